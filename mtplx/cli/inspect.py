"""`mtplx inspect`: describe a model without running it (MTP-ready / AR-only / unsupported)."""

from __future__ import annotations

import argparse
import json

from mtplx.cli.args import add_model_args

HELP = "describe a model without running it (MTP-ready / AR-only / unsupported)"


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser, adapters=False, positional=True)
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    info = inspect_model(args.model, head=args.head, dtype=args.dtype)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0
