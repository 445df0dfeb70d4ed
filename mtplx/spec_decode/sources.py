"""`Source`: where drafts come from, the one vocabulary of drafters inside the cycle (standard
library only, so the draft policy and request validation import it without MLX)."""

from __future__ import annotations

from enum import Enum

__all__ = ["DrafterKind", "Source"]


class Source(str, Enum):
    """Where drafts come from; the value names it in stats and acceptance records ("head": the
    model's MTP head chain; "model": a draft model; "lookup": prompt lookup; "grammar": the tokens
    a grammar forces)."""

    GRAMMAR = "grammar"
    LOOKUP = "lookup"
    MODEL = "model"
    HEAD = "head"

    def __str__(self) -> str:
        return self.value


class DrafterKind(str, Enum):
    """The drafter a request asks for (the CLI's --draft, the API's ``draft`` / ``speculative.drafter``):
    "auto" (lookup where the text recurs, else the draft model or the head), "head", "lookup",
    "model" (a draft model) or "none" (plain AR). `drafting` resolves it into the row's `Source`s."""

    AUTO = "auto"
    HEAD = "head"
    LOOKUP = "lookup"
    MODEL = "model"
    NONE = "none"

    def __str__(self) -> str:
        return self.value
