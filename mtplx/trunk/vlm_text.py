"""mlx-vlm's language model of a family mlx-lm lacks, as an mlx-lm-shaped model the `Trunk` wraps.

`mtplx.trunk.backends` decides that mlx-vlm hosts a checkpoint; ``load`` builds mlx-vlm's own
model with mlx-vlm's own loader (``mlx_vlm.utils.load_model``: its config classes, sanitize and
quantization), lazily, and keeps only ``language_model``: the vision tower's lazy arrays are
dropped unevaluated, so no tower is loaded (text path only).

`VlmTextModel` is the one adapter between the two packages' conventions, everything else of the
trunk contract is unchanged:

* mlx-vlm's ``LanguageModel.__call__`` returns a ``LanguageModelOutput``; the adapter returns its
  logits, as an mlx-lm model does (the final-norm tap records the hidden states as for mlx-lm);
* the parameter tree is ``language_model.model.{embed_tokens, layers, norm}`` + ``language_model.lm_head``,
  a layout `compat.find_inner_model` / `compat.find_lm_head` already know;
* caches: mlx-vlm's cache classes are its own (not mlx-lm's), so ``make_cache`` builds mlx-lm's
  equivalent of each one mlx-vlm's ``make_cache`` returns (``CACHE_EQUIVALENTS``), and
  `rollback`, `row_cache`, the batch (`batch_cache`: Hunyuan-V4's ``CacheList`` s as ragged K/V
  rows; Qwen3.8-Flash-Next's own caches through `batch_vlm`), the prompt cache and ``--kv-bits`` work on them as on any mlx-lm model's. mlx-vlm's
  language code reads only the methods both share (``offset``, ``update_and_fetch``, ``keys`` /
  ``values``, ``make_mask``); the equivalence is checked by
  comparing logits with mlx-vlm's own forward on its own caches (``tests/trunk/test_vlm_text.py``);
* families whose caches have no mlx-lm equivalent (``NATIVE_CACHE_FAMILIES``: Qwen3.8-Flash-Next's
  QSA KV cache with the indexer's raw keys, its gated-delta and PLE ``ArraysCache`` s) keep
  mlx-vlm's own caches; `mtplx.trunk.rollback_vlm` rolls them back through mlx-vlm's own
  speculative cache transaction (checked against plain decoding in ``tests/trunk/test_cache.py``);
  those whose caches batch (``BATCH_LAYERS``: MiniMax-M3, `mtplx.trunk.vlm_minimax_m3`;
  Qwen3.8-Flash-Next and GLM-5-Next, `mtplx.trunk.batch_vlm`; Inkling, `mtplx.trunk.batch_inkling`;
  DeepSeek-V4, `mtplx.trunk.batch_deepseek_v4`) give the batch its layer for each
  (`VlmTextModel.batch_layer`), and MiniMax-M3's forward on batch caches passes mlx-vlm the rows'
  own ``position_ids`` (`ragged_position_ids`);
* a family without a final norm (``FINAL_MIXERS``: Qwen3.8-Flash-Next collapses its ``hc_count``
  hyper-connection streams with ``hyper_connection_mixer`` and has no ``norm``) shows that module
  to the trunk as ``norm``, outside the parameter tree: the tap's ``pre`` is then the streams
  [B, T, hc_count * hidden] and ``post`` the mixed state the LM head reads;
* one forward path: a Qwen3.5-derived language model's separate one-token "batch-invariant"
  decode forward is switched off (`VlmTextModel.__init__`), so decode steps and verify blocks run
  the same code and the taps see both;
* exactness hooks (``EXACTNESS_HOOKS``): where mlx-vlm's forward is not the same function of the
  tokens at every context length, the module-level function responsible is replaced by the same
  math done exactly (Hunyuan-V4's indexer top-k: `_exact_partition_scores` says why; DeepSeek-V4's
  overlapping compressor, a method: `mtplx.trunk.vlm_deepseek_v4`);
* DeepSeek-V4's forward ends ``norm(hc_head(streams))``; `StreamsHead` is that pair as the trunk's
  one final "norm" (``STREAMS_HEADS``), its tap's ``pre`` the streams its MTP layer reads;
* Inkling (`mtplx.trunk.vlm_inkling`): its logits divide the final norm's output by a width
  multiplier, shown as the trunk's "norm" (``WIDTH_SCALED_NORMS``), and its short convolutions
  record their windows inside a verify block (an ``EXACTNESS_HOOKS`` entry) for mlx-vlm's
  transaction to roll them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError, first_line
from mtplx.trunk import batch_deepseek_v4, batch_inkling, batch_vlm, vlm_minimax_m3
from mtplx.trunk.compat import materialize

import mlx.core as mx
import mlx.nn as nn

__all__ = [
    "BATCH_LAYERS",
    "RAGGED_POSITION_FAMILIES",
    "CACHE_EQUIVALENTS",
    "EXACTNESS_HOOKS",
    "FINAL_MIXERS",
    "NATIVE_CACHE_FAMILIES",
    "STREAMS_HEADS",
    "StreamsHead",
    "WIDTH_SCALED_NORMS",
    "VlmTextModel",
    "install_exactness_hooks",
    "load",
    "lm_cache_like",
    "ragged_position_ids",
]


def _kv(cache: Any):
    from mlx_lm.models.cache import KVCache

    return KVCache()


def _cache_list(cache: Any):
    from mlx_lm.models.cache import CacheList

    return CacheList(*(lm_cache_like(c) for c in cache.caches))


def _rotating(cache: Any):
    from mlx_lm.models.cache import RotatingKVCache

    return RotatingKVCache(max_size=cache.max_size, keep=cache.keep)


# mlx-vlm cache class (by its base's name in mlx_vlm.models.cache, a family's subclass included:
# hy_v4's HyV4KVCache only sizes its buffer differently) -> mlx-lm's equivalent.
CACHE_EQUIVALENTS = {"KVCache": _kv, "CacheList": _cache_list, "RotatingKVCache": _rotating}


# Families whose every cache stays mlx-vlm's own (`mtplx.trunk.rollback_vlm` rolls them back):
# Qwen3.8-Flash-Next's QSA KV and ArraysCaches; DeepSeek-V4's sliding-window RotatingKVCache and
# compressed PoolingCaches (in mlx-vlm's CacheList); GLM-5-Next's linear-attention ArraysCaches
# and its sparse layers' CacheList(KV, indexer KV, PoolingCache, pooled KV); MiniMax-M3's
# MiniMaxM3KVCache (KV + the block-sparse indexer's keys) and KVCache.
# Inkling's CacheList(KVCache, ArraysCache(4)) per layer (K/V, the four short convolutions' windows).
NATIVE_CACHE_FAMILIES = frozenset({"qwen4_exp", "deepseek_v4", "glm5_next", "minimax_m3", "inkling"})

# Of those, the families whose caches batch: model type -> the batch's layer for a single-row
# cache (None: that class does not batch; a head's caches are asked through its trunk's model).
BATCH_LAYERS = {
    "minimax_m3": vlm_minimax_m3.batch_layer,
    "qwen4_exp": batch_vlm.qwen4_exp_layer,
    "glm5_next": batch_vlm.glm5_next_layer,
    "inkling": batch_inkling.inkling_layer,
    "deepseek_v4": batch_deepseek_v4.deepseek_v4_layer,
}
# Families whose forward on batch caches takes each row's ``position_ids`` (MiniMax-M3's indexer
# takes its query start as one int; the other two compute their rows' positions from the caches).
RAGGED_POSITION_FAMILIES = frozenset({"minimax_m3"})


def ragged_position_ids(cache: list, length: int) -> mx.array | None:
    """Each row's positions [B, length] for a forward on batch caches (per-row offsets: row r's
    block starts at its length); None for a single row's caches (an int offset)."""
    offset = getattr(cache[0], "offset", None) if cache else None
    if isinstance(offset, mx.array) and offset.ndim == 1:
        return offset[:, None] + mx.arange(length, dtype=offset.dtype)[None]
    return None


