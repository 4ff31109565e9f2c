// kernel_smem.cu: the dynamic shared memory each bf16 FlashAttention kernel is launched with, from
// the same constexpr functions its launcher uses (kernels/flash_attention_bf16.cuh). ptxas -v
// reports only static shared memory; tools/kernel_report.sh compiles this (host code only, no GPU
// needed) and prints these next to it. One line per kernel: its name as c++filt writes it, bytes.
#include <cstdio>

#include "kernels/flash_attention_bf16.cuh"

int main() {
  for (int hd : {16, 32, 64, 128}) {
    printf("flash_forward_bf16_kernel<%d> %zu\n", hd, fwd_shared_bytes(hd));
    printf("flash_backward_bf16_kernel<%d> %zu\n", hd, bwd_shared_bytes(hd));
  }
  return 0;
}
