// matmul_ladder.cu: the GPU chapter's matrix multiplication, rung by rung (Playbook §12.2-12.5),
// C = A B with A [M, K], B [K, N], C [M, N] row-major. Each kernel changes one thing from the
// one before and says why in the book's words: who reads which address (coalescing), what is
// read twice from HBM (tiling), how many shared-memory reads each multiply-add costs
// (coarsening), and which unit does the multiply-adds (tensor cores). The one idea: a matmul is
// limited by how fast its operands arrive, so each rung moves the same arithmetic closer to the
// data. First the CPU references, then the kernels, then the dispatchers; bench/bench_matmul.cu
// times every rung against cuBLAS, tests/test_matmul_ladder.cu holds each to its reference.
// Guide: docs/gpu-kernels.md.
#include <cmath>
#include <string>

#include "kernels/matmul_ladder.cuh"
#include "kernels/tensor_core.cuh"
#include "runtime/dtype.cuh"

// ============================================================================
// The rungs, as the chapter tells them
// ============================================================================

static const std::vector<MatmulRungInfo> kRungs = {
    {MatmulRung::Naive, "naive",
     "one thread per output, a warp's threads on consecutive rows: every load is a different "
     "row, K floats apart (uncoalesced)",
     "the starting point", 0.0},
    {MatmulRung::Coalesced, "coalesced",
     "a warp's threads on consecutive columns of one row: B's loads are one burst, A's one "
     "broadcast",
     "~10x the memory throughput, ~10x less time", 10.0},
    {MatmulRung::Tiled, "tiled",
     "32 x 32 tiles of A and B in shared memory: each element read from HBM once per tile, "
     "not once per output",
     "-43% time, ~6.6 TFLOP/s", 1.0 / (1.0 - 0.43)},
    {MatmulRung::Coarsened, "coarsened",
     "each thread computes 4 x 4 outputs: 2 shared-memory reads per 16 multiply-adds instead "
     "of 2 per 1 (the MIO-throttle stall)",
     "the fix, no number", 0.0},
    {MatmulRung::TensorCores, "tensor cores",
     "bf16 mma.sync m16n8k16 with fp32 sums, fragments loaded by ldmatrix: a warp does 4096 "
     "multiply-adds per instruction",
     "beyond the chapter", 0.0},
};
const std::vector<MatmulRungInfo>& matmul_rungs() {
  return kRungs;
}
const MatmulRungInfo& matmul_rung(MatmulRung rung) {
  for (const MatmulRungInfo& r : kRungs)
    if (r.rung == rung) return r;
  PICO_ASSERT(false, "matmul_rung: a rung missing from kRungs");
  return kRungs[0];
}

// ============================================================================
// The CPU references
// ============================================================================

// Every fp32 rung computes C[i][j] as this one chain of fused multiply-adds, k in order (the
// tiled rungs walk the tiles in order and k in order inside each; the zeros they pad a last
// partial tile with add nothing), so each matches this loop exactly, not to a tolerance.
void matmul_fp32_cpu(float* C, const float* A, const float* B, int M, int N, int K) {
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      float acc = 0.0f;
      for (int k = 0; k < K; k++) acc = std::fma(A[(int64_t)i * K + k], B[(int64_t)k * N + j], acc);
      C[(int64_t)i * N + j] = acc;
    }
}

// The tensor-core rung: bf16 products are exact in fp32; each mma adds one 16-wide slice of k.
void matmul_tensor_cores_cpu(float* C, const bf16* A, const bf16* B, int M, int N, int K) {
  auto value = [](const bf16* p, int64_t at) {
    return bf16_to_float(reinterpret_cast<const uint16_t*>(p)[at]);
  };
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      float acc = 0.0f;
      for (int k0 = 0; k0 < K; k0 += 16) {
        float slice = 0.0f;
        for (int k = k0; k < k0 + 16 && k < K; k++)
          slice += value(A, (int64_t)i * K + k) * value(B, (int64_t)k * N + j);
        acc += slice;
      }
      C[(int64_t)i * N + j] = acc;
    }
}

