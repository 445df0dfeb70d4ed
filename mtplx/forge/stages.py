"""A forge run's stages that a head's run (`mtplx.forge.run.forge`) and a drafter's
(`mtplx.forge.drafter.forge_drafter`) share, one copy: the run's start (settings, output directory,
budget, prompts, model, engine), the recorded shards, the training plan (checkpoint directory,
steps), the data record, the recipe, and the sidecar written whole.

Each stage is resumable and deterministic given the seed: shards and checkpoints live under a work
directory keyed by what they depend on, and a run's step count is fixed once (``steps.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.errors import MtplxError
from mtplx.forge.config import (
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
from mtplx.forge.record import ForgeData, ShardPlan, generate_shards, kind_counts, load_shards
from mtplx.forge.train import TrainResult
from mtplx.heads.forged import save_forged_head
from mtplx.io import atomic_write
from mtplx.sample.params import Setting


def _write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, written whole (a killed run leaves the old file or none)."""
    with atomic_write(path) as handle:
        handle.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def shard_settings(cfg: ForgeConfig) -> tuple[Setting, ...]:
    return tuple(Setting(float(t), float(p)) for t, p in cfg.settings)


@dataclass
class ForgeReport:
    """What `forge` returns: where the head went, its acceptance, and how much went into it."""

    manifest_path: Path
    acceptance: dict[str, dict[str, float]]
    response_tokens: int
    train_steps: int
    seconds: float


@dataclass
class PromptSets:
    """Stage 0: the prompts the trunk answers, split by source hash into training and held-out."""

    train: list[Prompt]
    eval: list[Prompt]
    description: str
    held_out_record: dict


@dataclass
class Recorded:
    """Stage 1: the generated shards, read back, and how they came to be."""

    run_dir: Path
    summaries: dict[str, dict]
    train: ForgeData
    train_metas: list[dict]
    eval: ForgeData
    eval_metas: list[dict]


@dataclass
class RunStart:
    """What a forge run (a head's, `forge`, or a drafter's, `mtplx.forge.drafter.forge_drafter`)
    has after its first stages (`start_run`)."""

    cfg: ForgeConfig
    t_start: float
    out: Path
    budget: Budget | None
    prompts: PromptSets
    loaded: Any  # `mtplx.checkpoints.load.load_model`'s: model, tokenizer, config, fingerprint
    engine: Engine


def start_run(config: ForgeConfig, overrides: dict[str, Any]) -> RunStart:
    """A forge run's first stages: ``overrides`` applied, the output directory and the budget
    checked, the prompts read (before loading the model: bad data fails fast), the model loaded
    and an engine without a head over it (generation goes through the one scheduler; forge
    drafts nothing)."""
    from mtplx.checkpoints.load import load_model

    cfg = replace(config, **overrides) if overrides else config
    t_start = time.time()
    out = Path(cfg.out_dir)
    if out.exists() and not cfg.overwrite:
        raise MtplxError(f"{out}: output directory exists; pass --overwrite to replace it")
    budget = parse_budget(cfg.budget) if cfg.budget is not None else None
    _check_budget(cfg, budget)
    prompts = prompt_sets(cfg)
    loaded = load_model(cfg.model)
    engine = Engine(loaded.model, loaded.tokenizer, loaded.config, fingerprint=loaded.fingerprint)
    return RunStart(cfg, t_start, out, budget, prompts, loaded, engine)


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


def prompt_sets(cfg: ForgeConfig) -> PromptSets:
    """The prompt set (``load_prompts``), split into training and held-out generations."""
    prompts, description, held_record = load_prompts(cfg)
    train, evaluation = split_prompts(prompts, cfg.eval_fraction)
    if not evaluation or not train:  # tiny user data: held-out generations from the same prompts
        train = evaluation = list(prompts)
    return PromptSets(train, evaluation, description, held_record)


def _work_root(cfg: ForgeConfig) -> Path:
    if cfg.work_dir is not None:
        return Path(cfg.work_dir)
    from mtplx.resources import cache_root

    return cache_root() / "forge"


def record_shards(
    cfg: ForgeConfig,
    engine: Any,
    loaded: Any,
    prompts: PromptSets,
    budget: Budget | None,
    t_start: float,
    taps: tuple[int, ...] = (),
) -> Recorded:
    """Generate (or find) this run's shards and read them back (``taps``: the decoder layers whose
    outputs are recorded joined instead of the last hidden state, for a drafter)."""
    settings = shard_settings(cfg)
    plans = {
        name: ShardPlan(
            tuple(ps), settings, cfg.gen_batch, cfg.seq_len, cfg.top_n, seed, loaded.fingerprint, taps
        )
        for name, ps, seed in (("train", prompts.train, cfg.seed), ("eval", prompts.eval, cfg.seed + 1))
    }
    run_dir = _work_root(cfg) / f"{loaded.fingerprint}-{plans['train'].key()}"
    summaries = _generate(cfg, engine, plans, run_dir, budget, t_start)
    data, metas = load_shards(run_dir / "train")
    eval_data, eval_metas = load_shards(run_dir / "eval")
    if data.num_response_tokens == 0 or eval_data.num_response_tokens == 0:
        raise MtplxError(
            f"--budget: {cfg.budget} is too small to train anything (no response tokens generated)"
        )
    return Recorded(run_dir, summaries, data, metas, eval_data, eval_metas)


