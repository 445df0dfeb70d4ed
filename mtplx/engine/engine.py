"""`Engine`: load a model (and its MTP head), then stream or generate text for a `GenerationRequest`.

One call, end to end: the request (validated at the edge) -> `plan` (prompt ids, the drafter and
depth from `spec_decode.drafting`, the loop's settings) -> the one scheduler (`engine.scheduler`: a
stream is a batch of one, on its own caches) and the one cycle (`spec_decode.loop.BatchDecoder`)
-> per step: EOS / stop strings / max_tokens, incremental text, running stats
(`output.RequestOutput`) -> `GenerationChunk`s. A sharded engine's scheduler steps one row on every
rank, with rank agreement (`engine.distributed`). The engine holds what outlives a request:
the trunk, the head, a draft model, the prompt cache, the tuned defaults, the sharding; building
it from files (`Engine.load`, the drafters, KV quantization, the disk tier) is
`engine.loading`'s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtplx.engine.grammar import GrammarCompiler
from mtplx.engine.loading import KV_EXACTNESS_NOTE, EngineLoading
from mtplx.engine.output import GenerationChunk, GenerationResult
from mtplx.engine.request import GenerationRequest
from mtplx.engine.scheduler import BatchScheduler, run_to_completion, stream_of
from mtplx.engine.stats import GenerationStats
from mtplx.engine.text import encode_prompt, with_image_parts
from mtplx.errors import MtplxError
from mtplx.heads.discovery import missing_head_message
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_policy import DRAFT_POLICIES, CostProfile, DraftPolicy
from mtplx.spec_decode.drafting import (
    DrafterChoice,
    build_proposer,
    choose_drafter,
    drafter_refusal,
    head_depth,
    row_sources,
)
from mtplx.spec_decode.rows import RowSpec
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP, DecodeSettings
from mtplx.spec_decode.sources import Source
from mtplx.trunk.model import Trunk
from mtplx.trunk.prompt_boundaries import ChatBoundaries
from mtplx.trunk.prompt_cache import PromptCache

import mlx.core as mx

__all__ = [
    "KV_EXACTNESS_NOTE",
    "Engine",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
]


@dataclass(frozen=True)
class DecodePlan:
    """One request as this engine decodes it (`Engine.plan`), resolved once: every choice's row
    is made from it (`BatchScheduler.submit`)."""

    prompt_tokens: list[int]
    choice: DrafterChoice
    # How its rows decode: settings, drafters in priority order, lookup, the request's own count.
    spec: RowSpec
    # The head's drafts per cycle, pinned (a seeded request drafts its own depth every cycle, as
    # alone, so it reproduces its tokens whatever else is in the batch; a pinned count); None:
    # the draft policy chooses.
    draft_length: int | None = None

    @property
    def settings(self) -> DecodeSettings:
        return self.spec.settings


class Engine(EngineLoading):
    """A loaded target model plus (optionally) its MTP head."""

    def __init__(
        self,
        model,
        tokenizer,
        config: dict,
        *,
        head=None,
        depth: int | None = None,
        model_path: Path | None = None,
        fingerprint: str = "",
        verify_backend: str = "auto",
        draft_model=None,
        draft_vocab_size: int = 0,
        adaptive_threshold: float = 0.0,
        prompt_cache_bytes: int = 0,
    ):
        self.trunk = Trunk(model)
        # Caches of earlier prompts, reused for the longest common prefix (0 bytes: off).
        self.prompt_cache = PromptCache(prompt_cache_bytes)
        # Where a hybrid model's requests snapshot their caches besides the prompt's end.
        self.prompt_cache.boundaries = ChatBoundaries(tokenizer)
        self.adapter_path: Path | None = None  # the mlx-lm adapters applied (`load`), for cache keys
        self.tokenizer = tokenizer
        self.config = config
        self.head = head
        self.depth = depth
        self.model_path = model_path
        self.fingerprint = fingerprint
        self.verify_backend = verify_backend
        self.draft_model = draft_model  # a separate mlx-lm model with the same tokenizer, or None
        self.draft_vocab_size = draft_vocab_size  # the real vocabulary both share (q = 0 past it)
        self.block_drafter = None  # DFlash / DFlash2 / DSpark / EAGLE-3 (`block_proposer.BlockDrafter`)
        self.adaptive_threshold = adaptive_threshold  # used when adaptive drafting is asked for
        self.distributed = None  # a mtplx.engine.distributed.Distributed once sharded
        self._warned_depth = False  # the deeper-than-trained warning is printed once per engine
        self._batch_support: str | None = None  # why this model cannot batch ("" = it can), once known
        self._cost_profile: CostProfile | None = None  # a batched cycle's cost here, once known
        self._grammars: GrammarCompiler | None = None  # the llguidance tokenizer, built at first use

    # -------------------------------------------------------------------- head
    def _warn_if_deeper_than_trained(self, depth: int) -> None:
        limit = self.head.max_depth
        if limit is not None and depth > limit and not self._warned_depth:
            self._warned_depth = True
            print(
                f"mtplx: warning: drafting {depth} tokens deep, but the head was trained for {limit} "
                "(deeper drafts are rarely accepted)",
                file=sys.stderr,
            )

    @property
    def has_head(self) -> bool:
        return self.head is not None

    # --------------------------------------------------------------- prompting
    def encode_prompt(
        self,
        prompt: str | Sequence[dict] | Sequence[int],
        chat: bool | None = None,
        tools: list | None = None,
    ) -> list[int]:
        """Token ids of ``prompt``: raw text, a chat message list (``tools`` for the template's
        ``tools=``), or token ids (taken as they are). In messages, a vision checkpoint's
        placeholder text is the text it is, never an image placeholder (`text.encode_chat`)."""
        vision = self.trunk.vision
        literal = vision.placeholder_texts(self.tokenizer) if vision is not None else ()
        return encode_prompt(self.tokenizer, self.trunk.vocab_size, prompt, chat, tools, literal)

    @property
    def context_length(self) -> int | None:
        """The model's context in tokens (``max_position_embeddings``), None when the config has none."""
        text_config = self.config.get("text_config", self.config)
        return text_config.get("max_position_embeddings")

    # -------------------------------------------------------------- generation
    def stream(
        self, prompt: str | Sequence[dict] | Sequence[int], request: GenerationRequest | None = None, **kwargs
    ) -> Iterator[GenerationChunk]:
        """Generate incrementally; each chunk carries new text, new token ids and running stats.

        ``request`` says what to generate (`GenerationRequest`); or pass its fields as keyword
        arguments, as `GenerationRequest.from_kwargs` names them: ``max_tokens``, the sampler
        (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
        ``presence_penalty``, ``frequency_penalty``, ``logit_bias``), ``seed``, ``stop``, ``chat``,
        ``logprobs`` (the target's log-probability of each token plus its top n), and the drafting:
        ``draft`` = "auto" (default: prompt lookup where the text recurs, else the draft model or
        the MTP head unless tuning found plain AR faster here), "head", "lookup", "model" or
        "none" (plain AR; ``mtp=True`` / ``False`` are aliases of "head" / "none"), ``depth`` (the
        most drafts a model drafter makes per cycle), ``greedy_draft``, ``lookup``, ``adaptive``
        (stop the head early when it is unsure; ``adaptive_threshold`` sets the threshold), and
        ``grammar`` (a `Grammar`: the output must match it, sampled exactly as constrained AR
        would; the stream ends with the grammar's last token, docs/sampling.md).
        """
        if request is None:
            request = GenerationRequest.from_kwargs(**kwargs)
        elif kwargs:
            raise MtplxError(f"stream: pass a request or keyword arguments, not both (got {sorted(kwargs)})")
        _one_choice(request, "stream")
        return self._stream_as_a_batch_of_one(prompt, request)

    def _stream_as_a_batch_of_one(self, prompt, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """A stream is a batch of one: the one scheduler and the one cycle (`mtplx.engine.scheduler`),
        on a single-row decoder (the row's own mlx-lm caches, no ragged batch buffers or masks;
        the same drafters as a batch's rows), drafting its own depth every cycle (no cost policy: a
        stream pays no profile measurement). A sharded engine's too: every rank steps the same
        row, with rank 0's seed and a check that the ranks agree (`BatchScheduler`). The request
        is planned and refused here, before the first chunk."""
        scheduler = BatchScheduler(self, max_rows=1, prompt_concurrency=1, single_row=True)
        handle = scheduler.submit(prompt, request)
        return stream_of(scheduler, handle)

    def _choose_drafter(self, request: GenerationRequest) -> DrafterChoice:
        """The request's drafter, refused with a one-line error when this engine cannot serve it."""
        block = self.block_drafter.source if self.block_drafter is not None else None
        refusal = drafter_refusal(
            request.drafting,
            has_head=self.head is not None,
            has_draft_model=self.draft_model is not None,
            block=block,
        )
        if refusal is not None:
            raise MtplxError(refusal or missing_head_message(self.config))
        choice = choose_drafter(
            request.drafting,
            has_head=self.head is not None,
            has_draft_model=self.draft_model is not None,
            engine_depth=self.depth or 0,
            head_depth=head_depth(self.head),
            block=block,
        )
        if choice.model_drafter is Source.HEAD:
            self._warn_if_deeper_than_trained(choice.depth)
        return choice

    def _check_fits(self, prompt_tokens: list[int], max_tokens: int) -> None:
        limit = self.context_length
        if limit is not None and len(prompt_tokens) + max_tokens > limit:
            raise MtplxError(
                f"prompt: {len(prompt_tokens)} tokens + max_tokens {max_tokens} exceed "
                f"the model's context of {limit} tokens"
            )

    def plan(self, prompt: str | Sequence[dict] | Sequence[int], request: GenerationRequest) -> DecodePlan:
        """What decoding ``request`` takes here (checked): prompt ids, drafter, loop settings and
        the row spec every choice's row decodes by."""
        choice = self._choose_drafter(request)
        prompt, images = with_image_parts(prompt, request.images)
        vision = self._vision() if images else None
        prompt_tokens = self.encode_prompt(prompt, request.chat)
        if vision is not None:  # each image pad token becomes its image's tokens (mtplx.trunk.vision)
            prompt_tokens = vision.expand(prompt_tokens, vision.prepare_all(images))
        self._check_fits(prompt_tokens, request.max_tokens)
        drafting = request.drafting
        threshold = drafting.adaptive_threshold or (self.adaptive_threshold if drafting.adaptive else 0.0)
        settings = DecodeSettings(
            sampler=request.sampler,
            depth=choice.depth,
            greedy_draft=drafting.greedy_draft,
            verify_backend=self.verify_backend,
            adaptive_threshold=threshold,
            logprobs=request.logprobs,
        )
        spec = RowSpec(
            settings,
            row_sources(choice),
            drafting.lookup,
            max_drafts=choice.depth if drafting.pinned else None,
        )
        pinned = request.seed is not None or drafting.pinned
        return DecodePlan(prompt_tokens, choice, spec, choice.depth if pinned else None)

    def _vision(self):
        """The trunk's image side, for a request with images; refused in one line where there is none."""
        if self.trunk.vision is None:
            reason = self.trunk.vision_refusal or "its checkpoint has no vision tower"
            raise MtplxError(f"images: this model takes no images ({reason})")
        if self.distributed is not None:
            raise MtplxError("images: not supported on a sharded engine")
        return self.trunk.vision

    def compile_grammar(self, grammar) -> GrammarConstraint:
        """A fresh matcher for ``grammar`` (`mtplx.engine.grammar_spec.Grammar`) on this model's
        tokenizer and vocabulary (`mtplx.engine.grammar`)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, int(self.trunk.vocab_size))
        return self._grammars.compile(grammar)

    @staticmethod
    def request_key(seed: int | None) -> mx.array:
        """The random key a request decodes from: its seed's, else a fresh one."""
        return mx.random.key(seed if seed is not None else int(time.time_ns() % (2**63)))

    def row_proposer(self, plan: DecodePlan):
        """A draft model row's own draft model state (its cache; None for any other row)."""
        return build_proposer(
            plan.choice,
            plan.settings,
            draft_model=self.draft_model,
            target_vocab_size=int(self.trunk.vocab_size),
            draft_vocab_size=self.draft_vocab_size,
        )

    def _model_batch_refusal(self) -> str | None:
        """Why requests cannot share a batch on this engine (one line; they then decode one at a
        time), None if they can."""
        if self.distributed is not None:
            return "a sharded engine decodes one request at a time"
        if self._batch_support is None:
            from mtplx.spec_decode.rows import check_batch_support

            self._batch_support = check_batch_support(self.trunk, self.head) or ""
        return self._batch_support or None

    def batch(
        self,
        max_rows: int = 32,
        prompt_concurrency: int = 8,
        draft_policy: str = "auto",
        prefill_step_size: int = DEFAULT_PREFILL_STEP,
        should_stop: Callable[[], bool] | None = None,
    ) -> BatchScheduler:
        """A scheduler that decodes up to ``max_rows`` requests together on this engine, with up to
        ``prompt_concurrency`` prefilling meanwhile, ``prefill_step_size`` prompt tokens in all per
        cycle (`mtplx.engine.scheduler`). ``draft_policy``: "auto" chooses each cycle's draft length
        from the cost profile and the rows' acceptance (`mtplx.spec_decode.draft_policy`);
        "fixed" drafts every row's depth every cycle. ``should_stop``: see `batch_cost_profile`."""
        if draft_policy not in DRAFT_POLICIES:
            raise MtplxError(
                f"draft policy: must be one of {', '.join(DRAFT_POLICIES)} (got {draft_policy!r})"
            )
        # No profile to measure where nothing batches (every request then decodes one row at a time).
        batches = self._model_batch_refusal() is None
        policy = (
            DraftPolicy(self.batch_cost_profile(should_stop=should_stop))
            if draft_policy == "auto" and batches
            else None
        )
        return BatchScheduler(
            self,
            max_rows,
            prompt_concurrency,
            prefill_step_size,
            policy=policy,
            single_row=self.distributed is not None,
        )

    def batch_cost_profile(
        self, remeasure: bool = False, should_stop: Callable[[], bool] | None = None
    ) -> CostProfile:
        """What a batched cycle costs here: the profile saved for this engine on this machine, else
        measured (a few seconds) and saved (`tuned.engine_batch_cost`); ``remeasure`` measures it now.
        ``should_stop`` True between two timed forwards raises `MeasurementStopped`, nothing saved."""
        if self._cost_profile is None or remeasure:
            from mtplx.engine import tuned

            self._cost_profile = tuned.engine_batch_cost(self, remeasure, should_stop)
        return self._cost_profile

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[dict] | Sequence[int]],
        request: GenerationRequest | Sequence[GenerationRequest] | None = None,
        *,
        max_rows: int = 32,
        draft_policy: str = "auto",
        progress: bool = False,
        **kwargs,
    ) -> list[GenerationResult]:
        """Generate every prompt to completion, ``max_rows`` at a time in one batch; results in
        prompt order. ``request`` is one `GenerationRequest` for all prompts or one per prompt,
        or pass its fields as keyword arguments (as `stream`). Greedy and seeded requests give the
        tokens they give alone, up to float rounding of batched matmuls (a tie at most): a seeded
        request drafts its own depth every cycle, as alone, whatever ``draft_policy`` says.
        ``progress`` shows a bar of finished prompts on stderr."""
        if request is None:
            requests = [GenerationRequest.from_kwargs(**kwargs)] * len(prompts)
        elif kwargs:
            raise MtplxError(
                f"generate_batch: pass a request or keyword arguments, not both (got {sorted(kwargs)})"
            )
        elif isinstance(request, GenerationRequest):
            requests = [request] * len(prompts)
        else:
            requests = list(request)
            if len(requests) != len(prompts):
                raise MtplxError(
                    f"generate_batch: {len(requests)} requests for {len(prompts)} prompts (give one, or one each)"
                )
        for r in requests:
            _one_choice(r, "generate_batch")
        from tqdm import tqdm

        with tqdm(total=len(prompts), unit="prompt", disable=not progress, file=sys.stderr) as bar:
            chunks = run_to_completion(
                self.batch(max_rows, draft_policy=draft_policy),
                prompts,
                requests,
                on_done=lambda _: bar.update(1),
            )
        return [GenerationResult.from_chunks(parts) for parts in chunks]

    def generate(
        self, prompt: str | Sequence[dict] | Sequence[int], request: GenerationRequest | None = None, **kwargs
    ) -> GenerationResult:
        """Generate to completion; the same arguments as `stream`."""
        return GenerationResult.from_chunks(list(self.stream(prompt, request, **kwargs)))


def _one_choice(request: GenerationRequest, entry: str) -> None:
    if request.n != 1:
        raise MtplxError(
            f"n: {entry} returns one choice per request (got n={request.n}); submit to Engine.batch() "
            "(each chunk's index is its choice) or ask the server"
        )
