// report.cu: the measured side of the book's formulas. The one idea: every byte allocated
// and every byte sent is counted where it happens, so a report is a reading, not an estimate.
#include <algorithm>
#include <cmath>

#include "runtime/dtype.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"

void print_memory(int64_t num_params, int zero_stage, int ranks, Precision precision,
                  bool bf16_grads) {
  MemoryStats m = memory_stats();
  printf("memory (peak / now):\n");
  for (int i = 0; i < (int)Mem::Count; i++)
    printf("  %-12s %12s / %s\n", mem_name((Mem)i), human_bytes(m.peak[i]).c_str(),
           human_bytes(m.current[i]).c_str());
  // CUDA and meta: what the arena took from the device, live or held free for reuse.
  const ArenaBytes reserved = arena_reserved();
  if (reserved.peak > 0)
    printf(
        "  reserved     %12s / %s (the device's buffers, live or held for reuse by size, given "
        "back if an allocation fails, as PyTorch's memory_reserved; the categories' peak "
        "together: %s)\n",
        human_bytes(reserved.peak).c_str(), human_bytes(reserved.now).c_str(),
        human_bytes(m.total_peak).c_str());
  size_t stat =
      m.current[(int)Mem::Params] + m.current[(int)Mem::Grads] + m.current[(int)Mem::Optimizer];
  printf("  static (params + grads + optimizer) = %s = %.2f bytes/parameter ",
         human_bytes(stat).c_str(), (double)stat / num_params);
  // The book's bytes for this run: fp32's 4 + 4 + 8, or mixed precision's 2 + 4 (2) + 12.
  const BytesPerParameter b = bytes_per_parameter(precision, bf16_grads);
  const char* what = precision == Precision::FP32 ? "fp32" : precision_name(precision);
  if (zero_stage == 0)
    printf("(Playbook §2.4, %s: %s = %.0f)\n", what, zero_memory_formula(0, b).c_str(),
           zero_static_memory(0, 1.0, 1, b).total());
  else
    printf("(Playbook §4.1, ZeRO-%d over %d ranks, %s: %s = %.2f)\n", zero_stage, ranks, what,
           zero_memory_formula(zero_stage, b).c_str(),
           zero_static_memory(zero_stage, 1.0, ranks, b).total());
}

void print_precision_memory(Precision p, int64_t num_params, int64_t master_bytes,
                            bool bf16_grads) {
  MemoryStats m = memory_stats();
  const double params = (double)m.current[(int)Mem::Params] / num_params;
  const double grads = (double)m.current[(int)Mem::Grads] / num_params;
  const double optimizer = (double)m.current[(int)Mem::Optimizer] / num_params;
  // fp32: the weights are what the optimizer updates. Mixed precision: the compute-format
  // weights (a copy, ZeRO-1/2's whole bf16 weights, ZeRO-3's bf16 shard) count as Params and
  // the fp32 master weights within Optimizer.
  const bool low = p != Precision::FP32;
  PICO_ASSERT(!low || master_bytes > 0, "mixed precision keeps fp32 master weights");
  const double weights = params;
  const double master = low ? (double)master_bytes / num_params : 0.0;
  const double adam = optimizer - master;
  printf("bytes per parameter by role, --dtype %s (Playbook §Mixed precision training):\n",
         precision_name(p));
  printf("  %-26s %8s %10s %8s %10s %7s\n", "", "weights", "gradients", "master", "Adam m, v",
         "total");
  printf("  %-26s %8d %10d %8s %10d %7d\n", "book, fp32", 4, 4, "-", 8, 16);
  printf("  %-26s %8d %10d %8d %10d %7d   (+ 4 for fp32 gradient accumulation: 20)\n",
         "book, bf16 + fp32 master", 2, 2, 4, 8, 16);
  char master_str[16] = "-";
  if (low) snprintf(master_str, sizeof master_str, "%.2f", master);
  printf("  %-26s %8.2f %10.2f %8s %10.2f %7.2f   %s\n", "this rank, measured", weights, grads,
         master_str, adam, weights + grads + master + adam,
         !low ? ""
         : bf16_grads
             ? "(--grad-acc-dtype bf16: each unit accumulates in fp32 while its backward runs)"
             : "(gradients accumulate in fp32: no bf16 gradient copy)");
}

