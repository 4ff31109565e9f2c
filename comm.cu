// comm.cu: the process grid [dp][pp][cp][tp] and its collectives, over NCCL or MPI, with
// per-group byte counters. Playbook appendix A0 (the collectives and what each rank sends in a
// ring); DESIGN sections 3 and 4. The one idea: every parallel technique is a few collectives on
// a few groups of ranks, issued without blocking and waited for later, so communication runs
// beside computation: on CUDA on a second stream ordered by events, on CPU inside MPI's
// nonblocking calls.
#include "comm.cuh"

#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <nlohmann/json.hpp>
#include <deque>
#include <mutex>
#include <thread>


const char* coll_name(Coll c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
                                "gather",     "scatter",        "send_recv",  "barrier"};
  return names[(int)c];
}
const char* backend_name(Backend b) {
  return b == Backend::MPI ? "mpi" : "nccl";
}

// ============================================================================
// The grid: world rank <-> coordinates, tp fastest (tensor-parallel peers share a node)
// ============================================================================

Grid make_grid(int dp, int pp, int cp, int tp, int world_size, int world_rank) {
  std::string flags = "--dp " + std::to_string(dp) + " x --pp " + std::to_string(pp) + " x --cp " +
                      std::to_string(cp) + " x --tp " + std::to_string(tp);
  if (dp < 1 || pp < 1 || cp < 1 || tp < 1)
    throw UsageError(flags + ": every parallel dimension must be at least 1");
  int64_t product = (int64_t)dp * pp * cp * tp;
  if (product != world_size)
    throw UsageError(flags + " = " + std::to_string(product) + " ranks, but mpirun started " +
                     std::to_string(world_size) + ": launch with mpirun -np " +
                     std::to_string(product) + ", or change the flags");
  Grid g;
  g.dp = dp, g.pp = pp, g.cp = cp, g.tp = tp;
  g.world_size = world_size, g.world_rank = world_rank;
  int r = world_rank;
  g.tp_rank = r % tp, r /= tp;
  g.cp_rank = r % cp, r /= cp;
  g.pp_rank = r % pp, r /= pp;
  g.dp_rank = r;
  return g;
}

