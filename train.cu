// train.cu: the entry point. Reads top-down as one training step flows (DESIGN 7): the flags
// (options.cu), the process grid, the data, the model, the gradient sync the flags choose; then
// per step: the batch, the schedule of its micro-batches, the sync, clipping, the optimizer
// step, the log. Around it: validation, checkpoints, --save-grads, --score, --sample, --trace
// and the reports. Launch like torchrun: `./train` is one rank, `mpirun -np N ./train` N ranks.
#include <cblas.h>
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "context_parallel.cuh"
#include "data_parallel.cuh"
#include "expert_parallel.cuh"
#include "mixed_precision.cuh"
#include "model.cuh"
#include "pipeline_parallel.cuh"
#include "planner/pipeline_timing.cuh"
#include "planner/planner.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/comm.cuh"
#include "runtime/data.cuh"
#include "runtime/formulas.cuh"
#include "runtime/observe.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"
#include "tensor_parallel.cuh"
#include "zero.cuh"

// ----------------------------------------------------------------------------
// The command line: the run's flags (runtime/options.cuh) and each chapter's, each checked
// next to its code, then what only the composition knows: how they combine.

struct Options : RunOptions,
                 ModelOptions,
                 AttentionOptions,
                 PrecisionOptions,
                 DataParallelOptions,
                 ZeroOptions,
                 TensorParallelOptions,
                 PipelineOptions,
                 ContextParallelOptions,
                 ExpertOptions {};

static void add_flags(CLI::App& app, Options& o) {
  // A flag given twice takes its last value, so a script can append overrides.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  add_run_flags(app, o);  // in the book's order
  add_model_flags(app, o);
  add_data_parallel_flags(app, o);
  add_zero_flags(app, o);
  add_tensor_parallel_flags(app, o);
  add_context_parallel_flags(app, o);
  add_pipeline_flags(app, o);
  add_expert_flags(app, o, o);
  add_attention_flags(app, o);
  add_precision_flags(app, o);
  add_io_flags(app, o);
  check_number_text(app);
}

// The same on every rank, before anything is allocated; UsageError names the flag and the fix.
static void resolve_options(Options& o) {
  const int64_t world = (int64_t)o.dp * o.pp * o.cp * o.tp;
  resolve_run_options(o, (int)std::min<int64_t>(world, INT32_MAX));
  check_positive(o.dp, "--dp");
  validate_context_parallel(o.model.seq, o.cp, o.cp_balance, o.attention == AttentionKind::Flash,
                            o.tp, o.sp, o.sample);
  validate_pipeline(o.model.layers, o.pp, o.pp_virtual, o.grad_acc, o.pp_schedule,
                    o.model.tie_embeddings, o.zero);
  validate_tensor_parallel(o.model, o.tp, o.sp);
  validate_expert_parallel(o.model, o, o.dp, o.cp);
  if (!o.gpu.empty()) gpu_profile(o.gpu);  // an unknown profile names the known ones
}

// ZeRO shards over the dp x cp ranks; with one there is nothing to shard, and --zero k is the
// plain run (make_gradient_sync says so).
static int zero_stage(const Options& o) {
  return o.dp * o.cp > 1 ? o.zero : 0;
}

// The closed forms, per rank (runtime/formulas.cuh, model.cu): weights, gradients and Adam's
// m and v over tp and ZeRO's shards, the saved activations of every block of one micro-batch,
// and the logits with their gradient. Collective (node-local ranks share the device).
static void check_before_start(const Options& o, const Comm& comm,
                               const PrecisionPolicy& precision) {
  int local = 0, local_ranks = 1;
  local_rank(&local, &local_ranks, comm.timeout_s);  // collective: before anything that may throw
  const ModelConfig& c = o.model;
  // The closed forms are int64: guard them against sizes whose bytes would overflow.
  double rough = (double)c.layers * c.d_model * ((double)c.d_model + c.ffn) +
                 (double)c.vocab * c.d_model +
                 (double)c.layers * o.mbs * c.seq * ((double)c.heads * c.seq + c.d_model + c.ffn);
  if (rough > 1e17) check_memory_fits(rough, 0, comm.device, local_ranks);
  check_step_tokens_fit(o, local_ranks);
  const bool train = o.score.empty();
  // Each rank holds its tp shard of every weight, of the experts only its ep rank's.
  const double psi =
      ((double)parameter_count(c) - (double)expert_parameter_count(c) * (o.ep - 1) / o.ep) / o.tp;
  const int n = o.dp * o.cp, stage = zero_stage(o);
  double state = 4 * psi;  // --score: the fp32 weights
  if (train) {
    StaticMemory m = zero_static_memory(
        stage, psi, n, bytes_per_parameter(precision.compute(), precision.grads() == DType::BF16));
    // Mixed precision: the fp32 master weights sit with the optimizer's 12 bytes; ZeRO-1/2
    // hold the whole compute-format weights, ZeRO-3 its shard of them.
    state = m.total();
  }
  const int e = train ? (int)dtype_size(precision.weight_format()) : 4;
  double acts =
      (double)c.layers * activation_bytes_per_block(c, o.mbs, c.seq, o.tp, o.sp, o.recompute,
                                                    *local_attention(o.attention), e) +
      2.0 * o.mbs * c.seq * (c.vocab / o.tp) * 4;
  check_memory_fits(state, acts, comm.device, local_ranks);
  check_outputs(o, comm);
}

