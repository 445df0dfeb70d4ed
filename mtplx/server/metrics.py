"""`GET /metrics`: the server's load and throughput in Prometheus' text format.

The names follow vLLM's (`vllm:num_requests_running`, `vllm:prompt_tokens_total`,
`vllm:request_success_total{finished_reason}`, `vllm:time_to_first_token_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:spec_decode_num_draft_tokens_total`,
`vllm:spec_decode_num_accepted_tokens_per_pos`, ...) with the
prefix ``mtplx_``, so a dashboard built for one reads the other with a rename. Requests are
counted when they finish (a finish reason, "stop" or "length"), from the same `GenerationStats`
their usage reports, so the token counters equal the sum of the finished responses' usage;
requests cancelled or timed out before their end are in ``mtplx_request_aborted_total`` only;
internal failures (`mtplx.engine.failures`: a bug, a damaged model) are counted once each in
``mtplx_worker_errors_total{stage}``, however many requests they failed.
The gauges (requests running and waiting, MLX's active memory, the prompt cache's bytes and
limit) read what the worker's thread last saw between cycles. With a disk tier
(``--prompt-cache-dir``) its hits, bytes loaded, load time, writes and bytes on disk are read
from its own counters (`mtplx.trunk.prompt_cache_disk.DiskStats`).
"""

from __future__ import annotations

from typing import Protocol

from mtplx.engine.failures import FailedStage
from mtplx.engine.output import GenerationChunk

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds: from tens of milliseconds (a cached prompt on a GPU) to minutes (a long prompt on a CPU).
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class WorkerLoad(Protocol):
    """What the gauges read (`mtplx.server.worker.GenerationWorker`)."""

    running: int  # requests decoding (batch rows)
    memory: tuple[int, int, int]  # MLX active bytes, prompt cache bytes, its limit

    @property
    def waiting(self) -> int: ...  # requests queued or prefilling


class _DiskCollector:
    """The prompt cache's disk tier, read at each scrape (`mtplx.trunk.prompt_cache_disk.DiskTier`)."""

    def __init__(self, disk):
        self.disk = disk

    def collect(self):
        stats, disk = self.disk.stats, self.disk
        counters = (
            ("mtplx_prompt_cache_disk_hits", "Prompt-cache lookups served from disk", stats.hits),
            (
                "mtplx_prompt_cache_disk_loaded_bytes",
                "Bytes of prompt-cache entries loaded from disk",
                stats.bytes_loaded,
            ),
            (
                "mtplx_prompt_cache_disk_load_seconds",
                "Time spent loading prompt-cache entries from disk",
                stats.load_seconds,
            ),
            ("mtplx_prompt_cache_disk_writes", "Prompt-cache entries written to disk", stats.writes),
            (
                "mtplx_prompt_cache_disk_skipped_files",
                "Damaged or foreign prompt-cache files skipped",
                stats.skipped_files,
            ),
            (
                "mtplx_prompt_cache_disk_dropped_writes",
                "Prompt-cache entries not written to disk (queue full, over the budget, failed, unfinished at shutdown)",
                stats.dropped_writes,
            ),
            (
                "mtplx_prompt_cache_disk_removed_files",
                "Damaged prompt-cache files and a stopped writer's unfinished files deleted",
                stats.removed_files,
            ),
        )
        for name, text, value in counters:
            yield CounterMetricFamily(name, text, value=value)
        yield GaugeMetricFamily(
            "mtplx_prompt_cache_disk_bytes", "Bytes of prompt-cache entries on disk", value=disk.nbytes
        )
        yield GaugeMetricFamily(
            "mtplx_prompt_cache_disk_capacity_bytes", "The prompt cache's disk budget", value=disk.max_bytes
        )


