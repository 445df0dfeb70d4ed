"""Every contact mtplx has with mlx-vlm, and with the one mlx-lm attribute the image path hooks, in
one place, checked against the installed packages (the image-side sibling of `mtplx.trunk.compat`,
which keeps the mlx-lm side; that module is near the line limit, so the mlx-vlm half lives here
under the same rules: nothing else imports mlx-vlm, and ``check()`` names what changed).

What is taken from mlx-vlm 0.7.10 (``mlx_vlm/models/qwen3_5/``, ``qwen3_5_moe/``, ``qwen3_vl/``),
and only this: the vision tower (``VisionModel``: patch embedding, blocks, merger) built from the
checkpoint's ``vision_config``, its weight ``sanitize`` (torch conv layout), the model config's
special token ids, and the numpy image processor (``Qwen3VLImageProcessor``: smart resize,
normalisation, patch flattening). The language model stays mlx-lm's (its caches, rollback and batch
caches are mtplx's own); mlx-vlm's language classes are never built.

The position hook: mlx-lm's Qwen3.5 / Qwen3-Next attention applies plain RoPE as
``self.rope(queries, offset=cache.offset)`` (``mlx_lm/models/qwen3_next.py``), ``rope`` an
``nn.RoPE``. `hook_ropes` swaps each such instance's class for a subclass of its own class whose
call reads a shared `RopeSwitch`: unset, it is the original call (bit for bit); set, it rotates by
the explicit 3-D (M-RoPE) positions held there. The parameter tree is unchanged.
"""

from __future__ import annotations

import copy
import functools
import importlib
import inspect
from importlib import metadata
from typing import Any

from mtplx.errors import MtplxError
from mtplx.trunk.compat_probe import format_version, guarded, parse_version

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "SUPPORTED_MLX_VLM",
    "VISION_MODEL_TYPES",
    "RopeSwitch",
    "VisionSpec",
    "build_vision",
    "check",
    "hook_ropes",
    "hooked_ropes",
    "mrope",
    "image_processor",
    "run_tower",
    "sanitize_tower_weights",
]

# [low, high): the mlx-vlm releases this module was verified on.
SUPPORTED_MLX_VLM = ((0, 7, 10), (0, 8, 0))
# checkpoint model_type -> the mlx-vlm module that holds its tower and config.
VISION_MODEL_TYPES = {"qwen3_5": "mlx_vlm.models.qwen3_5", "qwen3_5_moe": "mlx_vlm.models.qwen3_5_moe"}
# mlx-lm attention classes whose ``rope`` is called as ``self.rope(x, offset=cache.offset)``.
_HOOKED_ATTENTION = ("mlx_lm.models.qwen3_next.Qwen3NextAttention",)
_ROPE_CALL = "self.rope(queries, offset=cache.offset)"
# Weight key prefixes of the tower: Hugging Face's layout, then mlx-vlm's converted one.
TOWER_PREFIXES = ("model.visual.", "vision_tower.")


class VisionSpec:
    """What a checkpoint's config says about its images (mlx-vlm's ``ModelConfig``, read by name)."""

    def __init__(self, model_config: Any):
        self.image_token_id = int(model_config.image_token_id)
        self.video_token_id = int(model_config.video_token_id)
        self.vision_start_token_id = int(model_config.vision_start_token_id)
        self.vision_end_token_id = int(model_config.vision_end_token_id)
        vision = model_config.vision_config
        self.spatial_merge_size = int(vision.spatial_merge_size)
        self.patch_size = int(vision.patch_size)
        self.temporal_patch_size = int(vision.temporal_patch_size)
        rope = dict(model_config.text_config.rope_parameters or {})
        self.mrope_section = tuple(int(n) for n in rope.get("mrope_section", ()))


def _vlm_module(model_type: str):
    name = VISION_MODEL_TYPES.get(model_type)
    if name is None:
        raise MtplxError(
            f"model_type {model_type!r}: images are supported for {', '.join(VISION_MODEL_TYPES)} only"
        )
    return importlib.import_module(name)


