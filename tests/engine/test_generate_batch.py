"""`Engine.generate_batch` and `BatchScheduler` (continuous batching) against the same requests
decoded alone with `Engine.generate`.

Tiny random checkpoints in real layouts (MiMo: a module-stack head with its own KV cache;
Qwen3.5: hybrid gated-delta trunk, Qwen3-Next-style head) with the default tokenizer decode
token-id prompts; the default model itself checks identity up to rounding ties (the rule in
`support.decoding`), with a negative control that swaps rows.
"""

from __future__ import annotations

import dataclasses
import random
import re

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_model
from mtplx.engine import Engine
from mtplx.engine.grammar_spec import Grammar
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError

import pytest
from support import checkpoints
from support.decoding import same_or_tie
from support.models import tiny_gemma3

_req = GenerationRequest.from_kwargs
PROMPTS = [[5, 9, 2, 11, 7], [3, 3, 8], [12, 1, 4, 4, 9, 10, 2], [6], [7, 2, 7, 2, 7, 2]]


@pytest.fixture(scope="module", params=["mimo", "qwen3_5"])
def tiny_engine(request, tmp_path_factory, default_model_dir) -> Engine:
    path = tmp_path_factory.mktemp("batch") / request.param
    getattr(checkpoints, request.param)(path, seed=1)
    checkpoints.copy_tokenizer(default_model_dir, path)
    engine = Engine.load(str(path), mtp=True, depth=2)
    return engine


def _mixed_requests(seed: int) -> list[GenerationRequest]:
    """Greedy and sampled rows, head / lookup / auto / plain AR, penalties and filters."""
    return [
        _req(max_tokens=14, temperature=0.0, draft="head"),
        _req(max_tokens=11, temperature=1.0, seed=seed, draft="head", depth=3),
        _req(max_tokens=9, temperature=0.7, top_k=5, seed=seed + 1, draft="auto"),
        _req(max_tokens=12, temperature=0.9, repetition_penalty=1.3, seed=seed + 2, draft="none"),
        _req(max_tokens=10, temperature=1.0, top_p=0.8, seed=seed + 3, draft="lookup"),
    ]


def test_grammar_rows_speculate_in_a_batch_and_give_the_tokens_they_give_alone(tiny_engine):
    """Grammar requests speculate in the batch (forced tokens, masked head drafts, lookup cut to its
    legal prefix) beside free rows: the greedy row gives exactly what it gives alone, the seeded
    AR row (draft "none") exactly what it gives alone; every constrained text matches its grammar,
    and the drafting grammar rows did draft."""
    seed = random.randrange(10_000)
    # The tiny checkpoints' 64 ids hold the ASCII punctuation, digits and "A".."O" (no space, no braces).
    words = Grammar.lark(r'start: /[A-O]+/ ("-" /[A-O]+/)*')
    numbers = Grammar.lark(r'start: /[0-9]{1,3}/ ("," /[0-9]{1,3}/)* "."')  # ends: "stop"
    requests = [
        _req(max_tokens=12, temperature=0.0, grammar=words),
        _req(max_tokens=14, temperature=1.0, seed=seed, draft="head", depth=3),
        _req(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed + 1, grammar=numbers, draft="none"),
        _req(max_tokens=10, temperature=0.8, seed=seed + 2, grammar=words, repetition_penalty=1.2, depth=2),
        _req(max_tokens=9, temperature=0.7, top_k=5, seed=seed + 3, draft="auto"),
    ]
    alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
    # "fixed": every row drafts its depth (the cost policy may keep a short run at K = 0).
    batched = tiny_engine.generate_batch(PROMPTS, requests, max_rows=3, draft_policy="fixed")
    for i in (0, 1, 2, 4):  # greedy, or seeded with the same drafts as alone
        assert batched[i].token_ids == alone[i].token_ids, (i, seed)
        assert batched[i].finish_reason == alone[i].finish_reason
    assert re.fullmatch(r"[A-O]+(-[A-O]+)*-?", batched[0].text), batched[0].text
    assert re.fullmatch(r"[A-O]+(-[A-O]+)*-?", batched[3].text), batched[3].text
    numbers_text = re.fullmatch(r"[0-9]{1,3}(,[0-9]{1,3})*(\.|,)?", batched[2].text)
    assert numbers_text, batched[2].text
    assert batched[2].text.endswith(".") == (batched[2].finish_reason == "stop"), batched[2]
    for i in (0, 3):
        stats = batched[i].stats
        assert stats.mode == "mtp" and sum(d["drafted"] for d in stats.drafters.values()) > 0, stats
    assert batched[2].stats.drafters == {}, batched[2].stats.drafters


