"""Driving the one cycle directly in tests, without an engine or its scheduler: one request on its
own caches as a batch of one (`decode_alone`, with `ar_decode` / `speculative_decode` naming the
drafter), the first tokens (and the steps that made them), a sampled run long enough to have
rolled back, and the arrays a cache holds.

`decode_alone` is what the scheduler does for a single-row request, minus the prompt cache and
the stop rules: `BatchDecoder(single_row=True)` joins the row (the caller's caches, used in place)
and steps it; the Steps never stop on their own except after a complete grammar."""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.loop import BatchDecoder
from mtplx.spec_decode.rows import RowsFailed, RowSpec
from mtplx.spec_decode.settings import DecodeSettings, LookupConfig  # noqa: F401  (tests name them here)
from mtplx.spec_decode.sources import Source
from mtplx.spec_decode.step import PromptPrefix, Step, TokenLogprobs, prefill  # noqa: F401
from mtplx.trunk import rollback as cache_ops

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

_GREEDY = SamplerConfig(temperature=0.0)

# A row's sources by the names tests use ("proposer": a draft model on the row's own cache).
SOURCES = {
    "none": (),
    "lookup": (Source.LOOKUP,),
    "head": (Source.HEAD,),
    "auto": (Source.LOOKUP, Source.HEAD),
    "proposer": (Source.MODEL,),
}


@dataclass
class Drafters:
    """A row's drafters for `decode_alone`: its sources in priority order and what they need (the
    MTP head and its cache, a draft model's state, lookup's matcher), as `drafting` resolves them."""

    sources: tuple[Source, ...]
    head: object = None
    head_cache: list | None = None
    proposer: DraftModelProposer | None = None
    lookup: LookupConfig = field(default_factory=LookupConfig)


def decode_alone(
    trunk,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    drafters: Drafters | None = None,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
    constraint: GrammarConstraint | None = None,
) -> Generator[Step, None, None]:
    """One request on its own caches (``trunk_cache``, used in place; a fresh one when None)
    through the one cycle as a batch of one: the Step of its first token, then one per cycle.
    ``drafters``: its drafters (None: plain AR)."""
    drafters = drafters if drafters is not None else Drafters(())
    decoder = BatchDecoder(trunk, drafters.head, single_row=True)
    spec = RowSpec(settings, drafters.sources, drafters.lookup)
    row_id, step = decoder.join(
        prompt_tokens,
        spec,
        key,
        trunk_cache=trunk_cache,
        head_cache=drafters.head_cache,
        prefix=prefix,
        constraint=constraint,
        proposer=drafters.proposer,
    )
    yield step
    while not step.grammar_done:
        try:
            step = decoder.step()[row_id]
        except RowsFailed as err:  # invalid values (the cycle was undone): as the engine raises them
            raise ValueError(str(err)) from None
        yield step


def ar_decode(trunk, prompt_tokens, settings, key, trunk_cache=None, prefix=None, constraint=None):
    """Plain autoregressive decoding through the one cycle (`decode_alone` without a drafter)."""
    return decode_alone(trunk, prompt_tokens, settings, key, None, trunk_cache, prefix, constraint)


def speculative_decode(
    trunk, drafters, prompt_tokens, settings, key, trunk_cache=None, prefix=None, constraint=None
):
    """``drafters`` (`Drafters`) drafting through the one cycle (`decode_alone`); a model whose
    caches cannot roll back is refused as the engine refuses it."""
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    reason = cache_ops.check_rollback_support(trunk_cache, trunk.model)
    if reason is not None:
        raise MtplxError(f"speculative decoding cannot run on this model: {reason}")
    return decode_alone(trunk, prompt_tokens, settings, key, drafters, trunk_cache, prefix, constraint)


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
    """The loop with the MTP head as its drafter, without an engine: what `spec_decode.drafting`
    resolves for ``draft="head"``."""
    drafters = Drafters((Source.HEAD,), head=head, head_cache=head_cache)
    return speculative_decode(trunk, drafters, prompt_tokens, settings, key, trunk_cache, prefix)


# A rounding tie: with OpenBLAS a row's float32 matmul can change in its last bits when more
# rows share the call (measured: about 3e-6 from 2-3 rows on), which can flip a greedy choice
# only where the alone run's two best candidates are this close: probabilities within 1e-4 of
# each other relative to the larger, i.e. log-probabilities (and logits) within about 1e-4.
TIE_RELATIVE_GAP = 1e-4


def assert_mtp_equals_ar_with_drafts_kept(trunk, head, prompts, n: int, depths=(1, 2), label=None) -> None:
    """Greedy MTP with ``head`` gives the AR tokens (``n`` of each prompt, key 0) at each depth, and
    at each depth some draft was kept (an MTP run that never keeps a draft would prove nothing)."""
    for depth in depths:
        kept = 0
        for prompt in prompts:
            ar_settings = DecodeSettings(sampler=_GREEDY)
            ar = take_tokens(ar_decode(trunk, prompt, ar_settings, mx.random.key(0)), n)
            settings = DecodeSettings(sampler=_GREEDY, depth=depth)
            tokens, steps = take_steps(mtp_decode(trunk, head, prompt, settings, mx.random.key(0)), n)
            assert tokens == ar, (label, depth, prompt)
            kept += sum(s.num_accepted for s in steps if s.num_drafted)
        assert kept > 0, (label, depth)


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


def lookup_decode_steps(trunk, prompt: list[int], n: int) -> list[Step]:
    """Greedy decoding of ``prompt`` with prompt-lookup drafts only (n-grams from 1 token, blocks
    of up to 4): the steps that produced its first ``n`` tokens (verify blocks, kept and rejected)."""
    from mtplx.spec_decode.lookup_proposer import LookupConfig
    from mtplx.spec_decode.settings import DecodeSettings
    from mtplx.spec_decode.sources import Source

    drafters = Drafters((Source.LOOKUP,), lookup=LookupConfig(min_ngram=1, max_ngram=3, max_tokens=4))
    settings = DecodeSettings(sampler=SamplerConfig(temperature=0.0), depth=4)
    return take_steps(speculative_decode(trunk, drafters, prompt, settings, mx.random.key(0), None), n)[1]
