"""Where a chat prompt's caches are worth keeping when they cannot be trimmed (hybrid models).

A hybrid model's recurrent (gated-delta) state cannot be moved back, so its prompt cache serves
a prompt only from a snapshot of exactly that prompt's first tokens. A chat's next turn repeats
the previous prompt up to its generation prompt and rewrites the rest (the reply replaces the
thinking tail ``<think>\\n``), and another conversation with the same system prompt shares it up
to its first user turn. So a request keeps snapshots at:

- the end of the system prompt (and tools): where the first user turn's opener starts;
- the start of the generation prompt (the tokens ``add_generation_prompt`` appends);
- the start of a thinking tail inside the generation prompt.

mlx-lm's server keeps caches at the system prompt's end and before a thinking tail
(``mlx_lm/server.py``, ``_tokenize``) from the request's messages; here the boundaries are found
in the token ids alone (the server, the CLI and `Engine.generate` all hand the engine ids), from
two token patterns learned once per tokenizer by rendering a probe conversation through its own
chat template: the generation prompt (what ``add_generation_prompt=True`` adds) and the user
turn's opener (from the last special token before the probe user message's content that, with
the tokens after it, spells the role ``user``). A template the probe cannot render gives no
pattern; a boundary only chooses where snapshots are taken, never what a request outputs.
"""

from __future__ import annotations

from typing import Any

from mtplx.trunk.compat import thinking_markers

__all__ = ["ChatBoundaries", "find_pattern"]

_PROBE_SYSTEM = "You answer briefly."
_PROBE_USER = ("hello there", "goodbye now")  # lowercase: every tokenizer spells them


def find_pattern(tokens: list[int], pattern: tuple[int, ...], start: int = 0) -> int:
    """The first index >= ``start`` where ``pattern`` occurs in ``tokens``, -1 if none."""
    n = len(pattern)
    if not n:
        return -1
    first = pattern[0]
    for i in range(start, len(tokens) - n + 1):
        if tokens[i] == first and tuple(tokens[i : i + n]) == pattern:
            return i
    return -1


def _render(tokenizer: Any, messages: list[dict], generation: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _special_ids(tokenizer: Any) -> set[int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    ids = set(getattr(inner, "all_special_ids", []) or [])
    added = getattr(inner, "added_tokens_decoder", None) or {}
    ids.update(i for i, t in added.items() if getattr(t, "special", True))
    return ids


def _user_opener(tokenizer: Any, first: list[int], second: list[int]) -> tuple[int, ...]:
    """The tokens opening the probe's user turn: from the last special token before its content
    (where the two probes, differing only in that content, part) that spells ``user``."""
    part = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    special = _special_ids(tokenizer)
    for k in range(part - 1, -1, -1):
        if first[k] in special and "user" in "".join(tokenizer.decode([t]) for t in first[k:part]):
            return tuple(first[k:part])
    return ()


class ChatBoundaries:
    """Snapshot positions of chat prompts for one tokenizer (the module docstring); call it with a
    prompt's ids. Patterns are learned at the first call."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._learned = False
        self.generation_prompt: tuple[int, ...] = ()
        self.user_opener: tuple[int, ...] = ()
        self.think_start: tuple[int, ...] = ()

    def _learn(self) -> None:
        self._learned = True
        if getattr(self.tokenizer, "chat_template", None) is None:
            return
        probes = [
            [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": text}]
            for text in _PROBE_USER
        ]
        try:
            closed = _render(self.tokenizer, probes[0], False)
            opened = _render(self.tokenizer, probes[0], True)
            other = _render(self.tokenizer, probes[1], False)
            opener = _user_opener(self.tokenizer, closed, other)
        except Exception:  # a template that refuses the probe (no system role, ...): no patterns
            return
        if len(opened) > len(closed) and opened[: len(closed)] == closed:
            self.generation_prompt = tuple(opened[len(closed) :])
        self.user_opener = opener
        markers = thinking_markers(self.tokenizer)
        if markers is not None and markers.start_ids:
            self.think_start = tuple(markers.start_ids)

    def __call__(self, prompt: list[int]) -> list[int]:
        """Sorted positions p (0 < p < len(prompt) - 1) where the caches holding ``prompt[:p]``
        are worth keeping."""
        if not self._learned:
            self._learn()
        found = set()
        opener = find_pattern(prompt, self.user_opener) if self.user_opener else -1
        if opener > 0:
            found.add(opener)
        suffix = self.generation_prompt
        if suffix and len(prompt) > len(suffix) and tuple(prompt[-len(suffix) :]) == suffix:
            start = len(prompt) - len(suffix)
            found.add(start)
            think = find_pattern(prompt, self.think_start, start) if self.think_start else -1
            if think > start:
                found.add(think)
        return sorted(p for p in found if 0 < p < len(prompt) - 1)
