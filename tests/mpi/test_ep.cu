// test_ep.cu: one mixture-of-experts layer (expert_parallel.cu) with its experts split over the
// world (ep = dp = world size), against the same layer with every expert on one rank, run on
// each rank's own tokens ([mpi]). Half the tokens are steered to experts that live on the next
// rank, so a token whose every expert sits elsewhere leaves and comes back whole.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "expert_parallel.cuh"
#include "runtime/ops.cuh"
#include "world.cuh"

namespace {

Tensor normal(std::vector<int64_t> shape, const std::string& name, float std, uint64_t seed = 7) {
  Tensor t = zeros(shape, Mem::Workspace);
  init_normal(t, seed, name, std);
  return t;
}
// The layer's weights for experts [first, first + count) of the full, rank-independent ones.
MoeWeights weights(const ModelConfig& c, int first, int count, bool zero) {
  const int64_t D = c.d_model, F = c.ffn;
  auto make = [&](std::vector<int64_t> shape, const std::string& name, float std) {
    return zero ? zeros(shape, Mem::Workspace) : normal(shape, name, std);
  };
  MoeWeights w;
  // The router: expert e reads dimension e (steering below), plus a small random part.
  w.router = make({c.experts, D}, "router", 0.1f);
  if (!zero) {
    std::vector<float> r = to_host_floats(w.router);
    for (int e = 0; e < c.experts; e++) r[e * D + e] += 3.0f;
    from_host(w.router, r.data());
  }
  for (int j = first; j < first + count; j++) {
    const std::string n = "expert" + std::to_string(j);
    w.experts.push_back({make({F, D}, n + ".w1", 0.3f), make({D, F}, n + ".w2", 0.3f),
                         make({F, D}, n + ".w3", 0.3f)});
  }
  return w;
}
double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, (double)std::fabs(x));
  return m;
}
// max |got - want| <= tol x max |want|
void require_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                   const std::string& what) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); i++)
    worst = std::max(worst, (double)std::fabs(got[i] - want[i]));
  INFO(what << ": max diff " << worst << " of scale " << max_abs(want));
  REQUIRE(worst <= tol * max_abs(want));
}

}  // namespace

// Tolerance: each token's output is the same rows times the same weights on both sides; the
// experts' weight gradients are one GEMM over every rank's rows against a sum of per-rank GEMMs
// (fp32 sums of ~40 terms in another order: ~1e-6 of the scale). 1e-5 holds that; a row sent
// to the wrong expert or rank, a lost row or a doubled one moves values by their own size.
TEST_CASE(
    "a mixture layer with its experts over ep ranks equals every expert on one rank, "
    "tokens whose experts are all elsewhere included",
    "[mpi]") {
  const int P = world_size(), me = world_rank();
  ModelConfig c;
  c.d_model = 16, c.ffn = 8, c.experts = 2 * P, c.top_k = 2, c.layers = 1, c.aux_loss_coef = 0.05f;
  REQUIRE(c.experts <= c.d_model);
  const int64_t N = 12, D = c.d_model;
  Comm comm = comm_init(P, 1, 1, 1, "mpi", Device::CPU, 60, P);
  const Context ctx;
  TensorParallel tp{&comm, false};
  // This rank's tokens: even ones pushed towards the next rank's two experts.
  Tensor x = normal({N, D}, "tokens" + std::to_string(me), 1.0f, 11);
  {
    std::vector<float> h = to_host_floats(x);
    const int next = (me + 1) % P;
    for (int64_t t = 0; t < N; t += 2) h[t * D + 2 * next] += 4, h[t * D + 2 * next + 1] += 4;
    from_host(x, h.data());
  }
  Tensor dout = normal({N, D}, "dout" + std::to_string(me), 1.0f, 13);
  auto run = [&](const ExpertParallel& ep, const MoeWeights& w, const MoeWeights& g) {
    MoeActivations a;
    Tensor out = zeros({N, D}, Mem::Workspace), dx = zeros({N, D}, Mem::Workspace);
    std::vector<float> carry(2 * c.experts, 0.0f);
    moe_forward(ep, tp, c, ctx, w, a, x, out, 0, &carry);
    const Routing routing = *a.routing;
    moe_backward(ep, tp, c, ctx, w, g, a, x, dout, dx, carry, 1.0f / N);
    return std::tuple{to_host_floats(out), to_host_floats(dx), routing};
  };
  // Every expert here.
  MoeWeights all = weights(c, 0, c.experts, false), all_g = weights(c, 0, c.experts, true);
  auto [want_out, want_dx, routing] = run(ExpertParallel{}, all, all_g);
  // This rank's experts, the others' over ep.
  const ExpertRange mine = local_experts(c.experts, comm.ep.rank, comm.ep.size);
  MoeWeights part = weights(c, mine.first, mine.count, false),
             part_g = weights(c, mine.first, mine.count, true);
  auto [got_out, got_dx, unused] = run(ExpertParallel{&comm, 0.0, nullptr}, part, part_g);
  if (P > 1) {  // the steering works: half the tokens or more have both experts elsewhere
    int elsewhere = 0;
    for (int64_t t = 0; t < N; t++) {
      bool away = true;
      for (int j = 0; j < c.top_k; j++) {
        int e = routing.choice[t * c.top_k + j];
        away = away && (e < mine.first || e >= mine.first + mine.count);
      }
      elsewhere += away;
    }
    CHECK(elsewhere >= (int)N / 2);
  }
  require_close(got_out, want_out, 1e-5, "output");
  require_close(got_dx, want_dx, 1e-5, "input gradient");
  // The router is this rank's own (data-parallel): its gradient from this rank's tokens alone.
  require_close(to_host_floats(part_g.router), to_host_floats(all_g.router), 1e-5, "router");
  // An expert's gradient is the sum over every rank's tokens routed to it: the one-rank
  // gradients of every expert summed over the world (every rank sums all of them, in order).
  auto pick = [](const ExpertWeights& e, int m) { return m == 0 ? e.w1 : m == 1 ? e.w2 : e.w3; };
  for (int e = 0; e < c.experts; e++)
    for (int m = 0; m < 3; m++) {
      std::vector<float> want = to_host_floats(pick(all_g.experts[e], m));
      MPI_Allreduce(MPI_IN_PLACE, want.data(), (int)want.size(), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
      if (e < mine.first || e >= mine.first + mine.count) continue;
      require_close(to_host_floats(pick(part_g.experts[e - mine.first], m)), want, 1e-5,
                    "expert " + std::to_string(e) + " w" + "123"[m]);
    }
  comm_destroy(comm);
}
