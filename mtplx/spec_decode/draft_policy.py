"""How far a batched cycle drafts: the draft length that gives the most committed tokens per
second, from the measured cost of a cycle and each row's running acceptance.

Glossary: ``K`` is the cycle's draft length (every drafting row drafts at most K; K = 0 is a
plain batched AR step); a cycle over ``R`` rows forwards the block [R, K+1] whatever each row
drafted (shorter rows are padded, and padding costs what real positions cost), so one K per
cycle is the decision, not one per row.

Cost: `CostProfile` holds the measured seconds of one trunk forward over ``n`` tokens, of
one per-draft drafter forward over ``n`` rows (the head's; without a head, an EAGLE-3 chain
step) and of one block drafter's block forward over ``n`` rows (DFlash, DFlash2, DSpark: one per
drafting cycle whatever K), at a few ``n``; a cycle of R rows at depth K costs
trunk(R (K+1)) + K head(R) + block(R) (the last only when K > 0). On a memory-bound device (one row, a Mac's GPU) extra tokens are
nearly free and drafting pays; as R grows the forward turns compute-bound and each drafted
token costs about what an AR token costs, so drafting pays only where it is accepted often.

Gain: a row that drafts K tokens commits 1 + sum_{j<=K} prod_{i<=j} c_i tokens on average,
c_i its running acceptance at position i given position i-1 was accepted (`RowAcceptance`, with
a prior so that a new row starts from the drafter's typical figure). A row keeps one record per
drafter, since a lookup match (a copy of the row's own text) is kept far more often than a head
draft and a pooled record would cut every match to the head's length. A row offers at most
``most`` drafts (`DraftOffer`: the head's depth, or the lookup match's length), so at K above
that it gains nothing more. Rows that do not draft (drafter "none", lookup rows without a match)
commit 1.

The choice maximizes expected committed tokens / expected cycle seconds over K in 0..max_depth,
so batched AR (K = 0) is the floor: speculation is added only where the model says it pays.
The floor's own cost is measured, not inferred: a row count whose plain AR cycle has not been
timed lately gets one (`DraftPolicy.choose`), since measured cycles are what calibrate the
profile and a K never chosen is never measured. Exactness never depends on any of this (any K is
exact); speed does.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mtplx.spec_decode.settings import MAX_DEPTH
from mtplx.spec_decode.sources import BLOCK_SOURCES, Source

__all__ = [
    "DRAFT_POLICIES",
    "CostProfile",
    "DraftOffer",
    "DraftPolicy",
    "FLOOR_REFRESH_CYCLES",
    "MeasurementStopped",
    "RowAcceptance",
    "drafter_records",
    "measure_cost_profile",
    "row_bucket",
    "row_caps",
]

# "auto": `DraftPolicy` chooses each cycle's draft length; "fixed": every row drafts its depth.
DRAFT_POLICIES = ("auto", "fixed")

# A new row's acceptance per position before it has drafted (the last entry holds for every
# deeper position), weighted as PRIOR_WEIGHT drafted positions, so a row's own record takes over
# after a few cycles. The head: the default head's measured first position (benchmarks/RESULTS.md),
# decaying, as deeper drafts are kept less often. Lookup: measured on the suite's 16 chat turns
# (single-stream lookup, 96 tokens each, 2026-12-04): the first position kept 0.70 greedy / 0.56
# at t 0.7, and once it is, the copy tends to go on (later positions 0.91-0.95 / 0.66-0.88).
PRIOR_ACCEPTANCE = (0.4, 0.35, 0.3)
LOOKUP_PRIOR_ACCEPTANCE = (0.6, 0.8)
# Tokens a grammar forces: where its mask allows only that token, its masked target probability is
# 1 (kept for sure); llguidance's forced tokens are that case, so the prior is near 1 and a row's
# record (an ambiguous tokenization rejected) corrects it.
FORCED_PRIOR_ACCEPTANCE = (0.95,)
# Every cycle with a drafter on offer scales that record by this before it counts the cycle
# (about the last 20 cycles count): acceptance that changes within a response is followed, and
# a record whose drafts were not taken (K = 0) drifts back to its prior, so the row is tried
# again. Without it a few early rejections locked a row out of drafting for good (measured: 33
# cycles in a row at K = 0 on a chat turn at t 0.7, one row, where drafting paid).
ACCEPTANCE_MEMORY = 0.95
PRIOR_WEIGHT = 4.0
# Each measured cycle moves its length's calibration this far towards it (about the last 10
# cycles count), within [1/CALIBRATION_LIMIT, CALIBRATION_LIMIT].
CALIBRATION_RATE = 0.1
CALIBRATION_LIMIT = 4.0
# A row bucket whose drafting cycles ran this many times in a row gets one plain AR cycle, so that
# the floor is measured beside them (about 3% of cycles, each at the floor's own rate). Without it
# the floor of a bucket where drafting was chosen first was never timed: it borrowed the drafting
# cycles' calibration, the profile's shape decided alone, and at 8 rows at t 0.7 the policy kept
# drafting at 0.92x plain batched AR (measured, in process), where a drafting cycle cost 1.5x an AR
# one and the profile said 1.07x. Cycles right after rows join or leave are not timed (they also
# copy the moved rows): the first floor timing at 8 rows was such a cycle, at 2x a steady one.
FLOOR_REFRESH_CYCLES = 32


@dataclass(frozen=True)
class CostProfile:
    """Measured seconds of one forward at a few sizes (interpolated linearly between them,
    extrapolated from the last two beyond)."""

    tokens: tuple[int, ...]  # trunk block sizes measured, ascending
    trunk_seconds: tuple[float, ...]
    head_rows: tuple[int, ...] = ()  # per-draft forward batch sizes measured, ascending (empty: none)
    head_seconds: tuple[float, ...] = ()
    block_rows: tuple[int, ...] = ()  # a block drafter's block forward, per row count (empty: none)
    block_seconds: tuple[float, ...] = ()

    def trunk(self, num_tokens: int) -> float:
        return _interpolate(self.tokens, self.trunk_seconds, num_tokens)

    def head(self, num_rows: int) -> float:
        return _interpolate(self.head_rows, self.head_seconds, num_rows) if self.head_rows else 0.0

    def block(self, num_rows: int) -> float:
        return _interpolate(self.block_rows, self.block_seconds, num_rows) if self.block_rows else 0.0

    def cycle(self, num_rows: int, draft_length: int) -> float:
        """Seconds of a cycle over ``num_rows`` rows drafting ``draft_length`` each."""
        drafting = draft_length * self.head(num_rows) + (self.block(num_rows) if draft_length else 0.0)
        return self.trunk(num_rows * (draft_length + 1)) + drafting

    def as_dict(self) -> dict:
        return {
            "tokens": list(self.tokens),
            "trunk_seconds": list(self.trunk_seconds),
            "head_rows": list(self.head_rows),
            "head_seconds": list(self.head_seconds),
            "block_rows": list(self.block_rows),
            "block_seconds": list(self.block_seconds),
        }

    @classmethod
    def from_dict(cls, data: dict) -> CostProfile | None:
        """The profile saved by `as_dict`, None when ``data`` is not one (a damaged entry)."""
        try:
            profile = cls(
                tuple(int(n) for n in data["tokens"]),
                tuple(float(s) for s in data["trunk_seconds"]),
                tuple(int(n) for n in data.get("head_rows", ())),
                tuple(float(s) for s in data.get("head_seconds", ())),
                tuple(int(n) for n in data.get("block_rows", ())),
                tuple(float(s) for s in data.get("block_seconds", ())),
            )
        except (KeyError, TypeError, ValueError):
            return None
        ok = (
            len(profile.tokens) == len(profile.trunk_seconds) >= 1
            and len(profile.head_rows) == len(profile.head_seconds)
            and list(profile.tokens) == sorted(set(profile.tokens))
            and len(profile.block_rows) == len(profile.block_seconds)
            and list(profile.head_rows) == sorted(set(profile.head_rows))
            and list(profile.block_rows) == sorted(set(profile.block_rows))
            and all(s > 0 for s in (*profile.trunk_seconds, *profile.head_seconds, *profile.block_seconds))
        )
        return profile if ok else None


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]  # one point: proportional
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    value = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(value, min(ys) * 0.5) if x < xs[0] else value


@dataclass
class RowAcceptance:
    """One row's record of one drafter: per position, the cycles that reached it and the accepts
    (both fading by ``ACCEPTANCE_MEMORY`` a cycle)."""

    prior: tuple[float, ...] = PRIOR_ACCEPTANCE
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A cycle that drafted ``num_drafted`` tokens and kept ``num_accepted`` of them."""
        self.skip()
        while len(self.reached) < num_drafted:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for position in range(min(num_accepted + 1, num_drafted)):
            self.reached[position] += 1
            self.accepted[position] += int(position < num_accepted)

    def skip(self) -> None:
        """A cycle that offered this drafter but drafted nothing (K = 0): the record fades."""
        self.reached = [r * ACCEPTANCE_MEMORY for r in self.reached]
        self.accepted = [a * ACCEPTANCE_MEMORY for a in self.accepted]

    def conditional(self, position: int) -> float:
        """P(accept draft ``position`` | the earlier ones were accepted), smoothed by the prior."""
        prior = self.prior[min(position, len(self.prior) - 1)]
        reached = self.reached[position] if position < len(self.reached) else 0
        accepted = self.accepted[position] if position < len(self.accepted) else 0
        return (accepted + prior * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)

    def expected_tokens(self, draft_length: int) -> float:
        """Tokens a cycle drafting ``draft_length`` commits on average (the bonus token included)."""
        total, keep = 1.0, 1.0
        for position in range(draft_length):
            keep *= self.conditional(position)
            total += keep
        return total


