"""The trunk's two last hidden states a head can read or chain: before and after the final norm
(`Trunk` returns both; `compat.tap_final_norm` records them). Standard library only, so forge's
configuration and the CLI can validate a choice before MLX loads."""

from typing import Literal

HiddenSource = Literal["pre_norm", "post_norm"]
HIDDEN_SOURCES: tuple[HiddenSource, ...] = ("pre_norm", "post_norm")
