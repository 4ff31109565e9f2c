// test_experts.cu: the mixture of experts and expert parallelism (expert_parallel.cu). The
// routing against numbers worked by hand and against finite differences; the dispatch's
// bookkeeping against a hand-made exchange; the whole model against transformers'
// MixtralForCausalLM (tests/data/golden/mixtral, tools/make_golden.py: logits, cross-entropy,
// load-balancing loss and every gradient, in float64), in one process and through ./train under
// ep, tp, sp, pp, cp and ZeRO; Mixtral checkpoints saved whole from any layout; bad flags.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <sstream>

#include "cuda_case.cuh"
#include "expert_parallel.cuh"
#include "golden.cuh"
#include "kernels/router.cuh"
#include "launch.cuh"
#include "model.cuh"
#include "runtime/checkpoint.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// Routing

// Guards: the softmax, the top-k order, the renormalisation, the dispatch order.
TEST_CASE("route_tokens: softmax, top k best first, weights renormalised, rows by expert",
          "[experts]") {
  // Token 0 prefers expert 2 then 0; token 1 prefers 1 then 3; token 2 prefers 2 then 3.
  const std::vector<float> logits = {1.0f, -0.5f, 2.0f, 0.0f,  //
                                     0.1f, 3.0f,  -1.f, 1.5f,  //
                                     -2.f, 0.0f,  0.5f, 0.25f};
  Routing r = route_tokens(logits, 3, 4, 2);
  for (int t = 0; t < 3; t++) {
    double z[4], sum = 0;
    for (int e = 0; e < 4; e++) sum += z[e] = std::exp((double)logits[t * 4 + e]);
    for (int e = 0; e < 4; e++) CHECK(r.probs[t * 4 + e] == Approx(z[e] / sum).epsilon(1e-6));
  }
  CHECK(r.choice == std::vector<int32_t>{2, 0, 1, 3, 2, 3});
  // Token 0's weights: e^2 / (e^2 + e^1) and e^1 / (e^2 + e^1), the softmax's sum cancelling.
  const double e1 = std::exp(1.0), e2 = std::exp(2.0);
  CHECK(r.weight[0] == Approx(e2 / (e2 + e1)).epsilon(1e-6));
  CHECK(r.weight[1] == Approx(e1 / (e2 + e1)).epsilon(1e-6));
  CHECK(r.routed == std::vector<int64_t>{1, 1, 2, 2});
  CHECK(r.dropped == 0);
  // Dispatch order: expert 0 (token 0), expert 1 (token 1), expert 2 (tokens 0, 2), expert 3 (1,
  // 2).
  CHECK(r.row_expert == std::vector<int32_t>{0, 1, 2, 2, 3, 3});
  CHECK(r.row_token == std::vector<int32_t>{0, 1, 0, 2, 1, 2});
  CHECK(r.row_slot == std::vector<int32_t>{1, 0, 0, 0, 1, 1});
  CHECK(r.rows_per_expert == std::vector<int64_t>{1, 1, 2, 2});
}

// Guards: a tie broken towards the higher index (or by an unstable sort), which would make two
// ranks holding the same logits route differently.
TEST_CASE("route_tokens: equal probabilities go to the lower expert index", "[experts]") {
  Routing r = route_tokens({0.5f, 0.5f, 0.5f, 0.5f}, 1, 4, 3);
  CHECK(r.choice == std::vector<int32_t>{0, 1, 2});
  for (float w : r.weight) CHECK(w == Approx(1.0 / 3).epsilon(1e-6));
}

// Guards: the capacity's order (first choices of every token before any second choice) and its
// count; a dropped pair still counts as routed (the load-balancing loss counts choices).
TEST_CASE("route_tokens with a capacity keeps first choices first and counts the drops",
          "[experts]") {
  // Four tokens, all with first choice expert 0 and second choice expert 1; capacity 3.
  std::vector<float> logits;
  for (int t = 0; t < 4; t++) logits.insert(logits.end(), {2.0f, 1.0f, 0.0f});
  Routing r = route_tokens(logits, 4, 3, 2, 3);
  // Expert 0 keeps tokens 0-2's first choices; expert 1 keeps tokens 0-2's second choices.
  CHECK(r.kept == std::vector<uint8_t>{1, 1, 1, 1, 1, 1, 0, 0});
  CHECK(r.dropped == 2);
  CHECK(r.routed == std::vector<int64_t>{4, 4, 0});
  CHECK(r.rows_per_expert == std::vector<int64_t>{3, 3, 0});
  // c x tokens x k / E, rounded up: 1.25 x 10 x 2 / 4 = 6.25 -> 7; exact products stay.
  CHECK(expert_capacity(1.25, 10, 4, 2) == 7);
  CHECK(expert_capacity(1.0, 8, 4, 2) == 4);
}

