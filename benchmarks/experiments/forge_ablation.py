"""Recipe ablations of `mtplx forge` at equal data: every arm starts from the same head, trains the
same steps on the same batches of one forge run's shards, and is scored teacher-forced at the same
points, on the run's held-out generations and on the benchmark suite's own text.

    .venv/bin/python benchmarks/experiments/forge_ablation.py --run-dir <forge work dir>/<run> \
        --init-head models/smollm2-135m-instruct --steps 90 --eval-every 30 --lr 3e-4 \
        --out /tmp/ablation --json benchmarks/results/forge-ablation.json \
        --plot benchmarks/results/forge-ablation.png

Arms (``--arms``, in the order run):

* ``base``: the init head as it is: one decoder layer reading the trunk's last layer (what
  ``mtplx forge --init-head`` trains).
* ``layers2``: the init head plus a second decoder layer run after it in the same draft step,
  starting as the identity (``mtplx forge --head-layers 2``), so the arm starts where ``base`` does.
* ``fusion``: EAGLE-3's input: the outputs of a low, a middle and the last trunk layer, each
  RMS-normalised, fused by a learned [3H -> H] projection that starts as [0 0 I] (the last layer
  alone), so this arm also starts where ``base`` does. Benchmark-only: the decode loop hands heads
  the last layer, so the engine cannot serve such a head yet; it is built here to learn whether it
  is worth serving.

"Suite text" = each prompt of ``benchmarks/prompts/suite.jsonl`` (as ``benchmarks/acceptance.py``
sends it) plus the trunk's greedy continuation of ``--suite-tokens`` tokens, generated once and
kept in ``--out``; greedy AR text is what the engine's greedy output is, so teacher-forced
acceptance there is the first-draft acceptance of real greedy decoding, less the noise of a run.
Acceptance = 1 - TV(p_trunk, q_head) at t 0.7, argmax agreement at t 0 (as in the forge manifest).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.engine.engine import Engine
from mtplx.forge.config import DEFAULT_FORGE_CONFIG
from mtplx.forge.evaluate import evaluate_acceptance
from mtplx.forge.loss import batch_rows, frequent_ids
from mtplx.forge.prompts import read_held_out
from mtplx.forge.record import ForgeData, load_shards
from mtplx.forge.train import build_head, init_from_head, train_head
from mtplx.heads.base import build_layer_like, model_args_of
from mtplx.heads.forged import ForgedMTPHead, load_forged_head
from mtplx.io import atomic_path, atomic_write
from mtplx.trunk.model import Trunk, TrunkOutput

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask

HERE = Path(__file__).resolve().parent
SUITE = HERE.parent / "prompts" / "suite.jsonl"
ARMS = ("base", "layers2", "fusion")


# ---------------------------------------------------------------- the fusion arm


def layer_outputs(trunk: Trunk, tokens: mx.array, layer_ids: tuple[int, ...]) -> list[mx.array]:
    """Residual-stream outputs of the trunk's decoder layers ``layer_ids`` for whole sequences (no cache)."""
    h = trunk.embed(tokens)
    mask = create_attention_mask(h, None)
    found = {}
    for i, layer in enumerate(trunk.layers[: max(layer_ids) + 1]):
        h = layer(h, mask, None)
        if i in layer_ids:
            found[i] = h
    return [found[i] for i in layer_ids]


class FusedInputHead(ForgedMTPHead):
    """A forged head whose step-0 hidden input is [low, mid, last] trunk states ([.., 3H]), fused to H.

    Chained steps (depth > 1) feed back the head's own output ([.., H]), as EAGLE-3 does, so the
    fusion applies only where a trunk state is the input.
    """

    def __init__(self, layers, hidden_size: int, **kwargs):
        super().__init__(layers, hidden_size, **kwargs)
        eye = mx.eye(hidden_size, dtype=mx.float32)
        zeros = mx.zeros((hidden_size, hidden_size), dtype=mx.float32)
        self.fuse = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        self.fuse.weight = mx.concatenate([zeros, zeros, eye], axis=1)

    def __call__(self, hidden, next_tokens, cache=None, *, step=0, trunk_cache=None):
        if hidden.shape[-1] == self.fuse.weight.shape[1]:
            low, mid, last = mx.split(hidden, 3, axis=-1)
            hidden = self.fuse(
                mx.concatenate(
                    [mx.fast.rms_norm(low, None, 1e-6), mx.fast.rms_norm(mid, None, 1e-6), last], axis=-1
                )
            )
        return super().__call__(hidden, next_tokens, cache, step=step, trunk_cache=trunk_cache)


