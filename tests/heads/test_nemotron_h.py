"""Nemotron-H's MTP module (``mtplx.heads.nemotron_h``) on a Nemotron-H trunk, end to end.

One tiny random-weight replica in the published layout (``support.nemotron``: Mamba2, attention,
MLP and MoE blocks, per-expert HF tensors, the MTP module ``*E`` under ``mtp.layers.{j}``) whose
head predicts the trunk's bigram part by construction, so drafts are kept and rejected. From it:
the trunk and head as published (``Engine.load`` of the HF directory), and what the community
publishes: a 4-bit trunk made by ``mlx_lm.convert`` (head stripped) beside a ``nemotron_h_mtp``
drafter made by mlx-vlm's own splitter (``mlx_vlm.split_mtp``, offline).

The layer's math is checked against a NumPy float64 reference written from vLLM's
``nemotron_h_mtp.py`` (the fusion on the first block, embedding first, no position-0 mask,
``final_layernorm`` on the last block; blocks ``x + mixer(norm(x))``, attention without rope,
ReLU^2 experts with sigmoid routing and a shared expert) with a negative control per convention;
decoding is checked token for token against AR, one row on its own caches, one row through the
engine and rows in a batch, with a negative control that leaves the Mamba2 SSM state unrolled;
sampled decoding against the float64 enumeration of AR (chi-square, with the committed-rejected-
draft control); an 8-bit drafter and ``mtplx convert``'s 4-bit model with the head kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.heads import load_head
from mtplx.heads.nemotron_h import NemotronHMTPHead, mtp_pattern
from mtplx.sampling import SamplerConfig
from mtplx.trunk import batch_cache, compat, recurrent_capture
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import nemotron_h
from support import decoding as decode
from support.decoding import assert_mtp_equals_ar_with_drafts_kept, mtp_decode, take_steps
from support.exactness import (
    FALSE_FAILURE_RATE,
    exact_ar_joint,
    loop_p_value,
    plant_commit_rejected_draft,
    sample_counts,
)
from support.models import randomize, scale_outputs
from support.nemotron import nemotron_h_checkpoint, tiny_nemotron_h
from support.numpy_heads import causal_mask, gqa_attention, read_tensors, rms
from support.seeds import SEEDS, resolve

REFERENCE_LAYOUTS = ("nemotron_h",)
GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = [[5, 9, 2, 11, 7], [3, 3, 8, 40, 41, 17], [12, 13, 4, 4, 9, 10, 2], [60, 20, 33]]
LENGTH = 7
DRAFTS = [5, 11]  # teacher-forced d_1, d_2 of the chain test
_req = GenerationRequest.from_kwargs


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> dict:
    from mlx_lm import convert
    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("nemotron")
    src = root / "Nemotron-H-Tiny"
    tiny = nemotron_h_checkpoint(src)
    trunk = root / "Nemotron-H-Tiny-4bit"
    convert(str(src), str(trunk), quantize=True, q_group_size=32, q_bits=4)
    drafter = Path(split_mtp(str(src), str(root / "Nemotron-H-Tiny-MTP-bf16")))
    int8 = Path(split_mtp(str(src), str(root / "Nemotron-H-Tiny-MTP-8bit"), q_bits=8, q_group_size=32))
    return {"src": src, "tiny": tiny, "trunk": trunk, "drafter": drafter, "8bit": int8}


@pytest.fixture(scope="module")
def engine(replica) -> Engine:
    return Engine.load(str(replica["src"]), mtp=True, depth=2)


@pytest.fixture(scope="module")
def random_replica(tmp_path_factory):
    """(config, tensors, head): a replica with every weight random (no predictive construction,
    which zeroes the hidden half of ``eh_proj``), loaded as the engine loads it."""
    tiny = nemotron_h_checkpoint(tmp_path_factory.mktemp("nemotron_random") / "r", context_strength=None)
    head = Engine.load(str(tiny.path), mtp=True).head
    return tiny.config, read_tensors(tiny.path), head


# --------------------------------------------------------------------------- float64 reference


def relu2(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0.0) ** 2


def moe(x: np.ndarray, t: dict, p: str, cfg: dict, *, shared: bool = True) -> np.ndarray:
    """Nemotron-H's MoE mixer: sigmoid router, top ``num_experts_per_tok`` by score + correction
    bias, weighted by the uncorrected scores (normalised), ReLU^2 experts ``up -> down``, plus the
    shared expert."""
    scores = 1.0 / (1.0 + np.exp(-(x @ t[p + "gate.weight"].T)))
    k = cfg["num_experts_per_tok"]
    chosen = np.argsort(-(scores + t[p + "gate.e_score_correction_bias"]), axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, chosen, -1)
    weights = weights / weights.sum(-1, keepdims=True) * cfg["routed_scaling_factor"]
    out = np.zeros_like(x)
    for row in range(x.shape[0]):
        for e, w in zip(chosen[row], weights[row]):
            up, down = t[f"{p}experts.{e}.up_proj.weight"], t[f"{p}experts.{e}.down_proj.weight"]
            out[row] += w * (relu2(x[row] @ up.T) @ down.T)
    if shared:
        out += (
            relu2(x @ t[p + "shared_experts.up_proj.weight"].T) @ t[p + "shared_experts.down_proj.weight"].T
        )
    return out


def attention(x: np.ndarray, t: dict, p: str, cfg: dict) -> np.ndarray:
    """GQA without rope (Nemotron-H's attention has no positional encoding), causal."""
    T, nh, nkv, hd = len(x), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (x @ t[p + "q_proj.weight"].T).reshape(T, nh, hd)
    k = (x @ t[p + "k_proj.weight"].T).reshape(T, nkv, hd)
    v = (x @ t[p + "v_proj.weight"].T).reshape(T, nkv, hd)
    return gqa_attention(q, k, v, hd**-0.5, causal_mask(T)) @ t[p + "o_proj.weight"].T


def mtp_layer(
    t,
    cfg,
    hidden,
    tokens,
    *,
    embedding_first=True,
    mask_first=False,
    final_norm=True,
    shared=True,
    hnorm=True,
):
    """The MTP module in float64 -> (before ``final_layernorm``, after it, logits [T, vocab])."""
    eps = cfg["layer_norm_epsilon"]
    e = t["backbone.embeddings.weight"][tokens]
    if mask_first:
        e = np.concatenate([np.zeros_like(e[:1]), e[1:]])
    h = rms(hidden, t["mtp.layers.0.hnorm.weight"], eps) if hnorm else hidden
    parts = [rms(e, t["mtp.layers.0.enorm.weight"], eps), h]
    x = np.concatenate(parts if embedding_first else parts[::-1], -1) @ t["mtp.layers.0.eh_proj.weight"].T
    for j, kind in enumerate(mtp_pattern(cfg)):
        p = f"mtp.layers.{j}."
        a = rms(x, t[p + "norm.weight"], eps)
        x = x + (
            attention(a, t, p + "mixer.", cfg) if kind == "*" else moe(a, t, p + "mixer.", cfg, shared=shared)
        )
    last = f"mtp.layers.{len(mtp_pattern(cfg)) - 1}.final_layernorm.weight"
    out = rms(x, t[last], eps) if final_norm else x
    return x, out, out @ t["lm_head.weight"].T


def head_logits(head, hidden: np.ndarray, tokens: list[int]) -> np.ndarray:
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), head.make_cache())
    return np.asarray(head.logits(out)[0], dtype=np.float64)


