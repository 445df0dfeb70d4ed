"""ERNIE-4.5's MTP layout (``heads/ernie.py``) on a tiny replica in the published layout:
``model.mtp_emb_norm.{i}`` / ``mtp_hidden_norm.{i}`` / ``mtp_linear_proj.{i}`` / ``mtp_block.{i}.*``
beside an ``ernie4_5_moe`` trunk (vocabulary 32, 2 layers, one MoE with per-expert tensors).

The head's math (position-0 mask, embedding first, the block, no final norm) is checked against an
independent NumPy float64 reference of the whole layer in ``test_head_references.py``. Here: the
replica loads with its head, greedy MTP equals greedy AR at
depths 1 and 2 with drafts kept, `inspect` says MTP-ready, and `mtplx convert` keeps the head.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig
from mtplx.trunk.model import Trunk

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
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
