// comm.cuh: the process grid [dp][pp][cp][tp] (tp fastest) and collectives on its groups,
// over NCCL (one GPU per rank) or MPI (CPU ranks, or ranks sharing a GPU: device buffers are
// staged through host memory). Playbook appendix A0; DESIGN sections 3 and 4.
// Every collective exists as a nonblocking call returning a Handle and as a blocking call
// (the nonblocking one, waited for). Buffers are float arrays on the communicator's device;
// all-reduce, reduce-scatter, all-gather and all-to-all also carry bf16 and fp16 (mixed
// precision).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "runtime/core.cuh"

enum class Backend { MPI, NCCL };
enum class ReduceOp { Sum, Avg, Max };
enum class Coll {
  AllReduce,
  ReduceScatter,
  AllGather,
  Broadcast,
  Reduce,
  Gather,
  Scatter,
  SendRecv,
  Barrier,
  AllToAll,
  Count
};
const char* coll_name(Coll c);        // "all_reduce", "reduce_scatter", ...
const char* backend_name(Backend b);  // "mpi", "nccl"

// Per group and collective. Counted at each call: calls, and elements, the floats of this rank's
// data argument (all-reduce, broadcast and reduce: the buffer; reduce-scatter: its input of N
// shards; all-gather, gather and scatter: this rank's shard; send/recv: the floats it sends;
// all-to-all: its whole send buffer, its own segment included).
// Charged by formula: bytes, what the algorithm makes this rank send. Library collectives are
// charged the ring algorithm's share (all-reduce 2(N-1)K/N, reduce-scatter and all-gather
// (N-1)K/N of a K-byte buffer; see comm.cu for the others), since the library does not say
// what it sent; send/recv, and the hand-written ring built on it, count the bytes actually sent,
// and so does all-to-all: the segments it sends to other ranks (its own stays local).
struct CollStats {
  int64_t calls = 0;
  int64_t elements = 0;
  int64_t bytes = 0;
};

struct Group;
// What a group's collectives sent between open() and close(), summed over every such window:
// the training steps' traffic, without validation's or checkpoints'.
struct TrafficMeter {
  CollStats opened[(int)Coll::Count] = {}, total[(int)Coll::Count] = {};
  void open(const Group& g);
  void close(const Group& g);
};

struct Group {
  std::string name;          // "world", "tp", "cp", "pp", "dp", "dp_cp"
  int rank = 0, size = 1;    // this rank's index in the group, and the group's size
  std::vector<int> members;  // world ranks, in group order
  int next() const { return (rank + 1) % size; }  // ring neighbours (group ranks)
  int prev() const { return (rank + size - 1) % size; }
  MPI_Comm mpi = MPI_COMM_NULL;  // none in a simulated world: its groups exchange nothing
  bool simulated = false;
  ncclComm_t nccl = nullptr;  // none on MPI, nor for a group of one under --comm auto
  double timeout_s = 300;     // --comm-timeout: how long any collective on it may wait
  CollStats stats[(int)Coll::Count];
  // NCCL: the stream its ops run on, in order. Each communicator has its own, so that one group's
  // collectives never queue behind another's: an expert all-to-all or a tp all-reduce in the
  // backward behind the gradient buckets' all-reduces (PyTorch gives each process group its own
  // stream too). Groups of the same ranks whose ops may queue together share a communicator and
  // its stream (comm_setup.cu: communicator_owners): dp, dp_cp, edp_cp and the world when they
  // are the same ranks, and pp with pp_grad (whose messages travel on their links).
  cudaStream_t stream = nullptr;
  float* barrier_word =
      nullptr;  // NCCL: what its barriers all-reduce (cudaMalloc, with the stream)
  // NCCL, the pipeline's groups (pp, pp_grad): a communicator of two ranks and a stream for each
  // way the run's messages travel between this rank and a neighbour (comm_init's pipeline pairs),
  // which their sends and receives travel on.
  // An NCCL send holds its stream until the peer receives; on a stream of its own it never
  // holds up this rank's receives, so a stage waits only for what it receives, as on MPI.
  struct Link {
    int from = 0, to = 0;  // group ranks
    ncclComm_t nccl = nullptr;
    cudaStream_t stream = nullptr;
  };
  std::vector<Link> links;
};