// ============================================================================
// Communicators
// ============================================================================

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
  if (device == Device::CPU) why = "the device is cpu";
  else if (here) why = "another node has ranks without a GPU of their own";
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
[[noreturn]] static void nccl_stop(const std::vector<ncclComm_t>& comms,
                                   const std::string& message) {
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
static std::string nccl_error(const std::string& what, int world_rank, ncclResult_t r,
                              ncclComm_t comm) {
  return "rank " + std::to_string(world_rank) + ": " + what + " failed in NCCL: " +
         ncclGetErrorString(r) + " (" + ncclGetLastError(comm) + ")";
}
// The message of every collective, or NCCL set-up step, that ran past its deadline.
static std::string past_deadline(int world_rank, const std::string& what, double timeout_s) {
  char message[512];
  snprintf(message, sizeof message,
           "rank %d: %s did not finish within %gs (--comm-timeout): a peer rank failed or is stuck",
           world_rank, what.c_str(), timeout_s);
  return message;
}
// `returned` is what the call that started `what` returned; when it is ncclInProgress, waits
// until every communicator of `comms` is ready, or stops every rank past start + timeout_s.
static void nccl_settle(const std::vector<ncclComm_t>& comms, ncclResult_t returned,
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

Comm comm_init(int dp, int pp, int cp, int tp, const std::string& backend_flag, Device device,
               double timeout_s) {
  int up = 0, world_size = 1, world_rank = 0;
  MPI_Initialized(&up);
  PICO_ASSERT(up, "comm_init needs MPI_Init first");
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  if (!(timeout_s > 0))
    throw UsageError("--comm-timeout " + std::to_string(timeout_s) + ": expected seconds > 0");
  Comm c;
  c.grid = make_grid(dp, pp, cp, tp, world_size, world_rank);  // checked before any allocation
  c.backend = choose_backend(backend_flag, device, timeout_s);
  c.device = device;
  c.timeout_s = timeout_s;

  // A group's color is the world rank of its member with the group's own coordinates at 0:
  // one number per group, shared by exactly the ranks that agree on the other coordinates.
  const Grid& G = c.grid;
  int d = G.dp_rank, p = G.pp_rank, x = G.cp_rank, t = G.tp_rank;
  make_group(c.world, "world", 0, world_rank, timeout_s);  // a copy of MPI_COMM_WORLD, ours alone
  make_group(c.tp, "tp", G.rank_of(d, p, x, 0), t, timeout_s);
  make_group(c.cp, "cp", G.rank_of(d, p, 0, t), x, timeout_s);
  make_group(c.pp, "pp", G.rank_of(d, 0, x, t), p, timeout_s);
  make_group(c.pp_grad, "pp_grad", G.rank_of(d, 0, x, t), p, timeout_s);
  make_group(c.dp, "dp", G.rank_of(0, p, x, t), d, timeout_s);
  // Gradients average here.
  make_group(c.dp_cp, "dp_cp", G.rank_of(0, p, 0, t), d * G.cp + x, timeout_s);

  if (c.backend == Backend::NCCL) {
    // The standard bootstrap, one id per group: group rank 0 makes it, MPI shares it. Under
    // --comm auto a group of one needs no communicator (its collectives are local copies); an
    // explicit --comm nccl gives it one, so that one rank on one GPU exercises NCCL.
    bool groups_of_one = backend_flag == "nccl";
    for (Group* g : c.groups()) {
      if (g->size == 1 && !groups_of_one) continue;
      ncclUniqueId id;
      if (g->rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
      host_wait(*g, "broadcast of the NCCL unique id", sizeof id, [&](MPI_Request* r) {
        return MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, g->mpi, r);
      });
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // returns at once; nccl_settle waits, bounded by the timeout
      double t0 = now_seconds();
      ncclResult_t r = ncclCommInitRankConfig(&g->nccl, g->size, id, g->rank, &config);
      nccl_settle({g->nccl}, r, "ncclCommInitRankConfig on " + g->name, world_rank, t0,
                  timeout_s);
    }
  }
  if (device == Device::CUDA) {
    // Non-blocking: it never waits for the legacy default stream, so communication overlaps
    // compute; events order it with the compute stream where the data requires.
    c.comm_ctx.device = Device::CUDA;
    CUDA_CHECK(cudaStreamCreateWithFlags(&c.comm_ctx.stream, cudaStreamNonBlocking));
  } else {
    c.comm_ctx = Context::create(Device::CPU);
  }
  return c;
}

// Call after every Handle has been waited for. An NCCL communicator is finalized first (it
// flushes its work and waits for its peers: bounded by the timeout), then destroyed, which
// after a finished finalize only frees local memory.
void comm_destroy(Comm& c) {
  for (Group* g : c.groups()) {
    if (g->nccl) {
      int world_rank = g->members.empty() ? 0 : g->members[g->rank];
      double t0 = now_seconds();
      nccl_settle({g->nccl}, ncclCommFinalize(g->nccl), "ncclCommFinalize on " + g->name,
                  world_rank, t0, g->timeout_s);
      NCCL_CHECK(ncclCommDestroy(g->nccl));  // frees local resources, without blocking (nccl.h)
    }
    if (g->mpi != MPI_COMM_NULL) MPI_CHECK(MPI_Comm_free(&g->mpi));
    g->nccl = nullptr;
  }
  c.comm_ctx.destroy();
}

// ============================================================================
// Handle: what it takes to finish one collective
// ============================================================================

// ---- Staging through the host (MPI on CUDA: ranks sharing a GPU) ----
// Pinned host buffers, cached and reused by every collective of the process, as the stream-ordered
// pool caches device memory: cudaMallocHost is slow (it pins pages), and only pinned memory lets
// a copy run asynchronously on a stream. A buffer is taken for one collective and given back
// with an event on the stream of its last copy; it is taken again only once that event is done.
struct PinnedBuffer {
  float* ptr = nullptr;
  int64_t capacity = 0;              // floats
  cudaEvent_t free_after = nullptr;  // recorded after the last copy that uses it
  bool taken = false;
};
static std::mutex g_pinned_mutex;
static std::deque<PinnedBuffer> g_pinned;  // the cache; freed by the driver when the process ends

static float* take_pinned(int64_t count) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  PinnedBuffer* best = nullptr;  // the smallest free buffer that fits
  for (PinnedBuffer& b : g_pinned) {
    if (b.taken || b.capacity < count || (best && best->capacity <= b.capacity)) continue;
    cudaError_t e = b.free_after ? cudaEventQuery(b.free_after) : cudaSuccess;
    if (e == cudaErrorNotReady) continue;  // its last copy back to the device has not run yet
    CUDA_CHECK(e);
    best = &b;
  }
  if (!best) {  // powers of two from 256 KiB, so buffers fit many later requests
    best = &g_pinned.emplace_back();
    best->capacity = 1 << 16;
    while (best->capacity < count) best->capacity *= 2;
    CUDA_CHECK(cudaMallocHost(&best->ptr, best->capacity * sizeof(float)));
    CUDA_CHECK(cudaEventCreateWithFlags(&best->free_after, cudaEventDisableTiming));
  }
  best->taken = true;
  return best->ptr;
}
// Free again once the work queued on `stream` so far (the copies that use it) has run.
static void give_back_pinned(float* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  for (PinnedBuffer& b : g_pinned)
    if (b.ptr == ptr) {
      CUDA_CHECK(cudaEventRecord(b.free_after, stream));
      b.taken = false;
      return;
    }
  PICO_ASSERT(false, "a staging buffer given back twice or never taken");
}

struct Handle::State {
  Group* group = nullptr;
  std::string what;  // "all_reduce on dp_cp, 1.50 MiB", for the timeout message
  int world_rank = 0;
  double start = 0, timeout_s = 0;
  bool done = false;
  // MPI backend.
  std::vector<MPI_Request> requests;
  std::deque<std::vector<float>> host;  // host copies of aliased inputs (CPU)
  std::vector<float*> pinned;  // staging buffers of device data (CUDA), given back at the end
  struct CopyBack {
    float* device;
    const float* host;
    int64_t count;
  };
  std::vector<CopyBack> copy_back;  // host -> device when the op completes
  float* average_buf = nullptr;     // MPI has no average: sum, then scale this host buffer
  int64_t average_count = 0;
  // NCCL backend.
  std::vector<ncclComm_t> nccl;    // the communicators the op runs on (two for some send_recv)
  bool enqueue_pending = false;    // a call answered ncclInProgress: settle() before going on
  cudaEvent_t finished = nullptr;  // recorded on the comm stream after the op
  cudaStream_t compute = nullptr;  // the caller's stream: waits for `finished`, or copy-back

  MPI_Request* request() {
    requests.push_back(MPI_REQUEST_NULL);
    return &requests.back();
  }
  bool poll();
  void finish();
  void settle() {  // every NCCL call of the op enqueued on its stream
    nccl_settle(nccl, enqueue_pending ? ncclInProgress : ncclSuccess, what, world_rank, start,
                timeout_s);
    enqueue_pending = false;
  }
  void wait() {
    while (!poll()) std::this_thread::yield();
  }
  // A Handle dropped without wait() still completes here, so its buffers are never left in
  // flight (the communicator must still exist).
  ~State() {
    if (!done) wait();
    if (finished) cudaEventDestroy(finished);
  }
};

// Advances the op (MPI_Testall progresses MPI's nonblocking collectives) and finishes it when
// complete. Past the deadline it stops every rank: a peer that died or diverged would
// otherwise leave this rank waiting forever.
bool Handle::State::poll() {
  if (done) return true;
  bool complete = false;
  if (finished) {
    cudaError_t e = cudaEventQuery(finished);
    if (e != cudaErrorNotReady) CUDA_CHECK(e);  // anything else is a real CUDA error
    complete = e == cudaSuccess;
    for (size_t i = 0; !complete && i < nccl.size(); i++) {  // a failed peer shows up here
      ncclResult_t async = ncclSuccess, r = ncclCommGetAsyncError(nccl[i], &async);
      if (r != ncclSuccess) async = r;
      if (async != ncclSuccess && async != ncclInProgress)
        nccl_stop(nccl, nccl_error(what, world_rank, async, nccl[i]));
    }
  } else {
    int flag = 0;
    MPI_CHECK(MPI_Testall((int)requests.size(), requests.data(), &flag, MPI_STATUSES_IGNORE));
    complete = flag != 0;
  }
  if (complete) {
    finish();
    return true;
  }
  // Past the deadline: the NCCL communicators (if any) are aborted, then every rank stops.
  if (now_seconds() - start > timeout_s)
    nccl_stop(nccl, past_deadline(world_rank, what, timeout_s));
  return false;
}

void Handle::State::finish() {
  if (average_buf) {
    float inverse = 1.0f / (float)group->size;
    for (int64_t i = 0; i < average_count; i++) average_buf[i] *= inverse;
  }
  // From pinned memory the copies are truly asynchronous: the host goes on at once, and the
  // staging buffers are taken again only after these copies have run (give_back_pinned).
  for (const CopyBack& cb : copy_back)
    CUDA_CHECK(cudaMemcpyAsync(cb.device, cb.host, cb.count * sizeof(float), cudaMemcpyHostToDevice,
                               compute));
  for (float* p : pinned) give_back_pinned(p, compute);
  pinned.clear();
  // Work queued later on the compute stream runs after the collective; the host goes on.
  if (finished) CUDA_CHECK(cudaStreamWaitEvent(compute, finished, 0));
  done = true;
}

bool Handle::test() {
  return !state_ || state_->poll();
}
// On NCCL the host also waits here (polling the event) rather than trusting the GPU to finish:
// that is what lets a stuck peer end the run after --comm-timeout instead of hanging it.
void Handle::wait() {
  if (state_) state_->wait();
  state_.reset();
}

// ============================================================================
// Shared steps of every collective
// ============================================================================

// Bytes this rank sends for one call under the ring algorithm (appendix A0), N = group size:
//   all_reduce       2(N-1)K/N, K = count*4 (floor when N does not divide 2(N-1)K)
//   reduce_scatter   (N-1)K/N,  K = count*N*4, the whole buffer being reduced (always exact)
//   all_gather       (N-1)K/N,  K = count*N*4, the whole gathered buffer (always exact)
//   broadcast        K = count*4, except the last rank of the chain from root, which sends 0
//   reduce           K = count*4, except root, where the chain ends, which sends 0
//   gather           count*4 from every rank but root; scatter (N-1)*count*4 from root only
//   send_recv        the bytes of its sends;  barrier 0
// A group of one sends nothing: every formula is 0 for N = 1, and send_recv to oneself is a copy.
constexpr int64_t kF32 = sizeof(float);
static void count_call(Group& g, Coll coll, int64_t elements, int64_t bytes_sent) {
  g.stats[(int)coll].calls += 1;
  g.stats[(int)coll].elements += elements;
  g.stats[(int)coll].bytes += g.size > 1 ? bytes_sent : 0;
}

static void copy_floats(Device device, cudaStream_t stream, float* dst, const float* src,
                        int64_t count) {
  if (dst == src || count == 0) return;
  if (device == Device::CPU)
    memmove(dst, src, count * sizeof(float));
  else
    CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(float), cudaMemcpyDeviceToDevice, stream));
}

