// bench_matmul.cu: `make bench` and the GPU check. The GPU chapter's matmul ladder
// (kernels/matmul_ladder.cuh, Playbook §12.2-12.5) rung by rung: GFLOP/s, the speed-up over the
// rung before next to the book's (coalescing ~10x, tiling 1.75x: "-43% time"), and the fraction
// of cuBLAS (sgemm for the fp32 rungs, bf16 GemmEx with fp32 sums for the tensor-core rung), at
// a square shape and at llama-1b's own GEMMs (2048 tokens; d_model 2048, ffn 8192). Each result
// is also checked against cuBLAS (largest difference over the largest value). On the CPU: the
// reference loop against OpenBLAS, the gap the ladder closes on the GPU.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/timing.cuh"
#include "kernels/matmul_ladder.cuh"
#include "runtime/dtype.cuh"

// Best of 10 runs after a warm-up, or of those in the first 0.3 s.
static double time_best(const Context& ctx, const std::function<void()>& fn) {
  return best_seconds(ctx, 10, 0.3, fn);
}

struct Shape {
  int M, N, K;
  const char* what;
};

static void cpu_table() {
  Context ctx = Context::create(Device::CPU);
  printf("CPU: the ladder's reference loop (one fmaf chain per output) against OpenBLAS sgemm\n");
  printf("| %-18s | %14s | %14s |\n", "M x N x K", "loop GFLOP/s", "sgemm GFLOP/s");
  printf("|--------------------|----------------|----------------|\n");
  for (int n : {128, 256, 512}) {
    std::vector<float> A((size_t)n * n), B((size_t)n * n), C((size_t)n * n);
    for (size_t e = 0; e < A.size(); e++) A[e] = (float)(e % 7) - 3, B[e] = (float)(e % 5) - 2;
    const double flops = 2.0 * n * n * n;
    double loop = time_best(ctx, [&] { matmul_fp32_cpu(C.data(), A.data(), B.data(), n, n, n); });
    double blas = time_best(ctx, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, A.data(), n, B.data(),
                  n, 0.0f, C.data(), n);
    });
    printf("| %4d x %4d x %4d | %14.1f | %14.1f |\n", n, n, n, flops / loop / 1e9,
           flops / blas / 1e9);
  }
}

// Largest |x - y| over the largest |y|.
static double relative_difference(const std::vector<float>& x, const std::vector<float>& y) {
  double diff = 0.0, size = 0.0;
  for (size_t e = 0; e < x.size(); e++) {
    diff = std::max(diff, (double)std::abs(x[e] - y[e]));
    size = std::max(size, (double)std::abs(y[e]));
  }
  return size > 0 ? diff / size : diff;
}

