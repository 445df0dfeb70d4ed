"""Taps on the trunk's decoder layers: the hidden states a drafter names (DFlash's
``target_layer_ids``, EAGLE-3's auxiliary layers), recorded during the trunk's own forward.

Layer ``i`` here is the output of decoder layer ``i`` (0-based), the convention of z-lab's DFlash and
of mlx-vlm 0.7.10 (``hidden_states[i + 1]`` in Hugging Face's ``output_hidden_states`` list, whose
entry 0 is the embeddings). mlx-lm models return logits only, so, as for the final-norm tap
(`compat.tap_final_norm`), each tapped layer instance's class becomes a recording subclass of its
own class: the parameter tree, loading, quantization and fingerprints stay unchanged. A layer that
returns a tuple (Gemma 4: hidden, shared KV, offset) has its first element recorded.

No cost when nothing asks: layers are swapped only while a `LayerTaps` holds them, and `remove`
restores the original classes, so an untapped trunk runs mlx-lm's forward unchanged (the tests
check the classes and count host syncs). Recording keeps a reference to an array the forward
computes anyway; it adds no operation to the graph and no host read.

One mechanism for every backend: anything that exposes its decoder layers as a list (mlx-lm's
``model.layers``; an mlx-vlm language model's layers) is tapped the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.errors import MtplxError

import mlx.core as mx
import mlx.nn as nn


class LayerTaps:
    """Records the outputs of the decoder layers ``layer_ids`` of ``layers`` during each forward."""

    def __init__(self, layers: Sequence[nn.Module], layer_ids: Sequence[int]):
        ids = tuple(int(i) for i in layer_ids)
        if not ids:
            raise MtplxError("layer taps: no layer named")
        bad = [i for i in ids if not 0 <= i < len(layers)]
        if bad:
            raise MtplxError(f"layer taps: layer {bad[0]} out of range (the trunk has {len(layers)} layers)")
        self.layer_ids = ids
        self._captured: dict[int, mx.array] = {}
        self._swapped: list[tuple[nn.Module, type]] = []
        for index in sorted(set(ids)):
            layer = layers[index]
            if getattr(type(layer), "_mtplx_layer_tap", None) is not None:
                self.remove()
                raise MtplxError(f"layer taps: layer {index} is already tapped")
            self._swapped.append((layer, type(layer)))
            layer.__class__ = _recording_class(type(layer), self, index)

    def record(self, index: int, output) -> None:
        self._captured[index] = output[0] if isinstance(output, tuple) else output

    def take(self) -> tuple[mx.array, ...]:
        """The recorded outputs, one per requested id in the order named; clears the record."""
        missing = [i for i in self.layer_ids if i not in self._captured]
        if missing:
            self._captured.clear()
            raise MtplxError(f"layer taps: layer {missing[0]} did not run in this forward")
        out = tuple(self._captured[i] for i in self.layer_ids)
        self._captured.clear()
        return out

    def clear(self) -> None:
        self._captured.clear()

    def remove(self) -> None:
        """Restore every tapped layer's own class (the trunk is then exactly mlx-lm's again)."""
        for layer, cls in self._swapped:
            layer.__class__ = cls
        self._swapped.clear()
        self._captured.clear()


def _recording_class(base: type, taps: LayerTaps, index: int) -> type:
    def __call__(self, *args, **kwargs):
        out = base.__call__(self, *args, **kwargs)
        taps.record(index, out)
        return out

    return type(f"Tapped{base.__name__}", (base,), {"__call__": __call__, "_mtplx_layer_tap": taps})


def concatenated(hidden: Sequence[mx.array]) -> mx.array:
    """The taps joined on the feature axis, in the order named: DFlash's and EAGLE-3's input."""
    return hidden[0] if len(hidden) == 1 else mx.concatenate(list(hidden), axis=-1)
