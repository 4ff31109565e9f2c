// options.cu: the run's own flags (CLI11), their checks, the checks before the first allocation
// and the configuration table (options.cuh).
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <tuple>

#include "runtime/checkpoint.cuh"
#include "runtime/data.cuh"
#include "runtime/dtype.cuh"
#include "runtime/inputs.cuh"
#include "runtime/options.cuh"

namespace fs = std::filesystem;

std::vector<Choice<DType>> residual_choices() {
  return {{"fp32", DType::F32}, {"bf16", DType::BF16}, {"fp16", DType::F16}};
}
std::string residual_choice_name(DType format) {
  return choice_name(residual_choices(), format);
}
DType residual_format(DType requested, Precision p) {
  if (requested == DType::F32 || requested == activation_dtype(p)) return requested;
  const std::string name = residual_choice_name(requested);
  throw UsageError("--residual-dtype " + name +
                   " keeps the residual stream in the compute format of --dtype " + name +
                   "; this run is " + precision_name(p) + ": add that --dtype, or drop the flag");
}
CLI::App& flag_group(CLI::App& app, const std::string& chapter) {
  try {
    return *app.get_option_group(chapter);  // a second chapter file's flags join the group
  } catch (const CLI::OptionNotFound&) {
    return *app.add_option_group(chapter);
  }
}

void check_positive(int64_t value, const std::string& flag) {
  if (value <= 0) throw UsageError(flag + " " + std::to_string(value) + ": must be > 0");
}
std::string num(double x) {
  char buf[32];
  snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
std::string exact_num(double x) {
  char buf[40];
  snprintf(buf, sizeof buf, "%.0f", x);
  return x >= 1 && x < 1e18 && x == std::floor(x) ? buf : num(x);
}
bool is_power_of_two(double x) {
  int exponent = 0;
  return std::isfinite(x) && x > 0 && std::frexp(x, &exponent) == 0.5;
}
double parse_number(const std::string& text, const std::string& what, double lo, double hi,
                    bool integer, bool power_of_two) {
  char* end = nullptr;
  const double v = strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !(v >= lo && v <= hi) ||
      (integer && v != std::floor(v)) || (power_of_two && !is_power_of_two(v)))
    throw UsageError(what + " '" + text + "': not " +
                     (power_of_two ? "a power of two"
                      : integer    ? "an integer"
                                   : "a number") +
                     " from " + exact_num(lo) + " to " + exact_num(hi) +
                     " (a damaged or hand-edited file?)");
  return v;
}
void check_range(double value, const std::string& flag, double lo, bool open_lo, double hi,
                 const std::string& fix) {
  bool ok = std::isfinite(value) && (open_lo ? value > lo : value >= lo) && value <= hi;
  if (!ok) throw UsageError(flag + " " + num(value) + ": " + fix);
}
void check_at_most(int64_t value, int64_t max, const std::string& source, const std::string& fix) {
  if (value > max)
    throw UsageError(source + " " + std::to_string(value) + ": above the maximum " +
                     std::to_string(max) + "; " + fix);
}

// ----------------------------------------------------------------------------
// The run's own flags

static const std::vector<Choice<Report>> kReports = {
    {"memory", Report::Memory},    {"comm", Report::Comm},       {"bubble", Report::Bubble},
    {"sync", Report::Sync},        {"balance", Report::Balance}, {"experts", Report::Experts},
    {"roofline", Report::Roofline}};

void check_reports_answered(const RunOptions& o, const StepMeters& meters) {
  for (Report r : o.reports) {
    if (meters.answers(r)) continue;
    const std::string why =
        r == Report::Balance ? ": it measures the ring attention's work per cp rank, and this run "
                               "has no ring; add --cp 2 or more"
        : r == Report::Experts
            ? ": it measures a mixture's routing, and this model has no experts; add --experts N"
            : ": no part of this run measures it";
    throw UsageError(std::string("--report ") + choice_name(kReports, r) + why +
                     ", or leave it out of --report");
  }
}

bool RunOptions::reports_on(Report r) const {
  return std::find(reports.begin(), reports.end(), r) != reports.end();
}

void add_shape_flag(CLI::App& group, RunOptions& o, const std::string& flag,
                    int ModelConfig::*field, const std::string& help) {
  o.shape.push_back({flag, field});
  group.add_option(flag, o.model.*field, help);
}

