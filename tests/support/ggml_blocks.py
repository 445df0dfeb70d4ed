"""ggml block formats, written independently of ``mtplx.checkpoints.gguf_quants`` for its tests:
a float64 reference dequantizer that follows ggml's ``dequantize_row_*`` element by element
(``ggml-quants.c``, block structs in ``ggml-common.h``), and simple encoders that pack float
weights into valid K-quant blocks (``gguf``'s package has none for them) so a test model can be
written K-quantized. The encoders only need to be valid and close; exactness is the decoder's."""

from __future__ import annotations

import numpy as np

QK_K = 256
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8}
TYPES |= {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
BLOCK = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34)}
BLOCK |= {10: (QK_K, 84), 11: (QK_K, 110), 12: (QK_K, 144), 13: (QK_K, 176), 14: (QK_K, 210), 30: (1, 2)}


def _f16(b: bytes) -> float:
    return float(np.frombuffer(b, dtype="<f2")[0])


# ---------------------------------------------------------------- reference (float64, per element)


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _block_ref(t: int, b: bytes) -> list[float]:
    if t == 2:
        d = _f16(b[0:2])
        qs = b[2:18]
        return [((qs[j] & 0x0F) - 8) * d for j in range(16)] + [((qs[j] >> 4) - 8) * d for j in range(16)]
    if t == 3:
        d, m = _f16(b[0:2]), _f16(b[2:4])
        qs = b[4:20]
        return [(qs[j] & 0x0F) * d + m for j in range(16)] + [(qs[j] >> 4) * d + m for j in range(16)]
    if t in (6, 7):
        d = _f16(b[0:2])
        m = _f16(b[2:4]) if t == 7 else 0.0
        at = 4 if t == 7 else 2
        qh = int.from_bytes(b[at : at + 4], "little")
        qs = b[at + 4 : at + 20]
        off = 0 if t == 7 else 16
        lo = [((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - off for j in range(16)]
        hi = [((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - off for j in range(16)]
        return [x * d + m for x in lo + hi]
    if t == 8:
        d = _f16(b[0:2])
        return [int(v) * d for v in np.frombuffer(b[2:34], dtype=np.int8)]
    if t == 10:
        return _q2_k_ref(b)
    if t == 11:
        return _q3_k_ref(b)
    if t in (12, 13):
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if t == 13 else None
        ql = b[48:176] if t == 13 else b[16:144]
        out = []
        for chunk in range(4):
            for half in range(2):
                sc, m = _scale_min_k4(2 * chunk + half, scales)
                for e in range(32):
                    q = (ql[32 * chunk + e] >> (4 * half)) & 0xF
                    if qh is not None and qh[e] & (1 << (2 * chunk + half)):
                        q += 16
                    out.append(d * sc * q - dmin * m)
        return out
    if t == 14:
        ql, qh = b[0:128], b[128:192]
        sc = np.frombuffer(b[192:208], dtype=np.int8).astype(int)
        d = _f16(b[208:210])
        out = [0.0] * QK_K
        for n in range(2):
            for e in range(32):
                i = e // 16
                q1 = ((ql[64 * n + e] & 0xF) | (((qh[32 * n + e] >> 0) & 3) << 4)) - 32
                q2 = ((ql[64 * n + e + 32] & 0xF) | (((qh[32 * n + e] >> 2) & 3) << 4)) - 32
                q3 = ((ql[64 * n + e] >> 4) | (((qh[32 * n + e] >> 4) & 3) << 4)) - 32
                q4 = ((ql[64 * n + e + 32] >> 4) | (((qh[32 * n + e] >> 6) & 3) << 4)) - 32
                base = 128 * n
                out[base + e] = d * sc[8 * n + i] * q1
                out[base + e + 32] = d * sc[8 * n + i + 2] * q2
                out[base + e + 64] = d * sc[8 * n + i + 4] * q3
                out[base + e + 96] = d * sc[8 * n + i + 6] * q4
        return out
    raise ValueError(t)


def _q2_k_ref(b: bytes) -> list[float]:
    scales, q, d, dmin = b[0:16], b[16:80], _f16(b[80:82]), _f16(b[82:84])
    out, i = [], 0
    for n in range(2):
        for shift in (0, 2, 4, 6):
            for run in range(2):
                sc = scales[i]
                i += 1
                dl, ml = d * (sc & 0xF), dmin * (sc >> 4)
                out += [dl * ((q[32 * n + 16 * run + e] >> shift) & 3) - ml for e in range(16)]
    return out


def _q3_k_ref(b: bytes) -> list[float]:
    """As ggml: the 12 scale bytes read as three little-endian uint32 and re-packed with its masks."""
    hm, q, d = b[0:32], b[32:96], _f16(b[108:110])
    aux = [int.from_bytes(b[96 + 4 * w : 100 + 4 * w], "little") for w in range(3)] + [0]
    kmask1, kmask2, tmp = 0x03030303, 0x0F0F0F0F, aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    scales = np.frombuffer(b"".join(a.to_bytes(4, "little") for a in aux), dtype=np.int8).astype(int)
    out, i, m = [], 0, 1
    for n in range(2):
        for shift in (0, 2, 4, 6):
            for run in range(2):
                dl = d * (scales[i] - 32)
                i += 1
                for e in range(16):
                    at = 16 * run + e
                    out.append(dl * (((q[32 * n + at] >> shift) & 3) - (0 if hm[at] & m else 4)))
            m <<= 1
    return out


def reference_dequantize(raw: bytes, t: int, shape: tuple[int, ...]) -> np.ndarray:
    """float64 values of ``raw`` (ggml type ``t``), element by element as ggml's C code."""
    if t == 0:
        flat = np.frombuffer(raw, dtype="<f4").astype(np.float64)
    elif t == 1:
        flat = np.frombuffer(raw, dtype="<f2").astype(np.float64)
    elif t == 30:
        flat = np.array([struct_bf16(raw[i : i + 2]) for i in range(0, len(raw), 2)])
    else:
        size = BLOCK[t][1]
        flat = np.array([v for i in range(0, len(raw), size) for v in _block_ref(t, raw[i : i + size])])
    return flat.reshape(shape)


def struct_bf16(two: bytes) -> float:
    """A bfloat16 (little-endian) as the float32 whose top 16 bits it is."""
    return float(np.frombuffer(b"\0\0" + bytes(two), dtype="<f4")[0])


# ---------------------------------------------------------------- encoders (valid, approximate)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def _k_encode_min(x: np.ndarray, levels: int) -> tuple[bytes, np.ndarray, np.ndarray, np.ndarray]:
    """(d, dmin as f16 bytes, 6-bit scales, mins, quants [8, 32]) of one Q4_K/Q5_K super-block."""
    sub = x.reshape(8, 32)
    lo = np.minimum(sub.min(axis=1), 0.0)
    hi = np.maximum(sub.max(axis=1), 0.0)
    scale, minimum = (hi - lo) / levels, -lo
    d = _f16_round(np.array(max(scale.max() / 63, 1e-8)))
    dmin = _f16_round(np.array(max(minimum.max() / 63, 1e-8)))
    sc = np.clip(np.round(scale / d), 1, 63).astype(int)
    m = np.clip(np.round(minimum / dmin), 0, 63).astype(int)
    q = np.clip(np.round((sub + dmin * m[:, None]) / (d * sc[:, None])), 0, levels).astype(int)
    head = np.array([d, dmin], dtype=np.float16).tobytes()
    return head, sc, m, q


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> bytes:
    out = bytearray(12)
    for j in range(4):
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6)
        out[j + 4] = m[j] | ((m[j + 4] >> 4) << 6)
        out[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4)
    return bytes(out)


def _nibbles(q: np.ndarray) -> bytes:
    """[8, 32] quants -> 128 bytes: sub-block 2c in the low, 2c+1 in the high nibbles of run c."""
    return b"".join(
        bytes(((q[2 * c] & 0xF) | ((q[2 * c + 1] & 0xF) << 4)).astype(np.uint8)) for c in range(4)
    )


def encode_q4_k(x: np.ndarray) -> bytes:
    head, sc, m, q = _k_encode_min(x, 15)
    return head + _pack_scales(sc, m) + _nibbles(q)


def encode_q5_k(x: np.ndarray) -> bytes:
    head, sc, m, q = _k_encode_min(x, 31)
    qh = np.zeros(32, dtype=np.uint8)
    for s in range(8):
        qh |= (((q[s] >> 4) & 1) << s).astype(np.uint8)
    return head + _pack_scales(sc, m) + bytes(qh) + _nibbles(q)


def encode_q6_k(x: np.ndarray) -> bytes:
    groups = x.reshape(16, 16)
    s = np.maximum(np.abs(groups).max(axis=1) / 31, 1e-8)
    d = _f16_round(np.array(s.max() / 127))
    sc = np.clip(np.round(s / d), 1, 127).astype(int)
    q = (np.clip(np.round(groups / (d * sc[:, None])), -32, 31).astype(int) + 32).reshape(2, 4, 32)
    ql, qh = bytearray(128), bytearray(64)
    for n in range(2):
        for e in range(32):
            ql[64 * n + e] = (q[n, 0, e] & 0xF) | ((q[n, 2, e] & 0xF) << 4)
            ql[64 * n + 32 + e] = (q[n, 1, e] & 0xF) | ((q[n, 3, e] & 0xF) << 4)
            qh[32 * n + e] = sum(((q[n, k, e] >> 4) & 3) << (2 * k) for k in range(4))
    return bytes(ql) + bytes(qh) + sc.astype(np.int8).tobytes() + np.array(d, dtype=np.float16).tobytes()


_ENCODERS = {12: encode_q4_k, 13: encode_q5_k, 14: encode_q6_k}


def encode(w: np.ndarray, t: int) -> np.ndarray:
    """``w`` (float, rows a multiple of the block) as ggml type ``t``'s bytes, uint8 [rows, row bytes]
    (what ``gguf.GGUFWriter.add_tensor`` takes with ``raw_dtype``)."""
    import gguf

    w = np.ascontiguousarray(w, dtype=np.float32)
    if t in _ENCODERS:
        rows = w.reshape(-1, QK_K)
        raw = b"".join(_ENCODERS[t](r.astype(np.float64)) for r in rows)
        return np.frombuffer(raw, dtype=np.uint8).reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType(t))
