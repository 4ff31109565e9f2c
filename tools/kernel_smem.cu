// kernel_smem.cu: the dynamic shared memory each bf16 FlashAttention kernel is launched with, from
// the same constexpr functions its launcher uses (kernels/flash_attention_bf16.cuh). ptxas -v
// reports only static shared memory; tools/kernel_report.sh compiles this (host code only, no GPU
// needed) and prints these next to it. One line per kernel: its name as c++filt writes it, then
// the bytes (the last field: the name holds a space).
#include <cstdio>

#include "kernels/flash_attention_bf16.cuh"

int main() {
  for (int hd : {16, 32, 64, 128})
    for (bool dropout : {false, true}) {
      const char* d = dropout ? "true" : "false";
      printf("flash_forward_bf16_kernel<%d, %s> %zu\n", hd, d, fwd_shared_bytes(hd));
      printf("flash_backward_bf16_kernel<%d, %s> %zu\n", hd, d, bwd_shared_bytes(hd, dropout));
    }
  return 0;
}
