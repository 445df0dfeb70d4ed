"""The Responses API's wire format (``POST /v1/responses``): the response object, its stream of
events, and the conversations kept for ``previous_response_id``. The body's translation into a
chat completion is `mtplx.server.responses_input`; the route is `mtplx.server.app`.

Shapes: the OpenAI API reference (Responses, streaming events) and the `openai` client's
``types/responses``; every event and field Codex reads is checked against its reader
(openai/codex ``codex-rs/codex-api/src/sse/responses.rs``; items as ``ResponseItem`` in
``codex-rs/protocol/src/models.rs``).

Output items, in the order the reply writes them: ``reasoning`` (a thinking model's span, as
one ``reasoning_text`` content part; ``summary`` is empty), ``message`` (one ``output_text``
part), ``function_call`` (``call_id``, ``name``, ``arguments`` as a JSON string). A reply with
neither text nor calls still has its (empty) message.

A stream: ``response.created``, ``response.in_progress``; per item ``response.output_item.added``,
its part's ``response.content_part.added``, the deltas (``response.output_text.delta``,
``response.reasoning_text.delta`` with ``content_index``, ``response.function_call_arguments.delta``),
then the ``.done`` events in reverse order; last ``response.completed`` (``usage``, the ``mtplx``
stats), or ``response.incomplete`` (``incomplete_details.reason`` = ``max_output_tokens``) when
cut by length, or ``response.failed`` (``response.error.code``: Codex compacts its history on
``context_length_exceeded``). A stream that ``--request-timeout`` cuts after its output began
ends ``response.incomplete`` too, with the partial output (``incomplete_details.reason``
``max_output_tokens``, the only budget reason the API has; ``mtplx.stopped`` says ``timeout``):
Codex retries a failed stream from scratch (up to five times) but reports an incomplete one
and stops. While the prompt prefills, SSE comments keep the connection alive.
``sequence_number`` rises by one from 0.

Invariant: the streamed events and the whole response of the same reply agree (the same reply
reader reads both; a delta sent is never taken back).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import replace
from typing import Any

from mtplx.engine.engine import GenerationChunk, GenerationStats
from mtplx.server.chat import ReplyReader
from mtplx.server.openai import SSE_KEEPALIVE, APIError, decode_stats
from mtplx.server.schemas import ResponsesRequest
from mtplx.server.tools import CallDelta, assistant_turn, chat_call

__all__ = ["ResponseStore", "ResponsesFormat"]


class ResponseStore:
    """The conversations of stored responses (``store: true``), by response id: an LRU of at most
    ``capacity`` entries, in this process only. Used from the event loop's thread alone.

    A conversation is chat turns (`mtplx.server.responses_input.conversation`) ending with the
    reply's turn, without ``instructions``: as in OpenAI's API, a request continuing it with
    ``previous_response_id`` gives its own."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._turns: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, response_id: str) -> list[dict] | None:
        turns = self._turns.get(response_id)
        if turns is not None:
            self._turns.move_to_end(response_id)
        return turns

    def put(self, response_id: str, turns: list[dict]) -> None:
        self._turns[response_id] = turns
        self._turns.move_to_end(response_id)
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat:
    """A reply as a Responses API response, whole (`response`) or as events (`sse_open`,
    `sse_chunk`, `sse_error`, `sse_close`: `mtplx.server.respond.ResponseFormat`)."""

    def __init__(
        self,
        body: ResponsesRequest,
        model_id: str,
        reader: ReplyReader | None,
        tokenizer: Any,
        store: tuple[ResponseStore, list[dict]] | None,
    ):
        self.body = body
        self.model_id = model_id
        self.reader = reader
        self.tokenizer = tokenizer
        self.store = store  # (ResponseStore, conversation) when the reply is to be kept, else None
        self.id = _new_id("resp")
        self.created_at = int(time.time())
        self._sequence = 0
        self._output: list[dict] = []  # items, in order; the last may be open
        self._open: str | None = None  # "reasoning" / "message" / "function_call" / None
        self._reasoning = ""
        self._calls: list[dict] = []  # the calls, in chat's shape (for the stored history)
        self._last: GenerationChunk | None = None  # the latest streamed chunk

    # ---------------------------------------------------------------- the response object
    def _envelope(self, status: str) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        choice = choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "model": self.model_id,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice,
            "tools": [t for t in body.tools or () if t.get("type") == "function"],
            "top_p": body.top_p,
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": None,
        }

    def _usage(self, stats: GenerationStats) -> dict:
        reasoning = (
            len(self.tokenizer.encode(self._reasoning, add_special_tokens=False)) if self._reasoning else 0
        )
        return {
            "input_tokens": stats.prompt_tokens,
            # cache_write_tokens (the client's types require it): the prompt tokens this request
            # prefilled, which is what it adds to the prompt cache (when the cache is on)
            "input_tokens_details": {
                "cached_tokens": stats.cached_tokens,
                "cache_write_tokens": stats.prefilled_tokens,
            },
            "output_tokens": stats.generated_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning, stats.generated_tokens)},
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        }

    def _final(self, last: GenerationChunk) -> dict:
        """The finished response object; keeps the conversation when the body asked to store it."""
        cut = last.finish_reason == "length"
        response = self._envelope("incomplete" if cut else "completed")
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["output"] = self._output
        response["usage"] = self._usage(last.stats)
        response["mtplx"] = decode_stats(last.stats)
        if self.store is not None:
            store, turns = self.store
            content = "".join(p["text"] for i in self._output if i["type"] == "message" for p in i["content"])
            store.put(self.id, [*turns, assistant_turn(content, self._calls)])
        return response

    # ---------------------------------------------------------------- items
    def _item(self, kind: str) -> dict:
        if kind == "reasoning":
            return {
                "id": _new_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
        return {
            "id": _new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }

    def _call_item(self, delta: CallDelta) -> dict:
        self._calls.append(chat_call(delta.id, delta.name, ""))
        return {
            "id": _new_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": delta.id,
            "name": delta.name,
            "arguments": "",
        }

    def _add_text(self, kind: str, text: str) -> None:
        """Adds ``text`` to the open item of ``kind`` (opened here if another is open)."""
        if self._open != kind:
            self._open = kind
            part = {"type": "output_text", "text": "", "annotations": []}
            if kind == "reasoning":
                part = {"type": "reasoning_text", "text": ""}
            self._output.append({**self._item(kind), "content": [part]})
        self._output[-1]["content"][0]["text"] += text
        if kind == "reasoning":
            self._reasoning += text

    def _add_call(self, delta: CallDelta) -> None:
        if delta.id is not None:
            self._open = "function_call"
            self._output.append(self._call_item(delta))
        self._output[-1]["arguments"] += delta.arguments
        self._calls[-1]["function"]["arguments"] += delta.arguments

    def _read(self, text: str, final: bool) -> list[tuple[str, Any]]:
        """What ``text`` adds, in order: ("reasoning", text), ("message", text), ("call", delta)."""
        if self.reader is None:
            return [("message", text)] if text else []
        reasoning, content, deltas = self.reader.feed(text, final)
        pieces: list[tuple[str, Any]] = [("reasoning", reasoning)] if reasoning else []
        pieces += [("message", content)] if content else []
        return pieces + [("call", d) for d in deltas]

    def _apply(self, kind: str, piece: Any) -> None:
        if kind == "call":
            self._add_call(piece)
        else:
            self._add_text(kind, piece)

    def _finish_items(self, cut: bool) -> None:
        """Every item's final status; a reply without a message or a call gets an empty message."""
        if not any(i["type"] in ("message", "function_call") for i in self._output):
            self._add_text("message", "")
        for item in self._output:
            item["status"] = "completed"
        if cut:
            self._output[-1]["status"] = "incomplete"

    # ---------------------------------------------------------------- whole
    def response(self, chunks: list[GenerationChunk]) -> dict:
        for kind, piece in self._read("".join(c.text for c in chunks), final=True):
            self._apply(kind, piece)
        self._finish_items(chunks[-1].finish_reason == "length")
        return self._final(chunks[-1])

    # ---------------------------------------------------------------- streaming
    def _event(self, kind: str, **payload: Any) -> str:
        data = {"type": kind, "sequence_number": self._sequence, **payload}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _snapshot(self, item: dict) -> dict:
        """An item as ``output_item.added`` shows it: nothing written yet."""
        if item["type"] == "function_call":
            return {**item, "arguments": ""}
        return {**item, "content": []}

    def _part_event(self, kind: str, item: dict, at: int, text: str | None = None) -> str:
        part = dict(item["content"][0])
        if text is not None:
            part["text"] = text
        return self._event(kind, item_id=item["id"], output_index=at, content_index=0, part=part)

    def _open_events(self) -> list[str]:
        at, item = len(self._output) - 1, self._output[-1]
        out = [self._event("response.output_item.added", output_index=at, item=self._snapshot(item))]
        if item["type"] != "function_call":
            out.append(self._part_event("response.content_part.added", item, at, text=""))
        return out

    def _delta_event(self, kind: str, piece: Any) -> str:
        at, item = len(self._output) - 1, self._output[-1]
        where = {"item_id": item["id"], "output_index": at}
        if kind == "call":
            return self._event("response.function_call_arguments.delta", **where, delta=piece.arguments)
        if kind == "reasoning":
            return self._event("response.reasoning_text.delta", **where, content_index=0, delta=piece)
        return self._event("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[])

    def _done_events(self, status: str) -> list[str]:
        """The open item's ``.done`` events (innermost first)."""
        if self._open is None:
            return []
        self._open = None
        at, item = len(self._output) - 1, self._output[-1]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": at}
        if item["type"] == "function_call":
            out = [self._event("response.function_call_arguments.done", **where, arguments=item["arguments"])]
        else:
            text = item["content"][0]["text"]
            kind = (
                "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            )
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out = [self._event(kind, **where, content_index=0, text=text, **extra)]
            out.append(self._part_event("response.content_part.done", item, at))
        return [*out, self._event("response.output_item.done", output_index=at, item=item)]

    def sse_open(self) -> list[str]:
        response = self._envelope("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def sse_keepalive(self) -> str:
        return SSE_KEEPALIVE

    def sse_chunk(self, chunk: GenerationChunk) -> list[str]:
        self._last = chunk
        out: list[str] = []
        for kind, piece in self._read(chunk.text, final=chunk.finish_reason is not None):
            item_kind = "function_call" if kind == "call" else kind
            opens = item_kind != self._open or (kind == "call" and piece.id is not None)
            if opens:
                out += self._done_events("completed")
            self._apply(kind, piece)
            if opens:
                out += self._open_events()
            if kind != "call" or piece.arguments:
                out.append(self._delta_event(kind, piece))
        return out

    def sse_error(self, err: APIError) -> str:
        if err.code == "timeout" and self._last is not None:  # output began: keep it (module docstring)
            return "".join(self._cut_events(self._last))
        return self._event("response.failed", response=self.failed(err))

    def _cut_events(self, last: GenerationChunk) -> list[str]:
        """The end of a stream the timeout cut: the open item incomplete, then ``response.incomplete``."""
        out = self._done_events("incomplete")
        self._finish_items(cut=True)
        response = self._final(replace(last, finish_reason="length"))
        response["mtplx"]["stopped"] = "timeout"
        return [*out, self._event("response.incomplete", response=response)]

    def failed(self, err: APIError) -> dict:
        """The response object of a reply that failed with ``err``."""
        response = self._envelope("failed")
        response["output"] = self._output
        response["error"] = {"code": err.code or err.type, "message": err.message}
        return response

    def failed_events(self, err: APIError) -> list[str]:
        """A whole stream for a request refused before it ran (Codex reads ``response.failed``)."""
        return [*self.sse_open(), self.sse_error(err)]

    def sse_close(self, last: GenerationChunk | None, include_usage: bool, failed: bool) -> list[str]:
        if failed or last is None:
            return []
        cut = last.finish_reason == "length"
        out = self._done_events("incomplete" if cut else "completed")
        if not any(i["type"] in ("message", "function_call") for i in self._output):
            self._add_text("message", "")
            out += self._open_events()
            out += self._done_events("completed")
        self._finish_items(cut)
        response = self._final(last)
        kind = "response.incomplete" if cut else "response.completed"
        return [*out, self._event(kind, response=response)]
