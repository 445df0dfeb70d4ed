"""Communication cost of sharded MTP decoding, on the ranks `mlx.launch` starts.

    mlx.launch -n 2 --backend ring -- python benchmarks/bench_distributed.py [--model DIR] [--tokens 64]

Rank 0 prints one JSON object:

* ``collectives``: the isolated cost of what one verify cycle sends, per block
  length T = depth + 1 (T = 1 is an AR step): the pipeline pattern (a hidden
  block [1, T, H] sent one hop, then all-gathered) and one all-reduce of the
  same block (tensor parallel issues two per layer). Timed alone because lazy
  evaluation hides communication inside the forward.
* ``generation``: tokens/s of AR and MTP on the sharded model (pipeline), with
  the per-cycle collective count and bytes the engine reports, and the share of
  a cycle the isolated collectives account for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

# isort: off
import mtplx  # noqa: F401  (loads the optimized BLAS before mlx)
import mlx.core as mx

# isort: on


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_collectives(group, hidden: int, block_lens: list[int], repeats: int) -> list[dict]:
    rank, size = group.rank(), group.size()
    rows = []
    for t in block_lens:
        block = mx.ones((1, t, hidden), dtype=mx.float32)
        mx.eval(block)

        def pipeline_hop(block=block):
            h = block
            if rank < size - 1:
                h = mx.distributed.recv_like(h, rank + 1, group=group)
            if rank > 0:
                h = mx.distributed.send(h, rank - 1, group=group)
            mx.eval(mx.distributed.all_gather(h, group=group))

        def all_reduce(block=block):
            mx.eval(mx.distributed.all_sum(block, group=group))

        rows.append(
            {
                "block_len": t,
                "bytes": block.nbytes,
                "pipeline_ms": 1e3 * _median_seconds(pipeline_hop, repeats),
                "all_reduce_ms": 1e3 * _median_seconds(all_reduce, repeats),
            }
        )
    return rows


def time_generation(engine, prompt: str, tokens: int, depth: int) -> dict:
    out = {}
    for label, kwargs in (("ar", dict(mtp=False)), ("mtp", dict(mtp=True, depth=depth))):
        engine.generate(prompt, max_tokens=8, chat=True, **kwargs)  # warm-up
        result = engine.generate(prompt, max_tokens=tokens, chat=True, **kwargs)
        s = result.stats
        out[label] = {
            "decode_tokens_per_sec": s.decode_tokens_per_sec,
            "tokens_per_cycle": s.tokens_per_cycle,
            "cycles": s.cycles,
            "decode_seconds": s.decode_seconds,
            **{k: s.distributed[k] for k in ("collectives_per_cycle", "bytes_per_cycle", "collective_kinds")},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--head", default=None)
    parser.add_argument("--mode", default="pipeline", choices=("pipeline", "tensor", "auto"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--prompt", default="Write a Python function that reverses a string.")
    args = parser.parse_args(argv)

    from mtplx.engine.engine import Engine
    from mtplx.heads.base import model_args_of

    engine = Engine.load(args.model, head=args.head, distributed=args.mode)
    dist = engine.distributed
    hidden = int(model_args_of(engine.trunk.model).hidden_size)
    report = {
        "ranks": dist.size,
        "mode": dist.mode,
        "hidden": hidden,
        "collectives": time_collectives(dist.group, hidden, sorted({1, args.depth + 1}), args.repeats),
        "generation": time_generation(engine, args.prompt, args.tokens, args.depth),
    }
    by_len = {row["block_len"]: row for row in report["collectives"]}
    for label, block_len in (("ar", 1), ("mtp", args.depth + 1)):
        g = report["generation"][label]
        cycle_ms = 1e3 * g["decode_seconds"] / max(g["cycles"], 1)
        g["cycle_ms"] = cycle_ms
        g["communication_share"] = (
            by_len[block_len]["pipeline_ms"] / cycle_ms if dist.mode == "pipeline" else None
        )
    if dist.rank == 0:
        print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
