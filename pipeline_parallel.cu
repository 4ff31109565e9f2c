// pipeline_parallel.cu: pipeline parallelism (Playbook §8; picotron's pipeline_parallel.py,
// Megatron's schedules). Consecutive blocks live on consecutive ranks; a micro-batch's hidden
// state [n, D] travels forward through them and its gradient travels back.
// The one idea: a stage idles until the first micro-batch reaches it and after the last one
// leaves, (p-1) forward-backward times per step whatever the order; more micro-batches (m) or
// more, smaller chunks per rank (V) shrink that bubble to (p-1)/m, then (p-1)/(Vm), of the work,
// and 1F1B bounds the activations a stage holds at p micro-batches where AFAB holds m.
//
// Each schedule is a row of kSchedules: a table, a list of (forward or backward, micro-batch,
// chunk) per rank, made by pipeline_schedule, and a placement, which model chunk each rank's
// chunks are. One engine runs the tables (run_schedule, which also runs gradient accumulation:
// the one-stage table); simulate_pipeline runs the tables of every rank against each other on
// paper (planner/pipeline_timing.cu), which is how the tests, --report bubble and the planner
// read them.
// Guide: docs/pipeline-parallel.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <cmath>
#include <deque>
#include <map>

#include "pipeline_parallel.cuh"
#include "runtime/options.cuh"

// ----------------------------------------------------------------------------
// Schedules as tables (Playbook §8.3-§8.6). A schedule is a row: its table, its placement and
// the book's idle fraction; what the engine and the paper run need (whether the backward
// splits into B and W) is read off the table. A new schedule is a function and a row.

namespace {
using Table = std::vector<PipelineOp>;

// §8.3 GPipe: every forward, then every backward.
Table afab(int, int, int m, int) {
  Table ops;
  for (int i = 0; i < m; i++) ops.push_back({Phase::Forward, i, 0});
  for (int i = 0; i < m; i++) ops.push_back({Phase::Backward, i, 0});
  return ops;
}

// §8.4: warm-up forwards, then one forward, one backward, then the remaining backwards.
// ZB-H1 (§8.6) runs the same F and B, B being the input gradient only; rank r runs micro-batch
// j's weight gradient W after the B of micro-batch j + r, and the last r at the end: the W's
// fill the idle ticks the shorter B chain leaves, while no rank holds more than p micro-batches
// (1F1B's first stage), and every rank idles (p-1)(t_f + t_b - t_w).
Table one_f_one_b(int p, int rank, int m, bool zero_bubble) {
  Table ops;
  int warmup = std::min(p - rank - 1, m), weights = 0;
  auto backward = [&](int i) {
    ops.push_back({Phase::Backward, i, 0});
    for (; zero_bubble && weights <= i - rank; weights++)
      ops.push_back({Phase::Weight, weights, 0});
  };
  for (int i = 0; i < warmup; i++) ops.push_back({Phase::Forward, i, 0});
  for (int i = 0; i < m - warmup; i++) {
    ops.push_back({Phase::Forward, warmup + i, 0});
    backward(i);
  }
  for (int i = m - warmup; i < m; i++) backward(i);
  for (; zero_bubble && weights < m; weights++) ops.push_back({Phase::Weight, weights, 0});
  return ops;
}

// §8.5 interleaved (Megatron): micro-batches in groups of p; each group goes through chunk 0,
// then chunk 1, ... (virtual step k: chunk (k / p) mod V of micro-batch (k / pV) p + k mod p),
// backwards in the reverse chunk order. The warm-up fills the loop of all p x V chunks.
Table interleaved(int p, int rank, int m, int V) {
  Table ops;
  int total = m * V;
  auto micro = [&](int k) { return k / (p * V) * p + k % p; };
  auto fwd_chunk = [&](int k) { return k / p % V; };
  auto F = [&](int k) { ops.push_back({Phase::Forward, micro(k), fwd_chunk(k)}); };
  auto B = [&](int k) { ops.push_back({Phase::Backward, micro(k), V - 1 - fwd_chunk(k)}); };
  int warmup = m == p ? total : std::min(total, (p - rank - 1) * 2 + (V - 1) * p);
  for (int k = 0; k < warmup; k++) F(k);
  for (int k = 0; k < total - warmup; k++) {
    F(warmup + k);
    B(k);
  }
  for (int k = total - warmup; k < total; k++) B(k);
  return ops;
}

// A placement: which model chunk rank `rank`'s chunk `local` (0 .. V-1) is. §8.5, Megatron's
// loop: the model goes round the ranks V times, rank r holding r, r + p, r + 2p, ...
int loop_placement(int p, int rank, int local) {
  return local * p + rank;
}

struct ScheduleRow {
  PpSchedule id;
  const char* name;  // --pp-schedule
  Table (*table)(int p, int rank, int m, int V);
  int (*placement)(int p, int rank, int local);
  bool chunks;  // runs V >= 2 model chunks per rank
  bool groups;  // runs micro-batches in groups of p (m a multiple of p)
  // The book's idle fraction of a step (the bubble as a share of the step, not of the work).
  double (*bubble)(int p, int m, int V);
};
const ScheduleRow kSchedules[] = {
    {PpSchedule::AFAB, "afab", afab, loop_placement, false, false,
     [](int p, int m, int) { return (p - 1) / (m + p - 1.0); }},
    {PpSchedule::OneFOneB, "1f1b",
     [](int p, int rank, int m, int) { return one_f_one_b(p, rank, m, false); }, loop_placement,
     false, false, [](int p, int m, int) { return (p - 1) / (m + p - 1.0); }},
    {PpSchedule::Interleaved, "interleaved", interleaved, loop_placement, true, true,
     [](int p, int m, int V) { return (p - 1) / ((double)V * m + p - 1); }},
    // t_f = t_b = t_w: the idle (p-1)(t_f + t_b - t_w) of a step of 3m + p - 1 ticks.
    {PpSchedule::ZeroBubbleH1, "zb-h1",
     [](int p, int rank, int m, int) { return one_f_one_b(p, rank, m, true); }, loop_placement,
     false, false, [](int p, int m, int) { return (p - 1) / (3.0 * m + p - 1); }},
};
const ScheduleRow& row(PpSchedule s) {
  for (const ScheduleRow& r : kSchedules)
    if (r.id == s) return r;
  PICO_ASSERT(false, "a pipeline schedule without a row in kSchedules");
  return kSchedules[0];
}
}  // namespace

