"""Qwen3.5 GGUFs with their nextn block (``mtplx.checkpoints.gguf_qwen35``): exact dequantization
of every supported ggml type against a float64 reference written from the block layouts
(``support.ggml_blocks``), the converter's transforms undone (checked against the replica the
GGUF was written from), and the converted model decoding with its head: greedy MTP == AR with
drafts kept, float and requantized. The GGUF is written by ``support.gguf_qwen35`` with the
``gguf`` package, as llama.cpp's converter lays one out (K-quant, BF16, Q8_0, F32 tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints import gguf_quants, gguf_qwen35
from mtplx.checkpoints.convert_gguf import build_tokenizer, convert_gguf
from mtplx.checkpoints.gguf import read_gguf, read_tensor
from mtplx.checkpoints.gguf_requantize import convert_gguf_file
from mtplx.checkpoints.inspect import inspect_model
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import decoding as decode
from support import ggml_blocks
from support import gguf_qwen35 as tiny
from support.checkpoints import write_checkpoint
from support.decoding import assert_mtp_equals_ar_with_drafts_kept, mtp_decode, take_steps, take_tokens
from support.tokenizer import word_level

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = ([3, 17, 42, 5, 60, 9, 11, 2, 33, 8], [1, 2, 3, 4, 5], [50, 40, 30, 20, 10, 5])
# Measured on this replica: 19/27 depth-1 drafts kept (q4), 29/40 at depth 2 (float32): drafts
# are kept and rejected both; at 0.4 the hidden-256 head keeps almost none.
CONTEXT_STRENGTH = 0.1
TYPE_NAMES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Where each type keeps its f16 scale fields (sane random values there; every other byte random).
F16_FIELDS = {
    2: (0,),
    3: (0, 2),
    6: (0,),
    7: (0, 2),
    8: (0,),
    10: (80, 82),
    11: (108,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
}


def random_blocks(t: int, n_blocks: int, seed: int) -> bytes:
    """``n_blocks`` blocks of type ``t``: random bytes, the f16 scales in a sane range (and
    float elements finite), so every bit of the quants and packed scales is exercised."""
    rng = np.random.default_rng(seed)
    per, size = ggml_blocks.BLOCK[t]
    if t == 0:
        return rng.standard_normal(n_blocks).astype("<f4").tobytes()
    if t in (1, 30):
        floats = rng.standard_normal(n_blocks).astype("<f4")
        return (floats.astype("<f2") if t == 1 else (floats.view("<u4") >> 16).astype("<u2")).tobytes()
    raw = bytearray(rng.integers(0, 256, n_blocks * size, dtype=np.uint8).tobytes())
    for i in range(n_blocks):
        for at in F16_FIELDS[t]:
            raw[i * size + at : i * size + at + 2] = np.array(rng.uniform(-0.2, 0.2), "<f2").tobytes()
    return bytes(raw)


def shape_of(t: int, rows: int = 3) -> tuple[int, int]:
    return rows, 2 * ggml_blocks.BLOCK[t][0] if ggml_blocks.BLOCK[t][0] > 1 else 64


# ------------------------------------------------------------------ dequantization


@pytest.mark.parametrize("name", TYPE_NAMES)
def test_each_type_dequantizes_exactly_as_the_float64_reference(name, tmp_path):
    """Through a real file: one tensor of the type written by the gguf package, read back by
    mtplx's reader; the float32 values equal the reference's float64 values rounded once, and
    gguf-py's own dequantizer's."""
    import gguf

    t = ggml_blocks.TYPES[name]
    rows, cols = shape_of(t)
    per, size = ggml_blocks.BLOCK[t]
    raw = random_blocks(t, rows * cols // per, seed=t)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen35")
    data = np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)
    writer.add_tensor("x.weight", data, raw_dtype=gguf.GGMLQuantizationType(t))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = read_gguf(tmp_path / "t.gguf").tensors["x.weight"]
    assert info.shape == (rows, cols) and info.type_name == name
    got = read_tensor(read_gguf(tmp_path / "t.gguf"), info)
    expected = ggml_blocks.reference_dequantize(raw, t, (rows, cols))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected.astype(np.float32))
    # and llama.cpp's own Python dequantizer (gguf-py) agrees
    theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t)).reshape(rows, cols)
    np.testing.assert_array_equal(got, theirs.astype(np.float32))


def test_the_reference_catches_a_wrong_k_scale_unpacking(monkeypatch):
    """Negative control: sub-blocks 4-7 of a Q4_K block read without their scales' top two
    bits (a plausible unpacking slip) differ from the reference on the random blocks."""

    def low_bits_only(s):
        s = s.astype(np.uint8)
        scales = np.concatenate([s[:, 0:4] & 63, s[:, 8:12] & 0x0F], axis=1).astype(np.float32)
        mins = np.concatenate([s[:, 4:8] & 63, s[:, 8:12] >> 4], axis=1).astype(np.float32)
        return scales, mins

    monkeypatch.setattr(gguf_quants, "_k_scales_mins", low_bits_only)
    raw = random_blocks(12, 4, seed=12)
    got = gguf_quants.dequantize(np.frombuffer(raw, dtype=np.uint8), 12, (4, 256))
    expected = ggml_blocks.reference_dequantize(raw, 12, (4, 256)).astype(np.float32)
    assert not np.array_equal(got, expected)


def test_a_gguf_of_an_unsupported_type_is_a_one_line_error(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "iq.gguf"), "qwen35")
    raw = np.zeros((2, 18), dtype=np.uint8)  # two IQ4_NL blocks of 32
    writer.add_tensor("x.weight", raw, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MtplxError) as e:
        convert_gguf(tmp_path / "iq.gguf", tmp_path / "out")
    message = str(e.value)
    assert "\n" not in message and "iq.gguf" in message and "unsupported type IQ4_NL" in message
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ conversion


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qwen35gguf")
    config, hf, written = tiny.qwen35_gguf(root / f"{tiny.NAME}-Q4_K_M.gguf", CONTEXT_STRENGTH)
    source = root / tiny.NAME  # the replica as the Hugging Face checkpoint it came from
    write_checkpoint(source, {k: mx.array(v) for k, v in hf.items()}, config)
    word_level(source)
    gguf_path = root / f"{tiny.NAME}-Q4_K_M.gguf"
    return {
        "gguf": gguf_path,
        "written": written,
        "source": source,
        "float32": convert_gguf(gguf_path, root / "f32", dtype="float32"),
        # float32 scales: MLX's bfloat16 arithmetic on a CPU is ~9x slower (docs/DECISIONS.md; the CLI test: bf16)
        "q4": convert_gguf_file(gguf_path, root / "q4", dtype="q4", q_group_size=64, float_dtype="float32"),
    }


def _mlx_params(model_dir: Path) -> dict[str, np.ndarray]:
    engine = Engine.load(str(model_dir), mtp=False)
    return {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(engine.trunk.model.parameters())}


def _tolerance(ggml_type: int) -> float:
    """The most one element of a tensor of this type can differ from the float32 it encodes,
    relative to the tensor's largest magnitude (the encoders' steps; exact float types 0)."""
    return {0: 0.0, 1: 2**-10, 30: 2**-8, 8: 1 / 127, 13: 1 / 16, 14: 1 / 31, 12: 1 / 8}[ggml_type]


def assert_trunk_matches_source(gguf_model) -> None:
    """Every trunk tensor of the converted model equals mlx-lm's own reading of the Hugging Face
    replica (its sanitize: norms +1, conv layout), within what its GGUF type can hold: names,
    value-head order, A_log and every other transform undone."""
    written, n = gguf_model["written"], 4
    by_mlx_name = {gguf_qwen35.target_name(g, n): t for g, (t, _) in written.items()}
    source, converted = _mlx_params(gguf_model["source"]), _mlx_params(gguf_model["float32"])
    assert source.keys() == converted.keys()
    for name, want in source.items():
        tol = max(_tolerance(by_mlx_name[name]) * np.abs(want).max(), 2e-6 * np.abs(want).max())
        np.testing.assert_allclose(converted[name], want, rtol=0, atol=tol, err_msg=name)


def test_the_converted_trunk_is_the_replica_the_gguf_was_written_from(gguf_model):
    assert_trunk_matches_source(gguf_model)


def test_the_comparison_catches_value_heads_left_tiled(gguf_model, tmp_path, monkeypatch):
    """Negative control: without undoing llama.cpp's value-head reorder (4 value heads over 2
    key heads here) the gated-delta tensors differ from the replica's."""
    monkeypatch.setattr(gguf_qwen35, "_value_heads", lambda kind, w, text: w)
    broken = dict(gguf_model, float32=convert_gguf(gguf_model["gguf"], tmp_path / "tiled"))
    with pytest.raises(AssertionError, match="linear_attn"):
        assert_trunk_matches_source(broken)


