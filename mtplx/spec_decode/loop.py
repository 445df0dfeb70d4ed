"""The batched decode loop: many sequences, each with its own sampler, seed, drafter and draft
length, verified together in one trunk forward per cycle.

Glossary: a *row* is one sequence (`rows.BatchRow`); rows *join* after their own prefill (`join`)
and *leave* between cycles (`leave`); ``k_r`` is row r's draft length this cycle, K = max k_r.

One cycle (`BatchDecoder.step`), for all rows at once:
  1. draft: tokens a row's grammar forces, prompt lookup on the host (its own history), the MTP
     head chain batched (one head forward per depth for every row, `head_proposer.HeadChain`), or a
     row's own proposer (drafter "proposer": a draft model, or any drafter on a single-row decoder);
  2. one trunk forward over the block [B, K+1] = [pending_r, d_r1..d_rk_r, padding]; padding sits
     after a row's last real position, so causality keeps it out of every row's logits;
  3. verify (`rejection.verify`, k = 0 a plain AR step) per group of rows sharing (sampler, k_r,
     q or point masses): one `SamplerConfig` per call keeps the oracle, the kernel emulation and
     the fused kernels unchanged and exact; a server's rows mostly share a few settings;
  4. one host sync for every verdict and validity flag; then per row: caches keep n_r + 1
     positions (`commit_block`), the head its true pairs, proposers roll back.

Grammar rows speculate (docs/sampling.md, "Grammar mask": each verified position masked, any q exact):
  - tokens the grammar forces after the committed text (llguidance's fast-forward tokens) are
    drafted first, as point masses: where the mask allows only that token its masked target
    probability is 1, so verify keeps it (JSON keys, braces, tool-call syntax in one cycle);
  - else a lookup match, cut to its legal prefix (exact for point masses);
  - else the head chain: the first draft from the head's masked distribution (its mask is computed
    between cycles), later drafts unmasked (an illegal one has p = 0 and is rejected, exactly).
    The verify masks need the drafts on the host: one extra read per cycle, taken after the trunk
    forward is queued so llguidance computes the masks while it runs (`Step.grammar_reads`).
Adaptive head rows (``adaptive_threshold`` > 0) draft the full depth in the chain; the same read
(the head's confidences) cuts each such row's block after its first unsure draft: the drafts
`HeadProposer` stops at, without a host read per draft step stalling every row.

Keys split per row per cycle (`block.cycle_keys`): a seeded row with its draft length pinned
draws the same tokens in a batch as alone, up to float rounding of batched matmuls. Where every
row is plain AR the next cycle is queued before the caller reads this one (`_launch_ahead`).

``single_row``: sliding-window and quantized KV caches, heads that read the trunk's KV (Gemma 4
assistants), and every stream decode one row at a time on its own caches (`SingleRowCache`).
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
    SourceOnly,
    Verdicts,
    adaptive_length,
    cut_to_legal,
    cycle_keys,
    group_masks,
    groups_by,
    pad_time,
    raise_if_invalid,
    row_positions,
)
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_policy import DraftPolicy, row_caps
from mtplx.spec_decode.head_proposer import HeadChain, trunk_hidden
from mtplx.spec_decode.lookup_proposer import LookupProposer
from mtplx.spec_decode.proposer import CycleOutcome, Proposer
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

__all__ = ["BATCH_DRAFTERS", "BatchDecoder", "BatchRow", "PendingRow", "RowSpec", "RowsFailed", "TrunkTap"]

# "auto": lookup where it matches, else the head; "proposer": the row's own (`drafting.batch_drafter`).
BATCH_DRAFTERS = ("none", "lookup", "head", "auto", "proposer")
# Most grammar-forced tokens looked up per row per cycle (the draft policy then cuts them to its K).
MAX_FORCED = 8


class BatchDecoder:
    """Rows decoding together; ``step`` runs one cycle for all of them (the module docstring)."""

    def __init__(
        self, trunk: Trunk, head=None, policy: DraftPolicy | None = None, *, single_row: bool = False
    ):
        """``policy`` chooses each cycle's draft length for rows without a pinned one; None:
        every row drafts its spec's depth (or its lookup match) every cycle.

        ``single_row`` (or a model whose caches do not batch, `check_batch_support`): at most one
        row, on its own caches (`SingleRowCache`, every cache kind rollback supports), drafting
        with its own proposer (drafter "proposer") or lookup: the same cycle, one row at a time."""
        self.single_row = single_row or check_batch_support(trunk, head) is not None
        self.trunk = trunk
        self.head = head
        if self.single_row:
            self.cache: BatchCache | SingleRowCache = SingleRowCache()
            self.chain = None
        else:
            self.cache = BatchCache(trunk.make_cache(), trunk.model)
            self.chain = HeadChain(head, head.make_cache()) if head is not None else None
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
        proposer: Proposer | None = None,
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
        like any other (the module docstring, "Grammar rows"); with drafter "none" it decodes as
        constrained AR. A complete grammar ends the row's tokens (`Step.grammar_done`).
        """
        if spec.drafter not in BATCH_DRAFTERS:
            raise MtplxError(
                f"batched decoding: drafter must be one of {', '.join(BATCH_DRAFTERS)} (got {spec.drafter!r})"
            )
        if spec.drafter in ("head", "auto") and self.chain is None:
            raise MtplxError(
                f"batched decoding: drafter {spec.drafter!r} needs an MTP head on a decoder that batches rows"
            )
        if (spec.drafter == "proposer") != (proposer is not None):
            raise MtplxError(
                "batched decoding: drafter 'proposer' takes the row's proposer (and only it does)"
            )
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
        spec = pending.spec
        lookup = LookupProposer(spec.lookup) if spec.drafter in ("lookup", "auto") else None
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
        )
        if row.proposer is not None:  # as the single-row loop tells its proposer the first token
            row.proposer.commit(CycleOutcome(output, 0, [token], None))
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
        tokens, grammar = grammar_step(constraint, [token], mask_mark)
        return row.row_id, Step(tokens, logprobs=logprobs, **grammar)

    def join(self, prompt_tokens: list[int], spec: RowSpec, key: mx.array, **options) -> tuple[int, Step]:
        """`start`, `prefill` and `admit` in one call (the options are `start`'s)."""
        return self.admit(self.start(prompt_tokens, spec, key, **options))

    def _observer(self, pending: PendingRow):
        """What sees each prefill forward: the row's trunk tap, and the head's own prefill."""
        head_observer, tap, proposer = self._head_observer(pending), pending.trunk_tap, pending.proposer
        if tap is None and proposer is None:
            return head_observer

        def observe(output, start: int, end: int) -> None:
            if head_observer is not None:
                head_observer(output, start, end)
            if proposer is not None:
                proposer.observe_prefill(output, start, end, pending.prompt_tokens)
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
            mx.eval(cycle.block.tokens, cycle.verdict_arrays(), cycle.block.flags)  # the cycle's one sync
            raise_if_invalid(rows, cycle.groups, cycle.block.flags)
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
        if not all(row.spec.drafter == "none" and row.constraint is None for row in self.rows):
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
        """Every row's drafts for this cycle (lazy where the head draws them).

        Per row, first match wins: tokens its grammar forces (point masses), a prompt-lookup match
        (for a grammar row cut to its legal prefix: exact for point masses), else the head chain up
        to its length; each cut to the row's cap (the draft policy's K, `row_caps`)."""
        forced = [
            row.constraint.forced_tokens(MAX_FORCED)
            if row.constraint is not None and row.spec.drafter != "none"
            else []
            for row in rows
        ]
        found = [
            row.lookup.find(row.history) if row.lookup is not None and not g else []
            for row, g in zip(rows, forced)
        ]
        caps, offers = row_caps(self.policy, rows, found, forced, self.chain is not None, timed)
        forced = [g[:cap] for g, cap in zip(forced, caps)]
        found = [f[:cap] for f, cap in zip(found, caps)]
        found = [
            f[: row.constraint.legal_prefix(f)] if row.constraint is not None and f else f
            for row, f in zip(rows, found)
        ]
        kinds, host_drafts, lengths, row_drafts = [], [], [], [None] * len(rows)
        for i, (row, g, f, cap) in enumerate(zip(rows, forced, found, caps)):
            if g or f:
                kinds.append("grammar" if g else "lookup")
                host_drafts.append(g or f)
                lengths.append(len(g or f))
            elif row.proposer is not None:  # its own drafts, lazy (a draft model's chain)
                row_drafts[i] = row.proposer.propose(
                    row.history, keys[i].draft, self.cache.layers, constraint=row.constraint
                )
                kinds.append("proposer" if row_drafts[i] is not None else "")
                host_drafts.append([])
                lengths.append(row_drafts[i].num_tokens if row_drafts[i] is not None else 0)
            elif self.chain is not None and row.uses_head and cap > 0:
                kinds.append("head")
                host_drafts.append([])
                lengths.append(min(row.head_length, cap))
            else:
                kinds.append("")
                host_drafts.append([])
                lengths.append(0)
        width = max(lengths)
        draft_tokens = mx.array([d + [0] * (width - len(d)) for d in host_drafts], dtype=mx.int32)
        draft_tokens = draft_tokens.reshape(len(rows), width)
        if any(d is not None for d in row_drafts):
            draft_tokens = mx.concatenate(
                [
                    pad_time(d.tokens, width) if d is not None else draft_tokens[i : i + 1]
                    for i, d in enumerate(row_drafts)
                ]
            )
        block = Block(kinds, lengths, host_drafts, offers, width, draft_tokens, row_drafts=row_drafts)
        if "head" in kinds:
            self.chain.propose(rows, keys, block)
        pending = mx.array([[row.pending] for row in rows], dtype=mx.int32)
        block.tokens = mx.concatenate([pending, block.drafts], axis=1)
        return block

    def _verify_masks(self, rows: Sequence[BatchRow], block: Block, output: TrunkOutput) -> list | None:
        """Each row's grammar masks over its verify positions, bool [k_r + 1, V] (None for a free
        row); None when no row has a grammar. Before them, the cycle's one extra host read where a
        row needs its head drafts on the host, taken after the trunk forward is queued (it runs
        meanwhile): a grammar row's drafts, for its masks (`Step.grammar_reads`), and an adaptive
        row's confidences, which cut its block after the first draft the head gave less than the
        row's threshold (`HeadProposer`'s early stop, taken after the chain: the same drafts, the
        rest forwarded but never verified; exact, as the cut reads only the drafts and q)."""
        adaptive = [
            kind == "head" and row.spec.settings.adaptive_threshold > 0
            for row, kind in zip(rows, block.kinds)
        ]
        reads = [
            a or (kind in ("head", "proposer") and row.constraint is not None)
            for row, kind, a in zip(rows, block.kinds, adaptive)
        ]
        if any(reads):
            mx.async_eval(output.logits)
            on_host = block.drafts.tolist()
            confidence = block.confidence.tolist() if any(adaptive) else None
            for i, row in enumerate(rows):
                if adaptive[i]:
                    block.lengths[i] = adaptive_length(
                        confidence[i][: block.lengths[i]], row.spec.settings.adaptive_threshold
                    )
                if reads[i]:
                    block.host_drafts[i] = on_host[i][: block.lengths[i]]
                    block.grammar_reads[i] = int(row.constraint is not None)
                if reads[i] and block.kinds[i] == "proposer":
                    cut_to_legal(block, i, row.constraint)
        if all(row.constraint is None for row in rows):
            return None
        return _grammar_masks(rows, block.host_drafts)

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
            invalid = result.invalid
            for i in index:  # a row proposer's draw flags (the head's are the chain's, `block.flags`)
                draft = block.row_drafts[i]
                if draft is not None and draft.invalid is not None:
                    invalid = invalid | draft.invalid
            groups.append(Group(index, result.num_accepted, result.next_token, result.accept_probs, invalid))
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
        hidden = trunk_hidden(output, self.head) if self.chain is not None else None
        steps: dict[int, Step] = {}
        for i, row in enumerate(rows):
            n, k, kind = verdicts.num_accepted[i], block.lengths[i], block.kinds[i]
            committed = block_rows[i][1 : n + 1] + [verdicts.next_token[i]]
            draft = block.row_drafts[i]
            source = () if k == 0 else (draft.sources if draft is not None else ((kind, k),))
            if hidden is not None:
                row.pending_hidden.append(hidden[i : i + 1, : n + 1])
                row.pending_tokens.extend(committed)
            if row.lookup is not None and k:
                row.lookup.commit(CycleOutcome(output, n, committed, SourceOnly(source)))
            if row.proposer is not None:  # rolls its own state back (a draft model's cache)
                row.proposer.commit(CycleOutcome(row_positions(output, i, k + 1), n, committed, draft))
            row.history.extend(committed)
            if row.trunk_tap is not None:
                row.trunk_tap(row_positions(output, i, n + 1))
            logprobs = None
            if row.spec.settings.logprobs is not None:
                logprobs = token_logprobs(output.logits[i, : n + 1], committed, row.spec.settings.logprobs)
            if k and kind in row.acceptance:
                row.acceptance[kind].observe(k, n)
            elif block.offers[i] is not None:
                block.offers[i].acceptance.skip()
            committed, grammar = grammar_step(row.constraint, committed, mask_marks[i])
            steps[row.row_id] = Step(
                committed,
                k,
                n,
                verdicts.accept_probs[i],
                logprobs,
                source,
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
