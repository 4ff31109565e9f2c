// flash_attention_kernels.cuh: what FlashAttention's CPU code (flash_attention.cu), its fp32
// CUDA kernels (flash_attention_cuda.cu) and its bf16 tensor-core kernels
// (flash_attention_bf16.cu) share: the offsets of the token-major layouts,
// the causal mask by global position, the log2 units of the kernels' softmax, the backward's
// per-query statistics and the launch grids. Internal to those two files: callers include
// flash_attention.cuh.
#pragma once
#include <cuda_bf16.h>

#include "flash_attention.cuh"

using bf16 = __nv_bfloat16;

// Element offset of (sequence b, token i, head h) in a token-major [B*T, H, hd] tensor.
__host__ __device__ inline int64_t token_head(int b, int T, int i, int H, int h, int hd) {
  return (((int64_t)b * T + i) * H + h) * hd;
}
// Elements of a block's q (out, dq, dout), of its k (v, dk, dv) and of its lse (D).
inline int64_t q_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Tq * a.Hq * a.hd;
}
inline int64_t kv_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Tk * a.Hkv * a.hd;
}
inline int64_t lse_numel(const AttentionBlock& a) {
  return (int64_t)a.B * a.Hq * a.Tq;
}
// The backward's D[b, h, i] = dout_i . out_i (dout, out [B*Tq, Hq, hd]; D [B, Hq, Tq]) on the
// host, summed in Acc: double in the fp32 reference (flash_attention.cu says why), float in the
// bf16 kernels' mirror, as their kernel sums.
template <typename Acc>
void out_dot_dout_host(float* D, const float* dout, const float* out, const AttentionBlock& a) {
  for (int b = 0; b < a.B; b++)
    for (int i = 0; i < a.Tq; i++)
      for (int h = 0; h < a.Hq; h++) {
        const int64_t off = token_head(b, a.Tq, i, a.Hq, h, a.hd);
        Acc dot = 0;
        for (int d = 0; d < a.hd; d++) dot += (Acc)dout[off + d] * out[off + d];
        D[((int64_t)b * a.Hq + h) * a.Tq + i] = (float)dot;
      }
}
// How many keys of [j0, j0 + n) query i sees: all n without the mask; with it, those at global
// position k0 + j <= q0 + i, always a prefix of the tile (0 for a tile wholly in the future).
__host__ __device__ inline int visible_keys(const AttentionBlock& a, int i, int j0, int n) {
  if (!a.causal) return n;
  int64_t seen = a.q0 + i - (a.k0 + j0) + 1;
  return (int)(seen < 0 ? 0 : seen < n ? seen : n);
}
// What a block costs (the ledger, runtime/ledger.cuh), whichever kernel runs it: the (query,
// key) pairs the mask lets through, 4 FLOPs per pair and head dimension forward (S = QK^T,
// then PV), 10 backward (S again, dP, dV, dQ, dK); q, k, v (and dout) read once, out (dq, dk,
// dv) written once, as FlashAttention's one pass does.
inline int64_t attention_pairs(const AttentionBlock& a) {
  int64_t pairs = 0;
  for (int i = 0; i < a.Tq; i++) pairs += visible_keys(a, i, 0, a.Tk);
  return pairs * a.B * a.Hq;
}
inline OpCost attention_cost(const AttentionBlock& a, bool backward, int element_bytes) {
  const double pairs = (double)attention_pairs(a), e = element_bytes;
  const double q = (double)q_numel(a), kv = (double)kv_numel(a), lse = (double)lse_numel(a);
  // 16-bit operands run on the tensor cores (the FlashAttention-2 kernels), fp32 on CUDA cores.
  const MathUnit unit = element_bytes == 2 ? MathUnit::Tensor16 : MathUnit::CudaCores;
  if (!backward) return {4 * pairs * a.hd, e * (q + 2 * kv), 4 * q + 4 * lse, 1, unit};
  return {10 * pairs * a.hd, e * (2 * q + 2 * kv) + 8 * lse, 4 * (q + 2 * kv), 1, unit};
}
// D = rowsum(dO * O): dout and out read (e bytes each), D written; `cleared` bytes of gradients
// set to zero in the same pass (the bf16 kernel's).
inline OpCost out_dot_dout_cost(const AttentionBlock& a, int element_bytes, double cleared = 0.0) {
  const double q = (double)q_numel(a);
  return {2.0 * q, 2.0 * element_bytes * q, 4.0 * (double)lse_numel(a) + cleared};
}
// The first query that sees key j0 (Tq when none does): backward skips the query tiles before it.
__host__ __device__ inline int first_query_seeing(const AttentionBlock& a, int j0) {
  if (!a.causal) return 0;
  int64_t i = a.k0 + j0 - a.q0;
  return (int)(i < 0 ? 0 : i < a.Tq ? i : a.Tq);
}

