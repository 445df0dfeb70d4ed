"""Head-layout detection (``mtplx.heads.registry``): every family's tensor names are detected as
that family and match no other family's marker.

The names come from the tiny HF-layout replicas ``support.checkpoints`` writes (the published
names, written independently of the registry), with no config given, so the tensor markers alone
decide. Hunyuan-V4 (``model.mtp_layers.0.{enorm,hnorm,eh_proj,...,final_layernorm}``, as mlx-vlm
0.7.10's ``hy_v4_mtp/split.py`` selects and renames them: MiMo's list name with DeepSeek's module
names) is its own family, never MiMo's; a split MTP drafter (the Qwen3.5 head without ``mtp.``:
found by its ``model_type``, never as an in-checkpoint head) matches none.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.heads.registry import FAMILIES, detect_layout
from mtplx.heads.weights import weight_index

import pytest
from support import checkpoints
from support.nemotron import nemotron_h_checkpoint
from support.vlm_families import deepseek_v4, glm5_next, hy_v4, qwen4_exp
from support.vlm_inkling import inkling

# family row -> (replica builder, MTP layers it ships)
REPLICAS = {
    "qwen3_5": ("qwen3_next", lambda p: checkpoints.qwen3_5(p, mtp_layers=2), 2),
    "deepseek_v3": ("deepseek", lambda p: checkpoints.deepseek_v3(p, trunk_layers=2, moe=True), 1),
    "glm_moe_dsa": (
        "deepseek",
        lambda p: checkpoints.deepseek_v3(p, trunk_layers=2, moe=True, model_type="glm_moe_dsa"),
        1,
    ),
    "glm4_moe": ("deepseek", lambda p: checkpoints.glm4_moe(p), 1),
    "mimo": ("mimo", lambda p: checkpoints.mimo(p, mtp_layers=2), 2),
    "mimo_v2_flash": ("mimo_v2_flash", lambda p: checkpoints.mimo_v2_flash(p), 3),
    "step3p5": ("step3p5", lambda p: checkpoints.step3p5(p), 3),
    "longcat_flash": ("longcat", lambda p: checkpoints.longcat_flash(p), 1),
    "ernie4_5_moe": ("ernie", lambda p: checkpoints.ernie4_5_moe(p), 1),
    "nemotron_h": ("nemotron_h", lambda p: nemotron_h_checkpoint(p), 1),
    "hy_v4": ("hy_v4", lambda p: hy_v4(p), 1),
    # mtp.fc_hidden / mtp.fc_embedding beside mtp.layers.0: Qwen3-Next's one fc is mtp.fc.
    "qwen4_exp": ("qwen4_exp", lambda p: qwen4_exp(p), 1),
    # mtp.0.e_proj / h_proj at the top (official inference names): no eh_proj, no model. prefix.
    "deepseek_v4": ("deepseek_v4", lambda p: deepseek_v4(p), 1),
    # DeepSeek's layout under the multimodal trunk's model.language_model.layers.
    "glm5_next": ("glm5_next", lambda p: glm5_next(p), 1),
    # model.mtp.layers.0.{hidden_norm,embed_norm,input_proj,transformer_block.*}: MiMo-V2-Flash and
    # LongCat-Flash share the list name with other modules inside.
    "inkling": ("inkling", lambda p: inkling(p), 1),
}


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("detect")
    out = {}
    for name, (_, build, _) in REPLICAS.items():
        build(root / name)
        out[name] = weight_index(root / name)
    return out


def matching_families(index: dict[str, str]) -> list[str]:
    return [name for name, family in FAMILIES.items() if family.has_layout(index)]


def test_every_family_row_has_a_replica():
    assert {family for family, _, _ in REPLICAS.values()} == set(FAMILIES)


@pytest.mark.parametrize("replica", sorted(REPLICAS))
def test_each_layout_is_detected_as_itself_and_no_other(indexes, replica):
    family, _, layers = REPLICAS[replica]
    index = indexes[replica]
    assert detect_layout(index, {}) == family
    assert matching_families(index) == [family]  # no other family's marker matches
    assert FAMILIES[family].shipped_layers(index) == layers


def test_a_trunk_without_its_head_matches_no_marker(tmp_path):
    stripped = checkpoints.qwen3_5(tmp_path / "stripped", ship_mtp=False)
    assert matching_families(weight_index(stripped.path)) == []


def hunyuan_v4_names() -> dict[str, str]:
    """A Hunyuan-V4-style checkpoint's names (mlx-vlm 0.7.10 ``hy_v4_mtp/split.py``)."""
    layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    ]
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    names += [f"model.layers.{i}.{k}" for i in range(2) for k in layer]
    names += [f"model.mtp_layers.0.{k}" for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
    names += [f"model.mtp_layers.0.{k}" for k in [*layer, "final_layernorm.weight"]]
    return {n: "model.safetensors" for n in names}


def test_a_hunyuan_v4_checkpoint_is_not_taken_for_mimo():
    """Its MTP list is named as MiMo's (``model.mtp_layers``) with DeepSeek-style modules inside:
    the names alone (a dense layer, no config) are Hunyuan-V4's, never MiMo's math."""
    index = hunyuan_v4_names()
    assert matching_families(index) == ["hy_v4"]
    assert detect_layout(index, {"model_type": "mimo"}) == "hy_v4"


@pytest.mark.parametrize(
    "replica, marker", [("qwen3_5", "fc.weight"), ("nemotron_h", "layers.0.eh_proj.weight")]
)
def test_a_split_drafters_names_match_no_marker(indexes, replica, marker):
    drafter = {k[len("mtp.") :]: f for k, f in indexes[replica].items() if k.startswith("mtp.")}
    assert marker in drafter
    assert matching_families(drafter) == []


def test_replica_names_are_the_published_spellings(indexes):
    """A few names the markers rest on, written out (vLLM's ``*_mtp.py`` weight names)."""
    assert "mtp.fc.weight" in indexes["qwen3_5"]
    assert "model.layers.2.shared_head.norm.weight" in indexes["deepseek_v3"]
    assert "model.mtp_layers.1.input_proj.weight" in indexes["mimo"]
    assert any(k.startswith("model.mtp_linear_proj.0.") for k in indexes["ernie4_5_moe"])
    assert "mtp.layers.0.eh_proj.weight" in indexes["nemotron_h"]  # vLLM nemotron_h_mtp.py
    assert "mtp.layers.1.final_layernorm.weight" in indexes["nemotron_h"]
