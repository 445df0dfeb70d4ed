"""One cycle's data in the batched loop: each row's keys (`CycleKeys`), the block of drafts
(`Block`), verify's result per group of rows (`Group`) and per row on the host (`Verdicts`).

Glossary: B rows; k_r row r's drafts this cycle; K = max k_r (the block is [B, K+1]: the pending
token, the drafts, padding); V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.draft_block import DraftBlock, Source, pad_time
from mtplx.spec_decode.draft_policy import DraftOffer
from mtplx.spec_decode.rows import BatchRow, RowsFailed
from mtplx.spec_decode.step import split_key
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx

__all__ = [
    "Block",
    "Cycle",
    "CycleKeys",
    "Group",
    "Verdicts",
    "adaptive_length",
    "cut_sources",
    "cycle_keys",
    "group_masks",
    "padded_masks",
    "raise_if_invalid",
    "row_positions",
]


@dataclass
class Group:
    index: list[int]  # batch indices of the rows
    num_accepted: mx.array  # [G] int32
    next_token: mx.array  # [G] int32
    accept_probs: mx.array  # [G, k] float32
    invalid: mx.array  # [] int32


@dataclass
class CycleKeys:
    """A row's keys for one cycle, split the same in a batch and alone: (key, draft, accept,
    sample) for a drafting row, (key, step) for a plain AR row (no draft or accept key)."""

    draft: mx.array | None
    accept: mx.array | None
    sample: mx.array


def cycle_keys(row: BatchRow) -> CycleKeys:
    """Advance ``row``'s key by one cycle and return the cycle's keys."""
    if not row.spec.sources:
        row.key, sample_key = split_key(row.key)
        return CycleKeys(None, None, sample_key)
    row.key, draft_key, accept_key, sample_key = mx.random.split(row.key, 4)
    return CycleKeys(draft_key, accept_key, sample_key)


@dataclass
class Block:
    """One cycle's drafts for every row, merged from the drafters' blocks (`DraftBlock`s, the
    drafter contract): row r drafts from ``parts[chosen[r]]`` (None: no drafts), the first
    ``lengths[r]`` = k_r of them; ``width`` = K = max k_r. ``kinds[r]``: the chosen drafter's
    source (its acceptance record); ``sources[r]``: the (source, count) segments verified."""

    parts: list[DraftBlock]
    chosen: list[int | None]
    lengths: list[int]
    host_drafts: list[list[int] | None]  # drafts on the host (lookup, forced; lazy ones once read)
    offers: list[DraftOffer | None]  # what each row offered the draft policy
    width: int = 0
    drafts: mx.array | None = None  # [B, K] int32 (lazy where a model drew them)
    tokens: mx.array | None = None  # [B, K+1]: [pending_r, d_r1..d_rk, padding]
    grammar_reads: list[int] = field(init=False)  # host reads of drafts a row's masks needed

    def __post_init__(self) -> None:
        self.grammar_reads = [0] * len(self.chosen)

    def part(self, i: int) -> DraftBlock | None:
        return self.parts[self.chosen[i]] if self.chosen[i] is not None and self.lengths[i] else None

    def kind(self, i: int) -> Source | None:
        """The source of row i's chosen drafter (the first segment of its block)."""
        part = self.part(i)
        return part.sources[i][0][0] if part is not None else None

    def sources(self, i: int) -> tuple[tuple[Source, int], ...]:
        """Row i's (source, count) segments, cut to its length."""
        part = self.part(i)
        return cut_sources(part.sources[i], self.lengths[i]) if part is not None else ()

    def has_q(self, i: int) -> bool:
        """Whether row i's drafts come with the distribution they were drawn from (else point masses)."""
        part = self.part(i)
        return part is not None and part.q is not None

    def q(self, i: int, k: int) -> mx.array:
        """Row i's q over its k drafts, [1, k, V] (`has_q`)."""
        return self.part(i).q[i : i + 1, :k]

    def flags(self) -> list[tuple[mx.array, list[int]]]:
        """Each part's lazy validity flag with the batch rows it drafted for."""
        return [(p.invalid, p.drafted_rows()) for p in self.parts if p.invalid is not None]

    def merge(self, pending: mx.array) -> None:
        """``drafts`` [B, K] and ``tokens`` [B, K+1] from each row's chosen part (``pending`` [B, 1])."""
        self.width = width = max(self.lengths, default=0)
        only = {c for c in self.chosen}
        if len(only) == 1 and None not in only and all(d is None for d in self.host_drafts):
            part = self.parts[only.pop()]  # every row from one lazy drafter (a stream's head): as it is
            self.drafts = pad_time(part.tokens, width)
            self.tokens = mx.concatenate([pending, self.drafts], axis=1)
            return
        on_host = [
            d if d is not None and self.chosen[i] is not None else [] for i, d in enumerate(self.host_drafts)
        ]
        drafts = mx.array([d[:width] + [0] * (width - len(d[:width])) for d in on_host], dtype=mx.int32)
        drafts = drafts.reshape(len(self.chosen), width)
        for j, part in enumerate(self.parts):
            lazy = [c == j and self.host_drafts[i] is None for i, c in enumerate(self.chosen)]
            if any(lazy) and width:
                drafts = mx.where(mx.array(lazy)[:, None], pad_time(part.tokens, width), drafts)
        self.drafts = drafts
        self.tokens = mx.concatenate([pending, drafts], axis=1)

    def cut(self, i: int, keep: int) -> None:
        """Row i keeps its first ``keep`` drafts (none: no drafter)."""
        self.lengths[i] = min(self.lengths[i], keep)
        if self.host_drafts[i] is not None:
            self.host_drafts[i] = self.host_drafts[i][: self.lengths[i]]
        if not self.lengths[i]:
            self.chosen[i] = None


