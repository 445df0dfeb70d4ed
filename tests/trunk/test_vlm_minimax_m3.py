"""MiniMax-M3 (``minimax_m3``) hosted through mlx-vlm's language model with mlx-vlm's own caches
(`mtplx.trunk.vlm_text.NATIVE_CACHE_FAMILIES`: ``MiniMaxM3KVCache`` = KV + the block-sparse
indexer's keys on sparse layers, ``KVCache`` on dense ones).

The checkpoint is ``support.vlm_families.minimax_m3``'s tiny replica in the published layout; the
reference is mlx-vlm's own loader and forward. Cache rollback for these cache kinds runs in
``tests/trunk/test_cache.py`` (``minimax_m3_sparse``, with the skipped-trim control). mlx-vlm 0.7.10
ships no MiniMax-M3 MTP drafter: the trunk decodes AR or with lookup / draft-model drafts. Its rows
batch (`mtplx.trunk.vlm_minimax_m3`): ragged rows give their logits alone, lookup rows their tokens.
"""

from __future__ import annotations

from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.checkpoints.load import load_mlx_model
from mtplx.trunk import backends, vlm_text
from mtplx.trunk.batch_cache import BatchCache
from mtplx.trunk.model import Trunk

import mlx.core as mx
import numpy as np
import pytest
from support.seeds import FRESH, resolve
from support.vlm_families import MINIMAX_M3_HIDDEN, MINIMAX_M3_VOCAB, minimax_m3, tiny_minimax_m3
from support.vlm_heads import kept_and_rejected, lookup_prompt, max_abs_diff

TOL = 1e-4
PROMPT_LEN = 12  # six blocks of 2 keys: the indexer keeps 2 of them and the local one


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return minimax_m3(tmp_path_factory.mktemp("minimax_m3") / "model").path


def test_backend_is_mlx_vlm():
    assert backends.backend_for({"model_type": "minimax_m3"}) == (backends.MLX_VLM, "minimax_m3")


def test_trunk_logits_equal_mlx_vlm_forward_and_the_taps(checkpoint):
    """Every prompt position, then 5 decode steps, against mlx-vlm's forward on its own caches and
    its one forward over the whole sequence; pre-norm = mlx-vlm's ``return_hidden``, post = the
    LM head's input; a block after a chunked prefill."""
    from mlx_vlm.utils import load_model

    model, config = load_mlx_model(checkpoint)
    assert isinstance(model, vlm_text.VlmTextModel) and config["model_type"] == "minimax_m3"
    trunk = Trunk(model)
    reference = load_model(checkpoint).language_model
    seed = resolve(FRESH)
    tokens = np.random.default_rng(seed).integers(0, MINIMAX_M3_VOCAB, size=PROMPT_LEN + 5).tolist()
    whole = reference(mx.array([tokens]), cache=reference.make_cache()).logits
    cache, ref_cache = trunk.make_cache(), reference.make_cache()
    assert [type(c).__name__ for c in cache] == ["KVCache", "MiniMaxM3KVCache", "MiniMaxM3KVCache"]
    prompt = mx.array([tokens[:PROMPT_LEN]])
    out = trunk(prompt, cache)
    ref = reference(prompt, cache=ref_cache, return_hidden=True)
    assert max_abs_diff(out.logits, ref.logits) <= TOL, f"seed {seed}"
    assert out.hidden_pre_norm.shape == (1, PROMPT_LEN, MINIMAX_M3_HIDDEN)
    assert max_abs_diff(out.hidden_pre_norm, ref.hidden_states[0]) <= TOL, f"seed {seed}"
    assert max_abs_diff(trunk.lm_head(out.hidden_post_norm), out.logits) <= TOL
    for i, t in enumerate(tokens[PROMPT_LEN:]):
        step = trunk(mx.array([[t]]), cache).logits
        assert max_abs_diff(step, reference(mx.array([[t]]), cache=ref_cache).logits) <= TOL, f"seed {seed}"
        assert max_abs_diff(step[:, 0], whole[:, PROMPT_LEN + i]) <= TOL, f"seed {seed}, step {i}"
    chunked = trunk.make_cache()
    trunk(mx.array([tokens[:5]]), chunked)
    trunk(mx.array([tokens[5:PROMPT_LEN]]), chunked)
    block = trunk(mx.array([tokens[PROMPT_LEN:]]), chunked).logits
    assert max_abs_diff(block, whole[:, PROMPT_LEN:]) <= TOL, f"seed {seed}"


