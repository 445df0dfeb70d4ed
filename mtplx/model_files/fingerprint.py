"""A fingerprint of a trunk's weights, so a head is never attached to weights it was not trained on.

Hashing every byte of a multi-gigabyte model at load time is too slow, and any
two differently trained models differ almost everywhere, so each tensor
contributes its name, shape, dtype and a fixed, evenly spaced sample of its
bytes. Changing any tensor's shape, dtype or (substantially) its values
changes the fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

_SAMPLES_PER_TENSOR = 64
_SAMPLE_BYTES = 256


def _tensor_bytes_sample(array: mx.array) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    flat = np.asarray(array).reshape(-1).view(np.uint8)
    if flat.size <= _SAMPLES_PER_TENSOR * _SAMPLE_BYTES:
        return flat.tobytes()
    starts = np.linspace(0, flat.size - _SAMPLE_BYTES, _SAMPLES_PER_TENSOR).astype(np.int64)
    return b"".join(flat[s : s + _SAMPLE_BYTES].tobytes() for s in starts)


def _fingerprint(named: Iterable[tuple[str, mx.array]]) -> str:
    digest = hashlib.sha256()
    for name, array in named:
        digest.update(f"{name}|{tuple(array.shape)}|{array.dtype}|".encode())
        digest.update(_tensor_bytes_sample(array))
    return digest.hexdigest()[:16]


def weights_fingerprint(named_arrays: dict[str, mx.array]) -> str:
    """sha256 (hex, first 16 chars) over sorted (name, shape, dtype, sampled bytes)."""
    return _fingerprint((name, named_arrays[name]) for name in sorted(named_arrays))


def streamed_fingerprint(model_dir: Path, model) -> str:
    """``model_fingerprint`` of ``model`` loaded (lazily) from ``model_dir``, without materializing it.

    mlx-lm loads ``model*.safetensors`` through the model's ``sanitize`` into the
    parameters (a strict load: same names, shapes, dtypes, values), so hashing
    those sanitized file tensors gives the same fingerprint. ``mx.load`` is lazy
    per tensor and each one is dropped once hashed, so a rank of a sharded model
    never holds more than one tensor of the layers it does not keep.
    """
    weights: dict[str, mx.array] = {}
    for path in sorted(Path(model_dir).glob("model*.safetensors")):
        weights.update(mx.load(str(path)))
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    return _fingerprint((name, weights.pop(name)) for name in sorted(weights))


def model_fingerprint(model) -> str:
    """Fingerprint of an mlx ``nn.Module``'s parameters (keys as the module names them)."""
    return weights_fingerprint(dict(tree_flatten(model.parameters())))
