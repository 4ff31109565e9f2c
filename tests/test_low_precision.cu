// test_low_precision.cu: the linear layers under --dtype bf16, fp16 and fp8 (Playbook §Mixed
// precision training, §FP8 pretraining), each against a float64 recomputation written here from
// the rule "operands rounded, products summed in fp32, output rounded"; and the fp16 loss
// scaler's rule. The formats' own conversions are tested against the book's facts and CUDA's
// in test_mixed_precision.cu, so the rounding of single values is taken from them here.
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <vector>

#include "cuda_case.cuh"
#include "kernels/fp8_gemm.cuh"
#include "launch.cuh"
#include "mixed_precision.cuh"
#include "model.cuh"
#include "runtime/core.cuh"
#include "runtime/ops.cuh"
#include "tensor_parallel.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;

namespace {

float as_bf16(float x) {
  return bf16_to_float(float_to_bf16(x));
}
float as_fp16(float x) {
  return fp16_to_float(float_to_fp16(x));
}
float stored(Precision p, float x) {
  return p == Precision::FP16 ? as_fp16(x) : as_bf16(x);
}

Tensor filled(std::vector<int64_t> shape, uint64_t seed, float scale) {
  Tensor t = empty(shape, Mem::Workspace);
  for (int64_t i = 0; i < t.numel(); i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    t.f32()[i] = scale * (float)((double)(seed >> 11) / (double)(1ull << 53) * 2 - 1);
  }
  return t;
}

Tensor copy_of(const Tensor& t) {
  Tensor c = empty(t.shape, Mem::Workspace);
  copy_(c, t);
  return c;
}

// A float64 sum, and the sum of its terms' magnitudes (what fp32's rounding error scales with).
struct Sum64 {
  double sum = 0, abs = 0;
  void add(double term) { sum += term, abs += std::fabs(term); }
};

// y must be a value of the format, and the rounding of some number within fp32's summation
// error of the float64 sum y64 of the rounded operands' products (K terms, at most 2^-24 of
// the running |sum| each): between the roundings of y64 -+ that error. Mostly that is one value.
void require_rounded_sum(Precision p, float y, double y64, double abs_sum, int K) {
  const double fp32_error = K * std::ldexp(abs_sum, -24);
  const float lo = stored(p, (float)(y64 - fp32_error)), hi = stored(p, (float)(y64 + fp32_error));
  INFO("y " << y << ", float64 " << y64 << ", allowed " << lo << " .. " << hi);
  REQUIRE(y == stored(p, y));
  REQUIRE((lo <= y && y <= hi));
}

}  // namespace

TEST_CASE("round_ stores what the format conversions give, and counts underflow and overflow",
          "[precision]") {
  Context ctx = Context::create(Device::CPU);
  std::vector<float> values;
  for (uint32_t p = 0; p < 0x10000; p++) {  // every fp16 value, and both sides of each midpoint
    float v = fp16_to_float((uint16_t)p), next = fp16_to_float((uint16_t)(p + 1));
    values.push_back(v);
    if (std::isfinite(v) && std::isfinite(next) && (p & 0x7FFF) != 0x7BFF) {
      float mid = (float)(((double)v + next) / 2);
      values.insert(values.end(), {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f),
                                   std::nextafter(mid, -1e30f)});
    }
  }
  uint64_t s = 99;
  for (int i = 0; i < 200000; i++) {  // random fp32 bit patterns: every exponent
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t b = (uint32_t)(s >> 32);
    float v;
    memcpy(&v, &b, 4);
    values.push_back(v);
  }
  values.insert(values.end(), {65504.0f, 65519.996f, 65520.0f, 1e-8f, 3e-8f, 2.9802322e-08f});
  for (DType f : {DType::BF16, DType::F16}) {
    INFO(dtype_name(f));
    Tensor t = empty({(int64_t)values.size()}, Mem::Workspace);
    memcpy(t.ptr, values.data(), values.size() * 4);
    round_(ctx, t, f);
    int64_t wrong = 0;
    for (size_t i = 0; i < values.size(); i++) {
      float want = f == DType::BF16 ? as_bf16(values[i]) : as_fp16(values[i]);
      bool same = std::isnan(want) ? std::isnan(t.f32()[i]) : want == t.f32()[i];
      if (!same && wrong++ < 5) WARN(values[i] << " became " << t.f32()[i] << ", not " << want);
    }
    REQUIRE(wrong == 0);
  }
  // fp16: 1e-8 is below half the smallest subnormal (2^-25): it flushes; 1e5 overflows.
  reset_rounding_stats();
  Tensor t = empty({5}, Mem::Workspace);
  const float v[5] = {1e-8f, 1e5f, 1.0f, 0.0f, -3e-5f};
  memcpy(t.ptr, v, sizeof v);
  round_(ctx, t, DType::F16, true);
  RoundingStats st = rounding_stats(true);
  CHECK(st.nonzero == 4);
  CHECK(st.flushed == 1);
  CHECK(st.overflowed == 1);
  CHECK(rounding_stats(false).nonzero == 0);  // the forward's count is separate
  CHECK(st.flushed_share() == 0.25);
}

