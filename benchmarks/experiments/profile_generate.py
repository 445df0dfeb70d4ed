"""Where does an MTP generation's time go? Phase breakdown, isolated kernels, and cProfile.

    .venv/bin/python benchmarks/experiments/profile_generate.py --depth 3 --tokens 128 --temp 0

Three views of the same generation settings (default model unless --model):

1. Phases: the engine runs with an evaluation barrier after every phase (head
   layer, head LM head, draft sampling, verify forward, verify math, cache
   rollback), so each phase's compute is charged to it; what is left of the
   decode time is Python/bookkeeping. Barriers cost some overlap, so the
   barrier run is a little slower than a plain one (both are printed).
2. Isolated costs: one trunk forward of 1 and of k+1 tokens on a warm cache,
   one head step, one LM-head projection, timed alone (median of N): the
   ideal cycle cost is forward(k+1) + k * (head step + LM head) + sampling.
3. cProfile of a plain (barrier-free) generation, top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import mtplx  # noqa: F401  (optimized BLAS before mlx)
from mtplx.bench.runners import ban_bias
from mtplx.bench.suite import load_prompts
from mtplx.sample import ops as sample_ops
from mtplx.sample import rejection
from mtplx.trunk import rollback as cache_ops

import mlx.core as mx

PHASES = ("head layer", "head lm_head", "draft sample", "verify forward", "verify math", "rollback")


class Phases:
    """Per-phase seconds; counts only while ``active`` (after the first token: prefill is not decode)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.active = False

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            mx.eval(_arrays(out))
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1
            return out

        return wrapper


def _arrays(out) -> list:
    """The arrays in a call's result (array, tuple, dataclass-like result, TrunkOutput, caches)."""
    if isinstance(out, mx.array):
        return [out]
    if isinstance(out, (list, tuple)):
        return [a for item in out for a in _arrays(item)]
    if hasattr(out, "__dict__"):
        return [a for v in vars(out).values() for a in _arrays(v)]
    return []


class _HeadProxy:
    def __init__(self, head, phases: Phases):
        self._head = head
        self._call = phases.timed("head layer", head.__call__)
        self.logits = phases.timed("head lm_head", head.logits)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._head, name)


class _TrunkProxy:
    def __init__(self, trunk, phases: Phases):
        self._trunk = trunk
        self._call = phases.timed("verify forward", trunk.__call__)

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._trunk, name)


@contextmanager
def instrumented(engine, phases: Phases):
    """Swap in timing proxies for the engine's head/trunk and the verify/cache functions."""
    saved = (
        engine.head,
        engine.trunk,
        sample_ops.sample,
        rejection.verify,
        cache_ops.commit_block,
        cache_ops.trim_kv,
    )
    engine.head = _HeadProxy(engine.head, phases)
    engine.trunk = _TrunkProxy(engine.trunk, phases)
    sample_ops.sample = phases.timed("draft sample", saved[2])
    rejection.verify = phases.timed("verify math", saved[3])

    def commit(trunk_cache, *args, **kwargs):
        out = saved[4](trunk_cache, *args, **kwargs)
        mx.eval([c.state for c in trunk_cache])
        return out

    def trim(head_cache, *args, **kwargs):
        out = saved[5](head_cache, *args, **kwargs)
        mx.eval([c.state for c in head_cache])
        return out

    cache_ops.commit_block = phases.timed("rollback", commit)
    cache_ops.trim_kv = phases.timed("rollback", trim)
    try:
        yield
    finally:
        (
            engine.head,
            engine.trunk,
            sample_ops.sample,
            rejection.verify,
            cache_ops.commit_block,
            cache_ops.trim_kv,
        ) = saved


def _median_time(fn, repeats: int) -> float:
    mx.eval(_arrays(fn()))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(_arrays(fn()))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def isolated_costs(engine, depth: int, context: int, repeats: int) -> dict[str, float]:
    """Seconds for one forward of 1 / k+1 tokens at ``context`` cached tokens, one head step, one LM head."""
    trunk, head = engine.trunk, engine.head
    tokens = mx.array([[min(100 + i, trunk.vocab_size - 1) for i in range(context)]], dtype=mx.int32)

    def warm_cache():
        cache = trunk.make_cache()
        out = trunk(tokens, cache)
        mx.eval(out.logits, [c.state for c in cache])
        return cache, out

    cache, out = warm_cache()

    def forward(n):
        def run():
            result = trunk(tokens[:, :n], cache)
            for c in cache:  # undo, so every repeat sees the same context length
                c.offset -= n
            return result.logits

        return run

    hidden = (out.hidden_pre_norm if head.hidden_source == "pre_norm" else out.hidden_post_norm)[:, -1:]
    head_cache = head.make_cache()
    mx.eval(head(hidden, tokens[:, -1:], head_cache))

    def head_step():
        result = head(hidden, tokens[:, -1:], head_cache)
        for c in head_cache:
            c.offset -= 1
        return result

    head_out = head(hidden, tokens[:, -1:])
    mx.eval(head_out)
    uniforms = sample_ops.draw_uniforms((1,), mx.random.key(0))
    logits = head.logits(head_out)[:, -1, :]
    mx.eval(logits)
    return {
        "trunk forward, 1 token (AR step)": _median_time(forward(1), repeats),
        f"trunk forward, {depth + 1} tokens (verify)": _median_time(forward(depth + 1), repeats),
        "head layer step": _median_time(head_step, repeats),
        "LM head (1 row)": _median_time(lambda: head.logits(head_out), repeats),
        "sample greedy (1 row)": _median_time(
            lambda: sample_ops.sample(logits, bench_cfg(0.0), uniforms).tokens, repeats
        ),
        "sample t0.7/p0.95 (1 row)": _median_time(
            lambda: sample_ops.sample(logits, bench_cfg(0.7, 0.95), uniforms).tokens, repeats
        ),
    }