# Families without a final norm: model type -> the inner model's module that makes the LM head's input.
FINAL_MIXERS = {"qwen4_exp": "hyper_connection_mixer"}

# Families whose forward ends ``norm(hc_head(streams))`` with the streams [B, T, hc_mult, H] and
# whose MTP head reads those streams (DeepSeek-V4): the trunk's "norm" becomes `StreamsHead`.
STREAMS_HEADS = frozenset({"deepseek_v4"})

# Families whose logits divide the final norm's output by a width multiplier (Inkling): the trunk's
# "norm" becomes norm-then-divide (`mtplx.trunk.vlm_inkling.host`).
WIDTH_SCALED_NORMS = frozenset({"inkling"})


def _flatten_streams(h: mx.array) -> mx.array:
    """[B, T, hc_mult, H] -> [B, T, hc_mult * H] (the trunk contract's 3-D hidden states)."""
    return h.reshape(*h.shape[:-2], -1)


class StreamsHead(nn.Module):
    """``norm(hc_head(streams))`` of a DeepSeek-V4 trunk as one module taking the streams flattened
    ([B, T, hc_mult * H]): shown to the trunk as its final norm (`VlmTextModel.__init__` aliases
    the inner model's ``hc_head`` to `_flatten_streams` and ``norm`` to this), so the tap's ``pre``
    is the hyper-connection streams the MTP head reads and ``post`` the LM head's input. The two
    modules are held outside any parameter tree (the model's own tree keeps them)."""

    def __init__(self, hc_head: nn.Module, norm: nn.Module, hc_mult: int):
        super().__init__()
        object.__setattr__(self, "_parts", (hc_head, norm))
        self.hc_mult = hc_mult

    def __call__(self, flat: mx.array) -> mx.array:
        hc_head, norm = self._parts
        return norm(hc_head(flat.reshape(*flat.shape[:-1], self.hc_mult, -1)))


