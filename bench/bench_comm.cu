// bench_comm.cu: `make bench`, under mpirun. (1) All-reduce bandwidth of the library and of our
// ring, nccl-tests convention: algbw = bytes / time, busbw = algbw * 2(N-1)/N (the bandwidth
// each link carries, comparable across N); all-to-all's, the same way: algbw = S / time for a
// send buffer of S bytes per rank (S/N to each peer), busbw = algbw * (N-1)/N. (2) A
// data-parallel training step of the medium model with naive, bucketed, and
// bucketed-without-overlap gradient sync, with the exposed communication time: how long the
// step waits for gradients after its backward (the span "wait for gradients" of --trace).
// (3) ZeRO-0 to ZeRO-3 steps of the medium model: static and peak memory per rank against the
// book's formulas, step time, and how much of ZeRO-3's gather time prefetching hides.
// (4) --fit FILE: all-reduce, all-gather, reduce-scatter and send/recv over message sizes, with
// alpha and beta fitted per collective, and the GEMM rates (and one rank's memory bandwidth,
// our loops' share of it and attention's of the GEMM rate), written where ./plan --comm-fit
// reads them; --rates FILE measures that file's rates again; --mean OUT FILE... writes
// the first FILE with the GEMM rates averaged over every FILE.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "data_parallel.cuh"
#include "model.cuh"
#include "planner/planner.cuh"
#include "runtime/comm.cuh"
#include "runtime/ops.cuh"
#include "runtime/optimizer.cuh"
#include "zero.cuh"

static void bandwidth(Comm& comm, const Context& ctx, const char* backend) {
  Group& g = comm.world;
  int N = g.size;
  bool root = g.rank == 0;
  if (root) {
    printf("\nall-reduce bandwidth, %d ranks, %s, %s (best of 3)\n", N, backend,
           device_name(ctx.device));
    printf("| %10s | %-7s | %10s | %10s | %10s |\n", "size", "impl", "time us", "algbw GB/s",
           "busbw GB/s");
    printf("|------------|---------|------------|------------|------------|\n");
  }
  for (int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) {
    int64_t count = bytes / 4;
    Tensor buf = empty({count}, Mem::Workspace, ctx.device);
    init_normal(buf, 1, "bench", 1.0f);
    for (const char* impl : {"library", "ring"}) {
      double best = 1e30;
      for (int rep = 0; rep < 4; rep++) {  // the first is a warm-up
        barrier(comm, g, ctx);
        double t0 = now_seconds();
        if (impl[0] == 'l')
          all_reduce(comm, g, ctx, buf.f32(), count, ReduceOp::Sum);
        else
          ring_all_reduce(comm, g, ctx, buf.f32(), count);
        ctx.synchronize();
        double t = now_seconds() - t0;
        all_reduce_host(g, &t, 1, ReduceOp::Max);
        if (rep > 0) best = std::min(best, t);
      }
      double algbw = bytes / best / 1e9;
      if (root)
        printf("| %10s | %-7s | %10.1f | %10.3f | %10.3f |\n", human_bytes(bytes).c_str(), impl,
               best * 1e6, algbw, algbw * 2.0 * (N - 1) / N);
    }
  }
}

// All-to-all with equal counts, as nccl-tests' alltoall: each rank sends S/N bytes to every rank
// (itself included: that share stays local), so each link carries (N-1)/N of S.
static void all_to_all_bandwidth(Comm& comm, const Context& ctx, const char* backend) {
  Group& g = comm.world;
  int N = g.size;
  bool root = g.rank == 0;
  if (root) {
    printf("\nall-to-all bandwidth, %d ranks, %s, %s (best of 3; size: the send buffer per rank)\n",
           N, backend, device_name(ctx.device));
    printf("| %10s | %-10s | %10s | %10s | %10s |\n", "size", "impl", "time us", "algbw GB/s",
           "busbw GB/s");
    printf("|------------|------------|------------|------------|------------|\n");
  }
  for (int64_t bytes = 4 << 10; bytes <= (256 << 20); bytes *= 4) {
    int64_t per_peer = bytes / 4 / N, count = per_peer * N;  // [N segments of per_peer floats]
    std::vector<int64_t> counts(N, per_peer);
    Tensor send = empty({count}, Mem::Workspace, ctx.device);
    Tensor recv = empty({count}, Mem::Workspace, ctx.device);
    init_normal(send, 1, "bench", 1.0f);
    double best = 1e30;
    for (int rep = 0; rep < 4; rep++) {  // the first is a warm-up
      barrier(comm, g, ctx);
      double t0 = now_seconds();
      all_to_all_v(comm, g, ctx, send.f32(), counts, recv.f32(), counts, DType::F32);
      ctx.synchronize();
      double t = now_seconds() - t0;
      all_reduce_host(g, &t, 1, ReduceOp::Max);
      if (rep > 0) best = std::min(best, t);
    }
    double algbw = count * 4.0 / best / 1e9;
    if (root)
      printf("| %10s | %-10s | %10.1f | %10.3f | %10.3f |\n", human_bytes(count * 4.0).c_str(),
             "all_to_all", best * 1e6, algbw, algbw * (N - 1) / N);
  }
}

