// zero.cu: ZeRO, the Zero Redundancy Optimizer (Playbook §4; Rajbhandari et al., 2020). Plain
// data parallelism keeps all of the weights, gradients and Adam's m and v on every rank; ZeRO
// keeps 1/N of each (N = dp_cp ranks) and moves the rest when it is needed. Per rank, fp32:
//   ZeRO-1  m, v sharded: gradients are reduce-scattered (not all-reduced), each rank steps its
//           slice, then the weights are all-gathered.                       4Ψ + 4Ψ + 8Ψ/N
//   ZeRO-2  + gradients: reduce-scattered unit by unit during the backward; a rank keeps only
//           the sum of its slice.                                           4Ψ + 4Ψ/N + 8Ψ/N
//   ZeRO-3  + weights: a unit's weights are all-gathered before its forward and again before
//           its backward, and freed after; the next unit's gather runs while this one computes.
//                                                                           4Ψ/N + 4Ψ/N + 8Ψ/N
// The one idea: reduce-scatter + all-gather moves what all-reduce moves (2Ψ), so sharding the
// optimizer and the gradients costs no communication; sharding the weights costs one more Ψ.
//
// What lives where (persistent: Params / Grads / Optimizer; transient: Workspace):
//   weights    stages 1-2: all of them, each unit padded to N x S_u   stage 3: the shard [S]
//              stage 3 also: each gathered unit [N x S_u], from its gather to its release
//   gradients  stage 1: all of them, padded                           stages 2-3: the shard [S]
//              stages 2-3 also: the unit in backward [N x S_u], from before_backward until its
//              reduce-scatter completes (tied embeddings: the embedding's, from the head's
//              backward, which writes into it, to the embedding's own)
//   m, v       the shard [S] each
// Under mixed precision (--dtype bf16, fp16, fp8), the fp32 master weights are a shard [S] next
// to m and v, and what is gathered is in the compute format: stages 1-2 keep the whole weights
// only in that format (the book's 2Ψ + 4Ψ + 12Ψ/N for ZeRO-1), stage 3 a bf16 copy of its
// shard (2Ψ/N); each rank rounds its updated slice, and the units are all-gathered in bf16. With --grad-acc-dtype bf16 the gradient buffer (stage 1) or
// shard (stages 2-3) is bf16, and the reduce-scatters carry bf16.
#include <algorithm>
#include <cmath>

#include "mixed_precision.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"
#include "zero.cuh"

void add_zero_flags(CLI::App& app, ZeroOptions& o) {
  flag_group(app, "ZeRO (Playbook §4)")
      .add_option_function<int>(
          "--zero",
          [&o](int stage) {
            if (stage < 0 || stage > 3)
              throw UsageError("--zero " + std::to_string(stage) +
                               ": expected 0 (off), 1 (shard optimizer states), 2 (+ gradients) "
                               "or 3 (+ weights)");
            o.zero = stage;
          },
          "ZeRO stage over dp_cp: 0 off, 1 optimizer states, 2 + gradients, 3 + weights")
      ->default_str("0");
}

// ----------------------------------------------------------------------------
// Shards

