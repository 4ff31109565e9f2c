// comm_internal.cuh: what comm.cu, comm_setup.cu and comm_handle.cu share, and no caller of
// comm.cuh needs: NCCL's waits against a deadline, the state of a pending collective
// (Handle::State), and the steps every collective takes to start, issue and stage its data.
#pragma once
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/comm.cuh"

// The stream a group's NCCL ops go on: its own, or the communication stream.
inline cudaStream_t stream_of(const Comm& c, const Group& g) {
  return g.stream ? g.stream : c.comm_ctx.stream;
}
// Work queued on `waiter` from now on runs after what is queued on `done` so far, through an
// event; the host goes on.
void stream_waits_for(cudaStream_t waiter, cudaStream_t done);

// ---- comm_handle.cu: how a rank waits ----
// Yields for the first `spin_s` seconds of a wait, then, when the node's ranks share cores
// (set_cores_shared), sleeps: a rank waiting in a pipeline's bubble hands its core to a rank that
// computes instead of polling on it. With a core per rank it only yields.
void pause_while_waiting(double since, double spin_s);
void set_cores_shared(bool shared);

// ---- comm_setup.cu: NCCL's nonblocking communicators, waited for against a deadline ----

// Prints `message`, aborts the communicators (at most a few seconds), then stops every rank.
[[noreturn]] void nccl_stop(const std::vector<ncclComm_t>& comms, const std::string& message);
// "rank 3: <what> failed in NCCL: <error> (<NCCL's last message>)".
std::string nccl_error(const std::string& what, int world_rank, ncclResult_t r, ncclComm_t comm);
// "rank 3: <what> did not finish within 300s (--comm-timeout): ...".
std::string past_deadline(int world_rank, const std::string& what, double timeout_s);
// For each group, the index of the group whose NCCL communicator (and stream) it uses: the first
// group of its lane with the same members in the same order, or itself; a lane of -1 is the lane
// of the first group of the same members that has one (the world's). Groups that share one
// issue their ops in one order on every member, since they are the same ranks running the same
// program, and fewer communicators are fewer streams for the GPU's hardware queues.
std::vector<int> communicator_owners(const std::vector<std::vector<int>>& members,
                                     const std::vector<int>& lanes);
// The links rank `rank` of a pipeline group of `size` makes for `pairs` (group ranks, sender
// first; neighbours), in the pairs' order, each with where its NCCL id sits among the ids the
// group gathers: the sender's [rank][0: to the next rank, 1: to the previous one], which the
// sender makes and both ends read (comm_setup.cu's make_links).
struct LinkPlan {
  int from, to, id_slot;
};
std::vector<LinkPlan> link_plan(const PipelinePairs& pairs, int rank, int size);
// Every way to each neighbour of pp_size ranks in a ring: (from, to) pairs, none at pp_size 1.
PipelinePairs neighbour_pairs(int pp_size);
// The most links any of pp_size ranks makes for these pairs: one per pair it is in, on pp and on
// pp_grad (comm_setup.cu's make_links).
int most_links(const PipelinePairs& pairs, int pp_size);
// Why CUDA_DEVICE_MAX_CONNECTIONS (as set, or null) is too few hardware queues for a pipeline
// over NCCL of this many links and communicators a rank, or "" (comm_setup.cu).
std::string device_queue_shortage(const char* connections, int links, int communicators);
// What may go wrong when NCCL's own streams are counted too (its two a communicator), or "".
std::string device_queue_note(const char* connections, int links, int communicators);
// Waits until every communicator of `comms` has finished the call that returned `returned`,
// or stops every rank past start + timeout_s.
void nccl_settle(const std::vector<ncclComm_t>& comms, ncclResult_t returned,
                 const std::string& what, int world_rank, double start, double timeout_s);

// ---- comm_handle.cu: a collective in flight ----

