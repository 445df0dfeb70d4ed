"""Pack MLX's CUDA backend for an offline Hopper machine, under the device tool's 64 MiB.

    python benchmarks/device_pack.py            # writes .whl/mlx-cuda-sm90.tar.xz + the mlx wheel

mlx-cuda-13's wheel is 90 MB: libmlx.so carries device code for sm_75..sm_121 (about 58 MB)
and a 26 MB symbol table. For one H200 only the sm_90 ELF is used, so this strips the symbol
table (the dynamic one stays) and zeroes the payloads of the other architectures' fatbin
entries, keeping every header and offset, so the CUDA runtime still parses the fatbin and picks
sm_90; zeroes compress to nothing. The result is ~20 MiB as .tar.xz.

Fatbin layout (documented nowhere official; as cuobjdump lists it): a blob header
(magic 0xBA55ED50, u16 version, u16 header size, u64 payload size) followed by entries, each
(u16 kind 1=PTX 2=ELF, u16, u32 header size, u64 payload size, ..., u32 arch at byte 28).
"""

from __future__ import annotations

import argparse
import io
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(lib: Path) -> tuple[int, int]:
    """(file offset, size) of ``.nv_fatbin`` in ``lib``."""
    out = subprocess.check_output(["readelf", "-S", "-W", str(lib)], text=True)
    for line in out.splitlines():
        if ".nv_fatbin" in line:
            fields = line.split("]", 1)[1].split()
            return int(fields[3], 16), int(fields[4], 16)
    raise SystemExit(f"{lib}: no .nv_fatbin section")


def keep_only_arch(data: bytearray, start: int, size: int, arch: int) -> dict[tuple[int, int], int]:
    """Zero every fatbin entry's payload whose arch is not ``arch``; bytes per (kind, arch)."""
    seen: dict[tuple[int, int], int] = {}
    pos, end = start, start + size
    while pos < end:
        magic, _version, header_size, blob_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # blobs are 8-byte aligned; padding between them
            pos += 8
            continue
        entry, blob_end = pos + header_size, pos + header_size + blob_size
        while entry < blob_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            entry_arch = struct.unpack_from("<I", data, entry + 28)[0]
            seen[(kind, entry_arch)] = seen.get((kind, entry_arch), 0) + payload
            if entry_arch != arch:
                body = entry + entry_header
                data[body : body + payload] = bytes(payload)
            entry += entry_header + payload
        pos = blob_end
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mlx-version", default="0.32.4")
    ap.add_argument("--cuda", default="13", help="CUDA major of the machine's driver")
    ap.add_argument("--arch", type=int, default=90, help="SM to keep (H100/H200: 90)")
    ap.add_argument("--python", default="3.12", help="the device image's python3")
    ap.add_argument("--out", type=Path, default=Path(".whl"))
    args = ap.parse_args()
    args.out.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subprocess.check_call(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python, "--implementation", "cp",
             "--platform", "manylinux_2_35_x86_64", "-d", str(tmp),
             f"mlx=={args.mlx_version}", f"mlx-cuda-{args.cuda}=={args.mlx_version}"]
        )  # fmt: skip
        for wheel in tmp.glob("mlx-*.whl"):
            shutil.copy(wheel, args.out / wheel.name)
        (cuda_wheel,) = tmp.glob(f"mlx_cuda_{args.cuda}-*.whl")
        tree = tmp / "tree"
        zipfile.ZipFile(cuda_wheel).extractall(tree)
        lib = tree / "mlx" / "lib" / "libmlx.so"
        subprocess.check_call(["strip", "--strip-unneeded", str(lib)])
        data = bytearray(lib.read_bytes())
        start, size = fatbin_section(lib)
        seen = keep_only_arch(data, start, size, args.arch)
        lib.write_bytes(data)
        for (kind, arch), n in sorted(seen.items()):
            kept = "kept" if arch == args.arch else "zeroed"
            print(f"  {'PTX' if kind == 1 else 'ELF'} sm_{arch}: {n / 1e6:.1f} MB {kept}")
        if not any(arch == args.arch for _, arch in seen):
            raise SystemExit(f"libmlx.so has no sm_{args.arch} code")
        target = args.out / f"mlx-cuda-sm{args.arch}.tar.xz"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:xz", preset=6) as tar:
            for child in sorted(tree.iterdir()):
                tar.add(child, arcname=child.name)
        partial = target.with_suffix(".partial")
        partial.write_bytes(buf.getvalue())
        partial.rename(target)
        print(f"{target}: {target.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
