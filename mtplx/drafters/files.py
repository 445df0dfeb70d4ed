"""Reading a drafter directory: its ``config.json`` and safetensors, and loading the tensors into
a module with every misfit (missing, unexpected, wrong shape) a one-line error naming the tensor."""

from __future__ import annotations

import json
from pathlib import Path

from mtplx.errors import MtplxError
from mtplx.trunk.compat import materialize

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def read_config(path: Path, what: str) -> dict:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise MtplxError(f"{what} {path}: unreadable config.json ({err})") from None
    if config.get("quantization"):
        raise MtplxError(f"{what} {path}: quantization is not supported yet")
    return config


def published_weights(path: Path, what: str) -> dict[str, mx.array]:
    """Every tensor of the directory's safetensors files, a leading ``model.`` dropped."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise MtplxError(f"{what} {path}: no .safetensors file")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return {k.removeprefix("model."): v for k, v in weights.items()}


def load_checked(module: nn.Module, weights: dict[str, mx.array], path: Path, what: str) -> None:
    """Load ``weights`` into ``module`` when the names and shapes are exactly its own."""
    expected = {name: tuple(v.shape) for name, v in tree_flatten(module.parameters())}
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        name = missing[0] if missing else extra[0]
        raise MtplxError(f"{what} {path}: tensor {name} {'missing' if missing else 'unexpected'}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise MtplxError(
                f"{what} {path}: {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    module.load_weights(list(weights.items()))
    module.eval()
    materialize(module)  # its private arrays too: the server drafts on its own thread