// What it takes to finish one collective: its MPI requests or the NCCL event marking its end,
// its staging buffers, and its deadline.
struct Handle::State {
  Group* group = nullptr;
  std::string what;  // "all_reduce on dp_cp, 1.50 MiB", for the timeout message
  int world_rank = 0;
  double start = 0, timeout_s = 0;
  bool done = false;
  // MPI backend. A collective starts once the ones this rank started before it on the same
  // communicator have finished (mpi_post); until then `post` holds the call that starts it.
  std::vector<MPI_Request> requests;
  std::function<int(MPI_Request*)> post;
  bool queued = false;  // in its communicator's queue: not started, or started and not done
  // Every rank of the group takes part at once (a collective, not a send_recv): its peers are
  // at the same op, and it moves only while they are all inside MPI.
  bool lockstep = true;
  std::deque<std::vector<char>> host;  // host copies of aliased inputs (CPU)
  std::vector<void*> pinned;  // staging buffers of device data (CUDA), given back at the end
  struct CopyBack {
    void* device;
    const void* host;
    int64_t bytes;
  };
  std::vector<CopyBack> copy_back;  // host -> device when the op completes
  float* average_buf = nullptr;     // MPI has no average: sum, then scale this host buffer
  int64_t average_count = 0;
  std::vector<int> mpi_counts;  // all-to-all-v's counts and displacements, read by MPI
                                // until the op completes
  // NCCL backend.
  std::vector<ncclComm_t> nccl;    // the communicators the op runs on (a send_recv's links too)
  bool enqueue_pending = false;    // a call answered ncclInProgress: settle() before going on
  cudaEvent_t finished = nullptr;  // on the group's stream, after its part of the op
  std::vector<cudaEvent_t> other_ends;  // a send_recv's on its other streams (links), after it
  cudaStream_t compute = nullptr;       // the caller's stream: waits for `finished`, or copy-back

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
  void wait();
  // A Handle dropped without wait() still completes here, so its buffers are never left in
  // flight (the communicator must still exist).
  ~State() {
    if (!done) wait();
    if (finished) cudaEventDestroy(finished);
    for (cudaEvent_t e : other_ends) cudaEventDestroy(e);
  }
};

// A pending op on `g`, named `op` for the timeout message ("all_reduce", "agree_on_error"), its
// deadline counted from now.
std::shared_ptr<Handle::State> new_state(Group& g, const std::string& op, int64_t buffer_bytes);
// The first and last steps of every collective on a group of two or more: start() orders the op
// after the data it reads, issued() hands it to a Handle once its NCCL calls are queued.
std::shared_ptr<Handle::State> start(Comm& c, Group& g, const Context& ctx, Coll coll,
                                     int64_t buffer_bytes);
Handle issued(Comm& c, std::shared_ptr<Handle::State> s);
// Starts an MPI collective (`post` with the request to fill) now, or, while an earlier one of
// this rank on the group's communicator is still in flight, as soon as that one has finished.
void mpi_post(const std::shared_ptr<Handle::State>& s, std::function<int(MPI_Request*)> post);
// An NCCL call that enqueues (part of) an op on a nonblocking communicator: ncclInProgress is
// accepted and remembered, for issued() (or an explicit settle()) to wait for; an error stops.
#define NCCL_ENQUEUE(state, call) nccl_enqueue(state, (call), #call, __FILE__, __LINE__)
void nccl_enqueue(Handle::State& s, ncclResult_t r, const char* call, const char* file, int line);
// The host memory an MPI call reads (mpi_input: copied first when it overlaps the output) or
// writes, `bytes` long; on CUDA a pinned buffer, staged from and to the device.
void* mpi_buffer(Handle::State& s, const Context& ctx, const void* buf, int64_t bytes, bool read,
                 bool write);
const void* mpi_input(Handle::State& s, const Context& ctx, const void* send, int64_t send_bytes,
                      const void* recv, int64_t recv_bytes);
