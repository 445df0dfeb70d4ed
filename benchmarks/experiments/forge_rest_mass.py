"""Could larger top-K or full-vocabulary targets lift the head? (issue 28, item 1d)

    python benchmarks/experiments/forge_rest_mass.py [--suite-cache PATH] [--json benchmarks/results/forge-rest-mass.json]

Forge trains the head on the trunk's top-32 log-probabilities plus one "rest" bucket
(`mtplx.forge.loss`): the head is told how much mass lies outside the top 32 but not where. So
the most that full-vocabulary targets could add is the acceptance lost *outside* the trunk's
top 32. This measures it, teacher-forced on the held-out suite exactly as forge's scoring does
(`forge_ablation.score`: the shipped head at depth 1, every response position of the suite's 64
greedy tokens per prompt), split by where the lost acceptance lies:

    1 - acceptance = TV(p, q) = sum_v max(p_v - q_v, 0)
                   = [over the trunk's top-K tokens] + [over the rest]

At temperature 0 acceptance is argmax agreement, and the trunk's argmax is always in its top 32,
so more targets cannot matter there except through training. At temperature 0.7 the second term
is what better rest targets could recover at most, with the top-K part held fixed; the trunk's
rest mass (of p at the scored temperature) bounds it from above. Reported for K = 8 .. 256.
No training: a bound that rules a cause in or out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.bench.report import provenance
from mtplx.engine.engine import Engine
from mtplx.io import atomic_write

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import forge_ablation  # noqa: E402  (the suite windows forge's scoring uses)

TOP_KS = (8, 16, 32, 64, 256)
TEMPERATURES = (1.0, 0.7)


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def split_loss(p: np.ndarray, q: np.ndarray, top_ks=TOP_KS) -> dict:
    """For rows p, q [N, V]: mean acceptance, and per K the mean TV inside / outside p's top K
    and p's mass outside it."""
    lost = np.maximum(p - q, 0.0)
    order = np.argsort(-p, axis=-1)
    out = {"acceptance": float(np.minimum(p, q).sum(-1).mean()), "by_k": {}}
    for k in top_ks:
        inside = np.zeros_like(p, dtype=bool)
        np.put_along_axis(inside, order[:, :k], True, axis=-1)
        out["by_k"][str(k)] = {
            "lost_inside": float((lost * inside).sum(-1).mean()),
            "lost_outside": float((lost * ~inside).sum(-1).mean()),
            "p_mass_outside": float((p * ~inside).sum(-1).mean()),
        }
    return out


def measure(engine: Engine, suite: tuple) -> dict:
    windows, scored, kinds = suite
    trunk, head = engine.trunk, engine.head
    p_rows, q_rows, kind_rows = [], [], []
    for i in range(windows.shape[0]):
        length = int(np.nonzero(scored[i])[0].max()) + 1
        tokens = mx.array(windows[i : i + 1, :length])
        out = trunk(tokens)
        source = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
        g = head(source[:, :-1], tokens[:, 1:], head.make_cache())  # position t predicts t+2
        p_logits = np.asarray(out.logits.astype(mx.float32))[0, 1:]
        q_logits = np.asarray(head.logits(g).astype(mx.float32))[0]
        keep = scored[i, 1:length]
        p_rows.append(p_logits[keep])
        q_rows.append(q_logits[keep])
        kind_rows += [kinds[i]] * int(keep.sum())
    p_logits, q_logits = np.concatenate(p_rows), np.concatenate(q_rows)
    kind_of = np.array(kind_rows)
    report = {"positions": int(p_logits.shape[0]), "greedy_agreement": None, "temperatures": {}}
    report["greedy_agreement"] = float((p_logits.argmax(-1) == q_logits.argmax(-1)).mean())
    report["trunk_argmax_rank_in_head"] = _rank_histogram(p_logits, q_logits)
    for t in TEMPERATURES:
        p, q = softmax(p_logits, t), softmax(q_logits, t)
        row = split_loss(p, q)
        row["by_kind"] = {
            k: split_loss(p[kind_of == k], q[kind_of == k], (32,)) for k in sorted(set(kind_rows))
        }
        report["temperatures"][str(t)] = row
    return report


def _rank_histogram(p_logits: np.ndarray, q_logits: np.ndarray) -> dict:
    """Where the trunk's argmax sits in the head's ranking (1 = the head agrees greedily)."""
    target = p_logits.argmax(-1)
    rank = (q_logits > q_logits[np.arange(len(target)), target][:, None]).sum(-1) + 1
    edges = [1, 2, 4, 8, 32, 10**9]
    return {
        f"{lo}-{hi - 1}" if hi < 10**9 else f">={lo}": float(((rank >= lo) & (rank < hi)).mean())
        for lo, hi in zip(edges[:-1], edges[1:])
    }


def markdown(report: dict) -> str:
    lines = [
        "| temperature | acceptance | K | lost inside top-K | lost outside top-K | trunk mass outside top-K |",
        "|---|---|---|---|---|---|",
    ]
    for t, row in report["temperatures"].items():
        for k, cell in row["by_k"].items():
            lines.append(
                f"| {t} | {row['acceptance']:.3f} | {k} | {cell['lost_inside']:.3f} | "
                f"{cell['lost_outside']:.3f} | {cell['p_mass_outside']:.3f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite-cache", type=Path, default=Path("/tmp/forge-rest-mass/suite-greedy-64.json"))
    ap.add_argument("--suite-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=HERE.parent / "results" / "forge-rest-mass.json")
    args = ap.parse_args()
    args.suite_cache.parent.mkdir(parents=True, exist_ok=True)
    engine = Engine.load()
    suite = forge_ablation.suite_text(engine, args.suite_tokens, args.suite_cache)
    report = {"provenance": provenance(vars(args)), "head": "shipped", **measure(engine, suite)}
    with atomic_write(args.json) as f:
        f.write(json.dumps(report, indent=1))
    print(f"{report['positions']} positions; greedy agreement {report['greedy_agreement']:.3f}")
    print("trunk argmax rank in the head:", report["trunk_argmax_rank_in_head"])
    print(markdown(report))
    for t, row in report["temperatures"].items():
        print(t, {k: round(v["by_k"]["32"]["lost_outside"], 3) for k, v in row["by_kind"].items()})


if __name__ == "__main__":
    main()
