// flash_attention.cu: causal attention with grouped-query heads, forward and backward.
// For now this is naive attention (Playbook §2.5): per (sequence, head) a GEMM for the scores,
// a causal row softmax, and a GEMM for the output, keeping the [B, Hq, T, T] probabilities for
// backward: the 5as^2b term of §2.5's activation memory. FlashAttention (Playbook §12.8) comes
// later in this file. The one idea: attention is GEMM, row softmax, GEMM (and its backward four
// GEMMs around the softmax's backward); only the T x T matrix in between grows with T^2.
#include "flash_attention.cuh"

#include <cmath>
#include <initializer_list>
#include <string>
#include <utility>

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

void causal_softmax_forward(const Context& ctx, float* probs, const float* scores, int rows,
                            int T, float scale) {
  if (ctx.device == Device::CPU) return causal_softmax_forward_cpu(probs, scores, rows, T, scale);
  int64_t n_rows = (int64_t)rows * T;
  if (n_rows == 0) return;  // a zero-block grid is a launch error, not a no-op
  int blocks = (int)((n_rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  causal_softmax_forward_kernel<<<blocks, 32 * kWarpsPerBlock, 0, ctx.stream>>>(
      probs, scores, n_rows, T, scale);
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
// naive attention: one GEMM per (sequence, head) on strided views, no copies
// ============================================================================
// q rows are tokens with Hq*hd floats each, so head h of sequence b is a [T, hd] matrix
// starting at q + (b*T*Hq + h)*hd with leading dimension Hq*hd; likewise k, v with Hkv.
// The GEMMs dispatch on ctx.device, so only the softmax above needs a kernel of its own.
// (A production version would batch these GEMMs; one call per head keeps the math visible.)

// The [T, hd] slice of head `head` in sequence b of a [B*T, H, hd] tensor.
static float* head_slice(const Tensor& x, int b, int head, int H, const AttentionShape& s) {
  return x.f32() + ((int64_t)b * s.T * H + head) * s.hd;
}
// The [T, T] slice of (b, h) in a [B, Hq, T, T] tensor.
static float* score_slice(const Tensor& x, int b, int h, const AttentionShape& s) {
  return x.f32() + ((int64_t)b * s.Hq + h) * s.T * s.T;
}

static void check_attention_args(const Context& ctx, const AttentionShape& s,
                                 std::initializer_list<std::pair<const Tensor*, int>> tensors) {
  PICO_ASSERT(s.Hkv > 0 && s.Hq % s.Hkv == 0,
              "attention: Hq " + std::to_string(s.Hq) + " not a multiple of Hkv " +
                  std::to_string(s.Hkv));
  // width: floats per token (Hq*hd or Hkv*hd); 0 marks a [B, Hq, T, T] probabilities tensor.
  for (auto [t, width] : tensors) {
    int64_t want = width > 0 ? (int64_t)s.B * s.T * width : (int64_t)s.B * s.Hq * s.T * s.T;
    PICO_ASSERT(t->numel() == want && t->device == ctx.device,
                "attention tensor " + t->shape_str() + " on " + device_name(t->device) +
                    ", expected " + std::to_string(want) + " floats on " +
                    device_name(ctx.device));
  }
}

void attention_forward(const Context& ctx, const Tensor& out, const Tensor& probs,
                       const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionShape& s) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s, {{&out, qw}, {&q, qw}, {&k, kvw}, {&v, kvw}, {&probs, 0}});
  // S[T, T] = Q_h[T, hd] K_g[T, hd]^T, unscaled: the softmax applies 1/sqrt(hd).
  for (int b = 0; b < s.B; b++)
    for (int h = 0; h < s.Hq; h++)
      gemm(ctx, false, true, T, T, hd, 1.0f, head_slice(q, b, h, s.Hq, s), qw,
           head_slice(k, b, h / group, s.Hkv, s), kvw, 0.0f, score_slice(probs, b, h, s), T);
  // In place: the scores become the probabilities saved for backward.
  causal_softmax_forward(ctx, probs.f32(), probs.f32(), s.B * s.Hq, T, 1.0f / sqrtf((float)hd));
  // O_h[T, hd] = P[T, T] V_g[T, hd], written straight into its columns of out.
  for (int b = 0; b < s.B; b++)
    for (int h = 0; h < s.Hq; h++)
      gemm(ctx, false, false, T, hd, T, 1.0f, score_slice(probs, b, h, s), T,
           head_slice(v, b, h / group, s.Hkv, s), kvw, 0.0f, head_slice(out, b, h, s.Hq, s), qw);
}

void attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& probs,
                        const Tensor& scratch, const AttentionShape& s) {
  int qw = s.Hq * s.hd, kvw = s.Hkv * s.hd, group = s.Hq / s.Hkv, T = s.T, hd = s.hd;
  check_attention_args(ctx, s,
                       {{&dq, qw}, {&dk, kvw}, {&dv, kvw}, {&dout, qw}, {&q, qw}, {&k, kvw},
                        {&v, kvw}, {&probs, 0}, {&scratch, 0}});
  // The heads of a group share one K_g, V_g, so their gradients sum: the first head of the
  // group writes (beta 0), the rest add (beta 1). No memset needed, and none to order.
  auto group_beta = [&](int h) { return h % group == 0 ? 0.0f : 1.0f; };
  for (int b = 0; b < s.B; b++)
    for (int h = 0; h < s.Hq; h++) {
      const float* dO = head_slice(dout, b, h, s.Hq, s);  // [T, hd], ld qw
      const float* P = score_slice(probs, b, h, s);       // [T, T]
      // dP[T, T] = dO_h V_g^T
      gemm(ctx, false, true, T, T, hd, 1.0f, dO, qw, head_slice(v, b, h / group, s.Hkv, s), kvw,
           0.0f, score_slice(scratch, b, h, s), T);
      // dV_g[T, hd] (+)= P^T dO_h
      gemm(ctx, true, false, T, hd, T, 1.0f, P, T, dO, qw, group_beta(h),
           head_slice(dv, b, h / group, s.Hkv, s), kvw);
    }
  // dS = scale * P * (dP - rowsum(P * dP)), in place over dP; zero above the diagonal.
  causal_softmax_backward(ctx, scratch.f32(), scratch.f32(), probs.f32(), s.B * s.Hq, T,
                          1.0f / sqrtf((float)hd));
  for (int b = 0; b < s.B; b++)
    for (int h = 0; h < s.Hq; h++) {
      const float* dS = score_slice(scratch, b, h, s);  // [T, T]
      // dQ_h[T, hd] = dS K_g
      gemm(ctx, false, false, T, hd, T, 1.0f, dS, T, head_slice(k, b, h / group, s.Hkv, s), kvw,
           0.0f, head_slice(dq, b, h, s.Hq, s), qw);
      // dK_g[T, hd] (+)= dS^T Q_h
      gemm(ctx, true, false, T, hd, T, 1.0f, dS, T, head_slice(q, b, h, s.Hq, s), qw,
           group_beta(h), head_slice(dk, b, h / group, s.Hkv, s), kvw);
    }
}
