// data_parallel.cu: every dp rank runs the whole model on its own slice of the global batch;
// gradients are summed over the dp_cp group before the optimizer step (Playbook §3).
// The one idea: the sum is needed only before the optimizer step, so it can run during the
// backward pass: gradients are packed into buckets in the order the backward produces them, and
// each bucket's all-reduce starts the moment its last gradient is written (§3.2, §3.3).
// Guide: docs/data-parallel.md (the code in reading order, the reports that show it).
#include <deque>
#include <type_traits>

#include "data_parallel.cuh"
#include "mixed_precision.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

// On CUDA, make `waiter`'s stream wait for everything queued so far on `producer`'s stream.
static void stream_wait(const Context& waiter, const Context& producer) {
  if (waiter.device != Device::CUDA || waiter.stream == producer.stream) return;
  cudaEvent_t e;
  CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(e, producer.stream));
  CUDA_CHECK(cudaStreamWaitEvent(waiter.stream, e, 0));
  CUDA_CHECK(cudaEventDestroy(e));
}

// ----------------------------------------------------------------------------
// Ring all-reduce (the NCCL article; Playbook appendix A0)
//
// Rank r splits the buffer into N chunks. Reduce-scatter step s (0 <= s < N-1): send chunk
// (r - s) mod N to the next rank, receive chunk (r - s - 1) mod N from the previous one and add
// it in. After N-1 steps rank r holds the full sum of chunk (r + 1) mod N. All-gather step s:
// send chunk (r + 1 - s) mod N, receive chunk (r - s) mod N, overwriting. Each rank sends
// 2 (N-1) chunks: 2 (N-1) K / N bytes, the bandwidth-optimal amount.

void RingAllReduce::start(Comm& comm, Group& group, const Context& ctx, float* buf, int64_t count,
                          float* scratch) {
  comm_ = &comm, group_ = &group, buf_ = buf, count_ = count, scratch_ = scratch, step_ = 0;
  if (group.size == 1) return;
  stream_wait(comm.comm_ctx, ctx);  // the gradients come from the compute stream
  post_step();
}

void RingAllReduce::post_step() {
  int N = group_->size, r = group_->rank;
  bool reducing = step_ < N - 1;
  int s = reducing ? step_ : step_ - (N - 1);
  int send_chunk = ((reducing ? r - s : r + 1 - s) % N + N) % N;
  int recv_chunk = ((reducing ? r - s - 1 : r - s) % N + N) % N;
  float* recv_into = reducing ? scratch_ : buf_ + chunk_begin(recv_chunk);
  pending_ = send_recv_async(
      *comm_, *group_, comm_->comm_ctx,
      {{true, buf_ + chunk_begin(send_chunk), chunk_size(send_chunk), group_->next()},
       {false, recv_into, chunk_size(recv_chunk), group_->prev()}});
}

void RingAllReduce::finish_step() {
  int N = group_->size, r = group_->rank;
  if (step_ < N - 1) {  // reduce-scatter: add the received partial sum into our chunk
    int c = ((r - step_ - 1) % N + N) % N;
    Tensor dst = Tensor{nullptr, buf_ + chunk_begin(c), {chunk_size(c)}, DType::F32, comm_->device};
    Tensor src = Tensor{nullptr, scratch_, {chunk_size(c)}, DType::F32, comm_->device};
    axpy(comm_->comm_ctx, dst, 1.0f, src);
  }
  step_++;
  if (step_ < total_steps()) post_step();
}

bool RingAllReduce::progress() {
  while (active() && pending_.test()) {
    pending_.wait();  // completes the staged copy, if any; returns at once
    finish_step();
  }
  return !active();
}

void RingAllReduce::wait() {
  while (active()) {
    pending_.wait();  // bounded by --comm-timeout
    finish_step();
  }
}

void ring_all_reduce(Comm& comm, Group& group, const Context& ctx, float* buf, int64_t count) {
  // On the communication stream, where the ring reads it and, once it is done, frees it.
  Tensor scratch =
      empty(comm.comm_ctx, {RingAllReduce::scratch_size(count, group.size)}, Mem::Workspace);
  RingAllReduce ring;
  ring.start(comm, group, ctx, buf, count, scratch.f32());
  ring.wait();
  stream_wait(ctx, comm.comm_ctx);
}

// ----------------------------------------------------------------------------
// The reducers: how a bucket is summed

