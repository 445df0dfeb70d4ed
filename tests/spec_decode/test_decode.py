"""The MTP loop against plain AR: identical greedy tokens, identical sampled distribution,
and caches equal to a from-scratch run after any accept/reject history."""

from __future__ import annotations

import os

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sampling import SamplerConfig
from mtplx.spec_decode import settings as decode
from mtplx.trunk import rollback as cache_ops

import mlx.core as mx
import pytest
from support.decoding import mtp_decode, sample_until_rollbacks
from support.exactness import (
    FALSE_FAILURE_RATE,
    PROMPT,
    assert_same_caches,
    exact_ar_joint,
    loop_p_value,
    plant_commit_rejected_draft,
    run_loop,
    run_mtp_steps,
    sample_counts,
)
from support.models import make_loop_pair

# ----------------------------------------------------------------------------- greedy


# Settings under which greedy runs see both accepted and rejected drafts.
GREEDY_MODELS = {
    "llama": dict(vocab_size=48, seed=0, context_strength=6.0, head_noise=2.0, family="llama"),
    "qwen3_5-hybrid": dict(vocab_size=48, seed=1, head_noise=0.5, family="qwen3_5"),
}


@pytest.mark.parametrize("model", list(GREEDY_MODELS))
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_greedy_mtp_output_is_token_identical_to_ar(model, depth, greedy_draft):
    trunk, head = make_loop_pair(**GREEDY_MODELS[model])
    cfg = SamplerConfig(temperature=0.0)
    ar = run_loop(trunk, head, cfg, None, 48, seed=0)
    mtp, stats = run_mtp_steps(trunk, head, cfg, depth, 48, greedy_draft=greedy_draft)
    assert mtp == ar
    accepted = [s.num_accepted for s in stats if s.num_drafted]
    # The comparison only means something if both accepts and rejections happened.
    assert any(a > 0 for a in accepted) and any(a < depth for a in accepted), accepted


# ------------------------------------------------------------------------ cache state


def assert_caches_match_a_from_scratch_run(depth: int, family: str = "llama") -> None:
    trunk, head = make_loop_pair(vocab_size=16, seed=7, family=family)
    cfg = SamplerConfig(temperature=1.0)
    trunk_cache, head_cache = trunk.make_cache(), head.make_cache()
    steps = mtp_decode(
        trunk,
        head,
        PROMPT,
        decode.DecodeSettings(sampler=cfg, depth=depth),
        mx.random.key(3),
        trunk_cache=trunk_cache,
        head_cache=head_cache,
    )
    generated, _ = sample_until_rollbacks(steps, 20)
    # Forwarded so far: the prompt and every generated token but the pending (last) one.
    committed = PROMPT + generated[:-1]
    attention = [c for c in trunk_cache if getattr(c, "keys", None) is not None]
    assert attention and all(c.offset == len(committed) for c in attention)

    fresh_cache = trunk.make_cache()
    reference = trunk(mx.array(committed)[None], fresh_cache)
    assert_same_caches(trunk_cache, fresh_cache)

    # The head has seen (true hidden i, token i+1) for every position before the
    # last cycle's start; the rest is caught up at the next cycle.
    head_len = head_cache[0].offset
    assert len(PROMPT) - 1 <= head_len <= len(committed) - 1
    fresh_head_cache = head.make_cache()
    head(
        reference.hidden_post_norm[:, :head_len],
        mx.array(committed[1 : head_len + 1])[None],
        fresh_head_cache,
    )
    assert_same_caches(head_cache, fresh_head_cache)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("depth", [2, 4])
def test_caches_after_cycles_equal_a_from_scratch_run(depth, family):
    assert_caches_match_a_from_scratch_run(depth, family)


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_cache_comparison_catches_a_loop_that_keeps_a_rejected_draft(monkeypatch, family):
    """Negative control: an off-by-one in the committed prefix is caught."""
    depth = 2
    honest_commit = cache_ops.commit_block
    monkeypatch.setattr(
        cache_ops,
        "commit_block",
        lambda cache, capture, num_keep: honest_commit(cache, capture, min(num_keep + 1, depth + 1)),
    )
    with pytest.raises(AssertionError):
        assert_caches_match_a_from_scratch_run(depth, family)


def test_cache_comparison_catches_a_stale_head_cache(monkeypatch):
    """Negative control: drafted (not true) hidden states left in the head's cache are caught."""
    monkeypatch.setattr(cache_ops, "trim_kv", lambda cache, n: None)
    with pytest.raises(AssertionError):
        assert_caches_match_a_from_scratch_run(3)


# ----------------------------------------------------------------- sampled distribution

