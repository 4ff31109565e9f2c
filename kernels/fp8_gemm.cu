// fp8_gemm.cu: real FP8 GEMMs for the linear layers (Playbook §FP8 pretraining), the way
// DeepSeek-V3 trains: each operand is quantized to FP8 in tiles with one fp32 scale each (1 x 128
// for activations and gradients, 128 x 128 for weights, both along the contraction; for the
// weight gradient, which contracts over the tokens, 128 tokens x 1), the tensor cores multiply the
// FP8 values, and each 128-long block of a dot product is multiplied by its two scales before it
// joins the fp32 sum. cuBLAS 12.9 added this GEMM for Hopper ("VEC128" and "BLK128x128"
// scales); mixed_precision.cu emulates it wherever it is not available.
//
// The idea to take away: FP8 is only the storage of the GEMM's inputs. The per-tile scales are
// what make 3 (E4M3) or 2 (E5M2) mantissa bits enough, and the sums stay fp32.
#include <cublasLt.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "kernels/fp8_gemm.cuh"
#include "runtime/dtype.cuh"

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

// ----------------------------------------------------------------------------
// Quantization on the GPU (the CPU loops above)

// Where element (r, c) of a matrix sits: at r * row + c * col.
struct Strides {
  int64_t row, col;
};

// The quantize kernels' shared pieces: a warp's largest value (every lane gets it), and one
// value in FP8 as the CPU loop stores it (e4m3 saturates at 448, satfinite; e5m2 cannot reach
// its overflow, see quantize_tiles).
__device__ inline float warp_max(float m) {
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}
__device__ inline uint8_t to_fp8(float y, DType format) {
  return format == DType::F8E4M3 ? __nv_cvt_float_to_fp8(y, __NV_SATFINITE, __NV_E4M3)
                                 : __nv_cvt_float_to_fp8(y, __NV_NOSAT, __NV_E5M2);
}

