"""How far can a better drafter go on the default model? Drafters replayed on recorded AR text,
next to two foresight bounds (issue 11's speed targets).

A point-mass draft d verified exactly is accepted with probability p(d), and on rejection the
token is drawn from p without d: the same law as "draw x ~ p, accept iff x == d". So on a
recorded plain-AR trajectory a deterministic drafter keeps exactly the common prefix of its
block and the text, at any temperature, and each drafter can be replayed without running the
trunk again. Replayed here, per suite prompt and setting (greedy; t 0.7 / top-p 0.95):

* ``head``: the loaded head's first draft at depth 1 (stored with the trajectories), as its argmax (the engine's
  ``greedy_draft`` mode; at t 0.7 the default sampled head draft differs slightly);
* ``lookup`` and ``auto``: the engine's own `LookupProposer` (default config, adaptive blocks)
  and auto's rule (lookup when a suffix matches, else the head);
* ``auto, occurrence foresight``: auto whose lookup knows which earlier occurrence of the
  matching suffix (n >= 1) continues with the right token, and leaves the cycle to the head
  when none does;
* ``copy foresight``: proposes exactly the longest run of the coming text that occurs anywhere
  earlier (no wasted position): the ceiling of any drafter that copies from the context.

Speed-up over AR is modelled from the profiler's costs (benchmarks/RESULTS.md, "Where the time
goes"): a cycle costs 1 AR step + ``--verify-cost`` per drafted position + ``--head-cost`` when the
head drafted. `mtplx bench` measures the real thing; this shows what is left to gain.

    .venv/bin/python benchmarks/experiments/drafter_bounds.py --json benchmarks/results/drafter-bounds.json

Trajectories (prompt ids and generated ids) are kept in ``--trajectories`` and reused.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.bench.runners import ban_bias
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.io import atomic_write
from mtplx.spec_decode.lookup_proposer import LookupConfig, LookupProposer
from mtplx.spec_decode.sources import Source

import mlx.core as mx
import numpy as np

SETTINGS = {"greedy": (0.0, 1.0), "t0.7-p0.95": (0.7, 0.95)}


@dataclass
class Trajectory:
    prompt_id: str
    kind: str
    setting: str
    prompt_ids: list[int]
    generated: list[int]
    head_first: list[int] = field(default_factory=list)  # the head's argmax draft for each generated position


def record(engine: Engine, tokens: int, samples: int) -> list[Trajectory]:
    """Plain AR text for every suite prompt: greedy (seed 0), sampled with seeds 1..``samples`` (EOS banned)."""
    bias = ban_bias(engine.tokenizer)
    out = []
    for prompt in load_prompts():
        prompt_ids = engine.encode_prompt(prompt.engine_input, chat=prompt.is_chat)
        for setting, (temperature, top_p) in SETTINGS.items():
            for seed in [0] if temperature == 0.0 else range(1, samples + 1):
                result = engine.generate(
                    prompt.engine_input,
                    chat=prompt.is_chat,
                    max_tokens=tokens,
                    seed=seed,
                    draft="none",
                    temperature=temperature,
                    top_p=top_p,
                    logit_bias=bias,
                )
                out.append(Trajectory(prompt.id, prompt.kind, setting, list(prompt_ids), result.token_ids))
                print(f"recorded {prompt.id} {setting} seed {seed}", flush=True)
    return out


def add_head_drafts(engine: Engine, trajectory: Trajectory) -> None:
    """Teacher-forced first drafts: the head at position s-2 (trunk state, token s-1) drafts token s."""
    text = trajectory.prompt_ids + trajectory.generated
    tokens = mx.array([text])
    out = engine.trunk(tokens)
    source = out.hidden_pre_norm if engine.head.hidden_source == "pre_norm" else out.hidden_post_norm
    states = engine.head(source[:, :-1], tokens[:, 1:], engine.head.make_cache())
    drafts = np.asarray(mx.argmax(engine.head.logits(states), axis=-1))[0]
    start = len(trajectory.prompt_ids)
    trajectory.head_first = [int(drafts[s - 2]) for s in range(start, len(text))]


def common_prefix(block: list[int], text: list[int]) -> int:
    n = 0
    while n < min(len(block), len(text)) and block[n] == text[n]:
        n += 1
    return n


# A policy sees the committed text, the head's draft for the next position and what the last
# cycle kept; it returns its block and whether the head drafted it.
Policy = Callable[[list[int], int], tuple[list[int], bool]]


class LookupReplay:
    """The engine's LookupProposer, told each cycle's outcome as the loop would tell it."""

    def __init__(self) -> None:
        self.proposer = LookupProposer(LookupConfig())
        self.last_block: list[int] = []

    def find(self, history: list[int]) -> list[int]:
        self.last_block = self.proposer.find(history)
        return self.last_block

    def kept(self, num_accepted: int) -> None:
        if self.last_block:
            self.proposer.adapt(((Source.LOOKUP, len(self.last_block)),), num_accepted)
        self.last_block = []


def replay(trajectory: Trajectory, drafter: str, verify_cost: float, head_cost: float) -> dict:
    history, text = list(trajectory.prompt_ids), trajectory.generated
    lookup = LookupReplay()
    position, cost, cycles = 0, 0.0, 0
    while position < len(text):
        coming = text[position:]
        head_draft = trajectory.head_first[position]
        used_head = False
        if drafter == "head":
            block, used_head = [head_draft], True
        elif drafter == "lookup":
            block = lookup.find(history)
        elif drafter == "auto":
            block = lookup.find(history)
            if not block:
                block, used_head = [head_draft], True
        elif drafter == "auto, occurrence foresight":
            block = _occurrence_foresight(history, coming)
            if not block:
                block, used_head = [head_draft], True
        else:  # copy foresight
            block = coming[: _longest_earlier_run(history, coming)]
        block = block[: len(coming)]
        accepted = common_prefix(block, coming)
        lookup.kept(accepted)
        kept = min(accepted + 1, len(coming))
        cost += 1.0 + verify_cost * len(block) + (head_cost if used_head else 0.0)
        cycles += 1
        history += coming[:kept]
        position += kept
    return dict(tokens=len(text), cost=cost, cycles=cycles)


def _occurrence_foresight(
    history: list[int], coming: list[int], max_n: int = 6, block: int = 10
) -> list[int]:
    """Among the earlier occurrences of the longest matching suffix, the latest whose continuation
    starts with the coming token; that continuation up to ``block`` tokens, or nothing."""
    end = len(history)
    for n in range(min(max_n, end - 1), 0, -1):
        suffix = history[end - n :]
        starts = [j for j in range(n, end) if history[j - n : j] == suffix]
        if starts:
            for j in reversed(starts):
                if history[j] == coming[0]:
                    return history[j : j + block]
            return []
    return []


def _longest_earlier_run(history: list[int], coming: list[int]) -> int:
    best = 0
    for j, token in enumerate(history):
        if token == coming[0]:
            best = max(best, common_prefix(history[j:], coming))
    return best


DRAFTERS = ("head", "lookup", "auto", "auto, occurrence foresight", "copy foresight")


def summarize(trajectories: list[Trajectory], verify_cost: float, head_cost: float) -> dict:
    table: dict = {}
    for t in trajectories:
        for drafter in DRAFTERS:
            r = replay(t, drafter, verify_cost, head_cost)
            for kind in (t.kind, "all"):
                cell = (
                    table.setdefault(t.setting, {})
                    .setdefault(kind, {})
                    .setdefault(drafter, dict(tokens=0, cost=0.0, cycles=0))
                )
                for key in cell:
                    cell[key] += r[key]
    for per_kind in table.values():
        for per_drafter in per_kind.values():
            for cell in per_drafter.values():
                cell["tau"] = round(cell["tokens"] / cell["cycles"], 3)
                cell["x_ar"] = round(cell["tokens"] / cell["cost"], 3)
    return table


def print_table(table: dict) -> None:
    print("modelled speed-up over plain AR (tau in brackets)")
    print("| setting | kind | " + " | ".join(DRAFTERS) + " |")
    print("|---|---|" + "---|" * len(DRAFTERS))
    for setting, per_kind in table.items():
        for kind in sorted(per_kind, key=lambda k: k == "all"):  # suite order, then the pool
            cells = per_kind[kind]
            row = " | ".join(f"{cells[d]['x_ar']:.2f}x ({cells[d]['tau']:.2f})" for d in DRAFTERS)
            print(f"| {setting} | {kind} | {row} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajectories", type=Path, default=Path("benchmarks/results/drafter-trajectories.json"))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=2, help="sampled trajectories per prompt at t 0.7")
    ap.add_argument("--verify-cost", type=float, default=0.12, help="per drafted position, in AR steps")
    ap.add_argument("--head-cost", type=float, default=0.05, help="one head draft step, in AR steps")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    if args.trajectories.is_file():
        trajectories = [Trajectory(**row) for row in json.loads(args.trajectories.read_text())]
    else:
        engine = Engine.load(depth=1)
        trajectories = record(engine, args.tokens, args.samples)
        for t in trajectories:
            add_head_drafts(engine, t)
        with atomic_write(args.trajectories) as handle:
            handle.write(json.dumps([t.__dict__ for t in trajectories]) + "\n")
    table = summarize(trajectories, args.verify_cost, args.head_cost)
    print_table(table)
    if args.json:
        with atomic_write(args.json) as handle:
            handle.write(
                json.dumps(
                    dict(
                        verify_cost=args.verify_cost,
                        head_cost=args.head_cost,
                        tokens=args.tokens,
                        table=table,
                    ),
                    indent=1,
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
