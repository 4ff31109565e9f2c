// mixed_precision.cu: training in low precision (Playbook §Mixed precision training, §FP8
// pretraining): the linear layers read their operands rounded to bf16 or fp16 (or as FP8 tiles)
// and sum in fp32, the optimizer updates fp32 master weights, fp16 scales its loss. The formats
// are storage; a float is sign | exponent | mantissa, and they differ only in how many bits each
// part gets (runtime/dtype.cu encodes all four with one routine; round_ below emulates bf16 and
// fp16 on fp32 storage):
//
//   format  exp man  bias  largest finite        epsilon (1 to next)  values in (1, 2)
//   fp32     8  23   127   3.40e38               2^-23 = 1.19e-7      2^23 - 1
//   bf16     8   7   127   3.39e38 (fp32 range)  2^-7  = 7.81e-3      127
//   fp16     5  10    15   65504                 2^-10 = 9.77e-4      1023
//   e4m3     4   3     7   448 (no infinity)     2^-3                 7
//   e5m2     5   2    15   57344                 2^-2                 3
// The idea to take away: every store rounds (to nearest, ties to even), and what is lost is
// relative precision for bf16 but range for fp16 and fp8, hence loss scaling for fp16 and
// per-tile scales for fp8 (quantize_tiles, kernels/fp8_gemm.cu). Values only ever widen exactly
// back to fp32. The precision policy at the end is what train.cu holds. Guide:
// docs/mixed-precision.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fp8_gemm.cuh"
#include "mixed_precision.cuh"
#include "runtime/gradient_sync.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

// ============================================================================
// Rounding in place, with what it did: bf16 and fp16 on fp32 storage
// ============================================================================

// Keeps the top 32 - `cut` bits of an fp32: adds half of the dropped part (minus one unless the
// kept part is odd, so that a tie goes to even) and cuts. Agrees with encode() (runtime/dtype.cu)
// everywhere it is used below, and is about ten times faster: every activation passes here.
static float cut_mantissa(float x, int cut) {
  uint32_t b;
  memcpy(&b, &x, 4);
  const uint32_t half = (1u << (cut - 1)) - 1;
  b = (b + half + ((b >> cut) & 1)) & ~((1u << cut) - 1);
  float y;
  memcpy(&y, &b, 4);
  return y;
}
// bf16: 16 bits cut; NaN has its own branch (a carry could make it infinite).
static float round_bf16(float x) {
  if (std::isnan(x)) return NAN;
  return cut_mantissa(x, 16);
}
// fp16: 13 bits cut; below fp16's smallest normal (2^-14) its subnormals are the multiples of
// 2^-24, to which nearbyint rounds (ties to even, the default rounding mode); past 65504 a value
// is infinite.
static float round_fp16(float x) {
  const float a = std::fabs(x);
  if (!(a <= 65504.0f)) {
    if (std::isnan(x)) return NAN;
    if (a >= 65520.0f) return std::copysign(INFINITY, x);  // half an ulp past the largest
  }
  if (a < 6.103515625e-05f) return std::nearbyint(x * 16777216.0f) * (1.0f / 16777216.0f);
  return cut_mantissa(x, 13);
}

__global__ void round_kernel(float* x, int64_t n, DType format) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  x[i] = format == DType::BF16 ? __bfloat162float(__float2bfloat16_rn(x[i]))
                               : __half2float(__float2half_rn(x[i]));
}

void round_(const Context& ctx, const Tensor& x, DType format, bool backward) {
  PICO_ASSERT(x.dtype == DType::F32 && (format == DType::BF16 || format == DType::F16),
              std::string("round_ to ") + dtype_name(format));
  const int64_t n = x.numel();
  if (count_op(ctx.device, OpKind::Cast, {0, 4.0 * n, 4.0 * n})) return;
  if (n == 0) return;
  if (ctx.device == Device::CUDA) {
    round_kernel<<<(unsigned)((n + 255) / 256), 256, 0, ctx.stream>>>(x.f32(), n, format);
    return LAUNCH_CHECK(ctx, "round_kernel");
  }
  float* v = x.f32();
  RoundingStats counted;  // what underflowed and overflowed (runtime/observe.cuh)
  for (int64_t i = 0; i < n; i++) {
    const float after = format == DType::BF16 ? round_bf16(v[i]) : round_fp16(v[i]);
    counted.add(v[i], after);
    v[i] = after;
  }
  rounding_stats(backward).add(counted);
}