namespace {

// Playbook §3.1: once the backward is done, one blocking all-reduce per parameter.
class NaiveReducer : public BucketReducer {
 public:
  explicit NaiveReducer(Comm& comm) : comm_(comm) {}
  bool per_parameter() const override { return true; }
  bool overlaps() const override { return false; }
  void launch(const Context& ctx, Group& group, const Tensor& g) override {
    all_reduce_async(comm_, group, ctx, g.ptr, g.dtype, g.numel(), ReduceOp::Sum).wait();
  }
  void wait(const Context&) override {}

 private:
  Comm& comm_;
};

// §3.2, §3.3: the library's all-reduce (NCCL or MPI), one per bucket, in flight together.
class LibraryReducer : public BucketReducer {
 public:
  explicit LibraryReducer(Comm& comm) : comm_(comm) {}
  void launch(const Context& ctx, Group& group, const Tensor& g) override {
    handles_.push_back(
        all_reduce_async(comm_, group, ctx, g.ptr, g.dtype, g.numel(), ReduceOp::Sum));
  }
  void progress() override {
    for (Handle& h : handles_) h.test();
  }
  void wait(const Context&) override {
    for (Handle& h : handles_) h.wait();
    handles_.clear();
  }

 private:
  Comm& comm_;
  std::vector<Handle> handles_;
};

// A hand-written all-reduce made of sends and receives (RingAllReduce), one per bucket. Such
// algorithms talk with plain sends and receives, which MPI matches by order of posting: two in
// flight at once could post in different orders on different ranks and receive each other's
// chunks. So they run one at a time, in launch order (as NCCL runs the operations of one
// stream), each starting when the one before completes. Any class with RingAllReduce's start,
// progress, wait and scratch_size runs here.
template <class AllReduce>
class SequentialReducer : public BucketReducer {
 public:
  SequentialReducer(Comm& comm, int64_t largest)
      : comm_(comm),
        scratch_(empty({std::max(AllReduce::scratch_size(largest, comm.dp_cp.size),
                                 AllReduce::scratch_size(largest, comm.edp_cp.size))},
                       Mem::Workspace, comm.device)) {}
  void launch(const Context& ctx, Group& group, const Tensor& g) override {
    PICO_ASSERT(g.dtype == DType::F32, "our all-reduce adds fp32 chunks");
    queue_.push_back({g, &group, AllReduce{}, false});
    pump(ctx, false);
  }
  void progress() override { pump(*ctx_, false); }
  void wait(const Context& ctx) override {
    pump(ctx, true);
    stream_wait(ctx, comm_.comm_ctx);  // the last chunks were added on the communication stream
    queue_.clear(), next_ = 0;
  }

 private:
  struct Queued {
    Tensor grads;
    Group* group;
    AllReduce algorithm;
    bool started;
  };
  void pump(const Context& ctx, bool block) {
    ctx_ = &ctx;
    for (; next_ < queue_.size(); next_++) {
      Queued& q = queue_[next_];
      if (!q.started)
        q.algorithm.start(comm_, *q.group, ctx, q.grads.f32(), q.grads.numel(), scratch_.f32());
      q.started = true;
      if (block)
        q.algorithm.wait();
      else if (!q.algorithm.progress())
        return;
    }
  }
  Comm& comm_;
  Tensor scratch_;  // the algorithm's receive buffer
  std::deque<Queued> queue_;
  size_t next_ = 0;
  const Context* ctx_ = nullptr;
};

template <class Reducer>
std::unique_ptr<BucketReducer> reducer(Comm& comm, const DataParallelOptions&,
                                       int64_t largest_bucket) {
  if constexpr (std::is_constructible_v<Reducer, Comm&, int64_t>)
    return std::make_unique<Reducer>(comm, largest_bucket);
  else
    return std::make_unique<Reducer>(comm);
}

// --dp-sync's values: one row each.
struct SyncRow {
  DpSync id;
  const char* name;
  const char* help;
  bool fp32_only;  // adds fp32 chunks itself (no 16-bit gradients)
  // The reducer, for buckets of at most largest_bucket floats; `o`: the flags, for a reducer
  // that has some of its own.
  std::unique_ptr<BucketReducer> (*make)(Comm& comm, const DataParallelOptions& o,
                                         int64_t largest_bucket);
};
const SyncRow kSyncs[] = {
    {DpSync::Naive, "naive", "one all-reduce per parameter after the backward", false,
     reducer<NaiveReducer>},
    {DpSync::Bucket, "bucket", "buckets all-reduced as the backward fills them", false,
     reducer<LibraryReducer>},
    {DpSync::Ring, "ring", "the same buckets on our own ring all-reduce", true,
     reducer<SequentialReducer<RingAllReduce>>},
};
const SyncRow& sync_row(DpSync s) {
  return table_row(kSyncs, s);
}
std::unique_ptr<BucketReducer> make_reducer(const DataParallelOptions& o, Comm& comm,
                                            int64_t largest_bucket) {
  return sync_row(o.dp_sync).make(comm, o, largest_bucket);
}
}  // namespace

