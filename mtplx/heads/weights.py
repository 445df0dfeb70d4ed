"""Reading a head out of a checkpoint: the one loader template every head family shares.

``load_head_weights`` is mlx-lm's ``load_model`` for heads: a freshly built head names the
checkpoint prefixes its tensors sit under; those tensors are read (lazily: ``mx.load`` maps a
shard, so a tensor dropped later costs nothing), FP8 blocks dequantized, renamed to the head's
parameter paths by the head's own ``sanitize``, the layers the checkpoint stores quantized are
quantized the same way, and everything is loaded with one-line errors. A family adds only its
math and its renaming (``checkpoint_prefixes`` / ``sanitize`` / ``checkpoint_name`` on its head).

The helpers below are the HF -> mlx spellings (stacked experts, FP8 blocks, norm offsets) that
more than one family's ``sanitize`` needs.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from mtplx.errors import MtplxError
from mtplx.model_files.headers import quantization_config, read_safetensors_header, read_safetensors_metadata
from mtplx.trunk.compat import materialize

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class MissingHeadError(MtplxError):
    """The config declares MTP layers but no head can be read: the checkpoint ships none of their
    tensors (mlx-lm's converter drops them), or ships them in a layout mtplx does not know. The
    model still decodes, autoregressively (`Engine.load` says so in one line)."""


@dataclass(frozen=True)
class HeadSource:
    """A checkpoint being read for a head, and the trunk the head is built beside.

    ``config`` and ``index`` are the checkpoint's (for a Gemma 4 assistant: the assistant's,
    while ``trunk`` is the target's)."""

    model_dir: Path
    config: dict
    index: dict[str, str]
    trunk: Any

    @property
    def source(self) -> Path:
        """The file to name in errors about this checkpoint's tensors."""
        return source_name(self.model_dir)


def check_one_layer_head(src: HeadSource, num_layers: int, layout: str, key: str | None = None) -> None:
    """A hosted head of one MTP layer (the mlx-vlm families'): `MissingHeadError` unless the
    checkpoint ships ``key`` (None: the caller found the head's tensors itself), one line when its
    config declares another number of layers."""
    if key is not None and key not in src.index:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no {key}"
        )
    if num_layers != 1:
        raise MtplxError(f"{src.source}: a {layout} head has one MTP layer, its config declares {num_layers}")


def check_one_layer_drafter(src: HeadSource, num_layers: int, kind: str, key: str) -> None:
    """A split drafter of one MTP layer (``kind``: its ``model_type``): one line unless it ships
    ``key`` and its config declares one layer."""
    if key not in src.index:
        raise MtplxError(f"{src.source}: the {kind} split drafter needs {key}; it has none")
    if num_layers != 1:
        raise MtplxError(
            f"{src.source}: the {kind} drafter holds one MTP layer, its config declares {num_layers}"
        )


class CheckpointHead(Protocol):
    """The renaming a head supplies to ``load_head_weights`` (``MTPHead`` declares it)."""

    def checkpoint_prefixes(self) -> tuple[str, ...]: ...

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]: ...

    def checkpoint_name(self, path: str) -> str: ...


def load_head_weights(head: CheckpointHead, src: HeadSource) -> None:
    """Fill a freshly built ``head`` from ``src``: read -> FP8 blocks as 8-bit MLX layers -> rename
    -> quantize like the checkpoint (and as the weights came packed) -> load (one-line
    MtplxErrors for missing, extra or mis-shaped tensors).

    A head's FP8 layers stay 8-bit (``fp8_blocks_quantized``): a DeepSeek-V3 MTP layer is ~11.6 B
    parameters, 23 GB as a bfloat16 copy. Tensors the family reshapes on load
    (``fp8_dequantized`` on the head, e.g. MLA's ``kv_b_proj``, split per head) are dequantized."""
    prefixes = head.checkpoint_prefixes()
    names = sorted(k for k in src.index if k.startswith(prefixes))
    tensors = load_tensors(src.model_dir, src.index, names)
    tensors = fp8_blocks_quantized(tensors, keep_float=getattr(head, "fp8_dequantized", ()))
    weights = head.sanitize(tensors, src)
    quantize_like_checkpoint(head, head.checkpoint_name, set(src.index), src.config)
    quantize_as_packed(head, weights)
    check_and_load(head, weights, str(src.source))


