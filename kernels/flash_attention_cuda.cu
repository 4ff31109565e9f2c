// flash_attention_cuda.cu: FlashAttention's fp32 CUDA kernels (Playbook §12.8), the GPU side of
// flash_attention.cu, whose tiled CPU loops are the reference they are tested against: the
// forward and backward on CUDA cores, D = rowsum(dO * O), and the log-sum-exp merge of ring
// attention. The bf16 tensor-core versions are flash_attention_bf16.cu.
#include <algorithm>
#include <type_traits>

#include "kernels/flash_attention_kernels.cuh"

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

// out, q [B*Tq, Hq, hd]; k, v [B*Tk, Hkv, hd]; lse [B, Hq, Tq]. Grid (Hq, B, query tiles).
template <int MAX_HD>
__global__ void __launch_bounds__(kF32Tile* kRowThreads)
    flash_forward_f32_kernel(float* out, float* lse, const float* q, const float* k, const float* v,
                             AttentionBlock a) {
  constexpr int D = MAX_HD / kRowThreads;  // dims per thread
  __shared__ float Ks[kF32Tile][MAX_HD], Vs[kF32Tile][MAX_HD];
  // Causal: the last query tiles see the most keys; start them first so none runs alone at the end.
  const int i0 = (gridDim.z - 1 - blockIdx.z) * kF32Tile;
  const int h = blockIdx.x, b = blockIdx.y, g = h / (a.Hq / a.Hkv), hd = a.hd;
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
  const uint64_t draws = a.drop.on() ? a.drop.row(b, h, a.q0 + i) : 0;  // the row's dropout hash
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
      float p = exp2f(s[j] - m_use);
      l += p;  // the softmax's sum; under dropout the output sums the dropped probabilities
      if (a.drop.on() && j < seen) p *= a.drop.factor(draws, a.k0 + j0 + j);
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

// Calls launch(std::integral_constant<int, MAX_HD>) with the smallest of the fp32 kernels'
// register widths, 32, 64 or 128, that holds hd (any hd up to 128: the kernels mask the rest).
template <class Launch>
static void launch_f32_kernel(int hd, Launch launch) {
  PICO_ASSERT(hd <= kFlashMaxHeadDimCuda, "flash attention on CUDA: head dim " +
                                              std::to_string(hd) + " past " +
                                              std::to_string(kFlashMaxHeadDimCuda));
  if (hd <= 32)
    launch(std::integral_constant<int, 32>{});
  else if (hd <= 64)
    launch(std::integral_constant<int, 64>{});
  else
    launch(std::integral_constant<int, 128>{});
  CUDA_CHECK(cudaGetLastError());
}

void flash_forward_cuda(const Context& ctx, float* out, float* lse, const float* q, const float* k,
                        const float* v, const AttentionBlock& a) {
  if (a.Tq == 0) return;
  launch_f32_kernel(a.hd, [&](auto max_hd) {
    flash_forward_f32_kernel<decltype(max_hd)::value>
        <<<query_tile_grid(a, kF32Tile), kF32Tile * kRowThreads, 0, ctx.stream>>>(out, lse, q, k, v,
                                                                                  a);
  });
}

// ----------------------------------------------------------------------------
// CUDA, fp32 on CUDA cores. One block per (key tile, key/value head, sequence): four threads
// per key row, each holding its dims of k, v, dk, dv in registers, loop over the group's query
// heads and the query tiles that see the tile. Per query the row's four threads recompute the
// score and dP with two shuffles each, as in the forward kernel. dK, dV belong to the block
// alone and are added once at the end; dQ sums over key tiles of other blocks, so each block
// adds its part with atomicAdd (fp32 sums in an order that varies from run to run).
// load_query_stats (flash_attention_kernels.cuh) brings a query tile's lse and D to shared memory.

constexpr int kF32QueryTile = 16;  // queries per inner step: 34 KiB of shared memory at hd 128

// dq, dout, q [B*Tq, Hq, hd]; dk, dv, k, v [B*Tk, Hkv, hd]; lse, D [B, Hq, Tq].
// Grid (Hkv, B, key tiles).
template <int MAX_HD>
__global__ void __launch_bounds__(kF32Tile* kRowThreads)
    flash_backward_f32_kernel(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* lse, const float* D,
                              AttentionBlock a) {
  constexpr int DIMS = MAX_HD / kRowThreads, BQ = kF32QueryTile;
  __shared__ float Ks[kF32Tile][MAX_HD];  // for dQ = dS K, which mixes every key row
  __shared__ float Qs[BQ][MAX_HD], dOs[BQ][MAX_HD], dSs[BQ][kF32Tile + 1];
  __shared__ float lse_s[BQ], D_s[BQ];
  const int j0 = blockIdx.z * kF32Tile, g = blockIdx.x, b = blockIdx.y, hd = a.hd;
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
        // Dropout (flash_attention.cu's backward says why): dP and dV see the dropped P.
        const float f = seen && a.drop.on() ? a.drop.factor(b, h, a.q0 + i0 + ii, a.k0 + j) : 1.0f;
        const float p = seen ? exp2f(s - lse_s[ii]) : 0.0f, ds = p * (f * dp - D_s[ii]);
#pragma unroll
        for (int e = 0; e < DIMS; e++) {
          dvr[e] += f * p * dOs[ii][c + kRowThreads * e];
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

void flash_backward_cuda(const Context& ctx, float* dq, float* dk, float* dv, const float* dout,
                         const float* q, const float* k, const float* v, const float* lse,
                         const float* D, const AttentionBlock& a) {
  if (a.Tk == 0 || a.Tq == 0) return;
  launch_f32_kernel(a.hd, [&](auto max_hd) {
    flash_backward_f32_kernel<decltype(max_hd)::value>
        <<<key_tile_grid(a, kF32Tile), kF32Tile * kRowThreads, 0, ctx.stream>>>(dq, dk, dv, dout, q,
                                                                                k, v, lse, D, a);
  });
}

// ----------------------------------------------------------------------------
// D = rowsum(dO * O) and the log-sum-exp merge: one thread per (sequence, query, head) row

// One thread per (sequence, query, head) row (the bf16 version, a warp a row, is
// flash_attention_bf16.cu's).
__global__ void out_dot_dout_kernel(float* D, const float* dout, const float* out,
                                    AttentionBlock a) {
  const int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int h = (int)(r % a.Hq), i = (int)(r / a.Hq % a.Tq), b = (int)(r / a.Hq / a.Tq);
    float dot = 0.0f;
    for (int d = 0; d < a.hd; d++) dot += dout[r * a.hd + d] * out[r * a.hd + d];
    D[((int64_t)b * a.Hq + h) * a.Tq + i] = dot;
  }
}

// Blocks for one thread per (query, head) row, capped (the kernels loop over the rest).
static int row_kernel_blocks(const AttentionBlock& a) {
  int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  return (int)std::min<int64_t>((rows + kRowKernelThreads - 1) / kRowKernelThreads, 4096);
}

void out_dot_dout_cuda(const Context& ctx, float* D, const float* dout, const float* out,
                       const AttentionBlock& a) {
  if ((int64_t)a.B * a.Hq * a.Tq == 0) return;
  out_dot_dout_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(D, dout, out, a);
  CUDA_CHECK(cudaGetLastError());
}

// One thread per (sequence, query, head) row, in the order of out (token-major); out2 fp32 or bf16.
template <class T2>
__global__ void lse_merge_kernel(float* out, float* lse, const T2* out2, const float* lse2,
                                 AttentionBlock a) {
  const int64_t rows = (int64_t)a.B * a.Tq * a.Hq;
  for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows;
       r += (int64_t)gridDim.x * blockDim.x) {
    const int h = (int)(r % a.Hq), i = (int)(r / a.Hq % a.Tq), b = (int)(r / a.Hq / a.Tq);
    const int64_t l = ((int64_t)b * a.Hq + h) * a.Tq + i;
    float w1, w2;
    lse[l] = lse_merge_weights(lse[l], lse2[l], &w1, &w2);
    for (int d = 0; d < a.hd; d++)
      out[r * a.hd + d] = w1 * out[r * a.hd + d] + w2 * (float)out2[r * a.hd + d];
  }
}

void lse_merge_cuda(const Context& ctx, float* out, float* lse, const void* out2, DType out2_dtype,
                    const float* lse2, const AttentionBlock& a) {
  if ((int64_t)a.B * a.Hq * a.Tq == 0) return;
  PICO_ASSERT(out2_dtype == DType::F32 || out2_dtype == DType::BF16, "lse_merge_cuda: out2 format");
  if (out2_dtype == DType::BF16)
    lse_merge_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(
        out, lse, (const __nv_bfloat16*)out2, lse2, a);
  else
    lse_merge_kernel<<<row_kernel_blocks(a), kRowKernelThreads, 0, ctx.stream>>>(
        out, lse, (const float*)out2, lse2, a);
  CUDA_CHECK(cudaGetLastError());
}
