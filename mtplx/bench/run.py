"""The benchmark sweep as a library: stock mlx-lm vs mtplx AR vs mtplx MTP per depth.

How a sweep runs (and why):

* ONE process, ONE loaded model: stock ``mlx_lm.stream_generate`` runs on the
  very model object and tokenizer the mtplx engine uses, so weights, dtype,
  BLAS and allocator state are identical.
* Interleaved: for each repeat, for each prompt, for each setting, every
  variant runs once in turn (A B C A B C ...), so machine drift (thermal,
  other processes on a shared box) hits every variant alike.
* One untimed warm-up per (variant, setting) before the timed runs.
* Equal lengths: every variant bans the tokenizer's EOS ids through the same
  logit bias (``BAN_BIAS``; stock gets it through mlx-lm's own logits
  processor, mtplx through ``logit_bias``), so every run generates exactly
  ``max_tokens`` tokens at every temperature. ``ban_eos=False`` lets EOS end a
  run; rates are then over what was generated.
* Timing is taken here, identically for every variant, from the moments
  tokens reach the caller: prefill = prompt text -> first token (tokenization
  and chat template included for both: stock gets the engine's own encoding,
  done inside its timed region), decode = first token -> last token, decode tokens/s = (tokens - 1) / decode seconds
  (the first token is the prefill's). Engine-reported stats are used only for
  the counts the stream cannot see (verify cycles, accepted drafts).
* Per (variant, setting, repeat) the rate is total decode tokens / total
  decode seconds over all prompts; the quoted figure is the median over
  repeats, with min and max beside it. Ratios ("x stock", "x mtplx AR") are the
  median of paired ratios: each run against the baseline run of its own
  (repeat, prompt, setting) block, which ran seconds apart, so drift cancels.

Acceptance is reported per draft position as the conditional rate a_i =
P(draft i accepted | drafts 1..i-1 accepted); the theoretical tokens per cycle
is tau* = 1 + a_1 + a_1 a_2 + ... (what a cycle would commit on average given
those rates), and efficiency = (speedup over stock mlx-lm) / tau*: 1.0 would
mean a draft + verify cycle costs exactly one stock AR step.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from mtplx import resources
from mtplx.engine.tuned import machine_info
from mtplx.errors import MtplxError
from mtplx.io import atomic_write
from mtplx.spec_decode.settings import MAX_DEPTH

# Large but finite: -inf can turn into NaN in the filter pipeline (inf - inf).
BAN_BIAS = -1e9
KINDS = ("code", "prose", "chat", "grounded")
DRAFTS = ("head", "lookup", "auto")  # the drafters a sweep can compare (`mtplx.spec_decode`)
DEFAULT_DEPTHS = (1, 2, 3, 4)
DEFAULT_TEMPS = (0.0, 0.7)
DEFAULT_TOP_P = 0.95
DEFAULT_TOKENS = 256
DEFAULT_REPEATS = 3
DEFAULT_WARMUP_TOKENS = 32


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Setting:
    """One sampling setting; top_p is irrelevant (and recorded as 1.0) at temperature 0."""

    temperature: float
    top_p: float = 1.0

    @property
    def name(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return f"t{self.temperature:g}" + (f"-p{self.top_p:g}" if self.top_p < 1.0 else "")


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "code" | "prose" | "chat" (or anything a user file says)
    text: str | None = None  # raw continuation prompt
    messages: tuple[dict, ...] | None = None  # chat prompt (goes through the chat template)
    source: str = ""

    @property
    def engine_input(self) -> str | list[dict]:
        return list(self.messages) if self.messages is not None else self.text  # type: ignore[return-value]

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True)
class Variant:
    mode: str  # "stock" | "ar" | "mtp" (speculative)
    depth: int = 0
    draft: str = "head"  # the drafter of an "mtp" variant: "head" | "lookup" | "auto"
    threshold: float = 0.0  # > 0: adaptive head drafting, up to ``depth``, with this threshold

    @property
    def name(self) -> str:
        if self.mode == "mtp":
            if self.draft == "lookup":
                return "mtplx lookup"
            adaptive = f" adaptive {self.threshold:g}" if self.threshold > 0 else ""
            return f"mtplx {'MTP' if self.draft == 'head' else self.draft} d={self.depth}{adaptive}"
        return "mlx-lm stock" if self.mode == "stock" else "mtplx AR"


def make_settings(temps: Sequence[float], top_p: float = DEFAULT_TOP_P) -> list[Setting]:
    """One setting per temperature; ``top_p`` applies to the non-greedy ones."""
    if not temps:
        raise MtplxError("temps: give at least one temperature")
    if not 0.0 < top_p <= 1.0:
        raise MtplxError(f"top_p: must be in (0, 1], got {top_p}")
    settings = []
    for t in temps:
        if t < 0:
            raise MtplxError(f"temps: temperature must be >= 0, got {t}")
        setting = Setting(float(t), 1.0 if t == 0 else float(top_p))
        if setting not in settings:
            settings.append(setting)
    return settings


def parse_depths(spec: str | Sequence[int] | None) -> list[int]:
    """'1-4', '1,2,4', '0' / '' (AR only) or a sequence of ints -> sorted unique depths >= 1."""
    if spec is None:
        return list(DEFAULT_DEPTHS)
    if isinstance(spec, str):
        values: list[int] = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            try:
                if "-" in part[1:]:
                    lo, hi = part.split("-", 1)
                    values.extend(range(int(lo), int(hi) + 1))
                else:
                    values.append(int(part))
            except ValueError:
                raise MtplxError(
                    f"depths: cannot read {part!r} (use e.g. 1-4 or 1,2,3; 0 for AR only)"
                ) from None
    else:
        values = [int(v) for v in spec]
    if any(v < 0 for v in values):
        raise MtplxError(f"depths: must be >= 1 (0 = AR only), got {min(values)}")
    depths = sorted({v for v in values if v > 0})
    if depths and depths[-1] > MAX_DEPTH:
        raise MtplxError(f"depths: {depths[-1]} is more than the {MAX_DEPTH} drafts per cycle mtplx serves")
    return depths


def check_counts(tokens: int, repeats: int) -> None:
    if tokens <= 0:
        raise MtplxError(f"tokens: must be > 0, got {tokens}")
    if repeats <= 0:
        raise MtplxError(f"repeats: must be > 0, got {repeats}")


def default_prompts_path() -> Path:
    """The shipped suite, from an installed wheel or the source tree."""
    path = resources.prompt_suite()
    if path is None:
        raise MtplxError(
            f"prompt suite {resources.PROMPT_SUITE}: not found in the package or the source tree; pass --prompts FILE"
        )
    return path


def _prompt_from_json(obj: Any, where: str, index: int) -> Prompt:
    if not isinstance(obj, dict):
        raise MtplxError(f"{where}: expected a JSON object per line")
    kind = str(obj.get("kind", "prompt"))
    pid = str(obj.get("id", f"{kind}-{index}"))
    if "messages" in obj:
        messages = obj["messages"]
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and m.get("content") for m in messages)
        ):
            raise MtplxError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(pid, kind, messages=tuple(messages), source=str(obj.get("source", "")))
    text = obj.get("prompt", obj.get("text"))
    if not isinstance(text, str) or not text.strip():
        raise MtplxError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list")
    return Prompt(pid, kind, text=text, source=str(obj.get("source", "")))


def load_prompts(
    path: str | Path | None = None, *, kinds: Sequence[str] | None = None, per_kind: int | None = None
) -> list[Prompt]:
    """Read a prompt file: JSON lines ({id, kind, prompt | messages, source}) or, for any other
    suffix, plain text with one raw prompt per non-empty line. ``kinds`` / ``per_kind`` select."""
    path = Path(path) if path is not None else default_prompts_path()
    if not path.is_file():
        raise MtplxError(f"{path}: prompts file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise MtplxError(f"{path}: unreadable prompts file ({type(e).__name__})") from None
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise MtplxError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            prompts.append(_prompt_from_json(obj, f"{path}:{number}", len(prompts)))
        else:
            prompts.append(Prompt(f"line-{number}", "prompt", text=line.replace("\\n", "\n")))
    if not prompts:
        raise MtplxError(f"{path}: no prompts in the file")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise MtplxError(f"{path}: prompt ids repeat ({sorted({i for i in ids if ids.count(i) > 1})[0]!r})")
    return select_prompts(prompts, kinds, per_kind, str(path))


def select_prompts(
    prompts: Sequence[Prompt], kinds: Sequence[str] | None, per_kind: int | None, where: str = "prompts"
) -> list[Prompt]:
    if per_kind is not None and per_kind <= 0:
        raise MtplxError(f"per_kind: must be > 0, got {per_kind}")
    chosen = [p for p in prompts if kinds is None or p.kind in kinds]
    if not chosen:
        raise MtplxError(f"{where}: no prompts of kind {', '.join(kinds or [])}")
    if per_kind is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in chosen:
            seen[p.kind] = seen.get(p.kind, 0) + 1
            if seen[p.kind] <= per_kind:
                kept.append(p)
        chosen = kept
    return chosen


# ----------------------------------------------------------------------------- one run


@dataclass
class RunRecord:
    variant: str
    mode: str
    depth: int
    setting: str
    prompt_id: str
    kind: str
    repeat: int  # -1 = warm-up
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    cycles: int = 0  # MTP verify cycles after the first (prefill) token
    accepted_per_position: list[int] = field(default_factory=list)  # cycles whose drafts 1..i+1 were all kept
    tokens_in_cycles: int = 0  # tokens committed by those cycles
    peak_memory_gb: float = 0.0
    draft: str = "head"  # the drafter of an "mtp" run
    threshold: float = 0.0  # adaptive head drafting threshold (0 = fixed depth)
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # per drafter: drafted/accepted

    @property
    def decode_tokens_per_sec(self) -> float:
        return (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_sec(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0


class _Clock:
    """Arrival times of the first and the last token of one generation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last = self.start
        self.tokens = 0

    def tokens_arrived(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += count

    def split(self) -> tuple[float, float]:
        """(prefill seconds, decode seconds)."""
        first = self.first if self.first is not None else self.last
        return first - self.start, self.last - first


Runner = Callable[
    [Variant, Setting, Prompt, int, int, int], RunRecord
]  # (variant, setting, prompt, max_tokens, seed, repeat)


def ban_bias(tokenizer) -> dict[int, float]:
    return {int(t): BAN_BIAS for t in sorted(tokenizer.eos_token_ids)}


def run_stock(
    model,
    tokenizer,
    encode: Callable[[], list[int]],
    setting: Setting,
    max_tokens: int,
    seed: int,
    bias: dict[int, float] | None,
) -> tuple[_Clock, int, int, float]:
    """Stock ``mlx_lm.stream_generate``; returns (clock, prompt tokens, tokens kept, peak GB).

    ``encode`` (the engine's own tokenization + chat template) runs inside the timed
    prefill, as it does inside `Engine.stream`, so prefill is text -> first token for both.
    """
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temp=setting.temperature, top_p=setting.top_p if setting.top_p < 1.0 else 0.0)
    processors = make_logits_processors(logit_bias=bias) if bias else None
    mx.random.seed(seed)
    mx.reset_peak_memory()
    clock = _Clock()
    prompt_ids = encode()
    last = None
    for response in stream_generate(
        model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler, logits_processors=processors
    ):
        clock.tokens_arrived(1)
        last = response
    kept = clock.tokens
    if last is not None and last.finish_reason == "stop":
        kept -= 1  # stream_generate reports the EOS step itself; it is not a generated token
    return clock, len(prompt_ids), kept, mx.get_peak_memory() / 1e9


