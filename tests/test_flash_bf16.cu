// test_flash_bf16.cu: FlashAttention-2's bf16 kernels (kernels/flash_attention_bf16.cu) through
// their CPU mirrors. On the CPU: each mirror (the kernel's tiles, loop order and roundings in
// plain loops) against attention by its definition in float64, within the error the mirror's
// bf16 roundings allow, element by element. On a GPU: each kernel against its mirror. Head dims
// 64 and 128 (and 16, 32), causal and not, GQA and MQA, sizes that are not multiples of any
// tile, query and key offsets (ring attention's blocks), rows that see no key.
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "cuda_case.cuh"
#include "flash_attention.cuh"
#include "kernels/attention_naive.cuh"
#include "kernels/flash_attention_bf16.cuh"
#include "reference.cuh"
#include "runtime/dtype.cuh"

namespace {

// ----------------------------------------------------------------------------
// Attention of one block by its definition, in float64, and for every output element the sum of
// the magnitudes of its terms: what a rounding of each term (P, dS to bf16) scales with.
//   out_i = sum_j p_ij v_j                    |out|_i = sum_j p_ij |v_j|
//   dv_j = sum_i p_ij dO_i                    |dv|_j = sum_i p_ij |dO_i|
//   dk_j = scale sum_i ds_ij q_i              |dk|_j = scale sum_i |ds_ij| |q_i|
//   dq_i = scale sum_j ds_ij k_j              |dq|_i = scale sum_j |ds_ij| |k_j|
// with ds_ij = p_ij (dp_ij - D_i). dp_ij - D_i cancels: an fp32 error in dp (a sum of hd terms)
// or in D is relative to G_ij = p_ij (sum_d |dO_id v_jd| + |D_i|), not to |ds_ij|, so dk and dq
// also get scale sum_i G_ij |q_i| and scale sum_j G_ij |k_j| (the _cancel magnitudes).
// Under dropout (a.drop on) p_ij meets v_j and dO_i as f_ij p_ij (f: 1/(1-p) kept, 0 dropped), and
// dp_ij = f_ij dO_i . v_j: the chain rule through that product.
struct Exact {
  std::vector<double> out, lse, D, dq, dk, dv;
  std::vector<double> out_mag, dq_mag, dk_mag, dv_mag, dq_cancel, dk_cancel;
};
Exact attention64(const std::vector<float>& q, const std::vector<float>& k,
                  const std::vector<float>& v, const std::vector<float>& dout,
                  const AttentionBlock& a) {
  const int hd = a.hd, group = a.Hq / a.Hkv;
  const double scale = 1.0 / std::sqrt((double)hd);
  Exact r;
  r.out.assign(q.size(), 0.0), r.out_mag.assign(q.size(), 0.0);
  r.dq.assign(q.size(), 0.0), r.dq_mag.assign(q.size(), 0.0), r.dq_cancel.assign(q.size(), 0.0);
  r.dk.assign(k.size(), 0.0), r.dk_mag.assign(k.size(), 0.0), r.dk_cancel.assign(k.size(), 0.0);
  r.dv.assign(v.size(), 0.0), r.dv_mag.assign(v.size(), 0.0);
  r.lse.assign((size_t)a.B * a.Hq * a.Tq, -INFINITY), r.D.assign(r.lse.size(), 0.0);
  std::vector<double> p(a.Tk), dp(a.Tk), dp_mag(a.Tk), f(a.Tk);
  for (int b = 0; b < a.B; b++)
    for (int h = 0; h < a.Hq; h++)
      for (int i = 0; i < a.Tq; i++) {
        const size_t qo = (((size_t)b * a.Tq + i) * a.Hq + h) * hd,
                     st = ((size_t)b * a.Hq + h) * a.Tq + i;
        auto ko = [&](int j) { return (((size_t)b * a.Tk + j) * a.Hkv + h / group) * hd; };
        int seen = 0;  // keys 0 .. seen-1 are visible
        while (seen < a.Tk && (!a.causal || a.k0 + seen <= a.q0 + i)) seen++;
        if (seen == 0) continue;  // out 0, lse -inf, no gradient
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < seen; j++) {
          double dot = 0.0;
          for (int d = 0; d < hd; d++) dot += (double)q[qo + d] * k[ko(j) + d];
          p[j] = scale * dot;
          m = std::max(m, p[j]);
        }
        for (int j = 0; j < seen; j++) sum += (p[j] = std::exp(p[j] - m));
        r.lse[st] = m + std::log(sum);
        double D = 0.0;
        for (int j = 0; j < seen; j++) {
          p[j] /= sum;
          f[j] = a.drop.on() ? a.drop.factor(b, h, a.q0 + i, a.k0 + j) : 1.0;
          dp[j] = dp_mag[j] = 0.0;
          for (int d = 0; d < hd; d++) {
            r.out[qo + d] += f[j] * p[j] * v[ko(j) + d];
            r.out_mag[qo + d] += f[j] * p[j] * std::abs(v[ko(j) + d]);
            dp[j] += (double)dout[qo + d] * v[ko(j) + d];
            dp_mag[j] += std::abs((double)dout[qo + d] * v[ko(j) + d]);
          }
          dp[j] *= f[j], dp_mag[j] *= f[j];
          D += p[j] * dp[j];
        }
        r.D[st] = D;
        for (int j = 0; j < seen; j++) {
          const double ds = p[j] * (dp[j] - D), G = p[j] * (dp_mag[j] + std::abs(D));
          for (int d = 0; d < hd; d++) {
            r.dq[qo + d] += scale * ds * k[ko(j) + d];
            r.dq_mag[qo + d] += scale * std::abs(ds * k[ko(j) + d]);
            r.dq_cancel[qo + d] += scale * G * std::abs(k[ko(j) + d]);
            r.dk[ko(j) + d] += scale * ds * q[qo + d];
            r.dk_mag[ko(j) + d] += scale * std::abs(ds * q[qo + d]);
            r.dk_cancel[ko(j) + d] += scale * G * std::abs(q[qo + d]);
            r.dv[ko(j) + d] += f[j] * p[j] * dout[qo + d];
            r.dv_mag[ko(j) + d] += f[j] * p[j] * std::abs(dout[qo + d]);
          }
        }
      }
  return r;
}