PpSchedule parse_pp_schedule(const std::string& flag) {
  std::string names;
  for (const ScheduleRow& r : kSchedules) {
    if (flag == r.name) return r.id;
    names += std::string(names.empty() ? "" : ", ") + r.name;
  }
  throw UsageError("--pp-schedule " + flag + ": expected one of " + names);
}
const char* pp_schedule_name(PpSchedule s) {
  return row(s).name;
}

std::vector<PipelineOp> pipeline_schedule(PpSchedule s, int p, int rank, int m, int V) {
  return row(s).table(p, rank, m, V);
}
bool splits_backward(const std::vector<PipelineOp>& table) {
  return std::any_of(table.begin(), table.end(),
                     [](const PipelineOp& op) { return op.kind == Phase::Weight; });
}
double bubble_fraction(PpSchedule s, int p, int m, int V) {
  return row(s).bubble(p, m, V);
}

// ----------------------------------------------------------------------------
// Placement and partition (Playbook §8.1, §8.5)

StagePlacement stage_placement(PpSchedule s, int p, int V) {
  StagePlacement at;
  at.chunks.assign(p, std::vector<int>(V));
  at.rank.assign(p * V, -1);
  for (int r = 0; r < p; r++)
    for (int c = 0; c < V; c++) {
      const int g = row(s).placement(p, r, c);
      PICO_ASSERT(g >= 0 && g < p * V && at.rank[g] < 0 && (c == 0 || g > at.chunks[r][c - 1]),
                  "a placement must give each model chunk to one rank, a rank's in order");
      at.chunks[r][c] = g;
      at.rank[g] = r;
    }
  return at;
}

