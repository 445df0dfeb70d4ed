"""Logit ops in MLX (float32, batched): penalties, filters, sampling, uniforms, validity flags.

The sampling half of the engine's hot path (the rejection step is `mtplx.sample.rejection`).
Semantics: docs/sampling.md; bit-level mirror: `mtplx.sample.reference.sample_reference`. No full-vocabulary sort: top-k and the top-p
candidates come from `mx.topk` (a partial selection), and the top-p threshold
is found among at most a few thousand candidates, falling back to a bisection
on the float32 bit pattern when the nucleus is larger than that.

`sample` (and `rejection.verify`) dispatch to a fused kernel (`mtplx.sample.kernels.get_fused`)
when the backend has one and `backend="auto"`.

Host syncs: none on a GPU. (On the CPU backend only, the top-p search syncs to
skip fallbacks no row needs; see `_queue_top_p_fallbacks`.) Invalid values (NaN/+inf logits, a row with no finite
entry, draft ids outside the vocabulary) are reported through the results'
lazy `invalid` flag, which the caller evaluates together with the tokens it
reads anyway and turns into the error with `.checked()`; a decode cycle thus
syncs once. Only shapes, dtypes and config are checked eagerly (no data read).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import NamedTuple

from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig

import mlx.core as mx

__all__ = [
    "INVALID_DRAFTS",
    "INVALID_LOGITS",
    "SampleResult",
    "draw_uniforms",
    "filtered_probs",
    "constrain_logits",
    "left_padded",
    "mask_logits",
    "penalize_logits",
    "raise_if_invalid",
    "sample",
]

# Top-p candidate pool sizes tried in order before bisecting the whole row.
# mx.topk costs about the same for 20 or 4096 on CPU, but sorting the pool
# does not, so start small: an LLM nucleus is usually far below 256 tokens.
TOP_P_CANDIDATE_POOLS = (256, 4096)

# float32 bit patterns of non-negative floats are ordered like the floats;
# every weight lies in [0, 1], so the bisection runs over [bits(0), bits(1) + 1].
_BITS_ABOVE_ONE = 0x3F800001
_BISECTION_STEPS = 30  # 2**30 > _BITS_ABOVE_ONE

_SMALLEST_UNIFORM = 2.0**-126  # draw_uniforms never returns 0


# Bits of the lazy `invalid` flag.
INVALID_LOGITS = 1  # NaN or +inf logits, or a row with no finite entry
INVALID_DRAFTS = 2  # a draft token id outside [0, V)


def raise_if_invalid(invalid: mx.array) -> None:
    """Reads the flag (a sync unless it is already evaluated) and raises what it reports."""
    code = int(invalid.item())
    if code & INVALID_LOGITS:
        raise ValueError("logits contain NaN or +inf, or a row with no finite entry")
    if code & INVALID_DRAFTS:
        raise ValueError("draft_tokens must lie in [0, vocabulary size)")


class SampleResult(NamedTuple):
    tokens: mx.array  # [B] int32
    probs: mx.array  # [B, V] float32: the filtered distribution the token was drawn from
    invalid: mx.array  # [] int32, lazy: INVALID_* bits; the tokens are meaningless when nonzero

    def checked(self) -> SampleResult:
        """This result, after raising ValueError if the inputs were invalid (reads `invalid`)."""
        raise_if_invalid(self.invalid)
        return self


# ----------------------------------------------------------------------------
# Uniforms, validation, fused-kernel dispatch
# ----------------------------------------------------------------------------


def draw_uniforms(shape: tuple[int, ...] | int, key: mx.array | None = None) -> mx.array:
    """float32 uniforms in (0, 1]: 1 - U[0, 1) is exact in float32 and never 0."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    half_open = mx.random.uniform(shape=shape, key=key)
    return mx.maximum(1.0 - half_open, _SMALLEST_UNIFORM)


_kernels_missing = False


def _fused_implementation(name: str) -> Callable | None:
    global _kernels_missing
    if _kernels_missing:
        return None
    try:
        from mtplx.sample import kernels
    except ImportError:
        _kernels_missing = True  # a failed import is retried on every call otherwise
        return None
    get_fused = getattr(kernels, "get_fused", None)
    candidate = get_fused(name) if callable(get_fused) else None
    return candidate if callable(candidate) else None


