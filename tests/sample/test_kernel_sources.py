"""What can be checked here about the GPU variants of the shared kernel bodies
(generated Metal source, an NVRTC compile of the CUDA program), the CPU
emulation's own guarantees (a broken barrier aborts, shuffles are exact), and
the dispatch contract of ``kernels.get_fused``."""

import ctypes
import glob
import os
import re
import warnings

import mtplx  # noqa: F401  (before mlx)
from mtplx.sample import emulation as E
from mtplx.sample import kernels as K

import mlx.core as mx
import numpy as np
import pytest
from support.optional import import_or_skip

# ---------------------------------------------------------------- emulation harness

_HARNESS = r"""
#include "prelude_cpu.h"
#define RUN(body) mtplx_cpu::launch(1, 64, [&](unsigned l, unsigned g) { body }, err, n)
extern "C" int early_return(char* err, int n) {
  return RUN(if (l == 5) return; MTPLX_BARRIER(););
}
extern "C" int split_sites(char* err, int n) {
  // Two barrier sites on two source lines (sites are told apart by line).
  return mtplx_cpu::launch(1, 64, [&](unsigned l, unsigned g) {
    if (l % 2) {
      MTPLX_BARRIER();
    } else {
      MTPLX_BARRIER();
    }
  }, err, n);
}
extern "C" int partial_simd(char* err, int n) {
  return RUN(float x = 1.0f; if (l % 32 < 16) { x = MTPLX_SHFL_XOR(x, 1); } (void)x;);
}
extern "C" int shuffles(char* err, int n, unsigned* out) {
  return RUN(
    unsigned v = l * 7u + 3u;
    unsigned a = MTPLX_SHFL_XOR(v, 5u);
    unsigned b = MTPLX_SHFL_UP(v, 3u);
    unsigned c = MTPLX_SHFL_XOR(a, 16u);
    MTPLX_BARRIER();
    out[3 * l] = a; out[3 * l + 1] = b; out[3 * l + 2] = c;
  );
}
"""


@pytest.fixture(scope="module")
def harness():
    path = E._build(_HARNESS, [*E._CXXFLAGS, "-O1", "-shared", "-fPIC"], ".so")
    lib = ctypes.CDLL(str(path))
    return lib


def _run(lib, fn, *extra):
    err = ctypes.create_string_buffer(512)
    rc = getattr(lib, fn)(err, len(err), *extra)
    return rc, err.value.decode()


def test_barrier_reached_by_only_some_threads_aborts(harness):
    rc, msg = _run(harness, "early_return")
    assert rc == 1 and "only some threads" in msg


def test_threads_at_different_barriers_abort(harness):
    rc, msg = _run(harness, "split_sites")
    assert rc == 1 and "divergence" in msg


def test_shuffle_by_half_a_simd_group_aborts(harness):
    rc, msg = _run(harness, "partial_simd")
    assert rc == 1 and "simd shuffle" in msg


def test_shuffles_are_exact(harness):
    out = np.zeros(3 * 64, np.uint32)
    rc, msg = _run(harness, "shuffles", out.ctypes.data_as(ctypes.POINTER(ctypes.c_uint)))
    assert rc == 0, msg
    lid = np.arange(64)
    lane, base = lid % 32, lid - lid % 32
    v = lambda i: i * 7 + 3  # noqa: E731
    a = v(base + (lane ^ 5))
    b = np.where(lane >= 3, v(base + lane - 3), v(lid))  # low lanes keep their own value
    c = a[base + (lane ^ 16)]
    assert out.reshape(64, 3).tolist() == np.stack([a, b, c], 1).tolist()


# ---------------------------------------------------------------- generated Metal source


