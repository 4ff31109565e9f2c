// options.cu: train's flags (CLI11), their validation and the configuration table.
#include "options.cuh"

#include <csignal>
#include <thread>

#include "checkpoint.cuh"
#include "data_parallel.cuh"
#include "zero.cuh"

void add_flags(CLI::App& app, Options& o, std::vector<ShapeFlag>& shape) {
  // A flag given twice takes its last value, so a script can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
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
  app.add_option("--val-frac", o.val_frac, "held-out fraction of the data")->capture_default_str();
  app.add_option("--val-every", o.val_every, "validate every N steps (0: only at the end)")
      ->capture_default_str();
  app.add_option("--val-seqs", o.val_seqs, "validation sequences")->capture_default_str();
  app.add_option("--save", o.save, "write a Hugging Face checkpoint to DIR at the end");
  app.add_option("--load", o.load, "start from the checkpoint in DIR (weights, optimizer, step)");
  app.add_option("--log-json", o.log_json, "write one JSON object per step to FILE");
  app.add_option("--save-grads", o.save_grads, "write the first step's gradients (safetensors)");
  app.add_option("--score", o.score, "with --load: print the mean loss over FILE and exit");
  app.add_option("--sample", o.sample, "generate N bytes at the end")->capture_default_str();
  app.add_option("--prompt", o.prompt, "text the sample continues");
  app.add_option("--temperature", o.temperature, "sampling temperature")->capture_default_str();
  app.add_option("--dp", o.dp, "data-parallel ranks")->capture_default_str();
  app.add_option("--pp", o.pp, "pipeline-parallel stages")->capture_default_str();
  app.add_option("--cp", o.cp, "context-parallel ranks")->capture_default_str();
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
  app.add_option("--report", o.reports, "print reports at the end: memory, comm, sync")
      ->delimiter(',');
  app.add_flag("--sync-launches", o.sync_launches,
               "debugging: synchronise after every CUDA kernel, so a faulting kernel is named "
               "where it faults (slow)");
  app.add_option("--fault", o.fault, "test fault handling: KIND:RANK:STEP, KIND crash|hang|error");
}

static void check_positive(int value, const char* flag) {
  if (value <= 0) throw UsageError(std::string(flag) + " " + std::to_string(value) + ": must be > 0");
}

