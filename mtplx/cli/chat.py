"""`mtplx chat`: an interactive multi-turn conversation on one loaded engine.

Turns are read line by line from a terminal (with line editing) or a pipe; each reply
streams as it is decoded, with MTP drafting as `generate` would. The whole conversation
is sent through the chat template every turn, so the prompt of turn n+1 starts with the
tokens of turn n: the engine's prompt cache (when it has one) then prefills only what is
new. `/reset` starts over, `/stats` prints the last reply's stats, Ctrl-C stops the
current reply (what was said so far stays in the conversation), Ctrl-D quits.
Behaviour follows mlx_lm/chat.py (a REPL over `stream_generate` with a kept prompt cache).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import TextIO

from mtplx.cli.args import (
    add_disk_cache_args,
    add_generation_args,
    check_disk_cache_args,
    check_model_spec,
    disk_cache_bytes,
    load_engine,
    request_from_args,
    show_stats,
    typed,
)
from mtplx.cli.report import format_stats
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import DrafterKind

HELP = "interactive multi-turn chat (reads turns line by line; /reset, /stats, Ctrl-D quits)"

COMMANDS = {
    "/reset": "forget the conversation",
    "/stats": "speed and acceptance of the last reply",
    "/image PATH": "attach an image to your next turn (a vision-language model)",
}


@dataclass
class ChatSettings:
    request: GenerationRequest  # every reply's sampler, limits and drafting
    system_prompt: str | None = None
    show_stats: bool = False


@dataclass
class Conversation:
    system_prompt: str | None = None
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []

    def add(self, role: str, content: str, images: list[str] | None = None) -> None:
        if images:  # image parts before the text, as `Engine.generate(images=...)` places them
            parts = [{"type": "image", "image": path} for path in images]
            self.messages.append({"role": role, "content": [*parts, {"type": "text", "text": content}]})
        else:
            self.messages.append({"role": role, "content": content})


def _read_turn(stdin: TextIO, interactive: bool) -> str | None:
    """The next line (without its newline), or None at end of input (Ctrl-D)."""
    if interactive:
        try:
            return input(">> ")  # readline editing on a terminal
        except EOFError:
            return None
    line = stdin.readline()
    return line.rstrip("\n") if line else None


def _reply(engine, conversation: Conversation, settings: ChatSettings, stdout: TextIO, stderr: TextIO):
    """Stream one reply; Ctrl-C stops it and keeps what was said. Returns the last stats (or None)."""
    stream = engine.stream(conversation.messages, settings.request)
    text, chunk = [], None
    try:
        for chunk in stream:
            text.append(chunk.text)
            stdout.write(chunk.text)
            stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        stdout.write("\n")
        stdout.flush()
        print("[reply stopped]", file=stderr, flush=True)
    else:
        stdout.write("\n")
        stdout.flush()
    conversation.add("assistant", "".join(text))
    return chunk.stats if chunk is not None else None


def run_chat(
    engine,
    settings: ChatSettings,
    *,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """The chat loop; returns the exit status (0 at end of input)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    if getattr(engine.tokenizer, "chat_template", None) is None:
        raise MtplxError("chat: this model's tokenizer has no chat template (use `mtplx generate --raw`)")
    interactive = stdin.isatty()
    conversation = Conversation(settings.system_prompt)
    last_stats = None
    images: list[str] = []  # attached with /image, sent with the next turn
    if interactive:
        _print_banner(engine, settings, stderr)
    while True:
        try:
            line = _read_turn(stdin, interactive)
        except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
            stdout.write("\n")
            continue
        if line is None:
            if interactive:
                stdout.write("\n")  # leave the terminal on a fresh line after ^D
            return 0
        command = line.strip()
        if not command or _run_command(command, engine, conversation, images, last_stats, stderr):
            continue
        conversation.add("user", line, images)
        images.clear()
        try:
            stats = _reply(engine, conversation, settings, stdout, stderr)
        except MtplxError as err:  # e.g. the conversation outgrew the context: say so, keep chatting
            conversation.messages.pop()
            print(f"mtplx: error: {err}", file=stderr, flush=True)
            continue
        last_stats = stats or last_stats
        if settings.show_stats and stats is not None:
            print(format_stats(stats, getattr(engine, "head", None)), file=stderr, flush=True)


def _print_banner(engine, settings: ChatSettings, stderr: TextIO) -> None:
    """How replies are drafted and the commands, once, on a terminal."""
    mode = (
        f"MTP depth {engine.depth}"
        if engine.has_head and settings.request.drafting.kind is not DrafterKind.NONE
        else "autoregressive"
    )
    commands = ", ".join(COMMANDS)
    print(f"mtplx chat ({mode}): {commands}; Ctrl-C stops a reply, Ctrl-D quits", file=stderr)


def _run_command(
    command: str, engine, conversation: Conversation, images: list[str], last_stats, stderr: TextIO
) -> bool:
    """Carry out one of `COMMANDS` (``images``: the paths /image attached so far, added to here);
    False when ``command`` is none of them, a turn to send."""
    if command == "/reset":
        conversation.reset()
        print("[conversation reset]", file=stderr, flush=True)
    elif command == "/stats":
        print(
            format_stats(last_stats, getattr(engine, "head", None)) if last_stats else "[no reply yet]",
            file=stderr,
            flush=True,
        )
    elif command.startswith("/image "):
        path = command[len("/image ") :].strip()
        if os.path.isfile(path):
            images.append(path)
            print(f"[image attached to your next turn: {path}]", file=stderr, flush=True)
        else:
            print(f"mtplx: error: /image: {path} is not a file", file=stderr, flush=True)
    else:
        return False
    return True


def add_args(chat: argparse.ArgumentParser) -> None:
    add_generation_args(chat, max_tokens=512)
    typed(
        chat,
        "--prompt-cache-bytes",
        convert=int,
        default=None,
        help="memory for the conversation's cached prompt, so a turn prefills only what is new "
        "(default 2 GiB; 0 turns it off)",
    )
    add_disk_cache_args(chat)  # a conversation picked up again after a restart prefills only what is new


def run(args: argparse.Namespace) -> int:
    request = request_from_args(args, max_tokens=args.max_tokens)  # before loading: a typo costs no load time
    check_disk_cache_args(args)
    check_model_spec(args.model)
    from mtplx.trunk.prompt_cache import DEFAULT_PROMPT_CACHE_BYTES  # imports MLX: after the flags' checks

    # Each turn resends the conversation: the prompt cache makes it prefill only what is new.
    cache_bytes = DEFAULT_PROMPT_CACHE_BYTES if args.prompt_cache_bytes is None else args.prompt_cache_bytes
    engine = load_engine(args, prompt_cache_bytes=cache_bytes)
    if args.prompt_cache_dir is not None:
        engine.use_disk_cache(args.prompt_cache_dir, disk_cache_bytes(args))
    try:
        return run_chat(engine, ChatSettings(request, args.system_prompt, show_stats(args)))
    finally:
        if engine.prompt_cache.disk is not None:  # the last turn's entry reaches the disk before exit
            engine.prompt_cache.disk.close()
