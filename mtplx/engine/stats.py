"""`GenerationStats`: the one schema of a generation's figures (CLI, server, bench, drafters), and
`StatsTracker`, which fills it step by step from the decode loop's `Step`s.

Counting rules: the first generated token comes from prefill (it sets time to first token); every
later step is one cycle (a verify cycle, or an AR step when nothing was drafted). Acceptance per
draft position is over the cycles that drafted that position; drafter counts follow each step's
`sources` (which drafter made which part of the block).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from mtplx.spec_decode.step import Step

import mlx.core as mx

__all__ = ["GenerationStats", "StatsTracker"]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens_per_sec: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0  # from the first generated token on: prefill excluded
    decode_tokens_per_sec: float = 0.0
    cycles: int = 0  # verify cycles (MTP) or decode steps (AR)
    tokens_per_cycle: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    # Cycles that drafted at least k tokens, per position k: what each acceptance figure is over
    # (a lookup block can reach positions the model drafters never draft).
    drafted_per_position: list[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    mode: str = "ar"  # "ar" | "mtp" (speculative, with any drafter: see `drafters`)
    depth: int = 0
    ttft_seconds: float = 0.0  # from the start of the call to the first generated token
    total_seconds: float = 0.0  # from the start of the call to the last token so far
    prefilled_tokens: int = 0  # prompt tokens run through the trunk by this call
    cached_tokens: int = 0  # prompt tokens reused from a prompt cache (prompt = prefilled + cached)
    # Like tokens_per_cycle, over only the verify cycles whose tokens were all kept: the cycle that
    # EOS, a stop string or max_tokens cut short would understate what a cycle yields.
    tokens_per_full_cycle: float = 0.0
    # Draft tokens proposed / accepted by each drafter, e.g.
    # {"head": {"drafted": 40, "accepted": 22}, "lookup": {...}, "model": {...}}.
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)
    # Grammar-constrained requests: host reads of drafts the masks needed, and the host seconds
    # spent computing masks (llguidance), over the whole generation (see docs/DECISIONS.md, "Grammar rows and the head cache").
    grammar_reads: int = 0
    grammar_mask_seconds: float = 0.0
    # Sharded runs: mode, ranks, collectives and payload bytes per cycle (see mtplx/engine/distributed.py).
    distributed: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


class StatsTracker:
    """Accumulates per-step measurements into `GenerationStats`."""

    def __init__(self, prompt_tokens: int, mode: str, depth: int, cached_tokens: int = 0):
        self.stats = GenerationStats(
            prompt_tokens=prompt_tokens,
            mode=mode,
            depth=depth,
            prefilled_tokens=prompt_tokens - cached_tokens,
            cached_tokens=cached_tokens,
        )
        self._start = time.perf_counter()
        self._first_token_time: float | None = None
        self._drafted: list[int] = []  # per draft position (blocks may be longer than depth)
        self._accepted: list[int] = []
        self._committed_in_cycles = 0
        self._full_cycles = 0
        self._committed_in_full_cycles = 0
        mx.reset_peak_memory()

    def record(self, step: Step, num_tokens_kept: int) -> None:
        now = time.perf_counter()
        stats = self.stats
        if self._first_token_time is None:
            self._first_token_time = now
            stats.prefill_seconds = now - self._start
            stats.prefill_tokens_per_sec = stats.prefilled_tokens / max(stats.prefill_seconds, 1e-9)
            stats.ttft_seconds = stats.prefill_seconds
        else:  # every step after the first is a cycle (one without drafts is an AR step)
            stats.cycles += 1
            self._committed_in_cycles += num_tokens_kept
            if num_tokens_kept == len(step.tokens):
                self._full_cycles += 1
                self._committed_in_full_cycles += num_tokens_kept
            missing = step.num_drafted - len(self._drafted)
            if missing > 0:
                self._drafted += [0] * missing
                self._accepted += [0] * missing
            for position in range(step.num_drafted):
                self._drafted[position] += 1
                self._accepted[position] += int(position < step.num_accepted)
            start = 0
            for name, count in step.sources:
                counts = stats.drafters.setdefault(name, {"drafted": 0, "accepted": 0})
                counts["drafted"] += count
                counts["accepted"] += min(max(step.num_accepted - start, 0), count)
                start += count
        stats.grammar_reads += step.grammar_reads
        stats.grammar_mask_seconds += step.mask_seconds
        stats.generated_tokens += num_tokens_kept
        stats.decode_seconds = now - self._first_token_time
        stats.total_seconds = now - self._start
        # The first token comes from prefill; decode speed counts the tokens after it.
        stats.decode_tokens_per_sec = (
            (stats.generated_tokens - 1) / stats.decode_seconds if stats.decode_seconds > 0 else 0.0
        )
        stats.tokens_per_cycle = self._committed_in_cycles / stats.cycles if stats.cycles else 0.0
        stats.tokens_per_full_cycle = (
            self._committed_in_full_cycles / self._full_cycles if self._full_cycles else 0.0
        )
        stats.acceptance_per_position = [a / d for a, d in zip(self._accepted, self._drafted) if d]
        stats.drafted_per_position = [d for d in self._drafted if d]
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
