"""Block drafters through the entries: `Engine.load` finds a DFlash drafter beside the model (or
takes it from ``head`` / ``draft_model``); ``draft="dflash"`` and "auto" draft with it, greedy
equal to plain AR with drafts made and counted in the stats; a batch mixing it with lookup and
plain AR rows gives each row what it gives alone; a drafter the engine did not load is a
one-line refusal and the engine keeps working; `mtplx generate --head DIR --draft dflash` and
`mtplx serve` (the openai client's ``speculative.drafter``) draft with it; a prompt-cache hit
restores the drafter's context (DFlash and EAGLE-3): a cached turn drafts as a cold run."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.spec_decode.sources import Source

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
