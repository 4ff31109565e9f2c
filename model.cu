// model.cu: a tiny Llama with hand-written forward and backward (Playbook §2.1, §2.5, §2.6).
// One block: x -> RMSNorm -> q,k,v (RoPE on q,k) -> causal GQA attention -> o -> +x
//            -> RMSNorm -> SwiGLU MLP -> +residual.
// The one idea: backward is the forward read in reverse, and what it needs from the forward
// (the saved activations) is a choice: keep everything, recompute the attention core
// (selective), or keep only each block's input and recompute the whole block (full).
#include "model.cuh"

#include <algorithm>

#include "ops.cuh"

// ----------------------------------------------------------------------------
// Configuration

ModelConfig model_preset(const std::string& name) {
  ModelConfig c;
  c.preset = name;
  if (name == "tiny") return c;  // 0.85M parameters: trains in minutes on 2 CPU cores
  if (name == "medium") {        // 25M parameters: the CPU benchmark's config
    c.d_model = 512, c.layers = 8, c.heads = 8, c.kv_heads = 4, c.ffn = 1536, c.seq = 256;
    return c;
  }
  if (name == "smollm-135m") {  // SmolLM-135M's shape
    c.vocab = 49152, c.d_model = 576, c.layers = 30, c.heads = 9, c.kv_heads = 3;
    c.ffn = 1536, c.seq = 2048, c.tie_embeddings = true;
    return c;
  }
  if (name == "llama-1b") {  // Llama-3.2-1B's shape
    c.vocab = 128256, c.d_model = 2048, c.layers = 16, c.heads = 32, c.kv_heads = 8;
    c.ffn = 8192, c.seq = 2048, c.rope_theta = 500000.0f, c.tie_embeddings = true;
    return c;
  }
  std::string known;
  for (auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--model " + name + ": unknown preset; choose one of " + known);
}
std::vector<std::string> model_preset_names() {
  return {"tiny", "medium", "smollm-135m", "llama-1b"};
}

void validate_model_config(const ModelConfig& c) {
  auto positive = [](int v, const char* flag) {
    if (v <= 0) throw UsageError(std::string(flag) + " " + std::to_string(v) + ": must be > 0");
  };
  positive(c.vocab, "--vocab"), positive(c.d_model, "--d-model"), positive(c.layers, "--layers");
  positive(c.heads, "--heads"), positive(c.kv_heads, "--kv-heads"), positive(c.ffn, "--ffn");
  positive(c.seq, "--seq");
  if (c.d_model % c.heads)
    throw UsageError("--heads " + std::to_string(c.heads) + " does not divide --d-model " +
                     std::to_string(c.d_model) + ": pick a head count that divides it");
  if (c.heads % c.kv_heads)
    throw UsageError("--kv-heads " + std::to_string(c.kv_heads) + " does not divide --heads " +
                     std::to_string(c.heads) + ": grouped-query attention shares each key/value "
                     "head among heads/kv_heads query heads");
  if (c.head_dim() % 2)
    throw UsageError("--d-model / --heads = " + std::to_string(c.head_dim()) +
                     " is odd: RoPE rotates pairs, so the head dimension must be even");
}

int64_t parameter_count(const ModelConfig& c) {
  int64_t V = c.vocab, D = c.d_model, F = c.ffn, hd = c.head_dim();
  int64_t block = 2 * D + D * hd * (2 * c.heads + 2 * c.kv_heads) + 3 * D * F;
  return V * D + c.layers * block + D + (c.tie_embeddings ? 0 : V * D);
}

Recompute parse_recompute(const std::string& flag) {
  if (flag == "none") return Recompute::None;
  if (flag == "selective") return Recompute::Selective;
  if (flag == "full") return Recompute::Full;
  throw UsageError("--recompute " + flag + ": expected none, selective or full");
}
const char* recompute_name(Recompute r) {
  return r == Recompute::None ? "none" : r == Recompute::Selective ? "selective" : "full";
}

// ----------------------------------------------------------------------------
// Parameters: one flat buffer, HF names, layout-free initialisation (DESIGN 5)

// Calls fn(unit, name, shape, layout, view) for every parameter of `w`, in HF order, which is
// also the flat buffer's order; `unit` indexes Model::units, `shape` is this rank's shard and
// `layout` where it sits in the whole tensor (Playbook §5.3: q, k, v, gate, up and the LM head
// split by output rows, o and down by input columns, the embedding by vocabulary rows, norms
// whole). The one place that order and those splits are written down.
template <class Fn>
static void for_each_param(const ModelConfig& c, const LocalDims& L, Weights& w, Fn fn) {
  int64_t V = c.vocab, D = c.d_model, F = c.ffn, hd = c.head_dim();
  auto rows = [&](std::vector<int64_t> whole, int64_t row0, bool writer = true) {
    return TpSlice{whole, row0, 0, writer};
  };
  auto cols = [&](std::vector<int64_t> whole, int64_t col0) { return TpSlice{whole, 0, col0, true}; };
  TpSlice norm{{D}, 0, 0, L.tp_rank == 0};  // every tp rank holds it; rank 0 saves it
  bool kv_writer = L.tp_rank % L.kv_replicas == 0;
  fn(0, "model.embed_tokens.weight", {L.vocab, D}, rows({V, D}, L.vocab0), w.embed);
  for (int l = 0; l < c.layers; l++) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    BlockWeights& b = w.blocks[l];
    fn(l + 1, p + "input_layernorm.weight", {D}, norm, b.attn_norm);
    fn(l + 1, p + "self_attn.q_proj.weight", {L.heads * hd, D},
       rows({c.heads * hd, D}, L.head0 * hd), b.wq);
    fn(l + 1, p + "self_attn.k_proj.weight", {L.kv_heads * hd, D},
       rows({c.kv_heads * hd, D}, L.kv_head0 * hd, kv_writer), b.wk);
    fn(l + 1, p + "self_attn.v_proj.weight", {L.kv_heads * hd, D},
       rows({c.kv_heads * hd, D}, L.kv_head0 * hd, kv_writer), b.wv);
    fn(l + 1, p + "self_attn.o_proj.weight", {D, L.heads * hd}, cols({D, c.heads * hd}, L.head0 * hd),
       b.wo);
    fn(l + 1, p + "post_attention_layernorm.weight", {D}, norm, b.mlp_norm);
    fn(l + 1, p + "mlp.gate_proj.weight", {L.ffn, D}, rows({F, D}, L.ffn0), b.w_gate);
    fn(l + 1, p + "mlp.up_proj.weight", {L.ffn, D}, rows({F, D}, L.ffn0), b.w_up);
    fn(l + 1, p + "mlp.down_proj.weight", {D, L.ffn}, cols({D, F}, L.ffn0), b.w_down);
  }
  fn(c.layers + 1, "model.norm.weight", {D}, norm, w.final_norm);
  if (!c.tie_embeddings)  // HF omits lm_head.weight when tied
    fn(c.layers + 1, "lm_head.weight", {L.vocab, D}, rows({V, D}, L.vocab0), w.lm_head);
}

