#!/usr/bin/env bash
# One call on a GPU machine: set up, run every GPU test and the GPU benchmark, print a table.
# On a machine with picoscale's build dependencies it builds; on a bare one (driver and CUDA
# libraries only) it unpacks gpu_bundle/ made beforehand by tools/gpu_bundle.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/picoscale-gpu-check}
mkdir -p "$OUT"
log() { echo "== $*"; }

if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L failed); nothing to check"
  exit 1
fi
nvidia-smi -L

if [ -d gpu_bundle ]; then
  log "unpacking gpu_bundle"
  tar -xzf gpu_bundle/openmpi.tar.gz -C /
  ln -sf orterun /usr/bin/mpirun
  tar -xzf gpu_bundle/fortunes.tar.gz -C /
  tar -xzf gpu_bundle/lib.tar.gz -C gpu_bundle
  mkdir -p build && cp gpu_bundle/bin/train . && cp gpu_bundle/bin/unit_tests gpu_bundle/bin/bench build/
  libs="$PWD/gpu_bundle/lib"
  # cuBLAS and NCCL come from the machine: the CUDA toolkit or the Python wheels.
  for name in libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
    found=$(find /usr/local /opt /usr/lib -name "$name" 2>/dev/null | head -1)
    [ -n "$found" ] && libs="$libs:$(dirname "$found")" || echo "warning: $name not found"
  done
  export LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}"
else
  log "building"
  export PATH="$PATH:/usr/local/cuda/bin"
  make -j"$(nproc)" train build/unit_tests build/bench || exit 1
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none

log "GPU tests"
build/unit_tests "[gpu]" 2>&1 | tee "$OUT/gpu_tests.log" | grep -Ev "^\s*$" | tail -40
summary=$(grep -E "^(All tests passed|test cases:)" "$OUT/gpu_tests.log" | tail -1)

log "GPU benchmark"
build/bench 2>&1 | tee "$OUT/bench.log"

log "summary"
echo "| check | result |"
echo "|---|---|"
echo "| GPU tests ([gpu]) | ${summary:-no summary: the test binary crashed} |"
grep -E "^\| (tiny|medium)" "$OUT/bench.log" | awk -F'|' '{printf "| bench %s on %s | %s tok/s, %s GFLOP/s = %s of sgemm |\n", $2, $3, $6, $7, $9}'