# --- checkpoint access -------------------------------------------------------------


def weight_index(model_dir: Path) -> dict[str, str]:
    """``{tensor name: file name}`` over every ``*.safetensors`` in ``model_dir``: the shard index's
    weight_map, plus the headers of files it does not list (sidecars such as ``mtp.safetensors``
    that ship the head beside the trunk's shards, as ``mtplx convert`` writes)."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    index: dict[str, str] = {}
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise MtplxError(f"{index_file}: unreadable shard index (no weight_map)") from None
        index = {str(k): str(v) for k, v in weight_map.items()}
    listed = set(index.values())
    files = [f for f in sorted(model_dir.glob("*.safetensors")) if f.name not in listed]
    if not index and not files:
        raise MtplxError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        index.update({name: f.name for name in read_safetensors_header(f) if name not in index})
    return index


def load_tensors(model_dir: Path, index: dict[str, str], names: Iterable[str]) -> dict[str, mx.array]:
    """Load only ``names``, opening each shard once (mx.load maps the file; untouched tensors cost nothing)."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name], []).append(name)
    out: dict[str, mx.array] = {}
    for file, wanted in by_file.items():
        path = Path(model_dir) / file
        if not path.exists():
            raise MtplxError(f"{path}: shard listed in the index is missing")
        read_safetensors_header(path)  # clear error for truncated/corrupt shards
        try:
            arrays = mx.load(str(path))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a multi-line text
            raise MtplxError(f"{path}: cannot load safetensors ({str(e).splitlines()[0]})") from None
        for name in wanted:
            if name not in arrays:
                raise MtplxError(f"{path}: tensor {name} listed in the index is missing")
            out[name] = arrays[name]
    return out


def source_name(model_dir: Path) -> Path:
    """The file to name in errors about a checkpoint's tensors: its shard index or single shard."""
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if (Path(model_dir) / name).exists():
            return Path(model_dir) / name
    return Path(model_dir)


def keys_with_prefix(index: dict[str, str], prefix: str) -> list[str]:
    return sorted(k for k in index if k.startswith(prefix))


def find_prefix(index: dict[str, str], pattern: str) -> str | None:
    """The shortest prefix ``p`` such that ``p + pattern`` fully matches some key (regex suffix)."""
    rx = re.compile(rf"^(.*?){pattern}$")
    found = sorted({m.group(1) for k in index if (m := rx.match(k))}, key=len)
    return found[0] if found else None


def strip_prefix(tensors: dict[str, mx.array], prefix: str) -> dict[str, mx.array]:
    """The tensors under ``prefix``, named relative to it."""
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


# --- HF -> mlx-side tensor spellings ------------------------------------------------


