"""A fuzz of the prompt cache's disk files (issue 49, item 2 and "What to build"): a damaged file
is never served.

Real entry files, written by an engine on a tiny random llama (plain KV) and a hybrid Qwen3.5
(recurrent snapshots) with the default model's tokenizer, are damaged in every way a disk, a
crash or a careless hand damages them: cut short, bytes flipped (header, metadata or tensor data),
blocks of tensor data swapped, a token id of the key edited, the key field set to another
configuration's, or another model's files forged with this configuration's key. Each damaged
directory is opened by a fresh `DiskTier` (a restart): the entry must not be served, and a damaged
file (not a foreign one) is removed. Positive control: the same directory undamaged is served.
Negative control: with the digest check switched off, the fuzz finds damaged files served (so it
can fail). End to end, a restarted engine over a damaged entry answers as a cold one does and
writes back a sound entry, never the damaged prefix.

A fixed number of seeded cases per kind runs in ``make test``; ``slow`` runs many more.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.trunk import prompt_cache_format
from mtplx.trunk.prompt_cache_disk import DiskTier, cache_identity
from mtplx.trunk.prompt_cache_file import verify

import numpy as np
import pytest
from support.models import make_loop_pair

VOCAB = 49152  # the default tokenizer's
RAM = DISK = 1 << 30
CASES_PER_KIND = 8
SLOW_CASES_PER_KIND = 200


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from mlx_lm.tokenizer_utils import load

    return load(default_model_dir)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n).tolist()


PROMPT = _tokens(0, 70)


def _engine(trunk, head, tokenizer, directory=None) -> Engine:
    engine = Engine(
        trunk.model, tokenizer, {}, head=head, depth=2, prompt_cache_bytes=RAM if directory else 0
    )
    if directory is not None:
        engine.use_disk_cache(directory, DISK)
    return engine


def _entries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.glob("*.safetensors") if not p.name.startswith("."))


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def written(request, tokenizer, tmp_path_factory):
    """(trunk, head, the directory one request wrote, a second model's directory, the identity)."""
    trunk, head = make_loop_pair(vocab_size=VOCAB, family=request.param, seed=1, logit_scale=8.0)
    directory = tmp_path_factory.mktemp(f"written-{request.param}")
    engine = _engine(trunk, head, tokenizer, directory)
    engine.generate(PROMPT, max_tokens=4, temperature=0.0)
    assert engine.prompt_cache.disk.flush() and _entries(directory)
    other_trunk, other_head = make_loop_pair(vocab_size=VOCAB, family=request.param, seed=2, logit_scale=8.0)
    foreign = tmp_path_factory.mktemp(f"foreign-{request.param}")
    other = _engine(other_trunk, other_head, tokenizer, foreign)
    other.generate(PROMPT, max_tokens=4, temperature=0.0)
    assert other.prompt_cache.disk.flush() and _entries(foreign)
    identity = cache_identity(fingerprint=engine.fingerprint, trunk=engine.trunk, head=engine.head)
    return trunk, head, directory, foreign, identity


# ---------------------------------------------------------------- the file's layout, and damage


def _split(data: bytes) -> tuple[dict, int]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), 8 + length


def _join(header: dict, data: bytes, data_start: int) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(raw)) + raw + data[data_start:]


def truncate(data: bytes, rng: random.Random, context) -> bytes:
    return data[: rng.randrange(len(data))]


def flip(data: bytes, rng: random.Random, context) -> bytes:
    """1-3 bytes flipped: in the header (a third of the cases) or in the tensor data."""
    out = bytearray(data)
    _, data_start = _split(data)
    for _ in range(rng.randint(1, 3)):
        lo, hi = (8, data_start) if rng.random() < 1 / 3 else (data_start, len(data))
        out[rng.randrange(lo, hi)] ^= rng.randint(1, 255)
    return bytes(out)


def reorder(data: bytes, rng: random.Random, context) -> bytes:
    """Two distinct blocks of the tensor data swapped (what a misordered copy or a bad sector map
    gives): the same bytes, in another order."""
    _, data_start = _split(data)
    size = rng.choice([16, 64, 256])
    while True:
        a, b = sorted(rng.sample(range(data_start, len(data) - size, size), 2))
        if data[a : a + size] != data[b : b + size]:
            break
    return data[:a] + data[b : b + size] + data[a + size : b] + data[a : a + size] + data[b + size :]


def edit_token(data: bytes, rng: random.Random, context) -> bytes:
    """One token id of the entry's key changed (the prompt it claims to be built from)."""
    header, data_start = _split(data)
    meta = header["__metadata__"]
    tokens = json.loads(meta["0.mtplx_tokens"])
    i = rng.randrange(len(tokens))
    tokens[i] = (tokens[i] + rng.randint(1, VOCAB - 1)) % VOCAB
    meta["0.mtplx_tokens"] = json.dumps(tokens)
    return _join(header, data, data_start)


def wrong_key(data: bytes, rng: random.Random, context) -> bytes:
    """The key field set to another configuration's (a hand-copied file, or a bad edit)."""
    header, data_start = _split(data)
    header["__metadata__"]["0.mtplx_key"] = "".join(rng.choice("0123456789abcdef") for _ in range(64))
    return _join(header, data, data_start)


