"""`mtplx` command line: argument parsing and printing only.

`generate` and `chat` accept mlx-lm's spellings beside mtplx's own (`--prompt/-p`,
`--max-tokens/-m`, `--system-prompt`, `--ignore-chat-template`, `--num-draft-tokens`,
`--verbose BOOL`; see mlx_lm/generate.py's argument parser). Errors the API raises name the
field (`temperature must be >= 0 (got -1.0)`); the CLI rewrites the field into the flag the
user typed (`--temp must be >= 0 (got -1)`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence

import mtplx  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
from mtplx.cli import bench as bench_command
from mtplx.cli import forge as forge_command
from mtplx.cli import tune as tune_command
from mtplx.errors import MtplxError
from mtplx.spec_decode import DRAFT_KINDS

# API field -> argparse dest, where they differ.
_DEST_OF_FIELD = {"temperature": "temp", "num_draft_tokens": "depth"}


def _str2bool(text: str) -> bool:
    """mlx-lm's `--verbose` values: True/T/False/F (any case)."""
    lowered = text.strip().lower()
    if lowered in ("true", "t", "1", "yes"):
        return True
    if lowered in ("false", "f", "0", "no"):
        return False
    raise ValueError(text)


class _Typed(argparse.Action):
    """Stores the converted value and remembers the spelling and text the user typed, so an
    error about the value can name that flag and quote that text."""

    def __init__(self, option_strings, dest, convert: Callable = str, **kwargs):
        self.convert = convert
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = self.convert(values)
        except ValueError:
            raise argparse.ArgumentError(self, f"invalid value {values!r}") from None
        setattr(namespace, self.dest, value)
        typed = dict(getattr(namespace, "typed", None) or {})
        long_form = next((s for s in self.option_strings if s.startswith("--")), option_string)
        typed[self.dest] = (option_string if option_string.startswith("--") else long_form, values)
        namespace.typed = typed


def _flag_name(args: argparse.Namespace, dest: str) -> str | None:
    """The flag the user typed for ``dest``, else the command's first long flag for it."""
    typed = getattr(args, "typed", None) or {}
    if dest in typed:
        return typed[dest][0]
    for action in args.command_parser._actions:
        if action.dest == dest and isinstance(action, _Typed):
            return next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
    return None


_FIELD_MESSAGE = re.compile(r"^(?:SamplerConfig\.)?([a-z_]+):?\s+(.*)$")
_GOT = re.compile(r",?\s*\(?got ([^()]*)\)?$")


def user_message(err: MtplxError, args: argparse.Namespace) -> str:
    """``err`` with a leading API field name replaced by the flag the user typed (and their text)."""
    message = str(err)
    match = _FIELD_MESSAGE.match(message)
    if match is None:
        return message
    field, rest = match.groups()
    dest = _DEST_OF_FIELD.get(field, field)
    flag = _flag_name(args, dest)
    if flag is None:
        return message
    typed = (getattr(args, "typed", None) or {}).get(dest)
    if typed is not None and _GOT.search(rest):
        rest = _GOT.sub(f" (got {typed[1]})", rest)
    return f"{flag} {rest}"