@pytest.mark.parametrize("seed", SEEDS)
def test_head_logits_match_the_float64_reference_at_every_position(random_replica, seed):
    cfg, t, head = random_replica
    assert isinstance(head, NemotronHMTPHead) and [b.block_type for b in head.layers] == ["*", "E"]
    drawn = resolve(seed)
    rng = np.random.default_rng(drawn)
    tokens = [int(x) for x in rng.integers(0, cfg["vocab_size"], size=LENGTH)]
    hidden = rng.standard_normal((LENGTH, cfg["hidden_size"]))
    got, want = head_logits(head, hidden, tokens), mtp_layer(t, cfg, hidden, tokens)[2]
    scale = np.abs(want).max()
    assert (np.abs(got - want).max(-1) < 1e-4 * scale).all(), drawn
    for variant in (
        {"embedding_first": False},
        {"mask_first": True},
        {"final_norm": False},
        {"shared": False},
        {"hnorm": False},
    ):
        other = mtp_layer(t, cfg, hidden, tokens, **variant)[2]
        assert np.abs(got - other).max() > 1e-2 * scale, (drawn, variant)


def test_the_draft_chain_feeds_back_the_normed_output(random_replica):
    """Steps 1 and 2 read the previous step's output after ``final_layernorm`` (mlx-vlm's drafter
    returns that state for both uses; vLLM's MTP model returns it). Negative control: the state
    before the norm."""
    cfg, t, head = random_replica
    rng = np.random.default_rng(7)
    tokens = [int(x) for x in rng.integers(0, cfg["vocab_size"], size=LENGTH)]
    hidden = rng.standard_normal((LENGTH, cfg["hidden_size"]))
    cache = head.make_cache()
    out = head(mx.array(hidden[None].astype(np.float32)), mx.array([tokens]), cache, step=0)
    got = []
    for s in range(1, 3):
        out = head(head.chain_input(out), mx.array([[DRAFTS[s - 1]]]), cache, step=s)
        got.append(np.asarray(head.logits(out, step=s)[0, -1], dtype=np.float64))

    def chain(which: int) -> list[np.ndarray]:
        hs, toks, steps = list(hidden), list(tokens), []
        prev = mtp_layer(t, cfg, np.array(hs), np.array(toks))
        for s in range(1, 3):
            hs.append(prev[which][-1])
            toks.append(DRAFTS[s - 1])
            prev = mtp_layer(t, cfg, np.array(hs), np.array(toks))
            steps.append(prev[2][-1])
        return steps

    want, wrong = chain(1), chain(0)
    for g, w, x in zip(got, want, wrong):
        assert np.abs(g - w).max() < 1e-4 * np.abs(w).max()
        assert np.abs(g - x).max() > 1e-2 * np.abs(w).max()


