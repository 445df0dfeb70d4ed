"""Block drafters (DFlash, DFlash2, DSpark) drafting in the one cycle (`spec_decode.block_proposer`).

- The batched block forward (rows of different context lengths on one `RaggedKVCache`) equals
  the float64 NumPy oracle row by row (the single-row path is checked against mlx-vlm 0.7.10 in
  `test_dflash.py` / `test_dflash2.py`).
- Greedy drafting with each drafter equals plain AR token for token, with drafts kept, for
  several rows in one batch; the block forward runs once per cycle for all of them (counted).
- Sampled at t 0.7 and t 1.0 with top-p (each drafter at both: DFlash2 at t 0.7 and DSpark at
  t 1.0 under `make test-slow`), the first tokens' joint equals the exact AR joint (float64
  enumeration) by chi-square; a planted bug (the rejected draft committed) is caught with the
  same samples, and (slow) each draft verified against the q of the next position.
- Greedy, a batch mixing DFlash, head, lookup, grammar and plain AR rows gives each row its own.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.drafters.dflash import dflash_block_logits, load_dflash
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.block_proposer import BlockProposer
from mtplx.spec_decode.draft_block import pad_time
from mtplx.spec_decode.rows import RowSpec
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.spec_decode.sources import Source
from mtplx.trunk.batch_cache import RaggedKVCache

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, exactness, seeds
from support.block_drafting import LAYER_IDS, TARGET_LAYERS, decode_rows, load_replica
from support.seeds import SEEDS

VOCAB = 16
GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 9, 2], [7, 7, 7], [2, 9, 6, 5, 3, 5, 8, 9, 7, 9, 3]]


@pytest.fixture(scope="module")
def trunk():
    return drafters.tiny_target(0, TARGET_LAYERS, VOCAB)


@pytest.mark.parametrize("seed", [SEEDS[0], SEEDS[2]])
def test_batched_block_forward_equals_the_float64_oracle_per_row(tmp_path, seed):
    """Rows holding 3, 7 and 5 context positions, then 2, 0 and 4 new ones, in one forward."""
    seed = seeds.resolve(seed)
    trunk = drafters.tiny_target(seed, TARGET_LAYERS, VOCAB)
    config = drafters.dflash_config(VOCAB, LAYER_IDS, TARGET_LAYERS)
    path = drafters.write_dflash(tmp_path, config, drafters.dflash_tensors(config, seed=seed))
    drafter = load_dflash(path)
    drafter.set_dtype(mx.float32)
    trunk.tap_layers(drafter.target_layer_ids)
    rng = np.random.default_rng(seed)
    held, new = [3, 7, 5], [2, 0, 4]
    rows = [rng.integers(0, VOCAB, h + n + 1).tolist() for h, n in zip(held, new)]
    cache = [RaggedKVCache() for _ in drafter.layers]
    singles = []
    for tokens, h in zip(rows, held):
        single = drafter.make_cache()
        drafter.extend_context(trunk(mx.array([tokens[:h]]), None).layer_hidden, single)
        singles.append(single)
    for n, layer in enumerate(cache):
        layer.add_rows([s[n] for s in singles])
    taps = [trunk(mx.array([t[: h + n]]), None).layer_hidden for t, h, n in zip(rows, held, new)]
    new_taps = [
        mx.concatenate([pad_time(t[i][:, h : h + n], max(new)) for t, h, n in zip(taps, held, new)])
        for i in range(len(LAYER_IDS))
    ]
    last = mx.array([t[h + n] for t, h, n in zip(rows, held, new)])
    block = drafter.block_tokens(last, config["block_size"])
    ours = np.array(
        dflash_block_logits(drafter, block, new_taps, cache, trunk.embed, trunk.lm_head, 1.0, new)
    )
    weights = drafters.published_float64(path)
    embed = np.array(trunk.model.model.embed_tokens.weight).astype(np.float64)
    head = np.array(trunk.model.lm_head.weight).astype(np.float64)
    for r in range(len(rows)):
        row_taps = np.concatenate([np.array(x[0]).astype(np.float64) for x in taps[r]], axis=-1)
        expected = drafters.dflash_logits(weights, config, row_taps, np.array(block[r]), embed, head)
        np.testing.assert_allclose(ours[r], expected, atol=1e-4, rtol=0, err_msg=f"row {r} seed {seed}")
    assert cache[0].lengths == [h + n for h, n in zip(held, new)]


# Replica seeds whose random drafts the tiny target sometimes keeps (greedy acceptance of random
# weights is low: a test of kept drafts needs some).
KEPT = {Source.DFLASH: 5, Source.DFLASH2: 6, Source.DSPARK: 7}


@pytest.mark.parametrize("kind", [Source.DFLASH, Source.DFLASH2, Source.DSPARK])
def test_greedy_block_drafting_equals_ar_with_one_block_forward_per_cycle(trunk, tmp_path, kind):
    n, prompts = 16, PROMPTS[:3]
    spec = RowSpec(DecodeSettings(sampler=GREEDY), (kind,))
    ar, _ = decode_rows(trunk, prompts, [RowSpec(DecodeSettings(sampler=GREEDY))] * len(prompts), n)
    forwards, cycles = [], []

    def count(decoder) -> None:
        forward, step = decoder.blocks._forward, decoder.step

        def counted_forward(rows):
            forwards.append(len(rows))
            return forward(rows)

        def counted_step():
            cycles.append(len(decoder.rows))
            return step()

        decoder.blocks._forward, decoder.step = counted_forward, counted_step

    loaded = load_replica(kind, tmp_path, VOCAB, seed=KEPT[kind])
    got, accepted = decode_rows(trunk, prompts, [spec] * len(prompts), n, blocks=loaded, on_decoder=count)
    assert got == ar, kind
    assert sum(accepted) > 0, f"{kind}: no draft kept"
    assert forwards == cycles, "one block forward per cycle, over every row decoding"
    assert forwards[0] == len(prompts)


CHI_VOCAB = 8  # the joint of the first 3 tokens has 512 cells


def _first_tokens(trunk, loaded, cfg: SamplerConfig, samples: int, mixed: bool = False) -> np.ndarray:
    """The first tokens of ``samples`` rows (seeds 0..), decoded together in one batch; ``mixed``:
    the rows take turns drafting with the block drafter, with lookup then it, and not at all
    (every row's law is plain AR's whatever drafts for it)."""
    settings = DecodeSettings(sampler=cfg)
    kinds = [(loaded.source,), (Source.LOOKUP, loaded.source), ()] if mixed else [(loaded.source,)]
    specs = [RowSpec(settings, kinds[i % len(kinds)]) for i in range(samples)]
    prompts = [exactness.PROMPT] * samples
    tokens, accepted = decode_rows(
        trunk, prompts, specs, exactness.NUM_OUTPUT_TOKENS, seeds=range(samples), blocks=loaded
    )
    assert sum(accepted) > samples // 10, "too few drafts kept to test their verification"
    counts = np.zeros([CHI_VOCAB] * exactness.NUM_OUTPUT_TOKENS, dtype=np.int64)
    for row in tokens:
        counts[tuple(row)] += 1
    return counts


def _plant_wrong_position_q(monkeypatch) -> None:
    """Each draft verified against the q of the next position (the last against its own)."""
    honest = BlockProposer._block

    def shifted(self, rows, index, most, width, drafts, probs, confidence, flags):
        return honest(self, rows, index, most, width, drafts, probs[1:] + probs[-1:], confidence, flags)

    monkeypatch.setattr(BlockProposer, "_block", shifted)


@pytest.fixture(scope="module")
def chi_trunk():
    return drafters.tiny_target(0, TARGET_LAYERS, CHI_VOCAB)


@pytest.mark.parametrize(
    "kind, temperature, mixed",
    [
        (Source.DFLASH, 0.7, True),
        (Source.DFLASH, 1.0, False),
        (Source.DFLASH2, 1.0, False),
        (Source.DSPARK, 0.7, False),
        # Each drafter at the other temperature too (the default suite has one of each).
        pytest.param(Source.DFLASH2, 0.7, False, marks=pytest.mark.slow),
        pytest.param(Source.DSPARK, 1.0, True, marks=pytest.mark.slow),
    ],
)
def test_sampled_block_drafting_matches_the_exact_ar_joint(
    chi_trunk, tmp_path, kind, temperature, mixed, monkeypatch
):
    """150 rows in one batch (``mixed``: a third each block, lookup-then-block and plain AR rows);
    with DFlash at t 1.0 the shared planted bug (the rejected draft committed in place of the
    residual's token) is caught with as many samples."""
    cfg = SamplerConfig(temperature=temperature, top_p=0.9)
    loaded = load_replica(kind, tmp_path, CHI_VOCAB, seed=5)
    expected = exactness.exact_ar_joint(chi_trunk, cfg, CHI_VOCAB)
    p = exactness.loop_p_value(_first_tokens(chi_trunk, loaded, cfg, 150, mixed), expected)
    assert p > exactness.FALSE_FAILURE_RATE, f"t {temperature}: p = {p:.3g}"
    if kind is Source.DFLASH and temperature == 1.0:
        exactness.plant_commit_rejected_draft(monkeypatch)
        p_planted = exactness.loop_p_value(_first_tokens(chi_trunk, loaded, cfg, 150), expected)
        assert p_planted < exactness.FALSE_FAILURE_RATE, f"planted bug not caught: p = {p_planted:.3g}"


@pytest.mark.slow
def test_a_q_of_the_wrong_position_is_caught(chi_trunk, tmp_path, monkeypatch):
    """DSpark (its q differ by position through the Markov term): honest passes, and verifying each
    draft against the next position's q is caught (DFlash's mask positions have nearly equal q,
    so there the same plant moves the distribution too little to see with any affordable count)."""
    cfg = SamplerConfig(temperature=1.0, top_p=0.9)
    loaded = load_replica(Source.DSPARK, tmp_path, CHI_VOCAB, sharpen=4.0)
    expected = exactness.exact_ar_joint(chi_trunk, cfg, CHI_VOCAB)
    p = exactness.loop_p_value(_first_tokens(chi_trunk, loaded, cfg, 1000), expected)
    assert p > exactness.FALSE_FAILURE_RATE, f"p = {p:.3g}"
    _plant_wrong_position_q(monkeypatch)
    p_planted = exactness.loop_p_value(_first_tokens(chi_trunk, loaded, cfg, 1000), expected)
    assert p_planted < exactness.FALSE_FAILURE_RATE, (
        f"q of the wrong position not caught: p = {p_planted:.3g}"
    )


@pytest.mark.parametrize("kind", [Source.DFLASH, Source.EAGLE3])
def test_a_batch_mixing_block_head_lookup_grammar_and_ar_rows_gives_each_row_its_own(
    tmp_path, tmp_path_factory, kind
):
    """Greedy: DFlash (or EAGLE-3) rows (one with a grammar), head rows (one with a grammar), a
    lookup row and a plain AR row in one batch each give the tokens they give alone; the DFlash
    (EAGLE-3) rows draft. EAGLE-3's draft vocabulary lacks some ids the grammar allows: a grammar
    row's first draft comes from its mask over what remains, or over the missing ids alone."""
    from mtplx.engine.grammar import GrammarCompiler
    from mtplx.engine.grammar_spec import Grammar

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from support.models import make_loop_pair
    from support.tokenizer import CHATML_CHARS, chatml_chars

    vocab = 40
    trunk, head = make_loop_pair(vocab_size=vocab, seed=0, context_strength=6.0, head_noise=2.0)
    loaded = load_replica(kind, tmp_path, vocab, seed=5, layer_ids=[0, 1], target_layers=2)
    chars = tmp_path_factory.mktemp("chatml")
    chatml_chars(chars)
    compiler = GrammarCompiler(load_tokenizer(chars), vocab)
    grammar = "start: /[abc]([ab][abcd]){24}/"
    text = [CHATML_CHARS.index(c) for c in "ab,ab c. abab abab"]
    plain = RowSpec(DecodeSettings(sampler=GREEDY))
    block, lookup = (
        RowSpec(DecodeSettings(sampler=GREEDY), (kind,)),
        RowSpec(plain.settings, (Source.LOOKUP,)),
    )
    heads = RowSpec(DecodeSettings(sampler=GREEDY, depth=2), (Source.HEAD,))
    rows = [(block, None), (heads, None), (lookup, None), (plain, None), (block, grammar), (heads, grammar)]
    prompts = [text[i:] for i in range(len(rows))]

    def constraints(chosen):
        return [compiler.compile(Grammar.lark(g)) if g else None for _, g in chosen]

    n = 14
    decoders = []
    together, _ = decode_rows(
        trunk,
        prompts,
        [s for s, _ in rows],
        n,
        head=head,
        blocks=loaded,
        constraints=constraints(rows),
        on_decoder=decoders.append,
    )
    for i, row in enumerate(rows):
        alone, _ = decode_rows(
            trunk, prompts[i : i + 1], [row[0]], n, head=head, blocks=loaded, constraints=constraints([row])
        )
        assert together[i] == alone[0], f"row {i} ({row[0].sources}, grammar {row[1] is not None})"
    # The block drafter's rows drafted (whether the tiny target keeps any depends on
    # make_loop_pair's weights, which differ between its first call in a process and later ones).
    assert decoders[0].blocks.forwards > 0


def test_dspark_confidence_cuts_an_adaptive_rows_block(trunk, tmp_path, monkeypatch):
    """An adaptive row (threshold 0.5) drafts up to and including the first position DSpark's
    confidence head is unsure of, cycle by cycle; greedy output stays AR's."""
    from mtplx.spec_decode.loop import BatchDecoder

    loaded = load_replica(Source.DSPARK, tmp_path, VOCAB, seed=KEPT[Source.DSPARK])
    seen = []
    propose = BlockProposer.propose

    def recorded(self, rows, keys, most):
        block = propose(self, rows, keys, most)
        seen.append(np.array(block.confidence[0, : block.lengths[0]]).tolist())
        return block

    monkeypatch.setattr(BlockProposer, "propose", recorded)
    threshold = 0.5
    spec = RowSpec(DecodeSettings(sampler=GREEDY, adaptive_threshold=threshold), (Source.DSPARK,))
    decoder = BatchDecoder(trunk, blocks=loaded)
    row_id, first = decoder.join(PROMPTS[1], spec, mx.random.key(0))
    tokens, drafted = list(first.tokens), []
    while len(tokens) < 16:
        step = decoder.step()[row_id]
        tokens += step.tokens
        drafted.append(step.num_drafted)
    expected = []
    for sure in seen:
        unsure = [j for j, s in enumerate(sure[:-1]) if s < threshold]
        expected.append(unsure[0] + 1 if unsure else len(sure))
    assert drafted == expected, (drafted, seen)
    assert min(expected) < loaded.drafter.dspark.proposal_length, "no block was cut: the test needs one"
    ar, _ = decode_rows(trunk, PROMPTS[1:2], [RowSpec(DecodeSettings(sampler=GREEDY))], len(tokens))
    assert tokens == ar[0]


@pytest.mark.parametrize("kind", [Source.DFLASH, Source.EAGLE3])
def test_the_cost_profile_times_the_drafters_forward(trunk, tmp_path, kind, monkeypatch):
    """`measure_cost_profile` with a block drafter: DFlash's block forward once per drafting
    cycle (``block_*``), EAGLE-3's chain step per draft (``head_*``, the trunk having no head).
    What ran is counted, not timed: the drafter's forward of one new position over each row count
    measured, a warm-up call and ``repeats`` timed ones."""
    from mtplx.drafters import eagle3
    from mtplx.spec_decode import block_proposer
    from mtplx.spec_decode.draft_policy import measure_cost_profile

    ran: list[tuple[int, int]] = []  # (rows, new positions) of each drafter forward
    block_forward, chain_forward = block_proposer.block_forward, eagle3.eagle3_forward

    def counted_block(drafter, source, trunk, anchor, taps, cache, counts):
        ran.append((len(counts), counts[0]))
        return block_forward(drafter, source, trunk, anchor, taps, cache, counts)

    def counted_chain(drafter, tokens, *args, **kw):
        ran.append(tuple(tokens.shape))
        return chain_forward(drafter, tokens, *args, **kw)

    monkeypatch.setattr(block_proposer, "block_forward", counted_block)
    monkeypatch.setattr(eagle3, "eagle3_forward", counted_chain)
    loaded = load_replica(kind, tmp_path, VOCAB)
    profile = measure_cost_profile(trunk, max_tokens=2, max_rows=2, context=4, repeats=1, blocks=loaded)
    timed, untimed = ("block", "head") if kind is Source.DFLASH else ("head", "block")
    assert getattr(profile, f"{timed}_rows") == (1, 2) and len(getattr(profile, f"{timed}_seconds")) == 2
    assert sorted(ran) == [(1, 1), (1, 1), (1, 4), (2, 1), (2, 1), (2, 4)]  # + each row count's context
    assert getattr(profile, f"{untimed}_rows") == () and getattr(profile, f"{untimed}_seconds") == ()