// ============================================================================
// Training in low precision: the linear layers' arithmetic (see mixed_precision.cuh)
// ============================================================================

void round_to_compute(const Context& ctx, const Tensor& x) {
  if (ctx.precision != Precision::FP32 && x.dtype == DType::F32)
    round_(ctx, x, output_dtype(ctx.precision));
}

void output_in_compute_format(const Context& ctx, Tensor& x, Mem category) {
  if (ctx.precision == Precision::FP8) return round_(ctx, x, output_dtype(ctx.precision));
  to_compute_format(ctx, x, category);
}

Tensor WeightCopies::find(const Tensor& W) const {
  if (W.dtype != DType::F32) return {};
  for (const Copy& c : copies) {
    const float* begin = c.master.f32();
    const float* at = (const float*)W.ptr;
    if (at >= begin && at + W.numel() <= begin + c.master.numel())
      return c.half.view(at - begin, W.shape);
  }
  return {};
}

Tensor keep_compute_copy(Context& ctx, const Tensor& master) {
  PICO_ASSERT(ctx.precision != Precision::FP32 && master.dtype == DType::F32,
              "a compute copy is for fp32 weights under --dtype bf16, fp16 or fp8");
  if (!ctx.weight_copies) ctx.weight_copies = std::make_shared<WeightCopies>();
  Tensor half = empty(ctx, {master.numel()}, Mem::Params, output_dtype(ctx.precision));
  ctx.weight_copies->copies.push_back({master, half});
  recount(master, Mem::Optimizer);  // the fp32 weights are now the optimizer's master copy
  refresh_compute_copies(ctx);
  return half;
}

void refresh_compute_copies(const Context& ctx) {
  if (!ctx.weight_copies) return;
  for (const WeightCopies::Copy& c : ctx.weight_copies->copies) cast_(ctx, c.half, c.master);
}

Tensor weight_as_stored(const Context& ctx, const Tensor& W) {
  if (W.dtype != DType::F32) return W;
  return ctx.weight_copies ? ctx.weight_copies->find(W) : Tensor{};
}

Tensor compute_weight(const Context& ctx, const Tensor& W) {
  if (ctx.precision == Precision::FP32 && W.dtype == DType::F32) return W;
  Tensor half = weight_as_stored(ctx, W);
  Tensor wide = empty(ctx, W.shape, Mem::Workspace);
  cast_(ctx, wide, half.defined() ? half : W);
  if (!half.defined())
    round_(ctx, wide.reshape({W.numel() / W.size(-1), W.size(-1)}), output_dtype(ctx.precision));
  return wide;
}

Tensor stored_weight(const Context& ctx, const Tensor& W) {
  Tensor half = ctx.precision == Precision::FP32 ? Tensor{} : weight_as_stored(ctx, W);
  return half.defined() ? half : compute_weight(ctx, W);
}