def test_adaptive_rows_cut_their_blocks_in_a_batch_as_they_do_alone(tiny_engine):
    """Adaptive head drafting joins the batch (the chain drafts the full depth, one read of its
    confidences after the forward is queued cuts each row's block): seeded and greedy rows give
    the tokens and the drafted counts they give alone, and the blocks were cut."""
    seed = random.randrange(10_000)
    # A threshold inside this random head's confidence range: some blocks are cut, some not.
    adaptive = dict(draft="head", depth=3, adaptive_threshold=0.05)
    requests = [
        _req(max_tokens=16, temperature=0.0, **adaptive),
        _req(max_tokens=14, temperature=1.0, seed=seed, **adaptive),
        _req(max_tokens=12, temperature=0.8, seed=seed + 1, draft="head", depth=3),
    ]
    alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
    batched = tiny_engine.generate_batch(PROMPTS[:3], requests, max_rows=3, draft_policy="fixed")
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids, seed
        assert b.stats.drafters == a.stats.drafters, seed
    drafted = batched[0].stats.drafters["head"]["drafted"] + batched[1].stats.drafters["head"]["drafted"]
    cycles = batched[0].stats.cycles + batched[1].stats.cycles
    assert drafted < 3 * cycles, (drafted, cycles)  # some blocks were cut short


def test_draft_model_rows_join_the_batch_and_give_the_tokens_they_give_alone(
    tiny_engine, tmp_path, default_model_dir
):
    """With a draft model loaded, its requests decode in the batch (each row drafting with its own
    proposer and draft-model cache) beside head rows: greedy and seeded rows give the tokens and
    drafter counts they give alone, and the draft model's drafts were verified."""
    family = "mimo" if "mimo" in str(tiny_engine.model_path) else "qwen3_5"
    getattr(checkpoints, family)(tmp_path / "draft", seed=2)  # other weights, the same tokenizer
    checkpoints.copy_tokenizer(default_model_dir, tmp_path / "draft")
    seed = random.randrange(10_000)
    requests = [
        _req(max_tokens=12, temperature=0.0, draft="model", depth=2),
        _req(max_tokens=12, temperature=1.0, seed=seed, draft="model", depth=2),
        _req(max_tokens=10, temperature=0.9, seed=seed + 1, draft="auto", depth=2),  # lookup, then the model
        _req(max_tokens=10, temperature=0.8, seed=seed + 2, draft="head"),
    ]
    # Loaded as `Engine.load(draft_model=...)` does, without its tokenizer check: the tiny models
    # carry the default model's tokenizer over their 64 ids, which that check rightly refuses.
    tiny_engine.draft_model = load_model(tmp_path / "draft").model
    tiny_engine.draft_vocab_size = int(tiny_engine.trunk.vocab_size)
    try:
        alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
        batched = tiny_engine.generate_batch(PROMPTS[:4], requests, max_rows=4, draft_policy="fixed")
    finally:
        tiny_engine.draft_model, tiny_engine.draft_vocab_size = None, 0
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids, seed
        assert b.stats.drafters == a.stats.drafters, seed
    assert sum(b.stats.drafters.get("model", {}).get("drafted", 0) for b in batched[:3]) > 0


