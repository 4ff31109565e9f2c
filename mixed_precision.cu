// mixed_precision.cu: the low-precision formats of Playbook §Mixed precision training and §FP8
// pretraining, as storage. A float is sign | exponent | mantissa; the formats differ only in
// how many bits each part gets, so one rounding routine serves all four:
//
//   format  exp man  bias  largest finite        epsilon (1 to next)  values in (1, 2)
//   fp32     8  23   127   3.40e38               2^-23 = 1.19e-7      2^23 - 1
//   bf16     8   7   127   3.39e38 (fp32 range)  2^-7  = 7.81e-3      127
//   fp16     5  10    15   65504                 2^-10 = 9.77e-4      1023
//   e4m3     4   3     7   448 (no infinity)     2^-3                 7
//   e5m2     5   2    15   57344                 2^-2                 3
//
// The idea to take away: every store rounds (to nearest, ties to even), and what is lost is
// relative precision for bf16 but range for fp16 and fp8, hence loss scaling for fp16 and
// per-tile scales for fp8. Values only ever widen exactly back to fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/fp8_gemm.cuh"
#include "mixed_precision.cuh"
#include "runtime/ops.cuh"

// ----------------------------------------------------------------------------
// One rounding routine for every format

struct FloatFormat {
  int exp_bits, man_bits;
  bool has_inf;  // IEEE-like (all-ones exponent: inf, NaN); e4m3 keeps only S.1111.111 for NaN
};
static const FloatFormat kBF16{8, 7, true}, kFP16{5, 10, true}, kE4M3{4, 3, false},
    kE5M2{5, 2, true};

static uint32_t float_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}

// fp32 -> format, round to nearest even. |x| = m * 2^(e - 23) with m the 24-bit significand;
// the format keeps man_bits + 1 bits of it at exponents >= emin, and fewer below (subnormals:
// the quantum stays 2^(emin - man_bits)). Dropping `shift` bits and rounding gives r, the new
// significand; the encoding ((max(e, emin) + bias - 1) << man_bits) + r also turns a carry out
// of the mantissa (r = 2^(man_bits+1), or a subnormal rounding up to the smallest normal) into
// the next exponent, and a carry past the largest finite into the overflow branch.
static uint32_t encode(float x, FloatFormat f) {
  const uint32_t bits = float_bits(x), abs = bits & 0x7FFFFFFFu;
  const uint32_t sign = (bits >> 31) << (f.exp_bits + f.man_bits);
  const uint32_t nan = (1u << (f.exp_bits + f.man_bits)) - 1;  // canonical: all but the sign
  const uint32_t inf = ((1u << f.exp_bits) - 1) << f.man_bits;
  const uint32_t largest = f.has_inf ? inf - 1 : nan - 1;  // e4m3: 0x7E = 1.75 * 2^8 = 448
  if (abs > 0x7F800000u) return nan;
  const int bias = (1 << (f.exp_bits - 1)) - 1, emin = 1 - bias;
  int e = -126;  // fp32 subnormal (or zero): no hidden bit
  uint32_t m = abs;
  if (abs >= 0x00800000u) e = (int)(abs >> 23) - 127, m = (abs & 0x7FFFFFu) | 0x800000u;
  const int shift = 23 - f.man_bits + std::max(0, emin - e);
  uint32_t r = 0;  // shift > 24: below half the smallest subnormal, rounds to zero
  if (shift <= 24) {
    const uint32_t rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    r = m >> shift;
    if (rest > half || (rest == half && (r & 1))) r++;  // ties to even
  }
  uint32_t code = ((uint32_t)(std::max(e, emin) + bias - 1) << f.man_bits) + r;
  // Past the range (fp32 infinity included): infinity, or e4m3's "satfinite" saturation.
  if (code > largest) code = f.has_inf ? inf : largest;
  return sign | code;
}

static float decode(uint32_t code, FloatFormat f) {
  const uint32_t exp_all = (1u << f.exp_bits) - 1, man_all = (1u << f.man_bits) - 1;
  const uint32_t exp = (code >> f.man_bits) & exp_all, man = code & man_all;
  const bool negative = (code >> (f.exp_bits + f.man_bits)) & 1;
  const int bias = (1 << (f.exp_bits - 1)) - 1;
  float v;
  if (exp == exp_all && (f.has_inf || man == man_all))
    v = f.has_inf && man == 0 ? INFINITY : NAN;
  else if (exp == 0)
    v = ldexpf((float)man, 1 - bias - f.man_bits);  // subnormal: no hidden bit
  else
    v = ldexpf((float)(man | (1u << f.man_bits)), (int)exp - bias - f.man_bits);
  return negative ? -v : v;
}

