"""The batched cycle's cost profile (`tuned.engine_batch_cost`): measured once for an engine on a
machine and saved in the tune store (`mtplx tune`'s file), reused by the next engine of the same
model, head and versions; measured again for another head, a foreign or damaged entry, an
unreadable file, or ``remeasure`` (`mtplx tune`). Each test has its own store (tmp_path); the
measurement is counted, not timed (it runs at small sizes: what matters is whether it runs)."""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import tuned
from mtplx.engine.engine import Engine
from mtplx.spec_decode import draft_policy

import pytest
from support import checkpoints


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("cost") / "mimo"
    checkpoints.mimo(path, seed=1)
    checkpoints.copy_tokenizer(default_model_dir, path)
    return path


@pytest.fixture(scope="module")
def engine(mimo_dir) -> Engine:
    return Engine.load(str(mimo_dir), mtp=True, depth=2)


@pytest.fixture
def measurements(monkeypatch, tmp_path) -> list:
    """One entry per measurement run; the store in tmp_path/mtplx/tune.json."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    real = draft_policy.measure_cost_profile
    calls = []

    def counted(trunk, head=None, *, blocks=None, **_):
        calls.append(head)
        return real(trunk, head, blocks=blocks, max_tokens=4, max_rows=2, context=4, repeats=1)

    monkeypatch.setattr(draft_policy, "measure_cost_profile", counted)
    return calls


def _edit_entry(engine: Engine, change) -> None:
    path = tuned.config_file()
    data = json.loads(path.read_text())
    change(data["entries"][tuned.entry_key(engine.fingerprint, tuned.machine_key())])
    path.write_text(json.dumps(data))


def test_a_second_engine_of_the_model_reuses_the_saved_profile(mimo_dir, engine, measurements, capsys):
    first = tuned.engine_batch_cost(engine)
    assert len(measurements) == 1 and "measured, saved to" in capsys.readouterr().err
    assert tuned.saved_depth(engine.fingerprint) is None  # a profile alone is no tuned depth
    again = Engine.load(str(mimo_dir), mtp=True, depth=2)
    assert again.batch_cost_profile() == first
    assert len(measurements) == 1 and "measured here before" in capsys.readouterr().err
    tuned.engine_batch_cost(again, remeasure=True)  # `mtplx tune`
    assert len(measurements) == 2
    # Control: the same model without its head is another engine: measured for it.
    headless = Engine.load(str(mimo_dir), mtp=False)
    tuned.engine_batch_cost(headless)
    assert len(measurements) == 3 and measurements[-1] is None
    assert "measured for another head" in capsys.readouterr().err


def test_a_foreign_or_damaged_entry_is_measured_again_with_one_line(engine, measurements, capsys):
    tuned.engine_batch_cost(engine)
    _edit_entry(engine, lambda entry: entry["batch_cost_for"].update(mtplx="0.0.1"))
    tuned.engine_batch_cost(engine)
    lines = capsys.readouterr().err.splitlines()
    assert len(measurements) == 2 and sum("measured for another mtplx;" in line for line in lines) == 1
    tuned.engine_batch_cost(engine)  # the new one was saved over the foreign one
    assert len(measurements) == 2
    _edit_entry(engine, lambda entry: entry.update(batch_cost={"tokens": "x"}))
    tuned.engine_batch_cost(engine)
    assert len(measurements) == 3 and "damaged; measuring again" in capsys.readouterr().err
    tuned.config_file().write_text("{not json")
    tuned.engine_batch_cost(engine)
    tuned.engine_batch_cost(engine)  # the damaged file was replaced
    assert len(measurements) == 4


def test_a_store_that_cannot_be_written_costs_a_line_not_the_profile(
    engine, measurements, monkeypatch, tmp_path, capsys
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocker))  # its mtplx/ cannot be made
    profile = tuned.engine_batch_cost(engine)
    assert profile.tokens == (1, 2, 4) and len(measurements) == 1
    assert "measured, not saved" in capsys.readouterr().err


# The saver each process runs: it waits for the other (a file each, both present), then saves its
# entry; its read of the store is held for 0.5 s, so without the store's lock both read the file
# before either writes and the second write drops the first's entry.
_SAVER = """
import sys, time
from pathlib import Path
from mtplx.engine import tuned

config, name, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
read = tuned.read_config

def held_read(path=None):
    entries = read(path)
    time.sleep(0.5)
    return entries

tuned.read_config = held_read
(config.parent / f"ready-{name}").touch()
deadline = time.monotonic() + 60
while len(list(config.parent.glob("ready-*"))) < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
fields = {"batch_cost": {"tokens": [1], "trunk_seconds": [0.1]}, "by": name}
if how == "update":
    tuned.update_entry(name, fields, config, machine="m")
else:
    tuned.save_entry(name, fields, config, machine="m")
"""


def test_two_processes_saving_at_once_keep_both_entries(tmp_path):
    """A start saving its profile (`update_entry`) while another process saves its own entry
    (`save_entry`: `mtplx tune`, another server): both entries are in the store. Control: the
    store's lock taken out, one entry is lost (checked)."""
    import subprocess
    import sys

    from support.paths import REPO

    config = tmp_path / "store" / "tune.json"
    config.parent.mkdir()
    savers = [
        subprocess.Popen([sys.executable, "-c", _SAVER, str(config), name, how], cwd=REPO)
        for name, how in (("first", "update"), ("second", "save"))
    ]
    assert [saver.wait(timeout=120) for saver in savers] == [0, 0]
    entries = tuned.read_config(config)
    assert {entries[tuned.entry_key(name, "m")]["by"] for name in ("first", "second")} == {"first", "second"}
    assert len(entries) == 2


def test_a_profile_measured_while_another_process_tuned_keeps_the_tuned_depth(
    engine, measurements, monkeypatch
):
    """`mtplx tune` saves this model's entry (its depth) while a start measures the profile: the
    start adds its profile to the entry as the file holds it then. Control: main's start, which
    read the entry before measuring, wrote it back without the depth (checked)."""
    real = draft_policy.measure_cost_profile

    def tuned_meanwhile(*args, **kw):
        tuned.save_entry(engine.fingerprint, {"depth": 2, "model": "m"})  # the other process's save
        return real(*args, **kw)

    monkeypatch.setattr(draft_policy, "measure_cost_profile", tuned_meanwhile)
    tuned.engine_batch_cost(engine)
    assert tuned.saved_depth(engine.fingerprint) == 2 and len(measurements) == 1
    assert tuned.saved_batch_cost(engine.fingerprint, identity=tuned.batch_cost_identity(engine)) is not None
