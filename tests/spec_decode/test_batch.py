"""The batched loop (`mtplx.spec_decode.loop`) and its caches (`mtplx.trunk.batch_cache`).

Exactness: in one batch that mixes temperatures, filters, drafters and draft lengths, each
setting's rows reproduce the exact AR joint of the first tokens (chi-square, float64 oracle by
enumeration), with rows joining and leaving mid-run; a rollback applied to the neighbouring row
is caught. Identity: every row gives the tokens the single-row loop gives for the same request.
"""

from __future__ import annotations

import random

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.draft_policy import CostProfile, DraftPolicy
from mtplx.spec_decode.loop import BatchDecoder, RowSpec, check_batch_support, fill_holes
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.trunk import compat
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.model import Trunk
from mtplx.trunk.prompt_cache import cache_nbytes

import mlx.core as mx
import numpy as np
import pytest
from support import decoding as decode
from support.decoding import SOURCES, mtp_decode, take_tokens
from support.exactness import FALSE_FAILURE_RATE, NUM_OUTPUT_TOKENS, PROMPT, exact_ar_joint, loop_p_value
from support.models import make_loop_pair, tiny_gemma3, tiny_llama, tiny_qwen3_5, tiny_qwen3_next

VOCAB = 6

# --------------------------------------------------------------------------- caches


