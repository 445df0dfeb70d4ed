"""Finding a target's block drafter (DFlash, DFlash2, DSpark, EAGLE-3), the way split MTP drafters
are found (`mtplx.heads.split_drafter`): given with ``--head`` / ``--draft-model``, or a directory
beside the target named like its drafter, then checked by its config against the target.

Names (the publishers' own): ``<target stem>-DFlash[-b16]``, ``-DFlash2``, ``-DSpark``,
``-EAGLE3`` / ``-eagle3`` / ``-Eagle-3`` (any case; the target's precision suffix dropped as
`split_drafter.target_stems` does). A named drafter that does not fit is reported with the field.

Block drafters load and are checked here (``mtplx inspect`` reports which one a model would use
and why). Loaded by `Engine.load`, DFlash, DFlash2 and DSpark draft a block per forward
(`mtplx.spec_decode.block_proposer`), EAGLE-3 its chain (`mtplx.spec_decode.eagle3_proposer`).
Standard library only, except ``load_block_drafter`` (MLX, on demand).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx.drafters.layouts import (
    dflash2_spec,
    dflash_fit_problem,
    dflash_spec,
    drafter_layout,
    dspark_spec,
    eagle3_fit_problem,
    eagle3_spec,
)
from mtplx.errors import MtplxError

LAYOUT_NAMES = {"dflash": "DFlash", "dflash2": "DFlash2", "dspark": "DSpark", "eagle3": "EAGLE-3"}
LOADABLE = ("dflash", "dflash2", "dspark", "eagle3")
# DSpark layouts with their own architectures (mlx-vlm's gemma4_dspark, deepseek_v4_dspark): named, not loaded yet.
OWN_DSPARK = (
    "gemma4_dspark",
    "deepseek_v4_dspark",
    "Gemma4DSparkModel",
)  # the layouts whose loaders and references have landed
_NAME = re.compile(r"(?i)[-_](dflash2|dflash|dspark|eagle-?3)([-_].*)?")  # the whole rest (fullmatch)
DRAFTING = ("dflash", "dflash2", "dspark", "eagle3")  # the layouts that draft (`sources.BLOCK_SOURCES`)


def read_block_drafter_config(path: str | Path | None) -> dict | None:
    """The config of a block drafter directory, else None."""
    if path is None:
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) and drafter_layout(config) is not None else None


def name_says_drafter(candidate: str, target: str) -> bool:
    """Whether a directory name says it is a block drafter of ``target``."""
    from mtplx.heads.split_drafter import target_stems

    low = candidate.lower()
    return any(
        low.startswith(stem.lower()) and _NAME.fullmatch(low[len(stem) :]) for stem in target_stems(target)
    )


def _text(config: dict) -> dict:
    return config.get("text_config") or config


def _layer_count(text: dict) -> int:
    """The trunk's decoder layers: as mlx-lm counts them, Nemotron-H's by its block pattern
    (``hybrid_override_pattern`` / ``layers_block_type``), where a config may have no
    ``num_hidden_layers``."""
    pattern = text.get("hybrid_override_pattern") or text.get("layers_block_type")
    return len(pattern) if pattern else int(text.get("num_hidden_layers", 0))


def fit_problem(drafter_config: dict, target_config: dict) -> str | None:
    """Why a block drafter does not fit the target (one line naming the field), or None."""
    layout = drafter_layout(drafter_config)
    if layout not in LOADABLE:
        return f"{LAYOUT_NAMES[layout]} drafters are recognised but not loaded yet"
    own = {str(drafter_config.get("model_type")), *(drafter_config.get("architectures") or ())} & set(
        OWN_DSPARK
    )
    if layout == "dspark" and own:
        return f"the {sorted(own)[0]} DSpark layout is recognised but not loaded yet"
    text = _text(target_config)
    shape = (
        int(text.get("hidden_size", 0)),
        _layer_count(text),
        int(text.get("vocab_size", 0)),
    )
    try:
        if layout == "eagle3":
            return eagle3_fit_problem(eagle3_spec(drafter_config), *shape)
        if layout == "dspark":
            return dflash_fit_problem(dspark_spec(drafter_config).backbone, *shape)
        if layout == "dflash2":
            return dflash_fit_problem(dflash2_spec(drafter_config).backbone, *shape)
        return dflash_fit_problem(dflash_spec(drafter_config), *shape)
    except MtplxError as err:
        return str(err)


@dataclass(frozen=True)
class BlockCandidate:
    """A block drafter for a target: where, its layout, why it was chosen, and whether it fits."""

    path: Path
    layout: str
    why: str
    config: dict
    problem: str | None

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "layout": self.layout,
            "why": self.why,
            "fits": self.problem is None,
            "problem": self.problem,
            "drafts": drafts(self),
            "note": None if drafts(self) else self.problem,
        }


def drafts(candidate: BlockCandidate) -> bool:
    """Whether a candidate drafts when loaded (it fits, and its layout has a proposer)."""
    return candidate.problem is None and candidate.layout in DRAFTING


def find_block_drafter(
    model_path: Path, given: str | Path | None, target_config: dict
) -> BlockCandidate | None:
    """The block drafter given (``--head`` / ``--draft-model``: a directory) or, else, the best one
    beside the target named like its drafter (a fitting one first); None when there is none."""
    if given is not None:
        config = read_block_drafter_config(given)
        if config is None:
            return None
        why = "given with --head / --draft-model"
        return BlockCandidate(
            Path(given), drafter_layout(config), why, config, fit_problem(config, target_config)
        )
    parent, target = Path(model_path).parent, Path(model_path).name
    try:
        siblings = sorted(p for p in parent.iterdir() if p.is_dir() and p != Path(model_path))
    except OSError:
        return None
    found = []
    for path in siblings:
        config = read_block_drafter_config(path) if name_says_drafter(path.name, target) else None
        if config is not None:
            why = f"beside the model, named {path.name}: {target}'s drafter by name, then by config"
            found.append(
                BlockCandidate(path, drafter_layout(config), why, config, fit_problem(config, target_config))
            )
    found.sort(key=lambda c: c.problem is not None)
    return found[0] if found else None


def describe_drafter_dir(path: Path, config: dict) -> dict[str, Any]:
    """``mtplx inspect`` of a block drafter directory itself: its layout and the facts a target
    must match (a malformed config: the one-line problem instead)."""
    layout = drafter_layout(config)
    facts: dict[str, Any] = {"path": str(path), "kind": "block_drafter", "layout": layout}
    try:
        if layout == "eagle3":
            spec = eagle3_spec(config)
            ids = list(spec.aux_layer_ids) if spec.aux_layer_ids else "low / middle / high of the target"
            facts |= {
                "hidden_size": spec.target_hidden_size,
                "vocab_size": spec.vocab_size,
                "target_layers": ids,
            }
            facts |= {"draft_vocab_size": spec.draft_vocab_size, "block_size": spec.block_size}
        elif layout in ("dflash", "dflash2", "dspark"):
            read = {
                "dflash": dflash_spec,
                "dflash2": lambda c: dflash2_spec(c).backbone,
                "dspark": lambda c: dspark_spec(c).backbone,
            }
            spec = read[layout](config)
            facts |= {
                "hidden_size": spec.hidden_size,
                "vocab_size": spec.vocab_size,
                "target_layers": list(spec.target_layer_ids),
            }
            facts |= {
                "num_target_layers": spec.num_target_layers,
                "block_size": spec.block_size,
                "mask_token_id": spec.mask_token_id,
            }
        problem = None
    except MtplxError as err:
        problem = str(err)
    reason = problem or "drafts beside a target that fits it"
    return facts | {"problem": problem, "verdict": "block drafter", "reason": reason}


def load_block_drafter(candidate: BlockCandidate) -> Any:
    """Load a fitting candidate (`load_dflash`, `load_dflash2`, `load_dspark`, `load_eagle3`); a misfit or a
    layout not loaded yet is a one-line error naming it."""
    if candidate.problem is not None:
        raise MtplxError(
            f"{candidate.path}: {LAYOUT_NAMES[candidate.layout]} drafter does not fit: {candidate.problem}"
        )
    if candidate.layout == "eagle3":
        from mtplx.drafters.eagle3 import load_eagle3

        return load_eagle3(candidate.path)
    if candidate.layout == "dspark":
        from mtplx.drafters.dspark import load_dspark

        return load_dspark(candidate.path)
    if candidate.layout == "dflash2":
        from mtplx.drafters.dflash2 import load_dflash2

        return load_dflash2(candidate.path)
    from mtplx.drafters.dflash import load_dflash

    return load_dflash(candidate.path)


def refuse_block_drafter(candidate: BlockCandidate) -> None:
    """What a block drafter given where only an MTP head or a draft model can go does: load it (so
    a misfit is reported by its field), then a one-line error saying what it is and how it drafts."""
    load_block_drafter(candidate)
    name = LAYOUT_NAMES[candidate.layout]
    raise MtplxError(
        f"{candidate.path}: a {name} drafter, not an MTP head or a draft model: "
        f"give it to Engine.load (--head DIR) and draft with it ({candidate.layout!r} or 'auto')"
    )
