// gradient_sync.cu: what every gradient sync shares: the global gradient norm and clipping,
// the spans of its collectives for the trace, and checkpoints of whole tensors (DESIGN 6,
// "Gradient sync").
// The one idea: whichever way the replicas are kept in step, clipping and checkpoints see the
// model as one process would: each weight once, whole.
#include <algorithm>
#include <cmath>

#include "runtime/checkpoint.cuh"
#include "runtime/dtype.cuh"
#include "runtime/gradient_sync.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

GradientSync::GradientSync(Comm& comm, FlatParameters& model, const AdamWConfig& hp,
                           float weight_decay)
    : comm_(comm), model_(model) {
  adamw_.hp = hp;
  adamw_.weight_decay = weight_decay;
}

Bf16Accumulators::Bf16Accumulators(FlatParameters& model, std::function<Tensor(int)> bf16_unit)
    : model_(model), bf16_unit_(std::move(bf16_unit)) {
  acc_.resize(model.units.size());
  holders_.assign(model.units.size(), 0);
}

void Bf16Accumulators::hold(const Context& ctx, int unit) {
  for (int u : model_.grads_written(unit)) {  // a tied LM head writes the embedding's too
    if (holders_[u]++ > 0) continue;
    Tensor acc = empty(ctx, {model_.units[u].numel}, Mem::Workspace);
    cast_(ctx, acc, bf16_unit_(u));  // the bf16 sum so far, exactly
    model_.bind_unit_grads(u, acc);
    acc_[u] = acc;
  }
}

void Bf16Accumulators::drop(const Context& ctx, int unit) {
  for (int u : model_.grads_written(unit)) {
    PICO_ASSERT(holders_[u] > 0, "a unit's gradients dropped without being held");
    if (--holders_[u] > 0) continue;
    cast_(ctx, bf16_unit_(u), acc_[u]);  // rounded to bf16
    model_.bind_unit_grads(u, Tensor());
    acc_[u] = Tensor();
  }
}

void GradientSync::scale_gradients(const Context& ctx, float alpha) {
  if (grad_dtype_ == DType::F32) return scale_grads(ctx, alpha);
  pending_scale_ *= alpha;
}

float GradientSync::clip_grad_norm(const Context& ctx, float max_norm) {
  std::vector<Tensor> grads;
  for (const ParamSlice& s : slices_)
    if (s.counted) grads.push_back(Tensor{nullptr, s.grad, {s.count}, s.grad_dtype, ctx.device});
  // Expert units: each ep rank holds other experts; unsharded, their squares add over ep.
  std::vector<bool> experts;
  for (const ParamSlice& s : slices_)
    if (s.counted) experts.push_back(model_.units[s.unit].experts);
  double squares = 0, expert_squares = 0;
  std::vector<float> parts = sum_squares_each(ctx, grads);  // one trip to the host
  for (size_t i = 0; i < parts.size(); i++) (experts[i] ? expert_squares : squares) += parts[i];
  if (!grads_sharded() && comm_.ep.size > 1)
    all_reduce_host(comm_.ep, &expert_squares, 1, ReduceOp::Sum);
  squares += expert_squares;
  if (grads_sharded()) all_reduce_host(comm_.dp_cp, &squares, 1, ReduceOp::Sum);
  all_reduce_host(comm_.tp, &squares, 1, ReduceOp::Sum);  // the groups that split the model
  all_reduce_host(comm_.pp, &squares, 1, ReduceOp::Sum);
  float norm = (float)std::sqrt(squares);
  if (max_norm > 0.0f && norm > max_norm) scale_gradients(ctx, max_norm / norm);
  return norm;
}

double GradientSync::wait_traced(Handle& h, const std::string& name, double start) {
  double t0 = now_seconds();
  h.wait();  // orders the compute stream after the collective
  double t1 = now_seconds();
  comm_spans_.push_back({name, Track::Comm, start, t1});
  return t1 - t0;
}
void GradientSync::trace_communication(Trace& trace) const {
  for (const Trace::Span& s : comm_spans_) trace.add(s.name, s.track, s.start, s.end);
}