def test_plain_ar_rows_queue_the_next_cycle_and_give_the_tokens_they_give_alone(tiny_engine):
    """Where every row is plain AR the next cycle is queued before the step returns; rows that end
    at different lengths and rows that join meanwhile undo it (caches and keys), so every seeded
    row still gives the tokens it gives alone."""
    seed = random.randrange(10_000)
    requests = [
        _req(max_tokens=n, temperature=t, seed=seed + i, draft="none")
        for i, (n, t) in enumerate([(5, 1.0), (13, 0.9), (8, 1.0), (11, 0.0), (7, 1.0)])
    ]
    alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
    batched = tiny_engine.generate_batch(PROMPTS, requests, max_rows=2)  # joins as rows end
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert b.token_ids == a.token_ids, (i, seed)


def test_generate_batch_gives_each_request_the_tokens_it_gives_alone(tiny_engine):
    requests = _mixed_requests(random.randrange(10_000))
    alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
    # Seeded rows draft their own depth every cycle (the draft policy leaves them alone), so they
    # draw what they draw alone; the greedy row is unseeded and the policy chooses its lengths.
    batched = tiny_engine.generate_batch(PROMPTS, requests, max_rows=3)
    for a, b, r in zip(alone, batched, requests):
        assert b.token_ids == a.token_ids, r
        assert b.finish_reason == a.finish_reason
        assert b.stats.generated_tokens == len(b.token_ids)


def test_long_prompts_prefill_in_chunks_while_rows_decode(tiny_engine):
    request = _req(max_tokens=30, temperature=0.0, draft="head")
    long_prompt = [(7 * i) % 13 + 1 for i in range(150)]
    scheduler = tiny_engine.batch(max_rows=4, prompt_concurrency=2)
    scheduler.prefill_step_size = 40
    running = scheduler.submit(PROMPTS[0], request)
    tokens: dict[int, list[int]] = {running: []}
    for result in scheduler.step():  # the short prompt joins at once
        tokens[result.handle].extend(result.chunk.token_ids)
    late = scheduler.submit(long_prompt, request)
    tokens[late] = []
    waited = 0
    while scheduler.num_waiting:
        results = scheduler.step()  # a request admitted now gets two: its first token, its first cycle
        assert any(r.handle == running and r.chunk.token_ids for r in results), "a running row stalled"
        waited += all(r.handle != late for r in results)
        for r in results:
            tokens[r.handle].extend(r.chunk.token_ids)
    assert waited == 149 // 40  # 149 tokens before the last, 40 per step: 3 steps, then it joins
    while not scheduler.idle:
        for r in scheduler.step():
            tokens[r.handle].extend(r.chunk.token_ids)
    assert tokens[running] == tiny_engine.generate(PROMPTS[0], request).token_ids
    assert tokens[late] == tiny_engine.generate(long_prompt, request).token_ids


def test_each_step_reports_its_cycle_rows_and_tokens(tiny_engine):
    """`last_timing`: the rows the step's cycle decoded, its draft length (the head drafts depth 2
    every cycle here) and the tokens it committed, which are the tokens the step delivered less
    the admitted requests' first tokens (while nothing finishes)."""
    request = _req(max_tokens=12, temperature=0.0, draft="head")
    scheduler = tiny_engine.batch(max_rows=4, draft_policy="fixed")
    assert scheduler.last_timing is None
    for prompt in PROMPTS[:3]:
        scheduler.submit(prompt, request)
    checked, widest = 0, 0
    while not scheduler.idle:
        decoding = scheduler.num_decoding
        results = scheduler.step()
        timing = scheduler.last_timing
        assert timing.draft_length == 2
        widest = max(widest, timing.rows)
        if not any(r.done for r in results):
            admitted = scheduler.num_decoding - decoding
            assert timing.rows == scheduler.num_decoding
            assert sum(len(r.chunk.token_ids) for r in results) == timing.cycle_tokens + admitted
            checked += 1
    assert widest == 3 and checked >= 3


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("shared") / "mimo"
    checkpoints.mimo(path, seed=1)
    checkpoints.copy_tokenizer(default_model_dir, path)
    return path


def _run_together(engine: Engine, prompts: list, request: GenerationRequest) -> list:
    """Every prompt submitted at once; each request's (tokens, final stats)."""
    scheduler = engine.batch(max_rows=4)
    scheduler.prefill_step_size = 40  # the longest prompt prefills over several steps
    handles = [scheduler.submit(p, request) for p in prompts]
    chunks: dict[int, list] = {h: [] for h in handles}
    while not scheduler.idle:
        for r in scheduler.step():
            chunks[r.handle].append(r.chunk)
    return [([t for c in chunks[h] for t in c.token_ids], chunks[h][-1].stats) for h in handles]