// ----------------------------------------------------------------------------
// Tensor-parallel shard of the model (Playbook §5.3): heads, ffn and vocabulary split over tp

LocalDims local_dims(const ModelConfig& c, int rank, int size) {
  LocalDims L;
  L.tp_rank = rank;
  L.heads = c.heads / size, L.head0 = rank * L.heads;
  L.ffn = c.ffn / size, L.ffn0 = rank * L.ffn;
  L.vocab = c.vocab / size, L.vocab0 = rank * L.vocab;
  if (c.kv_heads % size == 0) {  // each rank its own key/value heads
    L.kv_heads = c.kv_heads / size, L.kv_head0 = rank * L.kv_heads, L.kv_replicas = 1;
  } else {  // more ranks than kv heads: the kv head of this rank's query heads, replicated
    L.kv_heads = 1, L.kv_replicas = size / c.kv_heads, L.kv_head0 = rank / L.kv_replicas;
  }
  return L;
}

void validate_tensor_parallel(const ModelConfig& c, int tp, bool sp) {
  auto divides = [&](int n, const char* flag) {
    if (n % tp)
      throw UsageError("--tp " + std::to_string(tp) + " does not divide " + flag + " " +
                       std::to_string(n) + ": tensor parallelism splits it evenly (picoscale "
                       "does not pad); pick a --tp that divides it");
  };
  divides(c.heads, "--heads");
  divides(c.ffn, "--ffn");
  divides(c.vocab, "--vocab");
  if (c.kv_heads % tp && tp % c.kv_heads)
    throw UsageError("--tp " + std::to_string(tp) + " and --kv-heads " +
                     std::to_string(c.kv_heads) + ": one must divide the other (key/value heads "
                     "are split over tp, or replicated when tp exceeds them)");
  if (sp && c.seq % tp)
    throw UsageError("--sp with --seq " + std::to_string(c.seq) + " and --tp " +
                     std::to_string(tp) + ": sequence parallelism splits every sequence's "
                     "tokens over tp, so --tp must divide --seq");
}