// The allowed error of each element: rel of its magnitude, rel_cancel of its cancellation
// magnitude (dq, dk only), rel_value of its value, and 1e-6.
struct Bound {
  double rel, rel_cancel, rel_value;
};
// Every |got - want| within its bound, and the mean of |got - want| / (magnitude + |want| +
// 1e-6) at most `mean`: rounding errors of many terms mostly cancel, a systematic error (a
// rounding or a term the reference does not have) does not.
void check_elementwise(const char* what, const std::vector<float>& got,
                       const std::vector<double>& want, const std::vector<double>& magnitude,
                       const std::vector<double>* cancel, Bound bound, double mean) {
  REQUIRE(got.size() == want.size());
  size_t outside = 0, nans = 0, at = 0;
  double worst = 0.0, total = 0.0;
  for (size_t e = 0; e < got.size(); e++) {
    nans += std::isnan(got[e]);
    const double err = std::abs(got[e] - want[e]), size = magnitude[e] + std::abs(want[e]) + 1e-6;
    const double allowed = bound.rel * magnitude[e] + bound.rel_value * std::abs(want[e]) + 1e-6 +
                           (cancel ? bound.rel_cancel * (*cancel)[e] : 0.0);
    if (!(err <= allowed)) outside++;
    if (err / allowed > worst) worst = err / allowed, at = e;
    total += err / size;
  }
  const double mean_err = got.empty() ? 0.0 : total / got.size();
  INFO(what << ": " << outside << " of " << got.size() << " elements outside their bound; worst "
            << worst << " of its bound at element " << at << " (got " << got[at] << ", want "
            << want[at] << ", magnitude " << magnitude[at] << "); mean error " << mean_err
            << " of the magnitude, at most " << mean);
  // CHECK, not REQUIRE: every block and every tensor is reported in one run.
  CHECK(nans == 0);
  CHECK(outside == 0);
  CHECK(mean_err <= mean);
}
// lse: -inf exactly where no key is seen, else within tol (1 + |lse|).
void require_lse(const char* what, const std::vector<float>& got, const std::vector<double>& want,
                 double tol) {
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  for (size_t e = 0; e < got.size(); e++) {
    if (std::isinf(want[e]) || std::isinf(got[e])) {
      REQUIRE(got[e] == want[e]);
      continue;
    }
    worst = std::max(worst, std::abs(got[e] - want[e]) / (1.0 + std::abs(want[e])));
  }
  INFO(what << ": worst lse error " << worst << " of 1 + |lse|, tolerance " << tol);
  REQUIRE(worst <= tol);
}

