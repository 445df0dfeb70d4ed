"""`BatchScheduler`: the one scheduler. Every request decodes through it: `Engine.stream` /
`generate` (a batch of one), `Engine.generate_batch`, the server's worker and forge's data
generation (continuous batching).

Requests are submitted at any time (`submit`); `drive` is the one loop that steps until they
have ended (every entry uses it). Each `step`:
  1. prefills waiting requests, first come first served, at most ``prompt_concurrency`` of them
     and ``prefill_step_size`` prompt tokens in all per step, so long prompts stall the running
     rows by one chunk per cycle, never by their whole length, while short ones join at once;
  2. admits prefilled requests while fewer than ``max_rows`` decode (the admission draws the
     request's first token);
  3. runs the one cycle (`mtplx.spec_decode.loop.BatchDecoder.step`) for every decoding row;
and returns each request's new `GenerationChunk` (from `RequestOutput`: EOS, stop strings,
max_tokens). Requests that end or are cancelled leave before the next cycle, their caches going
to the prompt cache.

Every request joins: grammar rows speculate under their grammar (`mtplx.spec_decode.loop`,
"Grammar rows"), adaptive, lookup, head and draft-model rows alike. ``single_row`` (a
stream; a model whose caches do not batch: sliding-window, quantized KV, heads that read the
trunk's KV; a sharded engine) decodes one row at a time on its own caches, the next prefilling
meanwhile. On a sharded engine every rank runs the same scheduler: each request decodes with
rank 0's seed after the ranks agree on it, and every step runs under the collective watchdog
(`mtplx.engine.distributed`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mtplx.engine.failures import FailedStage, reach
from mtplx.engine.output import GenerationChunk, RequestOutput
from mtplx.engine.request import GenerationRequest
from mtplx.engine.session import CacheSession, starting_caches
from mtplx.errors import MtplxError
from mtplx.spec_decode.draft_policy import DraftPolicy
from mtplx.spec_decode.loop import BatchDecoder, BatchRow, RowsFailed, TrunkTap
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP
from mtplx.spec_decode.sources import BLOCK_SOURCES, Source
from mtplx.spec_decode.step import PromptPrefix
from mtplx.trunk.compat import copy_cache
from mtplx.trunk.prompt_cache import CacheHit

import mlx.core as mx

__all__ = ["BatchScheduler", "DecodeCore", "StepTiming", "run_to_completion", "stream_of"]


class DecodeCore(Protocol):
    """What the scheduler needs of an engine (`mtplx.engine.Engine` is one): the models, the
    prompt cache, and the request set-up (plan, grammar, key, a draft model row's own draft model state)."""

    trunk: Any  # mtplx.trunk.model.Trunk
    head: Any  # the MTP head, or None
    tokenizer: Any
    prompt_cache: Any  # mtplx.trunk.prompt_cache.PromptCache
    distributed: Any  # mtplx.engine.distributed.Distributed when sharded, else None

    def plan(self, prompt, request: GenerationRequest) -> Any: ...  # a DecodePlan

    def compile_grammar(self, grammar) -> Any: ...  # a fresh GrammarConstraint

    def request_key(self, seed: int | None) -> Any: ...  # mx.array

    def row_proposer(self, plan) -> Any: ...


def choice_keys(key: mx.array, n: int) -> list[mx.array]:
    """Each choice's key: the request's own for one choice, else n keys split from it."""
    return [key] if n == 1 else list(mx.random.split(key, n))


@dataclass
class _Job:
    """One choice of a request, from submission to leaving: its row (`BatchRow`: prompt ids,
    settings and drafters, grammar matcher, key, caches, token history and position, from its
    start through its prefill to its leave), its output (stop rules, text, stats) and what of
    it goes back into the prompt cache (`CacheSession`, which reads the row)."""

    handle: int  # the request's (all its choices share it)
    session: CacheSession
    output: RequestOutput
    row: BatchRow
    choice: int = 0  # the choice's index (n > 1)
    cancelled: bool = False
    # Choices 1..n-1 wait for choice 0's prefill and start from a copy of its caches (`_fork`).
    forks: list[_Job] = field(default_factory=list)
    waits: bool = False  # a fork whose caches are not copied yet


@dataclass
class StepResult:
    """What one request got from a step: a chunk, or the error that ended it (an `MtplxError`
    for the request's own mistakes; `RowsFailed` or ValueError for invalid values the model
    produced, NaN logits: a fault of the model, not of the request; any other exception where
    the failure was the request's own: ``stage`` says where, `mtplx.engine.failures`)."""

    handle: int
    chunk: GenerationChunk | None = None  # its ``index`` is the choice's
    error: Exception | None = None
    choice: int = 0
    stage: FailedStage | None = None  # where ``error`` happened

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

    engine: DecodeCore  # an `Engine` (not imported: the engine imports this module)
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
    _jobs: dict[int, _Job] = field(default_factory=dict)  # every choice, in submission order
    _next_handle: int = 0
    _next_key: int = 0
    last_timing: StepTiming | None = None  # the latest step's, once a step has run

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise MtplxError(f"decode concurrency: must be >= 1 (got {self.max_rows})")
        if self.prompt_concurrency < 1:
            raise MtplxError(f"prompt concurrency: must be >= 1 (got {self.prompt_concurrency})")
        if self.prefill_step_size < 1:
            raise MtplxError(f"prefill step size: must be >= 1 (got {self.prefill_step_size})")

    # ------------------------------------------------------------------ requests in and out
    def submit(
        self, prompt, request: GenerationRequest, *, key=None, trunk_tap: TrunkTap | None = None
    ) -> int:
        """Queue one request (prompt text, messages or token ids); its handle. Raises MtplxError
        for a request this engine or the batch cannot serve, before anything runs; whatever it
        raises, nothing of the request stays queued.

        Row options for callers below the API (forge): ``key`` (an mx random key) replaces the
        request's seed; ``trunk_tap`` sees the trunk's output over every position the row
        commits (`BatchDecoder.start`), the prompt's whole: such a row never starts from the
        prompt cache."""
        reach(FailedStage.SUBMIT)
        engine = self.engine
        plan = engine.plan(prompt, request)  # first: a request nobody can serve gets that error
        decoder = self._decoder_for_engine()
        base = key if key is not None else engine.request_key(self._agreed_seed(plan, request))
        # n > 1: each choice its own key, split from the request's (a seeded request's choices
        # are each reproducible); one choice keeps the request's key as it is.
        keys = choice_keys(base, request.n)
        handle = self._next_handle
        self._next_handle += 1
        try:
            self._new_jobs(handle, plan, request, keys, decoder, trunk_tap)
        except BaseException:  # a choice failed to start: the ones started leave with it
            for job in self._choices(handle):
                self._remove(job)
            raise
        return handle

    def _new_jobs(self, handle, plan, request, keys, decoder, trunk_tap) -> None:
        """The request's choices, pending: choice 0's row, and each other's waiting to fork it."""
        first = self._new_job(handle, 0, plan, request, keys[0], decoder, trunk_tap, fresh=False)
        for choice in range(1, request.n):
            fork = self._new_job(handle, choice, plan, request, keys[choice], decoder, trunk_tap, fresh=True)
            # A draft model row (its draft model's cache of its own) prefills on its own.
            fork.waits = first.row.proposer is None
            if fork.waits:
                first.forks.append(fork)

    def _new_job(self, handle, choice, plan, request, key, decoder, trunk_tap, *, fresh: bool) -> _Job:
        """One choice's row, pending: its grammar matcher, caches (the prompt cache's longest
        prefix; ``fresh``: empty ones, for a fork), proposer and output."""
        engine = self.engine
        # A grammar row speculates in the batch like any other (`BatchDecoder`, "Grammar rows").
        # Compiled before any cache is taken: a grammar this tokenizer cannot serve fails here.
        constraint = engine.compile_grammar(request.grammar) if request.grammar is not None else None
        sources = plan.spec.sources
        with_head = Source.HEAD in sources
        # A block drafter row's entry holds its drafter's context too (`PromptCache`).
        with_drafter = any(source in BLOCK_SOURCES for source in sources)
        # A fork's caches become choice 0's, copied after its prefill (`_fork`); a tapped row's tap
        # sees every position (`submit`), so neither starts from the prompt cache.
        if fresh or trunk_tap is not None:
            hit = CacheHit(engine.trunk.make_cache(), engine.head.make_cache() if with_head else None, 0)
        else:
            hit = starting_caches(
                engine.prompt_cache, engine.trunk, engine.head, plan.prompt_tokens, with_head, with_drafter
            )
        trunk_cache, head_cache, start = hit.trunk_cache, hit.head_cache, hit.start
        row = decoder.start(
            plan.prompt_tokens,
            plan.spec,
            key,
            trunk_cache=trunk_cache,
            head_cache=head_cache,
            prefix=PromptPrefix(start),
            draft_length=plan.draft_length,
            trunk_tap=trunk_tap,
            constraint=constraint,
            proposer=engine.row_proposer(plan),
        )
        if hit.drafter_cache is not None:  # the block drafter's context of the cached prefix
            row.drafter_cache = decoder.blocks.context_from(hit.drafter_cache)
        # Reads the row, the one holder (and a block drafter row's context through its proposer).
        session = CacheSession(engine.prompt_cache, row, decoder.blocks if with_drafter else None)
        mode, depth = ("mtp", plan.choice.depth) if sources else ("ar", 0)
        output = RequestOutput(
            engine.tokenizer, request, len(plan.prompt_tokens), start, mode, depth, engine.head
        )
        if engine.distributed is not None:
            output.stats.distributed = engine.distributed.stats(depth + 1 if mode == "mtp" else 1)
        job = _Job(handle, session, output, row, choice)
        self._jobs[self._next_key] = job
        self._next_key += 1
        return job

    def _fork(self, job: _Job) -> None:
        """``job``'s prompt is prefilled but for its last token: each waiting choice starts from a
        copy of its caches (the prompt forwarded once; each choice forwards the last token itself,
        drawing its first token with its own key). Its stats count the copied positions cached."""
        row = job.row
        for fork in job.forks:
            head_cache = copy_cache(row.head_cache) if row.head_cache is not None else None
            self._start_from(fork, copy_cache(row.trunk_cache), head_cache, row.position)
            if row.drafter_cache is not None:  # a block drafter's context of the prompt
                fork.row.drafter_cache = copy_cache(row.drafter_cache)
            fork.waits = False
        job.forks = []

    def _start_from(self, job: _Job, trunk_cache: list, head_cache: list | None, start: int) -> None:
        """``job``, not started yet, starts from caches holding its first ``start`` prompt
        positions (a fork's copy, the prompt cache's better prefix): its row holds them, the one
        holder (the row decodes in them, or the batch copies them on admission; its store at the
        end reads the row's, `_finish`); its stats count them cached. ``head_cache`` None keeps
        the row's own."""
        row = job.row
        row.trunk_cache = trunk_cache
        self.engine.trunk.bind_prompt(trunk_cache, row.prompt_tokens)  # its images (vision)
        if head_cache is not None:
            row.head_cache = head_cache
        row.prefix = PromptPrefix(start, row.prefix.on_prompt_prefix)
        row.position = start
        job.output.prefix_reused(start)

    def _agreed_seed(self, plan, request: GenerationRequest) -> int | None:
        """The seed a request decodes from: its own; on a sharded engine rank 0's, once every rank
        has checked it got the same request (`Distributed.agree_on_request`)."""
        distributed = self.engine.distributed
        if distributed is None:
            return request.seed
        fields = {
            "prompt": plan.prompt_tokens,
            "settings": plan.settings,
            "draft": plan.choice.kind,
            "max_tokens": request.max_tokens,
        }
        return distributed.agree_on_request(request.seed, fields)

    def _guarded(self):
        """A step's collectives under the watchdog on a sharded engine (a lost rank: MtplxError)."""
        distributed = self.engine.distributed
        return distributed.guarded("a decode step") if distributed is not None else contextlib.nullcontext()

    def cancel(self, handle: int) -> None:
        """The request (every choice of it) leaves at the next step (it gets no more chunks)."""
        for job in self._jobs.values():
            if job.handle == handle:
                job.cancelled = True

    def _choices(self, handle: int) -> list[_Job]:
        return [job for job in self._jobs.values() if job.handle == handle]

    @property
    def idle(self) -> bool:
        return not self._jobs

    @property
    def num_decoding(self) -> int:
        return sum(job.row.row_id is not None for job in self._jobs.values())

    @property
    def num_waiting(self) -> int:
        return sum(job.row.row_id is None for job in self._jobs.values())

    def _decoder_for_engine(self) -> BatchDecoder:
        if self._decoder is None:
            engine = self.engine
            self._decoder = BatchDecoder(
                engine.trunk,
                engine.head,
                self.policy,
                single_row=self.single_row,
                blocks=engine.block_drafter,
            )
        return self._decoder

    # ------------------------------------------------------------------ one step
    def step(self) -> list[StepResult]:
        """Prefill a chunk, admit, decode one cycle (the module docstring); every request's news,
        in order (a request admitted in this step gets two: its first token, then its cycle's)."""
        self._drop_cancelled()
        if not self._jobs:
            return []
        with self._guarded():
            return self._step(self._decoder_for_engine())

    def _step(self, decoder: BatchDecoder) -> list[StepResult]:
        results: list[StepResult] = []
        started = time.perf_counter()
        waiting = [job for job in self._jobs.values() if job.row.row_id is None and not job.waits]
        budget = self.prefill_step_size
        for job in waiting[: self.prompt_concurrency]:
            if budget <= 0:
                break
            used, result = self._prefill_and_admit(job, decoder, budget)
            budget -= used
            if result is not None:
                results.append(result)
        rows = {job.row.row_id: job for job in self._jobs.values() if job.row.row_id is not None}
        cycle_started = time.perf_counter()
        try:
            if rows:
                reach(FailedStage.STEP)
            steps = decoder.step() if rows else {}
        except RowsFailed as err:
            steps = {}  # the cycle was undone for every row; the others step next time
            for row_id in err.row_ids:
                results.append(self._fail(rows[row_id], err, FailedStage.CYCLE))
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

    def _prefill_and_admit(
        self, job: _Job, decoder: BatchDecoder, budget: int
    ) -> tuple[int, StepResult | None]:
        """A chunk of ``job``'s prompt (at most ``budget`` tokens, cut at cache boundaries), and
        its admission once prefilled: the tokens it forwarded, and its news (its first token, or
        the failure that ended it; None: neither yet). A failure of its own ends it alone: its
        prefill (its own caches), its forks' copies, its first draw refused before it joins
        (MtplxError; ValueError: invalid values), its prompt-cache store, its output. Anything
        else raised inside the batch's join propagates: the batch's state is in question."""
        row = job.row
        before = row.remaining
        try:
            # Not started: the store may hold more now (a tapped row forwards its whole prompt).
            if row.position == row.prefix.start and row.trunk_tap is None:
                self._reuse_prefix(job)
            reach(FailedStage.PREFILL)
            ready = job.session.prefill(decoder, budget)
            if ready and job.forks:
                self._fork(job)
        except Exception as err:
            return before - row.remaining, self._fail(job, err, FailedStage.PREFILL)
        used = before - row.remaining
        if not ready or self.num_decoding >= (1 if decoder.single_row else self.max_rows):
            return used, None
        # The row's prompt caches and drafter context: a batch takes copies of them.
        prompt_caches = row.trunk_cache, row.head_cache, row.drafter_cache
        try:
            _, first = decoder.admit(row)
        except (MtplxError, ValueError) as err:  # ValueError: invalid values in the first draw
            return used, self._fail(job, err, FailedStage.ADMIT)
        if not decoder.single_row:  # a single row decodes in its own (live) caches
            try:
                self._store_prompt(job, prompt_caches, decoder)
            except Exception as err:
                return used + 1, self._fail(job, err, FailedStage.STORE)
        return used + 1, self._feed(job, first)

    @staticmethod
    def _store_prompt(job: _Job, prompt_caches: tuple, decoder: BatchDecoder) -> None:
        """The admitted row's prompt caches (trunk, head, block drafter context or None, taken
        before admission) into the store (`CacheSession.store_prompt`)."""
        trunk_cache, head_cache, drafter_cache = prompt_caches
        if drafter_cache is not None:
            drafter_cache = decoder.blocks.stored_context(drafter_cache)
        job.session.store_prompt(trunk_cache, head_cache, drafter_cache)

    def _reuse_prefix(self, job: _Job) -> None:
        """Before ``job`` forwards its first prompt token: start it from the prompt cache's caches
        if they give more now than when it was planned. Requests prefilled since then are in the
        store (`CacheSession.store_prompt`), so concurrent requests with a common prefix (an
        agent's parallel calls over one conversation) forward it once. A block drafter row's hit
        holds its drafter's context of the prefix too (the session asks for it)."""
        hit = job.session.better_prefix()
        if hit is not None:
            self._start_from(job, hit.trunk_cache, hit.head_cache, hit.start)
            if hit.drafter_cache is not None:
                job.row.drafter_cache = self._decoder.blocks.context_from(hit.drafter_cache)

    def _feed(self, job: _Job, step) -> StepResult:
        """``step``'s tokens through the job's output (detokenized, stop strings), as its chunk;
        a job that ends here stores its caches. A failure there ends this request alone."""
        try:
            reach(FailedStage.OUTPUT)
            chunk = job.output.feed(step)
        except Exception as err:
            return self._fail(job, err, FailedStage.OUTPUT)
        chunk.index = job.choice
        if job.output.finished:
            try:
                self._finish(job)
            except Exception as err:
                return self._fail(job, err, FailedStage.STORE)
        return StepResult(job.handle, chunk=chunk, choice=job.choice)

    def _fail(self, job: _Job, err: Exception, stage: FailedStage) -> StepResult:
        """The request ends with ``err`` (raised at ``stage``): every choice of it leaves."""
        for choice in self._choices(job.handle):
            self._remove(choice)
        return StepResult(job.handle, error=err, choice=job.choice, stage=stage)

    def _finish(self, job: _Job) -> None:
        """A request that ended between cycles: its caches go to the prompt cache, its row leaves."""
        if job.session.stores_at_finish and job.row.row_id is not None:
            # The row's caches: copies out of a batch, a single row's own.
            job.session.finish(*self._decoder.extract(job.row.row_id))
        self._remove(job)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._jobs.values() if j.cancelled]:
            self._remove(job)

    def _remove(self, job: _Job) -> None:
        if job.row.row_id is not None:
            self._decoder.leave([job.row.row_id])
            job.row.row_id = None
        for key, held in list(self._jobs.items()):
            if held is job:
                del self._jobs[key]

    def close(self) -> None:
        """Drop every request (their memory is freed)."""
        for job in list(self._jobs.values()):
            self._remove(job)

    # ------------------------------------------------------------------ the drive loop
    def drive(
        self,
        on_step: Callable[[list[StepResult]], bool | None] | None = None,
        *,
        feed: Callable[[], bool] | None = None,
    ) -> Iterator[StepResult]:
        """The one drive loop ("submit, step until idle, collect"): every entry decodes through it
        (`stream_of` for `Engine.stream`, `run_to_completion` for `Engine.generate_batch`, forge's
        `generate_batch`, the server worker). Steps until no request is left, yielding each
        step's results in order; then ``on_step(results)`` sees the whole step (True: stop here,
        e.g. forge's deadline). ``feed()`` runs before each step and may submit requests (the
        worker takes its queue; it may wait for one); with it the loop waits for requests instead
        of ending when idle, and ends when ``feed`` returns False. When the loop ends, or the
        generator is closed (use `contextlib.closing`), every request left is dropped."""
        try:
            while True:
                if feed is not None and not feed():
                    return
                if self.idle:
                    if feed is None:
                        return
                    continue
                results = self.step()
                yield from results
                if on_step is not None and on_step(results):
                    return
        finally:
            self.close()


