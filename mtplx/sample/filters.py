"""What `ops.sample` and `rejection.verify` share (float32, batched, lazy): the filter pipeline
(steps 3-6 of docs/sampling.md: temperature, top-k, top-p, min-p) as unnormalized weights, the
inverse-CDF draw, the lazy validity flags, and the fused-kernel dispatch.

No full-vocabulary sort: top-k and the top-p candidates come from `mx.topk` (a partial
selection), and the top-p threshold is found among at most a few thousand candidates, falling
back to a bisection on the float32 bit pattern when the nucleus is larger than that.
Bit-level mirror: `mtplx.sample.reference`.
"""

from __future__ import annotations

from collections.abc import Callable

from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig

import mlx.core as mx

__all__ = [
    "INVALID_DRAFTS",
    "INVALID_LOGITS",
    "TOP_P_CANDIDATE_POOLS",
    "as_rows",
    "check_backend",
    "draw",
    "filtered_weights",
    "fused_implementation",
    "one_hot",
    "raise_if_invalid",
    "row_max_and_flag",
]

# Top-p candidate pool sizes tried in order before bisecting the whole row.
# mx.topk costs about the same for 20 or 4096 on CPU, but sorting the pool
# does not, so start small: an LLM nucleus is usually far below 256 tokens.
TOP_P_CANDIDATE_POOLS = (256, 4096)

# float32 bit patterns of non-negative floats are ordered like the floats;
# every weight lies in [0, 1], so the bisection runs over [bits(0), bits(1) + 1].
_BITS_ABOVE_ONE = 0x3F800001
_BISECTION_STEPS = 30  # 2**30 > _BITS_ABOVE_ONE


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


_kernels_missing = False


def fused_implementation(name: str) -> Callable | None:
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


def check_backend(backend: str) -> None:
    if backend not in ("auto", "mlx"):
        raise MtplxError(f"backend must be 'auto' or 'mlx', got {backend!r}")


def row_max_and_flag(rows: mx.array) -> tuple[mx.array, mx.array]:
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


def filtered_weights(rows: mx.array, row_max: mx.array, cfg: SamplerConfig) -> mx.array:
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


def one_hot(tokens: mx.array, vocab_size: int) -> mx.array:
    return (mx.arange(vocab_size, dtype=mx.int32) == tokens[..., None]).astype(mx.float32)


def as_rows(logits: mx.array) -> mx.array:
    rows = logits.reshape(-1, logits.shape[-1])
    return rows if rows.dtype == mx.float32 else rows.astype(mx.float32)


def draw(weights: mx.array, uniforms: mx.array) -> mx.array:
    """Inverse CDF in vocabulary order: smallest id with cumsum >= u * total, per row."""
    cumulative = mx.cumsum(weights, axis=-1)
    # The total is the last prefix sum (not a separate sum), so u = 1 always lands.
    return _first_reaching(cumulative, uniforms[:, None] * cumulative[:, -1:])[:, 0]
