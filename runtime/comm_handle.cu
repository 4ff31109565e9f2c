// comm_handle.cu: a collective in flight, from the moment it starts to the moment a Handle
// finishes it. Playbook appendix A0 (overlapping communication with computation). The one idea:
// the host never blocks on a collective it can leave running. On NCCL the op is queued on the
// communication stream behind an event of the compute stream, and its end is an event the compute
// stream waits for; on MPI the op is a nonblocking call on host memory (on CUDA, pinned buffers
// staged to and from the device), advanced by MPI_Testall. Every wait is bounded by
// --comm-timeout: a peer that failed ends the job instead of hanging it.
#include <chrono>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm_internal.cuh"

// ============================================================================
// Waiting
// ============================================================================

// Ranks that share cores: more node-local ranks, times their threads, than the cores they may
// run on (comm_init finds out). Polling there would take a core from a rank with work to do, so
// that every rank waiting at a collective or in a pipeline's bubble would slow those computing.
static bool g_cores_shared = false;
void set_cores_shared(bool shared) {
  g_cores_shared = shared;
}
void pause_while_waiting(double since, double spin_s) {
  if (!g_cores_shared || now_seconds() - since < spin_s)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(std::chrono::microseconds(50));
}

// How long a wait polls before it sleeps. A collective's peers reach it together, and MPI moves
// its data a fragment at a time, only while both ends are inside MPI: a rank that slept 50 us
// between polls would hold every peer back at each fragment (measured on 4 ranks sharing 2 cores:
// a 2 MiB all-reduce took 15 ms between sleeping ranks, 0.6 ms between polling ones). So a
// collective polls until it is done. A send_recv may wait a whole bubble of a pipeline for a
// neighbour that computes meanwhile: it polls for a millisecond, then sleeps.
constexpr double kSpinPointToPoint_s = 1e-3;
void Handle::State::wait() {
  const double since = now_seconds();
  const double spin_s = lockstep ? std::numeric_limits<double>::infinity() : kSpinPointToPoint_s;
  while (!poll()) pause_while_waiting(since, spin_s);
}

// ============================================================================
// MPI's collectives, one at a time per communicator
// ============================================================================

// Several nonblocking collectives in flight at once on MPI's shared-memory transport move their
// data more slowly together than one after another (measured: 10 reduce-scatters of 7.6 MB on 4
// ranks, 41 ms in turn, 165 ms at once), and a data-parallel backward starts a bucket's
// collective while the previous ones still run. So each communicator keeps a queue: its head is
// in flight, the rest wait for it, and any rank's poll of any op advances every queue (a rank
// waiting for something else still starts what its peers wait for). Every rank starts a
// communicator's collectives in the order it issued them, the order MPI matches them in.
// The queues point at the states, which outlive their place in it: a state is destroyed only once
// its op has finished (a Handle dropped unwaited waits in its destructor).
static std::map<MPI_Comm, std::deque<Handle::State*>> g_mpi_queues;

static void advance_mpi_queues() {
  for (auto q = g_mpi_queues.begin(); q != g_mpi_queues.end();) {
    std::deque<Handle::State*>& ops = q->second;
    while (!ops.empty()) {
      Handle::State& head = *ops.front();
      if (head.post) {
        MPI_CHECK(head.post(head.request()));
        head.post = nullptr;
      }
      int flag = 0;
      MPI_CHECK(
          MPI_Testall((int)head.requests.size(), head.requests.data(), &flag, MPI_STATUSES_IGNORE));
      if (!flag) break;
      head.queued = false;  // done: its own poll() finishes it
      ops.pop_front();
    }
    q = ops.empty() ? g_mpi_queues.erase(q) : std::next(q);
  }
}

void mpi_post(const std::shared_ptr<Handle::State>& s, std::function<int(MPI_Request*)> post) {
  s->post = std::move(post);
  s->queued = true;
  g_mpi_queues[s->group->mpi].push_back(s.get());
  advance_mpi_queues();
}

// ============================================================================
// Handle: what it takes to finish one collective
// ============================================================================

// With the staging buffers, at the end.
static void give_back_pinned(void* ptr, cudaStream_t stream);