# --------------------------------------------------------------------------- decoding


def _ar(engine: Engine, prompt: list[int], n: int = 24) -> list[int]:
    return engine.generate(prompt, _req(max_tokens=n, temperature=0.0, draft="none")).token_ids


def _kept_and_rejected(stats) -> tuple[int, int]:
    made = sum(stats.drafted_per_position)
    kept = round(sum(a * d for a, d in zip(stats.acceptance_per_position, stats.drafted_per_position)))
    return kept, made - kept


@pytest.mark.parametrize("depth", [1, 2])
def test_greedy_mtp_equals_ar_with_drafts_kept_and_rejected(engine, depth):
    """One row through the engine (a batch of one) and one row on its own caches (the rollback of
    ``trunk.rollback``): the AR tokens, with drafts both kept and rejected."""
    kept = rejected = own_kept = own_rejected = 0
    for prompt in PROMPTS:
        ar = _ar(engine, prompt)
        out = engine.generate(prompt, _req(max_tokens=24, temperature=0.0, draft="head", depth=depth))
        assert out.token_ids == ar, (prompt, depth)
        k, r = _kept_and_rejected(out.stats)
        kept, rejected = kept + k, rejected + r
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        own, steps = take_steps(
            mtp_decode(engine.trunk, engine.head, prompt, settings, mx.random.key(0)), len(ar)
        )
        assert own[: len(ar)] == ar, (prompt, depth)
        own_kept += sum(s.num_accepted for s in steps if s.num_drafted)
        own_rejected += sum(s.num_drafted - s.num_accepted for s in steps if s.num_drafted)
    assert kept > 0 and rejected > 0, (kept, rejected)
    assert own_kept > 0 and own_rejected > 0, (own_kept, own_rejected)


def test_rows_in_a_batch_equal_ar(engine):
    ar = [_ar(engine, p) for p in PROMPTS]
    requests = [_req(max_tokens=24, temperature=0.0, draft="head", depth=2) for _ in PROMPTS]
    batched = engine.generate_batch(PROMPTS, requests, max_rows=3, draft_policy="fixed")
    assert [b.token_ids for b in batched] == ar
    rejected = sum(_kept_and_rejected(b.stats)[1] for b in batched)
    assert rejected > 0 and sum(_kept_and_rejected(b.stats)[0] for b in batched) > 0


