// zero.cuh: ZeRO-1/2/3, the Zero Redundancy Optimizer (Playbook §4): the optimizer states, then
// the gradients, then the weights, split over the dp_cp group instead of replicated on every rank.
#pragma once
#include <string>
#include <vector>

#include "comm.cuh"
#include "model.cuh"
#include "ops.cuh"

int parse_zero_stage(int flag);  // 0 (off), 1, 2 or 3; else UsageError naming --zero

// How the flat parameter vector is split over N ranks. Each unit (embedding, block, head) is
// split on its own, as FSDP splits each wrapped module's flat parameter, so that ZeRO-3 gathers a
// block with one all-gather: rank r owns elements [r*S_u, (r+1)*S_u) of unit u, S_u =
// ceil(numel_u / N); the slice of the last rank(s) runs past the unit's end into zero padding.
struct ShardLayout {
  int ranks = 1, rank = 0;
  struct Unit {
    int64_t offset = 0, numel = 0;  // the unit's slice of the flat (unpadded) parameter vector
    int64_t shard = 0;              // S_u: elements per rank, padding included
    int64_t shard_offset = 0;       // where the unit starts in each rank's shard buffers
    int64_t padded_offset = 0;      // where it starts in a full padded buffer: ranks * shard_offset
    int64_t valid = 0;              // elements of this rank's shard that are parameters
  };
  std::vector<Unit> units;  // the model's units, in order
  int64_t shard_numel = 0;  // sum of S_u: the size of every shard buffer, on every rank
  int64_t padded_numel() const { return ranks * shard_numel; }  // Psi': Psi plus the padding
};
ShardLayout make_shard_layout(const Model& model, int ranks, int rank);

// Bytes per parameter of each category. fp32 training: 4 (weights), 4 (gradients), 8 (Adam m, v).
// The book's mixed-precision figures use 2, 2 and k = 12 (fp32 master weights, m and v).
struct BytesPerParameter {
  double params = 4, grads = 4, optimizer = 8;
};
struct StaticMemory {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Playbook §4.1, bytes per rank for psi parameters at ZeRO stage 0..3 over `ranks` ranks.
StaticMemory zero_static_memory(int stage, double psi, int ranks, BytesPerParameter bytes = {});
const char* zero_memory_formula(int stage);  // fp32: "4Ψ + 4Ψ + 8Ψ/N" for stage 1, ...

// Collective calls and bytes this rank sends over dp_cp in one training step.
struct ZeroTraffic {
  int64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;
  int64_t all_gather_calls = 0, all_gather_bytes = 0;
};

// One rank's part of ZeRO training: the shard buffers, the hooks that gather and reduce-scatter
// around each unit, clipping from the shards, AdamW on the shard, and whole-tensor checkpoints.
// train.cu calls it where plain data parallelism calls DataParallel and optimizer_step.
class Zero {
 public:
  // `model` comes from build_model_layout (it holds no memory yet). Allocates what `stage` keeps
  // (see zero.cu), binds the model's views, and initialises this rank's part from `seed`.
  // overlap false: every collective is waited for when issued (no prefetch, no overlap).
  Zero(Comm& comm, Model& model, int stage, const AdamWConfig& hp, float weight_decay,
       uint64_t seed, bool overlap);
  int stage() const { return stage_; }
  const Model& model() const { return model_; }
  const ShardLayout& layout() const { return layout_; }

  // ---- one training step, in this order ----
  void begin_step(const Context& ctx);  // zeroes the gradients
  // For model_forward and model_backward of one micro-batch. Stage 1 reduce-scatters on the last
  // micro-batch only; stages 2 and 3 on every one, accumulating into the gradient shard.
  UnitHooks hooks(const Context& ctx, bool last_micro_batch);
  double finish_gradients(const Context& ctx);  // waits for every reduce-scatter; seconds blocked
  // The global L2 norm from every rank's shard (padding excluded) and the same rescale as
  // clip_grad_norm, on the shard.
  float clip_grad_norm(const Context& ctx, float max_norm);
  // AdamW on this rank's shard; stages 1 and 2 then all-gather the weights.
  void step(const Context& ctx, float lr);

  // ---- the whole model for evaluation and sampling: stage 3 gathers every unit (collective) ----
  void gather_all(const Context& ctx);
  void release_all();

  // ---- checkpoints hold whole tensors, exactly as an unsharded run writes them ----
  // Collective: the shards are gathered to world rank 0, which writes.
  void save(const Context& ctx, const std::string& dir);
  void save_gradients(const Context& ctx, const std::string& path, int64_t step);
  // Every rank reads the whole files and keeps its shard, so any dp and stage can resume any
  // other. Returns the optimizer step (0 when the directory has no optimizer state).
  int64_t load(const std::string& dir);

  // ---- measurements ----
  struct Span {
    std::string name;
    double start, end;  // host times, launch to completion observed
  };
  std::vector<Span> spans;  // this step's collectives, for --trace
  // This step's host time blocked on ZeRO's all-gathers and on its reduce-scatters.
  double exposed_gather_s = 0, exposed_reduce_s = 0;
  ZeroTraffic measured_traffic() const;  // summed over every step so far (training steps only)
  int64_t steps_measured = 0;
  ZeroTraffic expected_traffic(int grad_acc) const;  // per step, by the rules in zero.cu
  // Units whose weights hook index i reads, in forward or backward (see zero.cu).
  std::vector<int> weights_read(int i, bool backward) const;

 private:
  enum class Part { Params, Grads, ExpAvg, ExpAvgSq };
  struct UnitState {
    Tensor params, grads;  // transient full-unit buffers [N * S_u] (Mem::Workspace)
    bool gathering = false, resident = false, reducing = false;
    Handle gather, reduce;
    double gather_start = 0, reduce_start = 0;
  };
  struct Piece {  // a run of this rank's shard inside one parameter
    int unit;
    int64_t begin, count;  // within the unit's shard
    bool decay;            // matrices only
    bool counted;          // counts in the gradient norm (one copy of a tp-replicated weight)
  };
  float* shard(Part part, int u) const;
  Tensor shard_view(Part part, int u, int64_t count) const;
  std::string unit_name(int u) const;
  void before_forward(int i);
  void after_forward(int i);
  void before_backward(int i);
  void after_backward(int i);
  void launch_gather(int u);
  void gather_unit(int u);
  void release_unit(int u);
  void acquire_grads(int u);
  void reduce_unit(int u);
  void complete_reduce(int u);
  void progress();
  void count_traffic_since(const CollStats* before);
  Tensor gather_whole(const Context& ctx, Part part);

  Comm& comm_;
  Model& model_;
  int stage_;
  bool overlap_;
  AdamWConfig hp_;
  float weight_decay_;
  int64_t step_ = 0;
  ShardLayout layout_;
  Tensor param_shard_, grad_shard_;  // [S] stage 3 weights, stages 2-3 gradients
  Tensor exp_avg_, exp_avg_sq_;      // [S] Adam m and v
  std::vector<Piece> pieces_;
  std::vector<UnitState> units_;
  const Context* ctx_ = nullptr;
  bool last_micro_batch_ = true;
  CollStats window_[(int)Coll::Count];  // dp_cp counters when the current traffic window opened
  CollStats traffic_[(int)Coll::Count];
};
