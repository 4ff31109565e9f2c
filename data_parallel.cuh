// data_parallel.cuh: gradient synchronisation over the dp_cp group (Playbook §3): one
// all-reduce per parameter (naive), bucketed all-reduces launched during the backward pass
// (bucket), or the same buckets on our own ring all-reduce (ring).
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "mixed_precision.cuh"
#include "runtime/comm.cuh"
#include "runtime/gradient_sync.cuh"

namespace CLI {
class App;
}

enum class DpSync { Naive, Bucket, Ring };
DpSync parse_dp_sync(const std::string& flag);  // naive|bucket|ring
const char* dp_sync_name(DpSync s);

// ---- Flags (Playbook §3) ----
struct DataParallelOptions {
  int dp = 1;                       // --dp: data-parallel ranks
  DpSync dp_sync = DpSync::Bucket;  // --dp-sync
  double bucket_mb = 25;            // --bucket-mb
  bool no_overlap = false;          // --no-overlap (ZeRO's collectives too)
};
void add_data_parallel_flags(CLI::App& app, DataParallelOptions& o);
// UsageError naming the flags: --dp or --bucket-mb out of range, the ring with bf16 gradients.
void validate_data_parallel(const DataParallelOptions& o, DType grad_dtype);

// The ring all-reduce of the NCCL article: N-1 reduce-scatter steps, then N-1 all-gather
// steps, each a send to the next rank and a receive from the previous one; any N, any count.
// Nonblocking: start() posts the first step, progress() advances without blocking, wait()
// finishes. `scratch` holds at least ceil(count / N) floats (scratch_size).
class RingAllReduce {
 public:
  void start(Comm& comm, Group& group, const Context& ctx, float* buf, int64_t count,
             float* scratch);
  bool progress();  // true once done
  void wait();
  bool active() const { return comm_ != nullptr && step_ < total_steps(); }
  static int64_t scratch_size(int64_t count, int N) { return count / std::max(1, N) + 1; }

 private:
  int total_steps() const { return 2 * (group_ ? group_->size - 1 : 0); }
  void post_step();
  void finish_step();
  int64_t chunk_begin(int c) const { return count_ * c / group_->size; }
  int64_t chunk_size(int c) const { return chunk_begin(c + 1) - chunk_begin(c); }
  Comm* comm_ = nullptr;
  Group* group_ = nullptr;
  float* buf_ = nullptr;
  float* scratch_ = nullptr;
  int64_t count_ = 0;
  int step_ = 0;  // steps finished
  Handle pending_;
};
void ring_all_reduce(Comm& comm, Group& group, const Context& ctx, float* buf, int64_t count);

struct GradBucket {
  int64_t offset = 0, count = 0;  // a contiguous slice of the flat gradient buffer
  int params = 0, ready = 0;      // parameters in it, and how many are final
  Group* group = nullptr;         // summed over: dp_cp, or edp_cp for experts (never both)
  bool launched = false;
  double launch_time = 0;
};

// How the buckets are summed over the group (a strategy; --dp-sync chooses): naive (each
// parameter its own bucket, summed one after the other once the backward is done), bucket (the
// library's all-reduce, launched as each bucket completes) or ring (our RingAllReduce). A new
// way to sum (a tree, say) is one more class and one more row in data_parallel.cu.
class BucketReducer {
 public:
  virtual ~BucketReducer() = default;
  virtual bool per_parameter() const { return false; }  // buckets of one parameter each
  virtual bool overlaps() const { return true; }        // may launch during the backward
  // Starts the sum of `grads` over `group` (the bucket's slice: fp32, or bf16 when the reducer
  // allows it).
  virtual void launch(const Context& ctx, Group& group, const Tensor& grads) = 0;
  virtual void progress() {}  // MPI advances only inside MPI calls: at every hook
  // Every launched bucket summed, the compute stream ordered after them; ready for the next step.
  virtual void wait(const Context& ctx) = 0;
};

// Plain data parallelism as a GradientSync: every rank holds every weight, gradient and Adam
// moment (16 bytes per parameter in fp32); the gradients are summed over dp_cp.
// Gradients in bf16 (--grad-acc-dtype bf16, Playbook §Mixed precision training: 2 bytes per
// parameter instead of 4): the flat gradient buffer is bf16; each unit's backward accumulates
// in an fp32 buffer of its own (the bf16 sum so far, widened), rounded back into the buffer when
// the unit is done; the buckets are all-reduced in bf16; the optimizer widens each parameter's
// gradient as it updates it.
class DataParallel : public GradientSync {
 public:
  // Allocates and initialises the weights of `model` (a layout) from `seed`, its gradients (in
  // the policy's gradient dtype: F32 or BF16) and AdamW's moments; under mixed precision the
  // weights' copy in the compute format too, which GEMMs read (registered in ctx), refreshed
  // after every optimizer step. From the flags `o`: the reducer (--dp-sync; ring sums fp32
  // only), the bucket capacity (--bucket-mb) and whether buckets launch during the backward
  // (--no-overlap: after it). The flags come whole, so that a new one reaches the reducers.
  DataParallel(Comm& comm, FlatParameters& model, Context& ctx, const DataParallelOptions& o,
               const AdamWConfig& hp, float weight_decay, uint64_t seed,
               const PrecisionPolicy& precision = {});
  void begin_step(const Context& ctx) override;
  // Only the last micro-batch communicates (Playbook §3.4); its after_backward hook marks a
  // unit's gradients final and launches the buckets it completes (§3.2, §3.3).
  UnitHooks hooks(const Context& ctx, bool last_micro_batch) override;
  // Waits for every bucket (launching the ones not yet launched); returns seconds blocked.
  double finish(const Context& ctx) override;
  void step(const Context& ctx, float lr) override;
  int64_t master_bytes() const override;
  std::string describe() const override;  // "bucket, buckets of 25 MiB, overlapped"
  const std::vector<GradBucket>& buckets() const { return buckets_; }

 protected:
  std::vector<Holding> holdings(Part part) const override;
  void scale_grads(const Context& ctx, float alpha) override;
  bool grads_sharded() const override { return false; }

 private:
  void on_gradients_ready(int unit);
  void launch(GradBucket& b);
  std::unique_ptr<BucketReducer> reducer_;
  Bf16Accumulators accumulators_;  // bf16 gradients only
  bool overlap_, active_ = false;
  std::string description_;  // describe()
  Tensor compute_copy_;      // mixed precision: the bf16 / fp16 copy of the weights GEMMs read
  const Context* ctx_ = nullptr;
  AdamMoments moments_;  // [num_params] each
  std::vector<GradBucket> buckets_;
  std::vector<int> param_bucket_;  // parameter -> bucket
};
