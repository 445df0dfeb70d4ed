"""Fine-tuned adapters (`--adapter-path`, `Engine.load(adapter_path=...)`) on the default model.

The adapters are real mlx_lm.lora output (LoRA layers on the last blocks, adapters.safetensors
and adapter_config.json) with random non-zero B matrices, as after training; the reference is
mlx-lm itself loading the same directory. Bad directories are one-line errors.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.checkpoints.load import load_model
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model as mlx_lm_load_model
from support.cli import one_line_error, run_main
from support.seeds import FRESH, resolve

PROMPT = "The three most useful Python data structures are"
TOKENS = 16
LORA = {"rank": 8, "scale": 20.0, "dropout": 0.0}


def write_adapter(model_dir: Path, out: Path, seed: int, kind: str = "lora", num_layers: int = 4) -> Path:
    """An adapter directory as `mlx_lm.lora` writes it, with trained-looking (non-zero) B."""
    model, _ = mlx_lm_load_model(model_dir)
    linear_to_lora_layers(model, num_layers, LORA, use_dora=kind == "dora")
    rng = np.random.default_rng(seed)
    adapters = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(".lora_b"):
            value = mx.array(rng.normal(0.0, 0.02, value.shape).astype(np.float32))
        if name.endswith((".lora_a", ".lora_b", ".m")):  # m: DoRA's magnitudes
            adapters[name] = value
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), adapters)
    config = {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": LORA}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(
    scope="module",
    params=[
        pytest.param((0, "lora"), id="lora-seed0"),
        pytest.param((FRESH, "dora"), id="dora-fresh"),
    ],
)
def adapter_dir(request, tmp_path_factory, default_model_dir) -> Path:
    seed, kind = resolve(request.param[0]), request.param[1]
    if (seed, kind) == (0, "lora"):  # the same files as `fixed_adapter`: written once
        return request.getfixturevalue("fixed_adapter")
    return write_adapter(default_model_dir, tmp_path_factory.mktemp(f"adapter-{seed}") / kind, seed, kind)


@functools.cache
def mlx_lm_greedy(model_dir: Path, adapter: Path | None) -> tuple[list[int], str]:
    """mlx-lm's own greedy tokens for PROMPT (with ``adapter``) and their text; computed once per
    (model, adapter) in the module: the fixed adapter's is the reference of two tests."""
    model, tokenizer = mlx_lm_load(str(model_dir), adapter_path=None if adapter is None else str(adapter))
    # mlx-lm yields the end-of-sequence token last (finish_reason "stop"); mtplx's token_ids hold
    # the generated text's tokens only, so the stop token is left off the reference.
    responses = list(stream_generate(model, tokenizer, PROMPT, max_tokens=TOKENS))
    tokens = [r.token for r in responses if r.finish_reason != "stop"]
    return tokens, tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def fixed_adapter(tmp_path_factory, default_model_dir) -> Path:
    return write_adapter(default_model_dir, tmp_path_factory.mktemp("adapter-fixed") / "lora", 0)


@pytest.fixture(scope="module")
def base_greedy(default_model_dir) -> list[int]:
    return mlx_lm_greedy(default_model_dir, None)[0]


def test_greedy_output_is_mlx_lms_own_adapted_model(adapter_dir, default_model_dir, base_greedy):
    expected, _ = mlx_lm_greedy(default_model_dir, adapter_dir)
    # Negative control: the adapter changes the text, so equality below says it was applied.
    assert base_greedy != expected
    engine = Engine.load(adapter_path=adapter_dir, depth=2)
    assert engine.has_head  # the head forged for the base model drafts for the adapted one
    for draft in ("none", "head"):  # "auto" adds lookup, whose exactness test_drafters covers
        result = engine.generate(PROMPT, chat=False, max_tokens=TOKENS, draft=draft)
        assert result.token_ids == expected, draft


def _bad(tmp_path: Path, adapter_dir: Path, case: str) -> Path:
    """A broken copy of ``adapter_dir``."""
    bad = tmp_path / case
    if case == "missing":
        return bad
    bad.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    weights = (adapter_dir / "adapters.safetensors").read_bytes()
    if case == "no-weights":
        (bad / "adapter_config.json").write_text(json.dumps(config))
        return bad
    (bad / "adapters.safetensors").write_bytes(weights)
    if case == "config-not-json":
        (bad / "adapter_config.json").write_text("{not json")
    elif case == "config-without-lora":
        (bad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora", "num_layers": 4}))
    elif case == "other-rank":
        (bad / "adapter_config.json").write_text(
            json.dumps({**config, "lora_parameters": {**LORA, "rank": 4}})
        )
    elif case == "truncated-weights":
        (bad / "adapter_config.json").write_text(json.dumps(config))
        (bad / "adapters.safetensors").write_bytes(weights[: len(weights) // 2])
    return bad


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "adapter directory not found"),
        ("no-weights", "no adapters.safetensors"),
        ("config-not-json", "not valid JSON"),
        ("config-without-lora", "lacks a LoRA setting"),
        ("other-rank", "do not fit this model"),
        ("truncated-weights", "cannot load adapters"),
    ],
)
def test_bad_adapter_directories_are_one_line_errors(
    tmp_path, fixed_adapter, default_model_dir, case, needle
):
    bad = _bad(tmp_path, fixed_adapter, case)
    with pytest.raises(MtplxError) as excinfo:
        load_model(default_model_dir, adapter_path=bad)
    message = str(excinfo.value)
    assert "\n" not in message and str(bad) in message and needle in message, message


def test_cli_generate_with_an_adapter_and_a_bad_one(fixed_adapter, default_model_dir, tmp_path):
    _, expected = mlx_lm_greedy(default_model_dir, fixed_adapter)
    run = ("generate", PROMPT, "--raw", "-m", str(TOKENS))
    good = run_main(*run, "--adapter-path", str(fixed_adapter))
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == expected.strip()
    missing = tmp_path / "no-adapter"
    assert str(missing) in one_line_error(run_main(*run, "--adapter-path", str(missing)))
    assert str(missing) in one_line_error(run_main("serve", "--port", "1", "--adapter-path", str(missing)))


def test_adapters_are_refused_when_sharded(fixed_adapter):
    with pytest.raises(MtplxError, match="mlx_lm.fuse"):
        Engine.load(adapter_path=fixed_adapter, distributed="pipeline")
