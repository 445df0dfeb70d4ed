"""The OpenAI-compatible HTTP API (FastAPI): routes, validation, queueing, streaming.

The wire format (response bodies, stream chunks, error bodies) is `mtplx.server.openai`.

Route shapes follow the OpenAI API reference (chat completions, completions,
models, responses) and vLLM's server for the details it settles (logprobs are the raw
target log-probabilities; an error after streaming began is sent as a final
``data: {"error": ...}`` event). Generation runs on `GenerationWorker`'s thread;
handlers only validate, tokenize, queue and format.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time

from mtplx.engine.engine import GenerationStats
from mtplx.errors import MtplxError
from mtplx.server.anthropic import (
    CountTokensRequest,
    MessagesFormat,
    MessagesRequest,
    prompt_too_long,
    to_chat,
)
from mtplx.server.anthropic import error_body as anthropic_error
from mtplx.server.constraints import response_format_grammar
from mtplx.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mtplx.server.openai import APIError, ChatFormat, TextFormat, error_body
from mtplx.server.pipeline import (
    chat_prompt,
    check_cap,
    check_common,
    check_model,
    encode,
    generate,
    make_job,
)
from mtplx.server.respond import event_stream, respond
from mtplx.server.responses import ResponsesFormat, ResponseStore
from mtplx.server.responses_input import responses_error
from mtplx.server.responses_input import to_chat as responses_to_chat
from mtplx.server.schemas import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from mtplx.server.settings import ServerSettings
from mtplx.server.validation import SURROGATE_ESCAPE, first_problem, unpaired_surrogate
from mtplx.server.worker import GenerationWorker

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("mtplx.server")


class _BodyTooLarge(Exception):
    pass


class LimitsAndLogMiddleware:
    """Body size limit (413, before any handler reads it) and one log line per request.

    A pure ASGI middleware: it sees the declared Content-Length and every body
    chunk, and the response status. Handlers leave generation stats in
    ``scope["state"]["mtplx_stats"]`` for the log line.
    """

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500, "started": False}
        limit = self.max_body_bytes
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
            await send(message)

        declared = dict(scope.get("headers") or []).get(b"content-length")
        try:
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _BodyTooLarge
            await self.app(scope, limited_receive, recording_send)
        except _BodyTooLarge:
            if not status["started"]:
                message = f"request body: larger than the limit of {limit} bytes"
                body = error_body(message, "invalid_request_error", None, "body_too_large")
                if str(scope.get("path", "")).startswith("/v1/messages"):
                    body = anthropic_error(413, message)
                await JSONResponse(body, 413)(scope, receive, recording_send)
        finally:
            _log_request(scope, status["code"], time.perf_counter() - start)


def _log_request(scope, status: int, seconds: float) -> None:
    state = scope.get("state") or {}
    stats: GenerationStats | None = state.get("mtplx_stats")
    line = f"{scope.get('method', '')} {scope.get('path', '')} {status} {seconds:.2f}s"
    if state.get("mtplx_outcome"):  # a stream's status is 200 once it opened; how it really ended
        line += f" ({state['mtplx_outcome']})"
    if stats is not None:
        line += (
            f" prompt={stats.prompt_tokens} cached={stats.cached_tokens} completion={stats.generated_tokens}"
            f" {stats.decode_tokens_per_sec:.1f} tok/s {stats.tokens_per_cycle:.2f} tok/cycle"
        )
    log.info(line)


# ------------------------------------------------------------------ app


def create_app(worker: GenerationWorker, settings: ServerSettings) -> FastAPI:
    """The app: error handlers (each API's error shape), /health and /metrics, the /v1 routes behind
    the API key, then the body-limit, log and CORS middleware."""
    app = FastAPI(title="mtplx", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker = worker
    _install_error_handlers(app)
    check_key = _key_check(settings)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])
    _add_service_routes(app, v1, worker, settings, check_key)
    _add_generation_routes(v1, worker, settings)
    app.include_router(v1)
    _install_middleware(app, settings)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every failure as the route's API shapes it: ours (APIError, MtplxError), validation, HTTP, internal."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error_response(request, err)

    @app.exception_handler(MtplxError)
    async def _mtplx_error(request: Request, err: MtplxError):
        return _error_response(request, APIError(400, str(err), param=_field_of(str(err))))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        errors = err.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _error_response(request, APIError(400, "request body: not valid JSON"))
        located = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in errors]  # less FastAPI's "body"
        param, reason = first_problem(located, err.body)
        return _error_response(request, APIError(400, f"{param or 'request body'}: {reason}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        if err.status_code == 404:
            message = f"route: {request.url.path} does not exist"
            return _error_response(request, APIError(404, message, code="not_found"))
        if err.status_code == 400:  # FastAPI's "There was an error parsing the body": bytes, not JSON
            message = "request body: not valid JSON (UTF-8 text, nested at most about a thousand deep)"
            return _error_response(request, APIError(400, message))
        return _error_response(request, APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception):
        log.error("internal error on %s", request.url.path, exc_info=err)
        message = "internal server error (details in the server log)"
        return _error_response(request, APIError(500, message, type="server_error"))


def _unicode_text(model: type[BaseModel]):
    """A route dependency: a 400 naming the field (of ``model``: unknown fields are ignored anyway)
    whose string holds an unpaired UTF-16 surrogate. JSON can escape one (``"\\ud800"``), but it
    is no Unicode text, and the tokenizer cannot encode it."""
    fields = {info.alias or name for name, info in model.model_fields.items()}

    async def check(request: Request) -> None:
        raw = await request.body()
        if not SURROGATE_ESCAPE.search(raw):  # the usual case: no surrogate escape at all
            return
        try:
            body = json.loads(raw)
        except ValueError:
            return  # not JSON: the body's validation says so
        if not isinstance(body, dict):
            return
        where = unpaired_surrogate({k: v for k, v in body.items() if k in fields})
        if where is not None:
            message = f"{where}: holds an unpaired UTF-16 surrogate (not Unicode text)"
            raise APIError(400, message, param=where)

    return [Depends(check)]


def _key_check(settings: ServerSettings):
    """The dependency that guards /v1 and /metrics (None key: open)."""

    def check_key(request: Request) -> None:
        """``Authorization: Bearer <key>`` (OpenAI clients) or ``x-api-key: <key>`` (Anthropic's)."""
        if settings.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
            raise APIError(
                401, "api key: missing or invalid", type="authentication_error", code="invalid_api_key"
            )

    return check_key


def _add_service_routes(
    app: FastAPI, v1: APIRouter, worker: GenerationWorker, settings: ServerSettings, check_key
) -> None:
    """/health, /metrics and the model list."""
    created = int(time.time())

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():
        """Claude Code probes ``HEAD /`` before its first request."""
        return {"status": "ok", "model": settings.model_id}

    @app.get("/health")
    async def health():
        """``busy``: a request is queued or in flight now; ``prefilling``: admitted, no token yet;
        ``worker_errors``: internal failures so far (each failed the requests it concerned, a --learn
        learner's none; the worker served on)."""
        return {
            "status": "ok",
            "model": settings.model_id,
            "queued": worker.queued,
            "busy": worker.busy,
            "prefilling": worker.prefilling,
            "running": worker.running,
            "worker_errors": worker.errors,
        }

    @app.get("/metrics", dependencies=[Depends(check_key)])
    async def metrics():
        """Prometheus' text format (`mtplx.server.metrics`); behind the API key like /v1."""
        return Response(worker.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card(settings.model_id, created)]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id, settings)
        return _model_card(settings.model_id, created)


def _add_generation_routes(v1: APIRouter, worker: GenerationWorker, settings: ServerSettings) -> None:
    """The OpenAI (chat, completions, responses) and Anthropic (messages, count_tokens) routes: each
    plans a chat or text prompt and queues one job on the worker."""
    engine = worker.engine

    @v1.post("/chat/completions", dependencies=_unicode_text(ChatCompletionRequest))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_common(body, settings)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        plan, prompt_tokens = await chat_prompt(engine, body, settings)
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        fmt = ChatFormat(engine, settings.model_id, plan.reader, n=body.n or 1)
        return await generate(
            request, worker, settings, body, prompt_tokens, max_tokens, logprobs, plan.grammar, fmt
        )

    @v1.post("/completions", dependencies=_unicode_text(CompletionRequest))
    async def completions(body: CompletionRequest, request: Request):
        check_common(body, settings)
        grammar = response_format_grammar(body.response_format)
        prompt_tokens = await encode(engine, _one_prompt(body), "prompt")
        fmt = TextFormat(engine, settings.model_id, n=body.n or 1)
        return await generate(
            request, worker, settings, body, prompt_tokens, body.max_tokens, body.logprobs, grammar, fmt
        )

    @v1.post("/messages", dependencies=_unicode_text(MessagesRequest))
    async def messages(body: MessagesRequest, request: Request):
        chat = _chat_of(body, settings.max_tokens_cap)
        check_common(chat, settings)
        plan, prompt_tokens = await chat_prompt(engine, chat, settings)
        max_tokens = _messages_max_tokens(engine, chat.max_tokens, len(prompt_tokens))
        fmt = MessagesFormat(
            settings.model_id, plan.reader(), engine.tokenizer, body.stop_sequences, len(prompt_tokens)
        )
        return await generate(
            request, worker, settings, chat, prompt_tokens, max_tokens, None, plan.grammar, fmt
        )

    store = ResponseStore(settings.responses_store_size)

    @v1.post("/responses", dependencies=_unicode_text(ResponsesRequest))
    async def responses(body: ResponsesRequest, request: Request):
        return await _responses(request, body, worker, settings, store)

    @v1.post("/messages/count_tokens", dependencies=_unicode_text(CountTokensRequest))
    async def count_tokens(body: CountTokensRequest):
        chat = _chat_of(body)
        if chat.model is not None:
            check_model(chat.model, settings)
        _, tokens = await chat_prompt(engine, chat, settings, constrain=False)
        return {"input_tokens": len(tokens)}


def _one_prompt(body: CompletionRequest) -> str | list[int]:
    """A completion body's prompt: text, or token ids; a list of one text is that text (a 400 for
    several, or for an empty one)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "prompt: only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and not prompt:
        raise APIError(400, "prompt: is empty", param="prompt")
    return prompt


def _install_middleware(app: FastAPI, settings: ServerSettings) -> None:
    app.add_middleware(LimitsAndLogMiddleware, max_body_bytes=settings.max_body_bytes)
    if settings.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )


def _error_response(request: Request, err: APIError) -> JSONResponse:
    """``err`` in the shape of the API the route belongs to (Anthropic's under /v1/messages)."""
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error(err.status, err.message), err.status, headers=err.headers)
    return err.response()


def _chat_of(
    body: MessagesRequest | CountTokensRequest, max_tokens_cap: int | None = None
) -> ChatCompletionRequest:
    """An Anthropic body as the chat completion it asks for (`mtplx.server.anthropic.to_chat`)."""
    chat = to_chat(body, max_tokens_cap)
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as err:
        where, reason = first_problem(err.errors(), chat)
        raise APIError(400, f"{where or 'request body'}: {reason}", param=where) from None


_FIELD = re.compile(r"^([a-z_][\w.\[\]]*): ")


def _field_of(message: str) -> str | None:
    """The API field an error message starts with (``response_format: ...``), if any."""
    found = _FIELD.match(message)
    return found.group(1) if found else None


def _model_card(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "mtplx"}


def _agent_max_tokens(engine, settings: ServerSettings, prompt_length: int) -> int:
    """``max_output_tokens`` when the body leaves it out: ``--responses-max-tokens`` (4096), at
    most ``--max-tokens-cap`` and what is left of the context. A coding agent (Codex) never sends
    it and writes whole files in one call, so chat's 512 would cut such a reply mid-call; the rest
    of the context would let one reply run past ``--request-timeout`` on a slow machine."""
    context = engine.context_length
    cap = min(settings.max_tokens_cap, settings.responses_default_max_tokens)
    return cap if context is None else min(cap, context - prompt_length)


def _messages_max_tokens(engine, max_tokens: int, prompt_length: int) -> int:
    """An Anthropic ``max_tokens`` (already at most ``--max-tokens-cap``) lowered to what the
    context leaves: a bound, not a demand (Claude Code asks for 32k-64k whatever the model). A
    prompt that alone fills the context is Anthropic's own error, which clients recognise."""
    context = engine.context_length
    if context is None:
        return max_tokens
    if prompt_length >= context:
        raise APIError(400, prompt_too_long(prompt_length, context), param="messages")
    return min(max_tokens, context - prompt_length)


async def _responses(request: Request, body: ResponsesRequest, worker, settings, store: ResponseStore):
    """``POST /v1/responses``: the body as a chat request (`mtplx.server.responses_input`) on the
    chat path; a prompt that does not fit a streamed request is a ``response.failed`` stream."""
    engine = worker.engine
    if body.model is not None:
        check_model(body.model, settings)
    requested = body.max_output_tokens
    check_cap(requested, settings, "max_output_tokens")
    history: list[dict] = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id)
        if found is None:
            message = (
                f"previous_response_id: no stored response {body.previous_response_id!r} (this server "
                f"keeps the last {store.capacity} responses made with store: true, in memory)"
            )
            raise APIError(400, message, param="previous_response_id")
        history = found
    turn = responses_to_chat(body, history, requested)
    try:
        chat = ChatCompletionRequest.model_validate(turn.chat)
        plan, prompt_tokens = await chat_prompt(engine, chat, settings)
        context = engine.context_length
        if requested is None and context is not None and len(prompt_tokens) >= context:
            message = f"input: {len(prompt_tokens)} tokens leave no room in the model's context of {context}"
            raise APIError(400, message, param="input", code="context_length_exceeded")
        max_tokens = requested or _agent_max_tokens(engine, settings, len(prompt_tokens))
        job = make_job(engine, chat, prompt_tokens, max_tokens, None, settings, plan.grammar)
    except (APIError, MtplxError, ValidationError) as err:
        renamed = responses_error(err, turn.tool_index)
        if body.stream and renamed.code == "context_length_exceeded":
            fmt = ResponsesFormat(body, settings.model_id, None, engine.tokenizer, None)
            return event_stream(iter(fmt.failed_events(renamed)))
        raise renamed from None
    kept = (store, turn.turns) if body.store else None
    fmt = ResponsesFormat(body, settings.model_id, plan.reader(), engine.tokenizer, kept)
    return await respond(request, worker, job, settings, fmt, chat)
