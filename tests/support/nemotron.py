"""Tiny Nemotron-H replicas (mlx-lm 0.32.2 ``nemotron_h``: Mamba2 + attention + MLP + MoE blocks).

``nemotron_h_config`` is a Hugging Face config in the published spelling (``hybrid_override_pattern``
and ``mtp_hybrid_override_pattern`` strings, ``num_nextn_predict_layers`` 1); its default trunk
pattern ``M*-ME`` puts a cache-less MLP block between the second cache owner and the last, so the
cache list (M, *, M) does not line up with the layers (0, 1, 3). ``nemotron_h_checkpoint`` writes
the checkpoint as NVIDIA publishes it: ``backbone.*`` and ``lm_head.weight``, per-expert
``mixer.experts.{e}.{up,down}_proj`` (the reverse of mlx-lm's ``nemotron_h.sanitize``), the
torch conv layout ``[C, 1, K]``, and the MTP module under ``mtp.layers.{j}`` (vLLM
``nemotron_h_mtp.py``'s names: ``enorm`` / ``hnorm`` / ``eh_proj`` on block 0,
``final_layernorm`` on the last), written from modules built here, not through mtplx's head.
"""

from __future__ import annotations

from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import nemotron_h

from support.checkpoints import Tiny, write_checkpoint
from support.models import HIDDEN, ROLLBACK_VOCAB, VOCAB, randomize, scale_outputs
from support.tokenizer import word_level

TRUNK_PATTERN = "M*-ME"
MTP_PATTERN = "*E"
# Every projection that writes into the residual stream (Mamba2, attention, MLP, shared and routed experts).
OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "fc2.weight")


def nemotron_h_config(
    vocab_size: int = VOCAB, *, pattern: str = TRUNK_PATTERN, mtp_pattern: str = MTP_PATTERN
) -> dict:
    """A Nemotron-H config at hidden ``HIDDEN``: Mamba2 of 4 heads x 8 (2 groups, state 8, conv
    kernel 4), GQA attention 4 / 2 heads of 8 (no rope), ReLU^2 MLP of 64, MoE of 4 ReLU^2
    experts (2 per token, sigmoid routing) plus a shared expert; one MTP module of ``mtp_pattern``."""
    return {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "max_position_embeddings": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "attention_bias": False,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "mamba_proj_bias": False,
        "ssm_state_size": 8,
        "conv_kernel": 4,
        "n_groups": 2,
        "mlp_bias": False,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "hybrid_override_pattern": pattern,
        "moe_intermediate_size": HIDDEN,
        "moe_shared_expert_intermediate_size": HIDDEN,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 1,
        "mtp_hybrid_override_pattern": mtp_pattern,
        "tie_word_embeddings": False,
    }


def tiny_nemotron_h(vocab_size: int = ROLLBACK_VOCAB, *, seed: int = 0) -> nemotron_h.Model:
    """``nemotron_h_config``'s trunk with mlx-lm's initialisation after ``mx.random.seed(seed)``
    (the rollback tests' model)."""
    mx.random.seed(seed)
    model = nemotron_h.Model(nemotron_h.ModelArgs.from_dict(nemotron_h_config(vocab_size)))
    model.eval()
    mx.eval(model.parameters())
    return model


def _hf(params: dict[str, mx.array]) -> dict[str, mx.array]:
    """mlx-lm nemotron_h parameter names -> the HF checkpoint's (stacked experts split, torch conv)."""
    out: dict[str, mx.array] = {}
    for name, v in params.items():
        for mlx_name, hf in ((".switch_mlp.fc1.", "up_proj"), (".switch_mlp.fc2.", "down_proj")):
            if mlx_name in name:
                head, tail = name.split(mlx_name)
                out.update({f"{head}.experts.{e}.{hf}.{tail}": v[e] for e in range(v.shape[0])})
                break
        else:
            out[name] = v.moveaxis(2, 1) if "conv1d.weight" in name else v  # mlx [C, K, 1] -> torch [C, 1, K]
    return out


def mtp_module(args: nemotron_h.ModelArgs, pattern: str = MTP_PATTERN) -> nn.Module:
    """The MTP module as the checkpoint names it: ``layers.{j}`` blocks of ``pattern``, the fusion
    on block 0, ``final_layernorm`` on the last."""
    module = nn.Module()
    module.layers = [nemotron_h.NemotronHBlock(args, char) for char in pattern]
    first, last = module.layers[0], module.layers[-1]
    first.enorm, first.hnorm = nn.RMSNorm(args.hidden_size), nn.RMSNorm(args.hidden_size)
    first.eh_proj = nn.Linear(2 * args.hidden_size, args.hidden_size, bias=False)
    last.final_layernorm = nn.RMSNorm(args.hidden_size)
    return module


def nemotron_h_checkpoint(
    path: Path,
    *,
    seed: int = 0,
    head_seed: int | None = None,
    context_strength: float | None = 0.3,
    ship_mtp: bool = True,
) -> Tiny:
    """The replica's HF directory (config, ``model.safetensors``, a word-level tokenizer).

    With ``context_strength`` every residual-stream write is scaled by it and the embedding
    brought to RMS 1, so the trunk is mostly a bigram model; the MTP module then reads the next
    token's embedding alone (``eh_proj`` = [I, 0]) and ends in the trunk's final norm, so it
    predicts the trunk's bigram part and its drafts are often, not always, kept. ``head_seed``
    (default ``seed + 1``) draws the module's other weights."""
    config = nemotron_h_config()
    args = nemotron_h.ModelArgs.from_dict(config)
    model = nemotron_h.Model(args)
    randomize(model, seed)
    if context_strength is not None:
        scale_outputs(model, context_strength, OUTPUT_PROJECTIONS)
        model.backbone.embeddings.weight = model.backbone.embeddings.weight * HIDDEN**0.5
    tensors = _hf(dict(tree_flatten(model.parameters())))
    if ship_mtp:
        head = mtp_module(args)
        randomize(head, seed + 1 if head_seed is None else head_seed)
        if context_strength is not None:
            scale_outputs(head, context_strength, OUTPUT_PROJECTIONS)
            head.layers[0].eh_proj.weight = mx.concatenate(
                [mx.eye(HIDDEN), mx.zeros((HIDDEN, HIDDEN))], axis=1
            )
            head.layers[0].enorm.weight = mx.ones((HIDDEN,))
            head.layers[-1].final_layernorm.weight = model.backbone.norm_f.weight
        tensors.update({f"mtp.{k}": v for k, v in _hf(dict(tree_flatten(head.parameters()))).items()})
    tiny = write_checkpoint(path, tensors, config)
    word_level(path)
    return tiny
