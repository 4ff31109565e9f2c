// test_reference.cu: the multi-rank pieces against references written here in float64, on every
// world size the suite runs (2, 3, 4, 8): the vocab-parallel cross-entropy on large and skewed
// logits, the hand-written ring all-reduce on awkward counts, in-place reduce-scatter and
// all-gather (MPI forbids overlapping buffers), and a golden checkpoint loaded into tp shards
// and assembled again, byte for byte.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "../golden.cuh"
#include "../reference.cuh"
#include "data_parallel.cuh"
#include "model.cuh"
#include "runtime/ops.cuh"
#include "tensor_parallel.cuh"

namespace {

const Context kCpu;
constexpr double kUnit = 0x1p-24;  // fp32 unit roundoff

// A communicator on the whole world, as dp (or tp) = world, freed at the end of the case.
struct WorldComm {
  Comm c;
  TensorParallel tp;
  explicit WorldComm(bool as_tp) {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    c = comm_init(as_tp ? 1 : n, 1, 1, as_tp ? n : 1, "mpi", Device::CPU, 60);
    tp.comm = &c;
  }
  int size() const { return c.grid.world_size; }
  int rank() const { return c.grid.world_rank; }
  ~WorldComm() { comm_destroy(c); }
};
// Rank r's stream of inputs: ranks differ, and any rank can recompute any other's.
std::string of_rank(const std::string& name, int r) {
  return name + ".rank" + std::to_string(r);
}

// The MPI profiling interface: these definitions take the place of the library's for the whole
// test binary (comm.cu's calls included), count the calls whose send and receive buffers
// overlap, and pass every call on to the library's PMPI_ entry point. Counts are of floats
// (the collectives carry MPI_FLOAT only).
int overlapping_mpi_calls = 0;
void note_overlap(const void* send, int64_t send_floats, const void* recv, int64_t recv_floats) {
  const char *s = (const char*)send, *r = (const char*)recv;
  if (send == MPI_IN_PLACE || !s || !r) return;
  overlapping_mpi_calls +=
      s < r + sizeof(float) * recv_floats && r < s + sizeof(float) * send_floats;
}
int group_size(MPI_Comm comm) {
  int n = 1;
  PMPI_Comm_size(comm, &n);
  return n;
}

}  // namespace

extern "C" int MPI_Ireduce_scatter_block(const void* send, void* recv, int count, MPI_Datatype t,
                                         MPI_Op op, MPI_Comm comm, MPI_Request* request) {
  note_overlap(send, (int64_t)count * group_size(comm), recv, count);
  return PMPI_Ireduce_scatter_block(send, recv, count, t, op, comm, request);
}
extern "C" int MPI_Iallgather(const void* send, int send_count, MPI_Datatype send_type, void* recv,
                              int recv_count, MPI_Datatype recv_type, MPI_Comm comm,
                              MPI_Request* request) {
  note_overlap(send, send_count, recv, (int64_t)recv_count * group_size(comm));
  return PMPI_Iallgather(send, send_count, send_type, recv, recv_count, recv_type, comm, request);
}

