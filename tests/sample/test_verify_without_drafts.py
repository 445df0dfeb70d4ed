"""verify with k = 0 (no drafts: a plain AR step) is sample of row 0, on every backend here.

Token for token against `ops.sample` with the same uniforms (ops path and the ``auto`` dispatch),
against the NumPy oracle (`sampling.sample_reference`; rows within rounding of a boundary, as
`support.kernel_ref` finds them, are skipped and counted), and the verify kernel body against the
sample kernel body under the CPU emulation; a chi-square against the oracle's distribution with
negative controls that it must catch.
"""

from __future__ import annotations

import dataclasses
import sys
import types

import mtplx.sample  # noqa: F401  (optimized BLAS before mlx)
from mtplx import sampling
from mtplx.sample import emulation
from mtplx.sample import filters as filters_module
from mtplx.sample.kernels import row_params
from mtplx.sample.ops import INVALID_LOGITS, penalize_logits, sample
from mtplx.sample.rejection import verify
from mtplx.sampling import SamplerConfig, distribution_from_logits

import mlx.core as mx
import numpy as np
import pytest
from support import kernel_ref
from support.exactness import chi_square_p_value
from support.seeds import FRESH, SEEDS, resolve

CONFIGS = {
    "temperature": SamplerConfig(temperature=1.0),
    "top_k": SamplerConfig(temperature=0.7, top_k=5),
    "top_p": SamplerConfig(top_p=0.8),
    "min_p": SamplerConfig(min_p=0.1),
    "all_filters": SamplerConfig(temperature=1.3, top_k=12, top_p=0.9, min_p=0.02),
    "greedy": SamplerConfig(temperature=0.0),
}
PENALIZED = {
    "sampled": SamplerConfig(
        temperature=0.8,
        top_k=20,
        repetition_penalty=1.4,
        repetition_context_size=6,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias={3: 2.5, 5: -1.0},
    ),
    "greedy": SamplerConfig(
        temperature=0.0, repetition_penalty=1.4, presence_penalty=0.5, logit_bias={3: 2.5}
    ),
}
MAX_BOUNDARY_SKIPS = 0.25  # share of rows within rounding of a boundary, above which a test means nothing


