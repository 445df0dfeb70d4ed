"""The integrity digest of a disk prompt-cache file (`mtplx.trunk.prompt_cache_format`).

A file is a safetensors file (an 8-byte little-endian header length, a JSON header, the tensor
data). Its metadata holds ``mtplx_digest``: the sha256 of the whole file as it was written, with
the digest's own value replaced by ``PLACEHOLDER`` (the same length, so nothing moves). It covers
every byte but its own value: the tensors, their names, dtypes, shapes and offsets, the cache
classes and every metadata field (the key, the tokens, the size). The writer saves the file with
the placeholder, then `stamp` hashes it and writes the digest in place; `verify` recomputes it
before a file is loaded. Truncated, flipped, reordered or edited files fail, and are never served.

Only the writer thread and the lookup that loads an entry hash (never the decode thread's queueing of
a write). Imports the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

__all__ = ["DIGEST_FIELD", "PLACEHOLDER", "stamp", "verify"]

DIGEST_FIELD = "mtplx_digest"  # the caller's metadata key (stored as "0.mtplx_digest", mlx-lm's layout)
PLACEHOLDER = "~" * 64  # not hex: never mistaken for a digest, never found in a header by chance
_CHUNK = 8 << 20
_MAX_HEADER = 100 << 20  # safetensors' own limit on the header's length
_HEX64 = re.compile(r"[0-9a-f]{64}")


class DamagedFile(ValueError):
    """A prompt-cache file whose bytes do not match its digest (or that has none)."""


def _header(handle) -> tuple[bytes, bytes]:
    """(the 8 length bytes, the JSON header) of an open safetensors file."""
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise DamagedFile("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > _MAX_HEADER:
        raise DamagedFile(f"header length {length} is implausible")
    header = handle.read(length)
    if len(header) < length:
        raise DamagedFile("cut short inside its header")
    return prefix, header


def _digest(prefix: bytes, header_with_placeholder: bytes, handle) -> str:
    """sha256 of the 8 length bytes, the header (digest value replaced) and the rest of ``handle``."""
    digest = hashlib.sha256(prefix)
    digest.update(header_with_placeholder)
    while chunk := handle.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def _only_occurrence(header: bytes, value: str) -> int:
    quoted = f'"{value}"'.encode()
    at = header.find(quoted)
    if at < 0 or header.find(quoted, at + 1) >= 0:
        raise DamagedFile("its digest field is missing or ambiguous")
    return at + 1


def stamp(path: str | Path) -> str:
    """Replace the placeholder the file was saved with by the digest of the file (in place); returns it."""
    with open(path, "r+b") as handle:
        prefix, header = _header(handle)
        at = _only_occurrence(header, PLACEHOLDER)
        digest = _digest(prefix, header, handle)
        handle.seek(len(prefix) + at)
        handle.write(digest.encode())
    return digest


def verify(path: str | Path) -> None:
    """Raise `DamagedFile` (or OSError) unless the file's bytes match its digest."""
    with open(path, "rb") as handle:
        prefix, header = _header(handle)
        try:
            metadata = json.loads(header).get("__metadata__") or {}
        except (ValueError, AttributeError):
            raise DamagedFile("its header is not JSON") from None
        recorded = metadata.get(f"0.{DIGEST_FIELD}")
        if not isinstance(recorded, str) or not _HEX64.fullmatch(recorded):
            raise DamagedFile("it has no digest")
        at = _only_occurrence(header, recorded)
        with_placeholder = header[:at] + PLACEHOLDER.encode() + header[at + len(recorded) :]
        if _digest(prefix, with_placeholder, handle) != recorded:
            raise DamagedFile("its bytes do not match its digest")
