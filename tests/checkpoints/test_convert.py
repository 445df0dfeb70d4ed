"""GGUF -> mlx-lm conversion, on the real default model and on tiny hand-built GGUF files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.checkpoints.convert_gguf import convert_gguf, convert_weights
from mtplx.checkpoints.gguf import GGML_F16, GGML_F32, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, read_gguf, write_gguf
from mtplx.checkpoints.load import default_gguf_path
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import generate as mlx_lm_generate
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model as mlx_load_model

# Ordinary English written for this test: an encyclopedic paragraph set (predictable; the float32
# model scores ~5.0 on it alone) and a narrative one (~22.5 alone). Together: ~11.4 over ~550 tokens.
ENCYCLOPEDIC = """\
The water cycle describes how water moves between the land, the oceans and the atmosphere. Heat from the sun causes water to evaporate from the surface of oceans, lakes and rivers. Plants also release water vapor into the air through their leaves, a process known as transpiration. As the warm, moist air rises, it cools, and the water vapor condenses into tiny droplets that form clouds. When the droplets grow large enough, they fall back to the ground as rain, snow or hail.

Some of this water flows over the surface of the land and collects in streams and rivers, which carry it back to the sea. Some of it soaks into the soil and becomes groundwater, which can stay underground for many years before it reaches a spring or a well. In cold regions, water can be stored as ice in glaciers and polar ice caps for thousands of years.

The water cycle is important for life on Earth. It provides fresh water for people, animals and plants, and it helps to move heat around the planet. Changes in the climate can affect the water cycle, leading to more frequent droughts in some areas and heavier rainfall and flooding in others. Scientists study the water cycle to better understand these changes and to help communities plan for the future.
"""
NARRATIVE = """\
Most people who bake bread at home learn the same lesson sooner or later: the recipe is only half of the story.
Flour, water, salt and yeast are cheap and simple, but the way they behave depends on the temperature of the
kitchen, the age of the flour and the patience of the baker. On a cold winter morning the dough may take twice
as long to rise as it does in the middle of summer, and a loaf that is rushed into the oven will be dense and
pale. Experienced bakers therefore watch the dough rather than the clock. They press a finger gently into the
surface and see how slowly it springs back. They look for small bubbles at the edges of the bowl, and they
notice the faint, sour smell that tells them the yeast has been busy.

