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
from mtplx.trunk.prompt_cache import CacheHit, PromptCache, held_positions, is_trimmable

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

    def __init__(self, store: PromptCache, row: BatchRow):
        """``row``: the request's row, not prefilled yet (its caches are read here for their
        kinds; its prefix gets the snapshot hook where the caches cannot be trimmed back)."""
        self.store = store
        self.row = row
        self.with_head = row.uses_head
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
        """Copies of caches holding the first ``size`` prompt positions go into the store (to disk
        too), unless it holds that prefix already."""
        head_cache = head_cache if self.with_head else None
        prompt = self.row.prompt_tokens
        if not self.store.holds(prompt, size, head_cache is not None):
            self.store.insert(prompt, size, trunk_cache, head_cache, copy=True, persist=True)

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
        return self.store.lookup(self.row.prompt_tokens, self.with_head, longer_than=self.row.prefix.start)

    def store_prompt(self, trunk_cache: list, head_cache: list | None) -> None:
        """The prompt's caches, just prefilled, go into the store now (no copy: the caller is done
        with them), so requests that arrive while this one decodes start from them; the caches it
        ends with replace them (`finish`). Pure-KV caches only: the others are snapshotted."""
        if not self.trimmable or self.store.max_bytes == 0:
            return
        head_cache = head_cache if self.with_head else None
        prompt = self.row.prompt_tokens
        size = min(held_positions(trunk_cache, head_cache), len(prompt))
        self.store.insert(prompt, size, trunk_cache, head_cache, copy=False)

    @property
    def stores_at_finish(self) -> bool:
        """Whether `finish` stores anything (pure-KV caches and a store with room)."""
        return self.trimmable and self.store.max_bytes > 0

    def finish(self, trunk_cache: list, head_cache: list | None) -> None:
        """The decode loop stopped between steps, its row's caches (given, the row's own or
        copies) consistent with the row's history: they go into the store, keyed by it."""
        if not self.stores_at_finish:
            return
        head_cache = head_cache if self.with_head else None
        tokens = self.row.history
        size = min(held_positions(trunk_cache, head_cache), len(tokens))
        self.store.insert(tokens, size, trunk_cache, head_cache, copy=False, persist=True)


def starting_caches(
    store: PromptCache, trunk, head, prompt_tokens: list[int], with_head: bool, reuse: bool = True
) -> tuple[list, list | None, int]:
    """The caches a request starts from: the longest reusable prefix in ``store``, else (or with
    ``reuse`` False: a block drafter row, whose drafter reads every prompt position's layer taps
    as it prefills) fresh ones; (trunk cache, head cache or None, prompt positions they hold)."""
    hit = store.lookup(prompt_tokens, with_head) if reuse else None
    if hit is None:
        trunk_cache = trunk.make_cache()
        head_cache = head.make_cache() if with_head else None
        start = 0
    else:
        trunk_cache, head_cache, start = hit.trunk_cache, hit.head_cache, hit.start
    if hasattr(trunk, "bind_prompt"):  # a vision trunk reads the prompt's images off its caches
        trunk.bind_prompt(trunk_cache, prompt_tokens)
    return trunk_cache, head_cache, start
