"""`mtplx serve` as a real process on a free port, driven by the real `openai` client and httpx.

The served model is a tiny random MiMo checkpoint (plain attention, its own MTP
head, context 256) with the default model's real tokenizer, so the server runs
the MTP path at test speed. Expected outputs come from `Engine.generate` on the
same directory in this process.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.decoding import is_rounding_tie
from support.server import KEY, running_server, wait_for

MAX_QUEUE = 8
MAX_BODY = 100_000


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    flags = ["--depth", "2", "--max-queue", str(MAX_QUEUE), "--max-body-bytes", str(MAX_BODY)]
    flags += ["--served-model-name", str(model_dir)]  # strict: other names are a 404
    with running_server(model_dir, log_path, *flags) as running:
        yield running


@pytest.fixture(scope="module")
def engine(model_dir):
    from mtplx.engine.engine import Engine

    return Engine.load(model_dir, depth=2)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(model_dir) -> str:
    return str(model_dir)


def _messages(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_models_and_health(server, client, model_id):
    assert [m.id for m in client.models.list().data] == [model_id]
    health = httpx.get(server[0] + "/health").json()
    assert health["status"] == "ok" and health["model"] == model_id


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_engine_generate_with_usage(client, engine, model_id, stream):
    messages = _messages(f"Tell me about caches (stream={stream}).")
    expected = engine.generate(messages, max_tokens=12, temperature=0.0)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=model_id,
                messages=messages,
                max_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage, extra = chunks[-1].usage, chunks[-1].model_extra["mtplx"]
        assert chunks[-1].choices == []
    else:
        response = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=12, temperature=0
        )
        text, finish = response.choices[0].message.content, [response.choices[0].finish_reason]
        usage, extra = response.usage, response.model_extra["mtplx"]
    assert text == expected.text
    assert finish == [expected.finish_reason]
    assert usage.prompt_tokens == len(engine.encode_prompt(messages))
    assert usage.completion_tokens == len(expected.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The system message is shared with earlier requests: its tokens may come from the cache.
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 <= cached < usage.prompt_tokens and extra["cached_tokens"] == cached
    assert extra["prefilled_tokens"] == usage.prompt_tokens - cached
    assert extra["mode"] == "mtp" and extra["depth"] == 2 and extra["tokens_per_cycle"] >= 1.0


@pytest.mark.parametrize("stream", [False, True])
def test_completion_equals_engine_generate(client, engine, model_id, stream):
    prompt = f"Once upon a time, stream={stream}"
    expected = engine.generate(prompt, max_tokens=10, temperature=0.7, seed=123, chat=False)
    kwargs = dict(model=model_id, prompt=prompt, max_tokens=10, temperature=0.7, seed=123)
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    else:
        response = client.completions.create(**kwargs)
        text = response.choices[0].text
        assert response.usage.completion_tokens == len(expected.token_ids)
    assert text == expected.text


def test_logprobs_are_the_engines(client, engine, model_id):
    messages = _messages("Logprobs please.")
    expected = [
        lp
        for chunk in engine.stream(messages, max_tokens=8, temperature=0.9, seed=4, logprobs=3)
        for lp in chunk.logprobs
    ]
    response = client.chat.completions.create(
        model=model_id,
        messages=messages,
        max_tokens=8,
        temperature=0.9,
        seed=4,
        logprobs=True,
        top_logprobs=3,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == len(expected)
    for got, want in zip(content, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in got.top_logprobs] == pytest.approx([v for _, v in want.top], abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [engine.tokenizer.decode([t]) for t, _ in want.top]


def test_second_turn_reuses_the_first_turns_cache(client, model_id):
    messages = _messages("A question that starts a chat.")
    first = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And a follow-up."},
    ]
    second = client.chat.completions.create(model=model_id, messages=messages, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1
    assert second.model_extra["mtplx"]["prefilled_tokens"] == second.usage.prompt_tokens - cached


def _matches_or_ties(engine, alone, got_text: str) -> bool:
    """``got_text`` (a batched greedy stream) is the alone run's text, or leaves it at a token
    where the alone run had a rounding tie (support.decoding's rule, on the tokens' texts)."""
    if got_text == alone.text:
        return True
    tokens = alone.token_ids
    kept = 0  # tokens of the alone run whose text the batched stream starts with
    while kept < len(tokens) and got_text.startswith(engine.tokenizer.decode(tokens[: kept + 1])):
        kept += 1
    if kept == len(tokens):
        return False
    top = alone.logprobs[kept].top
    return is_rounding_tie((top[0][1], top[1][1]))


def test_eight_concurrent_streams_each_get_their_own_output(server, engine, model_id):
    """Eight clients at once, decoded in one batch: each gets what its request gives alone, up to
    a rounding tie (support.decoding); another client's output would not pass (negative control)."""
    prompts = [_messages(f"Concurrent request number {i}: say something about {i * 7}.") for i in range(8)]
    alone = [engine.generate(p, max_tokens=8, temperature=0.0, logprobs=2) for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)
            stream = c.chat.completions.create(
                model=model_id, messages=prompts[i], max_tokens=8, temperature=0, stream=True
            )
            results[i] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except BaseException as err:  # reported below, with the index
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    verdicts = [_matches_or_ties(engine, alone[i], results[i]) for i in range(8)]
    assert all(verdicts), [(results[i], alone[i].text) for i in range(8)]
    assert sum(results[i] != alone[i].text for i in range(8)) <= 1  # ties are rare
    # Negative control: a client that got another request's output is caught (the tiny random
    # model gives some prompts the same text: only pairs whose alone outputs differ count).
    pairs = [(i, j) for i in range(8) for j in range(8) if alone[i].text != alone[j].text]
    assert len(pairs) >= 8
    assert not any(_matches_or_ties(engine, alone[j], results[i]) for i, j in pairs)


