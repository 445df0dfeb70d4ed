"""NumPy float64 oracle of docs/sampling.md.

Everything here is the specification in executable form: the MLX path
(`mtplx.sample.rejection`) and the fused kernels are tested against these functions.
Clarity beats speed, except that the sparse forms never touch the whole
vocabulary. Imports numpy only. Tests and tools import this module; the
runtime never does (it reads `SamplerConfig` from `mtplx.sample.params`, re-exported
here so `mtplx.sample.reference.SamplerConfig` keeps working).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig

import numpy as np

__all__ = [
    "SamplerConfig",
    "SparseDistribution",
    "apply_penalties",
    "apply_grammar_mask",
    "filtered_weights",
    "distribution_from_logits",
    "acceptance_probability",
    "residual_distribution",
    "speculative_output_marginal",
    "chain_output_distribution",
    "autoregressive_joint",
    "draw_from_weights",
    "sample_reference",
    "verify_reference",
]


# ----------------------------------------------------------------------------
# Logits -> distribution
# ----------------------------------------------------------------------------


def _as_float32_logits(logits: np.ndarray) -> np.ndarray:
    """Round to float32 (the precision every implementation reads), then widen to float64."""
    as_array = np.asarray(logits)
    if as_array.ndim == 0:
        raise ValueError("logits must have a vocabulary axis")
    widened = as_array.astype(np.float32).astype(np.float64)
    if np.isnan(widened).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(widened).any():
        raise ValueError("logits contain +inf")
    return widened


def _checked_tokens(tokens: Sequence[int] | np.ndarray, vocab_size: int, what: str) -> np.ndarray:
    token_array = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if token_array.size and (token_array.min() < 0 or token_array.max() >= vocab_size):
        raise ValueError(
            f"{what} must lie in [0, {vocab_size}), got range [{token_array.min()}, {token_array.max()}]"
        )
    return token_array


def apply_penalties(
    logits: np.ndarray, context_tokens: Sequence[int] | np.ndarray, cfg: SamplerConfig
) -> np.ndarray:
    """Stage 2 of the pipeline for one position: logits[V] and the context it extends."""
    z = np.array(logits, dtype=np.float64)
    if z.ndim != 1:
        raise ValueError(f"apply_penalties takes one position's logits [V], got shape {z.shape}")
    vocab_size = z.shape[0]
    context = _checked_tokens(context_tokens, vocab_size, "context_tokens")
    if cfg.logit_bias:
        bias_ids = np.fromiter(cfg.logit_bias.keys(), dtype=np.int64)
        if bias_ids.max() >= vocab_size:
            raise MtplxError(f"logit_bias has token id {bias_ids.max()} >= vocab size {vocab_size}")
        z[bias_ids] += np.fromiter(cfg.logit_bias.values(), dtype=np.float64)
    if cfg.has_repetition_penalty and context.size:
        window = np.unique(context[-cfg.repetition_context_size :])
        seen = z[window]
        z[window] = np.where(seen < 0, seen * cfg.repetition_penalty, seen / cfg.repetition_penalty)
    if (cfg.presence_penalty or cfg.frequency_penalty) and context.size:
        counts = np.bincount(context, minlength=vocab_size).astype(np.float64)
        z -= cfg.presence_penalty * (counts > 0) + cfg.frequency_penalty * counts
    return z


def apply_grammar_mask(logits: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    """Stage 2b (docs/sampling.md, "Grammar mask"): -inf wherever ``allowed`` is False.

    logits[..., V] (penalized), allowed[..., V] bool (broadcast) or None (no grammar). After the
    penalties, before temperature and the filters: a disallowed token has weight exp(-inf) = 0 in
    every later stage, top-k / top-p / min-p act on the allowed tokens alone, greedy picks the
    allowed argmax. A row with nothing allowed has no finite entry and is refused downstream.
    """
    z = np.array(logits, dtype=np.float64)
    if allowed is None:
        return z
    mask = np.asarray(allowed)
    if mask.dtype != np.bool_:
        raise ValueError(f"allowed must be a boolean mask, got dtype {mask.dtype}")
    return np.where(mask, z, -np.inf)


def _top_p_threshold(weights: np.ndarray, top_p: float) -> float:
    """Largest t with mass(weights >= t) >= top_p * total; the oracle may sort, the MLX path may not."""
    total = weights.sum()
    positive_desc = np.sort(weights[weights > 0])[::-1]
    cumulative = np.cumsum(positive_desc)
    first_reaching = int(np.searchsorted(cumulative, top_p * total, side="left"))
    # Rounding can leave the last partial sum a hair below the target: then everything stays.
    return float(positive_desc[min(first_reaching, positive_desc.size - 1)])


def filtered_weights(penalized_logits: np.ndarray, cfg: SamplerConfig) -> np.ndarray:
    """Steps 3-6 for one row: unnormalized float64 weights, 0 outside the kept set.

    The largest weight is exactly 1 (exp(0)), which makes min-p a plain threshold.
    For temperature 0 the result is one-hot at the argmax (lowest id on ties).
    """
    z = np.asarray(penalized_logits, dtype=np.float64)
    vocab_size = z.shape[-1]
    z_max = z.max()
    if not np.isfinite(z_max):
        raise ValueError("logits row has no finite entry (all -inf)")
    if cfg.is_greedy:
        one_hot = np.zeros(vocab_size)
        one_hot[int(np.argmax(z))] = 1.0
        return one_hot
    # top-k is compared on the logits before temperature: same set as on z / T
    # (T > 0 is monotone) but exact in every implementation, since all of them
    # read the same float32 values.
    kept = np.ones(vocab_size, dtype=bool)
    if 0 < cfg.top_k < vocab_size:
        kth_largest = np.partition(z, vocab_size - cfg.top_k)[vocab_size - cfg.top_k]
        kept = z >= kth_largest
    weights = np.exp((z - z_max) / cfg.temperature) * kept
    if cfg.top_p < 1.0:
        weights = weights * (weights >= _top_p_threshold(weights, cfg.top_p))
    if cfg.min_p > 0.0:
        weights = weights * (weights >= cfg.min_p)  # max weight is 1, so this is p >= min_p * max p
    return weights


def distribution_from_logits(
    logits: np.ndarray,
    cfg: SamplerConfig,
    context_tokens: Sequence[int] | np.ndarray | None = None,
    allowed: np.ndarray | None = None,
) -> np.ndarray:
    """float64 probabilities of the full pipeline, over the last axis of ``logits``.

    ``context_tokens=None`` means the logits are already penalized (stage 2 is
    skipped, bias included); pass a (possibly empty) context to apply stage 2.
    ``allowed`` (bool, broadcast to ``logits``; None: no grammar) is the grammar mask of stage 2b.
    """
    z = _as_float32_logits(logits)
    rows = z.reshape(-1, z.shape[-1])
    masks = None if allowed is None else np.broadcast_to(np.asarray(allowed), z.shape).reshape(rows.shape)
    probs = np.empty_like(rows)
    for row_index, row in enumerate(rows):
        if context_tokens is not None:
            row = apply_penalties(row, context_tokens, cfg)
        if masks is not None:
            row = apply_grammar_mask(row, masks[row_index])
        weights = filtered_weights(row, cfg)
        probs[row_index] = weights / weights.sum()
    return probs.reshape(z.shape)


# ----------------------------------------------------------------------------
# Acceptance, residual, marginal: dense and sparse
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SparseDistribution:
    """Nonzero entries of a vector over the vocabulary: strictly increasing ids and their values.

    Used for distributions over a filtered support; ``acceptance_probability``
    also returns one whose ``probs`` are per-token acceptance probabilities.
    """

    token_ids: np.ndarray
    probs: np.ndarray

    def __post_init__(self) -> None:
        ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
        values = np.asarray(self.probs, dtype=np.float64).reshape(-1)
        if ids.shape != values.shape:
            raise ValueError(f"token_ids {ids.shape} and probs {values.shape} differ in length")
        if ids.size and (ids.min() < 0 or np.any(np.diff(ids) <= 0)):
            raise ValueError("token_ids must be non-negative and strictly increasing")
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "probs", values)

    @classmethod
    def from_dense(cls, dense: np.ndarray) -> SparseDistribution:
        dense = np.asarray(dense, dtype=np.float64)
        support = np.flatnonzero(dense)
        return cls(support, dense[support])

    def to_dense(self, vocab_size: int) -> np.ndarray:
        dense = np.zeros(vocab_size)
        dense[self.token_ids] = self.probs
        return dense

    def values_at(self, token_ids: np.ndarray) -> np.ndarray:
        """This vector's value at each of ``token_ids`` (0 off the support); O(n log s)."""
        positions = np.searchsorted(self.token_ids, token_ids)
        positions = np.minimum(positions, max(self.token_ids.size - 1, 0))
        found = self.token_ids.size > 0
        hit = (self.token_ids[positions] == token_ids) if found else np.zeros(len(token_ids), bool)
        return np.where(hit, self.probs[positions] if found else 0.0, 0.0)


