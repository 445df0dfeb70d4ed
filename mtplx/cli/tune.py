"""`mtplx tune`: its flags and the tuning run (or the listing of saved choices) they ask for."""

from __future__ import annotations

import argparse

from mtplx.bench.tune import TUNE_REPEATS, TUNE_TOKENS, tune_main
from mtplx.cli.args import add_model_args
from mtplx.cli.bench import measurement_kwargs

HELP = "measure and save the fastest depth for this model on this machine"


def add_args(parser: argparse.ArgumentParser) -> None:
    """The `mtplx tune` flags."""
    add_model_args(parser, builds=False)
    parser.add_argument(
        "--retune", action="store_true", help="measure again even if this model is tuned here"
    )
    parser.add_argument("--show", action="store_true", help="print the saved choices and exit")
    parser.add_argument("--config", default=None, help="tune config file (default ~/.config/mtplx/tune.json)")
    parser.add_argument("--depths", default=None, help="depths to try (default 1-4)")
    parser.add_argument(
        "--tokens", type=int, default=TUNE_TOKENS, help=f"tokens per run (default {TUNE_TOKENS})"
    )
    parser.add_argument(
        "--repeats", type=int, default=TUNE_REPEATS, help=f"timed repeats (default {TUNE_REPEATS})"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Tune (or, with --show, list what is saved); the exit code."""
    return tune_main(**measurement_kwargs(args), retune=args.retune, show=args.show, config_path=args.config)
