"""The prompt cache's disk tier (mtplx/trunk/prompt_cache_disk.py) through `Engine`.

Tiny random trunks and heads (tests/support/models.py) with the default model's real tokenizer:
a plain-KV llama (entries trimmed on reuse) and a hybrid Qwen3.5 (recurrent snapshots). A
"restart" is a second engine on the same weights with a fresh RAM cache over the same directory.
The reference is always the same weights without any prompt cache; mlx-lm's own
``load_prompt_cache`` and a full forward check what the files hold.
"""

from __future__ import annotations

import logging

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.trunk.prompt_cache_disk import DiskTier, cache_identity

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache
from support.models import make_loop_pair

VOCAB = 49152  # the default tokenizer's
RAM = 1 << 30
DISK = 1 << 30


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(default_model_dir)


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def pair(request):
    trunk, head = make_loop_pair(vocab_size=VOCAB, family=request.param, seed=1, logit_scale=8.0)
    return request.param, trunk, head


def _engine(pair, tokenizer, directory=None, budget: int = DISK, **identity) -> Engine:
    _, trunk, head = pair
    engine = Engine(
        trunk.model, tokenizer, {}, head=head, depth=3, prompt_cache_bytes=RAM if directory else 0
    )
    if directory is not None:
        engine.use_disk_cache(directory, budget)
        if identity:  # another configuration's key (what a different adapter or KV quantization gives)
            base = cache_identity(fingerprint="", trunk=engine.trunk, head=engine.head)
            engine.prompt_cache.disk = DiskTier(directory, budget, {**base, **identity})
    return engine


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


def _files(directory) -> list:
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))


def _first_turn(pair, tokenizer, directory, prompt):
    engine = _engine(pair, tokenizer, directory)
    result = engine.generate(prompt, max_tokens=6, temperature=0.0)
    assert engine.prompt_cache.disk.flush()
    return result


def test_restarted_engine_reuses_the_disk_with_identical_output(pair, tokenizer, tmp_path):
    family = pair[0]
    prompt = _tokens(0, 80)
    first = _first_turn(pair, tokenizer, tmp_path, prompt)
    assert first.stats.cached_tokens == 0
    assert _files(tmp_path), "nothing was written"
    turn2 = prompt + first.token_ids + _tokens(1, 6)
    plain = _engine(pair, tokenizer).generate(turn2, max_tokens=6, temperature=0.0)
    restarted = _engine(pair, tokenizer, tmp_path)
    assert len(restarted.prompt_cache) == 0 and len(restarted.prompt_cache.disk) > 0
    got = restarted.generate(turn2, max_tokens=6, temperature=0.0)
    assert got.token_ids == plain.token_ids
    disk = restarted.prompt_cache.disk.stats
    assert disk.hits == 1 and disk.bytes_loaded > 0
    if family == "qwen3_5":  # the snapshot at the first prompt's end (all but its last token)
        assert got.stats.cached_tokens == len(prompt) - 1
    else:
        assert len(prompt) <= got.stats.cached_tokens < len(prompt) + len(first.token_ids)


def test_mlx_lm_reads_the_trunk_part(pair, tokenizer, tmp_path):
    """The file's first caches, loaded by mlx-lm itself, continue the prompt as a full forward does."""
    _, trunk, _ = pair
    prompt = _tokens(2, 40)
    _first_turn(pair, tokenizer, tmp_path, prompt)
    (path,) = _files(tmp_path)
    caches, meta = load_prompt_cache(str(path), return_metadata=True)
    trunk_part = caches[: len(trunk.make_cache())]
    held = len(prompt) - 1  # a snapshot holds this much; plain KV holds more and is trimmed to it
    assert int(meta["mtplx_size"]) >= held
    for c in trunk_part:
        if c.is_trimmable():
            c.trim(c.offset - held)
    more = prompt[held:]
    expected = trunk.model(mx.array(prompt)[None])[0, held:]
    got = trunk.model(mx.array(more)[None], cache=trunk_part)[0]
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)
    # Negative control: the same forward on fresh caches differs (the file's state mattered).
    fresh = trunk.model(mx.array(more)[None], cache=trunk.make_cache())[0]
    assert not np.allclose(np.array(fresh), np.array(expected), atol=1e-3)


