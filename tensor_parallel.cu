// tensor_parallel.cu: split each weight matrix across the tp ranks (Playbook §5) and, with
// sequence parallelism, split the activations between them along the tokens (§6).
// The one idea: a column-parallel linear (weight split by output rows) followed by a
// row-parallel linear (split by input columns) needs no communication in between: one
// all-reduce after the pair in forward, one before it in backward (the conjugate operators
// f and f*). Sequence parallelism replaces each all-reduce by a reduce-scatter plus an
// all-gather (same bytes) so the norms and residuals in between run on N/tp tokens only.
#include "tensor_parallel.cuh"

#include <cfloat>
#include <cmath>
#include <initializer_list>

#include "ops.cuh"

// ----------------------------------------------------------------------------
// The conjugate operators

void copy_to_tp_region_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx) {
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, dx.f32(), dx.numel(), ReduceOp::Sum);
}
void reduce_from_tp_region_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x) {
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, x.f32(), x.numel(), ReduceOp::Sum);
}
void gather_from_sp_region_forward(const TensorParallel& tp, const Context& ctx,
                                   const Tensor& shard, const Tensor& full) {
  PICO_ASSERT(full.numel() == shard.numel() * tp.size(), "sp all-gather shapes");
  all_gather(*tp.comm, tp.group(), ctx, shard.f32(), full.f32(), shard.numel());
}
void gather_from_sp_region_backward(const TensorParallel& tp, const Context& ctx,
                                    const Tensor& dfull, const Tensor& dshard) {
  reduce_scatter(*tp.comm, tp.group(), ctx, dfull.f32(), dshard.f32(), dshard.numel(), ReduceOp::Sum);
}
void scatter_to_sp_region_forward(const TensorParallel& tp, const Context& ctx,
                                  const Tensor& full, const Tensor& shard) {
  gather_from_sp_region_backward(tp, ctx, full, shard);  // the same reduce-scatter
}
void scatter_to_sp_region_backward(const TensorParallel& tp, const Context& ctx,
                                   const Tensor& dshard, const Tensor& dfull) {
  gather_from_sp_region_forward(tp, ctx, dshard, dfull);  // the same all-gather
}

// ----------------------------------------------------------------------------
// Entering and leaving a tensor-parallel region

int64_t sp_tokens(const TensorParallel& tp, int64_t tokens) {
  return tp.sp ? tokens / tp.size() : tokens;
}
void tp_region_enter_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                             const Tensor& full) {
  if (tp.sp) return gather_from_sp_region_forward(tp, ctx, x, full);
  if (full.ptr != x.ptr) copy_(full, x);  // f: identity
}
void tp_region_enter_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dfull,
                              const Tensor& dx) {
  if (tp.sp) return gather_from_sp_region_backward(tp, ctx, dfull, dx);
  copy_to_tp_region_backward(tp, ctx, dfull);  // f: all-reduce
  if (dx.ptr != dfull.ptr) copy_(dx, dfull);
}
void tp_region_exit_forward(const TensorParallel& tp, const Context& ctx, const Tensor& partial,
                            const Tensor& out) {
  if (tp.sp) return scatter_to_sp_region_forward(tp, ctx, partial, out);
  reduce_from_tp_region_forward(tp, ctx, partial);  // f*: all-reduce
  if (out.ptr != partial.ptr) copy_(out, partial);
}
void tp_region_exit_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dout,
                             const Tensor& dpartial) {
  if (tp.sp) return scatter_to_sp_region_backward(tp, ctx, dout, dpartial);
  if (dpartial.ptr != dout.ptr) copy_(dpartial, dout);  // f*: identity
}

// ----------------------------------------------------------------------------
// Vocab-parallel embedding ids

std::vector<int32_t> local_vocab_ids(const int32_t* ids, int64_t n, int vocab_start,
                                     int local_vocab) {
  std::vector<int32_t> local(n);
  for (int64_t i = 0; i < n; i++) {
    int32_t id = ids[i] - vocab_start;
    local[i] = id >= 0 && id < local_vocab ? id : -1;
  }
  return local;
}

// ----------------------------------------------------------------------------
// Vocab-parallel cross-entropy
//
// Pass 1 (local): each row's maximum over this rank's logits -> all-reduce max.
// Pass 2 (local): sum of exp(logit - max) and the target's logit (0 when another rank holds
// the target) -> all-reduce sum. loss = log(sum) + max - target logit.

