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
"post_norm": vLLM hands the layer the target's returned (post-norm) hidden state.
"""

from __future__ import annotations

import re
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, ModuleStackHead, model_args_of
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


class LongCatMTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.final_layernorm = nn.RMSNorm(hidden_size, eps=eps)


class LongCatMTPHead(ModuleStackHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    mask_as_array = True  # the MLA attention applies the mask with mx.where
    module_class = LongCatMTPModule
    own_keys = ("enorm", "hnorm", "eh_proj", "final_layernorm")
    zero_position_zero = False

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.enorm(embedded)
        x = m.eh_proj(mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        return m.final_layernorm

    # --- checkpoint naming ---------------------------------------------------------------
    def module_prefix(self, i: int) -> str:
        return f"{PREFIX}{i}."

    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (*super().checkpoint_prefixes(), FINAL_NORM)

    def checkpoint_name(self, path: str) -> str:
        """``final_layernorm`` -> ``model.mtp.norm``; ``{e,h}norm`` -> ``{e,h}norm.m``;
        ``block.mlp`` -> ``transformer_layer.mlp``; the rest at the layer prefix."""
        parts = path.split(".")
        if parts[0] == "modules_" and len(parts) > 2:
            rest = parts[3:]
            if parts[2] == "final_layernorm":
                return ".".join(["model.mtp.norm", *rest])
            if parts[2] in ("enorm", "hnorm"):
                return ".".join([self.module_prefix(int(parts[1])) + parts[2], "m", *rest])
            if parts[2] == "block" and rest[:1] == ["mlp"]:
                return ".".join([self.module_prefix(int(parts[1])) + "transformer_layer", *rest])
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

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        out = {}
        for k, v in tensors.items():
            if k.startswith("embed_tokens.") or "rotary_emb." in k:
                continue
            k = re.sub(r"^([eh]norm)\.m\.", r"\1.", k)
            out[k.replace("transformer_layer.mlp.", "mlp.", 1)] = v
        split_mla_kv_b_proj(out, "self_attn", model_args_of(src.trunk.model), src.config)
        return out


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
