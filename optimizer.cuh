// optimizer.cuh: AdamW over the flat parameter buffer, and the learning-rate schedule.
// Adam keeps two fp32 moments per parameter: the 8 bytes of the book's 16 bytes per
// parameter (Playbook §2.4: 4 weights + 4 gradients + 8 optimizer).
#pragma once
#include "model.cuh"
#include "ops.cuh"

struct Optimizer {
  AdamWConfig hp;
  float weight_decay = 0.1f;
  Tensor exp_avg, exp_avg_sq;  // [num_params] flat, Mem::Optimizer
  std::vector<NamedTensor> named_exp_avg, named_exp_avg_sq;  // views, the parameters' names
  int64_t step = 0;                                          // updates taken so far
};
Optimizer build_optimizer(const Model& model, const AdamWConfig& hp, float weight_decay);
// One AdamW update of every parameter from model.grads; decay applies to matrices only
// (norm weights are not decayed, as in GPT-2, llm.c and Megatron).
void optimizer_step(const Context& ctx, Model& model, Optimizer& opt, float lr);

struct LrSchedule {
  float max_lr = 1e-3f, min_lr = 1e-4f;
  int warmup = 0, total = 1;
};
// Linear warmup over `warmup` steps, then cosine decay to min_lr at step `total`.
float learning_rate(const LrSchedule& s, int64_t step);