// A collective on a group of one moves nothing between ranks: at most a copy, done at once.
// (Unless the group has an NCCL communicator of its own: --comm nccl runs it through NCCL.)
static bool local(const Group& g) {
  return g.size == 1 && !g.nccl;
}
static Handle local_copy(const Context& ctx, float* dst, const float* src, int64_t count) {
  copy_floats(ctx.device, ctx.stream, dst, src, count);
  return Handle();
}

// ---- NCCL: ops run on the comm stream; MPI: nonblocking calls on host memory ----

static ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : op == ReduceOp::Avg ? ncclAvg : ncclMax;
}
static MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
}
static int mpi_count(int64_t n) {
  PICO_ASSERT(n <= INT_MAX, "MPI counts are int: " + std::to_string(n) + " elements");
  return (int)n;
}

// Starts a collective on a group of two or more, once the data it reads is ready. NCCL: the comm
// stream waits for the compute stream's pending writes through an event, not a synchronize, so
// the host goes on. MPI on CUDA: each buffer MPI reads is copied to pinned host memory on the
// compute stream, and the host waits for that copy only (mpi_buffer).
// The state every pending op starts from: what it is (for the timeout message) and its deadline.
static std::shared_ptr<Handle::State> new_state(Group& g, const std::string& op,
                                                int64_t buffer_bytes) {
  auto s = std::make_shared<Handle::State>();
  s->group = &g;
  s->what = op + " on " + g.name + ", " + human_bytes(buffer_bytes);
  s->world_rank = g.members.empty() ? 0 : g.members[g.rank];
  s->start = now_seconds();
  s->timeout_s = g.timeout_s;
  return s;
}
// The host waits for the work queued on `stream` so far, through an event rather than a stream
// synchronise, and only until the op's deadline, like every wait of a collective.
static void wait_for_stream(Handle::State& s, cudaStream_t stream) {
  count_host_sync();
  cudaEvent_t reached;
  CUDA_CHECK(cudaEventCreateWithFlags(&reached, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(reached, stream));
  for (;;) {
    cudaError_t e = cudaEventQuery(reached);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) CUDA_CHECK(e);
    if (now_seconds() - s.start > s.timeout_s)
      nccl_stop(s.nccl, past_deadline(s.world_rank, s.what, s.timeout_s));
    std::this_thread::yield();
  }
  CUDA_CHECK(cudaEventDestroy(reached));
}
static std::shared_ptr<Handle::State> start(Comm& c, Group& g, const Context& ctx, Coll coll,
                                            int64_t buffer_bytes) {
  auto s = new_state(g, coll_name(coll), buffer_bytes);
  s->compute = ctx.stream;
  if (c.backend == Backend::NCCL) {
    PICO_ASSERT(ctx.device == Device::CUDA, "NCCL collectives need device buffers");
    s->nccl = {g.nccl};
    cudaEvent_t ready;
    CUDA_CHECK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ready, ctx.stream));
    CUDA_CHECK(cudaStreamWaitEvent(c.comm_ctx.stream, ready, 0));
    CUDA_CHECK(cudaEventDestroy(ready));  // safe: the wait is already queued
  } else if (ctx.device == Device::CUDA && coll == Coll::Barrier) {
    wait_for_stream(*s, ctx.stream);  // a barrier also means: this rank's work so far is done
  }
  // (MPI on CUDA otherwise waits only for the data it sends: mpi_buffer.)
  return s;
}
// An NCCL call that enqueues (part of) an op on a nonblocking communicator: ncclInProgress is
// accepted and remembered, for issued() (or an explicit settle()) to wait for; an error stops.
#define NCCL_ENQUEUE(state, call) nccl_enqueue(state, (call), #call, __FILE__, __LINE__)
static void nccl_enqueue(Handle::State& s, ncclResult_t r, const char* call, const char* file,
                         int line) {
  if (r == ncclInProgress) s.enqueue_pending = true;
  else if (r != ncclSuccess)
    nccl_stop(s.nccl, std::string("[NCCL ERROR] ") + file + ":" + std::to_string(line) + ": " +
                          call + " -> " + ncclGetErrorString(r) + " (" +
                          ncclGetLastError(s.nccl[0]) + ")");
}
// The op is queued: NCCL marks its end on the comm stream, for test() and wait() to find. The
// event goes on the stream only once NCCL has really enqueued the op (settle()).
static Handle issued(Comm& c, std::shared_ptr<Handle::State> s) {
  if (c.backend == Backend::NCCL) {
    s->settle();
    CUDA_CHECK(cudaEventCreateWithFlags(&s->finished, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(s->finished, c.comm_ctx.stream));
  }
  return Handle(std::move(s));
}

// The host memory MPI works on: the buffer itself on CPU; on CUDA a pinned staging buffer,
// filled from the device when `read` (the copy queued on the compute stream after the work that
// writes the data, and waited for: MPI reads it next), and copied back on the compute stream
// when the op completes when `write`.
static float* mpi_buffer(Handle::State& s, const Context& ctx, const float* buf, int64_t count,
                         bool read, bool write) {
  if (ctx.device == Device::CPU) return const_cast<float*>(buf);
  float* h = take_pinned(count);
  s.pinned.push_back(h);
  if (read) {
    CUDA_CHECK(cudaMemcpyAsync(h, buf, count * sizeof(float), cudaMemcpyDeviceToHost, ctx.stream));
    wait_for_stream(s, ctx.stream);
  }
  if (write) s.copy_back.push_back({const_cast<float*>(buf), h, count});
  return h;
}
// An input MPI reads. MPI forbids it to overlap the output (in-place calls, e.g. all_gather
// from this rank's own slot, would otherwise be errors), so an overlapping one is copied first.
bool buffers_overlap(const float* a, int64_t na, const float* b, int64_t nb) {
  return a && b && a < b + nb && b < a + na;
}
static const float* mpi_input(Handle::State& s, const Context& ctx, const float* send,
                              int64_t n_send, const float* recv, int64_t n_recv) {
  bool overlap = buffers_overlap(send, n_send, recv, n_recv);
  if (ctx.device == Device::CUDA || !overlap) return mpi_buffer(s, ctx, send, n_send, true, false);
  return s.host.emplace_back(send, send + n_send).data();
}
static void mpi_average(Handle::State& s, ReduceOp op, float* host_result, int64_t count) {
  if (op == ReduceOp::Avg) s.average_buf = host_result, s.average_count = count;
}

// ============================================================================
// Collectives: the bytes this rank sends, the NCCL call, the MPI call
// ============================================================================

Handle all_reduce_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count,
                        ReduceOp op) {
  int64_t N = g.size, K = count * kF32;
  count_call(g, Coll::AllReduce, count, 2 * (N - 1) * K / N);
  if (local(g)) return Handle();  // the sum, average or max of one buffer is itself
  auto s = start(c, g, ctx, Coll::AllReduce, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclAllReduce(buf, buf, count, ncclFloat, nccl_op(op), g.nccl,
                                   c.comm_ctx.stream));
  } else {
    float* h = mpi_buffer(*s, ctx, buf, count, true, true);
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, h, mpi_count(count), MPI_FLOAT, mpi_op(op), g.mpi,
                             s->request()));
    mpi_average(*s, op, h, count);
  }
  return issued(c, s);
}

