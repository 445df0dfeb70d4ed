"""Block drafters as drafters of the one cycle (`BlockProposer`): DFlash, DFlash2 and DSpark
(`mtplx.drafters`) draft a whole block in one forward for every row using them, batch-first.

Glossary: B the batch's rows; Bd the rows that use the block drafter (its members, in the order
of its own cache); c_r the positions row r committed since its last block; P the drafts a block
holds (the trained block size less the anchor; DSpark's ``proposal_length``); V the vocabulary.

State: the drafter's context K/V of every committed position of each member row, in one
`RaggedKVCache` per drafter layer (rows of different lengths, `mtplx.trunk.batch_cache`). A
prefilling row fills its own single-row cache from the prefill chunks' layer taps
(`prefill_observer`); it joins the drafter's cache at its first proposal. Each cycle a member
row's newly committed positions' taps (`commit`: the trunk's layer taps at the pending token
and the accepted drafts) wait on the row (``drafter_taps``) and enter the context at the next
block forward, whether the row drafts that cycle or not. The block's own K/V never enter the
cache, so nothing is rolled back. The prompt cache keeps a row's context beside its trunk caches:
`extract` (the drafter's row, then the taps waiting on it) at the end of a request, and
`context_from` makes a new row's own cache of a hit's copy (`mtplx.trunk.prompt_cache`).

Cycle: one forward of ``[anchor_r, mask x P]`` (the anchor is the row's pending token) over
every member row, its new context of c_r positions padded to the longest; then each position's
draft is drawn from its own q (`head_chain.draw_drafts`: the row's draft sampler, penalties,
greedy or sampled), in block order: position j's q depends on the draft before it only where the
layout says so (DSpark's Markov term, DFlash2's candidate selector), never on the verify
uniforms, so `rejection.verify`'s min(1, p/q) and residual stay exact. A grammar row's first
draft is drawn from its masked distribution (the mask after the committed text, as the head's);
later drafts unmasked (verify masks the target at every position). DSpark's confidence head
returns each draft's confidence: a row with an adaptive threshold has its block cut after its
first unsure draft (the loop's length policy, as for the head's confidences).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtplx.spec_decode.draft_block import DraftBlock, Outcome, pad_time, padded_uniforms
from mtplx.spec_decode.head_chain import draw_drafts
from mtplx.spec_decode.sources import Source
from mtplx.trunk.batch_cache import RaggedKVCache

import mlx.core as mx

__all__ = [
    "BlockDrafter",
    "BlockProposer",
    "block_forward",
    "drafters_loaded",
    "first_masks",
    "time_block_forward",
]


@dataclass(frozen=True)
class BlockDrafter:
    """A loaded block drafter (`mtplx.drafters`: DFlash, DFlash2 or DSpark) and its source; each
    decoder drafts with it through its own `BlockProposer` (the rows' state is the decoder's)."""

    drafter: Any
    source: Source


class BlockProposer:
    """A DFlash / DFlash2 / DSpark drafter drafting for one decoder's rows whose sources name it
    (the module docstring). ``forwards`` counts its block forwards (one per cycle with any
    drafting row)."""

    def __init__(self, loaded: BlockDrafter, trunk):
        drafter, source = loaded.drafter, loaded.source
        self.drafter, self.trunk, self.source = drafter, trunk, source
        self.layout = source.value
        self.cache: list[RaggedKVCache] = [RaggedKVCache() for _ in drafter.layers]
        self.row_ids: list[int] = []  # the member rows, in the cache's row order
        self.forwards = 0
        trunk.tap_layers(self.tapped_layers(trunk))

    def tapped_layers(self, trunk) -> tuple[int, ...]:
        """The trunk layers whose outputs the drafter reads, in its order."""
        return tuple(self.drafter.target_layer_ids)

    @property
    def max_drafts(self) -> int:
        """P: the most drafts one block holds (the trained block size is the ceiling)."""
        if self.source is Source.DSPARK:
            return int(self.drafter.dspark.proposal_length)
        return int(self.drafter.spec.block_size) - 1

    def row_cache(self, spec) -> list | None:
        """A new row's own context cache while it prefills (None: the row does not use the drafter)."""
        return self.drafter.make_cache() if self.source in spec.sources else None

    def prefill_observer(self, cache: list | None, prompt_tokens: Sequence[int]):
        """What feeds a prefilling row's own context cache: every forwarded prompt position
        (None for a row that does not use the drafter; ``prompt_tokens``: the row's prompt)."""
        if cache is None:
            return None

        def observe(output, start: int, end: int) -> None:
            self.drafter.extend_context(output.layer_hidden, cache)
            mx.eval([c.state for c in cache])

        return observe

    # ------------------------------------------------------------------ members join and leave
    def _members(self, rows: Sequence) -> list[int]:
        """The batch indices of the member rows in the cache's order, after rows that left are
        dropped and rows that joined (their prefilled caches) are added."""
        members = {row.row_id: i for i, row in enumerate(rows) if self.source in row.spec.sources}
        keep = [j for j, rid in enumerate(self.row_ids) if rid in members]
        if len(keep) != len(self.row_ids):
            for layer in self.cache:
                layer.remove_rows(keep)
            self.row_ids = [self.row_ids[j] for j in keep]
        held = set(self.row_ids)
        joining = [rows[i] for rid, i in members.items() if rid not in held]
        if joining:
            for n, layer in enumerate(self.cache):
                layer.add_rows([row.drafter_cache[n] for row in joining])
            for row in joining:
                self._joined(row)
                row.drafter_cache = None
                self.row_ids.append(row.row_id)
        return [members[rid] for rid in self.row_ids]

    def _joined(self, row) -> None:
        """A row's prefilled cache has joined the drafter's (EAGLE-3 moves the taps it kept)."""

    # ------------------------------------------------------------------ the prompt cache
    def context_from(self, stored: list) -> list:
        """A prefilling row's own context cache from the prompt cache's copy of a row's context
        (its KV caches, `stored_context`)."""
        return stored

    def stored_context(self, row_cache: list) -> list:
        """The KV caches of a prefilling row's own context cache (what the prompt cache keeps)."""
        return row_cache

    def _waiting_taps(self, row_cache: list) -> list:
        """Taps a prefilling row's own cache keeps for the row's next context forward."""
        return []

    def extract(self, rows: Sequence, index: int) -> list:
        """Row ``rows[index]``'s whole context as single-row KV caches (copies, evaluated), for the
        prompt cache: what the drafter holds of it (its own cache if it has not joined yet), then
        the taps waiting on the row forwarded in, so it covers every position the trunk holds."""
        from mtplx.trunk.compat import copy_cache

        row = rows[index]
        if row.drafter_cache is not None:
            cache = copy_cache(self.stored_context(row.drafter_cache))
            taps = [*self._waiting_taps(row.drafter_cache), *row.drafter_taps]
        else:
            member = self.row_ids.index(row.row_id)
            cache, taps = [layer.extract(member) for layer in self.cache], row.drafter_taps
        if taps:
            self._extend(row, cache, taps)
        mx.eval([c.state for c in cache])
        return cache

    def _extend(self, row, cache: list, taps: Sequence[tuple[mx.array, ...]]) -> None:
        """One row's context ``cache`` extended by the positions of ``taps`` (oldest first)."""
        layers = [mx.concatenate([t[n] for t in taps], axis=1) for n in range(len(taps[0]))]
        self.drafter.extend_context(layers, cache)

    # ------------------------------------------------------------------ the cycle
    def propose_free(self, rows: Sequence, keys: Sequence, chosen: Sequence, caps: Sequence[int]):
        """The block for the member rows no earlier drafter took (``chosen[r]`` None), each cut to
        its cap; None when no such row drafts."""
        most = [
            min(self.max_drafts, cap) if self.source in row.spec.sources and c is None else 0
            for row, c, cap in zip(rows, chosen, caps)
        ]
        return self.propose(rows, keys, most) if any(most) else None

    def propose(self, rows: Sequence, keys: Sequence, most: Sequence[int]) -> DraftBlock:
        """At most ``most[r]`` (<= P) drafts for each member row r, from one block forward over
        every member row (each consumes its new context whether it drafts or not)."""
        index = self._members(rows)
        members = [rows[i] for i in index]
        width = min(max(most[i] for i in index), self.max_drafts)
        hidden, logits = self._forward(members)
        anchor = mx.array([row.pending for row in members], dtype=mx.int32)

        def logits_at(j: int, drafts: list[mx.array]) -> mx.array:
            return self._position_logits(hidden, logits, j, anchor if j == 0 else drafts[-1])

        drafts, probs, sure, flags = self._draw_positions(
            members, [keys[i] for i in index], [most[i] for i in index], width, logits_at
        )
        confidence = [
            self._confidence(hidden, j, anchor if j == 0 else drafts[j - 1], sure[j]) for j in range(width)
        ]
        return self._block(rows, index, most, width, drafts, probs, confidence, flags)

    def _draw_positions(self, members: Sequence, keys: Sequence, most: Sequence[int], width: int, logits_at):
        """Drafts for positions 0..width-1 of the member rows, position j drawn from
        ``logits_at(j, drafts so far)`` [Bd, V]: (drafts, q, probability drawn with, invalid flags),
        one [Bd] / [Bd, V] array per position."""
        # A row draws P uniforms whatever the block's width, so its draws do not depend on the batch.
        uniforms = [padded_uniforms(self.max_drafts, width, key.draft) for key in keys]
        first_allowed = first_masks(members, most)
        drafts: list[mx.array] = []
        probs, sure, flags = [], [], []
        for j in range(width):
            token, q, invalid, p_sure = draw_drafts(
                members,
                logits_at(j, drafts),
                drafts,
                [u[j : j + 1] for u in uniforms],
                first_allowed if j == 0 else None,
            )
            drafts.append(token)
            probs.append(q)
            sure.append(p_sure)
            flags.append(invalid)
        return drafts, probs, sure, flags

    def _forward(self, members: Sequence) -> tuple[mx.array, mx.array]:
        """One block forward over the member rows: (hidden [Bd, P, H], logits [Bd, P, V]) at the
        draft positions."""
        counts, taps = self._new_context(members)
        anchor = mx.array([row.pending for row in members], dtype=mx.int32)
        self.forwards += 1
        return block_forward(self.drafter, self.source, self.trunk, anchor, taps, self.cache, counts)

    def _new_context(self, members: Sequence) -> tuple[list[int], list[mx.array]]:
        """Each member row's new context (the layer taps waiting on it, then cleared): (its
        count c_r, one [Bd, max c_r, Ht] per tapped layer, padded past each row's count)."""
        counts = [sum(int(t[0].shape[1]) for t in row.drafter_taps) for row in members]
        longest = max(counts)
        taps = []
        for layer in range(len(self.trunk.tapped_layers)):
            parts = [
                pad_time(mx.concatenate([t[layer] for t in row.drafter_taps], axis=1), longest)
                if row.drafter_taps
                else mx.zeros((1, longest, self.tap_width), mx.float32)
                for row in members
            ]
            taps.append(mx.concatenate(parts, axis=0))
        for row in members:
            row.drafter_taps = []
        return counts, taps

    @property
    def tap_width(self) -> int:
        """The width of one layer tap (the trunk's hidden size)."""
        return int(self.drafter.fc.weight.shape[1]) // len(self.trunk.tapped_layers)

    def _position_logits(self, hidden: mx.array, logits: mx.array, j: int, previous: mx.array) -> mx.array:
        """Position j's draft logits [Bd, V], given the token before it (``previous`` [Bd])."""
        from mtplx.drafters import dflash2, dspark

        if self.source is Source.DSPARK:
            return dspark.dspark_step_logits(self.drafter, logits[:, j : j + 1], previous[:, None])[:, 0]
        if self.source is Source.DFLASH2:
            return dflash2.dflash2_scores(
                self.drafter, hidden[:, j : j + 1], logits[:, j : j + 1], previous[:, None]
            )[:, 0]
        return logits[:, j]

    def _confidence(self, hidden: mx.array, j: int, previous: mx.array, drawn: mx.array) -> mx.array:
        """Position j's confidence [Bd]: DSpark's confidence head where it has one, else the
        probability the draft was drawn with (as the head's)."""
        if self.source is Source.DSPARK:
            from mtplx.drafters import dspark

            head = dspark.dspark_confidence(self.drafter, hidden[:, j : j + 1], previous[:, None])
            if head is not None:
                return head[:, 0]
        return drawn

    def _block(self, rows, index, most, width, drafts, probs, confidence, flags) -> DraftBlock:
        """The members' drafts placed on the batch's B rows (length 0 for the others)."""
        batch = len(rows)
        # Batch row -> member row; a non-member reads a zero row appended after the members.
        where = [len(index)] * batch
        for m, i in enumerate(index):
            where[i] = m
        take = mx.array(where, dtype=mx.int32)

        def placed(x: mx.array) -> mx.array:
            return mx.concatenate([x, mx.zeros((1, *x.shape[1:]), x.dtype)])[take]

        tokens = placed(mx.stack(drafts, axis=1))
        q = placed(mx.stack(probs, axis=1))
        sure = placed(mx.stack(confidence, axis=1))
        invalid = flags[0]
        for flag in flags[1:]:
            invalid = invalid | flag
        lengths = [min(most[i], width) if where[i] < len(index) else 0 for i in range(batch)]
        return DraftBlock(
            tokens,
            lengths,
            [((self.source, n),) if n else () for n in lengths],
            q=q,
            confidence=sure,
            invalid=invalid,
        )

    def commit(self, rows: Sequence, outcome: Outcome) -> None:
        """Each member row's committed positions' layer taps (the pending token and the accepted
        drafts) wait for its next block forward."""
        taps = outcome.output.layer_hidden
        for i, row in enumerate(rows):
            if self.source in row.spec.sources:
                n = outcome.num_accepted[i]
                row.drafter_taps.append(tuple(t[i : i + 1, : n + 1] for t in taps))


