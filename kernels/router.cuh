// router.cuh: the mixture's router backward (Playbook §9; Mixtral's router, Switch Transformer's
// load-balancing loss) on either device. The routing itself is decided on the host, from the
// router's logits read back once per layer and micro-batch (the one host round trip the
// dispatch needs, since the all-to-all's sizes come from it: expert_parallel.cu); its backward
// needs nothing read back, so it runs where the gradients are.
#pragma once
#include <cstdint>

#include "runtime/core.cuh"

// One token's d logits [E] from the gradients of its k slot weights, through the weights'
// renormalisation over the k chosen probabilities and the softmax, plus `d_prob` [E] (the
// load-balancing loss's gradient per probability; null: none). `p` [E] its probabilities,
// `chosen` [k] its experts best first, `weight` [k] their renormalised weights. Slot j's weight
// gradient is d_weight[j] when `slot_row` is null, else d_weight[slot_row[j]] (0 where the slot
// was dropped, slot_row[j] < 0). In double, one expert at a time (no [E] buffer), in the same
// order on both devices.
__host__ __device__ inline float slot_weight_gradient(const float* d_weight,
                                                      const int32_t* slot_row, int j) {
  if (!slot_row) return d_weight[j];
  return slot_row[j] >= 0 ? d_weight[slot_row[j]] : 0.0f;
}
__host__ __device__ inline void route_backward_token(float* dz, const float* p,
                                                     const int32_t* chosen, const float* weight,
                                                     const float* d_weight, const int32_t* slot_row,
                                                     const float* d_prob, int E, int k) {
  double picked = 0, dot = 0;
  for (int j = 0; j < k; j++) {
    picked += p[chosen[j]];
    dot += (double)slot_weight_gradient(d_weight, slot_row, j) * weight[j];
  }
  // d prob[e]: the loss's share, then each chosen slot's, in slot order.
  auto d_prob_of = [&](int e) {
    double dp = d_prob ? d_prob[e] : 0.0;
    for (int j = 0; j < k; j++)
      if (chosen[j] == e) dp += (slot_weight_gradient(d_weight, slot_row, j) - dot) / picked;
    return dp;
  };
  double through = 0;  // the softmax's backward: dz = p (dp - <dp, p>)
  for (int e = 0; e < E; e++) through += d_prob_of(e) * p[e];
  for (int e = 0; e < E; e++) dz[e] = (float)(p[e] * (d_prob_of(e) - through));
}

// d_logits [N, E] F32 for every token, on ctx's device: `probs` [N, E] and `weight` [N, k] F32,
// `choice` [N, k] and `slot_row` [N, k] I32 (the dispatch row of each (token, slot), -1 where
// dropped), `d_weight` [rows] F32 per dispatch row, `d_prob` [E] F32 or empty. One thread per
// token on CUDA; the same arithmetic as the CPU loop (the GPU may fuse a multiply and an add).
void route_backward_on(const Context& ctx, const Tensor& d_logits, const Tensor& probs,
                       const Tensor& choice, const Tensor& weight, const Tensor& slot_row,
                       const Tensor& d_weight, const Tensor& d_prob);
