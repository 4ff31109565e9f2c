// flash_attention.cu: FlashAttention (Playbook §12.8, FlashAttention-2's loop order), the
// attention core softmax(q k^T / sqrt(hd) + causal mask) v with grouped-query heads in O(T)
// memory. A query tile meets the key/value tiles one at a time; a running max and running sum
// rescale the output accumulated so far (the online softmax), and only the log-sum-exp per
// query is kept. Backward recomputes the probabilities tile by tile from it. The one idea:
// attention is GEMM, row softmax, GEMM, and the softmax can be computed a tile at a time, so the
// T x T matrix never exists.
// Here: the tile loops on the CPU (the reference), D, the LSE merge, the dispatchers, and
// FlashAttention as the model's attention core. Its CUDA kernels are in kernels/
// (flash_attention_cuda.cu in fp32, flash_attention_bf16.cu on tensor cores); naive attention,
// which it is tested against, is kernels/attention_naive.cu.
// Guide: docs/flash-attention.md (the code in reading order, the reports that show it).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/attention_naive.cuh"
#include "kernels/flash_attention_bf16.cuh"
#include "kernels/flash_attention_kernels.cuh"
#include "mixed_precision.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

// The layout offsets and the causal mask (token_head, visible_keys, first_query_seeing) are in
// kernels/flash_attention_kernels.cuh, shared with the CUDA kernels.
// Each tensor: its element count and format (the operands' is q's, F32 or BF16).
static void check_block_args(
    const Context& ctx, const AttentionBlock& a, DType in,
    std::initializer_list<std::tuple<const Tensor*, int64_t, DType>> tensors) {
  PICO_ASSERT(
      a.B > 0 && a.Tq >= 0 && a.Tk >= 0 && a.hd > 0 && a.Hkv > 0 && a.Hq > 0 && a.Hq % a.Hkv == 0,
      "attention block: B " + std::to_string(a.B) + ", Hq " + std::to_string(a.Hq) + ", Hkv " +
          std::to_string(a.Hkv) + ", hd " + std::to_string(a.hd));
  PICO_ASSERT(in == DType::F32 || (in == DType::BF16 && bf16_head_dim(a.hd)),
              std::string("attention operands in ") + dtype_name(in) + " at hd " +
                  std::to_string(a.hd) + ": F32, or BF16 at hd 16, 32, 64 or 128");
  for (auto [t, want, dtype] : tensors)
    PICO_ASSERT(t->numel() == want && t->device == ctx.device && t->dtype == dtype,
                "attention tensor " + t->shape_str() + " of " + dtype_name(t->dtype) + " on " +
                    device_name(t->device) + ", expected " + std::to_string(want) + " " +
                    dtype_name(dtype) + " on " + device_name(ctx.device));
}
// ============================================================================
// FlashAttention forward: out = softmax(q k^T / sqrt(hd)) v and lse, one query tile at a time
// ============================================================================

constexpr int kCpuTileQ = 64, kCpuTileK = 64;  // Br x Bc: a 16 KiB score tile stays in L1/L2

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
      // Dropout: the sum l is the softmax's, the output the dropped probabilities' times v.
      for (int j = 0; a.drop.on() && j < seen; j++)
        p[j] *= a.drop.factor(b, h, a.q0 + i0 + r, a.k0 + j0 + j);
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

void flash_attention_forward(const Context& ctx, const Tensor& out, const Tensor& lse,
                             const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionBlock& a) {
  const DType in = q.dtype;
  check_block_args(ctx, a, in,
                   {{&out, q_numel(a), in},
                    {&lse, lse_numel(a), DType::F32},
                    {&q, q_numel(a), in},
                    {&k, kv_numel(a), in},
                    {&v, kv_numel(a), in}});
  if (in == DType::BF16) return flash_forward_bf16(ctx, out, lse, q, k, v, a);  // tensor cores
  if (count_op(ctx.device, OpKind::Attention, attention_cost(a, false, 4))) return;
  if (ctx.device == Device::CPU)
    return flash_forward_cpu(out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), a);
  flash_forward_cuda(ctx, out.f32(), lse.f32(), q.f32(), k.f32(), v.f32(), a);
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

void attention_out_dot_dout(const Context& ctx, const Tensor& D, const Tensor& dout,
                            const Tensor& out, const AttentionBlock& a) {
  const DType in = dout.dtype;
  check_block_args(
      ctx, a, in,
      {{&D, lse_numel(a), DType::F32}, {&dout, q_numel(a), in}, {&out, q_numel(a), in}});
  if (in == DType::BF16) return out_dot_dout_bf16(ctx, D, dout, out, a);
  if (count_op(ctx.device, OpKind::Attention, out_dot_dout_cost(a, 4))) return;
  if (ctx.device == Device::CPU)
    return out_dot_dout_host<double>(D.f32(), dout.f32(), out.f32(), a);
  out_dot_dout_cuda(ctx, D.f32(), dout.f32(), out.f32(), a);
}

