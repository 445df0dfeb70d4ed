"""EAGLE-3 drafting in the one cycle (`Eagle3Proposer`): a chain on the drafter's own KV cache,
batch-first, rolled back after each cycle's drafts like the head's.

Glossary: Bd the rows drafting with EAGLE-3 (its members, in the order of its cache); c_r the
positions row r committed since its last draft; Ht the target's hidden size; H the drafter's.

The drafter's context (mlx-vlm 0.7.10 ``drafters/eagle3``): one pair per forwarded position p,
(the token at p + 1, the target's taps at p) at rope position p + 1, its K/V in the drafter's
cache (one `RaggedKVCache` per drafter layer). A prefilling row fills its own single-row cache
from its prompt's pairs (`prefill_observer`); the last prompt position's taps wait for the
row's first token (``WaitingTaps``), and move to the row when it joins the drafter's cache.

Cycle, for every member row in one batch:

1. its c_r new pairs (the taps `commit` left on the row, each with the token after it, the last
   one the row's pending token) go through the drafter, padded to the longest row; they stay in
   the cache. The output at the last pair gives q_1, the distribution of the first draft
   (``target_logits``: the draft vocabulary placed on the target's through ``d2t``, zero
   probability elsewhere: the drafter never proposes there, so min(1, p/q) and the residual
   max(0, p - q) stay exact);
2. draft j + 1 from the pair (d_j, the drafter's own output at the step before): one step of
   width 1 per draft, appended to the cache; each draft drawn from its own q (`draw_drafts`: the
   row's draft sampler, penalties, greedy or sampled; a grammar row's first draft masked);
3. the chain's K/V are dropped (each row's cache length set back to its committed context): the
   next cycle's pairs are the committed ones, with the target's taps.

Nothing of the chain depends on the verify uniforms, so the verifier's ratio is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.spec_decode.block_proposer import BlockProposer
from mtplx.spec_decode.draft_block import DraftBlock

import mlx.core as mx

__all__ = ["Eagle3Proposer", "WaitingTaps", "time_chain_step", "token_embedding"]


def token_embedding(drafter, trunk):
    """The embedding an EAGLE-3 drafter reads tokens with (its tied LM head too): the target's, as
    mlx-vlm binds it whenever its shape is the drafter's; else the file's own copy."""
    from mtplx.trunk.compat_nemotron import embedding_of

    spec = drafter.spec
    own = "embed_tokens" in drafter and spec.hidden_size != spec.target_hidden_size
    return drafter.embed_tokens if own else embedding_of(trunk.inner)


def time_chain_step(loaded, num_rows: int, context: int, trunk):
    """A call running one chain step of ``loaded`` (an EAGLE-3 `BlockDrafter`) over ``num_rows``
    rows holding ``context`` pairs each (zero taps), with its logits, evaluated, the cache set back
    after: what the draft policy's cost profile times (a cycle's context forward of a few pairs
    costs about as much)."""
    from mtplx.drafters.eagle3 import eagle3_forward, eagle3_logits
    from mtplx.trunk.batch_cache import RaggedKVCache

    drafter = loaded.drafter
    embedding = token_embedding(drafter, trunk)
    cache = [RaggedKVCache(lengths=[0] * num_rows) for _ in drafter.layers]
    tokens = mx.zeros((num_rows, context), dtype=mx.int32)
    taps = mx.zeros((num_rows, context, 3 * drafter.spec.target_hidden_size), mx.float32)
    mx.eval(eagle3_forward(drafter, tokens, taps, cache, None, embedding, [context] * num_rows))
    hidden = mx.zeros((num_rows, 1, drafter.spec.hidden_size), mx.float32)

    def timed() -> None:
        out = eagle3_forward(drafter, tokens[:, :1], hidden, cache, None, embedding, [1] * num_rows)
        mx.eval(drafter.target_logits(eagle3_logits(drafter, out, embedding.as_linear)))
        for layer in cache:
            layer.set_lengths([context] * num_rows)

    return timed


class WaitingTaps:
    """The last prompt position's layer taps, waiting for the row's first token (the token after
    it). Kept at the end of a prefilling row's drafter cache list, so a fork's copy has its own."""

    def __init__(self) -> None:
        self.taps: tuple[mx.array, ...] | None = None


class Eagle3Proposer(BlockProposer):
    """An EAGLE-3 drafter drafting for one decoder's rows whose sources name it (the module
    docstring). ``forwards`` counts its context forwards (one per cycle with any drafting row),
    ``chain_steps`` the chain's (one per draft after the first, for all member rows at once)."""

    def __init__(self, loaded, trunk):
        super().__init__(loaded, trunk)
        self.chain_steps = 0
        self.embedding = token_embedding(self.drafter, trunk)

    def tapped_layers(self, trunk) -> tuple[int, ...]:
        return self.drafter.tapped_layers(len(trunk.layers))

    def row_cache(self, spec) -> list | None:
        return [*self.drafter.make_cache(), WaitingTaps()] if self.source in spec.sources else None

    def prefill_observer(self, cache: list | None, prompt_tokens: Sequence[int]):
        """Each forwarded prompt position p whose next token the prompt holds enters the row's
        cache as the pair (prompt[p + 1], taps of p); the last position's taps wait."""
        if cache is None:
            return None
        layers, waiting = cache[:-1], cache[-1]
        last = len(prompt_tokens) - 1

        def observe(output, start: int, end: int) -> None:
            if layers[0].offset != start:
                raise ValueError("EAGLE-3 prefill: the drafter's context must start where the chunk does")
            known = min(end, last) - start
            if known > 0:
                tokens = mx.array([prompt_tokens[start + 1 : start + 1 + known]], dtype=mx.int32)
                taps = mx.concatenate([t[:, :known] for t in output.layer_hidden], axis=-1)
                self._drafter_forward(tokens, taps, layers, None)
                mx.eval([c.state for c in layers])
            if end > last:
                waiting.taps = tuple(t[:, last - start : last - start + 1] for t in output.layer_hidden)

        return observe

    def context_from(self, stored: list) -> list:
        return [*stored, WaitingTaps()]

    def stored_context(self, row_cache: list) -> list:
        return row_cache[:-1]

    def _waiting_taps(self, row_cache: list) -> list:
        waiting = row_cache[-1].taps
        return [waiting] if waiting is not None else []

    def _extend(self, row, cache: list, taps) -> None:
        """Each tap's pair (the token after its position: the row's history ends with them)."""
        count = sum(int(t[0].shape[1]) for t in taps)
        joined = mx.concatenate([mx.concatenate(t, axis=-1) for t in taps], axis=1)
        self._drafter_forward(mx.array([row.history[-count:]], dtype=mx.int32), joined, cache, None)

    def _joined(self, row) -> None:
        waiting = row.drafter_cache[-1].taps
        if waiting is not None:
            row.drafter_taps = [waiting, *row.drafter_taps]

    def _drafter_forward(self, tokens: mx.array, hidden: mx.array, cache: list, counts) -> mx.array:
        from mtplx.drafters.eagle3 import eagle3_forward

        return eagle3_forward(self.drafter, tokens, hidden, cache, None, self.embedding, counts)

    def _target_logits(self, hidden: mx.array) -> mx.array:
        """Logits [Bd, V] on the target's vocabulary of the drafter's hidden [Bd, H] (-inf off the
        draft vocabulary; a grammar row whose mask allows only such ids drafts uniformly among
        them: `sample.target.masked_draft_logits`)."""
        from mtplx.drafters.eagle3 import eagle3_logits

        return self.drafter.target_logits(eagle3_logits(self.drafter, hidden, self.embedding.as_linear))

    def propose(self, rows: Sequence, keys: Sequence, most: Sequence[int]) -> DraftBlock:
        """At most ``most[r]`` (<= P) drafts for each member row r: the context forward over every
        member row (each consumes its new pairs whether it drafts or not), then the chain."""
        index = self._members(rows)
        members = [rows[i] for i in index]
        width = min(max(most[i] for i in index), self.max_drafts)
        counts, taps = self._new_context(members)
        if min(counts) < 1:
            raise ValueError("EAGLE-3: a member row has no committed position to draft from")
        longest = max(counts)
        tokens = mx.array(
            [row.history[-c:] + [0] * (longest - c) for row, c in zip(members, counts)], dtype=mx.int32
        )
        out = self._drafter_forward(tokens, mx.concatenate(taps, axis=-1), self.cache, counts)
        self.forwards += 1
        hidden = mx.take_along_axis(out, mx.array(counts, dtype=mx.int32)[:, None, None] - 1, axis=1)
        committed = list(self.cache[0].lengths)

        def logits_at(j: int, drafts: list[mx.array]) -> mx.array:
            nonlocal hidden
            if j:
                hidden = self._drafter_forward(drafts[-1][:, None], hidden, self.cache, [1] * len(members))
                self.chain_steps += 1
            return self._target_logits(hidden[:, 0])

        drafts, probs, sure, flags = self._draw_positions(
            members, [keys[i] for i in index], [most[i] for i in index], width, logits_at
        )
        for layer in self.cache:  # the chain rolled back: the context holds committed pairs only
            layer.set_lengths(committed)
        return self._block(rows, index, most, width, drafts, probs, sure, flags)
