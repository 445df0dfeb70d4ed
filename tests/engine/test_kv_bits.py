"""`--kv-bits` / `--kv-group-size` / `--quantized-kv-start` through `Engine.load` and the command
line: a mixed batch of quantized rows (`Engine.generate_batch`) gives each greedy speculating row
the tokens plain decoding gives alone with the same flags, with drafts rejected; a later start
decodes one row at a time across it; bad values are one-line errors naming the flag.

A tiny random MiMo checkpoint (an MTP head of its own) with one attention head of dimension 32,
the default model's tokenizer. At this size (one head, prompts of 1-7 tokens) the float
differences between groupings of positions do not reach a quantization boundary, so these check
the conversion, batching and rollback mechanics by equality; quantized KV is not invariant to
grouping in general, which test_kv_bits_grouping.py shows and the README states.
"""

from __future__ import annotations

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.engine import Engine
from mtplx.engine.request import GenerationRequest
from mtplx.errors import MtplxError
from mtplx.spec_decode.rows import check_batch_support
from mtplx.trunk.batch_cache import BatchCache

import pytest
from mlx_lm.models.cache import QuantizedKVCache
from support import checkpoints
from support.cli import run_main

_req = GenerationRequest.from_kwargs
PROMPTS = [[5, 9, 2, 11, 7], [3, 3, 8], [12, 1, 4, 4, 9, 10, 2], [6], [7, 2, 7, 2, 7, 2]]
KV = dict(kv_group_size=32, quantized_kv_start=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp("kvbits") / "mimo"
    checkpoints.mimo(path, seed=1, num_heads=1)
    checkpoints.copy_tokenizer(default_model_dir, path)
    return path


def _requests(seed: int = 7) -> list[GenerationRequest]:
    """Greedy head rows of two depths, a greedy AR row, a seeded sampled head row, greedy lookup."""
    return [
        _req(max_tokens=16, temperature=0.0, draft="head", depth=2),
        _req(max_tokens=14, temperature=0.0, draft="head", depth=3),
        _req(max_tokens=12, temperature=0.0, draft="none"),
        _req(max_tokens=12, temperature=1.0, seed=seed, draft="head", depth=2),
        _req(max_tokens=12, temperature=0.0, draft="auto"),
    ]


def _ar(request: GenerationRequest) -> GenerationRequest:
    return _req(max_tokens=request.max_tokens, temperature=0.0, draft="none")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_mixed_quantized_batch_gives_plain_decodings_tokens(model_dir, bits):
    engine = Engine.load(str(model_dir), mtp=True, depth=2, kv_bits=bits, **KV)
    assert all(type(c) is QuantizedKVCache for c in engine.trunk.make_cache())
    requests = _requests()
    assert check_batch_support(engine.trunk, engine.head) is None  # quantized rows batch
    batched = engine.generate_batch(PROMPTS, requests, max_rows=4, draft_policy="fixed")
    for i, (prompt, request) in enumerate(zip(PROMPTS, requests)):
        if request.sampler.temperature == 0:
            assert batched[i].token_ids == engine.generate(prompt, _ar(request)).token_ids, i
    sampled = engine.generate(PROMPTS[3], requests[3])  # seeded, pinned depth: the same alone
    assert batched[3].token_ids == sampled.token_ids
    head = [r.stats.drafters.get("head", {}) for r in batched[:2]]
    assert all(h.get("drafted", 0) > h.get("accepted", 0) for h in head), head  # rejections happened


def test_the_batch_comparison_catches_quantized_rows_not_rolled_back(model_dir, monkeypatch):
    """Negative control: a batch whose rows keep the whole block (rejected drafts included)."""
    engine = Engine.load(str(model_dir), mtp=True, depth=2, kv_bits=4, **KV)
    requests = _requests()[:2]
    alone = [engine.generate(p, _ar(r)).token_ids for p, r in zip(PROMPTS, requests)]
    honest = BatchCache.commit_block
    monkeypatch.setattr(
        BatchCache,
        "commit_block",
        lambda self, block, keep: honest(self, block, [block.block_len] * len(keep)),
    )
    batched = engine.generate_batch(PROMPTS[:2], requests, max_rows=2, draft_policy="fixed")
    assert [b.token_ids for b in batched] != alone


def test_a_later_start_decodes_one_row_at_a_time_and_gives_plain_decodings_tokens(model_dir):
    """quantized_kv_start 9: rows convert while decoding (blocks crossing it), one at a time."""
    engine = Engine.load(str(model_dir), mtp=True, depth=3, kv_bits=4, kv_group_size=32, quantized_kv_start=9)
    request = _req(max_tokens=16, temperature=0.0, draft="head", depth=3)
    assert "position 9" in (check_batch_support(engine.trunk, engine.head) or "")
    batched = engine.generate_batch(PROMPTS[:3], [request] * 3, draft_policy="fixed")
    for prompt, got in zip(PROMPTS, batched):
        assert got.token_ids == engine.generate(prompt, _ar(request)).token_ids


@pytest.mark.parametrize("start", [0, 9])
def test_the_prompt_cache_reuses_quantized_entries_with_the_same_tokens(model_dir, start):
    """A second turn (the first's prompt and reply, then more) reuses the stored quantized caches
    (start 9: converted while the first turn decoded) and gives the tokens a fresh prefill gives."""
    engine = Engine.load(
        str(model_dir),
        mtp=True,
        depth=2,
        kv_bits=4,
        kv_group_size=32,
        quantized_kv_start=start,
        prompt_cache_bytes=1 << 30,
    )
    request = _req(max_tokens=10, temperature=0.0, draft="head", depth=2)
    first = engine.generate(PROMPTS[2], request)
    second_prompt = PROMPTS[2] + first.token_ids + [3, 1]
    cached = engine.generate(second_prompt, request)
    assert cached.stats.cached_tokens >= len(PROMPTS[2]), cached.stats.cached_tokens
    engine.prompt_cache.clear()
    fresh = engine.generate(second_prompt, request)
    assert fresh.stats.cached_tokens == 0 and cached.token_ids == fresh.token_ids


def test_bad_kv_flags_are_one_line_errors_naming_the_flag(model_dir, tmp_path):
    with pytest.raises(MtplxError, match=r"^kv_group_size: 64 does not fit"):
        Engine.load(str(model_dir), mtp=True, kv_bits=4)  # head dimension 32: no group of 64
    hybrid = tmp_path / "qwen3_5"
    checkpoints.qwen3_5(hybrid, seed=1)
    checkpoints.copy_tokenizer(model_dir, hybrid)
    with pytest.raises(MtplxError, match=r"^quantized_kv_start must be 0 for this model"):
        Engine.load(str(hybrid), mtp=False, kv_bits=4, kv_group_size=32, quantized_kv_start=100)
    for flags, message in [
        (["--kv-bits", "7"], "--kv-bits must be one of 2, 3, 4, 5, 6, 8 (got 7)"),
        (["--kv-bits", "4", "--kv-group-size", "48"], "--kv-group-size must be one of 32, 64, 128 (got 48)"),
        (["--kv-bits", "4", "--quantized-kv-start", "-1"], "--quantized-kv-start must be >= 0 (got -1)"),
    ]:
        code, out, err = _outcome("generate", "--model", str(model_dir), "-p", "12", *flags)
        assert code != 0 and err.strip() == f"mtplx: error: {message}", err


def test_generate_chat_and_serve_take_the_kv_flags(default_model_dir):
    """`generate` decodes with them (the default model: groups of 64 fit its heads of 64, and MTP
    gives AR's greedy text); `chat` and `serve` parse them (their decode is the engine's)."""
    texts = []
    for mtp in ("--mtp", "--no-mtp"):
        flags = ("--kv-bits", "4", "--quantized-kv-start", "3")  # inside the prompt: its prefill splits
        code, out, err = _outcome(
            "generate", "-p", "The capital of France is", "--raw", "-m", "6", mtp, *flags
        )
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1] and "Paris" in texts[0], texts
    from mtplx.cli.main import _build_parser as build_parser

    for command in ("chat", "serve"):
        args = build_parser().parse_args([command, "--kv-bits", "4", *_cli(KV)])
        assert (args.kv_bits, args.kv_group_size, args.quantized_kv_start) == (4, 32, 0)


def _cli(flags: dict) -> list[str]:
    return [part for k, v in flags.items() for part in (f"--{k.replace('_', '-')}", str(v))]


def _outcome(*args: str) -> tuple[int, str, str]:
    out = run_main(*args)
    return out.returncode, out.stdout, out.stderr


def test_inspect_and_doctor_print_the_default_models_kv_bytes_per_token(default_model_dir):
    """SmolLM2-135M: 30 layers, 3 KV heads of 64 (float32 build). Per token, K and V: float32
    2*30*3*64*4 = 46080 B; 8-bit 2*30*3*(64 + 2*4) = 12960 B (a float32 scale and bias per group
    of 64); 4-bit 2*30*3*(32 + 8) = 7200 B."""
    from mtplx.cli.doctor import check_kv_cache

    code, out, err = _outcome("inspect")
    assert code == 0, err
    assert "kv cache      per token: float32 46.1 KB, 8-bit 13.0 KB, 4-bit 7.2 KB" in out, out
    assert check_kv_cache().data == {"float32": 46080, "8-bit": 12960, "4-bit": 7200}