def _stream_lines(base: str, body: dict):
    return httpx.stream(
        "POST",
        base + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )


def test_disconnect_mid_stream_cancels_and_the_next_request_is_fine(server, client, engine, model_id):
    base, log_path = server
    body = dict(
        model=model_id,
        messages=_messages("A long answer, please."),
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    with _stream_lines(base, body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert next(line for line in lines if line.startswith("data: "))
    # The next request is served as usual.
    messages = _messages("After the disconnect.")
    expected = engine.generate(messages, max_tokens=8, temperature=0.0)
    response = client.chat.completions.create(model=model_id, messages=messages, max_tokens=8, temperature=0)
    assert response.choices[0].message.content == expected.text

    # The abandoned generation stopped early (its log line, written as it ends, counts its tokens).
    def completions() -> list[int]:
        return [
            int(line.split("completion=")[1].split()[0])
            for line in log_path.read_text().splitlines()
            if "completion=" in line
        ]

    wait_for(lambda: any(n < 200 for n in completions()))
    assert any(n < 200 for n in completions()) and 200 not in completions()


def test_queue_full_answers_429_with_retry_after(model_dir, model_id, tmp_path):
    """A server that holds one decoding and one prefilling request and queues two: a burst beside a
    long stream finds it full (with the default 32 + 8 rows a burst of 24 fits in the batch, and a
    429 came only when the worker happened not to run while the burst arrived)."""
    queue_size = 2
    flags = ["--decode-concurrency", "1", "--prompt-concurrency", "1", "--max-queue", str(queue_size)]
    with running_server(model_dir, tmp_path / "server.log", *flags) as (base, _):
        _queue_burst(base, model_id, 12 * queue_size)


def _queue_burst(base: str, model_id: str, burst: int) -> None:
    body = dict(
        model=model_id,
        messages=_messages("Keep the worker busy."),
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    short = dict(model=model_id, messages=_messages("short"), max_tokens=4, temperature=0)
    statuses: list[httpx.Response] = []
    start = threading.Barrier(burst)

    def post() -> None:
        start.wait()
        headers = {"Authorization": f"Bearer {KEY}"}
        statuses.append(httpx.post(base + "/v1/chat/completions", json=short, headers=headers, timeout=120))

    with _stream_lines(base, body) as running:
        next(running.iter_lines())  # the worker is busy with this one
        # A burst far larger than the rows and the queue: more arrive than the worker drains meanwhile.
        threads = [threading.Thread(target=post) for _ in range(burst)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    rejected = [r for r in statuses if r.status_code == 429]
    assert len(statuses) == burst
    assert rejected, "no request was turned away"
    assert all(
        r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for r in rejected
    )
    served = [r for r in statuses if r.status_code == 200]
    assert len(served) + len(rejected) == burst
    assert all(r.json()["choices"][0]["finish_reason"] in ("stop", "length") for r in served)


def _chat(model="__served__", **fields):
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


BAD_REQUESTS = [
    # (name, path, body (dict, or raw bytes), headers override, expected status, param)
    ("malformed JSON", "/v1/chat/completions", b'{"model": "x", "messages": [', None, 400, None),
    ("messages not a list", "/v1/chat/completions", _chat(messages="hi"), None, 400, "messages"),
    ("missing messages", "/v1/chat/completions", {"model": "__served__"}, None, 400, "messages"),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), None, 400, "messages"),
    (
        "unknown role",
        "/v1/chat/completions",
        _chat(messages=[{"role": "wizard", "content": "x"}]),
        None,
        400,
        None,
    ),
    ("temperature a string", "/v1/chat/completions", _chat(temperature="hot"), None, 400, "temperature"),
    ("negative temperature", "/v1/chat/completions", _chat(temperature=-1), None, 400, "temperature"),
    ("top_p 0", "/v1/chat/completions", _chat(top_p=0), None, 400, "top_p"),
    ("top_p above 1", "/v1/chat/completions", _chat(top_p=1.5), None, 400, "top_p"),
    ("min_p 1", "/v1/chat/completions", _chat(min_p=1.0), None, 400, "min_p"),
    ("negative seed", "/v1/chat/completions", _chat(seed=-1), None, 400, "seed"),
    (
        "seed past 64 bits",
        "/v1/completions",
        {"model": "__served__", "prompt": "a", "seed": 2**64},
        None,
        400,
        "seed",
    ),
    ("max_tokens 0", "/v1/chat/completions", _chat(max_tokens=0), None, 400, "max_tokens"),
    ("max_tokens a float", "/v1/chat/completions", _chat(max_tokens=2.5), None, 400, "max_tokens"),
    ("max_tokens over the cap", "/v1/chat/completions", _chat(max_tokens=9000), None, 400, "max_tokens"),
    ("n > 16", "/v1/chat/completions", _chat(n=17), None, 400, "n"),
    (
        "logit_bias key not an id",
        "/v1/chat/completions",
        _chat(logit_bias={"abc": 1}),
        None,
        400,
        "logit_bias",
    ),
    (
        "logit_bias id past vocab",
        "/v1/chat/completions",
        _chat(logit_bias={"999999": 1}),
        None,
        400,
        "logit_bias",
    ),
    ("logit_bias value out of range", "/v1/chat/completions", _chat(logit_bias={"5": 500}), None, 400, None),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        _chat(top_logprobs=2),
        None,
        400,
        "top_logprobs",
    ),
    ("top_logprobs too many", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=50), None, 400, None),
    (
        "prompt over context",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "word " * 300}]),
        None,
        400,
        "messages",
    ),
    ("max_tokens past context", "/v1/chat/completions", _chat(max_tokens=250), None, 400, "messages"),
    ("unknown model", "/v1/chat/completions", _chat(model="../../etc/passwd"), None, 404, "model"),
    ("missing prompt", "/v1/completions", {"model": "__served__"}, None, 400, "prompt"),
    (
        "oversized body",
        "/v1/chat/completions",
        _chat(messages=[{"role": "user", "content": "x" * (MAX_BODY + 10)}]),
        None,
        413,
        None,
    ),
    ("bad API key", "/v1/chat/completions", _chat(), {"Authorization": "Bearer wrong"}, 401, None),
    ("missing API key", "/v1/chat/completions", _chat(), {}, 401, None),
    ("unknown route", "/v1/embeddings", _chat(), None, 404, None),
]


