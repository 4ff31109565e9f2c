// memory.cu: a layout's memory per pipeline rank (Playbook §2.4-§2.6, §4.1, §8). The one idea:
// every byte is one the reports already check against a run: static bytes by §4.1's formula at
// the rank's parameters, activations by model.cu's per-block formula held as many times as the
// pipeline's own schedule table keeps micro-batches in flight, walked op by op.
// Guide: docs/planner.md (the code in reading order, the reports that show it).
#include <algorithm>
#include <map>
#include <set>

#include "context_parallel.cuh"
#include "expert_parallel.cuh"
#include "planner/planner_internal.cuh"
#include "runtime/dtype.cuh"
#include "runtime/formulas.cuh"
#include "runtime/options.cuh"
#include "runtime/parameters.cuh"
#include "tensor_parallel.cuh"

// ----------------------------------------------------------------------------
// The book's activation formula

double book_activation_bytes(int layers, int64_t s, int64_t b, int64_t h, int a, int tp, bool sp,
                             Recompute mode) {
  const double sbh = (double)s * b * h, t = tp;
  const double scores = 5.0 * a * s / h;  // the attention scores, softmax and dropout: 5 a s^2 b
  double per_layer;
  if (mode == Recompute::Full)  // the layer's input only, 2 bytes per element
    per_layer = 2 * sbh / (sp ? t : 1);
  else if (tp == 1 || sp)  // 34: everything, split over tp when sp splits the rest by tokens
    per_layer = sbh * (34 + (mode == Recompute::None ? scores : 0)) / t;
  else  // tp without sp: norms, dropout masks and residual inputs (10) stay whole
    per_layer = sbh * (10 + 24 / t + (mode == Recompute::None ? scores / t : 0));
  return layers * per_layer;
}

ActivationFormula parse_activation_formula(const std::string& flag) {
  if (flag == "llama") return ActivationFormula::Llama;
  if (flag == "book") return ActivationFormula::Book;
  throw UsageError("--activations " + flag +
                   ": expected llama (model.cu's formula for picoscale's Llama: RMSNorm, SwiGLU, "
                   "fp32 residual stream) or book (the book's 34 sbh + 5 a s^2 b)");
}

// ----------------------------------------------------------------------------
// Layouts

std::string Layout::str() const {
  std::string s = "dp " + std::to_string(dp) + " tp " + std::to_string(tp) + (sp ? "+sp" : "") +
                  " pp " + std::to_string(pp);
  if (pp > 1)
    s += std::string(" (") + pp_schedule_name(schedule) +
         (virtual_stages > 1 ? " V " + std::to_string(virtual_stages) : "") + ")";
  s += " cp " + std::to_string(cp) + " zero " + std::to_string(zero) + " mbs " +
       std::to_string(mbs) + " ga " + std::to_string(grad_acc) + " " + precision_name(precision) +
       (bf16_grads ? " (bf16 grads)" : "") +
       (residual != DType::F32 ? " (" + residual_choice_name(residual) + " residual)" : "") +
       " recompute " + recompute_name(recompute);
  if (attention == AttentionKind::Naive) s += " naive attention";
  if (ep > 1) s += " ep " + std::to_string(ep);
  return s;
}

std::string Layout::flags() const {
  std::string s = "--dp " + std::to_string(dp) + " --tp " + std::to_string(tp) + " --pp " +
                  std::to_string(pp) + " --cp " + std::to_string(cp);
  if (sp) s += " --sp";
  if (pp > 1) s += std::string(" --pp-schedule ") + pp_schedule_name(schedule);
  if (virtual_stages > 1) s += " --pp-virtual " + std::to_string(virtual_stages);
  if (zero) s += " --zero " + std::to_string(zero);
  if (ep > 1) s += " --ep " + std::to_string(ep);
  s += " --mbs " + std::to_string(mbs) + " --grad-acc " + std::to_string(grad_acc);
  s += std::string(" --dtype ") + precision_name(precision);
  if (bf16_grads) s += " --grad-acc-dtype bf16";
  if (residual != DType::F32) s += " --residual-dtype " + residual_choice_name(residual);
  if (recompute != Recompute::None) s += std::string(" --recompute ") + recompute_name(recompute);
  s += std::string(" --attention ") + attention_name(attention);
  return s;
}