def test_concurrent_requests_with_a_shared_prefix_forward_it_once(mimo_dir):
    """Submitted together, a request sharing a long prefix with one that prefills before it (over
    several steps: the budget goes to requests in order) starts from a copy of that one's caches:
    it forwards only the rest and reports the shared part as cached (the head needs one more
    agreeing token, so 119 of the 120 shared), and it gives the tokens it gives alone. With the
    prompt cache off nothing is shared (the negative control)."""
    shared = [(5 * i) % 13 + 1 for i in range(120)]
    prompts = [shared + [3, 9, 4], shared + [7, 2], shared[:50] + [11, 12]]
    request = _req(max_tokens=8, temperature=0.0, draft="head")
    alone = Engine.load(str(mimo_dir), mtp=True, depth=2)
    expected = [alone.generate(p, request).token_ids for p in prompts]
    with_cache = Engine.load(str(mimo_dir), mtp=True, depth=2, prompt_cache_bytes=1 << 30)
    results = _run_together(with_cache, prompts, request)
    assert [tokens for tokens, _ in results] == expected
    assert [stats.cached_tokens for _, stats in results] == [0, 119, 49]
    assert [stats.prefilled_tokens for _, stats in results] == [123, 3, 3]
    results = _run_together(alone, prompts, request)  # prompt cache off
    assert [tokens for tokens, _ in results] == expected
    assert [stats.cached_tokens for _, stats in results] == [0, 0, 0]


def test_a_request_arriving_while_another_decodes_starts_from_its_prompt(mimo_dir):
    """The prompt's caches go into the prompt cache when its request is admitted, not only when it
    ends: a request submitted while the first one decodes reuses the shared prefix."""
    shared = [(7 * i) % 11 + 1 for i in range(90)]
    request = _req(max_tokens=12, temperature=0.0, draft="head")
    engine = Engine.load(str(mimo_dir), mtp=True, depth=2, prompt_cache_bytes=1 << 30)
    scheduler = engine.batch(max_rows=4)
    first = scheduler.submit(shared + [2, 4], request)
    scheduler.step()  # prefilled and admitted: decoding from here
    assert scheduler.num_decoding == 1
    late = scheduler.submit(shared + [5], request)
    stats = {}
    while not scheduler.idle:
        for r in scheduler.step():
            stats[r.handle] = r.chunk.stats
    assert stats[first].cached_tokens == 0 and stats[late].cached_tokens == 89


def test_a_prefix_reused_on_a_single_row_decoder_stores_the_caches_it_decoded_on(mimo_dir):
    """A single-row decoder decodes in the request's own caches, so the request's store at its end
    must be of the caches its prefill reuse (`BatchScheduler._reuse_prefix`) switched it to. Three
    requests, one row at a time: C is planned before A ends (nothing cached yet) and starts its
    prefill after A stored, from A's prefix; then C's whole text asked again is cached nearly
    whole (C's own store), not just the prefix it shares with A."""
    from mtplx.engine.scheduler import BatchScheduler, run_to_completion

    shared = [(5 * i) % 13 + 1 for i in range(40)]
    prompts = [shared + [3, 9], shared + [7, 2], shared + [11, 12, 4]]
    request = _req(max_tokens=8, temperature=0.0, draft="head")
    engine = Engine.load(str(mimo_dir), mtp=True, depth=2, prompt_cache_bytes=1 << 30)
    scheduler = BatchScheduler(engine, max_rows=1, prompt_concurrency=1, single_row=True)
    chunks = run_to_completion(scheduler, prompts, [request] * 3)
    last = chunks[2][-1].stats
    assert last.cached_tokens >= len(shared) - 1  # C started from A's prefix
    whole = prompts[2] + [t for c in chunks[2] for t in c.token_ids]
    again = engine.generate(whole, dataclasses.replace(request, max_tokens=2))
    assert again.stats.cached_tokens >= len(whole) - 2, (again.stats.cached_tokens, len(whole))


