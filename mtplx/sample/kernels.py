"""Fused verify/sample kernels: source location and GPU dispatch.

One kernel body per kernel (``kernels/verify.body``, ``kernels/sample.body``)
plus ``kernels/common.h`` is shared by three preludes: Metal
(``mx.fast.metal_kernel``), CUDA (``mx.fast.cuda_kernel``) and a CPU
emulation used only by the tests, which lives in ``mtplx.sample.emulation``
(g++, real threads, ctypes) so the runtime never imports it. Semantics are
those of ``docs/sampling.md``; the NumPy mirrors live in ``mtplx.sample.reference``.

``get_fused(name)`` is what ``mtplx.sample.rejection`` calls: on a GPU it returns
a callable taking ``verify.verify`` / ``verify.sample``'s array arguments
(already validated by ``mtplx.sample.rejection``) and returning the raw output arrays,
``(num_accepted, next_token, accept_probs)`` or ``(tokens, probs)`` (verify for k >= 1:
``rejection.verify`` sends k = 0, a plain AR step, to ``sample``); ``None``
on the CPU backend, on a backend where the fused kernels were measured slower than the
MLX-ops path (``FUSED_BY_DEFAULT``), when forced off, or when the build fails (one warning,
never an exception). ``build_fused`` builds one for a named backend regardless (the device
check uses it). From ``mtplx`` it imports only `mtplx.resources` (where the sources are).
"""

from __future__ import annotations

import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from mtplx.resources import kernel_dir

import numpy as np

__all__ = [
    "KernelSpec",
    "SPECS",
    "kernel_dir",
    "metal_sources",
    "cuda_sources",
    "get_fused",
    "build_fused",
    "FUSED_BY_DEFAULT",
    "set_force_fallback",
    "force_fallback",
    "row_params",
    "DEFAULT_TG",
]

# Threads per threadgroup on a GPU. Metal's limit is 1024 and register use of
# the 16-accumulator search makes 256 the safe choice on both backends.
DEFAULT_TG = 256

# Whether ``get_fused`` (the ``backend="auto"`` dispatch) uses the fused kernels on each GPU
# backend: only where they are not measured slower than the MLX-ops path. CUDA, measured on
# an H200 (benchmarks/RESULTS.md, "The fused kernels on a GPU"): 0.2-1.1x of the ops path at
# B 1-8, k 1-8, because one threadgroup per row walks the k+1 positions one after another
# (each filter search up to 8 passes over V), so a few rows leave most of the GPU idle.
# Metal: not measured (no Mac here); on by design until a Mac run of
# benchmarks/device_check.py says otherwise.
FUSED_BY_DEFAULT = {"metal": True, "cuda": False}


# --------------------------------------------------------------------------- sources


def _read(name: str) -> str:
    return (kernel_dir() / name).read_text()


@dataclass(frozen=True)
class KernelSpec:
    name: str
    body: str
    inputs: tuple[tuple[str, str], ...]  # (name, "f32" | "i32")
    outputs: tuple[tuple[str, str], ...]


SPECS = {
    "verify": KernelSpec(
        "verify",
        "verify.body",
        (
            ("target_logits", "f32"),
            ("draft_tokens", "i32"),
            ("draft_probs", "f32"),
            ("params", "f32"),
            ("accept_u", "f32"),
            ("sample_u", "f32"),
            ("dims", "i32"),
        ),
        (("num_accepted", "i32"), ("next_token", "i32"), ("accept_probs", "f32")),
    ),
    "sample": KernelSpec(
        "sample",
        "sample.body",
        (("logits", "f32"), ("params", "f32"), ("uniforms", "f32"), ("dims", "i32")),
        (("tokens", "i32"), ("probs", "f32")),
    ),
}

_ENTRY = re.compile(r"^//\s*MTPLX-ENTRY:\s*(.*)$", re.MULTILINE)


def _prelude(backend: str) -> tuple[str, str]:
    """(header text, entry line) for a backend prelude. The entry line is
    prepended to the kernel source because mlx only declares Metal
    thread-position attributes for names it finds in ``source``."""
    text = _read(f"prelude_{backend}.h")
    m = _ENTRY.search(text)
    return text, (m.group(1).strip() if m else "")


def _gpu_sources(backend: str, name: str) -> tuple[str, str]:
    spec = SPECS[name]
    header, entry = _prelude(backend)
    header = header + "\n" + _read("common.h")
    source = entry + "\n" + _read(spec.body)
    return header, source


def metal_sources(name: str) -> tuple[str, str]:
    """(header, source) handed to ``mx.fast.metal_kernel``."""
    return _gpu_sources("metal", name)


def cuda_sources(name: str) -> tuple[str, str]:
    """(header, source) handed to ``mx.fast.cuda_kernel``."""
    return _gpu_sources("cuda", name)


# --------------------------------------------------------------------------- dispatch

_force = False
_lock = threading.Lock()
_built: dict[tuple[str, str], Callable | None] = {}
_warned: set[str] = set()


def set_force_fallback(flag: bool) -> None:
    """Force ``get_fused`` to return None (the MLX-ops path) process-wide."""
    global _force
    _force = bool(flag)


def force_fallback() -> bool:
    return _force


def _gpu_backend() -> str | None:
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            return "metal"
    except Exception:
        pass
    try:
        if mx.cuda.is_available():
            return "cuda"
    except Exception:
        pass
    return None