void GradientSync::poison_gradient(const Context& ctx) {
  PICO_ASSERT(!slices_.empty(), "poison_gradient: this rank updates no parameter");
  const ParamSlice& s = slices_.front();
  Tensor inf = empty(ctx, {1}, Mem::Workspace);  // on the step's stream: no wait for the device
  fill_(ctx, inf, INFINITY);
  cast_(ctx, Tensor{nullptr, s.grad, {1}, s.grad_dtype, ctx.device}, inf);
}

// ----------------------------------------------------------------------------
// Whole tensors from any layout: the flat state over dp_cp by the syncs' holdings, then the
// tensor-parallel shards and the pipeline stages (runtime/checkpoint.cu)

// The flat [num_params] fp32 vector of `part`, each unit whole over its group (dp_cp, or
// edp_cp for expert units) on that group's rank 0 (host); elsewhere undefined, or holding only
// the units this rank is the root of (an ep rank's experts). Collective over dp_cp and edp_cp.
Tensor GradientSync::gather_flat(const Context& ctx, Part part) {
  const Holding held = holdings(part).front();
  bool root = comm_.dp_cp.rank == 0 || comm_.edp_cp.rank == 0;
  Tensor whole = root ? zeros({model_.num_params}, Mem::Workspace, Device::CPU) : Tensor();
  auto fp32 = [&](const Tensor& t) {  // checkpoints hold fp32: bf16 gradients widened first
    if (t.dtype == DType::F32) return t;
    Tensor wide = empty({t.numel()}, Mem::Workspace, comm_.device);
    cast_(wide, t);
    return wide;
  };
  for (size_t u = 0; u < model_.units.size(); u++) {
    const ModelUnit& U = model_.units[u];
    const Piece piece = held((int)u);
    Tensor mine = fp32(piece.tensor);
    if (!piece.split_over) {  // every rank holds the unit: the root's copy is the whole
      if (group_of((int)u).rank == 0)
        copy_(whole.view(U.offset, {U.numel}), mine.view(0, {U.numel}));
      continue;
    }
    // Split: every rank's range to every rank (host bookkeeping, uncounted), then every rank's
    // piece to the root in one gather of the largest piece's size, then each put in its place.
    Group& g = *piece.split_over;
    std::vector<int64_t> range;
    for (int r = 0; r < g.size; r++) range.insert(range.end(), {piece.first, piece.count});
    std::vector<int64_t> ranges = exchange_counts(comm_, g, range);  // rank r's at 2r, 2r + 1
    int64_t S = 0;
    for (int r = 0; r < g.size; r++) S = std::max(S, ranges[2 * r + 1]);
    if (mine.numel() < S) {  // a shorter piece travels zero-padded to the gather's size
      Tensor padded = zeros({S}, Mem::Workspace, comm_.device);
      if (piece.count > 0) copy_(padded.view(0, {piece.count}), mine.view(0, {piece.count}));
      mine = padded;
    }
    Tensor staging = g.rank == 0 ? empty({g.size * S}, Mem::Workspace, comm_.device) : Tensor();
    gather(comm_, g, ctx, mine.f32(), g.rank == 0 ? staging.f32() : nullptr, S, 0);
    for (int r = 0; g.rank == 0 && r < g.size; r++) {
      const int64_t first = ranges[2 * r], count = ranges[2 * r + 1];
      if (count > 0) copy_(whole.view(U.offset + first, {count}), staging.view(r * S, {count}));
    }
  }
  return whole;
}

// Keeps this rank's part of a whole flat fp32 host vector [num_params], in every holding.
void GradientSync::load_flat(Part part, const Tensor& whole) {
  for (const Holding& held : holdings(part))
    for (size_t u = 0; u < model_.units.size(); u++) {
      const Piece piece = held((int)u);
      if (piece.count == 0) continue;
      Tensor from = whole.view(model_.units[u].offset + piece.first, {piece.count});
      Tensor into = piece.tensor.view(0, {piece.count});
      if (into.dtype == DType::F32)
        copy_(into, from);
      else
        cast_(into, to_device(from, into.device, Mem::Workspace));  // rounded once
    }
}

