"""A sweep's records -> one `Summary` per (setting, variant): rates, paired ratios, acceptance.

* Per (variant, setting, repeat) the rate is total decode tokens / total decode seconds
  over all prompts; the quoted figure is the median over repeats, with min and max beside
  it. Decode tokens/s = (tokens - 1) / decode seconds (the first token is the prefill's).
* Ratios ("x stock", "x mtplx AR") are the median of paired ratios: each run against the
  baseline run of its own (repeat, prompt, setting) block, which ran seconds apart, so
  drift cancels.

Acceptance is reported per draft position as the conditional rate a_i =
P(draft i accepted | drafts 1..i-1 accepted); the theoretical tokens per cycle is
tau* = 1 + a_1 + a_1 a_2 + ... (what a cycle would commit on average given those rates),
and efficiency = (speedup over stock mlx-lm) / tau*: 1.0 would mean a draft + verify
cycle costs exactly one stock AR step. Warm-ups (repeat -1) are never summarized.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from mtplx.bench.sweep import RunRecord
from mtplx.spec_decode.sources import DrafterKind


def conditional_acceptance(cumulative: Sequence[float]) -> list[float]:
    """P(all of drafts 1..i kept) per i -> P(draft i kept | drafts 1..i-1 kept)."""
    out, previous = [], 1.0
    for c in cumulative:
        out.append(c / previous if previous > 0 else 0.0)
        previous = c
    return out


def theoretical_tau(conditional: Sequence[float]) -> float:
    """Expected tokens per cycle, 1 + a1 + a1*a2 + ...: the verify step always yields one token."""
    tau, reach = 1.0, 1.0
    for a in conditional:
        reach *= a
        tau += reach
    return tau


@dataclass
class Summary:
    """One (setting, variant) over all timed runs (or over one prompt kind's, see ``kind``)."""

    variant: str
    mode: str
    depth: int
    setting: str
    decode_tps: float  # median over repeats
    decode_tps_min: float
    decode_tps_max: float
    spread: float  # (max - min) / median over repeats: the run-to-run noise
    prefill_tps: float  # median over repeats
    generated_tokens: int  # all timed runs together
    peak_memory_gb: float
    ratio_to_stock: float | None = None  # median of paired (same-block) ratios
    ratio_to_ar: float | None = None  # likewise
    acceptance: list[float] = field(default_factory=list)  # conditional, per draft position
    acceptance_cumulative: list[float] = field(default_factory=list)
    tau: float | None = None  # measured tokens per verify cycle
    tau_theory: float | None = None
    efficiency: float | None = None  # ratio_to_stock / tau_theory
    draft: str = "head"
    threshold: float = 0.0
    kind: str = "all"  # the prompt kind summarized, or "all"
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # drafted/accepted, all runs


def _per_repeat_rates(records: Sequence[RunRecord]) -> tuple[list[float], list[float]]:
    """(decode, prefill) tokens/s per repeat, pooled over prompts."""
    decode, prefill = [], []
    for repeat in sorted({r.repeat for r in records}):
        rs = [r for r in records if r.repeat == repeat]
        d_seconds = sum(r.decode_seconds for r in rs)
        p_seconds = sum(r.prefill_seconds for r in rs)
        decode.append(sum(r.generated_tokens - 1 for r in rs) / d_seconds if d_seconds > 0 else 0.0)
        prefill.append(sum(r.prompt_tokens for r in rs) / p_seconds if p_seconds > 0 else 0.0)
    return decode, prefill


# What every record of one group shares (one variant at one setting), copied onto its Summary.
_GROUP_KEYS = ("variant", "mode", "depth", "setting", "draft", "threshold")


def summarize_group(records: Sequence[RunRecord]) -> Summary:
    """The `Summary` of one (setting, variant)'s timed runs, without the paired ratios."""
    first = records[0]
    decode, prefill = _per_repeat_rates(records)
    median = statistics.median(decode)
    summary = Summary(
        **{name: getattr(first, name) for name in _GROUP_KEYS},
        decode_tps=median,
        decode_tps_min=min(decode),
        decode_tps_max=max(decode),
        spread=(max(decode) - min(decode)) / median if median > 0 else 0.0,
        prefill_tps=statistics.median(prefill),
        generated_tokens=sum(r.generated_tokens for r in records),
        peak_memory_gb=max(r.peak_memory_gb for r in records),
    )
    for r in records:
        for name, counts in r.drafters.items():
            total = summary.drafters.setdefault(name, {"drafted": 0, "accepted": 0})
            total["drafted"] += counts.get("drafted", 0)
            total["accepted"] += counts.get("accepted", 0)
    cycles = sum(r.cycles for r in records)
    if first.mode == "mtp" and cycles > 0:
        summary.tau = sum(r.tokens_in_cycles for r in records) / cycles
    if first.mode == "mtp" and cycles > 0 and first.draft == DrafterKind.HEAD and first.threshold == 0:
        accepted = [sum(r.accepted_per_position[i] for r in records) for i in range(first.depth)]
        summary.acceptance_cumulative = [a / cycles for a in accepted]
        summary.acceptance = conditional_acceptance(summary.acceptance_cumulative)
        summary.tau_theory = theoretical_tau(summary.acceptance)
    return summary


def paired_ratios(records: Sequence[RunRecord], baseline_mode: str) -> dict[tuple[str, str], list[float]]:
    """Per (setting, variant): decode-rate ratios to the baseline run of the same block.

    A block is one (repeat, prompt, setting): its variants ran back to back, so machine
    drift (other jobs, thermals) mostly cancels in the ratio, which a ratio of medians
    taken minutes apart does not get."""
    blocks: dict[tuple[int, str, str], list[RunRecord]] = {}
    for r in records:
        blocks.setdefault((r.repeat, r.prompt_id, r.setting), []).append(r)
    ratios: dict[tuple[str, str], list[float]] = {}
    for block in blocks.values():
        base = next((r for r in block if r.mode == baseline_mode), None)
        if base is None or base.decode_tokens_per_sec <= 0:
            continue
        for r in block:
            ratios.setdefault((r.setting, r.variant), []).append(
                r.decode_tokens_per_sec / base.decode_tokens_per_sec
            )
    return ratios


def summarize_by_kind(records: Sequence[RunRecord]) -> list[Summary]:
    """`summarize` per prompt kind (each kind's own paired ratios), kinds in run order."""
    kinds = list(dict.fromkeys(r.kind for r in records if r.repeat >= 0))
    out = []
    for kind in kinds:
        for s in summarize([r for r in records if r.kind == kind]):
            s.kind = kind
            out.append(s)
    return out


def summarize(records: Sequence[RunRecord]) -> list[Summary]:
    """One `Summary` per (setting, variant), in run order. Ratios to stock and to mtplx AR are
    medians of paired (same-block) ratios; efficiency uses the ratio to stock."""
    timed = [r for r in records if r.repeat >= 0]
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in timed:
        groups.setdefault((r.setting, r.variant), []).append(r)
    summaries = [summarize_group(g) for g in groups.values()]
    to_stock, to_ar = paired_ratios(timed, "stock"), paired_ratios(timed, "ar")
    for s in summaries:
        if to_stock.get((s.setting, s.variant)):
            s.ratio_to_stock = statistics.median(to_stock[(s.setting, s.variant)])
        if to_ar.get((s.setting, s.variant)):
            s.ratio_to_ar = statistics.median(to_ar[(s.setting, s.variant)])
        if s.tau_theory and s.ratio_to_stock is not None:
            s.efficiency = s.ratio_to_stock / s.tau_theory
    return summaries