// Guards: the renormalisation's and the softmax's backward, and the load-balancing term's entry.
TEST_CASE("route_backward matches central finite differences of the weights and probabilities",
          "[experts]") {
  const int N = 3, E = 5, k = 2;
  std::vector<float> logits(N * E);
  for (int i = 0; i < N * E; i++) logits[i] = (float)std::sin(1.7 * i + 0.3) * 1.5f;
  const std::vector<float> d_weight = {0.7f, -1.3f, 0.4f, 0.9f, -0.2f, 1.1f};
  const std::vector<float> d_prob = {0.3f, -0.6f, 0.2f, 0.5f, -0.1f};
  Routing r = route_tokens(logits, N, E, k);
  std::vector<float> dz = route_backward(r, d_weight, d_prob);
  // f(z) = sum_slots d_weight x weight + sum_tokens sum_e d_prob[e] x prob[e], the choice held
  // fixed (h is far smaller than the gaps between probabilities, so it does not change here).
  auto f = [&](const std::vector<float>& z) {
    Routing q = route_tokens(z, N, E, k);
    REQUIRE(q.choice == r.choice);
    double v = 0;
    for (int i = 0; i < N * k; i++) v += (double)d_weight[i] * q.weight[i];
    for (int t = 0; t < N; t++)
      for (int e = 0; e < E; e++) v += (double)d_prob[e] * q.probs[t * E + e];
    return v;
  };
  // h = 1e-2: central differences err by ~h^2 f''' ~ 1e-4 x O(1); fp32 rounding of the weights
  // adds ~6e-8 / h ~ 6e-6. A missing term (the renormalisation's -dot, a softmax factor) moves
  // an entry by 0.1 or more.
  const double h = 1e-2;
  for (int i = 0; i < N * E; i++) {
    std::vector<float> up(logits), down(logits);
    up[i] += (float)h, down[i] -= (float)h;
    double fd = (f(up) - f(down)) / (double)(up[i] - down[i]);
    INFO("logit " << i);
    CHECK(dz[i] == Approx(fd).margin(5e-4));
  }
}

// The load-balancing loss against Switch Transformer's closed forms: E x sum_e f_e P_e.
// The router's backward as the training step runs it (kernels/router.cuh): the gradient of each
// kept (token, slot) pair's weight arrives per dispatch row, dropped pairs have none. Its
// reference: route_backward with the slots' gradients laid out per token by the test (0 where
// dropped), the function the finite differences above hold.
struct RouterCase {
  int N, E, k;
  Routing r;
  std::vector<float> d_rows, d_prob, want;
  std::vector<int32_t> slot_row;
  RouterCase(int n, int e, int kk, int64_t capacity) : N(n), E(e), k(kk) {
    std::vector<float> logits(N * E);
    for (int i = 0; i < N * E; i++) logits[i] = (float)std::sin(0.37 * i * i + 0.1) * 2.0f;
    r = route_tokens(logits, N, E, k, capacity);
    std::vector<float> per_slot(N * k, 0.0f);
    slot_row.assign(N * k, -1);
    for (size_t i = 0; i < r.row_token.size(); i++) {
      d_rows.push_back((float)std::cos(1.3 * i) - 0.2f);
      per_slot[r.row_token[i] * k + r.row_slot[i]] = d_rows[i];
      slot_row[r.row_token[i] * k + r.row_slot[i]] = (int32_t)i;
    }
    for (int i = 0; i < E; i++) d_prob.push_back(0.05f * (float)(i % 3) - 0.04f);
    want = route_backward(r, per_slot, d_prob);
  }
  std::vector<float> run(const Context& ctx) const {
    Device dev = ctx.device;
    auto on = [&](const Tensor& t) { return to_device(t, dev, Mem::Workspace); };
    Tensor probs = on(floats({N, E}, r.probs)), weight = on(floats({N, k}, r.weight));
    Tensor choice = on(ints({N, k}, r.choice)), rows = on(ints({N, k}, slot_row));
    Tensor d_w = on(floats({(int64_t)d_rows.size()}, d_rows));
    Tensor dp = on(floats({E}, d_prob)), dz = empty({N, E}, Mem::Workspace, dev);
    route_backward_on(ctx, dz, probs, choice, weight, rows, d_w, dp);
    return to_host_floats(dz);
  }
  static Tensor floats(std::vector<int64_t> shape, const std::vector<float>& v) {
    Tensor t = empty(shape, Mem::Workspace);
    std::copy(v.begin(), v.end(), t.f32());
    return t;
  }
  static Tensor ints(std::vector<int64_t> shape, const std::vector<int32_t>& v) {
    Tensor t = empty(shape, Mem::Workspace, Device::CPU, DType::I32);
    std::copy(v.begin(), v.end(), t.i32());
    return t;
  }
};

