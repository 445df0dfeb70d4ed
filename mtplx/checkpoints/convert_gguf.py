"""Convert a GGUF file into an mlx-lm model directory: the llama family here, Qwen3.5 / 3.6
(``qwen35``, ``qwen35moe``, the nextn block kept as the MTP head) in ``gguf_qwen35``
(Hugging Face checkpoints that keep their MTP head: ``mtplx.checkpoints.convert_hf``).

Output: ``model.safetensors``, ``config.json`` (with a ``quantization`` entry for
``q4``), ``tokenizer.json`` / ``tokenizer_config.json`` /
``special_tokens_map.json`` rebuilt from the GGUF metadata, and
``generation_config.json``. Everything is written into a temporary sibling
directory and renamed into place, so a failed or interrupted conversion never
leaves a half-written model behind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from mtplx.checkpoints import gguf_qwen35
from mtplx.checkpoints.gguf import (
    GGML_F16,
    GGML_F32,
    GGML_Q4_0,
    GGML_Q4_1,
    GGML_Q8_0,
    GGUFFile,
    TensorInfo,
    check_architecture,
    load_tensors,
    read_gguf,
)
from mtplx.checkpoints.output_dir import check_output_dir, write_dir_atomically
from mtplx.errors import MtplxError

import mlx.core as mx

Dtype = Literal["float32", "float16", "bfloat16", "q4"]
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
DTYPES: tuple[str, ...] = (*FLOAT_DTYPES, "q4")
# Bumped whenever the output of the converter changes, so cached conversions are redone.
CONVERTER_VERSION = 2
GROUP_SIZE = 32  # GGUF's Q4_0/Q4_1/Q8_0 block size, kept as the MLX group size

_LAYER_KEYS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_KEYS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# ---------------------------------------------------------------- config


def _meta(gguf: GGUFFile, key: str, default: Any = None) -> Any:
    value = gguf.metadata.get(f"{gguf.architecture}.{key}", default)
    if value is None:
        raise MtplxError(f"{gguf.path}: GGUF metadata lacks {gguf.architecture}.{key}")
    return value


def hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm / transformers ``config.json`` for a llama GGUF."""
    if gguf.metadata.get(f"{gguf.architecture}.rope.scaling.type", "none") not in ("none", ""):
        raise MtplxError(
            f"{gguf.path}: rope scaling ({gguf.metadata[f'{gguf.architecture}.rope.scaling.type']}) is not supported"
        )
    n_heads = int(_meta(gguf, "attention.head_count"))
    hidden = int(_meta(gguf, "embedding_length"))
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_meta(gguf, "feed_forward_length")),
        "num_hidden_layers": int(_meta(gguf, "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_meta(gguf, "attention.head_count_kv", n_heads)),
        "head_dim": int(_meta(gguf, "rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(_meta(gguf, "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(gguf, "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_meta(gguf, "context_length", 2048)),
        "vocab_size": int(_meta(gguf, "vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    for name in ("bos", "eos", "padding"):
        if f"tokenizer.ggml.{name}_token_id" in gguf.metadata:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = int(gguf.metadata[f"tokenizer.ggml.{name}_token_id"])
    return config


# ---------------------------------------------------------------- weights


def hf_name(gguf_name: str) -> str | None:
    """mlx-lm parameter prefix for a GGUF tensor prefix (``blk.3.attn_q`` -> ``model.layers.3.self_attn.q_proj``)."""
    if gguf_name in _GLOBAL_KEYS:
        return _GLOBAL_KEYS[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", gguf_name)
    if m and m.group(2) in _LAYER_KEYS:
        return f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"
    return None


def unpermute_rows(rows: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (a row reorder within each head).

    llama.cpp stores each head's rows interleaved as (pair, half): row 2*i + h holds
    HF row h*(d/2) + i, which suits its adjacent-pair rope. mlx-lm's llama applies
    rope in HF's half-split layout, so the rows go back to (half, pair) order.
    Works on any array whose first axis is the output rows (weights, scales, biases).
    """
    out_rows = rows.shape[0]
    head_dim = out_rows // n_heads
    rest = rows.shape[1:]
    return rows.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out_rows, *rest)


def _bits_of(info: TensorInfo, packed: mx.array) -> int:
    # Packed uint32 columns * 32 bits / logical columns.
    return packed.shape[-1] * 32 // info.shape[-1]


def _tensor_parts(gguf: GGUFFile, arrays: dict[str, mx.array], info: TensorInfo) -> dict[str, mx.array]:
    """{'weight': ...} for float tensors, {'weight','scales','biases'} for packed ones (MLX affine)."""
    base = info.name[: -len(".weight")]
    if info.ggml_type in (GGML_F32, GGML_F16):
        return {"weight": arrays[info.name]}
    if info.ggml_type in (GGML_Q4_0, GGML_Q4_1, GGML_Q8_0):
        try:
            return {
                "weight": arrays[info.name],
                "scales": arrays[f"{base}.scales"],
                "biases": arrays[f"{base}.biases"],
            }
        except KeyError:
            raise MtplxError(f"{gguf.path}: MLX did not unpack quantized tensor {info.name}") from None
    raise MtplxError(f"{gguf.path}: tensor {info.name} has unsupported type {info.type_name}")


def _to_dtype(parts: dict[str, mx.array], info: TensorInfo, dtype: str) -> dict[str, mx.array]:
    """Cast one tensor's parts to the requested output dtype."""
    if dtype != "q4":
        if "scales" in parts:
            # float32 scales/biases: in float16, q*scale + bias (bias = -128*scale for Q8_0)
            # cancels catastrophically and loses ~5% of a quantization step.
            w = mx.dequantize(
                parts["weight"],
                parts["scales"].astype(mx.float32),
                parts["biases"].astype(mx.float32),
                group_size=GROUP_SIZE,
                bits=_bits_of(info, parts["weight"]),
            )
        else:
            w = parts["weight"]
        return {"weight": w.astype(getattr(mx, dtype))}
    if "scales" in parts:
        # Already MLX affine (4-bit for Q4_x, 8-bit for Q8_0): keep it packed, lossless.
        return parts
    w = parts["weight"]
    if w.ndim == 2 and w.shape[-1] % GROUP_SIZE == 0:
        q, s, b = mx.quantize(w.astype(mx.float32), group_size=GROUP_SIZE, bits=4)
        return {"weight": q, "scales": s.astype(mx.float16), "biases": b.astype(mx.float16)}
    return {"weight": w.astype(mx.float32)}  # norms stay float


def convert_weights(
    gguf: GGUFFile,
    dtype: str,
    *,
    unpermute: bool = True,
    on_tensor: Callable[[int, int], None] | None = None,
) -> dict[str, mx.array]:
    """All tensors under mlx-lm names, in ``dtype``. ``unpermute=False`` exists only as a negative control.

    ``on_tensor(done, total)`` reports progress; each tensor is then computed as it goes, not at save time.
    """
    config = hf_config(gguf)
    arrays = load_tensors(gguf)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, mx.array] = {}
    for info in gguf.tensors.values():
        if not info.name.endswith(".weight"):
            raise MtplxError(f"{gguf.path}: unexpected tensor {info.name} (not a llama weight)")
        base = info.name[: -len(".weight")]
        target = hf_name(base)
        if target is None:
            raise MtplxError(f"{gguf.path}: unsupported tensor {info.name} for a llama model")
        parts = _tensor_parts(gguf, arrays, info)
        kind = base.rsplit(".", 1)[-1]
        if unpermute and kind in heads:
            parts = {k: unpermute_rows(v, heads[kind]) for k, v in parts.items()}
        converted = _to_dtype(parts, info, dtype)
        for suffix, value in converted.items():
            out[f"{target}.{suffix}"] = value
        if on_tensor is not None:
            mx.eval(*converted.values())
            on_tensor(len(out), len(gguf.tensors))
    return out


def _quantization_entry(weights: dict[str, mx.array]) -> dict[str, Any] | None:
    """The config's mlx-lm ``quantization`` entry for converted weights (what
    `checkpoint.quantization_config` reads back); per-layer bits are inferred by mlx-lm from the packed shapes."""
    if not any(k.endswith(".scales") for k in weights):
        return None
    return {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}


# ---------------------------------------------------------------- tokenizer


# llama.cpp pre-tokenizer names -> whether digits are split one by one before the GPT-2 regex.
_GPT2_STYLE_PRE = {
    "default": False,
    "gpt-2": False,
    "gpt2": False,
    "smollm": True,
    "starcoder": True,
    "refact": True,
}
# llama.cpp pre-tokenizer names -> the split regex of the model's own tokenizer.json (quoted in
# llama.cpp's ``llama-vocab.cpp`` for LLAMA_VOCAB_PRE_TYPE_QWEN2 / QWEN35; Qwen3.5 adds \p{M}),
# applied before a byte-level step without its own regex, after NFC, as Qwen's tokenizer.json does.
_SPLIT_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _pre_tokenizer(gguf: GGUFFile, pre: str):
    """The pre-tokenizer (and normalizer, or None) for llama.cpp's pre-tokenizer name ``pre``."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    add_prefix = bool(gguf.metadata.get("tokenizer.ggml.add_space_prefix", False))
    if pre in _SPLIT_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=False)
        return pre_tokenizers.Sequence([split, byte_level]), normalizers.NFC()
    if pre not in _GPT2_STYLE_PRE:
        supported = ", ".join([*_GPT2_STYLE_PRE, *_SPLIT_PRE])
        raise MtplxError(f"{gguf.path}: unsupported pre-tokenizer {pre!r} (supported: {supported})")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True)
    if _GPT2_STYLE_PRE[pre]:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), None
    return byte_level, None


def build_tokenizer(gguf: GGUFFile):
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF vocabulary, merges and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    md = gguf.metadata
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise MtplxError(
            f"{gguf.path}: unsupported tokenizer model {md.get('tokenizer.ggml.model')!r} (only byte-level BPE 'gpt2')"
        )
    pre_tokenizer, normalizer = _pre_tokenizer(gguf, md.get("tokenizer.ggml.pre", "default"))
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = md.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens must never be split by BPE.
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    specials = [
        AddedToken(tokens[i], special=(t == 3), normalized=False) for i, t in enumerate(types) if t in (3, 4)
    ]
    tok.add_tokens(specials)
    return tok


def tokenizer_files(gguf: GGUFFile) -> dict[str, Any]:
    """tokenizer_config.json and special_tokens_map.json contents."""
    md = gguf.metadata
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    def token(name: str) -> str | None:
        idx = md.get(f"tokenizer.ggml.{name}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    special_map = {
        k: v
        for k, v in {
            "bos_token": token("bos"),
            "eos_token": token("eos"),
            "unk_token": token("unknown"),
            "pad_token": token("padding"),
        }.items()
        if v is not None
    }
    added = {
        str(i): {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t == 3,
        }
        for i, t in enumerate(types)
        if t in (3, 4)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(md.get(f"{gguf.architecture}.context_length", 2048)),
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            tokens[i] for i, t in enumerate(types) if t == 3 and tokens[i] not in special_map.values()
        ],
        **special_map,
    }
    if "tokenizer.chat_template" in md:
        config["chat_template"] = md["tokenizer.chat_template"]
    return {"tokenizer_config.json": config, "special_tokens_map.json": special_map}


# ---------------------------------------------------------------- driver


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_dir(
    gguf: GGUFFile, out: Path, dtype: str, on_tensor: Callable[[int, int], None] | None = None
) -> None:
    """Write every file of the model directory into ``out`` (an existing, empty directory)."""
    config = hf_config(gguf)
    tokenizer = build_tokenizer(gguf)  # before the weights: fail fast on an unsupported vocab
    weights = convert_weights(gguf, dtype, on_tensor=on_tensor)
    quant = _quantization_entry(weights)
    if quant is not None:
        config["quantization"] = quant
        config["quantization_config"] = quant
    else:
        config["torch_dtype"] = dtype
    config["mtplx"] = {
        "converted_from": gguf.path.name,
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
    }
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    write_tokenizer(gguf, tokenizer, out, config)


def write_tokenizer(gguf: GGUFFile, tokenizer: Any, out: Path, config: dict) -> None:
    """tokenizer.json, its config files and generation_config.json (the config's token ids)."""
    tokenizer.save(str(out / "tokenizer.json"))
    for name, obj in tokenizer_files(gguf).items():
        _write_json(out / name, obj)
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out / "generation_config.json", gen)


def write_qwen35_dir(gguf: GGUFFile, out: Path, dtype: str) -> None:
    """A Qwen3.5 GGUF's float model directory in ``out`` (``gguf_qwen35.write_float_dir``), with
    the tokenizer from its metadata and the conversion mark."""
    tokenizer = build_tokenizer(gguf)  # before the weights: fail fast on an unsupported vocab
    config = gguf_qwen35.write_float_dir(gguf, out, dtype)
    config["mtplx"] = {
        "converted_from": gguf.path.name,
        "converter_version": CONVERTER_VERSION,
        "dtype": dtype,
    }
    _write_json(out / "config.json", config)
    write_tokenizer(gguf, tokenizer, out, config)


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    dtype: Dtype = "float32",
    overwrite: bool = False,
    on_tensor: Callable[[int, int], None] | None = None,
) -> Path:
    """Convert a GGUF into an mlx-lm model directory; returns it.

    llama (Q4_0/Q4_1/Q8_0/F16/F32 tensors): a float ``dtype`` dequantizes everything; ``"q4"``
    keeps Q4_0/Q4_1 blocks packed as MLX 4-bit (and Q8_0 as 8-bit, both lossless) and quantizes
    float matrices to 4-bit. ``on_tensor(done, total)`` reports progress (see `convert_weights`).
    qwen35 / qwen35moe (``gguf_qwen35``; every type of ``gguf_quants``): every tensor dequantized
    exactly, in a float ``dtype`` (``gguf_requantize`` quantizes that directory).
    The output appears atomically (temp dir + rename); an existing ``out_dir`` is refused
    unless ``overwrite``.
    """
    if dtype not in DTYPES:
        raise MtplxError(f"unsupported dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    out_dir = check_output_dir(out_dir, overwrite, inputs=[gguf_path])
    gguf = read_gguf(gguf_path)
    check_architecture(gguf)
    if gguf.architecture in gguf_qwen35.ARCHITECTURES:
        if dtype not in FLOAT_DTYPES:
            raise MtplxError(f"{gguf.path}: a {gguf.architecture} GGUF converts to a float dtype here")
        return write_dir_atomically(out_dir, lambda tmp: write_qwen35_dir(gguf, tmp, dtype))
    return write_dir_atomically(out_dir, lambda tmp: write_model_dir(gguf, tmp, dtype, on_tensor))
