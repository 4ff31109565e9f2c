// train.cu: the entry point. Reads top-down as one training step flows (DESIGN 7): the flags
// (options.cu), the process grid, the data, the model, the gradient sync the flags choose; then
// per step: the batch, the schedule of its micro-batches, the sync, clipping, the optimizer
// step, the log. Around it: validation, checkpoints, --save-grads, --score, --sample, --trace
// and the reports. Launch like torchrun: `./train` is one rank, `mpirun -np N ./train` N ranks.
#include <cblas.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "context_parallel.cuh"
#include "data_parallel.cuh"
#include "expert_parallel.cuh"
#include "mixed_precision.cuh"
#include "model.cuh"
#include "pipeline_parallel.cuh"
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
  if (o.dtype != "auto") parse_precision(o.dtype);
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
  const bool train = o.score.empty();
  // Each rank holds its tp shard of every weight, of the experts only its ep rank's.
  const double psi =
      ((double)parameter_count(c) - (double)expert_parameter_count(c) * (o.ep - 1) / o.ep) / o.tp;
  const int n = o.dp * o.cp, stage = n > 1 ? o.zero : 0;
  double state = 4 * psi;  // --score: the fp32 weights
  if (train) {
    StaticMemory m = zero_static_memory(
        stage, psi, n,
        bytes_per_parameter(stage, precision.compute(), precision.grads() == DType::BF16));
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

// The table rank 0 prints before the first step.
static void print_config(const Options& o, const Dataset& data, const Comm& comm, int64_t n_params,
                         int zero_stage, const PrecisionPolicy& precision) {
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
                                     (o.sp ? ", sequence parallel" : "")}};
  if (o.cp > 1)
    rows.push_back({"context parallel", std::string(cp_balance_name(o.cp_balance)) + " split, " +
                                            cp_comm_name(o.cp_comm) + ", " + s(c.seq / o.cp) +
                                            " tokens per rank"});
  if (c.experts > 0)
    rows.push_back({"mixture of experts",
                    s(c.experts) + " experts of ffn " + s(c.ffn) + ", top " + s(c.top_k) + ", ep " +
                        s(o.ep) + " (" + s(c.experts / o.ep) + " per rank), " +
                        (o.capacity_factor > 0 ? "capacity factor " + num(o.capacity_factor)
                                               : std::string("dropless")) +
                        ", aux loss coef " + num(c.aux_loss_coef)});
  if (o.pp > 1)
    rows.push_back(
        {"pipeline", std::string(pp_schedule_name(o.pp_schedule)) + ", " + s(o.grad_acc) +
                         " micro-batches" +
                         (o.pp_virtual > 1 ? ", " + s(o.pp_virtual) + " chunks per rank" : "")});
  std::string overlap = o.no_overlap ? ", no overlap" : ", overlapped";
  rows.push_back(
      {"gradient sync", zero_stage == 0
                            ? std::string(dp_sync_name(o.dp_sync)) + ", buckets of " +
                                  num(o.bucket_mb) + " MiB" + overlap
                            : "ZeRO-" + s(zero_stage) + ": reduce-scatter per unit" + overlap +
                                  (zero_stage == 3 && !o.no_overlap ? ", prefetch" : "")});
  rows.push_back({"dtype", precision.describe() +
                               (precision.mixed() && o.dtype == "auto" ? " (auto on CUDA)" : "")});
  rows.push_back({"attention", std::string(attention_name(o.attention)) +
                                   (o.attention == AttentionKind::Flash
                                        ? " (keeps O and its log-sum-exp: O(T))"
                                        : " (keeps the probabilities: O(T^2))")});
  rows.push_back(
      {"recompute", o.recompute == Recompute::Selective && o.attention == AttentionKind::Flash
                        ? "selective: nothing more to drop, flash keeps no probabilities"
                        : recompute_name(o.recompute)});
  rows.push_back({"steps / mbs / grad-acc", s(o.steps) + " / " + s(o.mbs) + " / " + s(o.grad_acc)});
  rows.push_back({"tokens per step",
                  s((int64_t)o.mbs * o.grad_acc * o.dp * c.seq) + " (mbs x grad-acc x dp x seq)"});
  char lr[96];
  snprintf(lr, sizeof lr, "%.2e -> %.2e, warmup %d, wd %.3g, clip %.3g", o.lr, o.min_lr, o.warmup,
           o.weight_decay, o.grad_clip);
  rows.push_back({"lr schedule (cosine)", lr});
  rows.push_back({"seed", s(o.seed)});
  rows.push_back({"data", data.source});
  rows.push_back({"train / val tokens", s(data.train.size()) + " / " + s(data.val.size())});
  rows.push_back(
      {"data order", o.no_shuffle ? "file order (--no-shuffle)" : "shuffled per epoch (--seed)"});
  print_config_table(rows);
}

