"""Split MTP drafters (``mtplx.heads.split_drafter``) beside a stripped community trunk, end to end.

One tiny random-weight Qwen3.5 replica in the Hugging Face layout (its ``mtp.*`` tensors bfloat16,
as published) is turned into what users download: a 4-bit trunk made by ``mlx_lm.convert`` (which
drops the MTP tensors, as the community's conversions are made) and drafters made by mlx-vlm's own
splitter (``mlx_vlm.split_mtp``, the real tool, offline on the local directory): one as the file
came (``-MTP-bf16``) and one 8-bit (``-MTP-8bit``). The replica's head predicts the trunk by
construction (``support.checkpoints.qwen3_5``'s ``context_strength``), so drafts are kept and a
head wired wrongly (norms shifted once more) loses acceptance: the negative control.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.heads import load_head
from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.heads.split_drafter import drafter_rank, find_split_drafter, target_stems
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_steps, take_tokens
from support.exactness import (
    FALSE_FAILURE_RATE,
    exact_ar_joint,
    loop_p_value,
    plant_commit_rejected_draft,
    sample_counts,
)
from support.hub import cache_layout
from support.models import HIDDEN, VOCAB
from support.tokenizer import word_level

GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = ([3, 17, 42, 5, 60, 9, 11, 2, 33, 8], [1, 2, 3, 4, 5], [50, 40, 30, 20, 10, 5])
CONTEXT_STRENGTH = 0.4  # measured: 29/89 depth-1 drafts kept on the 4-bit trunk, 6/111 with norms shifted
GROUP = 32  # the tiny hidden size: mlx's default group of 64 would leave every matrix float
NAME = "Qwen3.5-Tiny"


def _as_published(src: Path) -> None:
    """The replica's ``mtp.*`` tensors as bfloat16, as Qwen publishes them (trunk float32), and the
    final norm (the trunk's, tied to the head's by the factory) with scales spread over [0.01, 1]
    (mean below 0.5, the case the per-tensor norm guess gets wrong): a norm read with the wrong
    convention then loses the head most of its agreement with the trunk."""
    tensors = mx.load(str(src / "model.safetensors"))
    rng = np.random.default_rng(5)
    scales = mx.array(np.exp(rng.uniform(np.log(0.01), 0.0, HIDDEN)).astype(np.float32))
    for name in ("model.language_model.norm.weight", "mtp.norm.weight"):
        tensors[name] = scales - 1.0  # HF Qwen3.5 stores RMSNorm weights as offsets from 1
    tensors = {k: (v.astype(mx.bfloat16) if k.startswith("mtp.") else v) for k, v in tensors.items()}
    mx.save_safetensors(str(src / "model.safetensors"), tensors, {"format": "pt"})


@pytest.fixture(scope="module")
def replica(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import convert
    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("split")
    src = root / NAME
    checkpoints.qwen3_5(src, context_strength=CONTEXT_STRENGTH)
    _as_published(src)
    word_level(src)
    trunk = root / f"{NAME}-4bit"
    convert(str(src), str(trunk), quantize=True, q_group_size=GROUP, q_bits=4)
    bf16 = split_mtp(str(src), str(root / f"{NAME}-MTP-bf16"))
    int8 = split_mtp(str(src), str(root / f"{NAME}-MTP-8bit"), q_bits=8, q_group_size=GROUP)
    return {"src": src, "trunk": trunk, "bf16": Path(bf16), "8bit": Path(int8)}


def acceptance(engine: Engine, head, depth: int = 1, n: int = 40) -> tuple[int, int]:
    """(drafts kept, drafts made) of greedy MTP decoding over PROMPTS."""
    kept = made = 0
    for prompt in PROMPTS:
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        _, steps = take_steps(mtp_decode(engine.trunk, head, prompt, settings, mx.random.key(0)), n)
        kept += sum(s.num_accepted for s in steps if s.num_drafted)
        made += sum(s.num_drafted for s in steps)
    return kept, made


def is_norm(name: str) -> bool:
    """An RMSNorm weight of the head (``*norm*.weight``; no other 1-D weights in it)."""
    return name.endswith(".weight") and "norm" in name.split(".")[-2]


def copy_drafter(src: Path, dst: Path, **text_config) -> Path:
    """A copy of a drafter directory with ``text_config`` fields replaced."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(text_config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# ------------------------------------------------------------------ what the real tools wrote


