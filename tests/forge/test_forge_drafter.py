"""`mtplx forge --drafter eagle3` (`mtplx.forge.drafter`): the recorded taps, the unrolled chain
against the proposer's step-by-step forward, training, and the written drafter through the normal
loader and the engine."""

from __future__ import annotations

import json
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.bench.runners import ban_bias
from mtplx.drafters.eagle3 import eagle3_forward, eagle3_logits
from mtplx.engine.engine import Engine
from mtplx.forge.config import ForgeConfig
from mtplx.forge.drafter import (
    RECORD,
    Eagle3TrainStep,
    aux_layer_ids,
    build_eagle3,
    draft_index,
    drafter_embedding,
    drafter_step_losses,
    eagle3_config,
    evaluate_drafter,
    forge_drafter,
    save_eagle3,
    unrolled_hidden,
)
from mtplx.forge.loss import UnrollCache, frequent_ids, make_batch
from mtplx.forge.record import ForgeData, generate_batch
from mtplx.forge.stages import write_sidecar
from mtplx.forge.train import train_head
from mtplx.sample.params import Setting
from mtplx.trunk.compat import KVCache
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import checkpoints, models
from support.tokenizer import chatml_chars

VOCAB, SEQ, HIDDEN, EOS, DRAFT_VOCAB = 48, 24, 32, 47, 24
TAPS = (0, 1, 1)  # `aux_layer_ids(2)` as decoder layers: [1, 1, 1] -> 0, 0, 0 would hide a swapped tap


def _tiny_trunk(seed: int = 0) -> Trunk:
    """test_forge's trunk: sharper-than-random, untied logits (learnable, not "repeat the last")."""
    model = models.tiny_llama(VOCAB, seed=seed, hidden_size=HIDDEN, tie_word_embeddings=False)
    model.model.embed_tokens.weight = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(seed)) * 0.6
    model.lm_head.weight = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(seed + 1)) * 0.5
    mx.eval(model.parameters())
    return Trunk(model)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 8))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def trunk() -> Trunk:
    return _tiny_trunk()


@pytest.fixture(scope="module")
def data(trunk: Trunk) -> ForgeData:
    """Three shards' worth of the trunk's writing (greedy and t 1), recorded with ``TAPS``, rows
    joining as others finish (``max_rows``)."""
    engine = Engine(trunk.model, None, {})
    parts = [
        generate_batch(
            engine,
            _prompts(8, i),
            Setting(0.0 if i % 2 else 1.0),
            mx.random.key(i),
            SEQ,
            8,
            {EOS},
            max_rows=5,
            taps=TAPS,
        )
        for i in range(3)
    ]
    assert trunk.tapped_layers == ()  # generation leaves the trunk untapped
    return ForgeData.concat(parts)


def _drafter(trunk: Trunk, data: ForgeData, seed: int | None = None):
    ids = frequent_ids(data, DRAFT_VOCAB, VOCAB)
    config = eagle3_config(trunk, len(ids), 3, {"name_or_path": "tiny", "architectures": []})
    config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in TAPS]
    drafter = build_eagle3(trunk, ids, config)
    if seed is not None:  # off the trunk-copy start, so every weight matters to the comparison
        params = tree_flatten(drafter.parameters())
        noise = [
            (k, v + 0.2 * mx.random.normal(v.shape, key=mx.random.key(seed + i)))
            for i, (k, v) in enumerate(params)
            if k != "d2t"
        ]
        drafter.load_weights(noise, strict=False)
        mx.eval(drafter.parameters())
    return drafter, ids, config


def test_recorded_taps_are_the_trunks_layer_outputs_at_each_position(trunk: Trunk, data: ForgeData) -> None:
    """Each row's recorded hidden is the tapped layers' outputs of a teacher-forced forward over its
    tokens, joined in ``TAPS``' order (prompt and response, rows that joined late included); one
    position off, or the taps in another order, is caught."""
    trunk.tap_layers(TAPS)
    try:
        for r in range(data.num_sequences):
            end = int(np.flatnonzero(data.valid[r]).max()) + 1  # positions whose state is recorded
            out = trunk(mx.array(data.tokens[r : r + 1, : end + 1]))
            want = np.asarray(mx.concatenate(out.layer_hidden, axis=-1)[0, :end])
            got = data.hidden[r, :end].astype(np.float32)
            assert np.abs(got - want).max() < 2e-2, r  # float16 storage
            assert np.abs(got[1:] - want[:-1]).max() > 5e-2, r
            swapped = np.concatenate(
                [want[:, HIDDEN : 2 * HIDDEN], want[:, :HIDDEN], want[:, 2 * HIDDEN :]], -1
            )
            assert np.abs(got - swapped).max() > 5e-2, r
    finally:
        trunk.tap_layers(None)


