"""`RequestOutput`: one request's decode `Step`s turned into `GenerationChunk`s.

The one place a request's end is decided, for a single stream (`Engine.stream`) and for a row of
the batched loop (`mtplx.engine.scheduler`) alike: EOS, stop strings, ``max_tokens``, a complete
grammar (`Step.grammar_done`: "stop", the text ends with the grammar's last token, no EOS); plus the
incremental text (`TextAssembler`), the running stats (`StatsTracker`) and the logprobs of the
tokens kept. Tokens after the end (the rest of a verify block) are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtplx.engine.request import GenerationRequest
from mtplx.engine.stats import GenerationStats, StatsTracker
from mtplx.engine.text import TextAssembler
from mtplx.spec_decode.step import Step, TokenLogprobs

__all__ = ["GenerationChunk", "GenerationResult", "RequestOutput"]


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new tokens since the previous chunk
    finish_reason: str | None  # None while running; "stop" | "length" at the end
    stats: GenerationStats
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked for
    eos_token: int | None = None  # the EOS (or stop token id) that ended the request; not emitted
    index: int = 0  # the choice's index (a request with n > 1 has n choices)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprobs] | None = None  # one per token id, when asked for
    eos_token: int | None = None  # the EOS (or stop token id) that ended it; not in token_ids

    @classmethod
    def from_chunks(cls, chunks: Sequence[GenerationChunk]) -> GenerationResult:
        """The whole generation from its chunks (the last one ended it)."""
        logprobs = None
        if chunks and chunks[-1].logprobs is not None:
            logprobs = [lp for c in chunks for lp in c.logprobs or ()]
        return cls(
            "".join(c.text for c in chunks),
            [t for c in chunks for t in c.token_ids],
            chunks[-1].finish_reason or "stop",
            chunks[-1].stats,
            logprobs,
            chunks[-1].eos_token,
        )


class RequestOutput:
    """Feeds one request's Steps through its stop rules; `finished` once a chunk ended it."""

    def __init__(
        self,
        tokenizer,
        request: GenerationRequest,
        prompt_tokens: int,
        cached_tokens: int,
        mode: str,
        depth: int,
        head=None,
    ):
        self.eos = set(request.stop_token_ids) | (
            set() if request.ignore_eos else set(tokenizer.eos_token_ids)
        )
        self.max_tokens = request.max_tokens
        self.tracker = StatsTracker(prompt_tokens, mode, depth, cached_tokens)
        self.text = TextAssembler(tokenizer, request.stop) if request.detokenize else None
        self.produced = 0
        self.finished = False
        # The head's own counters (e.g. a narrowed vocabulary's misses): this request's share.
        self._head = head if mode == "mtp" else None
        self._counters_before = self._head.counters() if self._head is not None else {}

    @property
    def stats(self) -> GenerationStats:
        return self.tracker.stats

    def prefix_reused(self, cached_tokens: int) -> None:
        """The prompt's first ``cached_tokens`` came from another request's caches after all."""
        stats = self.tracker.stats
        stats.cached_tokens = cached_tokens
        stats.prefilled_tokens = stats.prompt_tokens - cached_tokens

    def feed(self, step: Step) -> GenerationChunk:
        """The chunk for ``step``'s tokens, up to the end of the request if it ends here."""
        assert not self.finished, "the request has ended"
        kept: list[int] = []
        delta = ""
        finish = eos_token = None
        for token in step.tokens:
            if token in self.eos:
                finish, eos_token = "stop", token
                break
            kept.append(token)
            self.produced += 1
            if self.text is not None:
                delta += self.text.add(token)
            if self.text is not None and self.text.stopped:
                finish = "stop"
                break
            if self.produced >= self.max_tokens:
                finish = "length"
                break
        if finish is None and step.grammar_done:
            finish = "stop"  # the grammar is complete: only EOS could follow, and it is not emitted
        self.tracker.record(step, len(kept))
        logprobs = step.logprobs[: len(kept)] if step.logprobs is not None else None
        if finish is not None:
            self.finished = True
            if self._counters_before:
                now = self._head.counters()
                head_stats = self.stats.drafters.setdefault("head", {"drafted": 0, "accepted": 0})
                head_stats.update({k: now[k] - self._counters_before[k] for k in now})
            delta += self.text.finish() if self.text is not None else ""
        return GenerationChunk(delta, kept, finish, self.stats, logprobs, eos_token)
