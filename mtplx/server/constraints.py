"""The grammar a chat or text completion must match, from ``response_format`` and the tools.

Built before anything is queued, so a bad schema is a 400 naming its field (``response_format``
or ``tools``) with llguidance's message, and nothing decodes.

Glossary:
- call schema: the JSON schema of one call of one tool, ``{"name": <const>, "arguments":
  <the tool's parameters>}`` with both keys required and no others, in that order (llguidance
  writes properties in the schema's order, so a streamed call names its function before its
  arguments). vLLM builds the same object for ``required`` and named tool choices.
- call syntax: the markers around a call (`mtplx.server.tools.CallSyntax`); the grammar
  writes them as literals, so a call always starts and ends where the parser looks.

What each choice allows:
- ``response_format`` json_object / json_schema: one JSON value (compact separators: a small
  model cannot pad with whitespace until ``max_tokens``).
- tool_choice ``required``: one call, or several when ``parallel_tool_calls`` (the default).
- a named function: exactly one call of it.
- ``auto``: text that never writes the start marker, or text up to the first marker and then
  calls (the text part is the ``response_format`` JSON instead when one is given). A call, once
  started, always parses.
- ``none``: no tools in the grammar; ``response_format`` alone.

A thinking model's reasoning span goes first, unconstrained (`mtplx.server.reasoning.wrap_grammar`);
the rules above then start from ``answer`` rather than ``start``.

Leniency: a keyword llguidance does not implement is dropped, with one warning in the server log,
only where every JSON value already satisfies it, so dropping it cannot let an invalid reply
through: ``propertyNames`` of ``{}``, ``true`` or ``{"type": "string"}`` (every JSON key is a
string; Claude Code's tools send it). Any other unimplemented keyword is still refused, naming
the field, since ignoring it would change which replies are valid.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from mtplx.engine.grammar_spec import COMPACT_JSON, Grammar
from mtplx.errors import MtplxError
from mtplx.server.reasoning import Reasoning, lark_marker, regex_literal, wrap_grammar
from mtplx.server.schemas import NamedToolChoice, ResponseFormat, Tool
from mtplx.server.tools import CallSyntax

__all__ = ["call_schema", "drop_vacuous", "response_format_grammar", "response_format_schema", "tool_grammar"]

log = logging.getLogger("mtplx.server")

# Keywords whose value maps names to subschemas, hold a list of subschemas, or hold one subschema.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
# A ``propertyNames`` every key satisfies (JSON keys are strings).
_VACUOUS_NAMES = ({}, True, {"type": "string"})


def drop_vacuous(schema: Any, where: str = "") -> tuple[Any, list[str]]:
    """``schema`` without the keywords that hold for every value (module docstring), and where
    each was (JSON-pointer-like paths); the schema itself is not changed."""
    if not isinstance(schema, dict):
        return schema, []
    dropped: list[str] = []
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "propertyNames" and any(value == v and type(value) is type(v) for v in _VACUOUS_NAMES):
            dropped.append(f"{where}/propertyNames")
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _collect(sub, f"{where}/{key}/{name}", dropped) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_collect(sub, f"{where}/{key}/{i}", dropped) for i, sub in enumerate(value)]
        elif key in _SCHEMA_ONE:
            value = _collect(value, f"{where}/{key}", dropped)
        out[key] = value
    return out, dropped


def _collect(schema: Any, where: str, dropped: list[str]) -> Any:
    relaxed, found = drop_vacuous(schema, where)
    dropped += found
    return relaxed


def _lenient(schema: Any, field: str) -> Any:
    """``schema`` as llguidance compiles it: vacuous keywords dropped, each dropped one logged."""
    relaxed, dropped = drop_vacuous(schema)
    if dropped:
        log.warning(
            "%s: ignored keywords every value satisfies: %s", field, ", ".join(p or "/" for p in dropped)
        )
    return relaxed


# A tool declared without parameters takes an empty object.
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def response_format_schema(fmt: ResponseFormat | None) -> dict[str, Any] | None:
    """The JSON schema ``response_format`` asks for, or None for free text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.json_schema is None:
        return {"type": "object"}
    return _lenient(fmt.json_schema.json_schema, "response_format")


