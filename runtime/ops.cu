// ops.cu: the model's building blocks, each as a CPU reference loop, then the CUDA kernel
// that must match it, then the function that dispatches on the device (STYLE: CPU reference
// beside each kernel). The one idea: a transformer is a handful of GEMMs plus cheap
// elementwise and row-wise ops, and every one of them has a simple backward.
#include <cblas.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "runtime/dtype.cuh"
#include "runtime/ops.cuh"

// ============================================================================
// matmul
// ============================================================================

void gemm(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
          const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  const double m = M, n = N, k = K;  // C is read too when accumulated into
  if (count_op(ctx.device, OpKind::Gemm,
               {2 * m * n * k, 4 * (m * k + k * n + (beta != 0.0f ? m * n : 0.0)), 4 * m * n, 1,
                MathUnit::CudaCores, std::min({m, n, k}), M, N, K}))
    return;
  if (ctx.device == Device::CPU) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                trans_b ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  // cuBLAS is column-major. A row-major [M, N] matrix is the column-major [N, M] matrix C^T,
  // and C^T = op(B)^T op(A)^T: so swap the operands (and M with N) and keep each transpose
  // flag as it is. This is the one place in picoscale where the two conventions meet.
  CUBLAS_CHECK(cublasSgemm(ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                           trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, ldb, A, lda,
                           &beta, C, ldc));
}

void gemm_16bit(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                const Tensor& A, int lda, const Tensor& B, int ldb, float beta, const Tensor& C,
                int ldc) {
  PICO_ASSERT(
      gpu_path(ctx.device) && A.dtype == B.dtype &&
          (A.dtype == DType::BF16 || A.dtype == DType::F16) &&
          (C.dtype == DType::F32 || C.dtype == A.dtype),
      "gemm_16bit takes bf16 or fp16 operands and an fp32 output or one in the operands' "
      "format (sums in fp32, C added in fp32 when beta is 1, rounded once) on the GPU path");
  const double m = M, n = N, k = K;  // 2-byte operands; the output read too when accumulated
  const double c = (double)dtype_size(C.dtype);
  if (count_op(ctx.device, OpKind::Gemm,
               {2 * m * n * k, 2 * (m * k + k * n) + (beta != 0.0f ? c * m * n : 0.0), c * m * n, 1,
                MathUnit::Tensor16, std::min({m, n, k}), M, N, K}))
    return;
  const cudaDataType type = A.dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const cudaDataType c_type = C.dtype == DType::F32 ? CUDA_R_32F : type;  // fp32 sums, rounded
  const float alpha = 1.0f;  // row-major to column-major as in gemm above
  CUBLAS_CHECK(cublasGemmEx(ctx.cublas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                            trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B.ptr, type, ldb,
                            A.ptr, type, lda, &beta, C.ptr, c_type, ldc, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT));
}

void gemm_strided_batched(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                          const Tensor& A, int lda, int64_t stride_a, const Tensor& B, int ldb,
                          int64_t stride_b, float beta, const Tensor& C, int ldc, int64_t stride_c,
                          int count) {
  const bool wide = A.dtype == DType::F32;
  PICO_ASSERT(count >= 1 && A.dtype == B.dtype &&
                  (wide ? C.dtype == DType::F32 : gpu_path(ctx.device)) &&
                  (wide || A.dtype == DType::BF16 || A.dtype == DType::F16) &&
                  (C.dtype == DType::F32 || C.dtype == A.dtype) && ldc >= N &&
                  (count == 1 || stride_c >= (int64_t)(M - 1) * ldc + N ||
                   (stride_c >= N && (int64_t)(count - 1) * stride_c + N <= ldc)),
              "gemm_strided_batched: fp32 operands, or bf16 / fp16 ones on the GPU path, and "
              "outputs that do not overlap");
  // One call for the batch; an operand with stride 0 (shared) is read once.
  const double m = M, n = N, k = K, e = (double)dtype_size(A.dtype), c = dtype_size(C.dtype);
  const double reads_a = stride_a ? count : 1, reads_b = stride_b ? count : 1;
  if (count_op(ctx.device, OpKind::Gemm,
               {2 * m * n * k * count,
                e * (reads_a * m * k + reads_b * k * n) + (beta != 0.0f ? c * count * m * n : 0.0),
                c * count * m * n, 1, wide ? MathUnit::CudaCores : MathUnit::Tensor16,
                std::min({m, n, k}), M, N, K, count}))
    return;
  if (ctx.device == Device::CPU) {  // one gemm each, in order: the values of `count` calls
    for (int i = 0; i < count; i++)
      cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                  trans_b ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, A.f32() + i * stride_a, lda,
                  B.f32() + i * stride_b, ldb, beta, C.f32() + i * stride_c, ldc);
    return;
  }
  const float alpha = 1.0f;  // row-major to column-major as in gemm
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (wide) {  // as gemm's cublasSgemm, batched
    CUBLAS_CHECK(cublasSgemmStridedBatched(ctx.cublas, op_b, op_a, N, M, K, &alpha, B.f32(), ldb,
                                           stride_b, A.f32(), lda, stride_a, &beta, C.f32(), ldc,
                                           stride_c, count));
    return;
  }
  const cudaDataType type = A.dtype == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const cudaDataType c_type = C.dtype == DType::F32 ? CUDA_R_32F : type;  // as gemm_16bit's
  CUBLAS_CHECK(cublasGemmStridedBatchedEx(ctx.cublas, op_b, op_a, N, M, K, &alpha, B.ptr, type, ldb,
                                          stride_b, A.ptr, type, lda, stride_a, &beta, C.ptr,
                                          c_type, ldc, stride_c, count, CUBLAS_COMPUTE_32F,
                                          CUBLAS_GEMM_DEFAULT));
}

// ============================================================================
// launch configuration and block reductions
// ============================================================================

constexpr int kThreads = 256;  // threads per block everywhere: a multiple of the 32-lane warp

// Blocks to give each element its own thread, capped: kernels loop grid-stride over the rest.
// (The device form lets a kernel that reduces several tensors find each one's share of blocks.)
static __host__ __device__ unsigned grid_for_device(int64_t n) {
  int64_t blocks = (n + kThreads - 1) / kThreads;
  return (unsigned)(blocks < 1 ? 1 : blocks > 4096 ? 4096 : blocks);
}
static unsigned grid_for(int64_t n) {
  return grid_for_device(n);
}
#define GRID_STRIDE_LOOP(i, n)                                              \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); \
       i += (int64_t)gridDim.x * blockDim.x)

// Sum (or max) of v over a warp with register shuffles; every lane gets the result.
static __device__ float warp_reduce(float v, bool take_max) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = take_max ? fmaxf(v, other) : v + other;
  }
  return v;
}
// Sum (or max) of v over the block, returned to every thread. All threads must call it.
static __device__ float block_reduce(float v, bool take_max) {
  __shared__ float partial[32];  // one value per warp
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_reduce(v, take_max);
  __syncthreads();  // a previous call may still be reading `partial`
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < warps ? partial[lane] : (take_max ? -INFINITY : 0.0f);
  return warp_reduce(v, take_max);
}

// ============================================================================
// Storage formats: the kernels read fp32, bf16 or fp16 values widened to fp32, compute in fp32
// and store each result rounded once (round to nearest even: CUDA's own conversions, which
// runtime/dtype.cu's host loops match bit for bit)
// ============================================================================

static __device__ float widen(float x) {
  return x;
}
static __device__ float widen(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
static __device__ float widen(__half x) {
  return __half2float(x);
}
static __device__ void store(float* at, float x) {
  *at = x;
}
static __device__ void store(__nv_bfloat16* at, float x) {
  *at = __float2bfloat16_rn(x);
}
static __device__ void store(__half* at, float x) {
  *at = __float2half_rn(x);
}

static bool float_storage(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16;
}
// The same without a copy where t is fp32 already: t's own values, else widened into `wide`.
static const float* host_floats(const Tensor& t, std::vector<float>& wide) {
  if (t.dtype == DType::F32) return t.f32();
  wide = widened(t);
  return wide.data();
}
// Where a CPU loop writes t's values in fp32: t's own floats, or `wide` (sized here) when t is
// 16-bit, which store_rounded then rounds into t, each value once.
static float* host_output(const Tensor& t, std::vector<float>& wide) {
  if (t.dtype == DType::F32) return t.f32();
  wide.resize(t.numel());
  return wide.data();
}
static void store_rounded(const Tensor& t, const std::vector<float>& wide) {
  if (t.dtype != DType::F32) cast_host(t.ptr, t.dtype, wide.data(), DType::F32, t.numel());
}
// Where a CPU loop adds into a gradient (dx +=): its own floats, or `wide` holding a 16-bit
// one's values widened, which store_gradient then rounds back once (a gradient's rounding,
// counted).
static float* host_accumulator(const Tensor& t, std::vector<float>& wide) {
  if (t.dtype == DType::F32) return t.f32();
  wide = widened(t);
  return wide.data();
}
static void store_gradient(const Tensor& t, const std::vector<float>& wide) {
  if (t.dtype != DType::F32) cast_gradient_host(t.ptr, t.dtype, wide.data(), t.numel());
}

// Calls f with a null pointer of the element type `t` is stored in: float, bf16 or fp16.
template <typename F>
static void with_element(DType t, F&& f) {
  if (t == DType::BF16) return f((__nv_bfloat16*)nullptr);
  if (t == DType::F16) return f((__half*)nullptr);
  PICO_ASSERT(t == DType::F32, std::string("an op on a tensor of ") + dtype_name(t));
  f((float*)nullptr);
}
// The same for an operand beside a tensor of element S (the residual stream): any of the three
// when S is float; float or S itself when S is 16-bit (bf16 and fp16 never meet in one op),
// which keeps the kernels compiled for a 16-bit stream to those pairs.
template <typename S, typename F>
static void with_element_beside(DType t, F&& f) {
  if constexpr (std::is_same_v<S, float>) {
    with_element(t, f);
  } else {
    if (t == DType::F32) return f((float*)nullptr);
    with_element(t, [&](auto* e) {
      if constexpr (std::is_same_v<std::remove_pointer_t<decltype(e)>, S>)
        f(e);
      else
        PICO_ASSERT(false, std::string("bf16 and fp16 in one op: ") + dtype_name(t));
    });
  }
}

// Calls f with null pointers of the element types of a stream tensor and of the operands beside
// it, in order: f((S*)0, (A*)0, ...) for the dtypes (stream, a, ...), one with_element for the
// stream and one with_element_beside for each operand, nested.
template <typename S, typename F>
static void with_elements_beside(F&& f) {
  f();
}
template <typename S, typename F, typename... Rest>
static void with_elements_beside(F&& f, DType t, Rest... rest) {
  with_element_beside<S>(
      t, [&](auto* e) { with_elements_beside<S>([&](auto*... more) { f(e, more...); }, rest...); });
}
template <typename F, typename... Rest>
static void with_elements(F&& f, DType stream, Rest... beside) {
  with_element(stream, [&](auto* s) {
    using S = std::remove_pointer_t<decltype(s)>;
    with_elements_beside<S>([&](auto*... e) { f(s, e...); }, beside...);
  });
}
// p as a pointer to E (the element type with_elements gave).
template <typename E>
static E* typed(E*, const void* p) {
  return (E*)p;
}

// ============================================================================
// embedding: a row gather forward, a scatter-add backward
// ============================================================================

// rows[T, D] = table[ids[t]] (gather), or table[ids[t]] += rows[t] (scatter); table [V, D]
static void embedding_cpu(float* rows, void* table, DType dtype, const int32_t* ids, int T, int D,
                          int V, bool scatter) {
  for (int t = 0; t < T; t++) {
    PICO_ASSERT(ids[t] >= -1 && ids[t] < V, "token id " + std::to_string(ids[t]) +
                                                " outside the vocabulary of " + std::to_string(V));
    float* row = rows + (int64_t)t * D;
    if (ids[t] == -1) {  // held by another tensor-parallel rank: a zero row, no gradient
      if (!scatter) std::fill(row, row + D, 0.0f);
      continue;
    }
    char* entry = (char*)table + (int64_t)ids[t] * D * dtype_size(dtype);
    if (!scatter) {
      cast_host(row, DType::F32, entry, dtype, D);  // a copy when the table is fp32
      continue;
    }
    for (int i = 0; i < D; i++) ((float*)entry)[i] += row[i];
  }
}

// rows in fp32 or in the residual stream's 16-bit format (each value rounded once: none when
// the table is in that format too, a gather).
template <typename R, typename E>
static __global__ void embedding_forward_kernel(R* rows, const E* table, const int32_t* ids,
                                                int64_t n, int D, int V) {
  GRID_STRIDE_LOOP(i, n) {
    int id = ids[i / D];
    // -1: another rank's vocabulary (a zero row); anything else out of range is a bug: no
    // assert on the GPU, a NaN loss instead.
    store(rows + i,
          id >= 0 && id < V ? widen(table[(int64_t)id * D + i % D]) : (id == -1 ? 0.0f : NAN));
  }
}

// Backward, deterministic. Adding rows into the table with float atomics would make the sum's
// order (and so its rounding) depend on thread scheduling whenever a token repeats. Instead
// the positions are sorted by token id first (a stable radix sort: equal ids keep their
// position order), and one thread per (run of equal ids, column) adds its run's rows in that
// order. Those are the CPU loop's additions in the CPU loop's order: GPU and CPU agree bit for
// bit, and two runs agree with each other.
static __global__ void iota_kernel(int32_t* out, int n) {
  GRID_STRIDE_LOOP(i, n) out[i] = (int32_t)i;
}
template <typename R>  // rows in fp32, or in 16 bits (a mixture's rows as they travel)
static __global__ void embedding_backward_kernel(float* table, const R* rows,
                                                 const int32_t* sorted_ids,
                                                 const int32_t* sorted_pos, int T, int D, int V) {
  GRID_STRIDE_LOOP(i, (int64_t)T * D) {  // i = (k, col): sorted position k, column col
    int k = (int)(i / D), col = (int)(i % D), id = sorted_ids[k];
    if (id < 0 || id >= V || (k > 0 && sorted_ids[k - 1] == id)) continue;  // not a run's head
    float* cell = table + (int64_t)id * D + col;
    float acc = *cell;
    for (int j = k; j < T && sorted_ids[j] == id; j++)
      acc += widen(rows[(int64_t)sorted_pos[j] * D + col]);
    *cell = acc;
  }
}

static void check_embedding(const Context& ctx, const Tensor& rows, const Tensor& ids,
                            const Tensor& table) {
  check_devices(ctx, "embedding", rows, ids, table);
  PICO_ASSERT(rows.numel() == ids.numel() * table.size(1), "embedding rows " + rows.shape_str());
}
void embedding_forward(const Context& ctx, const Tensor& out, const Tensor& ids,
                       const Tensor& table) {
  check_embedding(ctx, out, ids, table);
  int T = (int)ids.numel(), V = (int)table.size(0), D = (int)table.size(1);
  PICO_ASSERT(table.dtype == DType::F32 || table.dtype == DType::BF16 || table.dtype == DType::F16,
              std::string("an embedding table in ") + dtype_name(table.dtype));
  PICO_ASSERT(float_storage(out.dtype), std::string("embedding rows in ") + dtype_name(out.dtype));
  const double row_bytes = (double)D * dtype_size(table.dtype);
  if (count_op(ctx.device, OpKind::Elementwise,
               {0, T * row_bytes + 4.0 * T, (double)T * D * dtype_size(out.dtype)}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> wide;  // 16-bit rows: each value rounded once, as cast_ would
    embedding_cpu(host_output(out, wide), table.ptr, table.dtype, ids.i32(), T, D, V, false);
    return store_rounded(out, wide);
  }
  if (T == 0) return;
  const unsigned grid = grid_for((int64_t)T * D);
  with_elements(
      [&](auto* R, auto* E) {
        embedding_forward_kernel<<<grid, kThreads, 0, ctx.stream>>>(
            typed(R, out.ptr), typed(E, table.ptr), ids.i32(), (int64_t)T * D, D, V);
      },
      out.dtype, table.dtype);
  LAUNCH_CHECK(ctx, "embedding_forward_kernel");
}
void embedding_backward(const Context& ctx, const Tensor& dtable, const Tensor& ids,
                        const Tensor& dout) {
  check_embedding(ctx, dout, ids, dtable);
  int T = (int)ids.numel(), V = (int)dtable.size(0), D = (int)dtable.size(1);
  PICO_ASSERT(
      dtable.dtype == DType::F32 && float_storage(dout.dtype),
      std::string("embedding_backward: an fp32 table from rows in ") + dtype_name(dout.dtype));
  // The rows of the table it adds into are read and written; ids sorted first (iota, CUB's
  // radix sort, the scatter: three launches).
  const double row_bytes = (double)D * dtype_size(dout.dtype);
  if (count_op(ctx.device, OpKind::Elementwise,
               {(double)T * D, T * (row_bytes + 4.0 * D) + 16.0 * T, 4.0 * T * D + 12.0 * T, 3}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> wide;  // 16-bit rows widened (exact), then added as fp32 ones
    float* rows = (float*)host_floats(dout, wide);
    return embedding_cpu(rows, dtable.f32(), DType::F32, ids.i32(), T, D, V, true);
  }
  if (T == 0) return;
  // Workspace: CUB's scratch (rounded to 256 bytes, so what follows stays aligned), then [3, T]
  // int32: positions 0..T-1, the ids sorted, the positions in that order.
  size_t scratch = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, scratch, (const int32_t*)nullptr,
                                             (int32_t*)nullptr, (const int32_t*)nullptr,
                                             (int32_t*)nullptr, T, 0, 32, ctx.stream));
  int64_t scratch_words = (int64_t)(scratch + 255) / 256 * 64;
  Tensor work = empty(ctx, {scratch_words + 3 * (int64_t)T}, Mem::Workspace, DType::I32);
  int32_t* positions = work.i32() + scratch_words;
  int32_t *sorted_ids = positions + T, *sorted_pos = sorted_ids + T;
  iota_kernel<<<grid_for(T), kThreads, 0, ctx.stream>>>(positions, T);
  LAUNCH_CHECK(ctx, "iota_kernel");
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(work.i32(), scratch, ids.i32(), sorted_ids, positions,
                                             sorted_pos, T, 0, 32, ctx.stream));
  with_element(dout.dtype, [&](auto* R) {
    embedding_backward_kernel<<<grid_for((int64_t)T * D), kThreads, 0, ctx.stream>>>(
        dtable.f32(), typed(R, dout.ptr), sorted_ids, sorted_pos, T, D, V);
  });
  LAUNCH_CHECK(ctx, "embedding_backward_kernel");
}

