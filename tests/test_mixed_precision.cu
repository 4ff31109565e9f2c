// test_mixed_precision.cu: the book's facts about bf16, fp16 and fp8 (Playbook §Mixed precision
// training, §FP8 pretraining), each expected value computed here from the format's definition
// (sign, exponent bits, mantissa bits, bias), never read back from mixed_precision.cu; the
// conversions against CUDA's own (cuda_bf16.h, cuda_fp16.h, cuda_fp8.h, on the host and on the
// GPU); and the error bound of FP8 per-tile scaling.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <vector>

#include "mixed_precision.cuh"

namespace {

// A format as the book's table gives it, and the value of a bit pattern by definition:
// (-1)^s * 2^(e - bias) * 1.m for normal patterns, 2^(1 - bias) * 0.m for subnormal ones.
struct Spec {
  DType dtype;
  int exp_bits, man_bits;
  bool has_inf;  // e4m3 has none: S.1111.111 is its only NaN, S.1111.xxx are numbers
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
  int bits() const { return 1 + exp_bits + man_bits; }
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  double value_of(uint32_t p) const {  // NaN for NaN patterns, +-inf for infinities
    const uint32_t exp_all = (1u << exp_bits) - 1, man_all = (1u << man_bits) - 1;
    const uint32_t e = (p >> man_bits) & exp_all, m = p & man_all;
    const double sign = (p >> (exp_bits + man_bits)) & 1 ? -1.0 : 1.0;
    if (has_inf && e == exp_all) return m ? NAN : sign * INFINITY;
    if (!has_inf && e == exp_all && m == man_all) return NAN;
    if (e == 0) return sign * std::ldexp((double)m, 1 - bias() - man_bits);
    return sign * std::ldexp(1.0 + std::ldexp((double)m, -man_bits), (int)e - bias());
  }
};

const Spec kSpecs[] = {
    {DType::BF16, 8, 7, true, float_to_bf16, [](uint32_t p) { return bf16_to_float(p); }},
    {DType::F16, 5, 10, true, float_to_fp16, [](uint32_t p) { return fp16_to_float(p); }},
    {DType::F8E4M3, 4, 3, false, float_to_e4m3, [](uint32_t p) { return e4m3_to_float(p); }},
    {DType::F8E5M2, 5, 2, true, float_to_e5m2, [](uint32_t p) { return e5m2_to_float(p); }},
};
const Spec& spec(DType t) {
  for (const Spec& s : kSpecs)
    if (s.dtype == t) return s;
  FAIL("no spec");
  return kSpecs[0];
}

float next_up(float x) {
  return std::nextafter(x, INFINITY);
}

// CUDA's host-side conversions: an implementation independent of mixed_precision.cu.
uint32_t cuda_encode(DType t, float x) {
  switch (t) {
    case DType::BF16:
      return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    case DType::F16:
      return __half_as_ushort(__float2half_rn(x));
    case DType::F8E4M3:
      return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
    default:
      return __nv_cvt_float_to_fp8(x, __NV_NOSAT, __NV_E5M2);
  }
}

// Floats that probe every rounding decision: all 2^16 upper halves (every exponent, the round
// bit of fp8 and bf16) with lower halves around fp16's and bf16's round bits, then random ones.
std::vector<float> probe_floats() {
  const uint32_t lows[] = {0,      1,      0x0FFF, 0x1000, 0x1001, 0x2000, 0x3000, 0x3001,
                           0x7FFF, 0x8000, 0x8001, 0xE000, 0xF000, 0xF001, 0xFFFF, 0x4000};
  std::vector<float> out;
  for (uint32_t hi = 0; hi < 0x10000; hi++)
    for (uint32_t lo : lows) {
      const uint32_t b = hi << 16 | lo;
      float x;
      memcpy(&x, &b, 4);
      out.push_back(x);
    }
  uint64_t state = 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < 1 << 20; i++) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t b = (uint32_t)(state >> 32);
    float x;
    memcpy(&x, &b, 4);
    out.push_back(x);
  }
  return out;
}

}  // namespace

