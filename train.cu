// train.cu: the entry point. Parses and validates the flags, builds the model, optimizer and
// data, runs the training loop (gradient accumulation, clipping, AdamW, logging), and the
// side jobs: validation, checkpoints, --save-grads, --score and --sample.
// Launch like torchrun: `./train ...` is one rank, `mpirun -np N ./train ...` is N ranks.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <map>

#include "checkpoint.cuh"
#include "core.cuh"
#include "data.cuh"
#include "model.cuh"
#include "ops.cuh"
#include "optimizer.cuh"

struct Options {
  ModelConfig model;
  std::string preset = "tiny", device = "auto", recompute = "none";
  int steps = 100, stop_after = 0, mbs = 16, grad_acc = 1, warmup = 20, val_every = 50, val_seqs = 64;
  float lr = 2e-3f, min_lr = -1.0f, weight_decay = 0.1f, grad_clip = 1.0f;
  float val_frac = 0.1f, temperature = 0.8f;
  uint64_t seed = 1337;
  std::string data, save, load, log_json, save_grads, score, prompt = "\n";
  int sample = 0;
};

// ----------------------------------------------------------------------------
// Flags

// Model-shape flags: applied over the preset, or checked against a loaded checkpoint.
using IntField = int ModelConfig::*;
struct ShapeFlag {
  const char* flag;
  IntField field;
  CLI::Option* opt;
};

static void add_flags(CLI::App& app, Options& o, std::vector<ShapeFlag>& shape) {
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
}

static void check_positive(int value, const char* flag) {
  if (value <= 0) throw UsageError(std::string(flag) + " " + std::to_string(value) + ": must be > 0");
}

// Builds the model config (preset, flags, or checkpoint) and checks every flag. Runs the same
// on every rank before anything is allocated.
static void resolve_options(Options& o, const std::vector<ShapeFlag>& shape) {
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
}

static void print_config(const Options& o, const Dataset& data, Device device, int64_t n_params) {
  const ModelConfig& c = o.model;
  auto row = [](const char* k, const std::string& v) { printf("| %-22s | %-40s |\n", k, v.c_str()); };
  auto s = [](auto v) { return std::to_string(v); };
  printf("+------------------------+------------------------------------------+\n");
  row("model", c.preset + (o.load.empty() ? "" : " (from " + o.load + ")"));
  row("d_model / layers", s(c.d_model) + " / " + s(c.layers));
  row("heads / kv heads / hd", s(c.heads) + " / " + s(c.kv_heads) + " / " + s(c.head_dim()));
  row("ffn / vocab / seq", s(c.ffn) + " / " + s(c.vocab) + " / " + s(c.seq));
  row("tied embeddings", c.tie_embeddings ? "yes" : "no");
  row("parameters", s(n_params) + " (closed form " + s(parameter_count(c)) + ")");
  row("device", device_name(device));
  row("recompute", o.recompute);
  row("steps / mbs / grad-acc", s(o.steps) + " / " + s(o.mbs) + " / " + s(o.grad_acc));
  row("tokens per step", s((int64_t)o.mbs * o.grad_acc * c.seq));
  char lr[96];
  snprintf(lr, sizeof lr, "%.2e -> %.2e, warmup %d, wd %.3g, clip %.3g", o.lr, o.min_lr,
           o.warmup, o.weight_decay, o.grad_clip);
  row("lr schedule (cosine)", lr);
  row("seed", s(o.seed));
  row("data", data.source);
  row("train / val tokens", s(data.train.size()) + " / " + s(data.val.size()));
  printf("+------------------------+------------------------------------------+\n");
}

// ----------------------------------------------------------------------------
// Evaluation

// Mean cross-entropy (nats) over `windows` windows of seq + 1 tokens; window w starts at
// token w * stride (stride seq: the validation windows; seq + 1: disjoint windows for --score).
static double mean_loss(const Context& ctx, const Model& model, const std::vector<int32_t>& tokens,
                        int64_t windows, int seq, int64_t stride, int mbs) {
  std::vector<int32_t> in((size_t)mbs * seq), tgt((size_t)mbs * seq);
  double total = 0;
  for (int64_t w = 0; w < windows; w += mbs) {
    int n = (int)std::min<int64_t>(mbs, windows - w);
    for (int i = 0; i < n; i++) {
      const int32_t* src = tokens.data() + (w + i) * stride;
      std::copy(src, src + seq, in.begin() + (size_t)i * seq);
      std::copy(src + 1, src + seq + 1, tgt.begin() + (size_t)i * seq);
    }
    Activations acts;
    total += model_forward(ctx, model, acts, in.data(), tgt.data(), n, seq, Recompute::None);
  }
  return total / ((double)windows * seq);
}

