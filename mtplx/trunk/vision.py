"""Images in the prompt of a Qwen3.5 / 3.6 vision-language checkpoint: reading and checking an
image, the checkpoint's own preprocessing and vision tower (mlx-vlm's, through
`mtplx.trunk.compat_vision`), the image's tokens in the prompt, and the features that replace
their embeddings in the trunk's forward (`mtplx.trunk.model.Trunk`).

An image becomes ``n`` prompt tokens (`ImageToken`): each is the checkpoint's image pad id as an
int (what the model, the sampler, lookup and the detokenizer see, so nothing downstream meets an
id outside the vocabulary) that also carries its image and patch index, and compares equal only
to the same patch of an image with the same pixels. The prompt cache, keyed on token sequences,
so never shares a prefix past the start of a different image of the same size.

The prompt's images are bound to the row's caches (`bind`, on the first attention cache, as
`Engine` opens the request's caches); the trunk reads them there for every prefill forward that
touches an image: embeddings merged with the tower's features, M-RoPE positions, and the reframe
after each image (`mtplx.trunk.image_positions`). The MTP head reads the trunk's hidden states and
the image pad token's own embedding at image positions, at its own plain positions (vLLM feeds
its Qwen3.5 drafter the merged features and real positions; here the head's input is the
request's token ids, which the verifier keeps exact either way; acceptance after an image is
measured in benchmarks/vision.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError, first_line
from mtplx.trunk import compat_vision
from mtplx.trunk.compat import KVCache, cache_leaves
from mtplx.trunk.image_positions import ImageSpan

import mlx.core as mx
import mlx.nn as nn
import numpy as np

__all__ = [
    "ImageLimits",
    "ImageToken",
    "PromptImages",
    "VisionEncoder",
    "VisionImage",
    "attach_declared",
    "bind",
    "bound",
    "bound_nbytes",
    "is_vision_config",
    "unbind",
]

_BOUND = "_mtplx_images"  # the attribute of a row's first KVCache holding its prompt's images
# Preprocessor fields passed on to the image processor as they are.
_PROCESSOR_FIELDS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "image_mean",
    "image_std",
    "rescale_factor",
    "do_rescale",
    "do_normalize",
    "do_convert_rgb",
    "min_pixels",
    "max_pixels",
)


def is_vision_config(config: dict) -> bool:
    """True when ``config`` (a checkpoint's config.json) declares a vision tower."""
    return isinstance(config.get("vision_config"), dict)


def attach_declared(trunk, path: Path, config: dict) -> None:
    """Give ``trunk`` its checkpoint's vision tower when config.json declares one. A family the
    image path does not cover (Gemma 4), or no mlx-vlm installed (a note on stderr), leaves the
    model text-only with the reason in ``trunk.vision_refusal``."""
    if not is_vision_config(config):
        return
    model_type = config.get("model_type")
    if model_type not in compat_vision.VISION_MODEL_TYPES:  # Gemma 4 and others: text only, for now
        trunk.vision_refusal = (
            f"images are not supported for {model_type} checkpoints yet (Qwen3.5 / 3.6 only)"
        )
        return
    if not _tower_files(path):  # a text-only conversion that kept the config's vision_config
        trunk.vision_refusal = "the checkpoint ships no vision tower weights"
        return
    if importlib.util.find_spec("mlx_vlm") is None:
        trunk.vision_refusal = "images need mlx-vlm: pip install 'mtplx[vision]'"
        print(f"mtplx: note: this checkpoint takes images; {trunk.vision_refusal}", file=sys.stderr)
        return
    trunk.attach_vision(VisionEncoder.load(path, config))


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send (the server's limits; the CLI and the API use the same)."""

    max_images: int = 8  # images per request
    max_pixels: int = 4096 * 4096  # decoded pixels per image (a decompression bomb is refused unread)
    max_bytes: int = 20 * 1024 * 1024  # encoded bytes per image


@dataclass(eq=False)
class VisionImage:
    """One preprocessed image: its patches, its grids and the digest of its pixels."""

    pixels: np.ndarray  # float32 [patches, C * temporal * patch * patch] (the processor's)
    grid_thw: tuple[int, int, int]  # the tower's patch grid
    merge: int  # spatial merge size: the language model sees (t, h / merge, w / merge)
    digest: str  # sha256 of the pixels and grid

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid_thw
        return t, h // self.merge, w // self.merge

    @property
    def num_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w


class ImageToken(int):
    """A prompt token standing for patch ``patch`` of ``image``: the image pad id as an int; equal
    only to the same patch of an image with the same digest."""

    def __new__(cls, value: int, image: VisionImage, patch: int):
        token = super().__new__(cls, value)
        token.image, token.patch = image, patch
        return token

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ImageToken)
            and int(self) == int(other)
            and self.patch == other.patch
            and self.image.digest == other.image.digest
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((int(self), self.image.digest, self.patch))

    def __repr__(self) -> str:
        return f"ImageToken({int(self)}, {self.image.digest[:8]}, {self.patch})"

    def __reduce__(self):  # pickles (a disk tier, a worker) as the plain id: never equal to an image
        return int, (int(self),)


@dataclass
class PromptImages:
    """The images of one prompt, in order, with their spans (`ImageSpan`)."""

    spans: list[ImageSpan]
    images: list[VisionImage]

    @classmethod
    def from_tokens(cls, tokens: list[int]) -> PromptImages | None:
        """The images ``tokens`` hold (runs of `ImageToken`, patch 0 to n - 1); None if none."""
        spans, images, i = [], [], 0
        while i < len(tokens):
            token = tokens[i]
            if not isinstance(token, ImageToken):
                i += 1
                continue
            image = token.image
            run = tokens[i : i + image.num_tokens]
            if [getattr(t, "patch", None) for t in run] != list(range(image.num_tokens)) or any(
                t.image is not image for t in run
            ):
                raise MtplxError(f"prompt: the image tokens at {i} are not one whole image, in order")
            spans.append(ImageSpan(i, image.llm_grid))
            images.append(image)
            i += image.num_tokens
        return cls(spans, images) if spans else None


def _first_attention_cache(cache: list) -> KVCache | None:
    return next((c for c in cache_leaves(cache) if type(c) is KVCache), None)


def bind(cache: list, images: PromptImages | None) -> None:
    """Make ``images`` the prompt images of the single-row ``cache`` (None: a text prompt)."""
    holder = _first_attention_cache(cache)
    if holder is None:
        if images is not None:
            raise MtplxError("images: this model's caches have no attention layer to carry them")
        return
    setattr(holder, _BOUND, images)


def unbind(cache: list) -> None:
    """Drop the prompt images bound to ``cache`` (a stored copy: whoever reuses it binds its own)."""
    holder = _first_attention_cache(cache)
    if holder is not None and _BOUND in vars(holder):
        delattr(holder, _BOUND)


def bound_nbytes(cache: list) -> int:
    """Bytes of the preprocessed pixels of the images bound to ``cache`` (0: none)."""
    prompt = bound(cache)
    return sum(image.pixels.nbytes for image in prompt.images) if prompt is not None else 0


def bound(cache: list) -> PromptImages | None:
    """The prompt images bound to ``cache`` (None: none, or a batch's caches)."""
    holder = _first_attention_cache(cache)
    return getattr(holder, _BOUND, None) if holder is not None else None


def cache_offset(cache: list) -> int:
    holder = _first_attention_cache(cache)
    return int(holder.offset) if holder is not None else 0


# --------------------------------------------------------------------------- the encoder


def _processor_settings(path: Path, spec: compat_vision.VisionSpec) -> dict:
    """The image processor's settings from the checkpoint's own files (offline), as Hugging Face's
    ``Qwen2VLImageProcessor`` reads them (``size.shortest_edge`` / ``longest_edge`` = pixel bounds)."""
    raw: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text())
            raw.update(data.get("image_processor", data) if name == "processor_config.json" else data)
    size = raw.get("size") or {}
    raw.setdefault("min_pixels", size.get("shortest_edge", 56 * 56))
    raw.setdefault("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    raw.setdefault("patch_size", spec.patch_size)
    raw.setdefault("temporal_patch_size", spec.temporal_patch_size)
    raw.setdefault("merge_size", spec.spatial_merge_size)
    return {k: raw[k] for k in _PROCESSOR_FIELDS if k in raw}


def _tower_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files holding tower tensors (from their headers)."""
    from mtplx.model_files.headers import read_safetensors_header

    return [
        file
        for file in sorted(Path(path).glob("*.safetensors"))
        if any(n.startswith(compat_vision.TOWER_PREFIXES) for n in read_safetensors_header(file))
    ]


def _tower_weights(path: Path) -> dict[str, mx.array]:
    """The checkpoint's tensors under a tower prefix (either layout), loaded lazily by file."""
    found: dict[str, mx.array] = {}
    for file in _tower_files(path):
        found.update(
            {k: v for k, v in mx.load(str(file)).items() if k.startswith(compat_vision.TOWER_PREFIXES)}
        )
    return found


def _open_bytes(data: bytes, what: str, limits: ImageLimits) -> Any:
    """``data`` opened by PIL (header only), without PIL's own decompression-bomb warning (the
    pixel limit is checked next, in one line) and with no Python object in a refusal."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise MtplxError(f"{what}: over the limit of {limits.max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise MtplxError(f"{what}: not a readable image (not a format PIL can identify)") from None
    except (OSError, ValueError, SyntaxError) as e:  # a damaged header
        raise MtplxError(f"{what}: not a readable image ({_without_objects(first_line(e))})") from None


def _without_objects(message: str) -> str:
    """``message`` without Python object reprs (``<_io.BytesIO object at 0x...>``)."""
    import re

    return re.sub(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>", "", message).strip() or "damaged"


class VisionEncoder:
    """A checkpoint's image side: processor, tower, image token ids, and the features of recent
    images (least recently used first out, ``max_cached`` of them)."""

    def __init__(
        self,
        tower: nn.Module,
        spec: compat_vision.VisionSpec,
        processor: Any,
        limits: ImageLimits | None = None,
        max_cached: int = 16,
    ):
        self.tower, self.spec, self.processor = tower, spec, processor
        self.limits = limits or ImageLimits()
        self.max_cached = max_cached
        self._features: OrderedDict[str, mx.array] = OrderedDict()
        self.refusal: str | None = None  # why this engine takes no images now (kv_bits: `refuse_kv_bits`)
        self._placeholder_texts: tuple[str, ...] | None = None

    def placeholder_texts(self, tokenizer) -> tuple[str, ...]:
        """The text of the vision special tokens (image and video pads, vision start and end):
        in a message's own text they are text, never placeholders (`mtplx.engine.text.encode_chat`)."""
        if self._placeholder_texts is None:
            s = self.spec
            ids = (s.image_token_id, s.video_token_id, s.vision_start_token_id, s.vision_end_token_id)
            self._placeholder_texts = tuple(t for t in (tokenizer.decode([i]) for i in ids) if t)
        return self._placeholder_texts

    def refuse_kv_bits(self) -> None:
        """Images are refused on an engine whose KV cache is quantized: after an image the trunk
        turns every cached key by the image's M-RoPE lag (`image_positions.reframe`), which
        quantized keys cannot take without being rounded a second time."""
        self.refusal = (
            "not supported with kv_bits: after an image every cached key is turned by the image's "
            "M-RoPE position lag, which quantized keys cannot take without a second rounding; "
            "load without kv_bits for images"
        )

    @classmethod
    def load(cls, path: Path, config: dict) -> VisionEncoder:
        """The tower of the checkpoint at ``path`` with its weights (Hugging Face's
        ``model.visual.*`` or mlx-vlm's ``vision_tower.*``), processor from its preprocessor config."""
        compat_vision.check_once()
        tower, spec = compat_vision.build_vision(config)
        weights = compat_vision.sanitize_tower_weights(tower, _tower_weights(path))
        if not weights:
            raise MtplxError(f"{path}: config.json declares a vision tower but no tower weights were found")
        quant = config.get("quantization") or {}
        if any(k.endswith(".scales") for k in weights):
            nn.quantize(
                tower,
                group_size=quant.get("group_size", 64),
                bits=quant.get("bits", 4),
                class_predicate=lambda p, m: f"{p}.scales" in weights,
            )
        try:
            tower.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise MtplxError(
                f"{path}: vision tower weights do not match vision_config ({first_line(e)})"
            ) from None
        tower.eval()
        mx.eval(tower.parameters())
        processor = compat_vision.image_processor(_processor_settings(path, spec))
        return cls(tower, spec, processor)

    def describe(self) -> str:
        s = self.processor
        return (
            f"vision: images in the prompt (patch {s.patch_size}, merge {s.merge_size}, "
            f"{s.min_pixels}-{s.max_pixels} pixels after resize; M-RoPE positions)"
        )

    # ------------------------------------------------------------------ images in
    def open(self, source: Any, what: str = "image") -> np.ndarray:
        """RGB pixels [C, H, W] uint8 of ``source`` (a path, bytes, or a PIL image), checked
        against the limits before anything is decoded."""
        from PIL import Image

        limits = self.limits
        if isinstance(source, (str, Path)):
            file = Path(source)
            if not file.is_file():
                raise MtplxError(f"{what}: {file} is not a file")
            if file.stat().st_size > limits.max_bytes:
                raise MtplxError(f"{what}: {file} is over {limits.max_bytes} bytes")
            source = file.read_bytes()
        if isinstance(source, (bytes, bytearray)):
            if len(source) > limits.max_bytes:
                raise MtplxError(f"{what}: over {limits.max_bytes} bytes")
            source = _open_bytes(source, what, limits)
        if not isinstance(source, Image.Image):
            raise MtplxError(f"{what}: expected a path, bytes or a PIL image (got {type(source).__name__})")
        width, height = source.size
        if width * height > limits.max_pixels:
            raise MtplxError(f"{what}: {width}x{height} is over the limit of {limits.max_pixels} pixels")
        try:
            rgb = np.asarray(source.convert("RGB"))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
            raise MtplxError(f"{what}: cannot decode ({_without_objects(first_line(e))})") from None
        return np.ascontiguousarray(rgb.transpose(2, 0, 1))

    def prepare(self, source: Any, what: str = "image") -> VisionImage:
        """One image, opened, checked and preprocessed with the checkpoint's settings."""
        pixels = self.open(source, what)
        try:
            out = self.processor(pixels)
        except ValueError as e:  # an aspect ratio over 200, a too-small image
            raise MtplxError(f"{what}: {first_line(e)}") from None
        values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(n) for n in out["image_grid_thw"][0])
        digest = hashlib.sha256(values.tobytes() + repr(grid).encode()).hexdigest()
        return VisionImage(values, grid, self.spec.spatial_merge_size, digest)

    def prepare_all(self, sources: list, what: str = "image") -> list[VisionImage]:
        if self.refusal is not None:
            raise MtplxError(f"images: {self.refusal}")
        if len(sources) > self.limits.max_images:
            raise MtplxError(f"{what}s: {len(sources)} images, over the limit of {self.limits.max_images}")
        return [self.prepare(s, f"{what} {i + 1}") for i, s in enumerate(sources)]

    def expand(self, tokens: list[int], images: list[VisionImage]) -> list[int]:
        """``tokens`` with its i-th image pad token replaced by the i-th image's tokens."""
        pad = self.spec.image_token_id
        places = [i for i, t in enumerate(tokens) if int(t) == pad and not isinstance(t, ImageToken)]
        if len(places) != len(images):
            raise MtplxError(f"prompt: {len(places)} image placeholders for {len(images)} images")
        if self.spec.video_token_id in tokens:
            raise MtplxError("prompt: video is not supported (images only)")
        out: list[int] = []
        last = 0
        for place, image in zip(places, images):
            out.extend(tokens[last:place])
            out.extend(ImageToken(pad, image, p) for p in range(image.num_tokens))
            last = place + 1
        out.extend(tokens[last:])
        return out

    # ------------------------------------------------------------------ features
    def features(self, image: VisionImage) -> mx.array:
        """The tower's merged features [tokens, hidden] of ``image`` (cached by digest)."""
        cached = self._features.get(image.digest)
        if cached is not None:
            self._features.move_to_end(image.digest)
            return cached
        dtype = self.tower.patch_embed.proj.weight.dtype
        features = compat_vision.run_tower(
            self.tower, mx.array(image.pixels).astype(dtype), mx.array([list(image.grid_thw)])
        )
        mx.eval(features)
        self._features[image.digest] = features
        while len(self._features) > self.max_cached:
            self._features.popitem(last=False)
        return features

    def merge(self, embedded: mx.array, prompt: PromptImages, pieces) -> mx.array:
        """``embedded`` [1, L, H] with the rows ``pieces`` name replaced by image features."""
        parts, cursor = [], 0
        for k, row, p0, p1 in pieces:
            parts.append(embedded[0, cursor:row])
            parts.append(self.features(prompt.images[k])[p0:p1].astype(embedded.dtype))
            cursor = row + p1 - p0
        parts.append(embedded[0, cursor:])
        return mx.concatenate(parts, axis=0)[None]
