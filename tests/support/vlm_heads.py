"""What the tests of the families hosted through mlx-vlm share, one copy
(``tests/heads/test_{hy_v4,qwen4_exp,deepseek_v4,glm5_next}.py``, ``tests/trunk/test_vlm_*.py``):
a replica with its tokenizer, the decoding checks (rows of a batch = AR alone, with drafts kept
and rejected), the split drafter against the checkpoint's own head, and the t 0.7 chi-square
with its planted-bug control on a peaked 5-token trunk."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.request import GenerationRequest
from mtplx.sampling import SamplerConfig
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np

from support.exactness import (
    FALSE_FAILURE_RATE,
    exact_ar_joint,
    loop_p_value,
    plant_commit_rejected_draft,
    sample_counts,
)
from support.tokenizer import word_level

PROMPTS = ([3, 17, 42, 5, 60, 9, 11, 2, 33, 8], [50, 40, 30, 20, 10, 5], [7, 7, 12, 90, 4, 4, 31])
CHI_VOCAB = 5
CHI = SamplerConfig(temperature=0.7)
CHI_SAMPLES = 100  # the count with which the control catches a loop committing a rejected draft
_req = GenerationRequest.from_kwargs


def replica(path: Path, build: Callable, vocab: int, **kwargs) -> Path:
    """``build(path, **kwargs)`` (a `support.vlm_families` writer) with a word-level tokenizer beside it."""
    build(path, **kwargs)
    word_level(path, vocab)
    return path


def published_hidden(checkpoint: Path, tokens: list[int]) -> np.ndarray:
    """The trunk state mlx-vlm's own forward hands its drafter (``return_hidden``) at every
    position of ``tokens``: [T, D] float64 (hyper-connection streams flattened)."""
    from mlx_vlm.utils import load_model

    lm = load_model(checkpoint).language_model
    out = lm(mx.array([tokens]), cache=lm.make_cache(), return_hidden=True)
    return np.asarray(out.hidden_states[0][0], dtype=np.float64).reshape(len(tokens), -1)


def head_logits_on_trunk(engine, tokens: list[int]) -> np.ndarray:
    """mtplx's head on (its trunk's state at positions 0..T-2, tokens 1..T-1): logits [T-1, V] float64."""
    head, trunk = engine.head, engine.trunk
    out = trunk(mx.array([tokens[:-1]]), trunk.make_cache())
    hidden = getattr(out, f"hidden_{head.hidden_source}")
    return np.asarray(
        head.logits(head(hidden, mx.array([tokens[1:]]), head.make_cache()))[0], dtype=np.float64
    )


def max_abs_diff(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def lookup_prompt(vocab: int) -> list[int]:
    """Every token but EOS / BOS once, shuffled: whatever comes next recurs, so prompt lookup
    proposes what followed it (drafts kept and rejected)."""
    return np.random.default_rng(7).permutation(np.arange(2, vocab)).tolist()


def kept_and_rejected(stats) -> tuple[int, int]:
    """Drafts a request's stats say were kept and rejected."""
    made = sum(stats.drafted_per_position)
    kept = round(sum(a * d for a, d in zip(stats.acceptance_per_position, stats.drafted_per_position)))
    return kept, made - kept


def assert_batch_rows_equal_ar_with_rejections(engine, max_tokens: int, prompts=PROMPTS, **request) -> None:
    """Greedy head rows of ``generate_batch`` at depth 2 give each prompt's AR tokens alone, with
    drafts both kept and rejected among them (``request``: other `GenerationRequest` fields of
    every request, both runs)."""
    want = [
        engine.generate(p, replace(_req(max_tokens=max_tokens, draft="none"), **request)).token_ids
        for p in prompts
    ]
    requests = [replace(_req(max_tokens=max_tokens, draft="head", depth=2), **request) for _ in prompts]
    batched = engine.generate_batch(list(prompts), requests, max_rows=3, draft_policy="fixed")
    assert [b.token_ids for b in batched] == want
    kept, rejected = map(sum, zip(*(kept_and_rejected(b.stats) for b in batched)))
    assert kept > 0 and rejected > 0, (kept, rejected)


def assert_batched_rows_share_forwards_and_equal_ar(engine, monkeypatch, max_tokens: int, **request) -> None:
    """The engine's rows batch (`check_batch_support`) and `assert_batch_rows_equal_ar_with_rejections`
    holds with the three rows decoding in shared trunk forwards: at least 3 forwards of 3 rows are
    counted (a model decoding one request at a time forwards one row each time)."""
    from mtplx.spec_decode.rows import check_batch_support
    from mtplx.trunk.vlm_text import VlmTextModel

    assert check_batch_support(engine.trunk, engine.head) is None
    rows: list[int] = []
    forward = VlmTextModel.__call__

    def counted(self, inputs, *args, **kwargs):
        rows.append(inputs.shape[0])
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(VlmTextModel, "__call__", counted)
    assert_batch_rows_equal_ar_with_rejections(engine, max_tokens=max_tokens, **request)
    assert rows.count(len(PROMPTS)) >= 3, rows  # decode cycles of all three rows in one forward


def assert_split_head_equals_own(split_engine, own_engine, prompt: list[int]) -> None:
    """The split drafter's head and the checkpoint's own give the same logits on the same trunk
    state (the one the head reads) and next tokens."""
    head = split_engine.head
    hidden = getattr(split_engine.trunk(mx.array([prompt])), f"hidden_{head.hidden_source}")
    nxt = mx.array([prompt[1:] + [7]])
    split_out = head.logits(head(hidden, nxt, head.make_cache()))
    own = own_engine.head
    own_out = own.logits(own(hidden, nxt, own.make_cache()))
    assert mx.allclose(split_out, own_out, atol=1e-4).item()


# --------------------------------------------------------------------------- sampled distribution


def peaked_trunk(model) -> Trunk:
    """A tiny trunk (`mtplx.trunk.vlm_text.VlmTextModel`) with peaked, context-dependent
    distributions: embeddings x8, logits x3."""
    inner = model.language_model
    inner.model.embed_tokens.weight = inner.model.embed_tokens.weight * 8
    inner.lm_head.weight = inner.lm_head.weight * 3
    return Trunk(model)


def _p_value(trunk, head, seed0: int, num_samples: int = CHI_SAMPLES) -> float:
    """Depth 2: the first three tokens' joint and marginals against the float64 enumeration of AR sampling."""
    expected = exact_ar_joint(trunk, CHI, CHI_VOCAB)
    return loop_p_value(sample_counts(trunk, head, CHI, 2, num_samples, CHI_VOCAB, seed0), expected)


def assert_sampled_mtp_matches_ar(chi_pair: Callable) -> None:
    trunk, head = chi_pair()
    seed0 = int.from_bytes(os.urandom(4), "little")
    p = _p_value(trunk, head, seed0)
    assert p > FALSE_FAILURE_RATE, f"p={p:.3g} (seed0={seed0})"


def assert_chi_square_rejects_committed_rejected_drafts(monkeypatch, chi_pair: Callable) -> None:
    """The control: a loop that commits the rejected draft is caught at a quarter of the sample
    count (a gross bug: p ~1e-100 at the full count, 2026-12-07; the log-p scales with the count)."""
    plant_commit_rejected_draft(monkeypatch)
    trunk, head = chi_pair()
    assert _p_value(trunk, head, 1234, CHI_SAMPLES // 4) < FALSE_FAILURE_RATE