def make_runner(engine, *, ban_eos: bool = True) -> Runner:
    """A runner over one loaded `Engine` (stock mlx-lm uses the engine's model and tokenizer)."""
    bias = ban_bias(engine.tokenizer) if ban_eos else None
    prompt_lengths: dict[str, int] = {}

    def run(
        variant: Variant, setting: Setting, prompt: Prompt, max_tokens: int, seed: int, repeat: int
    ) -> RunRecord:
        def encode() -> list[int]:
            return engine.encode_prompt(prompt.engine_input, chat=prompt.is_chat)

        if prompt.id not in prompt_lengths:
            prompt_lengths[prompt.id] = len(encode())
        base = dict(
            variant=variant.name,
            mode=variant.mode,
            depth=variant.depth,
            draft=variant.draft,
            threshold=variant.threshold,
            setting=setting.name,
            prompt_id=prompt.id,
            kind=prompt.kind,
            repeat=repeat,
            prompt_tokens=prompt_lengths[prompt.id],
        )
        if variant.mode == "stock":
            clock, _, kept, peak = run_stock(
                engine.trunk.model, engine.tokenizer, encode, setting, max_tokens, seed, bias
            )
            prefill, decode = clock.split()
            return RunRecord(
                **base,
                generated_tokens=kept,
                prefill_seconds=prefill,
                decode_seconds=decode,
                peak_memory_gb=peak,
            )
        clock = _Clock()
        stats = None
        for chunk in engine.stream(
            prompt.engine_input,
            chat=prompt.is_chat,
            max_tokens=max_tokens,
            temperature=setting.temperature,
            top_p=setting.top_p,
            logit_bias=bias,
            seed=seed,
            draft=variant.draft if variant.mode == "mtp" else "none",
            depth=variant.depth if variant.mode == "mtp" and variant.depth else None,
            **({"adaptive_threshold": variant.threshold} if variant.threshold > 0 else {}),
        ):
            clock.tokens_arrived(len(chunk.token_ids))
            stats = chunk.stats
        prefill, decode = clock.split()
        record = RunRecord(
            **base,
            generated_tokens=clock.tokens,
            prefill_seconds=prefill,
            decode_seconds=decode,
            peak_memory_gb=float(getattr(stats, "peak_memory_gb", 0.0) or 0.0),
        )
        if variant.mode == "mtp" and stats is not None:
            record.cycles = int(stats.cycles)
            record.tokens_in_cycles = round(stats.tokens_per_cycle * stats.cycles)
            record.drafters = {name: dict(counts) for name, counts in stats.drafters.items()}
            if variant.draft == "head" and variant.threshold == 0:  # fixed-length blocks only
                record.accepted_per_position = accepted_counts(
                    stats.acceptance_per_position, stats.cycles, variant.depth
                )
        return record

    return run