void add_run_flags(CLI::App& app, RunOptions& o) {
  o.app = &app;
  CLI::App& model = flag_group(app, "The model: a tiny Llama (model.cu)");
  model
      .add_option("--model", o.preset,
                  "preset: tiny, tiny-moe, medium, smollm-135m, llama-1b; at the book's scale "
                  "(--device meta): llama-3b|8b|70b, book-1b|3b|8b|80b, gpt-1b|3b|8b|70b (the "
                  "book's GPT block), mixtral-8x7b")
      ->capture_default_str();
  auto shape = [&](const char* flag, int ModelConfig::*field, const char* help) {
    add_shape_flag(model, o, flag, field, help);
  };
  shape("--d-model", &ModelConfig::d_model,
        "hidden size, at most 16777216 (default: the preset's)");
  shape("--layers", &ModelConfig::layers, "transformer blocks, at most 4096");
  shape("--heads", &ModelConfig::heads, "query heads, dividing --d-model");
  shape("--kv-heads", &ModelConfig::kv_heads, "key/value heads, dividing --heads (grouped-query)");
  shape("--ffn", &ModelConfig::ffn, "MLP intermediate size, at most 16777216");
  shape("--vocab", &ModelConfig::vocab, "vocabulary size, at most 16777216");
  shape("--seq", &ModelConfig::seq, "tokens per sequence, at most 1048576");
  model.add_option("--rope-theta", o.model.rope_theta, "RoPE base, >= 1");

  add_choice(model, "--norm", &o.model.norm,
             {{"rmsnorm", NormKind::RMSNorm}, {"layernorm", NormKind::LayerNorm}},
             "the block's norm: rmsnorm (Llama) or layernorm (the book's GPT, with a bias; "
             "default: the preset's)");
  add_choice(model, "--mlp", &o.model.mlp, {{"swiglu", MlpKind::SwiGLU}, {"gelu", MlpKind::GeLU}},
             "the block's MLP: swiglu (Llama: gate, up, down) or gelu (the book's GPT: up, down; "
             "default: the preset's)");
  model.add_option("--dropout", o.model.dropout,
                   "dropout on attention's probabilities and on the attention's and MLP's outputs "
                   "(the book's GPT: 0.1), 0 to below 1 (default: the preset's)");
  model.add_flag("--tie-embeddings", o.model.tie_embeddings, "share embedding and LM head");
  model.add_flag("--untie-embeddings", o.untie_embeddings,
                 "give the LM head weights of its own when the preset ties them (llama-1b, "
                 "llama-3b, book-1b, book-3b), as nanotron does across pipeline stages");

  CLI::App& steps = flag_group(app, "First steps: the training step (Playbook §2)");
  steps
      .add_option("--steps", o.steps,
                  "total optimizer steps, >= 0 (a resumed run continues to it; 0: no step, only "
                  "--load then --save, e.g. to convert a checkpoint, or --sample)")
      ->capture_default_str();
  steps.add_option("--stop-after", o.stop_after,
                   "end this run after N steps (the schedule still spans --steps; resume with "
                   "--load)");
  steps.add_option("--mbs", o.mbs, "micro-batch size (sequences), at most 1048576")
      ->capture_default_str();
  steps
      .add_option("--grad-acc", o.grad_acc,
                  "micro-batches per step, >= 1, a rank's step at most 2147483647 tokens (--mbs x "
                  "--grad-acc x --seq; Playbook §2.7)")
      ->capture_default_str();
  steps.add_option("--lr", o.lr, "peak learning rate, > 0")->capture_default_str();
  steps.add_option("--warmup", o.warmup, "linear warmup steps, >= 0")->capture_default_str();
  steps.add_option("--min-lr", o.min_lr,
                   "final learning rate of the cosine, 0 to --lr "
                   "(default: lr/10)");
  steps.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay, >= 0")
      ->capture_default_str();
  steps.add_option("--grad-clip", o.grad_clip, "clip the global gradient norm (0: off)")
      ->capture_default_str();
  // A uint64_t: not a wrapped "-1" nor a saturated 2^64 (check_number_text).
  steps.add_option("--seed", o.seed, "seed of initialisation, data order and sampling")
      ->capture_default_str();
}

// A whole number in decimal between lo and hi, rewritten as such (CLI11 would read 010 as octal):
// the flag's text if it is one, else why not.
static std::string whole_number(std::string& s, long double lo, long double hi) {
  if (s.empty()) return "an empty value; give a number (see --help)";
  const size_t sign = s[0] == '+' || s[0] == '-';
  char range[64];
  snprintf(range, sizeof range, "from %.0Lf to %.0Lf", lo, hi);
  if (s.size() == sign || s.find_first_not_of("0123456789", sign) != std::string::npos)
    return s + " is not a whole number; give one " + range;
  const long double v = strtold(s.c_str(), nullptr);  // exact to 2^64
  if (v < lo || v > hi) return s + " is past the whole numbers this flag holds, " + range;
  s = v < 0 ? std::to_string((long long)v) : std::to_string((unsigned long long)v);
  return "";
}