Handle reduce_scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                            int64_t count, ReduceOp op) {
  int64_t N = g.size, K = count * N * kF32;
  count_call(g, Coll::ReduceScatter, count * N, (N - 1) * K / N);
  if (local(g)) return local_copy(ctx, recv, send, count);
  auto s = start(c, g, ctx, Coll::ReduceScatter, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclReduceScatter(send, recv, count, ncclFloat, nccl_op(op), g.nccl,
                                       c.comm_ctx.stream));
  } else {
    const float* hs = mpi_input(*s, ctx, send, count * N, recv, count);
    float* hr = mpi_buffer(*s, ctx, recv, count, false, true);
    MPI_CHECK(MPI_Ireduce_scatter_block(hs, hr, mpi_count(count), MPI_FLOAT, mpi_op(op), g.mpi,
                                        s->request()));
    mpi_average(*s, op, hr, count);
  }
  return issued(c, s);
}

Handle all_gather_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                        int64_t count) {
  int64_t N = g.size, K = count * N * kF32;
  count_call(g, Coll::AllGather, count, (N - 1) * K / N);
  if (local(g)) return local_copy(ctx, recv, send, count);
  auto s = start(c, g, ctx, Coll::AllGather, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclAllGather(send, recv, count, ncclFloat, g.nccl, c.comm_ctx.stream));
  } else {
    const float* hs = mpi_input(*s, ctx, send, count, recv, count * N);
    float* hr = mpi_buffer(*s, ctx, recv, count * N, false, true);
    MPI_CHECK(MPI_Iallgather(hs, mpi_count(count), MPI_FLOAT, hr, mpi_count(count), MPI_FLOAT,
                             g.mpi, s->request()));
  }
  return issued(c, s);
}

