"""Speculative decoding on a quantized KV cache (`--kv-bits`, `mtplx.trunk.kv_quant`) equals plain
decoding with the same flags: greedy token for token (blocks rejected, blocks crossing
``quantized_kv_start``), sampled in distribution (chi-square against the float64 oracle's exact
AR joint of the quantized model), and both catch a quantized cache that is not rolled back.

Loop pairs (`support.models.make_loop_pair`) with one attention head of dimension 32, the
smallest group size quantization takes; the single-row decoder (`spec_decode.loop`).
"""

from __future__ import annotations

import os

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sampling import SamplerConfig, distribution_from_logits
from mtplx.trunk import rollback
from mtplx.trunk.kv_quant import KVQuantization

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from support import decoding as decode
from support.decoding import mtp_decode, take_steps
from support.exactness import FALSE_FAILURE_RATE, NUM_OUTPUT_TOKENS, PROMPT, loop_p_value, run_loop
from support.models import make_loop_pair

GROUP = 32
GREEDY_MODEL = dict(vocab_size=32, seed=5, context_strength=3.0, head_noise=1.0, num_heads=1)
# Context-heavy (strong attention output, sharpened queries and keys: what the cache holds moves
# the distribution) and a noisy head (the first cycle is often rejected whole).
CHI_SQUARE_MODEL = dict(
    vocab_size=5, seed=11, context_strength=12.0, head_noise=6.0, logit_scale=1.5, num_heads=1
)
SHARPEN = 4.0
NUM_TOKENS = 40


def _greedy(trunk, head, depth: int | None) -> tuple[list[int], list]:
    settings = decode.DecodeSettings(sampler=SamplerConfig(temperature=0.0), depth=depth or 1)
    if depth is None:
        steps = decode.ar_decode(trunk, PROMPT, settings, mx.random.key(0))
    else:
        steps = mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0))
    return take_steps(steps, NUM_TOKENS)


def _crossing_blocks(steps: list, start: int) -> int:
    """Verify blocks whose positions [pending, d1..dk] run across ``start``."""
    crossing, held = 0, len(PROMPT) + len(steps[0].tokens)  # positions known: prompt and tokens
    for step in steps[1:]:
        pending = held - 1  # the last token, forwarded first in the block
        crossing += pending < start <= pending + step.num_drafted
        held += len(step.tokens)
    return crossing


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("start", [0, len(PROMPT) + 6])
def test_greedy_mtp_equals_ar_with_the_same_kv_bits(bits, start):
    """Depth 3 with drafts rejected (and, with a later start, a block crossing it): MTP gives AR's
    tokens on the same quantized cache."""
    trunk, head = make_loop_pair(**GREEDY_MODEL)
    trunk.kv_quantization = KVQuantization(bits, GROUP, start)
    ar, _ = _greedy(trunk, head, None)
    mtp, steps = _greedy(trunk, head, 3)
    assert mtp == ar
    assert any(s.num_accepted < s.num_drafted for s in steps), "no draft was rejected"
    if start:
        assert _crossing_blocks(steps, start) > 0, "no verify block crossed quantized_kv_start"


def test_greedy_comparison_catches_a_quantized_cache_not_rolled_back(monkeypatch):
    """Negative control: rejected drafts left in a QuantizedKVCache change MTP's tokens."""
    trunk, head = make_loop_pair(**GREEDY_MODEL)
    trunk.kv_quantization = KVQuantization(4, GROUP, 0)
    ar, _ = _greedy(trunk, head, None)
    _keep_quantized_rejections(monkeypatch)
    mtp, _ = _greedy(trunk, head, 3)
    assert mtp != ar


def _keep_quantized_rejections(monkeypatch) -> None:
    honest = rollback._KVRecord.commit

    def commit(self, num_keep: int, block_len: int) -> None:
        if type(self.cache) is not QuantizedKVCache:
            honest(self, num_keep, block_len)

    monkeypatch.setattr(rollback._KVRecord, "commit", commit)


# ----------------------------------------------------------------- sampled distribution