def cut_sources(sources: tuple[tuple[Source, int], ...], keep: int) -> tuple[tuple[Source, int], ...]:
    """The (source, count) segments of a block's first ``keep`` drafts."""
    out, left = [], keep
    for source, count in sources:
        if left > 0:
            out.append((source, min(count, left)))
        left -= count
    return tuple(out)


@dataclass
class Verdicts:
    """verify's verdict per batch row, on the host after the cycle's sync."""

    num_accepted: list[int]
    next_token: list[int]
    accept_probs: list[list[float]]

    @classmethod
    def gather(cls, groups: Sequence[Group], num_rows: int) -> Verdicts:
        verdicts = cls([0] * num_rows, [0] * num_rows, [[] for _ in range(num_rows)])
        for g in groups:
            for j, (n, t, probs) in enumerate(
                zip(g.num_accepted.tolist(), g.next_token.tolist(), g.accept_probs.tolist())
            ):
                i = g.index[j]
                verdicts.num_accepted[i], verdicts.next_token[i], verdicts.accept_probs[i] = n, t, probs
        return verdicts


def adaptive_length(confidence: Sequence[float], threshold: float) -> int:
    """The drafts an adaptive row keeps: up to and including the first the head gave less than
    ``threshold`` (all of them when ``threshold`` is 0)."""
    if threshold > 0:
        for i, sure in enumerate(confidence[:-1]):
            if sure < threshold:
                return i + 1
    return len(confidence)


def group_masks(masks: list | None, index: Sequence[int], count: int, vocab_size: int) -> mx.array | None:
    """bool [G, count, V]: the grammar masks of the rows ``index`` over ``count`` verify positions
    (all allowed for a free row); None when none of them has a grammar (``masks``: per batch row,
    [k_r + 1, V] or None)."""
    if masks is None or all(masks[i] is None for i in index):
        return None
    free = mx.ones((1, vocab_size), dtype=mx.bool_)
    return mx.stack([padded_masks(masks[i] if masks[i] is not None else free, count) for i in index])


def padded_masks(allowed: mx.array, count: int) -> mx.array:
    """A row's masks [n, V] as exactly ``count`` verify positions (the last repeated past its
    block: padding positions, never verified)."""
    if allowed.shape[0] >= count:
        return allowed[:count]
    return mx.concatenate([allowed, mx.repeat(allowed[-1:], count - allowed.shape[0], axis=0)])


def row_positions(output: TrunkOutput, row: int, count: int) -> TrunkOutput:
    """Row ``row``'s first ``count`` block positions of a cycle's output, as [1, count, ...]."""
    return TrunkOutput(
        output.logits[row : row + 1, :count],
        output.hidden_pre_norm[row : row + 1, :count],
        output.hidden_post_norm[row : row + 1, :count],
        None if output.layer_hidden is None else tuple(t[row : row + 1, :count] for t in output.layer_hidden),
    )


def raise_if_invalid(
    rows: Sequence[BatchRow], groups: list[Group], flags: list[tuple[mx.array, list[int]]]
) -> None:
    """Raise `RowsFailed` naming the rows whose cycle made invalid values (a drafter's draws: the
    rows it drafted for; a verify group's: its rows)."""
    for flag, index in flags:
        try:
            sample_ops.raise_if_invalid(flag)
        except ValueError as err:
            raise RowsFailed([rows[i].row_id for i in index], str(err)) from None
    for g in groups:
        try:
            sample_ops.raise_if_invalid(g.invalid)
        except ValueError as err:
            raise RowsFailed([rows[i].row_id for i in g.index], str(err)) from None


@dataclass
class Cycle:
    """One cycle launched (drafted, forwarded, verified lazily) and not yet synced: the state a
    sync, a commit or an undo needs (`BatchDecoder._launch`)."""

    keys_before: list[mx.array]  # each row's key before this cycle's split (an undo restores them)
    block: Block
    capture: object  # the cache's capture of this block (`BatchCache` / `SingleRowCache.begin_block`)
    output: TrunkOutput
    groups: list[Group]
    mask_marks: list[float]  # each grammar row's mask seconds before the cycle
    started: float  # time.perf_counter() at launch
    timed: bool  # this cycle's seconds calibrate the draft policy

    def verdict_arrays(self) -> list[tuple[mx.array, ...]]:
        return [(g.num_accepted, g.next_token, g.accept_probs, g.invalid) for g in self.groups]
