// test_ops.cu: every op of ops.cu on the CPU against a direct formula or central finite
// differences ([ops]), and every CUDA kernel against its CPU reference ([gpu]).
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda_case.cuh"
#include "mixed_precision.cuh"
#include "runtime/observe.cuh"
#include "runtime/ops.cuh"

namespace {

const Context kCpu = Context::create(Device::CPU);

Tensor randn(std::vector<int64_t> shape, const std::string& name, float std = 1.0f) {
  Tensor t = empty(std::move(shape), Mem::Activations);
  init_normal(t, 7, name, std);
  return t;
}
Tensor from_values(std::vector<int64_t> shape, const std::vector<float>& values) {
  Tensor t = empty(std::move(shape), Mem::Activations);
  REQUIRE(t.numel() == (int64_t)values.size());
  from_host(t, values.data());
  return t;
}
Tensor ids_tensor(const std::vector<int32_t>& ids) {
  Tensor t = empty({(int64_t)ids.size()}, Mem::Activations, Device::CPU, DType::I32);
  from_host(t, ids.data());
  return t;
}
// Integers in [-3, 3]: every product and sum in these tests is exact in fp32.
Tensor small_ints(std::vector<int64_t> shape, const std::string& name) {
  Tensor t = empty(std::move(shape), Mem::Activations);
  init_uniform(t, 7, name, -3.0f, 4.0f);
  for (int64_t i = 0; i < t.numel(); i++) t.f32()[i] = std::floor(t.f32()[i]);
  return t;
}
Tensor clone(const Tensor& t) {
  return to_device(t, Device::CPU, Mem::Activations);
}
// Two CPU tensors hold the same bytes (bit for bit; NaN payloads included).
bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && memcmp(a.ptr, b.ptr, a.nbytes()) == 0;
}

// L = sum(out * R) in fp32: a scalar whose gradient with respect to out is R.
float weighted_sum(const Tensor& out, const Tensor& R) {
  float L = 0.0f;
  for (int64_t i = 0; i < out.numel(); i++) L += out.f32()[i] * R.f32()[i];
  return L;
}

// Compares an analytic gradient with central differences (L(x+h) - L(x-h)) / 2h of `loss`
// for every element of the CPU tensor x. All in fp32: truncation error is O(h^2 L''') and
// roundoff about 1e-7 * |L| / h, so the tolerance (relative to 1 + |fd|) is set per test.
void check_gradient(const Tensor& x, const Tensor& grad, const std::function<float()>& loss,
                    float h, float tol) {
  float* p = x.f32();
  for (int64_t i = 0; i < x.numel(); i++) {
    float keep = p[i], plus = keep + h, minus = keep - h;
    p[i] = plus;
    float up = loss();
    p[i] = minus;
    float down = loss();
    p[i] = keep;
    float fd = (up - down) / (plus - minus);  // the step actually taken after rounding
    INFO("element " << i << ": analytic " << grad.f32()[i] << ", finite difference " << fd);
    CHECK(std::fabs(grad.f32()[i] - fd) <= tol * (1.0f + std::fabs(fd)));
  }
}

void check_equal(const Tensor& got, const std::vector<float>& want) {
  REQUIRE(got.numel() == (int64_t)want.size());
  for (size_t i = 0; i < want.size(); i++) {
    INFO("element " << i);
    CHECK(got.f32()[i] == want[i]);
  }
}

// C = alpha op(A) op(B) + beta C, written out with explicit row-major index arithmetic.
void naive_gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, int lda,
                const float* B, int ldb, float beta, float* C, int ldc) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      float acc = 0.0f;
      for (int k = 0; k < K; k++)
        acc += (ta ? A[k * lda + m] : A[m * lda + k]) * (tb ? B[n * ldb + k] : B[k * ldb + n]);
      C[m * ldc + n] = alpha * acc + beta * C[m * ldc + n];
    }
}

// Operands for op(A) [M, K] @ op(B) [K, N] stored with leading dimensions 2 wider than a row.
struct GemmCase {
  bool ta, tb;
  int M = 3, N = 5, K = 4, lda, ldb, ldc;
  Tensor A, B, C;
  GemmCase(bool ta_, bool tb_, std::function<Tensor(std::vector<int64_t>, std::string)> make)
      : ta(ta_), tb(tb_) {
    lda = (ta ? M : K) + 2;
    ldb = (tb ? K : N) + 2;
    ldc = N + 2;
    A = make({ta ? K : M, lda}, "A");
    B = make({tb ? N : K, ldb}, "B");
    C = make({M, ldc}, "C");
  }
};

}  // namespace

// ----------------------------------------------------------------------------
// matmul

TEST_CASE("gemm matches a naive loop for all four transposes, non-square, lda > cols", "[ops]") {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("trans_a " << ta << ", trans_b " << tb);
      GemmCase g(ta, tb, small_ints);
      Tensor want = clone(g.C);
      naive_gemm(ta, tb, g.M, g.N, g.K, 2.0f, g.A.f32(), g.lda, g.B.f32(), g.ldb, 0.5f, want.f32(),
                 g.ldc);
      gemm(kCpu, ta, tb, g.M, g.N, g.K, 2.0f, g.A.f32(), g.lda, g.B.f32(), g.ldb, 0.5f, g.C.f32(),
           g.ldc);
      // Small integers and halves: exact, padding columns included (gemm must not touch them).
      check_equal(g.C, to_host_floats(want));
    }
}

TEST_CASE("linear_forward computes y = x W^T", "[ops]") {
  Tensor x = small_ints({3, 4}, "x"), W = small_ints({5, 4}, "W"),
         y = empty({3, 5}, Mem::Activations);
  linear_forward(kCpu, y, x, W);
  std::vector<float> want(15, 0.0f);
  for (int t = 0; t < 3; t++)
    for (int o = 0; o < 5; o++)
      for (int i = 0; i < 4; i++) want[t * 5 + o] += x.f32()[t * 4 + i] * W.f32()[o * 4 + i];
  check_equal(y, want);
}

TEST_CASE("linear_backward matches central differences and accumulates on request", "[ops]") {
  Tensor x = randn({3, 4}, "x"), W = randn({5, 4}, "W"), R = randn({3, 5}, "R");
  Tensor y = empty({3, 5}, Mem::Activations);
  Tensor dx = zeros({3, 4}, Mem::Grads), dW = zeros({5, 4}, Mem::Grads);
  linear_backward(kCpu, dx, dW, R, x, W);
  auto loss = [&] {
    linear_forward(kCpu, y, x, W);
    return weighted_sum(y, R);
  };
  // L is linear in x and in W: no truncation error, only roundoff ~1e-7 * |L| / h.
  check_gradient(x, dx, loss, 1e-2f, 1e-3f);
  check_gradient(W, dW, loss, 1e-2f, 1e-3f);

  Tensor first = clone(dx), first_dW = clone(dW);
  linear_backward(kCpu, dx, dW, R, x, W, /*accumulate_dx=*/true);  // dW always accumulates
  for (int i = 0; i < 12; i++) CHECK(dx.f32()[i] == 2.0f * first.f32()[i]);
  for (int i = 0; i < 20; i++) CHECK(dW.f32()[i] == 2.0f * first_dW.f32()[i]);
  linear_backward(kCpu, dx, dW, R, x, W);  // accumulate_dx = false: dx is overwritten
  for (int i = 0; i < 12; i++) CHECK(dx.f32()[i] == first.f32()[i]);
}

// ----------------------------------------------------------------------------
// embedding

TEST_CASE("embedding gathers rows, and its backward scatter-adds repeated ids", "[ops]") {
  Tensor table = from_values({3, 2}, {1, 2, 3, 4, 5, 6}), ids = ids_tensor({2, 0, 2});
  Tensor out = empty({3, 2}, Mem::Activations);
  embedding_forward(kCpu, out, ids, table);
  check_equal(out, {5, 6, 1, 2, 5, 6});

  Tensor dtable = from_values({3, 2}, {1, 1, 1, 1, 1, 1});  // += keeps what was there
  embedding_backward(kCpu, dtable, ids, from_values({3, 2}, {10, 20, 30, 40, 50, 60}));
  check_equal(dtable, {31, 41, 1, 1, 61, 81});
}

TEST_CASE("embedding_backward matches central differences", "[ops]") {
  Tensor table = randn({5, 3}, "table"), ids = ids_tensor({4, 1, 4}), R = randn({3, 3}, "R");
  Tensor out = empty({3, 3}, Mem::Activations), dtable = zeros({5, 3}, Mem::Grads);
  embedding_backward(kCpu, dtable, ids, R);
  auto loss = [&] {
    embedding_forward(kCpu, out, ids, table);
    return weighted_sum(out, R);
  };
  check_gradient(table, dtable, loss, 1e-2f, 1e-3f);  // linear in table: roundoff only
}

// ----------------------------------------------------------------------------
// RMSNorm

TEST_CASE("rmsnorm with w = 1 and eps = 0 leaves every row with unit RMS", "[ops]") {
  Tensor x = randn({4, 10}, "x", 3.0f), y = empty({4, 10}, Mem::Activations);
  Tensor rstd = empty({4}, Mem::Activations), w = from_values({10}, std::vector<float>(10, 1.0f));
  rmsnorm_forward(kCpu, y, rstd, x, w, 0.0f);
  for (int t = 0; t < 4; t++) {
    float ss = 0.0f, xs = 0.0f;
    for (int i = 0; i < 10; i++) ss += y.f32()[t * 10 + i] * y.f32()[t * 10 + i];
    for (int i = 0; i < 10; i++) xs += x.f32()[t * 10 + i] * x.f32()[t * 10 + i];
    CHECK(ss / 10 == Approx(1.0f).epsilon(1e-5));  // 10 fp32 roundings
    CHECK(rstd.f32()[t] == Approx(1.0f / std::sqrt(xs / 10)).epsilon(1e-6));
  }
}

// Mixed precision's norms write their output in the compute format the linear layers read:
// bit for bit the fp32 output rounded once, the same rstd.
TEST_CASE("rmsnorm with a bf16 or fp16 output is the fp32 one rounded once", "[ops]") {
  const int T = 6, D = 50;
  Tensor x = randn({T, D}, "x", 2.0f), w = randn({D}, "w");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor y16 = empty({T, D}, Mem::Activations, Device::CPU, half), want = clone(y16);
    Tensor rstd16 = clone(rstd);
    rmsnorm_forward(kCpu, y16, rstd16, x, w, 1e-5f);
    cast_(kCpu, want, y);
    CHECK(memcmp(y16.ptr, want.ptr, y16.nbytes()) == 0);
    CHECK(memcmp(rstd16.ptr, rstd.ptr, rstd.nbytes()) == 0);
  }
}

TEST_CASE("rmsnorm reads a bf16 or fp16 weight as its fp32 values, bit for bit", "[ops]") {
  // Mixed precision's norms read the weights' compute copy as it is stored (stored_weight):
  // the same numbers as the widened copy they read before, forward and backward.
  const int T = 5, D = 40;
  Tensor x = randn({T, D}, "x", 2.0f), w = randn({D}, "w"), dy = randn({T, D}, "dy");
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor w16 = empty({D}, Mem::Params, Device::CPU, half);
    cast_(kCpu, w16, w);
    cast_(kCpu, w, w16);  // the fp32 weight: the format's values
    Tensor y = empty({T, D}, Mem::Activations, Device::CPU, half), y2 = clone(y);
    Tensor rstd = empty({T}, Mem::Activations), rstd2 = clone(rstd);
    rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
    rmsnorm_forward(kCpu, y2, rstd2, x, w16, 1e-5f);
    CHECK(memcmp(y.ptr, y2.ptr, y.nbytes()) == 0);
    CHECK(memcmp(rstd.ptr, rstd2.ptr, rstd.nbytes()) == 0);
    Tensor dx = randn({T, D}, "dx0"), dw = randn({D}, "dw0"), dx2 = clone(dx), dw2 = clone(dw);
    rmsnorm_backward(kCpu, dx, dw, dy, x, w, rstd);
    rmsnorm_backward(kCpu, dx2, dw2, dy, x, w16, rstd);
    CHECK(memcmp(dx.ptr, dx2.ptr, dx.nbytes()) == 0);
    CHECK(memcmp(dw.ptr, dw2.ptr, dw.nbytes()) == 0);
  }
}

TEST_CASE("rmsnorm_backward matches central differences and accumulates", "[ops]") {
  const int T = 3, D = 8;
  Tensor x = randn({T, D}, "x"), w = randn({D}, "w"), R = randn({T, D}, "R");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  Tensor dx = zeros({T, D}, Mem::Grads), dw = zeros({D}, Mem::Grads);
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  rmsnorm_backward(kCpu, dx, dw, R, x, w, rstd);
  auto loss = [&] {
    rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
    return weighted_sum(y, R);
  };
  // Smooth with O(1) curvature for unit-variance rows: h^2 truncation ~1e-4 plus roundoff
  // ~1e-7 * |L| / h ~ 1e-4, so 2e-3 leaves a margin without hiding a wrong term.
  check_gradient(x, dx, loss, 1e-2f, 2e-3f);
  check_gradient(w, dw, loss, 1e-2f, 2e-3f);

  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  Tensor first_dx = clone(dx), first_dw = clone(dw);
  rmsnorm_backward(kCpu, dx, dw, R, x, w, rstd);  // "+=": a second call doubles, exactly
  for (int i = 0; i < T * D; i++) CHECK(dx.f32()[i] == 2.0f * first_dx.f32()[i]);
  // dw sums over rows, so the second pass rounds differently from doubling the first.
  for (int i = 0; i < D; i++) CHECK(dw.f32()[i] == Approx(2.0f * first_dw.f32()[i]).epsilon(1e-6));
}

// The residual add and the next norm, fused: the values of the two ops run one after the other
// (the reference), in every format the block uses, as one op on the ledger.
TEST_CASE("residual_rmsnorm_forward equals residual_forward then rmsnorm_forward, bit for bit",
          "[ops]") {
  const int T = 7, D = 90;
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  for (DType format : {DType::F32, DType::BF16, DType::F16}) {
    INFO(dtype_name(format));
    Tensor b_f = empty({T, D}, Mem::Activations, Device::CPU, format);
    Tensor w_f = empty({D}, Mem::Params, Device::CPU, format);
    cast_(kCpu, b_f, b), cast_(kCpu, w_f, w);
    Tensor sum = empty({T, D}, Mem::Activations), want_sum = clone(sum);
    Tensor y = empty({T, D}, Mem::Activations, Device::CPU, format), want_y = clone(y);
    Tensor rstd = empty({T}, Mem::Activations), want_rstd = clone(rstd);
    residual_forward(kCpu, want_sum, a, b_f);
    rmsnorm_forward(kCpu, want_y, want_rstd, want_sum, w_f, 1e-5f);
    reset_ledger();
    residual_rmsnorm_forward(kCpu, sum, y, rstd, a, b_f, w_f, 1e-5f);
    CHECK(ledger().rows[(int)OpKind::Norm].calls == 1);
    CHECK(ledger().rows[(int)OpKind::Norm].launches == 1);
    CHECK(ledger().rows[(int)OpKind::Elementwise].calls == 0);
    CHECK(same_bytes(sum, want_sum));
    CHECK(same_bytes(y, want_y));
    CHECK(same_bytes(rstd, want_rstd));
  }
}