def _check_backend(backend: str) -> None:
    if backend not in ("auto", "mlx"):
        raise MtplxError(f"backend must be 'auto' or 'mlx', got {backend!r}")


def _row_max_and_flag(rows: mx.array) -> tuple[mx.array, mx.array]:
    """Row maxima [N, 1] and the lazy INVALID_LOGITS flag (max propagates NaN; -inf means no finite entry)."""
    row_max = mx.max(rows, axis=-1, keepdims=True)
    invalid = mx.any(~mx.isfinite(row_max)).astype(mx.int32) * INVALID_LOGITS
    return row_max, invalid


# ----------------------------------------------------------------------------
# The filter pipeline (steps 3-6), threshold search without sorting the vocabulary
# ----------------------------------------------------------------------------


def _weights(logits: mx.array, row_max: mx.array, temperature: float) -> mx.array:
    # One function for the full rows and the candidate pools, so equal logits
    # give bit-equal weights in both and the top-p threshold is an exact weight.
    return mx.exp((logits - row_max) / temperature)


def _first_reaching(cumulative: mx.array, target: mx.array) -> mx.array:
    """Index of the first entry with cumulative >= target (counting, no search), clipped."""
    count_below = mx.sum(cumulative < target, axis=-1, keepdims=True).astype(mx.int32)
    return mx.minimum(count_below, cumulative.shape[-1] - 1)


def _descending_pool(rows: mx.array, pool_size: int) -> mx.array:
    """The pool_size largest logits per row, sorted descending (a partial selection, then a small sort)."""
    return mx.sort(mx.topk(rows, pool_size, axis=-1), axis=-1)[:, ::-1]


def _top_p_threshold_from_pool(
    pool_desc: mx.array, row_max: mx.array, cfg: SamplerConfig, kth_largest: mx.array | None, target: mx.array
) -> tuple[mx.array, mx.array]:
    """Threshold t* from a pool of the largest logits, and whether the pool decided it.

    The pool holds every token whose weight exceeds the pool's smallest, so
    t* read from the pool's sorted prefix sums is exact whenever those sums
    reach the target, or the pool already ends in zero weights (it then holds
    the whole support and rounding alone kept the sum short of the target).
    """
    pool_weights = _weights(pool_desc, row_max, cfg.temperature)
    if kth_largest is not None:
        pool_weights = pool_weights * (pool_desc >= kth_largest)
    cumulative = mx.cumsum(pool_weights, axis=-1)
    decided = (cumulative[:, -1:] >= target) | (pool_weights[:, -1:] == 0)
    threshold = mx.take_along_axis(pool_weights, _first_reaching(cumulative, target), axis=-1)
    return threshold, decided


def _top_p_threshold_by_bisection(weights: mx.array, target: mx.array) -> mx.array:
    """Largest float32 t with mass(weights >= t) >= target, by bisecting its bit pattern.

    Invariant: mass(>= lo) >= target > mass(>= hi); mass only changes at weight
    values, so the final lo is exactly one of the weights.
    """
    rows = weights.shape[0]
    lo = mx.zeros((rows, 1), dtype=mx.int32)
    hi = mx.full((rows, 1), _BITS_ABOVE_ONE, dtype=mx.int32)
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) // 2
        mass = mx.sum(weights * (weights >= mid.view(mx.float32)), axis=-1, keepdims=True)
        reaches = mass >= target
        lo = mx.where(reaches, mid, lo)
        hi = mx.where(reaches, hi, mid)
    return lo.view(mx.float32)


def _top_p_threshold(
    rows: mx.array,
    row_max: mx.array,
    weights: mx.array,
    cfg: SamplerConfig,
    kth_largest: mx.array | None,
    first_pool: mx.array,
) -> mx.array:
    target = cfg.top_p * mx.sum(weights, axis=-1, keepdims=True)
    vocab_size = rows.shape[-1]
    threshold, decided = _top_p_threshold_from_pool(first_pool, row_max, cfg, kth_largest, target)
    if first_pool.shape[-1] == vocab_size:  # the pool is the whole row: nothing can be missing
        return threshold
    queue_fallbacks = _queue_top_p_fallbacks()
    for pool_size in [size for size in TOP_P_CANDIDATE_POOLS[1:] if first_pool.shape[-1] < size < vocab_size]:
        if not queue_fallbacks and mx.all(decided).item():
            return threshold
        pool_threshold, pool_decided = _top_p_threshold_from_pool(
            _descending_pool(rows, pool_size), row_max, cfg, kth_largest, target
        )
        threshold = mx.where(decided, threshold, pool_threshold)
        decided = decided | pool_decided
    if not queue_fallbacks and mx.all(decided).item():
        return threshold
    return mx.where(decided, threshold, _top_p_threshold_by_bisection(weights, target))


