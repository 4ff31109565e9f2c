// dtype.cu: bf16, fp16 and the two FP8 formats as storage (Playbook §Mixed precision training,
// §FP8 pretraining; the formats' table is in mixed_precision.cu): rounding from fp32, to nearest
// with ties to even, and the exact way back, on the CPU and in CUDA kernels that must match it.
// A float is sign | exponent | mantissa; the formats differ only in how many bits each part
// gets, so one rounding routine serves all four.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "runtime/dtype.cuh"
#include "runtime/observe.cuh"

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

std::vector<float> widened(const Tensor& t) {
  PICO_ASSERT(t.device == Device::CPU, "widened reads a host tensor");
  std::vector<float> v((size_t)t.numel());
  cast_host(v.data(), DType::F32, t.ptr, t.dtype, t.numel());
  return v;
}

// The CUDA types' own conversions, so a [gpu] test checks the loop above against NVIDIA's:
// cvt.rn.bf16.f32 / cvt.rn.f16.f32 in hardware; fp8 by cuda_fp8.h (hardware cvt.rn.satfinite
// on sm_89+ for e4m3; e5m2 must overflow to infinity, which only the __NV_NOSAT path does).
// Every NaN is written as the CPU loop writes it, all bits set but the sign, whatever sign or
// payload a conversion would keep: the two devices' bytes are the same.
__global__ void cast_from_f32_kernel(void* dst, DType dst_dtype, const float* src, int64_t n) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = src[i];
  switch (dst_dtype) {
    case DType::BF16:
      ((uint16_t*)dst)[i] = x != x ? 0x7FFF : __bfloat16_as_ushort(__float2bfloat16_rn(x));
      break;
    case DType::F16:
      ((uint16_t*)dst)[i] = x != x ? 0x7FFF : __half_as_ushort(__float2half_rn(x));
      break;
    case DType::F8E4M3:
      ((uint8_t*)dst)[i] = x != x ? 0x7F : __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
      break;
    case DType::F8E5M2:
      ((uint8_t*)dst)[i] = x != x ? 0x7F : __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
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
  if (count_op(dst.device, OpKind::Cast, {0, (double)src.nbytes(), (double)dst.nbytes()})) return;
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

void cast_(const Context& ctx, const Tensor& dst, const Tensor& src) {
  const int64_t n = src.numel();
  PICO_ASSERT(dst.numel() == n, "cast_ " + src.shape_str() + " into " + dst.shape_str());
  check_cast(dst.dtype, src.dtype);  // on every device: the kernels read fp32 on one side
  if (count_op(ctx.device, OpKind::Cast, {0, (double)src.nbytes(), (double)dst.nbytes()})) return;
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

Tensor cast_to(const Context& ctx, const Tensor& t, DType dtype, Mem category) {
  if (t.dtype == dtype) return t;
  Tensor out = empty(ctx, t.shape, category, dtype);
  cast_(ctx, out, t);
  return out;
}

void cast_gradient_host(void* dst, DType dst_dtype, const float* src, int64_t n) {
  cast_host(dst, dst_dtype, src, DType::F32, n);
  std::vector<float> stored((size_t)n);
  cast_host(stored.data(), DType::F32, dst, dst_dtype, n);
  RoundingStats counted;
  for (int64_t i = 0; i < n; i++) counted.add(src[i], stored[i]);
  rounding_stats(true).add(counted);
}

void cast_gradient_(const Context& ctx, const Tensor& dst, const Tensor& src) {
  if (ctx.device != Device::CPU || src.dtype != DType::F32 || dst.dtype == DType::F32)
    return cast_(ctx, dst, src);
  PICO_ASSERT(dst.numel() == src.numel(),
              "cast_gradient_ " + src.shape_str() + " into " + dst.shape_str());
  count_op(ctx.device, OpKind::Cast, {0, (double)src.nbytes(), (double)dst.nbytes()});
  cast_gradient_host(dst.ptr, dst.dtype, src.f32(), src.numel());
}

// ----------------------------------------------------------------------------
// --dtype

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
DType activation_dtype(Precision p) {
  return p == Precision::FP8 ? DType::F32 : output_dtype(p);
}

void to_compute_format(const Context& ctx, Tensor& x, Mem category) {
  x = cast_to(ctx, x, activation_dtype(ctx.precision), category);
}
Tensor empty_in_compute_format(const Context& ctx, std::vector<int64_t> shape, Mem category) {
  return empty(ctx, std::move(shape), category, activation_dtype(ctx.precision));
}
Tensor empty_residual(const Context& ctx, std::vector<int64_t> shape, Mem category) {
  return empty(ctx, std::move(shape), category, ctx.residual);
}
Tensor gradient_storage(const Context& ctx, const Tensor& dy) {
  const DType format = activation_dtype(ctx.precision);
  return dy.dtype == format ? dy : empty(ctx, dy.shape, Mem::Workspace, format);
}
Tensor gradient_operand(const Context& ctx, const Tensor& dy) {
  Tensor stored = gradient_storage(ctx, dy);
  if (stored.ptr != dy.ptr) cast_gradient_(ctx, stored, dy);
  return stored;
}
void store_in_compute_format(const Context& ctx, const std::vector<Tensor*>& kept) {
  if (ctx.precision == Precision::FP32) return;
  for (Tensor* t : kept)
    if (t->defined()) *t = cast_to(ctx, *t, output_dtype(ctx.precision), Mem::Activations);
}
void widen_to_fp32(const Context& ctx, const std::vector<Tensor*>& kept) {
  for (Tensor* t : kept)
    if (t->defined()) *t = cast_to(ctx, *t, DType::F32, Mem::Workspace);
}
