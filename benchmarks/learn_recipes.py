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
trunk's own distributions over the user's text, not the response positions only),
``samples=k`` (also train on the first ``k`` of ``--samples`` answers the trunk samples per
training request at ``--sample-temperature`` / ``--sample-top-p``: forge's recipe, more of the
trunk's own writing per prompt; cached in ``--samples-cache``). ``eval`` scores the candidate every
that many steps as well (the schedule stays the one of ``steps``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
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
from tqdm import tqdm

KEYS = {"lr": float, "steps": int, "batch": int, "train": int, "eval": int, "prompt": int, "samples": int}


def parse_recipe(text: str) -> dict:
    """``"lr=3e-4,steps=40,train=24"`` -> {"lr": 3e-4, "steps": 40, "train": 24}."""
    recipe = {}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in KEYS:
            raise SystemExit(f"--recipes: unknown key {key!r} (one of {', '.join(KEYS)})")
        recipe[key] = KEYS[key](value)
    return recipe


class Samples:
    """``count`` sampled answers per prompt (seeded: sample ``j`` of a prompt uses seed ``j``), generated
    in one batch and kept in a JSON-lines file (``--samples-cache``) as `Answers` keeps greedy ones."""

    def __init__(self, engine: Engine, count: int, temperature: float, top_p: float, max_tokens: int, path):
        self.engine, self.count, self.path = engine, count, path
        self.setting = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        self.known: dict[tuple[str, int], list[int]] = {}
        if path and Path(path).exists():
            for line in Path(path).read_text().splitlines():
                row = json.loads(line)
                if row["setting"] == self.setting:
                    self.known[(Answers._key(row["prompt"]), row["seed"])] = row["tokens"]

    def __call__(self, prompts: list[list[int]]) -> list[list[list[int]]]:
        """Per prompt, its ``count`` sampled answers (each with its EOS when it stopped)."""
        missing = [
            (p, j) for p in prompts for j in range(self.count) if (Answers._key(p), j) not in self.known
        ]
        if missing:
            print(f"sampling {len(missing)} answers in one batch", flush=True)
            requests = [GenerationRequest.from_kwargs(**self.setting, seed=j) for _, j in missing]
            results = self.engine.generate_batch(
                [p for p, _ in missing], requests, max_rows=16, progress=True
            )
            for (prompt, j), result in zip(missing, results):
                tokens = list(result.token_ids) + ([result.eos_token] if result.eos_token is not None else [])
                self.known[(Answers._key(prompt), j)] = tokens
                if self.path:
                    with open(self.path, "a") as f:
                        row = {"setting": self.setting, "prompt": prompt, "seed": j, "tokens": tokens}
                        f.write(json.dumps(row) + "\n")
        return [[self.known[(Answers._key(p), j)] for j in range(self.count)] for p in prompts]


def rows(data: ForgeData, picked: list[int], lengths: list[int] | None = None) -> ForgeData:
    """The rows ``picked``; with ``lengths`` (each sequence's), every position before a row's last
    trains, the prompt's too (the recipe key ``prompt=1``), not the response positions only."""
    valid = data.valid[picked]
    if lengths is not None:
        valid = np.zeros_like(valid)
        for r, row in enumerate(picked):
            valid[r, : lengths[row] - 1] = True
    return ForgeData(
        data.tokens[picked], data.hidden[picked], data.top_ids[picked], data.top_logp[picked], valid
    )


def picked_rows(recipe: dict, traffic: int, samples: int) -> list[int]:
    """The data's rows a recipe trains on: the first ``train`` greedy answers (rows ``0..traffic-1``),
    then the first ``samples`` sampled answers of each of those requests (row ``traffic + i*samples + j``)."""
    train = recipe.get("train", traffic)
    k = recipe.get("samples", 0)
    if k > samples:
        raise SystemExit(f"--recipes: samples={k} but only --samples {samples} were drawn")
    return list(range(train)) + [traffic + i * samples + j for i in range(train) for j in range(k)]


def run_recipe(engine, shipped, full_proj, data, lengths, picked, recipe, held, gate_pairs) -> dict:
    """One round from the shipped head under ``recipe``: held-out (and gate) acceptance per eval point."""
    cfg = LearnConfig(
        **{
            **vars(DEFAULT_LEARN_CONFIG),
            "lr": recipe.get("lr", DEFAULT_LEARN_CONFIG.lr),
            "steps": recipe.get("steps", DEFAULT_LEARN_CONFIG.steps),
            "batch_size": recipe.get("batch", DEFAULT_LEARN_CONFIG.batch_size),
        }
    )
    train = rows(data, picked, lengths if recipe.get("prompt") else None)
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
    parser.add_argument("--samples", type=int, default=0, help="answers sampled per traffic request")
    parser.add_argument("--sample-temperature", type=float, default=0.7)
    parser.add_argument("--sample-top-p", type=float, default=0.95)
    parser.add_argument("--samples-cache", default=None, help="JSON-lines cache of the sampled answers")
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
    if args.samples:
        sampler = Samples(
            engine,
            args.samples,
            args.sample_temperature,
            args.sample_top_p,
            args.max_tokens,
            args.samples_cache,
        )
        drawn = sampler([p for p, _ in traffic])
        # One record per sampled answer, after the greedy ones: row traffic + i*samples + j.
        records += [
            Record(tuple(p), (Choice(tuple(t), "stop"),), engine.fingerprint)
            for (p, _), answers_i in zip(traffic, drawn)
            for t in answers_i
        ]
    seqs = sequences(records, DEFAULT_LEARN_CONFIG.seq_len)
    if len(seqs) != len(records):  # the rows' order is picked_rows'
        raise SystemExit(f"{len(records) - len(seqs)} answers have no position to train on")
    data = empty_data(engine.trunk, len(seqs), max(len(t) for t, _ in seqs), DEFAULT_LEARN_CONFIG.top_k)
    for r, (tokens, p) in enumerate(tqdm(seqs, desc="teacher forwards", unit="seq", file=sys.stderr)):
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
        picked = picked_rows(recipe, len(traffic), args.samples)
        row = run_recipe(
            engine, shipped, full_proj, data, [len(t) for t, _ in seqs], picked, recipe, held, gate_pairs
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