def test_the_head_is_the_nextn_block(gguf_model):
    """``mtp.safetensors`` holds the nextn block under the head's names, norms as plain scales
    (the replica's offsets + 1), marked so; the config declares one MTP layer."""
    from mtplx.model_files.headers import read_safetensors_metadata

    out = gguf_model["float32"]
    head = {k: np.array(v) for k, v in mx.load(str(out / "mtp.safetensors")).items()}
    hf = {k: np.array(v) for k, v in mx.load(str(gguf_model["source"] / "model.safetensors")).items()}
    assert set(head) == {k for k in hf if k.startswith("mtp.")}
    for name in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        np.testing.assert_array_equal(head[name], hf[name] + np.float32(1.0), err_msg=name)
    np.testing.assert_array_equal(head["mtp.fc.weight"], hf["mtp.fc.weight"])  # BF16 holds [I, 0]
    assert read_safetensors_metadata(out / "mtp.safetensors")["mtplx_head_norms"] == "plain"
    config = json.loads((out / "config.json").read_text())
    assert inspect_model(str(out))["verdict"] == "MTP-ready"
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    assert config["text_config"]["num_hidden_layers"] == 4 and config["model_type"] == "qwen3_5"


@pytest.mark.parametrize("kind", ["float32", "q4"])
def test_greedy_mtp_equals_ar_with_drafts_kept(gguf_model, kind):
    engine = Engine.load(str(gguf_model[kind]))
    assert engine.head is not None and engine.head.hidden_source == "post_norm"
    trunk_bits = {m.bits for _, m in engine.trunk.model.named_modules() if hasattr(m, "scales")}
    head_bits = {m.bits for _, m in engine.head.named_modules() if hasattr(m, "scales")}
    # q4: the trunk at 4 bits, the head at the head-precision default (8 bits)
    assert (trunk_bits, head_bits) == (({4}, {8}) if kind == "q4" else (set(), set()))
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS, 16, label=kind)


