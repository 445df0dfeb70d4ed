"""The MiMo MTP layout: ``model.mtp_layers.{i}``.

    x = input_proj(concat([hidden_layernorm(hidden), token_layernorm(embed(next_token))], -1))
                                          # embedding zeroed at sequence position 0
                                          # HIDDEN FIRST: the reverse of Qwen3-Next / DeepSeek
    x = decoder block (Qwen2-style: input_layernorm, self_attn, post_attention_layernorm, mlp)
    out = final_layernorm(x)              # -> the trunk's lm_head; also what is chained

In the published checkpoints the block's tensors sit directly under
``model.mtp_layers.{i}.`` (``model.mtp_layers.0.self_attn.q_proj.weight``); some
re-exports nest them under ``mtp_block.`` (the serving code's module name). Both load.
Count: ``num_nextn_predict_layers``; draft step ``s`` uses module ``s % n`` (vLLM
``mimo_mtp.py``; see ``ModuleStackHead``); ``max_depth`` is None (modules cycle).

hidden_source default "pre_norm": MiMo's authors' own vLLM integration moves the
trunk's final norm out of the model forward (it is applied when computing logits),
so the hidden state handed to the MTP layer is the one *before* the final norm.
Third-party training code (FastMTP) feeds the post-norm state instead, so this is
disputed; measured acceptance decides (``hidden_source="post_norm"`` switches it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.heads.base import (
    Embed,
    HiddenSource,
    LMHead,
    MissingHeadError,
    ModuleStackHead,
    build_layer_like,
    check_and_load,
    dequantize_fp8_blocks,
    keys_with_prefix,
    load_tensors,
    model_args_of,
    quantize_like_checkpoint,
    shared_callables,
    source_name,
    weight_index,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

LAYOUT = "mimo"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "pre_norm"
COUNT_KEY = "num_nextn_predict_layers"
PREFIX = "model.mtp_layers."
_OWN_KEYS = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


class MiMoMTPModule(nn.Module):
    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.token_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hidden_layernorm = nn.RMSNorm(hidden_size, eps=eps)
        self.input_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.final_layernorm = nn.RMSNorm(hidden_size, eps=eps)


class MiMoMTPHead(ModuleStackHead):
    layout = LAYOUT

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        hidden_size: int,
        *,
        eps: float = 1e-6,
        trunk: Any = None,
        embed: Embed | None = None,
        lm_head: LMHead | None = None,
        hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
        nested_block: bool = False,
    ):
        super().__init__(*shared_callables(trunk, embed, lm_head), hidden_source)
        self.modules_ = [MiMoMTPModule(b, hidden_size, eps) for b in blocks]
        self.nested_block = nested_block  # checkpoint spells the block as "mtp_block."

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.token_layernorm(embedded)
        x = m.input_proj(mx.concatenate([m.hidden_layernorm(hidden).astype(e.dtype), e], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _final_norm(self, m: nn.Module) -> nn.Module:
        return m.final_layernorm

    def checkpoint_keys(self) -> dict[str, str]:
        return {p: module_to_checkpoint(p, self.nested_block) for p, _ in tree_flatten(self.parameters())}


def module_to_checkpoint(path: str, nested_block: bool = False) -> str:
    """``modules_.0.block.self_attn.q_proj`` -> ``model.mtp_layers.0.self_attn.q_proj``."""
    parts = path.split(".")
    if parts[0] != "modules_":
        return path
    rest = parts[2:]
    if rest and rest[0] == "block":
        rest = (["mtp_block"] if nested_block else []) + rest[1:]
    return ".".join([f"{PREFIX}{parts[1]}", *rest])


def declared_layers(config: dict) -> int:
    for cfg in (config.get("text_config") or {}, config):
        if cfg.get(COUNT_KEY):
            return int(cfg[COUNT_KEY])
    return 0


def has_layout(index: dict[str, str]) -> bool:
    return any(k.startswith(PREFIX) for k in index)


def load_mimo_head(
    model_dir: Path,
    trunk: Any,
    config: dict,
    index: dict[str, str] | None = None,
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
) -> MiMoMTPHead | None:
    model_dir = Path(model_dir)
    n = declared_layers(config)
    if n == 0:
        return None
    index = weight_index(model_dir) if index is None else index
    source = source_name(model_dir)
    present = sorted({int(k[len(PREFIX) :].split(".")[0]) for k in index if k.startswith(PREFIX)})
    if not present:
        raise MissingHeadError(
            f"{source}: config declares {n} MTP layer(s) but the checkpoint ships no model.mtp_layers.* tensors"
        )
    if present != list(range(n)):
        raise MtplxError(
            f"{source}: config declares {n} MTP layer(s), checkpoint has model.mtp_layers {present}"
        )
    nested = any(k.startswith(f"{PREFIX}0.mtp_block.") for k in index)

    args = model_args_of(trunk.model)
    blocks = [build_layer_like(trunk.layers[-1], args, args.num_hidden_layers + i) for i in range(n)]
    head = MiMoMTPHead(
        blocks,
        args.hidden_size,
        eps=args.rms_norm_eps,
        trunk=trunk,
        hidden_source=hidden_source,
        nested_block=nested,
    )
    weights: dict[str, mx.array] = {}
    for i in range(n):
        prefix = f"{PREFIX}{i}."
        raw = load_tensors(model_dir, index, keys_with_prefix(index, prefix))
        raw = dequantize_fp8_blocks({k[len(prefix) :]: v for k, v in raw.items()})
        for k, v in raw.items():
            if "rotary_emb.inv_freq" in k:
                continue
            first = k.split(".")[0]
            local = (
                k
                if first in _OWN_KEYS
                else "block." + (k[len("mtp_block.") :] if first == "mtp_block" else k)
            )
            weights[f"modules_.{i}.{local}"] = v
    quantize_like_checkpoint(head, lambda p: module_to_checkpoint(p, nested), set(index), config)
    check_and_load(head, weights, source)
    return head