// Guards: the dispatch rows' gradients reach their (token, slot), a dropped slot's is 0, every
// expert's probability gets the loss's term. Exact: the same double arithmetic in the same order.
TEST_CASE("route_backward_on: the dispatch rows' weight gradients into the router's logits",
          "[experts]") {
  RouterCase c(7, 4, 2, 3);  // capacity 3 of the 14 pairs: some dropped
  REQUIRE(c.r.dropped > 0);
  CHECK(c.run(Context::create(Device::CPU)) == c.want);
}

// Guards: the kernel's indexing past one block (300 tokens, 128 threads a block) and with drops.
// Within 2 ulp of fp32: the double sums are the CPU's, except where the GPU fuses a multiply and
// an add (a rounding of ~1e-16), which can move the result's float rounding by one ulp.
TEST_CASE("CUDA route_backward_on matches the CPU loop", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  RouterCase c(300, 8, 2, 70);
  REQUIRE(c.r.dropped > 0);
  std::vector<float> got = c.run(ctx);
  for (size_t i = 0; i < got.size(); i++) {
    INFO("entry " << i);
    CHECK(std::fabs(got[i] - c.want[i]) <= 2.4e-7f * std::fabs(c.want[i]) + 1e-12f);
  }
  ctx.destroy();
}

TEST_CASE("load_balancing_loss: balanced routing gives k, one expert taking all gives E x k",
          "[experts]") {
  // 8 rows, 4 experts, k 2: balanced counts 4 each, mean probabilities 1/4: 4 x 4 x (4/8)(2/8).
  CHECK(load_balancing_loss({4, 4, 4, 4}, {2, 2, 2, 2}, 8) == Approx(2.0));
  // Every row picks experts 0 and 1 with all the probability on expert 0: 4 x (8/8)(8/8) = 4.
  CHECK(load_balancing_loss({8, 8, 0, 0}, {8, 0, 0, 0}, 8) == Approx(4.0));
}

// Guards: the source-major to expert-major permutation (each local expert must read its own
// rows, from every source, in source order) and the per-peer totals the all-to-all moves.
TEST_CASE("make_dispatch: per-peer counts and the expert-major order of the received rows",
          "[experts]") {
  // 2 ranks x 2 local experts. This rank sends [3, 1 | 0, 2] rows to experts 0, 1 | 2, 3 and
  // receives, for its experts (a, b): from rank 0 (2, 1), from rank 1 (1, 3).
  Dispatch d = make_dispatch({3, 1, 0, 2}, {2, 1, 1, 3}, 2);
  CHECK(d.send_peer == std::vector<int64_t>{4, 2});
  CHECK(d.recv_peer == std::vector<int64_t>{3, 4});
  CHECK(d.expert_rows == std::vector<int64_t>{3, 4});
  // Source-major arrival: [a0 a0 b0 | a1 b1 b1 b1] at 0..6; expert-major: a0 a0 a1 b0 b1 b1 b1.
  CHECK(d.by_expert == std::vector<int32_t>{0, 1, 3, 2, 4, 5, 6});
  for (size_t i = 0; i < d.by_expert.size(); i++) CHECK(d.by_source[d.by_expert[i]] == (int)i);
}

