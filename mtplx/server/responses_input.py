"""A Responses API body (``POST /v1/responses``) -> the chat completion it asks for.

Like `mtplx.server.anthropic.to_chat` for Messages, the body is translated into the chat body the
chat route takes, so all three APIs share the prompt rendering, the tool grammars, the reasoning
split and the call reading (`mtplx.server.chat`). Shapes: the OpenAI API reference (Responses),
the `openai` client's ``types/responses``, and what Codex sends (openai/codex
``codex-rs/codex-api/src/common.rs`` ``ResponsesApiRequest``, items in
``codex-rs/protocol/src/models.rs`` ``ResponseItem``).

Input items -> chat turns (`conversation`):
- ``message`` (or an item with a ``role`` and no ``type``): user / assistant / system /
  developer; content a string or parts ``input_text`` / ``output_text`` (``refusal`` counts as
  text). ``developer`` is a system turn (Qwen-family templates drop ``developer`` turns).
- ``function_call``: a call on the assistant turn before it (a new assistant turn if the turn
  before is not the assistant's); ``function_call_output``: a ``tool`` turn answering ``call_id``.
- ``reasoning`` items are dropped (chat templates drop earlier reasoning too), and so are the
  items of hosted tools (``web_search_call``, ``local_shell_call``, ``custom_tool_call`` ...: no
  call of theirs can come from this server). Any other type is a 400 naming it.

The prompt (`assemble`): ``instructions`` and the system turns before the first user or assistant
turn make one system message (templates such as Qwen3's refuse a system turn elsewhere); a system
turn later in the conversation becomes a user turn where it stands.

Tools: ``{"type": "function", "name", "parameters", ...}`` -> chat's ``{"type": "function",
"function": {...}}``; hosted tool types are dropped (one log line per type per process).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from mtplx.errors import MtplxError
from mtplx.server.chat import unique_tool_names
from mtplx.server.openai import APIError
from mtplx.server.schemas import FUNCTION_NAME, ResponsesRequest
from mtplx.server.tools import assistant_turn, chat_call, chat_tool, function_choice
from mtplx.server.validation import first_problem

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

log = logging.getLogger("mtplx.server")

__all__ = ["ChatTurn", "assemble", "conversation", "responses_error", "to_chat"]

# Items of hosted tools (the OpenAI API reference's output item types): dropped from the input.
HOSTED_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "computer_call",
        "computer_call_output",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "local_shell_call_output",
        "shell_call",
        "shell_call_output",
        "apply_patch_call",
        "apply_patch_call_output",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "mcp_call",
        "custom_tool_call",
        "custom_tool_call_output",
        "tool_search_call",
        "tool_search_output",
        "compaction",
    }
)
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
_logged_drops: set[frozenset[str]] = set()


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Part(_Item):
    type: str
    text: str | None = None
    refusal: str | None = None


class _MessageItem(_Item):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[_Part]


class _FunctionCallItem(_Item):
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: str


class _FunctionCallOutputItem(_Item):
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[_Part]


class _FunctionTool(_Item):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


def _checked(model: type[_Item], value: Any, where: str) -> Any:
    """``value`` as ``model``, or a 400 naming the field inside it (``input[2].call_id: ...``)."""
    try:
        return model.model_validate(value)
    except ValidationError as err:
        param, reason = first_problem(err.errors(), value, where)
        raise APIError(400, f"{param}: {reason}", param=param) from None


def _text(parts: str | list[_Part], where: str) -> str:
    """The text of a content string or of its parts; a part that is not text is a 400."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        if part.type == "refusal":
            out.append(part.refusal or "")
        elif part.type in _TEXT_PARTS and part.text is not None:
            out.append(part.text)
        else:
            param = f"{where}[{j}]"
            raise APIError(400, f"{param}: {part.type!r} parts are not supported (text only)", param=param)
    return "".join(out)


def _add_call(turns: list[dict], call: _FunctionCallItem) -> None:
    wire = chat_call(call.call_id, call.name, call.arguments)
    last = turns[-1] if turns else None
    if last is not None and last["role"] == "assistant":
        last["tool_calls"] = [*(last.get("tool_calls") or []), wire]
        return
    turns.append(assistant_turn("", [wire]))


def _history_calls(history: list[dict]) -> set[str]:
    """The call ids of a stored conversation's assistant turns."""
    return {call["id"] for turn in history for call in turn.get("tool_calls") or ()}


