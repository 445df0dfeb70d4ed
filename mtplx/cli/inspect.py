"""`mtplx inspect`: describe a model without running it (MTP-ready / AR-only / unsupported)."""

from __future__ import annotations

import argparse
import json

HELP = "describe a model without running it (MTP-ready / AR-only / unsupported)"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local path or Hugging Face repo id (default: the embedded model)",
    )
    parser.add_argument("--head", default=None, help="a forged MTP head directory to check against the model")
    parser.add_argument(
        "--dtype", choices=("float32", "q4"), default=None, help="build of the embedded default model"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from mtplx.checkpoints.inspect import format_inspection, inspect_model

    info = inspect_model(args.model, head=args.head, dtype=args.dtype)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0
