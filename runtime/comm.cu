// comm.cu: the process grid [dp][pp][cp][tp] and its collectives, over NCCL or MPI, with
// per-group byte counters. Playbook appendix A0 (the collectives and what each rank sends in a
// ring); DESIGN sections 3 and 4. The one idea: every parallel technique is a few collectives on
// a few groups of ranks, issued without blocking and waited for later, so communication runs
// beside computation: on CUDA on a second stream ordered by events, on CPU inside MPI's
// nonblocking calls. Here: each collective's bytes, its NCCL call and its MPI call. How the
// groups' communicators are made is in comm_setup.cu; how a collective in flight is ordered
// with the compute stream, staged through host memory and waited for, in comm_handle.cu.
// Guide: docs/collectives.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <climits>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/comm_internal.cuh"
#include "runtime/dtype.cuh"

const char* coll_name(Coll c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "reduce",     "gather",         "scatter",    "send_recv",
                                "barrier",    "all_to_all"};
  static_assert(sizeof names / sizeof names[0] == (size_t)Coll::Count, "a name per collective");
  return names[(int)c];
}
const char* backend_name(Backend b) {
  return b == Backend::MPI ? "mpi" : "nccl";
}

// ============================================================================
// The grid: world rank <-> coordinates, tp fastest (tensor-parallel peers share a node)
// ============================================================================

