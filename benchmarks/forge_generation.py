"""Forge's data generation, tokens/s: the fixed-batch loop of an earlier commit vs the batched decoder.

Each run generates one shard of forge's default plan (default prompts, chat template, 32 prompts,
seq_len 384, top-32, seed 0: shard 0 greedy, shard 1 t0.7-p0.95) on the default model and times
`mtplx.forge.record.generate_batch` alone (prefill included, model load excluded). Variants:
``old`` (the earlier commit's tree, checked out into a temporary git worktree), ``none`` (this
tree, plain AR rows) and ``head`` (this tree, the shipped head drafting ``--depth`` tokens per
cycle, verified exactly). Each run is its own process; the variants alternate within each repeat,
in an order rotated per repeat, so drift on the machine hits all alike. The figure is response
tokens recorded (the positions training gets) per second; medians over the repeats per shard.

    python benchmarks/forge_generation.py --old bce51d9 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("old", "none", "head")


def child(variant: str, shard: int, depth: int) -> None:
    """One timed shard, in the tree on PYTHONPATH; prints a JSON line."""
    import mtplx  # noqa: F401  (optimized BLAS before mlx)
    from mtplx.checkpoints.load import load_model
    from mtplx.engine.engine import Engine
    from mtplx.forge.config import DEFAULT_FORGE_CONFIG as cfg
    from mtplx.forge.prompts import prompt_ids
    from mtplx.forge.record import ShardPlan, generate_batch

    try:
        from mtplx.forge.stages import prompt_sets, shard_settings
    except ImportError:  # an ``old`` tree from before mtplx.forge.stages
        from mtplx.forge.run import _prompt_sets as prompt_sets
        from mtplx.forge.run import _settings as shard_settings
    from mtplx.trunk.model import Trunk

    loaded = load_model(None)
    trunk, tokenizer = Trunk(loaded.model), loaded.tokenizer
    prompts = prompt_sets(cfg)
    plan = ShardPlan(
        tuple(prompts.train),
        shard_settings(cfg),
        cfg.gen_batch,
        cfg.seq_len,
        cfg.top_n,
        cfg.seed,
        loaded.fingerprint,
    )
    chosen, setting, key = plan.shard(shard)
    encoded = sorted(
        (ids for ids in (prompt_ids(tokenizer, p) for p in chosen) if 0 < len(ids) <= cfg.max_prompt), key=len
    )
    eos = set(int(i) for i in getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    head = None
    if variant == "head":
        from mtplx.heads.discovery import find_head

        head = find_head(loaded, trunk, required=True)
    engine = Engine(loaded.model, tokenizer, loaded.config, head=head)
    start = time.perf_counter()
    depth = depth if head is not None else 0
    data = generate_batch(engine, encoded, setting, key, cfg.seq_len, cfg.top_n, eos, depth=depth)
    seconds = time.perf_counter() - start
    tokens = data.num_response_tokens
    print(json.dumps({"variant": variant, "shard": shard, "setting": setting.label(), "tokens": tokens,
                      "seconds": seconds, "tokens_per_s": tokens / seconds}))  # fmt: skip


def run_child(tree: Path, variant: str, shard: int, depth: int) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--shard", str(shard)]
    command += ["--depth", str(depth)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", default="bce51d9", help="the commit with the fixed-batch loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", default="0,1", help="shard indices of forge's default plan")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--depth", type=int, default=1, help="head drafts per cycle (variant head)")
    parser.add_argument("--json", type=Path, default=None, help="write every run here")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--shard", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.shard, args.depth)
        return 0
    variants = args.variants.split(",")
    shards = [int(s) for s in args.shards.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.old], cwd=ROOT, check=True)
        try:
            for repeat in range(args.repeats):
                for shard in shards:
                    order = variants[repeat % len(variants) :] + variants[: repeat % len(variants)]
                    for variant in order:
                        tree = old_tree if variant == "old" else ROOT
                        run = {**run_child(tree, variant, shard, args.depth), "repeat": repeat}
                        runs.append(run)
                        print(json.dumps(run), flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=True)
    print("\n| shard | setting | " + " | ".join(f"{v} (tok/s)" for v in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for shard in shards:
        mine = [r for r in runs if r["shard"] == shard]
        medians = [statistics.median(r["tokens_per_s"] for r in mine if r["variant"] == v) for v in variants]
        print(f"| {shard} | {mine[0]['setting']} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")
    if args.json is not None:
        args.json.write_text(
            json.dumps({"old": args.old, "depth": args.depth, "runs": runs}, indent=1) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
