// Tests for attention_naive.cu and flash_attention*.cu: naive causal attention with
// grouped-query heads against a direct per-position loop, the causal mask, gradients against
// finite differences, and the CUDA kernels against the CPU reference; then FlashAttention
// against naive attention and a float64 reference (the FlashAttention paper's rule), offsets
// and fully masked blocks, the LSE merge as a ring of two uses it, its memory, and its CUDA
// kernels (fp32 and bf16).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "cuda_case.cuh"
#include "flash_attention.cuh"
#include "kernels/attention_naive.cuh"
#include "runtime/dtype.cuh"
#include "usage_error.cuh"

namespace {

// ----------------------------------------------------------------------------
// The definition, one output row at a time, in double:
// out[b, t, h] = sum_{s <= t} softmax_s(q[b,t,h] . k[b,s,g] / sqrt(hd)) v[b,s,g], g = h/(Hq/Hkv).
std::vector<double> reference_attention(const std::vector<double>& q, const std::vector<double>& k,
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

// d loss / d x[i] for every element, by central differences (loss(x + h) - loss(x - h)) / 2h in
// double, x restored after each.
template <class Loss>
std::vector<double> central_differences(std::vector<double>& x, Loss loss, double h) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); i++) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = loss();
    x[i] = x0 - h;
    const double down = loss();
    x[i] = x0;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

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

TEST_CASE("attention backward matches central finite differences of sum(out * R)", "[attention]") {
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
    require_close(to_host_floats(dq), central_differences(q, loss, 1e-4), 1e-5);
    require_close(to_host_floats(dk), central_differences(k, loss, 1e-4), 1e-5);
    require_close(to_host_floats(dv), central_differences(v, loss, 1e-4), 1e-5);
  }
}

