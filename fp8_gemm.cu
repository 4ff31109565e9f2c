// fp8_gemm.cu: real FP8 GEMMs for the linear layers (Playbook §FP8 pretraining), the way
// DeepSeek-V3 trains: each operand is quantized to FP8 in tiles with one fp32 scale each (1 x 128
// for activations and gradients, 128 x 128 for weights), the tensor cores multiply the FP8
// values, and each 128-long block of a dot product is multiplied by its two scales before it
// joins the fp32 sum. cuBLAS 12.9 added this GEMM for Hopper ("VEC128" and "BLK128x128"
// scales); mixed_precision.cu emulates it wherever it is not available.
//
// The idea to take away: FP8 is only the storage of the GEMM's inputs. The per-tile scales are
// what make 3 (E4M3) or 2 (E5M2) mantissa bits enough, and the sums stay fp32.
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <map>
#include <tuple>

#include "fp8_gemm.cuh"
#include "mixed_precision.cuh"

// ----------------------------------------------------------------------------
// Quantization on the GPU (the CPU loops: quantize_tiles, dequantize_tiles in mixed_precision.cu)

// Where element (r, c) of a matrix sits: at r * row + c * col.
struct Strides {
  int64_t row, col;
};

// One block per tile: its absmax, its scale absmax / largest, and each element as
// fp8(x / scale), with the CPU's fp32 operations (so bytes and scales agree bit for bit; a max is
// exact in any order). x [rows, cols] is read through x_at, so a transposed view costs no copy;
// q is row-major [rows, cols]; tile (i, j)'s scale goes to scales[i * s_at.row + j * s_at.col]:
// our [tiles down, tiles across] layout, or the one cuBLASLt reads.
__global__ void quantize_tiles_kernel(uint8_t* q, float* scales, Strides s_at, const float* x,
                                      Strides x_at, int64_t rows, int64_t cols, int tile_rows,
                                      int tile_cols, DType format, float largest) {
  const int64_t tiles_across = (cols + tile_cols - 1) / tile_cols;
  const int64_t i = blockIdx.x / tiles_across, j = blockIdx.x % tiles_across;
  const int64_t r0 = i * tile_rows, c0 = j * tile_cols;
  const int64_t tr = min((int64_t)tile_rows, rows - r0), tc = min((int64_t)tile_cols, cols - c0);
  __shared__ float partial[32];
  float m = 0.0f;
  for (int64_t k = threadIdx.x; k < tr * tc; k += blockDim.x)
    m = fmaxf(m, fabsf(x[(r0 + k / tc) * x_at.row + (c0 + k % tc) * x_at.col]));
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.0f;
  for (int w = 0; w < (int)blockDim.x / 32; w++) m = fmaxf(m, partial[w]);
  const float s = m > 0.0f ? m / largest : 1.0f;  // an all-zero tile keeps scale 1
  if (threadIdx.x == 0) scales[i * s_at.row + j * s_at.col] = s;
  // e4m3 saturates at 448 (satfinite); e5m2 cannot reach its overflow (see quantize_tiles).
  const __nv_fp8_interpretation_t fmt = format == DType::F8E4M3 ? __NV_E4M3 : __NV_E5M2;
  const __nv_saturation_t sat = format == DType::F8E4M3 ? __NV_SATFINITE : __NV_NOSAT;
  for (int64_t k = threadIdx.x; k < tr * tc; k += blockDim.x) {
    const int64_t r = r0 + k / tc, c = c0 + k % tc;
    q[r * cols + c] = __nv_cvt_float_to_fp8(x[r * x_at.row + c * x_at.col] / s, sat, fmt);
  }
}

// x = q * its tile's scale, one thread per element (scales in our layout).
__global__ void dequantize_tiles_kernel(float* x, const uint8_t* q, const float* scales,
                                        int64_t rows, int64_t cols, int tile_rows, int tile_cols,
                                        DType format) {
  const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= rows * cols) return;
  const int64_t r = n / cols, c = n % cols, tiles_across = (cols + tile_cols - 1) / tile_cols;
  const __nv_fp8_interpretation_t fmt = format == DType::F8E4M3 ? __NV_E4M3 : __NV_E5M2;
  const float value = __half2float(__half(__nv_cvt_fp8_to_halfraw(q[n], fmt)));  // exact
  x[n] = value * scales[r / tile_rows * tiles_across + c / tile_cols];
}

static void launch_quantize(const Context& ctx, const Tensor& q, float* scales, Strides s_at,
                            const float* x, Strides x_at, int tile_rows, int tile_cols) {
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t tiles = ((rows + tile_rows - 1) / tile_rows) * ((cols + tile_cols - 1) / tile_cols);
  if (tiles == 0) return;
  quantize_tiles_kernel<<<(unsigned)tiles, 256, 0, ctx.stream>>>(
      (uint8_t*)q.ptr, scales, s_at, x, x_at, rows, cols, tile_rows, tile_cols, q.dtype,
      max_finite(q.dtype));
  LAUNCH_CHECK(ctx, "quantize_tiles_kernel");
}

