// flash_attention.cu: the attention core, softmax(q k^T / sqrt(hd) + causal mask) v, with
// grouped-query heads, twice.
// Naive attention (Playbook §2.5): per (sequence, head) a GEMM for the scores, a causal row
// softmax, and a GEMM for the output, keeping the [B, Hq, T, T] probabilities for backward:
// the 5as^2b term of §2.5's activation memory. It stays as the readable reference.
// FlashAttention (Playbook §12.8, FlashAttention-2's loop order): a query tile meets the key/
// value tiles one at a time; a running max and running sum rescale the output accumulated so
// far (the online softmax), and only the log-sum-exp per query is kept. Backward recomputes
// the probabilities tile by tile from it. The one idea: attention is GEMM, row softmax, GEMM,
// and the softmax can be computed a tile at a time, so the T x T matrix never exists.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "flash_attention.cuh"
#include "ops.cuh"

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
    // The softmax Jacobian is diag(p) - p p^T, so J^T dp = p * (dp - <p, dp>).
    float dot = 0.0f;
    for (int j = 0; j <= i; j++) dot += p[j] * dp[j];
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

// `count` GEMMs C_i = alpha op(A_i) op(B_i) + beta C_i, X_i = X + i * stride_x (row-major, as
// gemm). CPU: one gemm each, in order; CUDA: one strided-batched call (the operands swapped
// for column-major as in gemm). The C_i must not overlap: cuBLAS may run them concurrently.
static void gemm_batched(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                         float alpha, const float* A, int lda, int64_t stride_a, const float* B,
                         int ldb, int64_t stride_b, float beta, float* C, int ldc, int64_t stride_c,
                         int count) {
  if (ctx.device == Device::CPU) {
    for (int i = 0; i < count; i++)
      gemm(ctx, trans_a, trans_b, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb,
           beta, C + i * stride_c, ldc);
    return;
  }
  CUBLAS_CHECK(cublasSgemmStridedBatched(
      ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
      &alpha, B, ldb, stride_b, A, lda, stride_a, &beta, C, ldc, stride_c, count));
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

void attention_forward(const Context& ctx, const Tensor& out, const Tensor& probs, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionShape& s) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s, {{&out, qw}, {&q, qw}, {&k, kvw}, {&v, kvw}, {&probs, 0}});
  // S[T, T] = Q_h[T, hd] K_g[T, hd]^T, unscaled: the softmax applies 1/sqrt(hd).
  std::vector<HeadBatch> batches = head_batches(s, false);
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, true, T, T, hd, 1.0f, head_slice(q, hb.b, hb.h, s.Hq, s), qw,
                 hb.q_stride(s), head_slice(k, hb.b, hb.h / group, s.Hkv, s), kvw, hb.kv_stride(s),
                 0.0f, score_slice(probs, hb.b, hb.h, s), T, hb.score_stride(s), hb.count);
  // In place: the scores become the probabilities saved for backward.
  causal_softmax_forward(ctx, probs.f32(), probs.f32(), s.B * s.Hq, T, 1.0f / sqrtf((float)hd));
  // O_h[T, hd] = P[T, T] V_g[T, hd], written straight into its columns of out.
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, false, T, hd, T, 1.0f, score_slice(probs, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(v, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), 0.0f, head_slice(out, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 hb.count);
}

void attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, const Tensor& scratch, const AttentionShape& s) {
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
  // The heads of a group share one K_g, V_g, so their gradients sum: the first head of the
  // group writes (beta 0), the rest add (beta 1), one head after the other (per-head batches).
  // No memset needed, and none to order.
  auto group_beta = [&](int h) { return h % group == 0 ? 0.0f : 1.0f; };
  std::vector<HeadBatch> batches = head_batches(s, false), per_head = head_batches(s, true);
  // dP[T, T] = dO_h V_g^T
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, true, T, T, hd, 1.0f, head_slice(dout, hb.b, hb.h, s.Hq, s), qw,
                 hb.q_stride(s), head_slice(v, hb.b, hb.h / group, s.Hkv, s), kvw, hb.kv_stride(s),
                 0.0f, score_slice(scratch, hb.b, hb.h, s), T, hb.score_stride(s), hb.count);
  // dV_g[T, hd] (+)= P^T dO_h
  for (const HeadBatch& hb : per_head)
    gemm_batched(ctx, true, false, T, hd, T, 1.0f, score_slice(probs, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(dout, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 group_beta(hb.h), head_slice(dv, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), hb.count);
  // dS = scale * P * (dP - rowsum(P * dP)), in place over dP; zero above the diagonal.
  causal_softmax_backward(ctx, scratch.f32(), scratch.f32(), probs.f32(), s.B * s.Hq, T,
                          1.0f / sqrtf((float)hd));
  // dQ_h[T, hd] = dS K_g
  for (const HeadBatch& hb : batches)
    gemm_batched(ctx, false, false, T, hd, T, 1.0f, score_slice(scratch, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(k, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), 0.0f, head_slice(dq, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 hb.count);
  // dK_g[T, hd] (+)= dS^T Q_h
  for (const HeadBatch& hb : per_head)
    gemm_batched(ctx, true, false, T, hd, T, 1.0f, score_slice(scratch, hb.b, hb.h, s), T,
                 hb.score_stride(s), head_slice(q, hb.b, hb.h, s.Hq, s), qw, hb.q_stride(s),
                 group_beta(hb.h), head_slice(dk, hb.b, hb.h / group, s.Hkv, s), kvw,
                 hb.kv_stride(s), hb.count);
}

// ============================================================================
// FlashAttention: the pieces every version shares
// ============================================================================

// Element offset of (sequence b, token i, head h) in a token-major [B*T, H, hd] tensor.
__host__ __device__ inline int64_t token_head(int b, int T, int i, int H, int h, int hd) {
  return (((int64_t)b * T + i) * H + h) * hd;
}
// How many keys of [j0, j0 + n) query i sees: all n without the mask; with it, those at global
// position k0 + j <= q0 + i, always a prefix of the tile (0 for a tile wholly in the future).
__host__ __device__ inline int visible_keys(const AttentionBlock& a, int i, int j0, int n) {
  if (!a.causal) return n;
  int64_t seen = a.q0 + i - (a.k0 + j0) + 1;
  return (int)(seen < 0 ? 0 : seen < n ? seen : n);
}
// The first query that sees key j0 (Tq when none does): backward skips the query tiles before it.
__host__ __device__ inline int first_query_seeing(const AttentionBlock& a, int j0) {
  if (!a.causal) return 0;
  int64_t i = a.k0 + j0 - a.q0;
  return (int)(i < 0 ? 0 : i < a.Tq ? i : a.Tq);
}
// logaddexp(lse1, lse2) and the weights exp(lse1 - lse), exp(lse2 - lse) of the two partial
// outputs. Written around the larger side, so exp never overflows; both sides -inf (no key seen
// by either) gives -inf and weights 0 instead of exp(-inf - -inf) = NaN.
__host__ __device__ inline float lse_merge_weights(float lse1, float lse2, float* w1, float* w2) {
  float hi = fmaxf(lse1, lse2), lo = fminf(lse1, lse2);
  if (hi == -INFINITY) {
    *w1 = *w2 = 0.0f;
    return -INFINITY;
  }
  float lse = hi + log1pf(expf(lo - hi));
  *w1 = expf(lse1 - lse);
  *w2 = expf(lse2 - lse);
  return lse;
}

static void check_block_args(const Context& ctx, const AttentionBlock& a,
                             std::initializer_list<std::pair<const Tensor*, int64_t>> tensors) {
  PICO_ASSERT(a.B > 0 && a.Tq >= 0 && a.Tk >= 0 && a.hd > 0 && a.Hkv > 0 && a.Hq % a.Hkv == 0,
              "attention block: B " + std::to_string(a.B) + ", Hq " + std::to_string(a.Hq) +
                  ", Hkv " + std::to_string(a.Hkv) + ", hd " + std::to_string(a.hd));
  for (auto [t, want] : tensors)
    PICO_ASSERT(t->numel() == want && t->device == ctx.device && t->dtype == DType::F32,
                "attention tensor " + t->shape_str() + " on " + device_name(t->device) +
                    ", expected " + std::to_string(want) + " floats on " + device_name(ctx.device));
}
static int64_t q_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Tq * a.Hq * a.hd;
}
static int64_t kv_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Tk * a.Hkv * a.hd;
}
static int64_t lse_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Hq * a.Tq;
}