def _generate(
    cfg: ForgeConfig,
    engine: Any,
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
            engine,
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
        engine,
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


def _checkpoint_dir(cfg: ForgeConfig, run_dir: Path, rows: int, init_sha: str | None) -> Path:
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
        + ([cfg.drafter, cfg.draft_vocab] if cfg.drafter else [])
    )
    return run_dir / f"ckpt-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def planned_steps(
    cfg: ForgeConfig,
    budget: Budget | None,
    ckpt_dir: Path,
    train_until: float | None,
    measure: Callable[[], float],
    rows: int,
    now: Callable[[], float] = time.time,
) -> int:
    """Training steps of this run, fixed once (``steps.json``) so a resumed run keeps its schedule.

    ``train_until`` is a ``now()`` reading (wall-clock seconds; tests pass a fixed clock)."""
    plan = ckpt_dir / "steps.json"
    if plan.is_file():
        return int(json.loads(plan.read_text())["steps"])
    if budget is not None and budget.seconds is not None:
        per_step = measure()
        steps = int(max(train_until - now(), 0.0) / (1.15 * per_step))  # 15%: checkpoints, load
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


def plan_training(
    cfg: ForgeConfig,
    recorded: Recorded,
    budget: Budget | None,
    t_start: float,
    init_sha: str | None,
    seconds_per_step: Callable[[], float],
) -> tuple[Path, int]:
    """(checkpoint directory, training steps) of this run: the directory keyed by everything the
    weights depend on (``init_sha``: the head it starts from), the steps fixed once (`planned_steps`,
    training ending at its share of a time budget; ``seconds_per_step`` asked only then)."""
    rows = recorded.train.num_sequences
    ckpt_dir = _checkpoint_dir(cfg, recorded.run_dir, rows, init_sha)
    train_until = t_start + (GEN_SHARE + TRAIN_SHARE) * budget.seconds if budget and budget.seconds else None
    return ckpt_dir, planned_steps(cfg, budget, ckpt_dir, train_until, seconds_per_step, rows)


def data_record(prompts: PromptSets, recorded: Recorded) -> dict[str, Any]:
    """The manifest's account of the training data (regenerable from the recipe and seed)."""
    train, evaluation = recorded.train, recorded.eval
    return {
        "kind": "the trunk's own generations (regenerable from the recipe and seed)",
        "prompts": prompts.description,
        "train_prompts": len(prompts.train),
        # Files the training prompts came from (benchmarks/prompts/build_suite.py --check reads them).
        "train_files": sorted({re.split(r"[:#]", p.source)[0] for p in prompts.train}),
        "eval_prompts": len(prompts.eval),
        "held_out_check": prompts.held_out_record,
        "train": {
            **recorded.summaries["train"],
            "sequences": train.num_sequences,
            "response_tokens": train.num_response_tokens,
            "sequences_by_setting_and_kind": kind_counts(recorded.train_metas),
        },
        "eval": {
            "sequences": evaluation.num_sequences,
            "response_tokens": evaluation.num_response_tokens,
            "sequences_by_setting_and_kind": kind_counts(recorded.eval_metas),
        },
    }


def training_record(result: TrainResult, curve: str) -> dict[str, Any]:
    """A forged file's ``training`` entry: this run's seconds, the last cross-entropy per draft step
    and the logged curve (about 40 points) under the key ``curve``."""
    return {
        "seconds_this_run": round(result.seconds, 1),
        "final_cross_entropy_per_step": result.step_losses,
        curve: result.losses[:: max(1, len(result.losses) // 40)],
    }


def recipe_record(cfg: ForgeConfig) -> dict[str, Any]:
    """The settings a forged file records as its recipe (paths and display flags left out)."""
    skipped = ("out_dir", "work_dir", "progress", "overwrite")
    return {**{k: v for k, v in asdict(cfg).items() if k not in skipped}, "lr": cfg.peak_lr}


def trunk_name(cfg: ForgeConfig) -> str:
    """The trunk a forged file drafts for, as its record names it."""
    return str(cfg.model) if cfg.model is not None else "default (SmolLM2-135M-Instruct, float32)"


def write_sidecar(
    out: Path,
    head: Any,
    manifest: dict,
    overwrite: bool,
    save: Callable[[Path, Any, dict], Any] = save_forged_head,
) -> Path:
    """Write into a temp directory beside ``out`` (``save``: a forged head's files, or a drafter's),
    then rename: a half-written head never exists. Returns ``out``."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save(tmp, head, manifest)
    if out.exists():
        if not overwrite:
            raise MtplxError(f"{out}: output directory exists; pass --overwrite to replace it")
        old = out.with_name(f".{out.name}.old{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    return out
