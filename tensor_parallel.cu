// tensor_parallel.cu: split each weight matrix across the tp ranks (Playbook §5) and, with
// sequence parallelism, split the activations between them along the tokens (§6).
// The one idea: a column-parallel linear (weight split by output rows) followed by a
// row-parallel linear (split by input columns) needs no communication in between: one
// all-reduce after the pair in forward, one before it in backward (the conjugate operators
// f and f*). Sequence parallelism replaces each all-reduce by a reduce-scatter plus an
// all-gather (same bytes) so the norms and residuals in between run on N/tp tokens only.
// Guide: docs/tensor-parallel.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <initializer_list>

#include "mixed_precision.cuh"
#include "runtime/model_config.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"
#include "tensor_parallel.cuh"

// ----------------------------------------------------------------------------
// This rank's slice of the model (Playbook §5.3)

LocalDims local_dims(const ModelConfig& c, int rank, int size) {
  LocalDims L;
  L.tp_rank = rank;
  L.heads = c.heads / size, L.head0 = rank * L.heads;
  L.ffn = c.ffn / size, L.ffn0 = rank * L.ffn;
  L.vocab = c.vocab / size, L.vocab0 = rank * L.vocab;
  if (c.kv_heads % size == 0) {  // each rank its own key/value heads
    L.kv_heads = c.kv_heads / size, L.kv_head0 = rank * L.kv_heads, L.kv_replicas = 1;
  } else {  // more ranks than kv heads: the kv head of this rank's query heads, replicated
    L.kv_heads = 1, L.kv_replicas = size / c.kv_heads, L.kv_head0 = rank / L.kv_replicas;
  }
  return L;
}

void add_tensor_parallel_flags(CLI::App& app, TensorParallelOptions& o) {
  CLI::App& g = flag_group(app, "Tensor and sequence parallelism (Playbook §5, §6)");
  g.add_option("--tp", o.tp, "tensor-parallel ranks, >= 1, dividing --heads, --ffn and --vocab")
      ->capture_default_str();
  g.add_flag("--sp", o.sp, "sequence parallelism in the tensor-parallel group (needs --tp > 1)");
}

void validate_tensor_parallel(const ModelConfig& c, int tp, bool sp) {
  check_positive(tp, "--tp");
  auto divides = [&](int n, const char* flag) {
    if (n % tp)
      throw UsageError("--tp " + std::to_string(tp) + " does not divide " + flag + " " +
                       std::to_string(n) +
                       ": tensor parallelism splits it evenly (picoscale "
                       "does not pad); pick a --tp that divides it");
  };
  divides(c.heads, "--heads");
  divides(c.ffn, "--ffn");
  divides(c.vocab, "--vocab");
  if (c.kv_heads % tp && tp % c.kv_heads)
    throw UsageError("--tp " + std::to_string(tp) + " and --kv-heads " +
                     std::to_string(c.kv_heads) +
                     ": one must divide the other (key/value heads "
                     "are split over tp, or replicated when tp exceeds them)");
  // A flag that changes nothing is refused rather than ignored: the run would be plain tp 1,
  // and a layout meant to test sequence parallelism would silently test none.
  if (sp && tp == 1)
    throw UsageError(
        "--sp with --tp 1: sequence parallelism splits the norms' and residuals' "
        "tokens over the tensor-parallel ranks, and one rank has nothing to split; "
        "add --tp 2 (or more), or drop --sp");
  if (sp && c.seq % tp)
    throw UsageError("--sp with --seq " + std::to_string(c.seq) + " and --tp " +
                     std::to_string(tp) +
                     ": sequence parallelism splits every sequence's "
                     "tokens over tp, so --tp must divide --seq");
}

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
  PICO_ASSERT(full.numel() == shard.numel() * tp.size() && full.dtype == shard.dtype,
              "sp all-gather shapes");
  // in the tensors' format (a 16-bit residual gradient gathered as it is: a move, exact)
  all_gather_async(*tp.comm, tp.group(), ctx, shard.ptr, full.ptr, shard.dtype, shard.numel())
      .wait();
}
void gather_from_sp_region_backward(const TensorParallel& tp, const Context& ctx,
                                    const Tensor& dfull, const Tensor& dshard) {
  reduce_scatter(*tp.comm, tp.group(), ctx, dfull.f32(), dshard.f32(), dshard.numel(),
                 ReduceOp::Sum);
}
void scatter_to_sp_region_forward(const TensorParallel& tp, const Context& ctx, const Tensor& full,
                                  const Tensor& shard) {
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
  if (full.ptr != x.ptr) copy_(ctx, full, x);  // f: identity
}
void tp_region_enter_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dfull,
                              const Tensor& dx) {
  if (tp.sp) return gather_from_sp_region_backward(tp, ctx, dfull, dx);
  copy_to_tp_region_backward(tp, ctx, dfull);  // f: all-reduce
  if (dx.ptr != dfull.ptr) copy_(ctx, dx, dfull);
}
void tp_region_exit_forward(const TensorParallel& tp, const Context& ctx, const Tensor& partial,
                            const Tensor& out) {
  if (tp.sp) return scatter_to_sp_region_forward(tp, ctx, partial, out);
  reduce_from_tp_region_forward(tp, ctx, partial);  // f*: all-reduce
  if (out.ptr != partial.ptr) copy_(ctx, out, partial);
}
void tp_region_exit_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dout,
                             const Tensor& dpartial) {
  if (tp.sp) return scatter_to_sp_region_backward(tp, ctx, dout, dpartial);
  if (dpartial.ptr != dout.ptr) copy_(ctx, dpartial, dout);  // f*: identity
}

