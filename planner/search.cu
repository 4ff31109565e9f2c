// search.cu: finding the best configuration (Playbook §11.1-§11.3): every layout picoscale can
// run for a model on a cluster, tried and ranked, and why the others lost; the printout; the
// models the planner knows; the book's benchmark campaign (§11.4) set against the planner.
#include <algorithm>
#include <cmath>
#include <map>
#include <queue>
#include <set>

#include "planner/planner_internal.cuh"
#include "runtime/dtype.cuh"
#include "runtime/formulas.cuh"
#include "runtime/inputs.cuh"
#include "runtime/options.cuh"

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

// Each layout of `in` once per value of `values` that `allowed` lets it take, set by `set`; the
// layouts in order, each one's values in theirs.
template <class T, class Set, class Allowed>
static std::vector<Layout> each(const std::vector<Layout>& in, const std::vector<T>& values,
                                Set set, Allowed allowed) {
  std::vector<Layout> out;
  for (const Layout& l : in)
    for (const T& v : values) {
      if (!allowed(l, v)) continue;
      Layout x = l;
      set(x, v);
      out.push_back(x);
    }
  return out;
}

// The layouts of one grid (dp, tp, pp, cp) the space allows: with and without sp, every
// schedule, ZeRO stage, recompute mode, format and residual stream format, every micro-batch size
// that divides a dp rank's `per_rank` sequences (grad-acc the rest).
static std::vector<Layout> grid_layouts(const Layout& grid, int64_t per_rank,
                                        const SearchSpace& space) {
  auto any = [](const Layout&, const auto&) { return true; };
  std::vector<bool> sps = {false};
  if (grid.tp > 1 && space.sp)
    sps = space.sp_only ? std::vector<bool>{true} : std::vector<bool>{false, true};
  std::vector<Layout> out = each(
      {grid}, sps, [](Layout& l, bool sp) { l.sp = sp; }, any);

  std::vector<std::pair<PpSchedule, int>> schedules = {{PpSchedule::OneFOneB, 1}};
  if (grid.pp > 1) {
    schedules.clear();
    for (PpSchedule s : space.schedules) {  // one chunk per rank, or the space's that s runs
      std::set<int> chunks(space.virtual_stages.begin(), space.virtual_stages.end());
      chunks.insert(1);
      for (int V : chunks)
        if (runs_chunks(s, V)) schedules.push_back({s, V});
    }
  }
  out = each(
      out, schedules,
      [](Layout& l, auto s) {
        l.schedule = s.first;
        l.virtual_stages = s.second;
      },
      any);

  // ZeRO shards over dp x cp: with neither there is nothing to shard (the zero 0 layout).
  out = each(
      out, space.zero_stages, [](Layout& l, int zero) { l.zero = zero; },
      [](const Layout& l, int zero) { return zero == 0 || l.dp * l.cp > 1; });
  // FlashAttention keeps no probabilities: selective recomputation has nothing to drop.
  out = each(
      out, space.recompute, [](Layout& l, Recompute r) { l.recompute = r; },
      [](const Layout& l, Recompute r) {
        return r != Recompute::Selective || l.attention != AttentionKind::Flash;
      });
  out = each(
      out, space.precisions, [](Layout& l, Precision p) { l.precision = p; }, any);
  // A residual stream in fp32, or in the format the activations are stored in.
  out = each(
      out, space.residuals, [](Layout& l, DType r) { l.residual = r; },
      [](const Layout& l, DType r) {
        return r == DType::F32 || r == activation_dtype(l.precision);
      });

  std::vector<int> mbs = divisors((int)std::min<int64_t>(per_rank, space.max_mbs));
  return each(
      out, mbs,
      [&](Layout& l, int m) {
        l.mbs = m;
        l.grad_acc = (int)(per_rank / m);
      },
      [&](const Layout&, int m) { return per_rank % m == 0; });
}

