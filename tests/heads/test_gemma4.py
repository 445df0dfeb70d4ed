"""Gemma 4 assistant drafters: the forward against a NumPy float64 reference and mlx-vlm, the
MTP loop against AR (greedy identity, sampled distribution, caches after rollbacks, including
a wrapped sliding window and KV-shared target layers), pairing and bad input."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import types
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.heads import gemma4_assistant as ga
from mtplx.sampling import SamplerConfig
from mtplx.spec_decode import settings as decode
from mtplx.trunk import rollback as cache_ops
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache
from mlx_lm.utils import load_model as mlx_load_model
from support import checkpoints, gemma4_ref
from support.decoding import mtp_decode, sample_until_rollbacks
from support.exactness import (
    FALSE_FAILURE_RATE,
    PROMPT,
    exact_ar_joint,
    loop_p_value,
    plant_commit_rejected_draft,
    run_loop,
    run_mtp_steps,
    sample_counts,
)
from support.hub import cache_layout
from support.models import GEMMA4_WINDOW, HIDDEN, gemma4_config
from support.paths import REPO
from support.tokenizer import word_level

# The float64 reference of the assistant's forward is ``support.gemma4_ref`` (read by
# ``test_reference_coverage.py``).
REFERENCE_LAYOUTS = ("gemma4_assistant",)


def build_pair(tmp_path: Path, *, vocab_size=64, ordered=False, num_centroids=8, top_k=2, fill="floor", **kw):
    target_kw = {k: kw.pop(k) for k in ("context_strength",) if k in kw}
    target = checkpoints.gemma4_target(
        tmp_path / "gemma-4-tiny", vocab_size, seed=kw.pop("target_seed", 0), **target_kw
    )
    assistant = checkpoints.gemma4_assistant(
        tmp_path / "gemma-4-tiny-assistant",
        vocab_size,
        ordered=ordered,
        num_centroids=num_centroids,
        top_k=top_k,
        **kw,
    )
    model, config = mlx_load_model(target.path)
    trunk = Trunk(model)
    head = ga.load_gemma4_assistant(assistant.path, trunk, config, non_candidate_fill=fill)
    return trunk, head, target, assistant


# ---------------------------------------------------------------- forward vs the reference


def _full_kv(trunk: Trunk, tokens: list[int]) -> list[KVCache]:
    """Every key/value of every cache-owning layer, from a from-scratch run with plain KV caches."""
    caches = [KVCache() for _ in trunk.make_cache()]
    trunk(mx.array(tokens)[None], caches)
    return caches


def _reference_kv(full: list[KVCache], head, position: int, window: int) -> dict:
    kv = {}
    for kind, i in head.source_layers.items():
        k = np.array(full[i].keys[0, :, : position + 1])
        v = np.array(full[i].values[0, :, : position + 1])
        if kind == "sliding_attention":
            k, v = k[:, -window:], v[:, -window:]
        kv[kind] = (k, v)
    return kv


def _advance(trunk: Trunk, tokens: list[int], how: str, rng) -> tuple[list, list[int], mx.array]:
    """Caches over ``tokens`` reached in different ways; returns (cache, committed tokens, last hidden)."""
    cache = trunk.make_cache()
    if how == "prefill":  # one multi-token update: the rotating buffer holds everything, in order
        out = trunk(mx.array(tokens)[None], cache)
        return cache, tokens, out.hidden_post_norm[:, -1:]
    if how == "one_by_one":  # in-place single-token updates: the window is rotated in its buffer
        for t in tokens:
            out = trunk(mx.array([[t]]), cache)
        return cache, tokens, out.hidden_post_norm[:, -1:]
    # "verify": a prefill, then blocks of 4 committed with random prefixes (rollbacks after wrapping)
    committed = tokens[:5]
    trunk(mx.array(committed)[None], cache)
    out = None
    while len(committed) < len(tokens):
        block = [int(x) for x in rng.integers(0, trunk.vocab_size, 4)]
        capture = cache_ops.begin_block(cache, block_len=4)
        out = trunk(mx.array(block)[None], cache)
        keep = int(rng.integers(1, 5))
        cache_ops.commit_block(cache, capture, keep)
        committed = committed + block[:keep]
        hidden = out.hidden_post_norm[:, keep - 1 : keep]
    return cache, committed, hidden


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-vocab", "ordered-embeddings"])
@pytest.mark.parametrize("how", ["prefill", "one_by_one", "verify"])
@pytest.mark.parametrize("seed", [0, None], ids=["fixed", "fresh"])
def test_assistant_forward_matches_the_numpy_reference(tmp_path, ordered, how, seed):
    trunk, head, target, assistant = build_pair(tmp_path, ordered=ordered)
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = np.random.default_rng(seed)
    tokens = [int(x) for x in rng.integers(0, 64, 21)]
    cache, committed, hidden = _advance(trunk, tokens, how, rng)
    position = len(committed) - 1
    assert position + 1 > GEMMA4_WINDOW  # the sliding window has wrapped
    token = int(rng.integers(0, 64))
    out = head(hidden, mx.array([[token]]), head.make_cache(), trunk_cache=cache)
    logits = head.logits(out)
    projected = head.chain_input(out)

    full = _full_kv(trunk, committed)
    embedding = np.array(trunk.embed(mx.array([token]))[0], dtype=np.float64) * HIDDEN**0.5
    args = (assistant.tensors, assistant.config, embedding, np.array(hidden[0, 0], dtype=np.float64))
    ref_h, ref_proj, ref_logits = gemma4_ref.reference_forward(
        *args, _reference_kv(full, head, position, GEMMA4_WINDOW), position
    )
    np.testing.assert_allclose(np.array(out[0, 0]), ref_h, atol=2e-4, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.array(projected[0, 0]), ref_proj, atol=2e-4, err_msg=f"seed={seed}")
    np.testing.assert_allclose(np.array(logits[0, 0]), ref_logits, atol=2e-4, err_msg=f"seed={seed}")

    # Negative controls: one key too few in the window (mlx-vlm's wrapped-window reading) or the
    # query one position late is visibly different.
    short = gemma4_ref.reference_forward(
        *args, _reference_kv(full, head, position, GEMMA4_WINDOW - 1), position
    )[0]
    late = gemma4_ref.reference_forward(
        *args, _reference_kv(full, head, position, GEMMA4_WINDOW), position + 1
    )[0]
    assert np.abs(short - ref_h).max() > 1e-2 and np.abs(late - ref_h).max() > 1e-2


def _import_mlx_vlm_drafter():
    """mlx-vlm's drafter modules without running mlx_vlm/__init__ (which imports its whole
    generation stack); None only when mlx-vlm is not installed (an installed one that fails to
    import fails the test)."""
    spec = importlib.util.find_spec("mlx_vlm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    saved = {k: v for k, v in sys.modules.items() if k == "mlx_vlm" or k.startswith("mlx_vlm.")}
    for name in ("", ".models", ".models.gemma4", ".speculative", ".speculative.drafters"):
        pkg = types.ModuleType("mlx_vlm" + name)
        pkg.__path__ = [str(root / name[1:].replace(".", "/"))]
        sys.modules["mlx_vlm" + name] = pkg
    try:
        return importlib.import_module("mlx_vlm.speculative.drafters.gemma4_assistant")
    finally:
        for k in [k for k in sys.modules if k == "mlx_vlm" or k.startswith("mlx_vlm.")]:
            sys.modules.pop(k)
        sys.modules.update(saved)


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-vocab", "ordered-embeddings"])
def test_assistant_forward_matches_mlx_vlm(tmp_path, ordered):
    """mlx-vlm 0.7.10's Gemma4AssistantDraftModel on the same weights and the same target KV.
    Before the window wraps both read the same keys; after it, mlx-vlm's query sits one slot past
    the newest key and drops the oldest window key, which the float64 reference reproduces."""
    vlm = _import_mlx_vlm_drafter()
    if vlm is None:
        pytest.skip(
            "mlx-vlm is not installed (optional test-time reference: pip install --no-deps mlx-vlm==0.7.10)"
        )
    trunk, head, target, assistant = build_pair(tmp_path, ordered=ordered)
    drafter = vlm.Model(vlm.ModelConfig.from_dict(assistant.config))
    weights = {
        k: mx.array(v) for k, v in assistant.tensors.items() if "k_proj" not in k and "k_norm" not in k
    }
    drafter.load_weights(list(drafter.sanitize(weights).items()))
    drafter.bind(trunk.model.language_model)

    seed = int.from_bytes(os.urandom(4), "little")  # fresh inputs every run, named on failure
    rng = np.random.default_rng(seed)
    # (prompt length, sliding keys handed to mlx-vlm, window its result reproduces): the whole
    # history (as after a prefill) or only the newest W keys (as its loop holds them after a
    # verify block that kept one token).
    for length, cut, window in (
        (6, None, GEMMA4_WINDOW),
        (19, None, GEMMA4_WINDOW),
        (19, GEMMA4_WINDOW, GEMMA4_WINDOW - 1),
    ):
        tokens = [int(x) for x in rng.integers(0, 64, length)]
        cache = trunk.make_cache()
        out = trunk(mx.array(tokens)[None], cache)
        hidden, token = out.hidden_post_norm[:, -1:], int(rng.integers(0, 64))
        shared = {}
        for kind, i in head.source_layers.items():
            keys, values = (
                cache[i].keys[..., : cache[i].offset, :],
                cache[i].values[..., : cache[i].offset, :],
            )
            if cut and kind == "sliding_attention":
                keys, values = keys[..., -cut:, :], values[..., -cut:, :]
            shared[kind] = (keys, values)
        drafter.set_shared_kv(shared, length, position=length - 1, kv_valid_len=length)
        embeds = mx.concatenate([trunk.embed(mx.array([[token]])) * HIDDEN**0.5, hidden], axis=-1)
        vlm_proj, vlm_logits = drafter(embeds, shared, mx.array([[length - 1]]))
        ours = head(hidden, mx.array([[token]]), [], trunk_cache=cache)
        same = np.allclose(np.array(head.logits(ours)), np.array(vlm_logits), atol=1e-4) and np.allclose(
            np.array(head.chain_input(ours)), np.array(vlm_proj), atol=1e-4
        )
        where = f"seed {seed}, length {length}, cut {cut}, tokens {tokens}, next {token}"
        assert same == (window == GEMMA4_WINDOW), where
        full = _full_kv(trunk, tokens)
        embedding = np.array(trunk.embed(mx.array([token]))[0], dtype=np.float64) * HIDDEN**0.5
        _, ref_proj, ref_logits = gemma4_ref.reference_forward(
            assistant.tensors,
            assistant.config,
            embedding,
            np.array(hidden[0, 0], dtype=np.float64),
            _reference_kv(full, head, length - 1, window),
            length - 1,
        )
        np.testing.assert_allclose(np.array(vlm_proj[0, 0]), ref_proj, atol=2e-4, err_msg=where)
        np.testing.assert_allclose(np.array(vlm_logits[0, 0]), ref_logits, atol=2e-4, err_msg=where)


# ----------------------------------------------------------------------- the MTP loop


LOOP = dict(vocab_size=8, num_centroids=4, top_k=2, scale=0.3, context_strength=3.0)


GREEDY_CASES = [(d, True, "floor", False) for d in (1, 2, 3, 4)] + [
    (2, False, "floor", False),
    (3, True, "zero_mass", True),
]


@pytest.mark.parametrize(
    "depth,ordered,fill,greedy_draft",
    GREEDY_CASES,
    ids=[
        f"d{d}-{'ordered' if o else 'dense'}-{f}{'-greedy-draft' if g else ''}" for d, o, f, g in GREEDY_CASES
    ],
)
def test_greedy_mtp_output_is_token_identical_to_ar(tmp_path, depth, ordered, fill, greedy_draft):
    trunk, head, *_ = build_pair(tmp_path, ordered=ordered, fill=fill, **LOOP)
    cfg = SamplerConfig(temperature=0.0)
    n = 40  # prompt 7 + 40 tokens: the 8-token sliding window wraps several times
    ar = run_loop(trunk, head, cfg, None, n, seed=0)
    mtp, steps = run_mtp_steps(trunk, head, cfg, depth, n, greedy_draft=greedy_draft)
    assert mtp == ar
    accepted = [s.num_accepted for s in steps if s.num_drafted]
    assert any(a > 0 for a in accepted) and any(a < depth for a in accepted), accepted


def _window_of(c, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The newest n committed entries of an mlx-lm cache, in temporal order (mlx-lm's own reordering)."""
    if isinstance(c, RotatingKVCache):
        keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
        keys, values = (
            keys[..., : min(c._idx, keys.shape[2]), :],
            values[..., : min(c._idx, values.shape[2]), :],
        )
    else:
        keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
    return np.array(keys[..., -n:, :]), np.array(values[..., -n:, :])