// ---------------------------------------------------------------------------------------------
// Against transformers' MixtralForCausalLM

namespace {

// As test_golden.cu's: the float64 reference exact to fp32 rounding; the model fp32 through two
// blocks. The routing itself is discrete: a token whose two best probabilities were within fp32
// rounding of each other would route differently here, and the fixture has none (the loss and
// every gradient agree to the bounds below, which such a token would break by 1e-2).
constexpr double kLogitsTol = 5e-6, kGradTol = 1e-5, kLossTol = 1e-5;

std::map<std::string, std::vector<float>> with_prefix(const Golden& g, const std::string& p) {
  std::map<std::string, std::vector<float>> out;
  for (auto& [name, v] : g.ref)
    if (name.rfind(p, 0) == 0) out[name.substr(p.size())] = v;
  return out;
}

}  // namespace

// Guards: the router's softmax and top-k, the renormalised weights, each expert's SwiGLU and
// its Mixtral names (w1 gate, w3 up, w2 down), the combine, the load-balancing loss and its
// gradient into the router (coefficient from config.json's router_aux_loss_coef).
TEST_CASE(
    "a mixture of experts matches transformers' Mixtral: logits, losses and every gradient, "
    "with flash and naive attention",
    "[golden][experts]") {
  const Context ctx;
  Golden g = read_golden("mixtral");
  REQUIRE(g.cfg.experts == 4);
  REQUIRE(g.cfg.top_k == 2);
  REQUIRE(g.cfg.aux_loss_coef == Approx(0.02));
  for (AttentionKind attention : {AttentionKind::Flash, AttentionKind::Naive}) {
    INFO(attention_name(attention) << " attention");
    Model model = build_model(g.cfg, Device::CPU, 1);
    model.attention = local_attention(attention);
    ExpertStats stats;
    model.ep.stats = &stats;
    load_checkpoint(g.dir, model.named_params, nullptr);
    Activations acts;
    float loss_sum =
        model_forward(ctx, model, acts, g.ids.data(), g.targets.data(), g.B, g.T, Recompute::None);
    require_close(to_host_floats(acts.logits), g.ref["logits"], kLogitsTol, "mixtral logits");
    REQUIRE(loss_sum / (g.B * g.T) == Approx(g.loss()).epsilon(kLossTol));
    REQUIRE(stats.batches == 1);
    REQUIRE(stats.aux_sum == Approx(g.ref["aux"][0]).epsilon(kLossTol));
    // transformers' own (fp32) load-balancing loss is the same number: the formula is theirs.
    REQUIRE(stats.aux_sum == Approx(g.ref["aux_transformers"][0]).epsilon(1e-6));
    zero_(model.grads);
    model_backward(ctx, model, acts, 1.0f / (g.B * g.T), Recompute::None);
    std::map<std::string, std::vector<float>> grads;
    for (const NamedTensor& t : model.named_grads) grads[t.name] = to_host_floats(t.tensor);
    require_grads(grads, with_prefix(g, "grad."), kGradTol, "mixtral gradient");
  }
}

