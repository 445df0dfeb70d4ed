"""The MTP head as a drafter: a chain of head steps on its own output hidden state.

Cycle (docs/ARCHITECTURE.md): the head first consumes the true (trunk hidden i,
token i+1) pairs it has not seen yet, drafts d_1 from the last of them, then
chains: step i reads its previous output and d_i. The entries made from drafted
(not true) hidden states are dropped at commit and the committed positions are
re-fed from the trunk's true hidden states at the next proposal, so the head's
cache always equals the one a from-scratch run builds. Cycles the head did not
draft for (prompt lookup) only add true pairs.

Adaptive length: with ``adaptive_threshold`` > 0 drafting stops after a draft the
head gave less than that probability (one host read per draft step, so it is
off by default). ``depth`` stays the maximum.
"""

from __future__ import annotations

from mtplx.heads.base import DraftHead
from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.proposer import CycleOutcome, Draft, draw_draft_token, stacked_draft
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx


def trunk_hidden(output: TrunkOutput, head: DraftHead) -> mx.array:
    return output.hidden_pre_norm if head.hidden_source == "pre_norm" else output.hidden_post_norm


class HeadProposer:
    name = "head"

    def __init__(self, head: DraftHead, settings: DecodeSettings, cache: list | None = None):
        """The head drafting as ``settings`` say: sampler, depth, greedy drafts, adaptive threshold,
        verify backend. ``cache``: the request's head cache (from the prompt cache), else a fresh one."""
        self.head = head
        self.settings = settings
        self.depth = settings.depth
        self.cache = cache if cache is not None else head.make_cache()
        # True (hidden, next token) pairs the head has not consumed; the last one drafts d_1.
        self._pending_hidden: list[mx.array] = []
        self._pending_tokens: list[int] = []
        self._chained = 0  # head entries made from drafted states this cycle (dropped at commit)

    def observe_prefill(self, output: TrunkOutput, start: int, end: int, prompt_tokens: list[int]) -> None:
        # Head position i pairs trunk hidden i with token i+1; the last prompt
        # position pairs with the first generated token, at the first commit.
        # A head without a cache of its own (a Gemma 4 assistant reads the trunk's) has nothing to prefill.
        stop = min(end, len(prompt_tokens) - 1)
        if stop > start and self.cache:
            hidden = trunk_hidden(output, self.head)[:, : stop - start]
            self.head(hidden, mx.array(prompt_tokens[start + 1 : stop + 1])[None], self.cache)
            mx.eval([c.state for c in self.cache])

    def propose(
        self,
        history: list[int],
        key: mx.array,
        trunk_cache: list,
        constraint: GrammarConstraint | None = None,
    ) -> Draft:
        """Up to ``depth`` drafts. Under a grammar each is drawn from the head's masked distribution
        (the mask after the drafts before it: one host read per draft step beyond the first), and
        drafting stops after an EOS draft (nothing after it is emitted)."""
        cfg = self.settings.sampler
        uniforms = sample_ops.draw_uniforms((self.depth,), key)
        hidden_in = mx.concatenate(self._pending_hidden, axis=1)
        tokens_in = mx.array(self._pending_tokens)[None]
        self._pending_hidden, self._pending_tokens = [], []
        head_out = self.head(hidden_in, tokens_in, self.cache, trunk_cache=trunk_cache)[:, -1:]
        context = mx.array(history, dtype=mx.int32)[None] if cfg.has_penalties else None
        tokens: list[mx.array] = []
        probs: list[mx.array | None] = []
        flags: list[mx.array | None] = []
        drafted: list[int] = []  # the drafts on the host, under a grammar
        for i in range(self.depth):
            if i > 0 and constraint is not None:
                drafted.append(int(tokens[-1].item()))  # the next mask depends on this draft
                if drafted[-1] in constraint.eos:
                    break
            if i > 0:
                head_out = self.head(
                    self.head.chain_input(head_out),
                    tokens[-1].reshape(1, 1),
                    self.cache,
                    step=i,
                    trunk_cache=trunk_cache,
                )
            logits = self.head.logits(head_out, step=i)[:, -1, :]
            if context is not None and tokens:
                context = mx.concatenate([context, tokens[-1][None]], axis=1)
            allowed = constraint.mask_after(drafted) if constraint is not None else None
            token, q, invalid = draw_draft_token(logits, context, self.settings, uniforms[i : i + 1], allowed)
            tokens.append(token)
            probs.append(q)
            flags.append(invalid)
            if self.settings.adaptive_threshold > 0 and i + 1 < self.depth and self._unsure(logits, token, q):
                break
        self._chained = len(tokens) - 1
        draft = stacked_draft(tokens, probs, flags, self.name)
        draft.host_reads = len(drafted)
        return draft

    def _unsure(self, logits: mx.array, token: mx.array, q: mx.array | None) -> bool:
        """Whether the head gave its draft less than the threshold (a host read).

        q is the sampled-from distribution; for argmax drafts (or greedy requests, where
        q is one-hot) the head's plain softmax says how sure it was."""
        if q is None or self.settings.sampler.is_greedy:
            q = mx.softmax(logits.astype(mx.float32), axis=-1)
        return float(q[0, token[0]].item()) < self.settings.adaptive_threshold

    def commit(self, outcome: CycleOutcome) -> None:
        if self._chained:
            cache_ops.trim_kv(self.cache, self._chained)
        self._chained = 0
        kept = outcome.num_accepted + 1
        self._pending_hidden.append(trunk_hidden(outcome.output, self.head)[:, :kept])
        self._pending_tokens.extend(outcome.committed)
