"""Hostile request bodies for the server fuzz (tests/server/test_server_fuzz.py), and the check of a
reply against the invariant: a 4xx in the route's API's own error shape whose one-line message
starts with the field it is about, or a valid reply (whole, or a stream that ends as its API
ends one), never a 5xx.

Bodies are built from each route's own schema (the pydantic model's JSON schema, as the server
validates it; hand-written for the Responses API's loose ``input`` items and ``tools``): mostly
values the schema allows, and at any node, now and then, a hostile one: a wrong type, a huge or
negative number, unicode with NUL and lone surrogates, an unknown or nested content part; objects
drop required fields and gain unknown ones.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
from hypothesis import strategies as st

# ------------------------------------------------------------------ hostile values

HUGE_NUMBERS = [
    0,
    -1,
    -(2**31),
    2**31,
    2**53 + 1,
    2**63,
    -(2**63) - 1,
    10**30,
    1e308,
    -1e308,
    1e-320,
    -0.0,
    0.5,
]
ODD_TEXT = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",  # a lone surrogate: valid in JSON text (escaped), not encodable as UTF-8
    "\n\r\u2028",
    "😀" * 3,
    "\u202e\u0645\u0631\u062d\u0628\u0627",
    "<|im_end|>",
    "{{ raise('x') }}",
    "%00../../etc/passwd",
    "x" * 3000,
]
PART_TYPES = [
    "text", "image_url", "image", "input_text", "output_text", "input_image", "input_audio", "audio",
    "video", "video_url", "file", "input_file", "tool_use", "tool_result", "thinking", "refusal",
    "mystery", "", "TEXT",
]  # fmt: skip
IMAGE_URLS = [
    "data:image/png;base64,AAAA",
    "data:image/png;base64,###",
    "https://example.com/a.png",
    "file:///etc/passwd",
    "cat\x00.png",
    "file:///tmp/%00x.png",
    "ftp://x",
    "",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE_NUMBERS),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(ODD_TEXT),
)
any_json = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def content_parts(draw) -> dict:
    """A content part of any type, known or not, its fields right, wrong or nested."""
    kind = draw(st.sampled_from(PART_TYPES))
    part: dict[str, Any] = {"type": kind}
    for name in draw(
        st.lists(st.sampled_from(["text", "image_url", "source", "data", "content"]), max_size=2)
    ):
        if name == "image_url":
            part[name] = draw(st.sampled_from(IMAGE_URLS).map(lambda u: {"url": u}) | any_json)
        elif name == "source":
            media = st.sampled_from(["image/png", "text/plain", "\x00"])
            source = st.fixed_dictionaries(
                {"type": st.sampled_from(["base64", "url", "file", 5]), "media_type": media, "data": scalars}
            )
            part[name] = draw(source | any_json)
        elif name == "content":
            part[name] = draw(st.lists(st.deferred(lambda: content_parts()), max_size=2) | any_json)
        else:
            part[name] = draw(scalars | st.deferred(lambda: content_parts()))
    return part


hostile = st.one_of(any_json, st.sampled_from(HUGE_NUMBERS), st.sampled_from(ODD_TEXT), content_parts())

# ------------------------------------------------------------------ values from a JSON schema


class SchemaBodies:
    """Strategies for values of a JSON schema (pydantic's ``model_json_schema()``, ``$defs`` and
    all), each node hostile with probability 1 / ``hostility``."""

    def __init__(self, schema: dict, hostility: int = 10):
        self.defs = schema.get("$defs", {})
        self.hostility = hostility

    def _resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.defs[schema["$ref"].rsplit("/", 1)[-1]]
        return schema

    def value(self, schema: dict, overrides: dict | None = None) -> st.SearchStrategy:
        return self.or_hostile(st.deferred(lambda: self._valid(self._resolve(schema), overrides or {})))

    def or_hostile(self, valid: st.SearchStrategy) -> st.SearchStrategy:
        """``valid``, or (one time in ``hostility``) a hostile value."""
        return st.integers(0, self.hostility - 1).flatmap(lambda k: hostile if k == 0 else valid)

    def _valid(self, schema: dict, overrides: dict) -> st.SearchStrategy:
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        choices = schema.get("anyOf") or schema.get("oneOf")
        if choices:  # null only as a hostile value (a field left out says the same, more often)
            choices = [c for c in choices if c.get("type") != "null"] or choices
            return st.one_of([self.value(c) for c in choices])
        kind = schema.get("type")
        if "properties" not in schema and isinstance(schema.get("additionalProperties"), dict):
            keys = st.from_regex(r"\A[0-9]{1,5}\Z") | st.text(max_size=4)  # logit_bias: token ids
            return st.dictionaries(keys, self.value(schema["additionalProperties"]), max_size=3)
        if kind == "object" or "properties" in schema:
            return _object(self, schema, overrides)
        if kind == "array":
            size = st.integers(schema.get("minItems", 0), min(schema.get("maxItems", 3), 3))
            return size.flatmap(
                lambda n: st.lists(self.value(schema.get("items", {})), min_size=n, max_size=n)
            )
        if kind == "string":
            if "pattern" in schema:
                return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) <= 64)
            return st.text(min_size=schema.get("minLength", 0), max_size=16)
        if kind == "integer":
            low = schema.get("minimum", schema.get("exclusiveMinimum", -4) + 1)
            return st.integers(low, min(schema.get("maximum", low + 8), low + 8))
        if kind == "number":
            low = schema.get("minimum", schema.get("exclusiveMinimum", 0.0))
            high = schema.get("maximum", schema.get("exclusiveMaximum", low + 2.0))
            return st.floats(
                low, high, exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema
            )
        if kind == "boolean":
            return st.booleans()
        if kind == "null":
            return st.none()
        return any_json  # {} or additionalProperties: anything


# Optional in the schema but what a body is for: present as often as a required field.
USUAL = frozenset({"content", "text", "input", "max_tokens", "max_output_tokens"})


@st.composite
def _object(draw, bodies: SchemaBodies, schema: dict, overrides: dict) -> dict:
    """An object of ``schema``: a required field missing as often as a value is hostile, optional
    ones now and then present, now and then an unknown one."""
    required = set(schema.get("required", ())) | USUAL
    out: dict[str, Any] = {}
    for name, sub in schema.get("properties", {}).items():
        keep = (
            draw(st.integers(0, bodies.hostility)) > 0 if name in required else draw(st.integers(0, 3)) == 0
        )
        if keep:
            out[name] = draw(bodies.or_hostile(overrides[name]) if name in overrides else bodies.value(sub))
    if not schema.get("properties") and schema.get("additionalProperties", True):
        out.update(draw(st.dictionaries(st.text(max_size=8), any_json, max_size=3)))
    if draw(st.integers(0, 7)) == 0:
        out[draw(st.sampled_from(["extra", "unknown_field", "\x00", "type", "index"]))] = draw(any_json)
    return out


# ------------------------------------------------------------------ the Responses API's loose parts

_TEXT = {"type": "string"}
_RESPONSES_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["input_text", "output_text", "refusal", "input_image"]}, "text": _TEXT},
    "required": ["type", "text"],
}
RESPONSES_ITEM = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {"anyOf": [_TEXT, {"type": "array", "items": _RESPONSES_PART}]},
            },
            "required": ["role", "content"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "function_call"},
                "call_id": {"enum": ["call_1", "call_2"]},
                "name": {"enum": ["f", "g"]},
                "arguments": {"enum": ["{}", '{"a": 1}', "not json"]},
            },
            "required": ["type", "call_id", "name", "arguments"],
        },
        {
            "type": "object",
            "properties": {
                "type": {"const": "function_call_output"},
                "call_id": {"enum": ["call_1", "call_2", "nobody"]},
                "output": {"anyOf": [_TEXT, {"type": "array", "items": _RESPONSES_PART}]},
            },
            "required": ["type", "call_id", "output"],
        },
        {"type": "object", "properties": {"type": {"enum": ["reasoning", "local_shell_call", "compaction"]}}},
    ]
}
RESPONSES_TOOL = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "name": {"enum": ["f", "g", "bad name"]},
                "parameters": {
                    "anyOf": [{"type": "object"}, {"const": {"type": "object", "properties": {}}}]
                },
            },
            "required": ["type", "name"],
        },
        {
            "type": "object",
            "properties": {"type": {"enum": ["web_search", "local_shell", "custom"]}},
            "required": ["type"],
        },
    ]
}


def responses_overrides(bodies: SchemaBodies) -> dict:
    return {
        "input": bodies.value({"anyOf": [_TEXT, {"type": "array", "items": RESPONSES_ITEM, "maxItems": 4}]}),
        "tools": bodies.value({"type": "array", "items": RESPONSES_TOOL}),
        "n": st.sampled_from([None, 1, 2]),
    }


# ------------------------------------------------------------------ the invariant

_FIELD = re.compile(
    r'^(request body|[A-Za-z_][\w-]*)((\.[A-Za-z_][\w-]*|\.\d+|\[\d+\]|\["(?:[^"\\]|\\.)*"\])*): '
)
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
ANTHROPIC_CONTEXT_WORDING = re.compile(
    r"^(input length and `?max_tokens`? exceed context limit|prompt is too long): "
)


def _check_error(route: str, status: int, payload: Any, fields: set[str]) -> str:
    """The error's message, after checking the route's error shape and that it names a field."""
    if route in ANTHROPIC:
        assert set(payload) == {"type", "error"} and payload["type"] == "error", payload
        assert set(payload["error"]) == {"type", "message"}, payload
        message = payload["error"]["message"]
    else:
        assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, (
            payload
        )
        message, param = payload["error"]["message"], payload["error"]["param"]
        assert param is None or message.startswith(param + ":"), payload
    assert isinstance(message, str) and "\n" not in message and "Traceback" not in message, payload
    if route in ANTHROPIC and ANTHROPIC_CONTEXT_WORDING.match(message):
        return message  # Anthropic's own context errors, which clients such as Claude Code read
    named = _FIELD.match(message)
    assert named is not None, f"the message names no field: {message!r}"
    assert named.group(1) in fields | {"request body"}, (
        f"{named.group(1)!r} is no field of {route}: {message!r}"
    )
    return message


def _sse_events(text: str) -> list[tuple[str | None, Any]]:
    events, name = [], None
    for line in text.splitlines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


STREAM_ENDS = {
    "/v1/chat/completions": lambda events: events[-1][1] == "[DONE]",
    "/v1/completions": lambda events: events[-1][1] == "[DONE]",
    "/v1/messages": lambda events: events[-1][0] in ("message_stop", "error"),
    "/v1/responses": lambda events: (
        events[-1][0] in ("response.completed", "response.incomplete", "response.failed")
    ),
}


def _check_stream(route: str, text: str) -> None:
    events = _sse_events(text)
    assert events and STREAM_ENDS[route](events), (
        f"a stream that does not end as {route}'s do: {text[-500:]!r}"
    )
    for name, data in events:
        error = data.get("error") if isinstance(data, dict) else None
        if name == "response.failed":
            error = data["response"]["error"]
            assert error["code"] in ("context_length_exceeded", "invalid_request_error", "timeout"), data
        elif isinstance(error, dict):
            assert error.get("type") not in ("server_error", "api_error"), data


def _check_reply(route: str, payload: Any) -> None:
    if route == "/v1/messages/count_tokens":
        assert isinstance(payload["input_tokens"], int) and payload["input_tokens"] > 0, payload
    elif route == "/v1/messages":
        assert payload["type"] == "message" and isinstance(payload["content"], list), payload
    elif route == "/v1/responses":
        assert payload["object"] == "response" and payload["status"] in ("completed", "incomplete"), payload
    else:
        assert payload["choices"] and all(
            c["finish_reason"] in ("stop", "length", "tool_calls") for c in payload["choices"]
        )


# Bytes put into a body's JSON text (in a string, or anywhere): not UTF-8, a surrogate encoded as
# UTF-8 (Python's json decodes it), NUL, escapes, nesting past the parser's depth; b"": cut there.
BYTE_MUTATIONS = [b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\x00", b"\\u0000", b"\\udc00", b"[" * 3000, b""]


@st.composite
def raw_bodies(draw, bodies: st.SearchStrategy) -> bytes:
    """A body's JSON text; one in five with bytes put in (after a quote: inside a string, mostly)."""
    raw = json.dumps(draw(bodies)).encode()
    if draw(st.integers(0, 4)) > 0:
        return raw
    quotes = [i + 1 for i, byte in enumerate(raw) if byte == ord('"')] or [0]
    at = draw(st.sampled_from(quotes) | st.integers(0, len(raw)))
    mutation = draw(st.sampled_from(BYTE_MUTATIONS))
    return raw[:at] + mutation + raw[at:] if mutation else raw[:at]


def check(client: httpx.Client, route: str, content: bytes, fields: set[str]) -> None:
    """Send the body ``content`` to ``route``; assert the invariant (module docstring)."""
    reply = client.post(route, content=content, headers={"Content-Type": "application/json"})
    assert reply.status_code < 500, f"{reply.status_code} for {content[:2000]!r}: {reply.text[:500]}"
    if reply.status_code >= 400:
        _check_error(route, reply.status_code, reply.json(), fields)
    elif reply.headers["content-type"].startswith("text/event-stream"):
        _check_stream(route, reply.text)
    else:
        assert reply.status_code == 200, reply.text
        _check_reply(route, reply.json())
