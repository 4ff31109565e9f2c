// plan.cu: `./plan`, the planner's command line (Playbook §11, finding the best configuration).
// For a model, a sequence length, a global batch in tokens and a cluster, it tries every
// layout picoscale can run and prints the fastest few with their memory per GPU, step time and
// MFU, and why the others lost. `./plan --campaign tests/data/book_campaign.csv` sets the
// planner against the book's benchmark campaign (docs/planner-checks.md). Bad input (a cluster that
// cannot hold the model, a batch no layout reaches) is one line and exit code 2.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <new>
#include <nlohmann/json.hpp>
#include <thread>

#include "mixed_precision.cuh"
#include "planner/planner.cuh"
#include "runtime/dtype.cuh"
#include "runtime/inputs.cuh"
#include "runtime/options.cuh"

// A comma-separated list of `flag`'s choices; an empty one, or an empty item ("0,,1"), refused.
static std::vector<std::string> split(const char* flag, const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); i++)
    if (i == s.size() || s[i] == ',') {
      if (i == start)
        throw UsageError(std::string(flag) + " '" + s +
                         "': an empty item; list the choices to try, comma-separated");
      out.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  return out;
}

// One stage of --zero's list: 0 to 3, written in full ("1", not "1e0" or "2147483648").
static int zero_stage(const std::string& text) {
  if (text.size() != 1 || text[0] < '0' || text[0] > '3')
    throw UsageError("--zero " + text + ": a ZeRO stage is 0, 1, 2 or 3 (a list: --zero 0,1)");
  return text[0] - '0';
}

// The command line's numbers, each given one checked against its range before anything uses
// it: a count 0 or negative, a rate NaN, infinite or absurd, a world past any cluster.
static void check_int(const CLI::App& app, const char* flag, int64_t value, int64_t lo, int64_t hi,
                      const std::string& fix) {
  if (app.count(flag) && (value < lo || value > hi))
    throw UsageError(std::string(flag) + " " + std::to_string(value) + ": must be from " +
                     std::to_string(lo) + " to " + std::to_string(hi) + "; " + fix);
}
static void check_real(const CLI::App& app, const char* flag, double value, double lo, bool open_lo,
                       double hi, const std::string& fix) {
  if (app.count(flag)) check_range(value, flag, lo, open_lo, hi, fix);
}
// The largest cluster the planner lays out (its ranks are ints, its search a loop over them).
constexpr int64_t kMaxWorld = 1 << 20;

// The campaign table of docs/planner.md: every cell, the book's layout and the planner's view;
// with --json, the same cells for tools/plots.py's heatmap.
// --json FILE, as every output is written (runtime/core.cuh): atomically, replacing only a
// regular file (a device or a directory is refused).
static void write_json(const std::string& file, const nlohmann::json& out) {
  check_output_file("--json", file);
  const std::string text = out.dump(1) + "\n";
  write_file_atomic(file, [&](FILE* f) { write_all(f, text.data(), text.size(), file); });
}

constexpr double kBookGB = 1e9;                // the book's explorer's GB
constexpr double kGiB = 1024.0 * 1024 * 1024;  // the planner's unit

