#!/usr/bin/env bash
# Compile the CUDA sources with nvcc against the installed torch's headers, so they cannot rot on
# machines without a GPU or a CUDA build of torch (CI runs this where nvcc exists; ~1 minute).
#   bash csrc/cuda/compile_check.sh [sm_90]
# A CPU wheel of torch lacks c10/cuda/impl/cuda_cmake_macros.h (generated only in CUDA builds); a
# one-line stand-in is supplied for the check. Only compiles: nothing is linked or run.
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH="${1:-sm_90}"
PY="${PYTHON:-.venv/bin/python}"
STUB="$(mktemp -d)"
trap 'rm -rf "$STUB"' EXIT
mkdir -p "$STUB/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$STUB/c10/cuda/impl/cuda_cmake_macros.h"
INC=$("$PY" -c "from torch.utils import cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths()))")
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
for src in csrc/cuda/*.cu; do
  # the stand-in goes last so a real CUDA torch's own header wins
  nvcc -c -std=c++20 -O3 -Xcompiler -fPIC $INC -I"$PYINC" -I"$STUB" \
    -gencode "arch=compute_${ARCH#sm_},code=$ARCH" "$src" -o "$STUB/$(basename "$src").o"
  echo "ok: $src ($ARCH)"
done