def test_a_cancelled_request_leaves_and_the_others_are_undisturbed(tiny_engine):
    requests = _mixed_requests(random.randrange(10_000))[:3]
    scheduler = tiny_engine.batch()
    handles = [scheduler.submit(p, r) for p, r in zip(PROMPTS, requests)]
    tokens = {h: [] for h in handles}
    for _ in range(2):
        for r in scheduler.step():
            tokens[r.handle].extend(r.chunk.token_ids)
    scheduler.cancel(handles[1])
    while not scheduler.idle:
        for r in scheduler.step():
            assert r.handle != handles[1]
            tokens[r.handle].extend(r.chunk.token_ids)
    for i in (0, 2):
        assert tokens[handles[i]] == tiny_engine.generate(PROMPTS[i], requests[i]).token_ids
    assert scheduler.num_decoding == 0 and not scheduler._decoder.rows


def test_finished_rows_fill_the_prompt_cache(tiny_engine):
    tiny_engine.prompt_cache.max_bytes = 1 << 26
    try:
        request = _req(max_tokens=6, temperature=0.0)
        prompt = [4, 8, 15, 16, 23, 42, 5, 1]
        first = tiny_engine.generate_batch([prompt], request)[0]
        again = tiny_engine.generate(prompt, request)
        assert again.token_ids == first.token_ids
        assert again.stats.cached_tokens >= len(prompt) - 1
    finally:
        tiny_engine.prompt_cache.max_bytes = 0
        tiny_engine.prompt_cache.clear()


def test_requests_the_batch_cannot_serve_are_refused_in_one_line(tiny_engine):
    with pytest.raises(MtplxError, match="needs a draft model") as err:
        tiny_engine.generate_batch(PROMPTS[:2], _req(max_tokens=4, draft="model"))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # 30 s; the tiny-model batch == alone tests above cover the rule in the default suite
def test_generate_batch_on_the_default_model_equals_alone_up_to_rounding_ties():
    """Greedy rows of the default model with its shipped head, in one batch, against each alone;
    the first mismatch must be a rounding tie of the alone run (support.decoding); a row compared
    with its neighbour's alone run must fail the rule (negative control)."""
    engine = Engine.load()
    prompts = [
        "Write a haiku about the sea.",
        "List three prime numbers.",
        "What is Python?",
        "Explain gravity briefly.",
        "def fib(n):",
        "Name the planets of the solar system.",
    ]
    request = _req(max_tokens=16, temperature=0.0, logprobs=2)
    alone = [engine.generate(p, request) for p in prompts]
    top2 = [[(t.top[0][1], t.top[1][1]) for t in a.logprobs] for a in alone]
    batched = engine.generate_batch(prompts, request)
    verdicts = [same_or_tie(a.token_ids, t, b.token_ids) for a, t, b in zip(alone, top2, batched)]
    assert all(ok for ok, _ in verdicts), verdicts
    assert sum(tied for _, tied in verdicts) <= 1  # ties are rare
    swapped = [same_or_tie(alone[i - 1].token_ids, top2[i - 1], batched[i].token_ids) for i in range(6)]
    assert not any(ok for ok, _ in swapped)


def test_a_model_that_cannot_batch_gets_a_single_row_scheduler_and_a_reason():
    """A sliding-window model (Gemma 3): its requests go through the scheduler (nothing is refused),
    one row at a time on its own caches (no cost profile is measured, nothing would use it), and
    the engine says why rows do not share a batch."""
    engine = Engine(tiny_gemma3(), None, {})
    scheduler = engine.batch()
    assert scheduler.policy is None and scheduler._decoder_for_engine().single_row
    assert "sliding-window" in engine._model_batch_refusal()


