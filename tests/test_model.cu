// The model as a whole: parameter count, static memory, gradients against finite
// differences, and the recompute modes (Playbook §2.4-§2.6).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <map>

#include "model.cuh"
#include "runtime/ops.cuh"
#include "runtime/optimizer.cuh"

static ModelConfig small_config() {
  ModelConfig c;
  c.vocab = 32, c.d_model = 16, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 24, c.seq = 8;
  c.init_std = 0.2f;  // larger weights: larger gradients, so finite differences resolve them
  return c;
}
// The same shape with the book's GPT block: LayerNorm with a bias, a GeLU MLP of 4h, dropout,
// multi-head attention.
static ModelConfig small_gpt_config() {
  ModelConfig c = small_config();
  c.norm = NormKind::LayerNorm, c.mlp = MlpKind::GeLU, c.ffn = 4 * c.d_model, c.dropout = 0.25f;
  c.kv_heads = c.heads;  // as many key/value heads as query heads, as the book's GPT
  return c;
}

static void random_tokens(std::vector<int32_t>& v, int vocab, uint64_t seed) {
  uint64_t key = rng_key(seed, "tokens");
  for (size_t i = 0; i < v.size(); i++) v[i] = (int32_t)(rng_uniform(key, i) * vocab);
}

TEST_CASE("the tiny preset has 853,120 parameters, as the closed form says", "[model]") {
  ModelConfig c = model_preset("tiny");
  // embed 256*128 + 4 blocks * (2*128 norms + 128*128 q + 2*64*128 kv + 128*128 o
  // + 3*128*384 mlp) + 128 final norm + 256*128 lm_head
  REQUIRE(parameter_count(c) == 32768 + 4 * (256 + 16384 + 16384 + 16384 + 147456) + 128 + 32768);
  for (bool tied : {false, true}) {
    c.tie_embeddings = tied;
    Model m = build_model(c, Device::CPU, 1);
    int64_t allocated = 0;
    for (auto& p : m.named_params) allocated += p.tensor.numel();
    REQUIRE(allocated == parameter_count(c));
    REQUIRE(m.params.numel() == parameter_count(c));
    REQUIRE(m.named_params.size() == (size_t)(4 * 9 + 2 + (tied ? 0 : 1)));
  }
  REQUIRE(parameter_count(model_preset("smollm-135m")) == 134515008);  // SmolLM-135M's count
  REQUIRE(parameter_count(model_preset("llama-1b")) == 1235814400);    // Llama-3.2-1B's count
}

TEST_CASE("fp32 training holds 16 bytes per parameter: weights, gradients, Adam m and v",
          "[model]") {
  MemoryStats before = memory_stats();
  ModelConfig c = model_preset("tiny");
  Model m = build_model(c, Device::CPU, 1);
  AdamMoments moments = adam_moments(m.num_params, Device::CPU);
  MemoryStats after = memory_stats();
  auto grew = [&](Mem k) { return after.current[(int)k] - before.current[(int)k]; };
  int64_t N = parameter_count(c);
  REQUIRE(grew(Mem::Params) == 4 * N);
  REQUIRE(grew(Mem::Grads) == 4 * N);
  REQUIRE(grew(Mem::Optimizer) == 8 * N);
}

TEST_CASE("initialisation depends on (seed, name, index) only", "[model]") {
  ModelConfig c = small_config();
  Model a = build_model(c, Device::CPU, 7), b = build_model(c, Device::CPU, 7);
  Model other = build_model(c, Device::CPU, 8);
  std::vector<float> pa = to_host_floats(a.params), pb = to_host_floats(b.params);
  std::vector<float> po = to_host_floats(other.params);
  REQUIRE(pa == pb);
  REQUIRE(pa != po);
  // A slice of a tensor initialised on its own equals the same slice of the whole tensor.
  Tensor slice = empty({10}, Mem::Workspace);
  init_normal(slice, 7, "model.layers.1.mlp.up_proj.weight", c.init_std, 50);
  std::vector<float> s = to_host_floats(slice);
  std::vector<float> whole = to_host_floats(a.w.blocks[1].w_up);
  REQUIRE(std::equal(s.begin(), s.end(), whole.begin() + 50));
}

