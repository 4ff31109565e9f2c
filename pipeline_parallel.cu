// pipeline_parallel.cu: pipeline parallelism (Playbook §8; picotron's pipeline_parallel.py,
// Megatron's schedules). Consecutive blocks live on consecutive ranks; a micro-batch's hidden
// state [n, D] travels forward through them and its gradient travels back.
// The one idea: a stage idles until the first micro-batch reaches it and after the last one
// leaves, (p-1) forward-backward times per step whatever the order; more micro-batches (m) or
// more, smaller chunks per rank (V) shrink that bubble to (p-1)/m, then (p-1)/(Vm), of the work,
// and 1F1B bounds the activations a stage holds at p micro-batches where AFAB holds m; weight
// gradients split from the backward fill the rest (zero bubble), to almost none on a V (ZB-V).
//
// Each schedule is a row of kSchedules: a table (per rank, forward, backward and weight ops, each
// of a micro-batch and a chunk) and a placement (the loop or the V: which model chunk each rank's
// chunks are). One engine runs the tables (run_schedule; one stage's is gradient accumulation);
// simulate_pipeline runs every rank's against the others on paper (planner/pipeline_timing.cu),
// as the tests, --report bubble and the planner read them.
// Guide: docs/pipeline-parallel.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>

#include "pipeline_parallel.cuh"
#include "runtime/exchange.cuh"
#include "runtime/options.cuh"

// ----------------------------------------------------------------------------
// Schedules as tables (Playbook §8.3-§8.6). A schedule is a row: its table, its placement and
// the book's idle fraction; what the engine and the paper run need (which backwards split into
// B and W, which ops run as a pair) is read off the table. A new schedule is a function and a row.

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
// The V (ZB-V, DeepSeek's DualPipeV): chunk 0 down the ranks, chunk 1 back up, rank r holding
// model chunks r and 2p - 1 - r. Chunks p - 1 and p meet on rank p - 1 (the tip: no message),
// the embedding and the head on rank 0.
int v_placement(int p, int rank, int local) {
  return local == 0 ? rank : 2 * p - 1 - rank;
}

// ZB-V (Qi et al. 2023): B and W apart on the V, no bubble once the pipeline is full, at 1F1B's
// memory (2p chunks' activations: p micro-batches of a stage). Built, like the paper's, on a clock
// of ticks (t_f = t_b = t_w), by rules of its own: each tick rank r runs the first that can run:
// a new micro-batch's forward (chunk 0) while it holds at most 2p - 2 chunks and leads its
// chunk 1 by fewer than 2(p - r) - 1 micro-batches (the V between them kept full, no fuller);
// a forward of chunk 1 while it holds fewer than 2p; a B of chunk 0, then of 1; its oldest W.
// A rank idles only until micro-batch 0 reaches it, p - 1 ticks: the least any table can.
Table zero_bubble_v(int p, int rank, int m, int) {
  // When each (model chunk, micro-batch)'s forward [0] and B [1] end, in ticks.
  std::vector<std::vector<int>> end[2];
  end[0] = end[1] = std::vector<std::vector<int>>(2 * p, std::vector<int>(m, 1 << 30));
  struct Rank {
    int next[2][2] = {}, held = 0;   // per kind and chunk the next micro-batch; activations held
    std::deque<PipelineOp> weights;  // W's to run, oldest first
    Table ops;
  };
  std::vector<Rank> ranks(p);
  for (int tick = 0, left = 6 * m * p; left > 0; tick++) {
    PICO_ASSERT(tick < 12 * (m + p), "the ZB-V tables stopped making progress");
    std::vector<std::optional<PipelineOp>> runs(p);
    for (int r = 0; r < p; r++) {
      Rank& x = ranks[r];
      auto ready = [&](Phase kind, int c) {
        const int g = v_placement(p, r, c), i = x.next[(int)kind][c];
        if (i == m) return false;
        if (kind == Phase::Forward) return g == 0 || end[0][g - 1][i] <= tick;
        return end[0][g][i] <= tick && (g == 2 * p - 1 || end[1][g + 1][i] <= tick);
      };
      if (ready(Phase::Forward, 0) && x.held <= 2 * p - 2 &&
          x.next[0][0] - x.next[0][1] < 2 * (p - r) - 1)
        runs[r] = PipelineOp{Phase::Forward, 0, 0};
      else if (ready(Phase::Forward, 1) && x.held < 2 * p)
        runs[r] = PipelineOp{Phase::Forward, 0, 1};
      else if (ready(Phase::Backward, 0) || ready(Phase::Backward, 1))
        runs[r] = PipelineOp{Phase::Backward, 0, ready(Phase::Backward, 0) ? 0 : 1};
      else if (!x.weights.empty())
        runs[r] = x.weights.front();
    }
    for (int r = 0; r < p; r++) {  // what ran this tick ends with it
      if (!runs[r]) continue;
      Rank& x = ranks[r];
      PipelineOp op = *runs[r];
      if (op.kind != Phase::Weight) {
        op.micro = x.next[(int)op.kind][op.chunk]++;
        end[(int)op.kind][v_placement(p, r, op.chunk)][op.micro] = tick + 1;
      }
      if (op.kind == Phase::Forward) x.held++;
      if (op.kind == Phase::Backward) x.weights.push_back({Phase::Weight, op.micro, op.chunk});
      if (op.kind == Phase::Weight) x.weights.pop_front(), x.held--;
      x.ops.push_back(op), left--;
    }
  }
  return ranks[rank].ops;
}