// Guards against: an operand not rounded (the cancellation rows below), the output not rounded,
// the weight gradient rounded (it is summed into an fp32 accumulator), dx not accumulated.
TEST_CASE("bf16 and fp16 linear layers: operands rounded, fp32 sums, outputs rounded",
          "[precision]") {
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::CPU);
    ctx.precision = p;
    const int T = 5, in = 70, out = 6;
    Tensor x = filled({T, in}, 1, 1.0f), W = filled({out, in}, 2, 0.5f);
    // Row 0: x = 1 + 2^-8 + 2^-10 and 1 against weights 1 and -1: y = round(x0) - 1, which is
    // 2^-7 in bf16 but 2^-8 + 2^-10 unrounded (exact in both formats): a forgotten rounding of
    // x shows up as 0.0049 instead of 0.0078. fp16 keeps x0 exactly (10 mantissa bits).
    // Row 1 the same for the weights: x = 1, -1 against W = 1 + 2^-8 + 2^-10, 1.
    for (int k = 0; k < in; k++) x.f32()[k] = x.f32()[in + k] = W.f32()[k] = W.f32()[in + k] = 0;
    x.f32()[0] = 1 + 0.00390625f + 0.0009765625f, x.f32()[1] = 1;
    W.f32()[0] = 1, W.f32()[1] = -1;
    x.f32()[in] = 1, x.f32()[in + 1] = -1;
    W.f32()[in] = 1 + 0.00390625f + 0.0009765625f, W.f32()[in + 1] = 1;
    Tensor y = empty({T, out}, Mem::Workspace);
    linear_forward(ctx, y, x, W);
    const float diff = p == Precision::BF16 ? 0.0078125f : 0.0048828125f;
    CHECK(y.f32()[0] == diff);        // x rounded
    CHECK(y.f32()[out + 1] == diff);  // W rounded
    for (int t = 0; t < T; t++)
      for (int o = 0; o < out; o++) {
        Sum64 s;
        for (int k = 0; k < in; k++)
          s.add((double)stored(p, x.f32()[t * in + k]) * stored(p, W.f32()[o * in + k]));
        require_rounded_sum(p, y.f32()[t * out + o], s.sum, s.abs, in);
      }

    Tensor dy = filled({T, out}, 3, 0.25f), dx = filled({T, in}, 4, 0.1f),
           dW = filled({out, in}, 5, 0.1f);
    for (int64_t i = 0; i < dx.numel(); i++) dx.f32()[i] = stored(p, dx.f32()[i]);  // as stored
    std::vector<float> dx0(dx.f32(), dx.f32() + dx.numel()), dW0(dW.f32(), dW.f32() + dW.numel());
    linear_backward(ctx, dx, dW, dy, x, W, /*accumulate_dx=*/true);
    for (int t = 0; t < T; t++)
      for (int k = 0; k < in; k++) {  // dx = round(dx0 + dy @ W)
        Sum64 s;
        s.add(dx0[t * in + k]);
        for (int o = 0; o < out; o++)
          s.add((double)stored(p, dy.f32()[t * out + o]) * stored(p, W.f32()[o * in + k]));
        require_rounded_sum(p, dx.f32()[t * in + k], s.sum, s.abs, out + 1);
      }
    int64_t unrounded = 0;
    for (int o = 0; o < out; o++)
      for (int k = 0; k < in; k++) {  // dW = dW0 + dy^T x in fp32: within fp32's error
        Sum64 s;
        s.add(dW0[o * in + k]);
        for (int t = 0; t < T; t++)
          s.add((double)stored(p, dy.f32()[t * out + o]) * stored(p, x.f32()[t * in + k]));
        float got = dW.f32()[o * in + k];
        REQUIRE(std::fabs(got - s.sum) <= (T + 1) * std::ldexp(s.abs, -23));
        unrounded += got != stored(p, got);
      }
    CHECK(unrounded > out * in / 2);  // the accumulator keeps fp32 values, not bf16/fp16 ones
  }
}

// Guards against: a gradient rounded and counted once per GEMM that reads it (the input's and,
// under a zero-bubble schedule later, the weights'), which weighs it twice in grad_underflow;
// an input gradient stored in 16 bits that is not the fp32 one rounded.
TEST_CASE("a linear layer's output gradient is rounded once for both GEMMs, and counted once",
          "[precision]") {
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::CPU);
    ctx.precision = p;
    const int T = 6, in = 40, out = 5;
    Tensor x = filled({T, in}, 31, 1.0f), W = filled({out, in}, 32, 0.5f);
    Tensor dy = filled({T, out}, 33, 0.25f);
    dy.f32()[0] = 1e-45f;  // rounds to zero in both formats
    uint64_t dy_nonzero = 0;
    for (int64_t i = 0; i < dy.numel(); i++) dy_nonzero += dy.f32()[i] != 0;
    // One call, both halves: dy rounded once inside it, then dx rounded.
    Tensor dx_ref = empty({T, in}, Mem::Workspace), dW_ref = zeros({out, in}, Mem::Workspace);
    reset_rounding_stats();
    linear_backward(ctx, dx_ref, dW_ref, dy, x, W);
    const RoundingStats both = rounding_stats(true);
    // The halves apart on the gradient as gradient_operand stores it.
    reset_rounding_stats();
    Tensor dyq = gradient_operand(ctx, dy);
    CHECK(dyq.dtype == output_dtype(p));
    CHECK(rounding_stats(true).nonzero == dy_nonzero);
    CHECK(rounding_stats(true).flushed == 1);
    Tensor dx = empty({T, in}, Mem::Workspace), dW = zeros({out, in}, Mem::Workspace);
    linear_backward(ctx, dx, Tensor(), dyq, x, W);
    linear_backward(ctx, Tensor(), dW, dyq, x, W);
    CHECK(memcmp(dx.ptr, dx_ref.ptr, dx.nbytes()) == 0);
    CHECK(memcmp(dW.ptr, dW_ref.ptr, dW.nbytes()) == 0);
    CHECK(rounding_stats(true).nonzero == both.nonzero);
    CHECK(rounding_stats(true).flushed == both.flushed);
    // dx stored in the format: the fp32 path's values, its rounding counted as dx's was.
    Tensor dx16 = empty({T, in}, Mem::Workspace, Device::CPU, output_dtype(p));
    Tensor want = empty({T, in}, Mem::Workspace, Device::CPU, output_dtype(p));
    cast_(ctx, want, dx_ref);
    reset_rounding_stats();
    linear_backward(ctx, dx16, Tensor(), dyq, x, W);
    CHECK(memcmp(dx16.ptr, want.ptr, dx16.nbytes()) == 0);
    CHECK(rounding_stats(true).nonzero == both.nonzero - dy_nonzero);
    CHECK(rounding_stats(true).flushed == both.flushed - 1);
  }
}

