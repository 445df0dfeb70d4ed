"""The one-MTP-layer heads of the mlx-vlm families (DeepSeek-V4, GLM-5-Next, Hy-V4, Inkling,
Qwen3.8-Flash-Next) refuse a checkpoint that lacks their tensors, or declares another number of
layers, in one line through one pair of checks (`mtplx.heads.weights.check_one_layer_head` /
`check_one_layer_drafter`), before any trunk is read."""

from __future__ import annotations

from pathlib import Path

from mtplx.errors import MtplxError
from mtplx.heads import deepseek_v4, inkling, qwen4_exp
from mtplx.heads.weights import HeadSource, MissingHeadError, check_one_layer_drafter, check_one_layer_head

import pytest

# (family module, the hosted head's key, the split drafter's kind and key)
FAMILIES = [
    pytest.param(
        inkling,
        "model.mtp.layers.0.input_proj.weight",
        "inkling_mtp",
        "blocks.0.input_proj.weight",
        id="inkling",
    ),
    pytest.param(qwen4_exp, "mtp.fc_hidden.weight", "qwen4_exp_mtp", "fc_hidden.weight", id="qwen4_exp"),
    pytest.param(deepseek_v4, "mtp.1.e_proj.weight", "deepseek_v4_mtp", "e_proj.weight", id="deepseek_v4"),
]


def _source(tmp_path: Path, *keys: str) -> HeadSource:
    """A checkpoint whose index holds ``keys``; no trunk (the checks come before it is read)."""
    (tmp_path / "model.safetensors").touch()
    return HeadSource(tmp_path, {}, {k: "model.safetensors" for k in keys}, trunk=None)


def _one_line(excinfo: pytest.ExceptionInfo, *words: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and "model.safetensors" in message, message
    assert all(w in message for w in words), (words, message)


@pytest.mark.parametrize(("family", "head_key", "kind", "drafter_key"), FAMILIES)
def test_a_head_without_its_tensors_or_of_two_layers_is_refused_in_one_line(
    family, head_key: str, kind: str, drafter_key: str, tmp_path: Path
) -> None:
    with pytest.raises(MissingHeadError) as missing:  # the model still decodes, AR
        family.build_head(_source(tmp_path), 1, "pre_norm")
    _one_line(missing, "ships no")
    with pytest.raises(MtplxError) as two:
        family.build_head(_source(tmp_path, head_key), 2, "pre_norm")
    assert not isinstance(two.value, MissingHeadError)
    _one_line(two, "one MTP layer", "declares 2")
    with pytest.raises(MtplxError) as lacking:
        family.build_split_head(_source(tmp_path, "other.weight"), 1)
    _one_line(lacking, kind, f"needs {drafter_key}")
    with pytest.raises(MtplxError) as split_two:
        family.build_split_head(_source(tmp_path, drafter_key), 2)
    _one_line(split_two, kind, "one MTP layer", "declares 2")


def test_the_checks_pass_a_checkpoint_of_one_layer_with_its_key(tmp_path: Path) -> None:
    """The pass side (a family then builds its head: its own tests load real replicas)."""
    src = _source(tmp_path, "k.weight")
    check_one_layer_head(src, 1, "some_layout", "k.weight")
    check_one_layer_head(src, 1, "some_layout")  # the caller found the tensors itself
    check_one_layer_drafter(src, 1, "some_mtp", "k.weight")
    with pytest.raises(MissingHeadError) as missing:
        check_one_layer_head(src, 1, "some_layout", "other.weight")
    _one_line(missing, "ships no other.weight")
