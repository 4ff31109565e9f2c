// fp8_gemm.cuh: FP8 GEMMs on the tensor cores (Playbook §FP8 pretraining): operands quantized
// on the GPU into FP8 tiles with one fp32 scale each (DeepSeek-V3: 1 x 128 activations and
// gradients, 128 x 128 weights; 128 tokens x 1 for both operands of the weight gradient),
// multiplied by cuBLASLt's block-scaled FP8 GEMM on Hopper.
// The CPU reference of the quantization, quantize_tiles, is here too.
#pragma once
#include <string>

#include "runtime/core.cuh"

// FP8 per-tile scaling (DeepSeek-V3 §3.3): each tile of x gets scale = absmax / max_finite(fmt)
// and is stored as fp8(x / scale), so the tile's largest value lands on the format's largest.
// x: [rows, cols] F32; q: [rows, cols] F8E4M3 or F8E5M2;
// scales: [ceil(rows / tile_rows), ceil(cols / tile_cols)] F32. On the CPU; quantize_tiles_on
// (below) runs it on either device.
void quantize_tiles(const Tensor& q, const Tensor& scales, const Tensor& x, int tile_rows,
                    int tile_cols);
// x = q * scale of its tile (shapes as quantize_tiles).
void dequantize_tiles(const Tensor& x, const Tensor& q, const Tensor& scales, int tile_rows,
                      int tile_cols);

// quantize_tiles on ctx's device (Playbook §FP8 pretraining): the CPU loop, or one CUDA block
// per tile giving the same bytes and scales bit for bit. Shapes as quantize_tiles.
void quantize_tiles_on(const Context& ctx, const Tensor& q, const Tensor& scales, const Tensor& x,
                       int tile_rows, int tile_cols);
// dequantize_tiles on ctx's device (Playbook §FP8 pretraining), bit for bit as the CPU loop.
void dequantize_tiles_on(const Context& ctx, const Tensor& x, const Tensor& q, const Tensor& scales,
                         int tile_rows, int tile_cols);
// quantize_tiles_on of x^T, for x [K, n] read in place: q [n, K], scales [ceil(n / tile_rows),
// ceil(K / 128)], tiles tile_rows (1 or 128) x 128 of x^T: the transposed operands of the dgrad
// and the wgrad. The CPU loop on the transpose, or a CUDA kernel staging x through shared
// memory, bit for bit the same.
void quantize_tiles_transposed_on(const Context& ctx, const Tensor& q, const Tensor& scales,
                                  const Tensor& x, int tile_rows);
// x := dequantize(quantize(x)) with one absmax scale per tile (quantize_tiles_on), in place: the
// FP8 values a GEMM would read, times their scales. CPU, or a CUDA kernel matching it.
void fake_quantize_tiles_(const Context& ctx, const Tensor& x, DType format, int tile_rows,
                          int tile_cols);

// One operand of fp8_gemm: n rows of K fp32 values, which fp8_gemm quantizes to `format` in tiles
// along K: 1 x 128 (activations and gradients) or 128 x 128 (weights). A transposed operand is
// given as [K, n] and read in place (the dgrad's weight, the wgrad's dy and x).
enum class Fp8Tiles { Row128, Block128 };
struct Fp8Operand {
  Tensor values;  // F32 [n, K], or [K, n] when transposed
  DType format;   // F8E4M3 or F8E5M2
  Fp8Tiles tiles;
  bool transposed = false;
};

// d = a · b^T + beta d as real FP8 GEMM (Playbook §FP8 pretraining): a [rows, K] and b [cols, K]
// quantized as their Fp8Operand says, products summed in fp32 by cuBLASLt's block-scaled GEMM;
// d [rows, cols] fp32. cuBLASLt pairs neither two 128 x 128 operands nor two E5M2 ones. The
// three GEMMs of a linear layer (DeepSeek-V3):
//   forward  y  = x · W^T:      a = x 1 x 128 E4M3,           b = W 128 x 128 E4M3
//   dgrad    dx = dy · W:       a = dy 1 x 128 E5M2,          b = W^T (W transposed) 128 x 128
//   wgrad    dW += dy^T · x:    a = dy^T 1 x 128 E5M2,        b = x^T 1 x 128 E4M3
//                               (both transposed: K = tokens; beta 1 adds to the accumulator)
// Returns false, touching nothing, where that GEMM is not available (no Hopper, cuBLAS older than
// 12.9, a shape or alignment it declines): the caller emulates it. cuBLASLt's answer is asked
// once per shape; `why` gets the reason.
bool fp8_gemm(const Context& ctx, const Tensor& d, const Fp8Operand& a, const Fp8Operand& b,
              float beta, std::string* why = nullptr);

// How many fp8_gemm calls ran on the tensor cores and how many were declined (and so
// emulated by the caller), since the process started. Observation only, like RoundingStats.
struct Fp8GemmCounts {
  uint64_t native = 0, emulated = 0;
};
Fp8GemmCounts fp8_gemm_counts();
// After the last step: how many FP8 GEMMs ran natively (CUDA under --dtype fp8; prints nothing
// otherwise).
void print_fp8_gemm_counts(const Context& ctx);
// UsageError naming --dtype fp8 unless this GPU has FP8 tensor cores (compute capability 8.9:
// Ada, Hopper, or later).
void require_fp8_tensor_cores();
