"""`mtplx` command line: argument parsing and printing only."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import mtplx  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
from mtplx.drafters import DRAFT_KINDS
from mtplx.errors import MtplxError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="local path or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--head", default=None, help="a forged MTP head directory (default: the model's own head)"
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )


def _format_stats(stats) -> str:
    lines = [
        f"mode: {stats.mode}" + (f" (depth {stats.depth})" if stats.mode == "mtp" else ""),
        f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_sec:.1f} tokens/s",
        f"generation: {stats.generated_tokens} tokens, {stats.decode_tokens_per_sec:.2f} tokens/s",
    ]
    if stats.mode == "mtp":
        per_position = ", ".join(f"{a:.2f}" for a in stats.acceptance_per_position)
        lines.append(f"verify cycles: {stats.cycles}, tokens per cycle: {stats.tokens_per_cycle:.2f}")
        lines.append(f"acceptance per draft position: [{per_position}]")
        for name, counts in stats.drafters.items():
            lines.append(f"drafter {name}: {counts['accepted']}/{counts['drafted']} drafts accepted")
    lines.append(f"peak memory: {stats.peak_memory_gb:.3f} GB")
    return "\n".join(lines)


def _lookup_config(args: argparse.Namespace):
    from mtplx.drafters.lookup import LookupConfig

    defaults = LookupConfig()
    return LookupConfig(
        min_ngram=args.lookup_min_ngram if args.lookup_min_ngram is not None else defaults.min_ngram,
        max_ngram=args.lookup_max_ngram if args.lookup_max_ngram is not None else defaults.max_ngram,
        max_tokens=args.lookup_max_tokens if args.lookup_max_tokens is not None else defaults.max_tokens,
    ).validate()


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return args.prompt
    if not sys.stdin.isatty():
        return sys.stdin.read()
    raise MtplxError("prompt: give one as an argument or on standard input")


def cmd_generate(args: argparse.Namespace) -> int:
    from mtplx.engine import Engine
    from mtplx.sampling import SamplerConfig

    # Validate what needs no model first: a typo should cost no load time.
    sampling = _sampling_kwargs(args)
    SamplerConfig(**{k: v for k, v in sampling.items() if k != "seed"})
    if args.max_tokens <= 0:
        raise MtplxError(f"max_tokens: must be > 0, got {args.max_tokens}")
    if args.depth is not None and args.depth < 1:
        raise MtplxError(f"depth: must be >= 1, got {args.depth}")
    lookup = _lookup_config(args)
    if args.draft is not None and args.draft not in DRAFT_KINDS:
        raise MtplxError(f"--draft: must be one of {', '.join(DRAFT_KINDS)}, got {args.draft!r}")
    prompt = _read_prompt(args)
    engine = Engine.load(
        args.model, head=args.head, depth=args.depth, dtype=args.dtype, draft_model=args.draft_model
    )
    chat = (
        args.chat if args.chat is not None else getattr(engine.tokenizer, "chat_template", None) is not None
    )
    if (
        args.mtp is None
        and args.draft in (None, "auto")
        and not engine.has_head
        and engine.draft_model is None
    ):
        print(
            "mtplx: note: this model has no MTP head, drafting by prompt lookup only (train one with `mtplx forge`)",
            file=sys.stderr,
        )
    stream = engine.stream(
        prompt,
        max_tokens=args.max_tokens,
        stop=args.stop,
        mtp=args.mtp,
        greedy_draft=args.greedy_draft,
        chat=chat,
        draft=args.draft,
        lookup=lookup,
        adaptive=args.adaptive,
        **sampling,
    )
    text, tokens, chunk = [], [], None
    try:
        for chunk in stream:
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if not args.json:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        if not args.json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print("mtplx: interrupted", file=sys.stderr)
        if chunk is not None and (args.stats or args.json):
            print(_format_stats(chunk.stats), file=sys.stderr)
        return 130
    if args.json:
        print(
            json.dumps(
                {
                    "text": "".join(text),
                    "token_ids": tokens,
                    "finish_reason": chunk.finish_reason,
                    "stats": chunk.stats.as_dict(),
                }
            )
        )
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if args.stats and chunk is not None:
        print(_format_stats(chunk.stats), file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from mtplx.convert import convert_gguf

    out = convert_gguf(args.gguf, args.out, dtype=args.dtype, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from mtplx.inspect import format_inspection, inspect_model

    info = inspect_model(args.model)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def cmd_forge(args: argparse.Namespace) -> int:
    from mtplx.forge import forge

    draft_vocab = (
        None
        if args.draft_vocab in (None, "full")
        else ("auto" if args.draft_vocab == "auto" else _positive_int("--draft-vocab", args.draft_vocab))
    )
    report = forge(
        args.model,
        args.out,
        args.data or None,
        steps=args.steps,
        train_tokens=args.train_tokens,
        seed=args.seed,
        hidden_source=args.hidden_source,
        compare_steps=args.compare_steps,
        draft_vocab=draft_vocab,
        work_dir=args.work_dir,
        progress=not args.no_progress,
    )
    print(f"wrote {report.manifest_path.parent}")
    return 0


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise MtplxError(f"{name}: expected a number, 'auto' or 'full', got {text!r}") from None
    if value <= 0:
        raise MtplxError(f"{name}: must be > 0, got {value}")
    return value


def cmd_bench(args: argparse.Namespace) -> int:
    from mtplx.bench import bench_from_args

    return bench_from_args(args)


def cmd_tune(args: argparse.Namespace) -> int:
    from mtplx.tune import tune_from_args

    return tune_from_args(args)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtplx", description="Exact MTP speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (streams to stdout)")
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read standard input)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument(
        "--depth",
        "--num-draft-tokens",
        dest="depth",
        type=int,
        default=None,
        help="most draft tokens per verify cycle from the head or draft model (default: tuned, else the head's)",
    )
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument(
        "--dtype",
        choices=("float32", "q4"),
        default=None,
        help="build of the embedded default model (default float32, the faster one on CPU)",
    )
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    speculative = gen.add_mutually_exclusive_group()
    speculative.add_argument(
        "--mtp",
        dest="mtp",
        action="store_true",
        default=None,
        help="require MTP speculative decoding (default: on when the model has a head)",
    )
    speculative.add_argument(
        "--no-mtp", dest="mtp", action="store_false", help="plain autoregressive decoding"
    )
    gen.add_argument("--greedy-draft", action="store_true", help="draft the head's argmax (still exact)")
    gen.add_argument(
        "--draft",
        default=None,
        metavar="{" + ",".join(DRAFT_KINDS) + "}",
        help="drafter: auto (default: prompt lookup where the text recurs, else the draft model or head), "
        "head, lookup, model, none",
    )
    gen.add_argument("--draft-model", default=None, help="a smaller mlx-lm model with the same tokenizer")
    gen.add_argument(
        "--lookup-min-ngram", type=int, default=None, help="shortest suffix prompt lookup matches"
    )
    gen.add_argument(
        "--lookup-max-ngram", type=int, default=None, help="longest suffix prompt lookup matches"
    )
    gen.add_argument("--lookup-max-tokens", type=int, default=None, help="most tokens one lookup proposes")
    gen.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="stop head drafting early when the head is unsure (threshold from `mtplx tune`)",
    )
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the chat template (default when the model has one)",
    )
    mode.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as raw text")
    gen.add_argument("--stats", action="store_true", help="print speed and acceptance to stderr")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.set_defaults(func=cmd_generate)

    conv = sub.add_parser("convert", help="convert a llama-architecture GGUF into an mlx-lm model directory")
    conv.add_argument("gguf", help="the .gguf file")
    conv.add_argument("out", help="output directory (written atomically)")
    conv.add_argument(
        "--dtype", default="float32", help="float32 | float16 | bfloat16 | q4 (default float32)"
    )
    conv.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    conv.set_defaults(func=cmd_convert)

    insp = sub.add_parser(
        "inspect", help="describe a model without running it (MTP-ready / AR-only / unsupported)"
    )
    insp.add_argument("model", help="local path or Hugging Face repo id")
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(func=cmd_inspect)

    frg = sub.add_parser("forge", help="train an MTP head for a model that has none (self-distillation)")
    frg.add_argument(
        "--model", default=None, help="local path or Hugging Face repo id (default: the embedded model)"
    )
    frg.add_argument("--out", default="forged-head", help="output head directory (default ./forged-head)")
    frg.add_argument(
        "--data",
        action="append",
        default=None,
        help="training text: a file or directory of .txt/.md/.rst/.py/.jsonl (repeatable; default: the offline corpus)",
    )
    frg.add_argument("--steps", type=int, default=1200)
    frg.add_argument("--train-tokens", type=int, default=300_000)
    frg.add_argument("--seed", type=int, default=0)
    frg.add_argument("--hidden-source", choices=("pre_norm", "post_norm"), default="post_norm")
    frg.add_argument(
        "--compare-steps",
        type=int,
        default=0,
        help="first train both hidden sources this many steps and keep the better one",
    )
    frg.add_argument(
        "--draft-vocab",
        default=None,
        help="reduced draft vocabulary: a size, 'auto' or 'full' (default full)",
    )
    frg.add_argument("--work-dir", default=None, help="where teacher data and checkpoints go (resumable)")
    frg.add_argument("--no-progress", action="store_true")
    frg.set_defaults(func=cmd_forge)

    from mtplx.bench import add_bench_args
    from mtplx.tune import add_tune_args

    bench = sub.add_parser("bench", help="tokens/s of MTP vs AR vs stock mlx-lm, interleaved in one process")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    tune = sub.add_parser("tune", help="measure and save the fastest depth for this model on this machine")
    add_tune_args(tune)
    tune.set_defaults(func=cmd_tune)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MtplxError as err:
        print(f"mtplx: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mtplx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
