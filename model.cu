// model.cu: a tiny Llama with hand-written forward and backward (Playbook §2.1, §2.5, §2.6).
// One block: x -> RMSNorm -> q,k,v (RoPE on q,k) -> causal GQA attention -> o -> +x
//            -> RMSNorm -> SwiGLU MLP -> +residual.
// The one idea: backward is the forward read in reverse, and what it needs from the forward
// (the saved activations) is a choice: keep everything, recompute the attention core
// (selective), or keep only each block's input and recompute the whole block (full).
// Guide: docs/first-steps.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <functional>
#include <numeric>
#include <optional>

#include "mixed_precision.cuh"
#include "model.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

// ----------------------------------------------------------------------------
// Configuration

static const std::vector<Choice<Recompute>> kRecomputes = {
    {"none", Recompute::None}, {"selective", Recompute::Selective}, {"full", Recompute::Full}};
Recompute parse_recompute(const std::string& flag) {
  return parse_choice("--recompute", flag, kRecomputes);
}
const char* recompute_name(Recompute r) {
  return choice_name(kRecomputes, r);
}
void add_model_flags(CLI::App& app, ModelOptions& o) {
  add_typed(flag_group(app, "First steps: the training step (Playbook §2)"), "--recompute",
            &o.recompute, parse_recompute, recompute_name(o.recompute),
            "activation recomputation (§2.6): none, selective (the attention core), full (each "
            "block from its input)");
}

// ----------------------------------------------------------------------------
// Parameters: one flat buffer, HF names, layout-free initialisation (DESIGN 5)

// Calls fn(unit, name, shape, layout, view) for every parameter of the stage, in HF order,
// which is also the flat buffer's order; `unit` indexes Model::units, `shape` is this rank's
// shard and `layout` where it sits in the whole tensor (Playbook §5.3: q, k, v, gate, up and the
// LM head split by output rows, o and down by input columns, the embedding by vocabulary rows,
// norms whole). The one place that order and those splits are written down. With `only` >= 0,
// the parameters of unit `only` alone, the other units passed over without a name made (binding
// one unit costs its own parameters, not the model's: 4096 blocks bind in milliseconds).
template <class Fn>
static void for_each_param(const ModelConfig& c, const std::vector<Stage>& chunks,
                           const LocalDims& L, const ExpertRange& X, Weights& w, Fn fn,
                           int only = -1) {
  int64_t V = c.vocab, D = c.d_model, F = c.ffn, hd = c.head_dim();
  auto rows = [&](std::vector<int64_t> whole, int64_t row0, bool writer = true) {
    return TpSlice{whole, row0, 0, writer};
  };
  auto cols = [&](std::vector<int64_t> whole, int64_t col0) {
    return TpSlice{whole, 0, col0, true};
  };
  TpSlice norm{{D}, 0, 0, L.tp_rank == 0};                // every tp rank holds it; rank 0 saves it
  const bool layer_norm = c.norm == NormKind::LayerNorm;  // a bias beside each norm's weight
  bool kv_writer = L.tp_rank % L.kv_replicas == 0;
  auto skip = [only](int first, int units) {
    return only >= 0 && (only < first || only >= first + units);
  };
  // fn for the unit's parameters only (a mixture's block binds its router apart from its experts)
  auto emit = [&](int u, const std::string& name, const std::vector<int64_t>& shape,
                  const TpSlice& layout, Tensor& view) {
    if (!skip(u, 1)) fn(u, name, shape, layout, view);
  };
  const int block_units = c.experts > 0 ? 2 : 1;  // a mixture's experts are a unit of their own
  int unit = 0, local = 0;                        // this rank's units and blocks, chunk after chunk
  for (const Stage& stage : chunks) {
    if (stage.embedding)
      emit(unit, "model.embed_tokens.weight", {L.vocab, D}, rows({V, D}, L.vocab0), w.embed);
    unit += stage.embedding;
    for (int l = stage.first_block; l < stage.last_block; l++, unit++) {
      BlockWeights& b = w.blocks[local++];
      if (skip(unit, block_units)) {
        unit += block_units - 1;
        continue;
      }
      std::string p = "model.layers." + std::to_string(l) + ".";
      emit(unit, p + "input_layernorm.weight", {D}, norm, b.attn_norm);
      if (layer_norm) emit(unit, p + "input_layernorm.bias", {D}, norm, b.attn_norm_bias);
      emit(unit, p + "self_attn.q_proj.weight", {L.heads * hd, D},
           rows({c.heads * hd, D}, L.head0 * hd), b.wq);
      emit(unit, p + "self_attn.k_proj.weight", {L.kv_heads * hd, D},
           rows({c.kv_heads * hd, D}, L.kv_head0 * hd, kv_writer), b.wk);
      emit(unit, p + "self_attn.v_proj.weight", {L.kv_heads * hd, D},
           rows({c.kv_heads * hd, D}, L.kv_head0 * hd, kv_writer), b.wv);
      emit(unit, p + "self_attn.o_proj.weight", {D, L.heads * hd},
           cols({D, c.heads * hd}, L.head0 * hd), b.wo);
      emit(unit, p + "post_attention_layernorm.weight", {D}, norm, b.mlp_norm);
      if (layer_norm) emit(unit, p + "post_attention_layernorm.bias", {D}, norm, b.mlp_norm_bias);
      if (c.mlp == MlpKind::GeLU) {  // the book's GPT: up (to 4h), GeLU, down
        emit(unit, p + "mlp.up_proj.weight", {L.ffn, D}, rows({F, D}, L.ffn0), b.w_up);
        emit(unit, p + "mlp.down_proj.weight", {D, L.ffn}, cols({D, F}, L.ffn0), b.w_down);
        continue;
      }
      if (c.experts == 0) {
        emit(unit, p + "mlp.gate_proj.weight", {L.ffn, D}, rows({F, D}, L.ffn0), b.w_gate);
        emit(unit, p + "mlp.up_proj.weight", {L.ffn, D}, rows({F, D}, L.ffn0), b.w_up);
        emit(unit, p + "mlp.down_proj.weight", {D, L.ffn}, cols({D, F}, L.ffn0), b.w_down);
        continue;
      }
      // Mixtral's sparse MoE block: the router with the block (every rank holds it, tp rank 0
      // saves it), this rank's experts a unit of their own, split over tp as the MLP is.
      std::string moe = p + "block_sparse_moe.";
      int64_t E = c.experts;
      emit(unit, moe + "gate.weight", {E, D}, TpSlice{{E, D}, 0, 0, L.tp_rank == 0}, b.moe.router);
      unit++;
      for (int j = 0; j < X.count; j++) {
        std::string e = moe + "experts." + std::to_string(X.first + j) + ".";
        ExpertWeights& x = b.moe.experts[j];
        emit(unit, e + "w1.weight", {L.ffn, D}, rows({F, D}, L.ffn0), x.w1);
        emit(unit, e + "w2.weight", {D, L.ffn}, cols({D, F}, L.ffn0), x.w2);
        emit(unit, e + "w3.weight", {L.ffn, D}, rows({F, D}, L.ffn0), x.w3);
      }
    }
    if (!stage.head) continue;
    emit(unit, "model.norm.weight", {D}, norm, w.final_norm);
    if (layer_norm) emit(unit, "model.norm.bias", {D}, norm, w.final_norm_bias);
    if (!c.tie_embeddings)  // HF omits lm_head.weight when tied
      emit(unit, "lm_head.weight", {L.vocab, D}, rows({V, D}, L.vocab0), w.lm_head);
    unit++;
  }
}