def test_the_unrolled_chain_is_the_proposers_step_by_step_forward(trunk: Trunk, data: ForgeData) -> None:
    """Draft step k at origin i of the unrolled training forward equals the proposer's path
    (`eagle3_forward` on a KV cache: the pairs 0..i, then k chain steps on the true tokens); a
    chain whose rope positions start one early (the pair's own position) is caught."""
    drafter, _, _ = _drafter(trunk, data, seed=11)
    embed = drafter_embedding(drafter, trunk)
    r = int(np.argmax(data.valid.sum(1)))
    n, depth = 14, 3
    tokens = mx.array(data.tokens[r : r + 1, : n + depth + 1])
    taps = mx.array(data.hidden[r : r + 1, :n].astype(np.float32))
    caches = [UnrollCache() for _ in drafter.layers]
    unrolled, x = [], taps
    for k in range(depth):
        x = unrolled_hidden(drafter, tokens[:, k + 1 : k + 1 + n], x, caches, k, embed)
        unrolled.append(np.asarray(x[0]))

    def chain(i: int, early: bool) -> list[np.ndarray]:
        """The proposer's path from origin i; ``early``: each chain step at its cache's length (the
        position of the pair before it) instead of one past it."""
        cache = [KVCache() for _ in drafter.layers]
        h = eagle3_forward(drafter, tokens[:, 1 : i + 2], taps[:, : i + 1], cache, None, embed)
        outs = [np.asarray(h[0, -1])]
        for k in range(1, depth):
            position = cache[0].offset if early else None
            h = eagle3_forward(drafter, tokens[:, i + k + 1 : i + k + 2], h[:, -1:], cache, position, embed)
            outs.append(np.asarray(h[0, -1]))
        return outs

    for i in (0, 5, n - 1):
        for k, ref in enumerate(chain(i, early=False)):
            assert np.abs(unrolled[k][i] - ref).max() < 1e-4, (i, k)
    off = chain(n - 1, early=True)
    assert max(np.abs(unrolled[k][n - 1] - off[k]).max() for k in range(depth)) > 1e-3


def test_training_lowers_the_loss_at_every_depth_and_acceptance_rises(
    trunk: Trunk, data: ForgeData, tmp_path: Path
) -> None:
    """30 steps of forge's loop (`train_head` with `Eagle3TrainStep`) lower every draft step's
    cross-entropy over the draft vocabulary, and the teacher-forced acceptance at t 0 and t 0.7
    (full p against q on the target vocabulary) rises at depth 1; ``d2t`` is not trained."""
    drafter, ids, _ = _drafter(trunk, data)
    d2t = np.asarray(drafter.d2t)
    index = mx.array(draft_index(ids, VOCAB))
    in_vocab = np.isin(np.arange(VOCAB), ids)
    batch = make_batch(trunk, data, np.arange(data.num_sequences), "pre_norm", in_vocab, 3)
    embed = drafter_embedding(drafter, trunk)
    before = [float(x) for x in drafter_step_losses(drafter, embed, index, batch, 3)]
    accept_before = evaluate_drafter(trunk, drafter, data, 2)
    cfg = ForgeConfig(
        steps=30, batch_size=6, lr=3e-3, warmup=5, checkpoint_every=10, progress=False, depth=3, held_out=None
    )
    train_head(cfg, trunk, drafter, data, ids, tmp_path / "ckpt", make_step=Eagle3TrainStep)
    after = [float(x) for x in drafter_step_losses(drafter, embed, index, batch, 3)]
    assert all(a < 0.85 * b for a, b in zip(after, before)), (before, after)
    accept_after = evaluate_drafter(trunk, drafter, data, 2)
    for t in ("0.0", "0.7"):
        assert 0.0 <= accept_before["1"][t] < accept_after["1"][t] <= 1.0, (accept_before, accept_after)
    assert np.array_equal(np.asarray(drafter.d2t), d2t)


