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
// What lives where: weights, stages 1-2 all (each unit padded to N x S_u), stage 3 the shard
// [S] and each gathered unit [N x S_u] from its gather to its release; gradients, stage 1 all
// (padded), stages 2-3 the shard [S] and the unit in backward [N x S_u] until its
// reduce-scatter completes; m and v, the shard [S] each. Under mixed precision (--dtype bf16,
// fp16, fp8) the fp32 master weights are a shard next to m and v and what is gathered is in
// the compute format (the book's 2Ψ + 4Ψ + 12Ψ/N for ZeRO-1); --grad-acc-dtype bf16 makes the
// gradient buffer or shard bf16. Experts shard over edp_cp (comm.cuh). Guide: docs/zero.md.
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

// Unit by unit: S_u = ceil(numel_u / N) elements per rank; rank r's valid ones are the part of
// [r S_u, (r+1) S_u) inside the unit (none for a last rank past its end); the rest is padding.
ShardLayout make_shard_layout(const FlatParameters& model, int ranks, int rank, int expert_ranks,
                              int expert_rank) {
  ShardLayout s;
  s.ranks = ranks, s.rank = rank;
  if (expert_ranks == 0) expert_ranks = ranks, expert_rank = rank;
  for (const ModelUnit& mu : model.units) {
    ShardLayout::Unit u;
    u.ranks = mu.experts ? expert_ranks : ranks, u.rank = mu.experts ? expert_rank : rank;
    u.offset = mu.offset, u.numel = mu.numel;
    u.shard = (mu.numel + u.ranks - 1) / u.ranks;
    u.shard_offset = s.shard_numel;
    u.padded_offset = s.padded;
    u.valid = std::clamp(mu.numel - u.first(), (int64_t)0, u.shard);
    s.shard_numel += u.shard;
    s.padded += (int64_t)u.ranks * u.shard;
    s.units.push_back(u);
  }
  return s;
}

Zero::Zero(Comm& comm, FlatParameters& model, int stage, const AdamWConfig& hp, float weight_decay,
           uint64_t seed, bool overlap, const PrecisionPolicy& precision)
    : GradientSync(comm, model, hp, weight_decay),
      stage_(stage),
      shard_grads_(stage >= 2),
      shard_weights_(stage == 3),
      overlap_(overlap),
      weight_format_(precision.weight_format()),
      accumulators_(model, [this](int u) {
        const ShardLayout::Unit& U = layout_.units[u];
        return model_.grads.view(U.padded_offset, {U.numel});
      }) {
  grad_dtype_ = precision.grads();
  PICO_ASSERT(stage >= 1 && stage <= 3, "ZeRO stage " + std::to_string(stage));
  PICO_ASSERT(!model.params.defined(), "Zero shards a model from build_model_layout");
  layout_ = make_shard_layout(model, comm.dp_cp.size, comm.dp_cp.rank, comm.edp_cp.size,
                              comm.edp_cp.rank);
  units_.resize(layout_.units.size());
  const Device d = comm.device;
  const int64_t S = layout_.shard_numel, padded = layout_.padded_numel();
  const bool mixed = weight_format_ != DType::F32;
  // Each rank initialises exactly what it holds; the counter-based RNG gives every slice the
  // values of the unsharded model (DESIGN 5). Padding is zero and stays zero.
  if (!shard_weights_) {  // whole weights, in fp32 or only in the compute format
    model.params = zeros({padded}, Mem::Params, d, weight_format_);
    for (int u = 0; u < (int)units_.size(); u++) {
      model.bind_unit_params(u, full(model.params, u));
      Tensor init = mixed ? empty({unit(u).numel}, Mem::Workspace, d) : whole(model.params, u);
      model.init_values(seed, init, unit(u).offset);
      if (mixed) cast_(whole(model.params, u), init);  // the initial values, rounded
    }
  }
  if (shard_weights_ || mixed) {  // the (master) weights: this rank's slice
    param_shard_ = zeros({S}, mixed ? Mem::Optimizer : Mem::Params, d);
    for (int u = 0; u < (int)units_.size(); u++)
      if (unit(u).valid > 0)
        model.init_values(seed, mine(param_shard_, u).view(0, {unit(u).valid}),
                          unit(u).offset + unit(u).first());
  }
  if (shard_weights_ && mixed) {  // the shard in the format it is gathered in
    compute_shard_ = empty({S}, Mem::Params, d, weight_format_);
    cast_(compute_shard_, param_shard_);
  }
  // Gradients in fp32 or bf16 (--grad-acc-dtype). Stage 1 in bf16 binds the views per unit
  // around its backward (Bf16Accumulators); stages 2-3 always do (acquire_grads).
  if (shard_grads_) {
    grad_shard_ = zeros({S}, Mem::Grads, d, grad_dtype_);
  } else {
    model.grads = zeros({padded}, Mem::Grads, d, grad_dtype_);
    for (int u = 0; u < (int)units_.size() && grad_dtype_ == DType::F32; u++)
      model.bind_unit_grads(u, full(model.grads, u));
  }
  exp_avg_ = zeros({S}, Mem::Optimizer, d);
  exp_avg_sq_ = zeros({S}, Mem::Optimizer, d);
  // This rank's slice of each parameter: what its AdamW updates.
  for (int u = 0; u < (int)units_.size(); u++) {
    const ShardLayout::Unit& U = unit(u);
    const ModelUnit& mu = model.units[u];
    int64_t lo = U.first(), hi = lo + U.valid;  // unit-relative
    for (int p = mu.first; p < mu.first + mu.count; p++) {
      const Tensor& t = model.named_params[p].tensor;
      int64_t begin = model.offsets[p] - U.offset, end = begin + t.numel();
      begin = std::max(begin, lo), end = std::min(end, hi);
      int64_t at = begin - lo;  // within the unit's shard
      if (begin < end)
        slices_.push_back({master(u).f32() + at, grads_of(u).view(at, {end - begin}).ptr,
                           mine(exp_avg_, u).f32() + at, mine(exp_avg_sq_, u).f32() + at,
                           end - begin, u, weight_decays(t), model.layouts[p].writer, grad_dtype_});
    }
  }
}