static double unigram_entropy(const std::vector<int32_t>& tokens, int vocab) {
  std::vector<double> counts(vocab, 0.0);
  for (int32_t t : tokens) counts[t] += 1;
  double h = 0;
  for (double c : counts)
    if (c > 0) h -= c / tokens.size() * std::log(c / tokens.size());
  return h;
}

static std::string generate(const Context& ctx, const Model& model, const Options& o) {
  std::vector<int32_t> tokens(o.prompt.begin(), o.prompt.end());
  if (tokens.empty()) tokens.push_back('\n');
  uint64_t key = rng_key(o.seed, "sample");
  std::string out;
  int V = model.cfg.vocab;
  for (int i = 0; i < o.sample; i++) {
    int T = (int)std::min<size_t>(tokens.size(), model.cfg.seq);
    Activations acts;
    model_forward(ctx, model, acts, tokens.data() + tokens.size() - T, nullptr, 1, T,
                  Recompute::None);
    std::vector<float> logits = to_host_floats(acts.logits.view((int64_t)(T - 1) * V, {V}));
    float mx = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (float& l : logits) z += (l = std::exp((l - mx) / o.temperature));
    double r = rng_uniform(key, i) * z;
    int next = V - 1;
    for (int v = 0; v < V; v++)
      if ((r -= logits[v]) < 0) { next = v; break; }
    tokens.push_back(next);
    out += (char)(next < 256 ? next : '?');
  }
  return out;
}

static void print_memory(const Model& model) {
  MemoryStats m = memory_stats();
  printf("memory (peak / now):\n");
  for (int i = 0; i < (int)Mem::Count; i++)
    printf("  %-12s %12s / %s\n", mem_name((Mem)i), human_bytes(m.peak[i]).c_str(),
           human_bytes(m.current[i]).c_str());
  size_t stat = m.current[(int)Mem::Params] + m.current[(int)Mem::Grads] +
                m.current[(int)Mem::Optimizer];
  printf("  static (params + grads + optimizer) = %s = %.2f bytes/parameter "
         "(Playbook §2.4, fp32: 16)\n",
         human_bytes(stat).c_str(), (double)stat / model.params.numel());
}

// ----------------------------------------------------------------------------
// Training

