// matmul_ladder.cuh: the matrix multiplication the GPU chapter (Playbook §12.2-12.5) improves one
// step at a time, as kernels a reader runs and times (bench/bench_matmul.cu) next to cuBLAS:
// naive, coalesced, tiled in shared memory, coarsened, then bf16 on tensor cores. The model's
// own GEMMs go through cuBLAS (runtime/ops.cu); this is the chapter's teaching ladder.
// Guide: docs/gpu-kernels.md.
#pragma once
#include <cuda_bf16.h>

#include <vector>

#include "runtime/core.cuh"

// C[M, N] = A[M, K] B[K, N], every matrix row-major (the book's layout). A linear layer
// y = x W^T with W [out, in] is A = x [tokens, in], B = W^T [in, out], C = y [tokens, out].

// The rungs, in the order the chapter climbs them; each kernel changes one thing from the last.
enum class MatmulRung { Naive, Coalesced, Tiled, Coarsened, TensorCores };
struct MatmulRungInfo {
  MatmulRung rung;
  const char* name;    // "naive", "coalesced", ...
  const char* change;  // what the rung changes from the one before, and why
  const char* book;    // what the book measured for it
  double book_ratio;   // the book's speed-up over the rung before (0: the book gives none)
};
const std::vector<MatmulRungInfo>& matmul_rungs();  // all five, in order
const MatmulRungInfo& matmul_rung(MatmulRung rung);

// Rungs 1-4 (fp32, CUDA cores), A, B, C on ctx's device: CUDA runs the rung's kernel, the CPU
// runs matmul_fp32_cpu, which each of them matches bit for bit. The tensor-core rung is below.
void matmul_ladder(const Context& ctx, MatmulRung rung, float* C, const float* A, const float* B,
                   int M, int N, int K);
// Rung 5: A, B bf16, C fp32 (=), products summed in fp32 on tensor cores (sm_80 and newer);
// the CPU runs matmul_tensor_cores_cpu.
void matmul_ladder_bf16(const Context& ctx, float* C, const __nv_bfloat16* A,
                        const __nv_bfloat16* B, int M, int N, int K);

// The CPU references. Rungs 1-4: C[i][j] = one fmaf chain over k = 0 .. K-1, the summation
// order of every fp32 rung. Rung 5: the same over 16-wide slices of k, each slice summed on its
// own and then added, as one mma.sync m16n8k16 does (inside a slice the hardware's order and
// rounding are its own: the tests allow for that).
void matmul_fp32_cpu(float* C, const float* A, const float* B, int M, int N, int K);
void matmul_tensor_cores_cpu(float* C, const __nv_bfloat16* A, const __nv_bfloat16* B, int M, int N,
                             int K);