uint16_t float_to_bf16(float x) {
  return (uint16_t)encode(x, kBF16);
}
uint16_t float_to_fp16(float x) {
  return (uint16_t)encode(x, kFP16);
}
uint8_t float_to_e4m3(float x) {
  return (uint8_t)encode(x, kE4M3);
}
uint8_t float_to_e5m2(float x) {
  return (uint8_t)encode(x, kE5M2);
}
float bf16_to_float(uint16_t bits) {
  return decode(bits, kBF16);
}
float fp16_to_float(uint16_t bits) {
  return decode(bits, kFP16);
}
float e4m3_to_float(uint8_t bits) {
  return decode(bits, kE4M3);
}
float e5m2_to_float(uint8_t bits) {
  return decode(bits, kE5M2);
}

float max_finite(DType format) {
  switch (format) {
    case DType::BF16:
      return bf16_to_float(0x7F7F);
    case DType::F16:
      return fp16_to_float(0x7BFF);
    case DType::F8E4M3:
      return e4m3_to_float(0x7E);
    case DType::F8E5M2:
      return e5m2_to_float(0x7B);
    default:
      PICO_ASSERT(format == DType::F32, std::string("no max_finite for ") + dtype_name(format));
  }
  return 3.40282347e38f;
}

// ----------------------------------------------------------------------------
// cast_: CPU loop, CUDA kernel, dispatcher

static bool is_storage_format(DType t) {
  return t == DType::BF16 || t == DType::F16 || t == DType::F8E4M3 || t == DType::F8E5M2;
}
static FloatFormat format_of(DType t) {
  return t == DType::BF16 ? kBF16 : t == DType::F16 ? kFP16 : t == DType::F8E4M3 ? kE4M3 : kE5M2;
}

// True when the cast widens to F32; stops on a pair of dtypes cast_ does not convert.
static bool check_cast(DType dst_dtype, DType src_dtype) {
  const bool widen =
      dst_dtype == DType::F32 && (src_dtype == DType::F32 || is_storage_format(src_dtype));
  PICO_ASSERT(widen || (src_dtype == DType::F32 && is_storage_format(dst_dtype)),
              std::string("cast from ") + dtype_name(src_dtype) + " to " + dtype_name(dst_dtype));
  return widen;
}

void cast_host(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n) {
  const bool widen = check_cast(dst_dtype, src_dtype);
  if (src_dtype == dst_dtype) return (void)memmove(dst, src, (size_t)n * 4);  // F32 -> F32
  const DType narrow = widen ? src_dtype : dst_dtype;
  const FloatFormat f = format_of(narrow);
  const bool two_bytes = dtype_size(narrow) == 2;
  for (int64_t i = 0; i < n; i++) {
    if (widen) {
      const uint32_t code = two_bytes ? ((const uint16_t*)src)[i] : ((const uint8_t*)src)[i];
      ((float*)dst)[i] = decode(code, f);
    } else if (two_bytes) {
      ((uint16_t*)dst)[i] = (uint16_t)encode(((const float*)src)[i], f);
    } else {
      ((uint8_t*)dst)[i] = (uint8_t)encode(((const float*)src)[i], f);
    }
  }
}

// The CUDA types' own conversions, so a [gpu] test checks the loop above against NVIDIA's:
// cvt.rn.bf16.f32 / cvt.rn.f16.f32 in hardware; fp8 by cuda_fp8.h (hardware cvt.rn.satfinite
// on sm_89+ for e4m3; e5m2 must overflow to infinity, which only the __NV_NOSAT path does).
__global__ void cast_from_f32_kernel(void* dst, DType dst_dtype, const float* src, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = src[i];
  switch (dst_dtype) {
    case DType::BF16:
      ((uint16_t*)dst)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
      break;
    case DType::F16:
      ((uint16_t*)dst)[i] = __half_as_ushort(__float2half_rn(x));
      break;
    case DType::F8E4M3:
      ((uint8_t*)dst)[i] = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
      break;
    case DType::F8E5M2:
      ((uint8_t*)dst)[i] = __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
      break;
    default:
      ((float*)dst)[i] = x;
  }
}
__global__ void cast_to_f32_kernel(float* dst, const void* src, DType src_dtype, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  switch (src_dtype) {
    case DType::BF16:
      dst[i] = __bfloat162float(__ushort_as_bfloat16(((const uint16_t*)src)[i]));
      break;
    case DType::F16:
      dst[i] = __half2float(__ushort_as_half(((const uint16_t*)src)[i]));
      break;
    case DType::F8E4M3:
      dst[i] = __half2float(__half(__nv_cvt_fp8_to_halfraw(((const uint8_t*)src)[i], __NV_E4M3)));
      break;
    case DType::F8E5M2:
      dst[i] = __half2float(__half(__nv_cvt_fp8_to_halfraw(((const uint8_t*)src)[i], __NV_E5M2)));
      break;
    default:
      dst[i] = ((const float*)src)[i];
  }
}

