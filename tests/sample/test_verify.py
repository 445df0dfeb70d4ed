"""The MLX verifier against its NumPy mirror, token for token, and against the target distribution."""

from __future__ import annotations

import dataclasses
import sys
import types

import mtplx.sample  # noqa: F401  (optimized BLAS before mlx)
from mtplx import sampling
from mtplx.errors import MtplxError
from mtplx.sample import filters as filters_module
from mtplx.sample.ops import (
    INVALID_DRAFTS,
    INVALID_LOGITS,
    draw_uniforms,
    filtered_probs,
    penalize_logits,
    sample,
)
from mtplx.sample.rejection import verify
from mtplx.sampling import SamplerConfig, distribution_from_logits, residual_distribution

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats
from support.seeds import FRESH, SEEDS, resolve

CONFIGS = {
    "temperature": SamplerConfig(temperature=1.0),
    "hot": SamplerConfig(temperature=1.9),
    "top_k": SamplerConfig(temperature=0.7, top_k=5),
    "top_p": SamplerConfig(top_p=0.8),
    "all_filters": SamplerConfig(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02),
    "min_p": SamplerConfig(min_p=0.1),
    "greedy": SamplerConfig(temperature=0.0),
}

# Relative size of the perturbation that separates a robust decision from a rounding tie.
TIE_TOLERANCE = 1e-5


def random_logits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    logits = rng.normal(scale=rng.choice([1.0, 3.0]), size=shape).astype(np.float32)
    logits[rng.random(shape) < 0.05] = -np.inf  # some masked tokens
    logits[..., 0] = np.maximum(logits[..., 0], -5.0)  # every row keeps a finite entry
    return logits


def perturbed_configs(cfg: SamplerConfig) -> list[SamplerConfig]:
    variants = []
    for factor in (1 - TIE_TOLERANCE, 1 + TIE_TOLERANCE):
        if cfg.top_p < 1.0:
            variants.append(dataclasses.replace(cfg, top_p=min(1.0, cfg.top_p * factor)))
        if cfg.min_p > 0.0:
            variants.append(dataclasses.replace(cfg, min_p=cfg.min_p * factor))
    return variants


def perturbed_uniforms(uniforms: np.ndarray) -> list[np.ndarray]:
    shifted = []
    for sign in (-1.0, 1.0):
        shifted.append(np.clip(uniforms * (1 + sign * TIE_TOLERANCE), 1e-30, 1.0))
        shifted.append(np.clip(uniforms + sign * TIE_TOLERANCE, 1e-30, 1.0))
    return shifted


def top_p_boundary_is_a_near_tie(logits: np.ndarray, cfg: SamplerConfig) -> bool:
    """True when the smallest kept and largest dropped weight differ by a rounding hair.

    float32 can round two such weights to the same value, and then keeps both.
    """
    if cfg.is_greedy or cfg.top_p >= 1.0:
        return False
    z = logits.astype(np.float64)
    without_top_p = sampling.filtered_weights(z, dataclasses.replace(cfg, top_p=1.0, min_p=0.0))
    kept = sampling.filtered_weights(z, dataclasses.replace(cfg, min_p=0.0)) > 0
    dropped = (without_top_p > 0) & ~kept
    if not dropped.any():
        return False
    smallest_kept, largest_dropped = without_top_p[kept].min(), without_top_p[dropped].max()
    return (smallest_kept - largest_dropped) <= TIE_TOLERANCE * smallest_kept


def kept_set_is_fragile(logits: np.ndarray, cfg: SamplerConfig) -> bool:
    """The filtered support changes under a nudge of top-p / min-p, or top-p ends on a near-tie."""
    kept = sampling.filtered_weights(logits.astype(np.float64), cfg) > 0
    for variant in perturbed_configs(cfg):
        if not np.array_equal(sampling.filtered_weights(logits.astype(np.float64), variant) > 0, kept):
            return True
    return top_p_boundary_is_a_near_tie(logits, cfg)


