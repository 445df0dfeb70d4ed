"""The head contract and the module classes every MTP head family shares.

A head is an ``nn.Module`` called as ``head(hidden[B,T,H], next_tokens[B,T], cache)``
returning a post-norm hidden state ready for an LM head. It owns only its own
weights: the token embedding and (unless the checkpoint ships its own copy) the
LM head are the trunk's, held as plain callables so they never enter the head's
parameter tree (no double counting, no double loading, fingerprints unchanged).
Reading one out of a checkpoint is ``mtplx.heads.weights``; each head says only how its
parameters are named there (``checkpoint_prefixes`` / ``sanitize`` / ``checkpoint_name``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, Protocol, runtime_checkable

from mtplx.heads.weights import HeadSource, strip_prefix
from mtplx.trunk.compat import KVCache, leading_cache
from mtplx.trunk.hidden import HIDDEN_SOURCES, HiddenSource

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

Embed = Callable[[mx.array], mx.array]
LMHead = Callable[[mx.array], mx.array]


@runtime_checkable
class DraftHead(Protocol):
    """What the decode loop (and every proposer built on a head) may rely on; nothing is probed.

    ``step`` is the 0-based draft position within a cycle (0 drafts d_1); layouts with several
    modules pick theirs from it. ``trunk_cache`` is the target's own cache list, for heads that
    read the trunk's KV (Gemma 4 assistants); other heads ignore it. ``counters`` are running
    totals the head keeps of its own (never reset; a caller reports the change over a request).
    """

    layout: str
    hidden_source: HiddenSource  # which trunk hidden state the head reads
    chain_source: HiddenSource  # which of its own outputs is fed back at step >= 1
    max_depth: int | None  # deepest chain the head was trained/built for; None = no limit known
    default_depth: int | None  # the depth its manifest measured best; None = engine default
    reads_trunk_cache: bool

    def __call__(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list,
        *,
        step: int = 0,
        trunk_cache: list | None = None,
    ) -> mx.array: ...

    def make_cache(self) -> list: ...

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array: ...

    def chain_input(self, head_out: mx.array) -> mx.array: ...

    def counters(self) -> dict[str, int]: ...


class MTPHead(nn.Module):
    """Base of every layout: the attributes and helpers the decode loop relies on.

    Subclasses set ``hidden_source`` (which trunk hidden they consume; the class attribute is
    the family's default) and ``chain_source`` (which of their own two outputs is fed back at
    depth > 1: "post_norm" = the returned hidden, "pre_norm" = ``self.last_pre_norm``), and
    implement ``_forward`` (the math up to the final norm) and ``_final_norm``.
    """

    layout: str = ""
    hidden_source: HiddenSource = "post_norm"
    chain_source: HiddenSource = "post_norm"
    mask_as_array: bool = False  # some attention kernels (MLA) index the mask with mx.where
    max_depth: int | None = None
    default_depth: int | None = None
    reads_trunk_cache: bool = False
    # FP8 checkpoint tensors the family reshapes in its sanitize, read as bfloat16 rather than
    # kept 8-bit (weights.fp8_blocks_quantized); suffixes of checkpoint module names.
    fp8_dequantized: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        trunk: Any = None,
        embed: Embed | None = None,
        lm_head: LMHead | None = None,
        hidden_source: HiddenSource | None = None,
        cache_like: Sequence[int] | None = None,
    ):
        """The keywords every head takes (``**shared`` in the families' constructors): ``trunk`` (a
        ``Trunk``) or the ``embed``/``lm_head`` callables, which override it, supply the shared
        weights; ``hidden_source`` None is the family's default (the class attribute);
        ``cache_like``: per head decoder layer, the index of the trunk layer it is built like,
        whose cache the trunk's own ``make_cache`` builds for it (None: a plain KVCache each)."""
        super().__init__()
        embed = embed or getattr(trunk, "embed", None)
        lm_head = lm_head or getattr(trunk, "lm_head", None)
        if embed is None or lm_head is None:
            raise ValueError(
                "an MTP head needs the trunk's embed and lm_head (pass trunk= or embed=/lm_head=)"
            )
        hidden_source = hidden_source or type(self).hidden_source
        if hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_source must be one of {HIDDEN_SOURCES}, got {hidden_source!r}")
        # Plain attributes (bound methods are not arrays/modules): kept out of parameters().
        self._embed = embed
        self._shared_lm_head = lm_head
        self.hidden_source = hidden_source
        # A namespace, not an array attribute: arrays set on a Module become parameters.
        self._scratch = SimpleNamespace(pre_norm=None)
        make_trunk_cache = getattr(trunk, "make_cache", None)
        self._cache_like = (
            (make_trunk_cache, tuple(cache_like)) if cache_like is not None and make_trunk_cache else None
        )

    @property
    def last_pre_norm(self) -> mx.array | None:
        """The last call's output before the head's final norm (what DeepSeek-style chaining feeds back)."""
        return self._scratch.pre_norm

    # --- contract ---------------------------------------------------------------
    def __call__(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list | None = None,
        *,
        step: int = 0,
        trunk_cache: list | None = None,
    ) -> mx.array:
        """The family's math up to its final norm (kept as ``last_pre_norm``), then the final
        norm of the module drafting ``step``. The KV the head attends to is its own ``cache``, or
        the target's ``trunk_cache`` for heads that read the trunk's (``reads_trunk_cache``)."""
        if self.reads_trunk_cache and trunk_cache is None:
            raise ValueError(f"a {self.layout} head reads the target's KV cache: pass trunk_cache")
        if step == 1 and cache and not self.reads_trunk_cache:
            # The chain's draft-made entries start here (the decode loop drops them with trim_kv);
            # a sliding-window cache overwrites its oldest entries in place, so record it first.
            from mtplx.trunk.rollback import mark_drafts

            mark_drafts(cache)
        x = self._forward(hidden, next_tokens, trunk_cache if self.reads_trunk_cache else cache, step)
        self._scratch.pre_norm = x
        return self._final_norm(step)(x)

    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers())

    def decoder_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def make_cache(self) -> list:
        """One cache per head decoder layer, built as the trunk builds one for the trunk layer the
        head layer is built like (``cache_like``): the same kind, the same cache-list composition
        (DeepSeek-V3.2 / GLM-5: latent KV + indexer keys) and the same window (a sliding layer's
        RotatingKVCache). Without a trunk to ask, a plain KVCache each (full attention)."""
        layers = self.decoder_layers()
        if self._cache_like is None:
            return [KVCache() for _ in layers]
        make_trunk_cache, like = self._cache_like
        if len(like) != len(layers):
            raise ValueError(f"cache_like names {len(like)} trunk layers for {len(layers)} head layers")
        # A fresh trunk cache list per head layer: two head layers like one trunk layer never share a cache.
        return [make_trunk_cache()[i] for i in like]

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        """Logits for a head output; the trunk's LM head unless the checkpoint ships its own."""
        return self._shared_lm_head(head_hidden)

    def chain_input(self, head_out: mx.array) -> mx.array:
        """What the next chained draft step reads: the last position of the returned (post-norm)
        output, or of the state before the head's final norm."""
        if self.chain_source == "pre_norm":
            return self.last_pre_norm[:, -1:]
        return head_out[:, -1:]

    def counters(self) -> dict[str, int]:
        """Running counters the head keeps of its own drafting; none for most heads."""
        return {}

    # --- the family's math ---------------------------------------------------------
    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        """The state before the final norm, for (hidden, next token) pairs at draft step ``step``."""
        raise NotImplementedError

    def _final_norm(self, step: int) -> nn.Module:
        raise NotImplementedError

    def _run_layers(self, h: mx.array, layers: Iterable[nn.Module], cache: list | None) -> mx.array:
        from mtplx.trunk.compat import create_attention_mask

        layers = list(layers)
        cache = cache if cache is not None else [None] * len(layers)
        if len(cache) != len(layers):
            raise ValueError(f"head cache has {len(cache)} entries for {len(layers)} layers")
        mask = create_attention_mask(h, leading_cache(cache[0]), return_array=self.mask_as_array)
        for layer, c in zip(layers, cache):
            h = layer(h, mask, c)
        return h

    # --- checkpoint naming (read by mtplx.heads.weights.load_head_weights) -----------------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        """The checkpoint name prefixes every tensor of this head sits under."""
        raise NotImplementedError

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """The checkpoint's tensors under ``checkpoint_prefixes`` (full names) as this head's
        parameter paths, HF-only spellings converted and unused tensors dropped (mlx-lm's
        ``Model.sanitize``)."""
        raise NotImplementedError

    def checkpoint_name(self, path: str) -> str:
        """The checkpoint's name for a parameter or module path of this head (mlx-side spellings,
        e.g. stacked ``switch_mlp`` experts): the inverse of ``sanitize``'s renaming."""
        raise NotImplementedError

    def checkpoint_keys(self) -> dict[str, str]:
        """``{parameter path in this module: tensor name in the checkpoint}``."""
        return {path: self.checkpoint_name(path) for path, _ in tree_flatten(self.parameters())}


