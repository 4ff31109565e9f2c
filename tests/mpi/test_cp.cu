// test_cp.cu: ring attention (Playbook §7.2) on cp = the whole world (2, 3, 4 and 8 ranks):
// each rank's share of the output, log-sum-exp and gradients against FlashAttention over the
// whole sequence in one call, which every rank computes for itself from the same inputs; for
// the zig-zag and the contiguous split, the ring and the all-gather of keys and values.
#include <catch2/catch.hpp>
#include <cmath>
#include <vector>

#include "context_parallel.cuh"
#include "flash_attention.cuh"
#include "runtime/dtype.cuh"

namespace {

const Context kCpu;

Tensor random(std::vector<int64_t> shape, const std::string& name) {
  Tensor t = empty(shape, Mem::Workspace);
  init_normal(t, 21, name, 1.0f);
  return t;
}
// Rows of a token-major tensor [B*T, H, hd] at this rank's local tokens, in local order.
std::vector<float> local_rows(const Tensor& whole, const std::vector<int64_t>& tokens) {
  std::vector<float> all = to_host_floats(whole), out;
  int64_t width = whole.numel() / whole.size(0);
  for (int64_t i : tokens)
    out.insert(out.end(), all.begin() + i * width, all.begin() + (i + 1) * width);
  return out;
}
Tensor host(const std::vector<float>& values, std::vector<int64_t> shape) {
  Tensor t = empty(shape, Mem::Workspace);
  from_host(t, values.data());
  return t;
}
// max |got - want| over the elements, relative to max |want| (one tolerance per tensor).
double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); i++) {
    diff = std::max(diff, (double)std::abs(got[i] - want[i]));
    scale = std::max(scale, (double)std::abs(want[i]));
  }
  return diff / std::max(scale, 1e-30);
}