TEST_CASE("storage dtypes have their safetensors names and sizes", "[precision]") {
  const std::pair<DType, const char*> names[] = {
      {DType::F32, "F32"}, {DType::I32, "I32"},        {DType::BF16, "BF16"},
      {DType::F16, "F16"}, {DType::F8E4M3, "F8_E4M3"}, {DType::F8E5M2, "F8_E5M2"}};
  for (auto [t, name] : names) {
    CHECK(std::string(dtype_name(t)) == name);
    DType back = DType::I32;
    CHECK(dtype_from_name(name, &back));
    CHECK(back == t);
  }
  for (const Spec& s : kSpecs) CHECK(dtype_size(s.dtype) * 8 == (size_t)s.bits());
  CHECK(dtype_size(DType::F32) == 4);
  DType unchanged = DType::F32;
  CHECK_FALSE(dtype_from_name("F64", &unchanged));
}

TEST_CASE("machine epsilon: fp32 1.19e-7, fp16 9.77e-4, bf16 7.81e-3", "[precision]") {
  // Epsilon: the distance from 1 to the next representable number, 2^-mantissa_bits.
  CHECK(next_up(1.0f) - 1.0f == std::ldexp(1.0f, -23));
  CHECK(std::ldexp(1.0, -23) == Approx(1.19e-7).epsilon(0.01));
  const float fp16_eps = fp16_to_float(float_to_fp16(1.0f) + 1) - 1.0f;
  const float bf16_eps = bf16_to_float(float_to_bf16(1.0f) + 1) - 1.0f;
  CHECK(fp16_eps == std::ldexp(1.0f, -10));
  CHECK(bf16_eps == std::ldexp(1.0f, -7));
  CHECK(fp16_eps == Approx(9.77e-4).epsilon(0.001));
  CHECK(bf16_eps == Approx(7.81e-3).epsilon(0.001));
  CHECK(bf16_eps / fp16_eps == 8);  // "BF16 about 10x FP16": 3 mantissa bits fewer
  CHECK(e4m3_to_float(float_to_e4m3(1.0f) + 1) - 1.0f == 0.125f);
  CHECK(e5m2_to_float(float_to_e5m2(1.0f) + 1) - 1.0f == 0.25f);
}

TEST_CASE("largest finite values: fp16 65504, bf16 3.39e38, e4m3 448, e5m2 57344", "[precision]") {
  // (2 - 2^-m) * 2^(2^e - 2 - bias) for IEEE-like formats; e4m3 keeps the all-ones exponent
  // for numbers and gives up one mantissa pattern for NaN: 1.75 * 2^(15 - 7).
  const double fp16 = (2 - std::ldexp(1.0, -10)) * std::ldexp(1.0, 15);
  const double bf16 = (2 - std::ldexp(1.0, -7)) * std::ldexp(1.0, 127);
  const double e4m3 = 1.75 * std::ldexp(1.0, 15 - 7), e5m2 = 1.75 * std::ldexp(1.0, 15);
  CHECK(fp16 == 65504);
  CHECK(bf16 == Approx(3.39e38).epsilon(0.001));
  CHECK(e4m3 == 448);
  CHECK(e5m2 == 57344);
  CHECK(max_finite(DType::F16) == fp16);
  CHECK(max_finite(DType::BF16) == bf16);
  CHECK(max_finite(DType::F8E4M3) == e4m3);
  CHECK(max_finite(DType::F8E5M2) == e5m2);
  // And no pattern of the format holds a larger finite value.
  for (const Spec& s : kSpecs)
    for (uint32_t p = 0; p < (1u << s.bits()); p++)
      if (std::isfinite(s.value_of(p))) CHECK(std::fabs(s.value_of(p)) <= max_finite(s.dtype));
}

TEST_CASE("values in (1, 2): e4m3 holds 7, e5m2 3, fp16 1023, bf16 127", "[precision]") {
  const std::pair<DType, int> expected[] = {
      {DType::F8E4M3, 7}, {DType::F8E5M2, 3}, {DType::F16, 1023}, {DType::BF16, 127}};
  for (auto [t, count] : expected) {
    int n = 0;
    for (uint32_t p = 0; p < (1u << spec(t).bits()); p++) {
      const float v = spec(t).decode(p);
      n += v > 1.0f && v < 2.0f;
    }
    CHECK(n == count);
  }
}

