"""Convert a Hugging Face checkpoint to a quantized mlx-lm directory that keeps its MTP head.

mlx-lm's converter drops the MTP tensors (``mtp.*``, DeepSeek's extra ``model.layers.N.*``,
``model.mtp_layers.*``): its ``sanitize`` filters them before the model is built. Here the
trunk goes through mlx-lm's own path (``load_model``, the ``mlx_lm.convert`` dtype cast,
``quantize_model``, ``save_model``, ``save_config``: same ``q_bits`` / ``q_group_size``), and
the head is loaded by ``mtplx.heads`` from the source (every HF convention resolved: fused
``kv_b_proj`` split, experts stacked, Qwen norms as plain scales) and written beside the
trunk's shards as ``mtp.safetensors``, under the checkpoint names the head loader reads.
That file is outside the shard index, so mlx-lm never sees it and ``mlx_lm.load`` opens the
directory as an ordinary quantized model; ``mtplx`` finds it as a sidecar.

The head's precision (``mtplx.heads.precision``): by default its attention, projection and
dense parts at max(trunk bits, 8) and its routed experts at the trunk's bits; ``head_bits="float"``
keeps it unquantized, an int gives every head layer that width. Layers whose width differs
from the trunk's get a per-layer entry in the ``quantization`` block (the form mlx-lm uses for
mixed precision); layers the head loader already holds quantized (an FP8 head read as mxfp8 or
8-bit affine) stay as they are. What each group got is recorded in the config's ``mtplx`` block
(``head_precision``), which ``mtplx inspect`` shows.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Literal

from mtplx.checkpoints.output_dir import check_output_dir, write_dir_atomically
from mtplx.errors import MtplxError, shown
from mtplx.heads import precision

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

HEAD_FILE = "mtp.safetensors"
FLOAT_DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert's MODEL_CONVERSION_DTYPES
HeadBits = int | Literal["float"] | None
# Everything of a HF repo a converted model needs besides the weights (mlx-lm's save copies
# the tokenizer via save_pretrained, *.py and generation_config.json).
_AUX_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template*",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "*.py",
)
_DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def resolve_source(source: str | Path, hub_cache: str | Path | None = None) -> Path:
    """A local checkpoint directory for ``source``: a directory, or a Hugging Face repo id
    (taken from the hub cache when it is there, else downloaded with ``snapshot_download``)."""
    from mtplx.model_files.hub import is_repo_id

    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise MtplxError(f"{path}: not a checkpoint directory or a .gguf file")
    if not (isinstance(source, str) and is_repo_id(source)):
        raise MtplxError(f"{shown(path)}: checkpoint directory not found")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, local_files_only=True, cache_dir=hub_cache))
    except Exception:  # not cached: fetch it (convert is the one command that downloads)
        pass
    try:
        return Path(snapshot_download(source, cache_dir=hub_cache, allow_patterns=_DOWNLOAD_PATTERNS))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise MtplxError(f"{source}: not a local directory and cannot be downloaded ({first})") from None


def _source_dtype(config: dict) -> str | None:
    """The float dtype ``mlx_lm.convert`` casts to: ``torch_dtype``, else ``text_config.dtype``."""
    dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    return dtype if dtype in FLOAT_DTYPES else None


def _cast(module: nn.Module, dtype: str, predicate: Any = None) -> None:
    target = getattr(mx, dtype)
    keep = predicate or (lambda _: True)

    def cast(path: str, v: mx.array) -> mx.array:
        return v.astype(target) if keep(path) and mx.issubdtype(v.dtype, mx.floating) else v

    module.update(tree_map_with_path(cast, module.parameters()))


def quantize_head(
    head: nn.Module, head_bits: HeadBits, trunk_bits: int, group_size: int, trunk_predicate: Any
) -> None:
    """Quantize the head's quantizable layers (mlx-lm's rule: ``to_quantized`` and the input
    dimension a multiple of the group size) at ``head_bits`` (an int: every layer; None: each
    layer's ``precision.default_bits`` for its group). The trunk model's ``quant_predicate``
    applied to the head's paths decides first (False skips a layer, a dict is its own setting:
    Qwen's 8-bit router gates). Layers already quantized (an FP8 head loaded as mxfp8) are kept."""
    if head_bits == "float":
        return
    names = head.checkpoint_keys()
    requantize_packed(head, names, head_bits, trunk_bits, group_size)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        own = trunk_predicate(path, module) if trunk_predicate is not None else True
        if own is False:
            return False
        if isinstance(own, dict):
            return own
        group = precision.tensor_group(names.get(f"{path}.weight", path))
        bits = head_bits if isinstance(head_bits, int) else precision.default_bits(group, trunk_bits)
        return {"group_size": group_size, "bits": bits, "mode": "affine"}

    nn.quantize(head, class_predicate=predicate)


def requantize_packed(
    head: nn.Module, names: dict[str, str], head_bits: HeadBits, trunk_bits: int, group_size: int
) -> None:
    """Head layers the loader holds packed at 8 bits (an FP8 head read as mxfp8 / 8-bit affine)
    whose width here is lower (routed experts beside a 4-bit trunk, or ``--head-bits 4``) are
    re-packed at it, affine, one layer at a time: its float copy lives only while that layer is
    converted. Layers whose width here is 8 or more stay as loaded (nothing to gain over FP8)."""
    for path, module in head.named_modules():
        if not hasattr(module, "scales") or module.weight.shape[-1] * 32 // module.bits % group_size:
            continue
        group = precision.tensor_group(names.get(f"{path}.weight", path))
        bits = head_bits if isinstance(head_bits, int) else precision.default_bits(group, trunk_bits)
        if bits >= module.bits:
            continue
        w = mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            module.group_size,
            module.bits,
            mode=module.mode,
        )
        module.weight, module.scales, module.biases = mx.quantize(w, group_size=group_size, bits=bits)
        module.group_size, module.bits, module.mode = group_size, bits, "affine"
        mx.eval(module.weight, module.scales, module.biases)


