"""A failure inside the server's generation worker fails the requests it concerns, at once, and the
worker serves on (`mtplx.server.worker`, `mtplx.engine.failures`).

A real `mtplx serve` process on a tiny random MiMo checkpoint, driven by the `openai` and
`anthropic` clients; the failures are planted through the engine's test hook
(``MTPLX_TEST_FAULT``, set for the server process only), at the points where a real one would
raise: the scheduler's setup (as the cost profile did for DeepSeek-V4: the worker thread died
and every request hung for its 600 s timeout), a request's start, its prompt's prefill, its
output's detokenization. The clients are bounded (a hang is a timeout error, not a stuck test).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.failures import FAULT_ENV

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server import KEY, running_server

# Each stage's planted failures, by the count of times the server reaches it (the test's order):
# setup 1 at start-up and 2 for the first request; output 1: the second request's first token;
# submit 2: the third request's start; prefill 2: the fourth's; step 1: the first cycle with a
# row in it (the fifth request's); prefill 6: the eighth request's (the sixth is served, the
# seventh decodes beside the eighth).
FAULTS = "setup:2,output@1,submit@2,prefill@2,step@1,prefill@6"
CLIENT_TIMEOUT = 60  # seconds: today's worker died on the setup failure and the request hung


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    flags = ["--depth", "2", "--draft-policy", "fixed"]
    with running_server(model_dir, log_path, *flags, env={FAULT_ENV: FAULTS}) as running:
        yield running


@pytest.fixture(scope="module")
def engine(model_dir):
    from mtplx.engine.engine import Engine

    return Engine.load(model_dir, depth=2)


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _internal_error(message: str, doing: str) -> None:
    assert message == f"internal server error {doing} (details in the server log)"


def test_worker_failures_fail_their_requests_and_the_worker_serves_on(server, model_dir, engine):
    base, log_path = server
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT)
    claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT)
    prompt, model = "Once upon a time", str(model_dir)

    # 1. The scheduler's setup failed at start-up and fails again for this request: a 500 now.
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    _internal_error(info.value.response.json()["error"]["message"], "while setting up the batch scheduler")

    # 2. The setup succeeds; this stream's first token fails in its detokenization: the stream
    # opened at admission, so the failure is its error event, and the stream ends.
    with pytest.raises(openai.APIError) as streamed:
        list(client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, stream=True))
    _internal_error(streamed.value.body["message"], "while detokenizing the output")

    # 3. A request's start fails: an Anthropic error body for the Messages route.
    with pytest.raises(anthropic.InternalServerError) as failed:
        claude.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    error = failed.value.body["error"]
    assert error["type"] == "api_error"
    _internal_error(error["message"], "while starting the request")

    # 4. Its prompt's prefill fails; then a batch step raises (its shared state in question:
    # every request in flight fails and the worker builds a fresh scheduler); the next request
    # is served exactly.
    for doing in ("while prefilling the prompt", "in a batch step"):
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        _internal_error(info.value.response.json()["error"]["message"], doing)
    expected = engine.generate(prompt, max_tokens=6, temperature=0.0, chat=False)
    served = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    assert served.choices[0].text == expected.text

    # 5. A request failing in its prefill while another decodes (sent after the stream's first
    # chunk; that the two meet in one batch is what the next test makes certain): that one fails
    # alone, the other gets the tokens it gets alone (no EOS: it runs its whole max_tokens).
    eos_ban = {token: -100.0 for token in engine.tokenizer.eos_token_ids}
    long_prompt = "The longest story"
    alone = engine.generate(long_prompt, max_tokens=24, temperature=0.0, chat=False, logit_bias=eos_ban)
    stream = client.completions.create(
        model=model,
        prompt=long_prompt,
        max_tokens=24,
        temperature=0,
        stream=True,
        logit_bias={str(k): v for k, v in eos_ban.items()},
    )
    pieces = [next(iter(stream)).choices[0].text]  # decoding now
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    _internal_error(info.value.response.json()["error"]["message"], "while prefilling the prompt")
    pieces += [chunk.choices[0].text for chunk in stream]
    assert "".join(pieces) == alone.text and len(alone.token_ids) == 24

    # /metrics and /health count each failure once; each failed request is an error abort.
    metrics = _metrics(base)
    for stage, count in {"setup": 2, "output": 1, "submit": 1, "prefill": 2, "step": 1}.items():
        assert metrics[("mtplx_worker_errors_total", (("stage", stage),))] == count, stage
    assert metrics[("mtplx_request_aborted_total", (("reason", "error"),))] == 6
    assert httpx.get(base + "/health").json()["worker_errors"] == 7
    # Each failure's traceback is logged once, server-side.
    logged = [line for line in log_path.read_text().splitlines() if line.startswith("mtplx.engine.failures")]
    assert len(logged) == 7 and all("planted failure at" in line for line in logged)


def test_a_rows_own_failure_leaves_the_row_beside_it_in_the_batch(engine, monkeypatch):
    """Deterministically in one batch (both jobs queued before the worker's thread starts, so its
    first step prefills both): the second job's prefill fails (planted at the hook's second
    prefill), the first decodes on and gets the tokens it gets alone. Control: a prefill failure
    treated as the batch's (the scheduler's catch before this change) fails both."""
    import asyncio
    import time

    from mtplx.engine import failures
    from mtplx.engine.request import GenerationRequest
    from mtplx.server.worker import Finished, GenerationWorker, Job, JobFailed

    monkeypatch.setattr(failures, "_planned", {"prefill": {2}})
    monkeypatch.setattr(failures, "_reached", {})
    eos_ban = {token: -100.0 for token in engine.tokenizer.eos_token_ids}
    request = GenerationRequest.from_kwargs(max_tokens=12, temperature=0.0, logit_bias=eos_ban)
    prompts = [engine.encode_prompt(text, chat=False) for text in ("The longest story", "Once upon a time")]

    async def run() -> list[list]:
        loop = asyncio.get_running_loop()
        jobs = [Job(tokens, request, time.monotonic() + 60, loop) for tokens in prompts]
        worker = GenerationWorker(engine, max_queue=4, draft_policy="fixed")
        for job in jobs:
            worker.submit(job)
        worker.start()
        try:
            items: list[list] = [[], []]
            for job, got in zip(jobs, items):
                while not got or not isinstance(got[-1], Finished):
                    got.append(await asyncio.wait_for(job.chunks.get(), timeout=60))
            return items
        finally:
            worker.stop()

    kept, failed = asyncio.run(run())
    assert not any(isinstance(item, JobFailed) for item in kept), kept
    assert type(kept[0]).__name__ == "Admitted" and isinstance(kept[-1], Finished)
    alone = engine.generate(prompts[0], max_tokens=12, temperature=0.0, logit_bias=eos_ban)
    assert [t for chunk in kept[1:-1] for t in chunk.token_ids] == alone.token_ids
    assert len(alone.token_ids) == 12
    assert [type(item).__name__ for item in failed] == ["Admitted", "JobFailed", "Finished"]
    assert failed[1].stage is failures.FailedStage.PREFILL


# ------------------------------------------------------------------ `serve --learn`'s learner failing


def _collect(jobs, timeout: float) -> list[list]:
    """Each job's items up to its ``Finished`` (a job that never finishes: a TimeoutError)."""
    import asyncio

    from mtplx.server.worker import Finished

    async def drain() -> list[list]:
        items: list[list] = [[] for _ in jobs]
        for job, got in zip(jobs, items):
            while not got or not isinstance(got[-1], Finished):
                got.append(await asyncio.wait_for(job.chunks.get(), timeout=timeout))
        return items

    return drain()