// LayerNorm's twin (the book's GPT block): the add, then the norm of the sum as stored, with the
// stream in fp32 and in each 16-bit format.
TEST_CASE("residual_layernorm_forward equals residual_forward then layernorm_forward, bit for bit",
          "[ops]") {
  const int T = 7, D = 90;
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  Tensor bias = randn({D}, "bias");
  for (DType format : {DType::F32, DType::BF16, DType::F16})
    for (DType stream : {DType::F32, format}) {
      INFO(dtype_name(format) << ", stream " << dtype_name(stream));
      auto in = [&](const Tensor& t, DType f) {
        Tensor c = empty(t.shape, Mem::Activations, Device::CPU, f);
        cast_(kCpu, c, t);
        return c;
      };
      Tensor a_s = in(a, stream), b_f = in(b, format), w_f = in(w, format),
             bias_f = in(bias, format);
      Tensor sum = empty({T, D}, Mem::Activations, Device::CPU, stream), want_sum = clone(sum);
      Tensor y = empty({T, D}, Mem::Activations, Device::CPU, format), want_y = clone(y);
      Tensor stats = empty({T, 2}, Mem::Activations), want_stats = clone(stats);
      residual_forward(kCpu, want_sum, a_s, b_f);
      layernorm_forward(kCpu, want_y, want_stats, want_sum, w_f, bias_f, 1e-5f);
      reset_ledger();
      residual_layernorm_forward(kCpu, sum, y, stats, a_s, b_f, w_f, bias_f, 1e-5f);
      CHECK(ledger().rows[(int)OpKind::Norm].calls == 1);
      CHECK(ledger().rows[(int)OpKind::Elementwise].calls == 0);
      CHECK(same_bytes(sum, want_sum));
      CHECK(same_bytes(y, want_y));
      CHECK(same_bytes(stats, want_stats));
    }
}

// The norm's backward also writes the residual gradient rounded for the GEMMs that read it next
// (a [T, D] bf16 or fp16 copy): dx's new value rounded once (cast_'s rounding, the reference),
// counted among the backward's roundings as the GEMMs' own rounding was; dx and dw (and
// LayerNorm's db) as without it. RMSNorm's and LayerNorm's alike.
TEST_CASE("a norm backward's rounded copy of dx is dx rounded once, and counted", "[ops]") {
  const int T = 6, D = 70;
  Tensor x = randn({T, D}, "x", 2.0f), w = randn({D}, "w"), b = randn({D}, "b");
  Tensor dy = randn({T, D}, "dy");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  Tensor stats = empty({T, 2}, Mem::Activations);
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
  for (bool layer_norm : {false, true})
    for (DType half : {DType::BF16, DType::F16}) {
      INFO((layer_norm ? "layernorm " : "rmsnorm ") << dtype_name(half));
      // dx and the weights' gradients (+=, from the same starting values), and dx's copy if given
      auto backward = [&](Tensor& dx, Tensor& dwb, const Tensor& rounded) {
        dx = randn({T, D}, "dx0", 1e-3f), dwb = randn({2, D}, "dw0");
        if (layer_norm)
          return layernorm_backward(kCpu, dx, dwb.view(0, {D}), dwb.view(D, {D}), dy, x, w, stats,
                                    rounded);
        rmsnorm_backward(kCpu, dx, dwb.view(0, {D}), dy, x, w, rstd, rounded);
      };
      Tensor dx, dwb, dx2, dwb2;
      Tensor rounded = empty({T, D}, Mem::Workspace, Device::CPU, half), want = clone(rounded);
      backward(dx, dwb, Tensor());
      reset_rounding_stats();
      reset_ledger();
      backward(dx2, dwb2, rounded);
      CHECK(ledger().rows[(int)OpKind::Norm].calls == 1);
      CHECK(ledger().rows[(int)OpKind::Cast].calls == 0);
      CHECK(same_bytes(dx, dx2));
      CHECK(same_bytes(dwb, dwb2));
      cast_(kCpu, want, dx);
      CHECK(same_bytes(rounded, want));
      int64_t nonzero = 0;
      for (int i = 0; i < T * D; i++) nonzero += dx.f32()[i] != 0.0f;
      CHECK(rounding_stats(true).nonzero == (uint64_t)nonzero);
    }
}

// --residual-dtype bf16|fp16: the stream between blocks (and its gradient) stored in 16 bits.
// Each op reads it widened and computes in fp32 as on an fp32 stream (the reference: the fp32
// op on the widened values), and a sum it stores is that fp32 value rounded once (cast_); on
// the ledger, the stream's bytes are 2 per element.
TEST_CASE("a 16-bit residual stream: the norms and adds read it widened, each sum rounded once",
          "[ops]") {
  const int T = 6, D = 70;
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  Tensor dy = randn({T, D}, "dy"), dx0 = randn({T, D}, "dx0", 1e-2f);
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    auto in_half = [&](const Tensor& t) {
      Tensor h = empty(t.shape, Mem::Activations, Device::CPU, half);
      cast_(kCpu, h, t);
      return h;
    };
    auto widened = [&](const Tensor& h) {
      Tensor f = empty(h.shape, Mem::Workspace);
      cast_(kCpu, f, h);
      return f;
    };
    const Tensor a16 = in_half(a), a_wide = widened(a16);
    // The residual add then the norm, fused: the sum rounded once, the norm of what is stored.
    Tensor sum16 = empty({T, D}, Mem::Activations, Device::CPU, half), want_sum = clone(sum16);
    Tensor y = empty({T, D}, Mem::Activations, Device::CPU, half), want_y = clone(y);
    Tensor rstd = empty({T}, Mem::Activations), want_rstd = clone(rstd);
    Tensor sum32 = empty({T, D}, Mem::Workspace);
    residual_forward(kCpu, sum32, a_wide, b);
    cast_(kCpu, want_sum, sum32);
    rmsnorm_forward(kCpu, want_y, want_rstd, widened(want_sum), w, 1e-5f);
    reset_ledger();
    residual_rmsnorm_forward(kCpu, sum16, y, rstd, a16, b, w, 1e-5f);
    const double e = 2, read = (e + 4) * T * D + 4.0 * D, written = (e + e) * T * D + 4.0 * T;
    CHECK(ledger().rows[(int)OpKind::Norm].read == read);
    CHECK(ledger().rows[(int)OpKind::Norm].written == written);
    CHECK(same_bytes(sum16, want_sum));
    CHECK(same_bytes(y, want_y));
    CHECK(same_bytes(rstd, want_rstd));
    // The norm alone (a stage's first block, the final norm without a pending branch).
    Tensor y2 = clone(y), rstd2 = clone(rstd);
    rmsnorm_forward(kCpu, y2, rstd2, sum16, w, 1e-5f);
    CHECK(same_bytes(y2, want_y));
    CHECK(same_bytes(rstd2, want_rstd));
    // The stage's last add: out = a + b, rounded once.
    Tensor out16 = clone(sum16);
    residual_forward(kCpu, out16, a16, b);
    CHECK(same_bytes(out16, want_sum));
    // The backward: dx += ... on the widened gradient, rounded once as stored and counted among
    // the backward's roundings; dw as on the widened stream, bit for bit.
    Tensor dx16 = in_half(dx0), dx_wide = widened(dx16), dw = zeros({D}, Mem::Grads);
    Tensor want_dw = clone(dw), want_dx = clone(dx16);
    rmsnorm_backward(kCpu, dx_wide, want_dw, dy, widened(sum16), w, rstd);
    cast_(kCpu, want_dx, dx_wide);
    reset_rounding_stats();
    reset_ledger();
    rmsnorm_backward(kCpu, dx16, dw, dy, sum16, w, rstd);
    CHECK(same_bytes(dx16, want_dx));
    CHECK(same_bytes(dw, want_dw));
    int64_t nonzero = 0;
    for (int i = 0; i < T * D; i++) nonzero += dx_wide.f32()[i] != 0.0f;
    CHECK(rounding_stats(true).nonzero == (uint64_t)nonzero);
    const double partials = 4.0 * ((T + 31) / 32) * D;  // one row block of the column sums
    CHECK(ledger().rows[(int)OpKind::Norm].read ==
          (2 * e + 4) * T * D + 4.0 * T + 4.0 * D + 4.0 * D + partials);
    CHECK(ledger().rows[(int)OpKind::Norm].written == e * T * D + 4.0 * D + partials);
  }
}

// ----------------------------------------------------------------------------
// RoPE

TEST_CASE("rope rotates pairs (i, i + hd/2) by pos * theta^(-2i/hd), and its backward undoes it",
          "[ops]") {
  const int T = 3, H = 2, hd = 8;
  const float theta = 10000.0f;
  Tensor x = randn({T, H, hd}, "x"), positions = ids_tensor({0, 5, 17});
  Tensor rotated = clone(x);
  rope_forward(kCpu, rotated, positions, theta);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++)
      for (int i = 0; i < hd; i++) {
        // rotate_half: out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
        int j = i % (hd / 2);
        float angle = (float)positions.i32()[t] * (1.0f / std::pow(theta, (2.0f * j) / hd));
        const float* v = x.f32() + (t * H + h) * hd;
        float half = i < hd / 2 ? -v[i + hd / 2] : v[i - hd / 2];
        float want = v[i] * std::cos(angle) + half * std::sin(angle);
        CHECK(rotated.f32()[(t * H + h) * hd + i] == Approx(want).margin(1e-6));
      }
  for (int i = 0; i < H * hd; i++) CHECK(rotated.f32()[i] == x.f32()[i]);  // position 0: identity

  rope_backward(kCpu, rotated, positions, theta);  // rotations are orthogonal: back to x
  for (int i = 0; i < T * H * hd; i++) CHECK(rotated.f32()[i] == Approx(x.f32()[i]).margin(1e-6));
}

// q and k in one call (one launch on CUDA): the values of two calls, forward in place and
// backward into 16-bit buffers (with v's gradient rounded alongside), one op on the ledger.
TEST_CASE("rope on q and k in one call equals a call each, bit for bit", "[ops]") {
  const int T = 9, Hq = 4, Hk = 2, hd = 16;
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; t++) pos[t] = 5 * t + 1;
  Tensor positions = ids_tensor(pos);
  for (DType format : {DType::F32, DType::BF16}) {
    INFO(dtype_name(format));
    Tensor q = empty({T, Hq, hd}, Mem::Activations, Device::CPU, format);
    Tensor k = empty({T, Hk, hd}, Mem::Activations, Device::CPU, format);
    cast_(kCpu, q, randn({T, Hq, hd}, "q")), cast_(kCpu, k, randn({T, Hk, hd}, "k"));
    Tensor q1 = clone(q), k1 = clone(k);
    rope_forward(kCpu, q1, positions, 10000.0f), rope_forward(kCpu, k1, positions, 10000.0f);
    reset_ledger();
    rope_forward(kCpu, q, k, positions, 10000.0f);
    CHECK(ledger().rows[(int)OpKind::Elementwise].calls == 1);
    CHECK(same_bytes(q, q1));
    CHECK(same_bytes(k, k1));
    // The backward from fp32 gradients into the format (in place under fp32).
    Tensor dq = randn({T, Hq, hd}, "dq"), dk = randn({T, Hk, hd}, "dk");
    Tensor dq1 = clone(dq), dk1 = clone(dk);
    Tensor into_q = format == DType::F32 ? dq : clone(q),
           into_k = format == DType::F32 ? dk : clone(k);
    Tensor into_q1 = format == DType::F32 ? dq1 : clone(q),
           into_k1 = format == DType::F32 ? dk1 : clone(k);
    rope_backward(kCpu, dq1, positions, 10000.0f, into_q1);
    rope_backward(kCpu, dk1, positions, 10000.0f, into_k1);
    // v's gradient rides along (rounded, not rotated) when it is rounded at all.
    Tensor dv = randn({T, Hk, hd}, "dv"), into_v = format == DType::F32 ? dv : clone(k);
    Tensor want_v = clone(into_v);
    if (format != DType::F32) cast_(kCpu, want_v, dv);
    reset_ledger();
    rope_backward(kCpu, dq, dk, positions, 10000.0f, into_q, into_k, dv, into_v);
    CHECK(ledger().rows[(int)OpKind::Elementwise].calls == 1);
    CHECK(ledger().rows[(int)OpKind::Cast].calls == 0);
    CHECK(same_bytes(into_q, into_q1));
    CHECK(same_bytes(into_k, into_k1));
    CHECK(same_bytes(into_v, want_v));
  }
}

TEST_CASE("rope_backward matches central differences", "[ops]") {
  Tensor x = randn({2, 2, 6}, "x"), R = randn({2, 2, 6}, "R"), positions = ids_tensor({3, 11});
  Tensor dx = clone(R), y = empty({2, 2, 6}, Mem::Activations);
  rope_backward(kCpu, dx, positions, 500.0f);
  auto loss = [&] {
    copy_(y, x);
    rope_forward(kCpu, y, positions, 500.0f);
    return weighted_sum(y, R);
  };
  check_gradient(x, dx, loss, 1e-2f, 1e-3f);  // linear in x: roundoff only
}

TEST_CASE("rope on bf16 or fp16 tensors is the fp32 rope of their values, rounded once", "[ops]") {
  // Under --dtype bf16 and fp16 q and k stay in the format through RoPE: the same values as
  // rotating in fp32 and rounding after, which is what the block did before.
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    const int T = 5, H = 3, hd = 16;
    Tensor x = randn({T, H, hd}, "x", 2.0f), positions = ids_tensor({0, 1, 7, 300, 4095});
    Tensor x16 = empty({T, H, hd}, Mem::Activations, Device::CPU, half);
    cast_(kCpu, x16, x);
    cast_(kCpu, x, x16);  // the fp32 input: the format's values
    for (bool forward : {true, false}) {
      INFO((forward ? "forward" : "backward"));
      Tensor want16 = clone(x16);
      if (forward)
        rope_forward(kCpu, x, positions, 10000.0f), rope_forward(kCpu, x16, positions, 10000.0f);
      else
        rope_backward(kCpu, x, positions, 10000.0f), rope_backward(kCpu, x16, positions, 10000.0f);
      cast_(kCpu, want16, x);
      CHECK(memcmp(x16.ptr, want16.ptr, x16.nbytes()) == 0);
      cast_(kCpu, x, x16);
    }
    // The backward from an fp32 gradient into the format (what the q and k projections read):
    // the fp32 rotation rounded once, dx unchanged, the rounding counted as a gradient's.
    Tensor dx = randn({T, H, hd}, "dx"), kept = clone(dx), into = clone(x16), want = clone(x16);
    Tensor rotated = clone(dx);
    rope_backward(kCpu, rotated, positions, 10000.0f);
    cast_(kCpu, want, rotated);
    reset_rounding_stats();
    rope_backward(kCpu, dx, positions, 10000.0f, into);
    CHECK(memcmp(into.ptr, want.ptr, into.nbytes()) == 0);
    CHECK(memcmp(dx.ptr, kept.ptr, dx.nbytes()) == 0);
    uint64_t nonzero = 0;
    for (int i = 0; i < T * H * hd; i++) nonzero += rotated.f32()[i] != 0;
    CHECK(rounding_stats(true).nonzero == nonzero);
  }
}

// ----------------------------------------------------------------------------
// SwiGLU