// ----------------------------------------------------------------------------
// CPU threads. The CPU version splits its work into independent items (a query tile, or a
// key/value head) and runs them on as many threads as OpenBLAS may use, worker w taking items
// w, w + W, ... (a fixed assignment: results never depend on timing). OpenBLAS itself is held
// to one thread meanwhile: a 64 x 64 x hd tile GEMM is too small to split, and splitting it
// inside each of our threads would oversubscribe the cores.

static int cpu_workers(int items) {
  return std::max(1, std::min(openblas_get_num_threads(), items));
}

template <class F>
static void run_on_cpu_workers(int items, int workers, F item) {
  int saved = openblas_get_num_threads();
  openblas_set_num_threads(1);
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; w++)
    pool.emplace_back([&, w] {
      for (int i = w; i < items; i += workers) item(i, w);
    });
  for (int i = 0; i < items; i += workers) item(i, 0);
  for (std::thread& t : pool) t.join();
  openblas_set_num_threads(saved);
}

// ============================================================================
// FlashAttention forward: out = softmax(q k^T / sqrt(hd)) v and lse, one query tile at a time
// ============================================================================

constexpr int kCpuTileQ = 64, kCpuTileK = 64;  // Br x Bc: a 16 KiB score tile stays in L1/L2

// exp(x) for x <= 0 (a score minus its row's max or lse), for the CPU tiles: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (about 1 ulp), 2^n written straight into
// the exponent bits. Unlike expf it has no branches and no call, so the compiler vectorises the
// row loops around it: the exponentials are half of the CPU version's time otherwise. Inputs
// below -87 (exp < 2e-38, nothing next to a row sum >= 1) are clamped there.
static inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round: add, drop 1.5 * 2^23
  float r = x - n * 0.693359375f;  // ln 2 in two parts: the first times n is exact
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// The figure of Playbook §12.8, for query tile [i0, i0 + Br) of head h in sequence b.
// Workspace: S [Br, Bc] scores then probabilities, acc [Br, hd], m and l [Br].
static void flash_forward_tile_cpu(float* out, float* lse, const float* q, const float* k,
                                   const float* v, const AttentionBlock& a, int b, int h, int i0,
                                   float* S, float* acc, float* m, float* l) {
  const int hd = a.hd, g = h / (a.Hq / a.Hkv), ldq = a.Hq * hd, ldk = a.Hkv * hd;
  const int rows = std::min(kCpuTileQ, a.Tq - i0);
  const float scale = 1.0f / sqrtf((float)hd);
  const float* Q = q + token_head(b, a.Tq, i0, a.Hq, h, hd);  // [rows, hd], leading dim ldq
  std::fill(m, m + rows, -INFINITY);                          // running max of each row's scores
  std::fill(l, l + rows, 0.0f);                               // running sum of exp(score - m)
  std::fill(acc, acc + (int64_t)rows * hd, 0.0f);             // running sum of exp(score - m) v
  // Causal tile skipping: tiles past the last key the tile's last query sees are never loaded.
  const int n_keys = visible_keys(a, i0 + rows - 1, 0, a.Tk);
  for (int j0 = 0; j0 < n_keys; j0 += kCpuTileK) {
    const int cols = std::min(kCpuTileK, n_keys - j0);
    const float* K = k + token_head(b, a.Tk, j0, a.Hkv, g, hd);  // [cols, hd], ld ldk
    const float* V = v + token_head(b, a.Tk, j0, a.Hkv, g, hd);  // [cols, hd], ld ldk
    // S[rows, cols] = scale * Q K^T
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hd, scale, Q, ldq, K, ldk,
                0.0f, S, kCpuTileK);
    for (int r = 0; r < rows; r++) {
      float* s = S + r * kCpuTileK;
      const int seen = visible_keys(a, i0 + r, j0, cols);  // keys [0, seen) of the tile
      float m_new = m[r];
      for (int j = 0; j < seen; j++) m_new = fmaxf(m_new, s[j]);
      // The online softmax: what was summed under the old max is rescaled by exp(m - m_new).
      // A row that has seen no key yet keeps m = -inf and a zero P row (no -inf - -inf).
      const float correction = m_new == -INFINITY ? 1.0f : expf(m[r] - m_new);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // (seen = 0 then: all P are 0)
      for (int j = 0; j < cols; j++) s[j] = j < seen ? exp_nonpositive(s[j] - m_use) : 0.0f;
      float row_sum = 0.0f;
      for (int j = 0; j < cols; j++) row_sum += s[j];
      l[r] = l[r] * correction + row_sum;
      m[r] = m_new;
      if (correction != 1.0f)
        for (int d = 0; d < hd; d++) acc[r * hd + d] *= correction;
    }
    // acc[rows, hd] += P[rows, cols] V[cols, hd]
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, cols, 1.0f, S, kCpuTileK, V,
                ldk, 1.0f, acc, hd);
  }
  for (int r = 0; r < rows; r++) {  // out = acc / l; lse = m + log l (-inf: no key seen)
    float* o = out + token_head(b, a.Tq, i0 + r, a.Hq, h, hd);
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    for (int d = 0; d < hd; d++) o[d] = acc[r * hd + d] * inv;
    lse[((int64_t)b * a.Hq + h) * a.Tq + i0 + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
  }
}

static void flash_forward_cpu(float* out, float* lse, const float* q, const float* k,
                              const float* v, const AttentionBlock& a) {
  const int q_tiles = (a.Tq + kCpuTileQ - 1) / kCpuTileQ, items = a.B * a.Hq * q_tiles;
  const int workers = cpu_workers(items);
  // Per worker: S [Br, Bc], acc [Br, hd], m [Br], l [Br]. Independent of T: the O(T) part of
  // flash attention's memory is its output and lse, never a [T, T] buffer.
  const int64_t per_worker = (int64_t)kCpuTileQ * (kCpuTileK + a.hd + 2);
  Tensor work = empty({workers, per_worker}, Mem::Workspace);
  run_on_cpu_workers(items, workers, [&](int item, int w) {
    float* S = work.f32() + w * per_worker;
    float* acc = S + kCpuTileQ * kCpuTileK;
    float* m = acc + kCpuTileQ * a.hd;
    int qt = item % q_tiles, h = item / q_tiles % a.Hq, b = item / q_tiles / a.Hq;
    flash_forward_tile_cpu(out, lse, q, k, v, a, b, h, qt * kCpuTileQ, S, acc, m, m + kCpuTileQ);
  });
}

