"""Tokens per cycle and decode tok/s per block drafter (DFlash, DFlash2, DSpark, EAGLE-3) against
plain AR and the MTP head, on the default model, greedy, interleaved repeats, medians.

No DFlash / DSpark checkpoint exists for the default model (SmolLM2) and none can be downloaded
here, so each drafter is a random-weight replica in its published layout, sized to the default
model (`tests/support/drafters.py`): it agrees with the target by chance only, so its tokens per
cycle stay near 1 and what this measures is the cost of drafting with it (one block forward per
cycle, or EAGLE-3's context forward and chain; a verify block of P + 1 positions) against plain
AR, not the speedup a trained drafter brings. Run from the repository root:
``python benchmarks/block_drafters.py [--reps 3] [--kinds eagle3] [--out FILE]`` ->
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
from mtplx.drafters.discovery import BlockCandidate, load_block_drafter  # noqa: E402
from mtplx.engine.engine import Engine  # noqa: E402
from mtplx.io import atomic_write  # noqa: E402
from mtplx.spec_decode.block_proposer import BlockDrafter  # noqa: E402
from mtplx.spec_decode.sources import Source  # noqa: E402

from support import drafters  # noqa: E402

OUT = ROOT / "benchmarks/results/block-drafters-cpu.json"
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


def run(engine: Engine, draft: str, prompt: str, tokens: int) -> dict:
    bias = ban_bias(engine.tokenizer)  # EOS banned: every run decodes ``tokens``
    stats = engine.generate(prompt, max_tokens=tokens, temperature=0.0, draft=draft, logit_bias=bias).stats
    return {
        "tau": stats.tokens_per_cycle,
        "tps": stats.decode_tokens_per_sec,
        "drafters": stats.drafters,
        "tokens": stats.generated_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--kinds", default=",".join(k.value for k in KINDS), help="block drafters to run")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    kinds = [Source(k) for k in args.kinds.split(",") if k]
    engine = Engine.load()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {kind: replica(engine, kind, Path(tmp)) for kind in kinds}
        cases = [("none", None), ("head", None)] + [(k.value, loaded[k]) for k in kinds]
        results: dict[str, list[dict]] = {name: [] for name, _ in cases}
        for _ in range(args.reps):  # interleaved: each repeat runs every case once
            for prompt in PROMPTS:
                for name, block in cases:
                    engine.block_drafter = block
                    results[name].append(run(engine, name, prompt, args.tokens))
        for name, runs in results.items():
            row = {
                "draft": name,
                "tau_median": round(statistics.median(r["tau"] for r in runs), 3),
                "tps_median": round(statistics.median(r["tps"] for r in runs), 2),
                "drafters": runs[-1]["drafters"],
                "runs": len(runs),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    with atomic_write(args.out) as handle:
        handle.write(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
