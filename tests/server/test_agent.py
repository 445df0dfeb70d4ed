"""`mtplx serve` as an agent back end, through the real server process and the real `openai` and
`anthropic` clients: structured output, tool calls (whole and streamed), a two-turn agent loop,
the Anthropic Messages API, and the 400s of each API's error shape.

The served model is the tiny random MiMo checkpoint of test_server.py (its own MTP head, depth 2:
speculation is on) with the default model's tokenizer. A random model writes nonsense, so every
reply that parses and validates does so because the grammar held it, at every accepted draft block.
Test schemas bound strings and arrays and forbid extra keys, and json_object requests bias the
tokens that close an object, so a constrained reply ends with ``stop`` well before ``max_tokens``.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import anthropic
import httpx
import jsonschema
import openai
import pytest
from support import checkpoints
from support.server import KEY, running_server

TEMPERATURES = (0.0, 0.8)
SEEDS = range(2)
# The bounded schema's longest reply fits 120 tokens. Any JSON object may not end (a random model
# keeps writing keys and strings), so json_object requests bias the tokens that close a string and
# an object: the client's own logit_bias, which bounds the reply (here 4-5 tokens at either
# temperature) and changes nothing the grammar allows. Biased enough to win over 49152 near-uniform
# logits at temperature 0.8; `"}` above `"`, so a value string closes the object with it.
MAX_TOKENS = {"json_schema": 120, "json_object": 40}
CLOSING_BIAS = {'"}': 20.0, '"': 15.0}

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 0, "maximum": 14},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["city", "days", "tags", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "clock", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
PARAMETERS = {
    "get_weather": WEATHER["function"]["parameters"],
    "clock": {"type": "object", "additionalProperties": False},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    path = tmp_path_factory.mktemp("served") / "tiny-mimo"
    checkpoints.mimo(path, vocab_size=49152, seed=0)  # the default tokenizer's vocabulary
    checkpoints.copy_tokenizer(default_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for the tool declarations (~200 tokens)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    with running_server(model_dir, log_path, "--depth", "2") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(model_dir) -> str:
    return str(model_dir)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _valid_calls(calls) -> list[tuple[str, dict]]:
    """(name, arguments) of each call, after checking the arguments against the tool's parameters."""
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        assert call.type == "function" and call.id
        out.append((call.function.name, arguments))
    return out


# ------------------------------------------------------------------ response_format


def test_json_replies_parse_and_validate_at_both_temperatures(client, model_id, model_dir):
    """Every reply ends with ``stop`` (none is cut by ``length``), parses and validates."""
    closing = _closing_bias(model_dir)
    formats = {
        "json_schema": (
            {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}},
            None,
        ),
        "json_object": ({"type": "json_object"}, closing),
    }
    for temperature in TEMPERATURES:
        for seed in SEEDS if temperature else SEEDS[:1]:  # greedy: one seed says it all
            for name, (fmt, bias) in formats.items():
                reply = client.chat.completions.create(
                    model=model_id,
                    messages=_ask(f"Plan a trip ({name}, seed {seed})."),
                    response_format=fmt,
                    max_tokens=MAX_TOKENS[name],
                    temperature=temperature,
                    seed=seed,
                    logit_bias=bias,
                )
                choice = reply.choices[0]
                where = f"{name}, temperature {temperature}, seed {seed}: {choice.message.content!r}"
                assert choice.finish_reason == "stop", where
                value = json.loads(choice.message.content)
                jsonschema.validate(value, SCHEMA if name == "json_schema" else {"type": "object"})
                assert choice.message.content == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _closing_bias(model_dir: Path) -> dict[str, float]:
    """CLOSING_BIAS as an OpenAI logit_bias: {token id (a string): bias}, from the served tokenizer."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(model_dir)
    bias = {}
    for text, value in CLOSING_BIAS.items():
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        bias[str(token)] = value
    return bias


def test_concurrent_json_requests_decode_in_the_batch_and_validate(client, model_id, server):
    """Grammar requests in flight together decode in the batch and speculate there: every reply
    that stops validates, and each says it drafted (forced tokens or head / lookup drafts)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}

    def ask(seed: int):
        return client.chat.completions.create(
            model=model_id,
            messages=_ask(f"Plan a trip (concurrent, seed {seed})."),
            response_format=fmt,
            max_tokens=MAX_TOKENS["json_schema"],
            temperature=0.8,
            seed=seed,
        )

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    for reply in replies:
        extra = reply.model_extra["mtplx"]
        assert extra["mode"] == "mtp" and sum(d["drafted"] for d in extra["drafters"].values()) > 0, extra