static int campaign(const std::string& path, const GpuProfile& gpu, const std::string& json_file) {
  std::vector<CampaignCell> cells = read_campaign(path);
  nlohmann::json out = nlohmann::json::array();
  printf(
      "| model | nodes | book's best (dp tp pp zero mbs ga) | book MFU | planner MFU | book mem "
      "GiB "
      "| planner mem GiB | planner rank | planner's best | note |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|\n");
  int ran = 0, memory_ok = 0, top5 = 0, mfu_ok = 0;
  std::vector<CampaignVerdict> verdicts;
  for (const CampaignCell& c : cells) {
    CampaignVerdict v = judge_campaign_cell(c, gpu);
    verdicts.push_back(v);
    nlohmann::json cell{
        {"model", c.model}, {"nodes", c.nodes}, {"best", nullptr}, {"book", nullptr}};
    if (v.best.time.step > 0) {
      const Layout& l = v.best.layout;
      cell["best"] = {{"layout", l.str()},
                      {"dp", l.dp},
                      {"tp", l.tp},
                      {"sp", l.sp},
                      {"pp", l.pp},
                      {"zero", l.zero},
                      {"mbs", l.mbs},
                      {"grad_acc", l.grad_acc},
                      {"mfu", v.best.time.mfu},
                      {"memory_gib", v.best.memory.total() / kGiB}};
    }
    if (c.ran)
      cell["book"] = {{"dp", c.dp},
                      {"tp", c.tp},
                      {"pp", c.pp},
                      {"zero", c.zero},
                      {"mbs", c.mbs},
                      {"grad_acc", c.grad_acc},
                      {"mfu", c.mfu},
                      {"memory_gib", c.memory_gb * kBookGB / kGiB},
                      {"predicted_mfu", v.valid ? nlohmann::json(v.book.time.mfu) : nullptr},
                      {"planner_rank", v.rank}};
    out.push_back(cell);
    std::string best = v.best.layout.str();
    if (v.best.time.step > 0) {
      char b[160];
      snprintf(b, sizeof b, "dp%d tp%d%s pp%d z%d mbs%d ga%d (%.1f%%)", v.best.layout.dp,
               v.best.layout.tp, v.best.layout.sp ? "+sp" : "", v.best.layout.pp,
               v.best.layout.zero, v.best.layout.mbs, v.best.layout.grad_acc,
               100 * v.best.time.mfu);
      best = b;
    } else {
      best = "nothing fits";
    }
    if (!c.ran) {
      printf("| %s | %d | nothing ran | | | | | | %s | |\n", c.model.c_str(), c.nodes,
             best.c_str());
      continue;
    }
    ran++;
    // Every memory in GiB, the planner's unit; the book's explorer gives GB (10^9 bytes).
    const double book_mem = c.memory_gb * kBookGB / kGiB, mem = v.book.memory.total() / kGiB;
    bool mem_close = v.valid && std::fabs(mem - book_mem) <= 0.25 * book_mem;
    bool mfu_close = v.valid && std::fabs(v.book.time.mfu - c.mfu) <= 0.10;
    bool in_top = v.rank >= 1 && v.rank <= 5;
    memory_ok += mem_close, mfu_ok += mfu_close, top5 += in_top;
    std::string note;
    if (!v.valid)
      note = "picoscale cannot run it";
    else if (!v.fits)
      note = "predicted not to fit";
    if (!mem_close && v.valid) note += std::string(note.empty() ? "" : "; ") + "memory off by >25%";
    if (!mfu_close && v.valid)
      note += std::string(note.empty() ? "" : "; ") + "MFU off by >10 points";
    if (!in_top && v.fits)
      note += std::string(note.empty() ? "" : "; ") + "not in the planner's top 5";
    printf(
        "| %s | %d | %d %d%s %d %d %d %d | %.1f%% | %.1f%% | %.1f | %.1f | %s of %d | %s | %s |\n",
        c.model.c_str(), c.nodes, c.dp, c.tp, v.book.layout.sp ? "+sp" : "", c.pp, c.zero, c.mbs,
        c.grad_acc, 100 * c.mfu, 100 * v.book.time.mfu, book_mem, mem,
        v.rank > 0 ? std::to_string(v.rank).c_str() : "-", v.layouts, best.c_str(), note.c_str());
  }
  const CampaignAgreement agree = campaign_mfu_agreement(verdicts);
  printf(
      "\n%d cells ran: memory within 25%% in %d, the book's layout among the planner's five "
      "best in %d, MFU within 10 points in %d; the planner's MFU against the book's: Spearman "
      "%.2f, median %+.1f points, at or above it in %d\n",
      ran, memory_ok, top5, mfu_ok, agree.spearman, 100 * agree.median_gap, agree.at_or_above);
  if (!json_file.empty()) write_json(json_file, out);
  return 0;
}

