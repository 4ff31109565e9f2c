// test_comm_dtype.cu: collectives carrying bf16 and fp16 (comm.cuh) on 2..8 MPI ranks ([mpi]).
// Over MPI the 16-bit values travel as MPI_UINT16_T and are summed by our own operation; the
// expectations are recomputed here from the bits: a gather moves them unchanged, a max picks
// one, a sum of two rounds once (fp32 add, round to nearest even), and a sum of N rounds at most
// N-1 times. [gpu]: the same on device buffers, staged (MPI) and over NCCL's ncclBfloat16.
// Run as: mpirun -np N build/mpi_tests "[dtype]"
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "gpu_ranks.cuh"
#include "mixed_precision.cuh"
#include "runtime/comm.cuh"
#include "world.cuh"

namespace {

const Context kCpu;
constexpr double kTimeout = 60;

struct TestComm {
  Comm c;
  explicit TestComm(const std::string& backend = "mpi", Device device = Device::CPU)
      : c(comm_init(world_size(), 1, 1, 1, backend, device, kTimeout)) {}
  ~TestComm() { comm_destroy(c); }
};

uint16_t to_bits(DType t, float x) {
  return t == DType::BF16 ? float_to_bf16(x) : float_to_fp16(x);
}
float from_bits(DType t, uint16_t b) {
  return t == DType::BF16 ? bf16_to_float(b) : fp16_to_float(b);
}

// n values of rank `rank` in format t: N(0,1) scaled into fp16's comfortable range, rounded.
std::vector<uint16_t> values(DType t, int64_t n, int rank) {
  std::vector<float> v(n);
  Tensor h{nullptr, v.data(), {n}, DType::F32, Device::CPU};
  init_normal(h, 11, "dtype.rank" + std::to_string(rank), 4.0f);
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; i++) bits[i] = to_bits(t, v[i]);
  return bits;
}

// Units in the last place of format t at x (t's eps times the power of two at or below |x|).
double ulp(DType t, double x) {
  const double eps = t == DType::BF16 ? 0x1p-7 : 0x1p-10;
  int e = 0;
  std::frexp(x == 0 ? 1e-30 : x, &e);
  return std::ldexp(eps, e - 1);
}

