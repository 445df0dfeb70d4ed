"""`POST /v1/responses` (the OpenAI Responses API that Codex speaks) through the real server process
and the real `openai` client: whole and streamed replies, a tool-call round trip, ``text.format``,
``previous_response_id``, recorded Codex-shaped bodies replayed raw, and the 400s.

The served model is the tiny random MiMo of test_agent.py (its own MTP head, depth 2: speculation
is on) with the default model's tokenizer; its context is 1024 tokens, and --max-tokens-cap 600. The route runs on the chat
path, so greedy replies equal /v1/chat/completions' for the same conversation.
"""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.server.responses import ResponseStore

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from support import checkpoints
from support.server import KEY, running_server

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather",
    "parameters": WEATHER_PARAMETERS,
}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 0, "maximum": 14},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "ok"],
    "additionalProperties": False,
}


# The `openai` client's type of each stream event, by its ``type``.
EVENT_TYPES = {
    kind: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
    for kind in typing.get_args(cls.model_fields["type"].annotation)
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    path = tmp_path_factory.mktemp("served") / "tiny-mimo"
    checkpoints.mimo(path, vocab_size=49152, seed=0)  # the default tokenizer's vocabulary
    checkpoints.copy_tokenizer(default_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    with running_server(model_dir, log_path, "--depth", "2", "--max-tokens-cap", "600") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(
        server[0] + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120
    )


def _sse(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a raw streamed request."""
    events, name = [], None
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server[0] + "/v1/responses", json=body, headers=headers, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


# ------------------------------------------------------------------ the same path as chat


def test_greedy_reply_equals_chat_completions_and_developer_is_a_system_turn(client, model_id):
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
        max_tokens=12,
        temperature=0,
    )
    kwargs = dict(model=model_id, max_output_tokens=12, temperature=0)
    reply = client.responses.create(instructions="You are terse.", input="Say hello.", **kwargs)
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == chat.usage.total_tokens
    assert reply.usage.output_tokens_details.reasoning_tokens == 0  # not a thinking model
    assert reply.id.startswith("resp_") and reply.object == "response"
    if chat.choices[0].finish_reason == "length":
        assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed" and reply.incomplete_details is None
    assert reply.model_extra["mtplx"]["depth"] == 2  # the decode stats, as on chat
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"

    developer = client.responses.create(
        input=[
            {"role": "developer", "content": "You are terse."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
        ],
        **kwargs,
    )
    assert developer.usage.input_tokens == reply.usage.input_tokens
    assert developer.output_text == reply.output_text
    # Negative control: the same developer text after the user's turn is a user turn, not the system
    # prompt (the template writes its default system prompt then): another prompt.
    later = client.responses.create(
        input=[{"role": "user", "content": "Say hello."}, {"role": "developer", "content": "You are terse."}],
        **kwargs,
    )
    assert later.usage.input_tokens != reply.usage.input_tokens
    # ... it is read as that: the same reply as a user turn of that text.
    as_user = client.responses.create(
        input=[{"role": "user", "content": "Say hello."}, {"role": "user", "content": "You are terse."}],
        **kwargs,
    )
    assert (later.usage.input_tokens, later.output_text) == (as_user.usage.input_tokens, as_user.output_text)


@pytest.fixture(scope="module")
def model_id(model_dir) -> str:
    return str(model_dir)


def _check_stream_order(events) -> None:
    """Each item's events in order: added, (part added), deltas, (text done, part done), done."""
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    open_item = None
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None
            open_item = e.item.id
        elif e.type == "response.output_item.done":
            assert open_item == e.item.id
            open_item = None
        else:
            assert open_item is not None and e.item_id == open_item, e
    assert open_item is None


def test_streamed_events_are_ordered_and_agree_with_the_whole_reply(client, model_id):
    kwargs = dict(model=model_id, input="Tell me a story.", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    _check_stream_order(events)
    kinds = [e.type for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text and text
    assert next(e.text for e in events if e.type == "response.output_text.done") == text
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens


# ------------------------------------------------------------------ tools, text.format, store


def _one_call(output) -> object:
    calls = [item for item in output if item.type == "function_call"]
    assert len(calls) == 1, output
    call = calls[0]
    assert call.call_id.startswith("call_") and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    return call


def test_a_tool_call_round_trip_with_function_call_output(client, model_id):
    kwargs = dict(
        model=model_id,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=150,
        temperature=0,
    )
    question = {"role": "user", "content": "Weather in Lima?"}
    first = client.responses.create(input=[question], **kwargs)
    assert first.status == "completed"
    call = _one_call(first.output)

    events = list(client.responses.create(input=[question], stream=True, **kwargs))
    _check_stream_order(events)
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert streamed == done == _one_call(events[-1].response.output).arguments
    # Greedy: the same call (a whole reply's arguments are re-serialized, a stream's are as written).
    assert json.loads(streamed) == json.loads(call.arguments)
    assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 1

    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky":"clear","c":21}'}
    history = [question, *[item.model_dump(exclude_none=True) for item in first.output], result]
    second = client.responses.create(
        input=history, **{**kwargs, "tool_choice": "auto", "max_output_tokens": 20}
    )
    assert second.status in ("completed", "incomplete")
    # The second prompt holds the first, the call and the tool's result: the prompt chat renders
    # for the same conversation.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    chat = client.chat.completions.create(
        model=model_id,
        messages=[
            question,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        parallel_tool_calls=False,
        max_tokens=20,
        temperature=0,
    )
    assert chat.usage.prompt_tokens == second.usage.input_tokens
    assert (chat.choices[0].message.content or "") == second.output_text


def test_json_schema_text_format_validates(client, model_id):
    fmt = {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}
    for seed in range(2):
        reply = client.responses.create(
            model=model_id,
            input=f"Plan a trip ({seed}).",
            text={"format": fmt},
            max_output_tokens=80,  # the bounded schema's longest reply fits: it must end by itself
            temperature=0.8,
            extra_body={"seed": seed},
        )
        assert reply.status == "completed", reply
        jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    # The client's own stream helper accumulates the events into the same (completed) response.
    with client.responses.stream(
        model=model_id,
        input="Plan a trip (1).",
        text={"format": fmt},
        max_output_tokens=80,
        temperature=0.8,
        extra_body={"seed": 1},
    ) as stream:
        accumulated = stream.get_final_response()
    assert accumulated.status == "completed" and accumulated.output_text == reply.output_text
    # Negative control: the same request without the format does not parse.
    free = client.responses.create(
        model=model_id, input="Plan a trip (0).", max_output_tokens=40, temperature=0
    )
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.output_text)


def test_previous_response_id_continues_the_stored_conversation(client, model_id):
    kwargs = dict(model=model_id, max_output_tokens=8, temperature=0)
    first = client.responses.create(instructions="Be brief.", input="Name a color.", store=True, **kwargs)
    second = client.responses.create(
        instructions="Be brief.", input="And another one?", previous_response_id=first.id, **kwargs
    )
    full = client.responses.create(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another one?"},
        ],
        store=False,
        **kwargs,
    )
    assert second.usage.input_tokens == full.usage.input_tokens
    assert second.output_text == full.output_text
    assert second.previous_response_id == first.id
    alone = client.responses.create(instructions="Be brief.", input="And another one?", **kwargs)
    assert alone.usage.input_tokens < second.usage.input_tokens  # negative control: no history
    # Not stored (store: false): a later request cannot continue it.
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="More?", previous_response_id=full.id, **kwargs)
    assert caught.value.body["param"] == "previous_response_id"


def test_the_store_keeps_the_most_recently_used_conversations():
    store = ResponseStore(2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    assert store.get("a") == [{"role": "user", "content": "1"}]  # a is now the most recent
    store.put("c", [{"role": "user", "content": "3"}])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


# ------------------------------------------------------------------ Codex's requests, replayed raw

# Shapes as Codex sends them (openai/codex codex-rs/codex-api/src/common.rs ResponsesApiRequest,
# items as codex-rs/protocol/src/models.rs ResponseItem serializes them): `codex exec
# --output-schema`, so every reply (the schema's JSON or a shell call) ends by itself.
CODEX_SCHEMA = {
    "type": "object",
    "properties": {"summary": {"type": "string", "maxLength": 24}, "done": {"type": "boolean"}},
    "required": ["summary", "done"],
    "additionalProperties": False,
}
CODEX_TOOLS = [
    {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command and returns its output.",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                "workdir": {"type": "string", "maxLength": 16},
            },
            "required": ["command"],
            "additionalProperties": False,
        },
    },
    {"type": "local_shell"},
    {"type": "web_search"},
    {
        "type": "custom",
        "name": "apply_patch",
        "description": "Edits files with a patch.",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    },
]


def _text_item(role: str, text: str) -> dict:
    kind = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}


