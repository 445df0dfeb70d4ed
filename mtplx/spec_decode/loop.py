"""The batched decode loop: many sequences, each with its own sampler, seed, drafter and draft
length, verified together in one trunk forward per cycle.

Glossary: a *row* is one sequence (`rows.BatchRow`); rows *join* after their own prefill (`join`)
and *leave* between cycles (`leave`); ``k_r`` is row r's draft length this cycle, K = max k_r.

One cycle (`BatchDecoder.step`), for all rows at once:
  1. draft (`draft_stage.Drafters.draft`): each drafter proposes for the rows that ask it,
     batch-first, and returns its data (`draft_block.DraftBlock`); the blocks are merged per row
     by the row's sources, first match wins (grammar-forced tokens, prompt lookup, a draft model
     or the MTP head chain), each cut to the row's cap (`draft_policy.row_caps`);
  2. one trunk forward over the block [B, K+1] = [pending_r, d_r1..d_rk_r, padding]; padding sits
     after a row's last real position, so causality keeps it out of every row's logits;
  3. verify (`verify_stage`): where a row needs its lazy drafts on the host (a grammar row's
     masks, an adaptive row's cut) one read, taken after the forward is queued; then
     `TargetSampler.verify` (penalties, grammar mask, `rejection.verify`; k = 0 a plain AR step)
     per group of rows sharing (target sampler, k_r, q or point masses);
  4. one host sync for every verdict and validity flag; then caches keep n_r + 1 positions per
     row (`commit_block`) and each drafter follows what its rows committed (`Drafters.commit`:
     the head its true pairs, lookup its block length, a draft model rolls back).

Grammar rows speculate like any other (docs/sampling.md, "Grammar mask": each verified position
masked, any q exact): forced tokens first, a lookup match cut to its legal prefix, else the model
drafter (`draft_stage`); the verify masks read the drafts once per cycle (`verify_stage`).
Adaptive head rows draft their full depth in the chain and are cut after their first unsure
draft by the same read.

Keys split per row per cycle (`block.cycle_keys`): a seeded row with its draft length pinned
draws the same tokens in a batch as alone, up to float rounding of batched matmuls. Where every
row is plain AR the next cycle is queued before the caller reads this one (`_launch_ahead`).

``single_row``: sliding-window and quantized KV caches, heads that read the trunk's KV (Gemma 4
assistants), and every stream decode one row at a time on its own caches (`SingleRowCache`),
through the same drafters (the head chain over the row's own head cache).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mtplx.errors import MtplxError
from mtplx.sample import ops as sample_ops
from mtplx.spec_decode import verify_stage
from mtplx.spec_decode.block import (
    Block,
    Cycle,
    CycleKeys,
    Group,
    Verdicts,
    cycle_keys,
    raise_if_invalid,
    row_positions,
)
from mtplx.spec_decode.block_proposer import drafters_loaded
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_block import Outcome, Source
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.draft_policy import DraftPolicy
from mtplx.spec_decode.draft_stage import Drafters, block_proposer_for
from mtplx.spec_decode.head_chain import HeadChain, trunk_hidden
from mtplx.spec_decode.lookup_proposer import LookupProposer
from mtplx.spec_decode.rows import (
    BatchRow,
    RowsFailed,
    RowSpec,
    TrunkTap,
    check_batch_support,
    fill_holes,
)
from mtplx.spec_decode.step import (
    PromptPrefix,
    Step,
    grammar_step,
    prefill_chunk,
    prefill_last,
    split_key,
    token_logprobs,
)
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.model import Trunk, TrunkOutput
from mtplx.trunk.row_cache import SingleRowCache

import mlx.core as mx

__all__ = ["BatchDecoder", "BatchRow", "RowSpec", "RowsFailed", "TrunkTap"]


class BatchDecoder:
    """Rows decoding together; ``step`` runs one cycle for all of them (the module docstring)."""

    def __init__(
        self, trunk: Trunk, head=None, policy: DraftPolicy | None = None, *, single_row=False, blocks=None
    ):
        """``policy`` chooses each cycle's draft length for rows without a pinned one; None:
        every row drafts its spec's depth (or its lookup match) every cycle.

        ``single_row`` (or a model whose caches do not batch, `check_batch_support`): at most one
        row, on its own caches (`SingleRowCache`, every cache kind rollback supports; the head's
        too): the same cycle and the same drafters, one row at a time. ``head``: an MTP
        head or an EAGLE-3 drafter's; ``blocks``: a block drafter (`block_proposer.BlockDrafter`)."""
        self.single_row = single_row or check_batch_support(trunk, head) is not None
        self.trunk = trunk
        self.head = head
        if self.single_row:
            self.cache: BatchCache | SingleRowCache = SingleRowCache()
            head_cache = SingleRowCache()
        else:
            self.cache = BatchCache(trunk.make_cache(), trunk.model)
            own_layer = getattr(trunk.model, "batch_layer", None)  # the backend's own cache classes
            head_cache = BatchCache(head.make_cache(), own_layer=own_layer) if head is not None else None
        self.chain = HeadChain(head, head_cache, self.cache) if head is not None else None
        self.blocks = block_proposer_for(blocks, trunk) if blocks is not None else None
        self.drafters = Drafters(self.chain, self.blocks)
        self.rows: list[BatchRow] = []
        self._next_id = 0
        self.policy = policy
        self._ahead: Cycle | None = None  # the next all-AR cycle, queued (`_launch_ahead`)
        # Rows joined or left since the last cycle: the next cycle also evaluates the copies that
        # moved them (lazy slice writes into the batch buffers), so it does not calibrate the policy.
        self._rows_moved = False

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ rows join and leave
    def start(
        self,
        prompt_tokens: list[int],
        spec: RowSpec,
        key: mx.array,
        *,
        trunk_cache: list | None = None,
        head_cache: list | None = None,
        prefix: PromptPrefix | None = None,
        draft_length: int | None = None,
        trunk_tap: TrunkTap | None = None,
        constraint: GrammarConstraint | None = None,
        proposer: DraftModelProposer | None = None,
    ) -> BatchRow:
        """A sequence to prefill on its own (`prefill`, chunk by chunk) before it joins (`admit`):
        its row, which it keeps from here to its leave.

        ``trunk_cache`` / ``head_cache`` (single-row, e.g. from the prompt cache) may already hold
        ``prefix.start`` prompt positions. ``draft_length`` pins the head's drafts per cycle.

        ``trunk_tap(output)`` is called with the trunk's output ([1, n, ...], lazy) over each run of
        positions this row commits, in order: every prefill chunk, the last prompt token, then per
        cycle the pending token and the accepted drafts (block positions 0..num_accepted; never a
        rejected draft or padding). So it sees every forwarded position from ``prefix.start`` on
        exactly once: hidden j is the state after reading token j, logits j the distribution token
        j+1 was drawn from. To add no host sync, the tap leaves what it derives lazy or queues it
        (``mx.async_eval``) and reads it back after a later sync; it must not evaluate it at once.

        ``constraint``: the row's grammar (a fresh `GrammarConstraint`). Such a row speculates
        like any other (the module docstring, "Grammar rows"); without drafters it decodes as
        constrained AR. A complete grammar ends the row's tokens (`Step.grammar_done`).
        ``proposer``: a draft model row's own draft model state (its source MODEL, and only it).
        """
        if not drafters_loaded(spec.sources, self.chain, self.blocks):
            raise MtplxError(
                f"batched decoding: no {'/'.join(map(str, spec.sources))} drafter in this decoder"
            )
        if (Source.MODEL in spec.sources) != (proposer is not None):
            raise MtplxError("batched decoding: a draft model row takes its draft model (and only it does)")
        prefix = prefix if prefix is not None else PromptPrefix()
        if not 0 <= prefix.start < len(prompt_tokens):
            raise MtplxError(
                f"batched decoding: cached prefix of {prefix.start} tokens leaves nothing of "
                f"{len(prompt_tokens)} to forward"
            )
        trunk_cache = trunk_cache if trunk_cache is not None else self.trunk.make_cache()
        if self.chain is not None and head_cache is None:
            head_cache = self.head.make_cache()
        return BatchRow(
            list(prompt_tokens),
            spec,
            key,
            trunk_cache,
            head_cache,
            prefix,
            draft_length,
            trunk_tap=trunk_tap,
            constraint=constraint,
            proposer=proposer,
            drafter_cache=self.blocks.row_cache(spec) if self.blocks is not None else None,
        )

    def prefill(self, row: BatchRow, max_tokens: int | None = None) -> bool:
        """Forward up to ``max_tokens`` more prompt tokens (default: the row's prefill step size),
        never the last one; True when only the last is left (the row can `admit`)."""
        step = max_tokens or row.spec.settings.prefill_step_size
        last = len(row.prompt_tokens) - 1
        if row.position < last:
            # A queued batch cycle's rollback records (a hybrid model's recurrent-state and conv
            # taps are armed on the shared layers) would also record this forward: undo it first.
            # A single row's queued AR step arms nothing (and keeps no capture to undo it with).
            if not self.single_row:
                self._drop_ahead()
            end = min(row.position + step, last)
            prefill_chunk(
                self.trunk,
                row.prompt_tokens,
                row.trunk_cache,
                row.position,
                end,
                self._observer(row),
            )
            row.position = end
        return row.position >= last

    def admit(self, row: BatchRow) -> tuple[int, Step]:
        """Forward a prefilled row's last prompt token, draw its first token (one sync) and add it
        to the batch. Returns the row's id and the Step of its first token. In a batch the row's
        own caches are copied into the batch's and the row lets them go (the batch holds its
        positions from here: `extract`); a single row decodes in them."""
        if self.single_row and self.rows:
            raise MtplxError("batched decoding: this model's caches are not batched: one row at a time")
        self._drop_ahead()
        while not self.prefill(row):
            pass
        prompt_tokens, settings, head = row.prompt_tokens, row.spec.settings, self.head
        trunk_cache, head_cache = row.trunk_cache, row.head_cache
        output = prefill_last(self.trunk, prompt_tokens, trunk_cache, self._observer(row), row.prefix)
        key, step_key = split_key(row.key)
        constraint = row.constraint
        mask_mark = constraint.mask_seconds if constraint is not None else 0.0
        allowed = constraint.mask_after() if constraint is not None else None
        uniform = sample_ops.draw_uniforms((1,), step_key)
        first = row.spec.sampler.first_token(output.logits[:, -1, :], [prompt_tokens], uniform, allowed)
        mx.eval(first.tokens, first.invalid, [c.state for c in trunk_cache])
        token = int(first.checked().tokens.item())
        # The grammar takes the token before the row joins: a refusal leaves nothing in the batch.
        tokens, grammar = grammar_step(constraint, [token], mask_mark)
        row.row_id, row.key, row.position = self._next_id, key, len(prompt_tokens)
        row.history.append(token)
        if Source.LOOKUP in row.spec.sources:
            row.lookup = LookupProposer(row.spec.lookup)
        if self.chain is not None:
            row.pending_hidden = [trunk_hidden(output, head)[:, :1]]
            row.pending_tokens = [token]
            self.chain.cache.add_rows([head_cache])
        self.cache.add_rows([trunk_cache])
        if not self.single_row:
            row.trunk_cache = row.head_cache = None
        self.rows.append(row)
        self._next_id += 1
        self._rows_moved = True
        logprobs = None
        if settings.logprobs is not None:
            logprobs = token_logprobs(output.logits[0, -1:], [token], settings.logprobs)
        return row.row_id, Step(tokens, logprobs=logprobs, **grammar)

    def join(self, prompt_tokens: list[int], spec: RowSpec, key: mx.array, **options) -> tuple[int, Step]:
        """`start`, `prefill` and `admit` in one call (the options are `start`'s)."""
        return self.admit(self.start(prompt_tokens, spec, key, **options))

    def _observer(self, row: BatchRow):
        """What sees each prefill forward: the row's trunk tap, the head's own prefill and a block
        drafter's context."""
        head_observer, tap = self._head_observer(row), row.trunk_tap
        block_observer = (
            self.blocks.prefill_observer(row.drafter_cache, row.prompt_tokens) if self.blocks else None
        )
        if tap is None and block_observer is None:
            return head_observer

        def observe(output, start: int, end: int) -> None:
            for seen in (head_observer, block_observer):
                if seen is not None:
                    seen(output, start, end)
            if tap is not None:
                tap(output)

        return observe

    def _head_observer(self, row: BatchRow):
        """The head's own prefill of this row (`HeadChain.prefill_observer`); None without a chain."""
        if self.chain is None:
            return None
        return self.chain.prefill_observer(row.head_cache, row.prompt_tokens)

    def index_of(self, row_id: int) -> int:
        for i, row in enumerate(self.rows):
            if row.row_id == row_id:
                return i
        raise KeyError(f"no row {row_id} in the batch")

    def leave(self, row_ids: Sequence[int]) -> None:
        """Remove rows (finished, stopped, cancelled); their cache memory is freed."""
        gone = {i for i, row in enumerate(self.rows) if row.row_id in set(row_ids)}
        if not gone:
            return
        self._drop_ahead()
        keep = fill_holes(len(self.rows), gone)
        self.rows = [self.rows[i] for i in keep]
        self._rows_moved = True
        self.cache.remove_rows(keep)
        if self.chain is not None:
            self.chain.cache.remove_rows(keep)

    def extract(self, row_id: int) -> tuple[list, list | None, list | None]:
        """A row's trunk and head caches and its block drafter's context (None for a row that does
        not use it) as single-row mlx-lm caches (copies, for the prompt cache).

        The copies are evaluated here: a lazy slice of the batch's buffers keeps the whole
        buffers (every slot, the full capacity) alive for as long as the prompt cache holds the
        row, so each stored request pinned a batch's worth of K/V (measured: a 16-client server
        grew to 21 GB and was killed)."""
        self._drop_ahead()
        i = self.index_of(row_id)
        trunk_cache = self.cache.extract(i)
        head_cache = self.chain.cache.extract(i) if self.chain is not None else None
        mx.eval([c.state for c in trunk_cache + (head_cache or [])])
        blocks = self.blocks
        drafter_cache = None
        if blocks is not None and blocks.source in self.rows[i].spec.sources:
            drafter_cache = blocks.extract(self.rows, i)
        return trunk_cache, head_cache, drafter_cache

    # ------------------------------------------------------------------ one cycle
    def step(self) -> dict[int, Step]:
        """One cycle for every row: {row id: the Step it committed}. Raises RowsFailed (cycle undone).

        draft -> one trunk forward -> verify (grammar rows masked) -> the one sync -> commit."""
        rows = self.rows
        if not rows:
            return {}
        cycle, self._ahead = self._ahead or self._launch(rows), None
        try:
            flags = cycle.block.flags()
            mx.eval(cycle.block.tokens, cycle.verdict_arrays(), [f for f, _ in flags])  # the cycle's one sync
            raise_if_invalid(rows, cycle.groups, flags)
        except BaseException:
            self.cache.abort_block(cycle.capture)
            raise
        verdicts = Verdicts.gather(cycle.groups, len(rows))
        self.cache.commit_block(cycle.capture, [n + 1 for n in verdicts.num_accepted])
        if self.policy is not None and cycle.timed:  # the cycle's cost, up to its one sync and commit
            self.policy.observe_cycle(len(rows), cycle.block.width, time.perf_counter() - cycle.started)
        steps = self._commit(rows, cycle.block, cycle.output, verdicts, cycle.mask_marks)
        self._launch_ahead()
        return steps

    def _launch(self, rows: Sequence[BatchRow]) -> Cycle:
        """Draft, forward and verify, lazily (nothing evaluated but the host reads a row needs)."""
        started = time.perf_counter()
        mask_marks = [row.constraint.mask_seconds if row.constraint is not None else 0.0 for row in rows]
        keys_before = [row.key for row in rows]
        keys = [cycle_keys(row) for row in rows]
        timed, self._rows_moved = not self._rows_moved, False
        block = self.drafters.draft(rows, keys, self.policy, timed)
        capture = self.cache.begin_block(block.width + 1)
        try:
            output = self.trunk(block.tokens, self.cache.layers)
            masks = verify_stage.read_for_verify(rows, block, output)
            groups = self._verify(rows, output.logits, block, masks, keys)
        except BaseException:
            self.cache.abort_block(capture)
            raise
        return Cycle(keys_before, block, capture, output, groups, mask_marks, started, timed)

    def _launch_ahead(self) -> None:
        """Keep single-row speed where no row drafts: every row plain AR (no drafter, no grammar,
        whose mask would need the token just read), the next cycle's forward and draw are queued
        now (`mx.async_eval`), so the caller's work on this cycle's tokens (text, stop strings,
        the wire) overlaps the compute, as a plain AR loop does. A join, a leave or an extract
        first undoes it (`_drop_ahead`), keys included."""
        if not all(not row.spec.speculative and row.constraint is None for row in self.rows):
            return
        self._ahead = self._launch(self.rows)
        mx.async_eval(self._ahead.verdict_arrays())

    def _drop_ahead(self) -> None:
        """Undo a queued cycle: the caches as before it, every row's key as before its split."""
        cycle, self._ahead = self._ahead, None
        if cycle is not None:
            self.cache.abort_block(cycle.capture)
            for row, key in zip(self.rows, cycle.keys_before):
                row.key = key

    def _verify(
        self,
        rows: Sequence[BatchRow],
        target_logits: mx.array,
        block: Block,
        masks: list | None,
        keys: Sequence[CycleKeys],
    ) -> list[Group]:
        """The verify stage's groups (`verify_stage.verify_groups`) over the trunk's vocabulary."""
        return verify_stage.verify_groups(rows, target_logits, block, masks, keys, int(self.trunk.vocab_size))

    def _commit(
        self,
        rows: Sequence[BatchRow],
        block: Block,
        output: TrunkOutput,
        verdicts: Verdicts,
        mask_marks: Sequence[float],
    ) -> dict[int, Step]:
        """Per row, after the sync: its committed tokens, the head's true pairs, lookup's length,
        the acceptance records, the tap, logprobs and the grammar's advance, as its Step."""
        block_rows = block.tokens.tolist()
        committed = [
            block_rows[i][1 : n + 1] + [t]
            for i, (n, t) in enumerate(zip(verdicts.num_accepted, verdicts.next_token))
        ]
        outcome = Outcome(
            output, verdicts.num_accepted, committed, [block.sources(i) for i in range(len(rows))]
        )
        self.drafters.commit(rows, outcome)
        steps: dict[int, Step] = {}
        for i, row in enumerate(rows):
            n, k, kind = verdicts.num_accepted[i], block.lengths[i], block.kind(i)
            row.history.extend(committed[i])
            row.position += n + 1
            if row.trunk_tap is not None:
                row.trunk_tap(row_positions(output, i, n + 1))
            logprobs = None
            if row.spec.settings.logprobs is not None:
                logprobs = token_logprobs(output.logits[i, : n + 1], committed[i], row.spec.settings.logprobs)
            if k and kind in row.acceptance:
                row.acceptance[kind].observe(k, n)
            elif block.offers[i] is not None:
                block.offers[i].acceptance.skip()
            tokens, grammar = grammar_step(row.constraint, committed[i], mask_marks[i])
            steps[row.row_id] = Step(
                tokens,
                k,
                n,
                verdicts.accept_probs[i],
                logprobs,
                tuple((source.value, count) for source, count in outcome.sources[i]),
                grammar_reads=block.grammar_reads[i],
                **grammar,
            )
        return steps