// Guards: the sharded paths against the same outside numbers: experts split over ep ranks
// (the all-to-alls, the gradient sum over edp_cp), tp and sp (each expert split as the dense
// MLP is, the router's input gradient added once), the routing counts carried across pipeline
// stages, cp (counts over the whole sequence), ZeRO-3 gathers of expert units over edp_cp.
TEST_CASE(
    "./train on the Mixtral fixture under ep, tp, sp, pp, cp and ZeRO gives transformers' "
    "losses and gradients",
    "[golden][experts][parity]") {
  struct Layout {
    std::string flags;
    int ranks;
    bool per_sequence;  // one sequence per micro-batch: the aux loss is the sequences' mean
  };
  const std::vector<Layout> layouts = {
      {"--mbs 2", 0, false},
      {"--mbs 1 --grad-acc 2", 0, true},
      {"--mbs 1 --dp 2", 2, true},
      {"--mbs 1 --dp 2 --ep 2", 2, true},
      {"--mbs 2 --tp 2", 2, false},
      {"--mbs 2 --tp 2 --sp", 2, false},
      {"--mbs 2 --pp 2", 2, false},
      {"--mbs 2 --cp 2", 2, false},
      {"--mbs 1 --dp 2 --ep 2 --zero 3", 2, true},
      {"--mbs 1 --dp 2 --ep 2 --tp 2 --sp", 4, true},
  };
  Golden g = read_golden("mixtral");
  std::string tmp = make_temp_dir();
  for (const Layout& l : layouts) {
    INFO("mixtral, " << l.flags);
    GoldenStep got = run_golden_step(g, l.flags, l.ranks, tmp);
    REQUIRE(got.log["loss"].get<double>() == Approx(g.loss()).epsilon(kLossTol));
    const double aux = g.ref[l.per_sequence ? "aux_mb" : "aux"][0];
    REQUIRE(got.log["aux_loss"].get<double>() == Approx(aux).epsilon(kLossTol));
    require_grads(got.grads, with_prefix(g, l.per_sequence ? "grad_mb." : "grad."), kGradTol,
                  "mixtral " + l.flags + " gradient");
  }
  fs::remove_all(tmp);
}

// Guards: a save under ep that writes only this rank's experts, or renames or reorders them; a
// load that puts expert j's weights on the wrong rank. An update of 1e-30 leaves every weight's
// bits as they were, so the save must hold exactly the fixture's bytes.
TEST_CASE(
    "a Mixtral checkpoint saved from ep 2 (and ep 2 x pp 2, ZeRO-3) is transformers' own "
    "bytes, and loads into one process",
    "[golden][experts][parity]") {
  Golden g = read_golden("mixtral");
  std::string tmp = make_temp_dir();
  const std::string common = "--load " + g.dir + " --data " + g.dir +
                             "/tokens.bin --val-frac 0.5 --steps 1 --val-every 0 --lr 1e-30 "
                             "--warmup 1 --comm-timeout 60 --mbs 1 ";
  for (auto [flags, ranks] : {std::pair{std::string("--dp 2 --ep 2"), 2},
                              {"--dp 2 --ep 2 --pp 2", 4},
                              {"--dp 2 --ep 2 --zero 3", 2}}) {
    INFO(flags);
    fs::remove_all(tmp + "/ck");
    RunResult r = run_train(common + flags + " --save " + tmp + "/ck", ranks);
    INFO(r.output);
    REQUIRE(r.code == 0);
    require_fixture_bytes(tmp + "/ck/model.safetensors", g);
    ModelConfig back = read_checkpoint_config(tmp + "/ck");
    CHECK(back.experts == 4);
    CHECK(back.top_k == 2);
    CHECK(back.aux_loss_coef == Approx(0.02));
  }
  // What ep 2 saved scores in one process as transformers scores the fixture.
  RunResult r = run_train("--load " + tmp + "/ck --score " + g.dir + "/score.bin");
  INFO(r.output);
  REQUIRE(r.code == 0);
  size_t at = r.output.find("loss: ");
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(r.output.substr(at + 6)) == Approx(g.loss()).epsilon(kLossTol));
  fs::remove_all(tmp);
}

// ---------------------------------------------------------------------------------------------
// Runs