// An exact byte count as an integer, a fractional one (a formula at Psi / N) with two decimals.
static std::string bytes_str(double b) {
  char buf[32];
  snprintf(buf, sizeof buf, b == std::floor(b) ? "%.0f" : "%.2f", b);
  return buf;
}

void print_memory_report(Comm& comm, int zero_stage, int64_t num_params, int64_t padded_params,
                         Precision precision, bool bf16_grads) {
  const int kFields = 5;  // params, grads, optimizer (current), activations, workspace (peak)
  MemoryStats m = memory_stats();
  int64_t mine[kFields] = {
      (int64_t)m.current[(int)Mem::Params], (int64_t)m.current[(int)Mem::Grads],
      (int64_t)m.current[(int)Mem::Optimizer], (int64_t)m.peak[(int)Mem::Activations],
      (int64_t)m.peak[(int)Mem::Workspace]};
  int world = comm.grid.world_size;
  std::vector<int64_t> all = gather_report(comm, mine, kFields, "gather of the memory report");
  if (!comm.grid.prints()) return;
  int N = comm.dp_cp.size;
  const BytesPerParameter b = bytes_per_parameter(precision, bf16_grads);
  StaticMemory book = zero_static_memory(zero_stage, (double)num_params, N, b);
  StaticMemory expected = zero_static_memory(zero_stage, (double)padded_params, N, b);
  if (b.params == 4)
    printf(
        "memory per rank (--report memory), ZeRO-%d over dp_cp, N = %d: bytes now; fp32, so 4 "
        "per weight, 4 per gradient, 8 per parameter for Adam's m and v\n",
        zero_stage, N);
  else
    printf(
        "memory per rank (--report memory), ZeRO-%d over dp_cp, N = %d: bytes now; --dtype %s, "
        "so 2 per weight (%s), %g per gradient, 12 per parameter for the fp32 master weight "
        "and Adam's m and v\n",
        zero_stage, N, precision_name(precision), precision == Precision::FP16 ? "fp16" : "bf16",
        b.grads);
  printf("  Ψ = %lld parameters", (long long)num_params);
  if (zero_stage > 0)
    printf(
        "; each unit (embedding, block, head) splits into N equal shards: Ψ' = N x %lld = %lld, "
        "%lld of them padding",
        (long long)(padded_params / N), (long long)padded_params,
        (long long)(padded_params - num_params));
  printf("\n  %-9s %12s %12s %12s %12s   %s\n", "rank", "params", "grads", "optimizer", "static",
         "peak activations, workspace");
  bool all_match = true;
  for (int r = 0; r < world; r++) {
    if (!row_gathered(comm, r)) continue;
    const int64_t* f = &all[r * kFields];
    all_match = all_match && f[0] == expected.params && f[1] == expected.grads &&
                f[2] == expected.optimizer;
    printf("  %-9d %12lld %12lld %12lld %12lld   %s, %s\n", r, (long long)f[0], (long long)f[1],
           (long long)f[2], (long long)(f[0] + f[1] + f[2]), human_bytes(f[3]).c_str(),
           human_bytes(f[4]).c_str());
  }
  auto row = [](const char* label, const StaticMemory& s, const std::string& what) {
    printf("  %-9s %12s %12s %12s %12s   %s\n", label, bytes_str(s.params).c_str(),
           bytes_str(s.grads).c_str(), bytes_str(s.optimizer).c_str(), bytes_str(s.total()).c_str(),
           what.c_str());
  };
  row("book", book, std::string("Playbook §4.1: ") + zero_memory_formula(zero_stage, b));
  if (zero_stage > 0) {
    row("+ padding",
        {expected.params - book.params, expected.grads - book.grads,
         expected.optimizer - book.optimizer},
        "the formula at Ψ' - Ψ");
    row("= padded", expected, "the formula at Ψ', what every rank should hold");
  }
  printf("  every rank holds exactly the formula's bytes%s: %s\n", zero_stage > 0 ? " at Ψ'" : "",
         all_match ? "yes" : "NO");
  printf(
      "  (ZeRO does not shard activations. Workspace holds what is transient: ZeRO-2/3 the "
      "gradients of the unit in backward, ZeRO-3 the gathered weights of the units in use, and "
      "the whole model while it evaluates.)\n");
}

