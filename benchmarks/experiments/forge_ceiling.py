"""The ceiling of a forged head, in-sample (issue 28, item 1a): fine-tune it on the trunk's own
continuations of the benchmark suite's prompts and score it on the suite's greedy text.

Every `mtplx forge` run holds the suite out (`mtplx.forge.prompts.check_held_out`); this script
bypasses that check on purpose, here and nowhere else, because in-sample is the point: how high
can this head go at all on the suite's own text? If it climbs far above the 0.41 it reaches from
forge's prompts, its capacity (and inputs) are not what stops it, and the data's distribution is.

Stages (each resumable; rerun the same command after a kill):

1. ``gen``: the trunk answers the 16 suite prompts (`benchmarks/prompts/suite.jsonl`, encoded as
   forge and the engine encode them) on forge's batched decoder (`mtplx.forge.record.generate_batch`),
   recorded in forge's shard format: shard 0 greedy (one row a prompt: greedy text is one text),
   shards 1.. at t 0.7 / top-p 0.95 (``--copies`` rows a prompt, each its own key), until
   ``--train-shards`` exist or ``--gen-minutes`` pass. ``eval/`` holds ``--eval-shards`` more t 0.7
   shards with other keys: samples of the same prompts the head never trains on.
2. ``train``: the head starts from ``--init-head`` and trains with forge's `train_head` (its
   default recipe: unrolled depth 3, batch 8, AdamW, warm-up and cosine decay, peak ``--lr``) for
   ``--steps``, scored at 0 and every ``--eval-every`` steps by `forge_ablation.score`: the suite
   greedy text ("suite d1", the model card's measure: each prompt plus the trunk's greedy
   ``--suite-tokens``-token continuation from `Engine.generate`, depth 1) and the unseen t 0.7
   samples of ``eval/`` at depths 1-3. Each point is written to ``--json`` as it is scored; a
   rerun resumes from the newest checkpoint in ``--out/ckpt-lr<lr>-<steps>`` and keeps the points
   already in ``--json`` (another ``--lr`` or ``--steps``: another ``--json``, same ``--out``).

    nice -n 19 .venv/bin/python benchmarks/experiments/forge_ceiling.py --out /tmp/ceiling \
        --init-head models/smollm2-135m-instruct --steps 90 --eval-every 30 --lr 1e-4 \
        --json benchmarks/results/forge-ceiling.json --plot benchmarks/results/forge-ceiling.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # forge_ablation, beside this script

import mtplx  # noqa: E402, F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine  # noqa: E402
from mtplx.forge.config import DEFAULT_FORGE_CONFIG  # noqa: E402
from mtplx.forge.loss import frequent_ids  # noqa: E402
from mtplx.forge.prompts import prompt_ids, read_held_out  # noqa: E402
from mtplx.forge.record import (  # noqa: E402
    SHARD_FILES,
    ForgeData,
    drop_empty_rows,
    generate_batch,
    load_shards,
    save_shard,
)
from mtplx.forge.train import build_head, init_from_head, train_head  # noqa: E402
from mtplx.io import atomic_path, atomic_write  # noqa: E402
from mtplx.sample.params import Setting  # noqa: E402

import forge_ablation  # noqa: E402
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

GREEDY, SAMPLED = Setting(0.0, 1.0), Setting(0.7, 0.95)


# ---------------------------------------------------------------- stage 1: the suite's own text


def generate(engine: Engine, out: Path, args: argparse.Namespace) -> dict:
    """Shards of the trunk's continuations of the suite prompts in ``out/train`` and ``out/eval``."""
    prompts = read_held_out(forge_ablation.SUITE)  # the held-out suite itself: in-sample on purpose
    ids = [prompt_ids(engine.tokenizer, p) for p in prompts]
    seq_len = max(len(i) for i in ids) + args.response_tokens + 2
    eos = set(
        int(i) for i in getattr(engine.tokenizer, "eos_token_ids", None) or [engine.tokenizer.eos_token_id]
    )
    deadline = time.time() + 60 * args.gen_minutes
    plan = [("train", i, GREEDY if i == 0 else SAMPLED) for i in range(args.train_shards)]
    plan += [("eval", i, SAMPLED) for i in range(args.eval_shards)]
    plan.sort(key=lambda e: (e[1] > 0 or e[0] == "eval", e[0] == "train"))  # greedy, then eval, then samples
    summary = {"seq_len": seq_len}
    for split, index, setting in plan:
        path = out / split / f"shard-{index:05d}.npz"
        if path.is_file():
            continue
        if time.time() >= deadline and split == "train":
            print(f"gen: --gen-minutes passed; {split} shard {index} not made", flush=True)
            continue
        copies = 1 if setting.temperature == 0.0 else args.copies
        rows = [r for r in range(len(prompts)) for _ in range(copies)]
        seed = args.seed * 1_000_003 + index + (500_000 if split == "eval" else 0)
        began = time.perf_counter()
        data = generate_batch(
            engine, [ids[r] for r in rows], setting, mx.random.key(seed), seq_len, args.top_k, eos
        )
        seconds = time.perf_counter() - began
        meta = {
            "setting": setting.label(explicit_top_p=True),
            "kinds": [prompts[r].kind for r in rows],
            "sources": [prompts[r].source for r in rows],
            "seconds": round(seconds, 2),
            "response_tokens_per_s": round(data.num_response_tokens / max(seconds, 1e-9), 1),
        }
        data, meta = drop_empty_rows(data, meta)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_shard(path, data, meta)
        print(
            f"gen: {split} shard {index} ({meta['setting']}, {data.num_sequences} rows): "
            f"{data.num_response_tokens} response tokens in {seconds:.0f}s "
            f"({meta['response_tokens_per_s']} tokens/s)",
            flush=True,
        )
    return summary