def _queue_top_p_fallbacks() -> bool:
    """Whether the top-p fallbacks are queued for every row (no sync) or launched only when needed.

    On a GPU a host sync drains the device queue and stalls the draft chain, while
    the fallbacks (a larger pool, a 30-step bisection) cost little, so they are
    queued and picked per row with `where`. On the CPU backend it is the other way
    round: the fallbacks cost several ms a row, a sync only ends Python/compute
    overlap, so it checks `decided` (an LLM nucleus rarely exceeds the first pool).
    On Metal the fused kernel runs instead (CUDA uses this path: kernels.FUSED_BY_DEFAULT).
    """
    return mx.default_device().type == mx.DeviceType.gpu


def _filtered_weights(rows: mx.array, row_max: mx.array, cfg: SamplerConfig) -> mx.array:
    """Steps 3-6 for rows [N, V] (not greedy): unnormalized weights, 0 outside the kept set.

    The maximum weight is exactly 1 (exp(0)), which makes min-p a plain threshold.
    """
    vocab_size = rows.shape[-1]
    weights = _weights(rows, row_max, cfg.temperature)
    top_k_active = 0 < cfg.top_k < vocab_size
    # One partial selection serves top-k and the first top-p pool.
    pool = None
    if cfg.top_p < 1.0:
        pool = _descending_pool(rows, min(vocab_size, max(TOP_P_CANDIDATE_POOLS[0], cfg.top_k)))
    kth_largest = None
    if top_k_active:
        # Compared on the logits, not the weights: same set (T > 0 is monotone),
        # and exact in every implementation since all read the same float32 values.
        if pool is not None:
            kth_largest = pool[:, cfg.top_k - 1 : cfg.top_k]
        else:
            kth_largest = mx.min(mx.topk(rows, cfg.top_k, axis=-1), axis=-1, keepdims=True)
        weights = weights * (rows >= kth_largest)
    if pool is not None:
        weights = weights * (weights >= _top_p_threshold(rows, row_max, weights, cfg, kth_largest, pool))
    if cfg.min_p > 0.0:
        weights = weights * (weights >= cfg.min_p)
    return weights


def _one_hot(tokens: mx.array, vocab_size: int) -> mx.array:
    return (mx.arange(vocab_size, dtype=mx.int32) == tokens[..., None]).astype(mx.float32)


def _as_rows(logits: mx.array) -> mx.array:
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.dtype == mx.float32 else rows.astype(mx.float32)


