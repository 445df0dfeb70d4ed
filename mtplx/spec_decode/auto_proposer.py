"""`draft="auto"`: prompt lookup when the text's suffix recurs, the model drafter otherwise.

Per cycle: if a suffix of at least ``min_ngram`` tokens matches earlier text,
the lookup continuation is the block; a draft model (not the MTP head, whose
chain is trained on its own states only) extends a block shorter than its depth.
Without a match the model drafter (head or draft model) proposes, and without
one the cycle has no drafts (plain AR step).
"""

from __future__ import annotations

from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.lookup_proposer import LookupProposer, point_mass_draft
from mtplx.spec_decode.proposer import CycleOutcome, Draft, Proposer
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx


class AutoProposer:
    name = "auto"

    def __init__(self, lookup: LookupProposer, model: Proposer | None):
        self.lookup = lookup
        self.model = model

    def observe_prefill(self, output: TrunkOutput, start: int, end: int, prompt_tokens: list[int]) -> None:
        if self.model is not None:
            self.model.observe_prefill(output, start, end, prompt_tokens)

    def propose(self, history: list[int], key: mx.array, trunk_cache: list, constraint=None) -> Draft | None:
        found = self.lookup.find(history)
        if not found:
            if self.model is None:
                return None
            return self.model.propose(history, key, trunk_cache, constraint=constraint)
        if isinstance(self.model, DraftModelProposer) and len(found) < self.model.depth:
            return self.model.propose(history, key, trunk_cache, forced=found)
        return point_mass_draft(found, self.lookup.name)

    def commit(self, outcome: CycleOutcome) -> None:
        self.lookup.commit(outcome)
        if self.model is not None:
            self.model.commit(outcome)