// Mean loss of one batch at the current weights (its sequences numbered from sequence0 in the
// run, which draws dropout's masks; -1: none dropped).
static double batch_loss(const Context& ctx, Model& m, const std::vector<int32_t>& ids,
                         const std::vector<int32_t>& tgt, int B, int T, int64_t sequence0 = -1) {
  Activations acts;
  return model_forward(ctx, m, acts, ids.data(), tgt.data(), B, T, Recompute::None, {}, sequence0) /
         (B * T);
}

// small_config's model at seed 3, tied or not, a batch, and the gradients of its mean loss.
struct ModelWithGradients {
  Model m;
  int B = 2, T = 0;
  std::vector<int32_t> ids, tgt;
  int64_t sequence0 = 5;  // the batch's first sequence in the run: dropout's masks, if any
  // The mean loss with tensor p set to `values` (p is restored by the caller).
  double loss_with(const Context& ctx, Tensor& p, const std::vector<float>& values) {
    from_host(p, values.data());
    return batch_loss(ctx, m, ids, tgt, B, T, sequence0);
  }
};
static ModelWithGradients model_with_gradients(const Context& ctx, const ModelConfig& c,
                                               AttentionKind attention = AttentionKind::Naive) {
  ModelWithGradients g{build_model(c, Device::CPU, 3), 2, c.seq};
  g.m.attention = local_attention(attention);
  g.ids.resize(g.B * g.T), g.tgt.resize(g.B * g.T);
  random_tokens(g.ids, c.vocab, 1), random_tokens(g.tgt, c.vocab, 2);
  Activations acts;
  model_forward(ctx, g.m, acts, g.ids.data(), g.tgt.data(), g.B, g.T, Recompute::None, {},
                g.sequence0);
  model_backward(ctx, g.m, acts, 1.0f / (g.B * g.T), Recompute::None);
  return g;
}

// Also the book's GPT block, its dropout masks fixed by where they are drawn (the loss a smooth
// function of the weights with the masks held), with naive attention (masks stored) and with
// FlashAttention (masks drawn again in its backward's tiles).
TEST_CASE("the whole model's gradient matches central finite differences", "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig gpt = small_gpt_config(), tied = small_config(), untied = small_config();
  tied.tie_embeddings = true;
  const std::pair<ModelConfig, AttentionKind> cases[] = {{untied, AttentionKind::Naive},
                                                         {tied, AttentionKind::Naive},
                                                         {gpt, AttentionKind::Naive},
                                                         {gpt, AttentionKind::Flash}};
  for (const auto& [c, attention] : cases) {
    INFO((c.gpt_block()      ? "the GPT block"
          : c.tie_embeddings ? "tied"
                             : "untied")
         << ", " << attention_name(attention) << " attention");
    ModelWithGradients g = model_with_gradients(ctx, c, attention);
    Model& m = g.m;
    // Per tensor: the directional derivative along a random direction u (restricted to that
    // tensor) against (L(p + h u) - L(p - h u)) / 2h. With h = 1e-2 the O(h^2) truncation and
    // the fp32 round-off of L (~1e-7 * |L| / h ~ 3e-5) both stay below 1% of the derivatives
    // here, which are ~1e-2 to 1; 2% relative (plus 1e-4 absolute) is a tight bound on that.
    for (size_t i = 0; i < m.named_params.size(); i++) {
      Tensor p = m.named_params[i].tensor;
      std::vector<float> orig = to_host_floats(p), u(orig.size());
      std::vector<float> grad = to_host_floats(m.named_grads[i].tensor);
      uint64_t key = rng_key(11, m.named_params[i].name);
      double analytic = 0, norm = 0;
      for (size_t k = 0; k < u.size(); k++) {
        u[k] = (float)rng_normal(key, k);
        norm += (double)u[k] * u[k];
      }
      for (size_t k = 0; k < u.size(); k++) analytic += grad[k] * (u[k] /= (float)std::sqrt(norm));
      const float h = 1e-2f;
      std::vector<float> moved(orig);
      for (size_t k = 0; k < u.size(); k++) moved[k] = orig[k] + h * u[k];
      double up = g.loss_with(ctx, p, moved);
      for (size_t k = 0; k < u.size(); k++) moved[k] = orig[k] - h * u[k];
      double down = g.loss_with(ctx, p, moved);
      from_host(p, orig.data());
      double numeric = (up - down) / (2 * h);
      INFO(m.named_params[i].name << " analytic " << analytic << " numeric " << numeric);
      REQUIRE(std::abs(analytic - numeric) <= 1e-4 + 0.02 * std::abs(numeric));
    }
  }
}

