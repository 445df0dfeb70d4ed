"""`mtplx inspect`: facts from config.json + safetensors headers, and the verdict."""

from __future__ import annotations

import json
import math

import mtplx  # noqa: F401
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.errors import MtplxError

import mlx.core as mx
import pytest
from support import checkpoints, models
from support.hub import cache_layout


def _numel(tensors) -> int:
    return sum(math.prod(v.shape) for v in tensors.values())


def test_qwen35_with_head_is_mtp_ready(tmp_path):
    tiny = checkpoints.qwen3_5(tmp_path / "q35", shards=2)
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready"
    assert info["mtp"] == {
        "layout": "qwen3_next",
        "declared_layers": 1,
        "layer_count_source": "config",
        "tensors": sum(k.startswith("mtp.") for k in tiny.tensors),
        "norm_rule": "offsets from 1: raw Hugging Face qwen3_5 checkpoint (format pt)",
        "precision": {
            "groups": {"projection": "float", "attention": "float", "dense": "float"},
            "below_8_bits": [],
            "converted_as": None,
        },
    }
    assert info["parameters"] == _numel(tiny.tensors)
    assert info["parameters_by_part"]["mtp_head"] == _numel(
        {k: v for k, v in tiny.tensors.items() if k.startswith("mtp.")}
    )
    assert info["memory_bytes"] == sum(v.nbytes for v in tiny.tensors.values())
    assert info["memory_bytes_by_dtype"] == {"F32": info["memory_bytes"]}
    assert info["shards"] == 2 and info["quantization"] is None
    assert json.loads(json.dumps(info)) == info  # --json ready
    text = format_inspection(info)
    assert "verdict       MTP-ready" in text and "qwen3_next layout" in text


def test_deepseek_and_mimo_layouts(tmp_path):
    ds = inspect_model(checkpoints.deepseek_v3(tmp_path / "ds").path)
    assert ds["mtp"]["layout"] == "deepseek" and ds["verdict"] == "MTP-ready"
    mi = inspect_model(checkpoints.mimo(tmp_path / "mimo").path)
    assert mi["mtp"]["layout"] == "mimo" and mi["verdict"] == "MTP-ready"


def test_quantized_counts_real_parameters(tmp_path):
    float_tiny = checkpoints.mimo(tmp_path / "f")
    q_tiny = checkpoints.mimo(tmp_path / "q", quantize={"group_size": 32, "bits": 4}, head_override_bits=8)
    info = inspect_model(q_tiny.path)
    assert info["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine", "per_layer_overrides": 1}
    assert info["parameters"] == _numel(float_tiny.tensors)  # packed uint32 weights unpacked to real counts
    assert (
        "4-bit quantized" in info["memory_bytes_by_dtype"]
        and "8-bit quantized" in info["memory_bytes_by_dtype"]
    )
    assert info["memory_bytes"] < sum(v.nbytes for v in float_tiny.tensors.values())
    assert "4-bit affine, group size 32" in format_inspection(info)


def test_model_without_head_is_ar_only_and_suggests_forge(tmp_path):
    tiny = checkpoints.save_model(tmp_path / "llama", models.tiny_llama(), architectures=["LlamaForCausalLM"])
    info = inspect_model(tiny.path)
    assert info["verdict"] == "AR-only" and "mtplx forge" in info["reason"] and info["mtp"]["layout"] is None
    # A forged head beside it makes it MTP-ready.
    (tiny.path / "mtplx_head").mkdir()
    (tiny.path / "mtplx_head" / "manifest.json").write_text(
        json.dumps({"layout": "qwen3_next", "trunk_fingerprint": "abc"})
    )
    info = inspect_model(tiny.path)
    assert info["verdict"] == "MTP-ready" and info["forged_head"]["layout"] == "qwen3_next"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]"])
def test_damaged_forged_head_manifest_is_a_one_line_error(tmp_path, content):
    """The sidecar lookup is self-contained (it once called a finder that does not exist)."""
    tiny = checkpoints.mimo(tmp_path / "m")
    (tiny.path / "mtplx_head").mkdir()
    manifest = tiny.path / "mtplx_head" / "manifest.json"
    manifest.write_text(content)
    with pytest.raises(MtplxError) as err:
        inspect_model(tiny.path)
    assert "\n" not in str(err.value) and str(manifest) in str(err.value)
    manifest.unlink()
    assert inspect_model(tiny.path)["forged_head"] is None  # negative control: no sidecar, no head


def test_declared_but_missing_head_is_ar_only(tmp_path):
    tiny = checkpoints.qwen3_5(tmp_path / "q35", ship_mtp=False)
    info = inspect_model(tiny.path)
    assert info["verdict"] == "AR-only" and "ships no head tensors" in info["reason"]
    assert "declared (1 layer(s)) but no tensors" in format_inspection(info)


def test_unsupported_architecture(tmp_path):
    tiny = checkpoints.mimo(tmp_path / "odd")
    cfg = json.loads((tiny.path / "config.json").read_text())
    cfg["model_type"] = "definitely_not_a_model"
    (tiny.path / "config.json").write_text(json.dumps(cfg))
    info = inspect_model(tiny.path)
    assert info["verdict"] == "unsupported" and "definitely_not_a_model" in info["reason"]


def test_hub_cache_repo_id(tmp_path):
    tiny = checkpoints.mimo(tmp_path / "src")
    cache_layout(tiny.path, tmp_path / "hub", "tiny-org/MiMo-tiny")
    from mtplx.checkpoints.load import resolve_model

    path = resolve_model("tiny-org/MiMo-tiny", hub_cache=tmp_path / "hub")
    assert inspect_model(path)["verdict"] == "MTP-ready"


@pytest.mark.parametrize("damage", ["truncate", "garbage_header", "no_config", "missing_shard"])
def test_bad_input_is_one_line_error_naming_the_file(tmp_path, damage):
    tiny = checkpoints.qwen3_5(tmp_path / "q", shards=2)
    shard = sorted(tiny.path.glob("model-*.safetensors"))[0]
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
        target = shard
    elif damage == "garbage_header":
        shard.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\x00" * 64)
        target = shard
    elif damage == "no_config":
        (tiny.path / "config.json").unlink()
        target = tiny.path / "config.json"
    else:
        shard.unlink()
        target = shard
    with pytest.raises(MtplxError) as err:
        inspect_model(tiny.path)
    assert "\n" not in str(err.value) and str(target) in str(err.value)


def test_reads_headers_only(tmp_path):
    """Tensor data is never read: zeroing every byte after the header changes nothing."""
    tiny = checkpoints.mimo(tmp_path / "m")
    before = inspect_model(tiny.path)
    f = tiny.path / "model.safetensors"
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    f.write_bytes(raw[: 8 + n] + b"\x00" * (len(raw) - 8 - n))
    assert inspect_model(tiny.path) == before
    assert mx.load(str(f))["model.norm.weight"].sum().item() == 0  # the data really is gone
