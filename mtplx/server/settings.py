"""What `mtplx serve` was started with (no web framework imported here)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    model_id: str  # the one name the `model` field may carry
    api_key: str | None = None
    max_queue: int = 64
    request_timeout: float = 600.0
    default_max_tokens: int = 512
    max_tokens_cap: int = 8192
    max_body_bytes: int = 10 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()
    mtp: bool | None = None  # Engine.stream's mtp (None: the engine's default)
    depth: int | None = None
    greedy_draft: bool = False