def fragile_verify_rows(target_logits, drafts, draft_probs, cfg, accept_u, sample_u) -> np.ndarray:
    """Rows whose reference decision changes under a TIE_TOLERANCE nudge of any threshold."""
    base = sampling.verify_reference(target_logits, drafts, draft_probs, cfg, accept_u, sample_u)
    fragile = np.zeros(target_logits.shape[0], dtype=bool)
    variants = [(cfg, a, sample_u) for a in perturbed_uniforms(accept_u)]
    variants += [(cfg, accept_u, s) for s in perturbed_uniforms(sample_u)]
    variants += [(c, accept_u, sample_u) for c in perturbed_configs(cfg)]
    for variant_cfg, a, s in variants:
        nudged = sampling.verify_reference(target_logits, drafts, draft_probs, variant_cfg, a, s)
        fragile |= (nudged[0] != base[0]) | (nudged[1] != base[1])
    for b in range(target_logits.shape[0]):
        fragile[b] |= any(kept_set_is_fragile(row, cfg) for row in target_logits[b])
    return fragile


def draw_drafts(rng: np.random.Generator, draft_probs: np.ndarray) -> np.ndarray:
    cumulative = np.cumsum(draft_probs.astype(np.float64), axis=-1)
    u = rng.random(draft_probs.shape[:-1] + (1,)) * cumulative[..., -1:]
    return np.minimum((cumulative < u).sum(axis=-1), draft_probs.shape[-1] - 1)


