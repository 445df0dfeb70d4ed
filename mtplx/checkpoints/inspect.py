"""`mtplx inspect [MODEL]`: what a checkpoint is and whether mtplx can draft with it, without running it.

Reads config.json and the safetensors headers (no tensor data): architecture,
parameter count, memory by dtype (packed quantized weights counted at their real
width), quantization, KV bytes per token, the vision tower, and the checkpoint's own MTP
head (layout, layer count, norm rule, precision). Where the head `mtplx generate` would
draft with comes from otherwise (the head mtplx ships for the default model, a forged
sidecar given with ``--head DIR`` or beside the model, a split drafter, a Gemma 4
assistant, a block drafter) and the verdict ("MTP-ready", "AR-only" suggesting
`mtplx forge`, "drafter" or "unsupported", with the reason) are
`mtplx.checkpoints.inspect_verdict`'s.
"""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path
from typing import Any

from mtplx.checkpoints.inspect_verdict import block_drafter_facts, choose_verdict, heads_beside
from mtplx.checkpoints.load import VARIANTS, default_model_variant, read_config, resolve_model
from mtplx.errors import MtplxError
from mtplx.heads.weights import weight_index
from mtplx.model_files.headers import quantization_config, read_safetensors_header

_SAFETENSORS_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def _trunk_backend(config: dict) -> dict[str, str | None]:
    """Which package hosts the trunk (`mtplx.trunk.backends`, the one place that decides): its
    name and version, or the one-line reason none can (then ``backend`` is None)."""
    from mtplx.trunk import backends

    try:
        backend, model_type = backends.backend_for(config)
    except MtplxError as e:
        return {"backend": None, "version": None, "problem": str(e)}
    return {"backend": backend.name, "version": backends.package_version(backend.package), "problem": None}


