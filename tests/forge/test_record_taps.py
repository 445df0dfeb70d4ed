"""A row recorded through a trunk tap (`mtplx.forge.record`) sees its whole prompt, whatever the
engine's prompt cache holds."""

from __future__ import annotations

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.engine.scheduler import run_to_completion
from mtplx.forge.record import SHARD_FILES, ForgeData, generate_batch
from mtplx.sample.params import Setting

import mlx.core as mx
import numpy as np
from support.learn import VOCAB, tiny_trunk

SEQ = 32
EOS = VOCAB - 1


def _same(a: ForgeData, b: ForgeData) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in SHARD_FILES)


def test_a_tapped_row_never_starts_from_the_prompt_cache() -> None:
    """A prompt-cache hit would skip prompt positions the tap must see: the recorded rows came out
    shifted (hidden states off by up to 2.7 on this trunk) before a tapped row skipped the cache."""
    trunk = tiny_trunk()
    prompt = list(range(3, 15))
    fresh = generate_batch(
        Engine(trunk.model, None, {}), [prompt], Setting(0.0), mx.random.key(0), SEQ, 8, {EOS}
    )
    cached = Engine(trunk.model, None, {}, prompt_cache_bytes=1 << 24)
    request = GenerationRequest(max_tokens=2, detokenize=False, ignore_eos=True)
    run_to_completion(cached.batch(2, draft_policy="fixed"), [prompt + [1, 2]], [request])
    hit = cached.prompt_cache.lookup(prompt, False)
    assert hit is not None and hit.start > 0  # the store holds the prompt: a row could start from it
    assert _same(generate_batch(cached, [prompt], Setting(0.0), mx.random.key(0), SEQ, 8, {EOS}), fresh)