// The table rank 0 prints before the first step: the run's own rows, and each chapter's (a
// chapter with nothing to say about this run gives an empty row, which is left out).
static void print_config(const Options& o, const Dataset& data, const Comm& comm, int64_t n_params,
                         const GradientSync& sync, const PrecisionPolicy& precision) {
  const ModelConfig& c = o.model;
  auto s = [](auto v) { return std::to_string(v); };
  std::vector<std::pair<std::string, std::string>> rows = {
      {"model", c.preset + (o.load.empty() ? "" : " (from " + o.load + ")")},
      {"d_model / layers", s(c.d_model) + " / " + s(c.layers)},
      {"heads / kv heads / hd", s(c.heads) + " / " + s(c.kv_heads) + " / " + s(c.head_dim())},
      {"ffn / vocab / seq", s(c.ffn) + " / " + s(c.vocab) + " / " + s(c.seq)},
      {"tied embeddings", c.tie_embeddings ? "yes" : "no"},
      {"parameters", s(n_params) + " (closed form " + s(parameter_count(c)) + ")"},
      {"device / backend", std::string(device_name(comm.device)) + " / " +
                               backend_name(comm.backend) +
                               (o.sync_launches ? ", sync after every kernel" : "")},
      {"grid dp x pp x cp x tp", s(o.dp) + " x " + s(o.pp) + " x " + s(o.cp) + " x " + s(o.tp) +
                                     " = " + s(comm.grid.world_size) + " ranks" +
                                     describe_tensor_parallel(o)},
      {"context parallel", describe_context_parallel(o, c.seq)},
      {"mixture of experts", describe_experts(c, o)},
      {"pipeline", describe_pipeline(o, o.grad_acc)},
      {"gradient sync", sync.describe()},
      {"dtype", precision.describe()},
      {"attention", describe_attention(o.attention)},
      {"recompute", describe_recompute(o.recompute, *local_attention(o.attention))},
      {"steps / mbs / grad-acc", s(o.steps) + " / " + s(o.mbs) + " / " + s(o.grad_acc)},
      {"tokens per step",
       s((int64_t)o.mbs * o.grad_acc * o.dp * c.seq) + " (mbs x grad-acc x dp x seq)"}};
  char lr[96];
  snprintf(lr, sizeof lr, "%.2e -> %.2e, warmup %d, wd %.3g, clip %.3g", o.lr, o.min_lr, o.warmup,
           o.weight_decay, o.grad_clip);
  rows.push_back({"lr schedule (cosine)", lr});
  rows.push_back({"seed", s(o.seed)});
  rows.push_back({"data", data.source});
  rows.push_back({"train / val tokens", s(data.train.size()) + " / " + s(data.val.size())});
  rows.push_back(
      {"data order", o.no_shuffle ? "file order (--no-shuffle)" : "shuffled per epoch (--seed)"});
  rows.erase(std::remove_if(rows.begin(), rows.end(), [](auto& row) { return row.second.empty(); }),
             rows.end());
  print_config_table(rows);
}

// ----------------------------------------------------------------------------
// Evaluation

// Sum of per-token cross-entropies over windows [first, first + count) of seq + 1 tokens;
// window w starts at token w * stride (stride seq: validation; seq + 1: disjoint, --score).
// Under context parallelism each rank runs its share of every window's tokens.
static double loss_sum(const Context& ctx, Comm& comm, Model& model, const ContextParallel& cp,
                       PpSchedule schedule, const std::vector<int32_t>& tokens, int64_t first,
                       int64_t count, int seq, int64_t stride, int mbs) {
  std::vector<int32_t> in((size_t)mbs * seq), tgt((size_t)mbs * seq);
  double total = 0;
  for (int64_t w = first; w < first + count; w += mbs) {
    int n = (int)std::min<int64_t>(mbs, first + count - w);
    for (int i = 0; i < n; i++) {
      const int32_t* src = tokens.data() + (w + i) * stride;
      std::copy(src, src + seq, in.begin() + (size_t)i * seq);
      std::copy(src + 1, src + seq + 1, tgt.begin() + (size_t)i * seq);
    }
    Activations acts;
    std::vector<int32_t> my_in = select_context_tokens(cp, in.data(), n, seq);
    std::vector<int32_t> my_tgt = select_context_tokens(cp, tgt.data(), n, seq);
    total += pipeline_forward(ctx, comm, model, acts, my_in.data(), my_tgt.data(), n,
                              seq / cp.size(), schedule);
  }
  return total;
}

// Mean loss over `windows` windows, the windows split evenly over the dp ranks (every rank
// holds the same weights), each window's tokens over the cp ranks, and the sums added up (over
// pp too: the last stage holds the loss), each counted once (evaluation_share: a mixture's
// expert-parallel ranks run the same windows).
static double mean_loss(const Context& ctx, Comm& comm, Model& model, const ContextParallel& cp,
                        PpSchedule schedule, const std::vector<int32_t>& tokens, int64_t windows,
                        int seq, int64_t stride, int mbs) {
  const EvaluationShare share = evaluation_share(comm);
  int64_t first = windows * share.index / share.count,
          last = windows * (share.index + 1) / share.count;
  double total =
      loss_sum(ctx, comm, model, cp, schedule, tokens, first, last - first, seq, stride, mbs);
  if (!share.counts) total = 0;
  all_reduce_host(comm.dp_cp, &total, 1, ReduceOp::Sum);
  all_reduce_host(comm.pp, &total, 1, ReduceOp::Sum);
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

// The next token after the logits of the last position [V/tp] (the rank's vocabulary slice):
// all-gathered over tp in vocabulary order, then drawn at the temperature.
static int sample_token(const Context& ctx, Comm& comm, const Tensor& logits_row, int V,
                        double uniform, float temperature) {
  Tensor all = empty({V}, Mem::Workspace, ctx.device);
  Tensor row = cast_to(ctx, logits_row, DType::F32);  // (16 bits under bf16 and fp16)
  all_gather(comm, comm.tp, ctx, row.f32(), all.f32(), row.numel());
  std::vector<float> logits = to_host_floats(all);
  float mx = *std::max_element(logits.begin(), logits.end());
  double z = 0;
  for (float& l : logits) z += (l = std::exp((l - mx) / temperature));
  double r = uniform * z;
  for (int v = 0; v < V; v++)
    if ((r -= logits[v]) < 0) return v;
  return V - 1;
}

// Every rank runs it (tensor-parallel ranks each hold a slice of the logits, the last pipeline
// stage draws the token and tells the others); rank 0 prints.
static std::string generate(const Context& ctx, Comm& comm, const Model& sharded,
                            const Options& o) {
  Model model = sharded;  // the same weights without sequence parallelism: any prompt length
  model.tp.sp = false;
  std::vector<int32_t> tokens(o.prompt.begin(), o.prompt.end());
  if (tokens.empty()) tokens.push_back('\n');
  uint64_t key = rng_key(o.seed, "sample");
  std::string out;
  int V = model.cfg.vocab;
  for (int i = 0; i < o.sample; i++) {
    int T = (int)std::min<size_t>(tokens.size(), model.cfg.seq);
    Activations acts;
    pipeline_forward(ctx, comm, model, acts, tokens.data() + tokens.size() - T, nullptr, 1, T,
                     o.pp_schedule);
    double next = -1;  // drawn where the head is, then shared over pp (max of -1 and it)
    if (model.head_unit() >= 0) {
      int Vl = model.tp.local.vocab;
      next = sample_token(ctx, comm, acts.logits.view((int64_t)(T - 1) * Vl, {Vl}), V,
                          rng_uniform(key, i), o.temperature);
    }
    all_reduce_host(comm.pp, &next, 1, ReduceOp::Max);
    tokens.push_back((int32_t)next);
    out += (char)(next < 256 ? (int)next : '?');
  }
  return out;
}

// ----------------------------------------------------------------------------
// Training

// Runs fn on every rank; when it throws a UsageError on some ranks (a file only rank 0 writes,
// say), every rank throws that message, so no rank is left waiting for one that stopped.
// fn's own collectives must come before anything that can fail on one rank only.
static void all_or_none(Comm& comm, const std::function<void()>& fn) {
  agree_on_error(comm.world, fn);
}

// The gradient sync the flags choose (Playbook §3, §4): ZeRO-k over the dp_cp group, or plain
// data parallelism. It allocates the model's memory and initialises the weights.
static std::unique_ptr<GradientSync> make_gradient_sync(Comm& comm, Model& model, Context& ctx,
                                                        const Options& o,
                                                        const PrecisionPolicy& precision) {
  if (o.zero > zero_stage(o) && comm.grid.prints())
    fprintf(stderr,
            "warning: --zero %d has no effect with one data-parallel rank (dp x cp = 1): "
            "nothing to shard; running as --zero 0\n",
            o.zero);
  if (zero_stage(o) > 0)
    return std::make_unique<Zero>(comm, model, zero_stage(o), AdamWConfig{}, o.weight_decay, o.seed,
                                  !o.no_overlap, precision);
  return std::make_unique<DataParallel>(comm, model, ctx, o, AdamWConfig{}, o.weight_decay, o.seed,
                                        precision);
}

// Evaluation reads the whole model: ZeRO-3 gathers it for the duration.
static void with_whole_model(GradientSync& sync, const Context& ctx,
                             const std::function<void()>& body) {
  sync.gather_weights(ctx);
  body();
  sync.release_weights();
}

// How the cp group splits each sequence (Playbook §7): this rank's tokens.
static ContextParallel context_parallel(Comm& comm, const Options& o) {
  return ContextParallel{&comm, o.cp_balance, o.cp_comm};
}

// This rank's part of the model (its tp slice, its pipeline stage or chunks) as a layout, with
// its attention core: ring or all-gather attention over the cp group, or one rank's own.
static Model model_layout(Comm& comm, const Options& o) {
  Model model = build_model_layout(
      o.model, TensorParallel{&comm, o.sp},
      pipeline_chunks(o.model.layers, o.pp, o.pp_virtual, comm.grid.pp_rank, o.pp_schedule),
      ExpertParallel{&comm, o.capacity_factor});
  model.attention = make_attention(comm, o, o.attention);
  model.seed = o.seed;  // dropout's masks
  return model;
}

static int score_file(Context& ctx, Comm& comm, const Options& o) {
  const ModelConfig& c = o.model;
  Model model = model_layout(comm, o);
  // Scoring reads the fp32 weights of the checkpoint as they are.
  std::unique_ptr<GradientSync> sync = make_gradient_sync(comm, model, ctx, o, PrecisionPolicy{});
  sync->load(o.load);
  std::vector<int32_t> tokens = read_tokens(o.score);
  int64_t windows = (int64_t)tokens.size() / (c.seq + 1);
  if (windows == 0)
    throw UsageError("--score " + o.score + ": " + std::to_string(tokens.size()) +
                     " tokens, fewer than one window of --seq + 1 = " + std::to_string(c.seq + 1));
  for (int32_t t : tokens)
    if (t >= c.vocab)
      throw UsageError("--score " + o.score + ": token " + std::to_string(t) +
                       " is outside the vocabulary " + std::to_string(c.vocab));
  double loss = 0;
  with_whole_model(*sync, ctx, [&] {
    loss = mean_loss(ctx, comm, model, context_parallel(comm, o), o.pp_schedule, tokens, windows,
                     c.seq, c.seq + 1, o.mbs);
  });
  if (comm.grid.prints()) printf("loss: %.6f\n", loss);
  return 0;
}

// What the loop needs besides the model: the data, this rank's share of each step's batch, the
// log, and the meters that measure the steps for the reports.
struct Trainer {
  const Options& o;
  Comm& comm;
  const Context& ctx;
  Model& model;
  GradientSync& sync;
  const Dataset& data;
  Recompute recompute;
  LrSchedule schedule;
  PipelineConfig pipeline;
  int64_t rank_batch, global_batch;      // sequences: mbs x grad_acc on this rank; x dp in the step
  int first_seq;                         // this dp rank's first sequence of the global batch
  std::vector<int32_t> inputs, targets;  // this rank's sequences, whole
  std::vector<int32_t> my_inputs, my_targets;  // and its share of their tokens (cp)
  ContextParallel cp;                          // which tokens those are
  OutputLines log_json;
  nlohmann::json log_line;  // this step's --log-json line, written once validation has run
  Observer observer;        // the trace, --fault, and what the schedule measured
  StepMeters meters;        // what the steps measure for the reports (register_meters)
  int64_t steps_run = 0;
  PrecisionPolicy precision;                // --dtype: the loss scale, what the log adds
  DevicePeak peak;                          // rank 0: the FLOP rate MFU divides by (planner.cuh)
  const RooflineMeter* roofline = nullptr;  // --report roofline, or the meta device's step time
};

// This rank's micro-batches of the step: its dp share of the global batch (DESIGN 5), and of
// each sequence its cp share of the tokens (Playbook §7).
static StepBatch local_batch(Trainer& t, int64_t step) {
  const Options& o = t.o;
  const int seq = o.model.seq;
  fill_train_batch(t.data, step, t.global_batch, t.first_seq, (int)t.rank_batch, seq,
                   t.inputs.data(), t.targets.data(), !o.no_shuffle, o.seed);
  t.my_inputs = select_context_tokens(t.cp, t.inputs.data(), o.mbs, seq, o.grad_acc);
  t.my_targets = select_context_tokens(t.cp, t.targets.data(), o.mbs, seq, o.grad_acc);
  return StepBatch{t.my_inputs.data(), t.my_targets.data(),
                   o.grad_acc,         o.mbs,
                   seq / t.cp.size(),  step * t.global_batch + t.first_seq};
}

// The step's line on rank 0 (and its --log-json line): loss, what the meters add, lr, norm,
// throughput, MFU (Playbook §2.6: the book's FLOPs per token over the rank's peak), time. On the
// meta device loss and norm are absent and the time is the roofline's prediction.
static void print_step(Trainer& t, int64_t step, std::optional<float> loss, const StepLog& log,
                       float lr, float norm, double measured) {
  if (!t.comm.grid.prints()) return;
  const Options& o = t.o;
  const double seconds = t.roofline ? t.roofline->step_seconds(measured) : measured;
  double tok_s = t.global_batch * o.model.seq / seconds, per_rank = tok_s / t.comm.grid.world_size;
  double mfu = book_flops_per_token(o.model) * per_rank / t.peak.flops;
  char loss_text[32] = "-", norm_text[32] = "-";
  if (loss) snprintf(loss_text, sizeof loss_text, "%.4f", *loss);
  if (loss) snprintf(norm_text, sizeof norm_text, "%.4f", norm);
  printf(
      "step %5lld/%d | loss %s%s | lr %.2e | norm %s | %8.0f tok/s | %7.0f tok/s/rank | "
      "MFU %5.1f%% | %7.1f ms%s\n",
      (long long)step + 1, o.steps, loss_text, log.after_loss.c_str(), lr, norm_text, tok_s,
      per_rank, 100 * mfu, seconds * 1e3,
      loss ? t.precision.step_note().c_str() : " (meta: predicted, nothing computed)");
  if (!t.log_json.is_open()) return;
  nlohmann::json line{{"step", step + 1},
                      {"loss", loss ? nlohmann::json(*loss) : nlohmann::json(nullptr)},
                      {"lr", lr},
                      {"grad_norm", loss ? nlohmann::json(norm) : nlohmann::json(nullptr)},
                      {"tokens_per_s", tok_s},
                      {"tokens_per_s_per_rank", per_rank},
                      {"mfu", mfu}};
  line.update(log.fields);
  if (loss) t.precision.log_step(t.ctx, line);
  t.log_line = line;
}

// The step's loss, the mean over every token of the global batch (DESIGN 5): each rank's sum
// added over dp_cp and pp (the last stage holds it); and what the meters add to the step's log
// (a mixture's load-balancing loss, apart from the loss). Rank 0 says when it is not finite.
// Absent on the meta device, which computes nothing.
static std::optional<float> mean_step_loss(Trainer& t, double loss_sum, int64_t step,
                                           StepLog& log) {
  all_reduce_host(t.comm.dp_cp, &loss_sum, 1, ReduceOp::Sum);
  all_reduce_host(t.comm.pp, &loss_sum, 1, ReduceOp::Sum);
  const float loss = (float)(loss_sum / (t.global_batch * t.o.model.seq));
  t.meters.log(log);
  if (t.ctx.device == Device::Meta) return std::nullopt;
  if (!std::isfinite(loss) && t.comm.grid.prints())
    fprintf(stderr, "error: loss is %f at step %lld; lower --lr or check the data\n", loss,
            (long long)step + 1);
  return loss;
}

// One optimizer step (DESIGN 7). Returns false when the loss is not finite.
static bool train_step(Trainer& t, int64_t step) {
  const Options& o = t.o;
  t.observer.at(FaultWhere::Step, step);
  const double t0 = now_seconds();
  t.meters.begin(StepPart::Step, step);
  const StepBatch batch = local_batch(t, step);
  t.meters.begin(StepPart::Gradients, step);
  t.sync.begin_step(t.ctx);
  // Each micro-batch's gradient is scaled so that the sum over micro-batches and dp ranks is the
  // gradient of the mean loss over every token of the global batch (DESIGN 5); under fp16 also
  // by the loss scale, divided back before clipping (Playbook §Mixed precision training).
  const float loss_scale = t.precision.loss_scale() / (float)(t.global_batch * o.model.seq);
  t.precision.begin_step();
  t.meters.begin(StepPart::Schedule, step);
  t.observer.begin_schedule(step, true);
  double loss_sum = run_schedule(t.ctx, t.comm, t.model, t.sync, batch, t.recompute, loss_scale,
                                 t.pipeline, t.observer);
  t.observer.end_schedule();
  t.meters.end(StepPart::Schedule);
  const double tw = t.observer.begin_span("wait for gradients");
  t.sync.finish(t.ctx);
  t.meters.end(StepPart::Gradients);  // --save-grads gathers next: not training traffic
  t.observer.end_span("wait for gradients", Track::Compute, tw);
  StepLog log;
  const std::optional<float> loss = mean_step_loss(t, loss_sum, step, log);
  if (loss && !std::isfinite(*loss)) return false;
  if (t.steps_run == 0 && !o.save_grads.empty())  // whole gradients, before clipping
    all_or_none(t.comm, [&] { t.sync.save_gradients(t.ctx, o.save_grads, step); });
  const double to = t.observer.begin_span("optimizer");
  if (t.observer.injects_inf(step)) t.sync.poison_gradient(t.ctx);
  t.observer.at(FaultWhere::Clip, step);
  t.precision.unscale(t.ctx, t.sync);
  const float norm = t.sync.clip_grad_norm(t.ctx, o.grad_clip);
  const bool take_step = t.precision.keep_step(t.ctx, norm, t.comm.world);
  const float lr = learning_rate(t.schedule, step);
  t.observer.at(FaultWhere::Optimizer, step);
  t.meters.begin(StepPart::Optimizer, step);
  if (take_step) t.sync.step(t.ctx, lr);
  t.meters.end(StepPart::Optimizer);
  t.ctx.synchronize();
  t.observer.end_span("optimizer", Track::Compute, to);
  t.sync.trace_communication(t.observer.trace());
  t.meters.end(StepPart::Step);
  t.steps_run++;
  print_step(t, step, loss, log, lr, norm, now_seconds() - t0);
  return true;
}

static void validate(Trainer& t, int64_t step) {
  t.observer.at(FaultWhere::Validation, step);
  const ModelConfig& c = t.o.model;
  int64_t windows = std::min<int64_t>(t.o.val_seqs, num_val_windows(t.data, c.seq));
  if (windows <= 0) return;
  double val = 0;
  with_whole_model(t.sync, t.ctx, [&] {
    val = mean_loss(t.ctx, t.comm, t.model, t.cp, t.o.pp_schedule, t.data.val, windows, c.seq,
                    c.seq, t.o.mbs);
  });
  const bool absent = t.ctx.device == Device::Meta;  // the meta device computes nothing
  if (t.comm.grid.prints() && absent)
    printf("step %5lld/%d | val loss -\n", (long long)step + 1, t.o.steps);
  else if (t.comm.grid.prints())
    printf("step %5lld/%d | val loss %.4f\n", (long long)step + 1, t.o.steps, val);
  t.log_line["val_loss"] = absent ? nlohmann::json(nullptr) : nlohmann::json(val);
}

// What --report roofline needs of the run besides the ledger: the model, the batch, this rank's
// parameters and the bytes of what it stores (the minimum traffic's terms).
static RooflineRun roofline_run(const Trainer& t) {
  const Options& o = t.o;
  const ModelConfig& c = o.model;
  RooflineRun r;
  r.model = c, r.precision = t.precision.compute();
  r.tokens_per_step = t.global_batch * c.seq, r.world = t.comm.grid.world_size;
  r.grad_acc = o.grad_acc, r.blocks = t.model.blocks_held(), r.params = t.model.num_params;
  r.weight_bytes = (int)dtype_size(t.precision.weight_format());
  r.grad_bytes = (int)dtype_size(t.precision.grads()), r.mixed = t.precision.mixed();
  const int T = c.seq / o.cp;
  r.activation_bytes =
      r.blocks * activation_bytes_per_block(c, o.mbs, T, o.tp, o.sp, t.recompute,
                                            *local_attention(o.attention), r.weight_bytes,
                                            (int)dtype_size(t.precision.residual()));
  const int64_t logits = 2 * (int64_t)o.mbs * T * (c.vocab / o.tp) * 4;  // and their gradient
  r.logit_bytes = t.model.head_unit() >= 0 ? logits : 0;
  return r;
}

// What the steps measure, registered once (runtime/meters.cuh), in the order each report prints
// its parts: the collectives of every group, the precision's bytes per parameter, the gradient
// sync's memory and traffic, the feed-forward's (a mixture's routing), the block's activations,
// tp's traffic, the pipeline's bubble, the attention's (the ring's balance), host syncs.
static void register_meters(Trainer& t) {
  const Options& o = t.o;
  Comm& comm = t.comm;
  const bool main_rank = comm.grid.prints();
  const int64_t n_params = t.model.num_params;  // on this rank: the whole model over tp
  const bool bf16_grads = t.precision.grads() == DType::BF16;
  t.meters.add(std::make_unique<HostSyncs>(t.observer, main_rank, t.ctx.device != Device::CPU));
  t.meters.add(Report::Comm, [&t, n_params] {
    print_comm_report(t.comm, n_params, t.steps_run, t.model.expert_params());
  });
  t.meters.add(Report::Memory, [&t, main_rank, n_params, bf16_grads] {
    if (main_rank)
      print_precision_memory(t.precision.compute(), n_params, t.sync.master_bytes(), bf16_grads);
    print_memory_report(t.comm, t.sync.zero_stage(), n_params, t.sync.padded_params(),
                        t.precision.compute(), bf16_grads);
  });
  auto dp_traffic = std::make_unique<GroupTraffic>(
      comm.dp_cp, std::vector<StepPart>{StepPart::Gradients, StepPart::Optimizer});
  const GroupTraffic& dp = *dp_traffic;
  t.meters.add(std::move(dp_traffic));
  t.meters.add(Report::Comm,
               [&t, &dp] { t.sync.print_comm_report(t.o.grad_acc, dp.total(), t.steps_run); });
  t.meters.add(t.model.mlp->meter(
      t.model, comm,
      RunShape{o.mbs, o.grad_acc, o.dp, o.model.seq / o.cp, t.recompute, t.ctx.precision}));
  t.meters.add(Report::Memory, [&t, main_rank] {
    const int64_t measured = t.observer.schedule().block_bytes;
    if (main_rank && measured >= 0)
      print_activation_report(t.model, t.o.mbs, t.o.model.seq / t.o.cp, t.recompute,
                              (int)dtype_size(t.precision.weight_format()),
                              (int)dtype_size(t.precision.residual()), measured);
    if (main_rank && measured >= 0 && t.ctx.device == Device::Meta)  // the book's sizes
      print_book_memory(t.o.model, t.o.mbs, t.o.model.seq, t.o.tp, t.o.sp, t.recompute,
                        t.model.blocks_held(), measured);
  });
  t.meters.add(tensor_parallel_meter(comm, o.model, o.mbs, o.grad_acc, o.sp));
  t.meters.add(Report::Bubble, [&t] {
    const Options& o = t.o;
    print_bubble_report(t.comm, bubble_prediction(o.pp_schedule, o.pp, o.grad_acc, o.pp_virtual),
                        t.observer.schedule());
  });
  t.meters.add(t.model.attention->meter(comm));
  // The step priced on a device profile (--gpu): --report roofline, and a meta step's time.
  if (o.reports_on(Report::Roofline) || t.ctx.device == Device::Meta) {
    auto roofline =
        std::make_unique<RooflineMeter>(comm, t.ctx, run_profile(t.ctx, o.gpu), roofline_run(t));
    t.roofline = roofline.get();
    t.meters.add(std::move(roofline));
  }
  all_or_none(comm, [&t] { check_reports_answered(t.o, t.meters); });
}

// The training steps this run takes: [first_step, run_end); --steps 0 takes none.
static int64_t run_end(const Options& o, int64_t first_step) {
  if (o.steps == 0) return first_step;
  return o.stop_after > 0 ? std::min<int64_t>(o.steps, first_step + o.stop_after) : o.steps;
}
// Whether a checkpoint is saved after step `step` (counted from 0): the final one, into --save
// DIR, and every --save-every N steps before it, into DIR/checkpoint-<steps done>.
static bool saves_after(const Options& o, int64_t first_step, int64_t step) {
  const int64_t end = run_end(o, first_step);
  return !o.save.empty() && (step == end - 1 || (o.save_every > 0 && step >= first_step &&
                                                 step < end - 1 && (step + 1) % o.save_every == 0));
}

// A checkpoint of whole tensors, whatever the layout, with what an exact resume needs beside
// the optimizer (fp16's loss scale).
static void save_checkpoint_after(Trainer& t, const std::string& dir, int64_t step) {
  t.observer.at(FaultWhere::Save, step);
  all_or_none(t.comm, [&] {
    t.sync.save(t.ctx, dir, t.model.cfg, step + 1, t.o.save_dtype, t.precision.resume_state());
  });
  if (t.comm.grid.prints())
    printf("saved %s (config.json, model.safetensors, optimizer.safetensors)\n", dir.c_str());
}

// Where this run passes, for --fault (check_fault_fires refuses a fault that never fires).
static FaultPlaces fault_places(const Options& o, int world, const PrecisionPolicy& precision) {
  FaultPlaces p;
  p.world = world;
  p.trains = o.score.empty();
  p.first_step = o.first_step, p.end = run_end(o, o.first_step);
  p.validates = [&o, first = p.first_step, end = p.end](int64_t s) {
    return s >= first && s < end &&
           (s + 1 == end || (o.val_every > 0 && (s + 1) % o.val_every == 0));
  };
  if (!o.save.empty()) p.saves = [&o](int64_t s) { return saves_after(o, o.first_step, s); };
  p.precision = precision_name(precision.compute());
  p.skips_overflow = precision.skips_overflow();
  p.schedule = "--steps " + std::to_string(o.steps) +
               (o.stop_after > 0 ? " --stop-after " + std::to_string(o.stop_after) : "") +
               (o.first_step > 0 ? ", resumed at step " + std::to_string(o.first_step) : "");
  return p;
}

// After the last step: the checkpoint, the trace, the reports and the sample.
static void finish_run(Trainer& t, int64_t last_step) {
  const Options& o = t.o;
  bool main_rank = t.comm.grid.prints();
  if (!o.save.empty()) save_checkpoint_after(t, o.save, last_step);
  if (t.observer.trace().enabled) {
    all_or_none(t.comm, [&] { trace_write(t.observer.trace(), o.trace, t.comm.world); });
    if (main_rank)
      printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o.trace.c_str());
  }
  if (t.comm.grid.prints())
    print_memory(t.model.num_params, t.sync.zero_stage(), t.comm.dp_cp.size, t.precision.compute(),
                 t.precision.grads() == DType::BF16);
  t.meters.report(o.reports);
  if (o.sample > 0)
    with_whole_model(t.sync, t.ctx, [&] {
      std::string text = generate(t.ctx, t.comm, t.model, o);
      if (main_rank) printf("sample:\n%s%s\n", o.prompt.c_str(), text.c_str());
    });
}