def assert_caches_match_a_from_scratch_run(tmp_path, depth: int) -> None:
    trunk, head, *_ = build_pair(tmp_path, ordered=True, **LOOP)
    trunk_cache = trunk.make_cache()
    seed = int.from_bytes(os.urandom(4), "little")  # a fresh run every time, named on failure
    steps = mtp_decode(
        trunk,
        head,
        PROMPT,
        decode.DecodeSettings(sampler=SamplerConfig(temperature=1.0), depth=depth),
        mx.random.key(seed),
        trunk_cache=trunk_cache,
    )
    generated, _ = sample_until_rollbacks(steps, 3 * GEMMA4_WINDOW)
    committed = PROMPT + generated[:-1]
    where = f"depth {depth}, sampling key seed {seed}"
    assert all(c.offset == len(committed) for c in trunk_cache), where
    fresh = trunk.make_cache()
    reference = trunk(mx.array(committed)[None], fresh)
    for c, f in zip(trunk_cache, fresh):
        n = min(len(committed), GEMMA4_WINDOW) if isinstance(c, RotatingKVCache) else len(committed)
        for a, e in zip(_window_of(c, n), _window_of(f, n)):
            np.testing.assert_allclose(a, e, atol=5e-5, err_msg=where)
    # The drafter reads the same keys from the rolled-back caches as from the fresh ones.
    hidden, token = reference.hidden_post_norm[:, -1:], mx.array([[generated[-1]]])
    after_loop = head(hidden, token, [], trunk_cache=trunk_cache)
    from_scratch = head(hidden, token, [], trunk_cache=fresh)
    np.testing.assert_allclose(np.array(after_loop), np.array(from_scratch), atol=5e-5, err_msg=where)