// ============================================================================
// RMSNorm (Zhang & Sennrich 2019): LayerNorm without the mean, as in Llama
// ============================================================================

// Row sums accumulate in fp32 on both devices; y may alias x.
static void rmsnorm_forward_cpu(float* y, float* rstd, const float* x, const float* w, int T, int D,
                                float eps) {
  for (int t = 0; t < T; t++) {
    const float* xr = x + (int64_t)t * D;  // [D]
    float ss = 0.0f;
    for (int i = 0; i < D; i++) ss += xr[i] * xr[i];
    float r = 1.0f / sqrtf(ss / D + eps);
    rstd[t] = r;
    for (int i = 0; i < D; i++) y[(int64_t)t * D + i] = xr[i] * r * w[i];
  }
}
// rmsnorm_forward's CPU path: fp32 sums, y rounded once into its format.
static void rmsnorm_forward_host(const Tensor& y, const Tensor& rstd, const Tensor& x,
                                 const Tensor& w, float eps) {
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  std::vector<float> w_wide, x_wide, y_wide;
  const float *wv = host_floats(w, w_wide), *xv = host_floats(x, x_wide);
  rmsnorm_forward_cpu(host_output(y, y_wide), rstd.f32(), xv, wv, T, D, eps);
  store_rounded(y, y_wide);
}
static void axpby_cpu(float* out, float alpha, const float* a, float beta, const float* b,
                      int64_t n);  // the residual add's loop (below, with its kernel)
// The fused residual-and-norm ops' first pass on the CPU: sum = a + b, rounded as stored (the
// norm then reads the sum as stored).
static void residual_sum_host(const Tensor& sum, const Tensor& a, const Tensor& b) {
  std::vector<float> a_wide, b_wide, sum_wide;
  const float *av = host_floats(a, a_wide), *bv = host_floats(b, b_wide);
  axpby_cpu(host_output(sum, sum_wide), 1.0f, av, 1.0f, bv, sum.numel());
  store_rounded(sum, sum_wide);
}
// With xhat = x * rstd and g = dy * w: dx += rstd * (g - xhat * mean(g * xhat)), the second
// term being the gradient through rstd; dw += sum_t dy * xhat. dw's column sums run over every
// row of the micro-batch (hundreds to thousands): in double, so their error does not grow with
// T (an fp32 running sum left the norm weights' gradients 3-5 times further from float64 than
// transformers' fp32 ones on a trained checkpoint).
static void rmsnorm_backward_cpu(float* dx, float* dw, const float* dy, const float* x,
                                 const float* w, const float* rstd, int T, int D) {
  std::vector<double> column(D, 0.0);
  for (int t = 0; t < T; t++) {
    const float *xr = x + (int64_t)t * D, *dyr = dy + (int64_t)t * D;  // [D]
    float r = rstd[t], dot = 0.0f;
    for (int i = 0; i < D; i++) dot += dyr[i] * w[i] * (xr[i] * r);
    dot /= D;
    for (int i = 0; i < D; i++) {
      float xhat = xr[i] * r;
      dx[(int64_t)t * D + i] += r * (dyr[i] * w[i] - xhat * dot);
      column[i] += (double)(dyr[i] * xhat);
    }
  }
  for (int i = 0; i < D; i++) dw[i] += (float)column[i];
}

// One block per row: the block reduces the row's sum of squares, then every thread scales. Y:
// fp32, or the compute format mixed precision's linear layers read (each value rounded once);
// W: the weight as it is stored, fp32 or its compute copy (read widened); X: the stream's
// storage (fp32, or 16-bit under --residual-dtype), read widened.
template <typename X, typename Y, typename W>
static __global__ void rmsnorm_forward_kernel(Y* y, float* rstd, const X* x, const W* w, int D,
                                              float eps) {
  const X* xr = x + (int64_t)blockIdx.x * D;  // [D]
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) ss += widen(xr[i]) * widen(xr[i]);
  float r = 1.0f / sqrtf(block_reduce(ss, false) / D + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    store(y + (int64_t)blockIdx.x * D + i, widen(xr[i]) * r * widen(w[i]));
}
// The residual add and the next norm in one pass (as Megatron's and Apex's fused add + norm):
// sum = a + b written, its row's sum of squares reduced, y = sum * rstd * w written. Each thread
// reads back only the sums it wrote itself (no barrier needed; the row is still in cache). The
// arithmetic is residual_forward's, then rmsnorm_forward's, value for value. S: the stream's
// storage (sum and a): a 16-bit sum is rounded as it is stored, and the norm reads it so.
template <typename S, typename B, typename Y, typename W>
static __global__ void residual_rmsnorm_kernel(S* sum, Y* y, float* rstd, const S* a, const B* b,
                                               const W* w, int D, float eps) {
  const int64_t row = (int64_t)blockIdx.x * D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    store(sum + row + i, 1.0f * widen(a[row + i]) + 1.0f * widen(b[row + i]));
    const float v = widen(sum[row + i]);
    ss += v * v;
  }
  float r = 1.0f / sqrtf(block_reduce(ss, false) / D + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = r;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    store(y + row + i, widen(sum[row + i]) * r * widen(w[i]));
}
// dw is a column sum over all T rows. One thread per column walking all T rows would leave the
// GPU idle (D threads) and take T steps; atomics would make the sum's order depend on
// scheduling. So two stages, both deterministic: stage 1 gives each block of kDwRows rows its
// own partial row, stage 2 adds the partials of each column in row-block order. The order
// differs from the CPU loop's (chunks, then their sum), hence a tolerance against the CPU, but
// it never differs between two GPU runs.
//
// Stage 1 is also dx's kernel, so dy and x are read once: a block walks its kDwRows rows in turn,
// reduces each row's dot product, adds to dx, and adds the row's dy * xhat into its partial row
// (in global memory, each column by the one thread that owns it: no barrier, and the row stays
// in cache). G: dy's storage (fp32, or the compute format the linear layers wrote it in); W: w's;
// R: the storage of dx's rounded copy (none when `rounded` is null); X: the stream's and its
// gradient's (x and dx: fp32, or 16-bit under --residual-dtype, dx rounded as it is stored).
constexpr int kDwRows = 32;
template <typename X, typename G, typename W, typename R>
static __global__ void rmsnorm_backward_kernel(X* dx, R* rounded, float* partials, const G* dy,
                                               const X* x, const W* w, const float* rstd, int T,
                                               int D) {
  float* column = partials + (int64_t)blockIdx.x * D;  // [D] this block's part of dw
  for (int i = threadIdx.x; i < D; i += blockDim.x) column[i] = 0.0f;
  const int first = blockIdx.x * kDwRows, last = min(T, first + kDwRows);
  for (int t = first; t < last; t++) {
    const int64_t row = (int64_t)t * D;
    float r = rstd[t], dot = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x)
      dot += widen(dy[row + i]) * widen(w[i]) * (widen(x[row + i]) * r);
    dot = block_reduce(dot, false) / D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float g = widen(dy[row + i]), xhat = widen(x[row + i]) * r;
      const float v = widen(dx[row + i]) + r * (g * widen(w[i]) - xhat * dot);
      store(dx + row + i, v);
      if (rounded) store(rounded + row + i, v);
      column[i] += g * xhat;
    }
  }
}
static __global__ void rmsnorm_dw_sum_kernel(float* dw, const float* partials, int row_blocks,
                                             int D) {
  GRID_STRIDE_LOOP(i, D) {
    float acc = 0.0f;
    for (int b = 0; b < row_blocks; b++) acc += partials[(int64_t)b * D + i];
    dw[i] += acc;
  }
}

void rmsnorm_forward(const Context& ctx, const Tensor& y, const Tensor& rstd, const Tensor& x,
                     const Tensor& w, float eps) {
  check_devices(ctx, "rmsnorm_forward", y, rstd, x, w);
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  PICO_ASSERT(w.numel() == D && y.numel() == x.numel() && rstd.numel() == T,
              "rmsnorm_forward shapes " + x.shape_str());
  PICO_ASSERT(float_storage(x.dtype) && float_storage(y.dtype),
              std::string("rmsnorm_forward: x and y fp32, bf16 or fp16, not ") +
                  dtype_name(x.dtype) + " and " + dtype_name(y.dtype));
  PICO_ASSERT(float_storage(w.dtype), std::string("rmsnorm weight in ") + dtype_name(w.dtype));
  const double ex = dtype_size(x.dtype), ey = dtype_size(y.dtype), ew = dtype_size(w.dtype);
  if (count_op(ctx.device, OpKind::Norm, {4.0 * T * D, ex * T * D + ew * D, ey * T * D + 4.0 * T}))
    return;
  if (ctx.device == Device::CPU) return rmsnorm_forward_host(y, rstd, x, w, eps);
  if (T == 0) return;  // a grid of zero blocks is a launch error, not a no-op
  with_elements(
      [&](auto* X, auto* Y, auto* W) {
        rmsnorm_forward_kernel<<<T, kThreads, 0, ctx.stream>>>(
            typed(Y, y.ptr), rstd.f32(), typed(X, x.ptr), typed(W, w.ptr), D, eps);
      },
      x.dtype, y.dtype, w.dtype);
  LAUNCH_CHECK(ctx, "rmsnorm_forward_kernel");
}

