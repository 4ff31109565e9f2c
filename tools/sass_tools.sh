#!/usr/bin/env bash
# sass_tools.sh: NVIDIA's cuobjdump and nvdisasm, which read the SASS (the machine code ptxas
# writes) of a compiled kernel. Some CUDA installs lack them; tools/kernel_report.sh then counts
# the PTX only. Optional: nothing builds or trains with them.
#   tools/sass_tools.sh          fetch them into build/sass-tools/bin (once; `make deps-sass`)
#   tools/sass_tools.sh --find   print the cuobjdump to use, or exit 1 when there is none
# Looked for in order: $CUOBJDUMP, cuobjdump on PATH, next to nvcc, build/sass-tools/bin. The
# fetch takes NVIDIA's own wheels of the two tools from the Python package index (about 5 MB,
# `pip download`, nothing installed into Python) and keeps only the two binaries.
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=build/sass-tools
VERSION=13.2.86 # cuobjdump reads the cubins of every nvcc up to its own version

find_cuobjdump() {
  local nvcc c
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  for c in "${CUOBJDUMP:-}" "$(command -v cuobjdump)" "$(dirname "$nvcc")/cuobjdump" \
    "$DIR/bin/cuobjdump"; do
    # nvdisasm must sit beside it or on PATH: cuobjdump -sass runs it.
    if [ -n "$c" ] && [ -x "$c" ] &&
      { [ -x "$(dirname "$c")/nvdisasm" ] || command -v nvdisasm >/dev/null; }; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

if [ "${1:-}" = --find ]; then
  find_cuobjdump
  exit
fi
[ $# -eq 0 ] || { echo "sass_tools: unknown argument $1 (usage: tools/sass_tools.sh [--find])"; exit 2; }
if c=$(find_cuobjdump); then
  echo "sass_tools: $c is there"
  exit 0
fi
PYTHON=$(command -v python3) || { echo "sass_tools: python3 is needed to fetch the tools"; exit 1; }
work=$(mktemp -d /tmp/sass_tools.XXXXXX)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DIR/bin"
for tool in cuobjdump nvdisasm; do
  if ! "$PYTHON" -m pip download --quiet --no-deps -d "$work/$tool" \
    "nvidia-cuda-$tool==$VERSION" >"$work/$tool.log" 2>&1; then
    echo "sass_tools: could not fetch nvidia-cuda-$tool $VERSION:"
    tail -2 "$work/$tool.log"
    exit 1
  fi
  "$PYTHON" -m zipfile -e "$work/$tool"/*.whl "$work/$tool/x" &&
    install -m 755 "$(find "$work/$tool/x" -path "*/bin/$tool" -type f | head -1)" "$DIR/bin/$tool" ||
    { echo "sass_tools: the wheel of $tool holds no bin/$tool"; exit 1; }
done
echo "sass_tools: $DIR/bin/cuobjdump and $DIR/bin/nvdisasm ($VERSION)"
