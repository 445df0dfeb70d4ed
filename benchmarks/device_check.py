"""GPU half of benchmarks/device_check.sh (on a Mac: run it directly): the fused verify vs the
NumPy mirror on the device, then fused vs MLX-ops verify timings. Prints markdown."""

import os
import sys
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(__file__), "..", "tests", "sample")
)  # the kernel tests it reuses
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # support/

import mtplx  # noqa: F401  (before mlx)
from mtplx.sample import emulation as E
from mtplx.sample import kernels as K
from mtplx.sample import ops as sample_ops
from mtplx.sample import rejection
from mtplx.sample.params import SamplerConfig

import mlx.core as mx
import numpy as np
import test_kernels as T
from support import kernel_ref as ref


def cfg_of(row):
    t, top_p, min_p, top_k = (float(x) for x in row)
    return SamplerConfig(temperature=t, top_p=top_p, top_k=int(top_k), min_p=min_p)


def fused_verify(tg: int = K.DEFAULT_TG):
    """This GPU's fused verify in threadgroups of ``tg`` threads, whether or not ``auto`` uses it."""
    backend = K._gpu_backend()
    assert backend is not None, "no GPU backend"
    return K.build_fused(backend, "verify", tg=tg)


def correctness(tg: int = K.DEFAULT_TG):
    fused_v = fused_verify(tg)
    checked = skipped = 0
    for seed, (B, k, Vv, kinds, draft, _tg, ties, masked) in enumerate(T.VERIFY_SHAPES):
        for kind in sorted(set(kinds)):  # the fused path takes one cfg for the batch
            rng = np.random.default_rng(3000 + seed)
            z, d, q, params, a, s = T.make_verify_case(rng, B, k, Vv, [kind], draft, ties, masked)
            cfg = cfg_of(params[0])
            num_accepted, next_token, _ = fused_v(
                mx.array(z), mx.array(d), None if q is None else mx.array(q), cfg, mx.array(a), mx.array(s)
            )
            n, tok = np.array(num_accepted), np.array(next_token)
            rn, rtok, _ = E.numpy_mirror_verify(z, d, q, params, a, s)
            for b in range(B):
                amb = ref.verify_row(z[b], d[b], None if q is None else q[b], params[b], a[b], s[b])[3]
                if amb:
                    skipped += 1
                    continue
                assert (n[b], tok[b]) == (rn[b], rtok[b]), (seed, kind, b, n[b], tok[b], rn[b], rtok[b])
                checked += 1
    print(f"verify on device, TG {tg}: {checked} rows equal to the oracle, {skipped} boundary rows skipped")


def bench(fn, reps=20):
    for _ in range(3):
        mx.eval(*fn())
    t = time.perf_counter()
    for _ in range(reps):
        mx.eval(*fn())
    return (time.perf_counter() - t) / reps * 1e3


def timings():
    vocab = 151936
    fused = fused_verify()
    print("\n| B | k | MLX-ops verify ms | fused verify ms | speedup |")
    print("|---|---|---|---|---|")
    cfg = SamplerConfig(temperature=0.7, top_p=0.9)
    for B in range(1, 9):
        for k in range(1, 9):
            z = mx.random.normal((B, k + 1, vocab)) * 3
            q = mx.softmax(mx.random.normal((B, k, vocab)) * 3, axis=-1)
            d = mx.argmax(q, axis=-1).astype(mx.int32)
            a, s = sample_ops.draw_uniforms((B, k)), sample_ops.draw_uniforms((B,))
            mx.eval(z, q, d, a, s)
            ops = bench(lambda z=z, d=d, q=q, a=a, s=s: rejection.verify(z, d, q, cfg, a, s, backend="mlx"))
            fu = bench(lambda z=z, d=d, q=q, a=a, s=s: fused(z, d, q, cfg, a, s))
            print(f"| {B} | {k} | {ops:.3f} | {fu:.3f} | {ops / fu:.2f}x |", flush=True)


def breakdown():
    """Where the fused time goes: sampler settings (the top-k/top-p threshold searches are up
    to 8 passes over V per position) against threadgroup size, beside the MLX-ops path."""
    vocab = 151936
    settings = {
        "greedy": SamplerConfig(temperature=0.0),
        "t0.7": SamplerConfig(temperature=0.7),
        "t0.7 top-p 0.9": SamplerConfig(temperature=0.7, top_p=0.9),
        "t0.7 top-k 50": SamplerConfig(temperature=0.7, top_k=50),
    }
    kernels = {tg: fused_verify(tg) for tg in (256, 512)}
    print("\n| sampler | B | k | MLX-ops ms | fused TG 256 ms | fused TG 512 ms |")
    print("|---|---|---|---|---|---|")
    for name, cfg in settings.items():
        for B in (1, 8):
            for k in (1, 4):
                z = mx.random.normal((B, k + 1, vocab)) * 3
                q = mx.softmax(mx.random.normal((B, k, vocab)) * 3, axis=-1)
                d = mx.argmax(q, axis=-1).astype(mx.int32)
                a, s = sample_ops.draw_uniforms((B, k)), sample_ops.draw_uniforms((B,))
                mx.eval(z, q, d, a, s)
                args = (z, d, q, cfg, a, s)
                ops = bench(lambda args=args: rejection.verify(*args, backend="mlx"))
                fused = [bench(lambda f=f, args=args: f(*args)) for f in kernels.values()]
                print(f"| {name} | {B} | {k} | {ops:.3f} | {fused[0]:.3f} | {fused[1]:.3f} |", flush=True)


def main() -> None:
    print(f"mlx {mx.__version__}, device {mx.default_device()}")
    correctness()
    correctness(tg=512)
    breakdown()
    timings()


if __name__ == "__main__":
    main()
