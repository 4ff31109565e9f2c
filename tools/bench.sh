#!/usr/bin/env bash
# `make bench`: the single-process step benchmark; collectives, data-parallel and ZeRO steps
# under mpirun on 2 and 4 ranks; tensor parallelism on 4 ranks; naive against flash attention.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMPI_MCA_btl_vader_single_copy_mechanism=none
build/bench
mpirun --oversubscribe -np 2 build/bench_comm
mpirun --oversubscribe -np 4 build/bench_comm --bandwidth-only
mpirun --oversubscribe -np 4 build/bench_comm --zero-only
mpirun --oversubscribe -np 4 build/bench_tp
build/bench_attention
