"""`mtplx tune`: measure which MTP depth is fastest for a model on this machine, and remember it.

A short version of the benchmark sweep (`mtplx.bench.run`: mtplx AR and MTP at each depth,
interleaved, median of repeats) picks the depth with the best speed-up over AR,
geometric mean over the sampling settings. AR (saved as depth 0) wins unless the best
depth beats it by more than the measured run-to-run spread: on a noisy machine a 3%
"win" is not a win.

The choice lives in a per-user JSON file (``~/.config/mtplx/tune.json``, or
``$XDG_CONFIG_HOME/mtplx/tune.json``), keyed by the model's weight fingerprint and a
description of the machine (OS, CPU, cores, MLX device), because the fastest depth
depends on both. `Engine.load` asks `saved_depth` when no depth is given.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtplx.bench.report import markdown_table, versions
from mtplx.bench.run import run_benchmark
from mtplx.bench.stats import Summary
from mtplx.bench.suite import load_prompts
from mtplx.bench.sweep import DEFAULT_TEMPS, DEFAULT_TOP_P, SweepPlan, check_counts, parse_depths
from mtplx.engine.tuned import (
    batch_cost_identity,
    config_file,
    machine_info,
    machine_key,
    read_config,
    save_entry,
    saved_entry,
)
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import DrafterKind

TUNE_TOKENS = 64
TUNE_REPEATS = 3
TUNE_PER_KIND = 1

# Adaptive-length thresholds `mtplx tune` compares (head probability of its own draft).
ADAPTIVE_THRESHOLDS = (0.2, 0.4)


def _ratio_to_ar(row: Summary, ar: Summary) -> float:
    """The paired ratio where the sweep measured one, else the ratio of medians."""
    return row.ratio_to_ar if row.ratio_to_ar is not None else row.decode_tps / ar.decode_tps


def choose_depth(summaries: Sequence[Summary]) -> tuple[int, float, float]:
    """(depth, margin, noise): the MTP depth with the best geometric-mean speed-up over AR
    across settings, or 0 when its margin over AR does not exceed the run-to-run spread."""
    settings = list(dict.fromkeys(s.setting for s in summaries))
    ar = {s.setting: s for s in summaries if s.mode == "ar"}
    if set(ar) != set(settings):
        raise MtplxError("tune: every setting needs an AR measurement")
    fixed = [s for s in summaries if s.mode == "mtp" and s.draft == DrafterKind.HEAD and s.threshold == 0]
    best_depth, best_score = 0, 1.0
    for depth in sorted({s.depth for s in fixed}):
        rows = {s.setting: s for s in fixed if s.depth == depth}
        ratios = [_ratio_to_ar(rows[k], ar[k]) for k in settings if k in rows and ar[k].decode_tps > 0]
        if len(ratios) != len(settings) or min(ratios) <= 0:
            continue
        score = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        if score > best_score:
            best_depth, best_score = depth, score
    if best_depth == 0:
        return 0, best_score - 1.0, max(s.spread for s in ar.values())
    best = [s for s in fixed if s.depth == best_depth]
    noise = max(max(s.spread for s in best), max(s.spread for s in ar.values()))
    margin = best_score - 1.0
    return (best_depth if margin > noise else 0), margin, noise


def _geometric_mean_ratio(rows: Sequence[Summary], ar: dict[str, Summary]) -> float | None:
    ratios = [
        _ratio_to_ar(r, ar[r.setting]) for r in rows if r.setting in ar and ar[r.setting].decode_tps > 0
    ]
    if not ratios or len(ratios) != len(ar) or min(ratios) <= 0:
        return None
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def choose_threshold(summaries: Sequence[Summary]) -> tuple[float | None, float]:
    """(threshold, ratio to the best fixed depth): the adaptive-length threshold with the best
    geometric-mean speed-up over AR, and how it compares with the fastest fixed depth
    (> 1 = adaptive faster). (None, 0.0) when the sweep measured no adaptive variant."""
    ar = {s.setting: s for s in summaries if s.mode == "ar"}
    head = [s for s in summaries if s.mode == "mtp" and s.draft == DrafterKind.HEAD]
    best_fixed = max(
        (
            score
            for depth in {s.depth for s in head if s.threshold == 0}
            if (
                score := _geometric_mean_ratio([s for s in head if s.threshold == 0 and s.depth == depth], ar)
            )
        ),
        default=None,
    )
    scored = [
        (score, t)
        for t in sorted({s.threshold for s in head if s.threshold > 0})
        if (score := _geometric_mean_ratio([s for s in head if s.threshold == t], ar))
    ]
    if not scored or best_fixed is None:
        return None, 0.0
    score, threshold = max(scored)
    return threshold, score / best_fixed


def make_entry(engine, summaries: Sequence[Summary], plan: SweepPlan, model: str | None) -> dict[str, Any]:
    depth, margin, noise = choose_depth(summaries)
    threshold, adaptive_vs_fixed = choose_threshold(summaries)
    installed = versions()
    batch_cost = engine.batch_cost_profile(remeasure=True)  # what the batched loop's draft policy reads
    return {
        "depth": depth,
        # Used only when adaptive drafting is asked for (`--adaptive`); measured at the largest depth.
        "adaptive_threshold": threshold,
        "adaptive_vs_best_fixed": round(adaptive_vs_fixed, 4),
        "margin_over_ar": round(margin, 4),
        "batch_cost": batch_cost.as_dict(),
        "batch_cost_for": batch_cost_identity(engine),  # a later start reuses it (`tuned.engine_batch_cost`)
        "spread": round(noise, 4),
        "tokens_per_sec": {f"{s.variant} | {s.setting}": round(s.decode_tps, 3) for s in summaries},
        "model": str(model) if model is not None else "default",
        "model_path": str(getattr(engine, "model_path", "") or ""),
        "machine": machine_info(),
        "mlx": installed["mlx"],
        "mtplx": installed["mtplx"],
        "tokens": plan.max_tokens,
        "repeats": plan.repeats,
        "settings": [s.name for s in plan.settings],
        "tuned_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def describe(entry: dict[str, Any]) -> str:
    if "depth" not in entry:  # a start saved the batch cost profile it measured; never tuned
        return "not tuned (a batch cost profile only)"
    depth = entry.get("depth")
    choice = "AR (no depth beat it)" if depth == 0 else f"depth {depth}"
    threshold = entry.get("adaptive_threshold")
    adaptive = (
        f"; adaptive threshold {threshold:g} ({entry.get('adaptive_vs_best_fixed', 0):.2f}x the best fixed depth)"
        if isinstance(threshold, (int, float))
        else ""
    )
    return (
        f"{choice}; margin over AR {entry.get('margin_over_ar', 0):+.1%} vs spread "
        f"{entry.get('spread', 0):.1%}{adaptive}; tuned {entry.get('tuned_at', '?')}"
    )


def show_text(config_path: str | Path | None = None) -> str:
    """What `mtplx tune --show` prints: every saved entry, this machine's marked with '*'."""
    path = config_file(config_path)
    entries = read_config(path)
    if not entries:
        return f"{path}: nothing tuned yet (run `mtplx tune`)"
    here = machine_key()
    lines = [f"{path}:"]
    for key in sorted(entries):
        entry = entries[key]
        fingerprint, _, machine = key.partition(" @ ")
        mark = "*" if machine == here else " "
        lines.append(f"{mark} {entry.get('model', '?')} [{fingerprint}] on {machine}: {describe(entry)}")
    return "\n".join(lines)


