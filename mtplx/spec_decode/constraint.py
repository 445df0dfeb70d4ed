"""`GrammarConstraint`: one request's grammar matcher, as the decode loop and the drafters read it.

The constrained distribution (docs/sampling.md, "Grammar mask") sets the logits of the tokens the
grammar does not allow next to -inf after the penalties and before temperature and the filters, at
every position the target or a masked drafter samples. This object answers "which tokens may come
next" for the committed text followed by any run of draft tokens, and moves the matcher forward by
what a cycle commits.

Glossary:
- matcher: an llguidance ``LLMatcher`` compiled for the request's grammar and the model's tokenizer
  (`mtplx.engine.grammar` builds it; this module never imports llguidance).
- mask: bool [V] over the trunk's vocabulary, True where the grammar allows the token next. Ids past
  the tokenizer's vocabulary are never allowed; EOS is allowed exactly where the grammar accepts.
- state after ``drafts``: the matcher advanced through the committed text and then ``drafts``
  (a tuple of token ids); masks are memoised per such tuple within a cycle, so the head's draft chain
  and the verify block share them.
- stopped: the grammar is complete and allows nothing but EOS: the row ends before another forward.

Invariants: between cycles the matcher holds exactly the committed tokens (EOS excluded: generation
ends there); every speculative advance is rolled back before a method returns. A position after an
EOS draft or after a draft the grammar refuses gets an all-allowed mask: no output ever comes from
it (generation ends at an accepted EOS; a refused draft has p = 0 under the masked target, so verify
rejects it with probability 1 and samples from the row before it), and an all -inf row would be
reported as invalid logits.

Host work per cycle (measured in `masks_computed`, `mask_seconds`): one llguidance mask per
distinct draft prefix. The host reads of the drafts that those masks need are counted by the loop.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from mtplx.errors import MtplxError
from mtplx.spec_decode.draft_block import DraftBlock, Source, host_block

import mlx.core as mx
import numpy as np

__all__ = ["ForcedDrafter", "GrammarConstraint", "matcher_message"]


def matcher_message(error: str) -> str:
    """llguidance's error as one line: its first line, without the parser state it appends."""
    lines = error.split("<state>")[0].strip().splitlines()
    return " ".join(lines[0].split()) if lines else "the matcher failed"


class GrammarConstraint:
    """A request's grammar over the trunk's vocabulary of ``vocab_size`` ids."""

    def __init__(self, matcher, vocab_size: int, tokenizer_vocab_size: int, eos_token_ids: Sequence[int]):
        """``matcher``: an llguidance LLMatcher at the start of the output; its masks cover
        ``tokenizer_vocab_size`` ids (the rest of the trunk's ``vocab_size`` stay disallowed)."""
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.tokenizer_vocab_size = min(tokenizer_vocab_size, vocab_size)
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self._memo: dict[tuple[int, ...], mx.array] = {}
        self._all_allowed = mx.ones((vocab_size,), dtype=mx.bool_)
        self.masks_computed = 0
        self.mask_seconds = 0.0
        self._check()

    # ------------------------------------------------------------------ state
    def _check(self) -> None:
        if self.matcher.is_error():
            raise MtplxError(f"grammar: {matcher_message(self.matcher.get_error())}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows only EOS next."""
        return bool(self.matcher.is_stopped())

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the matcher by a cycle's committed tokens (up to an EOS, where output ends)."""
        self._memo.clear()
        kept: list[int] = []
        for token in tokens:
            if token in self.eos:
                break
            kept.append(int(token))
        if kept and not self.matcher.consume_tokens(kept):
            self._check()
            raise MtplxError("grammar: a committed token does not match the grammar")
        self._check()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces right after the committed text (llguidance's
        fast-forward tokens: the forced bytes, tokenized). Drafted as point masses they are exact
        like any draft; where the mask allows only that token its masked target probability is 1
        and verify keeps it for sure (JSON keys, braces, fixed tool-call syntax). EOS never."""
        start = time.perf_counter()
        forced = [int(t) for t in self.matcher.compute_ff_tokens()][:limit]
        self._check()
        self.mask_seconds += time.perf_counter() - start
        inside = self.legal_prefix(forced)  # ids past the tokenizer's vocabulary never drafted
        return [t for t in forced[:inside] if t not in self.eos]

    def legal_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts after the committed text) the grammar allows in a row.
        An id past the tokenizer's vocabulary is never allowed (and never shown to llguidance,
        which would put the matcher in its error state for good)."""
        ids = [int(t) for t in tokens]
        inside = next((i for i, t in enumerate(ids) if not 0 <= t < self.tokenizer_vocab_size), len(ids))
        return int(self.matcher.validate_tokens(ids[:inside])) if inside else 0

    # ------------------------------------------------------------------ masks
    def mask_after(self, drafts: Sequence[int] = ()) -> mx.array:
        """bool [V]: the tokens allowed after the committed text and ``drafts`` (memoised)."""
        key = tuple(int(t) for t in drafts)
        found = self._memo.get(key)
        if found is not None:
            return found
        cut = next((i for i, t in enumerate(key) if t in self.eos), len(key))
        if cut < len(key):  # after an EOS draft: nothing is emitted there
            mask = self._all_allowed
        else:
            legal = self.legal_prefix(key) == len(key)
            mask = self._compute(key) if legal else self._all_allowed
        self._memo[key] = mask
        return mask

    def block_masks(self, drafts: Sequence[int]) -> mx.array:
        """bool [k+1, V]: the mask at every position of a verify block [pending, d_1..d_k]."""
        tokens = [int(t) for t in drafts]
        return mx.stack([self.mask_after(tokens[:i]) for i in range(len(tokens) + 1)])

    def _compute(self, drafts: tuple[int, ...]) -> mx.array:
        start = time.perf_counter()
        matcher = self.matcher
        if drafts and not matcher.consume_tokens(list(drafts)):
            raise MtplxError("grammar: a draft the grammar allowed could not be consumed")
        try:
            bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
            self._check()
        finally:
            if drafts:
                matcher.rollback(len(drafts))
        allowed = np.zeros(self.vocab_size, dtype=bool)
        allowed[: self.tokenizer_vocab_size] = np.unpackbits(bits, bitorder="little")[
            : self.tokenizer_vocab_size
        ].astype(bool)
        if not allowed.any():
            raise MtplxError("grammar: no token of this vocabulary can continue the output")
        self.masks_computed += 1
        self.mask_seconds += time.perf_counter() - start
        return mx.array(allowed)


class ForcedDrafter:
    """The tokens each grammar row's grammar forces after its committed text, drafted first as
    point masses (`GrammarConstraint.forced_tokens`), on the host."""

    source = Source.GRAMMAR

    def propose(self, rows: Sequence, keys: Sequence, most: Sequence[int]) -> DraftBlock:
        return host_block(
            [row.constraint.forced_tokens(n) if n else [] for row, n in zip(rows, most)], self.source
        )

    def commit(self, rows: Sequence, outcome) -> None:
        return None  # the loop advances each row's matcher by what it committed (`grammar_step`)
