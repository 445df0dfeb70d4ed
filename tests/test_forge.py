"""`mtplx forge` on a tiny random llama trunk: training, resume, determinism, evaluation, sidecar."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.errors import MtplxError
from mtplx.forge import (
    ForgeConfig,
    TeacherData,
    acceptance,
    build_head,
    choose_draft_vocab,
    evaluate_acceptance,
    forge,
    frequent_ids,
    precompute_teacher,
    top_n_logprobs,
    train_head,
)
from mtplx.forge_data import corpus_from_paths
from mtplx.heads.forged import MANIFEST, lm_head_matrix, load_forged_head, save_forged_head
from mtplx.trunk import Trunk

VOCAB, SEQ, ROWS = 48, 24, 24


def _tiny_trunk(seed: int = 0) -> Trunk:
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = llama.Model(args)
    # Sharper-than-random logits so the trunk's distributions carry learnable structure.
    model.model.embed_tokens.weight = mx.random.normal((VOCAB, 32)) * 0.6
    mx.eval(model.parameters())
    return Trunk(model)


def _windows(n: int = ROWS, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(n, SEQ)).astype(np.int32)


@pytest.fixture(scope="module")
def trunk() -> Trunk:
    return _tiny_trunk()


@pytest.fixture(scope="module")
def teacher(trunk: Trunk, tmp_path_factory: pytest.TempPathFactory) -> TeacherData:
    return precompute_teacher(
        trunk, "tinyfp", _windows(), tmp_path_factory.mktemp("teacher"), top_n=8, batch=8, progress=False
    )


def _cfg(tmp: Path, **kw) -> ForgeConfig:
    base = dict(
        out_dir=tmp / "out",
        steps=40,
        batch_size=4,
        lr=3e-3,
        warmup=5,
        checkpoint_every=10,
        progress=False,
        seed=0,
    )
    base.update(kw)
    return ForgeConfig(**base)


def _params(head) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in tree_flatten(head.parameters())}


def test_top_n_logprobs_matches_a_direct_log_softmax() -> None:
    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32)
    ids, logp = top_n_logprobs(logits, 5)
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert np.array_equal(ids, np.argsort(-logits, axis=-1)[:, :5])
    np.testing.assert_allclose(logp, np.take_along_axis(ref, ids, -1), rtol=1e-5, atol=1e-5)


def test_teacher_cache_resumes_after_an_interruption(
    trunk: Trunk, teacher: TeacherData, tmp_path: Path
) -> None:
    windows = _windows()
    precompute_teacher(trunk, "tinyfp", windows, tmp_path, 8, 8, False)
    # Simulate a kill after the first batch: later rows lost, progress says 8.
    hidden = np.load(tmp_path / "hidden.npy", mmap_mode="r+")
    hidden[8:] = 0
    hidden[0, 0, 0] = 1234.0  # a marker: resuming must not recompute finished rows
    hidden.flush()
    (tmp_path / "teacher_progress.json").write_text(json.dumps({"sequences_done": 8}))
    again = precompute_teacher(trunk, "tinyfp", windows, tmp_path, 8, 8, False)
    assert again.hidden[0, 0, 0] == 1234.0
    np.testing.assert_allclose(again.hidden[8:], teacher.hidden[8:], rtol=1e-3, atol=1e-3)
    assert np.array_equal(again.top_ids, teacher.top_ids)
    # Another trunk fingerprint invalidates the cache: everything is recomputed.
    fresh = precompute_teacher(trunk, "otherfp", windows, tmp_path, 8, 8, False)
    assert fresh.hidden[0, 0, 0] != 1234.0
    assert json.loads((tmp_path / "teacher.json").read_text())["trunk_fingerprint"] == "otherfp"


def test_a_foreign_teacher_cache_must_hold_exactly_this_runs_windows(trunk: Trunk, tmp_path: Path) -> None:
    from mtplx.forge import _foreign_teacher_fingerprint

    windows = _windows(8)
    precompute_teacher(trunk, "oldconversion", windows, tmp_path, 8, 8, False)
    assert _foreign_teacher_fingerprint(tmp_path, windows, 8) == "oldconversion"
    with pytest.raises(MtplxError, match=r"teacher\.json: teacher cache holds other windows"):
        _foreign_teacher_fingerprint(tmp_path, _windows(8, seed=5), 8)
    with pytest.raises(MtplxError, match=r"teacher\.json: not a complete teacher cache"):
        _foreign_teacher_fingerprint(tmp_path / "nothing", windows, 8)


@pytest.mark.parametrize("shared", [None, 12])
def test_training_lowers_the_kl(
    trunk: Trunk, teacher: TeacherData, tmp_path: Path, shared: int | None
) -> None:
    # shared=12: the softmax runs over 12 frequent ids + each position's teacher top-8 only.
    ids = None if shared is None else frequent_ids(teacher, ROWS, shared, VOCAB)
    head = build_head(trunk, "post_norm")
    result = train_head(_cfg(tmp_path), trunk, head, teacher, ids, tmp_path / "ckpt", log_every=1)
    first = np.mean([kl for _, kl in result.losses[:5]])
    last = np.mean([kl for _, kl in result.losses[-5:]])
    assert last < 0.7 * first, (first, last)


def test_resume_from_checkpoint_equals_a_straight_run(
    trunk: Trunk, teacher: TeacherData, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, steps=20)
    straight = build_head(trunk, "post_norm")
    train_head(cfg, trunk, straight, teacher, None, tmp_path / "a")
    first = build_head(trunk, "post_norm")
    train_head(cfg, trunk, first, teacher, None, tmp_path / "b", stop_at=10)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["step-000010.safetensors"]
    resumed = build_head(trunk, "post_norm")  # a fresh process would start from the init
    result = train_head(cfg, trunk, resumed, teacher, None, tmp_path / "b")
    assert result.losses[0][0] == 11  # it really resumed: the first logged step is 11
    a, b = _params(straight), _params(resumed)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_training_is_deterministic_given_the_seed(trunk: Trunk, teacher: TeacherData, tmp_path: Path) -> None:
    runs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        head = build_head(trunk, "pre_norm")
        train_head(_cfg(tmp_path, steps=8, seed=seed), trunk, head, teacher, None, tmp_path / name)
        runs.append(_params(head))
    assert all(np.array_equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert not all(np.array_equal(runs[0][k], runs[2][k]) for k in runs[0])  # the seed orders the batches


def test_trained_head_beats_untrained_and_acceptance_is_a_probability(
    trunk: Trunk, teacher: TeacherData, tmp_path: Path
) -> None:
    held_out = _windows(6, seed=7)
    untrained = build_head(trunk, "post_norm")
    before = evaluate_acceptance(trunk, untrained, held_out, depths=3, origins=6)
    trained = build_head(trunk, "post_norm")
    train_head(_cfg(tmp_path, steps=120), trunk, trained, teacher, None, tmp_path / "ckpt")
    after = evaluate_acceptance(trunk, trained, held_out, depths=3, origins=6)
    for table in (before, after):
        assert set(table) == {"1", "2", "3"}
        assert all(0.0 <= v <= 1.0 for row in table.values() for v in row.values())
    assert after["1"]["0.0"] > before["1"]["0.0"] + 0.1, (before, after)
    assert after["1"]["0.7"] > before["1"]["0.7"] + 0.05, (before, after)


def test_acceptance_is_one_minus_total_variation() -> None:
    p = np.log(np.array([[0.5, 0.3, 0.2]]))
    q = np.log(np.array([[0.2, 0.3, 0.5]]))
    np.testing.assert_allclose(acceptance(p, q, 1.0), [0.7])
    assert acceptance(p, q, 0.0).tolist() == [0.0] and acceptance(p, p, 0.0).tolist() == [1.0]
    q_reduced = np.array([[np.log(0.5), -np.inf, np.log(0.5)]])  # a reduced draft vocabulary: q exactly 0
    np.testing.assert_allclose(acceptance(p, q_reduced, 1.0), [0.7])


def test_draft_vocab_choice_needs_both_kept_acceptance_and_a_real_speedup() -> None:
    def table(a0: float, a7: float) -> dict:
        return {"1": {"0.0": a0, "0.7": a7}}

    tables = {
        "full": table(0.70, 0.60),
        "top4096": table(0.65, 0.58),
        "top8192": table(0.695, 0.595),
        "top16384": table(0.70, 0.60),
    }
    assert (
        choose_draft_vocab(tables, {"full": 50.0, "top4096": 10.0, "top8192": 20.0, "top16384": 30.0})
        == "top8192"
    )
    assert (
        choose_draft_vocab(tables, {"full": 50.0, "top4096": 10.0, "top8192": 45.0, "top16384": 30.0})
        == "top16384"
    )
    assert (
        choose_draft_vocab(tables, {"full": 50.0, "top4096": 10.0, "top8192": 45.0, "top16384": 48.0})
        == "full"
    )


def test_reduced_vocab_head_never_proposes_outside_ids(trunk: Trunk, teacher: TeacherData) -> None:
    head = build_head(trunk, "post_norm")
    ids = frequent_ids(teacher, ROWS, 16, VOCAB)
    assert len(ids) == 16 and np.all(np.diff(ids) > 0)
    full = head.logits(head(mx.zeros((1, 3, 32)), mx.array([[1, 2, 3]])))
    head.set_draft_vocab(ids.tolist(), lm_head_matrix(trunk))
    reduced = np.asarray(head.logits(head(mx.zeros((1, 3, 32)), mx.array([[1, 2, 3]]))))
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    assert np.all(np.isneginf(reduced[..., outside]))
    np.testing.assert_allclose(reduced[..., ids], np.asarray(full)[..., ids], rtol=1e-5, atol=1e-5)


def test_sidecar_round_trip_and_fingerprint_refusal(
    trunk: Trunk, teacher: TeacherData, tmp_path: Path
) -> None:
    head = build_head(trunk, "pre_norm")
    train_head(_cfg(tmp_path, steps=5), trunk, head, teacher, None, tmp_path / "ckpt")
    head.set_draft_vocab(frequent_ids(teacher, ROWS, 20, VOCAB).tolist(), lm_head_matrix(trunk))
    out = tmp_path / "sidecar"
    save_forged_head(out, head, {"trunk_fingerprint": "abc123", "steps": 5})
    assert sorted(p.name for p in out.iterdir()) == [
        "head.safetensors",
        "manifest.json",
    ]  # no temp files left
    loaded = load_forged_head(out, trunk, "abc123")
    assert loaded.chain_source == "pre_norm"  # defaults to the hidden source and is persisted
    assert loaded.hidden_source == "pre_norm" and loaded.vocab_ids.tolist() == head.vocab_ids.tolist()
    x, t = mx.random.normal((1, 4, 32)), mx.array([[1, 2, 3, 4]])
    np.testing.assert_allclose(
        np.asarray(loaded.logits(loaded(x, t))), np.asarray(head.logits(head(x, t))), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(
        MtplxError, match=r"manifest\.json: head was forged for trunk abc123, not this trunk \(other\)"
    ):
        load_forged_head(out, trunk, "other")
    # Damaged weights are caught by the manifest's checksum, naming the file.
    (out / "head.safetensors").write_bytes((out / "head.safetensors").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(MtplxError, match=r"head\.safetensors: weights do not match"):
        load_forged_head(out, trunk, "abc123")
    (out / MANIFEST).write_text("{not json")
    with pytest.raises(MtplxError, match=r"manifest\.json: unreadable"):
        load_forged_head(out, trunk, "abc123")


def test_no_or_empty_training_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(MtplxError, match="no training data"):
        forge(None, tmp_path / "out", data=[])
    with pytest.raises(MtplxError, match=r"missing\.txt: training data not found"):
        forge(None, tmp_path / "out", data=[tmp_path / "missing.txt"])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(MtplxError, match=r"empty\.txt: training data is empty"):
        forge(None, tmp_path / "out", data=[empty])
    (tmp_path / "d").mkdir()
    with pytest.raises(MtplxError, match=r"d: no training files"):
        corpus_from_paths([tmp_path / "d"])
    bad = tmp_path / "chat.jsonl"
    bad.write_text('{"oops": 1}\n')
    with pytest.raises(MtplxError, match=r"chat\.jsonl:1: expected a JSON object"):
        corpus_from_paths([bad])
    assert not (tmp_path / "out").exists()  # nothing written on refusal


def _tiny_model_dir(path: Path) -> Path:
    """A tiny llama checkpoint with a character-level tokenizer and a ChatML template, as a user would have."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    chars = list("abcdefghijklmnopqrstuvwxyz .,\n") + ["<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": template,
            }
        )
    )
    trunk = _tiny_trunk(seed=3)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(trunk.model.parameters())))
    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "rope_theta": 10000.0,
        "eos_token_id": vocab["<|im_end|>"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_forge_end_to_end_on_a_user_model_and_data(tmp_path: Path) -> None:
    from mtplx.loading import load_model

    model_dir = _tiny_model_dir(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    words = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs.\n"
    for i in range(6):
        (data / f"t{i}.txt").write_text(words * (20 + i))
    (data / "chat.jsonl").write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "say the fox"},
                    {"role": "assistant", "content": words},
                ]
            }
        )
        + "\n"
    )
    with pytest.raises(MtplxError, match="draft_vocab must be"):
        forge(str(model_dir), tmp_path / "head", [data], draft_vocab="small")
    report = forge(
        str(model_dir),
        tmp_path / "head",
        [data],
        steps=12,
        train_tokens=2048,
        seq_len=32,
        eval_tokens=256,
        compare_steps=4,
        draft_vocab=20,
        eval_vocab_sizes=(24,),
        eval_origins=4,
        work_dir=tmp_path / "work",
        progress=False,
    )
    manifest = json.loads(report.manifest_path.read_text())
    assert manifest["steps"] == 12 and manifest["seed"] == 0 and manifest["depth_trained"] == 1
    assert set(manifest["hidden_source_comparison"]["depth1_acceptance_t0"]) == {"pre_norm", "post_norm"}
    assert manifest["hidden_source"] == report.hidden_source
    chain = manifest["chain_source_comparison"]["depth2_acceptance_t0"]
    assert manifest["chain_source"] == max(chain, key=chain.get)
    assert set(manifest["acceptance_by_draft_vocab"]) == {"full", "top20", "top24"}
    assert (
        manifest["acceptance"] == manifest["acceptance_by_draft_vocab"]["top20"]
        and len(manifest["vocab_ids"]) == 20
    )
    assert all(0.0 <= v <= 1.0 for row in manifest["acceptance"].values() for v in row.values())
    assert manifest["data"]["train_tokens"] == 2048
    # Only files whose text reached the training windows are listed (the rest stay unused).
    assert set(manifest["data"]["train_files"]) <= {str(data / f"t{i}.txt") for i in range(6)} | {
        str(data / "chat.jsonl")
    }
    assert 0 < len(manifest["data"]["train_files"]) < 7
    assert set(manifest["draft_step_ms"]) == {"full", "top20", "top24"}
    loaded = load_model(str(model_dir))
    head = load_forged_head(tmp_path / "head", Trunk(loaded.model), loaded.fingerprint)
    assert head.vocab_ids.tolist() == manifest["vocab_ids"]
    with pytest.raises(MtplxError, match="not this trunk"):
        load_forged_head(tmp_path / "head", Trunk(_tiny_trunk(seed=4).model), "0123456789abcdef")
