#!/usr/bin/env bash
# Prepares gpu_bundle/ (git-ignored) for tools/gpu_check.sh on a bare GPU machine that has the
# NVIDIA driver and CUDA libraries (cuBLAS, NCCL) but no MPI, OpenBLAS or corpus: the built
# binaries, the shared libraries they need besides CUDA's and the C runtime's, the OpenMPI
# tree (libraries, plugins, help texts, config, mpirun/orted) and the fortune corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
make -j"$(nproc)" train build/unit_tests build/bench
rm -rf gpu_bundle && mkdir -p gpu_bundle/bin gpu_bundle/lib
cp train build/unit_tests build/bench gpu_bundle/bin/
mpi_lib=/usr/lib/x86_64-linux-gnu/openmpi
skip='linux-vdso|ld-linux|libc\.so|libm\.so|libstdc\+\+|libgcc_s|libpthread|libdl\.so|librt\.so|libcuda|libcublas|libnccl|libcudart'
{ ldd gpu_bundle/bin/*; ldd $mpi_lib/lib/openmpi3/*.so /usr/bin/orted 2>/dev/null || true; } |
  awk '/=> \//{print $3}' | sort -u | grep -Ev "$skip" | while read -r lib; do
  cp -L "$lib" gpu_bundle/lib/
done
# OpenMPI finds its plugins and help files at the paths it was built with: ship them as a tree.
tar -czf gpu_bundle/openmpi.tar.gz -C / "${mpi_lib#/}" usr/share/openmpi etc/openmpi \
  usr/bin/orted usr/bin/orterun
tar -czf gpu_bundle/fortunes.tar.gz -C / usr/share/games/fortunes
tar -czf gpu_bundle/lib.tar.gz -C gpu_bundle lib && rm -rf gpu_bundle/lib
du -sh gpu_bundle