void attention_backward_begin(const Context& ctx, const Tensor& D, const Tensor& dout,
                              const Tensor& out, const Tensor& dq, const Tensor& dk,
                              const Tensor& dv, const AttentionBlock& a) {
  if (dout.dtype == DType::BF16 && ctx.device != Device::CPU)  // one kernel for all four
    return out_dot_dout_bf16(ctx, D, dout, out, a, {dq, dk, dv});
  attention_out_dot_dout(ctx, D, dout, out, a);
  zero_(ctx, dq), zero_(ctx, dk), zero_(ctx, dv);
}

// ============================================================================
// FlashAttention backward: recompute P tile by tile from lse, FlashAttention-2's loop order
// ============================================================================
// For a key tile K_j, V_j and each query tile Q_i that sees it (Playbook §7.2's formulas):
//   P = exp(scale Q_i K_j^T - lse_i)   dV_j += P^T dO_i     dP = dO_i V_j^T
//   dS = P * (dP - D_i)                dQ_i += scale dS K_j  dK_j += scale dS^T Q_i
// The key tile is the outer loop, so dK_j and dV_j stay with one worker (or one thread block)
// from start to end, and only dQ collects from several key tiles. Under dropout (mask M, kept
// scaled by 1/(1-p): the factor F) the output was (F P) V, so dV_j += (F P)^T dO_i and
// dP = F dO_i V_j^T, while D = rowsum(dO * O) still equals sum_j P_ij dP_ij.

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
        // dS[rows, cols] = P * (dO V^T - D)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, hd, 1.0f, dO, ldq, V, ldk,
                    0.0f, dS, kCpuTileK);
        for (int r = 0; r < rows; r++)
          for (int j = 0; j < cols; j++) {
            float* p = P + r * kCpuTileK + j;  // under dropout: dP = f dO V^T, and P becomes f P
            const float f = a.drop.on() ? a.drop.factor(b, h, a.q0 + i0 + r, a.k0 + j0 + j) : 1.0f;
            dS[r * kCpuTileK + j] = *p * (f * dS[r * kCpuTileK + j] - Di[r]);
            *p *= f;
          }
        // dV[cols, hd] += P^T dO
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cols, hd, rows, 1.0f, P, kCpuTileK, dO,
                    ldq, 1.0f, dV, ldk);
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

void flash_attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk,
                              const Tensor& dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& D,
                              const AttentionBlock& a) {
  const DType in = q.dtype;
  check_block_args(ctx, a, in,
                   {{&dq, q_numel(a), DType::F32},
                    {&dk, kv_numel(a), DType::F32},
                    {&dv, kv_numel(a), DType::F32},
                    {&dout, q_numel(a), in},
                    {&q, q_numel(a), in},
                    {&k, kv_numel(a), in},
                    {&v, kv_numel(a), in},
                    {&lse, lse_numel(a), DType::F32},
                    {&D, lse_numel(a), DType::F32}});
  if (in == DType::BF16) return flash_backward_bf16(ctx, dq, dk, dv, dout, q, k, v, lse, D, a);
  if (count_op(ctx.device, OpKind::Attention, attention_cost(a, true, 4))) return;
  if (ctx.device == Device::CPU)
    return flash_backward_cpu(dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(),
                              lse.f32(), D.f32(), a);
  flash_backward_cuda(ctx, dq.f32(), dk.f32(), dv.f32(), dout.f32(), q.f32(), k.f32(), v.f32(),
                      lse.f32(), D.f32(), a);
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

void attention_lse_merge(const Context& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& out2, const Tensor& lse2, const AttentionBlock& a) {
  const DType in = out2.dtype;
  check_block_args(ctx, a, in,
                   {{&out, q_numel(a), DType::F32},
                    {&lse, lse_numel(a), DType::F32},
                    {&out2, q_numel(a), in},
                    {&lse2, lse_numel(a), DType::F32}});
  const double q = (double)q_numel(a), rows = (double)lse_numel(a);  // out2: e bytes a value
  if (count_op(ctx.device, OpKind::Attention,
               {3.0 * q + 6.0 * rows, (4.0 + dtype_size(in)) * q + 8.0 * rows, 4.0 * (q + rows)}))
    return;
  if (ctx.device == Device::CPU)
    return lse_merge_cpu(out.f32(), lse.f32(), in == DType::F32 ? out2.f32() : widened(out2).data(),
                         lse2.f32(), a);
  lse_merge_cuda(ctx, out.f32(), lse.f32(), out2.ptr, in, lse2.f32(), a);
}

// ============================================================================
// The seam: naive attention and FlashAttention as the model's attention core
// ============================================================================

static const std::vector<Choice<AttentionKind>> kAttentions = {{"naive", AttentionKind::Naive},
                                                               {"flash", AttentionKind::Flash}};
AttentionKind parse_attention(const std::string& flag) {
  return parse_choice("--attention", flag, kAttentions);
}
const char* attention_name(AttentionKind kind) {
  return choice_name(kAttentions, kind);
}
std::string describe_attention(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::Naive:
      return "naive (keeps the probabilities: O(T^2))";
    case AttentionKind::Flash:
      break;
  }
  return "flash (keeps O and its log-sum-exp: O(T))";
}
void add_attention_flags(CLI::App& app, AttentionOptions& o) {
  add_typed(flag_group(app, "FlashAttention (Playbook §12.8)"), "--attention", &o.attention,
            parse_attention, attention_name(o.attention),
            "attention core: flash (keeps O and its log-sum-exp: O(T)) or naive (keeps the "
            "probabilities: O(T^2))");
}

