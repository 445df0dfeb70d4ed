"""Acceptance vs training tokens of one `mtplx forge` run: every kept checkpoint, scored teacher-forced.

`mtplx forge` keeps only its newest checkpoints; to draw a curve, hard-link them elsewhere
while the run trains (e.g. a loop of `ln <work>/<run>/ckpt-*/step-*.safetensors <dir>/`),
then score each one on the run's own held-out generations (`<run>/eval`, never trained on):

    python benchmarks/experiments/forge_curve.py --run-dir ~/.cache/mtplx/forge/<run> --checkpoints DIR \
        --json benchmarks/results/forge-curve.json --plot benchmarks/results/forge-curve.png

"training tokens" = response tokens the head has trained on at that step (steps x batch x the
run's mean response tokens per sequence), so the curve reads as acceptance vs data seen.
Full draft vocabulary; depth 1-3; temperatures 0 and 0.7 (1 - TV, as in the forge manifest).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.checkpoints.load import load_model
from mtplx.forge.config import DEFAULT_FORGE_CONFIG
from mtplx.forge.evaluate import evaluate_acceptance
from mtplx.forge.record import load_shards
from mtplx.forge.train import build_head, init_from_head
from mtplx.io import atomic_path, atomic_write
from mtplx.trunk.model import Trunk

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path, help="the forge run (holds train/ and eval/)")
    ap.add_argument("--checkpoints", required=True, type=Path, help="directory of step-*.safetensors")
    ap.add_argument(
        "--init-head", default=None, help="the forged head the run started from (--init-head of the run)"
    )
    ap.add_argument(
        "--head-layers", type=int, default=DEFAULT_FORGE_CONFIG.head_layers, help="--head-layers of the run"
    )
    ap.add_argument("--every", type=int, default=1, help="score every Nth checkpoint (the last always)")
    ap.add_argument("--origins", type=int, default=DEFAULT_FORGE_CONFIG.eval_origins)
    ap.add_argument("--json", type=Path, default=Path("forge-curve.json"))
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args()

    cfg = DEFAULT_FORGE_CONFIG
    train, _ = load_shards(args.run_dir / "train")
    held_out, _ = load_shards(args.run_dir / "eval")
    tokens_per_sequence = train.num_response_tokens / max(train.num_sequences, 1)
    loaded = load_model(None)
    trunk = Trunk(loaded.model)
    paths = sorted(args.checkpoints.glob("step-*.safetensors"))
    if not paths:
        raise SystemExit(f"{args.checkpoints}: no step-*.safetensors checkpoints")
    chosen = paths[:: args.every] + ([paths[-1]] if (len(paths) - 1) % args.every else [])
    points = []
    for path in [None, *chosen]:  # None: the head the run started from, step 0
        head = build_head(trunk, cfg.hidden_source, cfg.chain_source, args.head_layers)
        if args.init_head:
            init_from_head(head, args.init_head, trunk, loaded.fingerprint)
        step = 0
        if path is not None:
            step = int(path.stem.split("-")[1])
            weights = mx.load(str(path))
            head.load_weights([(k[5:], v) for k, v in weights.items() if k.startswith("head.")], strict=True)
        table = evaluate_acceptance(
            trunk, head, held_out.tokens, depths=cfg.depth, origins=args.origins, valid=held_out.valid
        )
        point = {
            "step": step,
            "training_tokens": round(step * cfg.batch_size * tokens_per_sequence),
            "acceptance": table,
        }
        points.append(point)
        print(json.dumps(point), flush=True)
    result = {
        "run_dir": str(args.run_dir),
        "train_response_tokens": train.num_response_tokens,
        "held_out_response_tokens": held_out.num_response_tokens,
        "points": points,
    }
    with atomic_write(args.json) as handle:
        handle.write(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    x = [p["training_tokens"] / 1000 for p in result["points"]]
    for depth in ("1", "2", "3"):
        for temp, style in (("0.0", "-"), ("0.7", "--")):
            y = [p["acceptance"][depth][temp] for p in result["points"]]
            ax.plot(x, y, style, marker="o", ms=3, label=f"depth {depth}, t {temp}")
    ax.set_xlabel("response tokens trained on (thousands)")
    ax.set_ylabel("teacher-forced acceptance (1 - TV)")
    ax.set_title("forged head: acceptance on held-out generations vs training")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)


if __name__ == "__main__":
    main()
