"""`mtplx serve` vs `mlx_lm.server` on the default model: aggregate throughput at N concurrent clients.

Both servers serve the same weights (the float32 mlx directory mtplx converts the default
model into) and run one at a time, started and stopped by this script; the order alternates
across repetitions (mtplx, stock, stock, mtplx, ...) and medians over repetitions are quoted.
The stock server gets the optimized BLAS that `import mtplx` loads, through ``LD_PRELOAD``;
a matmul GFLOP/s check with and without the preload, and the running server's
``/proc/PID/maps``, say whether it took.

A round is C client threads (the `openai` client, streaming chat completions, no ``seed``:
a seed stops mlx_lm.server from batching), each sending R requests back to back, at one
temperature; the figure is aggregate tokens/s = completion tokens (from the stream's usage)
/ wall time of the round (so every request's prefill is in it), plus the median time to first token per request and, where the
mtplx server reports it, the median tokens per cycle. Every request's prompt is a suite prompt
with a request tag in front (the same for both servers), so neither server's prompt cache
turns a round into cache hits.

    python benchmarks/serve_concurrency.py                 # the full run (an hour on 2 cores)
    python benchmarks/serve_concurrency.py --short         # a smoke run (clients 1,2; 32 tokens)
    python benchmarks/serve_concurrency.py --mtplx-arg=--decode-concurrency=8 --stock-arg=--decode-concurrency=8
    python benchmarks/serve_concurrency.py --merge a.json b.json --out all.json   # one table from runs

Writes benchmarks/results/serve-concurrency.json (serve-concurrency-short.json with --short)
and a .png beside it. ``--stock-arg`` replaces the stock server's default flags
(``--decode-concurrency 16 --prompt-concurrency 8``, those that its version has).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mtplx
from mtplx.bench.suite import Prompt, load_prompts
from mtplx.checkpoints.load import resolve_model
from mtplx.io import atomic_path, atomic_write

import httpx
import openai
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SERVERS = ("mtplx", "stock")
STOCK_DEFAULT_ARGS = (("--decode-concurrency", "16"), ("--prompt-concurrency", "8"))
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 600.0
GFLOPS_CODE = """
import time
import mlx.core as mx
a = mx.random.normal((512, 512))
mx.eval(a @ a)
start = time.perf_counter()
for _ in range(20):
    mx.eval(a @ a)
