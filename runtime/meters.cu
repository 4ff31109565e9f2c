// meters.cu: the training step's meters (meters.cuh): the list the composition registers, a
// group's traffic over parts of the steps, the host synchronisations per step.
#include <algorithm>

#include "runtime/meters.cuh"

void StepMeters::add(std::unique_ptr<StepMeter> meter) {
  if (meter) meters_.push_back(std::move(meter));
}
void StepMeters::add(Report r, std::function<void()> print) {
  struct Printer : StepMeter {
    Report which;
    std::function<void()> print;
    void report(Report asked) override {
      if (asked == which) print();
    }
    bool answers(Report r) const override { return r == which; }
  };
  auto p = std::make_unique<Printer>();
  p->which = r, p->print = std::move(print);
  meters_.push_back(std::move(p));
}
void StepMeters::begin(StepPart part, int64_t step) {
  for (auto& m : meters_) m->begin(part, step);
}
void StepMeters::end(StepPart part) {
  for (auto& m : meters_) m->end(part);
}
void StepMeters::log(StepLog& log) {
  for (auto& m : meters_) m->log(log);
}
void StepMeters::report(const std::vector<Report>& asked) {
  for (Report r : asked)
    for (auto& m : meters_) m->report(r);
}

bool StepMeters::answers(Report r) const {
  return std::any_of(meters_.begin(), meters_.end(), [r](auto& m) { return m->answers(r); });
}

void GroupTraffic::begin(StepPart p, int64_t) {
  if (std::find(parts_.begin(), parts_.end(), p) != parts_.end()) meter_.open(group_);
}
void GroupTraffic::end(StepPart p) {
  if (std::find(parts_.begin(), parts_.end(), p) != parts_.end()) meter_.close(group_);
  if (p == StepPart::Step) steps_++;
}

void HostSyncs::begin(StepPart p, int64_t step) {
  if (p != StepPart::Step) return;
  step_ = step;
  start_ = observer_.begin_span("step " + std::to_string(step + 1));
  at_start_ = host_syncs();
  allocations_at_start_ = allocator_calls();
}
void HostSyncs::end(StepPart p) {
  if (p != StepPart::Step) return;
  const uint64_t syncs = host_syncs() - at_start_;
  const uint64_t allocations = allocator_calls() - allocations_at_start_;
  if (steps_ == 0) {
    first_ = syncs;
    first_allocations_ = allocations;
  } else {
    fewest_ = std::min(fewest_, syncs);
    most_ = std::max(most_, syncs);
    most_allocations_ = std::max(most_allocations_, allocations);
  }
  steps_++;
  observer_.end_span(
      "step " + std::to_string(step_ + 1) + " (" + std::to_string(syncs) + " host syncs)",
      Track::Compute, start_);
}
void HostSyncs::report(Report r) {
  if (r != Report::Sync || !prints_ || steps_ == 0) return;
  // One step: its count. More: the most after the first, and the first where it waited more.
  const uint64_t most = steps_ == 1 ? first_ : most_, fewest = steps_ == 1 ? first_ : fewest_;
  std::string notes = fewest == most ? "" : " (fewest " + std::to_string(fewest) + ")";
  if (steps_ > 1 && first_ > most_) notes += " (the first step: " + std::to_string(first_) + ")";
  printf("host synchronisations per training step: %llu%s\n", (unsigned long long)most,
         notes.c_str());
  if (device_buffers_ && steps_ > 1)
    printf(
        "device allocator calls: %llu in the first training step, %llu per step after it (the "
        "arena reuses the first step's buffers)\n",
        (unsigned long long)first_allocations_, (unsigned long long)most_allocations_);
}