Zero::Zero(Comm& comm, FlatParameters& model, int stage, const AdamWConfig& hp,
           float weight_decay, uint64_t seed, bool overlap, const PrecisionPolicy& precision)
    : GradientSync(comm, model, hp, weight_decay), stage_(stage), overlap_(overlap),
      weight_format_(precision.weight_format()),
      accumulators_(model, [this](int u) {
        const ShardLayout::Unit& U = layout_.units[u];
        return model_.grads.view(U.padded_offset, {U.numel});
      }) {
  const DType grad_dtype = precision.grads();
  grad_dtype_ = grad_dtype;
  PICO_ASSERT(stage >= 1 && stage <= 3, "ZeRO stage " + std::to_string(stage));
  PICO_ASSERT(!model.params.defined(), "Zero shards a model from build_model_layout");
  layout_ = make_shard_layout(model, comm.dp_cp.size, comm.dp_cp.rank);
  units_.resize(layout_.units.size());
  Device d = comm.device;
  int N = layout_.ranks, r = layout_.rank;
  int64_t S = layout_.shard_numel;
  // Each rank initialises exactly what it holds; the counter-based RNG gives every slice the
  // values of the unsharded model (DESIGN 5). Padding is zero and stays zero.
  if (stage <= 2) {  // whole weights, in fp32 or in the compute format
    model.params = zeros({layout_.padded_numel()}, Mem::Params, d, weight_format_);
    for (size_t u = 0; u < units_.size(); u++) {
      const ShardLayout::Unit& U = layout_.units[u];
      model.bind_unit_params((int)u, model.params.view(U.padded_offset, {N * U.shard}));
      Tensor whole = model.params.view(U.padded_offset, {U.numel});
      if (weight_format_ == DType::F32) {
        model.init_parameters(seed, whole, U.offset);
        continue;
      }
      Tensor fp32 = empty({U.numel}, Mem::Workspace, d);  // the unit's initial values, rounded
      model.init_parameters(seed, fp32, U.offset);
      cast_(whole, fp32);
    }
  }
  if (stage == 3 || weight_format_ != DType::F32) {  // the master weights: this rank's slice
    param_shard_ = zeros({S}, weight_format_ == DType::F32 ? Mem::Params : Mem::Optimizer, d);
    for (const ShardLayout::Unit& U : layout_.units)
      if (U.valid > 0)
        model.init_parameters(seed, param_shard_.view(U.shard_offset, {U.valid}),
                        U.offset + r * U.shard);
  }
  if (stage == 3 && weight_format_ != DType::F32) {  // the shard in the format it is gathered in
    compute_shard_ = empty({S}, Mem::Params, d, weight_format_);
    cast_(compute_shard_, param_shard_);
  }
  // Gradients in fp32 or bf16 (--grad-acc-dtype). Stage 1 in bf16 binds the views per unit
  // around its backward (Bf16Accumulators); stages 2-3 always do (acquire_grads).
  if (stage == 1) {
    model.grads = zeros({layout_.padded_numel()}, Mem::Grads, d, grad_dtype);
    for (size_t u = 0; u < units_.size() && grad_dtype == DType::F32; u++) {
      const ShardLayout::Unit& U = layout_.units[u];
      model.bind_unit_grads((int)u, model.grads.view(U.padded_offset, {N * U.shard}));
    }
  } else {
    grad_shard_ = zeros({S}, Mem::Grads, d, grad_dtype);
  }
  exp_avg_ = zeros({S}, Mem::Optimizer, d);
  exp_avg_sq_ = zeros({S}, Mem::Optimizer, d);
  // This rank's slice of each parameter: what its AdamW updates.
  for (int u = 0; u < (int)units_.size(); u++) {
    const ShardLayout::Unit& U = layout_.units[u];
    const ModelUnit& mu = model.units[u];
    int64_t lo = r * U.shard, hi = lo + U.valid;  // unit-relative
    for (int p = mu.first; p < mu.first + mu.count; p++) {
      const Tensor& t = model.named_params[p].tensor;
      int64_t begin = model.offsets[p] - U.offset, end = begin + t.numel();
      begin = std::max(begin, lo), end = std::min(end, hi);
      int64_t at = begin - lo;  // within the unit's shard
      if (begin < end)
        slices_.push_back({shard(Part::Params, u) + at, grads_of(u).view(at, {end - begin}).ptr,
                           shard(Part::ExpAvg, u) + at, shard(Part::ExpAvgSq, u) + at,
                           end - begin, u, weight_decays(t), model.layouts[p].writer, grad_dtype});
    }
  }
}

