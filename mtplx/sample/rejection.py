"""The rejection step in MLX ops (float32, batched): verify k drafts against the target.

Glossary (vLLM's `rejection_sampler.py` terms): the target distribution p of each position comes
from ``target_logits`` through the sampler (docs/sampling.md); q is the distribution each draft
was drawn from (``draft_probs``; one-hot at the draft for point-mass drafters); a draft is
*accepted* with probability min(1, p/q); at the first rejection the *recovered* token is drawn
from the residual max(p - q, 0) renormalised; when all k are accepted the *bonus* token is drawn
from p at position k+1. ``next_token`` is the recovered or the bonus token. k = 0 (no drafts) is
a plain AR step: nothing to accept, ``next_token`` is the bonus token from p_0, drawn by
`mtplx.sample.ops.sample` itself (same uniforms, same backend, so the same token).

Shapes (B sequences, k drafts each, V vocabulary; k >= 0): target_logits [B, k+1, V],
draft_tokens [B, k], draft_probs [B, k, V] or None, accept_uniforms [B, k], sample_uniforms [B];
result num_accepted [B], next_token [B], accept_probs [B, k].

Bit-level mirror: `mtplx.sample.reference.verify_reference`. Dispatches to a fused kernel
(`mtplx.sample.kernels.get_fused("verify")`) when the backend has one and ``backend="auto"``;
k = 0 goes to `ops.sample` with the caller's backend (the fused *sample* kernel where that one
runs), never to the fused verify kernel.
Lazy: nothing is evaluated; invalid inputs come back as the result's ``invalid`` flag.
"""

from __future__ import annotations

from typing import NamedTuple

from mtplx.sample.filters import (
    INVALID_DRAFTS,
    as_rows,
    check_backend,
    draw,
    filtered_weights,
    fused_implementation,
    one_hot,
    raise_if_invalid,
    row_max_and_flag,
)
from mtplx.sample.ops import sample
from mtplx.sample.params import SamplerConfig

import mlx.core as mx

__all__ = ["VerifyResult", "verify"]


class VerifyResult(NamedTuple):
    num_accepted: mx.array  # [B] int32: length of the accepted draft prefix
    next_token: mx.array  # [B] int32: residual sample, or the bonus token when all were accepted (k = 0 too)
    accept_probs: mx.array  # [B, k] float32: min(1, p/q) at every draft position ([B, 0] for k = 0)
    invalid: mx.array  # [] int32, lazy: INVALID_* bits; the other fields are meaningless when nonzero

    def checked(self) -> VerifyResult:
        """This result, after raising ValueError if the inputs were invalid (reads `invalid`)."""
        raise_if_invalid(self.invalid)
        return self


def _check_verify_shapes(
    target_logits: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    accept_uniforms: mx.array,
    sample_uniforms: mx.array,
) -> None:
    if target_logits.ndim != 3 or target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must be [B, k+1, V] with k >= 0, got shape {target_logits.shape}")
    batch, rows, vocab_size = target_logits.shape
    depth = rows - 1
    if draft_tokens.shape != (batch, depth):
        raise ValueError(f"draft_tokens must have shape {(batch, depth)}, got {draft_tokens.shape}")
    if draft_probs is not None and draft_probs.shape != (batch, depth, vocab_size):
        raise ValueError(f"draft_probs must have shape {(batch, depth, vocab_size)}, got {draft_probs.shape}")
    if accept_uniforms.shape != (batch, depth):
        raise ValueError(f"accept_uniforms must have shape {(batch, depth)}, got {accept_uniforms.shape}")
    if sample_uniforms.shape != (batch,):
        raise ValueError(f"sample_uniforms must have shape ({batch},), got {sample_uniforms.shape}")