def _skip_ssm_rollback(monkeypatch) -> None:
    """Both commit paths roll the conv state back but leave the SSM state as the block left it."""
    single, batched = recurrent_capture.RecurrentRecord.commit, batch_cache._RecurrentBlock.commit

    def single_without(self, num_keep):
        final = self.states[-1]
        single(self, num_keep)
        self.cache[compat.STATE_SLOT] = final

    def batched_without(self, num_keep, kernel_rows):
        final = self.states[-1]
        batched(self, num_keep, kernel_rows)
        self.cache[compat.STATE_SLOT] = final

    monkeypatch.setattr(recurrent_capture.RecurrentRecord, "commit", single_without)
    monkeypatch.setattr(batch_cache._RecurrentBlock, "commit", batched_without)


def test_negative_control_skipping_the_ssm_rollback_breaks_exactness(engine, monkeypatch):
    ar = [_ar(engine, p) for p in PROMPTS]
    _skip_ssm_rollback(monkeypatch)
    requests = [_req(max_tokens=24, temperature=0.0, draft="head", depth=2) for _ in PROMPTS]
    batched = [
        b.token_ids for b in engine.generate_batch(PROMPTS, requests, max_rows=3, draft_policy="fixed")
    ]
    alone = [engine.generate(p, r).token_ids for p, r in zip(PROMPTS, requests)]
    assert batched != ar and alone != ar


# --------------------------------------------------------------------------- the split drafter


def test_misfits_are_one_line_errors(replica, tmp_path):
    """A config declaring two MTP steps (the layout has one module), and a drafter whose source
    trunk has another block pattern, are each refused in one line naming the problem."""
    import shutil

    from mtplx.errors import MtplxError

    two = tmp_path / "two-steps"
    shutil.copytree(replica["src"], two)
    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(MtplxError, match="declares 2 Nemotron-H MTP steps") as e:
        Engine.load(str(two), mtp=True)
    assert "\n" not in str(e.value)
    other = tmp_path / "other-MTP-bf16"
    shutil.copytree(replica["drafter"], other)
    drafter = json.loads((other / "config.json").read_text())
    drafter["text_config"]["hybrid_override_pattern"] = "M*-EE"
    (other / "config.json").write_text(json.dumps(drafter))
    with pytest.raises(MtplxError, match="does not fit this model: hybrid_override_pattern") as e:
        Engine.load(str(replica["trunk"]), head=str(other))
    assert "\n" not in str(e.value)


def test_the_splitter_wrote_the_module_without_mtp_and_the_trunk_is_stripped(replica):
    from mtplx.heads.weights import weight_index

    config = json.loads((replica["drafter"] / "config.json").read_text())
    assert config["model_type"] == "nemotron_h_mtp"
    names = set(weight_index(replica["drafter"]))
    assert {
        "layers.0.eh_proj.weight",
        "layers.1.final_layernorm.weight",
        "layers.1.mixer.switch_mlp.fc1.weight",
    } <= names
    assert not [k for k in names if k.startswith("mtp.") or ".experts." in k]
    assert not [k for k in weight_index(replica["trunk"]) if "mtp" in k]


def test_the_drafter_is_found_beside_the_4bit_trunk_equals_the_own_head_and_is_exact(replica):
    engine = Engine.load(str(replica["trunk"]))
    head = engine.head
    assert isinstance(head, NemotronHMTPHead) and head.default_depth == 1  # block_size 2
    config = json.loads((replica["src"] / "config.json").read_text())
    own = load_head(replica["src"], engine.trunk, config)
    hidden = engine.trunk(mx.array([PROMPTS[0]])).hidden_post_norm
    nxt = mx.array([PROMPTS[0][1:] + [7]])
    split_out = head.logits(head(hidden, nxt, head.make_cache()))
    own_out = own.logits(own(hidden, nxt, own.make_cache()))
    assert mx.allclose(split_out, own_out, atol=1e-5).item()
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, head, PROMPTS[:2], 16)


