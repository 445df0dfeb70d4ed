"""`mtplx forge`'s configuration: the one source of its defaults, light enough for the CLI.

`mtplx forge --help` shows these defaults (`mtplx.cli.forge` builds its flags from them);
importing them must not import MLX, mlx-lm or transformers (`mtplx.forge.run` does, ~2 s), so
they live here. Imports the standard library, `mtplx.resources`, `mtplx.sample.params` and
`mtplx.spec_decode.sources` (the drafters' names) only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mtplx.errors import MtplxError
from mtplx.resources import prompt_suite
from mtplx.spec_decode.sources import Source
from mtplx.trunk.hidden import HIDDEN_SOURCES

# The benchmark suite of this repository: held out from every forge run that can see it.
BENCHMARK_SUITE = prompt_suite()
# How a time budget is shared between the stages (the rest: evaluation and writing the head).
# Generation gets the larger share: on a 2-core CPU it yields ~60 tokens/s, and a head trained
# many epochs on little data fits its data, not the trunk (measured on the first shipped head).
GEN_SHARE, TRAIN_SHARE = 0.6, 0.3
TOKEN_BUDGET_EPOCHS = 2  # a token budget trains this many passes over what it generated
MIN_TIME_BUDGET_S = 60.0
# Peak learning rates. From the trunk's last layer a head has far to go; from a forged head
# (--init-head) the from-scratch rate first undoes what it knew: fine-tunes of the default head
# dipped at 3e-4 and 5e-4 and did not at 1e-4, which ended best (the model card's ablations).
SCRATCH_LR, FINE_TUNE_LR = 1e-3, 1e-4
FORGED_DRAFTERS = (Source.EAGLE3.value,)  # what `mtplx forge --drafter` trains (`mtplx.forge.drafter`)


@dataclass(frozen=True)
class ForgeConfig:
    """Everything that determines a forged head (recorded in its manifest).

    ``DEFAULT_FORGE_CONFIG`` is the one source of the defaults: ``forge()`` and
    ``mtplx forge`` both start from it and override only what they are given.
    """

    out_dir: str = "forged-head"
    model: str | None = None  # model spec for ``load_model``; None = the default model
    data: tuple[str, ...] | None = None  # prompt files (.txt/.md/.rst/.py/.jsonl) or dirs; None = default set
    work_dir: str | None = None  # shards and checkpoints; default under the mtplx cache
    budget: str | None = None  # "2h" / "45m" (whole run) or "3M" / "500k" (tokens); overrides the two below
    gen_tokens: int = 200_000  # response tokens to generate
    steps: int = 1500
    overwrite: bool = False
    init_head: str | None = None  # start from this forged head (same trunk) instead of the trunk's last layer
    head_layers: int = 1  # layers run in sequence per draft step; those beyond init_head's start as identity
    drafter: str | None = None  # "eagle3": forge an EAGLE-3 drafter (`mtplx.forge.drafter`), not an MTP head
    # data generation
    seq_len: int = 384  # slots per sequence: prompt + response
    max_prompt: int = 256  # longer prompts are skipped (a chat template cannot be cut)
    gen_batch: int = 32  # sequences per batched forward (finished rows leave the batch)
    settings: tuple[tuple[float, float], ...] = ((0.0, 1.0), (0.7, 0.95))  # (temperature, top_p), by shard
    top_n: int = 32  # teacher log-probs kept per position (plus the rest mass)
    eval_fraction: float = 0.03  # prompts (by source hash) kept for the held-out generations
    eval_tokens: int = 1024
    held_out: str | None = str(BENCHMARK_SUITE) if BENCHMARK_SUITE is not None else None
    # training
    depth: int = 3  # draft steps unrolled in training = the head's max_depth
    step_weights: tuple[float, ...] = (1.0, 0.8, 0.6)
    batch_size: int = 8
    max_epochs: float = 8.0  # a time budget trains at most this many passes over the generated data
    lr: float | None = None  # peak; None = SCRATCH_LR, or FINE_TUNE_LR with init_head (see peak_lr)
    warmup: int = 30
    weight_decay: float = 0.0
    hidden_source: str = "pre_norm"  # measured better for SmolLM2 (see its model card)
    chain_source: str = "pre_norm"
    train_vocab: int | None = 4096  # frequent ids shared by every position's softmax (cost); None = full
    draft_vocab: int | str | None = "auto"  # ship a reduced vocabulary: a size, "auto" or None (full)
    eval_vocab_sizes: tuple[int, ...] = (4096, 8192)
    checkpoint_every: int = 50
    eval_origins: int = 24
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("hidden_source", "chain_source"):
            if getattr(self, name) not in HIDDEN_SOURCES:
                raise MtplxError(
                    f"forge: {name} must be one of {', '.join(HIDDEN_SOURCES)}, got {getattr(self, name)!r}"
                )
        for name in (
            "gen_tokens",
            "seq_len",
            "top_n",
            "steps",
            "batch_size",
            "gen_batch",
            "depth",
            "max_epochs",
            "head_layers",
        ):
            if int(getattr(self, name)) <= 0:
                raise MtplxError(f"forge: {name} must be positive, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise MtplxError(f"forge: lr must be positive, got {self.lr}")
        if len(self.step_weights) < self.depth or any(w < 0 for w in self.step_weights[: self.depth]):
            raise MtplxError(
                f"forge: step_weights needs {self.depth} non-negative weights, got {self.step_weights}"
            )
        if self.drafter not in (None, *FORGED_DRAFTERS):
            raise MtplxError(
                f"forge: drafter must be one of {', '.join(FORGED_DRAFTERS)}, got {self.drafter!r}"
            )
        if self.drafter is not None and self.init_head is not None:
            raise MtplxError("forge: --init-head starts an MTP head; a drafter starts from the trunk")
        if isinstance(self.draft_vocab, str) and self.draft_vocab != "auto":
            raise MtplxError(
                f"forge: draft_vocab must be a number of ids, 'auto' or None, got {self.draft_vocab!r}"
            )
        if self.max_prompt >= self.seq_len - 1:
            raise MtplxError(
                f"forge: max_prompt ({self.max_prompt}) must be below seq_len - 1 ({self.seq_len - 1})"
            )
        if self.budget is not None:
            parse_budget(self.budget)

    @property
    def peak_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return FINE_TUNE_LR if self.init_head else SCRATCH_LR


DEFAULT_FORGE_CONFIG = ForgeConfig()


@dataclass(frozen=True)
class Budget:
    seconds: float | None = None
    tokens: int | None = None


# The whole text (fullmatch), ASCII digits, spaces only around the unit: a newline or a tab is refused.
_BUDGET = re.compile(r" *(\d+(?:\.\d+)?) *(h|m|min|s|k|K|M|G) *", re.ASCII)


def parse_budget(text: str) -> Budget:
    """``2h``, ``45m``/``45min``, ``90s`` = wall time of the whole run; ``500k``/``3M``/``1G`` = tokens generated."""
    match = _BUDGET.fullmatch(text)
    if match is None:
        raise MtplxError(
            f"--budget: expected a time (2h, 45m, 90s) or a token count (500k, 3M), got {text!r}"
        )
    value, unit = float(match.group(1)), match.group(2)
    if unit in ("h", "m", "min", "s"):
        return Budget(seconds=value * {"h": 3600, "m": 60, "min": 60, "s": 1}[unit])
    return Budget(tokens=int(value * {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}[unit]))