PlanResult plan_layouts(const ModelConfig& cfg, int64_t global_tokens, const Cluster& cl,
                        const SearchSpace& space, const Implementation& impl) {
  PlanResult r;
  const int world = cl.world();
  // `reason` groups the cases; `as` says it of the first one, with its own numbers.
  auto reject = [&](const std::string& reason, const Layout& l, const std::string& as = "") {
    if (r.rejected[reason]++ > 0) return;
    r.rejected_example[reason] = l.str();
    r.rejected_as[reason] = as.empty() ? reason : as;
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
  // Ranked by MFU, whose order the step's bound does not decide, every layout is timed.
  const size_t keep = space.rank_by_mfu ? 0 : (size_t)std::max(0, space.exact_top);
  std::priority_queue<double>
      fastest;  // the exact_top fastest steps timed so far (the top: slowest)
  int64_t untimed = 0;
  Layout first_untimed;
  // §11.1-§11.3 for one layout: valid, fits, then timed.
  auto consider = [&](const Layout& l) {
    r.tried++;
    ModelConfig c = layout_model(cfg, l, space);
    if (peak_flops(cl.gpu, l.precision) <= 0)
      return reject(
          std::string("invalid: no ") + precision_name(l.precision) + " on " + cl.gpu.name, l);
    try {
      validate_layout(c, l, cl.gpu.name);
    } catch (const UsageError& e) {
      return reject("invalid: " + rule(e.what()), l,
                    "invalid: " + std::string(e.what()).substr(0, std::string(e.what()).find(':')));
    }
    reachable = true;
    Candidate cand;
    cand.layout = l;
    cand.memory =
        predict_memory(c, l, impl, l.pp > 1 ? std::vector<int>{0, l.pp - 1} : std::vector<int>{0});
    add_headroom(cand.memory, cl.gpu);
    r.smallest_memory = std::min(r.smallest_memory, cand.memory.total());
    if (cand.memory.total() > cl.gpu.memory)
      return reject("does not fit in " + human_bytes(cl.gpu.memory), l);
    // Slower without a bubble than the exact_top fastest timed so far: it cannot rank.
    const bool full = keep > 0 && fastest.size() == keep;
    cand.time = predict_time(c, l, cl, impl,
                             full ? fastest.top() : std::numeric_limits<double>::infinity());
    if (!cand.time.timed) {
      if (untimed++ == 0) first_untimed = l;
      return;
    }
    if (keep > 0) {
      fastest.push(cand.time.step);
      if (fastest.size() > keep) fastest.pop();
    }
    all.push_back(std::move(cand));
  };
  for (int tp : divisors(world)) {
    if (space.max_tp > 0 && tp > space.max_tp) continue;
    for (int pp : divisors(world / tp))
      for (int cp : divisors(world / tp / pp)) {
        if (!space.cp && cp > 1) continue;
        Layout grid;
        grid.dp = world / tp / pp / cp, grid.tp = tp, grid.pp = pp, grid.cp = cp;
        if (sequences % grid.dp) {  // §11.2: dp ranks take whole sequences
          r.tried++;
          reject("batch not reachable (" + std::to_string(sequences) +
                     " sequences do not split over dp)",
                 grid);
          continue;
        }
        // Expert parallelism (Playbook §9): any ep dividing dp and the experts.
        for (int ep : cfg.experts > 0 ? divisors(grid.dp) : std::vector<int>{1}) {
          if (cfg.experts % ep) continue;
          grid.ep = ep;
          for (const Layout& l : grid_layouts(grid, sequences / grid.dp, space)) consider(l);
        }
      }
  }
  // Ties keep the order of the search (a stable sort), whichever layouts were timed.
  std::stable_sort(all.begin(), all.end(), [&](const Candidate& a, const Candidate& b) {
    return space.rank_by_mfu ? a.time.mfu > b.time.mfu : a.time.step < b.time.step;
  });
  for (size_t i = 1; i < all.size(); i++) reject("slower", all[i].layout);
  if (untimed > 0) {
    reject("slower", first_untimed);  // the example: the second fastest, unless none was timed
    r.rejected["slower"] += untimed - 1;
  }
  r.ranked = std::move(all);
  if (!reachable) {
    r.error = "no layout of " + std::to_string(world) + " GPUs reaches a global batch of " +
              std::to_string(sequences) + " sequences of " + std::to_string(cfg.seq) +
              " tokens (dp must divide the sequences, and tp, pp, cp the model)";
  } else if (r.ranked.empty()) {
    r.error = "the model does not fit: the smallest layout needs " +
              human_bytes(r.smallest_memory) + " per GPU, one " + cl.gpu.name + " has " +
              human_bytes(cl.gpu.memory) +
              " (every layout searched: add nodes, or GPUs with more memory)";
  }
  return r;
}

// ----------------------------------------------------------------------------
// Printing

static std::string gib(double bytes) {
  char buf[32];
  snprintf(buf, sizeof buf, "%.2f", bytes / kGiB);
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
  printf(
      "    memory per GPU (GiB, pipeline stage %d): params %s + grads %s + optimizer %s + "
      "activations %s (%d micro-batch chunks in flight) + workspace ~%s + runtime %s%s = %s "
      "of %s\n",
      w.stage, gib(w.params).c_str(), gib(w.grads).c_str(), gib(w.optimizer).c_str(),
      gib(w.activations).c_str(), w.peak_in_flight, gib(w.workspace).c_str(),
      gib(m.runtime).c_str(), m.slack > 0 ? (" + allocator ~" + gib(m.slack)).c_str() : "",
      gib(m.total()).c_str(), gib(cl.gpu.memory).c_str());
  // The static part as the book writes it (Playbook §2.4, §4.1, §Mixed precision training):
  // bytes per parameter by role over ZeRO's shards.
  const Layout& l = c.layout;
  const int Nd = l.dp * l.cp, stage = Nd > 1 ? l.zero : 0;
  const BytesPerParameter b = bytes_per_parameter(l.precision, l.bf16_grads);
  printf(
      "    static: %s bytes (Ψ parameters, N = %d): %g + %g + %g = %g per parameter unsharded; the "
      "book's 16 in fp32 and 16 or 20 in bf16 (2 bf16 gradients, plus 4 to accumulate them in "
      "fp32); picoscale keeps one gradient buffer, fp32 or bf16 (--grad-acc-dtype)\n",
      zero_memory_formula(stage, b).c_str(), Nd, b.params, b.grads, b.optimizer,
      b.params + b.grads + b.optimizer);
  std::string comm;
  for (const char* g : {"tp", "cp", "pp", "ep", "dp"}) {
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
  printf(
      "batch: %lld tokens = %lld sequences per step; FLOPs per token (the book's 6N + 12 L h s): "
      "%.3g\n",
      (long long)global_tokens, (long long)(global_tokens / cfg.seq), book_flops_per_token(cfg));
  printf(
      "cluster: %d node%s x %d %s = %d GPUs; peak %.0f TFLOP/s bf16, %.1f fp32; %s GiB; "
      "busbw in a node %.0f (all-reduce) / %.0f GB/s (all-gather), between nodes %.0f / %.0f "
      "GB/s less %.2g / %.2g s/B per rank, %.0f GB/s per GPU; alpha %.1f us in a node, %.1f "
      "between\n",
      cl.nodes, cl.nodes > 1 ? "s" : "", cl.gpus_per_node, g.name.c_str(), cl.world(),
      g.peak_bf16 / 1e12, g.peak_fp32 / 1e12, gib(g.memory).c_str(), g.intra.allreduce_bw / 1e9,
      g.intra.gather_bw / 1e9, g.inter_allreduce_bw / 1e9, g.inter_gather_bw / 1e9,
      g.inter_allreduce_per_rank, g.inter_gather_per_rank, g.nic_bw / 1e9, g.intra.alpha * 1e6,
      g.inter_alpha * 1e6);
  printf(
      "compute: the model's own ops on the meta device, priced on the %s roofline (GEMMs %.0f%% "
      "of peak, half of that at width %.0f; attention %.0f%%; memory x %.2f; %.1f us a launch)\n",
      g.name.c_str(), 100 * g.gemm_efficiency, g.gemm_half_width, 100 * g.attention_efficiency,
      g.stream_efficiency, g.launch_s * 1e6);
  printf("activations: %s\n",
         impl.activations != ActivationFormula::Llama
             ? "the book's 34 sbh + 5 a s^2 b (LayerNorm, GeLU, dropout, 16-bit; "
               "--activations llama for picoscale's own)"
         : cfg.gpt_block()
             ? "picoscale's GPT block (model.cu: LayerNorm, GeLU, dropout, the residual stream "
               "as the layout keeps it; --activations book for the book's formula alone)"
             : "picoscale's Llama (model.cu: RMSNorm, SwiGLU, grouped-query heads, fp32 residual "
               "stream; --activations book for the book's 34 sbh + 5 a s^2 b)");
  printf("searched %lld layouts\n", (long long)r.tried);
  if (!r.error.empty()) return;
  for (int i = 0; i < top && i < (int)r.ranked.size(); i++) print_candidate(i + 1, r.ranked[i], cl);
  printf("why the others lost:\n");
  for (auto& [why, count] : r.rejected)  // the first layout's own words, then the layout
    printf("  %6d  %s%s (e.g. %s)\n", count, r.rejected_as.at(why).c_str(),
           count > 1 && r.rejected_as.at(why) != why ? ", and the like" : "",
           r.rejected_example.at(why).c_str());
}

// ----------------------------------------------------------------------------
// Models

// The planner's models are ./train's presets (runtime/model_config.cu): the two tools speak of
// the same shapes.
ModelConfig planner_model(const std::string& name) {
  return model_preset(name);
}
std::vector<std::string> planner_model_names() {
  return model_preset_names();
}

// ----------------------------------------------------------------------------
// The book's campaign

std::vector<CampaignCell> read_campaign(const std::string& path) {
  check_input_file("--campaign " + path, path);  // a directory read as no rows, a FIFO forever
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
    // Each field whole, in its range: "1e9" is no count of nodes, NaN no MFU.
    const std::string where = "--campaign " + path + ":" + std::to_string(number);
    auto count = [&](size_t i, const char* name, double lo, double hi) {
      return (int)parse_number(fields[i], where + ": " + name, lo, hi, true);
    };
    auto real = [&](size_t i, const char* name, double hi) {
      return parse_number(fields[i], where + ": " + name, 0, hi);
    };
    CampaignCell c;
    try {
      if (fields.size() < 2) throw std::invalid_argument("too few fields");
      c.model = fields[0];
      c.ran = fields.size() >= 11 && !fields[2].empty();
      if (!c.ran && fields.size() > 2 && fields.size() != 11)
        throw std::invalid_argument("a row is model,nodes or all eleven fields");
    } catch (const std::exception&) {
      fclose(f);
      throw UsageError(where + ": expected model,nodes,dp,tp,pp,zero,mbs,ga,mfu_percent," +
                       "tok_s_gpu,mem_gb");
    }
    try {
      c.nodes = count(1, "nodes", 1, 1 << 17);
      if (c.ran) {
        c.dp = count(2, "dp", 1, 1 << 20), c.tp = count(3, "tp", 1, 1 << 20);
        c.pp = count(4, "pp", 1, 1 << 20), c.zero = count(5, "zero", 0, 3);
        c.mbs = count(6, "mbs", 1, 1 << 20), c.grad_acc = count(7, "ga", 1, 1 << 20);
        c.mfu = real(8, "mfu_percent", 100) / 100,
        c.tokens_per_s_per_gpu = real(9, "tok_s_gpu", 1e12);
        c.memory_gb = real(10, "mem_gb", 1e6);
      }
    } catch (const UsageError&) {
      fclose(f);
      throw;
    }
    cells.push_back(c);
  }
  fclose(f);
  if (cells.empty())
    throw UsageError("--campaign " + path +
                     ": no cell in it (rows of model,nodes,dp,tp,pp,zero,mbs,ga,mfu_percent,"
                     "tok_s_gpu,mem_gb, as tests/data/book_campaign.csv)");
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
    validate_layout(c, l, cl.gpu.name);
  } catch (const UsageError&) {
    return v;
  }
  v.valid = true;
  v.book.layout = l;
  v.book.memory =
      predict_memory(c, l, impl, l.pp > 1 ? std::vector<int>{0, l.pp - 1} : std::vector<int>{0});
  add_headroom(v.book.memory, gpu);
  v.book.time = predict_time(c, l, cl, impl);
  v.fits = v.book.memory.total() <= gpu.memory;
  return v;
}

