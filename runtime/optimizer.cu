// optimizer.cu: AdamW on slices of the flat buffers, and the warmup + cosine schedule.
// The one idea: the optimizer state is two more copies of the parameters (m and v), which is
// why it dominates static memory, and why ZeRO shards it first (Playbook §4).
#include <cmath>

#include "runtime/dtype.cuh"
#include "runtime/optimizer.cuh"

bool weight_decays(const Tensor& param) {
  return param.dim() >= 2;
}

AdamMoments adam_moments(int64_t n, Device device) {
  return {zeros({n}, Mem::Optimizer, device), zeros({n}, Mem::Optimizer, device)};
}

std::vector<ParamSlice> whole_model_slices(const FlatParameters& model,
                                           const AdamMoments& moments) {
  std::vector<ParamSlice> slices;
  for (int u = 0; u < (int)model.units.size(); u++)
    for (int p = model.units[u].first; p < model.units[u].first + model.units[u].count; p++) {
      const Tensor& t = model.named_params[p].tensor;
      int64_t at = model.offsets[p];
      slices.push_back({model.params.f32() + at, model.grads.view(at, {t.numel()}).ptr,
                        moments.exp_avg.f32() + at, moments.exp_avg_sq.f32() + at, t.numel(), u,
                        weight_decays(t), model.layouts[p].writer, model.grads.dtype});
    }
  return slices;
}

void AdamW::update(const Context& ctx, const ParamSlice& s, float lr, float grad_scale) const {
  Tensor grad{nullptr, s.grad, {s.count}, s.grad_dtype, ctx.device};
  if (s.grad_dtype != DType::F32) {  // one parameter at a time: a small fp32 workspace
    Tensor wide = empty(ctx, {s.count}, Mem::Workspace);
    cast_(ctx, wide, grad);
    if (grad_scale != 1.0f) scale_(ctx, wide, grad_scale);
    grad = wide;
  } else {
    PICO_ASSERT(grad_scale == 1.0f, "fp32 gradients are scaled in place");
  }
  adamw_update(ctx, s.param, grad.f32(), s.exp_avg, s.exp_avg_sq, s.count, hp, lr,
               s.decay ? weight_decay : 0.0f, (int)steps, s.copy);
}

void AdamW::update(const Context& ctx, const ParamSlice* slices, size_t count, float lr,
                   float grad_scale) const {
  std::vector<AdamWSlice> fused;
  DType copy_dtype = DType::BF16;
  for (size_t i = 0; i < count; i++) {
    const ParamSlice& s = slices[i];
    if (s.grad_dtype != DType::F32) {  // widened one at a time (above)
      update(ctx, s, lr, grad_scale);
      continue;
    }
    PICO_ASSERT(grad_scale == 1.0f, "fp32 gradients are scaled in place");
    if (s.copy.defined()) copy_dtype = s.copy.dtype;
    fused.push_back({s.param, (const float*)s.grad, s.exp_avg, s.exp_avg_sq, s.count,
                     s.decay ? weight_decay : 0.0f,
                     s.copy.defined() ? (uint16_t*)s.copy.ptr : nullptr});
  }
  if (!fused.empty()) adamw_update_many(ctx, fused, hp, lr, (int)steps, copy_dtype);
}

float learning_rate(const LrSchedule& s, int64_t step) {
  if (step < s.warmup) return s.max_lr * (float)(step + 1) / (float)s.warmup;
  double progress = (double)(step - s.warmup) / std::max(1, s.total - s.warmup);
  progress = std::min(1.0, progress);
  return (float)(s.min_lr + 0.5 * (s.max_lr - s.min_lr) * (1.0 + std::cos(M_PI * progress)));
}
