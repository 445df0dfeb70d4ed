"""`Grammar`: the constraint a request's output must match, built once at the edge.

The edges build it (the server from ``response_format`` and ``tools``/``tool_choice``, the
Python API from a JSON schema or a Lark grammar) and put it on `GenerationRequest.grammar`;
the engine compiles it against the model's tokenizer into a per-row matcher
(`mtplx.engine.grammar`). This module holds only the specification: no MLX and no tokenizer,
so the CLI and the server check a grammar before anything loads.

Glossary:
- source: an llguidance grammar (the JSON text `llguidance.LLMatcher.grammar_from_*` returns,
  or Lark text with llguidance's extensions such as ``%json{...}``), the one form the matcher
  takes, whatever the edge started from.
- field: the API name the user typed (``response_format``, ``tools``), which every error names.

Invariants: a `Grammar` is immutable, hashable and valid as a grammar (construction compiles it
without a tokenizer and raises `MtplxError` ``<field>: <llguidance's message>``); whether every
token of a particular vocabulary can express it is checked when the engine compiles it.
llguidance is an optional dependency (the ``grammar`` and ``serve`` extras): without it, building
a grammar raises one line saying what to install.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtplx.errors import MtplxError

__all__ = ["COMPACT_JSON", "Grammar", "llguidance_module"]

# JSON without free whitespace: a small model cannot pad a reply with spaces or newlines until
# max_tokens (what vLLM's and llguidance's flexible default allows); one space after ':' and ','
# is not allowed either, so a constrained reply has exactly one spelling of its structure.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def llguidance_module() -> Any:
    """The llguidance package, or a one-line error saying how to install it."""
    try:
        import llguidance
    except ImportError:
        raise MtplxError(
            "grammar-constrained output needs llguidance: pip install 'mtplx[grammar]'"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar the output must match, and the API field it came from."""

    source: str  # llguidance grammar: JSON text from LLMatcher.grammar_from_*, or Lark text
    field: str = "grammar"  # the API name errors are reported under

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise MtplxError(f"{self.field} must be a non-empty grammar")
        llguidance = llguidance_module()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.source)
        if is_error:
            raise MtplxError(f"{self.field}: {_one_line(messages[0])}")

    @classmethod
    def json_schema(
        cls, schema: Mapping[str, Any] | bool, *, field: str = "response_format", compact: bool = True
    ) -> Grammar:
        """Output that is one JSON value valid under ``schema`` (compact separators by default)."""
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, Mapping):
            raise MtplxError(f"{field}: the schema must be a JSON object (got {type(schema).__name__})")
        llguidance = llguidance_module()
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=COMPACT_JSON if compact else None
            )
        except (TypeError, ValueError) as error:
            raise MtplxError(f"{field}: {_one_line(str(error))}") from None
        return cls(source=source, field=field)

    @classmethod
    def json_object(cls, *, field: str = "response_format", compact: bool = True) -> Grammar:
        """Output that is one JSON object, any keys (OpenAI's ``{"type": "json_object"}``)."""
        return cls.json_schema({"type": "object"}, field=field, compact=compact)

    @classmethod
    def lark(cls, text: str, *, field: str = "grammar") -> Grammar:
        """Output matching a Lark grammar (llguidance's dialect: ``%json{...}``, ``%regex``, lazy stops)."""
        if not isinstance(text, str) or not text.strip():
            raise MtplxError(f"{field} must be a non-empty Lark grammar")
        return cls(source=llguidance_module().LLMatcher.grammar_from_lark(text), field=field)


def _one_line(message: str) -> str:
    return " ".join(message.split())
