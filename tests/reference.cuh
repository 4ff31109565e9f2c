// reference.cuh: what the [reference] tests (one process and MPI) compute independently of the
// code under test: inputs from the counter-based RNG, and the float64 cross-entropy.
#pragma once
#include <cmath>
#include <string>
#include <vector>

#include "runtime/core.cuh"

// Element i: mean + std * N(0,1) of the stream `name` (the same on every rank that asks).
inline std::vector<float> reference_normal(int64_t n, const std::string& name, double mean = 0,
                                           double std = 1) {
  uint64_t key = rng_key(11, name);
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; i++) v[i] = (float)(mean + std * rng_normal(key, i));
  return v;
}
// log(sum_v exp(row[v])) in float64, shifted by the row's maximum.
inline double logsumexp64(const float* row, int V) {
  double m = -INFINITY, s = 0;
  for (int v = 0; v < V; v++) m = std::max(m, (double)row[v]);
  for (int v = 0; v < V; v++) s += std::exp(row[v] - m);
  return m + std::log(s);
}
// What an fp32 loss lse - logit may be off by: both terms are up to |lse| in size, so a few ulp
// of |lse| (8 u |lse| = 4 ulp), plus 1e-5 for the sum of exponentials' rounding in the log.
inline double ce_loss_tolerance(double lse) {
  return 8 * 0x1p-24 * std::abs(lse) + 1e-5;
}