// Every collective the planner prices, over message sizes, as nccl-tests reports them (algbw =
// S / time, S the whole buffer: all-reduce's, all-gather's output, reduce-scatter's input, one
// send of send/recv; busbw = algbw x 2(N-1)/N, (N-1)/N, (N-1)/N, 1), then alpha and beta fitted
// per collective to time = steps x alpha + factor x S / busbw (steps 2(N-1), N-1, N-1, 1; factor
// the busbw one) by least squares on the relative error; written to `path` for plan --comm-fit.
static nlohmann::json fit_group(Comm& comm, Group& g, const Context& ctx, const char* backend) {
  const int N = g.size;
  int world_rank = 0;
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
  const bool root = world_rank == 0;
  struct Kind {
    const char* name;
    double steps, factor;
  };
  const Kind kinds[] = {{"all_reduce", 2.0 * (N - 1), 2.0 * (N - 1) / N},
                        {"all_gather", N - 1.0, (N - 1.0) / N},
                        {"reduce_scatter", N - 1.0, (N - 1.0) / N},
                        {"send_recv", 1, 1}};
  if (root) {
    printf(
        "\ncollectives for the planner, groups of %d ranks (%s; every group at once), %s, %s "
        "(best of 3)\n",
        N, g.name.c_str(), backend, device_name(ctx.device));
    printf("| %-14s | %10s | %10s | %10s | %10s |\n", "collective", "size", "time us", "algbw GB/s",
           "busbw GB/s");
    printf("|----------------|------------|------------|------------|------------|\n");
  }
  nlohmann::json out;
  for (const Kind& k : kinds) {
    std::vector<double> sizes, times;
    for (int64_t bytes = 16 << 10; bytes <= (16 << 20); bytes *= 4) {
      int64_t count = bytes / 4 / N * N;  // whole shards
      Tensor a = empty({count}, Mem::Workspace, ctx.device);
      Tensor b = empty({count}, Mem::Workspace, ctx.device);
      init_normal(a, 1, "bench", 1.0f);
      double best = 1e30;
      for (int rep = 0; rep < 4; rep++) {  // the first is a warm-up
        barrier(comm, comm.world, ctx);    // every group starts together
        double t0 = now_seconds();
        std::string n = k.name;
        if (n == "all_reduce") all_reduce(comm, g, ctx, a.f32(), count, ReduceOp::Sum);
        if (n == "all_gather") all_gather(comm, g, ctx, a.f32(), b.f32(), count / N);
        if (n == "reduce_scatter")
          reduce_scatter(comm, g, ctx, a.f32(), b.f32(), count / N, ReduceOp::Sum);
        if (n == "send_recv")
          send_recv(comm, g, ctx,
                    {P2P{true, a.f32(), count, g.next()}, P2P{false, b.f32(), count, g.prev()}});
        ctx.synchronize();
        double t = now_seconds() - t0;
        all_reduce_host(comm.world, &t, 1, ReduceOp::Max);  // the slowest of every group
        if (rep > 0) best = std::min(best, t);
      }
      double S = count * 4.0, algbw = S / best;
      sizes.push_back(S), times.push_back(best);
      if (root)
        printf("| %-14s | %10s | %10.1f | %10.3f | %10.3f |\n", k.name, human_bytes(S).c_str(),
               best * 1e6, algbw / 1e9, algbw * k.factor / 1e9);
    }
    // Weighted least squares in (alpha, 1/busbw): each row steps/t, factor S/t against 1.
    double a11 = 0, a12 = 0, a22 = 0, b1 = 0, b2 = 0;
    for (size_t i = 0; i < sizes.size(); i++) {
      double x1 = k.steps / times[i], x2 = k.factor * sizes[i] / times[i];
      a11 += x1 * x1, a12 += x1 * x2, a22 += x2 * x2, b1 += x1, b2 += x2;
    }
    double det = a11 * a22 - a12 * a12;
    double alpha = (b1 * a22 - b2 * a12) / det, inverse = (a11 * b2 - a12 * b1) / det;
    if (alpha < 0 || inverse <= 0) {  // one term alone explains the times: fit it alone
      alpha = std::max(0.0, alpha);
      inverse = 0;
      for (size_t i = 0; i < sizes.size(); i++)
        inverse = std::max(inverse, (times[i] - k.steps * alpha) / (k.factor * sizes[i]));
    }
    out[k.name] = {{"alpha_s", alpha}, {"busbw_bytes_per_s", 1.0 / inverse}};
    if (root)
      printf("  %s: alpha %.2f us per step, busbw %.3f GB/s\n", k.name, alpha * 1e6,
             1e-9 / inverse);
  }
  return out;
}

