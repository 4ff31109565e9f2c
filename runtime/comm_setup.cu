// comm_setup.cu: the communicators behind comm.cuh's groups. comm_init splits the world into the
// grid's groups (world, tp, cp, pp, pp_grad, dp, dp_cp) over MPI, chooses NCCL or MPI from the
// GPUs of each node's ranks (by PCI bus id), and on NCCL gives the groups NCCL communicators;
// comm_destroy takes them down. The one idea: set-up is collective too, so every wait in
// it (MPI's splits, NCCL's creation, first connections and finalization) is bounded by
// --comm-timeout like a collective: a rank that never arrives ends the job instead of hanging it.
#include <cblas.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm_internal.cuh"

// ---- Set-up waits, bounded like every collective ----
// MPI_Comm_split, MPI_Comm_split_type and the blocking collectives have no deadline: a rank that
// never arrives (stopped, or crashed before set-up) would leave the others in them forever. So
// every set-up step waits through host_wait, against --comm-timeout: data moves in nonblocking
// collectives (MPI_Iallgather, MPI_Ibcast, ...), and a split comes only after a nonblocking
// barrier on the communicator it splits. Once every rank has passed that barrier, each goes
// straight to the split, which therefore cannot hang.

// `comm` seen as a Group, for host_wait: its name and timeout for the message, this rank's
// world rank in its own slot of `members` (the only one the message reads).
static Group setup_group(MPI_Comm comm, const char* name, double timeout_s) {
  Group g;
  g.name = name;
  g.mpi = comm;
  g.timeout_s = timeout_s;
  MPI_CHECK(MPI_Comm_rank(comm, &g.rank));
  MPI_CHECK(MPI_Comm_size(comm, &g.size));
  int world_rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  g.members.assign(g.size, -1);
  g.members[g.rank] = world_rank;
  return g;
}
// Returns once every rank of the world has arrived (every split here splits the world); past the
// timeout stops every rank, the message naming `step` ("barrier before MPI_Comm_split into tp on
// world, 0 B did not finish within ...").
static void barrier_before(const std::string& step, double timeout_s) {
  Group world = setup_group(MPI_COMM_WORLD, "world", timeout_s);
  host_wait(world, ("barrier before " + step).c_str(), 0,
            [&](MPI_Request* r) { return MPI_Ibarrier(MPI_COMM_WORLD, r); });
}
// MPI_COMM_TYPE_SHARED: the ranks of this node, in world order.
static MPI_Comm node_comm(const char* purpose, double timeout_s) {
  barrier_before(std::string("MPI_Comm_split_type (") + purpose + ")", timeout_s);
  MPI_Comm node;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node));
  return node;
}

// Whether this node's ranks share cores: the threads they compute on (OpenBLAS's on CPU, one
// host thread per GPU rank) against the cores any of them may run on (the union of their
// affinity masks). Collective over the world.
static bool node_shares_cores(Device device, double timeout_s) {
  MPI_Comm node = node_comm("cores of this node", timeout_s);
  Group g = setup_group(node, "node", timeout_s);
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) CPU_SET(0, &mine);
  std::vector<unsigned char> cores((unsigned char*)&mine, (unsigned char*)&mine + sizeof mine);
  host_wait(g, "union of the node's affinity masks", sizeof mine, [&](MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, cores.data(), (int)cores.size(), MPI_UNSIGNED_CHAR, MPI_BOR,
                          node, r);
  });
  int threads = device == Device::CPU ? std::max(1, openblas_get_num_threads()) : 1;
  host_wait(g, "sum of the node's compute threads", sizeof threads, [&](MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, &threads, 1, MPI_INT, MPI_SUM, node, r);
  });
  MPI_CHECK(MPI_Comm_free(&node));
  cpu_set_t all;
  memcpy(&all, cores.data(), sizeof all);
  return threads > CPU_COUNT(&all);
}

