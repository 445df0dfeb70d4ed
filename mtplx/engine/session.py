"""`CacheSession`: what one request stores back into the prompt cache, and when; `open_session`:
the caches it starts from, taken from the prompt cache or made fresh (its row holds them).

Invariant: what is stored is consistent with the tokens the loop has seen. Pure-KV caches are
handed over at the end (trimmed on reuse); caches with recurrent or sliding-window state are
snapshotted by the loop's `PromptPrefix` hook when they hold all prompt positions but the last,
and at the store's boundaries in the prompt (`mtplx.trunk.prompt_boundaries`: the system
prompt's end, the generation prompt's start), where prefill chunks are cut (`prefill`). A
snapshot the store already holds is not taken again.
"""

from __future__ import annotations

from mtplx.spec_decode.rows import PendingRow
from mtplx.spec_decode.step import PromptPrefix
from mtplx.trunk.prompt_cache import CacheHit, PromptCache, copy_cache, held_positions, is_trimmable

__all__ = ["CacheSession", "open_session"]


class CacheSession:
    """What one request stores back into the prompt cache, and when.

    It holds no caches of its own: the request's row does (`PendingRow` while it prefills, then
    the decoder's row), and each store is handed the caches it stores, so a row that starts from
    other caches (a fork's copy, the prompt cache's better prefix) needs no second holder kept in
    step. Caches that cannot be moved back (recurrent state) are snapshotted when they hold all
    prompt positions but the last; pure KV caches are handed over at the end, covering the
    generated tokens too (a chat's next turn repeats them).
    """

    def __init__(
        self,
        store: PromptCache,
        prompt_tokens: list[int],
        trunk_cache: list,
        head_cache: list | None,
        start: int,
        with_drafter: bool = False,
    ):
        """``trunk_cache`` / ``head_cache``: the caches the request starts from (read here for
        their kinds, not kept); ``start`` prompt positions held in them; ``with_drafter``: a block
        drafter row (its drafter's context is stored and reused beside them)."""
        self.store = store
        self.prompt_tokens = prompt_tokens
        self.with_head = head_cache is not None
        self.with_drafter = with_drafter
        self.trimmable = is_trimmable(trunk_cache) and (head_cache is None or is_trimmable(head_cache))
        self.tokens = list(prompt_tokens)  # every token the decode loop has seen
        # The row whose caches a prompt-prefix snapshot reads (set by whoever starts the row).
        self.row: PendingRow | None = None
        snapshots = not self.trimmable and store.max_bytes > 0
        self.prefix = PromptPrefix(start, self._snapshot if snapshots else None)
        # Where prefill stops to snapshot (beyond the cached prefix, before the last prompt token).
        marks = store.boundaries(prompt_tokens) if snapshots and store.boundaries is not None else []
        self.marks = [p for p in marks if start < p < len(prompt_tokens) - 1]

    def _snapshot(self, size: int) -> None:
        self.snapshot(size, self.row.trunk_cache, self.row.head_cache)

    def snapshot(self, size: int, trunk_cache: list, head_cache: list | None) -> None:
        """Copies of caches holding the first ``size`` prompt positions go into the store (to disk
        too), unless it holds that prefix already."""
        head_cache = head_cache if self.with_head else None
        if not self.store.holds(self.prompt_tokens, size, head_cache is not None):
            self.store.insert(self.prompt_tokens, size, trunk_cache, head_cache, copy=True, persist=True)

    def prefill(self, decoder, pending, budget: int) -> bool:
        """`BatchDecoder.prefill` of up to ``budget`` prompt tokens, cut at the next boundary mark,
        where the caches are snapshotted; True when only the last prompt token is left."""
        mark = next((p for p in self.marks if p > pending.position), None)
        step = budget if mark is None else min(budget, mark - pending.position)
        ready = decoder.prefill(pending, step)
        if pending.position == mark:
            self.snapshot(mark, pending.trunk_cache, pending.head_cache)
        return ready

    def record(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def better_prefix(self, start: int) -> CacheHit | None:
        """Caches holding more than ``start`` prompt positions, if the store has them by now (a
        request prefilled since this one was planned); None otherwise. Pure-KV caches only."""
        if not self.trimmable or self.store.max_bytes == 0:
            return None
        return self.store.lookup(self.prompt_tokens, self.with_head, start, self.with_drafter)

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
        size = min(held_positions(trunk_cache, head_cache, drafter_cache), len(self.prompt_tokens))
        self.store.insert(
            self.prompt_tokens, size, trunk_cache, head_cache, copy=False, drafter_cache=drafter_cache
        )

    @property
    def stores_at_finish(self) -> bool:
        """Whether `finish` stores anything (pure-KV caches and a store with room)."""
        return self.trimmable and self.store.max_bytes > 0

    def finish(self, trunk_cache: list, head_cache: list | None, drafter_cache: list | None = None) -> None:
        """The decode loop stopped between steps, its row's caches (given, the row's own or
        copies; a block drafter's context too) consistent with ``tokens``: they go into the store."""
        if not self.stores_at_finish:
            return
        head_cache = head_cache if self.with_head else None
        drafter_cache = drafter_cache if self.with_drafter else None
        size = min(held_positions(trunk_cache, head_cache, drafter_cache), len(self.tokens))
        self.store.insert(
            self.tokens, size, trunk_cache, head_cache, copy=False, persist=True, drafter_cache=drafter_cache
        )


def open_session(
    store: PromptCache, trunk, head, prompt_tokens: list[int], with_head: bool, with_drafter: bool = False
) -> tuple[CacheSession, CacheHit]:
    """The caches a request starts from (the longest reusable prefix in ``store``, else fresh
    ones; ``with_drafter``: a block drafter row, whose drafter's context must be in the entry:
    its ``drafter_cache`` None when fresh) and its session."""
    hit = store.lookup(prompt_tokens, with_head, with_drafter=with_drafter)
    if hit is None:
        hit = CacheHit(trunk.make_cache(), head.make_cache() if with_head else None, 0)
    if hasattr(trunk, "bind_prompt"):  # a vision trunk reads the prompt's images off its caches
        trunk.bind_prompt(hit.trunk_cache, prompt_tokens)
    session = CacheSession(store, prompt_tokens, hit.trunk_cache, hit.head_cache, hit.start, with_drafter)
    return session, hit