Grid make_grid(int dp, int pp, int cp, int tp, int world_size, int world_rank) {
  // (Called for every rank of a simulated world: the message is built only when needed.)
  auto flags = [&] {
    return "--dp " + std::to_string(dp) + " x --pp " + std::to_string(pp) + " x --cp " +
           std::to_string(cp) + " x --tp " + std::to_string(tp);
  };
  if (dp < 1 || pp < 1 || cp < 1 || tp < 1)
    throw UsageError(flags() + ": every parallel dimension must be at least 1");
  int64_t product = (int64_t)dp * pp * cp * tp;
  if (product != world_size)
    throw UsageError(flags() + " = " + std::to_string(product) + " ranks, but mpirun started " +
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
//   all_to_all       the segments it sends to the other ranks, sum over p != rank of
//                    send_counts[p]*4 (its own segment is copied locally); no ring: each
//                    segment goes straight to its destination, so these are the bytes sent
// (4 is an fp32 element's bytes: bf16 and fp16 all-reduces, reduce-scatters, all-gathers and
// all-to-alls count 2.) A group of one sends nothing: every formula is 0 for N = 1, and
// send_recv or all-to-all to oneself is a copy.
constexpr int64_t kF32 = sizeof(float);
static void count_call(Group& g, Coll coll, int64_t elements, int64_t bytes_sent) {
  mark_ledger_clock();  // the op before it has ended (--report roofline's measured time)
  g.stats[(int)coll].calls += 1;
  g.stats[(int)coll].elements += elements;
  g.stats[(int)coll].bytes += g.size > 1 ? bytes_sent : 0;
}

static void copy_bytes(Device device, cudaStream_t stream, void* dst, const void* src,
                       int64_t bytes) {
  if (dst == src || bytes == 0 || device == Device::Meta) return;  // meta: nothing to move
  if (device == Device::CPU)
    memmove(dst, src, bytes);
  else
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
}
static void copy_floats(Device device, cudaStream_t stream, float* dst, const float* src,
                        int64_t count) {
  copy_bytes(device, stream, dst, src, count * kF32);
}

// A collective on a group of one moves nothing between ranks: at most a copy, done at once.
// (Unless the group has an NCCL communicator of its own: --comm nccl runs it through NCCL.)
static bool local(const Group& g) {
  return g.size == 1 && !g.nccl;
}
static Handle local_copy(const Context& ctx, void* dst, const void* src, int64_t bytes) {
  copy_bytes(ctx.device, ctx.stream, dst, src, bytes);
  return Handle();
}

// ---- NCCL: ops run on the comm stream; MPI: nonblocking calls on host memory ----
// Each collective below counts its call, does a group of one locally, and otherwise runs between
// start() and issued() (comm_handle.cu): NCCL calls queued on the comm stream, or one MPI call
// on the host memory mpi_buffer() and mpi_input() give it (on CUDA, staged from the device).

static ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::Sum ? ncclSum : op == ReduceOp::Avg ? ncclAvg : ncclMax;
}
static MPI_Op mpi_op(ReduceOp op) {
  return op == ReduceOp::Max ? MPI_MAX : MPI_SUM;
}
// Called where an op is issued, outside the call mpi_post may defer: a count past int fails in
// the call that asked for it.
static int mpi_count(int64_t n) {
  PICO_ASSERT(n <= INT_MAX, "MPI counts are int: " + std::to_string(n) + " elements");
  return (int)n;
}
static void mpi_average(Handle::State& s, ReduceOp op, float* host_result, int64_t count) {
  if (op == ReduceOp::Avg) s.average_buf = host_result, s.average_count = count;
}

// ============================================================================
// Collectives: the bytes this rank sends, the NCCL call, the MPI call
// ============================================================================

// The wire types. F32 travels as MPI_FLOAT and ncclFloat. BF16 and F16 go to NCCL as
// ncclBfloat16 and ncclHalf; MPI has no 16-bit float type, so they travel as MPI_UINT16_T, the
// bits unchanged, and their sums and maxima are our own MPI operations on those bits: each
// pair widened to fp32, added (or compared), the result rounded back to the format, as NCCL's
// kernels do. Half the bytes of fp32 on the wire, for gradients and weights kept in bf16.
static void check_wire_dtype(DType t, ReduceOp op) {
  PICO_ASSERT(t == DType::F32 || t == DType::BF16 || t == DType::F16,
              std::string("collectives carry F32, BF16 or F16, not ") + dtype_name(t));
  PICO_ASSERT(t == DType::F32 || op != ReduceOp::Avg,
              "a 16-bit average would round twice: sum, then scale in fp32");
}
static ncclDataType_t nccl_type(DType t) {
  return t == DType::BF16 ? ncclBfloat16 : t == DType::F16 ? ncclHalf : ncclFloat;
}
static MPI_Datatype mpi_type(DType t) {
  return t == DType::F32 ? MPI_FLOAT : MPI_UINT16_T;
}
template <DType T, bool Max>
static void reduce_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = (const uint16_t*)in;
  uint16_t* b = (uint16_t*)inout;
  for (int i = 0; i < *len; i++) {
    float x = T == DType::BF16 ? bf16_to_float(a[i]) : fp16_to_float(a[i]);
    float y = T == DType::BF16 ? bf16_to_float(b[i]) : fp16_to_float(b[i]);
    float r = Max ? std::max(x, y) : x + y;
    b[i] = T == DType::BF16 ? float_to_bf16(r) : float_to_fp16(r);
  }
}
static MPI_Op mpi_op(ReduceOp op, DType t) {
  if (t == DType::F32) return mpi_op(op);
  static MPI_Op ops[2][2] = {{MPI_OP_NULL, MPI_OP_NULL}, {MPI_OP_NULL, MPI_OP_NULL}};
  const int f = t == DType::BF16 ? 0 : 1, m = op == ReduceOp::Max ? 1 : 0;
  if (ops[f][m] == MPI_OP_NULL) {
    MPI_User_function* fn =
        f == 0 ? (m ? reduce_16bit<DType::BF16, true> : reduce_16bit<DType::BF16, false>)
               : (m ? reduce_16bit<DType::F16, true> : reduce_16bit<DType::F16, false>);
    MPI_CHECK(MPI_Op_create(fn, 1, &ops[f][m]));
  }
  return ops[f][m];
}

Handle all_reduce_async(Comm& c, Group& g, const Context& ctx, void* buf, DType dtype,
                        int64_t count, ReduceOp op) {
  check_wire_dtype(dtype, op);
  const int64_t N = g.size, E = dtype_size(dtype), K = count * E;
  count_call(g, Coll::AllReduce, count, 2 * (N - 1) * K / N);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return Handle();                  // the sum, average or max of one buffer is itself
  auto s = start(c, g, ctx, Coll::AllReduce, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(
        *s, ncclAllReduce(buf, buf, count, nccl_type(dtype), nccl_op(op), g.nccl, stream_of(c, g)));
  } else {
    void* h = mpi_buffer(*s, ctx, buf, K, true, true);
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Iallreduce(MPI_IN_PLACE, h, n, mpi_type(dtype), mpi_op(op, dtype), comm, r);
    });
    mpi_average(*s, op, (float*)h, count);
  }
  return issued(c, s);
}

