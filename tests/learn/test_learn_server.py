"""`mtplx serve --learn DIR` as a real process, driven by the `openai` client: what the traffic log
records (prompt and completion ids, every choice, grammar and tools as such, the fingerprints), what
it leaves out (opt-outs, servers without the flag), the trainer's round between requests, `/metrics`,
and greedy output unchanged by learning.

The served model is a tiny random llama with the default model's tokenizer and a forged head
(`mtplx.forge.train.build_head`) for it, so the trainer has a head to learn.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.fingerprint import model_fingerprint
from mtplx.forge.train import build_head
from mtplx.heads.forged import save_forged_head
from mtplx.learn.log import Record, tokenizer_fingerprint
from mtplx.trunk.model import Trunk

import httpx
import mlx.core as mx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import checkpoints, models
from support.server import KEY, running_server, wait_for

VOCAB = 49152  # the default tokenizer's
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir) -> tuple[Path, Path, str]:
    """(model dir, forged head dir, the trunk's fingerprint)."""
    root = tmp_path_factory.mktemp("learn-served")
    model = models.tiny_llama(VOCAB, seed=0, hidden_size=32, tie_word_embeddings=False)
    model.lm_head.weight = mx.random.normal((VOCAB, 32), key=mx.random.key(2)) * 0.5
    mx.eval(model.parameters())
    path = checkpoints.save_model(root / "tiny-llama", model).path
    checkpoints.copy_tokenizer(default_model_dir, path)
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


def _metric(base: str, name: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    return {
        json.dumps(s.labels, sort_keys=True): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


def _ask(client: openai.OpenAI, text: str, **kw):
    return client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], **{"max_tokens": 6, "temperature": 0.0, **kw}
    )


def test_serve_learn_records_finished_requests_and_trains_between_them(served, tmp_path: Path) -> None:
    model_dir, head_dir, fingerprint = served
    learn = tmp_path / "learn"
    flags = ("--head", str(head_dir), "--depth", "2", "--learn", str(learn), "--learn-steps", "2")
    with running_server(model_dir, tmp_path / "server.log", *flags) as (base, log_path):
        client = _client(base)
        first = _ask(client, "what does the cache do")
        tokens = first.usage.completion_tokens
        _ask(client, "not this one", extra_headers={"X-Mtplx-Learn": "0"})
        _ask(client, "nor this one", extra_body={"mtplx": {"learn": False}})
        two = _ask(client, "two answers", n=2, temperature=1.0, seed=3)
        _ask(client, "as json", response_format={"type": "json_object"})
        records = _records(learn)
        assert len(records) == 3, [r.prompt[-5:] for r in records]  # the two opt-outs are not there
        plain, choices, constrained = records
        assert plain.trunk == fingerprint and plain.tokenizer == tokenizer_fingerprint(_tokenizer(model_dir))
        assert len(plain.choices[0].tokens) in (tokens, tokens + 1)  # + the EOS that ended it, if one did
        assert len(choices.choices) == 2 and [len(c.tokens) >= 1 for c in choices.choices] == [True, True]
        assert {c.tokens for c in choices.choices} != {()} and two.choices[1].index == 1
        assert (plain.grammar, constrained.grammar) == (None, "response_format")
        for path in (learn / "traffic").iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
        # Eight records start a round (--learn-every's default); it runs while the server is idle.
        for i in range(5):
            _ask(client, f"question number {i} about the cache")
        wait_for(lambda: _metric(base, "mtplx_learn_rounds_total").get("{}", 0) >= 1, timeout=120)
        assert _metric(base, "mtplx_learn_rounds_total")["{}"] == 1
        assert _metric(base, "mtplx_learn_log_records")["{}"] == 8
        version = _metric(base, "mtplx_learn_head_version")["{}"]
        assert version == _metric(base, "mtplx_learn_heads_accepted_total")["{}"]
        assert 0.0 < _metric(base, "mtplx_learn_trainer_share")["{}"] < 1.0
        # Greedy output is the trunk's, whichever head drafts it.
        again = _ask(client, "what does the cache do", extra_headers={"X-Mtplx-Learn": "0"})
        assert again.choices[0].message.content == first.choices[0].message.content
    log_text = log_path.read_text()
    assert "--learn: recording finished requests" in log_text
    assert ("head v1 swapped in" if version == 1 else "round 1 kept the head") in log_text


def test_nothing_is_recorded_without_the_flag(served, tmp_path: Path) -> None:
    model_dir, head_dir, _ = served
    with running_server(model_dir, tmp_path / "server.log", "--head", str(head_dir)) as (base, _):
        _ask(_client(base), "hello")
        assert "mtplx_learn_rounds" not in httpx.get(base + "/metrics", headers=AUTH).text
    assert not any(p.name.startswith("rec-") for p in tmp_path.rglob("*"))


def _tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
