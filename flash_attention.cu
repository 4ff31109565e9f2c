// flash_attention.cu: FlashAttention (Playbook §12.8, FlashAttention-2's loop order), the
// attention core softmax(q k^T / sqrt(hd) + causal mask) v with grouped-query heads in O(T)
// memory. A query tile meets the key/value tiles one at a time; a running max and running sum
// rescale the output accumulated so far (the online softmax), and only the log-sum-exp per
// query is kept. Backward recomputes the probabilities tile by tile from it. The one idea:
// attention is GEMM, row softmax, GEMM, and the softmax can be computed a tile at a time, so the
// T x T matrix never exists.
// Here: the CPU reference (the tile loop), the fp32 CUDA kernels, D, the LSE merge and the
// dispatchers. Naive attention, which FlashAttention is tested against, is attention_naive.cu;
// the bf16 tensor-core kernels are flash_attention_bf16.cu.
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

#include "kernels/flash_attention_kernels.cuh"

// ============================================================================
// FlashAttention: the pieces every version shares
// ============================================================================

// The layout offsets and the causal mask (token_head, visible_keys, first_query_seeing) are in
// flash_attention_kernels.cuh, shared with the bf16 kernels.

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
// Workspace: S [Br, Bc] scores (fp32); in double: P [Br, Bc] the probabilities, V [Bc, hd] the
// tile's values, acc [Br, hd], m and l [Br].
// The sums l and acc are kept in double (P V through dgemm), so O is exact to its own fp32
// rounding: the backward's D = rowsum(dO * O) needs O to its last bits (attention_out_dot_dout
// says why). Summed in fp32, O carried four times its rounding error, and a trained model's
// q and k gradients 3-4 times the error fp32 needs (tests/test_golden.cu, the trained fixture).
static void flash_forward_tile_cpu(float* out, float* lse, const float* q, const float* k,
                                   const float* v, const AttentionBlock& a, int b, int h, int i0,
                                   float* S, double* P, double* V64, double* acc, double* m,
                                   double* l) {
  const int hd = a.hd, g = h / (a.Hq / a.Hkv), ldq = a.Hq * hd, ldk = a.Hkv * hd;
  const int rows = std::min(kCpuTileQ, a.Tq - i0);
  const float scale = 1.0f / sqrtf((float)hd);
  const float* Q = q + token_head(b, a.Tq, i0, a.Hq, h, hd);  // [rows, hd], leading dim ldq
  std::fill(m, m + rows, -INFINITY);                          // running max of each row's scores
  std::fill(l, l + rows, 0.0);                                // running sum of exp(score - m)
  std::fill(acc, acc + (int64_t)rows * hd, 0.0);              // running sum of exp(score - m) v
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
      float m_new = (float)m[r];
      for (int j = 0; j < seen; j++) m_new = fmaxf(m_new, s[j]);
      // The online softmax: what was summed under the old max is rescaled by exp(m - m_new).
      // A row that has seen no key yet keeps m = -inf and a zero P row (no -inf - -inf).
      const double correction = m_new == -INFINITY ? 1.0 : std::exp(m[r] - m_new);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // (seen = 0 then: all P are 0)
      double* p = P + r * kCpuTileK;
      for (int j = 0; j < cols; j++) p[j] = j < seen ? exp_nonpositive(s[j] - m_use) : 0.0f;
      double row_sum = 0.0;
      for (int j = 0; j < cols; j++) row_sum += p[j];
      l[r] = l[r] * correction + row_sum;
      m[r] = m_new;
      if (correction != 1.0)
        for (int d = 0; d < hd; d++) acc[r * hd + d] *= correction;
    }
    // acc[rows, hd] += P[rows, cols] V[cols, hd]
    for (int j = 0; j < cols; j++)
      for (int d = 0; d < hd; d++) V64[j * hd + d] = V[(int64_t)j * ldk + d];
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hd, cols, 1.0, P, kCpuTileK, V64,
                hd, 1.0, acc, hd);
  }
  for (int r = 0; r < rows; r++) {  // out = acc / l; lse = m + log l (-inf: no key seen)
    float* o = out + token_head(b, a.Tq, i0 + r, a.Hq, h, hd);
    const double inv = l[r] > 0.0 ? 1.0 / l[r] : 0.0;
    for (int d = 0; d < hd; d++) o[d] = (float)(acc[r * hd + d] * inv);
    lse[((int64_t)b * a.Hq + h) * a.Tq + i0 + r] =
        l[r] > 0.0 ? (float)(m[r] + std::log(l[r])) : -INFINITY;
  }
}

