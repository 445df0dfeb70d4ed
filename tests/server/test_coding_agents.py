"""`mtplx serve` as coding agents speak to it (issue 50): Anthropic Messages as Claude Code sends
them, streams that open before the prefill ends, keep-alives, the agent prompt-cache
normalisation, lenient tool schemas, a Responses stream cut by the timeout, and a truthful /health.

The served model is the tiny random MiMo checkpoint of test_agent.py with the default model's
tokenizer and a 4,096-token context; `--prefill-step-size 32` makes a long prompt prefill in
many cycles, so a stream is observably open while its prompt is still prefilling.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.server.anthropic import MessagesRequest, to_chat

import anthropic
import httpx
import openai
import pytest
from support import checkpoints
from support.server import KEY, running_server, wait_for

CONTEXT = 4096
FIXTURES = Path(__file__).parent / "fixtures" / "agents"
TOKENS_LEFT = "<total_tokens>{} tokens left</total_tokens>"
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch={};"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir) -> Path:
    path = tmp_path_factory.mktemp("served") / "tiny-mimo"
    checkpoints.mimo(path, vocab_size=49152, seed=0)  # the default tokenizer's vocabulary
    checkpoints.copy_tokenizer(default_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    flags = ["--prefill-step-size", "32", "--keepalive-interval", "0.2", "--max-tokens-cap", "512"]
    with running_server(model_dir, log_path, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=KEY, max_retries=0, timeout=120)


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _long_text(words: int, salt: str = "item") -> str:
    """About 1.9 tokens a word with the default tokenizer (2,000 words: 3,840 tokens)."""
    return " ".join(f"{salt}{i % 97} is number {i}." for i in range(words // 5))


def _eos_ban(model_dir: Path) -> dict[str, float]:
    """An OpenAI logit_bias that rules out every end-of-sequence token of the served tokenizer."""
    from mlx_lm.tokenizer_utils import load

    eos_ids = load(model_dir).eos_token_ids
    assert eos_ids
    return {str(token): -100.0 for token in eos_ids}


def _events(lines) -> list[tuple[str, dict]]:
    """(event name, data) of each Anthropic SSE event in ``lines``."""
    out, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            out.append((name, json.loads(line.removeprefix("data: "))))
    return out


# ------------------------------------------------------------------ Messages as Claude Code sends them


def test_system_entries_in_messages_join_the_system_prompt_or_the_adjacent_user_turn():
    body = MessagesRequest.model_validate(
        {
            "max_tokens": 8,
            "system": [
                {"type": "text", "text": BILLING.format("abc12")},
                {"type": "text", "text": "Be terse."},
            ],
            "messages": [
                {"role": "system", "content": "Early note."},
                {"role": "user", "content": "One."},
                {"role": "system", "content": [{"type": "text", "text": "After one."}]},
                {"role": "assistant", "content": "Two."},
                {"role": "system", "content": "Before three."},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            ],
        }
    )
    assert to_chat(body)["messages"] == [
        {"role": "system", "content": "Be terse.\n\nEarly note."},  # the billing block is dropped
        {"role": "user", "content": "One.\n\nAfter one."},
        {"role": "assistant", "content": "Two.", "tool_calls": None},
        {"role": "tool", "tool_call_id": "t1", "content": "ok"},
        {"role": "user", "content": "Before three."},
    ]


def test_claude_codes_request_shape_is_served_under_any_model_name(claude, server, model_dir):
    """A mid-conversation system entry, a model name of Claude's and 64,000 max_tokens (over the
    512 cap, and the prompt leaves fewer than 512 tokens of the context): served, clamped to what
    is left, under the served model's name."""
    reply = claude.messages.create(
        model="claude-opus-4-8",
        max_tokens=64000,
        messages=[*_ask(_long_text(2000, "fill")), {"role": "system", "content": "Mind the context."}],
        extra_body={"temperature": 0.8},
    )
    assert reply.model == str(model_dir)
    total = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert CONTEXT - total < 512 and reply.usage.output_tokens <= CONTEXT - total
    assert reply.stop_reason in ("end_turn", "max_tokens")
    head = httpx.head(server[0] + "/", timeout=10)
    assert head.status_code == 200


