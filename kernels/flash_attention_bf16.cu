// flash_attention_bf16.cu: FlashAttention-2 (Playbook §12.8) on tensor cores, bf16 inputs and fp32
// sums, forward and backward, on FlashAttention-2's structure (Dao, 2023): a thread block owns a
// tile of queries (forward) or of keys (backward) for the whole pass, warps split that tile's
// rows so no warp needs another's partial sums, and the other side streams past in
// double-buffered tiles. The algorithm is flash_attention.cu's (its CPU loop and the fp32
// kernels in flash_attention_cuda.cu are the readable versions); what changes is how a tile is
// computed: mma.sync on fragments that ldmatrix loads from shared memory, which cp.async fills
// while the previous tile is being used. The one idea: keep the tensor cores fed, by reusing each
// tile loaded from memory for as many rows as registers allow and by never waiting for a load
// that could have started earlier. Below each kernel, the CPU loop that mirrors it tile by tile.
// Guide: docs/flash-attention.md ("FlashAttention-2 on tensor cores").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/flash_attention_bf16.cuh"
#include "kernels/flash_attention_kernels.cuh"
#include "kernels/tensor_core.cuh"
#include "runtime/dtype.cuh"
#include "runtime/ops.cuh"

// Rows [row0, row0 + ROWS) of head `head` of a [B*T, H, HD] bf16 tensor into dst[ROWS][HD + 8],
// by cp.async, 16 bytes per copy: consecutive threads take consecutive 16 bytes of a row
// (coalesced), rows past T are zero-filled. The 8 padding elements shift each row by 4 banks,
// so the 8 rows an ldmatrix tile reads fall in 8 different bank groups (FlashAttention-2 gets
// the same from CUTLASS's swizzled layouts; padding is the simpler way, at 16 bytes a row).
template <int HD, int ROWS, int THREADS>
__device__ inline void copy_rows_async(bf16* dst, const bf16* src, int b, int T, int row0, int H,
                                       int head) {
  constexpr int chunks = HD / 8;  // 8 bf16 = 16 bytes
#pragma unroll
  for (int idx = threadIdx.x; idx < ROWS * chunks; idx += THREADS) {
    const int r = idx / chunks, col = idx % chunks * 8;
    const bool in = row0 + r < T;
    const bf16* from = in ? src + token_head(b, T, row0 + r, H, head, HD) + col : src;
    cp_async_16(dst + r * (HD + 8) + col, from, in);
  }
}

// ============================================================================
// Forward: out and lse
// ============================================================================
// One block per (128 queries, query head, sequence); GQA is in the grid: blocks of the heads of
// one group read the same K, V tiles (from L2 after the first). Warp w owns queries
// i0 + 32w .. +31 as two m16 tiles, so every K and V fragment it loads feeds two mma. Per key
// tile: S = Q K^T (32 x Bc, registers), the online softmax on those registers, O += P V with P
// taken from the same registers (rounded to bf16). The loads are two cp.async groups per tile,
// K then V: S waits only for K, P V only for V, and tile j+1's K is in flight during the softmax
// and P V of tile j, its V during the next S.
// FlashAttention-2's other changes from FlashAttention-1 are here too: O is divided by the row
// sum once at the end, not at every tile, and only lse (not max and sum) is kept for the backward.
template <int HD, bool DROPOUT>
__global__ void __launch_bounds__(32 * kFwdWarps)
    flash_forward_bf16_kernel(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                              AttentionBlock a) {
  constexpr int LD = HD + 8, BR = kFwdQueryTile, BC = fwd_key_tile(HD);
  constexpr int MT = kFwdRowsPerWarp / 16, THREADS = 32 * kFwdWarps;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);  // [BR][LD]
  bf16* Ks = Qs + BR * LD;                   // [2][BC][LD]
  bf16* Vs = Ks + 2 * BC * LD;               // [2][BC][LD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int i0 = (gridDim.z - 1 - blockIdx.z) * BR;  // longest causal tiles first
  const int h = blockIdx.x, b = blockIdx.y, kv = h / (a.Hq / a.Hkv);
  const float scale_log2 = kLog2e * (1.0f / sqrtf((float)HD));  // scores in log2 units
  const int n_tiles = (visible_keys(a, min(i0 + BR, a.Tq) - 1, 0, a.Tk) + BC - 1) / BC;
  // Accumulator row g + 8x of m-tile mt is query row0 + 16 mt + 8x.
  const int row0 = i0 + kFwdRowsPerWarp * warp + g;
  copy_rows_async<HD, BR, THREADS>(Qs, q, b, a.Tq, i0, a.Hq, h);
  copy_rows_async<HD, BC, THREADS>(Ks, k, b, a.Tk, 0, a.Hkv, kv);
  cp_async_commit();  // group: Q and K_0
  copy_rows_async<HD, BC, THREADS>(Vs, v, b, a.Tk, 0, a.Hkv, kv);
  cp_async_commit();  // group: V_0

  float o[MT][HD / 8][4] = {};  // O (32 x HD): HD/8 accumulator tiles per m-tile
  float m[MT][2], l[MT][2];     // running max (log2 units) and this lane's part of the row sum