class FusionTrunk(Trunk):
    """The trunk whose ``hidden_pre_norm`` is [low, mid, last] concatenated (for evaluation)."""

    def __init__(self, model: nn.Module, fused_layers: tuple[int, int]):
        super().__init__(model)
        self.fused_layers = fused_layers

    def __call__(self, tokens: mx.array, cache: list | None = None) -> TrunkOutput:
        out = super().__call__(tokens, cache)
        low, mid = layer_outputs(self, tokens, self.fused_layers)
        return TrunkOutput(
            out.logits, mx.concatenate([low, mid, out.hidden_pre_norm], -1), out.hidden_post_norm
        )


class MemoTrunk:
    """A trunk that computes each window's outputs once: every arm and every point scores the same text,
    and the trunk's forward costs more than the head's on a CPU."""

    def __init__(self, trunk: Trunk):
        self.trunk = trunk
        self.vocab_size = trunk.vocab_size
        self.memo: dict[bytes, TrunkOutput] = {}

    def __call__(self, tokens: mx.array, cache: list | None = None) -> TrunkOutput:
        key = np.asarray(tokens).tobytes() + str(tokens.shape).encode()
        if key not in self.memo:
            out = self.trunk(tokens)
            mx.eval(out.logits, out.hidden_pre_norm, out.hidden_post_norm)
            self.memo[key] = out
        return self.memo[key]


def build_fusion_head(trunk: Trunk, init_head: str, fingerprint: str) -> FusedInputHead:
    args = model_args_of(trunk.model)
    last = len(trunk.layers) - 1
    head = FusedInputHead(
        [build_layer_like(trunk.layers[last], args, last)],
        int(args.hidden_size),
        eps=float(args.rms_norm_eps),
        trunk=trunk,
        hidden_source="pre_norm",
    )
    source = load_forged_head(init_head, trunk, fingerprint)
    head.load_weights(list(tree_flatten(source.parameters())), strict=False)
    mx.eval(head.parameters())
    return head


def fused_training_data(
    trunk: Trunk, data: ForgeData, rows: np.ndarray, fused_layers: tuple[int, int], batch: int = 8
) -> ForgeData:
    """``data`` with hidden = [low, mid, stored last] for ``rows`` (zeros elsewhere: never read)."""
    from tqdm import tqdm

    num, length, size = data.hidden.shape
    hidden = np.zeros((num, length, 3 * size), dtype=np.float16)
    hidden[..., 2 * size :] = data.hidden
    for start in tqdm(range(0, len(rows), batch), desc="fusion features"):
        chunk = rows[start : start + batch]
        low, mid = layer_outputs(trunk, mx.array(data.tokens[chunk]), fused_layers)
        hidden[chunk, :, : 2 * size] = np.asarray(mx.concatenate([low, mid], -1).astype(mx.float16))
    return replace(data, hidden=hidden)


# ---------------------------------------------------------------- suite text


