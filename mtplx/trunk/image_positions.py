"""M-RoPE positions of a prompt with images, chunk by chunk, in a frame where decoding is plain RoPE.

Qwen3.5 positions (mlx-vlm ``qwen3_5/language.py`` ``get_rope_index``; Hugging Face
``Qwen3VLModel.get_rope_index``): a text token has the same position on all three axes
(temporal, height, width), one more than the token before it; an image whose merged grid is
(t, h, w) starts at origin o = (the position the next text token would have had), its patch
(ti, hi, wi) at o + (ti, hi, wi), and the text after it resumes at o + max(t, h, w). So an image
of n = t*h*w tokens moves positions ``max(t, h, w) - n`` behind the sequence index (-182 for a
448x448 image: 196 tokens that advance positions by 14), and every later token carries that lag.

mlx-lm rotates by the cache offset (the sequence index). Rather than carrying each row's lag into
the decode cycle, the trunk keeps every cache in a frame where the lag is zero: after a forward
that completes images (total lag ``shift`` < 0), every key already in the row's attention caches
is turned by ``-shift`` positions (`reframe`). Attention reads only position differences, per
frequency and axis, so a uniform turn of all keys changes no score (in exact arithmetic; float
rounding differs at ~1e-7). Invariant between forwards: the next text token's position is the
cache offset, so the decode cycle, batch caches, rollback and the prompt cache see a plain
text model; an image cut by a chunk boundary keeps its origin at the index of its first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mtplx.errors import MtplxError
from mtplx.trunk.compat import ArraysCache, KVCache, cache_leaves, kv_state, set_kv_state

import mlx.core as mx
import numpy as np

__all__ = ["ChunkLayout", "ImageSpan", "chunk_layout", "interleaved_selector", "reframe", "rope_index"]


@dataclass(frozen=True)
class ImageSpan:
    """One image in a prompt: its first token's index and its merged grid (t, h, w)."""

    start: int
    grid: tuple[int, int, int]

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def lag(self) -> int:
        """How far positions fall behind the sequence index across this image (<= 0)."""
        return max(self.grid) - self.length


@dataclass
class ChunkLayout:
    """Positions of one forward's tokens and where image features replace token embeddings."""

    positions: np.ndarray  # int64 [3, L]
    shift: int  # total lag of the images this forward completes (<= 0)
    # (span index, first chunk row, first patch, end patch): rows taking image features.
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)


def chunk_layout(spans: Sequence[ImageSpan], offset: int, length: int) -> ChunkLayout | None:
    """The layout of prompt tokens [offset, offset + length) in the module's frame (the cache holds
    the first ``offset`` tokens); None when no image touches them (plain RoPE is then exact)."""
    end = offset + length
    touching = [(k, s) for k, s in enumerate(spans) if s.start < end and s.end > offset]
    if not touching:
        return None
    positions = np.empty((3, length), dtype=np.int64)
    shift, cursor, pieces = 0, offset, []
    for k, span in touching:
        first, last = max(span.start, offset), min(span.end, end)
        positions[:, cursor - offset : first - offset] = np.arange(cursor, first) + shift
        p0, p1 = first - span.start, last - span.start
        origin = span.start + shift
        coords = np.stack(np.unravel_index(np.arange(p0, p1), span.grid))
        positions[:, first - offset : last - offset] = origin + coords
        pieces.append((k, first - offset, p0, p1))
        if p1 == span.length:
            shift += span.lag
        cursor = last
    positions[:, cursor - offset :] = np.arange(cursor, end) + shift
    return ChunkLayout(positions, shift, pieces)


def rope_index(length: int, spans: Sequence[ImageSpan]) -> tuple[np.ndarray, int]:
    """Positions [3, length] of a whole prompt (in the model's own frame: the prompt forwarded at
    once from an empty cache) and the lag after it, as mlx-vlm's ``get_rope_index`` gives them."""
    layout = chunk_layout(spans, 0, length)
    if layout is None:
        return np.broadcast_to(np.arange(length), (3, length)).copy(), 0
    return layout.positions, layout.shift


def interleaved_selector(mrope_section: Sequence[int], num_frequencies: int) -> tuple[int, ...]:
    """Which axis each rotary frequency reads in Qwen3.5's interleaved M-RoPE: frequency j reads
    height where j % 3 == 1 and j < 3 * section[1], width where j % 3 == 2 and j < 3 * section[2],
    else temporal (HF ``apply_interleaved_mrope``)."""
    selector = [0] * num_frequencies
    for axis in (1, 2):
        for j in range(axis, min(3 * mrope_section[axis], num_frequencies), 3):
            selector[j] = axis
    return tuple(selector)


def reframe(cache: list, turn: int, rope) -> None:
    """Turn every key of the attention caches in ``cache`` (single-row mlx-lm ``KVCache``s) by
    ``turn`` positions with the layers' own RoPE (``rope``: dims, base, scale). Lazy."""
    for c in cache_leaves(cache):
        if type(c) is ArraysCache:  # recurrent state: no positions
            continue
        if type(c) is not KVCache:
            raise MtplxError(f"images: {type(c).__name__} caches are not supported (plain KV caches only)")
        state = kv_state(c)
        if state.keys is None:
            continue
        keys = state.keys
        flat = keys.reshape(-1, 1, keys.shape[-1])  # every key its own sequence of one: one angle for all
        turned = mx.fast.rope(
            flat, rope.dims, traditional=False, base=rope.base, scale=rope.scale, offset=turn
        ).reshape(keys.shape)
        set_kv_state(c, state._replace(keys=turned))
