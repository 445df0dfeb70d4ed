"""Grammar-constrained decoding in the loop: exact under speculation.

The expected distribution is the oracle's constrained chain (`reference.distribution_from_logits`
with ``allowed``), enumerated over the grammar's legal prefixes with masks computed here straight
from llguidance (not through `GrammarConstraint`, the code under test). Chi-square tests compare
sampled runs with it (head drafts masked, lookup drafts cut, depths 1-3, temperature 0.7 and 1.0
with top-p); two negative controls (the first position's mask reused at later positions; the
head's q left unmasked in the acceptance ratio) must be caught by the same check.
"""

from __future__ import annotations

import os

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.grammar import GrammarCompiler
from mtplx.engine.grammar_spec import Grammar
from mtplx.errors import MtplxError
from mtplx.sampling import SamplerConfig, distribution_from_logits
from mtplx.spec_decode import head_chain as head_module
from mtplx.spec_decode import verify_stage
from mtplx.spec_decode.block import Block
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_block import DraftBlock
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.draft_policy import CostProfile, DraftPolicy
from mtplx.spec_decode.loop import BatchDecoder, RowSpec
from mtplx.spec_decode.settings import DecodeSettings, LookupConfig
from mtplx.spec_decode.sources import Source

import llguidance
import llguidance.numpy as llg_numpy
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from support import decoding as decode
from support.decoding import SOURCES, Drafters, take_steps
from support.exactness import FALSE_FAILURE_RATE, loop_p_value
from support.models import make_loop_pair
from support.tokenizer import CHATML_CHARS, chatml_chars

