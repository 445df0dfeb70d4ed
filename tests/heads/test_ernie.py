"""ERNIE-4.5's MTP layout (``heads/ernie.py``) on a tiny replica in the published layout:
``model.mtp_emb_norm.{i}`` / ``mtp_hidden_norm.{i}`` / ``mtp_linear_proj.{i}`` / ``mtp_block.{i}.*``
beside an ``ernie4_5_moe`` trunk (vocabulary 32, 2 layers, one MoE with per-expert tensors).

The head's own math (position-0 mask, embedding first, no final norm) is checked against a
NumPy float64 reference around the block (the trunk's layer class, run in MLX), with negative
controls for each convention; then the replica loads with its head, greedy MTP equals greedy AR at
depths 1 and 2 with drafts kept, `inspect` says MTP-ready, and `mtplx convert` keeps the head.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.inspect import format_inspection, inspect_model
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig
from mtplx.spec_decode import loop as decode
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support.decoding import mtp_decode, take_steps, take_tokens
from support.seeds import SEEDS, resolve
from support.tokenizer import word_level

PROMPT = [3, 17, 22, 5, 30, 9, 11, 2, 13, 8]
GREEDY = SamplerConfig(temperature=0.0)


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory):
    path = tmp_path_factory.mktemp("ernie") / "tiny"
    tiny = checkpoints.ernie4_5_moe(path, context_strength=0.5)
    word_level(path)
    return tiny, load(path)


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_logits(
    tiny,
    trunk,
    hidden: np.ndarray,
    tokens: list[int],
    *,
    embedding_first=True,
    mask_first=True,
    final_norm=False,
) -> np.ndarray:
    """float64: e = embed(tokens) (row 0 zeroed), x = W [norm(e), norm(h)], block(x) (MLX), lm_head."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in tiny.tensors.items()}
    e = t["model.embed_tokens.weight"][tokens]
    if mask_first:
        e[0] = 0.0
    parts = [rms(e, t["model.mtp_emb_norm.0.weight"]), rms(hidden, t["model.mtp_hidden_norm.0.weight"])]
    x = np.concatenate(parts if embedding_first else parts[::-1], -1) @ t["model.mtp_linear_proj.0.weight"].T
    block = trunk_block(trunk, tiny)
    out = np.asarray(block(mx.array(x[None].astype(np.float32)), "causal", None)[0], dtype=np.float64)
    if final_norm:
        out = rms(out, t["model.norm.weight"])
    return out @ t["model.embed_tokens.weight"].T  # tied embeddings


def trunk_block(trunk, tiny):
    """The MTP block as the checkpoint defines it: the trunk's layer class with its tensors."""
    from mtplx.heads.base import build_layer_like, model_args_of

    args = model_args_of(trunk.model)
    block = build_layer_like(trunk.layers[-1], args, args.num_hidden_layers)
    prefix = "model.mtp_block.0."
    block.load_weights(
        [(k[len(prefix) :], mx.array(v)) for k, v in tiny.tensors.items() if k.startswith(prefix)]
    )
    return block


@pytest.mark.parametrize("seed", SEEDS)
def test_head_matches_a_float64_reference_and_not_its_variants(ernie, seed):
    tiny, (trunk, _, head) = ernie
    rng = np.random.default_rng(resolve(seed))
    tokens = [int(x) for x in rng.integers(0, 32, size=6)]
    hidden = rng.standard_normal((6, 32))
    got = head.logits(head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens])))[0]
    got = np.asarray(got, dtype=np.float64)
    want = reference_logits(tiny, trunk, hidden, tokens)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 1e-4 * scale, seed
    for variant in ({"embedding_first": False}, {"mask_first": False}, {"final_norm": True}):
        other = reference_logits(tiny, trunk, hidden, tokens, **variant)
        assert np.abs(got - other).max() > 1e-2 * scale, (seed, variant)  # each convention shows


def test_ernie_checkpoint_loads_its_head(ernie):
    tiny, (trunk, config, head) = ernie
    assert config["model_type"] == "ernie4_5_moe" and config["vocab_size"] <= 32
    assert not any("mtp" in k for k, _ in tree_flatten(trunk.model.parameters()))  # mlx-lm drops them
    assert head is not None and head.layout == "ernie" and head.num_layers == 1
    assert head.hidden_source == "post_norm"
    assert type(head.modules_[0].block.mlp).__name__ == "Ernie4_5_MLP"  # dense, as the references build it
    assert [type(c).__name__ for c in head.make_cache()] == ["KVCache"]
    w = tiny.tensors["model.mtp_block.0.mlp.up_proj.weight"]
    assert mx.array_equal(head.modules_[0].block.mlp.up_proj.weight, mx.array(w)).item()


def assert_greedy_mtp_equals_ar(trunk, head) -> None:
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 12
    )
    for depth in (1, 2):
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), 12)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


def test_ernie_greedy_mtp_equals_greedy_ar(ernie):
    _, (trunk, _, head) = ernie
    assert_greedy_mtp_equals_ar(trunk, head)


def test_ernie_inspects_and_converts_with_its_head(ernie, tmp_path):
    tiny, _ = ernie
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready" and info["mtp"]["layout"] == "ernie"
    assert info["mtp"]["declared_layers"] == 1 and "ernie layout" in format_inspection(info)
    out = convert_hf(tiny.path, tmp_path / "q4", q_bits=4, q_group_size=32)
    converted = inspect_model(out)
    assert converted["mtp"]["precision"]["groups"]["projection"] == 8
    trunk, _, head = load(out)
    assert head is not None and head.layout == "ernie"
    assert head.modules_[0].mtp_linear_proj.bits == 8
    assert_greedy_mtp_equals_ar(trunk, head)