def summarize(out: Path) -> dict:
    """The shards in ``out/train`` and ``out/eval``: rows, response tokens, settings, generation time."""
    summary = {}
    for split in ("train", "eval"):
        data, metas = load_shards(out / split)
        summary[split] = {
            "shards": len(metas),
            "seq_len": int(data.tokens.shape[1]),
            "sequences": data.num_sequences,
            "response_tokens": data.num_response_tokens,
            "by_setting": {s: sum(m["setting"] == s for m in metas) for s in {m["setting"] for m in metas}},
            "generation_seconds": round(sum(m["seconds"] for m in metas), 1),
        }
    return summary


def greedy_overlap(out: Path, suite_cache: Path) -> dict:
    """How much of the scored suite text (Engine.generate, greedy) the greedy training shard holds verbatim."""
    rows = json.loads(suite_cache.read_text())
    with np.load(out / "train" / "shard-00000.npz") as z:
        tokens, valid = z["tokens"], z["valid"]
    same = total = 0
    for i, r in enumerate(rows):
        start = len(r["prompt"])
        response = tokens[i, start : start + int(valid[i].sum()) + 1].tolist()
        n = len(r["generated"])
        total += n
        same += next(
            (k for k in range(min(n, len(response))) if response[k] != r["generated"][k]),
            min(n, len(response)),
        )
    return {"scored_tokens": total, "identical_prefix_tokens": same}