// ----------------------------------------------------------------------------
// Evaluation

// Sum of per-token cross-entropies over windows [first, first + count) of seq + 1 tokens;
// window w starts at token w * stride (stride seq: validation; seq + 1: disjoint, --score).
// Under context parallelism each rank runs its share of every window's tokens.
static double loss_sum(const Context& ctx, Comm& comm, Model& model, const ContextParallel& cp,
                       const std::vector<int32_t>& tokens, int64_t first, int64_t count, int seq,
                       int64_t stride, int mbs) {
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
    total +=
        pipeline_forward(ctx, comm, model, acts, my_in.data(), my_tgt.data(), n, seq / cp.size());
  }
  return total;
}

// Mean loss over `windows` windows, the windows split evenly over the dp ranks (every rank
// holds the same weights), each window's tokens over the cp ranks, and the sums added up (over
// pp too: the last stage holds the loss). The ranks of an ep group hold different experts and
// dispatch to each other: they run the same windows, and ep rank 0's sum counts.
static double mean_loss(const Context& ctx, Comm& comm, Model& model, const ContextParallel& cp,
                        const std::vector<int32_t>& tokens, int64_t windows, int seq,
                        int64_t stride, int mbs) {
  int share = comm.dp.rank / comm.ep.size, shares = comm.dp.size / comm.ep.size;
  int64_t first = windows * share / shares, last = windows * (share + 1) / shares;
  double total = loss_sum(ctx, comm, model, cp, tokens, first, last - first, seq, stride, mbs);
  if (comm.ep.rank != 0) total = 0;
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
  all_gather(comm, comm.tp, ctx, logits_row.f32(), all.f32(), logits_row.numel());
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
    pipeline_forward(ctx, comm, model, acts, tokens.data() + tokens.size() - T, nullptr, 1, T);
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
  int stage = o.zero;
  if (stage > 0 && comm.dp_cp.size == 1) {  // nothing to shard: zero 0 is the same run
    if (comm.grid.world_rank == 0)
      fprintf(stderr,
              "warning: --zero %d has no effect with one data-parallel rank (dp x cp = 1): "
              "nothing to shard; running as --zero 0\n",
              o.zero);
    stage = 0;
  }
  if (stage > 0)
    return std::make_unique<Zero>(comm, model, stage, AdamWConfig{}, o.weight_decay, o.seed,
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
  Model model =
      build_model_layout(o.model, TensorParallel{&comm, o.sp},
                         pipeline_chunks(o.model.layers, o.pp, o.pp_virtual, comm.grid.pp_rank),
                         ExpertParallel{&comm, o.capacity_factor});
  if (o.cp > 1)
    model.attention = std::make_shared<ContextParallelAttention>(context_parallel(comm, o));
  else
    model.attention = local_attention(o.attention);
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
    loss = mean_loss(ctx, comm, model, context_parallel(comm, o), tokens, windows, c.seq, c.seq + 1,
                     o.mbs);
  });
  if (comm.grid.world_rank == 0) printf("loss: %.6f\n", loss);
  return 0;
}

