"""Is the hot path as fast as at an earlier commit? Paired, interleaved `mtplx bench` runs of two trees.

The earlier commit is checked out into a temporary git worktree; each pair runs
`mtplx bench --depths 1` once on each tree, in separate processes, alternating which goes first
(so drift on the machine hits both sides alike). Per run the figure is decode tokens/s summed over
the sweep (generated tokens after the first / decode seconds, over every timed MTP run; the AR runs
likewise); per pair the ratio new / old; the median ratio is quoted with every pair listed.

    python benchmarks/old_vs_new.py --old 28ae3bc --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bench_once(tree: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    """One `mtplx bench --depths 1` in ``tree``; decode tokens/s per mode over its timed runs."""
    command = [
        sys.executable, "-m", "mtplx", "bench", "--depths", "1", "--no-stock", "--no-plot", "--no-progress",
        "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--per-kind", "1",
        "--kinds", args.kinds, "--temps", args.temps, "--json", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    runs = [r for r in json.loads(out.read_text())["runs"] if r["repeat"] >= 0]
    rates = {}
    for mode in ("mtp", "ar"):
        mine = [r for r in runs if r["mode"] == mode]
        rates[mode] = sum(r["generated_tokens"] - 1 for r in mine) / sum(r["decode_seconds"] for r in mine)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--old", default="28ae3bc", help="the earlier commit (default: before the layout change)"
    )
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--kinds", default="code,prose,chat")
    parser.add_argument("--temps", default="0,0.7")
    parser.add_argument("--json", type=Path, default=None, help="write the pairs here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], cwd=ROOT, check=True)
        try:
            pairs = []
            for i in range(args.pairs):
                order = (
                    [("old", old_tree), ("new", ROOT)] if i % 2 == 0 else [("new", ROOT), ("old", old_tree)]
                )
                rates = {name: bench_once(tree, Path(tmp) / f"{name}{i}.json", args) for name, tree in order}
                pair = {
                    "first": order[0][0],
                    **{f"{n}_{m}": rates[n][m] for n in ("old", "new") for m in ("mtp", "ar")},
                    "mtp_ratio": rates["new"]["mtp"] / rates["old"]["mtp"],
                    "ar_ratio": rates["new"]["ar"] / rates["old"]["ar"],
                }
                pairs.append(pair)
                print(json.dumps(pair), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    summary = {
        "old": args.old,
        "pairs": pairs,
        "median_mtp_ratio": statistics.median(p["mtp_ratio"] for p in pairs),
        "median_ar_ratio": statistics.median(p["ar_ratio"] for p in pairs),
    }
    print(f"median new/old: MTP {summary['median_mtp_ratio']:.3f}, AR {summary['median_ar_ratio']:.3f}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