static Tensor unbound(const std::vector<int64_t>& shape) {
  Tensor t;
  t.shape = shape;
  return t;
}

static std::shared_ptr<const FeedForward> feed_forward(const ModelConfig& cfg);
static std::shared_ptr<const Normalization> normalization(const ModelConfig& cfg);

Model build_model_layout(const ModelConfig& cfg, const TensorParallel& tp,
                         std::vector<Stage> chunks, const ExpertParallel& ep) {
  validate_model_config(cfg);
  if (chunks.empty()) chunks.push_back(Stage{});
  Model m;
  int blocks = 0;
  for (Stage& stage : chunks) {
    if (stage.last_block < 0) stage.last_block = cfg.layers;
    PICO_ASSERT(0 <= stage.first_block && stage.first_block <= stage.last_block &&
                    stage.last_block <= cfg.layers,
                "stage blocks [" + std::to_string(stage.first_block) + ", " +
                    std::to_string(stage.last_block) + ")");
    m.chunk_unit0.push_back((int)m.units.size());
    m.chunk_block0.push_back(blocks);
    if (stage.embedding) m.units.push_back(ModelUnit{"embedding"});
    for (int l = stage.first_block; l < stage.last_block; l++, blocks++) {
      m.units.push_back(ModelUnit{"block " + std::to_string(l)});
      if (cfg.experts > 0) {
        m.units.push_back(ModelUnit{"block " + std::to_string(l) + " experts"});
        m.units.back().experts = true;
      }
    }
    if (stage.head) m.units.push_back(ModelUnit{"head"});
  }
  PICO_ASSERT(!cfg.tie_embeddings || chunks.front().embedding == chunks.back().head,
              "tied embeddings need the embedding and the head on one rank");
  m.cfg = cfg;
  m.chunks = chunks;
  m.tp = tp;
  m.tp.local = local_dims(cfg, tp.rank(), tp.size());
  m.ep = ep;
  m.mlp = feed_forward(cfg);
  m.norm = normalization(cfg);
  m.w.blocks.resize(blocks);
  m.g.blocks.resize(blocks);
  const ExpertRange mine = local_experts(cfg.experts, ep.rank(), ep.size());
  for (Weights* w : {&m.w, &m.g})
    for (BlockWeights& b : w->blocks) b.moe.experts.resize(mine.count);
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
  for_each_param(cfg, chunks, m.tp.local, mine, m.w, add);
  m.num_params = offset;
  bool whole = chunks.size() == 1 && chunks[0].first_block == 0 &&
               chunks[0].last_block == cfg.layers && chunks[0].embedding && chunks[0].head;
  PICO_ASSERT(tp.size() > 1 || ep.size() > 1 || !whole || offset == parameter_count(cfg),
              "parameter layout disagrees with parameter_count");
  for (int u = 0; u < (int)m.units.size(); u++) {
    m.bind_unit_params(u, Tensor());
    m.bind_unit_grads(u, Tensor());
  }
  return m;
}

static void bind_unit(Model& m, int u, const Tensor& base, Weights& w,
                      std::vector<NamedTensor>& named) {
  const ModelUnit& unit = m.units[u];
  PICO_ASSERT(!base.defined() || base.numel() >= unit.numel,
              unit.name + " needs " + std::to_string(unit.numel) + " elements");
  int i = unit.first;  // the unit's parameters come in their order in named
  auto bind = [&](int pu, const std::string&, const std::vector<int64_t>& shape, const TpSlice&,
                  Tensor& view) {
    PICO_ASSERT(pu == u && i < unit.first + unit.count,
                unit.name + ": parameter " + std::to_string(i) + " of another unit");
    view = base.defined() ? base.view(m.offsets[i] - unit.offset, shape) : unbound(shape);
    named[i++].tensor = view;
  };
  for_each_param(m.cfg, m.chunks, m.tp.local,
                 local_experts(m.cfg.experts, m.ep.rank(), m.ep.size()), w, bind, u);
  PICO_ASSERT(i == unit.first + unit.count, unit.name + ": " + std::to_string(i - unit.first) +
                                                " parameters bound of " +
                                                std::to_string(unit.count));
  if (m.cfg.tie_embeddings && u == m.embedding_unit()) w.lm_head = w.embed;
}
void Model::bind_unit_params(int u, const Tensor& base) {
  bind_unit(*this, u, base, w, named_params);
}
void Model::bind_unit_grads(int u, const Tensor& base) {
  bind_unit(*this, u, base, g, named_grads);
}

std::vector<int> Model::weights_read(int u, bool backward) const {
  if (u < 0 || u >= (int)units.size()) return {};
  if (backward && u == embedding_unit()) return {};
  if (u == head_unit() && cfg.tie_embeddings) return {u, embedding_unit()};
  return {u};
}
std::vector<int> Model::grads_written(int u) const {
  if (u == head_unit() && cfg.tie_embeddings && embedding_unit() >= 0)
    return {u, embedding_unit()};  // the tied LM head's gradient is the embedding's
  return {u};
}

std::unique_ptr<FlatParameters> Model::whole_layout() const {
  return std::make_unique<Model>(build_model_layout(cfg, tp));
}

