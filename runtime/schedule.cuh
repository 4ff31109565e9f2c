// schedule.cuh: the order in which a training step runs its micro-batches (DESIGN 6,
// "Schedule"). Without a pipeline it is gradient accumulation (Playbook §2.7): forward and
// backward of each micro-batch in turn, the gradient sync's hooks around every unit. The one
// place a pipeline schedule (AFAB, 1F1B, interleaved, zero-bubble) takes over.
#pragma once
#include <cstdint>

#include "runtime/gradient_sync.cuh"

struct PipelineConfig;  // pipeline_parallel.cuh
struct PipelineMeasure;

// This rank's part of one step's global batch: micro_batches x mbs sequences of seq tokens.
struct StepBatch {
  const int32_t* inputs;   // host [micro_batches * mbs * seq]
  const int32_t* targets;  // host [micro_batches * mbs * seq]
  int micro_batches, mbs, seq;
  const Fault* fault = nullptr;  // --fault: checked before every forward and backward
  int64_t step = 0;
  void fault_at(FaultWhere where, int world_rank) const {
    if (fault) fault->at(where, world_rank, step);
  }
};
struct StepStats {
  double loss_sum = 0;       // summed per-token losses of this rank's micro-batches
  int64_t block_bytes = -1;  // one block's saved activations, measured on the first one
};
// Runs every micro-batch of the step through `model`; loss_scale turns each micro-batch's
// summed loss into its share of the step's mean (DESIGN 5). Spans go to `trace`. With a pp
// group of more than one rank, the pipeline's schedule (pipeline_parallel.cu) runs instead.
StepStats run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                       const StepBatch& batch, Recompute mode, float loss_scale, Trace& trace,
                       const PipelineConfig& pipeline, PipelineMeasure* measure);
