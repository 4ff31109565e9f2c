// planner.cu: finding the best configuration (Playbook §11). The one idea: every number the
// planner prints for a layout is one the book gives a formula for, so a layout can be judged
// on paper before it runs: static memory is §4.1's per-stage formula (to the byte, as
// --report memory checks it), activations are model.cu's per-block formula held as many times
// as the pipeline's own schedule table keeps micro-batches in flight, compute is the book's
// FLOP count at an achievable fraction of the peak, and communication is latency plus bytes
// over bus bandwidth for every collective the layout issues, exposed only where appendix A3
// says it cannot hide behind compute.
#include "planner/planner.cuh"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <unistd.h>

#include "context_parallel.cuh"
#include "runtime/dtype.cuh"
#include "runtime/formulas.cuh"
#include "runtime/ops.cuh"
#include "runtime/parameters.cuh"
#include "tensor_parallel.cuh"

static const double GiB = 1024.0 * 1024 * 1024;

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
// GPU profiles

// The H100 numbers the whole model uses (the book's cluster: 8 H100 SXM per node, 400 Gb/s per
// GPU between nodes). Bus bandwidths are the book's own measurement (Playbook §8.1,
// pp_comm_bandwidth: median busbw of 256 MB collectives on 1 to 64 nodes): within a node
// all-reduce reaches 436 GB/s, all-gather and reduce-scatter 250; between nodes, with a latency
// of 5 us per ring step, 1/busbw = 1/B + c R + alpha R / S over R = 8 x nodes ranks fits
// all-reduce with B = 408 GB/s and c = 4.1e-14 s/B, all-gather and reduce-scatter with B = 285
// GB/s and c = 1.2e-13 s/B (least squares on relative error over 2..64 nodes; within 30% of
// every point but 4 and 8 nodes' all-reduce). compute_efficiency: the fraction of the bf16 peak
// a large step sustains (GEMMs, FlashAttention and the memory-bound rest together).
static GpuProfile h100() {
  GpuProfile g;
  g.name = "h100";
  g.peak_bf16 = 989e12, g.peak_fp32 = 67e12, g.peak_fp8 = 1979e12;
  g.memory = 80 * GiB, g.hbm_bandwidth = 3.35e12;
  g.intra_allreduce_bw = 436e9, g.intra_gather_bw = 250e9, g.intra_p2p_bw = 450e9;
  g.intra_alpha = g.intra_alpha_gather = g.intra_alpha_p2p = 2e-6;
  g.inter_allreduce_bw = 408e9, g.inter_gather_bw = 285e9;
  g.inter_allreduce_per_rank = 4.1e-14, g.inter_gather_per_rank = 1.2e-13;
  g.inter_alpha = 5e-6;
  g.nic_bw = 50e9;
  g.compute_efficiency = 0.45, g.gemm_half_width = 128;
  g.runtime_bytes = 2 * GiB;  // the book: CUDA context and kernels 1-2 GB, plus buffers
  g.source = "H100 SXM datasheet; busbw fitted to the book's §8.1 measurement";
  return g;
}

GpuProfile gpu_profile(const std::string& name) {
  if (name == "h100") return h100();
  if (name == "h200") {  // the H100's compute and NVLink with 141 GB of faster memory
    GpuProfile g = h100();
    g.name = "h200", g.memory = 141e9, g.hbm_bandwidth = 4.8e12;
    g.source = "H200 SXM datasheet; links as the H100's";
    return g;
  }
  if (name == "a100") {  // NVLink 3 (300 GB/s per direction), 200 Gb/s per GPU between nodes
    GpuProfile g = h100();
    g.name = "a100";
    g.peak_bf16 = 312e12, g.peak_fp32 = 19.5e12, g.peak_fp8 = 0;
    g.memory = 80 * GiB, g.hbm_bandwidth = 2.04e12;
    const double nvlink = 300.0 / 450.0;
    g.intra_allreduce_bw *= nvlink, g.intra_gather_bw *= nvlink, g.intra_p2p_bw = 300e9;
    g.nic_bw = 25e9;
    g.inter_allreduce_bw = std::min(g.inter_allreduce_bw, 8 * g.nic_bw);
    g.inter_gather_bw = std::min(g.inter_gather_bw, 8 * g.nic_bw);
    g.source = "A100 SXM datasheet; busbw scaled from the H100's by NVLink and network bandwidth";
    return g;
  }
  if (name == "cpu") {  // this machine: one node whose "GPUs" are MPI ranks sharing its cores
    GpuProfile g;
    g.name = "cpu";
    g.peak_fp32 = 0;  // measured by the caller (device_peak) for its ranks' threads
    g.peak_bf16 = g.peak_fp8 = 0;
    double pages = (double)sysconf(_SC_PHYS_PAGES), page = (double)sysconf(_SC_PAGE_SIZE);
    g.memory = pages * page;
    g.hbm_bandwidth = 10e9;
    // Shared-memory MPI between processes: a few GB/s and microseconds (bench_comm measures
    // this machine's; plan --comm-fit reads its fit).
    g.intra_allreduce_bw = g.intra_gather_bw = 4e9, g.intra_p2p_bw = 4e9;
    g.intra_alpha = g.intra_alpha_gather = g.intra_alpha_p2p = 5e-6;
    g.inter_allreduce_bw = g.inter_gather_bw = g.nic_bw = 4e9;
    g.inter_alpha = 5e-6;
    g.compute_efficiency = 0.5, g.gemm_half_width = 32;
    g.source = "this machine: sgemm measured now, shared-memory MPI defaults";
    return g;
  }
  std::string known;
  for (const std::string& n : gpu_profile_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--gpu " + name + ": unknown profile; choose one of " + known);
}
std::vector<std::string> gpu_profile_names() { return {"h100", "h200", "a100", "cpu"}; }

void apply_comm_fit(GpuProfile& g, const std::string& path) {
  std::ifstream f(path);
  if (!f) throw UsageError("--comm-fit " + path + ": cannot open it (bench_comm --fit writes it)");
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    auto link = [&](const char* name, double& alpha, double& bw) {
      const nlohmann::json& c = j.at("collectives").at(name);
      alpha = c.at("alpha_s").get<double>(), bw = c.at("busbw_bytes_per_s").get<double>();
      if (!(alpha >= 0) || !(bw > 0)) throw std::invalid_argument(name);
    };
    double gather_alpha = 0, gather_bw = 0, scatter_alpha = 0, scatter_bw = 0;
    link("all_reduce", g.intra_alpha, g.intra_allreduce_bw);
    link("all_gather", gather_alpha, gather_bw);
    link("reduce_scatter", scatter_alpha, scatter_bw);
    link("send_recv", g.intra_alpha_p2p, g.intra_p2p_bw);
    // One figure for both: the planner prices all-gathers and reduce-scatters alike.
    g.intra_alpha_gather = (gather_alpha + scatter_alpha) / 2;
    g.intra_gather_bw = 2 / (1 / gather_bw + 1 / scatter_bw);
    g.inter_allreduce_bw = g.intra_allreduce_bw, g.inter_gather_bw = g.intra_gather_bw;
    g.inter_allreduce_per_rank = g.inter_gather_per_rank = 0;
    g.inter_alpha = g.intra_alpha, g.nic_bw = g.intra_p2p_bw;
    g.source += "; collectives measured by bench_comm --fit (" + path + ")";
    if (g.name == "cpu" && j.contains("gemm_flops_alone")) {
      // A rank alone runs at the machine's rate for one rank; together the ranks run
      // shared_capacity at a time (the rest wait for a core).
      double alone = j.at("gemm_flops_alone").get<double>();
      double busy = j.at("gemm_flops_per_rank").get<double>();
      int ranks = j.at("ranks").get<int>();
      g.peak_fp32 = alone;
      if (ranks * busy < 0.9 * ranks * alone) g.shared_capacity = ranks * busy / alone;
      g.source += ", its fp32 GEMM rate alone and shared";
    }
  } catch (const std::exception& e) {
    throw UsageError("--comm-fit " + path + ": not bench_comm --fit's JSON (" + e.what() + ")");
  }
}