def _prefilled(model, prompt):
    cache = compat.make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _batch_vs_alone(model, keep: list[int], *, swap_neighbours: bool = False) -> float:
    """Largest logit difference between a batch (prefill alone, join, one verify block with
    per-row keep, one more step) and each row decoded alone with the same kept tokens."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 60) for _ in range(n)] for n in (7, 3, 5)]
    blocks = [[rng.randrange(1, 60) for _ in range(3)] for _ in prompts]
    batch = BatchCache(compat.make_prompt_cache(model), model)
    batch.add_rows([_prefilled(model, p) for p in prompts])
    capture = batch.begin_block(3)
    mx.eval(model(mx.array(blocks), cache=batch.layers))
    committed = keep[1:] + keep[:1] if swap_neighbours else keep
    batch.commit_block(capture, committed)
    nxt = model(mx.array([[21], [22], [23]]), cache=batch.layers)
    worst = 0.0
    for r, prompt in enumerate(prompts):
        alone = model(mx.array([prompt + blocks[r][: keep[r]] + [21 + r]]), cache=None)
        worst = max(worst, mx.abs(alone[0, -1] - nxt[r, 0]).max().item())
    return worst


@pytest.mark.parametrize(
    "build", [tiny_llama, tiny_qwen3_next, tiny_qwen3_5], ids=["llama", "qwen3_next", "qwen3_5"]
)
def test_per_row_rollback_matches_each_row_alone(build):
    model = build()
    keep = random.Random().sample([0, 1, 2, 3], 3)  # fresh every run: a distinct keep per row
    assert _batch_vs_alone(model, keep) < 1e-4
    # Negative control: each row takes its neighbour's keep.
    assert _batch_vs_alone(model, keep, swap_neighbours=True) > 1e-3


def test_rows_leave_and_join_without_disturbing_the_others():
    model = tiny_llama()
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10, 11, 12, 13, 14]]
    batch = BatchCache(compat.make_prompt_cache(model), model)
    batch.add_rows([_prefilled(model, p) for p in prompts[:3]])
    batch.remove_rows([0, 2])  # row 1 leaves
    batch.add_rows([_prefilled(model, prompts[3])])
    out = model(mx.array([[30], [31], [32]]), cache=batch.layers)
    for r, prompt in enumerate([prompts[0], prompts[2], prompts[3]]):
        alone = model(mx.array([prompt + [30 + r]]))
        assert mx.abs(alone[0, -1] - out[r, 0]).max().item() < 1e-4
    assert batch.lengths == [5, 4, 6]


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3_5], ids=["llama", "qwen3_5"])
def test_leavers_holes_are_filled_by_the_last_rows(build):
    """The decoder's leave order (`fill_holes`): the last rows move into the leavers' slots, the
    slots are reused by the next joins, and every row still decodes as it would alone."""
    model = build()
    rng = random.Random()
    prompts = [[rng.randrange(1, 60) for _ in range(rng.randrange(2, 9))] for _ in range(8)]
    batch = BatchCache(compat.make_prompt_cache(model), model)
    batch.add_rows([_prefilled(model, p) for p in prompts[:6]])
    gone = set(rng.sample(range(6), 2))  # fresh every run
    keep = fill_holes(6, gone)
    assert sorted(keep) == [i for i in range(6) if i not in gone]
    assert all(i == j for j, i in enumerate(keep) if j not in gone)  # only the holes are refilled
    batch.remove_rows(keep)
    batch.add_rows([_prefilled(model, p) for p in prompts[6:]])
    rows = [prompts[i] for i in keep] + prompts[6:]
    out = model(mx.array([[30 + r] for r in range(len(rows))]), cache=batch.layers)
    for r, prompt in enumerate(rows):
        alone = model(mx.array([prompt + [30 + r]]))
        assert mx.abs(alone[0, -1] - out[r, 0]).max().item() < 1e-4, (r, gone)
    assert batch.lengths == [len(p) + 1 for p in rows]


def test_an_extracted_row_does_not_keep_the_batch_alive():
    """`BatchDecoder.extract` (a finished request's caches, for the prompt cache) holds the row's
    own positions only: with a lazy slice the whole batch's K/V buffers (every slot, the full
    capacity) stayed alive as long as the prompt cache kept the row."""
    import gc

    trunk = Trunk(tiny_llama())
    base = mx.get_active_memory()
    decoder = BatchDecoder(trunk)
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.0)), SOURCES["none"])
    rows = [decoder.join(PROMPT, spec, mx.random.key(seed))[0] for seed in range(8)]
    for _ in range(3):
        decoder.step()
    batch_bytes = mx.get_active_memory() - base
    trunk_cache = decoder.extract(rows[random.randrange(8)])[0]
    del decoder
    gc.collect()
    held = mx.get_active_memory() - base
    row_bytes = cache_nbytes(trunk_cache)
    assert held <= 2 * row_bytes + 65536, (held, row_bytes, batch_bytes)


def test_cycles_after_rows_move_do_not_calibrate_the_policy():
    """The cycle after a join or a leave also evaluates the copies that moved the rows (lazy
    writes into the batch buffers), so its seconds stay out of the policy's calibration, and the
    floor is not timed on it: the first floor timing at 8 rows was a join cycle, 2x the steady
    one, and kept the policy drafting where plain AR was faster."""
    trunk = Trunk(tiny_llama())
    policy = DraftPolicy(CostProfile((1, 64), (0.01, 0.64)))
    decoder = BatchDecoder(trunk, None, policy)
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.0)), SOURCES["none"])
    rows = [decoder.join(PROMPT, spec, mx.random.key(seed))[0] for seed in range(3)]
    decoder.step()  # right after the joins: not timed
    assert policy.calibration == {}
    decoder.step()
    assert set(policy.calibration) == {(4, 0)}
    decoder.leave(rows[:1])
    before = dict(policy.calibration)
    decoder.step()  # right after a leave: not timed
    assert policy.calibration == before
    decoder.step()
    assert set(policy.calibration) == {(4, 0), (2, 0)}


def test_sliding_window_models_decode_one_row_at_a_time_with_a_reason():
    """A model whose caches do not batch gets a single-row decoder (its own caches, the same
    cycle): one row decodes, a second is refused in one line, and the reason names the cache."""
    trunk = Trunk(tiny_gemma3())
    assert "sliding-window" in check_batch_support(trunk)
    decoder = BatchDecoder(trunk)
    assert decoder.single_row
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.0)), SOURCES["none"])
    decoder.join(PROMPT, spec, mx.random.key(0))
    with pytest.raises(MtplxError, match="one row at a time") as err:
        decoder.join(PROMPT, spec, mx.random.key(1))
    assert "\n" not in str(err.value)
    assert len(decoder.step()) == 1


@pytest.mark.parametrize("single_row", [False, True])
def test_a_row_has_one_position_counter_from_its_start_to_its_leave(single_row):
    """One `BatchRow` from `start` to `leave`: while it prefills, ``position`` is what its own
    caches hold; from its join on, between cycles, ``position`` == len(history) - 1 (the pending
    token not forwarded) == what the trunk's cache holds for it == the head's cache plus the true
    pairs it has not consumed yet, with drafts kept and rejected (t 1.0, a disagreeing head), in a batch and on a single-row decoder."""
    trunk, head = make_loop_pair(VOCAB, head_noise=3.0)
    decoder = BatchDecoder(trunk, head, single_row=single_row)
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=3), SOURCES["head"])
    rows = []
    for seed in range(1 if single_row else 3):
        row = decoder.start(PROMPT + [seed + 1] * seed, spec, mx.random.key(seed))
        while not decoder.prefill(row, max_tokens=2):
            assert row.position == row.trunk_cache[0].offset == len(row.history) - row.remaining
        assert row.row_id is None and row.history == row.prompt_tokens
        row_id, _ = decoder.admit(row)
        assert row.row_id == row_id and row in decoder.rows
        rows.append(row)
    rejected = 0
    for _ in range(6):
        steps = decoder.step()
        rejected += sum(step.num_accepted < step.num_drafted for step in steps.values())
        for i, row in enumerate(decoder.rows):
            assert row.position == len(row.history) - 1
            assert decoder.cache.lengths[i] == row.position
            # The head holds the true pairs it consumed; the newest wait for its next chain.
            assert decoder.chain.cache.lengths[i] + len(row.pending_tokens) == row.position
    assert rejected  # the rollback path ran
    assert decoder.rows == rows


# --------------------------------------------------------------------------- identity


def _alone(trunk, head, spec: RowSpec, seed: int, n: int) -> list[int]:
    key = mx.random.key(seed)
    if not spec.sources:
        return take_tokens(decode.ar_decode(trunk, PROMPT, spec.settings, key), n)
    return take_tokens(mtp_decode(trunk, head, PROMPT, spec.settings, key), n)


def _batched(decoder: BatchDecoder, specs_and_seeds, n: int) -> list[list[int]]:
    tokens = {}
    for spec, seed in specs_and_seeds:
        row_id, first = decoder.join(PROMPT, spec, mx.random.key(seed))
        tokens[row_id] = list(first.tokens)
    while min(len(t) for t in tokens.values()) < n:
        for row_id, step in decoder.step().items():
            tokens[row_id].extend(step.tokens)
    return [tokens[i][:n] for i in sorted(tokens)]


def _specs():
    head = [
        RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.0), depth=2), SOURCES["head"]),
        RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=3), SOURCES["head"]),
        RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.7, top_k=3), depth=1), SOURCES["head"]),
        RowSpec(
            DecodeSettings(sampler=SamplerConfig(temperature=1.0, top_p=0.8), depth=2, greedy_draft=True),
            SOURCES["head"],
        ),
    ]
    other = [
        RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0)), SOURCES["none"]),
        RowSpec(
            DecodeSettings(sampler=SamplerConfig(temperature=0.9, repetition_penalty=1.3)), SOURCES["none"]
        ),
    ]
    return head, other


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_each_row_gives_the_tokens_it_gives_alone(family):
    trunk, head = make_loop_pair(VOCAB, family=family)
    head_specs, other_specs = _specs()
    cases = [(spec, seed) for seed, spec in enumerate(head_specs + other_specs, start=random.randrange(1000))]
    n = 12
    batched = _batched(BatchDecoder(trunk, head), cases, n)
    for (spec, seed), tokens in zip(cases, batched):
        assert tokens == _alone(trunk, head, spec, seed, n), (spec, seed)


# --------------------------------------------------------------------------- exactness


EXACTNESS_CASES = [
    # (sampler, drafter, depth): mixed in one batch
    (SamplerConfig(temperature=1.0), "head", 2),
    (SamplerConfig(temperature=0.7, top_k=4), "head", 1),
    (SamplerConfig(temperature=1.0, top_p=0.85), "auto", 3),
    (SamplerConfig(temperature=1.3), "none", 1),
]
# Power at 200 (2026-12-07): the control below catches every drafting case at p < 6e-12 (seeds 77,
# 1e5, 2e5, 3e5; the top-k and top-p cases by sequences AR gives probability 0).
SAMPLES_PER_CASE = 200


class CyclingPolicy(DraftPolicy):
    """A draft policy whose length changes every cycle (1, 0, 2, 3, 1, 0, ...): the loop must stay
    exact when each cycle's K differs and caps rows below their depth (any K chosen from the
    past is exact; `DraftPolicy`'s own choice is tested in test_draft_policy.py)."""

    ORDER = (1, 0, 2, 3)

    def __init__(self):
        super().__init__(CostProfile((1,), (1.0,)))
        self.chosen: list[int] = []

    def choose(self, offers, *, timed=True):
        max_depth = max((o.most for o in offers if o is not None), default=0)
        self.chosen.append(min(self.ORDER[len(self.chosen) % len(self.ORDER)], max_depth))
        return self.chosen[-1]


