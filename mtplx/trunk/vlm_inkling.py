"""Inkling (``inkling``, mlx-vlm 0.7.10 ``models/inkling/language.py``) as an mlx-vlm-hosted trunk:
the two places its forward departs from the trunk contract, and how mtplx meets them.

* **Short convolutions** (rollback). Every layer runs four depthwise causal convolutions
  (``k_sconv`` / ``v_sconv`` in the attention, ``attn_sconv`` / ``mlp_sconv`` around it), whose
  windows of the last ``kernel_size - 1`` inputs share one mlx-vlm ``ArraysCache(4)`` (slot =
  ``conv_idx``). ``InklingShortConvolution.__call__`` assigns the new window straight into its
  slot, so mlx-vlm's speculative transaction has no per-position record of it (it refuses the
  commit: "state changed without temporal records"; mlx-vlm's own drafting restores a snapshot
  and replays the kept tokens, a second trunk forward per cycle). `recording_short_conv_call`
  wraps the method: while the cache is in a transaction it records the conv's input after the
  window it started from, ``concat([window, x])`` [B, K-1+T, C] (float32, as the conv keeps it),
  with mlx-vlm's own ``ArraysCache.record_speculative_window(conv_idx, source, K-1)``; the
  transaction's commit then installs ``source[:, keep : keep + K-1]``, the window after ``keep``
  positions, which is what plain decoding leaves (each step keeps the last K-1 inputs). No second
  forward; outside a transaction the method runs untouched. A padded batch (a conv mask) is not
  recorded (a batch's rows are ragged, not padded: `mtplx.trunk.batch_inkling`).
* **The final norm's width multiplier** (the LM head's input). ``LanguageModel._logits_from_norm``
  divides the final norm's output by ``logits_mup_width_multiplier`` before the LM head.
  `host` shows the trunk ``norm`` as `WidthScaledNorm` (norm, then the division) and makes
  ``_logits_from_norm`` the LM head alone, so the trunk's post-norm tap is the LM head's true
  input (``Trunk.lm_head(post) == logits``) and an MTP head reading it, or dividing its own norm's
  output the same way (`mtplx.heads.inkling`), shares the LM head unchanged. A checkpoint whose
  ``unpadded_vocab_size`` cuts the logits is refused in one line (the heads share the LM head's
  full width).
"""

from __future__ import annotations

from typing import Any

from mtplx.errors import MtplxError

import mlx.core as mx
import mlx.nn as nn

__all__ = ["WidthScaledNorm", "host", "recording_short_conv_call"]


def recording_short_conv_call(original: Any):
    """``InklingShortConvolution.__call__`` that records its window per position in a transaction
    (installed by `mtplx.trunk.vlm_text.install_exactness_hooks`)."""

    def __call__(
        self, x: mx.array, cache=None, mask: mx.array | None = None, residual: mx.array | None = None
    ):
        if cache is None or not getattr(cache, "is_speculating", False):
            return original(self, x, cache=cache, mask=mask, residual=residual)
        if mask is not None:
            raise RuntimeError("an Inkling short convolution over padded rows cannot be rolled back")
        width = self.kernel_size - 1
        window = cache[self.conv_idx]
        if window is None:
            window = mx.zeros((x.shape[0], width, x.shape[-1]), dtype=mx.float32)
        out = original(self, x, cache=cache, mask=mask, residual=residual)
        source = mx.concatenate([window, x.astype(mx.float32)], axis=1)
        cache.record_speculative_window(self.conv_idx, source, width)
        return out

    return __call__


class WidthScaledNorm(nn.Module):
    """Inkling's final norm followed by its division by ``logits_mup_width_multiplier``: the LM
    head's input. The norm is held outside the parameter tree (the model's own tree keeps it)."""

    def __init__(self, norm: nn.Module, multiplier: float):
        super().__init__()
        object.__setattr__(self, "_parts", (norm,))
        self.multiplier = float(multiplier)

    def __call__(self, h: mx.array) -> mx.array:
        (norm,) = self._parts
        return norm(h) / self.multiplier


def host(language_model: nn.Module) -> None:
    """Show ``language_model``'s final norm to the trunk as `WidthScaledNorm` and make its
    ``_logits_from_norm`` the LM head alone (the module docstring); MtplxError for a padded vocabulary."""
    config = language_model.config
    unpadded = getattr(config, "unpadded_vocab_size", None)
    if unpadded is not None and unpadded < config.vocab_size:
        raise MtplxError(
            f"inkling: unpadded_vocab_size {unpadded} < vocab_size {config.vocab_size} is not supported "
            "(mtplx's heads share the LM head's full width)"
        )
    inner = language_model.model
    # Attributes only (object.__setattr__: not child modules), so loading, quantization and
    # fingerprints see mlx-vlm's own tree.
    object.__setattr__(inner, "norm", WidthScaledNorm(inner["norm"], config.logits_mup_width_multiplier))

    def logits_from_scaled(h: mx.array) -> mx.array:
        if config.tie_word_embeddings:
            return inner.embed_tokens.as_linear(h)
        return language_model.lm_head(h)

    object.__setattr__(language_model, "_logits_from_norm", logits_from_scaled)