static void flash_forward_cpu(float* out, float* lse, const float* q, const float* k,
                              const float* v, const AttentionBlock& a) {
  const int q_tiles = (a.Tq + kCpuTileQ - 1) / kCpuTileQ, items = a.B * a.Hq * q_tiles;
  const int workers = cpu_workers(items);
  // Per worker: S [Br, Bc] in fp32; P [Br, Bc], V [Bc, hd], acc [Br, hd], m [Br], l [Br] in
  // double (two floats each). Independent of T: the O(T) part of flash attention's memory is
  // its output and lse, never a [T, T] buffer.
  const int64_t doubles =
      (int64_t)kCpuTileQ * kCpuTileK + (int64_t)kCpuTileK * a.hd + (int64_t)kCpuTileQ * (a.hd + 2);
  const int64_t per_worker = (int64_t)kCpuTileQ * kCpuTileK + 2 * doubles;  // in floats
  Tensor work = empty({workers, per_worker}, Mem::Workspace);
  run_on_cpu_workers(items, workers, [&](int item, int w) {
    float* S = work.f32() + w * per_worker;  // kCpuTileQ * kCpuTileK is even: doubles align
    double* P = (double*)(S + kCpuTileQ * kCpuTileK);
    double* V64 = P + kCpuTileQ * kCpuTileK;
    double* acc = V64 + (int64_t)kCpuTileK * a.hd;
    double* m = acc + (int64_t)kCpuTileQ * a.hd;
    int qt = item % q_tiles, h = item / q_tiles % a.Hq, b = item / q_tiles / a.Hq;
    flash_forward_tile_cpu(out, lse, q, k, v, a, b, h, qt * kCpuTileQ, S, P, V64, acc, m,
                           m + kCpuTileQ);
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

// ============================================================================
// D = rowsum(dO * O): the softmax backward's per-row term, once per (query, head)
// ============================================================================
// dP's softmax backward needs sum_j P_ij dP_ij per row, and that equals dO_i . O_i (Playbook
// §7.2's D = rowsum(dO ∘ O)), which needs neither P nor the keys: a ring computes it once.
// Precision: dS = P (dP - D) keeps only the differences between the dP_ij = dO_i . v_j, and in a
// trained model the v_j share a common part many times their spread, so the dP_ij of a row
// are nearly equal. An error e in D is then a large error in the small dP - D, the same on the
// whole row, and dQ_i gets e times the attention-weighted mean key, which shares the keys' own
// common part. D is summed in double here (and O made exact to its rounding by the forward);
// in fp32 both added errors comparable to D's rounding itself.

// D [B, Hq, Tq]; dout, out [B*Tq, Hq, hd]
static void out_dot_dout_cpu(float* D, const float* dout, const float* out,
                             const AttentionBlock& a) {
  for (int b = 0; b < a.B; b++)
    for (int i = 0; i < a.Tq; i++)
      for (int h = 0; h < a.Hq; h++) {
        const int64_t off = token_head(b, a.Tq, i, a.Hq, h, a.hd);
        double dot = 0.0;
        for (int d = 0; d < a.hd; d++) dot += (double)dout[off + d] * out[off + d];
        D[((int64_t)b * a.Hq + h) * a.Tq + i] = (float)dot;
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
// load_query_stats (flash_attention_kernels.cuh) brings a query tile's lse and D to shared memory.

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
