"""`mtplx` answers `--help` and refuses a bad flag or a missing model path before it imports MLX,
mlx-lm or transformers (about 1.5 to 5 s on the 2-core CPU, most of `mtplx inspect`'s time): each
command checks its flags and the model path first (`mtplx.cli.args.check_model_spec`), then imports
what loads the model. One fresh process runs every case through `mtplx.cli.main.main` and lists
the heavy modules loaded after each; a second, with the MLX import planted before a case, is the
control that the listing sees one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.paths import REPO

HEAVY = ("mlx.core", "mlx_lm", "transformers")
_RUN_CASES = """
import contextlib, io, json, sys
from mtplx.cli.main import main
cases, plant = json.loads(sys.argv[1]), sys.argv[2]
out = []
for argv in cases:
    if plant and argv[0] == plant:
        import mlx.core  # the control: what chat and serve imported (through the prompt cache) first
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exit:
            code = exit.code
    heavy = [m for m in HEAVY if m in sys.modules]
    out.append([argv, code, err.getvalue().strip().splitlines()[-1:], heavy])
print(json.dumps(out))
"""


def _run(cases: list[list[str]], plant: str = "") -> list:
    script = f"HEAVY = {HEAVY!r}\n" + _RUN_CASES
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases), plant],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_bad_flags_and_missing_models_import_no_mlx(tmp_path):
    missing = str(tmp_path / "no-such-model")
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    cases = {
        ("--help",): (0, ""),
        ("serve", "--help"): (0, ""),
        ("generate", "--bogus"): (2, "unrecognized arguments: --bogus"),
        ("chat", "--temp", "-1"): (2, "--temp must be >= 0 (got -1)"),
        ("serve", "--port", "99999999"): (2, "--port: must be <= 65535"),
        ("generate", "--model", missing, "hi"): (2, "model directory not found"),
        ("generate", "--model", str(gguf), "hi"): (2, "a GGUF file; convert it first"),
        ("chat", "--model", missing): (2, "model directory not found"),
        ("serve", "--model", missing): (2, "model directory not found"),
        ("inspect", missing): (2, "model directory not found"),
        ("forge", "--model", missing): (2, "model directory not found"),
    }
    results = _run([list(argv) for argv in cases])
    for (argv, (code, message)), (_, got_code, last_line, heavy) in zip(cases.items(), results):
        assert (got_code, heavy) == (code, []), (argv, got_code, last_line, heavy)
        assert message in "".join(last_line), (argv, last_line)


def test_the_listing_sees_mlx_imported_before_a_refusal():
    """Control: the same cases with MLX imported before the chat case (as chat's former first
    import, mtplx.trunk.prompt_cache, did): the listing names it from that case on."""
    results = _run([["serve", "--port", "0"], ["chat", "--temp", "-1"]], plant="chat")
    (_, serve_code, _, serve_heavy), (_, chat_code, _, chat_heavy) = results
    assert (serve_code, serve_heavy, chat_code, chat_heavy) == (2, [], 2, ["mlx.core"])