// One block per tile: its absmax, its scale absmax / largest, and each element as
// fp8(x / scale), with the CPU's fp32 operations (so bytes and scales agree bit for bit; a max is
// exact in any order). x [rows, cols] is read through x_at (transposed operands take the kernel
// below); q is row-major [rows, cols]; tile (i, j)'s scale goes to scales[i * s_at.row + j *
// s_at.col]: our [tiles down, tiles across] layout, or the one cuBLASLt reads.
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
  m = warp_max(m);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = m;
  __syncthreads();
  m = 0.0f;
  for (int w = 0; w < (int)blockDim.x / 32; w++) m = fmaxf(m, partial[w]);
  const float s = m > 0.0f ? m / largest : 1.0f;  // an all-zero tile keeps scale 1
  if (threadIdx.x == 0) scales[i * s_at.row + j * s_at.col] = s;
  for (int64_t k = threadIdx.x; k < tr * tc; k += blockDim.x) {
    const int64_t r = r0 + k / tc, c = c0 + k % tc;
    q[r * cols + c] = to_fp8(x[r * x_at.row + c * x_at.col] / s, format);
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

// The 1 x 128 tiles of a row-major x (the activations' and gradients' tiles): a warp per tile,
// four values a lane, each warp load 32 consecutive floats, where the kernel above gives a block
// of 256 threads to 128 values. The same fp32 operations, so the same bytes and scales.
constexpr int kTilesPerBlock = 8;  // warps
__global__ void quantize_rows_kernel(uint8_t* q, float* scales, Strides s_at, const float* x,
                                     int64_t rows, int64_t cols, DType format, float largest) {
  const int64_t tiles_across = (cols + 127) / 128;
  const int64_t tile = (int64_t)blockIdx.x * kTilesPerBlock + threadIdx.x / 32;
  if (tile >= rows * tiles_across) return;  // (the whole warp)
  const int lane = threadIdx.x % 32;
  const int64_t i = tile / tiles_across, j = tile % tiles_across;
  float v[4], m = 0.0f;
  for (int e = 0; e < 4; e++) {
    const int64_t c = j * 128 + lane + 32 * e;
    v[e] = c < cols ? x[i * cols + c] : 0.0f;
    m = fmaxf(m, fabsf(v[e]));
  }
  m = warp_max(m);
  const float s = m > 0.0f ? m / largest : 1.0f;  // an all-zero tile keeps scale 1
  if (lane == 0) scales[i * s_at.row + j * s_at.col] = s;
  for (int e = 0; e < 4; e++) {
    const int64_t c = j * 128 + lane + 32 * e;
    if (c < cols) q[i * cols + c] = to_fp8(v[e] / s, format);
  }
}

static void launch_quantize(const Context& ctx, const Tensor& q, float* scales, Strides s_at,
                            const float* x, Strides x_at, int tile_rows, int tile_cols) {
  const int64_t rows = q.size(0), cols = q.size(1);
  const int64_t tiles = ((rows + tile_rows - 1) / tile_rows) * ((cols + tile_cols - 1) / tile_cols);
  if (tiles == 0) return;
  if (tile_rows == 1 && tile_cols == 128 && x_at.row == cols && x_at.col == 1) {
    quantize_rows_kernel<<<(unsigned)((tiles + kTilesPerBlock - 1) / kTilesPerBlock),
                           32 * kTilesPerBlock, 0, ctx.stream>>>(
        (uint8_t*)q.ptr, scales, s_at, x, rows, cols, q.dtype, max_finite(q.dtype));
    LAUNCH_CHECK(ctx, "quantize_rows_kernel");
    return;
  }
  quantize_tiles_kernel<<<(unsigned)tiles, 256, 0, ctx.stream>>>(
      (uint8_t*)q.ptr, scales, s_at, x, x_at, rows, cols, tile_rows, tile_cols, q.dtype,
      max_finite(q.dtype));
  LAUNCH_CHECK(ctx, "quantize_tiles_kernel");
}

// The transposed operands (the dgrad's W^T, the wgrad's dy^T and x^T): q [n, K] holds the
// tiles of x^T for x [K, n] row-major. Read through the generic kernel's strides, a warp's 32
// loads of one tile row lie n floats apart: 32 memory transactions for 32 values. Here a block
// takes x's rows [c0, c0 + 128) (q's columns, one tile along K) and columns [r0, r0 + 128) (q's
// rows) and stages them 32 columns at a time in shared memory, each warp load 32 consecutive
// floats (one transaction); each warp then writes rows of q from it, 32 consecutive bytes per
// store. The fp32 operations are the generic kernel's, so the bytes and scales are the same.
constexpr int kPanel = 32;  // q rows staged at a time
__global__ void quantize_transposed_kernel(uint8_t* q, float* scales, Strides s_at, const float* x,
                                           int64_t n, int64_t K, int tile_rows, DType format,
                                           float largest) {
  __shared__ float panel[128][kPanel + 1];  // [x row][q row]; +1: no bank conflict either way
  __shared__ float partial[8];
  const int64_t c0 = (int64_t)blockIdx.x * 128, r0 = (int64_t)blockIdx.y * 128;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;  // 8 warps
  auto at = [&](int64_t c, int64_t r) { return c < K && r < n ? x[c * n + r] : 0.0f; };
  float tile_scale = 1.0f;
  if (tile_rows == 128) {  // one scale for the whole 128 x 128 tile: its absmax, in x's order
    float m = 0.0f;
    for (int e = threadIdx.x; e < 128 * 128; e += blockDim.x)
      m = fmaxf(m, fabsf(at(c0 + e / 128, r0 + e % 128)));
    m = warp_max(m);
    if (lane == 0) partial[warp] = m;
    __syncthreads();
    m = 0.0f;
    for (int w = 0; w < (int)blockDim.x / 32; w++) m = fmaxf(m, partial[w]);
    tile_scale = m > 0.0f ? m / largest : 1.0f;  // an all-zero tile keeps scale 1
    if (threadIdx.x == 0) scales[blockIdx.y * s_at.row + blockIdx.x * s_at.col] = tile_scale;
  }
  for (int p = 0; p < 128; p += kPanel) {
    __syncthreads();  // the panel before is written out
    for (int i = warp; i < 128; i += blockDim.x / 32) panel[i][lane] = at(c0 + i, r0 + p + lane);
    __syncthreads();
    for (int j = warp; j < kPanel; j += blockDim.x / 32) {  // q row r0 + p + j, for the warp
      const int64_t r = r0 + p + j;
      float s = tile_scale;
      if (tile_rows == 1) {  // the row's own 1 x 128 tile: lane holds columns lane + 32 k
        float m = 0.0f;
        for (int k = 0; k < 4; k++) m = fmaxf(m, fabsf(panel[lane + 32 * k][j]));
        m = warp_max(m);
        s = m > 0.0f ? m / largest : 1.0f;
        if (lane == 0 && r < n) scales[r * s_at.row + blockIdx.x * s_at.col] = s;
      }
      if (r >= n) continue;  // (the same r for the whole warp)
      for (int k = 0; k < 4; k++) {
        const int64_t c = c0 + lane + 32 * k;
        if (c < K) q[r * K + c] = to_fp8(panel[lane + 32 * k][j] / s, format);
      }
    }
  }
}

// q [n, K] and its scales (at s_at) from x [K, n], tiles tile_rows x 128 of x^T.
static void launch_quantize_transposed(const Context& ctx, const Tensor& q, float* scales,
                                       Strides s_at, const float* x, int tile_rows) {
  const int64_t n = q.size(0), K = q.size(1);
  if (n == 0 || K == 0) return;
  const dim3 grid((unsigned)((K + 127) / 128), (unsigned)((n + 127) / 128));
  quantize_transposed_kernel<<<grid, 256, 0, ctx.stream>>>((uint8_t*)q.ptr, scales, s_at, x, n, K,
                                                           tile_rows, q.dtype, max_finite(q.dtype));
  LAUNCH_CHECK(ctx, "quantize_transposed_kernel");
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
  if (count_op(ctx.device, OpKind::Cast,
               {0, (double)x.nbytes(), (double)(q.nbytes() + scales.nbytes())}))
    return;
  if (ctx.device == Device::CPU) return quantize_tiles(q, scales, x, tile_rows, tile_cols);
  check_tiles_on_gpu(q, scales, x, tile_rows, tile_cols);
  launch_quantize(ctx, q, scales.f32(), {scales.size(1), 1}, x.f32(), {x.size(1), 1}, tile_rows,
                  tile_cols);
}

void dequantize_tiles_on(const Context& ctx, const Tensor& x, const Tensor& q, const Tensor& scales,
                         int tile_rows, int tile_cols) {
  if (count_op(ctx.device, OpKind::Cast,
               {0, (double)(q.nbytes() + scales.nbytes()), (double)x.nbytes()}))
    return;
  if (ctx.device == Device::CPU) return dequantize_tiles(x, q, scales, tile_rows, tile_cols);
  check_tiles_on_gpu(q, scales, x, tile_rows, tile_cols);
  const int64_t n = x.numel();
  if (n == 0) return;
  dequantize_tiles_kernel<<<(unsigned)((n + 255) / 256), 256, 0, ctx.stream>>>(
      x.f32(), (const uint8_t*)q.ptr, scales.f32(), x.size(0), x.size(1), tile_rows, tile_cols,
      q.dtype);
  LAUNCH_CHECK(ctx, "dequantize_tiles_kernel");
}

void quantize_tiles_transposed_on(const Context& ctx, const Tensor& q, const Tensor& scales,
                                  const Tensor& x, int tile_rows) {
  PICO_ASSERT(x.dim() == 2 && (tile_rows == 1 || tile_rows == 128),
              "quantize_tiles_transposed_on: x " + x.shape_str() + ", tiles " +
                  std::to_string(tile_rows) + " x 128");
  const int64_t K = x.size(0), n = x.size(1);
  if (count_op(ctx.device, OpKind::Cast,
               {0, (double)x.nbytes(), (double)(q.nbytes() + scales.nbytes())}))
    return;
  if (ctx.device == Device::CPU) {
    Tensor xt = empty({n, K}, Mem::Workspace);
    for (int64_t r = 0; r < n; r++)
      for (int64_t c = 0; c < K; c++) xt.f32()[r * K + c] = x.f32()[c * n + r];
    return quantize_tiles(q, scales, xt, tile_rows, 128);
  }
  const std::vector<int64_t> want = {(n + tile_rows - 1) / tile_rows, (K + 127) / 128};
  PICO_ASSERT(x.dtype == DType::F32 && (q.dtype == DType::F8E4M3 || q.dtype == DType::F8E5M2) &&
                  q.shape == std::vector<int64_t>({n, K}) && scales.dtype == DType::F32 &&
                  scales.shape == want,
              "quantize_tiles_transposed_on: q " + q.shape_str() + ", scales " +
                  scales.shape_str() + " for x^T, x " + x.shape_str());
  launch_quantize_transposed(ctx, q, scales.f32(), {scales.size(1), 1}, x.f32(), tile_rows);
}

void fake_quantize_tiles_(const Context& ctx, const Tensor& x, DType format, int tile_rows,
                          int tile_cols) {
  PICO_ASSERT(x.dim() == 2 && x.dtype == DType::F32, "fake_quantize_tiles_ of " + x.shape_str());
  const int64_t rows = x.size(0), cols = x.size(1);
  if (rows == 0 || cols == 0) return;
  Tensor q = empty(ctx, x.shape, Mem::Workspace, format);
  Tensor scales =
      empty(ctx, {(rows + tile_rows - 1) / tile_rows, (cols + tile_cols - 1) / tile_cols},
            Mem::Workspace);
  quantize_tiles_on(ctx, q, scales, x, tile_rows, tile_cols);
  dequantize_tiles_on(ctx, x, q, scales, tile_rows, tile_cols);
}

// ----------------------------------------------------------------------------
// The block-scaled GEMM (cuBLASLt; cuBLAS docs, "128-element 1D and 128x128 2D block scaling")
//
// cuBLASLt is column-major, so as in gemm (ops.cu) the row-major d [rows, cols] is read as the
// column-major D (M = cols) x (N = rows), and D = op(A) op(B) with A = b, B = a:
//   A: b's FP8 bytes, row-major [cols, K] = column-major K x M, transposed (op T)
//   B: a's FP8 bytes, row-major [rows, K] = column-major K x N, as it is (op N)
// Hopper's FP8 GEMM takes only this "TN" form: both operands K-major, as our tiles run (a
// transposed operand is quantized into a K-major copy). The scales, as cuBLASLt reads them:
//   1 x 128 (VEC128_32F): n-major, [ceil(K/128)][n] for an operand of n rows: the transpose of
//     our [n, ceil(K/128)]; n must be a multiple of 4
//   128 x 128 (BLK128x128_32F): K-major, [ceil(n/128)][L4], L4 = ceil(K/128) rounded up to a
//     multiple of 4: our layout with each row padded to L4
// Of the pairs, BLK x BLK is the one not supported (VEC x VEC, the wgrad's, VEC x BLK and BLK x
// VEC are); of the FP8 types, E5M2 x E5M2. D is fp32 (bf16 and fp16 are the others), and C = D,
// so beta accumulates in fp32 and the caller rounds the result exactly as the emulation does.

// What cuBLASLt answered for one shape on one device.
struct Fp8Plan {
  bool supported = false;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  std::string why;  // when not supported
};
// The answer depends on the device, the library, the shape and d's alignment, never on the
// Context: one table per process, like cuBLAS's own heuristics cache. Key: device, rows, cols, K,
// the formats and tiles of a and b, and d's alignment.
static std::map<std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int, uint32_t>, Fp8Plan>
    g_plans;
// The largest power of two up to 256 that divides p's address. cuBLASLt's heuristic assumes 256
// unless told otherwise, and d is often a view into a packed buffer (a weight's gradient among
// the model's): an algorithm chosen for 256 may fault or refuse on it.
static uint32_t alignment_of(const void* p) {
  uint32_t a = 256;
  while ((uintptr_t)p % a) a /= 2;
  return a;
}
static Fp8GemmCounts g_counts;

Fp8GemmCounts fp8_gemm_counts() {
  return g_counts;
}

void print_fp8_gemm_counts(const Context& ctx) {
  if (ctx.precision != Precision::FP8 || ctx.device != Device::CUDA) return;
  const Fp8GemmCounts n = fp8_gemm_counts();  // forward, dgrad and wgrad GEMMs
  printf("fp8 GEMMs on rank 0: %llu native (cuBLASLt block-scaled), %llu emulated\n",
         (unsigned long long)n.native, (unsigned long long)n.emulated);
}

void require_fp8_tensor_cores() {
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major * 10 + minor < 89)
    throw UsageError(
        "--dtype fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); "
        "this GPU is " +
        std::to_string(major) + "." + std::to_string(minor) +
        ": use --dtype bf16, or --device cpu to simulate fp8");
}