// Guards against: E4M3 used for the gradient (E5M2's range is what gradients need), tiles of
// the wrong shape (the weight gradient reusing the forward's 1 x 128 tiles, whose scales run
// across its contraction), outputs not rounded to bf16.
TEST_CASE(
    "fp8 linear layers: E4M3 tiles forward, E5M2 tiles for the gradient, tiles along the tokens "
    "for the weight gradient, bf16 outputs",
    "[precision]") {
  Context ctx = Context::create(Device::CPU);
  ctx.precision = Precision::FP8;
  const int T = 130, in = 200, out = 130;  // partial 1 x 128, 128 x 1 and 128 x 128 tiles
  Tensor x = filled({T, in}, 7, 2.0f), W = filled({out, in}, 8, 0.05f);
  Tensor dy = filled({T, out}, 9, 1e-3f);
  x.f32()[5] = 40.0f;  // an outlier coarsens only its own tiles: 1 x 128, and 128 x 1 for dW
  // The test's own copy of each operand as the GEMM should see it.
  auto dequantized = [](const Tensor& t, DType fmt, int tr, int tc) {
    int64_t rows = t.size(0), cols = t.size(1);
    Tensor q = empty(t.shape, Mem::Workspace, Device::CPU, fmt);
    Tensor s = empty({(rows + tr - 1) / tr, (cols + tc - 1) / tc}, Mem::Workspace);
    Tensor d = empty(t.shape, Mem::Workspace);
    quantize_tiles(q, s, t, tr, tc);
    dequantize_tiles(d, q, s, tr, tc);
    return std::vector<float>(d.f32(), d.f32() + d.numel());
  };
  std::vector<float> xq = dequantized(x, DType::F8E4M3, 1, 128);
  Tensor W16 = empty(W.shape, Mem::Workspace);  // weights are quantized from their bf16 copy
  for (int64_t i = 0; i < W.numel(); i++) W16.f32()[i] = as_bf16(W.f32()[i]);
  std::vector<float> wq = dequantized(W16, DType::F8E4M3, 128, 128);
  std::vector<float> dyq = dequantized(dy, DType::F8E5M2, 1, 128);
  // The weight gradient contracts over the tokens: x and dy in tiles of 128 tokens x 1 column.
  std::vector<float> x_tokens = dequantized(x, DType::F8E4M3, 128, 1);
  std::vector<float> dy_tokens = dequantized(dy, DType::F8E5M2, 128, 1);
  Tensor y = empty({T, out}, Mem::Workspace);
  linear_forward(ctx, y, x, W);
  for (int t = 0; t < T; t++)
    for (int o = 0; o < out; o++) {
      Sum64 s;
      for (int k = 0; k < in; k++) s.add((double)xq[t * in + k] * wq[o * in + k]);
      require_rounded_sum(Precision::BF16, y.f32()[t * out + o], s.sum, s.abs, in);
    }
  Tensor dx = empty({T, in}, Mem::Workspace), dW = zeros({out, in}, Mem::Workspace);
  linear_backward(ctx, dx, dW, dy, x, W);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < in; k++) {
      Sum64 s;
      for (int o = 0; o < out; o++) s.add((double)dyq[t * out + o] * wq[o * in + k]);
      require_rounded_sum(Precision::BF16, dx.f32()[t * in + k], s.sum, s.abs, out);
    }
  // dW is the fp32 sum of T products, not rounded: each product and each addition is off by at
  // most 2^-24 of the sum of |products|, (2T - 1) 2^-24 < T 2^-23 in all. A tile of the wrong
  // shape moves elements by up to FP8's 2^-4 (E4M3) or 2^-3 (E5M2), thousands of times more.
  for (int o = 0; o < out; o++)
    for (int k = 0; k < in; k++) {
      Sum64 s;
      for (int t = 0; t < T; t++) s.add((double)dy_tokens[t * out + o] * x_tokens[t * in + k]);
      REQUIRE(std::fabs(dW.f32()[o * in + k] - s.sum) <= T * std::ldexp(s.abs, -23));
    }
}

// Micikevicius et al.: halve on overflow and skip, double after `window` good steps.
TEST_CASE(
    "the dynamic loss scale halves on overflow, doubles after its window, and a static "
    "one stays",
    "[precision]") {
  LossScaler s = make_loss_scaler(Precision::FP16, "dynamic", 3, true);
  REQUIRE(s.enabled);
  CHECK(s.scale == 65536.0f);
  CHECK(!s.update(false));
  CHECK(s.scale == 32768.0f);
  CHECK(s.skipped == 1);
  CHECK(s.update(true));
  CHECK(s.update(true));
  CHECK(s.scale == 32768.0f);
  CHECK(s.update(true));  // the third good step in a row
  CHECK(s.scale == 65536.0f);
  CHECK(s.update(true));
  CHECK(!s.update(false));  // an overflow restarts the count of good steps
  CHECK(s.update(true));
  CHECK(s.update(true));
  CHECK(s.scale == 32768.0f);
  LossScaler fixed = make_loss_scaler(Precision::FP16, "1", 1000, true);
  CHECK(!fixed.dynamic);
  CHECK(!fixed.update(false));
  CHECK(fixed.scale == 1.0f);
  CHECK(!make_loss_scaler(Precision::BF16, "dynamic", 1000, false).enabled);
  CHECK_THAT(usage_error_of([] { make_loss_scaler(Precision::BF16, "dynamic", 1000, true); }),
             Catch::Contains("--loss-scale") && Catch::Contains("fp16 only"));
  for (const char* bad : {"0", "-2", "nan", "inf", "abc", ""})
    CHECK_THAT(usage_error_of([&] { make_loss_scaler(Precision::FP16, bad, 1000, true); }),
               Catch::Contains("--loss-scale " + std::string(bad) + ":"));
  CHECK_THAT(usage_error_of([] { make_loss_scaler(Precision::FP16, "dynamic", 0, true); }),
             Catch::Contains("--loss-scale-window 0"));
  CHECK_THAT(usage_error_of([] { parse_precision("fp9"); }), Catch::Contains("--dtype fp9"));
}

// Guards: a stale copy (not refreshed after the master weights change), a copy in the wrong
// format, GEMMs that miss the copy, and the memory counted under the wrong category.
TEST_CASE("the kept bf16 weights give the GEMMs exactly what rounding the fp32 weights gives",
          "[precision]") {
  for (Precision p : {Precision::BF16, Precision::FP16, Precision::FP8}) {
    INFO(precision_name(p));
    ModelConfig cfg;
    cfg.d_model = 32, cfg.layers = 2, cfg.heads = 4, cfg.kv_heads = 2, cfg.ffn = 64, cfg.seq = 16;
    Model model = build_model(cfg, Device::CPU, 5);
    Context ctx = Context::create(Device::CPU);
    ctx.precision = p;
    const int B = 2, T = 16;
    std::vector<int32_t> ids(B * T), targets(B * T);
    for (int i = 0; i < B * T; i++) ids[i] = (i * 37) % 256, targets[i] = (i * 11 + 3) % 256;
    auto run = [&] {
      Activations acts;
      zero_(model.grads);
      float loss =
          model_forward(ctx, model, acts, ids.data(), targets.data(), B, T, Recompute::None);
      model_backward(ctx, model, acts, 1.0f / (B * T), Recompute::None);
      std::vector<float> out = to_host_floats(model.grads);
      out.push_back(loss);
      return out;
    };
    std::vector<float> rounded = run();  // every GEMM rounds the fp32 weights itself
    const MemoryStats before = memory_stats();
    keep_compute_copy(ctx, model.params);
    const MemoryStats after = memory_stats();
    const size_t n = (size_t)model.num_params;
    auto grew = [&](Mem m) {
      return (long long)after.current[(int)m] - (long long)before.current[(int)m];
    };
    CHECK(grew(Mem::Params) == 2LL * (long long)n - 4LL * (long long)n);  // + copy, - master
    CHECK(grew(Mem::Optimizer) == 4LL * (long long)n);                    // the master weights
    CHECK(run() == rounded);                                              // bit for bit
    // The master weights move: a copy not refreshed would keep the old values.
    for (int64_t i = 0; i < model.params.numel(); i++) model.params.f32()[i] *= 1.01f;
    refresh_compute_copies(ctx);
    std::vector<float> with_copy = run();
    ctx.weight_copies.reset();
    CHECK(run() == with_copy);
    CHECK(with_copy != rounded);
  }
}

