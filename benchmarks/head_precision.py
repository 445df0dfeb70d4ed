"""Head precision: the float MTP head vs the same head with some or all of its parts quantized
(what `mtplx convert --head-bits` and its default choose between), measured on acceptance.

Default model, q4 build (4-bit trunk from the GGUF's Q4 blocks) with the head mtplx ships for it.
Two measurements per variant:
- teacher-forced, every position of the suite's prompts: the expected acceptance of d_1 under
  exact speculative sampling at temperature 1, E[sum_x min(p(x), q(x))], and at temperature 0
  the rate at which the head's argmax equals the trunk's;
- real greedy decoding at depth 3 (`Engine.generate`): acceptance per position and tokens per
  cycle (greedy output is the same for every variant, so the drafts face the same text).

With ``--groups``, one tensor group at a time (`mtplx.heads.precision.tensor_group`: projection
``fc``, attention, dense MLP; plus ``embedding``: the trunk's tied embedding / LM head as the
head reads it, quantized for the head only) at 8 and 4 bits with the rest float, every group at
8 and at 4, and conversion's default beside a 4-bit trunk (``default_bits``).

    PYTHONPATH=$PWD python benchmarks/head_precision.py [--tokens 64] [--prompts 12] [--groups]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mtplx import resources
from mtplx.checkpoints import load as loading
from mtplx.engine.engine import Engine
from mtplx.heads import forged, precision

import mlx.core as mx
import mlx.nn as nn

SUITE = Path(__file__).parent / "prompts" / "suite.jsonl"


def quantized(head: nn.Module, bits: int, group_size: int) -> nn.Module:
    """``head`` (a freshly loaded copy) with every layer mlx-lm would quantize at 4-bit quantized."""
    nn.quantize(
        head,
        group_size=group_size,
        bits=bits,
        class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0,
    )
    return head


def quantized_groups(head: nn.Module, bits: dict[str, int], group_size: int) -> nn.Module:
    """``head`` with the layers of each group in ``bits`` (``precision.tensor_group`` of the layer's
    checkpoint name) quantized at that width, the rest float; ``"embedding"`` quantizes the trunk's
    tied embedding for the head's input and output only (the trunk's own logits are unchanged)."""

    def predicate(path: str, m: nn.Module) -> bool | dict:
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
            return False
        b = bits.get(precision.tensor_group(head.checkpoint_name(path)))
        return {"group_size": group_size, "bits": b} if b else False

    nn.quantize(head, class_predicate=predicate)
    if "embedding" in bits:
        table = head._embed.__self__.inner.embed_tokens.weight  # [V, H]
        q = mx.dequantize(*mx.quantize(table, group_size, bits["embedding"]), group_size, bits["embedding"])
        head._embed = lambda tokens: q[tokens]
        head.set_draft_vocab(None if head.vocab_ids is None else head.vocab_ids.tolist(), q.T)
    return head


def group_variants(fresh) -> dict:
    """Per group at 8 and 4 bits (rest float), all at 8 / 4, and conversion's default beside a 4-bit trunk."""
    groups = ("projection", "attention", "dense", "embedding")
    out = {}
    for bits in (8, 4):
        for g in groups:
            out[f"{g}-q{bits}"] = lambda g=g, bits=bits: quantized_groups(fresh(), {g: bits}, 64)
        out[f"all-q{bits}"] = lambda bits=bits: quantized_groups(fresh(), dict.fromkeys(groups, bits), 64)
    default = {g: precision.default_bits(g, 4) for g in precision.GROUPS}
    default["embedding"] = 4  # the trunk's LM head, at the trunk's bits
    out["default@q4-trunk"] = lambda: quantized_groups(fresh(), default, 64)
    return out


def trunk_rows(engine: Engine, prompts: list[list[int]], ids: mx.array) -> list[tuple]:
    """Per prompt: the head's input hidden states, the trunk's target distribution at the draft
    vocabulary ``ids`` (q is zero elsewhere, so min(p, q) sums over them alone), the trunk's
    argmax, and the tokens. Full-vocabulary rows are not kept (memory on a shared machine)."""
    rows = []
    for tokens in prompts:
        out = engine.trunk(mx.array([tokens]))
        hidden = out.hidden_pre_norm if engine.head.hidden_source == "pre_norm" else out.hidden_post_norm
        p = mx.softmax(out.logits[0, 1:-1].astype(mx.float32), axis=-1)
        row = (hidden, p[:, ids], mx.argmax(p, axis=-1), tokens)
        mx.eval(row[:3])
        rows.append(row)
    return rows


