"""Step-3.5-Flash's MTP layout (``heads/step3p5.py``) on a tiny replica in the published layout:
three MTP layers at ``model.layers.{2 + i}`` (``enorm``, ``hnorm``, ``eh_proj``, the block at the
prefix, ``transformer.shared_head.{norm,output}``), every norm stored as an offset from 1, beside a
``step3p5`` trunk (vocabulary 32, hidden 64, a full and a sliding-window layer, window 4, MoE
under ``.moe.``).

The head's math (no position-0 mask, offset norms, embedding first, the gated sliding-window block,
its own LM head) is checked against an independent NumPy float64 reference of the whole layer in
``test_head_references.py``. Here: the chain reads the pre-norm output; the replica loads
with sliding-window caches, greedy MTP equals greedy AR at depths 1-3 with drafts kept while the
windows wrap, `inspect` says MTP-ready, and `mtplx convert` keeps the head.
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
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
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


def test_the_next_draft_step_reads_the_output_before_shared_head_norm(step):
    """vLLM's chain: the layer's output before ``shared_head.norm`` is what step 1 reads."""
    tiny, (_, _, head) = step
    hidden = np.random.default_rng(0).standard_normal((1, 4, tiny.config["hidden_size"]))
    out = head(mx.array(hidden.astype(np.float32)), mx.array([[3, 17, 22, 5]]), head.make_cache())
    assert mx.array_equal(head.chain_input(out), head.last_pre_norm[:, -1:]).item()
    assert not mx.allclose(head.chain_input(out), out[:, -1:], atol=1e-3).item()  # the norm shows


def test_step3p5_checkpoint_loads_its_head(step):
    tiny, (trunk, config, head) = step
    assert config["model_type"] == "step3p5" and config["vocab_size"] <= 32
    assert head is not None and head.layout == "step3p5" and head.num_layers == 3
    assert head.hidden_source == "post_norm" and head.chain_source == "pre_norm"
    caches = head.make_cache()
    assert [type(c).__name__ for c in caches] == ["RotatingKVCache"] * 3
    assert all(c.max_size == config["sliding_window"] for c in caches)
    assert all(
        head.has_own_lm_head(i) for i in range(head.num_modules)
    )  # its own LM head differs from the trunk's
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
        head is not None
        and head.layout == "step3p5"
        and all(head.has_own_lm_head(i) for i in range(head.num_modules))
    )
    assert_greedy_mtp_equals_ar(trunk, head)