// What the loop needs besides the model: the data, this rank's share of each step's batch, the
// log, and what it measures for the reports.
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
  std::vector<int32_t> my_inputs, my_targets;      // and its share of their tokens (cp)
  ContextParallel cp;                              // which tokens those are
  const ContextParallelAttention* ring = nullptr;  // the model's attention under cp (else null)
  CpWork attention_work;  // what ring attention computed (--report balance)
  OutputLines log_json;
  nlohmann::json log_line;  // this step's --log-json line, written once validation has run
  Observer observer;        // the trace, --fault, and what the schedule measured
  int64_t steps_run = 0;
  uint64_t step_syncs_min = UINT64_MAX, step_syncs_max = 0;  // host synchronisations per step
  TrafficMeter tp_traffic, dp_traffic;  // what tp and dp_cp sent in training steps
  PrecisionPolicy precision;            // --dtype: the loss scale, what the log adds
  ExpertStats experts;                  // what the routers did (--report experts)
  TrafficMeter ep_traffic;              // what the ep group sent in training steps
  DevicePeak peak;                      // rank 0: the FLOP rate MFU divides by (planner.cuh)
};

// One optimizer step (DESIGN 7). Returns false when the loss is not finite.
static bool train_step(Trainer& t, int64_t step) {
  const Options& o = t.o;
  int seq = o.model.seq;
  t.observer.at(FaultWhere::Step, step);
  double t0 = now_seconds();
  uint64_t syncs0 = host_syncs();
  t.tp_traffic.open(t.comm.tp);
  fill_train_batch(t.data, step, t.global_batch, t.first_seq, (int)t.rank_batch, seq,
                   t.inputs.data(), t.targets.data(), !o.no_shuffle, o.seed);
  t.dp_traffic.open(t.comm.dp_cp);
  t.sync.begin_step(t.ctx);
  // Each micro-batch's gradient is scaled so that the sum over micro-batches and dp ranks is
  // the gradient of the mean loss over every token of the global batch (DESIGN 5).
  // Under fp16 the loss is also multiplied by the loss scale, and the gradients divided back
  // before clipping (Playbook §Mixed precision training).
  float loss_scale = t.precision.loss_scale() / (float)(t.global_batch * seq);
  t.precision.begin_step();
  StepBatch batch{t.inputs.data(), t.targets.data(), o.grad_acc, o.mbs, seq};
  // Playbook §7: each cp rank holds seq / cp tokens of each sequence.
  t.my_inputs = select_context_tokens(t.cp, t.inputs.data(), o.mbs, seq, o.grad_acc);
  t.my_targets = select_context_tokens(t.cp, t.targets.data(), o.mbs, seq, o.grad_acc);
  batch.inputs = t.my_inputs.data(), batch.targets = t.my_targets.data();
  batch.seq = seq / t.cp.size();
  if (t.ring) t.ring->work = &t.attention_work;  // training steps only, not validation
  t.model.ep.stats = &t.experts;
  const double aux_before = t.experts.aux_sum;
  t.ep_traffic.open(t.comm.ep);
  t.observer.begin_schedule(step, true);
  double loss_sum = run_schedule(t.ctx, t.comm, t.model, t.sync, batch, t.recompute, loss_scale,
                                 t.pipeline, t.observer);
  t.observer.end_schedule();
  t.ep_traffic.close(t.comm.ep);
  t.model.ep.stats = nullptr;
  if (t.ring) t.ring->work = nullptr;
  double tw = now_seconds();
  t.sync.finish(t.ctx);
  t.dp_traffic.close(t.comm.dp_cp);  // --save-grads gathers next: not training traffic
  t.observer.span("wait for gradients", Track::Compute, tw, now_seconds());
  all_reduce_host(t.comm.dp_cp, &loss_sum, 1, ReduceOp::Sum);
  all_reduce_host(t.comm.pp, &loss_sum, 1, ReduceOp::Sum);  // the last stage holds it
  float loss = (float)(loss_sum / (t.global_batch * seq));
  // A mixture of experts: its load-balancing loss, per micro-batch, also in the gradients
  // (times --aux-loss-coef); logged apart from the loss, which stays the language model's.
  double aux = t.experts.aux_sum - aux_before;
  if (o.model.experts > 0) {
    all_reduce_host(t.comm.world, &aux, 1, ReduceOp::Sum);
    aux /= (double)o.grad_acc * o.dp;
  }
  if (!std::isfinite(loss)) {
    if (t.comm.grid.world_rank == 0)
      fprintf(stderr, "error: loss is %f at step %lld; lower --lr or check the data\n", loss,
              (long long)step + 1);
    return false;
  }
  if (t.steps_run == 0 && !o.save_grads.empty())  // whole gradients, before clipping
    all_or_none(t.comm, [&] { t.sync.save_gradients(t.ctx, o.save_grads, step); });
  double to = now_seconds();
  if (t.observer.injects_inf(step)) t.sync.poison_gradient(t.ctx);
  t.observer.at(FaultWhere::Clip, step);
  t.precision.unscale(t.ctx, t.sync);
  float norm = t.sync.clip_grad_norm(t.ctx, o.grad_clip);
  bool take_step = t.precision.keep_step(norm, t.comm.world);
  float lr = learning_rate(t.schedule, step);
  t.observer.at(FaultWhere::Optimizer, step);
  t.dp_traffic.open(t.comm.dp_cp);
  if (take_step) t.sync.step(t.ctx, lr);
  t.dp_traffic.close(t.comm.dp_cp);
  t.ctx.synchronize();
  t.observer.span("optimizer", Track::Compute, to, now_seconds());
  t.sync.trace_communication(t.observer.trace());
  t.tp_traffic.close(t.comm.tp);
  t.steps_run++;
  uint64_t syncs = host_syncs() - syncs0;
  t.step_syncs_min = std::min(t.step_syncs_min, syncs);
  t.step_syncs_max = std::max(t.step_syncs_max, syncs);
  t.observer.span(
      "step " + std::to_string(step + 1) + " (" + std::to_string(syncs) + " host syncs)",
      Track::Compute, t0, now_seconds());
  double dt = now_seconds() - t0;
  if (t.comm.grid.world_rank == 0) {
    double tok_s = t.global_batch * seq / dt, per_rank = tok_s / t.comm.grid.world_size;
    double mfu = book_flops_per_token(o.model) * per_rank / t.peak.flops;  // Playbook §2.6
    char moe[32] = "";
    if (o.model.experts > 0) snprintf(moe, sizeof moe, " | aux %.4f", aux);
    printf(
        "step %5lld/%d | loss %.4f%s | lr %.2e | norm %.4f | %8.0f tok/s | %7.0f tok/s/rank | "
        "MFU %5.1f%% | %7.1f ms%s\n",
        (long long)step + 1, o.steps, loss, moe, lr, norm, tok_s, per_rank, 100 * mfu, dt * 1e3,
        t.precision.step_note().c_str());
    if (t.log_json.is_open()) {
      nlohmann::json line{
          {"step", step + 1},  {"loss", loss},          {"lr", lr},
          {"grad_norm", norm}, {"tokens_per_s", tok_s}, {"tokens_per_s_per_rank", per_rank},
          {"mfu", mfu}};
      if (o.model.experts > 0) line["aux_loss"] = aux;
      t.precision.log_step(t.ctx, line);
      t.log_line = line;
    }
  }
  return true;
}

