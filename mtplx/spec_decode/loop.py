"""The decode loops: plain autoregressive and speculative (any drafter), as small generators.

Both yield `Step`s: the tokens committed by one iteration plus what the
iteration measured. They never stop on their own; the caller (the engine)
stops iterating on EOS, stop strings or max_tokens, and closes them.

Speculative cycle (see docs/ARCHITECTURE.md): with committed tokens c_0..c_{m-1}
forwarded through the trunk and a pending token c_m not yet forwarded,
  1. a drafter (`mtplx.spec_decode`: MTP head, prompt lookup, draft model, auto)
     proposes d_1..d_k (k may change per cycle, 0 = a plain AR step) and the q
     each was drawn from, or none for point-mass drafts;
  2. one trunk forward over [c_m, d_1..d_k] gives target rows p_0..p_k;
  3. `verify` accepts a prefix d_1..d_n and draws the next token y;
  4. caches are rolled back to c_0..c_m, d_1..d_n, the drafter rolls its own
     state back (`Proposer.commit`); y becomes the pending token and is
     forwarded as the first position of the next block.
One host sync per cycle: the drafts, the verify forward, the verdict and every
lazy validity flag are evaluated together.

Under a grammar (`constraint`, docs/sampling.md "Grammar mask") every row the target samples or
verifies is masked with the grammar's mask at that position, and the head samples its drafts from
its own masked distribution (q is that masked distribution, so head drafts are always legal).
The masks need the drafts on the host: one extra read of the drafts per cycle, plus one per head
draft step beyond the first (`Step.grammar_reads`). Point-mass drafts (prompt lookup, argmax
drafts) are cut to their legal prefix, which is exact: an illegal point-mass draft has p = 0 and
verify would reject it with probability 1 and sample p itself. Sampled drafts a drafter did not
mask (a draft model) are verified as they are: p = 0 rejects an illegal one, exactly. When the
grammar is complete (`GrammarConstraint.stopped`) the step says so (`Step.grammar_done`) and the
generator ends before another forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from mtplx.errors import MtplxError
from mtplx.sample import ops as sample_ops
from mtplx.sample import rejection
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.proposer import CycleOutcome, Draft, Proposer
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.model import Trunk, TrunkOutput

import mlx.core as mx


@dataclass
class TokenLogprobs:
    logprob: float  # of the committed token under the target model
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass
class Step:
    tokens: list[int]  # committed by this iteration, in order
    num_drafted: int = 0
    num_accepted: int = 0
    accept_probs: list[float] = field(default_factory=list)  # min(1, p/q) per draft position
    logprobs: list[TokenLogprobs] | None = None  # one per token, when DecodeSettings.logprobs is set
    sources: tuple[tuple[str, int], ...] = ()  # (drafter, drafts) segments of the block, in order
    # Under a grammar: the generation ends with these tokens (the grammar is complete, or they end
    # with an EOS); the generator stops after this step.
    grammar_done: bool = False
    grammar_reads: int = 0  # host reads of draft tokens the grammar's masks needed this iteration
    mask_seconds: float = 0.0  # host time computing grammar masks this iteration


@dataclass
class PromptPrefix:
    """Where a prompt cache stands at the start of a decode (see mtplx/trunk/prompt_cache.py).

    The caches passed to the loop already hold ``start`` prompt positions: the
    trunk's positions 0..start-1 and the head's (hidden i, token i+1) pairs for
    i < start. ``on_prompt_prefix(n)`` is called when the caches hold exactly the
    first ``n`` prompt positions (n = len(prompt) - 1, right before the last
    prompt token is forwarded), so a snapshot can be taken there.
    """

    start: int = 0
    on_prompt_prefix: Callable[[int], None] | None = None


def _token_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Log-probabilities of ``tokens`` under rows logits[T, V] (raw: no penalty, no filter)."""
    logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32), axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(tokens)[:, None], axis=-1)[:, 0]
    top = min(top, logits.shape[-1])
    if top > 0:
        # A partial selection of the top ``top``, then an order among those few.
        top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
        top_lps = mx.take_along_axis(logprobs, top_ids, axis=-1)
        order = mx.argsort(-top_lps, axis=-1)
        top_ids = mx.take_along_axis(top_ids, order, axis=-1)
        top_lps = mx.take_along_axis(top_lps, order, axis=-1)
        mx.eval(chosen, top_ids, top_lps)  # one sync for all three reads below
        ids, lps = top_ids.tolist(), top_lps.tolist()
    else:
        ids = lps = [[] for _ in tokens]
    return [TokenLogprobs(lp, list(zip(i, v))) for lp, i, v in zip(chosen.tolist(), ids, lps)]


