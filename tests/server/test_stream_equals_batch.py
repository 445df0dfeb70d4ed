"""A stream and the server's batch draft with the same drafters (issue 51): the same seeded
request gives the same tokens and the same drafter counts through `mtplx generate` / `Engine.stream`
(a batch of one on a single-row decoder) as through `mtplx serve` (the continuous batch), with
``--adaptive`` (the head's confidence cut) and with a JSON-schema grammar. Before the one drafting
path they differed by construction (a stream's head masked every draft and stopped early; the
batch's masked the first and cut after the chain).

At depth 3: at depth 1 (the default model's tuned depth) the adaptive cut never shortens a block
(it keeps the first draft), so a stream that ignored ``--adaptive`` passed the comparison; at
depth 3 it is caught (checked by hand: the head chain's confidences dropped on single-row caches
fails the first test, its first draft unmasked on them fails the second)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI
from support.cli import run_main
from support.server import KEY, running_server

SAMPLING = dict(seed=11, temperature=0.7, max_tokens=40)  # room for the grammar test's JSON object
FREE_TOKENS = 24
DEPTH = 3  # the adaptive cut shortens blocks only past the first draft
FREE_PROMPT = "List the planets of the solar system, one per line, then list them again."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "moons": {"type": "integer"}},
    "required": ["name", "moons"],
}
SCHEMA_PROMPT = "Give the name and moon count of Mars as JSON."
MODEL_DIR: list = []  # the served model's directory (its id on the server)


@pytest.fixture(scope="module")
def adaptive_server(default_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("stream_batch") / "server.log"
    MODEL_DIR.append(default_model_dir)
    # Seeded requests draft their own depth every cycle under either draft policy (pinned); 'fixed'
    # spares the start measuring the default model's batch cost profile (seconds of CPU).
    flags = ("--adaptive", "--depth", str(DEPTH), "--draft-policy", "fixed")
    with running_server(default_model_dir, log, *flags) as (base, _):
        yield OpenAI(base_url=base + "/v1", api_key=KEY)


def _served(client, prompt: str, max_tokens: int = SAMPLING["max_tokens"], **extra) -> tuple[str, dict]:
    reply = client.chat.completions.create(
        model=str(MODEL_DIR[0]),
        messages=[{"role": "user", "content": prompt}],
        seed=SAMPLING["seed"],
        temperature=SAMPLING["temperature"],
        max_tokens=max_tokens,
        **extra,
    )
    stats = reply.model_extra["mtplx"]
    return reply.choices[0].message.content, stats


def test_generate_and_serve_agree_with_adaptive_drafting(adaptive_server, default_model_dir):
    # `mtplx generate` in this process (support.cli): the same command as a user's, without a Python start.
    out = run_main(
        *("generate", "--model", str(default_model_dir), FREE_PROMPT, "--json", "--adaptive"),
        *("--depth", str(DEPTH), "--seed", str(SAMPLING["seed"])),
        *("--temp", str(SAMPLING["temperature"]), "-m", str(FREE_TOKENS)),
    )
    assert out.returncode == 0, out.stderr
    streamed = json.loads(out.stdout)
    text, served = _served(adaptive_server, FREE_PROMPT, max_tokens=FREE_TOKENS)
    assert streamed["text"] == text
    for field in ("drafters", "drafted_per_position", "cycles"):
        assert streamed["stats"][field] == served[field], field
    assert served["drafters"]["head"]["drafted"] > 0
    cycles_drafting = served["drafted_per_position"]
    assert cycles_drafting[0] > cycles_drafting[-1]  # the adaptive cut shortened some blocks


def test_a_stream_and_serve_agree_under_a_grammar(adaptive_server, default_model_dir):
    from mtplx.engine.engine import Engine
    from mtplx.engine.grammar_spec import Grammar

    engine = Engine.load(str(default_model_dir), depth=DEPTH)
    chunks = list(
        engine.stream(
            [{"role": "user", "content": SCHEMA_PROMPT}],
            grammar=Grammar.json_schema(SCHEMA),
            adaptive=True,
            **SAMPLING,
        )
    )
    streamed_text = "".join(c.text for c in chunks)
    text, served = _served(
        adaptive_server,
        SCHEMA_PROMPT,
        response_format={"type": "json_schema", "json_schema": {"name": "moons", "schema": SCHEMA}},
    )
    assert streamed_text == text
    stats = chunks[-1].stats
    assert (stats.drafters, stats.drafted_per_position, stats.cycles) == (
        served["drafters"],
        served["drafted_per_position"],
        served["cycles"],
    )
    assert served["drafters"]["head"]["drafted"] > 0
    json.loads(text)  # the grammar held (max_tokens leaves room for the object)