// Advances the op (MPI_Testall progresses MPI's nonblocking collectives) and finishes it when
// complete. Past the deadline it stops every rank: a peer that died or diverged would
// otherwise leave this rank waiting forever.
bool Handle::State::poll() {
  if (done) return true;
  bool complete = false;
  if (finished) {
    complete = event_reached(finished);
    for (size_t i = 0; complete && i < other_ends.size(); i++)
      complete = event_reached(other_ends[i]);
    for (size_t i = 0; !complete && i < nccl.size(); i++) {  // a failed peer shows up here
      ncclResult_t async = ncclSuccess, r = ncclCommGetAsyncError(nccl[i], &async);
      if (r != ncclSuccess) async = r;
      if (async != ncclSuccess && async != ncclInProgress)
        nccl_stop(nccl, nccl_error(what, world_rank, async, nccl[i]));
    }
  } else {
    advance_mpi_queues();
    int flag = 0;
    if (!queued)  // a queued collective is tested by advance_mpi_queues, until it is done
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
    CUDA_CHECK(cudaMemcpyAsync(cb.device, cb.host, cb.bytes, cudaMemcpyHostToDevice, compute));
  for (void* p : pinned) give_back_pinned(p, compute);
  pinned.clear();
  // Work queued later on the compute stream runs after the collective; the host goes on.
  if (finished) CUDA_CHECK(cudaStreamWaitEvent(compute, finished, 0));
  for (cudaEvent_t e : other_ends) CUDA_CHECK(cudaStreamWaitEvent(compute, e, 0));
  done = true;
}

bool Handle::test() {
  return !state_ || state_->poll();
}
// On NCCL the host also waits here (polling the event) rather than trusting the GPU to finish:
// that is what lets a stuck peer end the run after --comm-timeout instead of hanging it. The op
// is queued behind the compute stream's work, so a wait that finds it unfinished waits for
// the device: a host synchronisation, counted (--report sync).
void Handle::wait() {
  if (state_) {
    mark_ledger_clock();  // waiting is no op's time (--report roofline's measured time)
    if (state_->finished && !state_->poll()) count_host_sync();
    state_->wait();
  }
  state_.reset();
}

// ============================================================================
// Starting one: the data ready, the op queued
// ============================================================================

// The state every pending op starts from: what it is (for the timeout message) and its deadline.
std::shared_ptr<Handle::State> new_state(Group& g, const std::string& op, int64_t buffer_bytes) {
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
  if (!stream_reached_by(stream, s.start + s.timeout_s))
    nccl_stop(s.nccl, past_deadline(s.world_rank, s.what, s.timeout_s));
}
void stream_waits_for(cudaStream_t waiter, cudaStream_t done) {
  cudaEvent_t reached;
  CUDA_CHECK(cudaEventCreateWithFlags(&reached, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(reached, done));
  CUDA_CHECK(cudaStreamWaitEvent(waiter, reached, 0));
  CUDA_CHECK(cudaEventDestroy(reached));  // safe: the wait is already queued
}
// Starts a collective on a group of two or more, once the data it reads is ready. NCCL: the comm
// stream waits for the compute stream's pending writes through an event, not a synchronize, so
// the host goes on. MPI on CUDA: each buffer MPI reads is copied to pinned host memory on the
// compute stream, and the host waits for that copy only (mpi_buffer).
std::shared_ptr<Handle::State> start(Comm& c, Group& g, const Context& ctx, Coll coll,
                                     int64_t buffer_bytes) {
  auto s = new_state(g, coll_name(coll), buffer_bytes);
  s->compute = ctx.stream;
  if (c.backend == Backend::NCCL) {
    PICO_ASSERT(ctx.device == Device::CUDA, "NCCL collectives need device buffers");
    s->nccl = {g.nccl};
    stream_waits_for(stream_of(c, g), ctx.stream);
  } else if (ctx.device == Device::CUDA && coll == Coll::Barrier) {
    wait_for_stream(*s, ctx.stream);  // a barrier also means: this rank's work so far is done
  }
  // (MPI on CUDA otherwise waits only for the data it sends: mpi_buffer.)
  return s;
}
// Behind NCCL_ENQUEUE: ncclInProgress is remembered for settle(); an error stops every rank.
void nccl_enqueue(Handle::State& s, ncclResult_t r, const char* call, const char* file, int line) {
  if (r == ncclInProgress)
    s.enqueue_pending = true;
  else if (r != ncclSuccess)
    nccl_stop(s.nccl, std::string("[NCCL ERROR] ") + file + ":" + std::to_string(line) + ": " +
                          call + " -> " + ncclGetErrorString(r) + " (" +
                          ncclGetLastError(s.nccl[0]) + ")");
}
// The op is queued: NCCL marks its end on the comm stream, for test() and wait() to find. The
// event goes on the stream only once NCCL has really enqueued the op (settle()).
Handle issued(Comm& c, std::shared_ptr<Handle::State> s) {
  if (c.backend == Backend::NCCL) {
    s->settle();
    CUDA_CHECK(cudaEventCreateWithFlags(&s->finished, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(s->finished, stream_of(c, *s->group)));
  }
  return Handle(std::move(s));
}

// ============================================================================
// Staging through the host (MPI on CUDA: ranks sharing a GPU)
// ============================================================================

// Pinned host buffers, cached and reused by every collective of the process, as the stream-ordered
// pool caches device memory: cudaMallocHost is slow (it pins pages), and only pinned memory lets
// a copy run asynchronously on a stream. A buffer is taken for one collective and given back
// with an event on the stream of its last copy; it is taken again only once that event is done.
struct PinnedBuffer {
  void* ptr = nullptr;
  int64_t capacity = 0;              // bytes
  cudaEvent_t free_after = nullptr;  // recorded after the last copy that uses it
  bool taken = false;
};
static std::mutex g_pinned_mutex;
static std::deque<PinnedBuffer> g_pinned;  // the cache; freed by the driver when the process ends

static void* take_pinned(int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  PinnedBuffer* best = nullptr;  // the smallest free buffer that fits
  for (PinnedBuffer& b : g_pinned) {
    if (b.taken || b.capacity < bytes || (best && best->capacity <= b.capacity)) continue;
    if (b.free_after && !event_reached(b.free_after)) continue;  // its last copy back: not run
    best = &b;
  }
  if (!best) {  // powers of two from 256 KiB, so buffers fit many later requests
    best = &g_pinned.emplace_back();
    best->capacity = 1 << 18;
    while (best->capacity < bytes) best->capacity *= 2;
    CUDA_CHECK(cudaMallocHost(&best->ptr, best->capacity));
    CUDA_CHECK(cudaEventCreateWithFlags(&best->free_after, cudaEventDisableTiming));
  }
  best->taken = true;
  return best->ptr;
}
// Free again once the work queued on `stream` so far (the copies that use it) has run.
static void give_back_pinned(void* ptr, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  for (PinnedBuffer& b : g_pinned)
    if (b.ptr == ptr) {
      CUDA_CHECK(cudaEventRecord(b.free_after, stream));
      b.taken = false;
      return;
    }
  PICO_ASSERT(false, "a staging buffer given back twice or never taken");
}

// The host memory MPI works on: the buffer itself on CPU; on CUDA a pinned staging buffer,
// filled from the device when `read` (the copy queued on the compute stream after the work that
// writes the data, and waited for: MPI reads it next), and copied back on the compute stream
// when the op completes when `write`.
void* mpi_buffer(Handle::State& s, const Context& ctx, const void* buf, int64_t bytes, bool read,
                 bool write) {
  if (ctx.device == Device::CPU) return const_cast<void*>(buf);
  void* h = take_pinned(bytes);
  s.pinned.push_back(h);
  if (read) {
    CUDA_CHECK(cudaMemcpyAsync(h, buf, bytes, cudaMemcpyDeviceToHost, ctx.stream));
    wait_for_stream(s, ctx.stream);
  }
  if (write) s.copy_back.push_back({const_cast<void*>(buf), h, bytes});
  return h;
}
// An input MPI reads. MPI forbids it to overlap the output (in-place calls, e.g. all_gather
// from this rank's own slot, would otherwise be errors), so an overlapping one is copied first.
bool buffers_overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes) {
  const char *x = (const char*)a, *y = (const char*)b;
  return x && y && x < y + b_bytes && y < x + a_bytes;
}
const void* mpi_input(Handle::State& s, const Context& ctx, const void* send, int64_t send_bytes,
                      const void* recv, int64_t recv_bytes) {
  const bool overlap = buffers_overlap(send, send_bytes, recv, recv_bytes);
  if (ctx.device == Device::CUDA || !overlap)
    return mpi_buffer(s, ctx, send, send_bytes, true, false);
  return s.host.emplace_back((const char*)send, (const char*)send + send_bytes).data();
}