def conversation(items: str | list[dict[str, Any]], history: list[dict] = ()) -> list[dict]:
    """``input`` -> chat turns (roles user, assistant, system, tool), without ``instructions``, after
    ``history`` (a stored conversation: its calls may be answered here). A ``function_call_output``
    must answer a call made before it (a ``function_call``, or a hosted tool's call, whose item is
    dropped but whose output Codex sends as a ``function_call_output``)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    turns: list[dict] = []
    calls = _history_calls(list(history))
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str):
            raise APIError(400, f"{where}.type: required (a string)", param=f"{where}.type")
        if kind == "message":
            message = _checked(_MessageItem, item, where)
            role = "system" if message.role == "developer" else message.role
            turns.append({"role": role, "content": _text(message.content, where + ".content")})
        elif kind == "function_call":
            call = _checked(_FunctionCallItem, item, where)
            calls.add(call.call_id)
            _add_call(turns, call)
        elif kind == "function_call_output":
            result = _checked(_FunctionCallOutputItem, item, where)
            if result.call_id not in calls:
                param = f"{where}.call_id"
                message = f"{param}: no function_call with call_id {result.call_id!r} comes before it"
                raise APIError(400, message, param=param)
            content = _text(result.output, where + ".output")
            turns.append({"role": "tool", "tool_call_id": result.call_id, "content": content})
        elif kind == "reasoning" or kind in HOSTED_ITEMS:
            if isinstance(item.get("call_id"), str):
                calls.add(item["call_id"])
            continue
        else:
            param = f"{where}.type"
            raise APIError(400, f"{param}: unknown input item type {kind!r}", param=param)
    return turns


def assemble(instructions: str | None, turns: list[dict]) -> list[dict]:
    """The chat messages: one leading system message (``instructions`` and the system turns before
    the first other turn), later system turns as user turns (module docstring)."""
    system = [instructions] if instructions else []
    at = 0
    while at < len(turns) and turns[at]["role"] == "system":
        system.append(turns[at]["content"])
        at += 1
    rest = [{**t, "role": "user"} if t["role"] == "system" else t for t in turns[at:]]
    head = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return head + rest


def _function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict], list[int]]:
    """(chat tools, the body's index of each): hosted tools are dropped, with one log line the first
    time a set of dropped types is seen (Codex sends the same tools with every request)."""
    chat_tools, index, dropped = [], [], []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise APIError(400, f"tools[{i}].type: required (a string)", param=f"tools[{i}].type")
        if kind != "function":
            dropped.append(kind)
            continue
        fn = _checked(_FunctionTool, tool, f"tools[{i}]")
        chat_tools.append(chat_tool(fn.name, fn.description, fn.parameters, fn.strict))
        index.append(i)
    unique_tool_names([(i, tool["function"]["name"]) for i, tool in zip(index, chat_tools)], "tools[{}].name")
    if dropped and frozenset(dropped) not in _logged_drops and len(_logged_drops) < 64:
        _logged_drops.add(frozenset(dropped))
        log.info("responses: dropped hosted tools (only function tools are served): %s", ", ".join(dropped))
    return chat_tools, index


def _tool_choice(body: ResponsesRequest, has_tools: bool) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        if choice == "required" and not has_tools:
            raise APIError(400, "tool_choice: 'required' needs function tools", param="tool_choice")
        return choice if has_tools else None  # "auto" / "none" over hosted tools only: no tools
    if choice.type != "function" or not choice.name:
        raise APIError(
            400,
            f"tool_choice: only 'none', 'auto', 'required' or a function by name are supported, got {choice.type!r}",
            param="tool_choice",
        )
    return function_choice(choice.name)


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else {"type": fmt.type}
    spec = {"name": fmt.name or "output", "schema": fmt.json_schema, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


_SAMPLER = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class ChatTurn:
    chat: dict  # the chat completion body
    turns: list[dict]  # the conversation (history + this input), without instructions: what is stored
    tool_index: list[int]  # the body's ``tools`` index of each chat tool (hosted ones are dropped)


def to_chat(body: ResponsesRequest, history: list[dict], max_tokens: int | None) -> ChatTurn:
    """The chat body asking for what ``body`` asks after ``history`` (a stored conversation)."""
    if body.input == "":
        raise APIError(400, "input: is empty", param="input")
    turns = history + conversation(body.input, history)
    messages = assemble(body.instructions, turns)
    if not messages:
        raise APIError(400, "input: is empty", param="input")
    tools, index = _function_tools(body.tools)
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "tools": tools or None,
        "tool_choice": _tool_choice(body, bool(tools)),
        "parallel_tool_calls": body.parallel_tool_calls if tools else None,
        "response_format": _response_format(body),
        "max_tokens": max_tokens,
        "repetition_penalty": body.repetition_penalty,
        "seed": body.seed,
        "logit_bias": body.logit_bias,
        "stream": body.stream,
    }
    chat.update({name: getattr(body, name) for name in _SAMPLER})
    chat.update(body.speculation())
    return ChatTurn({k: v for k, v in chat.items() if v is not None}, turns, index)


# Chat field names in the errors of the shared chat path -> the Responses body's names.
_RENAMES = (
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^(messages|prompt)\b"), "input"),
    (re.compile(r"\bmax_tokens\b"), "max_output_tokens"),
)
_TOOL_FIELD = re.compile(r"\btools\[(\d+)\]\.function\.")


def _rename(text: str, tool_index: list[int]) -> str:
    text = _TOOL_FIELD.sub(lambda m: f"tools[{tool_index[int(m.group(1))]}].", text)
    for pattern, name in _RENAMES:
        text = pattern.sub(name, text)
    return text


def responses_error(err: Exception, tool_index: list[int]) -> APIError:
    """An error of the chat path (`plan_chat`, encoding, the job's limits) in the Responses body's
    field names (``response_format`` -> ``text.format``, ``messages`` -> ``input``, a chat tool's
    index -> the body's, where hosted tools were dropped)."""
    if isinstance(err, ValidationError):
        first = err.errors()[0]
        err = APIError(400, f"input: {first.get('msg', 'invalid value').removeprefix('Value error, ')}")
    elif isinstance(err, MtplxError):
        err = APIError(400, str(err), param=str(err).split(":", 1)[0] if ": " in str(err) else None)
    assert isinstance(err, APIError)
    param = (
        _rename(err.param, tool_index)
        if err.param
        else ("input" if err.message.startswith("input") else None)
    )
    return APIError(
        err.status,
        _rename(err.message, tool_index),
        type=err.type,
        param=param,
        code=err.code,
        headers=err.headers,
    )
