"""mtplx.trunk.compat, checked by compat_check: the installed mlx-lm passes, each changed layout fails loudly."""

from __future__ import annotations

import re

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.trunk import compat, compat_check
from mtplx.trunk.compat_probe import parse_version

import mlx.core as mx
import pytest
from support.paths import REPO


def _failure(**changed) -> str:
    with pytest.raises(MtplxError) as raised:
        compat_check.check(**changed)
    message = str(raised.value)
    assert "\n" not in message and "Install mlx-lm>=0.32.2,<0.33.0" in message
    return message


def test_installed_mlx_lm_passes_the_check() -> None:
    compat_check.check()


def test_pyproject_pins_the_range_compat_was_verified_on() -> None:
    pin = re.search(r'"mlx-lm>=([\d.]+),<([\d.]+)"', (REPO / "pyproject.toml").read_text())
    assert pin is not None
    low, high = compat_check.SUPPORTED_MLX_LM
    assert parse_version(pin.group(1)) == low and parse_version(pin.group(2)) == high


def test_a_release_outside_the_range_is_refused() -> None:
    assert "version 0.33.0 is outside" in _failure(version="0.33.0")
    assert "version 0.31.9 is outside" in _failure(version="0.31.9")
    compat_check.check(version="0.32.9")  # negative control: inside the range passes


class _KVWithExtraField(compat.KVCache):
    @property
    def state(self):
        return self.keys, self.values, self.offset, "step"

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, _ = v


class _KVReordered(compat.KVCache):
    @property
    def state(self):
        return self.offset, self.keys, self.values

    @state.setter
    def state(self, v):
        self.offset, self.keys, self.values = v


class _KVWithoutTrim(compat.KVCache):
    def trim(self, n):
        return 0


def test_a_changed_kv_cache_layout_is_named() -> None:
    assert "_KVWithExtraField.state has 4 fields" in _failure(kv_cls=_KVWithExtraField)
    assert "_KVReordered.state is no longer (keys, values, offset)" in _failure(kv_cls=_KVReordered)
    assert "_KVWithoutTrim.trim(n)" in _failure(trimmable_classes=(_KVWithoutTrim,))


class _RotatingReordered(compat.RotatingKVCache):
    @property
    def state(self):
        return self.keys, self.values, self._idx, self.offset, self.keep, self.max_size

    @state.setter
    def state(self, v):
        self.keys, self.values, self._idx, self.offset, self.keep, self.max_size = v


def test_a_changed_rotating_cache_layout_is_named() -> None:
    message = _failure(rotating_cls=_RotatingReordered)
    assert "_RotatingReordered.state is no longer (keys, values, offset, keep, max_size, _idx)" in message


class _ArraysReordered(compat.ArraysCache):
    @property
    def state(self):
        return self.left_padding, self.cache, self.lengths

    @state.setter
    def state(self, v):
        self.left_padding, self.cache, self.lengths = v


class _ArraysWithoutPrepare(compat.ArraysCache):
    def prepare(self, lengths=None, **kwargs):
        return None


def test_a_changed_arrays_cache_is_named() -> None:
    assert "_ArraysReordered.state is no longer (slots, left_padding, lengths)" in _failure(
        arrays_cls=_ArraysReordered
    )
    assert "prepare(lengths=...)" in _failure(arrays_cls=_ArraysWithoutPrepare)


def test_a_changed_gated_delta_interface_is_named() -> None:
    def renamed(q, k, v, g, beta, state=None, mask=None):
        return v, state

    assert "gated_delta_update takes" in _failure(gated_delta_update=renamed)
    assert "mlx_lm.models.no_such_model is gone" in _failure(
        recurrent_modules=("mlx_lm.models.no_such_model",)
    )
    # A model module that stopped importing the function by name cannot be hooked.
    assert "mlx_lm.models.llama no longer calls a module-level gated_delta_update" in _failure(
        recurrent_modules=("mlx_lm.models.llama",)
    )


def test_a_changed_attention_mask_signature_is_named() -> None:
    def mask(h, cache=None, return_array=False):
        return None

    assert "create_attention_mask takes" in _failure(mask_fn=mask)


def test_every_problem_is_listed_in_one_message() -> None:
    message = _failure(version="0.40.0", kv_cls=_KVReordered, rotating_cls=_RotatingReordered)
    assert message.count(";") >= 2


def test_norm_tap_records_and_untapped_call_does_not() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    norm = nn.RMSNorm(4)
    weights_before = dict(norm.parameters())
    tap = compat.tap_final_norm(norm)
    assert compat.tap_final_norm(norm) is tap  # once per norm
    x = mx.random.normal((1, 2, 4))
    out = norm(x)
    assert tap.pre is x and tap.post is out
    y = mx.random.normal((1, 1, 4))
    plain = compat.untapped_norm(norm, y)
    assert tap.pre is x  # not overwritten
    assert mx.allclose(plain, nn.RMSNorm(4)(y)).item()
    assert dict(norm.parameters()).keys() == weights_before.keys()  # parameter tree unchanged


class _KVInADict(compat.KVCache):
    """Buffers behind a dict: a copy of the instance attributes would share them."""

    def __init__(self):
        self.store = {"keys": None, "values": None}
        self.offset = 0

    keys = property(lambda self: self.store["keys"], lambda self, v: self.store.__setitem__("keys", v))
    values = property(lambda self: self.store["values"], lambda self, v: self.store.__setitem__("values", v))


def test_a_cache_whose_copy_is_not_independent_is_named() -> None:
    message = _failure(kv_cls=_KVInADict)
    assert "a copied _KVInADict changes when the original is updated" in message
    kv = compat.KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 2, 2)), mx.zeros((1, 1, 2, 2)))
    (copied,) = compat.copy_cache([kv])
    kv.update_and_fetch(mx.ones((1, 1, 1, 2)), mx.ones((1, 1, 1, 2)))
    assert copied.offset == 2 and kv.offset == 3
    assert float(mx.abs(copied.keys).sum()) == 0.0 and float(mx.abs(kv.keys).sum()) > 0.0


def _draws_after(seed: int, between) -> list[float]:
    """Three normals drawn after ``mx.random.seed(seed)`` and then ``between()``."""
    mx.random.seed(seed)
    between()
    return mx.random.normal((3,)).tolist()


def test_the_probes_leave_the_callers_random_state_as_it_was() -> None:
    """The Nemotron-H probe builds a model, whose init draws from MLX's global random state: the
    caller's seeded sequence goes on as if the check had not run, in ``check()`` and in the first
    ``Trunk`` of a process (``check_once``). Control: the probe's model built bare does move it."""
    from mtplx.trunk.compat_nemotron import check_ssm
    from mtplx.trunk.model import Trunk

    from support import models

    model = models.rollback_model("llama")
    undisturbed = _draws_after(7, lambda: None)
    assert _draws_after(7, compat_check.check) == undisturbed
    compat_check.check_once.cache_clear()  # as in a process that wraps its first model now
    assert _draws_after(7, lambda: Trunk(model)) == undisturbed
    assert _draws_after(7, check_ssm) != undisturbed  # the draw the check undoes
