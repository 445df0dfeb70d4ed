"""What `mtplx serve` was started with (no web framework imported here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mtplx.engine.request import GenerationRequest
from mtplx.sample.params import SamplerConfig
from mtplx.spec_decode.settings import DEFAULT_PREFILL_STEP


@dataclass(frozen=True)
class ServerSettings:
    model_id: str  # the name replies report (the first --served-model-name, else the model given)
    # The names a request's `model` may use (`--served-model-name`); empty: any name (or none)
    # is the one loaded model, as llama.cpp and LM Studio do (Claude Code sends its own names).
    served_names: tuple[str, ...] = ()
    # What a request body leaves out: the sampler (OpenAI's defaults unless `serve` flags set
    # them), the seed and the drafting (`--draft`, `--depth`, ...). `max_tokens` is `default_max_tokens`.
    defaults: GenerationRequest = field(default_factory=lambda: GenerationRequest(sampler=SamplerConfig()))
    api_key: str | None = None
    max_queue: int = 64
    decode_concurrency: int = 32  # requests decoded together (mtplx.server.worker)
    prompt_concurrency: int = 8  # requests prefilled meanwhile
    prefill_step_size: int = DEFAULT_PREFILL_STEP  # prompt tokens per cycle, all prefilling requests together
    draft_policy: str = "auto"  # each batched cycle's draft length (mtplx.spec_decode.draft_policy)
    request_timeout: float = 600.0
    keepalive_interval: float = (
        5.0  # seconds between keep-alive events while a stream waits for its first token
    )
    default_max_tokens: int = 512
    max_tokens_cap: int = 8192
    # max_output_tokens of a Responses request that gives none (Codex never does): at most this,
    # and at most what the context leaves (`mtplx.server.app._agent_max_tokens`).
    responses_default_max_tokens: int = 4096
    max_body_bytes: int = 10 * 1024 * 1024
    responses_store_size: int = 64  # conversations kept for previous_response_id (an LRU, in memory)
    allowed_origins: tuple[str, ...] = ()
    # The prompt cache's disk tier (`mtplx.trunk.prompt_cache_disk`; None: RAM only) and its budget.
    prompt_cache_dir: str | None = None
    prompt_cache_disk_bytes: int = 0
    image_dir: Path | None = None  # local image files requests may name (None: data URLs only)
    learn_dir: str | None = None  # `--learn`: the traffic log and learned heads (`mtplx.learn`); None: off
    learn_max_bytes: int | None = None  # the traffic log's budget (None: `mtplx.learn.log.DEFAULT_LOG_BYTES`)
    learn_every: int | None = None  # new requests between learning rounds (None: LearnConfig's)
    learn_steps: int | None = None  # training steps per round (None: LearnConfig's)
    learn_samples: int | None = None  # sampled answers per logged request (None: LearnConfig's)