The oven matters just as much. A hot oven gives the loaf a burst of steam and a dark, crisp crust, while a
cooler one produces a softer crust that many children prefer. Some people place a tray of water on the bottom
shelf to keep the air moist during the first few minutes of baking. Others bake inside a heavy pot with a lid,
which traps the steam in a similar way. When the bread is finally done, it should sound hollow when tapped on
the bottom. The hardest part, for most families, is waiting until it has cooled before cutting the first slice.
"""
PASSAGE = ENCYCLOPEDIC + "\n" + NARRATIVE


def _greedy(model, tokenizer, prompt: str, max_tokens: int = 6) -> str:
    """Greedy continuation (mlx-lm's default sampler is argmax) with a KV cache."""
    return mlx_lm_generate(model, tokenizer, prompt, max_tokens=max_tokens)


def _perplexity(model, tokenizer, text: str) -> tuple[float, int]:
    ids = tokenizer.encode(text)
    logits = model(mx.array([ids[:-1]]))[0].astype(mx.float32)
    targets = mx.array(ids[1:])
    nll = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    return math.exp(mx.mean(nll).item()), len(ids) - 1


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    return default_gguf_path()


@pytest.fixture(scope="session")
def converted(tmp_path_factory, smollm_gguf) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("converted")
    return {dtype: convert_gguf(smollm_gguf, root / dtype, dtype=dtype) for dtype in ("float32", "q4")}


@pytest.fixture(scope="session")
def loaded(converted) -> dict[str, tuple]:
    return {dtype: mlx_lm_load(str(path)) for dtype, path in converted.items()}


# ---------------------------------------------------------------- the real default model


def test_config_describes_smollm2(converted):
    config = json.loads((converted["float32"] / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "vocab_size": 49152,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }
    assert {k: config[k] for k in expected} == expected
    assert "quantization" not in config
    q4 = json.loads((converted["q4"] / "config.json").read_text())
    assert q4["quantization"] == {"group_size": 32, "bits": 4, "mode": "affine"}


def test_output_is_written_atomically(converted):
    leftovers = [p.name for p in converted["float32"].parent.iterdir() if p.name.startswith(".")]
    assert leftovers == []


@pytest.mark.parametrize("dtype", ["float32", "q4"])
def test_greedy_continuation_knows_paris(loaded, dtype):
    model, tokenizer = loaded[dtype]
    assert "Paris" in _greedy(model, tokenizer, "The capital of France is")


def test_perplexity_on_ordinary_english(loaded):
    ppl, n = _perplexity(*loaded["float32"], PASSAGE)
    print(f"float32 perplexity over {n} tokens: {ppl:.2f}")
    assert n >= 500
    assert 6.0 < ppl < 16.0


def test_q4_and_float32_builds_agree(loaded):
    """Both builds hold the same GGUF numbers (packed vs dequantized), so their logits match closely.

    (Short input on purpose: 4-bit matmuls are slow on the CPU backend.)
    """
    ids = mx.array([loaded["float32"][1].encode("The water cycle describes how water moves between")])
    logp = {d: nn_log_softmax(loaded[d][0](ids)[0].astype(mx.float32)) for d in ("float32", "q4")}
    assert mx.max(mx.abs(logp["float32"] - logp["q4"])).item() < 0.05
    assert mx.array_equal(mx.argmax(logp["float32"], -1), mx.argmax(logp["q4"], -1)).item()


def nn_log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def test_unpermute_is_necessary(converted, smollm_gguf, loaded):
    """Negative control: the same conversion minus the Q/K un-permute breaks the model."""
    broken_weights = convert_weights(read_gguf(smollm_gguf), "float32", unpermute=False)
    broken, _ = mlx_load_model(converted["float32"], lazy=True)
    broken.load_weights(list(broken_weights.items()))
    tokenizer = loaded["float32"][1]
    text = ENCYCLOPEDIC[:600]
    ppl_good, _ = _perplexity(loaded["float32"][0], tokenizer, text)
    ppl_broken, _ = _perplexity(broken, tokenizer, text)
    continuation = _greedy(broken, tokenizer, "The capital of France is")
    print(f"without un-permute: {continuation!r}, perplexity {ppl_broken:.1f} (vs {ppl_good:.1f})")
    # Measured: perplexity ~32 vs ~4.7. Short, very common facts can survive ("Paris" still
    # comes out), so the control is the perplexity, which degrades by ~7x.
    assert ppl_broken > 5 * ppl_good
    # Independent proof that the un-permute is exactly right: llama.cpp's row order is what
    # adjacent-pair ("traditional") rope expects, so that rope on the raw rows must reproduce it.
    traditional, _ = mlx_load_model(converted["float32"], lazy=True, model_config={"rope_traditional": True})
    traditional.load_weights(list(broken_weights.items()))
    ppl_traditional, _ = _perplexity(traditional, tokenizer, text)
    assert abs(ppl_traditional - ppl_good) / ppl_good < 1e-3


ROUND_TRIP_TEXTS = [
    'def reverse(s: str) -> str:\n    return s[::-1]  # slices are cheap\n\n\tif x >= 10:\n\t\tprint(f"{x!r}")\n',
    "The quick brown fox jumps over the lazy dog. It's 2024; prices rose 3.5% (again)!",
    "Ça coûte 12 €, naïve façade — Grüße aus München. Привет, мир! 你好，世界。こんにちは 🙂👍🏽",
    "  leading spaces, trailing spaces   \n\n\nmultiple\r\nnewlines\u00a0nbsp",
]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=["code", "prose", "non-ascii", "whitespace"])
def test_tokenizer_round_trips(loaded, text):
    tokenizer = loaded["float32"][1]
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    # Byte-level BPE with real merges compresses text well below one token per character.
    assert len(ids) < len(text)


def test_tokenizer_matches_smollm_pretokenization(loaded):
    tokenizer = loaded["float32"][1]
    # llama.cpp's "smollm" pre-tokenizer splits digits one by one.
    assert len(tokenizer.encode("12345")) == 5
    # Common words with their leading space are single tokens.
    assert len(tokenizer.encode(" the")) == 1 and len(tokenizer.encode(" capital")) == 1
    # Control tokens are atomic, with their GGUF ids.
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert tokenizer.eos_token_id == 2


def test_chat_template_renders_chatml(loaded, converted):
    tokenizer = loaded["float32"][1]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.startswith("<|im_start|>system\n")
    # transformers alone (no mlx-lm) loads the directory offline too.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(converted["float32"]), local_files_only=True)
    assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == text
    assert hf.encode(ROUND_TRIP_TEXTS[2]) == tokenizer.encode(ROUND_TRIP_TEXTS[2])


# ---------------------------------------------------------------- tiny GGUF files (every tensor type)

HIDDEN, HEADS, KV_HEADS, FFN = 64, 2, 1, 96
HEAD_DIM = HIDDEN // HEADS


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """GGUF Q4 layout: byte j of a block holds element j (low nibble) and j + 16 (high nibble)."""
    return (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)


def quantize_reference(w: np.ndarray, ggml_type: int) -> tuple[bytes, np.ndarray]:
    """(GGUF block bytes, the exact values a correct reader must recover), written from the GGUF spec."""
    if ggml_type == GGML_F32:
        return w.astype("<f4").tobytes(), w.astype(np.float32)
    if ggml_type == GGML_F16:
        return w.astype("<f2").tobytes(), w.astype(np.float16).astype(np.float32)
    blocks = w.reshape(-1, 32).astype(np.float32)
    if ggml_type == GGML_Q8_0:
        d = _f16(np.abs(blocks).max(1, keepdims=True) / 127)
        q = np.clip(np.round(blocks / d.astype(np.float32)), -127, 127).astype(np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=1)
        return raw.tobytes(), (q * d.astype(np.float32)).reshape(w.shape)
    if ggml_type == GGML_Q4_0:
        d = _f16(np.abs(blocks).max(1, keepdims=True) / 7)
        q = np.clip(np.round(blocks / d.astype(np.float32)) + 8, 0, 15).astype(np.uint8)
        raw = np.concatenate([d.view(np.uint8), _nibbles(q)], axis=1)
        return raw.tobytes(), ((q.astype(np.float32) - 8) * d.astype(np.float32)).reshape(w.shape)
    if ggml_type == GGML_Q4_1:
        lo, hi = blocks.min(1, keepdims=True), blocks.max(1, keepdims=True)
        d, m = _f16((hi - lo) / 15), _f16(lo)
        q = np.clip(np.round((blocks - m.astype(np.float32)) / d.astype(np.float32)), 0, 15).astype(np.uint8)
        raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), _nibbles(q)], axis=1)
        return raw.tobytes(), (q * d.astype(np.float32) + m.astype(np.float32)).reshape(w.shape)
    raise ValueError(ggml_type)


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order, re-derived: per head, row 2*i + h <- HF row h*(d/2) + i."""
    d = w.shape[0] // n_heads
    out = np.empty_like(w)
    for head in range(n_heads):
        for i in range(d // 2):
            for h in range(2):
                out[head * d + 2 * i + h] = w[head * d + h * (d // 2) + i]
    return out


# GGUF name -> (shape, type): every supported type appears at least once.
TINY_TENSORS = {
    "token_embd": ((258, HIDDEN), GGML_Q8_0),
    "output_norm": ((HIDDEN,), GGML_F32),
    "output": ((258, HIDDEN), GGML_Q4_0),
    "blk.0.attn_norm": ((HIDDEN,), GGML_F32),
    "blk.0.attn_q": ((HEADS * HEAD_DIM, HIDDEN), GGML_Q4_0),
    "blk.0.attn_k": ((KV_HEADS * HEAD_DIM, HIDDEN), GGML_Q4_1),
    "blk.0.attn_v": ((KV_HEADS * HEAD_DIM, HIDDEN), GGML_F16),
    "blk.0.attn_output": ((HIDDEN, HEADS * HEAD_DIM), GGML_Q8_0),
    "blk.0.ffn_norm": ((HIDDEN,), GGML_F32),
    "blk.0.ffn_gate": ((FFN, HIDDEN), GGML_Q4_1),
    "blk.0.ffn_up": ((FFN, HIDDEN), GGML_F16),
    "blk.0.ffn_down": ((HIDDEN, FFN), GGML_F32),
}
HF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.0.attn_norm": "model.layers.0.input_layernorm",
    "blk.0.attn_q": "model.layers.0.self_attn.q_proj",
    "blk.0.attn_k": "model.layers.0.self_attn.k_proj",
    "blk.0.attn_v": "model.layers.0.self_attn.v_proj",
    "blk.0.attn_output": "model.layers.0.self_attn.o_proj",
    "blk.0.ffn_norm": "model.layers.0.post_attention_layernorm",
    "blk.0.ffn_gate": "model.layers.0.mlp.gate_proj",
    "blk.0.ffn_up": "model.layers.0.mlp.up_proj",
    "blk.0.ffn_down": "model.layers.0.mlp.down_proj",
}


def tiny_metadata(arch: str = "llama") -> dict:
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_start|>", "<|im_end|>"]
    return {
        "general.architecture": arch,
        f"{arch}.block_count": 1,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": FFN,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.context_length": 128,
        f"{arch}.vocab_size": len(tokens),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
    }


def write_tiny_gguf(
    path: Path, *, arch: str = "llama", overrides: dict | None = None, metadata: dict | None = None
) -> dict[str, np.ndarray]:
    """A one-layer llama GGUF with random weights; returns the HF-ordered values a converter must produce."""
    rng = np.random.default_rng(0)
    tensors, expected = {}, {}
    for name, (shape, ggml_type) in {**TINY_TENSORS, **(overrides or {})}.items():
        w = rng.standard_normal(shape).astype(np.float32) * (1.0 if len(shape) == 1 else 0.05)
        raw, values = quantize_reference(w, ggml_type) if ggml_type in (0, 1, 2, 3, 8) else (b"\0" * 4096, w)
        expected[HF_NAMES.get(name, name)] = values
        if name.endswith(
            ("attn_q", "attn_k")
        ):  # stored in llama.cpp's order; quantization is per row so it commutes
            heads = HEADS if name.endswith("attn_q") else KV_HEADS
            raw, _ = quantize_reference(llamacpp_permute(w, heads), ggml_type)
        tensors[f"{name}.weight"] = (ggml_type, shape, raw)
    meta = {k: v for k, v in {**tiny_metadata(arch), **(metadata or {})}.items() if v is not None}
    write_gguf(path, meta, tensors)
    return expected


def test_every_tensor_type_converts_exactly(tmp_path):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf")
    info = read_gguf(tmp_path / "tiny.gguf")
    assert {t.type_name for t in info.tensors.values()} == {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny-f32", dtype="float32")
    weights = mx.load(str(out / "model.safetensors"))
    assert set(weights) == {f"{k}.weight" for k in expected}
    for name, values in expected.items():
        got = np.array(weights[f"{name}.weight"])
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, values, rtol=1e-6, atol=1e-7, err_msg=name)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q4"])
def test_other_dtypes_load_and_agree_with_float32(tmp_path, dtype):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    ref_model, tok = mlx_lm_load(str(convert_gguf(tmp_path / "tiny.gguf", tmp_path / "f32", dtype="float32")))
    model, _ = mlx_lm_load(str(convert_gguf(tmp_path / "tiny.gguf", tmp_path / dtype, dtype=dtype)))
    ids = mx.array([tok.encode("hello, world 42")])
    ref, got = ref_model(ids).astype(mx.float32), model(ids).astype(mx.float32)
    # Lossy only where the dtype is: fp16/bf16 rounding, or 4-bit re-quantization of the F16/F32/Q8_0-free matrices.
    tol = {"float16": 0.01, "bfloat16": 0.05, "q4": 0.25}[dtype]
    assert mx.max(mx.abs(ref - got)).item() < tol * max(1.0, mx.max(mx.abs(ref)).item())
    if dtype == "q4":
        weights = mx.load(str(tmp_path / dtype / "model.safetensors"))
        # Q4_0/Q4_1 blocks are kept packed at 4 bits, Q8_0 at 8 bits: lossless.
        assert weights["model.layers.0.self_attn.q_proj.weight"].shape == (HEADS * HEAD_DIM, HIDDEN * 4 // 32)
        assert weights["model.embed_tokens.weight"].shape == (258, HIDDEN * 8 // 32)


# ---------------------------------------------------------------- bad input


def _one_line_error_naming(excinfo, name: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and name in message, message


def test_missing_gguf(tmp_path):
    with pytest.raises(MtplxError) as e:
        convert_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    _one_line_error_naming(e, "nope.gguf")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep_fraction", [0.0005, 0.6], ids=["in-metadata", "in-tensor-data"])
def test_truncated_gguf(tmp_path, smollm_gguf, keep_fraction):
    cut = tmp_path / "cut.gguf"
    with open(smollm_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(int(smollm_gguf.stat().st_size * keep_fraction)))
    with pytest.raises(MtplxError, match="truncated") as e:
        convert_gguf(cut, tmp_path / "out")
    _one_line_error_naming(e, "cut.gguf")
    assert list(tmp_path.iterdir()) == [cut]  # nothing written


def test_not_a_gguf(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 4)
    with pytest.raises(MtplxError, match="not a GGUF") as e:
        convert_gguf(bogus, tmp_path / "out")
    _one_line_error_naming(e, "bogus.gguf")


def test_corrupt_gguf_header(tmp_path):
    path = tmp_path / "corrupt.gguf"
    write_tiny_gguf(path)
    raw = bytearray(path.read_bytes())
    raw[24:32] = struct.pack("<Q", 2**40)  # first metadata key length: absurd
    path.write_bytes(bytes(raw))
    with pytest.raises(MtplxError) as e:
        read_gguf(path)
    _one_line_error_naming(e, "corrupt.gguf")


def test_unsupported_architecture(tmp_path):
    write_tiny_gguf(tmp_path / "mamba.gguf", arch="mamba")
    with pytest.raises(MtplxError, match="unsupported GGUF architecture 'mamba'") as e:
        convert_gguf(tmp_path / "mamba.gguf", tmp_path / "out")
    _one_line_error_naming(e, "mamba.gguf")


def test_unsupported_tensor_type(tmp_path):
    # IQ4_NL (ggml type 20) is a real llama.cpp type the converter does not handle.
    write_tiny_gguf(tmp_path / "iq4nl.gguf", overrides={"blk.0.ffn_up": ((FFN, HIDDEN), 20)})
    with pytest.raises(MtplxError, match="unsupported type IQ4_NL") as e:
        convert_gguf(tmp_path / "iq4nl.gguf", tmp_path / "out")
    _one_line_error_naming(e, "iq4nl.gguf")


def test_failure_mid_conversion_leaves_nothing(tmp_path):
    # A tensor the llama mapping does not know: detected after the tokenizer was built.
    write_tiny_gguf(tmp_path / "odd.gguf", overrides={"blk.0.attn_sinks": ((HIDDEN,), GGML_F32)})
    with pytest.raises(MtplxError, match="blk.0.attn_sinks") as e:
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "out")
    _one_line_error_naming(e, "odd.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype="q4")
    with pytest.raises(MtplxError, match="already exists"):
        convert_gguf(tmp_path / "tiny.gguf", out, dtype="float32")
    convert_gguf(tmp_path / "tiny.gguf", out, dtype="float32", overwrite=True)
    assert json.loads((out / "config.json").read_text())["mtplx"]["dtype"] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.gguf"]


def test_bad_dtype(tmp_path):
    with pytest.raises(MtplxError, match="unsupported dtype 'int3'"):
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="int3")


@pytest.mark.parametrize(
    "metadata, problem",
    [
        ({"tokenizer.ggml.model": "llama"}, "unsupported tokenizer model 'llama'"),
        ({"tokenizer.ggml.pre": "falcon"}, "unsupported pre-tokenizer 'falcon'"),
        ({"llama.block_count": None}, "lacks llama.block_count"),
    ],
    ids=["sentencepiece", "pre-tokenizer", "missing-key"],
)
def test_unsupported_metadata(tmp_path, metadata, problem):
    write_tiny_gguf(tmp_path / "meta.gguf", metadata=metadata)
    with pytest.raises(MtplxError, match=problem) as e:
        convert_gguf(tmp_path / "meta.gguf", tmp_path / "out")
    _one_line_error_naming(e, "meta.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meta.gguf"]


# ---------------------------------------------------------------- where the output may go (issue 49 items 1, 8, 13)


def _convert_cli(*args: str, cwd: Path | None = None) -> tuple[int, str]:
    """`mtplx convert ARGS` through the CLI's entry point in this process: (exit code, stderr)."""
    import contextlib
    import io
    import os

    from mtplx.cli.main import main

    stderr = io.StringIO()
    here = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = main(["convert", *args])
    finally:
        os.chdir(here)
    return code, stderr.getvalue()


