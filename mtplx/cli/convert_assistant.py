"""`mtplx convert-assistant`: write a Gemma 4 assistant beside its (converted) target as `<target>-assistant`."""

from __future__ import annotations

import argparse

HELP = "write a Gemma 4 assistant beside its (converted, e.g. 4-bit) target as <target>-assistant"


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assistant", help="the assistant directory or cached repo id")
    parser.add_argument("target", help="the target model directory it drafts for")
    parser.add_argument(
        "--bits", type=int, default=None, help="quantize the drafter (4 or 8; default: bfloat16, unquantized)"
    )


def run(args: argparse.Namespace) -> int:
    from mtplx.heads.gemma4_assistant import convert_assistant

    print(f"wrote {convert_assistant(args.assistant, args.target, bits=args.bits)}")
    return 0