@pytest.mark.parametrize(
    "other", [{"adapter": "another-adapter"}, {"kv": "QuantizedKVCache(bits=4,group=64)"}]
)
def test_another_configuration_does_not_reuse_the_disk(pair, tokenizer, tmp_path, other, caplog):
    prompt = _tokens(3, 60)
    _first_turn(pair, tokenizer, tmp_path, prompt)
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _engine(pair, tokenizer, tmp_path, **other)
    assert len(engine.prompt_cache.disk) == 0
    assert "of another model or configuration" in caplog.text
    got = engine.generate(prompt, max_tokens=3, temperature=0.0)
    assert got.stats.cached_tokens == 0 and engine.prompt_cache.disk.stats.hits == 0
    # Positive control: the same configuration does reuse it.
    same = _engine(pair, tokenizer, tmp_path).generate(prompt, max_tokens=3, temperature=0.0)
    assert same.stats.cached_tokens > 0


def test_identity_names_adapter_and_kv_quantization(pair, tokenizer, tmp_path):
    """Keys differ with the adapter files and the trunk's KV-cache kind (the model fingerprint
    alone ignores adapters)."""
    from support.models import quantized_kv_cache

    _, trunk, head = pair
    base = cache_identity(fingerprint="f", trunk=trunk, head=head)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapters.safetensors").write_bytes(b"x")
    assert (
        cache_identity(fingerprint="f", trunk=trunk, head=head, adapter_path=adapter)["adapter"]
        != base["adapter"]
    )
    (adapter / "adapters.safetensors").write_bytes(b"y")
    assert (
        len(
            {
                cache_identity(fingerprint="f", trunk=trunk, head=head, adapter_path=adapter)["adapter"],
                base["adapter"],
            }
        )
        == 2
    )
    quantized = type(
        "QuantizedTrunk",
        (),
        {"model": trunk.model, "make_cache": lambda self: quantized_kv_cache(trunk.model)},
    )()
    assert cache_identity(fingerprint="f", trunk=quantized, head=head)["kv"] != base["kv"]
    assert cache_identity(fingerprint="f", trunk=trunk, head=None)["head"] != base["head"]


@pytest.mark.parametrize("when", ["before start", "after indexing"])
def test_a_truncated_file_is_skipped_and_the_request_served(pair, tokenizer, tmp_path, when, caplog):
    prompt = _tokens(4, 60)
    _first_turn(pair, tokenizer, tmp_path, prompt)
    expected = _engine(pair, tokenizer).generate(prompt, max_tokens=4, temperature=0.0)
    path = _files(tmp_path)[-1]

    def truncate():
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])

    if when == "before start":
        truncate()
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _engine(pair, tokenizer, tmp_path)
        if when == "after indexing":
            truncate()
        got = engine.generate(prompt, max_tokens=4, temperature=0.0)
    assert got.token_ids == expected.token_ids and got.stats.cached_tokens == 0
    lines = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
    assert len(lines) == 1 and "skipped" in lines[0], lines
    assert engine.prompt_cache.disk.stats.skipped_files == 1


def test_disk_budget_evicts_the_least_recently_used(pair, tokenizer, tmp_path):
    prompts = [_tokens(10 + i, 50) for i in range(3)]
    engine = _engine(pair, tokenizer, tmp_path)
    engine.generate(prompts[0], max_tokens=2, temperature=0.0)
    assert engine.prompt_cache.disk.flush()
    one = engine.prompt_cache.disk.nbytes
    # Room for two entries on disk: the third write evicts the least recently used one.
    engine = _engine(pair, tokenizer, tmp_path, budget=int(2.5 * one))
    engine.generate(prompts[1], max_tokens=2, temperature=0.0)
    assert engine.prompt_cache.disk.flush()
    engine.prompt_cache.clear()
    engine.generate(prompts[0], max_tokens=2, temperature=0.0)  # a disk hit: prompt 0 is used again
    assert engine.prompt_cache.disk.stats.hits == 1
    engine.generate(prompts[2], max_tokens=2, temperature=0.0)
    assert engine.prompt_cache.disk.flush()
    assert engine.prompt_cache.disk.nbytes <= int(2.5 * one)
    fresh = _engine(pair, tokenizer, tmp_path, budget=int(2.5 * one))
    served = [fresh.prompt_cache.disk.load_best(np.array(p), True) is not None for p in prompts]
    assert served == [True, False, True]


