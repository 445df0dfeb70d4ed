"""Tokens per cycle and decode tok/s per block drafter (DFlash, DFlash2, DSpark, EAGLE-3) against
plain AR and the MTP head, on the default model, greedy, interleaved repeats, medians.

No DFlash / DSpark checkpoint exists for the default model (SmolLM2) and none can be downloaded
here, so each drafter is a random-weight replica in its published layout, sized to the default
model (`tests/support/drafters.py`): it agrees with the target by chance only, so its tokens per
cycle stay near 1 and what this measures is the cost of drafting with it (one block forward per
cycle, or EAGLE-3's context forward and chain; a verify block of P + 1 positions) against plain
AR, not the speedup a trained drafter brings. ``--eagle3 DIR`` runs a trained EAGLE-3 drafter
instead of its replica (`mtplx forge --drafter eagle3`), ``--temperatures 0,0.7`` sampled runs too
(seeded by repeat), ``--suite-per-kind N`` the held-out suite's prompts. Each row: medians of tokens
per cycle and decode tok/s, the first draft's acceptance pooled over cycles, drafted / accepted.
Run from the repository root: ``python benchmarks/block_drafters.py [--reps 3] [--kinds eagle3]
[--eagle3 DIR] [--temperatures 0,0.7] [--suite-per-kind 1] [--out FILE]`` ->
benchmarks/results/block-drafters-cpu.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import mtplx  # noqa: E402, F401  (BLAS before mlx)
from mtplx.bench.runners import ban_bias  # noqa: E402
from mtplx.drafters.discovery import BlockCandidate, find_block_drafter, load_block_drafter  # noqa: E402
from mtplx.engine.engine import Engine  # noqa: E402
from mtplx.io import atomic_write  # noqa: E402
from mtplx.spec_decode.block_proposer import BlockDrafter  # noqa: E402
from mtplx.spec_decode.sources import Source  # noqa: E402

from support import drafters  # noqa: E402

OUT = ROOT / "benchmarks/results/block-drafters-cpu.json"
SUITE = ROOT / "benchmarks/prompts/suite.jsonl"
PROMPTS = ("Write a short story about a lighthouse keeper.", "Explain how a hash map works.")
KINDS = (Source.DFLASH, Source.DFLASH2, Source.DSPARK, Source.EAGLE3)


def replica(engine: Engine, kind: Source, root: Path) -> BlockDrafter:
    """A random-weight ``kind`` drafter sized to the engine's model, written and loaded as published."""
    text = engine.config.get("text_config", engine.config)
    hidden, layers, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    ids = [1, layers // 2, layers - 2]
    if kind is Source.EAGLE3:
        return eagle3_replica(hidden, layers, vocab, root)
    make = {
        Source.DFLASH: (drafters.dflash_config, drafters.dflash_tensors),
        Source.DFLASH2: (drafters.dflash2_config, drafters.dflash2_tensors),
        Source.DSPARK: (drafters.dspark_config, drafters.dspark_tensors),
    }[kind]
    config = make[0](vocab, ids, layers)
    config.update(hidden_size=hidden, intermediate_size=2 * hidden)  # the layouts' own block sizes
    path = drafters.write_dflash(root / kind.value, config, make[1](config, seed=1))
    loaded = load_block_drafter(BlockCandidate(path, kind.value, "replica", config, None))
    return BlockDrafter(loaded, kind)


def eagle3_replica(hidden: int, layers: int, vocab: int, root: Path) -> BlockDrafter:
    """A random-weight EAGLE-3 drafter in the speculators layout at the model's hidden size, its
    draft vocabulary a random 32k of the model's ids (Llama-3's EAGLE-3 drafters keep 32k of 128k),
    tapping hidden_states 2, n // 2 and n - 1."""
    draft = min(32000, vocab - 1)
    config = drafters.eagle3_config(vocab, draft, [2, layers // 2, layers - 1])
    config["transformer_layer_config"].update(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    )
    config["target_hidden_size"] = hidden
    path = drafters.write_eagle3(root / "eagle3", config, drafters.eagle3_tensors(config, seed=1))
    loaded = load_block_drafter(BlockCandidate(path, "eagle3", "replica", config, None))
    return BlockDrafter(loaded, Source.EAGLE3)


def suite_prompts(per_kind: int) -> list[tuple[str, object, bool]]:
    """(id, request, chat) of the first ``per_kind`` prompts of each kind of the held-out suite
    (forge never trains on it), in suite order."""
    taken: dict[str, int] = {}
    out = []
    for line in SUITE.read_text().splitlines():
        p = json.loads(line)
        taken[p["kind"]] = taken.get(p["kind"], 0) + 1
        if taken[p["kind"]] <= per_kind:
            chat = "messages" in p
            out.append((p["id"], p["messages"] if chat else p["prompt"], chat))
    return out


def run(engine: Engine, draft: str, prompt, chat: bool, tokens: int, temperature: float, seed: int) -> dict:
    bias = ban_bias(engine.tokenizer)  # EOS banned: every run decodes ``tokens``
    stats = engine.generate(
        prompt,
        max_tokens=tokens,
        temperature=temperature,
        seed=seed,
        draft=draft,
        logit_bias=bias,
        chat=chat,
    ).stats
    return {
        "tau": stats.tokens_per_cycle,
        "tps": stats.decode_tokens_per_sec,
        "drafters": stats.drafters,
        "tokens": stats.generated_tokens,
        "first": stats.acceptance_per_position[0] if stats.acceptance_per_position else None,
        "first_over": stats.drafted_per_position[0] if stats.drafted_per_position else 0,
    }


def summary(name: str, temperature: float, runs: list[dict]) -> dict:
    """Medians of tau and tok/s over the runs, the first draft's acceptance pooled over their
    cycles, and the drafted / accepted totals."""
    totals: dict[str, dict[str, int]] = {}
    for r in runs:
        for who, counts in r["drafters"].items():
            row = totals.setdefault(who, {"drafted": 0, "accepted": 0})
            for k in row:
                row[k] += counts.get(k, 0)
    cycles = sum(r["first_over"] for r in runs if r["first"] is not None)
    first = sum(r["first"] * r["first_over"] for r in runs if r["first"] is not None)
    return {
        "draft": name,
        "temperature": temperature,
        "tau_median": round(statistics.median(r["tau"] for r in runs), 3),
        "tps_median": round(statistics.median(r["tps"] for r in runs), 2),
        "first_draft_acceptance": round(first / cycles, 3) if cycles else None,
        "drafters": totals,
        "runs": len(runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--kinds", default=",".join(k.value for k in KINDS), help="block drafters to run")
    parser.add_argument(
        "--eagle3",
        type=Path,
        help="a trained EAGLE-3 drafter directory (mtplx forge --drafter eagle3), not a replica",
    )
    parser.add_argument(
        "--temperatures", default="0", help="comma-separated; sampled runs are seeded by repeat"
    )
    parser.add_argument(
        "--suite-per-kind",
        type=int,
        default=0,
        help="prompts per kind of the held-out suite (0: the two built-in)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    kinds = [Source(k) for k in args.kinds.split(",") if k]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    prompts = (
        suite_prompts(args.suite_per_kind)
        if args.suite_per_kind
        else [(f"builtin-{i}", p, False) for i, p in enumerate(PROMPTS)]
    )
    engine = Engine.load()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {
            kind: trained(engine, args.eagle3)
            if kind is Source.EAGLE3 and args.eagle3
            else replica(engine, kind, Path(tmp))
            for kind in kinds
        }
        cases = [("none", None), ("head", None)] + [(k.value, loaded[k]) for k in kinds]
        results = {(name, t): [] for name, _ in cases for t in temperatures}
        for rep in range(args.reps):  # interleaved: each repeat runs every case once
            for _, prompt, chat in prompts:
                for t in temperatures:
                    for name, block in cases:
                        engine.block_drafter = block
                        results[(name, t)].append(run(engine, name, prompt, chat, args.tokens, t, rep))
        for (name, t), runs in results.items():
            rows.append(summary(name, t, runs))
            print(json.dumps(rows[-1]), flush=True)
    record = {"eagle3": str(args.eagle3) if args.eagle3 else "replica", "prompts": [p[0] for p in prompts]}
    with atomic_write(args.out) as handle:
        handle.write(json.dumps({**record, "rows": rows}, indent=1) + "\n")


def trained(engine: Engine, path: Path) -> BlockDrafter:
    """A trained EAGLE-3 drafter, found and loaded as ``--head DIR`` finds it (its fit checked)."""
    found = find_block_drafter(Path(engine.model_path or "."), path, engine.config)
    if found is None or found.layout != "eagle3":
        raise SystemExit(f"{path}: not an EAGLE-3 drafter directory")
    return BlockDrafter(load_block_drafter(found), Source.EAGLE3)


if __name__ == "__main__":
    main()
