"""Flag groups declared once, and what they build: the `GenerationRequest` and the `Engine`.

`generate`, `chat` and `serve` take the same model, sampling and drafting flags from these
declarations (on `serve` the sampling and drafting flags are the defaults for the fields a
request omits, as in `mlx_lm.server`). mlx-lm's spellings are accepted beside mtplx's own
(`--num-draft-tokens`, `--max-tokens/-m`, `--verbose BOOL`; mlx_lm/generate.py's parser).

Errors the API raises name the field (`temperature must be >= 0 (got -1.0)`); `user_message`
rewrites the field into the flag the user typed, quoting their text (`--temp must be >= 0 (got -1)`).
Importing this module imports no MLX: a typo costs no load time.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import DRAFT_KINDS, Drafting, LookupConfig

__all__ = [
    "add_drafting_args",
    "add_generation_args",
    "add_kv_args",
    "add_model_args",
    "add_reply_args",
    "add_sampling_args",
    "add_switch",
    "check_model_spec",
    "load_engine",
    "request_from_args",
    "sampler_from_args",
    "drafting_from_args",
    "show_stats",
    "str2bool",
    "typed",
    "user_message",
]

# API field -> argparse dest, where they differ.
_DEST_OF_FIELD = {"temperature": "temp", "num_draft_tokens": "depth"}
# Sampling flag -> SamplerConfig field (the flag's dest is the flag without dashes, mlx-lm's names).
SAMPLING_FLAGS = {
    "temp": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def str2bool(text: str) -> bool:
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


def typed(parser: argparse.ArgumentParser, *flags: str, convert: Callable = str, **kwargs) -> None:
    """A flag whose value errors can name it as typed (see `user_message`)."""
    parser.add_argument(*flags, action=_Typed, convert=convert, **kwargs)


def _flag_name(args: argparse.Namespace, dest: str) -> str | None:
    """The flag the user typed for ``dest``, else the command's first long flag for it."""
    typed_flags = getattr(args, "typed", None) or {}
    if dest in typed_flags:
        return typed_flags[dest][0]
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
    typed_flag = (getattr(args, "typed", None) or {}).get(dest)
    if typed_flag is not None and _GOT.search(rest):
        rest = _GOT.sub(f" (got {typed_flag[1]})", rest)
    return f"{flag} {rest}"


# ------------------------------------------------------------------- flag groups


def add_switch(
    parser: argparse.ArgumentParser, dest: str, *, on: tuple[list[str], str], off: tuple[list[str], str]
) -> None:
    """A three-way switch: ``on`` flags store True, ``off`` flags False, neither leaves None (the
    command decides); the two sides exclude each other. ``on`` / ``off``: (spellings, help)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(*on[0], dest=dest, action="store_true", default=None, help=on[1])
    group.add_argument(*off[0], dest=dest, action="store_false", help=off[1])


def add_model_args(
    parser: argparse.ArgumentParser, *, builds: bool = True, adapters: bool = True, positional: bool = False
) -> None:
    """``--model`` (``MODEL`` with ``positional``) and ``--head``; with ``builds`` also the default
    model's ``--dtype``, and with ``adapters`` ``--adapter-path`` (bench and tune take neither,
    inspect no adapters)."""
    model_help = "local path or Hugging Face repo id (default: the embedded SmolLM2-135M-Instruct)"
    if positional:
        parser.add_argument("model", nargs="?", default=None, help=model_help)
    else:
        parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument(
        "--head",
        default=None,
        help="a split MTP drafter (mlx-vlm's split_mtp), a Gemma 4 assistant (directory or cached repo id) "
        "or a forged MTP head directory (default: the model's own head, else a split drafter "
        "<stem>-MTP-* / <model>-mtp beside it; for Gemma 4, <model>-assistant if present); a DFlash / "
        "DFlash2 / DSpark / EAGLE-3 drafter directory drafts with --draft <its kind> or auto "
        "(found beside the model as <stem>-DFlash / -EAGLE3 ...; mtplx inspect reports it)",
    )
    if not builds:
        return
    parser.add_argument(
        "--dtype",
        choices=("float32", "q4"),
        default=None,
        help="build of the embedded default model (default float32, the faster one on CPU)",
    )
    if adapters:
        typed(
            parser, "--adapter-path", default=None, help="fine-tuned adapters from mlx_lm.lora (a directory)"
        )
        add_kv_args(parser)


def add_kv_args(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's KV-cache quantization flags (mlx_lm/generate.py's spellings, meaning and defaults;
    where mtplx converts is mtplx/trunk/kv_quant.py)."""
    typed(
        parser,
        "--kv-bits",
        convert=int,
        default=None,
        help="quantize the KV cache to this many bits (2-6 or 8; default: no quantization)",
    )
    typed(
        parser,
        "--kv-group-size",
        convert=int,
        default=None,
        help="group size for KV cache quantization (32, 64 or 128; default 64)",
    )
    typed(
        parser,
        "--quantized-kv-start",
        convert=int,
        default=None,
        help="position from which the KV cache is quantized, when --kv-bits is set (default 5000)",
    )


