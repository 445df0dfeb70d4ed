"""Finding a block drafter like a split drafter (`mtplx.drafters.discovery`): beside the trunk by
name then by config, or given with ``--head`` / ``--draft-model``; ``mtplx inspect`` says which
one and why and whether it drafts; a misfit names its field in one line and the CLI exits
non-zero without a traceback; naming a DFlash / DFlash2 / DSpark one loads it to draft (drafting
itself: `test_block_entries.py`), an EAGLE-3 one beside the model drafts through `Engine.generate`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.drafters.discovery import name_says_drafter
from mtplx.drafters.layouts import drafter_layout
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import Source

import pytest
from support import checkpoints, drafters, models
from support.tokenizer import word_level

LAYERS = 2  # tiny_llama's


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``Tiny-Llama-4bit`` with ``Tiny-Llama-DFlash-b16`` (fits) beside it, and an orphan target
    ``Other-4bit`` with ``Other-DFlash`` whose ``num_target_layers`` does not fit."""
    root = tmp_path_factory.mktemp("family")
    paths = {}
    for name in ("Tiny-Llama-4bit", "Other-4bit"):
        paths[name] = checkpoints.save_model(
            root / name, models.tiny_llama(), architectures=["LlamaForCausalLM"]
        ).path
        word_level(paths[name])
    config = drafters.dflash_config(models.VOCAB, [0, 1], LAYERS)
    paths["drafter"] = drafters.write_dflash(
        root / "Tiny-Llama-DFlash-b16", config, drafters.dflash_tensors(config)
    )
    bad = drafters.dflash_config(models.VOCAB, [0, 1], 3)
    paths["misfit"] = drafters.write_dflash(root / "Other-DFlash", bad, drafters.dflash_tensors(bad))
    return paths


def test_layouts_are_told_apart_as_mlx_vlm_tells_them():
    dflash = {"model_type": "qwen3", "dflash_config": {"mask_token_id": 1, "target_layer_ids": [0]}}
    assert drafter_layout(dflash) == "dflash"
    assert drafter_layout({**dflash, "dflash_config": {"projector_type": "dspark"}}) == "dspark"
    assert drafter_layout({**dflash, "markov_rank": 2}) == "dspark"
    assert drafter_layout({"architectures": ["DFlash2DraftModel"], "dflash_config": {}}) == "dflash2"
    assert drafter_layout({"model_type": "deepseek_v4_dspark"}) == "dspark"
    assert drafter_layout({"speculators_model_type": "eagle3"}) == "eagle3"
    assert drafter_layout({"model_type": "qwen3"}) is None
    assert name_says_drafter("Qwen3-8B-DFlash-b16", "Qwen3-8B-4bit")
    assert name_says_drafter("gemma-4-E4B-it-eagle3", "gemma-4-E4B-it-bf16")
    assert not name_says_drafter("Qwen3-8B-MTP", "Qwen3-8B-4bit")
    assert not name_says_drafter("Qwen3-80B-DFlash", "Qwen3-8B")


def test_inspect_names_the_drafter_beside_the_model_and_why(family):
    info = inspect_model(str(family["Tiny-Llama-4bit"]))
    block = info["block_drafter"]
    assert block["layout"] == "dflash" and block["fits"] and block["path"] == str(family["drafter"])
    assert "named Tiny-Llama-DFlash-b16" in block["why"] and block["drafts"] is True
    text = format_inspection(info)
    assert f"block drafter dflash {family['drafter']}" in text and "fits; drafts)" in text
    misfit = inspect_model(str(family["Other-4bit"]))["block_drafter"]
    assert not misfit["fits"] and "num_target_layers 3 != the trunk's 2 layers" in misfit["problem"]
    given = inspect_model(str(family["Other-4bit"]), head=str(family["drafter"]))["block_drafter"]
    assert given["fits"] and given["why"] == "given with --head / --draft-model"


def test_a_model_without_one_has_none(tmp_path):
    path = checkpoints.save_model(
        tmp_path / "Alone", models.tiny_llama(), architectures=["LlamaForCausalLM"]
    ).path
    word_level(path)
    assert inspect_model(str(path))["block_drafter"] is None


@pytest.mark.parametrize("how", ["head", "draft_model"])
def test_naming_a_block_drafter_loads_it_and_a_misfit_is_a_one_line_error(family, how):
    engine = Engine.load(str(family["Other-4bit"]), **{how: str(family["drafter"])})
    assert engine.block_drafter.source is Source.DFLASH
    assert engine.head is None and engine.draft_model is None
    with pytest.raises(MtplxError, match="does not fit: dflash_config.num_target_layers 3") as err:
        Engine.load(str(family["Tiny-Llama-4bit"]), **{how: str(family["misfit"])})
    assert "\n" not in str(err.value)