# Peaked, context-dependent distributions: a loop bug moves the output distribution visibly.
CHI_SQUARE_MODEL = dict(vocab_size=5, seed=11, context_strength=6.0, head_noise=1.5, logit_scale=1.5)
HYBRID_CHI_SQUARE_MODEL = dict(vocab_size=5, seed=11, family="qwen3_5")
# The default suite runs the depth-3 top-p / top-k case; depth 1 at t 1.0 and the hybrid case run
# under `make test-slow` (the default suite keeps a gated-delta chi-square in test_batch).
CHI_SQUARE_CASES = [
    pytest.param(
        CHI_SQUARE_MODEL, 1, SamplerConfig(temperature=1.0), 1000, id="llama-d1-t1.0", marks=pytest.mark.slow
    ),
    pytest.param(
        CHI_SQUARE_MODEL,
        3,
        SamplerConfig(temperature=0.7, top_p=0.9, top_k=4),
        500,
        id="llama-d3-t0.7-topp-topk",
    ),
    pytest.param(
        CHI_SQUARE_MODEL,
        3,
        SamplerConfig(temperature=0.7, top_p=0.9, top_k=4),
        1000,
        id="llama-d3-t0.7-topp-topk-1000",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        HYBRID_CHI_SQUARE_MODEL,
        2,
        SamplerConfig(temperature=1.0),
        1000,
        id="hybrid-d2-t1.0",
        marks=pytest.mark.slow,
    ),
]
# Power (bootstrap from 2000-3000 samples of each bug, 2000 redraws per size): the loop that
# commits the rejected draft (the control below) and a head that reports a wrong q (uniform)
# both fail at p < 1e-6 in every redraw from 250 samples on (median p < 1e-18); the control at
# 250 samples, seeds 1000 / 2000 / 3000: see CONTROL_SAMPLES. In general, a bug that moves one
# output position's marginal by a chi-square divergence D = sum((p' - p)^2 / p) >= 66 / NUM_SAMPLES
# (0.13 at the default case's 500; 0.066 at the `slow` cases' 1000).
CONTROL_SAMPLES = 250


@pytest.mark.parametrize("model,depth,cfg,num_samples", CHI_SQUARE_CASES)
def test_mtp_sampled_distribution_matches_ar(model, depth, cfg, num_samples):
    trunk, head = make_loop_pair(**model)
    expected = exact_ar_joint(trunk, cfg, model["vocab_size"])
    seed0 = int.from_bytes(os.urandom(4), "little")
    counts = sample_counts(trunk, head, cfg, depth, num_samples, model["vocab_size"], seed0)
    p_value = loop_p_value(counts, expected)
    assert p_value > FALSE_FAILURE_RATE, f"p={p_value:.3g} (seed0={seed0})"


def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    """Negative control: an off-by-one in the committed prefix (drafts[:n+1] committed,
    i.e. the rejected draft kept instead of the correction token) must be caught by
    the same test. (A stale head cache cannot be caught this way: any q keeps the
    output exact; the cache tests above catch that one.)"""
    plant_commit_rejected_draft(monkeypatch)
    trunk, head = make_loop_pair(**CHI_SQUARE_MODEL)
    cfg = SamplerConfig(temperature=1.0)
    expected = exact_ar_joint(trunk, cfg, CHI_SQUARE_MODEL["vocab_size"])
    # 250 samples: the power bound above (p ~1e-90 at 500 samples, 2026-12-07).
    counts = sample_counts(trunk, head, cfg, 2, CONTROL_SAMPLES, CHI_SQUARE_MODEL["vocab_size"], 1234)
    assert loop_p_value(counts, expected) < FALSE_FAILURE_RATE


# ------------------------------------------------- checkpoint heads of each shipped family


# Depth 1 for every family and depth 3 for the hybrid in the default suite; the other depth-3
# cases (deepseek_v3 alone took 17 s) repeat them under `make test-slow`.
FAMILY_DEPTHS = [
    pytest.param(
        family,
        depth,
        id=f"{depth}-{family}",
        marks=[pytest.mark.slow] if depth == 3 and family != "qwen3_5" else [],
    )
    for depth in (1, 3)
    for family in ("qwen3_5", "deepseek_v3", "mimo", "glm4_moe")
]


@pytest.mark.parametrize("family,depth", FAMILY_DEPTHS)
def test_greedy_identity_with_each_familys_checkpoint_head(family, depth, tmp_path):
    """Tiny random checkpoints in real HF layout, head loaded through the user's code path.
    Decoded in float32: the glm4_moe replica is bfloat16 as published, and the CPU backend's
    GatherMM (its unquantized experts) is float32-only."""
    from mtplx.heads import load_head
    from mtplx.trunk.model import Trunk

    from mlx_lm.utils import load_model as mlx_load_model
    from support import checkpoints

    tiny = getattr(checkpoints, family)(tmp_path / family)
    model, config = mlx_load_model(tiny.path)
    model.set_dtype(mx.float32)
    trunk = Trunk(model)
    head = load_head(tiny.path, trunk, config)
    assert head is not None
    head.set_dtype(mx.float32)
    cfg = SamplerConfig(temperature=0.0)
    ar = run_loop(trunk, head, cfg, None, 32, seed=0)
    mtp, cycles = run_mtp_steps(trunk, head, cfg, depth, 32)
    assert mtp == ar
    assert any(s.num_drafted and s.num_accepted < depth for s in cycles)  # rollbacks happened
