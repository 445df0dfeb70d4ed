"""Which published drafter layout a ``config.json`` is, and the DFlash facts read from it.

Standard library only (the CLI's ``inspect`` and discovery read configs before MLX loads). The
rules are mlx-vlm 0.7.10's (``mlx_vlm/utils.py:get_model_type``, ``speculative/drafters/
__init__.py``, ``qwen3_dflash/config.py``, ``gemma4_dflash/__init__.py``):

- ``architectures`` holding ``DFlash2DraftModel``: DFlash2; ``Gemma4DSparkModel``: DSpark;
- a ``dflash_config`` whose ``projector_type`` is ``dspark`` or with a ``markov_rank`` > 0: DSpark;
  any other ``dflash_config``: DFlash (z-lab's format; ``<model_type>_dflash``);
- ``model_type`` (or ``speculators_model_type``) ``eagle3``: EAGLE-3; ``dspark``, ``qwen3_dspark``,
  ``gemma4_dspark``, ``deepseek_v4_dspark``: DSpark.

DFlash keys: ``dflash_config.{mask_token_id, target_layer_ids, num_target_layers, causal,
attention_sink_bias, runtime_block_size, draft_window_size}`` (each also read at the top level,
``dflash_query_causal`` the older spelling of ``causal``), ``block_size``, ``rope_parameters``
(its ``rope_theta`` lifted out), and the Qwen3 decoder keys. Gemma 4 DFlash drafters default
``mask_token_id`` to 4; elsewhere it must be given (a missing one is an error naming it, where
mlx-vlm would assume Qwen3.5's 248070).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtplx.errors import MtplxError

DSPARK_MODEL_TYPES = ("dspark", "qwen3_dspark", "gemma4_dspark", "deepseek_v4_dspark")
GEMMA4_DFLASH_MASK_TOKEN = 4


def drafter_layout(config: Mapping[str, Any]) -> str | None:
    """``dflash``, ``dflash2``, ``dspark`` or ``eagle3``; None when ``config`` is none of them."""
    model_type = str(config.get("model_type") or config.get("speculators_model_type") or "").lower()
    architectures = set(config.get("architectures") or ())
    dflash_config = config.get("dflash_config")
    if "DFlash2DraftModel" in architectures:
        return "dflash2"
    if "Gemma4DSparkModel" in architectures or model_type in DSPARK_MODEL_TYPES:
        return "dspark"
    if isinstance(dflash_config, Mapping):
        rank = config.get("markov_rank") or dflash_config.get("markov_rank") or 0
        return "dspark" if dflash_config.get("projector_type") == "dspark" or int(rank) > 0 else "dflash"
    if model_type == "eagle3":
        return "eagle3"
    return None


@dataclass(frozen=True)
class DFlashSpec:
    """A DFlash drafter's shape and block facts (z-lab's format, as mlx-vlm 0.7.10 reads it)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    rope_theta: float
    rope_traditional: bool  # not ``rope_is_neox_style`` (mlx-vlm's ``_build_rope``)
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    is_causal: bool
    tie_word_embeddings: bool
    final_logit_softcapping: float | None
    draft_window_size: int | None  # mlx-vlm bounds the drafter's context cache with it; not yet here

    @property
    def concat_dim(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


def _field(config: Mapping[str, Any], dflash: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return dflash[key] if key in dflash else config.get(key, default)


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MtplxError(f"DFlash config: {name} must be an integer, got {value!r}")
    return value


def _rope_theta(config: Mapping[str, Any]) -> float:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, Mapping) else None
    if kind not in ("default", None):
        raise MtplxError(f"DFlash config: rope type {kind!r} is not supported (default rope only)")
    theta = rope.get("rope_theta") if isinstance(rope, Mapping) else None
    return float(theta if theta is not None else config.get("rope_theta", 10000.0))


def _unsupported(config: Mapping[str, Any], dflash: Mapping[str, Any]) -> None:
    types = set(config.get("layer_types") or ["full_attention"])
    if types != {"full_attention"}:
        raise MtplxError(f"DFlash config: layer_types {sorted(types)} not supported (full attention only)")
    if _field(config, dflash, "attention_sink_bias", False):
        raise MtplxError("DFlash config: dflash_config.attention_sink_bias is not supported")


def dflash_spec(config: Mapping[str, Any]) -> DFlashSpec:
    """Read a DFlash ``config.json``; a missing or malformed field is a one-line error naming it."""
    dflash = config.get("dflash_config") or {}
    model_type = str(config.get("model_type", "")).lower()
    _unsupported(config, dflash)
    mask = _field(config, dflash, "mask_token_id")
    if mask is None and model_type.startswith("gemma4"):
        mask = GEMMA4_DFLASH_MASK_TOKEN
    if mask is None:
        raise MtplxError("DFlash config: dflash_config.mask_token_id is missing")
    layer_ids = _field(config, dflash, "target_layer_ids")
    if not layer_ids or not all(isinstance(i, int) and i >= 0 for i in layer_ids):
        raise MtplxError(
            f"DFlash config: dflash_config.target_layer_ids must be layer indices, got {layer_ids!r}"
        )
    causal = dflash.get("causal", config.get("dflash_query_causal", False))
    required = {}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in config:
            raise MtplxError(f"DFlash config: {key} is missing")
        required[key] = _int(config[key], key)
    heads = required["num_attention_heads"]
    window = _field(config, dflash, "draft_window_size")
    return DFlashSpec(
        model_type=model_type,
        **required,
        num_key_value_heads=_int(config.get("num_key_value_heads", heads), "num_key_value_heads"),
        head_dim=_int(config.get("head_dim", required["hidden_size"] // heads), "head_dim"),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        rope_traditional=not bool(config.get("rope_is_neox_style", True)),
        block_size=_int(config.get("block_size", 16), "block_size"),
        mask_token_id=_int(mask, "dflash_config.mask_token_id"),
        target_layer_ids=tuple(layer_ids),
        num_target_layers=_int(
            _field(config, dflash, "num_target_layers", max(layer_ids) + 1), "num_target_layers"
        ),
        is_causal=bool(causal),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        draft_window_size=None if window is None else _int(window, "dflash_config.draft_window_size"),
    )


def dflash_fit_problem(spec: DFlashSpec, hidden_size: int, num_layers: int, vocab_size: int) -> str | None:
    """Why a DFlash drafter does not fit a trunk (one line naming the field), or None."""
    if spec.hidden_size != hidden_size:
        return f"hidden_size {spec.hidden_size} != the trunk's {hidden_size}"
    if spec.num_target_layers != num_layers:
        return f"dflash_config.num_target_layers {spec.num_target_layers} != the trunk's {num_layers} layers"
    if max(spec.target_layer_ids) >= num_layers:
        return f"dflash_config.target_layer_ids names layer {max(spec.target_layer_ids)} of a {num_layers}-layer trunk"
    if spec.vocab_size != vocab_size:
        return f"vocab_size {spec.vocab_size} != the trunk's {vocab_size}"
    if not 0 <= spec.mask_token_id < vocab_size:
        return f"dflash_config.mask_token_id {spec.mask_token_id} is outside the vocabulary ({vocab_size})"
    return None


@dataclass(frozen=True)
class Eagle3Spec:
    """An EAGLE-3 drafter (mlx-vlm 0.7.10's ``eagle3`` and the speculators format): one first
    layer over [embedding, hidden] (attention input 2H), more plain decoder layers, a reduced
    draft vocabulary mapped to the target's by ``d2t`` (target id = draft id + d2t[draft id])."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_traditional: bool
    attention_bias: bool
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # eagle_aux_hidden_state_layer_ids (hidden_states indices)
    norm_before_residual: bool
    norm_before_fc: bool
    tie_word_embeddings: bool
    block_size: int

    @property
    def uses_draft_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def tapped_layers(self, target_layers: int) -> tuple[int, ...]:
        """The trunk layers whose outputs feed the drafter, in order. The ids are indices into
        Hugging Face's ``hidden_states`` (entry i = layer i - 1's output), so layer ``max(i - 1, 0)``
        as mlx-vlm 0.7.10 captures them; without ids, EAGLE-3's low / middle / high default
        ``[2, n // 2, n - 3]`` of the target's ``n`` layers (mlx-vlm takes ``n`` from the drafter's own
        config, which names one layer: a default that cannot be meant)."""
        ids = self.aux_layer_ids or (2, target_layers // 2, max(target_layers - 3, 0))
        return tuple(max(int(i) - 1, 0) for i in ids)


def eagle3_spec(config: Mapping[str, Any]) -> Eagle3Spec:
    """Read an EAGLE-3 ``config.json``; a missing or malformed field is a one-line error naming it."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise MtplxError("EAGLE-3 config: transformer_layer_config is missing")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if key not in layer:
            raise MtplxError(f"EAGLE-3 config: transformer_layer_config.{key} is missing")
    hidden, heads = (
        _int(layer["hidden_size"], "hidden_size"),
        _int(layer["num_attention_heads"], "num_attention_heads"),
    )
    rope = layer.get("rope_parameters") or {}
    if (
        rope.get("rope_type", "default") != "default"
        or (layer.get("rope_scaling") or {}).get("rope_type", "default") != "default"
    ):
        raise MtplxError(
            "EAGLE-3 config: transformer_layer_config.rope_scaling is not supported (default rope only)"
        )
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (len(ids) != 3 or not all(isinstance(i, int) and i >= 0 for i in ids)):
        raise MtplxError(
            f"EAGLE-3 config: eagle_aux_hidden_state_layer_ids must be 3 layer indices, got {ids!r}"
        )
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    vocab = _int(layer["vocab_size"], "transformer_layer_config.vocab_size")
    return Eagle3Spec(
        hidden_size=hidden,
        intermediate_size=_int(layer["intermediate_size"], "intermediate_size"),
        num_hidden_layers=_int(layer.get("num_hidden_layers", 1), "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=_int(layer.get("num_key_value_heads", heads), "num_key_value_heads"),
        head_dim=_int(layer.get("head_dim") or hidden // heads, "head_dim"),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", layer.get("rope_theta", 10000.0))),
        rope_traditional=bool(layer.get("rope_traditional", False)),
        attention_bias=bool(layer.get("attention_bias", False)),
        vocab_size=vocab,
        draft_vocab_size=_int(config.get("draft_vocab_size", vocab), "draft_vocab_size"),
        target_hidden_size=_int(config.get("target_hidden_size") or hidden, "target_hidden_size"),
        aux_layer_ids=None if ids is None else tuple(ids),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        norm_before_fc=bool(config.get("norm_before_fc", False)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        block_size=_int(config.get("block_size", int(tokens) + 2 if tokens is not None else 5), "block_size"),
    )


def eagle3_fit_problem(spec: Eagle3Spec, hidden_size: int, num_layers: int, vocab_size: int) -> str | None:
    """Why an EAGLE-3 drafter does not fit a trunk (one line naming the field), or None."""
    if spec.target_hidden_size != hidden_size:
        return f"target_hidden_size {spec.target_hidden_size} != the trunk's {hidden_size}"
    if spec.vocab_size != vocab_size:
        return f"transformer_layer_config.vocab_size {spec.vocab_size} != the trunk's {vocab_size}"
    if max(spec.tapped_layers(num_layers)) >= num_layers:
        return f"eagle_aux_hidden_state_layer_ids {list(spec.aux_layer_ids or ())} name a layer past the trunk's {num_layers}"
    return None


@dataclass(frozen=True)
class DSparkSpec:
    """A DSpark drafter (mlx-vlm 0.7.10 ``drafters/dspark``): a DFlash backbone, a low-rank Markov
    correction of each position's logits by the previous token, and an optional confidence head.
    ``backbone.block_size`` is the verification width (anchor + ``proposal_length`` drafts): the
    checkpoint's ``block_size`` plus one unless ``dspark_bonus_anchor`` says it counts the anchor."""

    backbone: DFlashSpec
    proposal_length: int
    sample_from_anchor: bool
    markov_rank: int
    confidence_head: bool
    confidence_with_markov: bool


def dspark_spec(config: Mapping[str, Any]) -> DSparkSpec:
    """Read a DSpark ``config.json`` (``dflash_config`` with ``projector_type`` ``dspark`` or a
    ``markov_rank``); a missing or unsupported field is a one-line error naming it."""
    dflash = config.get("dflash_config")
    if not isinstance(dflash, Mapping):
        raise MtplxError("DSpark config: dflash_config is missing")
    if dflash.get("projector_type") not in (None, "dspark"):
        raise MtplxError(
            f"DSpark config: dflash_config.projector_type {dflash.get('projector_type')!r} is not dspark"
        )
    if dflash.get("markov_head_type", "vanilla") != "vanilla":
        raise MtplxError("DSpark config: dflash_config.markov_head_type must be vanilla")
    if config.get("hidden_act", "silu") != "silu":
        raise MtplxError("DSpark config: hidden_act must be silu")
    raw = dflash.get("block_size", config.get("block_size"))
    if raw is None:
        raise MtplxError("DSpark config: dflash_config.block_size is missing")
    width = _int(raw, "dflash_config.block_size") + (0 if config.get("dspark_bonus_anchor") else 1)
    backbone = dflash_spec({**config, "block_size": width})
    rank = dflash.get("markov_rank", config.get("markov_rank", 256))
    return DSparkSpec(
        backbone=backbone,
        proposal_length=width - 1,
        sample_from_anchor=bool(dflash.get("sample_from_anchor", True)),
        markov_rank=_int(rank, "dflash_config.markov_rank"),
        confidence_head=bool(dflash.get("enable_confidence_head", False)),
        confidence_with_markov=bool(dflash.get("confidence_head_with_markov", True)),
    )


@dataclass(frozen=True)
class DFlash2Spec:
    """A DFlash2 drafter (mlx-vlm 0.7.10 ``drafters/dflash2``; ``architectures`` DFlash2DraftModel):
    a DFlash backbone whose layers wrap attention and MLP in grouped dynamic causal convolutions,
    scaled embeddings and logits, and a candidate selector (top-k of each position's logits
    rescored by a low-rank predecessor x hidden x successor term). ``backbone.block_size`` is
    ``dflash_config.block_size`` (anchor + drafts)."""

    backbone: DFlashSpec
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float
    output_multiplier: float


def dflash2_spec(config: Mapping[str, Any]) -> DFlash2Spec:
    """Read a DFlash2 ``config.json``; a missing or malformed field is a one-line error naming it."""
    dflash = config.get("dflash_config")
    if not isinstance(dflash, Mapping):
        raise MtplxError("DFlash2 config: dflash_config is missing")
    sizes = {}
    for key in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        value = dflash.get(key, config.get(key))
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MtplxError(f"DFlash2 config: dflash_config.{key} must be a positive integer, got {value!r}")
        sizes[key] = value
    if dflash.get("causal") or config.get("dflash_query_causal"):
        raise MtplxError("DFlash2 config: dflash_config.causal is not supported")
    flat = {**config, "block_size": sizes.pop("block_size"), "dflash_config": {**dflash, "causal": False}}
    if "final_logit_softcapping" in dflash:
        flat["final_logit_softcapping"] = dflash["final_logit_softcapping"]
    backbone = dflash_spec(flat)
    if backbone.hidden_size % sizes["conv_group_size"]:
        raise MtplxError("DFlash2 config: hidden_size must be a multiple of dflash_config.conv_group_size")
    if sizes["selector_top_k"] > backbone.vocab_size:
        raise MtplxError("DFlash2 config: dflash_config.selector_top_k exceeds the vocabulary")
    return DFlash2Spec(
        backbone=backbone,
        **sizes,
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        output_multiplier=float(dflash.get("output_multiplier", 1.0)),
    )
