"""Which draft head a loaded target drafts with, and loading it.

In order (the first that applies wins):
1. ``head`` given: a split MTP drafter, a Gemma 4 assistant (directory / cached repo id), or a
   forged-head directory;
2. the checkpoint's own MTP head (``load_checkpoint_head``);
3. for a target whose head was stripped (or never shipped): a split MTP drafter named like it
   beside it or in the HF cache (``split_drafter.find_split_drafter``);
4. for a Gemma 4 target without one: ``<target>-assistant`` beside it or in the HF cache;
5. for the default model: the forged head mtplx ships for it (also for its q4 build).
None when nothing applies: the target decodes without a head.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mtplx import resources
from mtplx.checkpoints import load as loading
from mtplx.drafters.discovery import find_block_drafter, read_block_drafter_config, refuse_block_drafter
from mtplx.heads import forged, gemma4_assistant, provenance, split_drafter
from mtplx.heads.base import MTPHead
from mtplx.heads.registry import load_head
from mtplx.heads.weights import MissingHeadError


def load_checkpoint_head(
    model_dir: Path, trunk: Any, config: dict, *, required: bool = False
) -> MTPHead | None:
    """``load_head`` for ``Engine.load``: a checkpoint whose config declares MTP layers but whose
    head tensors were stripped (mlx-lm's converter drops them) loads without a head, with a
    one-line note on stderr; ``required=True`` makes that an error instead."""
    try:
        return load_head(model_dir, trunk, config)
    except MissingHeadError as e:
        if required:
            raise
        print(f"note: {e}; decoding without MTP", file=sys.stderr)
        return None


def find_head(
    loaded: loading.LoadedModel,
    trunk: Any,
    *,
    model: str | Path | None = None,
    head: str | Path | None = None,
    dtype: str | None = None,
    required: bool = False,
) -> MTPHead | None:
    """The draft head for ``loaded`` (built beside ``trunk``, its ``Trunk``), found as the module
    docstring orders it. ``model`` is the spec ``loaded`` came from (None: the default model,
    ``dtype`` its build); ``required``: a stripped checkpoint head is an error, not a note."""
    # The default model given by its converted directory is still the default model.
    default_variant = (dtype or "float32") if model is None else loading.default_model_variant(loaded.path)
    head_dir = (
        loading.resolve_model(head)  # a directory, or a repo id (Gemma 4 assistants)
        if head is not None
        else (resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME) if default_variant else None)
    )
    if head_dir is None:
        own = _own_or_split_drafter(loaded, trunk, model, required)
        if own is not None or not gemma4_assistant.is_gemma4_target(loaded.config):
            return own
        head_dir = gemma4_assistant.find_assistant(loaded.path, model)
        if head_dir is None:
            return None
    if split_drafter.read_split_config(head_dir) is not None:
        return _split_drafter(head_dir, loaded, trunk)
    if read_block_drafter_config(head_dir) is not None:  # DFlash, DSpark, EAGLE-3: not a head
        refuse_block_drafter(find_block_drafter(loaded.path, head_dir, loaded.config))
    if gemma4_assistant.read_assistant_config(head_dir) is not None:
        return gemma4_assistant.load_gemma4_assistant(head_dir, trunk, loaded.config)
    return forged.load_forged_head(head_dir, trunk, _forged_for(loaded, default_variant))


def _split_drafter(drafter_dir: Path, loaded: loading.LoadedModel, trunk: Any) -> MTPHead:
    """A split drafter loaded for ``loaded``, its provenance measured (``head.provenance``; a
    warning when it agrees little with these weights, never a refusal)."""
    head = split_drafter.load_split_drafter(drafter_dir, trunk, loaded.config)
    head.provenance = provenance.check_drafter(trunk, head, loaded.tokenizer, str(drafter_dir))
    return head


def _own_or_split_drafter(
    loaded: loading.LoadedModel, trunk: Any, model: str | Path | None, required: bool
) -> MTPHead | None:
    """The checkpoint's own head; else a fitting split drafter found beside it (a misfit one
    named like its drafter is an error); else None, with the stripped-head note (or error when
    ``required``) naming the drafter names looked for."""
    try:
        own = load_head(loaded.path, trunk, loaded.config)
    except MissingHeadError as e:
        own, missing = None, e
    else:
        missing = None
    if own is not None:
        return own
    found = split_drafter.find_split_drafter(loaded.path, model, loaded.config)
    if found is not None:
        print(f"note: drafting with the split MTP drafter {found.path} ({found.why})", file=sys.stderr)
        return _split_drafter(found.path, loaded, trunk)
    if missing is None:
        return None
    also = ""
    if split_drafter.is_split_target(loaded.config):
        also = f", and no split MTP drafter beside it ({split_drafter.looked_for(loaded.path, model)})"
    if required:
        raise MissingHeadError(f"{missing}{also}")
    print(f"note: {missing}{also}; decoding without MTP", file=sys.stderr)
    return None


def _forged_for(loaded: loading.LoadedModel, default_variant: str | None) -> str:
    """The trunk fingerprint a forged head must match to draft for ``loaded``."""
    if default_variant == "q4":
        # The float32 build is the exact dequantization of the same GGUF blocks, so the
        # shipped head (forged on it) fits the 4-bit build too; check against its weights.
        return loading.load_model(None, variant="float32", lazy=True).fingerprint
    return loaded.fingerprint


def missing_head_message(config: dict) -> str:
    """What to tell a user who asked for head drafting on a target that has no head."""
    if gemma4_assistant.is_gemma4_target(config):
        return gemma4_assistant.MISSING_ASSISTANT
    return (
        "this model has no MTP head: use --draft lookup or --no-mtp (mtp=False), "
        "or train one with `mtplx forge`"
    )
