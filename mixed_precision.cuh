// mixed_precision.cuh: bf16, fp16 and the two FP8 formats as storage (Playbook §Mixed precision
// training, §FP8 pretraining): rounding from fp32 and the exact way back, and FP8 with one
// absmax scale per tile (DeepSeek-V3: 1 x 128 activations, 128 x 128 weights).
#pragma once
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
// dst = src in dst's dtype (same device, same numel; as cast_host). On CUDA a kernel built on
// cuda_bf16.h / cuda_fp16.h / cuda_fp8.h, bit-identical to the CPU loop (except NaN payloads),
// on the legacy default stream like copy_ (core.cuh).
void cast_(const Tensor& dst, const Tensor& src);
// The same on ctx's stream (training: bf16 gradients widened for the optimizer, weight copies).
void cast_(const Context& ctx, const Tensor& dst, const Tensor& src);

// FP8 per-tile scaling (DeepSeek-V3 §3.3): each tile of x gets scale = absmax / max_finite(fmt)
// and is stored as fp8(x / scale), so the tile's largest value lands on the format's largest.
// x: [rows, cols] F32; q: [rows, cols] F8E4M3 or F8E5M2;
// scales: [ceil(rows / tile_rows), ceil(cols / tile_cols)] F32. On the CPU; quantize_tiles_on
// (fp8_gemm.cuh) runs it on either device.
void quantize_tiles(const Tensor& q, const Tensor& scales, const Tensor& x, int tile_rows,
                    int tile_cols);
// x = q * scale of its tile (shapes as quantize_tiles).
void dequantize_tiles(const Tensor& x, const Tensor& q, const Tensor& scales, int tile_rows,
                      int tile_cols);

// ----------------------------------------------------------------------------
// Training in low precision (Playbook §Mixed precision training, §FP8 pretraining)
//
// The weights the optimizer updates stay fp32 (the "master weights"), and so do Adam's
// moments and the gradient accumulators. What changes is the arithmetic of the linear layers,
// which hold nearly all the FLOPs: under --dtype bf16 or fp16 each GEMM reads its two operands
// rounded to that format, sums their products in fp32 (as tensor cores do) and stores its
// output rounded; under fp8 the operands are FP8 tiles with one scale each (E4M3 forward,
// E5M2 for the gradients flowing back) and the outputs bf16. Norms, softmax, attention sums,
// the loss and every reduction stay fp32.

Precision parse_precision(const std::string& flag);  // fp32|bf16|fp16|fp8, else UsageError
const char* precision_name(Precision p);             // "fp32", "bf16", ...
// The format linear outputs are stored in: BF16 (bf16, fp8), F16 (fp16) or F32.
DType output_dtype(Precision p);

// x := x rounded to `format` (BF16 or F16; the values stay in x's F32 storage), on ctx's stream.
// `backward` says which rounding statistics count it (CPU only; see RoundingStats).
void round_(const Context& ctx, const Tensor& x, DType format, bool backward = false);
// x rounded to the compute format in place, on ctx's stream; nothing under fp32. What the block
// applies to the values attention reads and writes (RoPE's q and k, attention's output).
void round_to_compute(const Context& ctx, const Tensor& x);
// What a block keeps for its backward is stored in the compute format under --dtype, half the
// bytes, as a model trained in bf16 keeps it (each fp32 tensor of `kept` replaced by its
// rounding, Mem::Activations); nothing changes under fp32. widen_to_fp32 undoes it before the
// backward reads them (fp32 again, in workspace).
void store_in_compute_format(const Context& ctx, const std::vector<Tensor*>& kept);
void widen_to_fp32(const Context& ctx, const std::vector<Tensor*>& kept);
// x := dequantize(quantize(x)) with one absmax scale per tile (quantize_tiles), in place: the
// FP8 values a GEMM would read, times their scales. CPU, or a CUDA kernel matching it.
void fake_quantize_tiles_(const Context& ctx, const Tensor& x, DType format, int tile_rows,
                          int tile_cols);

// What rounding did to the values stored by the forward and by the backward: how many were
// nonzero, how many of those became zero (underflow: fp16's 6e-8 floor) and how many became
// infinite (overflow: past 65504). Counted on CPU ranks only; observation, like MemoryStats.
struct RoundingStats {
  uint64_t nonzero = 0, flushed = 0, overflowed = 0;
  double flushed_share() const { return nonzero ? (double)flushed / nonzero : 0.0; }
};
RoundingStats rounding_stats(bool backward);
void reset_rounding_stats();

// The linear layers under ctx.precision (ops.cu's linear_forward / linear_backward hand over
// to these when it is not FP32, after checking the shapes; same contract). The weight
// gradient is summed in fp32 into dW, the fp32 accumulator (Megatron's "main_grad").
void low_precision_linear_forward(const Context& ctx, const Tensor& y, const Tensor& x,
                                  const Tensor& W);
void low_precision_linear_backward(const Context& ctx, const Tensor& dx, const Tensor& dW,
                                   const Tensor& dy, const Tensor& x, const Tensor& W,
                                   bool accumulate_dx);

// The weights in the compute format, next to the fp32 master weights (Megatron keeps bf16
// parameters for the GEMMs and fp32 ones in the optimizer): a copy of a flat fp32 buffer in
// bf16 (fp16 for --dtype fp16), refreshed after every optimizer step. A GEMM reading a weight
// inside the buffer reads its copy; one that finds none (ZeRO-3's gathered units) rounds the
// fp32 values itself, to the same numbers.
struct WeightCopies {
  struct Copy {
    Tensor master, half;  // F32 [n], and the same n values in the compute format
  };
  std::vector<Copy> copies;
  // The copy's view of W (W's shape), or an undefined tensor when no copy holds W.
  Tensor find(const Tensor& W) const;
};
// Allocates the compute-format copy of `master` (Mem::Params), fills it, registers it in
// ctx.weight_copies (created if needed), and counts `master` as optimizer state from now on.
void keep_compute_copy(Context& ctx, const Tensor& master);
// After the optimizer changed the master weights: every copy := master, rounded.
void refresh_compute_copies(const Context& ctx);
// What an op that is not a GEMM (the embedding lookup, RMSNorm's scale) reads of weight W:
// under fp32, W itself; otherwise W's values in the compute format, widened to fp32 in a
// workspace: from W when W is stored in that format (ZeRO-1/2 keep only that), from its kept
// copy, or W rounded (ZeRO-3's gathered fp32 weights). So every op reads what a model held in
// bf16 reads (as Megatron's --bf16 models do), and every layout reads the same numbers.
Tensor compute_weight(const Context& ctx, const Tensor& W);

// Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training"): the loss,
// hence every gradient, is multiplied by `scale` so that small gradients stay above fp16's
// underflow; the optimizer sees them divided back. A step whose gradients hold an inf or NaN
// (the scale was too large) is skipped and the scale halved; after `window` good steps in a
// row it doubles. A static scale (dynamic false) never changes; 1 is no scaling.
struct LossScaler {
  bool enabled = false, dynamic = true;
  float scale = 65536.0f;  // 2^16
  int window = 1000;       // good steps before the scale doubles
  int good_steps = 0;
  int64_t skipped = 0;  // steps skipped so far
  // After a step's gradients are known: false when the step must be skipped.
  bool update(bool gradients_finite);
};
// --loss-scale dynamic|S and --loss-scale-window N (fp16 only; UsageError otherwise).
LossScaler make_loss_scaler(Precision p, const std::string& loss_scale, int window,
                            bool flags_given);