double peak_flops(const GpuProfile& g, Precision p) {
  switch (p) {
    case Precision::FP32: return g.peak_fp32;
    case Precision::BF16:
    case Precision::FP16: return g.peak_bf16;
    case Precision::FP8: return g.peak_fp8;
  }
  return 0;
}
// MFU's peak: the format's, fp8 counted against bf16 (its attention and the rest run in bf16).
static double mfu_peak(const GpuProfile& g, Precision p) {
  return p == Precision::FP32 ? g.peak_fp32 : g.peak_bf16;
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
       (bf16_grads ? " (bf16 grads)" : "") + " recompute " + recompute_name(recompute);
  if (attention == AttentionKind::Naive) s += " naive attention";
  return s;
}

std::string Layout::flags() const {
  std::string s = "--dp " + std::to_string(dp) + " --tp " + std::to_string(tp) + " --pp " +
                  std::to_string(pp) + " --cp " + std::to_string(cp);
  if (sp) s += " --sp";
  if (pp > 1) s += std::string(" --pp-schedule ") + pp_schedule_name(schedule);
  if (virtual_stages > 1) s += " --pp-virtual " + std::to_string(virtual_stages);
  if (zero) s += " --zero " + std::to_string(zero);
  s += " --mbs " + std::to_string(mbs) + " --grad-acc " + std::to_string(grad_acc);
  s += std::string(" --dtype ") + precision_name(precision);
  if (bf16_grads) s += " --grad-acc-dtype bf16";
  if (recompute != Recompute::None) s += std::string(" --recompute ") + recompute_name(recompute);
  s += std::string(" --attention ") + attention_name(attention);
  return s;
}

void validate_layout(const ModelConfig& cfg, const Layout& l) {
  validate_model_config(cfg);
  validate_tensor_parallel(cfg, l.tp, l.sp);
  validate_context_parallel(cfg.seq, l.cp, CpBalance::Zigzag, l.attention == AttentionKind::Flash,
                            l.tp, l.sp, 0);
  validate_pipeline(cfg.layers, l.pp, l.virtual_stages, l.grad_acc, l.schedule,
                    cfg.tie_embeddings, l.zero);
  if (l.ep != 1) throw UsageError("--ep: expert parallelism is not planned (dense models only)");
}

// ----------------------------------------------------------------------------
// One pipeline rank's part of the model

namespace {

// What a pipeline rank holds (its chunks' blocks, embedding, head) and its units' sizes on one
// tensor-parallel rank: build_model_layout's own layout, which allocates nothing.
struct StageShape {
  struct Chunk {
    int blocks = 0;
    bool embedding = false, head = false;
    int global = 0;  // this chunk's index among the pipeline's p x V chunks
  };
  std::vector<Chunk> chunks;
  std::vector<int64_t> unit_numel;
  int64_t num_params = 0;
  int64_t padded(int N) const {
    int64_t total = 0;
    for (int64_t n : unit_numel) total += N * ((n + N - 1) / N);
    return total;
  }
};

StageShape build_stage_shape(const ModelConfig& cfg, const Layout& l, int stage) {
  Comm grid;  // only its tp group's size and rank are read: a layout, not a communicator
  grid.tp.size = l.tp, grid.tp.rank = 0;
  std::vector<Stage> chunks = pipeline_chunks(cfg.layers, l.pp, l.virtual_stages, stage);
  Model m = build_model_layout(cfg, TensorParallel{&grid, l.sp}, chunks);
  StageShape s;
  for (size_t c = 0; c < m.chunks.size(); c++)
    s.chunks.push_back({m.blocks((int)c), m.chunks[c].embedding, m.chunks[c].head,
                        stage + (int)c * l.pp});
  for (const ModelUnit& u : m.units) s.unit_numel.push_back(u.numel);
  s.num_params = m.num_params;
  return s;
}
// The same, remembered: a search asks for the same few stages many times.
const StageShape& stage_shape(const ModelConfig& cfg, const Layout& l, int stage) {
  static std::map<std::string, StageShape> cache;
  std::string key;
  for (int v : {cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn, cfg.seq,
                (int)cfg.tie_embeddings, l.tp, l.pp, l.virtual_stages, stage})
    key += std::to_string(v) + ",";
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 4096) cache.clear();
    it = cache.emplace(key, build_stage_shape(cfg, l, stage)).first;
  }
  return it->second;
}

