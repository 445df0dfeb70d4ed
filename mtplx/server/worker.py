"""The generation worker: one thread owns the engine and decodes the admitted jobs together.

MLX work happens on this thread only; request handlers (asyncio) submit a `Job` to a bounded
queue (full: 429) and read its chunks from an asyncio queue the worker feeds thread-safely.

Continuous batching (`mtplx.engine.scheduler.BatchScheduler`): between two cycles the worker takes
queued jobs while fewer than ``decode_concurrency + prompt_concurrency`` are in flight (so the
next prompts prefill while the rows decode), and every cycle steps them all: a chunk of prefill
for up to ``prompt_concurrency`` waiting jobs, then one batched decode cycle for up to
``decode_concurrency`` rows. A job is cancelled (client gone, timeout) by setting its event;
the worker drops its row before the next cycle, which frees its memory.

Every job goes through the scheduler: a model whose caches do not batch is stepped one row at a
time (`BatchDecoder`'s single-row mode); a grammar job (response_format, tools), an adaptive or a
draft-model job joins the batch and speculates there, whatever else is in flight.

A failure that is not the request's own mistake (a bug, a damaged model; `mtplx.engine.failures`)
fails the requests it concerns at once, each with a 500 naming the stage (`JobFailed`), logs its
traceback once and counts it (/metrics' ``mtplx_worker_errors_total{stage}``, /health's
``worker_errors``); the worker serves on. A request's own failure (its start, prefill, first
draw, output, prompt-cache store, its rows' invalid values) ends it alone, the batch decoding
on; a step that raised elsewhere fails every request in flight and the worker builds a fresh
scheduler (the batch's state is in question); a scheduler that cannot be built (its setup: the
cost profile) fails the requests waiting for it, and the next request tries again. `serve --learn`'s
learner failing (stage ``learn``: recording a finished request, or a piece of training while idle,
raised out of it) fails no request: logged and counted once, the learner is set aside and the
worker serves on without it (a restart learns again).

Stop (SIGTERM, Ctrl-C): `stop` sets ``_stopping`` before its marker goes in the queue; the draft
policy's cost profile, measured by the first setup where none is saved (seconds), asks it between
two timed forwards and gives up (`MeasurementStopped`: nothing saved, one log line), so the
server exits at once instead of after the measurement. Test hook: with ``MTPLX_TEST_HOLD_MEASUREMENT``
set, the measurement waits at its first forward until the stop (a test stops it mid-way for sure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mtplx.engine.failures import FailedStage, reach
from mtplx.engine.output import GenerationChunk
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.server.metrics import ServerMetrics
from mtplx.spec_decode.draft_policy import MeasurementStopped
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP

import mlx.core as mx

DISK_DRAIN_SECONDS = 30.0  # at shutdown, how long queued prompt-cache writes may take to reach the disk

HOLD_MEASUREMENT_ENV = "MTPLX_TEST_HOLD_MEASUREMENT"  # test hook (module docstring)

log = logging.getLogger("mtplx.server")


class QueueFull(Exception):
    """The bounded queue is full; the request should be retried later."""


class JobTimeout(Exception):
    """The request ran past its deadline."""


class JobFailed(Exception):
    """An internal error while generating, at ``stage``; details are in the server log."""

    def __init__(self, stage: FailedStage):
        super().__init__(stage.doing)
        self.stage = stage


class Finished:
    """Sentinel: the job has emitted everything it will."""


class Admitted:
    """Sentinel: the job joined the batch (its prefill starts with the next cycle); a stream
    opens here, before the first token."""


@dataclass
class Job:
    prompt_tokens: list[int]
    request: GenerationRequest  # what to generate, built from the body over the served defaults
    deadline: float  # time.monotonic() after which generation stops
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    # `serve --learn`: what the traffic log records besides the tokens, (the grammar's API field or
    # None, whether tools were offered), when the request goes into it; else None.
    traffic_tags: tuple[str | None, bool] | None = None
    tokens_by_choice: dict[int, list[int]] = field(default_factory=dict)  # logged jobs only
    finish_by_choice: dict[int, str] = field(default_factory=dict)

    def emit(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def abort_reason(self) -> str:
        """/metrics' reason for ending it early: "timeout" once the deadline has passed (the app
        cancels a job whose deadline passed while it waited, so a cancel alone does not say why),
        else "cancelled" (the client went away)."""
        return "timeout" if time.monotonic() > self.deadline else "cancelled"


class GenerationWorker:
    """A bounded queue of jobs in front of one generation thread that batches them."""

    def __init__(
        self,
        engine,
        max_queue: int,
        decode_concurrency: int = 32,
        prompt_concurrency: int = 8,
        draft_policy: str = "auto",
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        learner=None,
    ):
        self.engine = engine
        self.learner = learner  # `mtplx.learn.serving.Learner` under `serve --learn`, else None
        self.decode_concurrency = decode_concurrency
        self.prompt_concurrency = prompt_concurrency
        self.draft_policy = draft_policy
        self.prefill_step_size = prefill_step_size
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="mtplx-generation", daemon=True)
        self._stopping = threading.Event()  # set by `stop`: a cost profile measurement gives up
        self._hold_measurement = bool(os.environ.get(HOLD_MEASUREMENT_ENV))
        self._active: dict[int, Job] = {}  # scheduler handle -> job, in flight
        self._held: Job | None = None  # taken from the queue while no scheduler could be built
        self._last_failure: BaseException | None = None  # this step's, logged and counted already
        self._choices_left: dict[int, int] = {}  # scheduler handle -> its choices not ended yet
        # Load, as the generation thread last saw it between cycles (/metrics reads it from others).
        self.running = 0  # rows decoding
        self._prefilling = 0  # jobs in the batch still prefilling
        self.memory = (0, 0, engine.prompt_cache.max_bytes)  # MLX active bytes, prompt cache bytes, its limit
        self.metrics = ServerMetrics(self, engine.prompt_cache.disk)
        if learner is not None:
            from mtplx.learn.serving import LearnCollector

            self.metrics.registry.register(LearnCollector(learner))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
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
        if self.engine.prompt_cache.disk is not None:  # entries queued for the disk reach it (bounded)
            self.engine.prompt_cache.disk.close(timeout=DISK_DRAIN_SECONDS)

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def waiting(self) -> int:
        return self.queued + self._prefilling

    @property
    def prefilling(self) -> int:
        return self._prefilling

    @property
    def errors(self) -> int:
        """Internal failures so far (each once, however many requests it failed)."""
        return self.metrics.worker_error_count

    @property
    def busy(self) -> bool:
        """Whether any request is queued or in flight now (read from other threads)."""
        return bool(self._active) or self.queued > 0

    def _note_load(self, scheduler) -> None:
        """Publish the load for /metrics (the prompt cache is not thread-safe: read it here)."""
        self.running, self._prefilling = scheduler.num_decoding, scheduler.num_waiting
        self._last_failure = None  # a step's failure is not held past it (its traceback holds arrays)
        cache = self.engine.prompt_cache
        self.memory = (mx.get_active_memory(), cache.nbytes, cache.max_bytes)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    # ------------------------------------------------------------------ the generation thread
    def _run(self) -> None:
        scheduler = self._set_up()
        try:
            while True:
                if scheduler is None:  # its setup failed or was stopped: try again for the next job
                    if self._stopping.is_set() or not self._hold_next_job():
                        return
                    scheduler = self._set_up()
                    # stopping: no 500s, the held job is dropped (the loop's top returns)
                    if (
                        scheduler is None
                        and not self._stopping.is_set()
                        and not self._fail_waiting(FailedStage.SETUP)
                    ):
                        return
                    continue
                if self._drive(scheduler):
                    return
                scheduler = self._set_up()  # after a failed step: a fresh batch
        finally:
            for job in [*self._active.values(), *([self._held] if self._held is not None else [])]:
                job.cancel()
                job.emit(Finished())
            if scheduler is not None:
                scheduler.close()

    def _set_up(self):
        """A fresh scheduler; None when building it failed (logged and counted)."""
        try:
            reach(FailedStage.SETUP)
            return self.engine.batch(
                self.decode_concurrency,
                self.prompt_concurrency,
                self.draft_policy,
                self.prefill_step_size,
                should_stop=self._stop_requested,
            )
        except MeasurementStopped:
            log.info("batch cost profile: measurement stopped (the server is stopping); nothing saved")
            return None
        except Exception as err:
            self._note_failure(err, FailedStage.SETUP)
            return None

    def _stop_requested(self) -> bool:
        """Whether `stop` was called (asked between the cost profile's timed forwards); under the
        test hook ``MTPLX_TEST_HOLD_MEASUREMENT`` it first waits for that."""
        if self._hold_measurement:
            self._stopping.wait()
        return self._stopping.is_set()

    def _hold_next_job(self) -> bool:
        """Wait for the next job and hold it for the next scheduler (`_take_jobs`); False at stop."""
        job = self._queue.get()
        self._held = job
        return job is not None

    def _fail_waiting(self, stage: FailedStage) -> bool:
        """Every job held or queued fails (a 500 naming ``stage``); False when the stop marker
        was among them."""
        self._held, jobs = None, [self._held]
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job is None:
                return False
            self._fail_job(job, stage)
        return True

    def _fail_job(self, job: Job, stage: FailedStage) -> None:
        self.metrics.abort("error")
        job.emit(JobFailed(stage))
        job.emit(Finished())

    def _note_failure(self, err: BaseException, stage: FailedStage) -> None:
        """An internal failure: its traceback in the log and a count in /metrics."""
        log.error("generation failed %s", stage.doing, exc_info=err)
        self.metrics.worker_error(stage)

    def _drive(self, scheduler) -> bool:
        """The scheduler's drive loop (`BatchScheduler.drive`) over the queue: before each step the
        queued jobs join and cancelled and late ones leave (`_before_step`); each result goes to
        its job. True at stop; False after a step that raised (a bug, not a user error: every job
        in flight failed, the scheduler dropped them; the worker goes on with a fresh one)."""
        drive = scheduler.drive(
            lambda _: self._note_load(scheduler), feed=lambda: self._before_step(scheduler)
        )
        try:
            with contextlib.closing(drive) as results:  # closed: the scheduler drops every row
                for result in results:
                    self._deliver(result)
        except Exception as err:
            self._last_failure = None
            self._note_failure(err, FailedStage.STEP)
            for handle in list(self._active):
                self.metrics.abort("error")
                self._active[handle].emit(JobFailed(FailedStage.STEP))
                self._end(handle)
            self.running = self._prefilling = 0
            return False
        return True

    def _before_step(self, scheduler) -> bool:
        """Queued jobs join (`_take_jobs`; False at stop), then cancelled and late jobs leave. With
        nothing in flight or waiting, `serve --learn`'s trainer does one bounded piece of work."""
        if not self._take_jobs(scheduler):
            return False
        if not self._active and self.learner is not None and self._queue.empty():
            self._learn(self.learner.work)
            return True
        now = time.monotonic()
        for handle, job in list(self._active.items()):
            late = now > job.deadline
            if job.cancelled.is_set() or late:
                if late and not job.cancelled.is_set():
                    job.emit(JobTimeout())
                self.metrics.abort("timeout" if late else "cancelled")
                scheduler.cancel(handle)
                self._end(handle)
        return True

    def _take_jobs(self, scheduler) -> bool:
        """Move queued jobs into the batch (waiting for one when nothing runs); False at stop."""
        capacity = self.decode_concurrency + self.prompt_concurrency
        while len(self._active) < capacity:
            idle_work = self.learner is not None and bool(self._learn(self.learner.has_work, hook=False))
            try:
                job = (
                    self._held
                    if self._held is not None
                    else self._queue.get(block=not self._active and not idle_work)
                )
            except queue.Empty:
                break
            self._held = None
            if job is None:
                return False
            if job.cancelled.is_set():
                self.metrics.abort(job.abort_reason())
                job.emit(Finished())
                continue
            if time.monotonic() > job.deadline:
                self.metrics.abort("timeout")
                job.emit(JobTimeout())
                job.emit(Finished())
                continue
            try:
                handle = scheduler.submit(job.prompt_tokens, job.request)
            except MtplxError as err:
                self.metrics.abort("error")
                job.emit(err)
                job.emit(Finished())
                continue
            except Exception as err:  # a bug: this request fails, the others go on
                self._note_failure(err, FailedStage.SUBMIT)
                self._fail_job(job, FailedStage.SUBMIT)
                continue
            self._active[handle] = job
            self._choices_left[handle] = job.request.n
            job.emit(Admitted())
        self._note_load(scheduler)
        return True

    def _deliver(self, result) -> None:
        """One scheduler result to its job: a chunk, or the error that ended it."""
        job = self._active.get(result.handle)
        if job is None:
            return
        error = result.error
        if error is not None and not isinstance(error, MtplxError):  # not the request's: a 500
            stage = result.stage or FailedStage.STEP
            if error is not self._last_failure:  # once, however many rows it ended (a cycle's)
                self._last_failure = error
                self._note_failure(error, stage)
            error = JobFailed(stage)
        if error is not None:
            self.metrics.abort("error")
            job.emit(error)
        else:
            self._send(job, result.chunk)
        if result.done:
            self._choice_done(result.handle, failed=error is not None)

    def _send(self, job: Job, chunk: GenerationChunk) -> None:
        self.metrics.observe(chunk)  # counts the request when this chunk ends it
        if job.traffic_tags is not None:
            tokens = job.tokens_by_choice.setdefault(chunk.index, [])
            tokens.extend(chunk.token_ids)
            if chunk.eos_token is not None:
                tokens.append(chunk.eos_token)
            if chunk.finish_reason is not None:
                job.finish_by_choice[chunk.index] = chunk.finish_reason
        job.emit(chunk)

    def _choice_done(self, handle: int, failed: bool) -> None:
        """A choice ended; the job ends with its last choice (or with an error: the scheduler
        has dropped its other choices)."""
        left = self._choices_left.get(handle, 1) - 1
        self._choices_left[handle] = left
        if failed or left <= 0:
            self._end(handle)

    def _end(self, handle: int) -> None:
        self._choices_left.pop(handle, None)
        job = self._active.pop(handle, None)
        if job is not None:
            self._record_traffic(job)
            job.emit(Finished())

    def _record_traffic(self, job: Job) -> None:
        """`serve --learn`: a request whose every choice finished goes into the traffic log."""
        if job.traffic_tags is None or self.learner is None or len(job.finish_by_choice) < job.request.n:
            return
        choices = sorted(job.tokens_by_choice)
        self._learn(
            self.learner.record,
            job.prompt_tokens,
            [job.tokens_by_choice[i] for i in choices],
            [job.finish_by_choice.get(i) for i in choices],
            *job.traffic_tags,
        )

    def _learn(self, call, *args, hook: bool = True) -> Any:
        """`serve --learn`: ``call`` (a `Learner` method) with ``args``; its result, or None when it
        raised. A failure out of the learner (`Learner.work` keeps a round's own failures) is no
        request's: its traceback is logged once, it counts as stage ``learn``, and the learner is set
        aside, so no request waits on it or fails with it. ``hook``: `reach` the test hook first."""
        try:
            if hook:
                reach(FailedStage.LEARN)
            return call(*args)
        except Exception as err:
            log.error(
                "--learn: failed; serving goes on without learning (a restart learns again)", exc_info=err
            )
            self.metrics.worker_error(FailedStage.LEARN)
            self.learner = None  # /metrics' learn collector keeps its last state
            return None
