"""A single-row drafter's block (`Draft`, what a draft model returns for one row before
`draft_model_proposer.stacked_block` stacks the rows). The batch-first contract is `draft_block`;
model drafters draw through the row's `mtplx.sample.target.TargetSampler.draft`.

The shape follows vLLM's spec_decode (vllm/v1/spec_decode/{ngram_proposer,eagle}.py
beside vllm/v1/sample/rejection_sampler.py): proposers only propose; one
verifier (`mtplx.sample.rejection.verify`) accepts or rejects every proposer's block, so
exactness is argued once, for any q. A proposer returns the draft tokens and the
distribution q each was drawn from, or nothing for a point mass (deterministic
drafts such as prompt lookup); `verify` treats a missing q as a one-hot at the
draft, which accepts d with probability p(d) and on rejection samples p with d
removed and renormalised.

Exactness does not depend on how a proposer chooses its block (length, source,
early stop), as long as the choice for position i uses only the committed text,
earlier drafts and randomness independent of the verify uniforms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Draft:
    """A block of draft tokens for one cycle (k >= 1)."""

    tokens: mx.array  # [1, k] int32; may be lazy (evaluated with the verify forward)
    probs: mx.array | None  # [1, k, V] float32 q rows; None = every draft is a point mass
    sources: tuple[tuple[str, int], ...]  # (drafter name, how many drafts), in block order
    invalid: mx.array | None = None  # [] int32, lazy: verify's INVALID_* bits of the draft sampling
    host_reads: int = 0  # drafts read to the host while drafting (a grammar's masks need them)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])


def join_drafts(parts: Sequence[Draft]) -> Draft:
    """One block from consecutive parts; point-mass parts get explicit one-hot q rows when
    another part carries a real distribution (verify takes one q tensor per block)."""
    if len(parts) == 1:
        return parts[0]
    tokens = mx.concatenate([p.tokens for p in parts], axis=1)
    sources = tuple(s for p in parts for s in p.sources)
    flags = [p.invalid for p in parts if p.invalid is not None]
    invalid = None
    for flag in flags:
        invalid = flag if invalid is None else invalid | flag
    with_q = [p for p in parts if p.probs is not None]
    if not with_q:
        return Draft(tokens, None, sources, invalid)
    vocab_size = with_q[0].probs.shape[-1]
    rows = [
        p.probs
        if p.probs is not None
        else (mx.arange(vocab_size, dtype=mx.int32) == p.tokens[..., None]).astype(mx.float32)
        for p in parts
    ]
    return Draft(tokens, mx.concatenate(rows, axis=1), sources, invalid)


def stacked_draft(
    tokens: list[mx.array], probs: list[mx.array | None], flags: list[mx.array | None], name: str
) -> Draft:
    """A model drafter's block from per-position tokens [1], q rows [1, V] (all or none None)
    and validity flags."""
    stacked_probs = None if probs[0] is None else mx.stack(probs, axis=1)
    invalid = None
    for flag in flags:
        if flag is not None:
            invalid = flag if invalid is None else invalid | flag
    return Draft(mx.stack(tokens, axis=1), stacked_probs, ((name, len(tokens)),), invalid)


def cut_draft(draft: Draft, keep: int) -> Draft | None:
    """The first ``keep`` tokens of a point-mass ``draft`` (None when nothing is kept)."""
    if keep >= draft.num_tokens:
        return draft
    if keep <= 0:
        return None
    sources, left = [], keep
    for name, count in draft.sources:
        if left > 0:
            sources.append((name, min(count, left)))
        left -= count
    return Draft(draft.tokens[:, :keep], None, tuple(sources), draft.invalid)


def point_mass_draft(tokens: list[int], name: str) -> Draft:
    return Draft(mx.array(tokens, dtype=mx.int32)[None], None, ((name, len(tokens)),))
