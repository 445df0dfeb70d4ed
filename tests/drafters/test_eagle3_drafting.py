"""EAGLE-3 drafting in the one cycle (`spec_decode.eagle3_proposer`), on a tiny replica in the
speculators layout with a reduced draft vocabulary (``d2t``).

- Every draft's logits, cycle after cycle for rows of different lengths in one batch (the
  chain rolled back each cycle), equal mlx-vlm 0.7.10's own ``Eagle3DraftModel`` run afresh on
  the row's committed text (its taps from the trunk's full forward, its chain on its own hidden),
  on the draft vocabulary placed through the file's ``d2t``; -inf off it.
- Greedy drafting equals plain AR token for token with drafts kept; one context forward per
  cycle for all rows and one chain step per further draft (counted).
- Sampled at t 0.7 (and, slow, t 1.0) with top-p, the first tokens' joint equals the exact AR joint (float64
  enumeration) by chi-square, in a batch mixing EAGLE-3, lookup-then-EAGLE-3 and plain AR rows
  (the draft vocabulary lacks one of the 8 ids: it comes from the residual alone); the shared
  planted bug (the rejected draft committed) is caught with 80 EAGLE-3 rows.
"""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.eagle3_proposer import Eagle3Proposer
from mtplx.spec_decode.rows import RowSpec
from mtplx.spec_decode.settings import DecodeSettings
from mtplx.spec_decode.sources import Source

import mlx.core as mx
import numpy as np
import pytest
from support import drafters, exactness
from support.block_drafting import TARGET_LAYERS, decode_rows, load_eagle3_replica

VOCAB = 16
GREEDY = SamplerConfig(temperature=0.0)
PROMPTS = [[1, 2, 3, 4, 5], [3, 1, 4, 1, 5, 9, 2], [7, 7, 7]]
KEPT_SEED = 0  # a replica seed whose random drafts the tiny target sometimes keeps


@pytest.fixture(scope="module")
def trunk():
    return drafters.tiny_target(0, TARGET_LAYERS, VOCAB)


