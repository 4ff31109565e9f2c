// test_matmul_ladder.cu: the GPU chapter's matmul ladder (kernels/matmul_ladder.cuh). On the CPU:
// the references against a float64 product, with the error bound of an fp32 sum, and the rung
// table against the book's numbers. On a GPU: every fp32 rung equal to the fp32 reference bit
// for bit (they sum in its order), the tensor-core rung within the bound of its sums, on shapes
// that are not multiples of any tile and at llama-1b's own shapes (2048 tokens, d_model 2048,
// ffn 8192).
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_case.cuh"
#include "kernels/matmul_ladder.cuh"
#include "reference.cuh"
#include "runtime/dtype.cuh"

namespace {

struct Shape {
  int M, N, K;
};
std::string describe(const Shape& s) {
  return std::to_string(s.M) + " x " + std::to_string(s.N) + " x " + std::to_string(s.K);
}
// Not multiples of any tile (32, 64, 128; 8 for the 16-byte loads), multiples, and the edges.
const Shape kShapes[] = {{1, 1, 1},       {33, 65, 17},  {129, 67, 95}, {200, 136, 72},
                         {256, 256, 256}, {70, 300, 40}, {5, 7, 0},     {130, 129, 257}};

// C[i][j] = sum_k A[i][k] B[k][j] in float64, and sum_k |A[i][k] B[k][j]|: an fp32 sum of n
// terms is within about n 2^-24 of the latter (the classic bound of recursive summation).
struct Product64 {
  std::vector<double> value, magnitude;
};
Product64 product64(const std::vector<float>& A, const std::vector<float>& B, const Shape& s) {
  Product64 p{std::vector<double>((size_t)s.M * s.N), std::vector<double>((size_t)s.M * s.N)};
  for (int i = 0; i < s.M; i++)
    for (int k = 0; k < s.K; k++)
      for (int j = 0; j < s.N; j++) {
        const double term = (double)A[(size_t)i * s.K + k] * B[(size_t)k * s.N + j];
        p.value[(size_t)i * s.N + j] += term;
        p.magnitude[(size_t)i * s.N + j] += std::abs(term);
      }
  return p;
}
// |got - want| <= factor * magnitude, entry by entry (exact where the magnitude is 0).
void require_within(const char* what, const std::vector<float>& got, const Product64& want,
                    double factor) {
  REQUIRE(got.size() == want.value.size());
  double worst = 0.0;  // the largest |got - want| / magnitude
  size_t at = 0, outside = 0;
  for (size_t e = 0; e < got.size(); e++) {
    const double err = std::abs(got[e] - want.value[e]);
    if (!(err <= factor * want.magnitude[e])) outside++;
    if (want.magnitude[e] > 0 && err / want.magnitude[e] > worst)
      worst = err / want.magnitude[e], at = e;
  }
  INFO(what << ": worst error " << worst << " of the magnitude (entry " << at << "), bound "
            << factor << ", " << outside << " entries outside it");
  REQUIRE(outside == 0);
}
// Floats that are bf16 values, and the same as bf16 (the tensor-core rung's inputs).
std::vector<float> rounded_to_bf16(std::vector<float> x) {
  for (float& e : x) e = bf16_to_float(float_to_bf16(e));
  return x;
}
std::vector<uint16_t> bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t e = 0; e < x.size(); e++) b[e] = float_to_bf16(x[e]);
  return b;
}
const __nv_bfloat16* as_bf16(const std::vector<uint16_t>& b) {
  return reinterpret_cast<const __nv_bfloat16*>(b.data());
}

// The fp32 reference sums K terms in fp32: within (K + 1) 2^-24 of the magnitude. The
// tensor-core sums: K / 16 additions of a slice into the accumulator plus up to 16 inside a
// slice, each within one ulp (2^-23) of the partial sum if the hardware truncates rather than
// rounds; twice that for alignment inside the mma.
double fp32_bound(int K) {
  return (K + 1) * std::ldexp(1.0, -24);
}
double tensor_core_bound(int K) {
  return 2.0 * (K / 16 + 17) * std::ldexp(1.0, -23);
}

}  // namespace

TEST_CASE("the matmul ladder's fp32 reference is within an fp32 sum's error of float64",
          "[matmul]") {
  for (const Shape& s : kShapes) {
    INFO(describe(s));
    std::vector<float> A = reference_normal((int64_t)s.M * s.K, "ladder A");
    std::vector<float> B = reference_normal((int64_t)s.K * s.N, "ladder B");
    std::vector<float> C((size_t)s.M * s.N, -1.0f);
    matmul_fp32_cpu(C.data(), A.data(), B.data(), s.M, s.N, s.K);
    require_within("fp32 reference", C, product64(A, B, s), fp32_bound(s.K));
  }
}