TEST_CASE("causal softmax backward matches finite differences of sum(softmax * G)", "[attention]") {
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
  // Same reasoning as for attention: exact-in-double differences, fp32 analytic side.
  require_close(to_host_floats(ds), central_differences(x, loss, 1e-4), 1e-5);

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
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  // T = 7 and T = 70: a row shorter than a warp, and one that wraps the warp twice. The GEMMs
  // batch over the sequences (B >= Hq/Hkv: the first and last shapes) or over a kv group's
  // heads (the other two).
  for (AttentionShape s : {AttentionShape{2, 7, 4, 2, 8}, AttentionShape{2, 70, 6, 2, 16},
                           AttentionShape{1, 70, 4, 1, 32}, AttentionShape{3, 33, 4, 4, 8}}) {
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
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  for (AttentionShape s : {AttentionShape{2, 7, 4, 2, 8}, AttentionShape{2, 70, 6, 2, 16},
                           AttentionShape{3, 33, 4, 4, 8}}) {
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

// ============================================================================
// FlashAttention
// ============================================================================

namespace {

// Attention of one block written as the definition, per (sequence, head, query), in scalar S:
// double is the reference, float is "naive at the same precision" for the FlashAttention
// paper's rule (its error is the bar flash must stay within twice of). Backward from dout
// with D = sum_j P dP, the textbook form. Under dropout (a.drop on) each probability P_j is
// multiplied by its factor F_j (1/(1-p) kept, 0 dropped) before it meets v: out = sum F P v,
// dV += F P dO and dP = F dO.v, by the chain rule through that product.
template <class S>
struct BlockResult {
  std::vector<S> out, lse, dq, dk, dv;
};
template <class S>
BlockResult<S> attention_by_definition(const std::vector<float>& q, const std::vector<float>& k,
                                       const std::vector<float>& v, const std::vector<float>& dout,
                                       const AttentionBlock& a) {
  const int hd = a.hd, group = a.Hq / a.Hkv;
  const S scale = S(1) / std::sqrt(S(hd));
  BlockResult<S> r;
  r.out.assign(q.size(), S(0));
  r.dq.assign(q.size(), S(0));
  r.dk.assign(k.size(), S(0));
  r.dv.assign(v.size(), S(0));
  r.lse.assign((size_t)a.B * a.Hq * a.Tq, S(-INFINITY));
  std::vector<S> p(a.Tk), dp(a.Tk), f(a.Tk);
  for (int b = 0; b < a.B; b++)
    for (int h = 0; h < a.Hq; h++)
      for (int i = 0; i < a.Tq; i++) {
        const size_t qo = (((size_t)b * a.Tq + i) * a.Hq + h) * hd;
        auto ko = [&](int j) { return (((size_t)b * a.Tk + j) * a.Hkv + h / group) * hd; };
        int seen = 0;  // keys 0..seen-1 are visible (a prefix, as the mask is causal)
        while (seen < a.Tk && (!a.causal || a.k0 + seen <= a.q0 + i)) seen++;
        if (seen == 0) continue;  // out 0, lse -inf, no gradient
        S m = S(-INFINITY), sum = S(0);
        for (int j = 0; j < seen; j++) {
          S dot = S(0);
          for (int d = 0; d < hd; d++) dot += S(q[qo + d]) * S(k[ko(j) + d]);
          p[j] = scale * dot;
          m = std::max(m, p[j]);
        }
        for (int j = 0; j < seen; j++) sum += (p[j] = std::exp(p[j] - m));
        r.lse[((size_t)b * a.Hq + h) * a.Tq + i] = m + std::log(sum);
        S Drow = S(0);
        for (int j = 0; j < seen; j++) {
          p[j] /= sum;
          f[j] = a.drop.on() ? S(a.drop.factor(b, h, a.q0 + i, a.k0 + j)) : S(1);
          dp[j] = S(0);
          for (int d = 0; d < hd; d++) {
            r.out[qo + d] += f[j] * p[j] * S(v[ko(j) + d]);
            dp[j] += S(dout[qo + d]) * S(v[ko(j) + d]);
          }
          dp[j] *= f[j];
          Drow += p[j] * dp[j];
        }
        for (int j = 0; j < seen; j++) {
          const S ds = p[j] * (dp[j] - Drow);
          for (int d = 0; d < hd; d++) {
            r.dq[qo + d] += scale * ds * S(k[ko(j) + d]);
            r.dk[ko(j) + d] += scale * ds * S(q[qo + d]);
            r.dv[ko(j) + d] += f[j] * p[j] * S(dout[qo + d]);
          }
        }
      }
  return r;
}

// Largest |got - want| and largest |want|; -inf must match -inf exactly (lse of unseen rows).
struct Error {
  double worst = 0.0, scale = 0.0;
};
template <class G, class W>
Error max_error(const std::vector<G>& got, const std::vector<W>& want) {
  REQUIRE(got.size() == want.size());
  Error e;
  for (size_t i = 0; i < got.size(); i++) {
    const double g = got[i], w = want[i];
    REQUIRE(!std::isnan(g));
    if (std::isinf(w) || std::isinf(g)) {
      REQUIRE(g == w);
      continue;
    }
    e.worst = std::max(e.worst, std::abs(g - w));
    e.scale = std::max(e.scale, std::abs(w));
  }
  return e;
}

// The FlashAttention paper's rule: flash's error against float64 at most twice naive's at the
// same precision. Both are a few fp32 ulp of the largest value, so on one case their ratio is
// noisy, and a naive result that happens to be almost exact would fail a correct flash: a floor
// of two ulp of the largest value (2^-22 of it) is allowed as well. That is the size of the
// rounding errors themselves; a wrong mask or a missed rescale is off by orders of magnitude.
void require_flash_rule(const char* what, const Error& flash, const Error& naive) {
  const double floor = std::ldexp(1.0, -22) * std::max(1.0, flash.scale);
  INFO(what << ": flash error " << flash.worst << ", naive error " << naive.worst << ", floor "
            << floor << ", largest value " << flash.scale);
  REQUIRE(flash.worst <= 2.0 * naive.worst + floor);
}

// A block's inputs and flash's results on the CPU.
struct FlashCase {
  AttentionBlock a;
  Tensor q, k, v, dout;            // inputs, upstream gradient random too
  Tensor out, lse, D, dq, dk, dv;  // flash's results
  // q_std scales the scores: at 5 the softmax is peaked and each row's running max moves by
  // several units from tile to tile, so the online rescaling is exercised for real.
  FlashCase(const AttentionBlock& block, uint64_t seed, float q_std = 1.0f) : a(block) {
    const int64_t tq = (int64_t)a.B * a.Tq, tk = (int64_t)a.B * a.Tk;
    q = empty({tq, a.Hq, a.hd}, Mem::Activations);
    k = empty({tk, a.Hkv, a.hd}, Mem::Activations);
    v = empty({tk, a.Hkv, a.hd}, Mem::Activations);
    dout = empty({tq, a.Hq, a.hd}, Mem::Activations);
    init_normal(q, seed, "q", q_std);
    init_normal(k, seed, "k", 1.0f);
    init_normal(v, seed, "v", 1.0f);
    init_normal(dout, seed, "dout", 1.0f);
    out = empty(q.shape, Mem::Activations);
    lse = empty({a.B, a.Hq, a.Tq}, Mem::Activations);
    D = empty({a.B, a.Hq, a.Tq}, Mem::Activations);
    dq = zeros(q.shape, Mem::Grads);
    dk = zeros(k.shape, Mem::Grads);
    dv = zeros(v.shape, Mem::Grads);
  }
  void run(const Context& ctx) {  // forward, D, backward (into zeroed gradients)
    flash_attention_forward(ctx, out, lse, q, k, v, a);
    attention_out_dot_dout(ctx, D, dout, out, a);
    flash_attention_backward(ctx, dq, dk, dv, dout, q, k, v, lse, D, a);
  }
  template <class S>
  BlockResult<S> by_definition() const {
    return attention_by_definition<S>(to_host_floats(q), to_host_floats(k), to_host_floats(v),
                                      to_host_floats(dout), a);
  }
};

std::string describe(const AttentionBlock& a) {
  return "B " + std::to_string(a.B) + " Tq " + std::to_string(a.Tq) + " Tk " +
         std::to_string(a.Tk) + " Hq " + std::to_string(a.Hq) + " Hkv " + std::to_string(a.Hkv) +
         " hd " + std::to_string(a.hd) + " q0 " + std::to_string(a.q0) + " k0 " +
         std::to_string(a.k0) + (a.causal ? " causal" : " full");
}

// Sizes that are not multiples of the 64 (CPU) or 32 (CUDA fp32) tile; MHA, GQA, MQA; causal
// and not; queries after, inside and before the keys, including blocks whose first query tile
// sees no key at all and a block no query of which sees any key.
const AttentionBlock kFlashBlocks[] = {
    {2, 100, 100, 4, 2, 16, 0, 0, true},      // GQA, square: the model's own call
    {1, 130, 130, 4, 4, 32, 0, 0, true},      // MHA, three tiles, the last partial
    {2, 77, 77, 4, 1, 8, 0, 0, true},         // MQA
    {2, 90, 70, 4, 2, 16, 0, 0, false},       // no mask, Tq != Tk
    {1, 100, 150, 4, 2, 16, 200, 100, true},  // queries [200, 300) vs keys [100, 250)
    {2, 100, 100, 4, 2, 16, 0, 64, true},     // keys start at 64: queries 0..63 see nothing
    {1, 70, 130, 2, 1, 32, 0, 200, true},     // every key in every query's future
};

}  // namespace

TEST_CASE("FlashAttention's error against float64 is at most twice naive attention's",
          "[attention][flash]") {
  Context ctx = Context::create(Device::CPU);
  for (float q_std : {1.0f, 5.0f})
    for (const AttentionBlock& a : kFlashBlocks) {
      INFO(describe(a) << ", q std " << q_std);
      FlashCase c(a, 31, q_std);
      c.run(ctx);
      BlockResult<double> ref = c.by_definition<double>();
      BlockResult<float> naive = c.by_definition<float>();
      require_flash_rule("out", max_error(to_host_floats(c.out), ref.out),
                         max_error(naive.out, ref.out));
      require_flash_rule("lse", max_error(to_host_floats(c.lse), ref.lse),
                         max_error(naive.lse, ref.lse));
      require_flash_rule("dq", max_error(to_host_floats(c.dq), ref.dq),
                         max_error(naive.dq, ref.dq));
      require_flash_rule("dk", max_error(to_host_floats(c.dk), ref.dk),
                         max_error(naive.dk, ref.dk));
      require_flash_rule("dv", max_error(to_host_floats(c.dv), ref.dv),
                         max_error(naive.dv, ref.dv));

      if (a.q0 != 0 || a.k0 != 0 || a.Tq != a.Tk || !a.causal) continue;
      // The square causal block is what naive attention computes: hold flash to its error too.
      AttentionShape s{a.B, a.Tq, a.Hq, a.Hkv, a.hd};
      Tensor out = empty(c.out.shape, Mem::Activations),
             probs = empty({a.B, a.Hq, a.Tq, a.Tq}, Mem::Activations);
      Tensor scratch = empty(probs.shape, Mem::Workspace);
      Tensor dq = empty(c.q.shape, Mem::Grads), dk = empty(c.k.shape, Mem::Grads),
             dv = empty(c.v.shape, Mem::Grads);
      attention_forward(ctx, out, probs, c.q, c.k, c.v, s);
      attention_backward(ctx, dq, dk, dv, c.dout, c.q, c.k, c.v, probs, scratch, s);
      // The float64 definition is right: naive attention, checked by finite differences above,
      // lands within fp32 rounding of it (so the rule is not met by a wrong reference).
      REQUIRE(max_error(to_host_floats(dq), ref.dq).worst < 1e-4);
      require_flash_rule("out vs naive attention", max_error(to_host_floats(c.out), ref.out),
                         max_error(to_host_floats(out), ref.out));
      require_flash_rule("dq vs naive attention", max_error(to_host_floats(c.dq), ref.dq),
                         max_error(to_host_floats(dq), ref.dq));
      require_flash_rule("dk vs naive attention", max_error(to_host_floats(c.dk), ref.dk),
                         max_error(to_host_floats(dk), ref.dk));
      require_flash_rule("dv vs naive attention", max_error(to_host_floats(c.dv), ref.dv),
                         max_error(to_host_floats(dv), ref.dv));
    }
}

// Dropout on the probabilities (the book's GPT), drawn in FlashAttention's tile loops: two
// sequences numbered 7 and 3 in the run, query heads from 2 (a tensor-parallel rank's), p 0.3.
AttentionDraw test_draw(const Tensor& sequences, int64_t stride) {
  AttentionDropout d{DropoutSite{11, 1, 0, 0.3f}, sequences, Tensor(), 2};
  return d.draw(stride);
}

TEST_CASE("FlashAttention under dropout keeps to the masked definition in float64",
          "[attention][flash]") {
  // Every block of kFlashBlocks (queries and keys at other positions, tile edges, no key seen)
  // with dropout: flash draws each probability's mask in its tiles; the definition multiplies
  // the softmax by the same factors and takes the chain rule through them. Held to the same
  // rule as without dropout (twice the float definition's error). That the factors are the
  // masks naive attention stores, the next case shows.
  Context ctx = Context::create(Device::CPU);
  Tensor sequences = device_ints(ctx, {7, 3});
  for (float q_std : {1.0f, 5.0f})
    for (AttentionBlock a : kFlashBlocks) {
      a.drop = test_draw(sequences, 1);
      INFO(describe(a) << ", q std " << q_std << ", dropout 0.3");
      FlashCase c(a, 34, q_std);
      c.run(ctx);
      BlockResult<double> ref = c.by_definition<double>();
      BlockResult<float> naive = c.by_definition<float>();
      for (auto [name, got, want, bar] : {std::tuple{"out", &c.out, &ref.out, &naive.out},
                                          std::tuple{"dq", &c.dq, &ref.dq, &naive.dq},
                                          std::tuple{"dk", &c.dk, &ref.dk, &naive.dk},
                                          std::tuple{"dv", &c.dv, &ref.dv, &naive.dv}})
        require_flash_rule(name, max_error(to_host_floats(*got), *want), max_error(*bar, *want));
      // The masks are there: the same block without dropout is far from these outputs.
      AttentionBlock plain = a;
      plain.drop = AttentionDraw{};
      if (std::any_of(ref.lse.begin(), ref.lse.end(), [](double l) { return std::isfinite(l); }))
        REQUIRE(max_error(c.by_definition<double>().out,
                          FlashCase(plain, 34, q_std).by_definition<double>().out)
                    .worst > 0.1);
    }
}

TEST_CASE("FlashAttention under dropout drops what naive attention drops, forward and backward",
          "[attention][flash]") {
  // The two attention cores of the model with one AttentionDropout: naive attention stores the
  // masked probabilities (dropout_attention_forward); flash draws them per tile. GQA, T = 70
  // (a partial second CPU tile), tp's head offset 2. The same masks give the same outputs and
  // gradients up to fp32 summation order: 1e-5 of max(1, |value|), 1e-4 for the gradients,
  // which sum over a sequence (the tolerances of the CUDA-against-CPU cases above).
  Context ctx = Context::create(Device::CPU);
  AttentionShape s{2, 70, 4, 2, 16};
  std::vector<int32_t> positions, numbers;
  for (int i = 0; i < s.B * s.T; i++)
    positions.push_back(i % s.T), numbers.push_back(i < s.T ? 7 : 3);
  AttentionDropout dropout{DropoutSite{11, 1, 0, 0.3f}, device_ints(ctx, numbers),
                           device_ints(ctx, positions), 2};
  s.dropout = &dropout;
  AttentionCase c(s, 35);
  Tensor dout = empty(c.out.shape, Mem::Activations);
  init_normal(dout, 35, "dout", 1.0f);
  struct Result {
    Tensor out, dq, dk, dv;
  };
  auto run = [&](AttentionKind kind) {
    std::shared_ptr<const AttentionCore> core = local_attention(kind);
    Result r{empty(c.out.shape, Mem::Activations), empty(c.q.shape, Mem::Grads),
             empty(c.k.shape, Mem::Grads), empty(c.v.shape, Mem::Grads)};
    AttentionSaved saved;
    core->forward(ctx, s, r.out, saved, c.q, c.k, c.v);
    core->backward(ctx, s, r.dq, r.dk, r.dv, dout, r.out, saved, c.q, c.k, c.v);
    return r;
  };
  Result naive = run(AttentionKind::Naive), flash = run(AttentionKind::Flash);
  require_close(to_host_floats(flash.out), as_double(naive.out), 1e-5);
  require_close(to_host_floats(flash.dq), as_double(naive.dq), 1e-4);
  require_close(to_host_floats(flash.dk), as_double(naive.dk), 1e-4);
  require_close(to_host_floats(flash.dv), as_double(naive.dv), 1e-4);
}

TEST_CASE("a query that sees no key gets output 0, lse -inf and zero gradients, never NaN",
          "[attention][flash]") {
  Context ctx = Context::create(Device::CPU);
  // Keys at [64, 164): queries 0..63 (the whole first CPU tile, two CUDA tiles) see none.
  FlashCase c({2, 100, 100, 4, 2, 16, 0, 64, true}, 32);
  fill_(c.out, NAN);  // stale values must be overwritten, not skipped
  c.run(ctx);
  std::vector<float> out = to_host_floats(c.out), lse = to_host_floats(c.lse);
  std::vector<float> dq = to_host_floats(c.dq);
  const AttentionBlock& a = c.a;
  for (int b = 0; b < a.B; b++)
    for (int h = 0; h < a.Hq; h++)
      for (int i = 0; i < a.Tq; i++) {
        const float l = lse[((size_t)b * a.Hq + h) * a.Tq + i];
        REQUIRE(!std::isnan(l));
        REQUIRE((i < 64) == (l == -INFINITY));
        for (int d = 0; d < a.hd; d++) {
          const size_t idx = (((size_t)b * a.Tq + i) * a.Hq + h) * a.hd + d;
          REQUIRE(!std::isnan(out[idx]));
          REQUIRE(!std::isnan(dq[idx]));
          if (i < 64) REQUIRE((out[idx] == 0.0f && dq[idx] == 0.0f));
        }
      }
  // Keys 36..99 (positions 100..163) are in every query's future: no gradient reaches them.
  std::vector<float> dk = to_host_floats(c.dk), dv = to_host_floats(c.dv);
  for (int b = 0; b < a.B; b++)
    for (int j = 0; j < a.Tk; j++)
      for (int e = 0; e < a.Hkv * a.hd; e++) {
        const size_t idx = ((size_t)b * a.Tk + j) * a.Hkv * a.hd + e;
        REQUIRE((!std::isnan(dk[idx]) && !std::isnan(dv[idx])));
        if (j >= 36) REQUIRE((dk[idx] == 0.0f && dv[idx] == 0.0f));
      }
}

TEST_CASE("the LSE merge gives a side at -inf weight 0, without NaN", "[attention][flash]") {
  Context ctx = Context::create(Device::CPU);
  AttentionBlock a{1, 3, 0, 1, 1, 2};  // three queries, one head, hd 2 (Tk unused)
  Tensor out = empty({3, 1, 2}, Mem::Activations), out2 = empty({3, 1, 2}, Mem::Activations);
  Tensor lse = empty({1, 1, 3}, Mem::Activations), lse2 = empty({1, 1, 3}, Mem::Activations);
  const float o1[] = {1, 2, 0, 0, 0, 0}, o2[] = {0, 0, 5, 6, 0, 0};
  const float l1[] = {0.5f, -INFINITY, -INFINITY}, l2[] = {-INFINITY, 1.5f, -INFINITY};
  from_host(out, o1), from_host(out2, o2), from_host(lse, l1), from_host(lse2, l2);
  attention_lse_merge(ctx, out, lse, out2, lse2, a);
  // Query 0 saw only side 1, query 1 only side 2, query 2 nothing: each result is exact.
  REQUIRE(to_host_floats(out) == std::vector<float>{1, 2, 5, 6, 0, 0});
  REQUIRE(to_host_floats(lse) == std::vector<float>{0.5f, 1.5f, -INFINITY});
}

// A block's output in bf16 (the tensor-core kernels'): merged as its values widened, exactly.
TEST_CASE("the LSE merge reads a bf16 side as its value widened to fp32", "[attention][flash]") {
  Context ctx = Context::create(Device::CPU);
  AttentionBlock a{2, 5, 0, 3, 1, 16};  // Tk unused
  Tensor out = empty({2 * 5, 3, 16}, Mem::Activations), side = empty(out.shape, Mem::Activations);
  Tensor lse = empty({2, 3, 5}, Mem::Activations), lse2 = empty(lse.shape, Mem::Activations);
  init_normal(out, 7, "out", 1.0f), init_normal(side, 7, "side", 1.0f);
  init_normal(lse, 7, "lse", 2.0f), init_normal(lse2, 7, "lse2", 2.0f);
  Tensor side16 = cast_to(ctx, side, DType::BF16), widened = cast_to(ctx, side16, DType::F32);
  Tensor out_w = to_device(out, Device::CPU, Mem::Activations);
  Tensor lse_w = to_device(lse, Device::CPU, Mem::Activations);
  attention_lse_merge(ctx, out, lse, side16, lse2, a);
  attention_lse_merge(ctx, out_w, lse_w, widened, lse2, a);
  REQUIRE(to_host_floats(out) == to_host_floats(out_w));
  REQUIRE(to_host_floats(lse) == to_host_floats(lse_w));
}

namespace {
// Tokens [start, start + len) of each of B sequences of a [B*T, width] host array.
std::vector<float> tokens(const std::vector<float>& x, int B, int T, int width, int start,
                          int len) {
  std::vector<float> y;
  for (int b = 0; b < B; b++)
    y.insert(y.end(), x.begin() + ((size_t)b * T + start) * width,
             x.begin() + ((size_t)b * T + start + len) * width);
  return y;
}
Tensor host_tensor(const std::vector<float>& x, std::vector<int64_t> shape, Mem m) {
  Tensor t = empty(shape, m);
  from_host(t, x.data());
  return t;
}
}  // namespace

TEST_CASE("FlashAttention's memory grows like T, naive attention's probabilities like T^2",
          "[attention][flash]") {
  // Playbook §12.8: flash keeps the output and one lse per (query, head) and works in tiles;
  // naive keeps [B, Hq, T, T] probabilities (and backward a second such buffer).
  Context ctx = Context::create(Device::CPU);
  std::vector<double> flash_bytes, naive_bytes;
  const int Ts[] = {256, 512, 1024, 2048};
  for (int T : Ts) {
    AttentionBlock a{1, T, T, 4, 2, 32, 0, 0, true};
    FlashCase c(a, 34);
    // Flash: what the forward keeps besides its output (lse) and D for backward, plus the
    // peak workspace of forward and backward, measured by the allocator's counters.
    size_t base = memory_stats().current[(int)Mem::Workspace];
    memory_reset_peak();
    c.run(ctx);
    size_t workspace = memory_stats().peak[(int)Mem::Workspace] - base;
    flash_bytes.push_back((double)(workspace + c.lse.nbytes() + c.D.nbytes()));
    // Naive: the probabilities its forward keeps and the scratch its backward needs, as the
    // allocator counts them when allocated for it.
    size_t before =
        memory_stats().current[(int)Mem::Activations] + memory_stats().current[(int)Mem::Workspace];
    Tensor probs = empty({a.B, a.Hq, T, T}, Mem::Activations);
    Tensor scratch = empty(probs.shape, Mem::Workspace);
    naive_bytes.push_back((double)(memory_stats().current[(int)Mem::Activations] +
                                   memory_stats().current[(int)Mem::Workspace] - before));
    INFO("T " << T << ": flash " << flash_bytes.back() << " B (workspace " << workspace
              << " B), naive " << naive_bytes.back() << " B");
    REQUIRE(workspace > 0);  // the tiles are counted, so the measurement sees them
    if (flash_bytes.size() == 1) continue;
    size_t n = flash_bytes.size();
    REQUIRE(flash_bytes[n - 1] <= 2.0 * flash_bytes[n - 2]);  // doubling T at most doubles it
    REQUIRE(naive_bytes[n - 1] == 4.0 * naive_bytes[n - 2]);  // doubling T quadruples it
  }
  REQUIRE(flash_bytes.back() * 100 < naive_bytes.back());  // at T = 2048, under 1%
}

// ----------------------------------------------------------------------------
// CUDA FlashAttention against the CPU version.

namespace {
// |got - want| <= tol * max(1, largest |want|), -inf matching exactly, no NaN.
template <class G, class W>
void require_near(const char* what, const std::vector<G>& got, const std::vector<W>& want,
                  double tol) {
  Error e = max_error(got, want);
  INFO(what << ": worst error " << e.worst << ", largest value " << e.scale << ", tolerance " << tol
            << " of max(1, largest)");
  REQUIRE(e.worst <= tol * std::max(1.0, e.scale));
}
Tensor on_gpu(const Tensor& t) {
  return to_device(t, Device::CUDA, Mem::Activations);
}
Tensor gpu_zeros(const Tensor& like) {
  return zeros(like.shape, Mem::Grads, Device::CUDA);
}

// The nearest bf16 value (round to nearest even), as a float: inputs rounded so, the CPU and
// the bf16 kernels see exactly the same numbers.
float round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}
void round_to_bf16(const Tensor& t) {
  std::vector<float> x = to_host_floats(t);
  for (float& e : x) e = round_to_bf16(e);
  from_host(t, x.data());
}
// A CPU tensor's values on the GPU, in bf16 (inputs already bf16-valued: exact).
Tensor bf16_on_gpu(const Context& gpu, const Tensor& cpu) {
  return cast_to(gpu, on_gpu(cpu), DType::BF16, Mem::Activations);
}

// Block a (c's, its dropout drawn from device memory) on the GPU, every result held to the CPU
// run of c. Forward: the same fp32 math in another summation order, a few ulp: 1e-5. Gradients
// sum over a whole sequence of keys or queries, dq through atomics in any order: 1e-4.
void require_cuda_like_cpu(const Context& gpu, const FlashCase& c, const AttentionBlock& a) {
  Tensor q = on_gpu(c.q), k = on_gpu(c.k), v = on_gpu(c.v), dout = on_gpu(c.dout);
  Tensor out = empty(c.out.shape, Mem::Activations, Device::CUDA);
  Tensor lse = empty(c.lse.shape, Mem::Activations, Device::CUDA);
  Tensor D = empty(c.D.shape, Mem::Activations, Device::CUDA);
  Tensor dq = gpu_zeros(c.dq), dk = gpu_zeros(c.dk), dv = gpu_zeros(c.dv);
  flash_attention_forward(gpu, out, lse, q, k, v, a);
  attention_out_dot_dout(gpu, D, dout, out, a);
  flash_attention_backward(gpu, dq, dk, dv, dout, q, k, v, lse, D, a);
  gpu.synchronize();
  require_near("out", to_host_floats(out), to_host_floats(c.out), 1e-5);
  require_near("lse", to_host_floats(lse), to_host_floats(c.lse), 1e-5);
  require_near("D", to_host_floats(D), to_host_floats(c.D), 1e-5);
  require_near("dq", to_host_floats(dq), to_host_floats(c.dq), 1e-4);
  require_near("dk", to_host_floats(dk), to_host_floats(c.dk), 1e-4);
  require_near("dv", to_host_floats(dv), to_host_floats(c.dv), 1e-4);
}

}  // namespace

namespace {
// Context parallelism over 2 ranks (Playbook §7.2): rank r holds tokens [75r, 75r + 75) of each
// sequence. Each rank merges its queries' attention over both key halves by LSE; the backward
// computes D once from the merged output, then every block adds into dq of its query half and
// into dk, dv of its key half (what the ring passes on). Blocks on `ctx` with operands in `in`
// (bf16: what ring attention runs on tensor cores); the reference is whole attention in one
// fp32 call on the CPU, on the same (bf16-rounded) inputs.
void require_ring_of_two(const Context& ctx, DType in) {
  Context cpu = Context::create(Device::CPU);
  for (bool causal : {true, false}) {
    INFO((causal ? "causal" : "no mask")
         << ", operands " << dtype_name(in) << " on " << device_name(ctx.device));
    const int T = 150, half = 75;
    AttentionBlock whole{2, T, T, 4, 2, 16, 0, 0, causal};
    FlashCase c(whole, 33);
    if (in == DType::BF16)
      for (const Tensor* t : {&c.q, &c.k, &c.v, &c.dout}) round_to_bf16(*t);
    c.run(cpu);
    // fp32: the merge of two partial softmaxes is a few ulp from the one-pass result, 1e-5; the
    // gradients sum over more terms in another order, 1e-4 of max(1, |value|). bf16: each block
    // writes its output rounded to bf16 (2^-9) before the merge, and P, dS are rounded to bf16
    // before the second GEMMs: 2e-2 and 3e-2, as the bf16 kernels against the CPU.
    const double out_tol = in == DType::F32 ? 1e-5 : 2e-2,
                 grad_tol = in == DType::F32 ? 1e-4 : 3e-2;
    const int qw = whole.Hq * whole.hd, kw = whole.Hkv * whole.hd;
    std::vector<float> q = to_host_floats(c.q), k = to_host_floats(c.k), v = to_host_floats(c.v);
    std::vector<float> dout = to_host_floats(c.dout);
    auto qshape = std::vector<int64_t>{2 * half, whole.Hq, whole.hd};
    auto kshape = std::vector<int64_t>{2 * half, whole.Hkv, whole.hd};
    // Tokens [start, start + half) of each sequence, on ctx's device in the operands' format.
    auto operand = [&](const std::vector<float>& x, int width, int start,
                       std::vector<int64_t> shape) {
      Tensor host = host_tensor(tokens(x, 2, T, width, start, half), shape, Mem::Activations);
      return cast_to(ctx, to_device(host, ctx.device, Mem::Activations), in);
    };
    std::vector<Tensor> dk(2), dv(2);
    for (int r = 0; r < 2; r++)
      dk[r] = zeros(kshape, Mem::Grads, ctx.device), dv[r] = zeros(kshape, Mem::Grads, ctx.device);
    for (int rq = 0; rq < 2; rq++) {  // the rank holding queries [75 rq, 75 rq + 75)
      Tensor Q = operand(q, qw, rq * half, qshape), dO = operand(dout, qw, rq * half, qshape);
      Tensor out = empty(qshape, Mem::Activations, ctx.device),
             lse = empty({2, whole.Hq, half}, Mem::Activations, ctx.device);
      Tensor part = empty(qshape, Mem::Activations, ctx.device, in),
             part_lse = empty(lse.shape, Mem::Activations, ctx.device);
      auto block = [&](int rk) {
        AttentionBlock a = whole;
        a.Tq = a.Tk = half, a.q0 = rq * half, a.k0 = rk * half;
        return a;
      };
      auto K = [&](int rk) { return operand(k, kw, rk * half, kshape); };
      auto V = [&](int rk) { return operand(v, kw, rk * half, kshape); };
      // The first block into `part`, merged into out from nothing (lse -inf), as the ring does.
      // For causal, the block (queries 0..74, keys 75..149) is all masked: lse -inf, weight 0.
      zero_(ctx, out), fill_(ctx, lse, -INFINITY);
      for (int rk = 0; rk < 2; rk++) {
        flash_attention_forward(ctx, part, part_lse, Q, K(rk), V(rk), block(rk));
        attention_lse_merge(ctx, out, lse, part, part_lse, block(rk));
      }
      std::vector<float> want_out = tokens(to_host_floats(c.out), 2, T, qw, rq * half, half);
      require_near("out", to_host_floats(out), want_out, out_tol);
      Tensor D = empty(lse.shape, Mem::Activations, ctx.device);
      Tensor dQ = zeros(qshape, Mem::Grads, ctx.device);
      attention_out_dot_dout(ctx, D, dO, cast_to(ctx, out, in), block(0));
      for (int rk = 0; rk < 2; rk++)
        flash_attention_backward(ctx, dQ, dk[rk], dv[rk], dO, Q, K(rk), V(rk), lse, D, block(rk));
      require_near("dq", to_host_floats(dQ),
                   tokens(to_host_floats(c.dq), 2, T, qw, rq * half, half), grad_tol);
    }
    for (int rk = 0; rk < 2; rk++) {  // dk, dv of each key half, summed over both query halves
      require_near("dk", to_host_floats(dk[rk]),
                   tokens(to_host_floats(c.dk), 2, T, kw, rk * half, half), grad_tol);
      require_near("dv", to_host_floats(dv[rk]),
                   tokens(to_host_floats(c.dv), 2, T, kw, rk * half, half), grad_tol);
    }
  }
}
}  // namespace

TEST_CASE("a ring of two: merged halves equal whole attention, forward and backward",
          "[attention][flash]") {
  require_ring_of_two(Context::create(Device::CPU), DType::F32);
}

// The bf16 operands run the tensor-core kernels' CPU mirrors here, and their partial outputs
// merge from bf16 (ring attention under --dtype bf16 on a GPU, in its CPU form).
TEST_CASE("a ring of two in bf16: merged halves equal whole attention within bf16's bounds",
          "[attention][flash]") {
  require_ring_of_two(Context::create(Device::CPU), DType::BF16);
}

TEST_CASE("CUDA ring of two in bf16 (tensor-core blocks, merged from bf16) equals whole attention",
          "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  require_ring_of_two(gpu, DType::BF16);
  gpu.synchronize();
  gpu.destroy();
}

TEST_CASE("CUDA FlashAttention (fp32) matches the CPU version", "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  std::vector<AttentionBlock> blocks(std::begin(kFlashBlocks), std::end(kFlashBlocks));
  blocks.push_back({1, 200, 200, 2, 1, 64, 0, 0, true});  // the model-sized head dims
  blocks.push_back({2, 100, 100, 2, 2, 128, 0, 0, true});
  blocks.push_back({1, 33, 97, 3, 3, 24, 40, 0, true});  // a head dim no template has exactly
  for (float q_std : {1.0f, 5.0f})
    for (const AttentionBlock& a : blocks) {
      INFO(describe(a) << ", q std " << q_std);
      FlashCase c(a, 41, q_std);
      c.run(cpu);
      require_cuda_like_cpu(gpu, c, a);
    }
  gpu.destroy();
}

TEST_CASE("CUDA FlashAttention (fp32) under dropout draws the CPU's masks",
          "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  Tensor cpu_sequences = device_ints(cpu, {7, 3}), gpu_sequences = device_ints(gpu, {7, 3});
  for (AttentionBlock a :
       {kFlashBlocks[0], kFlashBlocks[4], AttentionBlock{1, 200, 200, 2, 1, 64}}) {
    INFO(describe(a) << ", dropout 0.3");
    a.drop = test_draw(cpu_sequences, 1);
    FlashCase c(a, 42);
    c.run(cpu);
    a.drop = test_draw(gpu_sequences, 1);
    require_cuda_like_cpu(gpu, c, a);  // the same masks, so the same bounds
  }
  gpu.destroy();
}

TEST_CASE("CUDA LSE merge matches the CPU version, -inf sides included, out2 in fp32 or bf16",
          "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  AttentionBlock a{2, 37, 0, 3, 1, 16};
  Tensor out = empty({2 * 37, 3, 16}, Mem::Activations), out2 = empty(out.shape, Mem::Activations);
  Tensor lse = empty({2, 3, 37}, Mem::Activations), lse2 = empty(lse.shape, Mem::Activations);
  init_normal(out, 42, "out", 1.0f), init_normal(out2, 42, "out2", 1.0f);
  init_normal(lse, 42, "lse", 3.0f), init_normal(lse2, 42, "lse2", 3.0f);
  std::vector<float> l1 = to_host_floats(lse), l2 = to_host_floats(lse2);
  for (size_t i = 0; i < l1.size(); i += 5) l1[i] = -INFINITY;  // some rows unseen on one side,
  for (size_t i = 0; i < l2.size(); i += 3) l2[i] = -INFINITY;  // some (i % 15 == 0) on both
  from_host(lse, l1.data()), from_host(lse2, l2.data());
  for (DType side : {DType::F32, DType::BF16}) {
    INFO("out2 in " << dtype_name(side));
    Tensor o = to_device(out, Device::CPU, Mem::Activations),
           l = to_device(lse, Device::CPU, Mem::Activations);
    Tensor out_g = on_gpu(out), lse_g = on_gpu(lse), lse2_g = on_gpu(lse2);
    Tensor out2_c = cast_to(cpu, out2, side), out2_g = cast_to(gpu, on_gpu(out2), side);
    attention_lse_merge(cpu, o, l, out2_c, lse2, a);
    attention_lse_merge(gpu, out_g, lse_g, out2_g, lse2_g, a);
    gpu.synchronize();
    require_near("out", to_host_floats(out_g), to_host_floats(o), 1e-6);  // expf: an ulp or two
    require_near("lse", to_host_floats(lse_g), to_host_floats(l), 1e-6);
  }
  gpu.destroy();
}

TEST_CASE("CUDA FlashAttention (bf16 tensor cores) matches the CPU version on bf16 inputs",
          "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  const AttentionBlock blocks[] = {
      {2, 100, 100, 4, 2, 64, 0, 0, true},      // GQA, partial tiles
      {1, 130, 130, 2, 1, 128, 0, 0, true},     // MQA, hd 128
      {2, 90, 70, 4, 4, 32, 0, 0, false},       // no mask, Tq != Tk
      {2, 100, 100, 4, 2, 16, 0, 64, true},     // the first query tile sees nothing
      {1, 100, 150, 4, 2, 64, 200, 100, true},  // offsets
  };
  for (const AttentionBlock& a : blocks) {
    INFO(describe(a));
    FlashCase c(a, 43);
    for (const Tensor* t : {&c.q, &c.k, &c.v, &c.dout}) round_to_bf16(*t);
    c.run(cpu);
    // bf16 tensors: the calls run the tensor-core kernels.
    Tensor q = bf16_on_gpu(gpu, c.q), k = bf16_on_gpu(gpu, c.k), v = bf16_on_gpu(gpu, c.v);
    Tensor dout = bf16_on_gpu(gpu, c.dout);
    Tensor out = empty(c.out.shape, Mem::Activations, Device::CUDA, DType::BF16);
    Tensor lse = empty(c.lse.shape, Mem::Activations, Device::CUDA);
    Tensor D = empty(c.D.shape, Mem::Activations, Device::CUDA);
    // The gradients start as NaN: attention_backward_begin's kernel sets them to zero with D.
    Tensor dq = gpu_zeros(c.dq), dk = gpu_zeros(c.dk), dv = gpu_zeros(c.dv);
    for (const Tensor* t : {&dq, &dk, &dv}) fill_(gpu, *t, NAN);
    flash_attention_forward(gpu, out, lse, q, k, v, a);
    attention_backward_begin(gpu, D, dout, out, dq, dk, dv, a);
    flash_attention_backward(gpu, dq, dk, dv, dout, q, k, v, lse, D, a);
    gpu.synchronize();
    // Same inputs on both sides, so the scores agree to fp32 rounding and lse to 1e-3. What
    // bf16 changes: P (and dS) are rounded to bf16 (relative 2^-9 each) before the second GEMMs,
    // and out is stored as bf16 (2^-9): out within 2e-2, gradients within 3e-2 of the largest.
    require_near("out", to_host_floats(cast_to(gpu, out, DType::F32)), to_host_floats(c.out), 2e-2);
    require_near("lse", to_host_floats(lse), to_host_floats(c.lse), 1e-3);
    require_near("dq", to_host_floats(dq), to_host_floats(c.dq), 3e-2);
    require_near("dk", to_host_floats(dk), to_host_floats(c.dk), 3e-2);
    require_near("dv", to_host_floats(dv), to_host_floats(c.dv), 3e-2);
  }
  gpu.destroy();
}

// On CUDA the fp32 FlashAttention kernels hold a query row in registers at widths up to 128 and
// RoPE's frequency table travels with its launch (128 pairs): a model past either bound is
// refused before any step (exit 2 naming the flags), not stopped by an assertion inside a kernel
// launch. The meta device, pricing that step on a GPU's profile, refuses the same; the CPU, and
// the meta device priced as CPU ranks, take any head dim. No GPU is needed to check this.
TEST_CASE(
    "CUDA, and the meta device priced on a GPU, refuse head dims past CUDA's kernels' bounds, "
    "naming the flags; CPU ranks don't",
    "[attention]") {
  using K = AttentionKind;
  auto refusal = [](K kind, int hd, Device device, const std::string& gpu = "") {
    return usage_error_of([&] { validate_head_dim(hd, kind == K::Flash, device, gpu); });
  };
  for (int hd : {2, 64, 128}) CHECK(refusal(K::Flash, hd, Device::CUDA).empty());
  for (int hd : {130, 256}) {
    CHECK_THAT(refusal(K::Flash, hd, Device::CUDA),
               Catch::Contains("head dim " + std::to_string(hd) + " (--d-model / --heads") &&
                   Catch::Contains("up to 128") && Catch::Contains("--attention naive"));
    CHECK(refusal(K::Naive, hd, Device::CUDA).empty());
  }
  for (K kind : {K::Flash, K::Naive})
    CHECK_THAT(refusal(kind, 258, Device::CUDA), Catch::Contains("head dim 258") &&
                                                     Catch::Contains("RoPE on CUDA") &&
                                                     Catch::Contains("up to 256"));
  for (const std::string& gpu : {"", "h100", "a100"}) {  // "": a meta run's default profile
    CHECK(refusal(K::Flash, 128, Device::Meta, gpu).empty());
    CHECK(refusal(K::Naive, 256, Device::Meta, gpu).empty());
    CHECK_THAT(refusal(K::Flash, 256, Device::Meta, gpu),
               Catch::Contains("up to 128") && Catch::Contains("or --gpu cpu") &&
                   Catch::Contains((gpu.empty() ? "h100" : gpu) + " profile"));
  }
  for (K kind : {K::Flash, K::Naive}) {
    CHECK(refusal(kind, 1024, Device::CPU).empty());
    CHECK(refusal(kind, 1024, Device::Meta, "cpu").empty());
  }
}