void cast_(const Tensor& dst, const Tensor& src) {
  PICO_ASSERT(dst.numel() == src.numel() && dst.device == src.device,
              "cast_ " + src.shape_str() + " into " + dst.shape_str() + " on one device");
  const int64_t n = src.numel();
  if (dst.device == Device::CPU) return cast_host(dst.ptr, dst.dtype, src.ptr, src.dtype, n);
  check_cast(dst.dtype, src.dtype);
  if (n == 0) return;
  const int threads = 256;
  const unsigned blocks = (unsigned)((n + threads - 1) / threads);
  if (dst.dtype == DType::F32)
    cast_to_f32_kernel<<<blocks, threads>>>((float*)dst.ptr, src.ptr, src.dtype, n);
  else
    cast_from_f32_kernel<<<blocks, threads>>>(dst.ptr, dst.dtype, (const float*)src.ptr, n);
  CUDA_CHECK(cudaGetLastError());
}

// ----------------------------------------------------------------------------
// FP8 per-tile absmax scaling (DeepSeek-V3 §3.3): CPU reference

// Calls fn(row, col, tile_row, tile_col) for every element of a [rows, cols] matrix.
template <class Fn>
static void for_each_in_tiles(const Tensor& x, int tile_rows, int tile_cols, Fn fn) {
  PICO_ASSERT(x.dim() == 2 && tile_rows > 0 && tile_cols > 0, "tiles of a matrix " + x.shape_str());
  for (int64_t r = 0; r < x.size(0); r++)
    for (int64_t c = 0; c < x.size(1); c++) fn(r, c, r / tile_rows, c / tile_cols);
}
static void check_tiles(const Tensor& q, const Tensor& scales, const Tensor& x, int tile_rows,
                        int tile_cols) {
  PICO_ASSERT(x.dtype == DType::F32 && scales.dtype == DType::F32 &&
                  (q.dtype == DType::F8E4M3 || q.dtype == DType::F8E5M2) && q.shape == x.shape,
              "tile scaling: F32 " + x.shape_str() + " and an FP8 tensor of that shape");
  PICO_ASSERT(x.device == Device::CPU && q.device == Device::CPU && scales.device == Device::CPU,
              "tile scaling runs on the CPU");
  const std::vector<int64_t> want = {(x.size(0) + tile_rows - 1) / tile_rows,
                                     (x.size(1) + tile_cols - 1) / tile_cols};
  PICO_ASSERT(scales.shape == want, "scales " + scales.shape_str() + " for " + x.shape_str());
}

void quantize_tiles(const Tensor& q, const Tensor& scales, const Tensor& x, int tile_rows,
                    int tile_cols) {
  check_tiles(q, scales, x, tile_rows, tile_cols);
  const int64_t cols = x.size(1), tiles_across = scales.size(1);
  const float* xv = x.f32();
  float* s = scales.f32();
  std::fill(s, s + scales.numel(), 0.0f);
  for_each_in_tiles(x, tile_rows, tile_cols, [&](int64_t r, int64_t c, int64_t tr, int64_t tc) {
    float& absmax = s[tr * tiles_across + tc];
    absmax = std::max(absmax, std::fabs(xv[r * cols + c]));
  });
  // An all-zero tile keeps scale 1 (any scale stores zeros exactly). x / scale may round a hair
  // above the format's largest value: e4m3 saturates there (satfinite), e5m2 is rounded by the
  // same RNE and cannot reach its overflow threshold, half an ulp above 57344.
  const float largest = max_finite(q.dtype);
  for (int64_t i = 0; i < scales.numel(); i++) s[i] = s[i] > 0 ? s[i] / largest : 1.0f;
  uint8_t* qv = (uint8_t*)q.ptr;
  for_each_in_tiles(x, tile_rows, tile_cols, [&](int64_t r, int64_t c, int64_t tr, int64_t tc) {
    const float y = xv[r * cols + c] / s[tr * tiles_across + tc];
    qv[r * cols + c] = q.dtype == DType::F8E4M3 ? float_to_e4m3(y) : float_to_e5m2(y);
  });
}

