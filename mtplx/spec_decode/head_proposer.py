"""The MTP head as a drafter: a chain of head steps on its own output hidden state, batch-first
(`HeadChain`: every row of the batch at once, one head forward per depth) and on one row's own
cache (`HeadProposer`: a single-row decoder's row, where the head may read the trunk's KV).

Shapes (`HeadChain`): B rows; ``n_r`` true (trunk hidden, next token) pairs row r has not fed
the head yet; ``depth`` drafts per row this cycle; V the vocabulary.

Cycle (docs/ARCHITECTURE.md): the head first consumes the true (trunk hidden i,
token i+1) pairs it has not seen yet, drafts d_1 from the last of them, then
chains: step i reads its previous output and d_i. The entries made from drafted
(not true) hidden states are dropped at commit and the committed positions are
re-fed from the trunk's true hidden states at the next proposal, so the head's
cache always equals the one a from-scratch run builds. Cycles the head did not
draft for (prompt lookup) only add true pairs.

Adaptive length: with ``adaptive_threshold`` > 0 drafting stops after a draft the
head gave less than that probability (one host read per draft step, so it is
off by default). ``depth`` stays the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from mtplx.heads.base import DraftHead
from mtplx.sample import ops as sample_ops
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.block import Block, CycleKeys, gather_positions, groups_by, pad_time, padded_uniforms
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.proposer import (
    CycleOutcome,
    Draft,
    draw_draft_token,
    masked_draft_logits,
    stacked_draft,
)
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx


def trunk_hidden(output: TrunkOutput, head: DraftHead) -> mx.array:
    return output.hidden_pre_norm if head.hidden_source == "pre_norm" else output.hidden_post_norm


class HeadProposer:
    name = "head"

    def __init__(self, head: DraftHead, settings: DecodeSettings, cache: list | None = None):
        """The head drafting as ``settings`` say: sampler, depth, greedy drafts, adaptive threshold,
        verify backend. ``cache``: the request's head cache (from the prompt cache), else a fresh one."""
        self.head = head
        self.settings = settings
        self.depth = settings.depth
        self.cache = cache if cache is not None else head.make_cache()
        # True (hidden, next token) pairs the head has not consumed; the last one drafts d_1.
        self._pending_hidden: list[mx.array] = []
        self._pending_tokens: list[int] = []
        self._chained = 0  # head entries made from drafted states this cycle (dropped at commit)

    def observe_prefill(self, output: TrunkOutput, start: int, end: int, prompt_tokens: list[int]) -> None:
        # Head position i pairs trunk hidden i with token i+1; the last prompt
        # position pairs with the first generated token, at the first commit.
        # A head without a cache of its own (a Gemma 4 assistant reads the trunk's) has nothing to prefill.
        stop = min(end, len(prompt_tokens) - 1)
        if stop > start and self.cache:
            hidden = trunk_hidden(output, self.head)[:, : stop - start]
            self.head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], self.cache)
            mx.eval([c.state for c in self.cache])

    def propose(
        self,
        history: list[int],
        key: mx.array,
        trunk_cache: list,
        constraint: GrammarConstraint | None = None,
    ) -> Draft:
        """Up to ``depth`` drafts. Under a grammar each is drawn from the head's masked distribution
        (the mask after the drafts before it: one host read per draft step beyond the first), and
        drafting stops after an EOS draft (nothing after it is emitted)."""
        cfg = self.settings.sampler
        uniforms = sample_ops.draw_uniforms((self.depth,), key)
        hidden_in = mx.concatenate(self._pending_hidden, axis=1)
        tokens_in = mx.array(self._pending_tokens)[None]
        self._pending_hidden, self._pending_tokens = [], []
        head_out = self.head(hidden_in, tokens_in, self.cache, trunk_cache=trunk_cache)[:, -1:]
        context = mx.array(history, dtype=mx.int32)[None] if cfg.has_penalties else None
        tokens: list[mx.array] = []
        probs: list[mx.array | None] = []
        flags: list[mx.array | None] = []
        drafted: list[int] = []  # the drafts on the host, under a grammar
        for i in range(self.depth):
            if i > 0 and constraint is not None:
                drafted.append(int(tokens[-1].item()))  # the next mask depends on this draft
                if drafted[-1] in constraint.eos:
                    break
            if i > 0:
                head_out = self.head(
                    self.head.chain_input(head_out),
                    tokens[-1].reshape(1, 1),
                    self.cache,
                    step=i,
                    trunk_cache=trunk_cache,
                )
            logits = self.head.logits(head_out, step=i)[:, -1, :]
            if context is not None and tokens:
                context = mx.concatenate([context, tokens[-1][None]], axis=1)
            allowed = constraint.mask_after(drafted) if constraint is not None else None
            token, q, invalid = draw_draft_token(logits, context, self.settings, uniforms[i : i + 1], allowed)
            tokens.append(token)
            probs.append(q)
            flags.append(invalid)
            if self.settings.adaptive_threshold > 0 and i + 1 < self.depth and self._unsure(logits, token, q):
                break
        self._chained = len(tokens) - 1
        draft = stacked_draft(tokens, probs, flags, self.name)
        draft.host_reads = len(drafted)
        return draft

    def _unsure(self, logits: mx.array, token: mx.array, q: mx.array | None) -> bool:
        """Whether the head gave its draft less than the threshold (a host read).

        q is the sampled-from distribution; for argmax drafts (or greedy requests, where
        q is one-hot) the head's plain softmax says how sure it was."""
        if q is None or self.settings.sampler.is_greedy:
            q = mx.softmax(logits.astype(mx.float32), axis=-1)
        return float(q[0, token[0]].item()) < self.settings.adaptive_threshold

    def commit(self, outcome: CycleOutcome) -> None:
        if self._chained:
            cache_ops.trim_kv(self.cache, self._chained)
        self._chained = 0
        kept = outcome.num_accepted + 1
        self._pending_hidden.append(trunk_hidden(outcome.output, self.head)[:, :kept])
        self._pending_tokens.extend(outcome.committed)