void residual_rmsnorm_forward(const Context& ctx, const Tensor& sum, const Tensor& y,
                              const Tensor& rstd, const Tensor& a, const Tensor& b, const Tensor& w,
                              float eps) {
  check_devices(ctx, "residual_rmsnorm_forward", sum, y, rstd, a, b, w);
  int D = (int)a.size(-1), T = (int)(a.numel() / D);
  PICO_ASSERT(w.numel() == D && sum.numel() == a.numel() && b.numel() == a.numel() &&
                  y.numel() == a.numel() && rstd.numel() == T,
              "residual_rmsnorm_forward shapes " + a.shape_str());
  PICO_ASSERT(sum.dtype == a.dtype && float_storage(a.dtype) && float_storage(b.dtype) &&
                  float_storage(y.dtype) && float_storage(w.dtype),
              "residual_rmsnorm_forward: sum and a of one format; each fp32 or 16-bit");
  // a and b read, the sum and y written (the sum's read back is the thread's own, in cache).
  const double es = dtype_size(a.dtype), eb = dtype_size(b.dtype), ey = dtype_size(y.dtype),
               ew = dtype_size(w.dtype);
  if (count_op(ctx.device, OpKind::Norm,
               {5.0 * T * D, (es + eb) * T * D + ew * D, (es + ey) * T * D + 4.0 * T}))
    return;
  if (ctx.device == Device::CPU) {  // the two passes the kernel fuses, one after the other
    residual_sum_host(sum, a, b);
    return rmsnorm_forward_host(y, rstd, sum, w, eps);
  }
  if (T == 0) return;
  with_elements(
      [&](auto* S, auto* B, auto* Y, auto* W) {
        residual_rmsnorm_kernel<<<T, kThreads, 0, ctx.stream>>>(
            typed(S, sum.ptr), typed(Y, y.ptr), rstd.f32(), typed(S, a.ptr), typed(B, b.ptr),
            typed(W, w.ptr), D, eps);
      },
      a.dtype, b.dtype, y.dtype, w.dtype);
  LAUNCH_CHECK(ctx, "residual_rmsnorm_kernel");
}

// A norm backward's dx (+=) and its optional rounded copy: the stream and its gradient in one
// format, fp32 (a rounded copy of dx may be asked for, a tensor of its own) or 16-bit under
// --residual-dtype (dx itself is what the linear layers read).
static void check_norm_gradient(const Context& ctx, const char* op, const Tensor& dx,
                                const Tensor& x, const Tensor& dx_rounded) {
  if (dx_rounded.defined()) check_devices(ctx, op, dx_rounded);
  PICO_ASSERT(
      !dx_rounded.defined() || (dx_rounded.numel() == dx.numel() &&
                                float_storage(dx_rounded.dtype) && dx_rounded.ptr != dx.ptr),
      std::string(op) + ": dx's rounded copy is a tensor of its own, of dx's size");
  PICO_ASSERT(dx.dtype == x.dtype && float_storage(x.dtype) &&
                  (x.dtype == DType::F32 || !dx_rounded.defined()),
              std::string(op) + ": dx and x of one format, not " + dtype_name(dx.dtype) + " and " +
                  dtype_name(x.dtype));
}
// The CPU path's end: dx stored (a 16-bit stream's sum rounded once as stored), and its copy
// rounded from it once, a gradient's rounding, counted.
static void store_norm_gradient(const Tensor& dx, const std::vector<float>& dx_wide,
                                const Tensor& dx_rounded) {
  store_gradient(dx, dx_wide);
  if (dx_rounded.defined())
    cast_gradient_host(dx_rounded.ptr, dx_rounded.dtype, dx.f32(), dx.numel());
}
// The element type the kernels write the copy in: dx_rounded's, or float for none (a null
// pointer never written through; a 16-bit stream has no copy).
static DType norm_copy_dtype(const Tensor& x, const Tensor& dx_rounded) {
  return x.dtype == DType::F32 && dx_rounded.defined() ? dx_rounded.dtype : DType::F32;
}

void rmsnorm_backward(const Context& ctx, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                      const Tensor& x, const Tensor& w, const Tensor& rstd,
                      const Tensor& dx_rounded) {
  check_devices(ctx, "rmsnorm_backward", dx, dw, dy, x, w, rstd);
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  PICO_ASSERT(dx.numel() == x.numel() && dy.numel() == x.numel() && dw.numel() == D,
              "rmsnorm_backward shapes " + x.shape_str());
  PICO_ASSERT(float_storage(w.dtype) && float_storage(dy.dtype),
              std::string("rmsnorm_backward: w in ") + dtype_name(w.dtype) + ", dy in " +
                  dtype_name(dy.dtype));
  check_norm_gradient(ctx, "rmsnorm_backward", dx, x, dx_rounded);
  // dx += ...: dx, dy and x read once, dx written (and its copy); dw from partial sums per block
  // of rows, the partials written by the same kernel and summed by a second.
  const double ew = (double)dtype_size(w.dtype), eg = (double)dtype_size(dy.dtype);
  const double er = dx_rounded.defined() ? (double)dtype_size(dx_rounded.dtype) : 0.0;
  const double ex = (double)dtype_size(x.dtype);
  const int row_blocks = (T + kDwRows - 1) / kDwRows;
  const double partial_bytes = 4.0 * row_blocks * D;
  if (count_op(ctx.device, OpKind::Norm,
               {8.0 * T * D, (2 * ex + eg) * T * D + 4.0 * T + ew * D + 4.0 * D + partial_bytes,
                (ex + er) * T * D + 4.0 * D + partial_bytes, 2}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> dy_wide, w_wide, x_wide, dx_wide;
    rmsnorm_backward_cpu(host_accumulator(dx, dx_wide), dw.f32(), host_floats(dy, dy_wide),
                         host_floats(x, x_wide), host_floats(w, w_wide), rstd.f32(), T, D);
    return store_norm_gradient(dx, dx_wide, dx_rounded);
  }
  if (T == 0) return;  // no rows: nothing to add (and a zero-block grid would not launch)
  Tensor partials = empty(ctx, {row_blocks, D}, Mem::Workspace);  // [T / kDwRows, D]
  with_elements(
      [&](auto* X, auto* G, auto* W, auto* R) {
        rmsnorm_backward_kernel<<<row_blocks, kThreads, 0, ctx.stream>>>(
            typed(X, dx.ptr), typed(R, dx_rounded.ptr), partials.f32(), typed(G, dy.ptr),
            typed(X, x.ptr), typed(W, w.ptr), rstd.f32(), T, D);
      },
      x.dtype, dy.dtype, w.dtype, norm_copy_dtype(x, dx_rounded));
  LAUNCH_CHECK(ctx, "rmsnorm_backward_kernel");
  rmsnorm_dw_sum_kernel<<<grid_for(D), kThreads, 0, ctx.stream>>>(dw.f32(), partials.f32(),
                                                                  row_blocks, D);
  LAUNCH_CHECK(ctx, "rmsnorm_dw_sum_kernel");
}

// ============================================================================
// RoPE (Su et al. 2021), HF rotate_half layout: pair (i, i + hd/2) turns by pos * theta^(-2i/hd)
// ============================================================================

// The pairs' frequencies theta^(-2i/hd), i < hd/2, computed once on the host and handed to the
// CPU loop and the kernel alike (as Hugging Face's inv_freq and llm.c's precomputed table): a
// device powf may differ from the host's by an ulp or more, and the angle pos x frequency turns
// that into a rotation error that grows with the position (about 4e-3 radians at 16k tokens for
// 4 ulp). With one table the angle is one correctly rounded product on both; only sinf and cosf
// may differ, by an ulp or two of their results. At most 128 pairs (head dims up to 256) travel
// with the launch (a kernel parameter, no copy).
constexpr int kRopeMaxPairs = kRopeMaxHeadDimCuda / 2;
struct RopeFrequencies {
  float of[kRopeMaxPairs];
};
void validate_head_dim(int head_dim, bool flash, Device device, const std::string& gpu) {
  if (device == Device::CPU || (device == Device::Meta && gpu == "cpu")) return;
  const std::string hd = "head dim " + std::to_string(head_dim) + " (--d-model / --heads" +
                         (device == Device::CUDA ? ", or a checkpoint's config.json)" : ")");
  // Where the step would run instead: the CPU, or priced as CPU ranks (./train --device meta,
  // ./plan).
  const std::string elsewhere =
      device == Device::Meta ? ", or --gpu cpu (the " + (gpu.empty() ? std::string("h100") : gpu) +
                                   " profile prices CUDA's step, the cpu profile CPU ranks')"
                             : ", or --device cpu";
  if (head_dim > kRopeMaxHeadDimCuda)
    throw UsageError(hd + ": RoPE on CUDA takes head dims up to " +
                     std::to_string(kRopeMaxHeadDimCuda) + "; use more --heads" + elsewhere);
  if (flash && head_dim > kFlashMaxHeadDimCuda)
    throw UsageError(hd + ": FlashAttention's CUDA kernels take head dims up to " +
                     std::to_string(kFlashMaxHeadDimCuda) +
                     "; use more --heads, --attention naive (one rank's whole sequences)" +
                     elsewhere);
}
static std::vector<float> rope_frequencies(int hd, float theta) {
  std::vector<float> f(hd / 2);
  for (int i = 0; i < hd / 2; i++) f[i] = 1.0f / powf(theta, (2.0f * i) / hd);
  return f;
}

// x [T, H, hd] in place; sign = +1 rotates (forward), -1 rotates back (backward: the transpose
// of a rotation is its inverse). Angles in float, the same expressions as the kernel.
static void rope_cpu(float* x, const int32_t* pos, int T, int H, int hd, const float* freq,
                     float sign) {
  int half = hd / 2;
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < half; i++) {
        float angle = (float)pos[t] * freq[i];
        float c = cosf(angle), s = sign * sinf(angle);
        float* v = x + ((int64_t)t * H + h) * hd;  // [hd]
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
      }
}

// One thread per rotated pair; x read in fp32 or the 16-bit format it is stored in, the result
// written into out (x itself, or a 16-bit tensor), each value rounded once as it is stored. Up
// to three tensors of the same formats and positions in one launch (q and k; and in the backward
// v's gradient, rounded but not rotated): the pairs of the first, then the second's, then the
// third's.
template <typename I, typename O>
struct RopeOperand {
  O* out;
  const I* x;
  int H;        // heads
  bool rotate;  // false: copied (rounded into out's format)
};
template <typename I, typename O>
struct RopeOperands {
  RopeOperand<I, O> op[3];
  int count;
};
template <typename I, typename O>
static __global__ void rope_kernel(RopeOperands<I, O> ops, const int32_t* pos, int T, int hd,
                                   const __grid_constant__ RopeFrequencies freq, float sign) {
  const int half = hd / 2;
  const RopeOperand<I, O>&a = ops.op[0], &b = ops.op[1], &c = ops.op[2];
  const int64_t pairs_a = (int64_t)T * a.H * half,
                pairs_b = ops.count > 1 ? (int64_t)T * b.H * half : 0;
  const int64_t pairs = pairs_a + pairs_b + (ops.count > 2 ? (int64_t)T * c.H * half : 0);
  GRID_STRIDE_LOOP(p, pairs) {
    // The pair's operand and its index there, by selects (an indexed parameter array would sit
    // in local memory).
    const bool in_a = p < pairs_a, in_b = !in_a && p < pairs_a + pairs_b;
    const int64_t q = in_a ? p : in_b ? p - pairs_a : p - pairs_a - pairs_b;
    O* out = in_a ? a.out : in_b ? b.out : c.out;
    const I* x = in_a ? a.x : in_b ? b.x : c.x;
    const int H = in_a ? a.H : in_b ? b.H : c.H;
    const bool rotate = in_a ? a.rotate : in_b ? b.rotate : c.rotate;
    int i = (int)(q % half);
    int64_t head = q / half;     // t * H + h
    const I* v = x + head * hd;  // [hd]
    O* o = out + head * hd;
    float va = widen(v[i]), vb = widen(v[i + half]);
    if (!rotate) {
      store(o + i, va), store(o + i + half, vb);
      continue;
    }
    float angle = (float)pos[head / H] * freq.of[i];
    float cs = cosf(angle), sn = sign * sinf(angle);
    store(o + i, va * cs - vb * sn);
    store(o + i + half, vb * cs + va * sn);
  }
}

// out (x itself, or a 16-bit tensor x's rotation is rounded into) from x, for each part given
// (one to three, in one launch); `gradient` says the rounding counts among the backward's
// (RoundingStats).
struct RopePart {
  Tensor out, x;
  bool rotate = true;  // false: x rounded into out as it is
};
static void rope(const Context& ctx, const std::vector<RopePart>& parts, const Tensor& positions,
                 float theta, float sign, bool gradient) {
  PICO_ASSERT(parts.size() >= 1 && parts.size() <= 3, "rope takes one to three tensors");
  int T = 0, hd = 0;
  double read = 4.0 * positions.numel(), written = 0, flops = 0;
  for (const RopePart& part : parts) {
    const Tensor &out = part.out, &x = part.x;
    check_devices(ctx, "rope", out, x, positions);
    PICO_ASSERT(x.dim() == 3 && x.size(2) % 2 == 0 && positions.numel() == x.size(0),
                "rope expects x [T, H, hd] with even hd and positions [T], got " + x.shape_str());
    const bool in_place = out.ptr == x.ptr;
    PICO_ASSERT(
        float_storage(x.dtype) && out.numel() == x.numel() &&
            (in_place ? out.dtype == x.dtype : x.dtype == DType::F32 && float_storage(out.dtype)),
        std::string("rope from ") + dtype_name(x.dtype) + " into " + dtype_name(out.dtype));
    PICO_ASSERT(
        &part == &parts[0] || (x.size(0) == T && x.size(2) == hd && x.dtype == parts[0].x.dtype &&
                               out.dtype == parts[0].out.dtype),
        "rope's tensors differ in tokens, head size or formats");
    PICO_ASSERT(part.rotate || !in_place, "rope: a tensor neither rotated nor rounded");
    T = (int)x.size(0), hd = (int)x.size(2);
    flops += part.rotate ? 3.0 * x.numel() : 0.0;
    read += dtype_size(x.dtype) * (double)x.numel();
    written += dtype_size(out.dtype) * (double)out.numel();
  }
  if (count_op(ctx.device, OpKind::Elementwise, {flops, read, written})) return;
  const std::vector<float> freq = rope_frequencies(hd, theta);
  if (ctx.device == Device::CPU) {
    for (const RopePart& part : parts) {
      const Tensor &out = part.out, &x = part.x;
      const int H = (int)x.size(1);
      if (x.dtype == DType::F32 && out.ptr == x.ptr) {
        rope_cpu(x.f32(), positions.i32(), T, H, hd, freq.data(), sign);
        continue;
      }
      std::vector<float> v = widened(x);
      if (part.rotate) rope_cpu(v.data(), positions.i32(), T, H, hd, freq.data(), sign);
      if (gradient && out.dtype != DType::F32)
        cast_gradient_host(out.ptr, out.dtype, v.data(), out.numel());  // counted
      else
        cast_host(out.ptr, out.dtype, v.data(), DType::F32, out.numel());  // rounded once
    }
    return;
  }
  PICO_ASSERT((int)freq.size() <= kRopeMaxPairs, "rope on CUDA takes head dims up to " +
                                                     std::to_string(2 * kRopeMaxPairs) + ", got " +
                                                     std::to_string(hd));
  RopeFrequencies table{};
  std::copy(freq.begin(), freq.end(), table.of);
  int64_t pairs = 0;
  for (const RopePart& part : parts) pairs += part.x.numel() / 2;
  with_element(parts[0].x.dtype, [&](auto* in_type) {
    using I = std::remove_pointer_t<decltype(in_type)>;
    with_element(parts[0].out.dtype, [&](auto* out_type) {
      using O = std::remove_pointer_t<decltype(out_type)>;
      RopeOperands<I, O> ops{};
      for (const RopePart& part : parts)
        ops.op[ops.count++] = {(O*)part.out.ptr, (const I*)part.x.ptr, (int)part.x.size(1),
                               part.rotate};
      rope_kernel<<<grid_for(pairs), kThreads, 0, ctx.stream>>>(ops, positions.i32(), T, hd, table,
                                                                sign);
    });
  });
  LAUNCH_CHECK(ctx, "rope_kernel");
}
void rope_forward(const Context& ctx, const Tensor& x, const Tensor& positions, float theta) {
  rope(ctx, {{x, x}}, positions, theta, 1.0f, false);
}
void rope_forward(const Context& ctx, const Tensor& q, const Tensor& k, const Tensor& positions,
                  float theta) {
  rope(ctx, {{q, q}, {k, k}}, positions, theta, 1.0f, false);
}
void rope_backward(const Context& ctx, const Tensor& dx, const Tensor& positions, float theta,
                   const Tensor& into) {
  rope(ctx, {{into.defined() ? into : dx, dx}}, positions, theta, -1.0f, true);
}
void rope_backward(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& positions,
                   float theta, const Tensor& into_q, const Tensor& into_k, const Tensor& dv,
                   const Tensor& into_v) {
  std::vector<RopePart> parts = {{into_q, dq}, {into_k, dk}};
  if (dv.defined() && into_v.ptr != dv.ptr) parts.push_back({into_v, dv, false});
  rope(ctx, parts, positions, theta, -1.0f, true);
}

