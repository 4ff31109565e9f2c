// options.cu: train's flags (CLI11), their validation and the configuration table.
#include "runtime/options.cuh"

#include <unistd.h>

#include <climits>
#include <cmath>
#include <fstream>
#include <limits>

#include "context_parallel.cuh"
#include "runtime/checkpoint.cuh"
#include "data_parallel.cuh"
#include "mixed_precision.cuh"
#include "pipeline_parallel.cuh"
#include "zero.cuh"

void add_flags(CLI::App& app, Options& o, std::vector<ShapeFlag>& shape) {
  // A flag given twice takes its last value, so a script can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  o.app = &app;
  app.add_option("--model", o.preset, "preset: tiny, medium, smollm-135m, llama-1b")
      ->capture_default_str();
  auto shape_flag = [&](const char* flag, IntField field, const char* help) {
    shape.push_back({flag, field, app.add_option(flag, o.model.*field, help)});
  };
  shape_flag("--d-model", &ModelConfig::d_model, "hidden size");
  shape_flag("--layers", &ModelConfig::layers, "transformer blocks");
  shape_flag("--heads", &ModelConfig::heads, "query heads");
  shape_flag("--kv-heads", &ModelConfig::kv_heads, "key/value heads (grouped-query attention)");
  shape_flag("--ffn", &ModelConfig::ffn, "MLP intermediate size");
  shape_flag("--vocab", &ModelConfig::vocab, "vocabulary size");
  shape_flag("--seq", &ModelConfig::seq, "tokens per sequence");
  app.add_option("--rope-theta", o.model.rope_theta, "RoPE base");
  app.add_flag("--tie-embeddings", o.model.tie_embeddings, "share embedding and LM head");
  app.add_option("--attention", o.attention, "attention core: flash|naive")
      ->capture_default_str();
  app.add_option("--recompute", o.recompute, "activation recomputation: none|selective|full")
      ->capture_default_str();
  app.add_option("--steps", o.steps, "total optimizer steps (a resumed run continues to it)")
      ->capture_default_str();
  app.add_option("--stop-after", o.stop_after,
                 "end this run after N steps (the schedule still spans --steps; resume with --load)");
  app.add_option("--mbs", o.mbs, "micro-batch size (sequences)")->capture_default_str();
  app.add_option("--grad-acc", o.grad_acc, "micro-batches per step")->capture_default_str();
  app.add_option("--lr", o.lr, "peak learning rate")->capture_default_str();
  app.add_option("--warmup", o.warmup, "linear warmup steps")->capture_default_str();
  app.add_option("--min-lr", o.min_lr, "final learning rate of the cosine (default lr/10)");
  app.add_option("--weight-decay", o.weight_decay, "AdamW decoupled weight decay")
      ->capture_default_str();
  app.add_option("--grad-clip", o.grad_clip, "clip the global gradient norm (0: off)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "seed of initialisation and sampling")->capture_default_str();
  app.add_option("--device", o.device, "auto|cpu|cuda")->capture_default_str();
  app.add_option("--data", o.data, "text file (bytes) or llm.c .bin shard; default: fortunes");
  app.add_flag("--no-shuffle", o.no_shuffle,
               "read training sequences in file order (default: shuffled each epoch by --seed)");
  app.add_option("--val-frac", o.val_frac, "held-out fraction of the data")->capture_default_str();
  app.add_option("--val-every", o.val_every, "validate every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--val-seqs", o.val_seqs, "validation sequences")->capture_default_str();
  app.add_option("--save", o.save, "write a Hugging Face checkpoint to DIR at the end");
  app.add_option("--save-dtype", o.save_dtype,
                 "model.safetensors in fp32 (the master weights) or bf16 (optimizer state: fp32)")
      ->capture_default_str();
  app.add_option("--dtype", o.dtype,
                 "linear layers in fp32|bf16|fp16|fp8, fp32 master weights (auto: fp32 on CPU, "
                 "bf16 on CUDA)")
      ->capture_default_str();
  app.add_option("--grad-acc-dtype", o.grad_acc_dtype,
                 "gradient buffers in fp32 (Playbook: 20 bytes per parameter with bf16 weights) or "
                 "bf16 (16; with --dtype bf16 or fp8)")
      ->capture_default_str();
  app.add_option("--loss-scale", o.loss_scale,
                 "fp16: dynamic (start 65536, halve on overflow) or a fixed scale (1: none)")
      ->capture_default_str();
  app.add_option("--loss-scale-window", o.loss_scale_window,
                 "fp16: good steps before a dynamic loss scale doubles")
      ->capture_default_str();
  app.add_option("--load", o.load, "start from the checkpoint in DIR (weights, optimizer, step)");
  app.add_option("--log-json", o.log_json, "write one JSON object per step to FILE");
  app.add_option("--save-grads", o.save_grads, "write the first step's gradients (safetensors)");
  app.add_option("--score", o.score, "with --load: print the mean loss over FILE and exit");
  app.add_option("--sample", o.sample, "generate N bytes at the end (at most 1048576)")
      ->capture_default_str();
  app.add_option("--prompt", o.prompt, "text the sample continues");
  app.add_option("--temperature", o.temperature, "sampling temperature")->capture_default_str();
  app.add_option("--dp", o.dp, "data-parallel ranks")->capture_default_str();
  app.add_option("--pp", o.pp, "pipeline-parallel stages")->capture_default_str();
  app.add_option("--pp-schedule", o.pp_schedule,
                 "pipeline schedule: afab|1f1b|interleaved|zb-h1")
      ->capture_default_str();
  app.add_option("--pp-virtual", o.pp_virtual, "model chunks per pipeline rank (interleaved)")
      ->capture_default_str();
  app.add_option("--cp", o.cp, "context-parallel ranks")->capture_default_str();
  app.add_option("--cp-balance", o.cp_balance, "how the sequence is split: zigzag|contiguous")
      ->capture_default_str();
  app.add_option("--cp-comm", o.cp_comm, "keys and values: ring|allgather")
      ->capture_default_str();
  app.add_option("--tp", o.tp, "tensor-parallel ranks")->capture_default_str();
  app.add_flag("--sp", o.sp, "sequence parallelism in the tensor-parallel group");
  app.add_option("--comm", o.comm, "collectives backend: auto|nccl|mpi")->capture_default_str();
  app.add_option("--comm-timeout", o.comm_timeout,
                 "seconds a collective may wait before the job is aborted")->capture_default_str();
  app.add_option("--dp-sync", o.dp_sync, "gradient sync: naive|bucket|ring")->capture_default_str();
  app.add_option("--bucket-mb", o.bucket_mb, "gradient bucket size in MiB")->capture_default_str();
  app.add_flag("--no-overlap", o.no_overlap,
               "launch every bucket after the backward pass (ZeRO: wait for every collective "
               "when issued, no prefetch)");
  app.add_option("--zero", o.zero,
                 "ZeRO stage over dp_cp: 0 off, 1 optimizer states, 2 + gradients, 3 + weights")
      ->capture_default_str();
  app.add_option("--trace", o.trace, "write a Chrome trace JSON (Perfetto) to FILE");
  app.add_option("--report", o.reports, "print reports at the end: memory, comm, bubble, sync")
      ->delimiter(',');
  app.add_flag("--sync-launches", o.sync_launches,
               "debugging: synchronise after every CUDA kernel, so a faulting kernel is named "
               "where it faults (slow)");
  app.add_option("--fault", o.fault,
                 "test fault handling: KIND:RANK:STEP[:WHERE], KIND crash|hang|error, WHERE "
                 "init|step|forward|backward|clip|optimizer|validation|save (default step)");
}

static void check_positive(int value, const char* flag) {
  if (value <= 0) throw UsageError(std::string(flag) + " " + std::to_string(value) + ": must be > 0");
}
static std::string num(double x) {  // 0.002, inf, nan: as the user would type it
  char buf[32];
  snprintf(buf, sizeof buf, "%g", x);
  return buf;
}
static bool given(const Options& o, const char* flag) { return o.app && o.app->count(flag) > 0; }

// Sizes past these maxima overflow int arithmetic (seq + 1, mbs x seq tokens) or fit no machine.
// `source` names where the value came from: the flag, or the checkpoint's config.json key.
static void check_at_most(int64_t value, int64_t max, const std::string& source,
                          const std::string& fix) {
  if (value > max)
    throw UsageError(source + " " + std::to_string(value) + ": above the maximum " +
                     std::to_string(max) + "; " + fix);
}
static void check_model_limits(const Options& o) {
  const ModelConfig& c = o.model;
  auto from = [&](const char* flag, const char* key) {
    return !o.load.empty() && !given(o, flag) ? o.load + "/config.json " + key : std::string(flag);
  };
  check_at_most(c.seq, kMaxSeq, from("--seq", "max_position_embeddings"),
                "pass a smaller --seq (RoPE has no learned positions: any length up to it works)");
  check_at_most(c.layers, kMaxLayers, from("--layers", "num_hidden_layers"), "use fewer layers");
  for (auto [value, flag, key] : {std::tuple{c.d_model, "--d-model", "hidden_size"},
                                  {c.ffn, "--ffn", "intermediate_size"},
                                  {c.vocab, "--vocab", "vocab_size"}})
    check_at_most(value, kMaxWidth, from(flag, key), "use a smaller value");
}

constexpr double kNoMax = std::numeric_limits<double>::max();
// A float flag that must be a finite number in [lo, hi] (lo excluded when `open_lo`).
static void check_range(double value, const char* flag, double lo, bool open_lo, double hi,
                        const std::string& fix) {
  bool ok = std::isfinite(value) && (open_lo ? value > lo : value >= lo) && value <= hi;
  if (!ok) throw UsageError(std::string(flag) + " " + num(value) + ": " + fix);
}

// Builds the model config (preset, flags, or checkpoint) and checks every flag. Runs the same
// on every rank before anything is allocated.
void resolve_options(Options& o, const std::vector<ShapeFlag>& shape) {
  if (!o.score.empty())  // --score prints a loss and exits: training flags would do nothing
    for (const char* flag :
         {"--save", "--save-dtype", "--steps", "--stop-after", "--save-grads", "--log-json",
          "--trace", "--sample", "--data", "--lr", "--min-lr", "--warmup", "--weight-decay", "--grad-clip", "--grad-acc",
          "--val-frac", "--val-every", "--val-seqs", "--no-shuffle"})
      if (given(o, flag))
        throw UsageError(std::string("--score prints a loss and exits: ") + flag +
                         " would be ignored; drop it (train first, then score the checkpoint)");
  ModelConfig flags = o.model;
  if (!o.load.empty()) {
    o.model = read_checkpoint_config(o.load);
    auto disagree = [&](const std::string& flag_and_value, const std::string& theirs) {
      return UsageError(flag_and_value + " disagrees with " + o.load + "/config.json (" +
                        theirs + "); drop the flag when loading");
    };
    for (const ShapeFlag& s : shape)  // --seq may differ: RoPE has no learned positions
      if (s.opt->count() && flags.*s.field != o.model.*s.field && std::string(s.flag) != "--seq")
        throw disagree(std::string(s.flag) + " " + std::to_string(flags.*s.field),
                       std::to_string(o.model.*s.field));
    if (shape.back().opt->count()) o.model.seq = flags.seq;
    if (given(o, "--rope-theta") && flags.rope_theta != o.model.rope_theta)
      throw disagree("--rope-theta " + num(flags.rope_theta),
                     "rope_theta " + num(o.model.rope_theta));
    if (given(o, "--tie-embeddings") && !o.model.tie_embeddings)
      throw disagree("--tie-embeddings", "tie_word_embeddings false");
  } else {
    o.model = model_preset(o.preset);
    for (const ShapeFlag& s : shape)
      if (s.opt->count()) o.model.*s.field = flags.*s.field;
    if (given(o, "--rope-theta")) o.model.rope_theta = flags.rope_theta;
    o.model.tie_embeddings = o.model.tie_embeddings || flags.tie_embeddings;
  }
  check_model_limits(o);
  validate_model_config(o.model);
  check_range(o.model.rope_theta, "--rope-theta", 0, true, kNoMax,
              "must be a positive number (RoPE's base, 10000 in Llama 2)");
  check_positive(o.steps, "--steps"), check_positive(o.mbs, "--mbs");
  check_positive(o.grad_acc, "--grad-acc"), check_positive(o.val_seqs, "--val-seqs");
  check_at_most(o.mbs, kMaxMbs, "--mbs", "lower --mbs (raise --grad-acc for a larger batch)");
  if ((int64_t)o.mbs * o.model.seq > INT_MAX)
    throw UsageError("--mbs " + std::to_string(o.mbs) + " x --seq " + std::to_string(o.model.seq) +
                     " tokens per micro-batch is above " + std::to_string(INT_MAX) +
                     "; lower --mbs (raise --grad-acc for a larger batch)");
  if (o.stop_after < 0) throw UsageError("--stop-after must be >= 0 (0: run to --steps)");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (o.val_every < 0) throw UsageError("--val-every must be >= 0");
  if (o.sample < 0) throw UsageError("--sample must be >= 0");
  check_at_most(o.sample, kMaxSample, "--sample", "generate fewer bytes");
  check_range(o.lr, "--lr", 0, true, kNoMax, "must be a positive number, e.g. 2e-3");
  if (!given(o, "--min-lr")) o.min_lr = o.lr / 10;
  check_range(o.min_lr, "--min-lr", 0, false, o.lr,
              "must be a number from 0 to --lr " + num(o.lr) + " (the cosine decays lr to it)");
  check_range(o.weight_decay, "--weight-decay", 0, false, kNoMax,
              "must be a number >= 0 (0 turns decay off), e.g. 0.1");
  check_range(o.grad_clip, "--grad-clip", 0, false, kNoMax,
              "must be a number >= 0 (0 turns clipping off), e.g. 1.0");
  check_range(o.temperature, "--temperature", 0, true, kNoMax, "must be a number > 0");
  if (!o.score.empty() && o.load.empty())
    throw UsageError("--score " + o.score + " needs --load DIR: the model to score with");
  parse_recompute(o.recompute);
  parse_attention(o.attention);
  check_positive(o.dp, "--dp"), check_positive(o.pp, "--pp");
  check_positive(o.cp, "--cp"), check_positive(o.tp, "--tp");
  parse_cp_comm(o.cp_comm);
  validate_context_parallel(o.model.seq, o.cp, parse_cp_balance(o.cp_balance),
                            parse_attention(o.attention) == AttentionKind::Flash, o.tp, o.sp, o.sample);
  validate_pipeline(o.model.layers, o.pp, o.pp_virtual, o.grad_acc, parse_pp_schedule(o.pp_schedule),
                    o.model.tie_embeddings, o.zero);
  validate_tensor_parallel(o.model, o.tp, o.sp);
  parse_dp_sync(o.dp_sync);
  parse_save_dtype(o.save_dtype);
  if (o.dtype != "auto") parse_precision(o.dtype);
  if (o.grad_acc_dtype != "fp32" && o.grad_acc_dtype != "bf16")
    throw UsageError("--grad-acc-dtype " + o.grad_acc_dtype + ": expected fp32 or bf16");
  make_loss_scaler(o.dtype == "fp16" ? Precision::FP16 : Precision::FP32, o.loss_scale,
                   o.loss_scale_window, given(o, "--loss-scale") || given(o, "--loss-scale-window"));
  parse_zero_stage(o.zero);
  check_range(o.bucket_mb, "--bucket-mb", 0, true, kNoMax, "must be a number > 0, e.g. 25");
  check_range(o.comm_timeout, "--comm-timeout", 0, true, kNoMax,
              "must be a number of seconds > 0, e.g. 300");
  for (const std::string& r : o.reports)
    if (r != "memory" && r != "comm" && r != "bubble" && r != "sync" && r != "balance")
      throw UsageError("--report " + r +
                       ": expected memory, comm, bubble, sync or balance (several: memory,comm)");
  if (!o.fault.empty()) {
    Fault f = parse_fault(o.fault);
    int64_t world = (int64_t)o.dp * o.pp * o.cp * o.tp;
    if (f.rank >= world)
      throw UsageError("--fault " + o.fault + ": rank " + std::to_string(f.rank) +
                       " does not exist in a grid of " + std::to_string(world) + " ranks");
  }
}

Precision resolve_precision(const Options& o, Device device) {
  if (o.dtype == "auto") return device == Device::CUDA ? Precision::BF16 : Precision::FP32;
  Precision p = parse_precision(o.dtype);
  if (p == Precision::FP8 && device == Device::CUDA) {
    int dev = 0, major = 0, minor = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    if (major * 10 + minor < 89)
      throw UsageError("--dtype fp8 needs FP8 tensor cores (compute capability 8.9 or later: Ada, "
                       "Hopper); this GPU is " + std::to_string(major) + "." +
                       std::to_string(minor) + ": use --dtype bf16, or --device cpu to simulate fp8");
  }
  return p;
}

DType resolve_grad_dtype(const Options& o, Precision p) {
  if (o.grad_acc_dtype == "fp32") return DType::F32;
  const std::string flag = "--grad-acc-dtype bf16";
  if (p != Precision::BF16 && p != Precision::FP8)
    throw UsageError(flag + " keeps gradients in the compute format of --dtype bf16 or fp8; this "
                     "run is " + precision_name(p) +
                     (p == Precision::FP16 ? " (fp16 gradients would underflow: loss scaling "
                                             "needs fp32 ones)" : "") +
                     ": add --dtype bf16, or drop the flag");
  if (o.dp_sync == "ring")
    throw UsageError(flag + ": the hand-written ring (--dp-sync ring) adds fp32 chunks; use "
                     "--dp-sync bucket or naive");
  return DType::BF16;
}

// ----------------------------------------------------------------------------
// Before the first allocation

// This rank's share of its device's memory: host RAM over the node's ranks on CPU; on CUDA the
// GPU's memory over the ranks that share it (a rank's GPU is its local rank modulo the count).
static double device_bytes_per_rank(Device device, int local_ranks, std::string& what) {
  if (device == Device::CUDA) {
    size_t free_bytes = 0, total = 0;
    int gpus = 1;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    int sharing = (local_ranks + gpus - 1) / gpus;
    what = "GPU memory " + human_bytes((double)total) + " shared by " + std::to_string(sharing) +
           " rank(s)";
    return (double)total / sharing;
  }
  double total = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  what = "host memory " + human_bytes(total) + " shared by " + std::to_string(local_ranks) +
         " rank(s) on this node";
  return total / local_ranks;
}

// The closed forms of model.cu, per rank: weights, gradients and Adam's m and v (the README's
// ZeRO table, over tp), the saved activations of every block of one micro-batch, and the
// logits with their gradient.
static void check_memory(const Options& o, Device device, int local_ranks) {
  const ModelConfig& c = o.model;
  // The closed forms are int64: guard them against sizes whose bytes would overflow (such a run
  // fits no machine anyway).
  double rough = (double)c.layers * c.d_model * ((double)c.d_model + c.ffn) +
                 (double)c.vocab * c.d_model +
                 (double)c.layers * o.mbs * c.seq * ((double)c.heads * c.seq + c.d_model + c.ffn);
  std::string what;
  double have = device_bytes_per_rank(device, local_ranks, what);
  if (rough > 1e17)
    throw UsageError("the model and batch need more than " + human_bytes(1e17) +
                     " per rank, this rank has " + human_bytes(have) + " (" + what +
                     "); lower --mbs, --seq, --layers, --d-model or --ffn");
  double psi = (double)parameter_count(c) / o.tp;
  int n = o.dp * o.cp, stage = n > 1 ? o.zero : 0;
  const double grad_bytes =
      o.score.empty() && resolve_grad_dtype(o, resolve_precision(o, device)) == DType::BF16 ? 2 : 4;
  // Mixed precision keeps the whole weights in bf16 / fp16 too (not ZeRO-3), and ZeRO-1/2 then
  // shard the fp32 master weights with Adam's moments.
  const bool low = o.score.empty() && resolve_precision(o, device) != Precision::FP32;
  double weights = 4 * psi / (stage == 3 || (low && stage >= 1) ? n : 1);
  double grads = grad_bytes * psi / (stage >= 2 ? n : 1);
  double adam = 8 * psi / (stage >= 1 ? n : 1);
  double copy = !low ? 0 : stage < 3 ? 2 * psi : 2 * psi / n;  // ZeRO-3: a bf16 copy of its shard
  double state = (o.score.empty() ? weights + grads + adam : 4 * psi) + copy;
  double acts = (double)c.layers * activation_bytes_per_block(c, o.mbs, c.seq, o.tp, o.sp,
                                                              parse_recompute(o.recompute),
                                                              *local_attention(parse_attention(o.attention)),
                                                              low ? 2 : 4) +
                2.0 * o.mbs * c.seq * (c.vocab / o.tp) * 4;
  if (state + acts > have)
    throw UsageError("the run needs about " + human_bytes(state + acts) +
                     " per rank (weights, gradients and Adam: " + human_bytes(state) +
                     "; activations of one micro-batch: " + human_bytes(acts) +
                     ") but this rank has " + human_bytes(have) + " (" + what +
                     "); lower --mbs, --seq or the model's size, or use --recompute, --tp or "
                     "--zero");
}

void check_before_start(const Options& o, const Comm& comm) {
  int local = 0, local_ranks = 1;
  local_rank(&local, &local_ranks, comm.timeout_s);  // collective: before anything that may throw
  check_memory(o, comm.device, local_ranks);
  if (comm.grid.world_rank != 0) return;  // world rank 0 writes every output
  if (!o.save.empty()) check_checkpoint_output("--save", o.save);
  for (auto [flag, path] : {std::pair<const char*, const std::string&>{"--save-grads", o.save_grads},
                            {"--log-json", o.log_json},
                            {"--trace", o.trace}})
    if (!path.empty()) check_output_file(flag, path);
}

void print_config(const Options& o, const Dataset& data, const Comm& comm, int64_t n_params,
                         int zero_stage) {
  const ModelConfig& c = o.model;
  auto row = [](const char* k, const std::string& v) { printf("| %-22s | %-50s |\n", k, v.c_str()); };
  auto s = [](auto v) { return std::to_string(v); };
  printf("+------------------------+----------------------------------------------------+\n");
  row("model", c.preset + (o.load.empty() ? "" : " (from " + o.load + ")"));
  row("d_model / layers", s(c.d_model) + " / " + s(c.layers));
  row("heads / kv heads / hd", s(c.heads) + " / " + s(c.kv_heads) + " / " + s(c.head_dim()));
  row("ffn / vocab / seq", s(c.ffn) + " / " + s(c.vocab) + " / " + s(c.seq));
  row("tied embeddings", c.tie_embeddings ? "yes" : "no");
  row("parameters", s(n_params) + " (closed form " + s(parameter_count(c)) + ")");
  row("device / backend", std::string(device_name(comm.device)) + " / " + backend_name(comm.backend) +
                              (o.sync_launches ? ", sync after every kernel" : ""));
  row("grid dp x pp x cp x tp", s(o.dp) + " x " + s(o.pp) + " x " + s(o.cp) + " x " + s(o.tp) +
                                    " = " + s(comm.grid.world_size) + " ranks" +
                                    (o.sp ? ", sequence parallel" : ""));
  if (o.cp > 1)
    row("context parallel", o.cp_balance + " split, " + o.cp_comm + ", " + s(c.seq / o.cp) +
                                " tokens per rank");
  if (o.pp > 1)
    row("pipeline", o.pp_schedule + ", " + s(o.grad_acc) + " micro-batches" +
                        (o.pp_virtual > 1 ? ", " + s(o.pp_virtual) + " chunks per rank" : ""));
  if (zero_stage == 0)
    row("gradient sync", o.dp_sync + ", buckets of " + s(o.bucket_mb).substr(0, 5) + " MiB" +
                             (o.no_overlap ? ", no overlap" : ", overlapped"));
  else
    row("gradient sync", "ZeRO-" + s(zero_stage) + ": reduce-scatter per unit" +
                             (o.no_overlap ? ", no overlap" : ", overlapped") +
                             (zero_stage == 3 && !o.no_overlap ? ", prefetch" : ""));
  {
    Precision p = resolve_precision(o, comm.device);
    row("dtype", p == Precision::FP32
                     ? std::string("fp32")
                     : std::string(precision_name(p)) + " linear layers, fp32 master weights" +
                           (o.dtype == "auto" ? " (auto on CUDA)" : "") +
                           (p == Precision::FP16 ? ", loss scale " + o.loss_scale : "") +
                           (resolve_grad_dtype(o, p) == DType::BF16 ? ", bf16 gradients"
                                                                    : ", fp32 gradients"));
  }
  row("attention", o.attention == "flash" ? "flash (keeps O and its log-sum-exp: O(T))"
                                         : "naive (keeps the probabilities: O(T^2))");
  row("recompute", o.recompute == "selective" && o.attention == "flash"
                       ? "selective: nothing more to drop, flash keeps no probabilities"
                       : o.recompute);
  row("steps / mbs / grad-acc", s(o.steps) + " / " + s(o.mbs) + " / " + s(o.grad_acc));
  row("tokens per step", s((int64_t)o.mbs * o.grad_acc * o.dp * c.seq) + " (mbs x grad-acc x dp x seq)");
  char lr[96];
  snprintf(lr, sizeof lr, "%.2e -> %.2e, warmup %d, wd %.3g, clip %.3g", o.lr, o.min_lr,
           o.warmup, o.weight_decay, o.grad_clip);
  row("lr schedule (cosine)", lr);
  row("seed", s(o.seed));
  row("data", data.source);
  row("train / val tokens", s(data.train.size()) + " / " + s(data.val.size()));
  row("data order", o.no_shuffle ? "file order (--no-shuffle)" : "shuffled per epoch (--seed)");
  printf("+------------------------+----------------------------------------------------+\n");
}
