"""CPU emulation of the fused kernels, and their NumPy mirrors: test and tool code only.

The shared kernel bodies (``kernels/*.body`` + ``common.h``) run here on the
CPU prelude, compiled with g++ into a ctypes library (real threads, one per
GPU thread of a group) or into a standalone ThreadSanitizer program. Tests
(``tests/sample/test_kernels.py``, ``tests/sample/test_kernel_sources.py``) and
``benchmarks/device_check.py`` import this module; the runtime path
(``mtplx.sample.rejection`` -> ``mtplx.sample.kernels``) never does.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from mtplx.io import atomic_path
from mtplx.resources import cache_root, kernel_dir
from mtplx.sample.kernels import DEFAULT_TG, SPECS, _read, cuda_sources
from mtplx.sample.params import SamplerConfig
from mtplx.sample.reference import sample_reference, verify_reference

import numpy as np

__all__ = [
    "CPU_TGS",
    "EmulationError",
    "cuda_translation_unit",
    "cpu_source",
    "cpu_library",
    "cpu_executable",
    "emulate",
    "emulate_verify",
    "emulate_sample",
    "numpy_mirror_verify",
    "numpy_mirror_sample",
]

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


# --------------------------------------------------------------------------- CPU emulation

CPU_TGS = (32, 64, 128, 256)  # instantiated in the emulation library


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
    build_dir = cache_root() / "kernels"
    build_dir.mkdir(parents=True, exist_ok=True)
    return build_dir


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
    with tempfile.TemporaryDirectory() as tmp, atomic_path(out, 0o777) as tmp_out:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        r = subprocess.run(
            [_compiler(), *flags, "-I", str(kernel_dir()), str(src), "-o", str(tmp_out)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"CPU emulation build failed:\n{r.stderr[-8000:]}")
    return out


_lock = threading.Lock()
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
    """The verify kernel on the CPU emulation: (num_accepted, next_token, accept_probs).

    k >= 0: with k = 0 (draft_tokens and accept_u [B, 0]) the body draws row 0's bonus token,
    the sample kernel's token (tests/sample/test_verify_without_drafts.py)."""
    ins, shapes, B = _verify_inputs(target_logits, draft_tokens, draft_probs, params, accept_u, sample_u)
    return emulate("verify", ins, shapes, B, tg, defines, tsan)


def emulate_sample(logits, params, uniforms, tg: int = 64, defines: Sequence[str] = (), tsan: bool = False):
    """The sample kernel on the CPU emulation: (tokens, probs)."""
    B, V = np.shape(logits)
    dims = np.array([B, V], np.int32)
    return emulate("sample", [logits, params, uniforms, dims], [(B,), (B, V)], B, tg, defines, tsan)


# --------------------------------------------------------------------------- NumPy mirrors


def _row_cfg(row) -> SamplerConfig:
    t, top_p, min_p, top_k = (float(x) for x in row)
    return SamplerConfig(temperature=t, top_p=top_p, top_k=int(top_k), min_p=min_p)


def numpy_mirror_verify(target_logits, draft_tokens, draft_probs, params, accept_u, sample_u):
    """The kernel's NumPy mirror, in the kernel's input form (per-row params):
    ``sampling.verify_reference`` applied row by row. float64."""
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
    B, V = np.shape(logits)
    tok = np.zeros(B, np.int64)
    probs = np.zeros((B, V), np.float64)
    for b in range(B):
        t, p = sample_reference(
            np.asarray(logits[b : b + 1]), _row_cfg(params[b]), np.asarray(uniforms[b : b + 1])
        )
        tok[b], probs[b] = np.asarray(t)[0], np.asarray(p)[0]
    return tok, probs
