#!/usr/bin/env bash
# Fused-kernel check on an NVIDIA machine with no network (< 5 minutes).
#
#   bash benchmarks/device_check.sh            # from the repository root
#
# Needs wheels brought along in .whl/ (fetch them on a networked Linux x86_64
# machine with the GPU machine's Python version, e.g. 3.11):
#   pip download -d .whl --only-binary=:all: --python-version 3.11 \
#       --platform manylinux_2_35_x86_64 "mlx[cuda12]==0.32.4" numpy pytest
# (mlx's CUDA backend ships as extra wheels pulled by the cuda12 extra; if the
# machine's driver wants CUDA 13, use "mlx[cuda13]" instead.)
# It installs mlx + mtplx (no deps) into a throwaway venv, runs the
# kernel-vs-oracle comparison on the GPU, then times fused vs MLX-ops verify
# for V=151936, k=1..8, B=1..8 and prints a markdown table for
# benchmarks/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ENV=${MTPLX_DEVICE_VENV:-/tmp/mtplx-device-venv}
python3 -m venv "$ENV"
"$ENV/bin/pip" install -q --no-index --find-links .whl "mlx[cuda12]" numpy pytest \
  || "$ENV/bin/pip" install -q --no-index --find-links .whl "mlx[cuda13]" numpy pytest
"$ENV/bin/pip" install -q --no-index --no-deps --no-build-isolation -e . 2>/dev/null \
  || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
timeout 270 "$ENV/bin/python" benchmarks/device_check.py "$@"