TEST_CASE("every bf16, fp16 and fp8 bit pattern widens exactly and rounds back to itself",
          "[precision]") {
  for (const Spec& s : kSpecs) {
    INFO(dtype_name(s.dtype));
    for (uint32_t p = 0; p < (1u << s.bits()); p++) {
      const double want = s.value_of(p);
      const float x = s.decode(p);
      INFO("pattern " << p);
      if (std::isnan(want)) {
        CHECK(std::isnan(x));
        CHECK(std::isnan(s.decode(s.encode(x))));
      } else {
        CHECK((double)x == want);
        CHECK(std::signbit(x) == std::signbit(want));  // -0 stays -0
        CHECK(s.encode(x) == p);
      }
    }
  }
}

TEST_CASE("ties round to even", "[precision]") {
  // Halfway between 1 and 1 + eps: down to 1 (mantissa ...0). Halfway between 1 + eps and
  // 1 + 2 eps: up to 1 + 2 eps (mantissa ...10, even).
  for (const Spec& s : kSpecs) {
    INFO(dtype_name(s.dtype));
    const float eps = std::ldexp(1.0f, -s.man_bits);
    CHECK(s.decode(s.encode(1 + eps / 2)) == 1.0f);
    CHECK(s.decode(s.encode(1 + 3 * eps / 2)) == 1 + 2 * eps);
    CHECK(s.decode(s.encode(next_up(1 + eps / 2))) == 1 + eps);  // just past the tie: up
    CHECK(s.decode(s.encode(-(1 + 3 * eps / 2))) == -(1 + 2 * eps));
  }
}

TEST_CASE("values past the range: fp16, bf16 and e5m2 go to infinity, e4m3 saturates at 448",
          "[precision]") {
  // The boundary is the largest finite value plus half its ulp; a tie there rounds to the even
  // neighbour, which is the next power of two, that is infinity (the largest has mantissa 1..1).
  CHECK(fp16_to_float(float_to_fp16(65504 + 15.99f)) == 65504);
  CHECK(std::isinf(fp16_to_float(float_to_fp16(65504 + 16))));
  CHECK(float_to_fp16(-1e6f) == 0xFC00);
  CHECK(float_to_fp16(INFINITY) == 0x7C00);
  CHECK(float_to_bf16(3.4e38f) == 0x7F80);  // fp32's largest range, past bf16's half ulp
  CHECK(float_to_bf16(-INFINITY) == 0xFF80);
  CHECK(e5m2_to_float(float_to_e5m2(61439)) == 57344);
  CHECK(float_to_e5m2(61440) == 0x7C);
  CHECK(float_to_e5m2(-1e9f) == 0xFC);
  // e4m3 has no infinity: overflow to NaN would turn one outlier into a NaN loss; saturating
  // to +-448 (the OCP FP8 "satfinite" conversion that DeepSeek-V3-style training uses) keeps
  // the value finite and as large as the format allows.
  CHECK(e4m3_to_float(float_to_e4m3(464)) == 448);  // the tie: 448 is even (1.110b)
  CHECK(e4m3_to_float(float_to_e4m3(500)) == 448);
  CHECK(e4m3_to_float(float_to_e4m3(1e30f)) == 448);
  CHECK(e4m3_to_float(float_to_e4m3(INFINITY)) == 448);
  CHECK(e4m3_to_float(float_to_e4m3(-INFINITY)) == -448);
  CHECK(e4m3_to_float(0x78) == 256);  // S.1111.000 is a number in e4m3, not infinity
  CHECK(std::isnan(e4m3_to_float(0x7F)));
  CHECK(std::isnan(e4m3_to_float(0xFF)));
}

