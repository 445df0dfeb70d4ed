"""One timed generation per call: stock mlx-lm and mtplx, run and timed the same way.

* ONE process, ONE loaded model: stock ``mlx_lm.stream_generate`` runs on the very model
  object and tokenizer the mtplx engine uses, so weights, dtype, BLAS and allocator
  state are identical.
* Equal lengths: every variant bans the tokenizer's EOS ids through the same logit bias
  (``BAN_BIAS``; stock gets it through mlx-lm's own logits processor, mtplx through
  ``logit_bias``), so every run generates exactly ``max_tokens`` tokens at every
  temperature. ``ban_eos=False`` lets EOS end a run; rates are then over what was generated.
* Timing is taken here, identically for every variant, from the moments tokens reach the
  caller: prefill = prompt text -> first token (tokenization and chat template included
  for both: stock gets the engine's own encoding, done inside its timed region), decode =
  first token -> last token. Engine-reported stats are used only for the counts the
  stream cannot see (verify cycles, accepted drafts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mtplx.bench.suite import Prompt, encode
from mtplx.bench.sweep import RunRecord, Variant
from mtplx.engine.request import GenerationRequest
from mtplx.sample.params import SamplerConfig, Setting
from mtplx.spec_decode.settings import Drafting
from mtplx.spec_decode.sources import DrafterKind

# Large but finite: -inf can turn into NaN in the filter pipeline (inf - inf).
BAN_BIAS = -1e9


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


def ban_bias(tokenizer) -> dict[int, float]:
    """The logit bias that bans every EOS id of ``tokenizer`` (equal lengths for every variant)."""
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


def accepted_counts(acceptance_per_position: Sequence[float], cycles: int, depth: int) -> list[int]:
    """Engine stats -> counts. The engine reports, per position i, (cycles whose first i+1 drafts
    were all accepted) / (cycles that drafted position i); every cycle drafts all ``depth``
    positions, so the denominator is ``cycles``."""
    counts = [round(a * cycles) for a in acceptance_per_position]
    return (counts + [0] * depth)[:depth]


class EngineRunner:
    """The sweep's `Runner` over one loaded `Engine`: stock mlx-lm on the engine's own model and
    tokenizer, mtplx AR and speculative through `Engine.stream`, each timed by a `_Clock`."""

    def __init__(self, engine, *, ban_eos: bool = True) -> None:
        self.engine = engine
        self.bias = ban_bias(engine.tokenizer) if ban_eos else None
        self.prompt_lengths: dict[str, int] = {}  # encoded once, outside any timed region

    def __call__(
        self, variant: Variant, setting: Setting, prompt: Prompt, max_tokens: int, seed: int, repeat: int
    ) -> RunRecord:
        if prompt.id not in self.prompt_lengths:
            self.prompt_lengths[prompt.id] = len(encode(self.engine, prompt))
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
            prompt_tokens=self.prompt_lengths[prompt.id],
        )
        if variant.mode == "stock":
            return self._stock(base, setting, prompt, max_tokens, seed)
        return self._mtplx(base, variant, setting, prompt, max_tokens, seed)

    def _stock(
        self, base: dict[str, Any], setting: Setting, prompt: Prompt, max_tokens: int, seed: int
    ) -> RunRecord:
        clock, _, kept, peak = run_stock(
            self.engine.trunk.model,
            self.engine.tokenizer,
            lambda: encode(self.engine, prompt),
            setting,
            max_tokens,
            seed,
            self.bias,
        )
        prefill, decode = clock.split()
        return RunRecord(
            **base, generated_tokens=kept, prefill_seconds=prefill, decode_seconds=decode, peak_memory_gb=peak
        )

    def _mtplx(
        self,
        base: dict[str, Any],
        variant: Variant,
        setting: Setting,
        prompt: Prompt,
        max_tokens: int,
        seed: int,
    ) -> RunRecord:
        clock = _Clock()
        stats = None
        request = GenerationRequest(
            sampler=SamplerConfig(temperature=setting.temperature, top_p=setting.top_p, logit_bias=self.bias),
            max_tokens=max_tokens,
            seed=seed,
            chat=prompt.is_chat,
            drafting=Drafting(
                kind=variant.draft if variant.mode == "mtp" else "none",
                depth=variant.depth if variant.mode == "mtp" and variant.depth else None,
                adaptive_threshold=variant.threshold if variant.threshold > 0 else None,
                adaptive=variant.threshold > 0,
            ),
        )
        for chunk in self.engine.stream(prompt.engine_input, request):
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
            _add_cycle_counts(record, variant, stats)
        return record


def _add_cycle_counts(record: RunRecord, variant: Variant, stats: Any) -> None:
    """The counts only the engine sees: verify cycles, tokens they committed, drafts kept."""
    record.cycles = int(stats.cycles)
    record.tokens_in_cycles = round(stats.tokens_per_cycle * stats.cycles)
    record.drafters = {name: dict(counts) for name, counts in stats.drafters.items()}
    if variant.draft == DrafterKind.HEAD and variant.threshold == 0:  # fixed-length blocks only
        record.accepted_per_position = accepted_counts(
            stats.acceptance_per_position, stats.cycles, variant.depth
        )