Handle reduce_scatter_async(Comm& c, Group& g, const Context& ctx, const void* send, void* recv,
                            DType dtype, int64_t count, ReduceOp op) {
  check_wire_dtype(dtype, op);
  const int64_t N = g.size, E = dtype_size(dtype), K = count * N * E;
  count_call(g, Coll::ReduceScatter, count * N, (N - 1) * K / N);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, count * E);
  auto s = start(c, g, ctx, Coll::ReduceScatter, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclReduceScatter(send, recv, count, nccl_type(dtype), nccl_op(op), g.nccl,
                                       stream_of(c, g)));
  } else {
    const void* hs = mpi_input(*s, ctx, send, K, recv, count * E);
    void* hr = mpi_buffer(*s, ctx, recv, count * E, false, true);
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Ireduce_scatter_block(hs, hr, n, mpi_type(dtype), mpi_op(op, dtype), comm, r);
    });
    mpi_average(*s, op, (float*)hr, count);
  }
  return issued(c, s);
}

Handle all_gather_async(Comm& c, Group& g, const Context& ctx, const void* send, void* recv,
                        DType dtype, int64_t count) {
  check_wire_dtype(dtype, ReduceOp::Sum);
  const int64_t N = g.size, E = dtype_size(dtype), K = count * N * E;
  count_call(g, Coll::AllGather, count, (N - 1) * K / N);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, count * E);
  auto s = start(c, g, ctx, Coll::AllGather, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclAllGather(send, recv, count, nccl_type(dtype), g.nccl, stream_of(c, g)));
  } else {
    const void* hs = mpi_input(*s, ctx, send, count * E, recv, K);
    void* hr = mpi_buffer(*s, ctx, recv, K, false, true);
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Iallgather(hs, n, mpi_type(dtype), hr, n, mpi_type(dtype), comm, r);
    });
  }
  return issued(c, s);
}

// The fp32 forms.
Handle all_reduce_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count,
                        ReduceOp op) {
  return all_reduce_async(c, g, ctx, buf, DType::F32, count, op);
}
Handle reduce_scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                            int64_t count, ReduceOp op) {
  return reduce_scatter_async(c, g, ctx, send, recv, DType::F32, count, op);
}
Handle all_gather_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                        int64_t count) {
  return all_gather_async(c, g, ctx, send, recv, DType::F32, count);
}

Handle broadcast_async(Comm& c, Group& g, const Context& ctx, float* buf, int64_t count, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "broadcast root " + std::to_string(root));
  int64_t N = g.size, K = count * kF32;
  bool is_root = g.rank == root, chain_end = g.rank == (root + N - 1) % N;
  count_call(g, Coll::Broadcast, count, chain_end ? 0 : K);  // the chain's end passes nothing on
  if (c.device == Device::Meta) return Handle();             // meta ranks exchange nothing, counted
  if (local(g)) return Handle();
  auto s = start(c, g, ctx, Coll::Broadcast, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(*s, ncclBroadcast(buf, buf, count, ncclFloat, root, g.nccl, stream_of(c, g)));
  } else {
    float* h = (float*)mpi_buffer(*s, ctx, buf, K, is_root, !is_root);
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Ibcast(h, n, MPI_FLOAT, root, comm, r);
    });
  }
  return issued(c, s);
}

