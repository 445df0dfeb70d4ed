"""Which package hosts a checkpoint's trunk, decided in one place (``BACKENDS``, ``MLX_VLM_TEXT_FAMILIES``).

mtplx runs trunks through mlx-lm. The newest families (Hunyuan-V4 first) have no module in
mlx-lm 0.32 but have one in mlx-vlm 0.7.10, whose ``mlx_vlm/models/<family>/language.py`` holds the
text path; mtplx hosts that language model behind the same trunk contract
(`mtplx.trunk.vlm_text.VlmTextModel`). The rule, as data:

* ``BACKENDS`` in order: the first whose package has a module for the checkpoint's ``model_type``
  (or its ``text_config``'s) hosts it; mlx-vlm only for the families in ``MLX_VLM_TEXT_FAMILIES``
  (text paths this repository checks against mlx-vlm's own forward, ``tests/trunk/test_vlm_text.py``);
* a family mlx-vlm would host but mlx-vlm is not installed: one line naming the type and the
  install command (`backend_for` raises it);
* a hosted family whose mlx-vlm package imports another package that is missing
  (``MLX_VLM_FAMILY_IMPORTS``: Inkling's mlx-audio): one line naming it and its install command;
* a family mlx-vlm has but mtplx does not host yet (``NOT_HOSTED_YET``): one line naming it, both
  versions and what is missing;
* a type neither knows: one line naming it and both packages' versions.

Standard library only (``importlib.util.find_spec``): `mtplx inspect` and `mtplx doctor` decide
without importing MLX.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata

from mtplx.errors import MtplxError

__all__ = [
    "BACKENDS",
    "MLX_LM",
    "MLX_VLM",
    "MLX_VLM_INSTALL",
    "MLX_VLM_FAMILY_IMPORTS",
    "MLX_VLM_REQUIREMENT",
    "MLX_VLM_TEXT_FAMILIES",
    "NOT_HOSTED_YET",
    "TrunkBackend",
    "backend_for",
    "package_version",
]

MLX_VLM_REQUIREMENT = (
    "mlx-vlm==0.7.10"  # the release the hosted families were checked on (pyproject: reference)
)
MLX_VLM_INSTALL = f'pip install --no-deps "{MLX_VLM_REQUIREMENT}"'


@dataclass(frozen=True)
class TrunkBackend:
    """One package mtplx hosts trunks through: ``package`` (its distribution name), ``models``
    (the package holding one module per ``model_type``), ``families`` (the model types it hosts
    for mtplx; None: every type it has a module for)."""

    name: str
    package: str
    models: str
    families: frozenset[str] | None
    install: str

    def installed(self) -> bool:
        return importlib.util.find_spec(self.models.split(".")[0]) is not None

    def has_module(self, model_type: str) -> bool:
        if self.families is not None and model_type not in self.families:
            return False
        if not self.installed():
            return False
        return importlib.util.find_spec(f"{self.models}.{model_type}") is not None

    def would_host(self, model_type: str) -> bool:
        """Hosts ``model_type`` once installed (families listed here; mlx-lm: only if installed)."""
        return self.families is not None and model_type in self.families


# The families mlx-vlm 0.7.10 hosts for mtplx, text path only (`mtplx.trunk.vlm_text`): the
# model type -> what its trunk brings that the trunk contract must respect.
MLX_VLM_TEXT_FAMILIES: dict[str, str] = {
    "hy_v4": "Hunyuan-V4: DeepSeek-V3.2 MLA with the DSA indexer, hyper-connections (hc_mult streams)",
    "deepseek_v4": "DeepSeek-V4: sliding-window attention with compressed (pooled) KV and a sparse indexer, "
    "hyper-connections (hc_mult streams, Sinkhorn-mixed); mlx-vlm's own caches",
    "glm5_next": "GLM-5-Next: gated-delta linear attention (short convolutions) and NoPE MLA sparse attention "
    "with a pooled indexer, hyper-connections (hc_mult streams, averaged before the final norm); mlx-vlm's own caches",
    "minimax_m3": "MiniMax-M3: GQA with a block-sparse indexer (its KV cache keeps the index keys), "
    "sigmoid-routed MoE; mlx-vlm's own caches",
    "qwen4_exp": "Qwen3.8-Flash-Next: gated-delta layers (PLE n-gram embeddings, short convolutions) and "
    "QSA sparse attention, hyper-connections (hc_count streams); mlx-vlm's own caches",
    "inkling": "Inkling: full and sliding-window attention with a learned relative-position mask, four short "
    "convolutions per layer, sigmoid-routed MoE, logits divided by a width multiplier; mlx-vlm's own caches",
}

# Families mlx-vlm 0.7.10 has a module for that mtplx does not host yet: the model type -> what
# is missing (the backend refuses them in one line with this reason, never loads them unchecked).
# None today: Inkling, the last one, is hosted (`mtplx.trunk.vlm_inkling`).
NOT_HOSTED_YET: dict[str, str] = {}

MLX_AUDIO_REQUIREMENT = "mlx-audio==0.6.2"
# Hosted families whose mlx-vlm package imports another package at import time: the model type ->
# (that module, why, how to install it). Installed with --no-deps as mlx-vlm is (Makefile).
MLX_VLM_FAMILY_IMPORTS: dict[str, tuple[str, str, str]] = {
    "inkling": (
        "mlx_audio",
        "mlx-vlm's models/inkling package imports mlx_audio.dsp (its audio front end)",
        f'pip install --no-deps "{MLX_AUDIO_REQUIREMENT}"',
    ),
}

MLX_LM = TrunkBackend("mlx-lm", "mlx-lm", "mlx_lm.models", None, 'pip install "mlx-lm"')
MLX_VLM = TrunkBackend(
    "mlx-vlm", "mlx-vlm", "mlx_vlm.models", frozenset(MLX_VLM_TEXT_FAMILIES), MLX_VLM_INSTALL
)
BACKENDS: tuple[TrunkBackend, ...] = (MLX_LM, MLX_VLM)


def package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _model_types(config: dict) -> list[str]:
    """The checkpoint's model type, then its text config's (mlx-lm's spelling: '-' -> '_')."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    types = [str(c.get("model_type") or "") for c in (config, text)]
    return [t.replace("-", "_") for t in types if t]


def _remapped(model_type: str) -> str:
    """mlx-lm's own renaming of a few model types (``MODEL_REMAPPING``), when mlx-lm is installed."""
    if not MLX_LM.installed():
        return model_type
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


def _check_family_imports(backend: TrunkBackend, model_type: str) -> None:
    """MtplxError (one line) when the package ``backend`` imports for ``model_type`` is not installed."""
    if backend.package != MLX_VLM.package or model_type not in MLX_VLM_FAMILY_IMPORTS:
        return
    module, why, install = MLX_VLM_FAMILY_IMPORTS[model_type]
    if importlib.util.find_spec(module) is None:
        raise MtplxError(
            f"model_type {model_type} is hosted through {backend.name}: {why}, which is not installed "
            f"(install it with: {install})"
        )


def backend_for(config: dict, backends: tuple[TrunkBackend, ...] | None = None) -> tuple[TrunkBackend, str]:
    """The backend hosting a checkpoint with ``config`` (its config.json) and the model type it
    hosts it as; MtplxError (one line) when none can. ``backends``: the rows to decide by
    (``BACKENDS`` unless given)."""
    backends = BACKENDS if backends is None else backends
    types = _model_types(config)
    for backend in backends:
        for model_type in types:
            mt = _remapped(model_type) if backend.package == MLX_LM.package else model_type
            if backend.has_module(mt):
                _check_family_imports(backend, mt)
                return backend, mt
    for backend in backends:
        for model_type in types:
            if backend.would_host(model_type):
                raise MtplxError(
                    f"model_type {model_type} is hosted through {backend.name}, which is not installed "
                    f"(install it with: {backend.install})"
                )
    versions = " nor ".join(f"{b.package} {package_version(b.package)}" for b in backends)
    for model_type in types:
        if model_type in NOT_HOSTED_YET:
            raise MtplxError(
                f"unsupported architecture (model_type {model_type}: neither {versions} hosts it for mtplx yet; "
                f"{NOT_HOSTED_YET[model_type]})"
            )
    shown = " / ".join(dict.fromkeys(types)) or "(none)"
    raise MtplxError(f"unsupported architecture (model_type {shown}: neither {versions} has a model for it)")
