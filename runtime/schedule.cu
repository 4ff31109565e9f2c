// schedule.cu: gradient accumulation, the schedule of one pipeline stage (Playbook §2.7).
// The one idea: micro-batches add their gradients into the same buffers, so a step of
// grad_acc x mbs sequences costs the activation memory of mbs; only the last micro-batch's
// backward needs to communicate.
#include <string>

#include "pipeline_parallel.cuh"
#include "runtime/schedule.cuh"

StepStats run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                       const StepBatch& batch, Recompute mode, float loss_scale, Trace& trace,
                       const PipelineConfig& pipeline, PipelineMeasure* measure) {
  if (comm.pp.size > 1)
    return run_pipeline(ctx, comm, model, sync, batch, mode, loss_scale, trace, pipeline, measure);
  StepStats stats;
  int64_t tokens = (int64_t)batch.mbs * batch.seq;  // per micro-batch
  for (int micro = 0; micro < batch.micro_batches; micro++) {
    UnitHooks hooks = sync.hooks(ctx, micro == batch.micro_batches - 1);
    Activations acts;
    double tf = now_seconds();
    batch.fault_at(FaultWhere::Forward, comm.grid.world_rank);
    stats.loss_sum +=
        model_forward(ctx, model, acts, batch.inputs + micro * tokens,
                      batch.targets + micro * tokens, batch.mbs, batch.seq, mode, hooks);
    double tb = now_seconds();
    trace.add("forward " + std::to_string(micro), Track::Compute, tf, tb);
    if (stats.block_bytes < 0 && !acts.blocks.empty())
      stats.block_bytes = saved_bytes(acts.blocks[0]);
    batch.fault_at(FaultWhere::Backward, comm.grid.world_rank);
    model_backward(ctx, model, acts, loss_scale, mode, hooks);
    trace.add("backward " + std::to_string(micro), Track::Compute, tb, now_seconds());
  }
  return stats;
}