# --------------------------------------------------------------------------- sampled distribution

CHI_VOCAB = 5


def chi_pair() -> tuple[Trunk, NemotronHMTPHead]:
    """A 5-token Nemotron-H trunk with peaked, context-dependent distributions (embeddings x8,
    the Mamba2 output x4, logits x3) and a random ``*E`` MTP module beside it."""
    model = tiny_nemotron_h(CHI_VOCAB, seed=3)
    model.backbone.embeddings.weight = model.backbone.embeddings.weight * 8
    scale_outputs(model, 4.0, ("out_proj.weight",))
    model.lm_head.weight = model.lm_head.weight * 3
    trunk = Trunk(model)
    blocks = [nemotron_h.NemotronHBlock(model.args, char) for char in "*E"]
    head = NemotronHMTPHead(blocks, model.args.hidden_size, eps=1e-5, key_prefix="mtp.", trunk=trunk)
    randomize(head, 5)
    return trunk, head


def test_sampled_mtp_matches_the_exact_ar_distribution():
    """Depth 2 at temperature 1: the first three tokens' joint (and each marginal) against the
    float64 enumeration of AR sampling. Measured on this pair: the loop that commits the rejected
    draft fails at p ~ 1e-135 from 300 samples, and at p < 3e-30 with the control's 100 (seeds
    1000, 2000, 3000; 2026-12-07)."""
    trunk, head = chi_pair()
    cfg = SamplerConfig(temperature=1.0)
    expected = exact_ar_joint(trunk, cfg, CHI_VOCAB)
    seed0 = int.from_bytes(os.urandom(4), "little")
    p = loop_p_value(sample_counts(trunk, head, cfg, 2, 150, CHI_VOCAB, seed0), expected)
    assert p > FALSE_FAILURE_RATE, f"p={p:.3g} (seed0={seed0})"


def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(monkeypatch):
    plant_commit_rejected_draft(monkeypatch)
    trunk, head = chi_pair()
    cfg = SamplerConfig(temperature=1.0)
    expected = exact_ar_joint(trunk, cfg, CHI_VOCAB)
    assert (
        loop_p_value(sample_counts(trunk, head, cfg, 2, 100, CHI_VOCAB, 1234), expected) < FALSE_FAILURE_RATE
    )


# --------------------------------------------------------------------------- quantized heads


def _exact_with_drafts_kept(engine: Engine, head) -> None:
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, head, PROMPTS[:2], 16)


def test_an_8bit_drafter_beside_the_4bit_trunk_loads_quantized_and_is_exact(replica):
    engine = Engine.load(str(replica["trunk"]), head=str(replica["8bit"]))
    kinds = {type(m).__name__ for _, m in engine.head.named_modules()}
    assert {"QuantizedLinear", "QuantizedSwitchLinear"} <= kinds, kinds
    _exact_with_drafts_kept(engine, engine.head)


def test_mtplx_convert_keeps_the_head_beside_a_4bit_trunk(replica, tmp_path):
    from mtplx.checkpoints.convert_hf import convert_hf

    out = convert_hf(replica["src"], tmp_path / "converted", q_bits=4, q_group_size=32)
    engine = Engine.load(str(out), mtp=True)
    assert isinstance(engine.head, NemotronHMTPHead)
    _exact_with_drafts_kept(engine, engine.head)


def test_inspect_counts_the_pattern_layers_and_the_mixer_attention(replica):
    """Nemotron-H's config states its layers as a pattern (no ``num_hidden_layers``): inspect counts
    them, and the head's ``mixer.{q,k,v,o}_proj`` are its attention, not dense layers."""
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    config = json.loads((replica["src"] / "config.json").read_text())
    assert "num_hidden_layers" not in config
    info = inspect_model(str(replica["src"]))
    assert info["num_hidden_layers"] == len(config["hybrid_override_pattern"])
    assert f"{len(config['hybrid_override_pattern'])} layers" in format_inspection(info)
    assert set(info["mtp"]["precision"]["groups"]) == {"projection", "attention", "dense", "routed_experts"}
