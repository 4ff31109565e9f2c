// exchange.cuh: point-to-point messages between the ranks that hold neighbouring model chunks,
// what the pipeline's engine sends and receives (pipeline_parallel.cu).
#pragma once
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "runtime/comm.cuh"

// A send is queued and goes out, without a wait, just before the next receive; only receives
// are waited for. On MPI sends are nonblocking. On NCCL a send holds its stream until the peer
// receives it, so each travels on a link of its own (Group::links, a communicator and a stream
// per direction and neighbour), where it holds up no receive: grouped with the receive, or on a
// stream the receive queues on, two neighbours that each send before they receive could each
// wait for the other's receive (the V's two directions, the interleaved schedule's last stage to
// its first). A send's buffer is kept until it is received: on NCCL given back at the first
// receive that finds it done (which the meta device, where every send is done at once, takes as
// the next receive), on MPI at the end (finish), where every send is waited for. Sends followed
// by no receive go out on their own and are kept to the end. A message a rank sends itself (two
// consecutive model chunks on one rank) is handed over in place: no message, and no buffer of its
// own. Messages between two ranks of a group, and those a rank hands itself, arrive in the order
// they were sent.
class Exchange {
 public:
  // `calls`: the group the grouped calls run on; every message's group holds the same ranks.
  Exchange(Comm& comm, Group& calls, const Context& ctx) : comm_(comm), calls_(calls), ctx_(ctx) {}
  void send(Group& g, int peer, const Tensor& t);
  // Receives a tensor of `spec` from peer of g (the queued sends issued first) and waits.
  Tensor receive(Group& g, int peer, const TensorSpec& spec, Mem category);
  // Several tensors (a pipeline stage's payload, the first one in `first`, the rest workspace).
  void send(Group& g, int peer, const std::vector<Tensor>& out);
  std::vector<Tensor> receive(Group& g, int peer, const std::vector<TensorSpec>& specs, Mem first);
  // The queued sends go out on their own (kept to the end, or, `freed_when_sent`, given back on
  // NCCL at the first receive that finds them done).
  void flush(bool freed_when_sent = false);
  void finish();  // ... and every send is waited for

 private:
  Comm& comm_;
  Group& calls_;
  const Context& ctx_;
  std::vector<P2P> queued_;
  std::vector<Tensor> keep_;  // queued sends' buffers, alive until sent
  struct InFlight {
    Handle handle;
    std::vector<Tensor> buffers;
    bool freed_when_sent;
  };
  std::vector<InFlight> in_flight_;
  std::map<const Group*, std::deque<Tensor>> handed_;  // per group: sent to this rank itself
};