static void validate(Trainer& t, int64_t step) {
  t.observer.at(FaultWhere::Validation, step);
  const ModelConfig& c = t.o.model;
  int64_t windows = std::min<int64_t>(t.o.val_seqs, num_val_windows(t.data, c.seq));
  if (windows <= 0) return;
  double val = 0;
  with_whole_model(t.sync, t.ctx, [&] {
    val = mean_loss(t.ctx, t.comm, t.model, t.cp, t.data.val, windows, c.seq, c.seq, t.o.mbs);
  });
  if (t.comm.grid.world_rank == 0)
    printf("step %5lld/%d | val loss %.4f\n", (long long)step + 1, t.o.steps, val);
  t.log_line["val_loss"] = val;
}

// The model config with a cp rank's share of each sequence as its length (Playbook §7): what
// one rank's activations are made of.
static ModelConfig local_sequences(const Options& o) {
  ModelConfig c = o.model;
  c.seq /= o.cp;
  return c;
}

// What the run measured next to the book's formulas (--report memory,comm,sync).
static void print_reports(Trainer& t) {
  const Options& o = t.o;
  Comm& comm = t.comm;
  bool main_rank = comm.grid.world_rank == 0;
  int64_t n_params = t.model.num_params;  // on this rank: the whole model over tp
  if (main_rank)
    print_memory(n_params, t.sync.zero_stage(), comm.dp_cp.size, t.precision.compute(),
                 t.precision.grads() == DType::BF16);
  for (Report r : o.reports) {
    if (r == Report::Sync && main_rank && t.steps_run > 0) {
      // The points where the host waits for the device (core.cuh, count_host_sync): each one
      // drains the GPU's queue, so the fewer per step the better.
      std::string range = t.step_syncs_min == t.step_syncs_max
                              ? ""
                              : " (fewest " + std::to_string(t.step_syncs_min) + ")";
      printf("host synchronisations per training step: %llu%s\n",
             (unsigned long long)t.step_syncs_max, range.c_str());
    }
    if (r == Report::Memory) {
      if (main_rank)
        print_precision_memory(t.precision.compute(), n_params, t.sync.master_bytes(),
                               t.precision.grads() == DType::BF16);
      print_memory_report(comm, t.sync.zero_stage(), n_params, t.sync.padded_params(),
                          t.precision.compute(), t.precision.grads() == DType::BF16);
      if (main_rank && o.model.experts > 0) {  // this rank's experts: E / ep per block
        int64_t held = 0, blocks = 0;
        for (const ModelUnit& u : t.model.units) held += u.experts ? u.numel * 4 : 0;
        for (int c = 0; c < (int)t.model.chunks.size(); c++) blocks += t.model.blocks(c);
        const int64_t D = o.model.d_model, F = o.model.ffn / o.tp, per = o.model.experts / o.ep;
        print_expert_memory(held, blocks * per * 3 * D * F * 4,
                            std::to_string(blocks) + " blocks x " + std::to_string(per) +
                                " experts (E / ep) x 3 D F / tp x 4");
      }
      if (main_rank && t.observer.schedule().block_bytes >= 0) {
        const int e = (int)dtype_size(t.precision.weight_format());
        const AttentionCore& attention = *t.model.attention;
        print_activation_report(
            t.observer.schedule().block_bytes,
            activation_bytes_per_block(local_sequences(o), o.mbs, o.model.seq / o.cp, o.tp, o.sp,
                                       t.recompute, attention, e),
            "tp " + std::to_string(o.tp) + (o.sp ? " + sp" : "") + ", recompute " +
                recompute_name(t.recompute) + ", " + attention.name() + " attention",
            attention.saved_formula(e), o.sp, e, o.model.experts > 0);
      }
    }
    if (r == Report::Comm) {
      int64_t expert_params = 0;
      for (const ModelUnit& u : t.model.units) expert_params += u.experts ? u.numel : 0;
      print_comm_report(comm, n_params, t.steps_run, expert_params);
      t.sync.print_comm_report(o.grad_acc, t.dp_traffic.total, t.steps_run);
      if (main_rank && o.model.experts > 0 && o.ep > 1) {
        // Each block's forward dispatches and combines once, its backward once more (and full
        // recomputation's forward again); every rank charged for the rows it sends.
        const int passes = t.recompute == Recompute::Full ? 3 : 2;
        int64_t blocks = 0, n = (int64_t)o.mbs * o.model.seq / o.cp, steps = t.steps_run;
        for (int c = 0; c < (int)t.model.chunks.size(); c++) blocks += t.model.blocks(c);
        double uniform =
            (double)blocks * o.grad_acc * passes * moe_expected_a2a_bytes(o.model, n, o.ep);
        double routed = passes * 4.0 * o.model.d_model *
                        (t.experts.rows_elsewhere + t.experts.rows_arrived) /
                        (double)std::max<int64_t>(1, steps);
        print_expert_comm_report(t.ep_traffic.total[(int)Coll::AllToAll], uniform, routed, steps,
                                 passes);
      }
      if (main_rank && o.tp > 1)
        print_tp_comm_report(tp_expected_traffic(o.model, o.mbs, o.model.seq, o.tp, o.sp),
                             o.grad_acc, o.tp, o.sp, t.tp_traffic.total, t.steps_run);
    }
    if (r == Report::Experts && o.model.experts > 0)
      print_expert_report(comm,
                          std::to_string(o.model.experts) + " experts, top " +
                              std::to_string(o.model.top_k) + ", ep " + std::to_string(o.ep) +
                              (o.capacity_factor > 0 ? ", capacity factor " + num(o.capacity_factor)
                                                     : ", dropless"),
                          o.model.layers, o.model.experts, t.experts, t.steps_run);
    if (r == Report::Bubble)
      print_bubble_report(comm, bubble_prediction(o.pp_schedule, o.pp, o.grad_acc, o.pp_virtual),
                          t.observer.schedule());
    if (r == Report::Balance)
      print_balance_report(
          comm, std::string(cp_balance_name(o.cp_balance)) + " split, " + cp_comm_name(o.cp_comm),
          t.attention_work.blocks, t.attention_work.pairs, t.attention_work.seconds, t.steps_run);
  }
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
  if (t.comm.grid.world_rank == 0)
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
  bool main_rank = t.comm.grid.world_rank == 0;
  if (!o.save.empty()) save_checkpoint_after(t, o.save, last_step);
  if (t.observer.trace().enabled) {
    all_or_none(t.comm, [&] { trace_write(t.observer.trace(), o.trace, t.comm.world); });
    if (main_rank)
      printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o.trace.c_str());
  }
  print_reports(t);
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
  bool main_rank = comm.grid.world_rank == 0;
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
    print_config(o, data, comm, laid_out, sync->zero_stage(), precision);
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
  t.ring = dynamic_cast<const ContextParallelAttention*>(model.attention.get());
  t.observer = Observer(comm.grid.world_rank, o.fault, !o.trace.empty());
  t.precision = precision;
  if (main_rank) {
    t.peak = device_peak(ctx, precision.compute());
    printf(
        "MFU: the book's 6N + 12 L h s = %.4g FLOPs per token (appendix A2) over %.4g FLOP/s "
        "per rank (%s)\n",
        book_flops_per_token(c), t.peak.flops, t.peak.how.c_str());
    if (c.experts > 0)
      printf("MFU: N = %lld parameters a token meets (top %d of %d experts per layer) of %lld\n",
             (long long)active_parameter_count(c), c.top_k, c.experts,
             (long long)parameter_count(c));
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
  if (main_rank) t.precision.print_summary(ctx);
  finish_run(t, end - 1);
  barrier(comm, comm.world, ctx);  // no rank leaves while rank 0 still writes
  return 0;
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
    validate_data_parallel(o, precision.grads());
    check_fault_fires(o.fault, o.app->get_option("--fault")->as<std::string>(),
                      fault_places(o, world, precision));
    Comm comm = comm_init(o.dp, o.pp, o.cp, o.tp, o.comm, device, o.comm_timeout, o.ep);
    set_sync_launches(o.sync_launches);
    Context ctx = Context::create(device);
    ctx.precision = precision.compute();
    code = run(o, comm, ctx, precision);
    ctx.destroy();
    comm_destroy(comm);
  } catch (const CLI::CallForHelp&) {
    if (rank == 0) std::cout << app.help();
  } catch (const UsageError& e) {
    if (rank == 0) fprintf(stderr, "error: %s\n", e.what());
    code = 2;
  }
  fflush(stdout);
  fflush(stderr);
  MPI_Finalize();
  return code;
}