Handle reduce_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                    int64_t count, ReduceOp op, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "reduce root " + std::to_string(root));
  int64_t K = count * kF32;
  bool is_root = g.rank == root;
  count_call(g, Coll::Reduce, count, is_root ? 0 : K);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, count * kF32);
  auto s = start(c, g, ctx, Coll::Reduce, K);
  if (c.backend == Backend::NCCL) {
    NCCL_ENQUEUE(
        *s, ncclReduce(send, recv, count, ncclFloat, nccl_op(op), root, g.nccl, stream_of(c, g)));
  } else {
    const void* hs = mpi_input(*s, ctx, send, K, is_root ? recv : nullptr, K);
    float* hr = is_root ? (float*)mpi_buffer(*s, ctx, recv, K, false, true) : nullptr;
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Ireduce(hs, hr, n, MPI_FLOAT, mpi_op(op), root, comm, r);
    });
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
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, count * kF32);
  auto s = start(c, g, ctx, Coll::Gather, K);
  if (c.backend == Backend::NCCL) {
    cudaStream_t st = stream_of(c, g);
    if (is_root) copy_floats(Device::CUDA, st, recv + root * count, send, count);
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < N; r++)
      if (is_root && r != root)
        NCCL_ENQUEUE(*s, ncclRecv(recv + r * count, count, ncclFloat, r, g.nccl, st));
    if (!is_root) NCCL_ENQUEUE(*s, ncclSend(send, count, ncclFloat, root, g.nccl, st));
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    const void* hs = mpi_input(*s, ctx, send, count * kF32, is_root ? recv : nullptr, K);
    void* hr = is_root ? mpi_buffer(*s, ctx, recv, K, false, true) : nullptr;
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Igather(hs, n, MPI_FLOAT, hr, n, MPI_FLOAT, root, comm, r);
    });
  }
  return issued(c, s);
}

Handle scatter_async(Comm& c, Group& g, const Context& ctx, const float* send, float* recv,
                     int64_t count, int root) {
  PICO_ASSERT(root >= 0 && root < g.size, "scatter root " + std::to_string(root));
  int64_t N = g.size, K = count * N * kF32;
  bool is_root = g.rank == root;
  count_call(g, Coll::Scatter, count, is_root ? (N - 1) * count * kF32 : 0);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, count * kF32);
  auto s = start(c, g, ctx, Coll::Scatter, K);
  if (c.backend == Backend::NCCL) {
    cudaStream_t st = stream_of(c, g);
    if (is_root) copy_floats(Device::CUDA, st, recv, send + root * count, count);
    NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < N; r++)
      if (is_root && r != root)
        NCCL_ENQUEUE(*s, ncclSend(send + r * count, count, ncclFloat, r, g.nccl, st));
    if (!is_root) NCCL_ENQUEUE(*s, ncclRecv(recv, count, ncclFloat, root, g.nccl, st));
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    const void* hs = is_root ? mpi_input(*s, ctx, send, K, recv, count * kF32) : nullptr;
    void* hr = mpi_buffer(*s, ctx, recv, count * kF32, false, true);
    const int n = mpi_count(count);
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Iscatter(hs, n, MPI_FLOAT, hr, n, MPI_FLOAT, root, comm, r);
    });
  }
  return issued(c, s);
}