// Unit u in a padded whole buffer [N x S_u], its [numel] prefix, and this rank's slice [S_u] of
// a padded whole buffer (stages 1-2 keep the weights whole, stage 1 the gradients) or of a
// shard buffer [S] (slice).
Tensor Zero::full(const Tensor& padded, int u) const {
  return padded.view(unit(u).padded_offset, {unit(u).ranks * unit(u).shard});
}
Tensor Zero::whole(const Tensor& padded, int u) const {
  return padded.view(unit(u).padded_offset, {unit(u).numel});
}
Tensor Zero::mine(const Tensor& shard, int u) const {
  return shard.view(unit(u).shard_offset, {unit(u).shard});
}
Tensor Zero::slice(const Tensor& padded, int u) const {
  return full(padded, u).view(unit(u).first(), {unit(u).shard});
}
// What AdamW updates: the fp32 master shard, or (stages 1-2 in fp32) the slice of the weights.
Tensor Zero::master(int u) const {
  return param_shard_.defined() ? mine(param_shard_, u) : slice(model_.params, u);
}
Tensor Zero::grads_of(int u) const {
  return shard_grads_ ? mine(grad_shard_, u) : slice(model_.grads, u);
}

// ----------------------------------------------------------------------------
// The hooks: which unit needs what, when

UnitHooks Zero::hooks(const Context& ctx, bool last_micro_batch) {
  ctx_ = &ctx;
  UnitHooks h;
  if (shard_weights_) {
    h.before_forward = [this](int u) { before_forward(u); };
    h.after_forward = [this](int u) { after_forward(u); };
  }
  h.before_backward = [this](int u) { before_backward(u); };
  h.after_backward = [this, last_micro_batch](int u) { after_backward(u, last_micro_batch); };
  return h;
}

// Playbook §4.4: gather this unit's weights (prefetched, so usually there already) and start
// the next units' gathers, which then run while this unit computes: kPrefetch units ahead,
// each holding its gathered weights until its own release.
constexpr int kPrefetch = 1;
void Zero::before_forward(int u) {
  progress();
  for (int w : model_.weights_read(u, false)) gather_unit(w);
  for (int k = 1; overlap_ && k <= kPrefetch; k++)
    for (int w : model_.weights_read(u + k, false)) launch_gather(w);
}
// Freed right after use, except the last unit's: its backward comes next, so its weights are
// still resident when the backward starts (the book's "2L - 1", see expected_traffic).
void Zero::after_forward(int u) {
  if (u == (int)units_.size() - 1) return;
  for (int w : model_.weights_read(u, false)) release_unit(w);
}
void Zero::before_backward(int u) {
  progress();
  if (!shard_grads_ && grad_dtype_ != DType::F32) accumulators_.hold(*ctx_, u);
  if (shard_weights_) {
    for (int w : model_.weights_read(u, true)) gather_unit(w);
    for (int k = 1; overlap_ && k <= kPrefetch; k++)
      for (int w : model_.weights_read(u - k, true)) launch_gather(w);
  }
  if (shard_grads_)
    for (int w : model_.grads_written(u)) acquire_grads(w);
}
void Zero::after_backward(int u, bool last_micro_batch) {
  if (!shard_grads_ && grad_dtype_ != DType::F32) accumulators_.drop(*ctx_, u);
  if (shard_weights_)
    for (int w : model_.weights_read(u, true)) release_unit(w);
  if (shard_grads_ || last_micro_batch) reduce_unit(u);  // §4.3: reduce-scatter as produced
  progress();
}