// DualPipeV (DeepSeek-V3's DualPipe cut in half, as DeepSeek's DualPipe repository runs it), on
// the V in eight phases, `below` = p - 1 - r: (1) 2 below forwards of chunk 0; (2) r + 1 times
// a forward of chunk 0 and one of chunk 1; (3) below times B, W (filling the wait) and a forward
// of chunk 1; (4) m - 2p + r + 1 times two F&B pairs, a micro-batch's forward overlapped with
// another's whole backward (chunk 0's forward with chunk 1's backward, then the other way; the
// last rank's first pair apart); (5) below times a backward of chunk 1 and an F&B; (6) r + 1
// backwards of each chunk, the later half B alone; (7) below times a W and a B of chunk 0; (8)
// the last W's. With m < 2p: the tables of 2p less the missing micro-batches' ops. A rank holds
// 2p + 1 chunks at most (DeepSeek's PP + 1), idles (p-1)(F&B + B - 3W) (DeepSeek's, PP/2 = p).
Table dual_pipe_v(int p, int rank, int m, int) {
  const int r = rank, below = p - 1 - r, M = std::max(m, 2 * p);
  Table ops;
  int forwards[2] = {0, 0}, backwards[2] = {0, 0};
  std::deque<PipelineOp> weights;  // the W's of the B's run alone, oldest first
  auto F = [&](int c, bool with_next = false) {
    ops.push_back({Phase::Forward, forwards[c]++, c, with_next});
  };
  auto B = [&](int c, bool w_apart = false) {
    if (w_apart) weights.push_back({Phase::Weight, backwards[c], c});
    ops.push_back({Phase::Backward, backwards[c]++, c});
  };
  auto W = [&] { ops.push_back(weights.front()), weights.pop_front(); };
  for (int i = 0; i < 2 * below; i++) F(0);
  for (int i = 0; i <= r; i++) F(0), F(1);
  for (int i = 0; i < below; i++) B(1, true), W(), F(1);
  for (int i = 0; i < M - 2 * p + r + 1; i++) {
    F(0, i > 0 || r < p - 1), B(1);
    F(1, true), B(0);
  }
  for (int i = 0; i < below; i++) B(1), F(1, true), B(0);
  for (int i = 0, half = (r + 1) / 2; i <= r; i++)
    B(1, i > half || (i == half && r % 2)), B(0, i >= half);
  for (int i = 0; i < below; i++) W(), B(0, true);
  while (!weights.empty()) W();
  Table mine;  // without the ops of micro-batches m .. M - 1
  for (size_t k = 0; k < ops.size(); k++)
    if (ops[k].micro < m)
      mine.push_back(ops[k]);
    else if (k > 0 && ops[k - 1].with_next && ops[k - 1].micro < m)
      mine.back().with_next = false;  // its partner left out: it runs alone
  return mine;
}

