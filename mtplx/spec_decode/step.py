"""What one decode step yields (`Step`, `TokenLogprobs`), where a prompt cache leaves a request
(`PromptPrefix`), and the pieces every row's start shares: prefill in chunks, the first token's
draw, the grammar's advance by committed tokens, a key's split.

The one cycle that uses them is `mtplx.spec_decode.loop.BatchDecoder` (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.trunk.model import Trunk, TrunkOutput

import mlx.core as mx

__all__ = [
    "PromptPrefix",
    "Step",
    "TokenLogprobs",
    "grammar_step",
    "prefill",
    "prefill_chunk",
    "prefill_last",
    "split_key",
    "token_logprobs",
]


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


def token_logprobs(logits: mx.array, tokens: list[int], top: int) -> list[TokenLogprobs]:
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


def split_key(key: mx.array) -> tuple[mx.array, mx.array]:
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


def grammar_step(
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