TEST_CASE("swiglu is silu(gate) * up and its backward matches central differences", "[ops]") {
  Tensor gate = randn({3, 5}, "gate", 2.0f), up = randn({3, 5}, "up"), R = randn({3, 5}, "R");
  Tensor out = empty({3, 5}, Mem::Activations);
  swiglu_forward(kCpu, out, gate, up);
  for (int i = 0; i < 15; i++) {
    float g = gate.f32()[i];
    CHECK(out.f32()[i] == Approx(g / (1.0f + std::exp(-g)) * up.f32()[i]).epsilon(1e-6));
  }
  Tensor dgate = from_values({3, 5}, std::vector<float>(15, 7.0f)), dup = clone(dgate);  // "="
  swiglu_backward(kCpu, dgate, dup, R, gate, up);
  auto loss = [&] {
    swiglu_forward(kCpu, out, gate, up);
    return weighted_sum(out, R);
  };
  // silu has O(1) third derivative: truncation ~h^2 = 1e-4, roundoff ~1e-5; tolerance 1e-3.
  check_gradient(gate, dgate, loss, 1e-2f, 1e-3f);
  check_gradient(up, dup, loss, 1e-2f, 1e-3f);
}

// Mixed precision keeps gate, up and SwiGLU's output in bf16 or fp16: the op must give, bit for
// bit, what its fp32 form (tested above) gives on the widened inputs, rounded once into the
// format (cast_, whose rounding test_mixed_precision.cu holds to CUDA's); the backward exactly
// the fp32 backward on the widened inputs.
TEST_CASE("swiglu on bf16 or fp16 tensors is the fp32 swiglu of their values, rounded once",
          "[ops]") {
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    const int n = 64;
    Tensor gate = randn({n}, "gate", 3.0f), up = randn({n}, "up"), dout = randn({n}, "dout");
    Tensor g16 = empty({n}, Mem::Activations, Device::CPU, half), u16 = clone(g16),
           out16 = clone(g16);
    cast_(kCpu, g16, gate), cast_(kCpu, u16, up);
    cast_(kCpu, gate, g16), cast_(kCpu, up, u16);  // the fp32 inputs: the formats' values
    Tensor out = empty({n}, Mem::Activations), want16 = clone(g16);
    swiglu_forward(kCpu, out, gate, up);
    swiglu_forward(kCpu, out16, g16, u16);
    cast_(kCpu, want16, out);
    CHECK(memcmp(out16.ptr, want16.ptr, out16.nbytes()) == 0);
    Tensor dgate = empty({n}, Mem::Activations), dup = clone(dgate);
    Tensor dgate16 = clone(dgate), dup16 = clone(dgate);
    swiglu_backward(kCpu, dgate, dup, dout, gate, up);
    swiglu_backward(kCpu, dgate16, dup16, dout, g16, u16);
    CHECK(memcmp(dgate16.ptr, dgate.ptr, dgate.nbytes()) == 0);
    CHECK(memcmp(dup16.ptr, dup.ptr, dup.nbytes()) == 0);
    // The gradients in the format too (the dense MLP's backward under bf16 and fp16): the fp32
    // backward on the widened dout, each gradient rounded once, its rounding counted.
    Tensor dout16 = clone(g16), dg16 = clone(g16), du16 = clone(g16);
    cast_(kCpu, dout16, dout);
    cast_(kCpu, dout, dout16);
    swiglu_backward(kCpu, dgate, dup, dout, gate, up);
    Tensor want_dg = clone(g16), want_du = clone(g16);
    cast_(kCpu, want_dg, dgate), cast_(kCpu, want_du, dup);
    reset_rounding_stats();
    swiglu_backward(kCpu, dg16, du16, dout16, g16, u16);
    CHECK(memcmp(dg16.ptr, want_dg.ptr, dg16.nbytes()) == 0);
    CHECK(memcmp(du16.ptr, want_du.ptr, du16.nbytes()) == 0);
    uint64_t nonzero = 0;
    for (int i = 0; i < n; i++) nonzero += (dgate.f32()[i] != 0) + (dup.f32()[i] != 0);
    CHECK(rounding_stats(true).nonzero == nonzero);  // both outputs, each value once
  }
}

// ----------------------------------------------------------------------------
// residual, axpy, scale_

// ----------------------------------------------------------------------------
// The book's GPT block (Playbook §2.5): LayerNorm, GeLU, dropout

// Each row against its float64 recomputation. The fp32 sums of 40 terms of size ~3 are within
// ~1e-5 of float64 (40 additions of 2.4e-7 of the running sum); y and 1/std follow to the
// same relative size: 1e-5 relative plus 1e-5 absolute holds them, while a wrong eps, a
// missing mean or bias moves every element by far more.
TEST_CASE("layernorm is (x - mean) / sqrt(var + eps) * w + b, row by row, as in float64", "[ops]") {
  const int T = 5, D = 40;
  const float eps = 1e-3f;
  Tensor x = randn({T, D}, "x", 3.0f), w = randn({D}, "w"), b = randn({D}, "b");
  Tensor y = empty({T, D}, Mem::Activations), stats = empty({T, 2}, Mem::Activations);
  layernorm_forward(kCpu, y, stats, x, w, b, eps);
  for (int t = 0; t < T; t++) {
    const float* xr = x.f32() + t * D;
    double mean = 0, var = 0;
    for (int i = 0; i < D; i++) mean += xr[i];
    mean /= D;
    for (int i = 0; i < D; i++) var += (xr[i] - mean) * (xr[i] - mean);
    const double r = 1.0 / std::sqrt(var / D + eps);
    CHECK(std::fabs(stats.f32()[2 * t] - mean) <= 1e-5 * (1 + std::fabs(mean)));
    CHECK(std::fabs(stats.f32()[2 * t + 1] - r) <= 1e-5 * r);
    for (int i = 0; i < D; i++) {
      const double want = (xr[i] - mean) * r * w.f32()[i] + b.f32()[i];
      INFO("row " << t << ", column " << i);
      CHECK(std::fabs(y.f32()[t * D + i] - want) <= 1e-5 * (1 + std::fabs(want)));
    }
  }
}

TEST_CASE("layernorm_backward matches central differences and accumulates", "[ops]") {
  const int T = 3, D = 8;
  Tensor x = randn({T, D}, "x"), w = randn({D}, "w"), b = randn({D}, "b"), R = randn({T, D}, "R");
  Tensor y = empty({T, D}, Mem::Activations), stats = empty({T, 2}, Mem::Activations);
  Tensor dx = zeros({T, D}, Mem::Grads), dw = zeros({D}, Mem::Grads), db = zeros({D}, Mem::Grads);
  layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
  layernorm_backward(kCpu, dx, dw, db, R, x, w, stats);
  auto loss = [&] {
    layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
    return weighted_sum(y, R);
  };
  // RMSNorm's bounds (above): O(1) curvature for unit-variance rows, h^2 truncation and
  // roundoff ~1e-4 each.
  check_gradient(x, dx, loss, 1e-2f, 2e-3f);
  check_gradient(w, dw, loss, 1e-2f, 2e-3f);
  check_gradient(b, db, loss, 1e-2f, 2e-3f);
  layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
  Tensor first_dx = clone(dx), first_db = clone(db);
  layernorm_backward(kCpu, dx, dw, db, R, x, w, stats);  // "+=": a second call doubles dx
  for (int i = 0; i < T * D; i++) CHECK(dx.f32()[i] == 2.0f * first_dx.f32()[i]);
  for (int i = 0; i < D; i++) CHECK(db.f32()[i] == Approx(2.0f * first_db.f32()[i]).epsilon(1e-6));
}

// GPT-2's GeLU against its formula in float64 (fp32 tanhf within a few ulp: 1e-6 relative),
// and its backward against central differences.
TEST_CASE("gelu is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), its backward the derivative",
          "[ops]") {
  Tensor x = randn({4, 6}, "x", 2.0f), R = randn({4, 6}, "R"), y = empty({4, 6}, Mem::Activations);
  gelu_forward(kCpu, y, x);
  for (int i = 0; i < 24; i++) {
    const double v = x.f32()[i];
    const double want = 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
    CHECK(std::fabs(y.f32()[i] - want) <= 1e-6 * (1 + std::fabs(want)));
  }
  Tensor dx = from_values({4, 6}, std::vector<float>(24, 7.0f));  // "=": overwritten
  gelu_backward(kCpu, dx, R, x);
  auto loss = [&] {
    gelu_forward(kCpu, y, x);
    return weighted_sum(y, R);
  };
  // tanh's O(1) third derivative: truncation ~h^2 = 1e-4, roundoff ~1e-5 (swiglu's bound).
  check_gradient(x, dx, loss, 1e-2f, 1e-3f);
}

namespace {
// Tokens of B sequences numbered from first_sequence in the run, at positions 0 .. T-1.
struct Tokens {
  Tensor sequences, positions;
  Tokens(int B, int T, int first_sequence, int first_position = 0) {
    std::vector<int32_t> s, p;
    for (int i = 0; i < B * T; i++)
      s.push_back(first_sequence + i / T), p.push_back(first_position + i % T);
    sequences = ids_tensor(s), positions = ids_tensor(p);
  }
};
int64_t kept(const Tensor& mask) {
  int64_t n = 0;
  for (int64_t i = 0; i < mask.numel(); i++) n += mask.u8()[i];
  return n;
}
}  // namespace

// Kept elements are scaled by 1/(1 - p) (the fp32 product: within an ulp of x / (1 - p) in
// float64), dropped ones are 0; about p of 64000 are dropped: the count is binomial, std
// sqrt(n p (1 - p)) = 110, and 6 of them (660) bound it. The mask is a function of where each
// element is: rows taken in two parts (as sequence parallelism splits them, row0) draw the
// whole's mask, and another layer, site or sequence draws another.
TEST_CASE("dropout keeps 1 - p of the elements, scaled, by a mask that any split of the rows draws",
          "[ops]") {
  const int B = 4, T = 50, D = 320;
  const float p = 0.25f;
  Tensor x = randn({B * T, D}, "x"), y = empty({B * T, D}, Mem::Activations);
  Tensor mask = empty({B * T, D}, Mem::Activations, Device::CPU, DType::U8);
  const Tokens tokens(B, T, 1000);
  const DropoutSite site{7, 3, 1, p};
  dropout_forward(kCpu, y, mask, x, site, tokens.sequences, tokens.positions, 0);
  const int64_t n = x.numel();
  CHECK(std::abs(n - kept(mask) - (int64_t)(p * n)) <= 660);
  for (int64_t i = 0; i < n; i++) {
    const double want = mask.u8()[i] ? x.f32()[i] / (1.0 - p) : 0.0;
    REQUIRE(std::fabs(y.f32()[i] - want) <= 2.4e-7 * std::fabs(want));
  }
  // In two parts of rows, as the ranks of a tensor-parallel group hold them under SP.
  const int64_t half = B * T / 2;
  Tensor mask2 = empty({B * T, D}, Mem::Activations, Device::CPU, DType::U8), y2 = clone(y);
  for (int64_t row0 : {(int64_t)0, half})
    dropout_forward(kCpu, y2.view(row0 * D, {half, D}), mask2.view(row0 * D, {half, D}),
                    x.view(row0 * D, {half, D}), site, tokens.sequences, tokens.positions, row0);
  CHECK(same_bytes(mask2, mask));
  CHECK(same_bytes(y2, y));
  // Elsewhere in the run: another layer, site or seed, or other sequences, draw other masks.
  for (const auto& [other, shift] : {std::pair{DropoutSite{7, 4, 1, p}, 0},
                                     {DropoutSite{7, 3, 2, p}, 0},
                                     {DropoutSite{8, 3, 1, p}, 0},
                                     {site, 1}}) {
    const Tokens moved(B, T, 1000 + shift);
    dropout_forward(kCpu, y2, mask2, x, other, moved.sequences, moved.positions, 0);
    CHECK(!same_bytes(mask2, mask));
  }
  // The backward: the mask and the scale, on the gradient.
  Tensor dy = randn({B * T, D}, "dy"), dx = empty({B * T, D}, Mem::Activations);
  dropout_backward(kCpu, dx, dy, mask, p);
  for (int64_t i = 0; i < n; i++) {
    const double want = mask.u8()[i] ? dy.f32()[i] / (1.0 - p) : 0.0;
    REQUIRE(std::fabs(dx.f32()[i] - want) <= 2.4e-7 * std::fabs(want));
  }
}

// On attention's probabilities [B, H, T, T]: nothing kept above the diagonal; each query
// head's mask is its own, so a rank holding heads 2..3 (head0 2) draws the whole's; and the
// key's position is part of the draw (a sequence split over cp ranks keeps its masks).
TEST_CASE("attention's dropout is causal, and a head split draws the whole's masks", "[ops]") {
  const int B = 1, H = 4, T = 24;
  const float p = 0.5f;
  Tensor probs = randn({B, H, T, T}, "probs"), dropped = empty({B, H, T, T}, Mem::Activations);
  Tensor mask = empty({B, H, T, T}, Mem::Activations, Device::CPU, DType::U8);
  const Tokens tokens(B, T, 3);
  const DropoutSite site{1, 0, 0, p};
  dropout_attention_forward(kCpu, dropped, mask, probs, site, tokens.sequences, tokens.positions,
                            0);
  int64_t visible = 0;
  for (int h = 0; h < H; h++)
    for (int i = 0; i < T; i++)
      for (int j = 0; j < T; j++) {
        const int64_t e = ((int64_t)h * T + i) * T + j;
        if (j > i) REQUIRE((mask.u8()[e] == 0 && dropped.f32()[e] == 0.0f));
        visible += j <= i;
        if (mask.u8()[e]) REQUIRE(dropped.f32()[e] == probs.f32()[e] * (1.0f / (1.0f - p)));
      }
  // Half of the 1200 visible scores: binomial std 17, 6 of them 104.
  CHECK(std::abs(visible / 2 - kept(mask)) <= 104);
  const int64_t per_head = (int64_t)T * T;
  Tensor upper = empty({B, 2, T, T}, Mem::Activations),
         upper_mask = empty({B, 2, T, T}, Mem::Activations, Device::CPU, DType::U8);
  dropout_attention_forward(kCpu, upper, upper_mask, probs.view(2 * per_head, {B, 2, T, T}), site,
                            tokens.sequences, tokens.positions, 2);
  CHECK(memcmp(upper_mask.ptr, mask.u8() + 2 * per_head, 2 * per_head) == 0);
  const Tokens later(B, T, 3, 100);  // the same sequence, 100 positions on
  dropout_attention_forward(kCpu, upper, upper_mask, probs.view(0, {B, 2, T, T}), site,
                            later.sequences, later.positions, 0);
  CHECK(memcmp(upper_mask.ptr, mask.u8(), 2 * per_head) != 0);
}

TEST_CASE("residual_forward, axpy and scale_ give exact small-integer results", "[ops]") {
  Tensor a = from_values({4}, {1, 2, 3, 4}), b = from_values({4}, {10, 20, 30, 40});
  Tensor out = empty({4}, Mem::Activations);
  residual_forward(kCpu, out, a, b);
  check_equal(out, {11, 22, 33, 44});
  residual_forward(kCpu, a, a, b);  // out may alias a
  check_equal(a, {11, 22, 33, 44});
  axpy(kCpu, out, -2.0f, b);
  check_equal(out, {-9, -18, -27, -36});
  scale_(kCpu, out, -0.5f);
  check_equal(out, {4.5f, 9, 13.5f, 18});
}

