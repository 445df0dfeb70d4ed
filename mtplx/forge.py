"""`mtplx forge`: train a Qwen3-Next-style MTP head for a trunk that ships none.

Objective: self-distillation. The head at position t gets the trunk's hidden
state at t and the true token t+1, and must reproduce the trunk's OWN
distribution at t+1 (over token t+2): KL(p_trunk || q_head). Acceptance of a
draft is 1 - TV(p, q) against the trunk, not against the data, so matching the
trunk is the quantity that pays.

Stages (each resumable, all deterministic given the seed):
  1. corpus -> token windows (``forge_data``)
  2. teacher precompute: trunk hidden states (float16) and top-N teacher
     log-probs written once to .npy memmaps, so epochs cost only the head
  3. training (AdamW, cosine schedule, checkpoints every few hundred steps)
  4. teacher-forced acceptance per depth on held-out text, at temperature 0 and 0.7
  5. sidecar: head.safetensors + manifest.json (``mtplx.heads.forged``)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx import compat
from mtplx.errors import MtplxError
from mtplx.forge_data import Corpus, Sample, corpus_from_paths, default_corpus
from mtplx.heads.forged import ForgedMTPHead, build_forged_head, lm_head_matrix, save_forged_head
from mtplx.io import atomic_path, atomic_write
from mtplx.trunk import Trunk

HIDDEN_SOURCES = ("pre_norm", "post_norm")
_PRECOMPUTE_VERSION = 1


@dataclass
class ForgeConfig:
    """Everything that determines a forged head (recorded in its manifest)."""

    out_dir: Path
    model: str | None = None  # model spec for ``load_model``; None = the default model
    data: list[str] | None = None  # text / .jsonl files or directories; None = the default corpus
    work_dir: Path | None = None  # teacher cache and checkpoints; default under the mtplx cache
    train_tokens: int = 288_000
    eval_tokens: int = 8192
    seq_len: int = 256
    top_n: int = 64  # teacher log-probs kept per position (plus the remaining mass)
    precompute_batch: int = 8
    steps: int = 1200
    batch_size: int = 4  # sequences per step
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    seed: int = 0
    hidden_source: str = "pre_norm"  # measured better for SmolLM2 (see its model card)
    train_vocab: int | None = (
        4096  # frequent ids shared by every position's softmax while training (cost); None = full
    )
    draft_vocab: int | None = None  # ship a reduced-vocabulary head of this size; None = full vocabulary
    checkpoint_every: int = 200
    eval_depths: int = 3
    eval_origins: int = 32  # positions per sequence used for depth >= 2 (each needs its own cache state)
    progress: bool = True

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.hidden_source not in HIDDEN_SOURCES:
            raise MtplxError(
                f"forge: hidden_source must be one of {', '.join(HIDDEN_SOURCES)}, got {self.hidden_source!r}"
            )
        for name in (
            "train_tokens",
            "seq_len",
            "top_n",
            "steps",
            "batch_size",
            "precompute_batch",
            "checkpoint_every",
        ):
            if int(getattr(self, name)) <= 0:
                raise MtplxError(f"forge: {name} must be positive, got {getattr(self, name)}")


def _write_json(path: Path, obj: Any) -> None:
    with atomic_write(path) as handle:
        handle.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ---------------------------------------------------------------- tokenizing


def sample_ids(tokenizer: Any, sample: Sample) -> list[int]:
    """Token ids of one sample: chat samples through the tokenizer's own template."""
    if sample.is_chat:
        messages = [{"role": r, "content": c} for r, c in sample.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = list(tokenizer.encode(sample.text, add_special_tokens=False))
    eos = tokenizer.eos_token_id
    return ids + ([int(eos)] if eos is not None else [])


def pack_windows(
    tokenizer: Any, samples: Sequence[Sample], seq_len: int, max_tokens: int, seed: int
) -> np.ndarray:
    """Shuffle the samples (seeded), concatenate their ids and cut [N, seq_len] windows (at most max_tokens)."""
    order = np.random.default_rng(seed).permutation(len(samples))
    stream: list[int] = []
    for i in order:
        stream.extend(sample_ids(tokenizer, samples[int(i)]))
        if len(stream) >= max_tokens + seq_len:
            break
    n = min(len(stream), max_tokens) // seq_len
    return np.asarray(stream[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def files_in_windows(
    tokenizer: Any, samples: Sequence[Sample], seq_len: int, tokens: int, seed: int
) -> list[str]:
    """Source files of the samples that reach the first ``tokens`` tokens of ``pack_windows``' stream
    (same seeded order): exactly the files a run trained or evaluated on."""
    order = np.random.default_rng(seed).permutation(len(samples))
    used: set[str] = set()
    offset = 0
    for i in order:
        if offset >= tokens:
            break
        used.add(samples[int(i)].source)
        offset += len(sample_ids(tokenizer, samples[int(i)]))
    return sorted(used)


# ---------------------------------------------------------------- teacher precompute


@dataclass
class TeacherData:
    """Memmapped teacher cache: tokens [N,T], pre-norm hidden [N,T,H] f16, top-N ids/log-probs [N,T,K]."""

    tokens: np.ndarray
    hidden: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])


_TEACHER_FILES = ("tokens", "hidden", "top_ids", "top_logp")


def _teacher_meta(fingerprint: str, windows: np.ndarray, hidden_size: int, top_n: int) -> dict:
    import hashlib

    return {
        "version": _PRECOMPUTE_VERSION,
        "trunk_fingerprint": fingerprint,
        "tokens_sha256": hashlib.sha256(windows.tobytes()).hexdigest()[:16],
        "shape": list(windows.shape),
        "hidden_size": hidden_size,
        "top_n": top_n,
    }


def top_n_logprobs(logits: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, log-probs) of the n most likely tokens per row, sorted by probability (NumPy: its exp is vectorized)."""
    logits = logits.astype(np.float32, copy=False)
    m = logits.max(axis=-1, keepdims=True)
    lse = m + np.log(np.exp(logits - m).sum(axis=-1, keepdims=True))
    ids = np.argpartition(-logits, n - 1, axis=-1)[..., :n]
    vals = np.take_along_axis(logits, ids, axis=-1)
    order = np.argsort(-vals, axis=-1, kind="stable")
    ids = np.take_along_axis(ids, order, axis=-1)
    return ids.astype(np.int32), (np.take_along_axis(vals, order, axis=-1) - lse).astype(np.float32)


def precompute_teacher(
    trunk: Trunk,
    fingerprint: str,
    windows: np.ndarray,
    cache_dir: Path,
    top_n: int,
    batch: int,
    progress: bool,
    limit: int | None = None,
) -> TeacherData:
    """Run the frozen trunk once over ``windows``; resumes from the last completed batch.

    ``limit`` computes only the first rows (the cache stays keyed by all ``windows``,
    so a later call with a higher limit continues it); the returned arrays are cut to it.
    """
    n, seq_len = windows.shape
    todo = n if limit is None else min(limit, n)
    top_n = min(top_n, trunk.vocab_size)
    hidden_size = int(trunk.inner.embed_tokens.weight.shape[1])
    meta = _teacher_meta(fingerprint, windows, hidden_size, top_n)
    meta_path, progress_path = cache_dir / "teacher.json", cache_dir / "teacher_progress.json"
    shapes = {
        "tokens": (n, seq_len),
        "hidden": (n, seq_len, hidden_size),
        "top_ids": (n, seq_len, top_n),
        "top_logp": (n, seq_len, top_n),
    }
    dtypes = {"tokens": np.int32, "hidden": np.float16, "top_ids": np.int32, "top_logp": np.float32}
    done = 0
    fresh = not (meta_path.exists() and json.loads(meta_path.read_text()) == meta)
    if fresh:
        cache_dir.mkdir(parents=True, exist_ok=True)
        meta_path.unlink(missing_ok=True)  # invalid until every array is (re)created
        progress_path.unlink(missing_ok=True)
        for name in _TEACHER_FILES:
            np.lib.format.open_memmap(
                cache_dir / f"{name}.npy", mode="w+", dtype=dtypes[name], shape=shapes[name]
            ).flush()
        _write_json(meta_path, meta)
    elif progress_path.exists():
        done = int(json.loads(progress_path.read_text())["sequences_done"])
    arrays = {name: np.load(cache_dir / f"{name}.npy", mmap_mode="r+") for name in _TEACHER_FILES}
    if done < todo:
        from tqdm import tqdm

        bar = tqdm(
            total=todo * seq_len,
            initial=done * seq_len,
            unit="tok",
            desc="teacher",
            disable=not progress,
            smoothing=0.1,
        )
        for start in range(done, todo, batch):
            stop = min(start + batch, todo)
            out = trunk(mx.array(windows[start:stop]))
            mx.eval(out.logits, out.hidden_pre_norm)
            ids, logp = top_n_logprobs(np.asarray(out.logits), top_n)
            arrays["tokens"][start:stop] = windows[start:stop]
            arrays["hidden"][start:stop] = np.asarray(out.hidden_pre_norm.astype(mx.float16))
            arrays["top_ids"][start:stop] = ids
            arrays["top_logp"][start:stop] = logp
            for a in arrays.values():
                a.flush()
            # Progress is recorded only after the rows are on disk, so a kill loses at most one batch.
            _write_json(progress_path, {"sequences_done": stop})
            bar.update((stop - start) * seq_len)
        bar.close()
    ro = {name: np.load(cache_dir / f"{name}.npy", mmap_mode="r")[:todo] for name in _TEACHER_FILES}
    return TeacherData(ro["tokens"], ro["hidden"], ro["top_ids"], ro["top_logp"])


# ---------------------------------------------------------------- corpus -> windows


def load_corpus(cfg: ForgeConfig) -> Corpus:
    if cfg.data is None:
        return default_corpus(_work_root(cfg) / "sources", cfg.train_tokens)
    return corpus_from_paths(list(cfg.data))


def _work_root(cfg: ForgeConfig) -> Path:
    if cfg.work_dir is not None:
        return Path(cfg.work_dir)
    from mtplx.loading import cache_root

    return cache_root() / "forge"


def build_windows(cfg: ForgeConfig, tokenizer: Any, corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) token windows [N, seq_len]; MtplxError when the data cannot fill one window."""
    train = pack_windows(tokenizer, corpus.train, cfg.seq_len, cfg.train_tokens, cfg.seed)
    if train.shape[0] == 0:
        raise MtplxError(
            f"{corpus.train_files[0] if corpus.train_files else 'forge'}: training data has fewer than {cfg.seq_len} tokens"
        )
    evals = pack_windows(tokenizer, corpus.eval, cfg.seq_len, cfg.eval_tokens, cfg.seed + 1)
    if evals.shape[0] == 0:
        # Tiny user data: evaluate on the last training window rather than not at all (recorded in the manifest).
        evals = train[-1:]
    return train, evals


def teacher_dir(cfg: ForgeConfig, fingerprint: str) -> Path:
    return _work_root(cfg) / f"{fingerprint}-s{cfg.seed}-n{cfg.train_tokens}-t{cfg.seq_len}"


# ---------------------------------------------------------------- the head


def build_head(trunk: Trunk, hidden_source: str) -> ForgedMTPHead:
    """A forged head for ``trunk``, initialised to start near the trunk's own behaviour.

    The decoder layer is a copy of the trunk's LAST layer (it already maps late-layer
    states toward next-token features); fc sums the two normed inputs (identity
    blocks) so both the new token and the context reach that layer from step 0;
    the output norm copies the trunk's final norm, which the shared LM head expects.
    """
    head = build_forged_head(trunk, hidden_source)
    template = trunk.layers[len(trunk.layers) - 1]
    head.layers[0].load_weights([(k, mx.array(v)) for k, v in tree_flatten(template.parameters())])
    hidden_size = int(head.fc.weight.shape[0])
    eye = mx.eye(hidden_size, dtype=mx.float32)
    head.fc.weight = mx.concatenate([eye, eye], axis=1)
    head.norm.weight = mx.array(trunk.inner.norm.weight)
    mx.eval(head.parameters())
    return head


def frequent_ids(teacher: TeacherData, rows: int, size: int, vocab: int) -> np.ndarray:
    """The ``size`` ids the trunk most often predicts (top-1 and input tokens), sorted by id.

    Ranked by the TRUNK's argmax, since a draft only pays when it matches the
    trunk; input tokens break ties so common-but-never-argmax ids still rank.
    """
    counts = np.bincount(teacher.top_ids[:rows, :, 0].reshape(-1), minlength=vocab).astype(np.float64)
    counts += 0.1 * np.bincount(teacher.tokens[:rows].reshape(-1), minlength=vocab)
    order = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return np.sort(order).astype(np.int32)


# ---------------------------------------------------------------- training


@dataclass
class Batch:
    hidden: mx.array  # [B, T-1, H] trunk hidden at t (chosen source)
    next_tokens: mx.array  # [B, T-1] token t+1
    top_ids: mx.array  # [B, T-1, K] the teacher's top-K ids at t+1
    top_in_shared: mx.array  # [B, T-1, K] bool: that id is also in the shared candidate set
    p_top: mx.array  # [B, T-1, K] their teacher probabilities
    p_rest: mx.array  # [B, T-1] teacher mass outside the top K
    entropy: float  # mean over positions of sum p log p (so KL = cross-entropy + entropy)


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Rows of step ``step``: epoch-wise permutations seeded by (seed, epoch), so any step is reproducible."""
    per_epoch = max(num_rows // batch_size, 1)
    epoch, within = divmod(step, per_epoch)
    perm = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return np.sort(perm[within * batch_size : (within + 1) * batch_size]) if num_rows >= batch_size else perm


def make_batch(
    trunk: Trunk, teacher: TeacherData, rows: np.ndarray, hidden_source: str, in_shared: np.ndarray
) -> Batch:
    hidden = mx.array(np.asarray(teacher.hidden[rows, :-1], dtype=np.float32))
    if hidden_source == "post_norm":
        hidden = trunk.final_norm(hidden)
    tokens = np.asarray(teacher.tokens[rows])
    ids = np.asarray(teacher.top_ids[rows, 1:])
    p = np.exp(np.asarray(teacher.top_logp[rows, 1:], dtype=np.float64))
    rest = np.clip(1.0 - p.sum(-1), 0.0, 1.0)
    total = p.sum(-1) + rest  # float32 rounding of the stored log-probs
    p, rest = p / total[..., None], rest / total
    entropy = float(
        ((p * np.log(np.maximum(p, 1e-30))).sum(-1) + rest * np.log(np.maximum(rest, 1e-30))).mean()
    )
    return Batch(
        hidden,
        mx.array(tokens[:, 1:]),
        mx.array(ids),
        mx.array(in_shared[ids]),
        mx.array(p.astype(np.float32)),
        mx.array(rest.astype(np.float32)),
        entropy,
    )


def distill_loss(head: Any, rows_matrix: mx.array, shared_proj: mx.array | None, batch: Batch) -> mx.array:
    """Cross-entropy of the head against the teacher's buckets {each top-K id, everything else} (= KL + const).

    A full-vocabulary softmax per position costs more than the head itself on a CPU
    (its exp dominates), so q is normalised over the teacher's top-K ids plus a
    shared set of frequent ids (``shared_proj`` [H, M]; None = the full vocabulary):
    the ids a head could plausibly confuse. q's "rest" bucket is then the shared
    ids outside this position's top-K, matched to the teacher's mass outside its top-K.
    """
    g = head(batch.hidden, batch.next_tokens, None)  # [B, T, H]
    w_top = rows_matrix[batch.top_ids]  # [B, T, K, H]
    logit_top = (w_top @ g[..., None]).squeeze(-1)  # [B, T, K]
    logit_shared = g @ shared_proj if shared_proj is not None else g @ rows_matrix.T
    # Top-K ids that are also shared would be counted twice in the normaliser.
    lse = mx.logsumexp(
        mx.concatenate([logit_shared, mx.where(batch.top_in_shared, -mx.inf, logit_top)], -1), -1
    )
    logq_top = logit_top - lse[..., None]
    logq_rest = mx.log(mx.maximum(1.0 - mx.exp(logq_top).sum(-1), 1e-6))
    ce = -(batch.p_top * logq_top).sum(-1) - batch.p_rest * logq_rest
    return ce.mean()


def lr_schedule(cfg: ForgeConfig) -> Callable[[mx.array], mx.array]:
    warm = optim.linear_schedule(cfg.lr * 0.01, cfg.lr, max(cfg.warmup, 1))
    decay = optim.cosine_decay(cfg.lr, max(cfg.steps - cfg.warmup, 1), cfg.lr * 0.1)
    return optim.join_schedules([warm, decay], [max(cfg.warmup, 1)])


def _ckpt_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:06d}.safetensors"


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    found = sorted(ckpt_dir.glob("step-*.safetensors"))
    return (int(found[-1].stem.split("-")[1]), found[-1]) if found else None


def save_checkpoint(ckpt_dir: Path, step: int, head: Any, opt: optim.Optimizer, keep: int = 2) -> None:
    """Head weights + optimizer state in one safetensors file (temp + rename); keeps the newest ``keep``."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    arrays = {f"head.{k}": v for k, v in tree_flatten(head.parameters())}
    arrays.update({f"opt.{k}": v for k, v in tree_flatten(opt.state)})
    with atomic_path(_ckpt_path(ckpt_dir, step)) as tmp:
        mx.save_safetensors(str(tmp), arrays)
    for old in sorted(ckpt_dir.glob("step-*.safetensors"))[:-keep]:
        old.unlink()


def load_checkpoint(path: Path, head: Any, opt: optim.Optimizer) -> None:
    from mlx.utils import tree_unflatten

    arrays = mx.load(str(path))
    head.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("head.")], strict=True)
    opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, KL) at log points


