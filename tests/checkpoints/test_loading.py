"""Model resolution, the default model cache, and load errors (real files, no mocks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.checkpoints.load import LoadedModel, default_model_dir, load_model, resolve_model
from mtplx.errors import MtplxError
from mtplx.resources import cache_root

import pytest
from mlx_lm import generate
from mlx_lm.tokenizer_utils import TokenizerWrapper
from support.paths import REPO


@pytest.fixture(scope="module")
def q4_cache(tmp_path_factory) -> Path:
    """A private cache holding the default model's q4 build (fast to convert: the 4-bit blocks are copied)."""
    cache = tmp_path_factory.mktemp("mtplx-cache")
    default_model_dir("q4", cache_dir=cache)
    return cache


@pytest.fixture(scope="module")
def q4_dir(q4_cache) -> Path:
    return default_model_dir("q4", cache_dir=q4_cache)


def _greedy(loaded: LoadedModel, prompt: str, n: int = 6) -> str:
    # mlx-lm's default sampler is argmax; its KV cache keeps the 4-bit build quick on CPU.
    return generate(loaded.model, loaded.tokenizer, prompt, max_tokens=n)


@pytest.fixture(scope="module")
def default_loaded(default_model_dir) -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="module")
def q4_loaded(q4_dir, q4_cache) -> LoadedModel:
    return load_model(None, variant="q4", cache_dir=q4_cache)