// ----------------------------------------------------------------------------
// CUDA, fp32 on CUDA cores (the fp32 model's path). One block per (query tile, head, sequence),
// as FlashAttention-2: the block owns its queries' output for the whole loop, so no other block
// ever writes it. Four threads share a query row, thread c owning dims c, c + 4, c + 8, ...
// (interleaved, so the four read four different shared-memory banks). Each thread holds its
// dims of q and of the output accumulator in registers; K and V tiles pass through shared
// memory. A score is the four partial dot products summed by two shuffles, after which all
// four threads hold the whole row of scores and run the same online softmax, without any
// further communication. Scores are kept in log2 units (q is pre-scaled by log2(e)/sqrt(hd)),
// so each exponential is one exp2f.

constexpr int kRowThreads = 4;  // threads per query (or key) row
constexpr int kF32Tile = 32;    // rows per tile: 128 threads
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Rows [row0, row0 + rows) of head `head` in a [B*T, H, hd] tensor into dst[rows][MAX_HD],
// zero past T and past hd (zeros add nothing to a dot product).
template <int MAX_HD>
__device__ void load_rows_f32(float* dst, const float* src, int rows, int b, int T, int row0, int H,
                              int head, int hd) {
  for (int idx = threadIdx.x; idx < rows * MAX_HD; idx += blockDim.x) {
    int r = idx / MAX_HD, d = idx % MAX_HD;
    dst[idx] = row0 + r < T && d < hd ? src[token_head(b, T, row0 + r, H, head, hd) + d] : 0.0f;
  }
}

// out, q [B*Tq, Hq, hd]; k, v [B*Tk, Hkv, hd]; lse [B, Hq, Tq]. Grid (query tiles, Hq, B).
template <int MAX_HD>
__global__ void __launch_bounds__(kF32Tile* kRowThreads)
    flash_forward_f32_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                             AttentionBlock a) {
  constexpr int D = MAX_HD / kRowThreads;  // dims per thread
  __shared__ float Ks[kF32Tile][MAX_HD], Vs[kF32Tile][MAX_HD];
  // Causal: the last query tiles see the most keys; start them first so none runs alone at the end.
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kF32Tile;
  const int h = blockIdx.y, b = blockIdx.z, g = h / (a.Hq / a.Hkv), hd = a.hd;
  const int r = threadIdx.x / kRowThreads, c = threadIdx.x % kRowThreads, i = i0 + r;
  const bool live = i < a.Tq;
  const float scale_log2 = kLog2e / sqrtf((float)hd);
  float qr[D], o[D];  // this thread's dims of q (pre-scaled) and of the output accumulator
  const float* qrow = q + token_head(b, a.Tq, live ? i : 0, a.Hq, h, hd);
#pragma unroll
  for (int e = 0; e < D; e++) {
    int d = c + kRowThreads * e;
    qr[e] = live && d < hd ? qrow[d] * scale_log2 : 0.0f;
    o[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;  // running max (log2 units) and running sum of the row
  const int n_keys = visible_keys(a, min(i0 + kF32Tile, a.Tq) - 1, 0, a.Tk);
  for (int j0 = 0; j0 < n_keys; j0 += kF32Tile) {
    __syncthreads();  // every thread is done with the previous K, V tile
    load_rows_f32<MAX_HD>(&Ks[0][0], k, kF32Tile, b, a.Tk, j0, a.Hkv, g, hd);
    load_rows_f32<MAX_HD>(&Vs[0][0], v, kF32Tile, b, a.Tk, j0, a.Hkv, g, hd);
    __syncthreads();
    const int seen = live ? visible_keys(a, i, j0, min(kF32Tile, a.Tk - j0)) : 0;
    float s[kF32Tile], m_new = m;
#pragma unroll
    for (int j = 0; j < kF32Tile; j++) {
      float dot = 0.0f;
#pragma unroll
      for (int e = 0; e < D; e++) dot += qr[e] * Ks[j][c + kRowThreads * e];
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);  // the row's four lanes are adjacent
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      s[j] = j < seen ? dot : -INFINITY;
      m_new = fmaxf(m_new, s[j]);
    }
    // Subtract 0 instead of -inf while the row has seen nothing: exp2(-inf) = 0, never NaN.
    const float m_use = m_new == -INFINITY ? 0.0f : m_new, correction = exp2f(m - m_use);
    l *= correction;
#pragma unroll
    for (int e = 0; e < D; e++) o[e] *= correction;
#pragma unroll
    for (int j = 0; j < kF32Tile; j++) {
      const float p = exp2f(s[j] - m_use);
      l += p;
#pragma unroll
      for (int e = 0; e < D; e++) o[e] += p * Vs[j][c + kRowThreads * e];
    }
    m = m_new;
  }
  if (!live) return;
  const float inv = l > 0.0f ? 1.0f / l : 0.0f;
  float* orow = out + token_head(b, a.Tq, i, a.Hq, h, hd);
#pragma unroll
  for (int e = 0; e < D; e++)
    if (c + kRowThreads * e < hd) orow[c + kRowThreads * e] = o[e] * inv;
  if (c == 0)
    lse[((int64_t)b * a.Hq + h) * a.Tq + i] = l > 0.0f ? (m + log2f(l)) * kLn2 : -INFINITY;
}

// ----------------------------------------------------------------------------
// CUDA, bf16 on tensor cores: mma.sync.m16n8k16 (bf16 inputs, fp32 accumulation), the
// instruction FlashAttention-2 is built on (sm_80 and newer). Fragment layouts, from the PTX
// ISA: lane = 4 g + t holds
//   A (16 x 16, row-major): rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9 (4 registers)
//   B (16 x 8):             column g, rows 2t, 2t+1 and 2t+8, 2t+9           (2 registers)
//   C (16 x 8, fp32):       rows g and g + 8, columns 2t, 2t+1               (4 floats)
// each register holding two bf16, the lower index in the low half. The C fragments of two
// adjacent 8-column tiles are exactly an A fragment: FlashAttention-2 feeds the probabilities
// P to the next mma straight from registers.

using bf16 = __nv_bfloat16;

// D[16 x 8] += A[16 x 16] B[16 x 8]
__device__ inline void mma_bf16(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}
__device__ inline uint32_t pack_bf16(bf16 lo, bf16 hi) {
  return (uint32_t)__bfloat16_as_ushort(lo) | ((uint32_t)__bfloat16_as_ushort(hi) << 16);
}
__device__ inline uint32_t pack_floats(float lo, float hi) {
  return pack_bf16(__float2bfloat16(lo), __float2bfloat16(hi));
}
// Shared-memory matrices are row-major with leading dimension ld (elements). An operand is read
// either along a row (two adjacent elements: one 32-bit load) or down a column (two loads).
__device__ inline uint32_t pair_along_row(const bf16* s, int ld, int row, int col) {
  return *reinterpret_cast<const uint32_t*>(s + row * ld + col);
}
__device__ inline uint32_t pair_down_col(const bf16* s, int ld, int row, int col) {
  return pack_bf16(s[row * ld + col], s[(row + 1) * ld + col]);
}
// A operand at (m0, k0) of a matrix stored as s[m][k] (Q, K, V as loaded).
__device__ inline void load_a(uint32_t a[4], const bf16* s, int ld, int m0, int k0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  a[0] = pair_along_row(s, ld, m0 + g, k0 + 2 * t);
  a[1] = pair_along_row(s, ld, m0 + g + 8, k0 + 2 * t);
  a[2] = pair_along_row(s, ld, m0 + g, k0 + 2 * t + 8);
  a[3] = pair_along_row(s, ld, m0 + g + 8, k0 + 2 * t + 8);
}
// A operand at (m0, k0) of a matrix stored transposed, as s[k][m].
__device__ inline void load_a_transposed(uint32_t a[4], const bf16* s, int ld, int m0, int k0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  a[0] = pair_down_col(s, ld, k0 + 2 * t, m0 + g);
  a[1] = pair_down_col(s, ld, k0 + 2 * t, m0 + g + 8);
  a[2] = pair_down_col(s, ld, k0 + 2 * t + 8, m0 + g);
  a[3] = pair_down_col(s, ld, k0 + 2 * t + 8, m0 + g + 8);
}
// B operand at (k0, n0) of B = X^T for X stored as s[n][k] (K in S = Q K^T).
__device__ inline void load_b_of_transpose(uint32_t b[2], const bf16* s, int ld, int k0, int n0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  b[0] = pair_along_row(s, ld, n0 + g, k0 + 2 * t);
  b[1] = pair_along_row(s, ld, n0 + g, k0 + 2 * t + 8);
}
// B operand at (k0, n0) of B stored as s[k][n] (V in O = P V).
__device__ inline void load_b(uint32_t b[2], const bf16* s, int ld, int k0, int n0) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  b[0] = pair_down_col(s, ld, k0 + 2 * t, n0 + g);
  b[1] = pair_down_col(s, ld, k0 + 2 * t + 8, n0 + g);
}
// The A operand made of accumulator tiles c0 (columns 0-7) and c1 (8-15), rounded to bf16.
__device__ inline void a_from_accumulators(uint32_t a[4], const float c0[4], const float c1[4]) {
  a[0] = pack_floats(c0[0], c0[1]);
  a[1] = pack_floats(c0[2], c0[3]);
  a[2] = pack_floats(c1[0], c1[1]);
  a[3] = pack_floats(c1[2], c1[3]);
}
// Rows [row0, row0 + ROWS) of head `head` of a [B*T, H, HD] bf16 tensor into dst[ROWS][HD + 8],
// 16 bytes per load, zero past T. The 8 padding elements shift each row by 4 banks, so the 8
// rows a fragment load touches fall in 8 different banks.
template <int HD, int ROWS>
__device__ void load_rows_bf16(bf16* dst, const bf16* src, int b, int T, int row0, int H,
                               int head) {
  constexpr int chunks = HD / 8;  // 8 bf16 = 16 bytes
  for (int idx = threadIdx.x; idx < ROWS * chunks; idx += blockDim.x) {
    const int r = idx / chunks, col = idx % chunks * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (row0 + r < T)
      val = *reinterpret_cast<const uint4*>(src + token_head(b, T, row0 + r, H, head, HD) + col);
    *reinterpret_cast<uint4*>(dst + r * (HD + 8) + col) = val;
  }
}
// Sum or max over the four lanes (t = 0..3) that hold one accumulator row.
__device__ inline float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ inline float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

