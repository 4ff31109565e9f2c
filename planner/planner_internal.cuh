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
    int global = 0;  // this chunk's index among the pipeline's p x V chunks
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> unit_numel;
  int64_t num_params = 0;
  int64_t padded(int N) const {
    int64_t total = 0;
    for (int64_t n : unit_numel) total += N * ((n + N - 1) / N);
    return total;
  }
};
// Remembered: a search asks for the same few stages many times (memory.cu).
const StageShape& stage_shape(const ModelConfig& cfg, const Layout& l, int stage);

// MFU's peak: the format's, fp8 counted against bf16 (its attention and the rest run in bf16).
double mfu_peak(const GpuProfile& g, Precision p);
