// meters.cuh: what a run measures of its training steps and prints at its end (--report), kept
// out of the step (DESIGN 2). Each part of the run that measures something (the gradient sync's
// traffic, a mixture's routing, the ring's work, the host synchronisations) is a StepMeter that
// the composition registers once; the training step tells every meter where it is and the end
// of the run asks each for the reports the user asked for, never asking which meters there are.
#pragma once
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/observe.cuh"

enum class Report { Memory, Comm, Bubble, Sync, Balance, Experts, Roofline };  // --report

// The parts of one training step, each inside the one before it but the last.
enum class StepPart {
  Step,       // the whole optimizer step
  Gradients,  // the gradient sync's begin_step, the micro-batches, its finish
  Schedule,   // the micro-batches' forwards and backwards (run_schedule)
  Optimizer,  // the optimizer step (ZeRO gathers the updated weights in it)
};

// What a step's log line shows after its loss (" | aux 2.0189") and adds to its --log-json line.
struct StepLog {
  std::string after_loss;
  nlohmann::json fields = nlohmann::json::object();
};

class StepMeter {
 public:
  virtual ~StepMeter() = default;
  virtual void begin(StepPart, int64_t /*step, counted from 0*/) {}
  virtual void end(StepPart) {}
  // Once the step's loss is summed, on every rank (it may reduce over a group): its log's part.
  virtual void log(StepLog&) {}
  // At the end of the run, once per report asked, in the order asked; every rank calls it
  // (collective reports gather to rank 0, which prints).
  virtual void report(Report) {}
  // Whether report(r) prints a part of this run's: a report no meter answers is refused before
  // the first step (--report balance without a ring, say), rather than printing nothing.
  virtual bool answers(Report) const { return false; }
};

// The meters of a run, in the order they were registered: each report prints its meters' parts
// in that order.
class StepMeters {
 public:
  void add(std::unique_ptr<StepMeter> meter);       // null: nothing to measure
  void add(Report r, std::function<void()> print);  // a report that measures nothing itself
  void begin(StepPart part, int64_t step);
  void end(StepPart part);
  void log(StepLog& log);
  void report(const std::vector<Report>& asked);
  bool answers(Report r) const;  // does any meter?

 private:
  std::vector<std::unique_ptr<StepMeter>> meters_;
};

// What group g's collectives sent during `parts` of the training steps (each part's windows
// summed): a comm report's measured column, without validation's or checkpoints' traffic.
class GroupTraffic : public StepMeter {
 public:
  GroupTraffic(const Group& g, std::vector<StepPart> parts) : group_(g), parts_(std::move(parts)) {}
  void begin(StepPart p, int64_t) override;
  void end(StepPart p) override;
  const CollStats* total() const { return meter_.total; }
  int64_t steps() const { return steps_; }  // training steps measured

 private:
  const Group& group_;
  std::vector<StepPart> parts_;
  TrafficMeter meter_;
  int64_t steps_ = 0;
};

// The host's waits for the device per training step (count_host_sync, core.cuh): each drains the
// GPU's queue, so the fewer the better (--report sync); and each step's span in the trace.
class HostSyncs : public StepMeter {
 public:
  // device_buffers: CUDA and meta, whose buffers come from the arena (CPU ones do not).
  HostSyncs(Observer& observer, bool prints, bool device_buffers)
      : observer_(observer), prints_(prints), device_buffers_(device_buffers) {}
  void begin(StepPart p, int64_t step) override;
  void end(StepPart p) override;
  void report(Report r) override;
  bool answers(Report r) const override { return r == Report::Sync; }

 private:
  Observer& observer_;
  bool prints_;  // rank 0
  bool device_buffers_;
  int64_t steps_ = 0, step_ = 0;
  double start_ = 0;
  // Fewest and most in a step after the first, which may also fill the pinned staging buffers
  // (core.cu's from_host: a cudaMallocHost is a wait) and so is told apart when it waits more.
  uint64_t at_start_ = 0, first_ = 0, fewest_ = UINT64_MAX, most_ = 0;
  // The device allocator's calls (core.cuh's allocator_calls), most in a step after the first
  // (which fills the arena).
  uint64_t allocations_at_start_ = 0, first_allocations_ = 0, most_allocations_ = 0;
};
