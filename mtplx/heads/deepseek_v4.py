"""The DeepSeek-V4 (``deepseek_v4``) MTP layout: ``mtp.{i}.*`` beside a hyper-connection trunk.

The trunk keeps ``hc_mult`` residual streams [B, T, hc_mult, H] and ends ``norm(hc_head(streams))``
(`mtplx.trunk.vlm_text.StreamsHead` shows that pair to the trunk as its final norm, so the tap's
``pre`` is the streams, flattened to [B, T, hc_mult * H]). The head (mlx-vlm 0.7.10
``speculative/drafters/deepseek_v4_mtp/deepseek_v4_mtp.py``, ``DeepseekV4MTPDraftModel``):

    s = h_proj(hnorm(streams))                   # per stream: [B, T, hc_mult, H]
    x = s + e_proj(enorm(embed(next_token)))[:, :, None]   # the embedding added to every stream
    x = decoder(x)        # one DeepSeek-V4 block: sliding-window attention (no compression,
                          # no hash routing) and MoE, each inside its hyper-connection
    out = norm(hc_head(x))                       # the head's OWN hc_head and norm -> the LM head

Hyper-connection convention (which trunk state the head reads; what it chains on), from
mlx-vlm 0.7.10:

* reads: the trunk's **streams before its hc_head** (``hidden_source`` "pre_norm"): the
  language model's ``return_hidden`` hands the drafter ``hidden_sink``, the last layer's output
  before ``norm(hc_head(.))``, and ``_target_hidden`` accepts [B, T, hc_mult * H] or
  [B, T, hc_mult, H] only;
* chains on: its own block's output streams, **before** its hc_head (``chain_source``
  "pre_norm"): ``_forward_hidden`` returns ``(norm(hc_head(h)), h)`` and ``mtp_base.draft_block``
  feeds the second back;
* positions: the head's own cache offset (``_next_position`` counts the drafter's forwards as
  the cache does);
* position 0's embedding is not zeroed.

Its cache: a sliding window of ``sliding_window`` (the drafter's ``make_cache``), here mlx-lm's
``RotatingKVCache`` (mlx-vlm's block reads only ``offset`` / ``update_and_fetch`` / ``make_mask``),
so `mtplx.trunk.rollback.mark_drafts` / ``trim_kv`` drop draft entries exactly.

Tensors: the official layout under ``mtp.{i}.`` (one block; DeepSeek-V4-Flash ships it as
``mtp.1.``, others as ``mtp.0.``: `shipped_prefix`) (``e_proj``, ``h_proj``, ``enorm``, ``hnorm``,
``norm``, ``hc_head_{fn,base,scale}``, ``attn.*``, ``attn_norm``, ``ffn.experts.{e}.w{1,2,3}``,
``hc_{attn,ffn}_{fn,base,scale}``), renamed by the drafter's own ``sanitize`` (it is idempotent on
the mlx-side names `mtplx convert` writes). The published FP8 layers (e4m3 with E8M0 scales per
128 x 128 block) and FP4 routed experts (e2m1 with E8M0 scales per 32) load as MLX mxfp8 / mxfp4
layers of the same bytes (`packed_fp8_fp4`), as mlx-vlm's drafter quantizes them. The split drafter (``deepseek_v4_mtp``, mlx-vlm's
``split.py``) holds the same mlx-side names with no prefix: ``build_split_head``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, model_args_of
from mtplx.heads.weights import (
    HeadSource,
    MissingHeadError,
    check_one_layer_drafter,
    check_one_layer_head,
    e8m0_blocks_as_mxfp8,
    mxfp4_bytes,
    strip_prefix,
)
from mtplx.trunk.vlm_text import StreamsHead

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "deepseek_v4"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"
KEY_PREFIX = "mtp.0."


def _block_args(args: Any) -> Any:
    """The drafter's one-block config: window-only attention, no hash routing."""
    return replace(args, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)