def _both_sparse(p: object, q: object) -> bool:
    p_sparse, q_sparse = isinstance(p, SparseDistribution), isinstance(q, SparseDistribution)
    if p_sparse != q_sparse:
        raise TypeError("pass both distributions dense or both as SparseDistribution")
    return p_sparse


def _dense_acceptance(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    safe_q = np.where(q > 0, q, 1.0)
    return np.where(q > 0, np.minimum(1.0, p / safe_q), 0.0)


def acceptance_probability(p_target, q_draft):
    """min(1, p/q) where q > 0, else 0 (a token with q = 0 is never proposed)."""
    if _both_sparse(p_target, q_draft):
        p_on_q = p_target.values_at(q_draft.token_ids)
        return SparseDistribution(q_draft.token_ids, _dense_acceptance(p_on_q, q_draft.probs))
    return _dense_acceptance(p_target, q_draft)


def residual_distribution(p_target, p_draft):
    """max(p - q, 0) normalized; p itself where that has zero mass."""
    if _both_sparse(p_target, p_draft):
        # p - q > 0 only where p > 0, so p's support is the whole story.
        excess = np.maximum(p_target.probs - p_draft.values_at(p_target.token_ids), 0.0)
        mass = excess.sum()
        if mass == 0.0:
            return p_target
        positive = excess > 0
        return SparseDistribution(p_target.token_ids[positive], excess[positive] / mass)
    p, q = np.asarray(p_target, np.float64), np.asarray(p_draft, np.float64)
    excess = np.maximum(p - q, 0.0)
    mass = excess.sum()
    return p.copy() if mass == 0.0 else excess / mass


def speculative_output_marginal(p_target, p_draft):
    """Exact output distribution of one step: draft x ~ q, accept w.p. min(1, p/q), else residual.

    Computed as (accept mass per token) + (total rejection mass) * residual,
    literally from the procedure; that it equals p is what the tests check.
    """
    if _both_sparse(p_target, p_draft):
        acceptance = acceptance_probability(p_target, p_draft)
        accept_mass = p_draft.probs * acceptance.probs
        reject_mass = float(np.sum(p_draft.probs * (1.0 - acceptance.probs)))
        residual = residual_distribution(p_target, p_draft)
        support = np.union1d(p_draft.token_ids, residual.token_ids)
        combined = SparseDistribution(p_draft.token_ids, accept_mass).values_at(
            support
        ) + reject_mass * residual.values_at(support)
        nonzero = combined > 0
        return SparseDistribution(support[nonzero], combined[nonzero])
    q = np.asarray(p_draft, np.float64)
    acceptance = _dense_acceptance(p_target, q)
    reject_mass = float(np.sum(q * (1.0 - acceptance)))
    return q * acceptance + reject_mass * residual_distribution(p_target, q)


# ----------------------------------------------------------------------------
# Chain oracle: one depth-k verify cycle, enumerated exactly
# ----------------------------------------------------------------------------

ConditionalTable = Callable[[tuple], np.ndarray]


def autoregressive_joint(p_cond: ConditionalTable, length: int, vocab_size: int) -> np.ndarray:
    """Joint probability of the first ``length`` tokens sampled one by one from p(. | prefix)."""
    joint = np.zeros((vocab_size,) * length)

    def extend(prefix: tuple, prob: float) -> None:
        if len(prefix) == length:
            joint[prefix] += prob
            return
        p = p_cond(prefix)
        for token in np.flatnonzero(p):
            extend(prefix + (int(token),), prob * p[token])

    extend((), 1.0)
    return joint


def chain_output_distribution(
    p_cond: ConditionalTable, q_cond: ConditionalTable, depth: int, vocab_size: int
) -> np.ndarray:
    """Exact joint of the first depth+1 output tokens of one speculative cycle.

    Drafts d_i ~ q(. | d_1..d_{i-1}); d_i is accepted w.p. min(1, p/q) under
    p(. | d_1..d_{i-1}); the first rejection emits a residual sample, full
    acceptance emits a bonus token from p(. | d_1..d_k). A cycle that emits
    fewer than depth+1 tokens is completed by plain AR sampling from p.
    """
    if not 1 <= depth <= 8:
        raise ValueError(f"depth must be in 1..8, got {depth}")
    length = depth + 1
    joint = np.zeros((vocab_size,) * length)

    def complete_autoregressively(prefix: tuple, prob: float) -> None:
        if len(prefix) == length:
            joint[prefix] += prob
            return
        p = p_cond(prefix)
        for token in np.flatnonzero(p):
            complete_autoregressively(prefix + (int(token),), prob * p[token])

    def verify_from(accepted: tuple, prob: float) -> None:
        p = p_cond(accepted)
        if len(accepted) == depth:  # every draft accepted: bonus token from the last target row
            for token in np.flatnonzero(p):
                complete_autoregressively(accepted + (int(token),), prob * p[token])
            return
        q = q_cond(accepted)
        acceptance = acceptance_probability(p, q)
        for draft in np.flatnonzero(q * acceptance):
            verify_from(accepted + (int(draft),), prob * q[draft] * acceptance[draft])
        reject_mass = float(np.sum(q * (1.0 - acceptance)))
        if reject_mass > 0.0:
            residual = residual_distribution(p, q)
            for token in np.flatnonzero(residual):
                complete_autoregressively(accepted + (int(token),), prob * reject_mass * residual[token])

    verify_from((), 1.0)
    return joint


# ----------------------------------------------------------------------------
# Bit-level mirrors of verify.sample / verify.verify
# ----------------------------------------------------------------------------


def _checked_uniforms(uniforms: np.ndarray, shape: tuple, what: str) -> np.ndarray:
    values = np.asarray(uniforms, dtype=np.float64)
    if values.shape != shape:
        raise ValueError(f"{what} must have shape {shape}, got {values.shape}")
    if values.size and not (np.all(values > 0.0) and np.all(values <= 1.0)):
        raise ValueError(f"{what} must lie in (0, 1]")
    return values


def draw_from_weights(weights: np.ndarray, uniform: float) -> int:
    """Smallest id with weight > 0 and cumsum >= u * total (inverse CDF in vocabulary order)."""
    cumulative = np.cumsum(weights)
    # The total is the last partial sum, not a separate sum, so u = 1 always lands.
    first_reaching = int(np.searchsorted(cumulative, uniform * cumulative[-1], side="left"))
    return min(first_reaching, len(weights) - 1)


def sample_reference(
    logits: np.ndarray, cfg: SamplerConfig, uniforms: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Mirror of ``verify.sample``: logits[B, V] (already penalized), uniforms[B] in (0, 1].

    Returns (tokens[B] int64, probs[B, V] float64): the token and the filtered
    distribution it was drawn from.
    """
    z = _as_float32_logits(logits)
    if z.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {z.shape}")
    batch = z.shape[0]
    u = _checked_uniforms(uniforms, (batch,), "uniforms")
    tokens = np.empty(batch, dtype=np.int64)
    probs = np.empty_like(z)
    for row in range(batch):
        weights = filtered_weights(z[row], cfg)
        probs[row] = weights / weights.sum()
        tokens[row] = int(np.argmax(weights)) if cfg.is_greedy else draw_from_weights(weights, u[row])
    return tokens, probs


def verify_reference(
    target_logits: np.ndarray,
    draft_tokens: np.ndarray,
    draft_probs: np.ndarray | None,
    cfg: SamplerConfig,
    accept_uniforms: np.ndarray,
    sample_uniforms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mirror of ``verify.verify`` (docs/sampling.md, "Verifying k draft tokens").

    target_logits[B, k+1, V] (already penalized), draft_tokens[B, k],
    draft_probs[B, k, V] or None (greedy drafting: q one-hot at the draft),
    accept_uniforms[B, k] and sample_uniforms[B] in (0, 1]; k >= 0.
    Returns (num_accepted[B] int64, next_token[B] int64, accept_probs[B, k] float64).
    The bonus token (all k accepted; k = 0 is a plain AR step) is drawn from row k's filtered
    weights exactly as ``sample_reference`` draws, so k = 0 gives sample_reference's token.
    """
    z = _as_float32_logits(target_logits)
    if z.ndim != 3 or z.shape[1] < 1:
        raise ValueError(f"target_logits must be [B, k+1, V] with k >= 0, got shape {z.shape}")
    batch, rows, vocab_size = z.shape
    depth = rows - 1
    drafts = np.asarray(draft_tokens, dtype=np.int64)
    if drafts.shape != (batch, depth):
        raise ValueError(f"draft_tokens must have shape {(batch, depth)}, got {drafts.shape}")
    _checked_tokens(drafts, vocab_size, "draft_tokens")
    q_all = None
    if draft_probs is not None:
        q_all = np.asarray(draft_probs, dtype=np.float64)
        if q_all.shape != (batch, depth, vocab_size):
            raise ValueError(f"draft_probs must have shape {(batch, depth, vocab_size)}, got {q_all.shape}")
    accept_u = _checked_uniforms(accept_uniforms, (batch, depth), "accept_uniforms")
    sample_u = _checked_uniforms(sample_uniforms, (batch,), "sample_uniforms")

    num_accepted = np.zeros(batch, dtype=np.int64)
    next_token = np.zeros(batch, dtype=np.int64)
    accept_probs = np.zeros((batch, depth))
    for b in range(batch):
        weights = np.stack([filtered_weights(z[b, i], cfg) for i in range(rows)])
        if cfg.is_greedy:
            argmaxes = weights.argmax(axis=1)
            matches = drafts[b] == argmaxes[:depth]
            accept_probs[b] = matches
            n = int(np.cumprod(matches).sum())
            num_accepted[b], next_token[b] = n, argmaxes[n]
            continue
        totals = weights.sum(axis=1)
        still_accepting = True
        n = 0
        for i in range(depth):
            d = drafts[b, i]
            q_of_d = 1.0 if q_all is None else q_all[b, i, d]
            if weights[i, d] > 0 and q_of_d > 0:
                log_ratio = math.log(weights[i, d]) - math.log(totals[i]) - math.log(q_of_d)
            else:
                log_ratio = -math.inf  # p = 0 never accepts; q = 0 was never proposed
            accept_probs[b, i] = min(1.0, math.exp(log_ratio)) if q_of_d > 0 else 0.0
            accepted = q_of_d > 0 and math.log(accept_u[b, i]) <= log_ratio
            still_accepting = still_accepting and accepted
            n += int(still_accepting)
        if n == depth:  # the bonus token: sample_reference's draw from the filtered weights
            num_accepted[b], next_token[b] = n, draw_from_weights(weights[n], sample_u[b])
            continue
        p_n = weights[n] / totals[n]
        if q_all is None:
            q_next = np.zeros(vocab_size)
            q_next[drafts[b, n]] = 1.0
        else:
            q_next = q_all[b, n]
        residual = np.maximum(p_n - q_next, 0.0)
        # Zero residual mass (p_n <= q pointwise): draw from p_n itself.
        source = residual if np.cumsum(residual)[-1] > 0 else weights[n]
        num_accepted[b], next_token[b] = n, draw_from_weights(source, sample_u[b])
    return num_accepted, next_token, accept_probs
