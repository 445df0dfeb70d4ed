"""A split drafter's provenance check (``mtplx.heads.provenance``): measured at load, a warning
for a drafter whose config fits but whose weights belong to another model, never a refusal.

Two tiny Qwen3.5 replicas of the same shapes: A, whose head predicts its trunk by construction
(``context_strength``), converted to a 4-bit trunk with ``mlx_lm.convert`` and split with
mlx-vlm's splitter beside it; B, other random weights, split the same way (the drafter of "another
fine-tune"). The tokenizer spells ``provenance.BUILTIN_TEXT`` character by character (byte-level,
as Qwen's), so the fixed text is 64+ real positions for the tiny vocabulary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx import cli
from mtplx.checkpoints.inspect import inspect_model
from mtplx.checkpoints.inspect_report import format_inspection
from mtplx.engine.engine import Engine
from mtplx.heads import provenance
from mtplx.sampling import SamplerConfig

import mlx.core as mx
import pytest
from support import checkpoints
from support import decoding as decode
from support.decoding import mtp_decode, take_tokens

GREEDY = SamplerConfig(temperature=0.0)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def char_tokenizer(path: Path, vocab_size: int = 64) -> None:
    """A byte-level BPE tokenizer without merges whose vocabulary is the characters of the
    built-in text (so it encodes to one token per character), padded to ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    chars = sorted({c for piece, _ in pre.pre_tokenize_str(provenance.BUILTIN_TEXT) for c in piece})
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre, decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    from mlx_lm import convert
    from mlx_vlm.split_mtp import split_mtp

    root = tmp_path_factory.mktemp("provenance")
    own, other = root / "Tiny", root / "elsewhere" / "Other"
    checkpoints.qwen3_5(own, context_strength=0.1)  # measured: 0.52 agreement, B's drafter 0.05
    checkpoints.qwen3_5(other, seed=1)  # same shapes, other (random) weights
    for src in (own, other):
        char_tokenizer(src)
    trunk = root / "Tiny-4bit"
    convert(str(own), str(trunk), quantize=True, q_group_size=32, q_bits=4)
    for name in TOKENIZER_FILES:  # mlx_lm.convert re-saves it as the model type's class: keep ours
        shutil.copy(own / name, trunk / name)
    split_mtp(str(own), str(root / "Tiny-MTP-bf16"))
    return {"trunk": trunk, "other": split_mtp(str(other), str(other.parent / "Other-MTP-bf16"))}


def test_the_text_is_long_enough_for_the_figure(pair):
    engine = Engine.load(str(pair["trunk"]), mtp=False)
    ids = provenance.text_ids(engine.tokenizer)
    assert len(ids) == provenance.MAX_POSITIONS + 1 and len(set(ids)) > 10


def test_the_drafter_of_these_weights_loads_without_a_warning(pair, capsys):
    engine = Engine.load(str(pair["trunk"]))
    assert engine.head.provenance.positions == provenance.MAX_POSITIONS
    assert engine.head.provenance.agreement > 0.4
    assert "warning" not in capsys.readouterr().err


def test_a_drafter_of_other_weights_warns_and_still_drafts_exactly(pair, capsys):
    engine = Engine.load(str(pair["trunk"]), head=str(pair["other"]))
    assert engine.head is not None and engine.head.provenance.agreement < 0.15
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "first-position agreement" in warnings[0] and "below 0.25" in warnings[0]
    prompt = [3, 17, 42, 5, 60, 9, 11, 2]
    ar = take_tokens(
        decode.ar_decode(engine.trunk, prompt, decode.DecodeSettings(sampler=GREEDY), mx.random.key(0)), 12
    )
    settings = decode.DecodeSettings(sampler=GREEDY, depth=2)
    assert take_tokens(mtp_decode(engine.trunk, engine.head, prompt, settings, mx.random.key(0)), 12) == ar


def agreements_one_position_at_a_time(trunk, head, ids: list[int], shift: int = 1) -> int:
    """The count, written out position by position: the target's greedy token after each prefix
    ``ids[:t+2]`` (its own forward) against the head's draft from the hidden at t and the token
    ``ids[t+1]``, the head fed one position per call on its own cache. ``shift`` 0 plants the
    off-by-one (the target's token after ``ids[:t+1]``), for the negative control."""
    hidden = trunk(mx.array([ids])).hidden_post_norm
    cache, agree = head.make_cache(), 0
    for t in range(len(ids) - 1):
        target = int(mx.argmax(trunk(mx.array([ids[: t + 1 + shift]])).logits[0, -1]).item())
        out = head(hidden[:, t : t + 1], mx.array([[ids[t + 1]]]), cache, step=0)
        agree += int(mx.argmax(head.logits(out, 0)[0, -1]).item()) == target
    return agree


def test_the_figure_is_the_count_of_positions_where_the_first_draft_is_the_targets(pair):
    engine = Engine.load(str(pair["trunk"]))
    ids = provenance.text_ids(engine.tokenizer)
    measured = provenance.first_position_agreement(engine.trunk, engine.head, ids)
    assert round(measured.agreement * measured.positions) == agreements_one_position_at_a_time(
        engine.trunk, engine.head, ids
    )
    # Negative control: the off-by-one alignment gives another count, so the check can tell.
    off_by_one = agreements_one_position_at_a_time(engine.trunk, engine.head, ids, shift=0)
    assert round(measured.agreement * measured.positions) != off_by_one


def test_stats_and_inspect_show_the_figure(pair, capsys):
    argv = [
        "generate",
        "The quick",
        "--model",
        str(pair["trunk"]),
        "--raw",
        "-m",
        "6",
        "--temp",
        "0",
        "--stats",
    ]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "Drafter: head, depth 2" in err and "Drafter check: first-position agreement 0." in err
    text = format_inspection(inspect_model(str(pair["trunk"]), head=str(pair["other"])))
    assert "provenance    first-position agreement 0.0" in text and "may belong to other weights" in text