def test_the_q4_config_records_the_gguf_and_the_head_precision(gguf_model):
    config = json.loads((gguf_model["q4"] / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    assert config["mtplx"]["converted_from"] == gguf_model["gguf"].name and config["mtplx"]["dtype"] == "q4"
    assert config["mtplx"]["head_precision"] == {"projection": 8, "attention": 8, "dense": 8}
    assert sorted(p.name for p in gguf_model["q4"].parent.iterdir() if p.name.startswith(".")) == []


@pytest.fixture(scope="module")
def moe_gguf_model(tmp_path_factory) -> dict:
    """The Qwen3.5-MoE variant (``qwen35moe``: 4 routed experts + a shared expert per layer and in
    the nextn block), converted float32."""
    root = tmp_path_factory.mktemp("qwen35moe")
    config, hf, written = tiny.qwen35_gguf(root / "moe.gguf", CONTEXT_STRENGTH, moe=True)
    source = root / "source"
    write_checkpoint(source, {k: mx.array(v) for k, v in hf.items()}, config)
    word_level(source)
    return {
        "gguf": root / "moe.gguf",
        "written": written,
        "source": source,
        "float32": convert_gguf(root / "moe.gguf", root / "f32", dtype="float32"),
    }


def test_a_moe_gguf_converts_its_experts_and_drafts_exactly(moe_gguf_model):
    assert read_gguf(moe_gguf_model["gguf"]).architecture == "qwen35moe"
    assert_trunk_matches_source(moe_gguf_model)
    engine = Engine.load(str(moe_gguf_model["float32"]))
    assert "switch_mlp" in dict(engine.head.layers[0].mlp.named_modules())
    kept = 0
    for prompt in PROMPTS[:2]:
        ar = take_tokens(
            decode.ar_decode(engine.trunk, prompt, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)),
            14,
        )
        settings = decode.DecodeSettings(sampler=GREEDY, depth=2)
        tokens, steps = take_steps(
            mtp_decode(engine.trunk, engine.head, prompt, settings, mx.random.key(0)), 14
        )
        assert tokens == ar, prompt
        kept += sum(s.num_accepted for s in steps if s.num_drafted)
    assert kept > 0


# ------------------------------------------------------------------ tokenizer and bad input


def test_the_tokenizer_comes_from_the_metadata(gguf_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_model["float32"]))
    ids = tok.encode("the cat's 42", add_special_tokens=False)
    # split: "the" " cat" "'s" " " "4" "2"; merges: h+e, Ġ+t, Ġt+he, i+n, Ġ+a
    assert [tiny.TOKENS[i] for i in ids] == ["t", "he", "Ġ", "c", "a", "t", "'", "s", "Ġ", "4", "2"]
    assert tok.decode(ids) == "the cat's 42"
    assert tok.eos_token == "<|im_end|>"
    assert tok.convert_ids_to_tokens(tok.encode(" the", add_special_tokens=False)) == ["Ġthe"]