CODEX_FIRST_TURN = [
    _text_item("developer", "<permissions instructions>Sandbox: workspace-write.</permissions instructions>"),
    _text_item("user", "<environment_context><cwd>/repo</cwd><shell>bash</shell></environment_context>"),
    _text_item("user", "List the files in this repository."),
]
CODEX_SECOND_TURN = [
    *CODEX_FIRST_TURN,
    {
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": "Listing."}],
        "encrypted_content": None,
    },
    {"type": "function_call", "name": "shell", "arguments": '{"command":["ls"]}', "call_id": "call_1"},
    {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsrc\n"},
    {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch", "input": "*** Begin Patch"},
    {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done."},
    _text_item("assistant", "Two entries: README.md and src."),
    _text_item("developer", "<permissions instructions>Sandbox: read-only.</permissions instructions>"),
    _text_item("user", "Thanks. Summarize."),
]


def _codex_body(model_id: str, items: list[dict]) -> dict:
    return {
        "model": model_id,
        "instructions": "You are Codex, a coding agent. Use the shell tool to inspect files.",
        "input": items,
        "tools": CODEX_TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        "text": {
            "verbosity": "low",
            "format": {
                "type": "json_schema",
                "strict": True,
                "schema": CODEX_SCHEMA,
                "name": "codex_output_schema",
            },
        },
    }


def _check_codex_item(item: dict) -> None:
    """``item`` deserializes as Codex's ResponseItem of its type (codex-rs/protocol/src/models.rs)."""
    assert isinstance(item["id"], str) and item["id"]
    if item["type"] == "message":
        assert item["role"] == "assistant"
        assert all(p["type"] == "output_text" and isinstance(p["text"], str) for p in item["content"])
    elif item["type"] == "function_call":
        assert isinstance(item["name"], str) and isinstance(item["call_id"], str) and item["call_id"]
        assert isinstance(item["arguments"], str)
    else:
        assert item["type"] == "reasoning" and isinstance(item["summary"], list), item


def _check_codex_stream(events: list[tuple[str, dict]]) -> dict:
    """Every event Codex's reader (codex-rs/codex-api/src/sse/responses.rs) reads is present,
    ordered and complete; returns the completed response."""
    assert all(name == data["type"] for name, data in events)
    for _, data in events:  # each has the fields the `openai` client's type for it requires
        EVENT_TYPES[data["type"]].model_validate(data)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [name for name, _ in events]
    assert kinds[0] == "response.created" and isinstance(events[0][1]["response"], dict)
    assert kinds[-1] == "response.completed" and kinds.count("response.completed") == 1
    assert "response.failed" not in kinds and "response.incomplete" not in kinds
    done_items, open_item, texts = [], None, {}
    for name, data in events[1:-1]:
        if name == "response.output_item.added":
            assert open_item is None
            _check_codex_item(data["item"])
            open_item, texts[data["item"]["id"]] = data["item"], ""
        elif name == "response.output_item.done":
            assert open_item is not None and data["item"]["id"] == open_item["id"]
            _check_codex_item(data["item"])
            done_items.append(data["item"])
            open_item = None
        elif name in ("response.output_text.delta", "response.function_call_arguments.delta"):
            assert data["item_id"] == open_item["id"] and isinstance(data["delta"], str)
            texts[open_item["id"]] += data["delta"]
        elif name == "response.reasoning_text.delta":
            assert isinstance(data["content_index"], int) and isinstance(data["delta"], str)
    assert open_item is None and done_items
    for item in done_items:  # the deltas add up to each finished item
        written = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert texts[item["id"]] == written
    response = events[-1][1]["response"]
    assert isinstance(response["id"], str) and response["id"].startswith("resp_")
    assert response["output"] == done_items
    usage = response["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert isinstance(usage["input_tokens_details"]["cached_tokens"], int)
    assert isinstance(usage["output_tokens_details"]["reasoning_tokens"], int)
    return response


def test_codex_requests_replayed_raw_stream_every_event_codex_reads(server, model_id):
    first = _check_codex_stream(_sse(server, _codex_body(model_id, CODEX_FIRST_TURN)))
    second = _check_codex_stream(_sse(server, _codex_body(model_id, CODEX_SECOND_TURN)))
    for response in (first, second):
        (item,) = response["output"]  # the schema's JSON or one call (parallel_tool_calls: false)
        if item["type"] == "message":
            jsonschema.validate(json.loads(item["content"][0]["text"]), CODEX_SCHEMA)
        else:
            jsonschema.validate(json.loads(item["arguments"]), CODEX_TOOLS[0]["parameters"])
    # The second turn's prompt holds the first's and the call, its output and the reply.
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 20
    assert first["store"] is False and first["tools"] == CODEX_TOOLS[:1]
    # Not streamed, the body is a whole response with every field the client's type requires.
    whole = _post(server, {**_codex_body(model_id, CODEX_FIRST_TURN), "stream": False})
    assert whole.status_code == 200, whole.text
    assert Response.model_validate(whole.json()).status == "completed"


# ------------------------------------------------------------------ errors

BAD = [
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "mystery"}]}, "input[0].type"),
    ({"input": [{"content": "no role, no type"}]}, "input[0].type"),
    ({"input": [{"type": ["message"]}]}, "input[0].type"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "bad name!", "arguments": "{}"}]},
        "input[0].name",
    ),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    (
        {"tools": [{"type": "web_search"}, {"type": "function", "name": "f", "parameters": {"type": 3}}]},
        "tools[1].parameters",
    ),
    (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "text.format",
    ),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"previous_response_id": "resp_never"}, "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"store": "yes"}, "store"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_bodies_get_a_400_in_the_responses_shape_naming_the_field(server, extra, param):
    reply = _post(server, {"input": "hi", **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(param + ":") and "\n" not in error["message"], error


def test_a_prompt_that_does_not_fit_is_context_length_exceeded_whole_and_streamed(server, client, model_id):
    long = "word " * 1500  # the model's context is 1024 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_id, input=long)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "input"
    assert caught.value.body["message"].startswith("input: ")
    events = _sse(server, {"model": model_id, "input": long, "stream": True})
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "response.failed"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "context_length_exceeded"
    assert [data["sequence_number"] for _, data in events] == [0, 1, 2]
    # (the client's type lists no context_length_exceeded code; Codex reads it, as OpenAI sends it)
    for _, data in events[:2]:
        EVENT_TYPES[data["type"]].model_validate(data)


def test_without_max_output_tokens_a_reply_may_use_the_rest_of_the_context_up_to_the_cap(client, model_id):
    """Codex never sends ``max_output_tokens``: the default is what the prompt leaves of the
    context (1024 here), at most --max-tokens-cap (600 here), not chat's 512. The random model
    never stops by itself."""
    short = client.responses.create(model=model_id, input="Ramble on.", temperature=0)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 600
    long = client.responses.create(model=model_id, input="word " * 900, temperature=0)
    assert long.status == "incomplete" and long.usage.output_tokens < 600
    assert long.usage.input_tokens + long.usage.output_tokens == 1024


# Codex's provider keys (openai/codex codex-rs/core/src/model_provider_info.rs ModelProviderInfo)
# and the top-level ones the README uses (its config: model, model_provider, model_context_window).
CODEX_PROVIDER_KEYS = frozenset(
    "name base_url env_key env_key_instructions experimental_bearer_token wire_api query_params http_headers"
    " env_http_headers request_max_retries stream_max_retries stream_idle_timeout_ms requires_openai_auth".split()
)


def test_the_readme_codex_configuration_names_codex_keys_and_this_route():
    import tomllib
    from support.paths import REPO

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    (block,) = re.findall(r"```toml\n(.*?)\n```", readme, re.S)
    config = tomllib.loads(block)
    assert set(config) == {"model", "model_provider", "model_context_window", "model_providers"}
    provider = config["model_providers"][config["model_provider"]]
    assert set(provider) <= CODEX_PROVIDER_KEYS
    assert provider["wire_api"] == "responses" and provider["base_url"] == "http://127.0.0.1:8000/v1"
    # No env_key: Codex stops before sending anything when the variable it names is unset, and
    # the README's server has no --api-key (the text says how to add one).
    assert "env_key" not in provider
    assert 'env_key = "MTPLX_API_KEY"' in readme


def test_speculation_fields_reach_the_row_through_the_responses_route(client, model_id):
    """``speculative`` / ``num_draft_tokens`` on /v1/responses, as on chat: drafter "none" is plain
    AR, a pinned count drafts every cycle; a contradiction is a 400 naming the fields."""
    kwargs = dict(model=model_id, input="Count to ten.", max_output_tokens=16, temperature=0)
    off = client.responses.create(**kwargs, extra_body={"speculative": {"drafter": "none"}})
    assert off.model_extra["mtplx"]["mode"] == "ar" and off.model_extra["mtplx"]["drafters"] == {}
    pinned = client.responses.create(**kwargs, extra_body={"num_draft_tokens": 1})
    stats = pinned.model_extra["mtplx"]
    assert stats["depth"] == 1 and stats["drafted_per_position"][0] == stats["cycles"], stats
    assert pinned.output_text == off.output_text  # greedy: the same text either way
    with pytest.raises(openai.BadRequestError, match="num_draft_tokens"):
        client.responses.create(**kwargs, extra_body={"num_draft_tokens": 2, "speculative": {"n_max": 1}})