Handle broadcast_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "broadcast root " + std::to_string(root));
  int64_t N = g.size, K = count * kF32;
  bool is_root = g.rank == root, chain_end = g.rank == (root + N - 1) % N;
  count_call(g, Coll::Broadcast, count, chain_end ? 0 : K);  // the chain's end passes nothing on
  if (local(g)) return Handle();
  auto s = start(c, g, ctx, Coll::Broadcast, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclBroadcast(buf, buf, count, ncclFloat, root, g.nccl, c.comm_ctx.stream));
  } else {
    float* h = mpi_buffer(*s, ctx, buf, count, is_root, !is_root);
    MPI_CHECK(MPI_Ibcast(h, mpi_count(count), MPI_FLOAT, root, g.mpi, s->request()));
  }
  return issued(c, s);
}

Handle reduce_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, ReduceOp op, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "reduce root " + std::to_string(root));
  int64_t K = count * kF32;
  bool is_root = g.rank == root;
  count_call(g, Coll::Reduce, count, is_root ? 0 : K);
  if (local(g)) return local_copy(ctx, recv, send, count);
  auto s = start(c, g, ctx, Coll::Reduce, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclReduce(send, recv, count, ncclFloat, nccl_op(op), root, g.nccl,
                                c.comm_ctx.stream));
  } else {
    const float* hs = mpi_input(*s, ctx, send, count, is_root ? recv : nullptr, count);
    float* hr = is_root ? mpi_buffer(*s, ctx, recv, count, false, true) : nullptr;
    MPI_CHECK(
        MPI_Ireduce(hs, hr, mpi_count(count), MPI_FLOAT, mpi_op(op), root, g.mpi, s->request()));
    if (is_root) mpi_average(*s, op, hr, count);
  }
  return issued(c, s);
}

