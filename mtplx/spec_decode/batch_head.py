"""The MTP head drafting for every row of a batch at once (the batched `HeadProposer`), and the
small array helpers the batched loop shares with it.

Shapes: B rows; ``n_r`` true (trunk hidden, next token) pairs row r has not fed the head yet;
``depth`` drafts per row this cycle; V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mtplx.sample import ops as sample_ops
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.head_proposer import trunk_hidden
from mtplx.spec_decode.proposer import masked_draft_logits
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk.batch_cache import BatchCache

import mlx.core as mx


class DraftingRow(Protocol):
    """What the chain reads and resets of a row (`mtplx.spec_decode.batch.BatchRow`)."""

    spec: Any  # a RowSpec: .settings (DecodeSettings) sets the row's draft sampler
    history: list[int]  # prompt + committed tokens (penalties' context)
    pending_hidden: list[mx.array]  # true (hidden [1, n, H], next token) pairs not fed yet
    pending_tokens: list[int]


__all__ = ["HeadChain", "gather_positions", "groups_by", "pad_time", "padded_uniforms"]


def gather_positions(x: mx.array, index: Sequence[int]) -> mx.array:
    """x[r, index[r]] for each row: [B, T, ...] -> [B, 1, ...]."""
    idx = mx.array(list(index), dtype=mx.int32).reshape(-1, 1, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, idx, axis=1)


class HeadChain:
    """The MTP head drafting for every row at once (the batched `HeadProposer`).

    The head's cache rows mirror the batch rows. Each cycle it first consumes every row's true
    (trunk hidden, next token) pairs (n_r >= 1 of them, right-padded to the longest), moves each
    row back to its true length (so the chain never attends to padding), then chains K - 1 steps,
    one position per row each; the commit moves every row back to its true length again.
    """

    def __init__(self, head, template: list):
        self.head = head
        self.cache = BatchCache(template)

    def prefill_observer(self, head_cache: list, prompt_tokens: list[int]):
        """What feeds a prefilling row's own head cache: head position i pairs trunk hidden i with
        token i+1 (as `HeadProposer.observe_prefill`); called with each prefill chunk's output."""
        head = self.head

        def observe(output, start: int, end: int) -> None:
            stop = min(end, len(prompt_tokens) - 1)
            if stop > start:
                hidden = trunk_hidden(output, head)[:, : stop - start]
                head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], head_cache)
                mx.eval([c.state for c in head_cache])

        return observe

    def draft(
        self,
        rows: Sequence[DraftingRow],
        depth: int,
        draft_uniforms: Sequence[mx.array],
        first_allowed: mx.array | None = None,
    ) -> tuple[mx.array, mx.array | None, mx.array | None, mx.array]:
        """Drafts [B, depth] int32, q [B, depth, V] (None when every row drafts its argmax), the
        lazy validity flag, and the head's confidence in each draft [B, depth] float32 (what the
        adaptive gate reads: q(d) for a sampled draft, the head's plain softmax at d for an argmax
        draft, as `HeadProposer` reads it); draft_uniforms[r] holds row r's uniforms (its spec's
        depth of them).

        ``first_allowed`` bool [B, V]: each row's grammar mask for its first draft (all True for a
        free row), known on the host before the cycle; the first draft and its q are then the
        head's masked distribution. Later drafts are drawn unmasked (q unmasked): verify masks the
        target at every position, so any q is exact and no read of the drafts stalls the chain."""
        head = self.head
        counts = [len(r.pending_tokens) for r in rows]
        width = max(counts)
        hidden = mx.concatenate(
            [pad_time(mx.concatenate(r.pending_hidden, axis=1), width) for r in rows], axis=0
        )
        tokens = mx.array([r.pending_tokens + [0] * (width - len(r.pending_tokens)) for r in rows])
        for r in rows:
            r.pending_hidden, r.pending_tokens = [], []
        true_lengths = [n + c for n, c in zip(self.cache.lengths, counts)]
        head_out = head(hidden, tokens, self.cache.layers)
        self.cache.set_lengths(true_lengths)
        last = [c - 1 for c in counts]
        chain_in = gather_positions(head.last_pre_norm if head.chain_source == "pre_norm" else head_out, last)
        head_out = gather_positions(head_out, last)
        draft_tokens: list[mx.array] = []
        draft_probs: list[mx.array] = []
        confidence: list[mx.array] = []
        flags: list[mx.array] = []
        any_q = any(not r.spec.settings.greedy_draft for r in rows)
        for step in range(depth):
            if step > 0:
                head_out = head(chain_in, draft_tokens[-1][:, None], self.cache.layers, step=step)
                chain_in = head.chain_input(head_out)
            logits = head.logits(head_out, step=step)[:, -1, :]
            token, q, invalid, sure = self._draw(
                rows,
                logits,
                draft_tokens,
                [u[step : step + 1] for u in draft_uniforms],
                first_allowed if step == 0 else None,
            )
            draft_tokens.append(token)
            confidence.append(sure)
            if any_q:
                draft_probs.append(q)
            flags.append(invalid)
        self.cache.set_lengths(true_lengths)
        invalid = flags[0]
        for flag in flags[1:]:
            invalid = invalid | flag
        probs = mx.stack(draft_probs, axis=1) if any_q else None
        return mx.stack(draft_tokens, axis=1), probs, invalid, mx.stack(confidence, axis=1)

    def _draw(
        self,
        rows: Sequence[DraftingRow],
        logits: mx.array,
        earlier: list[mx.array],
        uniforms: list[mx.array],
        allowed: mx.array | None,
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """One draft per row from logits [B, V] (masked by ``allowed`` [B, V] after the penalties,
        the target's order), grouped by the rows' draft sampler: tokens [B], q [B, V], the
        validity flag, and the head's confidence in each draft [B] (`draft`)."""
        vocab_size = logits.shape[-1]
        tokens: list[mx.array | None] = [None] * len(rows)
        probs: list[mx.array | None] = [None] * len(rows)
        sure: list[mx.array | None] = [None] * len(rows)
        invalid = mx.array(0, dtype=mx.int32)
        for (cfg, greedy, backend), index in groups_by(rows, lambda r: _draft_key(r.spec.settings)).items():
            sel = mx.array(index, dtype=mx.int32)
            group_logits = logits[sel]
            context = self._context(rows, index, earlier) if cfg.has_penalties else None
            group_logits = masked_draft_logits(
                sample_ops.constrain_logits(group_logits, cfg, context),
                None if allowed is None else allowed[sel],
            )
            if greedy:
                group_tokens = mx.argmax(group_logits, axis=-1).astype(mx.int32)
                group_probs = (mx.arange(vocab_size)[None] == group_tokens[:, None]).astype(mx.float32)
            else:
                u = mx.concatenate([uniforms[i] for i in index])
                drawn = sample_ops.sample(group_logits, cfg, u, backend=backend)
                group_tokens, group_probs = drawn.tokens.astype(mx.int32), drawn.probs
                invalid = invalid | drawn.invalid
            # An argmax draft's q is one-hot: its confidence is the head's plain softmax at it.
            weights = mx.softmax(logits[sel].astype(mx.float32), axis=-1) if greedy else group_probs
            group_sure = mx.take_along_axis(weights, group_tokens[:, None], axis=-1)[:, 0]
            for j, i in enumerate(index):
                tokens[i] = group_tokens[j : j + 1]
                probs[i] = group_probs[j : j + 1]
                sure[i] = group_sure[j : j + 1]
        return mx.concatenate(tokens), mx.concatenate(probs), invalid, mx.concatenate(sure)

    @staticmethod
    def _context(rows: Sequence[DraftingRow], index: Sequence[int], earlier: list[mx.array]) -> mx.array:
        context = sample_ops.left_padded([rows[i].history for i in index])
        if earlier:
            sel = mx.array(list(index), dtype=mx.int32)
            context = mx.concatenate([context, mx.stack(earlier, axis=1)[sel]], axis=1)
        return context


def pad_time(x: mx.array, width: int) -> mx.array:
    if x.shape[1] == width:
        return x
    return mx.concatenate([x, mx.zeros((x.shape[0], width - x.shape[1], *x.shape[2:]), x.dtype)], axis=1)


def _draft_key(settings: DecodeSettings) -> tuple[SamplerConfig, bool, str]:
    # A greedy request's head draft is its argmax either way (q one-hot).
    return settings.sampler, settings.greedy_draft or settings.sampler.is_greedy, settings.verify_backend


def groups_by(items: Sequence, key) -> dict:
    out: dict = {}
    for i, item in enumerate(items):
        out.setdefault(key(item), []).append(i)
    return out


def padded_uniforms(count: int, width: int, key: mx.array | None) -> mx.array:
    """A row's draft uniforms, drawn as the single-row head proposer draws them (``count`` from
    its key), padded with ones to the chain's ``width``; rows without a key get ones."""
    if key is None or count == 0:
        return mx.ones((width,), dtype=mx.float32)
    uniforms = sample_ops.draw_uniforms((count,), key)
    if count >= width:
        return uniforms[:width]
    return mx.concatenate([uniforms, mx.ones((width - count,), dtype=mx.float32)])