void print_comm_report(Comm& comm, int64_t num_params, int64_t steps, int64_t expert_params) {
  std::vector<Group*> groups = comm.groups();
  const int C = (int)Coll::Count, G = (int)groups.size(), F = 3;  // calls, elements, bytes
  std::vector<int64_t> mine;  // [group][collective][calls, elements, bytes]
  for (Group* g : groups)
    for (int c = 0; c < C; c++)
      mine.insert(mine.end(), {g->stats[c].calls, g->stats[c].elements, g->stats[c].bytes});
  int world = comm.grid.world_size;
  std::vector<int64_t> all =
      gather_report(comm, mine.data(), (int)mine.size(), "gather of the comm report");
  if (!comm.grid.prints()) return;
  steps = std::max<int64_t>(1, steps);
  printf(
      "communication per step (--report comm; averaged over %lld steps, validation and "
      "checkpoints included):\n",
      (long long)steps);
  printf(
      "  counted at each call on rank 0: calls, and elements (floats of its data argument); "
      "charged by formula: bytes each rank sent (library collectives: the ring algorithm's "
      "share; send_recv: counted)\n");
  printf("  %-6s %3s  %-15s %10s %14s %16s %18s\n", "group", "N", "collective", "calls", "elements",
         "bytes (formula)", "min..max, ranks");
  for (int g = 0; g < G; g++) {
    if (groups[g]->size == 1) continue;
    for (int c = 0; c < C; c++) {
      int64_t lo = INT64_MAX, hi = 0;
      for (int r = 0; r < world; r++) {
        if (!row_gathered(comm, r)) continue;
        int64_t b = all[r * mine.size() + (g * C + c) * F + 2];
        lo = std::min(lo, b), hi = std::max(hi, b);
      }
      // calls, elements, bytes of the printing rank
      const int64_t* rank0 = &all[(size_t)comm.grid.world_rank * mine.size() + (g * C + c) * F];
      if (rank0[0] == 0) continue;
      printf("  %-6s %3d  %-15s %10.1f %14.1f %16s %8s..%s\n", groups[g]->name.c_str(),
             groups[g]->size, coll_name((Coll)c), (double)rank0[0] / steps,
             (double)rank0[1] / steps, human_bytes((double)rank0[2] / steps).c_str(),
             human_bytes((double)lo / steps).c_str(), human_bytes((double)hi / steps).c_str());
    }
  }
  for (auto [g, params] :
       {std::pair{&comm.dp_cp, num_params - expert_params}, {&comm.edp_cp, expert_params}}) {
    const int N = g->size;
    if (N == 1 || params == 0) continue;
    double K = 4.0 * params;  // fp32 gradients
    printf("  gradient sync over %s, K = 4 bytes x %lld parameters = %s:\n", g->name.c_str(),
           (long long)params, human_bytes(K).c_str());
    printf(
        "    ring all-reduce 2(N-1)K/N = %s per rank per step (naive, bucket: all_reduce; "
        "ring: send_recv)\n",
        human_bytes(2.0 * (N - 1) * K / N).c_str());
  }
}