print(20 * 2 * 512**3 / (time.perf_counter() - start) / 1e9)
"""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]  # the command, less --port
    env: dict[str, str]
    model_id: str | None  # the model name requests send; None: the first id /v1/models lists


@dataclass(frozen=True)
class RunningServer:
    spec: ServerSpec
    proc: subprocess.Popen
    base: str
    model_id: str
    log_path: Path


@dataclass(frozen=True)
class RequestResult:
    tokens: int
    ttft_s: float | None
    tokens_per_cycle: float | None  # from the mtplx server's stats, where it reports them
    error: str | None = None
    start_s: float | None = None  # when the request was sent, in seconds from the round's start
    end_s: float | None = None  # when the stream ended, in seconds from the round's start


@dataclass(frozen=True)
class RoundResult:
    server: str
    temperature: float
    clients: int
    repetition: int
    wall_s: float
    requests: list[RequestResult]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s

    def summary(self) -> dict:
        return {
            "server": self.server,
            "temperature": self.temperature,
            "clients": self.clients,
            "repetition": self.repetition,
            "wall_s": self.wall_s,
            "tokens": self.tokens,
            "tok_s": self.tok_s,
            "request_tokens": [r.tokens for r in self.requests],
            "start_s": [r.start_s for r in self.requests],
            "ttft_s": [r.ttft_s for r in self.requests],
            "tokens_per_cycle": [r.tokens_per_cycle for r in self.requests],
            "end_s": [r.end_s for r in self.requests],
            "errors": [r.error for r in self.requests if r.error is not None],
        }


@dataclass(frozen=True)
class Session:
    """One start of one server: seconds to its first answer (warm-up included), whether OpenBLAS was mapped."""

    server: str
    repetition: int
    ready_s: float
    model_id: str
    openblas_mapped: bool | None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("MTPLX_API_KEY", "LD_PRELOAD"):
        env.pop(name, None)
    return env


def matmul_gflops(env: dict[str, str]) -> float:
    """A 512x512 float32 matmul's GFLOP/s in a fresh `mlx.core` process with ``env``."""
    out = subprocess.run(
        [sys.executable, "-c", GFLOPS_CODE], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


def blas_check(library: str | None) -> dict:
    """GFLOP/s of plain MLX with and without ``LD_PRELOAD=library``."""
    without = matmul_gflops(base_env())
    if library is None:
        return {"library": None, "gflops_without_preload": without, "gflops_with_preload": None}
    with_preload = matmul_gflops(dict(base_env(), LD_PRELOAD=library))
    return {
        "library": library,
        "gflops_without_preload": without,
        "gflops_with_preload": with_preload,
        "speedup": with_preload / without,
    }


def stock_default_args() -> list[str]:
    """``STOCK_DEFAULT_ARGS``, less the flags this mlx-lm's server does not have."""
    usage = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "server", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return [part for flag, value in STOCK_DEFAULT_ARGS if flag in usage for part in (flag, value)]


def server_specs(
    model_path: Path, library: str | None, mtplx_args: list[str], stock_args: list[str]
) -> dict[str, ServerSpec]:
    """`mtplx serve` on its default model (this tree on PYTHONPATH); mlx_lm.server on its directory, BLAS preloaded."""
    mtplx_env = dict(
        base_env(), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    stock_env = dict(base_env(), HF_HUB_OFFLINE="1", **({"LD_PRELOAD": library} if library else {}))
    return {
        "mtplx": ServerSpec("mtplx", (sys.executable, "-m", "mtplx", "serve", *mtplx_args), mtplx_env, None),
        "stock": ServerSpec(
            "stock",
            (sys.executable, "-m", "mlx_lm", "server", "--model", str(model_path), *stock_args),
            stock_env,
            "default_model",  # mlx_lm.server's name for its --model
        ),
    }


def log_tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def openblas_mapped(pid: int, library: str | None) -> bool | None:
    """Whether ``library`` is mapped into process ``pid`` (None: no library to look for)."""
    if library is None:
        return None
    wanted = os.path.realpath(library)
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(line.split()[-1] == wanted for line in maps.splitlines() if len(line.split()) >= 6)


def wait_ready(proc: subprocess.Popen, base: str, name: str, log_path: Path) -> list[str]:
    """The model ids /v1/models lists, once it answers; a SystemExit with the log's tail if the server dies."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise SystemExit(
                f"{name} server exited with status {proc.returncode} before it was ready; "
                f"the end of {log_path}:\n{log_tail(log_path)}"
            )
        try:
            response = httpx.get(base + "/v1/models", timeout=5)
            if response.status_code == 200:
                return [m["id"] for m in response.json()["data"]]
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(
                f"{name} server not ready after {READY_TIMEOUT_S:.0f} s; the end of {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serving(spec: ServerSpec) -> Iterator[RunningServer]:
    port = free_port()
    log_path = Path(tempfile.gettempdir()) / f"serve-concurrency-{spec.name}-{port}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*spec.argv, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=spec.env, cwd=ROOT
        )
        try:
            base = f"http://127.0.0.1:{port}"
            ids = wait_ready(proc, base, spec.name, log_path)
            if spec.model_id is None and not ids:
                raise SystemExit(f"{spec.name} server lists no model at /v1/models")
            yield RunningServer(spec, proc, base, spec.model_id or ids[0], log_path)
        finally:
            stop(proc)


def client_for(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    )


def chat_messages(prompt: Prompt, tag: str) -> list[dict]:
    """``prompt`` as chat messages, ``tag`` in front of the first one (raw prompts become one user turn)."""
    messages = (
        [dict(m) for m in prompt.messages]
        if prompt.messages
        else [{"role": "user", "content": f"Continue this text:\n\n{prompt.text}"}]
    )
    messages[0]["content"] = f"(request {tag})\n{messages[0]['content']}"
    return messages


def tokens_per_cycle(stats: object) -> float | None:
    """The mtplx server's ``tokens_per_cycle`` from the usage chunk's ``mtplx`` field, if it has one."""
    value = stats.get("tokens_per_cycle") if isinstance(stats, dict) else None
    return float(value) if isinstance(value, (int, float)) else None


def stream_one(
    client: openai.OpenAI, model_id: str, messages: list[dict], temperature: float, max_tokens: int
) -> RequestResult:
    """One streamed chat completion: completion tokens from the usage chunk, and time to first token."""
    start = time.perf_counter()
    first = None
    usage = None
    stats = None
    try:
        for chunk in client.chat.completions.create(
            model=model_id,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
        ):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
                stats = (chunk.model_extra or {}).get("mtplx")
    except (openai.OpenAIError, httpx.HTTPError) as err:
        return RequestResult(0, None, None, f"{type(err).__name__}: {err}")
    if usage is None:
        return RequestResult(0, None, None, "the stream carried no usage chunk")
    return RequestResult(
        usage.completion_tokens, None if first is None else first - start, tokens_per_cycle(stats)
    )


def run_round(
    server: RunningServer,
    prompts: list[Prompt],
    *,
    temperature: float,
    clients: int,
    requests: int,
    max_tokens: int,
    repetition: int,
) -> RoundResult:
    """``clients`` threads, each sending ``requests`` requests back to back; the same prompts whichever server."""
    client = client_for(server)

    def one_client(c: int) -> list[RequestResult]:
        results = []
        for j in range(requests):
            n = c * requests + j
            prompt = prompts[(n + repetition * clients * requests) % len(prompts)]
            tag = f"{repetition}.{temperature:g}.{clients}.{n}"
            sent = time.perf_counter() - start
            result = stream_one(client, server.model_id, chat_messages(prompt, tag), temperature, max_tokens)
            results.append(replace(result, start_s=sent, end_s=time.perf_counter() - start))
        return results

    start = time.perf_counter()  # read by one_client: the pool starts below
    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(one_client, range(clients)))
    wall = time.perf_counter() - start
    return RoundResult(
        server.spec.name, temperature, clients, repetition, wall, [r for rs in per_client for r in rs]
    )


def warm_up(server: RunningServer) -> None:
    """One short request (mlx_lm.server loads its model behind a /v1/models that already answers)."""
    messages = [{"role": "user", "content": "Say hello."}]
    result = stream_one(client_for(server), server.model_id, messages, 0.0, 4)
    if result.error is not None:
        raise SystemExit(
            f"{server.spec.name} server: warm-up request failed ({result.error}); "
            f"the end of {server.log_path}:\n{log_tail(server.log_path)}"
        )


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(rounds: list[dict]) -> dict:
    """results[server][temperature][clients]: tok/s per repetition and medians, from round summaries
    (`RoundResult.summary`, as the JSON keeps them)."""
    results: dict = {}
    for r in rounds:
        cell = results.setdefault(r["server"], {}).setdefault(f"{r['temperature']:g}", {})
        cell.setdefault(str(r["clients"]), []).append(r)
    for per_temperature in results.values():
        for per_clients in per_temperature.values():
            for key, cell in per_clients.items():
                errors = [e for r in cell for e in r["errors"]]
                per_clients[key] = {
                    "tok_s": [r["tok_s"] for r in cell],
                    "tok_s_median": statistics.median(r["tok_s"] for r in cell),
                    "ttft_median_s": _median([t for r in cell for t in r["ttft_s"]]),
                    "tokens_per_cycle_median": _median([t for r in cell for t in r["tokens_per_cycle"]]),
                    "requests": sum(len(r["ttft_s"]) for r in cell),
                    "errors": len(errors),
                    "error_messages": sorted(set(errors))[:5],
                }
    return results


def ratios(results: dict) -> dict:
    """mtplx / stock median tok/s per temperature and client count (where both have one)."""
    out: dict = {}
    for temperature, per_clients in results.get("mtplx", {}).items():
        for clients, cell in per_clients.items():
            stock = results.get("stock", {}).get(temperature, {}).get(clients)
            if stock and stock["tok_s_median"] > 0:
                out.setdefault(temperature, {})[clients] = cell["tok_s_median"] / stock["tok_s_median"]
    return out


def git_commit() -> dict:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": importlib.metadata.version("mlx"),
        "mlx_lm": importlib.metadata.version("mlx-lm"),
        "mtplx": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def report(
    config: dict,
    machine: dict,
    blas: dict,
    sessions: list[Session],
    rounds: list[RoundResult],
    complete: bool,
) -> dict:
    stock_mapped = [s.openblas_mapped for s in sessions if s.server == "stock"]
    summaries = [r.summary() for r in rounds]
    results = summarize(summaries)
    return {
        "complete": complete,
        "machine": machine,
        "config": config,
        "blas": dict(blas, stock_preload_active=bool(stock_mapped) and all(stock_mapped)),
        "sessions": [asdict(s) for s in sessions],
        "results": results,
        "ratio_mtplx_over_stock": ratios(results),
        "rounds": summaries,
    }


def merge(paths: list[Path]) -> dict:
    """One table from several runs' JSON files, each cell from exactly one of them (a cell in two
    runs is refused: its rounds would mix code or settings). ``sources`` says which run holds what."""
    sources, rounds, owner = [], [], {}
    max_tokens = set()
    for path in paths:
        try:
            data = json.loads(path.read_text())
            run_rounds, config, machine = data["rounds"], data["config"], data["machine"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise SystemExit(f"--merge {path}: not a serve_concurrency JSON file ({err})") from None
        if not data.get("complete"):
            raise SystemExit(f"--merge {path}: an incomplete run (it stopped before its last round)")
        max_tokens.add(config["max_tokens"])
        cells = {(r["server"], f"{r['temperature']:g}", r["clients"]) for r in run_rounds}
        overlap = sorted(cells & owner.keys())
        if overlap:
            raise SystemExit(f"--merge: the cell {overlap[0]} is in both {owner[overlap[0]]} and {path}")
        owner.update(dict.fromkeys(cells, path))
        rounds.extend(run_rounds)
        sources.append(
            {
                "path": str(path),
                "commit": machine["mtplx"]["commit"],
                "date": machine["date"],
                "clients": config["clients"],
                "temperatures": config["temperatures"],
                "requests_per_client": config["requests_per_client"],
                "repetitions": config["repetitions"],
                "blas": data["blas"],
            }
        )
    if len(max_tokens) != 1:
        raise SystemExit(f"--merge: the runs differ in max_tokens ({sorted(max_tokens)})")
    results = summarize(rounds)
    return {
        "complete": True,
        "machine": machine,  # the last run's
        "config": {
            "clients": sorted({r["clients"] for r in rounds}),
            "temperatures": sorted({r["temperature"] for r in rounds}),
            "max_tokens": max_tokens.pop(),
        },
        "sources": sources,
        "results": results,
        "ratio_mtplx_over_stock": ratios(results),
        "rounds": rounds,
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = data["config"]["temperatures"]
    fig, axes = plt.subplots(
        2, len(temperatures), figsize=(5 * len(temperatures), 7), squeeze=False, sharex=True
    )
    for col, temperature in enumerate(f"{t:g}" for t in temperatures):
        top, bottom = axes[0][col], axes[1][col]
        for server in SERVERS:
            cells = data["results"].get(server, {}).get(temperature, {})
            xs = sorted(int(c) for c in cells)
            top.plot(xs, [cells[str(x)]["tok_s_median"] for x in xs], marker="o", label=server)
        one = data["results"].get("mtplx", {}).get(temperature, {}).get("1")
        if one is not None and 4 in data["config"]["clients"]:  # the target: 4 clients >= 2x one
            top.plot(
                [4],
                [2 * one["tok_s_median"]],
                marker="_",
                markersize=18,
                color="black",
                linestyle="none",
                label="2x mtplx's 1-client figure",
            )
        ratio = data["ratio_mtplx_over_stock"].get(temperature, {})
        xs = sorted(int(c) for c in ratio)
        bottom.plot(xs, [ratio[str(x)] for x in xs], marker="o", color="tab:green")
        bottom.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        top.set_title(f"temperature {temperature}")
        top.set_ylabel("aggregate tok/s, prefill included (median)")
        bottom.set_ylabel("mtplx / stock")
        bottom.set_xlabel("concurrent clients")
        bottom.set_xscale("log", base=2)
        bottom.set_xticks(data["config"]["clients"], [str(c) for c in data["config"]["clients"]])
        top.legend()
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
    fig.suptitle(
        f"mtplx serve vs mlx_lm.server, {data['config']['max_tokens']} tokens/request, "
        f"{data['machine']['cpu_count']} CPUs, {data['machine']['date'][:10]}"
        + (f" ({len(data['sources'])} runs merged)" if data.get("sources") else "")
    )
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(data: dict) -> str:
    header = (
        f"{'temp':>5} {'clients':>7} {'mtplx tok/s':>11} {'stock tok/s':>11} {'ratio':>6} "
        f"{'mtplx ttft ms':>13} {'stock ttft ms':>13} {'tok/cycle':>9} {'errors':>6}"
    )
    lines = [header, "-" * len(header)]
    for temperature in (f"{t:g}" for t in data["config"]["temperatures"]):
        for clients in (str(c) for c in data["config"]["clients"]):
            cells = {s: data["results"].get(s, {}).get(temperature, {}).get(clients) for s in SERVERS}
            m, s = cells["mtplx"] or {}, cells["stock"] or {}
            ratio = data["ratio_mtplx_over_stock"].get(temperature, {}).get(clients)
            lines.append(
                f"{temperature:>5} {clients:>7} {_fmt(m.get('tok_s_median')):>11} {_fmt(s.get('tok_s_median')):>11} "
                f"{_fmt(ratio, digits=2):>6} {_fmt(m.get('ttft_median_s'), 1000, 0):>13} "
                f"{_fmt(s.get('ttft_median_s'), 1000, 0):>13} {_fmt(m.get('tokens_per_cycle_median'), digits=2):>9} "
                f"{m.get('errors', 0) + s.get('errors', 0):>6}"
            )
    return "\n".join(lines)


def parse_list(text: str, kind: type) -> list:
    return [kind(part) for part in text.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--short", action="store_true", help="smoke run: clients 1,2; 1 repetition; 32 tokens"
    )
    parser.add_argument("--clients", default=None, help="concurrent client counts (default 1,2,4,8,16)")
    parser.add_argument("--temperatures", default="0,0.7", help="temperatures (default 0,0.7)")
    parser.add_argument("--max-tokens", type=int, default=None, help="max_tokens per request (default 128)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client per round (default 2)")
    parser.add_argument("--repetitions", type=int, default=None, help="starts of each server (default 3)")
    parser.add_argument(
        "--mtplx-arg",
        action="append",
        default=[],
        help="a flag for `mtplx serve` (repeat; use --mtplx-arg=--flag=value; keep the default model)",
    )
    parser.add_argument(
        "--stock-arg",
        action="append",
        default=None,
        help="a flag for mlx_lm.server (repeat; replaces the defaults --decode-concurrency 16 --prompt-concurrency 8)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="the JSON file (the plot goes beside it as .png)"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="no run: one table and plot from these runs' JSON files (each cell from one run) into --out",
    )
    args = parser.parse_args()
    if args.merge is not None:
        if args.out is None:
            raise SystemExit("--merge needs --out (the merged JSON file)")
        data = merge(args.merge)
        with atomic_write(args.out) as handle:
            json.dump(data, handle, indent=1)
        plot(data, args.out.with_suffix(".png"))
        print(table(data))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
        return
    clients = parse_list(args.clients or ("1,2" if args.short else "1,2,4,8,16"), int)
    temperatures = parse_list(args.temperatures, float)
    max_tokens = args.max_tokens or (32 if args.short else 128)
    repetitions = args.repetitions or (1 if args.short else 3)
    out = args.out or RESULTS / ("serve-concurrency-short.json" if args.short else "serve-concurrency.json")
    if min(clients) < 1 or args.requests < 1 or max_tokens < 1 or repetitions < 1:
        raise SystemExit("--clients, --requests, --max-tokens and --repetitions must be >= 1")

    library = mtplx.BLAS.path
    model_path = resolve_model(None)  # converts the default model on first use
    stock_args = args.stock_arg if args.stock_arg is not None else stock_default_args()
    specs = server_specs(model_path, library, args.mtplx_arg, stock_args)
    prompts = load_prompts()
    print(f"model {model_path}; BLAS {library}; checking the preload ...", flush=True)
    blas = blas_check(library)
    print(
        f"  matmul GFLOP/s without / with LD_PRELOAD: {_fmt(blas['gflops_without_preload'])} / {_fmt(blas['gflops_with_preload'])}"
    )
    config = {
        "model_path": str(model_path),
        "clients": clients,
        "temperatures": temperatures,
        "max_tokens": max_tokens,
        "requests_per_client": args.requests,
        "repetitions": repetitions,
        "prompts": [p.id for p in prompts],
        "argv": {name: list(spec.argv) for name, spec in specs.items()},
        "stock_ld_preload": specs["stock"].env.get("LD_PRELOAD"),
    }
    machine = machine_info()
    sessions: list[Session] = []
    rounds: list[RoundResult] = []
    bar = tqdm(total=repetitions * len(SERVERS) * len(temperatures) * len(clients), unit="round")
    for repetition in range(repetitions):
        for name in SERVERS if repetition % 2 == 0 else SERVERS[::-1]:
            start = time.perf_counter()
            with serving(specs[name]) as server:
                warm_up(server)
                session = Session(
                    name,
                    repetition,
                    time.perf_counter() - start,
                    server.model_id,
                    openblas_mapped(server.proc.pid, library),
                )
                sessions.append(session)
                tqdm.write(
                    f"{name} server ready in {session.ready_s:.1f} s (OpenBLAS mapped: {session.openblas_mapped})"
                )
                for temperature in temperatures:
                    for count in clients:
                        bar.set_description(f"{name} T={temperature:g} clients={count}")
                        result = run_round(
                            server,
                            prompts,
                            temperature=temperature,
                            clients=count,
                            requests=args.requests,
                            max_tokens=max_tokens,
                            repetition=repetition,
                        )
                        rounds.append(result)
                        bar.set_postfix_str(f"{result.tok_s:.1f} tok/s")
                        bar.update()
            with atomic_write(out) as handle:  # after each server, so a long run that dies keeps its rounds
                json.dump(report(config, machine, blas, sessions, rounds, complete=False), handle, indent=1)
    bar.close()
    data = report(config, machine, blas, sessions, rounds, complete=True)
    with atomic_write(out) as handle:
        json.dump(data, handle, indent=1)
    plot(data, out.with_suffix(".png"))
    print(table(data))
    print(
        f"stock server preload active: {data['blas']['stock_preload_active']}; wrote {out} and {out.with_suffix('.png')}"
    )


if __name__ == "__main__":
    main()