void check_number_text(CLI::App& app) {
  const CLI::Validator whole([](std::string& s) { return whole_number(s, INT_MIN, INT_MAX); }, "");
  const CLI::Validator unsigned_whole(
      [](std::string& s) { return whole_number(s, 0, (long double)UINT64_MAX); }, "");
  const CLI::Validator real(
      [](std::string& s) {
        if (s.empty()) return std::string("an empty value; give a number (see --help)");
        char* end = nullptr;
        errno = 0;
        const double v = strtod(s.c_str(), &end);
        if (end == s.c_str() || *end) return s + " is not a number; give one, e.g. 0.5";
        if (errno == ERANGE && std::isinf(v)) return s + " is past the largest number (1.8e308)";
        return std::string();
      },
      "");
  for (CLI::Option* opt : app.get_options()) {
    const std::string type = opt->get_type_name();
    // First among the flag's validators (a range check reads the text too).
    if (type == "INT") opt->transform(whole);            // every INT flag holds an int
    if (type == "UINT") opt->transform(unsigned_whole);  // --seed, a uint64_t
    if (type == "FLOAT") opt->transform(real);
  }
  for (CLI::App* group : app.get_subcommands(std::function<bool(CLI::App*)>()))
    check_number_text(*group);
}

void add_io_flags(CLI::App& app, RunOptions& o) {
  CLI::App& data = flag_group(app, "Data and evaluation");
  data.add_option("--data", o.data, "text file (bytes) or llm.c .bin shard; default: fortunes");
  data.add_flag("--no-shuffle", o.no_shuffle,
                "read training sequences in file order (default: shuffled each epoch by --seed)");
  data.add_option("--val-frac", o.val_frac, "held-out fraction of the data, between 0 and 1")
      ->capture_default_str();
  data.add_option("--val-every", o.val_every, "validate every N steps, >= 0 (0: only at the end)")
      ->capture_default_str();
  data.add_option("--val-seqs", o.val_seqs, "validation sequences, >= 1")->capture_default_str();
  data.add_option("--score", o.score, "with --load: print the mean loss over FILE and exit");
  data.add_option("--sample", o.sample, "generate N bytes at the end, at most 1048576")
      ->capture_default_str();
  data.add_option("--prompt", o.prompt, "text the sample continues");
  data.add_option("--temperature", o.temperature, "sampling temperature, > 0")
      ->capture_default_str();

  CLI::App& out = flag_group(app, "Checkpoints, logs and reports");
  out.add_option("--save", o.save,
                 "write a Hugging Face checkpoint to DIR at the end (DIR's other files are kept)");
  add_typed(out, "--save-dtype", &o.save_dtype, parse_save_dtype, "fp32",
            "model.safetensors in fp32 (the master weights), bf16 or fp16 (optimizer: fp32)");
  out.add_option("--save-every", o.save_every,
                 "also save every N steps, to DIR/checkpoint-<step> (Hugging Face Trainer's "
                 "layout; --load DIR resumes from the newest)");
  out.add_option("--keep", o.keep, "with --save-every: keep the K newest (default: all)");
  out.add_option("--load", o.load,
                 "start from the checkpoint in DIR (weights, optimizer, step; the newest "
                 "DIR/checkpoint-<step> when one is further along)");
  out.add_option("--log-json", o.log_json, "write one JSON object per step to FILE");
  out.add_option("--save-grads", o.save_grads, "write the first step's gradients (safetensors)");
  out.add_option("--trace", o.trace, "write a Chrome trace JSON (Perfetto) to FILE");
  out.add_option_function<std::vector<std::string>>(
         "--report",
         [&o](const std::vector<std::string>& names) {
           for (const std::string& n : names)
             o.reports.push_back(parse_choice("--report", n, kReports));
         },
         "print reports at the end: memory, comm, bubble, sync, balance, experts, roofline "
         "(several: memory,comm)")
      ->delimiter(',');

  CLI::App& run = flag_group(app, "Devices, collectives and faults (Playbook appendix A0)");
  run.add_option("--device", o.device,
                 "auto|cpu|cuda|meta (meta: the real code path without storage or arithmetic, "
                 "counted: any model and layout on a laptop)")
      ->capture_default_str();
  run.add_option("--simulate-world", o.simulate_world,
                 "with --device meta: one process runs rank --simulate-rank of a world of N "
                 "ranks (N = dp x pp x cp x tp), without mpirun");
  run.add_option("--simulate-rank", o.simulate_rank,
                 "the rank of --simulate-world to run, 0 to N-1, or -1: every pipeline stage in "
                 "turn, then the one with the most memory in full")
      ->capture_default_str();
  run.add_option("--gpu", o.gpu,
                 "the device profile --report roofline and a meta run's MFU use: h100, h200, "
                 "a100 or cpu (default: h100 on meta, the GPU's own on cuda, this CPU on cpu)");
  run.add_option("--comm", o.comm, "collectives backend: auto|nccl|mpi")->capture_default_str();
  run.add_option("--comm-timeout", o.comm_timeout,
                 "seconds a collective may wait before the job is aborted, >= 1")
      ->capture_default_str();
  run.add_flag("--sync-launches", o.sync_launches,
               "debugging: synchronise after every CUDA kernel, so a faulting kernel is named "
               "where it faults (slow)");
  add_typed(
      run, "--fault", &o.fault, parse_fault, "",
      "test fault handling: KIND:RANK:STEP[:WHERE], KIND crash|hang|error|inf (inf: fp16 "
      "only), WHERE init|step|forward|backward|clip|optimizer|validation|save|finalize (default "
      "step); a fault this run never reaches is refused");
}

