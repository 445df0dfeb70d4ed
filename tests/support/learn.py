"""The tiny trunk the learning-from-traffic tests train heads for (tests/learn), light to import, so a
killed subprocess (tests/learn/test_learn.py) builds the same one fast."""

from __future__ import annotations

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.trunk.model import Trunk

import mlx.core as mx

from support import models

VOCAB, HIDDEN = 48, 32


def tiny_trunk() -> Trunk:
    """forge's test trunk: untied, sharper than random (learnable structure), fixed by its seeds."""
    model = models.tiny_llama(VOCAB, seed=0, hidden_size=HIDDEN, tie_word_embeddings=False)
    model.model.embed_tokens.weight = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(1)) * 0.6
    model.lm_head.weight = mx.random.normal((VOCAB, HIDDEN), key=mx.random.key(2)) * 0.5
    mx.eval(model.parameters())
    return Trunk(model)
