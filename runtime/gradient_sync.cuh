// gradient_sync.cuh: what keeps the data-parallel replicas in step (DESIGN 6, "Gradient sync").
// One interface, implemented by plain data parallelism (data_parallel.cu: naive, bucket, ring)
// and by ZeRO-1/2/3 (zero.cu): train.cu holds one, chosen by flags, and never asks which.
// Each owns the gradients' sum over dp_cp, the optimizer state and the weights' memory.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/model_config.cuh"
#include "runtime/optimizer.cuh"
#include "runtime/parameters.cuh"

// Gradients kept in bf16 (--grad-acc-dtype bf16): while a unit's backward runs, its gradient
// views point at an fp32 accumulator that starts from the bf16 sum so far; once no backward
// holds the unit any more, the accumulator is rounded back into the bf16 buffer. Counted,
// because a zero-bubble pipeline runs the next micro-batch's backward of a unit before the
// weight gradients of the previous one, and a tied LM head writes the embedding's gradient.
class Bf16Accumulators {
 public:
  // `bf16_unit(u)`: where unit u's gradient lives in bf16, laid out as in the flat buffer.
  Bf16Accumulators(FlatParameters& model, std::function<Tensor(int)> bf16_unit);
  void hold(const Context& ctx, int unit);  // this unit's, and a tied head's embedding's
  void drop(const Context& ctx, int unit);

 private:
  FlatParameters& model_;
  std::function<Tensor(int)> bf16_unit_;
  std::vector<Tensor> acc_;
  std::vector<int> holders_;
};

class GradientSync {
 public:
  // `model` is a layout (build_model_layout): the implementation allocates what it keeps.
  GradientSync(Comm& comm, FlatParameters& model, const AdamWConfig& hp, float weight_decay);
  virtual ~GradientSync() = default;
  const FlatParameters& parameters() const { return model_; }

  // ---- one training step, in this order (DESIGN 7) ----
  virtual void begin_step(const Context& ctx) = 0;  // zeroes the gradients
  // The unit hooks for one micro-batch's forward and backward (Playbook §3.2-§3.4, §4.2-§4.4).
  virtual UnitHooks hooks(const Context& ctx, bool last_micro_batch) = 0;
  virtual double finish(const Context& ctx) = 0;  // gradients summed; returns seconds blocked
  // The global L2 norm of the gradient (Playbook §2.3): every parameter once, whichever ranks
  // hold it, summed over dp_cp when sharded and over every group that splits the model (tp);
  // then every gradient scaled by max_norm / norm when the norm exceeds max_norm > 0.
  float clip_grad_norm(const Context& ctx, float max_norm);
  // Every gradient this rank holds times alpha (fp16: dividing out the loss scale; clipping).
  // bf16 gradients keep the factor and AdamW applies it in fp32 as it widens them, rather than
  // rounding every gradient once more (the norm is taken before: fp16's loss scale, the one
  // scaling before clipping, is refused with bf16 gradients).
  void scale_gradients(const Context& ctx, float alpha);
  // Testing fp16 loss scaling (--fault inf): an infinity in this rank's first gradient.
  void poison_gradient(const Context& ctx);
  virtual void step(const Context& ctx, float lr) = 0;  // AdamW on what this rank updates
  DType grad_dtype() const { return grad_dtype_; }      // F32, or BF16 (--grad-acc-dtype bf16)

  // ---- the whole model for evaluation and sampling (ZeRO-3 gathers it: collective) ----
  virtual void gather_weights(const Context&) {}
  virtual void release_weights() {}

  // ---- checkpoints hold whole tensors, whatever the layout (collective) ----
  // `cfg` goes into config.json.
  // `steps_done`: the training steps taken, the step a resume starts at (optimizer.safetensors'
  // "step"); AdamW's own count, lower when fp16 skipped steps, is kept beside it as
  // "adam_steps". `run_state`: more of the run to resume it exactly (fp16's loss scale), kept
  // in the same metadata.
  void save(const Context& ctx, const std::string& dir, const ModelConfig& cfg, int64_t steps_done,
            DType weights_dtype = DType::F32,
            const std::map<std::string, std::string>& run_state = {});
  void save_gradients(const Context& ctx, const std::string& path, int64_t step);
  // Every rank reads the whole files and keeps its part, so any layout resumes any other.
  // Returns the training step to resume at (0 when the directory has no optimizer state);
  // `run_state`, when given, gets optimizer.safetensors' metadata.
  int64_t load(const std::string& dir, std::map<std::string, std::string>* run_state = nullptr);

  // ---- measurements ----
  virtual int zero_stage() const { return 0; }
  virtual std::string describe() const = 0;  // the configuration table's row
  virtual int64_t padded_params() const { return model_.num_params; }  // Ψ' (ZeRO's padding)
  // Bytes of fp32 master weights kept apart from the weights the model computes with (mixed
  // precision): a kept copy's master, or ZeRO-1/2's master shard; 0 when the model's own
  // weights are what the optimizer updates.
  virtual int64_t master_bytes() const = 0;
  // This step's collectives on the trace's communication track (--trace), each from its launch
  // until its completion was seen.
  void trace_communication(Trace& trace) const;
  // Its own collectives next to its formula (rank 0 prints): `measured`, dp_cp's traffic over
  // `steps` training steps.
  virtual void print_comm_report(int, const CollStats*, int64_t) const {}

 protected:
  enum class Part { Params, Grads, ExpAvg, ExpAvgSq };
  // What this rank holds of one unit of the flat state: `tensor`, in its own dtype, whose
  // elements [0, count) are the unit's elements [first, first + count); any past `count` are
  // padding, neither saved nor loaded. `split_over`: the group (the unit's, group_of) whose
  // ranks each hold such a piece, the pieces together covering the unit; nullptr when this
  // rank holds the unit whole (first 0, count numel), like every rank of the unit's group.
  struct Piece {
    Tensor tensor;
    int64_t first = 0, count = 0;
    Group* split_over = nullptr;
  };
  // How this rank holds `part`, which is all a checkpoint asks of a gradient sync: each holding
  // a copy of it, one piece per unit. A save reads the first; a load writes them all (the fp32
  // master weights and their bf16 copy alike).
  using Holding = std::function<Piece(int unit)>;
  virtual std::vector<Holding> holdings(Part part) const = 0;
  virtual void scale_grads(const Context& ctx, float alpha) = 0;
  virtual bool grads_sharded() const = 0;  // each dp_cp rank holds a slice of the gradient
  // Waits for `h`, launched at `start`, and keeps its span for the trace; returns the seconds
  // the host was blocked on it: communication the step exposes.
  double wait_traced(Handle& h, const std::string& name, double start);

  // The group unit u's gradients are summed over: dp_cp, or edp_cp for expert units (the ranks
  // that hold the same experts; runtime/comm.cuh).
  Group& group_of(int u) const { return model_.units[u].experts ? comm_.edp_cp : comm_.dp_cp; }

  Comm& comm_;
  FlatParameters& model_;
  AdamW adamw_;
  std::vector<ParamSlice> slices_;  // what this rank's optimizer updates
  DType grad_dtype_ = DType::F32;   // of the gradient buffers (--grad-acc-dtype)
  float pending_scale_ = 1.0f;      // bf16 gradients: the factor not yet applied (reset per step)
  std::vector<Trace::Span> comm_spans_;  // this step's collectives (cleared by begin_step)

 private:
  Tensor gather_flat(const Context& ctx, Part part);
  std::vector<NamedTensor> whole_named(const Tensor& flat);
  void load_flat(Part part, const Tensor& whole);
};
