"""`mtplx forge`'s training loss: the draft chain unrolled as decode runs it, against the trunk.

The head at position t gets the trunk's hidden state at t and token t+1 and must reproduce
the trunk's recorded distribution at t+1: KL(p_trunk || q_head), on response positions
only (acceptance of a draft is 1 - TV(p, q), so matching the trunk is what pays).

The chain is unrolled exactly as the decode loop runs it (`spec_decode.head_chain`): step k feeds the head its
own previous output (``chain_input``) and the next token, and attends to the true-state
entries up to its origin plus its own chain entries (``UnrollCache``), so positions 2 and
3 are trained, not extrapolated (the training-time unrolling of HASS / EAGLE-3, whose
papers describe the idea; no code was followed). Per-step weights trade position 1
against the deeper ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mtplx.forge.record import ForgeData
from mtplx.heads.forged import lm_head_matrix
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np


@dataclass
class Batch:
    """B sequences; N = T - 1 head positions. Token / target arrays carry ``depth`` extra padded slots so
    step k (0-based) reads slice [k+1 : k+1+N]: head position i drafts at step k the token after x_{i+k+1}."""

    hidden: mx.array  # [B, N, H] trunk hidden at i (chosen source)
    tokens: mx.array  # [B, T+depth]
    top_ids: mx.array  # [B, T+depth, K] the teacher's top-K ids at s (over x_{s+1})
    top_in_shared: mx.array  # [B, T+depth, K] bool: that id is also in the shared candidate set
    p_top: mx.array  # [B, T+depth, K]
    p_rest: mx.array  # [B, T+depth] teacher mass outside the top K
    valid: mx.array  # [B, T+depth] float: s is a response position (padding: 0)
    entropy: float  # mean over valid positions of sum p log p (KL = cross-entropy + entropy)

    @property
    def positions(self) -> int:
        return int(self.hidden.shape[1])

    def targets(self, k: int) -> tuple[mx.array, ...]:
        """(tokens, top_ids, top_in_shared, p_top, p_rest, valid) of draft step k."""
        sl = slice(k + 1, k + 1 + self.positions)
        return (
            self.tokens[:, sl],
            self.top_ids[:, sl],
            self.top_in_shared[:, sl],
            self.p_top[:, sl],
            self.p_rest[:, sl],
            self.valid[:, sl],
        )


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Rows of step ``step``: epoch-wise permutations seeded by (seed, epoch), so any step is reproducible."""
    per_epoch = max(num_rows // batch_size, 1)
    epoch, within = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return np.sort(perm[within * batch_size : (within + 1) * batch_size]) if num_rows >= batch_size else perm


def make_batch(
    trunk: Trunk, data: ForgeData, rows: np.ndarray, hidden_source: str, in_shared: np.ndarray, depth: int
) -> Batch:
    """The rows of one step as a `Batch`: hidden states in the head's source, the teacher's normalized top-K."""
    hidden = mx.array(np.asarray(data.hidden[rows, :-1], dtype=np.float32))
    if hidden_source == "post_norm":
        hidden = trunk.final_norm(hidden)
    pad2, pad3 = ((0, 0), (0, depth)), ((0, 0), (0, depth), (0, 0))
    tokens = np.pad(data.tokens[rows], pad2)
    ids = np.pad(data.top_ids[rows], pad3)
    valid = np.pad(data.valid[rows], pad2)
    p = np.exp(np.pad(data.top_logp[rows], pad3, constant_values=-np.inf).astype(np.float64))
    rest = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
    total = np.maximum(p.sum(-1) + rest, 1e-30)  # float32 rounding of the stored log-probs
    p, rest = p / total[..., None], rest / total
    plogp = (p * np.log(np.maximum(p, 1e-30))).sum(-1) + rest * np.log(np.maximum(rest, 1e-30))
    entropy = float(plogp[valid].mean()) if valid.any() else 0.0
    return Batch(
        hidden,
        mx.array(tokens),
        mx.array(ids),
        mx.array(in_shared[ids]),
        mx.array(p.astype(np.float32)),
        mx.array(rest.astype(np.float32)),
        mx.array(valid.astype(np.float32)),
        entropy,
    )


def position_ce(
    g: mx.array,
    rows_matrix: mx.array,
    shared_proj: mx.array | None,
    top_ids: mx.array,
    top_in_shared: mx.array,
    p_top: mx.array,
    p_rest: mx.array,
) -> mx.array:
    """Cross-entropy [B, N] of head outputs ``g`` against the teacher's buckets {each top-K id, the rest}.

    A full-vocabulary softmax per position costs more than the head itself on a CPU, so
    q is normalised over the teacher's top-K ids plus a shared set of frequent ids
    (``shared_proj`` [H, M]; None = the full vocabulary); q's "rest" bucket is the shared
    ids outside this position's top-K, matched to the teacher's mass outside its top-K.
    """
    w_top = rows_matrix[top_ids]  # [B, N, K, H]
    logit_top = (w_top @ g[..., None]).squeeze(-1)  # [B, N, K]
    logit_shared = g @ shared_proj if shared_proj is not None else g @ rows_matrix.T
    # Top-K ids that are also shared would be counted twice in the normaliser.
    lse = mx.logsumexp(mx.concatenate([logit_shared, mx.where(top_in_shared, -mx.inf, logit_top)], -1), -1)
    logq_top = logit_top - lse[..., None]
    logq_rest = mx.log(mx.maximum(1.0 - mx.exp(logq_top).sum(-1), 1e-6))
    return -(p_top * logq_top).sum(-1) - p_rest * logq_rest


class UnrollCache:
    """A head layer's KV for all draft steps of all origins at once (one per head layer).

    Query i of step k (origin i, at sequence position i + k) sees what the decode loop's
    head cache holds when it drafts step k from origin i: the step-0 entries j <= i (true
    trunk states) and its own chain entries of steps 1..k-1, which sit at index i of
    each step's block. RoPE offset k puts step k's query i at position i + k.
    """

    def __init__(self) -> None:
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []

    @property
    def offset(self) -> int:
        return len(self.keys)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.keys.append(keys)
        self.values.append(values)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)

    def make_mask(self, n: int, **_: Any) -> mx.array:
        idx = mx.arange(n)
        blocks = [idx[:, None] >= idx[None]] + [idx[:, None] == idx[None]] * len(self.keys)
        return mx.concatenate(blocks, axis=1)