// Element by element, where a random direction could hide an error in a few elements (one
// token's embedding row, one head's rows): for every tensor, its largest gradient and three
// elements drawn at random; for the embedding, a row of a token in the batch; for each
// block's q projection, the rows of head 1; for k and v, the rows of kv head 1 (shared by
// query heads 2 and 3). The derivative (L(p + h e_i) - L(p - h e_i)) / 2h is taken in float64
// from the fp32 losses. Its error: the truncation h^2 L'''/6, small at h = 1e-2 for these
// weights (std 0.2), and the fp32 round-off of L (~3.5, a few ulps of 2.4e-7 each) over 2h,
// ~5e-5: hence 1e-4 absolute plus 1% of the derivative (the largest ones are ~1e-1). The
// largest error seen is 0.3 of that.
TEST_CASE(
    "the whole model's gradient matches finite differences element by element, in every "
    "tensor, one embedding row and one head's rows",
    "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig c = small_config();
  const int64_t hd = c.d_model / c.heads, D = c.d_model;
  for (bool tied : {false, true}) {
    c.tie_embeddings = tied;
    ModelWithGradients g = model_with_gradients(ctx, c);
    Model& m = g.m;
    const std::vector<int32_t>& ids = g.ids;
    int checked_rows = 0;
    for (size_t i = 0; i < m.named_params.size(); i++) {
      const std::string& name = m.named_params[i].name;
      Tensor p = m.named_params[i].tensor;
      std::vector<float> orig = to_host_floats(p), grad = to_host_floats(m.named_grads[i].tensor);
      int64_t n = (int64_t)orig.size();
      auto largest_in = [&](int64_t from, int64_t to) {  // index of the largest |g| in [from, to)
        int64_t best = from;
        for (int64_t k = from; k < to; k++)
          if (std::abs(grad[k]) > std::abs(grad[best])) best = k;
        return best;
      };
      std::vector<int64_t> picks = {largest_in(0, n)};
      uint64_t key = rng_key(17, name);
      for (int k = 0; k < 3; k++) picks.push_back((int64_t)(rng_uniform(key, k) * n) % n);
      auto rows = [&](int64_t first, int64_t count) {  // rows [first, first + count) of [., D]
        picks.push_back(largest_in(first * D, (first + count) * D));
        picks.push_back(first * D + (int64_t)(rng_uniform(key, 100 + first) * count * D));
        checked_rows++;
      };
      if (name == "model.embed_tokens.weight") rows(ids[0], 1);
      if (name.find("q_proj") != std::string::npos) rows(1 * hd, hd);
      if (name.find("k_proj") != std::string::npos || name.find("v_proj") != std::string::npos)
        rows(1 * hd, hd);
      for (int64_t k : picks) {
        const float h = 1e-2f;
        std::vector<float> moved(orig);
        moved[k] = orig[k] + h;
        double up = g.loss_with(ctx, p, moved);
        moved[k] = orig[k] - h;
        double down = g.loss_with(ctx, p, moved);
        from_host(p, orig.data());
        // The step actually taken: fp32 rounds orig +- h.
        double numeric = (up - down) / ((double)(orig[k] + h) - (double)(orig[k] - h));
        double error = std::abs(grad[k] - numeric), allowed = 1e-4 + 0.01 * std::abs(numeric);
        INFO((tied ? "tied, " : "")
             << name << "[" << k << "] analytic " << grad[k] << " numeric " << numeric);
        CHECK(error <= allowed);
      }
    }
    REQUIRE(checked_rows == 1 + 3 * c.layers);  // the embedding row, and q, k, v of each block
  }
}