// The CUDA kernels keep scores in log2 units (q pre-scaled by log2(e)/sqrt(hd)), so each
// exponential is one exp2f; lse goes back to natural log as (m + log2 l) ln 2.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// lse (in log2 units) and D of queries [i0, i0 + rows) of head h, into shared memory; past Tq
// lse is -inf, which masks those queries out.
__device__ inline void load_query_stats(float* lse_s, float* D_s, const float* lse, const float* D,
                                        const AttentionBlock& a, int b, int h, int i0, int rows) {
  if (threadIdx.x >= rows) return;
  const bool in = i0 + threadIdx.x < a.Tq;
  const int64_t row = ((int64_t)b * a.Hq + h) * a.Tq + i0 + threadIdx.x;
  lse_s[threadIdx.x] = in ? lse[row] * kLog2e : -INFINITY;
  D_s[threadIdx.x] = in ? D[row] : 0.0f;
}

// The kernels' grid: (heads, sequences, tiles), the tiles slowest, so every head's and
// sequence's block of one tile is dispatched before any block of the next (GPUs hand out blocks
// in linear order, x fastest: observed, not promised). Under a causal mask
// the longest tiles (which the kernels take first) then start first and the shortest fill the
// last wave, rather than one long block running alone at the end; and the query heads of a
// group, which read the same K and V tiles, run side by side (L2 serves the rest). A block
// reads its tile, head and sequence from blockIdx.z, .x and .y (special registers: no register
// held for them). Tq (or Tk) = 0 gives zero blocks: the callers launch nothing then.
inline dim3 tile_grid(int tiles, int heads, int B) {
  PICO_ASSERT(tiles <= 65535 && B <= 65535,
              "attention grid of " + std::to_string(tiles) + " tiles and " + std::to_string(B) +
                  " sequences: at most 65535 each (a grid's y and z)");
  return dim3(heads, B, tiles);
}
// Grid of (query tiles, Hq, B) blocks of `tile` queries each.
inline dim3 query_tile_grid(const AttentionBlock& a, int tile) {
  return tile_grid((a.Tq + tile - 1) / tile, a.Hq, a.B);
}
// Grid of (key tiles, Hkv, B) blocks of `tile` keys each.
inline dim3 key_tile_grid(const AttentionBlock& a, int tile) {
  return tile_grid((a.Tk + tile - 1) / tile, a.Hkv, a.B);
}

// Threads per block of the kernels that take one (query, head) row or one element per thread.
constexpr int kRowKernelThreads = 256;

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

// ---- The fp32 CUDA kernels (flash_attention_cuda.cu), the GPU side of flash_attention.cu's
// dispatchers: same layouts and contracts as flash_attention_forward, _backward,
// attention_out_dot_dout and attention_lse_merge, raw device pointers on ctx's stream.
void flash_forward_cuda(const Context& ctx, float* out, float* lse, const float* q, const float* k,
                        const float* v, const AttentionBlock& a);
void flash_backward_cuda(const Context& ctx, float* dq, float* dk, float* dv, const float* dout,
                         const float* q, const float* k, const float* v, const float* lse,
                         const float* D, const AttentionBlock& a);
void out_dot_dout_cuda(const Context& ctx, float* D, const float* dout, const float* out,
                       const AttentionBlock& a);
// out2 in `out2_dtype`: F32, or BF16 (a block of the tensor-core kernels).
void lse_merge_cuda(const Context& ctx, float* out, float* lse, const void* out2, DType out2_dtype,
                    const float* lse2, const AttentionBlock& a);
