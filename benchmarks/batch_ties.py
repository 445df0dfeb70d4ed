"""How often a greedy row in a batch differs from the same request alone (the rounding-tie rate).

With OpenBLAS a row's float32 matmul can change in its last bits when more rows share the call,
so a greedy row in a batch may take the other branch where the alone run's two best candidates
are within 1e-4 relative (the rule of `tests/support/decoding.py`, imported from there so the
benchmark and the tests judge alike). The tests allow at most one tie per run; this script
measures the rate: every suite prompt (chat turns) alone and then all in one batch, greedy, EOS
banned, and per row whether the tokens are identical, first differ at a rounding tie, or first
differ anywhere else (a defect: the tests fail on it).

    python benchmarks/batch_ties.py --tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtplx.bench.report import provenance, write_json
from mtplx.bench.suite import load_prompts
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import Drafting

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.decoding import first_divergence, same_or_tie  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    parser.add_argument("--draft", default="auto", help="drafter of every request (default auto)")
    parser.add_argument("--draft-policy", default="auto", help="the batch's draft policy (default auto)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch-ties.json")
    args = parser.parse_args()
    engine = Engine.load()
    sampler = SamplerConfig(temperature=0.0, logit_bias={engine.tokenizer.eos_token_id: -1e4})
    request = GenerationRequest(
        sampler=sampler, max_tokens=args.tokens, logprobs=2, drafting=Drafting(kind=args.draft)
    )
    prompts = [p.engine_input for p in load_prompts()]
    alone = [engine.generate(p, request) for p in prompts]
    top2 = [[(t.top[0][1], t.top[1][1]) for t in a.logprobs] for a in alone]
    batched = engine.generate_batch(prompts, request, draft_policy=args.draft_policy)
    rows = []
    for a, t, b in zip(alone, top2, batched):
        ok, tied = same_or_tie(a.token_ids, t, b.token_ids)
        rows.append(
            {
                "identical": ok and not tied,
                "tie": tied,
                "defect": not ok,
                "at": first_divergence(a.token_ids, b.token_ids),
            }
        )
    compared = sum(len(a.token_ids) if r["at"] is None else r["at"] + 1 for a, r in zip(alone, rows))
    summary = {
        "rows": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "ties": sum(r["tie"] for r in rows),
        "defects": sum(r["defect"] for r in rows),
        "tokens_compared": compared,
        "ties_per_1000_tokens": 1000 * sum(r["tie"] for r in rows) / compared,
    }
    print(json.dumps(summary))
    write_json(args.out, {**provenance(vars(args)), "summary": summary, "rows": rows})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