// With the book's GPT block too: recomputation draws dropout's masks again, the same ones.
TEST_CASE("recompute modes give identical gradients and keep less activation memory", "[model]") {
  Context ctx = Context::create(Device::CPU);
  for (ModelConfig c : {small_config(), small_gpt_config()}) {
    INFO((c.gpt_block() ? "the GPT block with dropout" : "the Llama"));
    c.seq = 32;  // long enough that the attention probabilities dominate a block
    int B = 2, T = c.seq;
    std::vector<int32_t> ids(B * T), tgt(B * T);
    random_tokens(ids, c.vocab, 4), random_tokens(tgt, c.vocab, 5);
    std::vector<std::vector<float>> grads;
    std::vector<size_t> peaks;
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      Model m = build_model(c, Device::CPU, 9);
      memory_reset_peak();
      size_t base = memory_stats().current[(int)Mem::Activations];
      Activations acts;
      model_forward(ctx, m, acts, ids.data(), tgt.data(), B, T, mode, {}, 3);
      model_backward(ctx, m, acts, 1.0f / (B * T), mode);
      peaks.push_back(memory_stats().peak[(int)Mem::Activations] - base);
      grads.push_back(to_host_floats(m.grads));
    }
    // Recomputation runs the very same float operations again, so the gradients are bitwise equal.
    REQUIRE(grads[0] == grads[1]);
    REQUIRE(grads[0] == grads[2]);
    INFO("peak activation bytes: none " << peaks[0] << ", selective " << peaks[1] << ", full "
                                        << peaks[2]);
    REQUIRE(peaks[0] > peaks[1]);
    REQUIRE(peaks[1] > peaks[2]);
    // Selective keeps no block's [B, Hq, T, T] probabilities after the forward (it rebuilds one
    // block's at a time in the backward), so it saves at least one block's worth at the peak.
    size_t probs = (size_t)B * c.heads * T * T * sizeof(float);
    REQUIRE(peaks[0] - peaks[1] >= probs);
  }
}

// The book's GPT block keeps what the book counts (Playbook §2.5, Korthikanti et al.): per
// block and token, in bytes, with every tensor in 16 bits: the two LayerNorms' inputs 4h, q k v
// 6h, the out-projection's input 2h, the MLP's input 2h, GeLU's input and output 8h each, two
// dropout masks 2h, and per head and key the probabilities, dropout's mask and what it left
// (5 a s); plus, which the book leaves out, each LayerNorm's mean and 1/std in fp32 (16 bytes).
// Measured on the block, and by the formula the reports print, against that sum written here.
// Under FlashAttention the 5 a s are one fp32 log-sum-exp per head (4 a): it draws dropout's
// masks again in the backward instead of keeping them, so selective recomputation has nothing
// left to drop (Playbook §2.6 and §12.8).
TEST_CASE("the GPT block keeps the book's 34 s b h + 5 a s^2 b bytes of activations", "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig c = small_gpt_config();
  c.seq = 16;
  const int B = 2, T = c.seq;
  const int64_t s = T, b = B, h = c.d_model, a = c.heads;
  std::vector<int32_t> ids(B * T), tgt(B * T);
  random_tokens(ids, c.vocab, 4), random_tokens(tgt, c.vocab, 5);
  // The model's activations in bf16 (e = 2), its residual stream too (er = 2), as the book's.
  ctx.precision = Precision::BF16;
  ctx.residual = DType::BF16;
  Model m = build_model(c, Device::CPU, 9);
  for (AttentionKind kind : {AttentionKind::Naive, AttentionKind::Flash})
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      INFO(attention_name(kind) << ", " << recompute_name(mode));
      m.attention = local_attention(kind);
      Activations acts;
      model_forward(ctx, m, acts, ids.data(), tgt.data(), B, T, mode, {}, 0);
      const int64_t attention = kind == AttentionKind::Flash ? 4 * a * s * b
                                : mode == Recompute::None    ? 5 * a * s * s * b
                                                             : 0;
      const int64_t book = mode == Recompute::Full ? 2 * s * b * h : 34 * s * b * h + attention;
      const int64_t stats = mode == Recompute::Full ? 0 : 2 * 8 * s * b;
      CHECK(saved_bytes(acts.blocks[0]) == book + stats);
      CHECK(activation_bytes_per_block(c, B, T, 1, false, mode, *m.attention, 2, 2) ==
            book + stats);
      model_backward(ctx, m, acts, 1.0f, mode);
    }
}

