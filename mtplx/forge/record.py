"""`mtplx forge`'s training data: the trunk's own writing, recorded while it writes.

Many prompts are generated in one batch (left-padded, an mlx-lm ``BatchKVCache`` per
trunk layer, so every row sees only its own tokens and positions). Each step records
what training needs, so there is no second teacher pass:

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
random key follow from (seed, i) alone, so a fresh machine regenerates the same data.

Batched cache and left padding follow mlx-lm's ``BatchKVCache`` docstring
(mlx_lm/models/cache.py) and its ``create_causal_mask``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtplx.errors import MtplxError
from mtplx.forge.prompts import Prompt, prompt_ids
from mtplx.io import atomic_path
from mtplx.sample.params import Setting
from mtplx.trunk.compat import BatchKVCache
from mtplx.trunk.model import Trunk

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

    @classmethod
    def concat(cls, parts: Sequence[ForgeData]) -> ForgeData:
        return cls(*(np.concatenate([getattr(p, n) for p in parts]) for n in SHARD_FILES))


NUCLEUS_CANDIDATES = (
    256  # top-p draws among the most likely ids only: a full sort per step costs more than the model
)


def _sample(logp: mx.array, setting: Setting, key: mx.array) -> mx.array:
    """Greedy, or temperature + nucleus (top-p) sampling of each row.

    Top-p is applied within the ``NUCLEUS_CANDIDATES`` most likely ids (training data, not
    decoding: the tail beyond them holds far less than 1 - top_p of the mass in practice).
    """
    if setting.temperature == 0.0:
        return mx.argmax(logp, axis=-1)
    logits = logp / setting.temperature
    if setting.top_p >= 1.0:
        return mx.random.categorical(logits, key=key)
    k = min(NUCLEUS_CANDIDATES, logits.shape[-1])
    cand = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
    cand_logits = mx.take_along_axis(logits, cand, axis=-1)
    order = mx.argsort(-cand_logits, axis=-1)
    cand, cand_logits = (
        mx.take_along_axis(cand, order, axis=-1),
        mx.take_along_axis(cand_logits, order, axis=-1),
    )
    probs = mx.exp(cand_logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    before = mx.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
    cand_logits = mx.where(before < setting.top_p, cand_logits, -mx.inf)
    drawn = mx.random.categorical(cand_logits, key=key)
    return mx.take_along_axis(cand, drawn[:, None], axis=-1)[:, 0]


def _top_k(logp: mx.array, k: int) -> tuple[mx.array, mx.array]:
    ids = mx.argpartition(-logp, k - 1, axis=-1)[:, :k]
    vals = mx.take_along_axis(logp, ids, axis=-1)
    order = mx.argsort(-vals, axis=-1)
    return mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(vals, order, axis=-1)


def generate_batch(
    trunk: Trunk,
    prompts: Sequence[list[int]],
    setting: Setting,
    key: mx.array,
    seq_len: int,
    top_k: int,
    eos_ids: set[int],
    deadline: float | None = None,
) -> ForgeData:
    """Generate a response for every prompt (until EOS or ``seq_len`` slots) and record the training data.

    Rows that reach EOS leave the batch (``BatchKVCache.filter``): responses differ a lot in
    length, and decoding finished rows to the longest one's end wasted most of the compute.
    ``deadline`` (time.time()) cuts every response short when it passes, so a time budget
    is kept even when one batch takes minutes (the cut responses are still valid data)."""
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    if width >= seq_len - 1:
        raise ValueError(f"prompts must be shorter than seq_len - 1 ({seq_len - 1}), got {width}")
    pads = [width - n for n in lengths]
    batch = mx.array([[0] * pad + list(p) for pad, p in zip(pads, prompts)], dtype=mx.int32)
    cache = [BatchKVCache(pads) for _ in trunk.layers]
    pre, post = trunk.forward_hidden(batch, cache)
    prompt_hidden = np.asarray(pre.astype(mx.float16))
    rows, k = len(prompts), min(top_k, trunk.vocab_size)
    response = [_Response() for _ in range(rows)]
    active = np.arange(rows)  # original row of each batch row
    eos = np.array(sorted(eos_ids))
    steps = seq_len - width  # every row's response fits its slots
    for j in range(steps):
        logits = trunk.lm_head(post[:, -1, :]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # raw: temperature 1, no filter
        key, step_key = mx.random.split(key)
        token = _sample(logp, setting, step_key).astype(mx.int32)
        ids, vals = _top_k(logp, k)
        mx.eval(token, ids, vals)
        token_np, ids_np, vals_np = np.asarray(token), np.asarray(ids), np.asarray(vals)
        for b, r in enumerate(active):
            response[r].add(token_np[b], ids_np[b], vals_np[b])
        going = ~np.isin(token_np, eos)
        if not going.any() or j == steps - 1 or (deadline is not None and time.time() >= deadline):
            break
        if not going.all():
            keep = mx.array(np.flatnonzero(going))
            for c in cache:
                c.filter(keep)
            token, active = token[keep], active[going]
        pre, post = trunk.forward_hidden(token[:, None], cache)
        hidden_np = np.asarray(pre[:, -1].astype(mx.float16))
        for b, r in enumerate(active):
            response[r].hidden.append(hidden_np[b])
    return _pack(prompts, prompt_hidden, pads, response, seq_len)


@dataclass
class _Response:
    """One row's generated tokens, the distributions they came from, and the states after reading them."""

    tokens: list[int] = field(default_factory=list)
    top_ids: list[np.ndarray] = field(default_factory=list)
    top_logp: list[np.ndarray] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)

    def add(self, token: np.integer, ids: np.ndarray, logp: np.ndarray) -> None:
        self.tokens.append(int(token))
        self.top_ids.append(ids)
        self.top_logp.append(logp)


