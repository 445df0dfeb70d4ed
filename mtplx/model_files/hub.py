"""Hugging Face Hub resolution: a repo id to a local snapshot directory, from the hub cache when
it is there, else downloaded with huggingface_hub (its own progress bars), unless offline mode is
on (``HF_HUB_OFFLINE=1``). Every failure is one line naming the repo id.
"""

from __future__ import annotations

import re
from pathlib import Path

from mtplx.errors import MtplxError, first_line

__all__ = ["HUB_ALLOW_PATTERNS", "REPO_ID", "hub_offline", "is_repo_id", "snapshot_dir"]

# Whole ids only (fullmatch: a "$" would pass "org/name\n"); ASCII, as the Hub's names are.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", re.ASCII)


# The files an mlx-lm model directory needs (mlx_lm/utils.py get_model_path downloads the same kinds).
HUB_ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)


def snapshot_dir(repo_id: str, hub_cache: str | Path | None) -> Path:
    """The repo's snapshot directory: from the hub cache, else downloaded (huggingface_hub's progress bars)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:  # cached: no network round trip at all
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=hub_cache))
    except Exception:  # LocalEntryNotFoundError and kin: not (fully) cached
        pass
    if hub_offline():
        raise MtplxError(
            f"{repo_id}: not in the Hugging Face cache and offline mode is on (HF_HUB_OFFLINE); "
            "unset it to download, or pass a local directory"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=hub_cache, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except (RepositoryNotFoundError, GatedRepoError):
        raise MtplxError(
            f"{repo_id}: not found on the Hugging Face Hub (or gated/private: log in with `hf auth login`)"
        ) from None
    except Exception as e:  # no network, Hub down, disk full, ...
        cause = e.__cause__ or e
        raise MtplxError(
            f"{repo_id}: not in the Hugging Face cache and the download failed "
            f"({type(cause).__name__}: {first_line(cause)})"
        ) from None


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def is_repo_id(spec: str) -> bool:
    """``spec`` reads as a Hub repo id (``owner/name``), not a relative path."""
    return bool(REPO_ID.fullmatch(spec)) and not spec.startswith((".", "~"))
