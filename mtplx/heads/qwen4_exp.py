"""The Qwen3.8-Flash-Next (``qwen4_exp``) MTP layout: ``mtp.*`` beside a hyper-connection trunk.

The trunk keeps ``hc_count`` residual streams (width ``hc_count * H``) and collapses them only at
the end, with ``hyper_connection_mixer`` (no final norm; `mtplx.trunk.vlm_text.FINAL_MIXERS` shows
it to the trunk as its "norm"). The head (mlx-vlm 0.7.10
``speculative/drafters/qwen4_exp_mtp/qwen4_exp_mtp.py``, ``Qwen4ExpMTPDraftModel``):

    e = fc_embedding(pre_fc_norm_embedding(embed(next_token)))            # [.., H]
    s = fc_hidden(pre_fc_norm_hidden(streams).reshape(.., hc_count, H))   # one RMS over all hc*H
    x = (e[.., None, :] + s).reshape(.., hc_count * H)                    # the embedding added to every stream
    x = layers[0](x)        # a trunk decoder layer: QSA attention + MoE inside hyper-connections
    out = hyper_connection_mixer(x)                                       # -> the trunk's LM head

Norms are Qwen4's zero-centred RMSNorm (``x * (1 + w)``), kept as mlx-vlm's own modules
(``Qwen4ExpRMSNorm``): the checkpoint's weights are read as they are, no offset conversion.

Hyper-connection convention (which trunk state the head reads; what it chains on), from
mlx-vlm 0.7.10:

* reads: the trunk's **streams before the final mixer**, all ``hc_count`` of them concatenated
  ([B, T, hc_count * H]; ``hidden_source`` "pre_norm": the mixer is the trunk's "norm"):
  ``models/qwen4_exp/language.py`` ``LanguageModel.__call__`` forces ``capture_layer_ids=[]``
  with ``return_hidden`` ("Native Qwen4 MTP consumes the complete hyper-connection state, before
  the final 4-stream mixer"), and the drafter's ``_target_hidden`` refuses any other width;
* chains on: its own layer's output streams, **before** its mixer (``chain_source``
  "pre_norm"): ``_forward_hidden`` returns ``(self.hyper_connection_mixer(hidden), hidden)``
  and ``mtp_base.draft_block`` feeds the second back (``h_prev``), the first only to the LM head;
* positions: the head's own cache offset (``mtp_base._position_ids``: ``_next_position``, which
  the prefill starts at 0 and every forward and trim moves with the cache);
* position 0's embedding is not zeroed (``prefill_from_target_hidden`` pairs every hidden with
  the next token's plain embedding).

Tensors (the published checkpoint): ``mtp.pre_fc_norm_{embedding,hidden}``,
``mtp.fc_{embedding,hidden}``, ``mtp.layers.0.*`` (the routed experts fused as
``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj``, as mlx-vlm's drafter ``sanitize``
reads them), ``mtp.hyper_connection_mixer.*``. The split drafter (``qwen4_exp_mtp``, mlx-vlm's
``split.py``) holds the same names after the drafter's own ``sanitize`` (no ``mtp.`` prefix,
``switch_mlp`` experts): ``build_split_head``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, model_args_of
from mtplx.heads.weights import (
    HeadSource,
    check_one_layer_drafter,
    check_one_layer_head,
    strip_prefix,
)

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "qwen4_exp"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"
KEY_PREFIX = "mtp."


def _layer_args(text_args: Any) -> Any:
    """The drafter's one-layer config: a QSA layer, no PLE (``Qwen4ExpMTPDraftModel.__init__``)."""
    return replace(
        text_args,
        num_hidden_layers=1,
        layer_types=["qwen_sparse_attention"],
        full_attention_interval=1,
        ple_layer_ids=[],
    )


