"""Tool calling without a server: the prompt's rendering, the tool grammars on the default model's
tokenizer (llguidance's own matcher says what they accept), and the call extractor fed in pieces
of every size (a verify cycle may accept several tokens at once, a marker may be cut in two)."""

from __future__ import annotations

import json
from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.server.constraints import response_format_grammar, tool_grammar
from mtplx.server.schemas import Message, NamedToolChoice, ResponseFormat, Tool
from mtplx.server.tools import GENERIC_SYNTAX, CallExtractor, CallSyntax, merge_calls, render_chat

import pytest

WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
)
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "clock"}})

CALL_W = '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>'
CALL_C = '<tool_call>{"name":"clock","arguments":{}}</tool_call>'


@pytest.fixture(scope="module", params=["spelled", "one-token"])
def env(request, default_model_dir):
    """(accepts, syntax): whether a grammar accepts a whole text (llguidance's matcher on the
    default model's tokenizer, the way the engine compiles it), and the generic call syntax with
    that tokenizer's marker ids. "one-token" adds ``<tool_call>`` / ``</tool_call>`` as tokens (as
    Qwen's tokenizers have them), so the grammar must name the tokens rather than spell them."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_dir)
    if request.param == "one-token":
        hf.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tokenizer = llguidance.hf.from_tokenizer(hf)

    def accepts(grammar, text: str) -> bool:
        matcher = llguidance.LLMatcher(tokenizer, grammar.source)
        ids = hf.encode(text, add_special_tokens=False)
        if matcher.validate_tokens(ids) != len(ids):
            return False
        matcher.consume_tokens(ids)
        return matcher.is_accepting()

    def ids(marker: str) -> tuple[int, ...]:
        return tuple(hf.encode(marker, add_special_tokens=False))

    syntax = replace(GENERIC_SYNTAX, start_ids=ids("<tool_call>"), end_ids=ids("</tool_call>"))
    assert (len(syntax.start_ids) == 1) == (request.param == "one-token")
    return accepts, syntax, ids


@pytest.mark.parametrize(
    ("choice", "parallel", "accepted", "refused"),
    [
        (
            "auto",
            True,
            ["Plain text.", CALL_W, "Let me look." + CALL_W + "\n" + CALL_C],
            ['<tool_call>{"arguments":{},"name":"clock"}</tool_call>', "text <tool_call> then text"],
        ),
        (
            "required",
            True,
            [CALL_W, CALL_W + CALL_C],
            ["Plain text.", '<tool_call>{"name":"clock"}</tool_call>'],
        ),
        (
            "required",
            False,
            [CALL_C],
            [CALL_C + CALL_C, '<tool_call>{"name":"get_weather","arguments":{}}</tool_call>'],
        ),
        ("clock", True, [CALL_C], [CALL_W, CALL_C + CALL_C]),
    ],
)
def test_tool_grammars_accept_calls_and_only_calls(env, choice, parallel, accepted, refused):
    matcher_for, syntax, _ = env
    if choice == "clock":
        choice = NamedToolChoice.model_validate({"type": "function", "function": {"name": "clock"}})
    grammar = tool_grammar([WEATHER, CLOCK], choice, parallel, syntax, None)
    for text in accepted:
        assert matcher_for(grammar, text), text
    for text in refused:
        assert not matcher_for(grammar, text), text


def test_auto_with_a_response_format_replaces_free_text_by_the_schema(env):
    matcher_for, syntax, _ = env
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    grammar = tool_grammar([CLOCK], "auto", True, syntax, schema)
    assert matcher_for(grammar, '{"a":1}') and matcher_for(grammar, CALL_C)
    assert not matcher_for(grammar, "Plain text.") and not matcher_for(grammar, '{"a": 1}')


@pytest.mark.parametrize("opened", [False, True])
def test_a_reasoning_span_is_free_and_only_the_answer_is_constrained(env, opened):
    matcher_for, _, ids = env
    reasoning = ("<think>", "</think>", opened, ids("<think>"), ids("</think>"))
    fmt = ResponseFormat.model_validate({"type": "json_object"})
    grammar = response_format_grammar(fmt, reasoning)
    lead = "" if opened else "<think>"
    assert matcher_for(grammar, lead + 'Free {text}\n</think>{"a":1}')
    assert not matcher_for(grammar, lead + "Free text</think>not json")
    assert not matcher_for(grammar, lead + 'Free</think>{"a":1}</think>{"b":2}')  # one span only
    assert matcher_for(grammar, '{"a":1}') == (not opened)  # the span is optional unless opened


def test_bad_tool_parameters_and_unknown_named_tools_are_one_line_errors():
    bad = Tool.model_validate(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}
    )
    with pytest.raises(MtplxError, match=r"^tools\[0\]\.function\.parameters: .*nonsense"):
        tool_grammar([bad], "auto", True, GENERIC_SYNTAX, None)
    nope = NamedToolChoice.model_validate({"type": "function", "function": {"name": "nope"}})
    with pytest.raises(MtplxError, match=r"^tool_choice: no tool named 'nope' \(tools: clock\)"):
        tool_grammar([CLOCK], nope, True, GENERIC_SYNTAX, None)


REPLY = (
    "Checking." + CALL_W + "\n" + '<tool_call>{"name":"clock","arguments":{"tz":{"a":[1,"}"]}}}</tool_call>'
)
EXPECTED = [
    ("get_weather", {"city": "Paris"}),
    ("clock", {"tz": {"a": [1, "}"]}}),
]


def _feed_in_pieces(text: str, size: int, syntax: CallSyntax = GENERIC_SYNTAX):
    extractor = CallExtractor(syntax)
    content, deltas = "", []
    for i in range(0, len(text), size):
        c, d = extractor.feed(text[i : i + size])
        content, deltas = content + c, deltas + d
    c, d = extractor.finish()
    return content + c, deltas


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 13, 64, 1000])
def test_extractor_gives_the_same_calls_whatever_the_piece_size(size):
    content, deltas = _feed_in_pieces(REPLY, size)
    assert content == "Checking."
    calls = merge_calls(deltas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
    # The first fragment of each call carries its id and name; the others only arguments.
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert mine[0].id is not None and mine[0].name is not None
        assert all(d.id is None for d in mine[1:])
    if size == 1:  # arguments streamed as they were written, not at the end marker
        assert len([d for d in deltas if d.index == 0]) > 3


def test_extractor_without_calls_passes_text_through_and_holds_back_a_cut_marker():
    extractor = CallExtractor(GENERIC_SYNTAX)
    assert extractor.feed("a <tool") == ("a ", [])  # "<tool" may be a marker: held
    assert extractor.feed("box> b") == ("<toolbox> b", [])
    assert extractor.finish() == ("", []) and extractor.calls == 0


def test_a_call_cut_before_its_name_stays_content():
    content, deltas = _feed_in_pieces('Hi <tool_call>{"na', 4)
    assert content == 'Hi <tool_call>{"na' and deltas == []


def test_a_block_that_does_not_parse_stays_content():
    text = "a<tool_call>not json</tool_call>b" + CALL_C
    content, deltas = _feed_in_pieces(text, 4)
    assert content == "a<tool_call>not json</tool_call>b"
    assert [(d.index, d.name) for d in deltas if d.id] == [(0, "clock")]


def test_native_non_json_syntax_is_parsed_whole_by_mlx_lms_parser():
    from mlx_lm.tool_parsers import qwen3_coder

    syntax = CallSyntax(
        qwen3_coder.tool_call_start,
        qwen3_coder.tool_call_end,
        False,
        qwen3_coder.parse_tool_call,
        True,
        "qwen3_coder",
    )
    body = "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
    text = f"ok{syntax.start}{body}{syntax.end}"
    content, deltas = _feed_in_pieces(text, 3, syntax)
    assert content == "ok"
    assert len(deltas) == 1 and deltas[0].name == "get_weather"
    assert json.loads(deltas[0].arguments) == {"city": "Paris"}


def test_generic_rendering_declares_tools_and_writes_calls_and_results_as_turns():
    messages = [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Weather?"),
        Message.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "a",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'},
                    },
                    {"id": "b", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
                ],
            }
        ),
        Message(role="tool", content="rain", tool_call_id="a"),
        Message(role="tool", content="noon", tool_call_id="b"),
    ]
    rendered, template_tools = render_chat(None, messages, [WEATHER, CLOCK], GENERIC_SYNTAX)
    assert template_tools is None
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in rendered[0]["content"] and "<tool_call>" in rendered[0]["content"]
    assert rendered[2]["content"] == (
        '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
        '<tool_call>{"name":"clock","arguments":{}}</tool_call>'
    )
    assert (
        rendered[3]["content"] == "<tool_response>rain</tool_response>\n<tool_response>noon</tool_response>"
    )
