"""Tool calling on the chat endpoint: the prompt that declares the tools, and the calls read back.

Two ways to show a model its tools:
- native: the model's own chat template renders ``tools`` and the calls of earlier turns
  (``tokenizer.apply_chat_template(messages, tools=...)``), where mlx-lm found a tool-call syntax
  in the template (`mtplx.trunk.compat.tool_call_syntax`); replies are read with mlx-lm's parser
  for that family (``mlx_lm.tool_parsers``).
- generic (a template without tools, such as the default model's): a block appended to the system
  prompt lists the tools as JSON and asks for ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`` (the Hermes / Qwen format, read by mlx-lm's ``json_tools`` parser); earlier calls
  are written into the assistant turn in that syntax, tool results become a user turn of
  ``<tool_response>...</tool_response>`` blocks (consecutive results share one turn), and a null
  ``content`` is the empty string.

Glossary:
- syntax: `CallSyntax`, the markers around a call and how its text is parsed.
- JSON syntax: a call's text is ``{"name": ..., "arguments": {...}}`` (generic and ``json_tools``);
  its arguments stream while they are written. Other families' calls are parsed whole at their
  end marker (their text is not JSON) and sent as one fragment.

Reading replies: `CallExtractor` takes the reply's text in pieces of any size (a verify cycle
may accept several tokens, or a marker may be cut between two pieces) and returns content and
tool-call fragments; the non-streamed reply is the same extraction over the whole text, so both
forms of a reply always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mtplx.server.schemas import Message, Tool
from mtplx.trunk.compat import tool_call_syntax

__all__ = [
    "GENERIC_SYNTAX",
    "CallDelta",
    "CallExtractor",
    "CallSyntax",
    "assistant_turn",
    "chat_call",
    "chat_tool",
    "function_choice",
    "merge_calls",
    "render_chat",
    "syntax_for",
]


@dataclass(frozen=True)
class CallSyntax:
    start: str
    end: str
    json: bool  # the call's text is {"name", "arguments"}: its arguments can stream
    parse: Callable[[str, Any], Any]  # text between the markers -> {"name", "arguments"} (or a list)
    native: bool  # the model's template renders tools and calls itself
    family: str
    start_ids: tuple[int, ...] = ()  # the markers' token ids (one id: the grammar names the token)
    end_ids: tuple[int, ...] = ()


def _parse_json_call(text: str, tools: Any = None) -> Any:
    return json.loads(text.strip())


GENERIC_SYNTAX = CallSyntax("<tool_call>", "</tool_call>", True, _parse_json_call, False, "generic")


def syntax_for(tokenizer: Any) -> CallSyntax:
    """The model's own tool-call syntax where its template has one, else the generic one."""
    found = tool_call_syntax(tokenizer)
    syntax = GENERIC_SYNTAX
    if found is not None:
        syntax = CallSyntax(
            found.start, found.end, found.family == "json_tools", found.parse, True, found.family
        )

    def ids(marker: str) -> tuple[int, ...]:
        return tuple(tokenizer.encode(marker, add_special_tokens=False))

    return replace(syntax, start_ids=ids(syntax.start), end_ids=ids(syntax.end))


# ------------------------------------------------------------------ the prompt

GENERIC_TOOLS_PROMPT = (
    "# Tools\n\n"
    "You may call one or more functions to help with the user's request. "
    "The functions, as JSON, one per line:\n{tools}\n\n"
    'To call a function, write <tool_call>{{"name": <function name>, "arguments": <arguments '
    "as a JSON object>}}</tool_call>, one block per call. Each result comes back in "
    "<tool_response></tool_response>."
)


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # kept as written: the prompt shows what the client sent