def _sample_batch(trunk, head, seed0: int, bug=None, policy=None) -> list[np.ndarray]:
    """Counts of the first NUM_OUTPUT_TOKENS tokens per case, all cases in one batch. Halfway
    in, rows that are not counted join and leave (they must not disturb the others)."""
    decoder = BatchDecoder(trunk, head, policy)
    if bug is not None:
        bug(decoder)
    counts_by_case = [np.zeros([VOCAB] * NUM_OUTPUT_TOKENS, dtype=np.int64) for _ in EXACTNESS_CASES]
    rows: dict[int, tuple[int, list[int]]] = {}
    specs = [
        RowSpec(DecodeSettings(sampler=cfg, depth=depth), SOURCES[drafter])
        for cfg, drafter, depth in EXACTNESS_CASES
    ]
    for i in range(SAMPLES_PER_CASE):  # round robin: neighbouring rows have different settings
        for c, spec in enumerate(specs):
            row_id, first = decoder.join(PROMPT, spec, mx.random.key(seed0 + c * SAMPLES_PER_CASE + i))
            rows[row_id] = (c, list(first.tokens))
    visitors: list[int] = []
    cycle = 0
    while any(len(t) < NUM_OUTPUT_TOKENS for _, t in rows.values()):
        for row_id, step in decoder.step().items():
            if row_id in rows:
                rows[row_id][1].extend(step.tokens)
        done = [row_id for row_id, (_, t) in rows.items() if len(t) >= NUM_OUTPUT_TOKENS]
        decoder.leave(done + visitors[:2])
        visitors = visitors[2:]
        if cycle == 0:  # visitors with another prompt and setting join mid-run
            spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=2.0), depth=2), SOURCES["head"])
            for v in range(4):
                visitors.append(decoder.join([2, 2, 1], spec, mx.random.key(seed0 - 1 - v))[0])
        cycle += 1
        for row_id in done:
            c, tokens = rows.pop(row_id)
            counts_by_case[c][tuple(tokens[:NUM_OUTPUT_TOKENS])] += 1
    return counts_by_case


