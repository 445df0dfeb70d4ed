"""The head families a checkpoint can ship its MTP layers in: one row each, and the lookups.

As mlx-lm's ``models/`` + ``_get_classes`` and vLLM's model registry: a family is a file
(its math and its key renaming) plus one ``HeadFamily`` row here; nothing else names it.
``detect_layout`` prefers the tensors a checkpoint holds over what its ``model_type`` implies,
so a re-export in another family's spelling still loads, and a config whose head tensors were
stripped is still recognised (``MissingHeadError``, not "unsupported").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx.heads import (
    deepseek,
    deepseek_v4,
    ernie,
    glm5_next,
    hy_v4,
    inkling,
    longcat,
    mimo,
    mimo_v2_flash,
    nemotron_h,
    qwen3_next,
    qwen4_exp,
    step3p5,
)
from mtplx.heads.base import HiddenSource, MTPHead
from mtplx.heads.weights import HeadSource, MissingHeadError, load_head_weights, weight_index

BuildHead = Callable[[HeadSource, int, HiddenSource], MTPHead]


@dataclass(frozen=True)
class HeadFamily:
    """One checkpoint layout of in-checkpoint MTP heads.

    ``marker``: a regex some tensor name of the layout fully matches (and no other layout's);
    ``count_keys``: the config keys that declare the layer count, first found wins (text_config
    before the top level: Qwen3.5 nests it there); ``layer_names``: a regex whose one group is
    an MTP layer's index in a tensor name, for configs that declare no count (Qwen3-Next as
    published); ``build``: an unloaded head of that layer count, checked against the checkpoint
    (``MissingHeadError`` when it ships none); ``offset_norm_types``: the model types whose raw
    checkpoints store the head's norms as offsets from 1 (``weights.norm_rule``).
    """

    name: str
    model_types: tuple[str, ...]
    marker: str
    count_keys: tuple[str, ...]
    layer_names: str
    default_hidden_source: HiddenSource
    build: BuildHead
    offset_norm_types: tuple[str, ...] = ()  # model types whose raw checkpoints store norms as offsets from 1

    def has_layout(self, index: dict[str, str]) -> bool:
        rx = re.compile(self.marker)
        return any(rx.fullmatch(k) for k in index)

    def declared_layers(self, config: dict) -> int:
        """MTP layer count the config declares (0 = none)."""
        for cfg in (config.get("text_config") or {}, config):
            for key in self.count_keys:
                if cfg.get(key):
                    return int(cfg[key])
        return 0

    def shipped_layers(self, index: dict[str, str]) -> int:
        """How many MTP layers the tensor names hold (distinct layer indices; 0 = none)."""
        rx = re.compile(self.layer_names)
        return len({m.group(1) for m in map(rx.fullmatch, index) if m})

    def layer_count(self, index: dict[str, str], config: dict) -> tuple[int, str]:
        """The head's layer count and where it came from: the config's declaration, else the
        tensor names ("config" / "tensor names"; (0, "config") when neither has any)."""
        declared = self.declared_layers(config)
        if declared or not self.has_layout(index):
            return declared, "config"
        return self.shipped_layers(index), "tensor names"


FAMILIES: dict[str, HeadFamily] = {
    f.name: f
    for f in (
        HeadFamily(
            name=qwen3_next.LAYOUT,
            model_types=("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"),
            marker=r".*mtp\.fc\.weight",
            count_keys=("mtp_num_hidden_layers", "num_nextn_predict_layers"),
            layer_names=r".*mtp\.layers\.(\d+)\..+",
            default_hidden_source=qwen3_next.DEFAULT_HIDDEN_SOURCE,
            build=qwen3_next.build_head,
            offset_norm_types=qwen3_next.OFFSET_NORM_MODEL_TYPES,
        ),
        HeadFamily(
            name=qwen4_exp.LAYOUT,
            model_types=("qwen4_exp", "qwen4_exp_text"),
            # fc_hidden (the streams' projection): Qwen3-Next's one fc is mtp.fc.
            marker=r"mtp\.fc_hidden\.weight",
            count_keys=("mtp_num_hidden_layers",),
            layer_names=r"mtp\.layers\.(\d+)\..+",
            default_hidden_source=qwen4_exp.DEFAULT_HIDDEN_SOURCE,
            build=qwen4_exp.build_head,
        ),
        HeadFamily(
            name=deepseek_v4.LAYOUT,
            model_types=("deepseek_v4",),
            # e_proj / h_proj (two projections, no eh_proj) under the top-level mtp.{i}.
            marker=r"mtp\.\d+\.e_proj\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"mtp\.(\d+)\.e_proj\.weight",
            default_hidden_source=deepseek_v4.DEFAULT_HIDDEN_SOURCE,
            build=deepseek_v4.build_head,
        ),
        HeadFamily(
            name=glm5_next.LAYOUT,
            model_types=("glm5_next", "glm5_next_text"),
            # DeepSeek's shared_head.norm under the multimodal trunk's model.language_model.layers
            marker=r"model\.language_model\.layers\.\d+\.shared_head\.norm\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.language_model\.layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=glm5_next.DEFAULT_HIDDEN_SOURCE,
            build=glm5_next.build_head,
        ),
        HeadFamily(
            name=inkling.LAYOUT,
            model_types=("inkling",),
            # hidden_norm under model.mtp.layers: MiMo-V2-Flash / LongCat-Flash put final_layernorm /
            # enorm there, MiMo's input_proj sits under model.mtp_layers.
            marker=r"model\.mtp\.layers\.\d+\.hidden_norm\.weight",
            count_keys=("num_nextn_predict_layers", "num_mtp_layers"),
            layer_names=r"model\.mtp\.layers\.(\d+)\.input_proj\.weight",
            default_hidden_source=inkling.DEFAULT_HIDDEN_SOURCE,
            build=inkling.build_head,
        ),
        HeadFamily(
            name=deepseek.LAYOUT,
            model_types=("deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe", "glm_moe_dsa"),
            # shared_head.norm right after the layer index: Step-3.5 nests it under transformer.
            marker=r"model\.layers\.\d+\.shared_head\.norm\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=deepseek.DEFAULT_HIDDEN_SOURCE,
            build=deepseek.build_head,
        ),
        HeadFamily(
            name=mimo.LAYOUT,
            model_types=("mimo",),
            # input_proj, not the list name: a Hunyuan-V4 checkpoint names its MTP list the same way
            # with DeepSeek-style modules inside (mlx-vlm 0.7.10 hy_v4_mtp/split.py).
            marker=r"model\.mtp_layers\.\d+\.input_proj\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.mtp_layers\.(\d+)\..+",
            default_hidden_source=mimo.DEFAULT_HIDDEN_SOURCE,
            build=mimo.build_head,
        ),
        HeadFamily(
            name=hy_v4.LAYOUT,
            model_types=("hy_v4",),
            # eh_proj under model.mtp_layers: MiMo's list has input_proj there, Nemotron-H's
            # eh_proj sits under (language_model.)mtp.layers.
            marker=r"model\.mtp_layers\.\d+\.eh_proj\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.mtp_layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=hy_v4.DEFAULT_HIDDEN_SOURCE,
            build=hy_v4.build_head,
        ),
        HeadFamily(
            name=mimo_v2_flash.LAYOUT,
            model_types=("mimo_v2_flash",),
            # its own final_layernorm per layer: LongCat-Flash has one shared model.mtp.norm
            marker=r"model\.mtp\.layers\.\d+\.final_layernorm\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.mtp\.layers\.(\d+)\..+",
            default_hidden_source=mimo_v2_flash.DEFAULT_HIDDEN_SOURCE,
            build=mimo_v2_flash.build_head,
        ),
        HeadFamily(
            name=step3p5.LAYOUT,
            model_types=("step3p5",),
            marker=r"model\.layers\.\d+\.transformer\.shared_head\.norm\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=step3p5.DEFAULT_HIDDEN_SOURCE,
            build=step3p5.build_head,
            offset_norm_types=step3p5.OFFSET_NORM_MODEL_TYPES,
        ),
        HeadFamily(
            name=longcat.LAYOUT,
            model_types=("longcat_flash",),
            marker=r"model\.mtp\.layers\.\d+\.enorm\.m\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.mtp\.layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=longcat.DEFAULT_HIDDEN_SOURCE,
            build=longcat.build_head,
        ),
        HeadFamily(
            name=ernie.LAYOUT,
            model_types=("ernie4_5_moe", "ernie4_5"),
            marker=r"model\.mtp_linear_proj\.\d+\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"model\.mtp_linear_proj\.(\d+)\.weight",
            default_hidden_source=ernie.DEFAULT_HIDDEN_SOURCE,
            build=ernie.build_head,
        ),
        HeadFamily(
            name=nemotron_h.LAYOUT,
            model_types=("nemotron_h",),
            # mtp.layers.0.eh_proj at the top (or under a multimodal checkpoint's language_model.):
            # MiMo-V2-Flash and LongCat-Flash put theirs under model.mtp.layers.
            marker=r"(language_model\.)?mtp\.layers\.\d+\.eh_proj\.weight",
            count_keys=("num_nextn_predict_layers",),
            layer_names=r"(?:language_model\.)?mtp\.layers\.(\d+)\.eh_proj\.weight",
            default_hidden_source=nemotron_h.DEFAULT_HIDDEN_SOURCE,
            build=nemotron_h.build_head,
        ),
    )
}
# The trunk hidden state each layout reads unless told otherwise (each family file says why).
DEFAULT_HIDDEN_SOURCE = {name: f.default_hidden_source for name, f in FAMILIES.items()}


def _model_types(config: dict) -> list[str]:
    return [str(c.get("model_type", "")) for c in (config, config.get("text_config") or {})]


def detect_layout(index: dict[str, str], config: dict) -> str | None:
    """The layout whose tensors the checkpoint holds; else the one its model_type implies; else None."""
    for name, family in FAMILIES.items():
        if family.has_layout(index):
            return name
    for mt in _model_types(config):
        for name, family in FAMILIES.items():
            if mt in family.model_types:
                return name
    return None


def declared_mtp_layers(config: dict, layout: str | None = None) -> int:
    """How many MTP layers the config declares (0 = none); under ``layout``'s keys when given."""
    families = [FAMILIES[layout]] if layout else list(FAMILIES.values())
    return max(f.declared_layers(config) for f in families)


