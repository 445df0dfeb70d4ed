"""`mtplx serve` benchmark on the default model: decode speed, prompt-cache TTFT, and a soak.

1. Streaming decode tokens/s through the server (openai client, SSE) vs `Engine.generate`
   in this process, interleaved (engine, server, engine, server, ...; the server is idle
   while the engine runs), median of paired ratios.
2. Time to first token of turn 2 of a chat, with the prompt cache vs a server started
   with ``--prompt-cache-bytes 0`` (the servers run one after the other).
3. Soak: mixed requests (chat / completion, streamed or not, some concurrent, some
   abandoned mid-stream); every finished response must be complete, and the server's
   resident memory at the end must be within 10% of its level after a warm-up.

    python benchmarks/bench_server.py              # the full run (minutes on a laptop)
    python benchmarks/bench_server.py --short      # a quick version (noisy machines)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = (
    "You are a careful assistant. Answer clearly, explain your reasoning step by step when it helps, "
    "prefer short paragraphs, and give a code example when the question is about programming. "
) * 4
QUESTIONS = [
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a hash map.",
    "What is the difference between a process and a thread?",
    "Summarize the plot of Hamlet in three sentences.",
    "How does binary search work?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("MTPLX_API_KEY", None)
        self.log = open(Path(tempfile.gettempdir()) / f"mtplx-bench-server-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mtplx", "serve", "--port", str(self.port), *flags],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: see {self.log.name}")
            try:
                self.model = httpx.get(self.base + "/health", timeout=2).json()["model"]
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise SystemExit("server did not start") from None
                time.sleep(0.5)
        self.client = openai.OpenAI(base_url=self.base + "/v1", api_key="none", max_retries=0, timeout=600)

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stream_chat(self, messages: list[dict], max_tokens: int) -> dict:
        """Streams one chat; returns ttft, decode tokens/s (first token to last) and usage."""
        start = time.perf_counter()
        first = last = None
        usage = None
        pieces = 0
        for chunk in self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ):
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                pieces += 1
                first = first or now
                last = now
            if chunk.usage is not None:
                usage = chunk.usage
        n = usage.completion_tokens
        return {
            "ttft": (first or start) - start,
            "tok_s": (n - 1) / (last - first) if first and last and last > first else 0.0,
            "tokens": n,
            "cached": usage.prompt_tokens_details.cached_tokens,
            "prompt": usage.prompt_tokens,
        }

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def bench_decode(server: Server, rounds: int, max_tokens: int) -> dict:
    from mtplx.engine.engine import Engine

    engine = Engine.load()
    pairs = []
    for i in range(rounds):
        messages = _messages(QUESTIONS[i % len(QUESTIONS)])
        local = engine.generate(messages, max_tokens=max_tokens, temperature=0.0)
        remote = server.stream_chat(messages, max_tokens)
        assert remote["tokens"] == len(local.token_ids)
        pairs.append((local.stats.decode_tokens_per_sec, remote["tok_s"]))
        print(
            f"  decode round {i}: engine {pairs[-1][0]:.2f} tok/s, server {pairs[-1][1]:.2f} tok/s",
            flush=True,
        )
    del engine
    return {
        "engine_tok_s": statistics.median(p[0] for p in pairs),
        "server_tok_s": statistics.median(p[1] for p in pairs),
        "ratio_median": statistics.median(p[1] / p[0] for p in pairs),
        "rounds": rounds,
        "max_tokens": max_tokens,
    }


def bench_turn2_ttft(server: Server, rounds: int) -> list[dict]:
    out = []
    for i in range(rounds):
        messages = _messages(f"{QUESTIONS[i % len(QUESTIONS)]} (conversation {i}, {random.random()})")
        first = server.client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=32, temperature=0
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Thanks. Now say it in one sentence."},
        ]
        out.append(server.stream_chat(messages, 4))
        print(
            f"  turn 2: ttft {out[-1]['ttft'] * 1000:.0f} ms, cached {out[-1]['cached']}/{out[-1]['prompt']}"
        )
    return out


def soak(server: Server, requests: int, warmup: int) -> dict:
    rng = random.Random(0)
    problems: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        kind = rng.choice(["chat", "chat-stream", "completion", "completion-stream", "cancel"])
        question = rng.choice(QUESTIONS) + f" #{i % 17}"
        max_tokens = rng.randint(2, 12)
        try:
            if kind == "chat":
                r = server.client.chat.completions.create(
                    model=server.model, messages=_messages(question), max_tokens=max_tokens, temperature=0.7
                )
                ok = r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
            elif kind == "completion":
                r = server.client.completions.create(
                    model=server.model, prompt=question, max_tokens=max_tokens
                )
                ok = r.choices[0].finish_reason in ("stop", "length")
            elif kind.endswith("stream"):
                body = {"model": server.model, "max_tokens": max_tokens, "stream": True}
                path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
                body.update(
                    {"messages": _messages(question)} if kind.startswith("chat") else {"prompt": question}
                )
                with httpx.stream("POST", server.base + path, json=body, timeout=600) as resp:
                    lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
                finishes = [
                    json.loads(line[6:])["choices"][0].get("finish_reason")
                    for line in lines[:-1]
                    if json.loads(line[6:])["choices"]
                ]
                ok = lines[-1] == "data: [DONE]" and finishes[-1] in ("stop", "length")
            else:  # abandon a stream after its first event
                body = {
                    "model": server.model,
                    "messages": _messages(question),
                    "max_tokens": 200,
                    "stream": True,
                }
                with httpx.stream(
                    "POST", server.base + "/v1/chat/completions", json=body, timeout=600
                ) as resp:
                    next(resp.iter_lines())
                ok = True
        except Exception as err:  # counted, not raised: the soak reports every failure
            ok = False
            kind += f" ({type(err).__name__}: {err})"
        if not ok:
            with lock:
                problems.append(f"request {i}: {kind}")

    def run(indices: range, concurrency: int) -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, indices))

    run(range(warmup), 4)
    time.sleep(1)
    warm = server.rss_mb()
    start = time.perf_counter()
    run(range(warmup, requests), 4)
    time.sleep(2)
    end = server.rss_mb()
    return {
        "requests": requests,
        "warmup": warmup,
        "seconds": time.perf_counter() - start,
        "rss_warm_mb": warm,
        "rss_end_mb": end,
        "rss_ratio": end / warm,
        "incomplete": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", action="store_true", help="fewer rounds and requests")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    rounds, max_tokens, ttft_rounds, soak_n = (3, 32, 3, 60) if args.short else (7, 128, 5, 300)
    results: dict = {}

    print("server with the prompt cache (64 MiB for the soak's steady state):", flush=True)
    server = Server("--prompt-cache-bytes", str(64 * 1024**2))
    try:
        results["decode"] = bench_decode(server, rounds, max_tokens)
        results["turn2_cached"] = bench_turn2_ttft(server, ttft_rounds)
        results["soak"] = soak(server, soak_n, warmup=max(20, soak_n // 10))
    finally:
        server.close()
    print("server without the prompt cache:", flush=True)
    server = Server("--prompt-cache-bytes", "0")
    try:
        results["turn2_uncached"] = bench_turn2_ttft(server, ttft_rounds)
    finally:
        server.close()
    cached = statistics.median(r["ttft"] for r in results["turn2_cached"])
    uncached = statistics.median(r["ttft"] for r in results["turn2_uncached"])
    results["turn2_ttft_speedup"] = uncached / cached
    summary = {
        "decode server/engine": round(results["decode"]["ratio_median"], 3),
        "turn-2 TTFT cached / uncached (ms)": (round(cached * 1000), round(uncached * 1000)),
        "turn-2 TTFT speed-up": round(results["turn2_ttft_speedup"], 2),
        "soak RSS end / warm": round(results["soak"]["rss_ratio"], 3),
        "soak incomplete": len(results["soak"]["incomplete"]),
    }
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