void print_zero_comm_report(const Comm& comm, const ZeroCommReport& r) {
  if (!comm.grid.prints()) return;
  const int N = r.ranks, stage = r.stage, grad_acc = r.grad_acc;
  const int64_t steps = std::max<int64_t>(1, r.steps), psi = r.psi;
  const ZeroTraffic &got = r.measured, &want = r.expected;
  const int wb = (int)dtype_size(r.weights), gb = (int)dtype_size(r.grads);
  auto name = [](DType t) { return t == DType::F32 ? "fp32" : t == DType::BF16 ? "bf16" : "fp16"; };
  printf(
      "ZeRO-%d traffic per training step over dp_cp (N = %d; averaged over %lld steps; "
      "validation and checkpoint gathers excluded; gradients %s, %d bytes per element; weights "
      "gathered in %s, %d):\n",
      stage, N, (long long)steps, name(r.grads), gb, name(r.weights), wb);
  printf("  %-15s %10s %14s   %10s %14s\n", "collective", "calls", "bytes", "expected", "bytes");
  printf("  %-15s %10.1f %14.0f   %10lld %14lld\n", "reduce_scatter",
         (double)got.reduce_scatter_calls / steps, (double)got.reduce_scatter_bytes / steps,
         (long long)want.reduce_scatter_calls, (long long)want.reduce_scatter_bytes);
  printf("  %-15s %10.1f %14.0f   %10lld %14lld\n", "all_gather",
         (double)got.all_gather_calls / steps, (double)got.all_gather_bytes / steps,
         (long long)want.all_gather_calls, (long long)want.all_gather_bytes);
  double total = (double)(got.reduce_scatter_bytes + got.all_gather_bytes) / steps;
  printf("  %-15s %10s %14.0f   %10s %14lld\n", "total", "", total, "",
         (long long)(want.reduce_scatter_bytes + want.all_gather_bytes));
  // The book's Ψ(N-1)/N reduce-scattered and Ψ(N-1)/N all-gathered (twice under ZeRO-3), each
  // at its element size.
  const double gathers = stage == 3 ? 2.0 : 1.0, padded = (double)r.padded;
  const double per = gb + gathers * wb;
  printf(
      "  book, Playbook §4.4: %.0fΨ(N-1)/N elements (Ψ(N-1)/N x %d bytes + %.0fΨ(N-1)/N x %d) = "
      "%s bytes (Ψ = %lld), %s at Ψ' (padded)\n",
      1 + gathers, gb, gathers, wb, bytes_str(psi * (N - 1.0) / N * per).c_str(), (long long)psi,
      bytes_str(padded * (N - 1) / N * per).c_str());
  if (stage == 2 && grad_acc > 1)
    printf(
        "  ZeRO-2 keeps no full gradient across micro-batches: it reduce-scatters each of the %d, "
        "accumulating into the shard: %d x Ψ(N-1)/N more\n",
        grad_acc, grad_acc - 1);
  if (stage == 3)
    printf(
        "  ZeRO-3, per micro-batch (x %d): the forward gathers every unit%s; the backward every "
        "block, not the head (still resident from the forward) nor the embedding (its backward "
        "reads no weights)\n",
        grad_acc, r.tied ? ", and the embedding again for the tied head" : "");
}

// ----------------------------------------------------------------------------
// Tensor parallelism

void print_activation_report(int64_t measured, int64_t formula, const std::string& run,
                             const ActivationTerms& t, bool sp, int e, int er, bool routed) {
  printf("activations per block and micro-batch (--report memory; %s, %s):\n", run.c_str(),
         e == 4    ? "stored in fp32"
         : er == 4 ? "stored in 16 bits, residual stream and statistics fp32"
                   : "stored in 16 bits with the residual stream, statistics fp32");
  printf("  measured %s (%lld B), formula %s (%lld B)%s\n", human_bytes(measured).c_str(),
         (long long)measured, human_bytes(formula).c_str(), (long long)formula,
         measured == formula ? ", equal"
         : routed            ? ", the routing's (the formula assumes it balanced)"
                             : ", DIFFERENT");
  printf(
      "  formula: N(%s)/%s + N(%s + %s)/tp bytes, N = mbs x seq: the book's sbh(34 + 5as/h) for "
      "%s; norms and residuals (the book's 10) shrink with tp only under sp (34/t); attention "
      "keeps %s per token (the probabilities%s: %s, the 5as/h term; FlashAttention's "
      "log-sum-exp: 4 Hq, linear in the sequence)\n",
      t.outside.c_str(), sp ? "tp" : "1", t.inside.c_str(), t.attention.c_str(), t.block.c_str(),
      t.attention.c_str(), t.dropout ? ", dropout's mask and what it left" : "",
      (std::to_string(t.dropout ? 2 * e + 1 : e) + " Hq T").c_str());
  if (routed)
    printf(
        "  a mixture of experts keeps k(2D + 3F/tp) x %d bytes per token in place of 3F/tp x %d:"
        " each of a token's k rows at its expert (input, output, gate, up, SwiGLU)\n",
        e, e);
}