def _one_line_error_naming(excinfo, name: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message and name in message, message


# ---------------------------------------------------------------- the default model


def test_load_default_model(default_loaded, default_model_dir):
    assert default_loaded.path == default_model_dir
    assert isinstance(default_loaded.tokenizer, TokenizerWrapper)
    assert default_loaded.config["num_hidden_layers"] == 30 and "quantization" not in default_loaded.config
    assert len(default_loaded.fingerprint) == 16 and int(default_loaded.fingerprint, 16) >= 0
    assert "Paris" in _greedy(default_loaded, "The capital of France is")


def test_q4_variant_loads_quantized(q4_loaded, q4_dir, q4_cache):
    assert q4_loaded.path == q4_dir and q4_dir.parent == q4_cache / "models"
    assert q4_loaded.config["quantization"]["bits"] == 4
    assert type(q4_loaded.model.model.layers[0].self_attn.q_proj).__name__ == "QuantizedLinear"
    assert "Paris" in _greedy(q4_loaded, "The capital of France is")


def test_fingerprint_is_stable_and_tells_variants_apart(default_loaded, q4_loaded, q4_dir):
    assert default_loaded.fingerprint != q4_loaded.fingerprint
    assert load_model(q4_dir).fingerprint == q4_loaded.fingerprint


def test_second_use_reuses_the_cache(q4_cache, q4_dir):
    weights = q4_dir / "model.safetensors"
    before = (q4_dir.stat().st_ino, weights.stat().st_ino, weights.stat().st_mtime_ns)
    assert default_model_dir("q4", cache_dir=q4_cache) == q4_dir
    assert (q4_dir.stat().st_ino, weights.stat().st_ino, weights.stat().st_mtime_ns) == before


def test_damaged_cache_entry_is_rebuilt(tmp_path):
    first = default_model_dir("q4", cache_dir=tmp_path)
    (first / "model.safetensors").unlink()
    again = default_model_dir("q4", cache_dir=tmp_path)
    assert again == first and (again / "model.safetensors").is_file()


def test_concurrent_first_use_converts_once(tmp_path):
    """Two processes race to convert; both get the same complete directory, no temp dirs remain."""
    # Both say when their (slow) imports are done and wait for one go, given to both at once, so
    # the first uses really overlap (a fixed start time idled whenever the imports were quicker);
    # without the lock the loser's convert_gguf would find the output existing and fail.
    code = (
        "import sys, mtplx; from mtplx.checkpoints.load import default_model_dir;"
        "print('ready', flush=True); sys.stdin.readline();"
        "p = default_model_dir('q4', cache_dir=sys.argv[1]);"
        "print(p, (p / 'model.safetensors').stat().st_ino)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    ready = [p.stdout.readline() for p in procs]
    if ready != ["ready\n"] * 2:  # one failed to start: the other would wait for its go forever
        for p in procs:
            p.kill()
        pytest.fail(f"a process did not start: {ready}")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    outputs = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outputs[0] == outputs[1]  # same path and same weights file (one conversion, no replacement)
    names = sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock"))
    assert names == [Path(outputs[0][0]).name]


def test_mtplx_cache_env_var_sets_cache_root(tmp_path):
    code = "import mtplx; from mtplx.resources import cache_root; print(cache_root())"
    env = {**os.environ, "PYTHONPATH": str(REPO), "MTPLX_CACHE": str(tmp_path / "elsewhere")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == str(tmp_path / "elsewhere")
    assert cache_root(tmp_path) == tmp_path  # the explicit argument wins


def test_unknown_variant():
    with pytest.raises(MtplxError, match="variant 'int2'"):
        default_model_dir("int2")


# ---------------------------------------------------------------- resolving specs


def test_resolve_local_dir(q4_dir):
    assert resolve_model(q4_dir) == q4_dir
    assert resolve_model(str(q4_dir)) == q4_dir


def _hub_cache_with(model_dir: Path, hub: Path, repo_id: str) -> None:
    """Lay a model out the way huggingface_hub caches a download (blobs are plain copies here)."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        os.link(f, snapshot / f.name)  # hard link: instant, no extra disk
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_resolve_repo_id_from_hub_cache(q4_dir, tmp_path):
    _hub_cache_with(q4_dir, tmp_path / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct")
    path = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", hub_cache=tmp_path / "hub")
    assert path.parts[-2:-1] == ("snapshots",) and (path / "config.json").is_file()
    loaded = load_model("HuggingFaceTB/SmolLM2-135M-Instruct", hub_cache=tmp_path / "hub")
    assert loaded.config["quantization"]["bits"] == 4


def test_repo_id_not_in_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # offline mode: refused without a network call
    with pytest.raises(MtplxError, match="not in the Hugging Face cache and offline mode is on") as e:
        resolve_model("someone/not-downloaded", hub_cache=tmp_path)
    _one_line_error_naming(e, "someone/not-downloaded")


# ---------------------------------------------------------------- bad model directories


def test_missing_dir(tmp_path):
    with pytest.raises(MtplxError, match="not found") as e:
        load_model(tmp_path / "no-such-model")
    _one_line_error_naming(e, "no-such-model")


def test_gguf_spec_points_to_convert(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(MtplxError, match="mtplx convert") as e:
        load_model(tmp_path / "m.gguf")
    _one_line_error_naming(e, "m.gguf")


@pytest.fixture
def copy_of(q4_dir, tmp_path):
    """A writable copy of the q4 model (weights hard-linked unless a test replaces them)."""
    dst = tmp_path / "model"
    dst.mkdir()
    for f in q4_dir.iterdir():
        shutil.copy(f, dst / f.name) if f.suffix == ".json" else os.link(f, dst / f.name)
    return dst


def test_missing_config(copy_of):
    (copy_of / "config.json").unlink()
    with pytest.raises(MtplxError, match="missing") as e:
        load_model(copy_of)
    _one_line_error_naming(e, "config.json")


def test_missing_weights(copy_of):
    (copy_of / "model.safetensors").unlink()
    with pytest.raises(MtplxError, match="no model") as e:
        load_model(copy_of)
    _one_line_error_naming(e, str(copy_of))


def test_truncated_safetensors(copy_of):
    weights = copy_of / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # break the hard link before writing
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(MtplxError, match="truncated") as e:
        load_model(copy_of)
    _one_line_error_naming(e, "model.safetensors")


def test_corrupt_safetensors_header(copy_of):
    weights = copy_of / "model.safetensors"
    data = bytearray(weights.read_bytes())
    weights.unlink()
    data[8:40] = b"\xff" * 32  # garbage inside the JSON header
    weights.write_bytes(bytes(data))
    with pytest.raises(MtplxError, match="corrupt") as e:
        load_model(copy_of)
    _one_line_error_naming(e, "model.safetensors")


@pytest.mark.parametrize(
    "change", [{"num_hidden_layers": 31}, {"intermediate_size": 2048}], ids=["layers", "shape"]
)
def test_config_weights_mismatch(copy_of, change):
    config = json.loads((copy_of / "config.json").read_text())
    (copy_of / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(MtplxError, match="do not match config.json") as e:
        load_model(copy_of)
    _one_line_error_naming(e, str(copy_of))


def test_unsupported_model_type(copy_of):
    config = json.loads((copy_of / "config.json").read_text())
    (copy_of / "config.json").write_text(json.dumps({**config, "model_type": "no_such_arch"}))
    with pytest.raises(MtplxError, match="unsupported architecture") as e:
        load_model(copy_of)
    _one_line_error_naming(e, "no_such_arch")
