"""mtplx.io: the one atomic-write helper (temp name beside the target, rename on success)."""

from __future__ import annotations

import os
import stat

from mtplx.io import atomic_path, atomic_write

import pytest


def test_atomic_path_keeps_the_suffix_and_renames_on_success(tmp_path) -> None:
    target = tmp_path / "sub" / "head.safetensors"
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp.suffix == ".safetensors" and tmp != target
        tmp.write_bytes(b"new")
        assert not target.exists()  # nothing visible before the rename
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["head.safetensors"]


def test_atomic_path_failure_leaves_the_old_file_and_no_temp(tmp_path) -> None:
    target = tmp_path / "manifest.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_permissions_follow_the_umask_not_mkstemp(tmp_path) -> None:
    old_umask = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "a.json") as handle:
            handle.write("{}")
        with atomic_path(tmp_path / "prog.bin", 0o777) as tmp:
            tmp.write_bytes(b"\x7fELF")
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "prog.bin").stat().st_mode) == 0o755


def test_atomic_write_refuses_read_modes(tmp_path) -> None:
    with pytest.raises(ValueError, match="mode"):
        with atomic_write(tmp_path / "x", "r"):
            pass
