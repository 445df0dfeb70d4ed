"""LongCat-Flash's MTP layout (``heads/longcat.py``) on a tiny replica in the published layout
(vLLM ``longcat_flash_mtp.py``'s name map): ``model.mtp.layers.0.{enorm,hnorm}.m``, ``eh_proj``,
an MLA attention with its fused ``kv_b_proj``, ``transformer_layer.mlp``, ``model.mtp.norm``,
beside a ``longcat_flash`` trunk (vocabulary 32, hidden 64, one layer of two MLA attentions,
shortcut MoE).

The head's math (no position-0 mask, embedding first, the MLA block, the final norm) is checked
against an independent NumPy float64 reference of the whole layer in ``test_head_references.py``.
Here: loads with a plain KV cache (one attention, where each trunk layer pairs two), greedy MTP equals greedy AR at depths 1
and 2 with drafts kept, `inspect` says MTP-ready (count from tensor names), and `mtplx convert`
keeps the head.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.inspect import inspect_model
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig
from mtplx.trunk.model import Trunk

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
from support.tokenizer import word_level

PROMPT = [3, 17, 22, 5, 30, 9, 11, 2, 13, 8]
GREEDY = SamplerConfig(temperature=0.0)
P = "model.mtp.layers.0."


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, config, load_head(path, trunk, config)


@pytest.fixture(scope="module")
def longcat(tmp_path_factory):
    path = tmp_path_factory.mktemp("longcat") / "tiny"
    tiny = checkpoints.longcat_flash(path, context_strength=0.3)
    word_level(path)
    return tiny, load(path)


def test_longcat_checkpoint_loads_its_head(longcat):
    tiny, (trunk, config, head) = longcat
    assert config["model_type"] == "longcat_flash" and config["vocab_size"] <= 32
    assert head is not None and head.layout == "longcat" and head.num_layers == 1
    assert [type(c).__name__ for c in head.make_cache()] == ["KVCache"]
    assert [type(c).__name__ for c in trunk.make_cache()] == ["CacheList"]  # two attentions per trunk layer
    block = head.modules_[0].block
    assert (
        type(block.self_attn).__name__ == "LongcatFlashMLA" and type(block.mlp).__name__ == "LongcatFlashMLP"
    )
    w = tiny.tensors[P + "transformer_layer.mlp.up_proj.weight"]
    assert mx.array_equal(block.mlp.up_proj.weight, mx.array(w)).item()


def assert_greedy_mtp_equals_ar(trunk, head) -> None:
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 16
    )
    for depth in (1, 2):
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), 16)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


def test_longcat_greedy_mtp_equals_greedy_ar(longcat):
    _, (trunk, _, head) = longcat
    assert_greedy_mtp_equals_ar(trunk, head)


def test_longcat_inspects_and_converts_with_its_head(longcat, tmp_path):
    tiny, _ = longcat
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready" and info["mtp"]["layout"] == "longcat"
    assert info["mtp"]["declared_layers"] == 1 and info["mtp"]["layer_count_source"] == "tensor names"
    out = convert_hf(tiny.path, tmp_path / "q4", q_bits=4, q_group_size=64)
    converted = inspect_model(out)
    assert converted["mtp"]["layout"] == "longcat" and converted["mtp"]["layer_count_source"] == "config"
    trunk, _, head = load(out)
    assert head is not None and head.layout == "longcat" and head.modules_[0].eh_proj.bits == 8
    assert_greedy_mtp_equals_ar(trunk, head)
