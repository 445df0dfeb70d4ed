"""`mtplx convert` of Hugging Face checkpoints: a 4-bit trunk the way mlx_lm.convert makes it,
plus the MTP head mlx-lm's converter drops, for each MTP family's tiny checkpoint.

The head check: the converted head (loaded from the written directory, on the converted trunk)
against the *source* head whose weights were quantized and dequantized here, independently of
the converter (mx.quantize / mx.dequantize per quantizable layer, the group size and bits
asked for). They agree to kernel rounding; a dropped or mis-mapped head does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import cli
from mtplx.checkpoints.convert_hf import HEAD_FILE, convert_hf
from mtplx.errors import MtplxError
from mtplx.heads import MissingHeadError, load_head
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support.hub import cache_layout
from support.tokenizer import word_level

GROUP, BITS = 32, 4  # the tiny models' hidden size is 32: group 64 would leave everything float
TOKENS = [[3, 17, 42, 5, 60, 9]]
NEXT = [[17, 42, 5, 60, 9, 11]]
FAMILIES = {"qwen3_5": checkpoints.qwen3_5, "deepseek_v3": checkpoints.deepseek_v3, "mimo": checkpoints.mimo}


def fake_quantize(module: nn.Module) -> None:
    """Quantize-dequantize every weight a converter may quantize (input dim a multiple of GROUP)."""
    for _, m in module.named_modules():
        if hasattr(m, "to_quantized") and "weight" in m and m.weight.shape[-1] % GROUP == 0:
            w = m.weight.astype(mx.float32)
            m.weight = mx.dequantize(
                *mx.quantize(w, group_size=GROUP, bits=BITS), group_size=GROUP, bits=BITS
            )


def chain_logits(head, trunk: Trunk) -> mx.array:
    """Three chained draft steps (step-dependent modules included), through the trunk's LM head."""
    out = trunk(mx.array(TOKENS))
    hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
    cache = head.make_cache()
    h = head(hidden, mx.array(NEXT), cache, step=0)
    rows = [h[0, -1]]
    for s, token in enumerate([7, 33], start=1):
        h = head(head.chain_input(h), mx.array([[token]]), cache, step=s)
        rows.append(h[0, -1])
    return trunk.lm_head(mx.stack(rows)[None])[0]


def head_error(src: Path, out: Path, *, quantized: bool = True) -> float:
    """Max |converted head logits - (fake-quantized) source head logits|, relative to their scale."""
    model, config = mlx_load_model(out)
    trunk = Trunk(model)
    converted = load_head(out, trunk, config)
    source = load_head(src, trunk, json.loads((src / "config.json").read_text()))
    if quantized:
        fake_quantize(source)
    got, want = chain_logits(converted, trunk), chain_logits(source, trunk)
    return float(mx.max(mx.abs(got - want)).item() / max(1.0, mx.max(mx.abs(want)).item()))


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for family, build in FAMILIES.items():
        src = root / family
        build(src)
        word_level(src)
        # head_bits=BITS: every head layer at the trunk's width, so one fake quantization checks it
        # (the default precision per group is tests/checkpoints/test_head_precision.py's).
        out[family] = (
            src,
            convert_hf(src, root / f"{family}-4bit", q_bits=BITS, q_group_size=GROUP, head_bits=BITS),
        )
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_converted_head_matches_the_dequantized_source_head(converted, family):
    src, out = converted[family]
    assert (out / HEAD_FILE).is_file()
    assert head_error(src, out) < 1e-4
    # The head really is 4-bit: the unquantized source head is measurably elsewhere.
    assert head_error(src, out, quantized=False) > 1e-3
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == BITS and config["quantization"]["group_size"] == GROUP


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mlx_lm_opens_the_converted_directory(converted, family):
    _, out = converted[family]
    model, tokenizer = mlx_lm_load(str(out))
    ours = Trunk(mlx_load_model(out)[0])
    assert isinstance(model.layers[0].mlp.down_proj, nn.QuantizedLinear)  # the trunk is 4-bit
    logits = model(mx.array(TOKENS))
    assert mx.allclose(logits, ours(mx.array(TOKENS)).logits, atol=1e-4).item()


def _swap_two_same_shaped_layers(path: Path) -> None:
    """Mis-map the head file: two layers of identical shapes trade all their tensors."""
    arrays = dict(mx.load(str(path)))
    mx.eval(arrays)
    by_shape: dict[tuple, list[str]] = {}
    for k, v in sorted(arrays.items()):
        if k.endswith(".scales"):
            base = k[: -len(".scales")]
            by_shape.setdefault((tuple(arrays[base + ".weight"].shape), tuple(v.shape)), []).append(base)
    a, b = next(bases[:2] for bases in by_shape.values() if len(bases) >= 2)
    for part in ("weight", "scales", "biases"):
        arrays[f"{a}.{part}"], arrays[f"{b}.{part}"] = arrays[f"{b}.{part}"], arrays[f"{a}.{part}"]
    mx.save_safetensors(str(path), arrays, {"format": "mlx"})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dropped_or_mis_mapped_head_fails_the_check(converted, family, tmp_path):
    """Negative controls for the head check above."""
    import shutil

    src, out = converted[family]
    broken = tmp_path / "mis-mapped"
    shutil.copytree(out, broken)
    _swap_two_same_shaped_layers(broken / HEAD_FILE)
    assert head_error(src, broken) > 1e-3
    (broken / HEAD_FILE).unlink()  # dropped, as mlx_lm.convert does
    with pytest.raises(MissingHeadError):
        head_error(src, broken)