// Builds the model config (preset, flags, or checkpoint) and checks every flag. Runs the same
// on every rank before anything is allocated.
void resolve_options(Options& o, const std::vector<ShapeFlag>& shape) {
  ModelConfig flags = o.model;
  if (!o.load.empty()) {
    o.model = read_checkpoint_config(o.load);
    for (const ShapeFlag& s : shape)  // --seq may differ: RoPE has no learned positions
      if (s.opt->count() && flags.*s.field != o.model.*s.field && std::string(s.flag) != "--seq")
        throw UsageError(std::string(s.flag) + " " + std::to_string(flags.*s.field) +
                         " disagrees with " + o.load + "/config.json (" +
                         std::to_string(o.model.*s.field) + "); drop the flag when loading");
    if (shape.back().opt->count()) o.model.seq = flags.seq;
  } else {
    o.model = model_preset(o.preset);
    for (const ShapeFlag& s : shape)
      if (s.opt->count()) o.model.*s.field = flags.*s.field;
    o.model.rope_theta = flags.rope_theta != ModelConfig{}.rope_theta ? flags.rope_theta
                                                                       : o.model.rope_theta;
    o.model.tie_embeddings = o.model.tie_embeddings || flags.tie_embeddings;
  }
  validate_model_config(o.model);
  check_positive(o.steps, "--steps"), check_positive(o.mbs, "--mbs");
  check_positive(o.grad_acc, "--grad-acc"), check_positive(o.val_seqs, "--val-seqs");
  if (o.stop_after < 0) throw UsageError("--stop-after must be >= 0 (0: run to --steps)");
  if (o.warmup < 0) throw UsageError("--warmup must be >= 0");
  if (o.val_every < 0) throw UsageError("--val-every must be >= 0");
  if (o.sample < 0) throw UsageError("--sample must be >= 0");
  if (!(o.lr > 0)) throw UsageError("--lr must be > 0");
  if (o.min_lr < 0) o.min_lr = o.lr / 10;
  if (o.grad_clip < 0) throw UsageError("--grad-clip must be >= 0 (0 turns clipping off)");
  if (!(o.temperature > 0)) throw UsageError("--temperature must be > 0");
  if (!o.score.empty() && o.load.empty())
    throw UsageError("--score " + o.score + " needs --load DIR: the model to score with");
  parse_recompute(o.recompute);
  check_positive(o.dp, "--dp"), check_positive(o.pp, "--pp");
  check_positive(o.cp, "--cp"), check_positive(o.tp, "--tp");
  for (auto [value, flag] : {std::pair{o.pp, "--pp"}, {o.cp, "--cp"}})
    if (value > 1)
      throw UsageError(std::string(flag) + " " + std::to_string(value) +
                       ": this version parallelises over --dp and --tp; use " + flag + " 1");
  validate_tensor_parallel(o.model, o.tp, o.sp);
  parse_dp_sync(o.dp_sync);
  parse_zero_stage(o.zero);
  if (!(o.bucket_mb > 0)) throw UsageError("--bucket-mb must be > 0");
  if (!(o.comm_timeout > 0)) throw UsageError("--comm-timeout must be > 0 seconds");
  for (const std::string& r : o.reports)
    if (r != "memory" && r != "comm" && r != "sync")
      throw UsageError("--report " + r + ": expected memory, comm or sync (or several: memory,comm)");
  if (!o.fault.empty() && std::count(o.fault.begin(), o.fault.end(), ':') != 2)
    throw UsageError("--fault " + o.fault + ": expected KIND:RANK:STEP, e.g. crash:1:3");
}

// --fault KIND:RANK:STEP, for testing that a failed rank never hangs the job: at the start of
// step STEP, rank RANK kills itself (crash), stops answering (hang), or fails a check (error).
void maybe_inject_fault(const std::string& fault, int rank, int64_t step) {
  if (fault.empty()) return;
  std::string kind = fault.substr(0, fault.find(':'));
  std::string rest = fault.substr(fault.find(':') + 1);
  if (std::stoi(rest.substr(0, rest.find(':'))) != rank ||
      std::stoll(rest.substr(rest.find(':') + 1)) != step)
    return;
  fprintf(stderr, "rank %d: injected fault '%s' at step %lld\n", rank, kind.c_str(), (long long)step);
  fflush(stderr);
  if (kind == "crash") raise(SIGKILL);
  if (kind == "hang") for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  PICO_ASSERT(kind != "error", "injected error");
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
  if (zero_stage == 0)
    row("gradient sync", o.dp_sync + ", buckets of " + s(o.bucket_mb).substr(0, 5) + " MiB" +
                             (o.no_overlap ? ", no overlap" : ", overlapped"));
  else
    row("gradient sync", "ZeRO-" + s(zero_stage) + ": reduce-scatter per unit" +
                             (o.no_overlap ? ", no overlap" : ", overlapped") +
                             (zero_stage == 3 && !o.no_overlap ? ", prefetch" : ""));
  row("recompute", o.recompute);
  row("steps / mbs / grad-acc", s(o.steps) + " / " + s(o.mbs) + " / " + s(o.grad_acc));
  row("tokens per step", s((int64_t)o.mbs * o.grad_acc * o.dp * c.seq) + " (mbs x grad-acc x dp x seq)");
  char lr[96];
  snprintf(lr, sizeof lr, "%.2e -> %.2e, warmup %d, wd %.3g, clip %.3g", o.lr, o.min_lr,
           o.warmup, o.weight_decay, o.grad_clip);
  row("lr schedule (cosine)", lr);
  row("seed", s(o.seed));
  row("data", data.source);
  row("train / val tokens", s(data.train.size()) + " / " + s(data.val.size()));
  printf("+------------------------+----------------------------------------------------+\n");
}
