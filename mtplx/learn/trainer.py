"""One learning round: the head in use, fine-tuned on the older traffic, measured against it on the newest.

A round (`learning_round`) is a generator that does one bounded piece of work per ``next()``
(one teacher-forced trunk forward, one training step, one held-out window scored), so the
server's background trainer can stop between any two pieces when a request arrives, and
`mtplx forge --from-traffic` simply runs it to the end. It never touches the head in use: it
trains a copy and returns it with both measurements; the caller decides (`RoundResult.better`)
and swaps (`swap_weights`) or saves it (`HeadStore`).

Acceptance is forge's measure (`mtplx.forge.evaluate`): teacher-forced, 1 - TV(p_trunk, q_head)
per draft depth at the response positions of the held-out requests, at temperatures 0 and 0.7;
"first-draft acceptance" is depth 1's mean over the two.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mtplx.forge.evaluate import EVAL_TEMPERATURES, Tally, tally_windows
from mtplx.forge.loss import frequent_ids
from mtplx.forge.record import ForgeData
from mtplx.forge.train import TrainStep
from mtplx.heads.forged import ForgedMTPHead, build_forged_head
from mtplx.learn.config import LearnConfig
from mtplx.learn.data import TeacherRows, empty_data, sequences, split_held_out, windows
from mtplx.learn.log import Record

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


def first_draft(table: dict[str, dict[str, float]]) -> float:
    """Depth-1 acceptance, the mean over the measured temperatures."""
    row = table["1"]
    return float(np.mean([row[t] for t in row]))


def copy_head(head: ForgedMTPHead, trunk: Any, full_proj: mx.array | None = None) -> ForgedMTPHead:
    """A new forged head with ``head``'s weights, sources, depth attributes and draft vocabulary."""
    copy = build_forged_head(trunk, head.hidden_source, head.num_layers, head.chain_source)
    swap_weights(copy, head)
    if head.vocab_ids is not None and full_proj is not None:
        copy.set_draft_vocab(head.vocab_ids.tolist(), full_proj)
    copy.max_depth = getattr(head, "max_depth", None)
    copy.default_depth = getattr(head, "default_depth", None)
    return copy


def swap_weights(target: Any, source: Any) -> None:
    """Load ``source``'s parameters into ``target`` in place (same shapes: a strict load).

    The decode loop holds ``target`` itself, so a swap between two cycles changes every later
    draft and nothing already drafted; the verifier keeps the output exact whatever the head."""
    target.load_weights([(k, mx.array(v)) for k, v in tree_flatten(source.parameters())], strict=True)
    mx.eval(target.parameters())


@dataclass
class RoundResult:
    """A finished round: the candidate head and both measurements on the held-out requests."""

    candidate: ForgedMTPHead
    before: dict[str, dict[str, float]]  # the head in use, per depth and temperature
    after: dict[str, dict[str, float]]  # the candidate
    train_records: int
    held_records: int
    train_sequences: int
    steps: int
    seconds: float
    newest_time: float  # the newest record's time (the next round waits for records after it)
    losses: list[float] = field(default_factory=list)
    train_positions: int = 0  # response positions trained on
    sampled_sequences: int = 0  # of the training sequences, sampled answers (`mtplx.learn.sampling`)

    @property
    def gain(self) -> float:
        """First-draft acceptance gained on the held-out requests (negative: lost)."""
        return first_draft(self.after) - first_draft(self.before)

    def better(self, min_gain: float = 0.0) -> bool:
        return self.gain > min_gain


def _score(trunk, head, tokens: np.ndarray, valid: np.ndarray, cfg: LearnConfig, tally: Tally):
    for r in range(tokens.shape[0]):
        tally_windows(trunk, head, tokens[r : r + 1], valid[r : r + 1], cfg.eval_origins, tally)
        yield