def test_the_qwen35_pre_tokenizer_keeps_combining_marks_with_their_letter(gguf_model):
    """Qwen3.5's split regex adds \\p{M} to letters (llama.cpp's QWEN35 pre-type); Qwen2's splits
    a combining mark off: the same file with ``tokenizer.ggml.pre`` = qwen2 shows the difference."""
    gguf = read_gguf(gguf_model["gguf"])
    text = "x\u0301y ok"  # x + combining acute (no precomposed form: NFC keeps it)
    qwen35 = [p for p, _ in build_tokenizer(gguf).pre_tokenizer.pre_tokenize_str(text)]
    gguf.metadata["tokenizer.ggml.pre"] = "qwen2"
    qwen2 = [p for p, _ in build_tokenizer(gguf).pre_tokenizer.pre_tokenize_str(text)]
    assert len(qwen35) == 2 and len(qwen2) == 3, (qwen35, qwen2)


def test_a_nextn_block_without_its_projection_is_a_one_line_error(tmp_path):
    config, hf = tiny.replica(CONTEXT_STRENGTH)
    tensors = tiny.gguf_tensors(config, hf)
    del tensors["blk.4.nextn.eh_proj.weight"]
    types = {name: tiny.ggml_type(name, 4) for name in tensors}
    path = tiny.write_gguf(tmp_path / "cut.gguf", config, tensors, types)
    with pytest.raises(MtplxError) as e:
        convert_gguf(path, tmp_path / "out")
    message = str(e.value)
    assert "\n" not in message and "blk.4.nextn.eh_proj" in message and "cut.gguf" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_the_cli_converts_at_the_bits_asked_and_refuses_bad_input_in_one_line(gguf_model, tmp_path, capsys):
    from mtplx.cli.main import main

    out = tmp_path / "q8"
    assert main(["convert", str(gguf_model["gguf"]), str(out), "--dtype", "q8", "--head-bits", "float"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["mtplx"]["head_precision"] == {
        "projection": "float",
        "attention": "float",
        "dense": "float",
    }
    capsys.readouterr()
    assert main(["convert", str(gguf_model["gguf"]), str(tmp_path / "bad"), "--dtype", "q7"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unsupported dtype 'q7'" in err and "Traceback" not in err


def test_one_part_of_a_split_gguf_is_a_one_line_error(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "part-00001-of-00002.gguf"), "qwen35")
    writer.add_uint16("split.no", 0)
    writer.add_uint16("split.count", 2)
    writer.add_tensor("x.weight", np.zeros((2, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MtplxError) as e:
        convert_gguf_file(tmp_path / "part-00001-of-00002.gguf", tmp_path / "out", dtype="q4")
    message = str(e.value)
    assert "\n" not in message and "2-file split GGUF" in message and "part-00001-of-00002.gguf" in message


def test_a_gguf_without_a_nextn_block_converts_to_a_plain_model(tmp_path, capsys):
    """Most published GGUFs were converted without the MTP layer: no head, no declared MTP
    layers, the model loads and decodes AR (no error, no missing-head note)."""
    config, hf = tiny.replica(CONTEXT_STRENGTH)
    config["text_config"]["mtp_num_hidden_layers"] = 0
    hf = {k: v for k, v in hf.items() if not k.startswith("mtp.")}
    tensors = tiny.gguf_tensors(config, hf)
    types = {name: tiny.ggml_type(name, 4) for name in tensors}
    out = convert_gguf(tiny.write_gguf(tmp_path / "plain.gguf", config, tensors, types), tmp_path / "out")
    assert not (out / "mtp.safetensors").exists()
    assert "mtp_num_hidden_layers" not in json.loads((out / "config.json").read_text())["text_config"]
    capsys.readouterr()
    engine = Engine.load(str(out))
    assert engine.head is None and "missing" not in capsys.readouterr().err.lower()