// ============================================================================
// SwiGLU (Shazeer 2020): the gated MLP activation of Llama
// ============================================================================

static __host__ __device__ float sigmoid(float g) {
  return 1.0f / (1.0f + expf(-g));
}

// gate, up, out [n]
static void swiglu_forward_cpu(float* out, const float* gate, const float* up, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = gate[i] * sigmoid(gate[i]) * up[i];
}
// silu'(g) = sig * (1 + g * (1 - sig)). Inputs are read before outputs are written, so the
// gradients may overwrite gate and up.
static void swiglu_backward_cpu(float* dgate, float* dup, const float* dout, const float* gate,
                                const float* up, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float g = gate[i], u = up[i], d = dout[i], sig = sigmoid(g);
    dgate[i] = d * u * sig * (1.0f + g * (1.0f - sig));
    dup[i] = d * g * sig;
  }
}

template <typename E>  // float, or the 16-bit format the tensors are stored in
static __global__ void swiglu_forward_kernel(E* out, const E* gate, const E* up, int64_t n) {
  GRID_STRIDE_LOOP(i, n) {
    const float g = widen(gate[i]);
    store(out + i, g * sigmoid(g) * widen(up[i]));
  }
}
// G: the gradients' storage, fp32 or the tensors' own 16-bit format (rounded once on store).
template <typename E, typename G>
static __global__ void swiglu_backward_kernel(G* dgate, G* dup, const G* dout, const E* gate,
                                              const E* up, int64_t n) {
  GRID_STRIDE_LOOP(i, n) {
    float g = widen(gate[i]), u = widen(up[i]), d = widen(dout[i]), sig = sigmoid(g);
    store(dgate + i, d * u * sig * (1.0f + g * (1.0f - sig)));
    store(dup + i, d * g * sig);
  }
}
template <typename E>
static void launch_swiglu_backward(const Context& ctx, const Tensor& dgate, const Tensor& dup,
                                   const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  const E *g = (const E*)gate.ptr, *u = (const E*)up.ptr;
  if (dout.dtype == DType::F32)
    swiglu_backward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(dgate.f32(), dup.f32(),
                                                                     dout.f32(), g, u, n);
  else
    swiglu_backward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>((E*)dgate.ptr, (E*)dup.ptr,
                                                                     (const E*)dout.ptr, g, u, n);
}

void swiglu_forward(const Context& ctx, const Tensor& out, const Tensor& gate, const Tensor& up) {
  check_devices(ctx, "swiglu_forward", out, gate, up);
  int64_t n = gate.numel();
  PICO_ASSERT(up.numel() == n && out.numel() == n, "swiglu_forward shapes " + gate.shape_str());
  const DType t = gate.dtype;
  PICO_ASSERT(float_storage(t) && up.dtype == t && out.dtype == t,
              std::string("swiglu_forward in ") + dtype_name(t) + ", one storage dtype for all");
  const double e = (double)dtype_size(t);
  if (count_op(ctx.device, OpKind::Elementwise, {6.0 * n, 2 * e * n, e * n})) return;
  if (ctx.device == Device::CPU) {
    if (t == DType::F32) return swiglu_forward_cpu(out.f32(), gate.f32(), up.f32(), n);
    std::vector<float> g = widened(gate), u = widened(up), o(n);
    swiglu_forward_cpu(o.data(), g.data(), u.data(), n);
    return cast_host(out.ptr, t, o.data(), DType::F32, n);  // rounded once
  }
  if (t == DType::BF16)
    swiglu_forward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
        (__nv_bfloat16*)out.ptr, (const __nv_bfloat16*)gate.ptr, (const __nv_bfloat16*)up.ptr, n);
  else if (t == DType::F16)
    swiglu_forward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
        (__half*)out.ptr, (const __half*)gate.ptr, (const __half*)up.ptr, n);
  else
    swiglu_forward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(out.f32(), gate.f32(), up.f32(),
                                                                    n);
  LAUNCH_CHECK(ctx, "swiglu_forward_kernel");
}
void swiglu_backward(const Context& ctx, const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up) {
  check_devices(ctx, "swiglu_backward", dgate, dup, dout, gate, up);
  int64_t n = gate.numel();
  PICO_ASSERT(up.numel() == n && dout.numel() == n && dgate.numel() == n && dup.numel() == n,
              "swiglu_backward shapes " + gate.shape_str());
  const DType t = gate.dtype, gt = dout.dtype;
  PICO_ASSERT(float_storage(t) && up.dtype == t,
              std::string("swiglu_backward reads gate and up in one dtype, not ") + dtype_name(t));
  PICO_ASSERT((gt == DType::F32 || gt == t) && dgate.dtype == gt && dup.dtype == gt,
              "swiglu_backward's gradients: all three fp32, or all three in gate's dtype");
  const double e = (double)dtype_size(t), ge = (double)dtype_size(gt);
  if (count_op(ctx.device, OpKind::Elementwise, {12.0 * n, (ge + 2 * e) * n, 2 * ge * n})) return;
  if (ctx.device == Device::CPU) {
    if (t == DType::F32)
      return swiglu_backward_cpu(dgate.f32(), dup.f32(), dout.f32(), gate.f32(), up.f32(), n);
    std::vector<float> g = widened(gate), u = widened(up);
    if (gt == DType::F32)
      return swiglu_backward_cpu(dgate.f32(), dup.f32(), dout.f32(), g.data(), u.data(), n);
    std::vector<float> dg(n), du(n);
    swiglu_backward_cpu(dg.data(), du.data(), widened(dout).data(), g.data(), u.data(), n);
    cast_gradient_host(dgate.ptr, t, dg.data(), n);  // rounded once, counted
    return cast_gradient_host(dup.ptr, t, du.data(), n);
  }
  if (t == DType::BF16)
    launch_swiglu_backward<__nv_bfloat16>(ctx, dgate, dup, dout, gate, up);
  else if (t == DType::F16)
    launch_swiglu_backward<__half>(ctx, dgate, dup, dout, gate, up);
  else
    launch_swiglu_backward<float>(ctx, dgate, dup, dout, gate, up);
  LAUNCH_CHECK(ctx, "swiglu_backward_kernel");
}

// ============================================================================
// The book's GPT block (Playbook §2.5): LayerNorm with a bias, GeLU, dropout
// ============================================================================

// LayerNorm (Ba et al. 2016): y = (x - mean) / sqrt(var + eps) * w + b over each row of D,
// the variance taken about the mean in a second pass (no cancellation). stats [T, 2]: (mean,
// 1/std) per row, fp32, what the backward reads.
static void layernorm_forward_cpu(float* y, float* stats, const float* x, const float* w,
                                  const float* b, int T, int D, float eps) {
  for (int t = 0; t < T; t++) {
    const float* xr = x + (int64_t)t * D;  // [D]
    float sum = 0.0f;
    for (int i = 0; i < D; i++) sum += xr[i];
    const float mean = sum / D;
    float ss = 0.0f;
    for (int i = 0; i < D; i++) ss += (xr[i] - mean) * (xr[i] - mean);
    const float r = 1.0f / sqrtf(ss / D + eps);
    stats[2 * t] = mean;
    stats[2 * t + 1] = r;
    for (int i = 0; i < D; i++) y[(int64_t)t * D + i] = (xr[i] - mean) * r * w[i] + b[i];
  }
}
// layernorm_forward's CPU path (as rmsnorm_forward_host): fp32 sums, y rounded once.
static void layernorm_forward_host(const Tensor& y, const Tensor& stats, const Tensor& x,
                                   const Tensor& w, const Tensor& b, float eps) {
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  std::vector<float> x_wide, w_wide, b_wide, y_wide;
  layernorm_forward_cpu(host_output(y, y_wide), stats.f32(), host_floats(x, x_wide),
                        host_floats(w, w_wide), host_floats(b, b_wide), T, D, eps);
  store_rounded(y, y_wide);
}
// With xhat = (x - mean) r and g = dy w: dx += r (g - mean(g) - xhat mean(g xhat)), the last two
// terms the gradient through the mean and through r; dw += sum_t dy xhat, db += sum_t dy, the
// column sums in double (as RMSNorm's).
static void layernorm_backward_cpu(float* dx, float* dw, float* db, const float* dy, const float* x,
                                   const float* w, const float* stats, int T, int D) {
  std::vector<double> dw_col(D, 0.0), db_col(D, 0.0);
  for (int t = 0; t < T; t++) {
    const float *xr = x + (int64_t)t * D, *dyr = dy + (int64_t)t * D;  // [D]
    const float mean = stats[2 * t], r = stats[2 * t + 1];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int i = 0; i < D; i++) {
      g_sum += dyr[i] * w[i];
      gx_sum += dyr[i] * w[i] * ((xr[i] - mean) * r);
    }
    const float g_mean = g_sum / D, gx_mean = gx_sum / D;
    for (int i = 0; i < D; i++) {
      const float xhat = (xr[i] - mean) * r;
      dx[(int64_t)t * D + i] += r * (dyr[i] * w[i] - g_mean - xhat * gx_mean);
      dw_col[i] += (double)(dyr[i] * xhat);
      db_col[i] += (double)dyr[i];
    }
  }
  for (int i = 0; i < D; i++) {
    dw[i] += (float)dw_col[i];
    db[i] += (float)db_col[i];
  }
}

// One block per row, as RMSNorm's: the row's sum, then its squared deviations, reduced by the
// block; X the stream's storage, Y the output's (the compute format), W the weight's and bias's.
// layernorm_row takes over after the first pass, which `sum` is this thread's part of.
template <typename X, typename Y, typename W>
static __device__ void layernorm_row(Y* y, float* stats, const X* xr, const W* w, const W* b, int D,
                                     float eps, float sum) {
  const float mean = block_reduce(sum, false) / D;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    ss += (widen(xr[i]) - mean) * (widen(xr[i]) - mean);
  const float r = 1.0f / sqrtf(block_reduce(ss, false) / D + eps);
  if (threadIdx.x == 0) {
    stats[2 * blockIdx.x] = mean;
    stats[2 * blockIdx.x + 1] = r;
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    store(y + (int64_t)blockIdx.x * D + i, (widen(xr[i]) - mean) * r * widen(w[i]) + widen(b[i]));
}
template <typename X, typename Y, typename W>
static __global__ void layernorm_forward_kernel(Y* y, float* stats, const X* x, const W* w,
                                                const W* b, int D, float eps) {
  const X* xr = x + (int64_t)blockIdx.x * D;  // [D]
  float sum = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) sum += widen(xr[i]);
  layernorm_row(y, stats, xr, w, b, D, eps, sum);
}
// The residual add fused in (residual_rmsnorm_kernel's LayerNorm twin): the first pass stores
// each element of the sum and reads it back as stored; every later pass reads the sum. S: the
// stream's storage (sum and a), B: the branch's.
template <typename S, typename B, typename Y, typename W>
static __global__ void residual_layernorm_kernel(S* sum, Y* y, float* stats, const S* a, const B* b,
                                                 const W* w, const W* bias, int D, float eps) {
  const int64_t row = (int64_t)blockIdx.x * D;
  float total = 0.0f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    store(sum + row + i, 1.0f * widen(a[row + i]) + 1.0f * widen(b[row + i]));
    total += widen(sum[row + i]);
  }
  layernorm_row(y, stats, (const S*)sum + row, w, bias, D, eps, total);
}
// dx (and its rounded copy) as RMSNorm's backward kernel computes it (a block walks kDwRows rows,
// reducing each row's two sums), and each block's partial column sums of dy xhat and dy in partials
// [blocks, 2, D], which layernorm_dwdb_sum_kernel adds in block order: deterministic.
template <typename X, typename G, typename W, typename R>
static __global__ void layernorm_backward_kernel(X* dx, R* rounded, float* partials, const G* dy,
                                                 const X* x, const W* w, const float* stats, int T,
                                                 int D) {
  float* dw_part = partials + (int64_t)blockIdx.x * 2 * D;  // [D], then db's [D]
  float* db_part = dw_part + D;
  for (int i = threadIdx.x; i < D; i += blockDim.x) dw_part[i] = db_part[i] = 0.0f;
  const int first = blockIdx.x * kDwRows, last = min(T, first + kDwRows);
  for (int t = first; t < last; t++) {
    const int64_t row = (int64_t)t * D;
    const float mean = stats[2 * t], r = stats[2 * t + 1];
    float g_sum = 0.0f, gx_sum = 0.0f;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float g = widen(dy[row + i]) * widen(w[i]);
      g_sum += g;
      gx_sum += g * ((widen(x[row + i]) - mean) * r);
    }
    const float g_mean = block_reduce(g_sum, false) / D;
    const float gx_mean = block_reduce(gx_sum, false) / D;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
      const float d = widen(dy[row + i]), xhat = (widen(x[row + i]) - mean) * r;
      const float v = widen(dx[row + i]) + r * (d * widen(w[i]) - g_mean - xhat * gx_mean);
      store(dx + row + i, v);
      if (rounded) store(rounded + row + i, v);
      dw_part[i] += d * xhat;
      db_part[i] += d;
    }
  }
}
static __global__ void layernorm_dwdb_sum_kernel(float* dw, float* db, const float* partials,
                                                 int blocks, int D) {
  GRID_STRIDE_LOOP(i, (int64_t)D) {
    float w_sum = 0.0f, b_sum = 0.0f;
    for (int k = 0; k < blocks; k++) {
      w_sum += partials[(int64_t)k * 2 * D + i];
      b_sum += partials[(int64_t)k * 2 * D + D + i];
    }
    dw[i] += w_sum;
    db[i] += b_sum;
  }
}