Handle send_recv_async(Comm& c, Group& g, const Context& ctx, const std::vector<P2P>& ops) {
  int64_t sent = 0, total = 0, elements = 0;
  Group* other = nullptr;  // the one other group of the same ranks some ops travel on
  int64_t sent_other = 0, elements_other = 0;
  for (const P2P& op : ops) {
    Group& og = op.group ? *op.group : g;
    PICO_ASSERT(op.peer >= 0 && op.peer < og.size && og.size == g.size &&
                    (&og == &g || !other || &og == other),
                "send_recv peer " + std::to_string(op.peer) + " in " + og.name);
    check_wire_dtype(op.dtype, ReduceOp::Sum);
    if (&og != &g) other = &og;
    const int64_t bytes = op.count * (int64_t)dtype_size(op.dtype);
    total += bytes;
    if (op.send) (&og == &g ? sent : sent_other) += bytes;
    if (op.send) (&og == &g ? elements : elements_other) += op.count;
  }
  // Each message's elements and bytes on the group it travels on.
  count_call(g, Coll::SendRecv, elements, sent);
  if (other) count_call(*other, Coll::SendRecv, elements_other, sent_other);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) {  // messages to oneself: the k-th send lands in the k-th receive, as in MPI
    std::vector<const P2P*> sends, recvs;
    for (const P2P& op : ops) (op.send ? sends : recvs).push_back(&op);
    PICO_ASSERT(sends.size() == recvs.size(), "send_recv to oneself needs a receive per send");
    for (size_t k = 0; k < sends.size(); k++) {
      PICO_ASSERT(sends[k]->count == recvs[k]->count && sends[k]->dtype == recvs[k]->dtype,
                  "send_recv to oneself: counts or formats differ");
      copy_bytes(ctx.device, ctx.stream, recvs[k]->buf, sends[k]->buf,
                 sends[k]->count * (int64_t)dtype_size(sends[k]->dtype));
    }
    return Handle();
  }
  auto s = start(c, g, ctx, Coll::SendRecv, total);
  s->lockstep = false;  // a peer (a pipeline's neighbour, a ring's) may still compute what it sends
  if (c.backend == Backend::NCCL) {
    // A pipeline's messages travel on their group's links (Group::links), each on the stream of
    // its direction and neighbour: a send there, which waits until its peer receives, holds up
    // nothing else. Other messages (a ring's exchange with both neighbours) go on the group's
    // communicator, in one NCCL group, where none of them holds up another. Every other stream
    // starts once the data is ready, as the group's does (start), and marks its own end
    // (`other_ends`). A grouped call on nonblocking communicators: ncclGroupEnd may answer
    // ncclInProgress, and then every communicator of the call must be waited for (settle).
    struct Route {
      ncclComm_t nccl;
      cudaStream_t stream;
      int peer;  // on a link, its other rank: the receiver 1, the sender 0
    };
    std::vector<Route> route(ops.size());
    std::vector<cudaStream_t> others;
    for (size_t i = 0; i < ops.size(); i++) {
      const P2P& op = ops[i];
      Group& og = op.group ? *op.group : g;
      const int from = op.send ? og.rank : op.peer, to = op.send ? op.peer : og.rank;
      route[i] = {og.nccl, stream_of(c, og), op.peer};
      for (const Group::Link& link : og.links)
        if (link.from == from && link.to == to)
          route[i] = {link.nccl, link.stream, op.send ? 1 : 0};
      PICO_ASSERT(og.links.empty() || route[i].stream != stream_of(c, og),
                  "a message on " + og.name + " from rank " + std::to_string(from) + " to " +
                      std::to_string(to) + " has no link (comm_init's pipeline pairs)");
      const Route& r = route[i];
      if (std::find(s->nccl.begin(), s->nccl.end(), r.nccl) == s->nccl.end())
        s->nccl.push_back(r.nccl);
      if (r.stream != stream_of(c, g) &&
          std::find(others.begin(), others.end(), r.stream) == others.end()) {
        others.push_back(r.stream);
        stream_waits_for(r.stream, ctx.stream);
      }
    }
    // One NCCL group per communicator: a group over several streams would join them (NCCL
    // starts it after all of them and holds them all until it ends), and tie a send to the rest.
    std::vector<bool> issued(ops.size(), false);
    for (size_t i = 0; i < ops.size(); i++) {
      if (issued[i]) continue;
      NCCL_CHECK(ncclGroupStart());
      for (size_t j = i; j < ops.size(); j++) {
        const P2P& op = ops[j];
        const Route& r = route[j];
        if (issued[j] || r.nccl != route[i].nccl) continue;
        issued[j] = true;
        if (op.send)
          NCCL_ENQUEUE(*s,
                       ncclSend(op.buf, op.count, nccl_type(op.dtype), r.peer, r.nccl, r.stream));
        else
          NCCL_ENQUEUE(*s,
                       ncclRecv(op.buf, op.count, nccl_type(op.dtype), r.peer, r.nccl, r.stream));
      }
      NCCL_ENQUEUE(*s, ncclGroupEnd());
      s->settle();  // this communicator's ops on its stream before the next call
    }
    for (cudaStream_t st : others) {
      s->other_ends.push_back(nullptr);
      CUDA_CHECK(cudaEventCreateWithFlags(&s->other_ends.back(), cudaEventDisableTiming));
      CUDA_CHECK(cudaEventRecord(s->other_ends.back(), st));
    }
  } else {
    const int kTag = 0;  // MPI keeps the messages between two ranks in order: one tag is enough
    for (const P2P& op : ops) {
      void* h =
          mpi_buffer(*s, ctx, op.buf, op.count * (int64_t)dtype_size(op.dtype), op.send, !op.send);
      int n = mpi_count(op.count);
      MPI_Comm mc = op.group ? op.group->mpi : g.mpi;
      if (op.send)
        MPI_CHECK(MPI_Isend(h, n, mpi_type(op.dtype), op.peer, kTag, mc, s->request()));
      else
        MPI_CHECK(MPI_Irecv(h, n, mpi_type(op.dtype), op.peer, kTag, mc, s->request()));
    }
  }
  return issued(c, s);
}