static void check_model_limits(const RunOptions& o) {
  const ModelConfig& c = o.model;
  auto from = [&](const char* flag, const char* key) {
    return !o.load.empty() && !o.given(flag) ? o.load + "/config.json " + key : std::string(flag);
  };
  check_at_most(c.seq, kMaxSeq, from("--seq", "max_position_embeddings"),
                "pass a smaller --seq (RoPE has no learned positions: any length up to it works)");
  check_at_most(c.layers, kMaxLayers, from("--layers", "num_hidden_layers"), "use fewer layers");
  for (auto [value, flag, key] : {std::tuple{c.d_model, "--d-model", "hidden_size"},
                                  {c.ffn, "--ffn", "intermediate_size"},
                                  {c.vocab, "--vocab", "vocab_size"}})
    check_at_most(value, kMaxWidth, from(flag, key), "use a smaller value");
}

// --model under --load: the preset (with the shape flags given over it) must be the model the
// checkpoint's config.json describes, as a shape flag must; --seq aside.
static void check_preset_agrees(const RunOptions& o, const ModelConfig& flags) {
  ModelConfig preset = model_preset(o.preset);
  for (auto [flag, field] : o.shape)
    if (o.given(flag)) preset.*field = flags.*field;
  const ModelConfig& loaded = o.model;
  const std::tuple<const char*, double, double> fields[] = {
      {"hidden_size", preset.d_model, loaded.d_model},
      {"num_hidden_layers", preset.layers, loaded.layers},
      {"num_attention_heads", preset.heads, loaded.heads},
      {"num_key_value_heads", preset.kv_heads, loaded.kv_heads},
      {"intermediate_size", preset.ffn, loaded.ffn},
      {"vocab_size", preset.vocab, loaded.vocab},
      {"num_local_experts", preset.experts, loaded.experts},
      {"num_experts_per_tok", preset.experts ? preset.top_k : 0, loaded.experts ? loaded.top_k : 0},
      {"tie_word_embeddings", preset.tie_embeddings, loaded.tie_embeddings},
      {"norm_type (1: layernorm)", preset.norm == NormKind::LayerNorm,
       loaded.norm == NormKind::LayerNorm},
      {"hidden_act (1: gelu)", preset.mlp == MlpKind::GeLU, loaded.mlp == MlpKind::GeLU},
      {"rope_theta", preset.rope_theta, loaded.rope_theta}};
  for (auto [key, ours, theirs] : fields)
    if (ours != theirs)
      throw UsageError("--model " + o.preset + " (" + key + " " + num(ours) + ") disagrees with " +
                       o.load + "/config.json (" + key + " " + num(theirs) +
                       "); drop --model when loading: the checkpoint's config.json is the model");
}