constexpr int kMmaWarps = 4;              // 128 threads; each warp owns 16 rows
constexpr int kMmaTile = 16 * kMmaWarps;  // 64 queries (forward) or keys (backward) per block
constexpr int kMmaKeyTile = 64;           // keys per step of the forward loop

// Forward, FlashAttention-2: warp w owns queries i0 + 16w .. +15; per key tile it computes
// S = Q K^T (16 x 64, in registers), the online softmax on those registers, and O += P V with P
// taken from the same registers. Lane (g, t) holds rows g and g + 8: index 0 and 1 below.
template <int HD>
__global__ void __launch_bounds__(32 * kMmaWarps)
    flash_forward_bf16_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                              AttentionBlock a) {
  constexpr int LD = HD + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [64][LD]
  bf16* Ks = Qs + kMmaTile * LD;             // [64][LD]
  bf16* Vs = Ks + kMmaKeyTile * LD;          // [64][LD]
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int i0 = (gridDim.x - 1 - blockIdx.x) * kMmaTile;  // longest causal tiles first
  const int h = blockIdx.y, b = blockIdx.z, kv = h / (a.Hq / a.Hkv);
  const float scale_log2 = kLog2e * rsqrtf((float)HD);
  load_rows_bf16<HD, kMmaTile>(Qs, q, b, a.Tq, i0, a.Hq, h);
  __syncthreads();
  uint32_t qf[HD / 16][4];  // this warp's Q rows as A operands, loaded once
#pragma unroll
  for (int kk = 0; kk < HD / 16; kk++) load_a(qf[kk], Qs, LD, 16 * warp, 16 * kk);
  float o[HD / 8][4] = {};  // O (16 x HD): HD/8 accumulator tiles
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const int row[2] = {i0 + 16 * warp + g, i0 + 16 * warp + g + 8};
  const int n_keys = visible_keys(a, min(i0 + kMmaTile, a.Tq) - 1, 0, a.Tk);
  for (int j0 = 0; j0 < n_keys; j0 += kMmaKeyTile) {
    __syncthreads();  // the previous K, V tile is no longer read
    load_rows_bf16<HD, kMmaKeyTile>(Ks, k, b, a.Tk, j0, a.Hkv, kv);
    load_rows_bf16<HD, kMmaKeyTile>(Vs, v, b, a.Tk, j0, a.Hkv, kv);
    __syncthreads();
    float s[kMmaKeyTile / 8][4] = {};  // S (16 x 64): 8 tiles of 8 keys
#pragma unroll
    for (int nt = 0; nt < kMmaKeyTile / 8; nt++)
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t kb[2];
        load_b_of_transpose(kb, Ks, LD, 16 * kk, 8 * nt);
        mma_bf16(s[nt], qf[kk], kb);
      }
    const int cols = min(kMmaKeyTile, a.Tk - j0);
    int seen[2];
    float m_new[2];
    for (int x = 0; x < 2; x++) {
      seen[x] = row[x] < a.Tq ? visible_keys(a, row[x], j0, cols) : 0;
      m_new[x] = m[x];
    }
#pragma unroll
    for (int nt = 0; nt < kMmaKeyTile / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int x = e / 2, col = 8 * nt + 2 * t + e % 2;
        s[nt][e] = col < seen[x] ? s[nt][e] * scale_log2 : -INFINITY;
        m_new[x] = fmaxf(m_new[x], s[nt][e]);
      }
    float m_use[2];
#pragma unroll
    for (int x = 0; x < 2; x++) {
      m_new[x] = quad_max(m_new[x]);  // the row's other 48 columns live in the quad's lanes
      m_use[x] = m_new[x] == -INFINITY ? 0.0f : m_new[x];  // nothing seen yet: no NaN
      const float correction = exp2f(m[x] - m_use[x]);
      l[x] *= correction;  // this lane's part of the row sum; the quad adds them at the end
#pragma unroll
      for (int nd = 0; nd < HD / 8; nd++)
        o[nd][2 * x] *= correction, o[nd][2 * x + 1] *= correction;
      m[x] = m_new[x];
    }
#pragma unroll
    for (int nt = 0; nt < kMmaKeyTile / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        s[nt][e] = exp2f(s[nt][e] - m_use[e / 2]);
        l[e / 2] += s[nt][e];
      }
#pragma unroll
    for (int kc = 0; kc < kMmaKeyTile / 16; kc++) {  // O += P V, 16 keys per step
      uint32_t pa[4];
      a_from_accumulators(pa, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
      for (int nd = 0; nd < HD / 8; nd++) {
        uint32_t vb[2];
        load_b(vb, Vs, LD, 16 * kc, 8 * nd);
        mma_bf16(o[nd], pa, vb);
      }
    }
  }
#pragma unroll
  for (int x = 0; x < 2; x++) {
    l[x] = quad_sum(l[x]);
    if (row[x] >= a.Tq) continue;
    const float inv = l[x] > 0.0f ? 1.0f / l[x] : 0.0f;
    bf16* orow = out + token_head(b, a.Tq, row[x], a.Hq, h, HD);
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
      *reinterpret_cast<__nv_bfloat162*>(orow + 8 * nd + 2 * t) =
          __floats2bfloat162_rn(o[nd][2 * x] * inv, o[nd][2 * x + 1] * inv);
    if (t == 0)
      lse[((int64_t)b * a.Hq + h) * a.Tq + row[x]] =
          l[x] > 0.0f ? (m[x] + log2f(l[x])) * kLn2 : -INFINITY;
  }
}