TEST_CASE("subnormals, signed zeros and NaN", "[precision]") {
  // Smallest subnormal: 2^(1 - bias - m). Half of it is a tie with zero: to zero (even).
  for (const Spec& s : kSpecs) {
    INFO(dtype_name(s.dtype));
    const float tiny = std::ldexp(1.0f, 1 - s.bias() - s.man_bits);
    CHECK(s.encode(tiny) == 1);
    CHECK(s.encode(tiny / 2) == 0);
    CHECK(s.encode(next_up(tiny / 2)) == 1);
    CHECK(s.encode(1.5f * tiny) == 2);  // tie between 1 and 2 ulp: 2
    CHECK(s.encode(2.5f * tiny) == 2);  // tie between 2 and 3 ulp: 2
    // The largest subnormal plus half an ulp rounds up into the smallest normal, 2^(1 - bias).
    const float largest_subnormal = ((1 << s.man_bits) - 1) * tiny;
    CHECK(s.decode(s.encode(largest_subnormal + tiny / 2)) == std::ldexp(1.0f, 1 - s.bias()));
    const uint32_t sign = 1u << (s.bits() - 1);
    CHECK(s.encode(-0.0f) == sign);
    CHECK(s.encode(-tiny / 4) == sign);  // underflow keeps the sign: -0
    CHECK(std::signbit(s.decode(sign)));
    // NaN, of either sign, becomes the canonical NaN: every bit but the sign set.
    CHECK(s.encode(NAN) == sign - 1);
    CHECK(s.encode(-NAN) == sign - 1);
  }
  CHECK(fp16_to_float(1) == std::ldexp(1.0f, -24));
  CHECK(e4m3_to_float(1) == std::ldexp(1.0f, -9));
  CHECK(e5m2_to_float(1) == std::ldexp(1.0f, -16));
  CHECK(bf16_to_float(1) == std::ldexp(1.0f, -133));  // bf16 keeps fp32's subnormals
}

