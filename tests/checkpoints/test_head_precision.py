"""The MTP head's precision on conversion (``mtplx.heads.precision``, issue 27 item 3).

``mtplx convert --q-bits 4`` of a hybrid (Qwen3.5) and of a DeepSeek-style MoE replica keeps the
head's attention, projection and dense parts at 8 bits and its routed experts at 4, records that
in the converted config, ``inspect`` shows it, and the converted model's greedy output with MTP
equals its own AR output. The converted head is checked against the source head fake-quantized
here, per layer by path (8 bits, ``switch_mlp`` experts 4), independently of the converter.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import cli
from mtplx.checkpoints.convert_hf import convert_hf
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.heads import load_head, precision
from mtplx.sampling import SamplerConfig
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
from support.tokenizer import word_level

GROUP = 32  # the tiny models' hidden size
PROMPT = [3, 17, 42, 5, 60, 9, 11, 2, 33, 8]
GREEDY = SamplerConfig(temperature=0.0)
DEFAULT_GROUPS = {
    "qwen3_5": {"projection": 8, "attention": 8, "dense": 8},
    "deepseek_v3": {"projection": 8, "attention": 8, "dense": 8, "routed_experts": 4},
}


def build(family: str, path: Path):
    if family == "qwen3_5":
        return checkpoints.qwen3_5(path, context_strength=0.5)
    return checkpoints.deepseek_v3(path, moe=True, trunk_layers=2, sidecar=True, context_strength=0.3)


@pytest.fixture(scope="module", params=sorted(DEFAULT_GROUPS))
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = root / "src"
    build(request.param, src)
    word_level(src)
    out = root / "q4"  # the command the issue names: mtplx convert --q-bits 4
    assert cli.main(["convert", str(src), str(out), "--q-bits", "4", "--q-group-size", str(GROUP)]) == 0
    return request.param, src, out


def expected_bits(path: str) -> int:
    """The default, written out by hand: routed experts at the trunk's 4 bits, the rest at 8."""
    return 4 if "switch_mlp" in path else 8


def fake_quantize_by_path(module: nn.Module) -> None:
    for path, m in module.named_modules():
        if hasattr(m, "to_quantized") and "weight" in m and m.weight.shape[-1] % GROUP == 0:
            bits = expected_bits(path)
            w = m.weight.astype(mx.float32)
            m.weight = mx.dequantize(
                *mx.quantize(w, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits
            )


def chain_logits(head, trunk: Trunk) -> mx.array:
    out = trunk(mx.array([PROMPT[:6]]))
    hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
    cache = head.make_cache()
    h = head(hidden, mx.array([PROMPT[1:7]]), cache, step=0)
    rows = [h[0, -1]]
    for s, token in enumerate([7, 33], start=1):
        h = head(head.chain_input(h), mx.array([[token]]), cache, step=s)
        rows.append(h[0, -1])
    return trunk.lm_head(mx.stack(rows)[None])[0]


def head_error(src: Path, out: Path, *, fake_quantized: bool = True) -> float:
    model, config = mlx_load_model(out)
    trunk = Trunk(model)
    converted = load_head(out, trunk, config)
    source = load_head(src, trunk, json.loads((src / "config.json").read_text()))
    if fake_quantized:
        fake_quantize_by_path(source)
    got, want = chain_logits(converted, trunk), chain_logits(source, trunk)
    return float(mx.max(mx.abs(got - want)).item() / max(1.0, mx.max(mx.abs(want)).item()))


def test_default_head_precision_is_recorded_and_loaded(converted):
    family, src, out = converted
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert config["mtplx"]["head_bits"] == "default"
    assert config["mtplx"]["head_precision"] == DEFAULT_GROUPS[family]
    model, config = mlx_load_model(out)
    head = load_head(out, Trunk(model), config)
    bits = {p: m.bits for p, m in head.named_modules() if hasattr(m, "scales")}
    assert bits and all(b == expected_bits(p) for p, b in bits.items()), bits
    assert (4 in bits.values()) == (family == "deepseek_v3")
    assert head_error(src, out) < 1e-4
    # Negative control: the float source head is measurably elsewhere (the head was quantized).
    assert head_error(src, out, fake_quantized=False) > 1e-4


def test_converted_model_greedy_mtp_equals_its_own_ar(converted):
    _, _, out = converted
    model, config = mlx_load_model(out)
    trunk = Trunk(model)
    head = load_head(out, trunk, config)
    ar = take_tokens(
        decode.ar_decode(trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 12
    )
    for depth in (1, 2):
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0)), 12)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