void Model::init_parameters(uint64_t seed, const Tensor& out, int64_t first) const {
  const Model& m = *this;
  int64_t last = first + out.numel();
  for (size_t i = 0; i < m.named_params.size(); i++) {
    const NamedTensor& p = m.named_params[i];
    int64_t begin = std::max(first, m.offsets[i]),
            end = std::min(last, m.offsets[i] + p.tensor.numel());
    if (begin >= end) continue;
    if (p.tensor.dim() == 1) {  // norm weights start at 1, LayerNorm's biases at 0
      const bool bias = p.name.size() > 5 && p.name.compare(p.name.size() - 5, 5, ".bias") == 0;
      fill_(out.view(begin - first, {end - begin}), bias ? 0.0f : 1.0f);
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

Model build_model(const ModelConfig& cfg, Device device, uint64_t seed, const TensorParallel& tp,
                  std::vector<Stage> chunks, const ExpertParallel& ep) {
  Model m = build_model_layout(cfg, tp, std::move(chunks), ep);
  m.seed = seed;
  allocate_flat(m, device, seed);
  return m;
}

// ----------------------------------------------------------------------------
// Forward

// On the compute stream, allocated and freed in its order (core.cuh).
static Tensor act(std::vector<int64_t> shape, const Context& c) {
  return empty(c, shape, Mem::Activations);
}
static Tensor work(std::vector<int64_t> shape, const Context& c) {
  return empty(c, shape, Mem::Workspace);
}
// Tensors of the given shapes one after another in `whole` (views; the buffer lives while any
// of them does): the q, k and v projections' outputs and gradients, the MLP's gate and up, which
// their GEMMs then write and read as one strided batch where neighbours have one shape
// (tensor_parallel.cu, mixed_precision.cuh's linear_forward_many).
using Shape = std::vector<int64_t>;
static int64_t total(const std::vector<Shape>& shapes) {
  int64_t n = 0;
  for (const Shape& s : shapes)
    n += std::accumulate(s.begin(), s.end(), (int64_t)1, std::multiplies<int64_t>());
  return n;
}
static std::vector<Tensor> packed(const Tensor& whole, const std::vector<Shape>& shapes) {
  PICO_ASSERT(whole.numel() == total(shapes), "packed: the shapes fill " + whole.shape_str());
  std::vector<Tensor> parts;
  int64_t at = 0;
  for (const Shape& s : shapes) {
    parts.push_back(whole.view(at, s));
    at += total({s});
  }
  return parts;
}

// The attention core (DESIGN 6, "Attention"): the model's one AttentionCore, naive, flash or
// ring (flash_attention.cuh), chosen when the model was built. Under mixed precision attention
// reads q, k and v in the compute format and writes its output in it, as a model trained in
// bf16 does: under bf16 and fp16 they are stored so from the GEMMs that make them through RoPE
// (rounded once as each writes them), and its output is; under fp8 (fp32 storage) RoPE's q and
// k and the output are rounded here.
static AttentionShape attention_shape(const Model& m, int B, int T,
                                      const AttentionDropout* dropout) {
  return {B, T, m.tp.local.heads, m.tp.local.kv_heads, m.cfg.head_dim(), dropout};
}
static Tensor heads(const Tensor& t, int64_t H, int64_t hd) {  // [N, H*hd] -> [N, H, hd]
  return t.reshape({t.size(0), H, hd});
}

static void attention_core_forward(const Context& ctx, const Model& m, BlockActivations& a, int B,
                                   int T, const AttentionDropout* dropout) {
  const LocalDims& L = m.tp.local;
  int64_t N = (int64_t)B * T, hd = m.cfg.head_dim();
  a.attn = empty_in_compute_format(ctx, {N, L.heads * hd}, Mem::Activations);
  round_to_compute(ctx, a.q), round_to_compute(ctx, a.k);
  LedgerScope scope(OpKind::Attention);  // whatever the core runs (the ledger's attention row)
  m.attention->forward(ctx, attention_shape(m, B, T, dropout), heads(a.attn, L.heads, hd), a.saved,
                       heads(a.q, L.heads, hd), heads(a.k, L.kv_heads, hd),
                       heads(a.v, L.kv_heads, hd));
  output_in_compute_format(ctx, a.attn, Mem::Activations);  // what the o projection reads
}
// dq (=), dk, dv (=) from d_attn.
static void attention_core_backward(const Context& ctx, const Model& m, BlockActivations& a, int B,
                                    int T, const AttentionDropout* dropout, const Tensor& d_attn,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const LocalDims& L = m.tp.local;
  int64_t hd = m.cfg.head_dim();
  LedgerScope scope(OpKind::Attention);
  m.attention->backward(
      ctx, attention_shape(m, B, T, dropout), heads(dq, L.heads, hd), heads(dk, L.kv_heads, hd),
      heads(dv, L.kv_heads, hd), heads(d_attn, L.heads, hd), heads(a.attn, L.heads, hd), a.saved,
      heads(a.q, L.heads, hd), heads(a.k, L.kv_heads, hd), heads(a.v, L.kv_heads, hd));
}

// The residual stream between blocks: x, plus `branch` when it is still a sum to take (the last
// block's MLP output), which the next op that reads the stream adds as it reads it: the next
// block's first norm or the final norm, in one pass with the norm (as Megatron's and Apex's
// fused add + norm), or a plain add where the stream leaves the stage.
struct Residual {
  Tensor x, branch;
};
// A norm's weight (and bias) as the kernels read them (mixed_precision.cuh's stored_weight).
static NormWeights norm_weights(const Context& ctx, const Tensor& w, const Tensor& b) {
  return {stored_weight(ctx, w), b.defined() ? stored_weight(ctx, b) : Tensor()};
}
// The stream whole (returned: x itself, or the new sum in ctx.residual) and its norm y, stats.
static Tensor residual_then_norm(const Context& ctx, const Model& m, const Residual& stream,
                                 const Tensor& y, const Tensor& stats, const NormWeights& w) {
  const Tensor sum =
      stream.branch.defined() ? empty_residual(ctx, stream.x.shape, Mem::Activations) : stream.x;
  m.norm->forward(ctx, y, stats, stream.x, stream.branch, sum, w, m.cfg.norm_eps);
  return sum;
}

// Dropout (the book's GPT, Playbook §2.5): where a block's masks are drawn from, or nothing
// when it drops nothing (`sequences` undefined: evaluation, or --dropout 0).
struct BlockDropout {
  const Model& m;
  int layer;
  const Tensor &sequences, &positions;
  bool on() const { return sequences.defined(); }
  DropoutSite site(int which) const { return {m.seed, layer, which, m.cfg.dropout}; }
  // On attention's probabilities (site 0), or null.
  std::optional<AttentionDropout> attention() const {
    if (!on()) return std::nullopt;
    return AttentionDropout{site(0), sequences, positions, m.tp.local.head0};
  }
  // On a branch's output [n, D] before its residual add, in place (site 1 attention's, 2 the
  // MLP's), its mask kept in `mask`. Under SP the rows are this rank's share of the tokens.
  void branch(const Context& ctx, Tensor& mask, const Tensor& out, int which) const {
    if (!on()) return;
    mask = empty(ctx, out.shape, Mem::Activations, DType::U8);
    const int64_t row0 = m.tp.sp ? (int64_t)m.tp.rank() * out.size(0) : 0;
    dropout_forward(ctx, out, mask, out, site(which), sequences, positions, row0);
  }
};
// The gradient into a branch whose output dropout masked (`mask` defined): dres's sum masked
// and scaled as the output was, a tensor of its own; dres itself otherwise.
static ResidualGradient through_dropout(const Context& ctx, const Model& m,
                                        const ResidualGradient& dres, const Tensor& mask) {
  if (!mask.defined()) return dres;
  Tensor d = empty(ctx, dres.sum.shape, Mem::Workspace, dres.sum.dtype);
  dropout_backward(ctx, d, dres.sum, mask, m.cfg.dropout);
  return ResidualGradient{d, Tensor()};
}

// Fills every field of `a` from the block's input `stream` and leaves its output there.
// x, x_mid, norms: [n, D] (n = N/tp under SP, else N); q, k, v, attn, gate, up, act: [N, local].
// The book's figure, top to bottom; the column- and row-parallel linears are tensor_parallel.cu's.
static void block_forward(const Context& ctx, const Model& m, const BlockWeights& w,
                          BlockActivations& a, const Tensor& positions, const Tensor& sequences,
                          int B, int T, Residual& stream, int layer, std::vector<float>* carry) {
  const ModelConfig& c = m.cfg;
  const LocalDims& L = m.tp.local;
  int64_t N = (int64_t)B * T, n = sp_tokens(m.tp, N), D = c.d_model, hd = c.head_dim();
  const BlockDropout drop{m, layer, sequences, positions};
  // Attention: x_mid = x + o(attn(rope(q(n1)), rope(k(n1)), v(n1))), n1 = norm(x), where x
  // is the last block's output, its residual add taken here with the norm in one pass.
  // The norms' outputs are read by linear layers only: written in the compute format.
  a.norm1 = empty_in_compute_format(ctx, {n, D}, Mem::Activations);
  a.rstd1 = act(m.norm->stats_shape(n), ctx);
  a.x = residual_then_norm(ctx, m, stream, a.norm1, a.rstd1,
                           norm_weights(ctx, w.attn_norm, w.attn_norm_bias));
  const std::vector<Shape> qkv = {{N, L.heads * hd}, {N, L.kv_heads * hd}, {N, L.kv_heads * hd}};
  std::vector<Tensor> made =
      packed(empty_in_compute_format(ctx, {total(qkv)}, Mem::Activations), qkv);
  a.q = made[0], a.k = made[1], a.v = made[2];
  column_parallel_forward(m.tp, ctx, a.norm1, {{a.q, w.wq}, {a.k, w.wk}, {a.v, w.wv}});
  rope_forward(ctx, a.q.reshape({N, L.heads, hd}), a.k.reshape({N, L.kv_heads, hd}), positions,
               c.rope_theta);
  const std::optional<AttentionDropout> attention_dropout = drop.attention();
  attention_core_forward(ctx, m, a, B, T, attention_dropout ? &*attention_dropout : nullptr);
  Tensor out = tp_region_output(m.tp, ctx, n, D);
  row_parallel_forward(m.tp, ctx, out, a.attn, w.wo);
  drop.branch(ctx, a.drop1, out, 1);
  // MLP: x_out = x_mid + mlp(n2), n2 = norm(x_mid), the add and the norm in one pass
  a.x_mid = empty_residual(ctx, {n, D}, Mem::Activations);
  a.norm2 = empty_in_compute_format(ctx, {n, D}, Mem::Activations);
  a.rstd2 = act(m.norm->stats_shape(n), ctx);
  m.norm->forward(ctx, a.norm2, a.rstd2, a.x, out, a.x_mid,
                  norm_weights(ctx, w.mlp_norm, w.mlp_norm_bias), c.norm_eps);
  out = Tensor();  // the MLP writes an output of its own
  Tensor mlp_out = m.mlp->forward(ctx, m, layer, w, a, a.norm2, carry);
  drop.branch(ctx, a.drop2, mlp_out, 2);
  stream = {a.x_mid, mlp_out};  // added by what reads it
}

// The dense MLP: down(swiglu(gate(x), up(x))), column- then row-parallel (Playbook §5.2).
struct DenseMlp : FeedForward {
  Tensor forward(const Context& ctx, const Model& m, int, const BlockWeights& w,
                 BlockActivations& a, const Tensor& x, std::vector<float>*) const override {
    int64_t N = (int64_t)x.size(0) * (m.tp.sp ? m.tp.size() : 1), F = m.tp.local.ffn;
    // Under bf16 and fp16 the GEMMs write gate and up in that format and SwiGLU reads and
    // writes it: the [N, F] tensors, the block's largest, are never fp32.
    std::vector<Tensor> gate_up =
        packed(empty_in_compute_format(ctx, {2 * N * F}, Mem::Activations), {{N, F}, {N, F}});
    a.gate = gate_up[0], a.up = gate_up[1];
    a.act = empty_in_compute_format(ctx, {N, F}, Mem::Activations);
    column_parallel_forward(m.tp, ctx, x, {{a.gate, w.w_gate}, {a.up, w.w_up}});
    swiglu_forward(ctx, a.act, a.gate, a.up);
    Tensor out = tp_region_output(m.tp, ctx, x.size(0), x.size(1));
    row_parallel_forward(m.tp, ctx, out, a.act, w.w_down);
    return out;
  }
  Tensor backward(const Context& ctx, const Model& m, const BlockWeights& w, const BlockWeights& g,
                  BlockActivations& a, const Tensor& x, const ResidualGradient& dout,
                  const std::vector<float>&, float, DeferredGrads* deferred) const override {
    int64_t N = a.gate.size(0), F = m.tp.local.ffn;
    Tensor dx = tp_region_output(m.tp, ctx, x.size(0), x.size(1));
    // Under bf16 and fp16 the three gradients too are stored in that format: each is read by
    // GEMMs or SwiGLU only, which round it once as they write it.
    Tensor d_act = empty_in_compute_format(ctx, {N, F}, Mem::Workspace);
    std::vector<Tensor> d_gate_up =
        packed(empty_in_compute_format(ctx, {2 * N * F}, Mem::Workspace), {{N, F}, {N, F}});
    Tensor d_gate = d_gate_up[0], d_up = d_gate_up[1];
    row_parallel_backward(m.tp, ctx, d_act, g.w_down, dout.for_gemms(), dout.gemms_read_sum(),
                          a.act, w.w_down, deferred);
    swiglu_backward(ctx, d_gate, d_up, d_act, a.gate, a.up);
    column_parallel_backward(m.tp, ctx, dx, x,
                             {{d_gate, w.w_gate, g.w_gate}, {d_up, w.w_up, g.w_up}}, deferred);
    return dx;
  }
  int64_t saved_bytes(const ModelConfig& c, int64_t N, int tp, int e) const override {
    return e * N * 3 * (c.ffn / tp);  // gate, up, act
  }
};
// The book's GPT's MLP: down(gelu(up(x))), up to 4h, column- then row-parallel as the dense one.
struct GeluMlp : FeedForward {
  Tensor forward(const Context& ctx, const Model& m, int, const BlockWeights& w,
                 BlockActivations& a, const Tensor& x, std::vector<float>*) const override {
    int64_t N = (int64_t)x.size(0) * (m.tp.sp ? m.tp.size() : 1), F = m.tp.local.ffn;
    a.up = empty_in_compute_format(ctx, {N, F}, Mem::Activations);   // GeLU's input
    a.act = empty_in_compute_format(ctx, {N, F}, Mem::Activations);  // the down projection's
    column_parallel_forward(m.tp, ctx, x, {{a.up, w.w_up}});
    gelu_forward(ctx, a.act, a.up);
    Tensor out = tp_region_output(m.tp, ctx, x.size(0), x.size(1));
    row_parallel_forward(m.tp, ctx, out, a.act, w.w_down);
    return out;
  }
  Tensor backward(const Context& ctx, const Model& m, const BlockWeights& w, const BlockWeights& g,
                  BlockActivations& a, const Tensor& x, const ResidualGradient& dout,
                  const std::vector<float>&, float, DeferredGrads* deferred) const override {
    int64_t N = a.up.size(0), F = m.tp.local.ffn;
    Tensor dx = tp_region_output(m.tp, ctx, x.size(0), x.size(1));
    Tensor d_act = empty_in_compute_format(ctx, {N, F}, Mem::Workspace);
    Tensor d_up = empty_in_compute_format(ctx, {N, F}, Mem::Workspace);
    row_parallel_backward(m.tp, ctx, d_act, g.w_down, dout.for_gemms(), dout.gemms_read_sum(),
                          a.act, w.w_down, deferred);
    gelu_backward(ctx, d_up, d_act, a.up);
    column_parallel_backward(m.tp, ctx, dx, x, {{d_up, w.w_up, g.w_up}}, deferred);
    return dx;
  }
  int64_t saved_bytes(const ModelConfig& c, int64_t N, int tp, int e) const override {
    return e * N * 2 * (c.ffn / tp);  // GeLU's input and output (the book's 8 + 8 sbh at 4h)
  }
};
// A mixture of experts (expert_parallel.cu) over the model's ep and tp groups; under a
// zero-bubble schedule its experts' and router's weight gradients wait for the W op too.
struct MixtureMlp : FeedForward {
  Tensor forward(const Context& ctx, const Model& m, int layer, const BlockWeights& w,
                 BlockActivations& a, const Tensor& x, std::vector<float>* carry) const override {
    // The router reads the input in fp32 (the dispatch rounds the rows it sends into the compute
    // format), and the combine writes fp32.
    Tensor out = work(x.shape, ctx);
    moe_forward(m.ep, m.tp, m.cfg, ctx, w.moe, a.moe, cast_to(ctx, x, DType::F32), out, layer,
                carry);
    return out;
  }
  Tensor backward(const Context& ctx, const Model& m, const BlockWeights& w, const BlockWeights& g,
                  BlockActivations& a, const Tensor& x, const ResidualGradient& dout,
                  const std::vector<float>& carry, float loss_scale,
                  DeferredGrads* deferred) const override {
    Tensor dx = work(x.shape, ctx);  // fp32, as the combine's backward writes it
    moe_backward(m.ep, m.tp, m.cfg, ctx, w.moe, g.moe, a.moe, cast_to(ctx, x, DType::F32),
                 cast_to(ctx, dout.sum, DType::F32), dx, carry, loss_scale, deferred);
    return dx;
  }
  int carry_numel() const override { return 2 * n_experts; }
  int64_t saved_bytes(const ModelConfig& c, int64_t N, int tp, int e) const override {
    return moe_activation_bytes(c, N, tp, e);
  }
  void finish(const Model& m, const std::vector<float>& carry, int64_t tokens) const override {
    moe_finish_micro_batch(m.ep, m.cfg, carry, tokens);
  }
  // Its routing, all-to-all and load-balancing loss (expert_parallel.cu's meter): each block's
  // forward dispatches and combines once, its backward once more, and full recomputation's
  // forward again.
  std::unique_ptr<StepMeter> meter(Model& m, Comm& comm, const RunShape& run) const override {
    const int passes = run.recompute == Recompute::Full ? 3 : 2;
    const int value_bytes = (int)dtype_size(activation_dtype(run.precision));
    return expert_meter(comm, m.cfg, m.ep.stats,
                        ExpertSteps{(int64_t)run.mbs * run.seq, run.grad_acc, run.dp, passes,
                                    m.blocks_held(), m.expert_params(), m.ep.capacity_factor,
                                    (double)m.blocks_held() * run.grad_acc * passes *
                                        moe_expected_a2a_bytes(m.cfg, (int64_t)run.mbs * run.seq,
                                                               m.ep.size(), value_bytes),
                                    value_bytes});
  }
  int n_experts = 0;
};
static std::shared_ptr<const FeedForward> feed_forward(const ModelConfig& cfg) {
  if (cfg.mlp == MlpKind::GeLU) return std::make_shared<GeluMlp>();
  if (cfg.experts == 0) return std::make_shared<DenseMlp>();
  auto moe = std::make_shared<MixtureMlp>();
  moe->n_experts = cfg.experts;
  return moe;
}

// The norms (DESIGN 6, "Norm"). RMSNorm: its kernels fuse the residual add (runtime/ops.cuh).
struct RmsNorm : Normalization {
  std::vector<int64_t> stats_shape(int64_t n) const override { return {n}; }  // 1/rms
  void forward(const Context& ctx, const Tensor& y, const Tensor& stats, const Tensor& x,
               const Tensor& branch, const Tensor& sum, const NormWeights& w,
               float eps) const override {
    if (!branch.defined()) return rmsnorm_forward(ctx, y, stats, x, w.weight, eps);
    residual_rmsnorm_forward(ctx, sum, y, stats, x, branch, w.weight, eps);
  }
  void backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                const NormWeights& g, const Tensor& dy, const Tensor& x, const NormWeights& w,
                const Tensor& stats, const Tensor& dx_rounded) const override {
    parallel_rmsnorm_backward(tp, ctx, dx, g.weight, dy, x, w.weight, stats, dx_rounded);
  }
};
// LayerNorm with a bias (the book's GPT), the residual add fused in as RMSNorm's is.
struct LayerNorm : Normalization {
  std::vector<int64_t> stats_shape(int64_t n) const override { return {n, 2}; }  // mean, 1/std
  void forward(const Context& ctx, const Tensor& y, const Tensor& stats, const Tensor& x,
               const Tensor& branch, const Tensor& sum, const NormWeights& w,
               float eps) const override {
    if (!branch.defined()) return layernorm_forward(ctx, y, stats, x, w.weight, w.bias, eps);
    residual_layernorm_forward(ctx, sum, y, stats, x, branch, w.weight, w.bias, eps);
  }
  void backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                const NormWeights& g, const Tensor& dy, const Tensor& x, const NormWeights& w,
                const Tensor& stats, const Tensor& dx_rounded) const override {
    parallel_layernorm_backward(tp, ctx, dx, g.weight, g.bias, dy, x, w.weight, stats, dx_rounded);
  }
};
static std::shared_ptr<const Normalization> normalization(const ModelConfig& cfg) {
  if (cfg.norm == NormKind::LayerNorm) return std::make_shared<LayerNorm>();
  return std::make_shared<RmsNorm>();
}

// What each recompute mode keeps after the forward (Playbook §2.6). The one place a new policy
// goes (e.g. keep everything but the MLP's gate, up and act). FlashAttention keeps no
// probabilities: selective recompute has nothing more to drop there.
static void drop_for_recompute(const Model& m, BlockActivations& a, Recompute mode) {
  if (mode == Recompute::Selective) m.attention->drop_recomputable(a.saved);  // the s^2 term
  if (mode == Recompute::Full) a = BlockActivations{a.x};  // only the block input
}
// Before a block's backward, once what was kept is fp32 again: what was dropped, rebuilt.
// (Selective recomputation's probabilities are rebuilt by the attention's own backward.)
static void rebuild_for_backward(const Context& ctx, const Model& m, const BlockWeights& w,
                                 BlockActivations& a, const Tensor& positions,
                                 const Tensor& sequences, int B, int T, int layer, Recompute mode) {
  if (mode == Recompute::Full) {  // the whole block from its input (dropout's masks drawn again)
    Residual stream{a.x, Tensor()};
    block_forward(ctx, m, w, a, positions, sequences, B, T, stream, layer, nullptr);
  }
}

// Mixed precision (Playbook §Mixed precision training): what a block keeps for its backward is
// stored in the compute format, half the bytes, as a model trained in bf16 keeps it. Kept fp32:
// the statistics (RMSNorm's 1/rms, FlashAttention's log-sum-exp), and the residual stream (x,
// x_mid) unless --residual-dtype stores it in 16 bits (Megatron's --fp32-residual-connection is
// the default here, the reverse of Megatron's; empty_residual). Under bf16 and
// fp16 most of it is stored so as it is made (the norms', the linear layers', RoPE's and
// attention's outputs); naive attention's probabilities and the experts' tensors are rounded
// here, and under fp8 (fp32 storage, bf16 values) everything is.
static std::vector<Tensor*> stored_in_compute_format(BlockActivations& a) {
  return {&a.norm1,    &a.q,      &a.k,       &a.v,      &a.saved.probs, &a.saved.dropped,
          &a.attn,     &a.norm2,  &a.gate,    &a.up,     &a.act,         &a.moe.xe,
          &a.moe.gate, &a.moe.up, &a.moe.act, &a.moe.out};
}
// What the backward reads in fp32 beyond the linear layers, SwiGLU and attention (naive
// attention's probabilities), widened back before it. The rest stays in the compute format:
// GEMMs, SwiGLU, the attention core and the routing weights' gradient read it as it is (the
// experts' inputs, gate, up, SwiGLU output and outputs among them).
static std::vector<Tensor*> read_beyond_gemms(BlockActivations& a) {
  return {&a.saved.probs, &a.saved.dropped};
}
static void run_hook(const std::function<void(int)>& hook, int unit) {
  if (hook) hook(unit);
}

// Final RMSNorm, the column-parallel LM head (this rank's vocabulary slice) and, with targets,
// the (vocab-parallel) cross-entropy. Returns the sum of per-token losses.
static PendingSum head_forward(const Context& ctx, Model& model, Activations& acts,
                               Residual& stream, const int32_t* targets) {
  const LocalDims& L = model.tp.local;
  int64_t N = (int64_t)acts.B * acts.T, n = stream.x.size(0), D = model.cfg.d_model;
  acts.normf = empty_in_compute_format(ctx, {n, D}, Mem::Activations);
  acts.rstdf = act(model.norm->stats_shape(n), ctx);
  acts.x_final = residual_then_norm(ctx, model, stream, acts.normf, acts.rstdf,
                                    norm_weights(ctx, model.w.final_norm, model.w.final_norm_bias));
  stream = Residual{};  // the last block's x_mid, unless it keeps it, goes before the logits come
  // Under bf16 and fp16 the final norm's output (as the blocks' norms') and the logits are in
  // that format: the cross-entropy reads the logits widened and writes their gradient in place,
  // rounded once (the head's GEMMs read nothing finer).
  acts.logits = empty_in_compute_format(ctx, {N, L.vocab}, Mem::Activations);
  column_parallel_forward(model.tp, ctx, acts.normf, {{acts.logits, model.w.lm_head}});
  if (!targets) return {};
  acts.targets = device_ints(ctx, local_vocab_ids(targets, N, L.vocab0, L.vocab), Mem::Activations);
  acts.losses = act({N}, ctx);
  acts.ce_stats = act({N, 2}, ctx);
  vocab_parallel_cross_entropy_forward(model.tp, ctx, acts.losses, acts.ce_stats, acts.logits,
                                       acts.targets);
  return sum_later(ctx, acts.losses);
}

// A block's units in forward order: one, or its dense part and its experts.
static std::vector<int> block_units(const Model& m, int chunk, int l) {
  std::vector<int> units;
  for (int i = 0; i < m.units_per_block(); i++) units.push_back(m.block_unit(chunk, l) + i);
  return units;
}

// ---- The payload between stages ----

std::vector<TensorSpec> stage_payload(const Context& ctx, const Model& model, int64_t tokens) {
  std::vector<TensorSpec> specs = {
      {{sp_tokens(model.tp, tokens), model.cfg.d_model}, ctx.residual}};
  if (model.mlp->carry_numel() > 0) specs.push_back({{model.mlp->carry_numel()}});
  return specs;
}
// The carried values on the device, to travel (Mem::Workspace: alive until sent).
static StagePayload with_carry(const Context& ctx, const Model& model, Tensor hidden,
                               const std::vector<float>& carry) {
  StagePayload out = {std::move(hidden)};
  const int carried = model.mlp->carry_numel();
  if (carried > 0) out.push_back(device_floats(ctx, carry, {carried}));
  return out;
}
StagePayload stage_output(const Context& ctx, const Model& model, const Activations& acts) {
  return with_carry(ctx, model, acts.x_final, acts.carry);
}
// The carried values of a payload that arrived, on the host; the payload keeps its hidden state.
static std::vector<float> take_carry(StagePayload& in) {
  std::vector<float> carry;
  if (in.size() > 1) carry = to_host_floats(in[1]);
  in.resize(std::min<size_t>(in.size(), 1));
  return carry;
}

PendingSum stage_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                         StagePayload in, const int32_t* targets, int B, int T, Recompute mode,
                         const UnitHooks& hooks, int chunk, int64_t sequence0) {
  const Stage& stage = model.chunks[chunk];
  const ModelConfig& c = model.cfg;
  const LocalDims& L = model.tp.local;
  int64_t N = (int64_t)B * T, n = sp_tokens(model.tp, N), D = c.d_model;
  acts = Activations{};
  acts.B = B, acts.T = T;
  acts.carry = take_carry(in);
  acts.carry.resize(model.mlp->carry_numel(), 0.0f);
  // Global positions (RoPE, the causal mask): under context parallelism T is this rank's
  // share of each sequence, whose tokens sit at the positions the cp layout gives them.
  acts.positions = device_ints(ctx, model.attention->positions(B, T), Mem::Activations);
  // Dropout draws its masks from each token's sequence, numbered in the run (training only).
  if (sequence0 >= 0 && c.dropout > 0) {
    std::vector<int32_t> sequences = model.attention->token_sequences(B, T);
    for (int32_t& s : sequences) s = (int32_t)(uint32_t)(sequence0 + s);
    acts.sequences = device_ints(ctx, sequences, Mem::Activations);
  }

  Tensor x = in.empty() ? Tensor() : in[0];  // [n, D] the residual stream
  in.clear();
  if (stage.embedding) {
    // Vocab-parallel embedding: this rank looks up the ids of its vocabulary slice.
    acts.ids = device_ints(ctx, local_vocab_ids(ids, N, L.vocab0, L.vocab), Mem::Activations);
    x = empty_residual(ctx, {n, D}, Mem::Activations);
    run_hook(hooks.before_forward, model.embedding_unit());
    vocab_parallel_embedding_forward(model.tp, ctx, x, acts.ids, stored_weight(ctx, model.w.embed));
    run_hook(hooks.after_forward, model.embedding_unit());
  }
  PICO_ASSERT(x.defined() && x.numel() == n * D, "stage input " + x.shape_str());
  Residual stream{x, Tensor()};
  x = Tensor();
  acts.blocks.resize(model.blocks(chunk));
  for (int l = 0; l < model.blocks(chunk); l++) {
    BlockActivations& a = acts.blocks[l];
    for (int u : block_units(model, chunk, l)) run_hook(hooks.before_forward, u);
    block_forward(ctx, model, model.w.blocks[model.chunk_block0[chunk] + l], a, acts.positions,
                  acts.sequences, B, T, stream, stage.first_block + l, &acts.carry);
    for (int u : block_units(model, chunk, l)) run_hook(hooks.after_forward, u);
    drop_for_recompute(model, a, mode);
    store_in_compute_format(ctx, stored_in_compute_format(a));
  }
  if (!stage.head) {  // the stream leaves whole, for the next stage
    acts.x_final = stream.x;
    if (stream.branch.defined()) {
      acts.x_final = empty_residual(ctx, {n, D}, Mem::Activations);
      residual_forward(ctx, acts.x_final, stream.x, stream.branch);
    }
    return {};
  }
  model.mlp->finish(model, acts.carry, N);
  run_hook(hooks.before_forward, model.head_unit());
  PendingSum loss = head_forward(ctx, model, acts, stream, targets);
  run_hook(hooks.after_forward, model.head_unit());
  return loss;
}

