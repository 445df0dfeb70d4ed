"""mtplx.bench and its commands (bench, tune): reports, formulas, bad input, interruption, the tune config.

Fast: a fake engine (scripted chunks and stats) for the bookkeeping, and one real
sweep on a tiny random llama + head with a character-level tokenizer. Nothing here
asserts on speed; timing values are only checked for being present and positive.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import mtplx  # noqa: F401  (BLAS before mlx)
from mtplx.bench import tune
from mtplx.bench.report import markdown_table, result_document, write_json
from mtplx.bench.run import bench_main, report_main, run_benchmark
from mtplx.bench.runners import BAN_BIAS, accepted_counts, ban_bias
from mtplx.bench.stats import Summary, conditional_acceptance, summarize, summarize_by_kind, theoretical_tau
from mtplx.bench.suite import Prompt, load_prompts
from mtplx.bench.sweep import (
    RunRecord,
    SweepPlan,
    make_settings,
    make_variants,
    parse_depths,
    parse_drafts,
    run_sweep,
)
from mtplx.cli import bench as bench_cli
from mtplx.cli import tune as tune_cli
from mtplx.engine import tuned
from mtplx.errors import MtplxError
from mtplx.io import atomic_write
from mtplx.spec_decode.draft_policy import CostProfile

import pytest
from support.optional import import_or_skip

# ----------------------------------------------------------------------------- fakes


@dataclass
class FakeStats:
    cycles: int = 0
    tokens_per_cycle: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    peak_memory_gb: float = 0.01
    drafters: dict = field(default_factory=dict)


@dataclass
class FakeChunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: FakeStats


class FakeTokenizer:
    eos_token_ids = {0}


class FakeHead:
    def __init__(self, max_depth: int | None = None):
        if max_depth is not None:
            self.max_depth = max_depth


class FakeEngine:
    """Scripted: MTP at depth d commits d tokens + 1 per cycle with cumulative acceptance 1.0, ..."""

    def __init__(self, head: object = "scripted", interrupt_after: int | None = None):
        self.tokenizer = FakeTokenizer()
        self.head = FakeHead() if head == "scripted" else head
        self.fingerprint = "fakefingerprint0"
        self.model_path = Path("/fake/model")
        self.calls: list[dict] = []
        self.interrupt_after = interrupt_after

    context_length = 10_000

    def batch_cost_profile(self, remeasure: bool = False) -> CostProfile:
        return CostProfile((1, 8), (0.01, 0.02))

    def encode_prompt(self, prompt, chat=None) -> list[int]:
        if not prompt:
            raise MtplxError("prompt: is empty")
        return [5] * 7

    def stream(self, prompt, request):
        """Records the request's fields under the API's names, then scripts a generation."""
        max_tokens, draft, depth = request.max_tokens, request.drafting.kind, request.drafting.depth
        kwargs = dict(
            temperature=request.sampler.temperature,
            top_p=request.sampler.top_p,
            logit_bias=dict(request.sampler.logit_bias or {}),
            seed=request.seed,
            chat=request.chat,
            adaptive_threshold=request.drafting.adaptive_threshold,
        )
        mtp = draft != "none"
        self.calls.append(dict(kwargs, max_tokens=max_tokens, mtp=mtp, depth=depth, draft=draft))
        if self.interrupt_after is not None and len(self.calls) > self.interrupt_after:
            raise KeyboardInterrupt
        stats = FakeStats()
        yield FakeChunk("a", [1], None, stats)
        produced, step = 1, ((depth or 4) + 1 if mtp else 1)  # lookup: blocks of 4
        while produced < max_tokens:
            n = min(step, max_tokens - produced)
            produced += n
            if mtp:
                stats.cycles += 1
                stats.tokens_per_cycle = float(step)
                stats.acceptance_per_position = [1.0] * (depth or 4)
            yield FakeChunk("b" * n, [2] * n, "length" if produced >= max_tokens else None, stats)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message and message
    return message


# ----------------------------------------------------------------------------- formulas


def test_theoretical_tau_matches_hand_computed_example():
    # a = (0.8, 0.5, 0.25): 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25 = 1 + 0.8 + 0.4 + 0.1 = 2.3
    assert theoretical_tau([0.8, 0.5, 0.25]) == pytest.approx(2.3)
    assert theoretical_tau([]) == 1.0
    assert theoretical_tau([1.0, 1.0]) == 3.0


def test_conditional_acceptance_from_cumulative_engine_rates():
    # engine: P(drafts 1..i all kept) = 0.8, 0.4, 0.1 -> conditional 0.8, 0.5, 0.25
    assert conditional_acceptance([0.8, 0.4, 0.1]) == pytest.approx([0.8, 0.5, 0.25])
    assert conditional_acceptance([0.0, 0.0]) == [0.0, 0.0]
    cumulative = [0.9, 0.6, 0.3]
    # theory from conditionals equals 1 + sum of the cumulative rates
    assert theoretical_tau(conditional_acceptance(cumulative)) == pytest.approx(1 + sum(cumulative))


def test_accepted_counts_pads_to_depth():
    assert accepted_counts([0.5, 0.25], 8, 3) == [4, 2, 0]


def _record(variant, mode, depth, setting, repeat, seconds, *, tokens=11, cycles=0, accepted=(), in_cycles=0):
    return RunRecord(
        variant=variant,
        mode=mode,
        depth=depth,
        setting=setting,
        prompt_id="p",
        kind="code",
        repeat=repeat,
        prompt_tokens=10,
        generated_tokens=tokens,
        prefill_seconds=1.0,
        decode_seconds=seconds,
        cycles=cycles,
        accepted_per_position=list(accepted),
        tokens_in_cycles=in_cycles,
        peak_memory_gb=0.5,
    )


def test_summary_medians_ratios_and_efficiency():
    records = []
    for repeat, (stock_s, mtp_s) in enumerate([(1.0, 0.5), (2.0, 0.4), (1.25, 1.0)]):
        records.append(_record("mlx-lm stock", "stock", 0, "greedy", repeat, stock_s))
        # 10 cycles, position 1 kept 8 times, positions 1+2 kept 4 times -> a = (0.8, 0.5), tau* = 2.2
        records.append(
            _record(
                "mtplx MTP d=2", "mtp", 2, "greedy", repeat, mtp_s, cycles=10, accepted=(8, 4), in_cycles=22
            )
        )
    records.append(_record("mtplx MTP d=2", "mtp", 2, "greedy", -1, 99.0))  # warm-up: ignored
    stock, mtp = summarize(records)
    assert stock.decode_tps == pytest.approx(8.0)  # rates 10, 5, 8 -> median 8
    assert (stock.decode_tps_min, stock.decode_tps_max) == pytest.approx((5.0, 10.0))
    assert mtp.decode_tps == pytest.approx(20.0)  # rates 20, 25, 10
    assert mtp.ratio_to_stock == pytest.approx(2.0)  # paired per repeat: 20/10, 25/5, 10/8 -> median 2.0
    assert mtp.acceptance == pytest.approx([0.8, 0.5])
    assert mtp.tau == pytest.approx(2.2)
    assert mtp.tau_theory == pytest.approx(2.2)
    assert mtp.efficiency == pytest.approx(2.0 / 2.2)
    assert mtp.spread == pytest.approx((25 - 10) / 20)
    table = markdown_table([stock, mtp])
    assert "| greedy | mtplx MTP d=2 | 20.00 [10.00-25.00]" in table and "[0.80, 0.50]" in table


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "spec, expected", [("1-3", [1, 2, 3]), ("3,1,3", [1, 3]), ("0", []), ("", []), ([2, 1], [1, 2])]
)
def test_parse_depths(spec, expected):
    assert parse_depths(spec) == expected


@pytest.mark.parametrize("spec", ["-1", "a", "1-x", "17", [0, -2]])
def test_bad_depths_are_one_line_errors(spec):
    with pytest.raises(MtplxError) as err:
        parse_depths(spec)
    assert "depths" in _one_line(err)


@pytest.mark.parametrize("tokens, repeats", [(0, 3), (-5, 3), (16, 0), (16, -1)])
def test_zero_or_negative_counts_fail_before_loading(tokens, repeats):
    with pytest.raises(MtplxError) as err:  # model=None would take seconds to load: it must not get there
        bench_main(tokens=tokens, repeats=repeats, engine=None, model="/definitely/not/loaded")
    assert ("tokens" if tokens <= 0 else "repeats") in _one_line(err)


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("", "no prompts"),
        ("\n  \n", "no prompts"),
        ('{"kind": "code", "prompt": "x"}\n{bad\n', ":2: not valid JSON"),
        ('{"kind": "code", "prompt": ""}\n', "non-empty"),
        ('{"kind": "chat", "messages": []}\n', "messages"),
    ],
)
def test_bad_prompt_files(tmp_path, content, fragment):
    path = _write(tmp_path, "p.jsonl", content)
    with pytest.raises(MtplxError) as err:
        load_prompts(path)
    assert fragment in _one_line(err) and str(path) in str(err.value)


def test_missing_prompt_file_and_unknown_kind(tmp_path):
    with pytest.raises(MtplxError) as err:
        load_prompts(tmp_path / "nope.jsonl")
    assert "not found" in _one_line(err)
    with pytest.raises(MtplxError) as err:
        load_prompts(kinds=["poetry"])
    assert "no prompts of kind poetry" in _one_line(err)


def test_text_prompt_file_one_prompt_per_line(tmp_path):
    prompts = load_prompts(_write(tmp_path, "p.txt", "first\n\nsecond\\nline\n"))
    assert [p.text for p in prompts] == ["first", "second\nline"]


def test_unknown_model_is_a_one_line_error(tmp_path):
    with pytest.raises(MtplxError) as err:
        bench_main(
            model=str(tmp_path / "no-such-model"),
            tokens=4,
            repeats=1,
            json_path=None,
            plot_path=None,
            progress=False,
        )
    assert "no-such-model" in _one_line(err)


def test_depth_the_head_cannot_serve():
    with pytest.raises(MtplxError) as err:
        run_benchmark(FakeEngine(head=None), depths=[1], tokens=4, repeats=1, progress=False)
    assert "no MTP head" in _one_line(err)
    with pytest.raises(MtplxError) as err:
        run_benchmark(
            FakeEngine(head=FakeHead(max_depth=2)), depths=[1, 3], tokens=4, repeats=1, progress=False
        )
    assert "serves depths 1..2" in _one_line(err)


def test_prompt_too_long_for_context_fails_before_running():
    engine = FakeEngine()
    engine.context_length = 20
    with pytest.raises(MtplxError) as err:
        run_benchmark(engine, depths=[1], tokens=16, repeats=1, progress=False)
    assert "exceed the context" in _one_line(err)
    assert engine.calls == []


# ----------------------------------------------------------------------------- the sweep


def test_shipped_suite_has_four_kinds_of_real_prompts():
    prompts = load_prompts()
    kinds = [p.kind for p in prompts]
    assert {k: kinds.count(k) for k in set(kinds)} == {"code": 4, "prose": 4, "grounded": 4, "chat": 4}
    assert all(p.source for p in prompts)
    assert all(len(p.text) > 200 for p in prompts if p.kind in ("code", "prose"))
    # Input-grounded: a long given text (code or passage) that the answer is asked to copy from.
    assert all(p.is_chat and len(p.messages[0]["content"]) > 400 for p in prompts if p.kind == "grounded")
    assert [p.kind for p in load_prompts(per_kind=1)] == ["code", "prose", "grounded", "chat"]


def test_sweep_is_interleaved_with_one_warmup_each_and_shared_seeds():
    calls = []

    def runner(variant, setting, prompt, max_tokens, seed, repeat):
        calls.append((variant.name, setting.name, prompt.id, max_tokens, seed, repeat))
        return _record(variant.name, variant.mode, variant.depth, setting.name, repeat, 1.0)

    prompts = [
        Prompt("a", "code", text="x"),
        Prompt("b", "chat", messages=({"role": "user", "content": "y"},)),
    ]
    plan = SweepPlan(make_variants([1, 2]), make_settings([0.0, 0.7]), prompts, 16, 2, warmup_tokens=4)
    records = run_sweep(runner, plan)
    assert len(calls) == plan.total_runs == 2 * 4 + 2 * 2 * 2 * 4
    warmups, timed = calls[:8], calls[8:]
    assert all(c[5] == -1 and c[3] == 4 for c in warmups)
    names = ["mlx-lm stock", "mtplx AR", "mtplx MTP d=1", "mtplx MTP d=2"]
    assert [c[0] for c in timed] == names * 8  # A B C D A B C D ...
    for block in range(0, len(timed), 4):  # one (repeat, prompt, setting) block: identical seed and settings
        assert len({(c[1], c[2], c[4]) for c in timed[block : block + 4]}) == 1
    assert len({c[4] for c in timed}) == 4  # seeds differ per (repeat, prompt)
    assert len(records) == len(timed)


def test_fake_engine_sweep_passes_eos_ban_and_counts_cycles():
    engine = FakeEngine()
    prompts = load_prompts(per_kind=1)
    summaries, records, _ = run_benchmark(
        engine,
        depths=[2],
        tokens=13,
        repeats=1,
        prompts=prompts,
        temps=[0.7],
        stock=False,
        warmup_tokens=0,
        progress=False,
    )
    assert all(c["logit_bias"] == {0: BAN_BIAS} for c in engine.calls)
    assert all(c["temperature"] == 0.7 and c["top_p"] == 0.95 for c in engine.calls)
    assert all(r.generated_tokens == 13 for r in records)
    mtp = [s for s in summaries if s.mode == "mtp"][0]
    assert mtp.acceptance == [1.0, 1.0] and mtp.tau == 3.0
    assert [s.mode for s in summaries] == ["ar", "mtp"]


def test_sweep_compares_drafters_and_reports_per_kind():
    engine = FakeEngine()
    prompts = load_prompts(per_kind=1)
    summaries, records, plan = run_benchmark(
        engine,
        depths=[2],
        tokens=9,
        repeats=1,
        prompts=prompts,
        temps=[0.0],
        stock=False,
        warmup_tokens=0,
        progress=False,
        drafts=["head", "lookup", "auto"],
    )
    assert [v.name for v in plan.variants] == ["mtplx AR", "mtplx MTP d=2", "mtplx lookup", "mtplx auto d=2"]
    assert {(c["draft"], c["depth"]) for c in engine.calls} == {
        ("none", None),
        ("head", 2),
        ("lookup", None),
        ("auto", 2),
    }
    # Acceptance per position only for the fixed-length head blocks.
    assert [bool(s.acceptance) for s in summaries] == [False, True, False, False]
    per_kind = summarize_by_kind(records)
    assert [s.kind for s in per_kind] == [k for k in ("code", "prose", "grounded", "chat") for _ in range(4)]
    table = markdown_table(per_kind)
    assert table.splitlines()[0].startswith("| kind |") and "drafters" in table.splitlines()[0]
    with pytest.raises(MtplxError, match="drafts"):
        parse_drafts("head,ngram")
    # A block drafter is one variant, like lookup (its trained block, cut by the cost model).
    variants = make_variants([1, 2], stock=False, drafts=parse_drafts("head,dflash"))
    assert [(v.depth, v.draft) for v in variants[1:]] == [(1, "head"), (2, "head"), (0, "dflash")]
    assert variants[-1].name == "mtplx dflash"


def test_interrupted_sweep_writes_nothing(tmp_path):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    with pytest.raises(KeyboardInterrupt):
        bench_main(
            engine=FakeEngine(interrupt_after=5),
            depths="1",
            tokens=8,
            repeats=2,
            stock=False,
            json_path=str(out_json),
            plot_path=str(out_png),
            progress=False,
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mode", ["w", "wb"])
def test_atomic_write_keeps_old_file_when_interrupted_mid_write(tmp_path, mode):
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target, mode) as handle:
            handle.write("half" if mode == "w" else b"half")
            raise KeyboardInterrupt
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_fake_engine_bench_main_writes_table_json_and_png(tmp_path, capsys):
    import_or_skip("matplotlib", "the plot extra: pip install 'mtplx[plot]'")
    out_json, out_png = tmp_path / "sub" / "r.json", tmp_path / "r.png"
    code = bench_main(
        engine=FakeEngine(),
        depths="1-2",
        tokens=9,
        repeats=2,
        stock=False,
        per_kind=1,
        json_path=str(out_json),
        plot_path=str(out_png),
        progress=False,
    )
    assert code == 0
    table = capsys.readouterr().out
    assert "| t0.7-p0.95 | mtplx MTP d=2 |" in table and "| greedy | mtplx AR |" in table
    doc = json.loads(out_json.read_text())
    assert doc["plan"]["max_tokens"] == 9 and len(doc["summary"]) == 6 and doc["machine"]["cores"] >= 1
    assert len(doc["runs"]) == 6 * 4 * 2  # timed runs over 4 prompts (warm-ups are not results)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- a real tiny model


@pytest.fixture(scope="module")
def tiny_engine():
    from mtplx.engine.engine import Engine
    from mtplx.heads.qwen3_next import Qwen3NextMTPHead

    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from support import models
    from support.tokenizer import printable_chars

    chars, vocab = printable_chars()
    model = models.tiny_llama(vocab, seed=3)
    engine = Engine(
        model, TokenizerWrapper(chars), {"max_position_embeddings": 4096}, fingerprint="tinyfingerprint1"
    )
    engine.head = Qwen3NextMTPHead([llama.TransformerBlock(model.args)], 32, eps=1e-5, trunk=engine.trunk)
    engine.depth = 2
    mx.eval(model.parameters(), engine.head.parameters())
    return engine


def test_real_tiny_sweep_stock_ar_and_mtp(tiny_engine, tmp_path, capsys):
    # No plot here (the fake engine's test draws one): this sweep runs without matplotlib.
    prompts = [
        Prompt("c", "code", text="def f(x):\n    return"),
        Prompt("q", "chat", messages=({"role": "user", "content": "Hi there"},)),
    ]
    summaries, records, plan = run_benchmark(
        tiny_engine,
        depths=[1, 2],
        tokens=12,
        repeats=2,
        prompts=prompts,
        temps=[0.0, 0.7],
        warmup_tokens=4,
        progress=False,
    )
    assert [s.variant for s in summaries[:4]] == [
        "mlx-lm stock",
        "mtplx AR",
        "mtplx MTP d=1",
        "mtplx MTP d=2",
    ]
    # EOS is banned for every variant alike, so every timed run has the full length
    assert {r.generated_tokens for r in records if r.repeat >= 0} == {12}
    assert all(s.decode_tps > 0 and s.prefill_tps > 0 and s.ratio_to_stock is not None for s in summaries)
    for s in (s for s in summaries if s.mode == "mtp"):
        assert len(s.acceptance) == s.depth and all(0.0 <= a <= 1.0 for a in s.acceptance)
        assert 1.0 <= s.tau <= s.depth + 1 and s.efficiency is not None
    write_json(tmp_path / "r.json", result_document(summaries, records, plan, {"model": "tiny"}))
    assert json.loads((tmp_path / "r.json").read_text())["summary"][0]["variant"] == "mlx-lm stock"


def test_real_tiny_greedy_stock_and_mtplx_generate_the_same_tokens(tiny_engine):
    # Same model, same prompt ids, greedy: stock mlx-lm, mtplx AR and MTP must agree (a fair comparison).
    from mlx_lm import stream_generate

    ids = tiny_engine.encode_prompt("abc")
    bias = ban_bias(tiny_engine.tokenizer)
    from mlx_lm.sample_utils import make_logits_processors

    stock = [
        r.token
        for r in stream_generate(
            tiny_engine.trunk.model,
            tiny_engine.tokenizer,
            ids,
            max_tokens=10,
            logits_processors=make_logits_processors(logit_bias=bias),
        )
    ]
    ar = tiny_engine.generate("abc", max_tokens=10, mtp=False, logit_bias=bias).token_ids
    mtp = tiny_engine.generate("abc", max_tokens=10, depth=2, logit_bias=bias).token_ids
    assert stock == ar == mtp


# ----------------------------------------------------------------------------- tune


def _summary(mode, depth, setting, tps, spread=0.02):
    name = {"ar": "mtplx AR", "mtp": f"mtplx MTP d={depth}"}[mode]
    return Summary(
        variant=name,
        mode=mode,
        depth=depth,
        setting=setting,
        decode_tps=tps,
        decode_tps_min=tps,
        decode_tps_max=tps,
        spread=spread,
        prefill_tps=1.0,
        generated_tokens=1,
        peak_memory_gb=0.0,
    )


def test_choose_threshold_compares_adaptive_with_the_best_fixed_depth():
    def adaptive(threshold, setting, tps):
        row = _summary("mtp", 4, setting, tps)
        row.threshold = threshold
        return row

    rows = [
        _summary("ar", 0, "greedy", 10),
        _summary("ar", 0, "t0.7", 10),
        _summary("mtp", 2, "greedy", 20),  # best fixed: geometric mean 2.0
        _summary("mtp", 2, "t0.7", 20),
        _summary("mtp", 4, "greedy", 15),
        _summary("mtp", 4, "t0.7", 15),
        adaptive(0.2, "greedy", 22),  # 2.2 -> 1.1x the best fixed depth
        adaptive(0.2, "t0.7", 22),
        adaptive(0.4, "greedy", 30),  # 2.0: the t0.7 row halves it
        adaptive(0.4, "t0.7", 13.3333),
    ]
    threshold, versus_fixed = tune.choose_threshold(rows)
    assert threshold == 0.2 and versus_fixed == pytest.approx(1.1)
    assert tune.choose_depth(rows)[0] == 2  # adaptive rows do not count as fixed depths
    assert tune.choose_threshold(rows[:6]) == (None, 0.0)


def test_choose_depth_picks_best_geometric_mean_and_respects_noise():
    rows = [
        _summary("ar", 0, "greedy", 10),
        _summary("ar", 0, "t0.7", 10),
        _summary("mtp", 1, "greedy", 14),
        _summary("mtp", 1, "t0.7", 12),
        _summary("mtp", 2, "greedy", 20),
        _summary("mtp", 2, "t0.7", 9),
    ]
    depth, margin, noise = tune.choose_depth(rows)
    assert depth == 2 and margin == pytest.approx((2.0 * 0.9) ** 0.5 - 1) and noise == 0.02
    noisy = [_summary(s.mode, s.depth, s.setting, s.decode_tps, spread=0.5) for s in rows]
    assert tune.choose_depth(noisy)[0] == 0  # a 34% win inside a 50% spread is no win
    slower = [_summary("ar", 0, "greedy", 10), _summary("mtp", 1, "greedy", 8)]
    assert tune.choose_depth(slower)[0] == 0


def test_tune_config_save_read_show_and_corrupt(tmp_path, capsys):
    config = tmp_path / "cfg" / "tune.json"
    assert tuned.saved_depth("fp", config) is None
    tuned.save_entry("fp", {"depth": 3, "model": "m", "margin_over_ar": 0.5, "spread": 0.05}, config)
    tuned.save_entry("other", {"depth": 0, "model": "n"}, config)
    assert tuned.saved_depth("fp", config) == 3
    assert tuned.saved_depth("other", config) == 0
    assert (
        tuned.saved_depth("fp", config) is not None
        and tuned.saved_entry("fp", config, machine="elsewhere") is None
    )
    shown = tune.show_text(config)
    assert "depth 3" in shown and "AR (no depth beat it)" in shown and shown.count("\n* ") == 2
    config.write_text("{not json")
    assert tuned.saved_depth("fp", config) is None  # never blocks Engine.load
    assert "unreadable tune config" in capsys.readouterr().err
    with pytest.raises(MtplxError) as err:
        tune.show_text(config)
    assert "unreadable" in _one_line(err)


def test_tune_main_saves_then_keeps_then_retunes(tmp_path, capsys, monkeypatch):
    config = tmp_path / "tune.json"
    engine = FakeEngine()
    identity = {"head": "FakeHead:0"}
    monkeypatch.setattr(tune, "batch_cost_identity", lambda engine: identity)
    # A start saved only its batch cost profile here: not a tuned entry, so tune runs.
    profile_only = {"batch_cost": CostProfile((1,), (0.5,)).as_dict(), "batch_cost_for": identity}
    tuned.save_entry(engine.fingerprint, profile_only, config)
    assert "not tuned" in tune.show_text(config)
    assert (
        tune.tune_main(engine=engine, config_path=config, depths="1-2", tokens=6, repeats=2, progress=False)
        == 0
    )
    first_calls = len(engine.calls)
    assert first_calls > 0 and all(c["depth"] in (None, 1, 2) for c in engine.calls)
    depth = tuned.saved_depth(engine.fingerprint, config)
    assert depth in (0, 1, 2)
    assert tuned.saved_batch_cost(engine.fingerprint, config, identity) == engine.batch_cost_profile()
    assert "saved to" in capsys.readouterr().out
    tune.tune_main(engine=engine, config_path=config, progress=False)
    assert "already tuned" in capsys.readouterr().out and len(engine.calls) == first_calls
    tune.tune_main(
        engine=engine, config_path=config, depths="1", tokens=6, repeats=2, retune=True, progress=False
    )
    assert len(engine.calls) > first_calls
    tune.tune_main(show=True, config_path=config)
    assert "fakefingerprint0" in capsys.readouterr().out


def test_report_re_renders_a_saved_result(tmp_path, capsys):
    out_json = tmp_path / "r.json"
    bench_main(
        engine=FakeEngine(),
        depths="1",
        tokens=5,
        repeats=2,
        stock=False,
        per_kind=1,
        json_path=str(out_json),
        plot_path=None,
        progress=False,
    )
    table = capsys.readouterr().out.split("\n\nwrote")[0].strip()
    assert report_main(out_json) == 0
    assert capsys.readouterr().out.strip() == table
    out_json.write_text('{"runs": [{"variant": 1}]}')
    with pytest.raises(MtplxError) as err:
        report_main(out_json)
    assert "not an mtplx bench result" in _one_line(err)


def test_cli_glue_parses_flags():
    parser = argparse.ArgumentParser()
    bench_cli.add_args(parser)
    args = parser.parse_args(["--tokens", "0", "--depths", "1,3", "--temps", "0,0.7,1.0", "--no-plot"])
    with pytest.raises(MtplxError):
        bench_cli.run(args)
    tparser = argparse.ArgumentParser()
    tune_cli.add_args(tparser)
    targs = tparser.parse_args(["--show", "--config", "/nonexistent/x.json"])
    assert tune_cli.run(targs) == 0


@pytest.mark.parametrize(
    "thresholds, depths, fragment",
    [((1.5,), "1-3", "(0, 1)"), ((0.0,), "1-3", "(0, 1)"), ((-0.2,), "2", "(0, 1)"), ((0.3,), "0", "depth")],
)
def test_bad_adaptive_thresholds_fail_before_loading(thresholds, depths, fragment):
    with pytest.raises(MtplxError) as err:  # model would take seconds to load: it must not get there
        bench_main(depths=depths, thresholds=thresholds, model="/definitely/not/loaded")
    line = _one_line(err)
    assert line.startswith("thresholds:") and fragment in line


def test_thresholds_flag_adds_one_adaptive_variant_per_threshold_at_the_largest_depth(capsys):
    parser = argparse.ArgumentParser()
    bench_cli.add_args(parser)
    with pytest.raises(MtplxError, match="thresholds: cannot read"):
        bench_cli.run(parser.parse_args(["--thresholds", "0.2,high", "--no-plot"]))
    code = bench_main(
        engine=FakeEngine(),
        depths="1-2",
        thresholds=(0.3, 0.5, 0.3),
        tokens=9,
        repeats=1,
        stock=False,
        per_kind=1,
        temps=[0.0],
        json_path=None,
        plot_path=None,
        progress=False,
    )
    assert code == 0
    table = capsys.readouterr().out.split("per prompt kind")[0]
    rows = [line for line in table.splitlines() if "adaptive" in line]
    assert len(rows) == 2 and all("d=2 adaptive" in r for r in rows), table
    assert any("adaptive 0.3" in r for r in rows) and any("adaptive 0.5" in r for r in rows)