def first_masks(members: Sequence, most: Sequence[int]) -> mx.array | None:
    """bool [Bd, V]: each drafting grammar row's mask after its committed text (all allowed for
    the others), for its first draft; None without a grammar row."""
    masks = [
        row.constraint.mask_after() if row.constraint is not None and n else None
        for row, n in zip(members, most)
    ]
    if all(m is None for m in masks):
        return None
    free = mx.ones_like(next(m for m in masks if m is not None))
    return mx.stack([m if m is not None else free for m in masks])


def block_forward(drafter, source: Source, trunk, anchor: mx.array, taps, cache, counts) -> tuple:
    """One block forward of a DFlash / DFlash2 / DSpark drafter over rows whose new context is the
    layer taps ``taps`` (row r's first counts[r] positions) and whose block starts at ``anchor``
    [Bd]: (hidden [Bd, P, H], logits [Bd, P, V]) at the draft positions."""
    from mtplx.drafters import dflash, dflash2, dspark

    # DSpark's block: its own length (`DSparkDrafter.block_tokens`); else [anchor, mask x P].
    size = None if source is Source.DSPARK else int(drafter.spec.block_size)
    block = drafter.block_tokens(anchor, size)
    scale = float(getattr(trunk.inner, "embed_scale", 1.0))
    shared = (block, taps, cache, trunk.embed, trunk.lm_head, scale, counts)
    if source is Source.DSPARK:
        return dspark.dspark_base(drafter, *shared)
    if source is Source.DFLASH2:
        return dflash2.dflash2_block(drafter, *shared)
    out = dflash.dflash_block_logits(drafter, *shared)
    return out[:, 1:], out[:, 1:]