# ---------------------------------------------------------------- stage 2: train and score


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="shards, checkpoints and the cached suite text")
    ap.add_argument("--init-head", default="models/smollm2-135m-instruct")
    ap.add_argument("--stage", choices=("gen", "train", "all"), default="all")
    ap.add_argument("--response-tokens", type=int, default=128, help="response tokens a row writes at most")
    ap.add_argument("--copies", type=int, default=2, help="t 0.7 rows per prompt in a sampled shard")
    ap.add_argument("--train-shards", type=int, default=6, help="shard 0 greedy, the rest t 0.7")
    ap.add_argument("--eval-shards", type=int, default=1, help="t 0.7 shards of unseen samples")
    ap.add_argument("--gen-minutes", type=float, default=60.0, help="no new training shard after this")
    ap.add_argument("--top-k", type=int, default=DEFAULT_FORGE_CONFIG.top_n)
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--eval-every", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--until", type=int, default=None, help="stop after this step's point (resumable)")
    ap.add_argument(
        "--samples-only", action="store_true", help="train on the t 0.7 shards only (no greedy suite text)"
    )
    ap.add_argument("--suite-tokens", type=int, default=64)
    ap.add_argument("--origins", type=int, default=DEFAULT_FORGE_CONFIG.eval_origins)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=Path("forge-ceiling.json"))
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--report-only", action="store_true", help="print the table (and plot) of --json")
    ap.add_argument("--compare", type=Path, default=None, help="another arm's --json, drawn beside it")
    args = ap.parse_args()
    if args.report_only:
        report = json.loads(args.json.read_text())
        print(markdown_table(report))
        if args.plot:
            plot(report, args.plot, json.loads(args.compare.read_text()) if args.compare else None)
        return
    if args.out is None:
        raise SystemExit("--out is needed (or pass --report-only)")
    args.out.mkdir(parents=True, exist_ok=True)
    engine = Engine.load()
    report = json.loads(args.json.read_text()) if args.json.is_file() else {}
    if args.stage in ("gen", "all"):
        report["generation"] = generate(engine, args.out, args)
        write(args.json, report)
    if args.stage == "gen":
        return

    data, metas = load_shards(args.out / "train")
    if args.samples_only:  # the greedy rows out: the scored suite text itself is never trained on
        settings = np.array([m["setting"] for m in metas for _ in m["kinds"]])
        data = ForgeData(*(getattr(data, n)[settings != "greedy"] for n in SHARD_FILES))
    held, _ = load_shards(args.out / "eval")
    cache = args.out / f"suite-greedy-{args.suite_tokens}.json"
    extra = {"samples_only": args.samples_only}
    # One checkpoint directory per recipe: arms share the shards.
    ckpt_dir = args.out / f"ckpt-lr{args.lr:g}-{args.steps}{'-samples' if args.samples_only else ''}"
    report = train_and_score(engine, data, held, cache, ckpt_dir, args, report, extra)
    report.update(data=summarize(args.out), greedy_overlap=greedy_overlap(args.out, cache))
    write(args.json, report)
    print(markdown_table(report))
    if args.plot:
        plot(report, args.plot)


