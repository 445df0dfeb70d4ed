"""The Inkling (``inkling``) MTP layout: ``model.mtp.layers.{i}`` beside a trunk hosted through mlx-vlm.

One module (mlx-vlm 0.7.10 ``speculative/drafters/inkling_mtp/inkling_mtp.py``,
``InklingMTPDraftModel``; ``num_nextn_predict_layers`` 1 as its splitter's default block size
assumes), at ``model.mtp.layers.0.``:

    x = input_proj(concat([hidden_norm(hidden), embed_norm(embed(next_token))], -1))   # hidden FIRST
    x = transformer_block(x)             # an InklingDecoderLayer: attention with the relative-position
                                         # band and its short convolutions, dense MLP, its own caches
    out = norm(x) / logits_mup_width_multiplier                   # -> the trunk's LM head

Convention, from mlx-vlm 0.7.10:

* reads: the trunk's **pre-norm** state (``speculative_verify_hidden`` hands the drafter
  ``return_hidden``'s ``pre_norm``, the last layer's output before the final norm);
* chains on: its own block output before ``norm`` (``draft_block`` feeds ``_forward_token``'s
  return back as the next step's hidden; ``chain_source`` "pre_norm");
* every draft step runs the same block (with one block ``min(step, n - 1)`` is 0);
* position 0's embedding is not zeroed (``prefill_from_target_hidden`` pairs every hidden with
  the next token's plain embedding);
* the final norm is the trunk's (the drafter's ``norm.weight`` is ``model.llm.norm.weight``;
  its splitter copies it), then the division by the width multiplier the trunk's logits take
  (`mtplx.trunk.vlm_inkling.WidthScaledNorm`).

The block's layer is sliding (``hybrid_sliding``) when its index is in ``mtp_local_layer_ids``
(mlx-vlm's config: the text config's ``mtp_local_layer_ids``, else the source's
``mtp_config.local_layer_ids``, else its ``local_layer_ids``); its cache is a trunk layer's,
mlx-vlm's ``CacheList(KVCache, ArraysCache(4))`` (``cache_like``), whose short-convolution
windows `mtplx.trunk.rollback_vlm` restores when the chain's draft entries are dropped.

Tensors: the published names, renamed by the drafter's own ``sanitize`` (q/k/v/r fused into
``qkvr_proj``, gate/up de-interleaved, convolutions [C, 1, K] -> [C, K, 1]). The split drafter
(``inkling_mtp``, mlx-vlm's ``split.py``) holds them already sanitized (``blocks.0.*``, ``norm``).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, model_args_of
from mtplx.heads.weights import HeadSource, check_one_layer_drafter, check_one_layer_head
from mtplx.trunk.vlm_inkling import WidthScaledNorm

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "inkling"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"
KEY_PREFIX = "model.mtp."
NORM_KEY = "model.llm.norm.weight"  # the trunk's final norm: the drafter's own norm


def mtp_local_layer_ids(config: dict) -> list[int]:
    """Which MTP layers are sliding-window ones, read as mlx-vlm's splitter and drafter config do."""
    text = config.get("text_config") or config
    local = text.get("mtp_local_layer_ids")
    if local is None:
        local = (config.get("mtp_config") or {}).get("local_layer_ids") or text.get("local_layer_ids")
    return [int(i) for i in local or ()]


class InklingMTPHead(MTPHead):
    """The Inkling MTP module (the module docstring); shares the trunk's embedding and LM head."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "pre_norm"

    def __init__(self, text_args: Any, *, local: list[int], key_prefix: str = KEY_PREFIX, **shared: Any):
        """``key_prefix``: the checkpoint's ``model.mtp.`` (its final norm read from the trunk's
        ``model.llm.norm``), or "" for a split drafter's already sanitized names."""
        from mlx_vlm.speculative.drafters.inkling_mtp.inkling_mtp import InklingMTPBlock

        super().__init__(**shared)
        layer_args = replace(
            text_args,
            num_hidden_layers=1,
            layer_types=["hybrid_sliding" if 0 in local else "hybrid"],
            mlp_layer_types=["dense"],
            local_layer_ids=None,
        )
        self.blocks = [InklingMTPBlock(layer_args, 0)]
        self.norm = nn.RMSNorm(text_args.hidden_size, eps=text_args.rms_norm_eps)
        self.width_multiplier = float(text_args.logits_mup_width_multiplier)
        self.key_prefix = key_prefix

    def decoder_layers(self) -> list[nn.Module]:
        return [b.transformer_block for b in self.blocks]

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        block = self.blocks[0]
        embedded = self._embed(next_tokens)
        x = mx.concatenate([block.hidden_norm(hidden), block.embed_norm(embedded)], axis=-1)
        return block.transformer_block(block.input_proj(x), cache=cache[0] if cache else None)

    def _final_norm(self, step: int) -> nn.Module:
        return WidthScaledNorm(self.norm, self.width_multiplier)

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (self.key_prefix, NORM_KEY) if self.key_prefix else ("",)

    def checkpoint_name(self, path: str) -> str:
        """mlx-side names (``qkvr_proj``, ``gate_proj``): a split drafter's, or at the checkpoint's
        ``model.mtp.layers.{i}`` prefix (the final norm at the trunk's)."""
        if not self.key_prefix:
            return path
        if path.split(".")[0] == "norm":
            return "model.llm." + path
        return self.key_prefix + path.replace("blocks.", "layers.", 1)

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        from mlx_vlm.speculative.drafters.inkling_mtp.inkling_mtp import InklingMTPDraftModel

        local: dict[str, mx.array] = {}
        for name, value in tensors.items():
            if self.key_prefix and name == NORM_KEY:
                local["norm.weight"] = value
            elif name.startswith(self.key_prefix):
                local[name[len(self.key_prefix) :]] = value
        # The drafter's own renaming (``layers.{i}.*`` -> ``blocks.{i}.*``; idempotent on its output).
        return InklingMTPDraftModel.sanitize(SimpleNamespace(), local)


def _text_args(src: HeadSource) -> Any:
    args = model_args_of(src.trunk.model)
    if getattr(args, "logits_mup_width_multiplier", None) is None or not hasattr(args, "sconv_kernel_size"):
        raise MtplxError(f"{src.source}: a {LAYOUT} head needs an Inkling trunk")
    return args


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> InklingMTPHead:
    """An unloaded head for the checkpoint's ``model.mtp.layers.0.*`` tensors, checked against what it ships."""
    check_one_layer_head(src, num_layers, LAYOUT, f"{KEY_PREFIX}layers.0.input_proj.weight")
    return InklingMTPHead(
        _text_args(src),
        local=mtp_local_layer_ids(src.config),
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[0],
    )


def build_split_head(src: HeadSource, num_layers: int) -> InklingMTPHead:
    """An unloaded head for an ``inkling_mtp`` split drafter beside an Inkling trunk."""
    check_one_layer_drafter(src, num_layers, "inkling_mtp", "blocks.0.input_proj.weight")
    return InklingMTPHead(
        _text_args(src),
        local=mtp_local_layer_ids(src.config),
        key_prefix="",
        trunk=src.trunk,
        hidden_source=DEFAULT_HIDDEN_SOURCE,
        cache_like=[0],
    )