// Element i of the sum over every rank's values: exact on two ranks (one rounding of an exact
// fp32 sum, whatever order); on N ranks within N-1 roundings, each at most half an ulp of a
// partial sum, all bounded by the sum of |x| (checked as (N-1) * ulp(sum |x|)).
void check_sum(DType t, const std::vector<uint16_t>& got, int64_t first, int N) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); i++) {
    double exact = 0, absum = 0;
    float pair = 0;
    for (int r = 0; r < N; r++) {
      float x = from_bits(t, values(t, first + i + 1, r)[first + i]);
      exact += x, absum += std::fabs(x), pair += x;
    }
    if (N == 2)
      bad += got[i] != to_bits(t, pair);
    else
      bad += std::fabs(from_bits(t, got[i]) - exact) > (N - 1) * ulp(t, absum);
  }
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("bf16 and fp16 all-reduce: the bits summed in fp32 and rounded, on any N",
          "[mpi][dtype]") {
  TestComm tc;
  Comm& c = tc.c;
  const int N = c.dp.size, r = c.dp.rank;
  const int64_t n = 300;
  for (DType t : {DType::BF16, DType::F16}) {
    CAPTURE(dtype_name(t));
    std::vector<uint16_t> buf = values(t, n, r);
    all_reduce_async(c, c.dp, kCpu, buf.data(), t, n, ReduceOp::Sum).wait();
    check_sum(t, buf, 0, N);
    // Max rounds nothing: the largest of the ranks' values, bit for bit.
    std::vector<uint16_t> mx = values(t, n, r);
    all_reduce_async(c, c.dp, kCpu, mx.data(), t, n, ReduceOp::Max).wait();
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
      float best = -INFINITY;
      for (int q = 0; q < N; q++) best = std::max(best, from_bits(t, values(t, n, q)[i]));
      wrong += mx[i] != to_bits(t, best);
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("bf16 all-gather moves the bits unchanged; reduce-scatter sums each rank's chunk",
          "[mpi][dtype]") {
  TestComm tc;
  Comm& c = tc.c;
  const int N = c.dp.size, r = c.dp.rank;
  const int64_t n = 37;  // odd: 16-bit counts need not fill whole 4-byte words
  const DType t = DType::BF16;
  std::vector<uint16_t> mine = values(t, n, r), all(n * N, 0xFFFF);
  all_gather_async(c, c.dp, kCpu, mine.data(), all.data(), t, n).wait();
  for (int q = 0; q < N; q++)
    CHECK(std::vector<uint16_t>(all.begin() + q * n, all.begin() + (q + 1) * n) == values(t, n, q));
  // In place, as ZeRO gathers: this rank's shard already sits in its slot.
  std::vector<uint16_t> in_place(n * N, 0);
  std::copy(mine.begin(), mine.end(), in_place.begin() + r * n);
  all_gather_async(c, c.dp, kCpu, in_place.data() + r * n, in_place.data(), t, n).wait();
  CHECK(in_place == all);

  std::vector<uint16_t> whole = values(t, n * N, r), chunk(n);
  reduce_scatter_async(c, c.dp, kCpu, whole.data(), chunk.data(), t, n, ReduceOp::Sum).wait();
  check_sum(t, chunk, r * n, N);
}

TEST_CASE("16-bit collectives are charged 2 bytes per element: half of fp32's traffic",
          "[mpi][dtype]") {
  TestComm tc;
  Comm& c = tc.c;
  const int64_t N = c.dp.size, n = 24 * N;
  std::vector<uint16_t> half(n * N), shard(n);
  std::vector<float> full(n * N), fshard(n);
  auto bytes = [&](Coll k) { return c.dp.stats[(int)k].bytes; };
  all_reduce_async(c, c.dp, kCpu, half.data(), DType::BF16, n, ReduceOp::Sum).wait();
  const int64_t ar16 = bytes(Coll::AllReduce);
  all_reduce(c, c.dp, kCpu, full.data(), n, ReduceOp::Sum);
  CHECK(ar16 == 2 * (N - 1) * (2 * n) / N);  // the ring's 2(N-1)K/N with K = 2n bytes
  CHECK(bytes(Coll::AllReduce) - ar16 == 2 * ar16);
  all_gather_async(c, c.dp, kCpu, shard.data(), half.data(), DType::F16, n).wait();
  CHECK(bytes(Coll::AllGather) == (N - 1) * 2 * n);
  reduce_scatter_async(c, c.dp, kCpu, half.data(), shard.data(), DType::BF16, n, ReduceOp::Sum)
      .wait();
  CHECK(bytes(Coll::ReduceScatter) == (N - 1) * 2 * n);
  CHECK(c.dp.stats[(int)Coll::ReduceScatter].elements == n * N);
}

TEST_CASE("bf16 collectives on device buffers (MPI staging, NCCL) give the CPU's results",
          "[mpi][dtype][gpu]") {
  if (!gpu_case_ready()) return;
  const int N = world_size(), r = world_rank();
  const int64_t n = 257;
  const DType t = DType::BF16;
  for (const char* backend : {"mpi", "nccl"}) {
    CAPTURE(backend);
    if (std::string(backend) == "nccl" && N > 1) {
      int gpus = 0;
      CUDA_CHECK(cudaGetDeviceCount(&gpus));
      int enough = gpus >= N, all = 0;
      MPI_Allreduce(&enough, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
      if (!all) continue;  // NCCL needs a GPU per rank: the MPI pass above covered this machine
    }
    TestComm tc(backend, Device::CUDA);
    Comm& c = tc.c;
    Context gpu = Context::create(Device::CUDA);
    std::vector<uint16_t> mine = values(t, n, r), gathered(n * N), summed(n);
    uint16_t *d_mine = nullptr, *d_all = nullptr;
    CUDA_CHECK(cudaMalloc(&d_mine, n * 2));
    CUDA_CHECK(cudaMalloc(&d_all, n * N * 2));
    CUDA_CHECK(cudaMemcpy(d_mine, mine.data(), n * 2, cudaMemcpyHostToDevice));
    all_gather_async(c, c.dp, gpu, d_mine, d_all, t, n).wait();
    all_reduce_async(c, c.dp, gpu, d_mine, t, n, ReduceOp::Sum).wait();
    gpu.synchronize();
    CUDA_CHECK(cudaMemcpy(gathered.data(), d_all, n * N * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(summed.data(), d_mine, n * 2, cudaMemcpyDeviceToHost));
    for (int q = 0; q < N; q++)
      CHECK(std::vector<uint16_t>(gathered.begin() + q * n, gathered.begin() + (q + 1) * n) ==
            values(t, n, q));
    check_sum(t, summed, 0, N);
    CUDA_CHECK(cudaFree(d_mine));
    CUDA_CHECK(cudaFree(d_all));
    gpu.destroy();
  }
}
