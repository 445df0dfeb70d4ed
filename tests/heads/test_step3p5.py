"""Step-3.5-Flash's MTP layout (``heads/step3p5.py``) on a tiny replica in the published layout:
three MTP layers at ``model.layers.{2 + i}`` (``enorm``, ``hnorm``, ``eh_proj``, the block at the
prefix, ``transformer.shared_head.{norm,output}``), every norm stored as an offset from 1, beside a
``step3p5`` trunk (vocabulary 32, hidden 64, a full and a sliding-window layer, window 4, MoE
under ``.moe.``).

The head's own math (no position-0 mask, offset norms, embedding first, its own LM head) against a
NumPy float64 reference around the block, with a negative control per convention; then: loads
with sliding-window caches, greedy MTP equals greedy AR at depths 1-3 with drafts kept while the
windows wrap, `inspect` says MTP-ready, and `mtplx convert` keeps the head.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.inspect import inspect_model
from mtplx.heads import load_head
from mtplx.heads.base import build_layer_like, model_args_of
from mtplx.sampling import SamplerConfig
from mtplx.spec_decode import loop as decode
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support.decoding import mtp_decode, take_steps, take_tokens
from support.seeds import SEEDS, resolve
from support.tokenizer import word_level

PROMPT = [3, 17, 22, 5, 30, 9, 11, 2, 13, 8]  # longer than the window (4)
GREEDY = SamplerConfig(temperature=0.0)
P = "model.layers.2."  # the first MTP layer


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = tmp_path_factory.mktemp("step3p5") / "tiny"
    tiny = checkpoints.step3p5(path, context_strength=0.5)
    word_level(path)
    return tiny, load(path)


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_logits(
    tiny, trunk, hidden: np.ndarray, tokens: list[int], *, offsets=True, mask_first=False, own_head=True
) -> np.ndarray:
    """float64: e = embed(tokens), x = W [enorm(e), hnorm(h)] (norms x * (1 + w)), block(x) (MLX,
    its stored norms + 1), shared_head.norm, the layer's own ``output`` matrix."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tiny.tensors.items()}
    shift = 1.0 if offsets else 0.0
    e = t["model.embed_tokens.weight"][tokens]
    if mask_first:
        e[0] = 0.0
    x = np.concatenate(
        [rms(e, t[P + "enorm.weight"] + shift), rms(hidden, t[P + "hnorm.weight"] + shift)], -1
    )
    x = x @ t[P + "eh_proj.weight"].T
    args = model_args_of(trunk.model)
    block = build_layer_like(trunk.layers[-1], args, 2)
    block.load_weights(
        [
            (k[len(P) :], mx.array(v + 1.0 if "norm" in k else v))
            for k, v in tiny.tensors.items()
            if k.startswith(P)
            and not k.startswith((P + "enorm", P + "hnorm", P + "eh_proj", P + "transformer."))
        ]
    )
    out = np.asarray(block(mx.array(x[None].astype(np.float32)), "causal", None)[0], dtype=np.float64)
    out = rms(out, t[P + "transformer.shared_head.norm.weight"] + shift)
    lm = t[P + "transformer.shared_head.output.weight"] if own_head else t["lm_head.weight"]
    return out @ lm.T


@pytest.mark.parametrize("seed", SEEDS)
def test_head_matches_a_float64_reference_and_not_its_variants(step, seed):
    tiny, (trunk, _, head) = step
    rng = np.random.default_rng(resolve(seed))
    tokens = [
        int(x) for x in rng.integers(0, 32, size=4)
    ]  # within the window: the reference's mask is causal
    hidden = rng.standard_normal((4, tiny.config["hidden_size"]))
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), head.make_cache())
    got = np.asarray(head.logits(out)[0], dtype=np.float64)
    want = reference_logits(tiny, trunk, hidden, tokens)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-4 * scale, seed
    for variant in ({"offsets": False}, {"mask_first": True}, {"own_head": False}):
        other = reference_logits(tiny, trunk, hidden, tokens, **variant)
        assert np.abs(got - other).max() > 1e-2 * scale, (seed, variant)  # each convention shows
    # The next draft step reads the layer's output before shared_head.norm (vLLM's chain).
    assert mx.array_equal(head.chain_input(out), head.last_pre_norm[:, -1:]).item()


def test_step3p5_checkpoint_loads_its_head(step):
    tiny, (trunk, config, head) = step
    assert config["model_type"] == "step3p5" and config["vocab_size"] <= 32
    assert head is not None and head.layout == "step3p5" and head.num_layers == 3
    assert head.hidden_source == "post_norm" and head.chain_source == "pre_norm"
    caches = head.make_cache()
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache"] * 3
    assert all(c.max_size == config["sliding_window"] for c in caches)
    assert all("head" in m.shared_head for m in head.modules_)  # its own LM head differs from the trunk's
    block = head.modules_[0].block
    assert block.is_sliding and type(block.mlp).__name__ == "Step3p5MLP"  # sliding, dense
    w = tiny.tensors[P + "self_attn.q_norm.weight"]  # stored as an offset from 1
    assert np.allclose(np.array(block.self_attn.q_norm.weight), np.asarray(w) + 1.0)


def assert_greedy_mtp_equals_ar(trunk, head, depths=(1, 2)) -> None:
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 16
    )
    for depth in depths:
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), 16)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


def test_step3p5_greedy_mtp_equals_greedy_ar_at_depths_1_to_3(step):
    _, (trunk, _, head) = step
    assert_greedy_mtp_equals_ar(trunk, head, depths=(1, 2, 3))


def test_step3p5_inspects_and_converts_with_its_head(step, tmp_path):
    tiny, _ = step
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready" and info["mtp"]["layout"] == "step3p5"
    assert info["mtp"]["declared_layers"] == 3 and "offsets from 1" in info["mtp"]["norm_rule"]
    out = convert_hf(tiny.path, tmp_path / "q4", q_bits=4, q_group_size=64)
    converted = inspect_model(out)
    assert converted["mtp"]["layout"] == "step3p5" and "conversion mark" in converted["mtp"]["norm_rule"]
    assert converted["mtp"]["precision"]["groups"]["attention"] == 8
    trunk, _, head = load(out)
    assert (
        head is not None and head.layout == "step3p5" and all("head" in m.shared_head for m in head.modules_)
    )
    assert_greedy_mtp_equals_ar(trunk, head)
