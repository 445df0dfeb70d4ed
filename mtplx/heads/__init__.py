"""MTP heads: one module per checkpoint layout; ``load_head`` detects which one a checkpoint ships.

Layouts (see each file for the math and the chosen ``hidden_source``):
- ``qwen3_next``: Qwen3-Next / Qwen3.5 / Qwen3.6 ``mtp.*`` (also the forged-head layout)
- ``deepseek``: DeepSeek-V3 / GLM-4.5 ``model.layers.{num_hidden_layers + i}.*``
- ``mimo``: MiMo ``model.mtp_layers.{i}.*``
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads import deepseek, mimo, qwen3_next
from mtplx.heads.base import MissingHeadError, MTPHead, weight_index
from mtplx.heads.deepseek import DeepSeekMTPHead
from mtplx.heads.mimo import MiMoMTPHead
from mtplx.heads.qwen3_next import Qwen3NextMTPHead

__all__ = [
    "MTPHead",
    "Qwen3NextMTPHead",
    "DeepSeekMTPHead",
    "MiMoMTPHead",
    "load_head",
    "load_checkpoint_head",
    "MissingHeadError",
    "detect_layout",
    "declared_mtp_layers",
    "DEFAULT_HIDDEN_SOURCE",
]

# model_type -> layout, for configs that declare MTP layers whose tensors are missing
_FAMILY_BY_MODEL_TYPE = {
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "deepseek_v3": "deepseek",
    "deepseek_v32": "deepseek",
    "kimi_k2": "deepseek",
    "glm4_moe": "deepseek",
    "mimo": "mimo",
}

_MODULES = {"qwen3_next": qwen3_next, "deepseek": deepseek, "mimo": mimo}
_LOADERS: dict[str, Callable[..., MTPHead | None]] = {
    "qwen3_next": qwen3_next.load_qwen3_next_head,
    "deepseek": deepseek.load_deepseek_head,
    "mimo": mimo.load_mimo_head,
}
DEFAULT_HIDDEN_SOURCE = {name: mod.DEFAULT_HIDDEN_SOURCE for name, mod in _MODULES.items()}


def _model_types(config: dict) -> list[str]:
    return [str(c.get("model_type", "")) for c in (config, config.get("text_config") or {})]


def detect_layout(index: dict[str, str], config: dict) -> str | None:
    """The layout whose tensors the checkpoint holds; else the one its model_type implies; else None."""
    for name, mod in _MODULES.items():
        if mod.has_layout(index):
            return name
    for mt in _model_types(config):
        if mt in _FAMILY_BY_MODEL_TYPE:
            return _FAMILY_BY_MODEL_TYPE[mt]
    return None


def declared_mtp_layers(config: dict, layout: str | None = None) -> int:
    """How many MTP layers the config declares (0 = none)."""
    mods = [_MODULES[layout]] if layout else list(_MODULES.values())
    return max(m.declared_layers(config) for m in mods)


def load_head(model_dir: Path, trunk: Any, config: dict, hidden_source: str | None = None) -> MTPHead | None:
    """The MTP head a checkpoint ships, built beside the mlx-lm ``trunk`` (a ``mtplx.trunk.model.Trunk``).

    None when the config declares no MTP layers; MtplxError (one line, naming the file)
    when it declares some but the tensors are missing or mis-shaped, or the layout is unknown.
    ``hidden_source`` overrides the layout's default trunk hidden ("pre_norm" / "post_norm").
    """
    model_dir = Path(model_dir)
    index = weight_index(model_dir)
    layout = detect_layout(index, config)
    if layout is None:
        if declared_mtp_layers(config):
            kind = ", ".join(t for t in _model_types(config) if t) or "unknown"
            raise MtplxError(
                f"{model_dir / 'config.json'}: declares MTP layers for an unsupported layout ({kind})"
            )
        return None
    kwargs = {} if hidden_source is None else {"hidden_source": hidden_source}
    return _LOADERS[layout](model_dir, trunk, config, index, **kwargs)


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
