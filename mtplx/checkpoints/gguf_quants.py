"""Dequantize GGUF tensor data (ggml block formats) to float32 with NumPy, exactly as ggml does.

Block layouts from ggml's ``ggml-common.h`` (``block_q4_0`` ... ``block_q6_K``) and the reference
dequantizers in ``ggml-quants.c`` (``dequantize_row_*``), read for this module. Every product
ggml forms (an f16 scale times a small integer, times a quant) is exact in float32, so computing
each in float32 in ggml's order gives ggml's value bit for bit; where ggml subtracts a min
(``*_1``, ``*_K`` with ``dmin``) the one rounding is that subtraction's, here too.

Invariants: ``dequantize(raw, type, shape)`` returns a C-contiguous float32 array of ``shape``
(numpy order, the GGUF dims reversed) for every type in ``BLOCKS``; ``raw`` holds exactly
``nbytes(type, shape)`` bytes; rows are whole blocks (the reader checks the row length).
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # elements of a K-quant super-block

# ggml type id -> (name, elements per block, bytes per block)
BLOCKS: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),  # f16 d, 16 bytes of nibbles
    3: ("Q4_1", 32, 20),  # f16 d, f16 m, 16 bytes of nibbles
    6: ("Q5_0", 32, 22),  # f16 d, 4 bytes of high bits, 16 bytes of nibbles
    7: ("Q5_1", 32, 24),  # f16 d, f16 m, 4 bytes of high bits, 16 bytes of nibbles
    8: ("Q8_0", 32, 34),  # f16 d, 32 int8
    10: ("Q2_K", QK_K, 84),  # 16 bytes of 4-bit scale|min, 64 bytes of 2-bit quants, f16 d, f16 dmin
    11: (
        "Q3_K",
        QK_K,
        110,
    ),  # 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, f16 d
    12: ("Q4_K", QK_K, 144),  # f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    13: ("Q5_K", QK_K, 176),  # as Q4_K + 32 bytes of high bits before the nibbles
    14: ("Q6_K", QK_K, 210),  # 128 bytes low nibbles, 64 bytes high 2-bits, 16 int8 scales, f16 d
    30: ("BF16", 1, 2),
}


def nbytes(ggml_type: int, count: int) -> int:
    _, block, block_bytes = BLOCKS[ggml_type]
    return count // block * block_bytes


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian f16 fields (``raw``: uint8 [..., 2]) as float32 (exact)."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32)


def _blocks(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    _, _, block_bytes = BLOCKS[ggml_type]
    return raw.reshape(-1, block_bytes)


def _q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    qs = b[:, 2:18]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)
    return q.astype(np.float32) * d


def _q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    qs = b[:, 4:20]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return q * d + m


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block (``qh``: uint8 [n, 4], little-endian uint32) as 0/16."""
    bits = np.ascontiguousarray(qh).view("<u4")[:, 0:1] >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


def _q5_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    qs = b[:, 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    q = (low | _high_bits_32(b[:, 2:6])).astype(np.int16) - 16
    return q.astype(np.float32) * d


def _q5_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    qs = b[:, 8:24]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    q = (low | _high_bits_32(b[:, 4:8])).astype(np.float32)
    return q * d + m


def _q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, 0:2])[:, None]
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32) * d


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in a Q4_K/Q5_K block's 12 bytes (ggml's
    ``get_scale_min_k4``): sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7, sub-blocks 4-7
    in the nibbles of bytes 8-11 with their top two bits in the high bits of bytes 0-3 / 4-7."""
    s = s.astype(np.uint8)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    scales = np.concatenate([lo_sc, hi_sc], axis=1).astype(np.float32)
    mins = np.concatenate([lo_m, hi_m], axis=1).astype(np.float32)
    return scales, mins


def _k_apply(q: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``d*sc*q - dmin*m`` per 32-element sub-block of a Q4_K/Q5_K super-block (``q``: [n, 8, 32])."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    scales, mins = _k_scales_mins(b[:, 4:16])
    d1 = (d[:, None] * scales)[:, :, None]  # exact: f16 times a 6-bit integer
    m1 = (dmin[:, None] * mins)[:, :, None]
    return (d1 * q.astype(np.float32) - m1).reshape(-1, QK_K)


def _nibble_pairs(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> [n, 8, 32] quants in output order: each 32-byte run gives its low nibbles
    (one sub-block) then its high nibbles (the next)."""
    runs = qs.reshape(-1, 4, 32)
    return np.stack([runs & 0x0F, runs >> 4], axis=2).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    return _k_apply(_nibble_pairs(b[:, 16:144]), b)