// Guards: the max all-reduced as a sum (or not at all: each rank shifting by its own max, which
// with logits 10 +- 25 underflows a whole slice's exponentials and yields -inf or nan at tp 8),
// the sum of exponentials not rescaled to the global max, the target logit taken from the wrong
// rank's slice, and a backward normalised by the local sum. test_tp.cu uses N(0,1) logits only.
TEST_CASE("vocab-parallel cross-entropy of large and skewed logits matches a float64 one",
          "[mpi][reference]") {
  WorldComm w(true);
  const int n = w.size(), r = w.rank(), Vl = 7, V = Vl * n, v0 = r * Vl, N = 8;
  std::vector<float> logits =
      reference_normal(N * V, "logits", 10, 25);  // the full [N, V], every rank
  for (int v = 0; v < V; v++) {
    logits[4 * V + v] = v < V - Vl ? -1000.0f + v : 80.0f - v;  // max on the last rank only
    logits[5 * V + v] = v < Vl ? 60.0f + v : -3000.0f;          // max on rank 0, the rest tiny
    logits[6 * V + v] = 88.0f;                                  // near fp32's exp overflow
    logits[7 * V + v] = -500.0f - (float)v;                     // every logit very negative
  }
  std::vector<int32_t> targets(N);
  for (int i = 0; i < N; i++) targets[i] = (i * 11 + 2) % V;  // on several ranks' slices
  targets[4] = 0, targets[5] = V - 1;                         // far from the row's maximum
  Tensor local = empty({N, Vl}, Mem::Workspace);              // [N, V/tp]
  load_block(local, logits.data(), 0, v0, V);
  std::vector<int32_t> lt = local_vocab_ids(targets.data(), N, v0, Vl);
  Tensor ltgt = empty({N}, Mem::Workspace, Device::CPU, DType::I32);
  from_host(ltgt, lt.data());
  Tensor losses = empty({N}, Mem::Workspace), stats = empty({N, 2}, Mem::Workspace);
  Tensor dlogits = empty({N, Vl}, Mem::Workspace);
  vocab_parallel_cross_entropy_forward(w.tp, kCpu, losses, stats, local, ltgt);
  vocab_parallel_cross_entropy_backward(w.tp, kCpu, dlogits, local, stats, ltgt, 0.5f);
  std::vector<float> got = to_host_floats(losses), grad = to_host_floats(dlogits);
  for (int i = 0; i < N; i++) {
    double lse = logsumexp64(&logits[i * V], V), want = lse - logits[i * V + targets[i]];
    // fp32: a difference of terms up to |lse| ~ 500 (ulp 3e-5). inf or nan fails.
    INFO("rank " << r << " of " << n << ", row " << i << ": " << got[i] << " vs " << want);
    REQUIRE(std::isfinite(got[i]));
    REQUIRE(std::abs(got[i] - want) <= ce_loss_tolerance(lse));
    for (int v = 0; v < Vl; v++) {
      double p = std::exp(logits[i * V + v0 + v] - lse);
      // The probability inherits the loss's absolute error as a relative one: ~1e-4 of 0.5.
      REQUIRE(std::abs(grad[i * Vl + v] - 0.5 * (p - (v0 + v == targets[i]))) <= 1e-4);
    }
  }
}