// This rank's slice of unit u in each buffer. Stages 1-2 keep the weights whole (padded), and
// stage 1 the gradients: there the slice sits inside the full buffer.
float* Zero::shard(Part part, int u) const {
  const ShardLayout::Unit& U = layout_.units[u];
  int64_t in_full = U.padded_offset + layout_.rank * U.shard;
  switch (part) {
    case Part::Params:
      return param_shard_.defined() ? param_shard_.f32() + U.shard_offset
                                    : model_.params.f32() + in_full;
    case Part::Grads:
      PICO_ASSERT(grad_dtype_ == DType::F32, "bf16 gradients: use grads_of");
      return stage_ == 1 ? model_.grads.f32() + in_full : grad_shard_.f32() + U.shard_offset;
    case Part::ExpAvg:
      return exp_avg_.f32() + U.shard_offset;
    case Part::ExpAvgSq:
      return exp_avg_sq_.f32() + U.shard_offset;
  }
  return nullptr;
}
Tensor Zero::grads_of(int u) const {
  const ShardLayout::Unit& U = layout_.units[u];
  return stage_ == 1 ? model_.grads.view(U.padded_offset + layout_.rank * U.shard, {U.shard})
                     : grad_shard_.view(U.shard_offset, {U.shard});
}
Tensor Zero::shard_view(Part part, int u, int64_t count) const {
  Tensor t;  // a non-owning view
  t.ptr = shard(part, u);
  t.shape = {count};
  t.device = comm_.device;
  return t;
}

// ----------------------------------------------------------------------------
// The hooks: which unit needs what, when

UnitHooks Zero::hooks(const Context& ctx, bool last_micro_batch) {
  ctx_ = &ctx;
  UnitHooks h;
  if (stage_ == 3) {
    h.before_forward = [this](int u) { before_forward(u); };
    h.after_forward = [this](int u) { after_forward(u); };
  }
  h.before_backward = [this](int u) { before_backward(u); };
  h.after_backward = [this, last_micro_batch](int u) { after_backward(u, last_micro_batch); };
  return h;
}

// Playbook §4.4: gather this unit's weights (prefetched, so usually there already) and start
// the next unit's gather, which then runs while this unit computes.
void Zero::before_forward(int u) {
  progress();
  for (int w : model_.weights_read(u, false)) gather_unit(w);
  if (overlap_)
    for (int w : model_.weights_read(u + 1, false)) launch_gather(w);
}
// Freed right after use, except the last unit's: its backward comes next, so its weights are
// still resident when the backward starts (the book's "2L - 1", see expected_traffic).
void Zero::after_forward(int u) {
  if (u == (int)units_.size() - 1) return;
  for (int w : model_.weights_read(u, false)) release_unit(w);
}
void Zero::before_backward(int u) {
  progress();
  if (stage_ == 1 && grad_dtype_ != DType::F32) accumulators_.hold(*ctx_, u);
  if (stage_ == 3) {
    for (int w : model_.weights_read(u, true)) gather_unit(w);
    if (overlap_)
      for (int w : model_.weights_read(u - 1, true)) launch_gather(w);
  }
  if (stage_ >= 2)
    for (int w : model_.weights_read(u, false)) acquire_grads(w);  // the gradients it writes
}
void Zero::after_backward(int u, bool last_micro_batch) {
  if (stage_ == 1 && grad_dtype_ != DType::F32) accumulators_.drop(*ctx_, u);
  if (stage_ == 3)
    for (int w : model_.weights_read(u, true)) release_unit(w);
  if (stage_ >= 2 || last_micro_batch) reduce_unit(u);  // §4.3: reduce-scatter as produced
  progress();
}

// ----------------------------------------------------------------------------
// Gathers (stage 3) and reduce-scatters, nonblocking

