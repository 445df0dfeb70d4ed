"""Running one job for a route: submit it to the worker (429 when the queue is full), cancel it
when the client goes away or its deadline passes, and answer its chunks whole or as server-sent
events in the route's API (``fmt``: `ChatFormat`, `TextFormat`, `MessagesFormat`,
`ResponsesFormat`). Routes live in `mtplx.server.app`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from mtplx.engine.engine import GenerationChunk
from mtplx.errors import MtplxError
from mtplx.server.openai import APIError
from mtplx.server.worker import Finished, GenerationWorker, Job, JobFailed, JobTimeout, QueueFull

from fastapi import Request
from fastapi.responses import StreamingResponse

__all__ = ["respond"]

_POLL_SECONDS = 0.5  # how often a waiting handler checks its job's deadline


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


async def _next_item(job: Job):
    """The worker's next item, or JobTimeout once the deadline passes first."""
    while True:
        remaining = job.deadline - time.monotonic()
        if remaining <= 0:
            job.cancel()
            return JobTimeout()
        try:
            return await asyncio.wait_for(job.chunks.get(), timeout=min(remaining, _POLL_SECONDS))
        except asyncio.TimeoutError:
            continue


def _raise_for(item) -> None:
    if isinstance(item, MtplxError):
        raise APIError(400, str(item))
    if isinstance(item, JobTimeout):
        raise APIError(504, "request: ran past the server's request timeout", type="timeout", code="timeout")
    if isinstance(item, JobFailed):
        raise APIError(500, "internal server error (details in the server log)", type="server_error")


async def respond(request: Request, worker: GenerationWorker, job: Job, settings, fmt, body):
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
        first = await _next_item(job)
        _raise_for(first)
    except BaseException:
        job.cancel()
        watcher.cancel()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(request, job, first, fmt, include_usage, watcher),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
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


async def _sse(
    request: Request, job: Job, first, fmt, include_usage: bool, watcher: asyncio.Task
) -> AsyncIterator[str]:
    """The stream's events; ``fmt`` spells them in its API (`sse_open`, `sse_chunk`, `sse_error`,
    `sse_close`)."""
    item = first
    last: GenerationChunk | None = None
    failed = False
    try:
        for event in fmt.sse_open():
            yield event
        while not isinstance(item, Finished):
            try:
                _raise_for(item)
            except APIError as err:
                yield fmt.sse_error(err)
                failed = True
                break
            last = item
            request.state.mtplx_stats = item.stats  # the log line counts what was generated, even if cut
            for event in fmt.sse_chunk(item):
                yield event
            item = await _next_item(job)
        for event in fmt.sse_close(last, include_usage, failed):
            yield event
    finally:
        job.cancel()
        watcher.cancel()