// The FLOP rate of one rank alone for 2 seconds (the others wait, sleeping where ranks share
// cores), and of each while every rank computes for the same 4 seconds: ranks on one machine
// share its cores, N x busy / alone of them at a time. Seconds rather than a GEMM's best, as a
// machine whose cores others share too can change speed from one second to the next. With all
// ranks at once as in training, how much slower narrow GEMMs run: the planner's half width.
static void measure_gemm_rates(Comm& comm, const Context& ctx, nlohmann::json& out) {
  Group& g = comm.world;
  const int N = g.size;
  barrier(comm, g, ctx);
  double alone = g.rank == 0 ? gemm_rate_for(ctx, 2.0).flops : 0;
  // Rank 0 alone still: the memory-bound loops' and attention's rates (./plan prices the
  // ledger's norms, elementwise ops, optimizer and attention on them, as --report roofline does).
  CpuRates rates = g.rank == 0 ? measure_cpu_rates(ctx, alone) : CpuRates{};
  double each[4] = {alone, rates.bandwidth, rates.stream_efficiency, rates.attention_efficiency};
  all_reduce_host(g, each, 4, ReduceOp::Sum);
  alone = each[0];
  barrier(comm, g, ctx);
  GemmRate rate = gemm_rate_for(ctx, 4.0);
  double busy[2] = {rate.flops / N, rate.half_width / N};
  all_reduce_host(g, busy, 2, ReduceOp::Sum);
  out["gemm_flops_alone"] = alone, out["gemm_flops_per_rank"] = busy[0];
  out["gemm_half_width"] = busy[1];
  out["memory_bandwidth"] = each[1], out["stream_efficiency"] = each[2];
  out["attention_efficiency"] = each[3];
  if (g.rank == 0)
    printf(
        "  fp32 GEMM: %.2f GFLOP/s on one rank alone, %.2f per rank with all %d at once "
        "(%.2f ranks' worth at a time); narrow GEMMs as if at w / (w + %.0f); memory %.2f GB/s "
        "x %.2f for our loops; attention %.2f of the GEMM rate\n",
        alone / 1e9, busy[0] / 1e9, N, N * busy[0] / alone, busy[1], each[1] / 1e9, each[2],
        each[3]);
}

// Rank 0 writes the fit, atomically, where ./plan --comm-fit reads it.
static void write_fit(const Group& g, const std::string& path, const nlohmann::json& out) {
  if (g.rank != 0) return;
  const std::string text = out.dump(1) + "\n";
  write_file_atomic(path, [&](FILE* f) { write_all(f, text.data(), text.size(), path); });
  printf("wrote %s (./plan --gpu cpu --comm-fit %s)\n", path.c_str(), path.c_str());
}

