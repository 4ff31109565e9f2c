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

// Every rank walks its table; time runs from the end of one phase of an op (computing it, then
// its blocking collectives) to the next. A message waits with its sender until its receiver
// asks for it (on CPU ranks, until its sender is inside MPI too); one a rank sends itself (two
// consecutive chunks on it) is there the instant it is asked for: no transfer.
PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, const PipelineCosts& cost,
                                 std::optional<HostRanks> host) {
  const StagePlacement at = stage_placement(s, p, V);
  const int last = p * V - 1;
  std::vector<std::vector<PipelineOp>> table(p);
  for (int r = 0; r < p; r++) table[r] = pipeline_schedule(s, p, r, m, V);
  const bool zb = splits_backward(table[0]);
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
  auto work = [&](const PipelineOp& op) {
    if (op.kind == Phase::Forward) return cost.forward;
    if (op.kind == Phase::Weight) return cost.weight;
    return zb ? cost.backward : cost.backward + cost.weight;
  };
  enum class State { Waiting, Computing, Communicating, Done };
  struct Rank {
    size_t next = 0;  // its op in the table
    State state = State::Waiting;
    bool arrived = false;  // the op's input
    double end = 0;        // with a device each: when its phase ends
    double left = 0;       // on shared cores: what is left of its phase, at full speed
    int in_flight = 0;
    std::vector<Message> held;                  // sent, not yet received
    std::set<std::tuple<Phase, int, int>> ran;  // (kind, micro-batch, chunk) of its ops so far
  };
  std::vector<Rank> rk(p);
  PipelineTiming t;
  t.busy.assign(p, 0);
  t.peak_in_flight.assign(p, 0);
  t.start.resize(p);
  double now = 0;
  auto begin = [&](int r) {  // the rank's next op: done, waiting for its input, or computing it
    Rank& x = rk[r];
    if (x.next == table[r].size()) {
      x.state = State::Done;
      return;
    }
    const PipelineOp& op = table[r][x.next];
    // A backward also reads what its forward kept, a W what its B left: a table that runs them
    // in the other order waits forever.
    const Phase own = op.kind == Phase::Weight ? Phase::Backward : Phase::Forward;
    const bool kept = op.kind == Phase::Forward || x.ran.count({own, op.micro, op.chunk});
    if ((input(r, op) && !x.arrived) || !kept) {
      x.state = State::Waiting;
      return;
    }
    x.ran.insert({op.kind, op.micro, op.chunk});
    x.state = State::Computing;
    x.arrived = false;
    x.end = now + work(op);
    x.left = work(op);
    t.start[r].push_back(now);
    t.busy[r] += work(op) + (op.kind == Phase::Weight ? 0.0 : cost.comm);
    // Activations are held from the forward to the last op that reads them.
    if (op.kind == Phase::Forward) x.in_flight++;
    if (op.kind == Phase::Weight || (op.kind == Phase::Backward && !zb)) x.in_flight--;
    t.peak_in_flight[r] = std::max(t.peak_in_flight[r], x.in_flight);
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
        if (rk[to].state != State::Waiting || input(to, table[to][rk[to].next]) != k) {
          i++;
          continue;
        }
        rk[r].held.erase(rk[r].held.begin() + (long)i);
        rk[to].arrived = true;
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
      const PipelineOp& op = table[r][x.next];
      if (x.state == State::Computing && cost.comm > 0 && op.kind != Phase::Weight) {
        x.state = State::Communicating;  // a W op has no collectives
        x.end = now + cost.comm;
        x.left = cost.comm;
        continue;
      }
      if (std::optional<Message> out = output(r, op)) x.held.push_back(*out);
      x.next++;
      begin(r);
    }
  }
  t.complete = true;
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
    for (size_t i = 0; i < ops.size() && i < t.start[r].size(); i++) {
      const char* kind[] = {"F", "B", "W"};
      std::string cell = kind[(int)ops[i].kind] + std::to_string(ops[i].micro) +
                         (V > 1 ? "." + std::to_string(ops[i].chunk) : "");
      cell = std::string(std::max(0, width - (int)cell.size()), ' ') + cell;
      bool whole_backward = ops[i].kind == Phase::Backward && !splits_backward(ops);
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
          pipeline_chart(s, p, m, V)};
}