// ----------------------------------------------------------------------------
// The layers

static Tensor workspace(std::vector<int64_t> shape, const Context& ctx) {  // on its stream
  return empty(ctx, std::move(shape), Mem::Workspace);
}

// The full [N, D] input of a column-parallel linear from a rank's [n, D]: the same tensor
// without SP; with SP all-gathered (the backward gathers it again rather than keeping the full
// tensor, as Megatron does, so saved activations stay sharded).
static Tensor region_input(const TensorParallel& tp, const Context& ctx, const Tensor& x) {
  if (!tp.sp) return x;
  Tensor full = workspace({x.size(0) * tp.size(), x.size(1)}, ctx);
  tp_region_enter_forward(tp, ctx, cast_to(ctx, x, DType::F32), full);  // gathered in fp32
  return full;
}

// ---- The same linear on one input for several weights of one shape ----

// The distance in elements from each tensor to the next when they are evenly spaced in memory,
// without overlapping, of one shape and format; 0 otherwise.
static int64_t even_stride(const std::vector<Tensor>& ts) {
  const int64_t bytes = (int64_t)ts[0].nbytes(), elem = (int64_t)dtype_size(ts[0].dtype);
  const int64_t gap = (const char*)ts[1].ptr - (const char*)ts[0].ptr;
  if (gap < bytes || gap % elem) return 0;
  for (size_t i = 1; i < ts.size(); i++)
    if (ts[i].shape != ts[0].shape || ts[i].dtype != ts[0].dtype ||
        (const char*)ts[i].ptr - (const char*)ts[i - 1].ptr != gap)
      return 0;
  return gap / elem;
}

void linear_forward_many(const Context& ctx, const std::vector<Tensor>& ys, const Tensor& x,
                         const std::vector<Tensor>& Ws) {
  PICO_ASSERT(ys.size() == Ws.size() && !ys.empty(), "linear_forward_many: a y per W");
  auto each = [&] {
    for (size_t i = 0; i < ys.size(); i++) linear_forward(ctx, ys[i], x, Ws[i]);
  };
  if (ys.size() < 2 || ctx.precision == Precision::FP8) return each();
  const int T = (int)x.size(0), in = (int)x.size(-1), out = (int)Ws[0].size(0);
  // The weights as the GEMM reads them: fp32 under fp32, else their stored 16-bit copies (GPU
  // path); x already in the GEMM's format; outputs it writes directly, in that format.
  std::vector<Tensor> read = Ws;
  if (ctx.precision != Precision::FP32) {
    const DType format = output_dtype(ctx.precision);
    if (!gpu_path(ctx.device) || x.dtype != format || ys[0].dtype != format) return each();
    for (Tensor& W : read)
      if (!(W = weight_as_stored(ctx, W)).defined()) return each();
  } else if (x.dtype != DType::F32 || ys[0].dtype != DType::F32) {
    return each();
  }
  const int64_t stride_w = even_stride(read), stride_y = even_stride(ys);
  if (!stride_w || !stride_y || read[0].numel() != (int64_t)out * in ||
      ys[0].numel() != (int64_t)T * out)
    return each();
  gemm_strided_batched(ctx, false, true, T, out, in, x, in, 0, read[0], in, stride_w, 0.0f, ys[0],
                       out, stride_y, (int)ys.size());
}

