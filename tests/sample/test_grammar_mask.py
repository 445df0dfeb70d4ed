"""The grammar mask (stage 2b, docs/sampling.md): the oracle, the MLX ops and the fused kernels'
emulation agree on grammar-masked inputs, where most of every row is -inf and the rest is a few
allowed tokens (the existing tests mask 5% of a row at random; a grammar masks nearly all of it).

Masking is one stage before the filters, so every implementation gets masked logits and the
comparisons are the existing token-for-token ones (fragile rows skipped and bounded as there)."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import sampling
from mtplx.sample.ops import filtered_probs, mask_logits, sample
from mtplx.sample.reference import apply_grammar_mask
from mtplx.sample.rejection import verify
from mtplx.sampling import SamplerConfig, distribution_from_logits

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import SEEDS, resolve
from test_kernels import PARAMS, check_verify
from test_verify import CONFIGS, draw_drafts, fragile_verify_rows, kept_set_is_fragile, uniforms

VOCAB = 96


def grammar_masks(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """bool masks [..., V] allowing 1 to 8 tokens per row (a grammar's typical shape)."""
    masks = np.zeros(shape, dtype=bool)
    for index in np.ndindex(shape[:-1]):
        count = int(rng.integers(1, 9))
        masks[index + (rng.choice(shape[-1], count, replace=False),)] = True
    return masks


def logits_of(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.normal(scale=rng.choice([1.0, 3.0]), size=shape).astype(np.float32)


@pytest.mark.parametrize("seed", SEEDS)
def test_mask_logits_matches_the_oracle_stage(seed):
    rng = np.random.default_rng(resolve(seed))
    z, masks = logits_of(rng, (5, 3, VOCAB)), grammar_masks(rng, (5, 3, VOCAB))
    got = np.array(mask_logits(mx.array(z), mx.array(masks)))
    np.testing.assert_array_equal(got, apply_grammar_mask(z, masks))
    assert np.isneginf(got[~masks]).all() and np.isfinite(got[masks]).all()
    np.testing.assert_array_equal(np.array(mask_logits(mx.array(z), None)), z)  # no grammar: untouched


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", list(CONFIGS))
def test_masked_sampling_matches_the_oracles_constrained_distribution(seed, cfg_name):
    seed = resolve(seed)
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(seed)
    z, masks = logits_of(rng, (64, VOCAB)), grammar_masks(rng, (64, VOCAB))
    expected = distribution_from_logits(z, cfg, allowed=masks)  # the oracle's constrained chain
    assert (expected[~masks] == 0).all()
    masked = apply_grammar_mask(z, masks).astype(np.float32)
    u = uniforms(rng, (64,))
    expected_tokens, _ = sampling.sample_reference(masked, cfg, u)
    got = sample(mask_logits(mx.array(z), mx.array(masks)), cfg, mx.array(u), backend="mlx")
    fragile = np.array([kept_set_is_fragile(row, cfg) for row in masked])
    assert fragile.mean() < 0.1
    context = f"seed {seed}, cfg {cfg_name}"
    assert masks[np.arange(64), np.array(got.tokens)].all(), context  # never a disallowed token
    np.testing.assert_array_equal(np.array(got.tokens)[~fragile], expected_tokens[~fragile], err_msg=context)
    np.testing.assert_allclose(np.array(got.probs)[~fragile], expected[~fragile], rtol=1e-5, atol=1e-7)
    probs = np.array(filtered_probs(mask_logits(mx.array(z), mx.array(masks)), cfg))
    np.testing.assert_allclose(probs[~fragile], expected[~fragile], rtol=1e-5, atol=1e-7, err_msg=context)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cfg_name", ["temperature", "top_p", "all_filters", "greedy"])
def test_masked_verify_matches_the_reference(seed, cfg_name):
    """Target rows masked at every position, drafts from a masked q (legal) or point masses
    (some refused: p = 0 there), as the loop verifies them."""
    seed = resolve(seed)
    cfg = CONFIGS[cfg_name]
    rng = np.random.default_rng(seed)
    batch, depth = 48, int(rng.integers(1, 5))
    masks = grammar_masks(rng, (batch, depth + 1, VOCAB))
    target = apply_grammar_mask(logits_of(rng, (batch, depth + 1, VOCAB)), masks).astype(np.float32)
    for drafting in ("masked_q", "point_mass"):
        if drafting == "masked_q":
            draft_logits = logits_of(rng, (batch, depth, VOCAB))
            draft_probs = distribution_from_logits(
                draft_logits, CONFIGS["temperature"], allowed=masks[:, :depth]
            )
            draft_probs = draft_probs.astype(np.float32)
            drafts = draw_drafts(rng, draft_probs)
        else:
            draft_probs = None
            drafts = np.where(
                rng.random((batch, depth)) < 0.7,
                target[:, :depth].argmax(-1),
                rng.integers(0, VOCAB, (batch, depth)),
            )
        accept_u, sample_u = uniforms(rng, (batch, depth)), uniforms(rng, (batch,))
        expected = sampling.verify_reference(target, drafts, draft_probs, cfg, accept_u, sample_u)
        got = verify(
            mx.array(target),
            mx.array(drafts.astype(np.int32)),
            None if draft_probs is None else mx.array(draft_probs),
            cfg,
            mx.array(accept_u),
            mx.array(sample_u),
            backend="mlx",
        ).checked()
        robust = ~fragile_verify_rows(target, drafts, draft_probs, cfg, accept_u, sample_u)
        context = f"seed {seed}, cfg {cfg_name}, {drafting}, depth {depth}"
        assert robust.mean() > 0.9, context
        num_accepted, next_token = np.array(got.num_accepted), np.array(got.next_token)
        np.testing.assert_array_equal(num_accepted[robust], expected[0][robust], err_msg=context)
        np.testing.assert_array_equal(next_token[robust], expected[1][robust], err_msg=context)
        # Every committed token is allowed where it lands: accepted drafts and the next token.
        for b in range(batch):
            n = num_accepted[b]
            assert all(masks[b, i, drafts[b, i]] for i in range(n)) and masks[b, n, next_token[b]], context


def _kernel_case(rng, batch, depth, vocab, kinds, draft):
    """A fused-verify case (tests/sample/test_kernels.py) whose every row is grammar-masked."""
    masks = grammar_masks(rng, (batch, depth + 1, vocab))
    z = apply_grammar_mask(logits_of(rng, (batch, depth + 1, vocab)), masks).astype(np.float32)
    params = np.array([PARAMS[kinds[b % len(kinds)]] for b in range(batch)], np.float32)
    drafts = np.zeros((batch, depth), np.int32)
    q = None if draft == "onehot" else np.zeros((batch, depth, vocab), np.float32)
    for b in range(batch):
        for i in range(depth):
            if q is None:
                drafts[b, i] = int(np.argmax(z[b, i]))
            else:
                q64 = distribution_from_logits(
                    z[b, i] + rng.normal(size=vocab).astype(np.float32), SamplerConfig()
                )
                drafts[b, i] = rng.choice(vocab, p=q64)
                q[b, i] = q64.astype(np.float32)
    return z, drafts, q, params, uniforms(rng, (batch, depth)), uniforms(rng, (batch,))


@pytest.mark.parametrize("seed", SEEDS)
def test_kernel_emulation_matches_the_oracle_on_grammar_masked_rows(seed):
    seed = resolve(seed)
    rng = np.random.default_rng(seed)
    checked = skipped = 0
    for vocab, draft, kinds in [
        (37, "dense", ["plain", "top_p"]),
        (513, "onehot", ["all", "greedy", "min_p"]),
    ]:
        case = _kernel_case(rng, 3, int(rng.integers(1, 5)), vocab, kinds, draft)
        c, s = check_verify(case, tg=32)
        checked, skipped = checked + c, skipped + s
    assert checked >= 0.8 * (checked + skipped), f"seed {seed}: {skipped} of {checked + skipped} skipped"
