"""The Qwen3-Next MTP layout (Qwen3-Next, Qwen3.5, Qwen3.6), also the layout of forged heads.

    e = pre_fc_norm_embedding(embed(next_token))
    h = pre_fc_norm_hidden(hidden)
    x = fc(concat([e, h], -1))            # 2H -> H, no bias; embedding FIRST
    x = layers[0..N-1](x) with the head's own KV cache
    out = norm(x)                         # post-norm, read by the trunk's (shared) lm_head

Checkpoint tensors: ``mtp.fc.weight``, ``mtp.pre_fc_norm_{embedding,hidden}.weight``,
``mtp.layers.{i}.*`` (a full-attention decoder layer of the trunk, MoE MLP in MoE
variants), ``mtp.norm.weight``; count from ``mtp_num_hidden_layers`` (or
``num_nextn_predict_layers``). Every published checkpoint has one layer; with N > 1 a
checkpoint head uses layer ``s % N`` at draft step ``s`` after the shared ``fc`` (vLLM's
``qwen3_next_mtp.py``: ``layers[spec_step_idx % num_mtp_layers]``), every layer filling its
own cache at every position as ``ModuleStackHead`` does. A forged head (``layer_per_step=False``)
is one module whose layers run in sequence. Norm weights: HF Qwen3-Next/3.5 store RMSNorm
weights as offsets from 1; which convention a head's tensors follow is decided by provenance
(``weights.norm_rule``: mtplx's conversion mark, the model type, who wrote the file), per
tensor by its mean only when that is unknown.

hidden_source default "post_norm": the serving implementations that published
Qwen3-Next MTP acceptance (vLLM's and SGLang's qwen3_next MTP) hand the drafter the
hidden state the target model returns, which is after its final norm, and the head
itself ends in a norm, so its own output (fed back when chaining) is post-norm too.
Training-side code is not public, so this is the serving convention, to be
confirmed by measured acceptance (``hidden_source="pre_norm"`` switches it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, build_layer_like, model_args_of, run_every_module
from mtplx.heads.weights import (
    HeadSource,
    MissingHeadError,
    NormRule,
    find_prefix,
    norm_rule,
    plain_norms,
    stack_experts,
    strip_prefix,
)

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "qwen3_next"
# Model types whose raw (Hugging Face) checkpoints store RMSNorm weights as offsets from 1.
OFFSET_NORM_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
KEY_PREFIX = "mtp."


class Qwen3NextMTPHead(MTPHead):
    """fc(concat[norm(embed(t)), norm(h)]) -> N decoder layers -> norm. Shares embed and lm_head."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE

    def __init__(
        self,
        layers: Sequence[nn.Module],
        hidden_size: int,
        *,
        eps: float = 1e-6,
        key_prefix: str = KEY_PREFIX,
        layer_per_step: bool = False,
        norms: NormRule | None = None,
        **shared: Any,
    ):
        """``layers``: already-built decoder layers of the trunk's architecture (called as
        ``layer(x, mask, cache)``, as every mlx-lm layer is); ``shared``: ``MTPHead``'s keywords
        (``trunk=`` or ``embed=``/``lm_head=``, ``hidden_source=``). ``norms``: the checkpoint's
        norm convention when its provenance is known (a split drafter's: plain scales), else
        None and ``weights.norm_rule`` decides."""
        super().__init__(**shared)
        if not layers:
            raise ValueError("a Qwen3-Next MTP head needs at least one decoder layer")
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = list(layers)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.key_prefix = key_prefix
        # True: layer s % N drafts step s (checkpoint heads); False: the layers form one module.
        self.layer_per_step = layer_per_step
        self._norms = norms  # a plain attribute: not a parameter

    def decoder_layers(self) -> list[nn.Module]:
        return self.layers

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        e = self.pre_fc_norm_embedding(self._embed(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h.astype(e.dtype)], axis=-1))
        if not self.layer_per_step:
            return self._run_layers(x, self.layers, cache)
        caches = cache if cache is not None else [None] * len(self.layers)
        return run_every_module(
            lambda i: self._run_layers(x, [self.layers[i]], [caches[i]]), caches, step % len(self.layers)
        )

    def _final_norm(self, step: int) -> nn.Module:
        return self.norm

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (self.key_prefix,)

    def checkpoint_name(self, path: str) -> str:
        return self.key_prefix + path

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        weights = strip_prefix(tensors, self.key_prefix)
        num_experts = int(getattr(model_args_of(src.trunk.model), "num_experts", 0) or 0)
        for i in range(len(self.layers)):
            weights = stack_experts(weights, f"layers.{i}.mlp", num_experts)
        rule = self._norms or norm_rule(
            src.config, src.model_dir, src.index, tensors, OFFSET_NORM_MODEL_TYPES
        )
        return plain_norms(weights, rule, str(src.source))