def test_a_single_row_decoding_plain_ar_stays_exact_while_the_next_request_prefills():
    """One row at a time (Gemma 3's sliding-window caches): while it decodes plain AR (its next
    cycle queued ahead), the next request prefills chunk by chunk; each gives exactly the tokens
    it gives alone (seeded and sampled: a position forwarded twice would change them)."""
    from mtplx.engine.scheduler import run_to_completion

    engine = Engine(tiny_gemma3(), None, {})
    prompts = [[5, 9, 2, 11, 7, 3, 3, 8, 1, 4], [3, 3, 8, 12, 1, 4, 4, 9, 10, 2], [6, 7, 2, 7, 2, 7, 2, 5]]
    requests = [
        dataclasses.replace(
            _req(max_tokens=12, temperature=1.0, seed=11 + i, draft="none"), ignore_eos=True, detokenize=False
        )
        for i in range(len(prompts))
    ]
    alone = [run_to_completion(engine.batch(), [p], [r])[0] for p, r in zip(prompts, requests)]
    together = run_to_completion(engine.batch(prefill_step_size=2), prompts, requests)
    for a, b in zip(alone, together):
        assert [t for c in b for t in c.token_ids] == [t for c in a for t in c.token_ids]


def test_a_sliding_window_model_with_an_assistant_decodes_its_requests_one_row_at_a_time(tmp_path):
    """Gemma 4 (sliding-window caches) with its assistant drafter (which reads the trunk's KV): the
    scheduler takes every request (nothing is served outside it), decodes them one row at a time
    through the one cycle, and each gives the tokens it gives alone; greedy equals plain AR and the
    assistant's drafts are verified."""
    from support.tokenizer import word_level

    target = checkpoints.gemma4_target(tmp_path / "gemma-4-tiny", 8, context_strength=3.0)
    word_level(target.path, 8)
    checkpoints.gemma4_assistant(
        tmp_path / "gemma-4-tiny-assistant", 8, ordered=True, num_centroids=4, scale=0.3
    )
    engine = Engine.load(str(target.path))
    assert engine.head is not None
    assert engine.batch()._decoder_for_engine().single_row
    seed = random.randrange(10_000)
    prompts = ["w2 w3 w4", "w5 w2 w6 w3", "w4 w4 w7"]
    requests = [
        _req(max_tokens=14, temperature=0.0, chat=False),
        _req(max_tokens=12, temperature=1.0, seed=seed, chat=False),
        _req(max_tokens=10, temperature=0.0, draft="none", chat=False),
    ]
    alone = [engine.generate(p, r) for p, r in zip(prompts, requests)]
    batched = engine.generate_batch(prompts, requests)
    for a, b in zip(alone, batched):
        assert b.token_ids == a.token_ids, seed
    plain = engine.generate(prompts[0], dataclasses.replace(requests[0], drafting=requests[2].drafting))
    assert batched[0].token_ids == plain.token_ids
    assert batched[0].stats.drafters["head"]["drafted"] > 0


def test_plain_ar_rows_stay_exact_while_other_requests_prefill(tiny_engine):
    """Every row plain AR, so each next cycle is queued before the step returns; requests that
    prefill meanwhile, in chunks over several cycles, must not run into it (a hybrid trunk's
    rollback taps are armed on the shared layers while a cycle is open: found when forge's
    records drifted from its teacher-forced forward). Seeded sampled rows give exactly the tokens
    they give alone, greedy rows too (up to the batching tests' rounding-tie rule)."""
    from mtplx.engine.scheduler import run_to_completion

    seed = random.randrange(10_000)
    requests = [
        _req(max_tokens=10, temperature=0.0 if i % 2 else 1.0, seed=seed + i, draft="none", logprobs=2)
        for i in range(len(PROMPTS))
    ]
    alone = [tiny_engine.generate(p, r) for p, r in zip(PROMPTS, requests)]
    scheduler = tiny_engine.batch(max_rows=2, prompt_concurrency=2, draft_policy="fixed", prefill_step_size=2)
    chunks = run_to_completion(scheduler, PROMPTS, requests)
    for a, parts, request in zip(alone, chunks, requests):
        tokens = [t for c in parts for t in c.token_ids]
        if request.sampler.is_greedy:
            top2 = [(t.top[0][1], t.top[1][1]) for t in a.logprobs]
            assert same_or_tie(a.token_ids, top2, tokens)[0], (a.token_ids, tokens)
        else:
            assert tokens == a.token_ids
