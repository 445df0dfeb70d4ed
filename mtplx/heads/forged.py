"""Forged heads on disk: a sidecar directory with ``head.safetensors`` + ``manifest.json``.

A forged head is a Qwen3-Next-layout head trained by ``mtplx forge`` for one
specific trunk. Its manifest records the trunk's weight fingerprint; loading it
against any other trunk is refused, because a head trained on other weights
drafts garbage and no shape check can tell.

Optionally the head drafts from a reduced vocabulary (``vocab_ids`` in the
manifest): its output projection is the trunk's LM head restricted to those
rows, and q is zero elsewhere, so such tokens are never proposed and
verification stays exact.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import build_layer_like, model_args_of
from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.heads.weights import check_and_load
from mtplx.io import atomic_path, atomic_write
from mtplx.trunk.hidden import HIDDEN_SOURCES

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

LAYOUT = "qwen3_next"
MANIFEST = "manifest.json"
WEIGHTS = "head.safetensors"
FORMAT_VERSION = 1


class ForgedMTPHead(Qwen3NextMTPHead):
    """A Qwen3-Next head for a trunk without one; optionally with a reduced draft vocabulary."""

    def __init__(
        self, layers: Sequence[nn.Module], hidden_size: int, *, chain_source: str | None = None, **kwargs: Any
    ):
        super().__init__(layers, hidden_size, **kwargs)
        # What is fed back at depth > 1: by default the head's output in the same form as the
        # trunk hidden it was trained on (its pre-final-norm state mirrors the trunk's pre-norm one).
        self.chain_source = chain_source or self.hidden_source
        # Plain attributes (leading underscore keeps them out of parameters()).
        self._vocab_ids: mx.array | None = None
        self._vocab_proj: mx.array | None = None  # [H, K]
        self._vocab_size: int | None = None

    @property
    def vocab_ids(self) -> mx.array | None:
        """Token ids the head may propose (sorted), or None for the full vocabulary."""
        return self._vocab_ids

    def set_draft_vocab(self, ids: Sequence[int] | None, full_proj: mx.array | None = None) -> None:
        """Restrict drafting to ``ids``; ``full_proj`` is the trunk's [H, V] output matrix."""
        if ids is None:
            self._vocab_ids = self._vocab_proj = self._vocab_size = None
            return
        if full_proj is None:
            raise ValueError("a reduced draft vocabulary needs the trunk's output matrix")
        self._vocab_ids = mx.array(sorted(int(i) for i in ids), dtype=mx.int32)
        self._vocab_proj = full_proj[:, self._vocab_ids]
        self._vocab_size = int(full_proj.shape[1])
        mx.eval(self._vocab_ids, self._vocab_proj)

    def _subset_logits(self, head_hidden: mx.array) -> mx.array:
        """Logits over ``vocab_ids`` only ([..., K]): one [H, K] product, which `logits` scatters
        into the full vocabulary (the decode loop and verify work in full-vocabulary ids)."""
        return head_hidden @ self._vocab_proj

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        """Full-vocabulary logits; with a reduced vocabulary, -inf outside it (q is exactly zero there)."""
        if self._vocab_proj is None:
            return super().logits(head_hidden)
        sub = self._subset_logits(head_hidden)
        full = mx.full((*sub.shape[:-1], self._vocab_size), -mx.inf, dtype=sub.dtype)
        full[..., self._vocab_ids] = sub
        return full


def lm_head_matrix(trunk: Any) -> mx.array:
    """The trunk's output projection as a dense [H, V] float32 matrix (tied, untied or quantized alike)."""
    hidden_size = int(model_args_of(trunk.model).hidden_size)
    w = trunk.lm_head(mx.eye(hidden_size, dtype=mx.float32)).astype(mx.float32)
    mx.eval(w)
    return w