def run_every_module(forward: Callable[[int], mx.array], caches: Sequence[Any], chosen: int) -> mx.array:
    """``forward(i)`` for every module ``i`` with a cache, module ``chosen`` last; its output.

    The references write a module's KV slot only at the steps it drafts and leave holes
    elsewhere; running every module on every input keeps each cache complete, so positions
    (rope) and attention context stay exact and the decode loop rolls every head cache back by
    the same count. Without a cache the other modules' outputs are unused: they are skipped.
    """
    order = [i for i in range(len(caches)) if i != chosen and caches[i] is not None] + [chosen]
    for i in order:
        out = forward(i)
    return out


def zero_first_position(embedded: mx.array, offset: int | mx.array) -> mx.array:
    """Zero the token embedding of sequence position 0 (rows are positions ``offset, offset+1, ...``;
    ``offset`` is one int, or an array [B] of each batch row's own, as a ragged batch cache has).

    DeepSeek-V3 / GLM / MiMo serving code masks it (vLLM ``deepseek_mtp.py``, ``glm4_moe_mtp.py``,
    ``mimo_mtp.py``: ``inputs_embeds[positions == 0] = 0``; SGLang ``mimo_nextn.py`` the same):
    position 0 pairs the first hidden state with the second token and training never used it.
    """
    if isinstance(offset, mx.array):
        positions = offset.reshape(-1, 1) + mx.arange(embedded.shape[1])[None]  # [B, T]
        return mx.where((positions == 0)[..., None], mx.zeros_like(embedded), embedded)
    if offset > 0:
        return embedded
    return mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)