float model_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode, const UnitHooks& hooks,
                    int64_t sequence0) {
  return (float)read_total(
      ctx, {stage_forward(ctx, model, acts, ids, {}, targets, B, T, mode, hooks, 0, sequence0)});
}

// ----------------------------------------------------------------------------
// Backward

// RoPE's backward on dq [N, Hq * hd] and dk [N, Hk * hd], packed with dv in `d_qkv` (shapes
// `qkv`), each result in the format the linear layers' GEMMs read the gradient in
// (runtime/dtype.cuh's gradient_storage: rounded once, counted; under fp32 and fp8 dq and dk
// themselves, rotated in place, which the GEMMs round themselves), and dv rounded into that
// format too: one launch for the three, returned packed as they came.
static std::vector<Tensor> rope_backward_for_gemms(const Context& ctx, const Tensor& d_qkv,
                                                   const std::vector<Shape>& qkv, int64_t hd,
                                                   const Tensor& positions, float theta) {
  std::vector<Tensor> d = packed(d_qkv, qkv), into = packed(gradient_storage(ctx, d_qkv), qkv);
  auto heads = [hd](const Tensor& t) { return t.reshape({t.size(0), t.size(1) / hd, hd}); };
  rope_backward(ctx, heads(d[0]), heads(d[1]), positions, theta, heads(into[0]), heads(into[1]),
                heads(d[2]), heads(into[2]));
  return into;
}

