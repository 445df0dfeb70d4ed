"""MTP decoding on a trunk sharded over processes and machines with ``mx.distributed``.

Sharding modes (``Engine.load(..., distributed="pipeline"|"tensor"|True)``):

* ``pipeline``: each rank holds a contiguous slice of the layers. Rank ``N-1``
  runs the first layers, rank 0 the last (mlx-lm's convention); hidden states
  travel down by send/recv and the last rank's output is all-gathered, so every
  rank ends the forward with the same final hidden state and logits. Models
  whose mlx-lm class has ``pipeline`` (Qwen3.5, DeepSeek-V3, ...) use it;
  llama-family models (mlx-lm's ``LlamaModel`` has none) get mtplx's own split,
  written after ``mlx_lm/models/pipeline.py`` and ``qwen3_5.Qwen3_5TextModel``.
  Numerics are those of one process: the same layers run the same kernels.
* ``tensor``: mlx-lm's ``shard`` splits every layer's heads / MLP columns and
  all-reduces inside the layer (``mlx.nn.layers.distributed``). The all-reduce
  sums in another order than a single matmul, so logits differ from one
  process in the last bits; they are identical across ranks.

``True`` picks pipeline where it exists (it costs one hop per rank plus one
all-gather per forward, independent of depth; tensor parallel costs two
all-reduces per layer), else tensor.

The MTP head is replicated: every rank holds it in full and runs it on the
(identical) final hidden state the forward leaves on every rank. Every rank
therefore takes identical decisions (same seed, same uniforms, same logits),
so drafts, accepts and rollbacks agree with no communication beyond the
sharded forward itself; each rank rolls back its own caches.

Failure handling: the ranks compare fingerprints of their model, head and
settings once at load (and a digest of every request), a collective that
fails because a peer is gone becomes an ``MtplxError``, and a ``Watchdog``
ends the process when a collective has not finished within
``collective_timeout`` seconds (MLX's collectives have no timeout of their own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mtplx.errors import MtplxError
from mtplx.model_files.fingerprint import weights_fingerprint
from mtplx.trunk.compat import materialize

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear
from mlx.utils import tree_flatten

MODES = ("pipeline", "tensor")
DEFAULT_COLLECTIVE_TIMEOUT = 300.0  # seconds; a long prompt's prefill on big models must fit
EXIT_COLLECTIVE_TIMEOUT = 3
# mx.distributed functions that move data between ranks (counted by `measure_comm`).
_COLLECTIVES = ("all_sum", "all_gather", "all_max", "all_min", "sum_scatter", "send", "recv", "recv_like")
# An LM head `shard` split over the vocabulary: each rank computes a slice of the logits.
_VOCAB_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
_BACKEND_TAGS = ("[ring]", "[mpi]", "[jaccl]", "[nccl]", "distributed")


# --------------------------------------------------------------------------- group


def world() -> mx.distributed.Group | None:
    """The group this process was launched into (``mlx.launch``), or None when it runs alone."""
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def launch_group() -> mx.distributed.Group:
    """The launch group, or MtplxError when this process runs alone."""
    group = world()
    if group is None:
        raise MtplxError(
            "distributed: this process is not part of a group of 2 or more; start every rank with "
            "`mlx.launch` (see README, 'Several processes or machines')"
        )
    return group


def parse_mode(value: bool | str) -> str:
    """``True``/"auto" -> "auto"; "pipeline" / "tensor" as given; anything else is an error."""
    if value is True or value == "auto":
        return "auto"
    if value in MODES:
        return str(value)
    raise MtplxError(f"distributed: must be True, 'auto', 'pipeline' or 'tensor', got {value!r}")


# --------------------------------------------------------------------------- watchdog


class Watchdog:
    """Ends the process when an armed section runs past ``timeout_s``.

    A blocked MLX collective cannot be interrupted from Python, so the only way
    out of a wait on a rank that hangs (host frozen, network partitioned without
    a reset) is to exit; ``os._exit`` skips the interpreter teardown that would
    itself wait on the blocked thread.
    """

    def __init__(self, timeout_s: float, rank: int):
        if timeout_s <= 0:
            raise MtplxError(f"collective_timeout: must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.rank = rank
        self._deadline: float | None = None
        self._what = ""
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def armed(self, what: str) -> Iterator[None]:
        with self._wake:
            self._deadline = time.monotonic() + self.timeout_s
            self._what = what
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="mtplx-watchdog", daemon=True)
                self._thread.start()
            self._wake.notify()
        try:
            yield
        finally:
            with self._wake:
                self._deadline = None

    def _watch(self) -> None:
        with self._wake:
            while True:
                if self._deadline is None:
                    self._wake.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                sys.stderr.write(
                    f"mtplx: error: rank {self.rank}: {self._what} did not finish within the collective "
                    f"timeout of {self.timeout_s:g} s (another rank died or hangs; raise it with "
                    "--collective-timeout)\n"
                )
                sys.stderr.flush()
                os._exit(EXIT_COLLECTIVE_TIMEOUT)


# --------------------------------------------------------------------------- pipeline for llama


def _pipelined_llama_call(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
    """`LlamaModel.__call__` for the local slice of layers, in mlx-lm's pipeline style."""
    from mtplx.trunk.compat import create_attention_mask

    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    cache = cache if cache is not None else [None] * len(self.layers)
    masks = {}
    for layer, c in zip(self.layers, cache):
        if layer.use_sliding not in masks:
            window = self.sliding_window if layer.use_sliding else None
            masks[layer.use_sliding] = create_attention_mask(h, c, window_size=window)
    rank, size = self.pipeline_rank, self.pipeline_size
    if rank < size - 1:  # the rank holding the earlier layers sends their output here
        h = mx.distributed.recv_like(h, rank + 1, group=self.pipeline_group)
    for layer, c in zip(self.layers, cache):
        h = layer(h, masks[layer.use_sliding], cache=c)
    if rank > 0:
        h = mx.distributed.send(h, rank - 1, group=self.pipeline_group)
        # Evaluating only the caches (prefill) must still perform the send the next rank waits on.
        if cache[-1] is not None:
            cache[-1].keys = mx.depends(cache[-1].keys, h)
    # Every rank leaves with rank 0's (the last layers') output.
    h = mx.distributed.all_gather(h, group=self.pipeline_group)[: h.shape[0]]
    return self.norm(h)