Handle barrier_async(Comm& c, Group& g, const Context& ctx) {
  count_call(g, Coll::Barrier, 0, 0);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return Handle();
  auto s = start(c, g, ctx, Coll::Barrier, 0);
  if (c.backend == Backend::NCCL) {
    // NCCL has no barrier: an all-reduce of one float completes only once every rank has joined.
    // The float is the group's own, allocated with its stream (comm_init) and used only on
    // that stream, in order.
    cudaStream_t st = stream_of(c, g);
    CUDA_CHECK(cudaMemsetAsync(g.barrier_word, 0, sizeof(float), st));
    NCCL_ENQUEUE(*s,
                 ncclAllReduce(g.barrier_word, g.barrier_word, 1, ncclFloat, ncclSum, g.nccl, st));
  } else {
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) { return MPI_Ibarrier(comm, r); });
  }
  return issued(c, s);
}

// ---- all-to-all with variable counts: expert parallelism's dispatch and combine ----

// Where each peer's segment starts in a rank-major buffer: offsets[p] = counts[0] + ... +
// counts[p-1]; offsets[N] is the buffer's length. Counts are checked: one per rank, none negative.
static std::vector<int64_t> segment_offsets(const Group& g, const std::vector<int64_t>& counts,
                                            const char* which) {
  PICO_ASSERT((int)counts.size() == g.size, std::string("all_to_all_v on ") + g.name + ": " +
                                                which + " has " + std::to_string(counts.size()) +
                                                " entries for " + std::to_string(g.size) +
                                                " ranks");
  std::vector<int64_t> offsets(g.size + 1, 0);
  for (int p = 0; p < g.size; p++) {
    PICO_ASSERT(counts[p] >= 0, std::string("all_to_all_v: ") + which + "[" + std::to_string(p) +
                                    "] = " + std::to_string(counts[p]));
    offsets[p + 1] = offsets[p] + counts[p];
  }
  return offsets;
}

