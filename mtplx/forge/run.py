"""`mtplx forge`: train a Qwen3-Next-style MTP head for a trunk that ships none.

Objective: self-distillation on the trunk's OWN writing. The trunk answers a broad
prompt set (``forge_prompts``) through its chat template, greedily and sampled;
while it writes, ``forge_gen`` records its hidden states and its raw next-token
distributions (top-K log-probs + rest mass). The head at position t gets the
trunk's hidden state at t and token t+1 and must reproduce the trunk's distribution
at t+1: KL(p_trunk || q_head), on response tokens only. Acceptance of a draft is
1 - TV(p, q) against the trunk, so matching the trunk is the quantity that pays.

The draft chain is unrolled in training exactly as ``decode.mtp_decode`` runs it:
step k feeds the head its own previous output (``chain_input``) and the next token,
and attends to the true-state entries up to its origin plus its own chain entries
(``UnrollCache``), so positions 2 and 3 are trained, not extrapolated (the
training-time unrolling of HASS / EAGLE-3, whose papers describe the idea; no code
was followed). Per-step loss weights trade position 1 against the deeper ones.

Stages (each resumable, deterministic given the seed; one ``--budget`` covers all):
  1. generate training and held-out shards (``forge_gen``)
  2. training (AdamW, cosine schedule, checkpoints, Ctrl-C saves one)
  3. teacher-forced acceptance per depth on held-out generations, t 0 and 0.7
  4. sidecar: head.safetensors + manifest.json (``mtplx.heads.forged``), written
     to a temp directory and renamed into place
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.forge.config import (
    DEFAULT_FORGE_CONFIG,
    GEN_SHARE,
    MIN_TIME_BUDGET_S,
    TOKEN_BUDGET_EPOCHS,
    TRAIN_SHARE,
    Budget,
    ForgeConfig,
    parse_budget,
)
from mtplx.forge.prompts import (
    Prompt,
    check_held_out,
    default_prompts,
    drop_held_out,
    prompts_from_samples,
    read_held_out,
    split_prompts,
)
from mtplx.forge.record import ForgeData, Setting, ShardPlan, generate_shards, kind_counts, load_shards
from mtplx.heads.forged import ForgedMTPHead, build_forged_head, lm_head_matrix, save_forged_head
from mtplx.io import atomic_path, atomic_write
from mtplx.trunk import compat
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten


def _write_json(path: Path, obj: Any) -> None:
    with atomic_write(path) as handle:
        handle.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


# ---------------------------------------------------------------- prompts


def load_prompts(cfg: ForgeConfig) -> tuple[list[Prompt], str, dict]:
    """(prompts, description, held-out record): the default set minus held-out overlaps, or the user's
    prompts, refused when they overlap the held-out suite."""
    held = read_held_out(Path(cfg.held_out)) if cfg.held_out is not None else []
    if cfg.data is None:
        prompts, desc = default_prompts()
        prompts, dropped = drop_held_out(prompts, held)
    else:
        from mtplx.forge.corpus import corpus_from_paths

        corpus = corpus_from_paths(list(cfg.data), eval_fraction=0.0)
        prompts, desc, dropped = prompts_from_samples(corpus.train), corpus.description, 0
        if not prompts:
            raise MtplxError(f"{cfg.data[0]}: no prompts in the training data")
    record = check_held_out(prompts, held) if held else {"held_out_prompts": 0}
    record = {**record, "suite": cfg.held_out, "default_prompts_dropped_for_overlap": dropped}
    return prompts, desc, record


def _work_root(cfg: ForgeConfig) -> Path:
    if cfg.work_dir is not None:
        return Path(cfg.work_dir)
    from mtplx.resources import cache_root

    return cache_root() / "forge"


def _settings(cfg: ForgeConfig) -> tuple[Setting, ...]:
    return tuple(Setting(float(t), float(p)) for t, p in cfg.settings)


# ---------------------------------------------------------------- the head


def build_head(
    trunk: Trunk, hidden_source: str, chain_source: str | None = None, num_layers: int = 1
) -> ForgedMTPHead:
    """A forged head for ``trunk``, initialised to start near the trunk's own behaviour.

    The first decoder layer is a copy of the trunk's LAST layer (it already maps late-layer
    states toward next-token features); fc sums the two normed inputs (identity
    blocks) so both the new token and the context reach that layer from step 0;
    the output norm copies the trunk's final norm, which the shared LM head expects.
    Further layers start as the identity (see ``_as_identity``), so a deeper head starts
    as the one-layer head and its extra depth is learned, not a random perturbation.
    """
    head = build_forged_head(trunk, hidden_source, num_layers, chain_source)
    template = trunk.layers[len(trunk.layers) - 1]
    template_weights = [(k, mx.array(v)) for k, v in tree_flatten(template.parameters())]
    for i, layer in enumerate(head.layers):
        layer.load_weights(template_weights)
        if i > 0:
            _as_identity(layer)
    hidden_size = int(head.fc.weight.shape[0])
    eye = mx.eye(hidden_size, dtype=mx.float32)
    head.fc.weight = mx.concatenate([eye, eye], axis=1)
    head.norm.weight = mx.array(trunk.inner.norm.weight)
    mx.eval(head.parameters())
    return head


def _as_identity(layer: nn.Module) -> None:
    """Zero the projections that write into the residual stream (attention output, MLP down), so
    the pre-norm decoder layer returns its input; its other weights still get gradients once
    those projections move off zero (as a LoRA adapter's zero-initialised B does)."""
    zeroed = [
        (path, mx.zeros_like(value))
        for path, value in tree_flatten(layer.parameters())
        if path.endswith(("o_proj.weight", "down_proj.weight"))
    ]
    if len(zeroed) != 2:
        raise MtplxError(
            f"--head-layers: {type(layer).__name__} layers have no o_proj and down_proj to start an extra "
            "head layer as the identity; use --head-layers 1 for this model"
        )
    layer.load_weights(zeroed, strict=False)


def init_from_head(head: ForgedMTPHead, head_dir: str, trunk: Trunk, fingerprint: str) -> str:
    """Copy the weights of the forged head in ``head_dir`` (forged for this trunk) into ``head``;
    returns their sha256 for the manifest.

    ``head`` may be deeper than the source: its first layers take the source's, and the
    rest keep their identity start, so the deeper head begins exactly where the source was.
    """
    from mtplx.heads.forged import load_forged_head, read_manifest

    source = load_forged_head(head_dir, trunk, fingerprint)
    if source.num_layers > head.num_layers:
        raise MtplxError(
            f"{head_dir}: init head has {source.num_layers} layer(s), this run builds {head.num_layers}"
        )
    head.load_weights(list(tree_flatten(source.parameters())), strict=source.num_layers == head.num_layers)
    mx.eval(head.parameters())
    return str(read_manifest(head_dir).get("weights_sha256", ""))


def frequent_ids(data: ForgeData, size: int, vocab: int) -> np.ndarray:
    """The ``size`` ids the trunk most often predicts at response positions (input tokens break ties), sorted.

    Ranked by the TRUNK's argmax, since a draft only pays when it matches the trunk.
    """
    counts = np.bincount(data.top_ids[..., 0][data.valid], minlength=vocab).astype(np.float64)
    counts += 0.1 * np.bincount(data.tokens[data.valid], minlength=vocab)
    order = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return np.sort(order).astype(np.int32)


# ---------------------------------------------------------------- the unrolled draft chain


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
    w = [float(x) for x in weights[: len(losses)]]
    return sum(wi * li for wi, li in zip(w, losses)) / sum(w)


# ---------------------------------------------------------------- training


def lr_schedule(cfg: ForgeConfig, steps: int) -> Callable[[mx.array], mx.array]:
    warmup = max(min(cfg.warmup, steps // 4), 1)
    peak = cfg.peak_lr
    warm = optim.linear_schedule(peak * 0.01, peak, warmup)
    decay = optim.cosine_decay(peak, max(steps - warmup, 1), peak * 0.1)
    return optim.join_schedules([warm, decay], [warmup])


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
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, depth-1 KL) at log points
    step_losses: list[float] = field(default_factory=list)  # last logged cross-entropy per draft step


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


def train_head(
    cfg: ForgeConfig,
    trunk: Trunk,
    head: Any,
    data: ForgeData,
    train_ids: np.ndarray | None,
    ckpt_dir: Path,
    steps: int | None = None,
    log_every: int = 10,
    stop_at: int | None = None,
) -> TrainResult:
    """Train ``head`` in place for ``steps`` (default ``cfg.steps``) steps with the unrolled chain,
    resuming from the newest checkpoint in ``ckpt_dir``.

    ``stop_at`` ends early (with a checkpoint) on the same schedule, so a short run
    continued later is identical to one straight run.
    """
    total = cfg.steps if steps is None else steps
    end = total if stop_at is None else min(stop_at, total)
    obj = Objective.build(trunk, train_ids)
    head.freeze(keys=[])  # every head parameter trains; the trunk is not part of the head's tree
    opt = optim.AdamW(learning_rate=lr_schedule(cfg, total), weight_decay=cfg.weight_decay)
    start = 0
    found = latest_checkpoint(ckpt_dir)
    if found is not None and found[0] <= end:
        opt.init(head.trainable_parameters())
        load_checkpoint(found[1], head, opt)
        start = found[0]

    def loss_fn(batch: Batch) -> tuple[mx.array, list[mx.array]]:
        losses = unrolled_step_losses(head, obj.rows_matrix, obj.shared_proj, batch, cfg.depth)
        return weighted_loss(losses, cfg.step_weights), losses

    loss_and_grad = nn.value_and_grad(head, loss_fn)
    result = TrainResult(start, 0.0)
    t0 = time.time()
    from tqdm import tqdm

    bar = tqdm(total=end, initial=start, desc=f"train d{cfg.depth}", unit="step", disable=not cfg.progress)
    ema = None
    # Ctrl-C leaves the newest periodic checkpoint (written whole); a rerun resumes from it.
    for step in range(start, end):
        rows = batch_rows(data.num_sequences, cfg.batch_size, step, cfg.seed)
        batch = make_batch(trunk, data, rows, cfg.hidden_source, obj.in_shared, cfg.depth)
        (_, losses), grads = loss_and_grad(batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(head, grads)
        mx.eval(head.parameters(), opt.state, losses)
        kl = float(losses[0].item()) + batch.entropy
        ema = kl if ema is None else 0.95 * ema + 0.05 * kl
        if (step + 1) % log_every == 0 or step == start:
            result.losses.append((step + 1, kl))
            result.step_losses = [round(float(x.item()), 4) for x in losses]
        bar.set_postfix(kl=f"{ema:.3f}")
        bar.update(1)
        if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == end:
            save_checkpoint(ckpt_dir, step + 1, head, opt)
    bar.close()
    result.steps, result.seconds = end, time.time() - t0
    return result


def seconds_per_step(
    cfg: ForgeConfig, trunk: Trunk, head: Any, data: ForgeData, obj: Objective, n: int = 1
) -> float:
    """Measured seconds of one training step (forward + backward, no update) to size a time budget."""

    def loss_fn(batch: Batch) -> mx.array:
        return weighted_loss(
            unrolled_step_losses(head, obj.rows_matrix, obj.shared_proj, batch, cfg.depth), cfg.step_weights
        )

    loss_and_grad = nn.value_and_grad(head, loss_fn)
    times = []
    for i in range(n + 1):
        batch = make_batch(
            trunk,
            data,
            batch_rows(data.num_sequences, cfg.batch_size, i, cfg.seed),
            cfg.hidden_source,
            obj.in_shared,
            cfg.depth,
        )
        t = time.perf_counter()
        mx.eval(loss_and_grad(batch))
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:]))


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

    def add(
        self, depth: int, p_logits: np.ndarray, q_logits: np.ndarray, keep: np.ndarray | None = None
    ) -> None:
        """``keep`` (bool, the rows' shape): positions that count (response positions); None = all."""
        if keep is not None:
            p_logits, q_logits = p_logits[keep], q_logits[keep]
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
    valid: np.ndarray | None = None,
) -> Any:
    """Teacher-forced acceptance per depth on held-out windows: {"1": {"0.0": a, "0.7": b}, ...}.

    Depth 1: the head at every position t, given (trunk hidden t, true token t+1),
    against the trunk at t+1. Depth d > 1 chains the head on its own output with the
    TRUE tokens (teacher forcing) and with the head cache a decode loop would hold:
    depth-1 entries up to the origin, then the chain's own entries. That needs a
    cache state per origin, so depth > 1 uses ``origins`` evenly spaced positions.
    ``vocab_variants`` ({name: ids or None}) scores the same drafts restricted to each
    id set and returns {name: table} instead of one table. ``valid`` [N, T] (bool) counts
    only drafts whose target position s has valid[s] (the response positions of forge data).
    """
    tally = _Tally(vocab_variants or {"": None}, depths, temperatures, trunk.vocab_size)
    from tqdm import tqdm

    keep_all = np.ones(windows.shape, dtype=bool) if valid is None else valid.astype(bool)
    for start in tqdm(range(0, windows.shape[0], batch), desc="eval", disable=not progress):
        tokens = mx.array(windows[start : start + batch])
        keep = keep_all[start : start + batch]
        out = trunk(tokens)
        p_logits = np.asarray(out.logits.astype(mx.float32))  # p at position t predicts t+1
        cache = head.make_cache()
        g = head(
            _trunk_source(out, head.hidden_source)[:, :-1], tokens[:, 1:], cache
        )  # position t predicts t+2
        tally.add(1, p_logits[:, 1:], _q_logits(head, g), keep[:, 1:])
        if depths > 1:
            _eval_chain(head, tokens, p_logits, g, cache, depths, origins, tally, keep)
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
    keep: np.ndarray,
) -> None:
    seq_len = tokens.shape[1]
    full_state = [compat.kv_state(c) for c in cache]
    chain1 = chain_all(head, g1)
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
            tally.add(d, p_logits[:, j + d], _q_logits(head, g)[:, 0], keep[:, j + d])
            x = head.chain_input(g)


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
    acceptance: dict[str, dict[str, float]]
    response_tokens: int
    train_steps: int
    seconds: float