// ============================================================================
// Rung 1: naive (Playbook §12.3, the starting point)
// ============================================================================
// One thread per output, 32 x 32 threads per block, x (the row) from threadIdx.x. A warp is 32
// consecutive threadIdx.x: 32 different rows of A at the same k, K floats apart, so each load
// instruction touches 32 separate bursts of DRAM ("uncoalesced"); its B loads are one address,
// and its stores again 32 rows.
constexpr int kNaiveBlock = 32;

__global__ void matmul_naive_kernel(float* C, const float* A, const float* B, int M, int N, int K) {
  const int x = blockIdx.x * blockDim.x + threadIdx.x;  // row of C
  const int y = blockIdx.y * blockDim.y + threadIdx.y;  // column of C
  if (x >= M || y >= N) return;
  float tmp = 0.0f;
  for (int i = 0; i < K; i++) tmp = fmaf(A[(int64_t)x * K + i], B[(int64_t)i * N + y], tmp);
  C[(int64_t)x * N + y] = tmp;
}

// ============================================================================
// Rung 2: coalesced (Playbook §12.3: "memory throughput ~10x, kernel time ~10x lower")
// ============================================================================
// The same arithmetic, threads renumbered: a 1-D block of 32 x 32, x = threadIdx.x / 32 and
// y = threadIdx.x % 32. A warp now shares one row x and takes 32 consecutive columns y: its B
// loads are 128 consecutive bytes (one transaction), its A load one address (a broadcast), its
// stores one row.
constexpr int kCoalescedBlock = 32;

__global__ void matmul_coalesced_kernel(float* C, const float* A, const float* B, int M, int N,
                                        int K) {
  const int x = blockIdx.x * kCoalescedBlock + threadIdx.x / kCoalescedBlock;
  const int y = blockIdx.y * kCoalescedBlock + threadIdx.x % kCoalescedBlock;
  if (x >= M || y >= N) return;
  float tmp = 0.0f;
  for (int i = 0; i < K; i++) tmp = fmaf(A[(int64_t)x * K + i], B[(int64_t)i * N + y], tmp);
  C[(int64_t)x * N + y] = tmp;
}

// ============================================================================
// Rung 3: shared-memory tiling (Playbook §12.4: "-43% time, ~6.6 TFLOPS")
// ============================================================================
// Coalesced, each output still reads its whole row of A and column of B from global memory:
// every element of A is read N times, every element of B M times. Here a block of 32 x 32
// threads loads a 32 x 32 tile of A and one of B into shared memory (each thread one element of
// each, threadIdx.x % 32 as the column so the loads stay coalesced), waits for the others
// (__syncthreads), and every thread takes its 32 products from the tiles: each element comes
// from global memory N/32 (or M/32) times instead.
constexpr int kTile = 32;

__global__ void matmul_tiled_kernel(float* C, const float* A, const float* B, int M, int N, int K) {
  __shared__ float As[kTile][kTile], Bs[kTile][kTile];
  const int r = threadIdx.x / kTile, c = threadIdx.x % kTile;
  const int row = blockIdx.x * kTile + r, col = blockIdx.y * kTile + c;
  float sum = 0.0f;
  for (int t0 = 0; t0 < K; t0 += kTile) {
    // Zeros past the edges: a partial tile multiplies as a whole one.
    As[r][c] = row < M && t0 + c < K ? A[(int64_t)row * K + t0 + c] : 0.0f;
    Bs[r][c] = t0 + r < K && col < N ? B[(int64_t)(t0 + r) * N + col] : 0.0f;
    __syncthreads();  // the tile is loaded
    // As[r][k]: one address per warp (broadcast); Bs[k][c]: 32 banks, no conflict.
#pragma unroll
    for (int k = 0; k < kTile; k++) sum = fmaf(As[r][k], Bs[k][c], sum);
    __syncthreads();  // everyone is done with the tile before it is overwritten
  }
  if (row < M && col < N) C[(int64_t)row * N + col] = sum;
}