def accepted_counts(acceptance_per_position: Sequence[float], cycles: int, depth: int) -> list[int]:
    """Engine stats -> counts. The engine reports, per position i, (cycles whose first i+1 drafts
    were all accepted) / (cycles that drafted position i); every cycle drafts all ``depth``
    positions, so the denominator is ``cycles``."""
    counts = [round(a * cycles) for a in acceptance_per_position]
    return (counts + [0] * depth)[:depth]


# ----------------------------------------------------------------------------- the sweep


@dataclass
class SweepPlan:
    variants: list[Variant]
    settings: list[Setting]
    prompts: list[Prompt]
    max_tokens: int
    repeats: int
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS
    seed: int = 0

    @property
    def total_runs(self) -> int:
        warmups = len(self.variants) * len(self.settings) if self.warmup_tokens > 0 else 0
        return warmups + len(self.variants) * len(self.settings) * len(self.prompts) * self.repeats


def make_variants(
    depths: Sequence[int],
    *,
    stock: bool = True,
    drafts: Sequence[str] = ("head",),
    thresholds: Sequence[float] = (),
) -> list[Variant]:
    """Stock, AR, then per drafter: the head and auto at each depth, lookup once (no depth);
    with ``thresholds``, adaptive head drafting up to the largest depth, one per threshold."""
    speculative = []
    for draft in drafts:
        if draft == "lookup":
            speculative.append(Variant("mtp", 0, "lookup"))
        else:
            speculative += [Variant("mtp", d, draft) for d in depths]
    if depths:
        speculative += [Variant("mtp", max(depths), "head", t) for t in thresholds]
    return ([Variant("stock")] if stock else []) + [Variant("ar")] + speculative