static void check_tiles_on_gpu(const Tensor& q, const Tensor& scales, const Tensor& x,
                               int tile_rows, int tile_cols) {
  PICO_ASSERT(x.dim() == 2 && x.dtype == DType::F32 && scales.dtype == DType::F32 &&
                  (q.dtype == DType::F8E4M3 || q.dtype == DType::F8E5M2) && q.shape == x.shape,
              "tile scaling: F32 " + x.shape_str() + " and an FP8 tensor of that shape");
  const std::vector<int64_t> want = {(x.size(0) + tile_rows - 1) / tile_rows,
                                     (x.size(1) + tile_cols - 1) / tile_cols};
  PICO_ASSERT(scales.shape == want, "scales " + scales.shape_str() + " for " + x.shape_str());
}

void quantize_tiles_on(const Context& ctx, const Tensor& q, const Tensor& scales, const Tensor& x,
                       int tile_rows, int tile_cols) {
  if (ctx.device == Device::CPU) return quantize_tiles(q, scales, x, tile_rows, tile_cols);
  check_tiles_on_gpu(q, scales, x, tile_rows, tile_cols);
  launch_quantize(ctx, q, scales.f32(), {scales.size(1), 1}, x.f32(), {x.size(1), 1}, tile_rows,
                  tile_cols);
}

void dequantize_tiles_on(const Context& ctx, const Tensor& x, const Tensor& q, const Tensor& scales,
                         int tile_rows, int tile_cols) {
  if (ctx.device == Device::CPU) return dequantize_tiles(x, q, scales, tile_rows, tile_cols);
  check_tiles_on_gpu(q, scales, x, tile_rows, tile_cols);
  const int64_t n = x.numel();
  if (n == 0) return;
  dequantize_tiles_kernel<<<(unsigned)((n + 255) / 256), 256, 0, ctx.stream>>>(
      x.f32(), (const uint8_t*)q.ptr, scales.f32(), x.size(0), x.size(1), tile_rows, tile_cols,
      q.dtype);
  LAUNCH_CHECK(ctx, "dequantize_tiles_kernel");
}

// ----------------------------------------------------------------------------
// The block-scaled GEMM (cuBLASLt; cuBLAS docs, "128-element 1D and 128x128 2D block scaling")
//
// cuBLASLt is column-major, so as in gemm (ops.cu) the row-major d [rows, cols] is read as the
// column-major D (M = cols) x (N = rows), and D = op(A) op(B) with A = w, B = x:
//   A: w's FP8 bytes, row-major [cols, K] = column-major K x M, transposed (op T)
//   B: x's FP8 bytes, row-major [rows, K] = column-major K x N, as it is (op N)
// Hopper's FP8 GEMM takes only this "TN" form: both operands K-major, as our tiles run.
// The scales, as cuBLASLt reads them:
//   B's 1 x 128 scales (VEC128_32F): N-major, [ceil(K/128)][N]: the transpose of our
//     [rows, ceil(K/128)]; N must be a multiple of 4
//   A's 128 x 128 scales (BLK128x128_32F): K-major, [ceil(M/128)][L4], L4 = ceil(K/128) rounded
//     up to a multiple of 4: our layout with each row padded to L4
// Of the pairs, BLK x BLK is the one not supported; of the FP8 types, E5M2 x E5M2 (we pair
// E4M3 weights with E4M3 or E5M2). D is fp32 (bf16 and fp16 are the others), and C = D, so
// beta accumulates in fp32 and the caller rounds the result exactly as the emulation does.

// What cuBLASLt answered for one shape on one device.
struct Fp8Plan {
  bool supported = false;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  std::string why;  // when not supported
};
// The answer depends on the device, the library and the shape, never on the Context: one table
// per process, like cuBLAS's own heuristics cache. Key: device, rows, cols, K, x's format.
static std::map<std::tuple<int, int64_t, int64_t, int64_t, int>, Fp8Plan> g_plans;
static Fp8GemmCounts g_counts;

Fp8GemmCounts fp8_gemm_counts() {
  return g_counts;
}

template <class T>
static void set_attribute(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t what, T value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, what, &value, sizeof(value)));
}

// The descriptors of one call: the operation (scale modes and pointers, fp32 compute, no fast
// accumulation: each 128-long block is promoted to fp32) and the layouts of A, B and D (= C).
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  LtGemm(int64_t M, int64_t N, int64_t K, cudaDataType b_type, const float* a_scales,
         const float* b_scales) {
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                           CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                           CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
    set_attribute<const void*>(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scales);
    set_attribute<const void*>(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scales);
    set_attribute<int8_t>(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, 0);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, K, M, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, b_type, K, N, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d, CUDA_R_32F, M, N, M));
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(d), cublasLtMatrixLayoutDestroy(b), cublasLtMatrixLayoutDestroy(a);
    cublasLtMatmulDescDestroy(op);
  }
};

// The device and library can run block-scaled FP8 at all: empty, else why not.
static std::string block_scaling_missing(int device) {
  int major = 0, minor = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 9)
    return "compute capability " + std::to_string(major) + "." + std::to_string(minor) +
           ": block-scaled FP8 GEMMs need 9.0 (Hopper)";
  const size_t version = cublasLtGetVersion();  // the library loaded, not the headers
  if (version < 120900)
    return "cuBLASLt " + std::to_string(version) + " predates block-scaled FP8 (12.9)";
  return "";
}