def _check_budget(cfg: ForgeConfig, budget: Budget | None) -> None:
    if budget is None:
        return
    if budget.seconds is not None and budget.seconds < MIN_TIME_BUDGET_S:
        raise MtplxError(
            f"--budget: {cfg.budget} is too small to train anything (at least {MIN_TIME_BUDGET_S:.0f}s)"
        )
    if budget.tokens is not None and budget.tokens < cfg.batch_size * 16:
        raise MtplxError(
            f"--budget: {cfg.budget} is too small to train anything (at least {cfg.batch_size * 16} tokens)"
        )


def _ckpt_dir(cfg: ForgeConfig, run_dir: Path, rows: int, init_sha: str | None) -> Path:
    key = json.dumps(
        [
            cfg.budget,
            cfg.steps,
            cfg.batch_size,
            cfg.max_epochs,
            cfg.peak_lr,
            cfg.warmup,
            cfg.weight_decay,
            cfg.seed,
            cfg.train_vocab,
            cfg.depth,
            list(cfg.step_weights),
            cfg.hidden_source,
            cfg.chain_source,
            init_sha,
            rows,
        ]
        # Keyed only when set, so the checkpoints of one-layer runs keep their directory.
        + ([cfg.head_layers] if cfg.head_layers != 1 else [])
    )
    return run_dir / f"ckpt-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _planned_steps(
    cfg: ForgeConfig,
    budget: Budget | None,
    ckpt_dir: Path,
    train_until: float | None,
    measure: Callable[[], float],
    rows: int,
) -> int:
    """Training steps of this run, fixed once (``steps.json``) so a resumed run keeps its schedule."""
    plan = ckpt_dir / "steps.json"
    if plan.is_file():
        return int(json.loads(plan.read_text())["steps"])
    if budget is not None and budget.seconds is not None:
        per_step = measure()
        steps = int(max(train_until - time.time(), 0.0) / (1.15 * per_step))  # 15%: checkpoints, load
        steps = min(steps, max(1, math.ceil(cfg.max_epochs * rows / cfg.batch_size)))
        if steps < 1:
            raise MtplxError(
                f"--budget: {cfg.budget} is too small to train anything (one step takes {per_step:.1f}s)"
            )
    elif budget is not None:
        steps = max(1, math.ceil(TOKEN_BUDGET_EPOCHS * rows / cfg.batch_size))
    else:
        steps = cfg.steps
    _write_json(plan, {"steps": steps})
    return steps