def lm_cache_like(cache: Any):
    """mlx-lm's cache equivalent to an empty mlx-vlm ``cache`` (MtplxError for a kind with none)."""
    for klass in type(cache).__mro__:
        if klass.__module__ == "mlx_vlm.models.cache" and klass.__name__ in CACHE_EQUIVALENTS:
            return CACHE_EQUIVALENTS[klass.__name__](cache)
    raise MtplxError(f"mlx-vlm cache {type(cache).__name__}: mtplx has no mlx-lm equivalent for it")


# --------------------------------------------------------------------------- exactness hooks


def _exact_partition_scores(top_k: int, masked: bool):
    """mlx-vlm 0.7.10 ``models/hy_v4/indexer.py``'s ``_partition_scores``, the same math, eager.

    mlx-vlm wraps it in ``mx.compile(shapeless=True)``: the first trace fixes ``argpartition``'s
    ``kth=-top_k`` as a position in the length it was traced at, so at any other context length the
    last ``top_k`` entries are no longer the ``top_k`` best keys (a block after a prefill, and every
    decode step after the first, attend to other keys than a from-scratch forward does; mlx-vlm's
    own drafting verifies one token at a time around it). Uncompiled, every forward selects
    the same keys a from-scratch forward would (``tests/trunk/test_vlm_text.py``, with a control
    that keeps the compiled one)."""

    def partition(q, k, weights, mask=None):
        scores = mx.maximum(q @ k.swapaxes(-1, -2), 0)
        scores = (scores * weights.swapaxes(-1, -2)[..., None]).sum(axis=1, keepdims=True)
        if masked:
            scores = mx.where(mask, scores, -float("inf"))
        return mx.argpartition(scores, kth=-top_k, axis=-1)

    return partition


def _recording_short_conv_call(original: Any):
    from mtplx.trunk.vlm_inkling import recording_short_conv_call

    return recording_short_conv_call(original)


def _exact_compressor_call(original: Any):
    from mtplx.trunk.vlm_deepseek_v4 import exact_compressor_call

    return exact_compressor_call(original)


# model type -> (module, or "module:Class" for a method, the function its forward calls, a factory of
# mtplx's exact replacement given the original)
EXACTNESS_HOOKS = {
    "hy_v4": ("mlx_vlm.models.hy_v4.indexer", "_partition_scores", lambda original: _exact_partition_scores),
    # DeepSeek-V4's overlapping compressor (`mtplx.trunk.vlm_deepseek_v4`: why)
    "deepseek_v4": ("mlx_vlm.models.deepseek_v4.language:Compressor", "__call__", _exact_compressor_call),
    # Inkling's short convolutions record their windows in a verify block (`mtplx.trunk.vlm_inkling`:
    # why), so mlx-vlm's transaction rolls them back exactly
    "inkling": (
        "mlx_vlm.models.inkling.language:InklingShortConvolution",
        "__call__",
        _recording_short_conv_call,
    ),
}
ORIGINALS: dict[tuple[str, str], Any] = {}  # what each hook replaced (a test restores it as a control)
INSTALLED: dict[tuple[str, str], Any] = {}  # what each hook put in its place


def install_exactness_hooks(model_type: str) -> None:
    """Replace the functions ``EXACTNESS_HOOKS`` names for ``model_type`` (idempotent; MtplxError,
    one line, when the installed mlx-vlm no longer has one)."""
    import importlib

    if model_type not in EXACTNESS_HOOKS:
        return
    target_name, name, make_replacement = EXACTNESS_HOOKS[model_type]
    module_name, _, class_name = target_name.partition(":")
    target = importlib.import_module(module_name)
    target = getattr(target, class_name, None) if class_name else target
    current = getattr(target, name, None) if target is not None else None
    if current is None:
        raise MtplxError(
            f"mlx-vlm changed: {target_name} no longer has {name} (mtplx hooks it for {model_type})"
        )
    key = (target_name, name)
    if current is not INSTALLED.get(key):
        ORIGINALS.setdefault(key, current)
        INSTALLED[key] = make_replacement(ORIGINALS[key])
        setattr(target, name, INSTALLED[key])


