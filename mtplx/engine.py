"""`Engine`: load a model (and its MTP head), generate and stream text.

The engine owns everything between a prompt and text: tokenization and chat
templates, picking the decode loop, EOS / stop strings / max_tokens,
incremental detokenization that never splits a multi-byte character, and the
stats. The loops themselves live in `decode.py`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from mtplx import decode
from mtplx.drafters import DRAFT_KINDS
from mtplx.drafters.auto import AutoProposer
from mtplx.drafters.base import Proposer
from mtplx.drafters.draft_model import DraftModelProposer
from mtplx.drafters.head import HeadProposer
from mtplx.drafters.lookup import LookupConfig, LookupProposer
from mtplx.errors import MtplxError
from mtplx.sampling import SamplerConfig
from mtplx.trunk import Trunk

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
    peak_memory_gb: float = 0.0
    mode: str = "ar"  # "ar" | "mtp" (speculative, with any drafter: see `drafters`)
    depth: int = 0
    # Per drafter: {"head": {"drafted": n, "accepted": m}, "lookup": {...}, "model": {...}}
    drafters: dict[str, dict[str, int]] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationChunk:
    text: str  # new text since the previous chunk
    token_ids: list[int]  # new tokens since the previous chunk
    finish_reason: str | None  # None while running; "stop" | "length" at the end
    stats: GenerationStats


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: GenerationStats


class _StatsTracker:
    """Accumulates per-step measurements into `GenerationStats`."""

    def __init__(self, prompt_tokens: int, mode: str, depth: int):
        self.stats = GenerationStats(prompt_tokens=prompt_tokens, mode=mode, depth=depth)
        self._start = time.perf_counter()
        self._first_token_time: float | None = None
        self._drafted: list[int] = []  # per draft position (blocks may be longer than depth)
        self._accepted: list[int] = []
        self._committed_in_cycles = 0
        mx.reset_peak_memory()

    def record(self, step: decode.Step, num_tokens_kept: int) -> None:
        now = time.perf_counter()
        stats = self.stats
        if self._first_token_time is None:
            self._first_token_time = now
            stats.prefill_seconds = now - self._start
            stats.prefill_tokens_per_sec = stats.prompt_tokens / max(stats.prefill_seconds, 1e-9)
        else:  # every step after the first is a cycle (one without drafts is an AR step)
            stats.cycles += 1
            self._committed_in_cycles += num_tokens_kept
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
        # The first token comes from prefill; decode speed counts the tokens after it.
        stats.decode_tokens_per_sec = (
            (stats.generated_tokens - 1) / stats.decode_seconds if stats.decode_seconds > 0 else 0.0
        )
        stats.tokens_per_cycle = self._committed_in_cycles / stats.cycles if stats.cycles else 0.0
        stats.acceptance_per_position = [a / d for a, d in zip(self._accepted, self._drafted) if d]
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
    ):
        self.trunk = Trunk(model)
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

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        *,
        head: str | Path | None = None,
        depth: int | None = None,
        dtype: str | None = None,
        verify_backend: str = "auto",
        draft_model: str | Path | None = None,
    ) -> Engine:
        """Load ``model`` (local path, Hugging Face repo id, or None for the embedded default).

        ``head`` is a forged-head directory; without it the checkpoint's own MTP
        head is used, or for the default model the head shipped with mtplx.
        ``draft_model`` is a separate mlx-lm model with the same tokenizer (`draft="model"`).
        """
        from mtplx import heads, loading

        if dtype not in (None, *loading.VARIANTS):
            raise MtplxError(f"dtype: must be one of {', '.join(loading.VARIANTS)}, got {dtype!r}")
        loaded = loading.load_model(model, variant=dtype or "float32")
        engine = cls(
            loaded.model,
            loaded.tokenizer,
            loaded.config,
            model_path=loaded.path,
            fingerprint=loaded.fingerprint,
            verify_backend=verify_backend,
        )
        head_dir = (
            Path(head)
            if head is not None
            else (heads.shipped_head_dir(loading.DEFAULT_MODEL_NAME) if model is None else None)
        )
        if head_dir is not None:
            from mtplx.heads import forged

            head_fingerprint = loaded.fingerprint
            if model is None and dtype == "q4":
                # The float32 build is the exact dequantization of the same GGUF blocks, so the
                # shipped head (forged on it) fits the 4-bit build too; check against its weights.
                head_fingerprint = loading.load_model(None, variant="float32", lazy=True).fingerprint
            engine.head = forged.load_forged_head(head_dir, engine.trunk, head_fingerprint)
        else:
            engine.head = heads.load_head(loaded.path, engine.trunk, loaded.config)
        if depth is not None and depth < 1:
            raise MtplxError(f"depth: must be >= 1, got {depth}")
        engine.depth = depth if depth is not None else engine._default_depth()
        engine.adaptive_threshold = engine._tuned_threshold()
        if draft_model is not None:
            engine._load_draft_model(draft_model)
        return engine

    def _load_draft_model(self, path: str | Path) -> None:
        from mtplx import loading
        from mtplx.drafters.draft_model import check_compatible, embedding_rows

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
        from mtplx import tune

        saved = tune.saved_threshold(self.fingerprint)
        return saved if saved is not None else DEFAULT_ADAPTIVE_THRESHOLD

    def _default_depth(self) -> int:
        """`mtplx tune`'s choice for this model on this machine (0 = AR was fastest), else the head's default."""
        from mtplx import tune

        tuned = tune.saved_depth(self.fingerprint)
        return tuned if tuned is not None else self._head_depth()

    def _head_depth(self) -> int:
        return int((self.head.default_depth if self.head is not None else None) or DEFAULT_DEPTH)

    @property
    def has_head(self) -> bool:
        return self.head is not None

    # --------------------------------------------------------------- prompting
    def encode_prompt(self, prompt: str | Sequence[dict], chat: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise MtplxError("prompt: is empty")
            use_chat = bool(chat)
            if use_chat:
                prompt = [{"role": "user", "content": prompt}]
        else:
            use_chat = True
            if not prompt:
                raise MtplxError("prompt: the message list is empty")
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
            raise MtplxError("prompt: encodes to no tokens")
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
        draft: str | None = None,
        lookup: LookupConfig | None = None,
        adaptive: bool = False,
        adaptive_threshold: float | None = None,
    ) -> Iterator[GenerationChunk]:
        """Generate incrementally; each chunk carries new text, new token ids and running stats.

        ``draft`` picks the drafter (`mtplx.drafters`): "auto" (default: prompt lookup where
        the text recurs, else the draft model or the MTP head when the engine has one and
        tuning did not find plain AR faster here), "head", "lookup", "model" or "none"
        (plain AR). ``mtp=True`` is an alias of "head", ``mtp=False`` of "none". ``depth`` is
        the most drafts a model drafter makes per cycle; ``adaptive`` stops the head earlier
        when it is unsure (threshold from `mtplx tune`, or ``adaptive_threshold``, which
        implies ``adaptive``).
        """
        if max_tokens <= 0:
            raise MtplxError(f"max_tokens: must be > 0, got {max_tokens}")
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
        if depth is not None and depth < 1:
            raise MtplxError(f"depth: must be >= 1, got {depth}")
        kind = self._draft_kind(draft, mtp)
        if adaptive_threshold is not None and not 0.0 < adaptive_threshold < 1.0:
            raise MtplxError(f"adaptive_threshold: must be in (0, 1), got {adaptive_threshold}")
        threshold = adaptive_threshold or (self.adaptive_threshold if adaptive else 0.0)
        lookup = (lookup or LookupConfig()).validate()
        tuned_to_ar = depth is None and not self.depth  # tuning found plain AR fastest here
        # The head's tuned depth says nothing about a draft model's best depth.
        model_depth = depth if depth is not None else DEFAULT_DEPTH
        # An explicit drafter on a model tuned to AR (depth 0) still drafts, at the head's own depth.
        depth = depth if depth is not None else (self.depth or self._head_depth())
        prompt_tokens = self.encode_prompt(prompt, chat)
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
        )
        key = mx.random.key(seed if seed is not None else int(time.time_ns() % (2**63)))
        proposer = self._proposer(kind, settings, lookup, tuned_to_ar, model_depth)
        if proposer is not None:
            steps = decode.speculative_decode(self.trunk, proposer, prompt_tokens, settings, key)
        else:
            steps = decode.ar_decode(self.trunk, prompt_tokens, settings, key)
        speculative = proposer is not None
        return self._assemble(
            steps,
            len(prompt_tokens),
            max_tokens,
            stops,
            "mtp" if speculative else "ar",
            depth if speculative else 0,
        )

    def _draft_kind(self, draft: str | None, mtp: bool | None) -> str:
        """The drafter asked for, checked against what this engine has (one-line errors)."""
        if draft is not None and draft not in DRAFT_KINDS:
            raise MtplxError(f"draft: must be one of {', '.join(DRAFT_KINDS)}, got {draft!r}")
        alias = None if mtp is None else ("head" if mtp else "none")
        if draft is not None and alias is not None and draft != alias:
            raise MtplxError(f"draft: {draft!r} contradicts mtp={mtp} (an alias of draft={alias!r})")
        kind = draft or alias or "auto"
        if kind == "head" and self.head is None:
            raise MtplxError(
                "this model has no MTP head: use --draft lookup or --no-mtp (mtp=False), "
                "or train one with `mtplx forge`"
            )
        if kind == "model" and self.draft_model is None:
            raise MtplxError(
                "draft: 'model' needs a draft model (--draft-model PATH, Engine.load(draft_model=...))"
            )
        return kind

    def _proposer(
        self,
        kind: str,
        settings: decode.DecodeSettings,
        lookup: LookupConfig,
        tuned_to_ar: bool,
        model_depth: int,
    ) -> Proposer | None:
        """A fresh drafter for one request (its state lives and dies with the request)."""
        if kind == "none":
            return None
        if kind == "lookup":
            return LookupProposer(lookup)
        model_drafter = None
        if kind == "model" or (kind == "auto" and self.draft_model is not None):
            model_drafter = DraftModelProposer(
                self.draft_model,
                sampler=settings.sampler,
                depth=model_depth,
                target_vocab_size=int(self.trunk.inner.embed_tokens.weight.shape[0]),
                real_vocab_size=self.draft_vocab_size,
                greedy_draft=settings.greedy_draft,
                prefill_step_size=settings.prefill_step_size,
                verify_backend=settings.verify_backend,
            )
        elif kind == "head" or (kind == "auto" and self.head is not None and not tuned_to_ar):
            model_drafter = HeadProposer(
                self.head,
                sampler=settings.sampler,
                depth=settings.depth,
                greedy_draft=settings.greedy_draft,
                adaptive_threshold=settings.adaptive_threshold,
                verify_backend=settings.verify_backend,
            )
        if kind == "auto":
            return AutoProposer(LookupProposer(lookup), model_drafter)
        return model_drafter

    def _assemble(
        self,
        steps: Iterator[decode.Step],
        num_prompt: int,
        max_tokens: int,
        stops: list[str],
        mode: str,
        depth: int,
    ) -> Iterator[GenerationChunk]:
        eos = set(self.tokenizer.eos_token_ids)
        tracker = _StatsTracker(num_prompt, mode, depth)
        text = _TextAssembler(self.tokenizer, stops)
        produced = 0
        try:
            for step in steps:
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
                if finish is not None:
                    delta += text.finish()
                    yield GenerationChunk(delta, kept, finish, tracker.stats)
                    return
                yield GenerationChunk(delta, kept, None, tracker.stats)
        finally:
            steps.close()

    def generate(self, prompt: str | Sequence[dict], **kwargs) -> GenerationResult:
        """Generate to completion; the same keyword arguments as `stream`."""
        text, tokens = [], []
        chunk = None
        for chunk in self.stream(prompt, **kwargs):
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
        assert chunk is not None  # stream always yields a final chunk
        return GenerationResult("".join(text), tokens, chunk.finish_reason or "stop", chunk.stats)
