"""Reasoning: the span a thinking model writes before its answer, split from the reply.

A model thinks when mlx-lm finds a pair of thinking markers in its vocabulary (``<think>`` /
``</think>`` and the other families it knows; `mtplx.trunk.compat.thinking_markers`). The span
is reported as ``message.reasoning_content`` (and ``reasoning``, mlx-lm's name) and streamed in
``delta.reasoning_content`` / ``delta.reasoning``; the answer after the end marker is the
content, read for tool calls as usual.

Glossary:
- opened: the prompt already ends inside the span (templates such as Qwen3's write the start
  marker into the generation prompt), so the reply starts as reasoning; otherwise the reply is
  reasoning only if it begins with the start marker.

Under a grammar the span is free text: `wrap_grammar` puts the boundary into the grammar itself
(free text up to the end marker, then the constrained answer), so the model thinks unconstrained
and its answer still parses. The end marker may fall anywhere in an accepted draft block; the
splitter works on text pieces of any size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mtplx.server.tools import held_suffix

# A thinking model's markers, whether the prompt opened the span, and the markers' token ids.
Reasoning = tuple[str, str, bool, tuple[int, ...], tuple[int, ...]]

__all__ = [
    "Reasoning",
    "ReasoningSplitter",
    "lark_string",
    "opened_in_prompt",
    "regex_literal",
    "wrap_grammar",
]


def opened_in_prompt(prompt_text: str, start: str, end: str) -> bool:
    """Whether ``prompt_text`` (the rendered prompt's tail) leaves a reasoning span open."""
    at = prompt_text.rfind(start)
    return at >= 0 and prompt_text.find(end, at) < 0 and not prompt_text[at + len(start) :].strip()


def regex_literal(text: str) -> str:
    """``text`` as a regex matching itself literally (inside a Lark ``/.../``)."""
    special = set("\\.^$|?*+()[]{}/")
    return "".join("\\" + c if c in special else c for c in text)


def lark_marker(text: str, ids: tuple[int, ...]) -> str:
    """A marker in a Lark rule: its token (``<[id]>``) when it is one token, which llguidance
    matches whether or not it counts the token as special; else its text."""
    return f"<[{ids[0]}]>" if len(ids) == 1 else lark_string(text)


def wrap_grammar(answer_rules: list[str], reasoning: Reasoning) -> list[str]:
    """Lark rules: a reasoning span (free text, then the end marker; optional unless the prompt
    opened it) and then the answer, whose rules use ``answer`` as their start symbol.

    A one-token end marker is not text: the span's text (which cannot spell the marker either)
    ends where the token comes. A marker spelled in text needs a lazy lexeme, which ends at the
    marker's first occurrence (a greedy one would run past it)."""
    start, end, opened, start_ids, end_ids = reasoning
    if len(end_ids) == 1:
        think = [
            f"think: THINK_TEXT {lark_marker(end, end_ids)}",
            f"THINK_TEXT: /(.|\\n)*/ & ~/(.|\\n)*{regex_literal(end)}(.|\\n)*/",
        ]
    else:
        think = [f"think[lazy]: /(.|\\n)*{regex_literal(end)}/"]
    head = "start: think answer" if opened else f"start: ({lark_marker(start, start_ids)} think)? answer"
    return [head, *think, *answer_rules]


def lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal has JSON's escapes


@dataclass
class ReasoningSplitter:
    """(reasoning, answer) pieces from a reply fed in pieces; markers are dropped from both."""

    start: str
    end: str
    opened: bool  # the reply starts inside the span
    _state: str = ""  # "head": may still open a span; "think": inside; "answer": after
    _pending: str = ""
    _strip: bool = False  # newlines right after the end marker are not part of the answer

    def __post_init__(self) -> None:
        self._state = "think" if self.opened else "head"

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, answer = "", ""
        self._pending += text
        while self._pending:
            if self._state == "head":
                stripped = self._pending.lstrip()
                if stripped.startswith(self.start):
                    self._pending, self._state = stripped[len(self.start) :], "think"
                elif self.start.startswith(stripped):  # could still be the start marker
                    break
                else:
                    self._state = "answer"
            elif self._state == "think":
                at = self._pending.find(self.end)
                if at < 0:
                    keep = held_suffix(self._pending, self.end)
                    reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                reasoning += self._pending[:at]
                self._pending, self._state, self._strip = self._pending[at + len(self.end) :], "answer", True
            else:
                if self._strip:
                    self._pending = self._pending.lstrip("\n")
                    self._strip = not self._pending
                answer, self._pending = answer + self._pending, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held back at the end (a span never closed is all reasoning)."""
        rest, self._pending = self._pending, ""
        return (rest, "") if self._state == "think" else ("", rest)