std::vector<float> bf16_values(int64_t n, const std::string& name, double std = 1.0) {
  std::vector<float> x = reference_normal(n, name, 0.0, std);
  for (float& e : x) e = bf16_to_float(float_to_bf16(e));
  return x;
}
std::vector<float> as_float(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

std::string describe(const AttentionBlock& a) {
  return "B " + std::to_string(a.B) + " Tq " + std::to_string(a.Tq) + " Tk " +
         std::to_string(a.Tk) + " Hq " + std::to_string(a.Hq) + " Hkv " + std::to_string(a.Hkv) +
         " hd " + std::to_string(a.hd) + " q0 " + std::to_string(a.q0) + " k0 " +
         std::to_string(a.k0) + (a.causal ? " causal" : " full");
}

// Not multiples of the tiles (128 queries and 64 or 32 keys forward, 128 keys and 64 or 32
// queries backward); MHA, GQA, MQA; causal and not; offsets; rows and blocks that see nothing.
const AttentionBlock kBlocks[] = {
    {2, 200, 200, 4, 2, 64, 0, 0, true},       // GQA, the model's call
    {1, 300, 300, 2, 1, 128, 0, 0, true},      // MQA, hd 128, three partial tiles
    {2, 130, 77, 4, 4, 64, 0, 0, false},       // no mask, Tq != Tk
    {1, 150, 260, 4, 2, 128, 300, 100, true},  // queries [300, 450) against keys [100, 360)
    {2, 100, 200, 2, 1, 64, 0, 150, true},     // keys from 150: queries 0..149 see nothing
    {1, 70, 130, 2, 1, 128, 0, 200, true},     // every key in every query's future
    {1, 129, 129, 2, 2, 16, 0, 0, true},       // the small head dims the kernels also take
    {1, 65, 140, 2, 1, 32, 0, 0, false},
};

// The bounds, as fractions of the magnitudes above:
//   mirror against float64: P (and dS) rounded to bf16, relative 2^-8 each, plus 2^-8 for the
//   fp32 roundings of a score (a sum of hd products: its error changes P by at most 4e-4 at
//   q std 5, hd 128), of exp2 and of the sums: 2^-7. out is also rounded to bf16 itself: 2^-8
//   of its value. dp - D in fp32: hd 2^-24 of the cancellation magnitude at worst, 2^-12 allowed.
//   The mean error: at most 2^-10 (about 2^-12 measured here).
//   kernel against mirror: the same fp32 values summed in another order, so a P or dS may round
//   to the neighbouring bf16 (one ulp, at most 2^-7 relative) where it lies next to a rounding
//   boundary, and out likewise: 2^-7 + 2^-10 of the magnitude, 2^-7 of the value. Such flips
//   are rare, so the mean stays far below: at most 2^-11 (an H200 measured 2^-11.6 for dq of
//   the GQA causal block, whose many terms each may flip; a systematic difference, a rounding
//   the mirror does not make, is about 2^-9).
const Bound kMirrorBound{std::ldexp(1.0, -7), std::ldexp(1.0, -12), std::ldexp(1.0, -8)};
const double kMirrorMean = std::ldexp(1.0, -9);
const Bound kKernelBound{std::ldexp(1.0, -7) + std::ldexp(1.0, -10), std::ldexp(1.0, -12),
                         std::ldexp(1.0, -7)};
const double kKernelMean = std::ldexp(1.0, -11);

struct Inputs {
  std::vector<float> q, k, v, dout;
  Inputs(const AttentionBlock& a, double q_std) {
    q = bf16_values((int64_t)a.B * a.Tq * a.Hq * a.hd, "bf16 q", q_std);
    k = bf16_values((int64_t)a.B * a.Tk * a.Hkv * a.hd, "bf16 k");
    v = bf16_values((int64_t)a.B * a.Tk * a.Hkv * a.hd, "bf16 v");
    dout = bf16_values((int64_t)a.B * a.Tq * a.Hq * a.hd, "bf16 dout");
  }
};

// Both mirrors on one block against attention by definition in float64.
void require_mirrors_match_definition(const AttentionBlock& a, double q_std) {
  INFO(describe(a) << ", q std " << q_std);
  Inputs in(a, q_std);
  const Exact x = attention64(in.q, in.k, in.v, in.dout, a);
  std::vector<float> out(in.q.size()), lse(x.lse.size());
  flash_forward_bf16_cpu(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), a);
  check_elementwise("out", out, x.out, x.out_mag, nullptr, kMirrorBound, kMirrorMean);
  require_lse("lse", lse, x.lse, std::ldexp(1.0, -12));
  // The backward from the exact lse and D (the forward's are tested above): only its own
  // roundings count here.
  std::vector<float> dq(in.q.size(), 0.0f), dk(in.k.size(), 0.0f), dv(in.v.size(), 0.0f);
  const std::vector<float> lse_exact = as_float(x.lse), D_exact = as_float(x.D);
  flash_backward_bf16_cpu(dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(), in.k.data(),
                          in.v.data(), lse_exact.data(), D_exact.data(), a);
  check_elementwise("dq", dq, x.dq, x.dq_mag, &x.dq_cancel, kMirrorBound, kMirrorMean);
  check_elementwise("dk", dk, x.dk, x.dk_mag, &x.dk_cancel, kMirrorBound, kMirrorMean);
  check_elementwise("dv", dv, x.dv, x.dv_mag, nullptr, kMirrorBound, kMirrorMean);
}
// Dropout on the probabilities at p 0.3, drawn as FlashAttention draws it (AttentionDraw):
// sequences numbered 7 and 3 in the run (host or device memory, for the mirrors or the kernels).
AttentionBlock with_dropout(AttentionBlock a, const Tensor& sequences) {
  a.drop = AttentionDropout{DropoutSite{11, 1, 0, 0.3f}, sequences, Tensor(), 0}.draw(1);
  return a;
}
}  // namespace

