// dtype.cuh: the low-precision storage formats (bf16, fp16, fp8 e4m3 and e5m2): one value
// rounded from fp32 and widened back, and tensors cast between a format and fp32.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core.cuh"

// One value, fp32 -> format: round to nearest, ties to even, subnormals kept. Overflow goes to
// infinity (bf16, fp16, e5m2); e4m3 has no infinity and saturates to +-448 ("satfinite").
// NaN becomes the canonical NaN: every bit but the sign set (what the CUDA conversions give).
uint16_t float_to_bf16(float x);
uint16_t float_to_fp16(float x);
uint8_t float_to_e4m3(float x);
uint8_t float_to_e5m2(float x);
// format -> fp32: exact (every value of these formats is an fp32 value).
float bf16_to_float(uint16_t bits);
float fp16_to_float(uint16_t bits);
float e4m3_to_float(uint8_t bits);
float e5m2_to_float(uint8_t bits);
// Largest finite value of a storage format: 3.39e38, 65504, 448, 57344.
float max_finite(DType format);

// n values from src to dst on the host; one of the two dtypes is F32, the other F32, BF16, F16,
// F8E4M3 or F8E5M2. The CPU reference of cast_.
void cast_host(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);
// A host tensor's values in fp32 (a copy; exact from every storage format), for the CPU loops.
std::vector<float> widened(const Tensor& t);
// dst = src in dst's dtype (same device, same numel; as cast_host). On CUDA a kernel built on
// cuda_bf16.h / cuda_fp16.h / cuda_fp8.h, bit-identical to the CPU loop (except NaN payloads),
// on the legacy default stream like copy_ (core.cuh).
void cast_(const Tensor& dst, const Tensor& src);
// The same on ctx's stream (training: bf16 gradients widened for the optimizer, weight copies).
void cast_(const Context& ctx, const Tensor& dst, const Tensor& src);
// t in `dtype`: t itself when it already is, else a cast copy (Mem::Workspace, ctx's stream).
Tensor cast_to(const Context& ctx, const Tensor& t, DType dtype, Mem category = Mem::Workspace);
// A gradient of the backward cast from fp32 into a narrower dst (as cast_), each value rounded
// once; on the CPU what the rounding flushed to zero or overflowed is counted in the backward's
// rounding statistics (observe.cuh's RoundingStats, mixed precision's grad_underflow), as
// mixed_precision.cuh's round_ counts it. The host loop: n fp32 values into dst's dtype.
void cast_gradient_(const Context& ctx, const Tensor& dst, const Tensor& src);
void cast_gradient_host(void* dst, DType dst_dtype, const float* src, int64_t n);

// --dtype: what the linear layers compute in (Precision, core.cuh; mixed_precision.cuh).
Precision parse_precision(const std::string& flag);  // fp32|bf16|fp16|fp8, else UsageError
const char* precision_name(Precision p);             // "fp32", "bf16", ...
// The format linear outputs are stored in: BF16 (bf16, fp8), F16 (fp16) or F32.
DType output_dtype(Precision p);
// What the linear layers' inputs and outputs are stored in between ops (mixed_precision.cuh's
// compute format): bf16 or fp16 under those; fp32 under fp32, and under fp8, whose GEMMs
// quantize fp32 values themselves.
DType activation_dtype(Precision p);

// ---- Where a block's tensors are stored under ctx.precision (mixed_precision.cuh) ----
// What only the linear layers read (the norms' outputs, attention's) rounded into the compute
// format once, under bf16 and fp16: x is replaced by a tensor of activation_dtype (of
// `category`), which every GEMM then reads as it is, forward and backward, rather than each
// casting x again; the block keeps it so and never widens it. Nothing under fp32 and fp8.
void to_compute_format(const Context& ctx, Tensor& x, Mem category);
// A new tensor that the linear layers write or read and the ops beside them read and write in
// activation_dtype (the MLP's gate, up and SwiGLU output), on ctx's stream.
Tensor empty_in_compute_format(const Context& ctx, std::vector<int64_t> shape, Mem category);
// A new tensor of the residual stream (a block's input and output, or their gradient) in
// ctx.residual: fp32, or under --residual-dtype the compute format, as a model held in bf16
// keeps it (the norms read it widened and add in fp32; each sum is rounded once as stored).
Tensor empty_residual(const Context& ctx, std::vector<int64_t> shape, Mem category);
// What a block keeps for its backward is stored in the compute format under --dtype, half the
// bytes, as a model trained in bf16 keeps it (each fp32 tensor of `kept` replaced by its
// rounding, Mem::Activations); nothing changes under fp32. widen_to_fp32 undoes it before the
// backward reads them (fp32 again, in workspace).
// A linear layer's output gradient as both of its GEMMs read it (the input gradient's and the
// weight gradient's, which a zero-bubble schedule runs later): rounded into the compute format
// once and stored in it under bf16 and fp16, counted once in the backward's rounding
// statistics (cast_gradient_); dy itself under fp32 and fp8 (whose GEMMs quantize it).
Tensor gradient_operand(const Context& ctx, const Tensor& dy);
// Where such a gradient is written by an op that rounds it itself (RoPE's backward): dy itself
// when it is in that format already (fp32 and fp8 runs), else an empty workspace in it.
Tensor gradient_storage(const Context& ctx, const Tensor& dy);
void store_in_compute_format(const Context& ctx, const std::vector<Tensor*>& kept);
void widen_to_fp32(const Context& ctx, const std::vector<Tensor*>& kept);