static Tensor unbound(const std::vector<int64_t>& shape) {
  Tensor t;
  t.shape = shape;
  return t;
}

Model build_model_layout(const ModelConfig& cfg, const TensorParallel& tp) {
  validate_model_config(cfg);
  Model m;
  m.cfg = cfg;
  m.tp = tp;
  m.local = local_dims(cfg, tp.rank(), tp.size());
  m.w.blocks.resize(cfg.layers);
  m.g.blocks.resize(cfg.layers);
  m.units.resize(cfg.layers + 2);
  int64_t offset = 0;
  auto add = [&](int u, const std::string& name, const std::vector<int64_t>& shape,
                 const TpSlice& layout, Tensor&) {
    ModelUnit& unit = m.units[u];
    m.layouts.push_back(layout);
    if (unit.count++ == 0) unit.offset = offset, unit.first = (int)m.named_params.size();
    Tensor view = unbound(shape);
    m.named_params.push_back({name, view});
    m.named_grads.push_back({name, view});
    m.offsets.push_back(offset);
    offset += view.numel();
    unit.numel = offset - unit.offset;
  };
  for_each_param(cfg, m.local, m.w, add);
  m.num_params = offset;
  PICO_ASSERT(tp.size() > 1 || offset == parameter_count(cfg),
              "parameter layout disagrees with parameter_count");
  for (int u = 0; u < (int)m.units.size(); u++) {
    bind_unit_params(m, u, Tensor());
    bind_unit_grads(m, u, Tensor());
  }
  return m;
}

static void bind_unit(Model& m, int u, const Tensor& base, Weights& w,
                      std::vector<NamedTensor>& named) {
  const ModelUnit& unit = m.units[u];
  PICO_ASSERT(!base.defined() || base.numel() >= unit.numel,
              "unit " + std::to_string(u) + " needs " + std::to_string(unit.numel) + " elements");
  int index = 0;
  auto bind = [&](int pu, const std::string&, const std::vector<int64_t>& shape,
                  const TpSlice&, Tensor& view) {
    int i = index++;
    if (pu != u) return;
    view = base.defined() ? base.view(m.offsets[i] - unit.offset, shape) : unbound(shape);
    named[i].tensor = view;
  };
  for_each_param(m.cfg, m.local, w, bind);
  if (m.cfg.tie_embeddings && u == 0) w.lm_head = w.embed;
}
void bind_unit_params(Model& m, int u, const Tensor& base) {
  bind_unit(m, u, base, m.w, m.named_params);
}
void bind_unit_grads(Model& m, int u, const Tensor& base) {
  bind_unit(m, u, base, m.g, m.named_grads);
}

void init_parameters(const Model& m, uint64_t seed, const Tensor& out, int64_t first) {
  int64_t last = first + out.numel();
  for (size_t i = 0; i < m.named_params.size(); i++) {
    const NamedTensor& p = m.named_params[i];
    int64_t begin = std::max(first, m.offsets[i]),
            end = std::min(last, m.offsets[i] + p.tensor.numel());
    if (begin >= end) continue;
    if (p.tensor.dim() == 1) {  // norm weights start at 1
      fill_(out.view(begin - first, {end - begin}), 1.0f);
      continue;
    }
    // Element k of this shard is element (row0 + k / cols) * full_cols + col0 + k % cols of the
    // whole tensor: draw each run of the shard's rows from its place in the whole (DESIGN 5).
    const TpSlice& layout = m.layouts[i];
    int64_t cols = p.tensor.size(1);
    for (int64_t k = begin - m.offsets[i]; k < end - m.offsets[i];) {
      int64_t row = k / cols, left = end - m.offsets[i] - k;
      // Whole rows of the whole tensor are contiguous in it: one run; a column block, per row.
      int64_t run = cols == layout.full_cols() ? left : std::min(cols - k % cols, left);
      int64_t whole = (layout.row0 + row) * layout.full_cols() + layout.col0 + k % cols;
      init_normal(out.view(m.offsets[i] + k - first, {run}), seed, p.name, m.cfg.init_std, whole);
      k += run;
    }
  }
}

