"""`mtplx bench`: its flags and the sweep (or the re-report of a saved result) they ask for.

Imports no MLX: the benchmark loads MLX and the model only inside the run.
"""

from __future__ import annotations

import argparse

from mtplx.bench.run import bench_main, report_main
from mtplx.bench.sweep import DEFAULT_REPEATS, DEFAULT_TOKENS, DEFAULT_TOP_P, DEFAULT_WARMUP_TOKENS, DRAFTS
from mtplx.cli.args import add_model_args
from mtplx.errors import MtplxError

HELP = "tokens/s of MTP vs AR vs stock mlx-lm, interleaved in one process"


def measurement_kwargs(args: argparse.Namespace) -> dict:
    """The flags bench and tune share, as `bench_main` / `tune_main` keywords."""
    same_name = {name: getattr(args, name) for name in ("model", "head", "depths", "tokens", "repeats")}
    return {**same_name, "progress": not args.no_progress}


def add_args(parser: argparse.ArgumentParser) -> None:
    """The `mtplx bench` flags (benchmarks/bench_generate.py runs `mtplx bench`)."""
    add_model_args(parser, builds=False)
    _add_sweep_args(parser)
    _add_output_args(parser)


def _add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """What the sweep compares: depths, lengths, prompts, drafters, sampling settings."""
    parser.add_argument(
        "--depths", default="1-4", help="MTP depths to sweep, e.g. 1-4 or 1,2,4; 0 = AR only (default 1-4)"
    )
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens per generation (default {DEFAULT_TOKENS})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed repeats; the median is quoted (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts: .jsonl ({id, kind, prompt|messages}) or one raw prompt per line (default: the shipped suite)",
    )
    parser.add_argument("--kinds", default=None, help="comma-separated prompt kinds to keep, e.g. code,chat")
    parser.add_argument(
        "--drafts",
        default="head",
        help=f"drafters to compare, a subset of {','.join(DRAFTS)} (default head; lookup runs once, no depth)",
    )
    parser.add_argument(
        "--thresholds",
        default="",
        help="adaptive head drafting to compare, one variant per threshold, each up to the largest "
        "depth, e.g. 0.2,0.4 (default none)",
    )
    parser.add_argument("--per-kind", type=int, default=None, help="keep the first N prompts of each kind")
    parser.add_argument("--temps", default="0,0.7", help="comma-separated temperatures (default 0,0.7)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        help=f"top-p at non-zero temperatures (default {DEFAULT_TOP_P})",
    )


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    """Where results go, the baseline, warm-up, seed and progress, and the no-run report."""
    parser.add_argument(
        "--json", dest="json_path", default="bench.json", help="JSON output (default bench.json)"
    )
    parser.add_argument("--plot", dest="plot_path", default=None, help="PNG output (default bench.png)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock mlx-lm baseline")
    parser.add_argument(
        "--allow-eos",
        action="store_true",
        help="let EOS end a generation (default: EOS banned for every variant alike)",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=DEFAULT_WARMUP_TOKENS,
        help="tokens per untimed warm-up run (0 = none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="no run: re-print the table of a saved result (and re-plot it with --plot)",
    )


def _floats(text: str, name: str = "temps", example: str = "0,0.7") -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MtplxError(f"{name}: cannot read {text!r} (use e.g. {example})") from None


def run(args: argparse.Namespace) -> int:
    """Run the sweep the flags describe (or, with --report, re-print a saved one); the exit code."""
    if getattr(args, "report", None):
        return report_main(args.report, plot_path=None if args.no_plot else args.plot_path)
    return bench_main(
        **measurement_kwargs(args),
        prompts_file=args.prompts,
        kinds=args.kinds.split(",") if args.kinds else None,
        per_kind=args.per_kind,
        temps=_floats(args.temps),
        top_p=args.top_p,
        json_path=args.json_path or None,
        plot_path=None if args.no_plot else (args.plot_path or "bench.png"),
        stock=not args.no_stock,
        ban_eos=not args.allow_eos,
        warmup_tokens=args.warmup_tokens,
        seed=args.seed,
        drafts=args.drafts,
        thresholds=_floats(args.thresholds, "thresholds", "0.2,0.4"),
    )
