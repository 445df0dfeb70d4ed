"""`Engine`: load a model (and its MTP head), then stream or generate text for a `GenerationRequest`.

One call, end to end: the request (validated at the edge) -> `plan` (prompt ids, the drafter and
depth from `spec_decode.drafting`, the loop's settings) -> the one scheduler (`engine.scheduler`: a
stream is a batch of one, on its own caches) and the one cycle (`spec_decode.loop.BatchDecoder`)
-> per step: EOS / stop strings / max_tokens, incremental text, running stats
(`output.RequestOutput`) -> `GenerationChunk`s. A sharded engine's scheduler steps one row on every
rank, with rank agreement (`engine.distributed`). The engine holds what outlives a request:
the trunk, the head, a draft model, the prompt cache, the tuned defaults, the sharding.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtplx.engine.grammar import GrammarCompiler
from mtplx.engine.output import GenerationChunk, GenerationResult
from mtplx.engine.request import GenerationRequest
from mtplx.engine.scheduler import BatchScheduler, run_to_completion, stream_of
from mtplx.engine.stats import GenerationStats
from mtplx.engine.text import encode_prompt, with_image_parts
from mtplx.errors import MtplxError
from mtplx.heads.discovery import find_head, missing_head_message
from mtplx.spec_decode.constraint import GrammarConstraint
from mtplx.spec_decode.draft_policy import DRAFT_POLICIES, CostProfile, DraftPolicy
from mtplx.spec_decode.drafting import (
    DEFAULT_ADAPTIVE_THRESHOLD,
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
from mtplx.trunk.kv_quant import KVQuantization, check_fit
from mtplx.trunk.model import Trunk
from mtplx.trunk.prompt_boundaries import ChatBoundaries
from mtplx.trunk.prompt_cache import PromptCache
from mtplx.trunk.vision import attach_declared

import mlx.core as mx

__all__ = ["Engine", "GenerationChunk", "GenerationRequest", "GenerationResult", "GenerationStats"]


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


class Engine:
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

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        head: str | Path | None = None,
        mtp: bool | None = None,
        depth: int | None = None,
        dtype: str | None = None,
        verify_backend: str = "auto",
        draft_model: str | Path | None = None,
        prompt_cache_bytes: int = 0,
        distributed: bool | str = False,
        collective_timeout: float | None = None,
        adapter_path: str | Path | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        quantized_kv_start: int | None = None,
    ) -> Engine:
        """Load ``model`` (local path, Hugging Face repo id, or None for the embedded default).

        ``head`` is a forged-head directory or a Gemma 4 assistant (directory or cached repo id);
        without it the checkpoint's own MTP head is used, for a Gemma 4 target the
        ``<target>-assistant`` beside it or in the HF cache, or for the default model the head
        shipped with mtplx. ``mtp=False`` never loads a head; ``mtp=None`` loads one when there
        is one (a config that declares MTP layers whose tensors a converter stripped gets a
        one-line note on stderr and decodes AR); ``mtp=True`` makes a missing head an error.
        ``draft_model`` is a separate mlx-lm model with the same tokenizer (`draft="model"`).
        ``distributed`` ("pipeline" | "tensor" | True = auto) shards the trunk over the
        processes started by ``mlx.launch``; ``collective_timeout`` (seconds) bounds every
        wait on the other ranks (see mtplx/engine/distributed.py). ``adapter_path`` applies adapters
        trained with ``mlx_lm.lora``; the head keeps drafting and the output is the adapted
        model's, exactly. ``kv_bits`` / ``kv_group_size`` / ``quantized_kv_start``: mlx-lm's
        KV-cache quantization (`_quantize_kv`).
        """
        from mtplx.checkpoints import load as loading

        kv_plan = _kv_plan(kv_bits, kv_group_size, quantized_kv_start, distributed)  # before the load

        if dtype not in (None, *loading.VARIANTS):
            raise MtplxError(f"dtype must be one of {', '.join(loading.VARIANTS)} (got {dtype})")
        group = _launch_group(distributed, adapter_path) if distributed else None
        # Sharded: load lazily, so each rank only materializes the weights it keeps.
        loaded = loading.load_model(
            model, variant=dtype or "float32", lazy=bool(distributed), adapter_path=adapter_path
        )
        engine = cls(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            model_path=loaded.path,
            fingerprint=loaded.fingerprint,
            verify_backend=verify_backend,
            prompt_cache_bytes=prompt_cache_bytes,
        )
        engine.adapter_path = Path(adapter_path) if adapter_path is not None else None
        attach_declared(engine.trunk, loaded.path, loaded.config)  # a vision-language checkpoint's tower
        head, draft_model = engine._load_block_drafter(head, draft_model, mtp is not False, bool(distributed))
        if mtp is not False:  # mtp=False: plain AR; no head is looked for, so a misfit one cannot fail
            engine.head = find_head(
                loaded, engine.trunk, model=model, head=head, dtype=dtype, required=bool(mtp)
            )
        if depth is not None and depth < 1:
            raise MtplxError(f"depth must be >= 1 (got {depth})")
        engine.depth = depth if depth is not None else engine._default_depth()
        engine.adaptive_threshold = engine._tuned_threshold()
        if draft_model is not None:
            engine._load_draft_model(draft_model)
        if kv_plan is not None:
            engine._quantize_kv(kv_plan)
        if distributed:
            from mtplx.engine import distributed as dist

            timeout = (
                collective_timeout if collective_timeout is not None else dist.DEFAULT_COLLECTIVE_TIMEOUT
            )
            engine.distributed = dist.shard_engine(engine, group, distributed, timeout)
        return engine

    def _quantize_kv(self, plan: KVQuantization) -> None:
        """The trunk's KV cache quantized from ``plan.start`` on (mlx-lm's names and defaults: no
        bits, groups of 64, start 5000), at the same positions in speculative and plain decoding
        (mtplx/trunk/kv_quant.py). The MTP head's own cache stays float: one layer beside the
        trunk's many, rebuilt from true hidden states every cycle; its precision moves acceptance
        only, never the output."""
        check_fit(self.trunk, self.head, plan)
        self.trunk.kv_quantization = plan
        if self.trunk.vision is not None:
            self.trunk.vision.refuse_kv_bits()
        print(f"mtplx: note: {KV_EXACTNESS_NOTE}", file=sys.stderr)

    def use_disk_cache(self, directory: str | Path, max_bytes: int, kv: str = "") -> None:
        """Keep prompt-cache entries in ``directory`` too, up to ``max_bytes``, and reuse the ones
        there that this engine's model, adapters, dtype, head, block drafter and KV quantization
        (``kv``; by default the engine's ``--kv-bits`` plan) made (`mtplx.trunk.prompt_cache_disk`)."""
        from mtplx.trunk.prompt_cache_disk import DiskTier

        if self.distributed is not None:
            raise MtplxError("prompt cache dir: not supported on a sharded engine")
        if self.prompt_cache.max_bytes == 0:
            raise MtplxError("prompt cache dir: needs a prompt cache in RAM (prompt cache bytes > 0)")
        self.prompt_cache.disk = DiskTier(directory, max_bytes, self.cache_identity(kv))

    def cache_identity(self, kv: str = "") -> dict[str, str]:
        """What state this engine made must agree on to be reused by another (the disk tier's
        entries, the saved batch cost profile): `prompt_cache_disk.cache_identity` of its model,
        adapters, dtype, head, block drafter and KV quantization (``kv``; by default its
        ``--kv-bits`` plan)."""
        from mtplx.trunk.prompt_cache_disk import cache_identity

        plan = self.trunk.kv_quantization
        if not kv and plan is not None:
            kv = plan.label
        return cache_identity(
            fingerprint=self.fingerprint,
            trunk=self.trunk,
            head=self.head,
            adapter_path=self.adapter_path,
            kv=kv,
            drafter=self.block_drafter,
        )

    def _load_block_drafter(self, head, draft_model, search: bool, sharded: bool) -> tuple:
        """A DFlash / DFlash2 / DSpark / EAGLE-3 drafter named by ``head`` or ``draft_model`` (a
        directory; then it is neither), else (``search``, not ``sharded``) a fitting one beside the
        model, found by name then checked by config (`mtplx.drafters.discovery`); a named misfit
        is a one-line error naming the field, and so is one named for a sharded engine. Returns
        the (head, draft_model) still to load."""
        from mtplx.drafters import discovery
        from mtplx.spec_decode.block_proposer import BlockDrafter
        from mtplx.spec_decode.sources import Source

        named = [g for g in (head, draft_model) if discovery.read_block_drafter_config(g) is not None]
        model_path = Path(self.model_path or ".")
        found = discovery.find_block_drafter(model_path, named[0] if named else None, self.config)
        if found is None or (not named and not (search and not sharded and discovery.drafts(found))):
            return head, draft_model
        if sharded:
            raise MtplxError(f"{found.path}: block drafters are not supported on a sharded engine")
        drafter = discovery.load_block_drafter(found)  # a misfit: one line naming the field
        self.block_drafter = BlockDrafter(drafter, Source(found.layout))
        return (None if head in named else head), (None if draft_model in named else draft_model)

    def _load_draft_model(self, path: str | Path) -> None:
        from mtplx.checkpoints import load as loading
        from mtplx.drafters import discovery
        from mtplx.spec_decode.draft_model_proposer import check_compatible, embedding_rows

        block = discovery.find_block_drafter(Path(self.model_path or "."), path, self.config)
        if block is not None:  # a DFlash / DSpark / EAGLE-3 directory, not an mlx-lm model
            discovery.refuse_block_drafter(block)
        try:
            loaded = loading.load_model(path)
        except MtplxError as e:
            raise MtplxError(f"draft model: {e}") from None
        self.draft_vocab_size = check_compatible(
            self.tokenizer,
            loaded.tokenizer,
            embedding_rows(self.trunk.model),
            embedding_rows(loaded.model),
            str(path),
        )
        self.draft_model = loaded.model

    def _tuned_threshold(self) -> float:
        """`mtplx tune`'s adaptive-length threshold for this model here, else the built-in default."""
        from mtplx.engine import tuned

        saved = tuned.saved_threshold(self.fingerprint)
        return saved if saved is not None else DEFAULT_ADAPTIVE_THRESHOLD

    def _default_depth(self) -> int:
        """`mtplx tune`'s choice for this model on this machine (0 = AR was fastest), else the head's default."""
        from mtplx.engine import tuned

        saved = tuned.saved_depth(self.fingerprint)
        return saved if saved is not None else head_depth(self.head)

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
    ) -> BatchScheduler:
        """A scheduler that decodes up to ``max_rows`` requests together on this engine, with up to
        ``prompt_concurrency`` prefilling meanwhile, ``prefill_step_size`` prompt tokens in all per
        cycle (`mtplx.engine.scheduler`). ``draft_policy``: "auto" chooses each cycle's draft length
        from the cost profile and the rows' acceptance (`mtplx.spec_decode.draft_policy`);
        "fixed" drafts every row's depth every cycle."""
        if draft_policy not in DRAFT_POLICIES:
            raise MtplxError(
                f"draft policy: must be one of {', '.join(DRAFT_POLICIES)} (got {draft_policy!r})"
            )
        # No profile to measure where nothing batches (every request then decodes one row at a time).
        batches = self._model_batch_refusal() is None
        policy = DraftPolicy(self.batch_cost_profile()) if draft_policy == "auto" and batches else None
        return BatchScheduler(
            self,
            max_rows,
            prompt_concurrency,
            prefill_step_size,
            policy=policy,
            single_row=self.distributed is not None,
        )

    def batch_cost_profile(self, remeasure: bool = False) -> CostProfile:
        """What a batched cycle costs here: the profile saved for this engine on this machine, else
        measured (a few seconds) and saved (`tuned.engine_batch_cost`); ``remeasure`` measures it now."""
        if self._cost_profile is None or remeasure:
            from mtplx.engine import tuned

            self._cost_profile = tuned.engine_batch_cost(self, remeasure)
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


KV_EXACTNESS_NOTE = (
    "kv_bits: tokens equal plain decoding's only for one request decoded alone on a fresh cache; "
    "speculation, batched rows and prompt-cache reuse group positions into forwards differently, and "
    "rounding to a few bits can turn those float-level differences into other tokens (README: "
    "What is exact under --kv-bits)"
)


def _kv_plan(
    kv_bits: int | None, group_size: int | None, start: int | None, distributed: bool | str
) -> KVQuantization | None:
    """The validated KV quantization plan (None: float KV); refused on a sharded engine."""
    plan = KVQuantization.from_flags(kv_bits, group_size, start)
    if plan is not None and distributed:
        raise MtplxError("kv_bits: not supported when sharded")
    return plan


def _launch_group(distributed: bool | str, adapter_path) -> object:
    """The group of ranks a sharded engine runs over, checked before the (long) load: a process
    that runs alone, an unknown mode or adapters (merge them first) are refused."""
    from mtplx.engine import distributed as dist

    dist.parse_mode(distributed)
    if adapter_path is not None:
        raise MtplxError("adapter_path: not supported when sharded; merge the adapters first (mlx_lm.fuse)")
    return dist.launch_group()