def response_format_grammar(fmt: ResponseFormat | None, reasoning: Reasoning | None = None) -> Grammar | None:
    """``response_format`` as a grammar (None for text), after the reasoning span of a thinking
    model; a bad schema raises ``response_format: <llguidance's message>``."""
    schema = response_format_schema(fmt)
    if schema is None:
        return None
    grammar = Grammar.json_schema(schema, field="response_format")  # checks the schema alone
    return (
        grammar
        if reasoning is None
        else _with_reasoning([f"answer: {_lark_json(schema)}"], reasoning, "response_format")
    )


def call_schema(tool: Tool) -> dict[str, Any]:
    """The JSON schema of one call of ``tool`` (see the glossary)."""
    parameters = _lenient(tool.function.parameters, f"tools: {tool.function.name}") or NO_ARGUMENTS
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _checked_call_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Each tool's call schema, once its parameters compile (a bad one is
    ``tools[i].function.parameters: <message>``)."""
    schemas = [call_schema(tool) for tool in tools]
    for i, schema in enumerate(schemas):
        Grammar.json_schema(schema, field=f"tools[{i}].function.parameters")
    return schemas


def _lark_json(schema: dict[str, Any]) -> str:
    """llguidance's ``%json{...}`` for ``schema`` with compact separators (its ``x-guidance`` options)."""
    return "%json" + json.dumps({**schema, "x-guidance": COMPACT_JSON})


def tool_grammar(
    tools: Sequence[Tool],
    choice: str | NamedToolChoice,
    parallel: bool,
    syntax: CallSyntax,
    text_schema: dict[str, Any] | None,
    reasoning: Reasoning | None = None,
) -> Grammar:
    """The grammar of a reply under ``tools`` and ``choice`` (not "none"), calls written in
    ``syntax`` (its markers as tokens where each is one token, else as text); ``text_schema`` (from ``response_format``) replaces free text; a
    thinking model's reasoning span comes first, unconstrained (`mtplx.server.reasoning`)."""
    checked, all_tools = _checked_call_schemas(tools), list(tools)
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            names = ", ".join(t.function.name for t in tools)
            raise MtplxError(f"tool_choice: no tool named {choice.function.name!r} (tools: {names})")
        tools, parallel = chosen, False
    schemas = [schema for tool, schema in zip(all_tools, checked) if tool in tools]
    call_json = _lark_json(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    more = "(SEP call)*" if parallel else ""
    start, end = lark_marker(syntax.start, syntax.start_ids), lark_marker(syntax.end, syntax.end_ids)
    rules = [f"call: {start} body", f"body: NL {call_json} NL {end}", r"NL: /\n?/", r"SEP: /\n{0,2}/"]
    if choice != "auto":
        rules.append(f"answer: call {more}")
    elif text_schema is not None:
        rules.append(f"answer: {_lark_json(text_schema)} | call {more}")
    else:
        # Text that never writes the start marker, or such text and then the calls. A one-token
        # marker is not text, so the text lexeme ends where the token comes; a marker spelled in
        # text needs a lazy lexeme, which ends at the first marker. Either way the text itself
        # makes the choice, and a call, once begun, always parses.
        marker = regex_literal(syntax.start)
        rules.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{marker}(.|\\n)*/")
        if len(syntax.start_ids) == 1:
            rules.append(f"answer: TEXT | TEXT call {more}")
        else:
            rules.append(f"answer: TEXT | lead body {more}")
            rules.append(f"lead[lazy]: /(.|\\n)*{marker}/")
    return _with_reasoning(rules, reasoning, "tools")


def _with_reasoning(answer_rules: list[str], reasoning: Reasoning | None, field: str) -> Grammar:
    rules = wrap_grammar(answer_rules, reasoning) if reasoning else ["start: answer", *answer_rules]
    return Grammar.lark("\n".join(rules), field=field)