// An input the linear layers read several times (the norms' outputs; SwiGLU's) is rounded into
// the compute format once and kept so: every GEMM must read exactly the values it read when it
// rounded the fp32 input itself, and the kept tensor must hold the format's own rounding of each
// value (as_bf16 / as_fp16 above) at half the bytes. Under fp32 and fp8 nothing changes (fp8's
// GEMMs quantize fp32 values themselves). An output (attention's) is stored so too, and under
// fp8 rounded to bf16 in place.
TEST_CASE("an input kept in the compute format gives the linear layers what rounding it gives",
          "[precision]") {
  for (Precision p : {Precision::FP32, Precision::BF16, Precision::FP16, Precision::FP8}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::CPU);
    ctx.precision = p;
    const int T = 12, in = 40, out = 24;
    Tensor x = filled({T, in}, 31, 3.0f), W = filled({out, in}, 32, 0.2f),
           dy = filled({T, out}, 33, 0.05f);
    Tensor kept = copy_of(x);
    const MemoryStats before = memory_stats();
    to_compute_format(ctx, kept, Mem::Activations);
    const bool sixteen = p == Precision::BF16 || p == Precision::FP16;
    CHECK(kept.dtype == (sixteen ? output_dtype(p) : DType::F32));
    if (sixteen) {
      CHECK(memory_stats().current[(int)Mem::Activations] - before.current[(int)Mem::Activations] ==
            (size_t)(2 * T * in));
      std::vector<float> values = widened(kept);
      for (int64_t i = 0; i < x.numel(); i++) REQUIRE(values[i] == stored(p, x.f32()[i]));
    }
    Tensor y = empty({T, out}, Mem::Workspace), y_kept = empty({T, out}, Mem::Workspace);
    Tensor dW = zeros({out, in}, Mem::Workspace), dW_kept = zeros({out, in}, Mem::Workspace);
    linear_forward(ctx, y, x, W);
    linear_forward(ctx, y_kept, kept, W);
    linear_backward(ctx, Tensor(), dW, dy, x, W);
    linear_backward(ctx, Tensor(), dW_kept, dy, kept, W);
    CHECK(to_host_floats(y_kept) == to_host_floats(y));  // bit for bit
    CHECK(to_host_floats(dW_kept) == to_host_floats(dW));
    // An output made in the compute format (the MLP's gate and up) holds the same values.
    Tensor y16 = empty(ctx, {T, out}, Mem::Activations, activation_dtype(p));
    CHECK(y16.dtype == (sixteen ? output_dtype(p) : DType::F32));
    linear_forward(ctx, y16, kept, W);
    CHECK(widened(y16) == to_host_floats(y));

    Tensor o = copy_of(x);
    output_in_compute_format(ctx, o, Mem::Activations);
    CHECK(o.dtype == (sixteen ? output_dtype(p) : DType::F32));
    std::vector<float> values = widened(o);
    for (int64_t i = 0; i < x.numel(); i++)
      REQUIRE(values[i] == (p == Precision::FP32 ? x.f32()[i] : stored(p, x.f32()[i])));
  }
}

// The embedding looks its rows up in the weights' 16-bit copy, widening only those rows: the
// same values a lookup in the whole widened table gives (the format's rounding, as_bf16 /
// as_fp16), and id -1 a zero row.
TEST_CASE("the embedding reads a bf16 or fp16 table: each row the format's values", "[precision]") {
  for (Precision p : {Precision::BF16, Precision::FP16}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::CPU);
    const int V = 9, D = 7;
    Tensor table = filled({V, D}, 41, 2.0f);
    Tensor half = empty({V, D}, Mem::Params, Device::CPU, output_dtype(p));
    cast_(ctx, half, table);
    Tensor ids = empty({4}, Mem::Activations, Device::CPU, DType::I32);
    const int32_t id_values[] = {3, -1, 8, 3};
    from_host(ids, id_values);
    Tensor rows = empty({4, D}, Mem::Activations);
    embedding_forward(ctx, rows, ids, half);
    for (int t = 0; t < 4; t++)
      for (int i = 0; i < D; i++) {
        const float want =
            id_values[t] < 0 ? 0.0f : stored(p, table.f32()[(int64_t)id_values[t] * D + i]);
        REQUIRE(rows.f32()[t * D + i] == want);
      }
    // Rows in the format itself (a 16-bit residual stream): from the 16-bit table its entries,
    // from the fp32 table each value rounded once; the same values either way.
    for (const Tensor* from : {&half, &table}) {
      Tensor rows16 = empty({4, D}, Mem::Activations, Device::CPU, output_dtype(p));
      embedding_forward(ctx, rows16, ids, *from);
      const std::vector<float> got = widened(rows16);
      for (int t = 0; t < 4; t++)
        for (int i = 0; i < D; i++)
          REQUIRE(
              got[t * D + i] ==
              (id_values[t] < 0 ? 0.0f : stored(p, table.f32()[(int64_t)id_values[t] * D + i])));
    }
  }
}

