"""The benchmark's prompt suite: reading, selecting and checking the prompts a sweep runs.

A prompt file is JSON lines (``{id, kind, prompt | messages, source}``) or, for any other
suffix, plain text with one raw prompt per non-empty line. Prompt ids are unique within a
file, and every prompt is encoded against the engine before the first run
(`check_prompts_fit`), so a bad prompt fails in seconds, not an hour into a sweep.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx import resources
from mtplx.errors import MtplxError


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: raw ``text`` (continued as is) or chat ``messages``, never both."""

    id: str
    kind: str  # "code" | "prose" | "chat" (or anything a user file says)
    text: str | None = None  # raw continuation prompt
    messages: tuple[dict, ...] | None = None  # chat prompt (goes through the chat template)
    source: str = ""

    @property
    def engine_input(self) -> str | list[dict]:
        return list(self.messages) if self.messages is not None else self.text  # type: ignore[return-value]

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def encode(engine, prompt: Prompt) -> list[int]:
    """The engine's own ids for ``prompt``: its tokenization and, for a chat prompt, its chat template."""
    return engine.encode_prompt(prompt.engine_input, chat=prompt.is_chat)


def default_prompts_path() -> Path:
    """The shipped suite, from an installed wheel or the source tree."""
    path = resources.prompt_suite()
    if path is None:
        raise MtplxError(
            f"prompt suite {resources.PROMPT_SUITE}: not found in the package or the source tree; pass --prompts FILE"
        )
    return path


def _prompt_from_json(obj: Any, where: str, index: int) -> Prompt:
    if not isinstance(obj, dict):
        raise MtplxError(f"{where}: expected a JSON object per line")
    kind = str(obj.get("kind", "prompt"))
    pid = str(obj.get("id", f"{kind}-{index}"))
    if "messages" in obj:
        messages = obj["messages"]
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and m.get("content") for m in messages)
        ):
            raise MtplxError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(pid, kind, messages=tuple(messages), source=str(obj.get("source", "")))
    text = obj.get("prompt", obj.get("text"))
    if not isinstance(text, str) or not text.strip():
        raise MtplxError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    return Prompt(pid, kind, text=text, source=str(obj.get("source", "")))


def load_prompts(
    path: str | Path | None = None, *, kinds: Sequence[str] | None = None, per_kind: int | None = None
) -> list[Prompt]:
    """Read a prompt file: JSON lines ({id, kind, prompt | messages, source}) or, for any other
    suffix, plain text with one raw prompt per non-empty line. ``kinds`` / ``per_kind`` select."""
    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise MtplxError(f"{path}: prompts file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MtplxError(f"{path}: unreadable prompts file ({type(e).__name__})") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MtplxError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            prompts.append(_prompt_from_json(obj, f"{path}:{number}", len(prompts)))
        else:
            prompts.append(Prompt(f"line-{number}", "prompt", text=line.replace("\\n", "\n")))
    if not prompts:
        raise MtplxError(f"{path}: no prompts in the file")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise MtplxError(f"{path}: prompt ids repeat ({sorted({i for i in ids if ids.count(i) > 1})[0]!r})")
    return select_prompts(prompts, kinds, per_kind, str(path))


def select_prompts(
    prompts: Sequence[Prompt], kinds: Sequence[str] | None, per_kind: int | None, where: str = "prompts"
) -> list[Prompt]:
    """The prompts of ``kinds`` (None: all), at most the first ``per_kind`` of each, in file order."""
    if per_kind is not None and per_kind <= 0:
        raise MtplxError(f"per_kind: must be > 0, got {per_kind}")
    chosen = [p for p in prompts if kinds is None or p.kind in kinds]
    if not chosen:
        raise MtplxError(f"{where}: no prompts of kind {', '.join(kinds or [])}")
    if per_kind is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in chosen:
            seen[p.kind] = seen.get(p.kind, 0) + 1
            if seen[p.kind] <= per_kind:
                kept.append(p)
        chosen = kept
    return chosen


def check_prompts_fit(engine, prompts: Sequence[Prompt], max_tokens: int) -> None:
    """Encode every prompt up front, so a prompt that is empty or too long fails before an hour of runs."""
    limit = engine.context_length
    for prompt in prompts:
        ids = encode(engine, prompt)
        if limit is not None and len(ids) + max_tokens > limit:
            raise MtplxError(
                f"prompt {prompt.id}: {len(ids)} tokens + {max_tokens} exceed the context of {limit}"
            )
