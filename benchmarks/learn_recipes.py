"""Which learning-round recipe uses served traffic best? (issue 54: `mtplx.learn.config.LearnConfig`)

    .venv/bin/python benchmarks/learn_recipes.py --answers benchmarks/results/learn-answers.jsonl \
        --pool 72 --traffic 32 --held 8 --recipes "lr=1e-4,steps=40,train=24; lr=3e-4,steps=40,train=24" \
        --json benchmarks/results/learn-recipes.json

`learn_from_traffic.py`'s workload and greedy answers (its ``--answers`` cache: the same questions,
served once), one round per recipe from the shipped head over the first ``--traffic`` requests,
each scored on the last ``--held`` questions of the pool (never trained on) with the same
teacher-forced measure as the learner's own (first-draft and per-depth acceptance, t 0 and 0.7).
The teacher-forced trunk forwards are done once and shared by every recipe, so a recipe costs its
training steps only. A recipe names what differs from the learner's defaults: ``lr``, ``steps``,
``batch`` and ``train`` (the first ``train`` requests trained on: the learner trains on the older
``1 - held_out_fraction`` of its log; the rest is its own held-out slice, whose gain, ``gate``,
decides the swap and is reported too), ``prompt=1`` (train on the prompt's positions too: the
trunk's own distributions over the user's text, not the response positions only). ``eval`` scores the candidate every that many steps as
well (the schedule stays the one of ``steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.forge.loss import frequent_ids
from mtplx.forge.record import ForgeData
from mtplx.forge.train import TrainStep
from mtplx.heads.forged import lm_head_matrix
from mtplx.io import atomic_path
from mtplx.learn.config import DEFAULT_LEARN_CONFIG, LearnConfig
from mtplx.learn.data import empty_data, fill_row, sequences
from mtplx.learn.log import Choice, Record
from mtplx.learn.trainer import copy_head, first_draft

import numpy as np
from learn_from_traffic import Answers, git_commit, teacher_forced, workload

KEYS = {"lr": float, "steps": int, "batch": int, "train": int, "eval": int, "prompt": int}


def parse_recipe(text: str) -> dict:
    """``"lr=3e-4,steps=40,train=24"`` -> {"lr": 3e-4, "steps": 40, "train": 24}."""
    recipe = {}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in KEYS:
            raise SystemExit(f"--recipes: unknown key {key!r} (one of {', '.join(KEYS)})")
        recipe[key] = KEYS[key](value)
    return recipe


def rows(data: ForgeData, n: int, lengths: list[int] | None = None) -> ForgeData:
    """The first ``n`` rows; with ``lengths`` (each sequence's), every position before a row's last
    trains, the prompt's too (the recipe key ``prompt=1``), not the response positions only."""
    valid = data.valid[:n]
    if lengths is not None:
        valid = np.zeros_like(valid)
        for r, end in enumerate(lengths[:n]):
            valid[r, : end - 1] = True
    return ForgeData(data.tokens[:n], data.hidden[:n], data.top_ids[:n], data.top_logp[:n], valid)


def run_recipe(engine, shipped, full_proj, data, lengths, recipe, held, gate_pairs) -> dict:
    """One round from the shipped head under ``recipe``: held-out (and gate) acceptance per eval point."""
    cfg = LearnConfig(
        **{
            **vars(DEFAULT_LEARN_CONFIG),
            "lr": recipe.get("lr", DEFAULT_LEARN_CONFIG.lr),
            "steps": recipe.get("steps", DEFAULT_LEARN_CONFIG.steps),
            "batch_size": recipe.get("batch", DEFAULT_LEARN_CONFIG.batch_size),
        }
    )
    train = rows(data, recipe.get("train", data.num_sequences), lengths if recipe.get("prompt") else None)
    trunk = engine.trunk
    candidate = copy_head(shipped, trunk, full_proj)
    train_ids = frequent_ids(train, cfg.train_vocab, trunk.vocab_size)
    step = TrainStep(cfg.forge_config(candidate), trunk, candidate, train, train_ids, cfg.steps)
    every = recipe.get("eval", cfg.steps)
    began, points, losses = time.perf_counter(), [], []
    for i in range(cfg.steps):
        kl, _ = step(i)
        losses.append(round(kl, 4))
        if (i + 1) % every == 0 or i + 1 == cfg.steps:
            tf = teacher_forced(engine, held, cfg.depth, candidate)
            gate = teacher_forced(engine, gate_pairs, 1, candidate) if gate_pairs else None
            points.append(
                {"steps": i + 1, "teacher_forced": tf, "first_draft": first_draft(tf), "gate": gate}
            )
            said = "" if gate is None else f", gate {first_draft(gate):.3f}"
            print(
                f"  {recipe} step {i + 1}: first-draft {first_draft(tf):.3f}{said} (loss {kl:.3f})",
                flush=True,
            )
    return {
        "recipe": recipe,
        "train_sequences": train.num_sequences,
        "seconds": time.perf_counter() - began,
        "losses": losses,
        "points": points,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--answers", required=True, help="learn_from_traffic.py's --answers cache")
    parser.add_argument("--pool", type=int, default=72, help="questions drawn (traffic first, held last)")
    parser.add_argument("--traffic", type=int, default=32)
    parser.add_argument("--held", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-lines", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipes", required=True, help='"lr=1e-4,steps=40,train=24; lr=3e-4,steps=40"')
    parser.add_argument(
        "--no-gate", action="store_true", help="skip scoring the learner's gate (the untrained traffic)"
    )
    parser.add_argument("--json", default=None, help="rewritten whole after every recipe")
    args = parser.parse_args(argv)
    recipes = [parse_recipe(r) for r in args.recipes.split(";") if r.strip()]

    engine = Engine.load()
    # The served head's draft vocabulary too (the learner's candidates keep it: `copy_head`).
    full_proj = lm_head_matrix(engine.trunk) if engine.head.vocab_ids is not None else None
    shipped = copy_head(engine.head, engine.trunk, full_proj)
    answers = Answers(engine, args.max_tokens, args.answers)
    questions = workload(args.pool, args.seed, args.max_lines)
    traffic = [answers(m) for m in questions[: args.traffic]]
    held = [answers(m) for m in questions[args.pool - args.held :]]
    records = [Record(tuple(p), (Choice(tuple(t), "stop"),), engine.fingerprint) for p, t in traffic]
    seqs = sequences(records, DEFAULT_LEARN_CONFIG.seq_len)
    data = empty_data(engine.trunk, len(seqs), max(len(t) for t, _ in seqs), DEFAULT_LEARN_CONFIG.top_k)
    for r, (tokens, p) in enumerate(seqs):
        fill_row(engine.trunk, data, r, tokens, p)
    base = teacher_forced(engine, held, DEFAULT_LEARN_CONFIG.depth, shipped)
    out = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": git_commit(),
        "config": vars(args),
        "shipped": {"teacher_forced": base, "first_draft": first_draft(base)},
        "load_average_1_5_15": {"start": os.getloadavg()},
        "recipes": [],
    }
    print(f"shipped head: first-draft {first_draft(base):.3f} on {len(held)} held-out questions", flush=True)
    for recipe in recipes:
        gate_pairs = [] if args.no_gate else traffic[recipe.get("train", len(traffic)) :]
        gate_base = teacher_forced(engine, gate_pairs, 1, shipped) if gate_pairs else None
        row = run_recipe(
            engine, shipped, full_proj, data, [len(t) for t, _ in seqs], recipe, held, gate_pairs
        )
        row["gate_shipped"] = gate_base
        out["recipes"].append(row)
        out["load_average_1_5_15"]["end"] = os.getloadavg()
        said = ", ".join(f"{p['steps']}: {p['first_draft']:.3f}" for p in row["points"])
        gate = ""
        if gate_base is not None:
            gate = f"  gate {first_draft(gate_base):.3f} -> {first_draft(row['points'][-1]['gate']):.3f}"
        print(f"{recipe}: first-draft by steps {said} ({row['seconds']:.0f}s){gate}", flush=True)
        if args.json:
            with atomic_path(Path(args.json)) as tmp:
                tmp.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
