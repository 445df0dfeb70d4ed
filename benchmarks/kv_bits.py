"""Quantized KV cache (`--kv-bits`) at a long context: memory and speed, AR and MTP, with acceptance.

One prompt of ``--context`` tokens (repository prose, then a request to continue), decoded greedily
for ``--max-tokens`` tokens with EOS banned (equal lengths), at each KV setting: float (the model's
dtype: 32 bits for the default float32 build), and ``--kv-bits`` 8 and 4 (groups of 64,
``--quantized-kv-start 0``: the whole context quantized; mlx-lm's default start, 5000, would leave a
4k context in float). Per setting, AR (draft "none") and MTP (the head at ``--depth``), alternating
which goes first per repetition. Reported: the trunk's KV bytes after the request (its caches as the
prompt cache stores them, AR run), peak memory, prefill and decode tok/s, tokens per cycle and the
head's acceptance per position, and whether MTP's tokens equal AR's (greedy: they must).

    python benchmarks/kv_bits.py [--context 4096] [--max-tokens 64] [--repetitions 1] [--depth 1]

-> benchmarks/results/kv-bits.json (every run, and the table printed at the end).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.bench.runners import ban_bias
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.io import atomic_write

import mlx.core as mx

OUT = "benchmarks/results/kv-bits.json"
REPO = Path(__file__).resolve().parent.parent
SOURCES = ["docs/ARCHITECTURE.md", "docs/DECISIONS.md", "README.md", "docs/sampling.md"]
SETTINGS = [None, 8, 4]  # --kv-bits


def long_prompt(tokenizer, context: int) -> list[int]:
    """``context`` token ids: repository prose cut to length, ending with a request to go on."""
    text = "\n\n".join((REPO / s).read_text() for s in SOURCES if (REPO / s).is_file())
    tail = tokenizer.encode("\n\nContinue the document above with one more paragraph:\n")
    body = tokenizer.encode(text)
    while len(body) < context:
        body = body + body
    return body[: context - len(tail)] + tail


def one_run(engine: Engine, prompt: list[int], mode: str, depth: int, max_tokens: int) -> dict:
    engine.prompt_cache.clear()
    bias = ban_bias(engine.tokenizer)
    draft = dict(draft="none") if mode == "ar" else dict(draft="head", depth=depth)
    request = GenerationRequest.from_kwargs(max_tokens=max_tokens, temperature=0.0, logit_bias=bias, **draft)
    mx.reset_peak_memory()
    started = time.perf_counter()
    result = engine.generate(prompt, request)
    wall = time.perf_counter() - started
    s = result.stats
    head = s.drafters.get("head", {})
    return {
        "mode": mode,
        "tokens": result.token_ids,
        "kv_bytes": engine.prompt_cache.nbytes if mode == "ar" else None,  # trunk caches only (AR)
        "peak_memory_gb": s.peak_memory_gb,
        "prefill_tok_s": s.prefill_tokens_per_sec,
        "decode_tok_s": s.decode_tokens_per_sec,
        "tokens_per_cycle": s.tokens_per_cycle,
        "acceptance_per_position": s.acceptance_per_position,
        "drafted": head.get("drafted", 0),
        "accepted": head.get("accepted", 0),
        "wall_s": wall,
    }


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for bits in SETTINGS:
        kv = {} if bits is None else dict(kv_bits=bits, kv_group_size=64, quantized_kv_start=0)
        engine = Engine.load(None, mtp=True, prompt_cache_bytes=8 * 1024**3, **kv)
        prompt = long_prompt(engine.tokenizer, args.context)
        for rep in range(args.repetitions):
            modes = ["ar", "mtp"] if rep % 2 == 0 else ["mtp", "ar"]
            runs = {m: one_run(engine, prompt, m, args.depth, args.max_tokens) for m in modes}
            same = runs["ar"]["tokens"] == runs["mtp"]["tokens"]
            for m in ("ar", "mtp"):
                rows.append({"kv_bits": bits, "repetition": rep, "same_tokens_as_ar": same, **runs[m]})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "tokens"}), flush=True)
        del engine
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| KV | mode | KV bytes (trunk) | peak GB | prefill tok/s | decode tok/s | tokens/cycle | acceptance | MTP == AR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for bits in SETTINGS:
        for mode in ("ar", "mtp"):
            runs = [r for r in rows if r["kv_bits"] == bits and r["mode"] == mode]
            kv_bytes = next((r["kv_bytes"] for r in rows if r["kv_bits"] == bits and r["kv_bytes"]), 0)

            def med(key: str, runs: list[dict] = runs) -> float:
                return statistics.median(r[key] for r in runs)

            acceptance = runs[0]["acceptance_per_position"] if mode == "mtp" else []
            lines.append(
                f"| {'float' if bits is None else f'{bits}-bit'} | {mode} | {kv_bytes / 1e6:.1f} MB | "
                f"{med('peak_memory_gb'):.2f} | {med('prefill_tok_s'):.0f} | {med('decode_tok_s'):.2f} | "
                f"{med('tokens_per_cycle'):.2f} | {[round(a, 2) for a in acceptance] or '-'} | "
                f"{all(r['same_tokens_as_ar'] for r in runs)} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=1)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args()
    rows = measure(args)
    report = {
        "args": vars(args),
        "machine": f"{platform.system()} {platform.machine()}, {platform.processor() or 'cpu'}",
        "device": str(mx.default_device()),
        "runs": rows,
        "table": table(rows),
    }
    with atomic_write(args.out) as f:
        json.dump(report, f, indent=1)
    print(report["table"])


if __name__ == "__main__":
    main()