def _pack(
    prompts: Sequence[list[int]],
    prompt_hidden: np.ndarray,
    pads: list[int],
    response: Sequence[_Response],
    seq_len: int,
) -> ForgeData:
    rows, hidden_size, k = len(prompts), prompt_hidden.shape[-1], response[0].top_ids[0].shape[-1]
    out = ForgeData(
        np.zeros((rows, seq_len), np.int32),
        np.zeros((rows, seq_len, hidden_size), np.float16),
        np.zeros((rows, seq_len, k), np.int32),
        np.zeros((rows, seq_len, k), np.float32),
        np.zeros((rows, seq_len), bool),
    )
    for r, (prompt, resp) in enumerate(zip(prompts, response)):
        p, n = len(prompt), len(resp.tokens)  # response length, EOS included
        out.tokens[r, :p] = prompt
        out.tokens[r, p : p + n] = resp.tokens
        out.hidden[r, :p] = prompt_hidden[r, pads[r] :]
        if n > 1:
            out.hidden[r, p : p + n - 1] = np.stack(resp.hidden[: n - 1])  # state after reading token j
        out.top_ids[r, p - 1 : p - 1 + n] = np.stack(resp.top_ids)  # distribution token j was drawn from
        out.top_logp[r, p - 1 : p - 1 + n] = np.stack(resp.top_logp)
        out.valid[r, p : p - 1 + n] = True
    return out


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

    def key(self) -> str:
        blob = json.dumps(
            [
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


def generate_shards(
    trunk: Trunk,
    tokenizer,
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
    Returns a summary for the manifest.
    """
    from tqdm import tqdm

    directory.mkdir(parents=True, exist_ok=True)
    max_prompt = max_prompt or plan.seq_len // 2
    eos = set(int(i) for i in getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    index, tokens = 0, 0
    for path in sorted(directory.glob("shard-*.npz")):
        with np.load(path) as z:
            tokens += int(z["valid"].sum())
        index = int(path.stem.split("-")[1]) + 1
    bar = tqdm(
        total=target_tokens, initial=min(tokens, target_tokens), unit="tok", desc=desc, disable=not progress
    )
    start, made, empty_run = time.time(), 0, 0
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
            data = generate_batch(
                trunk, [ids for _, ids in encoded], setting, key, plan.seq_len, plan.top_k, eos, deadline
            )
            meta = {
                "setting": setting.label(explicit_top_p=True),
                "kinds": [p.kind for p, _ in encoded],
                "sources": [p.source for p, _ in encoded],
            }
            data, meta = drop_empty_rows(data, meta)
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
    return {
        "shards": count_shards(directory),
        "response_tokens": tokens,
        "seconds_this_run": round(time.time() - start, 1),
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