def _typed(parser: argparse.ArgumentParser, *flags: str, convert: Callable = str, **kwargs) -> None:
    parser.add_argument(*flags, action=_Typed, convert=convert, **kwargs)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="local path or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--head",
        default=None,
        help="a forged MTP head directory or a Gemma 4 assistant (directory or cached repo id) "
        "(default: the model's own head; for Gemma 4, <model>-assistant if present)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "q4"),
        default=None,
        help="build of the embedded default model (default float32, the faster one on CPU)",
    )
    _typed(parser, "--adapter-path", default=None, help="fine-tuned adapters from mlx_lm.lora (a directory)")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    _typed(parser, "--temp", convert=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    _typed(parser, "--top-p", convert=float, default=1.0)
    _typed(parser, "--top-k", convert=int, default=0)
    _typed(parser, "--min-p", convert=float, default=0.0)
    _typed(parser, "--repetition-penalty", convert=float, default=1.0)
    _typed(parser, "--presence-penalty", convert=float, default=0.0)
    _typed(parser, "--frequency-penalty", convert=float, default=0.0)
    _typed(parser, "--seed", convert=int, default=None)


def _add_drafting_args(parser: argparse.ArgumentParser) -> None:
    _typed(
        parser,
        "--depth",
        "--num-draft-tokens",
        dest="depth",
        convert=int,
        default=None,
        help="draft tokens per verify cycle (default: tuned, else the head's); --num-draft-tokens is mlx-lm's name",
    )
    speculative = parser.add_mutually_exclusive_group()
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
    parser.add_argument("--greedy-draft", action="store_true", help="draft the head's argmax (still exact)")


def _add_drafter_choice_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--draft",
        default=None,
        metavar="{" + ",".join(DRAFT_KINDS) + "}",
        help="drafter: auto (default: prompt lookup where the text recurs, else the draft model or head), "
        "head, lookup, model, none",
    )
    parser.add_argument("--draft-model", default=None, help="a smaller mlx-lm model with the same tokenizer")
    _typed(
        parser, "--lookup-min-ngram", convert=int, default=None, help="shortest suffix prompt lookup matches"
    )
    _typed(
        parser, "--lookup-max-ngram", convert=int, default=None, help="longest suffix prompt lookup matches"
    )
    _typed(parser, "--lookup-max-tokens", convert=int, default=None, help="most tokens one lookup proposes")
    parser.add_argument(
        "--lookup-adaptive",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="lookup blocks grow while kept whole and shrink when cut (default on; "
        "--no-lookup-adaptive: always --lookup-max-tokens)",
    )
    parser.add_argument(
        "--adaptive",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="stop head drafting early when the head is unsure (threshold from `mtplx tune`)",
    )


def _drafter_kwargs(args: argparse.Namespace) -> dict:
    """The drafter choice for `Engine.stream`, validated before any model loads."""
    from mtplx.spec_decode.lookup_proposer import LookupConfig

    if args.draft is not None and args.draft not in DRAFT_KINDS:
        raise MtplxError(f"--draft: must be one of {', '.join(DRAFT_KINDS)}, got {args.draft!r}")
    defaults = LookupConfig()
    lookup = LookupConfig(
        min_ngram=args.lookup_min_ngram if args.lookup_min_ngram is not None else defaults.min_ngram,
        max_ngram=args.lookup_max_ngram if args.lookup_max_ngram is not None else defaults.max_ngram,
        max_tokens=args.lookup_max_tokens if args.lookup_max_tokens is not None else defaults.max_tokens,
        adaptive_length=args.lookup_adaptive,
    ).validate()
    return dict(draft=args.draft, lookup=lookup, adaptive=args.adaptive)


def _add_reply_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    _typed(parser, "--max-tokens", "-m", dest="max_tokens", convert=int, default=max_tokens)
    parser.add_argument("--system-prompt", default=None, help="a system message before the prompt")
    parser.add_argument("--stats", action="store_true", help="print speed and acceptance to stderr")
    _typed(
        parser,
        "--verbose",
        convert=_str2bool,
        default=None,
        metavar="BOOL",
        help="mlx-lm's flag: True prints the stats, False only the reply (default: --stats decides)",
    )


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


def check_reply_args(args: argparse.Namespace) -> None:
    """Validate what needs no model first: a typo should cost no load time."""
    from mtplx.engine.request import check_generation_args

    check_generation_args(max_tokens=args.max_tokens, depth=args.depth, **_sampling_kwargs(args))


def _show_stats(args: argparse.Namespace) -> bool:
    return args.verbose if args.verbose is not None else args.stats