def test_inspect_shows_the_head_precision(converted, capsys):
    family, _, out = converted
    info = inspect_model(out)
    assert info["mtp"]["precision"]["groups"] == DEFAULT_GROUPS[family]
    assert info["mtp"]["precision"]["below_8_bits"] == []
    text = format_inspection(info)
    assert "head bits     projection 8-bit, attention 8-bit" in text and "(mtplx convert's default)" in text
    assert "warning" not in text
    capsys.readouterr()
    assert cli.main(["inspect", str(out)]) == 0
    assert "head bits     projection 8-bit" in capsys.readouterr().out


def test_inspect_warns_when_attention_or_projection_is_below_8_bits(converted, tmp_path):
    """Negative control of the warning: the same model with ``--head-bits 4``."""
    _, src, _ = converted
    out = convert_hf(src, tmp_path / "h4", q_bits=4, q_group_size=GROUP, head_bits=4)
    info = inspect_model(out)
    assert info["mtp"]["precision"]["below_8_bits"] == ["projection", "attention"]
    warnings = [line for line in format_inspection(info).splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "projection and attention below 8 bits" in warnings[0]
    assert "(--head-bits 4)" in format_inspection(info)


@pytest.mark.parametrize(
    "name,group",
    [
        ("mtp.fc", "projection"),
        ("model.layers.61.eh_proj", "projection"),
        ("model.mtp_layers.0.input_proj", "projection"),
        ("model.mtp.layers.2.eh_proj", "projection"),
        ("mtp.layers.0.self_attn.q_proj", "attention"),
        ("model.layers.61.self_attn.kv_b_proj", "attention"),
        ("model.layers.78.self_attn.indexer.wk", "attention"),
        ("mtp.layers.0.mixer.q_proj", "attention"),  # Nemotron-H's attention block
        ("mtp.layers.0.mixer.o_proj", "attention"),
        ("mtp.layers.1.mixer.shared_experts.up_proj", "dense"),
        ("mtp.layers.1.mixer.gate", "dense"),
        ("mtp.layers.1.mixer.experts.0.down_proj", "routed_experts"),
        ("mtp.layers.0.mlp.gate_proj", "dense"),
        ("mtp.layers.0.mlp.gate", "dense"),
        ("mtp.layers.0.mlp.shared_expert.up_proj", "dense"),
        ("model.layers.61.mlp.shared_experts.down_proj", "dense"),
        ("mtp.layers.0.mlp.shared_expert_gate", "dense"),
        ("model.layers.61.mlp.experts.17.down_proj", "routed_experts"),
        ("mtp.layers.0.mlp.experts.gate_up_proj", "routed_experts"),
        ("modules_.0.block.mlp.switch_mlp.up_proj", "routed_experts"),
        ("model.layers.61.shared_head.head", "lm_head"),
        ("model.layers.61.embed_tokens", "lm_head"),
    ],
)
def test_tensor_groups_of_every_family(name, group):
    assert precision.tensor_group(name) == group


def test_default_bits_and_the_floor():
    assert [precision.default_bits(g, 4) for g in precision.GROUPS] == [8, 8, 8, 4, 8]
    assert precision.default_bits("attention", 8) == 8 and precision.default_bits("routed_experts", 8) == 8
    assert precision.below_floor({"projection": "4/8", "attention": "float"}) == ["projection"]
    assert precision.below_floor({"projection": 8, "attention": 8, "routed_experts": 2}) == []
