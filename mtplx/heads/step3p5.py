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
layer: ``RotatingKVCache(sliding_window)``).
"""

from __future__ import annotations

from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, ModuleStackHead, build_layer_like, model_args_of
from mtplx.heads.weights import (
    HeadSource,
    MissingHeadError,
    keys_with_prefix,
    load_tensors,
    norm_rule,
    plain_norms,
    same_as_trunk_lm_head,
)

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "step3p5"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
OFFSET_NORM_MODEL_TYPES = ("step3p5",)  # raw checkpoints store every norm as an offset from 1
OWN_HEAD = "transformer.shared_head.output."
# checkpoint spelling -> the head's (module-relative)
_RENAMES = (
    ("transformer.shared_head.output.", "shared_head.head."),
    ("transformer.shared_head.", "shared_head."),
)


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


class Step3p5MTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps)


class Step3p5MTPHead(ModuleStackHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "pre_norm"
    module_class = Step3p5MTPModule
    own_keys = ("enorm", "hnorm", "eh_proj", "shared_head")
    zero_position_zero = False

    def __init__(self, *args: Any, first_layer: int, **kwargs: Any):
        """``ModuleStackHead``'s arguments; module ``i`` is checkpoint layer ``first_layer + i``."""
        super().__init__(*args, **kwargs)
        self.first_layer = first_layer

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.enorm(embedded)
        x = m.eh_proj(mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        return m.shared_head.norm

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        sh = self.modules_[step % self.num_modules].shared_head
        return sh["head"](head_hidden) if "head" in sh else self._shared_lm_head(head_hidden)

    # --- checkpoint naming ---------------------------------------------------------------
    def module_prefix(self, i: int) -> str:
        return f"model.layers.{self.first_layer + i}."

    def checkpoint_name(self, path: str) -> str:
        """``modules_.{i}.shared_head.norm`` -> ``model.layers.{n+i}.transformer.shared_head.norm``,
        ``shared_head.head`` -> ``transformer.shared_head.output``; the rest as ``ModuleStackHead``."""
        prefix, found, rest = super().checkpoint_name(path).partition(".shared_head")
        if not found:
            return prefix
        if rest == ".head" or rest.startswith(".head."):
            rest = ".output" + rest[len(".head") :]
        return f"{prefix}.transformer.shared_head{rest}"

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """The checkpoint's ``transformer.shared_head.*`` as ``shared_head.*`` (``output`` ->
        ``head``, dropped where it equals the trunk's LM head); embedding copies and rotary
        buffers dropped."""
        own_head = "head" in self.modules_[i].shared_head
        out = {}
        for k, v in tensors.items():
            if (
                k.startswith("embed_tokens.")
                or "rotary_emb." in k
                or (k.startswith(OWN_HEAD) and not own_head)
            ):
                continue
            for ckpt, ours in _RENAMES:
                if k.startswith(ckpt):
                    k = ours + k[len(ckpt) :]
                    break
            out[k] = v
        return out

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
    for i in range(num_layers):
        prefix = head.module_prefix(i) + OWN_HEAD
        own = load_tensors(src.model_dir, src.index, keys_with_prefix(src.index, prefix))
        own = {k[len(prefix) :]: v for k, v in own.items()}
        if own and not same_as_trunk_lm_head(own, src.trunk):
            head.modules_[i].shared_head.head = nn.Linear(
                args.hidden_size, own["weight"].shape[0], bias=False
            )
    return head