def quantized_ar_joint(trunk, cfg: SamplerConfig, plan: KVQuantization, vocab_size: int) -> np.ndarray:
    """P(first NUM_OUTPUT_TOKENS tokens) of AR sampling on the quantized model, by enumeration
    (float64 oracle): every prefix forwarded from scratch by mlx-lm's model on mlx-lm's
    QuantizedKVCache (start 0: every position quantized), none of mtplx's cycle or caches."""
    prefixes: list[tuple[int, ...]] = [()]
    joint = {(): 1.0}
    for _ in range(NUM_OUTPUT_TOKENS):
        batch = mx.array([PROMPT + list(p) for p in prefixes])
        cache = [QuantizedKVCache(group_size=plan.group_size, bits=plan.bits) for _ in trunk.model.layers]
        logits = np.array(trunk.model(batch, cache=cache)[:, -1, :].astype(mx.float32), dtype=np.float64)
        new_joint = {}
        for row, prefix in enumerate(prefixes):
            p = distribution_from_logits(logits[row], cfg)
            for t in range(vocab_size):
                new_joint[prefix + (t,)] = joint[prefix] * p[t]
        joint, prefixes = new_joint, list(new_joint)
    table = np.zeros([vocab_size] * NUM_OUTPUT_TOKENS)
    for seq, prob in joint.items():
        table[seq] = prob
    return table


def kv_sensitive_pair(plan: KVQuantization):
    trunk, head = make_loop_pair(**CHI_SQUARE_MODEL)
    for layer in trunk.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * SHARPEN
        layer.self_attn.k_proj.weight = layer.self_attn.k_proj.weight * SHARPEN
    mx.eval(trunk.model.parameters())
    trunk.kv_quantization = plan
    return trunk, head


def _counts(trunk, head, cfg, depth: int, num_samples: int, seed0: int) -> np.ndarray:
    vocab = CHI_SQUARE_MODEL["vocab_size"]
    counts = np.zeros([vocab] * NUM_OUTPUT_TOKENS, dtype=np.int64)
    for i in range(num_samples):
        counts[tuple(run_loop(trunk, head, cfg, depth, NUM_OUTPUT_TOKENS, seed=seed0 + i))] += 1
    return counts


# Power: the control below (a QuantizedKVCache keeping rejected drafts) measured p = 9e-15 at 600
# samples (p = 3e-6 at 300); the first cycle's rejected drafts move the third token's distribution.
NUM_SAMPLES = 600


@pytest.mark.parametrize(
    "bits,depth,cfg,num_samples",
    [
        pytest.param(4, 2, SamplerConfig(temperature=1.0), 600, id="4bit-d2-t1.0"),
        pytest.param(
            8,
            3,
            SamplerConfig(temperature=0.7, top_p=0.9),
            400,
            id="8bit-d3-t0.7-topp",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_mtp_sampled_distribution_matches_the_quantized_models_ar(bits, depth, cfg, num_samples):
    plan = KVQuantization(bits, GROUP, 0)
    trunk, head = kv_sensitive_pair(plan)
    expected = quantized_ar_joint(trunk, cfg, plan, CHI_SQUARE_MODEL["vocab_size"])
    seed0 = int.from_bytes(os.urandom(4), "little")
    p_value = loop_p_value(_counts(trunk, head, cfg, depth, num_samples, seed0), expected)
    assert p_value > FALSE_FAILURE_RATE, f"p={p_value:.3g} (seed0={seed0})"


def test_chi_square_catches_a_quantized_cache_not_rolled_back(monkeypatch):
    """Negative control: the same test on a loop whose QuantizedKVCache keeps rejected drafts."""
    plan = KVQuantization(4, GROUP, 0)
    trunk, head = kv_sensitive_pair(plan)
    cfg = SamplerConfig(temperature=1.0)
    expected = quantized_ar_joint(trunk, cfg, plan, CHI_SQUARE_MODEL["vocab_size"])
    _keep_quantized_rejections(monkeypatch)
    counts = _counts(trunk, head, cfg, 2, NUM_SAMPLES, 1234)
    assert loop_p_value(counts, expected) < FALSE_FAILURE_RATE
