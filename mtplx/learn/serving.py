"""`mtplx serve --learn DIR`: the traffic log, and a background trainer that improves the head in use.

The generation worker (`mtplx.server.worker`) owns the engine; it hands each finished request to
`Learner.record` (a record in ``DIR/traffic``, `mtplx.learn.log`) and, only while no request is
in flight or queued, calls `Learner.work`, which does one bounded piece of work and returns: with
``cfg.samples``, first the trunk's own sampled answers to the training-side requests
(`mtplx.learn.sampling`), then a learning round (`mtplx.learn.trainer`). So training pauses
whenever a request waits (it waits at most one piece, `max_piece_seconds`), and every swap
happens between two scheduler steps: never mid-cycle. A round's candidate replaces the head's
weights only when it measures better on the held-out (most recent) requests; it is saved first
(`mtplx.learn.store`), so a restart resumes with it. Heads other than forged ones
(`mtplx.heads.forged`) are not trained yet: the log is still kept.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from dataclasses import asdict
from typing import Any

from mtplx.heads.forged import ForgedMTPHead, lm_head_matrix
from mtplx.learn.config import DEFAULT_LEARN_CONFIG, LearnConfig
from mtplx.learn.data import TeacherRows, split_held_out
from mtplx.learn.log import DEFAULT_LOG_BYTES, Record, TrafficLog, choices_of, tokenizer_fingerprint
from mtplx.learn.report import write_state
from mtplx.learn.sampling import AnswerSampler
from mtplx.learn.store import HeadStore
from mtplx.learn.trainer import RoundResult, first_draft, learning_round, swap_weights

log = logging.getLogger("mtplx.learn")


class Learner:
    """The traffic log and background trainer of one served engine (module docstring)."""

    def __init__(
        self,
        engine: Any,
        root: str,
        max_bytes: int = DEFAULT_LOG_BYTES,
        cfg: LearnConfig = DEFAULT_LEARN_CONFIG,
        train: bool = True,
    ):
        self.engine, self.cfg = engine, cfg
        self.log = TrafficLog(root, max_bytes)
        self.store = HeadStore(root)
        self.trunk_fp = engine.fingerprint
        self.tokenizer_fp = tokenizer_fingerprint(engine.tokenizer)
        head = engine.head
        self.can_train = train and isinstance(head, ForgedMTPHead)
        if train and not self.can_train:
            log.warning(
                "--learn: only forged heads learn yet; this model's traffic is recorded, not trained on"
            )
        self.started = time.monotonic()
        self.train_seconds = 0.0
        self.max_piece_seconds = 0.0
        self.rounds = self.accepted = 0
        self.served_mid_round = 0  # requests that finished while a round waited for them
        self.last_result: RoundResult | None = None  # the last finished round's
        self.pending = self.log.records  # records no round has seen yet
        self.version = 0
        self.acceptance: float | None = None  # the head in use, first-draft, as last measured
        self.history: list[dict] = []
        self._round: Generator[None, None, RoundResult] | None = None
        self._full_proj = None
        self._rows = TeacherRows()  # teacher-forced rows kept between rounds
        self.sampler = AnswerSampler(engine, cfg) if self.can_train and cfg.samples > 0 else None
        self._window: tuple[tuple[int, int], list[Record]] | None = None  # (log state, its newest records)
        if self.can_train:
            self._resume()

    def _resume(self) -> None:
        loaded = self.store.load_current(self.engine.trunk, self.trunk_fp)
        if loaded is None:
            return
        head, state = loaded
        current = self.engine.head
        if (head.num_layers, head.hidden_source, head.chain_source) != (
            current.num_layers,
            current.hidden_source,
            current.chain_source,
        ):
            log.warning("learned head v%s not used: its shape differs from the served head", state["version"])
            return
        swap_weights(current, head)
        self.version = int(state["version"])
        self.acceptance = state.get("acceptance", {}).get("first_draft")
        self.history = list(state.get("history", []))
        log.info("--learn: resumed with learned head v%d (%s)", self.version, self.store.dir / state["dir"])

    # ------------------------------------------------------------------ the log
    def record(
        self,
        prompt: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        finishes: Sequence[str | None],
        grammar: str | None,
        tools: bool,
    ) -> None:
        """Log one finished request (every choice); a failed write is one log line, never the request's."""
        record = Record(
            tuple(int(t) for t in prompt),
            choices_of(token_lists, finishes),
            self.trunk_fp,
            self.tokenizer_fp,
            grammar,
            tools,
        )
        if self._round is not None:
            self.served_mid_round += 1
        try:
            self.log.append(record)
        except OSError as e:
            log.warning("--learn: %s: record not written (%s)", self.log.dir, e.strerror or e)
            return
        self.pending += 1

    # ------------------------------------------------------------------ the trainer
    def has_work(self) -> bool:
        if not self.can_train:
            return False
        return self._round is not None or self._round_due() or self._sampling_left()

    def _round_due(self) -> bool:
        due = self.cfg.new_records if self.rounds else self.cfg.min_records
        return self.pending >= due and self.log_records() >= self.cfg.min_records

    def log_records(self) -> int:
        return self.log.records

    def _records(self) -> list[Record]:
        """The newest ``max_records`` of the log (what a round reads), read again only when it changed."""
        state = (self.log.written, self.log.records)
        if self._window is None or self._window[0] != state:
            records = self.log.read(self.trunk_fp, self.tokenizer_fp, newest=self.cfg.max_records)
            self._window = (state, records)
        return self._window[1]

    def _train_side(self) -> list[Record]:
        """The records a round would train on now (the newest ``max_records`` less the held-out ones)."""
        records = self._records()
        return split_held_out(records, self.cfg.held_out_fraction)[0] if len(records) >= 2 else []

    def _sampling_left(self) -> bool:
        """Sampling comes before the next round: a batch under way, or training-side records to sample."""
        if self.sampler is None or self._round is not None:
            return False
        return self.sampler.busy or bool(self.sampler.wanted(self._train_side()))

    def work(self) -> bool:
        """One bounded piece: of sampling (`mtplx.learn.sampling`) while training-side records wait
        for their samples, else of the current round (starting one when due); False when there is none."""
        if not self.has_work():
            return False
        began = time.perf_counter()
        try:
            if self._sampling_left():
                self.sampler.work(self._train_side(), self.cfg.piece_seconds)
                return True
            if self._round is None:
                records = self._records()
                self.pending = 0
                if len(records) < max(self.cfg.min_records, 2):
                    return True
                if self._full_proj is None and self.engine.head.vocab_ids is not None:
                    self._full_proj = lm_head_matrix(self.engine.trunk)
                sampled = None
                if self.sampler is not None:
                    self.sampler.keep_only(records)
                    sampled = self.sampler.rows
                self._round = learning_round(
                    self.engine.trunk,
                    self.engine.head,
                    records,
                    self.cfg,
                    self._full_proj,
                    self._rows,
                    sampled,
                )
            next(self._round)
        except StopIteration as done:
            self._round = None
            self._finish(done.value)
        except Exception:  # a bug, not the traffic's fault: serving goes on with the head in use
            log.exception("--learn: %s failed", "learning round" if self._round is not None else "sampling")
            self._round = None
        finally:
            seconds = time.perf_counter() - began
            self.train_seconds += seconds
            self.max_piece_seconds = max(self.max_piece_seconds, seconds)
        return True

    def _finish(self, result: RoundResult) -> None:
        self._accept(result)
        write_state(self.log.root, self.snapshot())  # for `mtplx inspect --learn`

    def _accept(self, result: RoundResult) -> None:
        self.rounds += 1
        self.last_result = result
        before, after = first_draft(result.before), first_draft(result.after)
        self.acceptance = before if self.acceptance is None else self.acceptance
        if not result.better(self.cfg.min_gain):
            log.info(
                "--learn: round %d kept the head: first-draft acceptance %.3f -> %.3f on %d held-out requests",
                self.rounds,
                before,
                after,
                result.held_records,
            )
            self.acceptance = before
            return
        acceptance = {"first_draft": after, "before": before, "per_depth": result.after}
        manifest = self._manifest(result)
        self.version = self.store.save(result.candidate, manifest, acceptance)
        swap_weights(self.engine.head, result.candidate)  # between two scheduler steps
        self.accepted += 1
        self.acceptance = after
        self.history = self.store.state().get("history", [])
        log.info(
            "--learn: head v%d swapped in: first-draft acceptance %.3f -> %.3f (%+.3f) on %d held-out requests",
            self.version,
            before,
            after,
            after - before,
            result.held_records,
        )

    def _manifest(self, result: RoundResult) -> dict[str, Any]:
        head = self.engine.head
        return {
            "trunk_fingerprint": self.trunk_fp,
            "depth_trained": getattr(head, "max_depth", None) or self.cfg.depth,
            "default_depth": getattr(head, "default_depth", None),
            "learned_from_traffic": {
                "train_records": result.train_records,
                "held_out_records": result.held_records,
                "train_sequences": result.train_sequences,
                "sampled_sequences": result.sampled_sequences,
                "steps": result.steps,
                "seconds": round(result.seconds, 1),
                "acceptance_before": result.before,
                "acceptance_after": result.after,
                "config": asdict(self.cfg),
            },
        }

    # ------------------------------------------------------------------ reports
    def share(self) -> float:
        """The trainer's share of the worker thread's wall time since start."""
        return self.train_seconds / max(time.monotonic() - self.started, 1e-9)

    def snapshot(self) -> dict[str, Any]:
        return {
            "head_version": self.version,
            "acceptance": self.acceptance,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "round_in_progress": self._round is not None,
            "served_mid_round": self.served_mid_round,
            "records": self.log_records(),
            "log_bytes": self.log.bytes,
            "sampled_answers": 0 if self.sampler is None else self.sampler.sampled,
            "trainer_seconds": self.train_seconds,
            "trainer_share": self.share(),
            "max_piece_seconds": self.max_piece_seconds,
        }


