"""Host syncs per MTP cycle for each sampler setting (tests/support/sync_counter.py), on a tiny real llama
with a 49,152-token vocabulary (the default model's), depth 3:

    PYTHONPATH=. .venv/bin/python benchmarks/count_syncs.py

Prints a markdown table; the "top-p, GPU policy" row queues the top-p fallbacks as on a GPU.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import mtplx  # noqa: F401, I001  (BLAS before mlx)
import mlx.core as mx
from support.decoding import mtp_decode
from support.models import make_loop_pair
from support.sync_counter import counting_syncs

from mtplx.spec_decode import settings as decode
from mtplx.sample import filters as sample_filters
from mtplx.sample.params import SamplerConfig

PROMPT = [1, 2, 0, 2, 1, 0, 2]
CYCLES = 10
CASES = {
    "greedy": SamplerConfig(temperature=0.0),
    "t 0.7": SamplerConfig(temperature=0.7),
    "t 0.7, top-p 0.95 (CPU policy)": SamplerConfig(temperature=0.7, top_p=0.95),
    "t 0.7, top-p 0.95 (GPU policy)": SamplerConfig(temperature=0.7, top_p=0.95),
    "t 0.7, top-k 40": SamplerConfig(temperature=0.7, top_k=40),
    "t 0.7, min-p 0.05": SamplerConfig(temperature=0.7, min_p=0.05),
    "t 0.7, repetition penalty 1.1 + logit bias": SamplerConfig(
        temperature=0.7, repetition_penalty=1.1, logit_bias={5: -1.0}
    ),
}


def main() -> None:
    trunk, head = make_loop_pair(vocab_size=49152, seed=3, logit_scale=20.0)
    cpu_policy = sample_filters._queue_top_p_fallbacks
    print("| sampler setting | host syncs per cycle (depth 3) |\n|---|---|")
    for name, cfg in CASES.items():
        sample_filters._queue_top_p_fallbacks = (lambda: True) if "GPU policy" in name else cpu_policy
        steps = mtp_decode(trunk, head, PROMPT, decode.DecodeSettings(sampler=cfg, depth=3), mx.random.key(0))
        next(steps)  # prefill and the first token are not a cycle
        with counting_syncs() as counter:
            for _ in range(CYCLES):
                next(steps)
        steps.close()
        print(f"| {name} | {counter.syncs / CYCLES:.1f} |")
    sample_filters._queue_top_p_fallbacks = cpu_policy


if __name__ == "__main__":
    main()