// NCCL has no gather or scatter: root exchanges with every peer, in one NCCL group so that no
// transfer waits for another, and copies its own slice.
Handle gather_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "gather root " + std::to_string(root));
  int64_t N = g.size, K = count * N * kF32;
  bool is_root = g.rank == root;
  count_call(g, Coll::Gather, count, is_root ? 0 : count * kF32);
  if (local(g)) return local_copy(ctx, recv, send, count);
  auto s = start(c, g, ctx, Coll::Gather, K);
  if (c.backend == Backend::NCCL) {
    cudaStream_t st = c.comm_ctx.stream;
    if (is_root) copy_floats(Device::CUDA, st, recv + root * count, send, count);
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < N; r++)
      if (is_root && r != root)
        NCCL_ENQUEUE(*s, ncclRecv(recv + r * count, count, ncclFloat, r, g.nccl, st));
    if (!is_root) NCCL_ENQUEUE(*s, ncclSend(send, count, ncclFloat, root, g.nccl, st));
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    const float* hs = mpi_input(*s, ctx, send, count, is_root ? recv : nullptr, count * N);
    float* hr = is_root ? mpi_buffer(*s, ctx, recv, count * N, false, true) : nullptr;
    MPI_CHECK(MPI_Igather(hs, mpi_count(count), MPI_FLOAT, hr, mpi_count(count), MPI_FLOAT, root,
                          g.mpi, s->request()));
  }
  return issued(c, s);
}

Handle scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                     int64_t count, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "scatter root " + std::to_string(root));
  int64_t N = g.size, K = count * N * kF32;
  bool is_root = g.rank == root;
  count_call(g, Coll::Scatter, count, is_root ? (N - 1) * count * kF32 : 0);
  if (local(g)) return local_copy(ctx, recv, send, count);
  auto s = start(c, g, ctx, Coll::Scatter, K);
  if (c.backend == Backend::NCCL) {
    cudaStream_t st = c.comm_ctx.stream;
    if (is_root) copy_floats(Device::CUDA, st, recv, send + root * count, count);
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < N; r++)
      if (is_root && r != root)
        NCCL_ENQUEUE(*s, ncclSend(send + r * count, count, ncclFloat, r, g.nccl, st));
    if (!is_root) NCCL_ENQUEUE(*s, ncclRecv(recv, count, ncclFloat, root, g.nccl, st));
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    const float* hs = is_root ? mpi_input(*s, ctx, send, count * N, recv, count) : nullptr;
    float* hr = mpi_buffer(*s, ctx, recv, count, false, true);
    MPI_CHECK(MPI_Iscatter(hs, mpi_count(count), MPI_FLOAT, hr, mpi_count(count), MPI_FLOAT, root,
                           g.mpi, s->request()));
  }
  return issued(c, s);
}

