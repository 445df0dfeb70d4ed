"""ms per `verify.verify` call on the current backend, per vocabulary size, depth and filter.

    .venv/bin/python benchmarks/verify_overhead.py [--repeats 15] [--flat]

Batch 1, stochastic drafting (full q), fresh uniforms per call. Logits are
"peaked" by default: 20 tokens hold about 98% of the mass, as in typical LLM
decoding. `--flat` uses N(0, 2^2) logits instead, the worst case for top-p
(the nucleus has tens of thousands of tokens and the threshold search falls
back to bisection). Prints a markdown table; ratios are against temperature-only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.sample.ops import draw_uniforms, filtered_probs
from mtplx.sample.rejection import verify
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import numpy as np

SETTINGS = {
    "temperature 1.0": SamplerConfig(temperature=1.0),
    "top-k 20": SamplerConfig(top_k=20),
    "top-p 0.95": SamplerConfig(top_p=0.95),
    "top-k 20 + top-p 0.95": SamplerConfig(top_k=20, top_p=0.95),
}


def make_logits(rng: np.random.Generator, shape: tuple[int, ...], flat: bool) -> np.ndarray:
    logits = rng.normal(scale=2.0 if flat else 1.5, size=shape).astype(np.float32)
    if not flat:
        vocab_size = shape[-1]
        for index in np.ndindex(*shape[:-1]):
            favourites = rng.choice(vocab_size, size=20, replace=False)
            logits[index + (favourites,)] += rng.uniform(12.0, 16.0, size=20).astype(np.float32)
    return logits


def time_verify(vocab_size: int, depth: int, cfg: SamplerConfig, repeats: int, flat: bool) -> float:
    rng = np.random.default_rng(1234 + depth)
    target_logits = mx.array(make_logits(rng, (1, depth + 1, vocab_size), flat))
    draft_probs = filtered_probs(mx.array(make_logits(rng, (1, depth, vocab_size), flat)), SamplerConfig())
    draft_tokens = mx.argmax(draft_probs, axis=-1).astype(mx.int32)
    mx.eval(target_logits, draft_probs, draft_tokens)
    timings = []
    for repeat in range(repeats + 2):
        accept_u, sample_u = draw_uniforms((1, depth)), draw_uniforms((1,))
        mx.eval(accept_u, sample_u)
        start = time.perf_counter()
        mx.eval(*verify(target_logits, draft_tokens, draft_probs, cfg, accept_u, sample_u))
        if repeat >= 2:  # two warm-up calls
            timings.append(time.perf_counter() - start)
    return statistics.median(timings) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--flat", action="store_true", help="flat N(0, 4) logits instead of peaked ones")
    parser.add_argument("--vocab", type=int, nargs="*", default=[49152, 151936])
    args = parser.parse_args()
    print(
        f"backend: MLX {mx.__version__} on {mx.default_device()}, BLAS: {mtplx.BLAS.path}, "
        f"logits: {'flat' if args.flat else 'peaked'}, median of {args.repeats}\n"
    )
    names = list(SETTINGS)
    print("| V | k | " + " | ".join(f"{name} (ms)" for name in names) + " | top-p / temp |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for vocab_size in args.vocab:
        for depth in range(1, 5):
            ms = [time_verify(vocab_size, depth, SETTINGS[name], args.repeats, args.flat) for name in names]
            cells = " | ".join(f"{value:.2f}" for value in ms)
            print(f"| {vocab_size} | {depth} | {cells} | {ms[2] / ms[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
