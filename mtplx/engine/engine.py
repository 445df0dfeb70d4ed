"""`Engine`: load a model (and its MTP head), generate and stream text.

The engine owns everything between a prompt and text: tokenization and chat
templates, picking the decode loop, EOS / stop strings / max_tokens,
incremental detokenization that never splits a multi-byte character, and the
stats. The loops themselves live in `decode.py`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mtplx import resources
from mtplx.engine.request import check_generation_args
from mtplx.errors import MtplxError
from mtplx.spec_decode import DRAFT_KINDS
from mtplx.spec_decode import loop as decode
from mtplx.spec_decode.auto_proposer import AutoProposer
from mtplx.spec_decode.draft_model_proposer import DraftModelProposer
from mtplx.spec_decode.head_proposer import HeadProposer
from mtplx.spec_decode.lookup_proposer import LookupConfig, LookupProposer
from mtplx.spec_decode.proposer import Proposer
from mtplx.trunk.compat import cache_leaves
from mtplx.trunk.model import Trunk
from mtplx.trunk.prompt_cache import PromptCache, is_trimmable

import mlx.core as mx

DEFAULT_DEPTH = 3
# Adaptive head drafting stops after a draft the head gave less than this probability.
DEFAULT_ADAPTIVE_THRESHOLD = 0.3


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_tokens_per_sec: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0  # from the first generated token on: prefill excluded
    decode_tokens_per_sec: float = 0.0
    cycles: int = 0  # verify cycles (MTP) or decode steps (AR)
    tokens_per_cycle: float = 0.0
    acceptance_per_position: list[float] = field(default_factory=list)
    # Cycles that drafted at least k tokens, per position k: what each acceptance figure is over
    # (a lookup block can reach positions the model drafters never draft).
    drafted_per_position: list[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    mode: str = "ar"  # "ar" | "mtp" (speculative, with any drafter: see `drafters`)
    depth: int = 0
    ttft_seconds: float = 0.0  # from the start of the call to the first generated token
    total_seconds: float = 0.0  # from the start of the call to the last token so far
    prefilled_tokens: int = 0  # prompt tokens run through the trunk by this call
    cached_tokens: int = 0  # prompt tokens reused from a prompt cache (prompt = prefilled + cached)
    # Like tokens_per_cycle, over only the verify cycles whose tokens were all kept: the cycle that
    # EOS, a stop string or max_tokens cut short would understate what a cycle yields.
    tokens_per_full_cycle: float = 0.0
    # Draft tokens proposed / accepted by each drafter, e.g.
    # {"head": {"drafted": 40, "accepted": 22}, "lookup": {...}, "model": {...}}.
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)
    # Sharded runs: mode, ranks, collectives and payload bytes per cycle (see mtplx/engine/distributed.py).
    distributed: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new tokens since the previous chunk
    finish_reason: str | None  # None while running; "stop" | "length" at the end
    stats: GenerationStats
    logprobs: list[decode.TokenLogprobs] | None = None  # one per token id, when asked for


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class _StatsTracker:
    """Accumulates per-step measurements into `GenerationStats`."""

    def __init__(self, prompt_tokens: int, mode: str, depth: int, cached_tokens: int = 0):
        self.stats = GenerationStats(
            prompt_tokens=prompt_tokens,
            mode=mode,
            depth=depth,
            prefilled_tokens=prompt_tokens - cached_tokens,
            cached_tokens=cached_tokens,
        )
        self._start = time.perf_counter()
        self._first_token_time: float | None = None
        self._drafted: list[int] = []  # per draft position (blocks may be longer than depth)
        self._accepted: list[int] = []
        self._committed_in_cycles = 0
        self._full_cycles = 0
        self._committed_in_full_cycles = 0
        mx.reset_peak_memory()

    def record(self, step: decode.Step, num_tokens_kept: int) -> None:
        now = time.perf_counter()
        stats = self.stats
        if self._first_token_time is None:
            self._first_token_time = now
            stats.prefill_seconds = now - self._start
            stats.prefill_tokens_per_sec = stats.prefilled_tokens / max(stats.prefill_seconds, 1e-9)
            stats.ttft_seconds = stats.prefill_seconds
        else:  # every step after the first is a cycle (one without drafts is an AR step)
            stats.cycles += 1
            self._committed_in_cycles += num_tokens_kept
            if num_tokens_kept == len(step.tokens):
                self._full_cycles += 1
                self._committed_in_full_cycles += num_tokens_kept
            missing = step.num_drafted - len(self._drafted)
            if missing > 0:
                self._drafted += [0] * missing
                self._accepted += [0] * missing
            for position in range(step.num_drafted):
                self._drafted[position] += 1
                self._accepted[position] += int(position < step.num_accepted)
            start = 0
            for name, count in step.sources:
                counts = stats.drafters.setdefault(name, {"drafted": 0, "accepted": 0})
                counts["drafted"] += count
                counts["accepted"] += min(max(step.num_accepted - start, 0), count)
                start += count
        stats.generated_tokens += num_tokens_kept
        stats.decode_seconds = now - self._first_token_time
        stats.total_seconds = now - self._start
        # The first token comes from prefill; decode speed counts the tokens after it.
        stats.decode_tokens_per_sec = (
            (stats.generated_tokens - 1) / stats.decode_seconds if stats.decode_seconds > 0 else 0.0
        )
        stats.tokens_per_cycle = self._committed_in_cycles / stats.cycles if stats.cycles else 0.0
        stats.tokens_per_full_cycle = (
            self._committed_in_full_cycles / self._full_cycles if self._full_cycles else 0.0
        )
        stats.acceptance_per_position = [a / d for a, d in zip(self._accepted, self._drafted) if d]
        stats.drafted_per_position = [d for d in self._drafted if d]
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9


class _TextAssembler:
    """Incremental detokenization with stop strings that may span tokens.

    Text that could still turn out to be the start of a stop string is held
    back, so a stop string is never emitted, even partly.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self._detok = tokenizer.detokenizer
        self._detok.reset()
        self._stop = [s for s in stop if s]
        self._emitted = 0
        self.stopped = False

    def _held_back(self, text: str) -> int:
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def add(self, token: int) -> str:
        self._detok.add_token(token)
        text = self._detok.text
        hits = [i for i in (text.find(s, max(self._emitted - len(s), 0)) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        return self._take(text, len(text) - self._held_back(text))

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._take(self._detok.text, len(self._detok.text))

    def _take(self, text: str, end: int) -> str:
        end = max(end, self._emitted)
        delta = text[self._emitted : end]
        self._emitted = end
        return delta


def _load_head(model, head, dtype, loaded, trunk, required: bool = False):
    """The draft head for a loaded target: ``head`` (a forged-head directory, or a Gemma 4
    assistant directory / cached repo id), else the checkpoint's own, else for a Gemma 4 target
    ``<target>-assistant`` beside it or in the HF cache, else for the default model the shipped one."""
    from mtplx import heads
    from mtplx.checkpoints import load as loading
    from mtplx.heads import gemma4_assistant

    # The default model given by its converted directory is still the default model.
    default_variant = (dtype or "float32") if model is None else loading.default_model_variant(loaded.path)
    head_dir = (
        loading.resolve_model(head)  # a directory, or a repo id (Gemma 4 assistants)
        if head is not None
        else (resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME) if default_variant else None)
    )
    if head_dir is None:
        own = heads.load_checkpoint_head(loaded.path, trunk, loaded.config, required=required)
        if own is not None or not gemma4_assistant.is_gemma4_target(loaded.config):
            return own
        head_dir = gemma4_assistant.find_assistant(loaded.path, model)
        if head_dir is None:
            return None
    if gemma4_assistant.read_assistant_config(head_dir) is not None:
        return gemma4_assistant.load_gemma4_assistant(head_dir, trunk, loaded.config)
    from mtplx.heads import forged

    head_fingerprint = loaded.fingerprint
    if default_variant == "q4":
        # The float32 build is the exact dequantization of the same GGUF blocks, so the
        # shipped head (forged on it) fits the 4-bit build too; check against its weights.
        head_fingerprint = loading.load_model(None, variant="float32", lazy=True).fingerprint
    return forged.load_forged_head(head_dir, trunk, head_fingerprint)


class _CacheSession:
    """One request's caches and what goes back into the prompt cache when it ends.

    Caches that cannot be moved back (recurrent state) are snapshotted when they
    hold all prompt positions but the last; pure KV caches are handed over at the
    end, covering the generated tokens too (a chat's next turn repeats them).
    """

    def __init__(
        self,
        store: PromptCache,
        prompt_tokens: list[int],
        trunk_cache: list,
        head_cache: list | None,
        start: int,
    ):
        self.store = store
        self.prompt_tokens = prompt_tokens
        self.trunk_cache = trunk_cache
        self.head_cache = head_cache
        self.trimmable = is_trimmable(trunk_cache) and (head_cache is None or is_trimmable(head_cache))
        self.tokens = list(prompt_tokens)  # every token the decode loop has seen
        snapshot = None if self.trimmable or store.max_bytes == 0 else self._snapshot
        self.prefix = decode.PromptPrefix(start, snapshot)

    def _snapshot(self, size: int) -> None:
        self.store.insert(self.prompt_tokens, size, self.trunk_cache, self.head_cache, copy=True)

    def record(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def finish(self) -> None:
        """The decode loop stopped between steps: its caches are consistent with ``tokens``."""
        if not self.trimmable or self.store.max_bytes == 0:
            return
        caches = list(self.trunk_cache) + list(self.head_cache or [])
        size = min(min((c.offset for c in cache_leaves(caches)), default=0), len(self.tokens))
        self.store.insert(self.tokens, size, self.trunk_cache, self.head_cache, copy=False)


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
        self.tokenizer = tokenizer
        self.config = config
        self.head = head
        self.depth = depth
        self.model_path = model_path
        self.fingerprint = fingerprint
        self.verify_backend = verify_backend
        self.draft_model = draft_model  # a separate mlx-lm model with the same tokenizer, or None
        self.draft_vocab_size = draft_vocab_size  # the real vocabulary both share (q = 0 past it)
        self.adaptive_threshold = adaptive_threshold  # used when adaptive drafting is asked for
        self.distributed = None  # a mtplx.engine.distributed.Distributed once sharded
        self._warned_depth = False  # the deeper-than-trained warning is printed once per engine

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
        model's, exactly.
        """
        from mtplx.checkpoints import load as loading

        if dtype not in (None, *loading.VARIANTS):
            raise MtplxError(f"dtype must be one of {', '.join(loading.VARIANTS)} (got {dtype})")
        if distributed:
            from mtplx.engine import distributed as dist

            dist.parse_mode(distributed)
            if adapter_path is not None:
                raise MtplxError(
                    "adapter_path: not supported when sharded; merge the adapters first (mlx_lm.fuse)"
                )
            group = dist.launch_group()  # before the (long) load: refuse a process that runs alone
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
        if mtp is not False:  # mtp=False: plain AR; no head is looked for, so a misfit one cannot fail
            engine.head = _load_head(model, head, dtype, loaded, engine.trunk, required=bool(mtp))
        if depth is not None and depth < 1:
            raise MtplxError(f"depth must be >= 1 (got {depth})")
        engine.depth = depth if depth is not None else engine._default_depth()
        engine.adaptive_threshold = engine._tuned_threshold()
        if draft_model is not None:
            engine._load_draft_model(draft_model)
        if distributed:
            timeout = (
                collective_timeout if collective_timeout is not None else dist.DEFAULT_COLLECTIVE_TIMEOUT
            )
            engine.distributed = dist.shard_engine(engine, group, distributed, timeout)
        return engine

    def _load_draft_model(self, path: str | Path) -> None:
        from mtplx.checkpoints import load as loading
        from mtplx.spec_decode.draft_model_proposer import check_compatible, embedding_rows

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
        return saved if saved is not None else self._head_depth()

    def _head_depth(self) -> int:
        return int((self.head.default_depth if self.head is not None else None) or DEFAULT_DEPTH)

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
        self, prompt: str | Sequence[dict] | Sequence[int], chat: bool | None = None
    ) -> list[int]:
        """Token ids of ``prompt``: raw text, a chat message list, or token ids (taken as they are)."""
        if not isinstance(prompt, str) and prompt and all(isinstance(t, int) for t in prompt):
            vocab = self.trunk.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise MtplxError(f"prompt: token id {bad} is outside the vocabulary of {vocab}")
            return list(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise MtplxError("prompt is empty")
            use_chat = bool(chat)
            if use_chat:
                prompt = [{"role": "user", "content": prompt}]
        else:
            use_chat = True
            if not prompt:
                raise MtplxError("prompt is an empty message list")
        if use_chat:
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise MtplxError("prompt: this model's tokenizer has no chat template; pass raw text")
            tokens = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=True
            )
            if isinstance(tokens, dict):
                tokens = tokens["input_ids"]
        else:
            tokens = self.tokenizer.encode(prompt)
        tokens = list(tokens)
        if not tokens:
            raise MtplxError("prompt encodes to no tokens")
        return tokens

    def _context_length(self) -> int | None:
        text_config = self.config.get("text_config", self.config)
        return text_config.get("max_position_embeddings")

    # -------------------------------------------------------------- generation
    def stream(
        self,
        prompt: str | Sequence[dict],
        *,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
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
    ) -> Iterator[GenerationChunk]:
        """Generate incrementally; each chunk carries new text, new token ids and running stats.

        ``draft`` picks the drafter (`mtplx.spec_decode`): "auto" (default: prompt lookup where
        the text recurs, else the draft model or the MTP head when the engine has one and
        tuning did not find plain AR faster here), "head", "lookup", "model" or "none"
        (plain AR). ``mtp=True`` is an alias of "head", ``mtp=False`` of "none". ``depth`` is
        the most drafts a model drafter makes per cycle; ``adaptive`` stops the head earlier
        when it is unsure (threshold from `mtplx tune`, or ``adaptive_threshold``, which
        implies ``adaptive``). ``logprobs=n`` reports the target's log-probability of each
        token plus its top n.
        """
        if logprobs is not None and logprobs < 0:
            raise MtplxError(f"logprobs must be >= 0 (got {logprobs})")
        sampler = check_generation_args(
            max_tokens=max_tokens,
            depth=depth,
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logit_bias=logit_bias,
        )
        kind = self._draft_kind(draft, mtp)
        if adaptive_threshold is not None and not 0.0 < adaptive_threshold < 1.0:
            raise MtplxError(f"adaptive_threshold: must be in (0, 1), got {adaptive_threshold}")
        threshold = adaptive_threshold or (self.adaptive_threshold if adaptive else 0.0)
        lookup = (lookup or LookupConfig()).validate()
        model_drafter = self._model_drafter(kind, tuned_to_ar=depth is None and not self.depth)
        # The head's tuned depth says nothing about a draft model's best depth.
        model_depth = depth if depth is not None else DEFAULT_DEPTH
        # An explicit drafter on a model tuned to AR (depth 0) still drafts, at the head's own depth.
        depth = depth if depth is not None else (self.depth or self._head_depth())
        prompt_tokens = self.encode_prompt(prompt, chat)
        if model_drafter == "head":
            self._warn_if_deeper_than_trained(depth)
        limit = self._context_length()
        if limit is not None and len(prompt_tokens) + max_tokens > limit:
            raise MtplxError(
                f"prompt: {len(prompt_tokens)} tokens + max_tokens {max_tokens} exceed "
                f"the model's context of {limit} tokens"
            )
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        settings = decode.DecodeSettings(
            sampler=sampler,
            depth=depth,
            greedy_draft=greedy_draft,
            verify_backend=self.verify_backend,
            adaptive_threshold=threshold,
            logprobs=logprobs,
        )
        if self.distributed is not None:  # every rank must run this request with rank 0's seed
            seed = self.distributed.agree_on_request(
                seed, {"prompt": prompt_tokens, "settings": settings, "draft": kind, "max_tokens": max_tokens}
            )
        key = mx.random.key(seed if seed is not None else int(time.time_ns() % (2**63)))
        session = self._cache_session(prompt_tokens, model_drafter == "head")
        proposer = self._proposer(kind, model_drafter, settings, lookup, model_depth, session.head_cache)
        if proposer is not None:
            steps = decode.speculative_decode(
                self.trunk, proposer, prompt_tokens, settings, key, session.trunk_cache, session.prefix
            )
        else:
            steps = decode.ar_decode(
                self.trunk, prompt_tokens, settings, key, session.trunk_cache, session.prefix
            )
        if self.distributed is not None:
            steps = self.distributed.guard_steps(steps)
        speculative = proposer is not None
        return self._assemble(
            steps, session, max_tokens, stops, "mtp" if speculative else "ar", depth if speculative else 0
        )

    def _cache_session(self, prompt_tokens: list[int], with_head: bool) -> _CacheSession:
        hit = self.prompt_cache.lookup(prompt_tokens, with_head)
        if hit is None:
            trunk_cache = self.trunk.make_cache()
            head_cache = self.head.make_cache() if with_head else None
            start = 0
        else:
            trunk_cache, head_cache, start = hit.trunk_cache, hit.head_cache, hit.start
        return _CacheSession(self.prompt_cache, prompt_tokens, trunk_cache, head_cache, start)

    def _draft_kind(self, draft: str | None, mtp: bool | None) -> str:
        """The drafter asked for, checked against what this engine has (one-line errors)."""
        if draft is not None and draft not in DRAFT_KINDS:
            raise MtplxError(f"draft: must be one of {', '.join(DRAFT_KINDS)}, got {draft!r}")
        alias = None if mtp is None else ("head" if mtp else "none")
        if draft is not None and alias is not None and draft != alias:
            raise MtplxError(f"draft: {draft!r} contradicts mtp={mtp} (an alias of draft={alias!r})")
        kind = draft or alias or "auto"
        if kind == "head" and self.head is None:
            from mtplx.heads import gemma4_assistant

            if gemma4_assistant.is_gemma4_target(self.config):
                raise MtplxError(gemma4_assistant.MISSING_ASSISTANT)
            raise MtplxError(
                "this model has no MTP head: use --draft lookup or --no-mtp (mtp=False), "
                "or train one with `mtplx forge`"
            )
        if kind == "model" and self.draft_model is None:
            raise MtplxError(
                "draft: 'model' needs a draft model (--draft-model PATH, Engine.load(draft_model=...))"
            )
        return kind

    def _model_drafter(self, kind: str, *, tuned_to_ar: bool) -> str | None:
        """Which model drafter a request uses: "head", "model" (the draft model) or None."""
        if kind == "model" or (kind == "auto" and self.draft_model is not None):
            return "model"
        if kind == "head" or (kind == "auto" and self.head is not None and not tuned_to_ar):
            return "head"
        return None

    def _proposer(
        self,
        kind: str,
        model_drafter: str | None,
        settings: decode.DecodeSettings,
        lookup: LookupConfig,
        model_depth: int,
        head_cache: list | None,
    ) -> Proposer | None:
        """A fresh drafter for one request (its state lives and dies with the request, except
        the head's cache, which comes from the request's prompt-cache session)."""
        if kind == "none":
            return None
        if kind == "lookup":
            return LookupProposer(lookup)
        drafter: Proposer | None = None
        if model_drafter == "model":
            drafter = DraftModelProposer(
                self.draft_model,
                sampler=settings.sampler,
                depth=model_depth,
                target_vocab_size=int(self.trunk.vocab_size),
                real_vocab_size=self.draft_vocab_size,
                greedy_draft=settings.greedy_draft,
                prefill_step_size=settings.prefill_step_size,
                verify_backend=settings.verify_backend,
            )
        elif model_drafter == "head":
            drafter = HeadProposer.from_settings(self.head, settings, head_cache)
        if kind == "auto":
            return AutoProposer(LookupProposer(lookup), drafter)
        return drafter

    def _assemble(
        self,
        steps: Iterator[decode.Step],
        session: _CacheSession,
        max_tokens: int,
        stops: list[str],
        mode: str,
        depth: int,
    ) -> Iterator[GenerationChunk]:
        eos = set(self.tokenizer.eos_token_ids)
        tracker = _StatsTracker(len(session.prompt_tokens), mode, depth, session.prefix.start)
        if self.distributed is not None:
            tracker.stats.distributed = self.distributed.stats(depth + 1 if mode == "mtp" else 1)
        text = _TextAssembler(self.tokenizer, stops)
        produced = 0
        candidates_before = self._candidate_counts() if mode == "mtp" else None
        clean_end = False
        try:
            for step in steps:
                session.record(step.tokens)
                kept: list[int] = []
                delta = ""
                finish = None
                for token in step.tokens:
                    if token in eos:
                        finish = "stop"
                        break
                    kept.append(token)
                    produced += 1
                    delta += text.add(token)
                    if text.stopped:
                        finish = "stop"
                        break
                    if produced >= max_tokens:
                        finish = "length"
                        break
                tracker.record(step, len(kept))
                logprobs = step.logprobs[: len(kept)] if step.logprobs is not None else None
                if finish is not None:
                    if candidates_before is not None:
                        now = self._candidate_counts()
                        tracker.stats.drafters["head"].update({k: now[k] - candidates_before[k] for k in now})
                    delta += text.finish()
                    clean_end = True
                    yield GenerationChunk(delta, kept, finish, tracker.stats, logprobs)
                    return
                clean_end = True  # the consumer may close the stream at this yield
                yield GenerationChunk(delta, kept, None, tracker.stats, logprobs)
                clean_end = False
        finally:
            steps.close()
            if clean_end:
                session.finish()

    def _candidate_counts(self) -> dict[str, int] | None:
        """A Gemma 4 assistant with a narrowed vocabulary: its running counts of target tokens checked
        against the draft candidates and found outside them (stats report this generation's share)."""
        from mtplx.heads.gemma4_assistant import Gemma4AssistantHead

        if isinstance(self.head, Gemma4AssistantHead) and self.head.narrowed:
            counts = self.head.candidate_stats()
            return {
                "target_checked": counts["checked"],
                "target_outside_candidates": counts["outside_candidates"],
            }
        return None

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> GenerationResult:
        """Generate to completion; the same keyword arguments as `stream`."""
        text, tokens = [], []
        chunk = None
        for chunk in self.stream(prompt, **kwargs):
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
        assert chunk is not None  # stream always yields a final chunk
        return GenerationResult("".join(text), tokens, chunk.finish_reason or "stop", chunk.stats)
