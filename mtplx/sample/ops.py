"""Logit ops in MLX (float32, batched): penalties, the grammar mask, sampling, uniforms.

The sampling half of the engine's hot path (the rejection step is `mtplx.sample.rejection`; what
the two share, the filter pipeline, the draw, the validity flags and the fused-kernel dispatch,
is `mtplx.sample.filters`; the one composition every caller uses is
`mtplx.sample.target.TargetSampler`). Semantics: docs/sampling.md; bit-level mirror:
`mtplx.sample.reference.sample_reference`.

`sample` (and `rejection.verify`) dispatch to a fused kernel (`mtplx.sample.kernels.get_fused`)
when the backend has one and `backend="auto"`.

Host syncs: none on a GPU. (On the CPU backend only, the top-p search syncs to skip fallbacks no
row needs; see `filters._queue_top_p_fallbacks`.) Invalid values (NaN/+inf logits, a row with no
finite entry, draft ids outside the vocabulary) are reported through the results' lazy `invalid`
flag, which the caller evaluates together with the tokens it reads anyway and turns into the
error with `.checked()`; a decode cycle thus syncs once. Only shapes, dtypes and config are
checked eagerly (no data read).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

from mtplx.errors import MtplxError
from mtplx.sample.filters import (
    INVALID_DRAFTS,
    INVALID_LOGITS,
    as_rows,
    check_backend,
    draw,
    filtered_weights,
    fused_implementation,
    one_hot,
    raise_if_invalid,
    row_max_and_flag,
)
from mtplx.sample.params import SamplerConfig

import mlx.core as mx

__all__ = [
    "INVALID_DRAFTS",
    "INVALID_LOGITS",
    "SampleResult",
    "constrain_logits",
    "draw_uniforms",
    "filtered_probs",
    "left_padded",
    "mask_logits",
    "penalize_logits",
    "raise_if_invalid",
    "sample",
]

_SMALLEST_UNIFORM = 2.0**-126  # draw_uniforms never returns 0


class SampleResult(NamedTuple):
    tokens: mx.array  # [B] int32
    probs: mx.array  # [B, V] float32: the filtered distribution the token was drawn from
    invalid: mx.array  # [] int32, lazy: INVALID_* bits; the tokens are meaningless when nonzero

    def checked(self) -> SampleResult:
        """This result, after raising ValueError if the inputs were invalid (reads `invalid`)."""
        raise_if_invalid(self.invalid)
        return self


def draw_uniforms(shape: tuple[int, ...] | int, key: mx.array | None = None) -> mx.array:
    """float32 uniforms in (0, 1]: 1 - U[0, 1) is exact in float32 and never 0."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    half_open = mx.random.uniform(shape=shape, key=key)
    return mx.maximum(1.0 - half_open, _SMALLEST_UNIFORM)


def filtered_probs(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """float32 distribution of steps 1 and 3-7 over the last axis (logits already penalized)."""
    rows = as_rows(logits)
    row_max, invalid = row_max_and_flag(rows)
    raise_if_invalid(invalid)  # a sync: this is an inspection helper, not the hot path
    if cfg.is_greedy:
        probs = one_hot(mx.argmax(rows, axis=-1).astype(mx.int32), rows.shape[-1])
    else:
        weights = filtered_weights(rows, row_max, cfg)
        probs = weights / mx.sum(weights, axis=-1, keepdims=True)
    return probs.reshape(logits.shape)


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
    check_backend(backend)
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    if uniforms.shape != (logits.shape[0],):
        raise ValueError(f"uniforms must have shape ({logits.shape[0]},), got {uniforms.shape}")
    rows = as_rows(logits)
    row_max, invalid = row_max_and_flag(rows)
    if backend == "auto" and (fused := fused_implementation("sample")) is not None:
        tokens, probs = fused(rows, cfg, uniforms)
        return SampleResult(tokens, probs, invalid)
    if cfg.is_greedy:
        tokens = mx.argmax(rows, axis=-1).astype(mx.int32)
        return SampleResult(tokens, one_hot(tokens, rows.shape[-1]), invalid)
    weights = filtered_weights(rows, row_max, cfg)
    probs = weights / mx.sum(weights, axis=-1, keepdims=True)
    return SampleResult(draw(weights, uniforms.astype(mx.float32)).astype(mx.int32), probs, invalid)