void layernorm_forward(const Context& ctx, const Tensor& y, const Tensor& stats, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps) {
  check_devices(ctx, "layernorm_forward", y, stats, x, w, b);
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  PICO_ASSERT(
      y.numel() == x.numel() && stats.numel() == 2 * (int64_t)T && w.numel() == D && b.numel() == D,
      "layernorm_forward shapes " + x.shape_str());
  PICO_ASSERT(float_storage(x.dtype) && float_storage(y.dtype) && float_storage(w.dtype) &&
                  b.dtype == w.dtype,
              "layernorm_forward: x, y, w fp32 or 16-bit, b in w's format");
  const double ex = dtype_size(x.dtype), ey = dtype_size(y.dtype), ew = dtype_size(w.dtype);
  if (count_op(ctx.device, OpKind::Norm,
               {7.0 * T * D, ex * T * D + 2 * ew * D, ey * T * D + 8.0 * T}))
    return;
  if (ctx.device == Device::CPU) return layernorm_forward_host(y, stats, x, w, b, eps);
  if (T == 0) return;
  with_elements(
      [&](auto* X, auto* Y, auto* W) {
        layernorm_forward_kernel<<<T, kThreads, 0, ctx.stream>>>(typed(Y, y.ptr), stats.f32(),
                                                                 typed(X, x.ptr), typed(W, w.ptr),
                                                                 typed(W, b.ptr), D, eps);
      },
      x.dtype, y.dtype, w.dtype);
  LAUNCH_CHECK(ctx, "layernorm_forward_kernel");
}

void residual_layernorm_forward(const Context& ctx, const Tensor& sum, const Tensor& y,
                                const Tensor& stats, const Tensor& a, const Tensor& b,
                                const Tensor& w, const Tensor& bias, float eps) {
  check_devices(ctx, "residual_layernorm_forward", sum, y, stats, a, b, w, bias);
  int D = (int)a.size(-1), T = (int)(a.numel() / D);
  PICO_ASSERT(w.numel() == D && bias.numel() == D && sum.numel() == a.numel() &&
                  b.numel() == a.numel() && y.numel() == a.numel() &&
                  stats.numel() == 2 * (int64_t)T,
              "residual_layernorm_forward shapes " + a.shape_str());
  PICO_ASSERT(sum.dtype == a.dtype && float_storage(a.dtype) && float_storage(b.dtype) &&
                  float_storage(y.dtype) && float_storage(w.dtype) && bias.dtype == w.dtype,
              "residual_layernorm_forward: sum and a of one format, bias in w's; each fp32 or "
              "16-bit");
  // a and b read, the sum and y written (the sum's read backs are the thread's own, in cache).
  const double es = dtype_size(a.dtype), eb = dtype_size(b.dtype), ey = dtype_size(y.dtype),
               ew = dtype_size(w.dtype);
  if (count_op(ctx.device, OpKind::Norm,
               {8.0 * T * D, (es + eb) * T * D + 2 * ew * D, (es + ey) * T * D + 8.0 * T}))
    return;
  if (ctx.device == Device::CPU) {  // the two passes the kernel fuses, one after the other
    residual_sum_host(sum, a, b);
    return layernorm_forward_host(y, stats, sum, w, bias, eps);
  }
  if (T == 0) return;
  with_elements(
      [&](auto* S, auto* B, auto* Y, auto* W) {
        residual_layernorm_kernel<<<T, kThreads, 0, ctx.stream>>>(
            typed(S, sum.ptr), typed(Y, y.ptr), stats.f32(), typed(S, a.ptr), typed(B, b.ptr),
            typed(W, w.ptr), typed(W, bias.ptr), D, eps);
      },
      a.dtype, b.dtype, y.dtype, w.dtype);
  LAUNCH_CHECK(ctx, "residual_layernorm_kernel");
}

void layernorm_backward(const Context& ctx, const Tensor& dx, const Tensor& dw, const Tensor& db,
                        const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& stats,
                        const Tensor& dx_rounded) {
  check_devices(ctx, "layernorm_backward", dx, dw, db, dy, x, w, stats);
  int D = (int)x.size(-1), T = (int)(x.numel() / D);
  PICO_ASSERT(dx.numel() == x.numel() && dy.numel() == x.numel() && dw.numel() == D &&
                  db.numel() == D && stats.numel() == 2 * (int64_t)T,
              "layernorm_backward shapes " + x.shape_str());
  PICO_ASSERT(float_storage(dy.dtype) && float_storage(w.dtype) && dw.dtype == DType::F32 &&
                  db.dtype == DType::F32,
              "layernorm_backward: dy and w fp32 or 16-bit, dw and db fp32");
  check_norm_gradient(ctx, "layernorm_backward", dx, x, dx_rounded);
  const double ex = dtype_size(x.dtype), eg = dtype_size(dy.dtype), ew = dtype_size(w.dtype);
  const double er = dx_rounded.defined() ? (double)dtype_size(dx_rounded.dtype) : 0.0;
  const int row_blocks = (T + kDwRows - 1) / kDwRows;
  const double partial_bytes = 8.0 * row_blocks * D;
  if (count_op(ctx.device, OpKind::Norm,
               {12.0 * T * D, (2 * ex + eg) * T * D + 8.0 * T + ew * D + 8.0 * D + partial_bytes,
                (ex + er) * T * D + 8.0 * D + partial_bytes, 2}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> dy_wide, w_wide, x_wide, dx_wide;
    layernorm_backward_cpu(host_accumulator(dx, dx_wide), dw.f32(), db.f32(),
                           host_floats(dy, dy_wide), host_floats(x, x_wide), host_floats(w, w_wide),
                           stats.f32(), T, D);
    return store_norm_gradient(dx, dx_wide, dx_rounded);
  }
  if (T == 0) return;
  Tensor partials = empty(ctx, {row_blocks, 2, D}, Mem::Workspace);
  with_elements(
      [&](auto* X, auto* G, auto* W, auto* R) {
        layernorm_backward_kernel<<<row_blocks, kThreads, 0, ctx.stream>>>(
            typed(X, dx.ptr), typed(R, dx_rounded.ptr), partials.f32(), typed(G, dy.ptr),
            typed(X, x.ptr), typed(W, w.ptr), stats.f32(), T, D);
      },
      x.dtype, dy.dtype, w.dtype, norm_copy_dtype(x, dx_rounded));
  LAUNCH_CHECK(ctx, "layernorm_backward_kernel");
  layernorm_dwdb_sum_kernel<<<grid_for(D), kThreads, 0, ctx.stream>>>(
      dw.f32(), db.f32(), partials.f32(), row_blocks, D);
  LAUNCH_CHECK(ctx, "layernorm_dwdb_sum_kernel");
}

// GeLU, the tanh form GPT-2 and the book's GPT use: 0.5 x (1 + tanh(k (x + 0.044715 x^3))),
// k = sqrt(2 / pi); its derivative 0.5 (1 + t) + 0.5 x (1 - t^2) k (1 + 3 * 0.044715 x^2).
static __host__ __device__ inline float gelu(float x) {
  const float k = 0.7978845608028654f, t = tanhf(k * (x + 0.044715f * x * x * x));
  return 0.5f * x * (1.0f + t);
}
static __host__ __device__ inline float gelu_grad(float x) {
  const float k = 0.7978845608028654f, t = tanhf(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}
template <typename E>  // float, or the 16-bit format the tensors are stored in
static __global__ void gelu_forward_kernel(E* out, const E* in, int64_t n) {
  GRID_STRIDE_LOOP(i, n) store(out + i, gelu(widen(in[i])));
}
template <typename E, typename G>  // G: the gradients' storage, fp32 or E
static __global__ void gelu_backward_kernel(G* din, const G* dout, const E* in, int64_t n) {
  GRID_STRIDE_LOOP(i, n) store(din + i, widen(dout[i]) * gelu_grad(widen(in[i])));
}
void gelu_forward(const Context& ctx, const Tensor& out, const Tensor& in) {
  check_devices(ctx, "gelu_forward", out, in);
  const int64_t n = in.numel();
  PICO_ASSERT(out.numel() == n && float_storage(in.dtype) && out.dtype == in.dtype,
              "gelu_forward: out and in of one shape and one format");
  const double e = (double)dtype_size(in.dtype);
  if (count_op(ctx.device, OpKind::Elementwise, {8.0 * n, e * n, e * n})) return;
  if (ctx.device == Device::CPU) {
    std::vector<float> in_wide, out_wide;
    const float* x = host_floats(in, in_wide);
    float* y = host_output(out, out_wide);
    for (int64_t i = 0; i < n; i++) y[i] = gelu(x[i]);
    return store_rounded(out, out_wide);
  }
  with_elements(
      [&](auto* E) {
        gelu_forward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(typed(E, out.ptr),
                                                                      typed(E, in.ptr), n);
      },
      in.dtype);
  LAUNCH_CHECK(ctx, "gelu_forward_kernel");
}
void gelu_backward(const Context& ctx, const Tensor& din, const Tensor& dout, const Tensor& in) {
  check_devices(ctx, "gelu_backward", din, dout, in);
  const int64_t n = in.numel();
  PICO_ASSERT(din.numel() == n && dout.numel() == n && float_storage(in.dtype) &&
                  (dout.dtype == DType::F32 || dout.dtype == in.dtype) && din.dtype == dout.dtype,
              "gelu_backward: din and dout fp32, or in the input's format");
  const double e = (double)dtype_size(in.dtype), ge = (double)dtype_size(dout.dtype);
  if (count_op(ctx.device, OpKind::Elementwise, {12.0 * n, (e + ge) * n, ge * n})) return;
  if (ctx.device == Device::CPU) {
    std::vector<float> in_wide, dout_wide, din_wide;
    const float *x = host_floats(in, in_wide), *d = host_floats(dout, dout_wide);
    float* dx = host_output(din, din_wide);
    for (int64_t i = 0; i < n; i++) dx[i] = d[i] * gelu_grad(x[i]);
    return store_gradient(din, din_wide);
  }
  with_elements(
      [&](auto* E, auto* G) {
        gelu_backward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
            typed(G, din.ptr), typed(G, dout.ptr), typed(E, in.ptr), n);
      },
      in.dtype, dout.dtype);
  LAUNCH_CHECK(ctx, "gelu_backward_kernel");
}

// Dropout (Srivastava et al. 2014). Whether an element is kept is a hash of where it is in the
// run (DropoutSite: the seed, layer and site; the token: its sequence's number in the run and
// its position; the element's place in the token's row), never of which rank holds it or of
// a random stream's state: any layout draws the mask one process draws, and a recomputed
// forward draws it again. Kept elements are scaled by 1 / (1 - p); mask: 1 kept, 0 dropped.
uint64_t DropoutSite::key() const {
  return dropout_mix64(dropout_mix64(seed + 0x5eedull) +
                       (((uint64_t)(uint32_t)layer << 8) | (uint32_t)site));
}
uint32_t DropoutSite::threshold() const {  // p of 2^32, so that a draw below it drops
  return (uint32_t)std::min(4294967295.0, std::floor((double)p * 4294967296.0));
}
float DropoutSite::scale() const {
  return 1.0f / (1.0f - p);
}

// Row r of x [rows, D] is token (sequences[row0 + r], positions[row0 + r]); element (r, d) is
// keyed (token, d, 0).
template <typename E>
static __global__ void dropout_rows_kernel(E* y, uint8_t* mask, const E* x, uint64_t site,
                                           uint32_t threshold, float scale,
                                           const int32_t* sequences, const int32_t* positions,
                                           int64_t row0, int64_t n, int D) {
  GRID_STRIDE_LOOP(i, n) {
    const int64_t token = row0 + i / D;
    const bool keep =
        dropout_keeps(site, sequences[token], positions[token], (uint32_t)(i % D), 0, threshold);
    mask[i] = keep;
    store(y + i, keep ? widen(x[i]) * scale : 0.0f);
  }
}
void dropout_forward(const Context& ctx, const Tensor& y, const Tensor& mask, const Tensor& x,
                     const DropoutSite& site, const Tensor& sequences, const Tensor& positions,
                     int64_t row0) {
  check_devices(ctx, "dropout_forward", y, mask, x, sequences, positions);
  const int D = (int)x.size(-1);
  const int64_t n = x.numel(), rows = n / D;
  PICO_ASSERT(y.numel() == n && mask.numel() == n && mask.dtype == DType::U8 &&
                  y.dtype == x.dtype && float_storage(x.dtype) &&
                  sequences.numel() == positions.numel() && row0 + rows <= sequences.numel(),
              "dropout_forward: y and a U8 mask of x's shape " + x.shape_str() + ", rows " +
                  std::to_string(row0) + " + " + std::to_string(rows) + " of " +
                  std::to_string(sequences.numel()) + " tokens");
  const double e = (double)dtype_size(x.dtype);
  if (count_op(ctx.device, OpKind::Elementwise, {(double)n, e * n + 8.0 * rows, (e + 1) * n}))
    return;
  const uint64_t key = site.key();
  const uint32_t threshold = site.threshold();
  const float scale = site.scale();
  if (ctx.device == Device::CPU) {
    std::vector<float> x_wide, y_wide;
    const float* xv = host_floats(x, x_wide);
    float* yv = host_output(y, y_wide);
    const int32_t *seq = sequences.i32(), *pos = positions.i32();
    for (int64_t i = 0; i < n; i++) {
      const int64_t token = row0 + i / D;
      const bool keep = dropout_keeps(key, seq[token], pos[token], (uint32_t)(i % D), 0, threshold);
      mask.u8()[i] = keep;
      yv[i] = keep ? xv[i] * scale : 0.0f;
    }
    return store_rounded(y, y_wide);
  }
  if (n == 0) return;
  with_elements(
      [&](auto* E) {
        dropout_rows_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
            typed(E, y.ptr), mask.u8(), typed(E, x.ptr), key, threshold, scale, sequences.i32(),
            positions.i32(), row0, n, D);
      },
      x.dtype);
  LAUNCH_CHECK(ctx, "dropout_rows_kernel");
}