void validate_layout(const ModelConfig& cfg, const Layout& l, const std::string& gpu) {
  validate_model_config(cfg);
  validate_head_dim(cfg.head_dim(), l.attention == AttentionKind::Flash, Device::Meta, gpu);
  validate_tensor_parallel(cfg, l.tp, l.sp);
  validate_context_parallel(cfg.seq, l.cp, CpBalance::Zigzag, l.attention == AttentionKind::Flash,
                            l.tp, l.sp, 0);
  validate_pipeline(cfg.layers, l.pp, l.virtual_stages, l.grad_acc, l.schedule, cfg.tie_embeddings,
                    l.zero);
  validate_expert_parallel(cfg, ExpertOptions{l.ep, 0.0}, l.dp, l.cp);
}

// ----------------------------------------------------------------------------
// One pipeline rank's part of the model

static StageShape build_stage_shape(const ModelConfig& cfg, const Layout& l, int stage) {
  Comm grid;  // only its tp group's size and rank are read: a layout, not a communicator
  grid.tp.size = l.tp, grid.tp.rank = 0, grid.ep.size = l.ep, grid.ep.rank = 0;
  std::vector<Stage> chunks =
      pipeline_chunks(cfg.layers, l.pp, l.virtual_stages, stage, l.schedule);
  Model m = build_model_layout(cfg, TensorParallel{&grid, l.sp}, chunks, ExpertParallel{&grid});
  const StagePlacement at = stage_placement(l.schedule, l.pp, l.virtual_stages);
  StageShape s;
  for (size_t c = 0; c < m.chunks.size(); c++) {
    const int g = at.chunks[stage][c];
    s.chunks.push_back({m.blocks((int)c), m.chunks[c].embedding, m.chunks[c].head,
                        at.elsewhere(g - 1, stage), at.elsewhere(g + 1, stage)});
  }
  for (const ModelUnit& u : m.units)
    s.unit_numel.push_back(u.numel), s.unit_experts.push_back(u.experts);
  s.num_params = m.num_params, s.ep = l.ep;
  return s;
}

const StageShape& stage_shape(const ModelConfig& cfg, const Layout& l, int stage) {
  static std::map<std::string, StageShape> cache;
  std::string key;
  for (int v :
       {cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.seq,
        (int)cfg.tie_embeddings, cfg.experts, cfg.top_k, l.tp, l.pp, l.virtual_stages, l.ep})
    key += std::to_string(v) + ",";
  const StagePlacement at = stage_placement(l.schedule, l.pp, l.virtual_stages);
  for (int g : at.chunks[stage]) key += std::to_string(g) + ",";  // the model chunks it holds
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 4096) cache.clear();
    it = cache.emplace(key, build_stage_shape(cfg, l, stage)).first;
  }
  return it->second;
}