def test_engine_decodes_as_one_forward_with_lookup_drafts_and_the_prompt_cache(checkpoint, tmp_path):
    """Through the Engine: greedy tokens = the argmax chain of mlx-vlm's one forward; the decode
    loop with prompt-lookup drafts (verify blocks, rejections) gives them too; a prompt-cache hit
    in RAM (its KV copied, not shared: `compat.copy_cache`) gives them too; so does a new engine
    starting from the disk tier's entry (a MiniMaxM3KVCache, which has no ``from_state``, rebuilt
    from its ``state``: its KV and the indexer's keys)."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest

    from mlx_vlm.utils import load_model
    from support.decoding import lookup_decode_steps
    from support.tokenizer import word_level

    word_level(checkpoint, MINIMAX_M3_VOCAB)
    engine = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    engine.use_disk_cache(tmp_path, 1 << 26)
    prompt = lookup_prompt(MINIMAX_M3_VOCAB)

    def run(e, tokens):
        return e.generate(tokens, GenerationRequest.from_kwargs(max_tokens=6, temperature=0.0, draft="none"))

    ar = run(engine, prompt).token_ids
    lm = load_model(checkpoint).language_model
    ref = lm(mx.array([prompt + ar[:-1]]), cache=lm.make_cache()).logits[0, len(prompt) - 1 :]
    assert ar == np.argmax(np.array(ref), axis=-1).tolist()[: len(ar)]
    drafted = lookup_decode_steps(engine.trunk, prompt, len(ar))
    assert [t for s in drafted for t in s.tokens][: len(ar)] == ar
    assert any(s.num_drafted > s.num_accepted for s in drafted), "no rejected draft"
    again = run(engine, prompt + ar[:2])
    assert again.stats.cached_tokens > 0 and again.token_ids[:4] == ar[2:]
    assert engine.prompt_cache.disk.flush() and list(tmp_path.glob("*.safetensors"))
    fresh = Engine.load(str(checkpoint), prompt_cache_bytes=1 << 26)
    fresh.use_disk_cache(tmp_path, 1 << 26)
    longer = replace(GenerationRequest.from_kwargs(max_tokens=4, draft="none"), ignore_eos=True)
    from_disk = fresh.generate(prompt + ar[:2], longer)
    assert from_disk.stats.cached_tokens > 0 and fresh.prompt_cache.disk.stats.hits == 1
    assert from_disk.token_ids == engine.generate(prompt + ar[:2], longer).token_ids
    # the caches loaded from disk continue as one forward over the whole sequence does
    tokens = prompt + [5, 6, 7, 8]
    cache = fresh.prompt_cache.disk.load_best(np.array(tokens), False)[2]
    assert "MiniMaxM3KVCache" in {type(c).__name__ for c in cache}
    n = cache[0].offset
    continued = fresh.trunk(mx.array([tokens[n:]]), cache).logits
    whole = lm(mx.array([tokens]), cache=lm.make_cache()).logits[:, n:]
    assert max_abs_diff(continued, whole) <= 1e-4


def _held(cache) -> list[np.ndarray]:
    """What a single-row MiniMax-M3 cache holds up to its offset: K and V, and on a sparse layer
    the indexer's keys."""
    if type(cache).__name__ == "MiniMaxM3KVCache":
        kv, index = cache.state
        return [np.array(kv[0]), np.array(kv[1]), np.array(index)]
    return [np.array(a) for a in cache.state]


@pytest.mark.parametrize("seed", [0, FRESH])
def test_ragged_rows_give_each_rows_logits_alone_and_keep_their_own_count(seed):
    """Rows of 1, 9 and 14 committed tokens in one batch forward a 3-position block, keep 1, 3
    and 0 of it, then forward one position: each row's logits are its own forward's alone (its
    caches trimmed as a single row's rollback does), and each row extracts as the caches alone
    (mlx-vlm's classes: KVCache, MiniMaxM3KVCache with the indexer's keys). The 1-token row
    holds at most ``block_size * topk_blocks`` keys (alone its indexer selects nothing) while the
    batch holds more; the long rows' indexers select their 2 best blocks (the local one forced) by their
    own positions (RoPE and the indexer's query start: ``position_ids``)."""
    rng = np.random.default_rng(resolve(seed))
    trunk = Trunk(tiny_minimax_m3())
    prompts = [rng.integers(2, MINIMAX_M3_VOCAB, size=n).tolist() for n in (1, 9, 14)]
    singles = []
    for prompt in prompts:
        cache = trunk.make_cache()
        trunk(mx.array([prompt]), cache)
        singles.append(cache)
    batch = BatchCache(trunk.make_cache(), trunk.model)
    assert [type(c).__name__ for c in batch.layers] == ["RaggedVlmKVCache"] + ["RaggedIndexedKVCache"] * 2
    batch.add_rows(singles)
    lengths = [len(p) for p in prompts]
    for block_len, keep in ((3, [1, 3, 0]), (1, [1, 1, 1])):
        tokens = rng.integers(2, MINIMAX_M3_VOCAB, size=(len(prompts), block_len))
        record = batch.begin_block(block_len)
        together = trunk(mx.array(tokens), batch.layers).logits
        batch.commit_block(record, keep)
        for r, (cache, n) in enumerate(zip(singles, keep)):
            alone = trunk(mx.array(tokens[r : r + 1]), cache).logits
            assert max_abs_diff(together[r : r + 1], alone) < TOL, f"seed {resolve(seed)}, row {r}"
            for c in cache:  # the single row's rollback of the rest of the block
                c.trim(block_len - n)
        lengths = [a + n for a, n in zip(lengths, keep)]
        assert batch.lengths == lengths
    for r, cache in enumerate(singles):
        extracted = batch.extract(r)
        assert [type(c).__name__ for c in extracted] == ["KVCache", "MiniMaxM3KVCache", "MiniMaxM3KVCache"]
        assert all(type(c).__module__.startswith("mlx_vlm.") for c in extracted)
        for got, want in zip(extracted, cache, strict=True):
            for a, b in zip(_held(got), _held(want), strict=True):
                assert a.shape == b.shape and np.abs(a - b).max() < TOL, f"seed {resolve(seed)}, row {r}"


