"""`Source`: where drafts come from, the one vocabulary of drafters inside the cycle (standard
library only, so the draft policy and request validation import it without MLX)."""

from __future__ import annotations

from enum import Enum

__all__ = ["Source"]


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
