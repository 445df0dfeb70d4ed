#!/usr/bin/env bash
# Fused-kernel check on an offline NVIDIA Hopper machine (< 5 minutes there).
#
#   python benchmarks/device_pack.py            # here, with network: fills .whl/ (~20 MiB)
#   bash benchmarks/device_check.sh | tee out   # there, from the repository root, .whl carried
#
# It unpacks MLX + its CUDA backend (pruned to sm_90 by device_pack.py) into /tmp/site, links
# the image's own NVIDIA libraries (cuBLAS, cuDNN, NVRTC, ... from its PyTorch install) where
# libmlx.so's rpath looks, and runs benchmarks/device_check.py with the image's python3 (its
# numpy and pytest): the fused verify on the GPU against the NumPy mirror over the test
# suite's shapes, then fused vs MLX-ops verify timings for V=151936, k=1..8, B=1..8.
set -euo pipefail
cd "$(dirname "$0")/.."
SITE=${MTPLX_DEVICE_SITE:-/tmp/site}
mkdir -p "$SITE"
python3 -m zipfile -e .whl/mlx-*-cp312-*.whl "$SITE"
tar -xJf .whl/mlx-cuda-sm90.tar.xz -C "$SITE"
NVIDIA=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')
ln -sfn "$NVIDIA" "$SITE/nvidia"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device(), "cuda:", mx.cuda.is_available())'
timeout 400 python3 benchmarks/device_check.py "$@"
