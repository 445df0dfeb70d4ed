"""Learning from traffic (`mtplx.learn`) on tiny random trunks: the log's budget, permissions and
skips; a round's training and its held-out measure; swaps only of better heads, saved and resumed;
SIGKILL during a log write and a head save (real subprocesses); exactness across head swaps."""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.forge.record import SHARD_FILES, ForgeData, generate_batch
from mtplx.forge.train import build_head
from mtplx.learn.config import LearnConfig
from mtplx.learn.data import TeacherRows, empty_data, sequences, split_held_out, traffic_data
from mtplx.learn.log import Choice, Record, TrafficLog
from mtplx.learn.report import format_learn_report, learn_report
from mtplx.learn.serving import Learner
from mtplx.learn.store import HeadStore
from mtplx.learn.trainer import learning_round, run_to_end, swap_weights
from mtplx.sample.params import SamplerConfig, Setting
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from support import decoding, exactness, models
from support.learn import VOCAB, tiny_trunk
from support.paths import REPO

SEQ = 32
EOS = VOCAB - 1
FP = "fp-tiny"
CFG = LearnConfig(
    seq_len=SEQ, steps=20, lr=3e-3, batch_size=4, train_vocab=None, eval_origins=4, min_records=8
)


@pytest.fixture(scope="module")
def trunk() -> Trunk:
    return tiny_trunk()