TEST_CASE("FlashAttention-2's bf16 CPU mirrors match attention by definition within bf16's bounds",
          "[attention][flash]") {
  // q std 5: a peaked softmax whose row max moves from tile to tile (the rescaling at work).
  for (double q_std : {1.0, 5.0})
    for (const AttentionBlock& a : kBlocks) require_mirrors_match_definition(a, q_std);
}

// Under dropout the mirrors round F P and P (F dP - D) where they rounded P and dS: the same
// bounds, against the definition with the same factors.
TEST_CASE("FlashAttention-2's bf16 CPU mirrors under dropout match the masked definition",
          "[attention][flash]") {
  Context cpu = Context::create(Device::CPU);
  Tensor sequences = device_ints(cpu, {7, 3});
  for (const AttentionBlock& a : kBlocks)
    require_mirrors_match_definition(with_dropout(a, sequences), 1.0);
}

namespace {
Tensor cpu_tensor(const std::vector<float>& x) {
  Tensor t = empty({(int64_t)x.size()}, Mem::Workspace);
  if (!x.empty()) from_host(t, x.data());
  return t;
}
std::vector<double> wide(const Tensor& t) {
  std::vector<float> f = to_host_floats(t);
  return std::vector<double>(f.begin(), f.end());
}
}  // namespace