def _pipeline_llama(inner: nn.Module, group: mx.distributed.Group) -> tuple[int, int]:
    """Keep this rank's slice of ``inner.layers`` (rank 0 = the last layers) and pipeline the forward."""
    num_layers, rank, size = len(inner.layers), group.rank(), group.size()
    if num_layers < size:
        raise MtplxError(f"distributed: {num_layers} layers cannot be split over {size} ranks")
    base, extra = divmod(num_layers, size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    start = sum(counts[rank + 1 :])
    end = start + counts[rank]
    inner.layers = inner.layers[start:end]
    inner.pipeline_rank, inner.pipeline_size, inner.pipeline_group = rank, size, group
    base_cls = type(inner)
    inner.__class__ = type(f"Pipelined{base_cls.__name__}", (base_cls,), {"__call__": _pipelined_llama_call})
    return start, end


def _mlx_lm_pipeline_owner(model: nn.Module) -> nn.Module | None:
    inner = getattr(model, "model", None)
    return inner if inner is not None and hasattr(inner, "pipeline") else None


def _is_llama_family(inner: nn.Module) -> bool:
    from mlx_lm.models.llama import LlamaModel

    return type(inner) is LlamaModel


def _model_type(config: dict) -> str:
    text = config.get("text_config") or {}
    return str(config.get("model_type") or text.get("model_type") or "unknown")


def supported_modes(model: nn.Module, inner: nn.Module) -> list[str]:
    modes = []
    if _mlx_lm_pipeline_owner(model) is not None or _is_llama_family(inner):
        modes.append("pipeline")
    if hasattr(model, "shard"):
        modes.append("tensor")
    return modes


def choose_mode(model: nn.Module, inner: nn.Module, requested: str, config: dict) -> str:
    modes = supported_modes(model, inner)
    if not modes:
        raise MtplxError(
            f"distributed: model type {_model_type(config)!r} supports neither pipeline nor tensor "
            "parallel sharding (mlx-lm has no `pipeline`/`shard` for it and it is not llama-family)"
        )
    if requested == "auto":
        return modes[0]
    if requested not in modes:
        raise MtplxError(
            f"distributed: model type {_model_type(config)!r} does not support {requested} sharding "
            f"(supported: {', '.join(modes)})"
        )
    return requested


def check_tensor_split(model: nn.Module, size: int, config: dict) -> None:
    """mlx-lm's llama ``shard`` divides head counts without checking; refuse uneven splits clearly."""
    from mtplx.heads.base import model_args_of

    args = model_args_of(model)
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(args, name, None)
        if value is not None and _is_llama_family(model.model) and int(value) % size:
            raise MtplxError(
                f"distributed: tensor parallel needs {name} ({value}) divisible by {size} ranks "
                f"for model type {_model_type(config)!r}; use distributed='pipeline'"
            )


class _GatheredOutput(nn.Module):
    """A vocabulary-sharded LM head whose output is gathered so every rank sees all logits.

    ``Trunk.lm_head`` (the head's logits) calls the layer directly; the trunk's own
    forward already gathers (e.g. ``qwen3_5.TextModel`` with ``gather_last_axis``).
    """

    def __init__(self, layer: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.layer = layer
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        from mlx_lm.models.base import gather_last_axis

        return gather_last_axis(self.layer(x), self._group)


# --------------------------------------------------------------------------- communication model


@dataclass(frozen=True)
class CommPlan:
    """Collectives one trunk forward issues on this rank, and their payload.

    Measured by building (not evaluating) a forward of ``block_len`` positions
    with the ``mx.distributed`` functions counted (`measure_comm`): exact for any
    model. Payload = the bytes each collective's input holds on this rank.
    """

    block_len: int
    collectives: int
    payload_bytes: int
    kinds: dict[str, int]


def measure_comm(trunk: Any, block_len: int) -> CommPlan:
    """Count the collectives a ``block_len``-position forward builds (nothing is evaluated or sent)."""
    counts: dict[str, int] = {}
    payload = 0
    originals = {
        name: getattr(mx.distributed, name) for name in _COLLECTIVES if hasattr(mx.distributed, name)
    }

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(x, *args, **kwargs):
            nonlocal payload
            counts[name] = counts.get(name, 0) + 1
            if isinstance(x, mx.array):
                payload += x.nbytes
            return fn(x, *args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(mx.distributed, name, counting(name, fn))
        trunk(mx.zeros((1, block_len), dtype=mx.int32), trunk.make_cache())
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)
    return CommPlan(block_len, sum(counts.values()), payload, dict(sorted(counts.items())))


# --------------------------------------------------------------------------- agreement


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def _gather_rows(group: mx.distributed.Group, row: np.ndarray) -> np.ndarray:
    gathered = mx.distributed.all_gather(mx.array(row[None]), group=group)
    return np.array(gathered)


def check_agreement(group: mx.distributed.Group, fields: dict[str, str]) -> None:
    """All ranks hold the same value for every field, else MtplxError (on every rank) naming it."""
    names = sorted(fields)
    row = np.frombuffer(b"".join(_digest(fields[n]) for n in names), dtype=np.uint8).astype(np.int32)
    rows = _gather_rows(group, row).reshape(group.size(), len(names), 32)
    for r in range(1, group.size()):
        for i, name in enumerate(names):
            if not np.array_equal(rows[r, i], rows[0, i]):
                raise MtplxError(
                    f"distributed: rank {r} has a different {name} than rank 0 "
                    f"({bytes(rows[r, i].astype(np.uint8)).hex()[:12]} vs "
                    f"{bytes(rows[0, i].astype(np.uint8)).hex()[:12]}); give every rank the same files"
                )


@dataclass
class Distributed:
    """A sharded engine's place in its group; what the engine consults per request."""

    group: mx.distributed.Group
    mode: str
    layer_range: tuple[int, int]  # this rank's trunk layers [start, end) in the full model
    watchdog: Watchdog
    trunk: Any
    _plans: dict[int, CommPlan]

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def comm(self, block_len: int) -> CommPlan:
        if block_len not in self._plans:
            self._plans[block_len] = measure_comm(self.trunk, block_len)
        return self._plans[block_len]

    def stats(self, block_len: int) -> dict[str, Any]:
        """The per-cycle communication of a forward of ``block_len`` positions (1 = an AR step)."""
        plan = self.comm(block_len)
        # A vocabulary-sharded LM head gathers the head's logits once per draft position.
        head_gathers = (block_len - 1) if isinstance(self.trunk.output_layer, _GatheredOutput) else 0
        return {
            "mode": self.mode,
            "ranks": self.size,
            "rank": self.rank,
            "layers": list(self.layer_range),
            "collectives_per_cycle": plan.collectives,
            "bytes_per_cycle": plan.payload_bytes,
            "collective_kinds": plan.kinds,
            "head_collectives_per_cycle": head_gathers,
        }

    def agree_on_request(self, seed: int | None, request: dict[str, Any]) -> int:
        """Rank 0's seed for this request, after checking every rank got the same request."""
        local_seed = seed if seed is not None else time.time_ns() % (2**62)
        request_digest = _digest(json.dumps({**request, "seed": seed}, sort_keys=True, default=str))
        seed_parts = [(local_seed >> shift) & 0xFFFF for shift in (0, 16, 32, 48)]
        row = np.array(seed_parts + list(request_digest), dtype=np.int32)
        with self.guarded("the request agreement"):
            rows = _gather_rows(self.group, row)
        for r in range(1, self.size):
            if not np.array_equal(rows[r, 4:], rows[0, 4:]):
                raise MtplxError(
                    f"distributed: rank {r} got a different request (prompt or settings) than rank 0"
                )
        return sum(int(p) << shift for p, shift in zip(rows[0, :4], (0, 16, 32, 48)))

    @contextlib.contextmanager
    def guarded(self, what: str) -> Iterator[None]:
        """Arm the watchdog and turn a lost peer into an MtplxError."""
        with self.watchdog.armed(what):
            try:
                yield
            except RuntimeError as e:
                text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if not any(tag in text for tag in _BACKEND_TAGS):
                    raise
                raise MtplxError(
                    f"distributed: rank {self.rank}: {what} failed ({text}); another rank died "
                    "or the network dropped"
                ) from None


# --------------------------------------------------------------------------- set-up


def shard_engine(
    engine: Any, group: mx.distributed.Group, requested: bool | str, collective_timeout: float
) -> Distributed:
    """Shard ``engine.trunk`` (loaded lazily, head already attached) over ``group``.

    The head is built before sharding, from the full model, so it is the same
    replicated module on every rank; then each rank keeps its part of the trunk,
    materializes only that, and all ranks compare fingerprints.
    """
    requested = parse_mode(requested)
    watchdog = Watchdog(collective_timeout, rank=group.rank())
    trunk, config = engine.trunk, engine.config
    model = trunk.model
    mode = choose_mode(model, trunk.inner, requested, config)
    layer_range = (0, len(trunk.layers))
    if mode == "pipeline":
        owner = _mlx_lm_pipeline_owner(model)
        if owner is not None:
            owner.pipeline(group)
            layer_range = (owner.start_idx, owner.end_idx)
        else:
            layer_range = _pipeline_llama(trunk.inner, group)
    else:
        check_tensor_split(model, group.size(), config)
        try:
            model.shard(group)
        except (AssertionError, ValueError) as e:
            raise MtplxError(
                f"distributed: tensor parallel sharding of model type {_model_type(config)!r} over "
                f"{group.size()} ranks failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            ) from None
        if isinstance(trunk.output_layer, _VOCAB_SHARDED):
            trunk.output_layer = _GatheredOutput(trunk.output_layer, group)
    materialize(model)  # its private arrays too: the server decodes on its own thread
    dist = Distributed(group, mode, layer_range, watchdog, trunk, {})
    head_fp = "" if engine.head is None else weights_fingerprint(dict(tree_flatten(engine.head.parameters())))
    with dist.guarded("the load-time fingerprint check"):
        check_agreement(
            group,
            {
                "model": engine.fingerprint,
                "head": head_fp,
                "settings": json.dumps({"mode": mode, "depth": engine.depth, "ranks": group.size()}),
            },
        )
    return dist
