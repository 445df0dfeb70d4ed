"""Tool and function names in request bodies are checked whole (`schemas.FUNCTION_NAME`): pydantic
runs the pattern with the Rust regex engine, whose ``$`` is the end of the text, so a name with a
final newline is refused where Python's ``re.match`` would have passed it. Pinned for each model that
uses the pattern (a switch to ``regex_engine="python-re"`` would fail here)."""

from __future__ import annotations

from mtplx.server import anthropic, responses_input, schemas

import pytest
from pydantic import ValidationError

MODELS = [
    (schemas.FunctionCall, {"arguments": "{}"}),
    (schemas.FunctionDefinition, {}),
    (anthropic.ToolUseBlock, {"type": "tool_use", "id": "t", "input": {}}),
    (anthropic.ToolDefinition, {"input_schema": {}}),
    (responses_input._FunctionCallItem, {"call_id": "c", "arguments": "{}"}),
    (responses_input._FunctionTool, {"type": "function"}),
]


@pytest.mark.parametrize("model,rest", MODELS, ids=[m.__name__ for m, _ in MODELS])
def test_a_function_name_is_the_whole_text(model, rest):
    assert model.model_validate({**rest, "name": "get_weather-2"}).name == "get_weather-2"
    for odd in ("get_weather\n", "get_weather\r\n", "\nget_weather", "get wéather", "x" * 65):
        with pytest.raises(ValidationError):
            model.model_validate({**rest, "name": odd})