void local_rank(int* rank, int* size, double timeout_s) {
  MPI_Comm node = node_comm("node-local ranks", timeout_s);
  MPI_CHECK(MPI_Comm_rank(node, rank));
  MPI_CHECK(MPI_Comm_size(node, size));
  MPI_CHECK(MPI_Comm_free(&node));
}

// The ranks that share `color` form one group, ordered by `key`.
static void make_group(Group& g, const char* name, int color, int key, double timeout_s) {
  g.name = name;
  g.timeout_s = timeout_s;
  barrier_before(std::string("MPI_Comm_split into ") + name, timeout_s);
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &g.mpi));
  // Errors come back to MPI_CHECK, which names file:line before stopping every rank.
  MPI_CHECK(MPI_Comm_set_errhandler(g.mpi, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(g.mpi, &g.rank));
  MPI_CHECK(MPI_Comm_size(g.mpi, &g.size));
  int world_rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  g.members.assign(g.size, 0);
  g.members[g.rank] = world_rank;  // the timeout message's rank, until the gather fills the rest
  host_wait(g, "all_gather of the members", (int64_t)g.size * sizeof(int), [&](MPI_Request* r) {
    return MPI_Iallgather(&world_rank, 1, MPI_INT, g.members.data(), 1, MPI_INT, g.mpi, r);
  });
}

Backend backend_for_node(const std::vector<std::string>& bus_ids, std::string* why) {
  for (size_t i = 0; i < bus_ids.size(); i++) {
    if (bus_ids[i].empty()) {
      if (why) *why = "rank " + std::to_string(i) + " of a node has no GPU";
      return Backend::MPI;
    }
    for (size_t j = 0; j < i; j++)
      if (bus_ids[j] == bus_ids[i]) {
        if (why)
          *why = "ranks " + std::to_string(j) + " and " + std::to_string(i) +
                 " of a node share the GPU at PCI bus " + bus_ids[i];
        return Backend::MPI;
      }
  }
  return Backend::NCCL;
}

// The PCI bus id of this rank's current GPU ("0000:3b:00.0"), or "" on CPU or without one.
static std::string my_bus_id(Device device) {
  char id[64] = "";
  int dev = 0;
  if (device != Device::CUDA || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetPCIBusId(id, sizeof id, dev) != cudaSuccess) {
    cudaGetLastError();  // clear a sticky "no driver" error
    return "";
  }
  return id;
}

// nccl when asked for (or, for auto, when possible) and every node has a GPU per rank. Each node
// gathers its ranks' bus ids over a node-local communicator and applies backend_for_node; all
// ranks then agree through one all-reduce, so either every rank throws or none does.
static Backend choose_backend(const std::string& flag, Device device, double timeout_s) {
  if (flag != "auto" && flag != "nccl" && flag != "mpi")
    throw UsageError("--comm " + flag + ": expected auto, nccl or mpi");
  if (flag == "mpi") return Backend::MPI;
  constexpr int kIdBytes = 64;
  char mine[kIdBytes] = "";
  snprintf(mine, sizeof mine, "%s", my_bus_id(device).c_str());
  MPI_Comm node = node_comm("GPU bus ids", timeout_s);
  Group node_group = setup_group(node, "node", timeout_s);
  std::vector<char> all(kIdBytes * node_group.size);
  host_wait(node_group, "all_gather of the GPU bus ids", all.size(), [&](MPI_Request* r) {
    return MPI_Iallgather(mine, kIdBytes, MPI_CHAR, all.data(), kIdBytes, MPI_CHAR, node, r);
  });
  MPI_CHECK(MPI_Comm_free(&node));
  std::vector<std::string> bus_ids;
  for (int r = 0; r < node_group.size; r++) bus_ids.emplace_back(all.data() + r * kIdBytes);
  std::string why;
  int here = backend_for_node(bus_ids, &why) == Backend::NCCL, everywhere = 0;
  Group world = setup_group(MPI_COMM_WORLD, "world", timeout_s);
  host_wait(world, "all_reduce of the backend choice", sizeof here, [&](MPI_Request* r) {
    return MPI_Iallreduce(&here, &everywhere, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD, r);
  });
  if (everywhere) return Backend::NCCL;
  if (flag == "auto") return Backend::MPI;
  if (device == Device::CPU)
    why = "the device is cpu";
  else if (here)
    why = "another node has ranks without a GPU of their own";
  throw UsageError("--comm nccl needs one GPU per rank: " + why +
                   "; use --comm mpi (device buffers are then staged through host memory)");
}