@pytest.mark.parametrize(
    "name,path,body,headers,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_requests_get_a_4xx_in_the_openai_shape(
    server, model_id, name, path, body, headers, status, param
):
    base, _ = server
    if isinstance(body, dict):
        body = json.dumps({**body, "model": model_id} if body.get("model") == "__served__" else body).encode()
    sent_headers = {"Content-Type": "application/json"}
    sent_headers.update({"Authorization": f"Bearer {KEY}"} if headers is None else headers)
    response = httpx.post(base + path, content=body, headers=sent_headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (
        isinstance(error["message"], str)
        and "\n" not in error["message"]
        and "Traceback" not in error["message"]
    )
    if param is not None:
        assert error["param"] == param


# `_one_prompt`'s refusals, each with its own line (the 400s above only name the status and param).
PROMPT_REFUSALS = [
    ("", "prompt: is empty"),
    ([""], "prompt: is empty"),
    (["a", "b"], "prompt: only one prompt per request is supported"),
]


@pytest.mark.parametrize("prompt,message", PROMPT_REFUSALS, ids=["empty", "one-empty-text", "two-texts"])
def test_completion_prompt_refusals_say_what_is_wrong(client, model_id, prompt, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model_id, prompt=prompt, max_tokens=2)
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["message"], error["param"]) == (message, "prompt")


