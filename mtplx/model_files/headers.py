"""Facts about checkpoint files without loading them: safetensors headers and the quantization block.

Used by loading (validation before MLX maps a file), the MTP-head loaders and
`mtplx inspect`. Reads headers only; imports the standard library only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError

__all__ = ["quantization_config", "read_safetensors_header", "read_safetensors_metadata"]

_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def _read_header(path: Path) -> tuple[dict[str, dict], dict[str, str]]:
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise MtplxError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8 or header_len > _MAX_HEADER_BYTES:
                raise MtplxError(
                    f"{path}: corrupt or truncated safetensors (header length {header_len} exceeds file size {size})"
                )
            raw_header = f.read(header_len)
    except OSError as e:
        raise MtplxError(f"{path}: cannot read safetensors ({e.strerror or e})") from None
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MtplxError(f"{path}: corrupt safetensors (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise MtplxError(f"{path}: corrupt safetensors (header is not a JSON object)")
    metadata = header.pop("__metadata__", None)
    try:
        ends = [int(entry["data_offsets"][1]) for entry in header.values()]
    except (TypeError, KeyError, IndexError, ValueError):
        raise MtplxError(f"{path}: corrupt safetensors (tensor entry without data_offsets)") from None
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise MtplxError(f"{path}: truncated safetensors (tensor data needs {needed} bytes, file has {size})")
    return header, (metadata if isinstance(metadata, dict) else {})


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/data_offsets), no data read.

    One-line MtplxError naming the file when it is truncated (header or tensor data)
    or its header is not a JSON object of tensor entries.
    """
    return _read_header(path)[0]


def read_safetensors_metadata(path: Path) -> dict[str, str]:
    """The ``__metadata__`` block of a safetensors file's header ({} when it has none): who wrote
    it (``{"format": "pt"}`` from torch / Hugging Face, ``"mlx"`` from MLX) and any marks."""
    return _read_header(path)[1]


def quantization_config(config: dict[str, Any]) -> dict | None:
    """The mlx-format ``quantization`` block of a model config (top level or text_config), or None.

    A Hugging Face ``quantization_config`` counts when it has mlx's fields (bits, group_size).
    """
    text_config = config.get("text_config", {})
    q = config.get("quantization") or text_config.get("quantization")
    if q is None:
        qc = config.get("quantization_config") or text_config.get("quantization_config")
        if qc and "bits" in qc and "group_size" in qc:
            q = qc
    return q
