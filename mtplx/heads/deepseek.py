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

The module and its math are ``heads/eh_proj.py``'s (``shared_head.norm`` is its ``final_layernorm``,
``shared_head.head`` its ``lm_head``); this file keeps the names, the mask and the block's tensors.
"""

from __future__ import annotations

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, build_layer_like, model_args_of
from mtplx.heads.eh_proj import EhProjHead, SplitNames, SplitNamesHead
from mtplx.heads.weights import HeadSource, MissingHeadError, split_mla_kv_b_proj, stack_experts

import mlx.core as mx

LAYOUT = "deepseek"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
__all__ = ["DeepSeekMTPHead", "SplitDeepSeekHead", "SplitNames", "build_head", "build_split_head"]


class DeepSeekMTPHead(EhProjHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"
    zero_position_zero = True  # vLLM / SGLang zero position 0's embedding
    mask_as_array = True  # mlx-lm's MLA attention applies the mask with mx.where
    renames = (("shared_head.head.", "lm_head."), ("shared_head.norm.", "final_layernorm."))
    # Split per attention head by split_mla_kv_b_proj (16.8 M parameters in V3: 34 MB as bfloat16).
    fp8_dequantized = ("kv_b_proj",)

    def module_prefix(self, i: int) -> str:
        return f"model.layers.{self.first_layer + i}."

    def _convert_block(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """HF experts and MLA ``kv_b_proj`` as mlx-lm's stacked experts and per-head projections."""
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
    head.attach_own_lm_heads(src, args.hidden_size)
    return head


# --- split drafters (a GLM MTP layer published as its own directory) --------------------


# mlx-vlm 0.7.10's splitters, read for this: ``glm_moe_dsa_mtp/split.py`` (GLM-5) prefixes the
# layer's names with ``mtp.`` and renames ``shared_head.norm`` to ``shared_head_norm``;
# ``glm4_moe_lite_mtp/split.py`` (GLM-4.7-Flash) puts ``enorm`` / ``hnorm`` / ``eh_proj`` /
# ``shared_head_norm`` under ``model.``, the decoder block under ``model.mtp_block.``, the
# embedding copy at ``model.embed_tokens`` and the LM-head copy at ``lm_head``. Both split MLA's
# ``kv_b_proj`` into mlx-lm's ``embed_q`` / ``unembed_out`` and stack the experts already. A split
# drafter shares the target's embedding and LM head (mlx-vlm's ``bind``): the copies are never read.
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


class SplitDeepSeekHead(SplitNamesHead, DeepSeekMTPHead):
    """One DeepSeek-layout module read from a split drafter's names (``SplitNames``); otherwise
    the in-checkpoint head: same math, same cache, same hidden source (the target's post-norm
    state, as mlx-vlm's GLM drafters are handed it)."""


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