def add_disk_cache_args(parser: argparse.ArgumentParser) -> None:
    """The prompt cache's disk tier (`serve`, `chat`): `check_disk_cache_args`, `use_disk_cache`."""
    parser.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="keep prompt caches in this directory too, reused after a restart (default: RAM only)",
    )
    parser.add_argument(
        "--prompt-cache-disk-bytes",
        type=int,
        default=None,
        help="bytes of prompt caches kept in --prompt-cache-dir, least recently used dropped first "
        "(default 16 GiB)",
    )


def check_disk_cache_args(args: argparse.Namespace) -> None:
    """The disk tier's flags, checked before the (long) load."""
    if args.prompt_cache_disk_bytes is not None and args.prompt_cache_disk_bytes <= 0:
        raise MtplxError(f"--prompt-cache-disk-bytes: must be > 0, got {args.prompt_cache_disk_bytes}")
    if args.prompt_cache_dir is not None and not args.prompt_cache_dir.strip():
        raise MtplxError(
            "--prompt-cache-dir: empty path (name a directory, or leave the flag out for RAM only)"
        )
    if args.prompt_cache_disk_bytes is not None and args.prompt_cache_dir is None:
        raise MtplxError("--prompt-cache-disk-bytes: needs --prompt-cache-dir")
    if args.prompt_cache_dir is not None and args.prompt_cache_bytes == 0:
        raise MtplxError("--prompt-cache-dir: needs a prompt cache in RAM (--prompt-cache-bytes > 0)")


def disk_cache_bytes(args: argparse.Namespace) -> int:
    """The disk tier's budget: --prompt-cache-disk-bytes, else the default; 0 without --prompt-cache-dir."""
    from mtplx.trunk.prompt_cache_disk import DEFAULT_DISK_BYTES

    if args.prompt_cache_dir is None:
        return 0
    return args.prompt_cache_disk_bytes or DEFAULT_DISK_BYTES


def add_sampling_args(parser: argparse.ArgumentParser, defaults: SamplerConfig) -> None:
    """The sampler flags, with ``defaults`` (greedy for `generate`/`chat`, OpenAI's for `serve`)."""
    typed(
        parser,
        "--temp",
        convert=float,
        default=defaults.temperature,
        help=f"temperature; 0 = greedy (default {defaults.temperature:g})",
    )
    for dest, field in SAMPLING_FLAGS.items():
        if dest != "temp":
            convert = int if field == "top_k" else float
            typed(parser, "--" + dest.replace("_", "-"), convert=convert, default=getattr(defaults, field))
    typed(parser, "--seed", convert=int, default=None)


def add_drafting_args(parser: argparse.ArgumentParser) -> None:
    typed(
        parser,
        "--depth",
        "--num-draft-tokens",
        dest="depth",
        convert=int,
        default=None,
        help="draft tokens per verify cycle (default: tuned, else the head's); --num-draft-tokens is mlx-lm's name",
    )
    add_switch(
        parser,
        "mtp",
        on=(["--mtp"], "require MTP speculative decoding (default: on when the model has a head)"),
        off=(["--no-mtp"], "plain autoregressive decoding"),
    )
    parser.add_argument("--greedy-draft", action="store_true", help="draft the head's argmax (still exact)")
    parser.add_argument(
        "--draft",
        default=None,
        metavar="{" + ",".join(DRAFT_KINDS) + "}",
        help="drafter: auto (default: prompt lookup where the text recurs, else the draft model or head), "
        "head, lookup, model, none",
    )
    parser.add_argument("--draft-model", default=None, help="a smaller mlx-lm model with the same tokenizer")
    typed(
        parser, "--lookup-min-ngram", convert=int, default=None, help="shortest suffix prompt lookup matches"
    )
    typed(
        parser, "--lookup-max-ngram", convert=int, default=None, help="longest suffix prompt lookup matches"
    )
    typed(parser, "--lookup-max-tokens", convert=int, default=None, help="most tokens one lookup proposes")
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