def parse_drafts(spec: str | Sequence[str] | None) -> list[str]:
    """'head,lookup,auto' -> the drafters to sweep (default: the head only)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or ["head"])
    drafts = [d.strip() for d in items if d.strip()]
    unknown = [d for d in drafts if d not in DRAFTS]
    if unknown or not drafts:
        raise MtplxError(f"drafts: must be a comma-separated subset of {','.join(DRAFTS)}, got {spec!r}")
    return list(dict.fromkeys(drafts))


def run_sweep(
    runner: Runner, plan: SweepPlan, on_run: Callable[[RunRecord], None] | None = None
) -> list[RunRecord]:
    """Warm-ups, then repeats x prompts x settings x variants with the variant loop innermost.

    The seed depends on (repeat, prompt) only, so at a given temperature every variant
    samples with the same seed (MTP still draws different uniforms: equal in law, not in value).
    """
    records: list[RunRecord] = []

    def note(record: RunRecord) -> None:
        if on_run is not None:
            on_run(record)

    if plan.warmup_tokens > 0:
        for setting in plan.settings:
            for variant in plan.variants:
                note(
                    runner(
                        variant,
                        setting,
                        plan.prompts[0],
                        min(plan.warmup_tokens, plan.max_tokens),
                        plan.seed,
                        -1,
                    )
                )
    for repeat in range(plan.repeats):
        for p_index, prompt in enumerate(plan.prompts):
            seed = plan.seed + 1000 * (repeat + 1) + p_index
            for setting in plan.settings:
                for variant in plan.variants:
                    record = runner(variant, setting, prompt, plan.max_tokens, seed, repeat)
                    records.append(record)
                    note(record)
    return records


# ----------------------------------------------------------------------------- summary


def conditional_acceptance(cumulative: Sequence[float]) -> list[float]:
    """P(all of drafts 1..i kept) per i -> P(draft i kept | drafts 1..i-1 kept)."""
    out, previous = [], 1.0
    for c in cumulative:
        out.append(c / previous if previous > 0 else 0.0)
        previous = c
    return out


def theoretical_tau(conditional: Sequence[float]) -> float:
    """Expected tokens per cycle, 1 + a1 + a1*a2 + ...: the verify step always yields one token."""
    tau, reach = 1.0, 1.0
    for a in conditional:
        reach *= a
        tau += reach
    return tau


@dataclass
class Summary:
    variant: str
    mode: str
    depth: int
    setting: str
    decode_tps: float  # median over repeats
    decode_tps_min: float
    decode_tps_max: float
    spread: float  # (max - min) / median over repeats: the run-to-run noise
    prefill_tps: float  # median over repeats
    generated_tokens: int  # all timed runs together
    peak_memory_gb: float
    ratio_to_stock: float | None = None  # median of paired (same-block) ratios
    ratio_to_ar: float | None = None  # likewise
    acceptance: list[float] = field(default_factory=list)  # conditional, per draft position
    acceptance_cumulative: list[float] = field(default_factory=list)
    tau: float | None = None  # measured tokens per verify cycle
    tau_theory: float | None = None
    efficiency: float | None = None  # ratio_to_stock / tau_theory
    draft: str = "head"
    threshold: float = 0.0
    kind: str = "all"  # the prompt kind summarized, or "all"
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)  # drafted/accepted, all runs


def _per_repeat_rates(records: Sequence[RunRecord]) -> tuple[list[float], list[float]]:
    """(decode, prefill) tokens/s per repeat, pooled over prompts."""
    decode, prefill = [], []
    for repeat in sorted({r.repeat for r in records}):
        rs = [r for r in records if r.repeat == repeat]
        d_seconds = sum(r.decode_seconds for r in rs)
        p_seconds = sum(r.prefill_seconds for r in rs)
        decode.append(sum(r.generated_tokens - 1 for r in rs) / d_seconds if d_seconds > 0 else 0.0)
        prefill.append(sum(r.prompt_tokens for r in rs) / p_seconds if p_seconds > 0 else 0.0)
    return decode, prefill


def summarize_group(records: Sequence[RunRecord]) -> Summary:
    first = records[0]
    decode, prefill = _per_repeat_rates(records)
    median = statistics.median(decode)
    summary = Summary(
        variant=first.variant,
        mode=first.mode,
        depth=first.depth,
        setting=first.setting,
        decode_tps=median,
        decode_tps_min=min(decode),
        decode_tps_max=max(decode),
        spread=(max(decode) - min(decode)) / median if median > 0 else 0.0,
        prefill_tps=statistics.median(prefill),
        generated_tokens=sum(r.generated_tokens for r in records),
        peak_memory_gb=max(r.peak_memory_gb for r in records),
        draft=first.draft,
        threshold=first.threshold,
    )
    for r in records:
        for name, counts in r.drafters.items():
            total = summary.drafters.setdefault(name, {"drafted": 0, "accepted": 0})
            total["drafted"] += counts.get("drafted", 0)
            total["accepted"] += counts.get("accepted", 0)
    cycles = sum(r.cycles for r in records)
    if first.mode == "mtp" and cycles > 0:
        summary.tau = sum(r.tokens_in_cycles for r in records) / cycles
    if first.mode == "mtp" and cycles > 0 and first.draft == "head" and first.threshold == 0:
        accepted = [sum(r.accepted_per_position[i] for r in records) for i in range(first.depth)]
        summary.acceptance_cumulative = [a / cycles for a in accepted]
        summary.acceptance = conditional_acceptance(summary.acceptance_cumulative)
        summary.tau_theory = theoretical_tau(summary.acceptance)
    return summary


def paired_ratios(records: Sequence[RunRecord], baseline_mode: str) -> dict[tuple[str, str], list[float]]:
    """Per (setting, variant): decode-rate ratios to the baseline run of the same block.

    A block is one (repeat, prompt, setting): its variants ran back to back, so machine
    drift (other jobs, thermals) mostly cancels in the ratio, which a ratio of medians
    taken minutes apart does not get."""
    blocks: dict[tuple[int, str, str], list[RunRecord]] = {}
    for r in records:
        blocks.setdefault((r.repeat, r.prompt_id, r.setting), []).append(r)
    ratios: dict[tuple[str, str], list[float]] = {}
    for block in blocks.values():
        base = next((r for r in block if r.mode == baseline_mode), None)
        if base is None or base.decode_tokens_per_sec <= 0:
            continue
        for r in block:
            ratios.setdefault((r.setting, r.variant), []).append(
                r.decode_tokens_per_sec / base.decode_tokens_per_sec
            )
    return ratios


def summarize_by_kind(records: Sequence[RunRecord]) -> list[Summary]:
    """`summarize` per prompt kind (each kind's own paired ratios), kinds in run order."""
    kinds = list(dict.fromkeys(r.kind for r in records if r.repeat >= 0))
    out = []
    for kind in kinds:
        for s in summarize([r for r in records if r.kind == kind]):
            s.kind = kind
            out.append(s)
    return out


def summarize(records: Sequence[RunRecord]) -> list[Summary]:
    """One `Summary` per (setting, variant), in run order. Ratios to stock and to mtplx AR are
    medians of paired (same-block) ratios; efficiency uses the ratio to stock."""
    timed = [r for r in records if r.repeat >= 0]
    groups: dict[tuple[str, str], list[RunRecord]] = {}
    for r in timed:
        groups.setdefault((r.setting, r.variant), []).append(r)
    summaries = [summarize_group(g) for g in groups.values()]
    to_stock, to_ar = paired_ratios(timed, "stock"), paired_ratios(timed, "ar")
    for s in summaries:
        if to_stock.get((s.setting, s.variant)):
            s.ratio_to_stock = statistics.median(to_stock[(s.setting, s.variant)])
        if to_ar.get((s.setting, s.variant)):
            s.ratio_to_ar = statistics.median(to_ar[(s.setting, s.variant)])
        if s.tau_theory and s.ratio_to_stock is not None:
            s.efficiency = s.ratio_to_stock / s.tau_theory
    return summaries


def records_from_document(document: dict[str, Any]) -> list[RunRecord]:
    """The timed runs of a saved JSON result (to re-summarize or re-plot without re-running)."""
    names = {f.name for f in fields(RunRecord)}
    try:
        return [RunRecord(**{k: v for k, v in run.items() if k in names}) for run in document["runs"]]
    except (KeyError, TypeError) as e:
        raise MtplxError(f"not an mtplx bench result ({type(e).__name__}: {e})") from None


# ----------------------------------------------------------------------------- reports


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _drafter_counts(s: Summary) -> str:
    parts = [f"{name} {c['accepted']}/{c['drafted']}" for name, c in s.drafters.items() if c.get("drafted")]
    return ", ".join(parts) or "-"


def markdown_table(summaries: Sequence[Summary]) -> str:
    """The results table; with a kind column when the summaries are per prompt kind, and a
    drafters column (accepted/drafted per drafter) when a sweep compares drafters."""
    by_kind = any(s.kind != "all" for s in summaries)
    drafters = any(s.draft != "head" for s in summaries if s.mode == "mtp")
    header = (
        ("| kind " if by_kind else "")
        + "| setting | variant | decode tok/s (median [min-max]) | prefill tok/s | x stock (paired) "
        "| x mtplx AR (paired) | acceptance per position | tau | tau theory | efficiency | peak GB |"
        + (" drafters (accepted/drafted) |" if drafters else "")
    )
    rows = [header, "|" + "---|" * (11 + by_kind + drafters)]
    for s in summaries:
        acceptance = "[" + ", ".join(f"{a:.2f}" for a in s.acceptance) + "]" if s.acceptance else "-"
        rows.append(
            (f"| {s.kind} " if by_kind else "")
            + f"| {s.setting} | {s.variant} | {s.decode_tps:.2f} [{s.decode_tps_min:.2f}-{s.decode_tps_max:.2f}] "
            f"| {s.prefill_tps:.1f} | {_fmt(s.ratio_to_stock, '.2f', 'x')} | {_fmt(s.ratio_to_ar, '.2f', 'x')} "
            f"| {acceptance} | {_fmt(s.tau, '.2f')} | {_fmt(s.tau_theory, '.2f')} | {_fmt(s.efficiency, '.2f')} "
            f"| {s.peak_memory_gb:.3f} |" + (f" {_drafter_counts(s)} |" if drafters else "")
        )
    return "\n".join(rows)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in ("mlx", "mlx-lm", "mtplx"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _head_weights_sha(head: str | None, model: str | None) -> str | None:
    """The forged head's weights hash from its manifest (which head was measured), if there is one."""
    try:
        from mtplx.checkpoints import load as loading

        head_dir = (
            Path(head)
            if head is not None
            else (resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME) if model is None else None)
        )
        if head_dir is None:
            return None
        return json.loads((head_dir / "manifest.json").read_text(encoding="utf-8")).get("weights_sha256")
    except (OSError, ValueError, ImportError, AttributeError):
        return None


def result_document(
    summaries: Sequence[Summary], records: Sequence[RunRecord], plan: SweepPlan, context: dict[str, Any]
) -> dict[str, Any]:
    return {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "versions": _versions(),
        "machine": machine_info(),
        **context,
        "plan": {
            "max_tokens": plan.max_tokens,
            "repeats": plan.repeats,
            "warmup_tokens": plan.warmup_tokens,
            "seed": plan.seed,
            "variants": [v.name for v in plan.variants],
            "settings": [asdict(s) | {"name": s.name} for s in plan.settings],
            "prompts": [{"id": p.id, "kind": p.kind, "source": p.source} for p in plan.prompts],
        },
        "summary": [asdict(s) for s in summaries],
        "runs": [
            asdict(r)
            | {
                "decode_tokens_per_sec": r.decode_tokens_per_sec,
                "prefill_tokens_per_sec": r.prefill_tokens_per_sec,
            }
            for r in records
        ],
    }


def write_json(path: str | Path, document: dict[str, Any]) -> None:
    text = json.dumps(document, indent=1)
    with atomic_write(path) as handle:
        handle.write(text + "\n")


def write_plot(path: str | Path, summaries: Sequence[Summary], title: str = "") -> None:
    """Left: decode tokens/s by depth (0 = mtplx AR), one line per setting with min-max bars,
    stock mlx-lm as a dashed line in the same colour. Right: the paired speed-up over stock
    by depth (drift cancels there, so it is the panel to read on a busy machine)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and no GUI backend import on a server
        import matplotlib.pyplot as plt
    except ImportError:
        raise MtplxError(
            "plot: matplotlib is not installed (pip install 'mtplx[plot]'), or pass --no-plot"
        ) from None
    fig, (ax, ax_ratio) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=120)
    try:
        settings = list(dict.fromkeys(s.setting for s in summaries))
        # The depth axis is the head's; lookup/auto rows are in the tables, not the plot.
        summaries = [s for s in summaries if s.mode != "mtp" or (s.draft == "head" and s.threshold == 0)]
        depths = sorted({s.depth for s in summaries if s.mode in ("ar", "mtp")}) or [0]
        for index, setting in enumerate(settings):
            color = f"C{index}"
            ours = sorted(
                (s for s in summaries if s.setting == setting and s.mode in ("ar", "mtp")),
                key=lambda s: s.depth,
            )
            if ours:
                xs = [s.depth for s in ours]
                err = [
                    [s.decode_tps - s.decode_tps_min for s in ours],
                    [s.decode_tps_max - s.decode_tps for s in ours],
                ]
                ax.errorbar(
                    xs,
                    [s.decode_tps for s in ours],
                    yerr=err,
                    color=color,
                    marker="o",
                    capsize=3,
                    label=f"mtplx, {setting}",
                )
                ratios = [(s.depth, s.ratio_to_stock) for s in ours if s.ratio_to_stock is not None]
                if ratios:
                    ax_ratio.plot(
                        [d for d, _ in ratios], [r for _, r in ratios], color=color, marker="o", label=setting
                    )
            stock = next((s for s in summaries if s.setting == setting and s.mode == "stock"), None)
            if stock is not None:
                ax.axhline(
                    stock.decode_tps,
                    color=color,
                    linestyle="--",
                    linewidth=1,
                    label=f"stock mlx-lm, {setting}",
                )
        ax.set_ylabel("decode tokens/s (median, min-max bars)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax_ratio.axhline(1.0, color="black", linestyle="--", linewidth=1, label="stock mlx-lm")
        ax_ratio.set_ylabel("speed-up over stock mlx-lm (paired median)")
        ax_ratio.legend(fontsize=8)
        for a in (ax, ax_ratio):
            a.set_xlabel("MTP depth (0 = mtplx AR)")
            a.set_xticks(depths)
            a.grid(alpha=0.3)
        if title:
            fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        with atomic_write(path, "wb") as handle:
            fig.savefig(handle, format="png")
    finally:
        plt.close(fig)


# ----------------------------------------------------------------------------- entry points


def check_depths_servable(engine, depths: Sequence[int]) -> None:
    """One-line error for depths this engine's head cannot serve."""
    if not depths:
        return
    if getattr(engine, "head", None) is None:
        raise MtplxError(
            "depths: this model has no MTP head (AR only): pass --depths 0, or give --head / forge one"
        )
    limit = getattr(engine.head, "max_depth", None)
    if limit is not None and max(depths) > int(limit):
        raise MtplxError(f"depths: this head serves depths 1..{int(limit)}, not {max(depths)}")


def check_prompts_fit(engine, prompts: Sequence[Prompt], max_tokens: int) -> None:
    """Encode every prompt up front, so a prompt that is empty or too long fails before an hour of runs."""
    limit = engine._context_length() if hasattr(engine, "_context_length") else None
    for prompt in prompts:
        ids = engine.encode_prompt(prompt.engine_input, chat=prompt.is_chat)
        if limit is not None and len(ids) + max_tokens > limit:
            raise MtplxError(
                f"prompt {prompt.id}: {len(ids)} tokens + {max_tokens} exceed the context of {limit}"
            )


def _progress(total: int, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="run", file=sys.stderr, dynamic_ncols=True)


def run_benchmark(
    engine,
    *,
    depths: Sequence[int] = DEFAULT_DEPTHS,
    tokens: int = DEFAULT_TOKENS,
    repeats: int = DEFAULT_REPEATS,
    prompts: Sequence[Prompt] | None = None,
    temps: Sequence[float] = DEFAULT_TEMPS,
    top_p: float = DEFAULT_TOP_P,
    stock: bool = True,
    ban_eos: bool = True,
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
    seed: int = 0,
    progress: bool = True,
    runner: Runner | None = None,
    desc: str = "bench",
    drafts: Sequence[str] = ("head",),
    thresholds: Sequence[float] = (),
) -> tuple[list[Summary], list[RunRecord], SweepPlan]:
    """Validate everything, then run the interleaved sweep on a loaded engine."""
    check_counts(tokens, repeats)
    if warmup_tokens < 0:
        raise MtplxError(f"warmup_tokens: must be >= 0, got {warmup_tokens}")
    depths = parse_depths(list(depths))
    drafts = parse_drafts(list(drafts))
    if any(d != "lookup" for d in drafts):  # lookup alone needs no head
        check_depths_servable(engine, depths)
    prompts = list(prompts) if prompts is not None else load_prompts()
    if not prompts:
        raise MtplxError("prompts: none given")
    check_prompts_fit(engine, prompts, tokens)
    plan = SweepPlan(
        make_variants(depths, stock=stock, drafts=drafts, thresholds=thresholds),
        make_settings(temps, top_p),
        prompts,
        tokens,
        repeats,
        warmup_tokens,
        seed,
    )
    runner = runner or make_runner(engine, ban_eos=ban_eos)
    with _progress(plan.total_runs, progress, desc) as bar:

        def on_run(record: RunRecord) -> None:
            bar.set_postfix_str(f"{record.variant} {record.setting} {record.decode_tokens_per_sec:.1f} tok/s")
            bar.update(1)

        records = run_sweep(runner, plan, on_run)
    return summarize(records), records, plan


def bench_main(
    *,
    model: str | None = None,
    head: str | None = None,
    depths: str | Sequence[int] | None = None,
    tokens: int = DEFAULT_TOKENS,
    repeats: int = DEFAULT_REPEATS,
    prompts_file: str | None = None,
    kinds: Sequence[str] | None = None,
    per_kind: int | None = None,
    temps: Sequence[float] = DEFAULT_TEMPS,
    top_p: float = DEFAULT_TOP_P,
    json_path: str | None = "bench.json",
    plot_path: str | None = "bench.png",
    stock: bool = True,
    ban_eos: bool = True,
    warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
    seed: int = 0,
    progress: bool = True,
    engine=None,
    out=None,
    drafts: str | Sequence[str] | None = None,
    thresholds: Sequence[float] = (),
) -> int:
    """`mtplx bench`: load, sweep, print the markdown table, write JSON and PNG (atomically).

    Validation happens before the model loads where it can (counts, depths, prompts file),
    so a typo costs no load time. Returns the process exit code.
    """
    out = out or sys.stdout
    check_counts(tokens, repeats)
    commit = _git_commit()  # now: files (a head, the engine) may change in the tree while the sweep runs
    depth_list = parse_depths(depths)
    draft_list = parse_drafts(drafts)
    threshold_list = check_thresholds(thresholds, depth_list)
    settings = make_settings(temps, top_p)
    prompt_list = load_prompts(prompts_file, kinds=kinds, per_kind=per_kind)
    if engine is None:
        from mtplx.engine.engine import Engine

        # An explicit depth, so loading never consults the tune config (the sweep sets depths itself).
        engine = Engine.load(model, head=head, depth=depth_list[0] if depth_list else 1)
    head_sha = _head_weights_sha(head, model)
    summaries, records, plan = run_benchmark(
        engine,
        depths=depth_list,
        tokens=tokens,
        repeats=repeats,
        prompts=prompt_list,
        temps=[s.temperature for s in settings],
        top_p=top_p,
        stock=stock,
        ban_eos=ban_eos,
        warmup_tokens=warmup_tokens,
        seed=seed,
        progress=progress,
        drafts=draft_list,
        thresholds=threshold_list,
    )
    context = {
        "model": str(model) if model is not None else "default (SmolLM2-135M-Instruct)",
        "model_path": str(getattr(engine, "model_path", "") or ""),
        "head": head,
        "commit": commit,
        "head_weights_sha256": head_sha,
        "fingerprint": getattr(engine, "fingerprint", ""),
        "ban_eos": ban_eos,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
    }
    document = result_document(summaries, records, plan, context)
    print(markdown_table(summaries), file=out)
    if len({p.kind for p in prompt_list}) > 1:
        print("\nper prompt kind:\n\n" + markdown_table(summarize_by_kind(records)), file=out)
    if json_path:
        write_json(json_path, document)
        print(f"\nwrote {json_path}", file=out)
    if plot_path:
        machine = document["machine"]
        write_plot(
            plot_path,
            summaries,
            f"{context['model']} | {machine['cpu']} ({machine['cores']} cores, "
            f"{machine['device']}) | {tokens} tokens, median of {repeats}",
        )
        print(f"wrote {plot_path}", file=out)
    return 0


def report_main(
    json_path: str | Path, *, plot_path: str | None = None, update_json: bool = False, out=None
) -> int:
    """Re-summarize a saved result (`mtplx bench --report FILE`): print the table, optionally
    re-plot it and rewrite the JSON's summary with this version's summary rules."""
    out = out or sys.stdout
    path = Path(json_path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MtplxError(f"{path}: unreadable bench result ({type(e).__name__})") from None
    if not isinstance(document, dict):
        raise MtplxError(f"{path}: not an mtplx bench result")
    records = records_from_document(document)
    summaries = summarize(records)
    print(markdown_table(summaries), file=out)
    if len({r.kind for r in records}) > 1:
        print("\nper prompt kind:\n\n" + markdown_table(summarize_by_kind(records)), file=out)
    if plot_path:
        machine = document.get("machine", {})
        plan = document.get("plan", {})
        write_plot(
            plot_path,
            summaries,
            f"{document.get('model', '')} | {machine.get('cpu', '?')} ({machine.get('cores', '?')} "
            f"cores, {machine.get('device', '?')}) | {plan.get('max_tokens', '?')} tokens, "
            f"median of {plan.get('repeats', '?')}",
        )
    if update_json:
        document["summary"] = [asdict(s) for s in summaries]
        write_json(path, document)
    return 0


# ----------------------------------------------------------------------------- CLI glue


def _floats(text: str, name: str = "temps", example: str = "0,0.7") -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MtplxError(f"{name}: cannot read {text!r} (use e.g. {example})") from None


def check_thresholds(thresholds: Sequence[float], depths: Sequence[int]) -> list[float]:
    """Adaptive-length thresholds to sweep: each in (0, 1), and a depth to stop short of."""
    bad = next((t for t in thresholds if not 0.0 < t < 1.0), None)
    if bad is not None:
        raise MtplxError(f"thresholds: each must be in (0, 1), got {bad:g}")
    if thresholds and not any(d > 0 for d in depths):
        raise MtplxError("thresholds: adaptive drafting needs an MTP depth (--depths) to stop short of")
    return list(dict.fromkeys(thresholds))


def add_bench_args(parser) -> None:
    """The `mtplx bench` flags (shared by benchmarks/bench_generate.py)."""
    parser.add_argument(
        "--model", default=None, help="local path or Hugging Face repo id (default: the embedded model)"
    )
    parser.add_argument(
        "--head", default=None, help="a forged MTP head directory (default: the model's own head)"
    )
    parser.add_argument(
        "--depths", default="1-4", help="MTP depths to sweep, e.g. 1-4 or 1,2,4; 0 = AR only (default 1-4)"
    )
    parser.add_argument(
        "--tokens", type=int, default=DEFAULT_TOKENS, help=f"tokens per generation (default {DEFAULT_TOKENS})"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed repeats; the median is quoted (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="prompts: .jsonl ({id, kind, prompt|messages}) or one raw prompt per line (default: the shipped suite)",
    )
    parser.add_argument("--kinds", default=None, help="comma-separated prompt kinds to keep, e.g. code,chat")
    parser.add_argument(
        "--drafts",
        default="head",
        help=f"drafters to compare, a subset of {','.join(DRAFTS)} (default head; lookup runs once, no depth)",
    )
    parser.add_argument(
        "--thresholds",
        default="",
        help="adaptive head drafting to compare, one variant per threshold, each up to the largest "
        "depth, e.g. 0.2,0.4 (default none)",
    )
    parser.add_argument("--per-kind", type=int, default=None, help="keep the first N prompts of each kind")
    parser.add_argument("--temps", default="0,0.7", help="comma-separated temperatures (default 0,0.7)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=DEFAULT_TOP_P,
        help=f"top-p at non-zero temperatures (default {DEFAULT_TOP_P})",
    )
    parser.add_argument(
        "--json", dest="json_path", default="bench.json", help="JSON output (default bench.json)"
    )
    parser.add_argument("--plot", dest="plot_path", default=None, help="PNG output (default bench.png)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock mlx-lm baseline")
    parser.add_argument(
        "--allow-eos",
        action="store_true",
        help="let EOS end a generation (default: EOS banned for every variant alike)",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=DEFAULT_WARMUP_TOKENS,
        help="tokens per untimed warm-up run (0 = none)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--report",
        default=None,
        metavar="JSON",
        help="no run: re-print the table of a saved result (and re-plot it with --plot)",
    )


def bench_from_args(args) -> int:
    if getattr(args, "report", None):
        return report_main(args.report, plot_path=None if args.no_plot else args.plot_path)
    return bench_main(
        model=args.model,
        head=args.head,
        depths=args.depths,
        tokens=args.tokens,
        repeats=args.repeats,
        prompts_file=args.prompts,
        kinds=args.kinds.split(",") if args.kinds else None,
        per_kind=args.per_kind,
        temps=_floats(args.temps),
        top_p=args.top_p,
        json_path=args.json_path or None,
        plot_path=None if args.no_plot else (args.plot_path or "bench.png"),
        stock=not args.no_stock,
        ban_eos=not args.allow_eos,
        warmup_tokens=args.warmup_tokens,
        seed=args.seed,
        progress=not args.no_progress,
        drafts=args.drafts,
        thresholds=_floats(args.thresholds, "thresholds", "0.2,0.4"),
    )