def test_lookup_rows_in_a_batch_share_one_forward_and_equal_each_alone_with_rejections(
    checkpoint, monkeypatch
):
    """Rows of ``generate_batch`` drafting by prompt lookup decode in shared trunk forwards (a
    forward of 3 rows is counted) and give each prompt's AR tokens alone, drafts rejected among them."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest
    from mtplx.spec_decode.rows import check_batch_support
    from mtplx.spec_decode.settings import LookupConfig

    from support.tokenizer import word_level

    word_level(checkpoint, MINIMAX_M3_VOCAB)
    engine = Engine.load(str(checkpoint))
    assert check_batch_support(engine.trunk) is None
    base = lookup_prompt(MINIMAX_M3_VOCAB)
    prompts = [base, base[20:] + base[:20], base[::-1]]

    def request(draft):
        lookup = LookupConfig(min_ngram=1, max_ngram=3, max_tokens=4)  # 1-grams: every token recurs
        return replace(
            GenerationRequest.from_kwargs(max_tokens=6, draft=draft, lookup=lookup), ignore_eos=True
        )

    alone = [engine.generate(p, request("none")).token_ids for p in prompts]
    rows: list[int] = []
    forward = vlm_text.VlmTextModel.__call__

    def counted(self, inputs, *args, **kwargs):
        rows.append(inputs.shape[0])
        return forward(self, inputs, *args, **kwargs)

    monkeypatch.setattr(vlm_text.VlmTextModel, "__call__", counted)
    batched = engine.generate_batch(prompts, request("lookup"), max_rows=3, draft_policy="fixed")
    assert [b.token_ids for b in batched] == alone
    assert sum(kept_and_rejected(b.stats)[1] for b in batched) > 0
    assert rows.count(len(prompts)) >= 3, rows  # cycles of all three rows in one forward


def test_a_seeded_n_2_request_among_batched_rows_gives_what_it_gives_alone(checkpoint):
    """A seeded request with n = 2 at t 1.0 (its choices forked from one prefill into rows of the
    batch, the MiniMaxM3KVCaches copied) decoded beside two greedy lookup rows gives each choice's
    tokens alone, and the greedy rows theirs."""
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest
    from mtplx.engine.scheduler import run_to_completion

    from support.tokenizer import word_level

    def per_choice(chunks) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for c in chunks:
            out.setdefault(c.index, []).extend(c.token_ids)
        return out

    def request(**kwargs):
        return replace(GenerationRequest.from_kwargs(max_tokens=8, draft="lookup", **kwargs), ignore_eos=True)

    word_level(checkpoint, MINIMAX_M3_VOCAB)
    engine = Engine.load(str(checkpoint))
    base = lookup_prompt(MINIMAX_M3_VOCAB)
    prompts = [base, base[::-1], base[5:]]
    requests = [request(temperature=1.0, seed=17, n=2), request(), request()]
    alone = [
        run_to_completion(engine.batch(draft_policy="fixed"), [p], [r])[0] for p, r in zip(prompts, requests)
    ]
    together = run_to_completion(engine.batch(draft_policy="fixed"), prompts, requests)
    assert [per_choice(c) for c in together] == [per_choice(c) for c in alone]
    assert len(per_choice(together[0])) == 2


def test_mtplx_convert_output_opens_in_mlx_vlm_and_decodes_as_its_forward(checkpoint, tmp_path):
    """4-bit with mlx-vlm's per-layer rule (8-bit router gates); greedy tokens = the argmax chain
    of mlx-vlm's own forward on the converted files."""
    from mtplx.checkpoints.convert_hf import convert_hf
    from mtplx.engine.engine import Engine
    from mtplx.engine.request import GenerationRequest

    from mlx_vlm.utils import load_model
    from support.tokenizer import word_level

    word_level(checkpoint, MINIMAX_M3_VOCAB)
    out = convert_hf(checkpoint, tmp_path / "MiniMax-M3-Tiny-4bit", q_bits=4, q_group_size=32)
    lm = load_model(out).language_model  # opens in mlx-vlm
    engine = Engine.load(str(out))
    bits = {p: m.bits for p, m in engine.trunk.model.named_modules() if hasattr(m, "scales")}
    assert bits["language_model.model.layers.1.block_sparse_moe.gate"] == 8
    prompt = [5, 6, 7, 8, 9, 10]
    got = engine.generate(
        prompt, GenerationRequest.from_kwargs(max_tokens=5, temperature=0.0, draft="none")
    ).token_ids
    ref = lm(mx.array([prompt + got[:-1]]), cache=lm.make_cache()).logits[0, len(prompt) - 1 :]
    assert got == np.argmax(np.array(ref), axis=-1).tolist()[: len(got)]