// Linear layers of one shape on one input (k and v; gate and up) with their weights and outputs
// side by side in memory run as one strided-batched GEMM: on the CPU one cblas call each inside
// it, so the values must be those of a linear each, bit for bit (the reference: linear_forward
// and linear_backward called one by one), and the ledger shows one launch where the CUDA path
// makes one cuBLAS call. Guards against a wrong stride or operand (the values), and a batch that
// never forms (the launches).
TEST_CASE("linear layers side by side: one batched GEMM, the values of one linear each",
          "[precision]") {
  Context ctx = Context::create(Device::CPU);
  const int64_t T = 9, in = 24, out = 16, count = 3;
  Tensor x = filled({T, in}, 5, 1.0f), W = filled({count * out * in}, 6, 0.5f);
  Tensor dy = filled({count * T * out}, 7, 1.0f), y = empty({count * T * out}, Mem::Workspace);
  Tensor dW = filled({count * out * in}, 8, 0.1f), dW_ref = copy_of(dW);
  std::vector<Tensor> Ws, ys, dys, dWs, dWs_ref;
  for (int64_t i = 0; i < count; i++) {
    Ws.push_back(W.view(i * out * in, {out, in})), ys.push_back(y.view(i * T * out, {T, out}));
    dys.push_back(dy.view(i * T * out, {T, out})), dWs.push_back(dW.view(i * out * in, {out, in}));
    dWs_ref.push_back(dW_ref.view(i * out * in, {out, in}));
  }
  reset_ledger();
  linear_forward_many(ctx, ys, x, Ws);
  linear_weight_grads_many(ctx, dWs, dys, x, Ws);
  CHECK(ledger().rows[(int)OpKind::Gemm].launches == 2);  // one forward, one weight gradient
  CHECK(ledger().gemm_shapes.at({T, out, in, MathUnit::CudaCores}).calls == count);
  for (int64_t i = 0; i < count; i++) {
    Tensor want = empty({T, out}, Mem::Workspace);
    linear_forward(ctx, want, x, Ws[i]);
    linear_backward(ctx, Tensor(), dWs_ref[i], dys[i], x, Ws[i]);
    CHECK(memcmp(want.ptr, ys[i].ptr, want.nbytes()) == 0);
  }
  CHECK(memcmp(dW.ptr, dW_ref.ptr, dW.nbytes()) == 0);
  // Overlapping outputs cannot be a batch: one linear each, the same values.
  Tensor y2 = empty({T * out + out}, Mem::Workspace);
  reset_ledger();
  linear_forward_many(ctx, {y2.view(0, {T, out}), y2.view(out, {T, out})}, x, {Ws[0], Ws[1]});
  CHECK(ledger().rows[(int)OpKind::Gemm].launches == 2);
  Tensor want = empty({T, out}, Mem::Workspace);
  linear_forward(ctx, want, x, Ws[1]);
  CHECK(memcmp(want.ptr, y2.f32() + out, want.nbytes()) == 0);
}

// On the GPU path (counted on meta) under bf16 the batch reads the weights' kept 16-bit copies;
// under fp8, whose GEMMs quantize each weight on its own, there is no batch.
TEST_CASE("linear layers side by side batch on the GPU path under bf16, not under fp8",
          "[precision]") {
  for (Precision p : {Precision::BF16, Precision::FP8}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::Meta);
    ctx.precision = p;
    const int64_t T = 64, in = 32, out = 16;
    Tensor master = empty({2 * out * in}, Mem::Params, Device::Meta);
    keep_compute_copy(ctx, master);
    const DType format = activation_dtype(p);
    Tensor x = empty({T, in}, Mem::Workspace, Device::Meta, format);
    Tensor y = empty({2 * T * out}, Mem::Workspace, Device::Meta, format);
    reset_ledger();
    linear_forward_many(ctx, {y.view(0, {T, out}), y.view(T * out, {T, out})}, x,
                        {master.view(0, {out, in}), master.view(out * in, {out, in})});
    CHECK(ledger().rows[(int)OpKind::Gemm].launches == (p == Precision::BF16 ? 1 : 2));
    ctx.destroy();
  }
}

// Under fp8 on the GPU path (counted on meta) the backward's two GEMMs are FP8 GEMMs, each
// quantizing its two operands: the dgrad dy and the weight (widened from its bf16 copy first),
// the wgrad dy and x (fp32 activations, as fp8 keeps them); and dx rounded to bf16 as every
// fp8 output is. Six casts; dy's fp32 copy with its fake quantization is made only where an
// emulated GEMM reads it, so none here.
TEST_CASE("the FP8 linear backward on the GPU path casts only what its FP8 GEMMs read",
          "[precision]") {
  Context ctx = Context::create(Device::Meta);
  ctx.precision = Precision::FP8;
  const int64_t T = 128, in = 64, out = 32;
  Tensor W = empty({out, in}, Mem::Params, Device::Meta);
  keep_compute_copy(ctx, W);
  const DType format = activation_dtype(Precision::FP8);
  REQUIRE(format == DType::F32);
  Tensor x = empty({T, in}, Mem::Workspace, Device::Meta, format);
  Tensor dy = empty({T, out}, Mem::Workspace, Device::Meta, format);
  Tensor dx = empty({T, in}, Mem::Workspace, Device::Meta, format);
  Tensor dW = empty({out, in}, Mem::Grads, Device::Meta);
  const Fp8GemmCounts before = fp8_gemm_counts();
  reset_ledger();
  linear_backward(ctx, dx, dW, dy, x, W);
  CHECK(fp8_gemm_counts().native - before.native == 2);
  CHECK(ledger().rows[(int)OpKind::Cast].calls == 6);
  CHECK(ledger().rows[(int)OpKind::Gemm].calls == 2);
  ctx.destroy();
}

// The batch on the GPU (cublasGemmStridedBatchedEx / cublasSgemmStridedBatched) against one
// linear each there: the same sums, which cuBLAS may order differently in a batched kernel, so
// each bf16 output within one unit of its last place (2^-7 of its value, plus a few fp32
// roundings of the 64-term sums near zero) and each fp32 weight gradient within 1e-5 relative
// (128-term sums, fp32) of the other's.
TEST_CASE("CUDA linear layers side by side: the batched GEMM equals one linear each",
          "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  for (Precision p : {Precision::FP32, Precision::BF16, Precision::FP16}) {
    INFO(precision_name(p));
    Context ctx = Context::create(Device::CUDA);
    ctx.precision = p;
    const int64_t T = 128, in = 64, out = 32;
    auto gpu = [](const Tensor& t) { return to_device(t, Device::CUDA, Mem::Workspace); };
    Tensor master = to_device(filled({2 * out * in}, 21, 0.5f), Device::CUDA, Mem::Params);
    if (p != Precision::FP32) keep_compute_copy(ctx, master);
    const DType format = activation_dtype(p);
    Tensor x = empty({T, in}, Mem::Workspace, Device::CUDA, format);
    Tensor dy = empty({2 * T * out}, Mem::Workspace, Device::CUDA, format);
    cast_(ctx, x, gpu(filled({T, in}, 22, 1.0f))),
        cast_(ctx, dy, gpu(filled({2 * T * out}, 23, 1.0f)));
    Tensor y = empty({2 * T * out}, Mem::Workspace, Device::CUDA, format);
    Tensor dW = gpu(filled({2 * out * in}, 24, 0.1f)),
           dW_ref = gpu(filled({2 * out * in}, 24, 0.1f));
    std::vector<Tensor> Ws, ys, dys, dWs;
    for (int64_t i = 0; i < 2; i++) {
      Ws.push_back(master.view(i * out * in, {out, in}));
      ys.push_back(y.view(i * T * out, {T, out})), dys.push_back(dy.view(i * T * out, {T, out}));
      dWs.push_back(dW.view(i * out * in, {out, in}));
    }
    linear_forward_many(ctx, ys, x, Ws);
    linear_weight_grads_many(ctx, dWs, dys, x, Ws);
    for (int64_t i = 0; i < 2; i++) {
      Tensor want = empty({T, out}, Mem::Workspace, Device::CUDA, format);
      linear_forward(ctx, want, x, Ws[i]);
      linear_backward(ctx, Tensor(), dW_ref.view(i * out * in, {out, in}), dys[i], x, Ws[i]);
      ctx.synchronize();
      std::vector<float> got = widened(to_device(ys[i], Device::CPU, Mem::Workspace));
      std::vector<float> ref = widened(to_device(want, Device::CPU, Mem::Workspace));
      for (size_t e = 0; e < got.size(); e++)
        REQUIRE(std::fabs(got[e] - ref[e]) <= std::ldexp(std::fabs(ref[e]), -7) + 1e-5f);
    }
    std::vector<float> got = to_host_floats(dW), ref = to_host_floats(dW_ref);
    for (size_t e = 0; e < got.size(); e++)
      REQUIRE(got[e] == Approx(ref[e]).epsilon(1e-5).margin(1e-5));
    ctx.destroy();
  }
}