def _split_key(key: mx.array) -> tuple[mx.array, mx.array]:
    pair = mx.random.split(key)
    return pair[0], pair[1]


def prefill(
    trunk: Trunk,
    prompt_tokens: list[int],
    trunk_cache: list,
    step_size: int,
    on_chunk: Callable[[TrunkOutput, int, int], None] | None = None,
    prefix: PromptPrefix | None = None,
) -> TrunkOutput:
    """Forward the prompt in chunks; return the output of the last position alone.

    ``on_chunk(output, start, end)`` sees every chunk's hidden states (for the
    head's own prefill). The last token is forwarded on its own, as mlx-lm does,
    so the LM head projects one row instead of a whole chunk; the other chunks'
    logits are never evaluated (MLX is lazy and only the cache state is forced).
    With ``prefix``, the caches already hold ``prompt_tokens[:prefix.start]``.
    """
    last = len(prompt_tokens) - 1
    first = prefix.start if prefix is not None else 0
    if not 0 <= first <= last:
        raise ValueError(f"prefill: cached prefix of {first} tokens leaves nothing of {last + 1} to forward")
    for start in range(first, last, step_size):
        prefill_chunk(trunk, prompt_tokens, trunk_cache, start, min(start + step_size, last), on_chunk)
    return prefill_last(trunk, prompt_tokens, trunk_cache, on_chunk, prefix)


def prefill_chunk(
    trunk: Trunk,
    prompt_tokens: list[int],
    trunk_cache: list,
    start: int,
    end: int,
    on_chunk: Callable[[TrunkOutput, int, int], None] | None = None,
) -> None:
    """Forward prompt_tokens[start:end] (all before the last prompt token) and force the caches."""
    output = trunk(mx.array(prompt_tokens[start:end])[None], trunk_cache)
    if on_chunk is not None:
        on_chunk(output, start, end)
    mx.eval([c.state for c in trunk_cache])


def prefill_last(
    trunk: Trunk,
    prompt_tokens: list[int],
    trunk_cache: list,
    on_chunk: Callable[[TrunkOutput, int, int], None] | None = None,
    prefix: PromptPrefix | None = None,
) -> TrunkOutput:
    """Forward the last prompt token, once the caches hold every position before it (lazy)."""
    last = len(prompt_tokens) - 1
    if prefix is not None and prefix.on_prompt_prefix is not None and last > prefix.start:
        prefix.on_prompt_prefix(last)
    output = trunk(mx.array(prompt_tokens[last:])[None], trunk_cache)
    if on_chunk is not None:
        on_chunk(output, last, last + 1)
    return output


def _penalize(
    logits: mx.array, context: list[int], cfg: SamplerConfig, block_tokens: mx.array | None = None
) -> mx.array:
    """Penalties for rows logits[B, T, V]: row t sees ``context`` then block_tokens[:, :t].

    Without penalties this returns ``logits`` untouched (the plain path costs nothing).
    """
    if not cfg.has_penalties:
        return logits
    return sample_ops.penalize_logits(logits, mx.array(context, dtype=mx.int32)[None], cfg, block_tokens)


def _sample_last_row(
    logits: mx.array,
    history: list[int],
    settings: DecodeSettings,
    key: mx.array,
    allowed: mx.array | None = None,
) -> sample_ops.SampleResult:
    """The next token from the last row of logits[1, T, V], penalized by ``history`` and masked by
    ``allowed`` [V] (the grammar's mask; None: none). Lazy."""
    cfg = settings.sampler
    last = sample_ops.mask_logits(_penalize(logits[:, -1:, :], history, cfg)[:, 0, :], allowed)
    return sample_ops.sample(last, cfg, sample_ops.draw_uniforms((1,), key), backend=settings.verify_backend)


