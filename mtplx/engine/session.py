"""`CacheSession`: what one request stores back into the prompt cache, and when; `starting_caches`:
the caches it starts from, taken from the prompt cache or made fresh (its row holds them).

Invariant: what is stored is consistent with the tokens the loop has seen. Pure-KV caches are
handed over at the end (trimmed on reuse); caches with recurrent or sliding-window state are
snapshotted by the loop's `PromptPrefix` hook when they hold all prompt positions but the last,
and at the store's boundaries in the prompt (`mtplx.trunk.prompt_boundaries`: the system
prompt's end, the generation prompt's start), where prefill chunks are cut (`prefill`). A
snapshot the store already holds is not taken again.
"""

from __future__ import annotations

from mtplx.spec_decode.rows import BatchRow
from mtplx.spec_decode.step import PromptPrefix
from mtplx.trunk.prompt_cache import CacheHit, PromptCache, copy_cache, held_positions, is_trimmable

__all__ = ["CacheSession", "starting_caches"]


class CacheSession:
    """What one request stores back into the prompt cache, and when.

    It holds no caches, no tokens and no position of its own: the request's row does (`BatchRow`,
    from its start to its leave: its prompt, its caches while it prefills, its token history),
    and each store is handed the caches it stores, so a row that starts from other caches (a
    fork's copy, the prompt cache's better prefix) needs no second holder kept in step. Caches
    that cannot be moved back (recurrent state) are snapshotted when they hold all prompt
    positions but the last; pure KV caches are handed over at the end, covering the generated
    tokens too (a chat's next turn repeats them).
    """

    def __init__(self, store: PromptCache, row: BatchRow, drafter=None):
        """``row``: the request's row, not prefilled yet (its caches are read here for their
        kinds; its prefix gets the snapshot hook where the caches cannot be trimmed back);
        ``drafter``: a block drafter row's `BlockProposer` (its drafter's context is stored and
        reused beside the caches; a snapshot reads the row's through it)."""
        self.store = store
        self.row = row
        self.with_head = row.uses_head
        self.drafter = drafter
        self.with_drafter = drafter is not None
        head_cache = row.head_cache if self.with_head else None
        self.trimmable = is_trimmable(row.trunk_cache) and (head_cache is None or is_trimmable(head_cache))
        snapshots = not self.trimmable and store.max_bytes > 0
        start, prompt = row.prefix.start, row.prompt_tokens
        if snapshots:
            row.prefix = PromptPrefix(start, self._snapshot)
        # Where prefill stops to snapshot (beyond the cached prefix, before the last prompt token).
        marks = store.boundaries(prompt) if snapshots and store.boundaries is not None else []
        self.marks = [p for p in marks if start < p < len(prompt) - 1]

    def _snapshot(self, size: int) -> None:
        self.snapshot(size, self.row.trunk_cache, self.row.head_cache)

    def snapshot(self, size: int, trunk_cache: list, head_cache: list | None) -> None:
        """Copies of caches holding the first ``size`` prompt positions (a block drafter row's
        context too) go into the store (to disk too), unless it holds that prefix already."""
        head_cache = head_cache if self.with_head else None
        drafter_cache = self._context_at(size)
        prompt = self.row.prompt_tokens
        if not self.store.holds(prompt, size, head_cache is not None, drafter_cache is not None):
            self.store.insert(
                prompt, size, trunk_cache, head_cache, copy=True, persist=True, drafter_cache=drafter_cache
            )

    def _context_at(self, size: int) -> list | None:
        """A prefilling block drafter row's context (its own cache's KV part), when it holds
        exactly the first ``size`` prompt positions, as the trunk's snapshot does; else None."""
        row = self.row
        if self.drafter is None or row.drafter_cache is None:
            return None
        context = self.drafter.stored_context(row.drafter_cache)
        return context if all(c.offset == size for c in context) else None

    def prefill(self, decoder, budget: int) -> bool:
        """`BatchDecoder.prefill` of the row, up to ``budget`` prompt tokens, cut at the next
        boundary mark, where the caches are snapshotted; True when only the last prompt token is left."""
        row = self.row
        mark = next((p for p in self.marks if p > row.position), None)
        step = budget if mark is None else min(budget, mark - row.position)
        ready = decoder.prefill(row, step)
        if row.position == mark:
            self.snapshot(mark, row.trunk_cache, row.head_cache)
        return ready

    def better_prefix(self) -> CacheHit | None:
        """Caches holding more prompt positions than the row starts from, if the store has them by
        now (a request prefilled since this one was planned); None otherwise. Pure-KV caches only."""
        if not self.trimmable or self.store.max_bytes == 0:
            return None
        return self.store.lookup(
            self.row.prompt_tokens,
            self.with_head,
            longer_than=self.row.prefix.start,
            with_drafter=self.with_drafter,
        )

    def store_prompt(
        self, trunk_cache: list, head_cache: list | None, drafter_cache: list | None = None
    ) -> None:
        """The prompt's caches, just prefilled, go into the store now (no copy: the caller is done
        with them; a block drafter's context ``drafter_cache``, its KV caches only, is copied: the
        drafter reads it when the row joins), so requests that arrive while this one decodes start
        from them; the caches it ends with replace them (`finish`). Pure-KV caches only: the
        others are snapshotted."""
        if not self.trimmable or self.store.max_bytes == 0:
            return
        head_cache = head_cache if self.with_head else None
        drafter_cache = copy_cache(drafter_cache) if self.with_drafter and drafter_cache else None
        prompt = self.row.prompt_tokens
        size = min(held_positions(trunk_cache, head_cache, drafter_cache), len(prompt))
        self.store.insert(prompt, size, trunk_cache, head_cache, copy=False, drafter_cache=drafter_cache)

    @property
    def stores_at_finish(self) -> bool:
        """Whether `finish` stores anything (pure-KV caches and a store with room)."""
        return self.trimmable and self.store.max_bytes > 0

    def finish(self, trunk_cache: list, head_cache: list | None, drafter_cache: list | None = None) -> None:
        """The decode loop stopped between steps, its row's caches (given, the row's own or
        copies; a block drafter's context too) consistent with the row's history: they go into the
        store, keyed by it."""
        if not self.stores_at_finish:
            return
        head_cache = head_cache if self.with_head else None
        drafter_cache = drafter_cache if self.with_drafter else None
        tokens = self.row.history
        size = min(held_positions(trunk_cache, head_cache, drafter_cache), len(tokens))
        self.store.insert(
            tokens, size, trunk_cache, head_cache, copy=False, persist=True, drafter_cache=drafter_cache
        )


def starting_caches(
    store: PromptCache, trunk, head, prompt_tokens: list[int], with_head: bool, with_drafter: bool = False
) -> CacheHit:
    """The caches a request starts from: the longest reusable prefix in ``store``, else fresh
    ones (``with_drafter``: a block drafter row, whose drafter's context must be in the entry; its
    ``drafter_cache`` None when fresh)."""
    hit = store.lookup(prompt_tokens, with_head, with_drafter=with_drafter)
    if hit is None:
        hit = CacheHit(trunk.make_cache(), head.make_cache() if with_head else None, 0)
    if hasattr(trunk, "bind_prompt"):  # a vision trunk reads the prompt's images off its caches
        trunk.bind_prompt(hit.trunk_cache, prompt_tokens)
    return hit
