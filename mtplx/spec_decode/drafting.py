"""Drafting, decided in one module: which drafter a request decodes with, how deep it drafts
(every depth default), the adaptive gate's default threshold, the cycle's per-row drafter table,
and building a row's own proposer. Each cycle's draft length per row is the draft-length policy's
(`draft_policy.row_caps`: a pinned length, the fixed depth, or the cost model; the adaptive gate
then cuts an adaptive row's block after its first unsure draft).

The rules, in order:
1. kind: the request's `Drafting.kind` ("auto" unless asked); the engine has already refused a
   kind it cannot serve (no head, no draft model).
2. model drafter: the draft model when asked for, or under "auto" when one is loaded; else the
   MTP head when asked for, or under "auto" when there is one, unless `mtplx tune` found plain AR
   fastest on this machine (the engine's depth is 0) and the request names no depth.
3. depth: the request's, else the engine's (tuned, else the head's default), else the head's
   own default when tuning chose AR but a drafter was asked for explicitly. A draft model drafts
   the request's depth or `DEFAULT_DEPTH`: the head's tuning says nothing about it.
4. the batched loop's drafter for the row (`batch_drafter`, the table below): the head batched
   across rows (`head_proposer.HeadChain`), lookup on the host, or the row's own proposer (a draft
   model always; any drafter on a single-row decoder, built by `build_proposer`).

| kind  | model drafter | batch row drafter (rows share a batch) | single-row decoder |
|-------|---------------|----------------------------------------|--------------------|
| none  | -             | none                                   | none               |
| lookup| -             | lookup                                 | lookup             |
| head  | head          | head                                   | proposer           |
| auto  | head          | auto (lookup where it matches, else the head) | proposer    |
| auto  | none          | lookup                                 | lookup             |
| model / auto | model  | proposer                               | proposer           |

Exactness never depends on these choices (any proposer is exact, `proposer.py`); speed does.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.spec_decode.auto_proposer import AutoProposer
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.head_proposer import HeadProposer
from mtplx.spec_decode.lookup_proposer import LookupProposer
from mtplx.spec_decode.proposer import Proposer
from mtplx.spec_decode.settings import DecodeSettings, Drafting

__all__ = [
    "DEFAULT_ADAPTIVE_THRESHOLD",
    "DEFAULT_DEPTH",
    "DrafterChoice",
    "batch_drafter",
    "build_proposer",
    "choose_drafter",
    "head_depth",
]

DEFAULT_DEPTH = 3  # drafts per cycle when neither the head, tuning nor the request says
# Adaptive head drafting stops after a draft the head gave less than this probability (unless
# `mtplx tune` saved a threshold for the model on this machine).
DEFAULT_ADAPTIVE_THRESHOLD = 0.3


def head_depth(head) -> int:
    """The head's own default depth (its manifest's), else `DEFAULT_DEPTH`."""
    return int((head.default_depth if head is not None else None) or DEFAULT_DEPTH)


@dataclass(frozen=True)
class DrafterChoice:
    kind: str  # the drafter asked for (settings.DRAFT_KINDS)
    model_drafter: str | None  # "head" | "model" | None: the model drafter behind kind
    depth: int  # the head's drafts per cycle (and the depth stats report)
    model_depth: int  # a draft model's drafts per cycle

    @property
    def speculative(self) -> bool:
        return self.kind != "none"


def choose_drafter(
    drafting: Drafting, *, has_head: bool, has_draft_model: bool, engine_depth: int, head_depth: int
) -> DrafterChoice:
    """The drafter and depths for one request (the module docstring's rules).

    ``engine_depth`` is the engine's default depth (0: tuning found plain AR fastest);
    ``head_depth`` the head's own default.
    """
    kind, asked_depth = drafting.kind, drafting.depth
    if kind == "model" or (kind == "auto" and has_draft_model):
        model_drafter = "model"
    elif kind == "head" or (kind == "auto" and has_head and not (asked_depth is None and not engine_depth)):
        model_drafter = "head"
    else:
        model_drafter = None
    return DrafterChoice(
        kind=kind,
        model_drafter=model_drafter,
        depth=asked_depth if asked_depth is not None else (engine_depth or head_depth),
        model_depth=asked_depth if asked_depth is not None else DEFAULT_DEPTH,
    )


def batch_drafter(choice: DrafterChoice, single_row: bool) -> str:
    """The cycle's drafter for a row (`loop.BATCH_DRAFTERS`; the module docstring's table)."""
    kind = choice.kind
    if kind == "auto" and choice.model_drafter is None:
        return "lookup"
    if kind in ("none", "lookup"):
        return kind
    if single_row or choice.model_drafter == "model":
        return "proposer"  # the row's own proposer (`build_proposer`)
    return kind  # "head" or "auto" (lookup, else the head chain)


def build_proposer(
    choice: DrafterChoice,
    drafting: Drafting,
    settings: DecodeSettings,
    *,
    head=None,
    head_cache: list | None = None,
    draft_model=None,
    target_vocab_size: int = 0,
    draft_vocab_size: int = 0,
) -> Proposer | None:
    """A fresh proposer for one request (None: plain AR). Its state lives and dies with the
    request, except the head's cache, which comes from the request's prompt-cache session."""
    if choice.kind == "none":
        return None
    if choice.kind == "lookup":
        return LookupProposer(drafting.lookup)
    drafter: Proposer | None = None
    if choice.model_drafter == "model":
        drafter = DraftModelProposer(
            draft_model,
            settings,
            target_vocab_size=target_vocab_size,
            real_vocab_size=draft_vocab_size,
            depth=choice.model_depth,
        )
    elif choice.model_drafter == "head":
        drafter = HeadProposer(head, settings, head_cache)
    if choice.kind == "auto":
        return AutoProposer(LookupProposer(drafting.lookup), drafter)
    return drafter
