"""The trunk's own sampled answers to logged prompts (`mtplx.learn.sampling`, ``LearnConfig.samples``):
recorded while the trunk writes, in bounded pieces, equal to teacher-forced rows; held-out and
grammar-constrained records never sampled; a round trains on them; a failure skips its records."""

from __future__ import annotations

import logging
from dataclasses import replace

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine import failures
from mtplx.engine.engine import Engine
from mtplx.forge.record import ForgeData, RecordingBatch, generate_batch
from mtplx.forge.train import build_head
from mtplx.learn.config import LearnConfig
from mtplx.learn.data import empty_data, fill_row, split_held_out
from mtplx.learn.log import Choice, Record
from mtplx.learn.sampling import AnswerSampler, keep_last
from mtplx.learn.serving import Learner
from mtplx.learn.trainer import learning_round, run_to_end
from mtplx.sample.params import Setting
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.learn import VOCAB, tiny_trunk

SEQ = 32
EOS = VOCAB - 1
FP = "fp-tiny"
CFG = LearnConfig(
    seq_len=SEQ,
    steps=4,
    lr=3e-3,
    batch_size=4,
    train_vocab=None,
    eval_origins=4,
    min_records=8,
    samples=2,
    sample_rows=6,
    piece_seconds=0.0,
)


@pytest.fixture(scope="module")
def trunk() -> Trunk:
    return tiny_trunk()