def drafter_records() -> dict[str, RowAcceptance]:
    """A new row's records, one per drafter that can offer it drafts."""
    return {
        Source.HEAD: RowAcceptance(),
        Source.LOOKUP: RowAcceptance(LOOKUP_PRIOR_ACCEPTANCE),
        Source.GRAMMAR: RowAcceptance(FORCED_PRIOR_ACCEPTANCE),
        **{source: RowAcceptance() for source in BLOCK_SOURCES},
    }


@dataclass(frozen=True)
class DraftOffer:
    """What one row can draft this cycle: its record for the drafter it would use, and how many
    drafts that drafter has at most (the head's depth, or the lookup match's length)."""

    acceptance: RowAcceptance
    most: int

    def expected_tokens(self, draft_length: int) -> float:
        return self.acceptance.expected_tokens(min(draft_length, self.most))


def row_bucket(num_rows: int) -> int:
    """The power of two at or above ``num_rows``: cycles over similar row counts share a calibration."""
    bucket = 1
    while bucket < num_rows:
        bucket *= 2
    return bucket


@dataclass
class DraftPolicy:
    """Chooses each cycle's draft length (the module docstring).

    The profile times bare forwards of one row; a real cycle adds drafting, verification, the
    ragged attention of many rows over their own contexts, and Python. So each cycle's measured
    seconds calibrate the profile (a running mean of measured / predicted, starting at 1) per
    (row bucket, draft length): ``calibration[(row_bucket(R), K)]``. Keyed by K alone, the ratio
    mixed row counts: K = 0 is chosen when many rows are in (where the ragged attention makes
    every cycle dearer than the one-row profile), K >= 1 when few are, so K = 0 looked dearer
    than it is against K = 1 and the policy kept drafting where batched AR was faster (measured
    at 16 rows: 10-15% of decode time). A length never measured in a bucket takes the mean of
    that bucket's measured lengths, so the comparison falls back to the profile's own shape.
    """

    profile: CostProfile
    calibration: dict[tuple[int, int], float] = field(default_factory=dict)
    floor_refresh: int | None = FLOOR_REFRESH_CYCLES  # None: never time the floor unasked
    floor_age: dict[int, int] = field(default_factory=dict)  # row bucket -> drafting cycles since its AR one

    def calibration_for(self, num_rows: int, draft_length: int) -> float:
        """measured / predicted for cycles like this one (the docstring's fallback when unmeasured)."""
        bucket = row_bucket(num_rows)
        ratio = self.calibration.get((bucket, draft_length))
        if ratio is not None:
            return ratio
        in_bucket = [r for (b, _), r in self.calibration.items() if b == bucket]
        return sum(in_bucket) / len(in_bucket) if in_bucket else 1.0

    def cycle_seconds(self, num_rows: int, draft_length: int) -> float:
        """The predicted seconds of a cycle, calibrated by the cycles measured like it."""
        return self.profile.cycle(num_rows, draft_length) * self.calibration_for(num_rows, draft_length)

    def best_length(self, offers: Sequence[DraftOffer | None]) -> int:
        """K in 0..(the most any row offers) with the most expected tokens per second for a cycle
        over these rows (None: a row that does not draft), by the calibrated profile."""
        num_rows = len(offers)
        max_depth = max((o.most for o in offers if o is not None), default=0)
        best_k, best_rate = 0, num_rows / self.cycle_seconds(num_rows, 0)
        for k in range(1, max_depth + 1):
            tokens = sum(o.expected_tokens(k) if o is not None else 1.0 for o in offers)
            rate = tokens / self.cycle_seconds(num_rows, k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def choose(self, offers: Sequence[DraftOffer | None], *, timed: bool = True) -> int:
        """This cycle's K: `best_length`, except that a row bucket gets a plain AR cycle (K = 0)
        when its floor has not been timed yet or its last FLOOR_REFRESH_CYCLES cycles all drafted
        (the module docstring); ``floor_refresh`` None never does. ``timed`` False: this cycle's
        seconds will not reach `observe_cycle` (rows just joined or left), so it times nothing."""
        best_k = self.best_length(offers)
        if self.floor_refresh is None or not timed:
            return best_k
        bucket = row_bucket(len(offers))
        age = self.floor_age.get(bucket)
        if best_k == 0 or age is None or age >= self.floor_refresh:
            self.floor_age[bucket] = 0
            return 0
        self.floor_age[bucket] = age + 1
        return best_k

    def observe_cycle(self, num_rows: int, draft_length: int, seconds: float) -> None:
        """A cycle of ``num_rows`` rows whose block drafted ``draft_length`` took ``seconds``."""
        ratio = seconds / self.profile.cycle(num_rows, draft_length)
        ratio = min(max(ratio, 1 / CALIBRATION_LIMIT), CALIBRATION_LIMIT)  # one stall must not rule
        key = (row_bucket(num_rows), draft_length)
        before = self.calibration.get(key)
        self.calibration[key] = ratio if before is None else before + CALIBRATION_RATE * (ratio - before)


def measure_cost_profile(
    trunk,
    head=None,
    *,
    max_tokens: int = 128,
    max_rows: int = 32,
    context: int = 64,
    repeats: int = 2,
    blocks=None,
    should_stop: Callable[[], bool] | None = None,
) -> CostProfile:
    """Time one trunk forward over 1, 2, 4, ... ``max_tokens`` tokens and one head forward over
    1, 2, 4, ... ``max_rows`` rows (the best of ``repeats``), after ``context`` tokens of prompt;
    with ``blocks`` (a loaded `block_proposer.BlockDrafter`), its forward over as many rows
    (`block_proposer.time_block_forward`, `eagle3_proposer.time_chain_step`): per draft for
    EAGLE-3 (when there is no head), per cycle for a block drafter.

    ``should_stop`` is asked before every forward: True raises `MeasurementStopped` (a server
    stopping while its worker measures exits at once, not after the whole measurement).

    The trunk block is one row of n tokens: the matmuls cost what R rows of n/R tokens cost,
    and the attention over a short context is a small part of a forward.
    """
    from mtplx.trunk import rollback

    import mlx.core as mx

    def timed(run) -> float:
        return best_of(run, repeats, should_stop)

    sizes = _powers_of_two(max_tokens)
    trunk_seconds = []
    for n in sizes:
        _check_stop(should_stop)
        cache = trunk.make_cache()
        mx.eval(trunk(mx.zeros((1, context), dtype=mx.int32), cache).logits[:, -1])
        block = mx.zeros((1, n), dtype=mx.int32)

        def forward(cache=cache, block=block) -> None:
            capture = rollback.begin_block(cache, block_len=block.shape[1])
            mx.eval(trunk(block, cache).logits)
            rollback.abort_block(cache, capture)

        trunk_seconds.append(timed(forward))
    rows = _powers_of_two(max_rows)
    head_seconds = []
    if head is not None:
        # the trunk state the head reads (a hyper-connection trunk's streams are wider than its embedding)
        state = getattr(trunk(mx.zeros((1, 1), dtype=mx.int32)), f"hidden_{head.hidden_source}")
        for r in rows:
            hidden = mx.zeros((r, 1, state.shape[-1]), dtype=state.dtype)
            tokens = mx.zeros((r, 1), dtype=mx.int32)

            def head_forward(hidden=hidden, tokens=tokens) -> None:
                mx.eval(head.logits(head(hidden, tokens, None)))

            head_seconds.append(timed(head_forward))
    drafter = _drafter_seconds(blocks, trunk, rows, context, timed) if blocks is not None else None
    per_draft, per_cycle = (drafter, None) if drafter is not None and drafter[0] else (None, drafter)
    if per_draft is not None and head is None:
        head_seconds = per_draft[1]
    return CostProfile(
        tuple(sizes),
        tuple(trunk_seconds),
        tuple(rows) if head_seconds else (),
        tuple(head_seconds),
        tuple(rows) if per_cycle is not None else (),
        tuple(per_cycle[1]) if per_cycle is not None else (),
    )


def _drafter_seconds(blocks, trunk, rows, context, timed) -> tuple[bool, list[float]]:
    """(per draft, seconds per row count, each from ``timed``) of a loaded block drafter's
    forward: an EAGLE-3 chain step (per draft), else a block forward (per drafting cycle)."""
    from mtplx.spec_decode.block_proposer import time_block_forward
    from mtplx.spec_decode.eagle3_proposer import time_chain_step

    per_draft = blocks.source is Source.EAGLE3
    timer = time_chain_step if per_draft else time_block_forward
    return per_draft, [timed(timer(blocks, r, context, trunk)) for r in rows]


class MeasurementStopped(Exception):
    """`measure_cost_profile` gave up: its ``should_stop`` said so (nothing was measured)."""


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise MeasurementStopped("batch cost profile: measurement stopped")


def best_of(run, repeats: int, should_stop: Callable[[], bool] | None = None) -> float:
    """The best seconds of ``repeats`` calls of ``run`` after one warm-up call (first-call graph
    and kernel set-up); ``should_stop`` is asked before each call (`MeasurementStopped`)."""
    _check_stop(should_stop)
    run()
    times = []
    for _ in range(repeats):
        _check_stop(should_stop)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def _powers_of_two(limit: int) -> list[int]:
    sizes, n = [], 1
    while n < limit:
        sizes.append(n)
        n *= 2
    return [*sizes, limit]


def row_caps(
    policy: DraftPolicy | None,
    rows: Sequence,
    found: Sequence[int],
    forced: Sequence[int],
    has_chain: bool,
    timed: bool,
    block: tuple[Source, int] | None = None,
) -> tuple[list[int], list[DraftOffer | None]]:
    """Each batch row's most drafts this cycle, whatever proposes them
    (`mtplx.spec_decode.rows.BatchRow`s, the lengths of their lookup matches ``found`` and of their
    grammar-forced tokens ``forced``): a request's own count (``spec.max_drafts``) where it set
    one, else the policy's K for rows without a pinned length (``timed``: this cycle's seconds
    will calibrate it), no cap for pinned rows, draft model rows or without a policy; and what
    each row offered the policy (None: nothing, or no policy; a draft model row offers nothing:
    its drafts are not the policy's). Forced tokens are offered like any drafts (record
    "grammar", kept nearly always), so they widen the block only where the cost model says the
    extra positions pay. ``has_chain``: the head chain drafts; ``block``: the block drafter's
    source and its most drafts (its trained block size, the ceiling of what it offers)."""
    unlimited = MAX_DEPTH + 64
    asked = [r.spec.max_drafts for r in rows]
    if policy is None:
        return [a if a is not None else unlimited for a in asked], [None] * len(rows)
    free = [r.draft_length is None and not r.uses_model for r in rows]
    offers: list[DraftOffer | None] = []
    for row, f, g, is_free in zip(rows, found, forced, free):
        if not is_free:
            offers.append(None)
        elif g:
            offers.append(DraftOffer(row.acceptance[Source.GRAMMAR], g))
        elif f:
            offers.append(DraftOffer(row.acceptance[Source.LOOKUP], f))
        elif block is not None and block[0] in row.spec.sources:
            offers.append(DraftOffer(row.acceptance[block[0]], block[1]))
        elif has_chain and row.uses_head:
            offers.append(DraftOffer(row.acceptance[Source.HEAD], row.head_length))
        else:
            offers.append(None)
    k = policy.choose(offers, timed=timed)
    caps = [k if is_free else unlimited for is_free in free]
    return [a if a is not None else cap for a, cap in zip(asked, caps)], offers
