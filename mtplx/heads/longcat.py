"""The LongCat-Flash MTP layout: one MLA layer with a dense MLP under ``model.mtp.*``.

    e = enorm(embed(next_token))                   # not zeroed at position 0 (vLLM does not mask it)
    x = eh_proj(concat([e, hnorm(hidden)], -1))    # embedding FIRST
    x = block(x): x + MLA(input_layernorm(x)), then + dense MLP(post_attention_layernorm(.))
    out = model.mtp.norm(x)                        # -> the trunk's lm_head; also what is chained

Followed: vLLM ``model_executor/models/longcat_flash_mtp.py`` (its name map is the published
layout: ``model.mtp.layers.0.{enorm,hnorm}.m.weight``, ``eh_proj``, the attention and the two
norms at the layer prefix, the MLP under ``transformer_layer.mlp``, the final norm at
``model.mtp.norm``, an embedding copy at ``model.mtp.embed_tokens`` (the trunk's serves); one MTP
layer, a DeepSeek-V2 decoder layer with ``n_routed_experts`` unset, i.e. a dense MLP of the
trunk's ``ffn_hidden_size``; ``mla_scale_q_lora`` / ``mla_scale_kv_lora`` scale the latent
norms, which mlx-lm's ``LongcatFlashMLA`` applies in its forward). mlx-lm's ``longcat_flash``
drops ``model.mtp*`` in its sanitize.

The block is built from the trunk's own classes (its ``LongcatFlashMLA`` and the dense
``LongcatFlashMLP``), as mlx-lm has no single-attention LongCat layer. The trunk's layers pair
two attentions and cache each in a ``CacheList(KVCache, KVCache)``; the MTP block has one, so
its cache is one ``KVCache`` (``cache_like`` is left unset on purpose). hidden_source
"post_norm": vLLM hands the layer the target's returned (post-norm) hidden state. The module and
its math are ``heads/eh_proj.py``'s.
"""

from __future__ import annotations

import re
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, model_args_of
from mtplx.heads.eh_proj import EhProjHead
from mtplx.heads.weights import HeadSource, MissingHeadError, split_mla_kv_b_proj

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "longcat"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
PREFIX = "model.mtp.layers."
FINAL_NORM = "model.mtp.norm."
_LAYER = re.compile(r"model\.mtp\.layers\.(\d+)\.eh_proj\.weight")


class LongCatMTPBlock(nn.Module):
    """A DeepSeek-V2-style decoder layer: one MLA attention and a dense MLP, pre-norm residuals."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.self_attn = attention
        self.post_attention_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = mlp

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class LongCatMTPHead(EhProjHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    mask_as_array = True  # the MLA attention applies the mask with mx.where
    zero_position_zero = False
    renames = (("enorm.m.", "enorm."), ("hnorm.m.", "hnorm."), ("transformer_layer.mlp.", "mlp."))

    def module_prefix(self, i: int) -> str:
        return f"{PREFIX}{i}."

    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (*super().checkpoint_prefixes(), FINAL_NORM)

    def checkpoint_name(self, path: str) -> str:
        """``final_layernorm`` -> the one ``model.mtp.norm``; the rest by ``renames`` at the layer prefix."""
        parts = path.split(".")
        if parts[0] == "modules_" and parts[2:3] == ["final_layernorm"]:
            return ".".join(["model.mtp.norm", *parts[3:]])
        return super().checkpoint_name(path)

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        tensors = dict(tensors)
        for i in range(self.num_modules):  # the one final norm, as each module's
            tensors.update(
                {
                    f"{self.module_prefix(i)}final_layernorm.{k[len(FINAL_NORM) :]}": v
                    for k, v in tensors.items()
                    if k.startswith(FINAL_NORM)
                }
            )
        return super().sanitize({k: v for k, v in tensors.items() if not k.startswith(FINAL_NORM)}, src)

    def _convert_block(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        split_mla_kv_b_proj(tensors, "self_attn", model_args_of(src.trunk.model), src.config)
        return tensors


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> LongCatMTPHead:
    """An unloaded head for ``model.mtp.layers.{i}``, checked against what the checkpoint ships."""
    present = sorted({int(m.group(1)) for m in map(_LAYER.fullmatch, src.index) if m})
    if not present:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.mtp.layers.*.eh_proj"
        )
    if present != list(range(num_layers)) or num_layers != 1:
        raise MtplxError(
            f"{src.source}: LongCat-Flash ships one MTP layer (model.mtp.layers.0), found {present}"
        )
    args = model_args_of(src.trunk.model)
    template = src.trunk.layers[0]
    attention, mlp = type(template.self_attn[0]), type(template.mlps[0])
    blocks = [
        LongCatMTPBlock(attention(args), mlp(args, False), args.hidden_size, args.rms_norm_eps)
        for _ in range(num_layers)
    ]
    return LongCatMTPHead(
        blocks, args.hidden_size, eps=args.rms_norm_eps, trunk=src.trunk, hidden_source=hidden_source
    )