struct ScheduleRow {
  PpSchedule id;
  const char* name;  // --pp-schedule
  Table (*table)(int p, int rank, int m, int V);
  int (*placement)(int p, int rank, int local);
  int fewest_chunks, most_chunks;  // model chunks per rank it runs (--pp-virtual)
  bool groups;                     // runs micro-batches in groups of p (m a multiple of p)
  // The book's idle fraction of a step (the bubble as a share of the step, not of the work).
  double (*bubble)(int p, int m, int V);
  const char* formula;  // that fraction in words
};
const int kAny = std::numeric_limits<int>::max();
const ScheduleRow kSchedules[] = {
    {PpSchedule::AFAB, "afab", afab, loop_placement, 1, 1, false,
     [](int p, int m, int) { return (p - 1) / (m + p - 1.0); }, "(p-1)/(m+p-1) (Playbook §8.3)"},
    {PpSchedule::OneFOneB, "1f1b",
     [](int p, int rank, int m, int) { return one_f_one_b(p, rank, m, false); }, loop_placement, 1,
     1, false, [](int p, int m, int) { return (p - 1) / (m + p - 1.0); },
     "(p-1)/(m+p-1), a bubble of (p-1)/m of the ideal time (Playbook §8.4)"},
    {PpSchedule::Interleaved, "interleaved", interleaved, loop_placement, 2, kAny, true,
     [](int p, int m, int V) { return (p - 1) / ((double)V * m + p - 1); },
     "(p-1)/(Vm+p-1), a bubble of (p-1)/(Vm) of the ideal time (Playbook §8.5)"},
    // t_f = t_b = t_w: the idle (p-1)(t_f + t_b - t_w) of a step of 3m + p - 1 ticks.
    {PpSchedule::ZeroBubbleH1, "zb-h1",
     [](int p, int rank, int m, int) { return one_f_one_b(p, rank, m, true); }, loop_placement, 1,
     1, false, [](int p, int m, int) { return (p - 1) / (3.0 * m + p - 1); },
     "(p-1)(t_f+t_b-t_w) of idle, (p-1)/(3m+p-1) with equal costs (Playbook §8.6)"},
    // Steps of 6m chunk ticks per rank: the ramp idles, (p-1) t_f; dualpipev 2(p-1) (m >= 2p).
    {PpSchedule::ZeroBubbleV, "zb-v", zero_bubble_v, v_placement, 2, 2, false,
     [](int p, int m, int) { return (p - 1) / (6.0 * m + p - 1); },
     "(p-1)/(6m+p-1): no bubble once full (Qi et al.), (p-1) t_f on the way down"},
    {PpSchedule::DualPipeV, "dualpipev", dual_pipe_v, v_placement, 2, 2, false,
     [](int p, int m, int) { return (p - 1.0) / (3.0 * m + p - 1); },
     "(PP/2-1)(F&B+B-3W), PP = 2p (DeepSeek-V3): 2(p-1) ticks of 6m+2(p-1) if m >= 2p"},
};
const ScheduleRow& row(PpSchedule s) {
  return table_row(kSchedules, s);
}
}  // namespace

PpSchedule parse_pp_schedule(const std::string& flag) {
  return parse_row("--pp-schedule", flag, kSchedules);
}
const char* pp_schedule_name(PpSchedule s) {
  return row(s).name;
}

