// test_comm.cu: the collectives of comm.cu on 2..8 MPI ranks ([mpi]): the Playbook's appendix
// A0 examples value for value, agreement with direct MPI calls on random data, Avg and Max,
// several collectives in flight at once, byte counters against the ring formulas, and the process
// grid for every factorization of the world, and the choice of NCCL or MPI per node. [gpu] cases
// repeat them on device buffers, over MPI staging and over NCCL (on one rank too: --comm nccl
// gives groups of one a communicator). The hidden [.stuck-nccl] and [.stuck-device] cases end
// the job on purpose.
// Run as: mpirun -np N build/mpi_tests   (every case works for any N from 2 to 8; [gpu] from 1)
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gpu_ranks.cuh"
#include "runtime/comm.cuh"
#include "runtime/ops.cuh"
#include "world.cuh"

namespace {

using Catch::Matchers::Contains;

const Context kCpu;                // a default Context is the CPU
constexpr double kTimeout = 60;    // a broken collective stops the run after a minute, never hangs
constexpr double kUnit = 0x1p-24;  // fp32 unit roundoff

// A communicator for one test case, freed at its end. Every rank builds it at the same point.
struct TestComm {
  Comm c;
  TestComm(int dp, int pp, int cp, int tp, const std::string& backend = "mpi",
           Device device = Device::CPU)
      : c(comm_init(dp, pp, cp, tp, backend, device, kTimeout)) {}
  ~TestComm() { comm_destroy(c); }
};

std::vector<float> filled(int64_t n, float value) {
  return std::vector<float>(n, value);
}
std::string on_rank(const std::string& name) {
  return name + ".rank" + std::to_string(world_rank());
}
// N(0,1) values: element i of the tensor `name` (pass on_rank(...) for data that differ per rank).
std::vector<float> normal(int64_t n, const std::string& name) {
  std::vector<float> v(n);
  Tensor t;
  t.ptr = v.data();
  t.shape = {n};
  init_normal(t, 7, name, 1.0f);
  return v;
}
// Per element, the sum over ranks of |x|: what bounds the rounding of a sum of x over ranks.
std::vector<double> abs_sum_over_ranks(const std::vector<float>& x) {
  std::vector<double> a(x.size());
  for (size_t i = 0; i < x.size(); i++) a[i] = std::fabs(x[i]);
  MPI_Allreduce(MPI_IN_PLACE, a.data(), (int)a.size(), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return a;
}
// Floating-point addition is not associative, and two reductions may add the N terms in different
// orders (different MPI or NCCL algorithms): each result is within (N-1)u sum|x| of the exact
// sum, so they differ by at most 2(N-1)u sum|x|. We allow 2(N+1)u sum|x| (times `scale` for an
// average), which also covers the rounding of the 1/N scaling. Returns the elements outside it.
int outside_sum_bound(const std::vector<float>& got, const std::vector<float>& want,
                      const std::vector<double>& abs_sum, int N, double scale = 1.0) {
  int bad = 0;
  for (size_t i = 0; i < want.size(); i++)
    bad += std::fabs((double)got[i] - want[i]) > 2.0 * (N + 1) * kUnit * scale * abs_sum[i];
  return bad;
}

Tensor on(const Context& ctx, const std::vector<float>& values) {
  Tensor t = empty({(int64_t)values.size()}, Mem::Workspace, ctx.device);
  from_host(t, values.data());
  return t;
}
std::vector<float> back(const Context& ctx, const Tensor& t) {
  ctx.synchronize();
  return to_host_floats(t);
}

// Every collective once on the whole world (the dp group when dp = world), on buffers on
// ctx.device, with random inputs named per rank; its outputs on the host.
constexpr int64_t kN = 1000;  // all-reduce, broadcast, reduce: not a multiple of most N
constexpr int64_t kM = 37;    // per-rank share of reduce-scatter, all-gather, gather, scatter
struct Outputs {
  std::vector<float> sum, avg, max, reduce_scatter, all_gather, broadcast, reduce, gather, scatter,
      ring;
};
Outputs every_collective(Comm& c, const Context& ctx) {
  Group& g = c.dp;
  int N = g.size;
  std::vector<float> x = normal(kN, on_rank("x"));
  Tensor sum = on(ctx, x), avg = on(ctx, x), max = on(ctx, x), x_in = on(ctx, x);
  all_reduce(c, g, ctx, sum.f32(), kN, ReduceOp::Sum);
  all_reduce(c, g, ctx, avg.f32(), kN, ReduceOp::Avg);
  all_reduce(c, g, ctx, max.f32(), kN, ReduceOp::Max);
  Tensor rs_in = on(ctx, normal(kM * N, on_rank("rs"))), rs_out = on(ctx, filled(kM, -1));
  reduce_scatter(c, g, ctx, rs_in.f32(), rs_out.f32(), kM, ReduceOp::Sum);
  Tensor ag_in = on(ctx, normal(kM, on_rank("ag"))), ag_out = on(ctx, filled(kM * N, -1));
  all_gather(c, g, ctx, ag_in.f32(), ag_out.f32(), kM);
  Tensor bcast = on(ctx, normal(kN, on_rank("bcast")));
  broadcast(c, g, ctx, bcast.f32(), kN, N - 1);
  Tensor red = on(ctx, filled(kN, -1));
  reduce(c, g, ctx, x_in.f32(), red.f32(), kN, ReduceOp::Sum, 1 % N);
  Tensor ga_in = on(ctx, normal(kM, on_rank("gather"))), ga_out = on(ctx, filled(kM * N, -1));
  gather(c, g, ctx, ga_in.f32(), ga_out.f32(), kM, N - 1);
  Tensor sc_in = on(ctx, normal(kM * N, on_rank("scatter"))), sc_out = on(ctx, filled(kM, -1));
  scatter(c, g, ctx, sc_in.f32(), sc_out.f32(), kM, 0);
  Tensor ring_in = on(ctx, normal(kM, on_rank("ring"))), ring_out = on(ctx, filled(kM, -1));
  send_recv(c, g, ctx,
            {{true, ring_in.f32(), kM, g.next()}, {false, ring_out.f32(), kM, g.prev()}});
  return {back(ctx, sum),    back(ctx, avg),     back(ctx, max), back(ctx, rs_out),
          back(ctx, ag_out), back(ctx, bcast),   back(ctx, red), back(ctx, ga_out),
          back(ctx, sc_out), back(ctx, ring_out)};
}

// The start of every NCCL case: a CUDA context and a communicator with every group on NCCL
// (--comm nccl: groups of one included), or, when not ready(), a SKIP on every rank alike: no
// GPU, or a node with ranks sharing one.
struct NcclCase {
  Context gpu;
  std::unique_ptr<TestComm> t;
  NcclCase() {
    if (!gpu_case_ready()) return;
    gpu = Context::create(Device::CUDA);
    try {
      t = std::make_unique<TestComm>(world_size(), 1, 1, 1, "nccl", Device::CUDA);
    } catch (const UsageError& e) {
      WARN("SKIP: NCCL needs one GPU per rank, and a node has more ranks than GPUs (" << e.what()
                                                                                      << ")");
    }
  }
  bool ready() const { return t != nullptr; }
  ~NcclCase() {
    t.reset();
    if (gpu.device == Device::CUDA) gpu.destroy();
  }
};

// A spec of exclusions only ("~[gpu]") selects hidden cases too: a case that ends the job on
// purpose runs only when its tag is given by name.
bool named(const std::string& tag) {
  for (const std::string& spec : Catch::getCurrentContext().getConfig()->getTestsOrTags())
    if (spec == tag) return true;
  return false;
}

// Keeps one thread of the GPU busy for `ns` nanoseconds of the device's global timer.
__global__ void spin_for_ns(uint64_t ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}

}  // namespace

// ============================================================================
// Appendix A0, value for value (rank r holds [r+1]*5 unless stated)
// ============================================================================

TEST_CASE("A0 broadcast: rank 0's [1,2,3,4,5] reaches every rank, from any root", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  std::vector<float> book = {1, 2, 3, 4, 5};
  std::vector<float> buf = r == 0 ? book : filled(5, 0);
  broadcast(c, c.dp, kCpu, buf.data(), 5, 0);
  CHECK(buf == book);
  for (int root = 1; root < N; root++) {
    buf = r == root ? filled(5, 10.0f * root) : filled(5, 0);
    broadcast(c, c.dp, kCpu, buf.data(), 5, root);
    CHECK(buf == filled(5, 10.0f * root));
  }
}

TEST_CASE("A0 reduce: rank 0 gets [6]*5 on 3 ranks (N(N+1)/2 on N), the others keep theirs",
          "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  std::vector<float> buf = filled(5, r + 1.0f);
  reduce(c, c.dp, kCpu, buf.data(), buf.data(), 5, ReduceOp::Sum, 0);  // in place, as in torch
  CHECK(buf == filled(5, r == 0 ? N * (N + 1) / 2.0f : r + 1.0f));
}

TEST_CASE("A0 all-reduce: every rank ends with [6]*5 on 3 ranks (N(N+1)/2 on N)", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size;
  std::vector<float> buf = filled(5, c.dp.rank + 1.0f);
  all_reduce(c, c.dp, kCpu, buf.data(), 5, ReduceOp::Sum);
  CHECK(buf == filled(5, N * (N + 1) / 2.0f));
}

TEST_CASE("A0 gather: rank 0 receives [[1]*5, [2]*5, ..., [N]*5]", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  std::vector<float> mine = filled(5, r + 1.0f), all = filled(5 * N, -1), book;
  for (int j = 0; j < N; j++)
    for (int i = 0; i < 5; i++) book.push_back(j + 1.0f);
  gather(c, c.dp, kCpu, mine.data(), all.data(), 5, 0);
  CHECK(all == (r == 0 ? book : filled(5 * N, -1)));  // only the root receives
}

TEST_CASE("A0 all-gather: every rank receives [[1]*5, [2]*5, ..., [N]*5]", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size;
  std::vector<float> mine = filled(5, c.dp.rank + 1.0f), all = filled(5 * N, -1), book;
  for (int j = 0; j < N; j++)
    for (int i = 0; i < 5; i++) book.push_back(j + 1.0f);
  all_gather(c, c.dp, kCpu, mine.data(), all.data(), 5);
  CHECK(all == book);
  // In place, as ZeRO uses it: this rank's slot of the output is the input.
  std::vector<float> slots = filled(5 * N, -1);
  std::copy(mine.begin(), mine.end(), slots.begin() + 5 * c.dp.rank);
  all_gather(c, c.dp, kCpu, slots.data() + 5 * c.dp.rank, slots.data(), 5);
  CHECK(slots == book);
}

TEST_CASE("A0 scatter: rank 0's [[1]*5, [2]*5, ..., [N]*5] gives rank r [r+1]*5", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  std::vector<float> chunks = filled(5 * N, -1), mine = filled(5, -1);
  if (r == 0)
    for (int j = 0; j < N; j++)
      for (int i = 0; i < 5; i++) chunks[5 * j + i] = j + 1.0f;
  scatter(c, c.dp, kCpu, chunks.data(), mine.data(), 5, 0);
  CHECK(mine == filled(5, r + 1.0f));
}

TEST_CASE("A0 reduce-scatter on 3 ranks gives [6,12], [14,56], [36,288]", "[mpi]") {
  if (world_size() != 3) {
    WARN("needs 3 ranks");
    return;
  }
  TestComm t(3, 1, 1, 1);
  Comm& c = t.c;
  int r = c.dp.rank;
  // Rank r's input: chunk j is [(r+1)*1, (r+1)*2] ** (j+1).
  std::vector<float> input, out = filled(2, -1);
  for (int j = 0; j < 3; j++)
    for (int k = 1; k <= 2; k++) input.push_back((float)std::pow((r + 1) * k, j + 1));
  reduce_scatter(c, c.dp, kCpu, input.data(), out.data(), 2, ReduceOp::Sum);
  std::vector<std::vector<float>> book = {{6, 12}, {14, 56}, {36, 288}};
  CHECK(out == book[r]);
}

TEST_CASE("reduce-scatter: rank j receives the sum over ranks of their j-th chunk, on any N",
          "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  std::vector<float> input, out = filled(3, -1), want;
  for (int j = 0; j < N; j++)
    for (int e = 0; e < 3; e++) input.push_back((r + 1.0f) * (j + 1) + e);
  for (int e = 0; e < 3; e++) want.push_back((r + 1.0f) * N * (N + 1) / 2 + (float)N * e);
  reduce_scatter(c, c.dp, kCpu, input.data(), out.data(), 3, ReduceOp::Sum);
  CHECK(out == want);
  // In place: this rank's chunk of the input is the output.
  reduce_scatter(c, c.dp, kCpu, input.data(), input.data() + 3 * r, 3, ReduceOp::Sum);
  CHECK(std::vector<float>(input.begin() + 3 * r, input.begin() + 3 * r + 3) == want);
}

TEST_CASE("A0 barrier: nobody leaves before the last rank arrives", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  const double unit = 0.1;  // the book sleeps r seconds; r tenths keep the test short
  MPI_Barrier(MPI_COMM_WORLD);
  double start = now_seconds();
  std::this_thread::sleep_for(std::chrono::duration<double>(unit * r));
  barrier(c, c.dp, kCpu);
  // Rank N-1 arrives (N-1) units after the start; ranks leave the first barrier a little apart.
  CHECK(now_seconds() - start >= unit * (N - 1) - unit / 2);
}

// ============================================================================
// Against direct MPI calls on random data
// ============================================================================

TEST_CASE("every collective equals the direct MPI call on random data", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  Outputs out = every_collective(c, kCpu);
  MPI_Comm W = MPI_COMM_WORLD;  // dp = world: same ranks, same order

  std::vector<float> x = normal(kN, on_rank("x")), want(kN);
  std::vector<double> x_abs = abs_sum_over_ranks(x);
  MPI_Allreduce(x.data(), want.data(), kN, MPI_FLOAT, MPI_SUM, W);
  CHECK(outside_sum_bound(out.sum, want, x_abs, N) == 0);
  std::vector<float> average(kN);
  for (int64_t i = 0; i < kN; i++) average[i] = want[i] / N;
  CHECK(outside_sum_bound(out.avg, average, x_abs, N, 1.0 / N) == 0);
  MPI_Reduce(x.data(), want.data(), kN, MPI_FLOAT, MPI_SUM, 1 % N, W);
  if (r == 1 % N)
    CHECK(outside_sum_bound(out.reduce, want, x_abs, N) == 0);
  else
    CHECK(out.reduce == filled(kN, -1));  // only the root receives
  MPI_Allreduce(x.data(), want.data(), kN, MPI_FLOAT, MPI_MAX, W);
  CHECK(out.max == want);  // a maximum is exact in any order

  std::vector<float> rs = normal(kM * N, on_rank("rs")), rs_want(kM);
  std::vector<double> rs_abs = abs_sum_over_ranks(rs);
  MPI_Reduce_scatter_block(rs.data(), rs_want.data(), kM, MPI_FLOAT, MPI_SUM, W);
  rs_abs = std::vector<double>(rs_abs.begin() + r * kM, rs_abs.begin() + (r + 1) * kM);
  CHECK(outside_sum_bound(out.reduce_scatter, rs_want, rs_abs, N) == 0);

  // Collectives that only move data are exact.
  std::vector<float> ag = normal(kM, on_rank("ag")), ag_want(kM * N);
  MPI_Allgather(ag.data(), kM, MPI_FLOAT, ag_want.data(), kM, MPI_FLOAT, W);
  CHECK(out.all_gather == ag_want);
  std::vector<float> bcast = normal(kN, on_rank("bcast"));
  MPI_Bcast(bcast.data(), kN, MPI_FLOAT, N - 1, W);
  CHECK(out.broadcast == bcast);
  std::vector<float> ga = normal(kM, on_rank("gather")), ga_want = filled(kM * N, -1);
  MPI_Gather(ga.data(), kM, MPI_FLOAT, ga_want.data(), kM, MPI_FLOAT, N - 1, W);
  CHECK(out.gather == ga_want);
  std::vector<float> sc = normal(kM * N, on_rank("scatter")), sc_want(kM);
  MPI_Scatter(sc.data(), kM, MPI_FLOAT, sc_want.data(), kM, MPI_FLOAT, 0, W);
  CHECK(out.scatter == sc_want);
  std::vector<float> ring = normal(kM, on_rank("ring")), ring_want(kM);
  MPI_Sendrecv(ring.data(), kM, MPI_FLOAT, (r + 1) % N, 9, ring_want.data(), kM, MPI_FLOAT,
               (r + N - 1) % N, 9, W, MPI_STATUS_IGNORE);
  CHECK(out.ring == ring_want);
}

TEST_CASE("ReduceOp::Avg is the sum over the group divided by its size, Max the largest", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size, r = c.dp.rank;
  // Integers: the sum is exact and the average too, up to the rounding of sum * (1/N) (and of
  // 1/N itself): within 2u of it.
  auto near_average = [&](const std::vector<float>& got, const std::vector<float>& avg) {
    for (size_t i = 0; i < avg.size(); i++)
      if (std::fabs(got[i] - avg[i]) > 2 * kUnit * std::fabs(avg[i])) return false;
    return true;
  };
  std::vector<float> buf, avg, mx;  // rank r holds N(r+1) + i; its max is (r+i) % N * 10 - i
  for (int i = 0; i < 8; i++) {
    buf.push_back((float)N * (r + 1) + i);
    avg.push_back(N * (N + 1) / 2.0f + i);
    mx.push_back((N - 1) * 10.0f - i);
  }
  all_reduce(c, c.dp, kCpu, buf.data(), 8, ReduceOp::Avg);
  CHECK(near_average(buf, avg));
  std::vector<float> m(8);
  for (int i = 0; i < 8; i++) m[i] = (float)((r + i) % N * 10 - i);
  all_reduce(c, c.dp, kCpu, m.data(), 8, ReduceOp::Max);
  CHECK(m == mx);

  // The same for reduce-scatter (chunk j of rank r: N(r+1) + j) and reduce (at the root).
  std::vector<float> chunks, one = filled(1, -1), red = filled(8, -1);
  for (int j = 0; j < N; j++) chunks.push_back((float)N * (r + 1) + j);
  reduce_scatter(c, c.dp, kCpu, chunks.data(), one.data(), 1, ReduceOp::Avg);
  CHECK(near_average(one, {N * (N + 1) / 2.0f + r}));
  reduce_scatter(c, c.dp, kCpu, chunks.data(), one.data(), 1, ReduceOp::Max);
  CHECK(one == std::vector<float>{(float)N * N + r});
  for (int i = 0; i < 8; i++) buf[i] = (float)N * (r + 1) + i;
  reduce(c, c.dp, kCpu, buf.data(), red.data(), 8, ReduceOp::Avg, N - 1);
  if (r == N - 1) CHECK(near_average(red, avg));
}

// ============================================================================
// Nonblocking: several collectives in flight
// ============================================================================

// `count` buffers of N(0,1) values that differ per rank, of first + k * step elements.
std::vector<std::vector<float>> per_rank_data(int count, int64_t first, int64_t step,
                                              const std::string& name) {
  std::vector<std::vector<float>> v;
  for (int k = 0; k < count; k++)
    v.push_back(normal(first + step * k, on_rank(name + std::to_string(k))));
  return v;
}
// A sum all-reduce of each buffer on `g`, all started before any is waited for.
std::vector<Handle> all_reduces_in_flight(Comm& c, Group& g,
                                          std::vector<std::vector<float>>& bufs) {
  std::vector<Handle> h;
  for (auto& v : bufs)
    h.push_back(all_reduce_async(c, g, kCpu, v.data(), (int64_t)v.size(), ReduceOp::Sum));
  return h;
}

TEST_CASE("three all-reduces in flight at once, waited in reverse order, equal blocking ones",
          "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  std::vector<std::vector<float>> async = per_rank_data(3, 100, 333, "x"), blocking = async;
  std::vector<Handle> h = all_reduces_in_flight(c, c.dp, async);
  h[2].wait();
  while (!h[1].test()) {
  }
  CHECK(h[1].test());  // idempotent once done
  h[0].wait();
  h[0].wait();
  CHECK_FALSE(h[0].active());
  // The blocking call is the same MPI algorithm on the same data: bit-identical.
  for (auto& v : blocking) all_reduce(c, c.dp, kCpu, v.data(), (int64_t)v.size(), ReduceOp::Sum);
  CHECK(async == blocking);
}

TEST_CASE("different collectives in flight together each equal their blocking version", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  Group& g = c.dp;
  int N = g.size;
  std::vector<float> rs_in = normal(kM * N, on_rank("rs")), ag_in = normal(kM, on_rank("ag"));
  std::vector<float> bc = normal(kN, on_rank("bc")), p2p_in = normal(kM, on_rank("p2p"));
  std::vector<float> rs_a(kM), ag_a(kM * N), bc_a = bc, p2p_a(kM);
  std::vector<float> rs_b(kM), ag_b(kM * N), bc_b = bc, p2p_b(kM);
  std::vector<P2P> ring_a = {{true, p2p_in.data(), kM, g.next()},
                             {false, p2p_a.data(), kM, g.prev()}};
  std::vector<P2P> ring_b = {{true, p2p_in.data(), kM, g.next()},
                             {false, p2p_b.data(), kM, g.prev()}};
  Handle h1 = reduce_scatter_async(c, g, kCpu, rs_in.data(), rs_a.data(), kM, ReduceOp::Sum);
  Handle h2 = all_gather_async(c, g, kCpu, ag_in.data(), ag_a.data(), kM);
  Handle h3 = broadcast_async(c, g, kCpu, bc_a.data(), kN, N / 2);
  Handle h4 = send_recv_async(c, g, kCpu, ring_a);
  Handle h5 = barrier_async(c, g, kCpu);
  for (Handle* h : {&h5, &h4, &h3, &h2, &h1}) h->wait();  // the reverse of their start
  reduce_scatter(c, g, kCpu, rs_in.data(), rs_b.data(), kM, ReduceOp::Sum);
  all_gather(c, g, kCpu, ag_in.data(), ag_b.data(), kM);
  broadcast(c, g, kCpu, bc_b.data(), kN, N / 2);
  send_recv(c, g, kCpu, ring_b);
  CHECK(rs_a == rs_b);
  CHECK(ag_a == ag_b);
  CHECK(bc_a == bc_b);
  CHECK(p2p_a == p2p_b);
}

TEST_CASE("a group's collectives run one at a time in the order issued, and any wait moves them",
          "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  Group& g = c.dp;
  std::vector<std::vector<float>> async = per_rank_data(4, 1000, 70000, "q"), blocking = async;
  std::vector<Handle> h = all_reduces_in_flight(c, g, async);
  // Waiting for a send_recv (never queued) moves the queued all-reduces too; then a host
  // all-reduce, issued last, finishes only after every one before it: each is done at once.
  std::vector<float> ring_in = normal(kM, on_rank("ring")), ring_out(kM);
  send_recv(c, g, kCpu,
            {{true, ring_in.data(), kM, g.next()}, {false, ring_out.data(), kM, g.prev()}});
  double one = 1;
  all_reduce_host(g, &one, 1, ReduceOp::Sum);
  CHECK(one == g.size);
  for (Handle& handle : h) CHECK(handle.test());
  for (auto& v : blocking) all_reduce(c, g, kCpu, v.data(), (int64_t)v.size(), ReduceOp::Sum);
  CHECK(async == blocking);
}

TEST_CASE("a Handle dropped without wait() still completes its collective", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  int N = c.dp.size;
  std::vector<float> buf = filled(4, 1);
  { Handle dropped = all_reduce_async(c, c.dp, kCpu, buf.data(), 4, ReduceOp::Sum); }
  CHECK(buf == filled(4, (float)N));
  Handle none;  // a default Handle has nothing pending
  CHECK(none.test());
  CHECK_FALSE(none.active());
  none.wait();
}

// ============================================================================
// Byte counters: what each rank sends under the ring algorithm (appendix A0)
// ============================================================================

// Elements are counted from the caller's arguments (its data argument's floats); bytes are
// charged by the ring formulas.
TEST_CASE("byte counters: all-reduce sends 2(N-1)K/N, reduce-scatter and all-gather (N-1)K/N",
          "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  Group& g = c.dp;
  int64_t N = g.size, r = g.rank;
  auto stats = [&](Coll k) { return g.stats[(int)k]; };

  const int64_t n = 12 * N;  // all-reduce elements: K = 4n bytes, a multiple of N
  std::vector<float> buf = normal(n, on_rank("buf")), big(n * N), small(n);
  all_reduce(c, g, kCpu, buf.data(), n, ReduceOp::Sum);
  all_reduce(c, g, kCpu, buf.data(), n, ReduceOp::Avg);
  CHECK(stats(Coll::AllReduce).calls == 2);
  CHECK(stats(Coll::AllReduce).elements == 2 * n);
  CHECK(stats(Coll::AllReduce).bytes == 2 * (2 * (N - 1) * (4 * n) / N));
  // reduce-scatter and all-gather: K is the whole buffer of n * N elements.
  reduce_scatter(c, g, kCpu, big.data(), small.data(), n, ReduceOp::Sum);
  all_gather(c, g, kCpu, small.data(), big.data(), n);
  CHECK(stats(Coll::ReduceScatter).calls == 1);
  CHECK(stats(Coll::ReduceScatter).elements == n * N);  // its input: N shards of n
  CHECK(stats(Coll::ReduceScatter).bytes == (N - 1) * (4 * n * N) / N);
  CHECK(stats(Coll::AllGather).calls == 1);
  CHECK(stats(Coll::AllGather).elements == n);  // its shard
  CHECK(stats(Coll::AllGather).bytes == (N - 1) * (4 * n * N) / N);
  // The chains: broadcast from 0 passes on everywhere but at rank N-1; reduce ends at rank 0.
  broadcast(c, g, kCpu, buf.data(), n, 0);
  reduce(c, g, kCpu, buf.data(), small.data(), n, ReduceOp::Sum, 0);
  CHECK(stats(Coll::Broadcast).bytes == (r == N - 1 ? 0 : 4 * n));
  CHECK(stats(Coll::Reduce).bytes == (r == 0 ? 0 : 4 * n));
  CHECK(stats(Coll::Broadcast).elements == n);
  CHECK(stats(Coll::Reduce).elements == n);
  gather(c, g, kCpu, small.data(), big.data(), n, 0);
  scatter(c, g, kCpu, big.data(), small.data(), n, 0);
  CHECK(stats(Coll::Gather).bytes == (r == 0 ? 0 : 4 * n));
  CHECK(stats(Coll::Scatter).bytes == (r == 0 ? (N - 1) * 4 * n : 0));
  CHECK(stats(Coll::Gather).elements == n);
  CHECK(stats(Coll::Scatter).elements == n);
  send_recv(c, g, kCpu, {{true, buf.data(), 7, g.next()}, {false, small.data(), 7, g.prev()}});
  barrier(c, g, kCpu);
  CHECK(stats(Coll::SendRecv).calls == 1);
  CHECK(stats(Coll::SendRecv).bytes == (N > 1 ? 4 * 7 : 0));  // the send half only
  CHECK(stats(Coll::SendRecv).elements == 7);
  CHECK(stats(Coll::Barrier).calls == 1);
  CHECK(stats(Coll::Barrier).bytes == 0);
  // One element: 2(N-1)*4/N is not whole for most N, and is rounded down.
  all_reduce(c, g, kCpu, buf.data(), 1, ReduceOp::Sum);
  CHECK(stats(Coll::AllReduce).bytes == 2 * (2 * (N - 1) * (4 * n) / N) + 2 * (N - 1) * 4 / N);
  CHECK(stats(Coll::AllReduce).elements == 2 * n + 1);
  // Other groups are charged nothing; a group of one counts calls and no bytes.
  for (int k = 0; k < (int)Coll::Count; k++) CHECK(c.world.stats[k].calls == 0);
  std::vector<float> before = buf;
  all_reduce(c, c.tp, kCpu, buf.data(), n, ReduceOp::Sum);
  CHECK(buf == before);
  CHECK(c.tp.stats[(int)Coll::AllReduce].calls == 1);
  CHECK(c.tp.stats[(int)Coll::AllReduce].bytes == 0);
  CHECK(c.tp.stats[(int)Coll::AllReduce].elements == n);
}

// ============================================================================
// Point to point
// ============================================================================

TEST_CASE("send_recv ring shift: each rank receives its previous neighbour's data", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  Group& g = c.dp;
  auto data_of = [](int rank, int tag) {
    std::vector<float> v;
    for (int i = 0; i < 6; i++) v.push_back(100.0f * rank + 10.0f * tag + i);
    return v;
  };
  std::vector<float> fwd = data_of(g.rank, 1), got = filled(6, -1);
  send_recv(c, g, kCpu, {{true, fwd.data(), 6, g.next()}, {false, got.data(), 6, g.prev()}});
  CHECK(got == data_of(g.prev(), 1));

  // Batched both ways at once, like a pipeline stage's send-forward-receive-backward: one call.
  std::vector<float> bwd = data_of(g.rank, 2), from_prev = filled(6, -1), from_next = filled(6, -1);
  send_recv(c, g, kCpu,
            {{true, fwd.data(), 6, g.next()},
             {true, bwd.data(), 6, g.prev()},
             {false, from_prev.data(), 6, g.prev()},
             {false, from_next.data(), 6, g.next()}});
  CHECK(from_prev == data_of(g.prev(), 1));
  CHECK(from_next == data_of(g.next(), 2));

  // Blocking send() and recv() between pairs (0,1), (2,3), ...; an odd last rank sits out.
  int partner = g.rank ^ 1;
  if (partner < g.size) {
    std::vector<float> in = filled(6, -1);
    if (g.rank % 2 == 0) {
      send(c, g, kCpu, fwd.data(), 6, partner);
      recv(c, g, kCpu, in.data(), 6, partner);
    } else {
      recv(c, g, kCpu, in.data(), 6, partner);
      send(c, g, kCpu, fwd.data(), 6, partner);
    }
    CHECK(in == data_of(partner, 1));
  }
}

// 16-bit messages (a bf16 residual stream between pipeline stages): the bits arrive unchanged
// (patterns no float would hold included: NaNs, subnormals, -0), and the byte counter charges
// 2 bytes an element.
TEST_CASE("send_recv moves bf16 and fp16 messages bit for bit, counted at 2 bytes", "[mpi]") {
  TestComm t(world_size(), 1, 1, 1);
  Comm& c = t.c;
  Group& g = c.dp;
  for (DType format : {DType::BF16, DType::F16}) {
    INFO(dtype_name(format));
    const int64_t n = 9, before = g.stats[(int)Coll::SendRecv].bytes;
    auto bits_of = [&](int rank) {
      std::vector<uint16_t> v = {0x7fc1, 0x0001, 0x8000, 0xffff};
      for (int i = (int)v.size(); i < n; i++) v.push_back((uint16_t)(977 * rank + 31 * i));
      return v;
    };
    std::vector<uint16_t> out = bits_of(g.rank), in(n, 0x1234);
    send_recv(c, g, kCpu,
              {{true, out.data(), n, g.next(), nullptr, format},
               {false, in.data(), n, g.prev(), nullptr, format}});
    CHECK(in == bits_of(g.prev()));
    CHECK(g.stats[(int)Coll::SendRecv].bytes - before == (g.size > 1 ? 2 * n : 0));
  }
}

// ============================================================================
// The process grid (DESIGN 4)
// ============================================================================

TEST_CASE(
    "the grid lays out every factorization dp x pp x cp x tp of the world as "
    "[dp][pp][cp][tp], tp fastest",
    "[mpi]") {
  int W = world_size();
  std::vector<std::vector<int>> shapes;
  for (int dp = 1; dp <= W; dp++)
    for (int pp = 1; pp <= W; pp++)
      for (int cp = 1; cp <= W; cp++)
        if (W % (dp * pp * cp) == 0) shapes.push_back({dp, pp, cp, W / (dp * pp * cp)});
  for (const auto& s : shapes) {
    int dp = s[0], pp = s[1], cp = s[2], tp = s[3];
    INFO("--dp " << dp << " --pp " << pp << " --cp " << cp << " --tp " << tp);
    TestComm t(dp, pp, cp, tp);
    Comm& c = t.c;
    const Grid& G = c.grid;
    int d = G.dp_rank, p = G.pp_rank, x = G.cp_rank, z = G.tp_rank;
    CHECK(G.world_rank == world_rank());
    CHECK(G.rank_of(d, p, x, z) == G.world_rank);
    CHECK((d < dp && p < pp && x < cp && z < tp));
    // The members each group must have, from the definition: all ranks agreeing on the others.
    std::vector<int> tp_m, cp_m, pp_m, dp_m, dp_cp_m, world_m;
    for (int i = 0; i < tp; i++) tp_m.push_back(G.rank_of(d, p, x, i));
    for (int i = 0; i < cp; i++) cp_m.push_back(G.rank_of(d, p, i, z));
    for (int i = 0; i < pp; i++) pp_m.push_back(G.rank_of(d, i, x, z));
    for (int i = 0; i < dp; i++) dp_m.push_back(G.rank_of(i, p, x, z));
    for (int i = 0; i < dp; i++)
      for (int j = 0; j < cp; j++) dp_cp_m.push_back(G.rank_of(i, p, j, z));
    for (int i = 0; i < W; i++) world_m.push_back(i);
    CHECK(c.tp.members == tp_m);
    CHECK(c.cp.members == cp_m);
    CHECK(c.pp.members == pp_m);
    CHECK(c.dp.members == dp_m);
    CHECK(c.dp_cp.members == dp_cp_m);
    CHECK(c.world.members == world_m);
    CHECK((c.tp.rank == z && c.cp.rank == x && c.pp.rank == p && c.dp.rank == d));
    CHECK(c.dp_cp.rank == d * cp + x);
    CHECK(c.dp_cp.size == dp * cp);
    CHECK((c.tp.size == tp && c.cp.size == cp && c.pp.size == pp && c.dp.size == dp));
    for (int i = 1; i < tp; i++) CHECK(c.tp.members[i] == c.tp.members[0] + i);  // neighbours
    // And the communicators really connect those ranks: summing world ranks gives the members'.
    for (Group* g : c.groups()) {
      float mine = (float)G.world_rank, want = 0;
      for (int m : g->members) want += m;
      all_reduce(c, *g, kCpu, &mine, 1, ReduceOp::Sum);
      CHECK(mine == want);
    }
  }
}

TEST_CASE("make_grid names the product of the flags and the mpirun -np that would fit", "[mpi]") {
  CHECK_THROWS_AS(make_grid(2, 1, 1, 2, 3, 0), UsageError);
  CHECK_THROWS_WITH(make_grid(2, 1, 1, 2, 3, 0),
                    Contains("--dp 2 x --pp 1 x --cp 1 x --tp 2 = 4 ranks") &&
                        Contains("mpirun started 3") && Contains("mpirun -np 4"));
  CHECK_THROWS_AS(make_grid(0, 1, 1, 3, 3, 0), UsageError);
  Grid g = make_grid(2, 2, 1, 2, 8, 5);  // 5 = ((1*2 + 0)*1 + 0)*2 + 1
  CHECK((g.dp_rank == 1 && g.pp_rank == 0 && g.cp_rank == 0 && g.tp_rank == 1));
}

TEST_CASE("comm_init refuses a bad --comm or grid on every rank alike, and auto on CPU is mpi",
          "[mpi]") {
  int W = world_size();
  CHECK_THROWS_WITH(comm_init(W, 1, 1, 1, "gloo", Device::CPU, kTimeout),
                    Contains("--comm gloo") && Contains("auto, nccl or mpi"));
  CHECK_THROWS_WITH(comm_init(W, 1, 1, 1, "nccl", Device::CPU, kTimeout),
                    Contains("--comm nccl needs one GPU per rank") && Contains("--comm mpi"));
  CHECK_THROWS_WITH(comm_init(W + 1, 1, 1, 1, "mpi", Device::CPU, kTimeout),
                    Contains("mpirun -np " + std::to_string(W + 1)));
  TestComm t(W, 1, 1, 1, "auto");
  CHECK(t.c.backend == Backend::MPI);
  CHECK(std::string(backend_name(t.c.backend)) == "mpi");
  CHECK(std::string(coll_name(Coll::ReduceScatter)) == "reduce_scatter");
}

TEST_CASE("NCCL or MPI per node: distinct GPU bus ids give nccl, a shared GPU or none mpi",
          "[mpi]") {
  // SLURM --gpus-per-task=1: every rank sees its own GPU as device 0, at its own bus id.
  CHECK(backend_for_node({"0000:1b:00.0", "0000:3b:00.0", "0000:5b:00.0", "0000:db:00.0"}) ==
        Backend::NCCL);
  CHECK(backend_for_node({"0000:1b:00.0"}) == Backend::NCCL);  // one rank, one GPU
  std::string why;
  // Two ranks on one GPU (device 0 of both, or 0 and 1 of a node with one): NCCL refuses it.
  CHECK(backend_for_node({"0000:1b:00.0", "0000:1b:00.0"}, &why) == Backend::MPI);
  CHECK_THAT(why, Contains("ranks 0 and 1") && Contains("0000:1b:00.0"));
  CHECK(backend_for_node({"0000:1b:00.0", "0000:3b:00.0", "0000:1b:00.0"}, &why) == Backend::MPI);
  CHECK_THAT(why, Contains("ranks 0 and 2"));
  // No GPU on any rank, or on one.
  CHECK(backend_for_node({"", ""}, &why) == Backend::MPI);
  CHECK_THAT(why, Contains("rank 0") && Contains("no GPU"));
  CHECK(backend_for_node({"0000:1b:00.0", ""}, &why) == Backend::MPI);
  CHECK_THAT(why, Contains("rank 1") && Contains("no GPU"));
}

TEST_CASE("--comm nccl on CUDA without a GPU per rank is refused on every rank, naming why",
          "[mpi]") {
  if (cuda_on_every_rank()) {
    WARN("SKIP: every rank sees a GPU here (the [gpu] cases cover that)");
    return;
  }
  int W = world_size();
  CHECK_THROWS_WITH(comm_init(W, 1, 1, 1, "nccl", Device::CUDA, kTimeout),
                    Contains("--comm nccl needs one GPU per rank") && Contains("no GPU") &&
                        Contains("--comm mpi"));
}

// ============================================================================
// GPU: device buffers, staged through host memory (MPI) or over NCCL
// ============================================================================

TEST_CASE("MPI backend: device buffers staged through host memory give the CPU results",
          "[mpi][gpu]") {
  if (!gpu_case_ready()) return;
  Context gpu = Context::create(Device::CUDA);
  Outputs on_gpu, on_cpu;
  {
    TestComm t(world_size(), 1, 1, 1, "mpi", Device::CUDA);
    on_gpu = every_collective(t.c, gpu);
  }
  {
    TestComm t(world_size(), 1, 1, 1, "mpi", Device::CPU);
    on_cpu = every_collective(t.c, kCpu);
  }
  // The same MPI calls on the same host data: bit-identical.
  CHECK(on_gpu.sum == on_cpu.sum);
  CHECK(on_gpu.avg == on_cpu.avg);
  CHECK(on_gpu.max == on_cpu.max);
  CHECK(on_gpu.reduce_scatter == on_cpu.reduce_scatter);
  CHECK(on_gpu.all_gather == on_cpu.all_gather);
  CHECK(on_gpu.broadcast == on_cpu.broadcast);
  CHECK(on_gpu.reduce == on_cpu.reduce);
  CHECK(on_gpu.gather == on_cpu.gather);
  CHECK(on_gpu.scatter == on_cpu.scatter);
  CHECK(on_gpu.ring == on_cpu.ring);
  gpu.destroy();
}

TEST_CASE("MPI staging: pinned buffers reused by ops in flight; the host waits for sent data only",
          "[mpi][gpu]") {
  if (!gpu_case_ready()) return;
  Context gpu = Context::create(Device::CUDA);
  {
    TestComm t(world_size(), 1, 1, 1, "mpi", Device::CUDA);
    Comm& c = t.c;
    Group& g = c.dp;
    int N = g.size;
    // Three rounds of four all-reduces in flight at once, one larger than a first staging
    // buffer (64 Ki floats): later rounds take the buffers the earlier ones gave back.
    for (int round = 0; round < 3; round++) {
      std::vector<std::vector<float>> x;
      std::vector<Tensor> bufs;
      std::vector<Handle> h;
      for (int k = 0; k < 4; k++) {
        int64_t n = k == 3 ? 100000 : 1000 + 777 * k;
        x.push_back(normal(n, on_rank("x" + std::to_string(round) + std::to_string(k))));
        bufs.push_back(on(gpu, x.back()));
      }
      for (int k = 0; k < 4; k++)
        h.push_back(
            all_reduce_async(c, g, gpu, bufs[k].f32(), (int64_t)x[k].size(), ReduceOp::Sum));
      for (int k = 3; k >= 0; k--) h[k].wait();
      for (int k = 0; k < 4; k++) {
        std::vector<float> want(x[k].size());
        MPI_Allreduce(x[k].data(), want.data(), (int)want.size(), MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);
        CHECK(outside_sum_bound(back(gpu, bufs[k]), want, abs_sum_over_ranks(x[k]), N) == 0);
      }
    }
    // The host waits once for an all-reduce (its input reaches the host), and for a broadcast
    // only on the root: the other ranks' buffers are only written, by a copy queued at the end.
    // (A group of one stages nothing: its collectives are local.)
    std::vector<float> v = normal(500, on_rank("b"));
    Tensor buf = on(gpu, v);
    uint64_t before = host_syncs();
    all_reduce(c, g, gpu, buf.f32(), 500, ReduceOp::Sum);
    CHECK(host_syncs() - before == (N > 1 ? 1u : 0u));
    before = host_syncs();
    broadcast(c, g, gpu, buf.f32(), 500, 0);
    CHECK(host_syncs() - before == (N > 1 && g.rank == 0 ? 1u : 0u));
    std::vector<float> root = back(gpu, buf);
    MPI_Bcast(root.data(), 500, MPI_FLOAT, 0, MPI_COMM_WORLD);  // rank 0's result, everywhere
    CHECK(back(gpu, buf) == root);
  }
  gpu.destroy();
}

TEST_CASE("NCCL collectives match the MPI ones, on any number of ranks from one", "[mpi][gpu]") {
  NcclCase n;  // agreed on by every rank
  if (!n.ready()) return;
  // Every group has a communicator: on one rank too, nothing is a local copy. Those of the same
  // ranks in one lane share one (comm_setup.cu: communicator_owners): dp, dp_cp and edp_cp (all
  // of the ranks here); pp with pp_grad; tp, cp and ep apart: five in all, the world joining the
  // first group of its ranks (dp's, or on one rank tp's).
  Comm& c = n.t->c;
  std::set<ncclComm_t> distinct;
  for (Group* g : c.groups()) {
    CHECK(g->nccl != nullptr);
    distinct.insert(g->nccl);
  }
  CHECK(distinct.size() == 5);
  CHECK((c.dp_cp.nccl == c.dp.nccl && c.edp_cp.nccl == c.dp.nccl && c.dp_cp.stream == c.dp.stream));
  CHECK((c.pp_grad.nccl == c.pp.nccl && c.tp.nccl != c.dp.nccl && c.ep.nccl != c.dp.nccl));
  CHECK(c.world.nccl == (world_size() > 1 ? c.dp.nccl : c.tp.nccl));
  Outputs nccl = every_collective(n.t->c, n.gpu), mpi;
  {
    TestComm t(world_size(), 1, 1, 1, "mpi", Device::CPU);
    mpi = every_collective(t.c, kCpu);
  }
  int N = world_size(), r = world_rank();
  std::vector<double> x_abs = abs_sum_over_ranks(normal(kN, on_rank("x")));
  std::vector<double> rs_abs = abs_sum_over_ranks(normal(kM * N, on_rank("rs")));
  rs_abs = std::vector<double>(rs_abs.begin() + r * kM, rs_abs.begin() + (r + 1) * kM);
  // NCCL adds in its own order (and averages by pre-scaling): sums agree within the bound.
  CHECK(outside_sum_bound(nccl.sum, mpi.sum, x_abs, N) == 0);
  CHECK(outside_sum_bound(nccl.avg, mpi.avg, x_abs, N, 1.0 / N) == 0);
  CHECK(outside_sum_bound(nccl.reduce_scatter, mpi.reduce_scatter, rs_abs, N) == 0);
  if (r == 1 % N)
    CHECK(outside_sum_bound(nccl.reduce, mpi.reduce, x_abs, N) == 0);
  else
    CHECK(nccl.reduce == mpi.reduce);
  CHECK(nccl.max == mpi.max);
  CHECK(nccl.all_gather == mpi.all_gather);
  CHECK(nccl.broadcast == mpi.broadcast);
  CHECK(nccl.gather == mpi.gather);
  CHECK(nccl.scatter == mpi.scatter);
  CHECK(nccl.ring == mpi.ring);
}

TEST_CASE("NCCL in-place reduce-scatter and all-gather (ZeRO's layout) equal MPI's", "[mpi][gpu]") {
  NcclCase n;
  if (!n.ready()) return;
  Comm& c = n.t->c;
  const Context& gpu = n.gpu;
  Group& g = c.dp;  // dp = world, same ranks in the same order
  int N = g.size, r = g.rank;
  std::vector<float> rs = normal(kM * N, on_rank("rs")), ag = normal(kM, on_rank("ag"));
  // Reduce-scatter in place: the output is this rank's chunk of the input (recv = send + r*kM).
  Tensor rs_buf = on(gpu, rs);  // [N * kM]
  reduce_scatter(c, g, gpu, rs_buf.f32(), rs_buf.f32() + r * kM, kM, ReduceOp::Sum);
  // All-gather in place: the input is this rank's slot of the output (send = recv + r*kM).
  std::vector<float> ag_full = filled(kM * N, -1);
  std::copy(ag.begin(), ag.end(), ag_full.begin() + r * kM);
  Tensor ag_buf = on(gpu, ag_full);  // [N * kM]
  all_gather(c, g, gpu, ag_buf.f32() + r * kM, ag_buf.f32(), kM);
  std::vector<float> rs_got = back(gpu, rs_buf), ag_got = back(gpu, ag_buf);

  std::vector<float> rs_want(kM), ag_want(kM * N);
  MPI_Reduce_scatter_block(rs.data(), rs_want.data(), kM, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allgather(ag.data(), kM, MPI_FLOAT, ag_want.data(), kM, MPI_FLOAT, MPI_COMM_WORLD);
  std::vector<double> rs_abs = abs_sum_over_ranks(rs);
  rs_abs = std::vector<double>(rs_abs.begin() + r * kM, rs_abs.begin() + (r + 1) * kM);
  std::vector<float> mine(rs_got.begin() + r * kM, rs_got.begin() + (r + 1) * kM);
  CHECK(outside_sum_bound(mine, rs_want, rs_abs, N) == 0);
  CHECK(ag_got == ag_want);
}

TEST_CASE("NCCL handles: test() polls the event to completion, several ops in flight at once",
          "[mpi][gpu]") {
  NcclCase n;
  if (!n.ready()) return;
  Comm& c = n.t->c;
  const Context& gpu = n.gpu;
  Group& g = c.dp;
  int N = g.size;
  std::vector<std::vector<float>> x;
  std::vector<Tensor> bufs;
  std::vector<Handle> h;
  for (int k = 0; k < 3; k++) {
    x.push_back(normal(1000 + 333 * k, on_rank("x" + std::to_string(k))));
    bufs.push_back(on(gpu, x.back()));
  }
  for (int k = 0; k < 3; k++)
    h.push_back(all_reduce_async(c, g, gpu, bufs[k].f32(), (int64_t)x[k].size(), ReduceOp::Sum));
  Handle barrier_handle = barrier_async(c, g, gpu);
  while (!h[1].test()) std::this_thread::yield();  // the host polls; nothing blocks
  CHECK(h[1].test());                              // idempotent once done
  barrier_handle.wait();
  h[2].wait();
  h[0].wait();
  CHECK_FALSE(h[0].active());
  for (int k = 0; k < 3; k++) {
    std::vector<float> want(x[k].size());
    MPI_Allreduce(x[k].data(), want.data(), (int)want.size(), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    CHECK(outside_sum_bound(back(gpu, bufs[k]), want, abs_sum_over_ranks(x[k]), N) == 0);
  }
}

// Run by tools/gpu_check.sh as `mpirun -np 1 build/mpi_tests "[.stuck-nccl]"`: the job must end
// with the timeout message a few seconds after the 2 s deadline (ncclCommAbort gets up to 10 s),
// long before the spinning kernel lets go (120 s).
TEST_CASE("an NCCL all-reduce whose input never becomes ready ends the job at --comm-timeout",
          "[.stuck-nccl]") {
  if (!named("[.stuck-nccl]") || !gpu_case_ready()) return;
  Context gpu = Context::create(Device::CUDA);
  Comm c = comm_init(world_size(), 1, 1, 1, "nccl", Device::CUDA, 2);
  Tensor x = on(gpu, filled(1, 1));
  all_reduce(c, c.world, gpu, x.f32(), 1, ReduceOp::Sum);  // NCCL connects here, not below
  // The compute stream is busy for 120 s and the all-reduce waits for it (an event on the comm
  // stream), so its handle cannot finish: after 2 s the host aborts the communicator and the job.
  spin_for_ns<<<1, 1, 0, gpu.stream>>>(120ull * 1000 * 1000 * 1000);
  all_reduce(c, c.world, gpu, x.f32(), 1, ReduceOp::Sum);
  FAIL("all_reduce returned although its input was never ready");
}

// Run by tools/gpu_check.sh as `mpirun -np 1 build/mpi_tests "[.stuck-device]"`: a host wait
// for the device outside any collective (here a reduction's result, read back) is bounded by
// --comm-timeout too: the job ends with its message a few seconds after the 2 s deadline.
TEST_CASE("a reduction read back while the device never finishes ends the job at --comm-timeout",
          "[.stuck-device]") {
  if (!named("[.stuck-device]") || !gpu_case_ready()) return;
  Context gpu = Context::create(Device::CUDA);
  Comm c = comm_init(world_size(), 1, 1, 1, "nccl", Device::CUDA, 2);  // the bound: 2 s
  Tensor x = on(gpu, filled(1, 1));
  spin_for_ns<<<1, 1, 0, gpu.stream>>>(120ull * 1000 * 1000 * 1000);
  sum(gpu, x);
  FAIL("sum returned although the device never finished");
}