# --------------------------------------------------------------------------- the adapter


class VlmTextModel(nn.Module):
    """mlx-vlm's ``LanguageModel`` behind mlx-lm's model interface (logits out, mlx-lm caches)."""

    def __init__(self, language_model: nn.Module, model_type: str):
        super().__init__()
        install_exactness_hooks(model_type)
        self.language_model = language_model
        self.model_type = model_type
        # mlx-vlm's text config (Inkling's language model names it ``config``)
        self.args = getattr(language_model, "args", None) or getattr(language_model, "config", None)
        if model_type in FINAL_MIXERS:
            inner = language_model.model
            # An attribute only (object.__setattr__: not a child module), so the parameter tree,
            # loading, quantization and fingerprints are mlx-vlm's own.
            object.__setattr__(inner, "norm", getattr(inner, FINAL_MIXERS[model_type]))
        if model_type in STREAMS_HEADS:
            inner = language_model.model
            head = StreamsHead(inner["hc_head"], inner["norm"], language_model.args.hc_mult)
            object.__setattr__(inner, "hc_head", _flatten_streams)
            object.__setattr__(inner, "norm", head)
        if model_type in WIDTH_SCALED_NORMS:
            from mtplx.trunk.vlm_inkling import host

            host(language_model)
        if callable(getattr(language_model, "_batch_invariant_decode", None)):
            # Qwen3.5-derived language models route one-token forwards through a separate
            # "batch-invariant" forward that never calls the final norm / mixer module (so no tap
            # would see a decode step) and computes the same function with other reductions:
            # every forward takes the one plain path, as a verify block does.
            object.__setattr__(language_model, "_supports_batch_invariant_decode", lambda: False)

    def __call__(self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None):
        extra = {}
        if self.model_type in RAGGED_POSITION_FAMILIES:
            positions = ragged_position_ids(cache, inputs.shape[1])
            if positions is not None:
                extra["position_ids"] = positions
        return self.language_model(inputs, cache=cache, inputs_embeds=input_embeddings, **extra).logits

    def batch_layer(self, cache: Any) -> Any:
        """The batch's cache (`mtplx.trunk.batch_cache.BatchCache`) for a layer whose single-row
        cache is ``cache``, one of this family's own classes; None where it has none (the caches
        of mlx-lm's classes batch as any mlx-lm model's)."""
        if self.model_type not in BATCH_LAYERS:
            return None
        return BATCH_LAYERS[self.model_type](cache)

    @property
    def layers(self) -> list:
        return self.language_model.model.layers

    @property
    def quant_predicate(self):
        """mlx-vlm's per-layer quantization rule for this family (Qwen's 8-bit router gates), for
        `mtplx convert` (mlx-lm's ``quantize_model`` reads it); mlx-vlm-only keys (a PLE row
        width's ``fallback_group_size``) read as "quantize as usual": mlx-lm skips widths its
        group does not divide."""
        own = getattr(self.language_model, "quant_predicate", None)
        if own is None:
            return None

        def predicate(path: str, module: nn.Module):
            rule = own(path.removeprefix("language_model."), module)
            return True if isinstance(rule, dict) and "fallback_group_size" in rule else rule

        return predicate

    def make_cache(self) -> list:
        if self.model_type in NATIVE_CACHE_FAMILIES:
            return self.language_model.make_cache()
        return [lm_cache_like(c) for c in self.language_model.make_cache()]


def load(path: Path, model_type: str, config: dict, *, lazy: bool = False) -> tuple[VlmTextModel, dict]:
    """mlx-vlm's language model of the checkpoint at ``path`` (``config``: its config.json) and the
    config, as mlx-lm's ``load_model`` returns them; errors as one-line MtplxErrors."""
    from mlx_vlm.utils import load_model

    try:
        full = load_model(Path(path), lazy=True)
    except FileNotFoundError as e:
        raise MtplxError(f"{path}: {first_line(e)}") from None
    except ValueError as e:
        raise MtplxError(f"{path}: weights do not match config.json ({first_line(e)})") from None
    except Exception as e:
        raise MtplxError(f"{path}: mlx-vlm cannot load {model_type} ({first_line(e)})") from None
    model = VlmTextModel(full.language_model, model_type)
    del full  # the vision tower's arrays were never evaluated; they go with it
    if not lazy:
        materialize(model)  # its private arrays too: the server decodes on its own thread
    model.eval()
    return model, config