// Guards: a capacity path that changes what it keeps when nothing overflows; drops that are
// not counted; a capacity that drops nothing when it must.
TEST_CASE("a capacity no expert reaches trains exactly as dropless; a small one drops and says so",
          "[train][experts]") {
  std::string tmp = make_temp_dir();
  const std::string common =
      "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 32 --seq 16 --mbs 2 --steps 2 "
      "--val-every 0 --experts 4 --top-k 2 --report experts --log-json ";
  RunResult dropless = run_train(common + tmp + "/a.jsonl");
  // 8 x tokens x k / E = 2 x the tokens: no expert can receive more than every token once.
  RunResult roomy = run_train(common + tmp + "/b.jsonl --capacity-factor 8");
  RunResult tight = run_train(common + tmp + "/c.jsonl --capacity-factor 0.25");
  INFO(dropless.output << roomy.output << tight.output);
  REQUIRE(dropless.code == 0);
  REQUIRE(roomy.code == 0);
  REQUIRE(tight.code == 0);
  auto a = read_json_lines(tmp + "/a.jsonl"), b = read_json_lines(tmp + "/b.jsonl"),
       c = read_json_lines(tmp + "/c.jsonl");
  for (size_t i = 0; i < a.size(); i++) {
    CHECK(a[i]["loss"].get<double>() == b[i]["loss"].get<double>());
    CHECK(a[i]["grad_norm"].get<double>() == b[i]["grad_norm"].get<double>());
  }
  CHECK(a[1]["loss"].get<double>() != c[1]["loss"].get<double>());
  // --report experts' rows: layer, min, mean, max, max/mean, dropped, balance loss (per step).
  auto rows = [](const std::string& out) {
    std::vector<std::vector<double>> got;
    std::istringstream in(out.substr(out.find("experts per layer (--report experts")));
    std::string line;
    std::getline(in, line), std::getline(in, line);  // the title and the header
    for (int l = 0; l < 2 && std::getline(in, line); l++) {
      std::istringstream cols(line);
      std::vector<double> v(7);
      for (double& x : v) cols >> x;
      got.push_back(v);
    }
    return got;
  };
  // 0.25 x 32 tokens x 2 / 4 = 4 rows per expert: every expert that receives at least 4 keeps
  // exactly 4, so with the least-loaded expert at 4 or more (its column) 64 - 16 = 48 of each
  // layer's 64 pairs are dropped, in each of the step's one micro-batch.
  for (const auto& row : rows(tight.output)) {
    INFO("layer " << row[0]);
    REQUIRE(row[1] >= 4);
    CHECK(row[5] == 48);
  }
  for (const auto& row : rows(dropless.output)) CHECK(row[5] == 0);
  fs::remove_all(tmp);
}

// ---------------------------------------------------------------------------------------------
// Bad input

TEST_CASE("expert flags that cannot work are refused, naming the flag and the fix", "[experts]") {
  ModelConfig c = model_preset("tiny");
  ExpertOptions o;
  o.ep = 2;
  CHECK_THAT(usage_error_of([&] { validate_expert_parallel(c, o, 2, 1); }),
             Catch::Contains("--ep 2 needs a mixture of experts"));
  c.experts = 8, c.top_k = 2;
  CHECK_THAT(usage_error_of([&] { validate_expert_parallel(c, o, 3, 1); }),
             Catch::Contains("--ep 2 does not divide --dp 3"));
  o.ep = 3;
  CHECK_THAT(usage_error_of([&] { validate_expert_parallel(c, o, 3, 1); }),
             Catch::Contains("--ep 3 does not divide the 8 experts"));
  o.ep = 1, o.capacity_factor = 1.0;
  CHECK_THAT(usage_error_of([&] { validate_expert_parallel(c, o, 1, 2); }),
             Catch::Contains("--capacity-factor with --cp 2"));
  o.capacity_factor = -1;
  CHECK_THAT(usage_error_of([&] { validate_expert_parallel(c, o, 1, 1); }),
             Catch::Contains("--capacity-factor"));
  c.top_k = 9;
  CHECK_THAT(usage_error_of([&] { validate_model_config(c); }),
             Catch::Contains("--top-k 9 with --experts 8"));
  c.top_k = 2, c.experts = -1;
  CHECK_THAT(usage_error_of([&] { validate_model_config(c); }), Catch::Contains("--experts -1"));
}

TEST_CASE("./train refuses bad expert flags with exit code 2 on every rank", "[parity][experts]") {
  const std::string common =
      "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 32 --seq 16 "
      "--steps 1 --comm-timeout 30 ";
  for (auto [flags, ranks, says] :
       {std::tuple{std::string("--dp 2 --ep 2"), 2, std::string("needs a mixture of experts")},
        {"--experts 4 --top-k 2 --dp 2 --ep 4", 2, "does not divide --dp 2"},
        {"--experts 3 --top-k 1 --dp 2 --ep 2", 2, "does not divide the 3 experts"},
        {"--experts 4 --top-k 5", 0, "--top-k 5 with --experts 4"},
        {"--experts 4 --aux-loss-coef -1", 0, "--aux-loss-coef"}}) {
    RunResult r = run_train(common + flags, ranks);
    INFO(flags << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(says));
  }
}

