// attention_naive.cu: the attention core, softmax(q k^T / sqrt(hd) + causal mask) v, with
// grouped-query heads, as the textbook writes it (Playbook §2.5): per (sequence, head) a GEMM for
// the scores, a causal row softmax, and a GEMM for the output, keeping the [B, Hq, T, T]
// probabilities for backward: the 5as^2b term of §2.5's activation memory. It stays as the
// readable reference that FlashAttention (flash_attention.cu) is tested against. The one idea:
// attention is GEMM, row softmax, GEMM, and only the softmax needs a kernel of its own.
#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_naive.cuh"
#include "runtime/dtype.cuh"
#include "runtime/ops.cuh"

// ============================================================================
// causal softmax, forward: probs = softmax over j <= i of scale * scores, 0 above the diagonal
// ============================================================================

// probs, scores [rows, T, T] (probs may equal scores); fp32 max and sum per row.
static void causal_softmax_forward_cpu(float* probs, const float* scores, int rows, int T,
                                       float scale) {
  for (int64_t row = 0; row < (int64_t)rows * T; row++) {
    int i = (int)(row % T);  // query position: keys 0..i are visible
    const float* s = scores + row * T;
    float* p = probs + row * T;
    float m = -INFINITY;  // subtract the row max so exp never overflows
    for (int j = 0; j <= i; j++) m = fmaxf(m, scale * s[j]);
    float sum = 0.0f;
    for (int j = 0; j <= i; j++) sum += expf(scale * s[j] - m);
    for (int j = 0; j < T; j++) p[j] = j <= i ? expf(scale * s[j] - m) / sum : 0.0f;
  }
}

// ----------------------------------------------------------------------------

__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2)
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}
__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

constexpr int kWarpsPerBlock = 4;

// One warp per row of T: shuffles reduce the max and the sum without shared memory or
// __syncthreads. Each lane writes only the columns it read, after both reductions, so
// probs may alias scores. probs, scores [n_rows, T] with n_rows = rows * T.
__global__ void causal_softmax_forward_kernel(float* probs, const float* scores, int64_t n_rows,
                                              int T, float scale) {
  int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= n_rows) return;  // the whole warp leaves together, so the shuffles stay full
  int i = (int)(row % T);
  const float* s = scores + row * T;
  float* p = probs + row * T;
  float m = -INFINITY;
  for (int j = lane; j <= i; j += 32) m = fmaxf(m, scale * s[j]);
  m = warp_max(m);
  float sum = 0.0f;
  for (int j = lane; j <= i; j += 32) sum += expf(scale * s[j] - m);
  sum = warp_sum(sum);
  for (int j = lane; j < T; j += 32) p[j] = j <= i ? expf(scale * s[j] - m) / sum : 0.0f;
}

// ----------------------------------------------------------------------------

