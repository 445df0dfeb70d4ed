"""`mtplx forge --drafter eagle3`: train an EAGLE-3 drafter for a trunk, written in the speculators
layout the normal drafter loader reads (`mtplx.drafters.eagle3`).

Why EAGLE-3 (not DFlash): its draft chain is the forged head's (a decoder layer fed the token and
a hidden state, then its own output), so forge's unrolled-chain training (`mtplx.forge.loss`:
`UnrollCache`, step weights, the teacher's top-K) trains it as decode runs it, and its ``d2t``
draft vocabulary is forge's reduced vocabulary (`frequent_ids`). A DFlash drafter predicts a block
in one non-causal forward from mask tokens: another objective (random anchors, block masks) and
several layers, more than a CPU budget trains.

The stages are forge's (`mtplx.forge.stages`, shared with a head's run), with two changes:

1. the trunk's generations are recorded with its three tapped layers' outputs joined instead of
   its last hidden state (`record.generate_batch(taps=...)`; their own shard directory);
2. the drafter (`build_eagle3`) starts near the trunk: its decoder layer is a copy of the trunk's
   last layer reading [embedding, hidden] (q / k / v halves of the trunk's), ``fc`` passes the
   highest tap through, ``norm`` is the trunk's final norm and ``lm_head`` the trunk's output rows of
   the draft vocabulary; it trains with `train.train_head`'s loop (schedule, AdamW, checkpoints,
   progress bar) through `Eagle3TrainStep`, whose loss is the unrolled chain's cross-entropy over
   the draft vocabulary (`drafter_step_losses`);
3. teacher-forced acceptance per depth on held-out generations (`evaluate_drafter`: 1 - TV of the
   trunk's p and the drafter's q on the target vocabulary, `evaluate.Tally`);
4. ``config.json`` (speculators format), ``model.safetensors`` (``d2t`` int64, ``t2d`` bool, no
   embedding: the target's is bound, as mlx-vlm does) and ``forge.json`` (recipe, data, training,
   acceptance), written to a temp directory and renamed (`stages.write_sidecar`).

Alignment (the proposer's, `mtplx.spec_decode.eagle3_proposer`): pair p is (token p + 1, the taps
of p) at rope position p + 1 and predicts token p + 2, the trunk's distribution recorded at p + 1;
step k from origin p reads (token p + k + 1, its own output of step k - 1) at position p + k + 1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.drafters.eagle3 import Eagle3Drafter, eagle3_logits
from mtplx.drafters.layouts import eagle3_spec
from mtplx.errors import MtplxError
from mtplx.forge import stages
from mtplx.forge.config import FORGED_DRAFTERS, Budget, ForgeConfig
from mtplx.forge.evaluate import EVAL_TEMPERATURES, Tally
from mtplx.forge.loss import Batch, UnrollCache, frequent_ids
from mtplx.forge.record import ForgeData
from mtplx.forge.stages import ForgeReport, Recorded
from mtplx.forge.train import TrainResult, TrainStep, train_head
from mtplx.heads.base import model_args_of
from mtplx.heads.forged import lm_head_matrix
from mtplx.io import atomic_write
from mtplx.trunk.compat_nemotron import final_norm_of
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

EAGLE3 = FORGED_DRAFTERS[0]
RECORD = "forge.json"  # what the run records beside the drafter (not manifest.json: a forged head's)


def aux_layer_ids(num_layers: int) -> list[int]:
    """``eagle_aux_hidden_state_layer_ids`` (Hugging Face ``hidden_states`` indices, entry i = layer
    i - 1's output): low, middle and high, [2, n // 2, n - 1], so the highest tap is the layer before
    the last, which the drafter's copy of the last layer reads."""
    return [min(2, num_layers - 1), num_layers // 2, num_layers - 1]


def eagle3_config(
    trunk: Trunk, draft_vocab_size: int, depth: int, verifier: dict[str, Any]
) -> dict[str, Any]:
    """The drafter's ``config.json`` in the speculators format, sized from the trunk's ``ModelArgs``;
    ``verifier``: the speculators ``verifier`` entry (``name_or_path``, ``architectures``)."""
    args = model_args_of(trunk.model)
    hidden, heads = int(args.hidden_size), int(args.num_attention_heads)
    if getattr(args, "rope_scaling", None):
        raise MtplxError(
            "forge --drafter eagle3: the trunk's rope_scaling is not supported (default rope only)"
        )
    layer = {
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(args.intermediate_size),
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(args, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(args, "head_dim", None) or hidden // heads),
        "rms_norm_eps": float(args.rms_norm_eps),
        "vocab_size": trunk.vocab_size,
        "rope_theta": float(getattr(args, "rope_theta", None) or 10000.0),
        "rope_traditional": bool(getattr(args, "rope_traditional", False)),
        "max_position_embeddings": int(getattr(args, "max_position_embeddings", None) or 4096),
        "attention_bias": bool(getattr(args, "attention_bias", False)),
        "tie_word_embeddings": False,
    }
    method = {"proposal_type": "greedy", "speculative_tokens": depth}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": EAGLE3,
        "speculators_version": "0.1.0",
        "speculators_config": {
            "algorithm": EAGLE3,
            "proposal_methods": [method],
            "verifier": verifier,
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids(len(trunk.layers)),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        # mlx-vlm's key (the anchor and the drafts; read before its speculative_tokens + 2): at
        # most ``depth`` drafts a cycle, the depth trained.
        "block_size": depth + 1,
    }


def build_eagle3(trunk: Trunk, draft_ids: np.ndarray, config: dict[str, Any]) -> Eagle3Drafter:
    """An EAGLE-3 drafter for ``trunk`` started near it (the module docstring, stage 2): a draft
    vocabulary of the sorted target ids ``draft_ids`` (all of them: no ``d2t``)."""
    spec = eagle3_spec(config)
    drafter = Eagle3Drafter(spec, own_embedding=False)
    template = dict(tree_flatten(trunk.layers[-1].parameters()))
    first = drafter.layers[0]
    loaded = []
    for name, value in tree_flatten(first.parameters()):
        source = template.get(name.replace("hidden_norm", "input_layernorm"))
        if source is None:
            continue
        if name.startswith("self_attn.") and name.split(".")[1] in ("q_proj", "k_proj", "v_proj"):
            if name.endswith("weight"):  # [out, 2H]: half of the trunk's projection on each input
                source = mx.concatenate([0.5 * source, 0.5 * source], axis=1)
        if tuple(source.shape) == tuple(value.shape):
            loaded.append((name, mx.array(source, dtype=mx.float32)))
    first.load_weights(loaded, strict=False)
    hidden = spec.hidden_size
    taps = len(config["eagle_aux_hidden_state_layer_ids"])
    drafter.fc.weight = mx.concatenate(
        [mx.zeros((hidden, (taps - 1) * spec.target_hidden_size)), mx.eye(hidden)], axis=1
    )
    drafter.norm.weight = mx.array(final_norm_of(trunk.inner).weight, dtype=mx.float32)
    drafter.lm_head.weight = lm_head_matrix(trunk).T[mx.array(draft_ids)]
    if spec.uses_draft_vocab:
        drafter.d2t = mx.array(draft_ids - np.arange(len(draft_ids)), dtype=mx.int32)
    mx.eval(drafter.parameters())
    return drafter


def draft_index(draft_ids: np.ndarray, vocab: int) -> np.ndarray:
    """[V] int32: each target id's draft id, -1 where the draft vocabulary lacks it."""
    index = np.full(vocab, -1, dtype=np.int32)
    index[draft_ids] = np.arange(len(draft_ids), dtype=np.int32)
    return index


def unrolled_hidden(
    drafter: Eagle3Drafter, tokens: mx.array, hidden: mx.array, caches: list[UnrollCache], step: int, embed
) -> mx.array:
    """The drafter's output [B, N, H] at draft step ``step`` for every origin at once: ``hidden`` the
    taps joined (step 0) or its own output of the step before; rope position of origin i is
    i + step + 1; each origin attends to the pairs up to it and its own chain (`UnrollCache`)."""
    if hidden.shape[-1] != drafter.spec.hidden_size:
        hidden = drafter.fc(drafter.input_norm(hidden) if "input_norm" in drafter else hidden)
    embeds = embed(tokens)
    h = hidden
    for layer, cache in zip(drafter.layers, caches):
        h = layer(h, embeds, cache, step + 1, cache.make_mask(int(tokens.shape[1])))
    return h


def draft_vocab_ce(
    logits: mx.array, top_draft: mx.array, in_vocab: mx.array, p_top: mx.array, p_rest: mx.array
) -> mx.array:
    """Cross-entropy [B, N] of draft-vocabulary logits [B, N, Vd] against the teacher's buckets:
    each of its top-K ids the draft vocabulary holds (``top_draft``: their draft ids), and the rest
    (the teacher's mass outside its top K, q's mass on the draft ids outside it). The teacher's
    mass on top-K ids outside the draft vocabulary cannot be drafted and is left out."""
    logq = mx.take_along_axis(logits, mx.maximum(top_draft, 0), axis=-1) - mx.logsumexp(logits, -1)[..., None]
    logq = mx.where(in_vocab, logq, 0.0)
    q_rest = 1.0 - mx.where(in_vocab, mx.exp(logq), 0.0).sum(-1)
    return -(mx.where(in_vocab, p_top, 0.0) * logq).sum(-1) - p_rest * mx.log(mx.maximum(q_rest, 1e-6))


def drafter_step_losses(
    drafter: Eagle3Drafter, embed, index: mx.array, batch: Batch, depth: int
) -> list[mx.array]:
    """Masked mean cross-entropy of each draft step 0..depth-1, the chain unrolled as decode runs
    it (``batch.hidden``: the taps joined; ``index``: `draft_index`)."""
    caches = [UnrollCache() for _ in drafter.layers]
    x = batch.hidden
    losses = []
    for k in range(depth):
        tokens, ids, _, p_top, p_rest, valid = batch.targets(k)
        x = unrolled_hidden(drafter, tokens, x, caches, k, embed)
        top_draft = index[ids]
        ce = draft_vocab_ce(eagle3_logits(drafter, x, None), top_draft, top_draft >= 0, p_top, p_rest)
        losses.append((ce * valid).sum() / mx.maximum(valid.sum(), 1.0))
    return losses


def drafter_embedding(drafter: Eagle3Drafter, trunk: Trunk):
    from mtplx.spec_decode.eagle3_proposer import token_embedding

    return token_embedding(drafter, trunk)


class Eagle3TrainStep(TrainStep):
    """`TrainStep` for an EAGLE-3 drafter: ``train_ids`` is its draft vocabulary (sorted target ids);
    ``d2t`` stays frozen."""

    def prepare(self, train_ids: np.ndarray | None) -> np.ndarray:
        vocab = self.trunk.vocab_size
        ids = np.arange(vocab) if train_ids is None else np.asarray(train_ids)
        self.embed = drafter_embedding(self.head, self.trunk)
        self.index = mx.array(draft_index(ids, vocab))
        self.head.unfreeze()
        if "d2t" in self.head:
            self.head.freeze(keys=["d2t"], recurse=False)
        in_vocab = np.zeros(vocab, dtype=bool)
        in_vocab[ids] = True
        return in_vocab

    def step_losses(self, batch: Batch) -> list[mx.array]:
        return drafter_step_losses(self.head, self.embed, self.index, batch, self.cfg.depth)


def evaluate_drafter(
    trunk: Trunk, drafter: Eagle3Drafter, data: ForgeData, depth: int, progress: bool = False
) -> dict[str, dict[str, float]]:
    """Teacher-forced acceptance per depth on ``data``'s sequences (recorded taps, true tokens):
    {"1": {"0.0": a, "0.7": b}, ...}, 1 - TV(p, q) of the trunk's full p at each response position
    and the drafter's q on the target vocabulary (zero off the draft vocabulary)."""
    from tqdm import tqdm

    tally = Tally({"": None}, depth, EVAL_TEMPERATURES, trunk.vocab_size)
    embed = drafter_embedding(drafter, trunk)
    for r in tqdm(range(data.num_sequences), desc="eval", disable=not progress):
        end = int(np.flatnonzero(data.valid[r]).max()) + 2 if data.valid[r].any() else 0
        if end < depth + 2:
            continue
        tokens = mx.array(data.tokens[r : r + 1, :end])
        p_logits = np.asarray(trunk(tokens).logits.astype(mx.float32))
        n = end - 1
        caches = [UnrollCache() for _ in drafter.layers]
        x = mx.array(data.hidden[r : r + 1, :n].astype(np.float32))
        padded = mx.pad(tokens, ((0, 0), (0, depth)))
        keep = np.pad(data.valid[r : r + 1, :end], ((0, 0), (0, depth)))
        for k in range(depth):
            x = unrolled_hidden(drafter, padded[:, k + 1 : k + 1 + n], x, caches, k, embed)
            q = drafter.target_logits(eagle3_logits(drafter, x, None)).astype(mx.float32)
            last = min(n, end - k - 1)  # the trunk's p exists up to position end - 1
            tally.add(
                k + 1,
                p_logits[:, k + 1 : k + 1 + last],
                np.asarray(q)[:, :last],
                keep[:, k + 1 : k + 1 + last],
            )
    return tally.table()[""]


def save_eagle3(path: Path, drafter: Eagle3Drafter, record: dict[str, Any]) -> None:
    """``config.json`` (``record["config"]``), ``model.safetensors`` and `RECORD` into ``path``."""
    import json

    path.mkdir(parents=True, exist_ok=True)
    config = record["config"]
    weights = {k: v for k, v in tree_flatten(drafter.parameters()) if k != "d2t"}
    if "d2t" in drafter:
        d2t = np.asarray(drafter.d2t).astype(np.int64)
        targets = np.arange(len(d2t)) + d2t
        t2d = np.zeros(config["transformer_layer_config"]["vocab_size"], dtype=bool)
        t2d[targets] = True
        weights |= {"d2t": mx.array(d2t), "t2d": mx.array(t2d)}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with atomic_write(path / RECORD) as handle:
        handle.write(json.dumps({k: v for k, v in record.items() if k != "config"}, indent=2) + "\n")


def draft_vocab_size(cfg: ForgeConfig, vocab: int) -> int:
    """``--draft-vocab``: a size, "auto" (the training vocabulary's size) or None (the full vocabulary)."""
    size = (
        cfg.draft_vocab
        if isinstance(cfg.draft_vocab, int)
        else (cfg.train_vocab if cfg.draft_vocab else None)
    )
    return vocab if size is None else min(int(size), vocab)


def _train_drafter(
    cfg: ForgeConfig,
    trunk: Trunk,
    recorded: Recorded,
    budget: Budget | None,
    t_start: float,
    verifier: dict[str, Any],
) -> tuple[Eagle3Drafter, dict[str, Any], TrainResult]:
    """Build the drafter (its draft vocabulary: the trunk's most frequent predictions in the training
    data) and train it for the steps this run plans (`stages.plan_training`), resumable."""
    data, vocab = recorded.train, trunk.vocab_size
    size = draft_vocab_size(cfg, vocab)
    ids = frequent_ids(data, size, vocab) if size < vocab else np.arange(vocab, dtype=np.int32)
    config = eagle3_config(trunk, len(ids), cfg.depth, verifier)
    drafter = build_eagle3(trunk, ids, config)
    ckpt_dir, steps = stages.plan_training(
        cfg,
        recorded,
        budget,
        t_start,
        None,
        lambda: Eagle3TrainStep(cfg, trunk, drafter, data, ids, 1).seconds(),
    )
    result = train_head(cfg, trunk, drafter, data, ids, ckpt_dir, steps=steps, make_step=Eagle3TrainStep)
    return drafter, config, result


def forge_drafter(config: ForgeConfig, **overrides: Any) -> ForgeReport:
    """Forge ``config.drafter`` (EAGLE-3) for ``config.model`` (None = the default model) into
    ``config.out_dir``; a head's run's stages (`mtplx.forge.stages`), resumable the same way. Returns
    a `stages.ForgeReport` whose ``manifest_path`` is the drafter's `RECORD`."""
    drafter = overrides.get("drafter", config.drafter)
    if drafter != EAGLE3:
        raise MtplxError(f"forge: drafter must be one of {', '.join(FORGED_DRAFTERS)}, got {drafter!r}")
    run = stages.start_run(config, overrides)
    cfg, trunk, loaded = run.cfg, run.engine.trunk, run.loaded
    taps = tuple(max(i - 1, 0) for i in aux_layer_ids(len(trunk.layers)))  # `Eagle3Spec.tapped_layers`
    recorded = stages.record_shards(cfg, run.engine, loaded, run.prompts, run.budget, run.t_start, taps)
    name = stages.trunk_name(cfg)
    verifier = {"name_or_path": name, "architectures": list(loaded.config.get("architectures") or [])}
    drafter, drafter_config, result = _train_drafter(cfg, trunk, recorded, run.budget, run.t_start, verifier)
    acceptance = evaluate_drafter(trunk, drafter, recorded.eval, cfg.depth, cfg.progress)
    record = {
        "config": drafter_config,
        "trunk_fingerprint": loaded.fingerprint,
        "trunk": name,
        "drafter": EAGLE3,
        "depth_trained": cfg.depth,
        "objective": f"cross-entropy against the trunk's top-{cfg.top_n} + rest mass over the draft vocabulary, "
        f"response tokens only, draft chain unrolled {cfg.depth} steps with weights {list(cfg.step_weights[: cfg.depth])}",
        "recipe": stages.recipe_record(cfg),
        "data": stages.data_record(run.prompts, recorded),
        "steps": result.steps,
        "training": stages.training_record(result, "loss_curve"),
        "acceptance": acceptance,
        "acceptance_note": "teacher-forced, 1 - TV(p_trunk, q_drafter) per draft depth at response positions of "
        "held-out generations; temperature 0 = greedy argmax agreement",
        "seconds_total_this_run": round(time.time() - run.t_start, 1),
    }
    stages.write_sidecar(run.out, drafter, record, cfg.overwrite, save=save_eagle3)
    return ForgeReport(
        run.out / RECORD,
        acceptance,
        recorded.train.num_response_tokens,
        result.steps,
        time.time() - run.t_start,
    )
