// tensor_core.cuh: the three instructions the bf16 kernels are built from (sm_80 and newer),
// each wrapped once: mma.sync m16n8k16 (a warp multiplies 16 x 16 by 16 x 8, bf16 inputs, fp32
// sums), ldmatrix (a warp loads four 8 x 8 bf16 tiles from shared memory straight into the
// fragment layout mma wants, optionally transposed) and cp.async (a thread copies 16 bytes from
// global to shared memory without passing them through registers, so the copy of the next tile
// overlaps the math on this one). Used by kernels/matmul_ladder.cu (the ladder's last rung) and
// kernels/flash_attention_bf16.cu (FlashAttention-2).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

using bf16 = __nv_bfloat16;

// Everything below is sm_80+ PTX; a build for an older GPU compiles the calls to nothing.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define PICO_SM80 1
#else
#define PICO_SM80 0
#endif

// ============================================================================
// mma.sync m16n8k16: D[16 x 8] += A[16 x 16] B[16 x 8]
// ============================================================================
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane = 4 g + t holds
//   A (row-major):  rows g and g + 8, columns 2t, 2t+1 and 2t+8, 2t+9   (4 registers)
//   B (col-major):  column g, rows 2t, 2t+1 and 2t+8, 2t+9             (2 registers)
//   C (fp32):       rows g and g + 8, columns 2t, 2t+1                 (4 floats)
// each register holding two bf16, the lower index in the low half. The C fragments of two
// adjacent 8-column tiles hold exactly the elements of one A fragment: a result can be the A
// operand of the next mma without leaving registers (FlashAttention's P V, dV += P^T dO).
__device__ inline void mma_bf16_16816(float c[4], const uint32_t a[4], const uint32_t b[2]) {
#if PICO_SM80
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

__device__ inline uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo is the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}
// The A operand made of two accumulator tiles: c0 (columns 0-7) and c1 (8-15), rounded to bf16.
__device__ inline void a_from_accumulators(uint32_t a[4], const float c0[4], const float c1[4]) {
  a[0] = pack_bf16x2(c0[0], c0[1]);
  a[1] = pack_bf16x2(c0[2], c0[3]);
  a[2] = pack_bf16x2(c1[0], c1[1]);
  a[3] = pack_bf16x2(c1[2], c1[3]);
}

// ============================================================================
// ldmatrix: four 8 x 8 tiles from shared memory, one row address per lane
// ============================================================================
// Lanes 8i .. 8i+7 give the addresses of tile i's eight rows (16 bytes each); register i of
// every lane receives tile i, lane 4 g + t holding row g, columns 2t and 2t+1 (or, transposed,
// column g, rows 2t and 2t+1). One instruction replaces the eight 32-bit loads per fragment of
// a load by hand, and the 8 rows of a tile land in different banks when rows are padded by 16
// bytes (see the kernels' leading dimensions).

__device__ inline uint32_t shared_address(const void* p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ inline void ldmatrix_x4(uint32_t r[4], const bf16* row) {
#if PICO_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}
__device__ inline void ldmatrix_x4_trans(uint32_t r[4], const bf16* row) {
#if PICO_SM80
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row)));
#endif
}

// Which row each lane addresses, for the operand shapes the kernels load: (row, column) of the
// first element of the 16 bytes lane `lane` points at, in a row-major bf16 matrix s in shared
// memory. Host and device, so tests/test_tensor_core_layout.cu can check each against the
// fragment layouts above with ldmatrix emulated on the CPU.
struct MatrixPosition {
  int row, col;
};
// A operand at (m0, k0) of A stored as s[m][k]: tiles (rows 0-7, cols 0-7), (rows 8-15, 0-7),
// (rows 0-7, cols 8-15), (rows 8-15, 8-15) are registers a0..a3.
__host__ __device__ inline MatrixPosition a_fragment_row(int m0, int k0, int lane) {
  return {m0 + lane % 16, k0 + lane / 16 * 8};
}
// A operand at (m0, k0) of A stored transposed, as s[k][m] (dS^T kept as [key][query]); loaded
// with .trans.
__host__ __device__ inline MatrixPosition a_fragment_transposed_row(int m0, int k0, int lane) {
  return {k0 + lane % 8 + lane / 16 * 8, m0 + lane / 8 % 2 * 8};
}
// B operands of two adjacent 8-column tiles, (k0, n0) and (k0, n0 + 8), of B = X^T for X stored
// as s[n][k] (K in S = Q K^T): registers b[0..1] for columns n0..n0+7, b[2..3] for n0+8..n0+15.
__host__ __device__ inline MatrixPosition b_fragments_of_transpose_row(int k0, int n0, int lane) {
  return {n0 + lane % 8 + lane / 16 * 8, k0 + lane / 8 % 2 * 8};
}
// The same two tiles of B stored as s[k][n] (V in O = P V, B of the ladder's C = A B); loaded
// with .trans.
__host__ __device__ inline MatrixPosition b_fragments_row(int k0, int n0, int lane) {
  return {k0 + lane % 8 + lane / 8 % 2 * 8, n0 + lane / 16 * 8};
}

__device__ inline const bf16* shared_row(const bf16* s, int ld, MatrixPosition p) {
  return s + p.row * ld + p.col;
}
__device__ inline void load_a_fragment(uint32_t a[4], const bf16* s, int ld, int m0, int k0,
                                       int lane) {
  ldmatrix_x4(a, shared_row(s, ld, a_fragment_row(m0, k0, lane)));
}
__device__ inline void load_a_fragment_transposed(uint32_t a[4], const bf16* s, int ld, int m0,
                                                  int k0, int lane) {
  ldmatrix_x4_trans(a, shared_row(s, ld, a_fragment_transposed_row(m0, k0, lane)));
}
__device__ inline void load_b_fragments_of_transpose(uint32_t b[4], const bf16* s, int ld, int k0,
                                                     int n0, int lane) {
  ldmatrix_x4(b, shared_row(s, ld, b_fragments_of_transpose_row(k0, n0, lane)));
}
__device__ inline void load_b_fragments(uint32_t b[4], const bf16* s, int ld, int k0, int n0,
                                        int lane) {
  ldmatrix_x4_trans(b, shared_row(s, ld, b_fragments_row(k0, n0, lane)));
}

// ============================================================================
// cp.async: 16 bytes global -> shared, in flight while the warp computes
// ============================================================================
// Copies are grouped (commit) and waited for by group: wait<N> returns when at most the N most
// recent groups are still in flight. With src_bytes 0 nothing is read and 16 zero bytes are
// written: rows past the end of a sequence load as zeros without a branch around the copy.
__device__ inline void cp_async_16(void* dst_shared, const void* src, bool in_bounds) {
#if PICO_SM80
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst_shared)),
               "l"(src), "r"(in_bounds ? 16 : 0));
#endif
}
__device__ inline void cp_async_commit() {
#if PICO_SM80
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ inline void cp_async_wait() {
#if PICO_SM80
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
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