Handle send_recv_async(Comm& c, Group& g, const Context& ctx, const std::vector<P2P>& ops) {
  int64_t sent = 0, total = 0;
  Group* other = nullptr;  // the one other group of the same ranks some ops travel on
  int64_t sent_other = 0;
  for (const P2P& op : ops) {
    Group& og = op.group ? *op.group : g;
    PICO_ASSERT(op.peer >= 0 && op.peer < og.size && og.size == g.size &&
                    (&og == &g || !other || &og == other),
                "send_recv peer " + std::to_string(op.peer) + " in " + og.name);
    if (&og != &g) other = &og;
    total += op.count * kF32;
    if (op.send) (&og == &g ? sent : sent_other) += op.count * kF32;
  }
  // Each message's bytes on the group it travels on.
  count_call(g, Coll::SendRecv, sent / kF32, sent);
  if (other) count_call(*other, Coll::SendRecv, sent_other / kF32, sent_other);
  if (local(g)) {  // messages to oneself: the k-th send lands in the k-th receive, as in MPI
    std::vector<const P2P*> sends, recvs;
    for (const P2P& op : ops) (op.send ? sends : recvs).push_back(&op);
    PICO_ASSERT(sends.size() == recvs.size(), "send_recv to oneself needs a receive per send");
    for (size_t k = 0; k < sends.size(); k++) {
      PICO_ASSERT(sends[k]->count == recvs[k]->count, "send_recv to oneself: counts differ");
      copy_floats(ctx.device, ctx.stream, recvs[k]->buf, sends[k]->buf, sends[k]->count);
    }
    return Handle();
  }
  auto s = start(c, g, ctx, Coll::SendRecv, total);
  if (c.backend == Backend::NCCL) {
    // One NCCL group: a stage that sends forward and receives backward cannot deadlock.
    // A grouped call on nonblocking communicators: ncclGroupEnd may answer ncclInProgress, and
    // then every communicator of the group must be waited for.
    cudaStream_t st = c.comm_ctx.stream;
    if (other) s->nccl.push_back(other->nccl);
    NCCL_CHECK(ncclGroupStart());
    for (const P2P& op : ops) {
      ncclComm_t nc = op.group ? op.group->nccl : g.nccl;  // one group may span communicators
      if (op.send)
        NCCL_ENQUEUE(*s, ncclSend(op.buf, op.count, ncclFloat, op.peer, nc, st));
      else
        NCCL_ENQUEUE(*s, ncclRecv(op.buf, op.count, ncclFloat, op.peer, nc, st));
    }
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    const int kTag = 0;  // MPI keeps the messages between two ranks in order: one tag is enough
    for (const P2P& op : ops) {
      float* h = mpi_buffer(*s, ctx, op.buf, op.count, op.send, !op.send);
      int n = mpi_count(op.count);
      MPI_Comm mc = op.group ? op.group->mpi : g.mpi;
      if (op.send)
        MPI_CHECK(MPI_Isend(h, n, MPI_FLOAT, op.peer, kTag, mc, s->request()));
      else
        MPI_CHECK(MPI_Irecv(h, n, MPI_FLOAT, op.peer, kTag, mc, s->request()));
    }
  }
  return issued(c, s);
}

Handle barrier_async(Comm& c, Group& g, const Context& ctx) {
  count_call(g, Coll::Barrier, 0, 0);
  if (local(g)) return Handle();
  auto s = start(c, g, ctx, Coll::Barrier, 0);
  if (c.backend == Backend::NCCL) {
    // NCCL has no barrier: an all-reduce of one float completes only once every rank has joined.
    cudaStream_t st = c.comm_ctx.stream;
    float* one = nullptr;
    CUDA_CHECK(cudaMallocAsync((void**)&one, sizeof(float), st));
    CUDA_CHECK(cudaMemsetAsync(one, 0, sizeof(float), st));
    NCCL_ENQUEUE(*s, ncclAllReduce(one, one, 1, ncclFloat, ncclSum, g.nccl, st));
    s->settle();  // the all-reduce on the stream before the free behind it
    CUDA_CHECK(cudaFreeAsync(one, st));
  } else {
    MPI_CHECK(MPI_Ibarrier(g.mpi, s->request()));
  }
  return issued(c, s);
}

// ---- blocking versions: the nonblocking call, waited for ----

void all_reduce(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, ReduceOp op) {
  all_reduce_async(c, g, ctx, buf, count, op).wait();
}
void reduce_scatter(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, ReduceOp op) {
  reduce_scatter_async(c, g, ctx, send, recv, count, op).wait();
}
void all_gather(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                int64_t count) {
  all_gather_async(c, g, ctx, send, recv, count).wait();
}
void broadcast(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int root) {
  broadcast_async(c, g, ctx, buf, count, root).wait();
}
void reduce(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
            ReduceOp op, int root) {
  reduce_async(c, g, ctx, send, recv, count, op, root).wait();
}
void gather(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
            int root) {
  gather_async(c, g, ctx, send, recv, count, root).wait();
}
void scatter(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
             int root) {
  scatter_async(c, g, ctx, send, recv, count, root).wait();
}
void send_recv(Comm& c, Group& g, const Context& ctx, const std::vector<P2P>& ops) {
  send_recv_async(c, g, ctx, ops).wait();
}
void send(Comm& c, Group& g, const Context& ctx, const float* buf, int64_t count, int peer) {
  send_recv(c, g, ctx, {P2P{true, const_cast<float*>(buf), count, peer}});
}
void recv(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int peer) {
  send_recv(c, g, ctx, {P2P{false, buf, count, peer}});
}
void barrier(Comm& c, Group& g, const Context& ctx) {
  barrier_async(c, g, ctx).wait();
}

