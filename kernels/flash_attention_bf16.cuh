// flash_attention_bf16.cuh: the tile sizes of FlashAttention-2's bf16 kernels
// (kernels/flash_attention_bf16.cu), their shared memory, and the CPU loops that mirror them
// tile by tile (the tests hold each kernel to its mirror, and the mirror to attention by its
// definition). The kernels themselves are called through flash_attention.cuh
// (flash_attention_forward_bf16, flash_attention_backward_bf16). Guide: docs/flash-attention.md.
#pragma once
#include <cuda_bf16.h>

#include <cstddef>
#include <vector>

#include "flash_attention.cuh"

// The head dims the kernels are built for.
__host__ __device__ constexpr bool bf16_head_dim(int hd) {
  return hd == 16 || hd == 32 || hd == 64 || hd == 128;
}

// ---- forward: one thread block per (128 queries, query head, sequence) ----
// 4 warps of 32 query rows (two m16 tiles each): a key fragment loaded from shared memory feeds
// two mma instead of one, so each K/V tile is read from shared memory once per 32 rows.
constexpr int kFwdWarps = 4;
constexpr int kFwdRowsPerWarp = 32;
constexpr int kFwdQueryTile = kFwdWarps * kFwdRowsPerWarp;  // Br = 128
// Bc: keys per step. S (32 x Bc per warp) and O (32 x hd) live in registers: at hd 64, 64
// keys make 64 + 64 floats a lane (214 registers); at hd 128, 64 + 128 spill (255 registers and
// 4-36 bytes of spill stores), so hd 128 steps 32 keys at a time (32 + 128 floats, 229
// registers, nothing spilled; ptxas -v, tools/kernel_report.sh).
__host__ __device__ constexpr int fwd_key_tile(int hd) {
  return hd >= 128 ? 32 : 64;
}
// Q [Br][hd + 8], K and V double-buffered [2][Bc][hd + 8], bf16.
__host__ __device__ constexpr size_t fwd_shared_bytes(int hd) {
  return ((size_t)kFwdQueryTile + 4 * (size_t)fwd_key_tile(hd)) * (hd + 8) * 2;
}

// ---- backward: one thread block per (128 keys, query head, sequence) ----
// 8 warps of 16 keys; the K, V tile stays in shared memory while Q, dO and the statistics of
// successive query tiles stream past, double-buffered.
constexpr int kBwdWarps = 8;
constexpr int kBwdKeyTile = 16 * kBwdWarps;  // Bc = 128
// Br: queries per step. S^T and dP^T (16 x Br per warp) and dK, dV (16 x hd each) live in
// registers: 32 queries at hd 128, 64 below.
__host__ __device__ constexpr int bwd_query_tile(int hd) {
  return hd >= 128 ? 32 : 64;
}
// K, V [Bc][hd + 8]; Q, dO double-buffered [2][Br][hd + 8]; dS^T [Bc][Br + 8] (bf16); lse and
// D double-buffered [2][Br] (fp32); under dropout, the query rows' hashes [2][Br] (64-bit).
__host__ __device__ constexpr size_t bwd_shared_bytes(int hd, bool dropout) {
  return (2 * (size_t)kBwdKeyTile + 4 * (size_t)bwd_query_tile(hd)) * (hd + 8) * 2 +
         (size_t)kBwdKeyTile * (bwd_query_tile(hd) + 8) * 2 + 4 * (size_t)bwd_query_tile(hd) * 4 +
         (dropout ? 2 * (size_t)bwd_query_tile(hd) * 8 : 0);
}

// ---- bf16 on tensor cores (mma.sync m16n8k16, fp32 accumulation; sm_80 and newer) ----
// CUDA only, raw device pointers in flash_attention.cuh's layouts; hd in {16, 32, 64, 128}.
// flash_attention.cuh's calls run them for bf16 operands on a GPU; the benchmark and the GPU
// tests call them directly. out (=) bf16, lse (=) fp32.
void flash_attention_forward_bf16(const Context& ctx, __nv_bfloat16* out, float* lse,
                                  const __nv_bfloat16* q, const __nv_bfloat16* k,
                                  const __nv_bfloat16* v, const AttentionBlock& a);
// D (=) fp32 from bf16 dout and out; given dq, dk and dv, also set to zero for the backward.
void attention_out_dot_dout_bf16(const Context& ctx, float* D, const __nv_bfloat16* dout,
                                 const __nv_bfloat16* out, const AttentionBlock& a,
                                 float* dq = nullptr, float* dk = nullptr, float* dv = nullptr);
// dq, dk, dv (+=) in fp32, as flash_attention_backward.
void flash_attention_backward_bf16(const Context& ctx, float* dq, float* dk, float* dv,
                                   const __nv_bfloat16* dout, const __nv_bfloat16* q,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v, const float* lse,
                                   const float* D, const AttentionBlock& a);
// dst[n] = bf16(src[n]) on the device (round to nearest even).
void convert_to_bf16(const Context& ctx, __nv_bfloat16* dst, const float* src, int64_t n);

// ---- the CPU mirrors (same tiles, same loop order, same roundings) ----
// Inputs are floats that hold bf16 values (q, k, v, dout rounded by the caller); layouts as in
// flash_attention.cuh. What the kernels do in fp32 the loops do in fp32, what they round to
// bf16 (P before P V, P and dS before the backward's GEMMs, out) the loops round the same way;
// only the order of fp32 sums inside an mma differs.
// out (=, bf16 values in floats), lse (=).
void flash_forward_bf16_cpu(float* out, float* lse, const float* q, const float* k, const float* v,
                            const AttentionBlock& a);
// dq, dk, dv (+=), from the lse and D given (as the kernel gets them).
void flash_backward_bf16_cpu(float* dq, float* dk, float* dv, const float* dout, const float* q,
                             const float* k, const float* v, const float* lse, const float* D,
                             const AttentionBlock& a);

// ---- bf16 tensors: what flash_attention.cu's calls run for bf16 operands ----
// The kernels on a GPU (counted, and only counted, on the meta device); on the CPU the mirrors
// above, on the values widened (exact), out rounded to bf16 once, D summed in fp32 as the
// kernel's warps do. Layouts and contracts as flash_attention_forward, _backward and
// attention_out_dot_dout; the caller checks the shapes.
void flash_forward_bf16(const Context& ctx, const Tensor& out, const Tensor& lse, const Tensor& q,
                        const Tensor& k, const Tensor& v, const AttentionBlock& a);
void flash_backward_bf16(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                         const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                         const Tensor& lse, const Tensor& D, const AttentionBlock& a);
// D (=); with `cleared` (dq, dk, dv; a GPU or meta only) also those (=) 0, in the same launch.
void out_dot_dout_bf16(const Context& ctx, const Tensor& D, const Tensor& dout, const Tensor& out,
                       const AttentionBlock& a, const std::vector<Tensor>& cleared = {});
