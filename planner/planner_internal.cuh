// planner_internal.cuh: what the planner's files share (planner/*.cu): a pipeline rank's part
// of the model as the planner sees it, and MFU's peak.
#pragma once
#include <cstdint>
#include <vector>

#include "planner/planner.cuh"

constexpr double kGiB = 1024.0 * 1024 * 1024;

// What a pipeline rank holds (its chunks' blocks, embedding, head) and its units' sizes on one
// tensor-parallel rank: build_model_layout's own layout, which allocates nothing.
struct StageShape {
  struct Chunk {
    int blocks = 0;
    bool embedding = false, head = false;
    // Whether its input comes from another rank, and its output goes to one: not at the
    // model's ends, nor between consecutive chunks on one rank (stage_placement).
    bool receives = false, sends = false;
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> unit_numel;
  std::vector<bool> unit_experts;  // a mixture's experts: sharded over N / ep ranks (edp_cp)
  int ep = 1;
  int64_t num_params = 0;
  // Ψ' of the units over ZeRO's groups of N (dp_cp) and N / ep (edp_cp), `experts`: those only
  // (1), the others (0), or all (-1).
  int64_t padded(int N, int experts = -1) const {
    int64_t total = 0;
    for (size_t u = 0; u < unit_numel.size(); u++) {
      if (experts >= 0 && unit_experts[u] != (experts == 1)) continue;
      const int64_t n = unit_numel[u], R = unit_experts[u] ? N / ep : N;
      total += R * ((n + R - 1) / R);
    }
    return total;
  }
  int64_t expert_params() const {
    int64_t total = 0;
    for (size_t u = 0; u < unit_numel.size(); u++) total += unit_experts[u] ? unit_numel[u] : 0;
    return total;
  }
};
// Remembered: a search asks for the same few stages many times (memory.cu).
const StageShape& stage_shape(const ModelConfig& cfg, const Layout& l, int stage);

// MFU's peak: the format's, fp8 counted against bf16 (its attention and the rest run in bf16).
double mfu_peak(const GpuProfile& g, Precision p);