// Ranks from 1, ties sharing their mean rank.
static std::vector<double> ranks(const std::vector<double>& v) {
  std::vector<size_t> order(v.size());
  for (size_t i = 0; i < v.size(); i++) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return v[a] < v[b]; });
  std::vector<double> r(v.size());
  for (size_t i = 0; i < order.size();) {
    size_t j = i;
    while (j + 1 < order.size() && v[order[j + 1]] == v[order[i]]) j++;
    for (size_t t = i; t <= j; t++) r[order[t]] = (i + j) / 2.0 + 1;
    i = j + 1;
  }
  return r;
}

double spearman(const std::vector<double>& a, const std::vector<double>& b) {
  PICO_ASSERT(a.size() == b.size() && a.size() >= 2, "spearman: two series of one length, >= 2");
  // Pearson's correlation of the ranks (exact with ties, unlike 1 - 6 sum d^2 / (n (n^2 - 1))).
  std::vector<double> ra = ranks(a), rb = ranks(b);
  const double mean = (a.size() + 1) / 2.0;
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < a.size(); i++) {
    sab += (ra[i] - mean) * (rb[i] - mean);
    saa += (ra[i] - mean) * (ra[i] - mean), sbb += (rb[i] - mean) * (rb[i] - mean);
  }
  return saa > 0 && sbb > 0 ? sab / std::sqrt(saa * sbb) : 0.0;
}

CampaignAgreement campaign_mfu_agreement(const std::vector<CampaignVerdict>& verdicts) {
  CampaignAgreement g;
  std::vector<double> measured, predicted, gaps;
  for (const CampaignVerdict& v : verdicts) {
    if (!v.cell.ran || !v.valid) continue;
    measured.push_back(v.cell.mfu), predicted.push_back(v.book.time.mfu);
    gaps.push_back(v.book.time.mfu - v.cell.mfu);
    g.at_or_above += v.book.time.mfu >= v.cell.mfu;
  }
  g.cells = (int)gaps.size();
  if (g.cells < 2) return g;
  g.spearman = spearman(measured, predicted);
  std::sort(gaps.begin(), gaps.end());
  const size_t n = gaps.size();
  g.median_gap = n % 2 ? gaps[n / 2] : (gaps[n / 2 - 1] + gaps[n / 2]) / 2;
  return g;
}