def chain_all(head: Any, g: mx.array) -> mx.array:
    """``head.chain_input`` for every position at once (the protocol's takes the last one)."""
    return head.last_pre_norm if head.chain_source == "pre_norm" else g


def unrolled_step_losses(
    head: Any, rows_matrix: mx.array, shared_proj: mx.array | None, batch: Batch, depth: int
) -> list[mx.array]:
    """Masked mean cross-entropy of each draft step 0..depth-1, the chain unrolled as decode runs it."""
    caches = [UnrollCache() for _ in head.decoder_layers()]
    x = batch.hidden
    losses = []
    for k in range(depth):
        tokens, ids, in_shared, p_top, p_rest, valid = batch.targets(k)
        g = head(x, tokens, caches, step=k)
        ce = position_ce(g, rows_matrix, shared_proj, ids, in_shared, p_top, p_rest)
        losses.append((ce * valid).sum() / mx.maximum(valid.sum(), 1.0))
        x = chain_all(head, g)
    return losses


def weighted_loss(losses: Sequence[mx.array], weights: Sequence[float]) -> mx.array:
    """The step losses weighted by ``weights`` (the first ``len(losses)`` of them), normalized by their sum."""
    w = [float(x) for x in weights[: len(losses)]]
    return sum(wi * li for wi, li in zip(w, losses)) / sum(w)


@dataclass
class Objective:
    """What every training step of one run shares: the output matrix, the shared id set, the loss."""

    rows_matrix: mx.array  # [V, H]: rows gathered per teacher id
    shared_proj: mx.array | None  # [H, M]
    in_shared: np.ndarray  # [V] bool

    @classmethod
    def build(cls, trunk: Trunk, train_ids: np.ndarray | None) -> Objective:
        full = lm_head_matrix(trunk)
        in_shared = np.ones(int(full.shape[1]), dtype=bool)
        shared_proj = None
        if train_ids is not None:
            shared_proj = full[:, mx.array(train_ids)]
            in_shared[:] = False
            in_shared[train_ids] = True
        rows_matrix = mx.contiguous(full.T)
        mx.eval(rows_matrix, *([shared_proj] if shared_proj is not None else []))
        return cls(rows_matrix, shared_proj, in_shared)


def frequent_ids(data: ForgeData, size: int, vocab: int) -> np.ndarray:
    """The ``size`` ids the trunk most often predicts at response positions (input tokens break ties), sorted.

    Ranked by the TRUNK's argmax, since a draft only pays when it matches the trunk.
    """
    counts = np.bincount(data.top_ids[..., 0][data.valid], minlength=vocab).astype(np.float64)
    counts += 0.1 * np.bincount(data.tokens[data.valid], minlength=vocab)
    order = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return np.sort(order).astype(np.int32)