def test_a_prompt_that_fills_the_context_gets_anthropics_error(claude):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="claude-opus-4-8", max_tokens=32000, messages=_ask(_long_text(5000)))
    error = caught.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert (
        error["message"].startswith("prompt is too long: ") and f"> {CONTEXT - 1} maximum" in error["message"]
    )


PROPERTY_NAMES_TOOL = {
    "name": "todo",
    "description": "Keep a list",
    "input_schema": {
        "type": "object",
        "properties": {
            "items": {
                "type": "object",
                "propertyNames": {"type": "string"},
                "additionalProperties": {"type": "string", "maxLength": 8},
                "maxProperties": 2,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
}


def test_vacuous_property_names_compile_with_a_warning_and_a_constraining_one_is_refused(claude, server):
    reply = claude.messages.create(
        model="m",
        max_tokens=60,
        messages=_ask("Note two things."),
        tools=[PROPERTY_NAMES_TOOL],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    (use,) = [b for b in reply.content if b.type == "tool_use"] or [None]
    if reply.stop_reason == "tool_use":  # a call that closed is valid under the whole schema
        assert set(use.input) == {"items"} and all(isinstance(v, str) for v in use.input["items"].values())
    wait_for(lambda: "ignored keywords every value satisfies" in server[1].read_text())
    assert "/properties/items/propertyNames" in server[1].read_text()
    strict = json.loads(json.dumps(PROPERTY_NAMES_TOOL))
    strict["input_schema"]["properties"]["items"]["propertyNames"] = {"type": "string", "pattern": "^a"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="m", max_tokens=8, messages=_ask("x"), tools=[strict])
    assert caught.value.body["error"]["message"].startswith("tools[0].function.parameters: ")
    assert "propertyNames" in caught.value.body["error"]["message"]


def test_claude_codes_default_tool_request_is_counted_and_gets_the_context_error(claude, server):
    """Claude Code's recorded first request with its default tools (24, two with propertyNames):
    count_tokens answers for it whole, and /messages refuses it with Anthropic's error (not a
    schema error: its propertyNames compile)."""
    record = json.loads((FIXTURES / "claude_code_default_tools.json").read_text())["body"]
    counted = claude.messages.count_tokens(
        model=record["model"], system=record["system"], messages=record["messages"], tools=record["tools"]
    )
    assert counted.input_tokens > CONTEXT
    reply = httpx.post(server[0] + "/v1/messages", json=record, headers={"x-api-key": KEY}, timeout=120)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {counted.input_tokens} tokens > {CONTEXT - 1} maximum",
    }


def test_count_tokens_builds_no_grammar(claude):
    """A schema llguidance refuses still counts (count_tokens renders the prompt only)."""
    bad = {"name": "f", "input_schema": {"type": "object", "not": {"type": "nonsense"}}}
    counted = claude.messages.count_tokens(model="m", messages=_ask("Count me."), tools=[bad])
    assert counted.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError):  # the same tool on /messages needs its grammar
        claude.messages.create(model="m", max_tokens=4, messages=_ask("Count me."), tools=[bad])


# ------------------------------------------------------------------ agent prompt cache


def test_billing_block_is_normalised_away_and_turn_two_reads_the_cache(claude):
    """Two requests that differ only in the billing block's hash: the second reads the first's
    prompt from the cache (Anthropic's usage split), and both serve exactly the prompt without
    the block (its token count; the greedy reply is the same)."""
    system = "You are a careful coding agent. " + _long_text(400)
    messages = _ask("List three prime numbers.")

    def ask(cch: str | None):
        blocks = [{"type": "text", "text": system}]
        if cch is not None:
            blocks.insert(0, {"type": "text", "text": BILLING.format(cch)})
        return claude.messages.create(
            model="m", max_tokens=6, system=blocks, messages=messages, extra_body={"temperature": 0}
        )

    counted = claude.messages.count_tokens(model="m", system=system, messages=messages).input_tokens
    first, second = ask("11111"), ask("22222")
    for reply in (first, second):
        assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted
        assert reply.usage.cache_creation_input_tokens == 0
    assert second.usage.cache_read_input_tokens >= 0.9 * counted
    assert second.content[0].text == first.content[0].text == ask(None).content[0].text


def test_tokens_left_notes_are_dropped_and_turn_two_reads_the_cache(claude):
    """Claude Code's "tokens left" system entries (a new count every request): dropped wherever
    they stand, so a second turn reads the first's prompt and reply from the cache and both
    serve the prompt without the notes (count, greedy reply); other system entries stay."""
    kept = to_chat(
        MessagesRequest.model_validate(
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": TOKENS_LEFT.format(199000)},
                    *_ask("One."),
                    {"role": "system", "content": "Keep me."},
                    {"role": "system", "content": [{"type": "text", "text": TOKENS_LEFT.format(198500)}]},
                ],
            }
        )
    )["messages"]
    assert kept == [{"role": "user", "content": "One.\n\nKeep me."}]
    system = "You are a careful coding agent. " + _long_text(400)
    turn1 = _ask("List three prime numbers.")
    first = claude.messages.create(
        model="m",
        max_tokens=6,
        system=system,
        messages=[*turn1, {"role": "system", "content": TOKENS_LEFT.format(180000)}],
        extra_body={"temperature": 0},
    )
    turn2 = [*turn1, {"role": "assistant", "content": first.content[0].text}, *_ask("And two more.")]
    counted = claude.messages.count_tokens(model="m", system=system, messages=turn2).input_tokens
    noted = [turn2[0], {"role": "system", "content": TOKENS_LEFT.format(180000)}, *turn2[1:]]
    second = claude.messages.create(
        model="m",
        max_tokens=6,
        system=system,
        messages=[*noted, {"role": "system", "content": TOKENS_LEFT.format(179000)}],
        extra_body={"temperature": 0},
    )
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == counted
    assert second.usage.cache_read_input_tokens >= 0.9 * counted
    plain = claude.messages.create(
        model="m", max_tokens=6, system=system, messages=turn2, extra_body={"temperature": 0}
    )
    assert second.content[0].text == plain.content[0].text