def _attention_template(trunk: Any) -> tuple[nn.Module, int]:
    """The trunk's first full-attention layer and its index: the MTP layer is built the same way,
    so it gets the same attention and the same MLP kind (dense or MoE) as the trunk would there."""
    for i, layer in enumerate(trunk.layers):
        if not getattr(layer, "is_linear", False) and "self_attn" in layer:
            return layer, i
    raise MtplxError(f"{type(trunk.model).__name__}: no full-attention trunk layer to model the MTP layer on")


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> Qwen3NextMTPHead:
    """An unloaded head for the checkpoint's ``mtp.*`` tensors (``num_layers`` declared), checked
    against what the checkpoint ships."""
    found = find_prefix(src.index, r"mtp\.fc\.weight")
    if found is None:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no mtp.* tensors"
        )
    prefix = found + KEY_PREFIX
    layer_keys = (k[len(prefix) + 7 :] for k in src.index if k.startswith(prefix + "layers."))
    present = {int(k.split(".")[0]) for k in layer_keys}
    if present != set(range(num_layers)):
        raise MtplxError(
            f"{src.source}: config declares {num_layers} MTP layer(s), checkpoint has mtp.layers {sorted(present)}"
        )
    return _head_like_the_trunk(src, num_layers, hidden_source, prefix)


def _head_like_the_trunk(
    src: HeadSource, num_layers: int, hidden_source: str, key_prefix: str, norms: NormRule | None = None
) -> Qwen3NextMTPHead:
    """``num_layers`` layers built like the trunk's first full-attention layer, one per step."""
    args = model_args_of(src.trunk.model)
    template, idx = _attention_template(src.trunk)
    return Qwen3NextMTPHead(
        [build_layer_like(template, args, idx) for _ in range(num_layers)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        trunk=src.trunk,
        hidden_source=hidden_source,
        key_prefix=key_prefix,
        layer_per_step=True,
        norms=norms,
        cache_like=[idx] * num_layers,
    )


# mlx-vlm's splitter adds 1 to every offset-style norm before writing (mlx-vlm 0.7.10
# ``qwen3_5_mtp/qwen3_5_mtp.py`` ``sanitize``; ``split.py`` for Qwen3-Next, and an MLX source
# it re-splits was shifted by mlx-lm's own conversion): the file holds plain scales.
SPLIT_DRAFTER_NORMS = NormRule(False, "plain scales: a split MTP drafter (mlx-vlm's splitter added 1)")


def build_split_head(src: HeadSource, num_layers: int) -> Qwen3NextMTPHead:
    """An unloaded head for a ``qwen3_5_mtp`` split drafter (``mtplx.heads.split_drafter``): the
    tensors of ``build_head``'s layout without the ``mtp.`` prefix, norms as plain scales, the
    layer built like the target's first full-attention layer, the target's post-norm hidden read."""
    present = {int(k.split(".")[1]) for k in src.index if k.startswith("layers.")}
    if "fc.weight" not in src.index or present != set(range(num_layers)):
        raise MtplxError(
            f"{src.source}: a qwen3_5_mtp drafter of {num_layers} layer(s) needs fc.weight and "
            f"layers 0..{num_layers - 1}; it has layers {sorted(present)}"
        )
    return _head_like_the_trunk(src, num_layers, DEFAULT_HIDDEN_SOURCE, "", SPLIT_DRAFTER_NORMS)
