"""Images at the edges (issue 49 items 12 and 13) on the tiny Qwen3.5 vision-language replica
(support.vision): ``kv_bits`` refused for images with the reason, a refusal with no Python object
in it, PIL's decompression-bomb warning never printed before mtplx's own refusal, and a
torch-layout tower whose patch equals its temporal size (at most 3) loading as the converted one.
"""

from __future__ import annotations

import io
import warnings

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.trunk.vision import ImageLimits

import mlx.core as mx
import pytest
from support.vision import IMAGE_PAD, made_up_image, write_vlm


def _image_prompt(image: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "fgh"}]}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    path = tmp_path_factory.mktemp("vlm") / "hf"
    write_vlm(path, seed=3, mtp_layers=0)
    return Engine.load(str(path), mtp=False)


def test_kv_bits_with_images_is_refused_with_the_reason_and_text_still_decodes(tmp_path):
    """Heads of 32 (groups of 32 fit): text decodes with quantized KV; an image request is refused
    naming kv_bits and why, before any image is read, and the engine keeps working."""
    write_vlm(tmp_path / "hf", seed=3, mtp_layers=0, head_dim=32)
    engine = Engine.load(str(tmp_path / "hf"), mtp=False, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    text = engine.generate("fgh", max_tokens=4, temperature=0.0)
    with pytest.raises(MtplxError, match=r"^images: not supported with kv_bits: .*M-RoPE.*second rounding"):
        engine.generate(_image_prompt(b"not even an image"), max_tokens=4)
    assert engine.generate("fgh", max_tokens=4, temperature=0.0).token_ids == text.token_ids
    plain = Engine.load(str(tmp_path / "hf"), mtp=False)  # the same checkpoint takes images without it
    assert len(plain.generate(_image_prompt(made_up_image(16, 16)), max_tokens=2).token_ids) == 2


@pytest.mark.parametrize(
    "data, message",
    [
        (b"not an image at all", r"^image 1: not a readable image \(not a format PIL can identify\)$"),
        (made_up_image(16, 16)[:40], r"^image 1: (not a readable image|cannot decode) \((?!.*0x)[^<>]*\)$"),
    ],
    ids=["not-an-image", "truncated-png"],
)
def test_a_bad_image_is_refused_in_one_line_with_no_python_object(engine, data, message):
    with pytest.raises(MtplxError, match=message):
        engine.generate(_image_prompt(data), max_tokens=2)


def _bomb(width: int, height: int) -> bytes:
    """A PNG of ``width`` x ``height`` one-bit pixels (small on disk, huge decoded)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("size", [(10_000, 9_000), (14_000, 13_000)])  # PIL: a warning, then an error
def test_a_decompression_bomb_gets_mtplxs_refusal_and_no_pil_warning(engine, size):
    from PIL import Image

    data = _bomb(*size)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)  # the negative control below
        with pytest.raises(
            MtplxError, match=rf"^image 1: .*over the limit of {ImageLimits().max_pixels} pixels$"
        ):
            engine.generate(_image_prompt(data), max_tokens=2)
    if size == (10_000, 9_000):  # PIL itself does warn on this one: the check above could fail
        with pytest.warns(Image.DecompressionBombWarning):
            Image.open(io.BytesIO(data))


def test_a_torch_layout_tower_with_patch_equal_to_its_temporal_size_loads(tmp_path):
    """Patch 2 and temporal 2: Hugging Face's torch-layout Conv3d [out, 3, 2, 2, 2] looks like
    mlx's to mlx-vlm's tower ``sanitize``; it loads, and its features are the converted layout's."""
    features = []
    for layout in ("hf", "mlx-vlm"):
        write_vlm(tmp_path / layout, layout=layout, seed=5, mtp_layers=0, patch_size=2, temporal_patch_size=2)
        vision = Engine.load(str(tmp_path / layout), mtp=False).trunk.vision
        features.append(vision.features(vision.prepare(made_up_image(16, 16, seed=1))))
    assert features[0].shape == features[1].shape
    assert mx.abs(features[0] - features[1]).max().item() < 1e-5


# ------------------------------------------------------------------ placeholder text in messages

PLACEHOLDERS = "<|vision_start|><|image_pad|><|vision_end|>"


def _plain(engine: Engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _contains(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_placeholder_text_in_a_users_message_is_text_and_the_image_request_works(engine):
    """The user writes the placeholders themselves beside a real image: one image placeholder
    (the template's) becomes the image, their text stays their text (its plain tokens)."""
    text = f"what is {PLACEHOLDERS} and <|image_pad|>"
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": made_up_image(16, 16)}, {"type": "text", "text": text}],
        }
    ]
    plain_ids = _plain(engine, "<|image_pad|>")
    tokens = engine.encode_prompt(
        [{**messages[0], "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    )
    assert tokens.count(IMAGE_PAD) == 1 and _contains(tokens, plain_ids)
    assert engine.generate(messages, max_tokens=3, temperature=0.0).token_ids  # decoded, not refused


def test_a_reply_holding_placeholder_text_is_reusable_as_the_next_assistant_turn(engine):
    first = [
        {
            "role": "user",
            "content": [{"type": "image", "image": made_up_image(16, 16)}, {"type": "text", "text": "fgh"}],
        }
    ]
    reply = f"bc{PLACEHOLDERS}de<|video_pad|>"  # what a model may write
    turn = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "more"}]
    assert engine.generate(turn, max_tokens=3, temperature=0.0).token_ids  # decoded, not refused


def test_messages_without_placeholder_text_encode_exactly_as_the_template_does(engine):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "fgh"}]}]
    want = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert engine.encode_prompt(messages) == list(want)