class ModuleStackHead(MTPHead):
    """A layout with ``n`` independent MTP modules (DeepSeek ``num_nextn_predict_layers``,
    MiMo ``mtp_layers``), each with its own KV cache.

    Draft step ``s`` reads module ``s % n`` (vLLM's ``spec_step_idx % num_mtp_layers`` in
    ``deepseek_mtp.py`` / ``mimo_mtp.py``; with one module every step uses it). Every call runs
    *all* modules on its input (``run_every_module``); only module ``s % n``'s output is returned.

    Checkpoint naming: module ``i``'s tensors sit under ``module_prefix(i)``; its ``own_keys``
    by their names, every other tensor is its decoder block's (``modules_.{i}.block.*`` here),
    at the prefix itself or nested under ``block_name`` where ``nested_block`` is set.
    """

    module_class: type[nn.Module]  # built as module_class(block, hidden_size, eps)
    own_keys: tuple[str, ...] = ()
    block_name: str | None = None
    nested_block: bool = False
    zero_position_zero: bool = True

    def __init__(self, blocks: Sequence[nn.Module], hidden_size: int, *, eps: float = 1e-6, **shared: Any):
        """``blocks``: already-built decoder layers of the trunk's architecture, one per module;
        ``shared``: ``MTPHead``'s keywords."""
        super().__init__(**shared)
        self.modules_ = [self.module_class(b, hidden_size, eps) for b in blocks]

    @property
    def num_modules(self) -> int:
        return len(self.modules_)

    def decoder_layers(self) -> list[nn.Module]:
        return [m.block for m in self.modules_]

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        """One module: the pre-final-norm output for (hidden, embedded next token) pairs."""
        raise NotImplementedError

    def _module_final_norm(self, m: nn.Module) -> nn.Module:
        raise NotImplementedError

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        n = self.num_modules
        caches = cache if cache is not None else [None] * n
        if len(caches) != n:
            raise ValueError(f"head cache has {len(caches)} entries for {n} modules")
        embedded = self._embed(next_tokens)
        offset = leading_cache(caches[0]).offset if caches[0] is not None else 0
        if self.zero_position_zero:
            embedded = zero_first_position(embedded, offset)
        return run_every_module(
            lambda i: self._module_forward(self.modules_[i], hidden, embedded, caches[i]), caches, step % n
        )

    def _final_norm(self, step: int) -> nn.Module:
        return self._module_final_norm(self.modules_[step % self.num_modules])

    # --- checkpoint naming ---------------------------------------------------------------
    def module_prefix(self, i: int) -> str:
        """The checkpoint prefix of module ``i`` (with its trailing dot)."""
        raise NotImplementedError

    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return tuple(self.module_prefix(i) for i in range(self.num_modules))

    def checkpoint_name(self, path: str) -> str:
        """``modules_.{i}.block.self_attn.q_proj`` -> ``{module_prefix(i)}self_attn.q_proj``."""
        parts = path.split(".")
        if parts[0] != "modules_":
            return path
        rest = parts[2:]
        if rest and rest[0] == "block":
            rest = ([self.block_name] if self.nested_block else []) + rest[1:]
        return ".".join([self.module_prefix(int(parts[1])).rstrip("."), *rest])

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        out: dict[str, mx.array] = {}
        for i in range(self.num_modules):
            local = self._convert_module(i, strip_prefix(tensors, self.module_prefix(i)), src)
            out.update({f"modules_.{i}.{self._local_name(k)}": v for k, v in local.items()})
        return out

    def _convert_module(self, i: int, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """Module ``i``'s tensors (named relative to its prefix) with HF-only spellings converted
        and the tensors the head does not use dropped; the family's hook."""
        return tensors

    def _local_name(self, name: str) -> str:
        first, _, rest = name.partition(".")
        if first in self.own_keys:
            return name
        return "block." + (rest if first == self.block_name else name)


# --- building a head beside a trunk -------------------------------------------------


def model_args_of(trunk_model: nn.Module, required: str = "hidden_size") -> Any:
    """The mlx-lm ``ModelArgs`` object holding the text model's fields (wrapper models nest it)."""
    for owner in (trunk_model, getattr(trunk_model, "language_model", None)):
        args = getattr(owner, "args", None)
        if args is not None and hasattr(args, required):
            return args
    raise ValueError(f"cannot find ModelArgs with {required!r} on {type(trunk_model).__name__}")


def build_layer_like(template: nn.Module, args: Any, layer_idx: int) -> nn.Module:
    """A fresh decoder layer of ``template``'s class (mlx-lm layers take ``(args)`` or ``(args, layer_idx)``)."""
    import inspect

    cls = type(template)
    n_params = len(inspect.signature(cls.__init__).parameters) - 1
    return cls(args, layer_idx) if n_params >= 2 else cls(args)