def _stage_counts(worker) -> dict[str, float]:
    return {
        sample.labels["stage"]: sample.value
        for family in worker.metrics.registry.collect()
        if family.name == "mtplx_worker_errors"
        for sample in family.samples
        if sample.name == "mtplx_worker_errors_total"
    }


def _planted_once(caplog) -> list[str]:
    """The logged tracebacks of the planted failure (each failure's is logged once)."""
    return [r.getMessage() for r in caplog.records if r.exc_info and "planted failure" in str(r.exc_info[1])]


def test_a_learner_failing_to_record_a_request_fails_no_request(engine, tmp_path, monkeypatch, caplog):
    """`serve --learn`: the learner raising while it records a finished request (planted at the hook's
    first learn reach: the shorter job's record, while the longer one decodes beside it) ends neither:
    the short one finishes, the long one gets the tokens it gets alone; counted as stage "learn", its
    traceback logged once, the learner set aside (the other request is not recorded). Control: the
    call unguarded (main's worker) leaves the short job without its end and fails the long one as a
    "step"."""
    import asyncio
    import time

    from mtplx.engine import failures
    from mtplx.engine.request import GenerationRequest
    from mtplx.learn.serving import Learner
    from mtplx.server.worker import GenerationWorker, Job, JobFailed

    monkeypatch.setattr(failures, "_planned", {"learn": {1}})
    monkeypatch.setattr(failures, "_reached", {})
    learner = Learner(engine, str(tmp_path / "learn"), train=False)
    eos_ban = {token: -100.0 for token in engine.tokenizer.eos_token_ids}
    prompts = [engine.encode_prompt(text, chat=False) for text in ("Once upon a time", "The longest story")]
    requests = [
        GenerationRequest.from_kwargs(max_tokens=n, temperature=0.0, logit_bias=eos_ban) for n in (2, 12)
    ]

    async def run() -> list[list]:
        loop = asyncio.get_running_loop()
        jobs = [Job(p, r, time.monotonic() + 60, loop) for p, r in zip(prompts, requests)]
        worker = GenerationWorker(engine, max_queue=4, draft_policy="fixed", learner=learner)
        for job in jobs:
            job.traffic_tags = (None, False)  # both are logged
            worker.submit(job)  # both queued before the thread starts: one batch
        worker.start()
        try:
            return [*await _collect(jobs, timeout=30), worker]
        finally:
            worker.stop()

    short, long, worker = asyncio.run(run())
    assert not any(isinstance(item, JobFailed) for item in short + long), (short, long)
    assert [t for chunk in short[1:-1] for t in chunk.token_ids] == engine.generate(
        prompts[0], max_tokens=2, temperature=0.0, logit_bias=eos_ban
    ).token_ids
    alone = engine.generate(prompts[1], max_tokens=12, temperature=0.0, logit_bias=eos_ban)
    assert [t for chunk in long[1:-1] for t in chunk.token_ids] == alone.token_ids
    assert _stage_counts(worker) == {"learn": 1.0} and worker.errors == 1
    assert len(_planted_once(caplog)) == 1
    assert worker.learner is None and learner.log.records == 0


