"""One row of the batched loop: how it decodes (`RowSpec`), its state while it prefills alone
(`PendingRow`) and once it decodes in the batch (`BatchRow`: everything the row owns, so a join
or a leave touches nothing else), and what ends rows (`RowsFailed`, `fill_holes`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mtplx.sample.target import TargetSampler, target_sampler
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.draft_policy import RowAcceptance, drafter_records
from mtplx.spec_decode.lookup_proposer import LookupProposer
from mtplx.spec_decode.settings import DecodeSettings, LookupConfig
from mtplx.spec_decode.sources import Source
from mtplx.spec_decode.step import PromptPrefix
from mtplx.trunk.batch_cache import check_batchable
from mtplx.trunk.model import Trunk, TrunkOutput

import mlx.core as mx

__all__ = ["BatchRow", "PendingRow", "RowSpec", "RowsFailed", "TrunkTap", "check_batch_support", "fill_holes"]

# Sees a row's trunk output [1, n, ...] (lazy) at n positions it commits (`BatchDecoder.start`).
TrunkTap = Callable[[TrunkOutput], None]


@dataclass(frozen=True)
class RowSpec:
    """How one row decodes: its settings (sampler, depth = the head's drafts per cycle, greedy
    drafts, logprobs, verify backend), its drafters in priority order (`Source`s; none: plain AR;
    `drafting.RowDrafting.sources` resolves them per request), its lookup matcher, and
    ``max_drafts``: the most drafts per cycle whatever proposes them (a request's pinned count)."""

    settings: DecodeSettings
    sources: tuple[Source, ...] = ()
    lookup: LookupConfig = field(default_factory=LookupConfig)
    max_drafts: int | None = None

    @property
    def speculative(self) -> bool:
        return bool(self.sources)

    @property
    def sampler(self) -> TargetSampler:
        """The row's target sampler (its sampler, verify backend and draft rule; one shared object
        per configuration): the first token, the drafters' draws and verify go through it."""
        s = self.settings
        return target_sampler(s.sampler, s.verify_backend, s.greedy_draft)


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
    constraint: GrammarConstraint | None = None  # the row's grammar
    proposer: DraftModelProposer | None = None  # a draft model row's own draft model state
    drafter_cache: list | None = None  # a block drafter row's own context cache while it prefills

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
    # What the draft policy reads: one record per drafter it offers (head, lookup, grammar).
    acceptance: dict[Source, RowAcceptance] = field(default_factory=drafter_records)
    trunk_tap: TrunkTap | None = None
    constraint: GrammarConstraint | None = None  # the row's grammar matcher, at its committed text
    proposer: DraftModelProposer | None = None  # a draft model row's own draft model state
    # A block drafter row (`block_proposer`): its prefilled context cache until it joins the
    # drafter's, and the layer taps of the positions it committed since its last block forward.
    drafter_cache: list | None = None
    drafter_taps: list[tuple[mx.array, ...]] = field(default_factory=list)

    @property
    def pending(self) -> int:
        return self.history[-1]

    @property
    def head_length(self) -> int:
        """The head's drafts per cycle for this row: its pinned length, else its spec's depth."""
        return self.draft_length if self.draft_length is not None else self.spec.settings.depth

    @property
    def uses_head(self) -> bool:
        return Source.HEAD in self.spec.sources

    @property
    def uses_model(self) -> bool:
        return Source.MODEL in self.spec.sources


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


def fill_holes(num_rows: int, gone: set[int]) -> list[int]:
    """The rows that stay, as ``remove_rows`` takes them: a staying row keeps its index where that
    index survives, and the last staying rows move into the holes the leavers left, so the caches
    copy one row per leaver rather than every row after the first hole (rows are not in join order)."""
    num_keep = num_rows - len(gone)
    movers = iter(i for i in range(num_keep, num_rows) if i not in gone)
    return [next(movers) if i in gone else i for i in range(num_keep)]