void linear_weight_grads_many(const Context& ctx, const std::vector<Tensor>& dWs,
                              const std::vector<Tensor>& dys, const Tensor& x,
                              const std::vector<Tensor>& Ws) {
  PICO_ASSERT(dWs.size() == dys.size() && dys.size() == Ws.size() && !dys.empty(),
              "linear_weight_grads_many: a dW and a dy per W");
  auto each = [&] {
    for (size_t i = 0; i < dys.size(); i++)
      linear_backward(ctx, Tensor(), dWs[i], dys[i], x, Ws[i]);
  };
  if (dys.size() < 2 || ctx.precision == Precision::FP8) return each();
  const int T = (int)x.size(0), in = (int)x.size(-1), out = (int)Ws[0].size(0);
  // dy and x as the GEMM reads them (fp32, or on the GPU path in the compute format already);
  // the fp32 accumulators summed into.
  const DType format = ctx.precision == Precision::FP32 ? DType::F32 : output_dtype(ctx.precision);
  if ((format != DType::F32 && !gpu_path(ctx.device)) || x.dtype != format ||
      dys[0].dtype != format || dWs[0].dtype != DType::F32)
    return each();
  const int64_t stride_dy = even_stride(dys), stride_dw = even_stride(dWs);
  if (!stride_dy || !stride_dw || dys[0].numel() != (int64_t)T * out ||
      dWs[0].numel() != (int64_t)out * in)
    return each();
  gemm_strided_batched(ctx, true, false, out, in, T, dys[0], out, stride_dy, x, in, 0, 1.0f, dWs[0],
                       in, stride_dw, (int)dys.size());
}

void column_parallel_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                             const std::vector<ColumnOutput>& outputs) {
  Tensor h = region_input(tp, ctx, x);        // [N, D]
  to_compute_format(ctx, h, Mem::Workspace);  // once, for every GEMM that reads it
  // Neighbours of one shape in one call (k and v; gate and up): one batched GEMM where they sit
  // evenly spaced in memory (mixed_precision.cuh).
  for (size_t i = 0, j; i < outputs.size(); i = j) {
    std::vector<Tensor> ys = {outputs[i].y}, Ws = {outputs[i].W};
    for (j = i + 1; j < outputs.size() && outputs[j].W.shape == Ws[0].shape; j++)
      ys.push_back(outputs[j].y), Ws.push_back(outputs[j].W);
    linear_forward_many(ctx, ys, h, Ws);
  }
}

// A gradient that several tp ranks hold a copy of, each copy having seen part of the data (a
// norm weight under SP; a replicated key/value head). `part` is summed over the copies, then
// added into grad: slot `slot` of `slots` equal slots of one all-reduce (one slot: every tp
// rank holds the same copy; kv heads: the copies of one head share a slot).
static void add_replicated_grad(const TensorParallel& tp, const Context& ctx, const Tensor& grad,
                                const Tensor& part, int slot, int slots) {
  if (slots == 1) {
    copy_to_tp_region_backward(tp, ctx, part);  // all-reduce over tp
  } else {
    Tensor all = zeros(ctx, {slots * part.numel()}, Mem::Workspace);
    copy_(ctx, all.view(slot * part.numel(), {part.numel()}), part);
    copy_to_tp_region_backward(tp, ctx, all);
    copy_(ctx, part, all.view(slot * part.numel(), {part.numel()}));
  }
  axpy(ctx, grad, 1.0f, part);
}

void weight_half(DeferredGrads* deferred, const char* what, std::function<void()> weights) {
  if (deferred)
    deferred->push_back({what, std::move(weights)});
  else
    weights();
}

