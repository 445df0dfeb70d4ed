"""The benchmark sweep: what is compared (variants x settings x prompts) and the order it runs in.

* Interleaved: for each repeat, for each prompt, for each setting, every variant runs
  once in turn (A B C A B C ...), so machine drift (thermal, other processes on a
  shared box) hits every variant alike.
* One untimed warm-up per (variant, setting) before the timed runs.
* The seed depends on (repeat, prompt) only, so within a block every variant samples
  with the same seed.

A `Runner` times one generation and returns its `RunRecord` (`mtplx.bench.runners` has
the one over a loaded engine); the sweep only orders the calls. Every parser here
raises a one-line `MtplxError` naming the field, before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mtplx.bench.suite import Prompt
from mtplx.errors import MtplxError
from mtplx.sample.params import Setting
from mtplx.spec_decode.settings import MAX_DEPTH
from mtplx.spec_decode.sources import DrafterKind

# The drafters a sweep can compare (`mtplx.spec_decode`); a block drafter's needs the model
# loaded with one (beside it, or --head DIR).
BLOCK_DRAFTS = ("dflash", "dflash2", "dspark", "eagle3")
DRAFTS = ("head", "lookup", "auto", *BLOCK_DRAFTS)
DEFAULT_DEPTHS = (1, 2, 3, 4)
DEFAULT_TEMPS = (0.0, 0.7)
DEFAULT_TOP_P = 0.95
DEFAULT_TOKENS = 256
DEFAULT_REPEATS = 3
DEFAULT_WARMUP_TOKENS = 32


@dataclass(frozen=True)
class Variant:
    """One thing a sweep times: stock mlx-lm, mtplx AR, or mtplx speculative with one drafter."""

    mode: str  # "stock" | "ar" | "mtp" (speculative)
    depth: int = 0
    draft: str = "head"  # the drafter of an "mtp" variant: one of DRAFTS
    threshold: float = 0.0  # > 0: adaptive head drafting, up to ``depth``, with this threshold

    @property
    def name(self) -> str:
        if self.mode == "mtp":
            if self.draft == DrafterKind.LOOKUP or self.draft in BLOCK_DRAFTS:
                return f"mtplx {self.draft}"
            adaptive = f" adaptive {self.threshold:g}" if self.threshold > 0 else ""
            return f"mtplx {'MTP' if self.draft == DrafterKind.HEAD else self.draft} d={self.depth}{adaptive}"
        return "mlx-lm stock" if self.mode == "stock" else "mtplx AR"


@dataclass
class RunRecord:
    """One generation of one variant: token counts and the seconds the caller saw them arrive in.

    Decode tokens/s counts ``generated_tokens - 1``: the first token is the prefill's.
    """

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


# (variant, setting, prompt, max_tokens, seed, repeat) -> the record of that one generation.
Runner = Callable[[Variant, Setting, Prompt, int, int, int], RunRecord]


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
    """Tokens per generation and timed repeats: both at least 1."""
    if tokens <= 0:
        raise MtplxError(f"tokens: must be > 0, got {tokens}")
    if repeats <= 0:
        raise MtplxError(f"repeats: must be > 0, got {repeats}")


def parse_drafts(spec: str | Sequence[str] | None) -> list[str]:
    """'head,lookup,auto' -> the drafters to sweep (default: the head only)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec or ["head"])
    drafts = [d.strip() for d in items if d.strip()]
    unknown = [d for d in drafts if d not in DRAFTS]
    if unknown or not drafts:
        raise MtplxError(f"drafts: must be a comma-separated subset of {','.join(DRAFTS)}, got {spec!r}")
    return list(dict.fromkeys(drafts))


def check_thresholds(thresholds: Sequence[float], depths: Sequence[int]) -> list[float]:
    """Adaptive-length thresholds to sweep: each in (0, 1), and a depth to stop short of."""
    bad = next((t for t in thresholds if not 0.0 < t < 1.0), None)
    if bad is not None:
        raise MtplxError(f"thresholds: each must be in (0, 1), got {bad:g}")
    if thresholds and not any(d > 0 for d in depths):
        raise MtplxError("thresholds: adaptive drafting needs an MTP depth (--depths) to stop short of")
    return list(dict.fromkeys(thresholds))


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


@dataclass
class SweepPlan:
    """Everything one sweep runs, fixed before its first run (the result records it)."""

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
    """Stock, AR, then per drafter: the head and auto at each depth, lookup and a block drafter
    once each (no depth: lookup's match, the block drafter's trained block, cut by the cost
    model); with ``thresholds``, adaptive head drafting up to the largest depth, one per threshold."""
    speculative = []
    for draft in drafts:
        if draft == DrafterKind.LOOKUP or draft in BLOCK_DRAFTS:
            speculative.append(Variant("mtp", 0, str(draft)))
        else:
            speculative += [Variant("mtp", d, draft) for d in depths]
    if depths:
        speculative += [Variant("mtp", max(depths), "head", t) for t in thresholds]
    return ([Variant("stock")] if stock else []) + [Variant("ar")] + speculative


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
