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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtplx.engine.grammar_spec import Grammar
from mtplx.errors import MtplxError
from mtplx.server.constraints import response_format_grammar, response_format_schema, tool_grammar
from mtplx.server.schemas import ChatCompletionRequest
from mtplx.server.tools import CallExtractor, CallSyntax, render_chat, syntax_for

__all__ = ["ChatPlan", "plan_chat"]


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict]  # what the chat template renders
    template_tools: list[dict] | None  # the template's ``tools=`` (native syntax only)
    grammar: Grammar | None
    syntax: CallSyntax | None  # None: no calls are read from the reply
    tools: list[dict]  # the tool definitions, for mlx-lm's parsers

    def extractor(self) -> CallExtractor | None:
        return None if self.syntax is None else CallExtractor(self.syntax, self.tools)


def plan_chat(tokenizer: Any, body: ChatCompletionRequest) -> ChatPlan:
    """What ``body`` asks the model to do (see the module docstring)."""
    tools = list(body.tools or ())
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise MtplxError("tool_choice: needs tools")
    syntax = syntax_for(tokenizer)
    shown = tools if choice != "none" else []
    messages, template_tools = render_chat(tokenizer, body.messages, shown, syntax)
    if choice == "none":
        return ChatPlan(messages, template_tools, response_format_grammar(body.response_format), None, [])
    parallel = body.parallel_tool_calls is not False
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools]
    if not syntax.json:
        if choice != "auto":
            raise MtplxError(
                f"tool_choice: {choice if isinstance(choice, str) else 'a named function'} needs JSON "
                f"tool calls; this model's template writes {syntax.family} calls (use 'auto')"
            )
        return ChatPlan(
            messages, template_tools, response_format_grammar(body.response_format), syntax, tool_dicts
        )
    response_format_grammar(body.response_format)  # a bad schema is named response_format, not tools
    text_schema = response_format_schema(body.response_format)
    grammar = tool_grammar(tools, choice, parallel, syntax.start, syntax.end, text_schema)
    return ChatPlan(messages, template_tools, grammar, syntax, tool_dicts)
