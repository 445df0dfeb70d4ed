"""The target model ("trunk") as the decode loop sees it.

An mlx-lm model returns only logits. MTP heads also need the trunk's last
hidden state, before or after its final norm depending on the family. Rather
than re-implementing every model's forward, the trunk's final norm is swapped
for a subclass of its own class that records its input and output; the
parameter tree (and so loading, quantization and fingerprints) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn


@dataclass
class TrunkOutput:
    logits: mx.array  # [B, T, V]
    hidden_pre_norm: mx.array  # [B, T, H]: input of the final norm
    hidden_post_norm: mx.array  # [B, T, H]: what the LM head reads


class _Tap:
    """Holds the last final-norm input/output of one forward pass."""

    def __init__(self) -> None:
        self.pre: mx.array | None = None
        self.post: mx.array | None = None


def find_inner_model(model: nn.Module) -> nn.Module:
    """The module that owns ``embed_tokens``, ``layers`` and ``norm``."""
    for path in (("model",), ("language_model", "model"), ("model", "language_model"), ()):
        node: Any = model
        try:
            for name in path:
                node = getattr(node, name)
        except AttributeError:
            continue
        if all(hasattr(node, a) for a in ("embed_tokens", "layers", "norm")):
            return node
    raise ValueError(f"unsupported model class {type(model).__name__}: no embed_tokens/layers/norm found")


def _find_lm_head(model: nn.Module) -> nn.Module | None:
    for owner in (model, getattr(model, "language_model", None)):
        if owner is not None and "lm_head" in owner:
            return owner["lm_head"]
    return None


def _install_tap(norm: nn.Module) -> _Tap:
    """Tap ``norm`` (once: a second Trunk over the same model shares the tap)."""
    existing = getattr(type(norm), "_mtplx_tap", None)
    if existing is not None:
        return existing
    base = type(norm)
    tap = _Tap()

    def __call__(self, x, *args, **kwargs):
        out = base.__call__(self, x, *args, **kwargs)
        tap.pre, tap.post = x, out
        return out

    norm.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtplx_tap": tap})
    return tap


class Trunk:
    """Wraps an mlx-lm model: logits plus the hidden states MTP heads consume."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = find_inner_model(model)
        self._tap = _install_tap(self.inner.norm)
        self._lm_head = _find_lm_head(model)

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def vocab_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[0]

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def __call__(self, tokens: mx.array, cache: list | None = None) -> TrunkOutput:
        logits = self.model(tokens, cache=cache)
        out = TrunkOutput(logits, self._tap.pre, self._tap.post)
        self._tap.pre = self._tap.post = None
        return out

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def final_norm(self, hidden: mx.array) -> mx.array:
        # Call the untapped class so a head's own use does not overwrite the trunk's capture.
        norm = self.inner.norm
        return type(norm).__mro__[1].__call__(norm, hidden)

    @property
    def output_layer(self) -> nn.Module | None:
        """The untied LM head layer (None when tied to the embeddings)."""
        return self._lm_head

    @output_layer.setter
    def output_layer(self, layer: nn.Module) -> None:
        # Distributed tensor parallel wraps a vocabulary-sharded LM head so heads see all logits.
        self._lm_head = layer

    def lm_head(self, hidden_post_norm: mx.array) -> mx.array:
        """Logits from a post-norm hidden state, through the trunk's (possibly tied) output layer."""
        if self._lm_head is not None:
            return self._lm_head(hidden_post_norm)
        return self.inner.embed_tokens.as_linear(hidden_post_norm)