def test_a_saved_drafter_loads_through_the_drafter_loader_with_its_logits(
    trunk: Trunk, data: ForgeData, tmp_path: Path
) -> None:
    """`save_eagle3` (through `write_sidecar`: temp directory, rename) writes the speculators layout
    the normal loader reads: the loaded drafter's draft logits and target ids are the saved one's,
    ``t2d`` marks exactly the draft vocabulary, and nothing else is left beside it."""
    from mtplx.drafters.discovery import find_block_drafter, load_block_drafter

    drafter, ids, config = _drafter(trunk, data, seed=5)
    write_sidecar(tmp_path / "d", drafter, {"config": config, "note": "x"}, False, save=save_eagle3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(
        ["config.json", "model.safetensors", RECORD]
    )
    target = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "vocab_size": VOCAB}
    found = find_block_drafter(tmp_path / "model", tmp_path / "d", target)
    assert found is not None and found.layout == "eagle3" and found.problem is None
    loaded = load_block_drafter(found)
    assert loaded.tapped_layers(2) == TAPS
    t2d = np.asarray(mx.load(str(tmp_path / "d" / "model.safetensors"))["t2d"])
    assert np.flatnonzero(t2d).tolist() == ids.tolist()
    embed = drafter_embedding(drafter, trunk)
    taps = mx.array(data.hidden[:2, :10].astype(np.float32))
    tokens = mx.array(data.tokens[:2, 1:11])
    for module in (drafter, loaded):
        h = eagle3_forward(module, tokens, taps, module.make_cache(), None, embed)
        logits = eagle3_logits(module, h, None)
        if module is drafter:
            want, want_ids = np.asarray(logits), np.asarray(module.draft_to_target(mx.arange(len(ids))))
    assert np.array_equal(np.asarray(logits), want)
    assert np.array_equal(np.asarray(loaded.draft_to_target(mx.arange(len(ids)))), want_ids)
    assert want_ids.tolist() == ids.tolist()


def test_forge_drafter_end_to_end_drafts_in_the_engine(tmp_path: Path) -> None:
    """The whole run on a user's model and prompts (record with taps, train, evaluate, write); the
    engine finds the drafter given with ``head=`` through its normal loader, and greedy decoding
    with it drafts and gives plain AR's tokens."""
    model_dir = tmp_path / "model"
    eos = chatml_chars(model_dir)
    checkpoints.save_model(model_dir, _tiny_trunk(seed=3).model, eos_token_id=eos)
    prompts = tmp_path / "data"
    prompts.mkdir()
    for w in "abcdef":
        (prompts / f"{w}.txt").write_text(f"the quick brown fox {w}")
    report = forge_drafter(
        ForgeConfig(
            drafter="eagle3",
            model=str(model_dir),
            data=(str(prompts),),
            out_dir=str(tmp_path / "eagle3"),
            work_dir=str(tmp_path / "work"),
            budget="0.2k",
            seq_len=48,
            max_prompt=30,
            gen_batch=4,
            top_n=8,
            eval_tokens=20,
            eval_fraction=0.2,
            depth=2,
            step_weights=(1.0, 0.5),
            batch_size=2,
            train_vocab=20,
            progress=False,
            held_out=None,
        )
    )
    record = json.loads(report.manifest_path.read_text())
    assert report.manifest_path.name == RECORD and record["drafter"] == "eagle3"
    assert record["data"]["train"]["response_tokens"] >= 200 and report.train_steps == record["steps"] >= 1
    assert set(record["acceptance"]) == {"1", "2"}
    assert all(0.0 <= v <= 1.0 for row in record["acceptance"].values() for v in row.values())
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["draft_vocab_size"] == 20 and config["eagle_aux_hidden_state_layer_ids"] == aux_layer_ids(2)
    engine = Engine.load(str(model_dir), head=str(tmp_path / "eagle3"))
    assert engine.block_drafter is not None
    prompt, bias = "the quick brown", ban_bias(engine.tokenizer)  # EOS banned: 12 tokens each
    drafted = engine.generate(
        prompt, max_tokens=12, temperature=0.0, draft="eagle3", chat=False, logit_bias=bias
    )
    plain = engine.generate(prompt, max_tokens=12, temperature=0.0, draft="none", chat=False, logit_bias=bias)
    assert drafted.token_ids == plain.token_ids and len(plain.token_ids) == 12
    assert drafted.stats.drafters["eagle3"]["drafted"] > 0


def test_the_cli_flag_reaches_the_config_and_misfits_are_one_line() -> None:
    """``--drafter eagle3`` sets the config the run dispatches on; another drafter, or one started
    from an MTP head, is refused before any work, in one line."""
    from mtplx.cli.forge import config_from_args
    from mtplx.cli.main import _build_parser
    from mtplx.errors import MtplxError

    parser = _build_parser()
    assert config_from_args(parser.parse_args(["forge", "--drafter", "eagle3"])).drafter == "eagle3"
    assert config_from_args(parser.parse_args(["forge"])).drafter is None
    for bad, says in (
        (dict(drafter="dflash"), "drafter must be one of eagle3"),
        (dict(drafter="eagle3", init_head="h"), "--init-head"),
    ):
        with pytest.raises(MtplxError, match=says) as err:
            ForgeConfig(**bad)
        assert "\n" not in str(err.value)