std::vector<NamedTensor> named_views(const Model& m, const Tensor& flat) {
  std::vector<NamedTensor> views;
  for (size_t i = 0; i < m.named_params.size(); i++)
    views.push_back(
        {m.named_params[i].name, flat.view(m.offsets[i], m.named_params[i].tensor.shape)});
  return views;
}

Model build_model(const ModelConfig& cfg, Device device, uint64_t seed, const TensorParallel& tp) {
  Model m = build_model_layout(cfg, tp);
  int64_t n = m.num_params;
  m.params = empty({n}, Mem::Params, device);
  m.grads = zeros({n}, Mem::Grads, device);
  for (int u = 0; u < (int)m.units.size(); u++) {
    const ModelUnit& unit = m.units[u];
    bind_unit_params(m, u, m.params.view(unit.offset, {unit.numel}));
    bind_unit_grads(m, u, m.grads.view(unit.offset, {unit.numel}));
  }
  init_parameters(m, seed, m.params, 0);
  return m;
}

// ----------------------------------------------------------------------------
// Forward

static Tensor act(std::vector<int64_t> shape, Device d) { return empty(shape, Mem::Activations, d); }
static Tensor work(std::vector<int64_t> shape, Device d) { return empty(shape, Mem::Workspace, d); }

static AttentionShape attention_shape(const Model& m, int B, int T) {
  return {B, T, m.local.heads, m.local.kv_heads, m.cfg.head_dim()};
}

// The full [N, D] input of a column-parallel linear from its [n_in, D] saved form: the same
// tensor without SP; with SP all-gathered again (the backward re-gathers rather than keeping
// the full tensor, as Megatron does, so activations stay sharded).
static Tensor tp_input(const Model& m, const Context& ctx, const Tensor& x, int64_t N) {
  if (!m.tp.sp) return x;
  Tensor full = work({N, x.size(1)}, ctx.device);
  tp_region_enter_forward(m.tp, ctx, x, full);
  return full;
}