def time_block_forward(loaded: BlockDrafter, num_rows: int, context: int, trunk):
    """A call running one block forward of ``loaded`` over ``num_rows`` rows holding ``context``
    positions each (zero taps) and one new position each (a cycle that kept nothing), evaluated,
    the cache set back after: what the draft policy's cost profile times."""
    taps_of = len(loaded.drafter.target_layer_ids)
    tap_width = int(loaded.drafter.fc.weight.shape[1]) // taps_of
    cache = [RaggedKVCache(lengths=[0] * num_rows) for _ in loaded.drafter.layers]
    anchor = mx.zeros((num_rows,), dtype=mx.int32)

    def forward(length: int) -> None:
        taps = [mx.zeros((num_rows, length, tap_width), mx.float32)] * taps_of
        mx.eval(block_forward(loaded.drafter, loaded.source, trunk, anchor, taps, cache, [length] * num_rows))

    forward(context)

    def timed() -> None:
        forward(1)
        for layer in cache:
            layer.set_lengths([context] * num_rows)

    return timed


def drafters_loaded(sources: Sequence[Source], chain, blocks: BlockProposer | None) -> bool:
    """Whether a decoder with this head chain and block drafter serves every one of a row's sources."""
    loaded = {Source.LOOKUP, Source.MODEL}
    loaded |= {chain.source} if chain is not None else set()
    loaded |= {blocks.source} if blocks is not None else set()
    return set(sources) <= loaded
