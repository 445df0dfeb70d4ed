"""The DeepSeek-V3 / GLM-4.5 MTP layout: extra decoder layers past ``num_hidden_layers``.

Module ``i`` lives at ``model.layers.{num_hidden_layers + i}``:

    e = embed(next_token), zeroed at sequence position 0
    x = eh_proj(concat([enorm(e), hnorm(hidden)], -1))   # embedding FIRST
    x = <that layer's own decoder block>(x)   # self_attn/mlp/input_layernorm/... at the same prefix
    out = shared_head.norm(x)                 # -> shared_head.head (the checkpoint's own LM head copy)

Count: ``num_nextn_predict_layers`` (1 in every published DeepSeek/GLM checkpoint). Draft
step ``s`` uses module ``s % n`` (see ``ModuleStackHead``). The checkpoint's copy of the
embedding at that prefix (``embed_tokens``) is ignored in favour of the trunk's;
``shared_head.head`` is kept only when it differs from the trunk's LM head (DeepSeek ships
an identical copy, so normally nothing extra stays in memory).

hidden_source default "post_norm": vLLM's and SGLang's DeepSeek MTP take the hidden state
the target model returns, which is after its final norm. The paper says only "the
representation given by the main model", so this is disputed (some training code feeds
the pre-norm state); ``hidden_source="pre_norm"`` switches it, to be settled by measured
acceptance. Chaining (step >= 1) feeds back the module output *after* ``shared_head.norm``
(``chain_source = "post_norm"``): SGLang's ``deepseek_nextn.py`` always returned the normed
state, and vLLM's ``deepseek_mtp.py`` moved to it after measuring pre-norm feedback collapse
GLM-4.5's acceptance at position 2. ``max_depth`` is None: modules cycle, no limit is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, ModuleStackHead, build_layer_like, model_args_of
from mtplx.heads.weights import (
    HeadSource,
    MissingHeadError,
    keys_with_prefix,
    load_tensors,
    same_as_trunk_lm_head,
    split_mla_kv_b_proj,
    stack_experts,
)

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "deepseek"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
OWN_HEAD = "shared_head.head."  # the module's copy of the LM head


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size, eps=eps)


class DeepSeekMTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, eps)


class DeepSeekMTPHead(ModuleStackHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"
    mask_as_array = True  # mlx-lm's MLA attention applies the mask with mx.where
    module_class = DeepSeekMTPModule
    own_keys = ("enorm", "hnorm", "eh_proj", "shared_head")  # everything else at the prefix is the block
    # Split per attention head by split_mla_kv_b_proj (16.8 M parameters in V3: 34 MB as bfloat16).
    fp8_dequantized = ("kv_b_proj",)

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

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """The trunk's embedding serves (the module's ``embed_tokens`` copy is dropped), and so
        does its LM head unless the module has its own; HF experts and MLA ``kv_b_proj`` become
        mlx-lm's stacked experts and per-head projections."""
        own_head = "head" in self.modules_[i].shared_head
        tensors = {
            k: v
            for k, v in tensors.items()
            if not k.startswith("embed_tokens.") and (own_head or not k.startswith(OWN_HEAD))
        }
        args = model_args_of(src.trunk.model)
        stack_experts(tensors, "mlp", int(getattr(args, "n_routed_experts", 0) or 0))
        split_mla_kv_b_proj(tensors, "self_attn", args, src.config)
        return tensors


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> DeepSeekMTPHead:
    """An unloaded head for checkpoint layers ``num_hidden_layers + i``, checked against what the
    checkpoint ships; a module keeps its own LM head only where its copy differs from the trunk's."""
    args = model_args_of(src.trunk.model)
    first = int(args.num_hidden_layers)
    if not any(k.startswith(f"model.layers.{first + i}.") for k in src.index for i in range(num_layers)):
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.layers.{first}.* tensors"
        )
    for i in range(num_layers):
        if f"model.layers.{first + i}.eh_proj.weight" not in src.index:
            raise MtplxError(f"{src.source}: MTP layer model.layers.{first + i} has no eh_proj.weight")
    head = DeepSeekMTPHead(
        [build_layer_like(src.trunk.layers[-1], args, first + i) for i in range(num_layers)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=first,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[len(src.trunk.layers) - 1] * num_layers,
    )
    for i in range(num_layers):
        prefix = head.module_prefix(i) + OWN_HEAD
        own = load_tensors(src.model_dir, src.index, keys_with_prefix(src.index, prefix))
        own = {k[len(prefix) :]: v for k, v in own.items()}
        if own and not same_as_trunk_lm_head(own, src.trunk):
            # Filled when the weights load, and quantized as the checkpoint stores it.
            head.modules_[i].shared_head.head = nn.Linear(
                args.hidden_size, own["weight"].shape[0], bias=False
            )
    return head


# --- split drafters (a GLM MTP layer published as its own directory) --------------------


@dataclass(frozen=True)
class SplitNames:
    """Where a split drafter keeps one DeepSeek-layout module's tensors (names relative to the
    in-checkpoint prefix ``model.layers.{n}.`` on the left, the drafter's names on the right).

    mlx-vlm 0.7.10's splitters, read for this: ``glm_moe_dsa_mtp/split.py`` (GLM-5) prefixes the
    layer's names with ``mtp.`` and renames ``shared_head.norm`` to ``shared_head_norm``;
    ``glm4_moe_lite_mtp/split.py`` (GLM-4.7-Flash) puts ``enorm`` / ``hnorm`` / ``eh_proj`` /
    ``shared_head_norm`` under ``model.``, the decoder block under ``model.mtp_block.``, the
    embedding copy at ``model.embed_tokens`` and the LM-head copy at ``lm_head``. Both split MLA's
    ``kv_b_proj`` into mlx-lm's ``embed_q`` / ``unembed_out`` and stack the experts already.
    A split drafter shares the target's embedding and LM head (mlx-vlm's ``bind``): the copies
    (``dropped``) are never read."""

    prefixes: tuple[str, ...]
    own: tuple[tuple[str, str], ...]  # (in-checkpoint local prefix, drafter prefix), own tensors
    block_prefix: str
    dropped: tuple[str, ...]

    def to_split(self, local: str) -> str:
        for mine, theirs in self.own:
            if local == mine.rstrip("."):
                return theirs.rstrip(".")
            if local.startswith(mine):
                return theirs + local[len(mine) :]
        return self.block_prefix + local

    def to_local(self, name: str) -> str | None:
        if name.startswith(self.dropped):
            return None
        for mine, theirs in self.own:
            if name.startswith(theirs):
                return mine + name[len(theirs) :]
        return name[len(self.block_prefix) :] if name.startswith(self.block_prefix) else None


_OWN = ("enorm.", "hnorm.", "eh_proj.")
GLM_MOE_DSA_SPLIT = SplitNames(
    prefixes=("mtp.",),
    own=(("shared_head.norm.", "mtp.shared_head_norm."), *((k, f"mtp.{k}") for k in _OWN)),
    block_prefix="mtp.",
    dropped=("mtp.embed_tokens.", "mtp.shared_head.head."),
)
GLM4_MOE_LITE_SPLIT = SplitNames(
    prefixes=("model.",),
    own=(("shared_head.norm.", "model.shared_head_norm."), *((k, f"model.{k}") for k in _OWN)),
    block_prefix="model.mtp_block.",
    dropped=("model.embed_tokens.", "lm_head."),
)


class SplitDeepSeekHead(DeepSeekMTPHead):
    """One DeepSeek-layout module read from a split drafter's names (``SplitNames``); otherwise
    the in-checkpoint head: same math, same cache, same hidden source (the target's post-norm
    state, as mlx-vlm's GLM drafters are handed it)."""

    def __init__(self, *args: Any, names: SplitNames, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._names = names  # a plain attribute: not a parameter

    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return self._names.prefixes

    def checkpoint_name(self, path: str) -> str:
        name, prefix = super().checkpoint_name(path), self.module_prefix(0)
        return self._names.to_split(name[len(prefix) :]) if name.startswith(prefix) else name

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        prefix = self.module_prefix(0)
        local = {k: self._names.to_local(k) for k in tensors}
        return super().sanitize({prefix + n: tensors[k] for k, n in local.items() if n is not None}, src)


def build_split_head(src: HeadSource, names: SplitNames) -> SplitDeepSeekHead:
    """An unloaded head for a GLM split drafter (``mtplx.heads.split_drafter``): one module, its
    block built like the target's last layer at index ``num_hidden_layers`` (MoE there as in the
    checkpoint), the target's embedding and LM head shared."""
    args = model_args_of(src.trunk.model)
    first = int(args.num_hidden_layers)
    needed = names.to_split("eh_proj.weight")
    if needed not in src.index:
        raise MtplxError(f"{src.source}: a split MTP drafter of this layout needs {needed}; it has none")
    return SplitDeepSeekHead(
        [build_layer_like(src.trunk.layers[-1], args, first)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=first,
        trunk=src.trunk,
        hidden_source=DEFAULT_HIDDEN_SOURCE,
        cache_like=[len(src.trunk.layers) - 1],
        names=names,
    )
