#!/usr/bin/env bash
# Prepares ptxas reports of the mosaic_gpu kernels on a host without a GPU
# (tools/ptxas_report.py --offline): downloads the CUDA plugin of the
# pinned jaxlib and ptxas from PyPI, unpacks them, and builds the stand-in
# driver (fake_libcuda.c).  Prints the directory to pass as --offline.
#
# ptxas is the H200 machine's version (CUDA 13.0.88) unless NVCC_VERSION
# names another; 13.5 gave the same register and spill counts.
#
# Usage: bash tools/offline_cuda/setup.sh [DIR]   (default /tmp/jflash-cuda)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="${1:-/tmp/jflash-cuda}"
PY="${PYTHON:-python3}"
jax_version="$("$PY" -c 'import jaxlib; print(jaxlib.__version__)')"
mkdir -p "$dir/wheels"
"$PY" -m pip download -q --no-deps -d "$dir/wheels" \
  "jax-cuda13-plugin==$jax_version" "jax-cuda13-pjrt==$jax_version" \
  "nvidia-cuda-nvcc==${NVCC_VERSION:-13.0.88}" \
  "nvidia-cuda-nvdisasm>=13,<14"
for wheel in "$dir"/wheels/*.whl; do
  "$PY" -m zipfile -e "$wheel" "$dir/unpacked"
done
chmod +x "$dir"/unpacked/nvidia/cu13/bin/* 2>/dev/null || true
mkdir -p "$dir/driver"
cc -shared -fPIC -o "$dir/driver/libcuda.so.1" "$here/fake_libcuda.c"
echo "$dir"