// What a GEMM reads of `t` ([rows, cols]): its values rounded, or FP8 tiles (DeepSeek-V3:
// 128 x 128 for weights; 1 x 128 for activations and gradients where the GEMM contracts along
// cols, the forward and the dgrad, and 128 x 1 where it contracts along the tokens, the wgrad),
// dequantized. A workspace the caller drops after the GEMM. On CUDA, bf16 and fp16 operands are
// stored in that format for the tensor cores. Under FP8, Fp8Tiling::None stops before the tiles:
// the values fp8_gemm quantizes itself.
enum class Operand { Activation, Weight, Gradient };
enum class Fp8Tiling { AlongCols, AlongTokens, None };
static Tensor gemm_operand(const Context& ctx, const Tensor& t, Operand role,
                           Fp8Tiling tiling = Fp8Tiling::AlongCols) {
  const DType format = output_dtype(ctx.precision);
  // A weight stored in the compute format (ZeRO-1/2), or its kept copy, or an activation
  // stored so (to_compute_format): on CUDA the GEMM reads it as it is.
  Tensor half = role == Operand::Weight || t.dtype == format ? weight_as_stored(ctx, t) : Tensor{};
  if (gpu_path(ctx.device) && ctx.precision != Precision::FP8)  // the tensor cores read it
    return half.defined() ? half : cast_to(ctx, t, format);
  // fp32 values in a workspace: the copy widened, or t rounded (to bf16 first for an FP8
  // weight, which is quantized from its bf16 copy as in DeepSeek-V3), or FP8 tiles.
  Tensor copy = empty(ctx, t.shape, Mem::Workspace);
  cast_(ctx, copy, half.defined() ? half : t);
  Tensor m = copy.reshape({t.numel() / t.size(-1), t.size(-1)});
  if (!half.defined() && (ctx.precision != Precision::FP8 || role == Operand::Weight))
    round_(ctx, m, format, role == Operand::Gradient);
  if (ctx.precision != Precision::FP8 || tiling == Fp8Tiling::None) return copy;
  const DType fp8 = role == Operand::Gradient ? DType::F8E5M2 : DType::F8E4M3;
  if (role == Operand::Weight)
    fake_quantize_tiles_(ctx, m, fp8, 128, 128);
  else if (tiling == Fp8Tiling::AlongTokens)
    fake_quantize_tiles_(ctx, m, fp8, 128, 1);
  else
    fake_quantize_tiles_(ctx, m, fp8, 1, 128);
  return copy;
}