struct Grid {
  int dp = 1, pp = 1, cp = 1, tp = 1;
  int ep = 1;  // expert parallelism: blocks of ep consecutive dp ranks (it divides dp)
  int world_size = 1, world_rank = 0;
  int dp_rank = 0, pp_rank = 0, cp_rank = 0, tp_rank = 0;
  // A simulated world (--simulate-world, the meta device): this one process stands for rank
  // world_rank of world_size ranks that exchange nothing; it prints as rank 0 would.
  bool simulated = false;
  // The rank that prints the run's lines and reports and writes its outputs: world rank 0, or
  // the one rank a simulated world runs.
  bool prints() const { return world_rank == 0 || simulated; }
  // The world rank at coordinates (d, p, c, t): ((d * pp + p) * cp + c) * tp + t.
  int rank_of(int d, int p, int c, int t) const { return ((d * pp + p) * cp + c) * tp + t; }
};
// Coordinates of `world_rank`; throws UsageError unless world_size == dp * pp * cp * tp.
Grid make_grid(int dp, int pp, int cp, int tp, int world_size, int world_rank);

// A pending collective. test() advances it without blocking and says whether it is done;
// wait() finishes it (copying staged data back, applying Avg) and orders the compute stream
// after it. Both abort every rank when it takes longer than the communicator's timeout.
class Handle {
 public:
  struct State;
  Handle() = default;
  explicit Handle(std::shared_ptr<State> s) : state_(std::move(s)) {}
  bool test();
  void wait();
  bool active() const { return state_ != nullptr; }

 private:
  std::shared_ptr<State> state_;
};

struct P2P {  // one half of a batched send/recv
  bool send;
  void* buf;
  int64_t count;           // elements of `dtype`
  int peer;                // group rank
  Group* group = nullptr;  // another group of the same ranks than the call's (nullptr: the call's)
  DType dtype = DType::F32;  // F32, BF16 or F16: moved, never combined
};

struct Comm {
  Backend backend = Backend::MPI;
  Device device = Device::CPU;
  double timeout_s = 300;  // --comm-timeout
  Grid grid;
  // pp carries activations to the next stage; pp_grad, the same ranks on an MPI communicator of
  // its own (on NCCL, links of its own), carries their gradients back, so the two directions
  // never match each other's messages.
  // Expert parallelism (expert_parallel.cu) carves its groups out of the dp ranks: ep, the ep
  // consecutive dp ranks (same pp, cp, tp) whose experts together are all of them, where tokens
  // are dispatched; edp_cp, the ranks holding the same experts (same pp, tp and ep rank, every
  // cp rank and every ep block), over which the experts' gradients are summed. ep = 1: every
  // rank holds every expert, ep is one rank and edp_cp is dp_cp.
  Group world, tp, cp, pp, pp_grad, dp, dp_cp, ep, edp_cp;
  Context comm_ctx;  // the communication stream (CUDA), for kernels that belong to it
  std::vector<Group*> groups() {
    return {&world, &tp, &cp, &pp, &pp_grad, &dp, &dp_cp, &ep, &edp_cp};
  }
};
// `backend_flag` is auto|nccl|mpi: auto is nccl on CUDA with one GPU per rank on each node,
// else mpi. Under auto a group of one has no communicator (its collectives are local copies);
// an explicit nccl gives every group one, groups of one included, so that one rank on one GPU
// runs every collective through NCCL. Every wait of the set-up (the splits into groups, the
// exchange of NCCL ids) and NCCL's creation, first connections and destruction are bounded by
// `timeout_s` like every collective: a rank that never arrives stops every rank, never hangs.
// Throws UsageError for a world that is not dp*pp*cp*tp, an unknown backend, or nccl without a GPU
// per rank. Call after MPI_Init and cudaSetDevice.
// A simulated world (the meta device, --simulate-world): one process runs the code path of world
// rank `rank` of `world` ranks; its groups have their members but no communicator, and nothing
// is exchanged (every collective counts its bytes and returns). world 0: the real one.
struct SimulatedWorld {
  int world = 0, rank = 0;
};
// The ways a pipeline's activations travel: (from, to) pairs of pp ranks, neighbours; its
// gradients go back the same ways (pipeline_messages, pipeline_parallel.cuh). Over NCCL each is
// a link on pp and one on pp_grad (Group::links). Empty: every way to each neighbour.
using PipelinePairs = std::vector<std::pair<int, int>>;
Comm comm_init(int dp, int pp, int cp, int tp, const std::string& backend_flag, Device device,
               double timeout_s, int ep = 1, const SimulatedWorld& simulate = {},
               const PipelinePairs& pipeline = {});