// ----------------------------------------------------------------------------
// Gathers (stage 3) and reduce-scatters, nonblocking

void Zero::launch_gather(int u) {
  UnitState& s = units_[u];
  if (s.resident || s.gathering) return;
  // Mixed precision: the bf16 (fp16) shard, half the bytes; the ops read the gathered unit as is.
  Tensor shard = compute_shard_.defined() ? mine(compute_shard_, u) : master(u);
  s.params = empty({unit(u).ranks * unit(u).shard}, Mem::Workspace, comm_.device, shard.dtype);
  s.gather_start = now_seconds();
  s.gather = all_gather_async(comm_, group_of(u), *ctx_, shard.ptr, s.params.ptr, shard.dtype,
                              unit(u).shard);
  s.gathering = true;
}

void Zero::gather_unit(int u) {
  UnitState& s = units_[u];
  if (s.resident) return;
  launch_gather(u);
  exposed_gather_s += wait_traced(s.gather, "all-gather " + model_.units[u].name, s.gather_start);
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
  s.grads = zeros({unit(u).ranks * unit(u).shard}, Mem::Workspace, comm_.device);
  model_.bind_unit_grads(u, s.grads);
}

// Sums unit u's gradients over dp_cp, in place: this rank's slice of the unit's full buffer
// receives the sum of everyone's (NCCL and MPI both allow recv = send + rank * count). Summed,
// not averaged: each micro-batch's loss is already scaled by 1 / global tokens (DESIGN 5).
// The unit's full gradient goes in the wire format: stage 1's buffer itself; stages 2-3's fp32
// workspace, or under bf16 gradients its rounding (this micro-batch's sum, rounded once).
void Zero::reduce_unit(int u) {
  UnitState& s = units_[u];
  s.wire = shard_grads_ ? cast_to(*ctx_, s.grads, grad_dtype_) : full(model_.grads, u);
  s.reduce_start = now_seconds();
  Tensor mine = s.wire.view(unit(u).first(), {unit(u).shard});
  s.reduce = reduce_scatter_async(comm_, group_of(u), *ctx_, s.wire.ptr, mine.ptr, grad_dtype_,
                                  unit(u).shard, ReduceOp::Sum);
  s.reducing = true;
  if (!overlap_) complete_reduce(u);
}

void Zero::complete_reduce(int u) {
  UnitState& s = units_[u];
  if (!s.reducing) return;
  exposed_reduce_s +=
      wait_traced(s.reduce, "reduce-scatter " + model_.units[u].name, s.reduce_start);
  s.reducing = false;
  if (shard_grads_) {  // keep the sum of this rank's slice; the unit's full gradient goes
    accumulate(*ctx_, grads_of(u), s.wire.view(unit(u).first(), {unit(u).shard}));
    model_.bind_unit_grads(u, Tensor());
    s.grads = Tensor();
  }
  s.wire = Tensor();
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
  comm_spans_.clear();
  exposed_gather_s = exposed_reduce_s = 0;
  zero_(ctx, shard_grads_ ? grad_shard_ : model_.grads);
  pending_scale_ = 1.0f;
}

double Zero::finish(const Context& ctx) {
  ctx_ = &ctx;
  double t0 = now_seconds();
  for (size_t u = 0; u < units_.size(); u++) complete_reduce((int)u);
  for (const UnitState& s : units_)
    PICO_ASSERT(!s.resident && !s.gathering && !s.grads.defined(), "a unit is still held");
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
  adamw_.steps++;
  auto finish_gather = [&](int u) {
    if (units_[u].gather.active())
      exposed_gather_s += wait_traced(units_[u].gather, "all-gather " + model_.units[u].name,
                                      units_[u].gather_start);
  };
  size_t k = 0;
  for (int u = 0; u < (int)units_.size(); u++) {
    const size_t first = k;
    while (k < slices_.size() && slices_[k].unit == u) k++;
    adamw_.update(ctx, slices_.data() + first, k - first, lr, pending_scale_);
    if (compute_shard_.defined())  // stage 3: the updated slice, rounded, for the next gathers
      cast_(ctx, mine(compute_shard_, u), master(u));
    if (shard_weights_) continue;
    // Stages 1-2, in place like the reduce-scatter. Mixed precision: this rank's slice of the
    // master weights, rounded to the compute format, is what every rank needs, and half the
    // bytes of fp32 on the wire.
    if (param_shard_.defined()) cast_(ctx, slice(model_.params, u), master(u));
    units_[u].gather_start = now_seconds();
    units_[u].gather = all_gather_async(comm_, group_of(u), ctx, slice(model_.params, u).ptr,
                                        full(model_.params, u).ptr, weight_format_, unit(u).shard);
    if (!overlap_) finish_gather(u);
  }
  for (int u = 0; u < (int)units_.size(); u++) finish_gather(u);
}