def format_stats(stats) -> str:
    """mlx-lm's stats lines (Prompt / Generation / Peak memory), timings, then the drafting lines."""
    cached = (
        f" ({stats.cached_tokens} cached, {stats.prefilled_tokens} prefilled)" if stats.cached_tokens else ""
    )
    lines = [
        f"Prompt: {stats.prompt_tokens} tokens{cached}, {stats.prefill_tokens_per_sec:.3f} tokens-per-sec",
        f"Generation: {stats.generated_tokens} tokens, {stats.decode_tokens_per_sec:.3f} tokens-per-sec",
        f"Peak memory: {stats.peak_memory_gb:.3f} GB",
        f"Time to first token: {stats.ttft_seconds:.3f} s, total time: {stats.total_seconds:.3f} s",
    ]
    if stats.distributed:
        d = stats.distributed
        lines.append(
            f"Distributed: {d['mode']} over {d['ranks']} ranks, per cycle {d['collectives_per_cycle']} "
            f"collectives, {d['bytes_per_cycle']} bytes"
        )
    if stats.mode != "mtp":
        lines.append("Drafter: none (autoregressive)")
        return "\n".join(lines)
    for name, counts in stats.drafters.items():
        drafted, accepted = counts.get("drafted", 0), counts.get("accepted", 0)
        rate = accepted / drafted if drafted else 0.0
        depth = "" if name == "lookup" else f", depth {stats.depth}"  # lookup blocks have no fixed depth
        lines.append(f"Drafter: {name}{depth}: drafted {drafted}, accepted {accepted} ({rate:.2f})")
    per_position = ", ".join(
        f"{i + 1}: {a:.2f} ({n})"
        for i, (a, n) in enumerate(zip(stats.acceptance_per_position, stats.drafted_per_position))
    )
    lines.append(f"Acceptance per draft position (cycles drafting it): {per_position}")
    lines.append(
        f"Tokens per verify cycle: {stats.tokens_per_cycle:.2f} over {stats.cycles} cycles"
        f" ({stats.tokens_per_full_cycle:.2f} over full cycles)"
    )
    return "\n".join(lines)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_text is not None:
        raise MtplxError("prompt: give it once, either as an argument or with --prompt")
    prompt = args.prompt if args.prompt is not None else args.prompt_text
    if prompt is not None and prompt != "-":
        return prompt
    if prompt == "-" or not sys.stdin.isatty():
        return sys.stdin.read()
    raise MtplxError("prompt: give one as an argument, with --prompt, or on standard input")


def _use_chat_template(args: argparse.Namespace, engine) -> bool:
    has_template = getattr(engine.tokenizer, "chat_template", None) is not None
    use = args.chat if args.chat is not None else has_template
    if args.system_prompt is not None and not use:
        raise MtplxError(
            "--system-prompt needs the chat template (drop --raw / --ignore-chat-template)"
            if has_template
            else "--system-prompt: this model's tokenizer has no chat template"
        )
    return use


def _distributed_mode(args: argparse.Namespace) -> bool | str:
    """--distributed, or "auto" when this process was started by mlx.launch with 2+ ranks."""
    requested = getattr(args, "distributed", "off")
    if requested == "off":
        return False
    if requested is not None:
        return requested
    from mtplx.engine.distributed import world

    return "auto" if world() is not None else False


def load_engine(args: argparse.Namespace, *, quiet: bool = False, prompt_cache_bytes: int = 0):
    """The engine `generate` and `chat` run on; notes on stderr unless ``quiet``."""
    from mtplx.engine.engine import Engine

    engine = Engine.load(
        args.model,
        head=args.head,
        mtp=args.mtp,
        depth=args.depth,
        dtype=args.dtype,
        prompt_cache_bytes=prompt_cache_bytes,
        distributed=_distributed_mode(args),
        collective_timeout=getattr(args, "collective_timeout", None),
        draft_model=getattr(args, "draft_model", None),
        adapter_path=args.adapter_path,
    )
    if args.mtp is None and not engine.has_head and engine.draft_model is None and not quiet:
        print(
            "mtplx: note: this model has no MTP head, drafting by prompt lookup only (train one with `mtplx forge`)",
            file=sys.stderr,
        )
    return engine


