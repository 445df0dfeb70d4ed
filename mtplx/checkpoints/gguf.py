"""Read a GGUF file: metadata, tensor directory, and tensors as MLX arrays.

The header is parsed here in pure Python (and fully bounds-checked) before
``mx.load`` touches the file: MLX's native GGUF reader trusts the header, so a
truncated or corrupt file must be rejected first, with a one-line
``MtplxError`` naming the file and the problem instead of a crash or garbage.

Also provides ``write_gguf``, a minimal writer used to build tiny GGUF files
(tests, tools); it writes only what ``read_gguf`` reads.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtplx.checkpoints.gguf_quants import BLOCKS, dequantize
from mtplx.errors import MtplxError
from mtplx.io import atomic_write

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Real GGUFs hold thousands of tensors and metadata entries; far more is a damaged header, while
# counts that merely cannot fit in the file's bytes mean the file was cut short.
PLAUSIBLE_COUNT = 1 << 24
MIN_METADATA_BYTES = 13  # key length (8) + type (4) + the smallest value (1)
MIN_TENSOR_INFO_BYTES = 24  # name length (8) + dimension count (4) + type (4) + offset (8)

# ggml tensor type ids (ggml.h) MLX's own GGUF reader unpacks (the llama path reads through it).
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 1, 2, 3, 8
GGML_BF16, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 30, 12, 13, 14
MLX_NATIVE_TYPES = (GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0)
# type id -> (name, elements per block, bytes per block): every type `gguf_quants` dequantizes.
TENSOR_TYPES: dict[int, tuple[str, int, int]] = dict(BLOCKS)
# Names for a clear "unsupported type" message; not otherwise handled.
_OTHER_TYPE_NAMES = {
    9: "Q8_1",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}

SUPPORTED_ARCHITECTURES = ("llama", "qwen35", "qwen35moe")

# GGUF metadata value type ids -> struct format (scalars only).
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9
# numpy dtypes for fast reading of numeric arrays (token types, scores).
_NUMPY_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<u1",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), i.e. GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return tensor_type_name(self.ggml_type)


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def tensor_type_name(ggml_type: int) -> str:
    if ggml_type in TENSOR_TYPES:
        return TENSOR_TYPES[ggml_type][0]
    return _OTHER_TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


class _Reader:
    """Cursor over the file bytes; every read is bounds-checked."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, problem: str) -> MtplxError:
        return MtplxError(f"{self.path}: {problem}")

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise self.fail(
                f"truncated or corrupt GGUF ({what} runs past the end of the file at byte {self.pos})"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        raw = self.take(n, what)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            # Some vocabularies hold raw byte tokens that are not valid UTF-8; keep them lossless-ish.
            return bytes(raw).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            item_type = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if item_type in _NUMPY_DTYPES:
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                raw = self.take(count * dtype.itemsize, what)
                arr = np.frombuffer(raw, dtype=dtype)
                return arr.astype(bool).tolist() if item_type == 7 else arr.tolist()
            if count > len(self.buf) - self.pos:  # each item takes at least one byte
                raise self.fail(f"truncated or corrupt GGUF ({what}: array of {count} items cannot fit)")
            return [self.value(item_type, what) for _ in range(count)]
        raise self.fail(f"corrupt GGUF ({what} has unknown value type {vtype})")


def _tensor_nbytes(path: Path, name: str, shape: tuple[int, ...], ggml_type: int) -> int:
    if ggml_type not in TENSOR_TYPES:
        supported = ", ".join(t[0] for t in TENSOR_TYPES.values())
        raise MtplxError(
            f"{path}: tensor {name} has unsupported type {tensor_type_name(ggml_type)} (supported: {supported})"
        )
    _, block, block_bytes = TENSOR_TYPES[ggml_type]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % block:
        raise MtplxError(
            f"{path}: tensor {name} row length {shape[-1]} is not a multiple of its block size {block}"
        )
    return count // block * block_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate a GGUF file's header, metadata and tensor directory (no tensor data read)."""
    path = Path(path)
    if not path.is_file():
        raise MtplxError(f"{path}: GGUF file not found")
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise MtplxError(f"{path}: truncated GGUF (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    return _parse(_Reader(view, path), size)
                finally:
                    view.release()
    except OSError as e:
        raise MtplxError(f"{path}: cannot read GGUF ({e.strerror or e})") from None


def _parse(r: _Reader, size: int) -> GGUFFile:
    if bytes(r.take(4, "magic")) != GGUF_MAGIC:
        raise r.fail("not a GGUF file (bad magic bytes)")
    version = r.scalar("<I", "version")
    if version not in SUPPORTED_VERSIONS:
        raise r.fail(f"unsupported GGUF version {version} (supported: 2, 3)")
    n_tensors = r.scalar("<Q", "tensor count")
    n_kv = r.scalar("<Q", "metadata count")
    if n_tensors > PLAUSIBLE_COUNT or n_kv > PLAUSIBLE_COUNT:
        raise r.fail(f"corrupt GGUF (implausible counts: {n_tensors} tensors, {n_kv} metadata entries)")
    if r.pos + MIN_TENSOR_INFO_BYTES * n_tensors + MIN_METADATA_BYTES * n_kv > size:
        raise r.fail(
            f"truncated GGUF ({n_tensors} tensors and {n_kv} metadata entries cannot fit in its {size} bytes)"
        )
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("metadata key")
        metadata[key] = r.value(r.scalar("<I", f"metadata {key}"), f"metadata {key}")
    infos = []
    for _ in range(n_tensors):
        name = r.string("tensor name")
        n_dims = r.scalar("<I", f"tensor {name}")
        if n_dims > 4:
            raise r.fail(f"corrupt GGUF (tensor {name} has {n_dims} dimensions)")
        dims = [r.scalar("<Q", f"tensor {name}") for _ in range(n_dims)]
        ggml_type = r.scalar("<I", f"tensor {name}")
        offset = r.scalar("<Q", f"tensor {name}")
        infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise r.fail(f"corrupt GGUF (alignment {alignment} is not a power of two)")
    data_start = (r.pos + alignment - 1) // alignment * alignment
    gguf = GGUFFile(path=r.path, version=version, metadata=metadata)
    for name, shape, ggml_type, offset in infos:
        nbytes = _tensor_nbytes(r.path, name, shape, ggml_type)
        start = data_start + offset
        if start + nbytes > size:
            raise r.fail(
                f"truncated GGUF (tensor {name} needs bytes up to {start + nbytes}, file has {size})"
            )
        gguf.tensors[name] = TensorInfo(name, shape, ggml_type, start, nbytes)
    return gguf


def check_architecture(gguf: GGUFFile) -> None:
    """A GGUF mtplx can convert: one whole file (not one part of llama.cpp's ``gguf-split``
    output, whose tensors sit in its sibling files) of a supported architecture."""
    parts = int(gguf.metadata.get("split.count", 1) or 1)
    if parts > 1:
        raise MtplxError(
            f"{gguf.path}: one part of a {parts}-file split GGUF; merge it first "
            "(llama.cpp: llama-gguf-split --merge FIRST-PART OUT.gguf)"
        )
    arch = gguf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise MtplxError(
            f"{gguf.path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )


def load_tensors(gguf: GGUFFile) -> dict[str, Any]:
    """Tensors as MLX arrays, via MLX's native reader (only after ``read_gguf`` validated the file).

    Q4_0/Q4_1/Q8_0 tensors come back packed as MLX affine quantization with group
    size 32: ``name.weight`` (uint32), ``name.scales`` and ``name.biases``.
    """
    import mlx.core as mx

    for info in gguf.tensors.values():
        if info.ggml_type not in MLX_NATIVE_TYPES:
            native = ", ".join(TENSOR_TYPES[t][0] for t in MLX_NATIVE_TYPES)
            raise MtplxError(
                f"{gguf.path}: tensor {info.name} has unsupported type {info.type_name} "
                f"for a {gguf.architecture} GGUF (supported: {native})"
            )
    try:
        arrays = mx.load(str(gguf.path))
    except Exception as e:  # MLX raises bare RuntimeError/ValueError; make it one line with the file name
        raise MtplxError(
            f"{gguf.path}: cannot read GGUF tensors ({str(e).splitlines()[0] if str(e) else e})"
        ) from None
    return arrays


def read_tensor(gguf: GGUFFile, info: TensorInfo) -> np.ndarray:
    """One tensor as float32 (numpy order), dequantized from the file's bytes (`gguf_quants`);
    the header was validated by ``read_gguf``, so the bytes are in the file."""
    count = int(np.prod(info.shape, dtype=np.int64)) if info.shape else 1
    try:
        raw = np.fromfile(gguf.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    except OSError as e:
        raise MtplxError(f"{gguf.path}: cannot read tensor {info.name} ({e.strerror or e})") from None
    if raw.size != info.nbytes:
        raise MtplxError(f"{gguf.path}: truncated GGUF (tensor {info.name} is cut short)")
    return dequantize(raw, info.ggml_type, info.shape or (count,))


# ---------------------------------------------------------------- writing (tiny files)


def _pack_value(value: Any) -> tuple[int, bytes]:
    """(type id, payload) for a metadata value; ints are written as int32/uint32/uint64 as they fit."""
    if isinstance(value, bool):
        return 7, struct.pack("<?", value)
    if isinstance(value, int):
        if 0 <= value < 2**32:
            return 4, struct.pack("<I", value)
        if -(2**31) <= value < 0:
            return 5, struct.pack("<i", value)
        return 10, struct.pack("<Q", value)
    if isinstance(value, float):
        return 6, struct.pack("<f", value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _STRING, struct.pack("<Q", len(raw)) + raw
    if isinstance(value, (list, tuple)):
        first = value[0] if value else 0
        # Integer arrays (token types) are int32 as llama.cpp writes them.
        packed = (
            [struct.pack("<i", v) for v in value]
            if type(first) is int
            else [_pack_value(v)[1] for v in value]
        )
        item_type = 5 if type(first) is int else _pack_value(first)[0]
        return _ARRAY, struct.pack("<IQ", item_type, len(value)) + b"".join(packed)
    raise TypeError(f"cannot write metadata value of type {type(value).__name__}")


def write_gguf(
    path: str | Path, metadata: dict[str, Any], tensors: dict[str, tuple[int, tuple[int, ...], bytes]]
) -> Path:
    """Write a GGUF v3 file. ``tensors`` maps name -> (ggml type, numpy-order shape, raw block bytes)."""
    path = Path(path)
    out = bytearray(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        raw_key = key.encode("utf-8")
        vtype, payload = _pack_value(value)
        out += struct.pack("<Q", len(raw_key)) + raw_key + struct.pack("<I", vtype) + payload
    offset, blobs = 0, []
    for name, (ggml_type, shape, data) in tensors.items():
        raw_name = name.encode("utf-8")
        out += struct.pack("<Q", len(raw_name)) + raw_name + struct.pack("<I", len(shape))
        out += b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", ggml_type, offset)
        padded = data + b"\0" * (-len(data) % DEFAULT_ALIGNMENT)
        blobs.append(padded)
        offset += len(padded)
    out += b"\0" * (-len(out) % DEFAULT_ALIGNMENT)
    with atomic_write(path, "wb") as handle:
        handle.write(bytes(out) + b"".join(blobs))
    return path
