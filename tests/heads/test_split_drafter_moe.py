"""A split MTP drafter of a Qwen3-Next (MoE) checkpoint: per-expert HF tensors stacked by mlx-vlm's
``Qwen3NextMTPSplitter``, the drafter's MoE layer built like the trunk's attention layer.

The replica: ``support.models.tiny_qwen3_next``'s architecture (2 layers, gated-delta + attention,
2 experts and a shared expert, hidden 64) with ``support.checkpoints``' randomized weights, written
as the Hugging Face checkpoint is (the reverse of mlx-lm 0.32.2's ``qwen3_next`` sanitize:
per-expert ``mlp.experts.{e}.*``, RMSNorms as offsets from 1 but the gated-delta one, torch conv
layout) with an MTP layer under ``mtp.`` that predicts the trunk by construction. The trunk is
made by ``mlx_lm.convert`` (4-bit, head stripped), the drafter by ``mlx_vlm.split_mtp``.
"""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.heads import load_head
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_next
from support import checkpoints, models
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
from support.tokenizer import word_level

GREEDY = SamplerConfig(temperature=0.0)
PROMPT = [3, 17, 42, 5, 60, 9, 11, 2, 33, 8]
CONTEXT_STRENGTH = 0.3
HF_OFFSET_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _hf(name: str, v: mx.array) -> dict[str, mx.array]:
    """One mlx-lm qwen3_next parameter as the HF checkpoint stores it."""
    if ".switch_mlp." in name:  # stacked [E, out, in] -> experts.{e}
        return {name.replace(".switch_mlp.", f".experts.{e}."): v[e] for e in range(v.shape[0])}
    if "conv1d.weight" in name:
        v = v.moveaxis(2, 1)  # mlx [C, K, 1] -> torch [C, 1, K]
    if (
        name.endswith(HF_OFFSET_NORMS)
        or name in ("model.norm.weight", "norm.weight")
        or "pre_fc_norm" in name
    ):
        v = v - 1.0  # HF Qwen3-Next RMSNorm computes x * (1 + w)
    return {name: v}


def qwen3_next_checkpoint(path: Path) -> dict:
    """The replica's HF directory (config, tensors, tokenizer); returns its config."""
    config = {k: v for k, v in vars(models.tiny_qwen3_next().args).items() if v is not None}
    config["architectures"] = ["Qwen3NextForCausalLM"]
    args, model = checkpoints._random_replica(qwen3_next, config, 0, CONTEXT_STRENGTH)
    head = nn.Module()
    h = args.hidden_size
    head.fc = nn.Linear(2 * h, h, bias=False)
    head.pre_fc_norm_embedding, head.pre_fc_norm_hidden, head.norm = (
        nn.RMSNorm(h),
        nn.RMSNorm(h),
        nn.RMSNorm(h),
    )
    head.layers = [qwen3_next.Qwen3NextDecoderLayer(args, layer_idx=args.full_attention_interval - 1)]
    models.randomize(head, 1)
    models.scale_outputs(head, CONTEXT_STRENGTH)
    # Predictive by construction: reads the next token's embedding alone, ends in the trunk's norm.
    head.fc.weight = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)
    head.pre_fc_norm_embedding.weight = mx.ones((h,))
    head.norm.weight = model.model.norm.weight
    tensors: dict[str, mx.array] = {}
    for name, v in tree_flatten(model.parameters()):
        tensors.update(_hf(name, v))
    for name, v in tree_flatten(head.parameters()):
        tensors.update({f"mtp.{k}": t for k, t in _hf(name, v).items()})
    checkpoints.write_checkpoint(path, tensors, config)
    word_level(path)
    return config


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import convert
    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("next")
    src = root / "Qwen3-Next-Tiny"
    qwen3_next_checkpoint(src)
    trunk = root / "Qwen3-Next-Tiny-4bit"
    convert(str(src), str(trunk), quantize=True, q_group_size=64, q_bits=4)
    drafter = split_mtp(str(src), str(root / "Qwen3-Next-Tiny-MTP-bf16"))
    return {"src": src, "trunk": trunk, "drafter": Path(drafter)}


def test_the_splitter_stacked_the_experts(replica):
    from mtplx.heads.weights import weight_index

    names = set(weight_index(replica["drafter"]))
    assert (
        "layers.0.mlp.switch_mlp.up_proj.weight" in names
        and "layers.0.mlp.shared_expert_gate.weight" in names
    )
    assert not [k for k in names if ".experts." in k or k.startswith("mtp.")]
    assert not [k for k in weight_index(replica["trunk"]) if "mtp" in k]


def test_the_moe_drafter_is_found_equals_the_own_head_and_drafts_exactly(replica):
    engine = Engine.load(str(replica["trunk"]))
    head = engine.head
    assert head is not None and "switch_mlp" in dict(head.layers[0].mlp.named_modules())
    own = load_head(replica["src"], engine.trunk, json.loads((replica["src"] / "config.json").read_text()))
    hidden = engine.trunk(mx.array([PROMPT])).hidden_post_norm
    nxt = mx.array([PROMPT[1:] + [7]])
    split_out = head.logits(head(hidden, nxt, head.make_cache()))
    own_out = own.logits(own(hidden, nxt, own.make_cache()))
    assert mx.allclose(split_out, own_out, atol=1e-5).item()
    ar = take_tokens(
        decode.ar_decode(engine.trunk, PROMPT, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 16
    )
    for depth in (1, 2):
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(mtp_decode(engine.trunk, head, PROMPT, settings, mx.random.key(0)), 16)
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth
