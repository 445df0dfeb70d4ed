"""The decode hot path: the lazy validity flags are read in the cycle's one sync (and do catch bad
values), every sample and verify honours `verify_backend`, and penalties draft without syncing."""

from __future__ import annotations

import math

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sample import filters as sample_filters
from mtplx.sample import ops as sample_ops
from mtplx.sample import rejection
from mtplx.sample.params import SamplerConfig

import pytest
from support import decoding as decode
from support.decoding import mtp_decode, take_tokens
from support.models import make_loop_pair

PROMPT = [1, 2, 0, 2, 1, 0, 2]


def _first_tokens(trunk, head, settings: decode.DecodeSettings, n: int, depth: int | None = 2) -> list[int]:
    import mlx.core as mx

    if depth is None:
        steps = decode.ar_decode(trunk, PROMPT, settings, mx.random.key(0))
    else:
        steps = mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0))
    return take_tokens(steps, n)


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_nan_in_a_draft_step_is_caught_by_the_cycle_check(greedy_draft: bool) -> None:
    """Draft logits turn NaN at step 1: the flag folded into the cycle's sync raises, and the
    trunk cache is left as before the block (the engine keeps working)."""
    trunk, head = make_loop_pair(vocab_size=6, seed=3)
    honest_logits = head.logits

    def poisoned_logits(head_hidden, step=0):
        logits = honest_logits(head_hidden, step)
        return logits * math.nan if step == 1 else logits

    head.logits = poisoned_logits
    cfg = SamplerConfig(temperature=1.0)
    settings = decode.DecodeSettings(sampler=cfg, depth=2, greedy_draft=greedy_draft)
    if greedy_draft:
        # Greedy drafting takes the argmax without sampling (no flag), and verify only sees the
        # draft token, which is in range: the cycle runs on (negative control for the flag).
        assert len(_first_tokens(trunk, head, settings, 6)) == 6
        return
    with pytest.raises(ValueError, match="NaN"):
        _first_tokens(trunk, head, settings, 6)


def test_nan_in_the_trunk_is_caught_by_the_cycle_check() -> None:
    trunk, head = make_loop_pair(vocab_size=6, seed=3)
    calls = {"n": 0}
    honest_call = type(trunk).__call__

    class PoisonedTrunk(type(trunk)):
        def __call__(self, tokens, cache=None):
            out = honest_call(self, tokens, cache)
            calls["n"] += 1
            if tokens.shape[1] > 1 and calls["n"] > 2:  # a verify block after the prompt
                out.logits = out.logits * math.nan
            return out

    trunk.__class__ = PoisonedTrunk
    settings = decode.DecodeSettings(sampler=SamplerConfig(temperature=0.0), depth=2)
    with pytest.raises(ValueError, match="NaN"):
        _first_tokens(trunk, head, settings, 12)


@pytest.mark.parametrize("depth", [None, 2])
def test_every_sample_and_verify_uses_the_configured_backend(monkeypatch, depth: int | None) -> None:
    """Including the first token of an MTP run, which once ignored `verify_backend`."""
    seen: list[tuple[str, str]] = []
    honest_sample, honest_verify = sample_ops.sample, rejection.verify

    def recording_sample(*args, backend="auto", **kwargs):
        seen.append(("sample", backend))
        return honest_sample(*args, backend=backend, **kwargs)

    def recording_verify(*args, backend="auto", **kwargs):
        seen.append(("verify", backend))
        return honest_verify(*args, backend=backend, **kwargs)

    monkeypatch.setattr(sample_ops, "sample", recording_sample)
    monkeypatch.setattr(rejection, "verify", recording_verify)
    trunk, head = make_loop_pair(vocab_size=6, seed=3)
    settings = decode.DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=2, verify_backend="mlx")
    _first_tokens(trunk, head, settings, 8, depth)
    assert seen and {backend for _, backend in seen} == {"mlx"}
    assert seen[0][0] == "sample"  # the first token's sample is among them


def test_penalized_mtp_with_lazy_draft_context_equals_ar() -> None:
    """Penalties: the drafts' context is built lazily (no per-draft sync) and greedy MTP still
    gives AR's tokens token for token."""
    trunk, head = make_loop_pair(vocab_size=6, seed=5, head_noise=0.3)
    cfg = SamplerConfig(temperature=0.0, repetition_penalty=1.7, presence_penalty=0.4, logit_bias={3: -0.5})
    mtp = _first_tokens(trunk, head, decode.DecodeSettings(sampler=cfg, depth=3), 16, depth=3)
    ar = _first_tokens(trunk, head, decode.DecodeSettings(sampler=cfg), 16, depth=None)
    assert mtp == ar


SYNC_CASES = {
    "greedy": SamplerConfig(temperature=0.0),
    "temperature": SamplerConfig(temperature=0.7),
    "top_p": SamplerConfig(temperature=0.7, top_p=0.9),
    "top_k": SamplerConfig(temperature=0.7, top_k=20),
    "min_p": SamplerConfig(temperature=0.7, min_p=0.05),
    "penalties": SamplerConfig(
        temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.1, logit_bias={5: -1.0}
    ),
}


@pytest.mark.parametrize("case", list(SYNC_CASES))
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_one_host_sync_per_mtp_cycle(monkeypatch, case: str, greedy_draft: bool) -> None:
    """Every default sampler path: one sync per cycle (the top-p fallbacks queued, as on a GPU;
    a vocabulary above the first top-p pool so the fallback logic runs)."""
    import mlx.core as mx
    from support.sync_counter import syncs_after_prefill

    monkeypatch.setattr(sample_filters, "_queue_top_p_fallbacks", lambda: True)
    trunk, head = make_loop_pair(vocab_size=300, seed=3, logit_scale=8.0)
    settings = decode.DecodeSettings(sampler=SYNC_CASES[case], depth=3, greedy_draft=greedy_draft)
    steps = mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0))
    assert syncs_after_prefill(steps, 4) == 4


def test_sync_counter_sees_a_sync() -> None:
    """Negative control: an unevaluated read is counted, a read after eval is not."""
    import mlx.core as mx
    from support.sync_counter import counting_syncs

    with counting_syncs() as counter:
        lazy = mx.arange(3) * 2
        lazy.tolist()
        evaluated = mx.arange(3) + 1
        mx.eval(evaluated)
        evaluated.item() if evaluated.size == 1 else evaluated.tolist()
    assert counter.syncs == 2


def test_logprobs_cost_one_extra_sync_per_cycle(monkeypatch) -> None:
    """Requested logprobs depend on the accept count, so they are read after the cycle's sync:
    one more, not one per array."""
    import mlx.core as mx
    from support.sync_counter import counting_syncs

    monkeypatch.setattr(sample_filters, "_queue_top_p_fallbacks", lambda: True)
    trunk, head = make_loop_pair(vocab_size=300, seed=3, logit_scale=8.0)
    settings = decode.DecodeSettings(sampler=SamplerConfig(temperature=0.7), depth=3, logprobs=5)
    steps = mtp_decode(trunk, head, PROMPT, settings, mx.random.key(0))
    next(steps)
    with counting_syncs() as counter:
        produced = [next(steps) for _ in range(4)]
    steps.close()
    assert all(len(step.logprobs) == len(step.tokens) for step in produced)
    assert counter.syncs == 2 * 4
