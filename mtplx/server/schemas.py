"""Request bodies of the OpenAI-compatible endpoints (pydantic), as the OpenAI API documents them.

Unknown fields are ignored (clients send many optional ones); fields we accept
are type-checked and range-checked here so a bad value is a 400 naming it.
Ranges follow the OpenAI API reference; sampler fields the API lacks (top_k,
min_p, repetition_penalty) follow mlx-lm's server. ``model`` may be omitted: the served model
answers (as with ``mlx_lm.server`` and ``llama-server``).

The agent fields (``response_format``, ``tools``, ``tool_choice``, assistant ``tool_calls`` and
``tool`` messages) have the OpenAI chat completions shapes; what they mean for generation is
`mtplx.server.tools` and `mtplx.server.constraints`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from mtplx.engine.request import MAX_CHOICES
from mtplx.spec_decode.settings import DRAFT_KINDS, MAX_DEPTH, Drafting
from mtplx.spec_decode.sources import DrafterKind

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

# OpenAI allows at most 20 alternatives per position.
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16
# OpenAI's function names: letters, digits, underscores and dashes, at most 64.
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class Speculative(BaseModel):
    """A request's own speculation, with llama-server's names: ``n_max`` the most drafts per cycle
    (0: none), ``n_min`` > 0 keeps the row drafting ``n_max`` every cycle (the cost policy may not
    take it to K = 0; without ``n_max``, ``n_min`` drafts every cycle), ``drafter`` one of the
    engine's drafter kinds ("none": plain AR)."""

    model_config = ConfigDict(extra="ignore")
    n_max: Annotated[StrictInt, Field(ge=0, le=MAX_DEPTH)] | None = None
    n_min: Annotated[StrictInt, Field(ge=0, le=MAX_DEPTH)] | None = None
    drafter: Literal[DRAFT_KINDS] | None = None

    @model_validator(mode="after")
    def _ordered(self) -> Speculative:
        if self.n_min is not None and self.n_max is not None and self.n_min > self.n_max:
            raise ValueError(f"n_min ({self.n_min}) must be <= n_max ({self.n_max})")
        return self


class MtplxOptions(BaseModel):
    """``"mtplx": {...}``, this server's own per-request options: ``learn`` false keeps the request
    out of the traffic log of ``serve --learn`` (`mtplx.learn`)."""

    model_config = ConfigDict(extra="ignore")
    learn: StrictBool | None = None


class SpeculationFields(BaseModel):
    """Speculation for one request (README, server section), on every route's body: mlx-lm's
    server spelling (``num_draft_tokens``: drafts per cycle, pinned) and llama-server's object;
    and ``mtplx`` (`MtplxOptions`), carried along the same way."""

    num_draft_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_DEPTH)] | None = None
    speculative: Speculative | None = None
    mtplx: MtplxOptions | None = None

    @model_validator(mode="after")
    def _one_draft_count(self) -> SpeculationFields:
        n_max = self.speculative.n_max if self.speculative is not None else None
        if self.num_draft_tokens is not None and n_max is not None and n_max != self.num_draft_tokens:
            raise ValueError(
                f"num_draft_tokens ({self.num_draft_tokens}) contradicts speculative.n_max ({n_max})"
            )
        drafter = self.speculative.drafter if self.speculative is not None else None
        count = self.num_draft_tokens if self.num_draft_tokens is not None else n_max
        conflict = Drafting.count_conflict(drafter, count)
        if conflict is not None:
            name = "num_draft_tokens" if self.num_draft_tokens is not None else "speculative.n_max"
            raise ValueError(f"{name}: {conflict} (speculative.drafter)")
        return self

    def drafting(self, served: Drafting) -> Drafting:
        """These fields over the served drafting: a draft count of 0 or drafter "none" is plain AR;
        ``num_draft_tokens`` or ``n_min`` > 0 pins the count (the batch's cost policy then drafts
        it every cycle, as for a seeded request)."""
        spec, count = self.speculative, self.num_draft_tokens
        if spec is None and count is None:
            return served
        n_max = count if count is not None else spec.n_max
        if n_max is None and spec is not None and spec.n_min:
            n_max = spec.n_min  # n_min alone: draft at least that many, every cycle
        named = spec is not None and spec.drafter is not None
        kind = spec.drafter if named else served.kind
        field = "speculative.drafter" if named else served.field
        if n_max == 0:
            return replace(served, kind=DrafterKind.NONE, depth=None, pinned=False, field=field)
        pinned = n_max is not None and (count is not None or bool(spec.n_min))
        depth = n_max if n_max is not None else served.depth
        return replace(served, kind=kind, depth=depth, pinned=pinned, field=field)

    def speculation(self) -> dict:
        """These fields as a chat completion body carries them (the ones given)."""
        out: dict = {}
        if self.num_draft_tokens is not None:
            out["num_draft_tokens"] = self.num_draft_tokens
        if self.speculative is not None:
            out["speculative"] = self.speculative.model_dump(exclude_none=True)
        if self.mtplx is not None:
            out["mtplx"] = self.mtplx.model_dump(exclude_none=True)
        return out


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")
    url: str  # a data URL, or a local file under the server's --image-dir (mtplx.server.images)
    detail: str | None = None


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["image_url"]
    image_url: ImageURL


