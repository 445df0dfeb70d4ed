"""Engine and CLI on the real default model (SmolLM2-135M-Instruct) and its real tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import MtplxError
from mtplx.checkpoints import load as loading
from mtplx.engine.engine import Engine
from mtplx.heads.forged import build_forged_head
from mtplx.trunk.model import Trunk

import mlx.core as mx
import pytest
from support.cli import run_main

PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a hash map.",
]


@pytest.fixture(scope="module")
def engine(default_model_dir):
    """The default trunk with an UNTRAINED head copied from its last layer.

    Exactness must not depend on how good the head is; a poor head gives many
    rejections, which is what the rollback paths need exercised.
    """
    loaded = loading.load_model(default_model_dir)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        loaded.config,
        model_path=loaded.path,
        fingerprint=loaded.fingerprint,
        depth=3,
    )
    mx.random.seed(0)
    head = build_forged_head(engine.trunk, "post_norm")
    head.load_weights([(f"layers.0.{k}", v) for k, v in _last_layer_weights(engine.trunk)], strict=False)
    mx.eval(head.parameters())
    engine.head = head
    return engine


def _last_layer_weights(trunk: Trunk):
    from mlx.utils import tree_flatten

    return tree_flatten(trunk.layers[-1].parameters())


@pytest.mark.parametrize(
    "prompt",
    # One prompt in the default run; the others repeat the same check (`make test-slow`).
    [PROMPTS[0], *(pytest.param(p, marks=pytest.mark.slow) for p in PROMPTS[1:])],
)
def test_greedy_mtp_equals_ar_on_the_default_model(engine, prompt):
    # 16 tokens: about 15 cycles of the untrained head, nearly every one a rollback.
    ar = engine.generate(prompt, chat=True, max_tokens=16, mtp=False)
    mtp = engine.generate(prompt, chat=True, max_tokens=16, mtp=True, depth=3)
    assert mtp.token_ids == ar.token_ids
    assert mtp.text == ar.text
    assert mtp.stats.cycles > 0 and len(mtp.stats.acceptance_per_position) == 3


def test_seeded_sampling_reproduces_exactly(engine):
    kwargs = dict(chat=True, max_tokens=8, temperature=0.8, top_p=0.95, seed=1234)
    first = engine.generate(PROMPTS[1], **kwargs)
    again = engine.generate(PROMPTS[1], **kwargs)
    other = engine.generate(PROMPTS[1], **{**kwargs, "seed": 99})
    assert first.token_ids == again.token_ids
    assert other.token_ids != first.token_ids  # the seed does something


def test_max_tokens_and_stop_strings(engine):
    result = engine.generate("The capital of France is", max_tokens=5, mtp=True)
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    full = engine.generate("The capital of France is", max_tokens=30, mtp=False)
    assert "Paris" in full.text
    cut = full.text.index("Paris")
    stopped = engine.generate("The capital of France is", max_tokens=30, mtp=True, stop=["Paris"])
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]  # the stop string itself is not emitted


def test_eos_ends_generation_without_emitting_it(engine):
    result = engine.generate("Say only the word yes.", chat=True, max_tokens=200, mtp=True)
    assert result.finish_reason == "stop"
    assert not set(result.token_ids) & set(engine.tokenizer.eos_token_ids)
    assert len(result.token_ids) < 200


def test_stream_never_splits_multibyte_characters(engine):
    prompt = "Translate to Japanese and add emoji: good morning, friend! 🌅 おはよう"
    chunks = list(engine.stream(prompt, chat=True, max_tokens=40, mtp=True))
    text = "".join(c.text for c in chunks)
    ids = [t for c in chunks for t in c.token_ids]
    assert text == engine.tokenizer.decode(ids)
    assert any(ord(ch) > 127 for ch in text), text  # the test only means something with non-ASCII output
    assert all("\ufffd" not in c.text for c in chunks)


def test_engine_serves_correctly_after_an_interrupted_call(engine):
    reference = engine.generate(PROMPTS[0], chat=True, max_tokens=12, mtp=True)
    stream = engine.stream(PROMPTS[2], chat=True, max_tokens=50, mtp=True)
    next(stream), next(stream)
    stream.close()  # what a Ctrl-C in the consumer does
    again = engine.generate(PROMPTS[0], chat=True, max_tokens=12, mtp=True)
    assert again.token_ids == reference.token_ids


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompt=""), "prompt"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(depth=0), "depth"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
        (dict(max_tokens=10**7), "context"),
    ],
)
def test_bad_input_raises_a_one_line_error(engine, kwargs, message):
    prompt = kwargs.pop("prompt", "hello")
    with pytest.raises(ValueError) as info:
        engine.generate(prompt, **kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert engine.generate("hello", max_tokens=3).token_ids  # still serving


def test_mtp_without_a_head_is_refused_with_advice(engine):
    headless = Engine(engine.trunk.model, engine.tokenizer, engine.config)
    with pytest.raises(MtplxError, match="no-mtp"):
        headless.generate("hello", max_tokens=3, mtp=True)
    # Default draft="auto": without a head, prompt lookup is the only drafter; mtp=False is plain AR.
    assert set(headless.generate("hello", max_tokens=3).stats.drafters) <= {"lookup"}
    assert headless.generate("hello", max_tokens=3, mtp=False).stats.mode == "ar"


def test_cli_generate_streams_text_and_prints_stats():
    out = run_main("generate", "The capital of France is", "--raw", "--max-tokens", "12", "--stats")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "Acceptance per draft position" in out.stderr and "Tokens per verify cycle" in out.stderr


def test_cli_json_without_mtp():  # stdin prompts: test_cli (a real process)
    out = run_main("generate", "--raw", "--max-tokens", "6", "--json", "--no-mtp", "The capital of France is")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 6
    assert result["stats"]["mode"] == "ar"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["generate", "hi", "--temp", "-1"], "--temp"),
        (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi", "--model", "/no/such/model"], "/no/such/model"),
        (["inspect", "/no/such/model"], "/no/such/model"),
    ],
)
def test_cli_bad_input_is_one_line_no_traceback(args, needle, capsys):
    from mtplx.cli.main import main

    # main() in-process (an exception would fail the test); the test below runs the module itself.
    assert main(args) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], err


def test_cli_ctrl_c_stops_cleanly_and_still_prints_stats():
    import signal

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mtplx",
            "generate",
            "Tell me a long story about a dragon.",
            "--max-tokens",
            "400",
            "--stats",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A shell that starts the suite in the background ignores SIGINT, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = proc.stdout.read(1)  # generation has started
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert first and proc.returncode == 130
    assert "interrupted" in err and "Tokens per verify cycle" in err and "Traceback" not in err
