"""Tokens per verify cycle and per-drafter acceptance on the grounded prompts (greedy): head, lookup, auto.

A quick look that machine load does not change (cycles and acceptance); speed comes from
`mtplx bench --drafts head,lookup,auto --kinds grounded`. Run from the repository root:
``python benchmarks/drafters_acceptance.py`` -> benchmarks/results/drafters-grounded-cpu.json.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.bench.runners import ban_bias
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.io import atomic_write

OUT = "benchmarks/results/drafters-grounded-cpu.json"
DRAFTS = ("head", "lookup", "auto")


def main() -> None:
    engine = Engine.load(depth=1)
    bias = ban_bias(engine.tokenizer)
    rows = []
    for prompt in load_prompts(kinds=["grounded"], per_kind=2):
        for draft in DRAFTS:
            stats = engine.generate(
                prompt.engine_input, chat=prompt.is_chat, max_tokens=48, seed=1, draft=draft, logit_bias=bias
            ).stats
            rows.append(
                dict(
                    prompt=prompt.id,
                    kind=prompt.kind,
                    temp=0.0,
                    draft=draft,
                    tokens=stats.generated_tokens,
                    cycles=stats.cycles,
                    tau=round(stats.tokens_per_cycle, 3),
                    drafters=stats.drafters,
                    decode_tps=round(stats.decode_tokens_per_sec, 2),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    with atomic_write(OUT) as handle:
        handle.write(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
