// flash_attention.cuh: the attention core, softmax(q k^T / sqrt(hd) + causal mask) v, with
// grouped-query heads (query head h reads key/value head h / (Hq / Hkv)).
// This file holds naive attention (materialises the [B, Hq, T, T] probabilities,
// Playbook §2.5's 5as^2b term); FlashAttention (Playbook §12.8) joins it later.
#pragma once
#include "core.cuh"

struct AttentionShape {
  int B;    // sequences
  int T;    // tokens per sequence
  int Hq;   // query heads
  int Hkv;  // key/value heads (divides Hq)
  int hd;   // head dimension
};

// q [B*T, Hq, hd], k and v [B*T, Hkv, hd] -> out [B*T, Hq, hd];
// probs [B, Hq, T, T] receives the softmax probabilities (zero above the diagonal).
void attention_forward(const Context& ctx, const Tensor& out, const Tensor& probs,
                       const Tensor& q, const Tensor& k, const Tensor& v,
                       const AttentionShape& s);
// dq [B*T, Hq, hd] (=), dk and dv [B*T, Hkv, hd] (=), from dout [B*T, Hq, hd] and the saved
// probs. `scratch` is a [B, Hq, T, T] workspace.
void attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk,
                        const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& probs,
                        const Tensor& scratch, const AttentionShape& s);

// The softmax pieces, CPU reference and CUDA kernel each (exposed for tests):
// probs[r, i, j] = causal softmax over j <= i of scale * scores[r, i, j]; rows r = B*Hq.
void causal_softmax_forward(const Context& ctx, float* probs, const float* scores, int rows,
                            int T, float scale);
// dscores[r,i,j] = scale * probs * (dprobs - sum_j' probs * dprobs); may alias dprobs.
void causal_softmax_backward(const Context& ctx, float* dscores, const float* dprobs,
                             const float* probs, int rows, int T, float scale);
