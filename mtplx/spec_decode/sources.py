"""`Source`: where drafts come from, the one vocabulary of drafters inside the cycle (standard
library only, so the draft policy and request validation import it without MLX)."""

from __future__ import annotations

from enum import Enum

__all__ = ["BLOCK_SOURCES", "DrafterKind", "Source"]


class Source(str, Enum):
    """Where drafts come from; the value names it in stats and acceptance records ("head": the
    model's MTP head chain; "model": a draft model; "lookup": prompt lookup; "grammar": the tokens
    a grammar forces; "dflash" / "dflash2" / "dspark": a block drafter, one block forward per
    cycle; "eagle3": an EAGLE-3 drafter, its chain on its own KV cache)."""

    GRAMMAR = "grammar"
    LOOKUP = "lookup"
    MODEL = "model"
    HEAD = "head"
    DFLASH = "dflash"
    DFLASH2 = "dflash2"
    DSPARK = "dspark"
    EAGLE3 = "eagle3"

    def __str__(self) -> str:
        return self.value


class DrafterKind(str, Enum):
    """The drafter a request asks for (the CLI's --draft, the API's ``draft`` / ``speculative.drafter``):
    "auto" (lookup where the text recurs, else the draft model or the head), "head", "lookup",
    "model" (a draft model), the block drafter the model was loaded with ("dflash", "dflash2",
    "dspark", "eagle3") or "none" (plain AR). `drafting` resolves it into the row's `Source`s."""

    AUTO = "auto"
    HEAD = "head"
    LOOKUP = "lookup"
    MODEL = "model"
    NONE = "none"
    DFLASH = "dflash"
    DFLASH2 = "dflash2"
    DSPARK = "dspark"
    EAGLE3 = "eagle3"

    def __str__(self) -> str:
        return self.value


# The drafters loaded from a drafter directory beside the model (`mtplx.drafters`; drafting in
# `spec_decode.block_proposer`, EAGLE-3's chain in `spec_decode.eagle3_proposer`): kind, source
# and layout share the name.
BLOCK_SOURCES = (Source.DFLASH, Source.DFLASH2, Source.DSPARK, Source.EAGLE3)
