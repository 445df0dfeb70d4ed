"""`mtplx generate`: one prompt (argument, `--prompt/-p` or standard input) to streamed text.

Ctrl-C stops cleanly and still prints the stats; `--json` prints one object with every figure.
Under `mlx.launch` every rank runs the same loop and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from mtplx.cli.args import (
    add_generation_args,
    add_switch,
    load_engine,
    request_from_args,
    show_stats,
)
from mtplx.cli.report import format_stats
from mtplx.engine.request import DEFAULT_MAX_TOKENS
from mtplx.errors import MtplxError

HELP = "generate text (streams to stdout)"


def add_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument(
        "prompt_text",
        nargs="?",
        default=None,
        metavar="PROMPT",
        help="the prompt ('-' or none: standard input)",
    )
    gen.add_argument("--prompt", "-p", default=None, help="the prompt, mlx-lm style ('-': standard input)")
    add_generation_args(gen, max_tokens=DEFAULT_MAX_TOKENS)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument(
        "--image",
        action="append",
        default=None,
        metavar="PATH",
        help="an image before the prompt's text (repeatable; a vision-language model, chat template)",
    )
    add_switch(
        gen,
        "chat",
        on=(["--chat"], "wrap the prompt in the chat template (default when the model has one)"),
        off=(
            ["--raw", "--ignore-chat-template"],
            "feed the prompt as raw text (--ignore-chat-template is mlx-lm's name)",
        ),
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


def run(args: argparse.Namespace) -> int:
    images = tuple(args.image or ())
    request = request_from_args(args, max_tokens=args.max_tokens, stop=args.stop or (), images=images)
    prompt = _read_prompt(args)
    quiet = args.verbose is False or args.json
    engine = load_engine(args, quiet=quiet)
    # Under mlx.launch every rank runs the same loop; only rank 0 prints.
    silent = engine.distributed is not None and engine.distributed.rank != 0
    chat = _use_chat_template(args, engine)
    if images and not chat:
        raise MtplxError("--image needs the chat template (drop --raw / --ignore-chat-template)")
    if chat:
        system = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
        prompt = [*system, {"role": "user", "content": prompt}]
    stream = engine.stream(prompt, replace(request, chat=chat))
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
        if chunk is not None and (show_stats(args) or args.json):
            print(format_stats(chunk.stats, engine.head), file=sys.stderr)
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
    if show_stats(args) and chunk is not None:
        print(format_stats(chunk.stats, engine.head), file=sys.stderr)
    return 0
