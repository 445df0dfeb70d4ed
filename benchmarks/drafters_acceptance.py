"""Tokens per verify cycle and per-drafter acceptance on the grounded prompts (greedy): head, lookup, auto.

A quick, load-independent look (cycles and acceptance do not depend on machine speed);
speed comes from `mtplx bench --drafts head,lookup,auto --kinds grounded`."""

import json
import time

import mtplx  # noqa
from mtplx import bench
from mtplx.engine import Engine

engine = Engine.load(depth=1)
prompts = bench.load_prompts(kinds=["grounded"], per_kind=2)
bias = bench.ban_bias(engine.tokenizer)
rows = []
for temp in (0.0,):
    for p in prompts:
        for draft in ("head", "lookup", "auto"):
            t = time.perf_counter()
            r = engine.generate(
                p.engine_input,
                chat=p.is_chat,
                max_tokens=48,
                temperature=temp,
                top_p=0.95 if temp else 1.0,
                seed=1,
                draft=draft,
                logit_bias=bias,
            )
            s = r.stats
            rows.append(
                dict(
                    prompt=p.id,
                    kind=p.kind,
                    temp=temp,
                    draft=draft,
                    tokens=s.generated_tokens,
                    cycles=s.cycles,
                    tau=round(s.tokens_per_cycle, 3),
                    drafters=s.drafters,
                    decode_tps=round(s.decode_tokens_per_sec, 2),
                )
            )
            print(json.dumps(rows[-1]), flush=True)
json.dump(rows, open("benchmarks/results/drafters-grounded-cpu.json", "w"), indent=1)
