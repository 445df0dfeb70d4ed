"""`mtplx serve --learn DIR` as a real process, driven by the `openai` client: what the traffic log
records (prompt and completion ids, every choice, grammar and tools as such, the fingerprints), what
it leaves out (opt-outs, servers without the flag), the trainer's round between requests, `/metrics`,
a restart resuming the accepted head, the trainer pausing while a request is served, and greedy
output equal to plain AR whichever head drafts it.

The served model is a tiny random llama over a 97-character tokenizer (`support.tokenizer.
printable_chars`: small, so a server starts and a round trains in seconds) with a forged head
(`mtplx.forge.train.build_head`) for it, so the trainer has a head to learn. Requests ban the
tokenizer's EOS (id 0), so every answer is as long as asked whatever the random model prefers.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.forge.train import build_head
from mtplx.heads.forged import save_forged_head
from mtplx.learn.log import Record, tokenizer_fingerprint
from mtplx.learn.store import HeadStore
from mtplx.model_files.fingerprint import model_fingerprint
from mtplx.trunk.model import Trunk

import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import checkpoints, models
from support.server import KEY, running_server, wait_for
from support.tokenizer import printable_chars

AUTH = {"Authorization": f"Bearer {KEY}"}
NO_EOS = {"0": -100}  # printable_chars' EOS
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a function up.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, Path, str]:
    """(model dir, forged head dir, the trunk's fingerprint)."""
    root = tmp_path_factory.mktemp("learn-served")
    chars, vocab = printable_chars()
    model = models.tiny_llama(vocab, seed=0, hidden_size=32, tie_word_embeddings=False)
    model.model.embed_tokens.weight = mx.random.normal((vocab, 32), key=mx.random.key(1)) * 0.6
    model.lm_head.weight = mx.random.normal((vocab, 32), key=mx.random.key(2)) * 0.5
    mx.eval(model.parameters())
    path = checkpoints.save_model(root / "tiny-llama", model, eos_token_id=0).path
    chars.save_pretrained(str(path))
    from mtplx.checkpoints.load import load_model

    loaded = load_model(str(path))
    head = build_head(Trunk(loaded.model), "pre_norm")
    save_forged_head(root / "head", head, {"trunk_fingerprint": loaded.fingerprint, "depth_trained": 3})
    assert loaded.fingerprint == model_fingerprint(loaded.model)
    return path, root / "head", loaded.fingerprint


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _records(learn: Path) -> list[Record]:
    return [
        Record.from_json(json.loads(p.read_bytes())) for p in sorted((learn / "traffic").glob("rec-*.json"))
    ]


def _metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    values = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels == labels
    ]
    assert len(values) == 1, (name, values)
    return values[0]


def _ask(client: openai.OpenAI, text: str, **kw):
    return client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": text}],
        **{"max_tokens": 6, "temperature": 0.0, "logit_bias": NO_EOS, **kw},
    )


def _text(response) -> str:
    return response.choices[0].message.content


def _plain_ar(client: openai.OpenAI, text: str) -> str:
    """The greedy answer without drafting (no head at all), not logged."""
    return _text(_ask(client, text, extra_body={"num_draft_tokens": 0}, extra_headers={"X-Mtplx-Learn": "0"}))


