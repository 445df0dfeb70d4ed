"""The GLM-5-Next (``glm5_next``) MTP layout: one DeepSeek-style layer past the trunk's layers.

Module ``i`` lives at ``model.language_model.layers.{num_hidden_layers + i}.`` (the published
multimodal checkpoint's trunk prefix; mlx-vlm 0.7.10 ``speculative/drafters/glm5_next_mtp``,
``Glm5NextMTPDraftModel``):

    e = embed(next_token), zeroed at sequence position 0
    x = eh_proj(concat([enorm(e), hnorm(hidden)], -1))            # embedding FIRST
    x = x + self_attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))
    out = shared_head.norm(x)                                      # -> the trunk's LM head

The block (``Glm5NextMTPBlock``) is a plain residual layer (no hyper-connections): NoPE MLA
sparse attention with its own pooled indexer, and the trunk's sigmoid-routed MoE with clamped
SwiGLU experts.

Hyper-connection convention (the trunk keeps ``hc_mult`` streams), from mlx-vlm 0.7.10:

* reads: the trunk's **post-norm** state, ``norm(streams.mean(axis=2))`` (``Glm5NextTextModel``
  appends that to ``hidden_sink``; the drafter's ``_target_hidden`` accepts [B, T, hidden] only):
  never one stream, never the streams themselves;
* chains on: its own output after ``shared_head.norm`` (``_forward_hidden`` returns ``(h, h)``);
* position 0's embedding is zeroed (``mx.where(position_ids == 0, 0, token_embed)``).

Its cache is the trunk's sparse-layer kind, mlx-vlm's own ``CacheList(latent KV, indexer KV,
PoolingCache, projected KV)`` (``cache_like``); `mtplx.trunk.rollback_vlm` drops draft entries
(the pool cache back to its ``mark_drafts`` snapshot).

Tensors: the layer's published names (``q_a_proj`` / ``kv_a_proj_with_mqa``, a fused
``kv_b_proj``, per-expert ``experts.{e}.*``, ``shared_experts.{gate,up,down}_proj``), renamed by the
drafter's own ``sanitize`` (idempotent on the mlx-side names `mtplx convert` writes). The split
drafter (``glm5_next_mtp``, mlx-vlm's ``split.py``): ``enorm`` / ``hnorm`` / ``eh_proj`` /
``shared_head_norm`` at the top and the block under ``mtp_block.``: ``build_split_head``.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, model_args_of, zero_first_position
from mtplx.heads.deepseek import DeepSeekMTPHead, SplitDeepSeekHead, SplitNames
from mtplx.heads.eh_proj import rename_prefix
from mtplx.heads.weights import HeadSource, check_one_layer_drafter, check_one_layer_head

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "glm5_next"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
TRUNK_PREFIX = "model.language_model.layers."


def _block(args: Any) -> nn.Module:
    """mlx-vlm's MTP block: a sparse-attention layer with its own ("full") indexer, MoE."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp.glm5_next_mtp import Glm5NextMTPBlock

    index = args.num_hidden_layers
    layer_args = replace(
        args,
        num_hidden_layers=index + 1,
        layer_types=[*args.layer_types, "deepseek_sparse_attention"],
        mlp_layer_types=[*args.mlp_layer_types, "sparse"],
        indexer_types=[*args.indexer_types, "full"],
    )
    return Glm5NextMTPBlock(layer_args, index)


def drafter_sanitize(args: Any, block_tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The block's published tensors (names relative to the layer) as mlx-vlm's drafter holds
    them (its own ``sanitize``: fused shared-expert ``gate_up_proj``, stacked experts, fused
    ``qkv_a_proj``, ``kv_b_proj`` split into ``embed_q`` / ``unembed_out``)."""
    from mlx_vlm.speculative.drafters.glm5_next_mtp.glm5_next_mtp import Glm5NextMTPDraftModel

    prefixed = {"mtp_block." + k: v for k, v in block_tensors.items()}
    out = Glm5NextMTPDraftModel.sanitize(SimpleNamespace(args=args), prefixed)
    return {k.removeprefix("mtp_block."): v for k, v in out.items()}


class Glm5NextMTPHead(DeepSeekMTPHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"
    fp8_dequantized = ()

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        """One module; its cache is mlx-vlm's CacheList, whose first member counts positions."""
        c = cache[0] if cache else None
        offset = c.caches[0].offset if c is not None else 0
        embedded = zero_first_position(self._embed(next_tokens), offset)
        return self._module_forward(self.modules_[0], hidden, embedded, c)

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.enorm(embedded)
        x = m.eh_proj(mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1))
        return m.block(x, cache)

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        return self._shared_lm_head(head_hidden)

    def module_prefix(self, i: int) -> str:
        return f"{TRUNK_PREFIX}{self.first_layer + i}."

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        tensors = {rename_prefix(k, self.renames): v for k, v in tensors.items()}  # shared_head.* as ours
        tensors = {k: v for k, v in tensors.items() if not k.startswith(("embed_tokens.", "lm_head."))}
        own = {k: v for k, v in tensors.items() if k.split(".")[0] in self.own_keys}
        block = {k: v for k, v in tensors.items() if k.split(".")[0] not in self.own_keys}
        return {**own, **drafter_sanitize(model_args_of(src.trunk.model), block)}


def _sparse_layer(trunk: Any) -> int:
    """A trunk layer whose cache is the head layer's kind (sparse attention with its own indexer)."""
    for i, layer in enumerate(trunk.layers):
        if getattr(layer.self_attn, "indexer", None) is not None:
            return i
    raise MtplxError("a GLM-5-Next trunk without a sparse-attention layer with an indexer")


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> Glm5NextMTPHead:
    """An unloaded head for ``model.language_model.layers.{num_hidden_layers}.*``."""
    args = model_args_of(src.trunk.model)
    first = int(args.num_hidden_layers)
    check_one_layer_head(src, num_layers, LAYOUT, f"{TRUNK_PREFIX}{first}.eh_proj.weight")
    return Glm5NextMTPHead(
        [_block(args)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=first,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[_sparse_layer(src.trunk)],
    )


# mlx-vlm 0.7.10 ``glm5_next_mtp/split.py`` ``rename``: in-checkpoint local names -> the drafter's.
SPLIT_NAMES = SplitNames(
    prefixes=("enorm.", "hnorm.", "eh_proj.", "shared_head_norm.", "mtp_block."),
    own=(
        ("shared_head.norm.", "shared_head_norm."),
        ("enorm.", "enorm."),
        ("hnorm.", "hnorm."),
        ("eh_proj.", "eh_proj."),
    ),
    block_prefix="mtp_block.",
    dropped=(),
)


class SplitGlm5NextHead(SplitDeepSeekHead, Glm5NextMTPHead):
    """The GLM-5-Next head read from a split drafter's names (``SPLIT_NAMES``), already sanitized."""


def build_split_head(src: HeadSource, num_layers: int) -> SplitGlm5NextHead:
    """An unloaded head for a ``glm5_next_mtp`` split drafter beside a GLM-5-Next trunk."""
    args = model_args_of(src.trunk.model)
    check_one_layer_drafter(src, num_layers, "glm5_next_mtp", "eh_proj.weight")
    return SplitGlm5NextHead(
        [_block(args)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=int(args.num_hidden_layers),
        trunk=src.trunk,
        hidden_source=DEFAULT_HIDDEN_SOURCE,
        cache_like=[_sparse_layer(src.trunk)],
        names=SPLIT_NAMES,
    )