void comm_destroy(Comm& comm);
// Node-local rank and node-local rank count (MPI_COMM_TYPE_SHARED), for choosing a GPU.
// Collective over the world; a rank that never arrives stops every rank after `timeout_s`
// (--comm-timeout), the message naming the step, like every collective.
void local_rank(int* rank, int* size, double timeout_s);
// The backend one node allows, from the PCI bus id of each of its ranks' GPUs ("" for a rank
// without one): nccl when every rank has a GPU and no two share one, else mpi (NCCL refuses two
// ranks on one GPU). Bus ids, not device numbers: with one GPU visible per rank (SLURM
// --gpus-per-task=1) every rank's GPU is device 0. When mpi, `why` (if given) says which
// ranks of the node are in the way.
Backend backend_for_node(const std::vector<std::string>& bus_ids, std::string* why = nullptr);

// Collectives on a group. `ctx` is the compute stream the data comes from and goes back to.
// Sizes are element counts per rank: reduce_scatter sends count * size and receives count;
// all_gather sends count and receives count * size (rank-major); gather/scatter likewise at root.
Handle all_reduce_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count,
                        ReduceOp op);
// The same three in `dtype` (F32, BF16 or F16; counts in elements, bytes counted at 2 per
// element for 16-bit ones). 16-bit sums and maxima: each pair widened to fp32, combined, rounded
// back (NCCL's ncclBfloat16 / ncclHalf; over MPI the bits travel as MPI_UINT16_T and the
// operation is ours, comm.cu). No 16-bit Avg: sum, and scale afterwards in fp32.
Handle all_reduce_async(Comm& c, Group& g, const Context& ctx, void* buf, DType dtype,
                        int64_t count, ReduceOp op);
Handle reduce_scatter_async(Comm& c, Group& g, const Context& ctx, const void* send, void* recv,
                            DType dtype, int64_t count, ReduceOp op);
Handle all_gather_async(Comm& c, Group& g, const Context& ctx, const void* send, void* recv,
                        DType dtype, int64_t count);
Handle reduce_scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                            int64_t count, ReduceOp op);
Handle all_gather_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                        int64_t count);
Handle broadcast_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int root);
Handle reduce_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, ReduceOp op, int root);
Handle gather_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, int root);
Handle scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                     int64_t count, int root);
Handle send_recv_async(Comm& c, Group& g, const Context& ctx, const std::vector<P2P>& ops);
Handle barrier_async(Comm& c, Group& g, const Context& ctx);
// All-to-all with variable counts (expert parallelism's dispatch and combine): this rank sends
// send_counts[p] elements to group rank p and receives recv_counts[p] from it. Both buffers
// hold one contiguous segment per peer in rank order ([sum of counts] elements, peer 0's first);
// this rank's own segment is copied locally. The counts must agree pairwise (p's send_counts[q]
// is q's recv_counts[p]: exchange_counts gives them) and may be 0; send and recv must not
// overlap. `dtype` F32, BF16 or F16: the elements are moved, never combined. Over MPI each
// buffer's total must fit in an int (MPI's counts and displacements).
Handle all_to_all_v_async(Comm& c, Group& g, const Context& ctx, const void* send,
                          const std::vector<int64_t>& send_counts, void* recv,
                          const std::vector<int64_t>& recv_counts, DType dtype);