// The model config: the preset with the shape flags over it, or the checkpoint's config.json,
// which a shape flag may not contradict (but --seq: RoPE has no learned positions).
static void resolve_model(RunOptions& o) {
  ModelConfig flags = o.model;
  if (!o.load.empty()) {
    o.model = read_checkpoint_config(o.load);
    auto disagree = [&](const std::string& flag_and_value, const std::string& theirs) {
      return UsageError(flag_and_value + " disagrees with " + o.load + "/config.json (" + theirs +
                        "); drop the flag when loading");
    };
    for (auto [flag, field] : o.shape)
      if (o.given(flag) && flags.*field != o.model.*field && flag != "--seq")
        throw disagree(flag + " " + std::to_string(flags.*field), std::to_string(o.model.*field));
    if (o.given("--model")) check_preset_agrees(o, flags);
    if (o.given("--seq")) o.model.seq = flags.seq;
    const int window = o.model.sliding_window;
    if (window > 0 && window < o.model.seq)
      throw UsageError("--load " + o.load + ": config.json's sliding_window " +
                       std::to_string(window) + " is shorter than the run's sequences of " +
                       std::to_string(o.model.seq) +
                       (o.given("--seq") ? " (--seq)" : " (max_position_embeddings)") +
                       ": transformers lets a token attend only to the " + std::to_string(window) +
                       " before it, which picoscale does not implement (it attends to every "
                       "earlier token); train with --seq " +
                       std::to_string(window) + " or less");
    if (o.given("--rope-theta") && flags.rope_theta != o.model.rope_theta)
      throw disagree("--rope-theta " + num(flags.rope_theta),
                     "rope_theta " + num(o.model.rope_theta));
    if (o.given("--tie-embeddings") && !o.model.tie_embeddings)
      throw disagree("--tie-embeddings", "tie_word_embeddings false");
    if (o.given("--aux-loss-coef")) o.model.aux_loss_coef = flags.aux_loss_coef;  // a loss weight
    if (o.given("--norm") && flags.norm != o.model.norm)
      throw disagree(
          "--norm", "norm_type " +
                        std::string(o.model.norm == NormKind::LayerNorm ? "layernorm" : "rmsnorm"));
    if (o.given("--mlp") && flags.mlp != o.model.mlp)
      throw disagree("--mlp", std::string("hidden_act ") +
                                  (o.model.mlp == MlpKind::GeLU ? "gelu_pytorch_tanh" : "silu"));
    if (o.given("--dropout")) o.model.dropout = flags.dropout;  // a training setting
    if (o.model.dropout > 0 && !o.save.empty() && !config_records_dropout(o.model))
      throw UsageError("--dropout " + num(o.model.dropout) + " with --load " + o.load +
                       " and --save: the checkpoint is a transformers Llama or Mixtral, whose "
                       "config.json has no place for picoscale's dropout, so a resume from the "
                       "saved one would train without it; drop --dropout, or --save");
  } else {
    o.model = model_preset(o.preset);
    for (auto [flag, field] : o.shape)
      if (o.given(flag)) o.model.*field = flags.*field;
    if (o.given("--norm")) o.model.norm = flags.norm;
    if (o.given("--mlp")) o.model.mlp = flags.mlp;
    if (o.given("--dropout")) o.model.dropout = flags.dropout;
    if (o.given("--rope-theta")) o.model.rope_theta = flags.rope_theta;
    if (o.given("--aux-loss-coef")) o.model.aux_loss_coef = flags.aux_loss_coef;
    o.model.tie_embeddings = o.model.tie_embeddings || flags.tie_embeddings;
    if (o.untie_embeddings) o.model.tie_embeddings = false;
  }
  if (o.untie_embeddings && o.given("--tie-embeddings"))
    throw UsageError("--untie-embeddings and --tie-embeddings contradict each other: keep one");
  if (o.untie_embeddings && !o.load.empty())
    throw UsageError("--untie-embeddings with --load " + o.load +
                     ": the checkpoint's config.json decides whether its weights are tied; drop "
                     "the flag");
  check_model_limits(o);
  check_mixture_flags(o.model, o.given("--top-k"), o.given("--aux-loss-coef"));
  validate_model_config(o.model);
  if (parameter_count_unbounded(o.model) > kMaxParameters)
    throw UsageError(std::string(o.load.empty()
                                     ? "--d-model, --layers, --ffn, --vocab, --heads, --experts"
                                     : o.load + "/config.json") +
                     ": the model would hold " + num(parameter_count_unbounded(o.model)) +
                     " parameters, past the 2^50 (1.1e15) picoscale indexes; use a smaller model");
  check_range(o.model.aux_loss_coef, "--aux-loss-coef", 0, false, kNoMax,
              "must be a number >= 0 (0 turns the load-balancing loss off), e.g. 0.001");
  check_range(o.model.rope_theta, "--rope-theta", kMinRopeTheta, false, kNoMax,
              "must be a number >= 1 (RoPE's base: 10000 in Llama 2, 500000 in Llama 3)");
}