namespace {

// Bytes of one micro-batch's activations on one chunk, and how they move while it runs.
struct ChunkBytes {
  double held = 0;           // after its forward, until its backward
  double forward_peak = 0;   // the most held during its forward (>= held)
  double backward_peak = 0;  // extra over what is held when its backward starts (>= 0)
  double weight_held = 0;    // zero-bubble: held from its B until its W
  double sent = 0;           // x_final, sent to the next stage
};

// The attention core a layout's blocks use (its saved_bytes is all the formula asks).
std::shared_ptr<const AttentionCore> attention_core(const Layout& l) {
  if (l.cp > 1) return std::make_shared<ContextParallelAttention>(ContextParallel{});
  return local_attention(l.attention);
}

ChunkBytes chunk_bytes(const ModelConfig& cfg, const Layout& l, const Implementation& impl,
                       const StageShape::Chunk& c) {
  const int T = cfg.seq / l.cp;  // this rank's share of each sequence
  ModelConfig local = cfg;
  local.seq = T;
  const LocalDims L = local_dims(cfg, 0, l.tp);
  const double N = (double)l.mbs * T, n = l.sp ? N / l.tp : N, D = cfg.d_model;
  const double hd = cfg.head_dim();
  const int e = l.precision == Precision::FP32 ? 4 : 2, er = (int)dtype_size(l.residual);
  std::shared_ptr<const AttentionCore> attention = attention_core(l);
  // One block: what it keeps, and everything in fp32 right after its forward (before the
  // recompute policy drops and the compute format shrinks what it keeps).
  double kept, fresh;
  if (impl.activations == ActivationFormula::Book) {
    kept = fresh =
        book_activation_bytes(1, T, l.mbs, cfg.d_model, cfg.heads, l.tp, l.sp, l.recompute);
  } else {
    kept = (double)activation_bytes_per_block(local, l.mbs, T, l.tp, l.sp, l.recompute, *attention,
                                              e, er);
    fresh = (double)activation_bytes_per_block(local, l.mbs, T, l.tp, l.sp, Recompute::None,
                                               *attention, 4);
  }
  // The block's own peak. Under bf16 and fp16 the linear layers' inputs and outputs are made in
  // the compute format (the norms, q, k and v through RoPE, attention's output), and so are the
  // dense MLP's gate, up and SwiGLU output; the peak is then the block's end. The other tensors
  // are rounded at the block's end one by one (store_in_compute_format: the 16-bit copy next to
  // the fp32 one), in stored_in_compute_format's order. Full recomputation keeps only the input
  // (fp32, or 16-bit with the stream). Under fp8 everything waits for the block's end. A 16-bit
  // residual stream (x, x_mid) is made so too.
  const bool llama = impl.activations == ActivationFormula::Llama;
  const bool early = llama && (l.precision == Precision::BF16 || l.precision == Precision::FP16);
  const double mlp = early && !cfg.experts ? N * L.ffn : 0;  // a mixture keeps its experts' own
  const double early_elements = early ? 2 * n * D + 2 * N * L.heads * hd + 2 * N * L.kv_heads * hd +
                                            3 * mlp + (er < 4 ? 2 * n * D : 0)
                                      : 0;
  const double made = fresh - (4 - e) * early_elements;  // everything, right after the forward
  double block_peak = early ? made : fresh;
  if (llama && e < 4 && l.recompute != Recompute::Full) {
    const double probs =
        fresh - (double)activation_bytes_per_block(local, l.mbs, T, l.tp, l.sp,
                                                   Recompute::Selective, *attention, 4);
    double now = made - (l.recompute == Recompute::Selective ? probs : 0);
    std::vector<double> order = {early ? 0 : n * D,
                                 early ? 0 : N * L.heads * hd,
                                 early ? 0 : N * L.kv_heads * hd,
                                 early ? 0 : N * L.kv_heads * hd,
                                 l.recompute == Recompute::None ? probs / 4 : 0,
                                 early ? 0 : N * L.heads * hd,
                                 early ? 0 : n * D,
                                 N * L.ffn - mlp,
                                 N * L.ffn - mlp,
                                 N * L.ffn - mlp};
    for (double elements : order) {
      block_peak = std::max(block_peak, now + e * elements);
      now -= (4 - e) * elements;
    }
  }
  const double positions = 4 * N, ids = c.embedding ? 4 * N : 0, x_final = er * n * D;
  const double normf = (early ? e : 4) * n * D, logits = (early ? e : 4) * N * L.vocab;
  const double head = c.head ? normf + 4 * n + logits + 4 * N + 4 * N + 8 * N : 0;
  ChunkBytes b;
  b.sent = x_final;
  b.held = positions + ids + c.blocks * kept + x_final + head;
  // The last block's forward: the earlier blocks kept, this one at its peak, its output.
  b.forward_peak = std::max(b.held, positions + ids + (c.blocks - 1) * kept + block_peak + x_final);
  const bool split =
      l.pp > 1 &&
      !weights_apart(pipeline_schedule(l.schedule, l.pp, 0, 2 * l.pp, l.virtual_stages)).empty();
  if (l.recompute == Recompute::Full) {
    // The first block's backward rebuilds its activations (fp32) from its input; the head's
    // logits and final norm are gone by then unless a deferred W still reads them.
    double freed = c.head && !split ? normf + logits : 0;
    b.backward_peak = std::max(0.0, block_peak - er * n * D - freed);
  }
  if (split) {
    // The W op's inputs: the linear layers' inputs (norm1 and norm2 only without sp: with sp
    // the layers read gathered copies, which are workspace). In fp32 where they are fp32
    // activations (fp32 runs; fp8's full recomputation). Otherwise the norms', attention's and
    // SwiGLU's outputs are held as stored, in the compute format. And the head's final-norm
    // output and the logits' gradient (in place).
    double block_inputs = (l.sp ? 0 : 2 * 4 * N * D) + 4 * N * L.heads * hd + 4 * N * L.ffn;
    bool fp32_inputs = e == 4 || (l.recompute == Recompute::Full && !early);
    if (!fp32_inputs) block_inputs = e * ((l.sp ? 0 : 2 * N * D) + N * L.heads * hd + N * L.ffn);
    b.weight_held = c.blocks * block_inputs + (c.head ? (l.sp ? 0 : normf) + logits : 0);
  }
  return b;
}

// One pipeline rank's table walked op by op: the activations held after each op and the most
// held at any time (the run's peak of the Activations category).
struct Walk {
  double peak = 0;
  int peak_in_flight = 0;
};
Walk walk_schedule(const Layout& l, const Implementation& impl, int stage,
                   const std::vector<ChunkBytes>& bytes) {
  const int p = l.pp, V = l.virtual_stages;
  const PpSchedule schedule = p * V > 1 ? l.schedule : PpSchedule::OneFOneB;
  std::vector<PipelineOp> table = pipeline_schedule(schedule, p, stage, l.grad_acc, V);
  const StagePlacement at = stage_placement(schedule, p, V);
  // The engine's sends (runtime/exchange.cuh): queued until the next receive, which sends them
  // first and, over NCCL, gives their buffers back once they are received (taken here, as on
  // the meta device, as by the end of that receive); otherwise (no receive follows, or MPI) they
  // stay in flight, their buffers alive, until the step ends.
  std::set<std::pair<int, int>> queued, in_flight, done;
  const std::set<std::pair<int, int>> apart = weights_apart(table);  // B's whose W runs later
  double now = 0;
  int held = 0;
  Walk w;
  auto note = [&](double bytes) {
    if (bytes > w.peak) w.peak = bytes, w.peak_in_flight = held;
  };
  auto release_queued = [&] {
    for (const auto& key : queued)
      if (done.count(key)) now -= bytes[key.second].sent;  // no longer kept by anyone
    queued.clear();
  };
  auto flush = [&] {
    in_flight.insert(queued.begin(), queued.end());
    queued.clear();
  };
  for (const PipelineOp& op : table) {
    const int g = at.chunks[stage][op.chunk];
    const std::pair<int, int> key{op.micro, op.chunk};
    const ChunkBytes& b = bytes[op.chunk];
    // Messages from and to other ranks (consecutive chunks on one rank hand over without one).
    bool receives = (op.kind == Phase::Forward && at.elsewhere(g - 1, stage)) ||
                    (op.kind == Phase::Backward && at.elsewhere(g + 1, stage));
    if (receives && !impl.mpi_sends)
      release_queued();
    else
      flush();
    if (op.kind == Phase::Forward) {
      held++;
      note(now + b.forward_peak);
      now += b.held;
      if (at.elsewhere(g + 1, stage)) queued.insert(key);
    } else if (op.kind == Phase::Backward) {
      note(now + b.backward_peak);
      now -= b.held;
      held--;
      done.insert(key);
      if (queued.count(key) || in_flight.count(key)) now += b.sent;  // its send still reads it
      if (apart.count(key)) now += b.weight_held;
    } else {
      now -= b.weight_held;
    }
    note(now);
  }
  return w;
}

// Transient buffers (Workspace): the larger of a block's backward temporaries (the gradients of
// its activations, the 16-bit stored tensors widened back to fp32) and the head's, plus ZeRO's
// gathered weights and a unit's full gradient. An estimate: the test checks static memory and
// activations, not this.
double workspace_bytes(const ModelConfig& cfg, const Layout& l, const StageShape& s) {
  const LocalDims L = local_dims(cfg, 0, l.tp);
  const double N = (double)l.mbs * cfg.seq / l.cp, n = l.sp ? N / l.tp : N, D = cfg.d_model;
  const double hd = cfg.head_dim();
  double block = 4 * (n * D + 3 * N * L.ffn + 2 * N * L.heads * hd + 2 * N * L.kv_heads * hd);
  if (l.sp) block += 2 * 4 * N * D;  // the gathered inputs of the column-parallel layers
  if (l.precision != Precision::FP32)
    block += 2 * (N * (2 * L.heads * hd + 2 * L.kv_heads * hd + 3 * L.ffn) + 2 * n * D);
  double head = 0;
  for (const StageShape::Chunk& c : s.chunks)
    if (c.head) head = 4 * n * D + 4 * N * 2;
  double units = 0;
  int64_t largest = 0;
  for (int64_t u : s.unit_numel) largest = std::max(largest, u);
  const int wb = l.precision == Precision::FP32 ? 4 : 2;
  if (l.zero >= 2) units += 4.0 * largest;       // the unit in backward's full gradient
  if (l.zero == 3) units += 2.0 * wb * largest;  // the unit in use and the next one, gathered
  return std::max(block, head) + units + (l.pp > 1 ? dtype_size(l.residual) * n * D : 0);
}

}  // namespace

