#!/usr/bin/env bash
# gpu_unpack.sh BUNDLE WORK: unpacks a bundle made by tools/gpu_bundle.sh under WORK, and only
# there, then writes WORK/env.sh, the environment that runs the bundled binaries and OpenMPI.
#
# The GPU image may carry its own MPI (its Python has mpi4py). Unpacking our OpenMPI over / would
# mix two versions' plugins and config, so the tree goes to a private prefix, WORK/openmpi, at
# the paths it was built for below that folder (usr/..., etc/openmpi), and OpenMPI is told
# where it moved: OPAL_PREFIX relocates every directory configured under the prefix /usr (bin,
# lib/.../openmpi3 plugins, share/openmpi help texts; `ompi_info --path all` shows them), and
# OPAL_SYSCONFDIR the one that is not (/etc/openmpi). PMIx, a library of its own with its own
# prefix, is moved by PMIX_PREFIX (and its plugin folder named outright). PATH and
# LD_LIBRARY_PATH put the bundle's mpirun, orted and libraries before any of the image's.
#   WORK/root   what the steps run in: train and build/{unit_tests,mpi_tests,...,device_info}
#   WORK/lib    the shared libraries the bundle carries
#   WORK/openmpi  the OpenMPI and PMIx trees; WORK/corpus.txt the default corpus as one file
set -euo pipefail
bundle=$(cd "$1" && pwd)
mkdir -p "$2"
work=$(cd "$2" && pwd)
MPI_DIR=usr/lib/x86_64-linux-gnu/openmpi  # Debian's layout, where gpu_bundle.sh took them from
PMIX_DIR=usr/lib/x86_64-linux-gnu/pmix2

cat "$bundle/MANIFEST.txt" 2>/dev/null || true
rm -rf "$work/openmpi" "$work/lib" "$work/root"
mkdir -p "$work/openmpi" "$work/root/build"
# --no-same-owner, no --absolute-names: members land below the folder given, as the caller.
# tar reads xz through the xz program; an image without it unpacks through Python's tarfile.
untar() {
  if command -v xz >/dev/null; then tar -xJf "$1" --no-same-owner -C "$2"
  else python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$1" "$2"; fi
}
untar "$bundle/openmpi.tar.xz" "$work/openmpi"
untar "$bundle/lib.tar.xz" "$work"
if [ -f "$bundle/bin.tar.xz" ]; then
  untar "$bundle/bin.tar.xz" "$work/root"
  mv "$work/root/bin/train" "$work/root/"
  mv "$work/root/bin/"* "$work/root/build/"
  rmdir "$work/root/bin"
fi
[ -f "$bundle/corpus.txt.gz" ] && gunzip -c "$bundle/corpus.txt.gz" >"$work/corpus.txt"
# A link out of the folder would let a later member be written through it.
outside=$(find "$work/openmpi" "$work/lib" -type l -lname '/*' | head -3)
[ -z "$outside" ] || { echo "gpu_unpack: absolute links in the bundle: $outside"; exit 1; }

prefix=$work/openmpi/usr
ln -sf orterun "$prefix/bin/mpirun"  # (Debian's mpirun is a link to orterun via alternatives)
cat >"$work/env.sh" <<ENV
# Written by tools/gpu_unpack.sh: the bundle's OpenMPI at its private prefix.
unset \$(env | grep -o '^OMPI_MCA_[A-Za-z0-9_]*') \$(env | grep -o '^OPAL_[A-Z]*') \$(env | grep -o '^PMIX_[A-Z_]*') 2>/dev/null
export OPAL_PREFIX=$prefix
export OPAL_SYSCONFDIR=$work/openmpi/etc/openmpi
export PMIX_PREFIX=$work/openmpi/$PMIX_DIR
export PMIX_MCA_mca_base_component_path=$work/openmpi/$PMIX_DIR/lib/pmix
export OMPI_MCA_mca_base_component_path=$work/openmpi/$MPI_DIR/lib/openmpi3
export PATH=$prefix/bin:\$PATH
export LD_LIBRARY_PATH=$work/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
ENV
echo "gpu_unpack: OpenMPI at $prefix, libraries in $work/lib, environment in $work/env.sh"
