"""compat's Nemotron-H part: mtplx's contacts with mlx-lm's Nemotron-H internals (mlx-lm 0.32.2
``mlx_lm/models/nemotron_h.py`` and ``mlx_lm/models/ssm.py``), kept beside ``compat.py``;
``compat_check.check()`` runs its probes (``check_ssm``). With ``compat.py`` it is the only module
that touches mlx-lm internals.

* Names: Nemotron-H's inner model is ``model.backbone`` with ``embeddings``, ``layers`` and
  ``norm_f`` where the other families have ``model.model`` with ``embed_tokens``, ``layers``,
  ``norm`` (``INNER_SPELLINGS``; ``embedding_of`` / ``final_norm_of`` read either).

* SSM-state capture: the Mamba2 mixers of the modules in ``SUPPORTED_SSM_MODULES`` call their
  module-level name ``ssm_update(hidden_states, A_log, B, C, D, dt, dt_bias, state,
  time_step_limit, mask)`` with the state read from cache slot 1 unchanged, and store what it
  returns there; ``install_ssm_hook`` rebinds that name to a wrapper
  (``mtplx.trunk.recurrent_capture.capturing_ssm_update``), as ``compat.install_gated_delta_hook`` does
  for the gated-delta layers. The conv state (slot 0) honours ``cache.lengths`` exactly as the
  gated-delta layers do (rows ``[len, len + kernel - 1)`` of ``[conv state, block]``), so the
  existing conv capture serves.
* Cache alignment: Nemotron-H's ``make_cache`` builds one cache per Mamba2 (``M``) and attention
  (``*``) block only; its MLP (``-``) and MoE (``E``) blocks have none, so cache ``i`` is not
  layer ``i``. ``cache_layers`` gives the layer each cache belongs to.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from mtplx.trunk.compat_probe import check_hooked_function

import mlx.nn as nn
from mlx_lm.models import ssm as _ssm

__all__ = [
    "INNER_SPELLINGS",
    "ORIGINAL_SSM_UPDATE",
    "SUPPORTED_SSM_MODULES",
    "cache_layers",
    "check_ssm",
    "embedding_of",
    "final_norm_of",
    "install_ssm_hook",
]

# Modules whose Mamba2 mixers read slot 0 = conv state (honouring ``cache.lengths``), slot 1 =
# SSM state, passing slot 1 unchanged into their module-level ``ssm_update``.
SUPPORTED_SSM_MODULES = ("mlx_lm.models.nemotron_h",)
# mlx-lm's own function; the hook's wrapper calls it.
ORIGINAL_SSM_UPDATE = _ssm.ssm_update
_SSM_PARAMETERS = (
    "hidden_states",
    "A_log",
    "B",
    "C",
    "D",
    "dt",
    "dt_bias",
    "state",
    "time_step_limit",
    "mask",
)
# (token embedding, layers, final norm) attribute names of an inner model: most families', then
# Nemotron-H's (``nemotron_h.NemotronHModel``, at ``Model.backbone``).
INNER_SPELLINGS = (("embed_tokens", "layers", "norm"), ("embeddings", "layers", "norm_f"))
INNER_PATH = ("backbone",)  # where Nemotron-H's Model keeps its inner model
# Nemotron-H block types that own a cache (mlx-lm ``nemotron_h.Model.make_cache``).
_CACHED_BLOCK_TYPES = ("M", "*")


def install_ssm_hook(wrapper: Callable) -> None:
    """Rebind ``ssm_update`` in the supported, already-imported model modules to ``wrapper``.

    Idempotent; the wrapper must pass every call it does not capture straight through.
    """
    for name in SUPPORTED_SSM_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "ssm_update", None) is ORIGINAL_SSM_UPDATE:
            module.ssm_update = wrapper


def embedding_of(inner: nn.Module) -> nn.Module:
    """The token embedding of an inner model (``compat.find_inner_model``), by either spelling."""
    return next(getattr(inner, names[0]) for names in INNER_SPELLINGS if hasattr(inner, names[0]))


def final_norm_of(inner: nn.Module) -> nn.Module:
    """The final norm of an inner model (``compat.find_inner_model``), by either spelling."""
    return next(getattr(inner, names[2]) for names in INNER_SPELLINGS if hasattr(inner, names[2]))


def cache_layers(model: nn.Module) -> list:
    """The layer each entry of ``model.make_cache()`` belongs to, in order: every layer, but for a
    Nemotron-H model (layers with a ``block_type``) only its Mamba2 and attention blocks."""
    layers = list(model.layers)
    if layers and all(isinstance(getattr(layer, "block_type", None), str) for layer in layers):
        return [layer for layer in layers if layer.block_type in _CACHED_BLOCK_TYPES]
    return layers


def check_ssm(
    update: Callable = ORIGINAL_SSM_UPDATE, module_names: Sequence[str] = SUPPORTED_SSM_MODULES
) -> list[str]:
    """What the installed mlx-lm changed of the layout above (empty when nothing)."""
    problems = check_hooked_function("ssm_update", update, _SSM_PARAMETERS, module_names)
    for name in module_names:
        try:
            module = __import__(name, fromlist=["_"])
        except ImportError:
            continue  # reported above
        problems += _check_structure(module)
    return problems


# A two-block Nemotron-H (a Mamba2 block, then an MLP block: the one without a cache) at the
# smallest sizes mlx-lm accepts; built by ``_check_structure`` (once per process, milliseconds).
_PROBE_CONFIG = {
    "model_type": "nemotron_h",
    "vocab_size": 4,
    "hidden_size": 8,
    "intermediate_size": 8,
    "max_position_embeddings": 8,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "attention_bias": False,
    "mamba_num_heads": 2,
    "mamba_head_dim": 4,
    "mamba_proj_bias": False,
    "ssm_state_size": 4,
    "conv_kernel": 2,
    "n_groups": 1,
    "mlp_bias": False,
    "layer_norm_epsilon": 1e-5,
    "use_bias": False,
    "use_conv_bias": True,
    "hybrid_override_pattern": "M-",
}


def _check_structure(module) -> list[str]:
    """The names and the cache list this module documents, on a model the module builds."""
    model = module.Model(module.ModelArgs.from_dict(_PROBE_CONFIG))
    inner = getattr(model, INNER_PATH[0], None)
    if inner is None or not all(hasattr(inner, a) for a in INNER_SPELLINGS[1]):
        return [f"{module.__name__}.Model no longer keeps backbone.embeddings / layers / norm_f"]
    cache = model.make_cache()
    if [layer.block_type for layer in cache_layers(model)] != ["M"] or len(cache) != 1:
        return [f"{module.__name__}: the cache list no longer holds one entry per Mamba2 / attention block"]
    if len(getattr(cache[0], "cache", ())) != 2:
        return [f"{module.__name__}: a Mamba2 block's cache no longer has two slots (conv, SSM state)"]
    return []
