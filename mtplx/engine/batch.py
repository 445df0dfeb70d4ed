"""`BatchScheduler`: many requests decoding together on one engine (continuous batching).

Requests are submitted at any time (`submit`). Each `step`:
  1. prefills waiting requests, first come first served, at most ``prompt_concurrency`` of them
     and ``prefill_step_size`` prompt tokens in all per step, so long prompts stall the running
     rows by one chunk per cycle, never by their whole length, while short ones join at once;
  2. admits prefilled requests while fewer than ``max_rows`` decode (the admission draws the
     request's first token);
  3. runs one cycle of the batched loop (`mtplx.spec_decode.batch.BatchDecoder`) for every
     decoding row;
and returns each request's new `GenerationChunk` (from `RequestOutput`, the same stop rules as a
single stream). Requests that end (EOS, stop string, max_tokens) or are cancelled leave before
the next cycle, their caches going to the prompt cache as a single stream's do.

A grammar request (``request.grammar``) joins like any other: its matcher is compiled here and the
row speculates under it (`mtplx.spec_decode.batch`, "Grammar rows": forced tokens, masked drafts).
A request runs here when `Engine.batch_refusal` has nothing against it: a sharded engine needs the
single-stream loop (`Engine.stream`), and so do models whose caches cannot be batched
(sliding-window, quantized KV; heads that read the trunk's cache). Adaptive head drafting, grammar
requests and draft-model requests (each row drafting with its own proposer) decode here.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from mtplx.engine.output import GenerationChunk, RequestOutput
from mtplx.engine.request import GenerationRequest
from mtplx.engine.session import CacheSession, open_session
from mtplx.errors import MtplxError
from mtplx.spec_decode.batch import BatchDecoder, PendingRow, RowsFailed, RowSpec
from mtplx.spec_decode.draft_policy import DraftPolicy
from mtplx.spec_decode.select import batch_drafter
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP
from mtplx.spec_decode.step import PromptPrefix

__all__ = ["BatchScheduler", "StepTiming", "run_to_completion", "stream_of"]


@dataclass
class _Job:
    handle: int
    session: CacheSession
    output: RequestOutput
    pending: PendingRow | None  # while prefilling
    row_id: int | None = None  # once decoding
    cancelled: bool = False


@dataclass
class StepResult:
    """What one request got from a step: a chunk, or the error that ended it (an `MtplxError`
    for the request's own mistakes; `RowsFailed` or ValueError for invalid values the model
    produced, NaN logits: a fault of the model, not of the request)."""

    handle: int
    chunk: GenerationChunk | None = None
    error: Exception | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or (self.chunk is not None and self.chunk.finish_reason is not None)


@dataclass(frozen=True)
class StepTiming:
    """Where one `BatchScheduler.step` spent its time (for benchmarks and logs)."""

    seconds: float  # the whole step: prefill chunks, admissions (first tokens), the cycle, outputs
    cycle_seconds: float  # the batched cycle alone; 0.0 when no row decoded
    rows: int  # rows in the cycle
    draft_length: int  # the cycle's K: the most drafts any row verified (0: a plain AR cycle)
    cycle_tokens: int  # tokens the cycle committed (a row's last cycle may pass its max_tokens)


@dataclass
class BatchScheduler:
    """Continuous batching over one engine (the module docstring). Not thread-safe: one thread
    owns it, as one thread owns the engine."""

    engine: object  # mtplx.engine.Engine (not imported: the engine imports this module)
    max_rows: int = 32  # rows decoding at once (--decode-concurrency)
    prompt_concurrency: int = 8  # requests prefilling at once (--prompt-concurrency)
    # Prompt tokens forwarded per step, over all prefilling requests: what bounds the stall of
    # the running rows (one chunk's worth per cycle), as vLLM's chunked-prefill token budget
    # (`mtplx serve --prefill-step-size`).
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    policy: DraftPolicy | None = None  # each cycle's draft length; None: every row its depth
    # One row at a time on its own mlx-lm caches (`BatchDecoder`'s single_row): a stream's
    # scheduler, and any engine whose model's caches do not batch.
    single_row: bool = False
    _decoder: BatchDecoder | None = None
    _jobs: dict[int, _Job] = field(default_factory=dict)  # in submission order
    _next_handle: int = 0
    last_timing: StepTiming | None = None  # the latest step's, once a step has run

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise MtplxError(f"decode concurrency: must be >= 1 (got {self.max_rows})")
        if self.prompt_concurrency < 1:
            raise MtplxError(f"prompt concurrency: must be >= 1 (got {self.prompt_concurrency})")
        if self.prefill_step_size < 1:
            raise MtplxError(f"prefill step size: must be >= 1 (got {self.prefill_step_size})")

    # ------------------------------------------------------------------ requests in and out
    def submit(self, prompt, request: GenerationRequest) -> int:
        """Queue one request (prompt text, messages or token ids); its handle. Raises MtplxError
        for a request this engine or the batch cannot serve, before anything runs."""
        engine = self.engine
        plan = engine.plan(prompt, request)  # first: a request nobody can serve gets that error
        refusal = engine.batch_refusal(request)
        if refusal is not None:
            raise MtplxError(f"batched decoding: {refusal}")
        decoder = self._decoder_for_engine()
        # A grammar row speculates in the batch like any other (`BatchDecoder`, "Grammar rows").
        # Compiled before any cache is taken: a grammar this tokenizer cannot serve fails here.
        constraint = engine.compile_grammar(request.grammar) if request.grammar is not None else None
        row_drafter = batch_drafter(plan.choice, decoder.single_row)
        with_head = plan.choice.model_drafter == "head" and row_drafter in ("head", "auto", "proposer")
        session = open_session(engine.prompt_cache, engine.trunk, engine.head, plan.prompt_tokens, with_head)
        pending = decoder.start(
            plan.prompt_tokens,
            RowSpec(plan.settings, row_drafter, request.drafting.lookup),
            engine.request_key(request.seed),
            trunk_cache=session.trunk_cache,
            head_cache=session.head_cache,
            prefix=session.prefix,
            # A seeded request drafts its own depth every cycle, as alone, so it reproduces its
            # tokens whatever else is in the batch; the draft policy chooses for the others.
            draft_length=plan.settings.depth if request.seed is not None or request.drafting.pinned else None,
            constraint=constraint,
            proposer=engine.row_proposer(plan, request, session.head_cache)
            if row_drafter == "proposer"
            else None,
        )
        mode, depth = ("mtp", plan.choice.depth) if row_drafter != "none" else ("ar", 0)
        output = RequestOutput(
            engine.tokenizer, request, len(plan.prompt_tokens), session.prefix.start, mode, depth, engine.head
        )
        handle = self._next_handle
        self._next_handle += 1
        self._jobs[handle] = _Job(handle, session, output, pending)
        return handle

    def cancel(self, handle: int) -> None:
        """The request leaves at the next step (it gets no more chunks)."""
        job = self._jobs.get(handle)
        if job is not None:
            job.cancelled = True

    @property
    def idle(self) -> bool:
        return not self._jobs

    @property
    def num_decoding(self) -> int:
        return sum(job.row_id is not None for job in self._jobs.values())

    @property
    def num_waiting(self) -> int:
        return sum(job.row_id is None for job in self._jobs.values())

    def _decoder_for_engine(self) -> BatchDecoder:
        if self._decoder is None:
            self._decoder = BatchDecoder(
                self.engine.trunk, self.engine.head, self.policy, single_row=self.single_row
            )
        return self._decoder

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepResult]:
        """Prefill a chunk, admit, decode one cycle (the module docstring); every request's news,
        in order (a request admitted in this step gets two: its first token, then its cycle's)."""
        results: list[StepResult] = []
        started = time.perf_counter()
        self._drop_cancelled()
        decoder = self._decoder_for_engine() if self._jobs else None
        if decoder is None:
            return results
        waiting = [job for job in self._jobs.values() if job.row_id is None]
        budget = self.prefill_step_size
        for job in waiting[: self.prompt_concurrency]:
            if budget <= 0:
                break
            pending = job.pending
            if pending.position == pending.prefix.start:  # not started: the store may hold more now
                self._reuse_prefix(job)
            try:
                before = pending.remaining
                ready = job.session.prefill(decoder, pending, budget)  # cut at cache boundaries
                budget -= before - pending.remaining
                if ready and self.num_decoding < (1 if decoder.single_row else self.max_rows):
                    job.row_id, first = decoder.admit(pending)
                    job.pending = None
                    budget -= 1
                    if not decoder.single_row:  # a single row decodes in its own (live) caches
                        job.session.store_prompt(pending.trunk_cache, pending.head_cache)
                    results.append(self._feed(job, first))
            except (MtplxError, ValueError) as err:  # ValueError: invalid values in the first draw
                results.append(self._fail(job, err))
        rows = {job.row_id: job for job in self._jobs.values() if job.row_id is not None}
        cycle_started = time.perf_counter()
        try:
            steps = decoder.step() if rows else {}
        except RowsFailed as err:
            steps = {}  # the cycle was undone for every row; the others step next time
            for row_id in err.row_ids:
                results.append(self._fail(rows[row_id], err))
        cycle_seconds = time.perf_counter() - cycle_started if rows else 0.0
        for row_id, step in steps.items():
            results.append(self._feed(rows[row_id], step))
        self.last_timing = StepTiming(
            time.perf_counter() - started,
            cycle_seconds,
            len(rows),
            max((step.num_drafted for step in steps.values()), default=0),
            sum(len(step.tokens) for step in steps.values()),
        )
        return results

    def _reuse_prefix(self, job: _Job) -> None:
        """Before ``job`` forwards its first prompt token: start it from the prompt cache's caches
        if they give more now than when it was planned. Requests prefilled since then are in the
        store (`CacheSession.store_prompt`), so concurrent requests with a common prefix (an
        agent's parallel calls over one conversation) forward it once."""
        pending = job.pending
        hit = job.session.better_prefix(pending.prefix.start)
        if hit is None:
            return
        pending.trunk_cache = hit.trunk_cache
        if hit.head_cache is not None:
            pending.head_cache = hit.head_cache
        pending.prefix = PromptPrefix(hit.start)
        pending.position = hit.start
        job.output.prefix_reused(hit.start)

    def _feed(self, job: _Job, step) -> StepResult:
        job.session.record(step.tokens)
        chunk = job.output.feed(step)
        if job.output.finished:
            self._finish(job)
        return StepResult(job.handle, chunk=chunk)

    def _fail(self, job: _Job, err: Exception) -> StepResult:
        self._remove(job)
        return StepResult(job.handle, error=err)

    def _finish(self, job: _Job) -> None:
        """A request that ended between cycles: its caches go to the prompt cache, its row leaves."""
        session = job.session
        if session.store.max_bytes and session.trimmable and job.row_id is not None:
            if not self._decoder.single_row:  # the batch's copies; a single row's are the session's own
                trunk_cache, head_cache = self._decoder.extract(job.row_id)
                session.trunk_cache = trunk_cache
                session.head_cache = head_cache if session.head_cache is not None else None
            session.finish()
        self._remove(job)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._jobs.values() if j.cancelled]:
            self._remove(job)

    def _remove(self, job: _Job) -> None:
        if job.row_id is not None:
            self._decoder.leave([job.row_id])
        self._jobs.pop(job.handle, None)

    def close(self) -> None:
        """Drop every request (their memory is freed)."""
        for job in list(self._jobs.values()):
            self._remove(job)