@pytest.mark.parametrize("depth", [2, 4])
def test_caches_after_random_accept_patterns_equal_a_from_scratch_run(tmp_path, depth):
    assert_caches_match_a_from_scratch_run(tmp_path, depth)


def test_cache_comparison_catches_a_loop_that_keeps_a_rejected_draft(tmp_path, monkeypatch):
    honest = cache_ops.commit_block
    monkeypatch.setattr(cache_ops, "commit_block", lambda c, cap, k: honest(c, cap, min(k + 1, 3)))
    with pytest.raises(AssertionError):
        assert_caches_match_a_from_scratch_run(tmp_path, 2)


CHI = dict(vocab_size=6, num_centroids=3, top_k=1, scale=1.0, context_strength=3.0)
# Every sample is a prefill of the 5-layer target, so the default suite runs the smallest size with
# the loader's default fill, `floor` (what users run); `make test-slow` adds q with exact zeros
# outside the candidates and the larger sizes (250, 500 and 1500 samples, depth 3). Power at 150:
# the control below fails at p < 2e-29 with 100 samples (seeds 1000, 2000, 3000; 2026-12-07) and
# at p <= 8e-45 with 150 (seeds 1234, 1000, 2000, 3000, 4000; 2026-12-07).
CHI_CASES = [
    pytest.param("zero_mass", 2, 500, marks=pytest.mark.slow),
    pytest.param("floor", 2, 150),
    pytest.param("floor", 2, 250, marks=pytest.mark.slow),
    pytest.param("floor", 2, 500, marks=pytest.mark.slow),
    pytest.param("floor", 2, 1500, marks=pytest.mark.slow),
    pytest.param("zero_mass", 3, 1500, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fill,depth,num_samples", CHI_CASES)
def test_mtp_sampled_distribution_matches_ar(tmp_path, fill, depth, num_samples):
    trunk, head, *_ = build_pair(tmp_path, ordered=True, fill=fill, **CHI)
    cfg = SamplerConfig(temperature=1.0)
    expected = exact_ar_joint(trunk, cfg, CHI["vocab_size"])
    seed0 = int.from_bytes(os.urandom(4), "little")
    counts = sample_counts(trunk, head, cfg, depth, num_samples, CHI["vocab_size"], seed0)
    p = loop_p_value(counts, expected)
    assert p > FALSE_FAILURE_RATE, f"p={p:.3g} (seed0={seed0})"


def test_chi_square_rejects_a_loop_that_commits_the_rejected_draft(tmp_path, monkeypatch):
    plant_commit_rejected_draft(monkeypatch)
    trunk, head, *_ = build_pair(tmp_path, ordered=True, **CHI)
    cfg = SamplerConfig(temperature=1.0)
    expected = exact_ar_joint(trunk, cfg, CHI["vocab_size"])
    counts = sample_counts(trunk, head, cfg, 2, 100, CHI["vocab_size"], 1234)  # p ~1e-100 at 300 (2026-12-07)
    assert loop_p_value(counts, expected) < FALSE_FAILURE_RATE


def test_outside_candidate_stats_count_the_target_tokens_the_narrowed_vocabulary_missed(tmp_path):
    """Zero-mass fill: accepted drafts are always candidates, so every target token outside a
    step's candidate set is a correction token; recount them from the steps and the head's sets."""
    trunk, head, *_ = build_pair(tmp_path, ordered=True, fill="zero_mass", **LOOP)
    recorded = []
    original = head.logits

    def logits(h, step=0):
        out = original(h, step)
        recorded.append((step, set(np.flatnonzero(np.isfinite(np.array(out[0, -1]))).tolist())))
        return out

    head.logits = logits  # instance attribute: the loop's head.logits calls go through it
    tokens, steps = run_mtp_steps(trunk, head, SamplerConfig(temperature=1.0), 2, 30)
    cycles = [recorded[i : i + 2] for i in range(0, len(recorded), 2)]
    outside = checked = 0
    for cycle, step in zip(cycles, [s for s in steps if s.num_drafted]):
        for j, token in enumerate(step.tokens[:2]):
            checked += 1
            outside += token not in cycle[j][1]
    stats = head.counters()
    # The head counts a cycle's targets when the next cycle starts: the last cycle is not counted yet.
    last = [s for s in steps if s.num_drafted][-1]
    last_checked = min(len(last.tokens), 2)
    last_outside = sum(
        t not in cycles[len([s for s in steps if s.num_drafted]) - 1][j][1]
        for j, t in enumerate(last.tokens[:2])
    )
    assert stats == {
        "target_checked": checked - last_checked,
        "target_outside_candidates": outside - last_outside,
    }
    assert stats["target_checked"] > 0


def test_a_narrowed_assistants_counters_grow_as_it_drafts_and_a_dense_one_has_none(tmp_path):
    """``counters()``, the head protocol's hook the engine reports per request: running totals
    (never reset), under the names stats report."""
    trunk, head, *_ = build_pair(tmp_path / "narrowed", ordered=True, fill="zero_mass", **LOOP)
    assert head.counters() == {"target_checked": 0, "target_outside_candidates": 0}
    run_mtp_steps(trunk, head, SamplerConfig(temperature=1.0), 2, 12)
    first = head.counters()
    assert first["target_checked"] > 0 and 0 <= first["target_outside_candidates"] <= first["target_checked"]
    run_mtp_steps(trunk, head, SamplerConfig(temperature=1.0), 2, 12)
    assert head.counters()["target_checked"] > first["target_checked"]

    trunk, dense, *_ = build_pair(tmp_path / "dense", ordered=False, **LOOP)
    run_mtp_steps(trunk, dense, SamplerConfig(temperature=1.0), 2, 12)
    assert dense.counters() == {}


# ----------------------------------------------------------------- pairing and bad input


def _write_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("text_config."):
            config["text_config"][key.split(".", 1)[1]] = value
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"backbone_hidden_size": 48}, "backbone_hidden_size 48 does not match the target's hidden_size 32"),
        ({"text_config.vocab_size": 128}, "vocab_size 128 does not match the target's vocab_size 64"),
        ({"text_config.global_head_dim": 32}, "head_dim 32, the target's full_attention KV has 16"),
        ({"text_config.sliding_window": 16}, "sliding_window 16 exceeds the target's 8"),
        ({"model_type": "gemma4_text"}, "not a Gemma 4 assistant config"),
    ],
)
def test_an_assistant_that_does_not_fit_is_a_one_line_error(tmp_path, changes, needle):
    target = checkpoints.gemma4_target(tmp_path / "t")
    assistant = checkpoints.gemma4_assistant(tmp_path / "a")
    _write_config(assistant.path, **changes)
    model, config = mlx_load_model(target.path)
    with pytest.raises(MtplxError) as err:
        ga.load_gemma4_assistant(assistant.path, Trunk(model), config)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_an_assistant_reading_a_layer_type_the_target_lacks_is_refused(tmp_path):
    from mlx_lm.models import gemma4

    config = gemma4_config(64)
    config["text_config"]["layer_types"] = ["sliding_attention"] * 5
    model = gemma4.Model(gemma4.ModelArgs.from_dict(config))
    assistant = checkpoints.gemma4_assistant(tmp_path / "a")
    with pytest.raises(
        MtplxError, match="reads the target's full_attention KV but the target has no such layer"
    ):
        ga.load_gemma4_assistant(assistant.path, Trunk(model), config)


