"""Fidelity of the image path against mlx-vlm's own Qwen3.5 forward, on a tiny random-weight
vision-language replica in the published layout (support.vision), with made-up images.

The oracle is mlx-vlm's model (its tower, merge, ``get_rope_index`` and language model), never
mtplx code: trunk logits at every prompt position and over 5 decode steps agree to float32
rounding. Negative control: the same comparison with the position hook off (merged embeddings at
plain RoPE positions, what mlx-lm alone would run) is far outside the tolerance.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.errors import MtplxError
from mtplx.trunk import image_positions
from mtplx.trunk.image_positions import ImageSpan, rope_index
from mtplx.trunk.model import Trunk
from mtplx.trunk.vision import ImageToken, PromptImages, VisionEncoder

import mlx.core as mx
import numpy as np
import pytest
from support.vision import IMAGE_PAD, VISION_END, VISION_START, made_up_image, reference_vlm, write_vlm

TOLERANCE = 3e-4  # mlx-lm vs mlx-vlm language models on text alone differ by up to ~3e-5 here


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("vlm") / "hf"
    write_vlm(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    return reference_vlm(checkpoint)


def load_trunk(path: Path) -> tuple[Trunk, VisionEncoder]:
    model, config = load_mlx_model(path)
    trunk = Trunk(model)
    encoder = VisionEncoder.load(path, config)
    trunk.attach_vision(encoder)
    return trunk, encoder


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_trunk(checkpoint)


def prompt_with(encoder: VisionEncoder, sizes: list[tuple[int, int]]) -> tuple[list[int], list]:
    """Text, then each image between its vision markers, then text: (tokens, images)."""
    images = [encoder.prepare(made_up_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    tokens = [5, 7]
    for i in range(len(images)):
        tokens += [VISION_START, IMAGE_PAD, VISION_END, 9 + i]
    tokens += [11, 13, 17]
    return encoder.expand(tokens, images), images


def reference_forward(reference, tokens: list[int], images) -> tuple[list[mx.array], object, mx.array]:
    """mlx-vlm: the prompt's logits [T, V], its cache and the prompt ids."""
    ids = mx.array([[int(t) for t in tokens]])
    kwargs = {}
    if images:
        kwargs = {
            "pixel_values": mx.array(np.concatenate([im.pixels for im in images])),
            "image_grid_thw": mx.array([list(im.grid_thw) for im in images]),
        }
    features = reference.get_input_embeddings(ids, **kwargs)
    cache = reference.language_model.make_cache()
    out = reference.language_model(
        ids,
        inputs_embeds=features.inputs_embeds,
        cache=cache,
        position_ids=features.position_ids,
        rope_deltas=features.rope_deltas,
    )
    return out.logits[0], cache


def trunk_prefill(trunk: Trunk, tokens: list[int], chunk: int) -> tuple[mx.array, list]:
    cache = trunk.make_cache()
    trunk.bind_prompt(cache, tokens)
    parts = []
    for start in range(0, len(tokens), chunk):
        parts.append(trunk(mx.array(tokens[start : start + chunk])[None], cache).logits[0])
        mx.eval(parts[-1])
    return mx.concatenate(parts, axis=0), cache


def max_gap(a: mx.array, b: mx.array) -> float:
    return float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))))


def decode_gaps(trunk, cache, reference, ref_cache, first: int, steps: int = 5) -> list[float]:
    """Feed the same greedy tokens to both for ``steps`` steps; the logit gap at each."""
    gaps, token = [], first
    for _ in range(steps):
        ours = trunk(mx.array([[token]]), cache).logits[0, -1]
        theirs = reference.language_model(mx.array([[token]]), cache=ref_cache).logits[0, -1]
        gaps.append(max_gap(ours, theirs))
        token = int(mx.argmax(theirs))
    return gaps


# ------------------------------------------------------------------ positions


