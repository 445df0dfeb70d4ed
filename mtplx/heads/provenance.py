"""Does a drafter belong to these weights? First-position agreement on a fixed text, measured at load.

A split MTP drafter is matched to its target by name and config (``split_drafter``); a drafter of
another fine-tune of the same base fits both and drafts badly, silently (output stays exact,
only speed is lost). So at load the drafter is measured once: the target reads ``BUILTIN_TEXT``
(one forward), the drafter reads the target's hidden states and the text's next tokens (one
forward), and at every position the drafter's greedy first draft is compared with the target's
greedy token there. That is greedy first-position acceptance under teacher forcing: exactly what
depth-1 greedy decoding of this text would accept.

``WARN_BELOW`` (0.25): heads of the weights they were trained with agree far above it on ordinary
text (published Qwen3.5 MTP first-position acceptance is 0.6-0.8: mlx-lm PR #990 reports 80.6%
on Qwen3.5-27B 4-bit; a Qwen3.5-4B artifact 0.67 at temperature 0.6); a head of unrelated weights
agrees about as often as chance (1 / vocabulary). Over the ~60 positions measured, the binomial
spread of a true 0.6 is about 0.06, so a legitimate head (even quantized) does not fall to 0.25
by noise, while a head that agrees on fewer than one position in four is not worth its cost.
A warning only: the drafter keeps drafting, and the output is exact either way.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

WARN_BELOW = 0.25
MAX_POSITIONS = 64

# Plain prose and a little code, the kinds of text drafters are used on. Fixed: the figure is
# comparable across runs and machines.
BUILTIN_TEXT = (
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
    "clocks were striking thirteen. We read the file, count the words, and print the result. "
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n"
    "The river runs to the sea, and the sea is never full."
)


@dataclass(frozen=True)
class Provenance:
    """The drafter's greedy first-position agreement with the target over ``positions``."""

    agreement: float
    positions: int

    @property
    def suspicious(self) -> bool:
        return self.agreement < WARN_BELOW

    def describe(self) -> str:
        return (
            f"first-position agreement {self.agreement:.2f} over {self.positions} positions of a fixed text"
        )


def text_ids(tokenizer: Any, text: str = BUILTIN_TEXT) -> list[int]:
    """The text's token ids (no special tokens), at most ``MAX_POSITIONS + 1``."""
    ids = tokenizer.encode(text, add_special_tokens=False) if tokenizer is not None else []
    return [int(i) for i in ids][: MAX_POSITIONS + 1]


def first_position_agreement(trunk: Any, head: Any, ids: list[int]) -> Provenance | None:
    """Teacher-forced greedy agreement: at position t the head reads the target's hidden state
    after ``ids[:t+1]`` and the next token ``ids[t+1]``; its draft is right when it equals the
    target's argmax after ``ids[:t+2]``. None when the text is shorter than 3 tokens."""
    if len(ids) < 3:
        return None
    out = trunk(mx.array([ids]))
    hidden = out.hidden_post_norm if head.hidden_source == "post_norm" else out.hidden_pre_norm
    target = mx.argmax(out.logits[0, 1:], axis=-1)
    drafted = head(hidden[:, :-1], mx.array([ids[1:]]), head.make_cache(), step=0)
    drafts = mx.argmax(head.logits(drafted, 0)[0], axis=-1)
    agree = int(mx.sum(drafts == target).item())
    return Provenance(agree / len(ids[1:]), len(ids[1:]))


def check_drafter(trunk: Any, head: Any, tokenizer: Any, source: str) -> Provenance | None:
    """Measure ``head`` (loaded from ``source``) against ``trunk``; a one-line warning on stderr
    when it agrees less than ``WARN_BELOW``. Never refuses."""
    found = first_position_agreement(trunk, head, text_ids(tokenizer))
    if found is not None and found.suspicious:
        print(
            f"warning: {source}: the drafter's {found.describe()} is below {WARN_BELOW}: it may "
            "belong to other weights (another fine-tune); it still drafts, the output stays exact",
            file=sys.stderr,
        )
    return found


def measure_dir(model_path: Any, drafter_dir: Any) -> Provenance | None:
    """``first_position_agreement`` of the split drafter in ``drafter_dir`` on the model at
    ``model_path`` (``mtplx inspect``: loads both)."""
    from mtplx.checkpoints.load import load_model
    from mtplx.heads.split_drafter import load_split_drafter
    from mtplx.trunk.model import Trunk

    loaded = load_model(str(model_path))
    trunk = Trunk(loaded.model)
    head = load_split_drafter(drafter_dir, trunk, loaded.config)
    return first_position_agreement(trunk, head, text_ids(loaded.tokenizer))
