"""The pipeline every generation route runs (routes in `mtplx.server.app`).

Check the body (`check_common`), plan and encode its prompt (`encode`, or `chat_prompt` for a
chat: images checked and expanded), then `generate`: the job (`make_job`: limits against the
context, the body's sampler fields over the served defaults) queued on the worker and answered
in the route's `ResponseFormat` (`mtplx.server.respond`). Responses builds its job under its own
error renaming (`responses_input.responses_error`), then answers through `respond` as
`generate` does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from mtplx.engine.grammar_spec import Grammar
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.server.chat import ChatPlan, plan_chat
from mtplx.server.images import check_images, expand_images
from mtplx.server.openai import APIError
from mtplx.server.respond import ResponseFormat, respond
from mtplx.server.schemas import ChatCompletionRequest
from mtplx.server.settings import ServerSettings
from mtplx.server.worker import GenerationWorker, Job

from fastapi import Request
from starlette.concurrency import run_in_threadpool


def check_model(name: str, settings: ServerSettings) -> None:
    """Any name is the loaded model unless ``--served-model-name`` lists the names it answers to.
    The name is compared, never resolved: a request cannot make the server load or read anything."""
    if settings.served_names and name not in settings.served_names:
        names = ", ".join(repr(n) for n in settings.served_names)
        raise APIError(
            404,
            f"model: {name!r} is not served here (this server serves {names})",
            param="model",
            code="model_not_found",
        )


def check_common(body, settings: ServerSettings) -> None:
    if body.model is not None:  # omitted: the served model answers (as mlx_lm.server, llama-server)
        check_model(body.model, settings)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        message = f"best_of: not supported (got {best_of}); n returns every choice as sampled"
        raise APIError(400, message, param="best_of")
    check_cap(getattr(body, "max_completion_tokens", None) or body.max_tokens, settings, "max_tokens")


def check_cap(requested: int | None, settings: ServerSettings, param: str) -> None:
    """A 400 naming ``param`` when a request asks for more tokens than ``--max-tokens-cap``."""
    if requested is not None and requested > settings.max_tokens_cap:
        message = f"{param}: {requested} exceeds this server's cap of {settings.max_tokens_cap}"
        raise APIError(400, message, param=param)


async def chat_prompt(
    engine, chat: ChatCompletionRequest, settings: ServerSettings, constrain: bool = True
) -> tuple[ChatPlan, list[int]]:
    """A chat body's plan (`plan_chat`) and its prompt ids, image placeholders expanded (a 400 for
    images the model cannot take, before the template renders them)."""
    check_images(engine, chat.messages)
    plan = plan_chat(engine.tokenizer, chat, constrain=constrain)
    tokens = await encode(engine, plan.messages, "messages", plan.template_tools)
    return plan, await expand_images(engine, chat.messages, tokens, settings.image_dir)


async def generate(
    request: Request,
    worker: GenerationWorker,
    settings: ServerSettings,
    body,
    prompt_tokens: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    grammar: Grammar | None,
    fmt: ResponseFormat,
):
    """The job for ``body`` over ``prompt_tokens``, queued on the worker and answered in ``fmt``."""
    job = make_job(worker.engine, body, prompt_tokens, max_tokens, logprobs, settings, grammar)
    return await respond(request, worker, job, settings, fmt, body)


async def encode(engine, prompt, param: str, tools: list[dict] | None = None) -> list[int]:
    """``prompt``'s ids, off the event loop: text, or messages through the chat template (``tools``
    through the template's own ``tools=``, a chat plan's ``template_tools``); a 400 naming ``param``."""
    try:
        return await run_in_threadpool(engine.encode_prompt, prompt, isinstance(prompt, list), tools)
    except MtplxError as err:
        raise APIError(400, str(err), param=param) from None


def make_job(
    engine,
    body,
    prompt_tokens: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    settings,
    grammar: Grammar | None = None,
) -> Job:
    context = engine.context_length
    if max_tokens is None:  # the default, never past the operator's cap
        max_tokens = min(settings.default_max_tokens, settings.max_tokens_cap)
        if context is not None:
            max_tokens = min(max_tokens, context - len(prompt_tokens))
    if context is not None and (max_tokens < 1 or len(prompt_tokens) + max_tokens > context):
        field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise APIError(
            400,
            f"{field}: {len(prompt_tokens)} tokens + max_tokens {max_tokens} exceed the model's "
            f"context of {context} tokens",
            param=field,
            code="context_length_exceeded",
        )
    bias = None
    if body.logit_bias:
        vocab = engine.trunk.vocab_size
        bias = {int(k): v for k, v in body.logit_bias.items()}
        outside = [k for k in bias if k >= vocab]
        if outside:
            raise APIError(
                400,
                f"logit_bias: token id {outside[0]} is outside the vocabulary of {vocab}",
                param="logit_bias",
            )
    request = replace(_request(body, settings.defaults, max_tokens, logprobs, bias), grammar=grammar)
    deadline = time.monotonic() + settings.request_timeout
    return Job(prompt_tokens, request, deadline, asyncio.get_running_loop())


_SAMPLER_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _request(
    body, defaults: GenerationRequest, max_tokens: int, logprobs: int | None, bias: dict[int, float] | None
) -> GenerationRequest:
    """The body's fields over the served defaults; a bad combination is a 400 now, not after queueing."""
    given = {name: getattr(body, name) for name in _SAMPLER_FIELDS if getattr(body, name) is not None}
    try:
        sampler = replace(defaults.sampler, **given, logit_bias=bias)
        return replace(
            defaults,
            sampler=sampler,
            max_tokens=max_tokens,
            seed=body.seed if body.seed is not None else defaults.seed,
            stop=body.stop or (),
            logprobs=logprobs,
            drafting=body.drafting(defaults.drafting),
            n=getattr(body, "n", None) or 1,
        )
    except MtplxError as err:
        field, _, rest = str(err).partition(" ")  # the messages start with the field's API name
        if field in _SAMPLER_FIELDS or field in ("seed", "logit_bias", "stop", "max_tokens", "n", "logprobs"):
            raise APIError(400, f"{field}: {rest}", param=field) from None
        raise APIError(400, str(err)) from None