def uniforms(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (1.0 - rng.random(shape)).astype(np.float32)  # (0, 1]


# ----------------------------------------------------------------------------
# Token for token against the NumPy mirror
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("drafting", ["stochastic", "greedy"])
def test_verify_matches_reference_token_for_token(seed: int, cfg_name: str, drafting: str) -> None:
    seed = resolve(seed)
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(seed)
    batch, vocab_size = 48, 64
    depth = int(rng.integers(1, 5))
    target_logits = random_logits(rng, (batch, depth + 1, vocab_size))
    draft_logits = random_logits(rng, (batch, depth, vocab_size))
    draft_probs = None
    if drafting == "stochastic":
        draft_probs = distribution_from_logits(draft_logits, CONFIGS["all_filters"]).astype(np.float32)
        drafts = draw_drafts(rng, draft_probs)
    else:
        drafts = draft_logits.argmax(axis=-1)
    # Bias some drafts toward the target argmax so long accepted prefixes happen too.
    copy_argmax = rng.random((batch, depth)) < 0.5
    drafts = np.where(copy_argmax & (draft_probs is None), target_logits[:, :depth].argmax(-1), drafts)
    accept_u, sample_u = uniforms(rng, (batch, depth)), uniforms(rng, (batch,))

    expected = sampling.verify_reference(target_logits, drafts, draft_probs, cfg, accept_u, sample_u)
    got = verify(
        mx.array(target_logits),
        mx.array(drafts.astype(np.int32)),
        None if draft_probs is None else mx.array(draft_probs),
        cfg,
        mx.array(accept_u),
        mx.array(sample_u),
        backend="mlx",
    )
    fragile = fragile_verify_rows(target_logits, drafts, draft_probs, cfg, accept_u, sample_u)
    assert fragile.mean() < 0.1, f"seed {seed}: too many near-tie rows to mean anything"
    robust = ~fragile
    context = f"seed {seed}, cfg {cfg_name}, drafting {drafting}, depth {depth}"
    np.testing.assert_array_equal(np.array(got.num_accepted)[robust], expected[0][robust], err_msg=context)
    np.testing.assert_array_equal(np.array(got.next_token)[robust], expected[1][robust], err_msg=context)
    np.testing.assert_allclose(np.array(got.accept_probs), expected[2], rtol=2e-5, atol=1e-6, err_msg=context)
    assert got.num_accepted.dtype == mx.int32 and got.next_token.dtype == mx.int32


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_sample_and_filtered_probs_match_reference(seed: int, cfg_name: str) -> None:
    seed = resolve(seed)
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(seed)
    logits = random_logits(rng, (64, 50))
    u = uniforms(rng, (64,))
    expected_tokens, expected_probs = sampling.sample_reference(logits, cfg, u)
    got = sample(mx.array(logits), cfg, mx.array(u), backend="mlx")
    fragile = np.array([kept_set_is_fragile(row, cfg) for row in logits])
    for nudged in perturbed_uniforms(u):
        fragile |= sampling.sample_reference(logits, cfg, nudged)[0] != expected_tokens
    assert fragile.mean() < 0.1
    context = f"seed {seed}, cfg {cfg_name}"
    np.testing.assert_array_equal(np.array(got.tokens)[~fragile], expected_tokens[~fragile], err_msg=context)
    np.testing.assert_allclose(
        np.array(got.probs)[~fragile], expected_probs[~fragile], rtol=1e-5, atol=1e-7, err_msg=context
    )
    np.testing.assert_allclose(
        np.array(filtered_probs(mx.array(logits), cfg))[~fragile],
        expected_probs[~fragile],
        rtol=1e-5,
        atol=1e-7,
        err_msg=context,
    )


@pytest.mark.parametrize("queued", [False, True], ids=["sync_decided", "queued"])
@pytest.mark.parametrize("nucleus", ["second_pool", "bisection"])
def test_large_nucleus_top_p_matches_reference(nucleus: str, queued: bool, monkeypatch) -> None:
    """Nuclei beyond the first (256) and second (4096) candidate pools, with the fallbacks
    launched when a row needs them (the CPU policy) or queued for every row (the GPU policy)."""
    monkeypatch.setattr(filters_module, "_queue_top_p_fallbacks", lambda: queued)
    seed = resolve(FRESH)
    rng = np.random.default_rng(seed)
    vocab_size = 3000 if nucleus == "second_pool" else 9000
    logits = rng.normal(scale=0.5, size=(32, vocab_size)).astype(np.float32)
    cfg = SamplerConfig(top_p=0.9, top_k=0 if nucleus == "second_pool" else 8500)
    expected = distribution_from_logits(logits, cfg)
    assert (expected > 0).sum(axis=-1).min() > (256 if nucleus == "second_pool" else 4096)
    got = np.array(filtered_probs(mx.array(logits), cfg))
    fragile = np.array([kept_set_is_fragile(row, cfg) for row in logits])
    # Each of thousands of similar tokens holds ~1e-4 of the mass, so a 1e-5 nudge of top_p often
    # moves the boundary: many rows are near-ties. Enough are decided to compare.
    assert (~fragile).sum() >= 4, f"seed {seed}: too many near-tie rows"
    robust = ~fragile
    np.testing.assert_array_equal(got[robust] > 0, expected[robust] > 0, err_msg=f"seed {seed}")
    np.testing.assert_allclose(got[robust], expected[robust], rtol=1e-4, atol=1e-9)


def test_greedy_verify_known_values() -> None:
    # Row argmaxes: 2, 1, 3 (ties resolve to the lowest id: row 1 has 1 and 3 tied).
    logits = mx.array([[[0.0, 1.0, 5.0, 0.0], [0.0, 4.0, 0.0, 4.0], [0.0, 0.0, 0.0, 9.0]]])
    uniform_a, uniform_s = mx.array([[0.5, 0.5]]), mx.array([0.5])
    greedy = SamplerConfig(temperature=0)
    result = verify(logits, mx.array([[2, 1]]), None, greedy, uniform_a, uniform_s)
    assert (result.num_accepted.item(), result.next_token.item()) == (2, 3)
    result = verify(logits, mx.array([[2, 3]]), None, greedy, uniform_a, uniform_s)
    assert (result.num_accepted.item(), result.next_token.item()) == (1, 1)
    assert np.array(result.accept_probs).tolist() == [[1.0, 0.0]]


def test_stochastic_verify_known_values() -> None:
    # p0 = [0.5, 0.5, 0], q1 = [0.9, 0.1, 0]: accept 0 w.p. 5/9; residual is one-hot at 1.
    p_logits = np.log(np.array([[0.5, 0.5, 1e-30], [0.2, 0.3, 0.5]], dtype=np.float32))
    q = mx.array([[[0.9, 0.1, 0.0]]])
    args = dict(
        target_logits=mx.array(p_logits[None]),
        draft_tokens=mx.array([[0]]),
        draft_probs=q,
        cfg=SamplerConfig(),
    )
    rejected = verify(**args, accept_uniforms=mx.array([[0.6]]), sample_uniforms=mx.array([0.01]))
    assert (rejected.num_accepted.item(), rejected.next_token.item()) == (0, 1)
    assert abs(rejected.accept_probs.item() - 5 / 9) < 1e-6
    accepted = verify(**args, accept_uniforms=mx.array([[0.55]]), sample_uniforms=mx.array([0.6]))
    assert (accepted.num_accepted.item(), accepted.next_token.item()) == (1, 2)  # bonus from [0.2, 0.3, 0.5]


# ----------------------------------------------------------------------------
# Distribution: chi-square against the target, with negative controls
# ----------------------------------------------------------------------------

FALSE_FAILURE_RATE = 1e-7  # per test; well below the required 1e-6
CHI_SAMPLES = 120_000
CHI_CFG = SamplerConfig(temperature=0.9, top_k=5, top_p=0.95)
CHI_TARGET_LOGITS = np.array(
    [
        [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
        [0.0, 1.5, -1.0, 2.0, 0.3, 0.0],
        [1.0, 1.0, 1.0, -2.0, 0.0, 0.5],
        [-1.0, 0.0, 3.0, 0.0, 1.0, 0.2],
    ],
    dtype=np.float32,
)
CHI_DRAFT_LOGITS = np.array(
    [[-1.0, 0.5, 2.0, 1.0, 0.0, 0.3], [1.0, 0.0, 0.0, 0.5, 2.0, -1.0], [0.0, 2.0, 0.0, 1.0, -1.0, 1.0]],
    dtype=np.float32,
)


def chi_square_rejects(samples: np.ndarray, expected_probs: np.ndarray, false_failure_rate: float) -> bool:
    """Pearson goodness of fit; True when the samples are not drawn from expected_probs."""
    counts = np.bincount(samples, minlength=expected_probs.size)
    if counts[expected_probs == 0].any():
        return True  # a token the target can never produce
    support = expected_probs > 0
    expected_counts = samples.size * expected_probs[support]
    assert expected_counts.min() >= 20, "too few samples for the chi-square approximation"
    statistic = float(np.sum((counts[support] - expected_counts) ** 2 / expected_counts))
    degrees_of_freedom = int(support.sum()) - 1
    return degrees_of_freedom > 0 and statistic > stats.chi2.isf(false_failure_rate, degrees_of_freedom)


def chi_square_inputs(rng: np.random.Generator):
    depth = CHI_DRAFT_LOGITS.shape[0]
    q = distribution_from_logits(CHI_DRAFT_LOGITS, CHI_CFG)
    drafts = draw_drafts(rng, np.broadcast_to(q, (CHI_SAMPLES, depth, q.shape[-1])))
    accept_u, sample_u = uniforms(rng, (CHI_SAMPLES, depth)), uniforms(rng, (CHI_SAMPLES,))
    return q, drafts, accept_u, sample_u


def first_output_token(num_accepted: np.ndarray, next_token: np.ndarray, drafts: np.ndarray) -> np.ndarray:
    return np.where(num_accepted >= 1, drafts[:, 0], next_token)


def mlx_first_tokens(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q, drafts, accept_u, sample_u = chi_square_inputs(rng)
    target = mx.broadcast_to(mx.array(CHI_TARGET_LOGITS), (CHI_SAMPLES,) + CHI_TARGET_LOGITS.shape)
    draft_probs = mx.broadcast_to(mx.array(q.astype(np.float32)), (CHI_SAMPLES,) + q.shape)
    result = verify(
        target,
        mx.array(drafts.astype(np.int32)),
        draft_probs,
        CHI_CFG,
        mx.array(accept_u),
        mx.array(sample_u),
        backend="mlx",
    )
    num_accepted, next_token = np.array(result.num_accepted), np.array(result.next_token)
    return first_output_token(num_accepted, next_token, drafts), num_accepted, next_token


def wrong_verifier_first_tokens(rng: np.random.Generator, mistake: str) -> np.ndarray:
    """A one-step verifier with a deliberate mistake, vectorized in NumPy."""
    q_all, drafts, accept_u, sample_u = chi_square_inputs(rng)
    p, q = distribution_from_logits(CHI_TARGET_LOGITS[0], CHI_CFG), q_all[0]
    d = drafts[:, 0]
    if mistake == "resample_from_target":
        accepted, fallback = accept_u[:, 0] <= np.minimum(1.0, p[d] / q[d]), p
    elif mistake == "accept_if_p_at_least_q":
        accepted, fallback = p[d] >= q[d], residual_distribution(p, q)
    else:
        raise ValueError(mistake)
    redrawn = np.minimum(np.searchsorted(np.cumsum(fallback), sample_u), p.size - 1)
    return np.where(accepted, d, redrawn)


@pytest.mark.parametrize("seed", SEEDS)
def test_verify_output_distribution_is_the_target(seed: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    first_tokens, num_accepted, next_token = mlx_first_tokens(rng)
    p0 = distribution_from_logits(CHI_TARGET_LOGITS[0], CHI_CFG)
    assert not chi_square_rejects(first_tokens, p0, FALSE_FAILURE_RATE), f"seed {seed}"
    # The token after a full cycle (every draft accepted) is the bonus from the last target row.
    depth = CHI_DRAFT_LOGITS.shape[0]
    bonus = next_token[num_accepted == depth]
    p_last = distribution_from_logits(CHI_TARGET_LOGITS[depth], CHI_CFG)
    assert bonus.size > 2000
    assert not chi_square_rejects(bonus, p_last, FALSE_FAILURE_RATE), f"seed {seed}"


@pytest.mark.parametrize("mistake", ["resample_from_target", "accept_if_p_at_least_q"])
def test_chi_square_rejects_wrong_verifiers(mistake: str) -> None:
    """Negative control: the same test must catch a verifier that is subtly wrong."""
    seed = resolve(FRESH)
    rng = np.random.default_rng(seed)
    p0 = distribution_from_logits(CHI_TARGET_LOGITS[0], CHI_CFG)
    assert chi_square_rejects(wrong_verifier_first_tokens(rng, mistake), p0, FALSE_FAILURE_RATE), (
        f"seed {seed}: {mistake} was not detected"
    )


# ----------------------------------------------------------------------------
# Penalties, uniforms, reproducibility, errors, dispatch
# ----------------------------------------------------------------------------


def test_penalize_logits_without_penalties_returns_the_input() -> None:
    logits = mx.array(np.random.default_rng(0).normal(size=(2, 3, 10)).astype(np.float32))
    assert (
        penalize_logits(logits, mx.array([[1, 2], [3, 4]]), SamplerConfig(), mx.array([[1, 2], [3, 4]]))
        is logits
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_penalize_logits_matches_reference_per_position(seed: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    batch, positions, vocab_size = 3, 4, 12
    cfg = SamplerConfig(
        repetition_penalty=1.7,
        repetition_context_size=4,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        logit_bias={2: 1.5, 7: -0.5},
    )
    logits = rng.normal(scale=2.0, size=(batch, positions, vocab_size)).astype(np.float32)
    context = rng.integers(0, vocab_size, size=(batch, 6))
    context[1, :2] = -1  # left padding: sequence 1 has only 4 committed tokens
    block = rng.integers(0, vocab_size, size=(batch, positions - 1))
    got = np.array(
        penalize_logits(
            mx.array(logits), mx.array(context.astype(np.int32)), cfg, mx.array(block.astype(np.int32))
        )
    )
    for b in range(batch):
        committed = [int(token) for token in context[b] if token >= 0]
        for t in range(positions):
            expected = sampling.apply_penalties(logits[b, t], committed + block[b, :t].tolist(), cfg)
            np.testing.assert_allclose(
                got[b, t], expected, rtol=1e-6, atol=1e-6, err_msg=f"seed {seed} b {b} t {t}"
            )


def test_draw_uniforms_lie_in_half_open_interval_and_are_reproducible() -> None:
    values = np.array(draw_uniforms((100_000,)))
    assert values.min() > 0.0 and values.max() <= 1.0
    key = mx.random.key(42)
    np.testing.assert_array_equal(np.array(draw_uniforms((3, 4), key)), np.array(draw_uniforms((3, 4), key)))
    assert not np.array_equal(
        np.array(draw_uniforms((3, 4), key)), np.array(draw_uniforms((3, 4), mx.random.key(43)))
    )


def test_verify_is_reproducible_with_the_same_uniforms() -> None:
    rng = np.random.default_rng(3)
    target = mx.array(random_logits(rng, (8, 4, 40)))
    drafts = mx.array(rng.integers(0, 40, size=(8, 3)).astype(np.int32))
    key = mx.random.key(5)
    accept_key, sample_key = mx.random.split(key)
    runs = [
        verify(
            target,
            drafts,
            None,
            CONFIGS["all_filters"],
            draw_uniforms((8, 3), accept_key),
            draw_uniforms((8,), sample_key),
        )
        for _ in range(2)
    ]
    for first, second in zip(*runs):
        np.testing.assert_array_equal(np.array(first), np.array(second))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("cfg_name", ["temperature", "greedy"])
def test_nan_and_positive_inf_raise(bad: float, cfg_name: str) -> None:
    logits = np.zeros((2, 3, 5), dtype=np.float32)
    logits[1, 2, 3] = bad
    with pytest.raises(ValueError, match="NaN"):
        verify(
            mx.array(logits),
            mx.zeros((2, 2), dtype=mx.int32),
            None,
            CONFIGS[cfg_name],
            mx.ones((2, 2)),
            mx.ones((2,)),
            backend="mlx",
        ).checked()
    with pytest.raises(ValueError, match="NaN"):
        sample(mx.array(logits[:, 2]), CONFIGS[cfg_name], mx.ones((2,)), backend="mlx").checked()


@pytest.mark.parametrize("cfg_name", ["temperature", "greedy", "top_p"])
def test_invalid_inputs_are_flagged_lazily_not_synced(cfg_name: str) -> None:
    """verify/sample read no data: the flag is evaluated with the tokens, `.checked()` raises."""
    logits = np.zeros((1, 3, 5), dtype=np.float32)
    args = (mx.zeros((1, 2), dtype=mx.int32), None, CONFIGS[cfg_name], mx.ones((1, 2)), mx.ones((1,)))
    clean = verify(mx.array(logits), *args, backend="mlx")
    logits[0, 1, 2] = np.nan
    flagged = verify(mx.array(logits), *args, backend="mlx")  # no raise: nothing was read
    mx.eval(clean, flagged)
    assert clean.checked().invalid.item() == 0  # negative control: valid input passes
    assert flagged.invalid.item() & INVALID_LOGITS
    with pytest.raises(ValueError, match="NaN"):
        flagged.checked()
    out_of_range = verify(mx.zeros((1, 3, 5)), mx.array([[0, 7]]), *args[1:], backend="mlx")
    assert out_of_range.invalid.item() == INVALID_DRAFTS
    drawn = sample(mx.array(logits[:, 1]), CONFIGS[cfg_name], mx.ones((1,)), backend="mlx")
    assert drawn.invalid.item() == INVALID_LOGITS


def test_shape_token_and_backend_errors() -> None:
    target = mx.zeros((2, 3, 5))
    drafts, a, s = mx.zeros((2, 2), dtype=mx.int32), mx.ones((2, 2)), mx.ones((2,))
    cfg = SamplerConfig()
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(target, mx.zeros((2, 3), dtype=mx.int32), None, cfg, a, s, backend="mlx")
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(target, mx.array([[0, 5], [0, 0]]), None, cfg, a, s, backend="mlx").checked()
    with pytest.raises(ValueError, match="draft_probs"):
        verify(target, drafts, mx.ones((2, 2, 4)), cfg, a, s, backend="mlx")
    with pytest.raises(ValueError, match="accept_uniforms"):
        verify(target, drafts, None, cfg, mx.ones((2, 3)), s, backend="mlx")
    with pytest.raises(ValueError, match="sample_uniforms"):
        verify(target, drafts, None, cfg, a, mx.ones((3,)), backend="mlx")
    with pytest.raises(MtplxError, match="backend"):
        verify(target, drafts, None, cfg, a, s, backend="cuda")
    with pytest.raises(MtplxError, match="logit_bias"):
        penalize_logits(target, None, SamplerConfig(logit_bias={9: 1.0}))


def test_auto_backend_uses_a_fused_kernel_when_one_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_fused_verify(*args):
        calls.append(len(args))
        return "num_accepted", "next_token", "accept_probs"

    fake_kernels = types.ModuleType("mtplx.sample.kernels")
    fake_kernels.get_fused = lambda name: fake_fused_verify if name == "verify" else None
    monkeypatch.setitem(sys.modules, "mtplx.sample.kernels", fake_kernels)
    monkeypatch.setattr(mtplx.sample, "kernels", fake_kernels, raising=False)
    monkeypatch.setattr(filters_module, "_kernels_missing", False)
    target, drafts = mx.zeros((1, 2, 4)), mx.zeros((1, 1), dtype=mx.int32)
    fused = verify(target, drafts, None, SamplerConfig(), mx.ones((1, 1)), mx.ones((1,)))
    assert fused[:3] == ("num_accepted", "next_token", "accept_probs")
    assert calls == [6]
    mlx_result = verify(target, drafts, None, SamplerConfig(), mx.ones((1, 1)), mx.ones((1,)), backend="mlx")
    # Uniform p = 1/4 at the draft, u = 1: rejected; the residual's last token for u = 1.
    assert (mlx_result.num_accepted.item(), mlx_result.next_token.item()) == (0, 3) and calls == [6]
    # get_fused("sample") returns None: the MLX path runs.
    assert sample(mx.zeros((1, 4)), SamplerConfig(), mx.ones((1,))).tokens.item() == 3