static Fp8Plan find_plan(const Context& ctx, const LtGemm& g, int device) {
  Fp8Plan plan;
  plan.why = block_scaling_missing(device);
  if (!plan.why.empty()) return plan;
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t max_workspace = 32u << 20;  // what cuBLAS recommends on Hopper
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &max_workspace, sizeof(max_workspace)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)ctx.cublas, g.op, g.a,
                                                           g.b, g.d, g.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    plan.why = "cuBLASLt has no block-scaled FP8 algorithm for it (status " +
               std::to_string((int)st) + ", " + std::to_string(found) + " found)";
    return plan;
  }
  plan.supported = true, plan.algo = result.algo, plan.workspace = result.workspaceSize;
  return plan;
}

bool fp8_gemm(const Context& ctx, const Tensor& d, const Tensor& x, DType x_format, const Tensor& w,
              bool w_transposed, float beta, std::string* why) {
  const int64_t rows = x.size(0), K = x.size(1), cols = d.size(1);
  const std::vector<int64_t> w_shape =
      w_transposed ? std::vector<int64_t>{K, cols} : std::vector<int64_t>{cols, K};
  PICO_ASSERT(x.dim() == 2 && d.shape == std::vector<int64_t>({rows, cols}) && w.shape == w_shape &&
                  x.dtype == DType::F32 && w.dtype == DType::F32 && d.dtype == DType::F32 &&
                  (x_format == DType::F8E4M3 || x_format == DType::F8E5M2),
              "fp8_gemm: d " + d.shape_str() + " = x " + x.shape_str() + " . w " + w.shape_str());
  const std::string shape = "[" + std::to_string(rows) + ", " + std::to_string(K) + "] x [" +
                            std::to_string(K) + ", " + std::to_string(cols) + "]: ";
  auto decline = [&](const std::string& reason) {
    g_counts.emulated++;
    if (why) *why = shape + reason;
    return false;
  };
  if (ctx.device != Device::CUDA) return decline("not on a CUDA device");
  // cuBLASLt's scales come in rows of 16 bytes (N a multiple of 4), and FP8 rows of K bytes
  // must start 16-byte aligned; so must d's rows.
  if (rows % 4 || cols % 4 || K % 16 || (uintptr_t)d.ptr % 16 || rows * cols * K == 0)
    return decline("rows and cols must be multiples of 4, K of 16 (none 0), d 16-byte aligned");
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, rows, cols, K, (int)x_format);
  auto known = g_plans.find(key);
  if (known != g_plans.end() && !known->second.supported) return decline(known->second.why);

  // The operands in FP8, the scales where cuBLASLt reads them (the weight's padding zeroed).
  const int64_t k_blocks = (K + 127) / 128, k_blocks4 = (k_blocks + 3) / 4 * 4;
  Tensor xq = empty(ctx, {rows, K}, Mem::Workspace, x_format);                    // [N, K]
  Tensor x_scales = empty(ctx, {k_blocks, rows}, Mem::Workspace);                 // [K/128, N]
  Tensor wq = empty(ctx, {cols, K}, Mem::Workspace, DType::F8E4M3);               // [M, K]
  Tensor w_scales = zeros(ctx, {(cols + 127) / 128, k_blocks4}, Mem::Workspace);  // [M/128, L4]
  const LtGemm g(cols, rows, K, x_format == DType::F8E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2,
                 w_scales.f32(), x_scales.f32());
  if (known == g_plans.end()) known = g_plans.emplace(key, find_plan(ctx, g, device)).first;
  Fp8Plan& plan = known->second;
  if (!plan.supported) return decline(plan.why);

  launch_quantize(ctx, xq, x_scales.f32(), {1, rows}, x.f32(), {K, 1}, 1, 128);
  // W^T's 128 x 128 tiles are W's tiles transposed: same absmax, same scale, same bytes.
  launch_quantize(ctx, wq, w_scales.f32(), {k_blocks4, 1}, w.f32(),
                  w_transposed ? Strides{1, cols} : Strides{K, 1}, 128, 128);
  Tensor workspace;
  if (plan.workspace > 0)
    workspace = empty(ctx, {(int64_t)(plan.workspace + 3) / 4}, Mem::Workspace);
  const float alpha = 1.0f;
  const cublasStatus_t st =
      cublasLtMatmul((cublasLtHandle_t)ctx.cublas, g.op, &alpha, wq.ptr, g.a, xq.ptr, g.b, &beta,
                     d.ptr, g.d, d.ptr, g.d, &plan.algo, workspace.ptr, plan.workspace, ctx.stream);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED) {  // d untouched: the caller emulates, now and after
    plan.supported = false;
    plan.why = "cuBLASLt declined the algorithm its heuristic chose (NOT_SUPPORTED)";
    return decline(plan.why);
  }
  CUBLAS_CHECK(st);
  g_counts.native++;
  return true;
}
