"""Parallel requests over one long conversation: does the server forward the shared prefix once?

An agent's parallel tool calls, or several questions about one document, arrive together and
share everything but their last message. Each round here sends ``--clients`` chat requests at
once with the same long system prompt (new every round, so no earlier round's cache helps) and
different short questions, ``--max-tokens`` each, and times the round. Servers, one at a time
(`serve_concurrency.py`'s helpers; the stock server gets OpenBLAS by LD_PRELOAD):

- ``mtplx``: `mtplx serve` as shipped (a prompt's caches enter the prompt cache when its request
  is admitted, and a request looks again right before its prefill starts,
  `BatchScheduler._reuse_prefix`);
- ``mtplx-no-cache``: `mtplx serve --prompt-cache-bytes 0` (no prefix reuse of any kind);
- ``stock``: `mlx_lm.server` with the concurrency benchmark's flags.

    python benchmarks/shared_prefix.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mtplx
from mtplx.bench.report import provenance, write_json
from mtplx.checkpoints.load import resolve_model

from serve_concurrency import ServerSpec, client_for, server_specs, serving, stock_default_args, warm_up

ROOT = Path(__file__).resolve().parents[1]


def system_prompt(round_id: str, rules: int) -> str:
    """A long system prompt, distinct from its first token on (so rounds never share a prefix)."""
    rules_text = " ".join(
        f"Rule {i}: answer briefly and cite the rule number when relevant." for i in range(rules)
    )
    return f"[conversation {round_id}] You are a careful assistant. {rules_text}"


def one_round(server, round_id: str, clients: int, rules: int, max_tokens: int) -> dict:
    client = client_for(server)
    system = system_prompt(round_id, rules)

    def ask(i: int) -> tuple[int, int]:
        response = client.chat.completions.create(
            model=server.model_id,
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {i}: name a colour."},
            ],
            max_tokens=max_tokens,
            temperature=0,
        )
        details = response.usage.prompt_tokens_details
        return response.usage.prompt_tokens, (details.cached_tokens if details else 0) or 0

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        usage = list(pool.map(ask, range(clients)))
    return {
        "wall_s": time.perf_counter() - started,
        "prompt_tokens": [p for p, _ in usage],
        "cached_tokens": [c for _, c in usage],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rules", type=int, default=40, help="system prompt length, in rules (40: ~600 tokens)"
    )
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "shared-prefix.json")
    args = parser.parse_args()
    model_path = resolve_model(None)
    specs = server_specs(model_path, mtplx.BLAS.path, [], stock_default_args())
    shipped = specs["mtplx"]
    variants = {
        "mtplx": shipped,
        "mtplx-no-cache": ServerSpec(
            "mtplx-no-cache", (*shipped.argv, "--prompt-cache-bytes", "0"), shipped.env, None
        ),
        "stock": specs["stock"],
    }
    runs: dict[str, list[dict]] = {}
    for name, spec in variants.items():
        with serving(spec) as server:
            warm_up(server)
            runs[name] = []
            for r in range(args.rounds):
                result = one_round(server, f"{name}-{r}", args.clients, args.rules, args.max_tokens)
                runs[name].append(result)
                print(
                    f"{name:>15} round {r}: {result['wall_s']:5.2f} s, prompt tokens {result['prompt_tokens']}, "
                    f"cached {result['cached_tokens']}",
                    flush=True,
                )
    summary = {name: statistics.median(r["wall_s"] for r in rounds) for name, rounds in runs.items()}
    for name, seconds in summary.items():
        print(f"{name:>15}: median {seconds:.2f} s per round of {args.clients} requests")
    write_json(args.out, {**provenance(vars(args)), "median_wall_s": summary, "runs": runs})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