def test_cli_inspect_and_generate(family):
    run = [sys.executable, "-m", "mtplx"]
    done = subprocess.run(
        [*run, "inspect", str(family["Tiny-Llama-4bit"]), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["block_drafter"]["layout"] == "dflash"
    model, head = str(family["Tiny-Llama-4bit"]), str(family["misfit"])
    args = ["generate", "--model", model, "--head", head, "--prompt", "w2 w3", "--max-tokens", "2"]
    done = subprocess.run([*run, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "num_target_layers 3 != the trunk's 2 layers" in done.stderr


def test_an_eagle3_drafter_beside_the_model_is_found_and_drafts(tmp_path):
    target = checkpoints.save_model(
        tmp_path / "Tiny-4bit", models.tiny_llama(), architectures=["LlamaForCausalLM"]
    ).path
    word_level(target)
    config = drafters.eagle3_config(models.VOCAB, 40, [1, 1, 2])
    drafters.write_eagle3(tmp_path / "Tiny-EAGLE3", config, drafters.eagle3_tensors(config))
    block = inspect_model(str(target))["block_drafter"]
    assert block["layout"] == "eagle3" and block["fits"] and block["drafts"], block
    engine = Engine.load(str(target))
    assert engine.block_drafter.source is Source.EAGLE3
    prompt = [1, 2, 3, 4, 5, 3, 4, 5]

    def greedy(draft: str) -> GenerationRequest:  # 10 tokens EOS does not end (a random model)
        return replace(
            GenerationRequest.from_kwargs(temperature=0.0, max_tokens=10, draft=draft), ignore_eos=True
        )

    ar = engine.generate(prompt, greedy("none"))
    got = engine.generate(prompt, greedy("eagle3"))
    assert got.token_ids == ar.token_ids
    assert got.stats.drafters["eagle3"]["drafted"] > 0, got.stats.drafters
    # n = 3 choices forked from one prefill (each from a copy of its drafter context): each = alone
    scheduler = engine.batch(max_rows=4, draft_policy="fixed")
    handle = scheduler.submit(prompt, replace(greedy("eagle3"), n=3))
    tokens = {}
    while not scheduler.idle:
        for result in scheduler.step():
            assert result.error is None and result.handle == handle, result.error
            tokens.setdefault(result.choice, []).extend(result.chunk.token_ids)
    assert [tokens[c] for c in range(3)] == [got.token_ids] * 3
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    drafters.write_eagle3(tmp_path / "Tiny-EAGLE3", config, drafters.eagle3_tensors(config))
    assert "name a layer past the trunk's 2" in inspect_model(str(target))["block_drafter"]["problem"]


def test_dspark_and_dflash2_drafters_are_found_and_the_own_dspark_layouts_named_not_loaded(tmp_path):
    target = checkpoints.save_model(
        tmp_path / "Tiny-bf16", models.tiny_llama(), architectures=["LlamaForCausalLM"]
    ).path
    word_level(target)
    config = drafters.dspark_config(models.VOCAB, [0, 1], LAYERS)
    drafters.write_dflash(tmp_path / "Tiny-DSpark", config, drafters.dspark_tensors(config))
    block = inspect_model(str(target))["block_drafter"]
    assert block["layout"] == "dspark" and block["fits"], block
    assert Engine.load(str(target), head=str(tmp_path / "Tiny-DSpark")).block_drafter.source is Source.DSPARK
    config = drafters.dflash2_config(models.VOCAB, [0, 1], LAYERS)
    drafters.write_dflash(tmp_path / "Tiny-DFlash2", config, drafters.dflash2_tensors(config))
    block = inspect_model(str(target), head=str(tmp_path / "Tiny-DFlash2"))["block_drafter"]
    assert block["layout"] == "dflash2" and block["fits"], block
    named = Engine.load(str(target), draft_model=str(tmp_path / "Tiny-DFlash2"))
    assert named.block_drafter.source is Source.DFLASH2
    config = {**drafters.dspark_config(models.VOCAB, [0, 1], LAYERS), "model_type": "deepseek_v4_dspark"}
    drafters.write_dflash(tmp_path / "Tiny-DSpark-V4", config, drafters.dspark_tensors(config))
    block = inspect_model(str(target), head=str(tmp_path / "Tiny-DSpark-V4"))["block_drafter"]
    assert block["problem"] == "the deepseek_v4_dspark DSpark layout is recognised but not loaded yet"


@pytest.mark.parametrize("layout", ["dflash", "eagle3"])
def test_inspect_of_a_drafter_directory_says_what_it_is(tmp_path, layout):
    if layout == "dflash":
        config = drafters.dflash_config(models.VOCAB, [0, 1], LAYERS)
        path = drafters.write_dflash(tmp_path / "d", config, drafters.dflash_tensors(config))
    else:
        config = drafters.eagle3_config(models.VOCAB, 40, None)
        path = drafters.write_eagle3(tmp_path / "e", config, drafters.eagle3_tensors(config))
    info = inspect_model(str(path))
    assert info["layout"] == layout and info["verdict"] == "block drafter" and info["problem"] is None
    expected = [0, 1] if layout == "dflash" else "low / middle / high of the target"
    assert info["target_layers"] == expected
    text = format_inspection(info)
    assert f"layout {layout}" in text and "drafts beside a target that fits it" in text