#pragma unroll
  for (int mt = 0; mt < MT; mt++) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
  for (int jt = 0; jt < n_tiles; jt++) {
    const int j0 = jt * BC;
    const bool more = jt + 1 < n_tiles;
    const bf16* Kt = Ks + (jt % 2) * BC * LD;
    const bf16* Vt = Vs + (jt % 2) * BC * LD;
    // Every group but the newest (V_j) has landed: K_j (and Q); the barrier makes it everyone's.
    // Buffer (j+1) % 2 was last read in iteration j-1, which every warp has left by now.
    cp_async_wait<1>();
    __syncthreads();
    float s[MT][BC / 8][4] = {};  // S (32 x BC): BC/8 tiles of 8 keys per m-tile
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
        load_a_fragment(qa[mt], Qs, LD, kFwdRowsPerWarp * warp + 16 * mt, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BC / 16; np++) {
        uint32_t kb[4];
        load_b_fragments_of_transpose(kb, Kt, LD, 16 * kk, 16 * np, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16_16816(s[mt][2 * np], qa[mt], kb);
          mma_bf16_16816(s[mt][2 * np + 1], qa[mt], kb + 2);
        }
      }
    }
    if (more) {
      copy_rows_async<HD, BC, THREADS>(Ks + ((jt + 1) % 2) * BC * LD, k, b, a.Tk, j0 + BC, a.Hkv,
                                       kv);
      cp_async_commit();  // group: K_{j+1}
    }
    // The mask costs a comparison per score only on tiles that cross the diagonal or Tk.
    const bool edge = j0 + BC > a.Tk || (a.causal && a.k0 + j0 + BC - 1 > a.q0 + i0);
    float m_use[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      float m_new[2] = {m[mt][0], m[mt][1]};
#pragma unroll
      for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int x = e / 2, col = j0 + 8 * nt + 2 * t + e % 2;
          float sc = s[mt][nt][e] * scale_log2;
          if (edge && (col >= a.Tk || (a.causal && a.k0 + col > a.q0 + row0 + 16 * mt + 8 * x)))
            sc = -INFINITY;
          s[mt][nt][e] = sc;
          m_new[x] = fmaxf(m_new[x], sc);
        }
#pragma unroll
      for (int x = 0; x < 2; x++) {
        m_new[x] = quad_max(m_new[x]);  // the row's other columns live in the quad's lanes
        m_use[mt][x] = m_new[x] == -INFINITY ? 0.0f : m_new[x];  // nothing seen yet: no NaN
        const float correction = exp2f(m[mt][x] - m_use[mt][x]);
        l[mt][x] *= correction;
#pragma unroll
        for (int nd = 0; nd < HD / 8; nd++)
          o[mt][nd][2 * x] *= correction, o[mt][nd][2 * x + 1] *= correction;
        m[mt][x] = m_new[x];
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      uint64_t draws[2] = {};  // dropout: each of the lane's two rows hashed once per tile
#pragma unroll
      for (int x = 0; DROPOUT && x < 2; x++)
        draws[x] = a.drop.row(b, h, a.q0 + row0 + 16 * mt + 8 * x);
#pragma unroll
      for (int nt = 0; nt < BC / 8; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
          s[mt][nt][e] = exp2f(s[mt][nt][e] - m_use[mt][e / 2]);
          l[mt][e / 2] += s[mt][nt][e];  // the softmax's sum; dropout acts on what meets V
          if (DROPOUT)
            s[mt][nt][e] *= a.drop.factor(draws[e / 2], a.k0 + j0 + 8 * nt + 2 * t + e % 2);
        }
    }
    // V_j has landed (only K_{j+1} may still be in flight).
    if (more)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int kc = 0; kc < BC / 16; kc++) {  // O += P V, 16 keys per step
      uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; mt++) a_from_accumulators(pa[mt], s[mt][2 * kc], s[mt][2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < HD / 16; dp++) {
        uint32_t vb[4];
        load_b_fragments(vb, Vt, LD, 16 * kc, 16 * dp, lane);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          mma_bf16_16816(o[mt][2 * dp], pa[mt], vb);
          mma_bf16_16816(o[mt][2 * dp + 1], pa[mt], vb + 2);
        }
      }
    }
    if (more) {
      copy_rows_async<HD, BC, THREADS>(Vs + ((jt + 1) % 2) * BC * LD, v, b, a.Tk, j0 + BC, a.Hkv,
                                       kv);
      cp_async_commit();  // group: V_{j+1}
    }
  }
  cp_async_wait<0>();  // a block that saw no key leaves no copy in flight
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
#pragma unroll
    for (int x = 0; x < 2; x++) {
      const float sum = quad_sum(l[mt][x]);
      const int row = row0 + 16 * mt + 8 * x;
      if (row >= a.Tq) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      bf16* orow = out + token_head(b, a.Tq, row, a.Hq, h, HD);
#pragma unroll
      for (int nd = 0; nd < HD / 8; nd++)
        *reinterpret_cast<uint32_t*>(orow + 8 * nd + 2 * t) =
            pack_bf16x2(o[mt][nd][2 * x] * inv, o[mt][nd][2 * x + 1] * inv);
      if (t == 0)
        lse[((int64_t)b * a.Hq + h) * a.Tq + row] =
            sum > 0.0f ? (m[mt][x] + log2f(sum)) * kLn2 : -INFINITY;
    }
}