// ============================================================================
// Rung 4: thread coarsening (Playbook §12.5: the MIO-throttle stall)
// ============================================================================
// Tiled, each multiply-add costs two shared-memory reads, and the profiler shows warps stalled
// on the MIO queue (smsp__pcsamp_warps_issue_stalled_mio_throttle): shared memory, not the
// arithmetic, is the limit. Coarsened, a thread computes a kCoarsen x kCoarsen block of outputs:
// per k it reads kCoarsen values of A and kCoarsen of B (one 16-byte load each) and does
// kCoarsen^2 multiply-adds with them from registers. A block covers a kCoarseTile x kCoarseTile
// tile of C with (kCoarseTile / kCoarsen)^2 threads, stepping k by kCoarseK. A is stored
// transposed in shared memory (As[k][m]) so that a thread's kCoarsen rows of A are adjacent, like
// its columns of B.
constexpr int kCoarseTile = 64;  // BM = BN: the block's tile of C (256 threads)
constexpr int kCoarseK = 8;      // BK: k per step
constexpr int kCoarsen = 4;      // outputs per thread along each side
constexpr int kCoarseSide = kCoarseTile / kCoarsen;
constexpr int kCoarseThreads = kCoarseSide * kCoarseSide;
static_assert(kCoarsen % 4 == 0, "a thread's row and column pieces are read as float4");

__global__ void matmul_coarsened_kernel(float* C, const float* A, const float* B, int M, int N,
                                        int K) {
  __shared__ __align__(16) float As[kCoarseK][kCoarseTile];  // A's tile, transposed: [k][m]
  __shared__ __align__(16) float Bs[kCoarseK][kCoarseTile];  // B's tile: [k][n]
  const int tr = threadIdx.x / kCoarseSide, tc = threadIdx.x % kCoarseSide;
  const int row0 = blockIdx.x * kCoarseTile, col0 = blockIdx.y * kCoarseTile;
  float acc[kCoarsen][kCoarsen] = {};
  for (int t0 = 0; t0 < K; t0 += kCoarseK) {
    for (int idx = threadIdx.x; idx < kCoarseTile * kCoarseK; idx += kCoarseThreads) {
      const int m = idx / kCoarseK, k = idx % kCoarseK;  // consecutive threads: along A's row
      As[k][m] = row0 + m < M && t0 + k < K ? A[(int64_t)(row0 + m) * K + t0 + k] : 0.0f;
      const int kb = idx / kCoarseTile, n = idx % kCoarseTile;  // along B's row
      Bs[kb][n] = t0 + kb < K && col0 + n < N ? B[(int64_t)(t0 + kb) * N + col0 + n] : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kCoarseK; k++) {
      float a[kCoarsen], b[kCoarsen];
#pragma unroll
      for (int v = 0; v < kCoarsen / 4; v++) {
        *reinterpret_cast<float4*>(a + 4 * v) =
            *reinterpret_cast<const float4*>(&As[k][tr * kCoarsen + 4 * v]);
        *reinterpret_cast<float4*>(b + 4 * v) =
            *reinterpret_cast<const float4*>(&Bs[k][tc * kCoarsen + 4 * v]);
      }
#pragma unroll
      for (int i = 0; i < kCoarsen; i++)
#pragma unroll
        for (int j = 0; j < kCoarsen; j++) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kCoarsen; i++)
#pragma unroll
    for (int j = 0; j < kCoarsen; j++) {
      const int row = row0 + tr * kCoarsen + i, col = col0 + tc * kCoarsen + j;
      if (row < M && col < N) C[(int64_t)row * N + col] = acc[i][j];
    }
}

// ============================================================================
// Rung 5: tensor cores (beyond the chapter's ladder; the instruction FlashAttention-2 uses)
// ============================================================================
// The CUDA cores of rungs 1-4 do one fp32 multiply-add per thread per instruction; a tensor
// core does a warp's 16 x 8 x 16 block of bf16 multiply-adds (4096) in one mma.sync, summing in
// fp32. The blocking is rung 4's one level up: a block of 8 warps covers a 128 x 128 tile of C,
// each warp a 64 x 32 piece of it as 4 x 4 accumulator tiles of 16 x 8 (64 floats a lane), and
// per 16 of k it loads 4 A fragments and 4 B fragments (ldmatrix: one instruction per
// fragment pair, straight from the shared-memory tiles into mma's register layout) for 16 mma.
// Rows in shared memory are padded by 16 bytes so that ldmatrix's 8 rows hit 8 bank groups.
// What this rung leaves out (FlashAttention-2's kernel has it, kernels/flash_attention_bf16.cu):
// cp.async double buffering, so the next tile's loads overlap this tile's mma.
constexpr int kTcTileM = 128, kTcTileN = 128, kTcTileK = 32;
constexpr int kTcWarpsM = 2, kTcWarpsN = 4;  // warps tiling the block's 128 x 128
constexpr int kTcWarpM = kTcTileM / kTcWarpsM, kTcWarpN = kTcTileN / kTcWarpsN;  // 64 x 32
constexpr int kTcThreads = 32 * kTcWarpsM * kTcWarpsN;
constexpr int kTcLdA = kTcTileK + 8, kTcLdB = kTcTileN + 8;  // padded leading dimensions

// 8 bf16 of row r from column c of a row-major [rows, cols] matrix into dst, zero outside it:
// one 16-byte load when the 8 lie inside and are 16-byte aligned (cols a multiple of 8).
__device__ inline void load_chunk8(bf16* dst, const bf16* src, int r, int c, int rows, int cols) {
  if (r < rows && c + 8 <= cols && cols % 8 == 0) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src + (int64_t)r * cols + c);
    return;
  }
  for (int e = 0; e < 8; e++)
    dst[e] = r < rows && c + e < cols ? src[(int64_t)r * cols + c + e] : __float2bfloat16(0.0f);
}

