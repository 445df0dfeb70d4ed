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
weights as offsets from 1; each head norm tensor is judged on its own (``stored_as_offset``).

hidden_source default "post_norm": the serving implementations that published
Qwen3-Next MTP acceptance (vLLM's and SGLang's qwen3_next MTP) hand the drafter the
hidden state the target model returns, which is after its final norm, and the head
itself ends in a norm, so its own output (fed back when chaining) is post-norm too.
Training-side code is not public, so this is the serving convention, to be
confirmed by measured acceptance (``hidden_source="pre_norm"`` switches it).
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
    MTPHead,
    build_layer_like,
    check_and_load,
    dequantize_fp8_blocks,
    find_prefix,
    keys_with_prefix,
    load_tensors,
    model_args_of,
    plain_norms,
    quantize_like_checkpoint,
    shared_callables,
    source_name,
    stack_experts,
    weight_index,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

LAYOUT = "qwen3_next"
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"
KEY_PREFIX = "mtp."
COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


class Qwen3NextMTPHead(MTPHead):
    """fc(concat[norm(embed(t)), norm(h)]) -> N decoder layers -> norm. Shares embed and lm_head."""

    layout = LAYOUT

    def __init__(
        self,
        layers: Sequence[nn.Module],
        hidden_size: int,
        *,
        eps: float = 1e-6,
        trunk: Any = None,
        embed: Embed | None = None,
        lm_head: LMHead | None = None,
        hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
        key_prefix: str = KEY_PREFIX,
        layer_per_step: bool = False,
    ):
        """``layers``: already-built decoder layers of the trunk's architecture (called as
        ``layer(x, mask, cache)``, as every mlx-lm layer is); ``trunk`` (a ``Trunk``) or the
        ``embed``/``lm_head`` callables supply the shared weights."""
        super().__init__(*shared_callables(trunk, embed, lm_head), hidden_source)
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

    def decoder_layers(self) -> list[nn.Module]:
        return self.layers

    def __call__(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list | None = None,
        *,
        step: int = 0,
        trunk_cache: list | None = None,
    ) -> mx.array:
        e = self.pre_fc_norm_embedding(self._embed(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h.astype(e.dtype)], axis=-1))
        if not self.layer_per_step:
            x = self._run_layers(x, self.layers, cache)
        else:
            n = len(self.layers)
            caches = cache if cache is not None else [None] * n
            chosen = step % n
            order = [i for i in range(n) if i != chosen and caches[i] is not None] + [chosen]
            for i in order:  # every layer fills its cache at every position (see ModuleStackHead)
                y = self._run_layers(x, [self.layers[i]], [caches[i]])
            x = y
        self._scratch.pre_norm = x
        return self.norm(x)

    def checkpoint_keys(self) -> dict[str, str]:
        return {path: self.key_prefix + path for path, _ in tree_flatten(self.parameters())}


def declared_layers(config: dict) -> int:
    """MTP layer count the config declares (text_config first: Qwen3.5 nests it there)."""
    for cfg in (config.get("text_config") or {}, config):
        for key in COUNT_KEYS:
            if cfg.get(key):
                return int(cfg[key])
    return 0


def has_layout(index: dict[str, str]) -> bool:
    return find_prefix(index, r"mtp\.fc\.weight") is not None


def _attention_template(trunk: Any) -> tuple[nn.Module, int]:
    """The trunk's first full-attention layer and its index: the MTP layer is built the same way,
    so it gets the same attention and the same MLP kind (dense or MoE) as the trunk would there."""
    for i, layer in enumerate(trunk.layers):
        if not getattr(layer, "is_linear", False) and "self_attn" in layer:
            return layer, i
    raise MtplxError(f"{type(trunk.model).__name__}: no full-attention trunk layer to model the MTP layer on")


def load_qwen3_next_head(
    model_dir: Path,
    trunk: Any,
    config: dict,
    index: dict[str, str] | None = None,
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE,
) -> Qwen3NextMTPHead | None:
    """The checkpoint's ``mtp.*`` head, or None when the config declares no MTP layers."""
    model_dir = Path(model_dir)
    n = declared_layers(config)
    if n == 0:
        return None
    index = weight_index(model_dir) if index is None else index
    source = source_name(model_dir)
    found = find_prefix(index, r"mtp\.fc\.weight")
    if found is None:
        raise MissingHeadError(
            f"{source}: config declares {n} MTP layer(s) but the checkpoint ships no mtp.* tensors"
        )
    prefix = found + KEY_PREFIX
    present = {int(k[len(prefix) + 7 :].split(".")[0]) for k in index if k.startswith(prefix + "layers.")}
    if present != set(range(n)):
        raise MtplxError(
            f"{source}: config declares {n} MTP layer(s), checkpoint has mtp.layers {sorted(present)}"
        )

    args = model_args_of(trunk.model)
    template, idx = _attention_template(trunk)
    layers = [build_layer_like(template, args, idx) for _ in range(n)]
    head = Qwen3NextMTPHead(
        layers,
        args.hidden_size,
        eps=args.rms_norm_eps,
        trunk=trunk,
        hidden_source=hidden_source,
        key_prefix=prefix,
        layer_per_step=True,
    )

    raw = load_tensors(model_dir, index, keys_with_prefix(index, prefix))
    weights = dequantize_fp8_blocks({k[len(prefix) :]: v for k, v in raw.items()})
    for i in range(n):
        weights = stack_experts(weights, f"layers.{i}.mlp", int(getattr(args, "num_experts", 0) or 0))
    weights = plain_norms(weights)
    quantize_like_checkpoint(head, lambda p: prefix + p, set(index), config)
    check_and_load(head, weights, source)
    return head
