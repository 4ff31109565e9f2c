// test_fp8_gemm.cu: the real FP8 GEMMs of Playbook §FP8 pretraining (fp8_gemm.cuh): the GPU's
// tile quantization against the CPU's quantize_tiles bit for bit, cuBLASLt's block-scaled GEMM
// against a float64 product of the dequantized tiles, and the FP8 linear layers on CUDA against
// the CPU emulation. All need a GPU; the GEMM needs compute capability 9.0 and cuBLAS 12.9, and
// its case ends with "SKIP: why" where cuBLASLt declines.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_case.cuh"
#include "kernels/fp8_gemm.cuh"
#include "mixed_precision.cuh"
#include "reference.cuh"
#include "runtime/core.cuh"

namespace {

// [rows, cols] of scale * N(0,1), times a power of two that changes from one 128 x 128 tile to
// the next (2^-2 .. 2^2) and from row to row (2^-1 .. 2^1), so that a scale applied to the wrong
// tile or row is off by a factor of 2 to 16.
Tensor tiled_values(int64_t rows, int64_t cols, const std::string& name, float scale = 1.0f) {
  std::vector<float> v = reference_normal(rows * cols, name);
  Tensor t = empty({rows, cols}, Mem::Workspace);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      const int power = (int)((r / 128 + 2 * (c / 128)) % 5) - 2 + (int)(r % 3) - 1;
      t.f32()[r * cols + c] = std::ldexp(scale * v[r * cols + c], power);
    }
  return t;
}

Tensor transposed(const Tensor& t) {  // [rows, cols] -> [cols, rows], on the CPU
  const int64_t rows = t.size(0), cols = t.size(1);
  Tensor u = empty({cols, rows}, Mem::Workspace);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) u.f32()[c * rows + r] = t.f32()[r * cols + c];
  return u;
}

// What a GEMM reads of t: its FP8 tiles times their scales (the CPU loops).
std::vector<float> dequantized(const Tensor& t, DType format, int tile_rows, int tile_cols) {
  Tensor d = empty(t.shape, Mem::Workspace);
  copy_(d, t);
  fake_quantize_tiles_(Context::create(Device::CPU), d, format, tile_rows, tile_cols);
  return std::vector<float>(d.f32(), d.f32() + d.numel());
}

// sum_k a[r][k] b[c][k] in float64 for a [rows, K] and b [cols, K], with the sum of its terms'
// magnitudes (what the error of a sum in lower precision scales with).
struct Product64 {
  std::vector<double> sum, abs;
};
Product64 product64(const std::vector<float>& a, const std::vector<float>& b, int64_t rows,
                    int64_t cols, int64_t K) {
  Product64 p{std::vector<double>(rows * cols), std::vector<double>(rows * cols)};
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++)
      for (int64_t k = 0; k < K; k++) {
        const double term = (double)a[r * K + k] * b[c * K + k];
        p.sum[r * cols + c] += term, p.abs[r * cols + c] += std::fabs(term);
      }
  return p;
}

// What cuBLASLt's sum of K products may be off by, against their float64 sum. Hopper's FP8
// tensor cores add products keeping about 13 mantissa bits (DeepSeek-V3 §3.3.2 measured about
// 14), and cuBLAS, fast accumulation off, promotes the partial sum to fp32 at least once per
// 128-long block, where the block's scales are applied. n <= 128 additions at 2^-13 of a running
// sum that grows like sqrt(k) terms cost about 2^-13 (2/3) sqrt(128) ~ 2^-10 of the block's
// sum of |products|; we allow twice that, 2^-9, plus fp32's K 2^-24 for the sum of the blocks.
// A scale on the wrong tile (tiled_values) is off by far more.
double fp8_gemm_error(double abs_sum, int64_t K) {
  return (0x1p-9 + K * 0x1p-24) * abs_sum;
}

int compute_capability() {  // of the current device, as 10 * major + minor
  int device = 0, major = 0, minor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return 10 * major + minor;
}

}  // namespace