TEST_CASE("the conversions agree bit for bit with CUDA's own (host side)", "[precision]") {
  const std::vector<float> xs = probe_floats();
  for (const Spec& s : kSpecs) {
    INFO(dtype_name(s.dtype));
    int64_t mismatches = 0;
    for (float x : xs) {
      const uint32_t ours = s.encode(x), theirs = cuda_encode(s.dtype, x);
      if (ours != theirs && mismatches++ < 5)
        FAIL_CHECK("x = " << x << ": " << ours << " vs " << theirs);
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("the CUDA cast kernels match the CPU loop bit for bit", "[precision][gpu]") {
  if (!cuda_available()) {
    WARN("SKIP: no CUDA device");
    return;
  }
  const std::vector<float> xs = probe_floats();
  const int64_t n = (int64_t)xs.size();
  Tensor x = empty({n}, Mem::Workspace), x_gpu = empty({n}, Mem::Workspace, Device::CUDA);
  from_host(x, xs.data());
  copy_(x_gpu, x);
  for (const Spec& s : kSpecs) {
    INFO(dtype_name(s.dtype));
    Tensor q = empty({n}, Mem::Workspace, Device::CPU, s.dtype);
    Tensor q_gpu = empty({n}, Mem::Workspace, Device::CUDA, s.dtype);
    cast_(q, x);
    cast_(q_gpu, x_gpu);
    CHECK(memcmp(to_device(q_gpu, Device::CPU, Mem::Workspace).ptr, q.ptr, q.nbytes()) == 0);
    // Back to fp32: every pattern of the format, on both devices.
    const int64_t patterns = 1 << s.bits();
    Tensor p = empty({patterns}, Mem::Workspace, Device::CPU, s.dtype);
    for (int64_t i = 0; i < patterns; i++) {
      if (s.bits() == 16)
        ((uint16_t*)p.ptr)[i] = (uint16_t)i;
      else
        ((uint8_t*)p.ptr)[i] = (uint8_t)i;
    }
    Tensor w = empty({patterns}, Mem::Workspace);
    Tensor w_gpu = empty({patterns}, Mem::Workspace, Device::CUDA);
    cast_(w, p);
    cast_(w_gpu, to_device(p, Device::CUDA, Mem::Workspace));
    const std::vector<float> cpu = to_host_floats(w), gpu = to_host_floats(w_gpu);
    for (int64_t i = 0; i < patterns; i++) {
      INFO("pattern " << i);
      if (std::isnan(cpu[i]))
        CHECK(std::isnan(gpu[i]));
      else
        CHECK(memcmp(&cpu[i], &gpu[i], 4) == 0);
    }
  }
}

// FP8 tiles. Let s = fl(absmax / L) be the tile's scale (L the format's largest finite value),
// y = fl(x / s), q = fp8(y) and d = fl(q * s) the dequantized value. Then
//   |x - d| <= |x - s y| + s |y - q| + |s q - d|
//           <= 2^-24 |x|  +  s ulp(y) / 2  +  2^-24 |s q|
// where ulp(y) = 2^(max(floor(log2 |y|), 1 - bias) - m) is the fp8 spacing at y: round to
// nearest is off by at most half of it, and saturation at L (y a hair above L, by fp32's
// rounding) is off by at most 2^-23 L, far less. Each fp32 rounding costs 2^-24 relative, and
// |s q| <= |x| (1 + 2^-m), so |x - d| <= s ulp(y) / 2 + 2^-22 |x|: half an ulp of the fp8 grid,
// stretched by the tile's scale, plus fp32's share.
TEST_CASE(
    "FP8 tiles (1 x 128 activations, 128 x 128 weights) are within half an ulp of "
    "their scale",
    "[precision]") {
  struct Case {
    DType fmt;
    int64_t rows, cols;
    int tile_rows, tile_cols;
  };
  const Case cases[] = {{DType::F8E4M3, 4, 300, 1, 128},      // activations; a partial tile
                        {DType::F8E4M3, 130, 260, 128, 128},  // weights; partial tiles
                        {DType::F8E5M2, 3, 200, 1, 128}};
  for (const Case& c : cases) {
    INFO(dtype_name(c.fmt) << " tiles " << c.tile_rows << " x " << c.tile_cols);
    const Spec& s = spec(c.fmt);
    const double L = s.value_of(s.has_inf ? (((1u << s.exp_bits) - 1) << s.man_bits) - 1 : 0x7E);
    Tensor x = empty({c.rows, c.cols}, Mem::Workspace);
    uint64_t state = 12345;
    float* xv = x.f32();
    for (int64_t i = 0; i < x.numel(); i++) {  // values over many magnitudes, some tiles loud
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const double u = (double)(state >> 11) / (double)(1ull << 53);
      xv[i] = (float)((u - 0.5) * std::ldexp(1.0, (int)(state % 24) - 12));
    }
    xv[0] = 0, xv[1] = -1e4f;  // an outlier only coarsens its own tile
    const int64_t tr = (c.rows + c.tile_rows - 1) / c.tile_rows;
    const int64_t tc = (c.cols + c.tile_cols - 1) / c.tile_cols;
    Tensor q = empty({c.rows, c.cols}, Mem::Workspace, Device::CPU, c.fmt);
    Tensor scales = empty({tr, tc}, Mem::Workspace), d = empty({c.rows, c.cols}, Mem::Workspace);
    quantize_tiles(q, scales, x, c.tile_rows, c.tile_cols);
    dequantize_tiles(d, q, scales, c.tile_rows, c.tile_cols);
    std::vector<double> absmax(tr * tc, 0.0);
    for (int64_t r = 0; r < c.rows; r++)
      for (int64_t k = 0; k < c.cols; k++) {
        double& a = absmax[(r / c.tile_rows) * tc + k / c.tile_cols];
        a = std::max(a, std::fabs((double)xv[r * c.cols + k]));
      }
    for (int64_t t = 0; t < tr * tc; t++) CHECK(scales.f32()[t] == (float)(absmax[t] / L));
    int64_t inexact = 0;
    for (int64_t r = 0; r < c.rows; r++)
      for (int64_t k = 0; k < c.cols; k++) {
        const int64_t i = r * c.cols + k;
        const double sc = scales.f32()[(r / c.tile_rows) * tc + k / c.tile_cols];
        const double y = std::fabs((double)xv[i]) / sc;
        const int e = y > 0 ? std::max(std::ilogb(y), 1 - s.bias()) : 1 - s.bias();
        const double half_ulp = std::ldexp(1.0, e - s.man_bits) / 2;
        const double err = std::fabs((double)xv[i] - (double)d.f32()[i]);
        INFO("element " << r << ", " << k << ": " << xv[i] << " -> " << d.f32()[i]);
        CHECK(err <= sc * half_ulp + std::ldexp(std::fabs((double)xv[i]), -22));
        inexact += err > 0;
      }
    CHECK(inexact > 0);  // the bound is tested on real rounding, not on exact values only
    CHECK(d.f32()[1] == Approx(-1e4).epsilon(1e-6));  // the absmax lands on +-L: kept
  }
}
