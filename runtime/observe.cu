// observe.cu: faults on purpose, and what the engine's operations measured (observe.cuh).
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <thread>
#include <vector>

#include "runtime/observe.cuh"

const char* fault_where_name(FaultWhere w) {
  const char* names[] = {"init",      "step",       "forward", "backward", "clip",
                         "optimizer", "validation", "save",    "finalize"};
  return names[(int)w];
}

void Fault::at(FaultWhere here, int world_rank, int64_t now) const {
  if (kind.empty() || kind == "inf" || rank != world_rank || step != now || where != here) return;
  fprintf(stderr, "rank %d: injected fault '%s' at step %lld, %s\n", world_rank, kind.c_str(),
          (long long)now, fault_where_name(here));
  fflush(stderr);
  if (kind == "crash") raise(SIGKILL);
  if (kind == "hang")
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  PICO_ASSERT(kind != "error", "injected error");
}

// KIND:RANK:STEP[:WHERE] with KIND crash, hang or error, RANK and STEP non-negative integers,
// WHERE one of the places of FaultWhere (default step).
Fault parse_fault(const std::string& value) {
  auto fail = [&](const std::string& why) {
    return UsageError("--fault " + value + ": " + why +
                      "; expected KIND:RANK:STEP[:WHERE], e.g. crash:1:3 or hang:0:2:backward");
  };
  std::vector<std::string> fields;
  for (size_t from = 0;;) {
    size_t colon = value.find(':', from);
    fields.push_back(value.substr(from, colon - from));
    if (colon == std::string::npos) break;
    from = colon + 1;
  }
  if (fields.size() != 3 && fields.size() != 4) throw fail("not three or four fields");
  Fault f;
  f.kind = fields[0];
  if (f.kind != "crash" && f.kind != "hang" && f.kind != "error" && f.kind != "inf")
    throw fail("unknown kind '" + f.kind + "' (crash, hang, error or inf)");
  auto integer = [&](const std::string& text, const char* what) {
    if (text.empty() || text.size() > 12 ||
        text.find_first_not_of("0123456789") != std::string::npos)
      throw fail(std::string(what) + " '" + text + "' is not a non-negative integer");
    return std::stoll(text);
  };
  f.rank = (int)integer(fields[1], "rank");
  f.step = integer(fields[2], "step");
  if (fields.size() == 4 && f.kind == "inf")
    throw fail("inf has no place: it is put into the gradient after the step's backward");
  if (fields.size() == 4) {
    std::string places;
    for (int w = 0; w <= (int)FaultWhere::Finalize; w++) {
      if (fields[3] == fault_where_name((FaultWhere)w)) return f.where = (FaultWhere)w, f;
      places += std::string(w ? ", " : "") + fault_where_name((FaultWhere)w);
    }
    throw fail("unknown place '" + fields[3] + "' (" + places + ")");
  }
  return f;
}

// Whether the run passes the fault's place at its step.
static void check_fault_place(const Fault& f, const std::string& value, const FaultPlaces& run) {
  auto never = [&](const std::string& why) {
    return UsageError("--fault " + value + " would never fire: " + why +
                      "; a fault that does not fire tests nothing: pick a rank, step and place "
                      "this run reaches");
  };
  if (f.rank >= run.world)
    throw never("rank " + std::to_string(f.rank) + " does not exist in a grid of " +
                std::to_string(run.world) + " ranks");
  const std::string s = std::to_string(f.step);
  for (auto [place, when] : {std::pair{FaultWhere::Init, "before set-up"},
                             std::pair{FaultWhere::Finalize, "at the job's end"}})
    if (f.kind != "inf" && f.where == place) {
      if (f.step != 0)
        throw never(std::string(fault_where_name(place)) + " comes once, " + when +
                    ", as step 0 (write " + f.kind + ":" + std::to_string(f.rank) +
                    ":0:" + fault_where_name(place) + ")");
      return;
    }
  if (!run.trains)
    throw never("--score takes no training step (only init and finalize faults fire)");
  if (f.kind == "inf" && !run.skips_overflow)
    throw UsageError("--fault " + value +
                     ": inf stands for an fp16 overflow, which fp16's loss "
                     "scaling meets by skipping the step on every rank; this run is " +
                     run.precision +
                     ", without loss scaling, where an infinity would reach the "
                     "weights (or not) depending on the layout: use --dtype fp16");
  auto steps_run = [&] {
    if (run.first_step >= run.end)
      return std::string("this run takes no step (") + run.schedule + ")";
    return "this run takes steps " + std::to_string(run.first_step) + " to " +
           std::to_string(run.end - 1) + " (counted from 0, as --fault counts; " + run.schedule +
           ")";
  };
  auto list = [&](const std::function<bool(int64_t)>& at) {
    std::string steps;
    int shown = 0;
    for (int64_t t = std::max<int64_t>(run.first_step - 1, -1); t < run.end && shown < 6; t++)
      if (t >= 0 && at && at(t)) steps += (shown++ ? ", " : "") + std::to_string(t);
    return steps.empty() ? std::string("none") : steps + (shown == 6 ? ", ..." : "");
  };
  if (f.kind == "inf" || f.where != FaultWhere::Save) {
    if (f.step < run.first_step || f.step >= run.end) throw never("step " + s + ": " + steps_run());
  }
  if (f.kind == "inf") return;
  if (f.where == FaultWhere::Validation && !(run.validates && run.validates(f.step)))
    throw never("no validation after step " + s + "; this run validates after steps " +
                list(run.validates) + " (--val-every, and after the last step)");
  if (f.where == FaultWhere::Save && !(run.saves && run.saves(f.step)))
    throw never(list(run.saves) == "none"
                    ? std::string("this run saves no checkpoint: add --save DIR")
                    : "no checkpoint is saved after step " + s + "; this run saves after steps " +
                          list(run.saves) + " (--save-every, and after the last step)");
}