void causal_softmax_forward(const Context& ctx, float* probs, const float* scores, int rows, int T,
                            float scale) {
  const double n = (double)rows * T * T;  // rows x T scores of T keys
  if (count_op(ctx.device, OpKind::Attention, {3 * n, 4 * n, 4 * n})) return;
  if (ctx.device == Device::CPU) return causal_softmax_forward_cpu(probs, scores, rows, T, scale);
  int64_t n_rows = (int64_t)rows * T;
  if (n_rows == 0) return;  // a zero-block grid is a launch error, not a no-op
  int blocks = (int)((n_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  causal_softmax_forward_kernel<<<blocks, 32 * kWarpsPerBlock, 0, ctx.stream>>>(probs, scores,
                                                                                n_rows, T, scale);
  CUDA_CHECK(cudaGetLastError());
}

// ============================================================================
// causal softmax, backward: dscores = scale * P * (dP - sum_j P * dP)
// ============================================================================

// dscores, dprobs, probs [rows, T, T]; dscores may equal dprobs.
static void causal_softmax_backward_cpu(float* dscores, const float* dprobs, const float* probs,
                                        int rows, int T, float scale) {
  for (int64_t row = 0; row < (int64_t)rows * T; row++) {
    int i = (int)(row % T);
    const float* p = probs + row * T;
    const float* dp = dprobs + row * T;
    float* ds = dscores + row * T;
    // The softmax Jacobian is diag(p) - p p^T, so J^T dp = p * (dp - <p, dp>). <p, dp> is taken
    // as the p-weighted mean of dp, in double: the dp are nearly equal (every value vector
    // shares a large common part), and dp - <p, dp> keeps only their small differences. An fp32
    // sum, and fp32 p that sum to 1 only within a few ulps, leave an error in <p, dp> that
    // every key then carries into dq, a few times fp32's own error in dq.
    double weighted = 0.0, total = 0.0;
    for (int j = 0; j <= i; j++) weighted += (double)p[j] * dp[j], total += p[j];
    const float dot = (float)(weighted / total);
    for (int j = 0; j < T; j++) ds[j] = j <= i ? scale * p[j] * (dp[j] - dot) : 0.0f;
  }
}

// ----------------------------------------------------------------------------

// One warp per row, as in the forward kernel; dscores may alias dprobs for the same reason.
// dscores, dprobs, probs [n_rows, T] with n_rows = rows * T.
__global__ void causal_softmax_backward_kernel(float* dscores, const float* dprobs,
                                               const float* probs, int64_t n_rows, int T,
                                               float scale) {
  int64_t row = (int64_t)blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= n_rows) return;
  int i = (int)(row % T);
  const float* p = probs + row * T;
  const float* dp = dprobs + row * T;
  float* ds = dscores + row * T;
  float dot = 0.0f;
  for (int j = lane; j <= i; j += 32) dot += p[j] * dp[j];
  dot = warp_sum(dot);
  // Explicit zeros above the diagonal: dP there is whatever the GEMM produced, not 0.
  for (int j = lane; j < T; j += 32) ds[j] = j <= i ? scale * p[j] * (dp[j] - dot) : 0.0f;
}

// ----------------------------------------------------------------------------

void causal_softmax_backward(const Context& ctx, float* dscores, const float* dprobs,
                             const float* probs, int rows, int T, float scale) {
  const double n = (double)rows * T * T;
  if (count_op(ctx.device, OpKind::Attention, {4 * n, 8 * n, 4 * n})) return;
  if (ctx.device == Device::CPU)
    return causal_softmax_backward_cpu(dscores, dprobs, probs, rows, T, scale);
  int64_t n_rows = (int64_t)rows * T;
  if (n_rows == 0) return;
  int blocks = (int)((n_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  causal_softmax_backward_kernel<<<blocks, 32 * kWarpsPerBlock, 0, ctx.stream>>>(
      dscores, dprobs, probs, n_rows, T, scale);
  CUDA_CHECK(cudaGetLastError());
}

// ============================================================================
// naive attention: strided-batched GEMMs over the heads or the sequences, no copies
// ============================================================================
// q rows are tokens with Hq*hd floats each, so head h of sequence b is a [T, hd] matrix
// starting at q + (b*T*Hq + h)*hd with leading dimension Hq*hd; likewise k, v with Hkv.
// Head h+1 starts hd floats after head h, and sequence b+1 T*Hq*hd floats after sequence b: both
// are constant strides, so either index can be the batch of one strided-batched GEMM (cuBLAS
// cublasSgemmStridedBatched). The heads of one kv group share K_g and V_g (stride 0 for them).
// Each call batches the longer of the two, so a forward makes Hkv * min(B, Hq/Hkv) calls per
// GEMM instead of B * Hq (the backward's dK and dV GEMMs, Hq: see head_batches). The softmax is
// the only kernel of its own.

// The [T, hd] slice of head `head` in sequence b of a [B*T, H, hd] tensor.
static float* head_slice(const Tensor& x, int b, int head, int H, const AttentionShape& s) {
  return x.f32() + ((int64_t)b * s.T * H + head) * s.hd;
}
// The [T, T] slice of (b, h) in a [B, Hq, T, T] tensor.
static float* score_slice(const Tensor& x, int b, int h, const AttentionShape& s) {
  return x.f32() + ((int64_t)b * s.Hq + h) * s.T * s.T;
}

// `count` GEMMs C_i = op(A_i) op(B_i) + beta C_i, X_i = X + i * stride_x (row-major, as gemm):
// ops.cuh's gemm_strided_batched on these raw slices (one cuBLAS call; on the CPU one gemm each).
static void gemm_batched(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                         const float* A, int lda, int64_t stride_a, const float* B, int ldb,
                         int64_t stride_b, float beta, float* C, int ldc, int64_t stride_c,
                         int count) {
  auto at = [&](const float* p) { return Tensor{nullptr, (void*)p, {1}, DType::F32, ctx.device}; };
  gemm_strided_batched(ctx, trans_a, trans_b, M, N, K, at(A), lda, stride_a, at(B), ldb, stride_b,
                       beta, at(C), ldc, stride_c, count);
}

// One batch of naive attention's GEMMs: `count` sequences b, b+1, ... of head h, or `count`
// heads h, h+1, ... of one kv group in sequence b. The strides between neighbours in the batch:
struct HeadBatch {
  int b, h, count;
  bool over_sequences;
  int64_t q_stride(const AttentionShape& s) const {  // a [B*T, Hq, hd] tensor
    return over_sequences ? (int64_t)s.T * s.Hq * s.hd : s.hd;
  }
  int64_t kv_stride(const AttentionShape& s) const {  // a [B*T, Hkv, hd] tensor: shared by heads
    return over_sequences ? (int64_t)s.T * s.Hkv * s.hd : 0;
  }
  int64_t score_stride(const AttentionShape& s) const {  // a [B, Hq, T, T] tensor
    return over_sequences ? (int64_t)s.Hq * s.T * s.T : (int64_t)s.T * s.T;
  }
};
// Every (b, h) once. Over the sequences when a kv group has no more heads than there are
// sequences, or always when `per_head` (the heads of a group accumulate into one dK_g, dV_g:
// one batch each, in head order, so no two GEMMs of a batch write the same memory).
static std::vector<HeadBatch> head_batches(const AttentionShape& s, bool per_head) {
  int group = s.Hq / s.Hkv;
  std::vector<HeadBatch> batches;
  if (per_head || s.B >= group) {
    for (int h = 0; h < s.Hq; h++) batches.push_back({0, h, s.B, true});
  } else {
    for (int b = 0; b < s.B; b++)
      for (int g = 0; g < s.Hkv; g++) batches.push_back({b, g * group, group, false});
  }
  return batches;
}

static void check_attention_args(const Context& ctx, const AttentionShape& s,
                                 std::initializer_list<std::pair<const Tensor*, int>> tensors) {
  PICO_ASSERT(
      s.Hkv > 0 && s.Hq % s.Hkv == 0,
      "attention: Hq " + std::to_string(s.Hq) + " not a multiple of Hkv " + std::to_string(s.Hkv));
  // width: floats per token (Hq*hd or Hkv*hd); 0 marks a [B, Hq, T, T] probabilities tensor.
  for (auto [t, width] : tensors) {
    int64_t want = width > 0 ? (int64_t)s.B * s.T * width : (int64_t)s.B * s.Hq * s.T * s.T;
    PICO_ASSERT(t->numel() == want && t->device == ctx.device,
                "attention tensor " + t->shape_str() + " on " + device_name(t->device) +
                    ", expected " + std::to_string(want) + " floats on " + device_name(ctx.device));
  }
}

void attention_probs(const Context& ctx, const Tensor& probs, const Tensor& q, const Tensor& k,
                     const AttentionShape& s) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s, {{&q, qw}, {&k, kvw}, {&probs, 0}});
  // S[T, T] = Q_h[T, hd] K_g[T, hd]^T, unscaled: the softmax applies 1/sqrt(hd).
  for (const HeadBatch& hb : head_batches(s, false))
    gemm_batched(ctx, false, true, T, T, hd, head_slice(q, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 head_slice(k, hb.b, hb.h / group, s.Hkv, s), kvw, hb.kv_stride(s), 0.0f,
                 score_slice(probs, hb.b, hb.h, s), T, hb.score_stride(s), hb.count);
  // In place: the scores become the probabilities saved for backward.
  causal_softmax_forward(ctx, probs.f32(), probs.f32(), s.B * s.Hq, T, 1.0f / sqrtf((float)hd));
}

void attention_output(const Context& ctx, const Tensor& out, const Tensor& probs, const Tensor& v,
                      const AttentionShape& s) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s, {{&out, qw}, {&v, kvw}, {&probs, 0}});
  // O_h[T, hd] = P[T, T] V_g[T, hd], written straight into its columns of out.
  for (const HeadBatch& hb : head_batches(s, false))
    gemm_batched(ctx, false, false, T, hd, T, score_slice(probs, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(v, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), 0.0f, head_slice(out, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 hb.count);
}

void attention_forward(const Context& ctx, const Tensor& out, const Tensor& probs, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionShape& s) {
  attention_probs(ctx, probs, q, k, s);
  attention_output(ctx, out, probs, v, s);
}

void attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, const Tensor& scratch, const AttentionShape& s,
                        const Tensor& dropped, const Tensor& mask, float p) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s,
                       {{&dq, qw},
                        {&dk, kvw},
                        {&dv, kvw},
                        {&dout, qw},
                        {&q, qw},
                        {&k, kvw},
                        {&v, kvw},
                        {&probs, 0},
                        {&scratch, 0}});
  const Tensor& read = dropped.defined() ? dropped : probs;  // what the output GEMM read
  // The heads of a group share one K_g, V_g, so their gradients sum: the first head of the
  // group writes (beta 0), the rest add (beta 1), one head after the other (per-head batches).
  // No memset needed, and none to order.
  auto group_beta = [&](int h) { return h % group == 0 ? 0.0f : 1.0f; };
  std::vector<HeadBatch> batches = head_batches(s, false), per_head = head_batches(s, true);
  // dP[T, T] = dO_h V_g^T
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, true, T, T, hd, head_slice(dout, hb.b, hb.h, s.Hq, s), qw,
                 hb.q_stride(s), head_slice(v, hb.b, hb.h / group, s.Hkv, s), kvw, hb.kv_stride(s),
                 0.0f, score_slice(scratch, hb.b, hb.h, s), T, hb.score_stride(s), hb.count);
  // dV_g[T, hd] (+)= P^T dO_h
  for (const HeadBatch& hb : per_head)
    gemm_batched(ctx, true, false, T, hd, T, score_slice(read, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(dout, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 group_beta(hb.h), head_slice(dv, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), hb.count);
  // Under dropout that was the gradient of what it left: dP = d(dropped) * mask / (1 - p).
  if (dropped.defined()) dropout_backward(ctx, scratch, scratch, mask, p);
  // dS = scale * P * (dP - rowsum(P * dP)), in place over dP; zero above the diagonal.
  causal_softmax_backward(ctx, scratch.f32(), scratch.f32(), probs.f32(), s.B * s.Hq, T,
                          1.0f / sqrtf((float)hd));
  // dQ_h[T, hd] = dS K_g
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, false, T, hd, T, score_slice(scratch, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(k, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), 0.0f, head_slice(dq, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 hb.count);
  // dK_g[T, hd] (+)= dS^T Q_h
  for (const HeadBatch& hb : per_head)
    gemm_batched(ctx, true, false, T, hd, T, score_slice(scratch, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(q, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 group_beta(hb.h), head_slice(dk, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), hb.count);
}

// ----------------------------------------------------------------------------
// The seam (flash_attention.cuh's AttentionCore)

namespace {
static Tensor kept(const Context& ctx, std::vector<int64_t> shape) {  // on the compute stream
  return empty(ctx, std::move(shape), Mem::Activations);
}
// Keeps the [B, Hq, T, T] probabilities (Playbook §2.5); selective recomputation drops them and
// the backward rebuilds them from q and k.
class NaiveAttention : public AttentionCore {
 public:
  std::string name() const override { return "naive"; }
  void forward(const Context& ctx, const AttentionShape& s, const Tensor& out,
               AttentionSaved& saved, const Tensor& q, const Tensor& k,
               const Tensor& v) const override {
    Tensor o = attention_output_fp32(ctx, out);  // fp32 values throughout (flash_attention.cuh)
    keep_probs(ctx, s, saved, cast_to(ctx, q, DType::F32), cast_to(ctx, k, DType::F32));
    attention_output(ctx, o, s.dropout ? saved.dropped : saved.probs, cast_to(ctx, v, DType::F32),
                     s);
    attention_store_output(ctx, out, o);
  }
  void backward(const Context& ctx, const AttentionShape& s, const Tensor& dq, const Tensor& dk,
                const Tensor& dv, const Tensor& dout, const Tensor&, AttentionSaved& saved,
                const Tensor& q16, const Tensor& k16, const Tensor& v16) const override {
    Tensor q = cast_to(ctx, q16, DType::F32), k = cast_to(ctx, k16, DType::F32),
           v = cast_to(ctx, v16, DType::F32);
    // Selective recompute: the probabilities again, and dropout's mask drawn again (the same).
    if (!saved.probs.defined()) keep_probs(ctx, s, saved, q, k);
    Tensor d_probs = empty(ctx, {s.B, s.Hq, s.T, s.T}, Mem::Workspace);
    attention_backward(ctx, dq, dk, dv, cast_to(ctx, dout, DType::F32), q, k, v, saved.probs,
                       d_probs, s, saved.dropped, saved.mask, s.dropout ? s.dropout->site.p : 0.0f);
  }
  // Per score: the probability (e bytes), and under dropout its mask (1) and what it left (e).
  int64_t saved_bytes(int64_t B, int64_t T, int64_t heads, bool selective, int e,
                      bool dropout) const override {
    return selective ? 0 : (dropout ? 2 * e + 1 : e) * B * heads * T * T;
  }
  std::string saved_formula(int e, bool dropout) const override {
    return std::to_string(dropout ? 2 * e + 1 : e) + " Hq T";
  }

 private:
  // saved's probabilities from q and k, and under dropout its mask and what it leaves of them.
  static void keep_probs(const Context& ctx, const AttentionShape& s, AttentionSaved& saved,
                         const Tensor& q, const Tensor& k) {
    saved.probs = kept(ctx, {s.B, s.Hq, s.T, s.T});
    attention_probs(ctx, saved.probs, q, k, s);
    if (!s.dropout) return;
    saved.mask = empty(ctx, {s.B, s.Hq, s.T, s.T}, Mem::Activations, DType::U8);
    saved.dropped = kept(ctx, {s.B, s.Hq, s.T, s.T});
    const AttentionDropout& d = *s.dropout;
    dropout_attention_forward(ctx, saved.dropped, saved.mask, saved.probs, d.site, d.sequences,
                              d.positions, d.head0);
  }
};
}  // namespace

std::shared_ptr<const AttentionCore> naive_attention() {
  return std::make_shared<NaiveAttention>();
}
