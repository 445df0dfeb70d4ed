"""Driving the decode loop's step generators in tests: the first tokens (and the steps that
made them), a sampled run long enough to have rolled back, and the arrays a cache holds."""

from __future__ import annotations

import math
from collections.abc import Generator

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.spec_decode.head_proposer import HeadProposer
from mtplx.spec_decode.loop import Step, speculative_decode
from mtplx.spec_decode.settings import DecodeSettings

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


def take_steps(steps: Generator[Step, None, None], n: int) -> tuple[list[int], list[Step]]:
    """The first ``n`` tokens of ``steps`` and every step that produced them; closes ``steps``."""
    tokens: list[int] = []
    produced: list[Step] = []
    for step in steps:
        tokens.extend(step.tokens)
        produced.append(step)
        if len(tokens) >= n:
            break
    steps.close()
    return tokens[:n], produced


def take_tokens(steps: Generator[Step, None, None], n: int) -> list[int]:
    """The first ``n`` tokens of ``steps``; closes ``steps``."""
    return take_steps(steps, n)[0]


def sample_until_rollbacks(steps: Generator[Step, None, None], min_tokens: int) -> tuple[list[int], set[int]]:
    """(tokens, accept counts) of a sampled speculative run, up to the step where its drafting
    cycles have accepted two different numbers of drafts (so at least one rolled back) and it
    has made more than ``min_tokens`` tokens; closes ``steps``. The last token is pending: not
    yet forwarded. Fewer than two accept counts: the run ended first."""
    generated: list[int] = []
    accept_counts: set[int] = set()
    for step in steps:
        generated.extend(step.tokens)
        if step.num_drafted:
            accept_counts.add(step.num_accepted)
        if len(accept_counts) >= 2 and len(generated) > min_tokens:
            break
    steps.close()
    return generated, accept_counts


def cache_arrays(caches: list) -> list[mx.array]:
    """Every array the caches hold for the committed positions (KV up to the offset; the conv
    and recurrent states of a gated-delta layer whole)."""
    out = []
    for c in caches:
        if isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


def mtp_decode(
    trunk,
    head,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    head_cache: list | None = None,
    prefix=None,
) -> Generator[Step, None, None]:
    """The loop with the MTP head as its drafter, without an engine: what `spec_decode.select`
    builds for ``draft="head"``."""
    proposer = HeadProposer(head, settings, head_cache)
    return speculative_decode(trunk, proposer, prompt_tokens, settings, key, trunk_cache, prefix)


# A rounding tie: with OpenBLAS a row's float32 matmul can change in its last bits when more
# rows share the call (measured: about 3e-6 from 2-3 rows on), which can flip a greedy choice
# only where the alone run's two best candidates are this close: probabilities within 1e-4 of
# each other relative to the larger, i.e. log-probabilities (and logits) within about 1e-4.
TIE_RELATIVE_GAP = 1e-4


def first_divergence(alone: list[int], got: list[int]) -> int | None:
    """Where ``got`` (a batched run) first differs from ``alone`` (the same request alone), None
    if nowhere; a run that ends first differs where it ended."""
    for i, (a, g) in enumerate(zip(alone, got)):
        if a != g:
            return i
    return None if len(alone) == len(got) else min(len(alone), len(got))


def is_rounding_tie(top2: tuple[float, float]) -> bool:
    """The two best candidates' probabilities are within TIE_RELATIVE_GAP of each other, relative
    to the larger (their log-probabilities differ by the logits' difference)."""
    first, second = top2
    return 1.0 - math.exp(-abs(first - second)) <= TIE_RELATIVE_GAP


def same_or_tie(alone: list[int], alone_top2: list[tuple[float, float]], got: list[int]) -> tuple[bool, bool]:
    """(acceptable, tied): ``got`` equals ``alone``, or first differs at a rounding tie of the
    alone run (after which the two runs are different sequences and are not compared).
    ``alone_top2[i]``: the alone run's two largest log-probabilities at token i."""
    at = first_divergence(alone, got)
    if at is None:
        return True, False
    if at >= len(alone_top2):
        return False, False  # the alone run ended (EOS) there: no recorded choice to blame
    tied = is_rounding_tie(alone_top2[at])
    return tied, tied
