"""The Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``): request
bodies, their translation into a chat completion, and the reply's wire format.

Shapes follow Anthropic's API reference (Messages, streaming messages, errors). A body is
translated into the OpenAI chat request the other route takes (`to_chat`), so both APIs share
the prompt rendering, the tool grammars and the call reading (`mtplx.server.chat`):

- ``system`` -> a system message; ``role: "system"`` entries in ``messages`` (Claude Code's
  mid-conversation system messages): the leading ones join the system prompt, a later one is
  folded into the adjacent user turn (the one before it, else the one after it, else a user turn
  of its own), as Claude Code itself does when a server refuses them, since most chat templates
  allow a system message only first. ``tool_use`` blocks of an assistant turn -> its ``tool_calls``
  (``input`` as the JSON arguments); ``tool_result`` blocks of a user turn -> ``tool`` messages,
  before the turn's text; ``thinking`` blocks of earlier turns are dropped (chat templates drop
  earlier reasoning too).
- ``tools[].input_schema`` -> the function's parameters; ``tool_choice`` auto / any / tool / none
  -> auto / required / the named function / none; ``disable_parallel_tool_use`` -> one call.
- ``stop_sequences`` -> ``stop``; ``max_tokens`` is required, as in Anthropic's API, and is a
  bound: the route lowers it to what ``--max-tokens-cap`` and the context leave; a prompt that
  alone fills the context is Anthropic's ``prompt is too long: P tokens > C maximum``.
- Per-request noise is dropped before the prompt is rendered, so an agent's prompts share their
  cached prefix (docs in README "Claude Code"): Claude Code's ``x-anthropic-billing-header:`` system
  block (its ``cch=`` hash changes every request; it carries nothing for the model), and its
  "tokens left" notes, ``role: "system"`` entries holding only ``<total_tokens>N tokens
  left</total_tokens>`` (sent after tool results and user turns since Claude Code 2.1.233: N
  counts down the context Claude Code assumes for a Claude model, not the served model's, and it
  changes every request, so kept it would cut the cached prefix at the newest one).

Usage follows Anthropic's split: ``input_tokens`` (the prompt tokens prefilled) +
``cache_read_input_tokens`` (read from the prompt cache) = the prompt; ``cache_creation_input_tokens``
is 0 (entries are written without a charge). ``message_start`` goes out before the prefill, so
it counts the whole prompt as ``input_tokens``; the final ``message_delta`` has the split.

Replies: a thinking model's reasoning is a ``thinking`` block (empty signature: nothing is
signed here) before the text; ``stop_reason`` is ``tool_use`` after a call, ``max_tokens`` when
cut, ``stop_sequence`` (with ``stop_sequence`` set) when one of them ended the reply, else
``end_turn``. Errors are ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Literal

from mtplx.engine.engine import GenerationChunk, GenerationStats
from mtplx.server.chat import ReplyReader, unique_tool_names
from mtplx.server.images import anthropic_image_url
from mtplx.server.openai import APIError
from mtplx.server.schemas import FUNCTION_NAME, SpeculationFields
from mtplx.server.tools import assistant_turn, chat_call, chat_tool, function_choice, merge_calls

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

__all__ = [
    "BILLING_HEADER",
    "MessagesFormat",
    "MessagesRequest",
    "error_body",
    "error_type",
    "prompt_too_long",
    "to_chat",
]

# The start of Claude Code's per-request system block (dropped: module docstring).
BILLING_HEADER = "x-anthropic-billing-header:"
# The whole text of Claude Code's "tokens left" system entries (dropped: module docstring).
TOKENS_LEFT_NOTE = re.compile(r"\s*<total_tokens>[^<]*</total_tokens>\s*")


class _Body(BaseModel):
    """Unknown fields are ignored (clients send many optional ones), as on the OpenAI routes."""

    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: StrictBool = False

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ImageBlock(_Body):
    """An image: ``source`` {"type": "base64", "media_type", "data"} (or "url": refused unless a local
    file under the server's --image-dir; `mtplx.server.images`)."""

    type: Literal["image"]
    source: dict[str, Any]


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class InputMessage(_Body):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDefinition(_Body):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class MessagesRequest(_Body, SpeculationFields):
    model: str | None = None  # None: the served model
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False


class CountTokensRequest(_Body):
    model: str | None = None
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None


def _blocks(content: str | list) -> list:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


def _text(content: str | list) -> str:
    return "".join(b.text for b in _blocks(content) if isinstance(b, TextBlock))


def _system_prompt(body: MessagesRequest | CountTokensRequest) -> str:
    """``system`` without the billing block, and the leading ``role: "system"`` entries but the
    "tokens left" notes."""
    blocks = _blocks(body.system or "")
    parts = ["".join(b.text for b in blocks if not b.text.startswith(BILLING_HEADER))]
    for turn in body.messages:
        if turn.role != "system":
            break
        if not TOKENS_LEFT_NOTE.fullmatch(_text(turn.content)):
            parts.append(_text(turn.content))
    return "\n\n".join(p for p in parts if p)


def _fold_system(turns: list[InputMessage]) -> list[tuple[str, list]]:
    """(role, blocks) of each user and assistant turn, a later system entry folded into the user
    turn just before it, else the one just after it, else a user turn of its own."""
    start = next((i for i, t in enumerate(turns) if t.role != "system"), len(turns))
    out: list[tuple[str, list]] = []
    pending: list[str] = []  # system text waiting for the next user turn
    for turn in turns[start:]:
        blocks = list(_blocks(turn.content))
        if turn.role == "system":
            text = _text(turn.content)
            if TOKENS_LEFT_NOTE.fullmatch(text):
                continue
            if out and out[-1][0] == "user" and not pending:
                out[-1][1].append(TextBlock(type="text", text="\n\n" + text))
            else:
                pending.append(text)
            continue
        if pending and turn.role == "user":
            has_text = any(isinstance(b, TextBlock) for b in blocks)
            note = "\n\n".join(pending) + ("\n\n" if has_text else "")
            blocks.insert(_after_results(blocks), TextBlock(type="text", text=note))
        elif pending:
            out.append(("user", [TextBlock(type="text", text="\n\n".join(pending))]))
        pending = []
        out.append((turn.role, blocks))
    if pending:
        out.append(("user", [TextBlock(type="text", text="\n\n".join(pending))]))
    return out


def _after_results(blocks: list) -> int:
    """Where a user turn's own text starts: after its tool results (they render first)."""
    return sum(1 for b in blocks if isinstance(b, ToolResultBlock))


def _messages(body: MessagesRequest | CountTokensRequest) -> list[dict]:
    out: list[dict] = []
    system = _system_prompt(body)
    if system:
        out.append({"role": "system", "content": system})
    for role, blocks in _fold_system(body.messages):
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if role == "user":
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    content = b.text() if not b.is_error else f"Error: {b.text()}"
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
            if any(isinstance(b, ImageBlock) for b in blocks):  # as OpenAI image_url parts, in order
                parts = [_chat_part(b) for b in blocks if isinstance(b, (TextBlock, ImageBlock))]
                out.append({"role": "user", "content": parts})
            elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": text})
            continue
        calls = [chat_call(b.id, b.name, json.dumps(b.input)) for b in blocks if isinstance(b, ToolUseBlock)]
        out.append(assistant_turn(text, calls))
    return out


def _chat_part(block: TextBlock | ImageBlock) -> dict:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": "image_url", "image_url": {"url": anthropic_image_url(block.source)}}


def _tool_choice(choice: ToolChoice | None) -> tuple[Any, bool | None]:
    if choice is None:
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise APIError(400, "tool_choice.name: required when type is 'tool'", param="tool_choice")
        return function_choice(choice.name), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat(body: MessagesRequest | CountTokensRequest, max_tokens_cap: int | None = None) -> dict:
    """The OpenAI chat completion body that asks for what ``body`` asks (module docstring);
    ``max_tokens`` at most ``max_tokens_cap``."""
    choice, parallel = _tool_choice(body.tool_choice)
    if all(turn.role == "system" for turn in body.messages):
        raise APIError(
            400, "messages: needs a user or assistant message, not only system ones", param="messages"
        )
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body)}
    unique_tool_names([(i, t.name) for i, t in enumerate(body.tools or ())], "tools[{}].name")
    if body.tools:
        chat["tools"] = [chat_tool(t.name, t.description, t.input_schema) for t in body.tools]
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    if isinstance(body, MessagesRequest):
        chat.update(
            max_tokens=min(body.max_tokens, max_tokens_cap or body.max_tokens),
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=body.stop_sequences,
            stream=body.stream,
            **body.speculation(),
        )
    return {k: v for k, v in chat.items() if v is not None}