def teacher_forced(head: nn.Module, rows: list, ids: mx.array) -> dict[str, float]:
    accept_t1 = match_t0 = n = 0.0
    for hidden, p, p_argmax, tokens in rows:
        # head position i pairs hidden i with token i+1 and predicts token i+2 = trunk row i+1
        h = head(hidden[:, :-2], mx.array([tokens[1:-1]]), head.make_cache())
        q = mx.softmax(head.logits(h).astype(mx.float32), axis=-1)[0][:, ids]
        accept_t1 += mx.sum(mx.minimum(p, q)).item()
        match_t0 += mx.sum(p_argmax == ids[mx.argmax(q, axis=-1)]).item()
        n += p.shape[0]
    return {
        "accept_t1": round(accept_t1 / n, 4),
        "argmax_match_t0": round(match_t0 / n, 4),
        "positions": int(n),
    }


def decoding(engine: Engine, prompts: list, tokens: int) -> dict[str, object]:
    drafted = accepted = cycles = committed = 0
    per_pos = [0.0, 0.0, 0.0]
    for prompt in prompts:
        stats = engine.generate(prompt, max_tokens=tokens, depth=3, mtp=True).stats
        cycles += stats.cycles
        committed += stats.tokens_per_cycle * stats.cycles
        for i, a in enumerate(stats.acceptance_per_position):
            per_pos[i] += a * stats.cycles
        drafted += 3 * stats.cycles
        accepted += sum(a * stats.cycles for a in stats.acceptance_per_position)
    return {
        "acceptance_per_position": [round(x / cycles, 4) for x in per_pos],
        "tokens_per_cycle": round(committed / cycles, 4),
        "cycles": cycles,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=48, help="tokens per greedy decoding run")
    ap.add_argument("--decode-prompts", type=int, default=4, help="prompts decoded per variant (0: none)")
    ap.add_argument(
        "--trunk",
        choices=["q4", "float32"],
        default="q4",
        help="q4 (default) or float32: the exact dequantization of the same GGUF blocks, so the same "
        "function up to rounding, and much faster on a CPU, where MLX's 4-bit matmul is slow",
    )
    ap.add_argument("--prompts", type=int, default=12, help="suite prompts scored teacher-forced")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="tokens scored per prompt (at most)")
    ap.add_argument("--groups", action="store_true", help="one tensor group at a time (teacher-forced only)")
    args = ap.parse_args()
    rows = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()][: args.prompts]
    texts = [r.get("prompt") or r["messages"] for r in rows]  # raw text, or a chat
    engine = Engine.load(None, dtype=args.trunk)
    print("loaded", flush=True)
    float_head = engine.head
    ids = float_head.vocab_ids if float_head.vocab_ids is not None else mx.arange(engine.trunk.vocab_size)
    targets = trunk_rows(engine, [engine.encode_prompt(t)[: args.prompt_tokens] for t in texts], ids)
    print("trunk rows", flush=True)
    head_dir = resources.shipped_head_dir(loading.DEFAULT_MODEL_NAME)
    fingerprint = loading.load_model(None, variant="float32", lazy=True).fingerprint

    def fresh() -> nn.Module:  # each variant quantizes its own copy of the shipped float head
        return forged.load_forged_head(head_dir, engine.trunk, fingerprint)

    variants = {
        "float": lambda: float_head,
        "q4-g64": lambda: quantized(fresh(), 4, 64),
        "q4-g32": lambda: quantized(fresh(), 4, 32),
    }
    if args.groups:
        variants = {"float": lambda: float_head, **group_variants(fresh)}
    for name, make in variants.items():
        engine.head = head = make()
        print(name, "teacher-forced", json.dumps(teacher_forced(head, targets, ids)), flush=True)
        if args.decode_prompts and name in ("float", "q4-g64"):
            chosen = texts[:: max(1, len(texts) // args.decode_prompts)]
            print(name, "greedy d=3", json.dumps(decoding(engine, chosen, args.tokens)), flush=True)


if __name__ == "__main__":
    main()