// ----------------------------------------------------------------------------
// cross-entropy

// A mixture of experts' combine: each row times its weight, and each row's dot product.
TEST_CASE("residual_forward reads a bf16 or fp16 branch as its fp32 values, bit for bit", "[ops]") {
  // On one tp rank the o and down projections write their output in the compute format, and
  // the residual add widens it: the same sums as from the fp32 copy of those values.
  const int n = 333;
  Tensor a = randn({n}, "a", 3.0f), b = randn({n}, "b");
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor b16 = empty({n}, Mem::Activations, Device::CPU, half);
    cast_(kCpu, b16, b);
    cast_(kCpu, b, b16);
    Tensor out = empty({n}, Mem::Activations), out16 = clone(out);
    residual_forward(kCpu, out, a, b);
    residual_forward(kCpu, out16, a, b16);
    CHECK(memcmp(out.ptr, out16.ptr, out.nbytes()) == 0);
  }
}

TEST_CASE("scale_rows and row_dots give exact small-integer results, zero rows included", "[ops]") {
  Tensor x = empty({3, 2}, Mem::Workspace), w = empty({3}, Mem::Workspace);
  Tensor y = empty({3, 2}, Mem::Workspace), d = empty({3}, Mem::Workspace);
  std::vector<float> xs = {1, 2, 3, 4, 5, 6}, ws = {2, -1, 0.5f};
  from_host(x, xs.data()), from_host(w, ws.data());
  scale_rows(kCpu, y, x, w);
  CHECK(to_host_floats(y) == std::vector<float>{2, 4, -3, -4, 2.5f, 3});
  row_dots(kCpu, d, x, y);  // 1*2 + 2*4, 3*-3 + 4*-4, 5*2.5 + 6*3
  CHECK(to_host_floats(d) == std::vector<float>{10, -25, 30.5f});
  scale_rows(kCpu, x, x, w);  // in place
  CHECK(to_host_floats(x) == to_host_floats(y));
  Tensor none = empty({1, 2}, Mem::Workspace).view(0, {0, 2}), nw = empty({1}, Mem::Workspace);
  scale_rows(kCpu, none, none, nw.view(0, {0}));  // nothing to do, nothing touched
  row_dots(kCpu, nw.view(0, {0}), none, none);
}

// A mixture's rows travel in the compute format: the combine scales 16-bit rows, the routing
// weights' gradient dots fp32 gradients with them and the backward scatter-adds 16-bit rows, each
// value widened (exact) and the arithmetic fp32's. Expected: each product in double, rounded once
// to float (a 8- or 11-bit by 24-bit significand product is exact in double, so this is fp32's
// correctly rounded product), and each sum in position order in float, from the format's values
// decoded here.
TEST_CASE("scale_rows, row_dots and embedding_backward read bf16 and fp16 rows widened", "[ops]") {
  const int K = 6, D = 5, V = 3;
  Tensor x = randn({K, D}, "x", 3.0f), w = randn({K}, "w");
  std::vector<int32_t> id_values = {2, 0, 2, 1, 2, 0};
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor xh = empty({K, D}, Mem::Workspace, Device::CPU, half);
    cast_(kCpu, xh, x);
    std::vector<float> xv(K * D);
    for (int i = 0; i < K * D; i++) {
      const uint16_t bits = ((const uint16_t*)xh.ptr)[i];
      xv[i] = half == DType::BF16 ? bf16_to_float(bits) : fp16_to_float(bits);
    }
    const std::vector<float> wv = to_host_floats(w);
    Tensor y = empty({K, D}, Mem::Workspace);
    scale_rows(kCpu, y, xh, w);
    std::vector<float> want(K * D);
    for (int i = 0; i < K * D; i++) want[i] = (float)((double)xv[i] * wv[i / D]);
    CHECK(to_host_floats(y) == want);

    Tensor a = randn({K, D}, "a"), dots = empty({K}, Mem::Workspace);
    row_dots(kCpu, dots, a, xh);
    const std::vector<float> av = to_host_floats(a);
    std::vector<float> dot_sums(K, 0.0f);
    for (int i = 0; i < K * D; i++) dot_sums[i / D] += (float)((double)av[i] * xv[i]);
    CHECK(to_host_floats(dots) == dot_sums);

    Tensor dtable = from_values({V, D}, std::vector<float>(V * D, 0.25f));
    embedding_backward(kCpu, dtable, ids_tensor(id_values), xh);
    std::vector<float> sums(V * D, 0.25f);
    for (int k = 0; k < K; k++)
      for (int d = 0; d < D; d++) sums[id_values[k] * D + d] += xv[k * D + d];
    CHECK(to_host_floats(dtable) == sums);
  }
}

TEST_CASE("cross-entropy is -log softmax(logits)[target]", "[ops]") {
  Tensor logits = randn({4, 7}, "logits", 2.0f), targets = ids_tensor({0, 6, 3, 3});
  Tensor losses = empty({4}, Mem::Activations);
  cross_entropy_forward(kCpu, losses, logits, targets);
  for (int t = 0; t < 4; t++) {
    float z = 0.0f;
    for (int i = 0; i < 7; i++) z += std::exp(logits.f32()[t * 7 + i]);
    float p = std::exp(logits.f32()[t * 7 + targets.i32()[t]]) / z;
    CHECK(losses.f32()[t] == Approx(-std::log(p)).epsilon(1e-5));
  }
}

TEST_CASE("cross-entropy subtracts the row max, so logits near 100 do not overflow", "[ops]") {
  // exp(100) is beyond fp32's range; the loss is shift-invariant, so it must equal the
  // loss of the unshifted row (up to the rounding of x + 100, ulp ~1e-5).
  Tensor logits = from_values({1, 3}, {0.5f, -1.0f, 2.0f}), targets = ids_tensor({1});
  Tensor shifted = from_values({1, 3}, {100.5f, 99.0f, 102.0f});
  Tensor loss = empty({1}, Mem::Activations), loss_shifted = empty({1}, Mem::Activations);
  cross_entropy_forward(kCpu, loss, logits, targets);
  cross_entropy_forward(kCpu, loss_shifted, shifted, targets);
  CHECK(std::isfinite(loss_shifted.f32()[0]));
  CHECK(loss_shifted.f32()[0] == Approx(loss.f32()[0]).margin(1e-4));
}

TEST_CASE("cross_entropy_backward matches central differences, also in place", "[ops]") {
  const int T = 4, V = 7;
  const float scale = 1.0f / T;  // the mean over tokens
  Tensor logits = randn({T, V}, "logits"), targets = ids_tensor({2, 0, 6, 2});
  Tensor losses = empty({T}, Mem::Activations), dlogits = empty({T, V}, Mem::Grads);
  Tensor weights = from_values({T}, std::vector<float>(T, scale));
  cross_entropy_backward(kCpu, dlogits, logits, targets, scale);
  auto loss = [&] {
    cross_entropy_forward(kCpu, losses, logits, targets);
    return weighted_sum(losses, weights);
  };
  // logsumexp has bounded derivatives: truncation ~h^2/6, roundoff ~1e-5; tolerance 1e-3.
  check_gradient(logits, dlogits, loss, 1e-2f, 1e-3f);

  Tensor in_place = clone(logits);
  cross_entropy_backward(kCpu, in_place, in_place, targets, scale);
  check_equal(in_place, to_host_floats(dlogits));
  for (int t = 0; t < T; t++) {  // softmax sums to 1, the one-hot too: each row sums to 0
    float row = 0.0f;
    for (int i = 0; i < V; i++) row += dlogits.f32()[t * V + i];
    CHECK(row == Approx(0.0f).margin(1e-6));
  }
}

// Mixed precision's LM head writes the logits in bf16 or fp16: the loss must be, bit for bit,
// the fp32 loss of their values, and the gradient the fp32 gradient rounded once into the
// format (in place, as the model runs it), its rounding counted in the backward's statistics.
TEST_CASE("cross-entropy on bf16 or fp16 logits is the fp32 one on their values, rounded once",
          "[ops]") {
  const int T = 5, V = 300;
  std::vector<int32_t> target_values(T);
  for (int t = 0; t < T; t++) target_values[t] = (t * 97) % V;
  Tensor targets = ids_tensor(target_values);
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor logits = randn({T, V}, "logits", 4.0f);
    Tensor l16 = empty({T, V}, Mem::Activations, Device::CPU, half);
    cast_(kCpu, l16, logits);
    cast_(kCpu, logits, l16);  // the fp32 logits: the format's values
    Tensor losses = empty({T}, Mem::Activations), losses16 = clone(losses);
    Tensor stats = empty({T, 2}, Mem::Workspace), stats16 = clone(stats);
    cross_entropy_forward(kCpu, losses, stats, logits, targets);
    cross_entropy_forward(kCpu, losses16, stats16, l16, targets);
    CHECK(memcmp(losses16.ptr, losses.ptr, losses.nbytes()) == 0);
    CHECK(memcmp(stats16.ptr, stats.ptr, stats.nbytes()) == 0);
    Tensor dlogits = empty({T, V}, Mem::Workspace), want = clone(l16);
    cross_entropy_backward(kCpu, dlogits, logits, stats, targets, 1.0f / T);
    cast_(kCpu, want, dlogits);
    reset_rounding_stats();
    cross_entropy_backward(kCpu, l16, l16, stats16, targets, 1.0f / T);  // in place
    CHECK(memcmp(l16.ptr, want.ptr, l16.nbytes()) == 0);
    uint64_t nonzero = 0;
    for (int64_t i = 0; i < dlogits.numel(); i++) nonzero += dlogits.f32()[i] != 0;
    CHECK(rounding_stats(true).nonzero == nonzero);
  }
}

// ----------------------------------------------------------------------------
// reductions, AdamW, clipping

TEST_CASE("sum and sum_squares are exact on small integers", "[ops]") {
  std::vector<float> v(1000);
  for (int i = 0; i < 1000; i++) v[i] = (float)(i % 100 + 1);  // ten copies of 1..100
  Tensor x = from_values({1000}, v);
  CHECK(sum(kCpu, x) == 50500.0f);
  CHECK(sum_squares(kCpu, x) == 3383500.0f);  // every partial sum is an integer below 2^24
  CHECK(sum(kCpu, from_values({3}, {-1, 2, -4})) == -3.0f);
}

TEST_CASE("AdamW matches a hand-computed two-step example", "[ops]") {
  // beta1 0.9, beta2 0.95, lr 0.1, weight decay 0.1; element 0 sees g = 0.5 then -0.25.
  // step 1: m = 0.05, v = 0.0125; mhat = 0.05/0.1 = 0.5, vhat = 0.0125/0.05 = 0.25
  //         p = 1 - 0.1 * (0.5/0.5 + 0.1 * 1) = 0.89      (Adam's first step is lr * sign(g))
  // step 2: m = 0.045 - 0.025 = 0.02, v = 0.011875 + 0.003125 = 0.015
  //         mhat = 0.02/0.19 = 2/19, vhat = 0.015/0.0975 = 2/13, mhat/sqrt(vhat) = 0.2683694
  //         p = 0.89 - 0.1 * (0.2683694 + 0.1 * 0.89) = 0.8542631
  // Element 1 has g = 0: the moments stay 0 and only decoupled weight decay acts,
  //         p = 2 * (1 - 0.01)^2 = 1.9602.
  AdamWConfig cfg;
  float p[2] = {1.0f, 2.0f}, m[2] = {0, 0}, v[2] = {0, 0};
  float g1[2] = {0.5f, 0.0f}, g2[2] = {-0.25f, 0.0f};
  adamw_update(kCpu, p, g1, m, v, 2, cfg, 0.1f, 0.1f, 1);
  CHECK(m[0] == Approx(0.05f).epsilon(1e-6));
  CHECK(v[0] == Approx(0.0125f).epsilon(1e-6));
  CHECK(p[0] == Approx(0.89f).epsilon(1e-6));
  adamw_update(kCpu, p, g2, m, v, 2, cfg, 0.1f, 0.1f, 2);
  CHECK(m[0] == Approx(0.02f).epsilon(1e-5));
  CHECK(v[0] == Approx(0.015f).epsilon(1e-5));
  CHECK(p[0] == Approx(0.8542631f).epsilon(1e-6));
  CHECK(p[1] == Approx(1.9602f).epsilon(1e-6));
}

// bf16 of an fp32 value by its bits, written here: keep the top 16, round the rest to nearest,
// ties to the even top half (finite values).
static uint16_t bf16_by_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

TEST_CASE(
    "AdamW writes the compute copy in its pass: the new weights rounded, nothing else changed",
    "[ops]") {
  // Mixed precision's bf16 (fp16) copy of the weights, refreshed by the optimizer's own pass:
  // p, m and v must be bit for bit those of an update without a copy, and the copy the new p
  // rounded to nearest (bf16 by its bits; fp16 checked against both neighbours of the result).
  const int n = 4099;
  AdamWConfig cfg;
  for (DType format : {DType::BF16, DType::F16}) {
    INFO(dtype_name(format));
    Tensor p = randn({n}, "p"), m = zeros({n}, Mem::Optimizer), v = zeros({n}, Mem::Optimizer);
    Tensor p2 = randn({n}, "p"), m2 = zeros({n}, Mem::Optimizer), v2 = zeros({n}, Mem::Optimizer);
    Tensor copy = zeros({n}, Mem::Params, Device::CPU, format);
    for (int step = 1; step <= 3; step++) {
      Tensor g = randn({n}, "g" + std::to_string(step));
      adamw_update(kCpu, p.f32(), g.f32(), m.f32(), v.f32(), n, cfg, 1e-2f, 0.1f, step);
      adamw_update(kCpu, p2.f32(), g.f32(), m2.f32(), v2.f32(), n, cfg, 1e-2f, 0.1f, step, copy);
    }
    REQUIRE(std::memcmp(p.ptr, p2.ptr, 4 * n) == 0);
    REQUIRE(std::memcmp(m.ptr, m2.ptr, 4 * n) == 0);
    REQUIRE(std::memcmp(v.ptr, v2.ptr, 4 * n) == 0);
    const uint16_t* c = (const uint16_t*)copy.ptr;
    int wrong = 0;
    for (int i = 0; i < n; i++) {
      const float x = p.f32()[i];
      if (format == DType::BF16) {
        wrong += c[i] != bf16_by_bits(x);
      } else {  // no fp16 value lies nearer to x than the copy's (|x| < 65504 here)
        const float at = fp16_to_float(c[i]), below = fp16_to_float((uint16_t)(c[i] - 1)),
                    above = fp16_to_float((uint16_t)(c[i] + 1));
        wrong +=
            std::fabs(x - at) > std::fabs(x - below) || std::fabs(x - at) > std::fabs(x - above);
      }
    }
    CHECK(wrong == 0);
  }
}