class ServerMetrics:
    """The server's metrics in a registry of their own (one per app, so tests can run several).
    ``disk``: the prompt cache's disk tier, if there is one."""

    def __init__(self, load: WorkerLoad, disk=None):
        self.registry = CollectorRegistry()
        r = self.registry
        if disk is not None:
            r.register(_DiskCollector(disk))
        gauges = (  # read at each scrape
            ("mtplx_num_requests_running", "Requests decoding", lambda: load.running),
            ("mtplx_num_requests_waiting", "Requests queued or prefilling", lambda: load.waiting),
            ("mtplx_memory_active_bytes", "MLX's active memory", lambda: load.memory[0]),
            ("mtplx_prompt_cache_bytes", "Bytes the prompt cache holds", lambda: load.memory[1]),
            ("mtplx_prompt_cache_capacity_bytes", "The prompt cache's limit", lambda: load.memory[2]),
        )
        for name, text, read in gauges:
            Gauge(name, text, registry=r).set_function(read)
        self.prompt_tokens = Counter("mtplx_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "mtplx_prompt_cached_tokens", "Prompt tokens reused from the prompt cache", registry=r
        )
        self.generation_tokens = Counter(
            "mtplx_generation_tokens", "Completion tokens of finished requests", registry=r
        )
        self.success = Counter("mtplx_request_success", "Finished requests", ["finished_reason"], registry=r)
        self.aborted = Counter(
            "mtplx_request_aborted", "Requests ended before their finish", ["reason"], registry=r
        )
        self.worker_errors = Counter(
            "mtplx_worker_errors", "Internal failures of the generation worker", ["stage"], registry=r
        )
        self.worker_error_count = 0  # their sum (/health)
        self.ttft = Histogram(
            "mtplx_time_to_first_token_seconds",
            "From the request reaching the engine to its first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "mtplx_e2e_request_latency_seconds",
            "From the request reaching the engine to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.draft_tokens = Counter(
            "mtplx_spec_decode_num_draft_tokens", "Draft tokens verified", ["drafter"], registry=r
        )
        self.accepted_tokens = Counter(
            "mtplx_spec_decode_num_accepted_tokens", "Draft tokens accepted", ["drafter"], registry=r
        )
        self.drafts = Counter("mtplx_spec_decode_num_drafts", "Cycles that verified drafts", registry=r)
        self.accepted_per_position = Counter(
            "mtplx_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (1-based)",
            ["position"],
            registry=r,
        )

    def observe(self, chunk: GenerationChunk) -> None:
        """Count a request that ended with ``chunk`` (other chunks are ignored). With n > 1 each
        choice's generation and drafts count; the prompt, success and latency once (choice 0)."""
        if chunk.finish_reason is None:
            return
        stats = chunk.stats
        self.generation_tokens.inc(stats.generated_tokens)
        if chunk.index == 0:
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.cached_tokens.inc(stats.cached_tokens)
            self.success.labels(finished_reason=chunk.finish_reason).inc()
            if stats.generated_tokens:
                self.ttft.observe(stats.ttft_seconds)
            self.latency.observe(stats.total_seconds)
        for drafter, counts in stats.drafters.items():
            self.draft_tokens.labels(drafter=drafter).inc(counts.get("drafted", 0))
            self.accepted_tokens.labels(drafter=drafter).inc(counts.get("accepted", 0))
        if stats.drafted_per_position:
            self.drafts.inc(stats.drafted_per_position[0])
        for position, (rate, cycles) in enumerate(
            zip(stats.acceptance_per_position, stats.drafted_per_position), start=1
        ):
            # The stats keep a rate over `cycles`; the count it came from is an integer.
            self.accepted_per_position.labels(position=str(position)).inc(round(rate * cycles))

    def abort(self, reason: str) -> None:
        """A request that ended without a finish: "cancelled" (client gone), "timeout", "error"."""
        self.aborted.labels(reason=reason).inc()

    def worker_error(self, stage: FailedStage) -> None:
        """An internal failure at ``stage`` (once, however many requests it failed)."""
        self.worker_errors.labels(stage=stage.label).inc()
        self.worker_error_count += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)