def run_to_completion(
    scheduler: BatchScheduler, prompts: Sequence, requests: Sequence[GenerationRequest], on_done=None
) -> list[list[GenerationChunk]]:
    """Submit every prompt, drive until all ended; each request's chunks in prompt order.
    ``on_done(index)`` is called as each request ends (a progress bar). Errors raise."""
    handles = [scheduler.submit(p, r) for p, r in zip(prompts, requests)]
    index = {h: i for i, h in enumerate(handles)}
    chunks: list[list[GenerationChunk]] = [[] for _ in handles]
    with contextlib.closing(scheduler.drive()) as results:
        for result in results:
            if result.error is not None:
                raise result.error
            chunks[index[result.handle]].append(result.chunk)
            if result.done and on_done is not None:
                on_done(index[result.handle])
    return chunks


def stream_of(scheduler: BatchScheduler, handle: int) -> Iterator[GenerationChunk]:
    """The chunks of request ``handle``, driving ``scheduler`` until it ends; errors raise
    (invalid values the model produced as the ValueError a single stream raises). Closing the
    generator early drops the request (its memory freed), as an interrupted call leaves nothing."""
    with contextlib.closing(scheduler.drive()) as results:
        for result in results:
            if isinstance(result.error, RowsFailed):
                raise ValueError(str(result.error)) from None
            if result.error is not None:
                raise result.error
            yield result.chunk
            if result.done:
                return
