"""Text in and out of the model: prompts to token ids (raw text, chat messages through the
tokenizer's template, or ids as they are), and token ids to text with stop strings.

`TextAssembler` detokenizes incrementally (never splitting a multi-byte character: mlx-lm's
streaming detokenizer) and holds back any text that could still become a stop string, so a stop
string is never emitted, even in part.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mtplx.errors import MtplxError

__all__ = ["TextAssembler", "encode_chat", "encode_prompt", "with_image_parts"]


def encode_prompt(
    tokenizer,
    vocab_size: int,
    prompt: str | Sequence[dict] | Sequence[int],
    chat: bool | None = None,
    tools: list | None = None,
    literal: Sequence[str] = (),
) -> list[int]:
    """Token ids of ``prompt``: raw text (through the chat template when ``chat``), a chat message
    list (always through the template, with ``tools`` for its ``tools=``; `encode_chat` for
    ``literal``), or token ids (checked against the vocabulary, taken as they are)."""
    if not isinstance(prompt, str) and prompt and all(isinstance(t, int) for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise MtplxError(f"prompt: token id {bad} is outside the vocabulary of {vocab_size}")
        return list(prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise MtplxError("prompt is empty")
        use_chat = bool(chat)
        if use_chat:
            prompt = [{"role": "user", "content": prompt}]
    else:
        use_chat = True
        if not prompt:
            raise MtplxError("prompt is an empty message list")
    if use_chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise MtplxError("prompt: this model's tokenizer has no chat template; pass raw text")
        tokens = encode_chat(tokenizer, list(prompt), tools, literal)
    else:
        tokens = tokenizer.encode(prompt)
    tokens = list(tokens)
    if not tokens:
        raise MtplxError("prompt encodes to no tokens")
    return tokens


def encode_chat(
    tokenizer, messages: list, tools: list | None = None, literal: Sequence[str] = ()
) -> list[int]:
    """The chat template's token ids for ``messages``, where the ``literal`` strings (special
    tokens' text, such as a vision checkpoint's image placeholder) in the messages' own text are
    encoded as the plain text they are, never as the special token: only the template makes those.
    Messages without them encode exactly as the template does; with them, the template renders
    each occurrence as a marker and the text between markers is encoded piece by piece."""
    found = [s for s in literal if s and any(s in text for text in _message_texts(messages))]
    if not found:
        ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    marks = _unused_marks(messages, len(found))
    escaped = [_replace_text(m, found, marks) for m in messages]
    rendered = tokenizer.apply_chat_template(escaped, tools=tools, add_generation_prompt=True, tokenize=False)
    tokens: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, marks)) + ")", rendered):
        if piece in marks:
            literal_text = found[marks.index(piece)]
            tokens.extend(tokenizer.encode(literal_text, add_special_tokens=False, split_special_tokens=True))
        elif piece:
            tokens.extend(tokenizer.encode(piece, add_special_tokens=False))
    return tokens


def _message_texts(messages: list) -> list[str]:
    texts = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            texts.append(content)
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return texts


def _unused_marks(messages: list, count: int) -> list[str]:
    """``count`` marker strings (private-use characters) that no message text contains."""
    texts = "".join(_message_texts(messages))
    base = next(c for c in range(0xE000, 0xF8FF) if chr(c) not in texts)
    return [f"{chr(base)}{k}{chr(base)}" for k in range(count)]


def _replace_text(message: dict, found: list[str], marks: list[str]) -> dict:
    def swap(text: str) -> str:
        for literal_text, mark in zip(found, marks):
            text = text.replace(literal_text, mark)
        return text

    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": swap(content)}
    if isinstance(content, list):
        parts = [
            {**p, "text": swap(p["text"])} if isinstance(p, dict) and isinstance(p.get("text"), str) else p
            for p in content
        ]
        return {**message, "content": parts}
    return message


# Content part types a prompt may hold besides text and images: refused in one line.
_UNSUPPORTED_PARTS = {"video": "video", "video_url": "video", "input_audio": "audio", "audio": "audio"}


def with_image_parts(
    prompt: str | Sequence[dict] | Sequence[int], images: Sequence
) -> tuple[str | Sequence[dict] | Sequence[int], list]:
    """(prompt, every image of it in order): ``images`` go before the text of the last user
    message as ``{"type": "image", "image": source}`` parts (a text prompt becomes that message;
    a token-id prompt keeps its own image pad tokens, one per image); image parts already in the
    messages count too. Video and audio parts are refused."""
    if not isinstance(prompt, str) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt, list(images)
    if isinstance(prompt, str):
        if not images:
            return prompt, []
        prompt = [{"role": "user", "content": prompt}]
    messages = list(prompt)
    if images:  # copies: the caller's messages stay as they were
        messages = [dict(m) for m in messages]
        users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
        if not users:
            raise MtplxError("images: the prompt has no user message to put them in")
        last = messages[users[-1]]
        content = last.get("content")
        text_parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        last["content"] = [{"type": "image", "image": source} for source in images] + text_parts
    found = []
    for message in messages:
        content = message.get("content")
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _UNSUPPORTED_PARTS:
                raise MtplxError(f"prompt: {_UNSUPPORTED_PARTS[kind]} parts are not supported (images only)")
            if kind == "image":
                found.append(part.get("image"))
    return messages, found


class TextAssembler:
    """Incremental detokenization with stop strings that may span tokens.

    Text that could still turn out to be the start of a stop string is held
    back, so a stop string is never emitted, even partly.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._detok = tokenizer.detokenizer
        self._detok.reset()
        self._stop = [s for s in stop if s]
        self._emitted = 0
        self.stopped = False

    def _held_back(self, text: str) -> int:
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        text = self._detok.text
        hits = [i for i in (text.find(s, max(self._emitted - len(s), 0)) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        return self._take(text, len(text) - self._held_back(text))

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._take(self._detok.text, len(self._detok.text))

    def _take(self, text: str, end: int) -> str:
        end = max(end, self._emitted)
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
