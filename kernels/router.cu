// router.cu: the router's backward on the device: each token's logits' gradient from its slots'
// weight gradients (kernels/router.cuh). The CPU loop and the kernel call the same per-token
// function.
#include "kernels/router.cuh"
#include "runtime/ops.cuh"

__global__ static void route_backward_kernel(float* dz, const float* probs, const int32_t* choice,
                                             const float* weight, const int32_t* slot_row,
                                             const float* d_weight, const float* d_prob, int64_t N,
                                             int E, int k) {
  const int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= N) return;
  route_backward_token(dz + t * E, probs + t * E, choice + t * k, weight + t * k, d_weight,
                       slot_row + t * k, d_prob, E, k);
}

void route_backward_on(const Context& ctx, const Tensor& d_logits, const Tensor& probs,
                       const Tensor& choice, const Tensor& weight, const Tensor& slot_row,
                       const Tensor& d_weight, const Tensor& d_prob) {
  const int64_t N = probs.size(0);
  const int E = (int)probs.size(1), k = (int)choice.size(1);
  PICO_ASSERT(d_logits.numel() == N * E && choice.numel() == N * k && weight.numel() == N * k &&
                  slot_row.numel() == N * k && (d_prob.numel() == 0 || d_prob.numel() == E),
              "route_backward_on: shapes");
  check_devices(ctx, "route_backward_on", d_logits, probs, choice, weight, slot_row, d_weight,
                d_prob);
  // Per token: the k slots twice and each expert's pass over them twice (E k), its E
  // probabilities read and E gradients written.
  const double read = 4.0 * (N * E + 3.0 * N * k + d_prob.numel()), written = 4.0 * N * E;
  if (count_op(ctx.device, OpKind::Elementwise,
               {(4.0 * k + 4.0 * E * k + 4.0 * E) * N, read, written}))
    return;
  const float* dp = d_prob.numel() ? d_prob.f32() : nullptr;
  if (ctx.device == Device::CPU) {
    for (int64_t t = 0; t < N; t++)
      route_backward_token(d_logits.f32() + t * E, probs.f32() + t * E, choice.i32() + t * k,
                           weight.f32() + t * k, d_weight.f32(), slot_row.i32() + t * k, dp, E, k);
    return;
  }
  if (N == 0) return;
  constexpr int kThreads = 128;
  route_backward_kernel<<<(unsigned)((N + kThreads - 1) / kThreads), kThreads, 0, ctx.stream>>>(
      d_logits.f32(), probs.f32(), choice.i32(), weight.f32(), slot_row.i32(), d_weight.f32(), dp,
      N, E, k);
  LAUNCH_CHECK(ctx, "route_backward_kernel");
}