std::vector<PipelineOp> pipeline_schedule(PpSchedule s, int p, int rank, int m, int V) {
  return row(s).table(p, rank, m, V);
}
std::set<std::pair<int, int>> weights_apart(const std::vector<PipelineOp>& table) {
  std::set<std::pair<int, int>> apart;
  for (const PipelineOp& op : table)
    if (op.kind == Phase::Weight) apart.insert({op.micro, op.chunk});
  return apart;
}
bool runs_chunks(PpSchedule s, int V) {
  return V >= row(s).fewest_chunks && V <= row(s).most_chunks;
}
double bubble_fraction(PpSchedule s, int p, int m, int V) {
  return row(s).bubble(p, m, V);
}
std::string bubble_formula(PpSchedule s) {
  return row(s).formula;
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
  g.add_option("--pp-virtual", o.pp_virtual,
               "model chunks per pipeline rank (interleaved: >= 2; zb-v, dualpipev: 2)")
      ->capture_default_str();
}

void validate_pipeline(int layers, int p, int V, int m, PpSchedule s, bool tied, int zero_stage) {
  check_positive(p, "--pp");
  std::string pp = "--pp " + std::to_string(p), name = pp_schedule_name(s);
  const ScheduleRow& sr = row(s);
  if (V < 1) throw UsageError("--pp-virtual " + std::to_string(V) + ": must be >= 1");
  if (!runs_chunks(s, V) && sr.fewest_chunks > 1)
    throw UsageError("--pp-schedule " + name + " needs --pp-virtual " +
                     (sr.most_chunks == 2 ? "2: two model chunks per rank, in a V"
                                          : "2 or more model chunks per rank (with one chunk it "
                                            "is 1f1b)"));
  if (!runs_chunks(s, V)) {
    std::string chunked;
    for (const ScheduleRow& r : kSchedules)
      if (runs_chunks(r.id, V)) chunked += std::string(chunked.empty() ? "" : " or ") + r.name;
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
  if (zero_stage == 2 && !weights_apart(pipeline_schedule(s, p, 0, m, V)).empty())
    throw UsageError("--zero 2 with --pp-schedule " + name + ": ZeRO-2 reduce-scatters each " +
                     "micro-batch's gradient as soon as it is final, while " + name +
                     " still adds earlier micro-batches' deferred weight gradients; use --zero 1");
  if (zero_stage == 3)
    throw UsageError("--zero 3 with " + pp +
                     ": ZeRO-3 would gather every unit's weights again for each micro-batch in "
                     "flight, which pipelining multiplies (Playbook §10.2: ZeRO-3 and PP are "
                     "alternatives); use --zero 1 or 2 with --pp");
}

// ----------------------------------------------------------------------------
// The engine

double run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                    const StepBatch& batch, Recompute mode, float loss_scale,
                    const PipelineConfig& cfg, Observer& observer) {
  int p = comm.pp.size, rank = comm.pp.rank, V = (int)model.chunks.size(), m = batch.micro_batches;
  int last_chunk = p * V - 1;
  const StagePlacement at = stage_placement(cfg.schedule, p, V);
  int64_t tokens = (int64_t)batch.mbs * batch.seq;  // per micro-batch
  const std::vector<TensorSpec> payload = stage_payload(ctx, model, tokens);
  // One stage of one chunk: gradient accumulation, whatever --pp-schedule says.
  std::vector<PipelineOp> table =
      pipeline_schedule(p * V > 1 ? cfg.schedule : PpSchedule::OneFOneB, p, rank, m, V);
  const std::set<std::pair<int, int>> apart = weights_apart(table);  // zero-bubble: B and W
  std::vector<PendingSum> losses;  // each micro-batch's, read once, in order, at the end
  // Sends go out with the next receive, on the pp group's calls (runtime/exchange.cuh).
  Exchange exchange(comm, comm.pp, ctx);
  std::map<std::pair<int, int>, Activations> saved;      // (micro-batch, chunk) in flight
  std::map<std::pair<int, int>, DeferredGrads> weights;  // zero-bubble: W ops still to run
  // A forward receives the previous model chunk's output, a backward the next one's input
  // gradient (from this rank itself at a V's tip); other ops let the queued sends go.
  auto receive = [&](const PipelineOp& op) {
    const int g = at.chunks[rank][op.chunk];
    if (op.kind == Phase::Forward && g > 0)
      return exchange.receive(comm.pp, at.rank[g - 1], payload, Mem::Activations);
    if (op.kind == Phase::Backward && g < last_chunk)
      return exchange.receive(comm.pp_grad, at.rank[g + 1], payload, Mem::Workspace);
    exchange.flush();
    return StagePayload{};
  };
  std::deque<StagePayload> inputs;  // received for this op (and, DualPipe's F&B, the next)
  for (size_t k = 0; k < table.size(); k++) {
    const PipelineOp& op = table[k];
    int g = at.chunks[rank][op.chunk];  // its model chunk
    std::pair<int, int> key{op.micro, op.chunk};
    if (k == 0 || !table[k - 1].with_next)
      for (size_t j = k; j <= k + op.with_next; j++) inputs.push_back(receive(table[j]));
    StagePayload input = std::move(inputs.front());
    inputs.pop_front();
    observer.before(op.kind, op.micro, op.chunk, V);
    UnitHooks hooks = sync.hooks(ctx, op.micro == m - 1);
    double start = now_seconds();
    int64_t block_bytes = -1;
    if (op.kind == Phase::Weight) {  // the deferred weight gradients, then their hooks
      for (const DeferredGrad& w : weights[key]) {
        const double began = w.what ? observer.begin_span(w.what) : 0.0;
        w.run();
        if (w.what) observer.end_span(w.what, Track::Compute, began);
      }
      weights.erase(key);
    } else if (op.kind == Phase::Forward) {
      Activations& acts = saved[key];
      losses.push_back(stage_forward(ctx, model, acts, batch.inputs + op.micro * tokens,
                                     std::move(input), batch.targets + op.micro * tokens, batch.mbs,
                                     batch.seq, mode, hooks, op.chunk, batch.sequence(op.micro)));
      if (!acts.blocks.empty()) block_bytes = saved_bytes(acts.blocks[0]);
      if (g < last_chunk) exchange.send(comm.pp, at.rank[g + 1], stage_output(ctx, model, acts));
    } else {
      StagePayload d_in =
          stage_backward(ctx, model, saved[key], loss_scale, std::move(input), mode, hooks,
                         op.chunk, apart.count(key) ? &weights[key] : nullptr);
      saved.erase(key);
      if (g > 0) exchange.send(comm.pp_grad, at.rank[g - 1], d_in);
    }
    observer.after(op.kind, op.micro, op.chunk, V, start, block_bytes);
  }
  exchange.finish();
  return read_total(ctx, losses);
}

