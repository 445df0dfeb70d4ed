"""`mtplx forge`'s training: the head it starts from, the schedule, checkpoints, the loop.

Deterministic given the seed: step ``s`` always trains on the same rows (``batch_rows``),
and a run resumed from its newest checkpoint (head weights and optimizer state in one
file, written whole) continues exactly as one straight run would.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.forge.config import ForgeConfig
from mtplx.forge.loss import Batch, Objective, batch_rows, make_batch, unrolled_step_losses, weighted_loss
from mtplx.forge.record import ForgeData
from mtplx.heads.forged import ForgedMTPHead, build_forged_head
from mtplx.io import atomic_path
from mtplx.trunk.model import Trunk

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten


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


def lr_schedule(cfg: ForgeConfig, steps: int) -> Callable[[mx.array], mx.array]:
    """Linear warm-up to the peak rate, then cosine decay to a tenth of it at ``steps``."""
    warmup = max(min(cfg.warmup, steps // 4), 1)
    peak = cfg.peak_lr
    warm = optim.linear_schedule(peak * 0.01, peak, warmup)
    decay = optim.cosine_decay(peak, max(steps - warmup, 1), peak * 0.1)
    return optim.join_schedules([warm, decay], [warmup])


def _ckpt_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step-{step:06d}.safetensors"


def latest_checkpoint(ckpt_dir: Path) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint in ``ckpt_dir``; None when there is none."""
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
    """Restore the head weights and the optimizer state `save_checkpoint` wrote."""
    from mlx.utils import tree_unflatten

    arrays = mx.load(str(path))
    head.load_weights([(k[5:], v) for k, v in arrays.items() if k.startswith("head.")], strict=True)
    opt.state = tree_unflatten([(k[4:], v) for k, v in arrays.items() if k.startswith("opt.")])


@dataclass
class TrainResult:
    """How a `train_head` call went: the step it reached, its seconds, its logged losses."""

    steps: int
    seconds: float
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, depth-1 KL) at log points
    step_losses: list[float] = field(default_factory=list)  # last logged cross-entropy per draft step


class TrainStep:
    """One training step of ``head`` at a time (AdamW on the unrolled chain's weighted loss, the
    gradient clipped to norm 1, ``cfg``'s schedule over ``total`` steps): `train_head`'s loop body,
    and the server's background trainer's, which must stop between steps. A drafter of another
    shape (`mtplx.forge.drafter`'s EAGLE-3) overrides ``prepare`` and ``step_losses``: the rows,
    schedule, optimizer, clipping and checkpoints stay these."""

    def __init__(
        self, cfg: Any, trunk: Trunk, head: Any, data: ForgeData, train_ids: np.ndarray | None, total: int
    ):
        self.cfg, self.trunk, self.head, self.data = cfg, trunk, head, data
        self.in_shared = self.prepare(train_ids)
        self.opt = optim.AdamW(learning_rate=lr_schedule(cfg, total), weight_decay=cfg.weight_decay)

        def loss_fn(batch: Batch) -> tuple[mx.array, list[mx.array]]:
            losses = self.step_losses(batch)
            return weighted_loss(losses, cfg.step_weights), losses

        self.loss_and_grad = nn.value_and_grad(head, loss_fn)

    def prepare(self, train_ids: np.ndarray | None) -> np.ndarray:
        """Make what every step shares; returns the [V] bool mask of the ids the loss normalises over."""
        self.obj = Objective.build(self.trunk, train_ids)
        self.head.freeze(keys=[])  # every head parameter trains; the trunk is not part of the head's tree
        return self.obj.in_shared

    def step_losses(self, batch: Batch) -> list[mx.array]:
        """The masked mean cross-entropy of each draft step of ``batch``, the chain unrolled."""
        return unrolled_step_losses(
            self.head, self.obj.rows_matrix, self.obj.shared_proj, batch, self.cfg.depth
        )

    def batch(self, step: int) -> Batch:
        """Step ``step``'s rows (`batch_rows`) as a `Batch`."""
        cfg = self.cfg
        rows = batch_rows(self.data.num_sequences, cfg.batch_size, step, cfg.seed)
        return make_batch(self.trunk, self.data, rows, cfg.hidden_source, self.in_shared, cfg.depth)

    def seconds(self, n: int = 1) -> float:
        """Measured seconds of one step's forward and backward (no update), to size a time budget."""
        times = []
        for i in range(n + 1):
            batch = self.batch(i)
            t = time.perf_counter()
            mx.eval(self.loss_and_grad(batch))
            times.append(time.perf_counter() - t)
        return float(np.median(times[1:]))

    def __call__(self, step: int) -> tuple[float, list[mx.array]]:
        """Train on step ``step``'s rows (`batch_rows`); returns (the depth-1 KL, the step losses)."""
        batch = self.batch(step)
        (_, losses), grads = self.loss_and_grad(batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.opt.update(self.head, grads)
        mx.eval(self.head.parameters(), self.opt.state, losses)
        return float(losses[0].item()) + batch.entropy, losses


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
    make_step: Callable[..., TrainStep] = TrainStep,
) -> TrainResult:
    """Train ``head`` in place for ``steps`` (default ``cfg.steps``) steps with the unrolled chain,
    resuming from the newest checkpoint in ``ckpt_dir``.

    ``stop_at`` ends early (with a checkpoint) on the same schedule, so a short run
    continued later is identical to one straight run. ``make_step`` builds the step (`TrainStep`,
    or a drafter's subclass).
    """
    total = cfg.steps if steps is None else steps
    end = total if stop_at is None else min(stop_at, total)
    train_step = make_step(cfg, trunk, head, data, train_ids, total)
    opt = train_step.opt
    start = 0
    found = latest_checkpoint(ckpt_dir)
    if found is not None and found[0] <= end:
        opt.init(head.trainable_parameters())
        load_checkpoint(found[1], head, opt)
        start = found[0]
    result = TrainResult(start, 0.0)
    t0 = time.time()
    from tqdm import tqdm

    bar = tqdm(total=end, initial=start, desc=f"train d{cfg.depth}", unit="step", disable=not cfg.progress)
    ema = None
    # Ctrl-C leaves the newest periodic checkpoint (written whole); a rerun resumes from it.
    for step in range(start, end):
        kl, losses = train_step(step)
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
