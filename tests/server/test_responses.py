"""`POST /v1/responses` (the OpenAI Responses API that Codex speaks) through the real server process
and the real `openai` client: whole and streamed replies, a tool-call round trip, ``text.format``,
``previous_response_id``, recorded Codex-shaped bodies replayed raw, and the 400s.

The served model is the tiny random MiMo of test_agent.py (its own MTP head, depth 2: speculation
is on) with the default model's tokenizer; its context is 1024 tokens. The route runs on the chat
path, so greedy replies equal /v1/chat/completions' for the same conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import httpx
import openai
import pytest
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
    with running_server(model_dir, log_path, "--depth", "2") as running:
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
