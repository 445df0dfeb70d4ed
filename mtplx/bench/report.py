"""A sweep's results as the user sees them: the markdown table, the JSON document, the PNG.

The JSON document holds every timed run (`records_from_document` reads them back), so a
saved result can be re-summarized and re-plotted by a later version without re-running
(`mtplx bench --report`). Every file is written whole (temp file, rename): an interrupted
write leaves the old file or none.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from mtplx import resources
from mtplx.bench.stats import Summary
from mtplx.bench.sweep import RunRecord, SweepPlan
from mtplx.engine.tuned import machine_info, versions
from mtplx.errors import MtplxError
from mtplx.io import atomic_write
from mtplx.spec_decode.sources import DrafterKind


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _drafter_counts(s: Summary) -> str:
    parts = [f"{name} {c['accepted']}/{c['drafted']}" for name, c in s.drafters.items() if c.get("drafted")]
    return ", ".join(parts) or "-"


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The results table; with a kind column when the summaries are per prompt kind, and a
    drafters column (accepted/drafted per drafter) when a sweep compares drafters."""
    by_kind = any(s.kind != "all" for s in summaries)
    drafters = any(s.draft != DrafterKind.HEAD for s in summaries if s.mode == "mtp")
    header = (
        ("| kind " if by_kind else "")
        + "| setting | variant | decode tok/s (median [min-max]) | prefill tok/s | x stock (paired) "
        "| x mtplx AR (paired) | acceptance per position | tau | tau theory | efficiency | peak GB |"
        + (" drafters (accepted/drafted) |" if drafters else "")
    )
    rows = [header, "|" + "---|" * (11 + by_kind + drafters)]
    for s in summaries:
        acceptance = "[" + ", ".join(f"{a:.2f}" for a in s.acceptance) + "]" if s.acceptance else "-"
        rows.append(
            (f"| {s.kind} " if by_kind else "")
            + f"| {s.setting} | {s.variant} | {s.decode_tps:.2f} [{s.decode_tps_min:.2f}-{s.decode_tps_max:.2f}] "
            f"| {s.prefill_tps:.1f} | {_fmt(s.ratio_to_stock, '.2f', 'x')} | {_fmt(s.ratio_to_ar, '.2f', 'x')} "
            f"| {acceptance} | {_fmt(s.tau, '.2f')} | {_fmt(s.tau_theory, '.2f')} | {_fmt(s.efficiency, '.2f')} "
            f"| {s.peak_memory_gb:.3f} |" + (f" {_drafter_counts(s)} |" if drafters else "")
        )
    return "\n".join(rows)


def git_commit() -> str | None:
    """The short commit of the checkout mtplx runs from; None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def head_weights_sha(head: str | None, model: str | None) -> str | None:
    """The forged head's weights hash from its manifest (which head was measured), if there is one."""
    try:
        from mtplx.checkpoints import load as loading

        head_dir = (
            Path(head)
            if head is not None
            else (resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME) if model is None else None)
        )
        if head_dir is None:
            return None
        return json.loads((head_dir / "manifest.json").read_text(encoding="utf-8")).get("weights_sha256")
    except (OSError, ValueError, ImportError, AttributeError):
        return None


def result_document(
    summaries: Sequence[Summary], records: Sequence[RunRecord], plan: SweepPlan, context: dict[str, Any]
) -> dict[str, Any]:
    """The saved result: provenance (versions, machine, ``context``), the plan, the summary and every run."""
    return {
        "schema": 1,
        **_origin(),
        **context,
        "plan": {
            "max_tokens": plan.max_tokens,
            "repeats": plan.repeats,
            "warmup_tokens": plan.warmup_tokens,
            "seed": plan.seed,
            "variants": [v.name for v in plan.variants],
            "settings": [asdict(s) | {"name": s.name} for s in plan.settings],
            "prompts": [{"id": p.id, "kind": p.kind, "source": p.source} for p in plan.prompts],
        },
        "summary": [asdict(s) for s in summaries],
        "runs": [
            asdict(r)
            | {
                "decode_tokens_per_sec": r.decode_tokens_per_sec,
                "prefill_tokens_per_sec": r.prefill_tokens_per_sec,
            }
            for r in records
        ],
    }


def _origin() -> dict[str, Any]:
    """When, which commit and versions, which machine: the head of every saved result."""
    return {
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "versions": versions(),
        "machine": machine_info(),
    }


