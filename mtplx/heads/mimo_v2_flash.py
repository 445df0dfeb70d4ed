"""The MiMo-V2-Flash MTP layout: ``model.mtp.layers.{i}``, sliding-window attention.

    e = enorm(embed(next_token))                   # not zeroed at position 0 (neither reference does)
    x = eh_proj(concat([e, hnorm(hidden)], -1))    # embedding FIRST, as DeepSeek
    x = decoder block: sliding-window attention (the trunk's SWA heads, head sizes, rope base,
        window and attention sinks) + a dense MLP (``intermediate_size``)
    out = final_layernorm(x)                       # -> the trunk's lm_head; also what is chained

Followed: vLLM ``vllm/model_executor/models/mimo_v2_flash_mtp.py`` and SGLang
``python/sglang/srt/models/mimo_v2_flash_nextn.py`` (both read the published checkpoint).
Tensors: ``model.mtp.layers.{i}.{enorm,hnorm,eh_proj,final_layernorm}.*``; the block's
(``self_attn.*``, ``mlp.*``, ``input_layernorm``, ``pre_mlp_layernorm``) at the same prefix;
both references rename ``pre_mlp_layernorm`` to ``post_attention_layernorm``, as here.
Count: ``num_nextn_predict_layers`` (3 in the release), else the layer indices in the tensor
names. The block is mlx-lm's ``mimo_v2_flash.DecoderLayer`` with ``is_sliding_window=True,
is_moe=False`` and its cache is the one the trunk builds for a sliding layer (a
RotatingKVCache of ``sliding_window_size``). Draft step ``s`` uses module ``s % n``
(``ModuleStackHead``), the SGLang multi-layer MTP chain; vLLM's loader folds every module
into one layer (its comment: "the last checkpoint loaded wins"), which mtplx does not follow.

hidden_source default "post_norm": vLLM's ``mimo_v2_flash.py`` returns the hidden state after
the trunk's final norm to the drafter, and the head's own output (chained) is post-norm too.
The module and its math are ``heads/eh_proj.py``'s.
"""

from __future__ import annotations

from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, model_args_of
from mtplx.heads.eh_proj import EhProjHead
from mtplx.heads.weights import HeadSource, MissingHeadError

import mlx.nn as nn

LAYOUT = "mimo_v2_flash"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
PREFIX = "model.mtp.layers."


class MiMoV2FlashMTPHead(EhProjHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    zero_position_zero = False
    renames = (("pre_mlp_layernorm.", "post_attention_layernorm."),)

    def module_prefix(self, i: int) -> str:
        return f"{PREFIX}{i}."


def _sliding_template(trunk: Any) -> tuple[nn.Module, int]:
    for i, layer in enumerate(trunk.layers):
        if getattr(layer, "is_sliding_window", False):
            return layer, i
    raise MtplxError(
        f"{type(trunk.model).__name__}: no sliding-window trunk layer to model the MTP layers on"
    )


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> MiMoV2FlashMTPHead:
    """An unloaded head for the checkpoint's ``model.mtp.layers.{i}``, checked against what it ships."""
    present = sorted({int(k[len(PREFIX) :].split(".")[0]) for k in src.index if k.startswith(PREFIX)})
    if not present:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.mtp.layers.* tensors"
        )
    if present != list(range(num_layers)):
        raise MtplxError(
            f"{src.source}: config declares {num_layers} MTP layer(s), checkpoint has model.mtp.layers {present}"
        )
    args = model_args_of(src.trunk.model)
    template, idx = _sliding_template(src.trunk)
    blocks = [type(template)(args, is_moe=False, is_sliding_window=True) for _ in range(num_layers)]
    return MiMoV2FlashMTPHead(
        blocks,
        args.hidden_size,
        eps=args.layernorm_epsilon,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[idx] * num_layers,
    )