void Zero::launch_gather(int u) {
  UnitState& s = units_[u];
  if (s.resident || s.gathering) return;
  const ShardLayout::Unit& U = layout_.units[u];
  // Mixed precision: the bf16 (fp16) shard, half the bytes; the ops read the gathered unit as it is.
  Tensor mine = compute_shard_.defined() ? compute_shard_.view(U.shard_offset, {U.shard})
                                         : shard_view(Part::Params, u, U.shard);
  s.params = empty({layout_.ranks * U.shard}, Mem::Workspace, comm_.device, mine.dtype);
  s.gather_start = now_seconds();
  s.gather = all_gather_async(comm_, comm_.dp_cp, *ctx_, mine.ptr, s.params.ptr, mine.dtype, U.shard);
  s.gathering = true;
}

void Zero::gather_unit(int u) {
  UnitState& s = units_[u];
  if (s.resident) return;
  launch_gather(u);
  double t0 = now_seconds();
  s.gather.wait();  // orders the compute stream after the gather
  double t1 = now_seconds();
  exposed_gather_s += t1 - t0;
  spans.push_back({"all-gather " + model_.units[u].name, s.gather_start, t1});
  s.gathering = false, s.resident = true;
  model_.bind_unit_params(u, s.params);
}

void Zero::release_unit(int u) {
  UnitState& s = units_[u];
  PICO_ASSERT(!s.gathering, "released " + model_.units[u].name + " while its gather is in flight");
  model_.bind_unit_params(u, Tensor());
  s.params = Tensor();
  s.resident = false;
}

// A zeroed full-size gradient buffer for unit u, which its backward accumulates into.
void Zero::acquire_grads(int u) {
  UnitState& s = units_[u];
  if (s.grads.defined() && !s.reducing) return;  // already taken this micro-batch (tied head)
  complete_reduce(u);  // the previous micro-batch's reduce-scatter of this unit
  s.grads = zeros({layout_.ranks * layout_.units[u].shard}, Mem::Workspace, comm_.device);
  model_.bind_unit_grads(u, s.grads);
}

// Sums unit u's gradients over dp_cp, in place: this rank's slice of the unit's full buffer
// receives the sum of everyone's (NCCL and MPI both allow recv = send + rank * count). Summed,
// not averaged: each micro-batch's loss is already scaled by 1 / global tokens (DESIGN 5).
void Zero::reduce_unit(int u) {
  UnitState& s = units_[u];
  const ShardLayout::Unit& U = layout_.units[u];
  // The unit's full gradient in the wire format: stage 1's buffer itself; stages 2-3's fp32
  // workspace, or under bf16 gradients its rounding (this micro-batch's sum, rounded once).
  Tensor full = stage_ == 1 ? model_.grads.view(U.padded_offset, {layout_.ranks * U.shard})
                            : s.grads;
  if (stage_ >= 2 && grad_dtype_ != DType::F32) {
    s.wire = empty(*ctx_, full.shape, Mem::Workspace, grad_dtype_);
    cast_(*ctx_, s.wire, full);
    full = s.wire;
  }
  s.reduce_start = now_seconds();
  s.reduce = reduce_scatter_async(comm_, comm_.dp_cp, *ctx_, full.ptr,
                                  full.view(layout_.rank * U.shard, {U.shard}).ptr, grad_dtype_,
                                  U.shard, ReduceOp::Sum);
  s.reducing = true;
  if (!overlap_) complete_reduce(u);
}

void Zero::complete_reduce(int u) {
  UnitState& s = units_[u];
  if (!s.reducing) return;
  double t0 = now_seconds();
  s.reduce.wait();
  double t1 = now_seconds();
  exposed_reduce_s += t1 - t0;
  spans.push_back({"reduce-scatter " + model_.units[u].name, s.reduce_start, t1});
  s.reducing = false;
  if (stage_ >= 2) {  // keep the sum of this rank's slice; the unit's full gradient goes
    const ShardLayout::Unit& U = layout_.units[u];
    const Tensor shard = grads_of(u);
    if (grad_dtype_ == DType::F32) {
      axpy(*ctx_, shard, 1.0f, s.grads.view(layout_.rank * U.shard, {U.shard}));
    } else {  // bf16 shard += bf16 slice: added in fp32, rounded once
      Tensor sum = empty(*ctx_, {U.shard}, Mem::Workspace), mine = empty(*ctx_, {U.shard}, Mem::Workspace);
      cast_(*ctx_, sum, shard);
      cast_(*ctx_, mine, s.wire.view(layout_.rank * U.shard, {U.shard}));
      axpy(*ctx_, sum, 1.0f, mine);
      cast_(*ctx_, shard, sum);
      s.wire = Tensor();
    }
    model_.bind_unit_grads(u, Tensor());
    s.grads = Tensor();
  }
}

