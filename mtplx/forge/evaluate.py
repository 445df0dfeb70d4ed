"""`mtplx forge`'s evaluation: teacher-forced acceptance per depth, and the draft vocabulary.

Acceptance of a draft from q against the trunk's p is 1 - TV(p, q) (argmax agreement at
temperature 0), measured at response positions of held-out generations with the head
cache a decode loop would hold. A reduced draft vocabulary ships only when it keeps
depth-1 acceptance and makes a draft step measurably faster (``choose_draft_vocab``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mtplx.forge.loss import chain_all
from mtplx.heads.forged import ForgedMTPHead
from mtplx.trunk import compat
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np

EVAL_TEMPERATURES = (0.0, 0.7)


def acceptance(p_logits: np.ndarray, q_logits: np.ndarray, temperature: float) -> np.ndarray:
    """Per-row probability that a draft from q is accepted against p: 1 - TV(p, q).

    At temperature 0 both sides are greedy (one-hot at the argmax), so it is argmax
    agreement. -inf in q (a reduced draft vocabulary) is probability exactly 0.
    """
    if temperature == 0.0:
        return (p_logits.argmax(-1) == q_logits.argmax(-1)).astype(np.float64)

    def probs(logits: np.ndarray) -> np.ndarray:
        z = logits.astype(np.float64) / temperature
        z -= z.max(-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(-1, keepdims=True)

    return np.minimum(probs(p_logits), probs(q_logits)).sum(-1)


def _q_logits(head: Any, g: mx.array) -> np.ndarray:
    return np.asarray(head.logits(g).astype(mx.float32))


def _trunk_source(trunk_out: Any, source: str) -> mx.array:
    return trunk_out.hidden_pre_norm if source == "pre_norm" else trunk_out.hidden_post_norm


class Tally:
    """Running sums of acceptance per (vocabulary variant, depth, temperature)."""

    def __init__(
        self, variants: dict[str, np.ndarray | None], depths: int, temperatures: Sequence[float], vocab: int
    ):
        # A variant restricts q to its ids (-inf elsewhere): a reduced draft vocabulary.
        self.masks = {
            name: None if ids is None else np.isin(np.arange(vocab), ids, invert=True)
            for name, ids in variants.items()
        }
        self.temperatures = tuple(temperatures)
        self.sums = {
            v: {d: {t: 0.0 for t in self.temperatures} for d in range(1, depths + 1)} for v in variants
        }
        self.counts = {d: 0 for d in range(1, depths + 1)}
        self.depths = depths

    def add(
        self, depth: int, p_logits: np.ndarray, q_logits: np.ndarray, keep: np.ndarray | None = None
    ) -> None:
        """``keep`` (bool, the rows' shape): positions that count (response positions); None = all."""
        if keep is not None:
            p_logits, q_logits = p_logits[keep], q_logits[keep]
        for name, outside in self.masks.items():
            q = q_logits if outside is None else np.where(outside, -np.inf, q_logits)
            for t in self.temperatures:
                self.sums[name][depth][t] += float(acceptance(p_logits, q, t).sum())
        self.counts[depth] += int(np.prod(q_logits.shape[:-1]))

    def table(self) -> dict[str, dict[str, dict[str, float]]]:
        return {
            v: {
                str(d): {str(t): row[t] / max(self.counts[d], 1) for t in self.temperatures}
                for d, row in per.items()
            }
            for v, per in self.sums.items()
        }


def evaluate_acceptance(
    trunk: Trunk,
    head: Any,
    windows: np.ndarray,
    depths: int = 3,
    origins: int = 64,
    batch: int = 4,
    temperatures: Sequence[float] = EVAL_TEMPERATURES,
    progress: bool = False,
    vocab_variants: dict[str, np.ndarray | None] | None = None,
    valid: np.ndarray | None = None,
) -> Any:
    """Teacher-forced acceptance per depth on held-out windows: {"1": {"0.0": a, "0.7": b}, ...}.

    Depth 1: the head at every position t, given (trunk hidden t, true token t+1),
    against the trunk at t+1. Depth d > 1 chains the head on its own output with the
    TRUE tokens (teacher forcing) and with the head cache a decode loop would hold:
    depth-1 entries up to the origin, then the chain's own entries. That needs a
    cache state per origin, so depth > 1 uses ``origins`` evenly spaced positions.
    ``vocab_variants`` ({name: ids or None}) scores the same drafts restricted to each
    id set and returns {name: table} instead of one table. ``valid`` [N, T] (bool) counts
    only drafts whose target position s has valid[s] (the response positions of forge data).
    """
    tally = Tally(vocab_variants or {"": None}, depths, temperatures, trunk.vocab_size)
    from tqdm import tqdm

    keep_all = np.ones(windows.shape, dtype=bool) if valid is None else valid.astype(bool)
    for start in tqdm(range(0, windows.shape[0], batch), desc="eval", disable=not progress):
        tally_windows(
            trunk, head, windows[start : start + batch], keep_all[start : start + batch], origins, tally
        )
    tables = tally.table()
    return tables if vocab_variants else tables[""]


def tally_windows(
    trunk: Trunk, head: Any, windows: np.ndarray, keep: np.ndarray, origins: int, tally: Tally
) -> None:
    """Add the acceptance of ``head`` on ``windows`` [B, T] (counting positions where ``keep``) to ``tally``
    at every depth it keeps (`evaluate_acceptance`'s loop body: callers that must stop between
    batches, such as the server's background trainer, call it one batch at a time)."""
    tokens = mx.array(windows)
    out = trunk(tokens)
    p_logits = np.asarray(out.logits.astype(mx.float32))  # p at position t predicts t+1
    cache = head.make_cache()
    g = head(_trunk_source(out, head.hidden_source)[:, :-1], tokens[:, 1:], cache)  # position t predicts t+2
    tally.add(1, p_logits[:, 1:], _q_logits(head, g), keep[:, 1:])
    if tally.depths > 1:
        _eval_chain(head, tokens, p_logits, g, cache, tally.depths, origins, tally, keep)


def _eval_chain(
    head: Any,
    tokens: mx.array,
    p_logits: np.ndarray,
    g1: mx.array,
    cache: list,
    depths: int,
    origins: int,
    tally: Tally,
    keep: np.ndarray,
) -> None:
    seq_len = tokens.shape[1]
    full_state = [compat.kv_state(c) for c in cache]
    chain1 = chain_all(head, g1)
    last_origin = seq_len - depths - 1  # the deepest draft must still have a trunk target
    for j in np.unique(np.linspace(0, max(last_origin, 0), num=min(origins, last_origin + 1)).astype(int)):
        j = int(j)
        step_cache = head.make_cache()
        for c, state in zip(step_cache, full_state):
            prefix = compat.KVState(state.keys[..., : j + 1, :], state.values[..., : j + 1, :], j + 1)
            compat.set_kv_state(c, prefix)
        x = chain1[:, j : j + 1]
        for d in range(2, depths + 1):
            # Draft d sits at position j+d-1: input = previous head output + true token j+d.
            g = head(x, tokens[:, j + d : j + d + 1], step_cache)
            tally.add(d, p_logits[:, j + d], _q_logits(head, g)[:, 0], keep[:, j + d])
            x = head.chain_input(g)


# ---------------------------------------------------------------- reduced draft vocabulary


def draft_step_ms(
    head: ForgedMTPHead,
    variants: dict[str, np.ndarray | None],
    full_proj: mx.array,
    context: int = 200,
    rounds: int = 30,
) -> dict[str, float]:
    """Median ms of one greedy draft step (head on 1 token with a ``context``-long cache, logits, argmax)
    per vocabulary variant. Round-robin, so every variant sees the same machine load."""
    hidden_size = int(head.fc.weight.shape[0])
    x, token = mx.random.normal((1, 1, hidden_size), key=mx.random.key(0)), mx.array([[1]], dtype=mx.int32)
    cache = head.make_cache()
    mx.eval(
        head(
            mx.random.normal((1, context, hidden_size), key=mx.random.key(1)),
            mx.zeros((1, context), dtype=mx.int32),
            cache,
        )
    )
    saved = None if head.vocab_ids is None else head.vocab_ids.tolist()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, ids in variants.items():
            head.set_draft_vocab(None if ids is None else ids.tolist(), full_proj)
            start = time.perf_counter()
            mx.eval(mx.argmax(head.logits(head(x, token, cache))[:, -1], axis=-1))
            times[name].append(time.perf_counter() - start)
            for c in cache:
                c.trim(1)
    head.set_draft_vocab(saved, full_proj)
    return {name: round(1e3 * float(np.median(t[3:] or t)), 2) for name, t in times.items()}


def choose_draft_vocab(
    tables: dict[str, Any], step_ms: dict[str, float], max_drop: float = 0.01, min_gain: float = 0.2
) -> str:
    """The smallest reduced vocabulary that loses at most ``max_drop`` depth-1 acceptance (at every
    evaluated temperature) and drafts at least ``min_gain`` faster than the full one; else "full"."""
    full = tables["full"]["1"]
    best = "full"
    for name in sorted((n for n in tables if n != "full"), key=lambda n: int(n[3:])):
        keeps = all(tables[name]["1"][t] >= full[t] - max_drop for t in full)
        faster = step_ms[name] <= (1.0 - min_gain) * step_ms["full"]
        if keeps and faster:
            return name
    return best