def _headers(path: Path, index: dict[str, str]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for file in sorted(set(index.values())):
        shard = path / file
        if not shard.exists():
            raise MtplxError(f"{shard}: shard listed in the index is missing")
        out.update(read_safetensors_header(shard))
    return out


def _quant_bits(name: str, header: dict[str, dict], q: dict | None) -> int | None:
    """Bits of a packed ``<module>.weight`` (per-layer override, else inferred from the scales' shape)."""
    module = name[: -len(".weight")]
    scales = header.get(f"{module}.scales")
    if scales is None:
        return None
    override = (q or {}).get(module)
    if isinstance(override, dict) and "bits" in override:
        return int(override["bits"])
    group = int((q or {}).get("group_size", 64))
    packed_cols, groups = header[name]["shape"][-1], scales["shape"][-1]
    return int(round(packed_cols * 32 / (groups * group))) if groups else None


def _head_precision(header: dict[str, dict], q: dict | None, is_head, config: dict) -> dict | None:
    """Per group (``mtplx.heads.precision``) the bits of the head's weight matrices as stored
    (FP8 tensors, ``F8_*`` or with a ``weight_scale_inv``, count as 8), which groups every draft passes through are under 8 bits,
    and the choice ``mtplx convert`` recorded (``"default"``, ``"float"``, a width; None: not
    converted by mtplx). In a quantized checkpoint with some head layer quantized, its float
    matrices are the ones no quantizer touches (router gates, widths off the group size) and are
    left out. None when the checkpoint holds no head layers."""
    from mtplx.heads import precision

    layers: dict[str, int | str] = {}
    for name, info in header.items():
        if not (is_head(name) and name.endswith(".weight")) or len(info["shape"]) < 2:
            continue
        bits = _quant_bits(name, header, q)
        fp8 = str(info["dtype"]).startswith("F8") or f"{name}_scale_inv" in header
        layers[name[: -len(".weight")]] = bits or (8 if fp8 else precision.FLOAT)
    if q is not None and any(b != precision.FLOAT for b in layers.values()):
        layers = {k: b for k, b in layers.items() if b != precision.FLOAT}
    if not layers:
        return None
    summary = precision.summarize(layers)
    recorded = (config.get("mtplx") or {}).get("head_bits")
    return {"groups": summary, "below_8_bits": precision.below_floor(summary), "converted_as": recorded}


def trunk_layers(config: dict) -> int | None:
    """The trunk's layer count: ``num_hidden_layers``, else the length of the layer pattern a
    hybrid config states instead (Nemotron-H's ``hybrid_override_pattern``, ``layers_block_type``,
    as mlx-lm's ``nemotron_h.ModelArgs`` counts them); None when the config says neither."""
    text = config.get("text_config") or config
    for source in (text, config):
        if source.get("num_hidden_layers") is not None:
            return int(source["num_hidden_layers"])
    for source in (text, config):
        for key in ("hybrid_override_pattern", "layers_block_type"):
            if source.get(key):
                return len(source[key])
    return None


def _head_predicate(layout: str | None, config: dict):
    text = config.get("text_config") or config
    if layout == "qwen3_next":
        return lambda k: re.search(r"(^|\.)mtp\.", k) is not None
    if layout in ("deepseek", "step3p5"):
        first = int(text.get("num_hidden_layers", config.get("num_hidden_layers", 0)))
        return lambda k: (
            (m := re.match(r"model\.layers\.(\d+)\.", k)) is not None and int(m.group(1)) >= first
        )
    if layout == "mimo":
        return lambda k: k.startswith("model.mtp_layers.")
    if layout in ("mimo_v2_flash", "longcat"):
        return lambda k: k.startswith("model.mtp.")
    if layout == "ernie":
        return lambda k: k.startswith("model.mtp_")
    # An unknown layout: count what is named like an MTP head, so inspect can say what it found.
    return lambda k: re.search(r"(^|[._])(mtp|nextn)", k) is not None


def _count_parameters(header: dict[str, dict], is_head, q: dict | None) -> tuple[dict, dict, int]:
    """({"trunk", "mtp_head"}: parameters, bytes by stored dtype, the head's bytes); a quantized
    weight counts the parameters it packs, its scales and biases count none."""
    params = {"trunk": 0, "mtp_head": 0}
    bytes_by_dtype: dict[str, int] = {}
    head_bytes = 0
    for name, info in header.items():
        part = "mtp_head" if is_head(name) else "trunk"
        numel = math.prod(info["shape"])
        nbytes = numel * _SAFETENSORS_BYTES.get(info["dtype"], 4)
        bits = _quant_bits(name, header, q) if name.endswith(".weight") else None
        if bits:
            dtype = f"{bits}-bit quantized"
            params[part] += numel * 32 // bits
        else:
            dtype = info["dtype"]
            if not name.endswith((".scales", ".biases", "_scale_inv", ".weight_scale")):
                params[part] += numel
        bytes_by_dtype[dtype] = bytes_by_dtype.get(dtype, 0) + nbytes
        head_bytes += nbytes if part == "mtp_head" else 0
    return params, bytes_by_dtype, head_bytes


def _quantization_summary(config: dict, text: dict, q: dict | None) -> dict | None:
    """MLX quantization (group size, bits, mode, per-layer overrides) or a source checkpoint's own
    (FP8 blocks ...); None for a float checkpoint."""
    quant = None
    qc = config.get("quantization_config") or text.get("quantization_config")
    if q:
        quant = {"group_size": q.get("group_size"), "bits": q.get("bits"), "mode": q.get("mode", "affine")}
        overrides = {k: v for k, v in q.items() if isinstance(v, (dict, bool)) and k not in quant}
        if overrides:
            quant["per_layer_overrides"] = len(overrides)
    elif qc:
        quant = {
            "method": qc.get("quant_method"),
            **{k: qc[k] for k in ("weight_block_size", "fmt") if k in qc},
        }
    return quant


def _norm_rule(config: dict, path: Path, index, header: dict, layout, is_head, split: bool) -> str | None:
    """Which rule decides the head's norm convention (None: not a question for this head)."""
    from mtplx.heads import split_drafter
    from mtplx.heads.registry import FAMILIES

    norms = split_drafter.SPLIT_NORMS_RULE if split else None
    head_tensors = any(is_head(k) for k in header)
    if norms is None and layout and head_tensors and FAMILIES[layout].offset_norm_types:
        from mtplx.heads.weights import norm_rule

        names = [k for k in header if is_head(k)]
        norms = norm_rule(config, path, index, names, FAMILIES[layout].offset_norm_types).rule
    return norms


def _mtp_facts(config: dict, header: dict, q, is_head, layout, declared, count_source: str, norms) -> dict:
    """The checkpoint's own MTP head as its tensors and config say."""
    head_tensors = sum(1 for k in header if is_head(k))
    return {
        "layout": layout if (head_tensors or declared) else None,
        "declared_layers": declared,
        "layer_count_source": count_source,  # "config", or "tensor names" when it declares none
        "tensors": head_tensors,
        "norm_rule": norms,  # which rule decides the head's norm convention (None: not a question)
        # {"groups": {group: bits or "float"}, "below_8_bits": [...], "converted_as": ...}
        "precision": _head_precision(header, q, is_head, config) if head_tensors else None,
    }


def _declared_layers(layout, header: dict, config: dict) -> tuple[int, str]:
    """(MTP layers, where the count came from): a config may declare no count (Qwen3-Next as
    published), then the family's tensor names say."""
    from mtplx.heads import declared_mtp_layers
    from mtplx.heads.registry import FAMILIES

    if layout:
        return FAMILIES[layout].layer_count(header, config)
    return declared_mtp_layers(config), "config"


def inspect_model(
    spec_or_path: str | Path | None = None, *, head: str | Path | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """Describe a model (a directory, an HF repo id, or None: the default model) and the head it drafts with.

    ``head`` is a forged-head directory to check against the model (as ``generate --head`` uses it);
    ``dtype`` picks the default model's build.
    """
    from mtplx.heads import detect_layout, split_drafter

    path, drafter_report = _inspected_dir(spec_or_path, dtype)
    if drafter_report is not None:  # a DFlash / DSpark / EAGLE-3 directory itself
        return drafter_report
    default_variant = (dtype or "float32") if spec_or_path is None else default_model_variant(path)
    config = read_config(path)
    text = config.get("text_config") or {}
    index = weight_index(path)
    header = _headers(path, index)
    q = quantization_config(config)

    layout = detect_layout(index, config)
    is_drafter = split_drafter.read_split_config(path) is not None
    is_head = (lambda k: True) if is_drafter else _head_predicate(layout, config)
    params, bytes_by_dtype, head_bytes = _count_parameters(header, is_head, q)

    declared, count_source = _declared_layers(layout, header, config)
    head_tensors = sum(1 for k in header if is_head(k))
    forged, sidecar, given_split, split, assistant = heads_beside(
        path, spec_or_path, config, head, head_tensors, is_drafter, default_variant
    )
    backend = _trunk_backend(config)
    supported = backend["backend"] is not None
    quant = _quantization_summary(config, text, q)

    verdict, reason, sidecar = choose_verdict(
        config,
        path,
        layout=layout,
        declared=declared,
        count_source=count_source,
        head_tensors=head_tensors,
        head_parameters=params["mtp_head"],
        head_bytes=head_bytes,
        is_drafter=is_drafter,
        split=split,
        given_split=given_split,
        sidecar=sidecar,
        forged=forged,
        assistant=assistant,
        supported=supported,
        unsupported_reason=backend["problem"],
    )

    norms = _norm_rule(
        config, path, index, header, layout, is_head, is_drafter or (sidecar or {}).get("split")
    )
    return {
        "path": str(path),
        **_trunk_facts(config, backend),
        "parameters": params["trunk"] + params["mtp_head"],
        "parameters_by_part": params,
        "memory_bytes": sum(bytes_by_dtype.values()),
        "memory_bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
        "mtp_head_bytes": head_bytes,
        "shards": len(set(index.values())),
        "quantization": quant,
        "kv_bytes_per_token": _kv_bytes(config, header),
        "mtp": _mtp_facts(config, header, q, is_head, layout, declared, count_source, norms),
        "forged_head": forged,
        "default_model_build": default_variant,
        "head": sidecar,
        "assistant": assistant,
        "split_drafter": split,
        "block_drafter": block_drafter_facts(path, config, head),
        "vision": _vision(config, header),
        "verdict": verdict,
        "reason": reason,
    }


def _inspected_dir(spec_or_path: str | Path | None, dtype: str | None) -> tuple[Path, dict | None]:
    """The model directory, and the report when it is a block drafter's own directory."""
    from mtplx.drafters.discovery import describe_drafter_dir, read_block_drafter_config

    if dtype not in (None, *VARIANTS):
        raise MtplxError(f"dtype must be one of {', '.join(VARIANTS)} (got {dtype})")
    path = resolve_model(spec_or_path, variant=dtype or "float32")
    block_config = read_block_drafter_config(path)
    return path, (describe_drafter_dir(path, block_config) if block_config is not None else None)


def _trunk_facts(config: dict, backend: dict) -> dict[str, Any]:
    """The trunk's type, backend and sizes (a VLM's from its text config)."""
    text = config.get("text_config") or {}
    model_type = str(config["model_type"])
    return {
        "model_type": model_type,
        "architecture": (config.get("architectures") or [model_type])[0],
        "trunk_backend": backend,
        "hidden_size": text.get("hidden_size", config.get("hidden_size")),
        "num_hidden_layers": trunk_layers(config),
        "vocab_size": text.get("vocab_size", config.get("vocab_size")),
    }


def _kv_bytes(config: dict, header: dict[str, dict]) -> dict[str, int]:
    """The trunk's KV cache per position: float (the dtype of the model's norms, its activations)
    and under ``--kv-bits`` 8 and 4 (``--kv-group-size`` 64), mtplx/trunk/kv_quant.py."""
    from mtplx.trunk.kv_quant import kv_bytes_per_token

    norms = [info["dtype"] for name, info in header.items() if "norm" in name]
    float_bytes = _SAFETENSORS_BYTES.get(norms[0] if norms else "F16", 2)
    out = {f"float{8 * float_bytes}": kv_bytes_per_token(config, None, float_bytes=float_bytes)}
    out.update({f"{bits}-bit": kv_bytes_per_token(config, bits, float_bytes=float_bytes) for bits in (8, 4)})
    return out


def _vision(config: dict, header: dict[str, dict]) -> dict | None:
    """What the checkpoint's vision tower is and what mtplx does with images (None: text only)."""
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    tensors = sum(1 for k in header if k.startswith(("model.visual.", "vision_tower.")))
    problem = None
    if config.get("model_type") not in ("qwen3_5", "qwen3_5_moe"):
        problem = f"images are not supported for model_type {config.get('model_type')} (Qwen3.5 / 3.6 only)"
    elif not tensors:
        problem = "config.json declares a vision tower but the checkpoint ships no tower tensors"
    elif importlib.util.find_spec("mlx_vlm") is None:
        problem = "install mtplx[vision] (mlx-vlm) to use them"
    return {
        "takes_images": problem is None,
        "problem": problem,
        "tower_tensors": tensors,
        "patch_size": vision.get("patch_size"),
        "merge_size": vision.get("spatial_merge_size"),
        "image_token_id": config.get("image_token_id"),
    }
