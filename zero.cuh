// zero.cuh: ZeRO-1/2/3, the Zero Redundancy Optimizer (Playbook §4): the optimizer states, then
// the gradients, then the weights, split over the dp_cp group instead of replicated on every rank.
#pragma once
#include <string>
#include <vector>

#include "mixed_precision.cuh"
#include "runtime/comm.cuh"
#include "runtime/formulas.cuh"
#include "runtime/gradient_sync.cuh"

namespace CLI {
class App;
}

// ---- Flags (Playbook §4) ----
struct ZeroOptions {
  int zero = 0;  // --zero: 0 (off), 1, 2 or 3
};
void add_zero_flags(CLI::App& app, ZeroOptions& o);

// ---- The shards (Playbook §4.2) ----
// How the flat parameter vector is split over N ranks. Each unit (embedding, block, head) is
// split on its own, as FSDP splits each wrapped module's flat parameter, so that ZeRO-3 gathers
// a block with one all-gather: rank r owns elements [r S_u, (r+1) S_u) of unit u, S_u =
// ceil(numel_u / N); the slice of the last rank(s) runs past the unit's end into zero padding.
// Expert units (ModelUnit::experts) split over their own group (edp_cp): N and r are theirs.
struct ShardLayout {
  int ranks = 1, rank = 0;  // the group of the other units (dp_cp)
  struct Unit {
    int ranks = 1, rank = 0;        // N and r of the unit's group
    int64_t offset = 0, numel = 0;  // the unit's slice of the flat (unpadded) parameter vector
    int64_t shard = 0;              // S_u: elements per rank, padding included
    int64_t shard_offset = 0;       // where the unit starts in each rank's shard buffers
    int64_t padded_offset = 0;      // where it starts in a full padded buffer (N_u S_u each)
    int64_t valid = 0;              // elements of this rank's shard that are parameters
    int64_t first() const { return rank * shard; }  // this rank's first element, unit-relative
  };
  std::vector<Unit> units;  // the model's units, in order
  int64_t shard_numel = 0;  // sum of S_u: the size of every shard buffer, on every rank
  int64_t padded = 0;       // sum of N_u S_u: Psi', Psi plus the padding
  int64_t padded_numel() const { return padded; }
};
// `ranks`, `rank`: dp_cp's; `expert_ranks`, `expert_rank`: edp_cp's (default: the same).
ShardLayout make_shard_layout(const FlatParameters& model, int ranks, int rank,
                              int expert_ranks = 0, int expert_rank = 0);

// One rank's part of ZeRO training as a GradientSync: the shard buffers, the hooks that gather
// and reduce-scatter around each unit, AdamW on the shard, and its part of whole checkpoints.
class Zero : public GradientSync {
 public:
  // `model` comes from build_model_layout (it holds no memory yet). Allocates what `stage` keeps
  // (see zero.cu), binds the model's views, and initialises this rank's part from `seed`.
  // overlap false: every collective is waited for when issued (no prefetch, no overlap).
  // weight_format BF16 or F16 (mixed precision): the fp32 master weights are sharded with Adam's
  // moments and the weights are gathered in that format; stages 1-2 keep the whole weights in
  // it only (the book's 2Ψ + 4Ψ + 12Ψ/N for ZeRO-1), stage 3 a copy of its shard.
  // grad_dtype BF16 (--grad-acc-dtype bf16): the gradient buffers and shards in bf16, each
  // unit summed in fp32 while its backward runs, reduce-scattered in bf16.
  Zero(Comm& comm, FlatParameters& model, int stage, const AdamWConfig& hp, float weight_decay,
       uint64_t seed, bool overlap, const PrecisionPolicy& precision = {});
  int stage() const { return stage_; }
  const ShardLayout& layout() const { return layout_; }

  // ---- one training step (GradientSync) ----
  void begin_step(const Context& ctx) override;  // zeroes the gradients
  // Stage 1 reduce-scatters on the last micro-batch only; stages 2 and 3 on every one,
  // accumulating into the gradient shard; stage 3 gathers weights around each unit.
  UnitHooks hooks(const Context& ctx, bool last_micro_batch) override;
  double finish(const Context& ctx) override;  // waits for every reduce-scatter
  // AdamW on this rank's shard; stages 1 and 2 then all-gather the weights.
  void step(const Context& ctx, float lr) override;
  // Stage 3 gathers every unit for evaluation (FSDP's summon_full_params).
  void gather_weights(const Context& ctx) override;
  void release_weights() override;

  // ---- measurements ----
  int zero_stage() const override { return stage_; }
  std::string describe() const override;  // "ZeRO-3: reduce-scatter per unit, overlapped, ..."
  int64_t padded_params() const override { return layout_.padded_numel(); }
  int64_t master_bytes() const override {
    return weight_format_ != DType::F32 ? (int64_t)param_shard_.nbytes() : 0;
  }
  // The ZeRO table (runtime/report.cu): `measured`, dp_cp's traffic over `steps` steps.
  void print_comm_report(int grad_acc, const CollStats* measured, int64_t steps) const override;
  // This step's host time blocked on ZeRO's all-gathers and on its reduce-scatters (the
  // collectives' spans go to the trace: trace_communication).
  double exposed_gather_s = 0, exposed_reduce_s = 0;
  ZeroTraffic expected_traffic(int grad_acc) const;  // per step (runtime/formulas.cu)

 protected:
  std::vector<Holding> holdings(Part part) const override;
  void scale_grads(const Context& ctx, float alpha) override;
  bool grads_sharded() const override { return true; }

 private:
  struct UnitState {
    Tensor params, grads;  // transient full-unit buffers [N * S_u] (Mem::Workspace)
    Tensor wire;           // the unit's gradient as reduce-scattered (bf16: rounded)
    bool gathering = false, resident = false, reducing = false;
    Handle gather, reduce;
    double gather_start = 0, reduce_start = 0;
  };
  const ShardLayout::Unit& unit(int u) const { return layout_.units[u]; }
  Tensor full(const Tensor& padded, int u) const;   // unit u in a padded buffer [N x S_u]
  Tensor whole(const Tensor& padded, int u) const;  // its parameters [numel]
  Tensor slice(const Tensor& padded, int u) const;  // this rank's slice of it [S_u]
  Tensor mine(const Tensor& shard, int u) const;    // unit u's part of a shard buffer [S_u]
  Tensor master(int u) const;                       // what AdamW updates of unit u [S_u], fp32
  Tensor grads_of(int u) const;  // this rank's slice of unit u's gradient [S_u], fp32 or bf16
  void before_forward(int u);
  void after_forward(int u);
  void before_backward(int u);
  void after_backward(int u, bool last_micro_batch);
  void launch_gather(int u);
  void gather_unit(int u);
  void release_unit(int u);
  void acquire_grads(int u);
  void reduce_unit(int u);
  void complete_reduce(int u);
  void progress();

  int stage_;
  bool shard_grads_, shard_weights_;  // stages 2-3, stage 3
  bool overlap_;
  DType weight_format_;            // of model.params under stages 1-2 (F32 unless mixed precision)
  Bf16Accumulators accumulators_;  // stage 1 with bf16 gradients
  ShardLayout layout_;
  Tensor param_shard_,
      grad_shard_;               // [S] stage 3 (or mixed precision) weights, stages 2-3 gradients
  Tensor compute_shard_;         // [S] stage 3 under mixed precision: param_shard_ rounded
  Tensor exp_avg_, exp_avg_sq_;  // [S] Adam m and v
  std::vector<UnitState> units_;
  const Context* ctx_ = nullptr;
};