// The same mirrors against the existing references of the attention chapter, on the same bf16
// inputs: FlashAttention's fp32 CPU loop (flash_attention.cu) on every block, naive attention
// (kernels/attention_naive.cu) on the model's own square causal call. Their fp32 errors are
// ~1e-6 of the magnitudes, so the mirror's bf16 bounds hold against them as against float64.
TEST_CASE(
    "FlashAttention-2's bf16 CPU mirrors match the fp32 CPU FlashAttention and naive attention",
    "[attention][flash]") {
  Context cpu = Context::create(Device::CPU);
  for (const AttentionBlock& a : kBlocks) {
    INFO(describe(a));
    Inputs in(a, 1.0);
    const Exact x = attention64(in.q, in.k, in.v, in.dout, a);  // the magnitudes
    Tensor q = cpu_tensor(in.q), k = cpu_tensor(in.k), v = cpu_tensor(in.v);
    Tensor dout = cpu_tensor(in.dout), out = empty(q.shape, Mem::Workspace);
    Tensor lse = empty({(int64_t)x.lse.size()}, Mem::Workspace),
           D = empty(lse.shape, Mem::Workspace);
    Tensor dq = zeros(q.shape, Mem::Workspace), dk = zeros(k.shape, Mem::Workspace);
    Tensor dv = zeros(v.shape, Mem::Workspace);
    flash_attention_forward(cpu, out, lse, q, k, v, a);
    attention_out_dot_dout(cpu, D, dout, out, a);
    flash_attention_backward(cpu, dq, dk, dv, dout, q, k, v, lse, D, a);
    std::vector<float> m_out(in.q.size()), m_lse(x.lse.size());
    flash_forward_bf16_cpu(m_out.data(), m_lse.data(), in.q.data(), in.k.data(), in.v.data(), a);
    check_elementwise("out vs fp32 flash", m_out, wide(out), x.out_mag, nullptr, kMirrorBound,
                      kMirrorMean);
    require_lse("lse vs fp32 flash", m_lse, wide(lse), std::ldexp(1.0, -12));
    // The backward from the fp32 reference's own lse and D, given to both.
    std::vector<float> m_dq(in.q.size(), 0.0f), m_dk(in.k.size(), 0.0f), m_dv(in.v.size(), 0.0f);
    const std::vector<float> ref_lse = to_host_floats(lse), ref_D = to_host_floats(D);
    flash_backward_bf16_cpu(m_dq.data(), m_dk.data(), m_dv.data(), in.dout.data(), in.q.data(),
                            in.k.data(), in.v.data(), ref_lse.data(), ref_D.data(), a);
    check_elementwise("dq vs fp32 flash", m_dq, wide(dq), x.dq_mag, &x.dq_cancel, kMirrorBound,
                      kMirrorMean);
    check_elementwise("dk vs fp32 flash", m_dk, wide(dk), x.dk_mag, &x.dk_cancel, kMirrorBound,
                      kMirrorMean);
    check_elementwise("dv vs fp32 flash", m_dv, wide(dv), x.dv_mag, nullptr, kMirrorBound,
                      kMirrorMean);
    if (a.causal && a.Tq == a.Tk && a.q0 == 0 && a.k0 == 0) {  // naive attention's own case
      const AttentionShape shape{a.B, a.Tq, a.Hq, a.Hkv, a.hd};
      Tensor naive = empty(q.shape, Mem::Workspace);
      Tensor probs = empty({a.B, a.Hq, a.Tq, a.Tq}, Mem::Workspace);
      attention_forward(cpu, naive, probs, q, k, v, shape);
      check_elementwise("out vs naive", m_out, wide(naive), x.out_mag, nullptr, kMirrorBound,
                        kMirrorMean);
    }
  }
}

TEST_CASE("the bf16 kernels' tiles fit shared memory: 227 KiB (sm_90) and 163 KiB (sm_80)",
          "[attention][flash]") {
  for (int hd : {16, 32, 64, 128}) {
    INFO("hd " << hd);
    REQUIRE(fwd_shared_bytes(hd) <= 163 * 1024);
    REQUIRE(bwd_shared_bytes(hd, true) <= 163 * 1024);
  }
  // The forward's 128 queries per block: each K, V tile serves 128 rows, four times the 32 of
  // a block of one warp.
  REQUIRE(kFwdQueryTile == 128);
  REQUIRE(kBwdKeyTile == 128);
}

// ----------------------------------------------------------------------------