void dequantize_tiles(const Tensor& x, const Tensor& q, const Tensor& scales, int tile_rows,
                      int tile_cols) {
  check_tiles(q, scales, x, tile_rows, tile_cols);
  const int64_t cols = x.size(1), tiles_across = scales.size(1);
  const uint8_t* qv = (const uint8_t*)q.ptr;
  const float* s = scales.f32();
  float* xv = x.f32();
  for_each_in_tiles(x, tile_rows, tile_cols, [&](int64_t r, int64_t c, int64_t tr, int64_t tc) {
    const uint8_t b = qv[r * cols + c];
    xv[r * cols + c] = (q.dtype == DType::F8E4M3 ? e4m3_to_float(b) : e5m2_to_float(b)) *
                       s[tr * tiles_across + tc];
  });
}

// ============================================================================
// Training in low precision: the linear layers' arithmetic (see mixed_precision.cuh)
// ============================================================================

Precision parse_precision(const std::string& flag) {
  if (flag == "fp32") return Precision::FP32;
  if (flag == "bf16") return Precision::BF16;
  if (flag == "fp16") return Precision::FP16;
  if (flag == "fp8") return Precision::FP8;
  throw UsageError("--dtype " + flag + ": unknown; use fp32, bf16, fp16 or fp8");
}
const char* precision_name(Precision p) {
  static const char* names[] = {"fp32", "bf16", "fp16", "fp8"};
  return names[(int)p];
}
DType output_dtype(Precision p) {
  return p == Precision::FP32 ? DType::F32 : p == Precision::FP16 ? DType::F16 : DType::BF16;
}

static RoundingStats g_rounding[2];  // forward, backward (observation only)
RoundingStats rounding_stats(bool backward) {
  return g_rounding[backward];
}
void reset_rounding_stats() {
  g_rounding[0] = g_rounding[1] = RoundingStats{};
}

// bf16 keeps the top 16 bits of an fp32: add half of the dropped part (minus one unless the
// kept part is odd, so a tie goes to even) and cut. Agrees with encode() everywhere but NaN,
// which has its own branch; about ten times faster, and every activation passes here.
static float round_bf16(float x) {
  uint32_t b = float_bits(x);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return NAN;
  b = (b + 0x7FFFu + ((b >> 16) & 1)) & 0xFFFF0000u;
  float y;
  memcpy(&y, &b, 4);
  return y;
}

// fp16 the same way, 13 bits cut; below fp16's smallest normal (2^-14) its subnormals are the
// multiples of 2^-24, to which nearbyint rounds (ties to even, the default rounding mode);
// past 65504 a value is infinite. Agrees with encode() everywhere but NaN.
static float round_fp16(float x) {
  const float a = std::fabs(x);
  if (!(a <= 65504.0f)) {
    if (std::isnan(x)) return NAN;
    if (a >= 65520.0f) return std::copysign(INFINITY, x);  // half an ulp past the largest
  }
  if (a < 6.103515625e-05f) return std::nearbyint(x * 16777216.0f) * (1.0f / 16777216.0f);
  uint32_t b = float_bits(x);
  b = (b + 0xFFFu + ((b >> 13) & 1)) & 0xFFFFE000u;
  float y;
  memcpy(&y, &b, 4);
  return y;
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
  if (n == 0) return;
  if (ctx.device == Device::CUDA) {
    round_kernel<<<(unsigned)((n + 255) / 256), 256, 0, ctx.stream>>>(x.f32(), n, format);
    return LAUNCH_CHECK(ctx, "round_kernel");
  }
  float* v = x.f32();
  RoundingStats& stats = g_rounding[backward];
  uint64_t nonzero = 0, flushed = 0, overflowed = 0;
  for (int64_t i = 0; i < n; i++) {
    const float before = v[i];
    const float after = format == DType::BF16 ? round_bf16(before) : round_fp16(before);
    nonzero += before != 0.0f;
    flushed += before != 0.0f && after == 0.0f;
    overflowed += std::isfinite(before) && std::isinf(after);
    v[i] = after;
  }
  stats.nonzero += nonzero, stats.flushed += flushed, stats.overflowed += overflowed;
}