def train_and_score(
    engine: Engine,
    data: ForgeData,
    held: ForgeData | None,
    cache: Path,
    ckpt_dir: Path,
    args: argparse.Namespace,
    report: dict,
    extra: dict,
) -> dict:
    """Train the head from ``args.init_head`` on ``data`` and score it (suite d1; ``held`` at depths
    1-3 when given) at step 0 and every ``args.eval_every`` steps up to ``args.steps`` (or
    ``args.until``), each point written to ``args.json`` as it is scored; resumes from the newest
    checkpoint in ``ckpt_dir`` and keeps the points already in ``report`` for the same recipe."""
    trunk, fingerprint = engine.trunk, engine.fingerprint
    suite = forge_ablation.suite_text(engine, args.suite_tokens, cache)
    cfg = replace(DEFAULT_FORGE_CONFIG, lr=args.lr, checkpoint_every=args.eval_every, progress=True)
    recipe = {
        "init_head": args.init_head,
        "steps": args.steps,
        "lr": args.lr,
        "batch_size": cfg.batch_size,
        "depth": cfg.depth,
        "train_sequences": data.num_sequences,
        "train_response_tokens": data.num_response_tokens,
        "suite_tokens": args.suite_tokens,
        **extra,
    }
    if report.get("recipe") != recipe:  # another recipe's points would not continue this curve
        report["points"] = []
    report["recipe"] = recipe
    train_ids = frequent_ids(data, cfg.train_vocab, trunk.vocab_size)
    tokens_per_sequence = data.num_response_tokens / max(data.num_sequences, 1)
    memo = forge_ablation.MemoTrunk(trunk)
    head = build_head(trunk, "pre_norm", "pre_norm", 1)
    init_from_head(head, args.init_head, trunk, fingerprint)
    done = {p["step"] for p in report["points"]}
    stops = [0, *range(args.eval_every, args.steps, args.eval_every), args.steps]
    stops = [s for s in stops if args.until is None or s <= args.until]
    for stop in stops:
        if stop in done:
            continue
        t0 = time.time()
        if stop:
            train_head(cfg, trunk, head, data, train_ids, ckpt_dir, args.steps, stop_at=stop)
        trained = time.time() - t0
        t0 = time.time()
        scores = forge_ablation.score(memo, head, held, suite, args.origins)
        point = {
            "step": stop,
            "tokens": round(stop * cfg.batch_size * tokens_per_sequence),
            "epochs": round(stop * cfg.batch_size / data.num_sequences, 2),
            "train_seconds": round(trained, 1),
            "score_seconds": round(time.time() - t0, 1),
            **scores,
        }
        report["points"] = sorted([*report["points"], point], key=lambda p: p["step"])
        write(args.json, report)
        unseen = f" unseen samples d1 {point['held_out']['1']}" if "held_out" in point else ""
        print(f"step {stop}: suite d1 {point['suite_depth1']}{unseen}", flush=True)
    return report


def write(path: Path, report: dict) -> None:
    with atomic_write(path) as f:
        f.write(json.dumps(report, indent=1) + "\n")


def markdown_table(report: dict) -> str:
    """One row per scored step: suite greedy text d1 (by kind), unseen t 0.7 samples d1-d3; t 0 / t 0.7."""
    kinds = sorted(report["points"][0]["suite_depth1_by_kind"]) if report.get("points") else []
    lines = [
        "| step (tokens, epochs) | suite d1 | "
        + " | ".join(f"suite {k}" for k in kinds)
        + " | unseen samples d1 | d2 | d3 |",
        "|---" * (5 + len(kinds)) + "|",
    ]
    for p in report.get("points", []):
        cells = [f"{p['suite_depth1']['0.0']:.3f} / {p['suite_depth1']['0.7']:.3f}"]
        cells += [f"{p['suite_depth1_by_kind'][k]['0.0']:.2f}" for k in kinds]
        cells += [f"{p['held_out'][d]['0.0']:.3f} / {p['held_out'][d]['0.7']:.3f}" for d in ("1", "2", "3")]
        lines.append(f"| {p['step']} ({p['tokens'] / 1e3:.0f}k, {p['epochs']}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path, other: dict | None = None) -> None:
    """Suite greedy text and unseen samples, depth 1, against steps; ``other`` (a --samples-only arm) beside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    arms = [("", report, ("C0", "C1"))] + ([("samples only: ", other, ("C2", "C3"))] if other else [])
    for prefix, arm, colors in arms:
        points = arm["points"]
        steps = [p["step"] for p in points]
        for t, style in (("0.0", "-o"), ("0.7", "--s")):
            suite = [p["suite_depth1"][t] for p in points]
            unseen = [p["held_out"]["1"][t] for p in points]
            ax.plot(steps, suite, style, color=colors[0], label=f"{prefix}suite greedy text, t {t}")
            ax.plot(steps, unseen, style, color=colors[1], label=f"{prefix}unseen samples, t {t}")
    ax.axhline(0.41, color="grey", lw=0.8, ls=":", label="forge's plateau on the suite (0.41)")
    ax.set_xlabel("training steps (8 sequences each)")
    ax.set_ylabel("teacher-forced first-draft acceptance")
    ax.set_title(
        f"in-sample ceiling: the shipped head fine-tuned on the suite's text (lr {report['recipe']['lr']})"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


if __name__ == "__main__":
    main()
