"""`GenerationRequest`: everything one generation asks for, built once at the edge and validated there.

The edges build it: `Engine.stream(prompt, **kwargs)` (sugar: `GenerationRequest.from_kwargs`),
the CLI (`mtplx.cli.args`), the server (request bodies over the served defaults) and the benchmark.
The engine reads only this object, never loose keyword arguments.

Glossary:
- sampler: how the target's logits become the distribution tokens are drawn from (docs/sampling.md).
- drafting: which drafter proposes tokens for the target to verify, and how far ahead.
- grammar: a constraint the output must match (`mtplx.engine.grammar_spec.Grammar`).
- depth: the most tokens a model drafter (MTP head, draft model) drafts per verify cycle.

Invariants: a request is immutable and valid (construction raises `MtplxError` whose message
starts with the field's API name, ``max_tokens must be > 0 (got 0)``, which the CLI and the server
rewrite into the flag or the JSON field the user typed). What needs the model (the prompt's length
against the context, whether the engine has the drafter asked for) is checked by the engine.
Importable without MLX: the CLI and the server check a request before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mtplx.engine.grammar_spec import Grammar
from mtplx.errors import MtplxError
from mtplx.sample.params import SamplerConfig, integer_value
from mtplx.spec_decode.settings import Drafting, LookupConfig

__all__ = ["DEFAULT_MAX_TOKENS", "SEED_LIMIT", "Drafting", "GenerationRequest"]

# mx.random.key takes an unsigned 64-bit seed.
SEED_LIMIT = 2**64
DEFAULT_MAX_TOKENS = 256
MAX_CHOICES = 16  # most choices (n) one request may ask for


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: sampler, limits, stops, seed, reported log-probabilities, drafting.

    Greedy unless asked otherwise (``temperature=0``), as `Engine.stream` and mlx-lm's
    ``generate`` default; the OpenAI server fills omitted fields from its own defaults.
    """

    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(temperature=0.0))
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()  # stop strings (never emitted, even in part)
    seed: int | None = None  # None: a fresh seed per request
    logprobs: int | None = None  # report each token's target log-probability plus its top n
    chat: bool | None = None  # raw text through the chat template (None: no; message lists always)
    drafting: Drafting = field(default_factory=Drafting)
    grammar: Grammar | None = None  # the output must match it (response_format, tool calls)
    # Token ids that end the request as EOS does (never emitted), beside the tokenizer's EOS
    # (vLLM's ``stop_token_ids``).
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1  # choices from one prefill, each with its own key (the server's ``n``)
    ignore_eos: bool = False  # the tokenizer's EOS does not end the request (only stop_token_ids)
    detokenize: bool = True  # False: token ids only, no text (no stop strings then)
    # Images (paths, bytes, PIL images) placed before the text of the prompt's last user message
    # (token-id prompts: one image pad token each); the model must have a vision tower.
    images: tuple = ()

    def __post_init__(self) -> None:
        if integer_value("max_tokens", self.max_tokens) <= 0:
            raise MtplxError(f"max_tokens must be > 0 (got {self.max_tokens})")
        if self.seed is not None and not 0 <= integer_value("seed", self.seed) < SEED_LIMIT:
            raise MtplxError(f"seed must be in [0, 2**64) (got {self.seed})")
        if not 1 <= integer_value("n", self.n) <= MAX_CHOICES:
            raise MtplxError(f"n must be in [1, {MAX_CHOICES}] (got {self.n})")
        if self.logprobs is not None and integer_value("logprobs", self.logprobs) < 0:
            raise MtplxError(f"logprobs must be >= 0 (got {self.logprobs})")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise MtplxError(f"grammar must be a Grammar (got {type(self.grammar).__name__})")
        if not all(isinstance(s, str) for s in stop):
            raise MtplxError(f"stop must be strings (got {self.stop!r})")
        object.__setattr__(self, "stop", stop)
        ids = tuple(integer_value("stop_token_ids", i) for i in self.stop_token_ids)
        if any(i < 0 for i in ids):
            raise MtplxError(f"stop_token_ids must be token ids >= 0 (got {list(self.stop_token_ids)})")
        object.__setattr__(self, "stop_token_ids", ids)
        if stop and not self.detokenize:
            raise MtplxError("stop strings need the text: they cannot be used with detokenize=False")
        images = tuple(str(i) if hasattr(i, "__fspath__") else i for i in self.images or ())
        bad = next(
            (i for i in images if not isinstance(i, (str, bytes, bytearray)) and not hasattr(i, "size")), None
        )
        if bad is not None:  # a PIL image has .size
            raise MtplxError(f"images must be paths, bytes or PIL images (got {type(bad).__name__})")
        object.__setattr__(self, "images", images)

    @classmethod
    def from_kwargs(
        cls,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        seed: int | None = None,
        stop: Sequence[str] | str | None = None,
        mtp: bool | None = None,
        depth: int | None = None,
        greedy_draft: bool = False,
        chat: bool | None = None,
        logprobs: int | None = None,
        draft: str | None = None,
        lookup: LookupConfig | None = None,
        adaptive: bool = False,
        adaptive_threshold: float | None = None,
        grammar: Grammar | None = None,
        n: int = 1,
        images: Sequence | None = None,
    ) -> GenerationRequest:
        """A request from `Engine.stream`'s flat keyword arguments (the names the API documents)."""
        sampler = SamplerConfig(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
        )
        drafting = Drafting(
            kind=Drafting.kind_from(draft, mtp),
            depth=depth,
            greedy_draft=greedy_draft,
            adaptive=adaptive or adaptive_threshold is not None,
            adaptive_threshold=adaptive_threshold,
            lookup=lookup or LookupConfig(),
        )
        return cls(
            sampler=sampler,
            max_tokens=max_tokens,
            stop=stop or (),
            seed=seed,
            logprobs=logprobs,
            chat=chat,
            drafting=drafting,
            grammar=grammar,
            n=n,
            images=tuple(images or ()),
        )
