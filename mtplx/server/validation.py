"""A pydantic validation error as the one-line 400 every route answers: the field in the API's own
path syntax (``messages[0].content[1].text``, ``tools[0].name``) and pydantic's reason.

Pydantic's error locations mix the body's keys and list indexes with its own names for union
members (``str``, ``literal['none','auto','required']``, ``list[tagged-union[...]]``, a model's
class name, a discriminated union's tag value). `field_path` walks the location along the body
that was sent and keeps only the steps that exist in it (plus a missing field's name at the end),
so the path names what the client wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["SURROGATE_ESCAPE", "field_path", "first_problem", "unpaired_surrogate"]

# Pydantic's names of union members and wrapped validators: never a field of ours.
_PYDANTIC_TAG = re.compile(r"^[a-z][a-z0-9-]*\[.*\]$|^(str|int|float|bool|none|list|dict|bytes|json)$")
_MISSING = object()
_PLAIN_KEY = re.compile(r"[A-Za-z_][\w-]*|\d+")  # whole keys only (fullmatch: "$" passes a final newline)


def _key(name: str) -> str:
    """``.name``, or ``["odd key"]`` (JSON-quoted: a client's key may hold anything, newlines included)."""
    return f".{name}" if _PLAIN_KEY.fullmatch(name) else f"[{json.dumps(name)}]"


def _step(value: Any, part: Any, last: bool) -> tuple[str | None, Any]:
    """(the path text for ``part``, the value under it); text None: pydantic's own step."""
    if isinstance(value, list) and isinstance(part, int) and not isinstance(part, bool):
        return f"[{part}]", value[part] if -len(value) <= part < len(value) else _MISSING
    if not isinstance(value, dict) or not isinstance(part, str):
        return None, value  # a union member's name under a scalar or a list
    if part in value:
        return _key(part), value[part]
    if last and not _PYDANTIC_TAG.match(part) and not part[:1].isupper():
        return _key(part), _MISSING  # a required field the body left out
    return None, value  # a union member's name


def field_path(loc: Sequence[Any], body: Any, prefix: str = "") -> str:
    """``loc`` (a pydantic error location inside ``body``) as the API's field path, after ``prefix``.
    A discriminated union's member is named by its tag (the object's ``type``) after the list
    index: ``list[tagged-union[A,B]]``, 0, ``"text"``, then the member's own fields."""
    path, value, tag_next = prefix, body, False
    for at, part in enumerate(loc):
        if isinstance(part, str) and "tagged-union[" in part:
            tag_next = True
            continue
        if tag_next and isinstance(part, str):
            tag_next = False
            continue
        text, value = _step(value, part, at == len(loc) - 1)
        if text is not None:
            path += text
        if value is _MISSING:
            break
    return path.removeprefix(".")


def first_problem(errors: Sequence[dict], body: Any, prefix: str = "") -> tuple[str | None, str]:
    """(field path or None for the whole body, the reason) of the most specific of ``errors``:
    the one whose path goes deepest (a union's members each report; the deepest is the member
    the body was meant to be), the first of equals."""
    best: tuple[int, str, str] | None = None
    for error in errors:
        path = field_path(error.get("loc", ()), body, prefix)
        depth = path.count(".") + path.count("[")
        if best is None or depth > best[0]:
            reason = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
            best = (depth, path, reason)
    if best is None:
        return None, "invalid value"
    return best[1] or None, best[2]


# A JSON escape of a UTF-16 surrogate (paired ones, an emoji escaped, are fine: `unpaired_surrogate`),
# or one encoded as UTF-8 bytes (not UTF-8, but Python's json decodes bytes with "surrogatepass").
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")
_UNPAIRED = re.compile("[\ud800-\udfff]")


def unpaired_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (or object key: its object's path) in ``value`` that holds an
    unpaired surrogate, or None. JSON decoding pairs escaped surrogates, so any left are unpaired."""
    if isinstance(value, str):
        return path if _UNPAIRED.search(value) else None
    if isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        if any(_UNPAIRED.search(k) for k in value):
            return path
        items = ((f"{path}{_key(k)}", v) for k, v in value.items())
    else:
        return None
    for where, item in items:
        found = unpaired_surrogate(item, where)
        if found is not None:
            return found.removeprefix(".")
    return None
