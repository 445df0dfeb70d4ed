"""MTP heads: one module per checkpoint layout; ``load_head`` detects which one a checkpoint ships."""

from mtplx.heads.base import MTPHead
from mtplx.heads.qwen3_next import Qwen3NextMTPHead

__all__ = ["MTPHead", "Qwen3NextMTPHead"]