def build_forged_head(
    trunk: Any, hidden_source: str, num_layers: int = 1, chain_source: str | None = None
) -> ForgedMTPHead:
    """An (untrained) forged head shaped for ``trunk``: decoder layers of the trunk's last-layer class."""
    for value in (hidden_source, chain_source or hidden_source):
        if value not in HIDDEN_SOURCES:
            raise ValueError(f"hidden/chain source must be one of {HIDDEN_SOURCES}, got {value!r}")
    args = model_args_of(trunk.model)
    idx = len(trunk.layers) - 1
    layers = [build_layer_like(trunk.layers[idx], args, idx) for _ in range(num_layers)]
    return ForgedMTPHead(
        layers,
        int(args.hidden_size),
        eps=float(args.rms_norm_eps),
        trunk=trunk,
        hidden_source=hidden_source,
        chain_source=chain_source,
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_forged_head(out_dir: str | Path, head: ForgedMTPHead, manifest: dict[str, Any]) -> Path:
    """Write weights then manifest, each via a temp name + rename; returns the manifest path.

    The manifest carries the weights' sha256, so a manifest never vouches for other weights
    even if a write was interrupted between the two renames.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(head.parameters()))
    with atomic_path(out / WEIGHTS) as tmp:
        mx.save_safetensors(str(tmp), weights, metadata={"format": "mlx", "layout": LAYOUT})
    full = dict(manifest)
    full.update(
        {
            "format_version": FORMAT_VERSION,
            "layout": LAYOUT,
            "hidden_source": head.hidden_source,
            "chain_source": head.chain_source,
            "num_layers": head.num_layers,
            "weights": WEIGHTS,
            "weights_sha256": _sha256(out / WEIGHTS),
            "vocab_ids": None if head.vocab_ids is None else [int(i) for i in head.vocab_ids.tolist()],
        }
    )
    if "trunk_fingerprint" not in full:
        raise ValueError("a forged-head manifest needs the trunk_fingerprint")
    path = out / MANIFEST
    with atomic_write(path) as handle:
        handle.write(json.dumps(full, indent=1) + "\n")
    return path


def read_manifest(head_dir: str | Path) -> dict[str, Any]:
    path = Path(head_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MtplxError(f"{path}: forged-head manifest not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtplxError(f"{path}: unreadable forged-head manifest ({str(e).splitlines()[0]})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("layout") != LAYOUT
        or "trunk_fingerprint" not in manifest
    ):
        raise MtplxError(
            f"{path}: not a forged-head manifest (needs layout {LAYOUT!r} and trunk_fingerprint)"
        )
    return manifest


def load_forged_head(head_dir: str | Path, trunk: Any, trunk_fingerprint: str) -> ForgedMTPHead:
    """Load a forged head for ``trunk``; MtplxError if it was trained on other weights or is damaged."""
    head_dir = Path(head_dir)
    manifest = read_manifest(head_dir)
    manifest_path = head_dir / MANIFEST
    if manifest["trunk_fingerprint"] != trunk_fingerprint:
        raise MtplxError(
            f"{manifest_path}: head was forged for trunk {manifest['trunk_fingerprint']}, "
            f"not this trunk ({trunk_fingerprint}); re-forge it with `mtplx forge`"
        )
    hidden_source = manifest.get("hidden_source")
    chain_source = manifest.get("chain_source", hidden_source)
    for key, value in (("hidden_source", hidden_source), ("chain_source", chain_source)):
        if value not in HIDDEN_SOURCES:
            raise MtplxError(
                f"{manifest_path}: {key} must be one of {', '.join(HIDDEN_SOURCES)}, got {value!r}"
            )
    weights_path = head_dir / str(manifest.get("weights", WEIGHTS))
    if not weights_path.is_file():
        raise MtplxError(f"{weights_path}: forged-head weights not found")
    if manifest.get("weights_sha256") and _sha256(weights_path) != manifest["weights_sha256"]:
        raise MtplxError(
            f"{weights_path}: weights do not match the sha256 in {MANIFEST} (damaged or replaced)"
        )
    try:
        weights = mx.load(str(weights_path))
    except Exception as e:  # mlx raises RuntimeError/ValueError with multi-line text
        raise MtplxError(f"{weights_path}: cannot load safetensors ({str(e).splitlines()[0]})") from None
    head = build_forged_head(trunk, hidden_source, int(manifest.get("num_layers", 1)), chain_source)
    check_and_load(head, weights, str(weights_path))
    if manifest.get("vocab_ids"):
        head.set_draft_vocab(manifest["vocab_ids"], lm_head_matrix(trunk))
    # The depth measured fastest for this head (benchmarks/RESULTS.md); `mtplx tune` overrides it per machine.
    head.default_depth = int(manifest["default_depth"]) if manifest.get("default_depth") else None
    # Trained for this many chained draft steps; deeper drafts are extrapolation (the engine warns).
    head.max_depth = int(manifest["depth_trained"]) if manifest.get("depth_trained") else None
    return head
