"""The Step-3.5-Flash MTP layout: DeepSeek-like layers past ``num_hidden_layers``, own LM heads.

Module ``i`` lives at ``model.layers.{num_hidden_layers + i}`` (45-47 in the release):

    e = enorm(embed(next_token))                   # not zeroed at position 0 (vLLM does not mask it)
    x = eh_proj(concat([e, hnorm(hidden)], -1))    # embedding FIRST
    x = decoder block at the same prefix (the trunk's layer class at that index: its attention
        type from the config's ``layer_types``, a dense MLP, head-wise attention gate, q/k norms)
    out = transformer.shared_head.norm(x)          # -> transformer.shared_head.output (own LM head)

Followed: vLLM ``model_executor/models/step3p5_mtp.py`` (``enorm`` / ``hnorm`` /
``shared_head.norm`` are ``GemmaRMSNorm``, i.e. ``x * (1 + w)``; ``shared_head.output`` renamed
``shared_head.head``; ``.transformer.`` dropped from the names; the block's tensors sit at the
layer prefix itself; draft step ``s`` uses layer ``s % n``; ``compute_logits`` applies the layer's
``shared_head`` norm and head to the layer's output, and the output before that norm is what
the next step reads, so ``chain_source = "pre_norm"``). The raw checkpoint stores every norm of
the layer as an offset from 1 (mlx-lm's ``step3p5.sanitize`` adds 1 to each ``norm`` weight of
such a checkpoint), decided here by provenance (``weights.norm_rule``). mlx-lm's sanitize drops
the MTP layers. Count: ``num_nextn_predict_layers`` (3), else the ``eh_proj`` indices.

hidden_source "post_norm": vLLM's Step-3.5 target returns its hidden state after the final norm.
The head layer's cache is the trunk's for a trunk layer of the same attention type (a sliding
layer: ``RotatingKVCache(sliding_window)``). The module and its math are ``heads/eh_proj.py``'s
(``transformer.shared_head.{norm,output}`` are its ``final_layernorm`` / ``lm_head``).
"""

from __future__ import annotations

from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, build_layer_like, model_args_of
from mtplx.heads.eh_proj import EhProjHead
from mtplx.heads.weights import HeadSource, MissingHeadError, norm_rule, plain_norms

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "step3p5"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
OFFSET_NORM_MODEL_TYPES = ("step3p5",)  # raw checkpoints store every norm as an offset from 1


class Step3p5MTPHead(EhProjHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "pre_norm"
    zero_position_zero = False
    renames = (
        ("transformer.shared_head.output.", "lm_head."),
        ("transformer.shared_head.norm.", "final_layernorm."),
    )

    def module_prefix(self, i: int) -> str:
        return f"model.layers.{self.first_layer + i}."

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        rule = norm_rule(src.config, src.model_dir, src.index, tensors, OFFSET_NORM_MODEL_TYPES)
        return plain_norms(super().sanitize(tensors, src), rule, str(src.source))


def _layer_like(trunk: Any, block: nn.Module) -> int:
    """The first trunk layer of the block's attention type (its cache is the head layer's)."""
    for i, layer in enumerate(trunk.layers):
        if getattr(layer, "is_sliding", None) == getattr(block, "is_sliding", None):
            return i
    return len(trunk.layers) - 1


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> Step3p5MTPHead:
    """An unloaded head for checkpoint layers ``num_hidden_layers + i``, checked against what the
    checkpoint ships; a layer keeps its own LM head only where it differs from the trunk's."""
    args = model_args_of(src.trunk.model)
    first = int(args.num_hidden_layers)
    for i in range(num_layers):
        if f"model.layers.{first + i}.eh_proj.weight" not in src.index:
            raise MissingHeadError(
                f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.layers.{first + i}.eh_proj"
            )
    types = list(getattr(args, "layer_types", None) or [])
    if types and len(types) < first + num_layers:
        raise MtplxError(
            f"{src.source}: config layer_types has {len(types)} entries; MTP layer {first + num_layers - 1} needs one"
        )
    blocks = [build_layer_like(src.trunk.layers[-1], args, first + i) for i in range(num_layers)]
    head = Step3p5MTPHead(
        blocks,
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=first,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[_layer_like(src.trunk, b) for b in blocks],
    )
    head.attach_own_lm_heads(src, args.hidden_size)
    return head