def _records(n: int, seed: int, grammar_every: int = 0) -> list[Record]:
    """``n`` logged requests (random prompts and answers ending at EOS), oldest first."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 9))).tolist()
        answer = rng.integers(0, VOCAB - 1, size=int(rng.integers(4, 10))).tolist() + [EOS]
        grammar = "response_format" if grammar_every and i % grammar_every == 0 else None
        out.append(
            Record(tuple(prompt), (Choice(tuple(answer), "stop"),), FP, grammar=grammar, time=seed + i)
        )
    return out


def _same(a: ForgeData, b: ForgeData) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays()))


def test_a_recording_batch_in_pieces_records_what_one_call_records(trunk: Trunk) -> None:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 8))).tolist() for _ in range(5)]
    engine = Engine(trunk.model, None, {})
    whole = generate_batch(engine, prompts, Setting(1.0), mx.random.key(7), SEQ, 8, {EOS}, max_rows=3)
    longest = max(map(len, prompts))
    batch = RecordingBatch(
        engine, prompts, Setting(1.0), mx.random.split(mx.random.key(7), 5), SEQ - longest, 8, {EOS},
        max_rows=3, seq_len=SEQ,
    )  # fmt: skip
    pieces = 1
    while not batch.advance(0.0):  # a piece ends after each result: many pieces
        pieces += 1
    assert pieces > 5 and _same(batch.data(), whole)


def test_sampled_rows_are_the_trunks_teacher_forced_rows(trunk: Trunk) -> None:
    records = _records(4, 1)
    sampler = AnswerSampler(Engine(trunk.model, None, {}), CFG)
    pieces = 0
    while sampler.work(records, 0.0):
        pieces += 1
    assert pieces > 2 and sampler.sampled == 8 and set(sampler.rows) == set(records)
    for record in records:
        rows, p = sampler.rows[record], len(record.prompt)
        assert rows.num_sequences == 2
        for r in range(2):
            end = int(np.flatnonzero(rows.valid[r]).max()) + 2
            tokens = rows.tokens[r, :end].tolist()
            assert tokens[:p] == list(record.prompt)
            # As long as the served answer at most (EOS included), ending at EOS or at that length.
            assert end - p <= len(record.choices[0].tokens)
            assert tokens[-1] == EOS or end - p == len(record.choices[0].tokens)
            teacher = empty_data(trunk, 1, end, CFG.top_k)
            fill_row(trunk, teacher, 0, tokens, p)
            assert np.array_equal(rows.valid[r, :end], teacher.valid[0])
            np.testing.assert_allclose(
                rows.hidden[r, : end - 1].astype(np.float32),
                teacher.hidden[0, : end - 1].astype(np.float32),
                atol=2e-2,
            )
            np.testing.assert_allclose(
                rows.top_logp[r, p : end - 1], teacher.top_logp[0, p : end - 1], atol=1e-3
            )
            assert (rows.top_ids[r, p : end - 1, 0] == teacher.top_ids[0, p : end - 1, 0]).all()
        # Two samples of one prompt draw with two keys: they differ (a fixed key per record and sample).
        assert not np.array_equal(rows.tokens[0], rows.tokens[1])
    again = AnswerSampler(Engine(trunk.model, None, {}), CFG)
    while again.work(records):
        pass
    assert all(_same(again.rows[r], sampler.rows[r]) for r in records)  # the same log samples alike


def test_keep_last_cuts_long_rows_to_their_last_positions() -> None:
    k, h = 2, 3
    data = ForgeData.zeros(2, 8, h, k)
    data.tokens[0, :8] = np.arange(10, 18)  # 8 positions: prompt 3, response 5
    data.valid[0, 3:7] = True
    data.tokens[1, :4] = [1, 2, 3, 4]  # 4 positions: short, kept as it is
    data.valid[1, 2:3] = True
    data.hidden[0, :7] = np.arange(7)[:, None]
    data.top_logp[0, 3:7] = -np.arange(3, 7)[:, None]
    cut = keep_last(data, 5)
    assert cut.tokens.shape == (2, 5)
    assert cut.tokens[0].tolist() == [13, 14, 15, 16, 17]
    assert cut.valid[0].tolist() == [True, True, True, True, False]
    assert cut.hidden[0, :, 0].tolist() == [3, 4, 5, 6, 0]
    assert cut.top_logp[0, :, 0].tolist() == [-3, -4, -5, -6, 0]
    assert cut.tokens[1].tolist() == [1, 2, 3, 4, 0] and cut.valid[1].tolist() == [
        False,
        False,
        True,
        False,
        False,
    ]


def test_a_round_trains_on_the_training_records_samples_only(trunk: Trunk) -> None:
    records = _records(8, 2)
    train, held = split_held_out(records, CFG.held_out_fraction)
    sampler = AnswerSampler(Engine(trunk.model, None, {}), CFG)
    while sampler.work(records):  # every record, the held-out ones too: the round must leave them
        pass
    head = build_head(trunk, "pre_norm")
    with_samples = run_to_end(learning_round(trunk, head, records, CFG, sampled=sampler.rows))
    assert with_samples.sampled_sequences == 2 * len(train) and with_samples.train_sequences == 3 * len(train)
    counted = sum(len(c.tokens) - 1 for r in train for c in r.choices) + sum(
        int(sampler.rows[r].valid.sum()) for r in train
    )
    assert with_samples.train_positions == counted
    without = run_to_end(learning_round(trunk, head, records, CFG))
    assert (without.sampled_sequences, without.train_sequences) == (0, len(train))
    assert with_samples.losses != without.losses  # the samples were trained on
    capped = run_to_end(
        learning_round(trunk, head, records, replace(CFG, max_train_rows=3), sampled=sampler.rows)
    )
    assert capped.sampled_sequences == 3  # the newest rows


def _serve(learner: Learner, records: list[Record]) -> int:
    """Log ``records`` as served, then let the learner work until it has nothing left: its pieces."""
    for record in records:
        learner.record(record.prompt, [c.tokens for c in record.choices], ["stop"], record.grammar, False)
    pieces = 0
    while learner.work():
        pieces += 1
    return pieces


def test_the_learner_samples_the_training_side_in_pieces_then_trains_on_it(trunk: Trunk, tmp_path) -> None:
    engine = Engine(trunk.model, None, {}, head=build_head(trunk, "pre_norm"), fingerprint=FP)
    learner = Learner(engine, str(tmp_path), cfg=CFG)
    records = _records(8, 3, grammar_every=4)  # records 0 and 4 grammar-constrained: not sampled
    pieces = _serve(learner, records)
    logged = learner.log.read(FP)
    train, held = split_held_out(logged, CFG.held_out_fraction)
    free = [r for r in train if r.grammar is None]
    assert set(learner.sampler.rows) == set(free) and learner.sampler.sampled == 2 * len(free)
    assert not set(learner.sampler.rows) & set(held)
    result = learner.last_result
    assert learner.rounds == 1 and result.sampled_sequences == 2 * len(free)
    assert pieces > CFG.steps + len(free)  # sampling came in pieces before the round's
    assert learner.snapshot()["sampled_answers"] == 2 * len(free)
    plain = Learner(engine, str(tmp_path / "plain"), cfg=replace(CFG, samples=0))
    _serve(plain, records)
    assert plain.sampler is None and plain.last_result.sampled_sequences == 0


def test_a_sampling_failure_skips_its_records_and_learning_goes_on(
    trunk: Trunk, tmp_path, monkeypatch, caplog
) -> None:
    engine = Engine(trunk.model, None, {}, head=build_head(trunk, "pre_norm"), fingerprint=FP)
    learner = Learner(engine, str(tmp_path), cfg=CFG)
    monkeypatch.setattr(failures, "_planned", {"submit": {1}})  # the documented hook, in process
    monkeypatch.setattr(failures, "_reached", {})
    with caplog.at_level(logging.ERROR, logger="mtplx.learn"):
        _serve(learner, _records(8, 5))
    failed = [r for r in caplog.records if "sampling failed" in r.getMessage()]
    assert len(failed) == 1 and "InjectedFault" in caplog.text
    per_batch = CFG.sample_rows // CFG.samples
    assert len(learner.sampler.failed) == per_batch and learner.sampler.sampled == 2 * (6 - per_batch)
    assert learner.rounds == 1  # the round ran on what there was


def test_forge_from_traffic_samples_answers_and_says_so(trunk: Trunk, tmp_path, capsys) -> None:
    from mtplx.checkpoints.load import load_model
    from mtplx.cli.main import main
    from mtplx.heads.forged import read_manifest, save_forged_head
    from mtplx.learn.log import TrafficLog

    from support import checkpoints
    from support.tokenizer import chatml_chars

    model_dir = checkpoints.save_model(
        tmp_path / "model", trunk.model, eos_token_id=chatml_chars(tmp_path / "model")
    ).path
    fingerprint = load_model(str(model_dir)).fingerprint
    save_forged_head(tmp_path / "head", build_head(trunk, "pre_norm"), {"trunk_fingerprint": fingerprint})
    log = TrafficLog(tmp_path / "learn")
    for record in _records(8, 6):
        log.append(replace(record, trunk=fingerprint))
    out = tmp_path / "learned"
    flags = [
        "--from-traffic",
        str(tmp_path / "learn"),
        "--model",
        str(model_dir),
        "--init-head",
        str(tmp_path / "head"),
    ]
    code = main(
        [
            "forge",
            *flags,
            "--out",
            str(out),
            "--steps",
            "4",
            "--lr",
            "3e-3",
            "--samples",
            "2",
            "--no-progress",
        ]
    )
    said = capsys.readouterr().out
    assert (
        code == 0 and "trained 4 steps on 18 sequences (12 of them sampled answers) of 6 requests" in said
    ), said
    assert f"wrote {out}" in said  # better on its held-out requests: the manifest counts the samples
    assert read_manifest(out)["learned_from_traffic"]["sampled_sequences"] == 12


def test_serve_learn_samples_sets_the_learners_samples(trunk: Trunk, tmp_path) -> None:
    from mtplx.cli.serve import _learner
    from mtplx.server.settings import ServerSettings

    engine = Engine(trunk.model, None, {}, head=build_head(trunk, "pre_norm"), fingerprint=FP)
    learner = _learner(engine, ServerSettings("m", learn_dir=str(tmp_path / "a"), learn_samples=3))
    assert learner.cfg.samples == 3 and learner.sampler is not None
    default = _learner(engine, ServerSettings("m", learn_dir=str(tmp_path / "b")))
    assert default.cfg.samples == LearnConfig().samples
