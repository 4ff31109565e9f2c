// fp8_gemm.cuh: FP8 GEMMs on the tensor cores (Playbook §FP8 pretraining): operands quantized
// on the GPU into FP8 tiles with one fp32 scale each (DeepSeek-V3: 1 x 128 activations and
// gradients, 128 x 128 weights), multiplied by cuBLASLt's block-scaled FP8 GEMM on Hopper.
// The CPU reference of the quantization is quantize_tiles (mixed_precision.cuh).
#pragma once
#include <string>

#include "core.cuh"

// quantize_tiles on ctx's device (Playbook §FP8 pretraining): the CPU loop, or one CUDA block
// per tile giving the same bytes and scales bit for bit. Shapes as quantize_tiles.
void quantize_tiles_on(const Context& ctx, const Tensor& q, const Tensor& scales, const Tensor& x,
                       int tile_rows, int tile_cols);
// dequantize_tiles on ctx's device (Playbook §FP8 pretraining), bit for bit as the CPU loop.
void dequantize_tiles_on(const Context& ctx, const Tensor& x, const Tensor& q, const Tensor& scales,
                         int tile_rows, int tile_cols);

// d = a · b^T + beta d as real FP8 GEMM (Playbook §FP8 pretraining): a [rows, K] quantized to
// `a_format` (E4M3 or E5M2) in 1 x 128 tiles along K, b [cols, K] (or, with b_transposed, b^T
// given as [K, cols]) to E4M3 in 128 x 128 tiles, products summed in fp32 by cuBLASLt's
// block-scaled GEMM; d [rows, cols] fp32. Returns false, touching nothing, where that GEMM is
// not available (no Hopper, cuBLAS older than 12.9, a shape or alignment it declines): the
// caller emulates it. cuBLASLt's answer is asked once per shape; `why` gets the reason.
bool fp8_gemm(const Context& ctx, const Tensor& d, const Tensor& a, DType a_format, const Tensor& b,
              bool b_transposed, float beta, std::string* why = nullptr);

// How many fp8_gemm calls ran on the tensor cores and how many were declined (and so
// emulated by the caller), since the process started. Observation only, like RoundingStats.
struct Fp8GemmCounts {
  uint64_t native = 0, emulated = 0;
};
Fp8GemmCounts fp8_gemm_counts();
