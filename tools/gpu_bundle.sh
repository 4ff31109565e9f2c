#!/usr/bin/env bash
# gpu_bundle.sh: run HERE, on a machine with picoscale's build dependencies, before a GPU check on another machine.
# Builds for the default GPU_ARCH (sm_80 + sm_90 machine code, compute_90 PTX) and packs into
# gpu_bundle/ (git-ignored) what tools/gpu_check.sh needs on a bare GPU machine: one with the
# NVIDIA driver and CUDA 13 (cuBLAS and NCCL from the toolkit or Python wheels) but no MPI,
# OpenBLAS or fortune corpus.
#   bin.tar.xz       train and build/{unit_tests,mpi_tests,bench_step,bench_comm,bench_attention,
#                    bench_matmul,bench_matmul_coarsen8x8 (docs/experiments/coarsen-8x8.patch
#                    applied),device_info}
#   lib.tar.xz       lib/: every shared library those, orted, orterun, ompi_info and the OpenMPI
#                    and PMIx plugins load, except the C/C++ runtime and CUDA's own libraries
#   openmpi.tar.xz   the OpenMPI tree with its paths relative to / (plugins, share/openmpi,
#                    etc/openmpi, orted, orterun, ompi_info, PMIx's plugins), links resolved.
#                    tools/gpu_unpack.sh unpacks it under a private prefix in its work folder
#                    and points OpenMPI there (OPAL_PREFIX); nothing is written to /.
#   corpus.txt.gz    the default corpus (the fortune files, sorted by name) as one file, for
#                    --data: the same bytes, so the same batches, as /usr/share/games/fortunes
#   MANIFEST.txt     commit, compiler, flags, sizes
#   NEEDED.txt       the libraries the binaries load that the GPU machine must provide (cuBLAS,
#                    NCCL): gpu_check.sh looks them up by name, without readelf
#   SOURCES.sha256   the sources the binaries were built from: gpu_check.sh says in its first line
#                    whether the checkout beside the bundle still has them
# xz, not gzip: the binaries share most of their bytes (the same kernels), which only xz's large
# window finds (about a third of the size). Made in a folder of its own and moved into place
# only when complete and within the limit, so a failure leaves no half bundle behind.
# Then it unpacks the bundle into a temporary directory and checks, with ldd, that every library
# a bundled binary or plugin needs is bundled, or is a C/C++ runtime or CUDA library.
# Usage: tools/gpu_bundle.sh [--no-build]   (--no-build packs the binaries already built)
#        tools/gpu_bundle.sh --mpi-only DIR  (only openmpi.tar.xz and lib.tar.xz for ./train,
#                                             into DIR: what tools/test_gpu_check.sh unpacks)
# Carry `gpu_bundle` to the GPU machine and run `bash tools/gpu_check.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
BINARIES="train build/unit_tests build/mpi_tests build/bench_step build/bench_comm build/bench_attention build/bench_matmul build/bench_matmul_coarsen8x8 build/device_info"
MPI_DIR=/usr/lib/x86_64-linux-gnu/openmpi
PMIX_DIR=/usr/lib/x86_64-linux-gnu/pmix2
# What may travel to a GPU machine: 64 MiB, the checkout's tracked files included; 4 to spare.
tracked=$(git ls-files -z 2>/dev/null | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
MAX_MIB=$((64 - (${tracked:-8388608} + 1048575) / 1048576 - 4))
pack() { tar -cf - "$@" | xz -9 -T1; }  # pack FOLDER_ARGS... > FILE.tar.xz

# Libraries every Linux GPU machine has: glibc, the GCC C++ runtime, the driver and CUDA's
# own (cuBLAS and NCCL are found there by gpu_check.sh).
SYSTEM_LIBS='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|libresolv|libanl|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia-[a-z-]+)\.so'
# Plugins for RDMA networks (disabled in /etc/openmpi anyway) pull in UCX, libfabric and
# verbs: a single node needs none of them.
RDMA_LIBS='lib(ucp|uct|ucs|ucm|fabric|ibverbs|rdmacm|psm_infinipath|psm2|efa|infinipath)\.so'

OUT_DIR=gpu_bundle MPI_ONLY=0
if [ "${1:-}" = "--mpi-only" ]; then
  MPI_ONLY=1 OUT_DIR=${2:?usage: tools/gpu_bundle.sh --mpi-only DIR} BINARIES=train
elif [ "${1:-}" != "--no-build" ]; then
  # The Makefile's default GPU_ARCH, even if the environment sets another one.
  env -u GPU_ARCH make -j"$(nproc)" $BINARIES
fi
[ "$MPI_ONLY" = 1 ] || grep -q "code=sm_90" build/flags.txt ||
  { echo "gpu_bundle: build/flags.txt has no sm_90 code: rebuild with the default GPU_ARCH"; exit 1; }
for b in $BINARIES; do [ -x "$b" ] || { echo "gpu_bundle: $b is missing"; exit 1; }; done

new=$(mktemp -d "${TMPDIR:-/tmp}/picoscale-bundle.XXXXXX")
check=$(mktemp -d)
trap 'rm -rf "$new" "$check"' EXIT
mkdir -p "$new/stage/bin" "$new/stage/lib"
stage=$new/stage
cp $BINARIES $stage/bin/

# The OpenMPI and PMIx files to ship: plugins without RDMA dependencies, help texts, config.
mpi_files=$(mktemp)
{
  for f in "$MPI_DIR"/lib/openmpi3/*.so "$PMIX_DIR"/lib/pmix/*.so; do
    deps=$(ldd "$f")  # (not piped into grep -q, whose early exit would fail the pipe)
    grep -Eq "$RDMA_LIBS" <<<"$deps" || echo "${f#/}"
  done
  (cd / && find usr/share/openmpi etc/openmpi "${PMIX_DIR#/}/share" \( -type f -o -type l \))
  echo usr/bin/orted
  echo usr/bin/orterun
  echo usr/bin/ompi_info
} | sort -u >"$mpi_files"
# --dereference: links become files, so unpacking never writes through a link out of the folder.
pack --dereference -C / -T "$mpi_files" >"$new/openmpi.tar.xz"

# Their shared libraries, and the binaries': ldd lists the transitive closure.
{
  ldd $stage/bin/*
  sed 's|^|/|' "$mpi_files" | grep -E '\.so$|/usr/bin/' | xargs ldd 2>/dev/null || true
} | awk '/=> \//{print $1, $3}' | sort -u | while read -r name path; do
  if ! [[ $name =~ $SYSTEM_LIBS ]]; then cp -L "$path" "$stage/lib/$name"; fi
done
if ls $stage/lib | grep -Eq "$RDMA_LIBS"; then
  echo "gpu_bundle: an RDMA library was pulled in: $(ls $stage/lib | grep -E "$RDMA_LIBS")"
  exit 1
fi
rm -f "$mpi_files"

pack -C $stage lib >"$new/lib.tar.xz"
if [ "$MPI_ONLY" = 1 ]; then
  rm -rf $stage "$OUT_DIR"
  mkdir -p "$(dirname "$OUT_DIR")"
  mv "$new" "$OUT_DIR"
  echo "gpu_bundle: $OUT_DIR: $(ls "$OUT_DIR" | tr '\n' ' ')"
  exit 0
fi
pack -C $stage bin >"$new/bin.tar.xz"
# What the GPU machine must provide: the libraries the binaries and the bundled ones load that
# are neither bundled nor the C/C++ runtime (cuBLAS, NCCL).
for f in $stage/bin/* $stage/lib/*; do readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; done |
  sort -u | while read -r name; do
    [ -e "$stage/lib/$name" ] ||
      [[ $name =~ ^(ld-linux.*|libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s)\.so ]] || echo "$name"
  done >"$new/NEEDED.txt"
# The sources the binaries come from, as the checkout beside the bundle must still have them.
git ls-files -- '*.cu' '*.cuh' '*.cpp' '*.h' Makefile | xargs sha256sum >"$new/SOURCES.sha256"
# The corpus as train reads it by default: files without a '.' in the name, sorted by name.
(cd /usr/share/games/fortunes && find -L . -maxdepth 1 -type f ! -name '*.*' -printf '%f\n' |
  LC_ALL=C sort | xargs cat) | gzip >"$new/corpus.txt.gz"
rm -rf $stage

# ---- check: unpack into a temporary root and resolve every dependency there ----
mkdir -p "$check/root"
tar -xJf "$new/bin.tar.xz" -C "$check"
tar -xJf "$new/lib.tar.xz" -C "$check"
tar -xJf "$new/openmpi.tar.xz" -C "$check/root"
for need in usr/bin/orted usr/bin/orterun etc/openmpi/openmpi-mca-params.conf \
            usr/share/openmpi/help-mpi-runtime.txt "${MPI_DIR#/}/lib/openmpi3/mca_ess_singleton.so" \
            "${MPI_DIR#/}/lib/openmpi3/mca_pml_ob1.so" "${MPI_DIR#/}/lib/openmpi3/mca_btl_vader.so" \
            "${MPI_DIR#/}/lib/openmpi3/mca_pmix_ext3x.so" "${MPI_DIR#/}/lib/openmpi3/mca_plm_isolated.so"; do
  [ -e "$check/root/$need" ] || { echo "gpu_bundle: openmpi.tar.xz lacks /$need"; exit 1; }
done
problems=0
for f in "$check"/bin/* "$check"/lib/* "$check"/root/usr/bin/* \
         "$check/root${MPI_DIR}"/lib/openmpi3/*.so "$check/root${PMIX_DIR}"/lib/pmix/*.so; do
  # env -i: only the bundle's library path, as gpu_check.sh sets it (the system's own copies
  # cannot be hidden here, so each resolved library is checked by name and place instead).
  while read -r name arrow path _; do
    if [[ $name =~ $SYSTEM_LIBS ]]; then
      :  # found on the GPU machine
    elif [ "$path" = "not" ]; then
      echo "gpu_bundle: ${f#$check/} needs $name: not found"; problems=$((problems + 1))
    elif [ -e "$check/lib/$name" ] || [ -e "$check/root$path" ]; then
      :  # bundled: in lib/, or in the OpenMPI tree at the same absolute path
    else
      echo "gpu_bundle: ${f#$check/} needs $name ($path), which is not in the bundle"
      problems=$((problems + 1))
    fi
  done < <(env -i LD_LIBRARY_PATH="$check/lib" ldd "$f" 2>/dev/null | awk '$2 == "=>" {print}')
done
[ "$problems" -eq 0 ] || { echo "gpu_bundle: $problems unresolved libraries"; exit 1; }

{
  echo "picoscale GPU bundle, made $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname)"
  echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
  echo "nvcc: $(nvcc --version | grep -o 'release [0-9.]*, V[0-9.]*')"
  echo "flags: $(cat build/flags.txt)"
  echo "glibc needed: up to $(for f in "$check"/bin/* "$check"/lib/*; do objdump -T "$f" 2>/dev/null; done |
                              grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2 -n -u | tail -1)"
  echo "binaries: $BINARIES"
  echo "libraries: $(ls "$check/lib" | tr '\n' ' ')"
  echo "from the GPU machine: $(tr '\n' ' ' <"$new/NEEDED.txt")"
} >"$new/MANIFEST.txt"
cat "$new/MANIFEST.txt"
mib=$(( ($(du -sb "$new" | cut -f1) + 1048575) / 1048576 ))
du -sh "$new"/*
echo "gpu_bundle: ${mib} MiB in all (limit ${MAX_MIB}: 64 less the checkout's tracked files and 4 to spare); every dependency resolves"
[ "$mib" -le "$MAX_MIB" ] || { echo "gpu_bundle: larger than ${MAX_MIB} MiB: not made"; exit 1; }
rm -rf "$OUT_DIR"
mv "$new" "$OUT_DIR"
echo "gpu_bundle: made $OUT_DIR"
