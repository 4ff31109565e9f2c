// bench_attention.cu: `make bench`. Naive attention against FlashAttention (Playbook §12.8).
// CPU: time and memory of forward and forward + backward at T = 128 .. 4096 with the tiny
// model's attention (B 1, Hq 4, Hkv 2, hd 32, causal). Naive keeps [B, Hq, T, T]
// probabilities and a backward scratch of the same size; flash keeps one lse per (query, head)
// and works in fixed-size tiles. Same math, and flash skips the tiles above the diagonal.
// CUDA (when a GPU is visible): TFLOP/s of the fp32 and bf16 kernels, forward and backward,
// causal, hd 64 and 128, T = 1k .. 16k at 16k tokens per batch and 2048 model width (the
// FlashAttention-2 paper's setting); tools/flash_bench_torch.py measures PyTorch's flash
// backend on the same shapes and prints rows in the same format.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench/timing.cuh"
#include "flash_attention.cuh"
#include "kernels/attention_naive.cuh"
#include "kernels/flash_attention_bf16.cuh"

// Best of 10 runs after a warm-up, or of those in the first 0.5 s.
static double time_best(const Context& ctx, const std::function<void()>& fn) {
  return best_seconds(ctx, 10, 0.5, fn);
}

// Bytes the attention core allocates beyond its inputs and outputs, peak, while fn runs.
static size_t extra_bytes(const std::function<void()>& fn) {
  MemoryStats before = memory_stats();
  memory_reset_peak();
  fn();
  MemoryStats after = memory_stats();
  return after.total_peak - before.total_current;
}

static void cpu_table() {
  Context ctx = Context::create(Device::CPU);
  printf("CPU attention, B 1, Hq 4, Hkv 2, hd 32, causal, fp32 (best of up to 10 runs)\n");
  printf("| %5s | %10s | %10s | %7s | %12s | %12s | %7s | %12s | %12s |\n", "T", "naive fwd",
         "flash fwd", "speedup", "naive f+b", "flash f+b", "speedup", "naive mem", "flash mem");
  printf(
      "|-------|------------|------------|---------|--------------|--------------|---------|"
      "--------------|--------------|\n");
  for (int T = 128; T <= 4096; T *= 2) {
    AttentionBlock a{1, T, T, 4, 2, 32, 0, 0, true};
    AttentionShape s{1, T, 4, 2, 32};
    Tensor q = empty({T, 4, 32}, Mem::Activations), out = empty(q.shape, Mem::Activations);
    Tensor k = empty({T, 2, 32}, Mem::Activations), v = empty(k.shape, Mem::Activations);
    Tensor dout = empty(q.shape, Mem::Activations), dq = empty(q.shape, Mem::Grads);
    Tensor dk = empty(k.shape, Mem::Grads), dv = empty(k.shape, Mem::Grads);
    init_normal(q, 1, "q", 1.0f), init_normal(k, 1, "k", 1.0f), init_normal(v, 1, "v", 1.0f);
    init_normal(dout, 1, "dout", 1.0f);
    // Naive: the probabilities (kept for backward) and the backward's scratch, [1, 4, T, T] each.
    auto naive_fwd = [&] {
      Tensor probs = empty({1, 4, T, T}, Mem::Activations);
      attention_forward(ctx, out, probs, q, k, v, s);
      return probs;
    };
    auto naive_both = [&] {
      Tensor probs = naive_fwd(), scratch = empty(probs.shape, Mem::Workspace);
      attention_backward(ctx, dq, dk, dv, dout, q, k, v, probs, scratch, s);
    };
    // Flash: lse kept for backward, D for backward, and the tile workspace.
    auto flash_fwd = [&] {
      Tensor lse = empty({1, 4, T}, Mem::Activations);
      flash_attention_forward(ctx, out, lse, q, k, v, a);
      return lse;
    };
    auto flash_both = [&] {
      Tensor lse = flash_fwd(), D = empty(lse.shape, Mem::Activations);
      attention_out_dot_dout(ctx, D, dout, out, a);
      zero_(dq), zero_(dk), zero_(dv);
      flash_attention_backward(ctx, dq, dk, dv, dout, q, k, v, lse, D, a);
    };
    double nf = time_best(ctx, [&] { naive_fwd(); }), ff = time_best(ctx, [&] { flash_fwd(); });
    double nb = time_best(ctx, naive_both), fb = time_best(ctx, flash_both);
    size_t nm = extra_bytes(naive_both), fm = extra_bytes(flash_both);
    printf("| %5d | %7.2f ms | %7.2f ms | %6.2fx | %9.2f ms | %9.2f ms | %6.2fx | %12s | %12s |\n",
           T, nf * 1e3, ff * 1e3, nf / ff, nb * 1e3, fb * 1e3, nb / fb, human_bytes(nm).c_str(),
           human_bytes(fm).c_str());
    fflush(stdout);
  }
}

// Causal attention FLOPs, FlashAttention-2 paper convention: forward 4 B T^2 H hd / 2 (two
// GEMMs, half the tiles), backward 2.5 x forward (five GEMMs).
static double causal_forward_flops(int B, int T, int H, int hd) {
  return 4.0 * B * (double)T * T * H * hd / 2.0;
}

