"""Drafting, decided in one module: which drafter a request decodes with, how deep it drafts
(every depth default), the adaptive gate's default threshold, the cycle's per-row drafter table,
and building a draft model row's state. Each cycle's draft length per row is the draft-length policy's
(`draft_policy.row_caps`: a pinned length, the fixed depth, or the cost model; the adaptive gate
then cuts an adaptive row's block after its first unsure draft).

The rules, in order:
1. kind: the request's `Drafting.kind` ("auto" unless asked); the engine has already refused a
   kind it cannot serve (no head, no draft model).
2. model drafter: the draft model when asked for, or under "auto" when one is loaded; else the
   block drafter (DFlash, DFlash2, DSpark, EAGLE-3) when asked for by its name, or under "auto" when one is
   loaded; else the MTP head when asked for, or under "auto" when there is one, unless `mtplx
   tune` found plain AR fastest on this machine (the engine's depth is 0) and the request names
   no depth. Under "auto" with both a block drafter and a head (Qwen3.8-27B's DFlash2 and MTP),
   the block drafter drafts (its whole block in one forward); ``draft="head"`` picks the head.
3. depth: the request's, else the engine's (tuned, else the head's default), else the head's
   own default when tuning chose AR but a drafter was asked for explicitly. A draft model drafts
   the request's depth or `DEFAULT_DEPTH`: the head's tuning says nothing about it.
4. the cycle's drafters for the row in priority order (`row_sources`, the table below), the same
   in a batch and on a single-row decoder (a stream): the head chain (`head_chain.HeadChain`),
   lookup on the host, a draft model on the row's own cache (`build_proposer`), a block drafter
   (`block_proposer.BlockProposer`, one block forward per cycle for all its rows; EAGLE-3's
   chain, `eagle3_proposer.Eagle3Proposer`). A grammar
   row's forced tokens come before any of them.

| kind  | model drafter | sources (first match wins)        |
|-------|---------------|-----------------------------------|
| none  | -             | (plain AR)                        |
| lookup| -             | lookup                            |
| head  | head          | head                              |
| auto  | head          | lookup, head                      |
| auto  | none          | lookup                            |
| auto  | model         | lookup, model (continues a short match) |
| model | model         | model                             |
| auto  | block         | lookup, block                     |
| dflash / dflash2 / dspark / eagle3 | block | block         |

Exactness never depends on these choices (any proposer is exact, `proposer.py`); speed does.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.settings import DecodeSettings, Drafting
from mtplx.spec_decode.sources import BLOCK_SOURCES, DrafterKind, Source

__all__ = [
    "DEFAULT_ADAPTIVE_THRESHOLD",
    "DEFAULT_DEPTH",
    "DrafterChoice",
    "build_proposer",
    "choose_drafter",
    "drafter_refusal",
    "head_depth",
    "row_sources",
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
    kind: DrafterKind  # the drafter asked for
    model_drafter: Source | None  # HEAD, MODEL, a block source or None: the model drafter behind kind
    depth: int  # the head's drafts per cycle (and the depth stats report)
    model_depth: int  # a draft model's drafts per cycle

    @property
    def speculative(self) -> bool:
        return self.kind is not DrafterKind.NONE


def choose_drafter(
    drafting: Drafting,
    *,
    has_head: bool,
    has_draft_model: bool,
    engine_depth: int,
    head_depth: int,
    block: Source | None = None,
) -> DrafterChoice:
    """The drafter and depths for one request (the module docstring's rules).

    ``engine_depth`` is the engine's default depth (0: tuning found plain AR fastest);
    ``head_depth`` the head's own default; ``block`` the loaded block drafter's source, if any.
    """
    kind, asked_depth = DrafterKind(drafting.kind), drafting.depth
    auto = kind is DrafterKind.AUTO
    if kind is DrafterKind.MODEL or (auto and has_draft_model):
        model_drafter = Source.MODEL
    elif kind.value in (s.value for s in BLOCK_SOURCES) or (auto and block is not None):
        model_drafter = Source(kind.value) if not auto else block
    elif kind is DrafterKind.HEAD or (auto and has_head and not (asked_depth is None and not engine_depth)):
        model_drafter = Source.HEAD
    else:
        model_drafter = None
    return DrafterChoice(
        kind=kind,
        model_drafter=model_drafter,
        depth=asked_depth if asked_depth is not None else (engine_depth or head_depth),
        model_depth=asked_depth if asked_depth is not None else DEFAULT_DEPTH,
    )


def drafter_refusal(
    drafting: Drafting, *, has_head: bool, has_draft_model: bool, block: Source | None = None
) -> str | None:
    """Why this engine cannot serve the drafter a request names, one line naming the request's
    field (`Drafting.field`); "" for a missing head (the engine words that one); None if it can.
    ``block``: the loaded block drafter's source, if any."""
    kind = DrafterKind(drafting.kind)
    if kind is DrafterKind.HEAD and not has_head:
        return ""
    if kind is DrafterKind.MODEL and not has_draft_model:
        return (
            f"{drafting.field}: 'model' needs a draft model and none is loaded "
            "(start with --draft-model PATH; Engine.load(draft_model=...))"
        )
    if kind.value in (s.value for s in BLOCK_SOURCES) and (block is None or block.value != kind.value):
        loaded = f"this engine loaded a {block} drafter" if block is not None else "none is loaded"
        return (
            f"{drafting.field}: {kind.value!r} needs a {kind.value} block drafter and {loaded} "
            "(start with --head DIR naming it, or place it beside the model)"
        )
    return None


def row_sources(choice: DrafterChoice) -> tuple[Source, ...]:
    """The cycle's drafters for a request's rows, in priority order (the module docstring's
    table): the same on a batch and on a single-row decoder (a stream is a batch of one)."""
    kind = DrafterKind(choice.kind)
    if kind is DrafterKind.NONE:
        return ()
    if kind is DrafterKind.LOOKUP:
        return (Source.LOOKUP,)
    model = () if choice.model_drafter is None else (Source(choice.model_drafter),)
    return ((Source.LOOKUP,) if kind is DrafterKind.AUTO else ()) + model


def build_proposer(
    choice: DrafterChoice,
    settings: DecodeSettings,
    *,
    draft_model=None,
    target_vocab_size: int = 0,
    draft_vocab_size: int = 0,
) -> DraftModelProposer | None:
    """A draft model row's own draft model state (None for any other row): its cache lives and
    dies with the request."""
    if Source.MODEL not in row_sources(choice):
        return None
    return DraftModelProposer(
        draft_model,
        settings,
        target_vocab_size=target_vocab_size,
        real_vocab_size=draft_vocab_size,
        depth=choice.model_depth,
    )