// ---- NCCL's nonblocking communicators ----
// Created with config.blocking = 0, a communicator answers every call at once. ncclInProgress
// means accepted but not finished: creation, the connections NCCL opens on a communicator's
// first ops, a grouped call, finalization. Until its state (ncclCommGetAsyncError) leaves
// ncclInProgress nothing else may be issued on it, nor on a stream it uses. Waiting for that
// here, against a deadline, lets --comm-timeout bound NCCL's set-up and tear-down as it bounds
// the collectives: a peer that never arrives ends the job instead of hanging it.

// Aborts the communicators (ncclCommAbort stops their kernels and frees them), then every rank.
// ncclCommAbort may itself wait for a stream that other work holds up (a kernel of ours that
// never ends): it gets a few seconds on a thread of its own, then the job stops regardless.
[[noreturn]] void nccl_stop(const std::vector<ncclComm_t>& comms, const std::string& message) {
  fprintf(stderr, "%s\n", message.c_str());
  if (!comms.empty()) {
    auto aborted = std::make_shared<std::atomic<bool>>(false);
    std::thread([comms, aborted] {
      for (ncclComm_t comm : comms)
        if (comm) ncclCommAbort(comm);
      *aborted = true;
    }).detach();
    constexpr double kAbortGrace_s = 10;
    double t0 = now_seconds();
    while (!*aborted && now_seconds() - t0 < kAbortGrace_s)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!*aborted)
      fprintf(stderr, "ncclCommAbort did not return within %gs: stopping without it\n",
              kAbortGrace_s);
  }
  fatal_abort();
}
std::string nccl_error(const std::string& what, int world_rank, ncclResult_t r, ncclComm_t comm) {
  return "rank " + std::to_string(world_rank) + ": " + what +
         " failed in NCCL: " + ncclGetErrorString(r) + " (" + ncclGetLastError(comm) + ")";
}
// The message of every collective, or NCCL set-up step, that ran past its deadline.
std::string past_deadline(int world_rank, const std::string& what, double timeout_s) {
  char message[512];
  snprintf(message, sizeof message,
           "rank %d: %s did not finish within %gs (--comm-timeout): a peer rank failed or is stuck",
           world_rank, what.c_str(), timeout_s);
  return message;
}
// `returned` is what the call that started `what` returned; when it is ncclInProgress, waits
// until every communicator of `comms` is ready, or stops every rank past start + timeout_s.
void nccl_settle(const std::vector<ncclComm_t>& comms, ncclResult_t returned,
                 const std::string& what, int world_rank, double start, double timeout_s) {
  if (returned == ncclSuccess) return;
  if (returned != ncclInProgress)
    nccl_stop(comms, nccl_error(what, world_rank, returned, comms.empty() ? nullptr : comms[0]));
  for (ncclComm_t comm : comms) {
    for (;;) {
      ncclResult_t state = ncclInProgress, r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) break;
      if (state != ncclInProgress) nccl_stop(comms, nccl_error(what, world_rank, state, comm));
      if (now_seconds() - start > timeout_s)
        nccl_stop(comms, past_deadline(world_rank, what, timeout_s));
      std::this_thread::yield();
    }
  }
}

// Whether group ranks `from` and `to` of `size` are neighbours in the ring (a link's two ends).
static bool neighbours(int from, int to, int size) {
  return from != to && (to == (from + 1) % size || to == (from + size - 1) % size);
}

std::vector<LinkPlan> link_plan(const PipelinePairs& pairs, int rank, int size) {
  std::vector<LinkPlan> plan;
  for (const auto& [from, to] : pairs) {
    PICO_ASSERT(neighbours(from, to, size), "a pipeline link joins neighbours");
    if (from == rank || to == rank)
      plan.push_back({from, to, 2 * from + (to == (from + 1) % size ? 0 : 1)});
  }
  return plan;
}

