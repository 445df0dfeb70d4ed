"""The Qwen norm convention ("+1": HF Qwen3-Next / Qwen3.5 store RMSNorm weights as offsets from 1)
decided by provenance, one test per rule of ``mtplx.heads.weights.norm_rule``; ``inspect`` names
the rule. Each uses a weight that fools the old guess (mean nearer 0 than 1 means offset): a
fine-tuned raw norm stored as an offset of mean above 0.5, or a plain scale of mean below 0.5.
The unknown-provenance fallback (per tensor, with a warning) is in ``test_heads.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.heads import Qwen3NextMTPHead, load_head
from mtplx.heads.weights import stored_as_offset
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints, models

NORM = "mtp.layers.0.post_attention_layernorm.weight"
FOOLING_OFFSET = 0.8  # a fine-tune's raw offset: the weight is 1.8, the old guess read it as 0.8


def load(path: Path):
    model, config = mlx_load_model(path)
    trunk = Trunk(model)
    return trunk, load_head(path, trunk, config)


def _rewrite(path: Path, file: str, changes: dict[str, mx.array], metadata: dict[str, str]) -> None:
    arrays = dict(mx.load(str(path / file)))
    arrays.update(changes)
    mx.save_safetensors(str(path / file), arrays, metadata)


def _head_norm(head) -> np.ndarray:
    return np.array(head.layers[0].post_attention_layernorm.weight)


def test_raw_hugging_face_qwen_checkpoint_norms_are_offsets_even_when_the_mean_is_high(tmp_path):
    tiny = checkpoints.qwen3_5(tmp_path / "raw")
    fooling = mx.full((models.HIDDEN,), FOOLING_OFFSET)
    assert not stored_as_offset(fooling)  # the old guess would load 0.8
    _rewrite(tiny.path, "model.safetensors", {NORM: fooling}, {"format": "pt"})
    _, head = load(tiny.path)
    np.testing.assert_allclose(_head_norm(head), 1.0 + FOOLING_OFFSET, rtol=1e-6)
    # Every other head norm: +1 as well (the file stores each as an offset).
    stored = tiny.tensors["mtp.norm.weight"]
    np.testing.assert_allclose(np.array(head.norm.weight), stored + 1.0, rtol=1e-6)
    info = inspect_model(tiny.path)
    assert "raw Hugging Face qwen3_5 checkpoint" in info["mtp"]["norm_rule"]
    assert "head norms    offsets from 1: raw Hugging Face" in format_inspection(info)


def test_mtplx_conversion_mark_keeps_plain_norms_even_when_the_mean_is_low(tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    tiny = checkpoints.qwen3_5(tmp_path / "src")
    out = convert_hf(tiny.path, tmp_path / "converted", q_bits=4, q_group_size=32, head_bits="float")
    _, converted = load(out)
    np.testing.assert_allclose(_head_norm(converted), tiny.tensors[NORM] + 1.0, rtol=1e-6)  # shifted once
    # A plain scale of mean 0.3 (a trained one could be): the old guess would add 1.
    low = mx.full((models.HIDDEN,), 0.3)
    assert stored_as_offset(low)
    metadata = {"format": "mlx", "mtplx_head_norms": "plain"}
    _rewrite(out, "mtp.safetensors", {NORM: low}, metadata)
    _, head = load(out)
    np.testing.assert_allclose(_head_norm(head), 0.3, rtol=1e-6)
    assert "mtplx conversion mark" in inspect_model(out)["mtp"]["norm_rule"]


def test_a_model_type_that_stores_plain_norms_keeps_them(tmp_path):
    """A Qwen3-Next-layout head on a llama checkpoint (raw, format pt): llama's norms are plain."""
    from mlx_lm.models import llama

    model = models.tiny_llama(seed=4)
    trunk = Trunk(model)
    head = Qwen3NextMTPHead([llama.TransformerBlock(model.args)], models.HIDDEN, eps=1e-5, trunk=trunk)
    models.randomize(head, 5)
    head.layers[0].post_attention_layernorm.weight = mx.full((models.HIDDEN,), 0.3)
    tensors = {f"mtp.{k}": v for k, v in tree_flatten(head.parameters())}
    tiny = checkpoints.save_model(tmp_path / "llama", model, mtp_num_hidden_layers=1)
    mx.save_safetensors(str(tiny.path / "mtp.safetensors"), tensors, {"format": "pt"})
    _, loaded = load(tiny.path)
    np.testing.assert_allclose(_head_norm(loaded), 0.3, rtol=1e-6)
    config = json.loads((tiny.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert "model_type llama does not store norms as offsets" in inspect_model(tiny.path)["mtp"]["norm_rule"]
