"""The cycle's draft stage (`mtplx.spec_decode.loop.BatchDecoder`, step 1): the drafters
(`Drafters`), each batch-first, returning its data (`draft_block.DraftBlock`: tokens, lengths, q,
confidence), merged per row into the cycle's `block.Block` by the row's sources (`RowSpec.sources`,
resolved per request by `drafting`), first match wins:

  - tokens the row's grammar forces after the committed text (`constraint.ForcedDrafter`,
    llguidance's fast-forward tokens), as point masses: where the mask allows only that token its
    masked target probability is 1, so verify keeps it (JSON keys, braces, tool-call syntax);
  - a prompt-lookup match on the host (`lookup_proposer.LookupDrafter`), for a grammar row cut to
    its legal prefix (exact for point masses);
  - a draft model on the row's own cache (`draft_model_proposer.ModelDrafter`, continuing a
    shorter lookup match), a block drafter (`block_proposer.BlockProposer`: DFlash, DFlash2,
    DSpark, one block forward for all its rows; `eagle3_proposer.Eagle3Proposer`: EAGLE-3's
    chain on its own cache, rolled back after drafting), or the MTP head chain, one head forward per depth for every row
    (`head_chain.HeadChain`; under a grammar its first draft from its masked distribution);

each cut to the row's cap (`draft_policy.row_caps`: the draft policy's K, or its own count).
After the cycle's sync each drafter follows what its rows committed (`Drafters.commit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.spec_decode.block import Block, CycleKeys
from mtplx.spec_decode.block_proposer import BlockDrafter, BlockProposer
from mtplx.spec_decode.constraint import ForcedDrafter
from mtplx.spec_decode.draft_block import DraftBlock, Outcome
from mtplx.spec_decode.draft_model_proposer import ModelDrafter
from mtplx.spec_decode.draft_policy import DraftPolicy, row_caps
from mtplx.spec_decode.eagle3_proposer import Eagle3Proposer
from mtplx.spec_decode.head_chain import HeadChain
from mtplx.spec_decode.lookup_proposer import LookupDrafter
from mtplx.spec_decode.rows import BatchRow
from mtplx.spec_decode.sources import Source

import mlx.core as mx

__all__ = ["MAX_FORCED", "MAX_LOOKUP", "Drafters", "block_proposer_for"]

# Most grammar-forced tokens looked up per row per cycle (the draft policy then cuts them to its K).
MAX_FORCED = 8
# Most tokens a lookup match offers (its own adaptive block length is at most this).
MAX_LOOKUP = 64


def block_proposer_for(loaded: BlockDrafter, trunk) -> BlockProposer:
    """A decoder's proposer of a loaded block drafter: EAGLE-3's chain, else one block forward."""
    return Eagle3Proposer(loaded, trunk) if loaded.source is Source.EAGLE3 else BlockProposer(loaded, trunk)


class Drafters:
    """The cycle's drafters, in priority order: grammar-forced, lookup, draft model, block drafter,
    head chain (``chain``: None without an MTP head; ``blocks``: None without a block drafter)."""

    def __init__(self, chain: HeadChain | None, blocks: BlockProposer | None = None):
        self.forced, self.lookup, self.model = ForcedDrafter(), LookupDrafter(), ModelDrafter()
        self.chain, self.blocks = chain, blocks

    def draft(
        self, rows: Sequence[BatchRow], keys: Sequence[CycleKeys], policy: DraftPolicy | None, timed: bool
    ) -> Block:
        """Every row's drafts for this cycle (lazy where a model draws them), merged by each row's
        sources, first match wins (the module docstring); ``timed``: this cycle calibrates
        ``policy`` (the draft policy choosing each row's K; None: every row its own count)."""
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
            policy, rows, found.lengths, forced.lengths, self.chain is not None, timed, block_offer
        )
        _cut_host_drafts(rows, caps, forced, found)
        parts = [forced, found]
        chosen = [0 if g else (1 if f else None) for g, f in zip(forced.lengths, found.lengths)]
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

    def commit(self, rows: Sequence[BatchRow], outcome: Outcome) -> None:
        """Each drafter follows what its rows committed: the head its true pairs, lookup its block
        length, a draft model rolls back, a block drafter its context."""
        for drafter in (self.chain, self.lookup, self.model, self.blocks):
            if drafter is not None:
                drafter.commit(rows, outcome)


def _cut_host_drafts(
    rows: Sequence[BatchRow], caps: Sequence[int], forced: DraftBlock, found: DraftBlock
) -> None:
    """The host drafters' blocks cut to each row's cap, a grammar row's lookup match to its legal
    prefix (exact for point masses)."""
    for i, (row, cap) in enumerate(zip(rows, caps)):
        for part in (forced, found):
            part.host_tokens[i] = part.host_tokens[i][:cap]
        if row.constraint is not None and found.host_tokens[i]:
            found.host_tokens[i] = found.host_tokens[i][: row.constraint.legal_prefix(found.host_tokens[i])]
        forced.lengths[i], found.lengths[i] = len(forced.host_tokens[i]), len(found.host_tokens[i])