void fake_quantize_tiles_(const Context& ctx, const Tensor& x, DType format, int tile_rows,
                          int tile_cols) {
  PICO_ASSERT(x.dim() == 2 && x.dtype == DType::F32, "fake_quantize_tiles_ of " + x.shape_str());
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  Tensor q = empty(ctx, x.shape, Mem::Workspace, format);
  Tensor scales = empty(
      ctx, {(rows + tile_rows - 1) / tile_rows, (cols + tile_cols - 1) / tile_cols}, Mem::Workspace);
  quantize_tiles_on(ctx, q, scales, x, tile_rows, tile_cols);
  dequantize_tiles_on(ctx, x, q, scales, tile_rows, tile_cols);
}

void round_to_compute(const Context& ctx, const Tensor& x) {
  if (ctx.precision != Precision::FP32) round_(ctx, x, output_dtype(ctx.precision));
}

void store_in_compute_format(const Context& ctx, const std::vector<Tensor*>& kept) {
  if (ctx.precision == Precision::FP32) return;
  for (Tensor* t : kept) {
    if (!t->defined() || t->dtype != DType::F32) continue;
    Tensor half = empty(ctx, t->shape, Mem::Activations, output_dtype(ctx.precision));
    cast_(ctx, half, *t);
    *t = half;
  }
}
void widen_to_fp32(const Context& ctx, const std::vector<Tensor*>& kept) {
  for (Tensor* t : kept) {
    if (!t->defined() || t->dtype == DType::F32) continue;
    Tensor wide = empty(ctx, t->shape, Mem::Workspace);
    cast_(ctx, wide, *t);
    *t = wide;
  }
}