// MPI advances nonblocking collectives only inside MPI calls: poll everything in flight at
// every hook, and retire finished reduce-scatters early (their buffers go sooner).
void Zero::progress() {
  for (size_t u = 0; u < units_.size(); u++) {
    if (units_[u].reducing && units_[u].reduce.test()) complete_reduce((int)u);
    if (units_[u].gathering) units_[u].gather.test();
  }
}

// ----------------------------------------------------------------------------
// The step

void Zero::begin_step(const Context& ctx) {
  ctx_ = &ctx;
  spans.clear();
  exposed_gather_s = exposed_reduce_s = 0;
  traffic_.open(comm_.dp_cp);
  zero_(stage_ == 1 ? model_.grads : grad_shard_);
  pending_scale_ = 1.0f;
}

double Zero::finish(const Context& ctx) {
  ctx_ = &ctx;
  double t0 = now_seconds();
  for (size_t u = 0; u < units_.size(); u++) complete_reduce((int)u);
  for (const UnitState& s : units_)
    PICO_ASSERT(!s.resident && !s.gathering && !s.grads.defined(), "a unit is still held");
  traffic_.close(comm_.dp_cp);  // --save-grads gathers next: not training traffic
  return now_seconds() - t0;
}

void Zero::scale_grads(const Context& ctx, float alpha) {
  for (size_t u = 0; u < units_.size(); u++) scale_(ctx, grads_of((int)u), alpha);
}

// Playbook §4.2 steps 4-5: AdamW on this rank's slice, then (stages 1-2) every rank's updated
// slice to every rank. Unit u's all-gather starts as soon as u is updated, and runs while the
// later units update.
void Zero::step(const Context& ctx, float lr) {
  ctx_ = &ctx;
  traffic_.open(comm_.dp_cp);
  adamw_.steps++;
  auto finish_gather = [&](size_t u) {
    if (!units_[u].gather.active()) return;
    double t0 = now_seconds();
    units_[u].gather.wait();
    exposed_gather_s += now_seconds() - t0;
    spans.push_back({"all-gather " + model_.units[u].name, units_[u].gather_start, now_seconds()});
  };
  size_t k = 0;
  for (size_t u = 0; u < units_.size(); u++) {
    int iu = (int)u;
    for (; k < slices_.size() && slices_[k].unit == iu; k++)
      adamw_.update(ctx, slices_[k], lr, pending_scale_);
    if (compute_shard_.defined()) {  // stage 3: the updated slice, rounded, for the next gathers
      const ShardLayout::Unit& U = layout_.units[u];
      cast_(ctx, compute_shard_.view(U.shard_offset, {U.shard}), shard_view(Part::Params, iu, U.shard));
    }
    if (stage_ <= 2) {  // in place, like the reduce-scatter
      const ShardLayout::Unit& U = layout_.units[u];
      Tensor full = model_.params.view(U.padded_offset, {layout_.ranks * U.shard});
      Tensor mine = full.view(layout_.rank * U.shard, {U.shard});
      // Mixed precision: this rank's slice of the master weights, rounded to the compute format,
      // is what every rank needs, and half the bytes of fp32 on the wire.
      if (param_shard_.defined()) cast_(ctx, mine, shard_view(Part::Params, iu, U.shard));
      units_[u].gather_start = now_seconds();
      units_[u].gather = all_gather_async(comm_, comm_.dp_cp, ctx, mine.ptr, full.ptr,
                                          weight_format_, U.shard);
      if (!overlap_) finish_gather(u);
    }
  }
  for (size_t u = 0; u < units_.size(); u++) finish_gather(u);
  traffic_.close(comm_.dp_cp);
  steps_measured++;
}