def test_the_json_check_catches_an_unconstrained_reply(client, model_id, model_dir):
    """Negative control: the same requests without response_format do not parse, the json_object one
    with its closing bias included (the bias alone does not make JSON: the grammar does)."""
    for name, bias in (("json_schema", None), ("json_object", _closing_bias(model_dir))):
        reply = client.chat.completions.create(
            model=model_id,
            messages=_ask(f"Plan a trip ({name}, seed 0)."),
            max_tokens=40,
            temperature=0,
            logit_bias=bias,
        )
        with pytest.raises(json.JSONDecodeError):
            json.loads(reply.choices[0].message.content)


def test_completions_take_response_format_and_model_may_be_omitted(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    reply = httpx.post(
        server[0] + "/v1/completions",
        json={"prompt": "A trip:", "response_format": fmt, "max_tokens": 120, "temperature": 0.8, "seed": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


# ------------------------------------------------------------------ tools, OpenAI style


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_required_and_named_tool_choices_always_produce_valid_calls(client, model_id, temperature):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in SEEDS[:2]:
        for choice, parallel in (("required", False), ("required", True), (named, True)):
            reply = client.chat.completions.create(
                model=model_id,
                messages=_ask(f"Weather in Oslo? ({seed})"),
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=parallel,
                max_tokens=150,
                temperature=temperature,
                seed=seed,
            )
            message, finish = reply.choices[0].message, reply.choices[0].finish_reason
            if parallel and finish == "length":  # several calls: a random model may not stop calling
                continue
            assert finish == "tool_calls", (choice, parallel, message)
            assert message.content is None
            calls = _valid_calls(message.tool_calls)
            if choice is named:
                assert [name for name, _ in calls] == ["get_weather"]
            if not parallel or choice is named:
                assert len(calls) == 1


def test_streamed_tool_call_fragments_concatenate_to_the_whole_replys_calls(client, model_id):
    kwargs = dict(
        model=model_id,
        messages=_ask("Weather in Rome?"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=150,
        temperature=0.8,
        seed=7,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for fragment in choice.delta.tool_calls or ():
            if fragment.index not in calls:  # the first fragment of a call names it
                assert fragment.id and fragment.function.name and fragment.type == "function"
                calls[fragment.index] = {"name": fragment.function.name, "arguments": "", "fragments": 0}
            else:
                assert fragment.id is None
            calls[fragment.index]["arguments"] += fragment.function.arguments or ""
            calls[fragment.index]["fragments"] += 1
    assert finish == whole.finish_reason
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or ()]
    got = [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]
    assert got == expected and got
    for name, arguments in got:
        jsonschema.validate(arguments, PARAMETERS[name])
    assert any(c["fragments"] > 1 for c in calls.values())  # arguments streamed, not sent whole


def test_auto_replies_are_text_or_valid_calls(client, model_id):
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model=model_id,
            messages=_ask(f"Anything ({seed})"),
            tools=TOOLS,
            max_tokens=60,
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        if choice.message.tool_calls:
            _valid_calls(choice.message.tool_calls)
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert isinstance(choice.message.content, str) and "<tool_call>" not in choice.message.content


def test_a_two_turn_agent_loop(client, model_id):
    messages = [{"role": "system", "content": "You use tools."}, *_ask("Weather in Lima?")]
    first = client.chat.completions.create(
        model=model_id,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=150,
        temperature=0,
    )
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = first.choices[0].message.tool_calls
    assert first.choices[0].message.content is None
    messages.append(first.choices[0].message)  # the client's own object, as the README's loop does
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky":"clear","c":21}'})
    second = client.chat.completions.create(
        model=model_id, messages=messages, tools=TOOLS, max_tokens=20, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The second prompt holds the first prompt, the call and the tool's result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


# ------------------------------------------------------------------ Anthropic Messages API


def test_messages_text_whole_and_streamed(claude, model_id):
    kwargs = dict(
        model=model_id,
        max_tokens=12,
        system="You are terse.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},  # the SDK (2.x) has no sampling arguments; the API has them
    )
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.content[0].type == "text"
    assert whole.usage.output_tokens > 0
    counted = claude.messages.count_tokens(
        model=model_id, system="You are terse.", messages=[{"role": "user", "content": "Say hello."}]
    )
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    events = list(claude.messages.create(stream=True, **kwargs))
    kinds = [e.type for e in events]  # the SDK drops ping events
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == whole.content[0].text
    assert events[-2].delta.stop_reason == whole.stop_reason
    assert (
        events[0].message.usage.input_tokens == counted.input_tokens
    )  # the whole prompt, before the prefill
    final = events[-2].usage  # message_delta: Anthropic's split, uncached + read from the cache
    assert final.input_tokens + final.cache_read_input_tokens == counted.input_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_messages_stop_sequences_say_which_one_ended_the_reply(claude, model_id, stream):
    kwargs = dict(model=model_id, max_tokens=16, messages=_ask("Ramble on."), extra_body={"temperature": 0})
    text = claude.messages.create(**kwargs).content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece of what the model will write again
    expected = text[: text.index(stop)]
    stops = ["never-written-zz", stop]
    if stream:
        with claude.messages.stream(stop_sequences=stops, **kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = claude.messages.create(stop_sequences=stops, **kwargs)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in reply.content) == expected
    unmatched = claude.messages.create(stop_sequences=["never-written-zz"], **kwargs)
    assert (unmatched.stop_reason, unmatched.stop_sequence) == ("max_tokens", None)


def test_messages_stream_events_on_the_wire(server, model_id):
    body = {"model": model_id, "max_tokens": 6, "stream": True, "messages": _ask("Hi."), "temperature": 0}
    with httpx.stream(
        "POST", server[0] + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60
    ) as reply:
        lines = [line for line in reply.iter_lines() if line.startswith("event: ")]
    kinds = [line.removeprefix("event: ") for line in lines]
    # message_start and a ping open the stream before the prefill; more pings only when no event
    # went out for --keepalive-interval (a loaded machine), as Anthropic's API sends them.
    blocks = [kind for kind in kinds if kind != "ping"]
    assert kinds[:2] == ["message_start", "ping"] and blocks[1] == "content_block_start"
    assert blocks[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(blocks[2:-3]) == {"content_block_delta"}


def test_messages_tool_use_whole_streamed_and_the_tool_result_turn(claude, model_id):
    tools = [
        {
            "name": "get_weather",
            "description": "The weather",
            "input_schema": WEATHER["function"]["parameters"],
        }
    ]
    kwargs = dict(
        model=model_id,
        max_tokens=150,
        messages=[{"role": "user", "content": "Weather in Kyiv?"}],
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    )
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, PARAMETERS["get_weather"])

    with claude.messages.stream(**kwargs) as stream:
        partial = "".join(
            e.delta.partial_json
            for e in stream
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
        )
        final = stream.get_final_message()
    jsonschema.validate(json.loads(partial), PARAMETERS["get_weather"])
    assert final.stop_reason == "tool_use" and final.content[-1].input == json.loads(partial)

    follow = claude.messages.create(
        model=model_id,
        max_tokens=10,
        tools=tools,
        messages=[
            kwargs["messages"][0],
            {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
        extra_body={"temperature": 0},
    )
    # The follow-up's prompt holds the tools, the call and its result.
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")

    def prompt(usage):
        return usage.input_tokens + usage.cache_read_input_tokens

    assert prompt(follow.usage) > prompt(whole.usage)


# ------------------------------------------------------------------ errors


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"} if headers is None else headers
    return httpx.post(server[0] + path, json=body, headers=headers, timeout=60)


OPENAI_BAD = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format",
        "response_format: Invalid type: nonsense",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "tool_choice: no tool named 'nope'",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
        "tools[0].function.parameters",
        "tools[0].function.parameters:",
    ),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
    (
        {"messages": [*_ask("hi"), {"role": "tool", "content": "x"}]},
        "messages[1]",
        "messages[1]: a tool message needs the tool_call_id",
    ),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "messages[0]: content is required"),
]


@pytest.mark.parametrize(("extra", "param", "message"), OPENAI_BAD)
def test_bad_agent_requests_get_a_400_in_the_openai_shape(server, extra, param, message):
    body = {"messages": _ask("hi"), "max_tokens": 4, **extra}
    reply = _post(server, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(message) and "\n" not in error["message"]


ANTHROPIC_BAD = [
    ({"messages": _ask("hi")}, "max_tokens"),  # max_tokens is required
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages"),  # no user turn
    (
        {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages",
    ),
    ({"max_tokens": 4, "messages": _ask("hi"), "tool_choice": {"type": "tool"}}, "tool_choice"),
    (
        {
            "max_tokens": 4,
            "messages": _ask("hi"),
            "tools": [{"name": "f", "input_schema": {"type": "nonsense"}}],
        },
        "tools",
    ),
]


@pytest.mark.parametrize(("body", "field"), ANTHROPIC_BAD)
def test_bad_messages_bodies_get_a_400_in_anthropics_shape(server, body, field):
    reply = _post(server, "/v1/messages", body, headers={"x-api-key": KEY})
    assert reply.status_code == 400, reply.text
    payload = reply.json()
    assert payload["type"] == "error" and payload["error"]["type"] == "invalid_request_error"
    assert payload["error"]["message"].startswith(field), payload


def test_messages_auth_uses_anthropics_shape_and_any_model_name_is_served(server, claude, model_id):
    """Without --served-model-name any name is the loaded model (Claude Code sends its own);
    test_server.py's server lists its names and answers others with a 404."""
    reply = _post(
        server, "/v1/messages", {"max_tokens": 4, "messages": _ask("hi")}, headers={"x-api-key": "wrong"}
    )
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    ok = claude.messages.create(model="other", max_tokens=4, messages=_ask("still there?"))
    assert ok.usage.output_tokens > 0 and ok.model == model_id


# ------------------------------------------------------------------ per-request speculation


def test_a_request_turns_drafting_off_while_others_keep_drafting(client, model_id):
    """``speculative.drafter: "none"`` decodes that request as plain AR (no drafted tokens) in the
    same batch as requests that draft."""

    def ask(extra: dict):
        return client.chat.completions.create(
            model=model_id, messages=_ask("Count to ten."), max_tokens=24, temperature=0, extra_body=extra
        )

    with ThreadPoolExecutor(3) as pool:
        # The two drafting requests pin their count: the cost policy may keep a free row at K = 0.
        pinned = [{"num_draft_tokens": 2}, {"speculative": {"n_max": 2, "n_min": 1}}]
        off, on, also_on = pool.map(ask, [{"speculative": {"drafter": "none"}}, *pinned])
    assert off.model_extra["mtplx"]["mode"] == "ar" and off.model_extra["mtplx"]["drafters"] == {}
    for reply in (on, also_on):
        extra = reply.model_extra["mtplx"]
        assert extra["mode"] == "mtp" and sum(d["drafted"] for d in extra["drafters"].values()) > 0, extra
    assert off.choices[0].message.content == on.choices[0].message.content  # greedy: the same text


@pytest.mark.parametrize(
    "extra",
    [
        {"num_draft_tokens": 1},
        {"speculative": {"n_max": 3, "n_min": 3, "drafter": "head"}},
        {"speculative": {"n_min": 2}},  # n_min alone: at least that many, every cycle
    ],
)
def test_a_pinned_draft_count_is_drafted_every_cycle(client, model_id, extra):
    """``num_draft_tokens`` (mlx-lm's spelling), ``speculative.n_max`` with ``n_min``, and ``n_min``
    alone pin the head's drafts per cycle: the reply's depth is the count, and every cycle but the
    prefill's drafted exactly that many (the cost policy took none of them to K = 0)."""
    spec = extra.get("speculative", {})
    count = extra.get("num_draft_tokens") or spec.get("n_max") or spec["n_min"]
    reply = client.chat.completions.create(
        model=model_id,
        messages=_ask("Write a long list of fruit."),
        max_tokens=40,
        temperature=0,
        extra_body={**extra, "speculative": {**extra.get("speculative", {}), "drafter": "head"}},
    )
    stats = reply.model_extra["mtplx"]
    assert stats["depth"] == count, stats
    assert len(stats["drafted_per_position"]) == count, stats
    assert stats["drafted_per_position"][0] == stats["cycles"], stats  # every cycle drafted


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"num_draft_tokens": 99}, "num_draft_tokens"),
        ({"speculative": {"n_max": 2, "n_min": 3}}, "speculative"),
        ({"speculative": {"drafter": "bogus"}}, "speculative.drafter"),
        ({"num_draft_tokens": 2, "speculative": {"n_max": 3}}, None),
        ({"num_draft_tokens": 3, "speculative": {"drafter": "none"}}, None),  # drafts with plain AR
        ({"speculative": {"n_max": 0, "drafter": "head"}}, None),  # no drafts with a drafter named
    ],
)
def test_bad_speculation_fields_are_400s_naming_the_field(server, extra, param):
    body = {"messages": _ask("hi"), "max_tokens": 4, **extra}
    reply = httpx.post(
        server[0] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert ("num_draft_tokens" in error["message"]) or ("speculative" in error["message"]), error


def test_a_draft_count_bounds_lookup_as_it_bounds_the_head(client, model_id):
    """``num_draft_tokens`` is the most drafts per cycle whatever proposes them (mlx-lm's and
    llama-server's meaning): a lookup row on repeated text drafts blocks of 1, not its own 10."""
    text = "alpha beta gamma delta epsilon " * 8
    reply = client.chat.completions.create(
        model=model_id,
        messages=_ask(f"Repeat this text exactly: {text}"),
        max_tokens=40,
        temperature=0,
        extra_body={"num_draft_tokens": 1, "speculative": {"drafter": "lookup"}},
    )
    stats = reply.model_extra["mtplx"]
    assert stats["drafters"]["lookup"]["drafted"] > 0, stats
    assert len(stats["drafted_per_position"]) == 1, stats  # no cycle drafted 2 or more


def test_a_draft_model_request_without_one_names_the_request_field(client, model_id):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id,
            messages=_ask("hi"),
            max_tokens=4,
            extra_body={"speculative": {"drafter": "model"}},
        )
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert message.startswith("speculative.drafter: 'model' needs a draft model"), message
    assert "\n" not in message


def test_the_messages_route_carries_the_speculation_fields(claude, model_id):
    """/v1/messages takes the same fields: they reach the chat request it is served as, and a bad
    one is a 400 in Anthropic's shape."""
    from mtplx.server.anthropic import MessagesRequest, to_chat

    body = MessagesRequest.model_validate(
        {"max_tokens": 4, "messages": _ask("hi"), "speculative": {"drafter": "none", "n_max": 0}}
    )
    assert to_chat(body)["speculative"] == {"drafter": "none", "n_max": 0}
    reply = claude.messages.create(
        model=model_id, max_tokens=8, messages=_ask("Count to ten."), extra_body={"num_draft_tokens": 1}
    )
    assert reply.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.BadRequestError, match="num_draft_tokens"):
        claude.messages.create(
            model=model_id, max_tokens=8, messages=_ask("hi"), extra_body={"num_draft_tokens": 99}
        )


# ------------------------------------------------------------------ n > 1


def test_n_choices_whole_and_streamed_reassemble_alike(client, model_id):
    """``n = 3`` with a seed: the streamed events, grouped by each chunk's choice index, reassemble to
    the whole reply's choices (text, finish reason, logprobs); the prompt is counted once and
    forwarded once (choices 1 and 2 start from a copy of choice 0's caches: their own stats count
    every prompt token but the last as cached), the completions summed."""
    request = dict(
        model=model_id,
        messages=_ask("Name three colours."),
        max_tokens=12,
        temperature=0.9,
        seed=11,
        n=3,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**request)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = {c.message.content for c in whole.choices}
    assert len(texts) > 1, texts  # independent keys: a random model at 0.9 writes three texts
    per_choice = whole.model_extra["mtplx"]["choices"]
    prompt = whole.usage.prompt_tokens
    cached = [c["cached_tokens"] for c in per_choice]  # choice 0's: what the prompt cache held
    assert cached[1:] == [prompt - 1, prompt - 1] and cached[0] < prompt - 1, per_choice
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)
    streamed = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    text, finish, tokens = ["", "", ""], [None] * 3, [[], [], []]
    usage = None
    for event in streamed:
        if event.usage is not None:
            usage = event.usage
        for choice in event.choices:
            text[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
            tokens[choice.index] += [e.token for e in (choice.logprobs.content if choice.logprobs else [])]
    assert text == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert tokens == [[e.token for e in c.logprobs.content] for c in whole.choices]
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt, whole.usage.completion_tokens)


def test_n_choices_each_follow_the_schema_and_completions_take_n(client, model_id, server):
    """Each choice has its own grammar matcher: every one validates; /v1/completions takes ``n`` too."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
    reply = client.chat.completions.create(
        model=model_id,
        messages=_ask("Plan a trip."),
        response_format=fmt,
        max_tokens=120,
        temperature=0.8,
        n=2,
    )
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    text = client.completions.create(model=model_id, prompt="Once upon", max_tokens=6, temperature=1.0, n=2)
    assert [c.index for c in text.choices] == [0, 1] and text.usage.completion_tokens == 12


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [("/v1/chat/completions", {"n": 17}, "n"), ("/v1/completions", {"n": 2, "best_of": 3}, "best_of")],
)
def test_bad_choice_counts_are_400s_naming_the_field(server, path, extra, param):
    body = {"max_tokens": 4, **extra}
    body.update({"messages": _ask("hi")} if path.endswith("chat/completions") else {"prompt": "hi"})
    reply = _post(server, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
