"""The Hunyuan-V4 (``hy_v4``) MTP layout: ``model.mtp_layers.{i}`` beside a hyper-connection trunk.

Module ``i`` (``num_nextn_predict_layers`` of them; 1 as published) lives at
``model.mtp_layers.{i}.``:

    x = eh_proj(concat([enorm(embed(next_token)), hnorm(hidden)], -1))   # embedding FIRST
    x = x + attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))   # plain residual
    out = final_layernorm(x)                                              # -> the trunk's LM head

The block is mlx-vlm's ``HyV4MTPDecoderLayer`` (Hunyuan-V4's MLA attention with its own "full"
DSA indexer, output gate and attention sinks; the MoE of the trunk's later layers), so its cache
is a trunk layer-0 cache (latent KV + indexer keys: ``cache_like``).

Hyper-connection convention (the trunk keeps ``hc_mult`` residual streams; which one the head
reads and what it chains on), from mlx-vlm 0.7.10:

* reads: the trunk's **post-norm** state, ``norm(hc_head(streams))``: the streams collapsed by the
  trunk's hyper-connection head (``models/hy_v4/language.py`` ``HyV4Model.__call__`` returns
  ``self.norm(self.hc_head(h))``, and that is the ``hidden_states`` entry ``LanguageModel`` hands a
  drafter with ``return_hidden``); never one raw stream, never the streams' concatenation
  (Qwen3.8-Flash-Next's head reads those; Hunyuan-V4's does not:
  ``speculative/drafters/hy_v4_mtp/hy_v4_mtp.py``: "Hy4's rank-3 native MTP block, which has no
  hyper-connection streams"; its ``hnorm`` / ``eh_proj`` are hidden_size wide);
* chains on: its own output after ``final_layernorm`` (``chain_source`` "post_norm"): the
  drafter's ``draft_block`` feeds ``_forward_token``'s return, ``self.norm(self.decoder(h))``,
  back as the next step's hidden (``qwen3_5_mtp.py``, which ``HyV4MTPDraftModel`` extends);
* position 0's embedding is not zeroed (``zero_position_zero`` False): mlx-vlm's
  ``prefill_from_target_hidden`` pairs every hidden with the next token's plain embedding.

Tensors: the checkpoint's ``kv_b_proj`` is MXFP8 (``weight`` + ``weight_scale``): dequantized
and split into the block's per-head ``embed_q`` / ``unembed_out`` (float: the head at safe
precision); per-expert ``experts.{e}.{gate,up,down}_proj`` stacked, gate and up fused as
mlx-vlm's ``FusedSwitchGLU`` holds them.

Split drafter (``hy_v4_mtp``, mlx-vlm 0.7.10 ``speculative/drafters/hy_v4_mtp/split.py``): the
layer's ``enorm`` / ``hnorm`` / ``eh_proj`` at the top, ``final_layernorm`` renamed ``norm``, the
block under ``decoder.`` with ``kv_b_proj`` already split and packed MXFP8 (``embed_q`` /
``unembed_out`` ``weight`` + ``scales``: loaded as packed), experts still per expert
(``SPLIT_NAMES``, ``SplitHyV4Head``); the same math, the same hidden source and chain.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, model_args_of
from mtplx.heads.eh_proj import EhProjHead, SplitNames, SplitNamesHead
from mtplx.heads.weights import HeadSource, MissingHeadError, check_one_layer_drafter, stack_experts

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "hy_v4"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
MXFP8_GROUP = 32


def dequantize_mxfp8(weight: mx.array, scale: mx.array) -> mx.array:
    """An MXFP8 tensor as published (e4m3 bytes [out, in], e8m0 scales [out, in / 32]) -> float32."""
    packed = weight.view(mx.uint8).reshape(weight.shape[0], -1).view(mx.uint32)
    return mx.dequantize(packed, scale, None, group_size=MXFP8_GROUP, bits=8, mode="mxfp8").astype(mx.float32)


def split_kv_b_proj(tensors: dict[str, mx.array], args: Any) -> None:
    """``self_attn.kv_b_proj`` [heads * (nope + v), kv_lora] (MXFP8 or float) -> the per-head
    ``embed_q`` [heads, kv_lora, nope] and ``unembed_out`` [heads, v, kv_lora] (mlx-vlm's sanitize)."""
    key = "self_attn.kv_b_proj.weight"
    if key not in tensors:
        return
    w = tensors.pop(key)
    scale = tensors.pop("self_attn.kv_b_proj.weight_scale", None)
    if scale is not None:
        w = dequantize_mxfp8(w, scale)
    nope = args.qk_nope_head_dim
    w = w.reshape(args.num_attention_heads, nope + args.v_head_dim, args.kv_lora_rank)
    tensors["self_attn.embed_q.weight"] = mx.contiguous(w[:, :nope, :].swapaxes(-1, -2))
    tensors["self_attn.unembed_out.weight"] = mx.contiguous(w[:, nope:, :])


def fuse_gate_up(tensors: dict[str, mx.array], mlp: str = "mlp") -> None:
    """Stacked ``switch_mlp.{gate,up}_proj`` -> ``FusedSwitchGLU``'s ``gate_up_proj`` (gate rows first)."""
    gate, up = f"{mlp}.switch_mlp.gate_proj.weight", f"{mlp}.switch_mlp.up_proj.weight"
    if gate in tensors and up in tensors:
        tensors[f"{mlp}.switch_mlp.gate_up_proj.weight"] = mx.concatenate(
            [tensors.pop(gate), tensors.pop(up)], axis=1
        )


class HyV4MTPHead(EhProjHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"
    mask_as_array = True  # the MLA attention applies the mask with mx.where
    zero_position_zero = False

    def module_prefix(self, i: int) -> str:
        return f"model.mtp_layers.{self.first_layer + i}."

    def _convert_block(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        args = model_args_of(src.trunk.model)
        stack_experts(tensors, "mlp", int(args.n_routed_experts))
        fuse_gate_up(tensors)
        split_kv_b_proj(tensors, args)
        return tensors


def _block(args: Any) -> nn.Module:
    """mlx-vlm's MTP decoder layer: one layer, MoE, its own "full" indexer (its drafter's config)."""
    from mlx_vlm.speculative.drafters.hy_v4_mtp.hy_v4_mtp import HyV4MTPDecoderLayer

    layer_args = replace(
        args, num_hidden_layers=1, first_k_dense_replace=0, moe_layer_freq=1, indexer_types=["full"]
    )
    return HyV4MTPDecoderLayer(layer_args, layer_idx=0)


def _full_indexer_layer(args: Any) -> int:
    """A trunk layer whose cache is a head layer's: one with its own indexer (latent KV + keys)."""
    return list(args.indexer_types).index("full")


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> HyV4MTPHead:
    """An unloaded head of ``num_layers`` modules at ``model.mtp_layers.{i}``, checked against
    what the checkpoint ships; the trunk's embedding and LM head are shared."""
    args = model_args_of(src.trunk.model)
    if not any(k.startswith("model.mtp_layers.") for k in src.index):
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.mtp_layers.* tensors"
        )
    for i in range(num_layers):
        if f"model.mtp_layers.{i}.eh_proj.weight" not in src.index:
            raise MtplxError(f"{src.source}: MTP layer model.mtp_layers.{i} has no eh_proj.weight")
    return HyV4MTPHead(
        [_block(args) for _ in range(num_layers)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=0,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[_full_indexer_layer(args)] * num_layers,
    )


# mlx-vlm 0.7.10 ``hy_v4_mtp/split.py`` ``rename``: in-checkpoint local names -> the drafter's.
SPLIT_NAMES = SplitNames(
    prefixes=("enorm.", "hnorm.", "eh_proj.", "norm.", "decoder."),
    own=(("final_layernorm.", "norm."), ("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj.")),
    block_prefix="decoder.",
    dropped=(),
)


class SplitHyV4Head(SplitNamesHead, HyV4MTPHead):
    """The Hunyuan-V4 head read from a split drafter's names (``SPLIT_NAMES``)."""


def build_split_head(src: HeadSource, num_layers: int) -> SplitHyV4Head:
    """An unloaded head for a ``hy_v4_mtp`` split drafter beside a Hunyuan-V4 trunk (one module)."""
    args = model_args_of(src.trunk.model)
    check_one_layer_drafter(src, num_layers, "hy_v4_mtp", "eh_proj.weight")
    return SplitHyV4Head(
        [_block(args)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=0,
        trunk=src.trunk,
        hidden_source=DEFAULT_HIDDEN_SOURCE,
        cache_like=[_full_indexer_layer(args)],
        names=SPLIT_NAMES,
    )