def train_head(
    cfg: ForgeConfig,
    trunk: Trunk,
    head: Any,
    teacher: TeacherData,
    train_ids: np.ndarray | None,
    ckpt_dir: Path,
    rows: int | None = None,
    log_every: int = 10,
    stop_at: int | None = None,
) -> TrainResult:
    """Train ``head`` in place for ``cfg.steps`` steps, resuming from the newest checkpoint in ``ckpt_dir``.

    ``stop_at`` ends early (with a checkpoint) on the same schedule, so a short run
    continued later is identical to one straight run.
    """
    end = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    rows = teacher.num_sequences if rows is None else min(rows, teacher.num_sequences)
    full = lm_head_matrix(trunk)
    vocab = int(full.shape[1])
    rows_matrix = mx.contiguous(full.T)  # [V, H]: rows gathered per teacher id
    in_shared = np.ones(vocab, dtype=bool)
    shared_proj = None
    if train_ids is not None:
        shared_proj = full[:, mx.array(train_ids)]
        in_shared[:] = False
        in_shared[train_ids] = True
    mx.eval(rows_matrix, shared_proj) if shared_proj is not None else mx.eval(rows_matrix)
    head.freeze(keys=[])  # every head parameter trains; the trunk is not part of the head's tree
    opt = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
    start = 0
    found = latest_checkpoint(ckpt_dir)
    if found is not None and found[0] <= end:
        opt.init(head.trainable_parameters())
        load_checkpoint(found[1], head, opt)
        start = found[0]
    loss_and_grad = nn.value_and_grad(head, lambda b: distill_loss(head, rows_matrix, shared_proj, b))
    result = TrainResult(start, 0.0)
    t0 = time.time()
    from tqdm import tqdm

    bar = tqdm(
        total=end, initial=start, desc=f"forge {cfg.hidden_source}", unit="step", disable=not cfg.progress
    )
    ema = None
    for step in range(start, end):
        batch = make_batch(
            trunk, teacher, batch_rows(rows, cfg.batch_size, step, cfg.seed), cfg.hidden_source, in_shared
        )
        loss, grads = loss_and_grad(batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, loss)
        kl = float(loss.item()) + batch.entropy
        ema = kl if ema is None else 0.95 * ema + 0.05 * kl
        if (step + 1) % log_every == 0 or step == start:
            result.losses.append((step + 1, kl))
        bar.set_postfix(kl=f"{ema:.3f}")
        bar.update(1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
            save_checkpoint(ckpt_dir, step + 1, head, opt)
    bar.close()
    result.steps, result.seconds = end, time.time() - t0
    return result


# ---------------------------------------------------------------- evaluation

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


def _chain_input(head: Any, g: mx.array) -> mx.array:
    return head.last_pre_norm if getattr(head, "chain_source", "post_norm") == "pre_norm" else g


class _Tally:
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

    def add(self, depth: int, p_logits: np.ndarray, q_logits: np.ndarray) -> None:
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
) -> Any:
    """Teacher-forced acceptance per depth on held-out windows: {"1": {"0.0": a, "0.7": b}, ...}.

    Depth 1: the head at every position t, given (trunk hidden t, true token t+1),
    against the trunk at t+1. Depth d > 1 chains the head on its own output with the
    TRUE tokens (teacher forcing) and with the head cache a decode loop would hold:
    depth-1 entries up to the origin, then the chain's own entries. That needs a
    cache state per origin, so depth > 1 uses ``origins`` evenly spaced positions.
    ``vocab_variants`` ({name: ids or None}) scores the same drafts restricted to each
    id set and returns {name: table} instead of one table.
    """
    tally = _Tally(vocab_variants or {"": None}, depths, temperatures, trunk.vocab_size)
    from tqdm import tqdm

    for start in tqdm(range(0, windows.shape[0], batch), desc="eval", disable=not progress):
        tokens = mx.array(windows[start : start + batch])
        out = trunk(tokens)
        p_logits = np.asarray(out.logits.astype(mx.float32))  # p at position t predicts t+1
        cache = head.make_cache()
        g = head(
            _trunk_source(out, head.hidden_source)[:, :-1], tokens[:, 1:], cache
        )  # position t predicts t+2
        tally.add(1, p_logits[:, 1:], _q_logits(head, g))
        if depths > 1:
            _eval_chain(head, tokens, p_logits, g, cache, depths, origins, tally)
    tables = tally.table()
    return tables if vocab_variants else tables[""]


