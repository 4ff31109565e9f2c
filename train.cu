// train.cu: the entry point. Parses the flags (options.cu), builds the process grid, model,
// optimizer and data, runs the training loop (gradient accumulation, gradient sync, clipping,
// AdamW, logging), and the side jobs: validation, checkpoints, --save-grads, --score,
// --sample, --trace and the reports.
// Launch like torchrun: `./train ...` is one rank, `mpirun -np N ./train ...` is N ranks.
#include <CLI/CLI.hpp>
#include <cblas.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <unistd.h>

#include "checkpoint.cuh"
#include "comm.cuh"
#include "core.cuh"
#include "data.cuh"
#include "data_parallel.cuh"
#include "model.cuh"
#include "ops.cuh"
#include "optimizer.cuh"
#include "options.cuh"
#include "report.cuh"
#include "zero.cuh"

// ----------------------------------------------------------------------------
// Evaluation

// Sum of per-token cross-entropies over windows [first, first + count) of seq + 1 tokens;
// window w starts at token w * stride (stride seq: validation; seq + 1: disjoint, --score).
static double loss_sum(const Context& ctx, const Model& model, const std::vector<int32_t>& tokens,
                       int64_t first, int64_t count, int seq, int64_t stride, int mbs) {
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
    total += model_forward(ctx, model, acts, in.data(), tgt.data(), n, seq, Recompute::None);
  }
  return total;
}

