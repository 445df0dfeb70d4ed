"""Fused verify/sample kernels: source location, builders, CPU emulation.

One kernel body per kernel (``kernels/verify.body``, ``kernels/sample.body``)
plus ``kernels/common.h`` is shared by three preludes: Metal
(``mx.fast.metal_kernel``), CUDA (``mx.fast.cuda_kernel``) and a CPU
emulation used only by the tests (g++, real threads, ctypes). Semantics are
those of ``docs/sampling.md``; the NumPy mirrors live in ``mtplx.sampling``.

``get_fused(name)`` is what ``mtplx.verify`` calls: it returns a callable with
exactly ``verify.verify`` / ``verify.sample``'s signature on Metal or CUDA and
``None`` on the CPU backend, when forced off, or when the build fails (one
warning, never an exception).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "KernelSpec",
    "SPECS",
    "kernel_dir",
    "metal_sources",
    "cuda_sources",
    "cuda_translation_unit",
    "get_fused",
    "set_force_fallback",
    "force_fallback",
    "row_params",
    "cpu_source",
    "cpu_library",
    "cpu_executable",
    "emulate",
    "emulate_verify",
    "emulate_sample",
    "numpy_mirror_verify",
    "numpy_mirror_sample",
    "DEFAULT_TG",
]

# Threads per threadgroup on a GPU. Metal's limit is 1024 and register use of
# the 16-accumulator search makes 256 the safe choice on both backends.
DEFAULT_TG = 256
CPU_TGS = (32, 64, 128, 256)  # instantiated in the emulation library


# --------------------------------------------------------------------------- sources


def kernel_dir() -> Path:
    """Directory holding the kernel sources: the wheel's ``mtplx/_kernels``
    (pyproject force-includes ``kernels`` there) or a checkout's ``kernels``."""
    here = Path(__file__).resolve().parent
    for cand in (here / "_kernels", here.parent / "kernels"):
        if (cand / "verify.body").is_file():
            return cand
    raise FileNotFoundError(f"mtplx kernel sources not found next to {here}")


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


_CUDA_TYPES = {"f32": "float", "i32": "int32_t"}
_CPU_TYPES = {"f32": "float", "i32": "int32_t"}
_NP_TYPES = {"f32": np.float32, "i32": np.int32}


