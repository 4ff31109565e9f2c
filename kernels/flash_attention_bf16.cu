// flash_attention_bf16.cu: FlashAttention-2 (Playbook §12.8) on tensor cores: bf16 inputs,
// fp32 accumulation, through mma.sync m16n8k16 (sm_80 and newer). The algorithm is the one of
// flash_attention.cu (its CPU tile loop and fp32 kernels are the reference these kernels are
// tested against); what changes is who computes a tile: a warp's 16 rows of S = Q K^T and of
// O += P V each come from one instruction on fragments spread over its 32 lanes. The one idea:
// the accumulator of S = Q K^T is already laid out as the A operand of P V, so the
// probabilities never leave registers. attention_out_dot_dout_bf16 lives in flash_attention.cu,
// where one kernel computes D for either input type.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kernels/flash_attention_kernels.cuh"

// ============================================================================
// mma.sync m16n8k16: the fragments
// ============================================================================
// CUDA, bf16 on tensor cores: mma.sync.m16n8k16 (bf16 inputs, fp32 accumulation), the
// instruction FlashAttention-2 is built on (sm_80 and newer). Fragment layouts, from the PTX
// ISA: lane = 4 g + t holds
//   A (16 x 16, row-major): rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9 (4 registers)
//   B (16 x 8):             column g, rows 2t, 2t+1 and 2t+8, 2t+9           (2 registers)
//   C (16 x 8, fp32):       rows g and g + 8, columns 2t, 2t+1               (4 floats)
// each register holding two bf16, the lower index in the low half. The C fragments of two
// adjacent 8-column tiles are exactly an A fragment: FlashAttention-2 feeds the probabilities
// P to the next mma straight from registers.

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

// ============================================================================
// forward: out and lse, the online softmax on mma accumulators
// ============================================================================

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
// backward: P recomputed from lse, everything transposed (keys as rows)
// ============================================================================
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
// fp32 -> bf16
// ============================================================================

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
