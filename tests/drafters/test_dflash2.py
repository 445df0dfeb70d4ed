"""DFlash2 drafters (`mtplx.drafters.dflash2`) on a tiny replica as published (``architectures``
DFlash2DraftModel, sizes in ``dflash_config``, selector codebooks without ``.weight``).

mtplx's logits at every draft position and its selector scores (logit + edge on each position's
top-k, given the token before) must equal mlx-vlm 0.7.10's ``DFlash2DraftModel`` (its own
``CandidateSelector.select``, its scores recorded) and a float64 NumPy oracle within 1e-4.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.drafters.dflash2 import dflash2_block, dflash2_scores, load_dflash2
from mtplx.drafters.dspark import previous_tokens
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, seeds
from support.seeds import SEEDS

VOCAB, TRUNK_LAYERS, PROMPT = 64, 4, 6


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    config = drafters.dflash2_config(VOCAB, [0, 2], TRUNK_LAYERS)
    return drafters.write_dflash(
        tmp_path_factory.mktemp("dflash2"), config, drafters.dflash2_tensors(config, seed=6)
    )


class _Recorder:
    """mlx-vlm's selector asks its sampler for ``sample_proposal(scores)``: record, then argmax."""

    def __init__(self):
        self.scores = []

    def __call__(self, logits):
        return mx.argmax(logits, axis=-1)

    def sample_proposal(self, scores):
        self.scores.append(scores)
        return mx.argmax(scores, axis=-1)


def _mlx_vlm_drafter(path, trunk):
    from mlx_vlm.speculative.drafters.dflash2 import DFlash2DraftModel
    from mlx_vlm.speculative.drafters.dflash2.config import DFlash2Config
    from mlx_vlm.speculative.drafters.qwen3_dflash import DFlashDraftModel

    model = DFlash2DraftModel(DFlash2Config.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    model.set_dtype(mx.float32)
    DFlashDraftModel.bind(model, trunk.model)  # DFlash2's own bind also asks for mlx-vlm's rollback API
    return model


@pytest.mark.parametrize("seed", [SEEDS[0], SEEDS[2]])
def test_dflash2_logits_and_selector_scores_equal_mlx_vlm_and_the_float64_oracle(replica, seed):
    seed = seeds.resolve(seed)
    config = json.loads((replica / "config.json").read_text())
    dflash = config["dflash_config"]
    top_k, mask = dflash["selector_top_k"], dflash["mask_token_id"]
    trunk = drafters.tiny_target(seed, TRUNK_LAYERS, VOCAB)
    tokens = mx.array(np.random.default_rng(seed).integers(0, VOCAB - 1, (2, PROMPT + 1)), dtype=mx.int32)
    drafter = load_dflash2(replica)
    drafter.set_dtype(mx.float32)
    trunk.tap_layers(drafter.target_layer_ids)
    taps = trunk(tokens[:, :PROMPT], trunk.make_cache()).layer_hidden
    anchor = tokens[:, PROMPT]
    block = drafter.block_tokens(anchor, dflash["block_size"])
    hidden, logits = dflash2_block(drafter, block, taps, drafter.make_cache(), trunk.embed, trunk.lm_head)

    reference = _mlx_vlm_drafter(replica, trunk)
    ref_block = mx.concatenate(
        [anchor[:, None], mx.full((2, dflash["block_size"] - 1), mask, dtype=mx.int32)], axis=1
    )
    ref_hidden = reference._hidden(ref_block, mx.concatenate(list(taps), axis=-1), reference.make_cache())[
        :, 1:
    ]
    ref_logits = reference._logits(ref_hidden)
    np.testing.assert_allclose(np.array(logits), np.array(ref_logits), atol=1e-4, rtol=0)
    recorder = _Recorder()
    path = reference.candidate_selector.select(ref_hidden, ref_logits, anchor, recorder)
    scores = dflash2_scores(drafter, hidden, logits, previous_tokens(anchor, path))
    for p, recorded in enumerate(recorder.scores):
        candidates = mx.argpartition(ref_logits[:, p], -top_k, axis=-1)[:, -top_k:]
        ours = mx.take_along_axis(scores[:, p], candidates, axis=-1)
        np.testing.assert_allclose(np.array(ours), np.array(recorded), atol=1e-4, rtol=0)
    assert int(mx.sum(mx.isfinite(scores))) == 2 * path.shape[1] * top_k

    weights = drafters.published_float64(replica)
    embed = (
        np.array(trunk.model.model.embed_tokens.weight).astype(np.float64) * dflash["input_embedding_scale"]
    )
    head = np.array(trunk.model.lm_head.weight).astype(np.float64)
    independent = np.concatenate(
        drafters.silenced_taps(trunk, tokens[:, :PROMPT], dflash["target_layer_ids"]), axis=-1
    )
    for row in range(2):
        h = drafters.dflash_hidden(weights, config, independent[row], np.array(ref_block[row]), embed)[1:]
        oracle_logits = h @ head.T * dflash["output_multiplier"]
        np.testing.assert_allclose(np.array(logits[row]), oracle_logits, atol=1e-4, rtol=0)
        prev = np.concatenate([[int(anchor[row])], np.array(path[row, :-1])])
        oracle = drafters.dflash2_scores(weights, oracle_logits, h, prev, top_k)
        assert np.array_equal(np.isfinite(oracle), np.isfinite(np.array(scores[row])))
        finite = np.isfinite(oracle)
        np.testing.assert_allclose(np.array(scores[row])[finite], oracle[finite], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda c, t: c["dflash_config"].pop("conv_group_size"),
            "dflash_config.conv_group_size must be a positive integer",
        ),
        (lambda c, t: c["dflash_config"].update(conv_group_size=7), "hidden_size must be a multiple of"),
        (lambda c, t: c["dflash_config"].update(causal=True), "dflash_config.causal is not supported"),
        (lambda c, t: t.pop("layers.1.mlp_conv.base_kernel"), "tensor layers.1.mlp_conv.base_kernel missing"),
    ],
)
def test_dflash2_misfit_is_one_line_naming_the_field(tmp_path, edit, message):
    config = drafters.dflash2_config(VOCAB, [0, 2], TRUNK_LAYERS)
    tensors = drafters.dflash2_tensors(config)
    edit(config, tensors)
    with pytest.raises(MtplxError, match=message) as err:
        load_dflash2(drafters.write_dflash(tmp_path / "d", config, tensors))
    assert "\n" not in str(err.value)
