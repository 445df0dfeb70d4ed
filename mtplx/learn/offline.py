"""`mtplx forge --from-traffic DIR`: one learning round over a `serve --learn` log, run to the end.

It starts from the head in use (``--init-head``, else the head ``serve --learn DIR`` last accepted,
else the model's own forged head), trains a copy on the older records, measures both on the most
recent ones (first-draft and per-position acceptance, `mtplx.learn.trainer`) and writes the new
head (temp directory, then rename) only when it measures better, saying by how much.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtplx.errors import MtplxError
from mtplx.learn.config import DEFAULT_LEARN_CONFIG, LearnConfig
from mtplx.learn.log import TRAFFIC, TrafficLog, tokenizer_fingerprint
from mtplx.learn.trainer import RoundResult, first_draft, learning_round, run_to_end

OUT_NAME = "forged-from-traffic"


@dataclass
class TrafficReport:
    """What `forge_from_traffic` did: the round's measurements and where the head went (None: kept out)."""

    result: RoundResult
    out: Path | None
    start: str  # the head it started from, in words

    def summary(self) -> str:
        r = self.result
        before, after = first_draft(r.before), first_draft(r.after)
        depths = ", ".join(
            f"d{d} {sum(r.before[d].values()) / len(r.before[d]):.3f}->{sum(r.after[d].values()) / len(r.after[d]):.3f}"
            for d in sorted(r.after, key=int)
        )
        head = f"first-draft acceptance {before:.3f} -> {after:.3f} ({after - before:+.3f}) on {r.held_records} held-out requests"
        sampled = f" ({r.sampled_sequences} of them sampled answers)" if r.sampled_sequences else ""
        trained = f"trained {r.steps} steps on {r.train_sequences} sequences{sampled} of {r.train_records} requests from {self.start}, {r.train_positions} response positions"
        if self.out is None:
            return f"forge --from-traffic: kept out: {head}; no better, nothing written ({trained}; per depth {depths})"
        return f"forge --from-traffic: wrote {self.out}: {head} ({trained}; per depth {depths})"


def _start_head(engine: Any, root: Path, init_head: str | None) -> tuple[Any, str]:
    from mtplx.heads.forged import ForgedMTPHead, load_forged_head
    from mtplx.learn.store import HEADS, HeadStore

    if init_head is not None:
        return load_forged_head(init_head, engine.trunk, engine.fingerprint), init_head
    if (root / HEADS).is_dir():
        loaded = HeadStore(root).load_current(engine.trunk, engine.fingerprint)
        if loaded is not None:
            return loaded[0], f"the learned head v{loaded[1]['version']}"
    if not isinstance(engine.head, ForgedMTPHead):
        kind = "no head" if engine.head is None else f"a {type(engine.head).__name__}"
        raise MtplxError(
            f"--from-traffic: the model has {kind}; only forged heads learn yet (pass --init-head)"
        )
    return engine.head, "the model's head"


def _sample_answers(engine: Any, records: list, cfg: LearnConfig, progress: bool) -> dict:
    """``cfg.samples`` sampled answers to each training-side record (`AnswerSampler`), by record."""
    from mtplx.learn.data import split_held_out
    from mtplx.learn.sampling import AnswerSampler

    from tqdm import tqdm

    sampler = AnswerSampler(engine, cfg)
    train = split_held_out(records, cfg.held_out_fraction)[0]
    wanted = len(sampler.wanted(train)) * cfg.samples
    with tqdm(total=wanted, unit="answer", desc="sampling", disable=not progress, file=sys.stderr) as bar:
        while sampler.work(train, cfg.piece_seconds):
            bar.update(sampler.sampled - bar.n)
    return sampler.rows


def forge_from_traffic(
    traffic_dir: str,
    model: str | None = None,
    init_head: str | None = None,
    out_dir: str | None = None,
    cfg: LearnConfig = DEFAULT_LEARN_CONFIG,
    overwrite: bool = False,
    progress: bool = True,
) -> TrafficReport:
    """One learning round over ``traffic_dir``'s log (module docstring); MtplxError for user mistakes.
    With ``cfg.samples``, the model first samples that many answers to each training-side request
    (`mtplx.learn.sampling`; a bar on stderr with ``progress``), trained on too."""
    root = Path(traffic_dir)
    if not (root / TRAFFIC).is_dir():
        raise MtplxError(
            f"--from-traffic: {root}: no traffic log here (`mtplx serve --learn {root}` writes one)"
        )
    out = Path(out_dir) if out_dir is not None else root / OUT_NAME
    if out.exists() and not overwrite:
        raise MtplxError(f"{out}: output directory exists; pass --overwrite to replace it")
    from mtplx.engine.engine import Engine

    engine = Engine.load(model)
    log = TrafficLog(root)
    records = log.read(engine.fingerprint, tokenizer_fingerprint(engine.tokenizer), newest=cfg.max_records)
    if len(records) < 2:
        foreign = log.foreign_trunks() - {engine.fingerprint}
        whose = f"; its records are for trunk {', '.join(sorted(foreign))}" if foreign else ""
        raise MtplxError(
            f"--from-traffic: {root}: {len(records)} usable record(s) of this model "
            f"(trunk {engine.fingerprint}), at least 2 needed{whose}"
        )
    head, start = _start_head(engine, root, init_head)
    full_proj = None
    if head.vocab_ids is not None:
        from mtplx.heads.forged import lm_head_matrix

        full_proj = lm_head_matrix(engine.trunk)
    print(f"forge --from-traffic: {len(records)} requests, training from {start}", file=sys.stderr)
    sampled = _sample_answers(engine, records, cfg, progress) if cfg.samples > 0 else None
    result = run_to_end(learning_round(engine.trunk, head, records, cfg, full_proj, sampled=sampled))
    if not result.better(cfg.min_gain):
        return TrafficReport(result, None, start)
    from mtplx.forge.stages import write_sidecar

    manifest = {
        "trunk_fingerprint": engine.fingerprint,
        "depth_trained": getattr(head, "max_depth", None) or cfg.depth,
        "default_depth": getattr(head, "default_depth", None),
        "learned_from_traffic": {
            "log": str(root),
            "started_from": start,
            "train_records": result.train_records,
            "held_out_records": result.held_records,
            "sampled_sequences": result.sampled_sequences,
            "steps": result.steps,
            "acceptance_before": result.before,
            "acceptance_after": result.after,
        },
        "acceptance": result.after,
    }
    write_sidecar(out, result.candidate, manifest, overwrite)
    return TrafficReport(result, out, start)