def _generate(
    cfg: ForgeConfig,
    trunk: Trunk,
    tokenizer: Any,
    plans: dict[str, ShardPlan],
    run_dir: Path,
    budget: Budget | None,
    t_start: float,
) -> dict[str, dict]:
    """Held-out then training shards; with a time budget, generation is marked done when its share ends,
    so a resumed run trains on exactly the same data."""
    done_path = run_dir / "generation_done.json"
    summaries = {
        "eval": generate_shards(
            trunk,
            tokenizer,
            plans["eval"],
            run_dir / "eval",
            cfg.eval_tokens,
            None,
            cfg.progress,
            "generate held-out",
            cfg.max_prompt,
        )
    }
    if done_path.is_file():
        summaries["train"] = json.loads(done_path.read_text())
        return summaries
    if budget is not None and budget.seconds is not None:
        target, deadline = 10**15, t_start + GEN_SHARE * budget.seconds
    else:
        target, deadline = (budget.tokens if budget is not None else None) or cfg.gen_tokens, None
    summaries["train"] = generate_shards(
        trunk,
        tokenizer,
        plans["train"],
        run_dir / "train",
        target,
        deadline,
        cfg.progress,
        "generate",
        cfg.max_prompt,
    )
    _write_json(done_path, summaries["train"])
    return summaries