# ------------------------------------------------------------------ the prompt cache's bytes


def test_image_prompt_cache_entries_hold_no_pixels_outside_the_byte_budget(tmp_path):
    """An image request's stored caches keep no preprocessed pixels (the request reusing them
    binds its own), so an entry's bytes are its caches' bytes; a second turn about the image
    reuses them and decodes as a fresh prefill does. Caches handed over with their images bound
    count the pixels (the negative control: a binding left in place is visible in the bytes)."""
    from mtplx.trunk import vision
    from mtplx.trunk.prompt_cache import PromptCache, cache_nbytes

    write_vlm(tmp_path / "hf", seed=3, mtp_layers=0)
    engine = Engine.load(str(tmp_path / "hf"), mtp=False, prompt_cache_bytes=1 << 30)
    first = [
        {
            "role": "user",
            "content": [{"type": "image", "image": made_up_image(48, 48)}, {"type": "text", "text": "fgh"}],
        }
    ]
    reply = engine.generate(first, max_tokens=4, temperature=0.0)
    entries = list(engine.prompt_cache._entries.values())
    assert entries and all(vision.bound(e.trunk_cache) is None for e in entries)
    assert all(e.nbytes == cache_nbytes(e.trunk_cache) for e in entries)
    second = [*first, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "bcd"}]
    cached = engine.generate(second, max_tokens=6, temperature=0.0)
    assert cached.stats.cached_tokens > 0
    engine.prompt_cache.clear()
    assert engine.generate(second, max_tokens=6, temperature=0.0).token_ids == cached.token_ids

    plan = engine.plan(first, GenerationRequest.from_kwargs(max_tokens=1))
    caches = engine.trunk.make_cache()
    engine.trunk.bind_prompt(caches, plan.prompt_tokens)
    pixels = vision.bound_nbytes(caches)
    assert pixels >= 48 * 48 * 3 * 4  # float32 patches of a 48 x 48 RGB image
    store = PromptCache(1 << 30)
    store.insert(plan.prompt_tokens, 1, caches, None, copy=False)
    assert next(iter(store._entries.values())).nbytes == cache_nbytes(caches) + pixels
