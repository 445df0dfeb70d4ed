"""DSpark drafters (`mtplx.drafters.dspark`) on a tiny replica in the canonical DSpark config
(``dflash_config.projector_type`` dspark, Markov rank, confidence head).

As for DFlash, the reference path reads the config itself, takes the target layers by silencing
later trunk layers and builds the block from the config's mask token and ``sample_from_anchor``;
mtplx's per-draft logits (base + Markov by the previous token) and confidence must equal mlx-vlm
0.7.10's ``DSparkDraftModel`` and a float64 NumPy oracle within 1e-4 at every draft position.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.drafters.dspark import (
    dspark_base,
    dspark_confidence,
    dspark_step_logits,
    load_dspark,
    previous_tokens,
)
from mtplx.drafters.layouts import drafter_layout
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, seeds
from support.seeds import SEEDS

VOCAB, TRUNK_LAYERS, PROMPT = 64, 4, 6


@pytest.fixture(scope="module", params=[True, False], ids=["from_anchor", "after_anchor"])
def replica(request, tmp_path_factory):
    config = drafters.dspark_config(VOCAB, [0, 2], TRUNK_LAYERS, sample_from_anchor=request.param)
    return drafters.write_dflash(
        tmp_path_factory.mktemp("dspark"), config, drafters.dspark_tensors(config, seed=4)
    )


def _mlx_vlm_drafter(path, trunk):
    from mlx_vlm.speculative.drafters.dspark import DSparkDraftModel, ModelConfig
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    model = DSparkDraftModel(ModelConfig.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    model.set_dtype(mx.float32)
    DFlashDraftModel.bind(model, trunk.model)  # DSpark's own bind also asks for mlx-vlm's rollback API
    return model


@pytest.mark.parametrize("seed", [SEEDS[0], SEEDS[2]])
def test_dspark_logits_and_confidence_equal_mlx_vlm_and_the_float64_oracle(replica, seed):
    seed = seeds.resolve(seed)
    config = json.loads((replica / "config.json").read_text())
    dflash = config["dflash_config"]
    ids, mask, proposals = dflash["target_layer_ids"], dflash["mask_token_id"], dflash["block_size"]
    trunk = drafters.tiny_target(seed, TRUNK_LAYERS, VOCAB)
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(0, VOCAB - 1, (2, PROMPT + 1)), dtype=mx.int32)
    drafts = mx.array(rng.integers(0, VOCAB, (2, proposals)), dtype=mx.int32)  # as if drawn
    drafter = load_dspark(replica)
    drafter.set_dtype(mx.float32)
    assert drafter_layout(config) == "dspark" and drafter.dspark.proposal_length == proposals
    trunk.tap_layers(drafter.target_layer_ids)
    taps = trunk(tokens[:, :PROMPT], trunk.make_cache()).layer_hidden
    anchor = tokens[:, PROMPT]
    hidden, base = dspark_base(
        drafter, drafter.block_tokens(anchor), taps, drafter.make_cache(), trunk.embed, trunk.lm_head
    )
    previous = previous_tokens(anchor, drafts)
    ours, confidence = (
        dspark_step_logits(drafter, base, previous),
        dspark_confidence(drafter, hidden, previous),
    )

    reference = _mlx_vlm_drafter(replica, trunk)
    masks = proposals - int(dflash["sample_from_anchor"])
    block = mx.concatenate([anchor[:, None], mx.full((2, masks), mask, dtype=mx.int32)], axis=1)
    ref_hidden = reference._hidden(block, mx.concatenate(list(taps), axis=-1), reference.make_cache())
    ref_hidden = ref_hidden if dflash["sample_from_anchor"] else ref_hidden[:, 1:]
    ref_base = reference._logits(ref_hidden)
    theirs = mx.stack(
        [reference.markov_head.apply_step_logits(ref_base[:, j], previous[:, j]) for j in range(proposals)],
        axis=1,
    )
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4, rtol=0)
    ref_confidence = reference.confidence(ref_hidden, anchor, drafts)
    np.testing.assert_allclose(np.array(confidence), np.array(ref_confidence), atol=1e-5, rtol=0)

    weights = drafters.published_float64(replica)
    embed = np.array(trunk.model.model.embed_tokens.weight).astype(np.float64)
    head = np.array(trunk.model.lm_head.weight).astype(np.float64)
    independent = np.concatenate(drafters.silenced_taps(trunk, tokens[:, :PROMPT], ids), axis=-1)
    for row in range(2):
        h = drafters.dflash_hidden(weights, config, independent[row], np.array(block[row]), embed)
        h = h if dflash["sample_from_anchor"] else h[1:]
        prev = np.concatenate([[int(anchor[row])], np.array(drafts[row, :-1])])
        logits, conf = drafters.dspark_step(weights, h, head, prev)
        np.testing.assert_allclose(np.array(ours[row]), logits, atol=1e-4, rtol=0)
        np.testing.assert_allclose(np.array(confidence[row]), conf, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c, t: c["dflash_config"].pop("block_size"), "dflash_config.block_size is missing"),
        (lambda c, t: c["dflash_config"].update(markov_head_type="mlp"), "markov_head_type must be vanilla"),
        (lambda c, t: t.pop("confidence_head.proj.bias"), "tensor confidence_head.proj.bias missing"),
        (
            lambda c, t: c["dflash_config"].update(enable_confidence_head=False),
            "tensor confidence_head.proj.bias unexpected",
        ),
        (lambda c, t: c.update(model_type="deepseek_v4_dspark"), "not a generic DSpark drafter"),
    ],
)
def test_dspark_misfit_is_one_line_naming_the_field(tmp_path, edit, message):
    config = drafters.dspark_config(VOCAB, [0, 2], TRUNK_LAYERS)
    tensors = drafters.dspark_tensors(config)
    edit(config, tensors)
    with pytest.raises(MtplxError, match=message) as err:
        load_dspark(drafters.write_dflash(tmp_path / "d", config, tensors))
    assert "\n" not in str(err.value)