__global__ void __launch_bounds__(kTcThreads)
    matmul_tensor_cores_kernel(float* C, const bf16* A, const bf16* B, int M, int N, int K) {
  __shared__ __align__(16) bf16 As[kTcTileM * kTcLdA];  // [128][32 + 8]
  __shared__ __align__(16) bf16 Bs[kTcTileK * kTcLdB];  // [32][128 + 8]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int wm = warp / kTcWarpsN * kTcWarpM, wn = warp % kTcWarpsN * kTcWarpN;
  const int row0 = blockIdx.x * kTcTileM, col0 = blockIdx.y * kTcTileN;
  float acc[kTcWarpM / 16][kTcWarpN / 8][4] = {};
  for (int t0 = 0; t0 < K; t0 += kTcTileK) {
    for (int idx = threadIdx.x; idx < kTcTileM * kTcTileK / 8; idx += kTcThreads) {
      const int r = idx / (kTcTileK / 8), c = idx % (kTcTileK / 8) * 8;
      load_chunk8(As + r * kTcLdA + c, A, row0 + r, t0 + c, M, K);
    }
    for (int idx = threadIdx.x; idx < kTcTileK * kTcTileN / 8; idx += kTcThreads) {
      const int r = idx / (kTcTileN / 8), c = idx % (kTcTileN / 8) * 8;
      load_chunk8(Bs + r * kTcLdB + c, B, t0 + r, col0 + c, K, N);
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kTcTileK; kk += 16) {
      uint32_t af[kTcWarpM / 16][4];
#pragma unroll
      for (int mt = 0; mt < kTcWarpM / 16; mt++)
        load_a_fragment(af[mt], As, kTcLdA, wm + 16 * mt, kk, lane);
#pragma unroll
      for (int np = 0; np < kTcWarpN / 16; np++) {
        uint32_t bf[4];  // two 8-column tiles of B
        load_b_fragments(bf, Bs, kTcLdB, kk, wn + 16 * np, lane);
#pragma unroll
        for (int mt = 0; mt < kTcWarpM / 16; mt++) {
          mma_bf16_16816(acc[mt][2 * np], af[mt], bf);
          mma_bf16_16816(acc[mt][2 * np + 1], af[mt], bf + 2);
        }
      }
    }
    __syncthreads();
  }
  // Accumulator tile (mt, nt): lane (g, t) holds rows g and g + 8, columns 2t and 2t + 1.
#pragma unroll
  for (int mt = 0; mt < kTcWarpM / 16; mt++)
#pragma unroll
    for (int nt = 0; nt < kTcWarpN / 8; nt++)
#pragma unroll
      for (int x = 0; x < 2; x++) {
        const int row = row0 + wm + 16 * mt + g + 8 * x, col = col0 + wn + 8 * nt + 2 * t;
        if (row >= M) continue;
        float* c = C + (int64_t)row * N + col;
        if (col + 1 < N && N % 2 == 0) {
          *reinterpret_cast<float2*>(c) = make_float2(acc[mt][nt][2 * x], acc[mt][nt][2 * x + 1]);
        } else {
          if (col < N) c[0] = acc[mt][nt][2 * x];
          if (col + 1 < N) c[1] = acc[mt][nt][2 * x + 1];
        }
      }
}