// A pipeline group's links (Group::links): a communicator of two ranks (the sender rank 0, the
// receiver 1) and a stream for each pair of `pairs` (group ranks, sender first) this rank is in,
// the ways the run's messages travel: a neighbour each way at most. The sender makes the id; the
// group's ranks gather each other's (the link to the next rank's, then to the previous one's).
// NCCL opens a connection at a pair's first message, and a grouped call waits for its
// connections before any of its transfers starts, each with its peer taking part: a stage's
// first send forward would wait for a neighbour that is itself waiting to receive. So every
// link carries one word here, before the first step. Every wait against the deadline.
static void make_links(Group& g, const PipelinePairs& pairs, int world_rank, double timeout_s) {
  if (!g.nccl || g.size < 2) return;
  const std::vector<LinkPlan> plan = link_plan(pairs, g.rank, g.size);
  std::vector<ncclUniqueId> mine(2), all(2 * g.size);
  for (const LinkPlan& l : plan)  // (an id made listens until used: only those used)
    if (l.from == g.rank) NCCL_CHECK(ncclGetUniqueId(&mine[l.id_slot % 2]));
  host_wait(g, "the exchange of the NCCL ids of the pipeline's links", sizeof(ncclUniqueId) * 2,
            [&](MPI_Request* r) {
              return MPI_Iallgather(mine.data(), 2 * sizeof(ncclUniqueId), MPI_BYTE, all.data(),
                                    2 * sizeof(ncclUniqueId), MPI_BYTE, g.mpi, r);
            });
  struct Made {
    int from, to;
    ncclUniqueId id;
  };
  std::vector<Made> made;
  for (const LinkPlan& l : plan) made.push_back({l.from, l.to, all[l.id_slot]});
  if (made.empty()) return;
  const std::string what = "the pipeline's links on " + g.name;
  const double t0 = now_seconds();
  for (const Made& m : made) {
    Group::Link link;
    link.from = m.from, link.to = m.to;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // every link's creation under way at once, then settled
    ncclResult_t r = ncclCommInitRankConfig(&link.nccl, 2, m.id, m.from == g.rank ? 0 : 1, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      nccl_stop({link.nccl}, nccl_error(what, world_rank, r, link.nccl));
    CUDA_CHECK(cudaStreamCreateWithFlags(&link.stream, cudaStreamNonBlocking));
    g.links.push_back(link);
  }
  std::vector<ncclComm_t> comms;
  for (const Group::Link& link : g.links) comms.push_back(link.nccl);
  nccl_settle(comms, ncclInProgress, what, world_rank, t0, timeout_s);
  // The first word each way.
  float* words = nullptr;
  CUDA_CHECK(cudaMalloc(&words, g.links.size() * sizeof(float)));
  CUDA_CHECK(cudaMemset(words, 0, g.links.size() * sizeof(float)));
  bool pending = false;
  auto call = [&](ncclResult_t r) {
    if (r == ncclInProgress)
      pending = true;
    else if (r != ncclSuccess)
      nccl_stop(comms, nccl_error(what, world_rank, r, comms[0]));
  };
  call(ncclGroupStart());
  for (size_t i = 0; i < g.links.size(); i++) {
    const Group::Link& l = g.links[i];
    if (l.from == g.rank)
      call(ncclSend(words + i, 1, ncclFloat, 1, l.nccl, l.stream));
    else
      call(ncclRecv(words + i, 1, ncclFloat, 0, l.nccl, l.stream));
  }
  call(ncclGroupEnd());
  nccl_settle(comms, pending ? ncclInProgress : ncclSuccess, what, world_rank, t0, timeout_s);
  for (const Group::Link& l : g.links)
    if (!stream_reached_by(l.stream, t0 + timeout_s))
      nccl_stop(comms, past_deadline(world_rank, what, timeout_s));
  CUDA_CHECK(cudaFree(words));
}

// A pipeline's send waits on its link's stream until the peer receives. CUDA feeds the device
// from CUDA_DEVICE_MAX_CONNECTIONS hardware queues (runtime/core.cu sets 32 unless it is set),
// streams sharing them when there are more streams than queues, and an op queued behind the
// waiting send in a shared queue waits with it: the peer's receive it needs may be that op. So
// a pipeline over NCCL needs a queue for each stream it makes (comm_init refuses fewer, on
// every rank alike: they share the environment, before any communicator exists). NCCL makes two
// streams of its own for every communicator, links included, and one for the process (2.28),
// where it waits for its kernels: counted too, they can pass the 32 queues CUDA gives at most,
// and then comm_init says so (device_queue_note), since which streams share cannot be chosen.
PipelinePairs neighbour_pairs(int pp_size) {
  std::set<std::pair<int, int>> pairs;
  for (int r = 0; pp_size > 1 && r < pp_size; r++)
    for (int to : {(r + 1) % pp_size, (r + pp_size - 1) % pp_size}) pairs.insert({r, to});
  return {pairs.begin(), pairs.end()};
}
int most_links(const PipelinePairs& pairs, int pp_size) {
  size_t most = 0;  // on pp, and the same pairs reversed on pp_grad
  for (int r = 0; r < pp_size; r++) most = std::max(most, 2 * link_plan(pairs, r, pp_size).size());
  return (int)most;
}
std::string device_queue_note(const char* connections, int links, int communicators) {
  if (links == 0) return "";
  const int queues = std::min(connections ? atoi(connections) : 8, 32);
  const int channels = communicators + links;
  const int streams = 4 + 3 * channels;  // compute, communication, legacy, NCCL's; 3 a channel
  if (streams <= queues) return "";
  return "a pipeline over NCCL here makes about " + std::to_string(streams) +
         " streams (picoscale's and NCCL's two for each of its " + std::to_string(channels) +
         " communicators and links) for " + std::to_string(queues) +
         " hardware queues: streams share queues, and a send waiting for its peer may hold up a "
         "receive queued behind it, which --comm-timeout then ends (unverified: no run of several "
         "GPUs yet); --comm mpi moves the pipeline's messages through the host instead";
}
std::string device_queue_shortage(const char* connections, int links, int communicators) {
  if (!connections || links == 0) return "";
  const int streams = 2 + communicators + links;  // + the compute and communication streams
  if (atoi(connections) >= streams) return "";
  return "CUDA_DEVICE_MAX_CONNECTIONS=" + std::string(connections) +
         ": a pipeline over NCCL makes " + std::to_string(streams) +
         " streams (compute, communication, one per communicator, " + std::to_string(links) +
         " links), each needing a hardware queue of its own; unset it (picoscale then asks for "
         "32) or set it to at least " +
         std::to_string(streams) + ", or use --comm mpi";
}

// ---- The communicators of a run ----

std::vector<int> communicator_owners(const std::vector<std::vector<int>>& members,
                                     const std::vector<int>& lanes) {
  std::vector<int> lane = lanes, owner(members.size());
  for (size_t i = 0; i < members.size(); i++)  // a lane of -1 joins the first of the same ranks
    for (size_t j = 0; j < members.size() && lane[i] < 0; j++)
      if (lanes[j] >= 0 && members[j] == members[i]) lane[i] = lanes[j];
  for (size_t i = 0; i < members.size(); i++) {
    owner[i] = (int)i;
    for (size_t j = 0; j < i; j++)  // the first such group owns it
      if (lane[j] == lane[i] && members[j] == members[i]) {
        owner[i] = (int)j;
        break;
      }
  }
  return owner;
}

// Which group of each kind a rank belongs to: (color, key), the ranks sharing a color forming
// one group ordered by key. A group's color is the world rank of its member with the group's
// own coordinates at 0: one number per group, shared by exactly the ranks that agree on the
// other coordinates.
enum class GroupKind { World, Tp, Cp, Pp, PpGrad, Dp, DpCp, Ep, EdpCp };
static std::pair<int, int> color_key(const Grid& G, GroupKind k) {
  const int d = G.dp_rank, p = G.pp_rank, x = G.cp_rank, t = G.tp_rank, ep = G.ep;
  switch (k) {
    case GroupKind::World:  // a copy of the world, ours alone
      return {0, G.world_rank};
    case GroupKind::Tp:
      return {G.rank_of(d, p, x, 0), t};
    case GroupKind::Cp:
      return {G.rank_of(d, p, 0, t), x};
    case GroupKind::Pp:
    case GroupKind::PpGrad:
      return {G.rank_of(d, 0, x, t), p};
    case GroupKind::Dp:
      return {G.rank_of(0, p, x, t), d};
    case GroupKind::DpCp:  // gradients average here
      return {G.rank_of(0, p, 0, t), d * G.cp + x};
    // Expert parallelism's, carved out of dp (runtime/comm.cuh): a block of ep dp ranks, and
    // the ranks of the same ep rank in every block (and every cp rank).
    case GroupKind::Ep:
      return {G.rank_of(d - d % ep, p, x, t), d % ep};
    case GroupKind::EdpCp:
      return {G.rank_of(d % ep, p, 0, t), (d / ep) * G.cp + x};
  }
  return {0, 0};
}

// A group of a simulated world: its members worked out from the grid, no communicator.
static void simulated_group(Group& g, const char* name, const Grid& G, GroupKind k,
                            double timeout_s) {
  g.name = name;
  g.timeout_s = timeout_s;
  g.simulated = true;
  const int color = color_key(G, k).first;
  std::vector<std::pair<int, int>> members;  // (key, world rank)
  for (int w = 0; w < G.world_size; w++) {
    Grid other = make_grid(G.dp, G.pp, G.cp, G.tp, G.world_size, w);
    other.ep = G.ep;
    const auto [c, kw] = color_key(other, k);
    if (c == color) members.push_back({kw, w});
  }
  std::sort(members.begin(), members.end());
  g.size = (int)members.size();
  for (int i = 0; i < g.size; i++) {
    g.members.push_back(members[i].second);
    if (members[i].second == G.world_rank) g.rank = i;
  }
}

Comm comm_init(int dp, int pp, int cp, int tp, const std::string& backend_flag, Device device,
               double timeout_s, int ep, const SimulatedWorld& simulate,
               const PipelinePairs& pipeline) {
  int up = 0, world_size = 1, world_rank = 0;
  const bool simulated = simulate.world > 0;
  MPI_Initialized(&up);
  // A simulated world exchanges nothing: it needs MPI only to know it runs alone.
  PICO_ASSERT(up || simulated, "comm_init needs MPI_Init first");
  if (up) {
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  }
  if (!(timeout_s > 0))
    throw UsageError("--comm-timeout " + std::to_string(timeout_s) + ": expected seconds > 0");
  set_device_wait_bound(timeout_s);
  Comm c;
  if (simulated) {
    PICO_ASSERT(device == Device::Meta && world_size == 1,
                "a simulated world runs one process on the meta device");
    world_size = simulate.world, world_rank = simulate.rank;
  }
  c.grid = make_grid(dp, pp, cp, tp, world_size, world_rank);  // checked before any allocation
  PICO_ASSERT(ep >= 1 && dp % ep == 0, "--ep " + std::to_string(ep) + " divides --dp");
  c.grid.ep = ep;
  c.grid.simulated = simulated;
  c.device = device;
  c.timeout_s = timeout_s;
  // Each group's lane (communicator_owners): groups of one lane with the same members share an
  // NCCL communicator. The gradients' groups may queue behind one another, and so may the
  // pipeline's two, whose messages travel on their links; tp, cp and ep have a lane each. The
  // world, whose only collective is the run's last barrier, joins the lane of the first group
  // of the same ranks (pp's at --pp 4 alone).
  enum Lane { AnyLane = -1, Gradients, TensorLane, ContextLane, Pipeline, Experts };
  struct {
    Group* group;
    const char* name;
    GroupKind kind;
    Lane lane;
  } kinds[] = {{&c.world, "world", GroupKind::World, AnyLane},
               {&c.tp, "tp", GroupKind::Tp, TensorLane},
               {&c.cp, "cp", GroupKind::Cp, ContextLane},
               {&c.pp, "pp", GroupKind::Pp, Pipeline},
               {&c.pp_grad, "pp_grad", GroupKind::PpGrad, Pipeline},
               {&c.dp, "dp", GroupKind::Dp, Gradients},
               {&c.dp_cp, "dp_cp", GroupKind::DpCp, Gradients},
               {&c.ep, "ep", GroupKind::Ep, Experts},
               {&c.edp_cp, "edp_cp", GroupKind::EdpCp, Gradients}};
  // The meta device stands for GPUs, one per rank as in the book's clusters: NCCL's semantics
  // (a pipeline's send given back once received, at the next receive) unless --comm mpi; it
  // creates no communicator of either.
  const bool meta = device == Device::Meta;
  if (meta && backend_flag != "auto" && backend_flag != "nccl" && backend_flag != "mpi")
    throw UsageError("--comm " + backend_flag + ": expected auto, nccl or mpi");
  if (meta)
    c.backend = backend_flag == "mpi" ? Backend::MPI : Backend::NCCL;
  else
    c.backend = choose_backend(backend_flag, device, timeout_s);
  if (simulated) {  // nothing to split, nothing to connect: the meta device exchanges nothing
    for (auto& k : kinds) simulated_group(*k.group, k.name, c.grid, k.kind, timeout_s);
    c.comm_ctx = Context::create(Device::Meta);
    return c;
  }
  for (auto& k : kinds) {
    const auto [color, key] = color_key(c.grid, k.kind);
    make_group(*k.group, k.name, color, key, timeout_s);
  }

  // The ways a pipeline's activations travel between pp ranks (every way to each neighbour
  // unless the run's placement says which).
  const std::set<std::pair<int, int>> ways(pipeline.begin(), pipeline.end());  // each once
  const PipelinePairs forward =
      pipeline.empty() ? neighbour_pairs(c.pp.size) : PipelinePairs(ways.begin(), ways.end());
  std::set<int> joined;  // every rank of a pipeline sends or receives: each pp rank's links
  for (const auto& [from, to] : forward) {
    const int n = c.pp.size;
    PICO_ASSERT(from >= 0 && from < n && to >= 0 && to < n && neighbours(from, to, n),
                "comm_init: a pipeline pair joins two neighbouring pp ranks");
    joined.insert(from), joined.insert(to);
  }
  PICO_ASSERT(c.pp.size == 1 || (int)joined.size() == c.pp.size,
              "comm_init: every pp rank in a pipeline pair");
  std::vector<std::vector<int>> members;
  std::vector<int> lanes;
  for (auto& k : kinds) members.push_back(k.group->members), lanes.push_back(k.lane);
  const std::vector<int> owner = communicator_owners(members, lanes);  // NCCL's sharing
  if (c.backend == Backend::NCCL && !meta) {
    // The standard bootstrap, one id per group: group rank 0 makes it, MPI shares it. Under
    // --comm auto a group of one needs no communicator (its collectives are local copies); an
    // explicit --comm nccl gives it one, so that one rank on one GPU exercises NCCL.
    bool groups_of_one = backend_flag == "nccl";
    auto makes_one = [&](size_t i) {  // its own communicator, not another group's
      return owner[i] == (int)i && (kinds[i].group->size > 1 || groups_of_one);
    };
    int communicators = 0;
    for (size_t i = 0; i < owner.size(); i++) communicators += makes_one(i);
    const int links = most_links(forward, c.pp.size);  // the most any rank makes: alike on all
    const char* connections = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    const std::string shortage = device_queue_shortage(connections, links, communicators);
    if (!shortage.empty()) throw UsageError(shortage);
    const std::string note = device_queue_note(connections, links, communicators);
    if (!note.empty() && world_rank == 0) fprintf(stderr, "note: %s\n", note.c_str());
    for (size_t i = 0; i < owner.size(); i++) {
      Group* g = kinds[i].group;
      if (owner[i] != (int)i) g->nccl = kinds[owner[i]].group->nccl;  // made already, or none
      if (!makes_one(i)) continue;
      ncclUniqueId id;
      if (g->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      host_wait(*g, "broadcast of the NCCL unique id", sizeof id,
                [&](MPI_Request* r) { return MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, g->mpi, r); });
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // returns at once; nccl_settle waits, bounded by the timeout
      double t0 = now_seconds();
      ncclResult_t r = ncclCommInitRankConfig(&g->nccl, g->size, id, g->rank, &config);
      nccl_settle({g->nccl}, r, "ncclCommInitRankConfig on " + g->name, world_rank, t0, timeout_s);
    }
  }
  set_cores_shared(node_shares_cores(device, timeout_s));
  if (device == Device::CUDA) {
    // Non-blocking: it never waits for the legacy default stream, so communication overlaps
    // compute; events order it with the compute stream where the data requires.
    c.comm_ctx.device = Device::CUDA;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c.comm_ctx.stream, cudaStreamNonBlocking));
    for (size_t i = 0; i < owner.size(); i++) {  // each communicator's ops on a stream of their own
      Group* g = kinds[i].group;
      if (!g->nccl) continue;
      if (owner[i] != (int)i) {  // the owner's, made already
        g->stream = kinds[owner[i]].group->stream;
        g->barrier_word = kinds[owner[i]].group->barrier_word;
      } else {
        CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking));
        // What its barriers all-reduce, taken now, before the arena holds the device's memory.
        CUDA_CHECK(cudaMalloc((void**)&g->barrier_word, sizeof(float)));
      }
    }
    PipelinePairs back;  // gradients travel the activations' ways reversed
    for (const auto& [from, to] : forward) back.push_back({to, from});
    make_links(c.pp, forward, world_rank, timeout_s);
    make_links(c.pp_grad, back, world_rank, timeout_s);
  } else {
    c.comm_ctx = Context::create(device == Device::Meta ? Device::Meta : Device::CPU);
  }
  return c;
}