// The fit on the world's group and, when the world holds 4 or more ranks in pairs, on groups of 2
// (a dp x tp 2 grid's tp groups, each pair at once as in training): `collectives` the world's,
// `groups` each size's, for plan --comm-fit. Then the GEMM rates.
static void fit_collectives(Comm& comm, const Context& ctx, const char* backend,
                            const std::string& path) {
  check_output_file("bench_comm --fit", path);  // before the minutes of measuring, on every rank
  const int N = comm.world.size;
  nlohmann::json out{{"ranks", N}, {"backend", backend}, {"device", device_name(ctx.device)}};
  out["collectives"] = fit_group(comm, comm.world, ctx, backend);
  out["groups"][std::to_string(N)] = out["collectives"];
  if (N >= 4 && N % 2 == 0) {
    Comm pairs = comm_init(N / 2, 1, 1, 2, backend, ctx.device, comm.timeout_s);
    out["groups"]["2"] = fit_group(pairs, pairs.tp, ctx, backend);
    comm_destroy(pairs);
  }
  measure_gemm_rates(comm, ctx, out);
  write_fit(comm.world, path, out);
}

// A fit bench_comm --fit wrote for `ranks` ranks (0: any), or a usage error that names the flag.
static nlohmann::json read_fit(const std::string& flag, const std::string& path, int ranks) {
  std::ifstream f(path);
  try {
    nlohmann::json fit = nlohmann::json::parse(f);
    const int fit_ranks = fit.at("ranks").get<int>();
    fit.at("gemm_flops_alone").get<double>(), fit.at("gemm_flops_per_rank").get<double>();
    if (ranks != 0 && fit_ranks != ranks) throw std::invalid_argument("ranks");
    return fit;
  } catch (const std::exception&) {
    throw UsageError(flag + " " + path + ": not a fit of " +
                     (ranks != 0 ? std::to_string(ranks) + " ranks" : std::string("bench_comm")) +
                     "; write one with bench_comm --fit " + path);
  }
}

// --rates FILE: the GEMM rates of a fit measured again, its collectives kept (tools/plan_check.sh
// measures them between its runs: a machine shared with other work changes speed by the minute).
static void refresh_rates(Comm& comm, const Context& ctx, const std::string& path) {
  nlohmann::json out = read_fit("bench_comm --rates", path, comm.world.size);
  check_output_file("bench_comm --rates", path);
  measure_gemm_rates(comm, ctx, out);
  write_fit(comm.world, path, out);
}

// --mean OUT FILE...: the first FILE with its GEMM rates replaced by their mean over every FILE,
// fits of one rank count (tools/plan_check.sh's probes, for a prediction at the check's mean).
static void mean_rates(const Group& g, const std::string& out_path,
                       const std::vector<std::string>& paths) {
  nlohmann::json out = read_fit("bench_comm --mean", paths[0], 0);
  const int ranks = out.at("ranks").get<int>();
  // The rates' means, and the half width's over the fits that measured it.
  double alone = 0, busy = 0, half_width = 0;
  int widths = 0;
  // And the memory and attention rates' over the fits that measured them.
  const char* others[] = {"memory_bandwidth", "stream_efficiency", "attention_efficiency"};
  double other[3] = {};
  int measured = 0;
  for (const std::string& path : paths) {
    nlohmann::json fit = read_fit("bench_comm --mean", path, ranks);
    alone += fit.at("gemm_flops_alone").get<double>();
    busy += fit.at("gemm_flops_per_rank").get<double>();
    if (fit.contains("gemm_half_width"))
      half_width += fit.at("gemm_half_width").get<double>(), widths++;
    if (fit.contains(others[0])) {
      for (int i = 0; i < 3; i++) other[i] += fit.at(others[i]).get<double>();
      measured++;
    }
  }
  check_output_file("bench_comm --mean", out_path);
  out["gemm_flops_alone"] = alone / paths.size(), out["gemm_flops_per_rank"] = busy / paths.size();
  if (widths > 0) out["gemm_half_width"] = half_width / widths;
  for (int i = 0; i < 3 && measured > 0; i++) out[others[i]] = other[i] / measured;
  if (g.rank == 0)
    printf("fp32 GEMM over %zu fits: %.2f GFLOP/s on one rank alone, %.2f per rank with all %d\n",
           paths.size(), alone / paths.size() / 1e9, busy / paths.size() / 1e9, ranks);
  write_fit(g, out_path, out);
}