@pytest.mark.parametrize(
    "sizes",
    [[], [(32, 24)], [(32, 24), (16, 16)], [(40, 16)]],
    ids=["no-image", "one-image", "two-images", "non-square"],
)
def test_rope_index_from_spans_equals_mlx_vlm(reference, loaded, sizes) -> None:
    _, encoder = loaded
    tokens, images = prompt_with(encoder, sizes)
    prompt = PromptImages.from_tokens(tokens)
    spans = prompt.spans if prompt is not None else []
    ours, lag = rope_index(len(tokens), spans)
    ids = mx.array([[int(t) for t in tokens]])
    grids = mx.array([list(im.grid_thw) for im in images]) if images else None
    theirs, deltas = reference.language_model.get_rope_index(ids, grids)
    theirs = np.array(theirs).reshape(-1, len(tokens)) if images else np.array(theirs)
    np.testing.assert_array_equal(np.broadcast_to(ours, (3, len(tokens)))[: theirs.shape[0]], theirs)
    assert lag == int(np.array(deltas).reshape(-1)[0])
    if sizes == [(40, 16)]:
        assert spans[0].grid == (1, 2, 5) and lag == 5 - 10  # non-square: advances by the longer side


# ------------------------------------------------------------------ logits


@pytest.mark.parametrize("chunk", [1000, 3], ids=["one-forward", "chunks-of-3"])
def test_trunk_logits_match_mlx_vlm_for_text_image_text(loaded, reference, chunk) -> None:
    trunk, encoder = loaded
    tokens, images = prompt_with(encoder, [(32, 24), (40, 16)])
    ours, cache = trunk_prefill(trunk, tokens, chunk)
    theirs, ref_cache = reference_forward(reference, tokens, images)
    assert ours.shape == theirs.shape
    assert max_gap(ours, theirs) < TOLERANCE  # every prompt position
    gaps = decode_gaps(trunk, cache, reference, ref_cache, int(mx.argmax(theirs[-1])))
    assert max(gaps) < TOLERANCE, gaps


def test_moe_trunk_logits_match_mlx_vlm(tmp_path) -> None:
    """The same on a Qwen3.5-MoE replica (Hugging Face's fused expert tensors), chunks of 3."""
    write_vlm(tmp_path / "moe", moe=True)
    trunk, encoder = load_trunk(tmp_path / "moe")
    reference = reference_vlm(tmp_path / "moe")
    tokens, images = prompt_with(encoder, [(32, 24), (40, 16)])
    ours, cache = trunk_prefill(trunk, tokens, 3)
    theirs, ref_cache = reference_forward(reference, tokens, images)
    assert max_gap(ours, theirs) < TOLERANCE
    assert max(decode_gaps(trunk, cache, reference, ref_cache, int(mx.argmax(theirs[-1])))) < TOLERANCE


def test_without_the_position_hook_the_logits_differ(loaded, reference, monkeypatch) -> None:
    """Negative control: merged embeddings at plain RoPE positions (no M-RoPE, no reframe) differ
    from mlx-vlm's far beyond the tolerance, so the test above would catch a missing hook."""
    trunk, encoder = loaded
    tokens, images = prompt_with(encoder, [(32, 24)])
    real = image_positions.chunk_layout

    def plain_positions(spans, offset, length):
        layout = real(spans, offset, length)
        if layout is not None:
            layout.positions = np.broadcast_to(np.arange(offset, offset + length), (3, length)).copy()
            layout.shift = 0
        return layout

    monkeypatch.setattr(image_positions, "chunk_layout", plain_positions)
    ours, cache = trunk_prefill(trunk, tokens, 1000)
    theirs, ref_cache = reference_forward(reference, tokens, images)
    gap_prompt = max_gap(ours, theirs)
    gaps = decode_gaps(trunk, cache, reference, ref_cache, int(mx.argmax(theirs[-1])))
    assert gap_prompt > 100 * TOLERANCE and min(gaps) > 100 * TOLERANCE