template <class T>
static void set_attribute(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t what, T value) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, what, &value, sizeof(value)));
}

// The descriptors of one call: the operation (scale modes and pointers, fp32 compute, no fast
// accumulation: each 128-long block is promoted to fp32) and the layouts of A, B and D (= C);
// a_op and b_op are the operands cuBLASLt calls A and B.
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  LtGemm(int64_t M, int64_t N, int64_t K, const Fp8Operand& a_op, const Fp8Operand& b_op,
         const float* a_scales, const float* b_scales) {
    auto type = [](const Fp8Operand& o) {
      return o.format == DType::F8E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
    };
    auto scale_mode = [](const Fp8Operand& o) -> int32_t {
      return o.tiles == Fp8Tiles::Block128 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                           : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    };
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, scale_mode(a_op));
    set_attribute<int32_t>(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, scale_mode(b_op));
    set_attribute<const void*>(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scales);
    set_attribute<const void*>(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scales);
    set_attribute<int8_t>(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, 0);
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, type(a_op), K, M, K));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&b, type(b_op), K, N, K));
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

// d_alignment: of C and D (the same buffer); A and B are fresh buffers of the device's allocator
// (256-byte aligned, cuBLASLt's default).
static Fp8Plan find_plan(const Context& ctx, const LtGemm& g, uint32_t d_alignment) {
  Fp8Plan plan;
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const size_t max_workspace = 32u << 20;  // what cuBLAS recommends on Hopper
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &max_workspace, sizeof(max_workspace)));
  for (cublasLtMatmulPreferenceAttributes_t cd :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, cd, &d_alignment, sizeof(d_alignment)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic((cublasLtHandle_t)ctx.cublas, g.op, g.a,
                                                           g.b, g.d, g.d, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
    plan.why = std::string("cuBLASLt has no block-scaled FP8 algorithm for it (") +
               cublasGetStatusName(st) + ", " + std::to_string(found) + " found)";
    return plan;
  }
  plan.supported = true, plan.algo = result.algo, plan.workspace = result.workspaceSize;
  return plan;
}