class DeepseekV4MTPHead(MTPHead):
    """The DeepSeek-V4 MTP block (see the module docstring); shares the trunk's embed and lm_head."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "pre_norm"
    mask_as_array = True

    def __init__(self, args: Any, *, key_prefix: str = KEY_PREFIX, **shared: Any):
        from mlx_vlm.models.deepseek_v4.hyper_connection import HyperHead
        from mlx_vlm.models.deepseek_v4.language import DeepseekV4Block

        super().__init__(**shared)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.args = args
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.decoder = DeepseekV4Block(_block_args(args), layer_idx=0)
        self.hc_head = HyperHead(args)
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.key_prefix = key_prefix

    def decoder_layers(self) -> list[nn.Module]:
        return [self.decoder]

    def make_cache(self) -> list:
        from mlx_lm.models.cache import RotatingKVCache

        return [RotatingKVCache(max_size=self.args.sliding_window)]

    def _streams(self, hidden: mx.array) -> mx.array:
        hc, width = self.args.hc_mult, self.args.hidden_size
        if hidden.shape[-1] != hc * width:
            raise MtplxError(
                f"a {LAYOUT} head reads the trunk's {hc} hyper-connection streams "
                f"(width {hc * width}), got width {hidden.shape[-1]}"
            )
        return hidden.reshape(*hidden.shape[:-1], hc, width)

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        from mlx_vlm.models.base import create_attention_mask

        e = self.e_proj(self.enorm(self._embed(next_tokens)))
        x = self.h_proj(self.hnorm(self._streams(hidden))) + e[:, :, None, :]
        c = cache[0] if cache else None
        mask = create_attention_mask(
            x[:, :, 0, :], c, window_size=self.args.sliding_window, return_array=True
        )
        x = self.decoder(x, mask, c, next_tokens)
        return x.reshape(*x.shape[:2], -1)

    def _final_norm(self, step: int) -> nn.Module:
        return StreamsHead(self.hc_head, self.norm, self.args.hc_mult)

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return (self.key_prefix,)

    def checkpoint_name(self, path: str) -> str:
        return self.key_prefix + path  # mlx-side names: the drafter's sanitize reads them as they are

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        from mlx_vlm.speculative.drafters.deepseek_v4_mtp.deepseek_v4_mtp import DeepseekV4MTPDraftModel

        local = packed_fp8_fp4(strip_prefix(tensors, self.key_prefix), f"{src.source}: the {LAYOUT} head")
        return DeepseekV4MTPDraftModel.sanitize(SimpleNamespace(args=self.args), local)


def packed_fp8_fp4(local: dict[str, mx.array], what: str) -> dict[str, mx.array]:
    """The official FP8 / FP4 tensors as MLX's packed layers, the checkpoint's own bytes (no float
    copy): an ``x.weight`` with an ``x.scale`` (``x.weight_scale_inv`` in the Transformers
    namespace; a hyper-connection's own ``scale`` has no weight beside it) is

    * FP4 (int8 / uint8 [m, n/2], scales [m, n/32]: the routed experts) -> mxfp4;
    * FP8 (e4m3 bytes [m, n], E8M0 scales per 128 x 128 block) -> mxfp8;

    as mlx-vlm 0.7.10's drafter ``sanitize`` reads them, edge blocks cropped; `quantize_as_packed`
    then makes those layers quantized as their weights say (mlx-vlm's ``make_quantization_config``:
    mxfp4 experts, mxfp8 for the rest)."""
    out = dict(local)
    for key in [k for k in local if k.endswith((".scale", ".weight_scale_inv"))]:
        module = key.removesuffix(".scale").removesuffix(".weight_scale_inv")
        weight = local.get(f"{module}.weight")
        if weight is None:
            continue
        scale = out.pop(key)
        if weight.dtype not in (mx.uint8, mx.int8) or scale.dtype != mx.uint8:
            raise MtplxError(
                f"{what}: {module} has a block scale of {scale.dtype} beside a {weight.dtype} weight "
                "(expected FP8 / FP4 bytes with E8M0 scales)"
            )
        if scale.shape[-1] * 16 == weight.shape[-1]:
            out[f"{module}.weight"], out[f"{module}.scales"] = mxfp4_bytes(weight, scale)
        else:
            out[f"{module}.weight"], out[f"{module}.scales"] = e8m0_blocks_as_mxfp8(weight, scale)
    return out


def _args(src: HeadSource) -> Any:
    args = model_args_of(src.trunk.model)
    if getattr(args, "hc_mult", None) is None or getattr(args, "compress_ratios", None) is None:
        raise MtplxError(
            f"{src.source}: a {LAYOUT} head needs a DeepSeek-V4 trunk (hc_mult, compress_ratios)"
        )
    return args


def shipped_prefix(src: HeadSource) -> str:
    """``mtp.{i}.`` of the one MTP block the checkpoint ships (DeepSeek-V4-Flash: ``mtp.1.``;
    mlx-vlm's drafter ``sanitize`` strips any index); MissingHeadError when it ships none."""
    found = sorted({m.group(1) for m in map(_SHIPPED.fullmatch, src.index) if m}, key=int)
    if not found:
        raise MissingHeadError(
            f"{src.source}: config declares an MTP layer but the checkpoint ships no mtp.N.e_proj.weight"
        )
    if len(found) > 1:
        raise MtplxError(
            f"{src.source}: a {LAYOUT} head has one MTP block, the checkpoint ships {len(found)} "
            f"(mtp.{', mtp.'.join(found)})"
        )
    return f"mtp.{found[0]}."


_SHIPPED = re.compile(r"mtp\.(\d+)\.e_proj\.weight")


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> DeepseekV4MTPHead:
    """An unloaded head for the checkpoint's ``mtp.{i}.*`` tensors, checked against what it ships."""
    prefix = shipped_prefix(src)
    check_one_layer_head(src, num_layers, LAYOUT)
    return DeepseekV4MTPHead(_args(src), key_prefix=prefix, trunk=src.trunk, hidden_source=hidden_source)


def build_split_head(src: HeadSource, num_layers: int) -> DeepseekV4MTPHead:
    """An unloaded head for a ``deepseek_v4_mtp`` split drafter beside a DeepSeek-V4 trunk."""
    check_one_layer_drafter(src, num_layers, "deepseek_v4_mtp", "e_proj.weight")
    return DeepseekV4MTPHead(_args(src), key_prefix="", trunk=src.trunk, hidden_source=DEFAULT_HIDDEN_SOURCE)