def _traffic(trunk: Trunk, n: int, seed: int) -> list[Record]:
    """``n`` requests the trunk answered (sampled at t 1), as the log records them, oldest first."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB - 1, size=int(rng.integers(3, 8))).tolist() for _ in range(n)]
    data = generate_batch(
        Engine(trunk.model, None, {}), prompts, Setting(1.0), mx.random.key(seed), SEQ, 8, {EOS}
    )
    records = []
    for r, p in enumerate(prompts):
        end = int(np.flatnonzero(data.valid[r]).max()) + 2 if data.valid[r].any() else len(p) + 1
        completion = tuple(int(t) for t in data.tokens[r, len(p) : end])
        records.append(Record(tuple(p), (Choice(completion, "stop"),), FP, time=float(seed * 1000 + r)))
    return records


@pytest.fixture(scope="module")
def traffic(trunk: Trunk) -> list[Record]:
    return _traffic(trunk, 16, 0)


def _params(head) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree_flatten(head.parameters())}


def _record(i: int, trunk: str = FP, size: int = 20) -> Record:
    return Record(
        tuple(range(size)), (Choice((i, i + 1, 2), "stop"), Choice((7,), "length")), trunk, time=float(i)
    )


# ---------------------------------------------------------------- the log


def test_log_keeps_its_budget_oldest_first_in_whole_0600_files(tmp_path: Path) -> None:
    log = TrafficLog(tmp_path / "learn", max_bytes=3000)
    for i in range(40):
        log.append(_record(i))
    sizes = [p.stat().st_size for p in log.files()]
    assert sum(sizes) <= 3000 < sum(sizes) + sizes[0] * 2  # the budget holds, and is used
    kept = log.read(FP)
    assert [r.time for r in kept] == [float(i) for i in range(40 - len(kept), 40)]  # the oldest went
    assert kept[-1] == _record(39)  # a record reads back as written, both choices in order
    for path in log.files():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(log.dir.stat().st_mode) == 0o700
    assert log.records == len(sizes) and log.bytes == sum(sizes)
    reopened = TrafficLog(tmp_path / "learn", max_bytes=3000)
    assert (reopened.records, reopened.bytes) == (len(sizes), sum(sizes))  # reopened: the same count
    for i in range(40, 50):  # a reopened log keeps the budget, evicting what an earlier run wrote
        reopened.append(_record(i))
    sizes = [p.stat().st_size for p in reopened.files()]
    assert sum(sizes) == reopened.bytes <= 3000 and len(sizes) == reopened.records
    assert [r.time for r in reopened.read(FP)][-1] == 49.0 and reopened.read(FP)[0].time > 40 - len(kept)
    with pytest.raises(MtplxError, match="--learn-max-bytes: must be > 0"):
        TrafficLog(tmp_path / "other", max_bytes=0)


def test_corrupt_and_foreign_files_are_skipped_with_one_log_line_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = TrafficLog(tmp_path, max_bytes=10**6)
    log.append(_record(1))
    (log.dir / "rec-00000000000000000001.json").write_bytes(b'{"format": "mtplx-traffic/1", "prompt": [1,')
    (log.dir / "rec-00000000000000000002.json").write_text(json.dumps({"some": "other file"}))
    log.append(_record(2, trunk="another-model"))
    log.append(_record(3))
    with caplog.at_level(logging.WARNING, logger="mtplx.learn"):
        first = log.read(FP)
        again = log.read(FP)
    assert [r.time for r in first] == [1.0, 3.0] and again == first
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # one per bad file, not one per read
    assert any("rec-00000000000000000001.json: skipped (not a traffic record" in line for line in lines)
    assert any("recorded for trunk another-model, not this one (fp-tiny)" in line for line in lines)
    # The same trunk with another tokenizer (its ids mean other text): skipped too.
    log.append(Record((1, 2), (Choice((3, 4), "stop"),), FP, tokenizer="tok-a", time=4.0))
    with caplog.at_level(logging.WARNING, logger="mtplx.learn"):
        assert [r.time for r in log.read(FP, "tok-b")] == [1.0, 3.0]
    assert "recorded with tokenizer tok-a, not this one (tok-b)" in caplog.records[-1].getMessage()
    assert [r.time for r in log.read(FP, "tok-a")] == [1.0, 3.0, 4.0]


@pytest.mark.parametrize(
    "args,expected",
    [
        (["serve", "--learn-every", "4"], "--learn-every: needs --learn"),
        (["serve", "--learn", "d", "--learn-steps", "0"], "--learn-steps: must be > 0, got 0"),
        (["serve", "--learn", "d", "--learn-max-bytes", "-1"], "--learn-max-bytes: must be > 0, got -1"),
        (["serve", "--learn", " "], "--learn: empty path (name a directory)"),
        (["forge", "--from-traffic", "d", "--budget", "1h"], "--budget: does not apply to --from-traffic"),
        (["forge", "--from-traffic", "d", "--steps", "0"], "--steps: must be > 0, got 0"),
        (["serve", "--learn-samples", "2"], "--learn-samples: needs --learn"),
        (["serve", "--learn", "d", "--learn-samples", "-1"], "--learn-samples: must be >= 0, got -1"),
        (["forge", "--samples", "2"], "--samples: applies to --from-traffic only"),
        (["forge", "--from-traffic", "d", "--samples", "-1"], "--samples: must be >= 0, got -1"),
    ],
)
def test_learn_flag_errors_are_one_line_naming_the_flag(
    args, expected, capsys, tmp_path, monkeypatch
) -> None:
    from mtplx.cli.main import main

    monkeypatch.chdir(tmp_path)  # nothing may be created by a refused command
    assert main(args) != 0
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []


KILL_DURING_LOG_WRITE = """
import os, signal, sys
from mtplx.learn import log as traffic
from mtplx.learn.log import Choice, Record, TrafficLog
from mtplx.learn.report import format_learn_report, learn_report

log = TrafficLog(sys.argv[1], max_bytes=10**6)
for i in range(3):
    log.append(Record((1, 2, 3), (Choice((i, 5), "stop"),), "fp", time=float(i)))