TEST_CASE("the tensor-core rung's CPU mirror is within its sums' error of float64 on bf16 inputs",
          "[matmul]") {
  Context cpu = Context::create(Device::CPU);
  for (const Shape& s : kShapes) {
    INFO(describe(s));
    std::vector<float> A = rounded_to_bf16(reference_normal((int64_t)s.M * s.K, "ladder A"));
    std::vector<float> B = rounded_to_bf16(reference_normal((int64_t)s.K * s.N, "ladder B"));
    std::vector<uint16_t> A16 = bf16_bits(A), B16 = bf16_bits(B);
    std::vector<float> C((size_t)s.M * s.N, -1.0f);
    matmul_ladder_bf16(cpu, C.data(), as_bf16(A16), as_bf16(B16), s.M, s.N, s.K);
    // The mirror sums in fp32 with rounding to nearest: K / 16 + 16 additions per entry.
    require_within("tensor-core mirror", C, product64(A, B, s),
                   (s.K / 16 + 17) * std::ldexp(1.0, -24));
  }
}

TEST_CASE("the ladder's table carries the book's claims: coalescing ~10x, tiling -43% time",
          "[matmul]") {
  const std::vector<MatmulRungInfo>& rungs = matmul_rungs();
  REQUIRE(rungs.size() == 5);
  const MatmulRung order[] = {MatmulRung::Naive, MatmulRung::Coalesced, MatmulRung::Tiled,
                              MatmulRung::Coarsened, MatmulRung::TensorCores};
  for (int r = 0; r < 5; r++) REQUIRE(rungs[r].rung == order[r]);
  REQUIRE(matmul_rung(MatmulRung::Coalesced).book_ratio == 10.0);
  // 43% less time is 1 / 0.57 = 1.75x the speed.
  REQUIRE(matmul_rung(MatmulRung::Tiled).book_ratio == Approx(1.754).epsilon(1e-3));
  REQUIRE(matmul_rung(MatmulRung::Coarsened).book_ratio == 0.0);  // the book gives no number
}

// ----------------------------------------------------------------------------

namespace {
struct DeviceMatrices {
  Tensor A, B, C;   // fp32 on the device
  Tensor A16, B16;  // bf16 on the device
};
DeviceMatrices upload(const std::vector<float>& A, const std::vector<float>& B, const Shape& s) {
  DeviceMatrices d;
  Tensor a = empty({(int64_t)A.size()}, Mem::Workspace),
         b = empty({(int64_t)B.size()}, Mem::Workspace);
  from_host(a, A.data());
  from_host(b, B.data());
  d.A = to_device(a, Device::CUDA, Mem::Workspace);
  d.B = to_device(b, Device::CUDA, Mem::Workspace);
  d.C = empty({(int64_t)s.M * s.N}, Mem::Workspace, Device::CUDA);
  d.A16 = empty(a.shape, Mem::Workspace, Device::CUDA, DType::BF16);
  d.B16 = empty(b.shape, Mem::Workspace, Device::CUDA, DType::BF16);
  cast_(d.A16, d.A);
  cast_(d.B16, d.B);
  return d;
}
const __nv_bfloat16* bf16_ptr(const Tensor& t) {
  return reinterpret_cast<const __nv_bfloat16*>(t.ptr);
}
}  // namespace

TEST_CASE("CUDA matmul rungs 1-4 equal the fp32 reference bit for bit", "[matmul][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  for (const Shape& s : kShapes) {
    std::vector<float> A = reference_normal((int64_t)s.M * s.K, "ladder A");
    std::vector<float> B = reference_normal((int64_t)s.K * s.N, "ladder B");
    std::vector<float> want((size_t)s.M * s.N);
    matmul_fp32_cpu(want.data(), A.data(), B.data(), s.M, s.N, s.K);
    DeviceMatrices d = upload(A, B, s);
    for (const MatmulRungInfo& r : matmul_rungs()) {
      if (r.rung == MatmulRung::TensorCores) continue;
      INFO(describe(s) << ", rung " << r.name);
      zero_(d.C);
      matmul_ladder(gpu, r.rung, d.C.f32(), d.A.f32(), d.B.f32(), s.M, s.N, s.K);
      gpu.synchronize();
      std::vector<float> got = to_host_floats(d.C);
      // The same fmaf chain in the same order: equal (== also equates 0 and -0).
      int64_t differ = 0;
      for (size_t e = 0; e < got.size(); e++) differ += got[e] != want[e];
      REQUIRE(differ == 0);
    }
  }
  gpu.destroy();
}