def test_a_gemma_assistant_on_a_non_gemma_target_is_refused(tmp_path):
    other = checkpoints.mimo(tmp_path / "mimo")
    assistant = checkpoints.gemma4_assistant(tmp_path / "a", backbone_hidden_size=32)
    model, config = mlx_load_model(other.path)
    with pytest.raises(MtplxError, match="drafts for Gemma 4 targets only, the target is mimo"):
        ga.load_gemma4_assistant(assistant.path, Trunk(model), config)


def test_the_assistant_is_found_beside_the_target_and_in_the_hub_cache(tmp_path):
    target = checkpoints.gemma4_target(tmp_path / "models" / "gemma-4-tiny")
    assert ga.find_assistant(target.path, str(target.path)) is None
    assistant = checkpoints.gemma4_assistant(tmp_path / "models" / "gemma-4-tiny-assistant")
    assert ga.find_assistant(target.path, str(target.path)) == assistant.path

    hub = tmp_path / "hub"
    snap = cache_layout(target.path, hub, "google/gemma-4-tiny")
    assert ga.find_assistant(snap, "google/gemma-4-tiny", hub_cache=hub) is None
    cache_layout(assistant.path, hub, "google/gemma-4-tiny-assistant")
    found = ga.find_assistant(snap, "google/gemma-4-tiny", hub_cache=hub)
    assert found is not None and ga.read_assistant_config(found)["model_type"] == "gemma4_assistant"
    shutil.rmtree(hub)


