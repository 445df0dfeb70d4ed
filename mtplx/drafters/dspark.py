"""DSpark block drafters (mlx-vlm 0.7.10 ``drafters/dspark``, also reached as ``qwen3_dspark``).

A DSpark drafter is a DFlash backbone (`mtplx.drafters.dflash`) with two more parts:

- a Markov head: draft ``j``'s logits are the backbone's ``base[j]`` plus
  ``markov_w2(markov_w1(previous token))``, the previous token being the anchor for ``j = 0`` and
  draft ``j - 1`` after it; so each position's q depends on the draft drawn before it;
- an optional confidence head: ``sigmoid(proj([hidden_j, markov_w1(previous token)]))`` (the
  Markov part only with ``confidence_head_with_markov``), one number per draft: the proposer's
  length policy cuts the block where it drops.

The block is ``[anchor, mask x (P - 1)]`` with ``sample_from_anchor`` (the anchor's position
drafts too: P positions give P drafts), else ``[anchor, mask x P]`` with position 0 dropped.
Tensors: the DFlash names plus ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [V, r], ``confidence_head.proj.{weight, bias}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from mtplx.drafters.dflash import DFlashDrafter
from mtplx.drafters.files import load_checked, published_weights, read_config
from mtplx.drafters.layouts import DSparkSpec, drafter_layout, dspark_spec
from mtplx.errors import MtplxError
from mtplx.trunk.compat import KVCache

import mlx.core as mx
import mlx.nn as nn


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)


class ConfidenceHead(nn.Module):
    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1, bias=True)


class DSparkDrafter(DFlashDrafter):
    def __init__(self, spec: DSparkSpec, own_embedding: bool = False, own_lm_head: bool = False):
        super().__init__(spec.backbone, own_embedding, own_lm_head)
        self.dspark = spec
        self.markov_head = MarkovHead(spec.backbone.vocab_size, spec.markov_rank)
        if spec.confidence_head:
            width = spec.backbone.hidden_size + (spec.markov_rank if spec.confidence_with_markov else 0)
            self.confidence_head = ConfidenceHead(width)

    def block_tokens(self, last_tokens: mx.array, block_size: int | None = None) -> mx.array:
        """``[anchor, mask, ...]``: P positions with ``sample_from_anchor``, else P + 1 (P drafts)."""
        proposals = self.dspark.proposal_length if block_size is None else block_size - 1
        return super().block_tokens(last_tokens, proposals + (0 if self.dspark.sample_from_anchor else 1))


def dspark_base(
    drafter: DSparkDrafter,
    block: mx.array,
    target_hidden: Sequence[mx.array],
    cache: list[KVCache],
    embed: Callable[[mx.array], mx.array],
    lm_head: Callable[[mx.array], mx.array],
    embed_scale: float = 1.0,
    counts: list[int] | None = None,
) -> tuple[mx.array, mx.array]:
    """The drafts' hidden states [B, P, H] and base logits [B, P, V] of one block forward (a pure
    function of the layer taps of the new context, the block and the drafter's cache; ``counts``:
    `DFlashDrafter.hidden`'s)."""
    embedding = drafter.embed_tokens if "embed_tokens" in drafter else embed
    hidden = drafter.hidden(embedding(block) * embed_scale, target_hidden, cache, counts)
    if not drafter.dspark.sample_from_anchor:
        hidden = hidden[:, 1:]
    return hidden, drafter.logits(hidden, lm_head)


def previous_tokens(anchor: mx.array, drafts: mx.array) -> mx.array:
    """Each draft's previous token [B, P]: the anchor, then the drafts but the last."""
    return mx.concatenate([anchor.reshape(-1, 1).astype(drafts.dtype), drafts[:, :-1]], axis=1)


def dspark_step_logits(drafter: DSparkDrafter, base: mx.array, previous: mx.array) -> mx.array:
    """Each draft's logits [B, P, V] given the token before it (``previous_tokens``)."""
    markov = drafter.markov_head
    return base + markov.markov_w2(markov.markov_w1(previous))


def dspark_confidence(drafter: DSparkDrafter, hidden: mx.array, previous: mx.array) -> mx.array | None:
    """The confidence head's [B, P] (float32, in (0, 1)), or None when the checkpoint has none."""
    if "confidence_head" not in drafter:
        return None
    features = hidden
    if drafter.dspark.confidence_with_markov:
        features = mx.concatenate([hidden, drafter.markov_head.markov_w1(previous)], axis=-1)
    return mx.sigmoid(drafter.confidence_head.proj(features).squeeze(-1).astype(mx.float32))


def load_dspark(path: str | Path) -> DSparkDrafter:
    """Load a DSpark drafter directory; a misfit is a one-line error naming the field or tensor."""
    path = Path(path)
    config = read_config(path, "DSpark drafter")
    own_layout = str(config.get("model_type")) in ("gemma4_dspark", "deepseek_v4_dspark")
    if (
        drafter_layout(config) != "dspark"
        or own_layout
        or "Gemma4DSparkModel" in (config.get("architectures") or ())
    ):
        raise MtplxError(
            f"{path}: not a generic DSpark drafter (the Gemma 4 and DeepSeek-V4 DSpark layouts are not loaded yet)"
        )
    spec = dspark_spec(config)
    weights = published_weights(path, "DSpark drafter")
    drafter = DSparkDrafter(spec, "embed_tokens.weight" in weights, "lm_head.weight" in weights)
    load_checked(drafter, weights, path, "DSpark drafter")
    return drafter