TEST_CASE("CUDA tensor-core rung matches its CPU mirror within the bound of their fp32 sums",
          "[matmul][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  for (const Shape& s : kShapes) {
    INFO(describe(s));
    std::vector<float> A = rounded_to_bf16(reference_normal((int64_t)s.M * s.K, "ladder A"));
    std::vector<float> B = rounded_to_bf16(reference_normal((int64_t)s.K * s.N, "ladder B"));
    DeviceMatrices d = upload(A, B, s);
    zero_(d.C);
    matmul_ladder_bf16(gpu, d.C.f32(), bf16_ptr(d.A16), bf16_ptr(d.B16), s.M, s.N, s.K);
    gpu.synchronize();
    std::vector<float> got = to_host_floats(d.C), mirror((size_t)s.M * s.N);
    std::vector<uint16_t> A16 = bf16_bits(A), B16 = bf16_bits(B);
    matmul_tensor_cores_cpu(mirror.data(), as_bf16(A16), as_bf16(B16), s.M, s.N, s.K);
    const Product64 exact = product64(A, B, s);
    require_within("tensor cores against float64", got, exact, tensor_core_bound(s.K));
    // Against the mirror: both within their bounds of float64.
    Product64 m{std::vector<double>(mirror.begin(), mirror.end()), exact.magnitude};
    require_within("tensor cores against the mirror", got, m,
                   tensor_core_bound(s.K) + (s.K / 16 + 17) * std::ldexp(1.0, -24));
  }
  gpu.destroy();
}

// [large]: seconds of inputs and copies; the sanitizer passes of the GPU check leave it out.
TEST_CASE("CUDA matmul rungs at llama-1b's shapes: 2048 tokens, d_model 2048, ffn 8192",
          "[matmul][gpu][large]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  // q/k/v/o projections, gate/up, down: [tokens, in] x [in, out].
  const Shape shapes[] = {{2048, 2048, 2048}, {2048, 8192, 2048}, {2048, 2048, 8192}};
  for (const Shape& s : shapes) {
    std::vector<float> A = rounded_to_bf16(reference_normal((int64_t)s.M * s.K, "ladder A"));
    std::vector<float> B = rounded_to_bf16(reference_normal((int64_t)s.K * s.N, "ladder B"));
    DeviceMatrices d = upload(A, B, s);
    // 4096 entries spread over C (every block of every rung holds some), checked against the
    // fmaf chain (fp32 rungs, equal) and float64 (tensor cores, within the bound).
    std::vector<std::pair<int, int>> entries;
    for (int e = 0; e < 4096; e++)
      entries.push_back({(int)((e * 2654435761u) % s.M), (int)((e * 40503u + 7 * e) % s.N)});
    auto entry_fma = [&](int i, int j) {
      float acc = 0.0f;
      for (int k = 0; k < s.K; k++)
        acc = std::fma(A[(size_t)i * s.K + k], B[(size_t)k * s.N + j], acc);
      return acc;
    };
    for (const MatmulRungInfo& r : matmul_rungs()) {
      INFO(describe(s) << ", rung " << r.name);
      zero_(d.C);
      if (r.rung == MatmulRung::TensorCores)
        matmul_ladder_bf16(gpu, d.C.f32(), bf16_ptr(d.A16), bf16_ptr(d.B16), s.M, s.N, s.K);
      else
        matmul_ladder(gpu, r.rung, d.C.f32(), d.A.f32(), d.B.f32(), s.M, s.N, s.K);
      gpu.synchronize();
      std::vector<float> got = to_host_floats(d.C);
      for (auto [i, j] : entries) {
        INFO("entry (" << i << ", " << j << ")");
        const float c = got[(size_t)i * s.N + j];
        if (r.rung != MatmulRung::TensorCores) {
          REQUIRE(c == entry_fma(i, j));
          continue;
        }
        double value = 0.0, magnitude = 0.0;
        for (int k = 0; k < s.K; k++) {
          const double term = (double)A[(size_t)i * s.K + k] * B[(size_t)k * s.N + j];
          value += term, magnitude += std::abs(term);
        }
        REQUIRE(std::abs(c - value) <= tensor_core_bound(s.K) * magnitude);
      }
    }
  }
  gpu.destroy();
}