// One operand in FP8: its bytes [n, K] and its scales where cuBLASLt reads them (above). The
// scale of tile (i, j) of our [n / tile rows, K / 128] grid sits at i * row + j * col of scales_at.
struct Fp8Bytes {
  Tensor q, scales;
  Strides scales_at;
};

static Fp8Bytes fp8_buffers(const Context& ctx, const Fp8Operand& o, int64_t n, int64_t K) {
  const int64_t k_blocks = (K + 127) / 128, k_blocks4 = (k_blocks + 3) / 4 * 4;
  Tensor q = empty(ctx, {n, K}, Mem::Workspace, o.format);  // [n, K]
  if (o.tiles == Fp8Tiles::Block128)                        // [n/128, L4], the padding zeroed
    return {q, zeros(ctx, {(n + 127) / 128, k_blocks4}, Mem::Workspace), {k_blocks4, 1}};
  return {q, empty(ctx, {k_blocks, n}, Mem::Workspace), {1, n}};  // [K/128, n]
}

// What the ledger counts for one FP8 GEMM, on the meta device and on CUDA alike: each operand
// quantized (4 bytes read, 1 written and its scales), then the GEMM on the 8-bit tensor cores.
static OpCost quantize_cost(int64_t n, int64_t K) {
  return {0, 4.0 * n * K, 1.0 * n * K + 4.0 * n * K / 128};
}
static OpCost gemm_cost(int64_t rows, int64_t cols, int64_t K, float beta) {
  OpCost c{2.0 * rows * cols * K, 1.0 * (rows + cols) * K, (beta != 0 ? 8.0 : 4.0) * rows * cols};
  c.unit = MathUnit::Tensor8;
  c.narrow = (double)std::min({rows, cols, K});
  c.m = rows;
  c.n = cols;
  c.k = K;
  return c;
}