def test_server_still_serves_after_bad_requests_and_logs_each(server, client, model_id):
    base, log_path = server
    response = client.chat.completions.create(
        model=model_id, messages=_messages("still alive?"), max_tokens=3
    )
    assert response.choices[0].finish_reason in ("stop", "length")
    log = log_path.read_text()
    assert "Traceback" not in log
    assert " 401 " in log and " 413 " in log and " 404 " in log
    assert "tok/cycle" in log


def test_cors_is_off_unless_origins_are_allowed(server, model_id):
    base, _ = server
    response = httpx.get(
        base + "/v1/models", headers={"Origin": "http://evil.example", "Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


@pytest.mark.parametrize("stream", [False, True])
def test_request_timeout_is_a_504_in_the_openai_shape(engine, stream):
    """In-process app (same code as the served one) with a timeout that has always passed. /metrics
    counts it as a timeout abort, not a finish; the next request served is one finish, whose
    first-token wait the histograms hold bucket by bucket."""
    from mtplx.server.app import create_app
    from mtplx.server.settings import ServerSettings
    from mtplx.server.worker import GenerationWorker

    from fastapi.testclient import TestClient

    worker = GenerationWorker(engine, max_queue=4)
    worker.start()
    try:
        app = create_app(worker, ServerSettings(model_id="tiny", request_timeout=1e-9))
        with TestClient(app) as http:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            response = http.post("/v1/chat/completions", json={**body, "stream": stream})
            assert response.status_code == 504
            assert response.json()["error"]["code"] == "timeout"
            timeouts = ("mtplx_request_aborted_total", (("reason", "timeout"),))
            wait_for(lambda: _scrape(http).get(timeouts) == 1)  # the worker may see it after the 504
            ok = create_app(worker, ServerSettings(model_id="tiny"))
            with TestClient(ok) as http2:
                reply = http2.post("/v1/chat/completions", json=body).json()
                assert reply["choices"][0]["finish_reason"] in ("stop", "length")
                after = _scrape(http2)
    finally:
        worker.stop()
    assert after[timeouts] == 1 and after.get(("mtplx_request_aborted_total", (("reason", "error"),)), 0) == 0
    finished = {"stop": 0, "length": 0, reply["choices"][0]["finish_reason"]: 1}
    for reason, count in finished.items():
        assert _delta(after, {}, "mtplx_request_success_total", finished_reason=reason) == count, reason
    _assert_latency_histograms(after, {}, [reply["mtplx"]["prefill_seconds"]])


def test_a_failed_scheduler_step_fails_the_jobs_in_flight_and_the_worker_serves_on(engine, monkeypatch):
    """A step that raises (a bug, not a user error; injected here) ends the worker's drive loop:
    every job in flight is a 500 and an error abort in /metrics, the scheduler drops its rows, and
    the worker drives on: the next request gets the tokens it gets alone. Without the recovery the
    generation thread dies and the next request times out (a 504 here)."""
    from mtplx.engine.scheduler import BatchScheduler
    from mtplx.server.app import create_app
    from mtplx.server.settings import ServerSettings
    from mtplx.server.worker import GenerationWorker

    from fastapi.testclient import TestClient

    honest_step, failures = BatchScheduler.step, [1]

    def failing_once(self):
        if failures:
            failures.pop()
            raise RuntimeError("injected step failure")
        return honest_step(self)

    monkeypatch.setattr(BatchScheduler, "step", failing_once)
    worker = GenerationWorker(engine, max_queue=4)
    worker.start()
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    try:
        app = create_app(worker, ServerSettings(model_id="tiny", request_timeout=60))
        with TestClient(app) as http:
            failed = http.post("/v1/completions", json=body)
            served = http.post("/v1/completions", json=body)
            scraped = _scrape(http)
    finally:
        worker.stop()
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    expected = engine.generate("Once upon a time", max_tokens=4, temperature=0.0, chat=False)
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == expected.text
    assert scraped[("mtplx_request_aborted_total", (("reason", "error"),))] == 1
    assert worker.running == 0 and not worker.busy


def test_every_v1_route_needs_the_key_and_health_does_not(server, model_id):
    base, _ = server
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{model_id}"),
        ("POST", "/v1/completions"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            response = httpx.request(method, base + path, json={}, headers=headers)
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/health").status_code == 200


def _metrics(base: str) -> dict[tuple[str, tuple], float]:
    """GET /metrics parsed: {(sample name, its labels): value}."""
    with httpx.Client(base_url=base) as http:
        return _scrape(http)


def _scrape(http) -> dict[tuple[str, tuple], float]:
    """GET /metrics through ``http`` (an httpx or FastAPI test client), parsed as `_metrics` does."""
    response = http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _assert_latency_histograms(after: dict, before: dict, first_token_waits: list[float]) -> None:
    """Between two scrapes, bucket by bucket: the time-to-first-token histogram gained exactly the
    finished requests' reported waits (the usage's ``prefill_seconds``: the first token is prefill's);
    the end-to-end latency histogram gained as many requests, and in no bucket more than the first
    one did (a request ends no earlier than its first token)."""
    ttft, latency = "mtplx_time_to_first_token_seconds", "mtplx_e2e_request_latency_seconds"
    bounds = [dict(labels)["le"] for name, labels in after if name == f"{ttft}_bucket"]
    assert len(bounds) > 2 and "+Inf" in bounds, bounds
    for le in bounds:
        want = sum(wait <= float(le) for wait in first_token_waits)
        assert _delta(after, before, f"{ttft}_bucket", le=le) == want, (le, first_token_waits)
        assert _delta(after, before, f"{latency}_bucket", le=le) <= want, le
    assert _delta(after, before, f"{latency}_count") == len(first_token_waits)
    assert _delta(after, before, f"{latency}_bucket", le="+Inf") == len(first_token_waits)


def _delta(after: dict, before: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_count_what_the_responses_report(server, client, model_id):
    """/metrics moves by exactly what the finished responses report in their usage: prompt, cached
    and completion tokens, finish reasons, one time-to-first-token and one latency observation
    each, the head's drafted and accepted tokens as the usage's mtplx field counts them; the
    running gauge counts the rows while they decode, the prompt cache's bytes are within its limit
    and inside MLX's active memory, and afterwards nothing runs or waits. A request cancelled mid-stream runs, then counts as aborted,
    not as finished. The API key guards the route."""
    base, _ = server
    assert httpx.get(base + "/metrics").status_code == 401

    def idle() -> bool:
        load = _metrics(base)
        return load[("mtplx_num_requests_running", ())] == load[("mtplx_num_requests_waiting", ())] == 0

    wait_for(idle)
    before = _metrics(base)

    def one(i: int, max_tokens: int) -> tuple:
        """(usage, the mtplx field, finish reasons) of one chat request; the second one streams."""
        messages = _messages(f"Count the metrics, request {i}.")
        if i == 1:
            chunks = list(
                client.chat.completions.create(
                    model=model_id,
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=0.8,
                    seed=7,  # a seeded row drafts its depth every cycle (the policy would not here)
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            return chunks[-1].usage, chunks[-1].model_extra["mtplx"], reasons
        response = client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=max_tokens, temperature=0
        )
        return response.usage, response.model_extra["mtplx"], [response.choices[0].finish_reason]

    running_seen = []  # what the gauge said while the three requests were in flight
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, i, n) for i, n in enumerate((24, 32, 40))]
        while not all(f.done() for f in futures):
            running_seen.append(_metrics(base)[("mtplx_num_requests_running", ())])
    usages, extras, reasons = zip(*(f.result() for f in futures))
    reasons = [r for rs in reasons for r in rs]
    assert max(running_seen) >= 2  # rows decoding together (measured here: 3 for most polls)
    # The finished requests' caches went to the prompt cache (on by default), which MLX holds.
    load = _metrics(base)
    active, held = load[("mtplx_memory_active_bytes", ())], load[("mtplx_prompt_cache_bytes", ())]
    assert 0 < held <= load[("mtplx_prompt_cache_capacity_bytes", ())] and active > held
    # One more, abandoned after its first chunk (as in the disconnect test): aborted, not finished.
    body = dict(
        model=model_id, messages=_messages("Go on and on."), max_tokens=200, temperature=0, stream=True
    )
    with _stream_lines(base, body) as response:
        assert next(response.iter_lines()).startswith("data: ")
    wait_for(
        lambda: (
            idle() and _delta(_metrics(base), before, "mtplx_request_aborted_total", reason="cancelled") == 1
        )
    )
    after = _metrics(base)
    assert _delta(after, before, "mtplx_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert _delta(after, before, "mtplx_prompt_cached_tokens_total") == sum(
        u.prompt_tokens_details.cached_tokens for u in usages
    )
    assert _delta(after, before, "mtplx_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    for reason in ("stop", "length"):
        assert _delta(after, before, "mtplx_request_success_total", finished_reason=reason) == reasons.count(
            reason
        )
    assert _delta(after, before, "mtplx_request_aborted_total", reason="cancelled") == 1
    assert _delta(after, before, "mtplx_time_to_first_token_seconds_count") == 3
    assert _delta(after, before, "mtplx_e2e_request_latency_seconds_count") == 3
    head = [extra["drafters"].get("head", {"drafted": 0, "accepted": 0}) for extra in extras]
    assert sum(h["drafted"] for h in head) > 0  # the seeded request drafted
    for kind, name in [("drafted", "num_draft_tokens"), ("accepted", "num_accepted_tokens")]:
        counted = _delta(after, before, f"mtplx_spec_decode_{name}_total", drafter="head")
        assert counted == sum(h[kind] for h in head), kind
    cycles = [e["drafted_per_position"] for e in extras]
    assert _delta(after, before, "mtplx_spec_decode_num_drafts_total") == sum(c[0] for c in cycles if c)
    per_position = [
        _delta(after, before, "mtplx_spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(1, 1 + max(len(c) for c in cycles))
    ]
    # Counted per position, they add up to the drafters' own accepted counts; a later position is
    # kept only after the earlier one.
    assert sum(per_position) == sum(d["accepted"] for e in extras for d in e["drafters"].values())
    assert per_position == sorted(per_position, reverse=True)
    _assert_latency_histograms(after, before, [extra["prefill_seconds"] for extra in extras])


def test_sampler_fields_reach_the_engine(client, engine, model_id):
    """stop, penalties, top_k, min_p and logit_bias through the server equal the engine's own run."""
    messages = _messages("Sampler fields, all at once.")
    sampler = dict(
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        min_p=0.02,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        seed=7,
        logit_bias={11: 2.0, 12: -100.0},
    )
    free = engine.generate(messages, max_tokens=12, **sampler)
    assert len(free.token_ids) == 12
    # A stop string taken from the middle of the unstopped output: it must end the text there.
    stop = engine.tokenizer.decode(free.token_ids[5:7])
    expected = engine.generate(messages, max_tokens=12, stop=[stop, "\x00never"], **sampler)
    assert expected.finish_reason == "stop" and len(expected.text) < len(free.text)
    extra = {"top_k": 50, "min_p": 0.02, "repetition_penalty": 1.1}
    fields = {k: v for k, v in sampler.items() if k not in extra}
    fields["logit_bias"] = {str(k): v for k, v in sampler["logit_bias"].items()}
    response = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=12, stop=[stop, "\x00never"], extra_body=extra, **fields
    )
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ a second server: damaged checkpoint, no key

NAN_TOKEN = 40000  # the damaged checkpoint's embedding row for this token id is NaN


@pytest.fixture(scope="module")
def damaged_model_dir(model_dir, tmp_path_factory) -> Path:
    """The served checkpoint with one embedding row overwritten by NaN.

    A real way for generation to fail inside the server (as a bad conversion or a corrupted
    download leaves a checkpoint): the engine's NaN check raises when a request reads that
    token, while requests that never read it are served exactly as by the undamaged model.
    """
    import mlx.core as mx

    path = tmp_path_factory.mktemp("damaged") / "tiny-mimo"
    shutil.copytree(model_dir, path)
    tensors = mx.load(str(path / "model.safetensors"))
    weight = tensors["model.embed_tokens.weight"]
    row = mx.arange(weight.shape[0])[:, None] == NAN_TOKEN
    tensors["model.embed_tokens.weight"] = mx.where(row, mx.array(float("nan"), weight.dtype), weight)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, {"format": "pt"})
    return path


ALLOWED_ORIGIN = "http://editor.example"


@pytest.fixture(scope="module")
def open_server(damaged_model_dir, tmp_path_factory):
    """No API key, bound to 127.0.0.1, CORS allowed for one origin, serving the damaged checkpoint."""
    log_path = tmp_path_factory.mktemp("log") / "open-server.log"
    flags = ["--depth", "2", "--allowed-origins", ALLOWED_ORIGIN]
    with running_server(damaged_model_dir, log_path, *flags, api_key=None) as running:
        yield running


@pytest.fixture(scope="module")
def open_client(open_server):
    return openai.OpenAI(base_url=open_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def _assert_internal_error_body(error: dict) -> None:
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error"
    message = error["message"]
    assert "\n" not in message and "details in the server log" in message
    for leak in ("Traceback", "ValueError", "NaN", "File ", ".py"):
        assert leak not in message


def test_internal_failure_is_a_500_and_the_next_request_is_served(open_server, open_client, engine):
    """Both failures are error aborts in /metrics, not finishes; the two served after them are
    finishes, their first-token waits in the histograms bucket by bucket."""
    base, log_path = open_server
    model_id = open_client.models.list().data[0].id
    before = _metrics(base)
    prefix = engine.encode_prompt("Once upon a time there was", chat=False)
    with pytest.raises(openai.InternalServerError) as info:
        open_client.completions.create(
            model=model_id, prompt=[*prefix, NAN_TOKEN], max_tokens=6, temperature=0
        )
    assert info.value.status_code == 500
    _assert_internal_error_body(info.value.response.json()["error"])
    # A stream opens before the prefill (issue 50), so its failure is the error event that ends it.
    with pytest.raises(openai.APIError) as streamed:
        stream = open_client.completions.create(
            model=model_id, prompt=[*prefix, NAN_TOKEN], max_tokens=6, temperature=0, stream=True
        )
        list(stream)
    _assert_internal_error_body(streamed.value.body)

    # The details went to the server log, not to the client. The request line is logged when the
    # request ends, which may be just after the client saw the 500: wait for it (bounded).
    def failed_lines() -> int:
        lines = log_path.read_text().splitlines()
        return len([line for line in lines if "/v1/completions 500" in line or "(error: internal" in line])

    wait_for(lambda: failed_lines() >= 2)
    log = log_path.read_text()
    assert "Traceback" in log and "logits contain NaN" in log
    assert failed_lines() == 2
    # The next requests (one sharing the failed prompt's prefix) are served exactly.
    waits, reasons = [], []
    for prompt in ([*prefix, 11, 12], "A different prompt"):
        expected = engine.generate(prompt, max_tokens=8, temperature=0.0, chat=False)
        assert NAN_TOKEN not in expected.token_ids
        response = open_client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
        assert response.choices[0].text == expected.text
        assert response.usage.completion_tokens == len(expected.token_ids)
        waits.append(response.model_extra["mtplx"]["prefill_seconds"])
        reasons.append(response.choices[0].finish_reason)
    after = _metrics(base)
    assert _delta(after, before, "mtplx_request_aborted_total", reason="error") == 2
    assert _delta(after, before, "mtplx_request_aborted_total", reason="timeout") == 0
    for reason in ("stop", "length"):
        assert _delta(after, before, "mtplx_request_success_total", finished_reason=reason) == reasons.count(
            reason
        )
    _assert_latency_histograms(after, before, waits)


def test_failure_after_streaming_began_ends_the_stream_with_an_error_event(open_server, open_client, engine):
    base, _ = open_server
    model_id = open_client.models.list().data[0].id
    # The bias makes the damaged token the first one generated: the next forward pass reads it.
    body = dict(
        model=model_id,
        messages=_messages("Anything."),
        max_tokens=8,
        temperature=0,
        stream=True,
        logit_bias={str(NAN_TOKEN): 100},
    )
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1].keys() == {"error"}
    _assert_internal_error_body(events[-1]["error"])
    generated = [e for e in events[1:-1] if e["choices"]]
    assert generated and all(e["choices"][0]["finish_reason"] is None for e in generated)
    # The openai client raises on the error event.
    with pytest.raises(openai.APIError):
        list(open_client.chat.completions.create(**body))
    # The next chat is served exactly.
    messages = _messages("After a failed stream.")
    expected = engine.generate(messages, max_tokens=8, temperature=0.0)
    response = open_client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=8, temperature=0
    )
    assert response.choices[0].message.content == expected.text


def test_no_key_on_loopback_serves_without_auth_and_does_not_warn(open_server, open_client):
    base, log_path = open_server
    assert open_client.models.list().data
    assert httpx.get(base + "/v1/models").status_code == 200  # no Authorization header at all
    assert "without an API key" not in log_path.read_text()


def test_cors_answers_only_the_allowed_origin(open_server):
    base, _ = open_server
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = httpx.options(base + "/v1/chat/completions", headers={"Origin": ALLOWED_ORIGIN, **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    other = httpx.options(
        base + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight}
    )
    assert "access-control-allow-origin" not in other.headers
    simple = httpx.get(base + "/v1/models", headers={"Origin": ALLOWED_ORIGIN})
    assert simple.headers["access-control-allow-origin"] == ALLOWED_ORIGIN


@pytest.mark.parametrize("with_key", [False, True])
def test_binding_a_non_local_address_without_a_key_warns(model_dir, tmp_path, with_key):
    log_path = tmp_path / "server.log"
    key = KEY if with_key else None
    with running_server(model_dir, log_path, "--host", "0.0.0.0", api_key=key) as (base, _):
        log = log_path.read_text()
        status = httpx.get(base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code
    assert status == 200
    warned = [line for line in log.splitlines() if "without an API key" in line]
    if with_key:
        assert not warned
    else:
        assert len(warned) == 1 and "WARNING" in warned[0] and "0.0.0.0" in warned[0]


def test_omitted_max_tokens_defaults_to_what_the_context_leaves(open_client, engine):
    """Without max_tokens a request gets min(512, context - prompt): here 256 - 250 = 6 tokens."""
    model_id = open_client.models.list().data[0].id
    words = engine.encode_prompt("the cache keeps every turn of the chat " * 40, chat=False)
    prompt = [t for t in words if t != NAN_TOKEN][:250]
    assert len(prompt) == 250
    expected = engine.generate(prompt, max_tokens=6, temperature=0.0, chat=False)
    response = open_client.completions.create(model=model_id, prompt=prompt, temperature=0)
    assert response.choices[0].text == expected.text
    assert response.usage.completion_tokens == len(expected.token_ids) <= 6
    assert response.choices[0].finish_reason == expected.finish_reason


REPEATING = "Copy this line twice: the quick brown fox jumps over the lazy dog, the quick brown fox jumps"


def test_serve_sampling_and_drafting_flags_are_the_defaults_of_omitted_fields(
    model_dir, tmp_path, server, engine
):
    """`mtplx serve --draft lookup --temp 0`: a request that names neither decodes greedily with prompt
    lookup only, exactly as the engine does with those arguments; the default server (auto drafting,
    the head) answers the same request with head drafts (the control that the flag changed something)."""
    request = dict(prompt=REPEATING, max_tokens=24)
    expected = engine.generate(REPEATING, max_tokens=24, temperature=0.0, draft="lookup", chat=False)
    flags = ["--draft", "lookup", "--temp", "0", "--depth", "2"]
    with running_server(model_dir, tmp_path / "lookup.log", *flags) as (base, _):
        body = httpx.post(
            base + "/v1/completions",
            json={"model": str(model_dir), **request},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        ).json()
    assert body["choices"][0]["text"] == expected.text
    assert body["mtplx"]["mode"] == "mtp" and set(body["mtplx"]["drafters"]) <= {"lookup"}
    auto = httpx.post(  # seeded: its draft length is pinned (the draft policy does not choose)
        server[0] + "/v1/completions",
        json={"model": str(model_dir), **request, "temperature": 0, "seed": 1},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    ).json()
    assert "head" in auto["mtplx"]["drafters"]


def test_a_later_start_reuses_the_batch_cost_profile_measured_before(
    model_dir, engine, tmp_path, monkeypatch
):
    """`mtplx serve` times a batched cycle (`draft_policy.measure_cost_profile`) only where no profile
    was saved for the same model, head and versions on this machine (`tuned.engine_batch_cost`):
    after this process's engine of the same directory measured it into a fresh store, the server
    process reads it (its log says so) and measures nothing. Control: the store empty before."""
    from mtplx.engine import tuned

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert tuned.saved_batch_cost(engine.fingerprint, identity=tuned.batch_cost_identity(engine)) is None
    measured = tuned.engine_batch_cost(engine)
    log_path = tmp_path / "server.log"
    with running_server(model_dir, log_path, "--depth", "2"):
        wait_for(lambda: "batch cost profile" in log_path.read_text())
    log = log_path.read_text()
    assert "measured here before" in log and "measured, saved" not in log, log
    assert tuned.saved_batch_cost(engine.fingerprint, identity=tuned.batch_cost_identity(engine)) == measured
