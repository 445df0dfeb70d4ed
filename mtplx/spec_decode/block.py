"""One cycle's data in the batched loop: each row's keys (`CycleKeys`), the block of drafts
(`Block`), verify's result per group of rows (`Group`) and per row on the host (`Verdicts`).

Glossary: B rows; k_r row r's drafts this cycle; K = max k_r (the block is [B, K+1]: the pending
token, the drafts, padding); V the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.draft_policy import DraftOffer
from mtplx.spec_decode.proposer import Draft, cut_draft
from mtplx.spec_decode.rows import BatchRow, RowsFailed
from mtplx.spec_decode.step import split_key
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx

__all__ = [
    "Block",
    "Cycle",
    "CycleKeys",
    "Group",
    "SourceOnly",
    "Verdicts",
    "adaptive_length",
    "gather_positions",
    "groups_by",
    "pad_time",
    "padded_uniforms",
    "cut_to_legal",
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
    """A row's keys for one cycle, split as the single-row loops split theirs: (key, draft, accept,
    sample) for a drafting row, (key, step) for a plain AR row (no draft or accept key)."""

    draft: mx.array | None
    accept: mx.array | None
    sample: mx.array


def cycle_keys(row: BatchRow) -> CycleKeys:
    """Advance ``row``'s key by one cycle and return the cycle's keys."""
    if row.spec.drafter == "none":
        row.key, sample_key = split_key(row.key)
        return CycleKeys(None, None, sample_key)
    row.key, draft_key, accept_key, sample_key = mx.random.split(row.key, 4)
    return CycleKeys(draft_key, accept_key, sample_key)


@dataclass
class Block:
    """One cycle's drafts for every row. ``kinds[r]``: "head", "lookup", "grammar" (forced tokens)
    or "" (no drafts); ``lengths[r]`` = k_r; ``width`` = K = max k_r."""

    kinds: list[str]
    lengths: list[int]
    host_drafts: list[list[int]]  # drafts known on the host (lookup, forced; head ones once read)
    offers: list[DraftOffer | None]  # what each row offered the draft policy
    width: int
    drafts: mx.array  # [B, K] int32 (lazy where the head drew them)
    tokens: mx.array | None = None  # [B, K+1]: [pending_r, d_r1..d_rk, padding]
    head_probs: mx.array | None = None  # [B, D, V] q of the head's drafts, D <= K (None: argmax drafts)
    confidence: mx.array | None = None  # [B, D] the head's confidence in each draft (adaptive rows)
    flags: list[mx.array] = field(default_factory=list)  # the head's lazy validity flags
    row_drafts: list[Draft | None] = field(default_factory=list)  # drafter "proposer" rows' own Drafts
    grammar_reads: list[int] = field(init=False)  # host reads of drafts a row's masks needed

    def __post_init__(self) -> None:
        self.grammar_reads = [0] * len(self.kinds)

    def has_q(self, i: int) -> bool:
        """Whether row i's drafts come with the distribution they were drawn from (else point masses)."""
        if self.kinds[i] == "head":
            return self.head_probs is not None
        return self.kinds[i] == "proposer" and self.row_drafts[i].probs is not None

    def q(self, i: int, k: int) -> mx.array:
        """Row i's q over its k drafts, [1, k, V] (`has_q`)."""
        if self.kinds[i] == "head":
            return self.head_probs[i : i + 1, :k]
        return self.row_drafts[i].probs[:, :k]


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
    )


@dataclass
class SourceOnly:
    """The part of a Draft that LookupProposer.commit reads (its source segments)."""

    sources: tuple[tuple[str, int], ...]


def cut_to_legal(block: Block, i: int, constraint) -> None:
    """Row i's own proposer's drafts under its grammar (``constraint``), read to the host: point
    masses cut to their legal prefix (exact: an illegal point mass has p = 0, verify would reject
    it and sample p itself); sampled drafts are verified as they are. The proposer's own reads (a
    head masking each draft) count with the row's."""
    draft = block.row_drafts[i]
    block.grammar_reads[i] += draft.host_reads
    if draft.probs is None:
        legal = constraint.legal_prefix(block.host_drafts[i])
        block.row_drafts[i] = cut_draft(draft, legal)
        block.host_drafts[i] = block.host_drafts[i][:legal]
        block.lengths[i] = legal
        if block.row_drafts[i] is None:
            block.kinds[i] = ""


def raise_if_invalid(rows: Sequence[BatchRow], groups: list[Group], flags: list[mx.array]) -> None:
    """Raise `RowsFailed` naming the rows whose cycle made invalid values (the head's draws: every
    head row; a verify group's: its rows)."""
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


# ------------------------------------------------------------------ array helpers
def gather_positions(x: mx.array, index: Sequence[int]) -> mx.array:
    """x[r, index[r]] for each row: [B, T, ...] -> [B, 1, ...]."""
    idx = mx.array(list(index), dtype=mx.int32).reshape(-1, 1, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, idx, axis=1)


def pad_time(x: mx.array, width: int) -> mx.array:
    if x.shape[1] == width:
        return x
    return mx.concatenate([x, mx.zeros((x.shape[0], width - x.shape[1], *x.shape[2:]), x.dtype)], axis=1)


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