def _refused(code: int, stderr: str, *words: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    for word in words:
        assert word in lines[0], lines[0]


def _tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(
    "layout, out, problem",
    [
        ("model.gguf", "model.gguf", "the output is the input"),
        ("holder/model.gguf", "holder", "contains the input"),
        ("model.gguf", "model.gguf/inside", "lies inside the input"),
        ("holder/model.gguf", ".", "contains the input"),
    ],
    ids=["is-the-input", "contains-the-input", "inside-the-input", "dot-contains-the-input"],
)
def test_output_that_is_contains_or_lies_in_the_input_is_refused_untouched(tmp_path, layout, out, problem):
    gguf = tmp_path / layout
    gguf.parent.mkdir(parents=True, exist_ok=True)
    write_tiny_gguf(gguf)
    (gguf.parent / "unrelated.txt").write_text("keep me")
    before = _tree(tmp_path)
    cwd = gguf.parent if out == "." else tmp_path
    _refused(*_convert_cli(str(gguf), out, "--overwrite", cwd=cwd), problem)
    assert _tree(tmp_path) == before


def test_output_dot_elsewhere_is_refused_as_the_current_directory(tmp_path):
    write_tiny_gguf(tmp_path / "model.gguf")
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    _refused(*_convert_cli(str(tmp_path / "model.gguf"), ".", "--overwrite", cwd=work), "current directory")
    assert _tree(tmp_path) == before


def test_output_under_a_regular_file_or_onto_one_is_one_line(tmp_path):
    write_tiny_gguf(tmp_path / "model.gguf")
    (tmp_path / "plain.txt").write_text("x")
    _refused(*_convert_cli(str(tmp_path / "model.gguf"), str(tmp_path / "plain.txt" / "out")), "is a file")
    _refused(
        *_convert_cli(str(tmp_path / "model.gguf"), str(tmp_path / "plain.txt"), "--overwrite"),
        "not a directory",
    )
    assert (tmp_path / "plain.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "plain.txt"]


def test_existing_output_names_the_flag(tmp_path):
    write_tiny_gguf(tmp_path / "model.gguf")
    (tmp_path / "out").mkdir()
    _refused(*_convert_cli(str(tmp_path / "model.gguf"), str(tmp_path / "out")), "pass --overwrite")


def test_truncated_100_byte_gguf_is_called_truncated(tmp_path):
    write_tiny_gguf(tmp_path / "model.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "model.gguf").read_bytes()[:100])
    _refused(*_convert_cli(str(cut), str(tmp_path / "out")), "cut.gguf", "truncated GGUF")
    assert not (tmp_path / "out").exists()


def _read_only_argv(directory: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``directory`` read-only: a read-only bind mount in a private mount
    namespace as root (root writes through a chmod), a chmod otherwise."""
    import os

    if os.geteuid() != 0:
        directory.chmod(0o555)
        return argv
    mount = f"mount --bind {directory} {directory} && mount -o remount,ro,bind {directory}"
    return ["unshare", "-m", "sh", "-c", f'{mount} && exec "$@"', "sh", *argv]


def test_output_on_a_read_only_filesystem_is_one_line(tmp_path):
    import os
    import subprocess
    import sys

    from support.paths import REPO

    write_tiny_gguf(tmp_path / "model.gguf")
    (tmp_path / "locked").mkdir()
    argv = [
        sys.executable,
        "-m",
        "mtplx",
        "convert",
        str(tmp_path / "model.gguf"),
        str(tmp_path / "locked" / "out"),
    ]
    try:
        out = subprocess.run(
            _read_only_argv(tmp_path / "locked", argv),
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        (tmp_path / "locked").chmod(0o755)
    _refused(out.returncode, out.stderr, "cannot write in", "locked")
    assert list((tmp_path / "locked").iterdir()) == []


def test_sigterm_mid_convert_leaves_no_temp_folder(tmp_path, smollm_gguf):
    import os
    import signal
    import subprocess
    import sys
    import time

    from support.paths import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtplx", "convert", str(smollm_gguf), str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 240
        while not any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in stderr, stderr
    assert list(tmp_path.iterdir()) == []