TEST_CASE("bad model shapes are rejected with the flag named", "[model]") {
  ModelConfig c = model_preset("tiny");
  c.heads = 3;
  REQUIRE_THROWS_WITH(validate_model_config(c),
                      Catch::Contains("--heads 3 does not divide --d-model 128"));
  c = model_preset("tiny");
  c.kv_heads = 3;
  REQUIRE_THROWS_WITH(validate_model_config(c),
                      Catch::Contains("--kv-heads 3 does not divide --heads 4"));
  REQUIRE_THROWS_WITH(model_preset("huge"), Catch::Contains("--model huge"));
}

TEST_CASE("learning rate: linear warmup then cosine to min_lr", "[model]") {
  LrSchedule s{1.0f, 0.1f, 10, 110};
  REQUIRE(learning_rate(s, 0) == Approx(0.1f));
  REQUIRE(learning_rate(s, 9) == Approx(1.0f));
  REQUIRE(learning_rate(s, 10) == Approx(1.0f));
  REQUIRE(learning_rate(s, 60) == Approx(0.55f));  // halfway: (1 + 0.1) / 2
  REQUIRE(learning_rate(s, 110) == Approx(0.1f));
}

// The pipeline seam (DESIGN 6, "Stage"): a model cut into stages, each built on its own from
// the same seed, computes what the whole model computes when the hidden state is handed from
// one stage to the next forward and its gradient back. Expected values: the one-stage model;
// the arithmetic is the same, so the loss and every gradient agree bit for bit. Guards against
// a stage dropping or re-initialising a block, or a stage boundary losing the residual gradient.
TEST_CASE("three stages chained by their hidden states equal the whole model, bit for bit",
          "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig c = small_config();
  c.layers = 3;
  int B = 2, T = c.seq;
  std::vector<int32_t> ids(B * T), tgt(B * T);
  random_tokens(ids, c.vocab, 6), random_tokens(tgt, c.vocab, 7);
  Model whole = build_model(c, Device::CPU, 5);
  Activations all;
  float want = model_forward(ctx, whole, all, ids.data(), tgt.data(), B, T, Recompute::None);
  model_backward(ctx, whole, all, 1.0f / (B * T), Recompute::None);

  // Stage 0: embedding + block 0; stage 1: block 1 alone; stage 2: block 2 + head.
  std::vector<Model> stages = {build_model(c, Device::CPU, 5, {}, {Stage{0, 1, true, false}}),
                               build_model(c, Device::CPU, 5, {}, {Stage{1, 2, false, false}}),
                               build_model(c, Device::CPU, 5, {}, {Stage{2, 3, false, true}})};
  REQUIRE(stages[0].units.size() == 2);  // embedding, block 0
  REQUIRE(stages[1].units[0].name == "block 1");
  REQUIRE(stages[2].units.back().name == "head");
  std::vector<Activations> acts(3);
  StagePayload hidden;
  float got = 0;
  for (int s = 0; s < 3; s++) {
    got = (float)read_total(ctx, {stage_forward(ctx, stages[s], acts[s], ids.data(), hidden,
                                                tgt.data(), B, T, Recompute::None)});
    hidden = stage_output(ctx, stages[s], acts[s]);
    REQUIRE(hidden.size() == 1);  // a dense model carries nothing besides the hidden state
  }
  REQUIRE(got == want);
  StagePayload d_hidden;
  for (int s = 2; s >= 0; s--)
    d_hidden = stage_backward(ctx, stages[s], acts[s], 1.0f / (B * T), d_hidden, Recompute::None);
  REQUIRE(d_hidden.empty());  // the first stage has no input hidden state
  int checked = 0;
  for (const Model& stage : stages)
    for (const NamedTensor& g : stage.named_grads)
      for (const NamedTensor& w : whole.named_grads)
        if (w.name == g.name) {
          INFO(g.name);
          REQUIRE(to_host_floats(g.tensor) == to_host_floats(w.tensor));
          checked++;
        }
  REQUIRE(checked == (int)whole.named_grads.size());  // every tensor on exactly one stage
}