def head_layer_precision(head: nn.Module, group_size: int) -> dict[str, dict | str]:
    """``{checkpoint layer name: {"group_size", "bits", "mode"} or "float"}`` for every head layer
    that is quantized or could be (``to_quantized``, input width a multiple of ``group_size``);
    layers no quantizer touches (router gates, norms) are left out."""
    names = head.checkpoint_keys()
    out: dict[str, dict | str] = {}
    for path, module in head.named_modules():
        if f"{path}.weight" not in names:
            continue
        name = names[f"{path}.weight"][: -len(".weight")]
        if hasattr(module, "scales"):
            out[name] = {"group_size": module.group_size, "bits": module.bits, "mode": module.mode}
        elif hasattr(module, "to_quantized") and module.weight.shape[-1] % group_size == 0:
            out[name] = precision.FLOAT
    return out


def record_head_precision(layers: dict[str, dict | str], quantization: dict) -> dict[str, int | str]:
    """Per-layer ``quantization`` entries for head layers whose setting differs from the trunk's
    (``quantization``'s own group_size / bits / mode, which mlx-lm's loader applies otherwise);
    returns the per-group summary (``precision.summarize``) for the config's ``mtplx`` block."""
    trunk = (quantization["group_size"], quantization["bits"], quantization.get("mode", "affine"))
    for name, setting in layers.items():
        if isinstance(setting, dict) and (setting["group_size"], setting["bits"], setting["mode"]) != trunk:
            quantization[name] = dict(setting)
    return precision.summarize({name: s["bits"] if isinstance(s, dict) else s for name, s in layers.items()})


def head_tensors(head: nn.Module) -> dict[str, mx.array]:
    """The head's parameters under the checkpoint names its loader reads."""
    names = head.checkpoint_keys()
    return {names[path]: value for path, value in tree_flatten(head.parameters())}


def _copy_aux_files(src: Path, out: Path) -> None:
    for pattern in _AUX_PATTERNS:
        for f in sorted(src.glob(pattern)):
            if f.is_file() and not (out / f.name).exists():
                shutil.copy(f, out / f.name)


