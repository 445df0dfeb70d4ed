"""The decode loops: plain autoregressive and MTP speculative, as small generators.

Both yield `Step`s: the tokens committed by one iteration plus what the
iteration measured. They never stop on their own; the caller (the engine)
stops iterating on EOS, stop strings or max_tokens, and closes them.

MTP cycle (see docs/ARCHITECTURE.md): with committed tokens c_0..c_{m-1}
forwarded through the trunk and a pending token c_m not yet forwarded,
  1. the head drafts d_1..d_k, chained on its own output hidden state;
  2. one trunk forward over [c_m, d_1..d_k] gives target rows p_0..p_k;
  3. `verify` accepts a prefix d_1..d_n and draws the next token y;
  4. caches are rolled back to c_0..c_m, d_1..d_n; y becomes the pending token
     and is forwarded as the first position of the next block.
The head's KV entries made from drafted (not true) hidden states are dropped
and recomputed from the trunk's true hidden states at the start of the next
cycle, so the head's cache always equals the one a from-scratch run builds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import mlx.core as mx

from mtplx import cache as cache_ops
from mtplx import verify as verify_ops
from mtplx.config import SamplerConfig
from mtplx.errors import MtplxError
from mtplx.heads.base import DraftHead
from mtplx.trunk import Trunk, TrunkOutput


@dataclass(frozen=True)
class DecodeSettings:
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    depth: int = 3  # draft tokens per verify cycle
    greedy_draft: bool = False  # draft the head's argmax (q one-hot) instead of sampling q
    prefill_step_size: int = 512
    verify_backend: str = "auto"  # "auto" (fused kernel where available) | "mlx"
    # Report the target's log-probabilities of each committed token plus this many top
    # alternatives (None: off). Raw log_softmax of the trunk logits, before penalties and filters.
    logprobs: int | None = None


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


@dataclass
class PromptPrefix:
    """Where a prompt cache stands at the start of a decode (see mtplx/prompt_cache.py).

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
        end = min(start + step_size, last)
        output = trunk(mx.array(prompt_tokens[start:end])[None], trunk_cache)
        if on_chunk is not None:
            on_chunk(output, start, end)
        mx.eval([c.state for c in trunk_cache])
    if prefix is not None and prefix.on_prompt_prefix is not None and last > first:
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
    return verify_ops.penalize_logits(logits, mx.array(context, dtype=mx.int32)[None], cfg, block_tokens)


def ar_decode(
    trunk: Trunk,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    prefix: PromptPrefix | None = None,
) -> Iterator[Step]:
    """Plain autoregressive sampling, one token per step.

    The next token's graph is built and queued (async_eval) before the current
    token is handed out, so Python work overlaps the model's compute.
    """
    cfg = settings.sampler
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    history = list(prompt_tokens)

    def next_token(logits: mx.array, step_key: mx.array) -> verify_ops.SampleResult:
        logits = _penalize(logits[:, -1:, :], history, cfg)[:, 0, :]
        uniforms = verify_ops.draw_uniforms((1,), step_key)
        return verify_ops.sample(logits, cfg, uniforms, backend=settings.verify_backend)

    key, step_key = _split_key(key)
    output = prefill(trunk, prompt_tokens, trunk_cache, settings.prefill_step_size, prefix=prefix)
    logits = output.logits
    drawn = next_token(logits, step_key)
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
        logits = trunk.model(drawn.tokens.reshape(1, 1), cache=trunk_cache)
        upcoming = next_token(logits, step_key)
        mx.async_eval(upcoming.tokens, upcoming.invalid)
        yield Step([token_id], logprobs=logprobs)
        drawn = upcoming


def _trunk_hidden(output: TrunkOutput, head: DraftHead) -> mx.array:
    return output.hidden_pre_norm if head.hidden_source == "pre_norm" else output.hidden_post_norm


