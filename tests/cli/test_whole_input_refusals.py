"""Names and values a user types are checked whole: a regex's ``$`` also matches before a final newline,
so ``.match`` with ``$`` took ``"org/name\\n"`` for a repo id and ``"45m\\n"`` for a budget. Each refusal is
met where a user meets it, through the command line: one line, non-zero exit, no traceback, the odd
character visible (quoted)."""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.forge.config import Budget, parse_budget
from mtplx.model_files.hub import is_repo_id

import pytest
from support.cli import one_line_error, run_main


@pytest.fixture
def offline(monkeypatch):
    """huggingface_hub in offline mode (read at each call): a repo id taken for one never reaches the network."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_a_repo_id_is_the_whole_text():
    assert is_repo_id("tiny-org/MiMo-tiny") and is_repo_id("org/name.v2_x")
    for odd in (
        "org/name\n",
        "org/name\r\n",
        "org/na\nme",
        "org/näme",
        "org/name/extra",
        "./org/name",
        "org/",
    ):
        assert not is_repo_id(odd), odd


@pytest.mark.parametrize(
    "args,expected",
    [
        (
            ["inspect", "tiny-org/not-here\n"],
            "mtplx: error: 'tiny-org/not-here\\n': model directory not found",
        ),
        (
            ["generate", "hi", "--model", "tiny-org/not-here\n"],
            "mtplx: error: 'tiny-org/not-here\\n': model directory not found",
        ),
        (
            ["convert", "tiny-org/not-here\n", "out"],
            "mtplx: error: 'tiny-org/not-here\\n': checkpoint directory not found",
        ),
    ],
)
def test_a_repo_id_with_a_final_newline_is_refused_in_one_line(
    offline, tmp_path, monkeypatch, args, expected
):
    monkeypatch.chdir(tmp_path)  # `convert ... out` writes nothing, but never beside the repository
    assert one_line_error(run_main(*args)) == expected
    assert not (tmp_path / "out").exists()


def test_a_budget_is_the_whole_text():
    assert parse_budget("45m") == parse_budget(" 45 m ") == Budget(seconds=2700)
    assert parse_budget("1.5k") == Budget(tokens=1500)
    for odd in ("45m\n", "\n45m", "45\tm", "45m\r", "٤٥m", "45"):
        with pytest.raises(MtplxError, match="--budget: expected a time"):
            parse_budget(odd)


def test_a_budget_with_a_final_newline_is_refused_in_one_line(offline):
    # --model names no directory: were the budget taken, the model's refusal would be the line instead.
    out = run_main("forge", "--model", "/no/such/model", "--budget", "45m\n")
    assert one_line_error(out) == (
        "mtplx: error: --budget: expected a time (2h, 45m, 90s) or a token count (500k, 3M), got '45m\\n'"
    )