// Guards: a scale formula or rounding that differs from the CPU's, partial tiles read past
// their end, an all-zero tile whose scale is not 1.
TEST_CASE("the CUDA FP8 tile quantization gives the CPU's bytes and scales bit for bit",
          "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  Tensor x = tiled_values(200, 300, "fp8 quantize", 3.0f);  // partial tiles both ways
  x.f32()[3 * 300 + 10] = 1e4f, x.f32()[4 * 300 + 11] = 1e-30f;
  for (int64_t r = 128; r < 200; r++)  // all-zero tiles in every tiling
    for (int64_t c = 256; c < 300; c++) x.f32()[r * 300 + c] = 0.0f;
  struct Tiles {
    int rows, cols;
  };
  for (DType format : {DType::F8E4M3, DType::F8E5M2})
    for (Tiles t : {Tiles{1, 128}, Tiles{128, 128}, Tiles{128, 1}}) {  // 128 x 1: the wgrad's
      INFO(dtype_name(format) << ", tiles " << t.rows << " x " << t.cols);
      const std::vector<int64_t> scales_shape = {(200 + t.rows - 1) / t.rows,
                                                 (300 + t.cols - 1) / t.cols};
      Tensor q = empty(x.shape, Mem::Workspace, Device::CPU, format);
      Tensor s = empty(scales_shape, Mem::Workspace), back = empty(x.shape, Mem::Workspace);
      quantize_tiles(q, s, x, t.rows, t.cols);
      dequantize_tiles(back, q, s, t.rows, t.cols);
      Tensor gx = to_device(x, Device::CUDA, Mem::Workspace);
      Tensor gq = empty(gpu, x.shape, Mem::Workspace, format);
      Tensor gs = empty(gpu, scales_shape, Mem::Workspace);
      quantize_tiles_on(gpu, gq, gs, gx, t.rows, t.cols);
      dequantize_tiles_on(gpu, gx, gq, gs, t.rows, t.cols);
      gpu.synchronize();
      Tensor hq = to_device(gq, Device::CPU, Mem::Workspace);
      std::vector<float> hs = to_host_floats(gs), hback = to_host_floats(gx);
      REQUIRE(memcmp(hq.ptr, q.ptr, q.nbytes()) == 0);
      REQUIRE(memcmp(hs.data(), s.ptr, s.nbytes()) == 0);
      REQUIRE(memcmp(hback.data(), back.ptr, back.nbytes()) == 0);
    }
  gpu.destroy();
}

// The transposed operands (dgrad's W^T, wgrad's dy^T and x^T) go through their own kernel,
// which stages x in shared memory. Guards: a panel or tile edge off by one (K and n not
// multiples of 128 or 32), a row scale taken from the wrong column, x read untransposed.
TEST_CASE("the CUDA FP8 quantization of a transposed operand gives the CPU's bytes and scales",
          "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  const int64_t K = 300, n = 200;  // x [K, n]; q [n, K] holds x^T's tiles
  Tensor x = tiled_values(K, n, "fp8 transposed", 3.0f);
  x.f32()[10 * n + 3] = 1e4f, x.f32()[11 * n + 4] = 1e-30f;
  for (int64_t c = 256; c < K; c++)  // x^T's rows 128.. and columns 256..: all-zero tiles
    for (int64_t r = 128; r < n; r++) x.f32()[c * n + r] = 0.0f;
  Tensor xt = empty({n, K}, Mem::Workspace);
  for (int64_t r = 0; r < n; r++)
    for (int64_t c = 0; c < K; c++) xt.f32()[r * K + c] = x.f32()[c * n + r];
  Tensor gx = to_device(x, Device::CUDA, Mem::Workspace);
  for (DType format : {DType::F8E4M3, DType::F8E5M2})
    for (int tile_rows : {1, 128}) {
      INFO(dtype_name(format) << ", tiles " << tile_rows << " x 128 of x^T");
      const std::vector<int64_t> scales_shape = {(n + tile_rows - 1) / tile_rows, (K + 127) / 128};
      Tensor q = empty({n, K}, Mem::Workspace, Device::CPU, format);
      Tensor s = empty(scales_shape, Mem::Workspace);
      quantize_tiles(q, s, xt, tile_rows, 128);
      Tensor gq = empty(gpu, {n, K}, Mem::Workspace, format);
      Tensor gs = empty(gpu, scales_shape, Mem::Workspace);
      quantize_tiles_transposed_on(gpu, gq, gs, gx, tile_rows);
      gpu.synchronize();
      Tensor hq = to_device(gq, Device::CPU, Mem::Workspace);
      std::vector<float> hs = to_host_floats(gs);
      REQUIRE(memcmp(hq.ptr, q.ptr, q.nbytes()) == 0);
      REQUIRE(memcmp(hs.data(), s.ptr, s.nbytes()) == 0);
    }
  gpu.destroy();
}

