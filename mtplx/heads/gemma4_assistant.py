"""Gemma 4 assistant drafters (``gemma4_assistant`` / ``gemma4_unified_assistant`` checkpoints).

Google ships the Gemma 4 MTP drafter as a separate small checkpoint
(``google/gemma-4-*-it-assistant``). Unlike the in-checkpoint heads it owns no KV
cache: every layer attends to the *target's* keys and values, and the position it
stands at never moves within a draft cycle. With ``p`` the position of the last
token the target has forwarded, ``hidden`` the target's post-norm hidden state at
``p`` and ``t`` the token that follows it::

    x = pre_projection(concat([target_embed(t) * sqrt(H_target), hidden]))   # 2*H_target -> h
    for each layer (a KV-shared Gemma 4 decoder layer of type sliding / full):
        queries at position p (RoPE of that layer type), keys/values = the target's
        KV of the last non-shared target layer of the same type:
          full_attention:    positions 0..p
          sliding_attention: positions max(0, p-W+1)..p  (the window the target itself uses at p)
    h = norm(x)
    chain = post_projection(h)                       # h -> H_target, fed back as `hidden` at step >= 1
    logits = lm_head(h)                              # tied: the drafter's own model.embed_tokens
           | masked_embedding(h)                     # use_ordered_embeddings: centroid-narrowed vocabulary

The narrowed vocabulary scores the tokens of the ``centroid_intermediate_top_k``
best centroids (``token_ordering`` lists each centroid's tokens) and fills every
other token with a floor logit ``min(candidate logits) - 1`` (the reference) or
``-inf`` (``non_candidate_fill="zero_mass"``). Either way the logits returned are
exactly the ones the draft is drawn from, so q in the verifier is exact.

References followed (read for facts, nothing copied):
- transformers ``models/gemma4_assistant/modeling_gemma4_assistant.py`` and
  ``configuration_gemma4_assistant.py``: pre/post projections, bidirectional masks
  over the shared KV (the sliding window counted back from the newest key), tied
  lm_head, ``Gemma4AssistantMaskedEmbedder`` (floor = min - 1), all layers KV-shared.
- mlx-vlm 0.7.10 ``speculative/drafters/gemma4_assistant/{gemma4_assistant,masks,
  masked_embedder,config}.py`` and ``speculative/mtp.py`` (``_mtp_rounds``): input
  order [embed(token) * embed_scale, hidden], hidden = target final-norm output, the
  KV of the last layer of each type, query position = KV length - 1 held constant
  across the cycle, ``gemma4_unified_assistant`` = the same model. One deliberate
  difference: when its loop holds the sliding KV cut to the newest keys (after a verify
  block, once the window has wrapped), ``_local_window_offset`` places the query one slot
  past the newest key and the mask drops the oldest key of the window; here the query
  always sees the full window of W keys, as in transformers and as the target's own
  attention at p does (``tests/heads/test_gemma4.py`` shows both against the float64 reference).
  Measured on the tiny random models (t=1.0, depth 2, 64-token vocabulary, 16 candidates):
  acceptance 0.15 with the floor fill vs 0.10 with zero mass; real checkpoints will differ.
- mlx-lm 0.32.2 ``models/gemma4_text.py``: the decoder layer used here (built with
  every layer KV-shared), KV sharing (``previous_kvs``), caches only for the
  non-shared layers.
- mlx-swift-lm ``Libraries/MLXLLM/Models/Gemma4Assistant.swift`` and
  ``MLXLMCommon/MTPSpeculativeTokenIterator.swift``: the same projections and
  masked embedder; that port applies no query RoPE or window mask, which this
  module does not follow (transformers and mlx-vlm apply both).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from mtplx.errors import MtplxError
from mtplx.heads.base import HiddenSource, MTPHead, model_args_of
from mtplx.heads.weights import HeadSource, load_head_weights, load_tensors, weight_index
from mtplx.trunk.compat import KVCache, RotatingKVCache, kv_state, rotating_state

import mlx.core as mx
import mlx.nn as nn

LAYOUT = "gemma4_assistant"
ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
TARGET_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified")
DEFAULT_HIDDEN_SOURCE: HiddenSource = "post_norm"  # the target's final-norm output (transformers, mlx-vlm)
NonCandidateFill = Literal["floor", "zero_mass"]
NON_CANDIDATE_FILLS = ("floor", "zero_mass")
ATTENTION_TYPES = ("sliding_attention", "full_attention")
# Tensors a KV-shared layer never uses (HF writes them; mlx-lm's gemma4_text sanitize drops them too).
_UNUSED_SUFFIXES = (
    ".self_attn.k_proj.weight",
    ".self_attn.v_proj.weight",
    ".self_attn.k_norm.weight",
    ".self_attn.v_norm.weight",
)


class MaskedEmbedder(nn.Module):
    """Centroid-routed output layer: logits for the tokens of the top-k centroids only."""

    def __init__(self, hidden_size: int, vocab_size: int, num_centroids: int, top_k: int):
        super().__init__()
        if vocab_size % num_centroids:
            raise ValueError(f"vocab_size {vocab_size} is not a multiple of num_centroids {num_centroids}")
        self.num_centroids = num_centroids
        self.top_k = top_k
        self.tokens_per_centroid = vocab_size // num_centroids
        self.centroids = nn.Linear(hidden_size, num_centroids, bias=False)
        # A checkpoint buffer (int64 in HF files), loaded like a parameter, never quantized.
        self.token_ordering = mx.zeros((vocab_size,), dtype=mx.int32)

    def candidates(self, h: mx.array) -> mx.array:
        """Token ids scored for each row of h[B, L, h]: [B, L, top_k * tokens_per_centroid]."""
        scores = self.centroids(h)
        top = mx.argpartition(scores, kth=-self.top_k, axis=-1)[..., -self.top_k :]
        groups = self.token_ordering.reshape(self.num_centroids, self.tokens_per_centroid)
        return groups[top].reshape(*h.shape[:-1], -1)

    def candidate_logits(self, h: mx.array, embedding: mx.array, candidates: mx.array) -> mx.array:
        rows = embedding[candidates]  # [B, L, C, h]
        return (h[..., None, :] @ rows.swapaxes(-1, -2)).squeeze(-2)


class Gemma4AssistantHead(MTPHead):
    """A Gemma 4 assistant checkpoint as a draft head (no own cache; reads the trunk's KV)."""

    layout = LAYOUT
    hidden_source: HiddenSource = DEFAULT_HIDDEN_SOURCE
    reads_trunk_cache = True

    def __init__(
        self,
        config: dict,
        source_layers: dict[str, int],
        *,
        trunk: Any,
        non_candidate_fill: NonCandidateFill = "floor",
    ):
        """``config``: the assistant's config.json; ``source_layers``: attention type -> index of
        the target cache it reads; ``trunk`` supplies the target's embedding (and its scale)."""
        from mlx_lm.models import gemma4_text

        if non_candidate_fill not in NON_CANDIDATE_FILLS:
            raise ValueError(
                f"non_candidate_fill must be one of {NON_CANDIDATE_FILLS}, got {non_candidate_fill!r}"
            )
        target_embed_scale = float(getattr(trunk.inner, "embed_scale", 1.0))
        super().__init__(embed=lambda t: trunk.embed(t) * target_embed_scale, lm_head=trunk.lm_head)
        args = drafter_args(config)
        backbone = int(config["backbone_hidden_size"])
        # A read-only mapping, not a dict: dicts set on a Module join its parameter tree.
        self.source_layers = MappingProxyType(dict(source_layers))
        self.sliding_window = int(args.sliding_window)
        self.non_candidate_fill = non_candidate_fill
        self.tied = bool(config.get("tie_word_embeddings", True))
        block_size = config.get("block_size")
        self.default_depth = int(block_size) - 1 if block_size and int(block_size) > 1 else None

        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = [gemma4_text.DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.model.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.pre_projection = nn.Linear(2 * backbone, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, backbone, bias=False)
        if not self.tied:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if config.get("use_ordered_embeddings"):
            self.masked_embedding = MaskedEmbedder(
                args.hidden_size,
                args.vocab_size,
                int(config.get("num_centroids", 2048)),
                int(config.get("centroid_intermediate_top_k", 32)),
            )
        self._scratch.candidates = []  # per draft step of the current cycle: [ids], with its position
        self._scratch.position = None
        self._scratch.outside = mx.array(0)
        self._scratch.checked = 0

    # --- contract ---------------------------------------------------------------------
    def decoder_layers(self) -> list[nn.Module]:
        return self.model.layers

    def make_cache(self) -> list:
        """No cache of its own: the drafter's keys and values are the target's."""
        return []

    def chain_input(self, head_out: mx.array) -> mx.array:
        """The up-projected state (``post_projection``), which the next step reads as its hidden."""
        return self.post_projection(head_out[:, -1:])

    def _forward(self, hidden: mx.array, next_tokens: mx.array, cache: list | None, step: int) -> mx.array:
        """``cache`` is the target's (``reads_trunk_cache``). Only the last (hidden, token) pair
        matters: the drafter keeps no state between calls."""
        position = self._position(cache)
        if step == 0:
            self._count_targets_outside(next_tokens, position)
        kv = {kind: _window_kv(cache[i], self._window(kind)) for kind, i in self.source_layers.items()}
        x = self.pre_projection(mx.concatenate([self._embed(next_tokens[:, -1:]), hidden[:, -1:]], axis=-1))
        for layer in self.model.layers:
            x, _, _ = layer(x, None, None, shared_kv=kv[layer.layer_type], offset=position)
        self._scratch.position = position
        return x

    def _final_norm(self, step: int) -> nn.Module:
        return self.model.norm

    def logits(self, head_hidden: mx.array, step: int = 0) -> mx.array:
        if not self.narrowed:
            return (
                self.lm_head(head_hidden) if not self.tied else self.model.embed_tokens.as_linear(head_hidden)
            )
        masked = self.masked_embedding
        candidates = masked.candidates(head_hidden)
        selected = masked.candidate_logits(head_hidden, self._output_embedding(), candidates)
        if step == 0:
            self._scratch.candidates = []
        self._scratch.candidates.append(candidates.reshape(-1))
        fill = selected.min() - 1.0 if self.non_candidate_fill == "floor" else mx.array(-mx.inf)
        out = mx.broadcast_to(fill.astype(selected.dtype), (*selected.shape[:-1], masked.token_ordering.size))
        return mx.put_along_axis(out, candidates, selected, axis=-1)

    @property
    def narrowed(self) -> bool:
        """Whether it drafts from a centroid-narrowed vocabulary (ordered-embedding checkpoints)."""
        return "masked_embedding" in self

    def counters(self) -> dict[str, int]:
        """With a narrowed vocabulary: how many target tokens (committed at a drafted position)
        were checked against that step's candidate set, and how many lay outside it."""
        if not self.narrowed:
            return {}
        return {
            "target_checked": self._scratch.checked,
            "target_outside_candidates": int(self._scratch.outside.item()),
        }

    # --- helpers ------------------------------------------------------------------------
    def _output_embedding(self) -> mx.array:
        layer = self.lm_head if not self.tied else self.model.embed_tokens
        if "scales" in layer:  # quantized: the gathered rows are dequantized
            return mx.dequantize(
                layer.weight, layer.scales, layer.get("biases"), layer.group_size, layer.bits, mode=layer.mode
            )
        return layer.weight

    def _window(self, kind: str) -> int | None:
        return self.sliding_window if kind == "sliding_attention" else None

    def _position(self, trunk_cache: list) -> int:
        offset = trunk_cache[next(iter(self.source_layers.values()))].offset
        if offset < 1:
            raise ValueError("the Gemma 4 assistant drafts after the target has forwarded at least one token")
        return offset - 1

    def _count_targets_outside(self, next_tokens: mx.array, position: int) -> None:
        """The tokens a cycle starts from are the target's tokens at the previous cycle's draft
        positions (accepted drafts, then the correction): compare each with that step's candidates.
        Counted only when the positions line up (a fresh generation starts over)."""
        previous = self._scratch.candidates
        self._scratch.candidates = []
        if not previous or self._scratch.position is None:
            return
        tokens = next_tokens[0]
        if self._scratch.position + tokens.size != position:
            return
        n = min(tokens.size, len(previous))
        missed = mx.stack([~mx.any(previous[j] == tokens[j]) for j in range(n)]).astype(mx.int32).sum()
        self._scratch.outside = self._scratch.outside + missed
        self._scratch.checked += n
        # Evaluated in the background, so the running count never holds the candidate sets alive.
        mx.async_eval(self._scratch.outside)

    # --- checkpoint naming: the assistant's own checkpoint, named as its parameters -------
    def checkpoint_prefixes(self) -> tuple[str, ...]:
        return ("",)

    def checkpoint_name(self, path: str) -> str:
        return path

    def sanitize(self, tensors: dict[str, mx.array], src: HeadSource) -> dict[str, mx.array]:
        """Drops what a KV-shared, tied drafter never uses; ``token_ordering`` (int64 in HF files) as int32."""
        weights = {
            k: v
            for k, v in tensors.items()
            if "self_attn.rotary_emb" not in k
            and not k.endswith(_UNUSED_SUFFIXES)
            and not (self.tied and k == "lm_head.weight")
        }
        if "masked_embedding.token_ordering" in weights:
            ordering = weights["masked_embedding.token_ordering"]
            weights["masked_embedding.token_ordering"] = ordering.astype(mx.int32)
        return weights


def _window_kv(cache: Any, window: int | None) -> tuple[mx.array, mx.array]:
    """The committed keys/values of one target cache in temporal order, the newest ``window`` of them
    for a sliding layer. A RotatingKVCache holds its window either in temporal order (after a
    multi-token update or a rollback) or rotated in place (after one-token updates)."""
    if type(cache) is KVCache:
        state = kv_state(cache)
        keys, values = state.keys[..., : state.offset, :], state.values[..., : state.offset, :]
    elif type(cache) is RotatingKVCache:
        state = rotating_state(cache)
        keys, values, idx = state.keys, state.values, state.idx
        if state.keep:
            raise ValueError("a RotatingKVCache with keep > 0 is not a Gemma 4 sliding cache")
        if idx < state.offset and idx != keys.shape[2]:  # wrapped in place: the oldest entry sits at idx
            keys = mx.concatenate([keys[..., idx:, :], keys[..., :idx, :]], axis=2)
            values = mx.concatenate([values[..., idx:, :], values[..., :idx, :]], axis=2)
        else:
            keys, values = keys[..., :idx, :], values[..., :idx, :]
    else:
        raise ValueError(f"the Gemma 4 assistant cannot read a {type(cache).__name__} of the target")
    if window is not None and keys.shape[2] > window:
        keys, values = keys[..., -window:, :], values[..., -window:, :]
    return keys, values


# --- config ------------------------------------------------------------------------------


def drafter_args(config: dict) -> Any:
    """mlx-lm gemma4_text ModelArgs for the drafter's layers: every layer KV-shared, dense MLP,
    no per-layer inputs (what transformers' ``Gemma4AssistantConfig.validate_architecture`` requires)."""
    from mlx_lm.models import gemma4_text

    text = dict(config.get("text_config") or {})
    text.update(
        num_kv_shared_layers=text.get("num_hidden_layers", 4),
        hidden_size_per_layer_input=0,
        use_double_wide_mlp=False,
        enable_moe_block=False,
    )
    return gemma4_text.ModelArgs.from_dict(text)


def is_assistant_config(config: dict) -> bool:
    return str(config.get("model_type", "")) in ASSISTANT_MODEL_TYPES


def is_gemma4_target(config: dict) -> bool:
    return str(config.get("model_type", "")) in TARGET_MODEL_TYPES


def read_assistant_config(path: Path) -> dict | None:
    """The config.json of an assistant directory, or None if ``path`` holds something else."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return config if isinstance(config, dict) and is_assistant_config(config) else None


def _target_text_config(target_config: dict) -> dict:
    return target_config.get("text_config") or target_config


def pairing_problem(assistant: dict, target_config: dict) -> str | None:
    """Why the assistant (config) does not fit the target (config), else None: config-only, so
    ``mtplx inspect`` can name a pairing without loading anything."""
    if not is_gemma4_target(target_config):
        kind = target_config.get("model_type", "unknown")
        return f"a Gemma 4 assistant drafts for Gemma 4 targets only, the target is {kind}"
    target = _target_text_config(target_config)
    text = assistant.get("text_config") or {}
    backbone, hidden = assistant.get("backbone_hidden_size"), target.get("hidden_size")
    if backbone != hidden:
        return f"backbone_hidden_size {backbone} does not match the target's hidden_size {hidden}"
    vocab, target_vocab = text.get("vocab_size"), target.get("vocab_size", target_config.get("vocab_size"))
    if vocab != target_vocab:
        return f"vocab_size {vocab} does not match the target's vocab_size {target_vocab}"
    return None


def source_layers_of(trunk_model: nn.Module, needed: set[str]) -> dict[str, int]:
    """For each attention type the drafter reads: the last target layer of that type that owns a
    cache (KV-shared target layers reuse exactly that layer's keys and values)."""
    args = model_args_of(trunk_model)
    owners = args.num_hidden_layers - int(getattr(args, "num_kv_shared_layers", 0) or 0)
    found = {kind: i for i, kind in enumerate(args.layer_types[:owners])}
    missing = sorted(needed - set(found))
    if missing:
        raise MtplxError(
            f"the assistant reads the target's {', '.join(missing)} KV but the target has no such layer"
        )
    return {kind: found[kind] for kind in sorted(needed)}


def _check_layer_shapes(head: Gemma4AssistantHead, trunk_model: nn.Module, source: str) -> None:
    """Each drafter layer's queries must match the head dim and divide into the KV heads of the
    target layer it reads, and its window must not exceed the target's."""
    target_layers = trunk_model.layers
    target_args = model_args_of(trunk_model)
    for i, layer in enumerate(head.model.layers):
        own = layer.self_attn
        theirs = target_layers[head.source_layers[layer.layer_type]].self_attn
        if own.head_dim != theirs.head_dim:
            raise MtplxError(
                f"{source}: layer {i} ({layer.layer_type}) has head_dim {own.head_dim}, "
                f"the target's {layer.layer_type} KV has {theirs.head_dim}"
            )
        if own.n_heads % theirs.n_kv_heads:
            raise MtplxError(
                f"{source}: layer {i} has {own.n_heads} query heads, not a multiple of the target's "
                f"{theirs.n_kv_heads} KV heads"
            )
    if "sliding_attention" in head.source_layers and head.sliding_window > target_args.sliding_window:
        raise MtplxError(
            f"{source}: sliding_window {head.sliding_window} exceeds the target's {target_args.sliding_window}"
        )


def load_gemma4_assistant(
    assistant_dir: Path,
    trunk: Any,
    target_config: dict,
    *,
    non_candidate_fill: NonCandidateFill = "floor",
) -> Gemma4AssistantHead:
    """The assistant in ``assistant_dir`` as a draft head for ``trunk``; one-line MtplxError
    naming the mismatch when it does not fit the target."""
    assistant_dir = Path(assistant_dir)
    config_path = assistant_dir / "config.json"
    config = read_assistant_config(assistant_dir)
    if config is None:
        raise MtplxError(
            f"{config_path}: not a Gemma 4 assistant config (model_type {', '.join(ASSISTANT_MODEL_TYPES)})"
        )
    problem = pairing_problem(config, target_config)
    if problem is not None:
        raise MtplxError(f"{config_path}: {problem}")
    args = drafter_args(config)
    for kind in args.layer_types:
        if kind not in ATTENTION_TYPES:
            raise MtplxError(f"{config_path}: unknown layer type {kind!r}")
    try:
        sources = source_layers_of(trunk.model, set(args.layer_types[: args.num_hidden_layers]))
    except MtplxError as e:
        raise MtplxError(f"{config_path}: {e}") from None
    head = Gemma4AssistantHead(config, sources, trunk=trunk, non_candidate_fill=non_candidate_fill)
    _check_layer_shapes(head, trunk.model, str(config_path))

    load_head_weights(head, HeadSource(assistant_dir, config, weight_index(assistant_dir), trunk))
    return head


# --- finding the assistant of a target -----------------------------------------------------

MISSING_ASSISTANT = (
    "this Gemma 4 model has no assistant drafter: pass --head DIR (a gemma4_assistant checkpoint, "
    "e.g. google/<model>-assistant), or put <model>-assistant beside the model; --no-mtp decodes without one"
)


def assistant_candidates(
    model_path: Path, spec: str | Path | None, hub_cache: str | Path | None = None
) -> list[tuple[str, Path | None]]:
    """Where the assistant of a target would be, in order: ``<dir>-assistant`` beside the target
    directory, then ``<repo id>-assistant`` in the Hugging Face cache. (name, path or None)."""
    out: list[tuple[str, Path | None]] = []
    sibling = Path(model_path).parent / f"{Path(model_path).name}-assistant"
    out.append((str(sibling), sibling if sibling.is_dir() else None))
    if isinstance(spec, str) and not Path(spec).expanduser().exists() and "/" in spec:
        repo = f"{spec}-assistant"
        out.append((repo, _cached_repo(repo, hub_cache)))
    return out


def _cached_repo(repo_id: str, hub_cache: str | Path | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=hub_cache))
    except Exception:  # not cached (mtplx never downloads)
        return None


def find_assistant(
    model_path: Path, spec: str | Path | None, hub_cache: str | Path | None = None
) -> Path | None:
    """The first existing assistant directory for a target (see ``assistant_candidates``)."""
    for _, path in assistant_candidates(model_path, spec, hub_cache):
        if path is not None and read_assistant_config(path) is not None:
            return path
    return None


# --- conversion ----------------------------------------------------------------------------------


def convert_assistant(
    src: str | Path, target_dir: str | Path, *, bits: int | None = None, group_size: int = 64
) -> Path:
    """Write the assistant ``src`` (directory or cached repo id) as ``<target_dir>-assistant``,
    where ``Engine.load`` finds it: bfloat16 by default (the drafter stays unquantized on a
    quantized trunk), or its matrices ``bits``-bit quantized (mlx affine, ``group_size``).
    Written to a temporary name, then renamed."""
    import shutil

    from mtplx.checkpoints.load import resolve_model

    if bits not in (None, 4, 8):
        raise MtplxError(f"bits: must be 4 or 8 (or omitted for bfloat16), got {bits}")
    src = resolve_model(str(src))
    config = read_assistant_config(src)
    if config is None:
        raise MtplxError(f"{src / 'config.json'}: not a Gemma 4 assistant config")
    out = Path(target_dir).parent / f"{Path(target_dir).name}-assistant"
    if out.exists():
        raise MtplxError(f"{out}: already exists")
    index = weight_index(src)
    tensors = load_tensors(src, index, list(index))
    written: dict[str, mx.array] = {}
    for name, value in tensors.items():
        if name == "masked_embedding.token_ordering":
            written[name] = value.astype(mx.int32)
            continue
        value = value.astype(mx.bfloat16)
        quantizable = name.endswith(".weight") and value.ndim == 2 and value.shape[-1] % group_size == 0
        if bits and quantizable:
            w, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            prefix = name[: -len(".weight")]
            written.update({name: w, f"{prefix}.scales": scales, f"{prefix}.biases": biases})
        else:
            written[name] = value
    if bits:
        config = {**config, "quantization": {"group_size": group_size, "bits": bits, "mode": "affine"}}
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), written, {"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(out)
    return out
