"""The target's sampler (`TargetSampler`): the one composition of the logit pipeline every
caller uses, "constrain, then sample or verify" (docs/sampling.md).

One object per (sampler configuration, backend, greedy drafts), `target_sampler` hands out the
shared one. Each method takes raw logits plus the row's context: ``context`` (the committed
tokens the penalties see: token lists, or [B, C] int32 left-padded with -1), ``allowed`` (the
grammar's mask, bool, broadcast against the logits; None: no grammar) and the uniforms; each
applies the bias and penalties, then the grammar mask (`ops.constrain_logits`), then draws:

- `first_token`: a row's first token after its prompt (`ops.sample`);
- `draft`: one drafter draw per row, with the draft-only rules: an argmax draft (greedy drafts,
  or a greedy sampler) is a point mass (q None), and where a drafter gives every allowed token
  probability 0 it drafts uniformly among them (`masked_draft_logits`);
- `verify`: k >= 0 drafts per row against the target (`rejection.verify`; k = 0 an AR step).

So the order of the stages, the greedy-draft shortcut and the mask fallback are written once.
Lazy: nothing is evaluated; the results carry the lazy validity flags (`.checked()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from mtplx.sample import ops, rejection
from mtplx.sample.params import SamplerConfig

import mlx.core as mx

__all__ = ["DraftDraw", "TargetSampler", "masked_draft_logits", "target_sampler"]

# The rows' committed tokens: [B, C] int32 left-padded with -1, or one token list per row.
Context = mx.array | Sequence[Sequence[int]] | None


class DraftDraw(NamedTuple):
    tokens: mx.array  # [B] int32
    q: mx.array | None  # [B, V] float32: the distribution each draft was drawn from; None: argmax drafts
    invalid: mx.array | None  # [] int32, lazy: the draw's INVALID_* bits; None for argmax drafts


@dataclass(frozen=True)
class TargetSampler:
    """The logit pipeline of one sampler configuration on one backend (the module docstring)."""

    cfg: SamplerConfig
    backend: str = "auto"  # "auto" (a fused kernel where one runs) | "mlx"
    greedy_draft: bool = False  # drafts are the argmax (q one-hot) instead of draws from q

    @property
    def argmax_drafts(self) -> bool:
        """Whether `draft` takes the argmax: greedy drafts asked for, or a greedy sampler (its
        draw is the argmax anyway)."""
        return self.greedy_draft or self.cfg.is_greedy

    def first_token(
        self, logits: mx.array, context: Context, uniforms: mx.array, allowed: mx.array | None = None
    ) -> ops.SampleResult:
        """One token per row from logits [B, V] (raw), uniforms [B]: penalties, mask, sample."""
        constrained = ops.constrain_logits(logits, self.cfg, context, allowed=allowed)
        return ops.sample(constrained, self.cfg, uniforms, backend=self.backend)

    def draft(
        self, logits: mx.array, context: Context, uniforms: mx.array, allowed: mx.array | None = None
    ) -> DraftDraw:
        """One draft per row from a drafter's logits [B, V] (raw): ``context`` holds the committed
        tokens and the drafts before this one, so the penalties see what the target will see at
        this position; ``allowed`` [B, V] or [V] masks it (q is then the masked distribution)."""
        constrained = masked_draft_logits(ops.constrain_logits(logits, self.cfg, context), allowed)
        if self.argmax_drafts:
            return DraftDraw(mx.argmax(constrained, axis=-1).astype(mx.int32), None, None)
        drawn = ops.sample(constrained, self.cfg, uniforms, backend=self.backend)
        return DraftDraw(drawn.tokens.astype(mx.int32), drawn.probs, drawn.invalid)

    def verify(
        self,
        logits: mx.array,
        context: Context,
        drafts: mx.array,
        q: mx.array | None,
        accept_uniforms: mx.array,
        sample_uniforms: mx.array,
        allowed: mx.array | None = None,
    ) -> rejection.VerifyResult:
        """Verify drafts [B, k] (k >= 0) drawn from q [B, k, V] (None: point masses) against the
        target's logits [B, k+1, V] (raw); position t's penalties see the context and the first t
        drafts; ``allowed`` [B, k+1, V] masks every position."""
        constrained = ops.constrain_logits(logits, self.cfg, context, drafts, allowed)
        return rejection.verify(
            constrained, drafts, q, self.cfg, accept_uniforms, sample_uniforms, backend=self.backend
        )


@lru_cache(maxsize=256)
def target_sampler(cfg: SamplerConfig, backend: str = "auto", greedy_draft: bool = False) -> TargetSampler:
    """The shared `TargetSampler` of this configuration (one object each)."""
    return TargetSampler(cfg, backend, greedy_draft)


def masked_draft_logits(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """A drafter's logits [B, V] (penalized) under the grammar's mask ``allowed`` [B, V] or [V]
    (None: returned as they are). A drafter may give every allowed token probability 0 (a head
    with a narrowed vocabulary): then it drafts uniformly among them. Any q keeps verify exact,
    and the draft stays legal."""
    if allowed is None:
        return logits
    masked = ops.mask_logits(logits, allowed)
    nothing = mx.all(masked == -mx.inf, axis=-1, keepdims=True)
    return mx.where(nothing, mx.where(allowed, 0.0, -mx.inf), masked)
