"""The Nemotron-H MTP layout (NVIDIA Nemotron-3 Super / Nano with ``num_nextn_predict_layers``):
one prediction module made of several Nemotron-H blocks in sequence, its pattern given by the
config (``mtp_hybrid_override_pattern``, e.g. ``"*E"``: an attention block then a MoE block).

    e = enorm(embed(next_token))                  # the trunk's embedding; position 0 NOT masked
    h = hnorm(hidden)                             # the trunk's post-norm hidden (norm_f's output)
    x = eh_proj(concat([e, h], -1))               # 2H -> H, no bias; embedding FIRST
    x = block_j(x) for each pattern block j       # x + mixer(norm(x)); attention blocks: own KV cache
    out = final_layernorm(x)                      # post-norm, read by the trunk's LM head

Checkpoint tensors (HF, under ``mtp.``; multimodal checkpoints nest them under
``language_model.``): ``mtp.layers.0.{enorm,hnorm,eh_proj}.weight`` on the first block,
``mtp.layers.{j}.norm.weight`` and ``mtp.layers.{j}.mixer.*`` per block (attention:
``{q,k,v,o}_proj``, no rope; MoE: ``gate.weight``, ``gate.e_score_correction_bias``,
``experts.{e}.{up,down}_proj``, ``shared_experts.{up,down}_proj``, ReLU^2 experts),
``mtp.layers.{last}.final_layernorm.weight``. Norms are plain scales (Nemotron-H's RMSNorm is
``x * w``; mlx-lm's ``nemotron_h.sanitize`` shifts nothing).

Published modeling code read for this (facts only; NVIDIA's training code is not public and no
checkpoint could be downloaded here, so the layout is built from these, not confirmed on a
file): vLLM ``model_executor/models/nemotron_h_mtp.py`` (the block list, ``enorm`` / ``hnorm`` /
``eh_proj`` on the step's first block, ``final_layernorm`` on its last, embedding first, no
position-0 mask, one MTP step only: ``num_nextn_predict_layers == 1``, layer names
``mtp.layers.{j}``); mlx-vlm 0.7.10 ``speculative/drafters/nemotron_h_mtp`` (the same block
math on mlx-lm-style blocks; the drafter reads the target's post-``norm_f`` hidden and chains on
its own post-``final_layernorm`` output; the ``nemotron_h_mtp`` split drafter holds the same
names without ``mtp.``, experts stacked as ``switch_mlp.fc1`` / ``fc2``); HF transformers 5.x
``configuration_nemotron_h.py`` (``mtp_layers_block_type`` defaults to attention + MoE, the
legacy ``mtp_hybrid_override_pattern`` string). The module is reused at every draft step (both
references chain the one module recursively).
"""

from __future__ import annotations

import re
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, model_args_of
from mtplx.heads.weights import HeadSource, MissingHeadError, find_prefix, stack_experts, strip_prefix
from mtplx.trunk.compat import KVCache, create_attention_mask, leading_cache

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "nemotron_h"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
KEY_PREFIX = "mtp."
# HF transformers' default MTP block list (``mtp_layers_block_type``: full attention, then MoE).
DEFAULT_PATTERN = "*E"
# transformers' block-type names -> mlx-lm's pattern characters (mlx-lm ``nemotron_h.ModelArgs``).
_BLOCK_CHARS = {"full_attention": "*", "attention": "*", "moe": "E", "mlp": "-"}
_HEAD_BLOCKS = ("*", "E", "-")  # a Mamba2 block in an MTP module is not published and not read
_LAYER = re.compile(r"layers\.(\d+)\.")


def mtp_pattern(config: dict) -> str:
    """The MTP module's block pattern from a Nemotron-H config (its ``text_config`` first):
    ``mtp_hybrid_override_pattern``, else ``mtp_layers_block_type``, else ``DEFAULT_PATTERN``."""
    for cfg in (config.get("text_config") or {}, config):
        if cfg.get("mtp_hybrid_override_pattern"):
            return "".join(cfg["mtp_hybrid_override_pattern"])
        if cfg.get("mtp_layers_block_type"):
            unknown = [t for t in cfg["mtp_layers_block_type"] if t not in _BLOCK_CHARS]
            if unknown:
                raise MtplxError(f"Nemotron-H MTP block type(s) {unknown} are not read by mtplx")
            return "".join(_BLOCK_CHARS[t] for t in cfg["mtp_layers_block_type"])
    return DEFAULT_PATTERN