def stack_experts(weights: dict[str, mx.array], mlp_prefix: str, num_experts: int) -> dict[str, mx.array]:
    """Per-expert HF tensors (``experts.{e}.gate_proj.weight`` or fused ``experts.gate_up_proj``)
    -> mlx-lm's stacked ``switch_mlp.{gate,up,down}_proj.*``; already-stacked input passes through."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for kind in ("weight", "scales", "biases"):
            first = f"{mlp_prefix}.experts.0.{proj}.{kind}"
            if first in weights:
                parts = [weights.pop(f"{mlp_prefix}.experts.{e}.{proj}.{kind}") for e in range(num_experts)]
                weights[f"{mlp_prefix}.switch_mlp.{proj}.{kind}"] = mx.stack(parts)
    fused = f"{mlp_prefix}.experts.gate_up_proj"
    if fused in weights:
        gate_up = weights.pop(fused)
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp_prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp_prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{mlp_prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{mlp_prefix}.experts.down_proj")
    return weights


def dequantize_fp8_blocks(weights: dict[str, mx.array], block: int = 128) -> dict[str, mx.array]:
    """DeepSeek-style FP8 checkpoints: ``w`` (e4m3) with per-``block`` x ``block`` ``w_scale_inv`` ->
    bfloat16. Any leading dimensions (stacked experts: w [E, m, n], scale [E, m/128, n/128]) are
    kept; the two trailing ones are blocked, edge blocks padded."""
    for key in [k for k in weights if k.endswith(".weight_scale_inv")]:
        scale = weights.pop(key)
        wkey = key[: -len("_scale_inv")]
        w = mx.from_fp8(weights[wkey], dtype=mx.bfloat16)
        *lead, m, n = w.shape
        pm, pn = (-m) % block, (-n) % block
        w = mx.pad(w, [(0, 0)] * len(lead) + [(0, pm), (0, pn)])
        w = w.reshape(*lead, (m + pm) // block, block, (n + pn) // block, block)
        w = (w * scale[..., :, None, :, None]).reshape(*lead, m + pm, n + pn)
        weights[wkey] = w[..., :m, :n].astype(mx.bfloat16)
    return weights


FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size
MXFP8 = {"group_size": 32, "bits": 8, "mode": "mxfp8"}
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
FP8_AFFINE = {"group_size": 64, "bits": 8, "mode": "affine"}


def powers_of_two(x: mx.array) -> bool:
    """Every element a positive normal power of two (zero mantissa bits): ue8m0 block scales."""
    bits = x.astype(mx.float32).view(mx.uint32)
    exponent = (bits >> 23) & 0xFF
    return bool(mx.all(((bits & 0x807FFFFF) == 0) & (exponent > 0) & (exponent < 255)).item())


def fp8_as_mxfp8(w8: mx.array, scale_inv: mx.array, block: int = FP8_BLOCK) -> tuple[mx.array, mx.array]:
    """FP8 e4m3 ``w8`` [..., m, n] with power-of-two ``block`` x ``block`` scales [..., m/b, n/b]
    -> MLX mxfp8 (weight [..., m, n/4] uint32, scales [..., m, n/32] uint8), exactly: mxfp8 is
    e4m3 elements with one E8M0 (biased power-of-two exponent) scale per 32 consecutive inputs, and
    every such group lies inside one FP8 block, so its scale is the block's and the elements are
    the checkpoint's own bytes. No float copy is made. Needs n % 32 == 0 and block % 32 == 0."""
    exponent = ((scale_inv.astype(mx.float32).view(mx.uint32) >> 23) & 0xFF).astype(
        mx.uint8
    )  # E8M0 = biased exp
    return e8m0_blocks_as_mxfp8(w8, exponent, block)