def get_fused(name: str, *, force_fallback: bool | None = None) -> Callable | None:
    """The fused ``verify`` or ``sample`` for this machine, or None.

    None on the CPU backend, when fallback is forced (argument, or
    ``set_force_fallback``), or when the kernel fails to build (warned once)."""
    if name not in SPECS:
        raise ValueError(f"unknown fused kernel {name!r}; expected one of {sorted(SPECS)}")
    forced = _force if force_fallback is None else force_fallback
    if forced:
        return None
    backend = _gpu_backend()
    if backend is None or not FUSED_BY_DEFAULT.get(backend, False):
        return None
    key = (backend, name)
    with _lock:
        if key not in _built:
            try:
                _built[key] = build_fused(backend, name)
            except Exception as e:  # any build failure means: use the MLX-ops path
                _built[key] = None
                if key not in _warned:
                    _warned.add(key)
                    warnings.warn(
                        f"mtplx: fused {name} kernel unavailable on {backend} "
                        f"({type(e).__name__}: {e}); using the MLX-ops path",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        return _built[key]


def build_fused(backend: str, name: str, tg: int = DEFAULT_TG) -> Callable:
    """The fused ``name`` kernel for ``backend`` ("metal" or "cuda") in threadgroups of ``tg``
    threads, wrapped like ``get_fused``'s; raises where that backend is absent or the build fails.

    A ``tg`` whose threadgroup needs more registers than the GPU has fails to launch; MLX's
    CUDA backend then returns the untouched (zero) outputs rather than raising (seen at 1024 on
    an H200), so a new ``tg`` is checked against the oracle before it is timed."""
    if name not in SPECS:
        raise ValueError(f"unknown fused kernel {name!r}; expected one of {sorted(SPECS)}")
    return _VERIFY_WRAPPERS[name](_make_kernel(backend, name), tg=tg)


def _make_kernel(backend: str, name: str):
    import mlx.core as mx

    spec = SPECS[name]
    ins = [n for n, _ in spec.inputs]
    outs = [n for n, _ in spec.outputs]
    if backend == "metal":
        header, source = metal_sources(name)
        # math_mode left at its "safe" default: fast math breaks exp(-inf).
        return mx.fast.metal_kernel(
            name=f"mtplx_{name}", input_names=ins, output_names=outs, source=source, header=header
        )
    header, source = cuda_sources(name)
    # Constructed only here (lazily): cuda_kernel raises on machines without CUDA.
    return mx.fast.cuda_kernel(
        name=f"mtplx_{name}", input_names=ins, output_names=outs, source=source, header=header
    )


def row_params(cfg, batch: int) -> np.ndarray:
    """Per-row sampler parameters [B, 4] float32: temperature, top_p, min_p,
    top_k (top_k as a float is exact below 2**24)."""
    row = [
        float(cfg.temperature),
        float(cfg.top_p),
        float(getattr(cfg, "min_p", 0.0)),
        float(int(getattr(cfg, "top_k", 0) or 0)),
    ]
    return np.tile(np.asarray(row, dtype=np.float32), (batch, 1))


def _launch(kernel, inputs, out_shapes, out_dtypes, batch, tg):
    return kernel(
        inputs=inputs,
        template=[("TG", tg)],
        # Both backends count the grid in threads: one group of TG per row.
        grid=(batch * tg, 1, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=out_shapes,
        output_dtypes=out_dtypes,
    )


def _wrap_verify(kernel, tg: int = DEFAULT_TG):
    import mlx.core as mx

    def verify(target_logits, draft_tokens, draft_probs, cfg, accept_uniforms, sample_uniforms):
        # Inputs arrive validated (shapes) by mtplx.sample.rejection, which also computes the
        # lazy validity flag; the kernel only does the math.
        B, k1, V = target_logits.shape
        k = k1 - 1
        if k == 0:  # zero-size buffers; rejection.verify sends k = 0 to the sample kernel instead
            raise ValueError("the fused verify kernel takes k >= 1 drafts; k = 0 is ops.sample")
        has_q = draft_probs is not None
        q = draft_probs.astype(mx.float32) if has_q else mx.zeros((1,), mx.float32)
        params = mx.array(row_params(cfg, B))
        dims = mx.array([B, k, V, 1 if has_q else 0], dtype=mx.int32)
        num_accepted, next_token, accept_probs = _launch(
            kernel,
            [
                target_logits.astype(mx.float32),
                draft_tokens.astype(mx.int32),
                q,
                params,
                accept_uniforms.astype(mx.float32),
                sample_uniforms.astype(mx.float32),
                dims,
            ],
            [(B,), (B,), (B, k)],
            [mx.int32, mx.int32, mx.float32],
            B,
            tg,
        )
        return num_accepted, next_token, accept_probs

    return verify


def _wrap_sample(kernel, tg: int = DEFAULT_TG):
    import mlx.core as mx

    def sample(logits, cfg, uniforms):
        B, V = logits.shape
        tokens, probs = _launch(
            kernel,
            [
                logits.astype(mx.float32),
                mx.array(row_params(cfg, B)),
                uniforms.astype(mx.float32),
                mx.array([B, V], dtype=mx.int32),
            ],
            [(B,), (B, V)],
            [mx.int32, mx.float32],
            B,
            tg,
        )
        return tokens, probs

    return sample


_VERIFY_WRAPPERS = {"verify": _wrap_verify, "sample": _wrap_sample}
