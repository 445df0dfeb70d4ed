"""The MiMo MTP layout: ``model.mtp_layers.{i}``.

    x = input_proj(concat([hidden_layernorm(hidden), token_layernorm(embed(next_token))], -1))
                                          # embedding zeroed at sequence position 0
                                          # HIDDEN FIRST: the reverse of Qwen3-Next / DeepSeek
    x = decoder block (Qwen2-style: input_layernorm, self_attn, post_attention_layernorm, mlp)
    out = final_layernorm(x)              # -> the trunk's lm_head; also what is chained

In the published checkpoints the block's tensors sit directly under
``model.mtp_layers.{i}.`` (``model.mtp_layers.0.self_attn.q_proj.weight``); some
re-exports nest them under ``mtp_block.`` (the serving code's module name). Both load.
Count: ``num_nextn_predict_layers``; draft step ``s`` uses module ``s % n`` (vLLM
``mimo_mtp.py``; see ``ModuleStackHead``); ``max_depth`` is None (modules cycle).

hidden_source default "pre_norm": MiMo's authors' own vLLM integration moves the
trunk's final norm out of the model forward (it is applied when computing logits),
so the hidden state handed to the MTP layer is the one *before* the final norm.
Third-party training code (FastMTP) feeds the post-norm state instead, so this is
disputed; measured acceptance decides (``hidden_source="post_norm"`` switches it).
"""

from __future__ import annotations

from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, ModuleStackHead, build_layer_like, model_args_of
from mtplx.heads.weights import HeadSource, MissingHeadError

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "mimo"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"
PREFIX = "model.mtp_layers."


class MiMoMTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.token_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.input_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.final_layernorm = nn.RMSNorm(hidden_size, eps=eps)


class MiMoMTPHead(ModuleStackHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    module_class = MiMoMTPModule
    own_keys = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")
    block_name = "mtp_block"  # the serving code's module name, which some re-exports nest the block under

    def __init__(self, *args: Any, nested_block: bool = False, **kwargs: Any):
        """``ModuleStackHead``'s arguments; ``nested_block``: the checkpoint spells the block
        ``mtp_block.*`` (quantization overrides are looked up under that spelling)."""
        super().__init__(*args, **kwargs)
        self.nested_block = nested_block

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.token_layernorm(embedded)
        x = m.input_proj(mx.concatenate([m.hidden_layernorm(hidden).astype(e.dtype), e], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        return m.final_layernorm

    # --- checkpoint naming ---------------------------------------------------------------
    def module_prefix(self, i: int) -> str:
        return f"{PREFIX}{i}."

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        return {k: v for k, v in tensors.items() if "rotary_emb.inv_freq" not in k}


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> MiMoMTPHead:
    """An unloaded head for the checkpoint's ``model.mtp_layers.{i}``, checked against what it ships."""
    present = sorted({int(k[len(PREFIX) :].split(".")[0]) for k in src.index if k.startswith(PREFIX)})
    if not present:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.mtp_layers.* tensors"
        )
    if present != list(range(num_layers)):
        raise MtplxError(
            f"{src.source}: config declares {num_layers} MTP layer(s), checkpoint has model.mtp_layers {present}"
        )
    args = model_args_of(src.trunk.model)
    return MiMoMTPHead(
        [build_layer_like(src.trunk.layers[-1], args, args.num_hidden_layers + i) for i in range(num_layers)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[len(src.trunk.layers) - 1] * num_layers,
        nested_block=any(k.startswith(f"{PREFIX}0.mtp_block.") for k in src.index),
    )