// Ring attention with its blocks' operands in `in` against one fp32 call over the whole
// sequence on the same inputs (rounded to bf16 first when `in` is bf16), within `out_tol` (out)
// and `grad_tol` (dq, dk, dv) of each tensor's largest value.
void require_ring_equals_whole(DType in, int hd, double out_tol, double grad_tol) {
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  Comm comm = comm_init(1, 1, world, 1, "mpi", Device::CPU, 60);
  const int B = 2, T = 48, Hq = 4, Hkv = 2;  // 48: divisible by 2 cp for cp 2, 3, 4, 8
  Tensor q = random({B * T, Hq, hd}, "q"), k = random({B * T, Hkv, hd}, "k");
  Tensor v = random({B * T, Hkv, hd}, "v"), dout = random({B * T, Hq, hd}, "dout");
  if (in == DType::BF16)
    for (Tensor* t : {&q, &k, &v, &dout}) *t = cast_to(kCpu, cast_to(kCpu, *t, in), DType::F32);
  // The reference: one call over the whole sequence, on every rank.
  AttentionBlock whole{B, T, T, Hq, Hkv, hd, 0, 0, true};
  Tensor out = empty({B * T, Hq, hd}, Mem::Workspace), lse = empty({B, Hq, T}, Mem::Workspace);
  flash_attention_forward(kCpu, out, lse, q, k, v, whole);
  Tensor D = empty({B, Hq, T}, Mem::Workspace);
  attention_out_dot_dout(kCpu, D, dout, out, whole);
  Tensor dq = zeros({B * T, Hq, hd}, Mem::Workspace), dk = zeros({B * T, Hkv, hd}, Mem::Workspace);
  Tensor dv = zeros({B * T, Hkv, hd}, Mem::Workspace);
  flash_attention_backward(kCpu, dq, dk, dv, dout, q, k, v, lse, D, whole);
  for (CpBalance balance : {CpBalance::Zigzag, CpBalance::Contiguous})
    for (CpComm mode : {CpComm::Ring, CpComm::AllGather}) {
      ContextParallel cp{&comm, balance, mode};
      std::vector<int64_t> tokens = cp.local_tokens(B, T);
      int64_t N = (int64_t)tokens.size();
      REQUIRE(N * world == (int64_t)B * T);
      auto mine = [&](const Tensor& whole_t, int H) {
        return cast_to(kCpu, host(local_rows(whole_t, tokens), {N, H, hd}), in);
      };
      Tensor my_q = mine(q, Hq), my_k = mine(k, Hkv), my_v = mine(v, Hkv);
      Tensor my_dout = mine(dout, Hq);
      Tensor my_out = empty({N, Hq, hd}, Mem::Workspace), my_lse = empty({N * Hq}, Mem::Workspace);
      CpWork work;
      context_attention_forward(kCpu, cp, my_out, my_lse, my_q, my_k, my_v, B, T, Hq, Hkv, hd,
                                &work);
      Tensor my_dq = empty({N, Hq, hd}, Mem::Workspace),
             my_dk = empty({N, Hkv, hd}, Mem::Workspace);
      Tensor my_dv = empty({N, Hkv, hd}, Mem::Workspace);
      context_attention_backward(kCpu, cp, my_dq, my_dk, my_dv, my_dout, cast_to(kCpu, my_out, in),
                                 my_lse, my_q, my_k, my_v, B, T, Hq, Hkv, hd);
      INFO(cp_balance_name(balance) << ", " << cp_comm_name(mode) << ", cp " << world << ", rank "
                                    << cp.rank() << ", operands " << dtype_name(in));
      CHECK(relative_error(to_host_floats(my_out), local_rows(out, tokens)) < out_tol);
      CHECK(relative_error(to_host_floats(my_dq), local_rows(dq, tokens)) < grad_tol);
      CHECK(relative_error(to_host_floats(my_dk), local_rows(dk, tokens)) < grad_tol);
      CHECK(relative_error(to_host_floats(my_dv), local_rows(dv, tokens)) < grad_tol);
      // The log-sum-exp, piece by piece ([B, Hq, length] each), against the whole one's.
      std::vector<float> got = to_host_floats(my_lse), want_all = to_host_floats(lse), want;
      for (const CpPiece& p : cp_pieces(balance, T, world, cp.rank()))
        for (int b = 0; b < B; b++)
          for (int h = 0; h < Hq; h++)
            for (int t = 0; t < p.length; t++)
              want.push_back(want_all[((int64_t)b * Hq + h) * T + p.start + t]);
      CHECK(relative_error(got, want) < 2e-5);  // fp32 arithmetic in both formats
      // Zig-zag: the T (T + 1) / 2 causal (query, key) pairs of a sequence split evenly over the
      // ranks. Contiguous: rank r attends to r + 1 blocks (Playbook §7.3).
      if (balance == CpBalance::Zigzag)
        CHECK(work.pairs * world == (int64_t)T * (T + 1) / 2);
      else
        CHECK(work.blocks == cp.rank() + 1);
    }
  comm_destroy(comm);
}

}  // namespace

// Guards: a block merged twice or never (a wrong ring step or owner), a diagonal block not
// masked, keys of the wrong positions (the zig-zag layout), gradient accumulators not coming
// back to their owner. Tolerance: the same attention summed block by block in another order,
// fp32: ~1e-6 of each tensor's scale; 2e-5 allows that and fails for any of those bugs.
TEST_CASE("ring attention on cp ranks equals FlashAttention over the whole sequence", "[mpi][cp]") {
  require_ring_equals_whole(DType::F32, 8, 2e-5, 2e-5);
}

// What a GPU runs under --dtype bf16: keys and values travel in bf16, each block runs the
// tensor-core kernels (here their CPU mirrors) and its output, rounded to bf16, merges into the
// fp32 sum. Each block's output rounding (2^-9) and P, dS rounded to bf16 before the second
// GEMMs: 2e-2 of the largest value for out, 3e-2 for the gradients, as the bf16 kernels against
// the CPU; lse is fp32 arithmetic on the same scores: 2e-5. A wrong format in a message or a
// merge that read the bf16 bits as fp32 is off by far more.
TEST_CASE("ring attention in bf16 on cp ranks equals FlashAttention over the whole sequence",
          "[mpi][cp]") {
  require_ring_equals_whole(DType::BF16, 16, 2e-2, 3e-2);
}