void print_tp_comm_report(const TpTraffic& e, int grad_acc, int tp, bool sp,
                          const CollStats* measured, int64_t steps) {
  steps = std::max<int64_t>(1, steps);
  printf(
      "tensor-parallel traffic per training step (--report comm; tp %d%s, %d micro-batches, "
      "rank 0; calls and elements counted, bytes charged by the ring formula):\n",
      tp, sp ? " + sp" : "", grad_acc);
  auto row = [&](Coll c, int64_t expected) {
    const CollStats& m = measured[(int)c];
    int64_t got = m.bytes / steps;
    printf("  %-15s %6.1f calls %12.1f elements, bytes %12s, model's count %12s%s\n", coll_name(c),
           (double)m.calls / steps, (double)m.elements / steps, human_bytes(got).c_str(),
           human_bytes((double)expected * grad_acc).c_str(),
           got == expected * grad_acc ? " (equal)" : "");
  };
  row(Coll::AllReduce, e.all_reduce);
  row(Coll::AllGather, e.all_gather);
  row(Coll::ReduceScatter, e.reduce_scatter);
  printf(
      "  the book: TP sends 4 all-reduces of s·b·h per block (2 forward, 2 backward), TP+SP "
      "the same bytes as all-gathers and reduce-scatters (AR = RS + AG), plus the backward's "
      "re-gathers of the norm outputs here (Megatron's choice: activations stay sharded)\n");
}

void print_bubble_report(Comm& comm, const BubblePrediction& paper,
                         const ScheduleMeasure& measured) {
  const Grid& G = comm.grid;
  double mine[3] = {measured.busy_s, measured.step_s, (double)measured.peak_in_flight};
  std::vector<double> all = gather_report(comm, mine, 3, "gather of a report");
  if (!G.prints()) return;
  const int p = paper.p, m = paper.m, V = paper.V;
  printf(
      "pipeline bubble (--report bubble; %s, p = %d stages, m = %d micro-batches, V = %d; "
      "averaged over %d steps):\n",
      paper.schedule.c_str(), p, m, V, measured.steps);
  printf("  %5s %9s %9s %13s %12s %11s %19s\n", "stage", "busy ms", "step ms", "idle measured",
         "idle ticks", "book", "in flight measured");
  int steps = std::max(1, measured.steps);
  for (int s = 0; s < p; s++) {
    // dp, cp and tp rank 0 of stage s (a simulated world: the stage this process runs)
    const int rank =
        G.simulated ? G.rank_of(G.dp_rank, s, G.cp_rank, G.tp_rank) : G.rank_of(0, s, 0, 0);
    if (!row_gathered(comm, rank)) continue;
    const double* r = &all[3 * rank];
    printf("  %5d %9.2f %9.2f %12.1f%% %11.1f%% %10.1f%% %9d (tables: %d)\n", s, r[0] / steps * 1e3,
           r[1] / steps * 1e3, 100.0 * (1.0 - r[0] / std::max(r[1], 1e-12)),
           100.0 * (1.0 - paper.busy_ticks[s] / paper.makespan_ticks), 100.0 * paper.book,
           (int)r[2], paper.peak_in_flight[s]);
  }
  printf(
      "the schedule's tables in ticks of t_f (a backward takes 2, a B and a W split from it one "
      "each; F3 forward of micro-batch 3%s%s, . idle):\n%s",
      V > 1 ? ", F3.1 of its chunk 1" : "",
      paper.chart.find('&') != std::string::npos ? ", &B2 run with the op before it (F&B)" : "",
      paper.chart.c_str());
  printf(
      "  book: idle share %s. The ticks are exact; measured wall-clock time also counts "
      "communication and, on CPU ranks sharing cores, time-slicing.\n",
      paper.formula.c_str());
}