// probs [B, H, T, T] of this rank's heads head0 .. head0 + H - 1: element (b, h, i, j) is keyed
// (query token b T + i, head0 + h, key position). Above the diagonal every mask is 0.
static __global__ void dropout_attention_kernel(float* dropped, uint8_t* mask, const float* probs,
                                                uint64_t site, uint32_t threshold, float scale,
                                                const int32_t* sequences, const int32_t* positions,
                                                int H, int T, int head0, int64_t n) {
  GRID_STRIDE_LOOP(e, n) {
    const int j = (int)(e % T), i = (int)(e / T % T), h = (int)(e / ((int64_t)T * T) % H);
    const int64_t b = e / ((int64_t)T * T * H), q = b * T + i, k = b * T + j;
    const bool keep = j <= i && dropout_keeps(site, sequences[q], positions[q],
                                              (uint32_t)(head0 + h), positions[k], threshold);
    mask[e] = keep;
    dropped[e] = keep ? probs[e] * scale : 0.0f;
  }
}
void dropout_attention_forward(const Context& ctx, const Tensor& dropped, const Tensor& mask,
                               const Tensor& probs, const DropoutSite& site,
                               const Tensor& sequences, const Tensor& positions, int head0) {
  check_devices(ctx, "dropout_attention_forward", dropped, mask, probs, sequences, positions);
  const int T = (int)probs.size(3), H = (int)probs.size(1), B = (int)probs.size(0);
  const int64_t n = probs.numel();
  PICO_ASSERT(probs.dim() == 4 && dropped.numel() == n && mask.numel() == n &&
                  mask.dtype == DType::U8 && probs.dtype == DType::F32 &&
                  dropped.dtype == DType::F32 && sequences.numel() == (int64_t)B * T &&
                  positions.numel() == (int64_t)B * T,
              "dropout_attention_forward: probabilities " + probs.shape_str() +
                  " in fp32, a U8 mask, a sequence and position per token");
  if (count_op(ctx.device, OpKind::Attention, {(double)n, 4.0 * n + 16.0 * B * T, 5.0 * n})) return;
  const uint64_t key = site.key();
  const uint32_t threshold = site.threshold();
  const float scale = site.scale();
  if (ctx.device == Device::CPU) {
    const int32_t *seq = sequences.i32(), *pos = positions.i32();
    for (int64_t e = 0; e < n; e++) {
      const int j = (int)(e % T), i = (int)(e / T % T), h = (int)(e / ((int64_t)T * T) % H);
      const int64_t b = e / ((int64_t)T * T * H), q = b * T + i, k = b * T + j;
      const bool keep =
          j <= i && dropout_keeps(key, seq[q], pos[q], (uint32_t)(head0 + h), pos[k], threshold);
      mask.u8()[e] = keep;
      dropped.f32()[e] = keep ? probs.f32()[e] * scale : 0.0f;
    }
    return;
  }
  if (n == 0) return;
  dropout_attention_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
      dropped.f32(), mask.u8(), probs.f32(), key, threshold, scale, sequences.i32(),
      positions.i32(), H, T, head0, n);
  LAUNCH_CHECK(ctx, "dropout_attention_kernel");
}

// dx = dy * mask * scale: the backward of either dropout (dx may be dy).
template <typename E>
static __global__ void dropout_backward_kernel(E* dx, const E* dy, const uint8_t* mask, float scale,
                                               int64_t n) {
  GRID_STRIDE_LOOP(i, n) store(dx + i, mask[i] ? widen(dy[i]) * scale : 0.0f);
}
void dropout_backward(const Context& ctx, const Tensor& dx, const Tensor& dy, const Tensor& mask,
                      float p) {
  check_devices(ctx, "dropout_backward", dx, dy, mask);
  const int64_t n = dy.numel();
  PICO_ASSERT(dx.numel() == n && mask.numel() == n && mask.dtype == DType::U8 &&
                  dx.dtype == dy.dtype && float_storage(dy.dtype),
              "dropout_backward: dx and dy of one format, a U8 mask of their size");
  const double e = (double)dtype_size(dy.dtype);
  if (count_op(ctx.device, OpKind::Elementwise, {(double)n, (e + 1) * n, e * n})) return;
  const float scale = DropoutSite{0, 0, 0, p}.scale();
  if (ctx.device == Device::CPU) {
    std::vector<float> dy_wide, dx_wide;
    const float* d = host_floats(dy, dy_wide);
    float* out = host_output(dx, dx_wide);
    for (int64_t i = 0; i < n; i++) out[i] = mask.u8()[i] ? d[i] * scale : 0.0f;
    return store_gradient(dx, dx_wide);
  }
  if (n == 0) return;
  with_elements(
      [&](auto* E) {
        dropout_backward_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
            typed(E, dx.ptr), typed(E, dy.ptr), mask.u8(), scale, n);
      },
      dy.dtype);
  LAUNCH_CHECK(ctx, "dropout_backward_kernel");
}

// ============================================================================
// residual add, axpy, scale_: one elementwise out = alpha * a + beta * b
// ============================================================================

// out, a, b [n]; b may be null (then beta is unused). out may alias a or b.
static void axpby_cpu(float* out, float alpha, const float* a, float beta, const float* b,
                      int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = alpha * a[i] + (b ? beta * b[i] : 0.0f);
}

// B: b's storage, fp32 or a 16-bit format read widened (a layer's output in the compute format);
// O: out's and a's (fp32, or a 16-bit residual stream: each value rounded once as stored).
template <typename O, typename B>
static __global__ void axpby_kernel(O* out, float alpha, const O* a, float beta, const B* b,
                                    int64_t n) {
  GRID_STRIDE_LOOP(i, n) store(out + i, alpha * widen(a[i]) + (b ? beta * widen(b[i]) : 0.0f));
}

static void axpby(const Context& ctx, const Tensor& out, float alpha, const Tensor& a, float beta,
                  const Tensor* b) {
  check_devices(ctx, "residual/axpy/scale_", out, a);
  if (b) check_devices(ctx, "residual/axpy/scale_", *b);
  int64_t n = out.numel();
  PICO_ASSERT(a.numel() == n && (!b || b->numel() == n),
              "elementwise sizes differ: " + out.shape_str() + " vs " + a.shape_str());
  const DType tb = b ? b->dtype : DType::F32;
  PICO_ASSERT(out.dtype == a.dtype && float_storage(a.dtype) && float_storage(tb),
              "residual/axpy/scale_: out and a of one format, each fp32 or 16-bit");
  const double eb = b ? (double)dtype_size(tb) : 0.0, eo = (double)dtype_size(out.dtype);
  if (count_op(ctx.device, OpKind::Elementwise, {(b ? 3.0 : 1.0) * n, (eo + eb) * n, eo * n}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> b_wide, a_wide, out_wide;
    const float* bv = b ? host_floats(*b, b_wide) : nullptr;
    axpby_cpu(host_output(out, out_wide), alpha, host_floats(a, a_wide), beta, bv, n);
    return store_rounded(out, out_wide);
  }
  with_elements(
      [&](auto* O, auto* B) {
        axpby_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(
            typed(O, out.ptr), alpha, typed(O, a.ptr), beta, typed(B, b ? b->ptr : nullptr), n);
      },
      out.dtype, tb);
  LAUNCH_CHECK(ctx, "axpby_kernel");
}
void residual_forward(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  axpby(ctx, out, 1.0f, a, 1.0f, &b);
}
void axpy(const Context& ctx, const Tensor& y, float alpha, const Tensor& x) {
  axpby(ctx, y, 1.0f, y, alpha, &x);
}
void accumulate(const Context& ctx, const Tensor& acc, const Tensor& x) {
  if (acc.dtype == DType::F32 && x.dtype == DType::F32) return axpy(ctx, acc, 1.0f, x);
  Tensor sum = cast_to(ctx, acc, DType::F32);  // acc += x: added in fp32, rounded once
  axpy(ctx, sum, 1.0f, cast_to(ctx, x, DType::F32));
  cast_(ctx, acc, sum);
}
void scale_(const Context& ctx, const Tensor& x, float alpha) {
  axpby(ctx, x, alpha, x, 0.0f, nullptr);
}

// ============================================================================
// rows times weights, and row dot products (a mixture of experts' combine and its backward)
// ============================================================================

static void scale_rows_cpu(float* y, const float* x, const float* w, int64_t K, int64_t D) {
  for (int64_t k = 0; k < K; k++)
    for (int64_t d = 0; d < D; d++) y[k * D + d] = x[k * D + d] * w[k];
}
static void row_dots_cpu(float* out, const float* a, const float* b, int64_t K, int64_t D) {
  for (int64_t k = 0; k < K; k++) {
    float s = 0.0f;
    for (int64_t d = 0; d < D; d++) s += a[k * D + d] * b[k * D + d];
    out[k] = s;
  }
}
template <typename X>  // x in fp32, or in 16 bits (the experts' outputs as they came back)
static __global__ void scale_rows_kernel(float* y, const X* x, const float* w, int64_t K,
                                         int64_t D) {
  GRID_STRIDE_LOOP(i, K * D) y[i] = widen(x[i]) * w[i / D];
}
// One warp per row: lane l adds the products l, l + 32, ... (neighbouring lanes read
// neighbouring values, coalesced), then the warp's shuffles add the 32 partial sums. The order
// is the CPU loop's regrouped, and each multiply-add fused: equal within fp32's accuracy. b in
// fp32 or 16 bits (the experts' outputs as they came back), widened.
template <typename B>
static __global__ void row_dots_kernel(float* out, const float* a, const B* b, int64_t K,
                                       int64_t D) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = (int64_t)gridDim.x * blockDim.x / 32;
  // k is the same for the warp's 32 lanes: they leave the loop together, as the shuffles need.
  for (int64_t k = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; k < K; k += warps) {
    float s = 0.0f;
    for (int64_t d = lane; d < D; d += 32) s += a[k * D + d] * widen(b[k * D + d]);
    s = warp_reduce(s, false);
    if (lane == 0) out[k] = s;
  }
}
void scale_rows(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& w) {
  check_devices(ctx, "scale_rows", y, x, w);
  int64_t K = w.numel(), D = K > 0 ? x.numel() / K : 0;
  PICO_ASSERT(x.numel() == K * D && y.numel() == x.numel(),
              "scale_rows: " + y.shape_str() + " = " + x.shape_str() + " x " + w.shape_str());
  PICO_ASSERT(
      y.dtype == DType::F32 && float_storage(x.dtype) && (y.ptr != x.ptr || x.dtype == y.dtype),
      std::string("scale_rows: fp32 rows from ") + dtype_name(x.dtype) + " ones");
  if (count_op(ctx.device, OpKind::Elementwise,
               {(double)K * D, (double)K * D * dtype_size(x.dtype) + 4.0 * K, 4.0 * K * D}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> wide;  // 16-bit rows widened (exact)
    return scale_rows_cpu(y.f32(), host_floats(x, wide), w.f32(), K, D);
  }
  if (K * D == 0) return;
  with_element(x.dtype, [&](auto* X) {
    scale_rows_kernel<<<grid_for(K * D), kThreads, 0, ctx.stream>>>(y.f32(), typed(X, x.ptr),
                                                                    w.f32(), K, D);
  });
  LAUNCH_CHECK(ctx, "scale_rows_kernel");
}
void row_dots(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b) {
  check_devices(ctx, "row_dots", out, a, b);
  int64_t K = out.numel(), D = K > 0 ? a.numel() / K : 0;
  PICO_ASSERT(a.numel() == K * D && b.numel() == a.numel(),
              "row_dots: " + out.shape_str() + " from " + a.shape_str() + " . " + b.shape_str());
  PICO_ASSERT(out.dtype == DType::F32 && a.dtype == DType::F32 && float_storage(b.dtype),
              std::string("row_dots: fp32 dots of fp32 rows and ") + dtype_name(b.dtype) + " ones");
  if (count_op(ctx.device, OpKind::Elementwise,
               {2.0 * K * D, (4.0 + dtype_size(b.dtype)) * K * D, 4.0 * K}))
    return;
  if (ctx.device == Device::CPU) {
    std::vector<float> wide;  // 16-bit rows widened (exact)
    return row_dots_cpu(out.f32(), a.f32(), host_floats(b, wide), K, D);
  }
  if (K == 0) return;
  with_element(b.dtype, [&](auto* B) {
    row_dots_kernel<<<grid_for(32 * K), kThreads, 0, ctx.stream>>>(out.f32(), a.f32(),
                                                                   typed(B, b.ptr), K, D);
  });
  LAUNCH_CHECK(ctx, "row_dots_kernel");
}

// ============================================================================
// cross-entropy in passes: row max, sums, finish; the [T, V] probabilities are never stored.
// The vocabulary may be split (tensor_parallel.cu's vocab-parallel version all-reduces the max
// and the sums between the passes), so a target another rank holds is -1 here.
// ============================================================================

static void ce_row_max_cpu(float* row_max, const float* logits, int64_t N, int V) {
  for (int64_t t = 0; t < N; t++) {
    float m = -FLT_MAX;
    for (int v = 0; v < V; v++) m = std::max(m, logits[t * V + v]);
    row_max[t] = m;
  }
}
// sums [N, 2]: (sum of exponentials, target logit, 0 when another rank holds the target)
static void ce_row_sums_cpu(float* sums, const float* logits, const float* row_max,
                            const int32_t* targets, int64_t N, int V) {
  for (int64_t t = 0; t < N; t++) {
    PICO_ASSERT(targets[t] < V, "target " + std::to_string(targets[t]) +
                                    " outside the vocabulary of " + std::to_string(V));
    float s = 0;
    for (int v = 0; v < V; v++) s += expf(logits[t * V + v] - row_max[t]);
    sums[2 * t] = s;
    sums[2 * t + 1] = targets[t] >= 0 ? logits[t * V + targets[t]] : 0.0f;
  }
}
// losses [N] = log(sum) + max - target logit; stats [N, 2] = (max, sum) for the backward.
static void ce_finish_cpu(float* losses, float* stats, const float* row_max, const float* sums,
                          int64_t N) {
  for (int64_t t = 0; t < N; t++) {
    losses[t] = logf(sums[2 * t]) + row_max[t] - sums[2 * t + 1];
    stats[2 * t] = row_max[t], stats[2 * t + 1] = sums[2 * t];
  }
}
static void ce_backward_cpu(float* dlogits, const float* logits, const float* stats,
                            const int32_t* targets, int64_t N, int V, float scale) {
  for (int64_t t = 0; t < N; t++)
    for (int v = 0; v < V; v++) {
      float p = expf(logits[t * V + v] - stats[2 * t]) / stats[2 * t + 1];
      dlogits[t * V + v] = scale * (p - (v == targets[t] ? 1.0f : 0.0f));
    }
}

// One block per row: a block reduction over the row. E: the logits' storage (fp32, or the
// compute format mixed precision's LM head writes them in), read widened.
template <typename E>
static __global__ void ce_row_max_kernel(float* row_max, const E* logits, int V) {
  const E* row = logits + (int64_t)blockIdx.x * V;
  float m = -FLT_MAX;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, widen(row[v]));
  m = block_reduce(m, true);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}
