"""The target model ("trunk") as the decode loop sees it.

An mlx-lm model returns only logits. MTP heads also need the trunk's last
hidden state, before or after its final norm depending on the family. Rather
than re-implementing every model's forward, the trunk's final norm is tapped
(`mtplx.trunk.compat.tap_final_norm`: the norm's class becomes a recording subclass
of itself; the parameter tree, and so loading, quantization and fingerprints,
is unchanged).

With a KV quantization plan (`kv_quant.KVQuantization`, ``Trunk.kv_quantization``) the trunk's
fresh caches follow it, and a forward that crosses the plan's start runs as two forwards split
there, the caches converted between them (`kv_quant`'s module docstring: why, and the invariant).

A vision-language checkpoint's trunk also takes images (`attach_vision`): a prompt's images are
bound to its row's caches (`bind_prompt`), and a forward over prompt tokens that touch an image
runs with the image features merged into the embeddings and M-RoPE positions
(`mtplx.trunk.vision`, `mtplx.trunk.image_positions`). Every other forward, text-only prompts and
every decode step included, is the plain one, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mtplx.errors import MtplxError
from mtplx.trunk import compat, compat_check, kv_quant
from mtplx.trunk.compat_nemotron import embedding_of, final_norm_of
from mtplx.trunk.layer_taps import LayerTaps

import mlx.core as mx
import mlx.nn as nn


@dataclass
class TrunkOutput:
    logits: mx.array  # [B, T, V]
    hidden_pre_norm: mx.array  # [B, T, H]: input of the final norm
    hidden_post_norm: mx.array  # [B, T, H]: what the LM head reads
    layer_hidden: tuple[mx.array, ...] | None = None  # [B, T, H] per tapped layer (`tap_layers`); else None


class Trunk:
    """Wraps an mlx-lm model: logits plus the hidden states MTP heads consume."""

    def __init__(self, model: nn.Module):
        compat_check.check_once()  # a changed mlx-lm fails here, with a clear message, not mid-decode
        self.model = model
        self.inner = compat.find_inner_model(model)
        self._tap = compat.tap_final_norm(final_norm_of(self.inner))
        self._lm_head = compat.find_lm_head(model)
        self.kv_quantization: kv_quant.KVQuantization | None = None  # None: float KV (`Engine.load`)
        self.vision = None  # a mtplx.trunk.vision.VisionEncoder once `attach_vision` ran
        self.vision_refusal: str | None = None  # why a checkpoint that declares a tower takes no images
        self._rope_switch = None  # the M-RoPE hook's switch (compat_vision.RopeSwitch)
        self._rope = None  # one hooked rope (dims, base, scale), for reframing keys
        self._layer_taps: LayerTaps | None = None  # decoder layers a drafter reads (`tap_layers`)

    def tap_layers(self, layer_ids: Sequence[int] | None) -> None:
        """Return the outputs of decoder layers ``layer_ids`` (0-based) in every forward's
        ``layer_hidden``, in that order; None or empty removes the taps (the forward is then
        mlx-lm's own again: `mtplx.trunk.layer_taps`)."""
        if self._layer_taps is not None:
            self._layer_taps.remove()
            self._layer_taps = None
        if layer_ids:
            self._layer_taps = LayerTaps(self.layers, layer_ids)

    @property
    def tapped_layers(self) -> tuple[int, ...]:
        return () if self._layer_taps is None else self._layer_taps.layer_ids

    def attach_vision(self, encoder) -> None:
        """Take images through ``encoder`` (`mtplx.trunk.vision.VisionEncoder`): hooks every
        attention layer's rope with the checkpoint's M-RoPE layout."""
        from mtplx.trunk import compat_vision
        from mtplx.trunk.image_positions import interleaved_selector
        from mtplx.trunk.prompt_cache import is_trimmable

        if is_trimmable(self.make_cache()):  # the prompt cache would trim keys reframed past an image
            raise MtplxError("images: supported on hybrid (gated-delta) Qwen3.5 models only")
        ropes = compat_vision.hooked_ropes(self.model)
        if not ropes:
            raise MtplxError("images: this model has no attention layer the position hook knows")
        selector = interleaved_selector(encoder.spec.mrope_section, ropes[0].dims // 2)
        self._rope_switch = compat_vision.hook_ropes(self.model, selector)
        self._rope = ropes[0]
        self.vision = encoder

    def bind_prompt(self, cache: list, prompt_tokens: list[int]) -> None:
        """Bind the images among ``prompt_tokens`` to the row's single-row ``cache`` (none: unbind)."""
        if self.vision is not None:
            from mtplx.trunk import vision

            vision.bind(cache, vision.PromptImages.from_tokens(prompt_tokens))

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def vocab_size(self) -> int:
        return embedding_of(self.inner).weight.shape[0]

    def make_cache(self) -> list:
        return kv_quant.make_cache(compat.make_prompt_cache(self.model), self.kv_quantization)

    def __call__(self, tokens: mx.array, cache: list | None = None) -> TrunkOutput:
        split = None if cache is None else kv_quant.conversion_split(cache, tokens.shape[1])
        if split is None:
            return self._forward(tokens, cache)
        # The caches convert right before position `start` is written: the positions before it first.
        if split == 0:
            kv_quant.convert(cache)
            return self._forward(tokens, cache)
        before = self._forward(tokens[:, :split], cache)
        kv_quant.convert(cache)
        after = self._forward(tokens[:, split:], cache)
        return TrunkOutput(
            mx.concatenate([before.logits, after.logits], axis=1),
            mx.concatenate([before.hidden_pre_norm, after.hidden_pre_norm], axis=1),
            mx.concatenate([before.hidden_post_norm, after.hidden_post_norm], axis=1),
            None
            if before.layer_hidden is None
            else tuple(mx.concatenate(pair, axis=1) for pair in zip(before.layer_hidden, after.layer_hidden)),
        )

    def _output(self, logits: mx.array) -> TrunkOutput:
        """The forward's logits with what the taps recorded; clears the taps for the next one."""
        layers = None if self._layer_taps is None else self._layer_taps.take()
        out = TrunkOutput(logits, self._tap.pre, self._tap.post, layers)
        self._tap.pre = self._tap.post = None
        return out

    def _forward(self, tokens: mx.array, cache: list | None) -> TrunkOutput:
        if self.vision is not None and cache is not None:
            out = self._image_forward(tokens, cache)
            if out is not None:
                return out
        return self._output(self.model(tokens, cache=cache))

    def _image_forward(self, tokens: mx.array, cache: list) -> TrunkOutput | None:
        """The forward of prompt tokens that touch a bound image; None when they touch none."""
        from mtplx.trunk import image_positions, vision

        prompt = vision.bound(cache)
        if prompt is None:
            return None
        layout = image_positions.chunk_layout(prompt.spans, vision.cache_offset(cache), tokens.shape[1])
        if layout is None:
            return None
        embedded = self.vision.merge(self.embed(tokens), prompt, layout.pieces)
        self._rope_switch.positions = mx.array(layout.positions, dtype=mx.int32)[:, None, :]
        try:
            logits = self.model(tokens, cache=cache, input_embeddings=embedded)
        finally:
            self._rope_switch.positions = None
        out = self._output(logits)
        if layout.shift:
            image_positions.reframe(cache, -layout.shift, self._rope)
        return out

    def embed(self, tokens: mx.array) -> mx.array:
        return embedding_of(self.inner)(tokens)

    def final_norm(self, hidden: mx.array) -> mx.array:
        # Untapped, so a head's own use does not overwrite the trunk's capture.
        return compat.untapped_norm(final_norm_of(self.inner), hidden)

    @property
    def output_layer(self) -> nn.Module | None:
        """The untied LM head layer (None when tied to the embeddings)."""
        return self._lm_head

    @output_layer.setter
    def output_layer(self, layer: nn.Module) -> None:
        # Distributed tensor parallel wraps a vocabulary-sharded LM head so heads see all logits.
        self._lm_head = layer

    def lm_head(self, hidden_post_norm: mx.array) -> mx.array:
        """Logits from a post-norm hidden state, through the trunk's (possibly tied) output layer."""
        if self._lm_head is not None:
            return self._lm_head(hidden_post_norm)
        return embedding_of(self.inner).as_linear(hidden_post_norm)