// Fills every field of `a` (a.x must be set) and writes the block's output into x_out.
// x, x_mid, norms: [n, D] with n = N/tp under SP, else N. q, k, v, attn, gate, up, act: [N, local].
static void block_forward(const Context& ctx, const Model& m, const BlockWeights& w,
                          BlockActivations& a, const Tensor& positions, int B, int T,
                          const Tensor& x_out) {
  const ModelConfig& c = m.cfg;
  const LocalDims& L = m.local;
  Device d = ctx.device;
  int64_t N = (int64_t)B * T, n = sp_tokens(m.tp, N), D = c.d_model, hd = c.head_dim();
  // Attention: x_mid = x + o(attn(rope(q(n1)), rope(k(n1)), v(n1))), n1 = rmsnorm(x)
  a.norm1 = act({n, D}, d), a.rstd1 = act({n}, d);
  rmsnorm_forward(ctx, a.norm1, a.rstd1, a.x, w.attn_norm, c.norm_eps);
  Tensor h = tp_input(m, ctx, a.norm1, N);  // [N, D]: enter the tensor-parallel region
  a.q = act({N, L.heads * hd}, d);
  a.k = act({N, L.kv_heads * hd}, d), a.v = act({N, L.kv_heads * hd}, d);
  // q, k, v: ColumnParallelLinear (Megatron): weights split by output rows, so each rank
  // computes its own heads from the full input h; no communication until the row-parallel o.
  linear_forward(ctx, a.q, h, w.wq);
  linear_forward(ctx, a.k, h, w.wk);
  linear_forward(ctx, a.v, h, w.wv);
  rope_forward(ctx, a.q.reshape({N, L.heads, hd}), positions, c.rope_theta);
  rope_forward(ctx, a.k.reshape({N, L.kv_heads, hd}), positions, c.rope_theta);
  a.attn = act({N, L.heads * hd}, d);
  a.probs = act({B, L.heads, T, T}, d);
  attention_forward(ctx, a.attn.reshape({N, L.heads, hd}), a.probs,
                    a.q.reshape({N, L.heads, hd}), a.k.reshape({N, L.kv_heads, hd}),
                    a.v.reshape({N, L.kv_heads, hd}), attention_shape(m, B, T));
  // o: RowParallelLinear: weight split by input columns (this rank's heads), so its output is
  // a partial sum, completed by leaving the region (f*: all-reduce; g*: reduce-scatter).
  Tensor partial = work({N, D}, d);
  Tensor out = m.tp.sp ? work({n, D}, d) : partial;
  linear_forward(ctx, partial, a.attn, w.wo);
  tp_region_exit_forward(m.tp, ctx, partial, out);  // leave: all-reduce or reduce-scatter
  a.x_mid = act({n, D}, d);
  residual_forward(ctx, a.x_mid, a.x, out);

  // MLP: x_out = x_mid + down(swiglu(gate(n2), up(n2))), n2 = rmsnorm(x_mid)
  a.norm2 = act({n, D}, d), a.rstd2 = act({n}, d);
  rmsnorm_forward(ctx, a.norm2, a.rstd2, a.x_mid, w.mlp_norm, c.norm_eps);
  h = tp_input(m, ctx, a.norm2, N);
  a.gate = act({N, L.ffn}, d), a.up = act({N, L.ffn}, d), a.act = act({N, L.ffn}, d);
  // gate, up: ColumnParallelLinear (this rank's ffn columns); down: RowParallelLinear.
  linear_forward(ctx, a.gate, h, w.w_gate);
  linear_forward(ctx, a.up, h, w.w_up);
  swiglu_forward(ctx, a.act, a.gate, a.up);
  linear_forward(ctx, partial, a.act, w.w_down);
  tp_region_exit_forward(m.tp, ctx, partial, out);
  residual_forward(ctx, x_out, a.x_mid, out);
}

// What each recompute mode keeps after the forward (Playbook §2.6).
static void drop_for_recompute(BlockActivations& a, Recompute mode) {
  if (mode == Recompute::Selective) a.probs = Tensor();  // the s^2 term: recomputed
  if (mode == Recompute::Full) a = BlockActivations{a.x};  // only the block input
}

static void run_hook(const std::function<void(int)>& hook, int i) {
  if (hook) hook(i);
}

static Tensor device_ints(const std::vector<int32_t>& v, Device d) {
  Tensor t = empty({(int64_t)v.size()}, Mem::Activations, d, DType::I32);
  from_host(t, v.data());
  return t;
}

float model_forward(const Context& ctx, const Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode, const UnitHooks& hooks) {
  const ModelConfig& c = model.cfg;
  const LocalDims& L = model.local;
  Device d = ctx.device;
  int64_t N = (int64_t)B * T, n = sp_tokens(model.tp, N), D = c.d_model;
  acts = Activations{};
  acts.B = B, acts.T = T;
  // Vocab-parallel embedding: this rank looks up the ids of its vocabulary slice (zero rows
  // for the others) and the partial rows are summed over tp (or reduce-scattered under SP).
  acts.ids = device_ints(local_vocab_ids(ids, N, L.vocab0, L.vocab), d);
  std::vector<int32_t> pos(N);
  for (int64_t i = 0; i < N; i++) pos[i] = (int32_t)(i % T);
  acts.positions = device_ints(pos, d);

  Tensor rows = model.tp.size() > 1 ? work({N, D}, d) : Tensor();  // [N, D] partial rows
  Tensor x = act({n, D}, d);  // [n, D] the residual stream
  run_hook(hooks.before_forward, -1);
  embedding_forward(ctx, rows.defined() ? rows : x, acts.ids, model.w.embed);
  run_hook(hooks.after_forward, -1);
  if (rows.defined()) tp_region_exit_forward(model.tp, ctx, rows, x);  // sum over the slices
  rows = Tensor();
  acts.blocks.resize(c.layers);
  for (int l = 0; l < c.layers; l++) {
    BlockActivations& a = acts.blocks[l];
    a.x = x;
    x = act({n, D}, d);
    run_hook(hooks.before_forward, l);
    block_forward(ctx, model, model.w.blocks[l], a, acts.positions, B, T, x);
    run_hook(hooks.after_forward, l);
    drop_for_recompute(a, mode);
  }
  acts.x_final = x;
  acts.normf = act({n, D}, d), acts.rstdf = act({n}, d);
  run_hook(hooks.before_forward, c.layers);
  rmsnorm_forward(ctx, acts.normf, acts.rstdf, x, model.w.final_norm, c.norm_eps);
  acts.logits = act({N, L.vocab}, d);  // column-parallel LM head: this rank's vocabulary slice
  linear_forward(ctx, acts.logits, tp_input(model, ctx, acts.normf, N), model.w.lm_head);
  run_hook(hooks.after_forward, c.layers);
  if (!targets) return 0.0f;
  acts.targets = device_ints(local_vocab_ids(targets, N, L.vocab0, L.vocab), d);
  acts.losses = act({N}, d);
  acts.ce_stats = act({N, 2}, d);
  tp_cross_entropy_forward(model.tp, ctx, acts.losses, acts.ce_stats, acts.logits, acts.targets);
  return sum(ctx, acts.losses);
}