def test_float_head_is_kept_exactly(converted, tmp_path):
    src, _ = converted["mimo"]
    out = convert_hf(src, tmp_path / "float-head", q_bits=BITS, q_group_size=GROUP, head_bits="float")
    assert head_error(src, out, quantized=False) < 1e-5
    model, config = mlx_load_model(out)
    head = load_head(out, Trunk(model), config)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in head.named_modules())


def test_head_bits_of_its_own_are_a_per_layer_override(converted, tmp_path):
    src, _ = converted["mimo"]
    out = convert_hf(src, tmp_path / "8bit-head", q_bits=BITS, q_group_size=GROUP, head_bits=8)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["model.mtp_layers.0.input_proj"] == {
        "group_size": GROUP,
        "bits": 8,
        "mode": "affine",
    }
    assert config["mtplx"]["head_bits"] == 8 and config["mtplx"]["head_precision"]["projection"] == 8
    model, config = mlx_load_model(out)
    head = load_head(out, Trunk(model), config)
    assert head.modules_[0].input_proj.bits == 8
    assert model.model.layers[0].mlp.down_proj.bits == BITS


def test_cli_converts_a_repo_id_from_the_hub_cache_and_generates(converted, tmp_path, capsys):
    src, _ = converted["mimo"]
    cache_layout(src, tmp_path / "hub", "tiny-org/MiMo-tiny")
    out = convert_hf(
        "tiny-org/MiMo-tiny",
        tmp_path / "from-repo",
        q_group_size=GROUP,
        head_bits=BITS,
        hub_cache=tmp_path / "hub",
    )
    assert head_error(src, out) < 1e-4
    cli_out = tmp_path / "cli"
    assert cli.main(["convert", str(src), str(cli_out), "--q-group-size", str(GROUP)]) == 0
    assert (cli_out / HEAD_FILE).is_file()
    capsys.readouterr()
    assert (
        cli.main(["generate", "--model", str(cli_out), "--raw", "--max-tokens", "4", "--stats", "w3 w5 w7"])
        == 0
    )
    captured = capsys.readouterr()
    assert "per draft position" in captured.err and captured.out.strip()  # decoded with the kept head


def test_failed_conversion_leaves_nothing(converted, tmp_path, monkeypatch):
    import mlx_lm.utils

    src, _ = converted["mimo"]

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(mlx_lm.utils, "save_config", boom)
    with pytest.raises(RuntimeError):
        convert_hf(src, tmp_path / "out", q_group_size=GROUP)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kwargs,problem",
    [({"q_bits": 7}, "q_bits"), ({"q_group_size": 48}, "q_group_size"), ({"head_bits": "fp8"}, "head_bits")],
)
def test_bad_options_are_one_line_errors(converted, tmp_path, kwargs, problem):
    src, _ = converted["mimo"]
    with pytest.raises(MtplxError, match=problem) as excinfo:
        convert_hf(src, tmp_path / "out", **kwargs)
    assert "\n" not in str(excinfo.value)


def test_already_quantized_source_is_refused(converted, tmp_path):
    _, out = converted["mimo"]
    with pytest.raises(MtplxError, match="already quantized"):
        convert_hf(out, tmp_path / "again", q_group_size=GROUP)


def test_missing_source_is_a_one_line_error(tmp_path):
    with pytest.raises(MtplxError, match="not found"):
        convert_hf(tmp_path / "nope", tmp_path / "out")


def test_the_head_is_cast_by_the_trunks_rule_so_the_router_bias_stays_float32(tmp_path):
    """DeepSeek's ``e_score_correction_bias`` stays float32 when the checkpoint is cast to its
    bfloat16 (mlx-lm's ``cast_predicate`` for the trunk); the rest of the head is cast."""
    src = checkpoints.deepseek_v3(tmp_path / "ds-moe", moe=True).path
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    out = convert_hf(src, tmp_path / "out", q_bits=BITS, q_group_size=GROUP, head_bits="float")
    head = mx.load(str(out / "mtp.safetensors"))
    bias = [k for k in head if k.endswith("e_score_correction_bias")]
    assert bias and all(head[k].dtype == mx.float32 for k in bias)
    gates = [k for k in head if k.endswith("mlp.gate.weight")]
    assert gates and all(head[k].dtype == mx.bfloat16 for k in gates)  # control: the cast did run
