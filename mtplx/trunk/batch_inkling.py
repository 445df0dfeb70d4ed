"""Inkling's (``inkling``) own caches (mlx-vlm) as rows of a batch, each at its own length.

mlx-vlm 0.7.10 ``models/inkling/language.py``: every layer (the trunk's and its MTP block's)
holds ``CacheList(KVCache, ArraysCache(4))``: the attention's K/V and the windows of the last
``kernel_size - 1`` inputs of its four short convolutions (``conv_idx`` 0-3: k, v, attention
output, MLP output). In a batch (`mtplx.trunk.batch_cache.BatchCache`, which asks
`mtplx.trunk.vlm_text.VlmTextModel.batch_layer` for these classes) such a ``CacheList`` becomes

* the K/V: `mtplx.trunk.batch_glm5_next.VlmRaggedKV` (per-row lengths, rollback by setting
  them; rows leave as mlx-vlm's ``KVCache``);
* the windows: `ConvWindowRows`, mlx-vlm's ``ArraysCache`` holding B rows (no ``lengths`` /
  ``left_padding``, so the layer passes its convolutions no padding mask: every row's block is
  all its own positions, nothing is padded). In a verify block each convolution records
  ``concat([window, x])`` per position (`mtplx.trunk.vlm_inkling.recording_short_conv_call`)
  and mlx-vlm's ``commit_speculation`` takes one kept count per row, installing row r's window
  after its own n positions (`BatchCache.begin_block` starts the transaction on a CacheList's
  members too). Rows join by stacking their windows and leave as mlx-vlm's ``ArraysCache``.

The attention has no RoPE: positions enter through the relative-position band
(``banded_additive_mask``: query position minus key position, read from ``r @ rel_proj``,
masked past the sliding window) and the log-scaled queries of the global layers (``tau`` of the
query's position). mlx-vlm takes one query offset for every row (``S - L``, the longest row's),
so over ragged rows `ragged_attention` builds both from each row's own start (its K/V length
before the block): the band's distance for row r's query t is ``lengths[r] + t - j``, keys past
it (a shorter row's stale tail) are masked as any future key is. It skips mlx-vlm's slicing of
keys older than a sliding window (they are masked either way: an exact zero weight).
"""

from __future__ import annotations

import functools
from typing import Any

from mtplx.trunk.batch_cache import RaggedKVCache, class_key
from mtplx.trunk.batch_glm5_next import VlmRaggedKV

import mlx.core as mx
import mlx.nn as nn

__all__ = ["conv_window_rows", "inkling_layer", "ragged_attention", "ragged_band_mask"]

_LIST = "mlx_vlm.models.cache.CacheList"
_MEMBERS = ("mlx_vlm.models.cache.KVCache", "mlx_vlm.models.cache.ArraysCache")
_MASKED = -1e30  # mlx-vlm's masked-entry value


@functools.cache
def conv_window_rows() -> type:
    """mlx-vlm's ``ArraysCache`` with the batch's row operations (the class, made once: mlx-vlm
    is imported lazily)."""
    from mlx_vlm.models.cache import ArraysCache

    class ConvWindowRows(ArraysCache):
        """The four short-convolution windows [B, K-1, C] of a batch's rows (the module docstring)."""

        def add_rows(self, caches) -> None:
            for slot in range(len(self.cache)):
                rows = [c.cache[slot] for c in caches]
                if any(r is None for r in rows):
                    raise ValueError("an Inkling row joining the batch must hold its convolution windows")
                old = self.cache[slot]
                self.cache[slot] = mx.concatenate(rows if old is None else [old, *rows], axis=0)

        def remove_rows(self, keep) -> None:
            index = mx.array(list(keep), dtype=mx.int32)
            self.cache = [
                None if a is None or not keep else mx.contiguous(mx.take(a, index, axis=0))
                for a in self.cache
            ]

        def extract(self, row: int) -> Any:
            out = ArraysCache(len(self.cache))
            out.cache = [None if a is None else mx.contiguous(a[row : row + 1]) for a in self.cache]
            return out

    return ConvWindowRows


# --------------------------------------------------------------------------- the attention


