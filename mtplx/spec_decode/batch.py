"""The batched decode loop: many sequences, each with its own sampler, seed, drafter and draft
length, verified together in one trunk forward per cycle.

Glossary: a *row* is one sequence in the batch (`BatchRow`); rows *join* after their own prefill
(`BatchDecoder.join`) and *leave* between cycles (`leave`). ``k_r`` is row r's draft length this
cycle (0 = a plain AR step in the same forward); K = max k_r.

One cycle (`BatchDecoder.step`), for all rows at once:
  1. each row's drafts: prompt lookup on the host (its own history), or the MTP head chain,
     batched: one head forward per depth for every row (`batch_head.HeadChain`);
  2. one trunk forward over the block [B, K+1] = [pending_r, d_r1..d_rk_r, padding];
     padding sits after a row's last real position, so causality keeps it out of every row's
     logits, and the commit drops it;
  3. verify per group of rows sharing (sampler, k_r, q-or-point-mass): `verify` and `sample`
     take one `SamplerConfig` per call, so grouping keeps the oracle, the kernel emulation and
     the fused kernels unchanged and exact; a server's rows mostly share a few settings, so the
     groups are few. (Vectorised per-row parameters would need every filter's threshold search
     and the kernels' static top-k per row: more code in the hot path for the rare mixed batch);
  4. one host sync for every group's verdict and validity flag; then per row: caches keep
     n_r + 1 positions (`BatchCache.commit_block`), the head its true pairs, lookup adapts.

A row may carry a *grammar* (`start`'s ``constraint``): it then drafts nothing, and its one
sampled position per cycle is masked by the grammar after its committed text (constrained AR; the
mask is computed on the host between cycles, so the cycle keeps its one sync). Speculation under a
grammar (masked head drafts, cut lookup drafts, a mask per draft position) runs single-stream.

A row may carry a *trunk tap* (`start`'s ``trunk_tap``): it sees the trunk's output at every
position the row commits, prompt included, and nothing else (forge records its training data
through it). Unset, it costs nothing.

Per-row randomness follows the single-row loops (`mtplx.spec_decode.loop`) key for key: a
speculative row splits its key into (key, draft, accept, sample) every cycle and draws uniforms
of the same shapes, an AR row splits (key, step). A seeded row with its draft length pinned
therefore draws the same tokens in a batch as alone, up to float rounding of batched matmuls.

Not batched (refused by `check_batch_support` / the engine): sliding-window and quantized KV
caches, heads that read the trunk's KV (Gemma 4 assistants), a separate draft model, and the
adaptive gate (its per-draft host read would stall every row).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mtplx.errors import MtplxError
from mtplx.sample import ops as sample_ops
from mtplx.sample import rejection
from mtplx.spec_decode.batch_head import HeadChain, groups_by, left_padded, pad_time, padded_uniforms
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_policy import DraftOffer, DraftPolicy, RowAcceptance, drafter_records
from mtplx.spec_decode.head_proposer import trunk_hidden
from mtplx.spec_decode.lookup_proposer import LookupProposer
from mtplx.spec_decode.loop import (
    PromptPrefix,
    Step,
    _grammar_step,
    _sample_last_row,
    _split_key,
    _token_logprobs,
    prefill_chunk,
    prefill_last,
)
from mtplx.spec_decode.proposer import CycleOutcome
from mtplx.spec_decode.settings import MAX_DEPTH, DecodeSettings, LookupConfig
from mtplx.trunk.batch_cache import BatchCache, check_batchable
from mtplx.trunk.model import Trunk, TrunkOutput

import mlx.core as mx

__all__ = ["BATCH_DRAFTERS", "BatchDecoder", "BatchRow", "PendingRow", "RowSpec", "RowsFailed", "TrunkTap"]

# Sees a row's trunk output [1, n, ...] (lazy) at n positions it commits (`BatchDecoder.start`).
TrunkTap = Callable[[TrunkOutput], None]

BATCH_DRAFTERS = ("none", "lookup", "head", "auto")  # "auto": lookup where the text recurs, else the head


@dataclass(frozen=True)
class RowSpec:
    """How one row decodes: its settings (sampler, depth = most drafts per cycle, greedy drafts,
    logprobs, verify backend), its drafter and its lookup matcher."""

    settings: DecodeSettings
    drafter: str = "auto"
    lookup: LookupConfig = field(default_factory=LookupConfig)


@dataclass
class PendingRow:
    """A sequence prefilling on its own before it joins the batch (`BatchDecoder.start`)."""

    prompt_tokens: list[int]
    spec: RowSpec
    key: mx.array
    trunk_cache: list  # single-row mlx-lm caches, holding prompt_tokens[:position]
    head_cache: list | None
    prefix: PromptPrefix
    draft_length: int | None = None
    position: int = -1  # prompt tokens forwarded so far (set from prefix.start)
    trunk_tap: TrunkTap | None = None
    constraint: GrammarConstraint | None = None  # the row's grammar (it then decodes without drafts)

    def __post_init__(self) -> None:
        if self.position < 0:
            self.position = self.prefix.start

    @property
    def remaining(self) -> int:
        """Prompt tokens still to forward, the last included."""
        return len(self.prompt_tokens) - self.position


@dataclass
class BatchRow:
    """Everything one sequence owns in the batch; the batch index is its position in ``rows``."""

    row_id: int
    spec: RowSpec
    key: mx.array
    history: list[int]  # prompt + committed tokens; the last (pending) one is not yet forwarded
    lookup: LookupProposer | None
    pending_hidden: list[mx.array] = field(default_factory=list)  # true (hidden [1, n, H], next token) pairs
    pending_tokens: list[int] = field(default_factory=list)  # the head has not consumed yet
    draft_length: int | None = None  # pinned draft length for the head (None: the spec's depth)
    # What the draft policy reads: one record per drafter ("head", "lookup").
    acceptance: dict[str, RowAcceptance] = field(default_factory=drafter_records)
    trunk_tap: TrunkTap | None = None
    constraint: GrammarConstraint | None = None  # the row's grammar matcher, at its committed text

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def uses_head(self) -> bool:
        return self.spec.drafter in ("head", "auto")


def check_batch_support(trunk: Trunk, head=None) -> str | None:
    """None if this trunk (and head) decode in a batch, else why not (one line)."""
    reason = check_batchable(trunk.make_cache(), trunk.model)
    if reason is None and head is not None and head.reads_trunk_cache:
        reason = f"a {head.layout} head reads the target's KV cache and is not batched"
    if reason is None and head is not None:
        reason = check_batchable(head.make_cache())
        reason = None if reason is None else f"head {reason}"
    return reason


class RowsFailed(Exception):
    """A cycle found invalid values (NaN logits, drafts outside the vocabulary) in some rows: a
    fault of the model or its weights, not of the request (so not an `MtplxError`).

    The cycle was undone for every row; the caller removes ``row_ids`` and steps again."""

    def __init__(self, row_ids: list[int], message: str):
        super().__init__(message)
        self.row_ids = row_ids


@dataclass
class _Group:
    index: list[int]  # batch indices of the rows
    num_accepted: mx.array  # [G] int32
    next_token: mx.array  # [G] int32
    accept_probs: mx.array  # [G, k] float32
    invalid: mx.array  # [] int32


def fill_holes(num_rows: int, gone: set[int]) -> list[int]:
    """The rows that stay, as ``remove_rows`` takes them: a staying row keeps its index where that
    index survives, and the last staying rows move into the holes the leavers left, so the caches
    copy one row per leaver rather than every row after the first hole (rows are not in join order)."""
    num_keep = num_rows - len(gone)
    movers = iter(i for i in range(num_keep, num_rows) if i not in gone)
    return [next(movers) if i in gone else i for i in range(num_keep)]


class BatchDecoder:
    """Rows decoding together; ``step`` runs one cycle for all of them (the module docstring)."""

    def __init__(self, trunk: Trunk, head=None, policy: DraftPolicy | None = None):
        """``policy`` chooses each cycle's draft length for rows without a pinned one; None:
        every row drafts its spec's depth (or its lookup match) every cycle."""
        reason = check_batch_support(trunk, head)
        if reason is not None:
            raise MtplxError(f"batched decoding: {reason}")
        self.trunk = trunk
        self.head = head
        self.cache = BatchCache(trunk.make_cache(), trunk.model)
        self.chain = HeadChain(head, head.make_cache()) if head is not None else None
        self.rows: list[BatchRow] = []
        self._next_id = 0
        self.policy = policy
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

        ``constraint``: the row's grammar (a fresh `GrammarConstraint`). Such a row drafts nothing
        (drafter "none"): each cycle its one sampled position is masked by the grammar after its
        committed text, a mask the host computes between cycles, so the cycle keeps its one sync
        (constrained AR, exact as `loop.ar_decode` with the same constraint). A complete grammar
        ends the row's tokens (`Step.grammar_done`).
        """
        if spec.drafter not in BATCH_DRAFTERS:
            raise MtplxError(
                f"batched decoding: drafter must be one of {', '.join(BATCH_DRAFTERS)} (got {spec.drafter!r})"
            )
        if spec.drafter == "head" and self.head is None:
            raise MtplxError("batched decoding: drafter 'head' needs an MTP head")
        if constraint is not None and spec.drafter != "none":
            raise MtplxError("batched decoding: a grammar-constrained row drafts nothing (drafter 'none')")
        prefix = prefix if prefix is not None else PromptPrefix()
        if not 0 <= prefix.start < len(prompt_tokens):
            raise MtplxError(
                f"batched decoding: cached prefix of {prefix.start} tokens leaves nothing of "
                f"{len(prompt_tokens)} to forward"
            )
        trunk_cache = trunk_cache if trunk_cache is not None else self.trunk.make_cache()
        if self.head is not None and head_cache is None:
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
        )

    def prefill(self, pending: PendingRow, max_tokens: int | None = None) -> bool:
        """Forward up to ``max_tokens`` more prompt tokens (default: the row's prefill step size),
        never the last one; True when only the last is left (the row can `admit`)."""
        step = max_tokens or pending.spec.settings.prefill_step_size
        last = len(pending.prompt_tokens) - 1
        if pending.position < last:
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
        while not self.prefill(pending):
            pass
        prompt_tokens, settings, head = pending.prompt_tokens, pending.spec.settings, self.head
        trunk_cache, head_cache = pending.trunk_cache, pending.head_cache
        output = prefill_last(self.trunk, prompt_tokens, trunk_cache, self._observer(pending), pending.prefix)
        key, step_key = _split_key(pending.key)
        constraint = pending.constraint
        mask_mark = constraint.mask_seconds if constraint is not None else 0.0
        allowed = constraint.mask_after() if constraint is not None else None
        first = _sample_last_row(output.logits, prompt_tokens, settings, step_key, allowed)
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
        )
        if head is not None:
            row.pending_hidden = [trunk_hidden(output, head)[:, :1]]
            row.pending_tokens = [token]
            self.chain.cache.add_rows([head_cache])
        self.cache.add_rows([trunk_cache])
        self.rows.append(row)
        self._next_id += 1
        self._rows_moved = True
        logprobs = None
        if settings.logprobs is not None:
            logprobs = _token_logprobs(output.logits[0, -1:], [token], settings.logprobs)
        tokens, grammar = _grammar_step(constraint, [token], mask_mark)
        return row.row_id, Step(tokens, logprobs=logprobs, **grammar)

    def join(self, prompt_tokens: list[int], spec: RowSpec, key: mx.array, **options) -> tuple[int, Step]:
        """`start`, `prefill` and `admit` in one call (the options are `start`'s)."""
        return self.admit(self.start(prompt_tokens, spec, key, **options))

    def _observer(self, pending: PendingRow):
        """What sees each prefill forward: the row's trunk tap, and the head's own prefill."""
        head_observer, tap = self._head_observer(pending), pending.trunk_tap
        if tap is None:
            return head_observer

        def observe(output, start: int, end: int) -> None:
            if head_observer is not None:
                head_observer(output, start, end)
            tap(output)

        return observe

    def _head_observer(self, pending: PendingRow):
        """The head's own prefill: head position i pairs trunk hidden i with token i+1 (as
        HeadProposer.observe_prefill); None without a head."""
        head, head_cache, prompt_tokens = self.head, pending.head_cache, pending.prompt_tokens
        if head is None:
            return None

        def observe(output, start: int, end: int) -> None:
            stop = min(end, len(prompt_tokens) - 1)
            if stop > start:
                hidden = trunk_hidden(output, head)[:, : stop - start]
                head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], head_cache)
                mx.eval([c.state for c in head_cache])

        return observe

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
        i = self.index_of(row_id)
        trunk_cache = self.cache.extract(i)
        head_cache = self.chain.cache.extract(i) if self.chain is not None else None
        mx.eval([c.state for c in trunk_cache + (head_cache or [])])
        return trunk_cache, head_cache

    # ------------------------------------------------------------------ one cycle
    def _head_length(self, row: BatchRow) -> int:
        return row.draft_length if row.draft_length is not None else row.spec.settings.depth

    def _draft_caps(
        self, rows: Sequence[BatchRow], found: Sequence[list[int]], timed: bool
    ) -> tuple[list[int], list[DraftOffer | None]]:
        """Each row's most drafts this cycle: the policy's K for rows without a pinned length
        (`DraftPolicy`; ``timed``: this cycle's seconds will calibrate it), no cap for pinned rows
        or without a policy; and what each row offered the policy (None: nothing, or no policy)."""
        unlimited = [MAX_DEPTH + 64] * len(rows)
        if self.policy is None:
            return unlimited, [None] * len(rows)
        free = [r.draft_length is None for r in rows]
        offers: list[DraftOffer | None] = []
        for row, f, is_free in zip(rows, found, free):
            if is_free and f:
                offers.append(DraftOffer(row.acceptance["lookup"], len(f)))
            elif is_free and self.chain is not None and row.uses_head:
                offers.append(DraftOffer(row.acceptance["head"], self._head_length(row)))
            else:
                offers.append(None)
        k = self.policy.choose(offers, timed=timed)
        return [k if is_free else cap for is_free, cap in zip(free, unlimited)], offers

    def step(self) -> dict[int, Step]:
        """One cycle for every row: {row id: the Step it committed}. Raises RowsFailed (cycle undone)."""
        rows = self.rows
        if not rows:
            return {}
        started = time.perf_counter()
        draft_keys: list[mx.array | None] = []
        accept_keys: list[mx.array | None] = []
        sample_keys: list[mx.array] = []
        for row in rows:
            if row.spec.drafter == "none":
                row.key, sample_key = _split_key(row.key)
                draft_keys.append(None)
                accept_keys.append(None)
            else:
                row.key, draft_key, accept_key, sample_key = mx.random.split(row.key, 4)
                draft_keys.append(draft_key)
                accept_keys.append(accept_key)
            sample_keys.append(sample_key)

        # 1. Drafts: lookup on the host, then the head chain for the rows without a match.
        found = [row.lookup.find(row.history) if row.lookup is not None else [] for row in rows]
        timed, self._rows_moved = not self._rows_moved, False
        caps, offers = self._draft_caps(rows, found, timed)
        found = [f[:cap] for f, cap in zip(found, caps)]
        use_head = [
            self.chain is not None and row.uses_head and not f and cap > 0
            for row, f, cap in zip(rows, found, caps)
        ]
        lengths = [
            len(f) if f else (min(self._head_length(row), cap) if h else 0)
            for row, f, h, cap in zip(rows, found, use_head, caps)
        ]
        width = max(lengths)
        host_drafts = [f + [0] * (width - len(f)) for f in found]
        draft_tokens = mx.array(host_drafts, dtype=mx.int32).reshape(len(rows), width)
        head_probs = None
        flags: list[mx.array] = []
        if any(use_head):
            depth = max(n for n, h in zip(lengths, use_head) if h)
            uniforms = [
                padded_uniforms(row.spec.settings.depth, depth, key) for row, key in zip(rows, draft_keys)
            ]
            head_tokens, head_probs, head_invalid = self.chain.draft(rows, depth, uniforms)
            flags.append(head_invalid)
            head_tokens = pad_time(head_tokens, width)
            head_mask = mx.array(use_head)[:, None]
            draft_tokens = mx.where(head_mask, head_tokens, draft_tokens)
        pending = mx.array([[row.pending] for row in rows], dtype=mx.int32)
        block = mx.concatenate([pending, draft_tokens], axis=1)

        # 2. One trunk forward; 3. verify per group; 4. one sync.
        mask_marks = [row.constraint.mask_seconds if row.constraint is not None else 0.0 for row in rows]
        capture = self.cache.begin_block(width + 1)
        try:
            output = self.trunk(block, self.cache.layers)
            groups = self._verify(
                rows, output.logits, draft_tokens, head_probs, lengths, use_head, accept_keys, sample_keys
            )
            mx.eval(block, [(g.num_accepted, g.next_token, g.accept_probs, g.invalid) for g in groups], flags)
            self._raise_if_invalid(rows, groups, flags)
        except BaseException:
            self.cache.abort_block(capture)
            raise
        num_accepted = [0] * len(rows)
        next_token = [0] * len(rows)
        accept_probs: list[list[float]] = [[] for _ in rows]
        for g in groups:
            for j, (n, t, probs) in enumerate(
                zip(g.num_accepted.tolist(), g.next_token.tolist(), g.accept_probs.tolist())
            ):
                i = g.index[j]
                num_accepted[i], next_token[i], accept_probs[i] = n, t, probs
        self.cache.commit_block(capture, [n + 1 for n in num_accepted])
        if self.policy is not None and timed:  # the cycle's cost, up to its one sync and commit
            self.policy.observe_cycle(len(rows), width, time.perf_counter() - started)

        block_rows = block.tolist()
        hidden = trunk_hidden(output, self.head) if self.head is not None else None
        steps: dict[int, Step] = {}
        for i, row in enumerate(rows):
            n, k = num_accepted[i], lengths[i]
            committed = block_rows[i][1 : n + 1] + [next_token[i]]
            drafter = "head" if use_head[i] else "lookup"
            source = () if k == 0 else ((drafter, k),)
            if hidden is not None:
                row.pending_hidden.append(hidden[i : i + 1, : n + 1])
                row.pending_tokens.extend(committed)
            if row.lookup is not None and k:
                row.lookup.commit(CycleOutcome(output, n, committed, _SourceOnly(source)))
            row.history.extend(committed)
            if row.trunk_tap is not None:
                row.trunk_tap(_positions(output, i, n + 1))
            logprobs = None
            if row.spec.settings.logprobs is not None:
                logprobs = _token_logprobs(output.logits[i, : n + 1], committed, row.spec.settings.logprobs)
            if k:
                row.acceptance[drafter].observe(k, n)
            elif offers[i] is not None:
                offers[i].acceptance.skip()
            committed, grammar = _grammar_step(row.constraint, committed, mask_marks[i])
            steps[row.row_id] = Step(committed, k, n, accept_probs[i], logprobs, source, **grammar)
        return steps

    def _verify(
        self,
        rows: Sequence[BatchRow],
        target_logits: mx.array,  # [B, K+1, V]
        draft_tokens: mx.array,  # [B, K]
        head_probs: mx.array | None,  # [B, D, V], D <= K
        lengths: list[int],
        use_head: list[bool],
        accept_keys: list[mx.array | None],
        sample_keys: list[mx.array],
    ) -> list[_Group]:
        groups: list[_Group] = []

        def group_key(i: int):
            settings = rows[i].spec.settings
            return settings.sampler, lengths[i], use_head[i], settings.verify_backend

        for (cfg, k, with_q, backend), index in groups_by(range(len(rows)), group_key).items():
            sel = mx.array(index, dtype=mx.int32)
            logits = target_logits[sel, : k + 1]
            drafts = draft_tokens[sel, :k]
            if cfg.has_penalties:
                context = left_padded([rows[i].history for i in index])
                logits = sample_ops.penalize_logits(logits, context, cfg, drafts)
            sample_u = mx.concatenate([sample_ops.draw_uniforms((1,), sample_keys[i]) for i in index])
            if k == 0:
                drawn = sample_ops.sample(
                    sample_ops.mask_logits(logits[:, 0, :], _grammar_masks([rows[i] for i in index])),
                    cfg,
                    sample_u,
                    backend=backend,
                )
                zeros = mx.zeros((len(index),), dtype=mx.int32)
                groups.append(_Group(index, zeros, drawn.tokens, mx.zeros((len(index), 0)), drawn.invalid))
                continue
            probs = head_probs[sel, :k] if with_q and head_probs is not None else None
            accept_u = mx.concatenate([sample_ops.draw_uniforms((1, k), accept_keys[i]) for i in index])
            result = rejection.verify(logits, drafts, probs, cfg, accept_u, sample_u, backend=backend)
            groups.append(
                _Group(index, result.num_accepted, result.next_token, result.accept_probs, result.invalid)
            )
        return groups

    @staticmethod
    def _raise_if_invalid(rows: Sequence[BatchRow], groups: list[_Group], flags: list[mx.array]) -> None:
        if any(int(f.item()) for f in flags):  # the head's draws: not attributable to one group
            try:
                for f in flags:
                    sample_ops.raise_if_invalid(f)
            except ValueError as err:
                raise RowsFailed([r.row_id for r in rows if r.uses_head], str(err)) from None
        for g in groups:
            try:
                sample_ops.raise_if_invalid(g.invalid)
            except ValueError as err:
                raise RowsFailed([rows[i].row_id for i in g.index], str(err)) from None


def _grammar_masks(rows: Sequence[BatchRow]) -> mx.array | None:
    """bool [G, V]: each row's grammar mask after its committed text (all allowed for a free row);
    None when no row has a grammar. Constrained rows draft nothing, so this is their only position."""
    masks = [row.constraint.mask_after() if row.constraint is not None else None for row in rows]
    if all(m is None for m in masks):
        return None
    vocab = next(m for m in masks if m is not None).shape[-1]
    return mx.stack([m if m is not None else mx.ones((vocab,), dtype=mx.bool_) for m in masks])


def _positions(output: TrunkOutput, row: int, count: int) -> TrunkOutput:
    """Row ``row``'s first ``count`` block positions of a cycle's output, as [1, count, ...]."""
    return TrunkOutput(
        output.logits[row : row + 1, :count],
        output.hidden_pre_norm[row : row + 1, :count],
        output.hidden_post_norm[row : row + 1, :count],
    )


@dataclass
class _SourceOnly:
    """The part of a Draft that LookupProposer.commit reads (its source segments)."""

    sources: tuple[tuple[str, int], ...]