void print_balance_report(Comm& comm, const std::string& split, int64_t blocks, int64_t pairs,
                          double seconds, int64_t steps) {
  const Grid& G = comm.grid;
  double mine[3] = {(double)blocks, (double)pairs, seconds};
  std::vector<double> all = gather_report(comm, mine, 3, "gather of a report");
  if (!G.prints() || G.cp == 1) return;
  double n = (double)std::max<int64_t>(1, steps);
  printf(
      "attention work per cp rank and training step (--report balance; %s; pairs "
      "of one sequence and head, summed over blocks and layers):\n",
      split.c_str());
  printf("  %7s %10s %14s %12s\n", "cp rank", "blocks", "(q, k) pairs", "time ms");
  for (int r = 0; r < G.cp; r++) {
    const int rank =
        G.simulated ? G.rank_of(G.dp_rank, G.pp_rank, r, G.tp_rank) : G.rank_of(0, 0, r, 0);
    if (!row_gathered(comm, rank)) continue;
    const double* w = &all[3 * rank];
    printf("  %7d %10.1f %14.0f %12.2f\n", r, w[0] / n, w[1] / n, w[2] / n * 1e3);
  }
  printf(
      "  book (§7.3): with contiguous chunks rank r attends to r + 1 blocks (1 : 2 : ... : cp), "
      "so the last rank sets the pace; zig-zag (chunks r and 2cp - 1 - r) gives every rank "
      "the same pairs\n");
}

// ----------------------------------------------------------------------------
// Expert parallelism

void print_expert_report(Comm& comm, const std::string& setup, int layers, int experts,
                         const ExpertStats& stats, int64_t steps) {
  // [routed L x E | dropped L | layer aux L | layer batches L | aux | batches], summed.
  const size_t L = layers, E = experts;
  std::vector<double> all(L * E + 3 * L + 2, 0.0);
  for (size_t l = 0; l < stats.routed.size() && l < L; l++) {
    for (size_t e = 0; e < E; e++) all[l * E + e] = (double)stats.routed[l][e];
    all[L * E + l] = (double)stats.dropped[l];
    all[L * E + L + l] = stats.layer_aux[l];
    all[L * E + 2 * L + l] = (double)stats.layer_batches[l];
  }
  all[L * E + 3 * L] = stats.aux_sum, all[L * E + 3 * L + 1] = (double)stats.batches;
  all_reduce_host(comm.world, all.data(), (int)all.size(), ReduceOp::Sum);
  if (!comm.grid.prints()) return;
  double n = (double)std::max<int64_t>(1, steps);
  printf(
      "experts per layer (--report experts; %s): (token, slot) pairs routed to each expert "
      "per training step, over every data-parallel rank\n",
      setup.c_str());
  printf("  %5s %9s %9s %9s %9s %12s %13s\n", "layer", "min", "mean", "max", "max/mean", "dropped",
         "balance loss");
  for (size_t l = 0; l < L; l++) {
    const double* r = &all[l * E];
    double lo = *std::min_element(r, r + E), hi = *std::max_element(r, r + E), mean = 0;
    for (size_t e = 0; e < E; e++) mean += r[e] / E;
    double batches = std::max(1.0, all[L * E + 2 * L + l]);
    printf("  %5zu %9.1f %9.1f %9.1f %9.3f %12.1f %13.4f\n", l, lo / n, mean / n, hi / n,
           mean > 0 ? hi / mean : 0.0, all[L * E + l] / n, all[L * E + L + l] / batches);
  }
  double batches = std::max(1.0, all[L * E + 3 * L + 1]);
  printf(
      "  load-balancing loss (transformers' load_balancing_loss_func, every layer's tokens "
      "together), per micro-batch: %.4f\n",
      all[L * E + 3 * L] / batches);
  printf(
      "  book (EP): E sum_e f_e P_e is k (top-k) when every expert gets tokens x k / E rows "
      "and 1/E of the probability; max/mean 1 is perfect balance\n");
}

void print_expert_comm_report(const CollStats& measured, double uniform_per_step,
                              double routed_per_step, int64_t steps, int passes, int value_bytes) {
  double n = (double)std::max<int64_t>(1, steps);
  printf(
      "expert all-to-all per training step, this rank (--report comm; %d passes per block: "
      "dispatch and combine each):\n",
      passes);
  printf("  measured                %12.0f bytes in %.0f calls\n", measured.bytes / n,
         measured.calls / n);
  printf("  the routing measured    %12.0f bytes (every row that left or came back, %d D bytes)\n",
         routed_per_step, value_bytes);
  printf(
      "  uniform routing (book)  %12.0f bytes (2 N k (ep - 1) / ep x %d D per block, "
      "micro-batch and pass)\n",
      uniform_per_step, value_bytes);
}

