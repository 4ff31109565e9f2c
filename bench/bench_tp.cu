// bench_tp.cu: `make bench`, under mpirun -np 4. A training step of the medium model under
// tensor parallelism tp 1, 2, 4, with and without sequence parallelism: step time, each rank's
// peak activation memory against the formula derived in model.cu (Playbook §5.3, §6), and the
// tp group's bytes per step. Ranks not needed by a tp size run the same step as data-parallel
// replicas (no gradient sync: only one step's memory and time are measured).
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "model.cuh"
#include "runtime/comm.cuh"
#include "runtime/ops.cuh"

struct Result {
  double step_ms;
  int64_t peak_activations, block_bytes, formula_block, tp_bytes;
};

static Result measure(const Context& ctx, int tp_size, bool sp, int world, Device device) {
  Comm comm = comm_init(world / tp_size, 1, 1, tp_size, device == Device::CUDA ? "auto" : "mpi",
                        device, 600);
  ModelConfig c = model_preset("medium");
  Model model = build_model(c, device, 1, TensorParallel{&comm, sp});
  int mbs = 2, T = c.seq, N = mbs * T;
  std::vector<int32_t> ids(N), targets(N);
  for (int i = 0; i < N; i++) ids[i] = (i * 31) % c.vocab, targets[i] = (i * 17) % c.vocab;
  Result r{1e30, 0, 0,
           activation_bytes_per_block(c, mbs, T, tp_size, sp, Recompute::None, *model.attention),
           0};
  for (int rep = 0; rep < 3; rep++) {  // the first is a warm-up
    barrier(comm, comm.world, ctx);
    int64_t sent = 0;
    for (int k = 0; k < (int)Coll::Count; k++) sent -= comm.tp.stats[k].bytes;
    memory_reset_peak();
    size_t base = memory_stats().current[(int)Mem::Activations];
    double t0 = now_seconds();
    Activations acts;
    model_forward(ctx, model, acts, ids.data(), targets.data(), mbs, T, Recompute::None);
    r.block_bytes = saved_bytes(acts.blocks[0]);
    model_backward(ctx, model, acts, 1.0f / N, Recompute::None);
    ctx.synchronize();
    double dt = now_seconds() - t0;
    all_reduce_host(comm.world, &dt, 1, ReduceOp::Max);
    for (int k = 0; k < (int)Coll::Count; k++) sent += comm.tp.stats[k].bytes;
    if (rep > 0) r.step_ms = std::min(r.step_ms, dt * 1e3);
    r.peak_activations = memory_stats().peak[(int)Mem::Activations] - base;
    r.tp_bytes = sent;
  }
  comm_destroy(comm);
  return r;
}

int main(int argc, char** argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int world = 1, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  int local = 0, local_size = 1;
  local_rank(&local, &local_size, 600);  // the comm_init timeout below
  openblas_set_num_threads(std::max(1, (int)std::thread::hardware_concurrency() / local_size));
  std::vector<Device> devices = {Device::CPU};
  if (cuda_available()) {
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaSetDevice(local % gpus));
    devices.push_back(Device::CUDA);
  }
  ModelConfig c = model_preset("medium");
  for (Device device : devices) {
    Context ctx = Context::create(device);
    if (rank == 0) {
      printf(
          "\ntensor parallelism, medium model (%d layers), mbs 2 x seq %d, %s, %d ranks "
          "(fastest of 2 steps)\n",
          c.layers, c.seq, device_name(device), world);
      printf("| %-8s | %8s | %14s | %14s | %10s | %14s | %12s |\n", "layout", "step ms",
             "block measured", "block formula", "peak act.", "vs tp 1 (form.)", "tp bytes");
      printf(
          "|----------|----------|----------------|----------------|------------|----------"
          "-------|--------------|\n");
    }
    double peak1 = 0, formula1 = 0;
    bool within = true;
    for (int tp : {1, 2, 4})
      for (bool sp : {false, true}) {
        if ((tp == 1 && sp) || world % tp) continue;
        Result r = measure(ctx, tp, sp, world, device);
        if (tp == 1) peak1 = (double)r.peak_activations, formula1 = (double)r.formula_block;
        double ratio = r.peak_activations / peak1, formula_ratio = r.formula_block / formula1;
        within = within && std::abs(ratio / formula_ratio - 1) <= 0.05;
        char name[16], vs[32];
        snprintf(name, sizeof name, "tp %d%s", tp, sp ? " sp" : "");
        snprintf(vs, sizeof vs, "%.3f (%.3f)", ratio, formula_ratio);
        if (rank == 0)
          printf("| %-8s | %8.1f | %14s | %14s | %10s | %15s | %12s |\n", name, r.step_ms,
                 human_bytes(r.block_bytes).c_str(), human_bytes(r.formula_block).c_str(),
                 human_bytes(r.peak_activations).c_str(), vs, human_bytes(r.tp_bytes).c_str());
      }
    if (rank == 0)
      printf(
          "target: peak activation memory per rank falls with tp as the formula says, within "
          "5%%, and sp lowers it further: %s\n",
          within ? "met" : "NOT met");
    ctx.destroy();
  }
  MPI_Finalize();
  return 0;
}
