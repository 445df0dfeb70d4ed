"""Grammar-constrained generation through `Engine` on the default model (SmolLM2 + its head):
JSON-schema output parses and validates under speculation, greedy and sampled; the stream ends
with the grammar's last token; grammar requests speculate in the batch; errors are one line
and the engine keeps working."""

from __future__ import annotations

import json

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.engine.grammar_spec import Grammar
from mtplx.errors import MtplxError

import jsonschema
import pytest

# Strings and arrays bounded, so a reply fits in max_tokens whatever the model likes.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON with a name, an age and tags."}]
MAX_TOKENS = 64
# Greedy json_object replies end within 32 tokens from +4 (7 tokens here; +3 nests once more, 18).
CLOSING_BIAS = 4.0


@pytest.fixture(scope="module")
def engine(default_model_dir):
    return Engine.load()


@pytest.mark.parametrize(
    "temperature,draft",
    [(0.0, "head"), (0.8, "head"), pytest.param(0.8, "auto", marks=pytest.mark.slow)],  # auto: head + lookup
)
def test_json_schema_output_parses_and_validates_under_speculation(engine, draft, temperature):
    grammar = Grammar.json_schema(PERSON)
    stopped = 0
    for seed in range(2 if temperature else 1):
        result = engine.generate(
            MESSAGES, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, draft=draft, grammar=grammar
        )
        assert result.finish_reason in ("stop", "length")
        assert result.stats.mode == "mtp" and result.stats.cycles > 0
        if result.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(result.text), PERSON)
            assert engine.tokenizer.eos_token_id not in result.token_ids
    assert stopped >= 1  # the bounded schema fits: at least one reply completes


def test_grammar_costs_are_reported_and_greedy_agrees_with_ar(engine):
    grammar = Grammar.json_schema(PERSON)
    spec = engine.generate(MESSAGES, max_tokens=MAX_TOKENS, draft="head", grammar=grammar)
    ar = engine.generate(MESSAGES, max_tokens=MAX_TOKENS, draft="none", grammar=grammar)
    # Counts, not timings: at most one draft read per cycle (none where the grammar forced the
    # drafts: they are kept for free), none in AR; the mask time is a reported float.
    assert 0 < spec.stats.grammar_reads <= spec.stats.cycles
    forced = spec.stats.drafters["grammar"]
    assert forced["accepted"] == forced["drafted"] > 0, spec.stats.drafters
    assert ar.stats.grammar_reads == 0 and "grammar" not in ar.stats.drafters
    assert all(isinstance(s.stats.grammar_mask_seconds, float) for s in (spec, ar))
    # Both parse: the same greedy constrained reply up to float rounding of the verify forward.
    assert json.loads(spec.text) == json.loads(ar.text)
    free = engine.generate(MESSAGES, max_tokens=16, draft="head")
    assert free.stats.grammar_reads == 0 and free.stats.grammar_mask_seconds == 0
    assert not spec.text.startswith(free.text)  # the grammar changed the reply


def test_a_lark_grammar_ends_the_stream_with_its_last_token(engine):
    grammar = Grammar.lark('start: "yes" | "no"')
    chunks = list(engine.stream(MESSAGES, max_tokens=16, draft="head", grammar=grammar))
    text = "".join(c.text for c in chunks)
    assert text in ("yes", "no") and chunks[-1].finish_reason == "stop"


def test_bad_grammars_are_one_line_errors_and_the_engine_keeps_working(engine):
    with pytest.raises(MtplxError, match="^response_format: ") as bad_schema:
        Grammar.json_schema({"type": "nonsense"})
    assert "\n" not in str(bad_schema.value)
    with pytest.raises(MtplxError, match="^grammar: "):
        Grammar.lark("start: nowhere")
    # Valid Lark, but a special token this tokenizer lacks: refused when compiled, before decoding.
    with pytest.raises(MtplxError, match="^grammar: .*unknown special token") as no_token:
        engine.generate(MESSAGES, max_tokens=4, grammar=Grammar.lark('start: <|no_such_token|> "x"'))
    assert "\n" not in str(no_token.value)
    # Any JSON object, bounded: a bias toward closing it (on the `}` and `"}` tokens; without it this
    # model nests objects past any max_tokens) makes the reply end at the object's last token.
    closing = {_token_id(engine.tokenizer, text): CLOSING_BIAS for text in ("}", '"}')}
    ask = [{"role": "user", "content": 'Give a JSON object with a "name" key only.'}]
    result = engine.generate(
        ask, max_tokens=32, draft="head", grammar=Grammar.json_object(), logit_bias=closing
    )
    assert result.finish_reason == "stop", result.text
    assert isinstance(json.loads(result.text), dict) and engine.tokenizer.eos_token_id not in result.token_ids


def _token_id(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text, add_special_tokens=False)
    return token


def test_a_grammar_refusing_a_rows_first_token_leaves_nothing_in_the_batch(engine, monkeypatch):
    """The server fuzz (merged tree) found a request whose grammar refused its first token (a NaN
    draw) failed, but its row stayed in the batch and every later cycle raised: all later requests
    were 500s. The refusal is planted here; the next request on the same scheduler must decode as
    it does alone."""
    from mtplx.engine.request import GenerationRequest
    from mtplx.spec_decode import loop

    def refuse(constraint, tokens, mask_mark):
        raise MtplxError("grammar: planted refusal of the first token")

    scheduler = engine.batch(draft_policy="fixed")
    plain = GenerationRequest.from_kwargs(max_tokens=8)
    try:
        monkeypatch.setattr(loop, "grammar_step", refuse)
        handle = scheduler.submit(
            MESSAGES, GenerationRequest.from_kwargs(max_tokens=8, grammar=Grammar.json_object())
        )
        results = []
        while not scheduler.idle:
            results += scheduler.step()
        assert [str(r.error) for r in results if r.handle == handle] == [
            "grammar: planted refusal of the first token"
        ]
        assert len(scheduler._decoder) == 0
        monkeypatch.undo()
        handle = scheduler.submit(MESSAGES, plain)
        tokens = []
        while not scheduler.idle:
            for result in scheduler.step():
                assert result.error is None
                tokens += result.chunk.token_ids
    finally:
        scheduler.close()
    assert tokens == engine.generate(MESSAGES, max_tokens=8).token_ids