// --layout "--dp 2 --tp 2 ...": one layout in ./train's flags (those that shape a step).
static Layout parse_layout(const std::string& flags) {
  CLI::App app{"layout"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // as ./train
  Layout l;
  std::string schedule = "1f1b", dtype = "bf16", grads = "fp32", recompute = "none",
              attention = "flash", residual = "fp32";
  app.add_option("--dp", l.dp), app.add_option("--tp", l.tp), app.add_option("--pp", l.pp);
  app.add_option("--cp", l.cp), app.add_flag("--sp", l.sp), app.add_option("--zero", l.zero);
  app.add_option("--pp-schedule", schedule), app.add_option("--pp-virtual", l.virtual_stages);
  app.add_option("--mbs", l.mbs), app.add_option("--grad-acc", l.grad_acc);
  app.add_option("--dtype", dtype), app.add_option("--grad-acc-dtype", grads);
  app.add_option("--residual-dtype", residual);
  app.add_option("--recompute", recompute), app.add_option("--attention", attention);
  app.add_option("--ep", l.ep);
  check_number_text(app);
  try {
    app.parse(flags, false);
  } catch (const CLI::ExtrasError& e) {
    throw UsageError("--layout \"" + flags + "\": " + e.what() +
                     " (it takes ./train's flags that shape a step: --dp --tp --pp --cp --sp "
                     "--zero --pp-schedule --pp-virtual --mbs --grad-acc --dtype --grad-acc-dtype "
                     "--residual-dtype --recompute --attention --ep)");
  } catch (const CLI::ParseError& e) {
    throw UsageError("--layout \"" + flags + "\": " + e.what());
  }
  for (auto [flag, value] : {std::pair<const char*, int>{"--dp", l.dp},
                             {"--tp", l.tp},
                             {"--pp", l.pp},
                             {"--cp", l.cp},
                             {"--ep", l.ep},
                             {"--pp-virtual", l.virtual_stages},
                             {"--mbs", l.mbs},
                             {"--grad-acc", l.grad_acc}})
    if (value < 1)
      throw UsageError("--layout \"" + flags + "\": " + flag + " " + std::to_string(value) +
                       ": must be >= 1");
  if (l.zero < 0 || l.zero > 3)
    throw UsageError("--layout \"" + flags + "\": --zero " + std::to_string(l.zero) +
                     ": a ZeRO stage, 0 to 3");
  check_at_most(l.mbs, kMaxMbs, "--layout's --mbs",
                "lower it (raise --grad-acc for a larger batch)");
  // The pipeline's timeline holds every micro-batch's operations.
  check_at_most(l.grad_acc, kMaxMbs, "--layout's --grad-acc",
                "lower it (more data-parallel ranks give a larger batch)");
  l.schedule = parse_pp_schedule(schedule), l.recompute = parse_recompute(recompute);
  l.attention = parse_attention(attention);
  // The formats as ./train combines them (the precision policy refuses what it refuses).
  try {
    PrecisionOptions formats;
    formats.dtype = parse_precision(dtype);
    formats.grad_acc_dtype = parse_choice<DType>("--grad-acc-dtype", grads,
                                                 {{"fp32", DType::F32}, {"bf16", DType::BF16}});
    formats.residual_dtype = parse_choice("--residual-dtype", residual, residual_choices());
    const PrecisionPolicy policy = make_precision_policy(formats, Device::Meta);
    l.precision = policy.compute(), l.residual = policy.residual();
    l.bf16_grads = policy.grads() == DType::BF16;
  } catch (const UsageError& e) {
    throw UsageError("--layout \"" + flags + "\": " + e.what());
  }
  return l;
}

int main(int argc, char** argv) {
  CLI::App app{"plan: the best layouts for a model on a cluster (Playbook §11)"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // as ./train
  std::string model = "llama-8b", gpu_name = "h100", activations = "llama";
  std::string zero = "0,1,2,3", recompute = "none,selective,full",
              schedules = "afab,1f1b,interleaved,zb-h1", dtypes = "", residuals = "fp32";
  std::string campaign_file, json_file, comm_fit, one_layout;
  int nodes = 1, gpus_per_node = 8, top = 5, seq = 0, max_mbs = 64, wire = 4;
  int layers = 0, d_model = 0, heads = 0, kv_heads = 0, ffn = 0, vocab = 0, experts = -1, top_k = 0;
  double batch_tokens = 1 << 20, peak = 0, memory_gib = 0, intra = 0, inter = 0, nic = 0,
         efficiency = 0, alpha_us = -1;
  bool no_cp = false, no_sp = false, tie = false, untie = false, campaign_space_flag = false;
  app.add_option(
         "--model", model,
         "preset or planner shape (" +
             [] {
               std::string s;
               for (const std::string& n : planner_model_names()) s += (s.empty() ? "" : ", ") + n;
               return s;
             }() +
             ")")
      ->capture_default_str();
  app.add_option("--layers", layers, "override the model's layers");
  app.add_option("--d-model", d_model, "override its hidden size");
  app.add_option("--heads", heads, "override its attention heads");
  app.add_option("--kv-heads", kv_heads, "override its key/value heads");
  app.add_option("--ffn", ffn, "override its MLP width");
  app.add_option("--vocab", vocab, "override its vocabulary");
  app.add_option("--experts", experts,
                 "a mixture of experts per block (0: dense); layouts try --ep");
  app.add_option("--top-k", top_k, "experts per token");
  app.add_flag("--tie-embeddings", tie, "tie the embedding and the LM head");
  app.add_flag("--untie-embeddings", untie, "untie them");
  app.add_option("--seq", seq, "tokens per sequence (default: the model's)");
  app.add_option("--batch-tokens", batch_tokens, "global batch in tokens")->capture_default_str();
  app.add_option("--nodes", nodes, "nodes")->capture_default_str();
  app.add_option("--gpus-per-node", gpus_per_node, "GPUs (or CPU ranks) per node")
      ->capture_default_str();
  app.add_option("--gpu", gpu_name, "profile: h100, h200, a100, cpu (measured here)")
      ->capture_default_str();
  app.add_option("--peak-tflops", peak, "override the profile's dense bf16 peak (fp32 for cpu)");
  app.add_option("--memory-gib", memory_gib, "override its memory per GPU");
  app.add_option("--intra-bw", intra, "override its in-node bus bandwidth, GB/s (all collectives)");
  app.add_option("--inter-bw", inter, "override its between-node bus bandwidth, GB/s");
  app.add_option("--nic-bw", nic, "override each GPU's network bandwidth, GB/s");
  app.add_option("--alpha-us", alpha_us, "override every collective's latency per ring step, us");
  app.add_option("--efficiency", efficiency,
                 "override the fraction of the peak a wide GEMM reaches (the roofline's)");
  app.add_option("--comm-fit", comm_fit,
                 "the collectives' alpha and busbw bench_comm --fit measured");
  app.add_option("--layout", one_layout,
                 "predict one layout, given as ./train's flags (\"--dp 2 --tp 2 --mbs 4 ...\"); "
                 "its global batch is dp x mbs x grad-acc sequences");
  app.add_option("--zero", zero, "ZeRO stages to try")->capture_default_str();
  app.add_option("--recompute", recompute, "recompute modes to try")->capture_default_str();
  app.add_option("--schedules", schedules, "pipeline schedules to try")->capture_default_str();
  app.add_option("--dtype", dtypes, "formats to try (default: bf16 on GPUs, fp32 on cpu)");
  app.add_option("--residual-dtype", residuals,
                 "residual stream formats to try: fp32, and bf16 or fp16 with that --dtype")
      ->capture_default_str();
  app.add_option("--max-mbs", max_mbs, "largest micro-batch to try")->capture_default_str();
  app.add_flag("--no-cp", no_cp, "do not try context parallelism");
  app.add_flag("--no-sp", no_sp, "do not try sequence parallelism");
  app.add_option("--activations", activations,
                 "llama (model.cu's formula, picoscale's Llama) or book (34 sbh + 5 a s^2 b)")
      ->capture_default_str();
  app.add_option("--wire-bytes", wire,
                 "bytes per activation element that tp, cp and pp send "
                 "(picoscale: 4, its residual stream is fp32; 2 for a bf16 framework)")
      ->capture_default_str();
  app.add_option("--top", top, "layouts to print")->capture_default_str();
  app.add_flag("--campaign-space", campaign_space_flag,
               "search what the book's campaign searched, as it did (ranked by MFU; bf16 wire)");
  app.add_option("--json", json_file,
                 "write the ranked layouts (with --campaign: every cell) as JSON");
  app.add_option(
      "--campaign", campaign_file,
      "judge the planner against the book's campaign table (tests/data/book_campaign.csv)");
  check_number_text(app);
  try {
    app.parse(argc, argv);
    if (app.count("--json") && json_file.empty())
      throw UsageError("--json '': an empty path; name the file to write, or drop --json");
    if (!json_file.empty()) check_output_file("--json", json_file);  // before the search
    if (app.count("--layout") && one_layout.empty())
      throw UsageError("--layout '': an empty layout; give ./train's flags, or drop --layout");
    // Shapes: as ./train bounds them (runtime/options.cuh).
    const std::string shape_fix = "give a positive size (or leave the flag out for the model's)";
    check_int(app, "--layers", layers, 1, kMaxLayers, shape_fix);
    for (auto [flag, value] : {std::pair<const char*, int>{"--d-model", d_model},
                               {"--heads", heads},
                               {"--kv-heads", kv_heads},
                               {"--ffn", ffn},
                               {"--vocab", vocab}})
      check_int(app, flag, value, 1, kMaxWidth, shape_fix);
    check_int(app, "--seq", seq, 1, kMaxSeq, shape_fix);
    check_int(app, "--experts", experts, 0, 1 << 16, "0 for a dense MLP, or the experts per block");
    check_int(app, "--top-k", top_k, 1, 1 << 16, "the experts each token goes to, e.g. 2");
    check_int(app, "--nodes", nodes, 1, kMaxWorld, "the cluster's nodes, e.g. 4");
    check_int(app, "--gpus-per-node", gpus_per_node, 1, kMaxWorld, "e.g. 8");
    if ((int64_t)nodes * gpus_per_node > kMaxWorld)
      throw UsageError("--nodes " + std::to_string(nodes) + " x --gpus-per-node " +
                       std::to_string(gpus_per_node) + " is past the " + std::to_string(kMaxWorld) +
                       " GPUs the planner lays out: a smaller cluster");
    check_int(app, "--max-mbs", max_mbs, 1, kMaxMbs, "the largest micro-batch to try, e.g. 64");
    check_int(app, "--top", top, 1, 1 << 20, "how many layouts to print, e.g. 5");
    if (app.count("--wire-bytes") && wire != 1 && wire != 2 && wire != 4)
      throw UsageError("--wire-bytes " + std::to_string(wire) +
                       ": bytes per activation element on the wire, 4 (fp32, picoscale's), 2 "
                       "(bf16) or 1 (fp8)");
    check_real(app, "--batch-tokens", batch_tokens, 1, false, 1e15,
               "a whole number of tokens per step, e.g. 1048576");
    // The profile's numbers: each positive and finite (the efficiency a fraction of the peak).
    check_real(app, "--peak-tflops", peak, 0, true, 1e6, "a positive TFLOP/s, e.g. 989");
    check_real(app, "--memory-gib", memory_gib, 0, true, 1e6, "a positive GiB per GPU, e.g. 80");
    check_real(app, "--efficiency", efficiency, 0, true, 1,
               "the achievable fraction of the peak, above 0 and at most 1, e.g. 0.5");
    check_real(app, "--alpha-us", alpha_us, 0, false, 1e6,
               "a latency per ring step in microseconds, >= 0, e.g. 10");
    for (auto [flag, value] : {std::pair<const char*, double>{"--intra-bw", intra},
                               {"--inter-bw", inter},
                               {"--nic-bw", nic}})
      check_real(app, flag, value, 0, true, 1e6, "a positive bandwidth in GB/s, e.g. 400");
    // Inputs: regular files (a FIFO would block the read forever), and no output over them.
    for (auto [flag, path] :
         {std::pair<const char*, const std::string&>{"--campaign", campaign_file},
          {"--comm-fit", comm_fit}})
      if (app.count(flag)) {
        check_input_file(std::string(flag) + " " + path, path);
        if (!json_file.empty() && same_file(json_file, path))
          throw UsageError("--json " + json_file + " would overwrite " + flag + " " + path +
                           ", which this run reads: they are the same file; write the JSON "
                           "elsewhere");
      }
    GpuProfile gpu = gpu_profile(gpu_name);
    if (gpu.name == "cpu") {  // this machine: each rank's share of the cores
      const int cores = std::max(1, (int)std::thread::hardware_concurrency());
      const int threads = std::max(1, cores / gpus_per_node);
      openblas_set_num_threads(threads);
      Context ctx = Context::create(Device::CPU);
      // The roofline's rates a rank reaches on its threads: memory, streaming loops, attention.
      gpu = run_profile(ctx, "cpu");
      DevicePeak d = device_peak(ctx, Precision::FP32);
      ctx.destroy();
      // More ranks than cores: they take turns, each at its share of the measured rate.
      const double share = std::min(1.0, (double)cores / (gpus_per_node * threads));
      gpu.peak_fp32 = d.flops * share;
      gpu.memory /= gpus_per_node;
      gpu.source += " (" + d.how +
                    (share < 1 ? ", x " + std::to_string(cores) + " cores / " +
                                     std::to_string(gpus_per_node) + " ranks"
                               : "") +
                    ")";
    }
    if (app.count("--peak-tflops"))
      (gpu.name == "cpu" ? gpu.peak_fp32 : gpu.peak_bf16) = peak * 1e12;
    if (app.count("--memory-gib")) gpu.memory = memory_gib * 1024.0 * 1024 * 1024;
    if (app.count("--intra-bw"))
      gpu.intra.allreduce_bw = gpu.intra.gather_bw = gpu.intra.p2p_bw = intra * 1e9;
    if (app.count("--inter-bw")) gpu.inter_allreduce_bw = gpu.inter_gather_bw = inter * 1e9;
    if (app.count("--nic-bw")) gpu.nic_bw = nic * 1e9;
    if (!comm_fit.empty()) apply_comm_fit(gpu, comm_fit);
    if (app.count("--alpha-us"))
      gpu.intra.alpha = gpu.intra.alpha_gather = gpu.intra.alpha_p2p = gpu.inter_alpha =
          alpha_us * 1e-6;
    if (app.count("--efficiency")) gpu.gemm_efficiency = efficiency;
    if (!campaign_file.empty()) return campaign(campaign_file, gpu, json_file);

    ModelConfig cfg = planner_model(model);
    for (auto [value, field] : {std::pair<int, int ModelConfig::*>{layers, &ModelConfig::layers},
                                {d_model, &ModelConfig::d_model},
                                {heads, &ModelConfig::heads},
                                {kv_heads, &ModelConfig::kv_heads},
                                {ffn, &ModelConfig::ffn},
                                {vocab, &ModelConfig::vocab},
                                {seq, &ModelConfig::seq},
                                {top_k, &ModelConfig::top_k}})
      if (value > 0) cfg.*field = value;  // given: checked above to be >= 1
    if (app.count("--experts")) cfg.experts = experts;
    check_mixture_flags(cfg, app.count("--top-k") > 0, false);
    if (tie && untie)
      throw UsageError("--tie-embeddings and --untie-embeddings contradict each other: keep one");
    if (tie) cfg.tie_embeddings = true;
    if (untie) cfg.tie_embeddings = false;
    validate_model_config(cfg);
    if (batch_tokens != std::floor(batch_tokens))
      throw UsageError("--batch-tokens " + num(batch_tokens) +
                       ": must be a whole number of tokens, e.g. 1048576");
    Cluster cl{nodes, gpus_per_node, gpu};
    SearchSpace space;
    space.zero_stages.clear();
    for (const std::string& z : split("--zero", zero)) space.zero_stages.push_back(zero_stage(z));
    space.recompute.clear();
    for (const std::string& r : split("--recompute", recompute))
      space.recompute.push_back(parse_recompute(r));
    space.schedules.clear();
    for (const std::string& s : split("--schedules", schedules))
      space.schedules.push_back(parse_pp_schedule(s));
    space.precisions.clear();
    if (dtypes.empty()) dtypes = gpu.name == "cpu" ? "fp32" : "bf16";
    for (const std::string& d : split("--dtype", dtypes))
      space.precisions.push_back(parse_precision(d));
    // A format the profile has no peak for is no layout's (searched among others, it is skipped).
    if (std::none_of(space.precisions.begin(), space.precisions.end(),
                     [&](Precision p) { return peak_flops(gpu, p) > 0; }))
      require_peak(gpu, space.precisions.front());
    space.residuals.clear();
    for (const std::string& r : split("--residual-dtype", residuals))
      space.residuals.push_back(parse_choice("--residual-dtype", r, residual_choices()));
    for (DType r : space.residuals)
      if (r != DType::F32 && std::none_of(space.precisions.begin(), space.precisions.end(),
                                          [r](Precision p) { return activation_dtype(p) == r; }))
        throw UsageError("--residual-dtype " + residual_choice_name(r) +
                         " keeps the residual stream in the compute format of --dtype " +
                         residual_choice_name(r) + ", which --dtype " + dtypes +
                         " does not try: add it to --dtype, or drop it here");
    space.cp = !no_cp, space.sp = !no_sp, space.max_mbs = max_mbs;
    space.exact_top = std::max(top, 200);  // what is printed, and the JSON's 200
    Implementation impl;
    impl.activations = parse_activation_formula(activations);
    impl.activation_wire_bytes = wire;
    impl.mpi_sends = gpu.name == "cpu";
    if (campaign_space_flag) space = campaign_space(), impl = campaign_implementation();
    if (!one_layout.empty()) {  // one layout: its memory and time, whether or not it fits
      Layout l = parse_layout(one_layout);
      require_peak(gpu, l.precision);
      if (l.world() != cl.world())
        throw UsageError("--layout has " + std::to_string(l.world()) +
                         " ranks (dp x tp x pp x cp), "
                         "the cluster " +
                         std::to_string(cl.world()) + ": set --nodes and --gpus-per-node to match");
      validate_layout(cfg, l, gpu.name);
      Candidate c;
      c.layout = l;
      c.memory = predict_memory(cfg, l, impl);
      add_headroom(c.memory, gpu);
      c.time = predict_time(cfg, l, cl, impl);
      print_candidate(1, c, cl);
      printf("predicted step: %.6f s\n", c.time.step);
      return 0;
    }
    // The search tries FlashAttention's layouts: a head dim its CUDA kernels do not take has none
    // (--layout prices one with --attention naive).
    validate_head_dim(cfg.head_dim(), true, Device::Meta, gpu.name);
    PlanResult r = plan_layouts(cfg, (int64_t)batch_tokens, cl, space, impl);
    if (!r.error.empty()) {
      fprintf(stderr, "error: %s\n", r.error.c_str());
      return 2;
    }
    print_plan(r, cfg, (int64_t)batch_tokens, cl, impl, top);
    if (!json_file.empty()) {
      nlohmann::json out = nlohmann::json::array();
      for (size_t i = 0; i < r.ranked.size() && i < 200; i++) {
        const Candidate& c = r.ranked[i];
        nlohmann::json exposed;
        for (auto& [g, s] : c.time.exposed) exposed[g] = s;
        out.push_back({{"layout", c.layout.str()},
                       {"flags", c.layout.flags()},
                       {"step_s", c.time.step},
                       {"compute_s", c.time.compute},
                       {"bubble_s", c.time.bubble},
                       {"exposed_s", exposed},
                       {"tokens_per_s_per_gpu", c.time.tokens_per_s_per_gpu},
                       {"mfu", c.time.mfu},
                       {"memory_bytes",
                        {{"params", c.memory.worst.params},
                         {"grads", c.memory.worst.grads},
                         {"optimizer", c.memory.worst.optimizer},
                         {"activations", c.memory.worst.activations},
                         {"workspace", c.memory.worst.workspace},
                         {"runtime", c.memory.runtime},
                         {"allocator_slack", c.memory.slack}}}});
      }
      write_json(json_file, out);
    }
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
  } catch (const CLI::ParseError& e) {
    fprintf(stderr, "error: %s\nRun ./plan --help for every flag.\n", e.what());
    return 2;
  } catch (const UsageError& e) {
    fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument&) {
    fprintf(stderr,
            "error: a list flag (--zero, --recompute, ...) holds something that is not "
            "one of its values\n");
    return 2;
  } catch (const std::bad_alloc&) {
    fprintf(stderr,
            "error: out of host memory: the model, the batch or --layout's micro-batches are too "
            "many for this machine; lower them\n");
    return 2;
  }
  return 0;
}