// ----------------------------------------------------------------------------
// Flags

DpSync parse_dp_sync(const std::string& flag) {
  return parse_row("--dp-sync", flag, kSyncs);
}
const char* dp_sync_name(DpSync s) {
  return sync_row(s).name;
}

void add_data_parallel_flags(CLI::App& app, DataParallelOptions& o) {
  std::string modes;
  for (const SyncRow& r : kSyncs)
    modes += std::string(modes.empty() ? "" : "; ") + r.name + ": " + r.help;
  CLI::App& g = flag_group(app, "Data parallelism (Playbook §3)");
  g.add_option("--dp", o.dp, "data-parallel ranks, >= 1")->capture_default_str();
  add_typed(g, "--dp-sync", &o.dp_sync, parse_dp_sync, dp_sync_name(o.dp_sync),
            "gradient sync: " + modes);
  g.add_option("--bucket-mb", o.bucket_mb, "gradient bucket size in MiB, > 0")
      ->capture_default_str();
  g.add_flag("--no-overlap", o.no_overlap,
             "launch every bucket after the backward pass (ZeRO: wait for every collective when "
             "issued, no prefetch)");
}

void validate_data_parallel(const DataParallelOptions& o, DType grad_dtype) {
  check_positive(o.dp, "--dp");
  check_range(o.bucket_mb, "--bucket-mb", 0, true, kNoMax, "must be a number > 0, e.g. 25");
  if (grad_dtype != DType::F32 && sync_row(o.dp_sync).fp32_only)
    throw UsageError("--grad-acc-dtype bf16: --dp-sync " + std::string(dp_sync_name(o.dp_sync)) +
                     " adds fp32 chunks itself; use --dp-sync bucket or naive");
}

// ----------------------------------------------------------------------------
// Buckets

DataParallel::DataParallel(Comm& comm, FlatParameters& model, Context& ctx,
                           const DataParallelOptions& o, const AdamWConfig& hp, float weight_decay,
                           uint64_t seed, const PrecisionPolicy& precision)
    : GradientSync(comm, model, hp, weight_decay),
      accumulators_(model,
                    [&model](int u) {
                      return model.grads.view(model.units[u].offset, {model.units[u].numel});
                    }),
      ctx_(&ctx) {
  description_ = std::string(dp_sync_name(o.dp_sync)) + ", buckets of " + num(o.bucket_mb) +
                 " MiB" + (o.no_overlap ? ", no overlap" : ", overlapped");
  grad_dtype_ = precision.grads();
  PICO_ASSERT(!model.params.defined(), "DataParallel allocates a model from build_model_layout");
  allocate_flat(model, comm.device, seed, grad_dtype_);
  moments_ = adam_moments(model.num_params, comm.device);
  // Mixed precision: the GEMMs read a bf16 / fp16 copy of the weights; the fp32 buffer becomes
  // the optimizer's master copy.
  if (precision.mixed()) compute_copy_ = keep_compute_copy(ctx, model.params);
  slices_ = whole_model_slices(model, moments_);
  if (compute_copy_.defined())  // AdamW rounds each new weight into it in the same pass
    for (ParamSlice& s : slices_)
      s.copy = compute_copy_.view(s.param - model.params.f32(), {s.count});
  // Buckets in backward order: the flat buffer is laid out in forward order, so walking the
  // parameters backwards gives contiguous slices. A bucket closes once it holds bucket_mb
  // (naive: once it holds one parameter), or where the group changes (experts: edp_cp).
  const bool one_each = make_reducer(o, comm, 0)->per_parameter();
  int64_t capacity = one_each ? 1 : std::max<int64_t>(1, (int64_t)(o.bucket_mb * 1024 * 1024 / 4));
  param_bucket_.assign(model.named_params.size(), -1);
  std::vector<Group*> group_of_param(model.named_params.size());
  for (int u = 0; u < (int)model.units.size(); u++)
    for (int p = model.units[u].first; p < model.units[u].first + model.units[u].count; p++)
      group_of_param[p] = &group_of(u);
  for (int p = (int)model.named_params.size() - 1; p >= 0; p--) {
    const Tensor& t = model.named_params[p].tensor;
    int64_t offset = model.offsets[p];
    if (buckets_.empty() || buckets_.back().count >= capacity ||
        buckets_.back().group != group_of_param[p])
      buckets_.push_back(GradBucket{offset + t.numel(), 0, 0, 0, group_of_param[p]});
    GradBucket& b = buckets_.back();
    b.offset = offset;  // grows downwards
    b.count += t.numel();
    b.params++;
    param_bucket_[p] = (int)buckets_.size() - 1;
  }
  int64_t largest = 0;
  for (const GradBucket& b : buckets_) largest = std::max(largest, b.count);
  reducer_ = make_reducer(o, comm, largest);
  overlap_ = !o.no_overlap && reducer_->overlaps();
}

