"""`mtplx inspect MODEL`: what a checkpoint is and whether mtplx can draft with it, without running it.

Reads config.json and the safetensors headers only (no tensor data): architecture,
parameter count, memory by dtype (packed quantized weights counted at their real
width), quantization, the MTP head the checkpoint ships (layout, layer count) or a
forged head beside it, and a verdict: "MTP-ready", "AR-only" (suggest `mtplx forge`)
or "unsupported", with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import quantization_config, read_safetensors_header, weight_index
from mtplx.loading import read_config, resolve_model

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


def _mlx_lm_supports(model_type: str) -> bool:
    try:
        from mlx_lm.utils import MODEL_REMAPPING
    except ImportError:
        MODEL_REMAPPING = {}
    mt = MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")
    return importlib.util.find_spec(f"mlx_lm.models.{mt}") is not None


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


def _head_predicate(layout: str | None, config: dict):
    text = config.get("text_config") or config
    if layout == "qwen3_next":
        return lambda k: re.search(r"(^|\.)mtp\.", k) is not None
    if layout == "deepseek":
        first = int(text.get("num_hidden_layers", config.get("num_hidden_layers", 0)))
        return lambda k: (
            (m := re.match(r"model\.layers\.(\d+)\.", k)) is not None and int(m.group(1)) >= first
        )
    if layout == "mimo":
        return lambda k: k.startswith("model.mtp_layers.")
    return lambda k: False


def _find_forged(path: Path) -> dict | None:
    """A forged head attached to this model: hook into ``mtplx.heads.forged`` when it exists,
    else the sidecar conventions (``mtplx_head/manifest.json`` or ``*.mtplx-head.json``)."""
    try:
        from mtplx.heads import forged  # type: ignore[attr-defined]

        finder = getattr(forged, "find_forged_head", None)
        if finder is not None:
            found = finder(path)
            if found is not None:
                return {"manifest": str(found)} if not isinstance(found, dict) else found
    except ImportError:
        pass
    for manifest in [path / "mtplx_head" / "manifest.json", *sorted(path.glob("*.mtplx-head.json"))]:
        if manifest.is_file():
            try:
                data = json.loads(manifest.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                raise MtplxError(f"{manifest}: unreadable forged-head manifest") from None
            return {
                "manifest": str(manifest),
                "layout": data.get("layout"),
                "fingerprint": data.get("trunk_fingerprint"),
            }
    return None


def _gemma4_assistant(path: Path, spec: str | Path, config: dict) -> dict | None:
    """For a Gemma 4 target: the assistant that pairs with it (``<target>-assistant`` beside it or
    in the HF cache, checked against both configs), else the first name looked for and why not."""
    from mtplx.heads import gemma4_assistant as ga

    if not ga.is_gemma4_target(config):
        return None
    candidates = ga.assistant_candidates(path, spec)
    for name, found in candidates:
        assistant = ga.read_assistant_config(found) if found is not None else None
        if assistant is not None:
            problem = ga.pairing_problem(assistant, config)
            return {"name": name, "path": str(found), "pairs": problem is None, "problem": problem}
    return {"name": candidates[-1][0], "path": None, "pairs": False, "problem": "not found locally"}


def inspect_model(spec_or_path: str | Path) -> dict[str, Any]:
    """Describe a model directory (or cached HF repo id) from config.json + safetensors headers."""
    from mtplx.heads import declared_mtp_layers, detect_layout

    path = resolve_model(spec_or_path)
    config = read_config(path)
    text = config.get("text_config") or {}
    model_type = str(config["model_type"])
    index = weight_index(path)
    header = _headers(path, index)
    q = quantization_config(config)

    layout = detect_layout(index, config)
    is_head = _head_predicate(layout, config)
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

    declared = declared_mtp_layers(config, layout) if layout else declared_mtp_layers(config)
    head_tensors = sum(1 for k in header if is_head(k))
    forged = _find_forged(path)
    assistant = _gemma4_assistant(path, spec_or_path, config)
    supported = _mlx_lm_supports(model_type)
    qc = config.get("quantization_config") or text.get("quantization_config")
    quant = None
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

    from mtplx.heads.gemma4_assistant import is_assistant_config

    if is_assistant_config(config):
        verdict = "drafter"
        reason = f"a Gemma 4 assistant for targets with hidden_size {config.get('backbone_hidden_size')}; use it with --head"
    elif not supported:
        verdict, reason = "unsupported", f"mlx-lm has no model class for model_type {model_type!r}"
    elif head_tensors and declared:
        verdict, reason = "MTP-ready", f"ships {declared} MTP layer(s) ({layout} layout)"
    elif forged:
        verdict, reason = "MTP-ready", f"forged head attached ({forged.get('manifest')})"
    elif assistant is not None and assistant["pairs"]:
        verdict, reason = "MTP-ready", f"Gemma 4 assistant {assistant['name']} pairs with it"
    elif assistant is not None:
        verdict, reason = (
            "AR-only",
            (f"Gemma 4 drafts with a separate assistant: {assistant['name']} ({assistant['problem']})"),
        )
    elif declared:
        verdict, reason = (
            "AR-only",
            f"config declares {declared} MTP layer(s) but the checkpoint ships no head tensors; run `mtplx forge`",
        )
    else:
        verdict, reason = "AR-only", "no MTP head in the checkpoint; run `mtplx forge` to train one"

    return {
        "path": str(path),
        "model_type": model_type,
        "architecture": (config.get("architectures") or [model_type])[0],
        "hidden_size": text.get("hidden_size", config.get("hidden_size")),
        "num_hidden_layers": text.get("num_hidden_layers", config.get("num_hidden_layers")),
        "vocab_size": text.get("vocab_size", config.get("vocab_size")),
        "parameters": params["trunk"] + params["mtp_head"],
        "parameters_by_part": params,
        "memory_bytes": sum(bytes_by_dtype.values()),
        "memory_bytes_by_dtype": dict(sorted(bytes_by_dtype.items())),
        "mtp_head_bytes": head_bytes,
        "shards": len(set(index.values())),
        "quantization": quant,
        "mtp": {
            "layout": layout if (head_tensors or declared) else None,
            "declared_layers": declared,
            "tensors": head_tensors,
        },
        "forged_head": forged,
        "assistant": assistant,
        "verdict": verdict,
        "reason": reason,
    }


def _human(n: float, unit: str = "B") -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.1f} {prefix}{unit}" if prefix else f"{int(n)} {unit}"
        n /= 1000
    return f"{n} {unit}"


def format_inspection(info: dict[str, Any]) -> str:
    """Human-readable text for ``mtplx inspect`` (``--json`` prints ``inspect_model``'s dict instead)."""
    mtp = info["mtp"]
    lines = [
        f"model         {info['path']}",
        f"architecture  {info['architecture']} (model_type {info['model_type']}, {info['num_hidden_layers']} layers, hidden {info['hidden_size']}, vocab {info['vocab_size']})",
        f"parameters    {_human(info['parameters'], '')} (MTP head {_human(info['parameters_by_part']['mtp_head'], '')})".replace(
            "  )", ")"
        ),
        f"memory        {_human(info['memory_bytes'])} in {info['shards']} shard(s): "
        + ", ".join(f"{k} {_human(v)}" for k, v in info["memory_bytes_by_dtype"].items()),
    ]
    q = info["quantization"]
    if q is None:
        lines.append("quantization  none")
    elif "bits" in q:
        extra = f", {q['per_layer_overrides']} per-layer override(s)" if q.get("per_layer_overrides") else ""
        lines.append(f"quantization  {q['bits']}-bit {q['mode']}, group size {q['group_size']}{extra}")
    else:
        lines.append(f"quantization  {q.get('method')}")
    if mtp["tensors"]:
        lines.append(
            f"MTP head      {mtp['layout']} layout, {mtp['declared_layers']} layer(s), {mtp['tensors']} tensors, {_human(info['mtp_head_bytes'])}"
        )
    elif mtp["declared_layers"]:
        lines.append(f"MTP head      declared ({mtp['declared_layers']} layer(s)) but no tensors shipped")
    else:
        lines.append("MTP head      none")
    if info["forged_head"]:
        lines.append(f"forged head   {info['forged_head'].get('manifest')}")
    assistant = info.get("assistant")
    if assistant:
        state = "pairs" if assistant["pairs"] else assistant["problem"]
        lines.append(f"assistant     {assistant['name']} ({state})")
    lines.append(f"verdict       {info['verdict']}: {info['reason']}")
    return "\n".join(lines)
