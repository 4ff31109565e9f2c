// timing.cuh: how the benchmarks time a piece of work.
#pragma once

#include <algorithm>

#include "runtime/core.cuh"

// The best time of `fn` in seconds, each run timed from an idle device to an idle device: one
// warm-up run, then up to `reps` timed runs, stopping early once `budget_s` seconds are spent.
template <class F>
double best_seconds(const Context& ctx, int reps, double budget_s, F fn) {
  fn();
  ctx.synchronize();
  double best = 1e30, spent = 0.0;
  for (int rep = 0; rep < reps && spent < budget_s; rep++) {
    double t0 = now_seconds();
    fn();
    ctx.synchronize();
    double t = now_seconds() - t0;
    best = std::min(best, t);
    spent += t;
  }
  return best;
}
