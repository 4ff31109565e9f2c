// bench_comm.cu: `make bench`, under mpirun. (1) All-reduce bandwidth of the library and of our
// ring, nccl-tests convention: algbw = bytes / time, busbw = algbw * 2(N-1)/N (the bandwidth
// each link carries, comparable across N). (2) A data-parallel training step of the medium
// model with naive, bucketed, and bucketed-without-overlap gradient sync, with the exposed
// communication time: how long the step waits for gradients after its backward (the span
// "wait for gradients" of --trace).
#include <cblas.h>

#include <algorithm>
#include <thread>
#include <cstdio>
#include <vector>

#include "comm.cuh"
#include "data_parallel.cuh"
#include "model.cuh"
#include "ops.cuh"
#include "optimizer.cuh"

static void bandwidth(Comm& comm, const Context& ctx, const char* backend) {
  Group& g = comm.world;
  int N = g.size;
  bool root = g.rank == 0;
  if (root) {
    printf("\nall-reduce bandwidth, %d ranks, %s, %s (best of 3)\n", N, backend, device_name(ctx.device));
    printf("| %10s | %-7s | %10s | %10s | %10s |\n", "size", "impl", "time us", "algbw GB/s", "busbw GB/s");
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
        if (impl[0] == 'l') all_reduce(comm, g, ctx, buf.f32(), count, ReduceOp::Sum);
        else ring_all_reduce(comm, g, ctx, buf.f32(), count);
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

static void dp_step(Comm& comm, const Context& ctx) {
  ModelConfig c = model_preset("medium");
  Model model = build_model(c, ctx.device, 1);
  Optimizer opt = build_optimizer(model, AdamWConfig{}, 0.1f);
  int mbs = 4, T = c.seq, tokens = mbs * T;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; i++) ids[i] = (i * 31 + comm.grid.dp_rank) % c.vocab, targets[i] = (i * 17) % c.vocab;
  if (comm.grid.world_rank == 0) {
    printf("\ndata-parallel step, medium model, dp %d, mbs %d x seq %d per rank, %s (mean of 3)\n",
           comm.dp_cp.size, mbs, T, device_name(ctx.device));
    printf("| %-18s | %9s | %14s |\n", "gradient sync", "step ms", "exposed comm ms");
    printf("|--------------------|-----------|-----------------|\n");
  }
  struct Mode { const char* name; DpSync sync; bool overlap; };
  double exposed_no_overlap = 0, exposed_overlap = 0;
  for (Mode m : {Mode{"naive", DpSync::Naive, false}, Mode{"bucket, no overlap", DpSync::Bucket, false},
                 Mode{"bucket", DpSync::Bucket, true}, Mode{"ring", DpSync::Ring, true}}) {
    DataParallel dp(comm, model, m.sync, 25, m.overlap);
    double step_sum = 0, exposed_sum = 0;
    for (int rep = 0; rep < 4; rep++) {
      barrier(comm, comm.world, ctx);
      double t0 = now_seconds();
      zero_(model.grads);
      Activations acts;
      model_forward(ctx, model, acts, ids.data(), targets.data(), mbs, T, Recompute::None);
      dp.begin_backward(ctx, true);
      model_backward(ctx, model, acts, 1.0f / tokens, Recompute::None,
                     [&](int group) { dp.on_gradients_ready(group); });
      double exposed = dp.finish(ctx);
      optimizer_step(ctx, model, opt, 1e-5f);
      ctx.synchronize();
      double step = now_seconds() - t0;
      all_reduce_host(comm.world, &step, 1, ReduceOp::Max);
      all_reduce_host(comm.world, &exposed, 1, ReduceOp::Max);
      if (rep > 0) step_sum += step, exposed_sum += exposed;  // the first is a warm-up
    }
    if (m.sync == DpSync::Bucket) (m.overlap ? exposed_overlap : exposed_no_overlap) = exposed_sum / 3;
    if (comm.grid.world_rank == 0)
      printf("| %-18s | %9.1f | %15.1f |\n", m.name, step_sum / 3 * 1e3, exposed_sum / 3 * 1e3);
  }
  if (comm.grid.world_rank == 0 && exposed_no_overlap > 0)
    printf("overlap hides %.0f%% of the communication the no-overlap run exposes (target: 50%% or more)\n",
           100.0 * (1.0 - exposed_overlap / exposed_no_overlap));
}

int main(int argc, char** argv) {
  MPI_CHECK(MPI_Init(&argc, &argv));
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int local = 0, local_size = 1;
  local_rank(&local, &local_size);
  openblas_set_num_threads(std::max(1, (int)std::thread::hardware_concurrency() / local_size));
  std::vector<std::pair<Device, const char*>> runs = {{Device::CPU, "mpi"}};
  if (cuda_available()) {
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaSetDevice(local % gpus));
    runs.push_back({Device::CUDA, local_size <= gpus ? "nccl" : "mpi"});
  }
  bool skip_step = argc > 1 && std::string(argv[1]) == "--bandwidth-only";
  for (auto [device, backend] : runs) {
    Comm comm = comm_init(world, 1, 1, 1, backend, device, 600);
    Context ctx = Context::create(device);
    bandwidth(comm, ctx, backend);
    if (!skip_step) dp_step(comm, ctx);
    ctx.destroy();
    comm_destroy(comm);
  }
  MPI_Finalize();
  return 0;
}