// Every rank sends a segment to every other and receives one from each, all at once: on NCCL
// one group of sends and receives (nothing waits for another, so no order can deadlock), on MPI
// one MPI_Ialltoallv. Zero-length segments are skipped on both sides (the counts agree).
Handle all_to_all_v_async(Comm& c, Group& g, const Context& ctx, const void* send,
                          const std::vector<int64_t>& send_counts, void* recv,
                          const std::vector<int64_t>& recv_counts, DType dtype) {
  check_wire_dtype(dtype, ReduceOp::Sum);
  const int N = g.size, me = g.rank;
  const int64_t E = dtype_size(dtype);
  const std::vector<int64_t> send_at = segment_offsets(g, send_counts, "send_counts");
  const std::vector<int64_t> recv_at = segment_offsets(g, recv_counts, "recv_counts");
  const int64_t send_total = send_at[N], recv_total = recv_at[N];  // elements
  PICO_ASSERT(send_counts[me] == recv_counts[me],
              "all_to_all_v: rank " + std::to_string(me) + " of " + g.name + " sends itself " +
                  std::to_string(send_counts[me]) + " elements but expects " +
                  std::to_string(recv_counts[me]));
  const char* s8 = (const char*)send;
  char* r8 = (char*)recv;
  PICO_ASSERT(
      send_total == 0 || recv_total == 0 || s8 + send_total * E <= r8 || r8 + recv_total * E <= s8,
      "all_to_all_v: the send and receive buffers overlap");
  count_call(g, Coll::AllToAll, send_total, (send_total - send_counts[me]) * E);
  if (c.device == Device::Meta) return Handle();  // meta ranks exchange nothing, counted
  if (local(g)) return local_copy(ctx, recv, send, send_total * E);
  auto s = start(c, g, ctx, Coll::AllToAll, send_total * E);
  if (c.backend == Backend::NCCL) {
    cudaStream_t st = stream_of(c, g);
    copy_bytes(Device::CUDA, st, r8 + recv_at[me] * E, s8 + send_at[me] * E, send_counts[me] * E);
    NCCL_CHECK(ncclGroupStart());
    for (int p = 0; p < N; p++) {
      if (p == me) continue;
      if (send_counts[p] > 0)
        NCCL_ENQUEUE(
            *s, ncclSend(s8 + send_at[p] * E, send_counts[p], nccl_type(dtype), p, g.nccl, st));
      if (recv_counts[p] > 0)
        NCCL_ENQUEUE(
            *s, ncclRecv(r8 + recv_at[p] * E, recv_counts[p], nccl_type(dtype), p, g.nccl, st));
    }
    NCCL_ENQUEUE(*s, ncclGroupEnd());
  } else {
    // MPI's counts and displacements are ints, read until the op completes: kept in its state.
    (void)mpi_count(send_total);  // then every count and displacement fits too
    (void)mpi_count(recv_total);
    std::vector<int>& a = s->mpi_counts;
    a.resize(4 * N);
    int *sc = a.data(), *sd = sc + N, *rc = sd + N, *rd = rc + N;
    for (int p = 0; p < N; p++)
      sc[p] = (int)send_counts[p], sd[p] = (int)send_at[p], rc[p] = (int)recv_counts[p],
      rd[p] = (int)recv_at[p];
    const void* hs = send_total ? mpi_buffer(*s, ctx, send, send_total * E, true, false) : nullptr;
    void* hr = recv_total ? mpi_buffer(*s, ctx, recv, recv_total * E, false, true) : nullptr;
    mpi_post(s, [=, comm = g.mpi](MPI_Request* r) {
      return MPI_Ialltoallv(hs, sc, sd, mpi_type(dtype), hr, rc, rd, mpi_type(dtype), comm, r);
    });
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
void all_to_all_v(Comm& c, Group& g, const Context& ctx, const void* send,
                  const std::vector<int64_t>& send_counts, void* recv,
                  const std::vector<int64_t>& recv_counts, DType dtype) {
  all_to_all_v_async(c, g, ctx, send, send_counts, recv, recv_counts, dtype).wait();
}

// ---- host-side collectives: bookkeeping, not training traffic (never counted) ----

// Posts one MPI call on host memory and waits for it through a Handle, so the same deadline
// and the same message ("all_reduce_host on dp_cp, 8 B did not finish within ...") apply.
void host_wait(Group& g, const char* what, int64_t bytes,
               const std::function<int(MPI_Request*)>& post) {
  auto s = new_state(g, what, bytes);
  mpi_post(s, post);
  Handle(s).wait();
}
// host_wait, except on a group of one, or of a simulated world, which have nothing to exchange.
static void host_collective(Group& g, const char* op, int64_t bytes,
                            const std::function<int(MPI_Request*)>& post) {
  if (g.size > 1 && !g.simulated) host_wait(g, op, bytes, post);
}

template <class T>
static std::vector<T> gather_rows(Comm& c, const T* mine, int n, const char* what,
                                  MPI_Datatype type) {
  std::vector<T> all((size_t)c.grid.world_size * n, T(0));
  if (c.world.simulated || c.world.size == 1) {
    std::copy(mine, mine + n, all.begin() + (size_t)c.grid.world_rank * n);
    return all;
  }
  host_wait(c.world, what, (int64_t)n * sizeof(T), [&](MPI_Request* r) {
    return MPI_Igather(mine, n, type, all.data(), n, type, 0, c.world.mpi, r);
  });
  return all;
}
std::vector<int64_t> gather_report(Comm& c, const int64_t* mine, int n, const char* what) {
  return gather_rows(c, mine, n, what, MPI_INT64_T);
}
std::vector<double> gather_report(Comm& c, const double* mine, int n, const char* what) {
  return gather_rows(c, mine, n, what, MPI_DOUBLE);
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

void TrafficMeter::open(const Group& g) {
  std::copy(g.stats, g.stats + (int)Coll::Count, opened);
}
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

// `per` int64s to each peer and `per` from each: the transpose of the group's matrix of counts.
std::vector<int64_t> exchange_counts(Comm& c, Group& g, const std::vector<int64_t>& send_counts) {
  PICO_ASSERT(!send_counts.empty() && (int)send_counts.size() % g.size == 0,
              "exchange_counts on " + g.name + ": " + std::to_string(send_counts.size()) +
                  " counts for " + std::to_string(g.size) + " ranks");
  const int per = (int)send_counts.size() / g.size;
  for (int64_t n : send_counts)
    PICO_ASSERT(n >= 0, "exchange_counts: a negative count, " + std::to_string(n));
  std::vector<int64_t> recv_counts = send_counts;  // a group of one receives its own
  if (c.device == Device::Meta) {
    // Meta ranks exchange nothing: every rank is taken to send what this one sends itself (as
    // under the uniform routing the meta device assumes, expert_parallel.cu).
    for (int p = 0; p < g.size; p++)
      std::copy(send_counts.begin() + g.rank * per, send_counts.begin() + (g.rank + 1) * per,
                recv_counts.begin() + p * per);
    return recv_counts;
  }
  host_collective(g, "exchange_counts", (int64_t)send_counts.size() * sizeof(int64_t),
                  [&](MPI_Request* r) {
                    return MPI_Ialltoall(send_counts.data(), per, MPI_INT64_T, recv_counts.data(),
                                         per, MPI_INT64_T, g.mpi, r);
                  });
  return recv_counts;
}

std::string broadcast_text(Group& g, const char* what, std::string text, int root) {
  int length = (int)text.size();
  host_collective(g, what, sizeof length,
                  [&](MPI_Request* r) { return MPI_Ibcast(&length, 1, MPI_INT, root, g.mpi, r); });
  text.resize(length);
  host_collective(g, what, length, [&](MPI_Request* r) {
    return MPI_Ibcast(text.data(), length, MPI_CHAR, root, g.mpi, r);
  });
  return text;
}

void agree_on_error(Group& g, const std::function<void()>& fn, const char* what) {
  std::string message;
  try {
    fn();
  } catch (const UsageError& e) {
    message = e.what();
  }
  // The lowest group rank with an error, as a max of -rank (-size: none).
  double first = message.empty() ? -g.size : -g.rank;
  all_reduce_doubles(g, what, &first, 1, ReduceOp::Max);
  int root = (int)-first;
  if (root == g.size) return;
  throw UsageError(broadcast_text(g, what, message, root));
}

void trace_write(const Trace& trace, const std::string& path, Group& g) {
  double t0 = -1e300;  // the earliest span of any rank is time 0: a max of negated starts
  for (const Trace::Span& s : trace.spans) t0 = std::max(t0, -s.start);
  all_reduce_doubles(g, "trace_write", &t0, 1, ReduceOp::Max);
  t0 = -t0;
  // Chrome trace "complete" events: ph X, ts and dur in microseconds, pid = rank, tid = track.
  std::string mine;
  for (const Trace::Span& s : trace.spans) {
    nlohmann::json event{{"name", s.name},
                         {"ph", "X"},
                         {"pid", g.rank},
                         {"tid", (int)s.track},
                         {"ts", (s.start - t0) * 1e6},
                         {"dur", (s.end - s.start) * 1e6}};
    if (!s.color.empty()) event["cname"] = s.color;
    mine += event.dump() + "\n";
  }
  int length = (int)mine.size();
  std::vector<int> lengths(g.size, length), offsets(g.size, 0);
  host_collective(g, "trace_write", sizeof length, [&](MPI_Request* r) {
    return MPI_Igather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, g.mpi, r);
  });
  for (int r = 1; r < g.size; r++) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string all =
      g.rank == 0 ? std::string(offsets[g.size - 1] + lengths[g.size - 1], '\0') : std::string();
  if (g.size == 1) all = mine;
  host_collective(g, "trace_write", length, [&](MPI_Request* r) {
    return MPI_Igatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                        MPI_CHAR, 0, g.mpi, r);
  });
  if (g.rank != 0) return;
  nlohmann::json events = nlohmann::json::array();
  for (int r = 0; r < g.size; r++) {
    events.push_back({{"name", "process_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"args", {{"name", "rank " + std::to_string(r)}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 0},
                      {"args", {{"name", "compute"}}}});
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", r},
                      {"tid", 1},
                      {"args", {{"name", "communication"}}}});
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