def test_engine_loads_the_assistant_beside_a_gemma_target_and_refuses_forced_mtp_without_one(tmp_path):
    from mtplx.engine.engine import Engine

    target = checkpoints.gemma4_target(tmp_path / "gemma-4-tiny", 8, context_strength=3.0)
    word_level(target.path, 8)
    bare = Engine.load(str(target.path))
    assert bare.head is None
    with pytest.raises(MtplxError, match="no assistant drafter: pass --head DIR"):
        bare.generate("w2 w3", mtp=True, max_tokens=4)
    ar = bare.generate("w2 w3 w4", mtp=False, max_tokens=12).token_ids

    assistant = checkpoints.gemma4_assistant(
        tmp_path / "gemma-4-tiny-assistant", 8, ordered=True, num_centroids=4, scale=0.3
    )
    found = Engine.load(str(target.path))
    explicit = Engine.load(str(target.path), head=str(assistant.path))
    for engine in (found, explicit):
        assert isinstance(engine.head, ga.Gemma4AssistantHead)
        assert engine.head.default_depth == 3  # block_size 4 = the pending token + 3 drafts
        result = engine.generate("w2 w3 w4", mtp=True, max_tokens=12)
        assert result.stats.mode == "mtp" and result.token_ids == ar
        head_stats = result.stats.drafters["head"]
        assert 0 <= head_stats["target_outside_candidates"] <= head_stats["target_checked"] <= 12