static void dp_step(Comm& comm, Context& ctx) {
  ModelConfig c = model_preset("medium");
  int mbs = 4, T = c.seq, tokens = mbs * T;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; i++)
    ids[i] = (i * 31 + comm.grid.dp_rank) % c.vocab, targets[i] = (i * 17) % c.vocab;
  if (comm.grid.world_rank == 0) {
    printf("\ndata-parallel step, medium model, dp %d, mbs %d x seq %d per rank, %s (mean of 3)\n",
           comm.dp_cp.size, mbs, T, device_name(ctx.device));
    printf("| %-18s | %9s | %14s |\n", "gradient sync", "step ms", "exposed comm ms");
    printf("|--------------------|-----------|-----------------|\n");
  }
  struct Mode {
    const char* name;
    DpSync sync;
    bool overlap;
  };
  double exposed_no_overlap = 0, exposed_overlap = 0;
  for (Mode m :
       {Mode{"naive", DpSync::Naive, false}, Mode{"bucket, no overlap", DpSync::Bucket, false},
        Mode{"bucket", DpSync::Bucket, true}, Mode{"ring", DpSync::Ring, true}}) {
    Model model = build_model_layout(c);
    DataParallelOptions o;  // buckets of 25 MiB
    o.dp_sync = m.sync, o.no_overlap = !m.overlap;
    DataParallel dp(comm, model, ctx, o, AdamWConfig{}, 0.1f, 1);
    double step_sum = 0, exposed_sum = 0;
    for (int rep = 0; rep < 4; rep++) {
      barrier(comm, comm.world, ctx);
      double t0 = now_seconds();
      dp.begin_step(ctx);
      UnitHooks hooks = dp.hooks(ctx, true);
      Activations acts;
      model_forward(ctx, model, acts, ids.data(), targets.data(), mbs, T, Recompute::None, hooks);
      model_backward(ctx, model, acts, 1.0f / tokens, Recompute::None, hooks);
      double exposed = dp.finish(ctx);
      dp.step(ctx, 1e-5f);
      ctx.synchronize();
      double step = now_seconds() - t0;
      all_reduce_host(comm.world, &step, 1, ReduceOp::Max);
      all_reduce_host(comm.world, &exposed, 1, ReduceOp::Max);
      if (rep > 0) step_sum += step, exposed_sum += exposed;  // the first is a warm-up
    }
    if (m.sync == DpSync::Bucket)
      (m.overlap ? exposed_overlap : exposed_no_overlap) = exposed_sum / 3;
    if (comm.grid.world_rank == 0)
      printf("| %-18s | %9.1f | %15.1f |\n", m.name, step_sum / 3 * 1e3, exposed_sum / 3 * 1e3);
  }
  if (comm.grid.world_rank == 0 && exposed_no_overlap > 0)
    printf(
        "overlap hides %.0f%% of the communication the no-overlap run exposes (target: 50%% or "
        "more)\n",
        100.0 * (1.0 - exposed_overlap / exposed_no_overlap));
}

