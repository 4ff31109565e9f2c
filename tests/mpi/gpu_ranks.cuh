// gpu_ranks.cuh: what an MPI test needs before a [gpu] case. Every rank must agree to run it
// (a case that runs on some ranks only leaves the others waiting in its collectives), and each
// rank uses its node-local GPU, as train.cu does (DESIGN 3).
#pragma once
#include "comm.cuh"

// True on every rank when every rank sees a CUDA device, else false on every rank.
inline bool cuda_on_every_rank() {
  int here = cuda_available(), everywhere = 0;
  MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return everywhere;
}
// A rank's GPU is its node-local rank modulo the node's GPU count: ranks may share one.
inline void use_node_local_gpu() {
  int node_rank = 0, node_ranks = 1, gpus = 1;
  local_rank(&node_rank, &node_ranks);
  CUDA_CHECK(cudaGetDeviceCount(&gpus));
  CUDA_CHECK(cudaSetDevice(node_rank % gpus));
}
// The start of every [gpu] case: false (with a visible SKIP on every rank) unless every rank
// has a GPU; otherwise each rank is on its node-local GPU. Include after catch.hpp.
inline bool gpu_case_ready() {
  if (!cuda_on_every_rank()) {
    WARN("SKIP: no CUDA device");
    return false;
  }
  use_node_local_gpu();
  return true;
}
