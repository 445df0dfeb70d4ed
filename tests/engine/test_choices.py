"""`n > 1` (issue 43 item 2): one prefill forked into n rows of the one scheduler, each choice with
its own key. Each choice has the exact AR marginals, choices are independent (a contingency
chi-square; negative control: one key shared by every choice is caught), greedy choices all equal
the single-choice run, and the prompt is forwarded once (choices 1..n-1 start from a copy of
choice 0's caches: their stats count the copied positions as cached)."""

from __future__ import annotations

import random

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine import scheduler as scheduler_module
from mtplx.engine.request import GenerationRequest
from mtplx.engine.scheduler import BatchScheduler
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import Drafting

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats as scipy_stats
from support.exactness import FALSE_FAILURE_RATE, NUM_OUTPUT_TOKENS, PROMPT, exact_ar_joint, loop_p_value
from support.models import make_loop_pair

VOCAB = 6
CHOICES = 3
CFG = SamplerConfig(temperature=1.0)


@pytest.fixture(scope="module")
def pair():
    trunk, head = make_loop_pair(
        VOCAB, head_noise=1.0, family="qwen3_5"
    )  # hybrid: recurrent state copied too
    return trunk, head, exact_ar_joint(trunk, CFG, VOCAB)


def _request(**fields) -> GenerationRequest:
    base = dict(
        sampler=CFG,
        max_tokens=NUM_OUTPUT_TOKENS,
        n=CHOICES,
        drafting=Drafting(kind="head", depth=2),
        ignore_eos=True,
        detokenize=False,
    )
    return GenerationRequest(**{**base, **fields})


def _run(engine: Engine, requests: int, seed0: int, request: GenerationRequest, prompt=PROMPT):
    """Every request's choices: {(request index, choice): (tokens, the choice's last chunk)}."""
    scheduler = BatchScheduler(engine, max_rows=12, prompt_concurrency=4)
    handles = {scheduler.submit(prompt, request, key=mx.random.key(seed0 + i)): i for i in range(requests)}
    tokens: dict[tuple[int, int], list[int]] = {}
    last = {}
    while not scheduler.idle:
        for result in scheduler.step():
            assert result.error is None, result.error
            at = (handles[result.handle], result.choice)
            assert result.chunk.index == result.choice
            tokens.setdefault(at, []).extend(result.chunk.token_ids)
            last[at] = result.chunk
    return tokens, last


def _p_values(engine: Engine, expected: np.ndarray, seed0: int, requests: int) -> tuple[list[float], float]:
    """Each choice's marginal p-value against the exact AR joint, and the p-value of choice 0's
    first token being independent of choice 1's (contingency chi-square)."""
    tokens, _ = _run(engine, requests, seed0, _request())
    counts = [np.zeros([VOCAB] * NUM_OUTPUT_TOKENS, dtype=np.int64) for _ in range(CHOICES)]
    table = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for i in range(requests):
        for c in range(CHOICES):
            counts[c][tuple(tokens[(i, c)][:NUM_OUTPUT_TOKENS])] += 1
        table[tokens[(i, 0)][0], tokens[(i, 1)][0]] += 1
    table = table[table.sum(1) > 0][:, table.sum(0) > 0]
    independence = scipy_stats.chi2_contingency(table)[1]
    return [loop_p_value(c, expected) for c in counts], independence


@pytest.mark.parametrize("requests", [200, pytest.param(600, marks=pytest.mark.slow)])
def test_choices_have_the_ar_marginals_and_are_independent(pair, requests):
    trunk, head, expected = pair
    engine = Engine(trunk.model, None, {}, head=head)
    seed0 = random.randrange(10**6)
    marginals, independence = _p_values(engine, expected, seed0, requests)
    assert min(marginals) > FALSE_FAILURE_RATE, (marginals, seed0)
    assert independence > FALSE_FAILURE_RATE, (independence, seed0)


def test_independence_check_catches_one_key_shared_by_every_choice(pair, monkeypatch):
    trunk, head, expected = pair
    engine = Engine(trunk.model, None, {}, head=head)
    monkeypatch.setattr(scheduler_module, "choice_keys", lambda key, n: [key] * n)
    # Identical choices: p ~ 0 at any size (60 requests: p = 6e-49 at seeds 4242, 1e5, 2e5 and 3e5).
    marginals, independence = _p_values(engine, expected, 4242, 60)
    assert min(marginals) > FALSE_FAILURE_RATE  # each choice alone still looks right
    assert independence < FALSE_FAILURE_RATE, independence


def test_the_prompt_is_forwarded_once_and_greedy_choices_equal_one_choice(pair):
    trunk, head, _ = pair
    engine = Engine(trunk.model, None, {}, head=head)
    prompt = PROMPT * 3
    greedy = _request(sampler=SamplerConfig(temperature=0.0), max_tokens=8)
    tokens, last = _run(engine, 2, 7, greedy, prompt)
    alone, _ = _run(engine, 1, 7, _request(sampler=SamplerConfig(temperature=0.0), max_tokens=8, n=1), prompt)
    for i in range(2):
        assert [tokens[(i, c)] for c in range(CHOICES)] == [alone[(0, 0)]] * CHOICES
        cached = [last[(i, c)].stats.cached_tokens for c in range(CHOICES)]
        assert cached == [0] + [len(prompt) - 1] * (CHOICES - 1), cached
        assert all(last[(i, c)].stats.prompt_tokens == len(prompt) for c in range(CHOICES))


def test_a_single_stream_refuses_several_choices(pair):
    trunk, head, _ = pair
    engine = Engine(trunk.model, None, {}, head=head)
    with pytest.raises(MtplxError, match=r"^n: stream returns one choice per request"):
        engine.stream(PROMPT, _request())
    with pytest.raises(MtplxError, match=r"^n must be in \[1, 16\]"):
        _request(n=0)