def provenance(args: dict[str, Any]) -> dict[str, Any]:
    """The head of a benchmark script's JSON: `_origin` and the script's arguments (as strings)."""
    return {**_origin(), "args": {k: str(v) for k, v in args.items()}}


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    """``document`` as indented JSON, written whole."""
    text = json.dumps(document, indent=1)
    with atomic_write(path) as handle:
        handle.write(text + "\n")


def records_from_document(document: dict[str, Any]) -> list[RunRecord]:
    """The timed runs of a saved JSON result (to re-summarize or re-plot without re-running)."""
    names = {f.name for f in fields(RunRecord)}
    try:
        return [RunRecord(**{k: v for k, v in run.items() if k in names}) for run in document["runs"]]
    except (KeyError, TypeError) as e:
        raise MtplxError(f"not an mtplx bench result ({type(e).__name__}: {e})") from None


def plot_title(document: dict[str, Any]) -> str:
    """Model, machine and run lengths of a result document, for the plot's title."""
    machine = document.get("machine", {})
    plan = document.get("plan", {})
    return (
        f"{document.get('model', '')} | {machine.get('cpu', '?')} ({machine.get('cores', '?')} "
        f"cores, {machine.get('device', '?')}) | {plan.get('max_tokens', '?')} tokens, "
        f"median of {plan.get('repeats', '?')}"
    )


def write_plot(path: str | Path, summaries: Sequence[Summary], title: str = "") -> None:
    """Left: decode tokens/s by depth (0 = mtplx AR), one line per setting with min-max bars,
    stock mlx-lm as a dashed line in the same colour. Right: the paired speed-up over stock
    by depth (drift cancels there, so it is the panel to read on a busy machine)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and no GUI backend import on a server
        import matplotlib.pyplot as plt
    except ImportError:
        raise MtplxError(
            "plot: matplotlib is not installed (pip install 'mtplx[plot]'), or pass --no-plot"
        ) from None
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    try:
        settings = list(dict.fromkeys(s.setting for s in summaries))
        # The depth axis is the head's; lookup/auto rows are in the tables, not the plot.
        summaries = [
            s for s in summaries if s.mode != "mtp" or (s.draft == DrafterKind.HEAD and s.threshold == 0)
        ]
        depths = sorted({s.depth for s in summaries if s.mode in ("ar", "mtp")}) or [0]
        for index, setting in enumerate(settings):
            rows = [s for s in summaries if s.setting == setting]
            _plot_setting(ax, ax_ratio, rows, setting, f"C{index}")
        _label_axes(ax, ax_ratio, depths)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format="png")
    finally:
        plt.close(fig)


def _plot_setting(ax, ax_ratio, rows: Sequence[Summary], setting: str, color: str) -> None:
    """One setting's lines: mtplx by depth with min-max bars (left), its paired speed-up (right),
    stock mlx-lm as a dashed level (left)."""
    ours = sorted((s for s in rows if s.mode in ("ar", "mtp")), key=lambda s: s.depth)
    if ours:
        err = [
            [s.decode_tps - s.decode_tps_min for s in ours],
            [s.decode_tps_max - s.decode_tps for s in ours],
        ]
        ax.errorbar(
            [s.depth for s in ours],
            [s.decode_tps for s in ours],
            yerr=err,
            color=color,
            marker="o",
            capsize=3,
            label=f"mtplx, {setting}",
        )
        ratios = [(s.depth, s.ratio_to_stock) for s in ours if s.ratio_to_stock is not None]
        if ratios:
            ax_ratio.plot(
                [d for d, _ in ratios], [r for _, r in ratios], color=color, marker="o", label=setting
            )
    stock = next((s for s in rows if s.mode == "stock"), None)
    if stock is not None:
        ax.axhline(
            stock.decode_tps, color=color, linestyle="--", linewidth=1, label=f"stock mlx-lm, {setting}"
        )


def _label_axes(ax, ax_ratio, depths: Sequence[int]) -> None:
    ax.set_ylabel("decode tokens/s (median, min-max bars)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax_ratio.axhline(1.0, color="black", linestyle="--", linewidth=1, label="stock mlx-lm")
    ax_ratio.set_ylabel("speed-up over stock mlx-lm (paired median)")
    ax_ratio.legend(fontsize=8)
    for a in (ax, ax_ratio):
        a.set_xlabel("MTP depth (0 = mtplx AR)")
        a.set_xticks(depths)
        a.grid(alpha=0.3)
