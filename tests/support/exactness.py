"""The exactness checks the loop tests share: a fixed prompt, running the MTP and AR loops on
tiny models, the exact AR joint of the first tokens by enumeration (float64), and the chi-square
p-values that compare sampled counts with it (Bonferroni over the joint and each position)."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sampling import SamplerConfig, distribution_from_logits

import mlx.core as mx
import numpy as np
from scipy import stats as scipy_stats

from support import decoding as decode
from support.decoding import cache_arrays, mtp_decode, take_steps, take_tokens

PROMPT = [1, 2, 0, 2, 1, 0, 2]  # valid for every vocabulary size used here (>= 3)
FALSE_FAILURE_RATE = 1e-6


def run_mtp_steps(trunk, head, cfg: SamplerConfig, depth: int, n: int, **settings) -> tuple[list[int], list]:
    """The first n MTP tokens (greedy key 0) and every Step that produced them."""
    steps = mtp_decode(
        trunk, head, PROMPT, decode.DecodeSettings(sampler=cfg, depth=depth, **settings), mx.random.key(0)
    )
    return take_steps(steps, n)


def run_loop(trunk, head, cfg: SamplerConfig, depth: int | None, n: int, seed: int, **settings) -> list[int]:
    key = mx.random.key(seed)
    if depth is None:
        steps = decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=cfg, **settings), key)
    else:
        steps = mtp_decode(
            trunk, head, PROMPT, decode.DecodeSettings(sampler=cfg, depth=depth, **settings), key
        )
    return take_tokens(steps, n)


def assert_same_caches(actual, expected, rtol: float = 1e-7, atol: float = 5e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(cache_arrays(actual), cache_arrays(expected)):
        np.testing.assert_allclose(np.array(a), np.array(e), rtol=rtol, atol=atol)


NUM_OUTPUT_TOKENS = 3


def exact_ar_joint(trunk, cfg: SamplerConfig, vocab_size: int) -> np.ndarray:
    """P(first NUM_OUTPUT_TOKENS tokens) under AR sampling, by enumeration, float64."""
    prefixes: list[tuple[int, ...]] = [()]
    joint = {(): 1.0}
    for _ in range(NUM_OUTPUT_TOKENS):
        batch = mx.array([PROMPT + list(p) for p in prefixes])
        logits = np.array(trunk(batch, None).logits[:, -1, :].astype(mx.float32), dtype=np.float64)
        new_joint = {}
        for row, prefix in enumerate(prefixes):
            p = distribution_from_logits(logits[row], cfg)
            for t in range(vocab_size):
                new_joint[prefix + (t,)] = joint[prefix] * p[t]
        joint = new_joint
        prefixes = list(joint)
    table = np.zeros([vocab_size] * NUM_OUTPUT_TOKENS)
    for seq, prob in joint.items():
        table[seq] = prob
    return table


def chi_square_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Pearson chi-square; cells with expected count < 5 are pooled into one."""
    n = counts.sum()
    expected = expected_probs.reshape(-1) * n
    observed = counts.reshape(-1).astype(np.float64)
    small = expected < 5
    if small.any():
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token sequence with probability 0 was generated"
    if keep.sum() < 2:  # everything pooled into one cell: no test (chi2.sf would give NaN)
        return 1.0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    return float(scipy_stats.chi2.sf(statistic, keep.sum() - 1))


def loop_p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Bonferroni-combined p-value of the joint test and one test per output position.

    The per-position marginals have few cells, so they have the power to see a
    shifted distribution that the sparse joint table would miss.
    """
    axes = range(counts.ndim)
    tests = [(counts, expected_probs)] + [
        (
            counts.sum(axis=tuple(a for a in axes if a != j)),
            expected_probs.sum(axis=tuple(a for a in axes if a != j)),
        )
        for j in axes
    ]
    return min(1.0, len(tests) * min(chi_square_p_value(c, e) for c, e in tests))


def sample_counts(trunk, head, cfg, depth, num_samples, vocab_size, seed0) -> np.ndarray:
    counts = np.zeros([vocab_size] * NUM_OUTPUT_TOKENS, dtype=np.int64)
    for i in range(num_samples):
        tokens = run_loop(trunk, head, cfg, depth, NUM_OUTPUT_TOKENS, seed=seed0 + i)
        counts[tuple(tokens)] += 1
    return counts


def plant_commit_rejected_draft(monkeypatch) -> None:
    """The negative control the chi-square tests share: verification commits the rejected draft in
    place of the correction token (the output stays plausible text, its distribution is wrong)."""
    from mtplx.sample import rejection

    honest = rejection.verify

    def commit_rejected_draft(target_logits, draft_tokens, *args, **kwargs):
        result = honest(target_logits, draft_tokens, *args, **kwargs)
        k = draft_tokens.shape[1]
        rejected = draft_tokens[0, mx.minimum(result.num_accepted, k - 1)]
        return result._replace(next_token=mx.where(result.num_accepted < k, rejected, result.next_token))

    monkeypatch.setattr(rejection, "verify", commit_rejected_draft)