// The CUDA round and FP8 tile kernels against the CPU loops, bit for bit.
TEST_CASE("the CUDA round and FP8 tile kernels match the CPU", "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  Tensor x = filled({7, 300}, 11, 3.0f);
  x.f32()[4] = 1e-9f, x.f32()[5] = 7e4f, x.f32()[6] = 250.0f;
  for (int variant = 0; variant < 5; variant++) {
    Tensor a = empty(x.shape, Mem::Workspace);
    copy_(a, x);
    Tensor b = to_device(x, Device::CUDA, Mem::Workspace);
    if (variant < 2) {
      DType f = variant == 0 ? DType::BF16 : DType::F16;
      round_(cpu, a, f), round_(gpu, b, f);
    } else {
      DType f = variant == 4 ? DType::F8E5M2 : DType::F8E4M3;
      int tr = variant == 3 ? 128 : 1;
      fake_quantize_tiles_(cpu, a, f, tr, 128), fake_quantize_tiles_(gpu, b, f, tr, 128);
    }
    gpu.synchronize();
    std::vector<float> back = to_host_floats(b);
    INFO("variant " << variant);
    REQUIRE(memcmp(back.data(), a.ptr, a.nbytes()) == 0);
  }
  gpu.destroy();
}

// ---- training runs (./train): the book's claims about each format, on the tiny model ----

namespace {
std::vector<nlohmann::json> train_log(const std::string& args, const std::string& dir, int np = 0) {
  RunResult r = run_train(args + " --log-json " + dir + "/log.jsonl", np);
  INFO(args << "\n" << r.output);
  REQUIRE(r.code == 0);
  return read_json_lines(dir + "/log.jsonl");
}
double mean_loss(const std::vector<nlohmann::json>& log, size_t end, size_t window) {
  double sum = 0;
  for (size_t i = end - window; i < end; i++) sum += log[i]["loss"].get<double>();
  return sum / window;
}
// The largest gap between two loss curves, each averaged over `window` steps: single steps
// are noisy (256 tokens), and two runs that differ by rounding drift apart step by step, as two
// fp32 runs that differ in summation order also do.
double curve_gap(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b,
                 size_t window) {
  double gap = 0;
  for (size_t end = window; end <= std::min(a.size(), b.size()); end++)
    gap = std::max(gap, std::fabs(mean_loss(a, end, window) - mean_loss(b, end, window)));
  return gap;
}
double logged_val_loss(const std::string& output) {
  size_t at = output.rfind("val loss ");
  return at == std::string::npos ? NAN : std::stod(output.substr(at + 9));
}
const std::string kRun = "--steps 300 --mbs 4 --seq 64 --val-every 0 --val-seqs 32 ";
}  // namespace

// bf16 keeps fp32's range and 8 bits of precision: the loss curve follows fp32's. FP8 with
// per-tile scales follows bf16's. Bounds, with what this seed measured: 20-step averages within
// 0.05 nats of fp32 for bf16 (measured 0.020) and within 0.06 of bf16 for fp8 (0.022); the final
// validation loss within 0.03 (measured 0.001) and 0.05 (0.016). bf16 gradients
// (--grad-acc-dtype bf16) follow fp32 accumulation within the same 0.05 (measured 0.017; the
// validation loss 0.04, measured 0.005). Broken arithmetic (a scale applied twice, gradients
// lost, a wrong format for a tensor) leaves the loss near its start, 5.6, or makes it diverge:
// tenths of a nat or more.
TEST_CASE("bf16 tracks fp32 over 300 steps, and fp8 tracks bf16", "[train]") {
  std::string dir = make_temp_dir();
  std::map<std::string, std::vector<nlohmann::json>> logs;
  std::map<std::string, double> val;
  for (const char* d : {"fp32", "bf16", "fp8", "bf16 --grad-acc-dtype bf16"}) {
    const std::string log = dir + "/" + std::to_string(logs.size()) + ".jsonl";
    RunResult r = run_train(kRun + "--dtype " + d + " --log-json " + log);
    INFO(r.output);
    REQUIRE(r.code == 0);
    logs[d] = read_json_lines(log);
    REQUIRE(logs[d].size() == 300);
    val[d] = logged_val_loss(r.output);
  }
  CHECK(mean_loss(logs["fp32"], 300, 20) < 2.8);  // it trained: from 5.6
  CHECK(curve_gap(logs["bf16"], logs["fp32"], 20) < 0.05);
  CHECK(curve_gap(logs["fp8"], logs["bf16"], 20) < 0.06);
  CHECK(std::fabs(val["bf16"] - val["fp32"]) < 0.03);
  CHECK(std::fabs(val["fp8"] - val["bf16"]) < 0.05);
  CHECK(curve_gap(logs["bf16 --grad-acc-dtype bf16"], logs["bf16"], 20) < 0.05);
  CHECK(std::fabs(val["bf16 --grad-acc-dtype bf16"] - val["bf16"]) < 0.04);
  fs::remove_all(dir);
}

