// optimizer.cuh: AdamW over the slices of the flat buffers a rank updates, the one weight-decay
// rule, and the learning-rate schedule. Adam keeps two fp32 moments per parameter: the 8 bytes
// of the book's 16 bytes per parameter (Playbook §2.4: 4 weights + 4 gradients + 8 optimizer).
#pragma once
#include "runtime/ops.cuh"
#include "runtime/parameters.cuh"

// A run of one parameter that this rank updates: `count` contiguous floats of its weights, its
// gradient and its two Adam moments. Plain data parallelism has one slice per parameter; ZeRO
// one per (parameter, unit shard) overlap. The gradient is fp32, or bf16 under
// --grad-acc-dtype bf16 (data_parallel.cu widens it for the update).
struct ParamSlice {
  float* param;
  void* grad;
  float *exp_avg, *exp_avg_sq;
  int64_t count = 0;
  int unit = 0;          // the model unit it belongs to
  bool decay = false;    // weight decay applies (weight_decays)
  bool counted = false;  // in the gradient norm: one copy of a weight several tp ranks hold
  DType grad_dtype = DType::F32;
  Tensor copy;  // mixed precision: the weights' compute copy [count], refreshed by the update
};
// Matrices decay; norm weights do not (as in GPT-2, llm.c and Megatron).
bool weight_decays(const Tensor& param);

// Adam's two moments for n parameters: fp32, zeroed, Mem::Optimizer.
struct AdamMoments {
  Tensor exp_avg, exp_avg_sq;  // [n] each
};
AdamMoments adam_moments(int64_t n, Device device);
// One slice per parameter, for a model whose flat buffers hold all of its parameters (plain
// data parallelism, one process); `moments` laid out like model.params.
std::vector<ParamSlice> whole_model_slices(const FlatParameters& model, const AdamMoments& moments);

struct AdamW {
  AdamWConfig hp;
  float weight_decay = 0.1f;
  int64_t steps = 0;  // updates taken so far; the caller counts them, update() reads them
  // One AdamW update of one slice at learning rate lr (Loshchilov & Hutter, decoupled decay).
  // A bf16 gradient is widened into fp32 first (and multiplied by grad_scale, a factor kept
  // aside for it: clipping); an fp32 one is read as it is (grad_scale must be 1).
  void update(const Context& ctx, const ParamSlice& s, float lr, float grad_scale = 1.0f) const;
  // The same on `count` slices: those with fp32 gradients in one launch (adamw_update_many),
  // the same arithmetic.
  void update(const Context& ctx, const ParamSlice* slices, size_t count, float lr,
              float grad_scale = 1.0f) const;
};

struct LrSchedule {
  float max_lr = 1e-3f, min_lr = 1e-4f;
  int warmup = 0, total = 1;
};
// Linear warmup over `warmup` steps, then cosine decay to min_lr at step `total`.
float learning_rate(const LrSchedule& s, int64_t step);