void check_fault_has_peer(const Fault& f, const std::string& value, int world) {
  if (f.kind == "hang" && world == 1)
    throw UsageError("--fault " + value +
                     ": a hang on a one-rank run has no peer waiting for it, so nothing would "
                     "end it (the rank would sleep forever); a hang tests that the other ranks "
                     "end the job by --comm-timeout: launch with mpirun -np 2 or more, or use "
                     "crash or error");
}

void check_fault_fires(const Fault& f, const std::string& value, const FaultPlaces& run) {
  if (f.kind.empty()) return;
  check_fault_place(f, value, run);
  check_fault_has_peer(f, value, run.world);
}

// ----------------------------------------------------------------------------
// Around a step's schedule

void Observer::begin_schedule(int64_t step, bool measured) {
  step_ = step, measured_ = measured;
  schedule_start_ = now_seconds(), busy_ = 0;
  acts_base_ = memory_stats().current[(int)Mem::Activations], one_micro_ = 0, peak_ = 0;
}

void range_push(const std::string& name) {
  nvtxRangePushA(name.c_str());
}
void range_pop() {
  nvtxRangePop();
}

// "F3", "B3 chunk 1": a schedule op's span and range.
static std::string op_name(Phase phase, int micro, int chunk, int chunks) {
  const char* kind[] = {"F", "B", "W"};
  return kind[(int)phase] + std::to_string(micro) +
         (chunks > 1 ? " chunk " + std::to_string(chunk) : "");
}

void Observer::before(Phase phase, int micro, int chunk, int chunks) const {
  if (!measured_) return;
  at(phase == Phase::Forward ? FaultWhere::Forward : FaultWhere::Backward, step_);
  range_push(op_name(phase, micro, chunk, chunks));
}

void Observer::after(Phase phase, int micro, int chunk, int chunks, double start,
                     int64_t block_bytes) {
  if (!measured_) return;
  range_pop();
  double end = now_seconds();
  busy_ += end - start;
  // Coloured by kind, as the book draws its schedules (Chrome trace colour names).
  const char* color[] = {"thread_state_running", "thread_state_iowait", "yellow"};
  trace_.add(op_name(phase, micro, chunk, chunks), Track::Compute, start, end, color[(int)phase]);
  if (measure_.block_bytes < 0 && block_bytes >= 0) measure_.block_bytes = block_bytes;
  size_t held = memory_stats().current[(int)Mem::Activations] - acts_base_;
  if (one_micro_ == 0 && phase == Phase::Forward) one_micro_ = held;  // one chunk's activations
  peak_ = std::max(peak_, held);
}

void Observer::end_schedule() {
  if (!measured_) return;
  measure_.busy_s += busy_, measure_.step_s += now_seconds() - schedule_start_, measure_.steps++;
  if (one_micro_ > 0)
    measure_.peak_in_flight =
        std::max(measure_.peak_in_flight, (int)std::lround((double)peak_ / one_micro_));
}

static RoundingStats g_rounding[2];  // forward, backward (observation only)
RoundingStats& rounding_stats(bool backward) {
  return g_rounding[backward];
}
void reset_rounding_stats() {
  g_rounding[0] = g_rounding[1] = RoundingStats{};
}
