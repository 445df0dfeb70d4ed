"""Speculation under a grammar: the speed-up of head drafting over AR for JSON-schema requests,
against the same speed-up without a grammar, and what the masks cost per cycle (issue 26).

Default model + shipped head. Each prompt asks for a JSON object; every (prompt, setting) runs
four variants interleaved, ``--repeats`` times: {grammar, free} x {head, none}. Reported per
variant: decode tok/s (median over runs), the median of paired head / AR ratios (the two runs of a
prompt in one repeat, back to back), tokens per cycle, host reads of drafts per cycle and
llguidance mask milliseconds per cycle (grammar runs). Run from the repository root:
``python benchmarks/grammar_speed.py [--repeats 2] [--max-tokens 64] [--depth D]``
-> benchmarks/results/grammar-speed-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.grammar_spec import Grammar
from mtplx.io import atomic_write

OUT = "benchmarks/results/grammar-speed-cpu.json"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional person as JSON with name, age, city and hobbies.",
    "Give me a JSON record for a retired teacher who lives by the sea.",
    "Invent a character for a novel and return it as JSON (name, age, city, hobbies).",
]
SETTINGS = {"greedy": dict(temperature=0.0), "t0.8": dict(temperature=0.8, top_p=0.95)}


def run_once(
    engine: Engine, prompt: str, setting: dict, draft: str, grammar, max_tokens: int, seed: int, depth
):
    messages = [{"role": "user", "content": prompt}]
    result = engine.generate(
        messages, max_tokens=max_tokens, seed=seed, draft=draft, depth=depth, grammar=grammar, **setting
    )
    stats = result.stats
    cycles = max(stats.cycles, 1)
    return dict(
        decode_tps=stats.decode_tokens_per_sec,
        tokens=stats.generated_tokens,
        tau=stats.tokens_per_cycle,
        reads_per_cycle=stats.grammar_reads / cycles,
        mask_ms_per_cycle=1000 * stats.grammar_mask_seconds / cycles,
        finish=result.finish_reason,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=None, help="head depth (default: the engine's)")
    args = parser.parse_args()
    engine = Engine.load()
    grammar = Grammar.json_schema(SCHEMA)
    engine.generate("warm up", max_tokens=4, grammar=grammar)  # builds the llguidance tokenizer once
    variants = [(g, d) for g in ("grammar", "free") for d in ("head", "none")]
    runs: dict[tuple, list[dict]] = {}
    for repeat in range(args.repeats):
        for name, setting in SETTINGS.items():
            for index, prompt in enumerate(PROMPTS):
                for kind, draft in variants:
                    row = run_once(
                        engine,
                        prompt,
                        setting,
                        draft,
                        grammar if kind == "grammar" else None,
                        args.max_tokens,
                        seed=index,
                        depth=args.depth if draft == "head" else None,
                    )
                    runs.setdefault((name, kind, draft), []).append(row)
                    print(
                        json.dumps(
                            dict(repeat=repeat, setting=name, prompt=index, kind=kind, draft=draft, **row)
                        )
                    )
    summary = []
    for name in SETTINGS:
        for kind in ("grammar", "free"):
            head, none = runs[(name, kind, "head")], runs[(name, kind, "none")]
            head_tps = statistics.median(r["decode_tps"] for r in head)
            none_tps = statistics.median(r["decode_tps"] for r in none)
            # Runs of the same (repeat, prompt) ran back to back, so their ratio is paired: the
            # load of that moment divides out, which the ratio of medians does not do.
            paired = statistics.median(h["decode_tps"] / n["decode_tps"] for h, n in zip(head, none))
            summary.append(
                dict(
                    setting=name,
                    kind=kind,
                    head_tps=round(head_tps, 2),
                    ar_tps=round(none_tps, 2),
                    speedup=round(head_tps / none_tps, 3),
                    paired_speedup=round(paired, 3),
                    head_tau=round(statistics.mean(r["tau"] for r in head), 3),
                    head_reads_per_cycle=round(statistics.mean(r["reads_per_cycle"] for r in head), 2),
                    head_mask_ms_per_cycle=round(statistics.mean(r["mask_ms_per_cycle"] for r in head), 2),
                    ar_mask_ms_per_token=round(statistics.mean(r["mask_ms_per_cycle"] for r in none), 2),
                    head_stopped=sum(r["finish"] == "stop" for r in head),
                    runs=len(head),
                )
            )
            print(json.dumps(summary[-1]))
    result = dict(
        depth=args.depth or engine.depth, repeats=args.repeats, max_tokens=args.max_tokens, summary=summary
    )
    with atomic_write(OUT) as handle:
        handle.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