void cast_(const Context& ctx, const Tensor& dst, const Tensor& src) {
  const int64_t n = src.numel();
  PICO_ASSERT(dst.numel() == n, "cast_ " + src.shape_str() + " into " + dst.shape_str());
  if (ctx.device == Device::CPU) return cast_host(dst.ptr, dst.dtype, src.ptr, src.dtype, n);
  if (n == 0) return;
  const unsigned blocks = (unsigned)((n + 255) / 256);
  if (dst.dtype == DType::F32)
    cast_to_f32_kernel<<<blocks, 256, 0, ctx.stream>>>((float*)dst.ptr, src.ptr, src.dtype, n);
  else
    cast_from_f32_kernel<<<blocks, 256, 0, ctx.stream>>>(dst.ptr, dst.dtype, (const float*)src.ptr,
                                                         n);
  LAUNCH_CHECK(ctx, "cast kernel");
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

void keep_compute_copy(Context& ctx, const Tensor& master) {
  PICO_ASSERT(ctx.precision != Precision::FP32 && master.dtype == DType::F32,
              "a compute copy is for fp32 weights under --dtype bf16, fp16 or fp8");
  if (!ctx.weight_copies) ctx.weight_copies = std::make_shared<WeightCopies>();
  Tensor half = empty(ctx, {master.numel()}, Mem::Params, output_dtype(ctx.precision));
  ctx.weight_copies->copies.push_back({master, half});
  recount(master, Mem::Optimizer);  // the fp32 weights are now the optimizer's master copy
  refresh_compute_copies(ctx);
}

void refresh_compute_copies(const Context& ctx) {
  if (!ctx.weight_copies) return;
  for (const WeightCopies::Copy& c : ctx.weight_copies->copies) cast_(ctx, c.half, c.master);
}

Tensor compute_weight(const Context& ctx, const Tensor& W) {
  if (ctx.precision == Precision::FP32 && W.dtype == DType::F32) return W;
  Tensor half = W.dtype != DType::F32 ? W : ctx.weight_copies ? ctx.weight_copies->find(W) : Tensor{};
  Tensor wide = empty(ctx, W.shape, Mem::Workspace);
  cast_(ctx, wide, half.defined() ? half : W);
  if (!half.defined()) round_(ctx, wide.reshape({W.numel() / W.size(-1), W.size(-1)}),
                              output_dtype(ctx.precision));
  return wide;
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
  // A weight stored in the compute format (ZeRO-1/2), or its kept copy: on CUDA the GEMM reads
  // it as it is.
  Tensor half = role != Operand::Weight ? Tensor{}
                : t.dtype != DType::F32 ? t
                : ctx.weight_copies     ? ctx.weight_copies->find(t)
                                        : Tensor{};
  if (half.defined() && ctx.device == Device::CUDA && ctx.precision != Precision::FP8) return half;
  if (!half.defined() && ctx.device == Device::CUDA && ctx.precision != Precision::FP8) {
    half = empty(ctx, t.shape, Mem::Workspace, format);
    cast_(ctx, half, t);
    return half;
  }
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
// through gemm; bf16 / fp16 ones (CUDA) through cublasGemmEx with fp32 compute, the tensor
// cores' mixed-precision GEMM, with gemm's row-major to column-major swap.
static void operand_gemm(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                         const Tensor& A, int lda, const Tensor& B, int ldb, float beta,
                         const Tensor& C, int ldc) {
  if (A.dtype == DType::F32)
    return gemm(ctx, trans_a, trans_b, M, N, K, 1.0f, A.f32(), lda, B.f32(), ldb, beta, C.f32(),
                ldc);
  const cudaDataType type = A.dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const float alpha = 1.0f;
  CUBLAS_CHECK(cublasGemmEx(ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                            trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B.ptr, type, ldb,
                            A.ptr, type, lda, &beta, C.ptr, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

// FP8 on a GPU: the three GEMMs go to fp8_gemm (real FP8 on Hopper), which declines where it
// cannot run them; the emulation below then does.
static bool fp8_on_gpu(const Context& ctx) {
  return ctx.precision == Precision::FP8 && ctx.device == Device::CUDA;
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
  operand_gemm(ctx, false, true, T, out, in, xq, in, wq, in, 0.0f, y, out);
  round_(ctx, y, output_dtype(ctx.precision));
}

void low_precision_linear_backward(const Context& ctx, const Tensor& dx, const Tensor& dW,
                                   const Tensor& dy, const Tensor& x, const Tensor& W,
                                   bool accumulate_dx) {
  const int T = (int)x.size(0), in = (int)x.size(-1), out = (int)W.size(0);
  Tensor dyq = gemm_operand(ctx, dy, Operand::Gradient);
  if (dx.defined()) {  // dx[T, in] = dy[T, out] @ W[out, in], stored rounded
    const float beta = accumulate_dx ? 1.0f : 0.0f;
    if (!fp8_on_gpu(ctx) ||
        !fp8_gemm(ctx, dx.reshape({T, in}), {dy.reshape({T, out}), DType::F8E5M2, Fp8Tiles::Row128},
                  {gemm_operand(ctx, W, Operand::Weight, Fp8Tiling::None), DType::F8E4M3,
                   Fp8Tiles::Block128, true},
                  beta)) {
      Tensor wq = gemm_operand(ctx, W, Operand::Weight);
      operand_gemm(ctx, false, false, T, in, out, dyq, out, wq, in, beta, dx, in);
    }
    round_(ctx, dx, output_dtype(ctx.precision), true);
  }
  // dW[out, in] += dy^T @ x, summed into the fp32 accumulator. It contracts along the tokens, so
  // under FP8 x and dy are tiled 128 tokens x 1 (DeepSeek-V3): each scale applies along the
  // contraction, and on Hopper dy^T [out, T] and x^T [in, T] are two 1 x 128 operands.
  if (dW.defined()) {
    if (fp8_on_gpu(ctx) &&
        fp8_gemm(ctx, dW, {dy.reshape({T, out}), DType::F8E5M2, Fp8Tiles::Row128, true},
                 {x.reshape({T, in}), DType::F8E4M3, Fp8Tiles::Row128, true}, 1.0f))
      return;
    Tensor dy_tokens = ctx.precision == Precision::FP8
                           ? gemm_operand(ctx, dy, Operand::Gradient, Fp8Tiling::AlongTokens)
                           : dyq;
    Tensor xq = gemm_operand(ctx, x, Operand::Activation, Fp8Tiling::AlongTokens);
    operand_gemm(ctx, true, false, out, in, T, dy_tokens, out, xq, in, 1.0f, dW, in);
  }
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
  char* end = nullptr;
  const float v = strtof(loss_scale.c_str(), &end);
  if (end == loss_scale.c_str() || *end != '\0' || !std::isfinite(v) || v <= 0.0f)
    throw UsageError("--loss-scale " + loss_scale +
                     ": use dynamic or a positive number (1: no scaling)");
  s.dynamic = false, s.scale = v;
  return s;
}
