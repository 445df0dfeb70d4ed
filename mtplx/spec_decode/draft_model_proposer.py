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
from mtplx.sample.target import target_sampler
from mtplx.spec_decode.draft_block import DraftBlock, Outcome, Source, pad_time
from mtplx.spec_decode.proposer import Draft, join_drafts, point_mass_draft, stacked_draft
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import compat
from mtplx.trunk import rollback as cache_ops

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
    """One row's draft model state: its own cache, rolled back after every cycle."""

    name = Source.MODEL

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

    def draft(self, history: list[int], key: mx.array, forced: Sequence[int] = ()) -> Draft | None:
        """Draft up to ``depth`` tokens; after ``forced`` point-mass tokens (a lookup block) when
        given, conditioned on them, filling the block up to ``depth``. Drafts are not masked by a
        grammar: the loop cuts argmax drafts to their legal prefix and verify rejects an illegal
        sampled one (p = 0), so the output stays exact. The prompt is forwarded at the first
        proposal (the draft model sees no trunk state)."""
        logits = self._catch_up(history)
        self._checkpoint = cache_ops.checkpoint(self.cache)
        prefix = [point_mass_draft(list(forced), Source.LOOKUP)] if forced else []
        if forced:
            logits = self._forward(forced)
        count = self.depth - len(forced)
        if count <= 0:
            return join_drafts(prefix) if prefix else None
        settings = self.settings
        cfg = settings.sampler
        sampler = target_sampler(cfg, settings.verify_backend, settings.greedy_draft)
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
            token, q, invalid = sampler.draft(self._aligned(logits), context, uniforms[i : i + 1])
            tokens.append(token)
            probs.append(q)
            flags.append(invalid)
        return join_drafts(prefix + [stacked_draft(tokens, probs, flags, self.name)])

    def rollback(self) -> None:
        """Back to the committed text (the drafts' entries dropped; re-fed at the next proposal)."""
        if self._checkpoint is not None:
            cache_ops.abort_block(self.cache, self._checkpoint)
            self._checkpoint = None


class ModelDrafter:
    """A draft model for every row that asks, each on its own cache (``row.proposer``, a
    `DraftModelProposer`: a small model drafts one row at a time). Composition with lookup: a
    row's lookup match shorter than its depth is continued by the draft model, conditioned on it
    (``prefixes``); a match as long as its depth is drafted as it is (by the lookup drafter)."""

    source = Source.MODEL

    def propose(
        self, rows: Sequence, keys: Sequence, most: Sequence[int], prefixes: Sequence[list[int]] = ()
    ) -> DraftBlock:
        drafts: list[Draft | None] = []
        for i, (row, n) in enumerate(zip(rows, most)):
            prefix = prefixes[i] if prefixes else []
            drafts.append(row.proposer.draft(row.history, keys[i].draft, forced=prefix) if n else None)
        return stacked_block(drafts)

    def commit(self, rows: Sequence, outcome: Outcome) -> None:
        for row in rows:
            if row.proposer is not None:
                row.proposer.rollback()


def stacked_block(drafts: Sequence[Draft | None]) -> DraftBlock:
    """One block from one-row `Draft`s (None: no drafts for that row); point-mass rows get one-hot
    q rows where another row carries a real q (a block holds one q tensor)."""
    lengths = [d.num_tokens if d is not None else 0 for d in drafts]
    width = max(lengths)
    zeros = mx.zeros((1, width), dtype=mx.int32)
    tokens = mx.concatenate([pad_time(d.tokens, width) if d is not None else zeros for d in drafts])
    q = None
    with_q = [d.probs for d in drafts if d is not None and d.probs is not None]
    if with_q:
        vocab_size = with_q[0].shape[-1]
        ids = mx.arange(vocab_size, dtype=mx.int32)
        q = mx.concatenate(
            [
                pad_time(
                    d.probs if d.probs is not None else (ids == d.tokens[..., None]).astype(mx.float32), width
                )
                if d is not None
                else mx.zeros((1, width, vocab_size), dtype=mx.float32)
                for d in drafts
            ]
        )
    invalid = None
    for d in drafts:
        if d is not None and d.invalid is not None:
            invalid = d.invalid if invalid is None else invalid | d.invalid
    sources = [
        tuple((Source(name), count) for name, count in d.sources) if d is not None else () for d in drafts
    ]
    return DraftBlock(tokens, lengths, sources, q=q, invalid=invalid)