// Where the linear layers after a norm's backward read the residual gradient rounded to their
// 16-bit format (ResidualGradient), a buffer for the norm's backward to write it into; else
// undefined.
static Tensor rounded_residual_gradient(const Context& ctx, const Model& m, const Tensor& sum) {
  if (m.tp.sp) return Tensor();  // the row-parallel backward gathers the fp32 sum first
  Tensor rounded = gradient_storage(ctx, sum);
  return rounded.ptr == sum.ptr ? Tensor() : rounded;
}

// dres [n, D] holds d(block output) on entry and d(block input) on exit (rounded too when
// `round_for_next`: the next block's MLP reads it). The forward read bottom to top: MLP first,
// then attention.
static void block_backward(const Context& ctx, const Model& m, const BlockWeights& w,
                           const BlockWeights& g, BlockActivations& a, const Tensor& positions,
                           const Tensor& sequences, int B, int T, int layer, ResidualGradient& dres,
                           bool round_for_next, const std::vector<float>& carry, float loss_scale,
                           DeferredGrads* deferred) {
  const ModelConfig& c = m.cfg;
  const LocalDims& L = m.tp.local;
  int64_t N = (int64_t)B * T, n = sp_tokens(m.tp, N), D = c.d_model, hd = c.head_dim();
  const BlockDropout drop{m, layer, sequences, positions};
  // MLP; d_norm [n, D] the gradient of a norm's output
  Tensor d_norm = m.mlp->backward(ctx, m, w, g, a, a.norm2, through_dropout(ctx, m, dres, a.drop2),
                                  carry, loss_scale, deferred);
  dres.rounded = rounded_residual_gradient(ctx, m, dres.sum);  // the o projection reads it
  m.norm->backward(m.tp, ctx, dres.sum, {g.mlp_norm, g.mlp_norm_bias}, d_norm, a.x_mid,
                   norm_weights(ctx, w.mlp_norm, w.mlp_norm_bias), a.rstd2, dres.rounded);
  d_norm = Tensor();

  // Attention
  // The o projection writes attention's output gradient in the compute format, which attention
  // reads (rounded once, as a linear layer's input gradient is); dq, dk, dv are fp32, and RoPE's
  // backward writes the three in the format the projections' GEMMs read.
  Tensor d_attn = empty_in_compute_format(ctx, {N, L.heads * hd}, Mem::Workspace);
  const std::vector<Shape> qkv = {{N, L.heads * hd}, {N, L.kv_heads * hd}, {N, L.kv_heads * hd}};
  Tensor d_qkv = work({total(qkv)}, ctx);
  std::vector<Tensor> d = packed(d_qkv, qkv);
  Tensor dq = d[0], dk = d[1], dv = d[2];
  const ResidualGradient d_out = through_dropout(ctx, m, dres, a.drop1);
  row_parallel_backward(m.tp, ctx, d_attn, g.wo, d_out.for_gemms(), d_out.gemms_read_sum(), a.attn,
                        w.wo, deferred);
  const std::optional<AttentionDropout> attention_dropout = drop.attention();
  attention_core_backward(ctx, m, a, B, T, attention_dropout ? &*attention_dropout : nullptr,
                          d_attn, dq, dk, dv);
  d = rope_backward_for_gemms(ctx, d_qkv, qkv, hd, positions, c.rope_theta);
  dq = d[0], dk = d[1], dv = d[2];
  d_norm = tp_region_output(m.tp, ctx, n, D);
  column_parallel_backward(m.tp, ctx, d_norm, a.norm1,
                           {{dq, w.wq, g.wq}, {dk, w.wk, g.wk, true}, {dv, w.wv, g.wv, true}},
                           deferred);
  dres.rounded = round_for_next ? rounded_residual_gradient(ctx, m, dres.sum) : Tensor();
  m.norm->backward(m.tp, ctx, dres.sum, {g.attn_norm, g.attn_norm_bias}, d_norm, a.x,
                   norm_weights(ctx, w.attn_norm, w.attn_norm_bias), a.rstd1, dres.rounded);
}

