"""A request decoded on its own caches: `speculative_decode` (any single-row proposer) and
`ar_decode`, as generators of `Step`s.

Both are a batch of one through the one cycle (`mtplx.spec_decode.batch.BatchDecoder` over a
`SingleRowCache`: every cache kind rollback supports, the caller's own cache list, never copied),
so the draft -> forward -> verify -> commit cycle exists once. They serve a sharded engine's stream
(every rank steps the same row, `mtplx.engine.distributed`) and the tests that drive a proposer
directly; `Engine.stream` submits to the scheduler instead.

They never stop on their own (EOS, stop strings and max_tokens are the caller's), except after a
complete grammar (`Step.grammar_done`): the text ends with the grammar's last token.
"""

from __future__ import annotations

from collections.abc import Iterator

from mtplx.errors import MtplxError
from mtplx.spec_decode.batch import BatchDecoder
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.proposer import Proposer
from mtplx.spec_decode.rows import RowsFailed, RowSpec
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.spec_decode.step import PromptPrefix, Step, TokenLogprobs, prefill
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.model import Trunk

import mlx.core as mx

__all__ = [
    "PromptPrefix",
    "Step",
    "TokenLogprobs",
    "ar_decode",
    "decode_alone",
    "prefill",
    "speculative_decode",
]


def ar_decode(
    trunk: Trunk,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
    constraint: GrammarConstraint | None = None,
) -> Iterator[Step]:
    """Plain autoregressive sampling, one token per step (``constraint``: each row masked by the
    request's grammar)."""
    return decode_alone(trunk, prompt_tokens, settings, key, None, trunk_cache, prefix, constraint)


def speculative_decode(
    trunk: Trunk,
    proposer: Proposer,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
    constraint: GrammarConstraint | None = None,
) -> Iterator[Step]:
    """Exact speculative decoding with any single-row proposer (`mtplx.spec_decode`): one verifier
    for all. ``constraint``: the request's grammar (`batch`'s "Grammar rows")."""
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    reason = cache_ops.check_rollback_support(trunk_cache, trunk.model)
    if reason is not None:
        raise MtplxError(
            f"speculative decoding cannot run on this model: {reason}; use --no-mtp (--draft none)"
        )
    return decode_alone(trunk, prompt_tokens, settings, key, proposer, trunk_cache, prefix, constraint)


def decode_alone(
    trunk: Trunk,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    proposer: Proposer | None = None,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
    constraint: GrammarConstraint | None = None,
) -> Iterator[Step]:
    """One request on its own caches (``trunk_cache``, the caller's, used in place; a fresh one
    when None), through the one cycle as a batch of one: the Step of its first token, then one
    per cycle, until a complete grammar ends it. ``proposer``: its drafter (None: plain AR)."""
    decoder = BatchDecoder(trunk, single_row=True)
    spec = RowSpec(settings, "proposer" if proposer is not None else "none")
    row_id, step = decoder.join(
        prompt_tokens,
        spec,
        key,
        trunk_cache=trunk_cache,
        prefix=prefix,
        constraint=constraint,
        proposer=proposer,
    )
    yield step
    while not step.grammar_done:
        try:
            step = decoder.step()[row_id]
        except RowsFailed as err:  # invalid values (the cycle was undone): the ValueError alone raises
            raise ValueError(str(err)) from None
        yield step