void all_reduce(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, ReduceOp op);
void reduce_scatter(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, ReduceOp op);
void all_gather(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                int64_t count);
void broadcast(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int root);
void reduce(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
            ReduceOp op, int root);
void gather(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
            int root);
void scatter(Comm& c, Group& g, const Context& ctx, const float* send, float* recv, int64_t count,
             int root);
void send_recv(Comm& c, Group& g, const Context& ctx, const std::vector<P2P>& ops);
void send(Comm& c, Group& g, const Context& ctx, const float* buf, int64_t count, int peer);
void recv(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int peer);
void barrier(Comm& c, Group& g, const Context& ctx);
void all_to_all_v(Comm& c, Group& g, const Context& ctx, const void* send,
                  const std::vector<int64_t>& send_counts, void* recv,
                  const std::vector<int64_t>& recv_counts, DType dtype);
// The counts an all-to-all-v will receive: element p of the result is what group rank p sends
// to this rank (its send_counts[rank]). With several counts per peer (send_counts holds
// group-size blocks of c, e.g. one per expert a peer holds), block p of the result is rank p's
// block for this rank. A host-side all-to-all of int64s, waited for
// like every collective (past the group's timeout every rank stops, naming exchange_counts and
// the group); bookkeeping, not counted in the group's stats.
std::vector<int64_t> exchange_counts(Comm& c, Group& g, const std::vector<int64_t>& send_counts);

// Whether the bytes [a, a + a_bytes) and [b, b + b_bytes) share one; b may be null (no output).
// MPI forbids a collective's send and receive buffers to overlap: an in-place call (recv = send +
// rank * count, or the reverse) has its input copied first when this holds (mpi_input).
bool buffers_overlap(const void* a, int64_t a_bytes, const void* b, int64_t b_bytes);

// Any host-side MPI call on g (a report's rows gathered to rank 0, a checkpoint's tensors):
// `post` issues it nonblocking (MPI_Igather, MPI_Ireduce, ...) on the request it is given, and
// it is waited for like every collective: past the group's timeout every rank stops, the
// message naming `what` and the group.
void host_wait(Group& g, const char* what, int64_t bytes,
               const std::function<int(MPI_Request*)>& post);

// A report's rows: each rank's `n` values gathered to world rank 0, rank-major (world rank r's
// at r * n), bounded like every collective. In a simulated world only the rank this process
// stands for has a row (the others stay 0): row_gathered says which rows hold values.
std::vector<int64_t> gather_report(Comm& c, const int64_t* mine, int n, const char* what);
std::vector<double> gather_report(Comm& c, const double* mine, int n, const char* what);
inline bool row_gathered(const Comm& c, int world_rank) {
  return !c.grid.simulated || world_rank == c.grid.world_rank;
}

// Host-side scalars (losses, norms, flags): an all-reduce of doubles over MPI, waited for like
// every collective: past the group's timeout it stops every rank, naming itself and the group.
void all_reduce_host(Group& g, double* values, int count, ReduceOp op);
// Runs fn on every rank of g; when it throws UsageError on some ranks (a file only rank 0
// writes, say), every rank throws the lowest such rank's message, so no rank is left waiting
// for one that stopped. Bounded by the timeout like every collective. fn's own collectives must
// come before anything in it that can fail on one rank only. `what` names the wait in a timeout.
void agree_on_error(Group& g, const std::function<void()>& fn, const char* what = "agree_on_error");
// `text` as group rank `root` holds it, on every rank of g; bounded like every collective.
std::string broadcast_text(Group& g, const char* what, std::string text, int root);
// Gathers every rank's spans to rank 0 of g, which writes a Chrome trace JSON atomically
// (process = rank, thread = track; open it in Perfetto or chrome://tracing). Collective and
// bounded like the others. Throws UsageError naming --trace and the file when it cannot be written.
void trace_write(const Trace& trace, const std::string& path, Group& g);
