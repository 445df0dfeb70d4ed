"""`mtplx serve` over a family hosted through mlx-vlm (issue 53, every entry): DeepSeek-V4's tiny
replica with its MTP head (hyper-connection streams, mlx-vlm's own window and pool caches), a
character tokenizer so grammar rows can write JSON. Requests sent together (free rows drafting
with the head, a JSON-schema grammar row, a seeded n = 2 request) give what each gives sent
alone: the scheduler decodes such a model's rows in one batch (`mtplx.trunk.batch_deepseek_v4`:
its window and pool caches as ragged rows, each rolled back to its own count), so a row gives
the same tokens in company as alone."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI
from support.server import KEY, running_server
from support.tokenizer import printable_level
from support.vlm_families import DEEPSEEK_V4_VOCAB, deepseek_v4

SCHEMA = {"enum": ["yes", "no"]}
REQUESTS = {
    "free": dict(
        messages=[{"role": "user", "content": "Name three planets."}], max_tokens=8, temperature=0.0
    ),
    "other": dict(messages=[{"role": "user", "content": "Count: 1 2 3"}], max_tokens=8, temperature=0.0),
    "grammar": dict(
        messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=8,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    ),
    "n2": dict(messages=[{"role": "user", "content": "Go."}], max_tokens=6, temperature=0.7, seed=5, n=2),
}


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_vlm") / "DeepSeek-V4-Tiny"
    deepseek_v4(path, context_strength=0.1)
    printable_level(path, DEEPSEEK_V4_VOCAB)
    return path


def _llama3_rope(path: Path) -> Path:
    """A tiny mlx-lm llama with Llama-3 rope scaling (its ``Llama3RoPE`` keeps ``_freqs``)."""
    from support.checkpoints import save_model
    from support.models import tiny_llama
    from support.tokenizer import word_level

    model = tiny_llama()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    save_model(path, model, rope_scaling={**scaling, "original_max_position_embeddings": 64})
    word_level(path, model.args.vocab_size)
    return path


@pytest.mark.parametrize("which", ["deepseek_v4_head", "llama3_rope"])
def test_an_engine_loaded_on_one_thread_decodes_on_another(which, replica, tmp_path):
    """As the server does (it loads on the main thread, decodes on its worker's): every array the
    trunk and head hold is evaluated at load, their private ones too (the DeepSeek-V4 head block's
    and a Llama-3 trunk's RoPE frequencies were not: "There is no Stream(cpu, 0) in current
    thread" on the first request)."""
    from mtplx.engine.engine import Engine

    if which == "deepseek_v4_head":
        engine, draft = Engine.load(str(replica), depth=2), "head"
    else:
        engine, draft = Engine.load(str(_llama3_rope(tmp_path / "llama3")), mtp=False), "none"
    results: list = []
    worker = threading.Thread(
        target=lambda: results.append(engine.generate([3, 4, 5], max_tokens=3, draft=draft))
    )
    worker.start()
    worker.join(timeout=120)
    assert results and len(results[0].token_ids) > 0
    if draft == "head":
        assert results[0].stats.drafters["head"]["drafted"] > 0


def test_a_grammar_row_among_head_rows_in_a_batch_gives_what_each_gives_alone(replica):
    """The scheduler behind `mtplx serve`, in process: head rows and a JSON-schema grammar row
    decoded together give each one's tokens alone, and the grammar holds."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.grammar_spec import Grammar
    from mtplx.engine.request import GenerationRequest

    engine = Engine.load(str(replica), depth=2)
    names = ("free", "grammar")
    prompts = [REQUESTS[name]["messages"] for name in names]
    requests = [
        GenerationRequest.from_kwargs(
            max_tokens=8,
            draft="head",
            depth=2,
            grammar=Grammar.json_schema(SCHEMA) if name == "grammar" else None,
        )
        for name in names
    ]
    alone = [engine.generate(p, r) for p, r in zip(prompts, requests)]
    together = engine.generate_batch(prompts, requests, max_rows=3, draft_policy="fixed")
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert json.loads(together[1].text) in SCHEMA["enum"]
    assert together[0].stats.drafters["head"]["drafted"] > 0


@pytest.fixture(scope="module")
def served(replica):
    path = replica
    # fixed drafting: under "auto" a row alone and the same row among others may draft differently
    # (the cost of a cycle depends on its rows), and the stats are compared too
    with running_server(path, path.parent / "server.log", "--depth", "2", "--draft-policy", "fixed") as (
        base,
        _,
    ):
        yield OpenAI(base_url=base + "/v1", api_key=KEY), str(path)


def _ask(served, name: str) -> tuple[list[str], dict]:
    client, model = served
    reply = client.chat.completions.create(model=model, **REQUESTS[name])
    return [c.message.content for c in reply.choices], reply.model_extra["mtplx"]["drafters"]


@pytest.mark.slow  # a server process (~10 s); the thread test above and the generate_batch rows in
# tests/heads/test_deepseek_v4.py run in every make test
def test_rows_sent_together_give_what_each_gives_alone(served):
    alone = {name: _ask(served, name) for name in REQUESTS}
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        together = dict(zip(REQUESTS, pool.map(lambda name: _ask(served, name), REQUESTS)))
    assert together == alone
    assert alone["free"][1]["head"]["drafted"] > 0  # the head drafted
    assert len(alone["n2"][0]) == 2
    assert json.loads(alone["grammar"][0][0]) in SCHEMA["enum"]  # the grammar held