TEST_CASE("adamw_update_many: every slice as adamw_update alone, bit for bit, in one launch",
          "[ops]") {
  // Slices of different lengths (one empty), with and without weight decay and a compute copy,
  // at offsets of one buffer as the flat parameters have them.
  AdamWConfig cfg;
  const std::vector<int64_t> lengths = {1, 257, 0, 4099, 33};
  int64_t total = 0;
  for (int64_t n : lengths) total += n;
  Tensor p = randn({total}, "p"), m = zeros({total}, Mem::Optimizer), v = clone(m);
  Tensor p2 = clone(p), m2 = clone(m), v2 = clone(m);
  Tensor copy = zeros({total}, Mem::Params, Device::CPU, DType::BF16), copy2 = clone(copy);
  reset_ledger();
  for (int step = 1; step <= 3; step++) {
    Tensor g = randn({total}, "g" + std::to_string(step));
    std::vector<AdamWSlice> slices;
    int64_t at = 0;
    for (size_t j = 0; j < lengths.size(); j++) {
      const int64_t n = lengths[j];
      const float wd = j % 2 ? 0.1f : 0.0f;
      Tensor c = j == 3 ? Tensor() : copy.view(at, {n});
      adamw_update(kCpu, p.f32() + at, g.f32() + at, m.f32() + at, v.f32() + at, n, cfg, 1e-2f, wd,
                   step, c);
      slices.push_back({p2.f32() + at, g.f32() + at, m2.f32() + at, v2.f32() + at, n, wd,
                        j == 3 ? nullptr : (uint16_t*)copy2.view(at, {n}).ptr});
      at += n;
    }
    const int64_t launches = ledger().rows[(int)OpKind::Optimizer].launches;
    adamw_update_many(kCpu, slices, cfg, 1e-2f, step);
    CHECK(ledger().rows[(int)OpKind::Optimizer].launches == launches + 1);  // one kernel
  }
  CHECK(memcmp(p.ptr, p2.ptr, p.nbytes()) == 0);
  CHECK(memcmp(m.ptr, m2.ptr, m.nbytes()) == 0);
  CHECK(memcmp(v.ptr, v2.ptr, v.nbytes()) == 0);
  CHECK(memcmp(copy.ptr, copy2.ptr, copy.nbytes()) == 0);
}

// Guards the arena's accounting (core.cuh, arena_reserved), on meta, where it allocates as CUDA
// would: a buffer's size rounded up to 512 bytes, reserved once, held after its tensor goes and
// reused by the next of its size without an allocator call, given back by release_arena. Deltas:
// other cases leave buffers of other sizes held. 123457 floats, 493828 bytes: 494080 reserved.
TEST_CASE("the arena reserves a size once, holds it after a free, and gives it back", "[ops]") {
  Context ctx = Context::create(Device::Meta);
  const int64_t kBuffer = 494080, n = 123457;
  const ArenaBytes before = arena_reserved();
  const uint64_t calls = allocator_calls();
  memory_reset_peak();
  { Tensor a = empty(ctx, {n}, Mem::Workspace); }
  CHECK(arena_reserved().now - before.now == kBuffer);  // held, not given back
  CHECK(allocator_calls() - calls == 1);
  {
    Tensor a = empty(ctx, {n}, Mem::Workspace);  // the held one
    CHECK(allocator_calls() - calls == 1);
    Tensor b = empty(ctx, {n}, Mem::Workspace);  // a second, from the allocator
    CHECK(arena_reserved().now - before.now == 2 * kBuffer);
  }
  CHECK(arena_reserved().peak - before.now == 2 * kBuffer);
  release_arena(ctx.stream);
  CHECK(arena_reserved().now <= before.now);  // both given back (and whatever else was held)
  ctx.destroy();
}

TEST_CASE("host synchronisations are counted where the host waits for the device", "[ops]") {
  Tensor x = small_ints({300}, "x");
  uint64_t before = host_syncs();
  sum(kCpu, x);            // a result on the host
  sum_squares(kCpu, x);    // another
  to_host_floats(x);       // a download
  kCpu.synchronize();      // an explicit wait
  axpy(kCpu, x, 2.0f, x);  // device-side work: no wait
  zero_(x);
  const int32_t ids[3] = {7, -1, 255};
  Tensor up = empty({3}, Mem::Workspace, Device::CPU, DType::I32);
  from_host(kCpu, up, ids);  // a step's inputs going up: no wait
  CHECK(host_syncs() - before == 4);
  CHECK(memcmp(up.ptr, ids, sizeof(ids)) == 0);
}

// A step's losses: each micro-batch's sum left pending (sum_later), all read in one trip. The
// values are sum's, bit for bit, added in order in double (float64 written out here); only the
// read waits, once, and a read of no pending sum (a stage without the loss) waits not at all.
TEST_CASE("sums left pending are sum's values, read in order with one host synchronisation",
          "[ops]") {
  std::vector<Tensor> xs = {randn({300}, "l0"), randn({1}, "l1"), randn({4099}, "l2")};
  uint64_t before = host_syncs();
  std::vector<PendingSum> pending = {PendingSum{}};  // a forward without the head: no sum
  for (const Tensor& x : xs) pending.push_back(sum_later(kCpu, x));
  CHECK(host_syncs() - before == 0);
  double want = 0;
  for (const Tensor& x : xs) want += (double)sum(kCpu, x);
  before = host_syncs();
  const double got = read_total(kCpu, pending);
  CHECK(host_syncs() - before == 1);
  CHECK(memcmp(&got, &want, sizeof(double)) == 0);
  before = host_syncs();
  CHECK(read_total(kCpu, {PendingSum{}, PendingSum{}}) == 0.0);
  CHECK(host_syncs() - before == 0);
}

// The value itself, from integers written out here: each tensor's elements are small integers,
// so every partial sum in float is exact and the total is the integer sum, which the test adds
// in int64 (a pending sum that lost, repeated or reordered a tensor would miss it).
TEST_CASE("sums left pending add up to the integers' total", "[ops]") {
  std::vector<std::vector<float>> values = {
      std::vector<float>(300), {7.0f}, {}, std::vector<float>(4099)};
  int64_t want = 0;
  for (size_t i = 0; i < values[0].size(); i++) values[0][i] = (float)(i % 100 + 1);
  for (size_t i = 0; i < values[3].size(); i++) values[3][i] = (float)((int)(i % 7) - 5);
  for (const auto& v : values)
    for (float f : v) want += (int64_t)f;
  REQUIRE(want == 3 * 5050 + 7 + 585 * (-14) + (-5 - 4 - 3 - 2));  // 4099 = 585 x 7 + 4
  std::vector<PendingSum> pending;
  for (const auto& v : values)
    pending.push_back(sum_later(kCpu, from_values({(int64_t)v.size()}, v)));
  CHECK(read_total(kCpu, pending) == (double)want);
}

// ----------------------------------------------------------------------------
// CUDA kernels against the CPU references. Sizes are not multiples of the 256-thread block.

namespace {

// copy_ runs on the legacy default stream, with which the (blocking) compute stream is ordered
// (core.cuh); the synchronisations make each test independent of that choice: the device
// after uploads, the compute stream before downloads.
Tensor gpu(const Tensor& t) {
  Tensor g = to_device(t, Device::CUDA, Mem::Activations);
  CUDA_CHECK(cudaDeviceSynchronize());
  return g;
}
std::vector<float> host(const Context& ctx, const Tensor& t) {
  ctx.synchronize();
  return to_host_floats(t);
}

// |gpu - cpu| <= atol + rtol * |cpu| everywhere; reports the worst element.
void check_close(const std::vector<float>& got, const Tensor& want, float rtol, float atol) {
  std::vector<float> w = to_host_floats(want);
  REQUIRE(got.size() == w.size());
  size_t worst = 0, bad = 0;
  float worst_excess = -1.0f;
  for (size_t i = 0; i < w.size(); i++) {
    float excess = std::fabs(got[i] - w[i]) - (atol + rtol * std::fabs(w[i]));
    if (!(excess <= 0.0f)) bad++;  // counts NaN as bad
    if (!(excess <= worst_excess)) worst_excess = excess, worst = i;
  }
  INFO(bad << " of " << w.size() << " elements out of tolerance; worst at " << worst << ": gpu "
           << got[worst] << ", cpu " << w[worst]);
  CHECK(bad == 0);
}

// Runs `run` twice; both results must agree bit for bit (a deterministic kernel). Returns one.
std::vector<float> same_twice(const std::function<std::vector<float>()>& run) {
  std::vector<float> first = run(), second = run();
  REQUIRE(first.size() == second.size());
  CHECK(memcmp(first.data(), second.data(), first.size() * sizeof(float)) == 0);
  return first;
}

}  // namespace

// A step's token ids, targets and positions go up through a ring of 32 pinned buffers on the
// compute stream: 32 copies make no host wait; the 33rd reuses the first buffer, whose copy has
// arrived (after the synchronise), so it makes none either; every tensor holds what was sent
// although each source was overwritten right after its call.
TEST_CASE("CUDA: the step's inputs go up through pinned buffers without a host wait", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  {
    const int n = 1000, copies = 33;
    std::vector<Tensor> sent;
    std::vector<int32_t> source(n);
    const uint64_t before = host_syncs();
    for (int c = 0; c < copies; c++) {
      if (c == 32) {
        ctx.synchronize();  // counted: one
        CHECK(host_syncs() - before == 1);
      }
      for (int i = 0; i < n; i++) source[i] = c * 100000 + i;
      sent.push_back(empty(ctx, {n}, Mem::Workspace, DType::I32));
      from_host(ctx, sent.back(), source.data());
      std::fill(source.begin(), source.end(), -1);  // the caller may reuse it at once
    }
    CHECK(host_syncs() - before == 1);
    ctx.synchronize();
    for (int c = 0; c < copies; c++) {
      Tensor back = to_device(sent[c], Device::CPU, Mem::Workspace);
      int wrong = 0;
      for (int i = 0; i < n; i++) wrong += back.i32()[i] != c * 100000 + i;
      CHECK(wrong == 0);
    }
  }
  ctx.destroy();
}

TEST_CASE("CUDA gemm matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      INFO("trans_a " << ta << ", trans_b " << tb);
      GemmCase g(ta, tb, [](std::vector<int64_t> s, std::string n) { return randn(s, n); });
      Tensor A = gpu(g.A), B = gpu(g.B), C = gpu(g.C);
      gemm(kCpu, ta, tb, g.M, g.N, g.K, 2.0f, g.A.f32(), g.lda, g.B.f32(), g.ldb, 0.5f, g.C.f32(),
           g.ldc);
      gemm(ctx, ta, tb, g.M, g.N, g.K, 2.0f, A.f32(), g.lda, B.f32(), g.ldb, 0.5f, C.f32(), g.ldc);
      check_close(host(ctx, C), g.C, 1e-5f, 1e-5f);  // fp32 (no TF32), K = 4: a few ulp
    }
  ctx.destroy();
}

TEST_CASE("CUDA embedding matches the CPU reference; its backward bit for bit", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int V = 50, D = 300, T = 97;
  std::vector<int32_t> id_values(T);
  for (int t = 0; t < T; t++) id_values[t] = (t * 7) % V;  // repeats: rows add into one entry
  id_values[5] = -1;  // another tensor-parallel rank's token: a zero row, no gradient
  Tensor table = randn({V, D}, "table"), ids = ids_tensor(id_values), dout = randn({T, D}, "dout");
  Tensor out = empty({T, D}, Mem::Activations), dtable = clone(table);
  Tensor g_table = gpu(table), g_ids = gpu(ids), g_dout = gpu(dout), g_out = gpu(out);
  embedding_forward(kCpu, out, ids, table);
  embedding_forward(ctx, g_out, g_ids, g_table);
  check_close(host(ctx, g_out), out, 0.0f, 0.0f);  // a copy: exact
  for (DType half : {DType::BF16, DType::F16}) {   // mixed precision's copy: rows widened, exactly
    INFO(dtype_name(half));
    Tensor h_table = empty({V, D}, Mem::Params, Device::CPU, half);
    cast_(kCpu, h_table, table);
    embedding_forward(kCpu, out, ids, h_table);
    embedding_forward(ctx, g_out, g_ids, to_device(h_table, Device::CUDA, Mem::Params));
    check_close(host(ctx, g_out), out, 0.0f, 0.0f);
    // Rows in that format too (a 16-bit residual stream), from either table: the CPU's bits.
    for (const Tensor* from : {&table, &h_table}) {
      Tensor rows = empty({T, D}, Mem::Activations, Device::CPU, half);
      Tensor g_rows = empty({T, D}, Mem::Activations, Device::CUDA, half);
      embedding_forward(kCpu, rows, ids, *from);
      embedding_forward(ctx, g_rows, g_ids, to_device(*from, Device::CUDA, Mem::Params));
      check_close(host(ctx, cast_to(ctx, g_rows, DType::F32)), cast_to(kCpu, rows, DType::F32),
                  0.0f, 0.0f);
    }
  }
  embedding_backward(kCpu, dtable, ids, dout);
  embedding_backward(ctx, g_table, g_ids, g_dout);
  // The GPU adds each entry's rows in position order, as the CPU loop does: exact.
  check_close(host(ctx, g_table), dtable, 0.0f, 0.0f);
  for (DType half : {DType::BF16, DType::F16}) {  // 16-bit rows (a mixture's), read widened
    INFO(dtype_name(half));
    Tensor dout_h = empty(dout.shape, Mem::Workspace, Device::CPU, half);
    cast_(kCpu, dout_h, dout);
    embedding_backward(kCpu, dtable, ids, dout_h);
    embedding_backward(ctx, g_table, g_ids, to_device(dout_h, Device::CUDA, Mem::Workspace));
    check_close(host(ctx, g_table), dtable, 0.0f, 0.0f);
  }
  ctx.destroy();
}

TEST_CASE("CUDA embedding backward is bitwise the same in two runs, with many repeats", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  // 4096 positions over 7 ids: runs of ~585 rows into one entry, where float atomics would
  // round differently from run to run. Zipf-like: id t % 7 except every third is id 0.
  const int V = 7, D = 129, T = 4096;
  std::vector<int32_t> id_values(T);
  for (int t = 0; t < T; t++) id_values[t] = t % 3 == 0 ? 0 : t % V;
  Tensor ids = gpu(ids_tensor(id_values)), dout = gpu(randn({T, D}, "dout", 3.0f));
  std::vector<float> got = same_twice([&] {
    Tensor dtable = gpu(randn({V, D}, "dtable0"));
    embedding_backward(ctx, dtable, ids, dout);
    return host(ctx, dtable);
  });
  Tensor dtable_cpu = randn({V, D}, "dtable0");
  embedding_backward(kCpu, dtable_cpu, ids_tensor(id_values), randn({T, D}, "dout", 3.0f));
  check_close(got, dtable_cpu, 0.0f, 0.0f);  // and the CPU's order too
  ctx.destroy();
}

