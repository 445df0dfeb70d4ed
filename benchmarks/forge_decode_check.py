"""Training vs decoding (issue 28, item 1c): is what the head sees in decoding what forge trained and
scored it on? Every first draft of real decoding, next to forge's teacher-forced evaluation of the
same head at exactly the same position of the same text.

For each prompt of ``benchmarks/prompts/suite.jsonl`` and each run (greedy at depth 1 and 3; t 0.7
without top-p at depth 1, so the trunk's p is its softmax at 0.7 in both measures), the engine
generates ``--tokens`` tokens with the head (`Engine.generate`, `mtplx generate`'s path: prompt
cache session, the one scheduler and cycle as a batch of one, `HeadChain`), and every cycle's outcome is taken from the
loop's own `Step`s: where it drafted (the first draft of a cycle that starts with n generated tokens
is a draft of token n, scored by the trunk at position P + n - 1), whether the first draft was
kept, and its min(1, p/q). The decode's text is then scored teacher-forced as `mtplx forge`
scores held-out data (`mtplx.forge.evaluate`: one full trunk forward, the head over every
position with a fresh cache, argmax agreement at t 0, 1 - TV(p, q) at t 0.7), and read at the
cycles' positions:

* greedy: the decision is deterministic, so the two must agree position by position; the
  report counts the positions where they differ (floating-point near-ties aside, a difference is a
  mismatch between what the head sees in decoding and in training / evaluation);
* t 0.7: min(1, p(d)/q(d)) of the drawn draft has expectation 1 - TV(p, q) at that position, so the
  mean paired difference must be zero within its standard error.

The teacher-forced figure over the same positions is also computed by
`mtplx.forge.evaluate.evaluate_acceptance` itself (``valid`` = the cycles' positions), as a check
that the per-position reading here is forge's own measure.

    nice -n 19 .venv/bin/python benchmarks/forge_decode_check.py --tokens 64 \
        --json benchmarks/results/forge-decode-check.json

No timing is taken: acceptance does not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine import output as output_module
from mtplx.engine.engine import Engine
from mtplx.forge.evaluate import acceptance, evaluate_acceptance
from mtplx.forge.prompts import read_held_out
from mtplx.io import atomic_write

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
SUITE = HERE / "prompts" / "suite.jsonl"
RUNS = {  # name: (sampling, depth)
    "greedy-d1": (dict(temperature=0.0), 1),
    "greedy-d3": (dict(temperature=0.0), 3),
    "t0.7-d1": (dict(temperature=0.7, top_p=1.0), 1),
}


class StepRecorder:
    """Tees the one cycle's `Step`s of every request the engine decodes into ``steps`` (each
    request's steps reach `RequestOutput.feed`, first token included, in order)."""

    def __init__(self) -> None:
        self.steps: list = []
        self.original = output_module.RequestOutput.feed

    def __enter__(self) -> StepRecorder:
        original, steps = self.original, self.steps

        def tee(output, step):
            steps.append(step)
            return original(output, step)

        output_module.RequestOutput.feed = tee
        return self

    def __exit__(self, *exc) -> None:
        output_module.RequestOutput.feed = self.original


def cycles_of(steps: list, prompt_len: int, generated: int) -> list[dict]:
    """Each drafting cycle: the trunk position scoring its first draft, kept or not, min(1, p/q)."""
    out, n = [], 0
    for step in steps:
        if step.num_drafted and n < generated:
            out.append(
                {
                    "position": prompt_len + n - 1,
                    "kept": step.num_accepted >= 1,
                    "accept_prob": float(step.accept_probs[0]),
                }
            )
        n += len(step.tokens)
    return out


def teacher_forced(engine: Engine, window: list[int], temperature: float) -> np.ndarray:
    """Per trunk position s: forge's teacher-forced acceptance of the head's draft scored there
    (the head at s - 1, given the trunk's hidden state at s - 1 and token s); NaN at s = 0."""
    return teacher_forced_all(engine, window, (temperature,))[temperature]


def teacher_forced_all(
    engine: Engine, window: list[int], temperatures: tuple[float, ...], chunk: int = 512
) -> dict[float, np.ndarray]:
    """`teacher_forced` at each of ``temperatures`` from one trunk and one head forward; p and q
    are read ``chunk`` positions at a time (a 4k-token window's logits are 0.8 GB each in float32)."""
    head, tokens = engine.head, mx.array([window])
    out = engine.trunk(tokens)
    hidden = out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm
    g = head(hidden[:, :-1], tokens[:, 1:], head.make_cache())
    mx.eval(out.logits, g)
    result = {t: [np.array([np.nan])] for t in temperatures}
    for start in range(0, len(window) - 1, chunk):
        p = np.asarray(out.logits[0, 1 + start : 1 + start + chunk].astype(mx.float32))
        q = np.asarray(head.logits(g[:, start : start + chunk]).astype(mx.float32))[0]
        for t in temperatures:
            result[t].append(acceptance(p, q, t))
    return {t: np.concatenate(parts) for t, parts in result.items()}