def ragged_band_mask(rel: mx.array, proj: mx.array, starts: mx.array, S: int, sliding: int, extent: int):
    """mlx-vlm 0.7.10 ``banded_additive_mask`` (its portable path) with one query start per row:
    rel [B, L, H, d_rel], starts [B] -> additive mask [B, H, L, S]."""
    B, L, H, _ = rel.shape
    dtype = rel.dtype
    band = (rel @ proj).transpose(0, 2, 1, 3)  # [B, H, L, extent]
    query = starts[:, None].astype(mx.int32) + mx.arange(L, dtype=mx.int32)[None]  # [B, L]
    dist = query[..., None] - mx.arange(S, dtype=mx.int32)[None, None]  # [B, L, S]
    index = mx.broadcast_to(mx.clip(dist, 0, extent - 1)[:, None], (B, H, L, S))
    bias = mx.take_along_axis(band, index, axis=-1)
    bias = mx.where((dist >= extent)[:, None], mx.array(0.0, dtype), bias)
    masked = dist < 0
    if sliding > 0:
        masked = masked | (dist >= sliding)
    return mx.where(masked[:, None], mx.array(_MASKED, dtype), bias).astype(dtype)


def ragged_attention(attn: nn.Module, x: mx.array, cache: Any) -> mx.array:
    """mlx-vlm 0.7.10 ``InklingAttention.__call__`` over ragged rows (the module docstring)."""
    from mlx_vlm.models.inkling.language import scaled_dot_product_attention

    B, L, _ = x.shape
    kv, conv = cache[0], cache[1]
    starts = kv.offset  # [B]: each row's block starts at its length
    qkvr = attn.qkvr_proj(x)
    dq, dk, dv, _ = attn.qkvr_dims
    k = attn.k_sconv(qkvr[..., dq : dq + dk], cache=conv, mask=None)
    v = attn.v_sconv(qkvr[..., dq + dk : dq + dk + dv], cache=conv, mask=None)
    k = attn.k_norm(k.reshape(B, L, attn.n_kv, attn.head_dim)).transpose(0, 2, 1, 3)
    v = v.reshape(B, L, attn.n_kv, attn.head_dim).transpose(0, 2, 1, 3)
    k, v = kv.update_and_fetch(k, v)
    q = attn.q_norm(qkvr[..., :dq].reshape(B, L, attn.n_heads, attn.head_dim)).transpose(0, 2, 1, 3)
    r = qkvr[..., dq + dk + dv :].reshape(B, L, attn.n_heads, attn.d_rel)
    mask = ragged_band_mask(
        r, attn.rel_proj.astype(x.dtype), starts, k.shape[2], attn.sliding, attn.rel_extent
    )
    if attn.log_floor is not None:
        positions = (starts[:, None] + mx.arange(L)[None] + 1).astype(mx.float32)  # [B, L]
        tau = 1.0 + attn.log_alpha * mx.log(mx.maximum(positions / attn.log_floor, 1.0))
        tau = tau[:, None, :, None].astype(x.dtype)
        q = q * tau
        mask = mx.where(mask > -1e29, mask * tau, mask)
    out = scaled_dot_product_attention(q, k, v, cache=None, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


_ORIGINAL_ATTENTION: list = []  # mlx-vlm's InklingAttention.__call__, once replaced


def _install_ragged_attention() -> None:
    """``InklingAttention.__call__`` -> `ragged_attention` for a batch's ragged K/V, mlx-vlm's own
    for any other cache (idempotent)."""
    from mlx_vlm.models.inkling.language import InklingAttention

    if _ORIGINAL_ATTENTION:
        return
    original = InklingAttention.__call__
    _ORIGINAL_ATTENTION.append(original)

    def attention_call(self, x, cache=None, conv_mask=None):
        if cache is not None and isinstance(cache[0], RaggedKVCache):
            if conv_mask is not None:
                raise ValueError("a batch of Inkling rows takes no padding mask")
            return ragged_attention(self, x, cache)
        return original(self, x, cache=cache, conv_mask=conv_mask)

    InklingAttention.__call__ = attention_call


# --------------------------------------------------------------------------- the batch layer


def inkling_layer(template: Any) -> Any:
    """The batch layer for an Inkling layer's ``CacheList(KVCache, ArraysCache)`` (a trunk's or
    its head's), None for any other cache (``--kv-bits``' quantized K/V among them)."""
    from mtplx.trunk.compat import CacheList

    if class_key(template) != _LIST or tuple(class_key(m) for m in template.caches) != _MEMBERS:
        return None
    _install_ragged_attention()
    return CacheList(VlmRaggedKV(), conv_window_rows()(len(template.caches[1].cache)))
