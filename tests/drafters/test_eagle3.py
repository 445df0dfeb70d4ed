"""EAGLE-3 drafters (`mtplx.drafters.eagle3`) on tiny replicas written as the speculators files and
mlx-vlm's own ``eagle3`` configs are.

The reference path is independent of mtplx's drafter code: the test derives the tapped layers
from ``config.json`` itself (Hugging Face ``hidden_states`` indices, layer ``i - 1``), takes them by
silencing later trunk layers, and runs mlx-vlm 0.7.10's ``Eagle3DraftModel`` (same weights,
float32) and a float64 NumPy oracle (no cache: one causal pass over the whole sequence) through a
first forward over the taps and one chained step on the drafter's own hidden. mtplx's logits at
every position, placed on the target vocabulary through ``d2t``, must equal both within 1e-4.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.drafters.eagle3 import eagle3_forward, eagle3_logits, joined_taps, load_eagle3
from mtplx.drafters.layouts import drafter_layout, eagle3_fit_problem
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, seeds
from support.seeds import SEEDS

VOCAB, TRUNK_LAYERS, STEPS = 64, 5, 5
LAYOUTS = {
    "speculators": lambda: drafters.eagle3_config(VOCAB, 40, [1, 3, 5]),
    "mlx_vlm_eagle3": lambda: drafters.eagle3_config(VOCAB, VOCAB, [2, 3, 4], speculators=False, layers=2),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def replica(request, tmp_path_factory):
    config = LAYOUTS[request.param]()
    return drafters.write_eagle3(
        tmp_path_factory.mktemp(request.param), config, drafters.eagle3_tensors(config, seed=5)
    )


def _mlx_vlm_drafter(path, trunk):
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel
    from mlx_vlm.speculative.drafters.eagle3 import ModelConfig as Eagle3Config

    model = Eagle3DraftModel(Eagle3Config.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    model.set_dtype(mx.float32)
    model.bind(trunk.model)
    model._cache, model._next_position = model.make_cache(), 1
    return model


@pytest.mark.parametrize("seed", [SEEDS[0], SEEDS[2]])
def test_eagle3_logits_equal_mlx_vlm_and_the_float64_oracle(replica, seed):
    seed = seeds.resolve(seed)
    config = json.loads((replica / "config.json").read_text())
    layers = [max(i - 1, 0) for i in config["eagle_aux_hidden_state_layer_ids"]]
    trunk = drafters.tiny_target(seed, TRUNK_LAYERS, VOCAB)
    drafter = load_eagle3(replica)
    drafter.set_dtype(mx.float32)
    assert drafter_layout(config) == "eagle3"
    tokens = mx.array(np.random.default_rng(seed).integers(0, VOCAB, (2, STEPS + 1)), dtype=mx.int32)
    trunk.tap_layers(drafter.tapped_layers(TRUNK_LAYERS))
    taps = trunk(tokens[:, :STEPS], trunk.make_cache()).layer_hidden
    reference = _mlx_vlm_drafter(replica, trunk)
    cache = drafter.make_cache()
    # the first forward over the target's taps (tokens shifted by one, at positions 1..), then one chained step
    first = eagle3_forward(drafter, tokens[:, 1:], joined_taps(taps), cache, 1, trunk.embed)
    chained = eagle3_forward(drafter, tokens[:, -1:], first[:, -1:], cache, 1 + STEPS, trunk.embed)
    ours = mx.concatenate([first, chained], axis=1)
    theirs = mx.concatenate(
        [
            reference._forward_tokens(tokens[:, 1:], joined_taps(taps), mx.int32),
            reference._forward_tokens(tokens[:, -1:], first[:, -1:], mx.int32),
        ],
        axis=1,
    )
    as_linear = trunk.model.model.embed_tokens.as_linear
    draft_logits = eagle3_logits(drafter, ours, as_linear)
    np.testing.assert_allclose(np.array(draft_logits), np.array(reference._logits(theirs)), atol=1e-4, rtol=0)
    draft_ids = mx.arange(config["draft_vocab_size"])
    assert np.array_equal(
        np.array(drafter.draft_to_target(draft_ids)),
        np.array(reference._draft_to_target(draft_ids, mx.int32)),
    )

    weights = drafters.published_float64(replica)
    embed = np.array(trunk.model.model.embed_tokens.weight).astype(np.float64)
    target_logits = np.array(drafter.target_logits(draft_logits))
    independent = np.concatenate(drafters.silenced_taps(trunk, tokens[:, :STEPS], layers), axis=-1)
    for row in range(2):
        projected = drafters.eagle3_project(weights, config, independent[row])
        seq = np.array(tokens[row, 1:])
        h1 = drafters.eagle3_hidden(weights, config, seq, projected, 1, embed)
        chain_in = np.concatenate([projected, h1[-1:]], axis=0)
        h2 = drafters.eagle3_hidden(weights, config, np.concatenate([seq, seq[-1:]]), chain_in, 1, embed)
        oracle = drafters.eagle3_target_logits(weights, config, np.concatenate([h1, h2[-1:]], axis=0))
        finite = np.isfinite(oracle)
        assert np.array_equal(finite, np.isfinite(target_logits[row]))
        np.testing.assert_allclose(target_logits[row][finite], oracle[finite], atol=1e-4, rtol=0)


def test_eagle3_default_taps_are_low_middle_high_of_the_target():
    config = drafters.eagle3_config(VOCAB, VOCAB, None)
    from mtplx.drafters.layouts import eagle3_spec

    spec = eagle3_spec(config)
    assert spec.tapped_layers(32) == (1, 15, 28)  # hidden_states [2, 16, 29]
    assert spec.block_size == 5  # speculative_tokens 3 + 2, as mlx-vlm reads it
    assert eagle3_fit_problem(spec, drafters.EAGLE3_HIDDEN, 32, VOCAB) is None
    assert "target_hidden_size 32 != the trunk's 48" in eagle3_fit_problem(spec, 48, 32, VOCAB)


def _broken(tmp_path, edit):
    config = drafters.eagle3_config(VOCAB, 40, [1, 3, 5])
    tensors = drafters.eagle3_tensors(config)
    edit(config, tensors)
    return drafters.write_eagle3(tmp_path / "e", config, tensors)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, t: c.pop("transformer_layer_config"), "transformer_layer_config is missing"),
        (
            lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[1, 2]),
            "eagle_aux_hidden_state_layer_ids must be 3",
        ),
        (lambda c, t: t.pop("d2t"), "tensor d2t missing"),
        (lambda c, t: t.update(d2t=np.append(t["d2t"][:-1], VOCAB)), "d2t maps draft ids outside or twice"),
        (lambda c, t: t.update(t2d=np.roll(t["t2d"], 1)), "t2d does not mark exactly"),
        (lambda c, t: t.pop("layers.0.hidden_norm.weight"), "tensor layers.0.hidden_norm.weight missing"),
        (lambda c, t: t.update({"fc.weight": t["fc.weight"][:, :64]}), r"fc.weight has shape \(32, 64\)"),
    ],
)
def test_eagle3_misfit_is_one_line_naming_the_field(tmp_path, edit, message):
    with pytest.raises(MtplxError, match=message) as err:
        load_eagle3(_broken(tmp_path, edit))
    assert "\n" not in str(err.value)
