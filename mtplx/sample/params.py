"""`SamplerConfig`: how logits become a distribution (docs/sampling.md).

The one small module both the MLX runtime (`mtplx.sample.ops`, `mtplx.sample.rejection`,
the decode loop) and the NumPy oracle (`mtplx.sample.reference`) read, so the runtime never
imports the oracle. Imports the standard library only.

Validation errors name the field the way a caller spells it in the API
(``temperature must be >= 0 (got -1.0)``); the CLI maps them to flag names.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from mtplx.errors import MtplxError

__all__ = ["REPETITION_PENALTY_RANGE", "SamplerConfig", "Setting", "integer_value", "real_value"]


def real_value(name: str, value: object) -> float:
    """``value`` as a finite float, else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MtplxError(f"{name} must be a number (got {value!r})")
    as_float = float(value)
    if not math.isfinite(as_float):
        raise MtplxError(f"{name} must be finite (got {value!r})")
    return as_float


def integer_value(name: str, value: object) -> int:
    """``value`` as an int (not a bool), else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MtplxError(f"{name} must be an integer (got {value!r})")
    return int(value)


# The penalised logits are z / p and z * p in float32: a penalty much further from 1 overflows
# them (a denormal p made every logit inf) and is a ban, not a penalty, long before that.
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
# Temperatures below / above these overflow float32 logits (0 is greedy): inf - inf draws NaN tokens.
TEMPERATURE_RANGE = (1e-6, 1e6)


@dataclass(frozen=True)
class SamplerConfig:
    """How logits become a distribution (docs/sampling.md). Immutable and hashable."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = field(default=None)

    def __post_init__(self) -> None:
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        temperature = real_value("temperature", self.temperature)
        if temperature < 0:
            raise MtplxError(f"temperature must be >= 0 (got {self.temperature!r})")
        if temperature != 0 and not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:
            low, high = TEMPERATURE_RANGE
            raise MtplxError(
                f"temperature must be 0 (greedy) or in [{low:g}, {high:g}] (got {self.temperature!r})"
            )
        top_p = real_value("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise MtplxError(f"top_p must be in (0, 1] (got {self.top_p!r})")
        top_k = integer_value("top_k", self.top_k)
        if top_k < 0:
            raise MtplxError(f"top_k must be >= 0, 0 disables it (got {self.top_k!r})")
        min_p = real_value("min_p", self.min_p)
        if not 0.0 <= min_p < 1.0:
            raise MtplxError(f"min_p must be in [0, 1) (got {self.min_p!r})")
        repetition_penalty = real_value("repetition_penalty", self.repetition_penalty)
        if not REPETITION_PENALTY_RANGE[0] <= repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            low, high = REPETITION_PENALTY_RANGE
            raise MtplxError(
                f"repetition_penalty must be in [{low:g}, {high:g}] (got {self.repetition_penalty!r})"
            )
        repetition_context_size = integer_value("repetition_context_size", self.repetition_context_size)
        if repetition_context_size < 0:
            raise MtplxError(f"repetition_context_size must be >= 0 (got {self.repetition_context_size!r})")
        presence_penalty = real_value("presence_penalty", self.presence_penalty)
        frequency_penalty = real_value("frequency_penalty", self.frequency_penalty)
        set_field("temperature", temperature)
        set_field("top_p", top_p)
        set_field("top_k", top_k)
        set_field("min_p", min_p)
        set_field("repetition_penalty", repetition_penalty)
        set_field("repetition_context_size", repetition_context_size)
        set_field("presence_penalty", presence_penalty)
        set_field("frequency_penalty", frequency_penalty)
        set_field("logit_bias", self._validated_bias(self.logit_bias))

    @staticmethod
    def _validated_bias(bias: Mapping[int, float] | None) -> Mapping[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise MtplxError(f"logit_bias must be a mapping token_id -> bias (got {bias!r})")
        checked: dict[int, float] = {}
        for token, value in bias.items():
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise MtplxError(f"logit_bias keys must be token ids >= 0 (got {token!r})")
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise MtplxError(f"logit_bias[{token}] must be a finite number (got {value!r})")
            checked[int(token)] = float(value)
        # Read-only, so a config cannot change under a cache keyed by it.
        return MappingProxyType(dict(sorted(checked.items()))) if checked else None

    def __hash__(self) -> int:
        bias_items = tuple(self.logit_bias.items()) if self.logit_bias else ()
        return hash(
            (
                self.temperature,
                self.top_p,
                self.top_k,
                self.min_p,
                self.repetition_penalty,
                self.repetition_context_size,
                self.presence_penalty,
                self.frequency_penalty,
                bias_items,
            )
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0 and self.repetition_context_size > 0

    @property
    def has_penalties(self) -> bool:
        """False exactly when the penalty/bias stage is a no-op."""
        return (
            self.has_repetition_penalty
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def has_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class Setting:
    """A (temperature, top-p) point a benchmark sweep runs at or forge records at (0 = greedy)."""

    temperature: float
    top_p: float = 1.0

    def label(self, *, explicit_top_p: bool = False) -> str:
        """``greedy`` at temperature 0, else ``t0.7`` and ``-p0.95`` when top-p filters (always
        with ``explicit_top_p``: forge's shard labels spell ``-p1`` too)."""
        if self.temperature == 0:
            return "greedy"
        shown = explicit_top_p or self.top_p < 1.0
        return f"t{self.temperature:g}" + (f"-p{self.top_p:g}" if shown else "")

    @property
    def name(self) -> str:
        return self.label()