def learning_round(
    trunk: Any,
    head: ForgedMTPHead,
    records: list[Record],
    cfg: LearnConfig,
    full_proj: mx.array | None = None,
    rows: TeacherRows | None = None,
    sampled: Mapping[Record, ForgeData] | None = None,
) -> Generator[None, None, RoundResult]:
    """One round over ``records`` (oldest first) from ``head`` (not modified): yields between pieces of
    work, returns the `RoundResult` (``yield from`` it, or drive it with `run_to_end`). ``rows`` keeps the
    teacher-forced rows between rounds (the server's learner passes its own; None: every row is run).
    ``sampled``: the trunk's sampled answers by record (`mtplx.learn.sampling`); the training records'
    are trained on too (their newest ``max_train_rows`` rows), the held-out ones' never."""
    began = time.perf_counter()
    train_recs, held_recs = split_held_out(records, cfg.held_out_fraction)
    train_seqs = sequences(train_recs, cfg.seq_len)[-cfg.max_train_rows :]
    held_seqs = sequences(held_recs, cfg.seq_len)
    if not train_seqs or not held_seqs:
        raise ValueError("a learning round needs a training and a held-out sequence")
    extra = _sampled_rows(sampled or {}, train_recs, cfg.max_train_rows)
    # Padded to the longest sequence, not to seq_len: chat traffic is short, and every step costs its width.
    held_tokens, held_valid = windows(held_seqs, max(len(t) for t, _ in held_seqs))
    width = max([len(t) for t, _ in train_seqs] + ([] if extra is None else [extra.tokens.shape[1]]))
    data = empty_data(
        trunk, len(train_seqs) + (0 if extra is None else extra.num_sequences), width, cfg.top_k
    )
    if extra is not None:
        for into, rows_sampled in zip(data.arrays(), extra.arrays()):
            into[len(train_seqs) :, : extra.tokens.shape[1]] = rows_sampled
    rows = TeacherRows() if rows is None else rows
    for r, (tokens, p) in enumerate(train_seqs):
        rows.fill(trunk, data, r, tokens, p)
        yield
    rows.keep_last_round()
    before = Tally({"": None}, cfg.depth, EVAL_TEMPERATURES, trunk.vocab_size)
    yield from _score(trunk, head, held_tokens, held_valid, cfg, before)
    candidate = copy_head(head, trunk, full_proj)
    vocab = trunk.vocab_size
    train_ids = (
        frequent_ids(data, cfg.train_vocab, vocab) if cfg.train_vocab and cfg.train_vocab < vocab else None
    )
    step = TrainStep(cfg.forge_config(head), trunk, candidate, data, train_ids, cfg.steps)
    losses = []
    for i in range(cfg.steps):
        kl, _ = step(i)
        losses.append(round(kl, 4))
        yield
    candidate.freeze()
    after = Tally({"": None}, cfg.depth, EVAL_TEMPERATURES, trunk.vocab_size)
    yield from _score(trunk, candidate, held_tokens, held_valid, cfg, after)
    return RoundResult(
        candidate,
        before.table()[""],
        after.table()[""],
        len(train_recs),
        len(held_recs),
        data.num_sequences,
        cfg.steps,
        time.perf_counter() - began,
        max(r.time for r in records),
        losses,
        int(data.valid.sum()),
        0 if extra is None else extra.num_sequences,
    )


def _sampled_rows(sampled: Mapping[Record, ForgeData], records: list[Record], limit: int) -> ForgeData | None:
    """The newest ``limit`` sampled rows of ``records``, as one array (rows as wide as the widest)."""
    parts = [sampled[r] for r in records if r in sampled]
    if not parts:
        return None
    width = max(p.tokens.shape[1] for p in parts)
    padded = [
        ForgeData(
            *(np.pad(a, [(0, 0), (0, width - a.shape[1])] + [(0, 0)] * (a.ndim - 2)) for a in p.arrays())
        )
        for p in parts
    ]
    data = ForgeData.concat(padded)
    return ForgeData(*(a[-limit:] for a in data.arrays()))


def run_to_end(round_: Generator[None, None, RoundResult]) -> RoundResult:
    """Drive a round without pausing (`mtplx forge --from-traffic`)."""
    while True:
        try:
            next(round_)
        except StopIteration as done:
            return done.value