// One configuration of the ZeRO table: a fresh model, 4 steps (the first a warm-up); times are
// those of the fastest step (the slowest rank's), memory the largest rank's.
struct ZeroRun {
  double step_ms = 0, exposed_gather_ms = 0, exposed_reduce_ms = 0;
  int64_t static_bytes = 0, peak_bytes = 0, padded = 0;
};
static ZeroRun zero_run(Comm& comm, Context& ctx, int stage, bool overlap) {
  ModelConfig c = model_preset("medium");
  int mbs = 4, T = c.seq, tokens = mbs * T, N = comm.dp_cp.size;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; i++)
    ids[i] = (i * 31 + comm.grid.dp_rank) % c.vocab, targets[i] = (i * 17) % c.vocab;
  memory_reset_peak();
  ZeroRun out;
  {
    Model model = build_model_layout(c);
    Zero* zero = nullptr;  // the ZeRO columns' exposed times
    std::unique_ptr<GradientSync> sync;
    if (stage > 0)
      sync.reset(zero = new Zero(comm, model, stage, AdamWConfig{}, 0.1f, 1, overlap));
    else
      sync = std::make_unique<DataParallel>(comm, model, ctx, DataParallelOptions{}, AdamWConfig{},
                                            0.1f, 1);
    for (int rep = 0; rep < 4; rep++) {
      barrier(comm, comm.world, ctx);
      double t0 = now_seconds();
      sync->begin_step(ctx);
      UnitHooks hooks = sync->hooks(ctx, true);
      Activations acts;
      model_forward(ctx, model, acts, ids.data(), targets.data(), mbs, T, Recompute::None, hooks);
      model_backward(ctx, model, acts, 1.0f / (tokens * N), Recompute::None, hooks);
      double reduce_wait = sync->finish(ctx);
      sync->step(ctx, 1e-5f);
      ctx.synchronize();
      double times[3] = {now_seconds() - t0, zero ? zero->exposed_gather_s : 0.0,
                         zero ? zero->exposed_reduce_s : reduce_wait};
      all_reduce_host(comm.world, times, 3, ReduceOp::Max);
      if (rep == 1 || (rep > 1 && times[0] * 1e3 < out.step_ms))  // the first is a warm-up
        out.step_ms = times[0] * 1e3, out.exposed_gather_ms = times[1] * 1e3,
        out.exposed_reduce_ms = times[2] * 1e3;
    }
    MemoryStats m = memory_stats();
    out.static_bytes = (int64_t)(m.current[(int)Mem::Params] + m.current[(int)Mem::Grads] +
                                 m.current[(int)Mem::Optimizer]);
    out.peak_bytes = (int64_t)m.total_peak;
    out.padded = sync->padded_params();
  }
  double peaks[2] = {(double)out.static_bytes, (double)out.peak_bytes};
  all_reduce_host(comm.world, peaks, 2, ReduceOp::Max);  // the largest rank's
  out.static_bytes = (int64_t)peaks[0], out.peak_bytes = (int64_t)peaks[1];
  return out;
}

// `text` padded to `width` columns (Ψ is one column but two bytes, which printf's %-22s counts).
static std::string padded(const std::string& text, size_t width) {
  size_t columns = 0;
  for (unsigned char ch : text) columns += (ch & 0xC0) != 0x80;
  return text + std::string(width > columns ? width - columns : 0, ' ');
}

static void zero_steps(Comm& comm, Context& ctx) {
  ModelConfig c = model_preset("medium");
  int N = comm.dp_cp.size;
  bool root = comm.grid.world_rank == 0;
  if (root) {
    printf(
        "\nZeRO steps, medium model (Ψ = %lld), dp %d, mbs 4 x seq %d per rank, %s (fastest of 3 "
        "steps; memory: the largest rank's)\n",
        (long long)parameter_count(c), N, c.seq, device_name(ctx.device));
    printf("| %-19s | %10s | %s | %11s | %8s | %8s | %17s | %17s |\n", "stage", "static MiB",
           padded("formula (Playbook §4.1)", 23).c_str(), "formula MiB", "peak MiB", "step ms",
           "exposed gather ms", "exposed reduce ms");
    printf(
        "|---------------------|------------|-------------------------|-------------|----------|"
        "----------|-------------------|-------------------|\n");
  }
  struct Config {
    const char* name;
    int stage;
    bool overlap;
  };
  std::vector<ZeroRun> runs;
  bool formulas_hold = true;
  for (Config k :
       {Config{"zero 0 (dp)", 0, true}, Config{"zero 1", 1, true}, Config{"zero 2", 2, true},
        Config{"zero 3, prefetch", 3, true}, Config{"zero 3, no prefetch", 3, false}}) {
    ZeroRun r = zero_run(comm, ctx, k.stage, k.overlap);
    double formula = zero_static_memory(k.stage, (double)r.padded, N).total();
    formulas_hold = formulas_hold && r.static_bytes == formula;
    runs.push_back(r);
    if (root)
      printf("| %-19s | %10.2f | %s | %11.2f | %8.1f | %8.1f | %17.1f | %17.1f |\n", k.name,
             r.static_bytes / 1048576.0, padded(zero_memory_formula(k.stage), 23).c_str(),
             formula / 1048576.0, r.peak_bytes / 1048576.0, r.step_ms, r.exposed_gather_ms,
             r.exposed_reduce_ms);
  }
  if (!root) return;
  bool falls = runs[0].peak_bytes > runs[1].peak_bytes && runs[1].peak_bytes > runs[2].peak_bytes &&
               runs[2].peak_bytes > runs[3].peak_bytes;
  printf("static memory per rank equals the formula at Ψ' (Ψ plus padding) for every stage: %s\n",
         formulas_hold ? "yes" : "NO");
  printf(
      "peak memory per rank falls with each stage (target): %s (%.1f -> %.1f -> %.1f -> %.1f "
      "MiB)\n",
      falls ? "yes" : "NO", runs[0].peak_bytes / 1048576.0, runs[1].peak_bytes / 1048576.0,
      runs[2].peak_bytes / 1048576.0, runs[3].peak_bytes / 1048576.0);
  if (runs[4].exposed_gather_ms > 0) {
    double hidden =
        std::round(100.0 * (1.0 - runs[3].exposed_gather_ms / runs[4].exposed_gather_ms));
    printf("prefetch hides %.0f%% of ZeRO-3's exposed gather time (target: 50%% or more)%s\n",
           hidden + 0.0,
           ctx.device == Device::CPU
               ? "; on CPU ranks MPI moves data only inside MPI calls, on the cores "
                 "that compute, so a prefetched gather waits for the next hook"
               : "");
  }
}

