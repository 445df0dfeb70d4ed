"""`mtplx bench`: stock mlx-lm vs mtplx AR vs mtplx MTP per depth, in one process, interleaved.

How a sweep runs (and why), stage by stage:

* `mtplx.bench.suite`: the prompts, all encoded before the first run.
* `mtplx.bench.sweep`: what is compared and in which order: every variant once per
  (repeat, prompt, setting) block, back to back, after one untimed warm-up each.
* `mtplx.bench.runners`: one model for stock mlx-lm and mtplx, EOS banned alike (equal
  lengths), prefill and decode timed from the moments tokens reach the caller.
* `mtplx.bench.stats`: medians over repeats, paired (same-block) ratios, acceptance per
  draft position, tau* and efficiency.
* `mtplx.bench.report`: the markdown table, the JSON document with every run, the PNG.

Here: validate everything (before the model loads where it can), sweep, report.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mtplx.bench.report import (
    git_commit,
    head_weights_sha,
    markdown_table,
    plot_title,
    records_from_document,
    result_document,
    write_json,
    write_plot,
)
from mtplx.bench.runners import EngineRunner
from mtplx.bench.stats import Summary, summarize, summarize_by_kind
from mtplx.bench.suite import Prompt, check_prompts_fit, load_prompts
from mtplx.bench.sweep import (
    DEFAULT_DEPTHS,
    DEFAULT_REPEATS,
    DEFAULT_TEMPS,
    DEFAULT_TOKENS,
    DEFAULT_TOP_P,
    DEFAULT_WARMUP_TOKENS,
    Runner,
    RunRecord,
    SweepPlan,
    check_counts,
    check_depths_servable,
    check_thresholds,
    make_settings,
    make_variants,
    parse_depths,
    parse_drafts,
    run_sweep,
)
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import DrafterKind


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def run_benchmark(
    engine,
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    tokens: int = DEFAULT_TOKENS,
    repeats: int = DEFAULT_REPEATS,
    prompts: Sequence[Prompt] | None = None,
    temps: Sequence[float] = DEFAULT_TEMPS,
    top_p: float = DEFAULT_TOP_P,
    stock: bool = True,
    ban_eos: bool = True,
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
    seed: int = 0,
    progress: bool = True,
    runner: Runner | None = None,
    desc: str = "bench",
    drafts: Sequence[str] = ("head",),
    thresholds: Sequence[float] = (),
) -> tuple[list[Summary], list[RunRecord], SweepPlan]:
    """Validate everything, then run the interleaved sweep on a loaded engine."""
    check_counts(tokens, repeats)
    if warmup_tokens < 0:
        raise MtplxError(f"warmup_tokens: must be >= 0, got {warmup_tokens}")
    depths = parse_depths(list(depths))
    drafts = parse_drafts(list(drafts))
    if any(d in (DrafterKind.HEAD, DrafterKind.AUTO) for d in drafts):  # lookup, block drafters: no head
        check_depths_servable(engine, depths)
    prompts = list(prompts) if prompts is not None else load_prompts()
    if not prompts:
        raise MtplxError("prompts: none given")
    check_prompts_fit(engine, prompts, tokens)
    plan = SweepPlan(
        make_variants(depths, stock=stock, drafts=drafts, thresholds=thresholds),
        make_settings(temps, top_p),
        prompts,
        tokens,
        repeats,
        warmup_tokens,
        seed,
    )
    runner = runner or EngineRunner(engine, ban_eos=ban_eos)
    with _progress(plan.total_runs, progress, desc) as bar:

        def on_run(record: RunRecord) -> None:
            bar.set_postfix_str(f"{record.variant} {record.setting} {record.decode_tokens_per_sec:.1f} tok/s")
            bar.update(1)

        records = run_sweep(runner, plan, on_run)
    return summarize(records), records, plan


def bench_main(
    *,
    model: str | None = None,
    head: str | None = None,
    depths: str | Sequence[int] | None = None,
    tokens: int = DEFAULT_TOKENS,
    repeats: int = DEFAULT_REPEATS,
    prompts_file: str | None = None,
    kinds: Sequence[str] | None = None,
    per_kind: int | None = None,
    temps: Sequence[float] = DEFAULT_TEMPS,
    top_p: float = DEFAULT_TOP_P,
    json_path: str | None = "bench.json",
    plot_path: str | None = "bench.png",
    stock: bool = True,
    ban_eos: bool = True,
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
    seed: int = 0,
    progress: bool = True,
    engine=None,
    out=None,
    drafts: str | Sequence[str] | None = None,
    thresholds: Sequence[float] = (),
) -> int:
    """`mtplx bench`: load, sweep, print the markdown table, write JSON and PNG (atomically).

    Validation happens before the model loads where it can (counts, depths, prompts file),
    so a typo costs no load time. Returns the process exit code.
    """
    check_counts(tokens, repeats)
    commit = git_commit()  # now: files (a head, the engine) may change in the tree while the sweep runs
    depth_list = parse_depths(depths)
    draft_list = parse_drafts(drafts)
    threshold_list = check_thresholds(thresholds, depth_list)
    settings = make_settings(temps, top_p)
    prompt_list = load_prompts(prompts_file, kinds=kinds, per_kind=per_kind)
    engine = engine if engine is not None else _load_engine(model, head, depth_list)
    head_sha = head_weights_sha(head, model)
    summaries, records, plan = run_benchmark(
        engine,
        depths=depth_list,
        tokens=tokens,
        repeats=repeats,
        prompts=prompt_list,
        temps=[s.temperature for s in settings],
        top_p=top_p,
        stock=stock,
        ban_eos=ban_eos,
        warmup_tokens=warmup_tokens,
        seed=seed,
        progress=progress,
        drafts=draft_list,
        thresholds=threshold_list,
    )
    context = _context(engine, model, head, commit, head_sha, ban_eos)
    document = result_document(summaries, records, plan, context)
    _write_outputs(document, summaries, records, json_path, plot_path, out or sys.stdout)
    return 0


def _load_engine(model: str | None, head: str | None, depths: Sequence[int]):
    from mtplx.engine.engine import Engine

    # An explicit depth, so loading never consults the tune config (the sweep sets depths itself).
    return Engine.load(model, head=head, depth=depths[0] if depths else 1)


def _context(
    engine, model: str | None, head: str | None, commit: str | None, head_sha: str | None, ban_eos: bool
) -> dict[str, Any]:
    """What the result records about what was measured: the model, the head, the tree, the command."""
    return {
        "model": str(model) if model is not None else "default (SmolLM2-135M-Instruct)",
        "model_path": str(getattr(engine, "model_path", "") or ""),
        "head": head,
        "commit": commit,
        "head_weights_sha256": head_sha,
        "fingerprint": getattr(engine, "fingerprint", ""),
        "ban_eos": ban_eos,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }


def _print_tables(summaries: Sequence[Summary], records: Sequence[RunRecord], out) -> None:
    """The table over all prompts, then one per prompt kind when the prompts are of several kinds."""
    print(markdown_table(summaries), file=out)
    if len({r.kind for r in records}) > 1:
        print("\nper prompt kind:\n\n" + markdown_table(summarize_by_kind(records)), file=out)


def _write_outputs(
    document: dict[str, Any],
    summaries: Sequence[Summary],
    records: Sequence[RunRecord],
    json_path: str | None,
    plot_path: str | None,
    out,
) -> None:
    """Print the tables, then write the JSON and the PNG (each only when its path is given)."""
    _print_tables(summaries, records, out)
    if json_path:
        write_json(json_path, document)
        print(f"\nwrote {json_path}", file=out)
    if plot_path:
        write_plot(plot_path, summaries, plot_title(document))
        print(f"wrote {plot_path}", file=out)


def report_main(
    json_path: str | Path, *, plot_path: str | None = None, update_json: bool = False, out=None
) -> int:
    """Re-summarize a saved result (`mtplx bench --report FILE`): print the table, optionally
    re-plot it and rewrite the JSON's summary with this version's summary rules."""
    out = out or sys.stdout
    path = Path(json_path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtplxError(f"{path}: unreadable bench result ({type(e).__name__})") from None
    if not isinstance(document, dict):
        raise MtplxError(f"{path}: not an mtplx bench result")
    records = records_from_document(document)
    summaries = summarize(records)
    _print_tables(summaries, records, out)
    if plot_path:
        write_plot(plot_path, summaries, plot_title(document))
    if update_json:
        document["summary"] = [asdict(s) for s in summaries]
        write_json(path, document)
    return 0