# ------------------------------------------------------------------ errors

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "api_error")


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def prompt_too_long(prompt_tokens: int, context: int) -> str:
    """Anthropic's wording for a prompt that leaves no room to reply (Claude Code recognises it)."""
    return f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum"


def usage_of(stats: GenerationStats) -> dict:
    """Anthropic's usage split of ``stats`` (module docstring)."""
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": stats.cached_tokens,
        "output_tokens": stats.generated_tokens,
    }


# ------------------------------------------------------------------ replies


def _event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n"


def _tool_use_input(arguments: str) -> dict:
    """A tool_use block's ``input``: the call's JSON arguments as an object ({} when they are not one)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}  # a call cut by max_tokens: its arguments never closed
    return value if isinstance(value, dict) else {}


class MessagesFormat:
    """A reply as an Anthropic message, whole or as a stream of events (content blocks in order)."""

    def __init__(
        self,
        model_id: str,
        reader: ReplyReader,
        tokenizer: Any,
        stop_sequences: list[str] | None,
        prompt_tokens: int = 0,
    ):
        self.model_id = model_id
        self.prompt_tokens = prompt_tokens  # message_start's input_tokens (sent before the prefill)
        self.reader = reader
        self.tokenizer = tokenizer
        self.stop_sequences = stop_sequences or []
        self._text = ""  # the reply so far, and its tokens
        self._ids: list[int] = []
        self.id = f"msg_{uuid.uuid4().hex}"
        self._block = -1  # index of the open content block, -1 before the first
        self._open: str | None = None  # "text" / "tool_use" / None

    def _ending(self, finish: str | None) -> dict:
        """``stop_reason`` and ``stop_sequence`` of the reply that ended with ``finish``."""
        if finish == "length":
            return {"stop_reason": "max_tokens", "stop_sequence": None}
        if self.reader.calls > 0:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        matched = self._matched_stop()
        reason = "end_turn" if matched is None else "stop_sequence"
        return {"stop_reason": reason, "stop_sequence": matched}

    def _matched_stop(self) -> str | None:
        """The stop sequence that ended the reply, if one did: the text leaves a stop string out
        but the tokens keep it, so they decode to the text and then the stop string (a decode
        of the whole may differ at its very start: the streaming detokenizer drops a leading space)."""
        if not self.stop_sequences:
            return None
        full = self.tokenizer.decode(self._ids)
        at = full.find(self._text)
        if at < 0:
            return None
        rest = full[at + len(self._text) :]
        rests = (rest, rest.lstrip()) if not self._text else (rest,)
        return next((s for s in self.stop_sequences for r in rests if r.startswith(s)), None)

    def _message(self, content: list, ending: dict, usage: dict) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": content,
            **ending,
            "usage": usage,
        }

    def response(self, chunks: list[GenerationChunk]) -> dict:
        self._text = "".join(c.text for c in chunks)
        self._ids = [t for c in chunks for t in c.token_ids]
        reasoning, content, deltas = self.reader.feed(self._text, final=True)
        blocks: list[dict] = (
            [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        )
        blocks += [{"type": "text", "text": content}] if content else []
        for call in merge_calls(deltas):
            fn = call["function"]
            blocks.append(
                {
                    "type": "tool_use",
                    "id": _tool_id(call["id"]),
                    "name": fn["name"],
                    "input": _tool_use_input(fn["arguments"]),
                }
            )
        return self._message(blocks, self._ending(chunks[-1].finish_reason), usage_of(chunks[-1].stats))

    # ---------------------------------------------------------------- streaming
    def sse_open(self) -> list[str]:
        usage = {
            "input_tokens": self.prompt_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        message = self._message([], {"stop_reason": None, "stop_sequence": None}, usage)
        return [_event("message_start", {"message": message}), self.sse_keepalive()]

    def sse_keepalive(self) -> str:
        return _event("ping", {})

    def _switch(self, kind: str, start: dict) -> list[str]:
        out = self._close_block()
        self._block += 1
        self._open = kind
        return [*out, _event("content_block_start", {"index": self._block, "content_block": start})]

    def _close_block(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", {"index": self._block})]

    def sse_chunk(self, chunk: GenerationChunk) -> list[str]:
        out = []
        self._text += chunk.text
        self._ids += chunk.token_ids
        reasoning, content, deltas = self.reader.feed(chunk.text, final=chunk.finish_reason is not None)
        if reasoning:
            if self._open != "thinking":
                out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            delta = {"type": "thinking_delta", "thinking": reasoning}
            out.append(_event("content_block_delta", {"index": self._block, "delta": delta}))
        if content:
            if self._open != "text":
                out += self._switch("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": content}
            out.append(_event("content_block_delta", {"index": self._block, "delta": delta}))
        for d in deltas:
            if d.id is not None:
                block = {"type": "tool_use", "id": _tool_id(d.id), "name": d.name, "input": {}}
                out += self._switch("tool_use", block)
            if d.arguments:
                delta = {"type": "input_json_delta", "partial_json": d.arguments}
                out.append(_event("content_block_delta", {"index": self._block, "delta": delta}))
        if chunk.finish_reason is not None:
            out += self._close_block()
            delta = self._ending(chunk.finish_reason)
            totals = usage_of(chunk.stats)
            out += [_event("message_delta", {"delta": delta, "usage": totals}), _event("message_stop", {})]
        return out

    def sse_error(self, err: APIError) -> str:
        return _event("error", {"error": error_body(err.status, err.message)["error"]})

    def sse_close(self, last: GenerationChunk | None, include_usage: bool, failed: bool) -> list[str]:
        return []  # message_stop went with the last chunk; an error ends the stream as it is


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")
