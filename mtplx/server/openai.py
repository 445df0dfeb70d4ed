"""The OpenAI wire format: error bodies, and the response bodies and stream chunks of chat and
text completions built from `GenerationChunk`s (the OpenAI API reference's shapes; logprobs are
the raw target log-probabilities, as vLLM reports them). Routes live in `mtplx.server.app`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtplx.engine.engine import GenerationChunk, GenerationStats
from mtplx.server.tools import merge_calls

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from mtplx.server.chat import ReplyReader

__all__ = [
    "SSE_KEEPALIVE",
    "APIError",
    "ChatFormat",
    "TextFormat",
    "decode_stats",
    "error_body",
    "sse_data",
    "usage",
]


class APIError(Exception):
    """An error answered in the OpenAI shape; its message is one line (a client's value quoted in it
    may hold line breaks: they become spaces)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        message = " ".join(message.splitlines())  # one line, whatever a client's value held
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers
        )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# An SSE comment, which clients skip: the OpenAI routes' keep-alive (chat, completions, Responses).
SSE_KEEPALIVE = ": keep-alive\n\n"


# ------------------------------------------------------------------ usage and the mtplx extension


def usage(stats: GenerationStats, *more: GenerationStats) -> dict:
    """The usage of a request whose choices ended with ``stats`` (and ``more``: n > 1): the
    prompt counted once (it was forwarded once), the completions summed."""
    completion = stats.generated_tokens + sum(s.generated_tokens for s in more)
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": stats.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def decode_stats(stats: GenerationStats) -> dict:
    """The mtplx extension: how the speculative decode went."""
    return {
        "mode": stats.mode,
        "depth": stats.depth,
        "cycles": stats.cycles,
        "tokens_per_cycle": stats.tokens_per_cycle,
        "acceptance_per_position": stats.acceptance_per_position,
        "drafted_per_position": stats.drafted_per_position,  # the cycles each acceptance is over
        "cached_tokens": stats.cached_tokens,
        "prefilled_tokens": stats.prefilled_tokens,
        "prefill_seconds": stats.prefill_seconds,
        "decode_tokens_per_sec": stats.decode_tokens_per_sec,
        "drafters": stats.drafters,  # drafted / accepted per drafter ("head", "lookup", "model")
    }


def _by_choice(chunks: list[GenerationChunk]) -> list[list[GenerationChunk]]:
    """A request's chunks, choice by choice (``GenerationChunk.index``), each in order."""
    choices: dict[int, list[GenerationChunk]] = {}
    for chunk in chunks:
        choices.setdefault(chunk.index, []).append(chunk)
    return [choices[i] for i in sorted(choices)]


class _Format:
    """A request's reply in an OpenAI shape; with ``n`` > 1 one entry of ``choices`` per choice,
    each chunk streamed under its choice's ``index``."""

    object_name = ""

    def __init__(self, engine, model_id: str, n: int = 1):
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.n = n
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._final: dict[int, GenerationStats] = {}  # each streamed choice's latest stats

    def _envelope(self, object_name: str, choices: list) -> dict:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model_id,
            "choices": choices,
        }

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def response(self, chunks: list[GenerationChunk]) -> dict:
        choices, finals = [], []
        for index, parts in enumerate(_by_choice(chunks)):
            text = "".join(c.text for c in parts)
            logprobs = self._logprobs(parts) if parts[0].logprobs is not None else None
            choices.append(self._choice(text, logprobs, parts[-1].finish_reason, index))
            finals.append(parts[-1].stats)
        body = self._envelope(self.object_name, choices)
        self._add_usage(body, finals)
        return body

    def _add_usage(self, body: dict, finals: list[GenerationStats]) -> None:
        body["usage"] = usage(*finals)
        body["mtplx"] = decode_stats(finals[0])
        if len(finals) > 1:  # each choice's own decode (choices 1.. start from choice 0's prompt caches)
            body["mtplx"]["choices"] = [decode_stats(stats) for stats in finals]

    def usage_chunk(self, finals: list[GenerationStats]) -> dict:
        body = self._envelope(self.chunk_object, [])
        self._add_usage(body, finals)
        return body

    # The server-sent events of a stream (vLLM's convention for an error after streaming began:
    # a final ``data: {"error": ...}`` event, then nothing).
    def sse_open(self) -> list[str]:
        openings = [self.opening_chunk(index) for index in range(self.n)]
        return [sse_data(opening) for opening in openings if opening is not None]

    def sse_keepalive(self) -> str:
        return SSE_KEEPALIVE

    def sse_chunk(self, chunk: GenerationChunk) -> list[str]:
        self._final[chunk.index] = chunk.stats
        return [sse_data(self.chunk(chunk))]

    def sse_error(self, err: APIError) -> str:
        return sse_data(error_body(err.message, err.type, err.param, err.code))

    def sse_close(self, last: GenerationChunk | None, include_usage: bool, failed: bool) -> list[str]:
        finals = [self._final[i] for i in sorted(self._final)]
        usage_event = [sse_data(self.usage_chunk(finals))] if last is not None and include_usage else []
        return [*usage_event, "data: [DONE]\n\n"]


def sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class ChatFormat(_Format):
    """Chat replies. With a ``reader`` (tools offered, or a thinking model) the text is split
    into ``reasoning_content`` (also as ``reasoning``, mlx-lm's name), content and ``tool_calls``;
    a reply that called a tool and stopped says ``finish_reason: "tool_calls"``."""

    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, engine, model_id: str, readers: Callable[[], ReplyReader] | None = None, n: int = 1):
        """``readers`` makes a fresh `ReplyReader` (one per choice: each splits its own text)."""
        super().__init__(engine, model_id, n)
        self._new_reader = readers
        self._readers: dict[int, ReplyReader] = {}

    def reader(self, index: int) -> ReplyReader | None:
        if self._new_reader is None:
            return None
        if index not in self._readers:
            self._readers[index] = self._new_reader()
        return self._readers[index]

    def _finish(self, finish: str | None, index: int) -> str | None:
        reader = self.reader(index)
        called = reader is not None and reader.calls > 0
        return "tool_calls" if finish == "stop" and called else finish

    def response(self, chunks: list[GenerationChunk]) -> dict:
        body = super().response(chunks)
        if self._new_reader is None:
            return body
        for index, parts in enumerate(_by_choice(chunks)):
            reasoning, content, deltas = self.reader(index).feed("".join(c.text for c in parts), final=True)
            calls = merge_calls(deltas)
            message = body["choices"][index]["message"]
            message["content"] = content or (None if calls else "")
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            body["choices"][index]["finish_reason"] = self._finish(parts[-1].finish_reason, index)
        return body

    def _entry(self, token: int, logprob: float) -> dict:
        text = self._token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _logprobs(self, chunks: list[GenerationChunk]) -> dict:
        content = []
        for chunk in chunks:
            for token, lp in zip(chunk.token_ids, chunk.logprobs or []):
                entry = self._entry(token, lp.logprob)
                entry["top_logprobs"] = [self._entry(t, v) for t, v in lp.top]
                content.append(entry)
        return {"content": content}

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, index: int = 0) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def opening_chunk(self, index: int = 0) -> dict:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.chunk_object, [choice])

    def chunk(self, chunk: GenerationChunk) -> dict:
        reasoning, content, deltas = "", chunk.text, []
        reader = self.reader(chunk.index)
        if reader is not None:
            reasoning, content, deltas = reader.feed(chunk.text, final=chunk.finish_reason is not None)
        delta: dict = {"content": content} if content else {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if deltas:
            delta["tool_calls"] = [d.wire() for d in deltas]
        logprobs = self._logprobs([chunk]) if chunk.logprobs is not None else None
        finish = self._finish(chunk.finish_reason, chunk.index)
        choice = {"index": chunk.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self._envelope(self.chunk_object, [choice])


class TextFormat(_Format):
    prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def _logprobs(self, chunks: list[GenerationChunk], offset: int = 0) -> dict:
        tokens, token_logprobs, top, offsets = [], [], [], []
        for chunk in chunks:
            for token, lp in zip(chunk.token_ids, chunk.logprobs or []):
                text = self._token_text(token)
                tokens.append(text)
                token_logprobs.append(lp.logprob)
                top.append({self._token_text(t): v for t, v in lp.top})
                offsets.append(offset)
                offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _choice(self, text: str, logprobs: dict | None, finish: str | None, index: int = 0) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def opening_chunk(self, index: int = 0) -> None:
        return None  # text completion streams start with the first text

    def chunk(self, chunk: GenerationChunk) -> dict:
        logprobs = self._logprobs([chunk]) if chunk.logprobs is not None else None
        choice = self._choice(chunk.text, logprobs, chunk.finish_reason, chunk.index)
        return self._envelope(self.chunk_object, [choice])
