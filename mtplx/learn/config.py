"""What a learning round does (`mtplx.learn.trainer`): the one source of its defaults, light enough for
the CLI (`mtplx serve --help`, `mtplx forge --help`): imports no MLX."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtplx.forge.config import FINE_TUNE_LR, ForgeConfig


@dataclass(frozen=True)
class LearnConfig:
    """What a learning round does (the server's and `forge --from-traffic`'s defaults)."""

    seq_len: int = 384  # tokens per sequence (longer prompts lose their start)
    top_k: int = 32  # teacher log-probs kept per position
    held_out_fraction: float = 0.25  # the most recent records measured on, never trained on
    min_records: int = 8  # records before the first round
    new_records: int = 8  # new records before the next round
    max_records: int = 320  # the newest records a round reads (train and held out): a round's cost is bounded
    max_train_rows: int = 256  # the newest training sequences a round uses
    steps: int = 40  # training steps per round
    batch_size: int = 8
    lr: float = FINE_TUNE_LR
    depth: int = 3
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.6)
    train_vocab: int | None = 4096
    eval_origins: int = 8
    min_gain: float = 0.0  # a candidate must beat the head in use by more than this (first-draft)
    seed: int = 0

    def forge_config(self, head: Any) -> ForgeConfig:
        """The `ForgeConfig` `TrainStep` reads (schedule, loss, batch rows)."""
        return ForgeConfig(
            depth=self.depth,
            step_weights=self.step_weights,
            batch_size=self.batch_size,
            lr=self.lr,
            warmup=max(self.steps // 10, 1),
            seed=self.seed,
            hidden_source=head.hidden_source,
            chain_source=head.chain_source,
            progress=False,
        )


DEFAULT_LEARN_CONFIG = LearnConfig()