static int run(const Options& o, Comm& comm, Context& ctx, PrecisionPolicy precision) {
  // Memory, outputs: before any step.
  all_or_none(comm, [&] { check_before_start(o, comm, precision); });
  if (!o.score.empty()) return score_file(ctx, comm, o);
  const ModelConfig& c = o.model;
  bool main_rank = comm.grid.prints();
  Dataset data = load_dataset(o.data, o.val_frac, c.seq);
  check_vocab(data, c.vocab);
  Model model = model_layout(comm, o);
  std::unique_ptr<GradientSync> sync = make_gradient_sync(comm, model, ctx, o, precision);
  std::map<std::string, std::string> run_state;  // fp16's loss scale, when the checkpoint has it
  int64_t first_step = o.load.empty() ? 0 : sync->load(o.load, &run_state);
  if (!o.load.empty())
    precision.resume_from(run_state, first_step, o.load + "/optimizer.safetensors");
  if (main_rank) {
    int64_t laid_out = 0;  // the layout's tensors, against the closed form
    for (const NamedTensor& p : model.named_params) laid_out += p.tensor.numel();
    print_config(o, data, comm, laid_out, *sync, precision);
    printf("unigram entropy of the training tokens: %.4f nats (a model that ignores context)\n",
           unigram_entropy(data.train, c.vocab));
  }
  // The global batch (DESIGN 5): mbs x grad_acc x dp sequences. dp rank d reads the
  // consecutive sequences [d * mbs * grad_acc, (d + 1) * mbs * grad_acc).
  int64_t rank_batch = (int64_t)o.mbs * o.grad_acc;
  Trainer t{o,
            comm,
            ctx,
            model,
            *sync,
            data,
            o.recompute,
            LrSchedule{o.lr, o.min_lr, o.warmup, o.steps},
            PipelineConfig{o.pp_schedule, o.pp_virtual},
            rank_batch,
            rank_batch * o.dp,
            (int)(comm.grid.dp_rank * rank_batch)};
  t.inputs.resize(rank_batch * c.seq), t.targets.resize(rank_batch * c.seq);
  t.cp = context_parallel(comm, o);
  t.observer = Observer(comm.grid.world_rank, o.fault, !o.trace.empty());
  t.precision = precision;
  register_meters(t);
  if (main_rank) {
    t.peak = device_peak(ctx, precision.compute(), o.gpu);
    printf(
        "MFU: the book's 6N + 12 L h s = %.4g FLOPs per token (appendix A2) over %.4g FLOP/s "
        "per rank (%s)\n",
        book_flops_per_token(c), t.peak.flops, t.peak.how.c_str());
    printf("%s", active_parameters_note(c).c_str());
  }
  all_or_none(comm, [&] {
    if (main_rank && !o.log_json.empty()) t.log_json.open("--log-json", o.log_json);
  });

  int64_t end = run_end(o, first_step);
  for (int64_t step = first_step; step < end; step++) {
    if (!train_step(t, step)) return 3;
    if (step + 1 == end || (o.val_every > 0 && (step + 1) % o.val_every == 0)) validate(t, step);
    if (t.log_json.is_open()) t.log_json.write_line(t.log_line.dump());
    if (step + 1 < end && saves_after(o, first_step, step)) {  // --save-every
      save_checkpoint_after(t, periodic_checkpoint(o.save, step + 1), step);
      if (main_rank) prune_periodic_checkpoints(o.save, o.keep);
    }
    fflush(stdout);
  }
  if (main_rank) print_fp8_gemm_counts(ctx);
  finish_run(t, end - 1);
  barrier(comm, comm.world, ctx);  // no rank leaves while rank 0 still writes
  return 0;
}