// ----------------------------------------------------------------------------
// Backward

// Scratch gradients, allocated once per backward pass and reused by every block.
struct BackwardScratch {
  Tensor d_full;               // [N, D] gradient of a row-parallel output (== dres without SP)
  Tensor d_norm_full;          // [N, D] gradient of a column-parallel input, partial over tp
  Tensor d_norm;               // [n, D] the same after leaving the region
  Tensor d_attn;               // [N, Hl*hd]
  Tensor dq, dk, dv;           // [N, Hl*hd], [N, KVl*hd] x2
  Tensor d_act, d_gate, d_up;  // [N, Fl] x3
  Tensor d_probs;              // [B, Hl, T, T]
  Tensor norm_part;            // [D] a norm weight's gradient before the sum over tp (SP)
  Tensor k_part, v_part;       // [KVl*hd, D] replicated k/v gradients before their sum
};

// A gradient that several tp ranks hold a copy of, each copy having seen part of the data:
// norm weights under SP (each rank normalised n of the N tokens) and key/value projections
// replicated when tp > kv heads (each copy served only this rank's query heads). Each
// micro-batch's part is summed over the copies, then added: slot `slot` of `slots` equal
// slots (one slot: every tp rank holds a copy; kv heads: the copies of one head share a slot).
static void add_replicated_grad(const Model& m, const Context& ctx, const Tensor& grad,
                                const Tensor& part, int slot, int slots) {
  if (slots == 1) {
    copy_to_tp_region_backward(m.tp, ctx, part);  // all-reduce over tp
  } else {
    Tensor all = zeros({slots * part.numel()}, Mem::Workspace, ctx.device);
    copy_(all.view(slot * part.numel(), {part.numel()}), part);
    copy_to_tp_region_backward(m.tp, ctx, all);
    copy_(part, all.view(slot * part.numel(), {part.numel()}));
  }
  axpy(ctx, grad, 1.0f, part);
}
// Where a norm weight's gradient goes first: straight into grad, or into a zeroed part (SP).
static Tensor norm_grad_target(const Model& m, const Tensor& grad, BackwardScratch& s) {
  if (!m.tp.sp) return grad;
  zero_(s.norm_part);
  return s.norm_part;
}

