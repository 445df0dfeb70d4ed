"""Block drafters through the entries: `Engine.load` finds a DFlash drafter beside the model (or
takes it from ``head`` / ``draft_model``); ``draft="dflash"`` and "auto" draft with it, greedy
equal to plain AR with drafts made and counted in the stats; a batch mixing it with lookup and
plain AR rows gives each row what it gives alone; a drafter the engine did not load is a
one-line refusal and the engine keeps working; `mtplx generate --head DIR --draft dflash` and
`mtplx serve` (the openai client's ``speculative.drafter``) draft with it; a prompt-cache hit
restores the drafter's context (DFlash and EAGLE-3; from RAM, from the disk tier after a
restart, and on a hybrid trunk's snapshots): a cached turn drafts as a cold run; a file of
another drafter is refused; a drafter loaded on one thread drafts on another."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import Source

import mlx.core as mx
import pytest
from support import checkpoints, drafters, models
from support.server import running_server
from support.tokenizer import word_level

LAYERS = 2  # tiny_llama's
PROMPT = [1, 2, 3, 4, 5, 3, 4, 5]
N = 12


def greedy(**kwargs) -> GenerationRequest:
    """A greedy request for N tokens that EOS does not end (the tiny random model may emit it)."""
    return replace(GenerationRequest.from_kwargs(temperature=0.0, max_tokens=N, **kwargs), ignore_eos=True)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """``Tiny-Llama-4bit`` with ``Tiny-Llama-DFlash`` beside it, and ``Alone-4bit`` without one."""
    root = tmp_path_factory.mktemp("entries")
    paths = {}
    for name in ("Tiny-Llama-4bit", "Alone-4bit"):
        paths[name] = checkpoints.save_model(
            root / name, models.tiny_llama(), architectures=["LlamaForCausalLM"]
        ).path
        word_level(paths[name])
    config = drafters.dflash_config(models.VOCAB, [0, 1], LAYERS)
    tensors = drafters.dflash_tensors(config, seed=5)
    paths["drafter"] = drafters.write_dflash(root / "Tiny-Llama-DFlash", config, tensors)
    return paths


@pytest.fixture(scope="module")
def engine(family):
    return Engine.load(str(family["Tiny-Llama-4bit"]))


def test_the_drafter_beside_the_model_drafts_greedy_equal_to_ar(engine):
    assert engine.block_drafter is not None and engine.block_drafter.source is Source.DFLASH
    ar = engine.generate(PROMPT, greedy(draft="none"))
    for kind in ("dflash", "auto"):
        got = engine.generate(PROMPT, greedy(draft=kind))
        assert got.token_ids == ar.token_ids, kind
        assert got.stats.drafters["dflash"]["drafted"] > 0, (kind, got.stats.drafters)


def test_a_batch_mixing_it_with_lookup_and_ar_gives_each_row_its_own(engine):
    requests = [
        {"draft": "dflash"},
        {"draft": "lookup"},
        {"draft": "none"},
        {"draft": "dflash", "seed": 3},
        {"draft": "auto"},
    ]
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], PROMPT, PROMPT[1:]]
    alone = [engine.generate(p, greedy(**r)).token_ids for p, r in zip(prompts, requests)]
    batch = engine.generate_batch(prompts, [greedy(**r) for r in requests])
    assert [r.token_ids for r in batch] == alone
    assert sum(r.stats.drafters.get("dflash", {}).get("drafted", 0) for r in batch) > 0


def test_a_drafter_not_loaded_is_a_one_line_refusal_and_the_engine_keeps_working(engine, family):
    refused = "'dspark' needs a dspark block drafter and this engine loaded a dflash"
    with pytest.raises(MtplxError, match=refused) as err:
        engine.generate(PROMPT, greedy(draft="dspark"))
    assert "\n" not in str(err.value)
    assert len(engine.generate(PROMPT, greedy(draft="dflash")).token_ids) == N
    alone = Engine.load(str(family["Alone-4bit"]))
    assert alone.block_drafter is None
    with pytest.raises(MtplxError, match="'dflash' needs a dflash block drafter and none is loaded"):
        alone.generate(PROMPT, greedy(draft="dflash"))
    named = Engine.load(str(family["Alone-4bit"]), draft_model=str(family["drafter"]))
    assert named.block_drafter.source is Source.DFLASH and named.draft_model is None
    assert (
        named.generate(PROMPT, greedy(draft="dflash")).token_ids
        == alone.generate(PROMPT, greedy(draft="none")).token_ids
    )


def test_cli_generate_drafts_with_it(family):
    model, drafter = str(family["Alone-4bit"]), str(family["drafter"])
    args = ["generate", "--model", model, "--head", drafter, "--draft", "dflash", "--prompt", "w2 w3"]
    done = subprocess.run(
        [sys.executable, "-m", "mtplx", *args, "--max-tokens", "4", "--temp", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["drafters"]["dflash"]["drafted"] > 0, done.stdout


@pytest.mark.slow
def test_serve_drafts_with_it_for_the_openai_client(family, tmp_path):
    """The continuous batch behind `mtplx serve` (`generate_batch`'s scheduler, tested above)."""
    import openai

    with running_server(family["Tiny-Llama-4bit"], tmp_path / "log.jsonl") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key-0123", timeout=60)
        texts = {
            drafter: client.completions.create(
                model="m",
                prompt="w2 w3 w4 w5 w3 w4",
                max_tokens=6,
                temperature=0,
                extra_body={"speculative": {"drafter": drafter}},
            )
            .choices[0]
            .text
            for drafter in ("none", "dflash")
        }
        assert texts["dflash"] == texts["none"], texts
        with pytest.raises(openai.BadRequestError, match="'dspark' needs a dspark block drafter"):
            client.completions.create(
                model="m", prompt="w1", max_tokens=2, extra_body={"speculative": {"drafter": "dspark"}}
            )


@pytest.mark.parametrize(
    "kind, has_head, has_model, engine_depth, sources",
    [
        ("auto", True, False, 3, (Source.LOOKUP, Source.DFLASH)),
        ("auto", False, False, 0, (Source.LOOKUP, Source.DFLASH)),
        ("auto", True, True, 3, (Source.LOOKUP, Source.MODEL)),
        ("head", True, False, 3, (Source.HEAD,)),
        ("dflash", True, False, 3, (Source.DFLASH,)),
        ("lookup", True, False, 3, (Source.LOOKUP,)),
    ],
)
def test_the_drafting_rules_resolve_a_loaded_block_drafter(kind, has_head, has_model, engine_depth, sources):
    """`drafting.choose_drafter` with a DFlash drafter loaded (the table in drafting.py)."""
    from mtplx.spec_decode.drafting import choose_drafter, row_sources
    from mtplx.spec_decode.settings import Drafting

    choice = choose_drafter(
        Drafting(kind),
        has_head=has_head,
        has_draft_model=has_model,
        engine_depth=engine_depth,
        head_depth=3,
        block=Source.DFLASH,
    )
    assert row_sources(choice) == sources


def test_choices_forked_from_one_prefill_keep_the_drafters_context(engine, monkeypatch):
    """n = 3 greedy choices: each is the single-choice run token for token, and each joins the
    block drafter holding the whole prompt as context (the forks start from a copy of choice 0's
    drafter context: they forward only the prompt's last token themselves)."""
    from mtplx.spec_decode.block_proposer import BlockProposer

    joined = []
    members = BlockProposer._members

    def recorded(self, rows):
        index = members(self, rows)
        joined.append(list(self.cache[0].lengths))
        return index

    monkeypatch.setattr(BlockProposer, "_members", recorded)
    scheduler = engine.batch(max_rows=4, draft_policy="fixed")
    handle = scheduler.submit(PROMPT, replace(greedy(draft="dflash"), n=3))
    tokens = {}
    while not scheduler.idle:
        for result in scheduler.step():
            assert result.error is None and result.handle == handle, result.error
            tokens.setdefault(result.choice, []).extend(result.chunk.token_ids)
    assert max(len(rows) for rows in joined) == 3, joined
    assert all(n >= len(PROMPT) for rows in joined for n in rows), joined
    alone = engine.generate(PROMPT, greedy(draft="dflash"))
    assert [tokens[c] for c in range(3)] == [alone.token_ids] * 3


@pytest.fixture(scope="module")
def eagle3_family(tmp_path_factory):
    """``Tiny-Llama-4bit`` with ``Tiny-Llama-EAGLE3`` (the speculators layout, a reduced draft
    vocabulary) beside it."""
    root = tmp_path_factory.mktemp("eagle3-entries")
    model = checkpoints.save_model(
        root / "Tiny-Llama-4bit", models.tiny_llama(), architectures=["LlamaForCausalLM"]
    ).path
    word_level(model)
    config = drafters.eagle3_config(models.VOCAB, models.VOCAB - 8, [1, 1, 2])
    drafters.write_eagle3(root / "Tiny-Llama-EAGLE3", config, drafters.eagle3_tensors(config, seed=0))
    return model


@pytest.mark.slow
def test_eagle3_drafts_through_cli_generate_and_serve(eagle3_family, tmp_path):
    """`mtplx generate --draft eagle3` drafts with the EAGLE-3 drafter beside the model, and
    `mtplx serve`'s continuous batch gives the openai client's ``speculative.drafter`` "eagle3"
    the plain AR text (greedy); `Engine.generate` and n > 1 forks: `test_discovery.py`."""
    import openai

    args = ["generate", "--model", str(eagle3_family), "--draft", "eagle3", "--prompt", "w2 w3 w4 w5"]
    done = subprocess.run(
        [sys.executable, "-m", "mtplx", *args, "--max-tokens", "6", "--temp", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stats"]["drafters"]["eagle3"]["drafted"] > 0, done.stdout
    with running_server(eagle3_family, tmp_path / "log.jsonl") as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="test-key-0123", timeout=60)
        texts = {
            drafter: client.completions.create(
                model="m",
                prompt="w2 w3 w4 w5 w3 w4",
                max_tokens=6,
                temperature=0,
                extra_body={"speculative": {"drafter": drafter}},
            )
            .choices[0]
            .text
            for drafter in ("none", "eagle3")
        }
        assert texts["eagle3"] == texts["none"], texts


def _record_drafts(monkeypatch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every block a block drafter makes, as (its row's text so far, the drafts), from now on."""
    from mtplx.spec_decode.block_proposer import BlockProposer

    made = []
    block = BlockProposer._block

    def recorded(self, rows, index, most, width, drafts, *rest):
        for m, i in enumerate(index):
            made.append((tuple(rows[i].history), tuple(int(d[m]) for d in drafts)))
        return block(self, rows, index, most, width, drafts, *rest)

    monkeypatch.setattr(BlockProposer, "_block", recorded)
    return made


def _drafts_after(made, prompt: list[int]) -> list:
    """The blocks of the rows whose text starts with ``prompt``, then cleared."""
    out = [m for m in made if m[0][: len(prompt)] == tuple(prompt)]
    made.clear()
    return out


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_prompt_cache_hit_drafts_as_a_cold_run(family, eagle3_family, kind, monkeypatch):
    """Greedy: a chat's second turn starts from the first turn's stored caches, the drafter's
    context among them (DFlash's K/V of every position, EAGLE-3's pairs: `BlockProposer.extract`),
    and gives the cold run's tokens, drafter counts and every block's drafts (the random replica's
    drafts are rarely kept: the drafts themselves show its context); so does a request planned
    while another with its prompt decodes (the prompt's entry stored at admission, `store_prompt`;
    its tokens and drafts).
    Without the drafter's context in the entry the row prefills it all (cached_tokens 0)."""
    model = family["Tiny-Llama-4bit"] if kind == "dflash" else eagle3_family
    cold, warm = Engine.load(str(model)), Engine.load(str(model), prompt_cache_bytes=1 << 26)
    first = warm.generate(PROMPT, greedy(draft=kind))
    second = PROMPT + first.token_ids + [6, 7, 3]
    made = _record_drafts(monkeypatch)
    got = warm.generate(second, greedy(draft=kind))
    got_drafts = _drafts_after(made, second)
    expected = cold.generate(second, greedy(draft=kind))
    assert got.stats.cached_tokens >= len(PROMPT) + N - 1, got.stats
    assert got.token_ids == expected.token_ids
    assert got.stats.drafters == expected.stats.drafters, (got.stats.drafters, expected.stats.drafters)
    assert got_drafts == _drafts_after(made, second) and len(got_drafts) > 1

    warm.prompt_cache.clear()
    scheduler = warm.batch(max_rows=4, draft_policy="fixed")
    scheduler.submit(second, greedy(draft=kind))
    scheduler.step()  # the first prefilled and admitted: its prompt's caches are stored
    later = second[:-1] + [9, 2]
    handle = scheduler.submit(later, greedy(draft=kind))
    results = [r for r in scheduler.drive() if r.handle == handle]
    got_drafts = _drafts_after(made, later)
    alone = cold.generate(later, greedy(draft=kind))
    assert results[-1].chunk.stats.cached_tokens == len(second) - 2, results[-1].chunk.stats
    assert [t for r in results for t in r.chunk.token_ids] == alone.token_ids
    assert got_drafts == _drafts_after(made, later) and len(got_drafts) > 1


def _disk_engine(model, directory, **kwargs) -> Engine:
    """An engine with a RAM prompt cache over the disk tier in ``directory`` (a new one: a restart)."""
    engine = Engine.load(str(model), prompt_cache_bytes=1 << 26, **kwargs)
    engine.use_disk_cache(directory, 1 << 30)
    return engine


def _context_zeroed_on_load(monkeypatch) -> None:
    """A planted bug: every disk entry's block drafter context is read back with zero values."""
    from mtplx.trunk import prompt_cache_format

    load = prompt_cache_format.load_caches

    def zeroed(path):
        caches, meta = load(path)
        for cache in caches[len(caches) - int(meta["mtplx_drafter_layers"]) :]:
            cache.values = mx.zeros_like(cache.values)
        return caches, meta

    monkeypatch.setattr(prompt_cache_format, "load_caches", zeroed)


def _restarted_turn(model, directory, prompt, kind, made):
    """(engine, result, blocks drafted) of ``prompt`` on a fresh engine over ``directory``."""
    engine = _disk_engine(model, directory)
    assert len(engine.prompt_cache) == 0 and len(engine.prompt_cache.disk) > 0
    got = engine.generate(prompt, greedy(draft=kind))
    return engine, got, _drafts_after(made, prompt)


@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_a_disk_hit_after_a_restart_drafts_as_a_cold_run(family, eagle3_family, kind, monkeypatch, tmp_path):
    """The disk tier writes a block drafter row's context beside its trunk caches: after a restart
    (a new engine over the directory, its RAM cache empty) the chat's second turn loads the first
    turn's file and gives the cold run's tokens, drafter counts and every block's drafts (the
    RAM test above, across a restart). Control: the file's context read back zeroed keeps the
    tokens (exact whatever the drafts) but changes the drafts, so they show the context."""
    model = family["Tiny-Llama-4bit"] if kind == "dflash" else eagle3_family
    first = _disk_engine(model, tmp_path / "cache")
    turn = first.generate(PROMPT, greedy(draft=kind))
    assert first.prompt_cache.disk.flush()
    shutil.copytree(tmp_path / "cache", tmp_path / "copy")  # for the control: the first turn's file alone
    second = PROMPT + turn.token_ids + [6, 7, 3]
    made = _record_drafts(monkeypatch)
    expected = Engine.load(str(model)).generate(second, greedy(draft=kind))
    expected_drafts = _drafts_after(made, second)
    assert len(expected_drafts) > 1

    engine, got, got_drafts = _restarted_turn(model, tmp_path / "cache", second, kind, made)
    assert engine.prompt_cache.disk.stats.hits == 1
    assert got.stats.cached_tokens >= len(PROMPT) + N - 1, got.stats
    assert got.token_ids == expected.token_ids
    assert got.stats.drafters == expected.stats.drafters, (got.stats.drafters, expected.stats.drafters)
    assert got_drafts == expected_drafts

    _context_zeroed_on_load(monkeypatch)
    engine, got, got_drafts = _restarted_turn(model, tmp_path / "copy", second, kind, made)
    assert engine.prompt_cache.disk.stats.hits == 1 and got.stats.cached_tokens >= len(PROMPT) + N - 1
    assert got.token_ids == expected.token_ids
    assert got_drafts != expected_drafts


def test_a_disk_file_of_another_drafter_is_refused(family, tmp_path, caplog):
    """A file is keyed by the engine's block drafter too (layout and weights): an engine with
    another DFlash drafter skips it as another configuration's and prefills; the same drafter
    reuses it (positive control)."""
    model = family["Tiny-Llama-4bit"]
    first = _disk_engine(model, tmp_path / "cache")
    first.generate(PROMPT, greedy(draft="dflash"))
    assert first.prompt_cache.disk.flush()
    config = drafters.dflash_config(models.VOCAB, [0, 1], LAYERS)
    other = drafters.write_dflash(tmp_path / "Other-DFlash", config, drafters.dflash_tensors(config, seed=6))
    with caplog.at_level(logging.INFO, logger="mtplx.prompt_cache"):
        engine = _disk_engine(model, tmp_path / "cache", draft_model=str(other))
    assert len(engine.prompt_cache.disk) == 0
    assert "of another model or configuration" in caplog.text
    assert engine.generate(PROMPT + [6], greedy(draft="dflash")).stats.cached_tokens == 0
    same = _disk_engine(model, tmp_path / "cache")
    assert same.generate(PROMPT + [6], greedy(draft="dflash")).stats.cached_tokens >= len(PROMPT) - 1


@pytest.fixture(scope="module", params=["qwen3_5", "nemotron_h"])
def hybrid_model(request, tmp_path_factory):
    """A hybrid trunk without MTP layers (Qwen3.5: gated-delta layers 0 and 2, attention 1 and 3;
    Nemotron-H ``M*-ME``: Mamba2, attention, MLP, Mamba2, MoE) with a DFlash drafter beside it
    tapping layers 0 and 2."""
    from support.nemotron import TRUNK_PATTERN, nemotron_h_checkpoint

    root = tmp_path_factory.mktemp("hybrid-entries")
    if request.param == "qwen3_5":
        model, layers = checkpoints.qwen3_5(root / "Tiny-Hybrid-4bit", mtp_layers=0).path, 4
        word_level(model)
    else:
        model, layers = (
            nemotron_h_checkpoint(root / "Tiny-Hybrid-4bit", ship_mtp=False).path,
            len(TRUNK_PATTERN),
        )
    config = drafters.dflash_config(models.VOCAB, [0, 2], layers)
    drafters.write_dflash(root / "Tiny-Hybrid-DFlash", config, drafters.dflash_tensors(config, seed=5))
    return model


def test_a_hybrid_trunks_snapshot_holds_the_drafters_context(hybrid_model, monkeypatch, tmp_path):
    """A hybrid trunk's caches cannot be moved back, so its entries are snapshots taken when
    the caches hold all prompt positions but the last: a DFlash row's snapshot holds the drafter's
    context of exactly those positions, so the chat's next turn starts from it (cached_tokens
    len(PROMPT) - 1; it prefilled the whole prompt before) and gives the cold run's tokens, drafter
    counts and every block's drafts, from RAM and after a restart from the disk tier. Control:
    the context read back zeroed changes the drafts."""
    engine = _disk_engine(hybrid_model, tmp_path / "cache")
    assert engine.block_drafter is not None and engine.block_drafter.source is Source.DFLASH
    turn = engine.generate(PROMPT, greedy(draft="dflash"))
    assert engine.prompt_cache.disk.flush()
    shutil.copytree(tmp_path / "cache", tmp_path / "copy")
    second = PROMPT + turn.token_ids + [6, 7, 3]
    made = _record_drafts(monkeypatch)
    expected = Engine.load(str(hybrid_model)).generate(second, greedy(draft="dflash"))
    expected_drafts = _drafts_after(made, second)
    assert len(expected_drafts) > 1

    restarted, from_disk, disk_drafts = _restarted_turn(
        hybrid_model, tmp_path / "cache", second, "dflash", made
    )
    from_ram = engine.generate(second, greedy(draft="dflash"))
    ram_drafts = _drafts_after(made, second)
    assert restarted.prompt_cache.disk.stats.hits == 1
    for got, drafts in ((from_ram, ram_drafts), (from_disk, disk_drafts)):
        assert got.stats.cached_tokens == len(PROMPT) - 1, got.stats
        assert got.token_ids == expected.token_ids
        assert got.stats.drafters == expected.stats.drafters, (got.stats.drafters, expected.stats.drafters)
        assert drafts == expected_drafts

    _context_zeroed_on_load(monkeypatch)
    _, got, drafts = _restarted_turn(hybrid_model, tmp_path / "copy", second, "dflash", made)
    assert got.stats.cached_tokens == len(PROMPT) - 1 and got.token_ids == expected.token_ids
    assert drafts != expected_drafts


def test_a_drafter_loaded_on_one_thread_drafts_on_another(family, monkeypatch):
    """As the server does (it loads on the main thread, decodes on its worker's): every array the
    drafter holds is evaluated at load, its private ones too (`compat.materialize`; a private
    array planted in the module, as a Llama-3 RoPE's frequencies sit in a trunk, is one a lazy
    load leaves tied to the loading thread: "There is no Stream(cpu, 0) in current thread"), and
    the engine drafts on the worker as on the loading thread."""
    from mtplx.drafters import dflash

    init = dflash.DFlashDrafter.__init__

    def planted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._planted = mx.arange(4) * 2  # lazy: built on the loading thread

    monkeypatch.setattr(dflash.DFlashDrafter, "__init__", planted)
    engine = Engine.load(str(family["Tiny-Llama-4bit"]))
    results: list = []

    def work() -> None:
        try:
            results.append(int(mx.sum(engine.block_drafter.drafter._planted).item()))
            results.append(engine.generate(PROMPT, greedy(draft="dflash")).token_ids)
        except Exception as err:  # the worker's failure, reported on the test's thread
            results.append(err)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join(timeout=120)
    assert results == [12, engine.generate(PROMPT, greedy(draft="dflash")).token_ids], results