void DataParallel::begin_step(const Context& ctx) {
  zero_(ctx, model_.grads);
  pending_scale_ = 1.0f;
  ctx_ = &ctx;
  active_ = comm_.dp_cp.size > 1;
  for (GradBucket& b : buckets_) b.ready = 0, b.launched = false;
  comm_spans_.clear();
}

// Micro-batches before the last only accumulate; a pipeline may run their backwards after the
// last one's forward, so each micro-batch's hooks carry whether it is the last.
UnitHooks DataParallel::hooks(const Context& ctx, bool last_micro_batch) {
  ctx_ = &ctx;
  UnitHooks h;
  if (grad_dtype_ == DType::F32) {
    if (last_micro_batch) h.after_backward = [this](int unit) { on_gradients_ready(unit); };
    return h;
  }
  h.before_backward = [this](int unit) { accumulators_.hold(*ctx_, unit); };
  h.after_backward = [this, last_micro_batch](int unit) {
    accumulators_.drop(*ctx_, unit);
    if (last_micro_batch) on_gradients_ready(unit);
  };
  return h;
}

void DataParallel::launch(GradBucket& b) {
  b.launched = true;
  b.launch_time = now_seconds();
  reducer_->launch(*ctx_, *b.group, model_.grads.view(b.offset, {b.count}));
}

// A unit's gradients are final: the buckets it completes go (§3.2), and MPI gets a chance to
// advance the ones in flight.
void DataParallel::on_gradients_ready(int unit) {
  if (!active_ || !overlap_) return;
  const ModelUnit& u = model_.units[unit];
  for (int p = u.first; p < u.first + u.count; p++) {
    GradBucket& b = buckets_[param_bucket_[p]];
    if (++b.ready == b.params) launch(b);
  }
  reducer_->progress();
}

double DataParallel::finish(const Context& ctx) {
  if (!active_) return 0.0;
  ctx_ = &ctx;
  double t0 = now_seconds();
  for (GradBucket& b : buckets_)
    if (!b.launched) launch(b);
  reducer_->wait(ctx);
  for (const GradBucket& b : buckets_)
    comm_spans_.push_back({"gradient all-reduce", Track::Comm, b.launch_time, now_seconds()});
  active_ = false;
  return now_seconds() - t0;
}

void DataParallel::step(const Context& ctx, float lr) {
  adamw_.steps++;
  adamw_.update(ctx, slices_.data(), slices_.size(), lr, pending_scale_);  // and the copies
}

int64_t DataParallel::master_bytes() const {
  return compute_copy_.defined() ? (int64_t)model_.params.nbytes() : 0;
}

// ----------------------------------------------------------------------------
// Checkpoints: every rank holds everything, whole

std::vector<GradientSync::Holding> DataParallel::holdings(Part part) const {
  auto whole = [this](const Tensor& flat) -> Holding {
    return [this, flat](int u) {
      const ModelUnit& U = model_.units[u];
      return Piece{flat.view(U.offset, {U.numel}), 0, U.numel};
    };
  };
  switch (part) {
    case Part::Params:
      if (compute_copy_.defined()) return {whole(model_.params), whole(compute_copy_)};
      return {whole(model_.params)};
    case Part::Grads:
      return {whole(model_.grads)};
    case Part::ExpAvg:
      return {whole(moments_.exp_avg)};
    case Part::ExpAvgSq:
      break;
  }
  return {whole(moments_.exp_avg_sq)};
}
void DataParallel::scale_grads(const Context& ctx, float alpha) {
  scale_(ctx, model_.grads, alpha);
}

std::string DataParallel::describe() const {
  return description_;
}
