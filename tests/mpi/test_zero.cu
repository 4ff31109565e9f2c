// test_zero.cu: ZeRO in-process on every rank of the world (mpirun -np 2..8, [mpi][zero]): the
// bytes each stage allocates against the book's formula at a padded size worked out here, and
// steps that leave every rank with plain data parallelism's weights, the same for every stage.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "data_parallel.cuh"
#include "model.cuh"
#include "runtime/comm.cuh"
#include "zero.cuh"

namespace {

struct WorldComm {  // dp = world, freed at the end of the test case
  Comm c;
  Context ctx;  // CPU: where plain data parallelism would register a weight copy
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

// Psi' worked out from the shapes: each unit (the embedding, every block, the final norm with
// the head) is padded to a multiple of the N ranks, so that each holds an equal slice of it.
int64_t padded_size(const ModelConfig& c, int N) {
  int64_t D = c.d_model, hd = D / c.heads, V = c.vocab;
  int64_t block = 2 * D + 2 * c.heads * hd * D + 2 * c.kv_heads * hd * D + 3 * c.ffn * D;
  auto pad = [&](int64_t n) { return (n + N - 1) / N * N; };
  return pad(V * D) + c.layers * pad(block) + pad(D + V * D);
}

struct Trained {
  std::vector<float> weights;  // whole, as every rank sees them
  std::vector<float> norms;    // each step's gradient norm before clipping
};

// Two steps through `sync` on this rank's tokens (different on every rank and step).
Trained two_steps(Comm& comm, GradientSync& sync, Model& m) {
  const Context cpu;
  int B = 2, T = m.cfg.seq, N = comm.dp_cp.size;
  Trained out;
  for (int step = 0; step < 2; step++) {
    std::vector<int32_t> ids(B * T), targets(B * T);
    for (int i = 0; i < B * T; i++)
      ids[i] = (i * 7 + comm.dp_cp.rank + 31 * step) % m.cfg.vocab,
      targets[i] = (i * 13 + 1 + step) % m.cfg.vocab;
    sync.begin_step(cpu);
    UnitHooks hooks = sync.hooks(cpu, true);
    Activations acts;
    model_forward(cpu, m, acts, ids.data(), targets.data(), B, T, Recompute::None, hooks);
    model_backward(cpu, m, acts, 1.0f / (B * T * N), Recompute::None, hooks);
    sync.finish(cpu);
    out.norms.push_back(sync.clip_grad_norm(cpu, 0.5f));
    sync.step(cpu, 1e-2f);
  }
  sync.gather_weights(cpu);  // ZeRO-3: the whole weights for a moment
  for (const NamedTensor& p : m.named_params) {
    std::vector<float> v = to_host_floats(p.tensor);
    out.weights.insert(out.weights.end(), v.begin(), v.end());
  }
  sync.release_weights();
  return out;
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
      // fp32: weights 4Ψ', gradients 4Ψ', Adam's m and v 8Ψ'; stage k shards the first k of
      // (optimizer, gradients, weights) over the N ranks.
      int64_t padded = padded_size(small_config(), N);
      REQUIRE(zero.layout().padded_numel() == padded);
      INFO("zero " << stage << " on " << N << " ranks, Ψ' = " << padded);
      REQUIRE(grew(before, after, Mem::Params) == 4 * padded / (stage >= 3 ? N : 1));
      REQUIRE(grew(before, after, Mem::Grads) == 4 * padded / (stage >= 2 ? N : 1));
      REQUIRE(grew(before, after, Mem::Optimizer) == 8 * padded / N);
      REQUIRE(grew(before, after, Mem::Workspace) == 0);  // nothing transient outlives a call
    }
    REQUIRE(grew(before, memory_stats(), Mem::Params) == 0);
  }
}

TEST_CASE(
    "after two ZeRO steps every rank holds plain data parallelism's weights, bitwise "
    "the same for stages 1, 2, 3",
    "[mpi][zero]") {
  WorldComm w;
  Model plain = build_model_layout(small_config());
  DataParallel dp(w.c, plain, w.ctx, DataParallelOptions{}, AdamWConfig{}, 0.1f, 7);
  Trained want = two_steps(w.c, dp, plain);
  Trained first;
  for (int stage : {1, 2, 3}) {
    Model m = build_model_layout(small_config());
    Zero zero(w.c, m, stage, AdamWConfig{}, 0.1f, 7, true);
    Trained got = two_steps(w.c, zero, m);
    INFO("zero " << stage << " on " << w.c.dp_cp.size << " ranks, rank " << w.c.world.rank);
    // The same gradients, summed by a reduce-scatter instead of an all-reduce (another order
    // on 3+ ranks): the norms agree to fp32 rounding of the sums (~1e-7 relative).
    for (int k = 0; k < 2; k++) REQUIRE(got.norms[k] == Approx(want.norms[k]).epsilon(1e-6));
    // The weights: Adam's update is lr x m / (sqrt(v) + eps), a ratio of gradients, so a 1e-7
    // relative change of a gradient moves it by ~lr x 1e-7 = 1e-9, and the weights (|w| <= 1,
    // the norms' ones) round to 6e-8: 1e-6 absolute holds with margin. A gradient summed
    // from terms that nearly cancel can sit at eps (1e-8), where rounding moves the update
    // by up to lr itself: allowed for at most one element in 10^4. A missing, doubled or
    // misplaced shard moves whole tensors by ~lr (1e-2).
    REQUIRE(got.weights.size() == want.weights.size());
    size_t far = 0;
    double worst = 0;
    for (size_t i = 0; i < want.weights.size(); i++) {
      double d = std::fabs((double)got.weights[i] - want.weights[i]);
      far += d > 1e-6, worst = std::max(worst, d);
    }
    INFO("largest difference " << worst << ", " << far << " elements past 1e-6");
    REQUIRE(far <= want.weights.size() / 10000);
    // Between stages: the same reduce-scatter sums and AdamW slices, so bitwise equal.
    if (stage == 1) first = got;
    REQUIRE(got.weights == first.weights);
    // Rank 0's weights against everyone's: a missing or stale all-gather shows here.
    std::vector<float> root = got.weights;
    broadcast(w.c, w.c.world, Context{}, root.data(), (int64_t)root.size(), 0);
    REQUIRE(got.weights == root);
  }
}

// One micro-batch through `sync` (the same tokens on every rank), gradients summed; returns
// the norm clip_grad_norm reports for max_norm.
static float synced_norm(Comm& comm, GradientSync& sync, Model& m, float max_norm) {
  const Context cpu;
  int B = 2, T = m.cfg.seq;
  std::vector<int32_t> ids(B * T), targets(B * T);
  for (int i = 0; i < B * T; i++)
    ids[i] = (i * 7) % m.cfg.vocab, targets[i] = (i * 13 + 1) % m.cfg.vocab;
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
TEST_CASE(
    "the one gradient-norm routine: plain dp and ZeRO-1/2/3 report the float64 norm and "
    "clip to max_norm",
    "[mpi][zero]") {
  WorldComm w;
  Model m = build_model_layout(small_config());
  DataParallel dp(w.c, m, w.ctx, DataParallelOptions{}, AdamWConfig{}, 0.1f, 7);
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