// Keeps the output and the [B, Hq, T] log-sum-exp (Playbook §12.8): one block of the ring
// interface, queries at [0, T) against keys at [0, T), its operands in attention_input_dtype:
// under --dtype bf16 (and fp8) on a GPU the tensor-core kernels, fp32 accumulation, the
// probabilities rounded to bf16 before they multiply v (which the CPU emulation does not
// round); elsewhere the fp32 version on the rounded inputs.
class FlashAttention : public AttentionCore {
 public:
  std::string name() const override { return "flash"; }
  void forward(const Context& ctx, const AttentionShape& s, const Tensor& out,
               AttentionSaved& saved, const Tensor& q, const Tensor& k,
               const Tensor& v) const override {
    saved.lse = empty(ctx, {s.B, s.Hq, s.T}, Mem::Activations);
    const DType in = attention_input_dtype(ctx, s);
    // The kernels write `in`: out itself when it is stored so.
    Tensor o = out.dtype == in ? out : empty(ctx, out.shape, Mem::Workspace, in);
    flash_attention_forward(ctx, o, saved.lse, cast_to(ctx, q, in), cast_to(ctx, k, in),
                            cast_to(ctx, v, in), whole_block(s));
    attention_store_output(ctx, out, o);
  }
  // D = rowsum(dO * O) once, then dq, dk, dv (+=) from zero.
  void backward(const Context& ctx, const AttentionShape& s, const Tensor& dq, const Tensor& dk,
                const Tensor& dv, const Tensor& dout, const Tensor& out, AttentionSaved& saved,
                const Tensor& q, const Tensor& k, const Tensor& v) const override {
    const AttentionBlock a = whole_block(s);
    const DType in = attention_input_dtype(ctx, s);
    Tensor D = empty(ctx, {s.B, s.Hq, s.T}, Mem::Workspace), d_out = cast_to(ctx, dout, in);
    attention_backward_begin(ctx, D, d_out, cast_to(ctx, out, in), dq, dk, dv, a);
    flash_attention_backward(ctx, dq, dk, dv, d_out, cast_to(ctx, q, in), cast_to(ctx, k, in),
                             cast_to(ctx, v, in), saved.lse, D, a);
  }
  int64_t saved_bytes(int64_t B, int64_t T, int64_t heads, bool, int, bool) const override {
    return 4 * B * heads * T;  // the lse, fp32
  }
  std::string saved_formula(int, bool) const override { return "4 Hq"; }

 private:
  static AttentionBlock whole_block(const AttentionShape& s) {
    AttentionBlock a{s.B, s.T, s.T, s.Hq, s.Hkv, s.hd, 0, 0, true};
    if (s.dropout) a.drop = s.dropout->draw(s.T);
    return a;
  }
};

DType attention_input_dtype(const Context& ctx, const AttentionShape& s) {
  return gpu_path(ctx.device) && output_dtype(ctx.precision) == DType::BF16 && bf16_head_dim(s.hd)
             ? DType::BF16
             : DType::F32;
}
Tensor attention_output_fp32(const Context& ctx, const Tensor& out) {
  return out.dtype == DType::F32 ? out : empty(ctx, out.shape, Mem::Workspace);
}
void attention_store_output(const Context& ctx, const Tensor& out, const Tensor& written) {
  if (written.ptr != out.ptr) cast_(ctx, out, written);
}

std::shared_ptr<const AttentionCore> local_attention(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::Naive:
      return naive_attention();
    case AttentionKind::Flash:
      break;
  }
  return std::make_shared<FlashAttention>();
}