// This rank's run: on its grid (the world mpirun started, or rank `simulated_rank` of the
// simulated one), its device and its streams.
static int run_rank(const Options& o, Device device, const PrecisionPolicy& precision,
                    int simulated_rank) {
  Comm comm = comm_init(o.dp, o.pp, o.cp, o.tp, o.comm, device, o.comm_timeout, o.ep,
                        SimulatedWorld{o.simulate_world, simulated_rank},
                        pipeline_messages(o.pp_schedule, o.pp, o.pp_virtual));
  Context ctx = Context::create(device);
  ctx.precision = precision.compute(), ctx.residual = precision.residual();
  const int code = run(o, comm, ctx, precision);
  ctx.destroy();
  comm_destroy(comm);
  return code;
}

// --simulate-rank -1: rank (dp 0, stage s, cp 0, tp 0) of every pipeline stage s in turn, quietly
// (tp, cp and expert-parallel positions hold the same shapes as rank 0 of their stage); a table
// of each stage's peak memory; then the stage with the most, in full.
static int run_every_stage(const Options& o, Device device, const PrecisionPolicy& precision) {
  Grid grid = make_grid(o.dp, o.pp, o.cp, o.tp, o.simulate_world, 0);
  std::vector<MemoryStats> peaks;
  // Standard output to /dev/null for a scope, and back at its end (an error thrown too).
  struct Quiet {
    int saved = dup(STDOUT_FILENO), quiet = open("/dev/null", O_WRONLY);
    Quiet() { fflush(stdout), dup2(quiet, STDOUT_FILENO); }
    ~Quiet() { fflush(stdout), dup2(saved, STDOUT_FILENO), close(saved), close(quiet); }
  };
  for (int s = 0; s < o.pp; s++) {
    int code = 0;
    {
      Quiet quiet;
      code = run_rank(o, device, precision, grid.rank_of(0, s, 0, 0));
    }
    if (code != 0) return code;
    peaks.push_back(memory_stats());
    release_arena(nullptr);  // the stage's buffers held for reuse go: the next starts empty
    memory_reset_peak();
    reset_ledger();
  }
  printf(
      "every pipeline stage of the simulated world (--simulate-rank -1), peak memory per rank "
      "(activations, workspace, and all categories at once):\n");
  printf("  %5s %6s %12s %12s %12s\n", "stage", "rank", "activations", "workspace", "peak total");
  int worst = 0;
  for (int s = 0; s < o.pp; s++) {
    const MemoryStats& m = peaks[s];
    printf("  %5d %6d", s, grid.rank_of(0, s, 0, 0));
    for (Mem k : {Mem::Activations, Mem::Workspace})
      printf(" %12s", human_bytes((double)m.peak[(int)k]).c_str());
    printf(" %12s\n", human_bytes((double)m.total_peak).c_str());
    if (m.total_peak > peaks[worst].total_peak) worst = s;
  }
  printf("the stage with the most, in full (rank %d):\n", grid.rank_of(0, worst, 0, 0));
  return run_rank(o, device, precision, grid.rank_of(0, worst, 0, 0));
}

