// gpu_ranks.cuh: what an MPI test needs before a [gpu] case. Every rank must agree to run it
// (a case that runs on some ranks only leaves the others waiting in its collectives), and each
// rank uses its node-local GPU, as train.cu does (DESIGN 3).
#pragma once
#include "../cuda_case.cuh"
#include "runtime/comm.cuh"

// True on every rank when every rank sees a CUDA device, else false on every rank (`why`: this
// rank's reason, when it has one).
inline bool cuda_on_every_rank(std::string* why = nullptr) {
  int here = cuda_available(why), everywhere = 0;
  MPI_Allreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return everywhere;
}
// A rank's GPU is its node-local rank modulo the node's GPU count: ranks may share one.
inline void use_node_local_gpu() {
  int node_rank = 0, node_ranks = 1, gpus = 1;
  local_rank(&node_rank, &node_ranks, 60);
  CUDA_CHECK(cudaGetDeviceCount(&gpus));
  CUDA_CHECK(cudaSetDevice(node_rank % gpus));
}
// The start of every [gpu] case: false (a visible SKIP on every rank, or a failure where
// nvidia-smi lists a GPU that CUDA cannot start: cuda_case.cuh) unless every rank
// has a GPU; otherwise each rank is on its node-local GPU. Include after catch.hpp.
inline bool gpu_case_ready() {
  std::string why = "another rank has none";
  bool everywhere = cuda_on_every_rank(&why);
  if (!cuda_case_ready(everywhere, why)) return false;  // a SKIP, or a failure (cuda_case.cuh)
  use_node_local_gpu();
  return true;
}