def test_the_disk_tier_adds_no_host_sync(pair, tokenizer, tmp_path, monkeypatch):
    """A request on an engine with a disk tier waits for MLX as often as one on a RAM cache alone
    (its entries are queued with ``mx.async_eval`` and saved by the writer thread)."""
    from mtplx.trunk.prompt_cache_disk import DiskTier

    from mlx.utils import tree_flatten
    from support.sync_counter import counting_syncs

    prompt = _tokens(30, 50)

    def syncs(engine: Engine) -> int:
        with counting_syncs() as counter:
            engine.generate(prompt, max_tokens=8, temperature=0.0)
        assert engine.prompt_cache.disk is None or engine.prompt_cache.disk.flush()
        return counter.syncs

    _, trunk, head = pair
    ram_only = Engine(trunk.model, tokenizer, {}, head=head, depth=3, prompt_cache_bytes=RAM)
    expected = syncs(ram_only)
    assert syncs(_engine(pair, tokenizer, tmp_path / "a")) == expected
    # Negative control: a write that waits for the states on the decode thread is caught.
    real_write = DiskTier.write

    def waiting_write(self, entry):
        caches = list(entry.trunk_cache) + list(entry.head_cache or [])
        mx.eval([a for _, a in tree_flatten([c.state for c in caches]) if isinstance(a, mx.array)])
        real_write(self, entry)

    monkeypatch.setattr(DiskTier, "write", waiting_write)
    assert syncs(_engine(pair, tokenizer, tmp_path / "b")) > expected


# ---------------------------------------------------------------- operations (issue 49 items 4, 5, 10)


def test_an_entry_larger_than_the_budget_is_said_once_and_counted(pair, tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _engine(pair, tokenizer, tmp_path, budget=1000)
        for seed in (40, 41):
            engine.generate(_tokens(seed, 40), max_tokens=2, temperature=0.0)
            assert engine.prompt_cache.disk.flush()
    assert _files(tmp_path) == []
    lines = [r.getMessage() for r in caplog.records if "larger than the disk budget" in r.getMessage()]
    assert len(lines) == 1, lines
    assert engine.prompt_cache.disk.stats.dropped_writes >= 2


def test_a_stopped_writers_unfinished_files_are_removed_and_counted(pair, tokenizer, tmp_path, caplog):
    prompt = _tokens(42, 50)
    _first_turn(pair, tokenizer, tmp_path, prompt)
    # What a writer killed mid-save leaves: a hidden temporary name with its (now dead) pid.
    entry = _files(tmp_path)[0]
    left = tmp_path / f".{entry.name}.999999999.tmp.safetensors"
    left.write_bytes(entry.read_bytes()[:1000])
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _engine(pair, tokenizer, tmp_path)
    assert not left.exists() and entry.exists()
    assert engine.prompt_cache.disk.stats.removed_files == 1
    assert any("unfinished" in r.getMessage() for r in caplog.records)


def test_a_second_process_on_the_directory_is_refused_in_one_line(tmp_path):
    """One writer per directory: another process's tier holds the lock, this one is refused."""
    import subprocess
    import sys

    from mtplx.errors import MtplxError

    from support.paths import REPO

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, mtplx\n"
            "from mtplx.trunk.prompt_cache_disk import DiskTier\n"
            "DiskTier(sys.argv[1], 1 << 20, {'model': 'other'})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.read()\n",
            str(tmp_path),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(MtplxError) as err:
            DiskTier(tmp_path, DISK, {"model": "mine"})
        message = str(err.value)
        assert "\n" not in message and str(tmp_path) in message and f"pid {holder.pid}" in message, message
    finally:
        holder.communicate(input="", timeout=60)
    # The lock goes with the process: now this one may write here.
    assert len(DiskTier(tmp_path, DISK, {"model": "mine"})) == 0


def test_close_waits_a_bounded_time_and_logs_written_and_dropped(
    pair, tokenizer, tmp_path, monkeypatch, caplog
):
    """A write that cannot finish (a stuck disk) does not hold shutdown past its bound; it is
    counted as dropped; the entries that did reach the disk are counted as written."""
    import threading

    from mtplx.trunk import prompt_cache_format

    engine = _engine(pair, tokenizer, tmp_path)
    engine.generate(_tokens(43, 40), max_tokens=2, temperature=0.0)
    assert engine.prompt_cache.disk.flush()
    written = engine.prompt_cache.disk.stats.writes
    assert written >= 1
    stuck = threading.Event()
    real_save = prompt_cache_format.save_prompt_cache

    def stuck_save(*args, **kwargs):
        stuck.wait(60)
        real_save(*args, **kwargs)

    monkeypatch.setattr(prompt_cache_format, "save_prompt_cache", stuck_save)
    engine.generate(_tokens(44, 40), max_tokens=2, temperature=0.0)
    try:
        with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
            engine.prompt_cache.disk.close(timeout=0.5)
    finally:
        stuck.set()
    lines = [r.getMessage() for r in caplog.records if "shutdown" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"{written} entries written" in lines[0] and "still queued" in lines[0], lines
    assert engine.prompt_cache.disk.stats.dropped_writes >= 1