// Mean loss over `windows` windows, the windows split evenly over the dp_cp ranks (every rank
// holds the same weights) and the sums added up.
static double mean_loss(const Context& ctx, Comm& comm, const Model& model,
                        const std::vector<int32_t>& tokens, int64_t windows, int seq,
                        int64_t stride, int mbs) {
  Group& g = comm.dp_cp;
  int64_t first = windows * g.rank / g.size, last = windows * (g.rank + 1) / g.size;
  double total = loss_sum(ctx, model, tokens, first, last - first, seq, stride, mbs);
  all_reduce_host(g, &total, 1, ReduceOp::Sum);
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

// Every rank runs it (tensor-parallel ranks each hold a slice of the logits); rank 0 prints.
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
    model_forward(ctx, model, acts, tokens.data() + tokens.size() - T, nullptr, 1, T,
                  Recompute::None);
    int Vl = model.local.vocab;  // this rank's vocabulary slice; all-gathered in vocab order
    Tensor all = empty({V}, Mem::Workspace, ctx.device);
    all_gather(comm, comm.tp, ctx, acts.logits.f32() + (int64_t)(T - 1) * Vl, all.f32(), Vl);
    std::vector<float> logits = to_host_floats(all);
    float mx = *std::max_element(logits.begin(), logits.end());
    double z = 0;
    for (float& l : logits) z += (l = std::exp((l - mx) / o.temperature));
    double r = rng_uniform(key, i) * z;
    int next = V - 1;
    for (int v = 0; v < V; v++)
      if ((r -= logits[v]) < 0) {
        next = v;
        break;
      }
    tokens.push_back(next);
    out += (char)(next < 256 ? next : '?');
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

// The global gradient norm over every parameter once, whichever tensor-parallel ranks hold it
// (shards on each, norms and replicated kv heads counted on one), then clipping to max_norm.
static float clip_global_grad_norm(const Context& ctx, Comm& comm, const Model& model,
                                   float max_norm) {
  double squares = 0;
  for (size_t i = 0; i < model.named_grads.size(); i++)
    if (model.layouts[i].writer) squares += sum_squares(ctx, model.named_grads[i].tensor);
  all_reduce_host(comm.tp, &squares, 1, ReduceOp::Sum);
  float norm = (float)std::sqrt(squares);
  if (max_norm > 0 && norm > max_norm) scale_(ctx, model.grads, max_norm / norm);
  return norm;
}

static int score_file(const Context& ctx, Comm& comm, const Options& o) {
  const ModelConfig& c = o.model;
  Model model = build_model(c, ctx.device, o.seed, TensorParallel{&comm, o.sp});
  load_checkpoint_shards(model, o.load, model.named_params, nullptr);
  std::vector<int32_t> tokens = read_tokens(o.score);
  int64_t windows = (int64_t)tokens.size() / (c.seq + 1);
  if (windows == 0)
    throw UsageError("--score " + o.score + ": " + std::to_string(tokens.size()) +
                     " tokens, fewer than one window of --seq + 1 = " + std::to_string(c.seq + 1));
  for (int32_t t : tokens)
    if (t >= c.vocab)
      throw UsageError("--score " + o.score + ": token " + std::to_string(t) +
                       " is outside the vocabulary " + std::to_string(c.vocab));
  double loss = mean_loss(ctx, comm, model, tokens, windows, c.seq, c.seq + 1, o.mbs);
  if (comm.grid.world_rank == 0) printf("loss: %.6f\n", loss);
  return 0;
}

static int run(const Options& o, Comm& comm, const Context& ctx) {
  const ModelConfig& c = o.model;
  const Grid& grid = comm.grid;
  bool main_rank = grid.world_rank == 0;
  all_or_none(comm, [&] { check_before_start(o, comm); });  // memory, outputs: before any step
  if (!o.score.empty()) return score_file(ctx, comm, o);

  Recompute recompute = parse_recompute(o.recompute);
  Dataset data = load_dataset(o.data, o.val_frac, c.seq);
  check_vocab(data, c.vocab);
  // ZeRO shards over dp_cp: with one rank there is nothing to shard, and zero 0 is the same run.
  int zero_stage = o.zero;
  if (zero_stage > 0 && comm.dp_cp.size == 1) {
    if (main_rank)
      fprintf(stderr,
              "warning: --zero %d has no effect with one data-parallel rank (dp x cp = 1): "
              "nothing to shard; running as --zero 0\n",
              o.zero);
    zero_stage = 0;
  }
  // Plain data parallelism: the model holds every weight and gradient, DataParallel sums the
  // gradients, AdamW steps all of them. ZeRO: the model is a layout whose views Zero binds.
  TensorParallel tp{&comm, o.sp};
  Model model = zero_stage > 0 ? build_model_layout(c, tp) : build_model(c, ctx.device, o.seed, tp);
  std::unique_ptr<Zero> zero;
  std::unique_ptr<DataParallel> dp;
  Optimizer opt;
  if (zero_stage > 0) {
    zero = std::make_unique<Zero>(comm, model, zero_stage, AdamWConfig{}, o.weight_decay, o.seed,
                                  !o.no_overlap);
  } else {
    opt = build_optimizer(model, AdamWConfig{}, o.weight_decay);
    dp = std::make_unique<DataParallel>(comm, model, parse_dp_sync(o.dp_sync), o.bucket_mb,
                                        !o.no_overlap);
  }
  int64_t first_step = 0;
  if (!o.load.empty() && zero) {
    first_step = zero->load(o.load);
  } else if (!o.load.empty()) {
    OptimizerState state{opt.named_exp_avg, opt.named_exp_avg_sq, 0};
    if (load_checkpoint_shards(model, o.load, model.named_params, &state)) opt.step = state.step;
    first_step = opt.step;
  }
  // Evaluation reads the whole model: ZeRO-3 gathers it for the duration (FSDP's
  // summon_full_params); the other stages hold it already.
  auto evaluate = [&](const std::function<void()>& body) {
    if (zero) zero->gather_all(ctx);
    body();
    if (zero) zero->release_all();
  };
  if (main_rank) {
    int64_t laid_out = 0;  // the layout's tensors, against the closed form
    for (const NamedTensor& p : model.named_params) laid_out += p.tensor.numel();
    print_config(o, data, comm, laid_out, zero_stage);
    printf("unigram entropy of the training tokens: %.4f nats (a model that ignores context)\n",
           unigram_entropy(data.train, c.vocab));
  }
  OutputLines log_json;
  all_or_none(comm, [&] {
    if (main_rank && !o.log_json.empty()) log_json.open("--log-json", o.log_json);
  });
  Trace trace;
  trace.enabled = !o.trace.empty();
  LrSchedule schedule{o.lr, o.min_lr, o.warmup, o.steps};
  // The global batch (DESIGN 5): mbs x grad_acc x dp sequences. dp rank d reads the
  // consecutive sequences [d * mbs * grad_acc, (d + 1) * mbs * grad_acc).
  int64_t rank_batch = (int64_t)o.mbs * o.grad_acc, global_batch = rank_batch * o.dp;
  int first_seq = (int)(grid.dp_rank * rank_batch);
  int64_t val_windows = std::min<int64_t>(o.val_seqs, num_val_windows(data, c.seq));
  std::vector<int32_t> inputs(rank_batch * c.seq), targets(rank_batch * c.seq);
  // Each micro-batch's gradient is scaled so that the sum over micro-batches and dp ranks is
  // the gradient of the mean loss over every token of the global batch (DESIGN 5).
  float loss_scale = 1.0f / (float)(global_batch * c.seq);
  int64_t steps_run = 0;
  int64_t block_bytes = -1;                   // one block's saved activations, measured once
  CollStats tp_traffic[(int)Coll::Count] = {};  // what the tp group sent in training steps

  int64_t end = o.stop_after > 0 ? std::min<int64_t>(o.steps, first_step + o.stop_after) : o.steps;
  for (int64_t step = first_step; step < end; step++) {
    maybe_inject_fault(o.fault, grid.world_rank, step);
    double t0 = now_seconds();
    CollStats tp_before[(int)Coll::Count];
    std::copy(comm.tp.stats, comm.tp.stats + (int)Coll::Count, tp_before);
    fill_train_batch(data, step, global_batch, first_seq, (int)rank_batch, c.seq, inputs.data(),
                     targets.data(), !o.no_shuffle, o.seed);
    if (zero)
      zero->begin_step(ctx);
    else
      zero_(model.grads);
    double loss_sum = 0;
    for (int micro = 0; micro < o.grad_acc; micro++) {  // Playbook §2.7 gradient accumulation
      size_t first = (size_t)micro * o.mbs * c.seq;
      bool last_micro = micro == o.grad_acc - 1;
      UnitHooks hooks = zero ? zero->hooks(ctx, last_micro) : dp->hooks();
      Activations acts;
      double tf = now_seconds();
      loss_sum += model_forward(ctx, model, acts, inputs.data() + first, targets.data() + first,
                                o.mbs, c.seq, recompute, hooks);
      double tb = now_seconds();
      trace.add("forward " + std::to_string(micro), Track::Compute, tf, tb);
      if (block_bytes < 0) block_bytes = saved_bytes(acts.blocks[0]);
      if (dp) dp->begin_backward(ctx, last_micro);
      model_backward(ctx, model, acts, loss_scale, recompute, hooks);
      trace.add("backward " + std::to_string(micro), Track::Compute, tb, now_seconds());
    }
    double tw = now_seconds();
    if (zero)
      zero->finish_gradients(ctx);
    else
      dp->finish(ctx);
    trace.add("wait for gradients", Track::Compute, tw, now_seconds());
    if (dp)
      for (auto [start, stop] : dp->last_spans)
        trace.add("gradient all-reduce", Track::Comm, start, stop);
    all_reduce_host(comm.dp_cp, &loss_sum, 1, ReduceOp::Sum);
    float loss = (float)(loss_sum / (global_batch * c.seq));
    if (!std::isfinite(loss)) {
      if (main_rank)
        fprintf(stderr, "error: loss is %f at step %lld; lower --lr or check the data\n", loss,
                (long long)step + 1);
      return 3;
    }
    if (step == first_step && !o.save_grads.empty()) {  // whole gradients, before clipping
      all_or_none(comm, [&] {
        if (zero) {
          zero->save_gradients(ctx, o.save_grads, step);
        } else if (comm.dp_cp.rank == 0) {  // the tp shards come together on world rank 0
          std::vector<NamedTensor> whole = whole_tensors(model, model.named_grads);
          if (main_rank) write_safetensors(o.save_grads, whole, {{"step", std::to_string(step)}});
        }
      });
    }
    double to = now_seconds();
    float norm = zero ? zero->clip_grad_norm(ctx, o.grad_clip)
                      : clip_global_grad_norm(ctx, comm, model, o.grad_clip);
    float lr = learning_rate(schedule, step);
    if (zero)
      zero->step(ctx, lr);
    else
      optimizer_step(ctx, model, opt, lr);
    ctx.synchronize();
    trace.add("optimizer", Track::Compute, to, now_seconds());
    if (zero)
      for (const Zero::Span& span : zero->spans)
        trace.add(span.name, Track::Comm, span.start, span.end);
    double dt = now_seconds() - t0;
    double tok_s = global_batch * c.seq / dt;
    steps_run++;
    for (int k = 0; k < (int)Coll::Count; k++)
      tp_traffic[k].calls += comm.tp.stats[k].calls - tp_before[k].calls,
          tp_traffic[k].bytes += comm.tp.stats[k].bytes - tp_before[k].bytes;
    if (main_rank) {
      printf("step %5lld/%d | loss %.4f | lr %.2e | norm %.4f | %8.0f tok/s | %7.1f ms\n",
             (long long)step + 1, o.steps, loss, lr, norm, tok_s, dt * 1e3);
      if (log_json.is_open())
        log_json.write_line(nlohmann::json{{"step", step + 1}, {"loss", loss}, {"lr", lr},
                                           {"grad_norm", norm}, {"tokens_per_s", tok_s}}
                                .dump());
    }
    bool last = step + 1 == end;
    if (val_windows > 0 && (last || (o.val_every > 0 && (step + 1) % o.val_every == 0))) {
      double val = 0;
      evaluate(
          [&] { val = mean_loss(ctx, comm, model, data.val, val_windows, c.seq, c.seq, o.mbs); });
      if (main_rank) printf("step %5lld/%d | val loss %.4f\n", (long long)step + 1, o.steps, val);
    }
    fflush(stdout);
  }
  if (!o.save.empty()) {  // whole tensors, whatever the layout (ZeRO gathers its shards)
    all_or_none(comm, [&] {
      if (zero) {
        zero->save(ctx, o.save);
      } else if (comm.dp_cp.rank == 0) {
        std::vector<NamedTensor> weights = whole_tensors(model, model.named_params);
        OptimizerState state{whole_tensors(model, opt.named_exp_avg),
                             whole_tensors(model, opt.named_exp_avg_sq), opt.step};
        if (main_rank) save_checkpoint(o.save, c, weights, &state);
      }
    });
    if (main_rank)
      printf("saved %s (config.json, model.safetensors, optimizer.safetensors)\n", o.save.c_str());
  }
  if (trace.enabled) {
    all_or_none(comm, [&] { trace_write(trace, o.trace, comm.world); });
    if (main_rank) printf("trace: %s (open in https://ui.perfetto.dev or chrome://tracing)\n", o.trace.c_str());
  }
  int64_t n_params = model.num_params;  // on this rank: the whole model over tp
  if (main_rank) print_memory(n_params, zero_stage, comm.dp_cp.size);
  for (const std::string& r : o.reports) {
    if (r == "memory") {
      print_memory_report(comm, zero_stage, n_params,
                          zero ? zero->layout().padded_numel() : n_params);
      if (main_rank && block_bytes >= 0)
        print_activation_report(c, o.mbs, o.tp, o.sp, recompute, block_bytes);
    }
    if (r == "comm") {
      print_comm_report(comm, n_params, steps_run);
      if (zero) print_zero_comm_report(comm, *zero, o.grad_acc);
      for (CollStats& s : tp_traffic) s.bytes /= std::max<int64_t>(1, steps_run);
      if (main_rank && o.tp > 1) print_tp_comm_report(c, o.mbs, o.grad_acc, o.tp, o.sp, tp_traffic);
    }
  }
  if (o.sample > 0)
    evaluate([&] {
      std::string text = generate(ctx, comm, model, o);
      if (main_rank) printf("sample:\n%s%s\n", o.prompt.c_str(), text.c_str());
    });
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
  std::vector<ShapeFlag> shape;
  add_flags(app, o, shape);
  int code = 0;
  try {
    app.parse(argc, argv);
    resolve_options(o, shape);
    // Ranks on one node share its cores (OpenBLAS) and its GPUs (local rank modulo count).
    int local = 0, local_size = 1;
    local_rank(&local, &local_size);
    openblas_set_num_threads(std::max(1, (int)std::thread::hardware_concurrency() / local_size));
    Device device = resolve_device(o.device);
    if (device == Device::CUDA) {
      int gpus = 0;
      CUDA_CHECK(cudaGetDeviceCount(&gpus));
      CUDA_CHECK(cudaSetDevice(local % gpus));
    }
    Comm comm = comm_init(o.dp, o.pp, o.cp, o.tp, o.comm, device, o.comm_timeout);
    Context ctx = Context::create(device);
    code = run(o, comm, ctx);
    ctx.destroy();
    comm_destroy(comm);
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
  fflush(stderr);
  MPI_Finalize();
  return code;
}
