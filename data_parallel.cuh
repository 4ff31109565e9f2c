// data_parallel.cuh: gradient synchronisation over the dp_cp group (Playbook §3): one
// all-reduce per parameter (naive), bucketed all-reduces launched during the backward pass
// (bucket), or the same buckets on our own ring all-reduce (ring).
#pragma once
#include <string>
#include <vector>

#include "comm.cuh"
#include "model.cuh"

enum class DpSync { Naive, Bucket, Ring };
DpSync parse_dp_sync(const std::string& flag);  // naive|bucket|ring
const char* dp_sync_name(DpSync s);

// The ring all-reduce of the NCCL article: N-1 reduce-scatter steps, then N-1 all-gather
// steps, each a send to the next rank and a receive from the previous one; any N, any count.
// Nonblocking: start() posts the first step, progress() advances without blocking, wait()
// finishes. `scratch` holds at least ceil(count / N) floats.
class RingAllReduce {
 public:
  void start(Comm& comm, Group& group, const Context& ctx, float* buf, int64_t count,
             float* scratch);
  bool progress();  // true once done
  void wait();
  bool active() const { return comm_ != nullptr && step_ < total_steps(); }

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
  bool launched = false, ring_started = false;
  double launch_time = 0;
  Handle handle;       // bucket mode
  RingAllReduce ring;  // ring mode
};

class DataParallel {
 public:
  // bucket_mb: bucket capacity in MiB; overlap false launches every bucket after the backward.
  DataParallel(Comm& comm, Model& model, DpSync mode, double bucket_mb, bool overlap);
  // Call before each micro-batch's backward; only the last one communicates (Playbook §3.4).
  void begin_backward(const Context& ctx, bool last_micro_batch);
  // model_backward's after_backward hook: marks a unit's gradients final, launches full buckets.
  void on_gradients_ready(int group);
  UnitHooks hooks();  // after_backward = on_gradients_ready
  // Waits for every bucket (launching the ones not yet launched); returns seconds blocked.
  double finish(const Context& ctx);
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  // (start, end) host times of each bucket's communication in the last step, for the trace.
  std::vector<std::pair<double, double>> last_spans;

 private:
  void launch(GradBucket& b);
  void progress_all();
  void pump_rings(bool block);
  Comm& comm_;
  Model& model_;
  DpSync mode_;
  bool overlap_, active_ = false;
  const Context* ctx_ = nullptr;
  std::vector<GradBucket> buckets_;
  std::vector<std::vector<int>> group_params_;  // readiness group (hook index + 1) -> params
  std::vector<int> param_bucket_;               // parameter -> bucket
  Tensor scratch_;                              // ring receive buffer
  size_t ring_next_ = 0;  // rings run one at a time, in bucket order (see pump_rings)
};
