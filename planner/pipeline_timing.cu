// pipeline_timing.cu: the pipeline's tables on paper (pipeline_timing.cuh): the one simulator,
// the book's chart of a schedule, and --report bubble's prediction.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <tuple>

#include "planner/pipeline_timing.cuh"

// ----------------------------------------------------------------------------
// The tables on paper (Playbook §8.2-§8.6)

// Every rank walks its table; time runs from the end of one phase of a step (an op, or DualPipe's
// F&B pair: computing it, then its blocking collectives) to the next. A message waits with its
// sender until its receiver asks for it (on CPU ranks, until its sender is inside MPI too); one
// a rank sends itself (two consecutive chunks on it) is there the instant it is asked for: no
// transfer. Between two ranks (or a rank and itself), each direction's messages are received in
// the order they were sent, as MPI and NCCL match them: a receive that would get another message
// than the one it waits for is out of order.
PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, const PipelineCosts& cost,
                                 std::optional<HostRanks> host) {
  std::vector<std::vector<PipelineOp>> tables(p);
  for (int r = 0; r < p; r++) tables[r] = pipeline_schedule(s, p, r, m, V);
  return simulate_tables(stage_placement(s, p, V), tables, cost, host);
}

PipelineTiming simulate_tables(const StagePlacement& at,
                               const std::vector<std::vector<PipelineOp>>& table,
                               const PipelineCosts& cost, std::optional<HostRanks> host) {
  const int p = (int)table.size(), last = (int)at.rank.size() - 1;
  std::vector<std::set<std::pair<int, int>>> apart(p);  // per rank: its B's whose W runs apart
  for (int r = 0; r < p; r++) apart[r] = weights_apart(table[r]);
  // A message: (a gradient?, the model chunk that reads it, micro-batch). A forward reads the
  // previous chunk's output, a backward the next one's input gradient; a W op what its B left.
  using Message = std::tuple<bool, int, int>;
  auto input = [&](int r, const PipelineOp& op) -> std::optional<Message> {
    const int g = at.chunks[r][op.chunk];
    if (op.kind == Phase::Forward && g > 0) return Message{false, g, op.micro};
    if (op.kind == Phase::Backward && g < last) return Message{true, g, op.micro};
    return std::nullopt;
  };
  auto output = [&](int r, const PipelineOp& op) -> std::optional<Message> {
    const int g = at.chunks[r][op.chunk];
    if (op.kind == Phase::Forward && g < last) return Message{false, g + 1, op.micro};
    if (op.kind == Phase::Backward && g > 0) return Message{true, g - 1, op.micro};
    return std::nullopt;
  };
  auto work = [&](int r, const PipelineOp& op) {
    if (op.kind == Phase::Forward) return cost.forward;
    if (op.kind == Phase::Weight) return cost.weight;
    return apart[r].count({op.micro, op.chunk}) ? cost.backward : cost.backward + cost.weight;
  };
  enum class State { Waiting, Computing, Communicating, Done };
  struct Rank {
    size_t next = 0, ops = 1;  // its step: ops [next, next + ops) of its table
    State state = State::Waiting;
    std::vector<Message> arrived;  // the step's inputs received so far
    double comm = 0;               // the step's blocking collectives
    double end = 0;                // with a device each: when its phase ends
    double left = 0;               // on shared cores: what is left of its phase, at full speed
    int in_flight = 0;
    std::vector<Message> held;                  // sent, not yet received, in the order sent
    std::set<std::tuple<Phase, int, int>> ran;  // (kind, micro-batch, chunk) of its ops so far
  };
  std::vector<Rank> rk(p);
  PipelineTiming t;
  t.busy.assign(p, 0);
  t.peak_in_flight.assign(p, 0);
  t.start.resize(p);
  double now = 0;
  auto has = [](const std::vector<Message>& v, const Message& k) {
    return std::find(v.begin(), v.end(), k) != v.end();
  };
  auto wanted = [&](int r, const Message& k) {  // an input of r's step, not yet received
    const Rank& x = rk[r];
    if (x.state != State::Waiting || has(x.arrived, k)) return false;
    for (size_t i = x.next; i < x.next + x.ops; i++)
      if (input(r, table[r][i]) == k) return true;
    return false;
  };
  auto begin = [&](int r) {  // the rank's next step: done, waiting for its inputs, or computing
    Rank& x = rk[r];
    if (x.next == table[r].size()) {
      x.state = State::Done;
      return;
    }
    x.ops = table[r][x.next].with_next ? 2 : 1;
    double phase = 0;
    x.comm = 0;
    for (size_t i = x.next; i < x.next + x.ops; i++) {
      const PipelineOp& op = table[r][i];
      // A backward also reads what its forward kept, a W what its B left: a table that runs
      // them in the other order waits forever.
      const Phase own = op.kind == Phase::Weight ? Phase::Backward : Phase::Forward;
      const bool kept = op.kind == Phase::Forward || x.ran.count({own, op.micro, op.chunk});
      const std::optional<Message> in = input(r, op);
      if (!kept || (in && !has(x.arrived, *in))) {
        x.state = State::Waiting;
        return;
      }
      phase += work(r, op), x.comm += op.kind == Phase::Weight ? 0.0 : cost.comm;
    }
    x.state = State::Computing;
    x.arrived.clear();
    x.end = now + phase, x.left = phase;
    t.busy[r] += phase + x.comm;
    double start = now;
    for (size_t i = x.next; i < x.next + x.ops; i++) {
      const PipelineOp& op = table[r][i];
      x.ran.insert({op.kind, op.micro, op.chunk});
      t.start[r].push_back(start);
      start += work(r, op);
      // Activations are held from the forward to the last op that reads them.
      if (op.kind == Phase::Forward) x.in_flight++;
      if (op.kind == Phase::Weight ||
          (op.kind == Phase::Backward && !apart[r].count({op.micro, op.chunk})))
        x.in_flight--;
      t.peak_in_flight[r] = std::max(t.peak_in_flight[r], x.in_flight);
    }
  };
  for (int r = 0; r < p; r++) begin(r);
  for (;;) {
    // Messages reach the ranks waiting for them. On CPU ranks a sender moves what it holds
    // while inside MPI, waiting or done, even if its own receive is met in this instant.
    std::vector<int> senders;
    for (int r = 0; r < p; r++)
      if (!host || rk[r].state == State::Waiting || rk[r].state == State::Done)
        senders.push_back(r);
    for (int r : senders)
      for (size_t i = 0; i < rk[r].held.size();) {
        const Message k = rk[r].held[i];
        const int to = at.rank[std::get<1>(k)];
        if (!wanted(to, k)) {
          i++;
          continue;
        }
        for (size_t j = 0; j < i; j++)  // sent earlier on the same way: a receive would get it
          if (at.rank[std::get<1>(rk[r].held[j])] == to &&
              std::get<0>(rk[r].held[j]) == std::get<0>(k))
            t.in_order = false;
        rk[r].held.erase(rk[r].held.begin() + (long)i);
        rk[to].arrived.push_back(k);
        begin(to);
      }
    // Time moves to the next end of a phase. With a device each, a phase ends at its start
    // plus its cost. On shared cores the k ranks computing go at min(1, cores / k) each, which
    // changes whenever one starts or stops: every busy rank does `step` at its speed, and one
    // with no more than rounding left ends with the others (whether two ranks meet inside MPI
    // decides when a send moves).
    int computing = 0;
    for (const Rank& x : rk) computing += x.state == State::Computing;
    const double share = host ? std::min(1.0, host->cores / std::max(1, computing)) : 1.0;
    auto busy = [](const Rank& x) {
      return x.state == State::Computing || x.state == State::Communicating;
    };
    auto speed = [&](const Rank& x) { return x.state == State::Computing ? share : 1.0; };
    double next_end = std::numeric_limits<double>::infinity(), step = next_end;
    for (const Rank& x : rk)
      if (busy(x)) {
        next_end = std::min(next_end, x.end);
        step = std::min(step, x.left / speed(x));
      }
    if (next_end == std::numeric_limits<double>::infinity()) break;  // all done, or stuck
    now = host ? now + step : next_end;
    for (int r = 0; r < p; r++) {
      Rank& x = rk[r];
      if (!busy(x)) continue;
      x.left -= step * speed(x);
      const bool ends = host ? x.left <= 1e-12 * (1 + now) : x.end <= now;
      if (!ends) continue;
      if (x.state == State::Computing && x.comm > 0) {  // a W op has no collectives
        x.state = State::Communicating;
        x.end = now + x.comm, x.left = x.comm;
        continue;
      }
      for (size_t i = x.next; i < x.next + x.ops; i++)
        if (std::optional<Message> out = output(r, table[r][i])) x.held.push_back(*out);
      x.next += x.ops;
      begin(r);
    }
  }
  t.complete = t.in_order;
  for (int r = 0; r < p; r++)
    t.complete = t.complete && rk[r].next == table[r].size() && rk[r].held.empty();
  t.makespan = now;
  return t;
}

PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, double t_f, double t_b,
                                 double t_w) {
  return simulate_pipeline(s, p, m, V, PipelineCosts{t_f, t_b, t_w});
}

std::string pipeline_chart(PpSchedule s, int p, int m, int V) {
  PipelineTiming t = simulate_pipeline(s, p, m, V, 1.0, 1.0, 1.0);
  int ticks = (int)std::lround(t.makespan), width = V > 1 ? 6 : 4;
  std::string chart;
  for (int r = 0; r < p; r++) {
    std::vector<std::string> cells(ticks, std::string(width - 1, ' ') + ".");
    std::vector<PipelineOp> ops = pipeline_schedule(s, p, r, m, V);
    const std::set<std::pair<int, int>> apart = weights_apart(ops);
    for (size_t i = 0; i < ops.size() && i < t.start[r].size(); i++) {
      const char* kind[] = {"F", "B", "W"};
      std::string cell = kind[(int)ops[i].kind] + std::to_string(ops[i].micro) +
                         (V > 1 ? "." + std::to_string(ops[i].chunk) : "");
      if (i > 0 && ops[i - 1].with_next) cell = "&" + cell;  // DualPipe's F&B: one step
      cell = std::string(std::max(0, width - (int)cell.size()), ' ') + cell;
      bool whole_backward =
          ops[i].kind == Phase::Backward && !apart.count({ops[i].micro, ops[i].chunk});
      int first = (int)std::lround(t.start[r][i]), span = whole_backward ? 2 : 1;
      for (int k = first; k < first + span && k < ticks; k++) cells[k] = cell;
    }
    chart += "  stage " + std::to_string(r) + " |";
    for (const std::string& c : cells) chart += c;
    chart += "\n";
  }
  return chart;
}

BubblePrediction bubble_prediction(PpSchedule s, int p, int m, int V) {
  PipelineTiming ticks = simulate_pipeline(s, p, m, V, 1.0, 1.0, 1.0);
  return {pp_schedule_name(s),
          p,
          m,
          V,
          ticks.busy,
          ticks.makespan,
          ticks.peak_in_flight,
          bubble_fraction(s, p, m, V),
          pipeline_chart(s, p, m, V),
          bubble_formula(s)};
}
