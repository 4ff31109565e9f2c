// mixed_precision.cuh: bf16, fp16 and the two FP8 formats as storage (Playbook §Mixed precision
// training, §FP8 pretraining): rounding from fp32 and the exact way back, and FP8 with one
// absmax scale per tile (DeepSeek-V3: 1 x 128 activations, 128 x 128 weights).
#pragma once
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kernels/fp8_gemm.cuh"
#include "runtime/comm.cuh"
#include "runtime/core.cuh"
#include "runtime/dtype.cuh"
#include "runtime/observe.cuh"
#include "runtime/ops.cuh"

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

// ---- Rounding in place: the formats emulated on fp32 storage (runtime/dtype.cuh stores them) ----
// x := x rounded to `format` (BF16 or F16; the values stay in x's F32 storage), on ctx's stream.
// `backward` says which rounding statistics count it (CPU only; see RoundingStats).
void round_(const Context& ctx, const Tensor& x, DType format, bool backward = false);

// x rounded to the compute format in place, on ctx's stream; nothing under fp32, nor for an x
// stored in that format already. What the block applies to RoPE's q and k under fp8 (bf16
// values on fp32 storage); under bf16 and fp16 they are stored so.
void round_to_compute(const Context& ctx, const Tensor& x);
// An output (attention's, as a GEMM's is) in the compute format: stored in it under bf16 and
// fp16 (runtime/dtype.cuh's to_compute_format), rounded in place under fp8 (bf16 values on the
// fp32 storage that fp8's GEMMs quantize); nothing under fp32.
void output_in_compute_format(const Context& ctx, Tensor& x, Mem category);
// (Where a block's tensors are stored in 16 bits, in the forward and for the backward:
// runtime/dtype.cuh's to_compute_format, empty_in_compute_format, store_in_compute_format,
// widen_to_fp32, and gradient_operand for the gradients the linear layers read.)

// The linear layer every model GEMM goes through (tensor_parallel.cu's column- and row-parallel
// layers): under fp32 the GEMMs of ops.cuh, otherwise the low-precision ones below.
// y[T, out] = x[T, in] @ W[out, in]^T; under bf16 and fp16, y may be stored in that format.
void linear_forward(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& W);
// dx[T, in] (= or += when accumulate_dx) dy[T, out] @ W ; dW[out, in] += dy^T @ x.
// dx or dW may be undefined: that half is not computed (no input gradient is needed, or a
// zero-bubble pipeline computes the weight gradient later).
void linear_backward(const Context& ctx, const Tensor& dx, const Tensor& dW, const Tensor& dy,
                     const Tensor& x, const Tensor& W, bool accumulate_dx = false);
// The linear layers under a ctx.precision other than fp32 (linear_forward / linear_backward
// hand over to these after checking the shapes; same contract). The weight
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
// ctx.weight_copies (created if needed), counts `master` as optimizer state from now on, and
// returns the copy.
Tensor keep_compute_copy(Context& ctx, const Tensor& master);
// Every copy := its master, rounded (when kept; after each step the optimizer's own pass writes
// them: adamw_update's copy, runtime/ops.cuh).
void refresh_compute_copies(const Context& ctx);
// What an op that is not a GEMM (the embedding lookup, RMSNorm's scale) reads of weight W:
// under fp32, W itself; otherwise W's values in the compute format, widened to fp32 in a
// workspace: from W when W is stored in that format (ZeRO-1/2 keep only that), from its kept
// copy, or W rounded (ZeRO-3's gathered fp32 weights). So every op reads what a model held in
// bf16 reads (as Megatron's --bf16 models do), and every layout reads the same numbers.
Tensor compute_weight(const Context& ctx, const Tensor& W);
// W in the compute format as it is stored: W itself (ZeRO-1/2 keep only that), its kept copy,
// or undefined (ZeRO-3's gathered fp32 weights): what a GEMM on the GPU path reads as it is.
Tensor weight_as_stored(const Context& ctx, const Tensor& W);
// A weight as an op that widens what it reads takes it (the embedding's lookup, RMSNorm): W in
// the compute format as stored (W itself or its kept copy), else compute_weight(W). The same
// values, without a widened copy.
Tensor stored_weight(const Context& ctx, const Tensor& W);

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
// --loss-scale dynamic|S and --loss-scale-window N (fp16 only; UsageError otherwise). A fixed S
// is a power of two fp16 holds, 2^-24 to kMaxFixedLossScale.
LossScaler make_loss_scaler(Precision p, const std::string& loss_scale, int window,
                            bool flags_given);