// fp16's smallest subnormal is 6e-8: gradients of a mean over thousands of tokens sit near it,
// and without scaling a share of them rounds to zero (grad_underflow: the share of nonzero
// values the backward stored that became zero). Scaling the loss by 2^16 lifts them clear.
// Over 300 steps this seed measured 0.8-13% lost without scaling and 0.02-0.2% with it (in a
// model this small the loss curve barely notices either).
TEST_CASE("fp16 without loss scaling loses gradients to underflow; dynamic scaling keeps them",
          "[train]") {
  std::string dir = make_temp_dir();
  const std::string run = "--steps 20 --mbs 4 --seq 64 --val-every 0 --val-seqs 4 --dtype fp16 ";
  auto none = train_log(run + "--loss-scale 1", dir);
  auto scaled = train_log(run, dir);
  auto fp32 = train_log("--steps 20 --mbs 4 --seq 64 --val-every 0 --val-seqs 4", dir);
  double lost_none = 0, lost_scaled = 0;
  for (size_t i = 0; i < 20; i++) {
    lost_none += none[i]["grad_underflow"].get<double>() / 20;
    lost_scaled += scaled[i]["grad_underflow"].get<double>() / 20;
    CHECK(scaled[i]["loss_scale"].get<double>() == 65536.0);
    CHECK(!scaled[i]["skipped"].get<bool>());
  }
  INFO("underflowed share: " << lost_none << " without scaling, " << lost_scaled << " with");
  CHECK(lost_none > 0.005);
  CHECK(lost_scaled < lost_none / 10);
  // and the scaled run trains as fp32 does (2^-7: a few fp16 ulps of the loss)
  CHECK(scaled[19]["loss"].get<double>() ==
        Approx(fp32[19]["loss"].get<double>()).epsilon(1.0 / 128));
  fs::remove_all(dir);
}

// --fault inf:RANK:STEP puts an infinity into that rank's gradient after the backward, as an
// fp16 overflow would. The step must be skipped on every rank, the scale halved, and the run go
// on: so a 3-step run whose third step overflows ends with the weights and Adam's state of a
// clean 2-step run, bit for bit (the warmup's learning rate does not depend on --steps); its
// checkpoint says it took 3 steps, 2 of them AdamW's, at the halved scale.
TEST_CASE("an overflow in fp16 skips the step on every rank, halves the scale, and the run goes on",
          "[train]") {
  std::string dir = make_temp_dir();
  const std::string run = "--mbs 4 --seq 64 --val-every 0 --val-seqs 4 --dtype fp16 --warmup 20 ";
  auto hit = train_log(run + "--steps 3 --fault inf:0:2 --save " + dir + "/hit", dir);
  REQUIRE(hit.size() == 3);
  CHECK(hit[2]["skipped"].get<bool>());
  CHECK(hit[2]["loss_scale"].get<double>() == 65536.0);
  train_log(run + "--steps 2 --save " + dir + "/clean", dir);
  CHECK(read_whole_file(dir + "/hit/model.safetensors") ==
        read_whole_file(dir + "/clean/model.safetensors"));
  auto hit_moments = read_raw_tensors(dir + "/hit/optimizer.safetensors");
  auto clean_moments = read_raw_tensors(dir + "/clean/optimizer.safetensors");
  REQUIRE(hit_moments.size() == clean_moments.size());
  for (auto& [name, t] : clean_moments) {
    INFO(name);
    CHECK(hit_moments[name].bytes == t.bytes);
  }
  const std::string header = read_whole_file(dir + "/hit/optimizer.safetensors").substr(0, 400);
  CHECK_THAT(header, Catch::Contains("\"step\":\"3\"") && Catch::Contains("\"adam_steps\":\"2\"") &&
                         Catch::Contains("\"loss_scale\":\"32768\""));
  // Two data-parallel ranks, the infinity on rank 1 only: both skip, then both go on at 2^15.
  auto dp = train_log(run + "--steps 4 --dp 2 --mbs 2 --fault inf:1:1", dir, 2);
  REQUIRE(dp.size() == 4);
  CHECK(dp[1]["skipped"].get<bool>());
  CHECK(!dp[2]["skipped"].get<bool>());
  CHECK(dp[2]["loss_scale"].get<double>() == 32768.0);
  CHECK(std::isfinite(dp[3]["loss"].get<double>()));
  fs::remove_all(dir);
}

TEST_CASE("bad precision flags end with exit code 2 naming the flag", "[train]") {
  struct Bad {
    std::string args, says;
  };
  const Bad cases[] = {
      {"--dtype fp9", "--dtype fp9"},
      {"--dtype bf16 --loss-scale 1024", "--loss-scale"},
      {"--loss-scale-window 10", "fp16 only"},
      {"--dtype fp16 --loss-scale 0", "--loss-scale 0"},
      {"--dtype fp16 --loss-scale-window 0", "--loss-scale-window 0"},
      {"--dtype fp16 --fault inf:0:1:backward", "--fault"},
  };
  for (const Bad& c : cases) {
    RunResult r = run_train("--steps 1 " + c.args);
    INFO(c.args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(c.says));
  }
}