TEST_CASE("CUDA rmsnorm matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 37, D = 300;
  Tensor x = randn({T, D}, "x"), w = randn({D}, "w"), dy = randn({T, D}, "dy");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  Tensor dx = randn({T, D}, "dx0"), dw = randn({D}, "dw0");  // nonzero: both accumulate
  Tensor g_x = gpu(x), g_w = gpu(w), g_dy = gpu(dy), g_y = gpu(y), g_rstd = gpu(rstd);
  Tensor g_dx = gpu(dx), g_dw = gpu(dw);
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  rmsnorm_forward(ctx, g_y, g_rstd, g_x, g_w, 1e-5f);
  // Row sums of 300 terms in a tree instead of a line, plus FMA: a few 1e-6 relative.
  check_close(host(ctx, g_y), y, 1e-5f, 1e-5f);
  check_close(host(ctx, g_rstd), rstd, 1e-5f, 0.0f);
  rmsnorm_backward(kCpu, dx, dw, dy, x, w, rstd);
  rmsnorm_backward(ctx, g_dx, g_dw, g_dy, g_x, g_w, g_rstd);
  check_close(host(ctx, g_dx), dx, 1e-4f, 1e-5f);
  check_close(host(ctx, g_dw), dw, 1e-4f, 1e-4f);  // 37-term column sums, same order (but FMA)
  for (DType half : {DType::BF16, DType::F16}) {   // the output in mixed precision's format
    INFO(dtype_name(half));
    Tensor y16 = empty({T, D}, Mem::Activations, Device::CPU, half);
    rmsnorm_forward(kCpu, y16, rstd, x, w, 1e-5f);
    Tensor g_y16 = to_device(y16, Device::CUDA, Mem::Activations);
    rmsnorm_forward(ctx, g_y16, g_rstd, g_x, g_w, 1e-5f);
    ctx.synchronize();
    // fp32 values within 1e-5 of each other, each rounded once: the CPU's 16-bit value or its
    // neighbour (one unit of the format's last place: 2^-8 of the value for bf16, 2^-11 fp16).
    Tensor wide = empty({T, D}, Mem::Workspace), g_wide = clone(wide);
    cast_(wide, y16);
    cast_(g_wide, to_device(g_y16, Device::CPU, Mem::Workspace));
    check_close(to_host_floats(g_wide), wide, half == DType::BF16 ? 8e-3f : 1e-3f, 1e-6f);
    // The weight's compute copy read as it is stored: the fp32 path's tolerances above, against
    // the CPU on the same (widened) values.
    Tensor w16 = empty({D}, Mem::Params, Device::CPU, half), w_wide = clone(w);
    cast_(kCpu, w16, w), cast_(kCpu, w_wide, w16);
    Tensor g_w16 = to_device(w16, Device::CUDA, Mem::Params);
    Tensor y_w = empty({T, D}, Mem::Activations), rstd_w = clone(rstd);
    Tensor dx_w = randn({T, D}, "dx1"), dw_w = randn({D}, "dw1");
    Tensor g_y_w = gpu(y_w), g_dx_w = gpu(dx_w), g_dw_w = gpu(dw_w);
    rmsnorm_forward(kCpu, y_w, rstd_w, x, w_wide, 1e-5f);
    rmsnorm_forward(ctx, g_y_w, g_rstd, g_x, g_w16, 1e-5f);
    check_close(host(ctx, g_y_w), y_w, 1e-5f, 1e-5f);
    rmsnorm_backward(kCpu, dx_w, dw_w, dy, x, w_wide, rstd_w);
    rmsnorm_backward(ctx, g_dx_w, g_dw_w, g_dy, g_x, g_w16, g_rstd);
    check_close(host(ctx, g_dx_w), dx_w, 1e-4f, 1e-5f);
    check_close(host(ctx, g_dw_w), dw_w, 1e-4f, 1e-4f);
  }
  ctx.destroy();
}

TEST_CASE("CUDA rmsnorm weight gradient over many row blocks: deterministic, close to CPU",
          "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 1000, D = 300;  // 32 row blocks of the two-stage column sum, the last partial
  Tensor x = randn({T, D}, "x"), w = randn({D}, "w"), dy = randn({T, D}, "dy");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  Tensor dx = zeros({T, D}, Mem::Activations), dw = randn({D}, "dw0");
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  Tensor g_x = gpu(x), g_w = gpu(w), g_dy = gpu(dy), g_rstd = gpu(rstd);
  std::vector<float> got = same_twice([&] {
    Tensor g_dx = gpu(dx), g_dw = gpu(dw);
    rmsnorm_backward(ctx, g_dx, g_dw, g_dy, g_x, g_w, g_rstd);
    return host(ctx, g_dw);
  });
  rmsnorm_backward(kCpu, dx, dw, dy, x, w, rstd);
  // 1000-term column sums of N(0,1)-sized terms (|sum| ~ 30) in chunks of 32 instead of one
  // line: fp32 rounding of ~1000 additions, about 1e-5 of the terms' scale.
  check_close(got, dw, 1e-4f, 1e-3f);
  ctx.destroy();
}

// The fused kernels against the unfused CUDA ops they replace (the same arithmetic in the same
// order: bit for bit) and the CPU reference (the tolerances of the unfused ops' tests above).
TEST_CASE("CUDA residual_rmsnorm_forward equals the residual add then the norm", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 37, D = 300;
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  for (DType format : {DType::F32, DType::BF16}) {
    INFO(dtype_name(format));
    Tensor b_f = empty({T, D}, Mem::Activations, Device::CPU, format);
    Tensor w_f = empty({D}, Mem::Params, Device::CPU, format);
    cast_(kCpu, b_f, b), cast_(kCpu, w_f, w);
    Tensor g_a = gpu(a), g_b = to_device(b_f, Device::CUDA, Mem::Activations);
    Tensor g_w = to_device(w_f, Device::CUDA, Mem::Params);
    auto outputs = [&] {
      return std::vector<Tensor>{empty({T, D}, Mem::Activations, Device::CUDA),
                                 empty({T, D}, Mem::Activations, Device::CUDA, format),
                                 empty({T}, Mem::Activations, Device::CUDA)};
    };
    std::vector<Tensor> fused = outputs(), apart = outputs();
    residual_rmsnorm_forward(ctx, fused[0], fused[1], fused[2], g_a, g_b, g_w, 1e-5f);
    residual_forward(ctx, apart[0], g_a, g_b);
    rmsnorm_forward(ctx, apart[1], apart[2], apart[0], g_w, 1e-5f);
    ctx.synchronize();
    for (int i = 0; i < 3; i++) {
      Tensor got = to_device(fused[i], Device::CPU, Mem::Workspace);
      Tensor want = to_device(apart[i], Device::CPU, Mem::Workspace);
      CHECK(memcmp(got.ptr, want.ptr, got.nbytes()) == 0);
    }
    Tensor sum = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
    Tensor y = empty({T, D}, Mem::Activations, Device::CPU, format);
    residual_rmsnorm_forward(kCpu, sum, y, rstd, a, b_f, w_f, 1e-5f);
    check_close(host(ctx, fused[0]), sum, 0.0f, 0.0f);  // one fp32 addition, exact both sides
    check_close(host(ctx, fused[2]), rstd, 1e-5f, 0.0f);
  }
  ctx.destroy();
}

TEST_CASE("CUDA residual_layernorm_forward equals the residual add then the norm", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 37, D = 300;
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  Tensor bias = randn({D}, "bias");
  for (DType format : {DType::F32, DType::BF16}) {
    INFO(dtype_name(format));
    Tensor b_f = empty({T, D}, Mem::Activations, Device::CPU, format);
    Tensor w_f = empty({D}, Mem::Params, Device::CPU, format), bias_f = clone(w_f);
    cast_(kCpu, b_f, b), cast_(kCpu, w_f, w), cast_(kCpu, bias_f, bias);
    Tensor g_a = gpu(a), g_b = to_device(b_f, Device::CUDA, Mem::Activations);
    Tensor g_w = to_device(w_f, Device::CUDA, Mem::Params);
    Tensor g_bias = to_device(bias_f, Device::CUDA, Mem::Params);
    auto outputs = [&] {
      return std::vector<Tensor>{empty({T, D}, Mem::Activations, Device::CUDA),
                                 empty({T, D}, Mem::Activations, Device::CUDA, format),
                                 empty({T, 2}, Mem::Activations, Device::CUDA)};
    };
    std::vector<Tensor> fused = outputs(), apart = outputs();
    residual_layernorm_forward(ctx, fused[0], fused[1], fused[2], g_a, g_b, g_w, g_bias, 1e-5f);
    residual_forward(ctx, apart[0], g_a, g_b);
    layernorm_forward(ctx, apart[1], apart[2], apart[0], g_w, g_bias, 1e-5f);
    ctx.synchronize();
    for (int i = 0; i < 3; i++) {
      Tensor got = to_device(fused[i], Device::CPU, Mem::Workspace);
      Tensor want = to_device(apart[i], Device::CPU, Mem::Workspace);
      CHECK(memcmp(got.ptr, want.ptr, got.nbytes()) == 0);
    }
    Tensor sum = empty({T, D}, Mem::Activations), stats = empty({T, 2}, Mem::Activations);
    Tensor y = empty({T, D}, Mem::Activations, Device::CPU, format);
    residual_layernorm_forward(kCpu, sum, y, stats, a, b_f, w_f, bias_f, 1e-5f);
    check_close(host(ctx, fused[0]), sum, 0.0f, 0.0f);      // one fp32 addition, exact both sides
    check_close(host(ctx, fused[2]), stats, 1e-5f, 1e-6f);  // as the unfused LayerNorm's test
  }
  ctx.destroy();
}

// The 16-bit residual stream's kernels against the CPU loops: a sum is one fp32 addition then
// one rounding on both sides (bit for bit); the norm's outputs and the gradient differ only by
// the order of the row's reductions (rstd and the backward's dot: 1e-5 relative in fp32), which
// can move a 16-bit value across a rounding boundary: one unit of its last place (2^-7 for bf16,
// 2^-10 for fp16, relative) at most.
TEST_CASE("CUDA norms and adds on a 16-bit residual stream match the CPU's", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 70, D = 300;  // three row blocks of the weight gradient's column sums
  Tensor a = randn({T, D}, "a", 2.0f), b = randn({T, D}, "b"), w = randn({D}, "w");
  Tensor dy = randn({T, D}, "dy"), dx0 = randn({T, D}, "dx0", 1e-2f);
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    const float ulp = half == DType::BF16 ? std::ldexp(1.0f, -7) : std::ldexp(1.0f, -10);
    auto in_half = [&](const Tensor& t, Device d) {
      Tensor h = empty(t.shape, Mem::Activations, Device::CPU, half);
      cast_(kCpu, h, t);
      return d == Device::CPU ? h : to_device(h, Device::CUDA, Mem::Activations);
    };
    auto wide_on_host = [&](const Tensor& t) {
      Tensor h = to_device(t, Device::CPU, Mem::Workspace), f = empty(t.shape, Mem::Workspace);
      cast_(kCpu, f, h);
      return f;
    };
    Tensor a16 = in_half(a, Device::CPU), g_a16 = in_half(a, Device::CUDA), g_b = gpu(b);
    Tensor g_w = gpu(w);
    Tensor sum16 = empty({T, D}, Mem::Activations, Device::CPU, half), y = clone(sum16);
    Tensor rstd = empty({T}, Mem::Activations);
    residual_rmsnorm_forward(kCpu, sum16, y, rstd, a16, b, w, 1e-5f);
    Tensor g_sum = empty({T, D}, Mem::Activations, Device::CUDA, half);
    Tensor g_y = empty({T, D}, Mem::Activations, Device::CUDA, half);
    Tensor g_rstd = empty({T}, Mem::Activations, Device::CUDA);
    Tensor g_out = empty({T, D}, Mem::Activations, Device::CUDA, half);
    residual_rmsnorm_forward(ctx, g_sum, g_y, g_rstd, g_a16, g_b, g_w, 1e-5f);
    residual_forward(ctx, g_out, g_a16, g_b);
    ctx.synchronize();
    Tensor got_sum = to_device(g_sum, Device::CPU, Mem::Workspace);
    Tensor got_out = to_device(g_out, Device::CPU, Mem::Workspace);
    CHECK(memcmp(got_sum.ptr, sum16.ptr, sum16.nbytes()) == 0);
    CHECK(memcmp(got_out.ptr, sum16.ptr, sum16.nbytes()) == 0);
    check_close(host(ctx, g_rstd), rstd, 1e-5f, 0.0f);
    check_close(to_host_floats(wide_on_host(g_y)), wide_on_host(y), ulp, 1e-6f);
    // The norm alone on the stored stream.
    Tensor g_y2 = empty({T, D}, Mem::Activations, Device::CUDA, half);
    rmsnorm_forward(ctx, g_y2, g_rstd, g_sum, g_w, 1e-5f);
    check_close(to_host_floats(wide_on_host(g_y2)), wide_on_host(y), ulp, 1e-6f);
    // The backward into a 16-bit dx, with a bf16 dy as the linear layers write it.
    Tensor dx16 = in_half(dx0, Device::CPU), g_dx16 = in_half(dx0, Device::CUDA);
    Tensor dw = zeros({D}, Mem::Grads), g_dw = gpu(dw), g_dy = gpu(dy), g_rstd_cpu = gpu(rstd);
    rmsnorm_backward(kCpu, dx16, dw, dy, sum16, w, rstd);
    rmsnorm_backward(ctx, g_dx16, g_dw, g_dy, g_sum, g_w, g_rstd_cpu);
    // dx: within a unit of the last place of the larger of itself and the step it took (2e-2
    // absolute covers a value that is the sum of two of opposite signs)
    check_close(to_host_floats(wide_on_host(g_dx16)), wide_on_host(dx16), ulp, 2e-2f * ulp);
    check_close(host(ctx, g_dw), dw, 1e-4f, 1e-5f);  // column sums of 70 rows, orders differ
  }
  ctx.destroy();
}

TEST_CASE("CUDA norm backwards' rounded copy is their dx rounded once", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 70, D = 300;  // three row blocks of the column sum, the last partial
  Tensor x = randn({T, D}, "x"), w = randn({D}, "w"), b = randn({D}, "b"), dy = randn({T, D}, "dy");
  Tensor y = empty({T, D}, Mem::Activations), rstd = empty({T}, Mem::Activations);
  Tensor stats = empty({T, 2}, Mem::Activations);
  rmsnorm_forward(kCpu, y, rstd, x, w, 1e-5f);
  layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
  Tensor g_x = gpu(x), g_w = gpu(w), g_dy = gpu(dy), g_rstd = gpu(rstd), g_stats = gpu(stats);
  for (bool layer_norm : {false, true}) {
    INFO("norm: " << (layer_norm ? "layernorm" : "rmsnorm"));
    auto backward = [&](const Tensor& dx, const Tensor& dwb, const Tensor& rounded) {
      if (layer_norm)
        return layernorm_backward(ctx, dx, dwb.view(0, {D}), dwb.view(D, {D}), g_dy, g_x, g_w,
                                  g_stats, rounded);
      rmsnorm_backward(ctx, dx, dwb.view(0, {D}), g_dy, g_x, g_w, g_rstd, rounded);
    };
    Tensor g_dx = gpu(randn({T, D}, "dx0")), g_dwb = gpu(randn({2, D}, "dw0"));
    Tensor g_dx2 = gpu(randn({T, D}, "dx0")), g_dwb2 = gpu(randn({2, D}, "dw0"));
    Tensor rounded = empty({T, D}, Mem::Workspace, Device::CUDA, DType::BF16);
    Tensor want = empty({T, D}, Mem::Workspace, Device::CUDA, DType::BF16);
    backward(g_dx, g_dwb, Tensor());
    backward(g_dx2, g_dwb2, rounded);
    cast_(ctx, want, g_dx);
    ctx.synchronize();
    check_close(host(ctx, g_dx2), to_device(g_dx, Device::CPU, Mem::Workspace), 0.0f, 0.0f);
    check_close(host(ctx, g_dwb2), to_device(g_dwb, Device::CPU, Mem::Workspace), 0.0f, 0.0f);
    Tensor got16 = to_device(rounded, Device::CPU, Mem::Workspace);
    Tensor want16 = to_device(want, Device::CPU, Mem::Workspace);
    CHECK(memcmp(got16.ptr, want16.ptr, got16.nbytes()) == 0);
  }
  ctx.destroy();
}