def build_vision(config: dict) -> tuple[nn.Module, VisionSpec]:
    """The vision tower (random weights until loaded) and the image facts of ``config``."""
    module = _vlm_module(config.get("model_type", ""))
    try:
        model_config = module.ModelConfig.from_dict(copy.deepcopy(config))  # it edits rope_parameters
        tower = module.VisionModel(model_config.vision_config)
    except (TypeError, ValueError, KeyError) as e:
        raise MtplxError(f"vision_config: mlx-vlm cannot build the vision tower ({e})") from None
    return tower, VisionSpec(model_config)


def sanitize_tower_weights(tower: nn.Module, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """The tower's own tensors of a checkpoint's ``weights`` (either layout), named as the tower's
    parameters and in its conv layout (mlx-vlm's ``VisionModel.sanitize``)."""
    in_channels = tower.patch_embed.proj.weight.shape[-1]  # mlx's Conv3d: [out, T, P, P, in]
    own = {}
    for key, value in weights.items():
        prefix = next((p for p in TOWER_PREFIXES if key.startswith(p)), None)
        if prefix is None:
            continue
        key = key[len(prefix) :]
        if key == "patch_embed.proj.weight" and value.ndim == 5:
            value = _conv3d_to_mlx(value, in_channels, torch_named=prefix == TOWER_PREFIXES[0])
        own[key] = value
    return tower.sanitize(own)


def _conv3d_to_mlx(weight: mx.array, in_channels: int, torch_named: bool) -> mx.array:
    """The patch embedding's Conv3d weight in mlx's layout [out, T, P, P, in], from torch's
    [out, in, T, P, P] where it is in that one: by the channel axes (mlx-vlm's model-level
    ``sanitize`` rule), and where both fit (T = P = in), by the names (Hugging Face's are torch's).
    The tower's own ``sanitize`` guesses by shape and keeps a torch weight whose patch equals its
    temporal size and is at most 3 as it is; after this it sees mlx's layout."""
    torch_fits, mlx_fits = weight.shape[1] == in_channels, weight.shape[-1] == in_channels
    if torch_fits and (not mlx_fits or torch_named):
        return weight.transpose(0, 2, 3, 4, 1)
    return weight


def run_tower(tower: nn.Module, pixel_values: mx.array, grid_thw: mx.array) -> mx.array:
    """Merged image features [tokens, text hidden] for the patches of the images in ``grid_thw``."""
    features, _deepstack = tower(pixel_values, grid_thw)  # Qwen3.5 has no deepstack features
    return features


def image_processor(settings: dict) -> Any:
    """mlx-vlm's numpy Qwen-VL image processor with a checkpoint's preprocessor settings."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    return Qwen3VLImageProcessor(**settings)


# --------------------------------------------------------------------------- the position hook


class RopeSwitch:
    """The explicit positions of the current forward, shared by every hooked rope of one model.

    ``positions``: int32 [3, B, L] (temporal, height, width per token) or None (plain RoPE).
    ``selector``: which of the three axes each frequency reads (the M-RoPE layout).
    """

    def __init__(self, selector: tuple[int, ...]):
        self.positions: mx.array | None = None
        self.selector = selector


def mrope(x: mx.array, positions: mx.array, selector: tuple[int, ...], dims: int, base: float, scale: float):
    """Rotate x [B, H, L, D] by 3-D positions [3, B, L]: frequency j turns by the position on axis
    selector[j], in the half-split pairing of ``nn.RoPE(traditional=False)`` (so equal axes give
    exactly plain RoPE's angles). Reference: Hugging Face ``Qwen3VLTextRotaryEmbedding`` with
    ``apply_interleaved_mrope`` (transformers/models/qwen3_vl/modeling_qwen3_vl.py)."""
    half = dims // 2
    inv_freq = 1.0 / (base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))  # [half], as HF computes it
    chosen = mx.take(positions.astype(mx.float32), mx.array(selector, dtype=mx.int32), axis=0)  # [half, B, L]
    angles = chosen.transpose(1, 2, 0) * scale * inv_freq  # [B, L, half]
    cos, sin = mx.cos(angles)[:, None], mx.sin(angles)[:, None]  # [B, 1, L, half]
    x1, x2 = x[..., :half].astype(mx.float32), x[..., half:dims].astype(mx.float32)
    rotated = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
    return mx.concatenate([rotated, x[..., dims:]], axis=-1) if dims < x.shape[-1] else rotated


def _hooked_attention(model: nn.Module) -> list[nn.Module]:
    return [
        m for _, m in model.named_modules() if f"{type(m).__module__}.{type(m).__name__}" in _HOOKED_ATTENTION
    ]


def hook_ropes(model: nn.Module, selector: tuple[int, ...]) -> RopeSwitch:
    """Hook every full-attention layer's rope of ``model`` (once; a second call returns the same
    switch). Raises MtplxError when the model has no attention this hook knows."""
    layers = _hooked_attention(model)
    if not layers:
        raise MtplxError("images: this model's attention layers have no position hook (Qwen3.5 only)")
    existing = getattr(type(layers[0].rope), "_mtplx_switch", None)
    if existing is not None:
        return existing
    switch = RopeSwitch(selector)
    for layer in layers:
        rope = layer.rope
        base = type(rope)
        if base is not nn.RoPE or rope.traditional:
            raise MtplxError(f"images: attention rope {base.__name__} is not plain half-split RoPE")

        def __call__(self, x, offset=0, _base=base):
            if switch.positions is None:
                return _base.__call__(self, x, offset=offset)
            return mrope(x, switch.positions, switch.selector, self.dims, self.base, self.scale)

        rope.__class__ = type(
            f"Hooked{base.__name__}", (base,), {"__call__": __call__, "_mtplx_switch": switch}
        )
    return switch


def hooked_ropes(model: nn.Module) -> list[nn.Module]:
    """The ropes `hook_ropes` hooked (their ``dims``, ``base``, ``scale`` are the layer's)."""
    return [layer.rope for layer in _hooked_attention(model)]


# --------------------------------------------------------------------------- the check


def _check_version(version: str) -> list[str]:
    low, high = SUPPORTED_MLX_VLM
    if not low <= parse_version(version) < high:
        return [
            f"mlx-vlm {version} is outside the supported range >={format_version(low)},<{format_version(high)}"
        ]
    return []


def _check_modules() -> list[str]:
    problems = []
    for name in VISION_MODEL_TYPES.values():
        module = importlib.import_module(name)
        for attr in ("ModelConfig", "VisionModel"):
            if not hasattr(module, attr):
                problems.append(f"{name} has no {attr}")
        if hasattr(module, "VisionModel") and not callable(getattr(module.VisionModel, "sanitize", None)):
            problems.append(f"{name}.VisionModel has no sanitize")
    return problems


def _check_rope_call(attention_path: str = _HOOKED_ATTENTION[0]) -> list[str]:
    module_name, cls_name = attention_path.rsplit(".", 1)
    source = inspect.getsource(getattr(importlib.import_module(module_name), cls_name).__call__)
    if _ROPE_CALL not in source:
        return [f"{cls_name} no longer calls {_ROPE_CALL}"]
    return []


def check(*, version: str | None = None, attention_path: str = _HOOKED_ATTENTION[0]) -> None:
    """Raise one MtplxError naming every assumption the installed mlx-vlm / mlx-lm breaks."""
    try:
        installed = metadata.version("mlx-vlm") if version is None else version
    except metadata.PackageNotFoundError:
        raise MtplxError("images need mlx-vlm: pip install 'mtplx[vision]'") from None
    problems = _check_version(installed)
    problems += guarded("probing mlx-vlm's Qwen3.5 modules", _check_modules)
    problems += guarded("probing the attention's rope call", _check_rope_call, attention_path)
    if problems:
        raise MtplxError(
            "the installed mlx-vlm / mlx-lm changed what mtplx's image path relies on "
            "(mtplx/trunk/compat_vision.py): " + "; ".join(problems)
        )


@functools.cache
def check_once() -> None:
    check()