class LearnCollector:
    """`/metrics`' view of a `Learner` (registered on the server's registry, read at each scrape)."""

    def __init__(self, learner: Learner):
        self.learner = learner

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.learner.snapshot()
        yield GaugeMetricFamily(
            "mtplx_learn_head_version", "Learned head in use (0: the served one)", value=s["head_version"]
        )
        acceptance = GaugeMetricFamily(
            "mtplx_learn_first_draft_acceptance",
            "First-draft acceptance on held-out traffic: the head in use (version=current) and each accepted head",
            labels=["version"],
        )
        if s["acceptance"] is not None:
            acceptance.add_metric(["current"], s["acceptance"])
        for entry in self.learner.history:
            acceptance.add_metric([str(entry["version"])], entry["acceptance"]["first_draft"])
        yield acceptance
        yield CounterMetricFamily("mtplx_learn_rounds", "Learning rounds finished", value=s["rounds"])
        yield CounterMetricFamily(
            "mtplx_learn_heads_accepted", "Rounds whose head was swapped in", value=s["accepted"]
        )
        yield GaugeMetricFamily(
            "mtplx_learn_round_in_progress",
            "1 while a learning round is under way",
            value=s["round_in_progress"],
        )
        yield CounterMetricFamily(
            "mtplx_learn_requests_mid_round",
            "Logged requests served while a learning round was under way (the round waited for them)",
            value=s["served_mid_round"],
        )
        yield GaugeMetricFamily("mtplx_learn_log_records", "Requests in the traffic log", value=s["records"])
        yield CounterMetricFamily(
            "mtplx_learn_sampled_answers",
            "Answers the trunk sampled to logged prompts in idle time (--learn-samples)",
            value=s["sampled_answers"],
        )
        yield GaugeMetricFamily("mtplx_learn_log_bytes", "Bytes of the traffic log", value=s["log_bytes"])
        yield CounterMetricFamily(
            "mtplx_learn_trainer_seconds", "Worker time spent training", value=s["trainer_seconds"]
        )
        yield GaugeMetricFamily(
            "mtplx_learn_trainer_share", "The trainer's share of the worker's time", value=s["trainer_share"]
        )
        yield GaugeMetricFamily(
            "mtplx_learn_max_piece_seconds",
            "Longest piece of training (the most a request that arrives can wait for it)",
            value=s["max_piece_seconds"],
        )
