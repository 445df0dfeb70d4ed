"""What a decode is configured by: a request's `Drafting` (which drafter, how deep), the loop's
`DecodeSettings`, prompt lookup's `LookupConfig`, and the limits they are checked against.

Standard library only (plus `SamplerConfig`), so `mtplx.engine.request`, the CLI and the server
validate a request before anything imports MLX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig, integer_value
from mtplx.spec_decode.sources import DrafterKind

# Prompt tokens per prefill forward (a single stream's chunk; a batch's per-cycle budget over
# all prefilling requests, `mtplx serve --prefill-step-size`): mlx-lm's default. A smaller step
# bounds how long a long prompt stalls the running streams (on the 2-core CPU 512 tokens of the
# default model take ~2.5 s) but costs aggregate throughput: at 16 clients greedy the 2048 step
# ran 23.3 tok/s against 20.9 for 512 (benchmarks/RESULTS.md).
DEFAULT_PREFILL_STEP = 2048

__all__ = [
    "DRAFT_KINDS",
    "MAX_DEPTH",
    "DecodeSettings",
    "Drafting",
    "LookupConfig",
]

# The drafters a request can ask for (`DrafterKind`; `mtplx.spec_decode.drafting` resolves them).
DRAFT_KINDS = tuple(kind.value for kind in DrafterKind)
MAX_DEPTH = 16  # drafts per cycle mtplx serves: no head layout chains usefully beyond this; a typo guard
MAX_NGRAM_LIMIT = 64
MAX_TOKENS_LIMIT = 64


@dataclass(frozen=True)
class DecodeSettings:
    """One request's decode, as the loop and the drafters read it."""

    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    depth: int = 3  # draft tokens per verify cycle
    greedy_draft: bool = False  # draft the head's argmax (q one-hot) instead of sampling q
    prefill_step_size: int = DEFAULT_PREFILL_STEP
    verify_backend: str = "auto"  # "auto" (fused kernel where available) | "mlx"
    # Adaptive head drafting: stop after a draft the head gave less than this probability (0 = off).
    adaptive_threshold: float = 0.0
    # Report the target's log-probabilities of each committed token plus this many top
    # alternatives (None: off). Raw log_softmax of the trunk logits, before penalties and filters.
    logprobs: int | None = None


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup's matcher and block length (`mtplx.spec_decode.lookup_proposer`)."""

    min_ngram: int = 3
    max_ngram: int = 6
    max_tokens: int = 10
    adaptive_length: bool = True  # the block length follows acceptance (lookup_proposer's docstring)

    def validate(self) -> LookupConfig:
        if not 1 <= self.min_ngram <= MAX_NGRAM_LIMIT:
            raise MtplxError(f"lookup min ngram: must be in [1, {MAX_NGRAM_LIMIT}], got {self.min_ngram}")
        if not self.min_ngram <= self.max_ngram <= MAX_NGRAM_LIMIT:
            raise MtplxError(
                f"lookup max ngram: must be in [min ngram {self.min_ngram}, {MAX_NGRAM_LIMIT}], "
                f"got {self.max_ngram}"
            )
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise MtplxError(f"lookup max tokens: must be in [1, {MAX_TOKENS_LIMIT}], got {self.max_tokens}")
        return self


@dataclass(frozen=True)
class Drafting:
    """How a request drafts. The batched loop's per-row pins (a fixed draft length) join here."""

    kind: DrafterKind = DrafterKind.AUTO  # a DrafterKind (its value is accepted); NONE is plain AR
    depth: int | None = None  # most drafts per cycle for a model drafter; None: tuned, else the head's
    greedy_draft: bool = False  # draft the head's argmax (q one-hot; still exact)
    adaptive: bool = False  # stop head drafting early when the head is unsure
    adaptive_threshold: float | None = None  # that threshold (implies adaptive); None: tuned, else default
    lookup: LookupConfig = field(default_factory=LookupConfig)
    pinned: bool = False  # draft ``depth`` every cycle, whatever drafts (the cost policy does not choose)
    field: str = "draft"  # the API field that named ``kind`` (an error about it names this field)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise MtplxError(f"{self.field}: must be one of {', '.join(DRAFT_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "kind", DrafterKind(self.kind))
        if self.depth is not None and integer_value("depth", self.depth) < 1:
            raise MtplxError(f"depth must be >= 1 (got {self.depth})")
        threshold = self.adaptive_threshold
        if threshold is not None and not 0.0 < threshold < 1.0:
            raise MtplxError(f"adaptive_threshold: must be in (0, 1), got {threshold}")
        self.lookup.validate()

    @staticmethod
    def kind_from(draft: str | None, mtp: bool | None) -> DrafterKind:
        """The drafter kind from ``draft`` and its older alias ``mtp`` (True = "head", False = "none")."""
        if draft is not None and draft not in DRAFT_KINDS:
            raise MtplxError(f"draft: must be one of {', '.join(DRAFT_KINDS)}, got {draft!r}")
        alias = None if mtp is None else (DrafterKind.HEAD if mtp else DrafterKind.NONE)
        if draft is not None and alias is not None and DrafterKind(draft) is not alias:
            raise MtplxError(f"draft: {draft!r} contradicts mtp={mtp} (an alias of draft={alias.value!r})")
        return DrafterKind(draft or alias or DrafterKind.AUTO)

    @staticmethod
    def count_conflict(kind: str | None, count: int | None) -> str | None:
        """Why a request's draft count contradicts its drafter (None if it does not): drafts with
        drafter "none", or none with a drafter named (only "auto" and "none" may draft nothing)."""
        if kind is None or count is None:
            return None
        named = DrafterKind(kind)
        if named is DrafterKind.NONE and count > 0:
            return f"{count} drafts per cycle contradicts drafter 'none' (plain AR)"
        if count == 0 and named not in (DrafterKind.NONE, DrafterKind.AUTO):
            return f"0 drafts per cycle contradicts drafter {named.value!r} (use 'none' for plain AR)"
        return None
