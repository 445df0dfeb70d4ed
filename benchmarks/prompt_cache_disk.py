"""Time to first token for a long prompt: cold, from the prompt cache in RAM, from its disk tier.

One engine on the default model (or ``--model``) with a RAM prompt cache and a disk tier in a
fresh directory (`Engine.use_disk_cache`, what `mtplx serve --prompt-cache-dir` attaches). Each
repetition draws a new ``--tokens``-token prompt (random ids: no earlier repetition's cache
helps) and runs, greedy, ``--max-tokens`` tokens each:

- cold: the prompt on empty caches (a full prefill), which writes its entry to disk;
- RAM hit: the same prompt again (the entry in RAM: one token forwarded);
- disk hit: the same prompt after the RAM cache is cleared, as a restarted server sees it (the
  entry loaded from disk; the OS page cache may still hold the file, as after a quick restart).

TTFT is the engine's own (`GenerationStats.ttft_seconds`: from the call to the first token).

    python benchmarks/prompt_cache_disk.py --tokens 4096 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.bench.report import provenance, write_json
from mtplx.engine.engine import Engine

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _ttft(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    result = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    return result.stats.ttft_seconds, result.stats.cached_tokens


def one_repetition(engine: Engine, rng: np.random.Generator, tokens: int, max_tokens: int) -> dict:
    prompt = rng.integers(100, int(engine.trunk.vocab_size) - 100, size=tokens).tolist()
    disk = engine.prompt_cache.disk
    row = {}
    row["cold_s"], row["cold_cached"] = _ttft(engine, prompt, max_tokens)
    assert disk.flush(), "the disk write did not finish"
    row["ram_s"], row["ram_cached"] = _ttft(engine, prompt, max_tokens)
    engine.prompt_cache.clear()
    hits, loaded, seconds = disk.stats.hits, disk.stats.bytes_loaded, disk.stats.load_seconds
    row["disk_s"], row["disk_cached"] = _ttft(engine, prompt, max_tokens)
    row["disk_hit"] = disk.stats.hits - hits
    row["disk_bytes_loaded"] = disk.stats.bytes_loaded - loaded
    row["disk_load_s"] = disk.stats.load_seconds - seconds
    assert disk.flush()
    engine.prompt_cache.clear()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "prompt-cache-disk.json"
    )
    args = parser.parse_args()
    engine = Engine.load(args.model, prompt_cache_bytes=8 << 30)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="mtplx-prompt-cache-") as directory:
        engine.use_disk_cache(directory, 16 << 30)
        _ttft(engine, rng.integers(100, 1000, size=64).tolist(), 2)  # warm-up (kernels, allocator)
        engine.prompt_cache.clear()
        for i in range(args.repeats):
            rows.append(one_repetition(engine, rng, args.tokens, args.max_tokens))
            print(
                f"repetition {i}: "
                + ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[-1].items()
                )
            )
    summary = {
        key: statistics.median(r[key] for r in rows) for key in ("cold_s", "ram_s", "disk_s", "disk_load_s")
    }
    summary["disk_bytes"] = rows[-1]["disk_bytes_loaded"]
    print("median TTFT: " + ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.endswith("_s")))
    write_json(args.out, {**provenance(vars(args)), "rows": rows, "median": summary})


if __name__ == "__main__":
    main()