def e8m0_blocks_as_mxfp8(w8: mx.array, e8m0: mx.array, block: int = FP8_BLOCK) -> tuple[mx.array, mx.array]:
    """FP8 e4m3 ``w8`` [..., m, n] with E8M0 (biased power-of-two exponent) bytes per ``block`` x
    ``block`` [..., ceil(m/b), ceil(n/b)] -> MLX mxfp8, exactly (`fp8_as_mxfp8`: each group of 32
    inputs lies inside one block; edge blocks cropped). DeepSeek-V4 stores its FP8 scales so."""
    *_, m, n = w8.shape
    per_row = mx.repeat(e8m0.view(mx.uint8), block, axis=-2)[..., :m, :]
    scales = mx.repeat(per_row, block // MXFP8["group_size"], axis=-1)[..., : n // MXFP8["group_size"]]
    return mx.contiguous(w8.view(mx.uint8)).view(mx.uint32), mx.contiguous(scales)


def mxfp4_bytes(w4: mx.array, e8m0: mx.array) -> tuple[mx.array, mx.array]:
    """FP4 e2m1 ``w4`` [..., m, n/2] (two elements a byte, the first in the low nibble) with one
    E8M0 byte per 32 inputs [..., m, n/32] -> MLX mxfp4 (weight [..., m, n/8] uint32, scales
    uint8): the same bytes, MLX's packing (DeepSeek-V4's routed experts)."""
    return mx.contiguous(w4.view(mx.uint8)).view(mx.uint32), mx.contiguous(e8m0.view(mx.uint8))


def fp8_blocks_quantized(
    weights: dict[str, mx.array], keep_float: Iterable[str] = (), block: int = FP8_BLOCK
) -> dict[str, mx.array]:
    """DeepSeek-style FP8 tensors (``w`` e4m3 + ``w_scale_inv`` per ``block`` x ``block``) as 8-bit
    MLX layers, never as a full float copy: power-of-two scales (V3.1's ue8m0) -> mxfp8, exactly
    (``fp8_as_mxfp8``; mlx-lm's loader does the same for 32x32 ue8m0 blocks); other scales ->
    8-bit affine with group size 64 (32 where the input width needs it), one tensor at a time (its
    bfloat16 dequantization evaluated and dropped before the next). Tensors whose name ends with
    one of ``keep_float``, or whose input width is not a multiple of 32, are dequantized to
    bfloat16 (``dequantize_fp8_blocks``).
    Each quantized ``x.weight`` comes out with ``x.scales`` (and ``x.biases`` for affine), the
    layout ``quantize_as_packed`` reads."""
    keep_float = tuple(keep_float)
    for key in [k for k in weights if k.endswith(".weight_scale_inv")]:
        wkey = key[: -len("_scale_inv")]
        module, n = wkey[: -len(".weight")], weights[wkey].shape[-1]
        if module.endswith(keep_float) or n % MXFP8["group_size"]:
            weights.update(dequantize_fp8_blocks({wkey: weights.pop(wkey), key: weights.pop(key)}, block))
        elif block % MXFP8["group_size"] == 0 and powers_of_two(weights[key]):
            weights[wkey], weights[f"{module}.scales"] = fp8_as_mxfp8(weights[wkey], weights.pop(key), block)
        else:
            group = FP8_AFFINE["group_size"] if n % FP8_AFFINE["group_size"] == 0 else MXFP8["group_size"]
            w = dequantize_fp8_blocks({wkey: weights[wkey], key: weights.pop(key)}, block)[wkey]
            wq, scales, biases = mx.quantize(w, group_size=group, bits=FP8_AFFINE["bits"])
            mx.eval(wq, scales, biases)  # the bfloat16 copy of this one tensor is freed here
            weights[wkey], weights[f"{module}.scales"], weights[f"{module}.biases"] = wq, scales, biases
    return weights


def split_mla_kv_b_proj(weights: dict[str, mx.array], prefix: str, args: Any, config: dict) -> None:
    """HF MLA ``kv_b_proj`` [heads*(nope+v), kv_lora] -> mlx-lm's per-head ``embed_q`` / ``unembed_out``
    (DeepSeek-V3 / GLM-5 and LongCat-Flash heads; as those models' mlx-lm ``sanitize``)."""
    key = f"{prefix}.kv_b_proj.weight"
    if key not in weights:
        return
    w = weights.pop(key)
    q = quantization_config(config)
    scales = weights.pop(f"{prefix}.kv_b_proj.scales", None)
    biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
    if scales is not None:
        w = mx.dequantize(w, scales, biases, group_size=q["group_size"], bits=q["bits"])
    nope, vdim = args.qk_nope_head_dim, args.v_head_dim
    w = w.reshape(args.num_attention_heads, nope + vdim, -1)
    parts = {
        "embed_q": mx.contiguous(w[:, :nope, :].swapaxes(-1, -2)),
        "unembed_out": mx.contiguous(w[:, nope:, :]),
    }
    for name, t in parts.items():
        if scales is not None:
            t, s, b = mx.quantize(t, group_size=q["group_size"], bits=q["bits"])
            weights[f"{prefix}.{name}.scales"], weights[f"{prefix}.{name}.biases"] = s, b
        weights[f"{prefix}.{name}.weight"] = t


# --- norm convention ---------------------------------------------------------------

_NORM_WEIGHT = re.compile(r"(^|\.)[^.]*norm[^.]*\.weight$")


def is_norm_weight(name: str, value: mx.array) -> bool:
    return value.ndim == 1 and _NORM_WEIGHT.search(name) is not None


# The mark ``mtplx convert`` writes into the head file's safetensors metadata: its norms are plain scales.
PLAIN_NORMS_MARK = ("mtplx_head_norms", "plain")


@dataclass(frozen=True)
class NormRule:
    """How a head's RMSNorm weights are stored, and which rule decided it (``inspect`` shows it).

    ``offset`` True: every norm weight is an offset from 1 (HF Qwen3-Next / Qwen3.5 compute
    ``x * (1 + w)``); False: plain scales; None: provenance unknown, each tensor judged by its mean."""

    offset: bool | None
    rule: str


def norm_rule(
    config: dict, model_dir: Path, index: dict[str, str], names: Iterable[str], offset_types
) -> NormRule:
    """The norm convention of the head tensors ``names``, by provenance, first rule that applies:

    1. the head file carries mtplx's conversion mark (``PLAIN_NORMS_MARK``): plain scales;
    2. the checkpoint's model_type is not one whose raw checkpoints store offsets (``offset_types``,
       the family's): plain scales;
    3. the head file was written by torch (safetensors metadata ``format: pt``, as every Hugging
       Face upload): a raw checkpoint of an offset model type, offsets;
    4. otherwise (MLX-written without the mark: some converter kept the head, mlx-lm's own drops it
       and shifts only some norms of what it keeps): unknown, judged per tensor (with a warning).
    """
    files = sorted({index[n] for n in names})
    metadata = [read_safetensors_metadata(Path(model_dir) / f) for f in files]
    key, value = PLAIN_NORMS_MARK
    if metadata and all(m.get(key) == value for m in metadata):
        return NormRule(False, f"plain scales: mtplx conversion mark in {', '.join(files)}")
    types = [str(c.get("model_type", "")) for c in (config, config.get("text_config") or {})]
    kind = next((t for t in types if t in offset_types), None)
    if kind is None:
        shown = ", ".join(t for t in types if t) or "unknown"
        return NormRule(False, f"plain scales: model_type {shown} does not store norms as offsets")
    if metadata and all(m.get("format") == "pt" for m in metadata):
        return NormRule(True, f"offsets from 1: raw Hugging Face {kind} checkpoint (format pt)")
    return NormRule(
        None, f"provenance unknown ({kind}, format {_formats(metadata)}): each norm judged by its mean"
    )


def _formats(metadata: list[dict[str, str]]) -> str:
    return "/".join(sorted({m.get("format", "none") for m in metadata})) or "none"


def stored_as_offset(value: mx.array) -> bool:
    """The fallback guess for one RMSNorm weight of unknown provenance: an offset from 1 when its
    mean is nearer 0 than 1. A fine-tune can fool it (a raw weight of mean above 0.5), so it is
    used only when ``norm_rule`` cannot decide."""
    return abs(mx.mean(value.astype(mx.float32)).item()) < 0.5


def plain_norms(weights: dict[str, mx.array], rule: NormRule, source: str = "") -> dict[str, mx.array]:
    """Every 1-D ``*norm*.weight`` as a plain RMSNorm scale: +1 for those stored as offsets, as
    ``rule`` says (per tensor by ``stored_as_offset`` when it cannot say, with a one-line warning)."""
    if rule.offset is None and any(is_norm_weight(k, v) for k, v in weights.items()):
        print(f"warning: {source}: head norm convention {rule.rule}", file=sys.stderr)

    def offset(k: str, v: mx.array) -> bool:
        return is_norm_weight(k, v) and (stored_as_offset(v) if rule.offset is None else rule.offset)

    return {k: (v + 1.0 if offset(k, v) else v) for k, v in weights.items()}


# --- quantization and loading -------------------------------------------------------


def quantize_like_checkpoint(
    module: nn.Module, module_to_ckpt: Callable[[str], str], stored: set[str], config: dict
) -> None:
    """Quantize exactly the layers the checkpoint stores quantized (``<key>.scales`` present),
    with its group size / bits / mode, honouring per-layer overrides keyed by checkpoint path."""
    q = quantization_config(config)
    if q is None:
        return

    def predicate(path: str, m: nn.Module):
        ckpt = module_to_ckpt(path)
        override = q.get(ckpt)
        if override is not None:
            return override  # False or {"group_size":..., "bits":...}
        return hasattr(m, "to_quantized") and f"{ckpt}.scales" in stored

    nn.quantize(
        module,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


def packed_setting(weight: mx.array, scales: mx.array, in_dims: int) -> dict:
    """The group size, bits and mode a packed weight was quantized with (as mlx-lm's
    ``infer_quant_config``: affine keeps its scales in a float dtype; uint8 scales with group 32
    are mxfp8 at 8 bits, mxfp4 at 4)."""
    group_size = in_dims // scales.shape[-1]
    bits = weight.shape[-1] * 32 // in_dims
    if scales.dtype != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    if (bits, group_size) == (8, 32):
        return dict(MXFP8)
    if (bits, group_size) == (4, 32):
        return dict(MXFP4)
    raise MtplxError(f"cannot tell how a head weight of {bits} bits with group size {group_size} was packed")


def quantize_as_packed(module: nn.Module, weights: dict[str, mx.array]) -> None:
    """Quantize the still-float layers whose sanitized weights came packed (``<path>.scales``
    present: an FP8 head read by ``fp8_blocks_quantized``), each as its weights say."""
    settings = {
        path: packed_setting(weights[f"{path}.weight"], weights[f"{path}.scales"], m.weight.shape[-1])
        for path, m in module.named_modules()
        if hasattr(m, "to_quantized") and f"{path}.scales" in weights and f"{path}.weight" in weights
    }
    if settings:
        nn.quantize(module, class_predicate=lambda path, _: settings.get(path, False))


def same_as_trunk_lm_head(own: dict[str, mx.array], trunk: Any) -> bool:
    """True when a checkpoint's own LM-head copy in an MTP layer (``{weight, scales?, biases?}``)
    equals the trunk's LM head (DeepSeek ships an identical copy: keep one in memory)."""
    lm = getattr(trunk, "_lm_head", None)
    if lm is None:
        lm = getattr(getattr(trunk, "inner", None), "embed_tokens", None)
    if lm is None:
        return False
    params = dict(tree_flatten(lm.parameters()))
    if set(own) != set(params):
        return False
    return all(params[k].shape == v.shape and mx.array_equal(params[k], v).item() for k, v in own.items())


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def check_and_load(module: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """``module.load_weights`` with one-line MtplxErrors for missing/unexpected/mis-shaped tensors."""
    params = dict(tree_flatten(module.parameters()))
    missing = sorted(set(params) - set(weights))
    if missing:
        raise MtplxError(f"{source}: MTP head tensor(s) missing: {_listed(missing)}")
    extra = sorted(set(weights) - set(params))
    if extra:
        raise MtplxError(f"{source}: unexpected MTP head tensor(s): {_listed(extra)}")
    for name, p in params.items():
        if tuple(weights[name].shape) != tuple(p.shape):
            raise MtplxError(
                f"{source}: MTP head tensor {name} has shape {tuple(weights[name].shape)}, expected {tuple(p.shape)}"
            )
    module.load_weights(list(weights.items()), strict=True)
    materialize(module)  # its private arrays too (a RoPE's frequencies): the server decodes on its thread