int main(int argc, char** argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int local = 0, local_size = 1;
  local_rank(&local, &local_size, 600);  // the comm_init timeout below
  openblas_set_num_threads(std::max(1, (int)std::thread::hardware_concurrency() / local_size));
  std::vector<std::pair<Device, const char*>> runs = {{Device::CPU, "mpi"}};
  if (cuda_available()) {
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaSetDevice(local % gpus));
    runs.push_back({Device::CUDA, local_size <= gpus ? "nccl" : "mpi"});
  }
  // --bandwidth-only, --zero-only, --fit FILE, --rates FILE, --mean OUT FILE...
  std::string only = argc > 1 ? argv[1] : "";
  const bool to_file = only == "--fit" || only == "--rates";
  if ((!only.empty() && only != "--bandwidth-only" && only != "--zero-only" && !to_file &&
       only != "--mean") ||
      (to_file && argc < 3) || (only == "--mean" && argc < 4)) {
    fprintf(stderr,
            "usage: bench_comm [--bandwidth-only | --zero-only | --fit FILE | "
            "--rates FILE | --mean OUT FILE...]\n");
    MPI_Finalize();
    return 2;
  }
  if (only == "--mean") {  // files only: every rank reads them, rank 0 writes
    Group world_group;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_group.rank);
    try {
      mean_rates(world_group, argv[2], std::vector<std::string>(argv + 3, argv + argc));
    } catch (const UsageError& e) {
      if (world_group.rank == 0) fprintf(stderr, "error: %s\n", e.what());
      MPI_Finalize();
      return 2;
    }
    MPI_Finalize();
    return 0;
  }
  if (to_file) runs.resize(1);  // the CPU ranks: what ./plan --gpu cpu prices
  for (auto [device, backend] : runs) {
    Comm comm = comm_init(world, 1, 1, 1, backend, device, 600);
    Context ctx = Context::create(device);
    if (to_file) {
      try {
        if (only == "--fit") fit_collectives(comm, ctx, backend, argv[2]);
        if (only == "--rates") refresh_rates(comm, ctx, argv[2]);
      } catch (const UsageError& e) {  // every rank reads the same file, so all stop here
        if (comm.world.rank == 0) fprintf(stderr, "error: %s\n", e.what());
        MPI_Finalize();
        return 2;
      }
      ctx.destroy();
      comm_destroy(comm);
      continue;
    }
    if (only != "--zero-only") bandwidth(comm, ctx, backend);
    if (only != "--zero-only") all_to_all_bandwidth(comm, ctx, backend);
    if (only.empty()) dp_step(comm, ctx);
    if (only != "--bandwidth-only") zero_steps(comm, ctx);
    ctx.destroy();
    comm_destroy(comm);
  }
  MPI_Finalize();
  return 0;
}
