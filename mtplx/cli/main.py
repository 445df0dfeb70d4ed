"""`mtplx` command line: a command table; each command module owns its flags.

As in mlx-lm's `mlx_lm/cli.py`: every command is a module of this package with ``HELP``,
``add_args(parser)`` and ``run(args) -> int``; the flag groups several commands share are
declared once in `mtplx.cli.args`. Building the parser imports no MLX (a typo costs no load
time); `run` imports what the command needs. Errors the API raises name the field; the one
handler here rewrites it into the flag the user typed (`args.user_message`) and exits 2 with
one line, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import mtplx  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
from mtplx.cli.args import user_message
from mtplx.errors import MtplxError

# command -> the module (in this package) that owns it, in `mtplx --help` order.
COMMANDS: dict[str, str] = {
    "generate": "generate",
    "chat": "chat",
    "inspect": "inspect",
    "doctor": "doctor",
    "convert": "convert",
    "convert-assistant": "convert_assistant",
    "forge": "forge",
    "bench": "bench",
    "tune": "tune",
    "serve": "serve",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtplx", description="Exact MTP speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"mtplx.cli.{module_name}")
        command = sub.add_parser(name, help=module.HELP)
        module.add_args(command)
        command.set_defaults(func=module.run, command_parser=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # the subcommand's usage, not the top level's
        args.command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except MtplxError as err:
        print(f"mtplx: error: {user_message(err, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtplx: interrupted", file=sys.stderr)
        return 130