int main(int argc, char** argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  CLI::App app{"picoscale: train a tiny Llama, the Ultra-Scale Playbook way"};
  Options o;
  add_flags(app, o);
  int code = 0;
  std::string error;  // this rank's: every rank learns the first (agree_on_launch)
  bool help = false;
  try {
    app.parse(argc, argv);
    resolve_options(o);
  } catch (const CLI::CallForHelp&) {
    help = true;
  } catch (const CLI::ParseError& e) {
    error = std::string(e.what()) + "\nRun ./train --help for every flag.";
  } catch (const UsageError& e) {
    error = e.what();
  }
  try {
    // Every rank was launched alike (runtime/launch.cuh): the same build, flags and files,
    // compared before the grid is built, so a mismatched grid never runs.
    agree_on_launch(error, launch_settings(o), o.comm_timeout);
    if (help) throw CLI::CallForHelp();
    o.fault.at(FaultWhere::Init, rank, 0);  // before set-up
    // Ranks on one node share its cores (OpenBLAS) and its GPUs (local rank modulo count).
    int local = 0, local_size = 1;
    local_rank(&local, &local_size, o.comm_timeout);
    openblas_set_num_threads(std::max(1, (int)std::thread::hardware_concurrency() / local_size));
    Device device = resolve_device(o.device);
    if (device == Device::CUDA) {
      int gpus = 0;
      CUDA_CHECK(cudaGetDeviceCount(&gpus));
      CUDA_CHECK(cudaSetDevice(local % gpus));
    }
    // The precision policy (mixed_precision.cuh): refused here, on every rank, before any step.
    PrecisionPolicy precision = make_precision_policy(o, device);
    validate_head_dim(o.model.head_dim(), o.attention == AttentionKind::Flash, device, o.gpu);
    validate_data_parallel(o, precision.grads());
    check_fault_fires(o.fault, o.app->get_option("--fault")->as<std::string>(),
                      fault_places(o, world, precision));
    if (o.simulate_world > 0 && world > 1)
      throw UsageError("--simulate-world " + std::to_string(o.simulate_world) +
                       ": one process stands for the whole world; launch ./train alone, "
                       "without mpirun");
    set_sync_launches(o.sync_launches);
    code = o.simulate_rank < 0 ? run_every_stage(o, device, precision)
                               : run_rank(o, device, precision, o.simulate_rank);
  } catch (const CLI::CallForHelp&) {
    if (rank == 0) std::cout << app.help();
  } catch (const UsageError& e) {
    if (rank == 0) fprintf(stderr, "error: %s\n", e.what());
    code = 2;
  } catch (const std::bad_alloc&) {  // this rank's alone: the others end by --comm-timeout
    fprintf(stderr,
            "error: rank %d ran out of host memory: the model, --mbs, --grad-acc or --seq is too "
            "large for this machine; lower them (--device meta runs any size without storing "
            "values)\n",
            rank);
    code = 2;
  }
  fflush(stdout);
  fflush(stderr);
  // Every rank together, each wait bounded (runtime/launch.cuh); a --fault at "finalize" fires
  // only in a run that got there.
  return finish_ranks(code, o.comm_timeout, code == 0 ? &o.fault : nullptr);
}