// ----------------------------------------------------------------------------
// The whole model: evaluation, checkpoints

void Zero::gather_weights(const Context& ctx) {
  if (!shard_weights_) return;
  ctx_ = &ctx;
  for (size_t u = 0; u < units_.size(); u++) launch_gather((int)u);
  for (size_t u = 0; u < units_.size(); u++) gather_unit((int)u);
}
void Zero::release_weights() {
  if (!shard_weights_) return;
  for (size_t u = 0; u < units_.size(); u++) release_unit((int)u);
}

// What a checkpoint reads and writes: this rank's slices (the unit's valid elements from its
// first, over the unit's group), and the weights stages 1-2 hold whole (in fp32, or in the
// compute format next to the fp32 master shard).
std::vector<GradientSync::Holding> Zero::holdings(Part part) const {
  auto sharded = [this](std::function<Tensor(int)> slice_of) -> Holding {
    return [this, slice_of](int u) {
      return Piece{slice_of(u), unit(u).first(), unit(u).valid, &group_of(u)};
    };
  };
  switch (part) {
    case Part::Grads:
      return {sharded([this](int u) { return grads_of(u); })};
    case Part::ExpAvg:
      return {sharded([this](int u) { return mine(exp_avg_, u); })};
    case Part::ExpAvgSq:
      return {sharded([this](int u) { return mine(exp_avg_sq_, u); })};
    case Part::Params:
      break;
  }
  std::vector<Holding> held;
  if (param_shard_.defined()) held.push_back(sharded([this](int u) { return master(u); }));
  if (!shard_weights_)  // the whole weights (after the master: a save reads the first)
    held.push_back([this](int u) { return Piece{whole(model_.params, u), 0, unit(u).numel}; });
  if (compute_shard_.defined())
    held.push_back(sharded([this](int u) { return mine(compute_shard_, u); }));
  return held;
}

void Zero::print_comm_report(int grad_acc, const CollStats* measured, int64_t steps) const {
  const int head = (int)layout_.units.size() - 1;
  const CollStats &rs = measured[(int)Coll::ReduceScatter], &ag = measured[(int)Coll::AllGather];
  int64_t psi = 0, padded = 0;  // over dp_cp's units (experts travel over edp_cp)
  for (int u = 0; u <= head; u++)
    if (!model_.units[u].experts) psi += unit(u).numel, padded += unit(u).ranks * unit(u).shard;
  print_zero_comm_report(comm_, {stage_,
                                 layout_.ranks,
                                 grad_acc,
                                 steps,
                                 {rs.calls, rs.bytes, ag.calls, ag.bytes},
                                 expected_traffic(grad_acc),
                                 psi,
                                 padded,
                                 grad_dtype_,
                                 weight_format_,
                                 model_.weights_read(head, false).size() > 1});
}

// What one step issues over dp_cp (runtime/formulas.cu, zero_expected_traffic): every unit's
// shard, and the units each unit reads in its forward and its backward (experts: over edp_cp).
ZeroTraffic Zero::expected_traffic(int grad_acc) const {
  std::vector<int64_t> shards;
  std::vector<std::vector<int>> reads, reads_back;
  std::vector<int> index(layout_.units.size(), -1);  // unit -> its place among dp_cp's
  for (int u = 0; u < (int)layout_.units.size(); u++)
    if (!model_.units[u].experts) index[u] = (int)shards.size(), shards.push_back(unit(u).shard);
  for (int u = 0; u < (int)layout_.units.size(); u++)
    for (bool back : {false, true})
      if (index[u] >= 0) {
        std::vector<int> read = model_.weights_read(u, back);
        for (int& w : read) w = index[w];
        (back ? reads_back : reads).push_back(read);
      }
  return zero_expected_traffic(stage_, layout_.ranks, shards, reads, reads_back,
                               (int)dtype_size(grad_dtype_), (int)dtype_size(weight_format_),
                               grad_acc);
}

std::string Zero::describe() const {
  return "ZeRO-" + std::to_string(stage_) + ": reduce-scatter per unit" +
         (overlap_ ? ", overlapped" : ", no overlap") +
         (stage_ == 3 && overlap_ ? ", prefetch" : "");
}