void print_expert_memory(int64_t measured_bytes, int64_t formula_bytes,
                         const std::string& formula) {
  printf("expert weights on this rank: %s (%lld bytes); formula %s = %lld bytes%s\n",
         human_bytes((double)measured_bytes).c_str(), (long long)measured_bytes, formula.c_str(),
         (long long)formula_bytes, measured_bytes == formula_bytes ? ", equal" : ", DIFFERENT");
}
// ----------------------------------------------------------------------------
// A mixture's meter: what the training steps routed (--report experts, memory, comm) and the
// step's load-balancing loss

namespace {
class ExpertMeter : public StepMeter {
 public:
  ExpertMeter(Comm& comm, const ModelConfig& cfg, ExpertStats*& recorded, const ExpertSteps& steps)
      : comm_(comm),
        cfg_(cfg),
        recorded_(recorded),
        steps_(steps),
        traffic_(comm.ep, {StepPart::Schedule}) {}
  void begin(StepPart p, int64_t step) override {
    traffic_.begin(p, step);
    if (p != StepPart::Schedule) return;
    recorded_ = &stats_;  // the training steps' schedules only, not validation's
    aux_before_ = stats_.aux_sum;
  }
  void end(StepPart p) override {
    if (p == StepPart::Schedule) recorded_ = nullptr;
    traffic_.end(p);
  }
  // The step's load-balancing loss per micro-batch, over every data-parallel rank: logged
  // apart from the loss, which stays the language model's (its gradient is in the step's).
  void log(StepLog& log) override {
    double aux = stats_.aux_sum - aux_before_;
    all_reduce_host(comm_.world, &aux, 1, ReduceOp::Sum);
    aux /= (double)steps_.grad_acc * steps_.dp;
    char text[32];
    snprintf(text, sizeof text, " | aux %.4f", aux);
    log.after_loss += text;
    log.fields["aux_loss"] = aux;
  }
  void report(Report r) override {
    const bool main_rank = comm_.grid.prints();
    const int64_t steps = traffic_.steps(), D = cfg_.d_model, ep = comm_.ep.size;
    const int64_t per = cfg_.experts / ep, blocks = steps_.blocks;
    if (r == Report::Memory && main_rank)  // this rank's experts: E / ep per block
      print_expert_memory(steps_.expert_params * 4,
                          blocks * per * 3 * D * (cfg_.ffn / comm_.tp.size) * 4,
                          std::to_string(blocks) + " blocks x " + std::to_string(per) +
                              " experts (E / ep) x 3 D F / tp x 4");
    if (r == Report::Comm && main_rank && ep > 1) {  // every rank charged what it sends
      const int b = steps_.value_bytes;
      double routed = steps_.passes * (double)b * D *
                      (stats_.rows_elsewhere + stats_.rows_arrived) /
                      (double)std::max<int64_t>(1, steps);
      print_expert_comm_report(traffic_.total()[(int)Coll::AllToAll], steps_.uniform_a2a, routed,
                               steps, steps_.passes, b);
    }
    if (r == Report::Experts) {
      std::string capacity = steps_.capacity_factor > 0
                                 ? ", capacity factor " + num(steps_.capacity_factor)
                                 : std::string(", dropless");
      print_expert_report(comm_,
                          std::to_string(cfg_.experts) + " experts, top " +
                              std::to_string(cfg_.top_k) + ", ep " + std::to_string(ep) + capacity,
                          cfg_.layers, cfg_.experts, stats_, steps);
    }
  }
  bool answers(Report r) const override {
    return r == Report::Memory || r == Report::Experts || (r == Report::Comm && comm_.ep.size > 1);
  }

 private:
  Comm& comm_;
  const ModelConfig& cfg_;
  ExpertStats*& recorded_;  // where the layers record (ExpertParallel::stats)
  ExpertSteps steps_;
  GroupTraffic traffic_;  // the ep group's all-to-alls in the schedules
  ExpertStats stats_;
  double aux_before_ = 0;
};
}  // namespace

std::unique_ptr<StepMeter> expert_meter(Comm& comm, const ModelConfig& cfg, ExpertStats*& recorded,
                                        const ExpertSteps& steps) {
  return std::make_unique<ExpertMeter>(comm, cfg, recorded, steps);
}
