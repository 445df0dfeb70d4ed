"""Draft heads: the MTP heads checkpoints ship, Gemma 4 assistants and forged heads.

- ``base``: the head protocol (``DraftHead``) and the module classes the families share
- ``eh_proj``: the DeepSeek-style module (enorm, hnorm, eh_proj, block, final norm) five layouts ship
- ``weights``: reading a head out of a checkpoint (the one loader template)
- ``qwen3_next`` / ``deepseek`` / ``mimo`` / ``step3p5`` / ...: one file per checkpoint layout, its math and key renaming
- ``registry``: one row per layout; ``load_head`` detects which one a checkpoint ships
- ``gemma4_assistant``: Google's separate drafter checkpoints; ``forged``: heads ``mtplx forge`` trains
- ``split_drafter``: heads split out by mlx-vlm (``qwen3_5_mtp``) beside stripped trunks; ``provenance``: their check at load
- ``discovery``: which head a loaded target drafts with (``find_head``)
"""

from __future__ import annotations

from mtplx.heads.base import DraftHead, MTPHead
from mtplx.heads.deepseek import DeepSeekMTPHead
from mtplx.heads.discovery import find_head, load_checkpoint_head
from mtplx.heads.mimo import MiMoMTPHead
from mtplx.heads.mimo_v2_flash import MiMoV2FlashMTPHead
from mtplx.heads.qwen3_next import Qwen3NextMTPHead
from mtplx.heads.registry import DEFAULT_HIDDEN_SOURCE, declared_mtp_layers, detect_layout, load_head
from mtplx.heads.weights import MissingHeadError

__all__ = [
    "DraftHead",
    "MTPHead",
    "Qwen3NextMTPHead",
    "DeepSeekMTPHead",
    "MiMoMTPHead",
    "MiMoV2FlashMTPHead",
    "load_head",
    "load_checkpoint_head",
    "find_head",
    "MissingHeadError",
    "detect_layout",
    "declared_mtp_layers",
    "DEFAULT_HIDDEN_SOURCE",
]
