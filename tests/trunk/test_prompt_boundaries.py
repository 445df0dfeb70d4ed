"""Boundary snapshots for hybrid models (mtplx/trunk/prompt_boundaries.py, CacheSession.prefill).

A tiny hybrid Qwen3.5 (gated-delta layers: caches that cannot be trimmed) with its MTP head and a
character-level ChatML tokenizer whose Qwen3-style template opens ``<think>\\n`` in the generation
prompt and renders past replies without it, so each turn rewrites the previous prompt's tail. A
5-turn chat, alone and two conversations at once through `Engine.generate_batch`: each new turn
must reuse >= 90% of its prompt with the boundaries on, with greedy tokens equal to the same
weights without a prompt cache. Negative control: with the boundaries off (the prompt's end
only, as before) the same chat reuses < 90% (nothing), so the test catches their loss.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.trunk.prompt_boundaries import ChatBoundaries

import pytest
from support.models import make_loop_pair
from support.tokenizer import chatml_thinking_chars

TURNS = 5
SYSTEM = "you are a careful assistant. " * 30  # 870 characters: the long, shared system prompt
QUESTIONS = ["what is a cache", "why keep it", "and on disk", "how large", "thanks, bye"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load

    path = tmp_path_factory.mktemp("thinking-tokenizer")
    chatml_thinking_chars(path)
    return load(path)


@pytest.fixture(scope="module")
def pair(tokenizer):
    return make_loop_pair(vocab_size=len(tokenizer.vocab), family="qwen3_5", seed=3, logit_scale=8.0)


def _engine(pair, tokenizer, cache: bool, boundaries: bool = True) -> Engine:
    trunk, head = pair
    engine = Engine(
        trunk.model, tokenizer, {}, head=head, depth=2, prompt_cache_bytes=(1 << 30) if cache else 0
    )
    if not boundaries:
        engine.prompt_cache.boundaries = None
    return engine


def _chats(
    engine: Engine, conversations: int, batch: bool
) -> tuple[list[list[list[int]]], list[list[float]]]:
    """Per conversation, per turn: the reply's tokens and the share of the prompt reused."""
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(conversations)]
    replies: list[list[list[int]]] = [[] for _ in range(conversations)]
    reuse: list[list[float]] = [[] for _ in range(conversations)]
    for turn in range(TURNS):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": QUESTIONS[(turn + c) % len(QUESTIONS)]})
        if batch:
            results = engine.generate_batch(histories, max_tokens=MAX_TOKENS, temperature=0.0, draft="head")
        else:
            results = [
                engine.generate(h, max_tokens=MAX_TOKENS, temperature=0.0, draft="head") for h in histories
            ]
        for c, (history, result) in enumerate(zip(histories, results)):
            replies[c].append(result.token_ids)
            reuse[c].append(result.stats.cached_tokens / result.stats.prompt_tokens)
            history.append({"role": "assistant", "content": result.text})
    return replies, reuse


@pytest.mark.parametrize("batch", [False, True], ids=["single", "batch"])
def test_five_turn_chat_reuses_each_turn_with_identical_output(pair, tokenizer, batch):
    conversations = 2 if batch else 1
    expected, _ = _chats(_engine(pair, tokenizer, cache=False), conversations, batch)
    got, reuse = _chats(_engine(pair, tokenizer, cache=True), conversations, batch)
    report = f"reuse per turn: {reuse}"
    assert got == expected, report
    for c in range(conversations):
        assert all(share >= 0.9 for share in reuse[c][1:]), report
    if not batch:  # (the same code path cuts the batch's prefill: one control is enough)
        # Negative control: the prompt's-end snapshot alone reuses (almost) nothing of a new turn.
        _, before = _chats(_engine(pair, tokenizer, cache=True, boundaries=False), conversations, batch)
        assert all(share < 0.9 for share in before[0][1:]), f"before {before}, after {reuse}"


def test_another_conversation_reuses_the_system_prompt(pair, tokenizer):
    engine = _engine(pair, tokenizer, cache=True)
    engine.generate(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}], max_tokens=2
    )
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a different question"}]
    got = engine.generate(other, max_tokens=2)
    # The oracle (as mlx-lm's server finds it): the system turn rendered alone ends where the user turn starts.
    system_end = len(tokenizer.apply_chat_template(other[:1], add_generation_prompt=False))
    assert got.stats.cached_tokens == system_end


def test_boundaries_on_the_default_models_template(default_model_dir):
    """The default model (SmolLM2, ChatML without thinking) gets the system prompt's end and the
    generation prompt's start, found by rendering prefixes of the conversation (the oracle)."""
    from mlx_lm.tokenizer_utils import load

    tokenizer = load(default_model_dir)
    messages = [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Arr"},
        {"role": "user", "content": "Where is the treasure?"},
    ]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    system_end = len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=False))
    generation_start = len(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    assert ChatBoundaries(tokenizer)(prompt) == [system_end, generation_start]
