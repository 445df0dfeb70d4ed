"""Pieces every MTP head layout shares: the head contract, checkpoint access, quantization.

A head is an ``nn.Module`` called as ``head(hidden[B,T,H], next_tokens[B,T], cache)``
returning a post-norm hidden state ready for an LM head. It owns only its own
weights: the token embedding and (unless the checkpoint ships its own copy) the
LM head are the trunk's, held as plain callables so they never enter the head's
parameter tree (no double counting, no double loading, fingerprints unchanged).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, Protocol, runtime_checkable

from mtplx.checkpoints.headers import quantization_config, read_safetensors_header
from mtplx.errors import MtplxError
from mtplx.spec_decode.settings import HIDDEN_SOURCES
from mtplx.trunk.compat import KVCache

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class MissingHeadError(MtplxError):
    """The config declares MTP layers but the checkpoint ships none of their tensors
    (mlx-lm's converter drops them): the model still decodes, autoregressively."""


HiddenSource = Literal["pre_norm", "post_norm"]
Embed = Callable[[mx.array], mx.array]
LMHead = Callable[[mx.array], mx.array]


def shared_callables(
    trunk: Any = None, embed: Embed | None = None, lm_head: LMHead | None = None
) -> tuple[Embed, LMHead]:
    """(embed, lm_head) from a ``Trunk``-like object, explicit callables overriding it."""
    embed = embed or getattr(trunk, "embed", None)
    lm_head = lm_head or getattr(trunk, "lm_head", None)
    if embed is None or lm_head is None:
        raise ValueError("an MTP head needs the trunk's embed and lm_head (pass trunk= or embed=/lm_head=)")
    return embed, lm_head


@runtime_checkable
class DraftHead(Protocol):
    """What the decode loop (and every proposer built on a head) may rely on; nothing is probed.

    ``step`` is the 0-based draft position within a cycle (0 drafts d_1); layouts with several
    modules pick theirs from it. ``trunk_cache`` is the target's own cache list, for heads that
    read the trunk's KV (Gemma 4 assistants); other heads ignore it.
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


class MTPHead(nn.Module):
    """Base of every layout: the attributes and helpers the decode loop relies on.

    Subclasses set ``hidden_source`` (which trunk hidden they consume) and
    ``chain_source`` (which of their own two outputs is fed back at depth > 1:
    "post_norm" = the returned hidden, "pre_norm" = ``self.last_pre_norm``).
    """

    layout: str = ""
    hidden_source: HiddenSource = "post_norm"
    chain_source: HiddenSource = "post_norm"
    mask_as_array: bool = False  # some attention kernels (MLA) index the mask with mx.where
    max_depth: int | None = None
    default_depth: int | None = None
    reads_trunk_cache: bool = False

    def __init__(self, embed: Embed, lm_head: LMHead, hidden_source: HiddenSource):
        super().__init__()
        if hidden_source not in HIDDEN_SOURCES:
            raise ValueError(f"hidden_source must be one of {HIDDEN_SOURCES}, got {hidden_source!r}")
        # Plain attributes (bound methods are not arrays/modules): kept out of parameters().
        self._embed = embed
        self._shared_lm_head = lm_head
        self.hidden_source = hidden_source
        # A namespace, not an array attribute: arrays set on a Module become parameters.
        self._scratch = SimpleNamespace(pre_norm=None)

    @property
    def last_pre_norm(self) -> mx.array | None:
        """The last call's output before the head's final norm (what DeepSeek-style chaining feeds back)."""
        return self._scratch.pre_norm

    # --- contract ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.decoder_layers())

    def decoder_layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def make_cache(self) -> list:
        """One mlx-lm ``KVCache`` per head decoder layer (every head layer is full attention)."""
        return [KVCache() for _ in self.decoder_layers()]

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        """Logits for a head output; the trunk's LM head unless the checkpoint ships its own."""
        return self._shared_lm_head(head_hidden)

    def chain_input(self, head_out: mx.array) -> mx.array:
        """What the next chained draft step reads: the last position of the returned (post-norm)
        output, or of the state before the head's final norm."""
        if self.chain_source == "pre_norm":
            return self.last_pre_norm[:, -1:]
        return head_out[:, -1:]

    def checkpoint_keys(self) -> dict[str, str]:
        """``{parameter path in this module: tensor name in the checkpoint}`` (mlx-side names,
        e.g. stacked ``switch_mlp`` experts); HF-only spellings are converted at load time."""
        raise NotImplementedError

    # --- helpers for subclasses ---------------------------------------------------
    def _run_layers(self, h: mx.array, layers: Iterable[nn.Module], cache: list | None) -> mx.array:
        from mtplx.trunk.compat import create_attention_mask

        layers = list(layers)
        cache = cache if cache is not None else [None] * len(layers)
        if len(cache) != len(layers):
            raise ValueError(f"head cache has {len(cache)} entries for {len(layers)} layers")
        mask = create_attention_mask(h, cache[0], return_array=self.mask_as_array)
        for layer, c in zip(layers, cache):
            h = layer(h, mask, c)
        return h


def zero_first_position(embedded: mx.array, offset: int) -> mx.array:
    """Zero the token embedding of sequence position 0 (rows are positions ``offset, offset+1, ...``).

    DeepSeek-V3 / GLM / MiMo serving code masks it (vLLM ``deepseek_mtp.py``, ``glm4_moe_mtp.py``,
    ``mimo_mtp.py``: ``inputs_embeds[positions == 0] = 0``; SGLang ``mimo_nextn.py`` the same):
    position 0 pairs the first hidden state with the second token and training never used it.
    """
    if offset > 0:
        return embedded
    return mx.concatenate([mx.zeros_like(embedded[:, :1]), embedded[:, 1:]], axis=1)


class ModuleStackHead(MTPHead):
    """A layout with ``n`` independent MTP modules (DeepSeek ``num_nextn_predict_layers``,
    MiMo ``mtp_layers``), each with its own KV cache.

    Draft step ``s`` reads module ``s % n`` (vLLM's ``spec_step_idx % num_mtp_layers`` in
    ``deepseek_mtp.py`` / ``mimo_mtp.py``; with one module every step uses it). Every call runs
    *all* modules on its input so each module's cache holds every position: the references
    write a module's KV slot only at the steps it runs and leave holes elsewhere; a complete
    cache keeps positions (rope) and attention context exact, and lets the decode loop roll
    every head cache back by the same count. Only module ``s % n``'s output is returned.
    """

    zero_position_zero: bool = True

    @property
    def num_modules(self) -> int:
        return len(self.modules_)

    def decoder_layers(self) -> list[nn.Module]:
        return [m.block for m in self.modules_]

    def _module_forward(self, m: nn.Module, hidden: mx.array, embedded: mx.array, cache: Any) -> mx.array:
        """One module: the pre-final-norm output for (hidden, embedded next token) pairs."""
        raise NotImplementedError

    def _final_norm(self, m: nn.Module) -> nn.Module:
        raise NotImplementedError

    def __call__(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        cache: list | None = None,
        *,
        step: int = 0,
        trunk_cache: list | None = None,
    ) -> mx.array:
        n = self.num_modules
        caches = cache if cache is not None else [None] * n
        if len(caches) != n:
            raise ValueError(f"head cache has {len(caches)} entries for {n} modules")
        embedded = self._embed(next_tokens)
        offset = caches[0].offset if caches[0] is not None else 0
        if self.zero_position_zero:
            embedded = zero_first_position(embedded, offset)
        chosen = step % n
        # Without a cache the other modules' outputs are unused: skip them.
        order = [i for i in range(n) if i != chosen and caches[i] is not None] + [chosen]
        for i in order:
            x = self._module_forward(self.modules_[i], hidden, embedded, caches[i])
        self._scratch.pre_norm = x
        return self._final_norm(self.modules_[chosen])(x)

    def make_cache(self) -> list:
        return [KVCache() for _ in self.modules_]


# --- checkpoint access -------------------------------------------------------------


def weight_index(model_dir: Path) -> dict[str, str]:
    """``{tensor name: file name}`` over every ``*.safetensors`` in ``model_dir``: the shard index's
    weight_map, plus the headers of files it does not list (sidecars such as ``mtp.safetensors``
    that ship the head beside the trunk's shards, as ``mtplx convert`` writes)."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    index: dict[str, str] = {}
    if index_file.exists():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise MtplxError(f"{index_file}: unreadable shard index (no weight_map)") from None
        index = {str(k): str(v) for k, v in weight_map.items()}
    listed = set(index.values())
    files = [f for f in sorted(model_dir.glob("*.safetensors")) if f.name not in listed]
    if not index and not files:
        raise MtplxError(f"{model_dir}: no *.safetensors weights found")
    for f in files:
        index.update({name: f.name for name in read_safetensors_header(f) if name not in index})
    return index


def load_tensors(model_dir: Path, index: dict[str, str], names: Iterable[str]) -> dict[str, mx.array]:
    """Load only ``names``, opening each shard once (mx.load maps the file; untouched tensors cost nothing)."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(index[name], []).append(name)
    out: dict[str, mx.array] = {}
    for file, wanted in by_file.items():
        path = Path(model_dir) / file
        if not path.exists():
            raise MtplxError(f"{path}: shard listed in the index is missing")
        read_safetensors_header(path)  # clear error for truncated/corrupt shards
        try:
            arrays = mx.load(str(path))
        except Exception as e:  # mlx raises RuntimeError/ValueError with a multi-line text
            raise MtplxError(f"{path}: cannot load safetensors ({str(e).splitlines()[0]})") from None
        for name in wanted:
            if name not in arrays:
                raise MtplxError(f"{path}: tensor {name} listed in the index is missing")
            out[name] = arrays[name]
    return out


def source_name(model_dir: Path) -> Path:
    """The file to name in errors about a checkpoint's tensors: its shard index or single shard."""
    for name in ("model.safetensors.index.json", "model.safetensors"):
        if (Path(model_dir) / name).exists():
            return Path(model_dir) / name
    return Path(model_dir)


def keys_with_prefix(index: dict[str, str], prefix: str) -> list[str]:
    return sorted(k for k in index if k.startswith(prefix))


def find_prefix(index: dict[str, str], pattern: str) -> str | None:
    """The shortest prefix ``p`` such that ``p + pattern`` fully matches some key (regex suffix)."""
    rx = re.compile(rf"^(.*?){pattern}$")
    found = sorted({m.group(1) for k in index if (m := rx.match(k))}, key=len)
    return found[0] if found else None


# --- HF -> mlx-side tensor spellings ------------------------------------------------


def stack_experts(weights: dict[str, mx.array], mlp_prefix: str, num_experts: int) -> dict[str, mx.array]:
    """Per-expert HF tensors (``experts.{e}.gate_proj.weight`` or fused ``experts.gate_up_proj``)
    -> mlx-lm's stacked ``switch_mlp.{gate,up,down}_proj.*``; already-stacked input passes through."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        for kind in ("weight", "scales", "biases"):
            first = f"{mlp_prefix}.experts.0.{proj}.{kind}"
            if first in weights:
                parts = [weights.pop(f"{mlp_prefix}.experts.{e}.{proj}.{kind}") for e in range(num_experts)]
                weights[f"{mlp_prefix}.switch_mlp.{proj}.{kind}"] = mx.stack(parts)
    fused = f"{mlp_prefix}.experts.gate_up_proj"
    if fused in weights:
        gate_up = weights.pop(fused)
        mid = gate_up.shape[-2] // 2
        weights[f"{mlp_prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        weights[f"{mlp_prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        weights[f"{mlp_prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{mlp_prefix}.experts.down_proj")
    return weights


def dequantize_fp8_blocks(weights: dict[str, mx.array], block: int = 128) -> dict[str, mx.array]:
    """DeepSeek-style FP8 checkpoints: ``w`` (e4m3) with per-128x128-block ``w_scale_inv`` -> bfloat16."""
    for key in [k for k in weights if k.endswith(".weight_scale_inv")]:
        scale = weights.pop(key)
        wkey = key[: -len("_scale_inv")]
        w = mx.from_fp8(weights[wkey], dtype=mx.bfloat16)
        m, n = w.shape
        pm, pn = (-m) % block, (-n) % block
        w = mx.pad(w, ((0, pm), (0, pn))).reshape((m + pm) // block, block, (n + pn) // block, block)
        w = (w * scale[:, None, :, None]).reshape(m + pm, n + pn)
        weights[wkey] = w[:m, :n].astype(mx.bfloat16)
    return weights


# --- quantization ---------------------------------------------------------------


def quantize_like_checkpoint(
    module: nn.Module, module_to_ckpt: Callable[[str], str], stored: set[str], config: dict
) -> None:
    """Quantize exactly the layers the checkpoint stores quantized (``<key>.scales`` present),
    with its group size / bits / mode, honouring per-layer overrides keyed by checkpoint path."""
    q = quantization_config(config)
    if q is None:
        return

    def predicate(path: str, m: nn.Module):
        ckpt = module_to_ckpt(path)
        override = q.get(ckpt)
        if override is not None:
            return override  # False or {"group_size":..., "bits":...}
        return hasattr(m, "to_quantized") and f"{ckpt}.scales" in stored

    nn.quantize(
        module,
        group_size=q["group_size"],
        bits=q["bits"],
        mode=q.get("mode", "affine"),
        class_predicate=predicate,
    )


# --- norm convention ---------------------------------------------------------------


def is_norm_weight(name: str, value: mx.array) -> bool:
    return value.ndim == 1 and _NORM_WEIGHT.search(name) is not None


def stored_as_offset(value: mx.array) -> bool:
    """Whether one RMSNorm weight is stored as an offset from 1 (HF Qwen3-Next / Qwen3.5 compute
    ``x * (1 + w)``) rather than as the plain scale: decided from the tensor itself, its mean
    nearer 0 than 1. Converters shift some norms and not others (mlx-lm shifts the trunk's and
    drops the head), so no other tensor can answer this for it."""
    return abs(mx.mean(value.astype(mx.float32)).item()) < 0.5


def plain_norms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Every 1-D ``*norm*.weight`` as a plain RMSNorm scale: +1 for those stored as offsets."""
    return {k: (v + 1.0 if is_norm_weight(k, v) and stored_as_offset(v) else v) for k, v in weights.items()}


_NORM_WEIGHT = re.compile(r"(^|\.)[^.]*norm[^.]*\.weight$")


def check_and_load(module: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    """``module.load_weights`` with one-line MtplxErrors for missing/unexpected/mis-shaped tensors."""
    params = dict(tree_flatten(module.parameters()))
    missing = sorted(set(params) - set(weights))
    if missing:
        raise MtplxError(
            f"{source}: MTP head tensor(s) missing: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
        )
    extra = sorted(set(weights) - set(params))
    if extra:
        raise MtplxError(
            f"{source}: unexpected MTP head tensor(s): {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
        )
    for name, p in params.items():
        if tuple(weights[name].shape) != tuple(p.shape):
            raise MtplxError(
                f"{source}: MTP head tensor {name} has shape {tuple(weights[name].shape)}, expected {tuple(p.shape)}"
            )
    module.load_weights(list(weights.items()), strict=True)
    mx.eval(module.parameters())


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