def _native_messages(messages: Sequence[Message]) -> list[dict]:
    out = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.template_content()}
        if m.tool_calls:
            # HF templates read arguments as a mapping (mlx-lm's server converts them the same way).
            turn["tool_calls"] = [
                chat_call(c.id, c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            turn["tool_call_id"] = m.tool_call_id
        out.append(turn)
    return out


def _generic_messages(messages: Sequence[Message], tools: Sequence[Tool]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>{m.text()}</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = ""
        for c in m.tool_calls or ():
            call = {"name": c.function.name, "arguments": _arguments(c.function.arguments)}
            calls += f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"
        out.append({"role": m.role, "content": m.template_content(calls)})
    if tools:
        lines = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
        block = GENERIC_TOOLS_PROMPT.format(tools=lines)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return [{k: v for k, v in turn.items() if not k.startswith("_")} for turn in out]


def render_chat(
    tokenizer: Any, messages: Sequence[Message], tools: Sequence[Tool], syntax: CallSyntax
) -> Any:
    """What the chat template gets: (messages, tools for the template's ``tools=`` or None)."""
    if syntax.native:
        return _native_messages(messages), [t.model_dump(exclude_none=True) for t in tools] or None
    return _generic_messages(messages, tools), None


# ------------------------------------------------------------------ reading the reply


@dataclass
class CallDelta:
    """One fragment of one call: the first carries id and name, the rest add to the arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def wire(self) -> dict:
        fn: dict[str, str] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            fn = {"name": self.name or "", **fn}
        out["function"] = fn
        return out


# The head of a JSON call (any whitespace), up to where the arguments begin.
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def held_suffix(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _OpenCall:
    index: int
    body: str = ""
    head_end: int | None = None  # where the arguments start in body, once the head is sent
    sent: int = 0  # characters of body sent as arguments


@dataclass
class CallExtractor:
    """Content and call fragments from a reply's text fed in pieces (see the module docstring).

    Invariants: text is never lost: it is content, or inside a call; a fragment sent is never
    taken back, so the arguments a client concatenates are the call's arguments.
    """

    syntax: CallSyntax
    tools: list[dict] = field(default_factory=list)
    calls: int = 0  # calls opened so far
    _pending: str = ""  # content held back: it may be the start of the start marker
    _open: _OpenCall | None = None
    _after_call: bool = False  # newlines right after a call separate calls: not content

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """(content, call fragments) that ``text`` adds to the reply."""
        content, deltas = "", []
        self._pending += text
        while self._pending:
            if self._open is None:
                if self._after_call:
                    self._pending = self._pending.lstrip("\n")
                    self._after_call = not self._pending
                    if not self._pending:
                        break
                at = self._pending.find(self.syntax.start)
                if at < 0:
                    keep = held_suffix(self._pending, self.syntax.start)
                    content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                content += self._pending[:at]
                self._pending = self._pending[at + len(self.syntax.start) :]
                self._open = _OpenCall(self.calls)
                self.calls += 1
            else:
                at = self._pending.find(self.syntax.end)
                if at < 0:
                    keep = held_suffix(self._pending, self.syntax.end)
                    self._open.body += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    deltas += self._stream(final=False)
                    break
                self._open.body += self._pending[:at]
                self._pending = self._pending[at + len(self.syntax.end) :]
                self._after_call = True
                text, closed = self._close()
                content, deltas = content + text, deltas + closed
        return content, deltas

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is still held back when the reply ends (a call cut by max_tokens stays as written)."""
        if self._open is not None:
            self._open.body += self._pending
            self._pending = ""
            deltas = self._stream(final=False)
            if self._open.head_end is None:  # nothing sent: the cut call is content
                text = self.syntax.start + self._open.body
                self._open = None
                return text, deltas
            self._open = None
            return "", deltas
        content, self._pending = self._pending, ""
        return content, []

    def _stream(self, final: bool) -> list[CallDelta]:
        """The open call's new fragments (JSON syntax only): the head once, then the arguments,
        holding back the closing brace of the call object and whitespace until the call ends."""
        call = self._open
        if call is None or not self.syntax.json:
            return []
        out = []
        if call.head_end is None:
            head = _JSON_HEAD.match(call.body)
            if head is None:
                return []
            call.head_end = call.sent = head.end()
            out.append(CallDelta(call.index, "", _call_id(), json.loads(f'"{head.group(1)}"')))
        body = call.body if final else call.body.rstrip()
        if not final and body.endswith("}"):
            body = body[:-1]
        if len(body) > call.sent:
            out.append(CallDelta(call.index, body[call.sent :]))
            call.sent = len(body)
        return out

    def _close(self) -> tuple[str, list[CallDelta]]:
        """The open call ended at its end marker: (content, what is left of it). A call that does
        not parse (possible only without a grammar) stays in the content as written."""
        call, self._open = self._open, None
        assert call is not None
        if self.syntax.json and call.head_end is not None:
            body = call.body.rstrip()
            body = body[:-1] if body.endswith("}") else body  # the call object's closing brace
            rest = body[call.sent :].rstrip()
            return "", [CallDelta(call.index, rest)] if rest else []
        try:
            parsed = self.syntax.parse(call.body, self.tools or None)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            named = all(isinstance(one, dict) and one.get("name") for one in parsed)
        except (ValueError, json.JSONDecodeError):
            named = False
        if not named:
            self.calls -= 1  # its index is free again
            return self.syntax.start + call.body + self.syntax.end, []
        out = []
        for i, one in enumerate(parsed):
            arguments = one.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            index = call.index if i == 0 else self._next_index()
            out.append(CallDelta(index, text, _call_id(), one["name"]))
        return "", out

    def _next_index(self) -> int:
        self.calls += 1
        return self.calls - 1


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def chat_tool(
    name: str, description: str | None = None, parameters: dict | None = None, strict: bool | None = None
) -> dict:
    """A function tool as chat's ``tools`` hold it (a field left out where None)."""
    spec = {"name": name, "description": description, "parameters": parameters, "strict": strict}
    return {"type": "function", "function": {k: v for k, v in spec.items() if v is not None}}


def function_choice(name: str) -> dict:
    """Chat's ``tool_choice`` naming one function."""
    return {"type": "function", "function": {"name": name}}


def chat_call(call_id: str, name: str, arguments: Any) -> dict:
    """A tool call as chat's ``message.tool_calls`` hold it (``arguments``: the JSON text; a
    mapping for a chat template that reads them so)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def assistant_turn(content: str, calls: list[dict]) -> dict:
    """A reply as the assistant turn a chat history holds: its text (None when it only called
    tools) and its calls (`chat_call`; None for none)."""
    return {"role": "assistant", "content": content or (None if calls else ""), "tool_calls": calls or None}


def merge_calls(deltas: Sequence[CallDelta]) -> list[dict]:
    """Fragments -> the ``message.tool_calls`` of a whole reply (index order)."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = chat_call(d.id, d.name, "")
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]
