"""`mtplx forge`: its flags, read over the library's one set of defaults, and the run.

Every default comes from `DEFAULT_FORGE_CONFIG` (`mtplx.forge.config`, which imports no
MLX, so `mtplx forge --help` loads none): a flag left out is None here and leaves the
library's value in place; `mtplx.forge.run` (MLX, the model) is imported when the command runs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from mtplx.cli.args import check_model_spec
from mtplx.errors import MtplxError
from mtplx.forge.config import DEFAULT_FORGE_CONFIG, FINE_TUNE_LR, FORGED_DRAFTERS, SCRATCH_LR, ForgeConfig
from mtplx.learn.config import DEFAULT_LEARN_CONFIG

# Flags whose values map 1:1 onto ForgeConfig fields (defaults come from DEFAULT_FORGE_CONFIG).
_FLAGS = (
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
    "drafter",
)


HELP = "train an MTP head for a model that has none, on the model's own generations"


def add_args(parser: argparse.ArgumentParser) -> None:
    """The `mtplx forge` flags; none has a default of its own (see the module docstring)."""
    defaults = DEFAULT_FORGE_CONFIG  # every default the help texts name
    parser.add_argument("--model", help="local path or Hugging Face repo id (default: the embedded model)")
    parser.add_argument("--out", dest="out_dir", help=f"output head directory (default {defaults.out_dir})")
    parser.add_argument(
        "--data",
        action="append",
        help="prompts: .txt/.md/.rst/.py/.jsonl files or directories (repeatable; default: the offline set)",
    )
    parser.add_argument(
        "--budget",
        help="the whole run's budget: a time (2h, 45m) or generated tokens (3M, 500k); overrides --gen-tokens/--steps",
    )
    parser.add_argument(
        "--gen-tokens", type=int, help=f"response tokens to generate (default {defaults.gen_tokens})"
    )
    parser.add_argument("--steps", type=int, help=f"training steps (default {defaults.steps})")
    parser.add_argument(
        "--depth", type=int, help=f"draft steps unrolled in training (default {defaults.depth})"
    )
    parser.add_argument("--batch-size", type=int, help=f"sequences per step (default {defaults.batch_size})")
    parser.add_argument(
        "--lr",
        type=float,
        help=f"peak learning rate (default {SCRATCH_LR:g}; {FINE_TUNE_LR:g} with --init-head)",
    )
    parser.add_argument("--init-head", help="start from this forged head of the same model (default: none)")
    parser.add_argument(
        "--head-layers",
        type=int,
        help=f"decoder layers per draft step (default {defaults.head_layers}); with --init-head, layers beyond "
        "the init head's start as the identity",
    )
    parser.add_argument(
        "--drafter",
        choices=FORGED_DRAFTERS,
        help="forge this drafter instead of an MTP head: an EAGLE-3 drafter in the speculators layout "
        "(load it with --head DIR, draft with --draft eagle3); --draft-vocab sizes its d2t vocabulary",
    )
    parser.add_argument(
        "--seed", type=int, help=f"seed of prompts, sampling and batches (default {defaults.seed})"
    )
    parser.add_argument(
        "--hidden-source", choices=("pre_norm", "post_norm"), help=f"(default {defaults.hidden_source})"
    )
    parser.add_argument(
        "--chain-source", choices=("pre_norm", "post_norm"), help=f"(default {defaults.chain_source})"
    )
    parser.add_argument(
        "--draft-vocab",
        help=f"reduced draft vocabulary: a size, 'auto' or 'full' (default {defaults.draft_vocab})",
    )
    parser.add_argument(
        "--work-dir", help="where shards and checkpoints go (resumable; default under the mtplx cache)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--from-traffic",
        metavar="DIR",
        help="train from the traffic `mtplx serve --learn DIR` recorded, starting from the head in use "
        "(--init-head, else DIR's last learned head, else the model's); the newest requests are held "
        "out, and the head (--out, default DIR/forged-from-traffic) is written only if it measures better",
    )
    parser.add_argument(
        "--samples",
        type=int,
        help="with --from-traffic: answers the model samples to each older logged request, trained on "
        f"too (default {DEFAULT_LEARN_CONFIG.samples}; README: Learning from traffic)",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(forge_defaults=defaults)


def config_from_args(args: argparse.Namespace) -> ForgeConfig:
    """The library's default ForgeConfig with only the flags the user gave replaced (no second set of defaults)."""
    defaults = args.forge_defaults
    overrides = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
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


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise MtplxError(f"{name} must be a number, 'auto' or 'full' (got {text})") from None
    if value <= 0:
        raise MtplxError(f"{name} must be > 0 (got {value})")
    return value


def run(args: argparse.Namespace) -> int:
    """Forge the head the flags describe and say where it went; the exit code."""
    if args.from_traffic is not None:
        return _from_traffic(args)
    if args.samples is not None:
        raise MtplxError("--samples: applies to --from-traffic only")
    cfg = config_from_args(args)
    check_model_spec(cfg.model)  # a missing model fails before the forge imports MLX
    if cfg.drafter is not None:
        from mtplx.forge.drafter import forge_drafter as forge
    else:
        from mtplx.forge.run import forge

    report = forge(cfg)
    print(
        f"wrote {report.manifest_path.parent} ({report.response_tokens} generated tokens, "
        f"{report.train_steps} steps, depth-1 acceptance {report.acceptance['1']})"
    )
    return 0


def _from_traffic(args: argparse.Namespace) -> int:
    """`--from-traffic DIR`: one learning round over the log (`mtplx.learn.offline`), its flags over
    `DEFAULT_LEARN_CONFIG`; generation flags do not apply."""
    for name in (
        "data",
        "budget",
        "gen_tokens",
        "work_dir",
        "head_layers",
        "hidden_source",
        "chain_source",
        "draft_vocab",
        "drafter",
    ):
        if getattr(args, name) is not None:
            raise MtplxError(f"--{name.replace('_', '-')}: does not apply to --from-traffic")
    overrides = {
        name: getattr(args, name)
        for name in ("steps", "depth", "batch_size", "lr", "seed")
        if getattr(args, name) is not None
    }
    for name, value in overrides.items():
        if name != "seed" and not value > 0:
            raise MtplxError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    if args.samples is not None:
        if args.samples < 0:
            raise MtplxError(f"--samples: must be >= 0, got {args.samples}")
        overrides["samples"] = args.samples
    if "depth" in overrides:
        weights = DEFAULT_LEARN_CONFIG.step_weights  # the last weight repeats for deeper steps
        overrides["step_weights"] = (weights + weights[-1:] * overrides["depth"])[: overrides["depth"]]
    cfg = replace(DEFAULT_LEARN_CONFIG, **overrides)
    from mtplx.learn.offline import forge_from_traffic

    report = forge_from_traffic(
        args.from_traffic, args.model, args.init_head, args.out_dir, cfg, args.overwrite, not args.no_progress
    )
    print(report.summary())
    return 0
