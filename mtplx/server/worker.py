"""The generation worker: one thread owns the engine and serves jobs first-in first-out.

MLX work happens on this thread only; request handlers (asyncio) submit a `Job`
and read its chunks from an asyncio queue the worker feeds thread-safely. A
job is cancelled (client gone, timeout) by setting its event; the worker sees
it after the current decode cycle and closes the stream, which leaves the
engine's caches consistent (see Engine.stream). Batched decoding later
replaces `_serve` with a loop that steps several jobs per forward; the
submit / chunk-queue / cancel contract stays.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError

log = logging.getLogger("mtplx.server")


class QueueFull(Exception):
    """The bounded queue is full; the request should be retried later."""


class JobTimeout(Exception):
    """The request ran past its deadline."""


class JobFailed(Exception):
    """An internal error while generating; details are in the server log."""


class Finished:
    """Sentinel: the job has emitted everything it will."""


@dataclass
class Job:
    prompt_tokens: list[int]
    request: GenerationRequest  # what to generate, built from the body over the served defaults
    deadline: float  # time.monotonic() after which generation stops
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class GenerationWorker:
    """A FIFO queue of jobs (bounded) in front of one generation thread."""

    def __init__(self, engine, max_queue: int):
        self.engine = engine
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="mtplx-generation", daemon=True)
        self.busy = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        # The stop marker goes in even when the queue is full: waiting jobs are dropped at shutdown.
        while True:
            try:
                self._queue.put_nowait(None)
                break
            except queue.Full:
                job = self._queue.get_nowait()
                if job is not None:
                    job.cancel()
                    job.emit(Finished())
        self._thread.join(timeout=10)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.busy = True
            try:
                self._serve(job)
            finally:
                self.busy = False
                job.emit(Finished())

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        if time.monotonic() > job.deadline:
            job.emit(JobTimeout())
            return
        try:
            stream = self.engine.stream(job.prompt_tokens, job.request)
            try:
                for chunk in stream:
                    job.emit(chunk)
                    if job.cancelled.is_set() or chunk.finish_reason is not None:
                        break
                    if time.monotonic() > job.deadline:
                        job.emit(JobTimeout())
                        break
            finally:
                stream.close()
        except MtplxError as err:
            job.emit(err)
        except Exception:
            log.exception("generation failed")
            job.emit(JobFailed())
