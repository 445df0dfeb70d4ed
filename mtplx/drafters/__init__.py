"""Drafters (proposers) for the one speculative loop in `mtplx.decode`; see `base.py`."""

from mtplx.drafters.auto import AutoProposer
from mtplx.drafters.base import CycleOutcome, Draft, Proposer
from mtplx.drafters.draft_model import DraftModelProposer
from mtplx.drafters.head import HeadProposer
from mtplx.drafters.lookup import LookupConfig, LookupProposer

DRAFT_KINDS = ("auto", "head", "lookup", "model", "none")

__all__ = [
    "DRAFT_KINDS",
    "AutoProposer",
    "CycleOutcome",
    "Draft",
    "DraftModelProposer",
    "HeadProposer",
    "LookupConfig",
    "LookupProposer",
    "Proposer",
]