def _mlx_vlm_drafter(path, trunk):
    from mlx_vlm.speculative.drafters.eagle3 import Eagle3DraftModel
    from mlx_vlm.speculative.drafters.eagle3 import ModelConfig as Eagle3Config

    model = Eagle3DraftModel(Eagle3Config.from_dict(json.loads((path / "config.json").read_text())))
    model.load_weights(list(model.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    model.set_dtype(mx.float32)
    return model.bind(trunk.model)


def _mlx_vlm_logits(model, layers, trunk, history: list[int], drafts: list[int]) -> np.ndarray:
    """mlx-vlm's drafter, fresh on one row: its context is every committed pair (token p + 1,
    taps of p, the taps of the trunk with later layers silenced) up to the pending token, then
    one chained step per draft; the draft-vocabulary logits of the first draft and of each
    chained step, [len(drafts) + 1, Vd]."""
    model._cache, model._next_position = model.make_cache(), 1
    taps = drafters.silenced_taps(trunk, mx.array([history[:-1]]), layers)
    joined = mx.array(np.concatenate(taps, axis=-1).astype(np.float32))
    hidden = model._forward_tokens(mx.array([history[1:]]), joined, mx.int32)[:, -1:]
    out = [model._logits(hidden)]
    for token in drafts:
        hidden = model._forward_tokens(mx.array([[token]]), hidden, mx.int32)
        out.append(model._logits(hidden))
    return np.array(mx.concatenate(out, axis=1)[0])


def test_every_draft_equals_mlx_vlms_drafter_on_the_committed_text(trunk, tmp_path, monkeypatch):
    """Greedy, three rows of different lengths in one batch for 12 tokens: at each cycle each
    drafting row's draft logits equal mlx-vlm's drafter rerun from scratch on its text."""
    loaded = load_eagle3_replica(tmp_path, VOCAB, seed=KEPT_SEED)
    calls = []
    propose, target_logits = Eagle3Proposer.propose, Eagle3Proposer._target_logits

    def recorded_propose(self, rows, keys, most):
        calls.append({"logits": [], "history": {r.row_id: list(r.history) for r in rows}})
        block = propose(self, rows, keys, most)
        calls[-1]["members"] = list(self.row_ids)
        drafts = np.array(block.tokens).tolist()
        calls[-1]["drafts"] = {r.row_id: drafts[i][: block.lengths[i]] for i, r in enumerate(rows)}
        return block

    def recorded_logits(self, hidden):
        out = target_logits(self, hidden)
        calls[-1]["logits"].append(np.array(out))
        return out

    monkeypatch.setattr(Eagle3Proposer, "propose", recorded_propose)
    monkeypatch.setattr(Eagle3Proposer, "_target_logits", recorded_logits)
    spec = RowSpec(DecodeSettings(sampler=GREEDY), (Source.EAGLE3,))
    _, accepted = decode_rows(trunk, PROMPTS, [spec] * len(PROMPTS), 12, blocks=loaded)
    assert sum(accepted) > 0, "no draft kept: the rollback after a kept draft goes untested"
    model = _mlx_vlm_drafter(tmp_path, trunk)
    config = json.loads((tmp_path / "config.json").read_text())
    layers = [max(i - 1, 0) for i in config["eagle_aux_hidden_state_layer_ids"]]
    weights = drafters.published_float64(tmp_path)
    targets = np.arange(len(weights["d2t"])) + weights["d2t"].astype(np.int64)
    off = np.setdiff1d(np.arange(VOCAB), targets)
    assert len(calls) > 3
    for call in calls:
        for m, row_id in enumerate(call["members"]):
            drafts = call["drafts"][row_id]
            ours = np.stack([step[m] for step in call["logits"]])[: len(drafts)]
            theirs = _mlx_vlm_logits(model, layers, trunk, call["history"][row_id], drafts[:-1])
            np.testing.assert_allclose(ours[:, targets], theirs, atol=1e-4, rtol=0)
            assert np.isneginf(ours[:, off]).all()


def test_greedy_eagle3_drafting_equals_ar_with_one_context_forward_per_cycle(trunk, tmp_path):
    n = 16
    ar, _ = decode_rows(trunk, PROMPTS, [RowSpec(DecodeSettings(sampler=GREEDY))] * len(PROMPTS), n)
    decoders = []
    spec = RowSpec(DecodeSettings(sampler=GREEDY), (Source.EAGLE3,))
    loaded = load_eagle3_replica(tmp_path, VOCAB, seed=KEPT_SEED)
    cycles = []

    def count(decoder) -> None:
        step = decoder.step

        def counted_step():
            cycles.append(len(decoder.rows))
            return step()

        decoder.step = counted_step
        decoders.append(decoder)

    got, accepted = decode_rows(trunk, PROMPTS, [spec] * len(PROMPTS), n, blocks=loaded, on_decoder=count)
    assert got == ar
    assert sum(accepted) > 0, "no draft kept"
    proposer = decoders[0].blocks
    assert proposer.forwards == len(cycles), "one context forward per cycle, over every row decoding"
    width = proposer.max_drafts
    assert proposer.chain_steps == (width - 1) * len(cycles), "one chain step per draft after the first"


CHI_VOCAB = 8  # the joint of the first 3 tokens has 512 cells; the draft vocabulary holds 7


def _first_tokens(trunk, loaded, cfg: SamplerConfig, samples: int, mixed: bool) -> np.ndarray:
    """The first tokens of ``samples`` rows (seeds 0..) in one batch (``mixed``: taking turns
    drafting with EAGLE-3, with lookup then EAGLE-3, and not at all; else all EAGLE-3)."""
    settings = DecodeSettings(sampler=cfg)
    kinds = [(Source.EAGLE3,), (Source.LOOKUP, Source.EAGLE3), ()] if mixed else [(Source.EAGLE3,)]
    specs = [RowSpec(settings, kinds[i % len(kinds)]) for i in range(samples)]
    tokens, accepted = decode_rows(
        trunk,
        [exactness.PROMPT] * samples,
        specs,
        exactness.NUM_OUTPUT_TOKENS,
        seeds=range(samples),
        blocks=loaded,
    )
    assert sum(accepted) > samples // 10, "too few drafts kept to test their verification"
    counts = np.zeros([CHI_VOCAB] * exactness.NUM_OUTPUT_TOKENS, dtype=np.int64)
    for row in tokens:
        counts[tuple(row)] += 1
    return counts


@pytest.mark.parametrize("temperature", [0.7, pytest.param(1.0, marks=pytest.mark.slow)])
def test_sampled_eagle3_drafting_matches_the_exact_ar_joint(tmp_path, monkeypatch, temperature):
    """Top-p 0.9, 150 rows in one batch (a third each EAGLE-3, lookup-then-EAGLE-3 and plain AR);
    at t 0.7 the shared planted bug (the rejected draft committed in place of the residual's
    token) is caught with 80 EAGLE-3 rows (p ~ 1e-11 there; 1e-4 at 40, 2e-7 at 60); t 1.0 under
    `make test-slow`."""
    trunk = drafters.tiny_target(0, TARGET_LAYERS, CHI_VOCAB)
    cfg = SamplerConfig(temperature=temperature, top_p=0.9)
    # A flat q (its final norm scaled by 0.3): the tiny target keeps many of its drafts.
    loaded = load_eagle3_replica(tmp_path, CHI_VOCAB, seed=1, sharpen=0.3)
    expected = exactness.exact_ar_joint(trunk, cfg, CHI_VOCAB)
    p = exactness.loop_p_value(_first_tokens(trunk, loaded, cfg, 150, mixed=True), expected)
    assert p > exactness.FALSE_FAILURE_RATE, f"t {temperature}: p = {p:.3g}"
    if temperature != 0.7:
        return
    exactness.plant_commit_rejected_draft(monkeypatch)
    p_planted = exactness.loop_p_value(_first_tokens(trunk, loaded, cfg, 80, mixed=False), expected)
    assert p_planted < exactness.FALSE_FAILURE_RATE, f"planted bug not caught: p = {p_planted:.3g}"


def test_a_grammar_allowing_only_ids_off_the_draft_vocabulary_still_drafts(tmp_path, tmp_path_factory):
    """A grammar row whose mask allows only target ids the draft vocabulary lacks: its first draft
    is drawn uniformly among what the mask allows (`masked_draft_logits`), not from a NaN that
    would fail the row (sampled at t 1); greedy, it gives the grammar's AR tokens."""
    from mtplx.engine.grammar import GrammarCompiler
    from mtplx.engine.grammar_spec import Grammar

    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from support.tokenizer import CHATML_CHARS, chatml_chars

    vocab = 40
    trunk = drafters.tiny_target(0, TARGET_LAYERS, vocab)
    loaded = load_eagle3_replica(tmp_path, vocab, seed=KEPT_SEED)
    d2t = np.array(loaded.drafter.d2t)
    off = sorted(set(range(26)) - set((np.arange(len(d2t)) + d2t).tolist()))  # letters, ids 0..25
    assert len(off) >= 2, off
    chars = tmp_path_factory.mktemp("chatml")
    chatml_chars(chars)
    compiler = GrammarCompiler(load_tokenizer(chars), vocab)
    grammar = Grammar.lark(f"start: /[{''.join(CHATML_CHARS[i] for i in off)}]{{10}}/")
    prompt = [CHATML_CHARS.index(c) for c in "ab,ab c."]
    decoders = []
    sampled = SamplerConfig(temperature=1.0)
    specs = [
        RowSpec(DecodeSettings(sampler=GREEDY)),
        RowSpec(DecodeSettings(sampler=GREEDY), (Source.EAGLE3,)),
        RowSpec(DecodeSettings(sampler=sampled), (Source.EAGLE3,)),
    ]
    got = [
        decode_rows(
            trunk,
            [prompt],
            [spec],
            10,
            blocks=loaded,
            constraints=[compiler.compile(grammar)],
            on_decoder=decoders.append,
        )[0][0]
        for spec in specs
    ]
    assert got[0] == got[1] and set(got[2]) <= set(off)
    assert decoders[1].blocks.forwards > 0 and decoders[2].blocks.forwards > 0


def test_an_eagle3_cycle_syncs_the_host_once(trunk, tmp_path):
    """Two sampled EAGLE-3 rows: drafting (context forward, chain, rollback), verify and commit
    add no host sync to the cycle's one."""
    from mtplx.spec_decode.loop import BatchDecoder

    from support.sync_counter import counting_syncs

    decoder = BatchDecoder(trunk, blocks=load_eagle3_replica(tmp_path, VOCAB, seed=KEPT_SEED))
    spec = RowSpec(DecodeSettings(sampler=SamplerConfig(temperature=0.7)), (Source.EAGLE3,))
    for i, prompt in enumerate(PROMPTS[:2]):
        decoder.join(prompt, spec, mx.random.key(i))
    decoder.step()  # the rows' first cycle also evaluates the copies that moved them in
    with counting_syncs() as counter:
        for _ in range(4):
            decoder.step()
    assert counter.syncs == 4 and decoder.blocks.forwards == 5