// The meta device holds no values: what would read or write them is refused, naming the flag.
// A simulated world is the grid's, and its rank one of it.
static void check_meta_run(const RunOptions& o, int world) {
  const bool meta = o.device == "meta";
  if (!meta)
    for (const char* flag : {"--simulate-world", "--simulate-rank"})
      if (o.given(flag))
        throw UsageError(std::string(flag) +
                         " runs one rank of a world that exchanges nothing: add --device meta");
  if (!meta) return;
  for (const char* flag : {"--load", "--save", "--save-every", "--keep", "--save-grads", "--score",
                           "--sample", "--trace", "--fault"})
    if (o.given(flag))
      throw UsageError(std::string("--device meta holds no values and times nothing: ") + flag +
                       " has nothing to " +
                       (std::string(flag) == "--load" ? "read into" : "write or act on") +
                       "; drop it, or run on --device cpu or cuda");
  if (o.given("--simulate-world") && o.simulate_world != world)
    throw UsageError("--simulate-world " + std::to_string(o.simulate_world) + ": the grid --dp x " +
                     "--pp x --cp x --tp has " + std::to_string(world) +
                     " ranks; give --simulate-world " + std::to_string(world));
  if (o.given("--simulate-rank") && !o.given("--simulate-world"))
    throw UsageError("--simulate-rank " + std::to_string(o.simulate_rank) +
                     " is a rank of --simulate-world N: add --simulate-world " +
                     std::to_string(world));
  if (o.simulate_rank < -1 || o.simulate_rank >= std::max(1, o.simulate_world))
    throw UsageError("--simulate-rank " + std::to_string(o.simulate_rank) +
                     ": not a rank of --simulate-world " + std::to_string(o.simulate_world) +
                     "; give 0 to " + std::to_string(std::max(1, o.simulate_world) - 1) +
                     ", or -1 for every pipeline stage");
}

void resolve_run_options(RunOptions& o, int world) {
  check_meta_run(o, world);  // before anything is read
  // An empty path is an unset variable in a script, not a choice: --load "" would train from
  // scratch and --save "" save nothing, each ending with exit code 0.
  for (auto [flag, path] : {std::pair<const char*, const std::string&>{"--save", o.save},
                            {"--load", o.load},
                            {"--log-json", o.log_json},
                            {"--save-grads", o.save_grads},
                            {"--trace", o.trace},
                            {"--data", o.data},
                            {"--score", o.score}})
    if (o.given(flag) && path.empty())
      throw UsageError(std::string(flag) +
                       " '': an empty path (an unset variable in a script?); give a path, or "
                       "drop " +
                       flag);
  if (o.given("--gpu") && o.gpu.empty())
    throw UsageError(
        "--gpu '': an empty profile name; give h100, h200, a100 or cpu, or drop --gpu");
  if (!o.score.empty())  // --score prints a loss and exits: training flags would do nothing
    for (const char* flag :
         {"--save",       "--save-dtype", "--save-every", "--keep",      "--steps",
          "--stop-after", "--save-grads", "--log-json",   "--trace",     "--sample",
          "--data",       "--lr",         "--min-lr",     "--warmup",    "--weight-decay",
          "--grad-clip",  "--grad-acc",   "--val-frac",   "--val-every", "--val-seqs",
          "--no-shuffle", "--report"})
      if (o.given(flag))
        throw UsageError(std::string("--score prints a loss and exits: ") + flag +
                         " would be ignored; drop it (train first, then score the checkpoint)");
  if (!o.score.empty() && o.load.empty())
    throw UsageError("--score " + o.score + " needs --load DIR: the model to score with");
  // Inputs before anything reads them: regular files (a FIFO would block every rank) that fit.
  if (!o.data.empty()) check_token_file("--data", o.data);
  if (!o.score.empty()) check_token_file("--score", o.score);
  resolve_model(o);
  if (!o.load.empty()) {
    check_checkpoint_weights(o.load);
    for (const std::string& f : checkpoint_input_files(o.load)) check_input_file("--load " + f, f);
  }
  if (o.steps < 0) throw UsageError("--steps " + std::to_string(o.steps) + ": must be >= 0");
  if (o.steps == 0 && o.score.empty() && o.save.empty() && o.sample == 0)
    throw UsageError(
        "--steps 0 trains nothing: it loads (--load DIR) and saves (--save DIR), "
        "e.g. a bf16 or sharded checkpoint into one fp32 model.safetensors, or "
        "samples (--sample N); add --save DIR");
  if (o.steps == 0 && !o.save_grads.empty())
    throw UsageError(
        "--save-grads writes the first step's gradients, and --steps 0 takes no "
        "step: drop --save-grads");
  if (o.save_every < 0) throw UsageError("--save-every must be >= 0 (0: only the final save)");
  if (o.save_every > 0 && o.save.empty())
    throw UsageError("--save-every " + std::to_string(o.save_every) +
                     " saves into --save DIR: add --save DIR");
  if (o.keep < 0) throw UsageError("--keep must be >= 0 (0: keep every periodic checkpoint)");
  if (o.given("--keep") && o.save_every == 0)
    throw UsageError("--keep " + std::to_string(o.keep) +
                     " keeps the newest periodic checkpoints of --save-every N: add "
                     "--save-every N");
  o.first_step = o.load.empty() || !o.score.empty() ? 0 : checkpoint_step(o.load);
  if (o.steps > 0 && o.first_step >= o.steps)
    throw UsageError("--load " + o.load + ": its optimizer state is at step " +
                     std::to_string(o.first_step) + ", " +
                     (o.first_step == o.steps ? "where" : "past where") + " --steps " +
                     std::to_string(o.steps) +
                     " ends: nothing is left to train; raise --steps to train on (the learning "
                     "rate's schedule spans --steps), or use --steps 0 to load and --save only");
  check_positive(o.mbs, "--mbs");
  check_positive(o.grad_acc, "--grad-acc"), check_positive(o.val_seqs, "--val-seqs");
  check_at_most(o.mbs, kMaxMbs, "--mbs", "lower --mbs (raise --grad-acc for a larger batch)");
  if ((int64_t)o.mbs * o.model.seq > INT_MAX)
    throw UsageError("--mbs " + std::to_string(o.mbs) + " x --seq " + std::to_string(o.model.seq) +
                     " tokens per micro-batch is above " + std::to_string(INT_MAX) +
                     "; lower --mbs (raise --grad-acc for a larger batch)");
  // A rank reads its whole step's tokens at once (int32 ids, runtime/data.cu).
  if ((double)o.mbs * o.grad_acc * o.model.seq > INT_MAX)
    throw UsageError("--grad-acc " + std::to_string(o.grad_acc) + " x --mbs " +
                     std::to_string(o.mbs) + " x --seq " + std::to_string(o.model.seq) +
                     " tokens a rank reads per step is above " + std::to_string(INT_MAX) +
                     "; lower --grad-acc (more data-parallel ranks give a larger batch)");
  if (o.stop_after < 0) throw UsageError("--stop-after must be >= 0 (0: run to --steps)");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (o.val_every < 0) throw UsageError("--val-every must be >= 0");
  if (o.sample < 0) throw UsageError("--sample must be >= 0");
  check_at_most(o.sample, kMaxSample, "--sample", "generate fewer bytes");
  check_range(o.lr, "--lr", 0, true, kNoMax, "must be a positive number, e.g. 2e-3");
  if (!o.given("--min-lr")) o.min_lr = o.lr / 10;
  check_range(o.min_lr, "--min-lr", 0, false, o.lr,
              "must be a number from 0 to --lr " + num(o.lr) + " (the cosine decays lr to it)");
  check_range(o.weight_decay, "--weight-decay", 0, false, kNoMax,
              "must be a number >= 0 (0 turns decay off), e.g. 0.1");
  check_range(o.grad_clip, "--grad-clip", 0, false, kNoMax,
              "must be a number >= 0 (0 turns clipping off), e.g. 1.0");
  check_range(o.temperature, "--temperature", 0, true, kNoMax, "must be a number > 0");
  // A collective takes milliseconds, but a rank's start-up or a checkpoint's write seconds.
  check_range(o.comm_timeout, "--comm-timeout", 1, false, kNoMax,
              "must be a number of seconds >= 1, e.g. 300");
  check_paths_apart(o);
  if (!o.fault.kind.empty() && o.fault.rank >= world)
    throw UsageError("--fault " + o.app->get_option("--fault")->as<std::string>() + ": rank " +
                     std::to_string(o.fault.rank) + " does not exist in a grid of " +
                     std::to_string(world) + " ranks");
  if (o.fault.where == FaultWhere::Init)
    check_fault_has_peer(o.fault, o.app->get_option("--fault")->as<std::string>(), world);
}

