#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention, flash backend, bf16, causal: forward and backward
TFLOP/s on bench_attention's CUDA shapes (B x T = 16384 tokens, 2048 / hd heads, hd 64 and 128,
T = 1k .. 16k), printed as rows of its table, so tools/gpu_check.sh can set ours against it.
FLOPs as in bench_attention.cu (FlashAttention-2's convention): forward 4 B T^2 H hd / 2 for a
causal mask, backward 2.5 x forward. Exit code 3: no PyTorch or no GPU here."""
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as err:
    print(f"flash_bench_torch: PyTorch is not installed ({err})")
    sys.exit(3)
if not torch.cuda.is_available():
    print("flash_bench_torch: PyTorch sees no CUDA device")
    sys.exit(3)


def flash_only():
    """The flash backend alone (an error, not a silent fallback, if it cannot run)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except ImportError:  # PyTorch before 2.3
        return torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False,
                                              enable_mem_efficient=False)


def best_seconds(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


print(f"PyTorch {torch.__version__} scaled_dot_product_attention (flash backend), causal, bf16,"
      f" on {torch.cuda.get_device_name()}")
print("| impl  | dtype | hd  |     T | fwd TFLOP/s | bwd TFLOP/s |")
print("|-------|-------|-----|-------|-------------|-------------|")
for hd in (64, 128):
    for T in (1024, 2048, 4096, 8192, 16384):
        B, H = 16384 // T, 2048 // hd
        # Token-major [B, T, H, hd] like picoscale's tensors, viewed as [B, H, T, hd].
        q, k, v = (torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16)
                   .transpose(1, 2).requires_grad_() for _ in range(3))
        dout = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        fwd_flops = 4.0 * B * T * T * H * hd / 2
        with flash_only():
            fwd = best_seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            bwd = best_seconds(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
        print(f"| torch | bf16  | {hd:3d} | {T:5d} | {fwd_flops / fwd / 1e12:11.1f} |"
              f" {2.5 * fwd_flops / bwd / 1e12:11.1f} |", flush=True)
        del q, k, v, dout, out
