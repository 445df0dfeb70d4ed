"""The MTP head as a drafter (`HeadChain`): a chain of head steps on its own output hidden state,
batch-first (one head forward per depth for every row) over a head cache that is either the
batch's (`trunk.batch_cache.BatchCache`) or one row's own (`trunk.row_cache.SingleRowCache`: a
stream, a sharded engine, a head that reads the trunk's KV), so a stream is B = 1 of this code.

Shapes: B rows; ``n_r`` true (trunk hidden, next token) pairs row r has not fed the head yet;
``depth`` drafts per row this cycle; V the vocabulary.

Cycle (docs/ARCHITECTURE.md): the head first consumes the true (trunk hidden i, token i+1) pairs
it has not seen yet, drafts d_1 from the last of them, then chains: step i reads its previous
output and d_i. The entries made from drafted (not true) hidden states are dropped right after
the chain and the committed positions are re-fed from the trunk's true hidden states at the
next proposal, so the head's cache always equals the one a from-scratch run builds. Cycles the
head did not draft for (prompt lookup) only add true pairs.

Per-row options (`DecodeSettings`): the draft sampler, greedy drafts, and the adaptive stop
(``adaptive_threshold`` > 0): every row drafts its full length in the chain and the block
carries the head's confidence in each draft; the loop cuts the row's block after its first
unsure draft with the one host read it takes after queuing the trunk forward (no read per
draft step stalling every row). Under a grammar the first draft is drawn from the head's masked
distribution (its mask after the committed text, computed between cycles: no host read); later
drafts unmasked (verify masks the target at every position: any q is exact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mtplx.heads.base import DraftHead
from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_block import (
    DraftBlock,
    Outcome,
    Source,
    gather_positions,
    groups_by,
    pad_time,
    padded_uniforms,
)
from mtplx.trunk import rollback
from mtplx.trunk.model import TrunkOutput
from mtplx.trunk.row_cache import SingleRowCache

import mlx.core as mx


def trunk_hidden(output: TrunkOutput, head: DraftHead) -> mx.array:
    return output.hidden_pre_norm if head.hidden_source == "pre_norm" else output.hidden_post_norm


class DraftingRow(Protocol):
    """What the chain reads and resets of a row (`mtplx.spec_decode.rows.BatchRow`)."""

    spec: Any  # a RowSpec: .settings (DecodeSettings) sets the row's draft sampler
    constraint: GrammarConstraint | None  # the row's grammar (its first draft is masked)
    history: list[int]  # prompt + committed tokens (penalties' context)
    pending_hidden: list[mx.array]  # true (hidden [1, n, H], next token) pairs not fed yet
    pending_tokens: list[int]


class HeadChain:
    """The MTP head drafting for every row at once (the module docstring).

    The head's cache rows mirror the batch rows (``cache``: a `BatchCache` or a `SingleRowCache`,
    joined and left with the trunk's). Each cycle it first consumes every row's true (trunk
    hidden, next token) pairs (n_r >= 1 of them, right-padded to the longest), moves each row
    back to its true length (so the chain never attends to padding), then chains depth - 1
    steps, one position per row each, and moves every row back to its true length again.
    ``trunk_cache``: the decoder's trunk cache holder, read by a head that attends to the
    trunk's KV (a Gemma 4 assistant; single-row decoders only).
    """

    source = Source.HEAD

    def __init__(self, head: DraftHead, cache, trunk_cache=None):
        self.head = head
        self.cache = cache
        self.trunk_cache = trunk_cache

    def prefill_observer(self, head_cache: list, prompt_tokens: list[int]):
        """What feeds a prefilling row's own head cache: head position i pairs trunk hidden i with
        token i+1; called with each prefill chunk's output. A head without a cache of its own (a
        Gemma 4 assistant reads the trunk's) has nothing to prefill."""
        head = self.head
        if not head_cache:
            return None

        def observe(output, start: int, end: int) -> None:
            stop = min(end, len(prompt_tokens) - 1)
            if stop > start:
                hidden = trunk_hidden(output, head)[:, : stop - start]
                head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], head_cache)
                mx.eval([c.state for c in head_cache])

        return observe

    def propose(self, rows: Sequence[DraftingRow], keys: Sequence, most: Sequence[int]) -> DraftBlock:
        """Drafts for every row with ``most[r]`` > 0 (that many), in one chain over every row (each
        row's pending true pairs are consumed whether it drafts or not): tokens, q (None when
        every row drafts its argmax), the head's confidences and the draw's validity flag. A
        grammar row's first draft is drawn from the head's masked distribution (its mask after
        the committed text, computed between cycles: no host read); later ones from q."""
        depth = max(most)
        uniforms = [padded_uniforms(row.spec.settings.depth, depth, k.draft) for row, k in zip(rows, keys)]
        masks = [
            row.constraint.mask_after() if row.constraint is not None and n else None
            for row, n in zip(rows, most)
        ]
        first_allowed = None
        if any(m is not None for m in masks):
            free = mx.ones_like(next(m for m in masks if m is not None))
            first_allowed = mx.stack([m if m is not None else free for m in masks])
        tokens, q, invalid, confidence = self.draft(rows, depth, uniforms, first_allowed)
        lengths = list(most)
        return DraftBlock(
            tokens,
            lengths,
            [((Source.HEAD, n),) if n else () for n in lengths],
            q=q,
            confidence=confidence,
            invalid=invalid,
        )

    def commit(self, rows: Sequence[DraftingRow], outcome: Outcome) -> None:
        """Each row's true pairs of this cycle (trunk hidden at the pending token and the accepted
        drafts, with the tokens committed after them) wait for the next proposal."""
        hidden = trunk_hidden(outcome.output, self.head)
        for i, row in enumerate(rows):
            n = outcome.num_accepted[i]
            row.pending_hidden.append(hidden[i : i + 1, : n + 1])
            row.pending_tokens.extend(outcome.committed[i])

    def _head(self, hidden: mx.array, tokens: mx.array, step: int = 0) -> mx.array:
        if self.head.reads_trunk_cache:
            return self.head(
                hidden, tokens, self.cache.layers, step=step, trunk_cache=self.trunk_cache.layers
            )
        return self.head(hidden, tokens, self.cache.layers, step=step)

    def _begin(self, block_len: int) -> Any:
        """In a batch, a block over the head's caches for the next ``block_len`` positions (so caches
        that record a block themselves, Inkling's convolution windows, keep each row's own count at
        `_set_lengths`); None for one row's own caches or a head without any."""
        if block_len < 1 or not self.cache.layers or isinstance(self.cache, SingleRowCache):
            return None
        return self.cache.begin_block(block_len)

    def _set_lengths(self, lengths: list[int], chained: int = 0, block: Any = None) -> None:
        """Every row back to its true length: in a batch by ``lengths`` (rows were padded; a
        ``block`` from `_begin` keeps each row's ``lengths[r]`` minus its length at the block's
        start); one row's own caches (nothing padded) drop the ``chained`` entries the chain made,
        as any cache kind's trim takes them (a DSA head's latent and indexer caches)."""
        if not self.cache.layers:  # a head without a cache of its own keeps nothing to trim
            return
        if isinstance(self.cache, SingleRowCache):
            if chained:
                rollback.trim_kv(self.cache.layers, chained)
            return
        if block is not None:
            self.cache.commit_block(block, [n - b for n, b in zip(lengths, block.lengths_before)])
        elif chained or lengths != self.cache.lengths:
            self.cache.set_lengths(lengths)

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
        draft); draft_uniforms[r] holds row r's uniforms (its spec's
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
        block = self._begin(width)
        head_out = self._head(hidden, tokens)
        self._set_lengths(true_lengths, block=block)
        # A head that reads only the last pair (a Gemma 4 assistant, one row) returns one position.
        last = [min(c, head_out.shape[1]) - 1 for c in counts]
        head_out_last = gather_positions(head_out, last)
        if head.chain_source == "pre_norm":  # each row's own last position (rows are padded)
            chain_in = gather_positions(head.last_pre_norm, last)
        else:  # what the head feeds back (an assistant up-projects it)
            chain_in = head.chain_input(head_out_last)
        head_out = head_out_last
        draft_tokens: list[mx.array] = []
        draft_probs: list[mx.array] = []
        confidence: list[mx.array] = []
        flags: list[mx.array] = []
        any_q = any(not r.spec.settings.greedy_draft for r in rows)
        block = self._begin(depth - 1)  # the chain's entries, dropped after it
        for step in range(depth):
            if step > 0:
                head_out = self._head(chain_in, draft_tokens[-1][:, None], step)
                chain_in = head.chain_input(head_out)
            logits = head.logits(head_out, step=step)[:, -1, :]
            token, q, invalid, sure = draw_drafts(
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
        self._set_lengths(true_lengths, chained=depth - 1, block=block)
        invalid = flags[0]
        for flag in flags[1:]:
            invalid = invalid | flag
        probs = mx.stack(draft_probs, axis=1) if any_q else None
        return mx.stack(draft_tokens, axis=1), probs, invalid, mx.stack(confidence, axis=1)


def draw_drafts(
    rows: Sequence[DraftingRow],
    logits: mx.array,
    earlier: list[mx.array],
    uniforms: list[mx.array],
    allowed: mx.array | None,
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One draft per row from logits [B, V] (masked by ``allowed`` [B, V] after the penalties,
    the target's order), grouped by the rows' `TargetSampler` (`draft`): tokens [B], q [B, V],
    the validity flag, and the drafter's confidence in each draft [B] (q(d) for a sampled draft,
    the plain softmax at d for an argmax draft). ``earlier``: the drafts before this position [B]
    each (the penalties' context); ``uniforms[r]``: row r's uniform [1]. Every model drafter
    draws through this (the head chain, the block drafters)."""
    vocab_size = logits.shape[-1]
    tokens: list[mx.array | None] = [None] * len(rows)
    probs: list[mx.array | None] = [None] * len(rows)
    sure: list[mx.array | None] = [None] * len(rows)
    invalid = mx.array(0, dtype=mx.int32)
    for sampler, index in groups_by(rows, lambda r: r.spec.sampler).items():
        sel = mx.array(index, dtype=mx.int32)
        context = _context(rows, index, earlier) if sampler.cfg.has_penalties else None
        u = mx.concatenate([uniforms[i] for i in index])
        drawn = sampler.draft(logits[sel], context, u, None if allowed is None else allowed[sel])
        group_tokens, group_probs = drawn.tokens, drawn.q
        if group_probs is None:  # argmax drafts: q one-hot, the confidence the drafter's plain softmax
            group_probs = (mx.arange(vocab_size)[None] == group_tokens[:, None]).astype(mx.float32)
            weights = mx.softmax(logits[sel].astype(mx.float32), axis=-1)
        else:
            weights = group_probs
            invalid = invalid | drawn.invalid
        group_sure = mx.take_along_axis(weights, group_tokens[:, None], axis=-1)[:, 0]
        for j, i in enumerate(index):
            tokens[i] = group_tokens[j : j + 1]
            probs[i] = group_probs[j : j + 1]
            sure[i] = group_sure[j : j + 1]
    return mx.concatenate(tokens), mx.concatenate(probs), invalid, mx.concatenate(sure)


def _context(rows: Sequence[DraftingRow], index: Sequence[int], earlier: list[mx.array]) -> mx.array:
    context = sample_ops.left_padded([rows[i].history for i in index])
    if earlier:
        sel = mx.array(list(index), dtype=mx.int32)
        context = mx.concatenate([context, mx.stack(earlier, axis=1)[sel]], axis=1)
    return context