def test_tool_argument_key_order_is_kept_when_earlier_turns_are_rendered():
    """Claude Code re-sends earlier tool calls; their keys render in the order it sent them."""
    turns = [
        *_ask("Run it."),
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"z": 1, "a": 2, "m": 3}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "done"}]},
    ]
    chat = to_chat(MessagesRequest.model_validate({"max_tokens": 4, "messages": turns}))
    assert chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"z": 1, "a": 2, "m": 3}'


# ------------------------------------------------------------------ streams open at once


def test_a_messages_stream_opens_and_pings_while_its_prompt_prefills(server):
    """message_start (with the prompt's input_tokens) arrives while the server still reports the
    request as prefilling, and pings follow until the first content block."""
    base, _ = server
    body = {
        "model": "m",
        "max_tokens": 4,
        "stream": True,
        "messages": _ask(_long_text(1500)),
        "temperature": 0,
    }
    with httpx.stream(
        "POST", base + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300
    ) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        seen = []
        for line in lines:
            seen.append(line)
            if line.startswith("data: ") and '"message_start"' in line:
                break
        health = httpx.get(base + "/health", timeout=10).json()
        rest = list(lines)
    events = _events(seen + rest)
    kinds = [name for name, _ in events]
    assert health["prefilling"] == 1 and health["busy"], health
    first_content = kinds.index("content_block_start")
    assert kinds[0] == "message_start" and kinds[1:first_content].count("ping") >= 2, kinds[:first_content]
    start_usage = events[0][1]["message"]["usage"]
    final_usage = events[-2][1]["usage"]
    assert start_usage["input_tokens"] == final_usage["input_tokens"] + final_usage["cache_read_input_tokens"]