// ----------------------------------------------------------------------------

// Calls launch(std::integral_constant<int, MAX_HD>) with the smallest of the fp32 kernels'
// register widths, 32, 64 or 128, that holds hd (any hd up to 128: the kernels mask the rest).
template <class Launch>
static void launch_f32_kernel(int hd, Launch launch) {
  PICO_ASSERT(hd <= 128, "flash attention on CUDA: head dim " + std::to_string(hd) + " > 128");
  if (hd <= 32)
    launch(std::integral_constant<int, 32>{});
  else if (hd <= 64)
    launch(std::integral_constant<int, 64>{});
  else
    launch(std::integral_constant<int, 128>{});
  CUDA_CHECK(cudaGetLastError());
}

// Grid (query tiles, Hq, B) of `tile` queries each; never zero blocks (Tq = 0 launches nothing).
static dim3 query_tile_grid(const AttentionBlock& a, int tile) {
  return dim3((a.Tq + tile - 1) / tile, a.Hq, a.B);
}

void flash_attention_forward(const Context& ctx, const Tensor& out, const Tensor& lse,
                             const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionBlock& a) {
  check_block_args(ctx, a,
                   {{&out, q_numel(a)},
                    {&lse, lse_numel(a)},
                    {&q, q_numel(a)},
                    {&k, kv_numel(a)},
                    {&v, kv_numel(a)}});
  if (ctx.device == Device::CPU)
    return flash_forward_cpu(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), a);
  if (a.Tq == 0) return;
  launch_f32_kernel(a.hd, [&](auto max_hd) {
    flash_forward_f32_kernel<decltype(max_hd)::value>
        <<<query_tile_grid(a, kF32Tile), kF32Tile * kRowThreads, 0, ctx.stream>>>(
            out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), a);
  });
}

// Launches kernel<HD> for the bf16 head dims, with its dynamic shared memory allowed past the
// 48 KiB default (up to 227 KiB on sm_90, 163 KiB on sm_80).
template <class Launch>
static void launch_bf16_kernel(const char* what, int hd, Launch launch) {
  PICO_ASSERT(hd == 16 || hd == 32 || hd == 64 || hd == 128,
              std::string(what) + ": bf16 head dim " + std::to_string(hd) +
                  " (supported: 16, 32, 64, 128)");
  if (hd == 16)
    launch(std::integral_constant<int, 16>{});
  else if (hd == 32)
    launch(std::integral_constant<int, 32>{});
  else if (hd == 64)
    launch(std::integral_constant<int, 64>{});
  else
    launch(std::integral_constant<int, 128>{});
  CUDA_CHECK(cudaGetLastError());
}
template <class Kernel>
static void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

void flash_attention_forward_bf16(const Context& ctx, bf16* out, float* lse, const bf16* q,
                                  const bf16* k, const bf16* v, const AttentionBlock& a) {
  PICO_ASSERT(ctx.device == Device::CUDA, "flash_attention_forward_bf16 runs on CUDA only");
  if (a.Tq == 0) return;
  launch_bf16_kernel("flash_attention_forward_bf16", a.hd, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const size_t bytes = (size_t)(kMmaTile + 2 * kMmaKeyTile) * (HD + 8) * sizeof(bf16);
    allow_shared_memory(flash_forward_bf16_kernel<HD>, bytes);
    flash_forward_bf16_kernel<HD>
        <<<query_tile_grid(a, kMmaTile), 32 * kMmaWarps, bytes, ctx.stream>>>(out, lse, q, k, v, a);
  });
}

// ============================================================================
// D = rowsum(dO * O): the softmax backward's per-row term, once per (query, head)
// ============================================================================
// dP's softmax backward needs sum_j P_ij dP_ij per row, and that equals dO_i . O_i (Playbook
// §7.2's D = rowsum(dO ∘ O)), which needs neither P nor the keys: a ring computes it once.

// D [B, Hq, Tq]; dout, out [B*Tq, Hq, hd]
static void out_dot_dout_cpu(float* D, const float* dout, const float* out,
                             const AttentionBlock& a) {
  for (int b = 0; b < a.B; b++)
    for (int i = 0; i < a.Tq; i++)
      for (int h = 0; h < a.Hq; h++) {
        const int64_t off = token_head(b, a.Tq, i, a.Hq, h, a.hd);
        float dot = 0.0f;
        for (int d = 0; d < a.hd; d++) dot += dout[off + d] * out[off + d];
        D[((int64_t)b * a.Hq + h) * a.Tq + i] = dot;
      }
}

// One thread per (sequence, query, head) row, fp32 sums whatever the input type.
template <class T>
__global__ void out_dot_dout_kernel(float* D, const T* dout, const T* out, AttentionBlock a) {
  const int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int h = (int)(r % a.Hq), i = (int)(r / a.Hq % a.Tq), b = (int)(r / a.Hq / a.Tq);
    float dot = 0.0f;
    for (int d = 0; d < a.hd; d++) dot += (float)dout[r * a.hd + d] * (float)out[r * a.hd + d];
    D[((int64_t)b * a.Hq + h) * a.Tq + i] = dot;
  }
}

constexpr int kRowKernelThreads = 256;
// Blocks for one thread per (query, head) row, capped (the kernels loop over the rest).
static int row_kernel_blocks(const AttentionBlock& a) {
  int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  return (int)std::min<int64_t>((rows + kRowKernelThreads - 1) / kRowKernelThreads, 4096);
}

void attention_out_dot_dout(const Context& ctx, const Tensor& D, const Tensor& dout,
                            const Tensor& out, const AttentionBlock& a) {
  check_block_args(ctx, a, {{&D, lse_numel(a)}, {&dout, q_numel(a)}, {&out, q_numel(a)}});
  if (ctx.device == Device::CPU) return out_dot_dout_cpu(D.f32(), dout.f32(), out.f32(), a);
  if (lse_numel(a) == 0) return;
  out_dot_dout_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(
      D.f32(), dout.f32(), out.f32(), a);
  CUDA_CHECK(cudaGetLastError());
}

void attention_out_dot_dout_bf16(const Context& ctx, float* D, const bf16* dout, const bf16* out,
                                 const AttentionBlock& a) {
  PICO_ASSERT(ctx.device == Device::CUDA, "attention_out_dot_dout_bf16 runs on CUDA only");
  if (lse_numel(a) == 0) return;
  out_dot_dout_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(D, dout, out, a);
  CUDA_CHECK(cudaGetLastError());
}

// ============================================================================
// FlashAttention backward: recompute P tile by tile from lse, FlashAttention-2's loop order
// ============================================================================
// For a key tile K_j, V_j and each query tile Q_i that sees it (Playbook §7.2's formulas):
//   P = exp(scale Q_i K_j^T - lse_i)   dV_j += P^T dO_i     dP = dO_i V_j^T
//   dS = P * (dP - D_i)                dQ_i += scale dS K_j  dK_j += scale dS^T Q_i
// The key tile is the outer loop, so dK_j and dV_j stay with one worker (or one thread block)
// from start to end, and only dQ collects from several key tiles.

