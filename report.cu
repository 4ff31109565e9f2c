// report.cu: the measured side of the book's formulas. The one idea: every byte allocated
// and every byte sent is counted where it happens, so a report is a reading, not an estimate.
#include <algorithm>
#include <cmath>

#include "report.cuh"

void print_memory(int64_t num_params, int zero_stage, int ranks) {
  MemoryStats m = memory_stats();
  printf("memory (peak / now):\n");
  for (int i = 0; i < (int)Mem::Count; i++)
    printf("  %-12s %12s / %s\n", mem_name((Mem)i), human_bytes(m.peak[i]).c_str(),
           human_bytes(m.current[i]).c_str());
  size_t stat = m.current[(int)Mem::Params] + m.current[(int)Mem::Grads] +
                m.current[(int)Mem::Optimizer];
  printf("  static (params + grads + optimizer) = %s = %.2f bytes/parameter ",
         human_bytes(stat).c_str(), (double)stat / num_params);
  if (zero_stage == 0)
    printf("(Playbook §2.4, fp32: 16)\n");
  else
    printf("(Playbook §4.1, ZeRO-%d over %d ranks, fp32: %s = %.2f)\n", zero_stage, ranks,
           zero_memory_formula(zero_stage), zero_static_memory(zero_stage, 1.0, ranks).total());
}

// An exact byte count as an integer, a fractional one (a formula at Psi / N) with two decimals.
static std::string bytes_str(double b) {
  char buf[32];
  snprintf(buf, sizeof buf, b == std::floor(b) ? "%.0f" : "%.2f", b);
  return buf;
}

void print_memory_report(Comm& comm, int zero_stage, int64_t num_params, int64_t padded_params) {
  const int kFields = 5;  // params, grads, optimizer (current), activations, workspace (peak)
  MemoryStats m = memory_stats();
  int64_t mine[kFields] = {
      (int64_t)m.current[(int)Mem::Params], (int64_t)m.current[(int)Mem::Grads],
      (int64_t)m.current[(int)Mem::Optimizer], (int64_t)m.peak[(int)Mem::Activations],
      (int64_t)m.peak[(int)Mem::Workspace]};
  int world = comm.grid.world_size;
  std::vector<int64_t> all(world * kFields);
  MPI_CHECK(
      MPI_Gather(mine, kFields, MPI_INT64_T, all.data(), kFields, MPI_INT64_T, 0, comm.world.mpi));
  if (comm.grid.world_rank != 0) return;
  int N = comm.dp_cp.size;
  StaticMemory book = zero_static_memory(zero_stage, (double)num_params, N);
  StaticMemory expected = zero_static_memory(zero_stage, (double)padded_params, N);
  printf(
      "memory per rank (--report memory), ZeRO-%d over dp_cp, N = %d: bytes now; fp32, so 4 per "
      "weight, 4 per gradient, 8 per parameter for Adam's m and v\n",
      zero_stage, N);
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
  row("book", book, std::string("Playbook §4.1: ") + zero_memory_formula(zero_stage));
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

void print_comm_report(Comm& comm, int64_t num_params, int64_t steps) {
  std::vector<Group*> groups = comm.groups();
  const int C = (int)Coll::Count, G = (int)groups.size();
  std::vector<int64_t> mine;  // [group][collective][calls, bytes]
  for (Group* g : groups)
    for (int c = 0; c < C; c++) mine.push_back(g->stats[c].calls), mine.push_back(g->stats[c].bytes);
  int world = comm.grid.world_size;
  std::vector<int64_t> all(world * mine.size());
  MPI_CHECK(MPI_Gather(mine.data(), (int)mine.size(), MPI_INT64_T, all.data(), (int)mine.size(),
                       MPI_INT64_T, 0, comm.world.mpi));
  if (comm.grid.world_rank != 0) return;
  steps = std::max<int64_t>(1, steps);
  printf("communication per step (--report comm; averaged over %lld steps; bytes each rank sent):\n",
         (long long)steps);
  printf("  %-6s %3s  %-15s %10s %14s %14s\n", "group", "N", "collective", "calls", "rank 0",
         "min..max");
  for (int g = 0; g < G; g++) {
    if (groups[g]->size == 1) continue;
    for (int c = 0; c < C; c++) {
      int64_t lo = INT64_MAX, hi = 0;
      for (int r = 0; r < world; r++) {
        int64_t b = all[r * mine.size() + (g * C + c) * 2 + 1];
        lo = std::min(lo, b), hi = std::max(hi, b);
      }
      int64_t calls = all[(g * C + c) * 2], bytes = all[(g * C + c) * 2 + 1];
      if (calls == 0) continue;
      printf("  %-6s %3d  %-15s %10.1f %14s %6s..%s\n", groups[g]->name.c_str(),
             groups[g]->size, coll_name((Coll)c), (double)calls / steps,
             human_bytes((double)bytes / steps).c_str(), human_bytes((double)lo / steps).c_str(),
             human_bytes((double)hi / steps).c_str());
    }
  }
  int N = comm.dp_cp.size;
  if (N > 1) {
    double K = 4.0 * num_params;  // fp32 gradients
    printf("  gradient sync over dp_cp, K = 4 bytes x %lld parameters = %s:\n",
           (long long)num_params, human_bytes(K).c_str());
    printf("    ring all-reduce 2(N-1)K/N = %s per rank per step (naive, bucket: all_reduce; "
           "ring: send_recv)\n",
           human_bytes(2.0 * (N - 1) * K / N).c_str());
  }
}

void print_zero_comm_report(const Comm& comm, const Zero& zero, int grad_acc) {
  if (comm.grid.world_rank != 0) return;
  const ShardLayout& s = zero.layout();
  int N = s.ranks, stage = zero.stage();
  int64_t steps = std::max<int64_t>(1, zero.steps_measured);
  ZeroTraffic got = zero.measured_traffic(), want = zero.expected_traffic(grad_acc);
  int64_t psi = s.units.back().offset + s.units.back().numel;
  printf(
      "ZeRO-%d traffic per training step over dp_cp (N = %d; averaged over %lld steps; "
      "validation and checkpoint gathers excluded; fp32: 4 bytes per element):\n",
      stage, N, (long long)steps);
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
  double k = stage == 3 ? 3.0 : 2.0, padded = (double)s.padded_numel();
  printf(
      "  book, Playbook §4.4: %.0fΨ(N-1)/N elements x 4 bytes = %s bytes (Ψ = %lld), %s at Ψ' "
      "(padded)\n",
      k, bytes_str(k * psi * (N - 1) / N * 4).c_str(), (long long)psi,
      bytes_str(k * padded * (N - 1) / N * 4).c_str());
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
        grad_acc,
        zero.model().cfg.tie_embeddings ? ", and the embedding again for the tied head" : "");
}
