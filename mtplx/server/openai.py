"""The OpenAI wire format: error bodies, and the response bodies and stream chunks of chat and
text completions built from `GenerationChunk`s (the OpenAI API reference's shapes; logprobs are
the raw target log-probabilities, as vLLM reports them). Routes live in `mtplx.server.app`.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

from mtplx.engine.engine import GenerationChunk, GenerationStats
from mtplx.server.tools import merge_calls

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from mtplx.server.chat import ReplyReader

__all__ = ["APIError", "ChatFormat", "TextFormat", "decode_stats", "error_body", "sse_data", "usage"]


class APIError(Exception):
    """An error answered in the OpenAI shape."""

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
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers
        )


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ------------------------------------------------------------------ middleware


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
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


class _Format:
    object_name = ""

    def __init__(self, engine, model_id: str):
        self.tokenizer = engine.tokenizer
        self.model_id = model_id
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

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
        text = "".join(c.text for c in chunks)
        logprobs = self._logprobs(chunks) if chunks[0].logprobs is not None else None
        body = self._envelope(self.object_name, [self._choice(text, logprobs, chunks[-1].finish_reason)])
        body["usage"] = usage(chunks[-1].stats)
        body["mtplx"] = decode_stats(chunks[-1].stats)
        return body

    def usage_chunk(self, stats: GenerationStats) -> dict:
        body = self._envelope(self.chunk_object, [])
        body["usage"] = usage(stats)
        body["mtplx"] = decode_stats(stats)
        return body

    # The server-sent events of a stream (vLLM's convention for an error after streaming began:
    # a final ``data: {"error": ...}`` event, then nothing).
    def sse_open(self) -> list[str]:
        opening = self.opening_chunk()
        return [] if opening is None else [sse_data(opening)]

    def sse_chunk(self, chunk: GenerationChunk) -> list[str]:
        return [sse_data(self.chunk(chunk))]

    def sse_error(self, err: APIError) -> str:
        return sse_data(error_body(err.message, err.type, err.param, err.code))

    def sse_close(self, last: GenerationChunk | None, include_usage: bool, failed: bool) -> list[str]:
        usage_event = [sse_data(self.usage_chunk(last.stats))] if last is not None and include_usage else []
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

    def __init__(self, engine, model_id: str, reader: ReplyReader | None = None):
        super().__init__(engine, model_id)
        self.reader = reader

    def _finish(self, finish: str | None) -> str | None:
        called = self.reader is not None and self.reader.calls > 0
        return "tool_calls" if finish == "stop" and called else finish

    def response(self, chunks: list[GenerationChunk]) -> dict:
        body = super().response(chunks)
        if self.reader is not None:
            reasoning, content, deltas = self.reader.feed("".join(c.text for c in chunks), final=True)
            calls = merge_calls(deltas)
            message = body["choices"][0]["message"]
            message["content"] = content or (None if calls else "")
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            body["choices"][0]["finish_reason"] = self._finish(chunks[-1].finish_reason)
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

    def _choice(self, text: str, logprobs: dict | None, finish: str | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def opening_chunk(self) -> dict:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope(self.chunk_object, [choice])

    def chunk(self, chunk: GenerationChunk) -> dict:
        reasoning, content, deltas = "", chunk.text, []
        if self.reader is not None:
            reasoning, content, deltas = self.reader.feed(chunk.text, final=chunk.finish_reason is not None)
        delta: dict = {"content": content} if content else {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if deltas:
            delta["tool_calls"] = [d.wire() for d in deltas]
        logprobs = self._logprobs([chunk]) if chunk.logprobs is not None else None
        finish = self._finish(chunk.finish_reason)
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
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

    def _choice(self, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def opening_chunk(self) -> None:
        return None  # text completion streams start with the first text

    def chunk(self, chunk: GenerationChunk) -> dict:
        logprobs = self._logprobs([chunk]) if chunk.logprobs is not None else None
        return self._envelope(self.chunk_object, [self._choice(chunk.text, logprobs, chunk.finish_reason)])