// One key/value head g of sequence b: its key tiles, the group's query heads, their query
// tiles. dk, dv of (b, g) and dq of the group's heads are written by this call alone, so the
// calls for different (b, g) run in parallel with no locks and a fixed summation order.
// Workspace: P and dS [Br, Bc]. The query range starts at the first query that sees the key
// tile, not at a tile boundary: on the CPU rows need no alignment, so none is computed in vain.
constexpr int kCpuBackwardTileQ = kCpuTileQ;
static void flash_backward_head_cpu(float* dq, float* dk, float* dv, const float* dout,
                                    const float* q, const float* k, const float* v,
                                    const float* lse, const float* D, const AttentionBlock& a,
                                    int b, int g, float* P, float* dS) {
  const int hd = a.hd, group = a.Hq / a.Hkv, ldq = a.Hq * hd, ldk = a.Hkv * hd;
  const float scale = 1.0f / sqrtf((float)hd);
  for (int j0 = 0; j0 < a.Tk; j0 += kCpuTileK) {
    const int cols = std::min(kCpuTileK, a.Tk - j0);
    const int64_t kv_off = token_head(b, a.Tk, j0, a.Hkv, g, hd);
    const float *K = k + kv_off, *V = v + kv_off;  // [cols, hd], ld ldk
    float *dK = dk + kv_off, *dV = dv + kv_off;
    const int i_first = first_query_seeing(a, j0);  // causal: earlier query tiles are skipped
    if (i_first >= a.Tq) continue;
    for (int h = g * group; h < (g + 1) * group; h++)
      for (int i0 = i_first; i0 < a.Tq; i0 += kCpuBackwardTileQ) {
        const int rows = std::min(kCpuBackwardTileQ, a.Tq - i0);
        const int64_t q_off = token_head(b, a.Tq, i0, a.Hq, h, hd);
        const float *Q = q + q_off, *dO = dout + q_off;  // [rows, hd], ld ldq
        const float* L = lse + ((int64_t)b * a.Hq + h) * a.Tq + i0;
        const float* Di = D + ((int64_t)b * a.Hq + h) * a.Tq + i0;
        // P[rows, cols] = exp(scale Q K^T - lse), 0 where masked
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hd, scale, Q, ldq, K, ldk,
                    0.0f, P, kCpuTileK);
        for (int r = 0; r < rows; r++) {
          // lse = -inf: the query sees no key anywhere, so none here either (and no NaN).
          const int seen = L[r] == -INFINITY ? 0 : visible_keys(a, i0 + r, j0, cols);
          const float L_use = seen ? L[r] : 0.0f;
          for (int j = 0; j < cols; j++)
            P[r * kCpuTileK + j] = j < seen ? exp_nonpositive(P[r * kCpuTileK + j] - L_use) : 0.0f;
        }
        // dV[cols, hd] += P^T dO
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, rows, 1.0f, P, kCpuTileK, dO,
                    ldq, 1.0f, dV, ldk);
        // dS[rows, cols] = P * (dO V^T - D)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hd, 1.0f, dO, ldq, V, ldk,
                    0.0f, dS, kCpuTileK);
        for (int r = 0; r < rows; r++)
          for (int j = 0; j < cols; j++)
            dS[r * kCpuTileK + j] = P[r * kCpuTileK + j] * (dS[r * kCpuTileK + j] - Di[r]);
        // dQ[rows, hd] += scale dS K;  dK[cols, hd] += scale dS^T Q
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, cols, scale, dS, kCpuTileK,
                    K, ldk, 1.0f, dq + q_off, ldq);
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, rows, scale, dS, kCpuTileK,
                    Q, ldq, 1.0f, dK, ldk);
      }
  }
}

static void flash_backward_cpu(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* lse, const float* D,
                               const AttentionBlock& a) {
  const int items = a.B * a.Hkv, workers = cpu_workers(items);
  const int64_t per_worker = 2 * kCpuBackwardTileQ * kCpuTileK;  // P and dS: independent of T
  Tensor work = empty({workers, per_worker}, Mem::Workspace);
  run_on_cpu_workers(items, workers, [&](int item, int w) {
    float* P = work.f32() + w * per_worker;
    flash_backward_head_cpu(dq, dk, dv, dout, q, k, v, lse, D, a, item / a.Hkv, item % a.Hkv, P,
                            P + kCpuBackwardTileQ * kCpuTileK);
  });
}

// ----------------------------------------------------------------------------
// CUDA, fp32 on CUDA cores. One block per (key tile, key/value head, sequence): four threads
// per key row, each holding its dims of k, v, dk, dv in registers, loop over the group's query
// heads and the query tiles that see the tile. Per query the row's four threads recompute the
// score and dP with two shuffles each, as in the forward kernel. dK, dV belong to the block
// alone and are added once at the end; dQ sums over key tiles of other blocks, so each block
// adds its part with atomicAdd (fp32 sums in an order that varies from run to run).

// lse (in log2 units) and D of queries [i0, i0 + rows) of head h, into shared memory; past Tq
// lse is -inf, which masks those queries out.
__device__ void load_query_stats(float* lse_s, float* D_s, const float* lse, const float* D,
                                 const AttentionBlock& a, int b, int h, int i0, int rows) {
  if (threadIdx.x >= rows) return;
  const bool in = i0 + threadIdx.x < a.Tq;
  const int64_t row = ((int64_t)b * a.Hq + h) * a.Tq + i0 + threadIdx.x;
  lse_s[threadIdx.x] = in ? lse[row] * kLog2e : -INFINITY;
  D_s[threadIdx.x] = in ? D[row] : 0.0f;
}

constexpr int kF32QueryTile = 16;  // queries per inner step: 34 KiB of shared memory at hd 128

