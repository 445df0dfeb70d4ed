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
COMMANDS = {
    "generate": "generate",
    "chat": "chat",
    "inspect": "inspect",
    "doctor": "doctor",
    "convert": "convert",
    "convert-assistant": "convert_assistant",
    "forge": None,
    "bench": None,
    "tune": None,
    "serve": "serve",
}


def forge_config(args: argparse.Namespace):
    """The library's default ForgeConfig with only the flags the user gave replaced (no second set of defaults)."""
    from dataclasses import replace

    defaults = args.forge_defaults
    overrides = {name: getattr(args, name) for name in _FORGE_FLAGS if getattr(args, name) is not None}
    if args.data:
        overrides["data"] = tuple(args.data)
    if args.draft_vocab is not None:
        overrides["draft_vocab"] = (
            None
            if args.draft_vocab == "full"
            else ("auto" if args.draft_vocab == "auto" else _positive_int("--draft-vocab", args.draft_vocab))
        )
    if args.overwrite:
        overrides["overwrite"] = True
    if args.no_progress:
        overrides["progress"] = False
    return replace(defaults, **overrides) if overrides else defaults


def cmd_forge(args: argparse.Namespace) -> int:
    from mtplx.forge.run import forge

    report = forge(forge_config(args))
    print(
        f"wrote {report.manifest_path.parent} ({report.response_tokens} generated tokens, "
        f"{report.train_steps} steps, depth-1 acceptance {report.acceptance['1']})"
    )
    return 0


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise MtplxError(f"{name} must be a number, 'auto' or 'full' (got {text})") from None
    if value <= 0:
        raise MtplxError(f"{name} must be > 0 (got {value})")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    from mtplx.bench.run import bench_from_args

    return bench_from_args(args)


def cmd_tune(args: argparse.Namespace) -> int:
    from mtplx.bench.tune import tune_from_args

    return tune_from_args(args)


# Flags whose values map 1:1 onto ForgeConfig fields (defaults come from DEFAULT_FORGE_CONFIG).
_FORGE_FLAGS = (
    "model",
    "out_dir",
    "work_dir",
    "budget",
    "gen_tokens",
    "steps",
    "depth",
    "batch_size",
    "lr",
    "init_head",
    "head_layers",
    "seed",
    "hidden_source",
    "chain_source",
)


def _add_forge_args(frg: argparse.ArgumentParser) -> None:
    from mtplx.forge.config import DEFAULT_FORGE_CONFIG as d
    from mtplx.forge.config import FINE_TUNE_LR, SCRATCH_LR

    frg.add_argument("--model", help="local path or Hugging Face repo id (default: the embedded model)")
    frg.add_argument("--out", dest="out_dir", help=f"output head directory (default {d.out_dir})")
    frg.add_argument(
        "--data",
        action="append",
        help="prompts: .txt/.md/.rst/.py/.jsonl files or directories (repeatable; default: the offline set)",
    )
    frg.add_argument(
        "--budget",
        help="the whole run's budget: a time (2h, 45m) or generated tokens (3M, 500k); overrides --gen-tokens/--steps",
    )
    frg.add_argument("--gen-tokens", type=int, help=f"response tokens to generate (default {d.gen_tokens})")
    frg.add_argument("--steps", type=int, help=f"training steps (default {d.steps})")
    frg.add_argument("--depth", type=int, help=f"draft steps unrolled in training (default {d.depth})")
    frg.add_argument("--batch-size", type=int, help=f"sequences per step (default {d.batch_size})")
    frg.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate (default {SCRATCH_LR:g}; {FINE_TUNE_LR:g} with --init-head)",
    )
    frg.add_argument("--init-head", help="start from this forged head of the same model (default: none)")
    frg.add_argument(
        "--head-layers",
        type=int,
        help=f"decoder layers per draft step (default {d.head_layers}); with --init-head, layers beyond "
        "the init head's start as the identity",
    )
    frg.add_argument("--seed", type=int, help=f"seed of prompts, sampling and batches (default {d.seed})")
    frg.add_argument(
        "--hidden-source", choices=("pre_norm", "post_norm"), help=f"(default {d.hidden_source})"
    )
    frg.add_argument("--chain-source", choices=("pre_norm", "post_norm"), help=f"(default {d.chain_source})")
    frg.add_argument(
        "--draft-vocab", help=f"reduced draft vocabulary: a size, 'auto' or 'full' (default {d.draft_vocab})"
    )
    frg.add_argument(
        "--work-dir", help="where shards and checkpoints go (resumable; default under the mtplx cache)"
    )
    frg.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    frg.add_argument("--no-progress", action="store_true")
    frg.set_defaults(forge_defaults=d)


def _add_legacy(sub, name: str) -> None:
    if name == "forge":
        frg = sub.add_parser(
            "forge", help="train an MTP head for a model that has none, on the model's own generations"
        )
        _add_forge_args(frg)
        frg.set_defaults(func=cmd_forge, command_parser=frg)
    elif name == "bench":
        from mtplx.bench.run import add_bench_args

        bench = sub.add_parser(
            "bench", help="tokens/s of MTP vs AR vs stock mlx-lm, interleaved in one process"
        )
        add_bench_args(bench)
        bench.set_defaults(func=cmd_bench, command_parser=bench)
    else:
        from mtplx.bench.tune import add_tune_args

        tune = sub.add_parser(
            "tune", help="measure and save the fastest depth for this model on this machine"
        )
        add_tune_args(tune)
        tune.set_defaults(func=cmd_tune, command_parser=tune)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtplx", description="Exact MTP speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        if module_name is None:
            _add_legacy(sub, name)
            continue
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
