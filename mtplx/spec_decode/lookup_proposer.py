"""Prompt lookup: propose what followed the latest earlier occurrence of the text's suffix.

The longest suffix of prompt + committed text (between ``min_ngram`` and
``max_ngram`` tokens) that also occurs earlier in that text is matched at its
most recent earlier occurrence, and the tokens that followed it (up to
``max_tokens``, copied on through the suffix itself when the occurrence is
that recent) are proposed as point-mass drafts. The facts follow vLLM's
vllm/v1/spec_decode/ngram_proposer.py; the matcher here is an incremental
hash index instead of a rescan: every n-gram is inserted once, when the token
ending it is committed, so a cycle costs O(new tokens x n sizes) dictionary
operations whether or not anything matches.

Block length: with ``adaptive_length`` (the default) a request's lookup blocks start at
``max_tokens`` and follow the schedule of Hugging Face transformers' assisted generation
(``num_assistant_tokens_schedule="heuristic"`` in
transformers/generation/candidate_generator.py): +2 after a block that was kept whole,
-1 after one that was cut, within [1, ``max_tokens``]. A rejected lookup token costs a
verify position; on a CPU that is ~0.1-0.15 of a decode step (benchmarks/RESULTS.md), so
long blocks the model does not copy cost more than they return. The length depends only on
earlier cycles' outcomes, so exactness does not depend on it (`draft_block`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.spec_decode.draft_block import DraftBlock, Outcome, Source, host_block
from mtplx.spec_decode.settings import LookupConfig


class NgramIndex:
    """Latest end position of every n-gram (min_n <= n <= max_n) of a growing token list,
    excluding the n-grams that end at the very end (the suffix must match *elsewhere*)."""

    def __init__(self, min_n: int, max_n: int):
        self.tokens: list[int] = []
        self._tables: list[tuple[int, dict[tuple[int, ...], int]]] = [
            (n, {}) for n in range(max_n, min_n - 1, -1)
        ]
        self._next_end = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _catch_up(self) -> None:
        tokens, end = self.tokens, len(self.tokens)
        for j in range(self._next_end, end):
            for n, table in self._tables:
                if j >= n:
                    table[tuple(tokens[j - n : j])] = j
        self._next_end = end

    def match(self, max_tokens: int) -> list[int]:
        """The continuation of the longest matching suffix ([] when no suffix of >= min_n matches)."""
        self._catch_up()
        tokens, end = self.tokens, len(self.tokens)
        for n, table in self._tables:
            if n <= end:
                found = table.get(tuple(tokens[end - n :]))
                if found is not None:
                    return _copy_forward(tokens, found, max_tokens)
        return []


def _copy_forward(tokens: list[int], start: int, count: int) -> list[int]:
    """``count`` tokens copied from ``start`` on; past the end the copy reads its own output
    (an overlapping copy, as in LZ77), so a loop of period p proposes the loop, not p tokens."""
    out = tokens[start : start + count]
    offset = len(tokens) - start  # out[i] = (tokens + out)[start + i]
    while len(out) < count:
        out.append(out[len(out) - offset])
    return out


class LookupProposer:
    """One row's matcher: its n-gram index over the row's text and its next block's length."""

    name = "lookup"

    def __init__(self, config: LookupConfig):
        self.config = config.validate()
        self.index = NgramIndex(config.min_ngram, config.max_ngram)
        self.block_tokens = config.max_tokens  # the next block's length

    def find(self, history: list[int]) -> list[int]:
        """Host-side continuation after ``history`` ([] when nothing matches)."""
        self.index.extend(history[len(self.index.tokens) :])
        return self.index.match(self.block_tokens)

    def adapt(self, sources: tuple[tuple[Source, int], ...], num_accepted: int) -> None:
        """The next block's length after a cycle that verified ``sources`` (its segments)."""
        # The index catches up from the history at the next proposal; only the length adapts.
        if not self.config.adaptive_length or not sources or sources[0][0] is not Source.LOOKUP:
            return  # a cycle another drafter proposed for says nothing about lookup blocks
        kept_whole = num_accepted >= sources[0][1]
        step = 2 if kept_whole else -1
        self.block_tokens = min(self.config.max_tokens, max(1, self.block_tokens + step))


class LookupDrafter:
    """Prompt lookup for every row that asks, on the host: each row's own matcher (``row.lookup``)."""

    source = Source.LOOKUP

    def propose(self, rows: Sequence, keys: Sequence, most: Sequence[int]) -> DraftBlock:
        found = [row.lookup.find(row.history)[:n] if n else [] for row, n in zip(rows, most)]
        return host_block(found, Source.LOOKUP)

    def commit(self, rows: Sequence, outcome: Outcome) -> None:
        for row, sources, n in zip(rows, outcome.sources, outcome.num_accepted):
            if row.lookup is not None:
                row.lookup.adapt(sources, n)
