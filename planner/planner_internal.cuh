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

// sum += b - a, row by row: what the ledger counted between two of its readings (roofline.cu's
// steps, compute.cu's passes).
inline void add_difference(LedgerRow& sum, const LedgerRow& a, const LedgerRow& b) {
  sum.calls += b.calls - a.calls;
  sum.launches += b.launches - a.launches;
  sum.flops += b.flops - a.flops;
  sum.read += b.read - a.read;
  sum.written += b.written - a.written;
  sum.predicted_s += b.predicted_s - a.predicted_s;
  sum.measured_s += b.measured_s - a.measured_s;
}

// MFU's peak: the format's, fp8 counted against bf16 (its attention and the rest run in bf16).
double mfu_peak(const GpuProfile& g, Precision p);

// One micro-batch on a rank of layout `l`, priced on `gpu`'s roofline from the ledger of the
// model's own forward and backward on the meta device (compute.cu), in seconds.
struct MicroBatchCost {
  double block_fwd = 0, block_bwd = 0;         // one block (backward: recomputation and W in it)
  double block_gemm = 0, block_attention = 0;  // of block_fwd: its GEMMs, its attention core
  double block_weights = 0;                    // of block_bwd: the deferred W (under `split`)
  double block_recompute = 0;                  // of block_bwd: what recomputation adds
  double rest_fwd = 0, rest_bwd = 0;  // the embedding, final norm, head and loss, forward, backward
  double rest_weights = 0;            // of rest_bwd: the deferred W (under `split`)
  // Once a step, over parameters held whole (unsharded): the gradients zeroed, their norm and
  // AdamW, for one block's and for the rest's (the embedding and, untied, the head).
  double block_step = 0, rest_step = 0;
};
// `split`: a zero-bubble table, whose backward leaves the weight gradients to a W op.
const MicroBatchCost& micro_batch_cost(const ModelConfig& cfg, const Layout& l,
                                       const GpuProfile& gpu, bool split);