// gemm (ops.cuh) on two operands from gemm_operand: fp32 products and sums. F32 operands go
// through gemm; bf16 / fp16 ones (CUDA) through gemm_16bit, the tensor cores' mixed-precision
// GEMM.
static void operand_gemm(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                         const Tensor& A, int lda, const Tensor& B, int ldb, float beta,
                         const Tensor& C, int ldc) {
  if (A.dtype != DType::F32)
    return gemm_16bit(ctx, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
  gemm(ctx, trans_a, trans_b, M, N, K, 1.0f, A.f32(), lda, B.f32(), ldb, beta, C.f32(), ldc);
}

// FP8 on a GPU: the three GEMMs go to fp8_gemm (real FP8 on Hopper), which declines where it
// cannot run them; the emulation below then does.
static bool fp8_on_gpu(const Context& ctx) {
  return ctx.precision == Precision::FP8 && gpu_path(ctx.device);
}

void low_precision_linear_forward(const Context& ctx, const Tensor& y, const Tensor& x,
                                  const Tensor& W) {
  const int T = (int)x.size(0), in = (int)x.size(-1), out = (int)W.size(0);
  if (fp8_on_gpu(ctx) &&
      fp8_gemm(ctx, y.reshape({T, out}), {x.reshape({T, in}), DType::F8E4M3, Fp8Tiles::Row128},
               {gemm_operand(ctx, W, Operand::Weight, Fp8Tiling::None), DType::F8E4M3,
                Fp8Tiles::Block128},
               0.0f))
    return round_(ctx, y, output_dtype(ctx.precision));
  Tensor xq = gemm_operand(ctx, x, Operand::Activation), wq = gemm_operand(ctx, W, Operand::Weight);
  // A y stored in the compute format (the MLP's gate and up) takes the fp32 sums rounded: by
  // cuBLAS on their way out when the operands are 16-bit, else from a workspace. Same values.
  const bool direct = y.dtype == DType::F32 || xq.dtype != DType::F32;
  Tensor sums = direct ? y : empty(ctx, y.shape, Mem::Workspace);
  operand_gemm(ctx, false, true, T, out, in, xq, in, wq, in, 0.0f, sums, out);
  if (y.dtype == DType::F32) return round_(ctx, y, output_dtype(ctx.precision));
  if (!direct) cast_(ctx, y, sums);
}

void low_precision_linear_backward(const Context& ctx, const Tensor& dx, const Tensor& dW,
                                   const Tensor& dy, const Tensor& x, const Tensor& W,
                                   bool accumulate_dx) {
  const int T = (int)x.size(0), in = (int)x.size(-1), out = (int)W.size(0);
  Tensor dyq;  // dy as the GEMMs below read it: made once, only where one of them runs
  auto dy_operand = [&]() -> const Tensor& {
    if (!dyq.defined()) dyq = gemm_operand(ctx, dy, Operand::Gradient);
    return dyq;
  };
  if (dx.defined()) {  // dx[T, in] (+)= dy[T, out] @ W[out, in], stored rounded
    const float beta = accumulate_dx ? 1.0f : 0.0f;
    if (!fp8_on_gpu(ctx) ||
        !fp8_gemm(ctx, dx.reshape({T, in}), {dy.reshape({T, out}), DType::F8E5M2, Fp8Tiles::Row128},
                  {gemm_operand(ctx, W, Operand::Weight, Fp8Tiling::None), DType::F8E4M3,
                   Fp8Tiles::Block128, true},
                  beta)) {
      Tensor wq = gemm_operand(ctx, W, Operand::Weight);
      // A dx stored in the compute format (SwiGLU's output gradient, a norm's) takes the sums
      // rounded, as a y does in the forward (added in fp32 to what it held when accumulated);
      // on the CPU from a workspace, counted.
      const bool direct = dx.dtype == DType::F32 || dy_operand().dtype != DType::F32;
      Tensor sums = direct ? dx : empty(ctx, dx.shape, Mem::Workspace);
      if (!direct && accumulate_dx) cast_(ctx, sums, dx);
      operand_gemm(ctx, false, false, T, in, out, dy_operand(), out, wq, in, beta, sums, in);
      if (!direct) cast_gradient_(ctx, dx, sums);
    }
    if (dx.dtype == DType::F32) round_(ctx, dx, output_dtype(ctx.precision), true);
  }
  // dW[out, in] += dy^T @ x, summed into the fp32 accumulator. It contracts along the tokens, so
  // under FP8 x and dy are tiled 128 tokens x 1 (DeepSeek-V3): each scale applies along the
  // contraction, and on Hopper dy^T [out, T] and x^T [in, T] are two 1 x 128 operands.
  if (dW.defined()) {
    if (fp8_on_gpu(ctx) &&
        fp8_gemm(
            ctx, dW, {dy.reshape({T, out}), DType::F8E5M2, Fp8Tiles::Row128, true},
            {cast_to(ctx, x, DType::F32).reshape({T, in}), DType::F8E4M3, Fp8Tiles::Row128, true},
            1.0f))
      return;
    Tensor dy_tokens = ctx.precision == Precision::FP8
                           ? gemm_operand(ctx, dy, Operand::Gradient, Fp8Tiling::AlongTokens)
                           : dy_operand();
    Tensor xq = gemm_operand(ctx, x, Operand::Activation, Fp8Tiling::AlongTokens);
    operand_gemm(ctx, true, false, out, in, T, dy_tokens, out, xq, in, 1.0f, dW, in);
  }
}

// The linear layer under the run's precision: fp32 GEMMs, or the low-precision ones above.
void linear_forward(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& W) {
  int T = (int)x.size(0), in = (int)x.size(-1), out = (int)W.size(0);
  PICO_ASSERT(W.size(1) == in && y.numel() == (int64_t)T * out, "linear_forward shapes");
  if (ctx.precision != Precision::FP32) return low_precision_linear_forward(ctx, y, x, W);
  gemm(ctx, false, true, T, out, in, 1.0f, x.f32(), in, W.f32(), in, 0.0f, y.f32(), out);
}

void linear_backward(const Context& ctx, const Tensor& dx, const Tensor& dW, const Tensor& dy,
                     const Tensor& x, const Tensor& W, bool accumulate_dx) {
  if (ctx.precision != Precision::FP32)
    return low_precision_linear_backward(ctx, dx, dW, dy, x, W, accumulate_dx);
  int T = (int)x.size(0), in = (int)x.size(-1), out = (int)W.size(0);
  if (dx.defined())  // dx[T, in] = dy[T, out] @ W[out, in]
    gemm(ctx, false, false, T, in, out, 1.0f, dy.f32(), out, W.f32(), in,
         accumulate_dx ? 1.0f : 0.0f, dx.f32(), in);
  if (dW.defined())  // dW[out, in] += dy^T[out, T] @ x[T, in]
    gemm(ctx, true, false, out, in, T, 1.0f, dy.f32(), out, x.f32(), in, 1.0f, dW.f32(), in);
}

// ============================================================================
// Dynamic loss scaling
// ============================================================================

bool LossScaler::update(bool gradients_finite) {
  if (!enabled) return gradients_finite;
  if (!gradients_finite) {
    skipped++;
    good_steps = 0;
    if (dynamic) scale = std::max(scale / 2, 1.0f);
    return false;
  }
  if (dynamic && ++good_steps >= window)
    scale = std::min(scale * 2, 65536.0f * 65536.0f), good_steps = 0;
  return true;
}

LossScaler make_loss_scaler(Precision p, const std::string& loss_scale, int window,
                            bool flags_given) {
  LossScaler s;
  if (p != Precision::FP16) {
    if (flags_given)
      throw UsageError(
          std::string(
              "--loss-scale and --loss-scale-window apply to --dtype fp16 only (this run is ") +
          precision_name(p) + "); drop them");
    return s;
  }
  s.enabled = true;
  if (window < 1)
    throw UsageError("--loss-scale-window " + std::to_string(window) + ": use 1 or more steps");
  s.window = window;
  if (loss_scale == "dynamic") return s;
  // A fixed scale is a power of two fp16 holds: scaling and unscaling are exact, and a larger
  // one makes every gradient inf (1e30 skipped every step, never training).
  char* end = nullptr;
  const double v = strtod(loss_scale.c_str(), &end);
  if (end == loss_scale.c_str() || *end != '\0' || !is_power_of_two(v) || v < 0x1p-24 ||
      v > kMaxFixedLossScale)
    throw UsageError("--loss-scale " + loss_scale +
                     ": use dynamic, or a fixed scale that is a "
                     "power of two fp16 holds, 2^-24 to 2^15 = 32768 (1: no scaling; e.g. 1024)");
  s.dynamic = false, s.scale = (float)v;
  return s;
}

// ============================================================================
// The policy
// ============================================================================

void PrecisionPolicy::unscale(const Context& ctx, GradientSync& sync) const {
  if (scaler_.enabled) sync.scale_gradients(ctx, 1.0f / scaler_.scale);
}

bool PrecisionPolicy::keep_step(const Context& ctx, float norm, Group& world) {
  step_scale_ = scaler_.scale;
  skipped_ = false;
  if (!scaler_.enabled) return true;
  // An inf or NaN anywhere: on every rank. The meta device holds no values: it never overflows.
  double overflow = std::isfinite(norm) || ctx.device == Device::Meta ? 0.0 : 1.0;
  all_reduce_host(world, &overflow, 1, ReduceOp::Max);
  skipped_ = !scaler_.update(overflow == 0.0);
  return !skipped_;
}

// fp16's dynamic scale and its count of good steps: an exact resume needs both.
std::map<std::string, std::string> PrecisionPolicy::resume_state() const {
  if (!scaler_.enabled || !scaler_.dynamic) return {};
  return {{"loss_scale", exact_num(scaler_.scale)},
          {"loss_scale_good_steps", std::to_string(scaler_.good_steps)}};
}
void PrecisionPolicy::resume_from(const std::map<std::string, std::string>& state, int64_t step,
                                  const std::string& file) {
  if (!scaler_.enabled || !scaler_.dynamic) return;
  if (state.count("loss_scale") && state.count("loss_scale_good_steps")) {
    scaler_.scale = (float)parse_number(state.at("loss_scale"), file + " loss_scale", 1, 0x1p32,
                                        false, true);  // a power of two, as it halves and doubles
    scaler_.good_steps = (int)parse_number(state.at("loss_scale_good_steps"),
                                           file + " loss_scale_good_steps", 0, INT32_MAX, true);
  } else if (step > 0 && is_main_process()) {
    printf(
        "note: %s holds no fp16 loss scale (an fp32, bf16 or fixed-scale run's): the "
        "dynamic scale starts again at %s\n",
        file.c_str(), exact_num(scaler_.scale).c_str());
  }
}

std::string PrecisionPolicy::step_note() const {
  if (!scaler_.enabled) return "";
  return " | scale " + exact_num(step_scale_) + (skipped_ ? " (overflow: step skipped)" : "");
}

void PrecisionPolicy::log_step(const Context& ctx, nlohmann::json& line) const {
  if (scaler_.enabled) {
    line["loss_scale"] = step_scale_;
    line["skipped"] = skipped_;
  }
  if (mixed() && ctx.device == Device::CPU)
    line["grad_underflow"] = rounding_stats(true).flushed_share();
}

std::string PrecisionPolicy::describe() const {
  if (!mixed()) return "fp32";
  std::string row = std::string(precision_name(compute_)) + " linear layers, fp32 master weights";
  if (scaler_.enabled)
    row += ", loss scale " + (scaler_.dynamic ? std::string("dynamic") : exact_num(scaler_.scale));
  row += grads_ == DType::BF16 ? ", bf16 gradients" : ", fp32 gradients";
  if (residual_ != DType::F32) row += ", " + residual_choice_name(residual_) + " residual stream";
  if (automatic_) row += " (auto on CUDA)";
  return row;
}

// ----------------------------------------------------------------------------
// Flags

void add_precision_flags(CLI::App& app, PrecisionOptions& o) {
  CLI::App& g = flag_group(app, "Mixed precision and FP8 (Playbook §12.9, §12.10)");
  add_typed(
      g, "--dtype", &o.dtype,
      [](const std::string& v) {
        return v == "auto" ? std::optional<Precision>() : parse_precision(v);
      },
      "auto",
      "linear layers in fp32|bf16|fp16|fp8, fp32 master weights (auto: fp32 on CPU, bf16 on "
      "CUDA)");
  add_choice<DType>(g, "--grad-acc-dtype", &o.grad_acc_dtype,
                    {{"fp32", DType::F32}, {"bf16", DType::BF16}},
                    "gradient buffers in fp32 (20 bytes per parameter with bf16 weights) or bf16 "
                    "(16; with --dtype bf16 or fp8)");
  add_choice<DType>(g, "--residual-dtype", &o.residual_dtype, residual_choices(),
                    "the residual stream between blocks and its gradient in fp32 (Megatron's "
                    "--fp32-residual-connection) or in the 16-bit format of --dtype bf16|fp16 "
                    "(Megatron's default: half the norms' traffic)");
  g.add_option_function<std::string>(
       "--loss-scale", [&o](const std::string& v) { o.loss_scale = v, o.loss_scale_given = true; },
       "fp16: dynamic (start 65536, halve on overflow) or a fixed power of two, 2^-24 to 32768")
      ->default_str(o.loss_scale);
  g.add_option_function<int>(
       "--loss-scale-window", [&o](int v) { o.loss_scale_window = v, o.loss_scale_given = true; },
       "fp16: good steps before a dynamic loss scale doubles, >= 1")
      ->default_str(std::to_string(o.loss_scale_window));
}

PrecisionPolicy make_precision_policy(const PrecisionOptions& o, Device device) {
  const Precision automatic = gpu_path(device) ? Precision::BF16 : Precision::FP32;
  const Precision p = o.dtype.value_or(automatic);
  if (p == Precision::FP8 && device == Device::CUDA) require_fp8_tensor_cores();
  if (o.grad_acc_dtype == DType::BF16 && p != Precision::BF16 && p != Precision::FP8)
    throw UsageError(
        "--grad-acc-dtype bf16 keeps gradients in the compute format of --dtype bf16 "
        "or fp8; this run is " +
        std::string(precision_name(p)) +
        (p == Precision::FP16 ? " (fp16 gradients would underflow: loss scaling "
                                "needs fp32 ones)"
                              : "") +
        ": add --dtype bf16, or drop the flag");
  return PrecisionPolicy(p, o.grad_acc_dtype,
                         make_loss_scaler(p, o.loss_scale, o.loss_scale_window, o.loss_scale_given),
                         !o.dtype.has_value(), residual_format(o.residual_dtype, p));
}
