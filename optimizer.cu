// optimizer.cu: AdamW on the flat parameter buffer and the warmup + cosine schedule.
// The one idea: the optimizer state is two more copies of the parameters (m and v), which is
// why it dominates static memory, and why ZeRO shards it first (Playbook §4).
#include "optimizer.cuh"

#include <cmath>

Optimizer build_optimizer(const Model& model, const AdamWConfig& hp, float weight_decay) {
  Optimizer opt;
  opt.hp = hp;
  opt.weight_decay = weight_decay;
  Device d = model.params.device;
  opt.exp_avg = zeros(model.params.shape, Mem::Optimizer, d);
  opt.exp_avg_sq = zeros(model.params.shape, Mem::Optimizer, d);
  opt.named_exp_avg = named_views(model, opt.exp_avg);
  opt.named_exp_avg_sq = named_views(model, opt.exp_avg_sq);
  return opt;
}

void optimizer_step(const Context& ctx, Model& model, Optimizer& opt, float lr) {
  opt.step++;
  for (size_t i = 0; i < model.named_params.size(); i++) {
    const Tensor& p = model.named_params[i].tensor;
    float wd = p.dim() >= 2 ? opt.weight_decay : 0.0f;
    adamw_update(ctx, p.f32(), model.named_grads[i].tensor.f32(),
                 opt.named_exp_avg[i].tensor.f32(), opt.named_exp_avg_sq[i].tensor.f32(),
                 p.numel(), opt.hp, lr, wd, (int)opt.step);
  }
}

float learning_rate(const LrSchedule& s, int64_t step) {
  if (step < s.warmup) return s.max_lr * (float)(step + 1) / (float)s.warmup;
  double progress = (double)(step - s.warmup) / std::max(1, s.total - s.warmup);
  progress = std::min(1.0, progress);
  return (float)(s.min_lr + 0.5 * (s.max_lr - s.min_lr) * (1.0 + std::cos(M_PI * progress)));
}