def _grammar_step(
    constraint: GrammarConstraint | None, tokens: list[int], mask_seconds: float
) -> tuple[list[int], dict]:
    """Advance the grammar by committed ``tokens``: the tokens to report and the Step fields that
    report the grammar's part. A complete grammar ends the tokens with its last one (the EOS the
    next row forces is not reported, as AR never samples it); otherwise they end at an EOS."""
    if constraint is None:
        return tokens, {}
    constraint.commit(tokens)
    eos_at = next((i for i, t in enumerate(tokens) if t in constraint.eos), None)
    if constraint.stopped:
        tokens = tokens[:eos_at] if eos_at is not None else tokens
    elif eos_at is not None:
        tokens = tokens[: eos_at + 1]
    done = constraint.stopped or eos_at is not None
    return tokens, {"grammar_done": done, "mask_seconds": constraint.mask_seconds - mask_seconds}


def ar_decode(
    trunk: Trunk,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
    constraint: GrammarConstraint | None = None,
) -> Iterator[Step]:
    """Plain autoregressive sampling, one token per step.

    The next token's graph is built and queued (async_eval) before the current
    token is handed out, so Python work overlaps the model's compute. Under a grammar
    (``constraint``) each row is masked; the mask needs the token before it, which the
    step reads anyway.
    """
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    history = list(prompt_tokens)

    key, step_key = _split_key(key)
    output = prefill(trunk, prompt_tokens, trunk_cache, settings.prefill_step_size, prefix=prefix)
    logits = output.logits
    mask_mark = constraint.mask_seconds if constraint is not None else 0.0
    allowed = constraint.mask_after() if constraint is not None else None
    drawn = _sample_last_row(logits, history, settings, step_key, allowed)
    mx.async_eval(drawn.tokens, drawn.invalid)
    while True:
        key, step_key = _split_key(key)
        token_id = drawn.tokens.item()  # the step's one sync; the flag was evaluated with it
        drawn.checked()
        history.append(token_id)
        logprobs = (
            None
            if settings.logprobs is None
            else _token_logprobs(logits[0, -1:], [token_id], settings.logprobs)
        )
        _, grammar = _grammar_step(constraint, [token_id], mask_mark)
        mask_mark = constraint.mask_seconds if constraint is not None else 0.0
        if grammar.get("grammar_done"):
            yield Step([token_id], logprobs=logprobs, **grammar)
            return
        allowed = constraint.mask_after() if constraint is not None else None
        logits = trunk.model(drawn.tokens.reshape(1, 1), cache=trunk_cache)
        upcoming = _sample_last_row(logits, history, settings, step_key, allowed)
        mx.async_eval(upcoming.tokens, upcoming.invalid)
        yield Step([token_id], logprobs=logprobs, **grammar)
        drawn = upcoming


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