// ---- host-side collectives: bookkeeping, not training traffic (never counted) ----

// Posts one MPI call on host memory and waits for it through a Handle, so the same deadline
// and the same message ("all_reduce_host on dp_cp, 8 B did not finish within ...") apply.
static void host_collective(Group& g, const char* op, int64_t bytes,
                            const std::function<int(MPI_Request*)>& post) {
  if (g.size == 1) return;
  auto s = new_state(g, op, bytes);
  MPI_CHECK(post(s->request()));
  Handle(s).wait();
}

void host_wait(Group& g, const char* what, int64_t bytes,
               const std::function<int(MPI_Request*)>& post) {
  auto s = new_state(g, what, bytes);
  MPI_CHECK(post(s->request()));
  Handle(s).wait();
}

static void all_reduce_doubles(Group& g, const char* op_name, double* values, int count,
                               ReduceOp op) {
  host_collective(g, op_name, (int64_t)count * sizeof(double), [&](MPI_Request* r) {
    return MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE,
                          op == ReduceOp::Max ? MPI_MAX : MPI_SUM, g.mpi, r);
  });
  if (op == ReduceOp::Avg)
    for (int i = 0; i < count; i++) values[i] /= g.size;
}

void TrafficMeter::open(const Group& g) { std::copy(g.stats, g.stats + (int)Coll::Count, opened); }
void TrafficMeter::close(const Group& g) {
  for (int c = 0; c < (int)Coll::Count; c++) {
    total[c].calls += g.stats[c].calls - opened[c].calls;
    total[c].elements += g.stats[c].elements - opened[c].elements;
    total[c].bytes += g.stats[c].bytes - opened[c].bytes;
  }
}

void all_reduce_host(Group& g, double* values, int count, ReduceOp op) {
  all_reduce_doubles(g, "all_reduce_host", values, count, op);
}

void agree_on_error(Group& g, const std::function<void()>& fn) {
  std::string message;
  try {
    fn();
  } catch (const UsageError& e) {
    message = e.what();
  }
  // The lowest group rank with an error, as a max of -rank (-size: none).
  double first = message.empty() ? -g.size : -g.rank;
  all_reduce_doubles(g, "agree_on_error", &first, 1, ReduceOp::Max);
  int root = (int)-first;
  if (root == g.size) return;
  int length = (int)message.size();
  host_collective(g, "agree_on_error", sizeof length, [&](MPI_Request* r) {
    return MPI_Ibcast(&length, 1, MPI_INT, root, g.mpi, r);
  });
  message.resize(length);
  host_collective(g, "agree_on_error", length, [&](MPI_Request* r) {
    return MPI_Ibcast(message.data(), length, MPI_CHAR, root, g.mpi, r);
  });
  throw UsageError(message);
}

void trace_write(const Trace& trace, const std::string& path, Group& g) {
  double t0 = -1e300;  // the earliest span of any rank is time 0: a max of negated starts
  for (const Trace::Span& s : trace.spans) t0 = std::max(t0, -s.start);
  all_reduce_doubles(g, "trace_write", &t0, 1, ReduceOp::Max);
  t0 = -t0;
  // Chrome trace "complete" events: ph X, ts and dur in microseconds, pid = rank, tid = track.
  std::string mine;
  for (const Trace::Span& s : trace.spans) {
    nlohmann::json event{{"name", s.name}, {"ph", "X"}, {"pid", g.rank}, {"tid", (int)s.track},
                         {"ts", (s.start - t0) * 1e6}, {"dur", (s.end - s.start) * 1e6}};
    if (!s.color.empty()) event["cname"] = s.color;
    mine += event.dump() + "\n";
  }
  int length = (int)mine.size();
  std::vector<int> lengths(g.size, length), offsets(g.size, 0);
  host_collective(g, "trace_write", sizeof length, [&](MPI_Request* r) {
    return MPI_Igather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, g.mpi, r);
  });
  for (int r = 1; r < g.size; r++) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string all = g.rank == 0 ? std::string(offsets[g.size - 1] + lengths[g.size - 1], '\0')
                                : std::string();
  if (g.size == 1) all = mine;
  host_collective(g, "trace_write", length, [&](MPI_Request* r) {
    return MPI_Igatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                        MPI_CHAR, 0, g.mpi, r);
  });
  if (g.rank != 0) return;
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < g.size; r++) {
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", r}, {"args", {{"name", "rank " + std::to_string(r)}}}});
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 0}, {"args", {{"name", "compute"}}}});
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", 1}, {"args", {{"name", "communication"}}}});
  }
  size_t pos = 0;
  while (pos < all.size()) {
    size_t end = all.find('\n', pos);
    events.push_back(nlohmann::json::parse(all.substr(pos, end - pos)));
    pos = end + 1;
  }
  const std::string text =
      nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() + "\n";
  try {
    write_file_atomic(path, [&](FILE* f) { write_all(f, text.data(), text.size(), path); });
  } catch (const UsageError& e) {
    throw UsageError(std::string("--trace ") + e.what());
  }
}