def convert_hf(
    source: str | Path,
    out_dir: str | Path,
    *,
    q_bits: int = 4,
    q_group_size: int = 64,
    head_bits: HeadBits = None,
    overwrite: bool = False,
    hub_cache: str | Path | None = None,
) -> Path:
    """Quantize a float HF checkpoint's trunk as ``mlx_lm.convert -q`` does and keep its MTP head.

    ``head_bits``: None is the default precision (``mtplx.heads.precision.default_bits``),
    ``"float"`` keeps the head unquantized (in the dtype the trunk is cast to), an int gives every
    head layer that width. Output is atomic.
    """
    from mtplx import heads
    from mtplx.checkpoints import load as loading
    from mtplx.heads.weights import PLAIN_NORMS_MARK, weight_index
    from mtplx.model_files.headers import quantization_config
    from mtplx.trunk.model import Trunk

    from mlx_lm.utils import quantize_model, save_config, save_model

    _check_widths(q_bits, q_group_size, head_bits)
    check_output_dir(out_dir, overwrite)  # before a download
    src = resolve_source(source, hub_cache)
    out_dir = check_output_dir(out_dir, overwrite, inputs=[src])
    model, config = loading.load_mlx_model(src, lazy=True)
    if quantization_config(config):
        raise MtplxError(f"{src / 'config.json'}: already quantized; convert from the float checkpoint")
    dtype = _source_dtype(config)
    if dtype is not None:
        _cast(model, dtype, getattr(model, "cast_predicate", None))
    try:
        head = heads.load_head(src, Trunk(model), config)
    except heads.MissingHeadError as e:
        print(f"note: {e}; converting the trunk alone", file=sys.stderr)
        head = None
    if head is None:
        print(f"note: {src}: no MTP head to keep", file=sys.stderr)
    elif dtype is not None:
        # The trunk's own rule, so e.g. e_score_correction_bias stays float32 as in mlx-lm.
        _cast(head, dtype, getattr(model, "cast_predicate", None))

    trunk_predicate = getattr(model, "quant_predicate", None)
    prequantized = _prequantized_layers(model)
    model, qconfig = quantize_model(model, config, q_group_size, q_bits)
    for section in ("quantization", "quantization_config"):
        if isinstance(qconfig.get(section), dict):
            qconfig[section].update(prequantized)
    summary = None
    if head is not None:
        quantize_head(head, head_bits, q_bits, q_group_size, trunk_predicate)
        summary = record_head_precision(head_layer_precision(head, q_group_size), qconfig["quantization"])
        _declare_head_layers(qconfig, config, weight_index(src), head.layout)
    qconfig["mtplx"] = {
        "converted_from": str(source),
        "head_file": HEAD_FILE if head is not None else None,
        # "default" (mtplx.heads.precision.default_bits), "float" or the --head-bits width
        "head_bits": None if head is None else ("default" if head_bits is None else head_bits),
        "head_precision": summary,  # {group: bits or "float"} as written
    }

    def write(tmp: Path) -> None:
        if head is not None:
            # The head's norms were made plain scales when it loaded: say so (weights.norm_rule reads it).
            key, value = PLAIN_NORMS_MARK
            mx.save_safetensors(
                str(tmp / HEAD_FILE), head_tensors(head), metadata={"format": "mlx", key: value}
            )
        save_model(tmp, model, donate_model=True)
        save_config(qconfig, tmp / "config.json")
        _copy_aux_files(src, tmp)

    return write_dir_atomically(out_dir, write)


def _check_widths(q_bits: int, q_group_size: int, head_bits: HeadBits) -> None:
    if q_bits not in (2, 3, 4, 5, 6, 8):
        raise MtplxError(f"q_bits: must be one of 2, 3, 4, 5, 6, 8, got {q_bits}")
    if q_group_size not in (32, 64, 128):
        raise MtplxError(f"q_group_size: must be 32, 64 or 128, got {q_group_size}")
    if head_bits not in (None, "float", 2, 3, 4, 5, 6, 8):
        raise MtplxError(f"head_bits: must be 'float' or one of 2, 3, 4, 5, 6, 8, got {head_bits!r}")


def _prequantized_layers(model: nn.Module) -> dict[str, dict]:
    """The layers the loaded model already holds quantized (a Hunyuan-V4 trunk through mlx-vlm
    packs its MXFP8 ``kv_b_proj`` as ``embed_q`` / ``unembed_out`` on load), each with its own
    setting: ``quantize_model`` leaves them as they are and records only what it quantized, so
    without these entries a reader would take them for the trunk's bits and mode."""
    return {
        path: {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}
        for path, m in model.named_modules()
        if path and hasattr(m, "scales") and hasattr(m, "bits")
    }


def _declare_head_layers(out_config: dict, config: dict, index: dict[str, str], layout: str) -> None:
    """Write the MTP layer count into the converted config when the source declared none (Qwen3-Next
    as published counts them only by tensor name), so every later reader finds it declared."""
    from mtplx.heads.registry import FAMILIES

    family = FAMILIES[layout]
    if family.declared_layers(config):
        return
    section = out_config.get("text_config") if isinstance(out_config.get("text_config"), dict) else out_config
    section[family.count_keys[0]] = family.shipped_layers(index)