static void cuda_table() {
  Context ctx = Context::create(Device::CUDA);
  const Shape shapes[] = {{1024, 1024, 1024, "square"},
                          {2048, 2048, 2048, "llama-1b q/k/v/o"},
                          {2048, 8192, 2048, "llama-1b gate/up"},
                          {2048, 2048, 8192, "llama-1b down"}};
  printf(
      "\nCUDA: the matmul ladder, C[M, N] = A[M, K] B[K, N] row-major (best of up to 10 runs)\n");
  printf("| %-16s | %-16s | %-12s | %9s | %7s | %-20s | %9s | %9s |\n", "shape", "M x N x K",
         "rung", "GFLOP/s", "x prev", "book", "of cuBLAS", "vs cuBLAS");
  printf(
      "|------------------|------------------|--------------|-----------|---------|-------------"
      "---------|-----------|-----------|\n");
  for (const Shape& s : shapes) {
    const int64_t a_n = (int64_t)s.M * s.K, b_n = (int64_t)s.K * s.N, c_n = (int64_t)s.M * s.N;
    Tensor A = empty({a_n}, Mem::Workspace, Device::CUDA),
           B = empty({b_n}, Mem::Workspace, Device::CUDA);
    Tensor C = empty({c_n}, Mem::Workspace, Device::CUDA),
           ref = empty({c_n}, Mem::Workspace, Device::CUDA);
    init_normal(A, 1, "bench A", 1.0f), init_normal(B, 1, "bench B", 1.0f);
    Tensor A16 = empty({a_n}, Mem::Workspace, Device::CUDA, DType::BF16);
    Tensor B16 = empty({b_n}, Mem::Workspace, Device::CUDA, DType::BF16);
    cast_(A16, A), cast_(B16, B);
    const double flops = 2.0 * s.M * s.N * s.K;
    const float one = 1.0f, zero = 0.0f;
    // Row-major C = A B is column-major C^T = B^T A^T: cuBLAS gets B first, dimensions swapped.
    auto sgemm = [&](float* c) {
      CUBLAS_CHECK(cublasSgemm(ctx.cublas, CUBLAS_OP_N, CUBLAS_OP_N, s.N, s.M, s.K, &one, B.f32(),
                               s.N, A.f32(), s.K, &zero, c, s.N));
    };
    auto gemm_bf16 = [&](float* c) {
      CUBLAS_CHECK(cublasGemmEx(ctx.cublas, CUBLAS_OP_N, CUBLAS_OP_N, s.N, s.M, s.K, &one, B16.ptr,
                                CUDA_R_16BF, s.N, A16.ptr, CUDA_R_16BF, s.K, &zero, c, CUDA_R_32F,
                                s.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    const double t_sgemm = time_best(ctx, [&] { sgemm(C.f32()); });
    const double t_bf16 = time_best(ctx, [&] { gemm_bf16(C.f32()); });
    char dims[32];
    snprintf(dims, sizeof dims, "%d x %d x %d", s.M, s.N, s.K);
    printf("| %-16s | %-16s | %-12s | %9.0f | %7s | %-20s | %9s | %9s |\n", s.what, dims,
           "cuBLAS fp32", flops / t_sgemm / 1e9, "", "", "", "");
    printf("| %-16s | %-16s | %-12s | %9.0f | %7s | %-20s | %9s | %9s |\n", s.what, dims,
           "cuBLAS bf16", flops / t_bf16 / 1e9, "", "", "", "");
    double previous = 0.0;
    for (const MatmulRungInfo& r : matmul_rungs()) {
      const bool tc = r.rung == MatmulRung::TensorCores;
      auto run = [&] {
        if (tc)
          matmul_ladder_bf16(ctx, C.f32(), (const __nv_bfloat16*)A16.ptr,
                             (const __nv_bfloat16*)B16.ptr, s.M, s.N, s.K);
        else
          matmul_ladder(ctx, r.rung, C.f32(), A.f32(), B.f32(), s.M, s.N, s.K);
      };
      const double t = time_best(ctx, run);
      if (tc)  // cuBLAS on the same inputs, for the check
        gemm_bf16(ref.f32());
      else
        sgemm(ref.f32());
      ctx.synchronize();
      const double diff = relative_difference(to_host_floats(C), to_host_floats(ref));
      const double gflops = flops / t / 1e9;
      char ratio[16] = "", book[32] = "";
      if (previous > 0) snprintf(ratio, sizeof ratio, "%.2fx", gflops / previous);
      if (r.book_ratio > 0)
        snprintf(book, sizeof book, "%.2fx", r.book_ratio);
      else
        snprintf(book, sizeof book, "%s", r.book);
      printf("| %-16s | %-16s | %-12s | %9.0f | %7s | %-20s | %8.1f%% | %9.1e |\n", s.what, dims,
             r.name, gflops, ratio, book, 100.0 * (tc ? t_bf16 : t_sgemm) / t, diff);
      fflush(stdout);
      previous = gflops;
    }
  }
  printf(
      "x prev: over the rung above; book: the book's speed-up for that step (Playbook "
      "§12.3-12.4);\n"
      "of cuBLAS: fp32 rungs against sgemm, tensor cores against bf16 GemmEx (fp32 sums);\n"
      "vs cuBLAS: largest difference over the largest value of C (fp32 ~1e-6, bf16 inputs the "
      "same\n"
      "for both, so only the order of fp32 sums differs).\n");
  for (const MatmulRungInfo& r : matmul_rungs()) printf("%s: %s\n", r.name, r.change);
  ctx.destroy();
}

int main(int argc, char** argv) {
  bool cuda_only = argc > 1 && std::string(argv[1]) == "--cuda-only";
  if (!cuda_only) cpu_table();
  if (cuda_available())
    cuda_table();
  else
    printf("\nCUDA: the matmul ladder: no CUDA device, skipped\n");
  return 0;
}