def add_reply_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    typed(parser, "--max-tokens", "-m", dest="max_tokens", convert=int, default=max_tokens)
    parser.add_argument("--system-prompt", default=None, help="a system message before the prompt")
    parser.add_argument("--stats", action="store_true", help="print speed and acceptance to stderr")
    typed(
        parser,
        "--verbose",
        convert=str2bool,
        default=None,
        metavar="BOOL",
        help="mlx-lm's flag: True prints the stats, False only the reply (default: --stats decides)",
    )


def add_generation_args(parser: argparse.ArgumentParser, *, max_tokens: int) -> None:
    """What `generate` and `chat` both take: the model, sampling (greedy by default), drafting
    and reply flags."""
    add_model_args(parser)
    add_sampling_args(parser, GenerationRequest().sampler)
    add_drafting_args(parser)
    add_reply_args(parser, max_tokens=max_tokens)


# ---------------------------------------------------------- what the flags build


def sampler_from_args(args: argparse.Namespace) -> SamplerConfig:
    return SamplerConfig(**{field: getattr(args, dest) for dest, field in SAMPLING_FLAGS.items()})


def drafting_from_args(args: argparse.Namespace) -> Drafting:
    if args.draft is not None and args.draft not in DRAFT_KINDS:  # the flag's own wording
        raise MtplxError(f"--draft: must be one of {', '.join(DRAFT_KINDS)}, got {args.draft!r}")
    defaults = LookupConfig()
    lookup = LookupConfig(
        min_ngram=args.lookup_min_ngram if args.lookup_min_ngram is not None else defaults.min_ngram,
        max_ngram=args.lookup_max_ngram if args.lookup_max_ngram is not None else defaults.max_ngram,
        max_tokens=args.lookup_max_tokens if args.lookup_max_tokens is not None else defaults.max_tokens,
        adaptive_length=args.lookup_adaptive,
    )
    return Drafting(
        kind=Drafting.kind_from(args.draft, args.mtp),
        depth=args.depth,
        greedy_draft=args.greedy_draft,
        adaptive=args.adaptive,
        lookup=lookup,
    )


def request_from_args(args: argparse.Namespace, **fields) -> GenerationRequest:
    """The request the flags describe, validated before any model loads; ``fields`` add the rest
    (``max_tokens``, ``stop``, ``chat``) where a command has them."""
    return GenerationRequest(
        sampler=sampler_from_args(args), seed=args.seed, drafting=drafting_from_args(args), **fields
    )


def show_stats(args: argparse.Namespace) -> bool:
    return args.verbose if args.verbose is not None else args.stats


def _distributed_mode(args: argparse.Namespace) -> bool | str:
    """--distributed, or "auto" when this process was started by mlx.launch with 2+ ranks."""
    requested = getattr(args, "distributed", "off")
    if requested == "off":
        return False
    if requested is not None:
        return requested
    from mtplx.engine.distributed import world

    return "auto" if world() is not None else False


def check_model_spec(spec: str | None) -> None:
    """A model flag naming a local path fails here, before MLX is imported, with the error loading
    would give (`resolve_model`: not found, a GGUF file, not a directory); a Hub repo id that is
    no local path is left to the load (it may download)."""
    if spec is None:
        return
    from pathlib import Path

    from mtplx.checkpoints.load import resolve_model
    from mtplx.model_files.hub import is_repo_id

    if Path(spec).expanduser().exists() or not is_repo_id(spec):
        resolve_model(spec)


def load_engine(args: argparse.Namespace, *, quiet: bool = False, prompt_cache_bytes: int = 0):
    """The engine the model flags describe; a note on stderr (unless ``quiet``) when it has no drafter model.
    The flags' own mistakes (a model path that is not there) fail before MLX is imported."""
    for dest in ("kv_group_size", "quantized_kv_start"):
        if getattr(args, dest, None) is not None and getattr(args, "kv_bits", None) is None:
            raise MtplxError(f"{_flag_name(args, dest)} needs --kv-bits: it does nothing without it")
    check_model_spec(args.model)
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
        draft_model=args.draft_model,
        adapter_path=args.adapter_path,
        kv_bits=getattr(args, "kv_bits", None),
        kv_group_size=getattr(args, "kv_group_size", None),
        quantized_kv_start=getattr(args, "quantized_kv_start", None),
    )
    if args.mtp is None and not engine.has_head and engine.draft_model is None and not quiet:
        print(
            "mtplx: note: this model has no MTP head, drafting by prompt lookup only (train one with `mtplx forge`)",
            file=sys.stderr,
        )
    return engine
