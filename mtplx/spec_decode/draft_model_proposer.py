"""A separate (smaller) mlx-lm model with the target's tokenizer as the drafter.

It drafts k tokens autoregressively with its own cache. Rollback is exact for
every cache kind `mtplx.trunk.rollback` supports, hybrid (gated-delta) drafts included:
the committed tokens are forwarded first, a `cache.checkpoint` is taken, the
drafts are forwarded one at a time, and at commit the cache is restored to the
checkpoint; the accepted drafts and the next token are re-forwarded as one
batched block at the next proposal (one forward of up to k+1 tokens, about the
cost of one token on a small model), so no per-position state is kept.

Vocabulary: q lives on the target's logit width. Ids past the tokenizer's real
vocabulary (embedding padding, on either model) get q = 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mtplx.errors import MtplxError
from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.lookup_proposer import point_mass_draft
from mtplx.spec_decode.proposer import CycleOutcome, Draft, draw_draft_token, join_drafts, stacked_draft
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import compat
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx
import mlx.nn as nn


def real_vocab_size(tokenizer: Any) -> int:
    """One past the largest token id the tokenizer can produce (added/special tokens included)."""
    vocab = tokenizer.get_vocab()
    return max(vocab.values()) + 1 if vocab else 0


def embedding_rows(model: nn.Module) -> int:
    """Logit width of an mlx-lm model (its input embedding's row count)."""
    return int(compat.find_inner_model(model).embed_tokens.weight.shape[0])


def _special_ids(tokenizer: Any) -> tuple:
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [])
    return (
        tuple(eos),
        getattr(tokenizer, "bos_token_id", None),
        tuple(sorted(getattr(tokenizer, "all_special_ids", None) or [])),
    )


def check_compatible(
    target_tokenizer: Any, draft_tokenizer: Any, target_rows: int, draft_rows: int, draft_path: str
) -> int:
    """The shared real vocabulary size; MtplxError when the draft model cannot draft for the target."""
    if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise MtplxError(
            f"draft model {draft_path}: its tokenizer maps tokens to other ids than the target's"
        )
    if _special_ids(target_tokenizer) != _special_ids(draft_tokenizer):
        raise MtplxError(f"draft model {draft_path}: its special/EOS token ids differ from the target's")
    vocab = real_vocab_size(target_tokenizer)
    if draft_rows < vocab or target_rows < vocab:
        raise MtplxError(
            f"draft model {draft_path}: vocabulary of {draft_rows} ids (target {target_rows}) "
            f"does not cover the tokenizer's {vocab} ids"
        )
    return vocab


class DraftModelProposer:
    name = "model"

    def __init__(
        self,
        model: nn.Module,
        settings: DecodeSettings,
        *,
        target_vocab_size: int,
        real_vocab_size: int,
        depth: int | None = None,
        cache: list | None = None,
    ):
        """Drafting with ``model`` as ``settings`` say; ``depth`` overrides theirs (a draft model's
        best depth is not the head's). Ids from ``real_vocab_size`` to ``target_vocab_size`` get q = 0."""
        self.model = model
        self.settings = settings
        self.depth = depth if depth is not None else settings.depth
        self.target_vocab_size = target_vocab_size
        self.real_vocab_size = real_vocab_size
        self.cache = cache if cache is not None else compat.make_prompt_cache(model)
        self._fed = 0  # history tokens forwarded through the draft model
        self._checkpoint: cache_ops.BlockCapture | None = None

    def observe_prefill(self, output: TrunkOutput, start: int, end: int, prompt_tokens: list[int]) -> None:
        return None  # the prompt is forwarded at the first proposal

    def _forward(self, tokens: Sequence[int] | mx.array) -> mx.array:
        if not isinstance(tokens, mx.array):
            tokens = mx.array(list(tokens), dtype=mx.int32)[None]
        return self.model(tokens, cache=self.cache)[:, -1, :]

    def _catch_up(self, history: list[int]) -> mx.array:
        """Forward the committed tokens the draft cache lacks (chunked); logits after the last."""
        new = history[self._fed :]
        step = self.settings.prefill_step_size
        for start in range(0, len(new) - step, step):
            self._forward(new[start : start + step])
            mx.eval([c.state for c in self.cache])
        self._fed = len(history)
        return self._forward(new[(max(len(new) - 1, 0) // step) * step :])

    def _aligned(self, logits: mx.array) -> mx.array:
        """Draft logits on the target's width, -inf (q = 0) past the real vocabulary."""
        logits = logits.astype(mx.float32)
        width = logits.shape[-1]
        if width > self.target_vocab_size:
            logits = logits[:, : self.target_vocab_size]
        elif width < self.target_vocab_size:
            pad = mx.full((logits.shape[0], self.target_vocab_size - width), -mx.inf, dtype=mx.float32)
            logits = mx.concatenate([logits, pad], axis=1)
        if self.real_vocab_size < self.target_vocab_size:
            ids = mx.arange(self.target_vocab_size)
            logits = mx.where(ids < self.real_vocab_size, logits, -mx.inf)
        return logits

    def propose(
        self,
        history: list[int],
        key: mx.array,
        trunk_cache: list,
        forced: Sequence[int] = (),
        constraint=None,
    ) -> Draft | None:
        """Draft up to ``depth`` tokens; after ``forced`` point-mass tokens (a lookup block) when
        given, conditioned on them, filling the block up to ``depth``. Drafts are not masked by a
        grammar (``constraint``): the loop cuts argmax drafts to their legal prefix and verify
        rejects an illegal sampled one (p = 0), so the output stays exact."""
        logits = self._catch_up(history)
        self._checkpoint = cache_ops.checkpoint(self.cache)
        prefix = [point_mass_draft(list(forced), "lookup")] if forced else []
        if forced:
            logits = self._forward(forced)
        count = self.depth - len(forced)
        if count <= 0:
            return join_drafts(prefix) if prefix else None
        cfg = self.settings.sampler
        uniforms = sample_ops.draw_uniforms((count,), key)
        context = mx.array(list(history) + list(forced), dtype=mx.int32)[None] if cfg.has_penalties else None
        tokens: list[mx.array] = []
        probs: list[mx.array | None] = []
        flags: list[mx.array | None] = []
        for i in range(count):
            if i > 0:
                logits = self._forward(tokens[-1].reshape(1, 1))
                if context is not None:
                    context = mx.concatenate([context, tokens[-1][None]], axis=1)
            token, q, invalid = draw_draft_token(
                self._aligned(logits), context, self.settings, uniforms[i : i + 1]
            )
            tokens.append(token)
            probs.append(q)
            flags.append(invalid)
        return join_drafts(prefix + [stacked_draft(tokens, probs, flags, self.name)])

    def commit(self, outcome: CycleOutcome) -> None:
        if self._checkpoint is not None:
            cache_ops.abort_block(self.cache, self._checkpoint)
            self._checkpoint = None
