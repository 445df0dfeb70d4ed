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
    quantization_config,
    quantize_like_checkpoint,
    shared_callables,
    source_name,
    stack_experts,
    weight_index,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

LAYOUT = "deepseek"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
COUNT_KEY = "num_nextn_predict_layers"
_OWN_KEYS = ("enorm", "hnorm", "eh_proj", "shared_head")  # everything else at the prefix is the block


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
    chain_source: HiddenSource = "post_norm"
    mask_as_array = True  # mlx-lm's MLA attention applies the mask with mx.where

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        hidden_size: int,
        *,
        eps: float = 1e-6,
        first_layer: int,
        trunk: Any = None,
        embed: Embed | None = None,
        lm_head: LMHead | None = None,
        hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
    ):
        super().__init__(*shared_callables(trunk, embed, lm_head), hidden_source)
        self.modules_ = [DeepSeekMTPModule(b, hidden_size, eps) for b in blocks]
        self.first_layer = first_layer

    def attach_own_lm_head(self, weight_owner_index: int, head: nn.Module) -> None:
        self.modules_[weight_owner_index].shared_head.head = head

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.enorm(embedded)
        x = m.eh_proj(mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _final_norm(self, m: nn.Module) -> nn.Module:
        return m.shared_head.norm

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        sh = self.modules_[step % self.num_modules].shared_head
        return sh["head"](head_hidden) if "head" in sh else self._shared_lm_head(head_hidden)

    def checkpoint_keys(self) -> dict[str, str]:
        return {
            path: module_to_checkpoint(path, self.first_layer) for path, _ in tree_flatten(self.parameters())
        }


def module_to_checkpoint(path: str, first_layer: int) -> str:
    """``modules_.0.block.self_attn.q_proj`` -> ``model.layers.{first+0}.self_attn.q_proj``."""
    parts = path.split(".")
    if parts[0] != "modules_":
        return path
    rest = parts[2:]
    if rest and rest[0] == "block":
        rest = rest[1:]
    return ".".join([f"model.layers.{first_layer + int(parts[1])}", *rest])


def declared_layers(config: dict) -> int:
    for cfg in (config.get("text_config") or {}, config):
        if cfg.get(COUNT_KEY):
            return int(cfg[COUNT_KEY])
    return 0


def has_layout(index: dict[str, str]) -> bool:
    return any(k.startswith("model.layers.") and k.endswith(".eh_proj.weight") for k in index)


def _split_kv_b_proj(weights: dict[str, mx.array], prefix: str, args: Any, config: dict) -> None:
    """HF MLA ``kv_b_proj`` [heads*(nope+v), kv_lora] -> mlx-lm's per-head ``embed_q`` / ``unembed_out``."""
    key = f"{prefix}.kv_b_proj.weight"
    if key not in weights:
        return
    w = weights.pop(key)
    q = quantization_config(config)
    scales = weights.pop(f"{prefix}.kv_b_proj.scales", None)
    biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
    if scales is not None:
        w = mx.dequantize(w, scales, biases, group_size=q["group_size"], bits=q["bits"])
    nope, vdim = args.qk_nope_head_dim, args.v_head_dim
    w = w.reshape(args.num_attention_heads, nope + vdim, -1)
    parts = {
        "embed_q": mx.contiguous(w[:, :nope, :].swapaxes(-1, -2)),
        "unembed_out": mx.contiguous(w[:, nope:, :]),
    }
    for name, t in parts.items():
        if scales is not None:
            t, s, b = mx.quantize(t, group_size=q["group_size"], bits=q["bits"])
            weights[f"{prefix}.{name}.scales"], weights[f"{prefix}.{name}.biases"] = s, b
        weights[f"{prefix}.{name}.weight"] = t


def load_deepseek_head(
    model_dir: Path,
    trunk: Any,
    config: dict,
    index: dict[str, str] | None = None,
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
) -> DeepSeekMTPHead | None:
    model_dir = Path(model_dir)
    n = declared_layers(config)
    if n == 0:
        return None
    index = weight_index(model_dir) if index is None else index
    source = source_name(model_dir)
    args = model_args_of(trunk.model)
    first = int(args.num_hidden_layers)
    if not any(k.startswith(f"model.layers.{first + i}.") for k in index for i in range(n)):
        raise MissingHeadError(
            f"{source}: config declares {n} MTP layer(s) but the checkpoint ships no model.layers.{first}.* tensors"
        )
    for i in range(n):
        if f"model.layers.{first + i}.eh_proj.weight" not in index:
            raise MtplxError(f"{source}: MTP layer model.layers.{first + i} has no eh_proj.weight")

    blocks = [build_layer_like(trunk.layers[-1], args, first + i) for i in range(n)]
    head = DeepSeekMTPHead(
        blocks,
        args.hidden_size,
        eps=args.rms_norm_eps,
        first_layer=first,
        trunk=trunk,
        hidden_source=hidden_source,
    )

    weights: dict[str, mx.array] = {}
    own_heads: dict[int, nn.Module] = {}
    for i in range(n):
        prefix = f"model.layers.{first + i}."
        names = [
            k for k in keys_with_prefix(index, prefix) if not k[len(prefix) :].startswith("embed_tokens.")
        ]
        raw = dequantize_fp8_blocks(
            {k[len(prefix) :]: v for k, v in load_tensors(model_dir, index, names).items()}
        )
        raw = {(k if k.split(".")[0] in _OWN_KEYS else f"block.{k}"): v for k, v in raw.items()}
        stack_experts(raw, "block.mlp", int(getattr(args, "n_routed_experts", 0) or 0))
        _split_kv_b_proj(raw, "block.self_attn", args, config)
        own_head = {k: raw.pop(k) for k in list(raw) if k.startswith("shared_head.head.")}
        if own_head and not _same_as_trunk_lm_head(own_head, trunk):
            own_heads[i] = _linear_from(own_head, config)
        weights.update({f"modules_.{i}.{k}": v for k, v in raw.items()})

    quantize_like_checkpoint(head, lambda p: module_to_checkpoint(p, first), set(index), config)
    check_and_load(head, weights, source)
    for (
        i,
        lin,
    ) in own_heads.items():  # attached after loading: built from its own (possibly quantized) tensors
        head.attach_own_lm_head(i, lin)
    return head


def _same_as_trunk_lm_head(own: dict[str, mx.array], trunk: Any) -> bool:
    """True when the checkpoint's ``shared_head.head`` copy equals the trunk's LM head (keep one)."""
    lm = getattr(trunk, "_lm_head", None)
    if lm is None:
        lm = getattr(getattr(trunk, "inner", None), "embed_tokens", None)
    if lm is None:
        return False
    params = dict(tree_flatten(lm.parameters()))
    mine = {k[len("shared_head.head.") :]: v for k, v in own.items()}
    if set(mine) != set(params):
        return False
    return all(params[k].shape == v.shape and mx.array_equal(params[k], v).item() for k, v in mine.items())


def _linear_from(tensors: dict[str, mx.array], config: dict) -> nn.Module:
    w = tensors["shared_head.head.weight"]
    if "shared_head.head.scales" in tensors:
        q = quantization_config(config)
        out_dims = w.shape[0]
        in_dims = w.shape[1] * 32 // q["bits"]
        lin = nn.QuantizedLinear(in_dims, out_dims, bias=False, group_size=q["group_size"], bits=q["bits"])
        lin.load_weights([(k.split(".")[-1], v) for k, v in tensors.items()])
        return lin
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
    lin.weight = w
    return lin
