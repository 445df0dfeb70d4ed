"""The cycle's verify stage (`mtplx.spec_decode.loop.BatchDecoder`, step 3): where a row needs its
lazy drafts on the host, the cycle's one extra read (`read_for_verify`: a grammar row's masks, an
adaptive row's cut), then `TargetSampler.verify` per group of rows (`verify_groups`).

Grammar rows (docs/sampling.md, "Grammar mask": each verified position masked, any q exact): the
verify masks need the row's drafts on the host; a model's drafts are lazy, so they are read once
per cycle, after the trunk forward is queued, and llguidance computes the masks while it runs
(`Step.grammar_reads`). Point-mass drafts are cut to their legal prefix (an illegal one has p = 0:
verify would reject it); sampled drafts are verified as they are.

Adaptive rows (``adaptive_threshold`` > 0) drafted their full length; the same read (the
drafter's confidences) cuts each such row's block after its first unsure draft, without a host
read per draft step stalling every row. Exact: the cut reads only the drafts and q.

Glossary: B rows; k_r row r's drafts; V the vocabulary (`block`).
"""

from __future__ import annotations

from collections.abc import Sequence

from mtplx.sample import ops as sample_ops
from mtplx.spec_decode.block import Block, CycleKeys, Group, adaptive_length, group_masks
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_block import groups_by
from mtplx.spec_decode.rows import BatchRow
from mtplx.trunk.model import TrunkOutput

import mlx.core as mx

__all__ = ["read_for_verify", "verify_groups"]


def read_for_verify(rows: Sequence[BatchRow], block: Block, output: TrunkOutput) -> list | None:
    """Each row's grammar masks over its verify positions, bool [k_r + 1, V] (None for a free
    row); None when no row has a grammar. Before them, the cycle's one extra host read where a
    row needs its lazy drafts on the host, taken after the trunk forward is queued (it runs
    meanwhile): a grammar row's drafts, for its masks, and a row's drafter confidences where its
    length policy cuts (the adaptive head: after the first draft the head gave less than the
    row's threshold; the rest forwarded but never verified)."""
    adaptive = [
        block.part(i) is not None
        and block.part(i).confidence is not None
        and row.spec.settings.adaptive_threshold > 0
        for i, row in enumerate(rows)
    ]
    reads = [
        a or (block.part(i) is not None and block.host_drafts[i] is None and row.constraint is not None)
        for i, (row, a) in enumerate(zip(rows, adaptive))
    ]
    if any(reads):
        mx.async_eval(output.logits)
        confidences = {id(p.confidence): p.confidence for p in block.parts if p.confidence is not None}
        mx.eval(block.drafts, list(confidences.values()))
        on_host = block.drafts.tolist()
        for i, row in enumerate(rows):
            if adaptive[i]:
                sure = block.part(i).confidence[i, : block.lengths[i]].tolist()
                block.cut(i, adaptive_length(sure, row.spec.settings.adaptive_threshold))
            if reads[i]:
                _read_drafts(block, i, on_host[i], row.constraint)
    if all(row.constraint is None for row in rows):
        return None
    return grammar_masks(rows, block.host_drafts)


def _read_drafts(block: Block, i: int, on_host: list[int], constraint: GrammarConstraint | None) -> None:
    """Row i's lazy drafts, read: on the host for its grammar's masks, point masses cut to their
    legal prefix (sampled drafts are verified as they are); a drafter's own reads (drafting under
    a mask) count with the row's."""
    part = block.part(i)
    block.host_drafts[i] = on_host[: block.lengths[i]]
    if constraint is None or part is None:
        return
    block.grammar_reads[i] = 1 + part.host_reads[i]
    if part.q is None:
        block.cut(i, constraint.legal_prefix(block.host_drafts[i]))


def grammar_masks(rows: Sequence[BatchRow], host_drafts: Sequence[list[int]]) -> list:
    """Per row, bool [k_r + 1, V]: the grammar's mask at each verify position [pending, d_1..d_k]
    (`GrammarConstraint.block_masks`: after a refused or EOS draft, all allowed); None for a
    free row."""
    return [
        row.constraint.block_masks(drafts) if row.constraint is not None else None
        for row, drafts in zip(rows, host_drafts)
    ]


def verify_groups(
    rows: Sequence[BatchRow],
    target_logits: mx.array,  # [B, K+1, V]
    block: Block,
    masks: list | None,  # per row: bool [k_r + 1, V] or None (`read_for_verify`)
    keys: Sequence[CycleKeys],
    vocab_size: int,  # the trunk's (a free row's mask)
) -> list[Group]:
    """`TargetSampler.verify` per group of rows sharing (target sampler, k_r, q or point masses):
    each row's penalties, grammar mask, then the rejection step. One `SamplerConfig` per call
    keeps the oracle, the kernel emulation and the fused kernels unchanged and exact; a server's
    rows mostly share a few settings."""
    groups: list[Group] = []

    def group_key(i: int):
        return rows[i].spec.sampler, block.lengths[i], block.has_q(i)

    for (sampler, k, with_q), index in groups_by(range(len(rows)), group_key).items():
        sel = mx.array(index, dtype=mx.int32)
        drafts = block.drafts[sel, :k]
        allowed = group_masks(masks, index, k + 1, vocab_size)
        sample_u = mx.concatenate([sample_ops.draw_uniforms((1,), keys[i].sample) for i in index])
        probs = mx.concatenate([block.q(i, k) for i in index]) if with_q and k else None
        accept_u = (  # k = 0: a plain AR step, verify samples row 0
            mx.concatenate([sample_ops.draw_uniforms((1, k), keys[i].accept) for i in index])
            if k
            else mx.zeros((len(index), 0), dtype=mx.float32)
        )
        history = [rows[i].history for i in index]
        result = sampler.verify(
            target_logits[sel, : k + 1], history, drafts, probs, accept_u, sample_u, allowed
        )
        groups.append(
            Group(index, result.num_accepted, result.next_token, result.accept_probs, result.invalid)
        )
    return groups
