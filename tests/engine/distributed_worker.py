"""One rank of the 2-process tests in test_distributed.py (run under ``mlx.launch``, with
``tests/`` on ``PYTHONPATH`` for ``support``).

``python distributed_worker.py JOB SPEC.json OUT_DIR``: loads the tiny models the
test saved (same files on every rank), runs JOB sharded and writes what this rank
saw to ``OUT_DIR/rank{r}.json``. Jobs:

* ``decode``: for each (model, mode) in the spec: greedy AR, greedy MTP, seeded
  sampled MTP, the sharded trunk's logits over the prompt and the greedy MTP tokens
  (the test compares them with one process), and the cache comparison after a sampled
  run (random accept patterns) against a from-scratch forward of the committed tokens.
  Last, rank 1 loads ``spec["other_head"]`` instead of the head: both must refuse.
* ``die`` / ``hang``: rank 1 leaves (exits / sleeps) after two chunks of a generation.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode import settings as decode

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from support.decoding import cache_arrays, mtp_decode, sample_until_rollbacks

PROMPT_TEXT = "def add(a, b):\n    return a + b\n"


def _max_diff(got: list, want: list) -> float:
    worst = 0.0
    for a, b in zip(cache_arrays(got), cache_arrays(want), strict=True):
        if a.shape != b.shape:
            return float("inf")
        worst = max(worst, float(mx.max(mx.abs(a - b))))
    return worst


def cache_check(engine: Engine, depth: int) -> dict:
    """Sampled MTP until both full and partial accepts happened; then compare every cache."""
    trunk, head = engine.trunk, engine.head
    prompt = engine.encode_prompt(PROMPT_TEXT)
    trunk_cache, head_cache = trunk.make_cache(), head.make_cache()
    settings = decode.DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=depth)
    steps = mtp_decode(
        trunk, head, prompt, settings, mx.random.key(3), trunk_cache=trunk_cache, head_cache=head_cache
    )
    generated, patterns = sample_until_rollbacks(steps, 20)
    committed = prompt + generated[:-1]
    fresh = trunk.make_cache()
    reference = trunk(mx.array(committed)[None], fresh)
    head_len = head_cache[0].offset
    fresh_head = head.make_cache()
    head(reference.hidden_post_norm[:, :head_len], mx.array(committed[1 : head_len + 1])[None], fresh_head)
    # Control: a history that differs in its last token must show up in this rank's caches.
    other = committed[:-1] + [(committed[-1] + 1) % trunk.vocab_size]
    control = trunk.make_cache()
    trunk(mx.array(other)[None], control)
    return {
        "patterns": sorted(patterns),
        "local_layers": len(trunk_cache),
        "offsets": [c.offset for c in trunk_cache if hasattr(c, "offset") and not isinstance(c, ArraysCache)],
        "committed": len(committed),
        "trunk_diff": _max_diff(trunk_cache, fresh),
        "head_diff": _max_diff(head_cache, fresh_head),
        "control_diff": _max_diff(trunk_cache, control),
    }


def run_decode(spec: dict) -> dict:
    out = {}
    for job in spec["jobs"]:
        engine = Engine.load(
            job["model"], head=job["head"], depth=job["depth"], distributed=job["mode"], collective_timeout=60
        )
        greedy = dict(max_tokens=spec["max_tokens"], temperature=0.0)
        # EOS (id 0) banned so the sampled run is long enough to mean something.
        sampled = dict(
            max_tokens=spec["max_tokens"],
            temperature=0.9,
            top_p=0.95,
            seed=spec["seed"],
            logit_bias={0: -100.0},
        )
        mtp_greedy = engine.generate(PROMPT_TEXT, mtp=True, **greedy)
        forwarded = engine.encode_prompt(PROMPT_TEXT) + mtp_greedy.token_ids
        logits = engine.trunk(mx.array(forwarded)[None]).logits[0].astype(mx.float32)
        out[f"{job['name']}/{job['mode']}"] = {
            "logits": logits.tolist(),  # [prompt + generated, vocab]: the sharded trunk's own
            "ar_greedy": engine.generate(PROMPT_TEXT, mtp=False, **greedy).token_ids,
            "mtp_greedy": mtp_greedy.token_ids,
            "mtp_sampled": engine.generate(PROMPT_TEXT, mtp=True, **sampled).token_ids,
            "stats": mtp_greedy.stats.distributed,
            "acceptance": mtp_greedy.stats.acceptance_per_position,
            "caches": cache_check(engine, job["depth"]),
        }
    # Last: rank 1 loads another head; every rank must refuse (and stay usable: no rank hangs).
    job = spec["jobs"][0]
    head = spec["other_head"] if mx.distributed.init().rank() == 1 else job["head"]
    try:
        Engine.load(
            job["model"], head=head, depth=job["depth"], distributed="pipeline", collective_timeout=60
        )
        out["mismatch_error"] = None
    except MtplxError as e:
        out["mismatch_error"] = str(e)
    return out


def run_failure(kind: str, spec: dict, rank: int) -> dict:
    job = spec["jobs"][0]
    head = spec["other_head"] if kind == "mismatch" and rank == 1 else job["head"]
    engine = Engine.load(
        job["model"],
        head=head,
        depth=job["depth"],
        distributed="pipeline",
        collective_timeout=spec["timeout"],
    )
    chunks = 0
    for _ in engine.stream(PROMPT_TEXT, max_tokens=200, temperature=0.0):
        chunks += 1
        if rank == 1 and chunks == 2:
            if kind == "die":
                os._exit(0)  # leaves without an error: mlx.launch does not stop the others
            time.sleep(120)  # "hang": alive, sockets open, never answers
    return {"chunks": chunks}


def main() -> int:
    kind, spec_path, out_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    rank = mx.distributed.init().rank()
    try:
        result = run_decode(spec) if kind == "decode" else run_failure(kind, spec, rank)
    except MtplxError as e:
        print(f"mtplx: error: {e}", file=sys.stderr, flush=True)
        return 2
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
