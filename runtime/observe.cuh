// observe.cuh: what a run measures and where it fails on purpose, kept out of the algorithms
// (DESIGN 2): the engine that runs a step's schedule calls an Observer around each operation,
// and the Observer records the trace's spans (Chrome trace colours by kind), the busy time and
// the activation memory the schedule holds (--report bubble), the first block's saved bytes
// (--report memory), and fires --fault where the run asked for it.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>

#include "runtime/core.cuh"

// --fault KIND:RANK:STEP[:WHERE] , for testing that a failed rank never
// hangs the job: at place WHERE of step STEP, rank RANK kills itself (crash), stops answering
// (hang) or fails a check (error); kind inf puts an infinity into its gradient instead. The
// places, in the order a run passes them (Init: before the communicators are set up; Finalize:
// at the job's end, inside MPI_Finalize's bound; both step 0 only):
enum class FaultWhere {
  Init,
  Step,
  Forward,
  Backward,
  Clip,
  Optimizer,
  Validation,
  Save,
  Finalize
};
const char* fault_where_name(FaultWhere w);  // "step", "forward", ...
struct Fault {
  std::string kind;  // crash | hang | error; empty: no fault
  int rank = 0;
  int64_t step = 0;
  FaultWhere where = FaultWhere::Step;
  // Called at each place: fires when this rank, step and place are the fault's.
  void at(FaultWhere here, int world_rank, int64_t now) const;
  // Kind inf (fp16 loss scaling's test): this rank's gradient gets an infinity after the
  // backward of this step, as an fp16 overflow would put there.
  bool injects_inf(int world_rank, int64_t now) const {
    return kind == "inf" && rank == world_rank && step == now;
  }
};
// --fault KIND:RANK:STEP[:WHERE] as a Fault; throws UsageError naming --fault.
Fault parse_fault(const std::string& flag_value);
// The places a run passes, for check_fault_fires. STEP counts from 0, as --fault does.
struct FaultPlaces {
  int world = 1;
  bool trains = true;                             // false: --score, which takes no step
  int64_t first_step = 0, end = 0;                // the training steps run: [first_step, end)
  std::function<bool(int64_t)> validates, saves;  // after step s: validation; a checkpoint
  std::string precision;                          // "fp32", ...: what inf meets
  bool skips_overflow = false;  // fp16 loss scaling: an inf gradient skips the step
  std::string schedule;         // how the steps were set, for the message ("--steps 3")
};
// Throws UsageError naming --fault and why when the fault can never fire in this run (a test
// relying on it would pass without it): a rank past the grid, a step the run does not take, a
// place it does not pass at that step (no save, no validation, init or finalize at a step other
// than 0), inf without fp16's loss scaling to meet it, or a hang on one rank (no peer waits for
// it, so nothing would end it).
void check_fault_fires(const Fault& f, const std::string& flag_value, const FaultPlaces& run);
// The last of those checks alone (a hang on one rank), for a fault at init, which fires before
// check_fault_fires can run.
void check_fault_has_peer(const Fault& f, const std::string& flag_value, int world);

// What rounding did to the values stored by the forward and by the backward: how many were
// nonzero, how many of those became zero (underflow: fp16's 6e-8 floor) and how many became
// infinite (overflow: past 65504). Counted on CPU ranks only; observation, like MemoryStats.
struct RoundingStats {
  uint64_t nonzero = 0, flushed = 0, overflowed = 0;
  double flushed_share() const { return nonzero ? (double)flushed / nonzero : 0.0; }
  void add(float before, float after) {  // one value rounded
    nonzero += before != 0.0f;
    flushed += before != 0.0f && after == 0.0f;
    overflowed += std::isfinite(before) && std::isinf(after);
  }
  void add(const RoundingStats& o) {
    nonzero += o.nonzero, flushed += o.flushed, overflowed += o.overflowed;
  }
};
// (mixed_precision.cu's round_ counts; the precision policy logs the backward's flushed share.)
RoundingStats& rounding_stats(bool backward);
void reset_rounding_stats();

// What an operation of a schedule does (pipeline_parallel.cuh's tables): a micro-batch's
// forward, its backward (or, zero-bubble, only the input-gradient half of it), or the deferred
// weight-gradient half.
enum class Phase { Forward, Backward, Weight };

// What the schedule of the training steps measured on this rank (--report bubble, memory).
struct ScheduleMeasure {
  double busy_s = 0, step_s = 0;  // forward/backward time, and whole schedule time
  int steps = 0;
  int peak_in_flight = 0;    // most micro-batch chunks' activations held, from the memory held
  int64_t block_bytes = -1;  // one block's saved activations, measured on the first forward
};

// Nsight Systems' view of the trace (NVTX ranges, as llm.c and Megatron-Core mark their steps):
// every compute span of --trace is also an NVTX range of its name, pushed when its work begins
// and popped when it ends, so a profile of a training run shows the same timeline. NVTX is
// header-only and costs a branch when no profiler is attached.
void range_push(const std::string& name);
void range_pop();

class Observer {
 public:
  Observer() = default;
  Observer(int world_rank, Fault fault, bool trace) : rank_(world_rank), fault_(fault) {
    trace_.enabled = trace;
  }
  // ---- places of a step (--fault) ----
  void at(FaultWhere where, int64_t step) const { fault_.at(where, rank_, step); }
  bool injects_inf(int64_t step) const { return fault_.injects_inf(rank_, step); }
  // ---- around one step's schedule, and each of its operations ----
  // `measured`: a training step (validation and generation schedules are not measured).
  void begin_schedule(int64_t step, bool measured);
  // Before the operation: --fault at the forward / backward, and its range.
  void before(Phase phase, int micro, int chunk, int chunks) const;
  // After the operation: its span (chunk shown when the rank holds several), the busy time and
  // the activation memory held; `block_bytes`, one block's saved activations after a forward.
  void after(Phase phase, int micro, int chunk, int chunks, double start, int64_t block_bytes);
  void end_schedule();
  const ScheduleMeasure& schedule() const { return measure_; }
  // ---- the trace (--trace) ----
  Trace& trace() { return trace_; }
  // A span whose work begins now: its range is pushed and the time returned; end_span pops the
  // range and records the span (its name may say more than the range's, e.g. what it counted).
  double begin_span(const std::string& name) const {
    range_push(name);
    return now_seconds();
  }
  void end_span(const std::string& name, Track track, double start) {
    range_pop();
    trace_.add(name, track, start, now_seconds());
  }

 private:
  int rank_ = 0;
  Fault fault_;
  Trace trace_;
  ScheduleMeasure measure_;
  int64_t step_ = 0;
  bool measured_ = false;
  double schedule_start_ = 0, busy_ = 0;
  size_t acts_base_ = 0, one_micro_ = 0, peak_ = 0;
};