// dq, dout, q [B*Tq, Hq, hd]; dk, dv, k, v [B*Tk, Hkv, hd]; lse, D [B, Hq, Tq].
// Grid (key tiles, Hkv, B).
template <int MAX_HD>
__global__ void __launch_bounds__(kF32Tile* kRowThreads)
    flash_backward_f32_kernel(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* lse, const float* D,
                              AttentionBlock a) {
  constexpr int DIMS = MAX_HD / kRowThreads, BQ = kF32QueryTile;
  __shared__ float Ks[kF32Tile][MAX_HD];  // for dQ = dS K, which mixes every key row
  __shared__ float Qs[BQ][MAX_HD], dOs[BQ][MAX_HD], dSs[BQ][kF32Tile + 1];
  __shared__ float lse_s[BQ], D_s[BQ];
  const int j0 = blockIdx.x * kF32Tile, g = blockIdx.y, b = blockIdx.z, hd = a.hd;
  const int r = threadIdx.x / kRowThreads, c = threadIdx.x % kRowThreads, j = j0 + r;
  const float scale = 1.0f / sqrtf((float)hd), scale_log2 = scale * kLog2e;  // as the CPU
  load_rows_f32<MAX_HD>(&Ks[0][0], k, kF32Tile, b, a.Tk, j0, a.Hkv, g, hd);
  __syncthreads();
  float kr[DIMS], vr[DIMS], dkr[DIMS], dvr[DIMS];  // this thread's dims of its key row
  const float* vrow = v + token_head(b, a.Tk, j < a.Tk ? j : 0, a.Hkv, g, hd);
#pragma unroll
  for (int e = 0; e < DIMS; e++) {
    const int d = c + kRowThreads * e;
    kr[e] = Ks[r][d] * scale_log2;  // zero past Tk and hd, as loaded
    vr[e] = j < a.Tk && d < hd ? vrow[d] : 0.0f;
    dkr[e] = dvr[e] = 0.0f;
  }
  const int i_first = first_query_seeing(a, j0);
  for (int h = g * (a.Hq / a.Hkv); h < (g + 1) * (a.Hq / a.Hkv); h++)
    for (int i0 = i_first - i_first % BQ; i0 < a.Tq; i0 += BQ) {
      __syncthreads();  // the previous step's Qs, dOs, dSs are no longer read
      load_rows_f32<MAX_HD>(&Qs[0][0], q, BQ, b, a.Tq, i0, a.Hq, h, hd);
      load_rows_f32<MAX_HD>(&dOs[0][0], dout, BQ, b, a.Tq, i0, a.Hq, h, hd);
      load_query_stats(lse_s, D_s, lse, D, a, b, h, i0, BQ);
      __syncthreads();
      for (int ii = 0; ii < BQ; ii++) {
        float s = 0.0f, dp = 0.0f;
#pragma unroll
        for (int e = 0; e < DIMS; e++) {
          s += kr[e] * Qs[ii][c + kRowThreads * e];
          dp += vr[e] * dOs[ii][c + kRowThreads * e];
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        dp += __shfl_xor_sync(0xffffffffu, dp, 1);
        dp += __shfl_xor_sync(0xffffffffu, dp, 2);
        const bool seen = j < a.Tk && lse_s[ii] != -INFINITY && visible_keys(a, i0 + ii, j, 1) == 1;
        const float p = seen ? exp2f(s - lse_s[ii]) : 0.0f, ds = p * (dp - D_s[ii]);
#pragma unroll
        for (int e = 0; e < DIMS; e++) {
          dvr[e] += p * dOs[ii][c + kRowThreads * e];
          dkr[e] += ds * Qs[ii][c + kRowThreads * e];
        }
        if (c == 0) dSs[ii][r] = ds;
      }
      __syncthreads();
      // dQ[i0 + ii, d] += scale sum_j dS[ii, j] K[j, d]: one thread per (query, dim)
      for (int idx = threadIdx.x; idx < BQ * hd; idx += blockDim.x) {
        const int ii = idx / hd, d = idx % hd;
        if (i0 + ii >= a.Tq) continue;
        float sum = 0.0f;
#pragma unroll 8
        for (int jj = 0; jj < kF32Tile; jj++) sum += dSs[ii][jj] * Ks[jj][d];
        atomicAdd(dq + token_head(b, a.Tq, i0 + ii, a.Hq, h, hd) + d, scale * sum);
      }
    }
  if (j >= a.Tk) return;
  const int64_t off = token_head(b, a.Tk, j, a.Hkv, g, hd);
#pragma unroll
  for (int e = 0; e < DIMS; e++) {
    const int d = c + kRowThreads * e;
    if (d < hd) dk[off + d] += scale * dkr[e], dv[off + d] += dvr[e];
  }
}

// ----------------------------------------------------------------------------
// CUDA, bf16 on tensor cores, FlashAttention-2's backward. One block per (64-key tile, key/value
// head, sequence); warp w owns keys j0 + 16w .. +15 and keeps their dK, dV (16 x hd, fp32) in
// registers. Per 32-query tile everything is computed transposed, keys as rows, so the key
// rows stay in the warp's registers: S^T = K Q^T, P^T, dP^T = V dO^T, dS^T, then
// dV += P^T dO and dK += dS^T Q with P^T and dS^T fed from registers. dQ = dS K mixes all 64
// keys, so dS^T goes through shared memory, and the block adds its dQ part with atomicAdd.

constexpr int kMmaQueryTile = 32;

template <int HD>
__global__ void __launch_bounds__(32 * kMmaWarps)
    flash_backward_bf16_kernel(float* dq, float* dk, float* dv, const bf16* dout, const bf16* q,
                               const bf16* k, const bf16* v, const float* lse, const float* D,
                               AttentionBlock a) {
  constexpr int LD = HD + 8, BQ = kMmaQueryTile, LDS = BQ + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);                       // [64][LD]
  bf16* Vs = Ks + kMmaTile * LD;                                  // [64][LD]
  bf16* Qs = Vs + kMmaTile * LD;                                  // [32][LD]
  bf16* dOs = Qs + BQ * LD;                                       // [32][LD]
  bf16* dSt = dOs + BQ * LD;                                      // [64 keys][LDS]: dS transposed
  float* lse_s = reinterpret_cast<float*>(dSt + kMmaTile * LDS);  // [32], log2 units
  float* D_s = lse_s + BQ;                                        // [32]
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int j0 = blockIdx.x * kMmaTile, kv = blockIdx.y, b = blockIdx.z;
  const float scale = rsqrtf((float)HD), scale_log2 = scale * kLog2e;
  load_rows_bf16<HD, kMmaTile>(Ks, k, b, a.Tk, j0, a.Hkv, kv);
  load_rows_bf16<HD, kMmaTile>(Vs, v, b, a.Tk, j0, a.Hkv, kv);
  float dk_acc[HD / 8][4] = {}, dv_acc[HD / 8][4] = {};  // 16 keys x HD each
  const int key[2] = {j0 + 16 * warp + g, j0 + 16 * warp + g + 8};
  const int i_first = first_query_seeing(a, j0);
  for (int h = kv * (a.Hq / a.Hkv); h < (kv + 1) * (a.Hq / a.Hkv); h++)
    for (int i0 = i_first - i_first % BQ; i0 < a.Tq; i0 += BQ) {
      __syncthreads();  // the previous step's Qs, dOs, dSt are no longer read
      load_rows_bf16<HD, BQ>(Qs, q, b, a.Tq, i0, a.Hq, h);
      load_rows_bf16<HD, BQ>(dOs, dout, b, a.Tq, i0, a.Hq, h);
      load_query_stats(lse_s, D_s, lse, D, a, b, h, i0, BQ);
      __syncthreads();
      float st[BQ / 8][4] = {}, dpt[BQ / 8][4] = {};  // S^T and dP^T: 16 keys x 32 queries
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        uint32_t ka[4], va[4];
        load_a(ka, Ks, LD, 16 * warp, 16 * kk);
        load_a(va, Vs, LD, 16 * warp, 16 * kk);
#pragma unroll
        for (int nt = 0; nt < BQ / 8; nt++) {
          uint32_t qb[2], ob[2];
          load_b_of_transpose(qb, Qs, LD, 16 * kk, 8 * nt);
          load_b_of_transpose(ob, dOs, LD, 16 * kk, 8 * nt);
          mma_bf16(st[nt], ka, qb);
          mma_bf16(dpt[nt], va, ob);
        }
      }
      // P^T = exp2(S^T scale log2(e) - lse), masked; dS^T = P^T (dP^T - D), into dpt.
#pragma unroll
      for (int nt = 0; nt < BQ / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int qi = 8 * nt + 2 * t + e % 2, j = key[e / 2];
          const bool seen =
              j < a.Tk && lse_s[qi] != -INFINITY && visible_keys(a, i0 + qi, j, 1) == 1;
          st[nt][e] = seen ? exp2f(st[nt][e] * scale_log2 - lse_s[qi]) : 0.0f;
          dpt[nt][e] = st[nt][e] * (dpt[nt][e] - D_s[qi]);
          dSt[(16 * warp + g + 8 * (e / 2)) * LDS + 8 * nt + 2 * t + e % 2] =
              __float2bfloat16(dpt[nt][e]);
        }
#pragma unroll
      for (int kc = 0; kc < BQ / 16; kc++) {  // over the tile's queries, 16 at a time
        uint32_t pa[4], sa[4];
        a_from_accumulators(pa, st[2 * kc], st[2 * kc + 1]);
        a_from_accumulators(sa, dpt[2 * kc], dpt[2 * kc + 1]);
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++) {
          uint32_t ob[2], qb[2];
          load_b(ob, dOs, LD, 16 * kc, 8 * nd);
          load_b(qb, Qs, LD, 16 * kc, 8 * nd);
          mma_bf16(dv_acc[nd], pa, ob);
          mma_bf16(dk_acc[nd], sa, qb);
        }
      }
      __syncthreads();  // dSt complete
      // dQ (32 x HD) += scale dS K: warp w takes query rows 16 (w % 2) and half of the columns.
      const int m0 = 16 * (warp % 2), nd0 = (warp / 2) * (HD / 16);
      for (int nd = nd0; nd < nd0 + HD / 16; nd++) {
        float acc[4] = {};
#pragma unroll
        for (int kc = 0; kc < kMmaTile / 16; kc++) {
          uint32_t sa[4], kb[2];
          load_a_transposed(sa, dSt, LDS, m0, 16 * kc);
          load_b(kb, Ks, LD, 16 * kc, 8 * nd);
          mma_bf16(acc, sa, kb);
        }
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int i = i0 + m0 + g + 8 * (e / 2);
          if (i < a.Tq)
            atomicAdd(dq + token_head(b, a.Tq, i, a.Hq, h, HD) + 8 * nd + 2 * t + e % 2,
                      scale * acc[e]);
        }
      }
    }
