"""More of the trunk's writing per logged request: its own sampled answers to the logged prompts.

A served request gives the head one answer (``n`` with ``n`` > 1) to learn from; the trunk can
write more on the same subject at no cost to anyone while the server is idle. `AnswerSampler`
samples ``cfg.samples`` answers per training-side record (forge's setting: ``sample_temperature``,
``sample_top_p``; as long as the record's longest served answer) through forge's
`mtplx.forge.record.RecordingBatch`, which records the training data while the trunk writes: no
second teacher forward. It works a bounded piece at a time (``cfg.piece_seconds`` and the step under
way), so the server's learner can run it between requests.

Kept in memory only, by record: the log on disk holds what users were served and nothing else, and
a restart samples again. Grammar-constrained records are not sampled (the log names the constrained
field, not the grammar, so a sample could not be constrained as the served answer was). A row
longer than ``cfg.seq_len`` keeps its last ``seq_len`` positions, as `mtplx.learn.data.sequences`
cuts a logged one (the trunk read the whole prompt either way).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from mtplx.forge.record import ForgeData, RecordingBatch
from mtplx.learn.config import LearnConfig
from mtplx.learn.log import Record
from mtplx.sample.params import Setting

import mlx.core as mx
import numpy as np


def record_key(record: Record) -> mx.array:
    """The random key of a record's samples: from its prompt and time, so a log samples alike every run."""
    digest = hashlib.sha256(repr((record.time, record.prompt)).encode()).digest()
    return mx.random.key(int.from_bytes(digest[:8], "little") % (1 << 63))


def samplable(record: Record) -> bool:
    """Free text with an answer to match in length (grammar-constrained records are not sampled)."""
    return record.grammar is None and max((len(c.tokens) for c in record.choices), default=0) >= 2


def keep_last(data: ForgeData, seq_len: int) -> ForgeData:
    """Each row's sequence cut to its last ``seq_len`` positions (rows shorter stay as they are), in
    rows ``seq_len`` wide at most."""
    out = ForgeData(*(np.zeros_like(a[:, :seq_len]) for a in data.arrays()))
    ends = [int(np.flatnonzero(row)[-1]) + 2 if row.any() else 0 for row in data.valid]
    for r, end in enumerate(ends):
        start = max(end - seq_len, 0)
        for kept, full in zip(out.arrays(), data.arrays()):
            kept[r, : end - start] = full[r, start:end]
    return out


class AnswerSampler:
    """``cfg.samples`` sampled answers per record, recorded as training rows (the module docstring)."""

    def __init__(self, engine: Any, cfg: LearnConfig):
        self.engine, self.cfg = engine, cfg
        self.rows: dict[Record, ForgeData] = {}  # each sampled record's rows, ``cfg.samples`` of them
        self._batch: RecordingBatch | None = None
        self._batch_records: list[Record] = []
        self.failed: set[Record] = set()  # records whose batch raised: never tried again
        self.sampled = 0  # answers sampled since start

    @property
    def busy(self) -> bool:
        """A batch is under way (`work` goes on with it)."""
        return self._batch is not None

    def wanted(self, records: Sequence[Record]) -> list[Record]:
        """The records of ``records`` still to sample (oldest first)."""
        if self.cfg.samples <= 0:
            return []
        skip = set(self._batch_records) | self.failed
        return [r for r in records if samplable(r) and r not in self.rows and r not in skip]

    def work(self, records: Sequence[Record], seconds: float | None = None) -> bool:
        """One piece: start a batch over the first records of ``records`` still to sample, or go on with
        the batch under way, for about ``seconds`` (None: to its end). False when there is nothing to do.
        An error raises, its records never sampled again."""
        try:
            if self._batch is None and not self._start(self.wanted(records)):
                return False
            done = self._batch.advance(seconds)
        except Exception:
            self.failed.update(self._batch_records)
            self.close()
            raise
        if done:
            data = keep_last(self._batch.data(), self.cfg.seq_len)
            k = self.cfg.samples
            for i, record in enumerate(self._batch_records):
                self.rows[record] = ForgeData(*(a[i * k : (i + 1) * k] for a in data.arrays()))
            self.sampled += len(self._batch_records) * k
            self._batch, self._batch_records = None, []
        return True

    def _start(self, todo: list[Record]) -> bool:
        k = self.cfg.samples
        todo = todo[: max(self.cfg.sample_rows // k, 1)]
        if not todo:
            return False
        prompts, limits, keys = [], [], []
        for record in todo:
            longest = max(len(c.tokens) for c in record.choices)
            prompts += [list(record.prompt)] * k
            limits += [longest] * k
            keys += list(mx.random.split(record_key(record), k))
        self._batch_records = todo
        self._batch = RecordingBatch(
            self.engine,
            prompts,
            Setting(self.cfg.sample_temperature, self.cfg.sample_top_p),
            keys,
            limits,
            self.cfg.top_k,
            set(getattr(self.engine.tokenizer, "eos_token_ids", None) or ()),
            max_rows=len(prompts),
            prefill_step_size=self.cfg.sample_prefill_step,
        )
        return True

    def data(self, records: Sequence[Record]) -> list[ForgeData]:
        """The sampled rows of ``records`` that have them, in their order."""
        return [self.rows[r] for r in records if r in self.rows]

    def keep_only(self, records: Sequence[Record]) -> None:
        """Forget the samples of records not in ``records`` (evicted or past the rounds' window)."""
        kept = set(records)
        self.rows = {r: v for r, v in self.rows.items() if r in kept}

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
        self._batch, self._batch_records = None, []