MemoryPrediction predict_memory(const ModelConfig& cfg, const Layout& l, const Implementation& impl,
                                std::vector<int> stages) {
  if (stages.empty())
    for (int s = 0; s < l.pp; s++) stages.push_back(s);
  MemoryPrediction mp;
  const int N = l.dp * l.cp;
  const int zero = N > 1 ? l.zero : 0;  // ./train runs --zero k over one rank as zero 0
  const BytesPerParameter b = bytes_per_parameter(l.precision, l.bf16_grads);
  for (int stage : stages) {
    const StageShape& s = stage_shape(cfg, l, stage);
    RankMemory r;
    r.stage = stage;
    r.num_params = s.num_params;
    r.padded_params = zero > 0 ? s.padded(N) : s.num_params;
    // The dense units over dp_cp's N ranks, a mixture's experts over edp_cp's N / ep.
    StaticMemory st = zero_static_memory(
        zero, (double)(zero > 0 ? s.padded(N, 0) : s.num_params - s.expert_params()), N, b);
    StaticMemory ex = zero_static_memory(
        zero, (double)(zero > 0 ? s.padded(N, 1) : s.expert_params()), std::max(1, N / l.ep), b);
    r.params = st.params + ex.params, r.grads = st.grads + ex.grads;
    r.optimizer = st.optimizer + ex.optimizer;
    std::vector<ChunkBytes> bytes;
    for (const StageShape::Chunk& c : s.chunks) bytes.push_back(chunk_bytes(cfg, l, impl, c));
    Walk w = walk_schedule(l, impl, stage, bytes);
    r.activations = w.peak, r.peak_in_flight = w.peak_in_flight;
    r.workspace = workspace_bytes(cfg, l, s);
    mp.stages.push_back(r);
    if (mp.stages.size() == 1 || r.total() > mp.worst.total()) mp.worst = r;
  }
  return mp;
}