// Whole tensors on world rank 0 from gather_flat's vector (collective over the ranks that hold
// one): the tp shards assembled, an ep rank's experts joined to the others' on ep rank 0, the
// pipeline stages' joined on pp rank 0. Called on the roots of dp_cp or edp_cp only.
std::vector<NamedTensor> GradientSync::whole_named(const Tensor& flat) {
  std::vector<NamedTensor> tensors = whole_tensors(model_, comm_.tp, named_views(model_, flat));
  if (comm_.ep.size > 1 && !tensors.empty()) {  // tp rank 0: the other ep ranks send experts only
    std::vector<NamedTensor> mine;
    for (const ModelUnit& U : model_.units)
      for (int i = U.first; i < U.first + U.count; i++)
        if (U.experts || comm_.ep.rank == 0) mine.push_back(tensors[i]);
    tensors = gather_stage_tensors(comm_.ep, mine);
  }
  if (comm_.dp_cp.rank != 0) return {};
  return gather_stage_tensors(comm_.pp, tensors);
}

// AdamW's own step count, when it differs from the training steps taken (fp16 skipped some):
// its bias correction (1 - beta^t) counts only the steps it took.
static const char* kAdamSteps = "adam_steps";

void GradientSync::save(const Context& ctx, const std::string& dir, const ModelConfig& cfg,
                        int64_t steps_done, DType weights_dtype,
                        const std::map<std::string, std::string>& run_state) {
  Tensor weights = gather_flat(ctx, Part::Params);
  Tensor m = gather_flat(ctx, Part::ExpAvg), v = gather_flat(ctx, Part::ExpAvgSq);
  if (comm_.dp_cp.rank != 0 && comm_.edp_cp.rank != 0) return;  // the others meet on rank 0
  std::vector<NamedTensor> w = whole_named(weights);
  OptimizerState state{whole_named(m), whole_named(v), steps_done, run_state};
  if (adamw_.steps != steps_done) state.metadata[kAdamSteps] = std::to_string(adamw_.steps);
  if (comm_.grid.prints()) save_checkpoint(dir, cfg, w, &state, weights_dtype);
}

void GradientSync::save_gradients(const Context& ctx, const std::string& path, int64_t step) {
  Tensor grads = gather_flat(ctx, Part::Grads);
  if (comm_.dp_cp.rank != 0 && comm_.edp_cp.rank != 0) return;
  std::vector<NamedTensor> whole = whole_named(grads);
  if (comm_.grid.prints()) write_safetensors(path, whole, {{"step", std::to_string(step)}});
}

// The tensors of `mine` (a rank's part of the model) picked by name out of the flat vector of
// `whole` (the whole model, same tp shard): [mine.num_params], on the host.
static Tensor part_of(const FlatParameters& whole, const Tensor& flat, const FlatParameters& mine) {
  if (whole.num_params == mine.num_params) return flat;  // the whole model is this rank's
  Tensor part = empty({mine.num_params}, Mem::Workspace, Device::CPU);
  std::vector<NamedTensor> from = named_views(whole, flat), to = named_views(mine, part);
  for (const NamedTensor& t : to)
    for (const NamedTensor& f : from)
      if (f.name == t.name) copy_(t.tensor, f.tensor);
  return part;
}

int64_t GradientSync::load(const std::string& dir, std::map<std::string, std::string>* run_state) {
  // Every rank reads the whole checkpoint (its tp shard of every tensor) and keeps its part:
  // its stage's tensors under pipeline parallelism, its dp_cp slice under ZeRO.
  std::unique_ptr<FlatParameters> layout = model_.whole_layout();
  const FlatParameters& whole = *layout;
  int64_t n = whole.num_params;
  Tensor weights = empty({n}, Mem::Workspace, Device::CPU);
  Tensor m = zeros({n}, Mem::Workspace, Device::CPU), v = zeros({n}, Mem::Workspace, Device::CPU);
  OptimizerState state{named_views(whole, m), named_views(whole, v), 0};
  bool with_optimizer =
      load_checkpoint_shards(whole, comm_.tp, dir, named_views(whole, weights), &state);
  load_flat(Part::Params, part_of(whole, weights, model_));
  load_flat(Part::ExpAvg, part_of(whole, m, model_));
  load_flat(Part::ExpAvgSq, part_of(whole, v, model_));
  adamw_.steps = with_optimizer ? state.step : 0;
  auto adam = state.metadata.find(kAdamSteps);
  if (with_optimizer && adam != state.metadata.end())
    adamw_.steps = (int64_t)parse_number(adam->second, dir + "/optimizer.safetensors " + kAdamSteps,
                                         0, (double)state.step, true);
  if (run_state) *run_state = state.metadata;
  return with_optimizer ? state.step : 0;
}