// The CUDA linear layers (bf16 and fp16 operands into cublasGemmEx, FP8 tiles by the kernel)
// against the CPU emulation: the same rounded operands, fp32 sums of K products in another
// order. Two orders of one fp32 sum differ by at most K 2^-24 sum |a b| (the classic bound of
// recursive summation, whatever the order), which matters where the terms cancel (an output
// far smaller than its terms); an output may then land on the neighbouring value of its
// format (one ulp). A wrong index or scale is off by the size of a term, orders of magnitude
// more.
// The second shape, a small output over a long sum, is where cuBLAS splits K: its partial sums
// must be added in fp32 too (the handle's math mode), or a 16-bit output is off by more.
TEST_CASE("the CUDA low-precision linear layers match the CPU emulation", "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  for (Precision p : {Precision::BF16, Precision::FP16, Precision::FP8})
    for (auto [T, in, out] : {std::array<int, 3>{40, 300, 136}, std::array<int, 3>{8, 4096, 64}}) {
      INFO(precision_name(p) << ", T " << T << ", in " << in << ", out " << out);
      Context cpu = Context::create(Device::CPU);
      cpu.precision = gpu.precision = p;
      Tensor x = filled({T, in}, 21, 1.0f), W = filled({out, in}, 22, 0.1f),
             dy = filled({T, out}, 23, 0.01f);
      auto on_gpu = [](const Tensor& t) { return to_device(t, Device::CUDA, Mem::Workspace); };
      Tensor y = empty({T, out}, Mem::Workspace), dx = empty({T, in}, Mem::Workspace);
      Tensor dW = zeros({out, in}, Mem::Workspace);
      Tensor gy = empty(gpu, {T, out}, Mem::Workspace), gdx = empty(gpu, {T, in}, Mem::Workspace);
      Tensor gdW = zeros(gpu, {out, in}, Mem::Workspace);
      linear_forward(cpu, y, x, W);
      linear_backward(cpu, dx, dW, dy, x, W);
      Tensor gx = on_gpu(x), gW = on_gpu(W), gdy = on_gpu(dy);
      linear_forward(gpu, gy, gx, gW);
      linear_backward(gpu, gdx, gdW, gdy, gx, gW);
      gpu.synchronize();
      const Precision stored_as = p == Precision::FP8 ? Precision::BF16 : p;
      // cuBLAS may sum in another order for another output type: the two roundings of nearly
      // the same fp32 sum are the same value or neighbours (one unit of the format's last place).
      const float unit = p == Precision::BF16 ? 0x1p-7f : 0x1p-10f;
      auto within_one_unit = [unit](const std::vector<float>& got, const std::vector<float>& want) {
        REQUIRE(got.size() == want.size());
        for (size_t i = 0; i < got.size(); i++)
          REQUIRE(std::fabs(got[i] - want[i]) <= unit * std::fabs(want[i]) + 1e-30f);
      };
      // sum |a b| per output from the fp32 operands, x 1.125 for their rounding (FP8's e4m3 at
      // most 2^-4 of a value, bf16 and fp16 less).
      auto sum_abs = [](const Tensor& A, const Tensor& B, bool b_transposed) {
        const int64_t R = A.shape[0], K = A.shape[1], C = b_transposed ? B.shape[0] : B.shape[1];
        std::vector<double> s((size_t)(R * C), 0.0);
        for (int64_t r = 0; r < R; r++)
          for (int64_t c = 0; c < C; c++)
            for (int64_t k = 0; k < K; k++)
              s[(size_t)(r * C + c)] +=
                  1.125 * std::fabs(A.f32()[r * K + k]) *
                  std::fabs(b_transposed ? B.f32()[c * K + k] : B.f32()[k * C + c]);
        return s;
      };
      struct Output {
        const char* name;
        const Tensor *cpu, *gpu;
        std::vector<double> magnitude;
        int64_t K;
      };
      const Output outputs[] = {{"y", &y, &gy, sum_abs(x, W, true), in},
                                {"dx", &dx, &gdx, sum_abs(dy, W, false), out}};
      for (const Output& o : outputs) {
        std::vector<float> g = to_host_floats(*o.gpu);
        int64_t outside = 0, worst_at = 0;
        double worst = 0.0;
        for (int64_t i = 0; i < o.cpu->numel(); i++) {
          const float c = o.cpu->f32()[i];
          const double ulp = std::fabs(stored(stored_as, std::nextafter(c, 2 * c + 1)) - c) +
                             std::fabs(c - stored(stored_as, std::nextafter(c, -2 * c - 1)));
          const double allowed = ulp + (double)o.K * 0x1p-24 * o.magnitude[(size_t)i];
          const double ratio = std::fabs((double)g[(size_t)i] - c) / allowed;
          outside += !(ratio <= 1.0);
          if (!(ratio <= worst)) worst = ratio, worst_at = i;
        }
        INFO(o.name << ": " << outside << " outside; worst element " << worst_at << " at " << worst
                    << " of its bound (cpu " << o.cpu->f32()[worst_at] << ", gpu " << g[worst_at]
                    << ")");
        CHECK(outside == 0);
      }
      if (p != Precision::FP8) {  // y written by cuBLAS in the compute format: the same values
        Tensor gy16 = empty(gpu, {T, out}, Mem::Workspace, activation_dtype(p));
        REQUIRE(gy16.dtype == output_dtype(p));
        linear_forward(gpu, gy16, gx, gW);
        gpu.synchronize();
        within_one_unit(widened(to_device(gy16, Device::CPU, Mem::Workspace)), to_host_floats(gy));
      }
      if (p != Precision::FP8) {  // dx written by cuBLAS in the compute format, as y above
        Tensor gdx16 = empty(gpu, {T, in}, Mem::Workspace, activation_dtype(p));
        linear_backward(gpu, gdx16, Tensor(), gradient_operand(gpu, gdy), gx, gW);
        gpu.synchronize();
        std::vector<float> g16 = widened(to_device(gdx16, Device::CPU, Mem::Workspace)),
                           g32 = to_host_floats(gdx);
        within_one_unit(g16, g32);
        // Added to (beta 1, as a second path into the same input's gradient): one rounding of
        // the 16-bit value held plus the fp32 sum, the same value or a neighbour.
        linear_backward(gpu, gdx16, Tensor(), gradient_operand(gpu, gdy), gx, gW, true);
        gpu.synchronize();
        std::vector<float> want(g16.size());
        for (size_t i = 0; i < g16.size(); i++) want[i] = g16[i] + g32[i];
        within_one_unit(widened(to_device(gdx16, Device::CPU, Mem::Workspace)), want);
      }
      std::vector<float> g = to_host_floats(gdW);
      double scale = 0;
      for (int64_t i = 0; i < dW.numel(); i++)
        scale = std::max(scale, (double)std::fabs(dW.f32()[i]));
      for (int64_t i = 0; i < dW.numel(); i++)  // fp32 sums of T products: 1e-6 of the scale
        REQUIRE(std::fabs(g[i] - dW.f32()[i]) <= 1e-6 * scale);
    }
  gpu.destroy();
}

// The memory report's bytes per parameter, measured at allocation, against the roles' sizes:
// fp32 weights 4 + gradients 4 + Adam 8; bf16: the copy 2, fp32 gradients 4, the master 4,
// Adam 8 (the book's 2 + 2 + 4 + 4 + 4 without the bf16 gradients, never stored); under ZeRO-3
// over 2 ranks no copy, the rest halved.
TEST_CASE("--report memory gives the bytes per parameter of each role under each dtype",
          "[train]") {
  struct Case {
    std::string flags;
    int np;
    std::string row;
  };
  const Case cases[] = {
      {"--dtype fp32", 0,
       "this rank, measured            4.00       4.00        -       8.00   16.00"},
      {"--dtype bf16", 0,
       "this rank, measured            2.00       4.00     4.00       8.00   18.00"},
      {"--dtype fp8", 0,
       "this rank, measured            2.00       4.00     4.00       8.00   18.00"},
      {"--dtype bf16 --dp 2 --zero 3", 2,
       "this rank, measured            1.00       2.00     2.00       4.00    9.00"},
  };
  for (const Case& c : cases) {
    RunResult r = run_train(
        "--steps 1 --mbs 2 --seq 32 --val-every 0 --val-seqs 2 --report memory " + c.flags, c.np);
    INFO(c.flags << "\n" << r.output);
    REQUIRE(r.code == 0);
    CHECK_THAT(r.output, Catch::Contains(c.row));
  }
}
