"""The precision each part of an MTP head is kept at on conversion, and reading it back.

Glossary (``tensor_group``, by checkpoint tensor name, any family):

- ``projection``: the layer joining the token embedding and the trunk hidden state
  (``eh_proj`` DeepSeek / GLM / MiMo-V2-Flash, ``fc`` Qwen3-Next / forged, ``input_proj`` MiMo,
  ``mtp_linear_proj`` ERNIE-4.5);
- ``attention``: the head block's attention (``self_attn.*``, Nemotron-H's ``mixer.{q,k,v,o}_proj``,
  MLA projections, DSA indexer);
- ``dense``: the dense MLP, the shared experts and the MoE router gates;
- ``routed_experts``: the routed experts (``switch_mlp.*``, ``experts.{e}.*``);
- ``lm_head``: the head's own LM-head / embedding copy (DeepSeek ``shared_head.head``, Step-3.5
  ``shared_head.output``, where it differs from the trunk's);
- norms and biases are never quantized (mlx-lm quantizes only ``to_quantized`` layers).

Default (``default_bits``): every group at max(trunk bits, 8) but the routed experts, at the
trunk's bits. Why: on the default model's head (docs/DECISIONS.md, "Head precision") 8 bits
cost no measurable acceptance in any group while 4 bits cost 0.15 (projection) to 1.6 (the
output / embedding matrix) points each and 2.7 all together; users report int4 heads keeping
0-4% of drafts where int8 keeps 39-59%. The routed experts are most of a MoE head's bytes (see
the memory table there) and each token reads only a few of them, so they follow the trunk.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

GROUPS = ("projection", "attention", "dense", "routed_experts", "lm_head")
# Groups `inspect` warns about below 8 bits: every draft passes through them at full weight.
CRITICAL_GROUPS = ("projection", "attention")
MIN_CRITICAL_BITS = 8
FLOAT = "float"  # a group kept unquantized

_PROJECTION = re.compile(r"(^|\.)(eh_proj|fc|input_proj|mtp_linear_proj)(\.|$)")
_ROUTED = re.compile(r"(^|\.)(switch_mlp|experts\.\d+)(\.|$)|(^|\.)experts\.(gate_up_proj|down_proj)")
# Nemotron-H's attention block names its projections under ``mixer`` (its Mamba and MoE blocks too).
_ATTENTION = re.compile(r"(^|\.)(self_attn|attn|attention)(\.|$)|(^|\.)mixer\.[qkvo]_proj(\.|$)")
_LM_HEAD = re.compile(r"(^|\.)(shared_head\.head|shared_head\.output|lm_head|embed_tokens)(\.|$)")


def tensor_group(name: str) -> str:
    """The precision group of a head tensor or layer named ``name`` (a checkpoint name, or a
    path of the head module with mlx-side spellings); see the module glossary."""
    for group, rx in (
        ("routed_experts", _ROUTED),
        ("lm_head", _LM_HEAD),
        ("attention", _ATTENTION),
        ("projection", _PROJECTION),
    ):
        if rx.search(name):
            return group
    return "dense"


def default_bits(group: str, trunk_bits: int) -> int:
    """The bit width conversion gives a head layer of ``group`` beside a ``trunk_bits`` trunk."""
    if group == "routed_experts":
        return trunk_bits
    return max(trunk_bits, MIN_CRITICAL_BITS)


def summarize(bits_by_layer: Mapping[str, int | str]) -> dict[str, int | str]:
    """``{layer name: bits or "float"}`` -> ``{group: bits}`` (``"4/8"`` where a group mixes
    widths, lowest first); groups without a layer are left out."""
    found: dict[str, set] = {}
    for name, bits in bits_by_layer.items():
        found.setdefault(tensor_group(name), set()).add(bits)
    out: dict[str, int | str] = {}
    for group in GROUPS:
        if group in found:
            widths = sorted(found[group], key=lambda b: 99 if b == FLOAT else int(b))
            out[group] = widths[0] if len(widths) == 1 else "/".join(str(b) for b in widths)
    return out


def below_floor(summary: Mapping[str, int | str]) -> list[str]:
    """The critical groups (attention, projection) some layer of which is under 8 bits."""
    low = []
    for group in CRITICAL_GROUPS:
        widths = str(summary.get(group, FLOAT)).split("/")
        if any(w != FLOAT and int(w) < MIN_CRITICAL_BITS for w in widths):
            low.append(group)
    return low
