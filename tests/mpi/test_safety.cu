// test_safety.cu: host-side collectives under MPI. agree_on_error gives every rank the lowest
// failing rank's message. The hidden cases ([.stuck-*], run by tests/test_safety.cu under
// mpirun) leave rank 1 asleep past a 2 s --comm-timeout, in a collective or before the
// communicators' set-up: the job must end by the wait's own deadline, naming it, never hang.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>

#include "runtime/comm.cuh"

namespace {

struct HostComm {
  Comm c;
  explicit HostComm(double timeout_s) {
    int world = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    c = comm_init(world, 1, 1, 1, "mpi", Device::CPU, timeout_s);
  }
  ~HostComm() { comm_destroy(c); }
};

void sleep_if_rank_1() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
}
// A spec of exclusions only ("~[gpu]") selects hidden cases too: these abort the job, so they
// run only when their tag is given by name.
bool named(const std::string& tag) {
  for (const std::string& spec : Catch::getCurrentContext().getConfig()->getTestsOrTags())
    if (spec == tag) return true;
  return false;
}

}  // namespace

TEST_CASE("agree_on_error: every rank throws the lowest failing rank's message, or none does",
          "[mpi][safety]") {
  HostComm h(60);
  Group& world = h.c.world;
  CHECK_NOTHROW(agree_on_error(world, [] {}));
  int last = world.size - 1;
  CHECK_THROWS_WITH(
      agree_on_error(world,
                     [&] {
                       if (world.rank >= last)
                         throw UsageError("rank " + std::to_string(world.rank) + " cannot write");
                     }),
      "rank " + std::to_string(last) + " cannot write");
  CHECK_THROWS_WITH(agree_on_error(world,
                                   [&] {
                                     if (world.rank > 0)
                                       throw UsageError("rank " + std::to_string(world.rank));
                                   }),
                    "rank 1");
  double v = world.rank + 1.0;
  all_reduce_host(world, &v, 1, ReduceOp::Sum);
  CHECK(v == world.size * (world.size + 1) / 2.0);
}

TEST_CASE("all_reduce_host with a peer that never joins", "[.stuck-all_reduce_host]") {
  if (!named("[.stuck-all_reduce_host]")) return;
  HostComm h(2);
  sleep_if_rank_1();
  double v = 1;
  all_reduce_host(h.c.world, &v, 1, ReduceOp::Sum);
}

TEST_CASE("agree_on_error with a peer that never joins", "[.stuck-agree_on_error]") {
  if (!named("[.stuck-agree_on_error]")) return;
  HostComm h(2);
  sleep_if_rank_1();
  agree_on_error(h.c.world, [] {});
}

// Rank 1 never reaches comm_init: rank 0 waits at the barrier before its first split, under
// --comm mpi the world's copy, under auto the node's communicator that compares GPUs.
TEST_CASE("comm_init with a peer that never arrives", "[.stuck-comm_init]") {
  if (!named("[.stuck-comm_init]")) return;
  sleep_if_rank_1();
  HostComm h(2);
}

TEST_CASE("comm_init (auto) with a peer that never arrives", "[.stuck-comm_init-auto]") {
  if (!named("[.stuck-comm_init-auto]")) return;
  sleep_if_rank_1();
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Comm c = comm_init(world, 1, 1, 1, "auto", Device::CPU, 2);
  comm_destroy(c);
}