def _write_sidecar(out: Path, head: ForgedMTPHead, manifest: dict, overwrite: bool) -> Path:
    """Write into a temp directory beside ``out``, then rename: a half-written head never exists."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_forged_head(tmp, head, manifest)
    if out.exists():
        if not overwrite:
            raise MtplxError(f"{out}: output directory exists; pass --overwrite to replace it")
        old = out.with_name(f".{out.name}.old{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out / "manifest.json"


def forge(config: ForgeConfig = DEFAULT_FORGE_CONFIG, **overrides: Any) -> ForgeReport:
    """Forge an MTP head for ``config.model`` (None = the default model) into ``config.out_dir``.

    ``overrides`` replace fields of ``config`` (``forge(model="x", budget="45m")``). Resumable:
    rerunning with the same settings reuses the shards and the newest checkpoint under ``work_dir``.
    """
    from mtplx.checkpoints.load import load_model

    cfg = replace(config, **overrides) if overrides else config
    t_start = time.time()
    out = Path(cfg.out_dir)
    if out.exists() and not cfg.overwrite:
        raise MtplxError(f"{out}: output directory exists; pass --overwrite to replace it")
    budget = parse_budget(cfg.budget) if cfg.budget is not None else None
    _check_budget(cfg, budget)
    prompts, prompt_desc, held_record = load_prompts(cfg)  # before loading the model: bad data fails fast
    loaded = load_model(cfg.model)
    trunk = Trunk(loaded.model)
    train_prompts, eval_prompts = split_prompts(prompts, cfg.eval_fraction)
    if not eval_prompts or not train_prompts:  # tiny user data: held-out generations from the same prompts
        train_prompts = eval_prompts = list(prompts)
    settings = _settings(cfg)
    plans = {
        name: ShardPlan(tuple(ps), settings, cfg.gen_batch, cfg.seq_len, cfg.top_n, seed, loaded.fingerprint)
        for name, ps, seed in (("train", train_prompts, cfg.seed), ("eval", eval_prompts, cfg.seed + 1))
    }
    run_dir = _work_root(cfg) / f"{loaded.fingerprint}-{plans['train'].key()}"
    summaries = _generate(cfg, trunk, loaded.tokenizer, plans, run_dir, budget, t_start)
    data, metas = load_shards(run_dir / "train")
    eval_data, eval_metas = load_shards(run_dir / "eval")
    if data.num_response_tokens == 0 or eval_data.num_response_tokens == 0:
        raise MtplxError(
            f"--budget: {cfg.budget} is too small to train anything (no response tokens generated)"
        )

    vocab = trunk.vocab_size
    train_ids = (
        frequent_ids(data, cfg.train_vocab, vocab) if cfg.train_vocab and cfg.train_vocab < vocab else None
    )
    head = build_head(trunk, cfg.hidden_source, cfg.chain_source, cfg.head_layers)
    init_sha = init_from_head(head, cfg.init_head, trunk, loaded.fingerprint) if cfg.init_head else None
    ckpt_dir = _ckpt_dir(cfg, run_dir, data.num_sequences, init_sha)
    train_until = t_start + (GEN_SHARE + TRAIN_SHARE) * budget.seconds if budget and budget.seconds else None
    steps = _planned_steps(
        cfg,
        budget,
        ckpt_dir,
        train_until,
        lambda: seconds_per_step(cfg, trunk, head, data, Objective.build(trunk, train_ids)),
        data.num_sequences,
    )
    result = train_head(cfg, trunk, head, data, train_ids, ckpt_dir, steps=steps)

    fixed = cfg.draft_vocab if isinstance(cfg.draft_vocab, int) else None
    sizes = sorted({k for k in (*cfg.eval_vocab_sizes, fixed) if k is not None and k < vocab})
    variants: dict[str, np.ndarray | None] = {"full": None}
    variants.update({f"top{k}": frequent_ids(data, k, vocab) for k in sizes})
    tables = evaluate_acceptance(
        trunk,
        head,
        eval_data.tokens,
        depths=cfg.depth,
        origins=cfg.eval_origins,
        progress=cfg.progress,
        vocab_variants=variants,
        valid=eval_data.valid,
    )
    full_proj = lm_head_matrix(trunk)
    step_ms = draft_step_ms(head, variants, full_proj) if len(variants) > 1 else {}
    if cfg.draft_vocab == "auto":
        shipped = choose_draft_vocab(tables, step_ms)
    else:
        shipped = "full" if fixed is None or fixed >= vocab else f"top{fixed}"
    if shipped != "full":
        head.set_draft_vocab(variants[shipped].tolist(), full_proj)
    acc = tables[shipped]
    manifest = {
        "trunk_fingerprint": loaded.fingerprint,
        "trunk": str(cfg.model) if cfg.model is not None else "default (SmolLM2-135M-Instruct, float32)",
        "depth_trained": cfg.depth,
        "objective": f"KL(p_trunk || q_head) over teacher top-{cfg.top_n} + rest mass, response tokens only, "
        f"draft chain unrolled {cfg.depth} steps with weights {list(cfg.step_weights[: cfg.depth])}",
        "recipe": {
            **{
                k: v
                for k, v in asdict(cfg).items()
                if k not in ("out_dir", "work_dir", "progress", "overwrite")
            },
            "lr": cfg.peak_lr,
        },
        "init_head_weights_sha256": init_sha,
        "data": {
            "kind": "the trunk's own generations (regenerable from the recipe and seed)",
            "prompts": prompt_desc,
            "train_prompts": len(train_prompts),
            # Files the training prompts came from (benchmarks/prompts/build_suite.py --check reads them).
            "train_files": sorted({re.split(r"[:#]", p.source)[0] for p in train_prompts}),
            "eval_prompts": len(eval_prompts),
            "held_out_check": held_record,
            "train": {
                **summaries["train"],
                "sequences": data.num_sequences,
                "response_tokens": data.num_response_tokens,
                "sequences_by_setting_and_kind": kind_counts(metas),
            },
            "eval": {
                "sequences": eval_data.num_sequences,
                "response_tokens": eval_data.num_response_tokens,
                "sequences_by_setting_and_kind": kind_counts(eval_metas),
            },
        },
        "steps": result.steps,
        "seed": cfg.seed,
        "training": {
            "seconds_this_run": round(result.seconds, 1),
            "final_kl_depth1": result.losses[-1][1] if result.losses else None,
            "final_cross_entropy_per_step": result.step_losses,
            "kl_curve": result.losses[:: max(1, len(result.losses) // 40)],
        },
        "acceptance": acc,
        "draft_vocab": shipped,
        "acceptance_by_draft_vocab": tables,
        "draft_step_ms": step_ms,
        "draft_vocab_rule": "auto: smallest reduced vocabulary losing <= 0.01 depth-1 acceptance and drafting >= 20% faster"
        if cfg.draft_vocab == "auto"
        else f"fixed: {cfg.draft_vocab}",
        "acceptance_note": "teacher-forced, 1 - TV(p_trunk, q_head) per draft depth at response positions of "
        "held-out generations; temperature 0 = greedy argmax agreement",
        "seconds_total_this_run": round(time.time() - t_start, 1),
    }
    path = _write_sidecar(out, head, manifest, cfg.overwrite)
    return ForgeReport(path, acc, data.num_response_tokens, result.steps, time.time() - t_start)