def verify(
    target_logits: mx.array,
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    cfg: SamplerConfig,
    accept_uniforms: mx.array,
    sample_uniforms: mx.array,
    backend: str = "auto",
) -> VerifyResult:
    """Verify k >= 0 drafts per sequence (docs/sampling.md).

    target_logits[B, k+1, V] (already penalized), draft_tokens[B, k],
    draft_probs[B, k, V] float32 or None (greedy drafting: q one-hot at the
    draft), accept_uniforms[B, k] and sample_uniforms[B] in (0, 1].
    k = 0 is a plain AR step (`_verify_without_drafts`).
    Lazy: nothing is evaluated; call `.checked()` on the result after evaluating it.
    """
    check_backend(backend)
    _check_verify_shapes(target_logits, draft_tokens, draft_probs, accept_uniforms, sample_uniforms)
    batch, rows, vocab_size = target_logits.shape
    depth = rows - 1
    if depth == 0:
        return _verify_without_drafts(target_logits, cfg, sample_uniforms, backend)
    flat_rows = as_rows(target_logits)
    row_max, invalid = row_max_and_flag(flat_rows)
    drafts_outside = (draft_tokens < 0) | (draft_tokens >= vocab_size)
    invalid = invalid | (mx.any(drafts_outside).astype(mx.int32) * INVALID_DRAFTS)
    # Gathers below read at the drafts: keep them in range even when flagged.
    drafts = mx.clip(draft_tokens.astype(mx.int32), 0, vocab_size - 1)
    if backend == "auto" and (fused := fused_implementation("verify")) is not None:
        num_accepted, next_token, accept_probs = fused(
            flat_rows.reshape(batch, rows, vocab_size),
            drafts,
            draft_probs,
            cfg,
            accept_uniforms,
            sample_uniforms,
        )
        return VerifyResult(num_accepted, next_token, accept_probs, invalid)
    if cfg.is_greedy:
        return _verify_greedy(flat_rows.reshape(batch, rows, vocab_size), drafts, invalid)

    weights = filtered_weights(flat_rows, row_max, cfg).reshape(batch, rows, vocab_size)
    totals = mx.sum(weights, axis=-1)  # [B, k+1]

    # Acceptance, in log space so a tiny p cannot underflow into an accept.
    weight_of_draft = mx.take_along_axis(weights[:, :depth, :], drafts[..., None], axis=-1)[..., 0]
    log_p = mx.log(weight_of_draft) - mx.log(totals[:, :depth])
    if draft_probs is None:
        log_ratio = log_p  # q(d) = 1
        draft_proposable = mx.ones(drafts.shape, dtype=mx.bool_)
    else:
        q_of_draft = mx.take_along_axis(draft_probs, drafts[..., None], axis=-1)[..., 0].astype(mx.float32)
        draft_proposable = q_of_draft > 0  # q = 0 was never proposed: accept probability 0
        log_ratio = mx.where(
            draft_proposable, log_p - mx.log(mx.where(draft_proposable, q_of_draft, 1.0)), -mx.inf
        )
    accepted = draft_proposable & (mx.log(accept_uniforms.astype(mx.float32)) <= log_ratio)
    accept_probs = mx.where(draft_proposable, mx.minimum(1.0, mx.exp(log_ratio)), 0.0)
    num_accepted = mx.sum(mx.cumprod(accepted.astype(mx.int32), axis=1), axis=1).astype(mx.int32)

    # Next token from row n: residual max(p_n - q_{n+1}, 0), or p_k itself as the bonus.
    weights_n = mx.take_along_axis(weights, num_accepted[:, None, None], axis=1)[:, 0, :]
    total_n = mx.take_along_axis(totals, num_accepted[:, None], axis=1)
    p_n = weights_n / total_n
    has_next_draft = (num_accepted < depth)[:, None]
    next_slot = mx.minimum(num_accepted, depth - 1)[:, None]
    if draft_probs is None:
        q_next = one_hot(mx.take_along_axis(drafts, next_slot, axis=1)[:, 0], vocab_size)
    else:
        q_next = mx.take_along_axis(draft_probs, next_slot[:, :, None], axis=1)[:, 0, :].astype(mx.float32)
    residual = mx.maximum(p_n - q_next * has_next_draft, 0.0)
    uniforms = sample_uniforms.astype(mx.float32)
    from_residual = draw(residual, uniforms)
    from_target = draw(weights_n, uniforms)  # used only where the residual has zero mass
    residual_has_mass = mx.sum(residual, axis=-1) > 0
    next_token = mx.where(residual_has_mass, from_residual, from_target).astype(mx.int32)
    return VerifyResult(num_accepted, next_token, accept_probs, invalid)


def _verify_without_drafts(
    target_logits: mx.array, cfg: SamplerConfig, sample_uniforms: mx.array, backend: str
) -> VerifyResult:
    """k = 0, a plain AR step: num_accepted 0, accept_probs [B, 0], next_token the bonus from p_0.

    The token is `ops.sample` of row 0 with the same uniforms and backend, so a seeded AR step
    gives the same token through `verify` as through `sample`, on every backend (with
    ``backend="auto"`` that is the fused sample kernel where one runs: the fused verify kernel
    is not launched for k = 0). The flag is sample's (no drafts, so never INVALID_DRAFTS).
    """
    batch = target_logits.shape[0]
    drawn = sample(target_logits[:, 0, :], cfg, sample_uniforms, backend=backend)
    return VerifyResult(
        mx.zeros((batch,), dtype=mx.int32),
        drawn.tokens.astype(mx.int32),
        mx.zeros((batch, 0), dtype=mx.float32),
        drawn.invalid,
    )


def _verify_greedy(logits: mx.array, drafts: mx.array, invalid: mx.array) -> VerifyResult:
    """temperature 0: accept while draft == argmax; the next token is the argmax of row n."""
    depth = drafts.shape[1]
    argmaxes = mx.argmax(logits, axis=-1).astype(mx.int32)  # lowest id on ties
    matches = drafts == argmaxes[:, :depth]
    num_accepted = mx.sum(mx.cumprod(matches.astype(mx.int32), axis=1), axis=1).astype(mx.int32)
    next_token = mx.take_along_axis(argmaxes, num_accepted[:, None], axis=1)[:, 0]
    return VerifyResult(num_accepted, next_token, matches.astype(mx.float32), invalid)