def test_the_tools_wrote_a_stripped_trunk_and_prefixless_drafters(replica):
    from mtplx.heads.weights import weight_index

    trunk_config = json.loads((replica["trunk"] / "config.json").read_text())
    assert trunk_config["text_config"]["mtp_num_hidden_layers"] == 1  # declared ...
    assert not [k for k in weight_index(replica["trunk"]) if "mtp" in k]  # ... but stripped
    for kind in ("bf16", "8bit"):
        config = json.loads((replica[kind] / "config.json").read_text())
        assert config["model_type"] == "qwen3_5_mtp" and config["block_size"] == 3
        names = set(weight_index(replica[kind]))
        assert "fc.weight" in names and not [k for k in names if k.startswith("mtp.")]
        assert ("fc.scales" in names) == (kind == "8bit")


# ------------------------------------------------------------------ found, loaded, drafting


def test_the_engine_finds_the_drafter_beside_the_stripped_trunk(replica, capsys):
    engine = Engine.load(str(replica["trunk"]))
    assert isinstance(engine.head, Qwen3NextMTPHead)
    assert engine.head.hidden_source == "post_norm"
    assert engine.head.default_depth == 2 and engine.depth == 2  # block_size 3 - the pending token
    err = capsys.readouterr().err
    assert f"{NAME}-MTP-bf16" in err and "decoding without MTP" not in err


def _chain_logits(head, trunk) -> mx.array:
    prompt = PROMPTS[0]
    hidden = trunk(mx.array([prompt[:6]])).hidden_post_norm
    cache = head.make_cache()
    h = head(hidden, mx.array([prompt[1:7]]), cache, step=0)
    rows = [h[0, -1]]
    for s, token in enumerate([7, 33], start=1):
        h = head(head.chain_input(h), mx.array([[token]]), cache, step=s)
        rows.append(h[0, -1])
    return trunk.lm_head(mx.stack(rows)[None])[0].astype(mx.float32)


def test_the_split_head_is_the_checkpoints_own_head(replica):
    """mlx-vlm's transformation of the head (prefix dropped, norms shifted by 1) read by the split
    loader equals mtplx's own reading of the raw checkpoint's ``mtp.*`` (offsets from 1)."""
    engine = Engine.load(str(replica["trunk"]), head=str(replica["bf16"]))
    source = load_head(replica["src"], engine.trunk, json.loads((replica["src"] / "config.json").read_text()))
    assert mx.array_equal(
        _chain_logits(engine.head, engine.trunk), _chain_logits(source, engine.trunk)
    ).item()