// ============================================================================
// Dispatchers
// ============================================================================

static dim3 tiles(int M, int N, int tile_m, int tile_n) {
  return dim3((M + tile_m - 1) / tile_m, (N + tile_n - 1) / tile_n);
}

void matmul_ladder(const Context& ctx, MatmulRung rung, float* C, const float* A, const float* B,
                   int M, int N, int K) {
  PICO_ASSERT(rung != MatmulRung::TensorCores,
              "matmul_ladder: the tensor-core rung takes bf16 inputs (matmul_ladder_bf16)");
  PICO_ASSERT(M >= 0 && N >= 0 && K >= 0, "matmul_ladder: negative size");
  if (ctx.device == Device::CPU) return matmul_fp32_cpu(C, A, B, M, N, K);
  if (M == 0 || N == 0) return;
  switch (rung) {
    case MatmulRung::Naive:
      matmul_naive_kernel<<<tiles(M, N, kNaiveBlock, kNaiveBlock), dim3(kNaiveBlock, kNaiveBlock),
                            0, ctx.stream>>>(C, A, B, M, N, K);
      break;
    case MatmulRung::Coalesced:
      matmul_coalesced_kernel<<<tiles(M, N, kCoalescedBlock, kCoalescedBlock),
                                kCoalescedBlock * kCoalescedBlock, 0, ctx.stream>>>(C, A, B, M, N,
                                                                                    K);
      break;
    case MatmulRung::Tiled:
      matmul_tiled_kernel<<<tiles(M, N, kTile, kTile), kTile * kTile, 0, ctx.stream>>>(C, A, B, M,
                                                                                       N, K);
      break;
    case MatmulRung::Coarsened:
      matmul_coarsened_kernel<<<tiles(M, N, kCoarseTile, kCoarseTile), kCoarseThreads, 0,
                                ctx.stream>>>(C, A, B, M, N, K);
      break;
    case MatmulRung::TensorCores:
      break;
  }
  LAUNCH_CHECK(ctx, matmul_rung(rung).name);
}

void matmul_ladder_bf16(const Context& ctx, float* C, const bf16* A, const bf16* B, int M, int N,
                        int K) {
  PICO_ASSERT(M >= 0 && N >= 0 && K >= 0, "matmul_ladder_bf16: negative size");
  if (ctx.device == Device::CPU) return matmul_tensor_cores_cpu(C, A, B, M, N, K);
  if (M == 0 || N == 0) return;
  PICO_ASSERT(reinterpret_cast<uintptr_t>(A) % 16 == 0 && reinterpret_cast<uintptr_t>(B) % 16 == 0,
              "matmul_ladder_bf16: A and B must be 16-byte aligned");
  matmul_tensor_cores_kernel<<<tiles(M, N, kTcTileM, kTcTileN), kTcThreads, 0, ctx.stream>>>(
      C, A, B, M, N, K);
  LAUNCH_CHECK(ctx, "matmul_tensor_cores");
}