def foreign_model(data: bytes, rng: random.Random, context) -> bytes:
    """Another model's file (same family, other weights) with this configuration's key forged in."""
    other = rng.choice(_entries(context["foreign"])).read_bytes()
    header, data_start = _split(other)
    header["__metadata__"]["0.mtplx_key"] = context["key"]
    return _join(header, other, data_start)


DAMAGE = [truncate, flip, reorder, edit_token, wrong_key, foreign_model]


def _damaged_dir(written, tmp_path: Path, damage, seed: int) -> tuple[Path, Path]:
    """A copy of the written directory with one entry damaged; (directory, damaged file)."""
    _, _, source, foreign, identity = written
    directory = tmp_path / f"{damage.__name__}-{seed}"
    shutil.copytree(source, directory, ignore=shutil.ignore_patterns(".lock"))
    rng = random.Random(seed)
    target = rng.choice(_entries(directory))
    key = DiskTier.key_of(identity)
    before = target.read_bytes()
    after = damage(before, rng, {"foreign": foreign, "key": key})
    assert after != before
    target.write_bytes(after)
    return directory, target


def _served(written, directory: Path) -> bool:
    """Whether a restarted disk tier over ``directory`` serves any part of the prompt."""
    _, _, _, _, identity = written
    tier = DiskTier(directory, DISK, identity)
    hit = tier.load_best(np.array(PROMPT), with_head=True)
    if hit is None:
        hit = tier.load_best(np.array(PROMPT), with_head=False)
    return hit is not None


def _fuzz(written, tmp_path, cases: int) -> list[str]:
    """Every damaged case served (should be none)."""
    served = []
    for damage in DAMAGE:
        for seed in range(cases):
            directory, _ = _damaged_dir(written, tmp_path, damage, seed)
            if _served(written, directory):
                served.append(f"{damage.__name__} seed {seed}")
    return served


def test_undamaged_files_are_served(written, tmp_path):
    """The positive control: what the fuzz damages is served when sound."""
    directory = tmp_path / "copy"
    shutil.copytree(written[2], directory, ignore=shutil.ignore_patterns(".lock"))
    assert _served(written, directory)
    for path in _entries(directory):
        verify(path)


def test_damaged_files_are_never_served(written, tmp_path):
    assert _fuzz(written, tmp_path, CASES_PER_KIND) == []


@pytest.mark.slow
def test_damaged_files_are_never_served_many(written, tmp_path):
    assert _fuzz(written, tmp_path, SLOW_CASES_PER_KIND) == []


def test_without_the_digest_check_the_fuzz_finds_damage_served(written, tmp_path, monkeypatch):
    """The negative control: the check this fuzz is for, switched off, lets damage through."""
    monkeypatch.setattr(prompt_cache_format, "verify", lambda path: None)
    served = _fuzz_kinds(written, tmp_path, [flip, reorder, edit_token], CASES_PER_KIND)
    assert served, "the fuzz cannot see a damaged file served"


def _fuzz_kinds(written, tmp_path, kinds, cases) -> list[str]:
    served = []
    for damage in kinds:
        for seed in range(cases):
            directory, _ = _damaged_dir(written, tmp_path, damage, seed)
            if _served(written, directory):
                served.append(f"{damage.__name__} seed {seed}")
    return served


@pytest.mark.parametrize("damage", [flip, edit_token], ids=["flipped-bytes", "edited-token"])
def test_a_restart_over_a_damaged_entry_answers_as_cold_and_stores_a_sound_one(
    written, tokenizer, tmp_path, damage, caplog
):
    """The issue's two reports: flipped bytes served as garbage and written back; an edited token
    serving a prompt the entry was not built from. The damaged entry is the directory's only one,
    and the prompt is the one it claims to hold, so it is the entry a lookup picks."""
    import logging

    trunk, head, _, _, _ = written
    directory, target = _damaged_dir(written, tmp_path, damage, seed=7)
    for other in _entries(directory):
        if other != target:
            other.unlink()
    header, _ = _split(target.read_bytes())
    prompt = json.loads(header["__metadata__"]["0.mtplx_tokens"])[: len(PROMPT)]
    cold = _engine(trunk, head, tokenizer).generate(prompt, max_tokens=6, temperature=0.0)
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _engine(trunk, head, tokenizer, directory)
        assert len(engine.prompt_cache.disk) == 1  # indexed: only its header was read
        got = engine.generate(prompt, max_tokens=6, temperature=0.0)
        assert engine.prompt_cache.disk.flush()
    assert got.token_ids == cold.token_ids and got.stats.cached_tokens == 0
    lines = [r.getMessage() for r in caplog.records if target.name in r.getMessage()]
    assert len(lines) == 1 and "damaged" in lines[0] and "removed" in lines[0], lines
    assert engine.prompt_cache.disk.stats.removed_files == 1
    assert _entries(directory), "the request's own entry was not written"
    for path in _entries(directory):  # what was written back is sound
        verify(path)