# Positions 1, 2, 3.. allow {a,b}, {a..e}, {a..z} (EOS too from position 4; never space,
# punctuation or ids past the tokenizer): the sets differ along a verify block, and every later set
# contains every earlier one, so a mask reused at a later position yields legal tokens in the wrong
# proportions (the chi-square sees it: p < 1e-70 at 400 samples, depths 1-3; < 1e-24 at 200 over
# four seeds), not a matcher error.
LOOP_GRAMMAR = "start: /[ab][a-e][a-z]+/"
# Exactly 49 letters, then the end: greedy runs long enough to see accepts and rejections.
GREEDY_GRAMMAR = "start: /[abc]([ab][abcd]){24}/"
VOCAB = 40  # the tokenizer has 33 ids: 33..39 must never be allowed
# Punctuation and spaces the grammar refuses, so prompt-lookup blocks get cut to a legal prefix.
GRAMMAR_PROMPT = [CHATML_CHARS.index(c) for c in "ab,ab c."]
NUM_OUTPUT_TOKENS = 3
MODEL = dict(vocab_size=VOCAB, seed=11, context_strength=6.0, head_noise=1.5, logit_scale=1.5)
GREEDY_MODEL = dict(vocab_size=VOCAB, seed=0, context_strength=6.0, head_noise=2.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatml")
    chatml_chars(path)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def encode(text: str) -> list[int]:
    return [CHATML_CHARS.index(c) for c in text]


def decode_text(tokens: list[int]) -> str:
    return "".join(CHATML_CHARS[t] for t in tokens)


# --------------------------------------------------------------------------- the oracle's joint


def llguidance_mask(matcher, ll_vocab: int) -> np.ndarray:
    """bool [VOCAB] straight from llguidance's bitmask (ids past its vocabulary disallowed)."""
    bitmask = llg_numpy.allocate_token_bitmask(1, ll_vocab)
    llg_numpy.fill_next_token_bitmask(matcher, bitmask)
    allowed = np.zeros(VOCAB, dtype=bool)
    bits = (bitmask[0][:, None] >> np.arange(32)) & 1
    allowed[:ll_vocab] = bits.reshape(-1)[:ll_vocab].astype(bool)
    return allowed


def constrained_ar_joint(trunk, compiler: GrammarCompiler, grammar: str, cfg: SamplerConfig) -> np.ndarray:
    """P(first NUM_OUTPUT_TOKENS tokens) of AR sampling from the oracle's constrained chain."""
    ll_tokenizer = compiler.ll_tokenizer
    source = Grammar.lark(grammar).source
    joint = {(): 1.0}
    for _ in range(NUM_OUTPUT_TOKENS):
        prefixes = list(joint)
        logits = trunk(mx.array([GRAMMAR_PROMPT + list(p) for p in prefixes]), None).logits[:, -1, :]
        logits = np.array(logits.astype(mx.float32), dtype=np.float64)
        new_joint = {}
        for row, prefix in enumerate(prefixes):
            matcher = llguidance.LLMatcher(ll_tokenizer, source, log_level=0)
            assert matcher.consume_tokens(list(prefix))
            p = distribution_from_logits(
                logits[row], cfg, allowed=llguidance_mask(matcher, ll_tokenizer.vocab_size)
            )
            for token in np.flatnonzero(p):
                new_joint[prefix + (int(token),)] = joint[prefix] * p[token]
        joint = new_joint
    table = np.zeros([VOCAB] * NUM_OUTPUT_TOKENS)
    for seq, prob in joint.items():
        table[seq] = prob
    return table


# ------------------------------------------------------------------------------- the loop runs


def head_run(trunk, head, constraint, cfg, depth, seed, **settings):
    s = DecodeSettings(sampler=cfg, depth=depth, **settings)
    return decode.speculative_decode(
        trunk,
        Drafters(SOURCES["head"], head=head),
        GRAMMAR_PROMPT,
        s,
        mx.random.key(seed),
        constraint=constraint,
    )


def lookup_run(trunk, head, constraint, cfg, depth, seed):
    s = DecodeSettings(sampler=cfg, depth=depth)
    lookup = LookupConfig(min_ngram=1, max_ngram=2, max_tokens=4, adaptive_length=False)
    proposer = Drafters(SOURCES["lookup" if head is None else "auto"], head=head, lookup=lookup)
    return decode.speculative_decode(
        trunk, proposer, GRAMMAR_PROMPT, s, mx.random.key(seed), constraint=constraint
    )


def draft_model_for(spec: dict):
    """The target's weights with its context-dependent part halved: a draft model that agrees
    with the target often but not always, and does not know the grammar (its drafts unmasked)."""
    return make_loop_pair(**dict(spec, context_strength=spec["context_strength"] * 0.5))[0].model


def model_run(trunk, head, constraint, cfg, depth, seed, draft_model=None, **settings):
    s = DecodeSettings(sampler=cfg, depth=depth, **settings)
    model = draft_model if draft_model is not None else draft_model_for(MODEL)
    proposer = Drafters(
        SOURCES["proposer"],
        proposer=DraftModelProposer(model, s, target_vocab_size=VOCAB, real_vocab_size=VOCAB),
    )
    return decode.speculative_decode(
        trunk, proposer, GRAMMAR_PROMPT, s, mx.random.key(seed), constraint=constraint
    )


def ar_run(trunk, head, constraint, cfg, depth, seed):
    s = DecodeSettings(sampler=cfg)
    return decode.ar_decode(trunk, GRAMMAR_PROMPT, s, mx.random.key(seed), constraint=constraint)


_DRAFT_MODEL: list = []


def _model_runner(trunk, head, constraint, cfg, depth, seed):
    if not _DRAFT_MODEL:
        _DRAFT_MODEL.append(draft_model_for(MODEL))
    return model_run(trunk, head, constraint, cfg, depth, seed, draft_model=_DRAFT_MODEL[0])


RUNNERS = {
    "head": head_run,
    "lookup": lambda t, h, *a: lookup_run(t, None, *a),
    "auto": lookup_run,
    "model": _model_runner,
    "ar": ar_run,
}


def sampled_counts(trunk, head, compiler, run, cfg, depth, num_samples, seed0) -> tuple[np.ndarray, set[int]]:
    """Counts of the first tokens over ``num_samples`` runs, and every block length verified."""
    counts = np.zeros([VOCAB] * NUM_OUTPUT_TOKENS, dtype=np.int64)
    block_lengths: set[int] = set()
    grammar = Grammar.lark(LOOP_GRAMMAR)
    for i in range(num_samples):
        constraint = compiler.compile(grammar)
        tokens, steps = take_steps(run(trunk, head, constraint, cfg, depth, seed0 + i), NUM_OUTPUT_TOKENS)
        counts[tuple(tokens)] += 1
        block_lengths |= {s.num_drafted for s in steps[1:]}
    return counts, block_lengths


# A loop run costs 25-60 ms here (2 cores, shared): `make test` runs four cases at 200 samples (the
# default `auto` drafter among them; the head once, at depth 3), `make test-slow` every case at 1000.
# Power at 200 (2026-12-07, seeds 1e5, 2e5, 3e5, 4321): the two controls below fail at p < 3e-25 (the first
# mask reused, depth 2) and p < 3e-20 (the head's q unmasked, depth 1) at every seed.
CASES = {
    "head-d1-t1.0": ("head", 1, SamplerConfig(temperature=1.0)),
    "head-d2-t0.7-topp": ("head", 2, SamplerConfig(temperature=0.7, top_p=0.9)),
    "head-d3-t1.0-topp": ("head", 3, SamplerConfig(temperature=1.0, top_p=0.8)),
    "lookup-t0.7-topp": ("lookup", 3, SamplerConfig(temperature=0.7, top_p=0.9)),
    "auto-d2-t1.0": ("auto", 2, SamplerConfig(temperature=1.0)),
    "ar-t0.7-topp": ("ar", 0, SamplerConfig(temperature=0.7, top_p=0.9)),
    "model-d2-t1.0": ("model", 2, SamplerConfig(temperature=1.0)),
}
QUICK_CASES = ["auto-d2-t1.0", "head-d3-t1.0-topp", "lookup-t0.7-topp", "model-d2-t1.0"]
NUM_SAMPLES = 200
NUM_SAMPLES_SLOW = 1000


@pytest.mark.parametrize("case", QUICK_CASES)
def test_constrained_speculative_distribution_matches_the_oracle(case, compiler):
    check_against_the_oracle(case, compiler, NUM_SAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_constrained_distribution_matches_the_oracle_at_more_samples(case, compiler):
    check_against_the_oracle(case, compiler, NUM_SAMPLES_SLOW)


def check_against_the_oracle(case: str, compiler: GrammarCompiler, num_samples: int) -> None:
    drafter, depth, cfg = CASES[case]
    trunk, head = make_loop_pair(**MODEL)
    expected = constrained_ar_joint(trunk, compiler, LOOP_GRAMMAR, cfg)
    seed0 = int.from_bytes(os.urandom(4), "little")
    counts, block_lengths = sampled_counts(
        trunk, head, compiler, RUNNERS[drafter], cfg, depth, num_samples, seed0
    )
    p_value = loop_p_value(counts, expected)
    assert p_value > FALSE_FAILURE_RATE, f"p={p_value:.3g} (seed0={seed0})"
    if drafter == "lookup":  # blocks of 4 were cut to their legal prefix, and some refused whole
        assert 0 in block_lengths and block_lengths & {1, 2, 3}, block_lengths
    if drafter == "model":  # unmasked sampled drafts are verified whole, illegal ones included
        assert block_lengths == {depth}, block_lengths


def test_the_joint_is_constrained_and_far_from_the_free_one(compiler):
    """The check means something: the constrained joint puts all its mass on legal prefixes,
    and differs from what the unconstrained model gives them."""
    trunk, _ = make_loop_pair(**MODEL)
    cfg = SamplerConfig(temperature=1.0)
    joint = constrained_ar_joint(trunk, compiler, LOOP_GRAMMAR, cfg)
    letters = "abcdefghijklmnopqrstuvwxyz"
    legal = [tuple(encode(a + b + c)) for a in "ab" for b in "abcde" for c in letters]
    assert sum(joint[seq] for seq in legal) == pytest.approx(1.0)
    assert min(joint[seq] for seq in legal) > 0  # every legal prefix is reachable
    free_first = distribution_from_logits(
        np.array(trunk(mx.array([GRAMMAR_PROMPT]), None).logits[0, -1].astype(mx.float32)), cfg
    )
    assert free_first[encode("abc")].sum() < 0.5  # the mask moves real mass


def _check_exactness(compiler, depth, num_samples=NUM_SAMPLES) -> float:
    trunk, head = make_loop_pair(**MODEL)
    cfg = SamplerConfig(temperature=1.0)
    expected = constrained_ar_joint(trunk, compiler, LOOP_GRAMMAR, cfg)
    counts, _ = sampled_counts(trunk, head, compiler, head_run, cfg, depth, num_samples, 4321)
    return loop_p_value(counts, expected)


def test_chi_square_catches_the_first_mask_reused_at_later_positions(compiler, monkeypatch):
    """Negative control (a): every position of a cycle (head drafts and target rows) gets the
    mask of the cycle's first position."""
    honest = GrammarConstraint.mask_after
    monkeypatch.setattr(GrammarConstraint, "mask_after", lambda self, drafts=(): honest(self, ()))
    try:
        p_value = _check_exactness(compiler, depth=2)
    except MtplxError:
        pytest.fail("the reused mask made a token the matcher refuses: the control needs legal tokens")
    assert p_value < FALSE_FAILURE_RATE


# --------------------------------------------------------------------------- in a batch


# The grammar rows of one batch: head drafting (the first draft masked, later ones unmasked and
# the verify positions masked after one read), prompt lookup cut to its legal prefix, and AR.
BATCH_GRAMMAR_SPECS = {
    "head": lambda cfg: RowSpec(DecodeSettings(sampler=cfg, depth=2), SOURCES["head"]),
    "lookup": lambda cfg: RowSpec(
        DecodeSettings(sampler=cfg, depth=2),
        SOURCES["auto"],
        LookupConfig(min_ngram=1, max_ngram=2, max_tokens=4, adaptive_length=False),
    ),
    "ar": lambda cfg: RowSpec(DecodeSettings(sampler=cfg), SOURCES["none"]),
    # The row's own proposer: a draft model (with its own cache), verified with the others.
    "draft": lambda cfg: RowSpec(DecodeSettings(sampler=cfg, depth=2), SOURCES["proposer"]),
}


def _row_proposer(kind: str, spec: RowSpec):
    """A "draft" row's own draft-model proposer (the draft model built once per module)."""
    if kind != "draft":
        return None
    if not _DRAFT_MODEL:
        _DRAFT_MODEL.append(draft_model_for(MODEL))
    return DraftModelProposer(_DRAFT_MODEL[0], spec.settings, target_vocab_size=VOCAB, real_vocab_size=VOCAB)


def batch_counts(
    trunk, head, compiler, cfg: SamplerConfig, num_samples: int, seed0: int, grammar_source=LOOP_GRAMMAR
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Counts of the first tokens of grammar rows decoded together in one `BatchDecoder`, per row
    kind (`BATCH_GRAMMAR_SPECS`, in turn), each beside a free head-drafting row; and the drafts
    each kind verified (a kind that never drafts would test nothing)."""
    decoder = BatchDecoder(trunk, head)
    grammar = Grammar.lark(grammar_source)
    free = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=2), SOURCES["head"])
    kinds = list(BATCH_GRAMMAR_SPECS)
    counts = {kind: np.zeros([VOCAB] * NUM_OUTPUT_TOKENS, dtype=np.int64) for kind in kinds}
    drafted = dict.fromkeys([*kinds, "forced", "forced_accepted"], 0)
    free_rows: list[int] = []
    rows: dict[int, tuple[str, list[int]]] = {}
    joined = 0
    while rows or joined < num_samples:
        # One row of each kind joins every cycle: rows at different positions share each cycle.
        for i in range(joined, min(joined + len(kinds), num_samples)):
            kind = kinds[i % len(kinds)]
            key = mx.random.key(seed0 + i)
            spec = BATCH_GRAMMAR_SPECS[kind](cfg)
            row_id, first = decoder.join(
                GRAMMAR_PROMPT,
                spec,
                key,
                constraint=compiler.compile(grammar),
                proposer=_row_proposer(kind, spec),
            )
            rows[row_id] = (kind, list(first.tokens))
            free_id, _ = decoder.join(GRAMMAR_PROMPT, free, mx.random.key(seed0 + num_samples + i))
            free_rows.append(free_id)
        joined = min(joined + len(kinds), num_samples)
        decoder.leave(free_rows[: -3 * len(kinds)])
        del free_rows[: -3 * len(kinds)]
        for row_id, step in decoder.step().items():
            if row_id in rows:
                rows[row_id][1].extend(step.tokens)
                drafted[rows[row_id][0]] += step.num_drafted
                if step.sources and step.sources[0][0] == "grammar":
                    drafted["forced"] += step.num_drafted
                    drafted["forced_accepted"] += step.num_accepted
        done = [row_id for row_id, (_, tokens) in rows.items() if len(tokens) >= NUM_OUTPUT_TOKENS]
        for row_id in done:
            kind, tokens = rows.pop(row_id)
            counts[kind][tuple(tokens[:NUM_OUTPUT_TOKENS])] += 1
        decoder.leave(done)
    return counts, drafted


def _batch_p_values(
    compiler, seed0: int, num_samples: int = NUM_SAMPLES, grammar: str = LOOP_GRAMMAR
) -> tuple[dict, dict]:
    trunk, head = make_loop_pair(**MODEL)
    cfg = SamplerConfig(temperature=1.0, top_p=0.9)
    expected = constrained_ar_joint(trunk, compiler, grammar, cfg)
    counts, drafted = batch_counts(trunk, head, compiler, cfg, num_samples, seed0, grammar)
    return {kind: loop_p_value(c, expected) for kind, c in counts.items()}, drafted


# 4 * 100, the controls' size: at it the neighbour's masks make a token the row's grammar refuses
# (seeds 1e5, 2e5, 2468) and a forced guess kept unverified gives p ~ 1e-13 (seeds 1e5, 2e5, 1357).
@pytest.mark.parametrize(
    "num_samples", [4 * 100, pytest.param(4 * 250, marks=pytest.mark.slow)], ids=["400", "1000"]
)
def test_grammar_rows_in_a_batch_match_the_oracle(compiler, num_samples):
    """Each grammar row kind (head, lookup, a draft model, AR) has the constrained chain's
    marginals, decoded in one batch beside free head rows; the drafting kinds did draft."""
    seed0 = int.from_bytes(os.urandom(4), "little")
    p_values, drafted = _batch_p_values(compiler, seed0, num_samples=num_samples)
    assert drafted["head"] > 0 and drafted["lookup"] > 0 and drafted["draft"] > 0 and drafted["ar"] == 0, (
        drafted
    )
    for kind, p_value in p_values.items():
        assert p_value > FALSE_FAILURE_RATE, f"{kind}: p={p_value:.3g} (seed0={seed0})"


def test_chi_square_catches_a_rows_mask_applied_to_its_neighbour(compiler, monkeypatch):
    """Negative control: each grammar row verifies under the next grammar row's masks (another
    row's state: legal tokens in the wrong proportions, or tokens its own grammar refuses)."""
    honest = verify_stage.grammar_masks

    def neighbours(rows, host_drafts):
        masks = honest(rows, host_drafts)
        grammar_rows = [i for i, m in enumerate(masks) if m is not None]
        shifted = list(masks)
        for a, b in zip(grammar_rows, grammar_rows[1:] + grammar_rows[:1]):
            shifted[a] = mx.concatenate([masks[b], mx.repeat(masks[b][-1:], 8, axis=0)])[: masks[a].shape[0]]
        return shifted

    monkeypatch.setattr(verify_stage, "grammar_masks", neighbours)
    try:
        p_values, _ = _batch_p_values(compiler, 2468, num_samples=4 * 100)
    except MtplxError:  # a token the row's own grammar refuses: caught as well
        return
    assert min(p_values.values()) < FALSE_FAILURE_RATE, p_values


# Position 2 is forced ("c"): drafted as a free point mass after position 1, always kept.
FORCED_GRAMMAR = 'start: /[ab]/ "c" /[a-e][a-z]*/'


def test_forced_tokens_are_free_drafts_in_a_batch(compiler):
    """Tokens the grammar forces are drafted (source "grammar") and kept every time (their masked
    target probability is 1), and every row kind keeps the constrained chain's marginals."""
    seed0 = int.from_bytes(os.urandom(4), "little")
    p_values, drafted = _batch_p_values(compiler, seed0, num_samples=4 * 60, grammar=FORCED_GRAMMAR)
    assert drafted["forced"] >= 60 and drafted["forced_accepted"] == drafted["forced"], drafted
    for kind, p_value in p_values.items():
        assert p_value > FALSE_FAILURE_RATE, f"{kind}: p={p_value:.3g} (seed0={seed0})"


class OneDraftPolicy(DraftPolicy):
    """A draft policy that allows K = 1 every cycle and keeps what each row offered it."""

    def __init__(self):
        super().__init__(CostProfile((1,), (1.0,)))
        self.offers: list = []

    def choose(self, offers, *, timed=True):
        self.offers.append(list(offers))
        return 1


def test_forced_tokens_are_offered_to_the_draft_policy_and_cut_to_its_length(compiler):
    """Under a cost policy, forced tokens widen every row's block, so they are offered like drafts
    (record "grammar", kept nearly always) and cut to the policy's K: a grammar forcing 3 letters
    drafts them one a cycle, each kept."""
    trunk, head = make_loop_pair(**MODEL)
    policy = OneDraftPolicy()
    decoder = BatchDecoder(trunk, head, policy)
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=2), SOURCES["head"])
    row_id, _ = decoder.join(
        GRAMMAR_PROMPT,
        spec,
        mx.random.key(0),
        constraint=compiler.compile(Grammar.lark('start: /[ab]/ "cde" /[a-e]+/')),
    )
    steps = [decoder.step()[row_id] for _ in range(4)]
    forced = [s for s in steps if s.sources and s.sources[0][0] == "grammar"]
    assert [(s.num_drafted, s.num_accepted) for s in forced] == [(1, 1)] * len(forced) and len(forced) >= 2, (
        steps
    )
    offered = [o for cycle in policy.offers for o in cycle if o is not None]
    assert any(o.acceptance is decoder.rows[0].acceptance["grammar"] for o in offered)


def _guess_forced(monkeypatch) -> None:
    """Treat the first allowed token as "forced" wherever the grammar allows several (as a
    drafter that mistook a choice for a forced token would)."""

    def guess(self, limit):
        return [int(np.flatnonzero(np.array(self.mask_after()))[0])]

    monkeypatch.setattr(GrammarConstraint, "forced_tokens", guess)


def test_a_forced_draft_where_two_tokens_are_allowed_is_still_verified(compiler, monkeypatch):
    """Exactness does not rest on the matcher's forced tokens being unique: a wrong "forced" point
    mass is verified like any draft, so the marginals hold (the control below proves the check
    would see it accepted unverified)."""
    _guess_forced(monkeypatch)
    seed0 = int.from_bytes(os.urandom(4), "little")
    p_values, drafted = _batch_p_values(compiler, seed0, num_samples=4 * 100)
    assert drafted["forced_accepted"] < drafted["forced"], drafted  # some guesses were rejected
    for kind, p_value in p_values.items():
        assert p_value > FALSE_FAILURE_RATE, f"{kind}: p={p_value:.3g} (seed0={seed0})"


def test_chi_square_catches_a_forced_draft_accepted_where_two_tokens_were_allowed(compiler, monkeypatch):
    """Negative control: the guessed "forced" token is kept without verify (its position's mask
    narrowed to it, as if the grammar allowed it alone)."""
    _guess_forced(monkeypatch)
    honest = verify_stage.grammar_masks

    def accepted_unverified(rows, host_drafts):
        masks = honest(rows, host_drafts)
        for i, (row, drafts) in enumerate(zip(rows, host_drafts)):
            if masks[i] is not None and drafts and drafts[:1] == row.constraint.forced_tokens(1):
                only = mx.arange(VOCAB) == drafts[0]
                masks[i] = mx.concatenate([only[None], masks[i][1:]])
        return masks

    monkeypatch.setattr(verify_stage, "grammar_masks", accepted_unverified)
    # Its p-value moves with the tests run before it in the process (seen 1e-205 and, at 4 * 40, 1e-5):
    # keep the full count.
    p_values, _ = _batch_p_values(compiler, 1357, num_samples=4 * 100)
    assert min(p_values[kind] for kind in ("head", "lookup")) < FALSE_FAILURE_RATE, p_values


def test_chi_square_catches_an_unmasked_q_in_the_acceptance_ratio(compiler, monkeypatch):
    """Negative control (b): drafts sampled from the head's masked distribution, but the q
    verify divides by is the unmasked one."""
    honest = head_module.draw_drafts

    def unmasked_q(rows, logits, earlier, uniforms, allowed):
        token, _, invalid, sure = honest(rows, logits, earlier, uniforms, allowed)
        _, q_unmasked, _, _ = honest(rows, logits, earlier, uniforms, None)
        return token, q_unmasked, invalid, sure

    monkeypatch.setattr(head_module, "draw_drafts", unmasked_q)
    assert _check_exactness(compiler, depth=1) < FALSE_FAILURE_RATE


# ---------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("greedy_draft", [False, True])
def test_greedy_constrained_speculation_equals_constrained_ar(depth, greedy_draft, compiler):
    trunk, head = make_loop_pair(**GREEDY_MODEL)
    cfg = SamplerConfig(temperature=0.0)
    grammar = Grammar.lark(GREEDY_GRAMMAR)
    ar = [t for s in ar_run(trunk, head, compiler.compile(grammar), cfg, 0, 0) for t in s.tokens]
    steps = list(head_run(trunk, head, compiler.compile(grammar), cfg, depth, 0, greedy_draft=greedy_draft))
    spec = [t for s in steps for t in s.tokens]
    assert spec == ar and len(ar) == 49 and steps[-1].grammar_done
    assert steps[1].grammar_reads == 1  # the drafts read once for the block (the chain reads none)
    accepted = [s.num_accepted for s in steps if s.num_drafted]
    assert any(a > 0 for a in accepted) and any(a < depth for a in accepted), accepted
    free, _ = take_steps(ar_run(trunk, head, None, cfg, 0, 0), 49)
    assert free != ar  # the grammar changed the greedy output


@pytest.mark.parametrize("drafter", ["lookup", "auto"])
def test_greedy_constrained_lookup_equals_constrained_ar(drafter, compiler):
    trunk, head = make_loop_pair(**GREEDY_MODEL)
    cfg = SamplerConfig(temperature=0.0)
    grammar = Grammar.lark(GREEDY_GRAMMAR)
    ar = [t for s in ar_run(trunk, head, compiler.compile(grammar), cfg, 0, 0) for t in s.tokens]
    steps = list(lookup_run(trunk, head if drafter == "auto" else None, compiler.compile(grammar), cfg, 3, 0))
    assert [t for s in steps for t in s.tokens] == ar
    assert any(s.num_drafted == 4 and s.num_accepted == 4 for s in steps)  # lookup blocks were kept


def _one_row_block(tokens: mx.array, source: Source, q: mx.array | None = None) -> Block:
    """A cycle's block holding one row with lazy drafts from one drafter (not yet on the host)."""
    k = tokens.shape[1]
    return Block([DraftBlock(tokens, [k], [((source, k),)], q=q)], [0], [k], [None], [None])


def test_point_mass_drafts_are_cut_and_sampled_drafts_kept(compiler):
    """Point masses are cut to their legal prefix when read; a sampled block keeps its refused
    draft (verify rejects it: p = 0), and the rows after it are all-allowed, never used."""
    constraint = compiler.compile(Grammar.lark(LOOP_GRAMMAR))
    tokens = mx.array([encode("abd,")], dtype=mx.int32)
    block = _one_row_block(tokens, Source.MODEL)
    verify_stage._read_drafts(block, 0, encode("abd,"), constraint)
    assert block.sources(0) == ((Source.MODEL, 3),) and block.grammar_reads == [1]
    assert block.lengths == [3] and block.host_drafts == [encode("abd")] and block.kind(0) is Source.MODEL
    refused = _one_row_block(tokens[:, 2:], Source.MODEL)
    verify_stage._read_drafts(refused, 0, encode("d,"), constraint)
    assert refused.chosen == [None] and refused.lengths == [0] and refused.kind(0) is None
    q = mx.full((1, 4, VOCAB), 1.0 / VOCAB)
    sampled = _one_row_block(tokens, Source.MODEL, q)
    verify_stage._read_drafts(sampled, 0, encode("abd,"), constraint)
    assert sampled.lengths == [4] and sampled.has_q(0)
    rows = np.array(constraint.block_masks(sampled.host_drafts[0]))
    assert rows.shape == (5, VOCAB)
    assert not rows[3, encode(",")[0]] and rows[4].all()  # "," refused at position 4; after it: anything


# --------------------------------------------------------------------------- the grammar's end

END_GRAMMAR = "start: /[ab][abc][ac]d/"


@pytest.mark.parametrize("depth", [None, 1, 3])
def test_a_complete_grammar_ends_the_stream_without_eos(depth, compiler):
    trunk, head = make_loop_pair(**MODEL)
    cfg = SamplerConfig(temperature=1.0)
    for seed in range(6):
        constraint = compiler.compile(Grammar.lark(END_GRAMMAR))
        steps = (
            ar_run(trunk, head, constraint, cfg, 0, seed)
            if depth is None
            else head_run(trunk, head, constraint, cfg, depth, seed)
        )
        produced = list(steps)  # the generator ends by itself at the grammar's end
        tokens = [t for s in produced for t in s.tokens]
        assert produced[-1].grammar_done and not any(s.grammar_done for s in produced[:-1])
        text = decode_text(tokens)  # no EOS: the stream ends with the grammar's last token
        assert len(text) == 4 and text[0] in "ab" and text[1] in "abc" and text[2] in "ac" and text[3] == "d"


def test_masks_allow_eos_only_where_the_grammar_accepts_and_never_ids_past_the_tokenizer(compiler):
    constraint = compiler.compile(Grammar.lark(END_GRAMMAR))
    eos = CHATML_CHARS.index("<|im_end|>")

    def allowed(drafts):
        return {CHATML_CHARS[i] for i in np.flatnonzero(np.array(constraint.mask_after(encode(drafts))))}

    assert allowed("") == {"a", "b"}
    assert allowed("ab") == {"a", "c"}
    assert allowed("abcd") == {"<|im_end|>"}  # complete: EOS only
    assert constraint.legal_prefix(encode("bbcd") + [eos]) == 5 and constraint.legal_prefix(encode("bd")) == 1
    masks = np.array(constraint.block_masks(encode("bx")))  # x is refused: the row after it is never used
    assert masks.shape == (3, VOCAB) and masks[2].all() and not masks[:2, 33:].any()
    constraint.commit(encode("abc"))
    assert allowed("") == {"d"} and not constraint.stopped
    constraint.commit(encode("d"))
    assert constraint.stopped
    with pytest.raises(MtplxError, match="^grammar: ") as refused:  # a failed matcher: one line
        constraint.commit(encode("a"))
    assert "\n" not in str(refused.value) and "<state>" not in str(refused.value)


def test_a_drafter_that_gives_every_allowed_token_zero_drafts_uniformly_among_them():
    """A head with a narrowed vocabulary can put -inf on every token the grammar allows: its draft
    is then uniform over the allowed tokens (legal, with the q it was drawn from), not token 0."""
    from mtplx.sample.target import target_sampler

    logits = mx.array([[0.0, 5.0, -mx.inf, -mx.inf, 1.0, -mx.inf]])
    allowed = mx.array([False, False, True, True, False, True])
    sampler = target_sampler(SamplerConfig(temperature=0.7, top_p=0.9))
    for u in (0.1, 0.5, 0.9):
        token, q, invalid = sampler.draft(logits, None, mx.array([u]), allowed)
        assert int(token[0]) in (2, 3, 5) and int(invalid) == 0
        np.testing.assert_allclose(np.array(q[0]), [0, 0, 1 / 3, 1 / 3, 0, 1 / 3], rtol=1e-6)
    partly = mx.array([False, True, True, False, True, False])  # the drafter's own masked distribution
    _, q, _ = target_sampler(SamplerConfig()).draft(logits, None, mx.array([0.5]), partly)
    expected = np.exp([5.0, 1.0]) / np.exp([5.0, 1.0]).sum()
    np.testing.assert_allclose(np.array(q[0])[[1, 4]], expected, rtol=1e-6)
    greedy = target_sampler(SamplerConfig(temperature=0.0), greedy_draft=True)
    assert int(greedy.draft(logits, None, mx.array([0.5]), allowed).tokens[0]) == 2


@pytest.mark.parametrize("greedy_draft", [False, True])
def test_greedy_constrained_draft_model_equals_constrained_ar(greedy_draft, compiler):
    """A draft model does not know the grammar: its sampled drafts (one-hot q at temperature 0)
    are verified whole and an illegal one rejected; its argmax drafts (point masses) are cut."""
    trunk, _ = make_loop_pair(**GREEDY_MODEL)
    cfg = SamplerConfig(temperature=0.0)
    # Letters only: the draft model's unconstrained argmax is often legal here (with the loop
    # grammar it never is, and every block would be refused).
    grammar = Grammar.lark("start: /[a-z]{48}/")
    ar = [t for s in ar_run(trunk, None, compiler.compile(grammar), cfg, 0, 0) for t in s.tokens]
    draft_model = draft_model_for(GREEDY_MODEL)
    steps = list(
        model_run(
            trunk,
            None,
            compiler.compile(grammar),
            cfg,
            3,
            0,
            draft_model=draft_model,
            greedy_draft=greedy_draft,
        )
    )
    assert [t for s in steps for t in s.tokens] == ar
    accepted = [(s.num_drafted, s.num_accepted) for s in steps[1:]]
    assert any(a == k > 0 for k, a in accepted) and any(a < k for k, a in accepted), accepted
    assert len(ar) == 48 and steps[-1].grammar_done


def test_draft_ids_past_the_tokenizer_are_illegal_and_leave_the_matcher_working(compiler):
    """A draft model or head can propose an id the tokenizer does not have (the trunk's vocabulary
    is wider): it is refused there, and the matcher stays usable (llguidance errors for good)."""
    constraint = compiler.compile(Grammar.lark(LOOP_GRAMMAR))
    assert constraint.legal_prefix(encode("ab") + [37, 0]) == 2 and constraint.legal_prefix([35]) == 0
    assert np.array(constraint.block_masks(encode("a") + [37]))[2].all()  # after it: never used
    constraint.commit(encode("ab"))
    assert not constraint.stopped and np.array(constraint.mask_after())[: len("abcde")].all()