def _generated_msl(name, capfd, header=None, source=None, tg=256):
    """The MSL mlx generates for our kernel: printed by verbose=True when the
    call is traced by mx.export_function, which works without Metal."""
    spec = K.SPECS[name]
    h, s = K.metal_sources(name)
    kernel = mx.fast.metal_kernel(
        name=f"mtplx_{name}",
        input_names=[n for n, _ in spec.inputs],
        output_names=[n for n, _ in spec.outputs],
        source=s if source is None else source,
        header=h if header is None else header,
    )
    B, k, V = 2, 3, 4096
    if name == "verify":
        ins = [
            mx.zeros((B, k + 1, V)),
            mx.zeros((B, k), mx.int32),
            mx.zeros((B, k, V)),
            mx.zeros((B, 4)),
            mx.zeros((B, k)),
            mx.zeros((B,)),
            mx.zeros((4,), mx.int32),
        ]
        shapes, dtypes = [(B,), (B,), (B, k)], [mx.int32, mx.int32, mx.float32]
    else:
        ins = [mx.zeros((B, V)), mx.zeros((B, 4)), mx.zeros((B,)), mx.zeros((2,), mx.int32)]
        shapes, dtypes = [(B,), (B, V)], [mx.int32, mx.float32]

    def fn(*xs):
        return kernel(
            inputs=list(xs),
            template=[("TG", tg)],
            grid=(B * tg, 1, 1),
            threadgroup=(tg, 1, 1),
            output_shapes=shapes,
            output_dtypes=dtypes,
            verbose=True,
        )

    capfd.readouterr()
    mx.export_function(lambda *a, **kw: None, fn, *ins)
    out = capfd.readouterr().out
    m = re.search(r"```\n(.*?)\n```", out, re.S)
    assert m, f"mlx printed no generated source: {out[:500]!r}"
    return m.group(1)


def msl_problems(msl, name, tg=256):
    """Reasons the generated MSL would not be what the Mac compiles."""
    spec = K.SPECS[name]
    problems = []
    fn = re.search(r"template <int TG>\s*\[\[kernel\]\] void (\w+)\((.*?)\)\s*\{", msl, re.S)
    if not fn:
        return ["no `template <int TG> [[kernel]]` function"]
    kname, params = fn.group(1), fn.group(2)
    for i, (n, t) in enumerate(list(spec.inputs) + list(spec.outputs)):
        ty = {"f32": "float", "i32": "int32_t"}[t]
        space = "const (device|constant)" if i < len(spec.inputs) else "device"
        if not re.search(rf"{space} {ty}\* {n} \[\[buffer\({i}\)\]\]", params):
            problems.append(f"buffer {i} ({n}) missing or mistyped")
    for attr in ("thread_position_in_threadgroup", "threadgroup_position_in_grid"):
        if f"uint3 {attr} [[{attr}]]" not in params:
            problems.append(f"attribute {attr} not declared")
    if not re.search(rf"decltype\({kname}<{tg}>\)\s*{kname}<{tg}>;", msl):
        problems.append("no explicit instantiation for TG")
    if msl.count("{") != msl.count("}"):
        problems.append("unbalanced braces")
    for token in ("__shared__", "__syncthreads", "__device__", "std::", "[&]", "[=]"):
        if token in msl:
            problems.append(f"non-Metal token {token!r}")
    return problems


@pytest.mark.parametrize("name", ["verify", "sample"])
def test_generated_msl(name, capfd):
    msl = _generated_msl(name, capfd)
    assert msl_problems(msl, name) == []
    header, _ = K.metal_sources(name)
    assert msl.count(header.strip().splitlines()[-1]) >= 1  # header passed through
    assert "threadgroup float mtplx_red[16 * (TG / 32)];" not in header  # memory only in the body
    assert "MTPLX_PLANT" not in msl.split("#ifndef MTPLX_PLANT")[0]  # plants off by default


def test_msl_check_catches_entry_in_header(capfd):
    # Negative control: the thread-position names moved to the header are not
    # declared by mlx, which the check must notice.
    h, s = K.metal_sources("sample")
    entry, body = s.split("\n", 1)
    msl = _generated_msl("sample", capfd, header=h + "\n" + entry, source=body)
    assert any("not declared" in p for p in msl_problems(msl, "sample"))


# ---------------------------------------------------------------- CUDA compile check


NVRTC_INSTALL = "pyproject's test extra installs nvidia-cuda-nvrtc-cu12 on Linux x86_64"


