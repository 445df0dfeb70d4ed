"""JSON-schema requests on a busy batch: 4 grammar rows decoding beside 3 plain rows, in process.

The case agents hit (issue 40): constrained requests arrive while other requests decode. Before
grammar rows speculated in the batch they decoded there as constrained AR (1.00 tokens per cycle).
This replays that on one `Engine.batch()` at `mtplx serve`'s defaults, no HTTP: 3 plain chat
requests (long, so the batch stays busy) and 4 JSON-schema requests submitted together; the figures
are the JSON rows' own (from each request's `GenerationStats`):
tokens per cycle, the part of it that grammar-forced drafts gave, head / lookup drafts kept,
host reads of drafts per cycle, llguidance milliseconds per cycle, and decode tok/s; plus the
round's wall seconds and its aggregate tok/s.

Two variants, interleaved per repetition (order alternating): "speculate" (the JSON requests draft
as the engine chooses: forced tokens, masked head drafts, lookup) and "constrained-ar" (the same
requests with draft "none": what the batch did before). Default model + shipped head.

    python benchmarks/grammar_batch.py [--repetitions 2] [--temperatures 0,0.7] [--max-tokens 96]

-> benchmarks/results/grammar-batch.json (every round, and the medians).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
import time

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.grammar_spec import Grammar
from mtplx.engine.request import GenerationRequest
from mtplx.io import atomic_write

from grammar_speed import SCHEMA  # the same JSON schema as the single-stream grammar benchmark

OUT = "benchmarks/results/grammar-batch.json"
JSON_PROMPTS = [
    "Describe a fictional person as JSON with name, age, city and hobbies.",
    "Give me a JSON record for a retired teacher who lives by the sea.",
    "Invent a character for a novel and return it as JSON (name, age, city, hobbies).",
    "Return a JSON profile of a young chef from Lyon.",
]
PLAIN_PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain in detail how a compiler turns source code into machine code.",
    "Describe the water cycle step by step for a school class.",
]


def one_round(engine: Engine, temperature: float, draft: str, max_tokens: int, seed: int) -> dict:
    """Submit the 3 plain and 4 JSON requests together; step until all end; the JSON rows' figures."""
    scheduler = engine.batch()  # mtplx serve's defaults
    json_request = GenerationRequest.from_kwargs(
        max_tokens=max_tokens, temperature=temperature, grammar=Grammar.json_schema(SCHEMA), chat=True
    )
    json_request = dataclasses.replace(
        json_request, drafting=dataclasses.replace(json_request.drafting, kind=draft)
    )
    plain_request = GenerationRequest.from_kwargs(
        max_tokens=3 * max_tokens, temperature=temperature, chat=True
    )
    handles = {}
    for i, prompt in enumerate(PLAIN_PROMPTS):
        handles[scheduler.submit([{"role": "user", "content": f"[{seed}.{i}] {prompt}"}], plain_request)] = (
            "plain"
        )
    for i, prompt in enumerate(JSON_PROMPTS):
        messages = [{"role": "user", "content": f"[{seed}.{i}] {prompt}"}]
        handles[scheduler.submit(messages, json_request)] = "json"
    last, tokens = {}, {"plain": 0, "json": 0}
    started = time.perf_counter()
    json_done_at = None
    while not scheduler.idle:
        for result in scheduler.step():
            if result.error is not None:
                raise result.error
            last[result.handle] = result.chunk
            tokens[handles[result.handle]] += len(result.chunk.token_ids)
        if json_done_at is None and all(
            last.get(h) is not None and last[h].finish_reason for h, kind in handles.items() if kind == "json"
        ):
            json_done_at = time.perf_counter() - started
    stats = [last[h].stats for h, kind in handles.items() if kind == "json"]
    cycles = sum(s.cycles for s in stats)
    forced = sum(s.drafters.get("grammar", {}).get("accepted", 0) for s in stats)
    model = {
        k: sum(s.drafters.get(k, {}).get(m, 0) for s in stats)
        for k in ("head", "lookup")
        for m in ["accepted"]
    }
    return dict(
        temperature=temperature,
        variant="speculate" if draft == "auto" else "constrained-ar",
        json_tokens_per_cycle=round(sum(s.generated_tokens - 1 for s in stats) / max(cycles, 1), 3),
        json_forced_per_cycle=round(forced / max(cycles, 1), 3),
        json_model_drafts_kept_per_cycle=round(sum(model.values()) / max(cycles, 1), 3),
        json_reads_per_cycle=round(sum(s.grammar_reads for s in stats) / max(cycles, 1), 3),
        json_mask_ms_per_cycle=round(1000 * sum(s.grammar_mask_seconds for s in stats) / max(cycles, 1), 2),
        json_decode_tps=round(statistics.median(s.decode_tokens_per_sec for s in stats), 2),
        json_finished_stop=sum(last[h].finish_reason == "stop" for h, k in handles.items() if k == "json"),
        json_round_seconds=round(json_done_at, 2),
        round_seconds=round(time.perf_counter() - started, 2),
        aggregate_tps=round((tokens["plain"] + tokens["json"]) / (time.perf_counter() - started), 2),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--temperatures", default="0,0.7")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    engine = Engine.load()
    engine.generate("warm up", max_tokens=4, grammar=Grammar.json_schema(SCHEMA))  # llguidance tokenizer
    engine.batch_cost_profile()  # measured once, outside the rounds
    rounds = []
    for rep in range(args.repetitions):
        for temperature in (float(t) for t in args.temperatures.split(",")):
            order = ("auto", "none") if rep % 2 == 0 else ("none", "auto")
            for draft in order:
                row = dict(repetition=rep, **one_round(engine, temperature, draft, args.max_tokens, rep))
                rounds.append(row)
                print(json.dumps(row), flush=True)
    summary = []
    keys = [k for k in rounds[0] if k.startswith("json_") or k in ("round_seconds", "aggregate_tps")]
    for temperature in sorted({r["temperature"] for r in rounds}):
        for variant in ("speculate", "constrained-ar"):
            cell = [r for r in rounds if r["temperature"] == temperature and r["variant"] == variant]
            summary.append(
                dict(
                    temperature=temperature,
                    variant=variant,
                    **{k: statistics.median(r[k] for r in cell) for k in keys},
                )
            )
            print(json.dumps(summary[-1]), flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = dict(
        machine=f"{platform.machine()} {platform.processor() or ''} ({platform.node()})".strip(),
        commit=commit,
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        args=vars(args),
        summary=summary,
        rounds=rounds,
    )
    with atomic_write(OUT) as handle:
        handle.write(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