def random_logits(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    logits = (rng.normal(size=shape) * rng.choice([1.0, 3.0])).astype(np.float32)
    logits[rng.random(shape) < 0.05] = -np.inf  # some masked tokens
    logits[..., 0] = np.maximum(logits[..., 0], -5.0)  # every row keeps a finite entry
    return logits


def uniforms(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return (1.0 - rng.random(shape)).astype(np.float32)  # (0, 1]


def verify_without_drafts(
    target_logits: mx.array, cfg: SamplerConfig, sample_u: mx.array, backend: str, empty_q: bool = False
):
    """verify with k = 0: draft_tokens [B, 0], accept_uniforms [B, 0], draft_probs None or [B, 0, V]."""
    batch, _, vocab_size = target_logits.shape
    draft_probs = mx.zeros((batch, 0, vocab_size)) if empty_q else None
    drafts, accept_u = mx.zeros((batch, 0), dtype=mx.int32), mx.zeros((batch, 0))
    return verify(target_logits, drafts, draft_probs, cfg, accept_u, sample_u, backend=backend)


def boundary_rows(logits_rows: np.ndarray, cfg: SamplerConfig, sample_u: np.ndarray) -> np.ndarray:
    """Rows [N, V] whose token a float32 implementation may legitimately draw differently."""
    params = row_params(cfg, 1)[0]
    return np.array([kernel_ref.sample_row(row, params, u)[2] for row, u in zip(logits_rows, sample_u)])


def assert_matches_oracle(tokens: np.ndarray, rows: np.ndarray, cfg: SamplerConfig, sample_u, context: str):
    expected, _ = sampling.sample_reference(rows, cfg, sample_u)
    skipped = boundary_rows(rows, cfg, sample_u)
    assert skipped.mean() <= MAX_BOUNDARY_SKIPS, f"{context}: {skipped.sum()} boundary rows"
    np.testing.assert_array_equal(tokens[~skipped], expected[~skipped], err_msg=context)


def assert_plain_ar_step(result, batch: int, context: str) -> None:
    result.checked()
    assert np.array(result.num_accepted).tolist() == [0] * batch, context
    assert result.accept_probs.shape == (batch, 0) and result.accept_probs.dtype == mx.float32, context
    assert result.num_accepted.dtype == mx.int32 and result.next_token.dtype == mx.int32, context


# ----------------------------------------------------------------------------
# Token for token: sample, the oracle, the emulated kernels
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["mlx", "auto"])
def test_k0_verify_is_sample_token_for_token(seed: int, cfg_name: str, backend: str) -> None:
    seed = resolve(seed)
    cfg, rng = CONFIGS[cfg_name], np.random.default_rng(seed)
    batch, vocab_size = 48, int(rng.choice([50, 300, 1000]))
    logits, sample_u = random_logits(rng, (batch, 1, vocab_size)), uniforms(rng, (batch,))
    empty_q = bool(rng.random() < 0.5)
    context = f"seed {seed}, cfg {cfg_name}, backend {backend}, V {vocab_size}, empty q {empty_q}"
    got = verify_without_drafts(mx.array(logits), cfg, mx.array(sample_u), backend, empty_q)
    drawn = sample(mx.array(logits[:, 0]), cfg, mx.array(sample_u), backend=backend)
    assert_plain_ar_step(got, batch, context)
    tokens = np.array(got.next_token)
    np.testing.assert_array_equal(tokens, np.array(drawn.tokens), err_msg=context)
    assert_matches_oracle(tokens, logits[:, 0], cfg, sample_u, context)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", list(PENALIZED))
def test_k0_verify_with_penalties_is_the_penalized_sample(seed: int, cfg_name: str) -> None:
    """The penalties reach verify as they always do (penalize_logits over the block, here no drafts)."""
    seed = resolve(seed)
    cfg, rng = PENALIZED[cfg_name], np.random.default_rng(seed)
    batch, vocab_size = 24, 40
    logits, sample_u = random_logits(rng, (batch, 1, vocab_size)), uniforms(rng, (batch,))
    history = rng.integers(0, vocab_size, size=(batch, 10))
    history[: batch // 2, :3] = -1  # left padding: half the rows have 7 committed tokens
    penalized = penalize_logits(
        mx.array(logits), mx.array(history.astype(np.int32)), cfg, mx.zeros((batch, 0), dtype=mx.int32)
    )
    context = f"seed {seed}, cfg {cfg_name}"
    got = verify_without_drafts(penalized, cfg, mx.array(sample_u), "mlx")
    drawn = sample(penalized[:, 0], cfg, mx.array(sample_u), backend="mlx")
    assert_plain_ar_step(got, batch, context)
    tokens = np.array(got.next_token)
    np.testing.assert_array_equal(tokens, np.array(drawn.tokens), err_msg=context)
    oracle_rows = np.stack(
        [sampling.apply_penalties(logits[b, 0], [t for t in history[b] if t >= 0], cfg) for b in range(batch)]
    ).astype(np.float32)
    assert_matches_oracle(tokens, oracle_rows, cfg, sample_u, context)


@pytest.mark.parametrize("seed", SEEDS)
def test_oracle_k0_verify_is_sample_reference(seed: int) -> None:
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    batch, vocab_size = 32, 60
    logits, sample_u = random_logits(rng, (batch, 1, vocab_size)), uniforms(rng, (batch,))
    for cfg_name, cfg in CONFIGS.items():
        for draft_probs in (None, np.zeros((batch, 0, vocab_size))):
            num_accepted, next_token, accept_probs = sampling.verify_reference(
                logits, np.zeros((batch, 0), np.int64), draft_probs, cfg, np.zeros((batch, 0)), sample_u
            )
            context = f"seed {seed}, cfg {cfg_name}, q {'none' if draft_probs is None else '[B, 0, V]'}"
            assert num_accepted.tolist() == [0] * batch and accept_probs.shape == (batch, 0), context
            expected, _ = sampling.sample_reference(logits[:, 0], cfg, sample_u)
            np.testing.assert_array_equal(next_token, expected, err_msg=context)


@pytest.mark.parametrize("seed", SEEDS)
def test_emulated_verify_kernel_k0_is_the_sample_kernel(seed: int) -> None:
    """The verify body with K = 0 against the sample body (same filter and draw: equal on every row)
    and against the oracle on rows away from rounding boundaries."""
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    batch, vocab_size, tg = 6, int(rng.choice([37, 1000, 4099])), int(rng.choice([32, 64]))
    logits, sample_u = random_logits(rng, (batch, 1, vocab_size)), uniforms(rng, (batch,))
    cfgs = [CONFIGS[name] for name in rng.choice(list(CONFIGS), size=batch)]
    params = np.concatenate([row_params(cfg, 1) for cfg in cfgs])
    empty_q = np.zeros((batch, 0, vocab_size), np.float32) if rng.random() < 0.5 else None
    context = f"seed {seed}, V {vocab_size}, TG {tg}, params {params.tolist()}"
    num_accepted, tokens, accept_probs = emulation.emulate_verify(
        logits,
        np.zeros((batch, 0), np.int32),
        empty_q,
        params,
        np.zeros((batch, 0), np.float32),
        sample_u,
        tg=tg,
    )
    sampled, _ = emulation.emulate_sample(logits[:, 0], params, sample_u, tg=tg)
    assert num_accepted.tolist() == [0] * batch and accept_probs.shape == (batch, 0), context
    np.testing.assert_array_equal(tokens, sampled, err_msg=context)
    mirror = emulation.numpy_mirror_verify(
        logits, np.zeros((batch, 0), np.int32), empty_q, params, np.zeros((batch, 0)), sample_u
    )[1]
    skipped = np.array([kernel_ref.sample_row(logits[b, 0], params[b], sample_u[b])[2] for b in range(batch)])
    # As test_kernels.py bounds it over many rows; over 6 rows a fresh seed drew 2 (seed 2297872857).
    assert skipped.sum() <= batch // 2, f"{context}: {skipped.sum()} boundary rows"
    np.testing.assert_array_equal(tokens[~skipped], mirror[~skipped], err_msg=context)


# ----------------------------------------------------------------------------
# Distribution: chi-square against the oracle, with negative controls
# ----------------------------------------------------------------------------

CHI_ROWS = 60_000  # per logits row; two rows alternate along the batch
CHI_CFG = SamplerConfig(temperature=0.7, top_k=5, top_p=0.95)
CHI_LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 1.5, -1.0, 2.0, 0.3, 0.0]], dtype=np.float32)
FALSE_FAILURE_RATE = 1e-7