// dres [n, D] holds d(block output) on entry and d(block input) on exit.
static void block_backward(const Context& ctx, const Model& m, const BlockWeights& w,
                           const BlockWeights& g, BlockActivations& a, const Tensor& positions,
                           int B, int T, const Tensor& dres, BackwardScratch& s) {
  const ModelConfig& c = m.cfg;
  const LocalDims& L = m.local;
  int64_t N = (int64_t)B * T, hd = c.head_dim();
  // MLP
  tp_region_exit_backward(m.tp, ctx, dres, s.d_full);
  linear_backward(ctx, s.d_act, g.w_down, s.d_full, a.act, w.w_down);
  swiglu_backward(ctx, s.d_gate, s.d_up, s.d_act, a.gate, a.up);
  Tensor h = tp_input(m, ctx, a.norm2, N);
  linear_backward(ctx, s.d_norm_full, g.w_gate, s.d_gate, h, w.w_gate);
  linear_backward(ctx, s.d_norm_full, g.w_up, s.d_up, h, w.w_up, /*accumulate_dx=*/true);
  tp_region_enter_backward(m.tp, ctx, s.d_norm_full, s.d_norm);
  Tensor dw = norm_grad_target(m, g.mlp_norm, s);
  rmsnorm_backward(ctx, dres, dw, s.d_norm, a.x_mid, w.mlp_norm, a.rstd2);  // += : residual
  if (m.tp.sp) add_replicated_grad(m, ctx, g.mlp_norm, dw, 0, 1);

  // Attention
  tp_region_exit_backward(m.tp, ctx, dres, s.d_full);
  linear_backward(ctx, s.d_attn, g.wo, s.d_full, a.attn, w.wo);
  AttentionShape shape = attention_shape(m, B, T);
  Tensor q3 = a.q.reshape({N, L.heads, hd}), k3 = a.k.reshape({N, L.kv_heads, hd});
  Tensor v3 = a.v.reshape({N, L.kv_heads, hd});
  if (!a.probs.defined()) {  // selective recompute: rebuild the probabilities from q and k
    a.probs = act({B, L.heads, T, T}, ctx.device);
    attention_forward(ctx, s.dq.reshape({N, L.heads, hd}), a.probs, q3, k3, v3, shape);
  }
  attention_backward(ctx, s.dq.reshape({N, L.heads, hd}), s.dk.reshape({N, L.kv_heads, hd}),
                     s.dv.reshape({N, L.kv_heads, hd}), s.d_attn.reshape({N, L.heads, hd}), q3,
                     k3, v3, a.probs, s.d_probs, shape);
  rope_backward(ctx, s.dq.reshape({N, L.heads, hd}), positions, c.rope_theta);
  rope_backward(ctx, s.dk.reshape({N, L.kv_heads, hd}), positions, c.rope_theta);
  h = tp_input(m, ctx, a.norm1, N);
  bool replicated = L.kv_replicas > 1;
  if (replicated) zero_(s.k_part), zero_(s.v_part);
  linear_backward(ctx, s.d_norm_full, g.wq, s.dq, h, w.wq);
  linear_backward(ctx, s.d_norm_full, replicated ? s.k_part : g.wk, s.dk, h, w.wk, true);
  linear_backward(ctx, s.d_norm_full, replicated ? s.v_part : g.wv, s.dv, h, w.wv, true);
  if (replicated) {
    add_replicated_grad(m, ctx, g.wk, s.k_part, L.kv_head0, c.kv_heads);
    add_replicated_grad(m, ctx, g.wv, s.v_part, L.kv_head0, c.kv_heads);
  }
  tp_region_enter_backward(m.tp, ctx, s.d_norm_full, s.d_norm);
  dw = norm_grad_target(m, g.attn_norm, s);
  rmsnorm_backward(ctx, dres, dw, s.d_norm, a.x, w.attn_norm, a.rstd1);
  if (m.tp.sp) add_replicated_grad(m, ctx, g.attn_norm, dw, 0, 1);
}

