"""`mtplx forge`'s training data: the trunk's own writing, recorded while it writes.

Many prompts are generated together through the one scheduler (`mtplx.engine.scheduler`, the
one cycle: every row sees only its own tokens and positions, rows leave at EOS and the next
prompts join after their own prefill). Through each row's trunk tap it records what training needs, so there
is no second teacher pass:

* the trunk's hidden state (before its final norm: forged heads read ``pre_norm``),
  float16, for every prompt and response position;
* the trunk's RAW next-token distribution (temperature 1, before any sampling
  filter) as its top-K log-probs; the rest mass is 1 - their sum;
* the token drawn (greedy, or temperature / top-p, per shard).

A row of a shard holds one sequence, prompt then response, left-aligned in
``seq_len`` slots: ``tokens[s]`` = x_s, ``hidden[s]`` = trunk state after reading x_s,
``top_*[s]`` = the trunk's distribution over x_{s+1}, ``valid[s]`` = that distribution
is a response position a head drafts at (s >= prompt length: the first response
token is sampled by the trunk itself, never drafted). Shards are written whole
(temp name, rename), so a killed run loses at most the shard in progress and a
rerun continues after the last complete one; shard i's prompts, setting and
random key follow from (seed, i) alone, and each row's key from the shard's, so a fresh
machine regenerates the same data.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from mtplx.engine.request import Drafting, GenerationRequest
from mtplx.engine.scheduler import BatchScheduler
from mtplx.errors import MtplxError
from mtplx.forge.prompts import Prompt, prompt_ids
from mtplx.io import atomic_path
from mtplx.sample.params import SamplerConfig, Setting
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx
import numpy as np

SHARD_FILES = ("tokens", "hidden", "top_ids", "top_logp", "valid")


@dataclass
class ForgeData:
    """Generated sequences, [N, T] (+ [.., H] / [.., K]); see the module docstring for the layout."""

    tokens: np.ndarray
    hidden: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray
    valid: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_response_tokens(self) -> int:
        return int(self.valid.sum())

    def arrays(self) -> tuple[np.ndarray, ...]:
        """The arrays in `SHARD_FILES` order."""
        return tuple(getattr(self, n) for n in SHARD_FILES)

    @classmethod
    def concat(cls, parts: Sequence[ForgeData]) -> ForgeData:
        return cls(*(np.concatenate([getattr(p, n) for p in parts]) for n in SHARD_FILES))

    @classmethod
    def zeros(cls, rows: int, seq_len: int, width: int, k: int) -> ForgeData:
        """Zeroed arrays for ``rows`` sequences of ``seq_len`` positions (hidden width ``width``,
        the trunk's top ``k``), nothing valid yet."""
        return cls(
            np.zeros((rows, seq_len), np.int32),
            np.zeros((rows, seq_len, width), np.float16),
            np.zeros((rows, seq_len, k), np.int32),
            np.zeros((rows, seq_len, k), np.float32),
            np.zeros((rows, seq_len), bool),
        )


def _top_k(logp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    ids = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


@dataclass
class _Run:
    """A run of positions one row committed (a trunk tap's call), queued until it is written."""

    row: int
    start: int  # its first position in the row's sequence
    hidden: mx.array  # [n, H] float16
    first_distribution: int  # offset of its first position whose distribution is kept (before: prompt)
    logits: mx.array | None  # [n - first_distribution, V], None when the run is all prompt


class _Recorder:
    """Writes what the rows' trunk taps see into ``out``, one batched top-K per decoder call.

    The taps only queue lazy slices. ``flush`` (after each decoder call) turns the queue into one
    batched computation and starts it (``mx.async_eval``, no host sync), and writes the batch
    started by the call before: the decoder's own sync since then ran it, so reading it back never
    waits. Thus recording adds no host sync to a cycle."""

    def __init__(self, out: ForgeData, prompt_lengths: Sequence[int], top_k: int, taps: bool = False):
        self.out, self.prompt_lengths, self.top_k = out, prompt_lengths, top_k
        self.taps = taps  # record the trunk's layer taps joined (a drafter's input), not its last hidden
        self.forwarded = [0] * len(prompt_lengths)  # positions each row's tap has seen
        self.queued: list[_Run] = []
        self.started: tuple[list[_Run], mx.array, mx.array | None, mx.array | None] | None = None

    def tap(self, row: int):
        def record(output: TrunkOutput) -> None:
            start, n = self.forwarded[row], output.hidden_pre_norm.shape[1]
            self.forwarded[row] += n
            first = min(max(self.prompt_lengths[row] - 1 - start, 0), n)
            logits = output.logits[0, first:] if first < n else None
            hidden = mx.concatenate(output.layer_hidden, axis=-1) if self.taps else output.hidden_pre_norm
            self.queued.append(_Run(row, start, hidden[0].astype(mx.float16), first, logits))

        return record

    def flush(self) -> None:
        self._write_started()
        if not self.queued:
            return
        runs, self.queued = self.queued, []
        hidden = mx.concatenate([run.hidden for run in runs])
        logits = [run.logits for run in runs if run.logits is not None]
        ids = vals = None
        if logits:
            stacked = mx.concatenate(logits).astype(mx.float32)
            logp = stacked - mx.logsumexp(stacked, axis=-1, keepdims=True)  # raw: temperature 1, no filter
            ids, vals = _top_k(logp, self.top_k)
        mx.async_eval(hidden, *([ids, vals] if logits else []))
        self.started = (runs, hidden, ids, vals)

    def finish(self) -> None:
        self.flush()
        self._write_started()

    def _write_started(self) -> None:
        if self.started is None:
            return
        (runs, hidden, ids, vals), self.started = self.started, None
        out, seq_len = self.out, self.out.tokens.shape[1]
        hidden_np = np.asarray(hidden)
        ids_np, vals_np = (np.asarray(ids), np.asarray(vals)) if ids is not None else (None, None)
        h = d = 0  # offsets of the next run in the batched hidden / distributions
        for run in runs:
            n = run.hidden.shape[0]
            end = min(run.start + n, seq_len)  # a speculative block may reach past the last slot
            out.hidden[run.row, run.start : end] = hidden_np[h : h + end - run.start]
            h += n
            if run.logits is not None:
                m = n - run.first_distribution
                first = run.start + run.first_distribution
                stop = min(first + m, seq_len)
                out.top_ids[run.row, first:stop] = ids_np[d : d + stop - first]
                out.top_logp[run.row, first:stop] = vals_np[d : d + stop - first]
                d += m


def generate_batch(
    engine,
    prompts: Sequence[list[int]],
    setting: Setting,
    key: mx.array,
    seq_len: int,
    top_k: int,
    eos_ids: set[int],
    deadline: float | None = None,
    *,
    depth: int = 0,
    max_rows: int | None = None,
    taps: Sequence[int] = (),
) -> ForgeData:
    """Generate a response for every prompt (until EOS, at most ``seq_len`` less the longest prompt
    tokens) and record the training data: every prompt is a `GenerationRequest` submitted to the
    one scheduler (`mtplx.engine.scheduler`) on ``engine`` (an `Engine`), its trunk tap a row
    option, so forge decodes as every other entry does (`RecordingBatch`, driven to its end).

    At most ``max_rows`` rows (default: every prompt) decode at once; a row leaves at EOS and the
    next prompt joins after its own prefill (responses differ a lot in length). Row r samples with
    its own key, split from ``key``, so the data follow from (key, prompts) alone. With ``depth`` > 0
    and the engine's head, rows draft ``depth`` tokens per cycle (default 0: plain AR) and the trunk verifies them
    exactly: the tokens have the same distribution, and the recorded distributions are the verify
    forward's own at each committed position; `generate_shards` does not draft: with 32 rows on a
    2-core CPU the trunk is compute bound and verifying two positions a row halved tokens/s
    (benchmarks/forge_generation.py, the default model's card). ``taps`` (decoder layer ids):
    ``hidden`` holds those layers' outputs joined, [.., len(taps) H] (an EAGLE-3 drafter's input,
    `mtplx.forge.drafter`), instead of the last hidden state. A shard's rows all start together
    (``max_rows`` unset): joins across shards would make a shard's floats depend on where a run
    resumed. ``deadline`` (time.time()) stops the scheduler after its first step once it passes,
    so a time budget is kept even when one batch takes minutes (the cut responses are still
    valid data)."""
    lengths = [len(p) for p in prompts]
    if max(lengths) >= seq_len - 1:
        raise ValueError(f"prompts must be shorter than seq_len - 1 ({seq_len - 1}), got {max(lengths)}")
    # The fixed-batch loop this replaced gave every row the slots the longest prompt leaves; kept,
    # so shards written before and after it (one resumed run can hold both) answer alike.
    batch = RecordingBatch(
        engine,
        prompts,
        setting,
        mx.random.split(key, len(prompts)),
        seq_len - max(lengths),
        top_k,
        eos_ids,
        depth=depth,
        max_rows=max_rows,
        taps=taps,
        seq_len=seq_len,
        deadline=deadline,
    )
    batch.advance()
    return batch.data()


class RecordingBatch:
    """Prompts generated together through the one scheduler, each row's training data recorded as
    it is written (the module docstring): `generate_batch` drives it to the end at once; the
    server's learner (`mtplx.learn.sampling`) drives it a bounded piece at a time between requests
    (`advance` with a time budget), so a request that arrives waits one step at most.

    Row r samples ``max_tokens`` (or ``max_tokens[r]``) at most with ``setting`` and its key ``keys[r]``;
    it ends at one of ``eos_ids``, kept as its last token. The rows are ``seq_len`` slots wide (default:
    the longest a row can get, prompt and response). ``taps``: as `generate_batch`'s, tapped only while
    a piece runs. ``prefill_step_size``: prompt tokens prefilled per step (default: every prompt whole
    in the first step)."""

    def __init__(
        self,
        engine,
        prompts: Sequence[list[int]],
        setting: Setting,
        keys: Sequence[mx.array],
        max_tokens: int | Sequence[int],
        top_k: int,
        eos_ids: set[int],
        *,
        depth: int = 0,
        max_rows: int | None = None,
        taps: Sequence[int] = (),
        seq_len: int | None = None,
        deadline: float | None = None,
        prefill_step_size: int | None = None,
    ):
        trunk = engine.trunk
        self.trunk, self.prompts, self.taps, self.deadline = trunk, list(prompts), tuple(taps), deadline
        lengths = [len(p) for p in prompts]
        rows, k = len(prompts), min(top_k, trunk.vocab_size)
        limits = [max_tokens] * rows if isinstance(max_tokens, int) else list(max_tokens)
        width = trunk.embed(mx.array([0])).shape[-1] * max(len(taps), 1)
        self.out = ForgeData.zeros(rows, seq_len or max(map(sum, zip(lengths, limits))), width, k)
        self.recorder = _Recorder(self.out, lengths, k, taps=bool(taps))
        request = GenerationRequest(
            sampler=SamplerConfig(temperature=setting.temperature, top_p=setting.top_p),
            max_tokens=limits[0],
            drafting=Drafting(
                kind="head" if engine.head is not None and depth else "none", depth=depth or None
            ),
            stop_token_ids=tuple(sorted(eos_ids)),  # exactly these end a response
            ignore_eos=True,
            detokenize=False,
        )
        width = max_rows or rows
        # By default every waiting prompt prefills in one step, whole: the first rows all join at once.
        prefill = prefill_step_size or sum(lengths) + rows
        scheduler = BatchScheduler(engine, width, width, prefill_step_size=prefill)
        self.handles = {
            scheduler.submit(
                prompt, replace(request, max_tokens=limits[r]), key=keys[r], trunk_tap=self.recorder.tap(r)
            ): r
            for r, prompt in enumerate(prompts)
        }
        self.response: list[list[int]] = [[] for _ in prompts]
        self._results = scheduler.drive(self._after_step)
        self.done = False

    def _after_step(self, _results) -> bool:  # the step's recorded positions; True: the deadline stops it
        self.recorder.flush()
        return self.deadline is not None and time.time() >= self.deadline

    def advance(self, seconds: float | None = None) -> bool:
        """Generate until every row ended, or (``seconds`` given) until that much time has passed and
        the step under way ended; True once every row ended. Errors raise (the batch is then done)."""
        began = time.perf_counter()
        tapped = self.trunk.tapped_layers
        if self.taps:
            self.trunk.tap_layers(self.taps)
        try:
            while not self.done:
                try:
                    result = next(self._results)
                except StopIteration:
                    self.done = True
                    break
                if result.error is not None:
                    self.close()
                    raise result.error
                r = self.handles[result.handle]
                self.response[r].extend(result.chunk.token_ids)
                if result.chunk.eos_token is not None:
                    self.response[r].append(result.chunk.eos_token)
                if seconds is not None and time.perf_counter() - began >= seconds:
                    break
        finally:
            if self.taps:
                self.trunk.tap_layers(tapped or None)
        return self.done

    def data(self) -> ForgeData:
        """The recorded rows (after `advance` returned True): prompt, response, valid positions."""
        self.recorder.finish()
        _write_sequences(self.out, self.prompts, self.response)
        return self.out

    def close(self) -> None:
        """Drop the rows still decoding (their memory freed)."""
        self._results.close()
        self.done = True


def _write_sequences(out: ForgeData, prompts: Sequence[list[int]], response: Sequence[list[int]]) -> None:
    """Each row's tokens, prompt then response, and which positions a head trains on."""
    for r, (prompt, resp) in enumerate(zip(prompts, response)):
        p, end = len(prompt), len(prompt) + len(resp)  # end: the sequence's length, EOS included
        out.tokens[r, :p] = prompt
        out.tokens[r, p:end] = resp
        # The state after reading the last token, and the distribution after it, belong to no pair
        # a head trains on; under speculation they may hold positions drafted past EOS.
        out.hidden[r, max(end - 1, 0) :] = 0
        out.top_ids[r, max(end - 1, 0) :] = 0
        out.top_logp[r, max(end - 1, 0) :] = 0
        out.valid[r, p : end - 1] = True


# ---------------------------------------------------------------- shards on disk


@dataclass(frozen=True)
class ShardPlan:
    """What makes shard i: the prompts it answers, with which setting and key (all from the seed)."""

    prompts: tuple[Prompt, ...]
    settings: tuple[Setting, ...]
    batch: int
    seq_len: int
    top_k: int
    seed: int
    fingerprint: str
    taps: tuple[int, ...] = ()  # decoder layers recorded joined instead of the last hidden (`generate_batch`)

    def key(self) -> str:
        blob = json.dumps(
            ([list(self.taps)] if self.taps else [])  # keyed only when set: head runs keep their directory
            + [
                [(p.kind, p.source, p.text, p.messages) for p in self.prompts],
                [(s.temperature, s.top_p) for s in self.settings],
                self.batch,
                self.seq_len,
                self.top_k,
                self.seed,
                self.fingerprint,
            ]
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def shard(self, index: int) -> tuple[list[Prompt], Setting, mx.array]:
        # Each pass over the prompts is a fresh seeded permutation; settings alternate by shard.
        per_pass = max(len(self.prompts) // self.batch, 1)
        epoch, within = divmod(index, per_pass)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
        chosen = [self.prompts[int(i)] for i in order[within * self.batch : (within + 1) * self.batch]]
        return chosen, self.settings[index % len(self.settings)], mx.random.key(self.seed * 1_000_003 + index)


def _shard_path(directory: Path, index: int) -> Path:
    return directory / f"shard-{index:05d}.npz"


def save_shard(path: Path, data: ForgeData, meta: dict) -> None:
    with atomic_path(path) as tmp:  # keeps the .npz suffix, so numpy writes exactly there
        np.savez(tmp, meta=np.array(json.dumps(meta)), **{n: getattr(data, n) for n in SHARD_FILES})


def load_shards(directory: Path, count: int | None = None) -> tuple[ForgeData, list[dict]]:
    paths = sorted(directory.glob("shard-*.npz"))[:count]
    parts, metas = [], []
    for path in paths:
        with np.load(path) as z:
            parts.append(ForgeData(*(z[n] for n in SHARD_FILES)))
            metas.append(json.loads(str(z["meta"])))
    return ForgeData.concat(parts), metas


def count_shards(directory: Path) -> int:
    return len(list(directory.glob("shard-*.npz")))


def _resume_point(directory: Path) -> tuple[int, int]:
    """(the next shard's index, the response tokens already written) from the complete shards."""
    index, tokens = 0, 0
    for path in sorted(directory.glob("shard-*.npz")):
        with np.load(path) as z:
            tokens += int(z["valid"].sum())
        index = int(path.stem.split("-")[1]) + 1
    return index, tokens


def _make_shard(engine, plan: ShardPlan, encoded, setting: Setting, key, eos: set[int], deadline) -> tuple:
    """One shard's data and metadata from its (prompt, ids) pairs; rows with nothing to train on dropped."""
    began = time.perf_counter()
    data = generate_batch(
        engine,
        [ids for _, ids in encoded],
        setting,
        key,
        plan.seq_len,
        plan.top_k,
        eos,
        deadline,
        taps=plan.taps,
    )
    seconds = time.perf_counter() - began
    meta = {
        "setting": setting.label(explicit_top_p=True),
        "kinds": [p.kind for p, _ in encoded],
        "sources": [p.source for p, _ in encoded],
        "seconds": round(seconds, 2),
        "response_tokens_per_s": round(data.num_response_tokens / max(seconds, 1e-9), 1),
    }
    return drop_empty_rows(data, meta)


def generate_shards(
    engine,
    plan: ShardPlan,
    directory: Path,
    target_tokens: int,
    deadline: float | None,
    progress: bool,
    desc: str = "generate",
    max_prompt: int | None = None,
    max_shards: int | None = None,
) -> dict:
    """Write shards until ``target_tokens`` response tokens exist or ``deadline`` (time.time()) passes.

    Resumes after the last complete shard. Prompts longer than ``max_prompt`` tokens are
    skipped (chat templates cannot be cut). ``max_shards`` also stops at that shard index.
    Returns a summary for the manifest, with this run's response tokens per second of generation.
    """
    from tqdm import tqdm

    tokenizer = engine.tokenizer
    directory.mkdir(parents=True, exist_ok=True)
    max_prompt = max_prompt or plan.seq_len // 2
    eos = set(int(i) for i in getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    index, tokens = _resume_point(directory)
    bar = tqdm(
        total=target_tokens, initial=min(tokens, target_tokens), unit="tok", desc=desc, disable=not progress
    )
    start, made, empty_run, generating = time.time(), 0, 0, 0.0
    per_pass = max(len(plan.prompts) // plan.batch, 1)
    while (
        tokens < target_tokens
        and (deadline is None or time.time() < deadline)
        and (max_shards is None or index < max_shards)
    ):
        chosen, setting, key = plan.shard(index)
        encoded = [(p, prompt_ids(tokenizer, p)) for p in chosen]
        encoded = sorted(
            ((p, ids) for p, ids in encoded if 0 < len(ids) <= max_prompt), key=lambda e: len(e[1])
        )
        # Every prompt too long: no shard i, but the numbering (and so the plan) is kept.
        empty_run = 0 if encoded else empty_run + 1
        if empty_run >= per_pass:
            raise MtplxError(f"forge: no prompt of {plan.prompts[0].source} ... fits in {max_prompt} tokens")
        if encoded:
            data, meta = _make_shard(engine, plan, encoded, setting, key, eos, deadline)
            generating += meta["seconds"]
        if encoded and data.num_sequences:
            save_shard(_shard_path(directory, index), data, meta)
            tokens += data.num_response_tokens
            made += data.num_response_tokens
            bar.update(min(data.num_response_tokens, max(target_tokens - bar.n, 0)))
        index += 1
        if deadline is not None and made:
            # A time budget: re-aim the bar at what the remaining time will produce, so its ETA is honest.
            rate = made / max(time.time() - start, 1e-6)
            bar.total = max(bar.n, min(target_tokens, tokens + int(rate * max(deadline - time.time(), 0))))
            bar.refresh()
    bar.close()
    rate = round(made / generating, 1) if generating else None
    if progress and made:
        print(f"{desc}: {made} response tokens in {generating:.0f}s of generation ({rate} tokens/s)")
    return {
        "shards": count_shards(directory),
        "response_tokens": tokens,
        "seconds_this_run": round(time.time() - start, 1),
        "response_tokens_per_s_this_run": rate,
    }


def drop_empty_rows(data: ForgeData, meta: dict) -> tuple[ForgeData, dict]:
    """Rows without a position to train on (EOS first, or cut by the deadline before a second token) removed.

    They cost a batch slot and teach nothing; a deadline in the middle of a prefill once left a
    whole shard of them (the last shard of a 110-minute run, 2026-12-01).
    """
    keep = data.valid.any(axis=1)
    if keep.all():
        return data, meta
    rows = np.flatnonzero(keep)
    per_row = {k: [v[i] for i in rows] for k, v in meta.items() if isinstance(v, list)}
    return ForgeData(*(getattr(data, n)[rows] for n in SHARD_FILES)), {**meta, **per_row}


def kind_counts(metas: Sequence[dict]) -> dict[str, dict[str, int]]:
    """{setting: {kind: sequences}} over shards' metadata (for the manifest)."""
    out: dict[str, dict[str, int]] = {}
    for m in metas:
        row = out.setdefault(m["setting"], {})
        for kind in m["kinds"]:
            row[kind] = row.get(kind, 0) + 1
    return out