void check_paths_apart(const RunOptions& o) {
  struct Path {
    std::string flag, flag_value, path;  // "--load", "ck", "ck/model.safetensors"
  };
  std::vector<Path> inputs, outputs;
  if (!o.data.empty()) inputs.push_back({"--data", o.data, o.data});
  if (!o.score.empty()) inputs.push_back({"--score", o.score, o.score});
  if (!o.load.empty())
    for (const std::string& f : checkpoint_input_files(o.load))
      inputs.push_back({"--load", o.load, f});
  if (!o.save.empty()) {
    outputs.push_back({"--save", o.save, o.save});  // the directory itself
    for (const std::string& f : checkpoint_output_files(o.save))
      outputs.push_back({"--save", o.save, f});
  }
  for (auto [flag, path] :
       {std::pair<const char*, const std::string&>{"--save-grads", o.save_grads},
        {"--log-json", o.log_json},
        {"--trace", o.trace}})
    if (!path.empty()) outputs.push_back({flag, path, path});
  auto named = [](const Path& p) {
    return p.flag + " " + p.flag_value + (p.path == p.flag_value ? "" : " (" + p.path + ")");
  };
  for (const Path& out : outputs)
    for (const Path& in : inputs)
      // --save DIR --load DIR resumes in place: every file is read before the first save, and
      // a save swaps the whole directory at once.
      if (!(out.flag == "--save" && in.flag == "--load") && same_file(out.path, in.path))
        throw UsageError(named(out) + " would overwrite " + named(in) +
                         ", which this run reads: they are the same file; write the output "
                         "elsewhere");
  for (size_t i = 0; i < outputs.size(); i++)
    for (size_t j = i + 1; j < outputs.size(); j++)
      if (outputs[i].flag != outputs[j].flag && same_file(outputs[i].path, outputs[j].path))
        throw UsageError(named(outputs[i]) + " and " + named(outputs[j]) +
                         " are the same file: one would overwrite the other; give each output "
                         "its own name");
}