_PAIRS: dict[str, tuple] = {}
_EXPECTED: dict[str, list[np.ndarray]] = {}


def _pair(family: str):
    """The trunk + head of a family (built once per module) and each case's exact AR joint."""
    if family not in _PAIRS:
        _PAIRS[family] = make_loop_pair(VOCAB, head_noise=1.0, family=family)
        trunk = _PAIRS[family][0]
        _EXPECTED[family] = [exact_ar_joint(trunk, cfg, VOCAB) for cfg, _, _ in EXACTNESS_CASES]
    return _PAIRS[family], _EXPECTED[family]


@pytest.fixture(scope="module")
def pair():
    return _pair("llama")[0]


@pytest.fixture(scope="module")
def expected():
    return _pair("llama")[1]


@pytest.mark.parametrize(
    ("family", "seed0", "policy"),
    [
        # Every row drafting its depth every cycle: the draft-policy cases reach it too (their K=3
        # cycles cap no row), so the default run leaves it to them and `slow` repeats it alone.
        pytest.param("llama", random.randrange(10**6, 10**7), None, marks=pytest.mark.slow),
        ("llama", random.randrange(10**6, 10**7), CyclingPolicy()),
        ("qwen3_5", random.randrange(10**6, 10**7), CyclingPolicy()),
    ],
    ids=["fresh", "fresh-draft-policy", "hybrid-fresh-draft-policy"],
)
def test_mixed_batch_matches_the_exact_ar_distribution(family, seed0, policy):
    """Exact marginals with a draft length that changes every cycle (`CyclingPolicy`: K = 1, 0, 2,
    3, ..., so cycles where every row drafts its depth, where rows are capped, and AR steps), on a
    plain and a hybrid (gated-delta) trunk; `slow` adds every row drafting its depth every cycle."""
    (trunk, head), expected = _pair(family)
    counts = _sample_batch(trunk, head, seed0, policy=policy)
    if policy is not None:
        assert len(set(policy.chosen)) >= 2, policy.chosen  # the lengths did change mid-run
    for c, (case_counts, case_expected) in enumerate(zip(counts, expected)):
        assert case_counts.sum() == SAMPLES_PER_CASE
        p_value = loop_p_value(case_counts, case_expected)
        assert p_value > FALSE_FAILURE_RATE, (
            f"{family} case {EXACTNESS_CASES[c]}: p={p_value:.3g} (seed0={seed0})"
        )