// ----------------------------------------------------------------------------
// The whole model: evaluation, checkpoints

void Zero::gather_weights(const Context& ctx) {
  if (stage_ < 3) return;
  ctx_ = &ctx;
  for (size_t u = 0; u < units_.size(); u++) launch_gather((int)u);
  for (size_t u = 0; u < units_.size(); u++) gather_unit((int)u);
}
void Zero::release_weights() {
  if (stage_ < 3) return;
  for (size_t u = 0; u < units_.size(); u++) release_unit((int)u);
}

// What a checkpoint reads and writes: this rank's slices, and the weights stages 1-2 hold whole
// (in fp32, or in the compute format next to the fp32 master shard).
std::vector<GradientSync::Holding> Zero::holdings(Part part) const {
  auto slices = [this](Part p) {
    return Holding{true, [this, p](int u) { return shard_view(p, u, layout_.units[u].shard); }};
  };
  if (part == Part::Grads) return {{true, [this](int u) { return grads_of(u); }}};
  if (part != Part::Params) return {slices(part)};
  Holding whole{false, [this](int u) {
                  return model_.params.view(layout_.units[u].padded_offset, {layout_.units[u].numel});
                }};
  Holding compute{true, [this](int u) {
                    const ShardLayout::Unit& U = layout_.units[u];
                    return compute_shard_.view(U.shard_offset, {U.shard});
                  }};
  if (!param_shard_.defined()) return {whole};                   // stages 1-2, fp32
  if (stage_ <= 2) return {slices(Part::Params), whole};          // the master, the compute format
  if (compute_shard_.defined()) return {slices(Part::Params), compute};  // stage 3, mixed
  return {slices(Part::Params)};
}

void Zero::trace_communication(Trace& trace) const {
  for (const Span& span : spans) trace.add(span.name, Track::Comm, span.start, span.end);
}
void Zero::print_comm_report(int grad_acc) const {
  const ShardLayout::Unit& last = layout_.units.back();
  const int head = (int)layout_.units.size() - 1;
  print_zero_comm_report(
      comm_, {stage_, layout_.ranks, grad_acc, steps_measured, measured_traffic(),
              expected_traffic(grad_acc), last.offset + last.numel, layout_.padded_numel(),
              grad_dtype_, weight_format_, model_.weights_read(head, false).size() > 1});
}

// ----------------------------------------------------------------------------
// Traffic

ZeroTraffic Zero::measured_traffic() const {
  const CollStats* t = traffic_.total;
  return {t[(int)Coll::ReduceScatter].calls, t[(int)Coll::ReduceScatter].bytes,
          t[(int)Coll::AllGather].calls, t[(int)Coll::AllGather].bytes};
}

// What one step issues (runtime/formulas.cu, zero_expected_traffic): every unit's shard, and
// the units each unit reads in its forward and its backward.
ZeroTraffic Zero::expected_traffic(int grad_acc) const {
  std::vector<int64_t> shards;
  std::vector<std::vector<int>> reads, reads_back;
  for (int u = 0; u < (int)layout_.units.size(); u++) {
    shards.push_back(layout_.units[u].shard);
    reads.push_back(model_.weights_read(u, false));
    reads_back.push_back(model_.weights_read(u, true));
  }
  return zero_expected_traffic(stage_, layout_.ranks, shards, reads, reads_back,
                               (int)dtype_size(grad_dtype_), (int)dtype_size(weight_format_),
                               grad_acc);
}