std::vector<Stage> pipeline_chunks(int layers, int p, int V, int rank, PpSchedule s) {
  const int chunks = p * V;
  auto first_block = [&](int g) { return g * (layers / chunks) + std::min(g, layers % chunks); };
  const StagePlacement at = stage_placement(s, p, V);
  std::vector<Stage> mine;
  for (int g : at.chunks[rank])
    mine.push_back(Stage{first_block(g), first_block(g + 1), g == 0, g == chunks - 1});
  return mine;
}

// ----------------------------------------------------------------------------
// Flags

void add_pipeline_flags(CLI::App& app, PipelineOptions& o) {
  std::string names;
  for (const ScheduleRow& r : kSchedules) names += std::string(names.empty() ? "" : "|") + r.name;
  CLI::App& g = flag_group(app, "Pipeline parallelism (Playbook §8)");
  g.add_option("--pp", o.pp, "pipeline-parallel stages, >= 1")->capture_default_str();
  add_typed(g, "--pp-schedule", &o.pp_schedule, parse_pp_schedule, pp_schedule_name(o.pp_schedule),
            "pipeline schedule: " + names);
  g.add_option("--pp-virtual", o.pp_virtual, "model chunks per pipeline rank (interleaved), >= 1")
      ->capture_default_str();
}

void validate_pipeline(int layers, int p, int V, int m, PpSchedule s, bool tied, int zero_stage) {
  check_positive(p, "--pp");
  std::string pp = "--pp " + std::to_string(p), name = pp_schedule_name(s);
  const bool chunks = row(s).chunks;
  if (V < 1) throw UsageError("--pp-virtual " + std::to_string(V) + ": must be >= 1");
  if (chunks && V < 2)
    throw UsageError("--pp-schedule " + name +
                     " needs --pp-virtual 2 or more model chunks per rank (with one chunk it is "
                     "1f1b)");
  if (!chunks && V > 1) {
    std::string chunked;
    for (const ScheduleRow& r : kSchedules)
      if (r.chunks) chunked += std::string(chunked.empty() ? "" : " or ") + r.name;
    throw UsageError("--pp-virtual " + std::to_string(V) + " needs --pp-schedule " + chunked);
  }
  if (layers < p * V)
    throw UsageError(pp + " x --pp-virtual " + std::to_string(V) + " = " + std::to_string(p * V) +
                     " chunks but --layers " + std::to_string(layers) +
                     ": every chunk needs a block; lower --pp or --pp-virtual");
  if (p == 1) return;
  if (row(s).groups && m % p)
    throw UsageError("--pp-schedule " + name +
                     " runs micro-batches in groups of --pp: --grad-acc " + std::to_string(m) +
                     " must be a multiple of " + pp);
  if (tied)
    throw UsageError("--tie-embeddings with " + pp +
                     ": the embedding lives on the first stage and the head on the last; tied "
                     "weights across stages are not supported, drop --tie-embeddings (or, for a "
                     "preset that ties them, add --untie-embeddings)");
  if (zero_stage == 2 && splits_backward(pipeline_schedule(s, p, 0, m, V)))
    throw UsageError("--zero 2 with --pp-schedule " + name +
                     ": ZeRO-2 reduce-scatters each micro-batch's gradient as soon as it is "
                     "final, while " +
                     name +
                     " still adds earlier micro-batches' deferred "
                     "weight gradients; use --zero 1");
  if (zero_stage == 3)
    throw UsageError("--zero 3 with " + pp +
                     ": ZeRO-3 would gather every unit's weights again for each micro-batch in "
                     "flight, which pipelining multiplies (Playbook §10.2: ZeRO-3 and PP are "
                     "alternatives); use --zero 1 or 2 with --pp");
}

// ----------------------------------------------------------------------------
// Point-to-point: sends go out with the next receive