static void ce_row_max_cpu(float* row_max, const float* logits, int64_t N, int V) {
  for (int64_t t = 0; t < N; t++) {
    float m = -FLT_MAX;
    for (int v = 0; v < V; v++) m = std::max(m, logits[t * V + v]);
    row_max[t] = m;
  }
}
// sums [N, 2]: (sum of exponentials, target logit)
static void ce_row_sums_cpu(float* sums, const float* logits, const float* row_max,
                            const int32_t* targets, int64_t N, int V) {
  for (int64_t t = 0; t < N; t++) {
    float s = 0;
    for (int v = 0; v < V; v++) s += expf(logits[t * V + v] - row_max[t]);
    sums[2 * t] = s;
    sums[2 * t + 1] = targets[t] >= 0 ? logits[t * V + targets[t]] : 0.0f;
  }
}
static void ce_backward_cpu(float* dlogits, const float* logits, const float* stats,
                            const int32_t* targets, int64_t N, int V, float scale) {
  for (int64_t t = 0; t < N; t++)
    for (int v = 0; v < V; v++) {
      float p = expf(logits[t * V + v] - stats[2 * t]) / stats[2 * t + 1];
      dlogits[t * V + v] = scale * (p - (v == targets[t] ? 1.0f : 0.0f));
    }
}

// One block of kCeThreads per row; a shared-memory tree reduction, which halves the active
// threads each round, so the block size must be a power of two (and fill buf exactly).
constexpr int kCeThreads = 256;
static_assert((kCeThreads & (kCeThreads - 1)) == 0, "tree reduction needs a power of two");
static __device__ float block_reduce(float v, bool take_max) {
  __shared__ float buf[kCeThreads];
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride)
      buf[threadIdx.x] = take_max ? fmaxf(buf[threadIdx.x], buf[threadIdx.x + stride])
                                  : buf[threadIdx.x] + buf[threadIdx.x + stride];
    __syncthreads();
  }
  float r = buf[0];
  __syncthreads();
  return r;
}
static __global__ void ce_row_max_kernel(float* row_max, const float* logits, int V) {
  const float* row = logits + (int64_t)blockIdx.x * V;
  float m = -FLT_MAX;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, row[v]);
  m = block_reduce(m, true);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}
static __global__ void ce_row_sums_kernel(float* sums, const float* logits, const float* row_max,
                                          const int32_t* targets, int V) {
  const float* row = logits + (int64_t)blockIdx.x * V;
  float s = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += expf(row[v] - row_max[blockIdx.x]);
  s = block_reduce(s, false);
  if (threadIdx.x == 0) {
    int target = targets[blockIdx.x];
    sums[2 * blockIdx.x] = s;
    sums[2 * blockIdx.x + 1] = target >= 0 ? row[target] : 0.0f;
  }
}
static __global__ void ce_backward_kernel(float* dlogits, const float* logits, const float* stats,
                                          const int32_t* targets, int V, float scale) {
  int64_t t = blockIdx.x;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    float p = expf(logits[t * V + v] - stats[2 * t]) / stats[2 * t + 1];
    dlogits[t * V + v] = scale * (p - (v == targets[t] ? 1.0f : 0.0f));
  }
}

// Every tensor on the context's device (a kernel handed a host pointer faults), N rows each.
static void check_ce_args(const Context& ctx, std::initializer_list<const Tensor*> tensors,
                          int64_t N) {
  for (const Tensor* t : tensors)
    PICO_ASSERT(t->device == ctx.device && t->numel() >= N,
                "vocab-parallel cross-entropy: tensor " + t->shape_str() + " on " +
                    device_name(t->device) + ", context on " + device_name(ctx.device));
}

void vocab_parallel_cross_entropy_forward(const TensorParallel& tp, const Context& ctx,
                                          const Tensor& losses, const Tensor& stats,
                                          const Tensor& logits, const Tensor& local_targets) {
  int64_t N = logits.size(0);
  int V = (int)logits.size(1);
  check_ce_args(ctx, {&losses, &stats, &logits, &local_targets}, N);
  Tensor row_max = empty({N}, Mem::Workspace, ctx.device);  // [N]
  Tensor sums = empty({N, 2}, Mem::Workspace, ctx.device);  // [N, 2]
  // N == 0 launches nothing (a zero-block grid is an error) but still joins the collectives.
  if (ctx.device == Device::CPU) {
    ce_row_max_cpu(row_max.f32(), logits.f32(), N, V);
  } else if (N > 0) {
    ce_row_max_kernel<<<N, kCeThreads, 0, ctx.stream>>>(row_max.f32(), logits.f32(), V);
    CUDA_CHECK(cudaGetLastError());
  }
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Max);
  if (ctx.device == Device::CPU) {
    ce_row_sums_cpu(sums.f32(), logits.f32(), row_max.f32(), local_targets.i32(), N, V);
  } else if (N > 0) {
    ce_row_sums_kernel<<<N, kCeThreads, 0, ctx.stream>>>(sums.f32(), logits.f32(), row_max.f32(),
                                                         local_targets.i32(), V);
    CUDA_CHECK(cudaGetLastError());
  }
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, sums.f32(), 2 * N, ReduceOp::Sum);
  // On the host: N scalars, once per micro-batch (stats[t] = (max, sum of exponentials)).
  std::vector<float> m = to_host_floats(row_max), s = to_host_floats(sums), loss(N), st(2 * N);
  for (int64_t t = 0; t < N; t++) {
    loss[t] = logf(s[2 * t]) + m[t] - s[2 * t + 1];
    st[2 * t] = m[t], st[2 * t + 1] = s[2 * t];
  }
  from_host(losses, loss.data());
  from_host(stats, st.data());
}