// Call after every Handle has been waited for. An NCCL communicator is finalized first (it
// flushes its work and waits for its peers: bounded by the timeout), then destroyed, which
// after a finished finalize only frees local memory.
void comm_destroy(Comm& c) {
  std::set<const void*> gone;  // what groups share (communicator_owners) goes once
  for (Group* g : c.groups()) {
    const int world_rank = g->members.empty() ? 0 : g->members[g->rank];
    auto finalize = [&](ncclComm_t comm, const std::string& what) {
      nccl_settle({comm}, ncclCommFinalize(comm), what, world_rank, now_seconds(), g->timeout_s);
      NCCL_CHECK(ncclCommDestroy(comm));  // frees local resources, without blocking (nccl.h)
    };
    for (Group::Link& link : g->links) {
      finalize(link.nccl, "ncclCommFinalize of a link on " + g->name);
      CUDA_CHECK(cudaStreamDestroy(link.stream));  // finalized: idle
    }
    g->links.clear();
    if (g->nccl && gone.insert(g->nccl).second) finalize(g->nccl, "ncclCommFinalize on " + g->name);
    if (g->mpi != MPI_COMM_NULL) MPI_CHECK(MPI_Comm_free(&g->mpi));
    g->nccl = nullptr;
  }
  for (Group* g : c.groups()) {  // every communicator finalized: their streams are idle
    if (g->stream && gone.insert(g->stream).second) CUDA_CHECK(cudaStreamDestroy(g->stream));
    if (g->barrier_word && gone.insert(g->barrier_word).second)
      CUDA_CHECK(cudaFree(g->barrier_word));
    g->stream = nullptr, g->barrier_word = nullptr;
  }
  c.comm_ctx.destroy();
}