TEST_CASE("CUDA rope on q and k (and dv rounded) in one launch equals a launch each", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 33, Hq = 4, Hk = 2, hd = 64;
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; t++) pos[t] = 3 * t;
  Tensor g_positions = gpu(ids_tensor(pos));
  Tensor q = gpu(randn({T, Hq, hd}, "q")), k = gpu(randn({T, Hk, hd}, "k"));
  Tensor q1 = gpu(randn({T, Hq, hd}, "q")), k1 = gpu(randn({T, Hk, hd}, "k"));
  rope_forward(ctx, q, k, g_positions, 10000.0f);
  rope_forward(ctx, q1, g_positions, 10000.0f), rope_forward(ctx, k1, g_positions, 10000.0f);
  Tensor into_q = empty({T, Hq, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor into_k = empty({T, Hk, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor into_q1 = empty({T, Hq, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor into_k1 = empty({T, Hk, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor dv = gpu(randn({T, Hk, hd}, "dv"));
  Tensor into_v = empty({T, Hk, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor into_v1 = empty({T, Hk, hd}, Mem::Workspace, Device::CUDA, DType::BF16);
  rope_backward(ctx, q, k, g_positions, 10000.0f, into_q, into_k, dv, into_v);
  rope_backward(ctx, q1, g_positions, 10000.0f, into_q1);
  rope_backward(ctx, k1, g_positions, 10000.0f, into_k1);
  cast_(ctx, into_v1, dv);  // v's gradient: rounded, not rotated
  ctx.synchronize();
  const std::vector<std::pair<Tensor, Tensor>> pairs = {
      {q, q1}, {k, k1}, {into_q, into_q1}, {into_k, into_k1}, {into_v, into_v1}};
  for (const auto& [got, want] : pairs) {
    Tensor g = to_device(got, Device::CPU, Mem::Workspace);
    Tensor w = to_device(want, Device::CPU, Mem::Workspace);
    CHECK(memcmp(g.ptr, w.ptr, g.nbytes()) == 0);
  }
  ctx.destroy();
}

TEST_CASE("CUDA rope matches the CPU reference, at long positions too", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 33, H = 3, hd = 64;
  // Angles up to 96 rad, then positions just below 128k, where an angle's error grows with the
  // position: a frequency off by 4 ulp would turn pair 1 by ~0.03 rad too far there.
  for (int32_t start : {0, 131072 - 3 * T}) {
    INFO("positions from " << start);
    std::vector<int32_t> pos(T);
    for (int t = 0; t < T; t++) pos[t] = start + 3 * t;
    Tensor x = randn({T, H, hd}, "x"), positions = ids_tensor(pos);
    Tensor g_x = gpu(x), g_positions = gpu(positions);
    rope_forward(kCpu, x, positions, 10000.0f);
    rope_forward(ctx, g_x, g_positions, 10000.0f);
    // Both read one table of frequencies, so the angles are the same floats; CUDA's sinf and
    // cosf and glibc's may differ by 2 ulp (<= 1.2e-7 for values <= 1), and a product may be
    // fused on the device: for |x| < 5 an output moves by < 2e-6. A wrong index, sign or
    // frequency shows up as an error of 1e-3 or more.
    check_close(host(ctx, g_x), x, 0.0f, 4e-6f);
    rope_backward(kCpu, x, positions, 10000.0f);
    rope_backward(ctx, g_x, g_positions, 10000.0f);
    check_close(host(ctx, g_x), x, 0.0f, 8e-6f);  // two rotations' worth
  }
  ctx.destroy();
}

TEST_CASE("CUDA rope on bf16 and fp16 matches the CPU's, within one unit of the last place",
          "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 33, H = 3, hd = 64;
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; t++) pos[t] = 3 * t;
  Tensor positions = ids_tensor(pos), g_positions = gpu(positions);
  for (DType half : {DType::BF16, DType::F16}) {
    INFO(dtype_name(half));
    Tensor x = randn({T, H, hd}, "x"), x16 = empty({T, H, hd}, Mem::Activations, Device::CPU, half);
    cast_(kCpu, x16, x);
    Tensor g16 = empty({T, H, hd}, Mem::Activations, Device::CUDA, half);
    copy_(g16, x16);
    rope_forward(kCpu, x16, positions, 10000.0f);
    rope_forward(ctx, g16, g_positions, 10000.0f);
    Tensor back = clone(x16), want = empty({T, H, hd}, Mem::Activations);
    copy_(back, g16);
    Tensor got = clone(want);
    cast_(kCpu, got, back), cast_(kCpu, want, x16);
    // The fp32 rotations differ by a few ulp (the test above); rounded to the format, a value
    // near a rounding boundary may land one unit apart: 2^-7 (bf16) of |x| < 4, plus that.
    check_close(to_host_floats(got), want, 8e-3f, 2e-4f);
    // The backward from fp32 into the format (RoPE's dq and dk for the projections' GEMMs).
    Tensor dx = randn({T, H, hd}, "dx"), into = clone(x16), g_into = gpu(into), g_dx = gpu(dx);
    rope_backward(kCpu, dx, positions, 10000.0f, into);
    rope_backward(ctx, g_dx, g_positions, 10000.0f, g_into);
    ctx.synchronize();
    Tensor back_into = clone(into);
    copy_(back_into, g_into);
    cast_(kCpu, got, back_into), cast_(kCpu, want, into);
    check_close(to_host_floats(got), want, 8e-3f, 2e-4f);  // as above
  }
  ctx.destroy();
}

TEST_CASE("CUDA swiglu matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int n = 1000;
  Tensor gate = randn({n}, "gate", 3.0f), up = randn({n}, "up"), dout = randn({n}, "dout");
  Tensor out = empty({n}, Mem::Activations), dgate = clone(out), dup = clone(out);
  Tensor g_gate = gpu(gate), g_up = gpu(up), g_dout = gpu(dout), g_out = gpu(out);
  Tensor g_dgate = gpu(dgate), g_dup = gpu(dup);
  swiglu_forward(kCpu, out, gate, up);
  swiglu_forward(ctx, g_out, g_gate, g_up);
  check_close(host(ctx, g_out), out, 1e-5f, 1e-6f);  // expf within 2 ulp, FMA
  swiglu_backward(kCpu, dgate, dup, dout, gate, up);
  swiglu_backward(ctx, g_dgate, g_dup, g_dout, g_gate, g_up);
  check_close(host(ctx, g_dgate), dgate, 1e-5f, 1e-6f);
  check_close(host(ctx, g_dup), dup, 1e-5f, 1e-6f);
  for (DType half : {DType::BF16, DType::F16}) {  // mixed precision's gate, up and output
    INFO(dtype_name(half));
    Tensor g16 = empty({n}, Mem::Activations, Device::CPU, half), u16 = clone(g16),
           out16 = clone(g16);
    cast_(kCpu, g16, gate), cast_(kCpu, u16, up);
    swiglu_forward(kCpu, out16, g16, u16);
    swiglu_backward(kCpu, dgate, dup, dout, g16, u16);
    Tensor gg16 = to_device(g16, Device::CUDA, Mem::Activations);
    Tensor gu16 = to_device(u16, Device::CUDA, Mem::Activations);
    Tensor gout16 = to_device(out16, Device::CUDA, Mem::Activations);
    swiglu_forward(ctx, gout16, gg16, gu16);
    swiglu_backward(ctx, g_dgate, g_dup, g_dout, gg16, gu16);
    // The fp32 values within 2 ulp (expf) round to the CPU's 16-bit value or its neighbour: one
    // unit of the format's last place (2^-8 of the value for bf16, 2^-11 for fp16).
    ctx.synchronize();
    Tensor wide = empty({n}, Mem::Workspace), g_wide = clone(wide);
    cast_(wide, out16);
    cast_(g_wide, to_device(gout16, Device::CPU, Mem::Workspace));
    check_close(to_host_floats(g_wide), wide, half == DType::BF16 ? 8e-3f : 1e-3f, 1e-6f);
    check_close(host(ctx, g_dgate), dgate, 1e-5f, 1e-6f);
    check_close(host(ctx, g_dup), dup, 1e-5f, 1e-6f);
    // The gradients stored in the format: the GPU's fp32 values (within 1e-5 of the CPU's)
    // rounded once, so the CPU's 16-bit value or a neighbour, as for the forward above.
    Tensor dout16 = clone(g16), dg16 = clone(g16), du16 = clone(g16);
    cast_(kCpu, dout16, dout);
    swiglu_backward(kCpu, dg16, du16, dout16, g16, u16);
    Tensor gdout16 = to_device(dout16, Device::CUDA, Mem::Workspace);
    Tensor gdg16 = to_device(dg16, Device::CUDA, Mem::Workspace);
    Tensor gdu16 = to_device(du16, Device::CUDA, Mem::Workspace);
    swiglu_backward(ctx, gdg16, gdu16, gdout16, gg16, gu16);
    ctx.synchronize();
    for (auto [c16, g16_] : {std::pair{&dg16, &gdg16}, {&du16, &gdu16}}) {
      cast_(wide, *c16);
      cast_(g_wide, to_device(*g16_, Device::CPU, Mem::Workspace));
      check_close(to_host_floats(g_wide), wide, half == DType::BF16 ? 8e-3f : 1e-3f, 1e-6f);
    }
  }
  ctx.destroy();
}

// LayerNorm's row sums in a tree instead of a line (and FMA): RMSNorm's tolerances; dw and db
// from partials per block of rows, summed in block order.
TEST_CASE("CUDA layernorm matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 77, D = 300;  // 3 blocks of kDwRows rows, the last partial
  Tensor x = randn({T, D}, "x", 2.0f), w = randn({D}, "w"), b = randn({D}, "b");
  Tensor dy = randn({T, D}, "dy"), y = empty({T, D}, Mem::Activations);
  Tensor stats = empty({T, 2}, Mem::Activations);
  Tensor dx = randn({T, D}, "dx0"), dw = randn({D}, "dw0"), db = randn({D}, "db0");  // +=
  Tensor g_x = gpu(x), g_w = gpu(w), g_b = gpu(b), g_dy = gpu(dy), g_y = gpu(y);
  Tensor g_stats = gpu(stats), g_dx = gpu(dx), g_dw = gpu(dw), g_db = gpu(db);
  layernorm_forward(kCpu, y, stats, x, w, b, 1e-5f);
  layernorm_forward(ctx, g_y, g_stats, g_x, g_w, g_b, 1e-5f);
  check_close(host(ctx, g_y), y, 1e-5f, 1e-5f);
  check_close(host(ctx, g_stats), stats, 1e-5f, 1e-6f);
  layernorm_backward(kCpu, dx, dw, db, dy, x, w, stats);
  layernorm_backward(ctx, g_dx, g_dw, g_db, g_dy, g_x, g_w, g_stats);
  check_close(host(ctx, g_dx), dx, 1e-4f, 1e-5f);
  check_close(host(ctx, g_dw), dw, 1e-4f, 1e-4f);
  check_close(host(ctx, g_db), db, 1e-4f, 1e-4f);
  ctx.destroy();
}

TEST_CASE("CUDA gelu matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int n = 1000;
  Tensor x = randn({n}, "x", 3.0f), dout = randn({n}, "dout");
  Tensor y = empty({n}, Mem::Activations), dx = clone(y);
  Tensor g_x = gpu(x), g_dout = gpu(dout), g_y = gpu(y), g_dx = gpu(dx);
  gelu_forward(kCpu, y, x);
  gelu_forward(ctx, g_y, g_x);
  check_close(host(ctx, g_y), y, 1e-5f, 1e-6f);  // tanhf within 2 ulp, FMA
  gelu_backward(kCpu, dx, dout, x);
  gelu_backward(ctx, g_dx, g_dout, g_x);
  check_close(host(ctx, g_dx), dx, 1e-5f, 1e-6f);
  ctx.destroy();
}

// The masks are integer hashes: the device draws the CPU's, bit for bit, and the kept values
// are the same single fp32 product.
TEST_CASE("CUDA dropout draws the CPU's masks and values, bit for bit", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int B = 2, H = 3, T = 37, D = 129;
  const DropoutSite site{5, 2, 1, 0.1f};
  std::vector<int32_t> s, p;
  for (int i = 0; i < B * T; i++) s.push_back(40 + i / T), p.push_back(i % T);
  Tensor sequences = ids_tensor(s), positions = ids_tensor(p);
  Tensor g_sequences = to_device(sequences, Device::CUDA, Mem::Activations);
  Tensor g_positions = to_device(positions, Device::CUDA, Mem::Activations);
  auto u8 = [](std::vector<int64_t> shape) {
    return empty(std::move(shape), Mem::Activations, Device::CPU, DType::U8);
  };
  auto same_on_host = [&](const Tensor& g, const Tensor& c) {
    ctx.synchronize();
    return same_bytes(to_device(g, Device::CPU, Mem::Activations), c);
  };
  Tensor x = randn({B * T, D}, "x"), y = clone(x), mask = u8({B * T, D});
  Tensor g_x = gpu(x), g_y = gpu(y), g_mask = gpu(mask);
  dropout_forward(kCpu, y, mask, x, site, sequences, positions, 0);
  dropout_forward(ctx, g_y, g_mask, g_x, site, g_sequences, g_positions, 0);
  CHECK(same_on_host(g_mask, mask));
  CHECK(same_on_host(g_y, y));
  Tensor dx = clone(x), g_dx = gpu(dx);
  dropout_backward(kCpu, dx, x, mask, site.p);
  dropout_backward(ctx, g_dx, g_x, g_mask, site.p);
  CHECK(same_on_host(g_dx, dx));
  Tensor probs = randn({B, H, T, T}, "probs"), dropped = clone(probs), pmask = u8({B, H, T, T});
  Tensor g_probs = gpu(probs), g_dropped = gpu(dropped), g_pmask = gpu(pmask);
  dropout_attention_forward(kCpu, dropped, pmask, probs, site, sequences, positions, 1);
  dropout_attention_forward(ctx, g_dropped, g_pmask, g_probs, site, g_sequences, g_positions, 1);
  CHECK(same_on_host(g_pmask, pmask));
  CHECK(same_on_host(g_dropped, dropped));
  ctx.destroy();
}

TEST_CASE("CUDA residual, axpy and scale_ match the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int n = 1001;
  Tensor a = randn({n}, "a"), b = randn({n}, "b"), out = empty({n}, Mem::Activations);
  Tensor g_a = gpu(a), g_b = gpu(b), g_out = gpu(out);
  residual_forward(kCpu, out, a, b);
  residual_forward(ctx, g_out, g_a, g_b);
  axpy(kCpu, out, 0.3f, b);
  axpy(ctx, g_out, 0.3f, g_b);
  scale_(kCpu, out, -1.7f);
  scale_(ctx, g_out, -1.7f);
  check_close(host(ctx, g_out), out, 1e-6f, 1e-6f);  // FMA in axpy: one rounding fewer
  // A bf16 branch (a projection's output on one tp rank), read widened: one fp32 add, exact.
  Tensor b16 = empty({n}, Mem::Activations, Device::CPU, DType::BF16);
  cast_(kCpu, b16, b);
  Tensor g_b16 = to_device(b16, Device::CUDA, Mem::Activations);
  residual_forward(kCpu, out, a, b16);
  residual_forward(ctx, g_out, g_a, g_b16);
  check_close(host(ctx, g_out), out, 0.0f, 0.0f);
  ctx.destroy();
}

TEST_CASE("CUDA scale_rows and row_dots match the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int K = 37, D = 300;
  Tensor x = randn({K, D}, "x"), b = randn({K, D}, "b"), w = randn({K}, "w");
  Tensor y = empty({K, D}, Mem::Activations), d = empty({K}, Mem::Activations);
  Tensor g_x = gpu(x), g_b = gpu(b), g_w = gpu(w), g_y = gpu(y), g_d = gpu(d);
  scale_rows(kCpu, y, x, w);
  scale_rows(ctx, g_y, g_x, g_w);
  check_close(host(ctx, g_y), y, 0.0f, 0.0f);  // one product each: exact
  row_dots(kCpu, d, x, b);
  row_dots(ctx, g_d, g_x, g_b);
  // 300-term sums of products of unit normals (their magnitudes add to about 190, where fp32's
  // unit is 1.5e-5), in the CPU loop's order and regrouped over a warp's 32 lanes with fused
  // multiply-adds: the two differ by at most 6.1e-5 over 20,000 such rows (simulated in C++ on
  // the host), so 2e-4 absolute leaves a margin of 3; a lost lane or row is off by about 1.
  check_close(host(ctx, g_d), d, 1e-5f, 2e-4f);
  for (DType half : {DType::BF16, DType::F16}) {  // rows as a mixture's travel: widened, exact
    INFO(dtype_name(half));
    Tensor xh = empty({K, D}, Mem::Workspace, Device::CPU, half);
    cast_(kCpu, xh, x);
    Tensor g_xh = to_device(xh, Device::CUDA, Mem::Workspace);
    scale_rows(kCpu, y, xh, w);
    scale_rows(ctx, g_y, g_xh, g_w);
    check_close(host(ctx, g_y), y, 0.0f, 0.0f);
    row_dots(kCpu, d, b, xh);
    row_dots(ctx, g_d, g_b, g_xh);
    check_close(host(ctx, g_d), d, 1e-5f, 2e-4f);  // as the fp32 rows' sums
  }
  ctx.destroy();
}

TEST_CASE("CUDA cross-entropy matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int T = 19, V = 1000;
  std::vector<int32_t> target_values(T);
  for (int t = 0; t < T; t++) target_values[t] = (t * 131) % V;
  Tensor logits = randn({T, V}, "logits", 3.0f), targets = ids_tensor(target_values);
  Tensor losses = empty({T}, Mem::Activations), dlogits = empty({T, V}, Mem::Grads);
  Tensor g_logits = gpu(logits), g_targets = gpu(targets), g_losses = gpu(losses);
  cross_entropy_forward(kCpu, losses, logits, targets);
  cross_entropy_forward(ctx, g_losses, g_logits, g_targets);
  // Sums of 1000 exponentials in a different order: ~1e-6 relative in the log.
  check_close(host(ctx, g_losses), losses, 1e-5f, 1e-5f);
  cross_entropy_backward(kCpu, dlogits, logits, targets, 1.0f / T);
  cross_entropy_backward(ctx, g_logits, g_logits, g_targets, 1.0f / T);  // in place
  check_close(host(ctx, g_logits), dlogits, 1e-4f, 1e-8f);
  for (DType half : {DType::BF16, DType::F16}) {  // mixed precision's logits, and gradient
    INFO(dtype_name(half));
    Tensor l16 = empty({T, V}, Mem::Activations, Device::CPU, half);
    cast_(kCpu, l16, logits);
    Tensor stats = empty({T, 2}, Mem::Workspace);
    cross_entropy_forward(kCpu, losses, stats, l16, targets);
    Tensor g_l16 = to_device(l16, Device::CUDA, Mem::Activations);
    Tensor g_stats = gpu(stats);
    cross_entropy_forward(ctx, g_losses, g_stats, g_l16, g_targets);
    check_close(host(ctx, g_losses), losses, 1e-5f, 1e-5f);  // as above
    cross_entropy_backward(kCpu, l16, l16, stats, targets, 1.0f / T);
    cross_entropy_backward(ctx, g_l16, g_l16, g_stats, g_targets, 1.0f / T);
    ctx.synchronize();
    // The fp32 values within 1e-4 of each other, each rounded once: the same 16-bit value or
    // a neighbour, one unit of the format's last place (2^-8 of the value for bf16, 2^-11 for
    // fp16), plus fp16's subnormal spacing near zero.
    Tensor wide = empty({T, V}, Mem::Workspace), g_wide = clone(wide);
    cast_(wide, l16);
    cast_(g_wide, to_device(g_l16, Device::CPU, Mem::Workspace));
    check_close(to_host_floats(g_wide), wide, half == DType::BF16 ? 8e-3f : 1e-3f, 1e-7f);
  }
  ctx.destroy();
}

TEST_CASE("CUDA sum and sum_squares match the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  // From a single element to more blocks than the grid cap (4096 x 256).
  for (int64_t n : std::vector<int64_t>{1, 300, (1 << 20) + 7, 5000003}) {
    INFO("n = " << n);
    Tensor x = randn({n}, "x"), g_x = gpu(x);
    float abs_sum = 0.0f;
    for (int64_t i = 0; i < n; i++) abs_sum += std::fabs(x.f32()[i]);
    // Both sums are blocked or tree-shaped fp32: error well under 1e-5 of sum |x|.
    CHECK(std::fabs(sum(ctx, g_x) - sum(kCpu, x)) <= 1e-5f * abs_sum);
    float squares = sum_squares(kCpu, x);
    CHECK(sum_squares(ctx, g_x) == Approx(squares).epsilon(1e-5));
  }
  ctx.destroy();
}

// The GPU's AdamW state against the CPU's: fp32 arithmetic in another order of contraction
// (FMA) at most; and the bf16 compute copy written in the same kernel, the GPU's new weights
// rounded, bit for bit.
void check_adamw_on_gpu(const Context& ctx, const Tensor& g_p, const Tensor& g_m, const Tensor& g_v,
                        const Tensor& g_copy, const Tensor& p, const Tensor& m, const Tensor& v) {
  check_close(host(ctx, g_m), m, 1e-5f, 1e-7f);
  check_close(host(ctx, g_v), v, 1e-5f, 1e-7f);
  check_close(host(ctx, g_p), p, 1e-5f, 1e-6f);
  std::vector<float> gp = host(ctx, g_p);
  Tensor copy = zeros(g_copy.shape, Mem::Params, Device::CPU, DType::BF16);
  copy_(copy, g_copy);
  int64_t wrong = 0;
  for (size_t i = 0; i < gp.size(); i++)
    wrong += ((const uint16_t*)copy.ptr)[i] != float_to_bf16(gp[i]);
  CHECK(wrong == 0);
}

TEST_CASE("CUDA adamw matches the CPU reference", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  const int n = 777;
  Tensor p = randn({n}, "p"), m = zeros({n}, Mem::Optimizer), v = zeros({n}, Mem::Optimizer);
  Tensor g_p = gpu(p), g_m = gpu(m), g_v = gpu(v);
  Tensor g_copy = zeros({n}, Mem::Params, Device::CUDA, DType::BF16);
  AdamWConfig cfg;
  for (int step = 1; step <= 3; step++) {
    Tensor g = randn({n}, "g" + std::to_string(step)), g_g = gpu(g);
    adamw_update(kCpu, p.f32(), g.f32(), m.f32(), v.f32(), n, cfg, 1e-2f, 0.1f, step);
    adamw_update(ctx, g_p.f32(), g_g.f32(), g_m.f32(), g_v.f32(), n, cfg, 1e-2f, 0.1f, step,
                 g_copy);
    ctx.synchronize();  // g_g is freed at the end of the iteration
  }
  check_adamw_on_gpu(ctx, g_p, g_m, g_v, g_copy, p, m, v);
  ctx.destroy();
}

TEST_CASE("CUDA adamw_update_many matches the CPU's, its bf16 copies bit for bit", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  AdamWConfig cfg;
  const std::vector<int64_t> lengths = {1, 70000, 0, 4099, 33};  // 70000: many blocks
  int64_t total = 0;
  for (int64_t n : lengths) total += n;
  Tensor p = randn({total}, "p"), m = zeros({total}, Mem::Optimizer), v = clone(m);
  Tensor g_p = gpu(p), g_m = gpu(m), g_v = gpu(v);
  Tensor copy = zeros({total}, Mem::Params, Device::CPU, DType::BF16);
  Tensor g_copy = zeros({total}, Mem::Params, Device::CUDA, DType::BF16);
  for (int step = 1; step <= 3; step++) {
    Tensor g = randn({total}, "g" + std::to_string(step)), g_g = gpu(g);
    std::vector<AdamWSlice> cpu, cuda;
    int64_t at = 0;
    for (size_t j = 0; j < lengths.size(); j++) {
      const float wd = j % 2 ? 0.1f : 0.0f;
      cpu.push_back({p.f32() + at, g.f32() + at, m.f32() + at, v.f32() + at, lengths[j], wd,
                     (uint16_t*)copy.view(at, {lengths[j]}).ptr});
      cuda.push_back({g_p.f32() + at, g_g.f32() + at, g_m.f32() + at, g_v.f32() + at, lengths[j],
                      wd, (uint16_t*)g_copy.view(at, {lengths[j]}).ptr});
      at += lengths[j];
    }
    adamw_update_many(kCpu, cpu, cfg, 1e-2f, step);
    adamw_update_many(ctx, cuda, cfg, 1e-2f, step);
    ctx.synchronize();  // g_g is freed at the end of the iteration
  }
  check_adamw_on_gpu(ctx, g_p, g_m, g_v, g_copy, p, m, v);
  ctx.destroy();
}

TEST_CASE("CUDA sum_squares and scale_ (gradient clipping's two halves) match the CPU", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  Tensor grads = randn({5000}, "grads"), g_grads = gpu(grads);
  float norm = std::sqrt(sum_squares(kCpu, grads));
  CHECK(std::sqrt(sum_squares(ctx, g_grads)) == Approx(norm).epsilon(1e-5));
  scale_(kCpu, grads, 1.0f / norm);
  scale_(ctx, g_grads, 1.0f / norm);
  check_close(host(ctx, g_grads), grads, 1e-5f, 1e-7f);
  CHECK(std::sqrt(sum_squares(ctx, g_grads)) == Approx(1.0f).epsilon(1e-5));
  ctx.destroy();
}

TEST_CASE("CUDA sum_squares_each: every tensor's sum in one launch, as alone, bit for bit twice",
          "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  // Sizes from one element to past the 4096-block cap, and an empty tensor among them.
  std::vector<int64_t> sizes = {1, 300, 0, 4096 * 256 + 5, 70000, 257};
  std::vector<Tensor> cpu, gpus;
  for (size_t j = 0; j < sizes.size(); j++) {
    cpu.push_back(randn({sizes[j]}, "grad" + std::to_string(j)));
    gpus.push_back(gpu(cpu.back()));
  }
  uint64_t before = host_syncs();
  std::vector<float> got = same_twice([&] { return sum_squares_each(ctx, gpus); });
  CHECK(host_syncs() - before == 2);  // one host synchronisation per call
  std::vector<float> want = sum_squares_each(kCpu, cpu);
  REQUIRE(got.size() == want.size());
  for (size_t j = 0; j < sizes.size(); j++) {
    INFO("tensor " << j << " of " << sizes[j] << " elements");
    CHECK(got[j] == Approx(want[j]).epsilon(1e-5).margin(1e-30));
    // Among other tensors or alone, a tensor's sum is the same bits (its blocks are its own).
    float alone = sum_squares(ctx, gpus[j]);
    CHECK(memcmp(&alone, &got[j], sizeof(float)) == 0);
  }
  ctx.destroy();
}

// The losses left on the device (sum_later) are sum's bits there, read in one trip, in order;
// the device queue runs on meanwhile (nothing waits before read_total).
TEST_CASE("CUDA sums left pending equal sum's, bit for bit, read with one synchronisation",
          "[gpu]") {
  SKIP_WITHOUT_CUDA();
  Context ctx = Context::create(Device::CUDA);
  std::vector<Tensor> xs = {gpu(randn({300}, "l0")), gpu(randn({1}, "l1")),
                            gpu(randn({4096 * 256 + 5}, "l2"))};
  uint64_t before = host_syncs();
  std::vector<PendingSum> pending;
  for (const Tensor& x : xs) pending.push_back(sum_later(ctx, x));
  pending.push_back(PendingSum{});
  CHECK(host_syncs() - before == 0);
  const double got = read_total(ctx, pending);
  CHECK(host_syncs() - before == 1);
  double want = 0;
  for (const Tensor& x : xs) want += (double)sum(ctx, x);  // each alone: the same blocks, bits
  CHECK(memcmp(&got, &want, sizeof(double)) == 0);
  ctx.destroy();
}

TEST_CASE("CUDA init_normal and init_uniform draw the CPU's values on the device", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  // Uniform draws use exact operations only (an integer shift, one multiply and one add, kept
  // apart from FMA): bit for bit. Normal draws go through log and cos in double, where CUDA's
  // functions may differ from glibc's by an ulp or two (sqrt is exact on both). Rounded to fp32
  // that almost never shows: a float changes only when the double lies within a few double ulps
  // of a rounding boundary, about 1 in 10^8 draws. So every element must be within one float
  // ulp, and all but a handful bit for bit.
  struct Case {
    int64_t n, offset;
  };
  for (Case c : std::vector<Case>{{1, 0}, {1000, 12345}, {(1 << 20) + 3, 0}, {4099, 1ll << 33}}) {
    INFO("n = " << c.n << ", offset = " << c.offset);
    Tensor want = empty({c.n}, Mem::Params), got = empty({c.n}, Mem::Params, Device::CUDA);
    init_uniform(want, 3, "layers.0.w", -0.5f, 0.25f, c.offset);
    init_uniform(got, 3, "layers.0.w", -0.5f, 0.25f, c.offset);
    std::vector<float> u = to_host_floats(got);
    CHECK(memcmp(u.data(), want.f32(), c.n * sizeof(float)) == 0);

    init_normal(want, 3, "layers.0.w", 0.02f, c.offset);
    init_normal(got, 3, "layers.0.w", 0.02f, c.offset);
    std::vector<float> g = to_host_floats(got);
    int64_t differ = 0, beyond_one_ulp = 0;
    for (int64_t i = 0; i < c.n; i++) {
      float w = want.f32()[i];
      if (memcmp(&g[i], &w, sizeof(float)) == 0) continue;
      differ++;
      if (g[i] != std::nextafter(w, INFINITY) && g[i] != std::nextafter(w, -INFINITY))
        beyond_one_ulp++;
    }
    CHECK(beyond_one_ulp == 0);
    CHECK(differ <= 2);
  }
}
