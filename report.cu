// report.cu: the measured side of the book's formulas. The one idea: every byte allocated
// and every byte sent is counted where it happens, so a report is a reading, not an estimate.
#include "report.cuh"

#include <algorithm>

void print_memory(const Model& model) {
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