// The operand's tiles along K, read in place: [n, K], or [K, n] transposed. A transposed
// operand's tiles are the tiles of what it was given, transposed: the same absmax, scale and
// bytes (W^T's 128 x 128 tiles are W's; the wgrad's 1 x 128 tiles of x^T are 128 x 1 tiles of x).
static void quantize_operand(const Context& ctx, const Fp8Bytes& bytes, const Fp8Operand& o) {
  const int64_t n = bytes.q.size(0), K = bytes.q.size(1);
  const int tile_rows = o.tiles == Fp8Tiles::Block128 ? 128 : 1;
  count_op(ctx.device, OpKind::Cast, quantize_cost(n, K));
  if (o.transposed)
    return launch_quantize_transposed(ctx, bytes.q, bytes.scales.f32(), bytes.scales_at,
                                      o.values.f32(), tile_rows);
  launch_quantize(ctx, bytes.q, bytes.scales.f32(), bytes.scales_at, o.values.f32(), {K, 1},
                  tile_rows, 128);
}

bool fp8_gemm(const Context& ctx, const Tensor& d, const Fp8Operand& a, const Fp8Operand& b,
              float beta, std::string* why) {
  const int64_t rows = d.size(0), cols = d.size(1);
  const int64_t K = a.values.size(a.transposed ? 0 : 1);
  auto shape_of = [&](const Fp8Operand& o, int64_t n) {
    return o.transposed ? std::vector<int64_t>{K, n} : std::vector<int64_t>{n, K};
  };
  auto fp8 = [](DType t) { return t == DType::F8E4M3 || t == DType::F8E5M2; };
  PICO_ASSERT(d.dim() == 2 && a.values.dim() == 2 && a.values.shape == shape_of(a, rows) &&
                  b.values.shape == shape_of(b, cols) && a.values.dtype == DType::F32 &&
                  b.values.dtype == DType::F32 && d.dtype == DType::F32 && fp8(a.format) &&
                  fp8(b.format),
              "fp8_gemm: d " + d.shape_str() + " = a " + a.values.shape_str() + " . b " +
                  b.values.shape_str());
  PICO_ASSERT(!(a.tiles == Fp8Tiles::Block128 && b.tiles == Fp8Tiles::Block128) &&
                  !(a.format == DType::F8E5M2 && b.format == DType::F8E5M2),
              "fp8_gemm: cuBLASLt pairs neither two 128 x 128 operands nor two E5M2 ones");
  const std::string shape = "[" + std::to_string(rows) + ", " + std::to_string(K) + "] x [" +
                            std::to_string(K) + ", " + std::to_string(cols) + "]: ";
  auto decline = [&](const std::string& reason) {
    g_counts.emulated++;
    if (why) *why = shape + reason;
    return false;
  };
  if (!gpu_path(ctx.device)) return decline("not on a CUDA device");
  // cuBLASLt's 1 x 128 scales come in rows of 16 bytes (n a multiple of 4), and FP8 rows of K
  // bytes must start 16-byte aligned; so must d's rows.
  if (rows % 4 || cols % 4 || K % 16 || (uintptr_t)d.ptr % 16 || rows * cols * K == 0)
    return decline("rows and cols must be multiples of 4, K of 16 (none 0), d 16-byte aligned");
  if (ctx.device == Device::Meta) {  // as on Hopper: both operands quantized, one FP8 GEMM
    count_op(ctx.device, OpKind::Cast, quantize_cost(rows, K));
    count_op(ctx.device, OpKind::Cast, quantize_cost(cols, K));
    count_op(ctx.device, OpKind::Gemm, gemm_cost(rows, cols, K, beta));
    g_counts.native++;
    return true;
  }
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const uint32_t d_alignment = alignment_of(d.ptr);
  const auto key = std::make_tuple(device, rows, cols, K, (int)a.format, (int)b.format,
                                   (int)a.tiles, (int)b.tiles, d_alignment);
  auto known = g_plans.find(key);
  if (known == g_plans.end()) {  // asked before any descriptor: an older library lacks its modes
    Fp8Plan missing;
    missing.why = block_scaling_missing(device);
    if (!missing.why.empty()) known = g_plans.emplace(key, missing).first;
  }
  if (known != g_plans.end() && !known->second.supported) return decline(known->second.why);

  const Fp8Bytes aq = fp8_buffers(ctx, a, rows, K), bq = fp8_buffers(ctx, b, cols, K);
  const LtGemm g(cols, rows, K, b, a, bq.scales.f32(), aq.scales.f32());  // A = b, B = a
  if (known == g_plans.end()) known = g_plans.emplace(key, find_plan(ctx, g, d_alignment)).first;
  Fp8Plan& plan = known->second;
  if (!plan.supported) return decline(plan.why);

  quantize_operand(ctx, aq, a);
  quantize_operand(ctx, bq, b);
  Tensor workspace;
  if (plan.workspace > 0)
    workspace = empty(ctx, {(int64_t)(plan.workspace + 3) / 4}, Mem::Workspace);
  const float alpha = 1.0f;
  // Counted before the launch, so that the ledger's clock gives the GEMM its own time (a
  // refusal below, once per shape at most, leaves this count beside the emulation's).
  count_op(ctx.device, OpKind::Gemm, gemm_cost(rows, cols, K, beta));
  const cublasStatus_t st = cublasLtMatmul((cublasLtHandle_t)ctx.cublas, g.op, &alpha, bq.q.ptr,
                                           g.a, aq.q.ptr, g.b, &beta, d.ptr, g.d, d.ptr, g.d,
                                           &plan.algo, workspace.ptr, plan.workspace, ctx.stream);
  if (st != CUBLAS_STATUS_SUCCESS) {
    // Any refusal (NOT_SUPPORTED, or INVALID_VALUE, ARCH_MISMATCH... from a library or driver
    // that reads these descriptors otherwise): nothing ran and d is untouched, so the caller
    // emulates, now and for this shape after, rather than stopping the run. A launch error
    // left behind is cuBLASLt's, not the next kernel's: cleared.
    cudaGetLastError();
    plan.supported = false;
    plan.why = std::string("cuBLASLt's matmul returned ") + cublasGetStatusName(st) + " (" +
               std::to_string((int)st) + ") for the algorithm its heuristic chose";
    return decline(plan.why);
  }
  g_counts.native++;
  return true;
}