def cmd_generate(args: argparse.Namespace) -> int:
    check_reply_args(args)
    drafting = _drafter_kwargs(args)  # before loading: a typo costs no load time
    prompt = _read_prompt(args)
    quiet = args.verbose is False or args.json
    engine = load_engine(args, quiet=quiet)
    # Under mlx.launch every rank runs the same loop; only rank 0 prints.
    silent = engine.distributed is not None and engine.distributed.rank != 0
    chat = _use_chat_template(args, engine)
    if chat:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompt = [*system, {"role": "user", "content": prompt}]
    stream = engine.stream(
        prompt,
        max_tokens=args.max_tokens,
        stop=args.stop,
        mtp=args.mtp,
        greedy_draft=args.greedy_draft,
        chat=chat,
        **_sampling_kwargs(args),
        **drafting,
    )
    text, tokens, chunk = [], [], None
    try:
        for chunk in stream:
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            if not args.json and not silent:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        if not args.json:
            sys.stdout.write("\n")
            sys.stdout.flush()
        print("mtplx: interrupted", file=sys.stderr)
        if chunk is not None and (_show_stats(args) or args.json):
            print(format_stats(chunk.stats), file=sys.stderr)
        return 130
    if silent:
        return 0
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
    if _show_stats(args) and chunk is not None:
        print(format_stats(chunk.stats), file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from mtplx.cli.chat import run_chat, settings_from_args
    from mtplx.trunk.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES

    check_reply_args(args)
    # Each turn resends the conversation: the prompt cache makes it prefill only what is new.
    cache_bytes = DEFAULT_PROMPT_CACHE_BYTES if args.prompt_cache_bytes is None else args.prompt_cache_bytes
    engine = load_engine(args, prompt_cache_bytes=cache_bytes)
    return run_chat(engine, settings_from_args(args, _sampling_kwargs(args)), format_stats=format_stats)


def cmd_doctor(args: argparse.Namespace) -> int:
    from mtplx.cli.doctor import diagnose, format_report

    report = diagnose(gflops=not args.no_gflops)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return 0 if report.healthy else 1


def cmd_convert(args: argparse.Namespace) -> int:
    if str(args.source).endswith(".gguf"):
        from mtplx.checkpoints.convert_gguf import convert_gguf

        out = convert_gguf(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite)
    else:
        from mtplx.checkpoints.convert_hf import convert_hf

        head_bits = (
            None
            if args.head_bits is None
            else (args.head_bits if args.head_bits == "float" else int(args.head_bits))
        )
        out = convert_hf(
            args.source,
            args.out,
            q_bits=args.q_bits,
            q_group_size=args.q_group_size,
            head_bits=head_bits,
            overwrite=args.overwrite,
        )
    print(f"wrote {out}")
    return 0


def cmd_convert_assistant(args: argparse.Namespace) -> int:
    from mtplx.heads.gemma4_assistant import convert_assistant

    print(f"wrote {convert_assistant(args.assistant, args.target, bits=args.bits)}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from mtplx.checkpoints.inspect import format_inspection, inspect_model

    info = inspect_model(args.model, head=args.head, dtype=args.dtype)
    print(json.dumps(info, indent=2) if args.json else format_inspection(info))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mtplx.cli.serve import serve_from_args

    return serve_from_args(args)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text (streams to stdout)")
    gen.add_argument(
        "prompt_text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt ('-' or none: standard input)",
    )
    gen.add_argument("--prompt", "-p", default=None, help="the prompt, mlx-lm style ('-': standard input)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    _add_drafting_args(gen)
    _add_drafter_choice_args(gen)
    _add_reply_args(gen, max_tokens=256)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    mode = gen.add_mutually_exclusive_group()
    mode.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="wrap the prompt in the chat template (default when the model has one)",
    )
    mode.add_argument(
        "--raw",
        "--ignore-chat-template",
        dest="chat",
        action="store_false",
        help="feed the prompt as raw text (--ignore-chat-template is mlx-lm's name)",
    )
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    gen.add_argument(
        "--distributed",
        choices=("auto", "pipeline", "tensor", "off"),
        default=None,
        help="shard the model over the ranks mlx.launch started (default: auto when launched with 2+)",
    )
    gen.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit with an error when the other ranks do not answer within this (default 300)",
    )
    gen.set_defaults(func=cmd_generate, command_parser=gen)


def _add_chat_parser(sub) -> None:
    chat = sub.add_parser(
        "chat",
        help="interactive multi-turn chat (reads turns line by line; /reset, /stats, Ctrl-D quits)",
    )
    _add_model_args(chat)
    _add_sampling_args(chat)
    _add_drafting_args(chat)
    _add_reply_args(chat, max_tokens=512)
    _typed(
        chat,
        "--prompt-cache-bytes",
        convert=int,
        default=None,
        help="memory for the conversation's cached prompt, so a turn prefills only what is new "
        "(default 2 GiB; 0 turns it off)",
    )
    chat.set_defaults(func=cmd_chat, command_parser=chat)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtplx", description="Exact MTP speculative decoding on MLX.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_parser(sub)
    _add_chat_parser(sub)

    insp = sub.add_parser(
        "inspect", help="describe a model without running it (MTP-ready / AR-only / unsupported)"
    )
    insp.add_argument(
        "model",
        nargs="?",
        default=None,
        help="local path or Hugging Face repo id (default: the embedded model)",
    )
    insp.add_argument("--head", default=None, help="a forged MTP head directory to check against the model")
    insp.add_argument(
        "--dtype", choices=("float32", "q4"), default=None, help="build of the embedded default model"
    )
    insp.add_argument("--json", action="store_true", help="print JSON")
    insp.set_defaults(func=cmd_inspect, command_parser=insp)

    doctor = sub.add_parser("doctor", help="check the environment: MLX backend, BLAS, kernels, caches, model")
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.add_argument("--no-gflops", action="store_true", help="skip the matmul speed measurement")
    doctor.set_defaults(func=cmd_doctor, command_parser=doctor)

    conv = sub.add_parser(
        "convert",
        help="a llama GGUF, or a Hugging Face checkpoint (quantized, keeping its MTP head), to an mlx-lm directory",
    )
    conv.add_argument("source", help="a .gguf file, or a Hugging Face checkpoint directory or repo id")
    conv.add_argument("out", help="output directory (written atomically)")
    conv.add_argument(
        "--dtype", default="float32", help="GGUF: float32 | float16 | bfloat16 | q4 (default float32)"
    )
    conv.add_argument("--q-bits", type=int, default=4, help="HF: trunk bits per weight (default 4)")
    conv.add_argument("--q-group-size", type=int, default=64, help="HF: quantization group size (default 64)")
    conv.add_argument(
        "--head-bits",
        choices=["float", "2", "3", "4", "5", "6", "8"],
        default=None,
        help="HF: the MTP head's bits, or float to keep it unquantized (default: the trunk's bits)",
    )
    conv.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    conv.set_defaults(func=cmd_convert, command_parser=conv)
    ca = sub.add_parser(
        "convert-assistant",
        help="write a Gemma 4 assistant beside its (converted, e.g. 4-bit) target as <target>-assistant",
    )
    ca.add_argument("assistant", help="the assistant directory or cached repo id")
    ca.add_argument("target", help="the target model directory it drafts for")
    ca.add_argument(
        "--bits", type=int, default=None, help="quantize the drafter (4 or 8; default: bfloat16, unquantized)"
    )
    ca.set_defaults(func=cmd_convert_assistant, command_parser=ca)

    frg = sub.add_parser(
        "forge", help="train an MTP head for a model that has none, on the model's own generations"
    )
    forge_command.add_args(frg)
    frg.set_defaults(func=forge_command.run, command_parser=frg)

    bench = sub.add_parser("bench", help="tokens/s of MTP vs AR vs stock mlx-lm, interleaved in one process")
    bench_command.add_args(bench)
    bench.set_defaults(func=bench_command.run, command_parser=bench)
    tune = sub.add_parser("tune", help="measure and save the fastest depth for this model on this machine")
    tune_command.add_args(tune)
    tune.set_defaults(func=tune_command.run, command_parser=tune)

    from mtplx.cli.serve import add_serve_args

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions)")
    add_serve_args(srv)
    srv.set_defaults(func=cmd_serve, command_parser=srv)
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
