// test_zero.cu: ZeRO in-process on every rank of the world (mpirun -np 2..8, [mpi][zero]): the
// bytes each stage allocates against the book's formula at a padded size worked out here, steps
// that leave every rank with plain data parallelism's weights, the same for every stage, and
// checkpoints put together from pieces of any shape the ranks hold.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
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

// ----------------------------------------------------------------------------
// Checkpoints from pieces

namespace {

// A gradient sync that holds every unit in pieces of its own, not ZeRO's: the unit's elements
// cut at numel k^2 / N^2 (k = 0..N) into N runs of growing length, unpadded, and rank r holds
// run N-1-r, so that neither the sizes nor the rank order say where a piece goes. Every rank
// allocates the whole model; a checkpoint sees only the pieces.
class PieceSync : public GradientSync {
 public:
  PieceSync(Comm& comm, FlatParameters& model, uint64_t seed)
      : GradientSync(comm, model, AdamWConfig{}, 0.1f) {
    allocate_flat(model, comm.device, seed);
    moments = adam_moments(model.num_params, comm.device);
  }
  // Unit u's run held here: [first, first + count) of its elements.
  std::pair<int64_t, int64_t> range(int u) const {
    const int64_t N = comm_.dp_cp.size, k = N - 1 - comm_.dp_cp.rank, n = model_.units[u].numel;
    int64_t first = n * k * k / (N * N), end = n * (k + 1) * (k + 1) / (N * N);
    return {first, end - first};
  }
  AdamMoments moments;

  void begin_step(const Context&) override {}
  UnitHooks hooks(const Context&, bool) override { return {}; }
  double finish(const Context&) override { return 0; }
  void step(const Context&, float) override {}
  int64_t master_bytes() const override { return 0; }
  std::string describe() const override { return "pieces"; }

 protected:
  std::vector<Holding> holdings(Part part) const override {
    Tensor flat = model_.grads;
    switch (part) {
      case Part::Params:
        flat = model_.params;
        break;
      case Part::ExpAvg:
        flat = moments.exp_avg;
        break;
      case Part::ExpAvgSq:
        flat = moments.exp_avg_sq;
        break;
      case Part::Grads:
        break;
    }
    return {[this, flat](int u) {
      auto [first, count] = range(u);
      return Piece{flat.view(model_.units[u].offset + first, {count}), first, count, &comm_.dp_cp};
    }};
  }
  void scale_grads(const Context&, float) override {}
  bool grads_sharded() const override { return true; }
};

// Rank 0's new temporary directory, on every rank.
std::string shared_temp_dir() {
  char path[] = "/tmp/picoscale-pieces-XXXXXX";
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) REQUIRE(mkdtemp(path) != nullptr);
  MPI_Bcast(path, sizeof path, MPI_CHAR, 0, MPI_COMM_WORLD);
  return path;
}

}  // namespace

// Expected values from outside the pieces: the weights one process initialises from the same
// seed, and moments set here element by element. Guards against a piece put where its rank
// order (rather than its range) says, a shorter piece's padding saved, or a load that writes
// a rank's piece from the wrong place.
TEST_CASE(
    "a checkpoint puts whole tensors together from any pieces the ranks hold, and a load gives "
    "each rank its own back",
    "[mpi][zero]") {
  WorldComm w;
  const Context cpu;
  Model m = build_model_layout(small_config());
  PieceSync held(w.c, m, 7);
  const int64_t n = m.num_params;
  std::vector<float> m1(n), m2(n);
  for (int64_t i = 0; i < n; i++) m1[i] = 1e-3f * (float)(i % 997), m2[i] = 1e-6f * (float)(i % 89);
  from_host(held.moments.exp_avg, m1.data());
  from_host(held.moments.exp_avg_sq, m2.data());
  const std::string dir = shared_temp_dir();
  held.save(cpu, dir, m.cfg, 3);
  barrier(w.c, w.c.world, cpu);  // world rank 0 writes the files

  Model one = build_model_layout(small_config());
  allocate_flat(one, Device::CPU, 7);  // the single process's weights
  Model plain = build_model_layout(small_config());
  DataParallel dp(w.c, plain, w.ctx, DataParallelOptions{}, AdamWConfig{}, 0.1f, 99);
  Model again = build_model_layout(small_config());
  PieceSync back(w.c, again, 99);  // other weights and zero moments, until the load
  int64_t steps_plain = 0, steps_back = 0;
  agree_on_error(w.c.world, [&] {  // a load that fails on one rank fails on every rank
    steps_plain = dp.load(dir);
    steps_back = back.load(dir);
  });
  if (w.c.world.rank == 0) std::filesystem::remove_all(dir);
  REQUIRE(steps_plain == 3);
  REQUIRE(steps_back == 3);
  REQUIRE(to_host_floats(plain.params) == to_host_floats(one.params));
  std::vector<float> want = to_host_floats(one.params), got = to_host_floats(again.params);
  std::vector<float> got1 = to_host_floats(back.moments.exp_avg);
  std::vector<float> got2 = to_host_floats(back.moments.exp_avg_sq);
  for (int u = 0; u < (int)again.units.size(); u++) {
    auto [first, count] = back.range(u);
    INFO("unit " << again.units[u].name << ", rank " << w.c.dp_cp.rank << "'s piece [" << first
                 << ", " << first + count << ")");
    for (int64_t i = again.units[u].offset + first; i < again.units[u].offset + first + count;
         i++) {
      REQUIRE(got[i] == want[i]);
      REQUIRE(got1[i] == m1[i]);
      REQUIRE(got2[i] == m2[i]);
    }
  }
}
