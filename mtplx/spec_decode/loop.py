"""The batched decode loop: many sequences, each with its own sampler, seed, drafter and draft
length, verified together in one trunk forward per cycle.

Glossary: a *row* is one sequence (`rows.BatchRow`); rows *join* after their own prefill (`join`)
and *leave* between cycles (`leave`); ``k_r`` is row r's draft length this cycle, K = max k_r.

One cycle (`BatchDecoder.step`), for all rows at once:
  1. draft: each drafter proposes for the rows that ask it, batch-first, and returns its data
     (`draft_block.DraftBlock`: tokens, lengths, q, confidence); the loop merges the blocks per
     row by the row's sources (`RowSpec.sources`, resolved per request by `drafting`), first
     match wins: tokens the row's grammar forces (`constraint.ForcedDrafter`), prompt lookup on
     the host (`lookup_proposer.LookupDrafter`), a draft model on the row's own cache
     (`draft_model_proposer.ModelDrafter`) or the MTP head chain, one head forward per depth for
     every row (`head_chain.HeadChain`); each cut to the row's cap (`draft_policy.row_caps`);
  2. one trunk forward over the block [B, K+1] = [pending_r, d_r1..d_rk_r, padding]; padding sits
     after a row's last real position, so causality keeps it out of every row's logits;
  3. verify (`rejection.verify`, k = 0 a plain AR step) per group of rows sharing (sampler, k_r,
     q or point masses): one `SamplerConfig` per call keeps the oracle, the kernel emulation and
     the fused kernels unchanged and exact; a server's rows mostly share a few settings;
  4. one host sync for every verdict and validity flag; then caches keep n_r + 1 positions per
     row (`commit_block`) and each drafter follows what its rows committed (`Drafter.commit`:
     the head its true pairs, lookup its block length, a draft model rolls back).

Grammar rows speculate (docs/sampling.md, "Grammar mask": each verified position masked, any q exact):
  - tokens the grammar forces after the committed text (llguidance's fast-forward tokens) are
    drafted first, as point masses: where the mask allows only that token its masked target
    probability is 1, so verify keeps it (JSON keys, braces, tool-call syntax in one cycle);
  - else a lookup match, cut to its legal prefix (exact for point masses);
  - else the model drafter: the head's first draft from its masked distribution (its mask is
    computed between cycles), later drafts unmasked (an illegal one has p = 0 and is rejected,
    exactly); a draft model's argmax drafts cut to their legal prefix.
    The verify masks need lazy drafts on the host: one extra read per cycle, taken after the
    trunk forward is queued so llguidance computes the masks while it runs (`Step.grammar_reads`).
Adaptive head rows (``adaptive_threshold`` > 0) draft the full depth in the chain; the same read
(the head's confidences) cuts each such row's block after its first unsure draft, without a host
read per draft step stalling every row (a drafter returning ``confidence`` gets the same cut).

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
from mtplx.sample import rejection
from mtplx.spec_decode.block import (
    Block,
    Cycle,
    CycleKeys,
    Group,
    Verdicts,
    adaptive_length,
    cycle_keys,
    group_masks,
    raise_if_invalid,
    row_positions,
)
from mtplx.spec_decode.block_proposer import BlockProposer, drafters_loaded
from mtplx.spec_decode.constraint import ForcedDrafter, GrammarConstraint
from mtplx.spec_decode.draft_block import Outcome, Source, groups_by
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer, ModelDrafter
from mtplx.spec_decode.draft_policy import DraftPolicy, row_caps
from mtplx.spec_decode.head_chain import HeadChain, trunk_hidden
from mtplx.spec_decode.lookup_proposer import LookupDrafter, LookupProposer
from mtplx.spec_decode.rows import (
    BatchRow,
    PendingRow,
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
    sample_last_row,
    split_key,
    token_logprobs,
)
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.model import Trunk, TrunkOutput
from mtplx.trunk.row_cache import SingleRowCache

import mlx.core as mx

__all__ = ["BatchDecoder", "BatchRow", "PendingRow", "RowSpec", "RowsFailed", "TrunkTap"]

# Most grammar-forced tokens looked up per row per cycle (the draft policy then cuts them to its K).
MAX_FORCED = 8
# Most tokens a lookup match offers (its own adaptive block length is at most this).
MAX_LOOKUP = 64


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
            head_cache = BatchCache(head.make_cache()) if head is not None else None
        self.chain = HeadChain(head, head_cache, self.cache) if head is not None else None
        self.blocks = BlockProposer(blocks, trunk) if blocks is not None else None
        self.forced, self.lookup, self.model = ForcedDrafter(), LookupDrafter(), ModelDrafter()
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
    ) -> PendingRow:
        """A sequence to prefill on its own (`prefill`, chunk by chunk) before it joins (`admit`).

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
        return PendingRow(
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

    def prefill(self, pending: PendingRow, max_tokens: int | None = None) -> bool:
        """Forward up to ``max_tokens`` more prompt tokens (default: the row's prefill step size),
        never the last one; True when only the last is left (the row can `admit`)."""
        step = max_tokens or pending.spec.settings.prefill_step_size
        last = len(pending.prompt_tokens) - 1
        if pending.position < last:
            # A queued batch cycle's rollback records (a hybrid model's recurrent-state and conv
            # taps are armed on the shared layers) would also record this forward: undo it first.
            # A single row's queued AR step arms nothing (and keeps no capture to undo it with).
            if not self.single_row:
                self._drop_ahead()
            end = min(pending.position + step, last)
            prefill_chunk(
                self.trunk,
                pending.prompt_tokens,
                pending.trunk_cache,
                pending.position,
                end,
                self._observer(pending),
            )
            pending.position = end
        return pending.position >= last

    def admit(self, pending: PendingRow) -> tuple[int, Step]:
        """Forward a prefilled row's last prompt token, draw its first token (one sync) and add it
        to the batch. Returns the row's id and the Step of its first token."""
        if self.single_row and self.rows:
            raise MtplxError("batched decoding: this model's caches are not batched: one row at a time")
        self._drop_ahead()
        while not self.prefill(pending):
            pass
        prompt_tokens, settings, head = pending.prompt_tokens, pending.spec.settings, self.head
        trunk_cache, head_cache = pending.trunk_cache, pending.head_cache
        output = prefill_last(self.trunk, prompt_tokens, trunk_cache, self._observer(pending), pending.prefix)
        key, step_key = split_key(pending.key)
        constraint = pending.constraint
        mask_mark = constraint.mask_seconds if constraint is not None else 0.0
        allowed = constraint.mask_after() if constraint is not None else None
        first = sample_last_row(output.logits, prompt_tokens, settings, step_key, allowed)
        mx.eval(first.tokens, first.invalid, [c.state for c in trunk_cache])
        token = int(first.checked().tokens.item())
        # The grammar takes the token before the row joins: a refusal leaves nothing in the batch.
        tokens, grammar = grammar_step(constraint, [token], mask_mark)
        spec = pending.spec
        lookup = LookupProposer(spec.lookup) if Source.LOOKUP in spec.sources else None
        row = BatchRow(
            self._next_id,
            spec,
            key,
            [*prompt_tokens, token],
            lookup,
            draft_length=pending.draft_length,
            trunk_tap=pending.trunk_tap,
            constraint=constraint,
            proposer=pending.proposer,
            drafter_cache=pending.drafter_cache,
        )
        if self.chain is not None:
            row.pending_hidden = [trunk_hidden(output, head)[:, :1]]
            row.pending_tokens = [token]
            self.chain.cache.add_rows([head_cache])
        self.cache.add_rows([trunk_cache])
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

    def _observer(self, pending: PendingRow):
        """What sees each prefill forward: the row's trunk tap, the head's own prefill and a block
        drafter's context."""
        head_observer, tap = self._head_observer(pending), pending.trunk_tap
        block_observer = self.blocks.prefill_observer(pending.drafter_cache) if self.blocks else None
        if tap is None and block_observer is None:
            return head_observer

        def observe(output, start: int, end: int) -> None:
            for seen in (head_observer, block_observer):
                if seen is not None:
                    seen(output, start, end)
            if tap is not None:
                tap(output)

        return observe

    def _head_observer(self, pending: PendingRow):
        """The head's own prefill of this row (`HeadChain.prefill_observer`); None without a chain."""
        if self.chain is None:
            return None
        return self.chain.prefill_observer(pending.head_cache, pending.prompt_tokens)

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

    def extract(self, row_id: int) -> tuple[list, list | None]:
        """A row's trunk and head caches as single-row mlx-lm caches (copies, for the prompt cache).

        The copies are evaluated here: a lazy slice of the batch's buffers keeps the whole
        buffers (every slot, the full capacity) alive for as long as the prompt cache holds the
        row, so each stored request pinned a batch's worth of K/V (measured: a 16-client server
        grew to 21 GB and was killed)."""
        self._drop_ahead()
        i = self.index_of(row_id)
        trunk_cache = self.cache.extract(i)
        head_cache = self.chain.cache.extract(i) if self.chain is not None else None
        mx.eval([c.state for c in trunk_cache + (head_cache or [])])
        return trunk_cache, head_cache

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
        block = self._draft(rows, keys, timed)
        capture = self.cache.begin_block(block.width + 1)
        try:
            output = self.trunk(block.tokens, self.cache.layers)
            groups = self._verify(rows, output.logits, block, self._verify_masks(rows, block, output), keys)
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

    # ------------------------------------------------------------------ the cycle's stages
    def _draft(self, rows: Sequence[BatchRow], keys: Sequence[CycleKeys], timed: bool) -> Block:
        """Every row's drafts for this cycle (lazy where a model draws them), merged from the
        drafters' blocks by each row's sources, first match wins: tokens its grammar forces, a
        prompt-lookup match (for a grammar row cut to its legal prefix: exact for point masses),
        then its model drafter (a draft model, continuing a shorter lookup match; or the head
        chain); each cut to the row's cap (`row_caps`: the draft policy's K, or its own count)."""
        forced = self.forced.propose(
            rows,
            keys,
            [MAX_FORCED if row.constraint is not None and row.spec.speculative else 0 for row in rows],
        )
        found = self.lookup.propose(
            rows,
            keys,
            [MAX_LOOKUP if row.lookup is not None and not g else 0 for row, g in zip(rows, forced.lengths)],
        )
        block_offer = None if self.blocks is None else (self.blocks.source, self.blocks.max_drafts)
        caps, offers = row_caps(
            self.policy, rows, found.lengths, forced.lengths, self.chain is not None, timed, block_offer
        )
        for i, (row, cap) in enumerate(zip(rows, caps)):
            for part in (forced, found):
                part.host_tokens[i] = part.host_tokens[i][:cap]
            if row.constraint is not None and found.host_tokens[i]:
                found.host_tokens[i] = found.host_tokens[i][
                    : row.constraint.legal_prefix(found.host_tokens[i])
                ]
            forced.lengths[i], found.lengths[i] = len(forced.host_tokens[i]), len(found.host_tokens[i])
        parts, chosen = (
            [forced, found],
            [0 if g else (1 if f else None) for g, f in zip(forced.lengths, found.lengths)],
        )
        model_rows = [
            int(row.uses_model and not g and f < row.proposer.depth and cap > 0)
            for row, g, f, cap in zip(rows, forced.lengths, found.lengths, caps)
        ]
        if any(model_rows):
            parts.append(self.model.propose(rows, keys, model_rows, found.host_tokens))
            chosen = [len(parts) - 1 if m else c for m, c in zip(model_rows, chosen)]
        block_part = self.blocks.propose_free(rows, keys, chosen, caps) if self.blocks else None
        if block_part is not None:
            parts.append(block_part)
            chosen = [len(parts) - 1 if n else c for n, c in zip(block_part.lengths, chosen)]
        head_rows = [
            min(row.head_length, cap) if row.uses_head and c is None else 0
            for row, c, cap in zip(rows, chosen, caps)
        ]
        if self.chain is not None and any(head_rows):
            parts.append(self.chain.propose(rows, keys, head_rows))
            chosen = [len(parts) - 1 if h else c for h, c in zip(head_rows, chosen)]
        lengths = [
            min(parts[c].lengths[i], cap) if c is not None else 0
            for i, (c, cap) in enumerate(zip(chosen, caps))
        ]
        host = [
            ([] if c is None else parts[c].host_tokens[i] if parts[c].host_tokens else None)
            for i, c in enumerate(chosen)
        ]
        block = Block(parts, chosen, lengths, host, offers)
        block.merge(mx.array([[row.pending] for row in rows], dtype=mx.int32))
        return block

    def _verify_masks(self, rows: Sequence[BatchRow], block: Block, output: TrunkOutput) -> list | None:
        """Each row's grammar masks over its verify positions, bool [k_r + 1, V] (None for a free
        row); None when no row has a grammar. Before them, the cycle's one extra host read where a
        row needs its lazy drafts on the host, taken after the trunk forward is queued (it runs
        meanwhile): a grammar row's drafts, for its masks (`Step.grammar_reads`; point masses cut
        to their legal prefix: an illegal one has p = 0, verify would reject it), and a row's
        drafter confidences where its length policy cuts (the adaptive head: after the first
        draft the head gave less than the row's threshold; the rest forwarded but never
        verified; exact, as the cut reads only the drafts and q)."""
        adaptive = [
            block.part(i) is not None
            and block.part(i).confidence is not None
            and row.spec.settings.adaptive_threshold > 0
            for i, row in enumerate(rows)
        ]
        reads = [
            a or (block.part(i) is not None and block.host_drafts[i] is None and row.constraint is not None)
            for i, (row, a) in enumerate(zip(rows, adaptive))
        ]
        if any(reads):
            mx.async_eval(output.logits)
            confidences = {
                id(p.confidence): p.confidence for i, p in enumerate(block.parts) if p.confidence is not None
            }
            mx.eval(block.drafts, list(confidences.values()))
            on_host = block.drafts.tolist()
            for i, row in enumerate(rows):
                if adaptive[i]:
                    sure = block.part(i).confidence[i, : block.lengths[i]].tolist()
                    block.cut(i, adaptive_length(sure, row.spec.settings.adaptive_threshold))
                if reads[i]:
                    self._read_drafts(block, i, on_host[i], row.constraint)
        if all(row.constraint is None for row in rows):
            return None
        return _grammar_masks(rows, block.host_drafts)

    @staticmethod
    def _read_drafts(block: Block, i: int, on_host: list[int], constraint: GrammarConstraint | None) -> None:
        """Row i's lazy drafts, read: on the host for its grammar's masks, point masses cut to
        their legal prefix (sampled drafts are verified as they are); a drafter's own reads
        (drafting under a mask) count with the row's."""
        part = block.part(i)
        block.host_drafts[i] = on_host[: block.lengths[i]]
        if constraint is None or part is None:
            return
        block.grammar_reads[i] = 1 + part.host_reads[i]
        if part.q is None:
            block.cut(i, constraint.legal_prefix(block.host_drafts[i]))

    def _verify(
        self,
        rows: Sequence[BatchRow],
        target_logits: mx.array,  # [B, K+1, V]
        block: Block,
        masks: list | None,  # per row: bool [k_r + 1, V] or None (`_verify_masks`)
        keys: Sequence[CycleKeys],
    ) -> list[Group]:
        """`rejection.verify` per group of rows sharing (sampler, k_r, q or point masses, backend),
        after each row's penalties and grammar mask (the logit pipeline's order)."""
        groups: list[Group] = []

        def group_key(i: int):
            settings = rows[i].spec.settings
            return settings.sampler, block.lengths[i], block.has_q(i), settings.verify_backend

        for (cfg, k, with_q, backend), index in groups_by(range(len(rows)), group_key).items():
            sel = mx.array(index, dtype=mx.int32)
            logits = target_logits[sel, : k + 1]
            drafts = block.drafts[sel, :k]
            allowed = group_masks(masks, index, k + 1, int(self.trunk.vocab_size))
            logits = sample_ops.constrain_logits(
                logits, cfg, [rows[i].history for i in index], drafts, allowed
            )
            sample_u = mx.concatenate([sample_ops.draw_uniforms((1,), keys[i].sample) for i in index])
            probs = mx.concatenate([block.q(i, k) for i in index]) if with_q and k else None
            accept_u = (  # k = 0: a plain AR step, verify samples row 0
                mx.concatenate([sample_ops.draw_uniforms((1, k), keys[i].accept) for i in index])
                if k
                else mx.zeros((len(index), 0), dtype=mx.float32)
            )
            result = rejection.verify(logits, drafts, probs, cfg, accept_u, sample_u, backend=backend)
            groups.append(
                Group(index, result.num_accepted, result.next_token, result.accept_probs, result.invalid)
            )
        return groups

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
        for drafter in (self.chain, self.lookup, self.model, self.blocks):  # each follows its rows' commits
            if drafter is not None:
                drafter.commit(rows, outcome)
        steps: dict[int, Step] = {}
        for i, row in enumerate(rows):
            n, k, kind = verdicts.num_accepted[i], block.lengths[i], block.kind(i)
            row.history.extend(committed[i])
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


def _grammar_masks(rows: Sequence[BatchRow], host_drafts: Sequence[list[int]]) -> list:
    """Per row, bool [k_r + 1, V]: the grammar's mask at each verify position [pending, d_1..d_k]
    (`GrammarConstraint.block_masks`: after a refused or EOS draft, all allowed); None for a
    free row."""
    return [
        row.constraint.block_masks(drafts) if row.constraint is not None else None
        for row, drafts in zip(rows, host_drafts)
    ]
