#!/usr/bin/env bash
# Installs the Debian packages picoscale needs (arguments), only those missing.
# As root it runs apt-get; otherwise it prints the exact command to run.
set -euo pipefail
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "picoscale needs the CUDA toolkit (nvcc) even for CPU runs: every .cu file is compiled" >&2
  echo "by nvcc. Install CUDA 12 or 13 and put nvcc on PATH (e.g. /usr/local/cuda/bin)." >&2
  exit 1
fi
missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
cmd="apt-get update && apt-get install -y ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  echo "picoscale needs these Debian packages: ${missing[*]}" >&2
  echo "Run:  sudo sh -c '$cmd'" >&2
  exit 1
fi
echo "installing: ${missing[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
