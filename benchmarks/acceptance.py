"""Acceptance per draft position in REAL decoding, through the engine's loop, on the held-out suite.

    .venv/bin/python benchmarks/acceptance.py --head models/smollm2-135m-instruct \
        --tokens 64 --depth 3 --json benchmarks/results/acceptance-<name>.json

For every prompt of ``benchmarks/prompts/suite.jsonl`` (code and prose: raw continuation;
chat: through the chat template, as ``mtplx generate`` sends them) and each setting
(greedy; t 0.7 / top-p 0.95, seeded) it generates ``--tokens`` tokens with MTP at ``--depth``
and pools the engine's own statistics over prompts, weighted by verify cycles:

* ``reach[k]``: P(drafts 1..k all accepted) per cycle (the engine's acceptance_per_position);
* ``conditional[k]``: P(draft k accepted | drafts 1..k-1 accepted) = reach[k] / reach[k-1];
* ``tau``: tokens committed per verify cycle at this depth; ``tau_at_depth[d]`` = 1 + sum of
  reach[1..d], what a run at depth d would commit (drafts 1..d are the same chain);
* ``best_depth_estimate``: argmax over d of efficiency(d) * tau_at_depth[d], with the loop
  efficiency per depth measured in the last full `mtplx bench` sweep (benchmarks/RESULTS.md),
  because a timing sweep on a loaded machine means nothing. It is an estimate, labelled so.

With ``--teacher-forced``, each greedy generation is also scored teacher-forced (the head at
every generated position, given the trunk's hidden state and the true next token: what
`mtplx forge` reports on its held-out data), pooled per kind as ``teacher_forced_first``. On the
same text the two should agree; a gap between this and the forge manifest's figure is a gap
between the suite's text and the forge data, not a decoding bug.

No timing is taken: acceptance does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.forge.evaluate import evaluate_acceptance
from mtplx.forge.prompts import read_held_out

import numpy as np

HERE = Path(__file__).resolve().parent
SUITE = HERE / "prompts" / "suite.jsonl"
SETTINGS = {"greedy": dict(temperature=0.0), "t0.7-p0.95": dict(temperature=0.7, top_p=0.95)}
# Loop efficiency (x stock / tau theory) per depth, greedy and sampled, from the sweep in RESULTS.md.
EFFICIENCY = {"greedy": {1: 0.84, 2: 0.83, 3: 0.75}, "t0.7-p0.95": {1: 0.84, 2: 0.77, 3: 0.67}}


def teacher_forced_first(engine: Engine, prompt_tokens: list[int], generated: list[int]) -> float:
    """Greedy first-draft acceptance of the head at every generated position, teacher-forced."""
    window = np.array([prompt_tokens + generated])
    scored = np.zeros(window.shape, dtype=bool)
    scored[0, len(prompt_tokens) :] = True
    table = evaluate_acceptance(
        engine.trunk, engine.head, window, depths=1, temperatures=(0.0,), valid=scored
    )
    return table["1"]["0.0"]


def measure(
    engine: Engine,
    depth: int,
    tokens: int,
    seed: int,
    per_kind: int | None = None,
    teacher_forced: bool = False,
) -> dict:
    prompts, taken = [], {}
    for p in read_held_out(SUITE):  # the first ``per_kind`` prompts of each kind, in suite order
        taken[p.kind] = taken.get(p.kind, 0) + 1
        if per_kind is None or taken[p.kind] <= per_kind:
            prompts.append(p)
    table: dict = {}
    for setting, sampling in SETTINGS.items():
        pooled: dict[str, dict] = {}
        for p in prompts:
            request = [{"role": r, "content": c} for r, c in p.messages] if p.is_chat else p.text
            result = engine.generate(
                request, max_tokens=tokens, depth=depth, mtp=True, seed=seed, chat=p.is_chat, **sampling
            )
            s = result.stats
            tf = None
            if teacher_forced and setting == "greedy":
                prompt_tokens = engine.encode_prompt(request, chat=p.is_chat)
                tf = teacher_forced_first(engine, prompt_tokens, result.token_ids)
            for key in (p.kind, "all"):
                row = pooled.setdefault(key, {"cycles": 0, "reach_sum": [0.0] * depth, "committed": 0})
                if tf is not None:  # weighted by the positions scored
                    row["tf_sum"] = row.get("tf_sum", 0.0) + tf * len(result.token_ids)
                    row["tf_positions"] = row.get("tf_positions", 0) + len(result.token_ids)
                row["cycles"] += s.cycles
                row["committed"] += round(s.tokens_per_cycle * s.cycles)
                for k, a in enumerate(s.acceptance_per_position):
                    row["reach_sum"][k] += a * s.cycles
            print(
                f"{setting} {p.source}: tau {s.tokens_per_cycle:.2f} {s.acceptance_per_position}"
                + ("" if tf is None else f" teacher-forced first {tf:.3f}"),
                file=sys.stderr,
            )
        table[setting] = {kind: _summarize(row, setting, depth) for kind, row in pooled.items()}
    return table


def _summarize(row: dict, setting: str, depth: int) -> dict:
    cycles = max(row["cycles"], 1)
    reach = [r / cycles for r in row["reach_sum"]]
    conditional = [reach[0]] + [reach[k] / reach[k - 1] if reach[k - 1] else 0.0 for k in range(1, depth)]
    tau_at = {d: 1.0 + sum(reach[:d]) for d in range(1, depth + 1)}
    eff = EFFICIENCY[setting]
    best = max((d for d in tau_at if d in eff), key=lambda d: eff[d] * tau_at[d])
    extra = {}
    if row.get("tf_positions"):
        extra["teacher_forced_first"] = round(row["tf_sum"] / row["tf_positions"], 3)
    return {
        **extra,
        "cycles": row["cycles"],
        "reach": [round(x, 3) for x in reach],
        "conditional": [round(x, 3) for x in conditional],
        "tau": round(row["committed"] / cycles, 3),
        "tau_at_depth": {str(d): round(t, 3) for d, t in tau_at.items()},
        "best_depth_estimate": best,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head", required=True, help="forged head directory")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--per-kind", type=int, default=None, help="first N prompts of each kind (default all)"
    )
    parser.add_argument(
        "--teacher-forced", action="store_true", help="also score greedy generations teacher-forced"
    )
    parser.add_argument("--json", default=None, help="write the table here")
    args = parser.parse_args(argv)
    engine = Engine.load(None, head=args.head)
    table = measure(engine, args.depth, args.tokens, args.seed, args.per_kind, args.teacher_forced)
    record = {
        "head": args.head,
        "depth": args.depth,
        "tokens": args.tokens,
        "seed": args.seed,
        "per_kind": args.per_kind,
        "table": table,
    }
    text = json.dumps(record, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