// Guards: scales in the wrong layout (ours instead of cuBLASLt's, transposed, unpadded), a
// transposed operand's tiles not transposed with it, the wgrad's operands given 128 x 128 scales,
// beta ignored, a partial K block mis-scaled.
TEST_CASE("cuBLASLt's block-scaled FP8 GEMM gives the float64 product of the dequantized tiles",
          "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  if (compute_capability() < 90) {
    WARN("SKIP: compute capability " << compute_capability() / 10 << "."
                                     << compute_capability() % 10
                                     << ": block-scaled FP8 GEMMs need 9.0 (Hopper)");
    return;
  }
  Context gpu = Context::create(Device::CUDA);
  // The linear layer's three GEMMs (fp8_gemm.cuh), d [rows, cols] = a [rows, K] . b [cols, K]^T:
  // forward, a 1 x 128, b 128 x 128; dgrad, the same with b given as [K, cols]; wgrad, a and b
  // 1 x 128 E5M2 and E4M3, both given as [K, n] (dy and x, K the tokens).
  enum Form { Forward, Dgrad, Wgrad };
  struct Case {
    int64_t rows, cols, K;
    DType format;  // a's
    Form form;
    float beta;
    // d starts this many floats into its buffer: 16-byte aligned, not 256, as a weight's
    // gradient in the model's packed buffer may be (the plan must not assume 256).
    int64_t d_offset = 0;
  };
  for (Case c : {Case{256, 384, 512, DType::F8E4M3, Forward, 0.0f},
                 Case{256, 384, 512, DType::F8E5M2, Dgrad, 1.0f},
                 Case{256, 384, 512, DType::F8E5M2, Wgrad, 1.0f},
                 Case{200, 264, 320, DType::F8E4M3, Forward, 1.0f},  // partial blocks of 128
                 Case{200, 264, 320, DType::F8E5M2, Dgrad, 0.0f},
                 Case{200, 264, 320, DType::F8E5M2, Wgrad, 1.0f},
                 Case{256, 384, 512, DType::F8E4M3, Forward, 1.0f, 4},
                 Case{256, 384, 512, DType::F8E5M2, Wgrad, 1.0f, 12}}) {
    const char* forms[] = {"forward", "dgrad", "wgrad"};
    INFO(c.rows << " x " << c.cols << " x " << c.K << ", a " << dtype_name(c.format) << ", "
                << forms[c.form] << ", beta " << c.beta << ", d at float " << c.d_offset);
    Tensor a = tiled_values(c.rows, c.K, "fp8 gemm x"), b = tiled_values(c.cols, c.K, "fp8 gemm w");
    Tensor d0 = tiled_values(c.rows, c.cols, "fp8 gemm d");
    const Fp8Tiles b_tiles = c.form == Wgrad ? Fp8Tiles::Row128 : Fp8Tiles::Block128;
    const bool a_transposed = c.form == Wgrad, b_transposed = c.form != Forward;
    Tensor ga = to_device(a_transposed ? transposed(a) : a, Device::CUDA, Mem::Workspace);
    Tensor gb = to_device(b_transposed ? transposed(b) : b, Device::CUDA, Mem::Workspace);
    Tensor gd_buffer = empty({c.d_offset + c.rows * c.cols}, Mem::Workspace, Device::CUDA);
    Tensor gd = gd_buffer.view(c.d_offset, {c.rows, c.cols});
    copy_(gd, d0);
    std::string why;
    if (!fp8_gemm(gpu, gd, {ga, c.format, Fp8Tiles::Row128, a_transposed},
                  {gb, DType::F8E4M3, b_tiles, b_transposed}, c.beta, &why)) {
      WARN("SKIP: cuBLASLt declined " << why);
      gpu.destroy();
      return;
    }
    gpu.synchronize();
    std::vector<float> got = to_host_floats(gd);
    const int b_tile_rows = b_tiles == Fp8Tiles::Block128 ? 128 : 1;
    Product64 p = product64(dequantized(a, c.format, 1, 128),
                            dequantized(b, DType::F8E4M3, b_tile_rows, 128), c.rows, c.cols, c.K);
    int64_t worst = 0;
    double worst_ratio = 0;
    for (int64_t i = 0; i < c.rows * c.cols; i++) {
      const double want = p.sum[i] + c.beta * d0.f32()[i];  // + beta d0 in fp32: 2^-24, doubled
      const double allowed = fp8_gemm_error(p.abs[i], c.K) + std::ldexp(std::fabs(want), -23);
      const double ratio = std::fabs(got[i] - want) / allowed;
      if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
    }
    INFO("worst element " << worst << ": " << got[worst] << " against float64 "
                          << p.sum[worst] + c.beta * d0.f32()[worst] << ", sum of |products| "
                          << p.abs[worst] << "; error / allowed " << worst_ratio);
    REQUIRE(worst_ratio <= 1.0);
  }
  gpu.destroy();
}

