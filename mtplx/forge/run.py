"""`mtplx forge`: train a Qwen3-Next-style MTP head for a trunk that ships none.

Objective: self-distillation on the trunk's OWN writing. The trunk answers a broad
prompt set (``mtplx.forge.prompts``) through its chat template, greedily and sampled;
while it writes, ``mtplx.forge.record`` records its hidden states and its raw next-token
distributions (top-K log-probs + rest mass). The head is trained to reproduce those
distributions with its draft chain unrolled as the decode loop runs it (``mtplx.forge.loss``).

Stages (each resumable, deterministic given the seed; one ``--budget`` covers all):
  1. generate training and held-out shards (``mtplx.forge.record``)
  2. training (AdamW, cosine schedule, checkpoints, Ctrl-C saves one: ``mtplx.forge.train``)
  3. teacher-forced acceptance per depth on held-out generations, t 0 and 0.7, and the
     draft vocabulary to ship (``mtplx.forge.evaluate``)
  4. sidecar: head.safetensors + manifest.json (``mtplx.heads.forged``), written
     to a temp directory and renamed into place

Stages 0-1, the training plan, the data record and the sidecar's write are a drafter's run's too
(`mtplx.forge.drafter`): they live in ``mtplx.forge.stages``; this module holds the head's own.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.forge.config import DEFAULT_FORGE_CONFIG, Budget, ForgeConfig
from mtplx.forge.evaluate import choose_draft_vocab, draft_step_ms, evaluate_acceptance
from mtplx.forge.loss import Objective, frequent_ids
from mtplx.forge.stages import (
    ForgeReport,
    PromptSets,
    Recorded,
    data_record,
    plan_training,
    recipe_record,
    record_shards,
    start_run,
    training_record,
    trunk_name,
    write_sidecar,
)
from mtplx.forge.train import TrainResult, build_head, init_from_head, seconds_per_step, train_head
from mtplx.heads.forged import ForgedMTPHead, lm_head_matrix
from mtplx.trunk.model import Trunk

import numpy as np


@dataclass
class _Trained:
    """Stage 2: the trained head, how its training went, and the head it started from."""

    head: ForgedMTPHead
    result: TrainResult
    init_sha: str | None


@dataclass
class _Scored:
    """Stage 3: acceptance per draft vocabulary, draft-step times, and the vocabulary shipped."""

    tables: dict[str, Any]
    step_ms: dict[str, float]
    shipped: str

    @property
    def acceptance(self) -> dict[str, dict[str, float]]:
        return self.tables[self.shipped]


def _train(
    cfg: ForgeConfig,
    trunk: Trunk,
    fingerprint: str,
    recorded: Recorded,
    budget: Budget | None,
    t_start: float,
) -> _Trained:
    """Build (or start from ``init_head``) the head and train it for the steps this run plans."""
    data, vocab = recorded.train, trunk.vocab_size
    train_ids = (
        frequent_ids(data, cfg.train_vocab, vocab) if cfg.train_vocab and cfg.train_vocab < vocab else None
    )
    head = build_head(trunk, cfg.hidden_source, cfg.chain_source, cfg.head_layers)
    init_sha = init_from_head(head, cfg.init_head, trunk, fingerprint) if cfg.init_head else None
    ckpt_dir, steps = plan_training(
        cfg,
        recorded,
        budget,
        t_start,
        init_sha,
        lambda: seconds_per_step(cfg, trunk, head, data, Objective.build(trunk, train_ids)),
    )
    result = train_head(cfg, trunk, head, data, train_ids, ckpt_dir, steps=steps)
    return _Trained(head, result, init_sha)


def _score(cfg: ForgeConfig, trunk: Trunk, head: ForgedMTPHead, recorded: Recorded) -> _Scored:
    """Acceptance on the held-out shards per draft vocabulary; the chosen one is set on ``head``."""
    vocab = trunk.vocab_size
    fixed = cfg.draft_vocab if isinstance(cfg.draft_vocab, int) else None
    sizes = sorted({k for k in (*cfg.eval_vocab_sizes, fixed) if k is not None and k < vocab})
    variants: dict[str, np.ndarray | None] = {"full": None}
    variants.update({f"top{k}": frequent_ids(recorded.train, k, vocab) for k in sizes})
    tables = evaluate_acceptance(
        trunk,
        head,
        recorded.eval.tokens,
        depths=cfg.depth,
        origins=cfg.eval_origins,
        progress=cfg.progress,
        vocab_variants=variants,
        valid=recorded.eval.valid,
    )
    full_proj = lm_head_matrix(trunk)
    step_ms = draft_step_ms(head, variants, full_proj) if len(variants) > 1 else {}
    if cfg.draft_vocab == "auto":
        shipped = choose_draft_vocab(tables, step_ms)
    else:
        shipped = "full" if fixed is None or fixed >= vocab else f"top{fixed}"
    if shipped != "full":
        head.set_draft_vocab(variants[shipped].tolist(), full_proj)
    return _Scored(tables, step_ms, shipped)


def _manifest(
    cfg: ForgeConfig,
    fingerprint: str,
    prompts: PromptSets,
    recorded: Recorded,
    trained: _Trained,
    scored: _Scored,
    t_start: float,
) -> dict[str, Any]:
    """What the sidecar records: the trunk it drafts for, the recipe, the data, training, acceptance."""
    result = trained.result
    return {
        "trunk_fingerprint": fingerprint,
        "trunk": trunk_name(cfg),
        "depth_trained": cfg.depth,
        "objective": f"KL(p_trunk || q_head) over teacher top-{cfg.top_n} + rest mass, response tokens only, "
        f"draft chain unrolled {cfg.depth} steps with weights {list(cfg.step_weights[: cfg.depth])}",
        "recipe": recipe_record(cfg),
        "init_head_weights_sha256": trained.init_sha,
        "data": data_record(prompts, recorded),
        "steps": result.steps,
        "seed": cfg.seed,
        "training": {
            **training_record(result, "kl_curve"),
            "final_kl_depth1": result.losses[-1][1] if result.losses else None,
        },
        "acceptance": scored.acceptance,
        "draft_vocab": scored.shipped,
        "acceptance_by_draft_vocab": scored.tables,
        "draft_step_ms": scored.step_ms,
        "draft_vocab_rule": "auto: smallest reduced vocabulary losing <= 0.01 depth-1 acceptance and drafting >= 20% faster"
        if cfg.draft_vocab == "auto"
        else f"fixed: {cfg.draft_vocab}",
        "acceptance_note": "teacher-forced, 1 - TV(p_trunk, q_head) per draft depth at response positions of "
        "held-out generations; temperature 0 = greedy argmax agreement",
        "seconds_total_this_run": round(time.time() - t_start, 1),
    }


def forge(config: ForgeConfig = DEFAULT_FORGE_CONFIG, **overrides: Any) -> ForgeReport:
    """Forge an MTP head for ``config.model`` (None = the default model) into ``config.out_dir``.

    ``overrides`` replace fields of ``config`` (``forge(model="x", budget="45m")``). Resumable:
    rerunning with the same settings reuses the shards and the newest checkpoint under ``work_dir``.
    """
    run = start_run(config, overrides)
    cfg, trunk, fingerprint = run.cfg, run.engine.trunk, run.loaded.fingerprint
    recorded = record_shards(cfg, run.engine, run.loaded, run.prompts, run.budget, run.t_start)
    trained = _train(cfg, trunk, fingerprint, recorded, run.budget, run.t_start)
    scored = _score(cfg, trunk, trained.head, recorded)
    manifest = _manifest(cfg, fingerprint, run.prompts, recorded, trained, scored, run.t_start)
    path = write_sidecar(run.out, trained.head, manifest, cfg.overwrite) / "manifest.json"
    return ForgeReport(
        path,
        scored.acceptance,
        recorded.train.num_response_tokens,
        trained.result.steps,
        time.time() - run.t_start,
    )