def test_a_learner_failing_while_idle_is_its_own_stage_and_the_next_request_is_served(
    engine, tmp_path, monkeypatch, caplog
):
    """The trainer's idle piece of work raising (planted at the first learn reach: the worker's
    first idle moment, its learner holding enough records for a round) is counted as stage "learn",
    not as a failed batch step, its traceback logged once; the learner is set aside (no round runs)
    and the next request is served exactly. Control: main's worker counts it as "step" and builds
    a fresh scheduler."""
    import asyncio
    import time
    from dataclasses import replace

    from mtplx.engine import failures
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest
    from mtplx.forge.train import build_head
    from mtplx.learn.config import DEFAULT_LEARN_CONFIG
    from mtplx.learn.serving import Learner
    from mtplx.server.worker import GenerationWorker, Job, JobFailed

    from support.server import wait_for

    learning = Engine(
        engine.trunk.model,
        engine.tokenizer,
        engine.config,
        head=build_head(engine.trunk, "pre_norm"),  # a forged head: one the learner trains
        depth=2,
        fingerprint=engine.fingerprint,
    )
    cfg = replace(DEFAULT_LEARN_CONFIG, min_records=2)
    learner = Learner(learning, str(tmp_path / "learn"), cfg=cfg)
    for tokens in ((5, 6, 7), (8, 9, 10)):
        learner.record((1, 2, 3, 4), [tokens], ["length"], None, False)
    assert learner.has_work()  # a round is due: the idle worker calls work()
    monkeypatch.setattr(failures, "_planned", {"learn": {1}})
    monkeypatch.setattr(failures, "_reached", {})
    prompt = learning.encode_prompt("Once upon a time", chat=False)
    request = GenerationRequest.from_kwargs(max_tokens=6, temperature=0.0)

    async def run():
        worker = GenerationWorker(learning, max_queue=4, draft_policy="fixed", learner=learner)
        worker.start()
        try:
            await asyncio.to_thread(wait_for, lambda: worker.errors > 0, 30)
            job = Job(prompt, request, time.monotonic() + 60, asyncio.get_running_loop())
            worker.submit(job)
            return (await _collect([job], timeout=30))[0], worker
        finally:
            worker.stop()

    served, worker = asyncio.run(run())
    assert not any(isinstance(item, JobFailed) for item in served), served
    alone = learning.generate(prompt, max_tokens=6, temperature=0.0)
    assert [t for chunk in served[1:-1] for t in chunk.token_ids] == alone.token_ids
    assert _stage_counts(worker) == {"learn": 1.0} and worker.errors == 1
    assert len(_planted_once(caplog)) == 1
    assert worker.learner is None and learner.rounds == 0 and learner.train_seconds == 0.0


@pytest.mark.slow  # the real-process repeat of the two in-process learner tests above
def test_serve_learn_with_its_learner_failing_serves_every_request(model_dir, tmp_path):
    """`mtplx serve --learn` with ``MTPLX_TEST_FAULT=learn`` (the first request's record raises):
    both requests are answered through the `openai` client, /metrics counts one "learn" failure
    and no "step", the log holds its traceback once, and nothing was recorded (the learner set aside)."""
    learn = tmp_path / "learn"
    flags = ["--depth", "2", "--draft-policy", "fixed", "--learn", str(learn)]
    with running_server(model_dir, tmp_path / "server.log", *flags, env={FAULT_ENV: "learn@1"}) as (
        base,
        log_path,
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=CLIENT_TIMEOUT)
        for prompt in ("Once upon a time", "The longest story"):
            reply = client.completions.create(
                model=str(model_dir), prompt=prompt, max_tokens=4, temperature=0
            )
            assert reply.usage.completion_tokens >= 1
        metrics = _metrics(base)
        assert metrics[("mtplx_worker_errors_total", (("stage", "learn"),))] == 1
        assert ("mtplx_worker_errors_total", (("stage", "step"),)) not in metrics
        assert httpx.get(base + "/health").json()["worker_errors"] == 1
    logged = [line for line in log_path.read_text().splitlines() if line.startswith("mtplx.engine.failures")]
    assert len(logged) == 1 and "planted failure at learn" in logged[0]
    assert not list((learn / "traffic").glob("rec-*"))