def forge_figure(engine: Engine, window: list[int], positions: list[int], temperature: float) -> float:
    """`evaluate_acceptance` itself, counting only ``positions`` (the drafts scored there)."""
    valid = np.zeros((1, len(window)), dtype=bool)
    valid[0, positions] = True
    table = evaluate_acceptance(
        engine.trunk, engine.head, np.array([window]), depths=1, temperatures=(temperature,), valid=valid
    )
    return table["1"][str(temperature)]


def run(engine: Engine, name: str, tokens: int, seed: int) -> dict:
    sampling, depth = RUNS[name]
    temperature = sampling["temperature"]
    rows, per_kind = [], {}
    for p in read_held_out(SUITE):
        request = [{"role": r, "content": c} for r, c in p.messages] if p.is_chat else p.text
        prompt = engine.encode_prompt(request, chat=p.is_chat)
        with StepRecorder() as rec:
            result = engine.generate(
                request, max_tokens=tokens, depth=depth, mtp=True, seed=seed, chat=p.is_chat, **sampling
            )
        window = prompt + list(result.token_ids)
        cycles = cycles_of(rec.steps, len(prompt), len(result.token_ids))
        positions = [c["position"] for c in cycles]
        tf = teacher_forced(engine, window, temperature)[positions]
        decoded = np.array([c["kept"] if temperature == 0 else c["accept_prob"] for c in cycles], dtype=float)
        row = {
            "prompt": p.source,
            "kind": p.kind,
            "cycles": len(cycles),
            "decode_first": float(decoded.mean()),
            "decode_first_kept": float(np.mean([c["kept"] for c in cycles])),
            "teacher_forced_same_positions": float(tf.mean()),
            "forge_evaluate_same_positions": forge_figure(engine, window, positions, temperature),
            "engine_stats_first": float(result.stats.acceptance_per_position[0]),
            "differing_positions": int(np.sum(decoded != tf)) if temperature == 0 else None,
            "paired_diff": (decoded - tf).tolist(),
        }
        rows.append(row)
        print(
            f"{name} {p.source}: {len(cycles)} cycles, decode {row['decode_first']:.3f} "
            f"teacher-forced {row['teacher_forced_same_positions']:.3f} "
            f"(forge evaluate {row['forge_evaluate_same_positions']:.3f})",
            file=sys.stderr,
            flush=True,
        )
        per_kind.setdefault(p.kind, []).append(row)
    summary = {"all": pool(rows), **{k: pool(v) for k, v in sorted(per_kind.items())}}
    for r in rows:
        del r["paired_diff"]
    return {"sampling": sampling, "depth": depth, "summary": summary, "prompts": rows}


def pool(rows: list[dict]) -> dict:
    """Cycle-weighted means of both measures, the paired difference and its standard error."""
    diffs = np.concatenate([np.array(r["paired_diff"]) for r in rows])
    cycles = sum(r["cycles"] for r in rows)
    mean = {
        k: round(sum(r[k] * r["cycles"] for r in rows) / max(cycles, 1), 4)
        for k in ("decode_first", "teacher_forced_same_positions", "forge_evaluate_same_positions")
    }
    out = {
        "cycles": cycles,
        **mean,
        "paired_difference": round(float(diffs.mean()), 4),
        "paired_difference_se": round(float(diffs.std(ddof=1) / math.sqrt(len(diffs))), 4)
        if len(diffs) > 1
        else None,
    }
    if rows[0]["differing_positions"] is not None:
        out["differing_positions"] = sum(r["differing_positions"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=None, help="a forged head directory (default: the engine's)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--json", type=Path, default=Path("forge-decode-check.json"))
    args = ap.parse_args()
    engine = Engine.load(head=args.head) if args.head else Engine.load()
    report = json.loads(args.json.read_text()) if args.json.is_file() else {}
    report.update(tokens=args.tokens, seed=args.seed, suite=str(SUITE.relative_to(HERE.parent)))
    report.setdefault("runs", {})
    for name in [r.strip() for r in args.runs.split(",") if r.strip()]:
        report["runs"][name] = run(engine, name, args.tokens, args.seed)
        with atomic_write(args.json) as f:
            f.write(json.dumps(report, indent=1) + "\n")
        print(name, json.dumps(report["runs"][name]["summary"]["all"]), flush=True)


if __name__ == "__main__":
    main()
