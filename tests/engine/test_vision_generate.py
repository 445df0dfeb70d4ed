"""Images through the engine on a tiny random-weight Qwen3.5 vision-language replica with its MTP
head (support.vision): speculation after an image is exact.

Greedy MTP equals plain AR for an image prompt, alone and in a batch beside text rows and other
image rows (rows joining as others leave; the rounding-tie rule of the batching tests); prefill
chunk sizes 1, 3 and 1000 give the same tokens; sampled first tokens match the exact AR joint
(enumerated in float64 from the trunk's own image forward) by chi-square, and the same counts
against the joint of a different image are rejected (negative control).
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.engine.scheduler import run_to_completion
from mtplx.errors import MtplxError
from mtplx.sampling import SamplerConfig, distribution_from_logits
from mtplx.trunk.compat import copy_cache
from mtplx.trunk.prompt_cache import PromptCache

import mlx.core as mx
import numpy as np
import pytest
from support.decoding import same_or_tie
from support.exactness import FALSE_FAILURE_RATE, loop_p_value
from support.models import VOCAB
from support.vision import CHARS, EOS, IMAGE_PAD, VISION_END, VISION_START, made_up_image, write_vlm

_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("vlm") / "hf"
    write_vlm(path, seed=3)
    engine = Engine.load(str(path), mtp=True, depth=2)
    assert engine.trunk.vision is not None and engine.head is not None
    return engine


def image_messages(image: bytes, text: str = "fgh") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": text}]}]


IMAGE_A = made_up_image(32, 24, seed=1)
IMAGE_B = made_up_image(32, 24, seed=2)  # the same size: the same number of image tokens
IMAGE_C = made_up_image(40, 16, seed=3)


def test_greedy_mtp_equals_ar_after_an_image(engine) -> None:
    prompt = image_messages(IMAGE_A)
    ar = engine.generate(prompt, max_tokens=16, draft="none")
    mtp = engine.generate(prompt, max_tokens=16, draft="head")
    assert mtp.token_ids == ar.token_ids
    assert mtp.stats.drafters["head"]["drafted"] > 0  # it speculated
    other = engine.generate(image_messages(IMAGE_B), max_tokens=16, draft="none")
    assert other.token_ids != ar.token_ids  # the image is read: a different one changes the text


def test_images_keyword_and_token_id_prompts_place_them_as_message_parts_do(engine) -> None:
    by_part = engine.generate(image_messages(IMAGE_A), max_tokens=8)
    by_keyword = engine.generate("fgh", max_tokens=8, images=[IMAGE_A], chat=True)
    assert by_keyword.token_ids == by_part.token_ids
    ids = [VISION_START, IMAGE_PAD, VISION_END, *(CHARS.index(c) for c in "fghZ")]  # one pad per image
    assert engine.generate(ids, max_tokens=8, images=[IMAGE_A]).token_ids == by_part.token_ids


def test_image_rows_in_a_batch_give_the_tokens_they_give_alone(engine) -> None:
    prompts = [
        image_messages(IMAGE_A),
        [5, 9, 2, 11, 7],
        image_messages(IMAGE_C, "ccd"),
        image_messages(IMAGE_B),
        [12, 1, 4],
    ]
    lengths = (14, 9, 12, 6, 11)
    requests = [_req(max_tokens=n, temperature=0.0, draft="head", logprobs=2) for n in lengths]
    alone = [engine.generate(p, r) for p, r in zip(prompts, requests)]
    top2 = [[(t.top[0][1], t.top[1][1]) for t in a.logprobs] for a in alone]
    batched = engine.generate_batch(prompts, requests, max_rows=2)  # rows join as others leave
    verdicts = [same_or_tie(a.token_ids, t, b.token_ids) for a, t, b in zip(alone, top2, batched)]
    assert all(ok for ok, _ in verdicts), verdicts
    plain = [engine.generate(p, _req(max_tokens=n, draft="none")) for p, n in zip(prompts, lengths)]
    assert [a.token_ids for a in alone] == [p.token_ids for p in plain]  # greedy MTP == AR, each alone


@pytest.mark.parametrize("draft", ["head", "none"])
def test_prefill_chunk_sizes_give_the_same_tokens(engine, draft) -> None:
    prompt = image_messages(IMAGE_C)
    runs = []
    for chunk in (1, 3, 1000):
        scheduler = engine.batch(max_rows=1, draft_policy="fixed", prefill_step_size=chunk)
        (chunks,) = run_to_completion(scheduler, [prompt], [_req(max_tokens=12, draft=draft)])
        runs.append([t for c in chunks for t in c.token_ids])
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 12


def _exact_two_token_joint(engine, prompt, cfg: SamplerConfig) -> np.ndarray:
    """P(first two tokens) under AR sampling, float64, from the trunk's own image forward."""
    tokens = engine.plan(prompt, _req(max_tokens=2)).prompt_tokens
    trunk = engine.trunk
    cache = trunk.make_cache()
    trunk.bind_prompt(cache, tokens)
    logits = trunk(mx.array(tokens)[None], cache).logits[0, -1]
    p1 = distribution_from_logits(np.array(logits.astype(mx.float32), dtype=np.float64), cfg)
    joint = np.zeros((VOCAB, VOCAB))
    for t in np.flatnonzero(p1):
        after = trunk(mx.array([[int(t)]]), copy_cache(cache)).logits[0, -1]
        joint[t] = p1[t] * distribution_from_logits(np.array(after.astype(mx.float32), dtype=np.float64), cfg)
    return joint


