"""DFlash drafters (`mtplx.drafters.dflash`) on a tiny replica written as z-lab's files are.

The reference path is independent of mtplx's drafter code end to end: the test reads the target
layer ids from ``config.json`` itself, takes those layers' hidden states by silencing the later
layers of the trunk (the final-norm tap of the silenced trunk, not the layer tap), builds the block
``[last, mask, ...]`` from the config's ``mask_token_id``, and runs both mlx-vlm 0.7.10's own
``qwen3_dflash`` forward (same weights, float32) and a float64 NumPy oracle over two calls (the
second on the drafter's cache after the first context). mtplx's logits at every block position
must equal mlx-vlm's within 1e-4 and the oracle's within 1e-4.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.drafters.dflash import dflash_block_logits, load_dflash
from mtplx.drafters.layouts import dflash_fit_problem, drafter_layout
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, seeds
from support.seeds import SEEDS

VOCAB, TRUNK_LAYERS, PROMPT, MORE = 64, 4, 6, 3


@pytest.fixture(scope="module", params=[False, True], ids=["bidirectional", "causal"])
def replica(request, tmp_path_factory):
    """z-lab's default (the block attends to itself both ways) and ``dflash_config.causal``."""
    config = drafters.dflash_config(VOCAB, [0, 2], TRUNK_LAYERS)
    config["dflash_config"]["causal"] = request.param
    return drafters.write_dflash(
        tmp_path_factory.mktemp("dflash"), config, drafters.dflash_tensors(config, seed=3)
    )


def _mlx_vlm_drafter(path, trunk):
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel, ModelConfig

    config = json.loads((path / "config.json").read_text())
    model = DFlashDraftModel(ModelConfig.from_dict(config))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    model.set_dtype(mx.float32)
    model.bind(trunk.model)
    return model


@pytest.mark.parametrize("seed", [SEEDS[0], SEEDS[2]])
def test_dflash_logits_equal_mlx_vlm_and_the_float64_oracle(replica, seed):
    seed = seeds.resolve(seed)
    config = json.loads((replica / "config.json").read_text())
    ids, mask = config["dflash_config"]["target_layer_ids"], config["dflash_config"]["mask_token_id"]
    block_size = config["block_size"]
    trunk = drafters.tiny_target(seed, TRUNK_LAYERS, VOCAB)
    tokens = mx.array(
        np.random.default_rng(seed).integers(0, VOCAB - 1, (2, PROMPT + MORE + 1)), dtype=mx.int32
    )
    drafter = load_dflash(replica)
    drafter.set_dtype(mx.float32)
    assert drafter_layout(config) == "dflash"
    trunk.tap_layers(drafter.target_layer_ids)
    trunk_cache, cache = trunk.make_cache(), drafter.make_cache()
    reference = _mlx_vlm_drafter(replica, trunk)
    ref_cache = reference.make_cache()
    taps_all = np.concatenate(drafters.silenced_taps(trunk, tokens[:, :-1], ids), axis=-1)
    weights = drafters.published_float64(replica)
    embed = np.array(trunk.model.model.embed_tokens.weight).astype(np.float64)
    head = np.array(trunk.model.lm_head.weight).astype(np.float64)
    for start, stop in ((0, PROMPT), (PROMPT, PROMPT + MORE)):  # a prefill chunk, then a verify block
        taps = trunk(tokens[:, start:stop], trunk_cache).layer_hidden
        last = tokens[:, stop]
        ours = dflash_block_logits(
            drafter, drafter.block_tokens(last, block_size), taps, cache, trunk.embed, trunk.lm_head
        )
        block = mx.concatenate([last[:, None], mx.full((2, block_size - 1), mask, dtype=mx.int32)], axis=1)
        theirs = reference(block, mx.concatenate(list(taps), axis=-1), ref_cache)
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=0)
        for row in range(2):
            oracle = drafters.dflash_logits(
                weights, config, taps_all[row, :stop], np.array(block[row]), embed, head
            )
            np.testing.assert_allclose(np.array(ours[row]), oracle, atol=1e-4, rtol=0)


def test_dflash_loads_the_model_prefixed_layout_and_fits_the_trunk(tmp_path):
    config = drafters.dflash_config(VOCAB, [1, 3], TRUNK_LAYERS)
    path = drafters.write_dflash(tmp_path / "d", config, drafters.dflash_tensors(config), prefix="model.")
    drafter = load_dflash(path)
    assert drafter.target_layer_ids == (1, 3) and drafter.spec.mask_token_id == VOCAB - 1
    assert dflash_fit_problem(drafter.spec, drafters.DFLASH_HIDDEN, TRUNK_LAYERS, VOCAB) is None
    assert "num_target_layers 4 != the trunk's 6 layers" in dflash_fit_problem(drafter.spec, 32, 6, VOCAB)
    assert "vocab_size 64 != the trunk's 65" in dflash_fit_problem(drafter.spec, 32, TRUNK_LAYERS, 65)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id is missing"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[]), "dflash_config.target_layer_ids must be"),
        (lambda c: c.pop("hidden_size"), "hidden_size is missing"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), "layer_types"),
        (lambda c: c.update(num_hidden_layers=3), "layers.2.input_layernorm.weight missing"),
        (
            lambda c: c.update(intermediate_size=48),
            r"layers.0.mlp.gate_proj.weight has shape \(64, 32\), expected \(48, 32\)",
        ),
    ],
)
def test_dflash_misfit_is_one_line_naming_the_field(tmp_path, change, message):
    config = drafters.dflash_config(VOCAB, [0, 2], TRUNK_LAYERS)
    tensors = drafters.dflash_tensors(config)
    change(config)
    path = drafters.write_dflash(tmp_path / "d", config, tensors)
    with pytest.raises(MtplxError, match=message) as err:
        load_dflash(path)
    assert "\n" not in str(err.value)
