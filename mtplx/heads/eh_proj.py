"""The DeepSeek-style MTP module five families ship, and the head that stacks them.

One module (``EhProjModule``), as DeepSeek-V3 introduced it:

    e = enorm(embed(next_token))                  # zeroed at position 0 where the family's serving code does
    x = eh_proj(concat([e, hnorm(hidden)], -1))   # embedding FIRST
    x = block(x)                                  # the family's decoder layer
    out = final_layernorm(x)                      # -> the module's own ``lm_head`` copy, else the trunk's

``EhProjHead`` stacks ``n`` of them (``ModuleStackHead``: draft step ``s`` uses module ``s % n``).
A family file (``deepseek``, ``step3p5``, ``mimo_v2_flash``, ``longcat``, ``hy_v4``) keeps only
what differs, as an mlx-lm model file keeps its math and its ``sanitize``: the position-0 mask
(``zero_position_zero``), which output the next step reads (``chain_source``), the block it
builds, where module ``i`` sits in the checkpoint (``module_prefix``), its spellings of the
module's own names (``renames``) and its block's HF-only tensors (``_convert_block``).

``SplitNames`` / ``SplitNamesHead``: one such module published as its own drafter directory
(mlx-vlm's ``split_mtp``), read under the drafter's names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtplx.heads.base import ModuleStackHead
from mtplx.heads.weights import HeadSource, keys_with_prefix, load_tensors, same_as_trunk_lm_head

import mlx.core as mx
import mlx.nn as nn


class EhProjModule(nn.Module):
    """``enorm``, ``hnorm``, ``eh_proj``, the decoder ``block`` and ``final_layernorm``; ``lm_head``
    only where the checkpoint ships a copy that differs from the trunk's (``attach_own_lm_heads``)."""

    def __init__(self, block: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden_size, eps=eps)
        self.hnorm = nn.RMSNorm(hidden_size, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.final_layernorm = nn.RMSNorm(hidden_size, eps=eps)


def rename_prefix(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first matching ``(from, to)`` prefix replaced (``from`` without its dot
    matches the bare module name too)."""
    for old, new in renames:
        if name == old.rstrip("."):
            return new.rstrip(".")
        if name.startswith(old):
            return new + name[len(old) :]
    return name


class EhProjHead(ModuleStackHead):
    module_class = EhProjModule
    own_keys = ("enorm", "hnorm", "eh_proj", "final_layernorm", "lm_head")  # the rest is the block
    # The family's checkpoint spelling -> this module's, module-relative prefixes, first match wins.
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, *args: Any, first_layer: int = 0, **kwargs: Any):
        """``ModuleStackHead``'s arguments; ``first_layer`` is the checkpoint index of module 0
        where the family numbers its modules after the trunk's layers."""
        super().__init__(*args, **kwargs)
        self.first_layer = first_layer

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        e = m.enorm(embedded)
        x = m.eh_proj(mx.concatenate([e, m.hnorm(hidden).astype(e.dtype)], axis=-1))
        return self._run_layers(x, [m.block], [cache])

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        return m.final_layernorm

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        m = self.modules_[step % self.num_modules]
        return m["lm_head"](head_hidden) if "lm_head" in m else self._shared_lm_head(head_hidden)

    def has_own_lm_head(self, i: int) -> bool:
        return "lm_head" in self.modules_[i]

    def attach_own_lm_heads(self, src: HeadSource, hidden_size: int) -> None:
        """Give module ``i`` its own LM head where the checkpoint ships a copy that differs from
        the trunk's (filled when the weights load, quantized as the checkpoint stores it)."""
        for i in range(self.num_modules):
            prefix = self.checkpoint_name(f"modules_.{i}.lm_head") + "."
            own = load_tensors(src.model_dir, src.index, keys_with_prefix(src.index, prefix))
            own = {k[len(prefix) :]: v for k, v in own.items()}
            if own and not same_as_trunk_lm_head(own, src.trunk):
                self.modules_[i].lm_head = nn.Linear(hidden_size, own["weight"].shape[0], bias=False)

    # --- checkpoint naming ---------------------------------------------------------------
    def module_prefix(self, i: int) -> str:
        raise NotImplementedError

    def checkpoint_name(self, path: str) -> str:
        """``ModuleStackHead``'s name with the module-relative part in the family's spelling."""
        name, parts = super().checkpoint_name(path), path.split(".")
        if parts[0] != "modules_" or len(parts) < 3:
            return name
        prefix = self.module_prefix(int(parts[1]))
        back = tuple((ours, theirs) for theirs, ours in self.renames)
        return prefix + rename_prefix(name[len(prefix) :], back)

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """The family's spellings renamed; the embedding copy, rotary buffers and an LM-head copy
        equal to the trunk's dropped (the trunk's serve); then the block's conversions."""
        out = {}
        for k, v in tensors.items():
            k = rename_prefix(k, self.renames)
            own_head = k.startswith("lm_head.") and not self.has_own_lm_head(i)
            if not (k.startswith("embed_tokens.") or "rotary_emb." in k or own_head):
                out[k] = v
        return self._convert_block(i, out, src)

    def _convert_block(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """The family's hook: its block's HF-only tensors in mlx's shapes (stacked experts, split MLA)."""
        return tensors


# --- split drafters (one module published as its own directory) ---------------------


@dataclass(frozen=True)
class SplitNames:
    """Where a split drafter keeps one module's tensors (names relative to the in-checkpoint
    module prefix on the left, the drafter's names on the right). ``own``: (in-checkpoint local
    prefix, drafter prefix) pairs for the module's own tensors; the block sits under
    ``block_prefix``; ``dropped``: copies of the target's embedding / LM head, never read."""

    prefixes: tuple[str, ...]
    own: tuple[tuple[str, str], ...]
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


class SplitNamesHead(EhProjHead):
    """Put first in a family head's bases: that head (one module) read from a split drafter's
    names (``SplitNames``); otherwise the in-checkpoint head: same math, cache and hidden source."""

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
