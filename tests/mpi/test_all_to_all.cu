// test_all_to_all.cu: all-to-all with variable counts (comm.cuh), the collective of expert
// parallelism's dispatch and combine, on 2..8 MPI ranks ([all_to_all]). What each rank must
// receive is computed here from two formulas, never by the code under test: how many elements
// rank s sends to rank d, and the bits of element i of that segment. The counts are uneven and
// include zeros (a rank that receives nothing at all, one that sends nothing at all, pairs that
// exchange nothing); fp32, bf16 and fp16 travel bit for bit, there and back; the byte counters
// charge what a rank sends to the others; exchange_counts returns the transpose of the counts.
// [gpu]: the same on device buffers, staged through host memory (MPI) and over NCCL. The hidden
// [.stuck-*] cases (run by tests/test_safety.cu) leave rank 1 asleep past a 2 s --comm-timeout.
// Run as: mpirun -np N build/mpi_tests "[all_to_all]"
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpu_ranks.cuh"
#include "runtime/comm.cuh"
#include "runtime/dtype.cuh"
#include "world.cuh"

namespace {

const Context kCpu;
constexpr double kTimeout = 60;  // a broken collective stops the run after a minute, never hangs

struct TestComm {
  Comm c;
  TestComm(int dp, int tp, const std::string& backend = "mpi", Device device = Device::CPU,
           double timeout_s = kTimeout)
      : c(comm_init(dp, 1, 1, tp, backend, device, timeout_s)) {}
  ~TestComm() { comm_destroy(c); }
};

// ---- the two formulas: counts, and the bits of every element ----

// How many elements rank s sends to rank d of a group of N, times `scale`.
//   pattern 0: the last rank receives nothing at all (so every rank sends nothing to one peer);
//              every other pair exchanges 1..5 elements, unevenly.
//   pattern 1: rank 0 sends nothing at all; the others send (s + 2d + 1) mod 3: zero for some
//              pairs, some segments to oneself included.
// (A group of one keeps its one segment, `scale` elements, in both.)
constexpr int kPatterns = 2;
int64_t count_of(int pattern, int s, int d, int N, int64_t scale) {
  if (pattern == 0) return N > 1 && d == N - 1 ? 0 : scale * (1 + (2 * s + 3 * d + s * d) % 5);
  return N > 1 && s == 0 ? 0 : scale * ((s + 2 * d + 1) % 3);
}
std::vector<int64_t> sends_of(int pattern, int rank, int N, int64_t scale) {
  std::vector<int64_t> counts;
  for (int d = 0; d < N; d++) counts.push_back(count_of(pattern, rank, d, N, scale));
  return counts;
}
std::vector<int64_t> receives_of(int pattern, int rank, int N, int64_t scale) {
  std::vector<int64_t> counts;
  for (int s = 0; s < N; s++) counts.push_back(count_of(pattern, s, rank, N, scale));
  return counts;
}
constexpr int64_t kScales[] = {1, 2000};  // a few elements, and segments of tens of KiB
constexpr int64_t kStride = 1 << 14;      // more than any segment's length (5 x 2000)

// Element i of the segment rank s sends to rank d, as bits of `t`. fp32: the integer
// (s*N + d) * 2^14 + i, below 2^24 for N < 32, so exact and different for every element.
// bf16 and fp16: a finite positive 16-bit pattern in [0x3C00, 0x5C00), varying with s, d and i.
uint32_t element_bits(DType t, int s, int d, int N, int64_t i) {
  if (t == DType::F32) {
    float v = (float)(((int64_t)s * N + d) * kStride + i);
    uint32_t bits;
    memcpy(&bits, &v, 4);
    return bits;
  }
  return 0x3C00 + (uint32_t)(((s * 8 + d) * 97 + i) % 0x2000);
}

// x in format t (rounded to nearest even for bf16 and fp16), as bits.
uint32_t rounded_bits(DType t, float x) {
  if (t == DType::BF16) return float_to_bf16(x);
  if (t == DType::F16) return float_to_fp16(x);
  uint32_t bits;
  memcpy(&bits, &x, 4);
  return bits;
}

using Bytes = std::vector<uint8_t>;
void put(Bytes& b, DType t, int64_t k, uint32_t bits) {
  const size_t E = dtype_size(t);
  uint16_t half = (uint16_t)bits;
  memcpy(b.data() + k * E, E == 4 ? (const void*)&bits : (const void*)&half, E);
}
constexpr int64_t kGuard = 5;         // elements past the end of every receive buffer
constexpr uint8_t kUntouched = 0xA5;  // what a receive buffer holds before the call

// What rank `me` sends: segment d (rank-major) holds element_bits(t, me, d, ...).
Bytes send_buffer(DType t, int me, const std::vector<int64_t>& send_counts) {
  const int N = (int)send_counts.size();
  int64_t total = 0;
  for (int64_t n : send_counts) total += n;
  Bytes b(total * dtype_size(t));
  int64_t k = 0;
  for (int d = 0; d < N; d++)
    for (int64_t i = 0; i < send_counts[d]; i++) put(b, t, k++, element_bits(t, me, d, N, i));
  return b;
}
// What rank `me` must receive: segment s holds element_bits(t, s, me, ...); then the guard,
// untouched.
Bytes expected_receive(DType t, int me, const std::vector<int64_t>& recv_counts) {
  const int N = (int)recv_counts.size();
  int64_t total = 0;
  for (int64_t n : recv_counts) total += n;
  Bytes b((total + kGuard) * dtype_size(t), kUntouched);
  int64_t k = 0;
  for (int s = 0; s < N; s++)
    for (int64_t i = 0; i < recv_counts[s]; i++) put(b, t, k++, element_bits(t, s, me, N, i));
  return b;
}
// The elements (of `t`) where two buffers differ.
int64_t elements_differing(const Bytes& got, const Bytes& want, DType t) {
  if (got.size() != want.size()) return -1;
  const size_t E = dtype_size(t);
  int64_t bad = 0;
  for (size_t k = 0; k < want.size(); k += E) bad += memcmp(&got[k], &want[k], E) != 0;
  return bad;
}

// ---- one call, on the host or on device buffers ----

// A buffer on ctx's device holding `bytes` (at least one byte allocated on CUDA).
struct DeviceBytes {
  const Context& ctx;
  Bytes host;
  void* device = nullptr;
  DeviceBytes(const Context& context, const Bytes& bytes) : ctx(context), host(bytes) {
    if (ctx.device == Device::CPU) return;
    CUDA_CHECK(cudaMalloc(&device, std::max<size_t>(1, host.size())));
    if (!host.empty())
      CUDA_CHECK(cudaMemcpy(device, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  void* ptr() { return ctx.device == Device::CPU ? (void*)host.data() : device; }
  Bytes read() {
    if (ctx.device == Device::CPU) return host;
    ctx.synchronize();
    Bytes out(host.size());
    if (!out.empty())
      CUDA_CHECK(cudaMemcpy(out.data(), device, out.size(), cudaMemcpyDeviceToHost));
    return out;
  }
  ~DeviceBytes() {
    if (device) CUDA_CHECK(cudaFree(device));
  }
};

// Runs all_to_all_v of `t` on g under ctx from `send`, into a receive buffer of `recv_size`
// bytes filled with kUntouched; returns that buffer afterwards.
Bytes run_all_to_all(Comm& c, Group& g, const Context& ctx, DType t, const Bytes& send,
                     const std::vector<int64_t>& send_counts, size_t recv_size,
                     const std::vector<int64_t>& recv_counts) {
  DeviceBytes in(ctx, send), out(ctx, Bytes(recv_size, kUntouched));
  all_to_all_v(c, g, ctx, in.ptr(), send_counts, out.ptr(), recv_counts, t);
  return out.read();
}

// Every pattern, scale and dtype on group g: each rank receives exactly the formula's segments,
// nothing past them.
void check_every_pattern(Comm& c, Group& g, const Context& ctx) {
  const int N = g.size, me = g.rank;
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (int pattern = 0; pattern < kPatterns; pattern++)
      for (int64_t scale : kScales) {
        INFO(g.name << " of " << N << ", rank " << me << ", " << dtype_name(t) << ", pattern "
                    << pattern << ", scale " << scale);
        std::vector<int64_t> sends = sends_of(pattern, me, N, scale);
        std::vector<int64_t> receives = receives_of(pattern, me, N, scale);
        Bytes want = expected_receive(t, me, receives);
        Bytes got =
            run_all_to_all(c, g, ctx, t, send_buffer(t, me, sends), sends, want.size(), receives);
        CHECK(elements_differing(got, want, t) == 0);
      }
}

// Every factorization W = dp x tp: the all-to-all on dp, several groups at once when tp > 1
// (group ranks, not world ranks, address the segments), a local copy when dp = 1.
template <typename Fn>
void on_every_dp_group(const Fn& fn) {
  const int W = world_size();
  for (int dp = 1; dp <= W; dp++) {
    if (W % dp != 0) continue;
    TestComm tc(dp, W / dp);
    fn(tc.c, tc.c.dp);
  }
}

bool named(const std::string& tag) {
  for (const std::string& spec : Catch::getCurrentContext().getConfig()->getTestsOrTags())
    if (spec == tag) return true;
  return false;
}

// A communicator with every group on NCCL, or a SKIP on every rank alike (no GPU, or ranks
// sharing one).
struct NcclCase {
  Context gpu;
  std::unique_ptr<TestComm> t;
  NcclCase() {
    if (!gpu_case_ready()) return;
    gpu = Context::create(Device::CUDA);
    try {
      t = std::make_unique<TestComm>(world_size(), 1, "nccl", Device::CUDA);
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

}  // namespace

// ============================================================================
// Values
// ============================================================================

TEST_CASE(
    "the counts of the tests are uneven, with zeros: a rank receives nothing at all, one "
    "sends nothing at all, some pairs exchange nothing",
    "[mpi][all_to_all]") {
  // The formulas themselves, so that the cases below cover what they claim on every N.
  for (int N : {2, 3, 4, 8}) {
    INFO("N = " << N);
    int64_t received_by_last = 0, sent_by_0 = 0, zero_pairs = 0, sizes_seen = 0;
    std::vector<bool> seen(6, false);
    for (int s = 0; s < N; s++)
      for (int d = 0; d < N; d++) {
        received_by_last += d == N - 1 ? count_of(0, s, d, N, 1) : 0;
        sent_by_0 += s == 0 ? count_of(1, s, d, N, 1) : 0;
        zero_pairs += s != d && count_of(0, s, d, N, 1) == 0;
        seen[count_of(0, s, d, N, 1)] = true;
      }
    for (bool b : seen) sizes_seen += b;
    CHECK(received_by_last == 0);
    CHECK(sent_by_0 == 0);
    CHECK(zero_pairs >= 1);
    CHECK(sizes_seen >= 3);  // 0 and at least two other lengths
  }
}

TEST_CASE(
    "all-to-all-v: rank d receives from every rank s the segment s addressed to it, in "
    "rank order, for uneven counts with zeros, in fp32, bf16 and fp16",
    "[mpi][all_to_all]") {
  on_every_dp_group([](Comm& c, Group& g) { check_every_pattern(c, g, kCpu); });
}

TEST_CASE(
    "dispatch and combine: an all-to-all-v there and back with the counts swapped returns "
    "every element bit for bit (bf16, fp16, fp32)",
    "[mpi][all_to_all]") {
  TestComm tc(world_size(), 1);
  Comm& c = tc.c;
  Group& g = c.dp;
  const int N = g.size, me = g.rank;
  for (DType t : {DType::BF16, DType::F16, DType::F32})
    for (int pattern = 0; pattern < kPatterns; pattern++) {
      INFO(dtype_name(t) << ", pattern " << pattern);
      std::vector<int64_t> sends = sends_of(pattern, me, N, 37);
      std::vector<int64_t> receives = receives_of(pattern, me, N, 37);
      // Values that are not the formula's: random bf16/fp16/fp32 bits of a normal sample.
      int64_t total = 0;
      for (int64_t n : sends) total += n;
      std::vector<float> x(total);
      Tensor xt{nullptr, x.data(), {total}, DType::F32, Device::CPU};
      if (total > 0) init_normal(xt, 5, "tokens.rank" + std::to_string(me), 1.0f);
      Bytes tokens(total * dtype_size(t));
      for (int64_t k = 0; k < total; k++) put(tokens, t, k, rounded_bits(t, x[k]));
      int64_t held = 0;
      for (int64_t n : receives) held += n;
      Bytes at_experts(held * dtype_size(t)), back(tokens.size());
      all_to_all_v_async(c, g, kCpu, tokens.data(), sends, at_experts.data(), receives, t).wait();
      all_to_all_v(c, g, kCpu, at_experts.data(), receives, back.data(), sends, t);
      CHECK(elements_differing(back, tokens, t) == 0);
    }
}

TEST_CASE(
    "several all-to-all-v in flight at once, waited in reverse order, each equal the "
    "formula",
    "[mpi][all_to_all]") {
  TestComm tc(world_size(), 1);
  Comm& c = tc.c;
  Group& g = c.dp;
  const int N = g.size, me = g.rank;
  struct Op {
    DType t;
    int pattern;
    int64_t scale;
    std::vector<int64_t> sends, receives;
    Bytes in, out, want;
  };
  std::vector<Op> ops = {
      {DType::F32, 0, 2000}, {DType::BF16, 1, 3}, {DType::F16, 0, 7}, {DType::F32, 1, 1}};
  std::vector<Handle> h;
  for (Op& op : ops) {
    op.sends = sends_of(op.pattern, me, N, op.scale);
    op.receives = receives_of(op.pattern, me, N, op.scale);
    op.in = send_buffer(op.t, me, op.sends);
    op.want = expected_receive(op.t, me, op.receives);
    op.out = Bytes(op.want.size(), kUntouched);
    h.push_back(
        all_to_all_v_async(c, g, kCpu, op.in.data(), op.sends, op.out.data(), op.receives, op.t));
  }
  while (!h[1].test()) std::this_thread::yield();
  for (int k = (int)h.size() - 1; k >= 0; k--) h[k].wait();
  for (Op& op : ops) {
    INFO(dtype_name(op.t) << ", pattern " << op.pattern << ", scale " << op.scale);
    CHECK(elements_differing(op.out, op.want, op.t) == 0);
  }
}

// ============================================================================
// The counts
// ============================================================================

TEST_CASE("exchange_counts: element s of the result is what rank s sends to this rank",
          "[mpi][all_to_all]") {
  on_every_dp_group([](Comm& c, Group& g) {
    const int N = g.size, me = g.rank;
    INFO(g.name << " of " << N << ", rank " << me);
    for (int pattern = 0; pattern < kPatterns; pattern++)
      CHECK(exchange_counts(c, g, sends_of(pattern, me, N, 3)) == receives_of(pattern, me, N, 3));
    // int64 all the way: counts past 2^32.
    std::vector<int64_t> big, want;
    for (int p = 0; p < N; p++) big.push_back((int64_t)5e9 + 1000 * me + p);
    for (int p = 0; p < N; p++) want.push_back((int64_t)5e9 + 1000 * p + me);
    CHECK(exchange_counts(c, g, big) == want);
    // Bookkeeping, not traffic: nothing is counted.
    for (int k = 0; k < (int)Coll::Count; k++) CHECK(g.stats[k].calls == 0);
  });
}

TEST_CASE("exchange_counts then all_to_all_v: counts known only to their senders arrive",
          "[mpi][all_to_all]") {
  TestComm tc(world_size(), 1);
  Comm& c = tc.c;
  Group& g = c.dp;
  const int N = g.size, me = g.rank;
  // Each sender picks its own counts; the receivers learn them from exchange_counts only.
  std::vector<int64_t> sends = sends_of(1, me, N, 11);
  std::vector<int64_t> receives = exchange_counts(c, g, sends);
  CHECK(receives == receives_of(1, me, N, 11));
  Bytes want = expected_receive(DType::BF16, me, receives_of(1, me, N, 11));
  Bytes got = run_all_to_all(c, g, kCpu, DType::BF16, send_buffer(DType::BF16, me, sends), sends,
                             want.size(), receives);
  CHECK(elements_differing(got, want, DType::BF16) == 0);
}

// ============================================================================
// Byte counters: the segments a rank sends to the other ranks
// ============================================================================

TEST_CASE(
    "byte counters: all-to-all-v is charged the bytes a rank sends to other ranks, its own "
    "segment excluded; elements are its whole send buffer",
    "[mpi][all_to_all]") {
  TestComm tc(world_size(), 1);
  Comm& c = tc.c;
  Group& g = c.dp;
  const int N = g.size, me = g.rank;
  int64_t calls = 0, elements = 0, bytes = 0;
  for (DType t : {DType::F32, DType::BF16})
    for (int pattern = 0; pattern < kPatterns; pattern++) {
      std::vector<int64_t> sends = sends_of(pattern, me, N, 10);
      std::vector<int64_t> receives = receives_of(pattern, me, N, 10);
      Bytes want = expected_receive(t, me, receives);
      run_all_to_all(c, g, kCpu, t, send_buffer(t, me, sends), sends, want.size(), receives);
      calls += 1;
      for (int d = 0; d < N; d++) {
        elements += count_of(pattern, me, d, N, 10);
        if (d != me) bytes += count_of(pattern, me, d, N, 10) * (int64_t)dtype_size(t);
      }
    }
  const CollStats& s = g.stats[(int)Coll::AllToAll];
  CHECK(s.calls == calls);
  CHECK(s.elements == elements);
  CHECK(s.bytes == bytes);
  // Summed over the ranks, what was sent is what was received from others: check the total
  // against the formula's off-diagonal sum.
  int64_t sent_by_all = s.bytes, off_diagonal = 0;
  MPI_Allreduce(MPI_IN_PLACE, &sent_by_all, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  for (DType t : {DType::F32, DType::BF16})
    for (int pattern = 0; pattern < kPatterns; pattern++)
      for (int a = 0; a < N; a++)
        for (int b = 0; b < N; b++)
          if (a != b) off_diagonal += count_of(pattern, a, b, N, 10) * (int64_t)dtype_size(t);
  CHECK(sent_by_all == off_diagonal);
  // No other collective was charged; the name is all_to_all.
  for (int k = 0; k < (int)Coll::Count; k++)
    if (k != (int)Coll::AllToAll) CHECK(g.stats[k].calls == 0);
  CHECK(std::string(coll_name(Coll::AllToAll)) == "all_to_all");
  // A group of one copies its segment and sends nothing.
  std::vector<float> mine = {1, 2, 3}, out = {0, 0, 0};
  all_to_all_v(c, c.tp, kCpu, mine.data(), {3}, out.data(), {3}, DType::F32);
  CHECK(out == mine);
  CHECK(c.tp.stats[(int)Coll::AllToAll].calls == 1);
  CHECK(c.tp.stats[(int)Coll::AllToAll].elements == 3);
  CHECK(c.tp.stats[(int)Coll::AllToAll].bytes == 0);
}

// ============================================================================
// Waits: a peer that never joins (run by tests/test_safety.cu)
// ============================================================================

TEST_CASE("all_to_all_v with a peer that never joins", "[.stuck-all_to_all]") {
  if (!named("[.stuck-all_to_all]")) return;
  TestComm tc(world_size(), 1, "mpi", Device::CPU, 2);
  Group& g = tc.c.world;
  if (g.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
  std::vector<int64_t> counts(g.size, 2);
  std::vector<float> in(2 * g.size, 1), out(2 * g.size);
  all_to_all_v(tc.c, g, kCpu, in.data(), counts, out.data(), counts, DType::F32);
}

TEST_CASE("exchange_counts with a peer that never joins", "[.stuck-exchange_counts]") {
  if (!named("[.stuck-exchange_counts]")) return;
  TestComm tc(world_size(), 1, "mpi", Device::CPU, 2);
  Group& g = tc.c.world;
  if (g.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
  exchange_counts(tc.c, g, std::vector<int64_t>(g.size, 2));
}

// ============================================================================
// GPU: device buffers, staged through host memory (MPI) or over NCCL
// ============================================================================

TEST_CASE("all-to-all-v on device buffers staged through host memory (MPI) equals the formula",
          "[mpi][all_to_all][gpu]") {
  if (!gpu_case_ready()) return;
  Context gpu = Context::create(Device::CUDA);
  {
    TestComm tc(world_size(), 1, "mpi", Device::CUDA);
    check_every_pattern(tc.c, tc.c.dp, gpu);
    check_every_pattern(tc.c, tc.c.tp, gpu);  // a group of one: a device-to-device copy
  }
  gpu.destroy();
}

TEST_CASE(
    "NCCL all-to-all-v (grouped send/recv) equals the formula, on any number of ranks from "
    "one; dispatch and combine return every bf16 bit",
    "[mpi][all_to_all][gpu]") {
  NcclCase n;
  if (!n.ready()) return;
  Comm& c = n.t->c;
  Group& g = c.dp;
  CHECK(g.nccl != nullptr);
  check_every_pattern(c, g, n.gpu);
  // There and back on the device, as expert parallelism dispatches and combines, async.
  const int N = g.size, me = g.rank;
  const DType t = DType::BF16;
  std::vector<int64_t> sends = sends_of(0, me, N, 300), receives = receives_of(0, me, N, 300);
  Bytes tokens = send_buffer(t, me, sends);
  int64_t held = 0;
  for (int64_t k : receives) held += k;
  DeviceBytes in(n.gpu, tokens), mid(n.gpu, Bytes(held * 2)), out(n.gpu, Bytes(tokens.size()));
  all_to_all_v_async(c, g, n.gpu, in.ptr(), sends, mid.ptr(), receives, t).wait();
  Handle h = all_to_all_v_async(c, g, n.gpu, mid.ptr(), receives, out.ptr(), sends, t);
  while (!h.test()) std::this_thread::yield();
  h.wait();
  CHECK(elements_differing(out.read(), tokens, t) == 0);
  int64_t bytes = 0;
  for (int d = 0; d < N; d++)
    if (d != me) bytes += 2 * (sends[d] + receives[d]);  // there, then back
  CHECK(g.stats[(int)Coll::AllToAll].calls == 3 * 2 * (int64_t)std::size(kScales) + 2);
  int64_t formula_bytes = 0;
  for (DType dt : {DType::F32, DType::BF16, DType::F16})
    for (int pattern = 0; pattern < kPatterns; pattern++)
      for (int64_t scale : kScales)
        for (int d = 0; d < N; d++)
          if (d != me) formula_bytes += count_of(pattern, me, d, N, scale) * dtype_size(dt);
  CHECK(g.stats[(int)Coll::AllToAll].bytes == formula_bytes + bytes);
}
