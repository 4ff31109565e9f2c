// test_reference.cu: ops against references written here, in float64 (or against a property
// that does not depend on the code under test), on the inputs the other op tests leave out:
// RMSNorm on rows of small RMS with eps > 0, cross-entropy on large and skewed logits, and
// RoPE's defining property, that attention scores depend on relative positions only.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "reference.cuh"
#include "runtime/ops.cuh"

namespace {

const Context kCpu;

Tensor floats(const std::vector<float>& v, std::vector<int64_t> shape) {
  Tensor t = empty(shape, Mem::Workspace);
  from_host(t, v.data());
  return t;
}
Tensor ints(const std::vector<int32_t>& v) {
  Tensor t = empty({(int64_t)v.size()}, Mem::Workspace, Device::CPU, DType::I32);
  from_host(t, v.data());
  return t;
}

}  // namespace

// Guards: eps added outside the square root or after the mean's division, eps dropped, the
// mean taken over the wrong length, rstd saved without eps (the backward then disagrees), and a
// backward that drops the -x (x . dy w) / D rstd^3 term. The existing tests use eps = 0, or rows
// of RMS ~1 where eps = 1e-5 changes nothing visible.
TEST_CASE(
    "rmsnorm with eps > 0 on rows of small RMS matches a float64 loop, forward and "
    "backward",
    "[ops][reference]") {
  const int D = 40;
  const std::vector<double> row_rms = {1e-3, 3e-3, 1e-2, 0.1, 1.0};  // eps matters for the first
  const int T = (int)row_rms.size();
  std::vector<float> x = reference_normal(T * D, "x", 0, 1), w = reference_normal(D, "w", 1, 0.3),
                     dy = reference_normal(T * D, "dy", 0, 1);
  for (int t = 0; t < T; t++)
    for (int j = 0; j < D; j++) x[t * D + j] *= (float)row_rms[t];
  for (float eps : {1e-5f, 1e-2f}) {
    INFO("eps " << eps);
    Tensor X = floats(x, {T, D}), W = floats(w, {D}), DY = floats(dy, {T, D});
    Tensor y = empty({T, D}, Mem::Workspace), rstd = empty({T}, Mem::Workspace);
    Tensor dx = zeros({T, D}, Mem::Workspace), dw = zeros({D}, Mem::Workspace);
    rmsnorm_forward(kCpu, y, rstd, X, W, eps);
    rmsnorm_backward(kCpu, dx, dw, DY, X, W, rstd);
    std::vector<float> got_y = to_host_floats(y), got_dx = to_host_floats(dx),
                       got_dw = to_host_floats(dw);
    std::vector<double> want_dw(D, 0);
    for (int t = 0; t < T; t++) {
      const float* xr = &x[t * D];
      double ms = 0, dot = 0;  // mean(x^2), and sum_k x_k w_k dy_k
      for (int j = 0; j < D; j++) ms += (double)xr[j] * xr[j] / D;
      double r = 1 / std::sqrt(ms + eps);
      for (int j = 0; j < D; j++) dot += (double)xr[j] * w[j] * dy[t * D + j];
      // y = w x r; dx_j = r w_j dy_j - x_j r^3 dot / D; dw_j = sum_t dy_j x_j r.
      // fp32 against float64: a few ulp of each element's scale (the row's |y| ~ |w| ~ 1 and
      // |dx| ~ r): 1e-5 relative to the row's largest element allows it.
      double y_scale = 0, dx_scale = 0, y_err = 0, dx_err = 0;
      for (int j = 0; j < D; j++) {
        double want_y = w[j] * xr[j] * r;
        double want_dx = r * w[j] * dy[t * D + j] - xr[j] * r * r * r * dot / D;
        want_dw[j] += dy[t * D + j] * xr[j] * r;
        y_scale = std::max(y_scale, std::abs(want_y));
        dx_scale = std::max(dx_scale, std::abs(want_dx));
        y_err = std::max(y_err, std::abs(got_y[t * D + j] - want_y));
        dx_err = std::max(dx_err, std::abs(got_dx[t * D + j] - want_dx));
      }
      INFO("row RMS " << row_rms[t] << ": y err " << y_err << " of " << y_scale << ", dx err "
                      << dx_err << " of " << dx_scale);
      REQUIRE(y_err <= 1e-5 * y_scale);
      REQUIRE(dx_err <= 1e-5 * dx_scale);
    }
    for (int j = 0; j < D; j++) REQUIRE(got_dw[j] == Approx(want_dw[j]).epsilon(1e-5).margin(1e-6));
  }
}