def test_text_only_prompt_is_the_plain_forward_bit_for_bit(checkpoint, loaded) -> None:
    """A text prompt on a vision trunk runs exactly the text trunk's forward."""
    trunk, _ = loaded
    plain = Trunk(load_mlx_model(checkpoint)[0])
    tokens = [5, 7, 9, 11, 13]
    a, b = trunk.make_cache(), plain.make_cache()
    trunk.bind_prompt(a, tokens)
    ours = trunk(mx.array(tokens)[None], a).logits
    theirs = plain(mx.array(tokens)[None], b).logits
    assert mx.array_equal(ours, theirs).item()
    assert mx.array_equal(trunk(mx.array([[3]]), a).logits, plain(mx.array([[3]]), b).logits).item()


def test_mlx_vlm_layout_loads_the_same_model(tmp_path, loaded) -> None:
    """mlx-vlm's converted layout (``language_model.*``, ``vision_tower.*``) gives the same logits."""
    trunk, encoder = loaded
    write_vlm(tmp_path / "converted", layout="mlx-vlm", mtp_layers=0)
    other, other_encoder = load_trunk(tmp_path / "converted")
    tokens, _ = prompt_with(encoder, [(16, 16)])
    again, _ = prompt_with(other_encoder, [(16, 16)])
    assert max_gap(trunk_prefill(trunk, tokens, 1000)[0], trunk_prefill(other, again, 1000)[0]) < 1e-5


# ------------------------------------------------------------------ tokens and spans


def test_image_tokens_are_the_pad_id_but_equal_only_for_the_same_pixels(loaded) -> None:
    _, encoder = loaded
    a = encoder.prepare(made_up_image(16, 16, seed=1))
    b = encoder.prepare(made_up_image(16, 16, seed=2))
    a_again = encoder.prepare(made_up_image(16, 16, seed=1))
    ta, tb, ta2 = ImageToken(IMAGE_PAD, a, 0), ImageToken(IMAGE_PAD, b, 0), ImageToken(IMAGE_PAD, a_again, 0)
    assert int(ta) == IMAGE_PAD and mx.array([ta]).item() == IMAGE_PAD
    assert ta == ta2 and hash(ta) == hash(ta2)
    assert ta != tb and ta != IMAGE_PAD and IMAGE_PAD != ta
    assert ta != ImageToken(IMAGE_PAD, a, 1)


def test_expand_refuses_a_count_mismatch_and_video(loaded) -> None:
    _, encoder = loaded
    image = encoder.prepare(made_up_image(16, 16))
    with pytest.raises(MtplxError, match="2 image placeholders for 1 images"):
        encoder.expand([IMAGE_PAD, 3, IMAGE_PAD], [image])
    with pytest.raises(MtplxError, match="video"):
        encoder.expand([IMAGE_PAD, json.loads("63")], [image])


def test_spans_from_tokens(loaded) -> None:
    _, encoder = loaded
    tokens, images = prompt_with(encoder, [(32, 24), (16, 16)])
    prompt = PromptImages.from_tokens(tokens)
    assert [s.start for s in prompt.spans] == [3, 3 + 12 + 3]
    assert [s.grid for s in prompt.spans] == [(1, 3, 4), (1, 2, 2)]
    assert prompt.images == images
    assert PromptImages.from_tokens([1, 2, 3]) is None
    with pytest.raises(MtplxError, match="not one whole image"):
        PromptImages.from_tokens(tokens[:5] + tokens[6:])


def test_a_chunk_inside_an_image_keeps_its_origin() -> None:
    """Chunk layouts put an image's patches at the same places whatever the chunking (after the
    reframe of completed images), so a chunk boundary may fall anywhere."""
    spans = [ImageSpan(2, (1, 2, 3)), ImageSpan(9, (1, 2, 2))]
    whole, lag = rope_index(16, spans)
    pieces, shift = [], 0
    for start in range(0, 16, 3):
        layout = image_positions.chunk_layout(spans, start, min(3, 16 - start))
        got = np.broadcast_to(np.arange(start, start + 3)[: min(3, 16 - start)], (3, min(3, 16 - start)))
        got = layout.positions if layout is not None else got
        pieces.append(got + shift)  # back to the whole prompt's frame: undo the reframes so far
        shift += layout.shift if layout is not None else 0
    np.testing.assert_array_equal(np.concatenate(pieces, axis=1), whole)
    assert shift == lag == (3 - 6) + (2 - 4)