def half_then_kill(path, data):
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
        handle.flush()
        os.fsync(handle.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

traffic._write_bytes = half_then_kill
log.append(Record((1, 2, 3), (Choice((9, 5), "stop"),), "fp", time=9.0))
"""


def _run_killed(script: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{REPO / 'tests'}")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]


def test_sigkill_during_a_log_write_loses_only_that_record(tmp_path: Path) -> None:
    _run_killed(KILL_DURING_LOG_WRITE, str(tmp_path))
    assert list((tmp_path / "traffic").glob(".rec-*"))  # the half-written temp file is there
    log = TrafficLog(tmp_path, max_bytes=10**6)
    assert [r.choices[0].tokens for r in log.read("fp")] == [(0, 5), (1, 5), (2, 5)]
    assert not list(log.dir.glob(".rec-*"))  # removed at the next open


# ---------------------------------------------------------------- a learning round


def test_held_out_requests_are_the_newest_and_never_trained_on(traffic: list[Record]) -> None:
    train, held = split_held_out(traffic, 0.25)
    assert held == traffic[-4:] and train == traffic[:-4]
    seqs = sequences(traffic[:1], 6)  # cut to 6: the prompt's start goes, the completion stays
    completion = traffic[0].choices[0].tokens
    assert seqs[0][0][-min(len(completion), 5) :] == list(completion[:5])[-min(len(completion), 5) :]
    assert len(seqs[0][0]) <= 6


def test_a_round_raises_held_out_acceptance_and_leaves_the_head_in_use(
    trunk: Trunk, traffic: list[Record]
) -> None:
    head = build_head(trunk, "pre_norm")
    before_params = _params(head)
    result = run_to_end(learning_round(trunk, head, traffic, CFG))
    for table in (result.before, result.after):
        assert set(table) == {"1", "2", "3"}
        assert all(0.0 <= v <= 1.0 for row in table.values() for v in row.values())
    assert result.gain > 0.15, (result.before, result.after)
    assert result.better() and (result.train_records, result.held_records) == (12, 4)
    after = _params(head)
    assert all(np.array_equal(before_params[k], after[k]) for k in after)  # a copy was trained


def test_kept_teacher_rows_equal_fresh_ones_and_only_new_sequences_run_the_trunk(
    trunk: Trunk, traffic: list[Record]
) -> None:
    seqs = sequences(traffic, SEQ)
    rows = TeacherRows()

    def through(kept: list) -> ForgeData:
        out = empty_data(trunk, len(kept), SEQ, CFG.top_k)
        for r, (tokens, p) in enumerate(kept):
            rows.fill(trunk, out, r, tokens, p)
        rows.keep_last_round()
        return out

    def same(a: ForgeData, b: ForgeData) -> bool:
        return all(np.array_equal(getattr(a, n), getattr(b, n)) for n in SHARD_FILES)

    assert same(through(seqs[:10]), traffic_data(trunk, seqs[:10], SEQ, CFG.top_k)) and rows.forwards == 10
    # The next round reads 6 more: 6 forwards; its kept rows (reordered) are the fresh ones.
    later = seqs[4:] + seqs[:4]
    assert same(through(later), traffic_data(trunk, later, SEQ, CFG.top_k)) and rows.forwards == 16
    # One token changed mid-completion is another sequence (its later states differ): a forward.
    tokens, p = seqs[0]
    edited = [(tokens[:p] + [(tokens[p] + 1) % VOCAB] + tokens[p + 1 :], p)]
    assert same(through(edited), traffic_data(trunk, edited, SEQ, CFG.top_k)) and rows.forwards == 17
    # The same tokens as another prompt/completion split: the response positions follow the split.
    split = through([(tokens, p + 1)])
    assert split.valid[0, p] == 0 and split.valid[0, p + 1 : len(tokens) - 1].all()
    assert len(rows) == 1  # rows the last round did not read are dropped


def test_a_round_counts_the_response_positions_it_trains_on(trunk: Trunk, traffic: list[Record]) -> None:
    """`RoundResult.train_positions` (what `forge --from-traffic` reports): every response position
    of the older records but each sequence's last, counted here from the records."""
    train, _ = split_held_out(traffic, CFG.held_out_fraction)
    counted = sum(len(c.tokens) - 1 for r in train for c in r.choices if len(c.tokens) >= 2)
    result = run_to_end(learning_round(trunk, build_head(trunk, "pre_norm"), traffic, replace(CFG, steps=1)))
    assert result.train_positions == counted > 0


def test_a_round_over_kept_rows_trains_the_same_head(trunk: Trunk, traffic: list[Record]) -> None:
    cfg = replace(CFG, steps=3)
    head = build_head(trunk, "pre_norm")
    rows = TeacherRows()
    run_to_end(learning_round(trunk, head, traffic[:12], cfg, rows=rows))
    kept = run_to_end(learning_round(trunk, head, traffic, cfg, rows=rows))
    fresh = run_to_end(learning_round(trunk, head, traffic, cfg))
    assert rows.forwards == 9 + 3  # round 1 trains on 9 requests; round 2 on 12, 9 of them kept
    assert kept.after == fresh.after and kept.losses == fresh.losses
    a, b = _params(kept.candidate), _params(fresh.candidate)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def _engine(trunk: Trunk, head) -> Engine:
    return Engine(trunk.model, None, {}, head=head, fingerprint=FP)


def _learn(learner: Learner, records: list[Record]) -> None:
    for record in records:
        learner.record(record.prompt, [c.tokens for c in record.choices], ["stop"], None, False)
    while learner.work():
        pass


def test_a_better_head_is_swapped_in_saved_and_resumed_after_a_restart(
    trunk: Trunk, traffic: list[Record], tmp_path: Path
) -> None:
    engine = _engine(trunk, build_head(trunk, "pre_norm"))
    learner = Learner(engine, str(tmp_path), cfg=CFG)
    _learn(learner, traffic)
    assert (learner.version, learner.rounds, learner.accepted) == (1, 1, 1)
    state = HeadStore(tmp_path).state()
    assert state["version"] == 1 and state["acceptance"]["first_draft"] > state["acceptance"]["before"]
    served = _params(engine.head)
    assert any(not np.array_equal(served[k], v) for k, v in _params(build_head(trunk, "pre_norm")).items())
    # A restart with the shipped head resumes with the learned one.
    restarted = _engine(trunk, build_head(trunk, "pre_norm"))
    resumed = Learner(restarted, str(tmp_path), cfg=CFG)
    assert resumed.version == 1
    assert all(np.array_equal(served[k], v) for k, v in _params(restarted.head).items())
    snapshot = resumed.snapshot()
    assert snapshot["head_version"] == 1 and snapshot["records"] == len(traffic)
    # What `mtplx inspect --learn DIR` reports, from the files alone.
    report = learn_report(tmp_path)
    assert report["head_version"] == 1 and [h["version"] for h in report["history"]] == [1]
    assert report["trainer"]["rounds"] == 1 and 0 < report["trainer"]["trainer_share"] <= 1
    text = format_learn_report(report)
    assert f"head: learned v1, first-draft acceptance {state['acceptance']['first_draft']:.3f}" in text
    assert f"traffic log: {len(traffic)} requests" in text and "1 rounds, 1 accepted" in text


def test_a_worse_head_is_never_swapped_in(trunk: Trunk, traffic: list[Record], tmp_path: Path) -> None:
    engine = _engine(trunk, build_head(trunk, "pre_norm"))
    before = _params(engine.head)
    # Diverges: a worse head. A round reads the newest max_records records only (its cost is bounded).
    wild = LearnConfig(**{**CFG.__dict__, "lr": 3.0, "steps": 6, "max_records": 12})
    learner = Learner(engine, str(tmp_path), cfg=wild)
    _learn(learner, traffic)
    assert learner.rounds == 1 and learner.accepted == 0 and learner.version == 0
    assert all(np.array_equal(before[k], v) for k, v in _params(engine.head).items())
    assert HeadStore(tmp_path).state() == {}
    result = learner.last_result
    assert result.gain < 0, (result.before, result.after)  # really worse, not merely not better
    assert (result.train_records, result.held_records) == (9, 3)  # of the 16 logged


KILL_DURING_HEAD_SAVE = """
import os, signal, sys
import mtplx
import mlx.core as mx
from mtplx.forge.train import build_head
from mtplx.learn.store import HeadStore
from support.learn import tiny_trunk

trunk = tiny_trunk()
store = HeadStore(sys.argv[1])
head = build_head(trunk, "pre_norm")
store.save(head, {"trunk_fingerprint": "fp"}, {"first_draft": 0.5})
head.fc.weight = head.fc.weight * 2

real_save = mx.save_safetensors
def save_then_kill(path, arrays, metadata=None):
    real_save(path, arrays, metadata=metadata)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    os.kill(os.getpid(), signal.SIGKILL)

mx.save_safetensors = save_then_kill
store.save(head, {"trunk_fingerprint": "fp"}, {"first_draft": 0.6})
"""


def test_sigkill_during_a_head_save_keeps_the_last_good_head(trunk: Trunk, tmp_path: Path) -> None:
    _run_killed(KILL_DURING_HEAD_SAVE, str(tmp_path))
    assert list((tmp_path / "heads").glob(".v0002*"))  # the interrupted save's temp directory
    store = HeadStore(tmp_path)
    assert not list(store.dir.glob(".v*"))
    head, state = store.load_current(trunk, "fp")
    assert state["version"] == 1 and state["acceptance"]["first_draft"] == 0.5
    assert all(np.array_equal(v, _params(build_head(trunk, "pre_norm"))[k]) for k, v in _params(head).items())


# ---------------------------------------------------------------- exactness across swaps


def _swapping_decode(trunk, head, heads, cfg: SamplerConfig, depth: int, n: int, seed: int) -> list[int]:
    """The first ``n`` tokens of a speculative run whose head weights change at every cycle boundary
    (alternating between ``heads``): what a swap mid-request does, as often as possible."""
    steps = decoding.mtp_decode(
        trunk, head, exactness.PROMPT, decoding.DecodeSettings(sampler=cfg, depth=depth), mx.random.key(seed)
    )
    tokens: list[int] = []
    for i, step in enumerate(steps):
        tokens.extend(step.tokens)
        if len(tokens) >= n:
            break
        swap_weights(head, heads[i % len(heads)])
    steps.close()
    return tokens[:n]


def _swap_pair():
    trunk, head = models.make_loop_pair(vocab_size=6, seed=3)
    _, other = models.make_loop_pair(vocab_size=6, seed=11, head_noise=2.0)
    original = models.make_loop_pair(vocab_size=6, seed=3)[1]
    return trunk, head, [other, original]


# The default suite's size (the planted bug below measured p ~ 1e-23 at 150 samples); the slow
# repeat has the power of the loop tests' chi-squares (tests/spec_decode/test_decode.py: 1000).
SWAP_SAMPLES, SWAP_SAMPLES_SLOW, CONTROL_SAMPLES = 120, 1000, 100


def _swap_counts(seed0: int, samples: int) -> tuple[np.ndarray, np.ndarray]:
    trunk, head, heads = _swap_pair()
    cfg = SamplerConfig(temperature=0.7)
    counts = np.zeros([6] * exactness.NUM_OUTPUT_TOKENS, dtype=np.int64)
    for i in range(samples):
        counts[
            tuple(_swapping_decode(trunk, head, heads, cfg, 2, exactness.NUM_OUTPUT_TOKENS, seed0 + i))
        ] += 1
    return counts, exactness.exact_ar_joint(trunk, cfg, 6)


@pytest.mark.parametrize(
    "samples",
    [SWAP_SAMPLES, pytest.param(SWAP_SAMPLES_SLOW, marks=pytest.mark.slow)],
    ids=["default", "large"],
)
def test_sampling_across_head_swaps_matches_the_exact_ar_chain(samples: int) -> None:
    counts, expected = _swap_counts(50_000, samples)
    assert exactness.loop_p_value(counts, expected) > exactness.FALSE_FAILURE_RATE


def test_the_swap_chi_square_catches_a_loop_that_commits_the_rejected_draft(monkeypatch) -> None:
    exactness.plant_commit_rejected_draft(monkeypatch)
    counts, expected = _swap_counts(60_000, CONTROL_SAMPLES)
    assert exactness.loop_p_value(counts, expected) < exactness.FALSE_FAILURE_RATE


def test_greedy_output_is_identical_with_head_swaps_and_without() -> None:
    trunk, head, heads = _swap_pair()
    greedy = SamplerConfig(temperature=0.0)
    plain = decoding.take_tokens(
        decoding.ar_decode(
            trunk, exactness.PROMPT, decoding.DecodeSettings(sampler=greedy), mx.random.key(0)
        ),
        16,
    )
    assert _swapping_decode(trunk, head, heads, greedy, 2, 16, 0) == plain


# ---------------------------------------------------------------- mtplx forge --from-traffic


@pytest.fixture(scope="module")
def served_tiny(trunk: Trunk, traffic: list[Record], tmp_path_factory) -> tuple[Path, Path, Path]:
    """(model dir, its forged head, a traffic log of it): the tiny trunk as a user's model directory."""
    from mtplx.checkpoints.load import load_model
    from mtplx.heads.forged import save_forged_head

    from support import checkpoints
    from support.tokenizer import chatml_chars

    root = tmp_path_factory.mktemp("from-traffic")
    model_dir = checkpoints.save_model(
        root / "model", trunk.model, eos_token_id=chatml_chars(root / "model")
    ).path
    fingerprint = load_model(str(model_dir)).fingerprint
    save_forged_head(root / "head", build_head(trunk, "pre_norm"), {"trunk_fingerprint": fingerprint})
    log = TrafficLog(root / "learn")
    for record in traffic:
        log.append(Record(record.prompt, record.choices, fingerprint, time=record.time))
    return model_dir, root / "head", root / "learn"


def _forge(*args: str) -> int:
    from mtplx.cli.main import main

    return main(["forge", *args])


def test_forge_from_traffic_writes_a_better_head_and_says_by_how_much(
    served_tiny, tmp_path: Path, capsys
) -> None:
    from mtplx.heads.forged import load_forged_head, read_manifest

    model_dir, head, learn = served_tiny
    out = tmp_path / "learned"
    flags = [
        "--from-traffic",
        str(learn),
        "--model",
        str(model_dir),
        "--init-head",
        str(head),
        "--out",
        str(out),
    ]
    assert _forge(*flags, "--steps", "20", "--lr", "3e-3") == 0
    said = capsys.readouterr().out
    manifest = read_manifest(out)
    learned = manifest["learned_from_traffic"]
    before, after = learned["acceptance_before"]["1"], learned["acceptance_after"]["1"]
    gain = (sum(after.values()) - sum(before.values())) / 2
    assert gain > 0.15 and f"({gain:+.3f}) on 4 held-out requests" in said, said
    assert f"wrote {out}" in said
    load_forged_head(out, served_tiny_trunk(model_dir), manifest["trunk_fingerprint"])  # a usable head
    # A run whose head measures worse writes nothing, and says so.
    worse = tmp_path / "worse"
    assert _forge(*flags[:-1], str(worse), "--steps", "6", "--lr", "3.0") == 0
    assert "kept out" in capsys.readouterr().out and not worse.exists()


def served_tiny_trunk(model_dir: Path) -> Trunk:
    from mtplx.checkpoints.load import load_model

    return Trunk(load_model(str(model_dir)).model)


def test_forge_from_traffic_starts_from_the_head_serve_learn_accepted(
    served_tiny, tmp_path: Path, capsys
) -> None:
    import shutil

    from mtplx.checkpoints.load import load_model

    model_dir, _, learn = served_tiny
    copy = tmp_path / "learn"
    shutil.copytree(learn / "traffic", copy / "traffic")
    loaded = load_model(str(model_dir))
    HeadStore(copy).save(
        build_head(Trunk(loaded.model), "pre_norm"), {"trunk_fingerprint": loaded.fingerprint}, {}
    )
    code = _forge("--from-traffic", str(copy), "--model", str(model_dir), "--steps", "2", "--lr", "3.0")
    said = capsys.readouterr().out
    assert code == 0 and "trained 2 steps on 12 sequences of 12 requests from the learned head v1" in said, (
        said
    )


def test_traffic_is_logged_for_a_head_that_cannot_learn_yet(trunk: Trunk, tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="mtplx.learn"):
        learner = Learner(_engine(trunk, None), str(tmp_path), cfg=CFG)
    assert "only forged heads learn yet" in caplog.text
    for _ in range(CFG.min_records + 1):
        learner.record((1, 2, 3), [(4, 5, 6)], ["stop"], None, False)
    assert learner.log.records == CFG.min_records + 1 and not learner.has_work() and not learner.work()


def test_forge_from_traffic_refuses_a_log_of_another_model(served_tiny, tmp_path: Path, capsys) -> None:
    model_dir, head, _ = served_tiny
    log = TrafficLog(tmp_path / "other")
    for i in range(4):
        log.append(_record(i, trunk="0123456789abcdef"))
    code = _forge(
        "--from-traffic", str(tmp_path / "other"), "--model", str(model_dir), "--init-head", str(head)
    )
    err = capsys.readouterr().err
    assert code != 0 and "its records are for trunk 0123456789abcdef" in err, err
    assert not (tmp_path / "other" / "forged-from-traffic").exists()
    assert _forge("--from-traffic", str(tmp_path / "nothing"), "--model", str(model_dir)) != 0
    assert "no traffic log here" in capsys.readouterr().err
    from mtplx.cli.main import main

    assert main(["inspect", str(model_dir), "--learn", str(tmp_path / "nothing")]) != 0
    assert "--learn: " in capsys.readouterr().err
    assert main(["inspect", str(model_dir), "--learn", str(tmp_path / "other")]) == 0
    assert "head: the served one (no learned head accepted yet)" in capsys.readouterr().out