static int run(Options& o) {
  Device device = resolve_device(o.device);
  Context ctx = Context::create(device);
  Recompute recompute = parse_recompute(o.recompute);
  const ModelConfig& c = o.model;

  if (!o.score.empty()) {  // score a file with a loaded model, then exit
    Model model = build_model(c, device, o.seed);
    load_checkpoint(o.load, model.named_params, nullptr);
    std::vector<int32_t> tokens = read_tokens(o.score);
    int64_t windows = (int64_t)tokens.size() / (c.seq + 1);
    if (windows == 0)
      throw UsageError("--score " + o.score + ": " + std::to_string(tokens.size()) +
                       " tokens, fewer than one window of --seq + 1 = " + std::to_string(c.seq + 1));
    for (int32_t t : tokens)
      if (t >= c.vocab) throw UsageError("--score " + o.score + ": token " + std::to_string(t) +
                                         " is outside the vocabulary " + std::to_string(c.vocab));
    printf("loss: %.6f\n", mean_loss(ctx, model, tokens, windows, c.seq, c.seq + 1, o.mbs));
    return 0;
  }

  Dataset data = load_dataset(o.data, o.val_frac, c.seq);
  check_vocab(data, c.vocab);
  Model model = build_model(c, device, o.seed);
  Optimizer opt = build_optimizer(model, AdamWConfig{}, o.weight_decay);
  if (!o.load.empty()) {
    OptimizerState state{opt.named_exp_avg, opt.named_exp_avg_sq, 0};
    if (load_checkpoint(o.load, model.named_params, &state)) opt.step = state.step;
  }
  print_config(o, data, device, model.params.numel());
  printf("unigram entropy of the training tokens: %.4f nats (a model that ignores context)\n",
         unigram_entropy(data.train, c.vocab));

  std::ofstream log_json;
  if (!o.log_json.empty()) {
    log_json.open(o.log_json);
    if (!log_json) throw UsageError("--log-json " + o.log_json + ": cannot open for writing");
  }
  LrSchedule schedule{o.lr, o.min_lr, o.warmup, o.steps};
  int64_t global_batch = (int64_t)o.mbs * o.grad_acc;  // sequences per step
  int64_t val_windows = std::min<int64_t>(o.val_seqs, num_val_windows(data, c.seq));
  std::vector<int32_t> inputs(global_batch * c.seq), targets(global_batch * c.seq);
  // Each micro-batch's gradient is scaled so that their sum is the gradient of the mean loss
  // over every token of the global batch (DESIGN 5).
  float loss_scale = 1.0f / (float)(global_batch * c.seq);

  int64_t end = o.stop_after > 0 ? std::min<int64_t>(o.steps, opt.step + o.stop_after) : o.steps;
  for (int64_t step = opt.step; step < end; step++) {
    double t0 = now_seconds();
    fill_train_batch(data, step, global_batch, 0, (int)global_batch, c.seq, inputs.data(),
                     targets.data());
    zero_(model.grads);
    double loss_sum = 0;
    for (int micro = 0; micro < o.grad_acc; micro++) {  // Playbook §2.7 gradient accumulation
      size_t first = (size_t)micro * o.mbs * c.seq;
      Activations acts;
      loss_sum += model_forward(ctx, model, acts, inputs.data() + first, targets.data() + first,
                                o.mbs, c.seq, recompute);
      model_backward(ctx, model, acts, loss_scale, recompute);
    }
    float loss = (float)(loss_sum / (global_batch * c.seq));
    if (!std::isfinite(loss)) {
      fprintf(stderr, "error: loss is %f at step %lld; lower --lr or check the data\n", loss,
              (long long)step);
      return 3;
    }
    if (step == opt.step && !o.save_grads.empty())
      write_safetensors(o.save_grads, model.named_grads, {{"step", std::to_string(step)}});
    float norm = clip_grad_norm(ctx, model.grads, o.grad_clip);
    float lr = learning_rate(schedule, step);
    optimizer_step(ctx, model, opt, lr);
    ctx.synchronize();
    double dt = now_seconds() - t0;
    double tok_s = global_batch * c.seq / dt;
    printf("step %5lld/%d | loss %.4f | lr %.2e | norm %.4f | %8.0f tok/s | %7.1f ms\n",
           (long long)step + 1, o.steps, loss, lr, norm, tok_s, dt * 1e3);
    if (log_json.is_open())
      log_json << nlohmann::json{{"step", step + 1}, {"loss", loss}, {"lr", lr},
                                 {"grad_norm", norm}, {"tokens_per_s", tok_s}}
                      .dump()
               << "\n" << std::flush;
    bool last = step + 1 == end;
    if (val_windows > 0 && (last || (o.val_every > 0 && (step + 1) % o.val_every == 0)))
      printf("step %5lld/%d | val loss %.4f\n", (long long)step + 1, o.steps,
             mean_loss(ctx, model, data.val, val_windows, c.seq, c.seq, o.mbs));
    fflush(stdout);
  }
  if (!o.save.empty()) {
    OptimizerState state{opt.named_exp_avg, opt.named_exp_avg_sq, opt.step};
    save_checkpoint(o.save, c, model.named_params, &state);
    printf("saved %s (config.json, model.safetensors, optimizer.safetensors)\n", o.save.c_str());
  }
  print_memory(model);
  if (o.sample > 0) printf("sample:\n%s%s\n", o.prompt.c_str(), generate(ctx, model, o).c_str());
  ctx.destroy();
  return 0;
}

int main(int argc, char** argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  CLI::App app{"picoscale: train a tiny Llama, the Ultra-Scale Playbook way"};
  Options o;
  std::vector<ShapeFlag> shape;
  add_flags(app, o, shape);
  int code = 0;
  try {
    app.parse(argc, argv);
    if (world != 1)
      throw UsageError("this build trains on one process; run ./train without mpirun");
    resolve_options(o, shape);
    code = run(o);
  } catch (const CLI::CallForHelp&) {
    if (rank == 0) std::cout << app.help();
  } catch (const CLI::ParseError& e) {
    if (rank == 0) fprintf(stderr, "error: %s\nRun ./train --help for every flag.\n", e.what());
    code = 2;
  } catch (const UsageError& e) {
    if (rank == 0) fprintf(stderr, "error: %s\n", e.what());
    code = 2;
  }
  fflush(stdout);
  MPI_Finalize();
  return code;
}