def bench_cfg(temp: float, top_p: float = 1.0):
    from mtplx.sample.params import SamplerConfig

    return SamplerConfig(temperature=temp, top_p=top_p)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--head", default=None)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--temp", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--prompt-id", default="code-json-decoder", help="prompt from the shipped suite")
    parser.add_argument("--repeats", type=int, default=20, help="repeats for the isolated timings")
    parser.add_argument("--no-ban-eos", action="store_true")
    parser.add_argument("--cprofile", type=int, default=25, help="cProfile rows to print (0 = skip)")
    parser.add_argument(
        "--untrained-head",
        action="store_true",
        help="attach forge's untrained initial head: costs are real, acceptance is not",
    )
    args = parser.parse_args(argv)

    from mtplx.engine.engine import Engine

    engine = Engine.load(args.model, head=args.head, depth=args.depth)
    if args.untrained_head:
        from mtplx.forge.train import build_head

        engine.head = build_head(engine.trunk, "post_norm")
    if engine.head is None:
        print(
            "this model has no MTP head (pass --head DIR, or --untrained-head for costs only)",
            file=sys.stderr,
        )
        return 2
    prompt = next(p for p in load_prompts() if p.id == args.prompt_id)
    top_p = args.top_p if args.temp > 0 else 1.0
    kwargs = dict(
        chat=prompt.is_chat,
        max_tokens=args.tokens,
        temperature=args.temp,
        top_p=top_p,
        seed=1,
        logit_bias=None if args.no_ban_eos else ban_bias(engine.tokenizer),
    )

    def generate(mtp: bool = True, phases: Phases | None = None):
        stats = None
        for chunk in engine.stream(prompt.engine_input, mtp=mtp, depth=args.depth if mtp else None, **kwargs):
            stats = chunk.stats
            if phases is not None:
                phases.active = True  # from the first token on: decode only
        return stats

    generate()  # warm-up
    ar = generate(mtp=False)
    plain = generate()
    phases = Phases()
    with instrumented(engine, phases):
        barrier = generate(phases=phases)
    print(
        f"# {engine.model_path} depth {args.depth}, {args.tokens} tokens, temp {args.temp}"
        f"{f' top-p {top_p}' if top_p < 1 else ''}, prompt {prompt.id}, EOS {'allowed' if args.no_ban_eos else 'banned'}"
    )
    print(
        f"mtplx AR: {ar.decode_tokens_per_sec:.2f} tok/s ({1000 / max(ar.decode_tokens_per_sec, 1e-9):.1f} ms/token)"
    )
    print(
        f"MTP plain: {plain.decode_tokens_per_sec:.2f} tok/s, {plain.cycles} cycles, tau {plain.tokens_per_cycle:.2f}, "
        f"acceptance {[round(a, 2) for a in plain.acceptance_per_position]}"
    )
    print(
        f"MTP with barriers: {barrier.decode_tokens_per_sec:.2f} tok/s, {barrier.cycles} cycles, decode {barrier.decode_seconds:.2f} s"
    )
    cycles = max(barrier.cycles, 1)
    total = barrier.decode_seconds
    print("\n| phase | ms per cycle | share of decode | calls per cycle |\n|---|---|---|---|")
    accounted = 0.0
    for name in PHASES:
        seconds = phases.seconds.get(name, 0.0)
        accounted += seconds
        print(
            f"| {name} | {1000 * seconds / cycles:.2f} | {seconds / total:.1%} | {phases.calls.get(name, 0) / cycles:.1f} |"
        )
    rest = total - accounted
    print(f"| Python + bookkeeping (rest) | {1000 * rest / cycles:.2f} | {rest / total:.1%} | |")
    print(f"| total | {1000 * total / cycles:.2f} | 100% | |")

    context = len(engine.encode_prompt(prompt.engine_input, chat=prompt.is_chat)) + args.tokens // 2
    costs = isolated_costs(engine, args.depth, context, args.repeats)
    print(f"\n| isolated, context {context} tokens | ms |\n|---|---|")
    for name, seconds in costs.items():
        print(f"| {name} | {1000 * seconds:.2f} |")
    sample_key = "sample greedy (1 row)" if args.temp == 0 else "sample t0.7/p0.95 (1 row)"
    ideal = costs[f"trunk forward, {args.depth + 1} tokens (verify)"] + args.depth * (
        costs["head layer step"] + costs["LM head (1 row)"] + costs[sample_key]
    )
    print(f"| ideal cycle = verify + {args.depth} x (head + LM head + sample) | {1000 * ideal:.2f} |")
    print(
        f"| ideal speed-up over AR step at tau {plain.tokens_per_cycle:.2f} | "
        f"{plain.tokens_per_cycle * costs['trunk forward, 1 token (AR step)'] / ideal:.2f}x |"
    )

    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.enable()
        generate()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.cprofile)
        print("\ncProfile (plain MTP generation, by own time):")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