// ----------------------------------------------------------------------------
// CPU mirror of the forward: per (sequence, head, 128-query tile), the tile's key tiles of Bc in
// order, every row through the same steps: fp32 scores in log2 units, masked to -inf, the new
// max, exp2 of the old max minus the new one rescaling l and O, P = exp2(s - max) summed into l
// unrounded but rounded to bf16 before P V (under dropout, F P rounded), out = bf16(O / l).

static float to_bf16_value(float x) {
  return bf16_to_float(float_to_bf16(x));
}

void flash_forward_bf16_cpu(float* out, float* lse, const float* q, const float* k, const float* v,
                            const AttentionBlock& a) {
  const int hd = a.hd, BR = kFwdQueryTile, BC = fwd_key_tile(hd), group = a.Hq / a.Hkv;
  const float scale_log2 = kLog2e * (1.0f / sqrtf((float)hd));
  run_on_cpu_workers(a.B * a.Hq, cpu_workers(a.B * a.Hq), [&](int item, int) {
    const int b = item / a.Hq, h = item % a.Hq, kv = h / group;
    std::vector<float> s(BC), o(hd);
    for (int i0 = 0; i0 < a.Tq; i0 += BR) {
      const int n_tiles = (visible_keys(a, std::min(i0 + BR, a.Tq) - 1, 0, a.Tk) + BC - 1) / BC;
      for (int i = i0; i < std::min(i0 + BR, a.Tq); i++) {
        const float* qi = q + token_head(b, a.Tq, i, a.Hq, h, hd);
        const int seen = visible_keys(a, i, 0, a.Tk);
        float m = -INFINITY, l = 0.0f;
        std::fill(o.begin(), o.end(), 0.0f);
        for (int j0 = 0; j0 < n_tiles * BC; j0 += BC) {
          float m_new = m;
          for (int c = 0; c < BC; c++) {
            s[c] = -INFINITY;
            if (j0 + c >= seen) continue;
            const float* kj = k + token_head(b, a.Tk, j0 + c, a.Hkv, kv, hd);
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += qi[d] * kj[d];
            s[c] = dot * scale_log2;
            m_new = std::max(m_new, s[c]);
          }
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;
          const float correction = exp2f(m - m_use);
          l *= correction;
          for (float& x : o) x *= correction;
          m = m_new;
          for (int c = 0; c < BC; c++) {
            const float p = exp2f(s[c] - m_use);
            l += p;
            const float f = a.drop.on() ? a.drop.factor(b, h, a.q0 + i, a.k0 + j0 + c) : 1.0f;
            const float pb = to_bf16_value(f * p);
            if (pb == 0.0f) continue;  // also every masked column (and those past Tk)
            const float* vj = v + token_head(b, a.Tk, j0 + c, a.Hkv, kv, hd);
            for (int d = 0; d < hd; d++) o[d] += pb * vj[d];
          }
        }
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        float* oi = out + token_head(b, a.Tq, i, a.Hq, h, hd);
        for (int d = 0; d < hd; d++) oi[d] = to_bf16_value(o[d] * inv);
        lse[((int64_t)b * a.Hq + h) * a.Tq + i] = l > 0.0f ? (m + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  });
}

// ----------------------------------------------------------------------------

// Launches kernel<HD, DROPOUT> for the bf16 head dims, with its dynamic shared memory allowed past
// the 48 KiB default (up to 227 KiB on sm_90, 163 KiB on sm_80). Dropout is a template argument,
// so the kernels without it hold no code (and no registers) for it.
template <class Launch>
static void launch_bf16_kernel(const char* what, int hd, bool dropout, Launch launch) {
  PICO_ASSERT(bf16_head_dim(hd), std::string(what) + ": bf16 head dim " + std::to_string(hd) +
                                     " (supported: 16, 32, 64, 128)");
  auto with_hd = [&](auto hd_constant) {
    if (dropout)
      launch(hd_constant, std::true_type{});
    else
      launch(hd_constant, std::false_type{});
  };
  if (hd == 16)
    with_hd(std::integral_constant<int, 16>{});
  else if (hd == 32)
    with_hd(std::integral_constant<int, 32>{});
  else if (hd == 64)
    with_hd(std::integral_constant<int, 64>{});
  else
    with_hd(std::integral_constant<int, 128>{});
  CUDA_CHECK(cudaGetLastError());
}
// Past 48 KiB a kernel must ask for its shared memory. The tiles fit an A100's 163 KiB and a
// Hopper's 227 KiB; a GPU that offers less (sm_86 and sm_89: 99 KiB, too little for the
// backward's at head dim 128) gets a message rather than a failed launch. Asked once per kernel
// and device (a kernel's tiles, and so its bytes, are fixed by its template arguments).
template <class Kernel>
static void allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return;
  int device = 0, most = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::set<std::pair<const void*, int>> allowed;
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<const void*, int> key{(const void*)kernel, device};
  if (allowed.count(key)) return;
  CUDA_CHECK(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  PICO_ASSERT(bytes <= (size_t)most, "bf16 FlashAttention needs " + std::to_string(bytes / 1024) +
                                         " KiB of shared memory a block and this GPU offers " +
                                         std::to_string(most / 1024) +
                                         " KiB (--dtype fp32 runs the fp32 kernels)");
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  allowed.insert(key);
}
// cp.async copies 16 bytes at a time: every row must start on a 16-byte boundary.
static bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

void flash_attention_forward_bf16(const Context& ctx, bf16* out, float* lse, const bf16* q,
                                  const bf16* k, const bf16* v, const AttentionBlock& a) {
  if (count_op(ctx.device, OpKind::Attention, attention_cost(a, false, 2))) return;
  PICO_ASSERT(ctx.device == Device::CUDA, "flash_attention_forward_bf16 runs on CUDA only");
  if (a.Tq == 0) return;
  PICO_ASSERT(aligned16(q) && aligned16(k) && aligned16(v) && (uintptr_t)out % 4 == 0,
              "flash_attention_forward_bf16: q, k, v must be 16-byte aligned, out 4-byte");
  launch_bf16_kernel("flash_attention_forward_bf16", a.hd, a.drop.on(), [&](auto hd, auto drop) {
    constexpr int HD = decltype(hd)::value;
    constexpr bool DROPOUT = decltype(drop)::value;
    const size_t bytes = fwd_shared_bytes(HD);
    allow_shared_memory(flash_forward_bf16_kernel<HD, DROPOUT>, bytes);
    flash_forward_bf16_kernel<HD, DROPOUT>
        <<<query_tile_grid(a, kFwdQueryTile), 32 * kFwdWarps, bytes, ctx.stream>>>(out, lse, q, k,
                                                                                   v, a);
  });
}

// ============================================================================
// Backward: dQ, dK, dV, P recomputed from lse, everything transposed (keys as rows)
// ============================================================================
// One block per (128 keys, query head, sequence): GQA is in the grid here too, so a group's
// heads run in parallel blocks (which add into the same dK, dV at the end) instead of one block
// looping over them. Warp w owns keys j0 + 16w .. +15 and keeps their dK, dV (16 x hd each,
// fp32) in registers for the whole pass; K and V stay in shared memory for it, while Q, dO, lse
// and D of successive query tiles stream past, double-buffered (cp.async: tile i+1 loads while
// tile i is used). Per query tile everything is computed transposed, keys as rows, so a warp's
// rows stay its own: S^T = K Q^T, dP^T = V dO^T, P^T and dS^T = P^T (dP^T - D) in registers,
// dV += P^T dO and dK += dS^T Q with P^T and dS^T fed from registers.
// dQ = dS K mixes all 128 keys, so dS^T goes through shared memory and each block adds its part
// of dQ with fp32 atomics: FlashAttention-2's choice. The alternative, a second pass with query
// tiles outer, would recompute S and dP (two of the five GEMMs, 40% more work) to avoid the
// atomics; those cost one red.add per dQ element per key tile (Tk/128 per element), which L2
// absorbs, at the price of dQ's last bits varying from run to run.

// lse (as log2) and D of queries [i0, i0 + rows) of head h into shared memory. A query past Tq,
// or one that sees no key at all (lse -inf), gets +inf: exp2(s - inf) = 0, so it adds nothing
// and needs no mask. Under dropout (draws_s given), also each query row's half of the dropout
// hash, so a score costs one hash, not two and a load of the sequence's number.
__device__ inline void load_query_stats_log2(float* lse_s, float* D_s, uint64_t* draws_s,
                                             const float* lse, const float* D,
                                             const AttentionBlock& a, int b, int h, int i0,
                                             int rows) {
  for (int r = threadIdx.x; r < rows; r += blockDim.x) {
    const int64_t at = ((int64_t)b * a.Hq + h) * a.Tq + i0 + r;
    const float L = i0 + r < a.Tq ? lse[at] : -INFINITY;
    lse_s[r] = L == -INFINITY ? INFINITY : L * kLog2e;
    D_s[r] = i0 + r < a.Tq ? D[at] : 0.0f;
    if (draws_s) draws_s[r] = a.drop.row(b, h, a.q0 + i0 + r);
  }
}

template <int HD, bool DROPOUT>
__global__ void __launch_bounds__(32 * kBwdWarps)
    flash_backward_bf16_kernel(float* dq, float* dk, float* dv, const bf16* dout, const bf16* q,
                               const bf16* k, const bf16* v, const float* lse, const float* D,
                               AttentionBlock a) {
  constexpr int LD = HD + 8, BC = kBwdKeyTile, BR = bwd_query_tile(HD), LDS = BR + 8;
  constexpr int THREADS = 32 * kBwdWarps;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);                 // [BC][LD]
  bf16* Vs = Ks + BC * LD;                                  // [BC][LD]
  bf16* Qs = Vs + BC * LD;                                  // [2][BR][LD]
  bf16* dOs = Qs + 2 * BR * LD;                             // [2][BR][LD]
  bf16* dSt = dOs + 2 * BR * LD;                            // [BC keys][LDS]: dS transposed
  float* lse_s = reinterpret_cast<float*>(dSt + BC * LDS);  // [2][BR], log2 units
  float* D_s = lse_s + 2 * BR;                              // [2][BR]
  uint64_t* draws_s = DROPOUT ? reinterpret_cast<uint64_t*>(D_s + 2 * BR) : nullptr;  // [2][BR]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int j0 = blockIdx.z * BC, h = blockIdx.x, b = blockIdx.y;  // key tile 0 (longest) first
  const int group = a.Hq / a.Hkv, kv = h / group;
  const int i_first = first_query_seeing(a, j0);
  if (i_first >= a.Tq) return;  // causal: no query sees these keys (the whole block returns)
  const int tile0 = i_first / BR, n_tiles = (a.Tq + BR - 1) / BR - tile0;
  const float scale = 1.0f / sqrtf((float)HD), scale_log2 = scale * kLog2e;
  copy_rows_async<HD, BC, THREADS>(Ks, k, b, a.Tk, j0, a.Hkv, kv);
  copy_rows_async<HD, BC, THREADS>(Vs, v, b, a.Tk, j0, a.Hkv, kv);
  copy_rows_async<HD, BR, THREADS>(Qs, q, b, a.Tq, tile0 * BR, a.Hq, h);
  copy_rows_async<HD, BR, THREADS>(dOs, dout, b, a.Tq, tile0 * BR, a.Hq, h);
  cp_async_commit();  // group: K, V, Q_0, dO_0
  load_query_stats_log2(lse_s, D_s, draws_s, lse, D, a, b, h, tile0 * BR, BR);

  float dk_acc[HD / 8][4] = {}, dv_acc[HD / 8][4] = {};  // 16 keys x HD each
  const int key[2] = {j0 + 16 * warp + g, j0 + 16 * warp + g + 8};
  for (int n = 0; n < n_tiles; n++) {
    const int i0 = (tile0 + n) * BR, buf = n % 2;
    // Buffer (n+1) % 2 was last read before iteration n-1's second barrier, which every warp
    // has passed: the next tile's copies can start now and land during this tile's math.
    if (n + 1 < n_tiles) {
      copy_rows_async<HD, BR, THREADS>(Qs + (1 - buf) * BR * LD, q, b, a.Tq, i0 + BR, a.Hq, h);
      copy_rows_async<HD, BR, THREADS>(dOs + (1 - buf) * BR * LD, dout, b, a.Tq, i0 + BR, a.Hq, h);
      cp_async_commit();  // group: Q, dO of the next tile
      load_query_stats_log2(lse_s + (1 - buf) * BR, D_s + (1 - buf) * BR,
                            DROPOUT ? draws_s + (1 - buf) * BR : nullptr, lse, D, a, b, h, i0 + BR,
                            BR);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this tile's Q, dO, lse, D are everyone's
    const bf16* Qt = Qs + buf * BR * LD;
    const bf16* dOt = dOs + buf * BR * LD;
    const float* Ls = lse_s + buf * BR;
    const float* Ds = D_s + buf * BR;
    const uint64_t* draws = DROPOUT ? draws_s + buf * BR : nullptr;
    float st[BR / 8][4] = {}, dpt[BR / 8][4] = {};  // S^T and dP^T: 16 keys x BR queries
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
      uint32_t ka[4], va[4];
      load_a_fragment(ka, Ks, LD, 16 * warp, 16 * kk, lane);
      load_a_fragment(va, Vs, LD, 16 * warp, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BR / 16; np++) {
        uint32_t qb[4], ob[4];
        load_b_fragments_of_transpose(qb, Qt, LD, 16 * kk, 16 * np, lane);
        load_b_fragments_of_transpose(ob, dOt, LD, 16 * kk, 16 * np, lane);
        mma_bf16_16816(st[2 * np], ka, qb);
        mma_bf16_16816(st[2 * np + 1], ka, qb + 2);
        mma_bf16_16816(dpt[2 * np], va, ob);
        mma_bf16_16816(dpt[2 * np + 1], va, ob + 2);
      }
    }
    // P^T = exp2(S^T scale log2(e) - lse) (0 where masked), dS^T = P^T (dP^T - D), into dpt.
    // Under dropout (factor F): dV reads (F P)^T and dP^T is F V dO^T (flash_attention.cu).
    const bool edge = j0 + BC > a.Tk || (a.causal && a.k0 + j0 + BC - 1 > a.q0 + i0);
#pragma unroll
    for (int nt = 0; nt < BR / 8; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int qi = 8 * nt + 2 * t + e % 2, j = key[e / 2];
        float p = exp2f(st[nt][e] * scale_log2 - Ls[qi]);
        if (edge && (j >= a.Tk || (a.causal && a.k0 + j > a.q0 + i0 + qi))) p = 0.0f;
        const float f = DROPOUT ? a.drop.factor(draws[qi], a.k0 + j) : 1.0f;
        st[nt][e] = f * p;
        dpt[nt][e] = p * (f * dpt[nt][e] - Ds[qi]);
      }
#pragma unroll
    for (int kc = 0; kc < BR / 16; kc++) {  // over the tile's queries, 16 at a time
      uint32_t pa[4], sa[4];
      a_from_accumulators(pa, st[2 * kc], st[2 * kc + 1]);
      a_from_accumulators(sa, dpt[2 * kc], dpt[2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < HD / 16; dp++) {
        uint32_t ob[4], qb[4];
        load_b_fragments(ob, dOt, LD, 16 * kc, 16 * dp, lane);
        load_b_fragments(qb, Qt, LD, 16 * kc, 16 * dp, lane);
        mma_bf16_16816(dv_acc[2 * dp], pa, ob);
        mma_bf16_16816(dv_acc[2 * dp + 1], pa, ob + 2);
        mma_bf16_16816(dk_acc[2 * dp], sa, qb);
        mma_bf16_16816(dk_acc[2 * dp + 1], sa, qb + 2);
      }
    }
#pragma unroll
    for (int nt = 0; nt < BR / 8; nt++)
#pragma unroll
      for (int x = 0; x < 2; x++)
        *reinterpret_cast<uint32_t*>(dSt + (16 * warp + g + 8 * x) * LDS + 8 * nt + 2 * t) =
            pack_bf16x2(dpt[nt][2 * x], dpt[nt][2 * x + 1]);
    __syncthreads();  // dS^T complete
    // dQ (BR x HD) += scale dS K, in 16 x 16 pieces dealt to the warps in turn.
    for (int item = warp; item < BR / 16 * (HD / 16); item += kBwdWarps) {
      const int mt = item / (HD / 16), np = item % (HD / 16);
      float acc[2][4] = {};
#pragma unroll
      for (int kc = 0; kc < BC / 16; kc++) {
        uint32_t sa[4], kb[4];
        load_a_fragment_transposed(sa, dSt, LDS, 16 * mt, 16 * kc, lane);
        load_b_fragments(kb, Ks, LD, 16 * kc, 16 * np, lane);
        mma_bf16_16816(acc[0], sa, kb);
        mma_bf16_16816(acc[1], sa, kb + 2);
      }
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int i = i0 + 16 * mt + g + 8 * (e / 2);
        if (i >= a.Tq) continue;
        float* dqi = dq + token_head(b, a.Tq, i, a.Hq, h, HD) + 16 * np + 2 * t + e % 2;
        atomicAdd(dqi, scale * acc[0][e]);
        atomicAdd(dqi + 8, scale * acc[1][e]);
      }
    }
  }
  // dK, dV of this head's pass: alone on them under MHA, added atomically by the group's heads.
#pragma unroll
  for (int x = 0; x < 2; x++) {
    if (key[x] >= a.Tk) continue;
    const int64_t off = token_head(b, a.Tk, key[x], a.Hkv, kv, HD);
#pragma unroll
    for (int nd = 0; nd < HD / 8; nd++)
#pragma unroll
      for (int e = 0; e < 2; e++) {
        const int d = 8 * nd + 2 * t + e;
        if (group == 1) {
          dk[off + d] += scale * dk_acc[nd][2 * x + e];
          dv[off + d] += dv_acc[nd][2 * x + e];
        } else {
          atomicAdd(dk + off + d, scale * dk_acc[nd][2 * x + e]);
          atomicAdd(dv + off + d, dv_acc[nd][2 * x + e]);
        }
      }
  }
}

// ----------------------------------------------------------------------------
// CPU mirror of the backward: per (sequence, head, 128-key tile), the query tiles from the one
// holding the first query that sees the tile, every (query, key) pair through the same steps:
// P = exp2(s scale log2(e) - lse log2(e)) in fp32, dS = P (dP - D), both rounded to bf16 before
// they multiply (under dropout F P and P (F dP - D)); dV, dK summed over the whole pass in fp32 and
// added at its end (dK times the scale), dQ's part from one key tile summed in fp32 and added
// (times the scale) per query tile. The group's heads run in order (the kernel's blocks add theirs
// in any order).

void flash_backward_bf16_cpu(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* lse, const float* D,
                             const AttentionBlock& a) {
  const int hd = a.hd, BC = kBwdKeyTile, BR = bwd_query_tile(hd), group = a.Hq / a.Hkv;
  const float scale = 1.0f / sqrtf((float)hd), scale_log2 = scale * kLog2e;
  // Items (sequence, key/value head): each writes only its own dk, dv and its heads' dq.
  run_on_cpu_workers(a.B * a.Hkv, cpu_workers(a.B * a.Hkv), [&](int item, int) {
    const int b = item / a.Hkv, kv = item % a.Hkv;
    std::vector<float> dk_acc((size_t)BC * hd), dv_acc((size_t)BC * hd), dq_part(hd);
    for (int h = kv * group; h < (kv + 1) * group; h++)
      for (int j0 = 0; j0 < a.Tk; j0 += BC) {
        const int i_first = first_query_seeing(a, j0);
        if (i_first >= a.Tq) continue;
        std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
        for (int i = i_first / BR * BR; i < a.Tq; i++) {
          const int64_t qo = token_head(b, a.Tq, i, a.Hq, h, hd);
          const float* qi = q + qo;
          const float* dOi = dout + qo;
          const float L = lse[((int64_t)b * a.Hq + h) * a.Tq + i];
          const float L2 = L == -INFINITY ? INFINITY : L * kLog2e;
          const float Di = D[((int64_t)b * a.Hq + h) * a.Tq + i];
          std::fill(dq_part.begin(), dq_part.end(), 0.0f);
          for (int c = 0; c < BC && j0 + c < a.Tk; c++) {
            const int j = j0 + c;
            if (visible_keys(a, i, j, 1) == 0) continue;  // P = 0, dS = 0
            const float* kj = k + token_head(b, a.Tk, j, a.Hkv, kv, hd);
            const float* vj = v + token_head(b, a.Tk, j, a.Hkv, kv, hd);
            float s = 0.0f, dp = 0.0f;
            for (int d = 0; d < hd; d++) s += qi[d] * kj[d], dp += dOi[d] * vj[d];
            const float p = exp2f(s * scale_log2 - L2);
            const float f = a.drop.on() ? a.drop.factor(b, h, a.q0 + i, a.k0 + j) : 1.0f;
            const float pb = to_bf16_value(f * p), dsb = to_bf16_value(p * (f * dp - Di));
            for (int d = 0; d < hd; d++) {
              dv_acc[(size_t)c * hd + d] += pb * dOi[d];
              dk_acc[(size_t)c * hd + d] += dsb * qi[d];
              dq_part[d] += dsb * kj[d];
            }
          }
          for (int d = 0; d < hd; d++) dq[qo + d] += scale * dq_part[d];
        }
        for (int c = 0; c < BC && j0 + c < a.Tk; c++) {
          const int64_t ko = token_head(b, a.Tk, j0 + c, a.Hkv, kv, hd);
          for (int d = 0; d < hd; d++) {
            dk[ko + d] += scale * dk_acc[(size_t)c * hd + d];
            dv[ko + d] += dv_acc[(size_t)c * hd + d];
          }
        }
      }
  });
}

// ----------------------------------------------------------------------------

void flash_attention_backward_bf16(const Context& ctx, float* dq, float* dk, float* dv,
                                   const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                                   const float* lse, const float* D, const AttentionBlock& a) {
  if (count_op(ctx.device, OpKind::Attention, attention_cost(a, true, 2))) return;
  PICO_ASSERT(ctx.device == Device::CUDA, "flash_attention_backward_bf16 runs on CUDA only");
  if (a.Tk == 0 || a.Tq == 0) return;
  PICO_ASSERT(aligned16(dout) && aligned16(q) && aligned16(k) && aligned16(v),
              "flash_attention_backward_bf16: dout, q, k, v must be 16-byte aligned");
  launch_bf16_kernel("flash_attention_backward_bf16", a.hd, a.drop.on(), [&](auto hd, auto drop) {
    constexpr int HD = decltype(hd)::value;
    constexpr bool DROPOUT = decltype(drop)::value;
    const size_t bytes = bwd_shared_bytes(HD, DROPOUT);
    allow_shared_memory(flash_backward_bf16_kernel<HD, DROPOUT>, bytes);
    const dim3 grid = tile_grid((a.Tk + kBwdKeyTile - 1) / kBwdKeyTile, a.Hq, a.B);
    flash_backward_bf16_kernel<HD, DROPOUT>
        <<<grid, 32 * kBwdWarps, bytes, ctx.stream>>>(dq, dk, dv, dout, q, k, v, lse, D, a);
  });
}

// ============================================================================
// D = rowsum(dO * O) for the backward, and its sums cleared
// ============================================================================

// A warp per (sequence, query, head) row: its lanes read the row's consecutive bf16 values
// (coalesced), fp32 products summed across the warp by shuffles. Given dq, then the same launch
// sets dq, dk and dv to zero for the backward's sums (one kernel where four would run).
__global__ void out_dot_dout_bf16_kernel(float* D, const bf16* dout, const bf16* out,
                                         AttentionBlock a, float* dq, float* dk, float* dv,
                                         int64_t q_elems, int64_t kv_elems) {
  const int lane = threadIdx.x % 32;
  const int64_t thread = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t threads = (int64_t)gridDim.x * blockDim.x, rows = (int64_t)a.B * a.Tq * a.Hq;
  for (int64_t r = thread / 32; r < rows; r += threads / 32) {
    float dot = 0.0f;
    for (int d = lane; d < a.hd; d += 32)
      dot += __bfloat162float(dout[r * a.hd + d]) * __bfloat162float(out[r * a.hd + d]);
    for (int offset = 16; offset > 0; offset >>= 1)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const int h = (int)(r % a.Hq), i = (int)(r / a.Hq % a.Tq), b = (int)(r / a.Hq / a.Tq);
    if (lane == 0) D[((int64_t)b * a.Hq + h) * a.Tq + i] = dot;
  }
  if (!dq) return;
  for (int64_t e = thread; e < q_elems; e += threads) dq[e] = 0.0f;
  for (int64_t e = thread; e < kv_elems; e += threads) dk[e] = 0.0f, dv[e] = 0.0f;
}

void attention_out_dot_dout_bf16(const Context& ctx, float* D, const bf16* dout, const bf16* out,
                                 const AttentionBlock& a, float* dq, float* dk, float* dv) {
  PICO_ASSERT(!dq == !dk && !dk == !dv, "attention_out_dot_dout_bf16 clears dq, dk, dv or none");
  const double cleared = dq ? 4.0 * ((double)q_numel(a) + 2.0 * kv_numel(a)) : 0.0;
  if (count_op(ctx.device, OpKind::Attention, out_dot_dout_cost(a, 2, cleared))) return;
  PICO_ASSERT(ctx.device == Device::CUDA, "attention_out_dot_dout_bf16 runs on CUDA only");
  const int64_t work = std::max<int64_t>(32 * lse_numel(a), dq ? kv_numel(a) : 0);
  if (work == 0) return;
  const int blocks = (int)std::min<int64_t>((work + 255) / 256, 4096);
  out_dot_dout_bf16_kernel<<<blocks, 256, 0, ctx.stream>>>(D, dout, out, a, dq, dk, dv, q_numel(a),
                                                           kv_numel(a));
  CUDA_CHECK(cudaGetLastError());
}

// ============================================================================
// bf16 tensors (flash_attention.cu's calls, for bf16 operands)
// ============================================================================

static const bf16* bf16_ptr(const Tensor& t) {
  return (const bf16*)t.ptr;
}

void flash_forward_bf16(const Context& ctx, const Tensor& out, const Tensor& lse, const Tensor& q,
                        const Tensor& k, const Tensor& v, const AttentionBlock& a) {
  if (ctx.device != Device::CPU)
    return flash_attention_forward_bf16(ctx, (bf16*)out.ptr, lse.f32(), bf16_ptr(q), bf16_ptr(k),
                                        bf16_ptr(v), a);
  count_op(ctx.device, OpKind::Attention, attention_cost(a, false, 2));
  std::vector<float> o((size_t)out.numel());
  flash_forward_bf16_cpu(o.data(), lse.f32(), widened(q).data(), widened(k).data(),
                         widened(v).data(), a);
  cast_host(out.ptr, DType::BF16, o.data(), DType::F32, out.numel());
}

void flash_backward_bf16(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                         const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& lse, const Tensor& D, const AttentionBlock& a) {
  if (ctx.device != Device::CPU)
    return flash_attention_backward_bf16(ctx, dq.f32(), dk.f32(), dv.f32(), bf16_ptr(dout),
                                         bf16_ptr(q), bf16_ptr(k), bf16_ptr(v), lse.f32(), D.f32(),
                                         a);
  count_op(ctx.device, OpKind::Attention, attention_cost(a, true, 2));
  flash_backward_bf16_cpu(dq.f32(), dk.f32(), dv.f32(), widened(dout).data(), widened(q).data(),
                          widened(k).data(), widened(v).data(), lse.f32(), D.f32(), a);
}

void out_dot_dout_bf16(const Context& ctx, const Tensor& D, const Tensor& dout, const Tensor& out,
                       const AttentionBlock& a, const std::vector<Tensor>& cleared) {
  PICO_ASSERT(D.numel() == lse_numel(a) && dout.numel() == q_numel(a) &&
                  out.numel() == q_numel(a) && dout.dtype == DType::BF16 &&
                  out.dtype == DType::BF16 &&
                  (cleared.empty() ||
                   (cleared.size() == 3 && cleared[0].numel() == q_numel(a) &&
                    cleared[1].numel() == kv_numel(a) && cleared[2].numel() == kv_numel(a))),
              "out_dot_dout_bf16: D, dout, out (bf16) and dq, dk, dv of the block");
  if (ctx.device != Device::CPU) {
    float* g[3] = {nullptr, nullptr, nullptr};
    for (size_t i = 0; i < cleared.size(); i++) g[i] = cleared[i].f32();
    return attention_out_dot_dout_bf16(ctx, D.f32(), bf16_ptr(dout), bf16_ptr(out), a, g[0], g[1],
                                       g[2]);
  }
  PICO_ASSERT(cleared.empty(), "out_dot_dout_bf16 clears gradients on a GPU only");
  count_op(ctx.device, OpKind::Attention, out_dot_dout_cost(a, 2));
  out_dot_dout_host<float>(D.f32(), widened(dout).data(), widened(out).data(), a);
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