def test_inspect_names_the_assistant_that_pairs_with_a_gemma_target(tmp_path):
    from mtplx.checkpoints.inspect import inspect_model
    from mtplx.checkpoints.inspect_report import format_inspection

    target = checkpoints.gemma4_target(tmp_path / "gemma-4-tiny")
    info = inspect_model(str(target.path))
    assert info["verdict"] == "AR-only" and info["assistant"]["problem"] == "not found locally"
    assistant = checkpoints.gemma4_assistant(tmp_path / "gemma-4-tiny-assistant")
    info = inspect_model(str(target.path))
    assert info["verdict"] == "MTP-ready" and info["assistant"]["path"] == str(assistant.path)
    assert f"assistant     {assistant.path} (pairs)" in format_inspection(info)
    _write_config(assistant.path, backbone_hidden_size=48)
    info = inspect_model(str(target.path))
    assert info["verdict"] == "AR-only" and "backbone_hidden_size 48" in info["assistant"]["problem"]
    assert inspect_model(str(assistant.path))["verdict"] == "drafter"


@pytest.mark.parametrize("bits", [None, 8])
def test_convert_assistant_writes_a_bf16_or_quantized_drafter_beside_the_target(tmp_path, bits):
    target = checkpoints.gemma4_target(tmp_path / "gemma-4-tiny", 64)
    assistant = checkpoints.gemma4_assistant(tmp_path / "src-assistant", 64, ordered=True)
    out = ga.convert_assistant(assistant.path, target.path, bits=bits, group_size=32)
    assert (
        out == tmp_path / "gemma-4-tiny-assistant" and ga.find_assistant(target.path, str(target.path)) == out
    )
    model, config = mlx_load_model(target.path)
    trunk = Trunk(model)
    head = ga.load_gemma4_assistant(out, trunk, config)
    assert ("scales" in head.pre_projection) == bool(bits)
    assert head.pre_projection.weight.dtype == (mx.uint32 if bits else mx.bfloat16)
    cfg = SamplerConfig(temperature=0.0)
    assert run_mtp_steps(trunk, head, cfg, 2, 20)[0] == run_loop(trunk, head, cfg, None, 20, seed=0)
    with pytest.raises(MtplxError, match="already exists"):
        ga.convert_assistant(assistant.path, target.path)


def _cli(*args):
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mtplx", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_misfit_assistant_is_a_one_line_error_and_no_mtp_still_works(tmp_path):
    target = checkpoints.gemma4_target(tmp_path / "gemma-4-tiny", 8)
    word_level(target.path, 8)
    other = checkpoints.gemma4_assistant(tmp_path / "other", 8, num_centroids=4, backbone_hidden_size=48)
    base = ["generate", "w2 w3", "--model", str(target.path), "--raw", "--max-tokens", "4"]
    out = _cli(*base, "--head", str(other.path))
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert (
        len(lines) == 1 and "backbone_hidden_size 48 does not match the target's hidden_size 32" in lines[0]
    )
    out = _cli(*base, "--head", str(other.path), "--no-mtp", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["mode"] == "ar"