def test_sampled_first_tokens_after_an_image_match_the_exact_ar_joint(engine) -> None:
    """Rows sampled at temperature 1 with MTP (the second token comes out of the verifier) match
    the exact AR joint of the first two tokens; the same counts against the joint of the prompt
    without its image (a path that dropped the image) are rejected (negative control). The rows
    start from the prompt cache's snapshot of the image prompt (an earlier request stored it).
    Power: at 150 samples the control is rejected at p < 2e-9 (seeds 1000, 1e5, 2e5; 2026-12-07)."""
    no_eos = {EOS: -100.0}  # two tokens every time: the joint has no stopped sequences
    cfg = SamplerConfig(temperature=1.0, logit_bias=no_eos)
    prompt = image_messages(IMAGE_A)
    num_samples = 200
    requests = [
        _req(max_tokens=2, temperature=1.0, logit_bias=no_eos, seed=1000 + i, draft="head")
        for i in range(num_samples)
    ]
    kept, engine.prompt_cache = engine.prompt_cache, PromptCache(64 * 1024**2)
    try:
        engine.generate(prompt, requests[0])  # stores the prompt's snapshot
        results = engine.generate_batch([prompt] * num_samples, requests, max_rows=64)
    finally:
        engine.prompt_cache = kept
    assert all(r.stats.cached_tokens > 0 for r in results)
    counts = np.zeros((VOCAB, VOCAB), dtype=np.int64)
    for r in results:
        assert len(r.token_ids) == 2
        counts[tuple(r.token_ids)] += 1
    assert sum(r.stats.drafters.get("head", {}).get("drafted", 0) for r in results) > 0
    assert loop_p_value(counts, _exact_two_token_joint(engine, prompt, cfg)) > FALSE_FAILURE_RATE
    text_only = _exact_two_token_joint(engine, [{"role": "user", "content": "fgh"}], cfg)
    assert loop_p_value(counts, text_only) < FALSE_FAILURE_RATE


def decompression_bomb() -> bytes:
    """A PNG of 25 M pixels in a few kilobytes."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (5000, 5000)).save(out, format="PNG")
    assert len(out.getvalue()) < 100_000
    return out.getvalue()


def test_images_on_a_text_model_and_bad_images_are_refused_in_one_line(engine, default_model_dir) -> None:
    with pytest.raises(MtplxError, match="image 1: not a readable image"):
        engine.generate(image_messages(b"not an image"), max_tokens=2)
    with pytest.raises(MtplxError, match="image 1: 5000x5000 is over the limit of 16777216 pixels"):
        engine.generate(image_messages(decompression_bomb()), max_tokens=2)  # refused before decoding
    with pytest.raises(MtplxError, match="video parts are not supported"):
        engine.generate([{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}], max_tokens=2)
    text = Engine.load(str(default_model_dir), mtp=False)
    with pytest.raises(MtplxError, match="this model takes no images"):
        text.generate("hi", max_tokens=2, images=[IMAGE_A], chat=True)


def test_a_second_turn_about_the_same_image_reuses_the_prompt_cache(engine) -> None:
    """The prompt cache keys image tokens on the image's pixels: a chat's second turn about the
    same image starts from the first turn's snapshot; the same turn about another image of the
    same size (the same token ids) reuses nothing. Reuse changes no token."""

    def second_turn(image: bytes, reply: str) -> list[dict]:
        return [
            *image_messages(image),
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "ijk"},
        ]

    kept, engine.prompt_cache = engine.prompt_cache, PromptCache(64 * 1024**2)
    try:
        first = engine.generate(image_messages(IMAGE_A), max_tokens=6)
        again = engine.generate(second_turn(IMAGE_A, first.text), max_tokens=6)
        other = engine.generate(second_turn(IMAGE_B, first.text), max_tokens=6)
    finally:
        engine.prompt_cache = kept
    first_prompt = engine.plan(image_messages(IMAGE_A), _req()).prompt_tokens
    assert again.stats.cached_tokens == len(first_prompt) - 1
    assert other.stats.cached_tokens == 0
    assert again.token_ids == engine.generate(second_turn(IMAGE_A, first.text), max_tokens=6).token_ids
