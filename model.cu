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

// Calls fn(unit, name, shape, view) for every parameter of `w`, in HF order, which is also the
// flat buffer's order; `unit` indexes Model::units. The one place that order is written down.
template <class Fn>
static void for_each_param(const ModelConfig& c, Weights& w, Fn fn) {
  int64_t V = c.vocab, D = c.d_model, F = c.ffn, hd = c.head_dim();
  int64_t q_dim = c.heads * hd, kv_dim = c.kv_heads * hd;
  fn(0, "model.embed_tokens.weight", {V, D}, w.embed);
  for (int l = 0; l < c.layers; l++) {
    std::string p = "model.layers." + std::to_string(l) + ".";
    BlockWeights& b = w.blocks[l];
    fn(l + 1, p + "input_layernorm.weight", {D}, b.attn_norm);
    fn(l + 1, p + "self_attn.q_proj.weight", {q_dim, D}, b.wq);
    fn(l + 1, p + "self_attn.k_proj.weight", {kv_dim, D}, b.wk);
    fn(l + 1, p + "self_attn.v_proj.weight", {kv_dim, D}, b.wv);
    fn(l + 1, p + "self_attn.o_proj.weight", {D, q_dim}, b.wo);
    fn(l + 1, p + "post_attention_layernorm.weight", {D}, b.mlp_norm);
    fn(l + 1, p + "mlp.gate_proj.weight", {F, D}, b.w_gate);
    fn(l + 1, p + "mlp.up_proj.weight", {F, D}, b.w_up);
    fn(l + 1, p + "mlp.down_proj.weight", {D, F}, b.w_down);
  }
  fn(c.layers + 1, "model.norm.weight", {D}, w.final_norm);
  if (!c.tie_embeddings)
    fn(c.layers + 1, "lm_head.weight", {V, D}, w.lm_head);  // HF omits it when tied
}

static Tensor unbound(const std::vector<int64_t>& shape) {
  Tensor t;
  t.shape = shape;
  return t;
}

Model build_model_layout(const ModelConfig& cfg) {
  validate_model_config(cfg);
  Model m;
  m.cfg = cfg;
  m.w.blocks.resize(cfg.layers);
  m.g.blocks.resize(cfg.layers);
  m.units.resize(cfg.layers + 2);
  int64_t offset = 0;
  auto add = [&](int u, const std::string& name, const std::vector<int64_t>& shape, Tensor&) {
    ModelUnit& unit = m.units[u];
    if (unit.count++ == 0) unit.offset = offset, unit.first = (int)m.named_params.size();
    Tensor view = unbound(shape);
    m.named_params.push_back({name, view});
    m.named_grads.push_back({name, view});
    m.offsets.push_back(offset);
    offset += view.numel();
    unit.numel = offset - unit.offset;
  };
  for_each_param(cfg, m.w, add);
  PICO_ASSERT(offset == parameter_count(cfg), "parameter layout disagrees with parameter_count");
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
  auto bind = [&](int pu, const std::string&, const std::vector<int64_t>& shape, Tensor& view) {
    int i = index++;
    if (pu != u) return;
    view = base.defined() ? base.view(m.offsets[i] - unit.offset, shape) : unbound(shape);
    named[i].tensor = view;
  };
  for_each_param(m.cfg, w, bind);
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
    Tensor slice = out.view(begin - first, {end - begin});
    bool is_norm = p.tensor.dim() == 1;
    if (is_norm)
      fill_(slice, 1.0f);
    else
      init_normal(slice, seed, p.name, m.cfg.init_std, begin - m.offsets[i]);
  }
}

std::vector<NamedTensor> named_views(const Model& m, const Tensor& flat) {
  std::vector<NamedTensor> views;
  for (size_t i = 0; i < m.named_params.size(); i++)
    views.push_back(
        {m.named_params[i].name, flat.view(m.offsets[i], m.named_params[i].tensor.shape)});
  return views;
}

