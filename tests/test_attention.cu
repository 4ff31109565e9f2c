// Tests for flash_attention.cu: naive causal attention with grouped-query heads against a
// direct per-position loop, the causal mask, gradients against finite differences, and the
// CUDA kernels against the CPU reference.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "flash_attention.cuh"

namespace {

// ----------------------------------------------------------------------------
// The definition, one output row at a time, in double:
// out[b, t, h] = sum_{s <= t} softmax_s(q[b,t,h] . k[b,s,g] / sqrt(hd)) v[b,s,g], g = h/(Hq/Hkv).
std::vector<double> reference_attention(const std::vector<double>& q,
                                        const std::vector<double>& k,
                                        const std::vector<double>& v, const AttentionShape& s) {
  int group = s.Hq / s.Hkv, hd = s.hd;
  std::vector<double> out((size_t)s.B * s.T * s.Hq * hd, 0.0), w(s.T);
  for (int b = 0; b < s.B; b++)
    for (int t = 0; t < s.T; t++)
      for (int h = 0; h < s.Hq; h++) {
        int g = h / group;
        const double* qt = &q[(((size_t)b * s.T + t) * s.Hq + h) * hd];
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j <= t; j++) {
          const double* kj = &k[(((size_t)b * s.T + j) * s.Hkv + g) * hd];
          double dot = 0.0;
          for (int d = 0; d < hd; d++) dot += qt[d] * kj[d];
          w[j] = dot / std::sqrt((double)hd);
          m = std::max(m, w[j]);
        }
        for (int j = 0; j <= t; j++) sum += (w[j] = std::exp(w[j] - m));
        double* o = &out[(((size_t)b * s.T + t) * s.Hq + h) * hd];
        for (int j = 0; j <= t; j++) {
          const double* vj = &v[(((size_t)b * s.T + j) * s.Hkv + g) * hd];
          for (int d = 0; d < hd; d++) o[d] += w[j] / sum * vj[d];
        }
      }
  return out;
}

std::vector<double> as_double(const Tensor& t) {
  std::vector<float> f = to_host_floats(t);
  return std::vector<double>(f.begin(), f.end());
}

// The inputs and buffers of one attention call, on one device.
struct AttentionCase {
  AttentionShape s;
  Tensor q, k, v, out, probs;  // [B*T, Hq, hd], [B*T, Hkv, hd] x 2, [B*T, Hq, hd], [B, Hq, T, T]
  AttentionCase(AttentionShape shape, uint64_t seed) : s(shape) {
    q = empty({(int64_t)s.B * s.T, s.Hq, s.hd}, Mem::Activations);
    k = empty({(int64_t)s.B * s.T, s.Hkv, s.hd}, Mem::Activations);
    v = empty({(int64_t)s.B * s.T, s.Hkv, s.hd}, Mem::Activations);
    out = empty({(int64_t)s.B * s.T, s.Hq, s.hd}, Mem::Activations);
    probs = empty({s.B, s.Hq, s.T, s.T}, Mem::Activations);
    init_normal(q, seed, "q", 1.0f);
    init_normal(k, seed, "k", 1.0f);
    init_normal(v, seed, "v", 1.0f);
  }
  void forward(const Context& ctx) { attention_forward(ctx, out, probs, q, k, v, s); }
};

// |got - want| <= rel * max(1, |want|): relative for large values, absolute near zero.
void require_close(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  for (size_t i = 0; i < got.size(); i++)
    worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
  INFO("worst scaled error " << worst << ", tolerance " << rel);
  REQUIRE(worst <= rel);
}

const AttentionShape kShapes[] = {
    {2, 7, 4, 2, 8},  // GQA: two query heads per key/value head
    {2, 7, 4, 4, 8},  // MHA
    {2, 7, 4, 1, 8},  // MQA: one key/value head for all
};

}  // namespace

// ----------------------------------------------------------------------------

TEST_CASE("naive attention matches a per-position softmax loop for GQA, MHA and MQA",
          "[attention]") {
  Context ctx = Context::create(Device::CPU);
  for (const AttentionShape& s : kShapes) {
    INFO("B " << s.B << " T " << s.T << " Hq " << s.Hq << " Hkv " << s.Hkv << " hd " << s.hd);
    AttentionCase c(s, 11);
    c.forward(ctx);
    // fp32 GEMMs over hd = 8 and T = 7 terms and one expf per score: each output carries a few
    // ulp (~1e-7) of rounding, so 1e-5 leaves a wide margin yet catches any wrong term.
    require_close(to_host_floats(c.out),
                  reference_attention(as_double(c.q), as_double(c.k), as_double(c.v), s), 1e-5);
  }
}