def chi_square_p_value_of(tokens: np.ndarray, probs: np.ndarray) -> float:
    """p-value that ``tokens`` were drawn from ``probs``; 0 when a token of probability 0 appears."""
    counts = np.bincount(tokens, minlength=probs.size)
    if counts[probs == 0].any():
        return 0.0
    return chi_square_p_value(counts, probs)


def k0_tokens_per_row(seed: int, mistake: str | None = None) -> list[np.ndarray]:
    """k = 0 verify on a batch alternating CHI_LOGITS rows; tokens split by the row they belong to.

    ``mistake`` plants a bug in what verify is given: "neighbour_row" draws every sequence from
    its neighbour's logits, "no_temperature" drops the temperature (T = 1)."""
    rng = np.random.default_rng(seed)
    rows = len(CHI_LOGITS)
    logits = np.tile(CHI_LOGITS, (CHI_ROWS, 1))  # sequence b has logits row b % rows
    cfg = CHI_CFG
    if mistake == "neighbour_row":
        logits = np.roll(logits, 1, axis=0)
    elif mistake == "no_temperature":
        cfg = dataclasses.replace(CHI_CFG, temperature=1.0)
    elif mistake is not None:
        raise ValueError(mistake)
    sample_u = uniforms(rng, (logits.shape[0],))
    result = verify_without_drafts(mx.array(logits[:, None, :]), cfg, mx.array(sample_u), "mlx").checked()
    tokens = np.array(result.next_token)
    return [tokens[r::rows] for r in range(rows)]


def k0_p_value(seed: int, mistake: str | None = None) -> float:
    """Bonferroni over the logits rows: the smallest per-row p-value times the number of rows."""
    per_row = k0_tokens_per_row(seed, mistake)
    expected = distribution_from_logits(CHI_LOGITS, CHI_CFG)
    return min(1.0, len(per_row) * min(chi_square_p_value_of(t, p) for t, p in zip(per_row, expected)))


