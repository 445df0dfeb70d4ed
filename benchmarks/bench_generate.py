"""Benchmark sweep: stock mlx-lm vs mtplx AR vs mtplx MTP per depth, interleaved, in one process.

    .venv/bin/python benchmarks/bench_generate.py --tokens 256 --repeats 3 --depths 1-4

The same thing as `mtplx bench`; all the logic lives in `mtplx/bench/` (`run.py`'s
docstring says which module does what; `runners.py` how runs are timed and made equal
in length). Prints a markdown table; writes a JSON file and a PNG (``--json``,
``--plot``), only when the sweep completes (Ctrl-C leaves no half-written files).
"""

from __future__ import annotations

import sys

from mtplx.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