template <typename E>
static __global__ void ce_row_sums_kernel(float* sums, const E* logits, const float* row_max,
                                          const int32_t* targets, int V) {
  const E* row = logits + (int64_t)blockIdx.x * V;
  float s = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += expf(widen(row[v]) - row_max[blockIdx.x]);
  s = block_reduce(s, false);
  if (threadIdx.x == 0) {
    int target = targets[blockIdx.x];  // no assert on the GPU: past V reads a wrong logit
    sums[2 * blockIdx.x] = s;
    sums[2 * blockIdx.x + 1] = target >= 0 && target < V ? widen(row[target]) : 0.0f;
  }
}
// A thread per token: the losses stay on the device until the caller sums them.
static __global__ void ce_finish_kernel(float* losses, float* stats, const float* row_max,
                                        const float* sums, int64_t N) {
  for (int64_t t = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; t < N;
       t += (int64_t)gridDim.x * blockDim.x) {
    losses[t] = logf(sums[2 * t]) + row_max[t] - sums[2 * t + 1];
    stats[2 * t] = row_max[t], stats[2 * t + 1] = sums[2 * t];
  }
}
// The three passes in one, on the GPU path where the vocabulary is whole (as llm.c's and
// Liger's fused cross-entropy): one read of the logits. Each thread keeps the online softmax's
// running maximum and its sum of exp(x - max), rescaled when the maximum grows (FlashAttention's
// rule, here along the vocabulary); the block takes the row's maximum M, then the sum of each
// thread's sum rescaled to M. The same loss and statistics as the passes, summed in another
// order.
template <typename E>
static __global__ void ce_forward_fused_kernel(float* losses, float* stats, const E* logits,
                                               const int32_t* targets, int V) {
  const E* row = logits + (int64_t)blockIdx.x * V;
  float m = -FLT_MAX, s = 0.0f;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = widen(row[v]);
    if (x > m)
      s = s * expf(m - x) + 1.0f, m = x;
    else
      s += expf(x - m);
  }
  const float M = block_reduce(m, true), S = block_reduce(s * expf(m - M), false);
  if (threadIdx.x == 0) {
    const int target = targets[blockIdx.x];  // as ce_row_sums_kernel: no assert on the GPU
    const float t = target >= 0 && target < V ? widen(row[target]) : 0.0f;
    losses[blockIdx.x] = logf(S) + M - t;
    stats[2 * blockIdx.x] = M, stats[2 * blockIdx.x + 1] = S;
  }
}
// The gradient in the logits' storage: a 16-bit one is rounded once as it is stored (the LM
// head's GEMMs read nothing finer).
template <typename E>
static __global__ void ce_backward_kernel(E* dlogits, const E* logits, const float* stats,
                                          const int32_t* targets, int V, float scale) {
  int64_t t = blockIdx.x;
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    float p = expf(widen(logits[t * V + v]) - stats[2 * t]) / stats[2 * t + 1];
    store(dlogits + t * V + v, scale * (p - (v == targets[t] ? 1.0f : 0.0f)));
  }
}

// The logits as fp32 values for the CPU loops: themselves, or a 16-bit tensor widened (exact).
static const float* logits_f32(const Tensor& logits, std::vector<float>& wide) {
  if (logits.dtype == DType::F32) return logits.f32();
  wide = widened(logits);
  return wide.data();
}

// N == 0 launches nothing (a zero-block grid is an error).
void cross_entropy_row_max(const Context& ctx, const Tensor& row_max, const Tensor& logits) {
  int64_t N = logits.size(0);
  int V = (int)logits.size(1);
  check_devices(ctx, "cross_entropy_row_max", row_max, logits);
  const double e = (double)dtype_size(logits.dtype);
  if (count_op(ctx.device, OpKind::Loss, {(double)N * V, e * N * V, 4.0 * N})) return;
  std::vector<float> wide;
  if (ctx.device == Device::CPU)
    return ce_row_max_cpu(row_max.f32(), logits_f32(logits, wide), N, V);
  if (N == 0) return;
  with_element(logits.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    ce_row_max_kernel<<<N, kThreads, 0, ctx.stream>>>(row_max.f32(), (const E*)logits.ptr, V);
  });
  LAUNCH_CHECK(ctx, "ce_row_max_kernel");
}
void cross_entropy_row_sums(const Context& ctx, const Tensor& sums, const Tensor& logits,
                            const Tensor& row_max, const Tensor& targets) {
  int64_t N = logits.size(0);
  int V = (int)logits.size(1);
  check_devices(ctx, "cross_entropy_row_sums", sums, logits, row_max, targets);
  PICO_ASSERT(targets.numel() == N && sums.numel() == 2 * N,
              "cross_entropy_row_sums: " + std::to_string(targets.numel()) +
                  " targets for logits " + logits.shape_str());
  const double e = (double)dtype_size(logits.dtype);
  if (count_op(ctx.device, OpKind::Loss, {3.0 * N * V, e * N * V + 8.0 * N, 8.0 * N})) return;
  std::vector<float> wide;
  if (ctx.device == Device::CPU)
    return ce_row_sums_cpu(sums.f32(), logits_f32(logits, wide), row_max.f32(), targets.i32(), N,
                           V);
  if (N == 0) return;
  with_element(logits.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    ce_row_sums_kernel<<<N, kThreads, 0, ctx.stream>>>(sums.f32(), (const E*)logits.ptr,
                                                       row_max.f32(), targets.i32(), V);
  });
  LAUNCH_CHECK(ctx, "ce_row_sums_kernel");
}
void cross_entropy_finish(const Context& ctx, const Tensor& losses, const Tensor& stats,
                          const Tensor& row_max, const Tensor& sums) {
  int64_t N = row_max.numel();
  check_devices(ctx, "cross_entropy_finish", losses, stats, row_max, sums);
  if (count_op(ctx.device, OpKind::Loss, {2.0 * N, 12.0 * N, 12.0 * N})) return;
  if (ctx.device == Device::CPU)
    return ce_finish_cpu(losses.f32(), stats.f32(), row_max.f32(), sums.f32(), N);
  if (N == 0) return;
  ce_finish_kernel<<<grid_for(N), kThreads, 0, ctx.stream>>>(losses.f32(), stats.f32(),
                                                             row_max.f32(), sums.f32(), N);
  LAUNCH_CHECK(ctx, "ce_finish_kernel");
}
void cross_entropy_backward(const Context& ctx, const Tensor& dlogits, const Tensor& logits,
                            const Tensor& stats, const Tensor& targets, float scale) {
  int64_t N = logits.size(0);
  int V = (int)logits.size(1);
  check_devices(ctx, "cross_entropy_backward", dlogits, logits, stats, targets);
  PICO_ASSERT(dlogits.numel() == logits.numel() && dlogits.dtype == logits.dtype,
              "cross_entropy_backward " + dlogits.shape_str() + " in the logits' dtype");
  const double e = (double)dtype_size(logits.dtype);
  if (count_op(ctx.device, OpKind::Loss, {4.0 * N * V, e * N * V + 12.0 * N, e * N * V})) return;
  if (ctx.device == Device::CPU) {
    if (logits.dtype == DType::F32)
      return ce_backward_cpu(dlogits.f32(), logits.f32(), stats.f32(), targets.i32(), N, V, scale);
    std::vector<float> wide = widened(logits);
    ce_backward_cpu(wide.data(), wide.data(), stats.f32(), targets.i32(), N, V, scale);
    return cast_gradient_host(dlogits.ptr, dlogits.dtype, wide.data(), N * V);  // counted
  }
  if (N == 0) return;
  with_element(logits.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    ce_backward_kernel<<<N, kThreads, 0, ctx.stream>>>((E*)dlogits.ptr, (const E*)logits.ptr,
                                                       stats.f32(), targets.i32(), V, scale);
  });
  LAUNCH_CHECK(ctx, "ce_backward_kernel");
}

// One op on every device, as the fused kernel is one launch with one read of the logits: the CPU
// runs the three passes' loops (the reference the kernels meet) under that one count, so its
// ledger is the GPU's.
void cross_entropy_forward(const Context& ctx, const Tensor& losses, const Tensor& stats,
                           const Tensor& logits, const Tensor& targets) {
  const int64_t N = logits.size(0);
  const int V = (int)logits.size(1);
  check_devices(ctx, "cross_entropy_forward", losses, stats, logits, targets);
  PICO_ASSERT(targets.numel() == N && losses.numel() == N && stats.numel() == 2 * N,
              "cross_entropy_forward: " + std::to_string(targets.numel()) + " targets for logits " +
                  logits.shape_str());
  const double e = (double)dtype_size(logits.dtype);
  if (count_op(ctx.device, OpKind::Loss, {4.0 * N * V, e * N * V + 4.0 * N, 12.0 * N})) return;
  if (ctx.device == Device::CPU) {
    std::vector<float> wide, row_max((size_t)N), sums((size_t)(2 * N));
    const float* x = logits_f32(logits, wide);
    ce_row_max_cpu(row_max.data(), x, N, V);
    ce_row_sums_cpu(sums.data(), x, row_max.data(), targets.i32(), N, V);
    return ce_finish_cpu(losses.f32(), stats.f32(), row_max.data(), sums.data(), N);
  }
  if (N == 0) return;
  with_element(logits.dtype, [&](auto* type) {
    using E = std::remove_pointer_t<decltype(type)>;
    ce_forward_fused_kernel<<<N, kThreads, 0, ctx.stream>>>(losses.f32(), stats.f32(),
                                                            (const E*)logits.ptr, targets.i32(), V);
  });
  LAUNCH_CHECK(ctx, "ce_forward_fused_kernel");
}
void cross_entropy_forward(const Context& ctx, const Tensor& losses, const Tensor& logits,
                           const Tensor& targets) {
  Tensor stats = empty(ctx, {logits.numel() / logits.size(-1), 2}, Mem::Workspace);
  cross_entropy_forward(ctx, losses, stats, logits.reshape({stats.size(0), logits.size(-1)}),
                        targets);
}
void cross_entropy_backward(const Context& ctx, const Tensor& dlogits, const Tensor& logits,
                            const Tensor& targets, float scale) {
  const int64_t N = logits.numel() / logits.size(-1), V = logits.size(-1);
  Tensor losses = empty(ctx, {N}, Mem::Workspace), stats = empty(ctx, {N, 2}, Mem::Workspace);
  cross_entropy_forward(ctx, losses, stats, logits.reshape({N, V}), targets);
  cross_entropy_backward(ctx, dlogits.reshape({N, V}), logits.reshape({N, V}), stats, targets,
                         scale);
}

// ============================================================================
// reductions: sum and sum of squares, fp32, result on the host
// ============================================================================

// Blocked fp32 sum: each 256-element chunk is summed alone and the chunk sums are added, so the
// rounding error grows like 256 + n/256 additions instead of n (close to the GPU's tree).
// A bf16 value is the top half of an fp32 one: widening is a shift, exact on both devices.
__host__ __device__ static inline float load_value(const void* x, int64_t i, bool bf16) {
  if (!bf16) return ((const float*)x)[i];
#ifdef __CUDA_ARCH__
  return __uint_as_float((uint32_t)((const uint16_t*)x)[i] << 16);
#else
  uint32_t bits = (uint32_t)((const uint16_t*)x)[i] << 16;
  float v;
  memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
static float sum_cpu(const void* x, int64_t n, bool squares, bool bf16) {
  float total = 0.0f;
  for (int64_t start = 0; start < n; start += 256) {
    float chunk = 0.0f;
    for (int64_t i = start; i < std::min<int64_t>(n, start + 256); i++) {
      const float v = load_value(x, i, bf16);
      chunk += squares ? v * v : v;
    }
    total += chunk;
  }
  return total;
}

// Several tensors in one launch. Tensor j owns grid_for(n_j) consecutive blocks from
// first_block[j] and walks its elements grid-stride over just those blocks, so its partials
// do not depend on the other tensors: one tensor alone, or among many, sums bitwise the same.
// The tensors' pointers and sizes come in one device array.
struct SumItem {
  const void* x;  // [n] fp32, or bf16 (gradients kept in bf16)
  int64_t n;
  bool bf16;
  int64_t first_block;  // the first of this tensor's blocks; blocks are numbered tensor by tensor
};
// Of `count` items whose blocks are numbered item by item (each knows its first_block), the one
// that holds this block: a binary search.
template <typename Item>
static __device__ int item_of_block(const Item* items, int count) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (items[mid].first_block <= (int64_t)blockIdx.x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}
static __global__ void sum_many_kernel(float* partials, const SumItem* items, int count,
                                       bool squares) {
  const SumItem item = items[item_of_block(items, count)];
  int64_t block = blockIdx.x - item.first_block, blocks = grid_for_device(item.n);
  float acc = 0.0f;
  for (int64_t i = block * blockDim.x + threadIdx.x; i < item.n; i += blocks * blockDim.x) {
    const float v = load_value(item.x, i, item.bf16);
    acc += squares ? v * v : v;
  }
  acc = block_reduce(acc, false);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}
// totals[j] = the sum of tensor j's partials: one block per tensor, a fixed tree (no atomics).
static __global__ void sum_partials_kernel(float* totals, const float* partials,
                                           const SumItem* items) {
  const SumItem item = items[blockIdx.x];
  int64_t blocks = grid_for_device(item.n);
  float acc = 0.0f;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) acc += partials[item.first_block + b];
  acc = block_reduce(acc, false);
  if (threadIdx.x == 0) totals[blockIdx.x] = acc;
}