void column_parallel_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                              const Tensor& x, const std::vector<ColumnGrad>& grads,
                              DeferredGrads* deferred) {
  int64_t N = x.size(0) * (tp.sp ? tp.size() : 1), D = x.size(1);
  Tensor h = region_input(tp, ctx, x);              // [N, D]
  to_compute_format(ctx, h, Mem::Workspace);        // once, for every weight gradient
  Tensor dh = tp.sp ? workspace({N, D}, ctx) : dx;  // [N, D], partial over tp
  std::vector<ColumnGrad> read = grads;             // each dy as both its GEMMs read it
  for (ColumnGrad& g : read) g.dy = gradient_operand(ctx, g.dy);
  for (size_t i = 0; i < read.size(); i++)  // input gradient: sum_i dy_i W_i
    linear_backward(ctx, dh, Tensor(), read[i].dy, h, read[i].W, i > 0);
  weight_half(deferred, "dW", [tp, &ctx, h, grads = std::move(read)] {
    bool replicated = tp.local.kv_replicas > 1;
    for (size_t i = 0, j; i < grads.size(); i = j) {
      const ColumnGrad& g = grads[i];
      j = i + 1;
      if (g.kv_replicated && replicated) {
        // A replicated kv head's part, summed over its copies before it is added.
        Tensor part = zeros(ctx, g.dW.shape, Mem::Workspace);
        linear_backward(ctx, Tensor(), part, g.dy, h, g.W);
        add_replicated_grad(tp, ctx, g.dW, part, tp.local.kv_head0,
                            tp.size() / tp.local.kv_replicas);
        continue;
      }
      // Neighbours of one shape in one call, as in the forward.
      std::vector<Tensor> dWs = {g.dW}, dys = {g.dy}, Ws = {g.W};
      for (; j < grads.size() && grads[j].W.shape == g.W.shape &&
             !(grads[j].kv_replicated && replicated);
           j++)
        dWs.push_back(grads[j].dW), dys.push_back(grads[j].dy), Ws.push_back(grads[j].W);
      linear_weight_grads_many(ctx, dWs, dys, h, Ws);
    }
  });
  tp_region_enter_backward(tp, ctx, dh, dx);  // all-reduce, or reduce-scatter under SP
}

void row_parallel_forward(const TensorParallel& tp, const Context& ctx, const Tensor& y,
                          const Tensor& x, const Tensor& W) {
  Tensor partial = tp.sp ? workspace({x.size(0), y.size(1)}, ctx) : y;  // [N, D]
  linear_forward(ctx, partial, x, W);
  tp_region_exit_forward(tp, ctx, partial, y);  // all-reduce, or reduce-scatter under SP
}

Tensor tp_region_output(const TensorParallel& tp, const Context& ctx, int64_t n, int64_t D) {
  if (tp.size() > 1 || tp.sp) return workspace({n, D}, ctx);
  return empty_in_compute_format(ctx, {n, D}, Mem::Workspace);
}

void row_parallel_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                           const Tensor& dW, const Tensor& dy, bool dy_changes, const Tensor& x,
                           const Tensor& W, DeferredGrads* deferred) {
  Tensor dfull =
      tp.sp ? empty(ctx, {x.size(0), dy.size(1)}, Mem::Workspace, dy.dtype) : dy;  // [N, D]
  tp_region_exit_backward(tp, ctx, dy, dfull);  // identity, or all-gather under SP
  dfull = gradient_operand(ctx, dfull);         // as both GEMMs read it
  linear_backward(ctx, dx, Tensor(), dfull, x, W);
  if (deferred && dy_changes && dfull.ptr == dy.ptr) {  // not a gathered or widened copy
    Tensor saved = empty(ctx, dy.shape, Mem::Workspace, dy.dtype);
    copy_(ctx, saved, dy);
    dfull = saved;
  }
  weight_half(deferred, "dW",
              [&ctx, dW, dfull, x, W] { linear_backward(ctx, Tensor(), dW, dfull, x, W); });
}

// A 16-bit residual stream (--residual-dtype) is looked up, summed over the slices and
// scattered in fp32 and rounded once at the end: exact, each row being one slice's table row.
void vocab_parallel_embedding_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                                      const Tensor& local_ids, const Tensor& table) {
  if (tp.size() == 1) return embedding_forward(ctx, x, local_ids, table);  // rounded as it goes
  const Tensor out = x.dtype == DType::F32 ? x : workspace(x.shape, ctx);
  Tensor rows = workspace({local_ids.numel(), x.size(1)}, ctx);  // [N, D] partial rows
  embedding_forward(ctx, rows, local_ids, table);
  tp_region_exit_forward(tp, ctx, rows, out);  // sum over the slices (reduce-scatter under SP)
  if (out.ptr != x.ptr) cast_(ctx, x, out);
}

void vocab_parallel_embedding_backward(const TensorParallel& tp, const Context& ctx,
                                       const Tensor& dtable, const Tensor& local_ids,
                                       const Tensor& dx_stream) {
  const Tensor dx = cast_to(ctx, dx_stream, DType::F32);  // the collectives and the scatter: fp32
  Tensor dfull = tp.sp ? workspace({local_ids.numel(), dx.size(1)}, ctx) : dx;
  tp_region_exit_backward(tp, ctx, dx, dfull);
  embedding_backward(ctx, dtable, local_ids, dfull);  // reads no weights, only ids
}

