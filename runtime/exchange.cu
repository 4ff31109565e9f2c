// exchange.cu: point-to-point messages that go out just before the next receive (exchange.cuh).
#include "runtime/exchange.cuh"

void Exchange::send(Group& g, int peer, const Tensor& t) {
  if (peer == g.rank) {
    handed_[&g].push_back(t);
    return;
  }
  queued_.push_back({true, t.ptr, t.numel(), peer, &g, t.dtype});
  keep_.push_back(t);
}

Tensor Exchange::receive(Group& g, int peer, const TensorSpec& spec, Mem category) {
  if (peer == g.rank) {  // as an op that receives nothing: the queued sends go on their own
    flush();
    std::deque<Tensor>& mine = handed_[&g];
    PICO_ASSERT(!mine.empty(), "a chunk's input asked for on its own rank before it was made");
    Tensor t = mine.front();
    mine.pop_front();
    return t;
  }
  Tensor t = empty(ctx_, spec.shape, category, spec.dtype);
  flush(comm_.backend == Backend::NCCL);
  send_recv_async(comm_, calls_, ctx_, {P2P{false, t.ptr, t.numel(), peer, &g, t.dtype}}).wait();
  // NCCL: the sends that went out before a receive give their buffers back once received (on
  // the meta device at once: its sends complete as they are issued); MPI's wait for the end.
  for (auto it = in_flight_.begin(); it != in_flight_.end();)
    it = it->freed_when_sent && it->handle.test() ? in_flight_.erase(it) : std::next(it);
  return t;
}

void Exchange::send(Group& g, int peer, const std::vector<Tensor>& out) {
  for (const Tensor& t : out) send(g, peer, t);
}

std::vector<Tensor> Exchange::receive(Group& g, int peer, const std::vector<TensorSpec>& specs,
                                      Mem first) {
  std::vector<Tensor> in;
  for (size_t i = 0; i < specs.size(); i++)
    in.push_back(receive(g, peer, specs[i], i == 0 ? first : Mem::Workspace));
  return in;
}

void Exchange::flush(bool freed_when_sent) {
  if (queued_.empty()) return;
  in_flight_.push_back({send_recv_async(comm_, calls_, ctx_, queued_), keep_, freed_when_sent});
  queued_.clear();
  keep_.clear();
}

void Exchange::finish() {
  flush();
  for (InFlight& sent : in_flight_) sent.handle.wait();
  in_flight_.clear();
}
