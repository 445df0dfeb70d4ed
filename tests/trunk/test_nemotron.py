"""Nemotron-H as a trunk: its names (``backbone.embeddings`` / ``norm_f``), a cache list that skips
the MLP and MoE blocks, and the Mamba2 state rolled back per row in a batch.

The model is ``support.nemotron``'s (pattern ``M*-ME``: caches for layers 0, 1 and 3 only), with
mlx-lm's initialisation; single-row rollback runs in ``test_cache.py`` (``nemotron_h_hybrid``).
"""

from __future__ import annotations

import random

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.trunk import batch_cache, compat, compat_check, rollback
from mtplx.trunk.batch_cache import BatchCache, check_batchable
from mtplx.trunk.compat_nemotron import _check_structure, cache_layers, check_ssm
from mtplx.trunk.model import Trunk

import mlx.core as mx
import pytest
from mlx_lm.models import nemotron_h
from mlx_lm.models.cache import ArraysCache
from support.nemotron import tiny_nemotron_h


@pytest.fixture(scope="module")
def model():
    return tiny_nemotron_h()


def test_the_trunk_reads_nemotron_names_and_its_hidden_states(model):
    trunk = Trunk(model)
    tokens = mx.array([[3, 1, 4, 1, 5, 9]])
    out = trunk(tokens, trunk.make_cache())
    assert trunk.vocab_size == model.backbone.embeddings.weight.shape[0]
    assert mx.array_equal(trunk.embed(tokens), model.backbone.embeddings(tokens)).item()
    # The tap sits on norm_f: post = norm_f(pre), and the logits are the LM head of post.
    assert mx.allclose(out.hidden_post_norm, model.backbone.norm_f(out.hidden_pre_norm), atol=1e-6).item()
    assert mx.allclose(out.logits, model.lm_head(out.hidden_post_norm), atol=1e-5).item()
    assert mx.allclose(out.logits, model(tokens), atol=1e-5).item()
    assert mx.allclose(trunk.lm_head(out.hidden_post_norm), out.logits, atol=1e-5).item()


def test_cache_entries_belong_to_the_mamba2_and_attention_blocks(model):
    owners = cache_layers(model)
    assert [layer.block_type for layer in owners] == ["M", "*", "M"]
    assert owners[2] is model.layers[3]  # cache 2 is layer 3's: layer 2 is an MLP block
    cache = model.make_cache()
    assert rollback.check_rollback_support(cache, model) is None
    assert check_batchable(cache, model) is None
    # Read as layer i (the old rule), cache 2 would belong to the MLP block and be refused.
    assert not compat.is_supported_recurrent_layer(model.layers[2])
    assert compat.is_supported_recurrent_layer(model.layers[3])


def _prefilled(model, prompt):
    cache = model.make_cache()
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _batch_vs_alone(model, keep: list[int]) -> float:
    """Largest logit difference between a batch (prefill alone, join, two verify blocks of 4 with
    per-row keep, one more step) and each row run alone over the same kept tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 90) for _ in range(n)] for n in (7, 3, 5)]
    batch = BatchCache(model.make_cache(), model)
    batch.add_rows([_prefilled(model, p) for p in prompts])
    kept = [list(p) for p in prompts]
    for _ in range(2):
        blocks = [[rng.randrange(1, 90) for _ in range(4)] for _ in prompts]
        block = batch.begin_block(4)
        mx.eval(model(mx.array(blocks), cache=batch.layers))
        batch.commit_block(block, keep)
        for r, n in enumerate(keep):
            kept[r] += blocks[r][:n]
    nxt = model(mx.array([[21], [22], [23]]), cache=batch.layers)
    worst = 0.0
    for r, tokens in enumerate(kept):
        alone = model(mx.array([tokens + [21 + r]]))
        worst = max(worst, mx.abs(alone[0, -1] - nxt[r, 0]).max().item())
    return worst


def test_per_row_mamba2_rollback_matches_each_row_alone(model):
    keep = random.Random().sample([1, 2, 3, 4], 3)  # fresh every run: a distinct keep per row
    assert _batch_vs_alone(model, keep) < 1e-4, keep


def test_negative_control_a_batch_that_skips_the_ssm_rollback_is_caught(model, monkeypatch):
    """Every row keeps the SSM state of the whole block (conv rolled back): the comparison fails."""
    commit = batch_cache._RecurrentBlock.commit

    def without_ssm_rollback(self, num_keep, kernel_rows):
        final = self.states[-1]
        commit(self, num_keep, kernel_rows)
        self.cache[compat.STATE_SLOT] = final

    monkeypatch.setattr(batch_cache._RecurrentBlock, "commit", without_ssm_rollback)
    assert _batch_vs_alone(model, [1, 2, 3]) > 1e-3


def test_check_notices_a_changed_ssm_update(monkeypatch):
    def renamed(x, A_log, B, C, D, dt, dt_bias, state=None, time_step_limit=(0, 1), mask=None):
        return x, state

    assert check_ssm() == []
    assert "ssm_update takes" in check_ssm(update=renamed)[0]
    assert "is gone" in check_ssm(module_names=("mlx_lm.models.no_such_model",))[0]
    compat_check.check()  # the installed mlx-lm passes, Nemotron-H's contacts included
    # compat_check.check() runs compat_nemotron's probe: given the changed function, it says so.
    monkeypatch.setattr(compat_check, "check_ssm", lambda: check_ssm(update=renamed))
    with pytest.raises(MtplxError, match="ssm_update takes"):
        compat_check.check()


def test_check_notices_a_cache_list_that_lines_up_with_the_layers():
    """Negative control of the structural probe: a release whose cache list had one entry per
    layer (MLP blocks included) would break ``cache_layers``; the probe says so."""

    class PerLayer(nemotron_h.Model):
        def make_cache(self):
            return [ArraysCache(2) for _ in self.layers]

    class Renamed(nemotron_h.Model):
        def __init__(self, args):
            super().__init__(args)
            self.trunk = self.backbone
            del self.backbone

    assert _check_structure(nemotron_h) == []
    for model_cls, needle in ((PerLayer, "cache list"), (Renamed, "backbone")):
        fake = type(
            "FakeModule", (), {"__name__": "fake", "Model": model_cls, "ModelArgs": nemotron_h.ModelArgs}
        )
        assert needle in _check_structure(fake)[0]
