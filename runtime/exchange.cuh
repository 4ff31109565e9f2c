// exchange.cuh: point-to-point messages that go out with the next receive (picotron's
// send_forward_recv_backward, Megatron's batched p2p): what the pipeline's engine sends and
// receives between the ranks that hold neighbouring model chunks (pipeline_parallel.cu).
#pragma once
#include <deque>
#include <map>
#include <utility>
#include <vector>

#include "runtime/comm.cuh"

// On NCCL a send is queued and issued together with the receive the next op needs, as one
// grouped call: two neighbours that each send before they receive would otherwise each have a
// send at the head of their communication stream that the other's receive, queued behind its
// own send, never reaches. On MPI sends are nonblocking and only the receive is waited for (a
// large send completes only once the peer receives it, which it may do only after this rank's
// next op). Sends followed by no receive go out on their own; every send is waited for at the
// end (finish). A message a rank sends itself (two consecutive model chunks on one rank) is
// handed over in place: no message, and no buffer of its own. Messages between two ranks of a
// group, and those a rank hands itself, arrive in the order they were sent.
class Exchange {
 public:
  // `calls`: the group the grouped calls run on; every message's group holds the same ranks.
  Exchange(Comm& comm, Group& calls, const Context& ctx) : comm_(comm), calls_(calls), ctx_(ctx) {}
  void send(Group& g, int peer, const Tensor& t);
  // Receives a tensor of `spec` from peer of g (issuing the queued sends with it) and waits.
  Tensor receive(Group& g, int peer, const TensorSpec& spec, Mem category);
  // Several tensors (a pipeline stage's payload, the first one in `first`, the rest workspace).
  void send(Group& g, int peer, const std::vector<Tensor>& out);
  std::vector<Tensor> receive(Group& g, int peer, const std::vector<TensorSpec>& specs, Mem first);
  void flush();   // the queued sends go out on their own
  void finish();  // ... and every send is waited for

 private:
  Comm& comm_;
  Group& calls_;
  const Context& ctx_;
  std::vector<P2P> queued_;
  std::vector<Tensor> keep_;  // queued sends' buffers, alive until sent
  std::vector<std::pair<Handle, std::vector<Tensor>>> in_flight_;
  std::map<const Group*, std::deque<Tensor>> handed_;  // per group: sent to this rank itself
};