def test_serve_learn_records_finished_requests_and_trains_between_them(served, tmp_path: Path) -> None:
    model_dir, head_dir, fingerprint = served
    learn = tmp_path / "learn"
    flags = ("--head", str(head_dir), "--depth", "2", "--learn", str(learn), "--learn-steps", "20")
    with running_server(model_dir, tmp_path / "server.log", *flags) as (base, log_path):
        client = _client(base)
        first = _ask(client, "what does the cache do")
        assert first.usage.completion_tokens == 6
        _ask(client, "not this one", extra_headers={"X-Mtplx-Learn": "0"})
        _ask(client, "nor this one", extra_body={"mtplx": {"learn": False}})
        two = _ask(client, "two answers", n=2, temperature=1.0, seed=3)
        _ask(client, "as json", response_format={"type": "json_object"}, max_tokens=4)
        records = _records(learn)
        assert len(records) == 3, [r.prompt[-5:] for r in records]  # the two opt-outs are not there
        plain, choices, constrained = records
        assert plain.trunk == fingerprint and plain.tokenizer == tokenizer_fingerprint(printable_chars()[0])
        asked = tuple(printable_chars()[0].encode("what does the cache do", add_special_tokens=False))
        assert any(plain.prompt[i : i + len(asked)] == asked for i in range(len(plain.prompt)))
        assert len(plain.choices[0].tokens) == 6 and plain.choices[0].finish == "length"
        assert [len(c.tokens) for c in choices.choices] == [6, 6] and two.choices[1].index == 1
        assert choices.choices[0].tokens != choices.choices[1].tokens  # each choice as sampled
        assert (plain.grammar, constrained.grammar) == (None, "response_format")
        for path in (learn / "traffic").iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        # Eight records start a round (--learn-every's default); it runs while the server is idle.
        for i in range(5):
            _ask(client, f"question number {i} about the cache")
        wait_for(lambda: _metric(base, "mtplx_learn_rounds_total") >= 1, timeout=120)
        assert _metric(base, "mtplx_learn_rounds_total") == 1
        assert _metric(base, "mtplx_learn_log_records") == 8
        assert (
            _metric(base, "mtplx_learn_head_version")
            == 1
            == _metric(base, "mtplx_learn_heads_accepted_total")
        )
        assert 0.0 < _metric(base, "mtplx_learn_trainer_share") < 1.0
        assert _metric(base, "mtplx_learn_round_in_progress") == 0
        # After the round (its long tool prompt would slow a round's steps): tool calls as such.
        _ask(client, "look it up", tools=TOOLS)
        tooled = _records(learn)[-1]
        assert (tooled.grammar, tooled.tools, plain.tools) == ("tools", True, False)
        # Greedy output is the trunk's, with the learned head drafting it as with the served one.
        again = _ask(client, "what does the cache do", extra_headers={"X-Mtplx-Learn": "0"})
        assert _text(again) == _text(first) == _plain_ar(client, "what does the cache do")
        assert _metric(base, "mtplx_learn_log_records") == 9
    assert "--learn: recording finished requests" in log_path.read_text()
    assert "head v1 swapped in" in log_path.read_text()
    state = HeadStore(learn).state()
    assert state["version"] == 1 and state["acceptance"]["first_draft"] > state["acceptance"]["before"]


def test_a_restart_resumes_the_learned_head_and_the_trainer_pauses_for_requests(
    served, tmp_path: Path
) -> None:
    """A head a previous run accepted is in use from the start; a round under way (one that would
    take far longer than this test: a million steps) waits while a request is served."""
    model_dir, head_dir, fingerprint = served
    from mtplx.checkpoints.load import load_model

    learned = build_head(Trunk(load_model(str(model_dir)).model), "pre_norm")
    learned.fc.weight = learned.fc.weight + 0.5  # not the served head: its drafts differ
    learn = tmp_path / "learn"
    HeadStore(learn).save(learned, {"trunk_fingerprint": fingerprint}, {"first_draft": 0.5, "before": 0.4})
    flags = ("--head", str(head_dir), "--depth", "2", "--learn", str(learn), "--learn-every", "2")
    with running_server(model_dir, tmp_path / "server.log", *flags, "--learn-steps", "1000000") as (
        base,
        log,
    ):
        assert "resumed with learned head v1" in log.read_text()
        assert _metric(base, "mtplx_learn_head_version") == 1
        assert _metric(base, "mtplx_learn_first_draft_acceptance", version="1") == 0.5
        client = _client(base)
        answer = _text(_ask(client, "what does the cache do"))
        assert answer == _plain_ar(client, "what does the cache do")  # exact with the learned head
        _ask(client, "and the log")  # the second record: a round starts
        wait_for(lambda: _metric(base, "mtplx_learn_round_in_progress") == 1, timeout=60)
        mid_round = _ask(client, "served while the round waits")
        assert mid_round.usage.completion_tokens == 6
        assert _metric(base, "mtplx_learn_requests_mid_round_total") == 1
        assert _metric(base, "mtplx_learn_round_in_progress") == 1  # it waited, and goes on
        assert _metric(base, "mtplx_learn_rounds_total") == 0
        assert _metric(base, "mtplx_learn_head_version") == 1


@pytest.mark.slow
def test_nothing_is_recorded_without_the_flag(served, tmp_path: Path) -> None:
    model_dir, head_dir, _ = served
    with running_server(model_dir, tmp_path / "server.log", "--head", str(head_dir)) as (base, _):
        _ask(_client(base), "hello")
        assert "mtplx_learn_rounds" not in httpx.get(base + "/metrics", headers=AUTH).text
    assert not any(p.name.startswith("rec-") for p in tmp_path.rglob("*"))
