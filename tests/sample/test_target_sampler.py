"""`TargetSampler`, the one composition of "constrain, then sample or verify", against the NumPy
oracle run stage by stage (penalties over the history and the drafts before each position, the
grammar mask, then `sample_reference` / `verify_reference`), on fixed and fresh seeds."""

from __future__ import annotations

import dataclasses

import mtplx.sample  # noqa: F401  (optimized BLAS before mlx)
from mtplx.sample import ops, rejection
from mtplx.sample.reference import apply_grammar_mask, apply_penalties, sample_reference, verify_reference
from mtplx.sample.target import target_sampler
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import SEEDS, resolve

VOCAB, ROWS, DEPTH = 24, 4, 3
CFG = SamplerConfig(
    temperature=0.8, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.5,
    logit_bias={3: 1.5, 7: -2.0},
)  # fmt: skip


def _case(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=2.0, size=(ROWS, DEPTH + 1, VOCAB)).astype(np.float32)
    # Rows of different lengths (left-padded in the batch); drafts repeat history tokens, so the
    # penalties at positions 1.. depend on the drafts before them.
    histories = [rng.integers(0, VOCAB, size=n).tolist() for n in (5, 9, 2, 12)]
    drafts = np.stack([rng.choice(h, size=DEPTH) for h in histories]).astype(np.int32)
    allowed = rng.random((ROWS, DEPTH + 1, VOCAB)) < 0.7
    allowed[np.arange(ROWS)[:, None], np.arange(DEPTH)[None], drafts] = True  # each draft legal
    # q mostly at the draft, so min(1, p/q) = p/q follows the penalties (not clipped at 1).
    at_draft = (np.arange(VOCAB) == drafts[..., None]).astype(np.float64)
    q = (0.1 * rng.dirichlet(np.ones(VOCAB), size=(ROWS, DEPTH)) + 0.9 * at_draft).astype(np.float32)
    return logits, histories, drafts, allowed, q


def _oracle_logits(logits, histories, drafts, allowed, positions: int) -> np.ndarray:
    """Each position's constrained logits: penalties over the history and the drafts before it,
    then the mask (the order docs/sampling.md gives)."""
    out = np.empty((ROWS, positions, VOCAB), dtype=np.float64)
    for b, history in enumerate(histories):
        for t in range(positions):
            context = list(history) + list(drafts[b, :t])
            out[b, t] = apply_grammar_mask(apply_penalties(logits[b, t], context, CFG), allowed[b, t])
    return out


@pytest.mark.parametrize("seed", SEEDS)
def test_first_token_and_verify_match_the_oracle_stage_by_stage(seed):
    seed = resolve(seed)
    logits, histories, drafts, allowed, q = _case(seed)
    rng = np.random.default_rng(seed + 1)
    accept_u = (1.0 - rng.random((ROWS, DEPTH))).astype(np.float32)
    sample_u = (1.0 - rng.random(ROWS)).astype(np.float32)
    sampler = target_sampler(CFG, "mlx")
    oracle = _oracle_logits(logits, histories, drafts, allowed, DEPTH + 1)

    first = sampler.first_token(
        mx.array(logits[:, 0]), histories, mx.array(sample_u), mx.array(allowed[:, 0])
    )
    first = first.checked()
    tokens, probs = sample_reference(oracle[:, 0].astype(np.float32), CFG, sample_u)
    assert np.array(first.tokens).tolist() == tokens.tolist(), f"seed {seed}"
    np.testing.assert_allclose(np.array(first.probs), probs, atol=2e-5, err_msg=f"seed {seed}")

    result = sampler.verify(
        mx.array(logits), histories, mx.array(drafts), mx.array(q), mx.array(accept_u), mx.array(sample_u),
        mx.array(allowed),
    ).checked()  # fmt: skip
    expected = verify_reference(oracle.astype(np.float32), drafts, q, CFG, accept_u, sample_u)
    assert np.array(result.num_accepted).tolist() == expected[0].tolist(), f"seed {seed}"
    assert np.array(result.next_token).tolist() == expected[1].tolist(), f"seed {seed}"
    np.testing.assert_allclose(np.array(result.accept_probs), expected[2], rtol=1e-4, err_msg=f"seed {seed}")


def test_the_oracle_comparison_sees_penalties_that_skip_the_drafts():
    """Negative control: a hand composition that penalizes every position by the history alone
    (the drafts before a position left out) gives other acceptance probabilities."""
    logits, histories, drafts, allowed, q = _case(0)
    accept_u, sample_u = np.full((ROWS, DEPTH), 0.5, np.float32), np.full(ROWS, 0.5, np.float32)
    no_drafts = mx.full((ROWS, DEPTH), -1, dtype=mx.int32)  # -1: padding, seen by no penalty
    constrained = ops.constrain_logits(mx.array(logits), CFG, histories, no_drafts, mx.array(allowed))
    wrong = rejection.verify(
        constrained, mx.array(drafts), mx.array(q), CFG, mx.array(accept_u), mx.array(sample_u), backend="mlx"
    )
    expected = verify_reference(
        _oracle_logits(logits, histories, drafts, allowed, DEPTH + 1).astype(np.float32),
        drafts, q, CFG, accept_u, sample_u,
    )  # fmt: skip
    assert not np.allclose(np.array(wrong.accept_probs), expected[2], rtol=1e-4)


def test_draft_takes_the_argmax_for_greedy_drafts_or_a_greedy_sampler():
    """The one greedy-draft rule: greedy drafts, or a greedy sampler, draft the constrained argmax
    as a point mass (q None, no flag); a sampled draft carries the q it was drawn from."""
    logits, histories, _, allowed, _ = _case(3)
    first, mask = mx.array(logits[:, 0]), mx.array(allowed[:, 0])
    oracle = _oracle_logits(logits, histories, np.zeros((ROWS, 0), np.int32), allowed, 1)[:, 0]
    for sampler in (
        target_sampler(CFG, greedy_draft=True),
        target_sampler(dataclasses.replace(CFG, temperature=0.0)),
    ):
        drawn = sampler.draft(first, histories, mx.ones((ROWS,)), mask)
        assert drawn.q is None and drawn.invalid is None
        assert np.array(drawn.tokens).tolist() == oracle.argmax(axis=1).tolist()
    drawn = target_sampler(CFG).draft(first, histories, mx.full((ROWS,), 0.5), mask)
    _, probs = sample_reference(oracle.astype(np.float32), CFG, np.full(ROWS, 0.5, np.float32))
    np.testing.assert_allclose(np.array(drawn.q), probs, atol=2e-5)