def test_chi_square_catches_a_batch_that_commits_rejected_drafts(pair, expected):
    """The negative control: rows that commit their rejected draft instead of the residual
    sample are caught. (The cache-level mix-up, a rollback applied to the neighbouring row, is
    the control of test_per_row_rollback_matches_each_row_alone: the tiny trunk's context
    dependence is too weak for 300 samples to see it in the token distribution.)"""

    def commits_rejected(decoder: BatchDecoder) -> None:
        verify = decoder._verify

        def wrong(rows, logits, block, *rest):
            groups = verify(rows, logits, block, *rest)
            for g in groups:
                k = g.accept_probs.shape[1]
                if k:
                    row_drafts = block.drafts[mx.array(g.index), :k]
                    slot = mx.minimum(g.num_accepted, k - 1)[:, None]
                    rejected = mx.take_along_axis(row_drafts, slot, axis=1)[:, 0]
                    g.next_token = mx.where(g.num_accepted < k, rejected, g.next_token)
            return groups

        decoder._verify = wrong

    counts = _sample_batch(*pair, 77, bug=commits_rejected)
    p_values = []
    for case_counts, case_expected in zip(counts, expected):
        try:
            p_values.append(loop_p_value(case_counts, case_expected))
        except AssertionError:  # a sequence the exact distribution gives probability 0
            p_values.append(0.0)
    # Case by case: every drafting row is caught, and the row that never drafts is untouched by the bug
    # (the same test as above passes it), so no one case's catch can stand in for another's.
    for (cfg, drafter, depth), p_value in zip(EXACTNESS_CASES, p_values):
        caught = p_value < FALSE_FAILURE_RATE
        assert caught == (drafter != "none"), f"{drafter} depth {depth} {cfg}: p={p_value:.3g}"
