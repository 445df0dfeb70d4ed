"""The batched draft policy against plain batched AR, in process, at a steady number of rows.

The server's aggregate figure (`benchmarks/serve_concurrency.py`) mixes prefill, admission and
HTTP into the decode it measures; this script isolates the one decision the draft policy makes.
R suite prompts (chat turns as the concurrency benchmark sends them) are submitted to one
`Engine.batch()`; once all R rows are decoding, every cycle until the first row finishes is
timed, and the figure is committed tokens / those cycles' seconds. Variants (interleaved, the
order reversed every repetition, medians quoted):

- ``ar``: batched AR (every request ``draft="none"``), the floor the policy must not fall below;
- ``auto``: the server's default (``--draft-policy auto``, drafter auto: lookup or the head);
- ``head1``: every row drafts one head token every cycle (``--draft-policy fixed``, depth 1).

EOS is banned (a logit bias) so every row decodes ``--tokens``; greedy rows therefore write the
same text in every variant, and the ratios compare the decoding, not the text.

    python benchmarks/batch_policy.py --rows 4,16 --repetitions 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mtplx.bench.report import provenance, write_json
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import Drafting

from serve_concurrency import chat_messages  # the same chat turns as the server benchmark

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "ar": ("fixed", Drafting(kind="none")),
    "auto": ("auto", Drafting()),
    "head1": ("fixed", Drafting(kind="head", depth=1)),
}


def steady_run(engine: Engine, prompts: list, request: GenerationRequest, policy: str) -> dict:
    """Decode every prompt in one batch; time the cycles that ran with every row in."""
    scheduler = engine.batch(max_rows=len(prompts), draft_policy=policy)
    handles = {scheduler.submit(p, request): i for i, p in enumerate(prompts)}
    seconds, tokens, cycles = 0.0, 0, 0
    full = False
    try:
        while not scheduler.idle:
            full = scheduler.num_decoding == len(prompts) and scheduler.num_waiting == 0
            started = time.perf_counter()
            results = scheduler.step()
            elapsed = time.perf_counter() - started
            for result in results:
                if result.error is not None:
                    raise result.error
            if not full:
                continue
            if any(result.done for result in results):
                break  # from here fewer rows decode: the steady state is over
            seconds += elapsed
            tokens += sum(len(result.chunk.token_ids) for result in results if result.handle in handles)
            cycles += 1
        calibration = dict(scheduler.policy.calibration) if scheduler.policy is not None else {}
    finally:
        scheduler.close()
    return {
        "seconds": seconds,
        "tokens": tokens,
        "cycles": cycles,
        "tok_s": tokens / seconds if seconds else None,
        "tokens_per_row_cycle": tokens / (cycles * len(prompts)) if cycles else None,
        "calibration": {f"{bucket},{k}": ratio for (bucket, k), ratio in sorted(calibration.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="4,16", help="row counts, comma-separated (default 4,16)")
    parser.add_argument("--variants", default="ar,auto,head1", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--tokens", type=int, default=96, help="tokens per request (default 96)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch-policy.json")
    args = parser.parse_args()
    variants = args.variants.split(",")
    engine = Engine.load()
    engine.batch_cost_profile()  # measured once, outside every timed run
    eos = engine.tokenizer.eos_token_id
    sampler = SamplerConfig(temperature=args.temperature, logit_bias={eos: -1e4})
    suite = load_prompts()
    runs: list[dict] = []
    for rows in (int(r) for r in args.rows.split(",")):
        for repetition in range(args.repetitions):
            order = variants if repetition % 2 == 0 else variants[::-1]
            for name in order:
                policy, drafting = VARIANTS[name]
                prompts = [
                    chat_messages(suite[(repetition * rows + i) % len(suite)], f"{repetition}.{rows}.{i}")
                    for i in range(rows)
                ]
                request = GenerationRequest(sampler=sampler, max_tokens=args.tokens, drafting=drafting)
                result = steady_run(engine, prompts, request, policy)
                runs.append({"rows": rows, "repetition": repetition, "variant": name, **result})
                print(
                    f"rows {rows:>2} rep {repetition} {name:>5}: {result['tok_s'] or 0:6.1f} tok/s, "
                    f"{result['tokens_per_row_cycle'] or 0:.2f} tok/row/cycle over {result['cycles']} cycles",
                    flush=True,
                )
    summary: dict = {}
    for rows in sorted({r["rows"] for r in runs}):
        cell = {
            name: statistics.median(r["tok_s"] for r in runs if r["rows"] == rows and r["variant"] == name)
            for name in variants
        }
        summary[rows] = {**cell, **{f"{n}/ar": cell[n] / cell["ar"] for n in variants if "ar" in cell}}
        print(f"rows {rows}: " + ", ".join(f"{k} {v:.2f}" for k, v in summary[rows].items()))
    write_json(args.out, {**provenance(vars(args)), "summary": summary, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