// Loss -> d(final hidden) [n, D] into dres (rounded too when `round_for_next`): cross-entropy,
// LM head, final norm.
static void head_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                          ResidualGradient& dres, bool round_for_next, DeferredGrads* deferred) {
  vocab_parallel_cross_entropy_backward(model.tp, ctx, acts.logits, acts.logits, acts.ce_stats,
                                        acts.targets,
                                        loss_scale);  // in place: the logits become their gradient
  Tensor d_norm = tp_region_output(model.tp, ctx, dres.sum.size(0), dres.sum.size(1));
  column_parallel_backward(model.tp, ctx, d_norm, acts.normf,
                           {{acts.logits, model.w.lm_head, model.g.lm_head}}, deferred);
  acts.logits = acts.normf = Tensor();
  if (round_for_next) dres.rounded = rounded_residual_gradient(ctx, model, dres.sum);
  model.norm->backward(
      model.tp, ctx, dres.sum, {model.g.final_norm, model.g.final_norm_bias}, d_norm, acts.x_final,
      norm_weights(ctx, model.w.final_norm, model.w.final_norm_bias), acts.rstdf, dres.rounded);
}

StagePayload stage_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                            StagePayload d_out, Recompute mode, const UnitHooks& hooks, int chunk,
                            DeferredGrads* deferred) {
  const Stage& stage = model.chunks[chunk];
  // Every layer's carried values: this chunk's own when it ends the model, else as the chunk
  // that does sent them back.
  if (!stage.head) acts.carry = take_carry(d_out);
  // A unit's gradients are final once its weight gradients are: after the W op when deferred.
  auto gradients_ready = [&](int unit) {
    if (!deferred) return run_hook(hooks.after_backward, unit);
    deferred->push_back({nullptr, [hook = hooks.after_backward, unit] { run_hook(hook, unit); }});
  };
  int B = acts.B, T = acts.T;
  int64_t n = acts.x_final.size(0), D = model.cfg.d_model;
  ResidualGradient dres{zeros(ctx, {n, D}, Mem::Workspace, ctx.residual), Tensor()};  // [n, D]
  if (stage.head) {
    run_hook(hooks.before_backward, model.head_unit());
    head_backward(ctx, model, acts, loss_scale, dres, model.blocks(chunk) > 0, deferred);
    gradients_ready(model.head_unit());
  } else {
    copy_(ctx, dres.sum, d_out[0]);
    d_out.clear();
  }
  for (int l = model.blocks(chunk) - 1; l >= 0; l--) {
    BlockActivations& a = acts.blocks[l];
    int b = model.chunk_block0[chunk] + l;
    std::vector<int> units = block_units(model, chunk, l);  // in backward order: experts first
    for (auto u = units.rbegin(); u != units.rend(); u++) run_hook(hooks.before_backward, *u);
    const int layer = stage.first_block + l;
    rebuild_for_backward(ctx, model, model.w.blocks[b], a, acts.positions, acts.sequences, B, T,
                         layer, mode);
    widen_to_fp32(ctx, read_beyond_gemms(a));
    block_backward(ctx, model, model.w.blocks[b], model.g.blocks[b], a, acts.positions,
                   acts.sequences, B, T, layer, dres, l > 0, acts.carry, loss_scale, deferred);
    a = BlockActivations{};  // this micro-batch no longer needs block l's activations
    for (auto u = units.rbegin(); u != units.rend(); u++) gradients_ready(*u);
  }
  if (stage.embedding) {
    run_hook(hooks.before_backward, model.embedding_unit());
    vocab_parallel_embedding_backward(model.tp, ctx, model.g.embed, acts.ids, dres.sum);
    gradients_ready(model.embedding_unit());
    acts = Activations{};
    return {};  // nothing before the first chunk
  }
  std::vector<float> carry = std::move(acts.carry);
  acts = Activations{};
  return with_carry(ctx, model, std::move(dres.sum), carry);
}