// Guards: an all-to-all or count exchange that waits without bound, or a fault that never
// reaches the mixture's waits.
TEST_CASE(
    "a rank stuck in a mixture's forward or backward ends the job within --comm-timeout, "
    "naming the expert-parallel wait",
    "[parity][experts]") {
  const std::string common =
      "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 32 --seq 16 --mbs 2 --steps 3 "
      "--val-every 0 --experts 4 --top-k 2 --dp 2 --ep 2 --comm-timeout 5 ";
  for (auto [where, wait] :
       {std::pair{std::string("forward"), std::string("exchange_counts on ep")},
        {"backward", "all_to_all on ep"}}) {
    auto start = std::chrono::steady_clock::now();
    RunResult r = run_train(common + "--fault hang:1:2:" + where, 2);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    INFO(where << "\n" << r.output);
    CHECK(r.code != 0);
    CHECK_THAT(r.output, Catch::Contains(wait));
    CHECK(s < 60);  // 5 s of timeout, start-up and the abort
  }
}

// Zero bubble (Playbook §8.6) with a mixture: the experts' and the router's weight gradients
// wait for the W op as the dense layers' do. The trace shows each W op's deferred work as spans
// inside it ("dW" for a dense linear, "experts' dW" for a mixture), so every "experts' dW" span
// lies inside a W span of its rank: one per block and micro-batch. The weights end as 1F1B's,
// bit for bit: every gradient is the same sum over micro-batches in the same order, only when
// each term is added moves.
TEST_CASE(
    "under zb-h1 a mixture's expert weight gradients run in the W op (the trace), and the weights "
    "equal 1F1B's bit for bit",
    "[parity][experts]") {
  const std::string flags =
      "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 32 --seq 16 --mbs 2 --steps 3 "
      "--val-every 0 --experts 4 --top-k 2 --pp 2 --grad-acc 4 ";
  const std::string dir = make_temp_dir();
  struct Span {
    std::string name;
    double start, end;
  };
  std::map<int, std::vector<Span>> spans;  // per rank (trace pid), its compute spans
  for (const char* schedule : {"zb-h1", "1f1b"}) {
    RunResult r = run_train(flags + "--pp-schedule " + schedule + " --trace " + dir + "/" +
                                schedule + ".json --save " + dir + "/" + schedule,
                            2);
    INFO(schedule << "\n" << r.output);
    REQUIRE(r.code == 0);
    nlohmann::json trace = nlohmann::json::parse(read_whole_file(dir + "/" + schedule + ".json"));
    int experts_spans = 0;
    for (auto& e : trace["traceEvents"]) {
      if (e["ph"] != "X") continue;
      const std::string name = e.value("name", "");
      const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
      experts_spans += name == "experts' dW";
      if (std::string(schedule) == "zb-h1")
        spans[e["pid"].get<int>()].push_back({name, ts, ts + dur});
    }
    // 1F1B computes them in the backward: nothing deferred, no such span.
    if (std::string(schedule) == "1f1b") CHECK(experts_spans == 0);
  }
  REQUIRE(spans.size() == 2);
  for (auto& [rank, list] : spans) {
    int inside = 0, weight_ops = 0;
    for (const Span& s : list) {
      weight_ops += s.name.size() > 1 && s.name[0] == 'W' && isdigit(s.name[1]);
      if (s.name != "experts' dW") continue;
      bool in_w = false;
      for (const Span& w : list)
        in_w |= w.name.size() > 1 && w.name[0] == 'W' && isdigit(w.name[1]) &&
                w.start <= s.start + 1e-3 && s.end <= w.end + 1e-3;  // microseconds
      INFO("rank " << rank << ": an experts' dW span at " << s.start);
      CHECK(in_w);
      inside += in_w;
    }
    INFO("rank " << rank);
    CHECK(weight_ops == 3 * 4);  // 3 steps x 4 micro-batches
    CHECK(inside == 3 * 4);      // each W op: its stage's one block's mixture
  }
  CHECK(read_whole_file(dir + "/zb-h1/model.safetensors") ==
        read_whole_file(dir + "/1f1b/model.safetensors"));
  std::filesystem::remove_all(dir);
}