void parallel_layernorm_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                                 const Tensor& dw, const Tensor& db, const Tensor& dy,
                                 const Tensor& x, const Tensor& w, const Tensor& stats,
                                 const Tensor& dx_rounded) {
  if (!tp.sp) return layernorm_backward(ctx, dx, dw, db, dy, x, w, stats, dx_rounded);
  const int64_t D = dw.numel();
  Tensor part = zeros(ctx, {2 * D}, Mem::Workspace);  // this rank's tokens' share: dw, then db
  layernorm_backward(ctx, dx, part.view(0, {D}), part.view(D, {D}), dy, x, w, stats, dx_rounded);
  copy_to_tp_region_backward(tp, ctx, part);  // one all-reduce over tp for the two
  axpy(ctx, dw, 1.0f, part.view(0, {D}));
  axpy(ctx, db, 1.0f, part.view(D, {D}));
}

void parallel_rmsnorm_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                               const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                               const Tensor& rstd, const Tensor& dx_rounded) {
  if (!tp.sp) return rmsnorm_backward(ctx, dx, dw, dy, x, w, rstd, dx_rounded);
  Tensor part = zeros(ctx, dw.shape, Mem::Workspace);  // this rank's tokens' share
  rmsnorm_backward(ctx, dx, part, dy, x, w, rstd, dx_rounded);
  add_replicated_grad(tp, ctx, dw, part, 0, 1);
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
// Vocab-parallel cross-entropy (Megatron's): ops.cuh's passes with the tp group's reductions
// between them, so no rank ever holds the full logits.
//   1. each row's maximum over this rank's logits -> all-reduce max
//   2. sum of exp(logit - max) and the target's logit (0 when another rank holds the target)
//      -> all-reduce sum
//   3. loss = log(sum) + max - target logit
// On one tp rank the vocabulary is whole: ops.cuh's cross_entropy_forward (one fused kernel on
// the GPU path).

void vocab_parallel_cross_entropy_forward(const TensorParallel& tp, const Context& ctx,
                                          const Tensor& losses, const Tensor& stats,
                                          const Tensor& logits, const Tensor& local_targets) {
  if (tp.size() == 1) return cross_entropy_forward(ctx, losses, stats, logits, local_targets);
  int64_t N = logits.size(0);
  Tensor row_max = workspace({N}, ctx), sums = workspace({N, 2}, ctx);  // [N], [N, 2]
  cross_entropy_row_max(ctx, row_max, logits);
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Max);
  cross_entropy_row_sums(ctx, sums, logits, row_max, local_targets);
  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, sums.f32(), 2 * N, ReduceOp::Sum);
  cross_entropy_finish(ctx, losses, stats, row_max, sums);  // where the statistics are
}

void vocab_parallel_cross_entropy_backward(const TensorParallel&, const Context& ctx,
                                           const Tensor& dlogits, const Tensor& logits,
                                           const Tensor& stats, const Tensor& local_targets,
                                           float scale) {
  cross_entropy_backward(ctx, dlogits, logits, stats, local_targets, scale);
}

// ----------------------------------------------------------------------------
// What the tp group sent

std::string describe_tensor_parallel(const TensorParallelOptions& o) {
  return o.sp ? ", sequence parallel" : "";
}

std::unique_ptr<StepMeter> tensor_parallel_meter(Comm& comm, const ModelConfig& cfg, int mbs,
                                                 int grad_acc, bool sp) {
  struct Meter : GroupTraffic {
    Meter(Comm& comm, TpTraffic expected, int grad_acc, bool sp)
        : GroupTraffic(comm.tp, {StepPart::Step}),
          comm(comm),
          expected(expected),
          grad_acc(grad_acc),
          sp(sp) {}
    void report(Report r) override {
      if (r == Report::Comm && comm.grid.prints())
        print_tp_comm_report(expected, grad_acc, comm.tp.size, sp, total(), steps());
    }
    bool answers(Report r) const override { return r == Report::Comm; }
    Comm& comm;
    TpTraffic expected;
    int grad_acc;
    bool sp;
  };
  if (comm.tp.size == 1) return nullptr;
  return std::make_unique<Meter>(comm, tp_expected_traffic(cfg, mbs, cfg.seq, comm.tp.size, sp),
                                 grad_acc, sp);
}