void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks) {
  stage_backward(ctx, model, acts, loss_scale, {}, mode, hooks);
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
// A mixture of experts keeps, for each of a token's k rows, its hidden state at the expert and
// the expert's output (D each) and gate, up and SwiGLU output (F/t each): k (2 D + 3 F/t) in
// place of 3 F/t, exact when the routing is balanced (moe_activation_bytes).
// FlashAttention never keeps the probabilities, only the log-sum-exp [B, Hq/t, T]: its term is
// 4 Hq / t bytes per token instead of 4 Hq T / t, so a block's activations grow as T, not T^2.
int64_t activation_bytes_per_block(const ModelConfig& c, int B, int T, int tp, bool sp,
                                   Recompute mode, const AttentionCore& attention, int e, int er) {
  LocalDims L = local_dims(c, 0, tp);
  int64_t N = (int64_t)B * T, n = sp ? N / tp : N, D = c.d_model, hd = c.head_dim();
  if (mode == Recompute::Full) return er * n * D;
  // x and x_mid in er bytes, norm1 and norm2 in e bytes, each norm's statistics in fp32 (1/rms,
  // or LayerNorm's mean and 1/std) and dropout's two masks in bytes (on n tokens); q, attn, k,
  // v, the MLP's in e bytes (on N tokens, this rank's heads and ffn columns).
  const int64_t stats = c.norm == NormKind::LayerNorm ? 8 : 4;
  const bool dropout = c.dropout > 0;
  int64_t outside = (2 * er + 2 * e) * n * D + 2 * stats * n + (dropout ? 2 * n * D : 0);
  int64_t inside =
      e * N * (2 * L.heads * hd + 2 * L.kv_heads * hd) + feed_forward(c)->saved_bytes(c, N, tp, e);
  return outside + inside +
         attention.saved_bytes(B, T, L.heads, mode == Recompute::Selective, e, dropout);
}

void print_activation_report(const Model& m, int B, int T, Recompute mode, int e, int er,
                             int64_t measured) {
  ModelConfig local = m.cfg;  // what one rank's activations are made of: its share of T
  local.seq = T;
  const AttentionCore& attention = *m.attention;
  const int tp = m.tp.size();
  // The formula's terms as activation_bytes_per_block counts them (its comment): the block's
  // residuals and norms' outputs, their statistics (LayerNorm's mean and 1/std: 16 bytes for
  // two) and dropout's two masks; q, attn, k, v and the MLP's (SwiGLU 3F, GeLU 2F); attention's.
  const bool dropout = m.cfg.dropout > 0, gelu = m.cfg.mlp == MlpKind::GeLU;
  ActivationTerms terms;
  terms.outside = std::to_string(2 * er + 2 * e + (dropout ? 2 : 0)) + "D + " +
                  (m.cfg.norm == NormKind::LayerNorm ? "16" : "8");
  terms.inside = std::to_string(2 * e) + "D + " + std::to_string(2 * e) + " Hkv hd + " +
                 std::to_string((gelu ? 2 : 3) * e) + "F";
  terms.attention = attention.saved_formula(e, dropout);
  terms.block = m.cfg.gpt_block() ? "the GPT block" : "this Llama";
  terms.dropout = dropout && attention.saved_bytes(1, 2, 1, false, 1, true) > 0;
  print_activation_report(
      measured, activation_bytes_per_block(local, B, T, tp, m.tp.sp, mode, attention, e, er),
      "tp " + std::to_string(tp) + (m.tp.sp ? " + sp" : "") + ", recompute " +
          recompute_name(mode) + ", " + attention.name() + " attention",
      terms, m.tp.sp, e, er, m.cfg.experts > 0);
}

std::string describe_recompute(Recompute mode, const AttentionCore& attention) {
  // Selective recomputation drops the attention's probabilities: an attention that keeps none
  // (flash: O and its log-sum-exp) has nothing more to drop.
  const bool drops = attention.saved_bytes(1, 2, 1, true, 4, false) !=
                     attention.saved_bytes(1, 2, 1, false, 4, false);
  if (mode == Recompute::Selective && !drops)
    return "selective: nothing more to drop, " + attention.name() + " keeps no probabilities";
  return recompute_name(mode);
}

int Model::blocks_held() const {
  int held = 0;
  for (int c = 0; c < (int)chunks.size(); c++) held += blocks(c);
  return held;
}
int64_t Model::expert_params() const {
  int64_t n = 0;
  for (const ModelUnit& u : units)
    if (u.experts) n += u.numel;
  return n;
}

int64_t saved_bytes(const BlockActivations& a) {
  int64_t bytes = 0;
  for (const Tensor* t :
       {&a.x,        &a.norm1,       &a.rstd1,     &a.q,          &a.k,
        &a.v,        &a.saved.probs, &a.saved.lse, &a.saved.mask, &a.saved.dropped,
        &a.attn,     &a.drop1,       &a.x_mid,     &a.norm2,      &a.rstd2,
        &a.gate,     &a.up,          &a.act,       &a.drop2,      &a.moe.xe,
        &a.moe.gate, &a.moe.up,      &a.moe.act,   &a.moe.out})
    if (t->defined()) bytes += t->nbytes();
  return bytes;
}
