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

from mtplx.spec_decode.rows import BatchRow
from mtplx.spec_decode.step import PromptPrefix
from mtplx.trunk.prompt_cache import CacheHit, PromptCache, held_positions, is_trimmable

__all__ = ["CacheSession", "open_session"]


class CacheSession:
    """What one request stores back into the prompt cache, and when.

    It holds no caches and no tokens of its own: the request's row does (`BatchRow`, from its
    start to its leave: its caches while it prefills, its token history), and each store is
    handed the caches it stores, so a row that starts from other caches (a fork's copy, the
    prompt cache's better prefix) needs no second holder kept in step. Caches that cannot be moved back (recurrent state) are snapshotted when they hold all
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
    ):
        """``trunk_cache`` / ``head_cache``: the caches the request starts from (read here for
        their kinds, not kept); ``start`` prompt positions held in them."""
        self.store = store
        self.prompt_tokens = prompt_tokens
        self.with_head = head_cache is not None
        self.trimmable = is_trimmable(trunk_cache) and (head_cache is None or is_trimmable(head_cache))
        # The row whose caches a prompt-prefix snapshot reads and whose tokens the store at the
        # end keys (set by whoever starts the row).
        self.row: BatchRow | None = None
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

    def better_prefix(self, start: int) -> CacheHit | None:
        """Caches holding more than ``start`` prompt positions, if the store has them by now (a
        request prefilled since this one was planned); None otherwise. Pure-KV caches only."""
        if not self.trimmable or self.store.max_bytes == 0:
            return None
        return self.store.lookup(self.prompt_tokens, self.with_head, longer_than=start)

    def store_prompt(self, trunk_cache: list, head_cache: list | None) -> None:
        """The prompt's caches, just prefilled, go into the store now (no copy: the caller is done
        with them), so requests that arrive while this one decodes start from them; the caches it
        ends with replace them (`finish`). Pure-KV caches only: the others are snapshotted."""
        if not self.trimmable or self.store.max_bytes == 0:
            return
        head_cache = head_cache if self.with_head else None
        size = min(held_positions(trunk_cache, head_cache), len(self.prompt_tokens))
        self.store.insert(self.prompt_tokens, size, trunk_cache, head_cache, copy=False)

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


def open_session(
    store: PromptCache, trunk, head, prompt_tokens: list[int], with_head: bool, reuse: bool = True
) -> tuple[CacheSession, list, list | None]:
    """The caches a request starts from (the longest reusable prefix in ``store``, else, or with
    ``reuse`` False, fresh ones: a block drafter row, whose drafter reads every prompt position's
    layer taps as it prefills) and its session: (session, trunk cache, head cache or None)."""
    hit = store.lookup(prompt_tokens, with_head) if reuse else None
    if hit is None:
        trunk_cache = trunk.make_cache()
        head_cache = head.make_cache() if with_head else None
        start = 0
    else:
        trunk_cache, head_cache, start = hit.trunk_cache, hit.head_cache, hit.start
    if hasattr(trunk, "bind_prompt"):  # a vision trunk reads the prompt's images off its caches
        trunk.bind_prompt(trunk_cache, prompt_tokens)
    return CacheSession(store, prompt_tokens, trunk_cache, head_cache, start), trunk_cache, head_cache
