"""The ERNIE-4.5 MTP layout: four parallel lists indexed by MTP layer, not one prefix per layer.

Module ``i`` is spread over ``model.mtp_emb_norm.{i}``, ``model.mtp_hidden_norm.{i}``,
``model.mtp_linear_proj.{i}`` and ``model.mtp_block.{i}.*`` (a decoder layer of the trunk's
kind with a dense MLP of ``intermediate_size``):

    e = embed(next_token), zeroed at sequence position 0
    x = mtp_linear_proj(concat([mtp_emb_norm(e), mtp_hidden_norm(hidden)], -1))   # embedding FIRST
    out = mtp_block(x)                    # residual included; NO final norm
    logits = lm_head(out)                 # the trunk's LM head, on the block's output as it is

References (facts only): vLLM ``model_executor/models/ernie_mtp.py`` and SGLang
``models/ernie4_eagle.py`` (both: the position-0 mask, embedding first in the concatenation,
the block's output with its residual handed to the LM head without a norm; SGLang builds the
block with ``is_mtp=True``, which gives it the dense MLP; the projection's bias follows
``use_bias``). mlx-lm's ``ernie4_5_moe.sanitize`` drops all four names.

Count: ``num_nextn_predict_layers``, else the ``mtp_linear_proj`` indices. hidden_source
"post_norm": both references hand the MTP layer the hidden state the target returns, after its
final norm. vLLM drafts one token only (``spec_step_idx == 0``); mtplx chains module ``s % n``
on its own output (the only state there is, since the layer has no final norm), as for the other
layouts, and measured acceptance decides how deep to draft. Rope: the block is the trunk's
layer class, so it rotates as the trunk does (mlx-lm ``traditional=True``; SGLang
``rope_is_neox_style`` False by default).
"""

from __future__ import annotations

import re
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, ModuleStackHead, build_layer_like, model_args_of
from mtplx.heads.weights import HeadSource, MissingHeadError

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "ernie"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
OWN = ("mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj")
BLOCK = "mtp_block"
_NAME = re.compile(rf"model\.({'|'.join((*OWN, BLOCK))})\.(\d+)\.(.+)")
_NO_NORM = nn.Identity()  # the layer's output goes to the LM head as it is


class ErnieMTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float, bias: bool = False):
        super().__init__()
        self.mtp_emb_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.mtp_hidden_norm = nn.RMSNorm(hidden_size, eps=eps)
        self.mtp_linear_proj = nn.Linear(2 * hidden_size, hidden_size, bias=bias)
        self.block = block


class ErnieMTPHead(ModuleStackHead):
    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    chain_source: HiddenSource = "post_norm"  # no final norm: the output is the only state
    module_class = ErnieMTPModule
    own_keys = OWN

    def __init__(self, blocks: list[nn.Module], hidden_size: int, *, eps: float, bias: bool, **shared: Any):
        """``ModuleStackHead``'s arguments; ``bias``: ``mtp_linear_proj`` has one (``use_bias``)."""
        super().__init__(blocks, hidden_size, eps=eps, **shared)
        if bias:
            for m in self.modules_:
                m.mtp_linear_proj = nn.Linear(2 * hidden_size, hidden_size, bias=True)

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.mtp_emb_norm(embedded)
        x = m.mtp_linear_proj(mx.concatenate([e, m.mtp_hidden_norm(hidden).astype(e.dtype)], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        return _NO_NORM

    # --- checkpoint naming ---------------------------------------------------------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return tuple(f"model.{name}.{i}." for i in range(self.num_modules) for name in (*OWN, BLOCK))

    def checkpoint_name(self, path: str) -> str:
        """``modules_.{i}.mtp_emb_norm.weight`` -> ``model.mtp_emb_norm.{i}.weight``;
        ``modules_.{i}.block.<rest>`` -> ``model.mtp_block.{i}.<rest>``."""
        parts = path.split(".")
        if parts[0] != "modules_" or len(parts) < 3:
            return path
        name = BLOCK if parts[2] == "block" else parts[2]
        return ".".join(["model", name, parts[1], *parts[3:]])

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for key, value in tensors.items():
            m = _NAME.fullmatch(key)
            if m is None or "rotary_emb.inv_freq" in key:
                continue
            name, i, rest = m.groups()
            out[f"modules_.{i}.{'block' if name == BLOCK else name}.{rest}"] = value
        return out


def build_head(src: HeadSource, num_layers: int, hidden_source: HiddenSource) -> ErnieMTPHead:
    """An unloaded head for the checkpoint's ``model.mtp_*.{i}`` tensors, checked against what it
    ships. The block is the trunk's decoder layer class at index ``num_hidden_layers + i``, past
    ``moe_layer_end_index``, where it builds the dense MLP the references give the MTP block."""
    present = sorted({int(m.group(2)) for m in map(_NAME.fullmatch, src.index) if m})
    if not present:
        raise MissingHeadError(
            f"{src.source}: config declares {num_layers} MTP layer(s) but the checkpoint ships no model.mtp_* tensors"
        )
    if present != list(range(num_layers)):
        raise MtplxError(f"{src.source}: config declares {num_layers} MTP layer(s), checkpoint has {present}")
    args = model_args_of(src.trunk.model)
    first = int(args.num_hidden_layers)
    return ErnieMTPHead(
        [build_layer_like(src.trunk.layers[-1], args, first + i) for i in range(num_layers)],
        args.hidden_size,
        eps=args.rms_norm_eps,
        bias="model.mtp_linear_proj.0.bias" in src.index,
        trunk=src.trunk,
        hidden_source=hidden_source,
        cache_like=[len(src.trunk.layers) - 1] * num_layers,
    )