@pytest.mark.parametrize("kind", ["bf16", "8bit"])
def test_greedy_mtp_equals_ar_with_drafts_kept(replica, kind):
    engine = Engine.load(str(replica["trunk"]), head=str(replica[kind]))
    bits = {m.bits for _, m in engine.head.named_modules() if hasattr(m, "scales")}
    assert bits == ({8} if kind == "8bit" else set())
    prompt = PROMPTS[0]
    ar = take_tokens(
        decode.ar_decode(engine.trunk, prompt, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 16
    )
    for depth in (1, 2):
        settings = decode.DecodeSettings(sampler=GREEDY, depth=depth)
        tokens, steps = take_steps(
            mtp_decode(engine.trunk, engine.head, prompt, settings, mx.random.key(0)), 16
        )
        assert tokens == ar, depth
        assert sum(s.num_accepted for s in steps if s.num_drafted) > 0, depth  # drafts were kept


# The replica's distributions are nearly flat over 64 tokens; top-k 2 leaves each position two
# cells that carry the mass (joint: 8 cells), so the per-position marginals have power
# (support.exactness). Measured at 300 samples: the honest loop p = 0.32 to 1.0 over 5 seeds; the
# control below makes 267-275 of 300 sequences AR gives probability 0 (refused outright), and on
# the remaining ones alone p = 1e-22 for one of two seeds. At CONTROL_SAMPLES (50) the control is
# refused outright at seeds 1234, 1e5, 2e5 and 3e5 (2026-12-07); `make test-slow` repeats the
# sampled test at 300.
CHI_SAMPLER = SamplerConfig(temperature=1.0, top_k=2)
CHI_SAMPLES = 150
CONTROL_SAMPLES = 50


def assert_sampled_matches_ar(engine: Engine, seed0: int, samples: int = CHI_SAMPLES) -> None:
    """Sampled MTP with the split drafter (its default depth, 2) against the exact AR joint of
    the first three tokens (float64 enumeration): chi-square, Bonferroni over joint and positions."""
    expected = exact_ar_joint(engine.trunk, CHI_SAMPLER, VOCAB)
    counts = sample_counts(engine.trunk, engine.head, CHI_SAMPLER, engine.depth, samples, VOCAB, seed0)
    p = loop_p_value(counts, expected)
    assert p > FALSE_FAILURE_RATE, f"p={p:.3g} (seed0={seed0})"


@pytest.mark.parametrize("samples", [CHI_SAMPLES, pytest.param(300, marks=pytest.mark.slow)])
def test_sampled_mtp_with_the_split_drafter_matches_ar(replica, samples):
    engine = Engine.load(str(replica["trunk"]))
    assert engine.depth == 2
    assert_sampled_matches_ar(engine, int.from_bytes(os.urandom(4), "little"), samples)


def test_the_chi_square_catches_a_loop_that_commits_the_rejected_draft(replica, monkeypatch):
    """Negative control: the rejected draft committed in place of the correction token."""
    plant_commit_rejected_draft(monkeypatch)
    with pytest.raises(AssertionError):
        assert_sampled_matches_ar(Engine.load(str(replica["trunk"])), 1234, samples=CONTROL_SAMPLES)


def test_a_wrong_norm_offset_lowers_acceptance(replica):
    """Negative control: the same drafter with every norm weight shifted by 1 once more (what
    treating the splitter's plain scales as offsets does) keeps far fewer drafts."""
    engine = Engine.load(str(replica["trunk"]))
    kept, made = acceptance(engine, engine.head)
    shifted = [(k, v + 1.0) for k, v in tree_flatten(engine.head.parameters()) if is_norm(k)]
    assert len(shifted) == 7  # pre_fc_norm x2, input/post-attention, q/k norms, final norm
    engine.head.update(tree_unflatten(shifted))
    kept_wrong, made_wrong = acceptance(engine, engine.head)
    assert kept / made > 0.2, (kept, made)
    assert kept / made > 3 * kept_wrong / made_wrong, (kept, made, kept_wrong, made_wrong)


def test_norms_are_read_as_stored_even_with_a_mean_below_one_half(replica, tmp_path):
    """The per-tensor guess would call a q_norm of mean 0.3 an offset and add 1; a split
    drafter's norms are plain scales by provenance, so every one loads as the file has it."""
    drafter = copy_drafter(replica["bf16"], tmp_path / f"{NAME}-MTP-bf16")
    weights = mx.load(str(drafter / "model.safetensors"))
    for k in ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"):
        weights[k] = mx.full(weights[k].shape, 0.3, dtype=weights[k].dtype)
    mx.save_safetensors(str(drafter / "model.safetensors"), weights, {"format": "mlx"})
    engine = Engine.load(str(replica["trunk"]), head=str(drafter))
    loaded = dict(tree_flatten(engine.head.parameters()))
    for k, v in weights.items():
        if is_norm(k):
            assert mx.array_equal(loaded[k], v).item(), k


# ------------------------------------------------------------------ misfits and absences


@pytest.mark.parametrize("field, value", [("hidden_size", 64), ("vocab_size", 128)])
def test_a_misfit_drafter_is_a_one_line_error_naming_the_field(replica, tmp_path, field, value):
    drafter = copy_drafter(replica["bf16"], tmp_path / "other-MTP-bf16", **{field: value})
    with pytest.raises(MtplxError) as given:
        Engine.load(str(replica["trunk"]), head=str(drafter))
    # Found beside the target by its name, the misfit is refused the same way (not skipped).
    target = tmp_path / "beside" / f"{NAME}-4bit"
    shutil.copytree(replica["trunk"], target)
    copy_drafter(replica["bf16"], target.parent / f"{NAME}-MTP-bf16", **{field: value})
    with pytest.raises(MtplxError) as found:
        Engine.load(str(target))
    for error in (given.value, found.value):
        message = str(error)
        assert "\n" not in message and f"{field} {value}" in message, message


def test_without_a_drafter_the_note_says_what_was_looked_for(replica, tmp_path, capsys):
    target = tmp_path / f"{NAME}-4bit"
    shutil.copytree(replica["trunk"], target)
    engine = Engine.load(str(target))
    assert engine.head is None
    err = capsys.readouterr().err
    assert f"{NAME}-MTP-* or {NAME}-4bit-mtp" in err and "decoding without MTP" in err
    with pytest.raises(MtplxError, match=f"{NAME}-MTP-"):
        Engine.load(str(target), mtp=True)


def test_a_repo_ids_drafter_is_found_in_the_hub_cache(replica, tmp_path):
    cache = tmp_path / "hub"
    snapshot = cache_layout(replica["trunk"], cache, f"mlx-community/{NAME}-4bit")
    config = json.loads((snapshot / "config.json").read_text())
    spec = f"mlx-community/{NAME}-4bit"
    assert find_split_drafter(snapshot, spec, config, hub_cache=cache) is None
    cache_layout(replica["8bit"], cache, f"someone/{NAME}-MTP-8bit")
    found = find_split_drafter(snapshot, spec, config, hub_cache=cache)
    assert found is not None and found.name == f"{NAME}-MTP-8bit"
    cache_layout(replica["bf16"], cache, f"mlx-community/{NAME}-4bit-mtp")  # mlx-vlm's own name wins
    assert find_split_drafter(snapshot, spec, config, hub_cache=cache).name == f"{NAME}-4bit-mtp"


def test_drafter_names():
    assert target_stems("Qwen3.5-9B-4bit") == ["Qwen3.5-9B", "Qwen3.5-9B-4bit"]
    assert target_stems("Qwen3.5-9B-MLX-4bit") == ["Qwen3.5-9B-MLX", "Qwen3.5-9B", "Qwen3.5-9B-MLX-4bit"]
    assert target_stems("Qwen3.6-27B-8bit-DWQ") == ["Qwen3.6-27B", "Qwen3.6-27B-8bit-DWQ"]
    assert target_stems("my-model") == ["my-model"]
    target = "Qwen3.5-9B-MLX-4bit"
    ranked = [
        "Qwen3.5-9B-MLX-4bit-mtp",
        "Qwen3.5-9B-MTP-bf16",
        "Qwen3.5-9B-MLX-MTP-8bit",
        "Qwen3.5-9B-MLX-4bit-MTP-6bit",
        "Qwen3.5-9B-MTP-4bit",
    ]
    assert sorted(ranked[::-1], key=lambda n: drafter_rank(n, target)[0]) == ranked
    for other in ("Qwen3.5-9B-MTPLX-Optimized", "Qwen3.5-9B-Base-MTP-bf16", "Qwen3.5-27B-MTP-bf16", target):
        assert drafter_rank(other, target) is None, other


# ------------------------------------------------------------------ inspect


def test_inspect_names_the_drafter_a_target_uses_and_what_a_drafter_is(replica, tmp_path):
    info = inspect_model(str(replica["trunk"]))
    assert info["verdict"] == "MTP-ready" and info["split_drafter"]["path"] == str(replica["bf16"])
    text = format_inspection(info)
    assert f"{NAME}-MTP-bf16" in text and "precision suffix replaced" in text and "plain scales" in text
    drafter = inspect_model(str(replica["8bit"]))
    assert drafter["verdict"] == "drafter" and drafter["head"]["default_depth"] == 2
    assert "qwen3_5_mtp" in drafter["reason"] and "hidden_size 32" in drafter["reason"]
    misfit = copy_drafter(replica["bf16"], tmp_path / "other-MTP-bf16", hidden_size=64)
    given = inspect_model(str(replica["trunk"]), head=str(misfit))
    assert given["verdict"] == "AR-only" and "hidden_size 64" in given["reason"]