def filtered_probs(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """float32 distribution of steps 1 and 3-7 over the last axis (logits already penalized)."""
    rows = _as_rows(logits)
    row_max, invalid = _row_max_and_flag(rows)
    raise_if_invalid(invalid)  # a sync: this is an inspection helper, not the hot path
    if cfg.is_greedy:
        probs = _one_hot(mx.argmax(rows, axis=-1).astype(mx.int32), rows.shape[-1])
    else:
        weights = _filtered_weights(rows, row_max, cfg)
        probs = weights / mx.sum(weights, axis=-1, keepdims=True)
    return probs.reshape(logits.shape)


def _draw(weights: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse CDF in vocabulary order: smallest id with cumsum >= u * total, per row."""
    cumulative = mx.cumsum(weights, axis=-1)
    # The total is the last prefix sum (not a separate sum), so u = 1 always lands.
    return _first_reaching(cumulative, uniforms[:, None] * cumulative[:, -1:])[:, 0]


# ----------------------------------------------------------------------------
# Penalties (step 2)
# ----------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _bias_vector(bias_items: tuple[tuple[int, float], ...], vocab_size: int) -> mx.array:
    if bias_items[-1][0] >= vocab_size:  # items are sorted by token id
        raise MtplxError(f"logit_bias has token id {bias_items[-1][0]} >= vocab size {vocab_size}")
    ids = mx.array([token for token, _ in bias_items], dtype=mx.int32)
    values = mx.array([value for _, value in bias_items], dtype=mx.float32)
    return mx.zeros((vocab_size,), dtype=mx.float32).at[ids].add(values)


def penalize_logits(
    logits: mx.array,
    context_tokens: mx.array | None,
    cfg: SamplerConfig,
    block_tokens: mx.array | None = None,
) -> mx.array:
    """Step 2 for a block of positions: logits[B, T, V] -> penalized float32 logits.

    context_tokens[B, C] int: the committed tokens (prompt, output, and the
    pending token), left-padded with -1 where sequences differ in length;
    None or C = 0 means no context. block_tokens[B, T-1]: the tokens inside the
    block (the drafts); position t sees the context followed by
    block_tokens[:, :t]. Without penalties the input itself is returned.
    """
    if not cfg.has_penalties:
        return logits
    if logits.ndim != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {logits.shape}")
    batch, positions, vocab_size = logits.shape
    z = logits if logits.dtype == mx.float32 else logits.astype(mx.float32)
    if cfg.logit_bias:
        z = z + _bias_vector(tuple(cfg.logit_bias.items()), vocab_size)
    if context_tokens is None:
        context_tokens = mx.zeros((batch, 0), dtype=mx.int32)
    if block_tokens is None:
        block_tokens = mx.zeros((batch, 0), dtype=mx.int32)
    if context_tokens.shape[0] != batch or block_tokens.shape[0] != batch:
        raise ValueError("context_tokens and block_tokens need the logits' batch size")
    if block_tokens.shape[1] < positions - 1:
        raise ValueError(f"block_tokens needs {positions - 1} tokens for {positions} positions")
    # The stream every position extends; position t sees its first (context_len + t) tokens.
    stream = mx.concatenate(
        [context_tokens.astype(mx.int32), block_tokens[:, : positions - 1].astype(mx.int32)], axis=1
    )
    context_len = context_tokens.shape[1]
    if stream.shape[1] == 0:
        return z
    batch_index = mx.arange(batch)[:, None, None]
    position_index = mx.arange(positions)[None, :, None]
    if cfg.has_repetition_penalty:
        z = _apply_repetition(z, stream, context_len, cfg, batch_index, position_index)
    if cfg.presence_penalty or cfg.frequency_penalty:
        counts = _token_counts(stream, context_len, positions, vocab_size, batch_index, position_index)
        z = z - (cfg.presence_penalty * (counts > 0) + cfg.frequency_penalty * counts)
    return z


def _scatter_membership(
    tokens: mx.array,
    valid: mx.array,
    shape: tuple[int, int, int],
    batch_index: mx.array,
    position_index: mx.array,
) -> mx.array:
    """counts[b, t, v] = number of valid entries tokens[b, t, :] equal to v."""
    safe_tokens = mx.where(valid, tokens, 0)  # padding adds 0 at token 0
    batch_b = mx.broadcast_to(batch_index, tokens.shape)
    position_b = mx.broadcast_to(position_index, tokens.shape)
    return (
        mx.zeros(shape, dtype=mx.float32).at[batch_b, position_b, safe_tokens].add(valid.astype(mx.float32))
    )


def _apply_repetition(
    z: mx.array,
    stream: mx.array,
    context_len: int,
    cfg: SamplerConfig,
    batch_index: mx.array,
    position_index: mx.array,
) -> mx.array:
    batch, positions, vocab_size = z.shape
    window = cfg.repetition_context_size
    # Stream positions of each position's window: the `window` tokens before context_len + t.
    offsets = mx.arange(window)[None, None, :] - window + context_len + position_index  # [1, T, W]
    inside = offsets >= 0
    window_tokens = mx.take(stream, mx.maximum(offsets[0], 0), axis=1)  # [B, T, W]
    valid = inside & (window_tokens >= 0)
    in_window = (
        _scatter_membership(window_tokens, valid, (batch, positions, vocab_size), batch_index, position_index)
        > 0
    )
    penalized = mx.where(z < 0, z * cfg.repetition_penalty, z / cfg.repetition_penalty)
    return mx.where(in_window, penalized, z)


def _token_counts(
    stream: mx.array,
    context_len: int,
    positions: int,
    vocab_size: int,
    batch_index: mx.array,
    position_index: mx.array,
) -> mx.array:
    batch, stream_len = stream.shape
    # Position t counts stream entries [0, context_len + t): one [B, T, L] mask, small next to V.
    seen = mx.arange(stream_len)[None, None, :] < (context_len + position_index)
    tokens = mx.broadcast_to(stream[:, None, :], (batch, positions, stream_len))
    valid = seen & (tokens >= 0)
    return _scatter_membership(tokens, valid, (batch, positions, vocab_size), batch_index, position_index)


# ----------------------------------------------------------------------------
# Grammar mask (step 2b)
# ----------------------------------------------------------------------------


def mask_logits(logits: mx.array, allowed: mx.array | None) -> mx.array:
    """Step 2b: logits[..., V] with -inf where ``allowed`` [..., V] (bool, broadcast) is False.

    Applied after the penalties and before temperature and the filters, so every filter and both
    samplers see a disallowed token as weight 0 (docs/sampling.md, "Grammar mask"). None: no grammar,
    the input itself is returned.
    """
    if allowed is None:
        return logits
    return mx.where(allowed, logits, mx.array(-mx.inf, dtype=logits.dtype))


def left_padded(histories: Sequence[Sequence[int]]) -> mx.array:
    """int32 [B, C]: token lists left-padded with -1 (`penalize_logits`' context of rows of
    different lengths)."""
    width = max(len(h) for h in histories)
    return mx.array([[-1] * (width - len(h)) + list(h) for h in histories], dtype=mx.int32)


def constrain_logits(
    logits: mx.array,
    cfg: SamplerConfig,
    context: mx.array | Sequence[Sequence[int]] | None = None,
    block_tokens: mx.array | None = None,
    allowed: mx.array | None = None,
) -> mx.array:
    """The logit pipeline's stages before temperature and the filters (docs/sampling.md): step 2
    (bias and penalties over ``context`` then ``block_tokens``, `penalize_logits`), then step 2b
    (the grammar mask ``allowed``, `mask_logits`). Every path that samples or verifies a
    distribution (verify, the first token's draw, a drafter's draw) applies these two here, so
    their order is written once; `sample` and `verify` apply temperature and the filters.

    logits [B, T, V] or [B, V] (one position); ``context``: [B, C] int32 left-padded with -1, or
    the rows' token lists (padded here, only when the sampler has penalties); ``allowed`` bool,
    broadcast against the logits (None: no grammar). Without penalties and mask: the input."""
    if cfg.has_penalties:
        if context is not None and not isinstance(context, mx.array):
            context = left_padded(context)
        one_position = logits.ndim == 2
        logits = penalize_logits(logits[:, None, :] if one_position else logits, context, cfg, block_tokens)
        logits = logits[:, 0, :] if one_position else logits
    return mask_logits(logits, allowed)


# ----------------------------------------------------------------------------
# sample and verify
# ----------------------------------------------------------------------------


def sample(logits: mx.array, cfg: SamplerConfig, uniforms: mx.array, backend: str = "auto") -> SampleResult:
    """Draw one token per row: logits[B, V] (already penalized), uniforms[B] in (0, 1].

    Lazy: nothing is evaluated; call `.checked()` on the result after evaluating it.
    """
    _check_backend(backend)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if uniforms.shape != (logits.shape[0],):
        raise ValueError(f"uniforms must have shape ({logits.shape[0]},), got {uniforms.shape}")
    rows = _as_rows(logits)
    row_max, invalid = _row_max_and_flag(rows)
    if backend == "auto" and (fused := _fused_implementation("sample")) is not None:
        tokens, probs = fused(rows, cfg, uniforms)
        return SampleResult(tokens, probs, invalid)
    if cfg.is_greedy:
        tokens = mx.argmax(rows, axis=-1).astype(mx.int32)
        return SampleResult(tokens, _one_hot(tokens, rows.shape[-1]), invalid)
    weights = _filtered_weights(rows, row_max, cfg)
    probs = weights / mx.sum(weights, axis=-1, keepdims=True)
    return SampleResult(_draw(weights, uniforms.astype(mx.float32)).astype(mx.int32), probs, invalid)
