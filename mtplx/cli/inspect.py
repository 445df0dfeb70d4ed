"""`mtplx inspect`: describe a model without running it (MTP-ready / AR-only / unsupported)."""

from __future__ import annotations

import argparse
import json

from mtplx.cli.args import add_model_args, check_model_spec

HELP = "describe a model without running it (MTP-ready / AR-only / unsupported)"


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser, adapters=False, positional=True)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--learn",
        metavar="DIR",
        default=None,
        help="also report a `serve --learn DIR` directory: the learned head's version, its acceptance over "
        "time, the traffic log, the trainer's share",
    )


def run(args: argparse.Namespace) -> int:
    learn = None
    if args.learn is not None:
        from mtplx.learn.report import learn_report

        learn = learn_report(args.learn)  # before the model: a wrong directory fails fast
    check_model_spec(args.model)  # before the heads' modules import MLX
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    info = inspect_model(args.model, head=args.head, dtype=args.dtype)
    if learn is not None:
        info = {**info, "learn": learn}
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    if learn is not None and not args.json:
        from mtplx.learn.report import format_learn_report

        print(format_learn_report(learn))
    return 0