TEST_CASE("the causal mask: output at t never sees keys or values after t", "[attention]") {
  Context ctx = Context::create(Device::CPU);
  AttentionShape s = kShapes[0];
  AttentionCase c(s, 12);
  c.forward(ctx);
  std::vector<float> out = to_host_floats(c.out), probs = to_host_floats(c.probs);
  for (int64_t r = 0; r < (int64_t)s.B * s.Hq; r++)
    for (int i = 0; i < s.T; i++)
      for (int j = i + 1; j < s.T; j++) REQUIRE(probs[(r * s.T + i) * s.T + j] == 0.0f);

  std::vector<float> k = to_host_floats(c.k), v = to_host_floats(c.v);
  int64_t kv_row = (int64_t)s.Hkv * s.hd, q_row = (int64_t)s.Hq * s.hd;
  for (int cut = 0; cut < s.T - 1; cut++) {
    // Large values after `cut`: if they leaked into the max or the sum, the output would move.
    std::vector<float> k2 = k, v2 = v;
    for (int b = 0; b < s.B; b++)
      for (int t = cut + 1; t < s.T; t++)
        for (int64_t e = 0; e < kv_row; e++) {
          k2[(b * s.T + t) * kv_row + e] = 50.0f;
          v2[(b * s.T + t) * kv_row + e] = -1e4f;
        }
    from_host(c.k, k2.data());
    from_host(c.v, v2.data());
    c.forward(ctx);
    std::vector<float> out2 = to_host_floats(c.out);
    for (int b = 0; b < s.B; b++)
      for (int t = 0; t <= cut; t++)
        for (int64_t e = 0; e < q_row; e++) {
          int64_t idx = (b * s.T + t) * q_row + e;
          REQUIRE(out2[idx] == out[idx]);  // exactly: masked terms are exact zeros
        }
  }
}

TEST_CASE("attention backward matches central finite differences of sum(out * R)",
          "[attention]") {
  Context ctx = Context::create(Device::CPU);
  for (const AttentionShape& s : kShapes) {
    INFO("Hq " << s.Hq << " Hkv " << s.Hkv);
    AttentionCase c(s, 13);
    Tensor R = empty(c.out.shape, Mem::Activations);  // dout = dL/dout
    init_normal(R, 13, "R", 1.0f);
    Tensor dq = empty(c.q.shape, Mem::Grads), dk = empty(c.k.shape, Mem::Grads);
    Tensor dv = empty(c.v.shape, Mem::Grads);
    Tensor scratch = empty(c.probs.shape, Mem::Workspace);
    fill_(dk, 1e9f);  // garbage: backward must overwrite, not accumulate into, dk and dv
    fill_(dv, 1e9f);
    c.forward(ctx);
    attention_backward(ctx, dq, dk, dv, R, c.q, c.k, c.v, c.probs, scratch, s);

    // The finite differences run through the double reference, so they carry no fp32 noise:
    // with h = 1e-4 the central-difference truncation error is ~h^2 = 1e-8. What remains is
    // the fp32 rounding of the analytic gradient (a few 1e-7 here), so 1e-5 is a wide margin.
    std::vector<double> q = as_double(c.q), k = as_double(c.k), v = as_double(c.v);
    std::vector<double> r = as_double(R);
    auto loss = [&]() {
      std::vector<double> o = reference_attention(q, k, v, s);
      double L = 0.0;
      for (size_t i = 0; i < o.size(); i++) L += o[i] * r[i];
      return L;
    };
    const double h = 1e-4;
    auto numeric_grad = [&](std::vector<double>& x) {
      std::vector<double> g(x.size());
      for (size_t i = 0; i < x.size(); i++) {
        double x0 = x[i];
        x[i] = x0 + h;
        double up = loss();
        x[i] = x0 - h;
        double down = loss();
        x[i] = x0;
        g[i] = (up - down) / (2 * h);
      }
      return g;
    };
    require_close(to_host_floats(dq), numeric_grad(q), 1e-5);
    require_close(to_host_floats(dk), numeric_grad(k), 1e-5);
    require_close(to_host_floats(dv), numeric_grad(v), 1e-5);
  }
}

TEST_CASE("causal softmax backward matches finite differences of sum(softmax * G)",
          "[attention]") {
  Context ctx = Context::create(Device::CPU);
  const int rows = 3, T = 6;
  const float scale = 0.7f;
  Tensor scores = empty({rows, T, T}, Mem::Activations), G = empty({rows, T, T}, Mem::Activations);
  Tensor probs = empty({rows, T, T}, Mem::Activations), ds = empty({rows, T, T}, Mem::Grads);
  init_normal(scores, 14, "scores", 2.0f);
  init_normal(G, 14, "G", 1.0f);
  causal_softmax_forward(ctx, probs.f32(), scores.f32(), rows, T, scale);
  causal_softmax_backward(ctx, ds.f32(), G.f32(), probs.f32(), rows, T, scale);

  // L(scores) = sum_{r,i,j<=i} softmax(scale * scores[r,i,:i+1])_j * G[r,i,j], in double.
  std::vector<double> x = as_double(scores), g = as_double(G);
  auto loss = [&]() {
    double L = 0.0;
    for (int64_t row = 0; row < (int64_t)rows * T; row++) {
      int i = (int)(row % T);
      double m = -INFINITY, sum = 0.0, dot = 0.0;
      for (int j = 0; j <= i; j++) m = std::max(m, scale * x[row * T + j]);
      for (int j = 0; j <= i; j++) sum += std::exp(scale * x[row * T + j] - m);
      for (int j = 0; j <= i; j++) dot += std::exp(scale * x[row * T + j] - m) * g[row * T + j];
      L += dot / sum;
    }
    return L;
  };
  std::vector<double> numeric(x.size());
  const double h = 1e-4;
  for (size_t i = 0; i < x.size(); i++) {
    double x0 = x[i];
    x[i] = x0 + h;
    double up = loss();
    x[i] = x0 - h;
    double down = loss();
    x[i] = x0;
    numeric[i] = (up - down) / (2 * h);
  }
  // Same reasoning as for attention: exact-in-double differences, fp32 analytic side.
  require_close(to_host_floats(ds), numeric, 1e-5);

  SECTION("in place (dscores aliasing dprobs) gives the same result") {
    Tensor inplace = empty({rows, T, T}, Mem::Grads);
    copy_(inplace, G);
    causal_softmax_backward(ctx, inplace.f32(), inplace.f32(), probs.f32(), rows, T, scale);
    REQUIRE(to_host_floats(inplace) == to_host_floats(ds));
  }
}