// Picotron's send_forward_recv_backward and Megatron's batched p2p. On NCCL a send is queued
// and issued together with the receive the next op needs, as one grouped call: two neighbours
// that each send before they receive would otherwise each have a send at the head of their
// communication stream that the other's receive, queued behind its own send, never reaches.
// On MPI sends are nonblocking and only the receive is waited for (a large send completes only
// once the peer receives it, which it may do only after this rank's next op). Sends followed by
// no receive go out on their own; every send is waited for at the end of the step. Where two
// consecutive model chunks sit on one rank (a V placement's tip), the tensor is handed over on
// that rank: no message, and no buffer of its own.
class Exchange {
 public:
  Exchange(Comm& comm, const Context& ctx) : comm_(comm), ctx_(ctx) {}
  void send(Group& g, int peer, const Tensor& t) {
    if (peer == g.rank) {
      handed_[&g].push_back(t);
      return;
    }
    queued_.push_back({true, t.f32(), t.numel(), peer, &g});
    keep_.push_back(t);
  }
  // Receives [n, D] from peer of g (issuing the queued sends with it) and waits for it.
  Tensor receive(Group& g, int peer, std::vector<int64_t> shape, Mem category) {
    if (peer == g.rank) {  // as an op that receives nothing: the queued sends go on their own
      flush();
      std::deque<Tensor>& mine = handed_[&g];
      PICO_ASSERT(!mine.empty(), "a chunk's input asked for on its own rank before it was made");
      Tensor t = mine.front();
      mine.pop_front();
      return t;
    }
    Tensor t = empty(ctx_, std::move(shape), category);
    P2P recv{false, t.f32(), t.numel(), peer, &g};
    if (comm_.backend != Backend::NCCL) {
      flush();
      send_recv_async(comm_, comm_.pp, ctx_, {recv}).wait();
      return t;
    }
    queued_.push_back(recv);
    send_recv_async(comm_, comm_.pp, ctx_, queued_).wait();  // orders the compute stream only
    queued_.clear();
    keep_.clear();
    return t;
  }
  // A micro-batch's payload (model.cuh's StagePayload, the hidden state first), tensor by tensor:
  // the hidden state in `category` (the forward's input is an activation), the rest workspace.
  StagePayload receive(Group& g, int peer, const std::vector<std::vector<int64_t>>& shapes,
                       Mem category) {
    StagePayload in;
    for (size_t i = 0; i < shapes.size(); i++)
      in.push_back(receive(g, peer, shapes[i], i == 0 ? category : Mem::Workspace));
    return in;
  }
  void send(Group& g, int peer, const StagePayload& out) {
    for (const Tensor& t : out) send(g, peer, t);
  }
  void flush() {
    if (queued_.empty()) return;
    in_flight_.push_back({send_recv_async(comm_, comm_.pp, ctx_, queued_), keep_});
    queued_.clear();
    keep_.clear();
  }
  void finish() {
    flush();
    for (auto& [handle, buffers] : in_flight_) handle.wait();
    in_flight_.clear();
  }

 private:
  Comm& comm_;
  const Context& ctx_;
  std::vector<P2P> queued_;
  std::vector<Tensor> keep_;  // queued sends' buffers, alive until sent
  std::vector<std::pair<Handle, std::vector<Tensor>>> in_flight_;
  std::map<const Group*, std::deque<Tensor>> handed_;  // per group: sent to this rank itself
};

// ----------------------------------------------------------------------------
// The engine