// Bytes of one micro-batch's activations on one chunk, and how they move while it runs.
struct ChunkBytes {
  double held = 0;         // after its forward, until its backward
  double forward_peak = 0; // the most held during its forward (>= held)
  double backward_peak = 0;  // extra over what is held when its backward starts (>= 0)
  double weight_held = 0;  // zero-bubble: held from its B until its W
  double sent = 0;         // x_final, sent to the next stage
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
  const int e = l.precision == Precision::FP32 ? 4 : 2;
  std::shared_ptr<const AttentionCore> attention = attention_core(l);
  // One block: what it keeps, and everything in fp32 right after its forward (before the
  // recompute policy drops and the compute format shrinks what it keeps).
  double kept, fresh;
  if (impl.activations == ActivationFormula::Book) {
    kept = fresh = book_activation_bytes(1, T, l.mbs, cfg.d_model, cfg.heads, l.tp, l.sp,
                                         l.recompute);
  } else {
    kept = (double)activation_bytes_per_block(local, l.mbs, T, l.tp, l.sp, l.recompute, *attention, e);
    fresh = (double)activation_bytes_per_block(local, l.mbs, T, l.tp, l.sp, Recompute::None,
                                               *attention, 4);
  }
  // The block's own peak: fresh, or while its tensors are rounded to the compute format one by
  // one (store_in_compute_format: the 16-bit copy exists next to the fp32 one), in
  // stored_in_compute_format's order. Full recomputation keeps only the (fp32) input.
  double block_peak = fresh;
  if (impl.activations == ActivationFormula::Llama && e < 4 && l.recompute != Recompute::Full) {
    const double probs = fresh - (double)activation_bytes_per_block(
                                     local, l.mbs, T, l.tp, l.sp, Recompute::Selective, *attention, 4);
    double now = fresh - (l.recompute == Recompute::Selective ? probs : 0);
    std::vector<double> order = {n * D, N * L.heads * hd, N * L.kv_heads * hd, N * L.kv_heads * hd,
                                 l.recompute == Recompute::None ? probs / 4 : 0,
                                 N * L.heads * hd, n * D, N * L.ffn, N * L.ffn, N * L.ffn};
    for (double elements : order) {
      block_peak = std::max(block_peak, now + e * elements);
      now -= (4 - e) * elements;
    }
  }
  const double positions = 4 * N, ids = c.embedding ? 4 * N : 0, x_final = 4 * n * D;
  const double normf = 4 * n * D, logits = 4 * N * L.vocab;
  const double head = c.head ? normf + 4 * n + logits + 4 * N + 4 * N + 8 * N : 0;
  ChunkBytes b;
  b.sent = x_final;
  b.held = positions + ids + c.blocks * kept + x_final + head;
  // The last block's forward: the earlier blocks kept, this one at its peak, its output.
  b.forward_peak = std::max(b.held, positions + ids + (c.blocks - 1) * kept + block_peak + x_final);
  const bool split =
      l.pp > 1 && splits_backward(pipeline_schedule(l.schedule, l.pp, 0, 2 * l.pp, l.virtual_stages));
  if (l.recompute == Recompute::Full) {
    // The first block's backward rebuilds its activations (fp32) from its input; the head's
    // logits and final norm are gone by then unless a deferred W still reads them.
    double freed = c.head && !split ? normf + logits : 0;
    b.backward_peak = std::max(0.0, fresh - 4 * n * D - freed);
  }
  if (split) {
    // The W op's inputs: the linear layers' inputs (norm1 and norm2 only without sp: with sp
    // the layers read gathered copies, which are workspace), held in fp32 where they are
    // activations (fp32 runs and full recomputation; in 16-bit runs the backward reads widened
    // workspace copies); the head's final-norm output and the logits' gradient (in place).
    double block_inputs = (l.sp ? 0 : 2 * 4 * N * D) + 4 * N * L.heads * hd + 4 * N * L.ffn;
    bool fp32_inputs = e == 4 || l.recompute == Recompute::Full;
    b.weight_held = (fp32_inputs ? c.blocks * block_inputs : 0) +
                    (c.head ? (l.sp ? 0 : normf) + logits : 0);
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
  const int p = l.pp, V = l.virtual_stages, last = p * V - 1;
  std::vector<PipelineOp> table =
      pipeline_schedule(p > 1 ? l.schedule : PpSchedule::OneFOneB, p, stage, l.grad_acc, V);
  // The engine's sends (pipeline_parallel.cu, Exchange): queued until the next receive, which
  // over NCCL sends them with it and lets them go; otherwise (no receive follows, or MPI) they
  // stay in flight, their buffers alive, until the step ends.
  std::set<std::pair<int, int>> queued, in_flight, done;
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
    const int g = stage + op.chunk * p;
    const std::pair<int, int> key{op.micro, op.chunk};
    const ChunkBytes& b = bytes[op.chunk];
    bool receives = (op.kind == Phase::Forward && g > 0) || (op.kind == Phase::Backward && g < last);
    if (receives && !impl.mpi_sends)
      release_queued();
    else
      flush();
    if (op.kind == Phase::Forward) {
      held++;
      note(now + b.forward_peak);
      now += b.held;
      if (g < last) queued.insert(key);
    } else if (op.kind == Phase::Backward) {
      note(now + b.backward_peak);
      now -= b.held;
      held--;
      done.insert(key);
      if (queued.count(key) || in_flight.count(key)) now += b.sent;  // its send still reads it
      now += b.weight_held;
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
  return std::max(block, head) + units + (l.pp > 1 ? 4 * n * D : 0);
}

}  // namespace

MemoryPrediction predict_memory(const ModelConfig& cfg, const Layout& l, const Implementation& impl,
                                std::vector<int> stages) {
  if (stages.empty())
    for (int s = 0; s < l.pp; s++) stages.push_back(s);
  MemoryPrediction mp;
  const int N = l.dp * l.cp;
  const int zero = N > 1 ? l.zero : 0;  // ./train runs --zero k over one rank as zero 0
  const BytesPerParameter b = bytes_per_parameter(zero, l.precision, l.bf16_grads);
  for (int stage : stages) {
    const StageShape& s = stage_shape(cfg, l, stage);
    RankMemory r;
    r.stage = stage;
    r.num_params = s.num_params;
    r.padded_params = zero > 0 ? s.padded(N) : s.num_params;
    StaticMemory st = zero_static_memory(zero, (double)r.padded_params, N, b);
    r.params = st.params, r.grads = st.grads, r.optimizer = st.optimizer;
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

// ----------------------------------------------------------------------------
// Communication: the alpha-beta cost of ring collectives (collectives notes §2.4, nccl-tests'
// bus bandwidth)

namespace {

enum class Op { AllReduce, Gather, PointToPoint };  // Gather: all-gather or reduce-scatter

// Where a group's members sit: how many, whether the group leaves the node, and how many of
// them share the busiest node (each brings its own network link).
struct Placement {
  int size = 1, per_node = 1;
  bool inter = false;
};
// The group of world rank 0 along the given grid dimensions ("dp", "pp", "cp", "tp", "dp_cp").
Placement placement(const Layout& l, const Cluster& cl, const std::string& group) {
  Grid g;
  g.dp = l.dp, g.pp = l.pp, g.cp = l.cp, g.tp = l.tp;
  std::vector<int> members;
  const bool d = group == "dp" || group == "dp_cp", p = group == "pp",
             c = group == "cp" || group == "dp_cp", t = group == "tp";
  for (int di = 0; di < (d ? l.dp : 1); di++)
    for (int pi = 0; pi < (p ? l.pp : 1); pi++)
      for (int ci = 0; ci < (c ? l.cp : 1); ci++)
        for (int ti = 0; ti < (t ? l.tp : 1); ti++) members.push_back(g.rank_of(di, pi, ci, ti));
  std::map<int, int> per_node;
  for (int r : members) per_node[r / cl.gpus_per_node]++;
  Placement pl;
  pl.size = (int)members.size();
  pl.inter = per_node.size() > 1;
  for (auto& [node, k] : per_node) pl.per_node = std::max(pl.per_node, k);
  return pl;
}

// Seconds for one collective on `bytes` (all-reduce: the buffer; all-gather: the gathered
// output; reduce-scatter: the input; point-to-point: the message).
double collective_time(const GpuProfile& gpu, const Placement& pl, Op op, double bytes) {
  const int R = pl.size;
  if (op == Op::PointToPoint) {
    double bw = pl.inter ? gpu.nic_bw : gpu.intra_p2p_bw;
    return (pl.inter ? gpu.inter_alpha : gpu.intra_alpha_p2p) + bytes / bw;
  }
  if (R <= 1 || bytes <= 0) return 0;
  const bool ar = op == Op::AllReduce;
  const double steps = (ar ? 2.0 : 1.0) * (R - 1), factor = steps / R;
  if (!pl.inter)
    return steps * (ar ? gpu.intra_alpha : gpu.intra_alpha_gather) +
           factor * bytes / (ar ? gpu.intra_allreduce_bw : gpu.intra_gather_bw);
  // Between nodes: the ring's bandwidth, capped by the network links its members on one node
  // bring, and degraded by the ranks in it.
  double inverse = std::max(1.0 / (ar ? gpu.inter_allreduce_bw : gpu.inter_gather_bw),
                            1.0 / (pl.per_node * gpu.nic_bw)) +
                   R * (ar ? gpu.inter_allreduce_per_rank : gpu.inter_gather_per_rank);
  return steps * gpu.inter_alpha + factor * bytes * inverse;
}

// The efficiency of a GEMM along a dimension of `width`: it saturates the device only when wide
// (gemm_half_width: the width at which it reaches half of the achievable rate).
double gemm_efficiency(const GpuProfile& gpu, double width) {
  return gpu.compute_efficiency * width / (width + gpu.gemm_half_width);
}

// simulate_pipeline on ticks: its result depends on the ratios of the op costs only, so
// layouts with the same (schedule, p, m, V) and ratios share one run.
PipelineTiming pipeline_timing(PpSchedule s, int p, int m, int V, double t_f, double t_b, double t_w) {
  static std::map<std::vector<double>, PipelineTiming> cache;
  auto round2 = [](double x) { return std::round(x * 100) / 100; };
  std::vector<double> key = {(double)s, (double)p, (double)m, (double)V, round2(t_b / t_f),
                             round2(t_w / t_f)};
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 20000) cache.clear();
    it = cache.emplace(key, simulate_pipeline(s, p, m, V, 1.0, key[4], key[5])).first;
  }
  PipelineTiming t = it->second;
  t.makespan *= t_f;
  for (double& b : t.busy) b *= t_f;
  return t;
}

}  // namespace

// The ranks of a layout on one node.
static int world_ranks_per_node(const Layout& l, const Cluster& cl) {
  return std::min(l.world(), cl.gpus_per_node);
}

double StepTime::exposed_total() const {
  double t = 0;
  for (auto& [group, s] : exposed) t += s;
  return t;
}

double book_flops_per_token(const ModelConfig& cfg) {
  return model_flops_per_token((double)parameter_count(cfg), cfg.layers,
                               cfg.heads * cfg.head_dim(), cfg.seq);
}

StepTime predict_time(const ModelConfig& cfg, const Layout& l, const Cluster& cl,
                      const Implementation& impl) {
  const GpuProfile& gpu = cl.gpu;
  const LocalDims L = local_dims(cfg, 0, l.tp);
  const int m = l.grad_acc, p = l.pp, V = l.virtual_stages;
  const double T = (double)cfg.seq / l.cp, N = l.mbs * T, n = l.sp ? N / l.tp : N;
  const double D = cfg.d_model, hd = cfg.head_dim(), wire = impl.activation_wire_bytes;
  const double gemm_peak = peak_flops(gpu, l.precision);
  const double attn_peak = l.precision == Precision::FP32 ? gpu.peak_fp32 : gpu.peak_bf16;
  // One block's forward on this rank: its linear layers (2 FLOPs per weight and token) and
  // attention (QK^T and AV over the whole sequence, as the book counts them: 4 h s per token).
  const double block_weights = D * hd * (2.0 * L.heads + 2.0 * L.kv_heads) + 3.0 * D * L.ffn;
  // A GEMM of this step is [N tokens, D] x [D, D/tp or wider]: both its token count and the
  // width each rank keeps decide how close it comes to the achievable rate.
  const double eff = gemm_efficiency(gpu, N) * gemm_efficiency(gpu, D / l.tp) / gpu.compute_efficiency;
  const double block_gemm = 2 * N * block_weights / (gemm_peak * eff);
  const double block_attn = 4 * N * (L.heads * hd) * cfg.seq / (attn_peak * eff);
  const double head_fwd = 2 * N * D * L.vocab / (gemm_peak * eff);
  const double block_fwd = block_gemm + block_attn;

  // Tensor parallelism: every collective on the critical path (Playbook §5.3; picoscale's are
  // blocking). Per block, forward: 2 all-reduces of [N, D], or under sp 2 all-gathers and 2
  // reduce-scatters; backward: 2 all-reduces, or 4 all-gathers (2 re-gathering the norms'
  // outputs) and 2 reduce-scatters (runtime/formulas.cu, tp_expected_traffic).
  Placement tp_pl = placement(l, cl, "tp");
  const double K = N * D * wire;
  double tp_fwd = 0, tp_bwd = 0;
  if (l.tp > 1) {
    double ar = collective_time(gpu, tp_pl, Op::AllReduce, K);
    double ag = collective_time(gpu, tp_pl, Op::Gather, K);
    tp_fwd = l.sp ? 4 * ag : 2 * ar;  // a reduce-scatter costs an all-gather
    tp_bwd = l.sp ? 6 * ag : 2 * ar;
  }
  // Context parallelism (Playbook §7.2): per block, cp - 1 ring steps, each passing k and v of
  // this rank's tokens (forward) or k, v and their gradient accumulators (backward) while one
  // block of attention computes; only what the step's compute does not cover is exposed.
  double cp_fwd = 0, cp_bwd = 0;
  if (l.cp > 1) {
    Placement cp_pl = placement(l, cl, "cp");
    double kv = 2 * N * L.kv_heads * hd * wire;
    double step_fwd = collective_time(gpu, cp_pl, Op::PointToPoint, kv);
    double step_bwd = collective_time(gpu, cp_pl, Op::PointToPoint, 2 * kv);
    cp_fwd = (l.cp - 1) * std::max(0.0, step_fwd - block_attn / l.cp);
    cp_bwd = (l.cp - 1) * std::max(0.0, step_bwd - 2 * block_attn / l.cp);
  }
  // Pipeline parallelism (Playbook §8.7): each op receives [n, D] from its neighbour and waits
  // for it (the engine's receives block), so the transfer adds to the op.
  double p2p = 0;
  if (p > 1) p2p = collective_time(gpu, placement(l, cl, "pp"), Op::PointToPoint, n * D * wire);

  // Appendix A3: an overlapped tp collective hides behind the GEMMs of its block.
  if (impl.tp_overlap) {
    tp_fwd = std::max(0.0, tp_fwd - block_gemm);
    tp_bwd = std::max(0.0, tp_bwd - 2 * block_gemm);
  }
  // The slowest pipeline rank's forward and backward of one micro-batch (all its chunks). The
  // first and the last bound the others: the most blocks and the embedding, or the head
  // (pipeline_chunks gives the first chunks the extra blocks).
  std::vector<const StageShape*> shapes;
  for (int s : p > 1 ? std::vector<int>{0, p - 1} : std::vector<int>{0})
    shapes.push_back(&stage_shape(cfg, l, s));
  double stage_fwd = 0, stage_bwd = 0, stage_recompute = 0, stage_tp = 0, stage_cp = 0,
         stage_p2p = 0;
  for (const StageShape* shape : shapes) {
    double f = 0, r = 0, tpc = 0, cpc = 0, pc = 0;
    int blocks = 0;
    for (const StageShape::Chunk& c : shape->chunks) {
      blocks += c.blocks;
      f += c.blocks * block_fwd + (c.head ? head_fwd : 0);
      if (l.recompute == Recompute::Full) r += c.blocks * block_fwd;
      if (l.recompute == Recompute::Selective && l.attention == AttentionKind::Naive)
        r += c.blocks * block_attn;
      // The vocab-parallel embedding's forward and the head's backward add one collective each.
      tpc += c.blocks * (tp_fwd + tp_bwd) + ((c.embedding ? 1 : 0) + (c.head ? 1 : 0)) * tp_fwd / 2;
      cpc += c.blocks * (cp_fwd + cp_bwd);
      pc += (c.global > 0 ? 2 * p2p : 0) + (c.global < p * V - 1 ? 2 * p2p : 0);
    }
    if (impl.balanced_stages && p > 1) {  // every stage a p-th of the whole model's work
      f = (cfg.layers * block_fwd + head_fwd) / p;
      r = r / blocks * cfg.layers / p;
    }
    if (3 * f + r + tpc + cpc + pc > stage_fwd + stage_bwd + stage_tp + stage_cp + stage_p2p) {
      stage_fwd = f, stage_bwd = 2 * f + r, stage_recompute = r;
      stage_tp = tpc, stage_cp = cpc, stage_p2p = pc;
    }
  }
  // Per op (a chunk's share): compute plus its exposed tp, cp and pp communication; the
  // backward splits into B and W halves of its matmuls under zero-bubble tables.
  const double ops = (double)V;
  const bool split =
      p > 1 && splits_backward(pipeline_schedule(l.schedule, p, 0, std::max(m, 2 * p), V));
  const double comm_op = (stage_tp + stage_cp + stage_p2p) / ops / 2;
  double t_f = stage_fwd / ops + comm_op, t_b = stage_bwd / ops + comm_op, t_w = 0;
  if (split) t_w = stage_fwd / ops, t_b -= t_w;  // W: the weight-gradient GEMMs, 1 forward
  PipelineTiming timing = p > 1 ? pipeline_timing(l.schedule, p, m, V, t_f, t_b, t_w)
                                : PipelineTiming{};
  const double busy = m * (stage_fwd + stage_bwd + stage_tp + stage_cp + stage_p2p);
  const double makespan = p > 1 ? timing.makespan : busy;

  StepTime st;
  st.compute = m * (stage_fwd + stage_bwd);
  st.recompute = m * stage_recompute;
  st.bubble = std::max(0.0, makespan - busy);
  st.exposed["tp"] = m * stage_tp;
  st.exposed["cp"] = m * stage_cp;
  st.exposed["pp"] = m * stage_p2p;

  // Data parallelism and ZeRO over dp_cp (Playbook §3, §4; appendix A3): what the backward
  // of the micro-batch that launches the collectives covers is hidden; the rest is exposed.
  const int Nd = l.dp * l.cp;
  const int zero = Nd > 1 ? l.zero : 0;
  double dp_exposed = 0, opt = 0;
  {
    Placement pl = placement(l, cl, "dp_cp");
    const double grad_bytes = l.bf16_grads ? 2 : 4;
    const double weight_bytes = l.precision == Precision::FP32 ? 4 : 2;
    double worst = 0, worst_opt = 0;
    for (const StageShape* shape : shapes) {
      const StageShape& sh = *shape;
      double shard = zero > 0 ? (double)sh.padded(Nd) / Nd : (double)sh.num_params;
      double o = 32 * shard / gpu.hbm_bandwidth;  // AdamW: ~32 bytes read and written per parameter
      double exposed = 0;
      if (Nd > 1) {
        double window = stage_bwd;  // the last micro-batch's backward on this stage
        if (zero == 0) {
          // Buckets of 25 MiB (data_parallel.cu), all-reduced as they fill; the last cannot hide.
          double bytes = grad_bytes * sh.num_params, bucket = 25.0 * 1024 * 1024;
          int buckets = std::max(1, (int)std::ceil(bytes / bucket));
          double each = collective_time(gpu, pl, Op::AllReduce, bytes / buckets);
          exposed = std::max(each, buckets * each - window);
        } else {
          double rs = 0, rs_last = 0, ag = 0;
          for (int64_t u : sh.unit_numel) {
            double padded = (double)Nd * ((u + Nd - 1) / Nd);
            rs_last = collective_time(gpu, pl, Op::Gather, grad_bytes * padded);
            rs += rs_last;
            ag += collective_time(gpu, pl, Op::Gather, weight_bytes * padded);
          }
          if (zero == 1) exposed = std::max(rs_last, rs - window);
          if (zero == 2) exposed = m * std::max(rs_last, rs - window);  // every micro-batch
          if (zero <= 2) exposed += std::max(0.0, ag - o);  // gathered as the optimizer updates
          if (zero == 3) {
            // Per micro-batch: every unit gathered before its forward and again before its
            // backward, the next one prefetched while this one computes; the reduce-scatter
            // after its backward overlaps the next unit's (A3: 1/(2 seq mbs) x peak/bw <= 1).
            double units = (double)sh.unit_numel.size();
            double f_unit = stage_fwd / units, b_unit = stage_bwd / units;
            double ag_unit = ag / units, rs_unit = rs / units;
            exposed = m * (ag_unit + units * std::max(0.0, ag_unit - f_unit) +
                           units * std::max(0.0, ag_unit + rs_unit - b_unit));
          }
        }
      }
      worst = std::max(worst, exposed), worst_opt = std::max(worst_opt, o);
    }
    dp_exposed = worst, opt = worst_opt;
  }
  st.exposed["dp"] = dp_exposed;
  st.optimizer = opt;
  // Ranks sharing cores: the node's compute cannot finish before its cores have done every
  // rank's share, however the schedule lets ranks wait (a waiting rank frees its core).
  double floor = 0;
  if (gpu.shared_capacity > 0)
    floor = st.compute * world_ranks_per_node(l, cl) / gpu.shared_capacity;
  st.step = std::max(makespan, floor) + dp_exposed + opt;
  const double tokens = (double)l.dp * l.mbs * l.grad_acc * cfg.seq;
  const int world = l.world();
  st.tokens_per_s_per_gpu = tokens / st.step / world;
  st.mfu = book_flops_per_token(cfg) * tokens / (st.step * world * mfu_peak(gpu, l.precision));
  return st;
}

// ----------------------------------------------------------------------------
// The search

ModelConfig layout_model(const ModelConfig& cfg, const Layout& l, const SearchSpace& space) {
  ModelConfig c = cfg;
  if (space.untie_for_pipeline && l.pp > 1) c.tie_embeddings = false;
  return c;
}

static std::vector<int> divisors(int n) {
  std::vector<int> d;
  for (int i = 1; i <= n; i++)
    if (n % i == 0) d.push_back(i);
  return d;
}

// A rule's message as a reason that groups its cases: its first clause with the numbers
// named N ("--tp 3 does not divide --heads 32: ..." -> "--tp N does not divide --heads N").
static std::string rule(const std::string& why) {
  std::string clause = why.substr(0, why.find(':')), out;
  for (size_t i = 0; i < clause.size(); i++) {
    if (!isdigit((unsigned char)clause[i]) || (i > 0 && clause[i - 1] != ' ')) {
      out += clause[i];
      continue;
    }
    out += 'N';  // a number on its own (not the 1 of zb-h1)
    while (i + 1 < clause.size() && isdigit((unsigned char)clause[i + 1])) i++;
  }
  return out;
}

PlanResult plan_layouts(const ModelConfig& cfg, int64_t global_tokens, const Cluster& cl,
                        const SearchSpace& space, const Implementation& impl) {
  PlanResult r;
  const int world = cl.world();
  auto reject = [&](const std::string& reason, const Layout& l) {
    if (r.rejected[reason]++ == 0) r.rejected_example[reason] = l.str();
  };
  if (global_tokens % cfg.seq) {
    r.error = "a global batch of " + std::to_string(global_tokens) + " tokens is not a whole " +
              "number of sequences of " + std::to_string(cfg.seq) + " tokens";
    return r;
  }
  const int64_t sequences = global_tokens / cfg.seq;
  bool reachable = false;
  r.smallest_memory = INFINITY;
  std::vector<Candidate> all;
  for (int tp : divisors(world)) {
    if (space.max_tp > 0 && tp > space.max_tp) continue;
    for (int pp : divisors(world / tp))
      for (int cp : divisors(world / tp / pp)) {
        if (!space.cp && cp > 1) continue;
        const int dp = world / tp / pp / cp;
        Layout base;
        base.dp = dp, base.tp = tp, base.pp = pp, base.cp = cp;
        if (sequences % dp) {
          r.tried++;
          reject("batch not reachable (" + std::to_string(sequences) +
                     " sequences do not split over dp)", base);
          continue;
        }
        const int64_t per_rank = sequences / dp;
        std::vector<bool> sps = {false};
        if (tp > 1 && space.sp) sps = space.sp_only ? std::vector<bool>{true} : std::vector<bool>{false, true};
        std::vector<std::pair<PpSchedule, int>> schedules = {{PpSchedule::OneFOneB, 1}};
        if (pp > 1) {
          schedules.clear();
          for (PpSchedule s : space.schedules) {
            if (s == PpSchedule::Interleaved) {
              for (int V : space.virtual_stages) schedules.push_back({s, V});
            } else {
              schedules.push_back({s, 1});
            }
          }
        }
        for (bool sp : sps)
          for (auto [schedule, V] : schedules)
            for (int zero : space.zero_stages) {
              if (zero > 0 && dp * cp == 1) continue;  // nothing to shard: the zero 0 layout
              for (Recompute rec : space.recompute)
                for (Precision prec : space.precisions) {
                  // FlashAttention keeps no probabilities: selective recomputation has nothing to
                  // drop, and is the recompute none layout.
                  if (rec == Recompute::Selective && base.attention == AttentionKind::Flash) continue;
                  for (int mbs : divisors((int)std::min<int64_t>(per_rank, 1 << 20))) {
                    if (per_rank % mbs || mbs > space.max_mbs) continue;
                    Layout l = base;
                    l.sp = sp, l.schedule = schedule, l.virtual_stages = V, l.zero = zero;
                    l.recompute = rec, l.precision = prec, l.mbs = mbs;
                    l.grad_acc = (int)(per_rank / mbs);
                    r.tried++;
                    ModelConfig c = layout_model(cfg, l, space);
                    if (peak_flops(cl.gpu, prec) <= 0) {
                      reject(std::string("invalid: no ") + precision_name(prec) + " on " + cl.gpu.name, l);
                      continue;
                    }
                    try {
                      validate_layout(c, l);
                    } catch (const UsageError& e) {
                      reject("invalid: " + rule(e.what()), l);
                      continue;
                    }
                    reachable = true;
                    Candidate cand;
                    cand.layout = l;
                    cand.memory = predict_memory(c, l, impl, pp > 1 ? std::vector<int>{0, pp - 1}
                                                                     : std::vector<int>{0});
                    cand.memory.runtime = cl.gpu.runtime_bytes;
                    r.smallest_memory = std::min(r.smallest_memory, cand.memory.total());
                    if (cand.memory.total() > cl.gpu.memory) {
                      reject("does not fit in " + human_bytes(cl.gpu.memory), l);
                      continue;
                    }
                    cand.time = predict_time(c, l, cl, impl);
                    all.push_back(std::move(cand));
                  }
                }
            }
      }
  }
  std::sort(all.begin(), all.end(), [&](const Candidate& a, const Candidate& b) {
    return space.rank_by_mfu ? a.time.mfu > b.time.mfu : a.time.step < b.time.step;
  });
  for (size_t i = 1; i < all.size(); i++) reject("slower", all[i].layout);
  r.ranked = std::move(all);
  if (!reachable) {
    r.error = "no layout of " + std::to_string(world) + " GPUs reaches a global batch of " +
              std::to_string(sequences) + " sequences of " + std::to_string(cfg.seq) +
              " tokens (dp must divide the sequences, and tp, pp, cp the model)";
  } else if (r.ranked.empty()) {
    r.error = "the model does not fit: the smallest layout needs " +
              human_bytes(r.smallest_memory) + " per GPU, one " + cl.gpu.name + " has " +
              human_bytes(cl.gpu.memory) + " (every layout searched: add nodes, or GPUs with more memory)";
  }
  return r;
}

// ----------------------------------------------------------------------------
// Printing

static std::string gib(double bytes) {
  char buf[32];
  snprintf(buf, sizeof buf, "%.2f", bytes / GiB);
  return buf;
}
static std::string ms(double s) {
  char buf[32];
  snprintf(buf, sizeof buf, s >= 1 ? "%.3f s" : "%.1f ms", s >= 1 ? s : s * 1e3);
  return buf;
}

void print_candidate(int rank, const Candidate& c, const Cluster& cl) {
  const MemoryPrediction& m = c.memory;
  const RankMemory& w = m.worst;
  const StepTime& t = c.time;
  printf("#%d  %s\n", rank, c.layout.str().c_str());
  printf("    memory per GPU (GiB, pipeline stage %d): params %s + grads %s + optimizer %s + "
         "activations %s (%d micro-batch chunks in flight) + workspace ~%s + runtime %s = %s "
         "of %s\n",
         w.stage, gib(w.params).c_str(), gib(w.grads).c_str(), gib(w.optimizer).c_str(),
         gib(w.activations).c_str(), w.peak_in_flight, gib(w.workspace).c_str(),
         gib(m.runtime).c_str(), gib(m.total()).c_str(), gib(cl.gpu.memory).c_str());
  std::string comm;
  for (const char* g : {"tp", "cp", "pp", "dp"}) {
    auto it = t.exposed.find(g);
    double s = it == t.exposed.end() ? 0 : it->second;
    if (s > 0) comm += std::string(comm.empty() ? "" : ", ") + g + " " + ms(s);
  }
  printf("    step %s = compute %s%s + bubble %s + exposed communication %s (%s) + optimizer %s\n",
         ms(t.step).c_str(), ms(t.compute).c_str(),
         t.recompute > 0 ? (" (recompute " + ms(t.recompute) + ")").c_str() : "",
         ms(t.bubble).c_str(), ms(t.exposed_total()).c_str(), comm.empty() ? "none" : comm.c_str(),
         ms(t.optimizer).c_str());
  printf("    %.0f tokens/s per GPU, MFU %.1f%%   ./train %s\n", t.tokens_per_s_per_gpu,
         100 * t.mfu, c.layout.flags().c_str());
}

void print_plan(const PlanResult& r, const ModelConfig& cfg, int64_t global_tokens,
                const Cluster& cl, const Implementation& impl, int top) {
  const GpuProfile& g = cl.gpu;
  printf("model: %s, %.3f B parameters (L %d, h %d, heads %d/%d kv, ffn %d, vocab %d%s), seq %d\n",
         cfg.preset.c_str(), parameter_count(cfg) / 1e9, cfg.layers, cfg.d_model, cfg.heads,
         cfg.kv_heads, cfg.ffn, cfg.vocab, cfg.tie_embeddings ? ", tied" : "", cfg.seq);
  printf("batch: %lld tokens = %lld sequences per step; FLOPs per token (the book's 6N + 12 L h s): "
         "%.3g\n",
         (long long)global_tokens, (long long)(global_tokens / cfg.seq), book_flops_per_token(cfg));
  printf("cluster: %d node%s x %d %s = %d GPUs; peak %.0f TFLOP/s bf16, %.1f fp32; %s GiB; "
         "busbw in a node %.0f (all-reduce) / %.0f GB/s (all-gather), between nodes %.0f / %.0f "
         "GB/s less %.2g / %.2g s/B per rank, %.0f GB/s per GPU; alpha %.1f us in a node, %.1f "
         "between\n",
         cl.nodes, cl.nodes > 1 ? "s" : "", cl.gpus_per_node, g.name.c_str(), cl.world(),
         g.peak_bf16 / 1e12, g.peak_fp32 / 1e12, gib(g.memory).c_str(), g.intra_allreduce_bw / 1e9,
         g.intra_gather_bw / 1e9, g.inter_allreduce_bw / 1e9, g.inter_gather_bw / 1e9,
         g.inter_allreduce_per_rank, g.inter_gather_per_rank, g.nic_bw / 1e9,
         g.intra_alpha * 1e6, g.inter_alpha * 1e6);
  printf("model constants (%s): %.0f%% of peak on large GEMMs, half of that at width %.0f\n",
         g.source.c_str(), 100 * g.compute_efficiency, g.gemm_half_width);
  printf("activations: %s\n",
         impl.activations == ActivationFormula::Llama
             ? "picoscale's Llama (model.cu: RMSNorm, SwiGLU, grouped-query heads, fp32 residual "
               "stream; --activations book for the book's 34 sbh + 5 a s^2 b)"
             : "the book's 34 sbh + 5 a s^2 b (LayerNorm, GeLU, dropout, 16-bit; "
               "--activations llama for picoscale's own)");
  printf("searched %lld layouts\n", (long long)r.tried);
  if (!r.error.empty()) return;
  for (int i = 0; i < top && i < (int)r.ranked.size(); i++) print_candidate(i + 1, r.ranked[i], cl);
  printf("why the others lost:\n");
  for (auto& [why, count] : r.rejected)
    printf("  %6d  %s (e.g. %s)\n", count, why.c_str(), r.rejected_example.at(why).c_str());
}

// ----------------------------------------------------------------------------
// The peak of a running job

DevicePeak device_peak(const Context& ctx, Precision p) {
  DevicePeak d;
  if (ctx.device == Device::CUDA) {
    int dev = 0;
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    for (const char* name : {"H100", "H200", "A100"})
      if (strstr(prop.name, name)) {
        std::string lower = name;
        for (char& ch : lower) ch = (char)tolower(ch);
        GpuProfile g = gpu_profile(lower);
        d.flops = mfu_peak(g, p);
        d.how = std::string(prop.name) + ": the " + lower + " profile's dense " +
                (p == Precision::FP32 ? "fp32" : "bf16") + " peak";
        return d;
      }
  }
  // Measured: the best of 3 square GEMMs of 512 (after one warm-up) on this rank's threads.
  const int n = 512;
  Tensor a = empty({n, n}, Mem::Workspace, ctx.device), b = empty({n, n}, Mem::Workspace, ctx.device);
  Tensor c = empty({n, n}, Mem::Workspace, ctx.device);
  init_normal(a, 1, "a", 1.0f), init_normal(b, 1, "b", 1.0f);
  double best = 1e30;
  for (int i = 0; i < 4; i++) {
    ctx.synchronize();
    double t0 = now_seconds();
    gemm(ctx, false, false, n, n, n, 1, a.f32(), n, b.f32(), n, 0, c.f32(), n);
    ctx.synchronize();
    if (i > 0) best = std::min(best, now_seconds() - t0);
  }
  d.flops = 2.0 * n * n * n / best;
  d.how = "measured now: fp32 GEMM of " + std::to_string(n) + "^3, best of 3, " +
          (ctx.device == Device::CPU
               ? "on " + std::to_string(openblas_get_num_threads()) + " OpenBLAS thread(s)"
               : std::string("on this GPU (no profile for its name)"));
  return d;
}

// ----------------------------------------------------------------------------
// Models

ModelConfig planner_model(const std::string& name) {
  auto llama3 = [](ModelConfig c, int d, int layers, int heads, int ffn, bool tied) {
    c.vocab = 128256, c.d_model = d, c.layers = layers, c.heads = heads, c.kv_heads = 8;
    c.ffn = ffn, c.tie_embeddings = tied, c.rope_theta = 500000.0f, c.seq = 4096;
    return c;
  };
  ModelConfig c;
  c.preset = name;
  if (name == "llama-3b") return llama3(c, 3072, 28, 24, 8192, true);
  if (name == "llama-8b") return llama3(c, 4096, 32, 32, 14336, false);
  if (name == "llama-70b") return llama3(c, 8192, 80, 64, 28672, false);
  if (name.rfind("book-", 0) == 0) {
    std::map<std::string, std::string> base = {
        {"book-1b", "llama-1b"}, {"book-3b", "llama-3b"}, {"book-8b", "llama-8b"}, {"book-80b", "llama-70b"}};
    auto it = base.find(name);
    if (it != base.end()) {
      ModelConfig b = planner_model(it->second);
      b.preset = name, b.kv_heads = b.heads, b.seq = 4096;
      return b;
    }
  }
  for (const std::string& n : model_preset_names())
    if (n == name) return model_preset(name);
  std::string known;
  for (const std::string& n : planner_model_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--model " + name + ": unknown; choose one of " + known);
}
std::vector<std::string> planner_model_names() {
  std::vector<std::string> names = model_preset_names();
  for (const char* n : {"llama-3b", "llama-8b", "llama-70b", "book-1b", "book-3b", "book-8b", "book-80b"})
    names.push_back(n);
  return names;
}

// ----------------------------------------------------------------------------
// The book's campaign

std::vector<CampaignCell> read_campaign(const std::string& path) {
  FILE* f = fopen(path.c_str(), "r");
  if (!f) throw UsageError("--campaign " + path + ": cannot open it");
  std::vector<CampaignCell> cells;
  char line[512];
  int number = 0;
  while (fgets(line, sizeof line, f)) {
    number++;
    std::string s(line);
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s.empty() || s[0] == '#' || s.rfind("model,", 0) == 0) continue;
    std::vector<std::string> fields;
    size_t start = 0;
    for (size_t i = 0; i <= s.size(); i++)
      if (i == s.size() || s[i] == ',') fields.push_back(s.substr(start, i - start)), start = i + 1;
    CampaignCell c;
    try {
      if (fields.size() < 2) throw std::invalid_argument("too few fields");
      c.model = fields[0], c.nodes = std::stoi(fields[1]);
      c.ran = fields.size() >= 11 && !fields[2].empty();
      if (c.ran) {
        c.dp = std::stoi(fields[2]), c.tp = std::stoi(fields[3]), c.pp = std::stoi(fields[4]);
        c.zero = std::stoi(fields[5]), c.mbs = std::stoi(fields[6]), c.grad_acc = std::stoi(fields[7]);
        c.mfu = std::stod(fields[8]) / 100, c.tokens_per_s_per_gpu = std::stod(fields[9]);
        c.memory_gb = std::stod(fields[10]);
      }
    } catch (const std::exception&) {
      fclose(f);
      throw UsageError("--campaign " + path + ":" + std::to_string(number) +
                       ": expected model,nodes,dp,tp,pp,zero,mbs,ga,mfu_percent,tok_s_gpu,mem_gb");
    }
    cells.push_back(c);
  }
  fclose(f);
  return cells;
}

SearchSpace campaign_space() {
  SearchSpace s;
  s.zero_stages = {0, 1};
  s.recompute = {Recompute::None};
  s.schedules = {PpSchedule::OneFOneB};
  s.precisions = {Precision::BF16};
  s.cp = false;
  // The campaign's memory figures need sequence parallelism wherever tp > 1 (8B at tp 8 and
  // mbs 8 in 67 GB; without it the activations alone would take ~67 GB): nanotron's
  // REDUCE_SCATTER mode.
  s.sp_only = true;
  s.untie_for_pipeline = true;
  s.rank_by_mfu = true;
  s.max_mbs = 64;
  return s;
}
Implementation campaign_implementation() {
  Implementation impl;
  impl.activation_wire_bytes = 2;
  impl.tp_overlap = true;       // the campaign's sequence-parallel mode runs asynchronously
  impl.balanced_stages = true;  // nanotron splits the blocks by their compute cost
  return impl;
}

CampaignVerdict judge_campaign_cell(const CampaignCell& cell, const GpuProfile& gpu) {
  CampaignVerdict v;
  v.cell = cell;
  Cluster cl;
  cl.nodes = cell.nodes, cl.gpus_per_node = 8, cl.gpu = gpu;
  ModelConfig cfg = planner_model("book-" + [&] {
    std::string m = cell.model;
    for (char& ch : m) ch = (char)tolower(ch);
    return m;
  }());
  const int64_t tokens = 256LL * cfg.seq;  // 1M tokens: 256 sequences of 4096
  SearchSpace space = campaign_space();
  Implementation impl = campaign_implementation();
  PlanResult r = plan_layouts(cfg, tokens, cl, space, impl);
  // The planner's layouts by the book's columns, in its order.
  auto tuple = [](const Layout& l) {
    return std::vector<int>{l.dp, l.tp, l.pp, l.zero, l.mbs, l.grad_acc};
  };
  std::vector<std::vector<int>> order;
  std::set<std::vector<int>> seen;
  for (const Candidate& c : r.ranked)
    if (seen.insert(tuple(c.layout)).second) order.push_back(tuple(c.layout));
  v.layouts = (int)order.size();
  if (!r.ranked.empty()) v.best = r.ranked.front();
  if (!cell.ran) return v;
  std::vector<int> want = {cell.dp, cell.tp, cell.pp, cell.zero, cell.mbs, cell.grad_acc};
  for (size_t i = 0; i < order.size(); i++)
    if (order[i] == want) v.rank = (int)i + 1;
  // The book's layout itself, fitting or not.
  Layout l;
  l.dp = cell.dp, l.tp = cell.tp, l.pp = cell.pp, l.zero = cell.zero, l.mbs = cell.mbs;
  l.grad_acc = cell.grad_acc, l.sp = cell.tp > 1, l.precision = Precision::BF16;
  ModelConfig c = layout_model(cfg, l, space);
  try {
    validate_layout(c, l);
  } catch (const UsageError&) {
    return v;
  }
  v.valid = true;
  v.book.layout = l;
  v.book.memory = predict_memory(c, l, impl, l.pp > 1 ? std::vector<int>{0, l.pp - 1} : std::vector<int>{0});
  v.book.memory.runtime = gpu.runtime_bytes;
  v.book.time = predict_time(c, l, cl, impl);
  v.fits = v.book.memory.total() <= gpu.memory;
  return v;
}
