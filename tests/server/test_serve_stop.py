"""`mtplx serve` stopped while its worker still measures the batch cost profile (the first start
of a model on a machine, `--draft-policy auto`) exits at once: the measurement asks the worker's
stop flag between its timed forwards and gives up, saving nothing, instead of holding the exit
up to the worker's 10 s join. The test hook ``MTPLX_TEST_HOLD_MEASUREMENT`` holds the measurement
at its first forward until the stop, so the SIGTERM lands mid-measurement whatever the load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.server.worker import HOLD_MEASUREMENT_ENV

from support import checkpoints, models
from support.paths import REPO
from support.server import _free_port, wait_for_health
from support.tokenizer import printable_chars


def _tiny_model(root):
    """A tiny random llama over a 97-character tokenizer: it batches, so `auto` measures its profile."""
    chars, vocab = printable_chars()
    path = checkpoints.save_model(root / "tiny-llama", models.tiny_llama(vocab, seed=0), eos_token_id=0).path
    chars.save_pretrained(str(path))
    return path


def test_serve_stopped_mid_measurement_exits_and_saves_no_profile(tmp_path):
    model = _tiny_model(tmp_path)
    config_home, log_path = tmp_path / "config", tmp_path / "serve.log"
    env = dict(
        os.environ, PYTHONPATH=str(REPO), XDG_CONFIG_HOME=str(config_home), **{HOLD_MEASUREMENT_ENV: "1"}
    )
    env.pop("MTPLX_API_KEY", None)
    port = _free_port()
    args = [sys.executable, "-m", "mtplx", "serve", "--model", str(model), "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*args, "--draft-policy", "auto"], stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        wait_for_health(proc, f"http://127.0.0.1:{port}", log_path)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert returncode == 128 + signal.SIGTERM, text
    assert "batch cost profile: measurement stopped (the server is stopping); nothing saved" in text, text
    assert "Traceback" not in text and "generation failed" not in text, text
    store = config_home / "mtplx" / "tune.json"
    entries = json.loads(store.read_text())["entries"] if store.exists() else {}
    assert [key for key, entry in entries.items() if "batch_cost" in entry] == []