class DraftingRow(Protocol):
    """What the chain reads and resets of a row (`mtplx.spec_decode.rows.BatchRow`)."""

    spec: Any  # a RowSpec: .settings (DecodeSettings) sets the row's draft sampler
    constraint: GrammarConstraint | None  # the row's grammar (its first draft is masked)
    history: list[int]  # prompt + committed tokens (penalties' context)
    pending_hidden: list[mx.array]  # true (hidden [1, n, H], next token) pairs not fed yet
    pending_tokens: list[int]


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

    def propose(self, rows: Sequence[DraftingRow], keys: Sequence[CycleKeys], block: Block) -> None:
        """Draft for every row of ``block`` whose kind is "head" (its length each), in one chain:
        those rows take its tokens and q (``block.drafts``, ``block.head_probs``), every row its
        confidences (the adaptive gate's). A grammar row's first draft is drawn from the head's
        masked distribution (its mask after the committed text, computed between cycles: no
        host read); its later drafts from q (verify masks them, exactly)."""
        use_head = [kind == "head" for kind in block.kinds]
        depth = max(n for n, h in zip(block.lengths, use_head) if h)
        uniforms = [padded_uniforms(row.spec.settings.depth, depth, k.draft) for row, k in zip(rows, keys)]
        first_allowed = None
        masks = [
            row.constraint.mask_after() if row.constraint is not None and h else None
            for row, h in zip(rows, use_head)
        ]
        if any(m is not None for m in masks):
            free = mx.ones_like(next(m for m in masks if m is not None))
            first_allowed = mx.stack([m if m is not None else free for m in masks])
        head_tokens, block.head_probs, head_invalid, block.confidence = self.draft(
            rows, depth, uniforms, first_allowed
        )
        block.flags.append(head_invalid)
        block.drafts = mx.where(mx.array(use_head)[:, None], pad_time(head_tokens, block.width), block.drafts)

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


def _draft_key(settings: DecodeSettings) -> tuple[SamplerConfig, bool, str]:
    # A greedy request's head draft is its argmax either way (q one-hot).
    return settings.sampler, settings.greedy_draft or settings.sampler.is_greedy, settings.verify_backend