void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks) {
  const ModelConfig& c = model.cfg;
  const LocalDims& L = model.local;
  Device d = ctx.device;
  int B = acts.B, T = acts.T;
  int64_t N = (int64_t)B * T, n = sp_tokens(model.tp, N), D = c.d_model, hd = c.head_dim();
  bool sp = model.tp.sp;
  BackwardScratch s;
  s.norm_part = work({D}, d);
  if (L.kv_replicas > 1) s.k_part = work({L.kv_heads * hd, D}, d), s.v_part = work({L.kv_heads * hd, D}, d);
  s.d_norm_full = work({N, D}, d);
  s.d_norm = sp ? work({n, D}, d) : s.d_norm_full;
  Tensor dres = zeros({n, D}, Mem::Workspace, d);  // [n, D] gradient of the residual stream
  s.d_full = sp ? work({N, D}, d) : dres;

  // Head: loss = loss_scale * sum CE(lm_head(rmsnorm(x_final)))
  run_hook(hooks.before_backward, c.layers);
  tp_cross_entropy_backward(model.tp, ctx, acts.logits, acts.logits, acts.ce_stats, acts.targets,
                            loss_scale);  // in place
  linear_backward(ctx, s.d_norm_full, model.g.lm_head, acts.logits,
                  tp_input(model, ctx, acts.normf, N), model.w.lm_head);
  acts.logits = acts.normf = Tensor();
  tp_region_enter_backward(model.tp, ctx, s.d_norm_full, s.d_norm);
  Tensor dw = norm_grad_target(model, model.g.final_norm, s);
  rmsnorm_backward(ctx, dres, dw, s.d_norm, acts.x_final, model.w.final_norm, acts.rstdf);
  if (sp) add_replicated_grad(model, ctx, model.g.final_norm, dw, 0, 1);
  run_hook(hooks.after_backward, c.layers);

  s.d_attn = work({N, L.heads * hd}, d), s.dq = work({N, L.heads * hd}, d);
  s.dk = work({N, L.kv_heads * hd}, d), s.dv = work({N, L.kv_heads * hd}, d);
  s.d_act = work({N, L.ffn}, d), s.d_gate = work({N, L.ffn}, d), s.d_up = work({N, L.ffn}, d);
  s.d_probs = work({B, L.heads, T, T}, d);
  for (int l = c.layers - 1; l >= 0; l--) {
    BlockActivations& a = acts.blocks[l];
    run_hook(hooks.before_backward, l);
    if (mode == Recompute::Full) {  // rebuild this block's activations from its input
      Tensor x_out = work({n, D}, d);
      block_forward(ctx, model, model.w.blocks[l], a, acts.positions, B, T, x_out);
    }
    block_backward(ctx, model, model.w.blocks[l], model.g.blocks[l], a, acts.positions, B, T, dres, s);
    a = BlockActivations{};  // this micro-batch no longer needs block l's activations
    run_hook(hooks.after_backward, l);
  }
  run_hook(hooks.before_backward, -1);
  tp_region_exit_backward(model.tp, ctx, dres, s.d_full);
  embedding_backward(ctx, model.g.embed, acts.ids, s.d_full);  // reads no weights, only ids
  run_hook(hooks.after_backward, -1);
  acts = Activations{};
}

// ----------------------------------------------------------------------------
// Activation memory (Playbook §2.5, §5.3, §6): the book's sbh(34 + 5as/h) for GPT in fp16
// becomes, for this Llama in fp32 (RMSNorm, SwiGLU, grouped-query heads, no dropout), per block
// and per token (N = B T tokens, n = N/tp under SP, else N; t = tp):
//   outside the tensor-parallel region, [n, D]: block input, norm1, x_mid, norm2 -> 16 D n
//     plus the two rstd vectors [n] -> 8 n
//   inside it, [N, .] / t: q and attention output 8 D, k and v 8 Hkv hd (when t exceeds the
//     kv heads each rank keeps one: 8 hd t), gate, up and the SwiGLU output 12 F, and the
//     [B, Hq/t, T, T] probabilities 4 Hq T   (the 5as/h term)
// so bytes = N (16 D + 8) / (sp ? t : 1) + N (8 D + 8 Hkv hd + 12 F + 4 Hq T) / t:
// the book's 10 + 24/t shape with TP (norms and residuals stay whole) and 34/t with TP+SP.
// Selective recomputation drops the probabilities; full keeps the block input only.
int64_t activation_bytes_per_block(const ModelConfig& c, int B, int T, int tp, bool sp,
                                   Recompute mode) {
  LocalDims L = local_dims(c, 0, tp);
  int64_t N = (int64_t)B * T, n = sp ? N / tp : N, D = c.d_model, hd = c.head_dim();
  if (mode == Recompute::Full) return 4 * n * D;
  int64_t outside = 4 * n * D * 4 + 2 * 4 * n;
  int64_t inside = 4 * N * (2 * L.heads * hd + 2 * L.kv_heads * hd + 3 * L.ffn);
  int64_t probs = mode == Recompute::Selective ? 0 : 4 * (int64_t)B * L.heads * T * T;
  return outside + inside + probs;
}

int64_t saved_bytes(const BlockActivations& a) {
  int64_t bytes = 0;
  for (const Tensor* t : {&a.x, &a.norm1, &a.rstd1, &a.q, &a.k, &a.v, &a.probs, &a.attn, &a.x_mid,
                          &a.norm2, &a.rstd2, &a.gate, &a.up, &a.act})
    if (t->defined()) bytes += t->nbytes();
  return bytes;
}