std::vector<std::vector<LaunchSetting>> launch_settings(const RunOptions& o) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world == 1) return {};  // one rank agrees with itself: no file read for a checksum
  std::vector<LaunchSetting> files;
  // A token file refused (too large for this machine, say) is compared by its refusal, unread.
  auto token_file = [&](const std::string& flag, const std::string& path) {
    try {
      check_token_file(flag, path);
    } catch (const UsageError& e) {
      return LaunchSetting{flag + " " + path, e.what(), e.what()};
    }
    return files_setting(flag + " " + path, {path});
  };
  if (!o.data.empty()) files.push_back(token_file("--data", o.data));
  if (!o.score.empty()) files.push_back(token_file("--score", o.score));
  if (!o.load.empty()) {
    std::vector<std::string> read;
    try {
      read = checkpoint_input_files(o.load);
    } catch (const UsageError& e) {  // unreadable here: compared as such
      read = {o.load + " (" + e.what() + ")"};
    }
    files.push_back(files_setting("--load " + o.load, read));
  }
  return {{build_setting()},
          o.app ? command_line_settings(*o.app) : std::vector<LaunchSetting>{},
          files};
}

// ----------------------------------------------------------------------------
// Before the first allocation

double device_bytes_per_rank(Device device, int local_ranks, std::string& what) {
  if (device == Device::Meta) {  // counted, never allocated: any size fits
    what = "the meta device (no storage)";
    return INFINITY;
  }
  if (device == Device::CUDA) {
    size_t free_bytes = 0, total = 0;
    int gpus = 1;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    int sharing = (local_ranks + gpus - 1) / gpus;  // a rank's GPU: its local rank modulo count
    what = "GPU memory " + human_bytes((double)total) + " shared by " + std::to_string(sharing) +
           " rank(s)";
    return (double)total / sharing;
  }
  double total = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  what = "host memory " + human_bytes(total) + " shared by " + std::to_string(local_ranks) +
         " rank(s) on this node";
  return total / local_ranks;
}

void check_memory_fits(double state, double acts, Device device, int local_ranks) {
  std::string what;
  double have = device_bytes_per_rank(device, local_ranks, what);
  if (state + acts <= have) return;
  throw UsageError("the run needs about " + human_bytes(state + acts) +
                   " per rank (weights, gradients and Adam: " + human_bytes(state) +
                   "; activations of one micro-batch: " + human_bytes(acts) +
                   ") but this rank has " + human_bytes(have) + " (" + what +
                   "); lower --mbs, --seq or the model's size, or use --recompute, --tp or "
                   "--zero");
}

void check_step_tokens_fit(const RunOptions& o, int local_ranks) {
  // inputs and targets, whole and this rank's share (train.cu's Trainer): 16 bytes a token
  const double tokens = (double)o.mbs * o.grad_acc * o.model.seq, bytes = 16 * tokens;
  std::string what;
  const double have = device_bytes_per_rank(Device::CPU, local_ranks, what);
  if (bytes <= have / 2) return;
  throw UsageError("--mbs " + std::to_string(o.mbs) + " x --grad-acc " +
                   std::to_string(o.grad_acc) + " x --seq " + std::to_string(o.model.seq) + " = " +
                   num(tokens) +
                   " tokens a step, held on the host at 16 bytes each: " + human_bytes(bytes) +
                   ", more than half of this rank's " + human_bytes(have) + " (" + what +
                   "); lower --grad-acc (more data-parallel ranks give a larger batch)");
}

void check_outputs(const RunOptions& o, const Comm& comm) {
  if (!comm.grid.prints()) return;  // world rank 0 writes every output
  if (!o.save.empty()) check_checkpoint_output("--save", o.save);
  for (auto [flag, path] :
       {std::pair<const char*, const std::string&>{"--save-grads", o.save_grads},
        {"--log-json", o.log_json},
        {"--trace", o.trace}})
    if (!path.empty()) check_output_file(flag, path);
}

void print_config_table(const std::vector<std::pair<std::string, std::string>>& rows) {
  const char* rule =
      "+------------------------+----------------------------------------------------+";
  printf("%s\n", rule);
  for (const auto& [k, v] : rows) printf("| %-22s | %-50s |\n", k.c_str(), v.c_str());
  printf("%s\n", rule);
}