namespace {
// bf16 values (held in floats) as a bf16 device tensor.
Tensor bf16_on_gpu(const std::vector<float>& x) {
  Tensor h = empty({(int64_t)x.size()}, Mem::Workspace, Device::CPU, DType::BF16);
  uint16_t* bits = reinterpret_cast<uint16_t*>(h.ptr);
  for (size_t e = 0; e < x.size(); e++) bits[e] = float_to_bf16(x[e]);
  return to_device(h, Device::CUDA, Mem::Workspace);
}
std::vector<float> bf16_from_gpu(const Tensor& t) {
  Tensor f = empty(t.shape, Mem::Workspace, Device::CUDA);
  cast_(f, t);
  return to_host_floats(f);
}
const __nv_bfloat16* bf(const Tensor& t) {
  return reinterpret_cast<const __nv_bfloat16*>(t.ptr);
}

// The kernels on one block against their mirrors (forward on the same inputs; backward from the
// kernel's lse and D, given to both). Under dropout the kernels take `on_gpu`: a with its
// sequence numbers in device memory.
void require_kernels_match_mirrors(const Context& gpu, const AttentionBlock& a, double q_std,
                                   const AttentionBlock* on_gpu = nullptr) {
  INFO(describe(a) << ", q std " << q_std);
  Inputs in(a, q_std);
  const Exact x = attention64(in.q, in.k, in.v, in.dout, a);  // the magnitudes
  Tensor q = bf16_on_gpu(in.q), k = bf16_on_gpu(in.k), v = bf16_on_gpu(in.v);
  Tensor dout = bf16_on_gpu(in.dout);
  Tensor out = empty(q.shape, Mem::Workspace, Device::CUDA, DType::BF16);
  Tensor lse = empty({(int64_t)x.lse.size()}, Mem::Workspace, Device::CUDA);
  Tensor D = empty(lse.shape, Mem::Workspace, Device::CUDA);
  // dq, dk, dv start as garbage: the D kernel clears them for the backward's sums.
  auto garbage = [](size_t n) {
    return to_device(cpu_tensor(std::vector<float>(n, 1e30f)), Device::CUDA, Mem::Workspace);
  };
  Tensor dq = garbage(in.q.size()), dk = garbage(in.k.size()), dv = garbage(in.v.size());
  __nv_bfloat16* out_p = reinterpret_cast<__nv_bfloat16*>(out.ptr);
  const AttentionBlock& g = on_gpu ? *on_gpu : a;
  flash_attention_forward_bf16(gpu, out_p, lse.f32(), bf(q), bf(k), bf(v), g);
  attention_out_dot_dout_bf16(gpu, D.f32(), bf(dout), out_p, g, dq.f32(), dk.f32(), dv.f32());
  flash_attention_backward_bf16(gpu, dq.f32(), dk.f32(), dv.f32(), bf(dout), bf(q), bf(k), bf(v),
                                lse.f32(), D.f32(), g);
  gpu.synchronize();
  auto wide = [](const std::vector<float>& f) { return std::vector<double>(f.begin(), f.end()); };
  std::vector<float> m_out(in.q.size()), m_lse(x.lse.size());
  flash_forward_bf16_cpu(m_out.data(), m_lse.data(), in.q.data(), in.k.data(), in.v.data(), a);
  check_elementwise("out", bf16_from_gpu(out), wide(m_out), x.out_mag, nullptr, kKernelBound,
                    kKernelMean);
  // lse: the same fp32 sums in another order, exp2f and log2f within an ulp or two.
  std::vector<float> g_lse = to_host_floats(lse), g_D = to_host_floats(D);
  require_lse("lse", g_lse, wide(m_lse), 1e-5);
  std::vector<float> m_dq(in.q.size(), 0.0f), m_dk(in.k.size(), 0.0f), m_dv(in.v.size(), 0.0f);
  flash_backward_bf16_cpu(m_dq.data(), m_dk.data(), m_dv.data(), in.dout.data(), in.q.data(),
                          in.k.data(), in.v.data(), g_lse.data(), g_D.data(), a);
  check_elementwise("dq", to_host_floats(dq), wide(m_dq), x.dq_mag, &x.dq_cancel, kKernelBound,
                    kKernelMean);
  check_elementwise("dk", to_host_floats(dk), wide(m_dk), x.dk_mag, &x.dk_cancel, kKernelBound,
                    kKernelMean);
  check_elementwise("dv", to_host_floats(dv), wide(m_dv), x.dv_mag, nullptr, kKernelBound,
                    kKernelMean);
}
}  // namespace

TEST_CASE("CUDA FlashAttention-2 bf16 kernels match their CPU mirrors", "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  for (double q_std : {1.0, 5.0})
    for (const AttentionBlock& a : kBlocks) require_kernels_match_mirrors(gpu, a, q_std);
  gpu.destroy();
}

TEST_CASE("CUDA FlashAttention-2 bf16 kernels under dropout match their CPU mirrors",
          "[attention][flash][gpu]") {
  SKIP_WITHOUT_CUDA();
  Context cpu = Context::create(Device::CPU), gpu = Context::create(Device::CUDA);
  Tensor on_cpu = device_ints(cpu, {7, 3}), on_device = device_ints(gpu, {7, 3});
  for (const AttentionBlock& a : kBlocks) {
    const AttentionBlock g = with_dropout(a, on_device);
    require_kernels_match_mirrors(gpu, with_dropout(a, on_cpu), 1.0, &g);
  }
  gpu.destroy();
}

// Many tiles each way: the double-buffered pipelines through a dozen K/V (or Q/dO) tiles. Tagged
// [large]: the float64 reference takes seconds, so the sanitizer passes of the GPU check leave
// it out.
TEST_CASE("long blocks: CUDA FlashAttention-2 bf16 kernels match their CPU mirrors",
          "[attention][flash][gpu][large]") {
  SKIP_WITHOUT_CUDA();
  Context gpu = Context::create(Device::CUDA);
  require_kernels_match_mirrors(gpu, {1, 1000, 1000, 4, 2, 128, 0, 0, true}, 5.0);
  require_kernels_match_mirrors(gpu, {2, 513, 513, 2, 2, 64, 0, 0, false}, 1.0);
  gpu.destroy();
}
