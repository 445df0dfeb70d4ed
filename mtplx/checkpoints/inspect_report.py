"""`mtplx inspect`'s text report: the facts `mtplx.checkpoints.inspect.inspect_model` gathers, one
aligned line each (sizes in human units, the head's widths, acceptance by depth, the verdict)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_inspection"]


def _vision_line(vision: dict) -> str:
    if not vision["takes_images"]:
        return f"vision        declared, images off: {vision['problem']}"
    return (
        f"vision        images in the prompt (tower of {vision['tower_tensors']} tensors, patch "
        f"{vision['patch_size']}, merge {vision['merge_size']}; M-RoPE positions), MTP drafts the text after them"
    )


def _human(n: float, unit: str = "B") -> str:
    """``1234567, "B"`` -> ``1.2 MB``; ``1234567, ""`` -> ``1.2M``."""
    space = " " if unit else ""
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or prefix == "T":
            return f"{n:.1f}{space}{prefix}{unit}" if prefix else f"{int(n)}{space}{unit}"
        n /= 1000
    return f"{n}{space}{unit}"


def _acceptance_text(acceptance: dict[str, dict[str, float]]) -> str:
    by_depth = []
    for depth, by_temp in sorted(acceptance.items(), key=lambda kv: int(kv[0])):
        temps = ", ".join(f"t={t} {a:.2f}" for t, a in sorted(by_temp.items(), key=lambda kv: float(kv[0])))
        by_depth.append(f"depth {depth}: {temps}")
    return "; ".join(by_depth)


def _widths(bits: int | str) -> str:
    """``8`` -> ``8-bit``; ``"4/8"`` -> ``4-bit/8-bit``; ``"float"`` stays."""
    return "/".join(w if w == "float" else f"{w}-bit" for w in str(bits).split("/"))


def _head_lines(info: dict[str, Any]) -> list[str]:
    head, mtp = info["head"], info["mtp"]
    if head is None:
        if mtp["declared_layers"]:
            return [f"MTP head      declared ({mtp['declared_layers']} layer(s)) but no tensors shipped"]
        return ["MTP head      none"]
    lines = [
        f"MTP head      {head['source']}: {head['layout']} layout, {head['layers']} layer(s), "
        f"{_human(head['parameters'], '')} parameters, {_human(head['bytes'])}"
    ]
    if mtp.get("norm_rule") and (head.get("source") == "in the checkpoint" or head.get("split")):
        lines.append(f"head norms    {mtp['norm_rule']}")
    prec = mtp.get("precision")
    if prec and head.get("source") == "in the checkpoint":
        groups = ", ".join(f"{g} {_widths(b)}" for g, b in prec["groups"].items())
        chosen = {None: "", "default": " (mtplx convert's default)", "float": " (--head-bits float)"}
        how = chosen.get(prec["converted_as"], f" (--head-bits {prec['converted_as']})")
        lines.append(f"head bits     {groups}{how}")
        if prec["below_8_bits"]:
            lines.append(
                f"warning       head {' and '.join(prec['below_8_bits'])} below 8 bits: drafts are "
                "often rejected; reconvert with `mtplx convert` (default) or --head-bits 8"
            )
    if "dir" in head:
        lines.append(f"head files    {head['dir']} (draft vocabulary {head['draft_vocab']})")
    if head.get("split") and head.get("default_depth"):
        lines.append(
            f"depth         default {head['default_depth']}: the drafter's block_size less the pending token"
            " (`mtplx tune` measures this machine)"
        )
    elif head.get("depth_trained") or head.get("default_depth"):
        lines.append(
            f"depth         trained at {head.get('depth_trained') or '?'}, default {head.get('default_depth') or '?'}"
            " (`mtplx tune` measures this machine)"
        )
    if head.get("provenance"):
        lines.append(f"provenance    {head['provenance']} (measured now)")
    if head.get("acceptance"):
        lines.append(f"acceptance    {_acceptance_text(head['acceptance'])} (measured when forged)")
    if "fits" in head:
        if head["fits"] == ["this model"]:
            fits = f"this model's weights (trunk {head['trunk_fingerprint']})"
        elif head["fits"]:
            fits = " and ".join(head["fits"]) + f" builds (trunk {head['trunk_fingerprint']})"
        else:
            fits = f"not these weights (forged for trunk {head['trunk_fingerprint']}, model is {head['model_fingerprint']})"
        lines.append(f"fits          {fits}")
    return lines


def format_inspection(info: dict[str, Any]) -> str:
    """Human-readable text for ``mtplx inspect`` (``--json`` prints ``inspect_model``'s dict instead)."""
    if info.get("kind") == "block_drafter":
        shown = {k: v for k, v in info.items() if k not in ("path", "kind", "verdict", "reason", "problem")}
        return "\n".join(
            [
                f"drafter       {info['path']}",
                "facts         " + ", ".join(f"{k} {v}" for k, v in shown.items()),
            ]
            + [f"verdict       {info['verdict']}: {info['reason']}"]
        )
    lines = [
        f"model         {info['path']}"
        + (f" (default model, {info['default_model_build']} build)" if info["default_model_build"] else ""),
        f"architecture  {info['architecture']} (model_type {info['model_type']}, {info['num_hidden_layers'] if info['num_hidden_layers'] is not None else 'unknown'} layers, hidden {info['hidden_size']}, vocab {info['vocab_size']})",
        _backend_line(info.get("trunk_backend") or {}),
        f"parameters    {_human(info['parameters'], '')}"
        + (
            f" (MTP head {_human(info['parameters_by_part']['mtp_head'], '')} of them)"
            if info["parameters_by_part"]["mtp_head"]
            else ""
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
    kv = info.get("kv_bytes_per_token") or {}
    if any(kv.values()):
        lines.append("kv cache      per token: " + ", ".join(f"{k} {_human(v)}" for k, v in kv.items()))
    lines.extend(_head_lines(info))
    if info["forged_head"] and info["head"] is None:
        lines.append(f"forged head   {info['forged_head'].get('manifest')}")
    split = info.get("split_drafter")
    if split and not split.get("path"):
        lines.append(f"split drafter none beside it ({split['looked_for']})")
    assistant = info.get("assistant")
    if assistant:
        state = "pairs" if assistant["pairs"] else assistant["problem"]
        lines.append(f"assistant     {assistant['name']} ({state})")
    block = info.get("block_drafter")
    if block:
        state = "fits" if block["fits"] else f"does not fit: {block['problem']}"
        state += "; drafts" if block["drafts"] else f"; {block['note'] or 'does not draft'}"
        lines.append(f"block drafter {block['layout']} {block['path']} ({block['why']}; {state})")
    if info.get("vision"):
        lines.append(_vision_line(info["vision"]))
    lines.append(f"verdict       {info['verdict']}: {info['reason']}")
    return "\n".join(lines)


def _backend_line(backend: dict) -> str:
    """Which package hosts the trunk (``mtplx.trunk.backends``), or why none can."""
    if backend.get("backend"):
        return f"trunk         {backend['backend']} {backend['version']}"
    return f"trunk         none ({backend.get('problem')})"