float pipeline_forward(const Context& ctx, Comm& comm, Model& model, Activations& acts,
                       const int32_t* ids, const int32_t* targets, int B, int T, PpSchedule s) {
  int p = comm.pp.size, rank = comm.pp.rank, V = (int)model.chunks.size(), last_chunk = p * V - 1;
  const StagePlacement at = stage_placement(s, p, V);
  const std::vector<TensorSpec> payload = stage_payload(ctx, model, (int64_t)B * T);
  Exchange exchange(comm, comm.pp, ctx);
  PendingSum loss;
  for (int c = 0; c < V; c++) {  // this rank's chunks, in the model's order
    const int g = at.chunks[rank][c];
    StagePayload input;
    if (g > 0) input = exchange.receive(comm.pp, at.rank[g - 1], payload, Mem::Activations);
    loss =
        stage_forward(ctx, model, acts, ids, std::move(input), targets, B, T, kForwardOnly, {}, c);
    if (g < last_chunk) exchange.send(comm.pp, at.rank[g + 1], stage_output(ctx, model, acts));
    exchange.flush();
  }
  exchange.finish();
  return (float)read_total(ctx, {loss});
}

std::string describe_pipeline(const PipelineOptions& o, int micro_batches) {
  if (o.pp == 1) return "";
  std::string row = std::string(pp_schedule_name(o.pp_schedule)) + ", " +
                    std::to_string(micro_batches) + " micro-batches";
  if (o.pp_virtual > 1) row += ", " + std::to_string(o.pp_virtual) + " chunks per rank";
  return row;
}