def mtp_decode(
    trunk: Trunk,
    head: DraftHead,
    prompt_tokens: list[int],
    settings: DecodeSettings,
    key: mx.array,
    trunk_cache: list | None = None,
    head_cache: list | None = None,
    prefix: PromptPrefix | None = None,
) -> Iterator[Step]:
    """Exact speculative decoding with the model's MTP head as the drafter."""
    if settings.depth < 1:
        raise MtplxError(f"depth must be >= 1 (got {settings.depth})")
    cfg = settings.sampler
    depth = settings.depth
    trunk_cache = trunk_cache if trunk_cache is not None else trunk.make_cache()
    head_cache = head_cache if head_cache is not None else head.make_cache()
    reason = cache_ops.check_rollback_support(trunk_cache, trunk.model)
    if reason is not None:
        raise MtplxError(f"MTP cannot run on this model: {reason}; use --no-mtp")
    history = list(prompt_tokens)
    num_prompt = len(prompt_tokens)

    def head_prefill(output: TrunkOutput, start: int, end: int) -> None:
        # Head position i pairs trunk hidden i with token i+1; the last prompt
        # position pairs with the first generated token, at the first cycle.
        stop = min(end, num_prompt - 1)
        if stop > start:
            hidden = _trunk_hidden(output, head)[:, : stop - start]
            head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], head_cache)
            mx.eval([c.state for c in head_cache])

    key, step_key = _split_key(key)
    # A head without a cache of its own (a Gemma 4 assistant reads the trunk's) has nothing to prefill.
    output = prefill(
        trunk,
        prompt_tokens,
        trunk_cache,
        settings.prefill_step_size,
        head_prefill if head_cache else None,
        prefix,
    )
    first_logits = _penalize(output.logits[:, -1:, :], history, cfg)[:, 0, :]
    first = verify_ops.sample(
        first_logits, cfg, verify_ops.draw_uniforms((1,), step_key), backend=settings.verify_backend
    )
    mx.eval(first.tokens, first.invalid)
    pending = int(first.checked().tokens.item())
    history.append(pending)
    yield Step(
        [pending],
        logprobs=None
        if settings.logprobs is None
        else _token_logprobs(output.logits[0, -1:], [pending], settings.logprobs),
    )

    # True (hidden, next token) pairs the head has not yet seen; the last pair drafts d_1.
    head_hidden_in = _trunk_hidden(output, head)[:, -1:]
    head_tokens_in = [pending]

    while True:
        key, draft_key, accept_key, sample_key = mx.random.split(key, 4)
        draft_uniforms = verify_ops.draw_uniforms((depth,), draft_key)

        # 1. Draft d_1..d_k, chained on the head's own output.
        head_out = head(head_hidden_in, mx.array(head_tokens_in)[None], head_cache, trunk_cache=trunk_cache)[
            :, -1:
        ]
        draft_tokens: list[mx.array] = []
        draft_probs: list[mx.array] = []
        drafts_invalid = mx.array(0, dtype=mx.int32)  # lazy validity flags, read with the accept count
        for i in range(depth):
            if i > 0:
                head_out = head(
                    head.chain_input(head_out),
                    draft_tokens[-1].reshape(1, 1),
                    head_cache,
                    step=i,
                    trunk_cache=trunk_cache,
                )
            logits = head.logits(head_out, step=i)[:, -1, :]
            if cfg.has_penalties:  # draft i sees the committed tokens and d_1..d_{i-1}, kept lazy (no sync)
                context = mx.concatenate(
                    [mx.array(history, dtype=mx.int32)[None], *[t.reshape(1, 1) for t in draft_tokens]],
                    axis=1,
                )
                logits = verify_ops.penalize_logits(logits[:, None, :], context, cfg)[:, 0, :]
            if settings.greedy_draft:
                token = mx.argmax(logits, axis=-1).astype(mx.int32)
            else:
                drawn = verify_ops.sample(
                    logits, cfg, draft_uniforms[i : i + 1], backend=settings.verify_backend
                )
                token = drawn.tokens.astype(mx.int32)
                draft_probs.append(drawn.probs)
                drafts_invalid = drafts_invalid | drawn.invalid
            draft_tokens.append(token)

        # 2. One trunk forward over [pending, d_1..d_k]; 3. verify.
        drafts = mx.stack(draft_tokens, axis=1)  # [1, k]
        block = mx.concatenate([mx.array([[pending]], dtype=mx.int32), drafts], axis=1)
        capture = cache_ops.begin_block(trunk_cache, block_len=depth + 1)
        try:
            output = trunk(block, trunk_cache)
            target_logits = _penalize(output.logits, history, cfg, drafts)
            result = verify_ops.verify(
                target_logits,
                drafts,
                None if settings.greedy_draft else mx.stack(draft_probs, axis=1),
                cfg,
                verify_ops.draw_uniforms((1, depth), accept_key),
                verify_ops.draw_uniforms((1,), sample_key),
                backend=settings.verify_backend,
            )
            # The cycle's one sync: tokens, accept count and every lazy validity flag together.
            invalid = result.invalid | drafts_invalid
            mx.eval(result, drafts, invalid)
            verify_ops.raise_if_invalid(invalid)
        except BaseException:
            # Interrupted or failed mid-cycle: leave the caches as they were before the block.
            cache_ops.abort_block(trunk_cache, capture)
            raise
        # Reads of evaluated arrays only (indexing first would queue new work).
        num_accepted = int(result.num_accepted.item())
        next_token = int(result.next_token.item())
        accepted = drafts.tolist()[0][:num_accepted]

        # 4. Roll back to the committed prefix.
        cache_ops.commit_block(trunk_cache, capture, num_accepted + 1)
        cache_ops.trim_kv(head_cache, depth - 1)
        head_hidden_in = _trunk_hidden(output, head)[:, : num_accepted + 1]
        head_tokens_in = accepted + [next_token]

        committed = accepted + [next_token]
        history.extend(committed)
        pending = next_token
        logprobs = (
            None
            if settings.logprobs is None
            else _token_logprobs(output.logits[0, : num_accepted + 1], committed, settings.logprobs)
        )
        yield Step(committed, depth, num_accepted, result.accept_probs.tolist()[0], logprobs)