// Playbook §12.8: FlashAttention keeps the output and one log-sum-exp per query and head, so a
// block's saved activations grow linearly with T; naive attention keeps [B, H, T, T]
// probabilities. Measured from the tensors the forward keeps (the allocator's category), next
// to model.cu's formula, at T = 256 ... 2048. Expected growth from the closed form: exactly 2x
// per doubling with flash; with naive the T^2 term (4 Hq T per token) comes to dominate.
TEST_CASE("a block keeps O(T) activations with FlashAttention and O(T^2) with naive attention",
          "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig c = small_config();
  c.layers = 1;
  std::map<AttentionKind, std::vector<int64_t>> bytes;
  for (AttentionKind attention : {AttentionKind::Flash, AttentionKind::Naive})
    for (int T : {256, 512, 1024, 2048}) {
      c.seq = T;
      Model m = build_model(c, Device::CPU, 2);
      m.attention = local_attention(attention);
      std::vector<int32_t> ids(T), tgt(T);
      random_tokens(ids, c.vocab, 8), random_tokens(tgt, c.vocab, 9);
      size_t before = memory_stats().current[(int)Mem::Activations];
      Activations acts;
      model_forward(ctx, m, acts, ids.data(), tgt.data(), 1, T, Recompute::None);
      int64_t measured = saved_bytes(acts.blocks[0]);
      INFO(attention_name(attention) << " at T " << T);
      REQUIRE(measured == activation_bytes_per_block(c, 1, T, 1, false, Recompute::None,
                                                     *local_attention(attention)));
      REQUIRE((int64_t)(memory_stats().current[(int)Mem::Activations] - before) >= measured);
      // Per token, D 16, Hkv hd 8, F 24, Hq 4: N (16 D + 8) + N (8 D + 8 Hkv hd + 12 F) + lse or
      // probabilities, all in bytes.
      int64_t linear = (int64_t)T * (16 * 16 + 8) + (int64_t)T * (8 * 16 + 8 * 8 + 12 * 24);
      REQUIRE(measured == linear + (attention == AttentionKind::Flash ? 4 * 4 * (int64_t)T
                                                                      : 4 * 4 * (int64_t)T * T));
      bytes[attention].push_back(measured);
    }
  for (size_t i = 1; i < bytes[AttentionKind::Flash].size(); i++) {
    REQUIRE(bytes[AttentionKind::Flash][i] == 2 * bytes[AttentionKind::Flash][i - 1]);
    REQUIRE(bytes[AttentionKind::Naive][i] > 3 * bytes[AttentionKind::Naive][i - 1]);
  }
}

// The model's gradient with FlashAttention against naive attention, element by element: the
// two compute the same function, their fp32 sums in different orders (~1e-7 relative per
// score); 1e-5 of each tensor's scale allows that and fails for a wrong mask, scale or head.
TEST_CASE("FlashAttention and naive attention give the same loss and gradients", "[model]") {
  Context ctx = Context::create(Device::CPU);
  ModelConfig c = small_config();
  c.seq = 70;                 // not a multiple of the 64-token tile
  for (int kv : {4, 2, 1}) {  // MHA, GQA, MQA
    c.kv_heads = kv;
    int B = 2, T = c.seq;
    std::vector<int32_t> ids(B * T), tgt(B * T);
    random_tokens(ids, c.vocab, 10), random_tokens(tgt, c.vocab, 11);
    std::vector<Model> models;
    std::vector<float> losses;
    for (AttentionKind attention : {AttentionKind::Naive, AttentionKind::Flash}) {
      models.push_back(build_model(c, Device::CPU, 4));
      models.back().attention = local_attention(attention);
      Activations acts;
      losses.push_back(model_forward(ctx, models.back(), acts, ids.data(), tgt.data(), B, T,
                                     Recompute::Selective));
      model_backward(ctx, models.back(), acts, 1.0f / (B * T), Recompute::Selective);
    }
    INFO("kv heads " << kv);
    REQUIRE(losses[1] == Approx(losses[0]).epsilon(1e-6));
    for (size_t i = 0; i < models[0].named_grads.size(); i++) {
      std::vector<float> naive = to_host_floats(models[0].named_grads[i].tensor);
      std::vector<float> flash = to_host_floats(models[1].named_grads[i].tensor);
      double scale = 0;
      for (float g : naive) scale = std::max(scale, (double)std::abs(g));
      for (size_t k = 0; k < naive.size(); k++) {
        INFO(models[0].named_grads[i].name << "[" << k << "]");
        REQUIRE(std::abs(flash[k] - naive[k]) <= 1e-5 * scale + 1e-9);
      }
    }
  }
}