class NemotronHMTPHead(MTPHead):
    """eh_proj(concat[enorm(embed(t)), hnorm(h)]) -> the pattern's blocks -> final_layernorm.
    Shares the trunk's embedding and LM head; one KV cache per attention block."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"

    def __init__(
        self, blocks: list[nn.Module], hidden_size: int, *, eps: float, key_prefix: str, **shared: Any
    ):
        """``blocks``: mlx-lm ``nemotron_h.NemotronHBlock``s, the pattern in order (called as
        ``block(x, mask=, cache=)``); ``shared``: ``MTPHead``'s keywords. The fusion sits on the
        first block and the final norm on the last, as the checkpoint names them."""
        super().__init__(**shared)
        if not any(b.block_type == "*" for b in blocks):
            raise MtplxError("a Nemotron-H MTP module needs an attention block (its pattern has none)")
        self.layers = list(blocks)
        first, last = self.layers[0], self.layers[-1]
        first.enorm = nn.RMSNorm(hidden_size, eps=eps)
        first.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        first.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        last.final_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.key_prefix = key_prefix

    def decoder_layers(self) -> list[nn.Module]:
        return self.layers

    def make_cache(self) -> list:
        """One KVCache per attention block (MLP and MoE blocks keep nothing)."""
        return [KVCache() for b in self.layers if b.block_type == "*"]

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        first = self.layers[0]
        e = first.enorm(self._embed(next_tokens))
        x = first.eh_proj(mx.concatenate([e, first.hnorm(hidden).astype(e.dtype)], axis=-1))
        caches = iter(cache if cache is not None else [None] * len(self.layers))
        mask = create_attention_mask(x, leading_cache(cache[0]) if cache else None)
        for block in self.layers:
            if block.block_type == "*":
                x = block(x, mask=mask, cache=next(caches))
            else:
                x = block(x)
        return x

    def _final_norm(self, step: int) -> nn.Module:
        return self.layers[-1].final_layernorm

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (self.key_prefix,)

    def checkpoint_name(self, path: str) -> str:
        return self.key_prefix + path

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """Per-expert HF tensors stacked as mlx-lm's ``switch_mlp.fc1`` (up) / ``fc2`` (down); FP8
        KV scales and rotary buffers dropped; norms kept as they are (plain scales)."""
        weights = {
            k: v
            for k, v in strip_prefix(tensors, self.key_prefix).items()
            if not k.endswith((".k_scale", ".v_scale")) and "rotary_emb." not in k
        }
        num_experts = int(getattr(model_args_of(src.trunk.model), "n_routed_experts", 0) or 0)
        for j, block in enumerate(self.layers):
            if block.block_type != "E":
                continue
            weights = stack_experts(weights, f"layers.{j}.mixer", num_experts)
            for hf, mlx in (("up_proj", "fc1"), ("down_proj", "fc2")):
                for kind in ("weight", "scales", "biases"):
                    key = f"layers.{j}.mixer.switch_mlp.{hf}.{kind}"
                    if key in weights:
                        weights[f"layers.{j}.mixer.switch_mlp.{mlx}.{kind}"] = weights.pop(key)
        return weights


def _blocks_like_the_trunk(src: HeadSource, pattern: str) -> list[nn.Module]:
    """The pattern's blocks, built with the trunk's own block class and arguments."""
    bad = sorted(set(pattern) - set(_HEAD_BLOCKS))
    if bad:
        raise MtplxError(
            f"{src.source}: Nemotron-H MTP pattern {pattern!r} has block(s) {bad} mtplx does not read"
        )
    args = model_args_of(src.trunk.model)
    block_cls = type(src.trunk.layers[0])
    return [block_cls(args, char) for char in pattern]


def _check_layers(src: HeadSource, prefix: str, pattern: str) -> None:
    present = sorted(
        {int(m.group(1)) for k in src.index if k.startswith(prefix) and (m := _LAYER.match(k[len(prefix) :]))}
    )
    if present != list(range(len(pattern))):
        raise MtplxError(
            f"{src.source}: a Nemotron-H MTP module of pattern {pattern!r} has layers 0..{len(pattern) - 1}; "
            f"the checkpoint has {present}"
        )


def _build(src: HeadSource, num_layers: int, hidden_source: HiddenSource, prefix: str) -> NemotronHMTPHead:
    if num_layers != 1:
        raise MtplxError(
            f"{src.source}: declares {num_layers} Nemotron-H MTP steps; the published layout has one module"
        )
    pattern = mtp_pattern(src.config)
    _check_layers(src, prefix, pattern)
    args = model_args_of(src.trunk.model)
    return NemotronHMTPHead(
        _blocks_like_the_trunk(src, pattern),
        args.hidden_size,
        eps=args.layer_norm_epsilon,
        key_prefix=prefix,
        trunk=src.trunk,
        hidden_source=hidden_source,
    )


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> NemotronHMTPHead:
    """An unloaded head for the checkpoint's ``mtp.layers.*`` tensors, checked against what it ships."""
    found = find_prefix(src.index, r"mtp\.layers\.0\.eh_proj\.weight")
    if found is None:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no mtp.layers.*"
        )
    return _build(src, num_layers, hidden_source, found + KEY_PREFIX)


def build_split_head(src: HeadSource, num_layers: int) -> NemotronHMTPHead:
    """An unloaded head for a ``nemotron_h_mtp`` split drafter (mlx-vlm's splitter): the names of
    ``build_head``'s layout without ``mtp.``, experts already stacked."""
    if "layers.0.eh_proj.weight" not in src.index:
        raise MtplxError(f"{src.source}: a nemotron_h_mtp drafter without layers.0.eh_proj.weight")
    return _build(src, num_layers, DEFAULT_HIDDEN_SOURCE, "")