def suite_text(engine: Engine, tokens: int, cache_path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Right-padded [prompt + greedy continuation] windows, the continuation mask, and each row's kind."""
    if cache_path.is_file():
        rows = json.loads(cache_path.read_text())
    else:
        rows = []
        for p in read_held_out(SUITE):
            request = [{"role": r, "content": c} for r, c in p.messages] if p.is_chat else p.text
            prompt = engine.encode_prompt(request, chat=p.is_chat)
            out = engine.generate(request, max_tokens=tokens, mtp=False, temperature=0.0, chat=p.is_chat)
            rows.append({"kind": p.kind, "prompt": prompt, "generated": out.token_ids})
        with atomic_write(cache_path) as f:
            f.write(json.dumps(rows))
    length = max(len(r["prompt"]) + len(r["generated"]) for r in rows)
    windows = np.zeros((len(rows), length), dtype=np.int32)
    scored = np.zeros((len(rows), length), dtype=bool)
    for i, r in enumerate(rows):
        seq = r["prompt"] + r["generated"]
        windows[i, : len(seq)] = seq
        scored[i, len(r["prompt"]) : len(seq)] = True
    return windows, scored, [r["kind"] for r in rows]


# ---------------------------------------------------------------- the run


def score(trunk: Trunk, head, held: ForgeData | None, suite: tuple, origins: int) -> dict:
    windows, scored, kinds = suite
    by_kind, weights = {}, {}
    for kind in sorted(set(kinds)):
        pick = np.array([k == kind for k in kinds])
        length = int(np.nonzero(scored[pick].any(0))[0].max()) + 1  # this kind's rows, less the padding
        by_kind[kind] = evaluate_acceptance(
            trunk, head, windows[pick, :length], depths=1, valid=scored[pick, :length]
        )["1"]
        weights[kind] = int(scored[pick].sum())
    total = sum(weights.values())
    suite_all = {t: sum(by_kind[k][t] * weights[k] for k in by_kind) / total for t in by_kind[kinds[0]]}
    out = {"suite_depth1": suite_all, "suite_depth1_by_kind": by_kind}
    if held is not None:  # None: the suite alone
        out["held_out"] = evaluate_acceptance(
            trunk, head, held.tokens, depths=3, origins=origins, valid=held.valid
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, help="a forge run (holds train/ and eval/)")
    ap.add_argument("--init-head", help="the forged head every arm starts from")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=90)
    ap.add_argument("--eval-every", type=int, default=30)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--fused-layers", default="2,15", help="low and middle trunk layers (0-based) of fusion")
    ap.add_argument("--suite-tokens", type=int, default=64)
    ap.add_argument("--origins", type=int, default=DEFAULT_FORGE_CONFIG.eval_origins)
    ap.add_argument("--out", type=Path, help="checkpoints and the cached suite text")
    ap.add_argument("--json", type=Path, default=Path("forge-ablation.json"))
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument(
        "--report-only", action="store_true", help="print the table (and plot) of --json; no training"
    )
    args = ap.parse_args()
    if args.report_only:
        report = json.loads(args.json.read_text())
        print(markdown_table(report))
        if args.plot:
            plot(report, args.plot)
        return
    if args.run_dir is None or args.init_head is None or args.out is None:
        raise SystemExit("--run-dir, --init-head and --out are needed to train (or pass --report-only)")
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(arms) - set(ARMS))
    if unknown:
        raise SystemExit(f"--arms: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    fused_layers = tuple(int(x) for x in args.fused_layers.split(","))
    args.out.mkdir(parents=True, exist_ok=True)

    engine = Engine.load()
    trunk, fingerprint = engine.trunk, engine.fingerprint
    data, _ = load_shards(args.run_dir / "train")
    held, _ = load_shards(args.run_dir / "eval")
    suite = suite_text(engine, args.suite_tokens, args.out / f"suite-greedy-{args.suite_tokens}.json")
    cfg = replace(DEFAULT_FORGE_CONFIG, lr=args.lr, checkpoint_every=args.eval_every, progress=True)
    train_ids = frequent_ids(data, cfg.train_vocab, trunk.vocab_size)
    tokens_per_sequence = data.num_response_tokens / max(data.num_sequences, 1)
    plain_memo = MemoTrunk(trunk)
    stops = list(range(args.eval_every, args.steps, args.eval_every)) + [args.steps]

    report = {
        "run_dir": str(args.run_dir),
        "init_head": args.init_head,
        "steps": args.steps,
        "lr": args.lr,
        "batch_size": cfg.batch_size,
        "train_sequences": data.num_sequences,
        "fused_layers": list(fused_layers),
        "suite_tokens": args.suite_tokens,
        "arms": {},
    }
    # Arms of an earlier invocation join this report only when they were trained the same way.
    previous = json.loads(args.json.read_text()) if args.json.is_file() else {}
    if all(previous.get(k) == v for k, v in report.items() if k != "arms"):
        report["arms"] = previous.get("arms", {})
    for arm in arms:
        ckpt_dir = args.out / f"ckpt-{arm}"
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # a stale run's checkpoints would be resumed
        arm_trunk, arm_data = plain_memo, data
        if arm == "fusion":
            arm_trunk = MemoTrunk(FusionTrunk(trunk.model, fused_layers))
            needed = np.unique(
                np.concatenate(
                    [batch_rows(data.num_sequences, cfg.batch_size, s, cfg.seed) for s in range(args.steps)]
                )
            )
            arm_data = fused_training_data(trunk, data, needed, fused_layers)
            head = build_fusion_head(trunk, args.init_head, fingerprint)
        else:
            head = build_head(trunk, "pre_norm", "pre_norm", 2 if arm == "layers2" else 1)
            init_from_head(head, args.init_head, trunk, fingerprint)
        points = [{"step": 0, "tokens": 0, **score(arm_trunk, head, held, suite, args.origins)}]
        seconds = 0.0
        for stop in stops:
            t0 = time.time()
            train_head(cfg, trunk, head, arm_data, train_ids, ckpt_dir, args.steps, stop_at=stop)
            seconds += time.time() - t0
            tokens = round(stop * cfg.batch_size * tokens_per_sequence)
            points.append(
                {"step": stop, "tokens": tokens, **score(arm_trunk, head, held, suite, args.origins)}
            )
            last = points[-1]
            print(
                f"{arm} step {stop}: held-out d1 {last['held_out']['1']} suite d1 {last['suite_depth1']}",
                flush=True,
            )
        report["arms"][arm] = {
            "head_parameters": sum(v.size for _, v in tree_flatten(head.parameters())),
            "train_seconds": round(seconds, 1),
            "points": points,
        }
        with atomic_write(args.json) as f:
            f.write(json.dumps(report, indent=1) + "\n")
    print(markdown_table(report))
    if args.plot:
        plot(report, args.plot)


def markdown_table(report: dict) -> str:
    """One row per arm and scored point: held-out depth 1/2/3 and suite depth 1, each at t 0 / t 0.7."""
    lines = [
        "| arm | step (tokens) | held-out d1 | held-out d2 | held-out d3 | suite d1 |",
        "|---|---|---|---|---|---|",
    ]
    for arm, entry in report["arms"].items():
        for p in entry["points"]:
            cells = [
                f"{p['held_out'][d]['0.0']:.3f} / {p['held_out'][d]['0.7']:.3f}" for d in ("1", "2", "3")
            ]
            suite = f"{p['suite_depth1']['0.0']:.3f} / {p['suite_depth1']['0.7']:.3f}"
            lines.append(
                f"| {arm} | {p['step']} ({p['tokens'] / 1e3:.0f}k) | {' | '.join(cells)} | {suite} |"
            )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=False)
    panels = (
        ("held-out generations, depth 1", lambda p, t: p["held_out"]["1"][t]),
        ("suite text, depth 1", lambda p, t: p["suite_depth1"][t]),
    )
    for ax, (title, value) in zip(axes, panels):
        for color, (arm, entry) in zip(("C0", "C1", "C2", "C3"), report["arms"].items()):
            xs = [p["tokens"] / 1e3 for p in entry["points"]]
            for t, style in (("0.0", "-o"), ("0.7", "--s")):
                ax.plot(xs, [value(p, t) for p in entry["points"]], style, color=color, label=f"{arm}, t {t}")
        ax.set_title(title)
        ax.set_xlabel("response tokens trained on (thousands)")
        ax.set_ylabel("teacher-forced acceptance")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"forge ablations from the shipped head (lr {report['lr']}, batch {report['batch_size']})")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110)


if __name__ == "__main__":
    main()