Model build_model(const ModelConfig& cfg, Device device, uint64_t seed) {
  Model m = build_model_layout(cfg);
  int64_t n = parameter_count(cfg);
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

static AttentionShape attention_shape(const ModelConfig& c, int B, int T) {
  return {B, T, c.heads, c.kv_heads, c.head_dim()};
}

// Fills every field of `a` (a.x must be set) and writes the block's output into x_out [N, D].
static void block_forward(const Context& ctx, const ModelConfig& c, const BlockWeights& w,
                          BlockActivations& a, const Tensor& positions, int B, int T,
                          const Tensor& x_out) {
  Device d = ctx.device;
  int64_t N = (int64_t)B * T, D = c.d_model, hd = c.head_dim();
  a.norm1 = act({N, D}, d), a.rstd1 = act({N}, d);
  rmsnorm_forward(ctx, a.norm1, a.rstd1, a.x, w.attn_norm, c.norm_eps);
  a.q = act({N, c.heads * hd}, d);
  a.k = act({N, c.kv_heads * hd}, d);
  a.v = act({N, c.kv_heads * hd}, d);
  linear_forward(ctx, a.q, a.norm1, w.wq);
  linear_forward(ctx, a.k, a.norm1, w.wk);
  linear_forward(ctx, a.v, a.norm1, w.wv);
  rope_forward(ctx, a.q.reshape({N, c.heads, hd}), positions, c.rope_theta);
  rope_forward(ctx, a.k.reshape({N, c.kv_heads, hd}), positions, c.rope_theta);
  a.attn = act({N, c.heads * hd}, d);
  a.probs = act({B, c.heads, T, T}, d);
  AttentionShape s = attention_shape(c, B, T);
  attention_forward(ctx, a.attn.reshape({N, c.heads, hd}), a.probs,
                    a.q.reshape({N, c.heads, hd}), a.k.reshape({N, c.kv_heads, hd}),
                    a.v.reshape({N, c.kv_heads, hd}), s);
  Tensor proj = work({N, D}, d);  // [N, D] attention or MLP output before its residual
  linear_forward(ctx, proj, a.attn, w.wo);
  a.x_mid = act({N, D}, d);
  residual_forward(ctx, a.x_mid, a.x, proj);

  a.norm2 = act({N, D}, d), a.rstd2 = act({N}, d);
  rmsnorm_forward(ctx, a.norm2, a.rstd2, a.x_mid, w.mlp_norm, c.norm_eps);
  a.gate = act({N, c.ffn}, d), a.up = act({N, c.ffn}, d), a.act = act({N, c.ffn}, d);
  linear_forward(ctx, a.gate, a.norm2, w.w_gate);
  linear_forward(ctx, a.up, a.norm2, w.w_up);
  swiglu_forward(ctx, a.act, a.gate, a.up);
  linear_forward(ctx, proj, a.act, w.w_down);
  residual_forward(ctx, x_out, a.x_mid, proj);
}

// What each recompute mode keeps after the forward (Playbook §2.6).
static void drop_for_recompute(BlockActivations& a, Recompute mode) {
  if (mode == Recompute::Selective) a.probs = Tensor();  // the s^2 term: recomputed
  if (mode == Recompute::Full) a = BlockActivations{a.x};  // only the block input
}

static void run_hook(const std::function<void(int)>& hook, int i) {
  if (hook) hook(i);
}

float model_forward(const Context& ctx, const Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode, const UnitHooks& hooks) {
  const ModelConfig& c = model.cfg;
  Device d = ctx.device;
  int64_t N = (int64_t)B * T, D = c.d_model;
  acts = Activations{};
  acts.B = B, acts.T = T;
  acts.ids = empty({N}, Mem::Activations, d, DType::I32);
  from_host(acts.ids, ids);
  std::vector<int32_t> pos(N);
  for (int64_t i = 0; i < N; i++) pos[i] = (int32_t)(i % T);
  acts.positions = empty({N}, Mem::Activations, d, DType::I32);
  from_host(acts.positions, pos.data());

  Tensor x = act({N, D}, d);  // [N, D] the residual stream
  run_hook(hooks.before_forward, -1);
  embedding_forward(ctx, x, acts.ids, model.w.embed);
  run_hook(hooks.after_forward, -1);
  acts.blocks.resize(c.layers);
  for (int l = 0; l < c.layers; l++) {
    BlockActivations& a = acts.blocks[l];
    a.x = x;
    x = act({N, D}, d);
    run_hook(hooks.before_forward, l);
    block_forward(ctx, c, model.w.blocks[l], a, acts.positions, B, T, x);
    run_hook(hooks.after_forward, l);
    drop_for_recompute(a, mode);
  }
  acts.x_final = x;
  acts.normf = act({N, D}, d), acts.rstdf = act({N}, d);
  run_hook(hooks.before_forward, c.layers);
  rmsnorm_forward(ctx, acts.normf, acts.rstdf, x, model.w.final_norm, c.norm_eps);
  acts.logits = act({N, c.vocab}, d);
  linear_forward(ctx, acts.logits, acts.normf, model.w.lm_head);
  run_hook(hooks.after_forward, c.layers);
  if (!targets) return 0.0f;
  acts.targets = empty({N}, Mem::Activations, d, DType::I32);
  from_host(acts.targets, targets);
  acts.losses = act({N}, d);
  cross_entropy_forward(ctx, acts.losses, acts.logits, acts.targets);
  return sum(ctx, acts.losses);
}

// ----------------------------------------------------------------------------
// Backward

// Scratch gradients, allocated once per backward pass and reused by every block.
struct BackwardScratch {
  Tensor d_norm;          // [N, D]
  Tensor d_attn;          // [N, Hq*hd]
  Tensor dq, dk, dv;      // [N, Hq*hd], [N, Hkv*hd] x2
  Tensor d_act, d_gate, d_up;  // [N, F] x3
  Tensor d_probs;         // [B, Hq, T, T]
};

// dres [N, D] holds d(block output) on entry and d(block input) on exit.
static void block_backward(const Context& ctx, const ModelConfig& c, const BlockWeights& w,
                           const BlockWeights& g, BlockActivations& a, const Tensor& positions,
                           int B, int T, const Tensor& dres, BackwardScratch& s) {
  int64_t N = (int64_t)B * T, hd = c.head_dim();
  // MLP: x_out = x_mid + down(swiglu(gate(n2), up(n2))), n2 = rmsnorm(x_mid)
  linear_backward(ctx, s.d_act, g.w_down, dres, a.act, w.w_down);
  swiglu_backward(ctx, s.d_gate, s.d_up, s.d_act, a.gate, a.up);
  linear_backward(ctx, s.d_norm, g.w_gate, s.d_gate, a.norm2, w.w_gate);
  linear_backward(ctx, s.d_norm, g.w_up, s.d_up, a.norm2, w.w_up, /*accumulate_dx=*/true);
  rmsnorm_backward(ctx, dres, g.mlp_norm, s.d_norm, a.x_mid, w.mlp_norm, a.rstd2);  // += : residual

  // Attention: x_mid = x + o(attn(rope(q(n1)), rope(k(n1)), v(n1))), n1 = rmsnorm(x)
  linear_backward(ctx, s.d_attn, g.wo, dres, a.attn, w.wo);
  AttentionShape shape = attention_shape(c, B, T);
  Tensor q3 = a.q.reshape({N, c.heads, hd}), k3 = a.k.reshape({N, c.kv_heads, hd});
  Tensor v3 = a.v.reshape({N, c.kv_heads, hd});
  if (!a.probs.defined()) {  // selective recompute: rebuild the probabilities from q and k
    a.probs = act({B, c.heads, T, T}, ctx.device);
    attention_forward(ctx, s.dq.reshape({N, c.heads, hd}), a.probs, q3, k3, v3, shape);
  }
  attention_backward(ctx, s.dq.reshape({N, c.heads, hd}), s.dk.reshape({N, c.kv_heads, hd}),
                     s.dv.reshape({N, c.kv_heads, hd}), s.d_attn.reshape({N, c.heads, hd}), q3,
                     k3, v3, a.probs, s.d_probs, shape);
  rope_backward(ctx, s.dq.reshape({N, c.heads, hd}), positions, c.rope_theta);
  rope_backward(ctx, s.dk.reshape({N, c.kv_heads, hd}), positions, c.rope_theta);
  linear_backward(ctx, s.d_norm, g.wq, s.dq, a.norm1, w.wq);
  linear_backward(ctx, s.d_norm, g.wk, s.dk, a.norm1, w.wk, true);
  linear_backward(ctx, s.d_norm, g.wv, s.dv, a.norm1, w.wv, true);
  rmsnorm_backward(ctx, dres, g.attn_norm, s.d_norm, a.x, w.attn_norm, a.rstd1);
}

void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks) {
  const ModelConfig& c = model.cfg;
  Device d = ctx.device;
  int B = acts.B, T = acts.T;
  int64_t N = (int64_t)B * T, D = c.d_model, hd = c.head_dim();

  // Head: loss = loss_scale * sum CE(lm_head(rmsnorm(x_final)))
  run_hook(hooks.before_backward, c.layers);
  cross_entropy_backward(ctx, acts.logits, acts.logits, acts.targets, loss_scale);  // in place
  Tensor dres = zeros({N, D}, Mem::Workspace, d);  // [N, D] gradient of the residual stream
  Tensor d_normf = work({N, D}, d);
  linear_backward(ctx, d_normf, model.g.lm_head, acts.logits, acts.normf, model.w.lm_head);
  acts.logits = acts.normf = Tensor();
  rmsnorm_backward(ctx, dres, model.g.final_norm, d_normf, acts.x_final, model.w.final_norm,
                   acts.rstdf);
  d_normf = Tensor();
  run_hook(hooks.after_backward, c.layers);

  BackwardScratch s;
  s.d_norm = work({N, D}, d), s.d_attn = work({N, c.heads * hd}, d);
  s.dq = work({N, c.heads * hd}, d);
  s.dk = work({N, c.kv_heads * hd}, d), s.dv = work({N, c.kv_heads * hd}, d);
  s.d_act = work({N, c.ffn}, d), s.d_gate = work({N, c.ffn}, d), s.d_up = work({N, c.ffn}, d);
  s.d_probs = work({B, c.heads, T, T}, d);
  for (int l = c.layers - 1; l >= 0; l--) {
    BlockActivations& a = acts.blocks[l];
    run_hook(hooks.before_backward, l);
    if (mode == Recompute::Full) {  // rebuild this block's activations from its input
      Tensor x_out = work({N, D}, d);
      block_forward(ctx, c, model.w.blocks[l], a, acts.positions, B, T, x_out);
    }
    block_backward(ctx, c, model.w.blocks[l], model.g.blocks[l], a, acts.positions, B, T, dres, s);
    a = BlockActivations{};  // this micro-batch no longer needs block l's activations
    run_hook(hooks.after_backward, l);
  }
  run_hook(hooks.before_backward, -1);
  embedding_backward(ctx, model.g.embed, acts.ids, dres);  // reads no weights, only ids
  run_hook(hooks.after_backward, -1);
  acts = Activations{};
}