# Content parts this server refuses in one line (it reads text and images).
REFUSED_PARTS = ("input_audio", "audio", "video", "video_url", "file", "input_file")
ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    arguments: str  # a JSON object, as text (what the model wrote)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat turn. ``content`` may be null only on an assistant turn that calls tools; a
    ``tool`` turn answers one call by its ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in REFUSED_PARTS:
                raise ValueError(f"content: {kind} parts are not supported (text and images only)")
        return data

    @model_validator(mode="after")
    def _turn_shape(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only on an assistant turn with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls are only allowed on assistant turns")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content
            if isinstance(self.content, str)
            else "".join(p.text for p in self.content if isinstance(p, TextPart))
        )

    def template_content(self, suffix: str = "") -> str | list[dict]:
        """What the chat template gets as this turn's content: its text then ``suffix``, or, with
        images, its parts in order (an image as ``{"type": "image"}``, its placeholder) then
        ``suffix`` as a text part."""
        if not isinstance(self.content, list) or not any(isinstance(p, ImagePart) for p in self.content):
            return self.text() + suffix
        parts = [
            {"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text}
            for p in self.content
        ]
        return parts + ([{"type": "text", "text": suffix}] if suffix else [])


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: StrictBool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class _SamplingRequest(SpeculationFields):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    seed: StrictInt | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None  # choices from one prefill
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return bias


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None


class CompletionRequest(_SamplingRequest):
    # A string, a list of token ids, or a one-element list of strings (n prompts is a batch: refused).
    prompt: str | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    best_of: StrictInt | None = None  # refused unless it equals n (`pipeline.check_common`)


# ------------------------------------------------------------------ the Responses API (/v1/responses)
# Shapes from the OpenAI API reference (Responses) and the `openai` client's
# ``types/responses``; what Codex sends is openai/codex codex-rs/codex-api/src/common.rs
# (``ResponsesApiRequest``). ``input`` items and ``tools`` stay loose dicts here: each is checked
# by its own model in `mtplx.server.responses`, so an error names the item (``input[3].call_id``).


class ResponsesTextFormat(BaseModel):
    """``text.format``: ``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "name", "schema", "strict"}`` (the schema sits on the format itself, not under ``json_schema``)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponsesTextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a schema')
        return self


class ResponsesText(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: ResponsesTextFormat | None = None
    verbosity: str | None = None  # accepted; a local model has no verbosity control


class ResponsesNamedTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None


class ResponsesRequest(SpeculationFields):
    """``POST /v1/responses``. Sampler fields beyond OpenAI's (top_k, min_p, the penalties, seed)
    are accepted as on chat completions. ``store`` defaults to true, as in OpenAI's API; the
    fields Codex sends that change nothing here (``include``, ``prompt_cache_key``, ``reasoning``,
    ``metadata``, ``user``, ``truncation``, ``service_tier``) are accepted and type-checked."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    input: Any  # a string or a list of items (objects); checked by `_input_shape`
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: StrictBool | None = None
    text: ResponsesText | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, lt=1.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    seed: StrictInt | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # as on chat
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    # Not a Responses API field; chat's clients may send it: refused unless 1, never ignored.
    n: Any = None

    @field_validator("n")
    @classmethod
    def _one_output(cls, value: Any) -> Any:
        if value is None or (type(value) is int and value == 1):
            return value
        raise ValueError(
            "a response has one output: 1 or leave it out (several: /v1/chat/completions with n)"
        )

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> str | list[dict[str, Any]]:
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            return value
        raise ValueError("must be a string or a list of input items (objects)")