def run_to_completion(
    scheduler: BatchScheduler, prompts: Sequence, requests: Sequence[GenerationRequest], on_done=None
) -> list[list[GenerationChunk]]:
    """Submit every prompt, step until all ended; each request's chunks in prompt order.
    ``on_done(index)`` is called as each request ends (a progress bar). Errors raise."""
    handles = [scheduler.submit(p, r) for p, r in zip(prompts, requests)]
    index = {h: i for i, h in enumerate(handles)}
    chunks: list[list[GenerationChunk]] = [[] for _ in handles]
    try:
        while not scheduler.idle:
            for result in scheduler.step():
                if result.error is not None:
                    raise result.error
                chunks[index[result.handle]].append(result.chunk)
                if result.done and on_done is not None:
                    on_done(index[result.handle])
    finally:
        scheduler.close()
    return chunks


def stream_of(scheduler: BatchScheduler, handle: int) -> Iterator[GenerationChunk]:
    """The chunks of request ``handle``, stepping ``scheduler`` until it ends; errors raise
    (invalid values the model produced as the ValueError a single stream raises). Closing the
    generator early drops the request (its memory freed), as an interrupted call leaves nothing."""
    try:
        while not scheduler.idle:
            for result in scheduler.step():
                if isinstance(result.error, RowsFailed):
                    raise ValueError(str(result.error)) from None
                if result.error is not None:
                    raise result.error
                yield result.chunk
                if result.done:
                    return
    finally:
        scheduler.close()
