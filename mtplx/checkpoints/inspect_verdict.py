"""Which head `mtplx inspect`'s model drafts with, and the verdict.

The checkpoint's own head is what its tensors say (`mtplx.checkpoints.inspect`); here are the
heads beside it or given with ``--head`` (a forged head attached, a forged sidecar or the one
mtplx ships for the default model, its trunk fingerprint checked against the model's weights; a
split MTP drafter; a Gemma 4 assistant; a block drafter), and the rule list that turns all of
them into "MTP-ready", "AR-only", "drafter" or "unsupported" with its reason.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mtplx.checkpoints.load import DEFAULT_MODEL_NAME, VARIANTS, resolve_model
from mtplx.errors import MtplxError
from mtplx.model_files.headers import read_safetensors_header

__all__ = ["block_drafter_facts", "choose_verdict", "heads_beside"]


def _find_forged(path: Path) -> dict | None:
    """A forged head stored beside the model, in ``<model>/mtplx_head/`` (pass that directory as
    ``--head``); None when there is none."""
    manifest = path / "mtplx_head" / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raise MtplxError(f"{manifest}: unreadable forged-head manifest") from None
    if not isinstance(data, dict):
        raise MtplxError(f"{manifest}: not a forged-head manifest (not a JSON object)")
    return {
        "manifest": str(manifest),
        "layout": data.get("layout"),
        "fingerprint": data.get("trunk_fingerprint"),
    }


def _gemma4_assistant(path: Path, spec: str | Path | None, config: dict, given: Path | None) -> dict | None:
    """The Gemma 4 assistant given with --head, or for a Gemma 4 target the one that pairs with
    it (``<target>-assistant`` beside it or in the HF cache), checked against both configs; else
    the name looked for and why it does not serve."""
    from mtplx.heads import gemma4_assistant as ga

    if given is not None:
        problem = ga.pairing_problem(ga.read_assistant_config(given), config)
        return {"name": str(given), "path": str(given), "pairs": problem is None, "problem": problem}
    if not ga.is_gemma4_target(config):
        return None
    candidates = ga.assistant_candidates(path, spec)
    for name, found in candidates:
        assistant = ga.read_assistant_config(found) if found is not None else None
        if assistant is not None:
            problem = ga.pairing_problem(assistant, config)
            return {"name": name, "path": str(found), "pairs": problem is None, "problem": problem}
    return {"name": candidates[-1][0], "path": None, "pairs": False, "problem": "not found locally"}


def _trunk_fingerprint(path: Path) -> str:
    from mtplx.checkpoints.load import load_mlx_model
    from mtplx.model_files.fingerprint import model_fingerprint

    model, _ = load_mlx_model(path, lazy=True)  # through the backend that hosts it
    return model_fingerprint(model)


def _sidecar_head(
    head_dir: Path, source: str, model_path: Path, default_variant: str | None
) -> dict[str, Any]:
    """A forged head's facts from its manifest and weights header, and the builds of the model it fits."""
    from mtplx.heads.forged import MANIFEST, WEIGHTS, read_manifest

    manifest = read_manifest(head_dir)
    weights = head_dir / str(manifest.get("weights", WEIGHTS))
    if not weights.is_file():
        raise MtplxError(f"{weights}: forged-head weights not found")
    header = read_safetensors_header(weights)
    if default_variant is not None:
        # The float32 build is the exact dequantization of the GGUF the q4 build packs, so a head
        # forged on float32 weights fits both (what `Engine.load` checks too).
        fingerprint = _trunk_fingerprint(resolve_model(None, variant="float32"))
        builds = list(VARIANTS) if fingerprint == manifest["trunk_fingerprint"] else []
    else:
        fingerprint = _trunk_fingerprint(model_path)
        builds = ["this model"] if fingerprint == manifest["trunk_fingerprint"] else []
    return {
        "source": source,
        "dir": str(head_dir),
        "manifest": str(head_dir / MANIFEST),
        "layout": manifest.get("layout"),
        "layers": int(manifest.get("num_layers", 1)),
        "parameters": sum(math.prod(t["shape"]) for t in header.values()),
        "bytes": weights.stat().st_size,
        "draft_vocab": manifest.get("draft_vocab", "full"),
        "depth_trained": manifest.get("depth_trained"),
        "default_depth": manifest.get("default_depth"),
        # {depth: {temperature: acceptance}}, measured on held-out text when the head was forged
        "acceptance": manifest.get("acceptance"),
        "trunk": manifest.get("trunk"),
        "trunk_fingerprint": manifest["trunk_fingerprint"],
        "model_fingerprint": fingerprint,
        "fits": builds,
    }


