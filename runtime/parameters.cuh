// parameters.cuh: a model's parameters as the gradient sync, the optimizer and checkpoints see
// them (DESIGN 5, 6): named tensors one after the other in one flat buffer (their gradients in
// another), grouped in units (the embedding, one block, the head) that the hooks and ZeRO's
// shards work on, each tensor this rank's shard of a whole one. model.cu's Model is one; the
// runtime knows no more of it than this.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core.cuh"

struct NamedTensor {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Tensor tensor;
};

// Where this rank's shard of a weight sits in the whole tensor: the block of rows
// [row0, row0 + rows) and columns [col0, col0 + cols) of the whole [full_rows, full_cols] matrix
// (a 1-D weight is one row). Tensor parallelism splits rows for column-parallel layers and
// columns for row-parallel ones, nothing for norms. `writer`: the one rank whose copy goes into
// a checkpoint when several hold the same block (norms; replicated key/value heads).
struct TpSlice {
  std::vector<int64_t> full_shape;
  int64_t row0 = 0, col0 = 0;
  bool writer = true;
  int64_t full_cols() const { return full_shape.size() > 1 ? full_shape[1] : full_shape[0]; }
  bool whole(const Tensor& shard) const;  // the shard is the full tensor
};

// A unit: the parameters one hook covers (the embedding, one block, or the head: final norm and
// LM head unless tied), a contiguous slice of the flat buffer. Data parallelism reduces, and
// ZeRO gathers, one unit at a time. Units are in forward order: u + 1 runs after u.
struct ModelUnit {
  std::string name;               // "embedding", "block 3", "head"
  int64_t offset = 0, numel = 0;  // its slice [offset, offset + numel) of the flat buffer
  int first = 0, count = 0;       // its parameters: named_params[first, first + count)
  // Expert parallelism's experts: held by the ranks of one ep rank only, so their gradients
  // sum (and ZeRO shards them) over edp_cp, not dp_cp (runtime/comm.cuh).
  bool experts = false;
};

// Hooks around each unit's forward and backward, by unit index. after_backward runs as soon as
// the unit's weight gradients are final: the seam where data parallelism launches a bucket's
// all-reduce and ZeRO a reduce-scatter; ZeRO-3 gathers a unit's weights in before_forward /
// before_backward and frees them in after_forward / after_backward.
struct UnitHooks {
  std::function<void(int)> before_forward, after_forward, before_backward, after_backward;
};

struct FlatParameters {
  int64_t num_params = 0;  // on this rank
  // [num_params] flat, Mem::Params and Mem::Grads. A sharded optimizer (zero.cu) may hold the
  // memory instead: then these are undefined or padded, and the views point where it binds them.
  Tensor params, grads;
  std::vector<NamedTensor> named_params, named_grads;  // HF order (the checkpoint's order)
  std::vector<int64_t> offsets;  // per named parameter: its first element in the flat buffer
  std::vector<TpSlice> layouts;  // per named parameter: where its shard sits in the whole
  std::vector<ModelUnit> units;

  virtual ~FlatParameters() = default;
  // Points the views of unit u at `base`, which holds the unit laid out as in the flat buffer
  // (base[k] is flat element units[u].offset + k); an undefined `base` unbinds them.
  virtual void bind_unit_params(int u, const Tensor& base) = 0;
  virtual void bind_unit_grads(int u, const Tensor& base) = 0;
  // out[k] := flat element first + k of the initial parameters: any slice, layout-free.
  virtual void init_parameters(uint64_t seed, const Tensor& out, int64_t first) const = 0;
  // The same, where there are values to draw: nothing on the meta device.
  void init_values(uint64_t seed, const Tensor& out, int64_t first) const {
    if (out.device != Device::Meta) init_parameters(seed, out, first);
  }
  // Units whose weights unit u reads in its forward (backward: false) or backward, and whose
  // gradients its backward writes: its own, and what a tied LM head shares with the embedding.
  virtual std::vector<int> weights_read(int u, bool backward) const = 0;
  virtual std::vector<int> grads_written(int u) const = 0;
  // The same layout for every parameter of the model on this tensor-parallel rank, whatever
  // part of it this rank holds (a checkpoint holds them all); no memory.
  virtual std::unique_ptr<FlatParameters> whole_layout() const = 0;
};

// Views of `flat` ([num_params], any device) under the parameter names and shapes: a whole copy
// of the weights, the gradients or an optimizer moment, in the checkpoint's order.
std::vector<NamedTensor> named_views(const FlatParameters& p, const Tensor& flat);
// Allocates the flat parameter and gradient buffers (gradients in grad_dtype), binds every view
// and initialises the weights from `seed`. With bf16 gradients (--grad-acc-dtype bf16) the
// gradient views stay unbound: each unit's backward accumulates in an fp32 buffer of its own,
// bound around it (Bf16Accumulators, gradient_sync.cuh).
void allocate_flat(FlatParameters& p, Device device, uint64_t seed, DType grad_dtype = DType::F32);

// ---- Blocks of a whole row-major tensor (tensor-parallel shards) ----
// The rows [row0, row0 + rows) and columns [col0, col0 + cols) of the whole [*, full_cols]
// tensor `name`, initialised from the layout-free RNG (DESIGN 5) into `shard` [rows, cols].
void init_normal_block(const Tensor& shard, uint64_t seed, const std::string& name, float std,
                       int64_t row0, int64_t col0, int64_t full_cols);
// Copies the block [row0, row0 + shard rows) x [col0, col0 + shard cols) of a whole host
// tensor [*, full_cols] into `shard` (any device), and back.
void load_block(const Tensor& shard, const float* full, int64_t row0, int64_t col0,
                int64_t full_cols);
void store_block(const Tensor& shard, float* full, int64_t row0, int64_t col0, int64_t full_cols);