def test_an_openai_chat_stream_opens_with_its_first_chunk_and_keeps_alive(server):
    base, _ = server
    body = {"messages": _ask(_long_text(1500, "chat")), "max_tokens": 3, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json=body, headers=headers, timeout=300
    ) as reply:
        lines = [line for line in reply.iter_lines() if line]
    first_content = next(
        i for i, line in enumerate(lines) if '"content": "' in line and '"content": ""' not in line
    )
    assert '"role": "assistant"' in lines[0]
    assert lines[1:first_content].count(": keep-alive") >= 2, lines[:first_content]
    # the openai client reads the same stream (comments skipped)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=300)
    short = {**body, "messages": _ask("Hi.")}
    chunks = list(
        client.chat.completions.create(model="m", **{k: v for k, v in short.items() if k != "model"})
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_stream_cancelled_during_prefill_is_logged_as_cancelled_and_health_goes_idle(server):
    base, log_path = server
    body = {"model": "m", "max_tokens": 4, "stream": True, "messages": _ask(_long_text(1500, "cancel"))}
    with httpx.stream(
        "POST", base + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=300
    ) as reply:
        for line in reply.iter_lines():
            if '"message_start"' in line:
                break
    wait_for(lambda: "(cancelled)" in log_path.read_text(), timeout=120)
    assert any(
        "/v1/messages 200" in line and "(cancelled)" in line for line in log_path.read_text().splitlines()
    )
    wait_for(lambda: not httpx.get(base + "/health", timeout=10).json()["busy"], timeout=120)
    health = httpx.get(base + "/health", timeout=10).json()
    assert (health["busy"], health["queued"], health["prefilling"], health["running"]) == (False, 0, 0, 0)


# ------------------------------------------------------------------ no replay storms


def test_a_responses_stream_cut_by_the_timeout_ends_incomplete_with_its_output(model_dir, tmp_path):
    """Codex sends no max_output_tokens; the reply runs into --request-timeout after its output
    began: the stream ends response.incomplete with the partial text (Codex reports it and does not
    retry), one request in the log."""
    log_path = tmp_path / "server.log"
    with running_server(model_dir, log_path, "--request-timeout", "3", "--responses-max-tokens", "4000") as (
        base,
        _,
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        # The worker measures its batch cost once at start (seconds; more on a loaded machine),
        # and requests wait meanwhile: warm up until a short one fits in the 3 s timeout.
        warm = {"messages": _ask("Hi."), "max_tokens": 2}  # another route: one responses line in the log
        headers = {"Authorization": f"Bearer {KEY}"}

        def warmed() -> bool:
            return httpx.post(
                base + "/v1/chat/completions", json=warm, headers=headers, timeout=60
            ).is_success

        wait_for(warmed, timeout=300)
        # The random model may sample an end-of-sequence token before the timeout (one CI run
        # ended `completed` so): the tokenizer's EOS ids are banned, so only the timeout ends it.
        events = list(
            client.responses.create(
                model="gpt-5-codex",
                input="Write a very long story.",
                stream=True,
                temperature=0.8,
                extra_body={"logit_bias": _eos_ban(model_dir)},
            )
        )
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        final = events[-1]
        assert final.type == "response.incomplete", kinds[-5:]
        assert final.response.incomplete_details.reason == "max_output_tokens"
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text and final.response.output[-1].content[0].text == text
        assert 0 < final.response.usage.output_tokens < 4000
        wait_for(lambda: "(timeout)" in log_path.read_text())
        lines = [line for line in log_path.read_text().splitlines() if "POST /v1/responses" in line]
    assert len(lines) == 1 and " 200 " in lines[0] and "(timeout)" in lines[0], lines