// The sums of several tensors, each reduced on its own, with one trip to the host for all of
// them (the gradient norm needs one per parameter tensor: one round trip each would stall the
// GPU that many times per step). On CUDA: one kernel over every tensor's blocks, one small
// kernel for the per-tensor totals, one copy to the host. No atomics: the same inputs give
// bitwise the same sums, whatever the block scheduling.
// The sums' kernels, queued on ctx.stream (CUDA, xs not empty): the workspace returned holds
// the totals in its last xs.size() floats once they have run.
static Tensor launch_sums(const Context& ctx, const std::vector<Tensor>& xs, bool squares) {
  std::vector<SumItem> items(xs.size());  // [count]
  int64_t blocks = 0;
  for (size_t j = 0; j < xs.size(); j++) {
    items[j] = {xs[j].ptr, xs[j].numel(), xs[j].dtype == DType::BF16, blocks};
    blocks += grid_for(xs[j].numel());
  }
  PICO_ASSERT(blocks <= INT32_MAX && xs.size() <= INT32_MAX, "sum: too many tensors at once");
  // One workspace: [items | partials [blocks] | totals [count]], items first (8-byte aligned).
  int64_t item_floats = (int64_t)(items.size() * sizeof(SumItem) / sizeof(float));
  Tensor buffer = empty(ctx, {item_floats + blocks + (int64_t)xs.size()}, Mem::Workspace);
  SumItem* device_items = (SumItem*)buffer.ptr;
  float *partials = buffer.f32() + item_floats, *device_totals = partials + blocks;
  from_host(ctx, buffer.view(0, {item_floats}), items.data());  // pinned: the host goes on
  sum_many_kernel<<<(unsigned)blocks, kThreads, 0, ctx.stream>>>(partials, device_items,
                                                                 (int)xs.size(), squares);
  LAUNCH_CHECK(ctx, "sum_many_kernel");
  sum_partials_kernel<<<(unsigned)xs.size(), kThreads, 0, ctx.stream>>>(device_totals, partials,
                                                                        device_items);
  LAUNCH_CHECK(ctx, "sum_partials_kernel");
  return buffer;
}
// Each tensor's checks, then its op counted: one kernel over every tensor's blocks, one for the
// totals, a host copy each way. True on the meta device (no value).
static bool count_sums(const Context& ctx, const std::vector<Tensor>& xs, bool squares) {
  double elements = 0, bytes = 0;
  for (const Tensor& x : xs) {
    check_devices(ctx, "sum", x);
    PICO_ASSERT(x.dtype == DType::F32 || x.dtype == DType::BF16, "sum of " + x.shape_str());
    elements += x.numel(), bytes += x.nbytes();
  }
  return count_op(ctx.device, OpKind::Optimizer,
                  {(squares ? 2.0 : 1.0) * elements, bytes, 4.0 * xs.size(), xs.empty() ? 0 : 2});
}
static std::vector<float> reduce_each(const Context& ctx, const std::vector<Tensor>& xs,
                                      bool squares) {
  count_host_sync();  // the results go to the host: on CUDA the host waits for the stream
  std::vector<float> totals(xs.size());
  if (count_sums(ctx, xs, squares)) {
    std::fill(totals.begin(), totals.end(), NAN);  // the meta device: no value, absent
    return totals;
  }
  if (ctx.device == Device::CPU) {
    for (size_t i = 0; i < xs.size(); i++)
      totals[i] = sum_cpu(xs[i].ptr, xs[i].numel(), squares, xs[i].dtype == DType::BF16);
    return totals;
  }
  if (xs.empty()) return totals;
  Tensor buffer = launch_sums(ctx, xs, squares);
  // The sums done (within the bound), then read: the copy into pageable memory finds them there.
  synchronize_stream(ctx.stream, "a reduction's sums");
  CUDA_CHECK(cudaMemcpy(totals.data(), buffer.f32() + buffer.numel() - xs.size(),
                        xs.size() * sizeof(float), cudaMemcpyDeviceToHost));
  return totals;
}
static float reduce(const Context& ctx, const Tensor& x, bool squares) {
  return reduce_each(ctx, {x}, squares)[0];
}
float sum(const Context& ctx, const Tensor& x) {
  return reduce(ctx, x, false);
}
float sum_squares(const Context& ctx, const Tensor& x) {
  return reduce(ctx, x, true);
}
std::vector<float> sum_squares_each(const Context& ctx, const std::vector<Tensor>& xs) {
  return reduce_each(ctx, xs, true);
}
PendingSum sum_later(const Context& ctx, const Tensor& x) {
  PendingSum s;
  s.pending = true;
  if (count_sums(ctx, {x}, false)) {
    s.value = NAN;  // the meta device: no value, absent
  } else if (ctx.device == Device::CPU) {
    s.value = sum_cpu(x.ptr, x.numel(), false, x.dtype == DType::BF16);
  } else {
    Tensor buffer = launch_sums(ctx, {x}, false);
    s.total = buffer.view(buffer.numel() - 1, {1});  // holds the workspace until read
  }
  return s;
}
double read_total(const Context& ctx, const std::vector<PendingSum>& sums) {
  bool pending = false, on_device = false;
  for (const PendingSum& s : sums) pending |= s.pending, on_device |= s.total.defined();
  if (pending) count_host_sync();  // the totals come to the host: the host waits for the stream
  if (on_device) synchronize_stream(ctx.stream, "the losses' sums");
  double total = 0;
  for (const PendingSum& s : sums) {
    float value = s.value;
    if (s.total.defined())  // done: the copy into pageable memory finds it there
      CUDA_CHECK(cudaMemcpy(&value, s.total.ptr, sizeof(float), cudaMemcpyDeviceToHost));
    total += value;
  }
  return total;
}

// ============================================================================
// AdamW (Loshchilov & Hutter 2019); m and v are the optimizer state of Playbook §2.3
// ============================================================================

// p, g, m, v [n]. bc1 = 1 - beta1^step and bc2 = 1 - beta2^step come in from the host.
// Weight decay is decoupled: it shrinks p directly instead of entering the moments.
// The compute copy, when there is one, gets the new weight rounded (dtype.cuh's conversions).
static void adamw_cpu(float* p, const float* g, float* m, float* v, int64_t n, AdamWConfig cfg,
                      float lr, float wd, float bc1, float bc2, uint16_t* copy, bool bf16) {
  for (int64_t i = 0; i < n; i++) {
    m[i] = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * g[i];
    v[i] = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * g[i] * g[i];
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= lr * (mhat / (sqrtf(vhat) + cfg.eps) + wd * p[i]);
    if (copy) copy[i] = bf16 ? float_to_bf16(p[i]) : float_to_fp16(p[i]);
  }
}

static __device__ void adamw_element(int64_t i, float* p, const float* g, float* m, float* v,
                                     const AdamWConfig& cfg, float lr, float wd, float bc1,
                                     float bc2, uint16_t* copy, bool bf16) {
  m[i] = cfg.beta1 * m[i] + (1.0f - cfg.beta1) * g[i];
  v[i] = cfg.beta2 * v[i] + (1.0f - cfg.beta2) * g[i] * g[i];
  float mhat = m[i] / bc1, vhat = v[i] / bc2;
  p[i] -= lr * (mhat / (sqrtf(vhat) + cfg.eps) + wd * p[i]);
  if (copy)  // cast_'s conversions (cvt.rn), so the copy is bit for bit a cast of p
    copy[i] = bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(p[i]))
                   : __half_as_ushort(__float2half_rn(p[i]));
}
static __global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                                    AdamWConfig cfg, float lr, float wd, float bc1, float bc2,
                                    uint16_t* copy, bool bf16) {
  GRID_STRIDE_LOOP(i, n) adamw_element(i, p, g, m, v, cfg, lr, wd, bc1, bc2, copy, bf16);
}

// 1 - beta^step, once, in double, so both devices divide by the same float (step counts from 1).
static float bias_correction(float beta, int step) {
  PICO_ASSERT(step >= 1, "adamw: step counts from 1, got " + std::to_string(step));
  return (float)(1.0 - std::pow((double)beta, step));
}

void adamw_update(const Context& ctx, float* p, const float* g, float* m, float* v, int64_t n,
                  const AdamWConfig& cfg, float lr, float weight_decay, int step,
                  const Tensor& copy) {
  PICO_ASSERT(!copy.defined() || ((copy.dtype == DType::BF16 || copy.dtype == DType::F16) &&
                                  copy.numel() == n && copy.device == ctx.device),
              "adamw_update: a compute copy is " + std::to_string(n) + " bf16 or fp16 values");
  const float bc1 = bias_correction(cfg.beta1, step), bc2 = bias_correction(cfg.beta2, step);
  uint16_t* half = copy.defined() ? (uint16_t*)copy.ptr : nullptr;
  const bool bf16 = copy.dtype == DType::BF16;
  if (count_op(ctx.device, OpKind::Optimizer, {15.0 * n, 16.0 * n, (half ? 14.0 : 12.0) * n}))
    return;
  if (ctx.device == Device::CPU)
    return adamw_cpu(p, g, m, v, n, cfg, lr, weight_decay, bc1, bc2, half, bf16);
  adamw_kernel<<<grid_for(n), kThreads, 0, ctx.stream>>>(p, g, m, v, n, cfg, lr, weight_decay, bc1,
                                                         bc2, half, bf16);
  LAUNCH_CHECK(ctx, "adamw_kernel");
}

// Many slices in one launch (the multi-tensor AdamW of apex, PyTorch's foreach / fused AdamW
// and llm.c): one kernel over every slice's blocks, numbered slice by slice, each block finding
// its slice by binary search, as sum_many_kernel does. A step then launches one kernel where it
// launched one per parameter, and each element's arithmetic is adamw_kernel's.
struct AdamWItem {
  float* p;
  const float* g;
  float *m, *v;
  int64_t n;
  float wd;
  uint16_t* copy;
  int64_t first_block;
};
static __global__ void adamw_many_kernel(const AdamWItem* items, int count, AdamWConfig cfg,
                                         float lr, float bc1, float bc2, bool bf16) {
  const AdamWItem it = items[item_of_block(items, count)];
  int64_t block = blockIdx.x - it.first_block, blocks = grid_for_device(it.n);
  for (int64_t i = block * blockDim.x + threadIdx.x; i < it.n; i += blocks * blockDim.x)
    adamw_element(i, it.p, it.g, it.m, it.v, cfg, lr, it.wd, bc1, bc2, it.copy, bf16);
}

void adamw_update_many(const Context& ctx, const std::vector<AdamWSlice>& slices,
                       const AdamWConfig& cfg, float lr, int step, DType copy_dtype) {
  PICO_ASSERT(copy_dtype == DType::BF16 || copy_dtype == DType::F16,
              "adamw_update_many: compute copies are bf16 or fp16");
  const float bc1 = bias_correction(cfg.beta1, step), bc2 = bias_correction(cfg.beta2, step);
  const bool bf16 = copy_dtype == DType::BF16;
  double n = 0, copied = 0;
  for (const AdamWSlice& s : slices) {
    n += s.n;
    if (s.copy) copied += s.n;
  }
  if (count_op(ctx.device, OpKind::Optimizer,
               {15.0 * n, 16.0 * n, 12.0 * n + 2.0 * copied, slices.empty() ? 0 : 1}))
    return;
  if (ctx.device == Device::CPU) {
    for (const AdamWSlice& s : slices)
      adamw_cpu(s.p, s.g, s.m, s.v, s.n, cfg, lr, s.weight_decay, bc1, bc2, s.copy, bf16);
    return;
  }
  if (slices.empty()) return;
  std::vector<AdamWItem> items(slices.size());
  int64_t blocks = 0;
  for (size_t j = 0; j < slices.size(); j++) {
    const AdamWSlice& s = slices[j];
    items[j] = {s.p, s.g, s.m, s.v, s.n, s.weight_decay, s.copy, blocks};
    blocks += grid_for(s.n);
  }
  PICO_ASSERT(blocks <= INT32_MAX && slices.size() <= INT32_MAX, "adamw: too many slices at once");
  Tensor buffer =
      empty(ctx, {(int64_t)(items.size() * sizeof(AdamWItem) / sizeof(float))}, Mem::Workspace);
  from_host(ctx, buffer, items.data());  // pinned: the host goes on
  adamw_many_kernel<<<(unsigned)blocks, kThreads, 0, ctx.stream>>>(
      (const AdamWItem*)buffer.ptr, (int)items.size(), cfg, lr, bc1, bc2, bf16);
  LAUNCH_CHECK(ctx, "adamw_many_kernel");
}

// ============================================================================
// CPU threads
// ============================================================================

int cpu_workers(int items) {
  return std::max(1, std::min(openblas_get_num_threads(), items));
}

void run_on_cpu_workers(int items, int workers,
                        const std::function<void(int item, int worker)>& fn) {
  int saved = openblas_get_num_threads();
  openblas_set_num_threads(1);
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; w++)
    pool.emplace_back([&, w] {
      for (int i = w; i < items; i += workers) fn(i, w);
    });
  for (int i = 0; i < items; i += workers) fn(i, 0);
  for (std::thread& t : pool) t.join();
  openblas_set_num_threads(saved);
}