void add_headroom(MemoryPrediction& m, const GpuProfile& gpu) {
  auto slack = [&](const RankMemory& r) { return gpu.allocator_slack * r.activations; };
  for (const RankMemory& r : m.stages)
    if (r.total() + slack(r) > m.worst.total() + slack(m.worst)) m.worst = r;
  m.runtime = gpu.runtime_bytes;
  m.slack = slack(m.worst);
}

// ----------------------------------------------------------------------------
// The book's closed forms beside a run (--report memory on the meta device)

void print_book_memory(const ModelConfig& c, int mbs, int seq, int tp, bool sp, Recompute mode,
                       int blocks, int64_t block_bytes) {
  const double h = c.d_model, v = c.vocab, L = c.layers;
  const double book_params = h * v + L * (12 * h * h + 13 * h) + 2 * h;
  const double book = book_activation_bytes(c.layers, seq, mbs, c.d_model, c.heads, tp, sp, mode);
  const bool none = mode == Recompute::None;
  const std::string formula =
      mode == Recompute::Full ? (sp ? "2 L s b h / t" : "2 L s b h")
      : sp || tp == 1         ? (none ? "L s b h (34 + 5 a s/h) / t" : "34 L s b h / t")
                      : (none ? "L s b h (10 + 24/t + 5 a s/(h t))" : "L s b h (10 + 24/t)");
  printf(
      "the book's closed forms for this shape (h %d, L %d, a %d, v %d; Playbook §2.4-§2.6, "
      "§5.3):\n",
      c.d_model, c.layers, c.heads, c.vocab);
  // What this model is beside the book's GPT: the Llama, or the GPT block without linear biases.
  const bool gpt = c.gpt_block();
  char dropout[32] = "";
  if (c.dropout > 0) snprintf(dropout, sizeof dropout, ", dropout %g", c.dropout);
  printf(
      "  parameters: the book's GPT, h v + L (12 h^2 + 13 h) + 2 h = %.0f; this %s (%s of %d, %s, "
      "%d kv heads, %s embeddings, no linear biases%s) %lld\n",
      book_params, gpt ? "GPT" : "Llama", c.mlp == MlpKind::GeLU ? "GeLU" : "SwiGLU", c.ffn,
      c.norm == NormKind::LayerNorm ? "LayerNorm" : "RMSNorm", c.kv_heads,
      c.tie_embeddings ? "tied" : "untied", dropout, (long long)parameter_count(c));
  printf(
      "  activations of all %d layers, mbs %d x seq %d, tp %d%s, recompute %s: the book's %s = "
      "%s; this %s's, measured on this rank: %s (%d blocks x %s; layers only, without the "
      "embedding, the logits and the workspace)\n",
      c.layers, mbs, seq, tp, sp ? " + sp" : "", recompute_name(mode), formula.c_str(),
      human_bytes(book).c_str(), gpt ? "GPT" : "Llama",
      human_bytes((double)blocks * block_bytes).c_str(), blocks,
      human_bytes((double)block_bytes).c_str());
}
