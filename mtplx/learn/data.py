"""Training data from the traffic log: teacher-forced trunk forwards over each (prompt, completion).

forge records hidden states and the trunk's raw distributions while the trunk writes
(`mtplx.forge.record`); the log keeps token ids only, so one teacher-forced forward per sequence
gives the same arrays: ``hidden[s]`` the trunk's state after x_s, ``top_*[s]`` its raw
(temperature 1) top-K log-probs over x_{s+1}, ``valid[s]`` for response positions a head drafts
at. Every choice of a record is a sequence. The most recent records are held out to measure
acceptance; training uses the older ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.forge.record import ForgeData
from mtplx.learn.log import Record
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np


def sequences(records: Sequence[Record], seq_len: int) -> list[tuple[list[int], int]]:
    """(tokens, prompt length) per choice, cut to ``seq_len`` (the prompt's start is dropped first, so
    the completion is kept); choices with no position to train on (fewer than 2 tokens) are left out."""
    out = []
    for record in records:
        for choice in record.choices:
            if len(choice.tokens) < 2:
                continue
            prompt, completion = list(record.prompt), list(choice.tokens)[: seq_len - 1]
            prompt = prompt[max(len(prompt) - (seq_len - len(completion)), 0) :]
            if not prompt:
                continue
            out.append((prompt + completion, len(prompt)))
    return out


def _top_k(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    logp = logits.astype(mx.float32)
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    ids = mx.argpartition(-logp, k - 1, axis=-1)[..., :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    ids, vals = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)
    return np.asarray(ids.astype(mx.int32)), np.asarray(vals)


def empty_data(trunk: Trunk, rows: int, seq_len: int, top_k: int) -> ForgeData:
    k = min(top_k, trunk.vocab_size)
    hidden_size = int(trunk.embed(mx.array([0])).shape[-1])
    return ForgeData.zeros(rows, seq_len, hidden_size, k)


def fill_row(trunk: Trunk, out: ForgeData, r: int, tokens: Sequence[int], prompt_length: int) -> None:
    """Row ``r`` of ``out`` from one teacher-forced trunk forward over ``tokens``."""
    end, p = len(tokens), prompt_length
    result = trunk(mx.array([list(tokens)]))
    ids, vals = _top_k(result.logits[0], out.top_ids.shape[-1])
    out.tokens[r, :end] = tokens
    # As forge: the state after the last token and the distribution after it train nothing.
    out.hidden[r, : end - 1] = np.asarray(result.hidden_pre_norm[0, : end - 1].astype(mx.float16))
    out.top_ids[r, : end - 1] = ids[: end - 1]
    out.top_logp[r, : end - 1] = vals[: end - 1]
    out.valid[r, p : end - 1] = True


class TeacherRows:
    """Teacher-forced rows kept between learning rounds, by sequence (tokens and prompt length).

    A row depends on the sequence and the trunk alone, and consecutive rounds read mostly the same
    records (a round every ``new_records`` requests over the newest ``max_records``), so a round runs
    the trunk on the sequences it has not seen only. `keep_last_round` drops the rows the last round
    did not read: what is held stays one round's data (the round's own arrays hold as much).
    """

    def __init__(self) -> None:
        self._rows: dict[tuple[tuple[int, ...], int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._read: set[tuple[tuple[int, ...], int]] = set()
        self.forwards = 0  # trunk forwards run (sequences not found)

    def __len__(self) -> int:
        return len(self._rows)

    def fill(self, trunk: Trunk, out: ForgeData, r: int, tokens: Sequence[int], prompt_length: int) -> None:
        """Row ``r`` of ``out`` as `fill_row` writes it: from a kept row, else from the trunk (then kept)."""
        key, end = (tuple(int(t) for t in tokens), int(prompt_length)), len(tokens)
        self._read.add(key)
        row = self._rows.get(key)
        if row is None:
            fill_row(trunk, out, r, tokens, prompt_length)
            self.forwards += 1
            self._rows[key] = tuple(a[r, : end - 1].copy() for a in (out.hidden, out.top_ids, out.top_logp))
            return
        out.tokens[r, :end] = tokens
        out.hidden[r, : end - 1], out.top_ids[r, : end - 1], out.top_logp[r, : end - 1] = row
        out.valid[r, prompt_length : end - 1] = True

    def keep_last_round(self) -> None:
        """Forget the rows not read since the previous call."""
        self._rows = {k: v for k, v in self._rows.items() if k in self._read}
        self._read = set()


def traffic_data(trunk: Trunk, seqs: Sequence[tuple[list[int], int]], seq_len: int, top_k: int) -> ForgeData:
    """`ForgeData` of ``seqs`` (from `sequences`), one teacher-forced trunk forward per sequence."""
    out = empty_data(trunk, len(seqs), seq_len, top_k)
    for r, (tokens, p) in enumerate(seqs):
        fill_row(trunk, out, r, tokens, p)
    return out


def windows(seqs: Sequence[tuple[list[int], int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, seq_len], the response positions [N, seq_len]) of ``seqs``: what acceptance is
    measured on (`mtplx.forge.evaluate.tally_windows`; padding is never counted)."""
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    valid = np.zeros((len(seqs), seq_len), bool)
    for r, (toks, p) in enumerate(seqs):
        tokens[r, : len(toks)] = toks
        valid[r, p : len(toks) - 1] = True
    return tokens, valid


def split_held_out(records: Sequence[Record], fraction: float, minimum: int = 1) -> tuple[list, list]:
    """(older records to train on, the most recent ``fraction`` held out: at least ``minimum``)."""
    held = min(max(int(round(len(records) * fraction)), minimum), max(len(records) - 1, 0))
    cut = len(records) - held
    return list(records[:cut]), list(records[cut:])
