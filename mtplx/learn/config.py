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
    # The trunk's own sampled answers to the logged prompts, in idle time (`mtplx.learn.sampling`).
    samples: int = 0  # per training-side record (0: none)
    sample_temperature: float = 0.7  # forge's sampled setting
    sample_top_p: float = 0.95
    sample_rows: int = 12  # rows sampled together
    sample_prefill_step: int = 512  # prompt tokens prefilled per step (a step bounds a piece)
    piece_seconds: float = 1.0  # a sampling piece stops at the first step end past this

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