// Guards: chunk boundaries that drop or repeat elements when N does not divide the count
// (chunk_begin rounding), a step count off by one (a chunk summed over N-1 ranks, or not passed
// on), the wrong neighbour, writes past the end, and counts smaller than N (empty chunks).
TEST_CASE("ring all-reduce equals a float64 sum for counts 0, 1, N-1, N+1 and a large prime",
          "[mpi][reference]") {
  WorldComm w(false);
  const int n = w.size(), r = w.rank();
  for (int64_t count : {int64_t(0), int64_t(1), int64_t(n - 1), int64_t(n + 1), int64_t(100003)}) {
    INFO("count " << count << " on " << n << " ranks");
    std::vector<float> buf = reference_normal(count, of_rank("ring", r));
    buf.push_back(12345.0f);  // a sentinel just past the end: nothing may write it
    std::vector<double> want(count, 0), abs_sum(count, 0);
    for (int q = 0; q < n; q++) {
      std::vector<float> x = reference_normal(count, of_rank("ring", q));
      for (int64_t i = 0; i < count; i++) want[i] += x[i], abs_sum[i] += std::abs(x[i]);
    }
    ring_all_reduce(w.c, w.c.dp, kCpu, buf.data(), count);
    REQUIRE(buf[count] == 12345.0f);
    // N terms added in one order: within (N-1) u sum|x| of the exact sum.
    int64_t bad = 0;
    for (int64_t i = 0; i < count; i++)
      bad += !(std::abs(buf[i] - want[i]) <= (n - 1) * kUnit * abs_sum[i] + 1e-30);
    REQUIRE(bad == 0);
    // Every rank ends with the same bits (the all-gather phase copies, it never re-adds).
    std::vector<float> first(buf.begin(), buf.end() - 1);
    MPI_Bcast(first.data(), (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    REQUIRE(std::equal(first.begin(), first.end(), buf.begin()));
  }
}

// Guards: an overlap test that misses a shared first or last element, or calls touching ranges
// overlapping (which would copy every ZeRO shard for nothing).
TEST_CASE("buffers_overlap: shared elements, not touching ranges", "[mpi][reference]") {
  float x[16];
  const int64_t f = sizeof(float);  // the ranges in bytes: n floats are n * f
  REQUIRE(buffers_overlap(x, 4 * f, x, 4 * f));
  REQUIRE(buffers_overlap(x, 4 * f, x + 3, 4 * f));  // the last element of a is the first of b
  REQUIRE(buffers_overlap(x + 3, 4 * f, x, 4 * f));
  REQUIRE(buffers_overlap(x + 4, 2 * f, x, 16 * f));  // inside
  REQUIRE(!buffers_overlap(x, 4 * f, x + 4, 4 * f));  // touching
  REQUIRE(!buffers_overlap(x + 4, 4 * f, x, 4 * f));
  REQUIRE(!buffers_overlap(x, 4 * f, nullptr, 4 * f));  // no output (a non-root rank)
  REQUIRE(!buffers_overlap(x, 0, x, 4 * f));            // nothing sent
}

// Guards: in-place calls handed to MPI with overlapping send and receive buffers (forbidden by
// the standard: results may be garbage), and in-place slots computed from the wrong rank.
TEST_CASE(
    "in-place reduce-scatter and all-gather (recv = send + rank * count) give float64 sums "
    "and exact copies",
    "[mpi][reference]") {
  WorldComm w(false);
  const int n = w.size(), r = w.rank();
  const int64_t count = 1001;
  overlapping_mpi_calls = 0;
  std::vector<float> buf = reference_normal(count * n, of_rank("rs", r));  // [n, count]
  std::vector<double> want(count, 0), abs_sum(count, 0);
  for (int q = 0; q < n; q++) {
    std::vector<float> x = reference_normal(count * n, of_rank("rs", q));
    for (int64_t i = 0; i < count; i++)
      want[i] += x[r * count + i], abs_sum[i] += std::abs(x[r * count + i]);
  }
  reduce_scatter(w.c, w.c.dp, kCpu, buf.data(), buf.data() + r * count, count, ReduceOp::Sum);
  int64_t bad = 0;  // a library reduction of N terms, any order: within (N-1) u sum|x|
  for (int64_t i = 0; i < count; i++)
    bad += !(std::abs(buf[r * count + i] - want[i]) <= (n - 1) * kUnit * abs_sum[i]);
  REQUIRE(bad == 0);

  std::vector<float> gathered(count * n, -1.0f);
  std::vector<float> mine = reference_normal(count, of_rank("ag", r));
  std::copy(mine.begin(), mine.end(), gathered.begin() + r * count);
  all_gather(w.c, w.c.dp, kCpu, gathered.data() + r * count, gathered.data(), count);
  for (int q = 0; q < n; q++) {
    std::vector<float> x = reference_normal(count, of_rank("ag", q));
    REQUIRE(std::equal(x.begin(), x.end(), gathered.begin() + q * count));
  }
  // Correct values do not prove a legal call (MPI may happen to cope with overlap): MPI itself
  // must never have seen overlapping buffers.
  REQUIRE(overlapping_mpi_calls == 0);
}

// Guards: a tp shard loaded from, or assembled into, the wrong rows or columns, or transposed
// on the way in and back out (which a save/load round trip alone cannot see).
TEST_CASE("a transformers checkpoint loaded into tp shards is assembled into the same bytes",
          "[mpi][reference]") {
  WorldComm w(true);
  const int n = w.size();
  if (4 % n != 0) {  // the fixtures have 4 heads, ffn 32 and vocab 32
    WARN("SKIP: the golden fixtures (4 heads) cannot be split over tp " << n);
    return;
  }
  std::string tmp = w.rank() == 0 ? make_temp_dir() : "";
  for (const std::string& name : kFixtures) {
    INFO("fixture " << name << " at tp " << n);
    Golden g = read_golden(name);
    Model model = build_model(g.cfg, Device::CPU, 1, w.tp);
    load_checkpoint_shards(model, model.tp.group(), g.dir, model.named_params, nullptr);
    std::vector<NamedTensor> whole = whole_tensors(model, model.tp.group(), model.named_params);
    if (w.rank() != 0) continue;
    save_checkpoint(tmp + "/" + name, g.cfg, whole, nullptr, g.dtype);
    require_fixture_bytes(tmp + "/" + name + "/model.safetensors", g);
  }
  if (w.rank() == 0) std::filesystem::remove_all(tmp);
}