def _servable(engine, depths: list[int]) -> list[int]:
    """The default range, cut to what the engine's head serves."""
    limit = getattr(engine.head, "max_depth", None) if getattr(engine, "head", None) is not None else None
    return depths if limit is None else [d for d in depths if d <= int(limit)]


def tune_main(
    *,
    model: str | None = None,
    head: str | None = None,
    retune: bool = False,
    show: bool = False,
    config_path: str | Path | None = None,
    depths: str | Sequence[int] | None = None,
    tokens: int = TUNE_TOKENS,
    repeats: int = TUNE_REPEATS,
    prompts_file: str | None = None,
    per_kind: int | None = TUNE_PER_KIND,
    temps: Sequence[float] = DEFAULT_TEMPS,
    top_p: float = DEFAULT_TOP_P,
    progress: bool = True,
    engine=None,
    out=None,
) -> int:
    """`mtplx tune`: returns the exit code. Without ``retune`` an existing entry is kept."""
    out = out or sys.stdout
    if show:
        print(show_text(config_path), file=out)
        return 0
    check_counts(tokens, repeats)
    depth_list = parse_depths(depths)
    if not depth_list:
        raise MtplxError("depths: tune needs at least one MTP depth to compare with AR")
    prompts = load_prompts(prompts_file, per_kind=per_kind)
    if engine is None:
        from mtplx.engine.engine import Engine

        # An explicit depth: loading must not consult the very config being (re)built.
        engine = Engine.load(model, head=head, depth=depth_list[0])
    fingerprint = engine.fingerprint
    existing = None if retune else saved_entry(fingerprint, config_path)
    if existing is not None and "depth" in existing:  # not an entry holding only a batch cost profile
        print(f"already tuned: {describe(existing)} (pass --retune to measure again)", file=out)
        return 0
    if depths is None:
        depth_list = _servable(engine, depth_list)
    summaries, _, plan = run_benchmark(
        engine,
        depths=depth_list,
        tokens=tokens,
        repeats=repeats,
        prompts=prompts,
        temps=temps,
        top_p=top_p,
        stock=False,
        progress=progress,
        desc="tune",
        thresholds=ADAPTIVE_THRESHOLDS if max(depth_list) >= 2 else (),
    )
    entry = make_entry(engine, summaries, plan, model)
    path = save_entry(fingerprint, entry, config_path)
    print(markdown_table(summaries), file=out)
    print(f"\nsaved to {path}: {describe(entry)}", file=out)
    return 0
