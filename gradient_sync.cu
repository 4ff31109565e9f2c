// gradient_sync.cu: what every gradient sync shares: the global gradient norm and clipping,
// and checkpoints of whole tensors (DESIGN 6, "Gradient sync").
// The one idea: whichever way the replicas are kept in step, clipping and checkpoints see the
// model as one process would: each weight once, whole.
#include <cmath>

#include "checkpoint.cuh"
#include "gradient_sync.cuh"

GradientSync::GradientSync(Comm& comm, Model& model, const AdamWConfig& hp, float weight_decay)
    : comm_(comm), model_(model) {
  adamw_.hp = hp;
  adamw_.weight_decay = weight_decay;
}

float GradientSync::clip_grad_norm(const Context& ctx, float max_norm) {
  std::vector<Tensor> grads;
  for (const ParamSlice& s : slices_)
    if (s.counted) grads.push_back(Tensor{nullptr, s.grad, {s.count}, DType::F32, ctx.device});
  double squares = 0;
  for (float part : sum_squares_each(ctx, grads)) squares += part;  // one trip to the host
  if (grads_sharded()) all_reduce_host(comm_.dp_cp, &squares, 1, ReduceOp::Sum);
  all_reduce_host(comm_.tp, &squares, 1, ReduceOp::Sum);  // the groups that split the model
  float norm = (float)std::sqrt(squares);
  if (max_norm > 0.0f && norm > max_norm) scale_grads(ctx, max_norm / norm);
  return norm;
}

void GradientSync::save(const Context& ctx, const std::string& dir) {
  Tensor weights = gather_flat(ctx, Part::Params);
  Tensor m = gather_flat(ctx, Part::ExpAvg), v = gather_flat(ctx, Part::ExpAvgSq);
  if (comm_.dp_cp.rank != 0) return;  // then the tp shards come together on world rank 0
  std::vector<NamedTensor> whole = whole_tensors(model_, named_views(model_, weights));
  OptimizerState state{whole_tensors(model_, named_views(model_, m)),
                       whole_tensors(model_, named_views(model_, v)), adamw_.steps};
  if (comm_.grid.world_rank == 0) save_checkpoint(dir, model_.cfg, whole, &state);
}

void GradientSync::save_gradients(const Context& ctx, const std::string& path, int64_t step) {
  Tensor grads = gather_flat(ctx, Part::Grads);
  if (comm_.dp_cp.rank != 0) return;
  std::vector<NamedTensor> whole = whole_tensors(model_, named_views(model_, grads));
  if (comm_.grid.world_rank == 0) write_safetensors(path, whole, {{"step", std::to_string(step)}});
}

int64_t GradientSync::load(const std::string& dir) {
  int64_t n = model_.num_params;
  Tensor weights = empty({n}, Mem::Workspace, Device::CPU);
  Tensor m = zeros({n}, Mem::Workspace, Device::CPU), v = zeros({n}, Mem::Workspace, Device::CPU);
  OptimizerState state{named_views(model_, m), named_views(model_, v), 0};
  bool with_optimizer = load_checkpoint_shards(model_, dir, named_views(model_, weights), &state);
  load_flat(Part::Params, weights);
  load_flat(Part::ExpAvg, m);
  load_flat(Part::ExpAvgSq, v);
  adamw_.steps = with_optimizer ? state.step : 0;
  return adamw_.steps;
}
