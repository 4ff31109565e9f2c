// test_zero.cu: ZeRO in-process on every rank of the world (mpirun -np 2..8, [mpi][zero]): the
// bytes each stage allocates against the book's formula, and a step that leaves every rank with
// the same weights, equal across stages.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "comm.cuh"
#include "data_parallel.cuh"
#include "zero.cuh"

namespace {

struct WorldComm {  // dp = world, freed at the end of the test case
  Comm c;
  WorldComm() {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    c = comm_init(n, 1, 1, 1, "mpi", Device::CPU, 60);
  }
  ~WorldComm() { comm_destroy(c); }
};

ModelConfig small_config() {
  ModelConfig c = model_preset("tiny");
  c.d_model = 32, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 64, c.seq = 16;
  return c;  // no unit's size is a multiple of 3: on 3 ranks every unit is padded
}

int64_t grew(const MemoryStats& before, const MemoryStats& after, Mem m) {
  return (int64_t)after.current[(int)m] - (int64_t)before.current[(int)m];
}

// One step of `stage` on this rank's tokens; returns the whole weights as every rank sees them.
std::vector<float> one_step(Comm& comm, int stage) {
  const Context cpu;
  ModelConfig c = small_config();
  Model m = build_model_layout(c);
  Zero zero(comm, m, stage, AdamWConfig{}, 0.1f, 7, true);
  int B = 2, T = c.seq, N = comm.dp_cp.size;
  std::vector<int32_t> ids(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++)
    ids[i] = (i * 7 + comm.dp_cp.rank) % c.vocab, targets[i] = (i * 13 + 1) % c.vocab;
  zero.begin_step(cpu);
  UnitHooks hooks = zero.hooks(cpu, true);
  Activations acts;
  model_forward(cpu, m, acts, ids.data(), targets.data(), B, T, Recompute::None, hooks);
  model_backward(cpu, m, acts, 1.0f / (B * T * N), Recompute::None, hooks);
  zero.finish(cpu);
  zero.clip_grad_norm(cpu, 0.5f);
  zero.step(cpu, 1e-2f);
  zero.gather_weights(cpu);
  std::vector<float> whole;
  for (const NamedTensor& p : m.named_params) {
    std::vector<float> v = to_host_floats(p.tensor);
    whole.insert(whole.end(), v.begin(), v.end());
  }
  zero.release_weights();
  return whole;
}

}  // namespace

TEST_CASE("ZeRO-k allocates the book's bytes at Ψ' = Ψ + padding on every rank, for any N",
          "[mpi][zero]") {
  WorldComm w;
  int N = w.c.dp_cp.size;
  for (int stage : {1, 2, 3}) {
    MemoryStats before = memory_stats();
    {
      Model m = build_model_layout(small_config());
      Zero zero(w.c, m, stage, AdamWConfig{}, 0.1f, 1, true);
      MemoryStats after = memory_stats();
      StaticMemory want = zero_static_memory(stage, (double)zero.layout().padded_numel(), N);
      INFO("zero " << stage << " on " << N << " ranks");
      REQUIRE(grew(before, after, Mem::Params) == want.params);
      REQUIRE(grew(before, after, Mem::Grads) == want.grads);
      REQUIRE(grew(before, after, Mem::Optimizer) == want.optimizer);
      REQUIRE(grew(before, after, Mem::Workspace) == 0);  // nothing transient outlives a call
    }
    REQUIRE(grew(before, memory_stats(), Mem::Params) == 0);
  }
}

TEST_CASE("after a ZeRO step every rank holds the same weights, the same for stages 1, 2, 3",
          "[mpi][zero]") {
  WorldComm w;
  std::vector<float> first = one_step(w.c, 1);
  for (int stage : {1, 2, 3}) {
    std::vector<float> mine = stage == 1 ? first : one_step(w.c, stage);
    REQUIRE(mine == first);  // bitwise: the same reduce-scatter sums, the same AdamW slices
    // Rank 0's weights against everyone's: a missing or stale all-gather shows here.
    std::vector<float> root = mine;
    broadcast(w.c, w.c.world, Context{}, root.data(), (int64_t)root.size(), 0);
    INFO("zero " << stage << ", rank " << w.c.world.rank);
    REQUIRE(mine == root);
  }
}

// One micro-batch through `sync` (the same tokens on every rank), gradients summed; returns
// the norm clip_grad_norm reports for max_norm.
static float synced_norm(Comm& comm, GradientSync& sync, Model& m, float max_norm) {
  const Context cpu;
  int B = 2, T = m.cfg.seq;
  std::vector<int32_t> ids(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++) ids[i] = (i * 7) % m.cfg.vocab, targets[i] = (i * 13 + 1) % m.cfg.vocab;
  sync.begin_step(cpu);
  UnitHooks hooks = sync.hooks(cpu, true);
  Activations acts;
  model_forward(cpu, m, acts, ids.data(), targets.data(), B, T, Recompute::None, hooks);
  model_backward(cpu, m, acts, 1.0f / (B * T * comm.dp_cp.size), Recompute::None, hooks);
  sync.finish(cpu);
  return sync.clip_grad_norm(cpu, max_norm);
}

// Expected value: the float64 norm of the whole summed gradient, computed here from plain data
// parallelism's full gradient buffer. Guards against a norm that misses the other ranks' shards
// (ZeRO), counts padding or a shard twice, or skips the rescale.
TEST_CASE("the one gradient-norm routine: plain dp and ZeRO-1/2/3 report the float64 norm and "
          "clip to max_norm",
          "[mpi][zero]") {
  WorldComm w;
  Model m = build_model_layout(small_config());
  DataParallel dp(w.c, m, DpSync::Bucket, 25, true, AdamWConfig{}, 0.1f, 7);
  float norm = synced_norm(w.c, dp, m, 0.0f);  // max_norm 0: no clipping
  double squares = 0;
  for (float g : to_host_floats(m.grads)) squares += (double)g * g;
  // fp32 partial sums per tensor, then float64 over tensors: ~1e-7 relative.
  REQUIRE(norm == Approx(std::sqrt(squares)).epsilon(1e-6));
  float clipped = synced_norm(w.c, dp, m, norm / 2);
  REQUIRE(clipped == Approx(norm).epsilon(1e-6));  // the pre-clip norm is what is returned
  double after = 0;
  for (float g : to_host_floats(m.grads)) after += (double)g * g;
  REQUIRE(std::sqrt(after) == Approx(norm / 2).epsilon(1e-6));
  for (int stage : {1, 2, 3}) {
    Model layout = build_model_layout(small_config());
    Zero zero(w.c, layout, stage, AdamWConfig{}, 0.1f, 7, true);
    INFO("zero " << stage << " on " << w.c.dp_cp.size << " ranks");
    // The same weights and tokens: the same gradient, summed in a different order (~1e-7).
    REQUIRE(synced_norm(w.c, zero, layout, 0.0f) == Approx(norm).epsilon(1e-6));
  }
}