def choose_verdict(
    config: dict,
    path: Path,
    *,
    layout,
    declared,
    count_source: str,
    head_tensors: int,
    head_parameters: int,
    head_bytes: int,
    is_drafter: bool,
    split,
    given_split,
    sidecar,
    forged,
    assistant,
    supported: bool,
    unsupported_reason: str | None = None,
) -> tuple[str, str, dict | None]:
    """(verdict, reason, the head it drafts with): the first rule that applies, in order."""
    from mtplx.heads import split_drafter
    from mtplx.heads.gemma4_assistant import is_assistant_config

    model_type = str(config["model_type"])
    if is_assistant_config(config):
        verdict = "drafter"
        reason = f"a Gemma 4 assistant for targets with hidden_size {config.get('backbone_hidden_size')}; use it with --head"
    elif is_drafter:
        verdict, reason = "drafter", split_drafter.describe_drafter(config)
        sidecar = split_drafter.head_info(path, config, "split MTP drafter")
    elif split and split["path"] and (given_split is not None or not head_tensors):
        verdict, reason, sidecar = _split_verdict(split, path, config)
    elif not supported:
        verdict, reason = "unsupported", unsupported_reason or f"no backend hosts model_type {model_type!r}"
    elif sidecar is not None and not sidecar["fits"]:
        verdict, reason = (
            "AR-only",
            f"the head in {sidecar['dir']} was forged for trunk {sidecar['trunk_fingerprint']}, not these "
            f"weights ({sidecar['model_fingerprint']}); run `mtplx forge` for this model",
        )
    elif sidecar is not None:
        verdict, reason = "MTP-ready", f"drafts with the head {sidecar['source']} ({sidecar['dir']})"
    elif declared and layout is None:
        verdict, reason = (
            "AR-only",
            f"config declares {declared} MTP layer(s) in a layout mtplx does not know (model_type "
            f"{model_type}; {head_tensors} tensor(s) named like a head); decodes without MTP",
        )
    elif head_tensors and declared:
        counted = "" if count_source == "config" else ", counted from tensor names: the config declares none"
        verdict, reason = (
            "MTP-ready",
            f"the checkpoint ships {declared} MTP layer(s) ({layout} layout{counted})",
        )
        sidecar = {
            "source": "in the checkpoint",
            "layout": layout,
            "layers": declared,
            "parameters": head_parameters,
            "bytes": head_bytes,
        }
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
    return verdict, reason, sidecar


def heads_beside(
    path: Path, spec_or_path, config: dict, head, head_tensors: int, is_drafter: bool, default_variant
):
    """The heads a model could draft with besides its own tensors: (a forged head attached, the
    sidecar head given with ``head`` or shipped by mtplx, the split drafter given with ``head``,
    the split drafter found beside it, the Gemma 4 assistant)."""
    from mtplx.drafters.discovery import read_block_drafter_config
    from mtplx.heads import split_drafter
    from mtplx.heads.gemma4_assistant import read_assistant_config
    from mtplx.resources import shipped_head_dir

    forged = _find_forged(path)
    shipped = shipped_head_dir(DEFAULT_MODEL_NAME) if default_variant else None
    sidecar = None
    given_assistant = resolve_model(head) if head is not None else None
    given_split = given_assistant if split_drafter.read_split_config(given_assistant) else None
    if given_assistant is not None and (given_split or read_assistant_config(given_assistant) is None):
        given_assistant = None
    split = None if is_drafter else split_drafter.inspect_split(path, spec_or_path, config, given_split)
    given_block = read_block_drafter_config(head)  # a directory (block drafters are not looked up by repo id)
    if head is not None and given_assistant is None and given_split is None and given_block is None:
        sidecar = _sidecar_head(Path(head), "forged sidecar given with --head", path, default_variant)
    elif not head_tensors and shipped is not None:
        sidecar = _sidecar_head(shipped, "shipped by mtplx for this model", path, default_variant)
    assistant = _gemma4_assistant(path, spec_or_path, config, given_assistant)
    return forged, sidecar, given_split, split, assistant


def block_drafter_facts(path: Path, config: dict, head) -> dict[str, Any] | None:
    """The block drafter (DFlash, DFlash2, DSpark, EAGLE-3) given with ``head`` or found beside the
    model (`mtplx.drafters.discovery`), with why and whether it fits; None when there is none."""
    from mtplx.drafters.discovery import find_block_drafter, read_block_drafter_config

    given = Path(head) if head is not None and read_block_drafter_config(head) is not None else None
    found = find_block_drafter(path, given, config)
    return None if found is None else found.describe()


def _split_verdict(split: dict, path: Path, config: dict) -> tuple[str, str, dict | None]:
    """Verdict, reason and head facts for a target with a split MTP drafter found or given."""
    from mtplx.heads import split_drafter

    where = f"{split['path']} ({split['why']})"
    if split["problem"] is not None:
        return "AR-only", f"the split MTP drafter {where} does not fit: {split['problem']}", None
    from mtplx.heads import provenance

    info = split_drafter.head_info(Path(split["path"]), split_drafter.read_split_config(split["path"]), where)
    measured = provenance.measure_dir(path, split["path"])
    info["provenance"] = measured.describe() if measured is not None else None
    if measured is not None and measured.suspicious:
        return (
            "MTP-ready",
            f"drafts with the split MTP drafter {where}, but its {measured.describe()} is below {provenance.WARN_BELOW}: it may belong to other weights",
            info,
        )
    return "MTP-ready", f"drafts with the split MTP drafter {where}", info
