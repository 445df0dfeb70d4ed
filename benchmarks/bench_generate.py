"""Benchmark sweep: stock mlx-lm vs mtplx AR vs mtplx MTP per depth, interleaved, in one process.

    .venv/bin/python benchmarks/bench_generate.py --tokens 256 --repeats 3 --depths 1-4

The same thing as `mtplx bench`; all the logic lives in `mtplx/bench.py` (see its
docstring for how runs are timed and made equal in length). Prints a markdown
table; writes a JSON file and a PNG (``--json``, ``--plot``), only when the sweep
completes (Ctrl-C leaves no half-written files).
"""

from __future__ import annotations

import argparse
import sys

import mtplx  # noqa: F401  (loads the optimized BLAS before anything imports mlx)
from mtplx import bench
from mtplx.errors import MtplxError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_generate.py", description=__doc__.splitlines()[0])
    bench.add_bench_args(parser)
    args = parser.parse_args(argv)
    try:
        return bench.bench_from_args(args)
    except MtplxError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nbench: interrupted; no result files written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