@pytest.mark.parametrize("seed", SEEDS)
def test_k0_verify_tokens_follow_the_oracle_distribution(seed: int) -> None:
    seed = resolve(seed)
    p_value = k0_p_value(seed)
    assert p_value > FALSE_FAILURE_RATE, f"seed {seed}: p = {p_value:.3g}"


@pytest.mark.parametrize("mistake", ["neighbour_row", "no_temperature"])
def test_chi_square_catches_wrong_k0_draws(mistake: str) -> None:
    """Negative control: the same test must reject draws from the wrong row or without temperature."""
    seed = resolve(FRESH)
    p_value = k0_p_value(seed, mistake)
    assert p_value <= FALSE_FAILURE_RATE, f"seed {seed}: {mistake} not detected (p = {p_value:.3g})"


# ----------------------------------------------------------------------------
# Shapes, the invalid flag, dispatch
# ----------------------------------------------------------------------------


def test_k0_shape_errors_name_the_field() -> None:
    target, s, cfg = mx.zeros((2, 1, 5)), mx.ones((2,)), SamplerConfig()
    none, no_u = mx.zeros((2, 0), dtype=mx.int32), mx.zeros((2, 0))
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(target, mx.zeros((2, 1), dtype=mx.int32), None, cfg, no_u, s, backend="mlx")
    with pytest.raises(ValueError, match="accept_uniforms"):
        verify(target, none, None, cfg, mx.ones((2, 1)), s, backend="mlx")
    with pytest.raises(ValueError, match="draft_probs"):
        verify(target, none, mx.zeros((2, 1, 5)), cfg, no_u, s, backend="mlx")
    with pytest.raises(ValueError, match="sample_uniforms"):
        verify(target, none, None, cfg, no_u, mx.ones((3,)), backend="mlx")
    with pytest.raises(ValueError, match=r"target_logits must be \[B, k\+1, V\] with k >= 0"):
        verify(mx.zeros((2, 0, 5)), none, None, cfg, no_u, s, backend="mlx")
    with pytest.raises(ValueError, match="k >= 0"):
        sampling.verify_reference(
            np.zeros((2, 0, 5)), np.zeros((2, 0)), None, cfg, np.zeros((2, 0)), np.ones(2)
        )


@pytest.mark.parametrize("cfg_name", ["temperature", "greedy"])
def test_k0_invalid_logits_are_flagged_lazily(cfg_name: str) -> None:
    logits = np.zeros((2, 1, 5), dtype=np.float32)
    logits[1, 0, 2] = np.nan
    flagged = verify_without_drafts(mx.array(logits), CONFIGS[cfg_name], mx.ones((2,)), "mlx")  # no raise yet
    clean = verify_without_drafts(mx.zeros((2, 1, 5)), CONFIGS[cfg_name], mx.ones((2,)), "mlx")
    assert clean.invalid.item() == 0  # negative control: valid input passes
    assert flagged.invalid.item() == INVALID_LOGITS
    with pytest.raises(ValueError, match="NaN"):
        flagged.checked()


def test_k0_auto_dispatch_uses_the_fused_sample_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fused kernels present, k = 0 goes to the fused sample (as `sample` would), not to verify."""
    calls = []

    def fused(name):
        def run(*args):
            calls.append(name)
            return (mx.array([2], dtype=mx.int32), mx.zeros((1, 4))) if name == "sample" else ("verify",) * 3

        return run

    fake_kernels = types.ModuleType("mtplx.sample.kernels")
    fake_kernels.get_fused = fused
    monkeypatch.setitem(sys.modules, "mtplx.sample.kernels", fake_kernels)
    monkeypatch.setattr(mtplx.sample, "kernels", fake_kernels, raising=False)
    monkeypatch.setattr(filters_module, "_kernels_missing", False)
    result = verify_without_drafts(mx.zeros((1, 1, 4)), SamplerConfig(), mx.ones((1,)), "auto")
    assert calls == ["sample"] and result.next_token.item() == 2 and result.num_accepted.item() == 0
    # backend="mlx" never reaches a fused kernel: uniform p, u = 1 draws the last token.
    assert (
        verify_without_drafts(mx.zeros((1, 1, 4)), SamplerConfig(), mx.ones((1,)), "mlx").next_token.item()
        == 3
    )
    assert calls == ["sample"]