def _nvrtc():
    """NVRTC's library from the nvidia-cuda-nvrtc wheel; a skip only when the wheel is absent (an
    installed wheel without its library fails)."""
    pkg = import_or_skip("nvidia.cuda_nvrtc", NVRTC_INSTALL)
    roots = list(getattr(pkg, "__path__", []))
    libs = sorted(
        p
        for r in roots
        for p in glob.glob(os.path.join(r, "lib", "libnvrtc.so*"))
        if "builtins" not in p and ".alt." not in p
    )
    assert libs, f"nvidia.cuda_nvrtc is installed at {roots} but holds no lib/libnvrtc.so*"
    return ctypes.CDLL(libs[0])


# Stand-ins for what mlx's default header includes; our bodies use neither.
_CUDA_STUB = """\
typedef int int32_t;
namespace cooperative_groups {}
#define inf __int_as_float(0x7f800000)
"""


def nvrtc_compile(lib, src, arch):
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"mtplx.cu", 0, None, None) == 0
    opts = (ctypes.c_char_p * 1)(f"--gpu-architecture={arch}".encode())
    rc = lib.nvrtcCompileProgram(prog, 1, opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace")


@pytest.mark.parametrize("name", ["verify", "sample"])
def test_cuda_variant_compiles_with_nvrtc(name):
    lib = _nvrtc()
    for arch in ("compute_80", "sm_90"):
        rc, log = nvrtc_compile(lib, E.cuda_translation_unit(name, 256, prefix=_CUDA_STUB), arch)
        assert rc == 0, f"{arch}:\n{log}"


def test_nvrtc_check_rejects_metal_prelude():
    # Negative control: the same check fails on source that is not CUDA.
    lib = _nvrtc()
    src = E.cuda_translation_unit("sample", 256, prefix=_CUDA_STUB)
    src = src.replace(K._read("prelude_cuda.h"), K._read("prelude_metal.h"))
    rc, _ = nvrtc_compile(lib, src, "compute_80")
    assert rc != 0


# ---------------------------------------------------------------- dispatch contract


def test_get_fused_is_none_on_cpu_and_when_forced():
    assert K._gpu_backend() is None  # this suite runs on the CPU backend
    assert K.get_fused("verify") is None and K.get_fused("sample") is None
    assert K.get_fused("verify", force_fallback=True) is None
    with pytest.raises(ValueError):
        K.get_fused("nope")


def test_auto_skips_a_backend_measured_slower_without_building_it(monkeypatch):
    # CUDA: the fused verify measured 0.2-1.1x of the ops path on an H200, so auto does not use it.
    assert K.FUSED_BY_DEFAULT == {"metal": True, "cuda": False}

    def no_build(*_args, **_kw):
        raise AssertionError("auto built a kernel on a backend it should skip")

    monkeypatch.setattr(K, "_gpu_backend", lambda: "cuda")
    monkeypatch.setattr(K, "_built", {})
    monkeypatch.setattr(K, "_make_kernel", no_build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert K.get_fused("verify") is None and K.get_fused("sample") is None
    with pytest.raises(AssertionError, match="should skip"):  # build_fused still builds on request
        K.build_fused("cuda", "verify")


def test_build_failure_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(K, "_gpu_backend", lambda: "cuda")  # cuda_kernel raises without CUDA
    monkeypatch.setitem(K.FUSED_BY_DEFAULT, "cuda", True)
    monkeypatch.setattr(K, "_built", {})
    monkeypatch.setattr(K, "_warned", set())
    with pytest.warns(RuntimeWarning, match="fused verify kernel unavailable"):
        assert K.get_fused("verify") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert K.get_fused("verify") is None
        K.set_force_fallback(True)
        try:
            assert K.force_fallback() and K.get_fused("verify", force_fallback=None) is None
        finally:
            K.set_force_fallback(False)


def test_sources_ship_in_the_wheel():
    root = K.kernel_dir()
    assert root.name in ("kernels", "_kernels")
    pyproject = (root.parent / "pyproject.toml") if root.name == "kernels" else None
    if pyproject is not None and pyproject.exists():
        assert re.search(r'"kernels"\s*=\s*"mtplx/_kernels"', pyproject.read_text())
    for f in (
        "common.h",
        "prelude_metal.h",
        "prelude_cuda.h",
        "prelude_cpu.h",
        *(s.body for s in K.SPECS.values()),
    ):
        assert (root / f).is_file(), f