def _eval_chain(
    head: Any,
    tokens: mx.array,
    p_logits: np.ndarray,
    g1: mx.array,
    cache: list,
    depths: int,
    origins: int,
    tally: _Tally,
) -> None:
    seq_len = tokens.shape[1]
    full_state = [compat.kv_state(c) for c in cache]
    chain1 = _chain_input(head, g1)
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
            tally.add(d, p_logits[:, j + d], _q_logits(head, g)[:, 0])
            x = _chain_input(head, g)


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


# ---------------------------------------------------------------- the entry point


@dataclass
class ForgeReport:
    manifest_path: Path
    hidden_source: str
    acceptance: dict[str, dict[str, float]]
    train_seconds: float
    precompute_seconds: float
    source_comparison: dict[str, float] = field(default_factory=dict)  # depth-1 t=0 acceptance per source


def _foreign_teacher_fingerprint(cache: Path, windows: np.ndarray, top_n: int) -> str:
    """The fingerprint a teacher cache was built with, after checking it holds exactly these windows."""
    meta_path = cache / "teacher.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise MtplxError(f"{meta_path}: not a complete teacher cache") from None
    expected = _teacher_meta(
        meta.get("trunk_fingerprint", ""),
        windows,
        int(meta.get("hidden_size", 0)),
        min(top_n, int(meta.get("top_n", top_n))),
    )
    if meta != expected:
        raise MtplxError(f"{meta_path}: teacher cache holds other windows or settings than this run")
    return str(meta["trunk_fingerprint"])