def _q5_k(b: np.ndarray) -> np.ndarray:
    qh = b[:, 16:48]  # bit j of byte l: the fifth bit of element l of sub-block j
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4
    return _k_apply(_nibble_pairs(b[:, 48:176]) | high, b)


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """64 bytes -> [n, 2, 4, 2, 16] 2-bit quants in output order (half, shift pair j, run h, element):
    each half's 32 bytes are two runs of 16, read at shifts 0, 2, 4, 6 in turn."""
    runs = qs.reshape(-1, 2, 1, 2, 16)
    return (runs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None, None]) & 3


def _q2_k(b: np.ndarray) -> np.ndarray:
    """``d * (scale & 15) * q - dmin * (scale >> 4)`` per 16-element group (16 groups)."""
    scales = b[:, 0:16].reshape(-1, 2, 4, 2, 1)  # group 8*half + 2*j + h
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = d[:, None, None, None, None] * (scales & 0x0F).astype(np.float32)  # exact
    ml = dmin[:, None, None, None, None] * (scales >> 4).astype(np.float32)
    return (dl * _two_bit_runs(b[:, 16:80]).astype(np.float32) - ml).reshape(-1, QK_K)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """The 16 six-bit scales of a Q3_K block (12 bytes), minus 32: scale k's low nibble is byte
    k % 8's low (k < 8) or high (k >= 8) nibble, its top two bits bits 2*(k // 4) of byte 8 + k % 4."""
    k = np.arange(16)
    low = (s[:, k % 8] >> (4 * (k // 8)).astype(np.uint8)) & 0x0F
    high = (s[:, 8 + k % 4] >> (2 * (k // 4)).astype(np.uint8)) & 3
    return (low | (high << 4)).astype(np.int16) - 32


def _q3_k(b: np.ndarray) -> np.ndarray:
    """``d * scale * (q - 4 * (high bit clear))`` per 16-element group; the high bits of element
    (h, l) of shift pair j in half n are bit 4*n + j of hmask byte 16*h + l."""
    hmask = b[:, 0:32].reshape(-1, 1, 1, 2, 16)
    bit = (4 * np.arange(2)[:, None] + np.arange(4)[None, :]).astype(np.uint8)  # [half, j]
    high = (hmask >> bit[None, :, :, None, None]) & 1
    q = _two_bit_runs(b[:, 32:96]).astype(np.int16) - 4 * (1 - high.astype(np.int16))
    d = _f16(b[:, 108:110])
    dl = d[:, None, None, None, None] * _q3_k_scales(b[:, 96:108]).reshape(-1, 2, 4, 2, 1).astype(np.float32)
    return (dl * q.astype(np.float32)).reshape(-1, QK_K)


def _q6_k(b: np.ndarray) -> np.ndarray:
    ql = b[:, 0:128].reshape(-1, 2, 64)  # per 128-element half
    qh = b[:, 128:192].reshape(-1, 2, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32).reshape(-1, 2, 8)
    d = _f16(b[:, 208:210])
    # Within a half, output quarter k (32 elements) takes ql's low (k even) or high (k odd)
    # nibbles of bytes 0-31 (k < 2) or 32-63, and qh's bits 2k, 2k+1.
    low = np.stack(
        [ql[..., 0:32] & 0x0F, ql[..., 32:64] & 0x0F, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], axis=2
    )
    high = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=2)
    q = (low | (high << 4)).astype(np.int16) - 32  # [n, 2, 4, 32]
    # Scale index within a half: 16-element groups, quarter k uses scales 2k (first 16) and 2k+1.
    sc = scales.reshape(-1, 2, 4, 2, 1)
    d_sc = d[:, None, None, None, None] * sc  # exact: f16 times an int8
    return (d_sc * q.reshape(-1, 2, 4, 2, 16).astype(np.float32)).reshape(-1, QK_K)


_DEQUANT = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    10: _q2_k,
    11: _q3_k,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
}


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of one tensor's raw bytes (uint8), shaped ``shape`` (numpy order)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if ggml_type == 0:
        out = np.ascontiguousarray(raw).view("<f4").astype(np.float32)
    elif ggml_type == 1:
        out = np.ascontiguousarray(raw).view("<f2").astype(np.float32)
    elif ggml_type == 30:  # bfloat16: the top half of a float32
        out = (np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        out = _DEQUANT[ggml_type](_blocks(raw, ggml_type))
    return np.ascontiguousarray(out.reshape(shape), dtype=np.float32)
