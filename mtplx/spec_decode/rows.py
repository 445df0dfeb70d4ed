"""One row of the batched loop: how it decodes (`RowSpec`), its state from its start through its
prefill and its cycles in the batch to its leave (`BatchRow`: everything the row owns, so a join
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

__all__ = ["BatchRow", "RowSpec", "RowsFailed", "TrunkTap", "check_batch_support", "fill_holes"]

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
class BatchRow:
    """One sequence from its start to its leave: everything it owns, so a join or a leave touches
    nothing else (`BatchDecoder.start` makes it; ``row_id`` is set when it joins the batch, and its
    batch index is then its position in the decoder's ``rows``).

    One position counter: ``position`` is how many of ``history``'s tokens the row's caches hold.
    While it prefills, ``history`` is the prompt and ``position`` < len(prompt); from its join on,
    ``history`` is the prompt plus every committed token, the last (pending) one not yet forwarded
    (``position`` == len(history) - 1 between cycles). Its caches: ``trunk_cache`` / ``head_cache``
    are its own while it prefills (single-row mlx-lm caches) and, on a single-row decoder, the
    ones it decodes in; in a batch they are copied into the batch's on joining and dropped here
    (`BatchDecoder.admit`), the batch then holding them (`BatchDecoder.extract`)."""

    prompt_tokens: list[int]
    spec: RowSpec
    key: mx.array
    trunk_cache: list | None  # single-row caches holding history[:position] (None once in a batch)
    head_cache: list | None
    prefix: PromptPrefix
    draft_length: int | None = None  # pinned draft length for the head (None: the spec's depth)
    position: int = -1  # tokens forwarded into the caches (set from prefix.start)
    trunk_tap: TrunkTap | None = None
    constraint: GrammarConstraint | None = None  # the row's grammar matcher, at its committed text
    proposer: DraftModelProposer | None = None  # a draft model row's own draft model state
    row_id: int | None = None  # its id in the batch, once it joined
    history: list[int] = field(default_factory=list)  # prompt + committed tokens (the one token list)
    lookup: LookupProposer | None = None
    pending_hidden: list[mx.array] = field(default_factory=list)  # true (hidden [1, n, H], next token) pairs
    pending_tokens: list[int] = field(default_factory=list)  # the head has not consumed yet
    # What the draft policy reads: one record per drafter it offers (head, lookup, grammar).
    acceptance: dict[Source, RowAcceptance] = field(default_factory=drafter_records)
    # A block drafter row (`block_proposer`): its prefilled context cache until it joins the
    # drafter's, and the layer taps of the positions it committed since its last block forward.
    drafter_cache: list | None = None
    drafter_taps: list[tuple[mx.array, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.position < 0:
            self.position = self.prefix.start
        if not self.history:
            self.history = list(self.prompt_tokens)

    @property
    def remaining(self) -> int:
        """Prompt tokens still to forward, the last included (0 once joined)."""
        return max(len(self.prompt_tokens) - self.position, 0)

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
        reason = check_batchable(head.make_cache(), own_layer=getattr(trunk.model, "batch_layer", None))
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
