"""A chat completion body -> what to generate: the template's input, the grammar, how to read the reply.

`plan_chat` settles everything the agent fields ask before anything is queued (a bad schema,
an unknown named tool or a tool choice the model's syntax cannot constrain is a 400 here):

- ``response_format`` alone: its grammar (`mtplx.server.constraints`).
- ``tools`` with ``tool_choice`` auto (the default when tools are given), ``required`` or a named
  function: the tools are rendered into the prompt (`mtplx.server.tools`) and the reply is
  constrained by the tool grammar, so a call always parses and matches its tool's parameters.
  A native syntax other than JSON (mlx-lm's XML or Python-style families) is left unconstrained
  under ``auto`` and refused for ``required`` / named choices: the grammar writes JSON calls.
- ``tool_choice`` "none": the tools are not shown and no call is read (earlier calls and tool
  results in the messages are still rendered).
- a thinking model (`mtplx.server.reasoning`): the grammar starts with the free reasoning span,
  and the reply's reader splits the reasoning off before it reads content and calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtplx.engine.grammar_spec import Grammar
from mtplx.errors import MtplxError, first_line
from mtplx.server.constraints import response_format_grammar, response_format_schema, tool_grammar
from mtplx.server.reasoning import Reasoning, ReasoningSplitter, opened_in_prompt
from mtplx.server.schemas import ChatCompletionRequest
from mtplx.server.tools import CallDelta, CallExtractor, CallSyntax, render_chat, syntax_for
from mtplx.trunk.compat import thinking_markers

__all__ = ["ChatPlan", "ReplyReader", "plan_chat", "unique_tool_names"]


@dataclass
class ReplyReader:
    """A reply's text -> reasoning, content and tool-call fragments, fed in pieces of any size."""

    splitter: ReasoningSplitter | None
    extractor: CallExtractor | None

    @property
    def calls(self) -> int:
        return 0 if self.extractor is None else self.extractor.calls

    def feed(self, text: str, final: bool) -> tuple[str, str, list[CallDelta]]:
        """(reasoning, content, call fragments) that ``text`` adds; ``final``: the reply ends here."""
        reasoning, answer = ("", text) if self.splitter is None else self.splitter.feed(text)
        if final and self.splitter is not None:
            more_reasoning, more_answer = self.splitter.finish()
            reasoning, answer = reasoning + more_reasoning, answer + more_answer
        if self.extractor is None:
            return reasoning, answer, []
        content, deltas = self.extractor.feed(answer)
        if final:
            tail, more = self.extractor.finish()
            content, deltas = content + tail, deltas + more
        return reasoning, content, deltas


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict]  # what the chat template renders
    template_tools: list[dict] | None  # the template's ``tools=`` (native syntax only)
    grammar: Grammar | None
    syntax: CallSyntax | None  # None: no calls are read from the reply
    tools: list[dict]  # the tool definitions, for mlx-lm's parsers
    reasoning: Reasoning | None  # a thinking model's markers and whether the prompt opened the span

    def reader(self) -> ReplyReader:
        splitter = None if self.reasoning is None else ReasoningSplitter(*self.reasoning[:3])
        extractor = None if self.syntax is None else CallExtractor(self.syntax, self.tools)
        return ReplyReader(splitter, extractor)


def _reasoning(tokenizer: Any, messages: list[dict], template_tools: list[dict] | None) -> Reasoning | None:
    markers = thinking_markers(tokenizer)
    if markers is None:
        return None
    try:
        prompt = tokenizer.apply_chat_template(
            messages, tools=template_tools, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # the template's own error (jinja): the encoding step reports it
        raise MtplxError(f"messages: the chat template failed ({first_line(err)})") from None
    opened = opened_in_prompt(prompt[-200:], markers.start, markers.end)
    return (markers.start, markers.end, opened, markers.start_ids, markers.end_ids)


def unique_tool_names(named: list[tuple[int, str]], field: str) -> None:
    """A 400 naming the second of two tools with one name (a call names its tool: two are
    ambiguous); ``named``: (the body's index, name) of each tool, ``field``: the name's path with
    ``{}`` for the index (``tools[{}].function.name`` on chat)."""
    first: dict[str, int] = {}
    for i, name in named:
        if name in first:
            raise MtplxError(
                f"{field.format(i)}: {name!r} is also the name of tools[{first[name]}] (tool names must be unique)"
            )
        first[name] = i


def plan_chat(tokenizer: Any, body: ChatCompletionRequest, constrain: bool = True) -> ChatPlan:
    """What ``body`` asks the model to do (see the module docstring); ``constrain=False`` builds
    no grammar (counting the prompt's tokens needs none, and a schema cannot fail it)."""
    tools = list(body.tools or ())
    unique_tool_names([(i, t.function.name) for i, t in enumerate(tools)], "tools[{}].function.name")
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise MtplxError("tool_choice: needs tools")
    syntax = syntax_for(tokenizer)
    shown = tools if choice != "none" else []
    messages, template_tools = render_chat(tokenizer, body.messages, shown, syntax)
    reasoning = _reasoning(tokenizer, messages, template_tools)
    if not constrain:
        return ChatPlan(messages, template_tools, None, None, [], reasoning)
    text_grammar = response_format_grammar(body.response_format, reasoning)
    if choice == "none":
        return ChatPlan(messages, template_tools, text_grammar, None, [], reasoning)
    parallel = body.parallel_tool_calls is not False
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if not syntax.json:
        if choice != "auto":
            raise MtplxError(
                f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} needs JSON "
                f"tool calls; this model's template writes {syntax.family} calls (use 'auto')"
            )
        return ChatPlan(messages, template_tools, text_grammar, syntax, tool_dicts, reasoning)
    text_schema = response_format_schema(body.response_format)
    grammar = tool_grammar(tools, choice, parallel, syntax, text_schema, reasoning)
    return ChatPlan(messages, template_tools, grammar, syntax, tool_dicts, reasoning)
