"""Soak the continuous-batching scheduler: a few hundred mixed requests, some cancelled mid-run.

Drives `Engine.batch()` exactly as `mtplx serve`'s worker does (submit between cycles, one
`step` per cycle, cancel by handle) on the default model with its head, the prompt cache off
(a cache filling with distinct conversations is growth by design). Requests mix temperatures,
filters, penalties, drafters, seeds and lengths; a share is cancelled after a random number of
cycles. At the end every request that was not cancelled must have ended with a finish reason
and at most its ``max_tokens``, and ``mx.get_active_memory()`` after ``mx.clear_cache()`` must
be within 10% of its warm level (measured the same way after a warm-up round).

    python benchmarks/batch_soak.py                 # 300 requests, 16 in flight
    python benchmarks/batch_soak.py --requests 60   # a quick one

Writes benchmarks/results/batch-soak.json; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine.request import GenerationRequest

import mlx.core as mx
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
TOPICS = ["the sea", "caches", "a hash map", "gravity", "bread", "Python lists", "the moon", "trains"]
ASKS = ["Write a haiku about {}.", "Explain {} in two sentences.", "List three facts about {}.", "{}?"]


def _request(rng: random.Random) -> GenerationRequest:
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    return GenerationRequest.from_kwargs(
        max_tokens=rng.randint(4, 64),
        temperature=temperature,
        top_p=rng.choice([1.0, 0.9]) if temperature else 1.0,
        top_k=rng.choice([0, 0, 40]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
        seed=rng.choice([None, rng.randrange(10**6)]),
        draft=rng.choice(["auto", "auto", "head", "none", "lookup"]),
    )


def _prompt(rng: random.Random) -> list[dict]:
    return [{"role": "user", "content": rng.choice(ASKS).format(rng.choice(TOPICS))}]


def _memory() -> int:
    mx.clear_cache()
    return mx.get_active_memory()


def run(engine: Engine, num_requests: int, in_flight: int, cancel_share: float, seed: int) -> dict:
    rng = random.Random(seed)
    scheduler = engine.batch(max_rows=in_flight)
    # Warm-up: every code path once (a batch of mixed requests to the end), then the baseline.
    warm = [_request(rng) for _ in range(in_flight)]
    engine.generate_batch([_prompt(rng) for _ in warm], warm, max_rows=in_flight)
    warm_bytes = _memory()

    pending = [(_prompt(rng), _request(rng)) for _ in range(num_requests)]
    cancel_after = {i: rng.randint(0, 6) for i in range(num_requests) if rng.random() < cancel_share}
    running: dict[int, tuple[int, int]] = {}  # handle -> (request index, cycles seen)
    finished: dict[int, str] = {}
    produced = [0] * num_requests
    cancelled: set[int] = set()
    next_index = 0
    start = time.perf_counter()
    with tqdm(total=num_requests, unit="request", file=sys.stderr) as bar:
        while next_index < num_requests or running:
            while next_index < num_requests and len(running) < in_flight:
                prompt, request = pending[next_index]
                running[scheduler.submit(prompt, request)] = (next_index, 0)
                next_index += 1
            for handle, (index, cycles) in list(running.items()):
                if cancel_after.get(index) == cycles:
                    scheduler.cancel(handle)
                    cancelled.add(index)
                    del running[handle]
                    bar.update(1)
                else:
                    running[handle] = (index, cycles + 1)
            for result in scheduler.step():
                if result.handle not in running:
                    continue
                index = running[result.handle][0]
                if result.error is not None:
                    finished[index] = f"error: {result.error}"
                else:
                    produced[index] += len(result.chunk.token_ids)
                if result.done:
                    if result.error is None:
                        finished[index] = result.chunk.finish_reason
                    del running[result.handle]
                    bar.update(1)
    seconds = time.perf_counter() - start
    scheduler.close()
    end_bytes = _memory()
    served = [i for i in range(num_requests) if i not in cancelled]
    incomplete = [
        i
        for i in served
        if finished.get(i) not in ("stop", "length") or produced[i] > pending[i][1].max_tokens
    ]
    growth = (end_bytes - warm_bytes) / warm_bytes
    return {
        "requests": num_requests,
        "in_flight": in_flight,
        "cancelled": len(cancelled),
        "served": len(served),
        "incomplete": incomplete,
        "generated_tokens": sum(produced),
        "seconds": round(seconds, 1),
        "tokens_per_sec": round(sum(produced) / seconds, 2),
        "warm_active_bytes": warm_bytes,
        "end_active_bytes": end_bytes,
        "growth": round(growth, 4),
        "ok": not incomplete and growth <= 0.10,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--cancel-share", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "batch-soak.json")
    args = parser.parse_args()
    engine = Engine.load()
    report = run(engine, args.requests, args.in_flight, args.cancel_share, args.seed)
    report["command"] = " ".join(["python", "benchmarks/batch_soak.py", *sys.argv[1:]])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "incomplete"}, indent=1))
    if report["incomplete"]:
        print(f"incomplete responses: {report['incomplete'][:10]}", file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