def _checkpoint_dir(cfg: ForgeConfig, teacher_path: Path, rows: int, source: str) -> Path:
    import hashlib

    key = json.dumps(
        [cfg.steps, cfg.batch_size, cfg.lr, cfg.warmup, cfg.weight_decay, cfg.seed, cfg.train_vocab, rows]
    )
    return teacher_path / f"ckpt-{source}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _train_for_source(
    cfg: ForgeConfig,
    trunk: Trunk,
    teacher: TeacherData,
    rows: int,
    train_ids: np.ndarray | None,
    tdir: Path,
    source: str,
    stop_at: int | None,
) -> tuple[ForgedMTPHead, TrainResult]:
    run_cfg = ForgeConfig(**{**asdict(cfg), "hidden_source": source})
    head = build_head(trunk, source)
    result = train_head(
        run_cfg,
        trunk,
        head,
        teacher,
        train_ids,
        _checkpoint_dir(cfg, tdir, rows, source),
        rows,
        stop_at=stop_at,
    )
    return head, result


def forge(
    model: str | None = None,
    out_dir: str | Path = "forged-head",
    data: Sequence[str | Path] | None = None,
    *,
    steps: int = 1200,
    train_tokens: int = 288_000,
    seed: int = 0,
    hidden_source: str = "pre_norm",
    compare_steps: int = 40,
    draft_vocab: int | str | None = "auto",
    train_vocab: int | None = 4096,
    batch_size: int = 4,
    lr: float = 1e-3,
    seq_len: int = 256,
    eval_tokens: int = 8192,
    max_train_sequences: int | None = None,
    eval_vocab_sizes: Sequence[int] = (4096, 8192, 16_384),
    eval_origins: int = 32,
    work_dir: str | Path | None = None,
    teacher_cache: str | Path | None = None,
    progress: bool = True,
) -> ForgeReport:
    """Forge an MTP head for ``model`` (None = the default model) and write it to ``out_dir``.

    ``data``: text / .jsonl files or directories (None = the default offline corpus).
    ``hidden_source``: "pre_norm" or "post_norm"; with ``compare_steps`` > 0 both are
    trained that many steps on the same schedule and the one with the higher depth-1
    acceptance (temperature 0, held-out text) continues. ``draft_vocab``: ship a
    reduced draft vocabulary of that many most-predicted ids (None = full; "auto" =
    the smallest of ``eval_vocab_sizes`` that keeps acceptance and measurably drafts faster).
    ``max_train_sequences`` caps the teacher rows computed and used (a prefix of the same windows).
    ``eval_vocab_sizes``: also score reduced draft vocabularies of these sizes (manifest only).
    ``teacher_cache``: train from this existing teacher cache directory even though it was
    computed by a trunk with another fingerprint (e.g. an earlier conversion of the same
    GGUF); its windows must be this run's, and its fingerprint is recorded in the manifest.
    Evaluation and the head's fingerprint always use the trunk loaded here.
    Resumable: rerunning with the same arguments reuses the teacher cache and checkpoints.
    """
    from mtplx.loading import load_model

    if isinstance(draft_vocab, str) and draft_vocab != "auto":
        raise MtplxError(f"forge: draft_vocab must be a number of ids, 'auto' or None, got {draft_vocab!r}")
    cfg = ForgeConfig(
        out_dir=Path(out_dir),
        model=model,
        data=[str(d) for d in data] if data is not None else None,
        work_dir=Path(work_dir) if work_dir is not None else None,
        train_tokens=train_tokens,
        eval_tokens=eval_tokens,
        seq_len=seq_len,
        steps=steps,
        batch_size=batch_size,
        lr=lr,
        seed=seed,
        hidden_source=hidden_source,
        train_vocab=train_vocab,
        draft_vocab=draft_vocab if isinstance(draft_vocab, int) else None,
        eval_origins=eval_origins,
        progress=progress,
    )
    corpus = load_corpus(cfg)  # before loading the model: bad data fails fast
    loaded = load_model(model)
    trunk = Trunk(loaded.model)
    train_windows, eval_windows = build_windows(cfg, loaded.tokenizer, corpus)
    tdir = teacher_dir(cfg, loaded.fingerprint)
    teacher_fp = loaded.fingerprint
    if teacher_cache is not None:
        tdir, teacher_fp = (
            Path(teacher_cache),
            _foreign_teacher_fingerprint(Path(teacher_cache), train_windows, cfg.top_n),
        )
    t0 = time.time()
    teacher = precompute_teacher(
        trunk,
        teacher_fp,
        train_windows,
        tdir,
        cfg.top_n,
        cfg.precompute_batch,
        progress,
        limit=max_train_sequences,
    )
    precompute_seconds = time.time() - t0
    rows = teacher.num_sequences
    vocab = trunk.vocab_size
    train_ids = (
        frequent_ids(teacher, rows, cfg.train_vocab, vocab)
        if cfg.train_vocab and cfg.train_vocab < vocab
        else None
    )

    comparison: dict[str, float] = {}
    source = cfg.hidden_source
    if compare_steps > 0:
        probe = eval_windows[: max(1, min(8, eval_windows.shape[0]))]
        for candidate in HIDDEN_SOURCES:
            head, _ = _train_for_source(cfg, trunk, teacher, rows, train_ids, tdir, candidate, compare_steps)
            comparison[candidate] = evaluate_acceptance(trunk, head, probe, depths=1, temperatures=(0.0,))[
                "1"
            ]["0.0"]
        source = max(HIDDEN_SOURCES, key=lambda s: comparison[s])
    head, result = _train_for_source(cfg, trunk, teacher, rows, train_ids, tdir, source, None)
    cfg.hidden_source = source

    chain_comparison: dict[str, float] = {}
    if cfg.eval_depths > 1:
        # Which of the head's own outputs to feed back at depth 2: measured, like hidden_source.
        probe = eval_windows[: max(1, min(8, eval_windows.shape[0]))]
        for candidate in HIDDEN_SOURCES:
            head.chain_source = candidate
            chain_comparison[candidate] = evaluate_acceptance(
                trunk, head, probe, depths=2, origins=cfg.eval_origins, temperatures=(0.0,)
            )["2"]["0.0"]
        head.chain_source = max(HIDDEN_SOURCES, key=lambda s: chain_comparison[s])
    fixed = draft_vocab if isinstance(draft_vocab, int) else None
    sizes = sorted({k for k in (*eval_vocab_sizes, fixed) if k is not None and k < vocab})
    variants: dict[str, np.ndarray | None] = {"full": None}
    variants.update({f"top{k}": frequent_ids(teacher, rows, k, vocab) for k in sizes})
    tables = evaluate_acceptance(
        trunk,
        head,
        eval_windows,
        depths=cfg.eval_depths,
        origins=cfg.eval_origins,
        progress=progress,
        vocab_variants=variants,
    )
    full_proj = lm_head_matrix(trunk)
    step_ms = draft_step_ms(head, variants, full_proj) if len(variants) > 1 else {}
    if draft_vocab == "auto":
        shipped = choose_draft_vocab(tables, step_ms)
    else:
        shipped = "full" if fixed is None or fixed >= vocab else f"top{fixed}"
    if shipped != "full":
        head.set_draft_vocab(variants[shipped].tolist(), full_proj)
    acc = tables[shipped]
    manifest = {
        "trunk_fingerprint": loaded.fingerprint,
        "teacher_trunk_fingerprint": teacher_fp,
        "trunk": str(model) if model is not None else "default (SmolLM2-135M-Instruct, float32)",
        "depth_trained": 1,
        "objective": f"KL(p_trunk(t+1) || q_head(t)) over teacher top-{cfg.top_n} + rest mass",
        "data": {
            "description": corpus.description,
            "train_files": files_in_windows(
                loaded.tokenizer, corpus.train, cfg.seq_len, rows * cfg.seq_len, cfg.seed
            ),
            "eval_files": files_in_windows(
                loaded.tokenizer, corpus.eval, cfg.seq_len, int(eval_windows.size), cfg.seed + 1
            ),
            "train_tokens": int(rows * cfg.seq_len),
            "eval_tokens": int(eval_windows.size),
            "seq_len": cfg.seq_len,
        },
        "steps": result.steps,
        "seed": cfg.seed,
        "training": {
            "batch_size": cfg.batch_size,
            "lr": cfg.lr,
            "warmup": cfg.warmup,
            "train_vocab": cfg.train_vocab,
            "seconds_this_run": round(result.seconds, 1),
            "precompute_seconds_this_run": round(precompute_seconds, 1),
            "final_kl": result.losses[-1][1] if result.losses else None,
        },
        "hidden_source_comparison": {"steps": compare_steps, "depth1_acceptance_t0": comparison}
        if comparison
        else None,
        "chain_source_comparison": {"depth2_acceptance_t0": chain_comparison} if chain_comparison else None,
        "acceptance": acc,
        "draft_vocab": shipped,
        "acceptance_by_draft_vocab": tables,
        "draft_step_ms": step_ms,
        "draft_vocab_rule": "auto: smallest reduced vocabulary losing <= 0.01 depth-1 acceptance and drafting >= 20% faster"
        if draft_vocab == "auto"
        else f"fixed: {draft_vocab}",
        "acceptance_note": "teacher-forced, 1 - TV(p_trunk, q_head) per draft depth on held-out windows; "
        "temperature 0 = greedy argmax agreement",
    }
    path = save_forged_head(cfg.out_dir, head, manifest)
    return ForgeReport(path, source, acc, result.seconds, precompute_seconds, comparison)