// ----------------------------------------------------------------------------
// CUDA against the CPU reference. cuBLAS runs in plain fp32 (no TF32, see Context::create) but
// sums in another order, and the kernels reduce in a warp-shuffle tree: a few ulp apart, so the
// 1e-5 tolerance of the forward test applies; gradients sum longer (T = 70, a group), 1e-4.

TEST_CASE("CUDA attention forward matches the CPU reference", "[attention][gpu]") {
  if (!cuda_available()) {
    WARN("SKIP: no CUDA device");
    return;
  }
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  // T = 7 and T = 70: a row shorter than a warp, and one that wraps the warp twice.
  for (AttentionShape s : {AttentionShape{2, 7, 4, 2, 8}, AttentionShape{2, 70, 6, 2, 16},
                           AttentionShape{1, 70, 4, 1, 32}}) {
    INFO("T " << s.T << " Hq " << s.Hq << " Hkv " << s.Hkv << " hd " << s.hd);
    AttentionCase c(s, 21);
    c.forward(cpu);
    Tensor q = to_device(c.q, Device::CUDA, Mem::Activations);
    Tensor k = to_device(c.k, Device::CUDA, Mem::Activations);
    Tensor v = to_device(c.v, Device::CUDA, Mem::Activations);
    Tensor out = empty(c.out.shape, Mem::Activations, Device::CUDA);
    Tensor probs = empty(c.probs.shape, Mem::Activations, Device::CUDA);
    attention_forward(gpu, out, probs, q, k, v, s);
    gpu.synchronize();
    require_close(to_host_floats(out), as_double(c.out), 1e-5);
    require_close(to_host_floats(probs), as_double(c.probs), 1e-5);
  }
  gpu.destroy();
}

TEST_CASE("CUDA attention backward matches the CPU reference", "[attention][gpu]") {
  if (!cuda_available()) {
    WARN("SKIP: no CUDA device");
    return;
  }
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  for (AttentionShape s : {AttentionShape{2, 7, 4, 2, 8}, AttentionShape{2, 70, 6, 2, 16}}) {
    INFO("T " << s.T << " Hq " << s.Hq << " Hkv " << s.Hkv << " hd " << s.hd);
    AttentionCase c(s, 22);
    Tensor R = empty(c.out.shape, Mem::Activations);
    init_normal(R, 22, "R", 1.0f);
    Tensor dq = empty(c.q.shape, Mem::Grads), dk = empty(c.k.shape, Mem::Grads);
    Tensor dv = empty(c.v.shape, Mem::Grads);
    Tensor scratch = empty(c.probs.shape, Mem::Workspace);
    c.forward(cpu);
    attention_backward(cpu, dq, dk, dv, R, c.q, c.k, c.v, c.probs, scratch, s);

    auto cuda = [](const Tensor& t) { return to_device(t, Device::CUDA, Mem::Activations); };
    Tensor q = cuda(c.q), k = cuda(c.k), v = cuda(c.v), dout = cuda(R);
    Tensor out = empty(c.out.shape, Mem::Activations, Device::CUDA);
    Tensor probs = empty(c.probs.shape, Mem::Activations, Device::CUDA);
    Tensor scratch_gpu = empty(c.probs.shape, Mem::Workspace, Device::CUDA);
    Tensor dq_gpu = empty(c.q.shape, Mem::Grads, Device::CUDA);
    Tensor dk_gpu = empty(c.k.shape, Mem::Grads, Device::CUDA);
    Tensor dv_gpu = empty(c.v.shape, Mem::Grads, Device::CUDA);
    attention_forward(gpu, out, probs, q, k, v, s);
    attention_backward(gpu, dq_gpu, dk_gpu, dv_gpu, dout, q, k, v, probs, scratch_gpu, s);
    gpu.synchronize();
    require_close(to_host_floats(dq_gpu), as_double(dq), 1e-4);
    require_close(to_host_floats(dk_gpu), as_double(dk), 1e-4);
    require_close(to_host_floats(dv_gpu), as_double(dv), 1e-4);
  }
  gpu.destroy();
}
