"""Images in the prompt on the tiny Qwen3.5 vision-language replica (tests/support/vision.py):
time to first token of an image turn with and without the prompt cache, and decode speed after
an image with MTP vs AR, and the head's acceptance after an image against the same text without
one (recorded, not asserted; the replica's head agrees with its trunk by ``--context-strength``).

- TTFT cold: a new conversation about a new image (tower + prefill of every prompt token);
- TTFT cached: the second turn about the same image (the first turn's snapshot is reused: only
  the new tokens are forwarded, the image is not read again);
- decode: ``--max-tokens`` greedy tokens after the image, MTP (the checkpoint's head, depth
  ``--depth``) and AR, tokens/s of the decode phase and the head's acceptance.

    python benchmarks/vision.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.bench.report import provenance, write_json
from mtplx.engine import Engine
from mtplx.trunk.prompt_cache import PromptCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.vision import made_up_image, write_vlm  # noqa: E402


def turn(image: bytes, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


def ttft(engine: Engine, repeats: int, width: int, height: int) -> dict:
    cold, cached = [], []
    for r in range(repeats):
        engine.prompt_cache = PromptCache(256 * 1024**2)
        image = made_up_image(width, height, seed=100 + r)  # new every round: no earlier tower features
        first = engine.generate(turn(image, "fgh"), max_tokens=4)
        cold.append(first.stats.ttft_seconds)
        follow = [
            *turn(image, "fgh"),
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": "ijk"},
        ]
        second = engine.generate(follow, max_tokens=4)
        assert second.stats.cached_tokens > 0, "the second turn did not reuse the first"
        cached.append(second.stats.ttft_seconds)
    return {
        "cold_s": statistics.median(cold),
        "cached_s": statistics.median(cached),
        "cold": cold,
        "cached": cached,
    }


def decode(engine: Engine, repeats: int, max_tokens: int, width: int, height: int) -> dict:
    """Decode speed and head acceptance after an image, and after the same text without one."""
    out = {}
    for prompt_kind in ("image", "text"):
        for draft in ("none", "head"):
            speeds, drafted, accepted = [], 0, 0
            for r in range(repeats):
                image = made_up_image(width, height, seed=r)
                prompt = (
                    turn(image, "fgh") if prompt_kind == "image" else [{"role": "user", "content": f"fgh{r}"}]
                )
                result = engine.generate(prompt, max_tokens=max_tokens, draft=draft)
                speeds.append(result.stats.decode_tokens_per_sec)
                head = result.stats.drafters.get("head", {})
                drafted, accepted = drafted + head.get("drafted", 0), accepted + head.get("accepted", 0)
            out[f"{prompt_kind}/{'mtp' if draft == 'head' else 'ar'}"] = {
                "decode_tokens_per_sec": statistics.median(speeds),
                "acceptance": accepted / drafted if drafted else None,
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--height", type=int, default=48)
    parser.add_argument(
        "--context-strength",
        type=float,
        default=0.5,
        help="the replica's head agreement (support.vision.write_vlm)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "vision.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-vlm"
        write_vlm(path, seed=3, context_strength=args.context_strength)
        engine = Engine.load(str(path), mtp=True, depth=args.depth)
        engine.generate(turn(made_up_image(16, 16), "fgh"), max_tokens=2)  # warm-up
        times = ttft(engine, args.repeats, args.width, args.height)
        engine.prompt_cache = PromptCache(0)
        speeds = decode(engine, args.repeats, args.max_tokens, args.width, args.height)
    print(
        f"TTFT of an image turn: cold {times['cold_s'] * 1e3:.1f} ms, second turn (prompt cache) {times['cached_s'] * 1e3:.1f} ms"
    )
    for name, row in speeds.items():
        acc = "" if row["acceptance"] is None else f", acceptance {row['acceptance']:.2f}"
        print(f"decode, {name}: {row['decode_tokens_per_sec']:.1f} tok/s{acc}")
    write_json(args.out, {**provenance(vars(args)), "ttft": times, "decode": speeds})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