def cuda_translation_unit(name: str, tg: int = DEFAULT_TG, prefix: str = "") -> str:
    """The CUDA program as mlx 0.32's cuda_kernel assembles it (its default
    header, our header, a ``__global__`` function in ``mlx::core::cu`` with
    ``const T*`` inputs, ``T*`` outputs, template arguments as constexpr
    locals, then our source). ``prefix`` replaces mlx's default header for
    compile checks made without mlx's device headers."""
    spec = SPECS[name]
    header, source = cuda_sources(name)
    params = [f"    const {_CUDA_TYPES[t]}* {n}" for n, t in spec.inputs]
    params += [f"    {_CUDA_TYPES[t]}* {n}" for n, t in spec.outputs]
    return (
        prefix
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void custom_kernel_mtplx_{name}_{tg}(\n"
        + ",\n".join(params)
        + ") {\n"
        + f"  constexpr int TG = {tg};\n\n"
        + source
        + "\n}\n\n} // namespace mlx::core::cu\n"
    )


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
    if backend is None:
        return None
    key = (backend, name)
    with _lock:
        if key not in _built:
            try:
                kernel = _make_kernel(backend, name)
                _built[key] = _VERIFY_WRAPPERS[name](kernel, backend)
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


def _result_types():
    # Imported lazily: mtplx.verify imports this module.
    from mtplx import verify as _v

    return _v.VerifyResult, _v.SampleResult


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


def _wrap_verify(kernel, backend, tg: int = DEFAULT_TG):
    import mlx.core as mx

    def verify(target_logits, draft_tokens, draft_probs, cfg, accept_uniforms, sample_uniforms):
        from mtplx import verify as _v

        VerifyResult, _ = _result_types()
        # Same errors as the MLX-ops path, which this replaces before its checks
        # run: shapes, then NaN/+inf/all -inf rows and out-of-range drafts. The
        # value check costs one reduction and a sync, exactly as on that path.
        _v._check_verify_shapes(target_logits, draft_tokens, draft_probs, accept_uniforms, sample_uniforms)
        B, k1, V = target_logits.shape
        d = draft_tokens.astype(mx.int32)
        _v._row_max_checked(target_logits.reshape(-1, V), mx.any((d < 0) | (d >= V)))
        k = k1 - 1
        has_q = draft_probs is not None
        q = draft_probs.astype(mx.float32) if has_q else mx.zeros((1,), mx.float32)
        params = mx.array(row_params(cfg, B))
        dims = mx.array([B, k, V, 1 if has_q else 0], dtype=mx.int32)
        n, tok, ap = _launch(
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
        return VerifyResult(num_accepted=n, next_token=tok, accept_probs=ap)

    return verify


def _wrap_sample(kernel, backend, tg: int = DEFAULT_TG):
    import mlx.core as mx

    def sample(logits, cfg, uniforms):
        from mtplx import verify as _v

        _, SampleResult = _result_types()
        if logits.ndim != 2:
            raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
        if uniforms.shape != (logits.shape[0],):
            raise ValueError(f"uniforms must have shape ({logits.shape[0]},), got {uniforms.shape}")
        _v._row_max_checked(logits)
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
        return SampleResult(tokens=tokens, probs=probs)

    return sample


_VERIFY_WRAPPERS = {"verify": _wrap_verify, "sample": _wrap_sample}


# --------------------------------------------------------------------------- CPU emulation


def cpu_source(defines: Sequence[str] = ()) -> str:
    """One C++ translation unit holding every kernel on the CPU prelude, a
    ctypes entry point per kernel and (under MTPLX_STANDALONE) a ``main`` for
    the sanitizer build, which cannot be loaded into Python."""
    parts = [f"#define {d}\n" for d in defines]
    parts.append('#line 1 "prelude_cpu.h"\n' + _read("prelude_cpu.h"))
    parts.append('#line 1 "common.h"\n' + _read("common.h"))
    mains = []
    for spec in SPECS.values():
        bufs = list(spec.inputs) + list(spec.outputs)
        params = [f"const {_CPU_TYPES[t]}* {n}" for n, t in spec.inputs]
        params += [f"{_CPU_TYPES[t]}* {n}" for n, t in spec.outputs]
        args = ", ".join(
            f"({'const ' if i < len(spec.inputs) else ''}{_CPU_TYPES[t]}*)bufs[{i}]"
            for i, (_, t) in enumerate(bufs)
        )
        parts.append(
            f"template <int TG>\nstatic void mtplx_kernel_{spec.name}("
            + ", ".join(params)
            + ", const uint mtplx_lid, const uint mtplx_grp) {\n"
            + f'#line 1 "{spec.body}"\n'
            + _read(spec.body)
            + "\n}\n"
        )
        cases = "\n".join(
            f"    case {t}: return mtplx_cpu::launch(groups, {t}, [&](unsigned l, unsigned g) "
            f"{{ mtplx_kernel_{spec.name}<{t}>({args}, l, g); }}, err, errlen);"
            for t in CPU_TGS
        )
        parts.append(
            f'extern "C" int mtplx_run_{spec.name}(unsigned tg, unsigned groups, void** bufs, '
            f"char* err, int errlen) {{\n  switch (tg) {{\n{cases}\n  }}\n"
            f'  std::snprintf(err, errlen, "unsupported threadgroup size %u", tg);\n  return 2;\n}}\n'
        )
        mains.append(
            f'  if (name == "{spec.name}") {{ if (nb != {len(bufs)}) return 3; '
            f"rc = mtplx_run_{spec.name}(tg, groups, bufs.data(), err, sizeof err); }}"
        )
    parts.append(
        "#ifdef MTPLX_STANDALONE\n#include <fstream>\n#include <iterator>\n"
        "// usage: prog KERNEL TG GROUPS BUFFER_FILE... (inputs then outputs, raw bytes;\n"
        "// output files are pre-sized and rewritten in place)\n"
        "int main(int argc, char** argv) {\n"
        "  if (argc < 4) return 3;\n"
        "  std::string name = argv[1];\n"
        "  unsigned tg = (unsigned)std::stoul(argv[2]), groups = (unsigned)std::stoul(argv[3]);\n"
        "  int nb = argc - 4;\n"
        "  std::vector<std::vector<char>> data(nb);\n"
        "  std::vector<void*> bufs(nb);\n"
        "  for (int i = 0; i < nb; ++i) {\n"
        "    std::ifstream f(argv[4 + i], std::ios::binary);\n"
        "    data[i].assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());\n"
        "    data[i].resize(data[i].size() + 8);\n"
        "    bufs[i] = data[i].data();\n"
        "  }\n"
        "  char err[512] = {0};\n  int rc = 4;\n"
        + "\n".join(mains)
        + '\n  if (rc != 0) { std::fprintf(stderr, "mtplx kernel error: %s\\n", err); return 10 + rc; }\n'
        "  for (int i = 0; i < nb; ++i) {\n"
        "    std::ofstream f(argv[4 + i], std::ios::binary);\n"
        "    f.write(data[i].data(), (std::streamsize)(data[i].size() - 8));\n"
        "  }\n  return 0;\n}\n#endif\n"
    )
    return "".join(parts)


def _cache_dir() -> Path:
    base = os.environ.get("MTPLX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mtplx"
    )
    d = Path(base) / "kernels"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compiler() -> str:
    return os.environ.get("CXX") or "g++"


_CXXFLAGS = [
    "-std=c++17",
    "-pthread",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wno-unused-variable",
    "-Wno-maybe-uninitialized",
    "-Wno-unused-function",
]


def _build(source: str, flags: list[str], suffix: str) -> Path:
    """Compile ``source`` once per (source, flags, compiler) into the cache;
    concurrent builders race harmlessly (atomic rename)."""
    try:
        ver = subprocess.run([_compiler(), "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise RuntimeError(f"no C++ compiler for the CPU emulation: {e}") from e
    h = hashlib.sha256("\0".join([source, *flags, ver]).encode()).hexdigest()[:20]
    out = _cache_dir() / f"mtplx_kernels_{h}{suffix}"
    if out.exists():
        return out
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        tmp_out = Path(tmp) / out.name
        r = subprocess.run(
            [_compiler(), *flags, "-I", str(kernel_dir()), str(src), "-o", str(tmp_out)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"CPU emulation build failed:\n{r.stderr[-8000:]}")
        os.replace(tmp_out, out)
    return out


_libs: dict[tuple[str, ...], ctypes.CDLL] = {}


def cpu_library(defines: Sequence[str] = ()) -> ctypes.CDLL:
    """The emulation as a shared library (cached by source hash)."""
    key = tuple(defines)
    with _lock:
        if key not in _libs:
            path = _build(cpu_source(defines), [*_CXXFLAGS, "-O2", "-shared", "-fPIC"], ".so")
            lib = ctypes.CDLL(str(path))
            for spec in SPECS.values():
                fn = getattr(lib, f"mtplx_run_{spec.name}")
                fn.argtypes = [
                    ctypes.c_uint,
                    ctypes.c_uint,
                    ctypes.POINTER(ctypes.c_void_p),
                    ctypes.c_char_p,
                    ctypes.c_int,
                ]
                fn.restype = ctypes.c_int
            _libs[key] = lib
        return _libs[key]


def cpu_executable(defines: Sequence[str] = (), sanitize: str | None = "thread") -> Path:
    """The emulation as a standalone program (for ``-fsanitize=thread``: a
    TSAN-instrumented library cannot be loaded into an uninstrumented Python)."""
    flags = [*_CXXFLAGS, "-O1", "-g"]
    if sanitize:
        flags.append(f"-fsanitize={sanitize}")
    return _build(cpu_source([*defines, "MTPLX_STANDALONE"]), flags, ".bin")


def _prepare(name: str, inputs: Sequence[np.ndarray], out_shapes):
    spec = SPECS[name]
    if len(inputs) != len(spec.inputs) or len(out_shapes) != len(spec.outputs):
        raise ValueError(f"{name}: expected {len(spec.inputs)} inputs, {len(spec.outputs)} outputs")
    ins = [np.ascontiguousarray(a, dtype=_NP_TYPES[t]) for a, (_, t) in zip(inputs, spec.inputs)]
    outs = [np.zeros(s, dtype=_NP_TYPES[t]) for s, (_, t) in zip(out_shapes, spec.outputs)]
    return ins, outs


class EmulationError(RuntimeError):
    """The emulated kernel hit a barrier it could not complete."""


def emulate(
    name, inputs, out_shapes, groups: int, tg: int = 64, defines: Sequence[str] = (), tsan: bool = False
):
    """Run kernel ``name`` under the CPU emulation; returns the outputs.

    With ``tsan`` the sanitizer build runs as a subprocess and
    ``(outputs, returncode, stderr)`` is returned instead."""
    ins, outs = _prepare(name, inputs, out_shapes)
    if tsan:
        exe = cpu_executable(defines)
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for i, a in enumerate(ins + outs):
                f = os.path.join(tmp, f"b{i}")
                a.tofile(f)
                files.append(f)
            env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0")
            r = subprocess.run(
                [str(exe), name, str(tg), str(groups), *files],
                capture_output=True,
                text=True,
                env=env,
                timeout=600,
            )
            if r.returncode == 0:
                for f, o in zip(files[len(ins) :], outs):
                    o[...] = np.fromfile(f, dtype=o.dtype).reshape(o.shape)
            return outs, r.returncode, r.stderr
    lib = cpu_library(defines)
    bufs = (ctypes.c_void_p * (len(ins) + len(outs)))(*[a.ctypes.data for a in ins + outs])
    err = ctypes.create_string_buffer(512)
    rc = getattr(lib, f"mtplx_run_{name}")(tg, groups, bufs, err, len(err))
    if rc != 0:
        raise EmulationError(err.value.decode(errors="replace"))
    return outs


def _verify_inputs(target_logits, draft_tokens, draft_probs, params, accept_u, sample_u):
    B, k1, V = np.shape(target_logits)
    has_q = draft_probs is not None
    q = draft_probs if has_q else np.zeros((1,), np.float32)
    dims = np.array([B, k1 - 1, V, int(has_q)], np.int32)
    ins = [target_logits, draft_tokens, q, params, accept_u, sample_u, dims]
    return ins, [(B,), (B,), (B, k1 - 1)], B


def emulate_verify(
    target_logits,
    draft_tokens,
    draft_probs,
    params,
    accept_u,
    sample_u,
    tg: int = 64,
    defines: Sequence[str] = (),
    tsan: bool = False,
):
    """The verify kernel on the CPU emulation: (num_accepted, next_token, accept_probs)."""
    ins, shapes, B = _verify_inputs(target_logits, draft_tokens, draft_probs, params, accept_u, sample_u)
    return emulate("verify", ins, shapes, B, tg, defines, tsan)


def emulate_sample(logits, params, uniforms, tg: int = 64, defines: Sequence[str] = (), tsan: bool = False):
    """The sample kernel on the CPU emulation: (tokens, probs)."""
    B, V = np.shape(logits)
    dims = np.array([B, V], np.int32)
    return emulate("sample", [logits, params, uniforms, dims], [(B,), (B, V)], B, tg, defines, tsan)


# --------------------------------------------------------------------------- NumPy mirrors


def _row_cfg(row):
    from mtplx.sampling import SamplerConfig

    t, top_p, min_p, top_k = (float(x) for x in row)
    return SamplerConfig(temperature=t, top_p=top_p, top_k=int(top_k), min_p=min_p)


def numpy_mirror_verify(target_logits, draft_tokens, draft_probs, params, accept_u, sample_u):
    """The kernel's NumPy mirror, in the kernel's input form (per-row params):
    ``sampling.verify_reference`` applied row by row. float64."""
    from mtplx.sampling import verify_reference

    B, k1, _ = np.shape(target_logits)
    n = np.zeros(B, np.int64)
    tok = np.zeros(B, np.int64)
    ap = np.zeros((B, k1 - 1), np.float64)
    for b in range(B):
        r = verify_reference(
            np.asarray(target_logits[b : b + 1]),
            np.asarray(draft_tokens[b : b + 1]),
            None if draft_probs is None else np.asarray(draft_probs[b : b + 1]),
            _row_cfg(params[b]),
            np.asarray(accept_u[b : b + 1]),
            np.asarray(sample_u[b : b + 1]),
        )
        n[b], tok[b], ap[b] = np.asarray(r[0])[0], np.asarray(r[1])[0], np.asarray(r[2])[0]
    return n, tok, ap


def numpy_mirror_sample(logits, params, uniforms):
    """``sampling.sample_reference`` in the kernel's input form, row by row."""
    from mtplx.sampling import sample_reference

    B, V = np.shape(logits)
    tok = np.zeros(B, np.int64)
    probs = np.zeros((B, V), np.float64)
    for b in range(B):
        t, p = sample_reference(
            np.asarray(logits[b : b + 1]), _row_cfg(params[b]), np.asarray(uniforms[b : b + 1])
        )
        tok[b], probs[b] = np.asarray(t)[0], np.asarray(p)[0]
    return tok, probs