constexpr double kMaxFixedLossScale = 32768;  // 2^15: fp16's largest power of two

// ---- Flags (Playbook §Mixed precision training) ----
namespace CLI {
class App;
}
struct PrecisionOptions {
  std::optional<Precision>
      dtype;  // --dtype: fp32|bf16|fp16|fp8; empty (auto): fp32 on CPU, bf16 on CUDA
  DType grad_acc_dtype = DType::F32;   // --grad-acc-dtype: fp32 or bf16 gradient buffers
  DType residual_dtype = DType::F32;   // --residual-dtype: the residual stream's storage
  std::string loss_scale = "dynamic";  // --loss-scale (fp16)
  int loss_scale_window = 1000;        // --loss-scale-window (fp16)
  bool loss_scale_given = false;       // either given: refused outside fp16
};
void add_precision_flags(CLI::App& app, PrecisionOptions& o);

// ----------------------------------------------------------------------------
// The precision policy (DESIGN 6, "Precision"): built once from --dtype, --grad-acc-dtype and
// --loss-scale; train.cu asks it what the step needs and never the dtype itself. The gradient
// sync keeps (and refreshes) the weights' copies in the compute format, and the fp32 master
// weights with Adam's moments.
class GradientSync;  // runtime/gradient_sync.cuh
class PrecisionPolicy {
 public:
  PrecisionPolicy() = default;  // fp32 everywhere
  PrecisionPolicy(Precision compute, DType grads, LossScaler scaler, bool automatic = false,
                  DType residual = DType::F32)
      : compute_(compute),
        grads_(grads),
        residual_(residual),
        scaler_(scaler),
        automatic_(automatic) {}
  Precision compute() const { return compute_; }  // the linear layers (ctx.precision)
  DType grads() const { return grads_; }          // the gradient buffers: F32 or BF16
  DType residual() const { return residual_; }    // the residual stream (ctx.residual)
  DType weight_format() const { return output_dtype(compute_); }  // the weights GEMMs read
  bool mixed() const { return compute_ != Precision::FP32; }      // fp32 master weights apart
  // Playbook §Mixed precision training: fp16 multiplies the loss by the loss scale, so every
  // gradient carries it (1 otherwise); the gradients are divided back before clipping.
  float loss_scale() const { return scaler_.enabled ? scaler_.scale : 1.0f; }
  bool skips_overflow() const { return scaler_.enabled; }  // fp16: an inf gradient skips the step
  void unscale(const Context& ctx, GradientSync& sync) const;
  // After clipping, with the global norm: false when the step must be skipped (fp16: an inf
  // or NaN on any rank of `world` halves the scale and skips the step on every rank).
  bool keep_step(const Context& ctx, float norm, Group& world);
  // What the step's line of the log adds (fp16: " | scale 65536", and the skip), and its
  // --log-json fields: the scale and the skip, and under --dtype on CPU the share of the
  // backward's nonzero values that rounded to zero (rounding_stats).
  std::string step_note() const;
  void log_step(const Context& ctx, nlohmann::json& line) const;
  void begin_step() const { reset_rounding_stats(); }
  // fp16's dynamic loss scale for an exact resume, as optimizer.safetensors' metadata keeps it:
  // the scale and the good steps toward its next doubling; empty otherwise.
  std::map<std::string, std::string> resume_state() const;
  // Takes back what resume_state saved (read from `file`, for the message when a value is bad).
  // A dynamic fp16 run resumed at step > 0 from a checkpoint without it (fp32, bf16, fixed
  // scale) starts its scale afresh, and rank 0 says so.
  void resume_from(const std::map<std::string, std::string>& state, int64_t step,
                   const std::string& file);
  // The configuration table's row: "bf16 linear layers, ...", and whether --dtype auto chose it.
  std::string describe() const;

 private:
  Precision compute_ = Precision::FP32;
  DType grads_ = DType::F32;
  DType residual_ = DType::F32;
  LossScaler scaler_;
  float step_scale_ = 1.0f;  // the scale the last step's gradients carried
  bool skipped_ = false;     // whether keep_step skipped it
  bool automatic_ = false;   // --dtype auto chose the compute format
};
// The policy the flags ask for on `device` (auto: fp32 on CPU, bf16 on CUDA). Throws UsageError
// naming the flags: fp8 on a GPU without FP8 tensor cores, bf16 gradients with fp32 or fp16
// arithmetic, loss-scale flags outside fp16.
PrecisionPolicy make_precision_policy(const PrecisionOptions& o, Device device);