def test_prompt_cache_shares_a_prefix_up_to_a_different_image_and_through_the_same(loaded) -> None:
    """Keyed on token sequences, the prompt cache stops a shared prefix at the first token of a
    different image of the same size (the same ids), and keeps it through the same image."""
    from mtplx.trunk.compat import KVCache
    from mtplx.trunk.prompt_cache import PromptCache

    _, encoder = loaded
    x, y = made_up_image(32, 24, seed=5), made_up_image(32, 24, seed=6)
    text = [5, 7, VISION_START, IMAGE_PAD, VISION_END, 9, 11]
    with_x = encoder.expand(text, [encoder.prepare(x)])
    with_y = encoder.expand(text, [encoder.prepare(y)])
    with_x_again = encoder.expand(text, [encoder.prepare(x)]) + [13]
    assert [int(t) for t in with_x] == [int(t) for t in with_y]  # the same ids
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, len(with_x), 4)), mx.zeros((1, 1, len(with_x), 4)))
    store = PromptCache(1 << 20)
    store.insert(with_x, len(with_x), [kv], None, copy=True)
    assert store.lookup(with_y, with_head=False).start == 3  # the image starts at index 3
    assert store.lookup(with_x_again, with_head=False).start == len(with_x)


def test_compat_vision_check_passes_here_and_names_what_changed() -> None:
    """The image path's assumptions about mlx-vlm / mlx-lm hold on the installed versions, and a
    changed version or an attention class that no longer calls its rope at the cache offset is
    reported in one error (negative controls)."""
    from mtplx.trunk import compat_vision

    compat_vision.check()
    with pytest.raises(MtplxError, match="mlx-vlm 0.6.0 is outside the supported range"):
        compat_vision.check(version="0.6.0")
    with pytest.raises(MtplxError, match="no longer calls self.rope"):
        compat_vision.check(attention_path="mlx_lm.models.qwen3_5.GatedDeltaNet")


def test_a_pure_attention_model_is_refused_images(loaded) -> None:
    """Images need caches the prompt cache snapshots (a trimmed KV cache would keep keys reframed
    past an image): a pure-KV model is refused in one line."""
    from support.models import tiny_llama

    _, encoder = loaded
    with pytest.raises(MtplxError, match="hybrid"):
        Trunk(tiny_llama()).attach_vision(encoder)


def test_a_tower_of_another_family_or_none_leaves_the_model_text_only_with_a_reason(checkpoint) -> None:
    """A Gemma 4 (or any non-Qwen3.5) checkpoint that declares a vision tower still loads, text
    only; a request with images then gets the reason (`Engine` reads ``vision_refusal``)."""
    from mtplx.trunk.vision import attach_declared

    trunk = Trunk(load_mlx_model(checkpoint)[0])
    attach_declared(trunk, checkpoint, {"model_type": "gemma4", "vision_config": {}})
    assert trunk.vision is None and "not supported for gemma4" in trunk.vision_refusal
    # A text-only conversion that kept vision_config in its config.json loads text-only too.
    attach_declared(trunk, checkpoint / "nowhere", {"model_type": "qwen3_5", "vision_config": {}})
    assert trunk.vision is None and trunk.vision_refusal == "the checkpoint ships no vision tower weights"


def test_reframe_refuses_caches_it_cannot_turn() -> None:
    """A quantized KV cache holds keys the reframe cannot turn: refused, never left stale."""
    from mtplx.trunk.compat import QuantizedKVCache

    with pytest.raises(MtplxError, match="QuantizedKVCache caches are not supported"):
        image_positions.reframe([QuantizedKVCache()], 3, None)