def load_head(model_dir: Path, trunk: Any, config: dict, hidden_source: str | None = None) -> MTPHead | None:
    """The MTP head a checkpoint ships, built beside the mlx-lm ``trunk`` (a ``mtplx.trunk.model.Trunk``).

    None when the config declares no MTP layers; `MissingHeadError` (one line, naming the file)
    when it declares some but ships no tensors or ships them in an unknown layout (the caller may
    decode AR); MtplxError when the tensors are mis-shaped.
    ``hidden_source`` overrides the layout's default trunk hidden ("pre_norm" / "post_norm").
    """
    model_dir = Path(model_dir)
    index = weight_index(model_dir)
    layout = detect_layout(index, config)
    if layout is None:
        if declared_mtp_layers(config):
            kind = ", ".join(t for t in _model_types(config) if t) or "unknown"
            raise MissingHeadError(
                f"{model_dir / 'config.json'}: declares {declared_mtp_layers(config)} MTP layer(s) in a layout "
                f"mtplx does not know (model_type {kind})"
            )
        return None
    family = FAMILIES[layout]
    num_layers, _ = family.layer_count(index, config)
    if num_layers == 0:
        return None
    src = HeadSource(model_dir, config, index, trunk)
    head = family.build(src, num_layers, hidden_source or family.default_hidden_source)
    load_head_weights(head, src)
    return head
