"""GLM split MTP drafters as heads: ``glm_moe_dsa_mtp`` (GLM-5) and ``glm4_moe_lite_mtp``
(GLM-4.7-Flash), both written by mlx-vlm's own splitter (``mlx_vlm.split_mtp``, offline) from a
tiny replica in the Hugging Face layout (``support.checkpoints.deepseek_v3``: MLA with the fused
``kv_b_proj``, per-expert MoE, the MTP layer at ``model.layers.{n}``; GLM-5 with the DSA indexer),
beside a 4-bit trunk made by ``mlx_lm.convert`` (which drops the MTP layer, as the community's
conversions do). The head is mtplx's DeepSeek-layout head under the drafter's names
(``mtplx.heads.deepseek.SplitNames``); its output equals mtplx's reading of the raw checkpoint's
MTP layer, and greedy MTP == AR with drafts kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.inspect import inspect_model
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.heads import load_head
from mtplx.heads.deepseek import SplitDeepSeekHead
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from support import checkpoints
from support.decoding import assert_mtp_equals_ar_with_drafts_kept
from support.tokenizer import word_level

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = ([3, 17, 42, 5, 60, 9, 11, 2, 33, 8], [50, 40, 30, 20, 10, 5])
# Measured: depth 1 keeps 17/29 (GLM-5) and 20/27 (GLM-4.7-Flash) drafts; at 1.0, 2/43.
CONTEXT_STRENGTH = 0.2
GROUP = 32  # the tiny hidden size: mlx's default group of 64 would leave the matrices float
FAMILIES = {"glm_moe_dsa": "GLM-5-Tiny", "glm4_moe_lite": "GLM-4.7-Flash-Tiny"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def replica(request, tmp_path_factory) -> dict:
    from mlx_lm import convert
    from mlx_vlm.split_mtp import split_mtp

    model_type, name = request.param, FAMILIES[request.param]
    root = tmp_path_factory.mktemp(model_type)
    src = root / name
    checkpoints.deepseek_v3(
        src, model_type=model_type, trunk_layers=2, moe=True, context_strength=CONTEXT_STRENGTH
    )
    word_level(src)
    trunk = root / f"{name}-4bit"
    convert(str(src), str(trunk), quantize=True, q_group_size=GROUP, q_bits=4)
    bf16 = Path(split_mtp(str(src), str(root / f"{name}-MTP-bf16")))
    int8 = Path(split_mtp(str(src), str(root / f"{name}-MTP-8bit"), q_bits=8, q_group_size=GROUP))
    return {"type": model_type, "src": src, "trunk": trunk, "bf16": bf16, "8bit": int8}


def test_the_splitter_wrote_the_drafter_layout_and_the_trunk_is_stripped(replica):
    from mtplx.heads.weights import weight_index

    config = json.loads((replica["bf16"] / "config.json").read_text())
    assert config["model_type"] == f"{replica['type']}_mtp" and config["block_size"] == 2
    names = set(weight_index(replica["bf16"]))
    eh_proj = "mtp.eh_proj.weight" if replica["type"] == "glm_moe_dsa" else "model.eh_proj.weight"
    assert eh_proj in names and not [k for k in names if "kv_b_proj" in k or ".experts." in k]
    assert not [k for k in weight_index(replica["trunk"]) if k.startswith("model.layers.2.")]


def test_the_engine_finds_the_drafter_and_it_is_the_checkpoints_own_layer(replica, capsys):
    engine = Engine.load(str(replica["trunk"]))
    head = engine.head
    assert isinstance(head, SplitDeepSeekHead) and head.hidden_source == "post_norm"
    assert engine.depth == 1 and "MTP-bf16" in capsys.readouterr().err  # block_size 2 - the pending token
    own = load_head(replica["src"], engine.trunk, json.loads((replica["src"] / "config.json").read_text()))
    # mlx-vlm's GLM-4.7-Flash splitter stores the layer bfloat16 (the router bias float32): read
    # the raw checkpoint's layer at the dtypes the drafter holds, then the two must agree exactly.
    dtypes = {k: v.dtype for k, v in tree_flatten(head.parameters())}
    own.update(
        tree_unflatten([(k, v.astype(dtypes.get(k, v.dtype))) for k, v in tree_flatten(own.parameters())])
    )
    prompt = PROMPTS[0]
    hidden = engine.trunk(mx.array([prompt])).hidden_post_norm
    nxt = mx.array([prompt[1:] + [7]])
    split_out = head(hidden, nxt, head.make_cache())
    own_out = own(hidden, nxt, own.make_cache())
    assert mx.array_equal(split_out, own_out).item()
    assert not head.has_own_lm_head(0)  # the target's LM head serves, not a copy


@pytest.mark.parametrize("kind", ["bf16", "8bit"])
def test_greedy_mtp_equals_ar_with_drafts_kept(replica, kind):
    engine = Engine.load(str(replica["trunk"]), head=str(replica[kind]))
    bits = {m.bits for _, m in engine.head.named_modules() if hasattr(m, "scales")}
    assert bits == ({8} if kind == "8bit" else set())
    assert_mtp_equals_ar_with_drafts_kept(engine.trunk, engine.head, PROMPTS, 14, label=kind)


def test_a_drafter_with_other_mla_shapes_is_a_one_line_error(replica, tmp_path):
    drafter = tmp_path / "other-MTP-bf16"
    shutil.copytree(replica["bf16"], drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["text_config"]["kv_lora_rank"] = 32
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtplxError) as e:
        Engine.load(str(replica["trunk"]), head=str(drafter))
    message = str(e.value)
    assert "\n" not in message and "kv_lora_rank 32" in message


def test_a_glm_drafter_does_not_fit_the_other_glm(replica, tmp_path):
    """The two GLM drafters share the DeepSeek layout but not their targets: each is refused by
    model type beside the other family's trunk, in one line."""
    other = "glm4_moe_lite" if replica["type"] == "glm_moe_dsa" else "glm_moe_dsa"
    drafter = tmp_path / "swapped-MTP-bf16"
    shutil.copytree(replica["bf16"], drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["model_type"] = f"{other}_mtp"
    (drafter / "config.json").write_text(json.dumps(config))
    with pytest.raises(MtplxError) as e:
        Engine.load(str(replica["trunk"]), head=str(drafter))
    assert "\n" not in str(e.value) and f"serves {other} targets" in str(e.value)


def test_inspect_says_what_the_drafter_is(replica):
    info = inspect_model(str(replica["8bit"]))
    assert info["verdict"] == "drafter" and f"{replica['type']}_mtp" in info["reason"]
    assert info["head"]["default_depth"] == 1
    target = inspect_model(str(replica["trunk"]))
    assert target["verdict"] == "MTP-ready" and target["split_drafter"]["path"] == str(replica["bf16"])


def test_the_comparison_catches_swapped_input_norms(replica, monkeypatch):
    """Negative control: the drafter's ``enorm`` and ``hnorm`` read the wrong way round (a name
    table slip) no longer equal the checkpoint's own layer."""
    from mtplx.heads import deepseek

    for attr in ("GLM_MOE_DSA_SPLIT", "GLM4_MOE_LITE_SPLIT"):
        names = getattr(deepseek, attr)
        swap = {"enorm.": "hnorm.", "hnorm.": "enorm."}
        own = tuple((swap.get(mine, mine), theirs) for mine, theirs in names.own)
        monkeypatch.setattr(
            deepseek, attr, deepseek.SplitNames(names.prefixes, own, names.block_prefix, names.dropped)
        )
    engine = Engine.load(str(replica["trunk"]), head=str(replica["bf16"]))
    own = load_head(replica["src"], engine.trunk, json.loads((replica["src"] / "config.json").read_text()))
    hidden = engine.trunk(mx.array([PROMPTS[0]])).hidden_post_norm
    nxt = mx.array([PROMPTS[0][1:] + [7]])
    split_out = engine.head(hidden, nxt, engine.head.make_cache())
    assert not mx.allclose(split_out, own(hidden, nxt, own.make_cache()), atol=1e-2).item()