double run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                    const StepBatch& batch, Recompute mode, float loss_scale,
                    const PipelineConfig& cfg, Observer& observer) {
  int p = comm.pp.size, rank = comm.pp.rank, V = (int)model.chunks.size(), m = batch.micro_batches;
  int last_chunk = p * V - 1;
  const StagePlacement at = stage_placement(cfg.schedule, p, V);
  int64_t tokens = (int64_t)batch.mbs * batch.seq;  // per micro-batch
  const std::vector<std::vector<int64_t>> payload = stage_payload_shapes(model, tokens);
  // One stage: gradient accumulation, whatever --pp-schedule says.
  std::vector<PipelineOp> table =
      pipeline_schedule(p > 1 ? cfg.schedule : PpSchedule::OneFOneB, p, rank, m, V);
  const bool split = splits_backward(table);  // zero-bubble: B and W apart
  double loss_sum = 0;
  Exchange exchange(comm, ctx);
  std::map<std::pair<int, int>, Activations> saved;      // (micro-batch, chunk) in flight
  std::map<std::pair<int, int>, DeferredGrads> weights;  // zero-bubble: W ops still to run
  for (const PipelineOp& op : table) {
    int g = at.chunks[rank][op.chunk];  // its model chunk
    // The ranks that hold the model chunks before and after it, where there are such chunks
    // (this rank itself where two consecutive chunks sit on it: Exchange hands over).
    const int prev = g > 0 ? at.rank[g - 1] : rank;
    const int next = g < last_chunk ? at.rank[g + 1] : rank;
    std::pair<int, int> key{op.micro, op.chunk};
    bool forward = op.kind == Phase::Forward, backward = op.kind == Phase::Backward;
    // Receive what the op needs (with the queued sends), or let the queued sends go.
    StagePayload input;
    if (forward && g > 0) {
      input = exchange.receive(comm.pp, prev, payload, Mem::Activations);
    } else if (backward && g < last_chunk) {
      input = exchange.receive(comm.pp_grad, next, payload, Mem::Workspace);
    } else {
      exchange.flush();
    }
    observer.before(op.kind, op.micro);
    UnitHooks hooks = sync.hooks(ctx, op.micro == m - 1);
    double start = now_seconds();
    int64_t block_bytes = -1;
    if (op.kind == Phase::Weight) {  // the deferred weight gradients, then their hooks
      for (const std::function<void()>& w : weights[key]) w();
      weights.erase(key);
    } else if (forward) {
      Activations& acts = saved[key];
      loss_sum += stage_forward(ctx, model, acts, batch.inputs + op.micro * tokens,
                                std::move(input), batch.targets + op.micro * tokens, batch.mbs,
                                batch.seq, mode, hooks, op.chunk);
      if (!acts.blocks.empty()) block_bytes = saved_bytes(acts.blocks[0]);
      if (g < last_chunk) exchange.send(comm.pp, next, stage_output(ctx, model, acts));
    } else {
      StagePayload d_in = stage_backward(ctx, model, saved[key], loss_scale, std::move(input), mode,
                                         hooks, op.chunk, split ? &weights[key] : nullptr);
      saved.erase(key);
      if (g > 0) exchange.send(comm.pp_grad, prev, d_in);
    }
    observer.after(op.kind, op.micro, op.chunk, V, start, block_bytes);
  }
  exchange.finish();
  return loss_sum;
}

float pipeline_forward(const Context& ctx, Comm& comm, Model& model, Activations& acts,
                       const int32_t* ids, const int32_t* targets, int B, int T, PpSchedule s) {
  int p = comm.pp.size, rank = comm.pp.rank, V = (int)model.chunks.size(), last_chunk = p * V - 1;
  const StagePlacement at = stage_placement(s, p, V);
  const std::vector<std::vector<int64_t>> payload = stage_payload_shapes(model, (int64_t)B * T);
  Exchange exchange(comm, ctx);
  float loss = 0;
  for (int c = 0; c < V; c++) {  // this rank's chunks, in the model's order
    const int g = at.chunks[rank][c];
    const int prev = g > 0 ? at.rank[g - 1] : rank;
    const int next = g < last_chunk ? at.rank[g + 1] : rank;
    StagePayload input;
    if (g > 0) input = exchange.receive(comm.pp, prev, payload, Mem::Activations);
    loss = stage_forward(ctx, model, acts, ids, std::move(input), targets, B, T, Recompute::None,
                         {}, c);
    if (g < last_chunk) exchange.send(comm.pp, next, stage_output(ctx, model, acts));
    exchange.flush();
  }
  exchange.finish();
  return loss;
}

std::string describe_pipeline(const PipelineOptions& o, int micro_batches) {
  if (o.pp == 1) return "";
  std::string row = std::string(pp_schedule_name(o.pp_schedule)) + ", " +
                    std::to_string(micro_batches) + " micro-batches";
  if (o.pp_virtual > 1) row += ", " + std::to_string(o.pp_virtual) + " chunks per rank";
  return row;
}
