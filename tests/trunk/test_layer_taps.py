"""Trunk taps for several layers (`mtplx.trunk.layer_taps`, `Trunk.tap_layers`): on every trunk
family mtplx hosts (plain llama, gated-delta hybrid Qwen3.5, MoE gated-delta Qwen3-Next,
Nemotron-H), for a prefill chunk and a verify block on the same cache.

The oracle is independent of the layer tap: layer ``i``'s output equals the final norm's input
(the final-norm tap, `compat.tap_final_norm`) of the same model with every later layer's output
projections zeroed, since a pre-norm residual layer whose branch writes zeros is the identity.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from support.models import tiny_llama, tiny_qwen3_5, tiny_qwen3_next
from support.nemotron import tiny_nemotron_h
from support.sync_counter import counting_syncs

FAMILIES = {
    "llama": lambda: tiny_llama(),
    "qwen3_5": lambda: tiny_qwen3_5(),
    "qwen3_next": lambda: tiny_qwen3_next(),
    "nemotron_h": lambda: tiny_nemotron_h(vocab_size=64),
}
_BRANCH_OUTPUTS = ("o_proj", "down_proj", "out_proj", "fc2")  # fc2: a SwitchMLP's experts


def _prefill_and_verify(trunk: Trunk, tokens: mx.array) -> list:
    """A prefill chunk of 5 tokens then a verify block of 3 on the same cache: both outputs."""
    cache = trunk.make_cache()
    first = trunk(tokens[:, :5], cache)
    mx.eval(first.logits)
    second = trunk(tokens[:, 5:], cache)
    return [first, second]


def _silence_layers_after(trunk: Trunk, index: int) -> None:
    """Zero the output projections of every decoder layer after ``index`` (identity layers)."""
    for later in trunk.layers[index + 1 :]:
        zeroed = [
            (n, mx.zeros_like(v))
            for n, v in tree_flatten(later.parameters())
            if n.split(".")[-2] in _BRANCH_OUTPUTS
        ]
        assert zeroed, "a later layer has no output projection to zero"
        later.update(tree_unflatten(zeroed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layer_taps_equal_truncated_trunk(family):
    trunk = Trunk(FAMILIES[family]())
    n_layers = len(trunk.layers)
    ids = sorted({0, n_layers // 2, n_layers - 1}, reverse=True)  # out of order: returned as named
    tokens = mx.array(np.random.default_rng(7).integers(0, 64, (2, 8)), dtype=mx.int32)
    trunk.tap_layers(ids)
    tapped = _prefill_and_verify(trunk, tokens)
    trunk.tap_layers(None)
    for out in tapped:
        assert len(out.layer_hidden) == len(ids)
        # the last layer's tap is the final norm's input, captured by the other mechanism
        np.testing.assert_allclose(np.array(out.layer_hidden[0]), np.array(out.hidden_pre_norm), atol=1e-5)
    saved = tree_flatten(trunk.model.parameters())
    for k, index in enumerate(ids):
        _silence_layers_after(trunk, index)
        reference = _prefill_and_verify(trunk, tokens)
        trunk.model.update(tree_unflatten(saved))
        for out, ref in zip(tapped, reference):
            assert ref.layer_hidden is None
            np.testing.assert_allclose(
                np.array(out.layer_hidden[k]),
                np.array(ref.hidden_pre_norm),
                atol=1e-4,
                err_msg=f"layer {index}",
            )


def test_untapped_trunk_is_mlx_lms_own_forward():
    """No cost when nothing asks: no layer's class is touched, nothing is recorded, and a forward
    makes the same host syncs tapped or not (one: the eval)."""
    trunk = Trunk(tiny_qwen3_5())
    classes = [type(layer) for layer in trunk.layers]
    tokens = mx.array([[1, 2, 3, 4]], dtype=mx.int32)
    syncs = []
    for ids in (None, (0, 2), None):
        trunk.tap_layers(ids)
        with counting_syncs() as counter:
            out = trunk(tokens, trunk.make_cache())
            mx.eval(out.logits, out.layer_hidden or [])
        syncs.append(counter.syncs)
        if ids is None:
            assert out.layer_hidden is None
            assert [type(layer) for layer in trunk.layers] == classes
            assert trunk.tapped_layers == ()
        else:
            assert [type(layer) is cls for layer, cls in zip(trunk.layers, classes)] == [
                False,
                True,
                False,
                True,
            ]
            assert trunk._layer_taps._captured == {}  # taken with the output, not kept
    assert syncs == [1, 1, 1]


def test_layer_taps_refuse_a_layer_out_of_range():
    trunk = Trunk(tiny_llama())
    with pytest.raises(MtplxError, match="layer 5 out of range"):
        trunk.tap_layers([0, 5])
    assert trunk.tapped_layers == ()
    assert all(not type(layer).__name__.startswith("Tapped") for layer in trunk.layers)