static void cuda_table() {
  Context ctx = Context::create(Device::CUDA);
  printf("\nCUDA FlashAttention, causal, B x T = 16384 tokens, Hq = Hkv = 2048 / hd (TFLOP/s)\n");
  printf("| impl  | dtype | hd  |     T | fwd TFLOP/s | bwd TFLOP/s |\n");
  printf("|-------|-------|-----|-------|-------------|-------------|\n");
  for (int hd : {64, 128})
    for (int T = 1024; T <= 16384; T *= 2) {
      const int B = 16384 / T, H = 2048 / hd;
      AttentionBlock a{B, T, T, H, H, hd, 0, 0, true};
      const int64_t n = (int64_t)B * T * H * hd;
      Tensor q = empty({n}, Mem::Activations, Device::CUDA),
             k = empty({n}, Mem::Activations, Device::CUDA);
      Tensor v = empty({n}, Mem::Activations, Device::CUDA),
             dout = empty({n}, Mem::Activations, Device::CUDA);
      Tensor out = empty({n}, Mem::Activations, Device::CUDA);
      Tensor dq = empty({n}, Mem::Grads, Device::CUDA), dk = empty({n}, Mem::Grads, Device::CUDA);
      Tensor dv = empty({n}, Mem::Grads, Device::CUDA);
      Tensor lse = empty({B, H, T}, Mem::Activations, Device::CUDA),
             D = empty(lse.shape, Mem::Activations, Device::CUDA);
      init_normal(q, 1, "q", 1.0f), init_normal(k, 1, "k", 1.0f), init_normal(v, 1, "v", 1.0f);
      init_normal(dout, 1, "dout", 1.0f);
      const double fwd_flops = causal_forward_flops(B, T, H, hd), bwd_flops = 2.5 * fwd_flops;
      // Backward is timed with D (part of every backward) and without zeroing the gradients.
      double f32_fwd = time_best(ctx, [&] { flash_attention_forward(ctx, out, lse, q, k, v, a); });
      double f32_bwd = time_best(ctx, [&] {
        attention_out_dot_dout(ctx, D, dout, out, a);
        flash_attention_backward(ctx, dq, dk, dv, dout, q, k, v, lse, D, a);
      });
      printf("| ours  | fp32  | %3d | %5d | %11.1f | %11.1f |\n", hd, T, fwd_flops / f32_fwd / 1e12,
             bwd_flops / f32_bwd / 1e12);
      // bf16: the same inputs rounded on the device, held in F32 tensors of half the length.
      auto bf16_copy = [&](const Tensor& t) {
        Tensor h = empty({(n + 1) / 2}, Mem::Activations, Device::CUDA);
        convert_to_bf16(ctx, reinterpret_cast<__nv_bfloat16*>(h.ptr), t.f32(), n);
        return h;
      };
      auto bf = [](const Tensor& t) { return reinterpret_cast<__nv_bfloat16*>(t.ptr); };
      Tensor qb = bf16_copy(q), kb = bf16_copy(k), vb = bf16_copy(v), dob = bf16_copy(dout);
      Tensor ob = bf16_copy(out);
      // bf16, then bf16 with the book's dropout 0.1 drawn in the tiles (the same FLOPs counted:
      // what the masks cost shows as a lower rate).
      std::vector<int32_t> numbers(B);
      for (int b = 0; b < B; b++) numbers[b] = b;
      Tensor sequences = device_ints(ctx, numbers);
      for (bool dropout : {false, true}) {
        AttentionBlock d = a;
        if (dropout)
          d.drop = AttentionDropout{DropoutSite{1, 0, 0, 0.1f}, sequences, Tensor(), 0}.draw(1);
        double bf_fwd = time_best(ctx, [&] {
          flash_attention_forward_bf16(ctx, bf(ob), lse.f32(), bf(qb), bf(kb), bf(vb), d);
        });
        double bf_bwd = time_best(ctx, [&] {
          attention_out_dot_dout_bf16(ctx, D.f32(), bf(dob), bf(ob), d, dq.f32(), dk.f32(),
                                      dv.f32());  // as the step runs it
          flash_attention_backward_bf16(ctx, dq.f32(), dk.f32(), dv.f32(), bf(dob), bf(qb), bf(kb),
                                        bf(vb), lse.f32(), D.f32(), d);
        });
        printf("| ours  | %-5s | %3d | %5d | %11.1f | %11.1f |\n", dropout ? "+drop" : "bf16", hd,
               T, fwd_flops / bf_fwd / 1e12, bwd_flops / bf_bwd / 1e12);
      }
      fflush(stdout);
    }
  ctx.destroy();
}

int main(int argc, char** argv) {
  bool cuda_only = argc > 1 && std::string(argv[1]) == "--cuda-only";
  if (!cuda_only) cpu_table();
  if (cuda_available())
    cuda_table();
  else
    printf("\nCUDA FlashAttention: no CUDA device, skipped\n");
  return 0;
}