// Guards: a logsumexp without the max shift (exp(60) overflows fp32 to inf), a max taken over
// part of the row, the shift applied to one term only, and a backward whose softmax is not
// normalised. The other tests use N(0, 1) logits, where all of these still pass.
TEST_CASE("cross-entropy of large and skewed logits matches a float64 logsumexp",
          "[ops][reference]") {
  const int N = 6, V = 50;
  std::vector<float> logits =
      reference_normal(N * V, "logits", 10, 25);                 // 10 +- 25: maxima ~ 60..80
  for (int v = 0; v < V; v++) logits[1 * V + v] = -1000.0f + v;  // every logit very negative
  for (int v = 0; v < V; v++) logits[2 * V + v] = v == V - 1 ? 90.0f : -90.0f;  // max at the end
  for (int v = 0; v < V; v++) logits[3 * V + v] = 88.0f;  // near fp32's exp overflow, uniform
  std::vector<int32_t> targets = {3, 49, 0, 17, V - 1, 25};
  Tensor L = floats(logits, {N, V}), tgt = ints(targets);
  Tensor losses = empty({N}, Mem::Workspace), dlogits = empty({N, V}, Mem::Workspace);
  cross_entropy_forward(kCpu, losses, L, tgt);
  cross_entropy_backward(kCpu, dlogits, L, tgt, 0.25f);
  std::vector<float> got = to_host_floats(losses), grad = to_host_floats(dlogits);
  for (int i = 0; i < N; i++) {
    double lse = logsumexp64(&logits[i * V], V), want = lse - logits[i * V + targets[i]];
    // fp32: a difference of terms up to |lse| ~ 1000 (ulp 6e-5). inf or nan fails.
    INFO("row " << i << ": " << got[i] << " vs " << want);
    REQUIRE(std::isfinite(got[i]));
    REQUIRE(std::abs(got[i] - want) <= ce_loss_tolerance(lse));
    for (int v = 0; v < V; v++) {
      double p = std::exp(logits[i * V + v] - lse);
      double want_g = 0.25 * (p - (v == targets[i]));
      // Probabilities carry the loss's absolute error as a relative one: ~1e-4 of 0.25.
      REQUIRE(std::abs(grad[i * V + v] - want_g) <= 3e-5);
    }
  }
}

// Guards: a rotation that is not orthogonal (a sign flipped in one of the two outputs), angles
// read from the wrong token's position, or q and k rotated by different conventions: all change
// q . k when every position shifts. (Which angles RoPE uses is checked by the golden fixtures.)
TEST_CASE("rope: q . k scores are unchanged when every position shifts by the same amount",
          "[ops][reference]") {
  const int T = 9, H = 2, hd = 16;
  std::vector<float> q = reference_normal(T * H * hd, "q", 0, 1),
                     k = reference_normal(T * H * hd, "k", 0, 1);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; t++) pos[t] = 3 * t + (t % 2);  // uneven gaps
  auto scores = [&](int shift, float theta) {
    std::vector<int32_t> p(pos);
    for (int32_t& v : p) v += shift;
    Tensor Q = floats(q, {T, H, hd}), K = floats(k, {T, H, hd}), P = ints(p);
    rope_forward(kCpu, Q, P, theta);
    rope_forward(kCpu, K, P, theta);
    std::vector<float> rq = to_host_floats(Q), rk = to_host_floats(K);
    std::vector<double> s;  // [T, T, H] every pair of tokens, per head
    for (int i = 0; i < T; i++)
      for (int j = 0; j < T; j++)
        for (int h = 0; h < H; h++) {
          double dot = 0;
          for (int d = 0; d < hd; d++)
            dot += (double)rq[(i * H + h) * hd + d] * rk[(j * H + h) * hd + d];
          s.push_back(dot);
        }
    return s;
  };
  for (float theta : {10000.0f, 100.0f}) {
    std::vector<double> base = scores(0, theta);
    for (int shift : {1, 7, 40}) {
      std::vector<double> moved = scores(shift, theta);
      // Angles up to ~70 rad in fp32 (ulp 8e-6) and 16-term dots of N(0,1) pairs (|q||k| ~ 16):
      // ~1e-4 absolute; a broken rotation changes scores by O(1).
      for (size_t i = 0; i < base.size(); i++) {
        INFO("theta " << theta << ", shift " << shift << ", pair " << i);
        REQUIRE(std::abs(moved[i] - base[i]) <= 5e-4);
      }
    }
    // Not the trivial case: the rotation does change scores between different offsets.
    Tensor Q = floats(q, {T, H, hd}), Q0 = floats(q, {T, H, hd});
    rope_forward(kCpu, Q, ints(pos), theta);
    REQUIRE(to_host_floats(Q) != to_host_floats(Q0));
  }
}