def _constrain_draft(
    draft: Draft | None, constraint: GrammarConstraint
) -> tuple[Draft | None, mx.array, int]:
    """The block's drafts under the grammar, its masks [k+1, V], and the host reads it took."""
    if draft is None:
        return None, constraint.mask_after()[None], 0
    drafts = draft.tokens.tolist()[0]  # the read the masks need (head drafts: evaluates the chain)
    if draft.probs is None:  # point masses: cut to the legal prefix (exact, see the module docstring)
        legal = constraint.legal_prefix(drafts)
        draft, drafts = cut_draft(draft, legal), drafts[:legal]
    reads = (draft.host_reads + 1) if draft is not None else 1
    return draft, constraint.block_masks(drafts), reads


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
    """Exact speculative decoding with any drafter (`mtplx.spec_decode`): one verifier for all.

    ``constraint``: the request's grammar (module docstring), None for free text."""
    cfg = settings.sampler
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    reason = cache_ops.check_rollback_support(trunk_cache, trunk.model)
    if reason is not None:
        raise MtplxError(
            f"speculative decoding cannot run on this model: {reason}; use --no-mtp (--draft none)"
        )
    history = list(prompt_tokens)

    def observe(output: TrunkOutput, start: int, end: int) -> None:
        proposer.observe_prefill(output, start, end, prompt_tokens)

    key, step_key = _split_key(key)
    output = prefill(trunk, prompt_tokens, trunk_cache, settings.prefill_step_size, observe, prefix)
    mask_seconds = constraint.mask_seconds if constraint is not None else 0.0
    allowed = constraint.mask_after() if constraint is not None else None
    first = _sample_last_row(output.logits, history, settings, step_key, allowed)
    mx.eval(first.tokens, first.invalid)
    pending = int(first.checked().tokens.item())
    history.append(pending)
    proposer.commit(CycleOutcome(output, 0, [pending], None))
    _, grammar = _grammar_step(constraint, [pending], mask_seconds)
    yield Step(
        [pending],
        logprobs=None
        if settings.logprobs is None
        else _token_logprobs(output.logits[0, -1:], [pending], settings.logprobs),
        **grammar,
    )

    while not grammar.get("grammar_done"):
        key, draft_key, accept_key, sample_key = mx.random.split(key, 4)
        mask_seconds = constraint.mask_seconds if constraint is not None else 0.0
        # 1. Draft (lazy for model drafters: evaluated together with the verify forward, unless a
        #    grammar needs the drafts first).
        draft = proposer.propose(history, draft_key, trunk_cache, constraint=constraint)
        masks, reads = None, 0
        if constraint is not None:
            draft, masks, reads = _constrain_draft(draft, constraint)
        num_drafted = draft.num_tokens if draft is not None else 0
        block = mx.array([[pending]], dtype=mx.int32)
        if draft is not None:
            block = mx.concatenate([block, draft.tokens], axis=1)
        # 2. One trunk forward over [pending, d_1..d_k]; 3. verify (k = 0: a plain AR step).
        capture = cache_ops.begin_block(trunk_cache, block_len=num_drafted + 1)
        try:
            output = trunk(block, trunk_cache)
            # k = 0 (no draft): verify samples row 0, a plain AR step.
            drafts = draft.tokens if draft is not None else mx.zeros((1, 0), dtype=mx.int32)
            result = rejection.verify(
                sample_ops.mask_logits(
                    _penalize(output.logits, history, cfg, drafts if num_drafted else None),
                    None if masks is None else masks[None],
                ),
                drafts,
                draft.probs if draft is not None else None,
                cfg,
                sample_ops.draw_uniforms((1, num_drafted), accept_key),
                sample_ops.draw_uniforms((1,), sample_key),
                backend=settings.verify_backend,
            )
            invalid = (
                result.invalid if draft is None or draft.invalid is None else result.invalid | draft.invalid
            )
            # The cycle's one sync: tokens, accept count and every lazy validity flag together.
            mx.eval(result, block, invalid)
            sample_ops.raise_if_invalid(invalid)
        except BaseException:
            # Interrupted or failed mid-cycle: leave the caches as they were before the block.
            cache_ops.abort_block(trunk_cache, capture)
            raise
        # Reads of evaluated arrays only (indexing first would queue new work).
        num_accepted = int(result.num_accepted.item())
        next_token = int(result.next_token.item())
        committed = block.tolist()[0][1 : num_accepted + 1] + [next_token]

        # 4. Roll back to the committed prefix: the trunk's cache, then the drafter's state.
        cache_ops.commit_block(trunk_cache, capture, num_accepted + 1)
        proposer.commit(CycleOutcome(output, num_accepted, committed, draft))
        history.extend(committed)
        pending = next_token
        committed, grammar = _grammar_step(constraint, committed, mask_seconds)
        logprobs = (
            None
            if settings.logprobs is None
            else _token_logprobs(output.logits[0, : len(committed)], committed, settings.logprobs)
        )
        yield Step(
            committed,
            num_drafted,
            num_accepted,
            result.accept_probs.tolist()[0],
            logprobs,
            draft.sources if draft is not None else (),
            grammar_reads=reads,
            **grammar,
        )