#pragma unroll
  for (int x = 0; x < 2; x++) {
    if (key[x] >= a.Tk) continue;
    const int64_t off = token_head(b, a.Tk, key[x], a.Hkv, kv, HD);
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int d = 8 * nd + 2 * t + e;
        dk[off + d] += scale * dk_acc[nd][2 * x + e];
        dv[off + d] += dv_acc[nd][2 * x + e];
      }
  }
}

// ----------------------------------------------------------------------------

// Grid (key tiles, Hkv, B); never zero blocks (Tk = 0 launches nothing).
static dim3 key_tile_grid(const AttentionBlock& a, int tile) {
  return dim3((a.Tk + tile - 1) / tile, a.Hkv, a.B);
}

void flash_attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk,
                              const Tensor& dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& D,
                              const AttentionBlock& a) {
  check_block_args(ctx, a,
                   {{&dq, q_numel(a)},
                    {&dk, kv_numel(a)},
                    {&dv, kv_numel(a)},
                    {&dout, q_numel(a)},
                    {&q, q_numel(a)},
                    {&k, kv_numel(a)},
                    {&v, kv_numel(a)},
                    {&lse, lse_numel(a)},
                    {&D, lse_numel(a)}});
  if (ctx.device == Device::CPU)
    return flash_backward_cpu(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(),
                              lse.f32(), D.f32(), a);
  if (a.Tk == 0 || a.Tq == 0) return;
  launch_f32_kernel(a.hd, [&](auto max_hd) {
    flash_backward_f32_kernel<decltype(max_hd)::value>
        <<<key_tile_grid(a, kF32Tile), kF32Tile * kRowThreads, 0, ctx.stream>>>(
            dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(), lse.f32(), D.f32(),
            a);
  });
}

void flash_attention_backward_bf16(const Context& ctx, float* dq, float* dk, float* dv,
                                   const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                   const float* lse, const float* D, const AttentionBlock& a) {
  PICO_ASSERT(ctx.device == Device::CUDA, "flash_attention_backward_bf16 runs on CUDA only");
  if (a.Tk == 0 || a.Tq == 0) return;
  launch_bf16_kernel("flash_attention_backward_bf16", a.hd, [&](auto hd) {
    constexpr int HD = decltype(hd)::value;
    const size_t bytes = (size_t)(2 * kMmaTile + 2 * kMmaQueryTile) * (HD + 8) * sizeof(bf16) +
                         (size_t)kMmaTile * (kMmaQueryTile + 8) * sizeof(bf16) +
                         2 * kMmaQueryTile * sizeof(float);
    allow_shared_memory(flash_backward_bf16_kernel<HD>, bytes);
    flash_backward_bf16_kernel<HD>
        <<<key_tile_grid(a, kMmaTile), 32 * kMmaWarps, bytes, ctx.stream>>>(dq, dk, dv, dout, q, k,
                                                                            v, lse, D, a);
  });
}

// ============================================================================
// LSE merge: two partial attentions of the same queries over disjoint keys (ring attention's step)
// ============================================================================

// out, out2 [B*Tq, Hq, hd]; lse, lse2 [B, Hq, Tq]; (out, lse) updated in place.
static void lse_merge_cpu(float* out, float* lse, const float* out2, const float* lse2,
                          const AttentionBlock& a) {
  for (int b = 0; b < a.B; b++)
    for (int h = 0; h < a.Hq; h++)
      for (int i = 0; i < a.Tq; i++) {
        float* l = lse + ((int64_t)b * a.Hq + h) * a.Tq + i;
        float w1, w2;
        *l = lse_merge_weights(*l, lse2[l - lse], &w1, &w2);
        const int64_t off = token_head(b, a.Tq, i, a.Hq, h, a.hd);
        for (int d = 0; d < a.hd; d++) out[off + d] = w1 * out[off + d] + w2 * out2[off + d];
      }
}

// One thread per (sequence, query, head) row, in the order of out (token-major).
__global__ void lse_merge_kernel(float* out, float* lse, const float* out2, const float* lse2,
                                 AttentionBlock a) {
  const int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int h = (int)(r % a.Hq), i = (int)(r / a.Hq % a.Tq), b = (int)(r / a.Hq / a.Tq);
    const int64_t l = ((int64_t)b * a.Hq + h) * a.Tq + i;
    float w1, w2;
    lse[l] = lse_merge_weights(lse[l], lse2[l], &w1, &w2);
    for (int d = 0; d < a.hd; d++)
      out[r * a.hd + d] = w1 * out[r * a.hd + d] + w2 * out2[r * a.hd + d];
  }
}

void attention_lse_merge(const Context& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& out2, const Tensor& lse2, const AttentionBlock& a) {
  check_block_args(
      ctx, a,
      {{&out, q_numel(a)}, {&lse, lse_numel(a)}, {&out2, q_numel(a)}, {&lse2, lse_numel(a)}});
  if (ctx.device == Device::CPU)
    return lse_merge_cpu(out.f32(), lse.f32(), out2.f32(), lse2.f32(), a);
  if (lse_numel(a) == 0) return;
  lse_merge_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(
      out.f32(), lse.f32(), out2.f32(), lse2.f32(), a);
  CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------

__global__ void convert_to_bf16_kernel(bf16* dst, const float* src, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = __float2bfloat16(src[i]);
}

void convert_to_bf16(const Context& ctx, bf16* dst, const float* src, int64_t n) {
  PICO_ASSERT(ctx.device == Device::CUDA, "convert_to_bf16 runs on CUDA only");
  if (n == 0) return;
  int blocks = (int)std::min<int64_t>((n + kRowKernelThreads - 1) / kRowKernelThreads, 4096);
  convert_to_bf16_kernel<<<blocks, kRowKernelThreads, 0, ctx.stream>>>(dst, src, n);
  CUDA_CHECK(cudaGetLastError());
}