void vocab_parallel_cross_entropy_backward(const TensorParallel&, const Context& ctx,
                                           const Tensor& dlogits, const Tensor& logits,
                                           const Tensor& stats, const Tensor& local_targets,
                                           float scale) {
  int64_t N = logits.size(0);
  int V = (int)logits.size(1);
  check_ce_args(ctx, {&dlogits, &stats, &logits, &local_targets}, N);
  PICO_ASSERT(dlogits.numel() == logits.numel(), "vocab-parallel dlogits " + dlogits.shape_str());
  if (ctx.device == Device::CPU)
    return ce_backward_cpu(dlogits.f32(), logits.f32(), stats.f32(), local_targets.i32(), N, V, scale);
  if (N == 0) return;
  ce_backward_kernel<<<N, kCeThreads, 0, ctx.stream>>>(dlogits.f32(), logits.f32(), stats.f32(),
                                                       local_targets.i32(), V, scale);
  CUDA_CHECK(cudaGetLastError());
}

void tp_cross_entropy_forward(const TensorParallel& tp, const Context& ctx, const Tensor& losses,
                              const Tensor& stats, const Tensor& logits, const Tensor& targets) {
  if (tp.size() == 1) return cross_entropy_forward(ctx, losses, logits, targets);
  vocab_parallel_cross_entropy_forward(tp, ctx, losses, stats, logits, targets);
}
void tp_cross_entropy_backward(const TensorParallel& tp, const Context& ctx,
                               const Tensor& dlogits, const Tensor& logits, const Tensor& stats,
                               const Tensor& targets, float scale) {
  if (tp.size() == 1) return cross_entropy_backward(ctx, dlogits, logits, targets, scale);
  vocab_parallel_cross_entropy_backward(tp, ctx, dlogits, logits, stats, targets, scale);
}

// ----------------------------------------------------------------------------
// Weight shards: blocks of a full row-major tensor

void init_normal_block(const Tensor& shard, uint64_t seed, const std::string& name, float std,
                       int64_t row0, int64_t col0, int64_t full_cols) {
  int64_t rows = shard.dim() > 1 ? shard.size(0) : 1, cols = shard.numel() / rows;
  for (int64_t r = 0; r < rows; r++)  // row r of the shard is a contiguous run of the full tensor
    init_normal(shard.view(r * cols, {cols}), seed, name, std, (row0 + r) * full_cols + col0);
}
static void copy_block(const Tensor& shard, float* full, int64_t row0, int64_t col0,
                       int64_t full_cols, bool into_shard) {
  int64_t rows = shard.dim() > 1 ? shard.size(0) : 1, cols = shard.numel() / rows;
  std::vector<float> host = into_shard ? std::vector<float>(shard.numel()) : to_host_floats(shard);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      float& cell = full[(row0 + r) * full_cols + col0 + c];
      if (into_shard) host[r * cols + c] = cell;
      else cell = host[r * cols + c];
    }
  if (into_shard) from_host(shard, host.data());
}
void load_block(const Tensor& shard, const float* full, int64_t row0, int64_t col0, int64_t full_cols) {
  copy_block(shard, const_cast<float*>(full), row0, col0, full_cols, true);
}
void store_block(const Tensor& shard, float* full, int64_t row0, int64_t col0, int64_t full_cols) {
  copy_block(shard, full, row0, col0, full_cols, false);
}

bool TpSlice::whole(const Tensor& shard) const {
  int64_t n = 1;
  for (int64_t s : full_shape) n *= s;
  return shard.numel() == n;
}

// Each rank writes its block into a zeroed full tensor and the tp ranks sum them on rank 0:
// blocks do not overlap (only one writer per replicated block), so the sum is exact.
std::vector<Tensor> gather_full_tensors(const TensorParallel& tp, const std::vector<Tensor>& shards,
                                        const std::vector<TpSlice>& layouts) {
  if (tp.size() == 1) return shards;
  std::vector<Tensor> full;
  for (size_t i = 0; i < shards.size(); i++) {
    const TpSlice& l = layouts[i];
    Tensor t = zeros(l.full_shape, Mem::Workspace);
    if (l.writer) store_block(shards[i], t.f32(), l.row0, l.col0, l.full_cols());
    MPI_CHECK(MPI_Reduce(tp.rank() == 0 ? MPI_IN_PLACE : t.ptr, t.ptr, (int)t.numel(), MPI_FLOAT,
                         MPI_SUM, 0, tp.group().mpi));
    full.push_back(t);
  }
  return full;
}
void scatter_full_tensors(const std::vector<Tensor>& full, const std::vector<Tensor>& shards,
                          const std::vector<TpSlice>& layouts) {
  for (size_t i = 0; i < shards.size(); i++) {
    if (full[i].ptr == shards[i].ptr) continue;
    std::vector<float> host = to_host_floats(full[i]);
    load_block(shards[i], host.data(), layouts[i].row0, layouts[i].col0, layouts[i].full_cols());
  }
}