class Qwen4ExpMTPHead(MTPHead):
    """The Qwen3.8-Flash-Next MTP module (see the module docstring); shares embed and lm_head."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "pre_norm"

    def __init__(
        self, text_args: Any, *, key_prefix: str = KEY_PREFIX, fused_experts: bool = True, **shared: Any
    ):
        """``key_prefix`` / ``fused_experts``: the checkpoint's ``mtp.`` prefix and fused
        ``experts.gate_up_proj`` (the published file), or neither (a split drafter's mlx names)."""
        from mlx_vlm.models.qwen4_exp.language import (
            Qwen4ExpDecoderLayer,
            Qwen4ExpGatedResidual,
            Qwen4ExpRMSNorm,
        )

        super().__init__(**shared)
        hidden, eps = text_args.hidden_size, text_args.rms_norm_eps
        self.hc_count = text_args.hc_count
        self.pre_fc_norm_embedding = Qwen4ExpRMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = Qwen4ExpRMSNorm(self.hc_count * hidden, eps=eps)
        self.fc_embedding = nn.Linear(hidden, hidden, bias=False)
        self.fc_hidden = nn.Linear(hidden, hidden, bias=False)
        layer_args = _layer_args(text_args)
        self.layers = [Qwen4ExpDecoderLayer(layer_args, layer_idx=0)]
        self.hyper_connection_mixer = Qwen4ExpGatedResidual(layer_args, use_combine=False)
        self.key_prefix = key_prefix

    def decoder_layers(self) -> list[nn.Module]:
        return self.layers

    def _fuse(self, hidden: mx.array, next_tokens: mx.array) -> mx.array:
        width = hidden.shape[-1]
        if width != self.hc_count * self.fc_hidden.weight.shape[0]:
            raise MtplxError(
                f"a {LAYOUT} head reads the trunk's {self.hc_count} hyper-connection streams "
                f"(width {self.hc_count * self.fc_hidden.weight.shape[0]}), got width {width}"
            )
        e = self.fc_embedding(self.pre_fc_norm_embedding(self._embed(next_tokens)))
        streams = self.pre_fc_norm_hidden(hidden).reshape(*hidden.shape[:-1], self.hc_count, -1)
        return (e[..., None, :] + self.fc_hidden(streams)).reshape(hidden.shape)

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        from mlx_vlm.models.qwen3_5.language import _create_qwen3_5_attention_mask

        x = self._fuse(hidden, next_tokens)
        caches = cache if cache is not None else [None] * len(self.layers)
        first = caches[0]
        start = first.offset if first is not None else 0
        if isinstance(start, mx.array):  # a batch's ragged rows: each row's own offset [B]
            positions = start[:, None].astype(mx.int32) + mx.arange(x.shape[1], dtype=mx.int32)[None]
        else:
            positions = (mx.arange(x.shape[1], dtype=mx.int32) + start)[None]
        mask = _create_qwen3_5_attention_mask(x, first)
        for layer, c in zip(self.layers, caches):
            x = layer(x, next_tokens, mask=mask, cache=c, position_ids=positions)
        return x

    def _final_norm(self, step: int) -> nn.Module:
        return self.hyper_connection_mixer

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (self.key_prefix,)

    def checkpoint_name(self, path: str) -> str:
        # mlx-side names (``switch_mlp`` experts): what `mtplx convert` writes and a split drafter
        # holds; ``sanitize`` reads the published fused ``experts.gate_up_proj`` as well.
        return self.key_prefix + path

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        return split_fused_experts(strip_prefix(tensors, self.key_prefix), len(self.layers))


def split_fused_experts(weights: dict[str, mx.array], num_layers: int) -> dict[str, mx.array]:
    """``layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` -> mlx-vlm's
    ``switch_mlp.{gate,up,down}_proj.weight`` (the drafter's ``sanitize``: gate rows first)."""
    for i in range(num_layers):
        stem = f"layers.{i}.mlp."
        for suffix in ("", ".weight"):
            fused = weights.pop(f"{stem}experts.gate_up_proj{suffix}", None)
            if fused is None:
                continue
            gate, up = mx.split(fused, 2, axis=-2)
            weights[f"{stem}switch_mlp.gate_proj.weight"] = gate
            weights[f"{stem}switch_mlp.up_proj.weight"] = up
            weights[f"{stem}switch_mlp.down_proj.weight"] = weights.pop(f"{stem}experts.down_proj{suffix}")
    return weights


def _qsa_layer(trunk: Any) -> int:
    """A trunk QSA layer: its cache (KV + indexer keys) is the head layer's kind."""
    for i, layer in enumerate(trunk.layers):
        if not getattr(layer, "is_linear", True):
            return i
    raise MtplxError(f"{type(trunk.model).__name__}: no QSA attention layer to model the MTP cache on")


def _text_args(src: HeadSource) -> Any:
    args = model_args_of(src.trunk.model)
    if getattr(args, "hc_count", None) is None:
        raise MtplxError(f"{src.source}: a {LAYOUT} head needs a Qwen3.8-Flash-Next trunk (hc_count)")
    return args


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> Qwen4ExpMTPHead:
    """An unloaded head for the checkpoint's ``mtp.*`` tensors, checked against what it ships."""
    check_one_layer_head(src, num_layers, LAYOUT, "mtp.fc_hidden.weight")
    return Qwen4ExpMTPHead(
        _text_args(src), trunk=src.trunk, hidden_source=hidden_source, cache_like=[_qsa_layer(src.trunk)]
    )


def build_split_head(src: HeadSource, num_layers: int) -> Qwen4ExpMTPHead:
    """An unloaded head for a ``qwen4_exp_mtp`` split drafter beside a Qwen3.8-Flash-Next trunk."""
    check_one_layer_drafter(src, num_layers, "qwen4_exp_mtp", "fc_hidden.weight")
    return Qwen4ExpMTPHead(
        _text_args(src),
        key_prefix="",
        trunk=src.trunk,
        hidden_source=DEFAULT_HIDDEN_SOURCE,
        cache_like=[_qsa_layer(src.trunk)],
    )