// Guards: the forward or dgrad GEMM reading the weight unrounded (not its bf16 value) or
// untransposed, E4M3 for the gradient, outputs not rounded to bf16, the wgrad tiled otherwise
// than along the tokens or not added to dW.
TEST_CASE("the FP8 linear layers on CUDA match the CPU emulation within the FP8 GEMM's error",
          "[precision][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  cpu.precision = gpu.precision = Precision::FP8;
  const int T = 64, in = 384, out = 256;  // shapes cuBLASLt's block-scaled GEMM takes
  Tensor x = tiled_values(T, in, "fp8 linear x"), W = tiled_values(out, in, "fp8 linear W", 0.05f);
  Tensor dy = tiled_values(T, out, "fp8 linear dy", 1e-3f);
  Tensor y = empty({T, out}, Mem::Workspace), dx = empty({T, in}, Mem::Workspace);
  Tensor dW = tiled_values(out, in, "fp8 linear dW", 1e-3f);  // earlier micro-batches' sum
  auto on_gpu = [](const Tensor& t) { return to_device(t, Device::CUDA, Mem::Workspace); };
  Tensor gx = on_gpu(x), gW = on_gpu(W), gdy = on_gpu(dy), gdW = on_gpu(dW);
  Tensor gy = empty(gpu, {T, out}, Mem::Workspace), gdx = empty(gpu, {T, in}, Mem::Workspace);
  low_precision_linear_forward(cpu, y, x, W);
  low_precision_linear_backward(cpu, dx, dW, dy, x, W, false);
  const Fp8GemmCounts before = fp8_gemm_counts();
  low_precision_linear_forward(gpu, gy, gx, gW);
  low_precision_linear_backward(gpu, gdx, gdW, gdy, gx, gW, false);
  gpu.synchronize();
  const Fp8GemmCounts after = fp8_gemm_counts();
  WARN("FP8 GEMMs on this GPU: " << after.native - before.native << " native, "
                                 << after.emulated - before.emulated << " emulated");
  // The operands as both sides quantize them: the weight from its bf16 value.
  Tensor W16 = empty(W.shape, Mem::Workspace);
  for (int64_t i = 0; i < W.numel(); i++) W16.f32()[i] = bf16_to_float(float_to_bf16(W.f32()[i]));
  std::vector<float> xq = dequantized(x, DType::F8E4M3, 1, 128);
  std::vector<float> wq = dequantized(W16, DType::F8E4M3, 128, 128);
  std::vector<float> dyq = dequantized(dy, DType::F8E5M2, 1, 128);
  std::vector<float> wq_t(wq.size());  // W^T [in, out]: the dgrad contracts along out
  for (int o = 0; o < out; o++)
    for (int i = 0; i < in; i++) wq_t[(int64_t)i * out + o] = wq[(int64_t)o * in + i];
  // The wgrad contracts along the tokens: dy^T [out, T] and x^T [in, T] in 1 x 128 tiles.
  std::vector<float> dyq_t = dequantized(transposed(dy), DType::F8E5M2, 1, 128);
  std::vector<float> xq_t = dequantized(transposed(x), DType::F8E4M3, 1, 128);
  // Each output is the rounding of a sum within fp8_gemm_error of the float64 one on the GPU,
  // within fp32's K 2^-24 on the CPU: y and dx to bf16 (at most 2^-8 of the value), dW added to
  // the accumulator in fp32 (2^-24).
  struct Output {
    const char* name;
    Tensor *cpu, *gpu;
    Product64 exact;
    int K, rounding_exp;
  };
  for (Output o : {Output{"y", &y, &gy, product64(xq, wq, T, out, in), in, -8},
                   Output{"dx", &dx, &gdx, product64(dyq, wq_t, T, in, out), out, -8},
                   Output{"dW", &dW, &gdW, product64(dyq_t, xq_t, out, in, T), T, -24}}) {
    std::vector<float> g = to_host_floats(*o.gpu);
    for (int64_t i = 0; i < o.cpu->numel(); i++) {
      const double c = o.cpu->f32()[i];
      const double allowed = std::ldexp(std::fabs(g[i]) + std::fabs(c), o.rounding_exp) +
                             fp8_gemm_error(o.exact.abs[i], o.K) +
                             o.K * std::ldexp(o.exact.abs[i], -24);
      if (std::fabs(g[i] - c) <= allowed) continue;
      INFO(o.name << " element " << i << ": cpu " << c << ", gpu " << g[i] << ", allowed "
                  << allowed);
      REQUIRE(std::fabs(g[i] - c) <= allowed);
    }
  }
  // gy and gdx were made on gpu's stream: they go before it does (Context::destroy checks).
  gy = gdx = Tensor{};
  gpu.destroy();
}
