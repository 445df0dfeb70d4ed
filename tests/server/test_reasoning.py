"""A Qwen3-like model through the real server: its reasoning span is split from the answer, whole
and streamed; a grammar constrains only the answer; its own template renders the tools, and its
calls are read with mlx-lm's parser for the template's family.

The model is the tiny random MiMo of the server tests with the default tokenizer plus ``<think>``,
``</think>``, ``<tool_call>`` and ``</tool_call>`` as tokens (so mlx-lm finds the thinking markers) and a Hermes-style template that renders
``tools`` and calls (mlx-lm infers its ``json_tools`` parser) and opens the span in the generation
prompt, as Qwen3's does. A bias on ``</think>`` makes the random model close the span within a
few tokens; the expected split is the engine's own text cut at the first end marker.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.server.reasoning import ReasoningSplitter

import jsonschema
import openai
import pytest
from openai.types.responses import Response
from support import checkpoints
from support.server import KEY, running_server

TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    '</tools>\nCall one with <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\n{% endif %}'
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- for tc in m.tool_calls or [] %}{%- set tool_call = tc.function %}<tool_call>\n"
    '{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory, default_model_dir) -> Path:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("thinking") / "tiny-thinker"
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    # Plain text when decoded; one token each, as in Qwen3's tokenizer (the grammars name them by id).
    tokenizer.add_tokens(["<think>", "</think>", "<tool_call>", "</tool_call>"])
    tokenizer.chat_template = TEMPLATE
    checkpoints.mimo(path, vocab_size=len(tokenizer), seed=3)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def end_id(thinking_dir) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(thinking_dir).convert_tokens_to_ids("</think>")


@pytest.fixture(scope="module")
def server(thinking_dir, tmp_path_factory):
    with running_server(
        thinking_dir, tmp_path_factory.mktemp("log") / "server.log", "--depth", "2"
    ) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(thinking_dir):
    from mtplx.engine.engine import Engine

    return Engine.load(thinking_dir, depth=2)


def _request(end_id: int, seed: int) -> dict:
    return dict(
        messages=[{"role": "user", "content": f"Think, then answer ({seed})."}],
        max_tokens=24,
        temperature=0.8,
        seed=seed,
        logit_bias={str(end_id): 10.0},
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_reasoning_is_split_from_the_answer_whole_and_streamed(client, engine, thinking_dir, end_id, seed):
    kwargs = _request(end_id, seed)
    raw = engine.generate(
        kwargs["messages"], max_tokens=24, temperature=0.8, seed=seed, logit_bias={end_id: 10.0}
    ).text
    assert "</think>" in raw  # the bias closes the span within max_tokens
    expected_reasoning, _, expected_answer = raw.partition("</think>")
    expected_answer = expected_answer.lstrip("\n")

    whole = client.chat.completions.create(model=str(thinking_dir), **kwargs).choices[0].message
    extra = whole.model_extra
    assert extra.get("reasoning_content", "") == expected_reasoning == extra.get("reasoning", "")
    assert whole.content == expected_answer

    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=str(thinking_dir), stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
    assert (reasoning, content) == (expected_reasoning, expected_answer)


def test_a_grammar_constrains_only_the_answer(client, thinking_dir, end_id):
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reasonings = []
    for seed in range(4):
        request = {**_request(end_id, seed), "max_tokens": 80, "logit_bias": {str(end_id): 7.0}}
        choice = client.chat.completions.create(
            model=str(thinking_dir), response_format=fmt, **request
        ).choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        reasonings.append(choice.message.model_extra.get("reasoning_content", ""))
    # The reasoning was free text (the random model's words, not JSON), and some replies had one.
    assert any(reasonings) and not any("{" in r for r in reasonings), reasonings


def test_the_templates_own_tool_calls_with_reasoning_whole_streamed_and_as_a_turn(
    client, thinking_dir, end_id
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(thinking_dir)
    kwargs = {**_request(end_id, 5), "max_tokens": 80, "tools": [WEATHER], "tool_choice": "required"}
    kwargs["parallel_tool_calls"] = False
    reply = client.chat.completions.create(model=str(thinking_dir), **kwargs)
    # The model's own template rendered the tools (the generic format would give another prompt).
    rendered = tokenizer.apply_chat_template(
        kwargs["messages"], tools=[WEATHER], add_generation_prompt=True, return_dict=False
    )
    assert reply.usage.prompt_tokens == len(rendered)
    whole = reply.choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert "<tool_call>" not in (whole.message.content or "")

    arguments, names = "", []
    for chunk in client.chat.completions.create(model=str(thinking_dir), stream=True, **kwargs):
        for fragment in chunk.choices[0].delta.tool_calls or ():
            names += [fragment.function.name] if fragment.id else []
            arguments += fragment.function.arguments or ""
    assert names == ["get_weather"] and json.loads(arguments) == json.loads(call.function.arguments)

    # The call and its result go back through the template, arguments as a mapping (HF templates' form).
    messages = [
        *kwargs["messages"],
        whole.message,
        {"role": "tool", "tool_call_id": call.id, "content": "rain"},
    ]
    second = client.chat.completions.create(
        model=str(thinking_dir), messages=messages, tools=[WEATHER], max_tokens=4, temperature=0
    )
    turn = {
        "role": "assistant",
        "content": whole.message.content or "",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}
        ],
    }
    expected = tokenizer.apply_chat_template(
        [*kwargs["messages"], turn, {"role": "tool", "content": "rain"}],
        tools=[WEATHER],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert second.usage.prompt_tokens == len(expected)


def test_responses_reasoning_is_a_reasoning_item_whole_and_streamed(client, thinking_dir, end_id):
    """/v1/responses on the same path: the span is a ``reasoning`` item (its text as chat's
    ``reasoning_content``) before the message, streamed as ``response.reasoning_text.delta``."""
    for seed in range(6):  # the first seed whose reply has both a span and an answer
        kwargs = _request(end_id, seed)
        chat = client.chat.completions.create(model=str(thinking_dir), **kwargs).choices[0].message
        expected = chat.model_extra.get("reasoning_content", "")
        if expected and chat.content:
            break
    assert expected and chat.content, chat
    body = dict(
        model=str(thinking_dir),
        input=kwargs["messages"],
        max_output_tokens=kwargs["max_tokens"],
        temperature=kwargs["temperature"],
        extra_body={"seed": kwargs["seed"], "logit_bias": kwargs["logit_bias"]},
    )
    whole = client.responses.create(**body)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].type == "reasoning_text" and whole.output[0].summary == []
    assert whole.output[0].content[0].text == expected and whole.output_text == chat.content
    Response.model_validate(whole.to_dict())  # every field the client's (strict) type requires
    details = whole.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.output_tokens

    events = list(client.responses.create(stream=True, **body))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas and all(e.content_index == 0 for e in deltas)
    assert "".join(e.delta for e in deltas) == expected
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat.content
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    for event in events:
        type(event).model_validate(event.to_dict())


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 100])
def test_the_splitter_handles_markers_cut_between_pieces(size):
    text = "<think>a</thi\nnk</think>\n\nthe answer</think>"
    for opened, expected in (
        (False, ("a</thi\nnk", "the answer</think>")),
        (True, ("<think>a</thi\nnk", "the answer</think>")),
    ):
        splitter = ReasoningSplitter("<think>", "</think>", opened)
        reasoning, answer = "", ""
        for i in range(0, len(text), size):
            r, a = splitter.feed(text[i : i + size])
            reasoning, answer = reasoning + r, answer + a
        r, a = splitter.finish()
        assert (reasoning + r, answer + a) == expected
    no_thinking = ReasoningSplitter("<think>", "</think>", False)
    assert no_thinking.feed("<thi") == ("", "") and no_thinking.feed("s is not it") == ("", "<this is not it")
