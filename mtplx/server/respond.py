"""Running one job for a route: submit it to the worker (429 when the queue is full), cancel it
when the client goes away or its deadline passes, and answer its chunks whole or as server-sent
events in the route's API (``fmt``: `ChatFormat`, `TextFormat`, `MessagesFormat`,
`ResponsesFormat`). Routes live in `mtplx.server.app`.

A stream opens when the worker admits its job into the batch (`Admitted`, before the prefill):
the headers and the opening events (``fmt.sse_open``) go out at once, then a keep-alive
(``fmt.sse_keepalive``: Anthropic's ``ping``, an SSE comment on the OpenAI routes) every
``--keepalive-interval`` seconds without an event (during the prefill, and while other requests'
prefill chunks hold the batch), so a prefill of minutes never looks like a dead connection. An error before admission is still an HTTP error; after it, an event.

How a request ended early is left in ``request.state.mtplx_outcome`` for the log line
("cancelled" when the client went away, "timeout", "error: <message>"): a stream's status is
200 once its headers are out, whatever happens after."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from mtplx.engine.engine import GenerationChunk
from mtplx.errors import MtplxError
from mtplx.server.openai import APIError
from mtplx.server.worker import Admitted, Finished, GenerationWorker, Job, JobFailed, JobTimeout, QueueFull
from mtplx.trunk.vision import ImageToken

from fastapi import Request
from fastapi.responses import StreamingResponse

__all__ = ["ResponseFormat", "event_stream", "respond"]


@runtime_checkable
class ResponseFormat(Protocol):
    """A route's API spelling of one job's chunks, whole or as server-sent events: `ChatFormat`,
    `TextFormat` (`mtplx.server.openai`), `MessagesFormat` (`mtplx.server.anthropic`),
    `ResponsesFormat` (`mtplx.server.responses`). ``respond`` calls nothing else on it."""

    def response(self, chunks: list[GenerationChunk]) -> dict:
        """The whole reply (a non-streamed request), from every chunk the job produced."""
        ...

    def sse_open(self) -> list[str]:
        """The events sent when the worker admits the job (before the prefill)."""
        ...

    def sse_keepalive(self) -> str:
        """The event sent after ``--keepalive-interval`` seconds without one."""
        ...

    def sse_chunk(self, chunk: GenerationChunk) -> list[str]:
        """The events for one chunk of tokens."""
        ...

    def sse_error(self, err: APIError) -> str:
        """The event for an error after the stream opened."""
        ...

    def sse_close(self, last: GenerationChunk | None, include_usage: bool, failed: bool) -> list[str]:
        """The closing events (usage where asked, the API's end marker)."""
        ...


_POLL_SECONDS = 0.5  # how often a waiting handler checks its job's deadline


def event_stream(events) -> StreamingResponse:
    """``events`` (strings, sync or async) as a server-sent-events response no proxy buffers."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class KeepAlive:
    """No item came within the keep-alive interval."""


async def _next_item(job: Job, keepalive: float | None = None):
    """The worker's next item (`Admitted` skipped), JobTimeout once the deadline passes first, or
    `KeepAlive` when ``keepalive`` seconds pass without one."""
    started = time.monotonic()
    while True:
        now = time.monotonic()
        remaining = job.deadline - now
        if remaining <= 0:
            job.cancel()
            return JobTimeout()
        wait = min(remaining, _POLL_SECONDS)
        if keepalive is not None:
            if now - started >= keepalive:
                return KeepAlive()
            wait = min(wait, keepalive - (now - started))
        try:
            item = await asyncio.wait_for(job.chunks.get(), timeout=wait)
        except asyncio.TimeoutError:
            continue
        if not isinstance(item, Admitted):
            return item


def _raise_for(item) -> None:
    if isinstance(item, MtplxError):
        raise APIError(400, str(item))
    if isinstance(item, JobTimeout):
        raise APIError(504, "request: ran past the server's request timeout", type="timeout", code="timeout")
    if isinstance(item, JobFailed):
        message = f"internal server error {item.stage.doing} (details in the server log)"
        raise APIError(500, message, type="server_error")


LEARN_HEADER = "x-mtplx-learn"  # "0", "false", "no" or "off": keep this request out of the traffic log


def learns(request: Request, body, prompt_tokens: list[int]) -> bool:
    """Whether a request goes into `serve --learn`'s traffic log: unless it opts out, by the body's
    ``"mtplx": {"learn": false}`` or the ``X-Mtplx-Learn: 0`` header, or its prompt holds an image
    (the log keeps token ids only: a round would train on the prompt without its image, another
    context than the one the model answered)."""
    if request.headers.get(LEARN_HEADER, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if any(isinstance(token, ImageToken) for token in prompt_tokens):
        return False
    options = getattr(body, "mtplx", None)
    return options is None or options.learn is not False


async def respond(request: Request, worker: GenerationWorker, job: Job, settings, fmt: ResponseFormat, body):
    """``job``'s reply in ``fmt``'s API: whole, or streamed when ``body.stream`` (module docstring)."""
    if worker.learner is not None and learns(request, body, job.prompt_tokens):
        grammar = job.request.grammar
        job.traffic_tags = (
            grammar.field if grammar is not None else None,
            bool(getattr(body, "tools", None)),
        )
    try:
        worker.submit(job)
    except QueueFull:
        raise APIError(
            429,
            f"server busy: {settings.max_queue} requests are already queued; retry later",
            type="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from None
    watcher = asyncio.create_task(_watch_disconnect(request, job))
    try:
        first = await (_admission(job) if body.stream else _next_item(job))
        _raise_for(first)
        if isinstance(first, Finished) and body.stream:  # cancelled while queued (client gone)
            raise APIError(499, "request: cancelled")
    except BaseException as err:
        job.cancel()
        watcher.cancel()
        _note_outcome(request, job, err)
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return event_stream(_sse(request, job, fmt, include_usage, watcher, settings.keepalive_interval))
    try:
        chunks = []
        item = first
        while not isinstance(item, Finished):
            _raise_for(item)
            chunks.append(item)
            item = await _next_item(job)
    finally:
        job.cancel()
        watcher.cancel()
    if not chunks:  # cancelled before the first token (client gone): nobody reads this
        raise APIError(499, "request: cancelled")
    request.state.mtplx_stats = chunks[-1].stats
    return fmt.response(chunks)


async def _admission(job: Job):
    """`Admitted` once the worker takes the job into the batch, or what ended it before that."""
    while True:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.cancel()
            return JobTimeout()
        try:
            return await asyncio.wait_for(job.chunks.get(), timeout=min(remaining, _POLL_SECONDS))
        except asyncio.TimeoutError:
            continue


def _note_outcome(request: Request, job: Job, err: BaseException | None) -> None:
    """Why the request ended early, for its log line (module docstring); nothing when it did not."""
    if isinstance(err, APIError):
        outcome = "timeout" if err.code == "timeout" else f"error: {err.message}"
    elif job.cancelled.is_set() or isinstance(err, asyncio.CancelledError):
        outcome = job.abort_reason()
    else:
        return
    request.state.mtplx_outcome = outcome


async def _sse(
    request: Request,
    job: Job,
    fmt: ResponseFormat,
    include_usage: bool,
    watcher: asyncio.Task,
    keepalive: float,
) -> AsyncIterator[str]:
    """The stream's events; ``fmt`` spells them in its API (`sse_open`, `sse_keepalive`,
    `sse_chunk`, `sse_error`, `sse_close`)."""
    last: GenerationChunk | None = None
    failed = False
    ended = False
    try:
        for event in fmt.sse_open():
            yield event
        item = await _next_item(job, keepalive)
        while not isinstance(item, Finished):
            if isinstance(item, KeepAlive):
                yield fmt.sse_keepalive()
                item = await _next_item(job, keepalive)
                continue
            try:
                _raise_for(item)
            except APIError as err:
                _note_outcome(request, job, err)
                yield fmt.sse_error(err)
                failed = True
                break
            last = item
            request.state.mtplx_stats = item.stats  # the log line counts what was generated, even if cut
            for event in fmt.sse_chunk(item):
                yield event
            item = await _next_item(job, keepalive)
        for event in fmt.sse_close(last, include_usage, failed):
            yield event
        ended = True
    finally:
        if not failed and (
            not ended or job.cancelled.is_set()
        ):  # the client went away, or the deadline passed
            _note_outcome(request, job, asyncio.CancelledError())
        job.cancel()
        watcher.cancel()
