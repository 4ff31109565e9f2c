// attention_naive.cuh: naive attention (kernels/attention_naive.cu), the readable reference
// FlashAttention is tested against: per (sequence, head) a GEMM for the scores, a causal row
// softmax and a GEMM for the output, keeping the [B, Hq, T, T] probabilities (Playbook §2.5's
// 5as^2b term), and under dropout (the book's GPT) their mask and what it left.
#pragma once
#include <memory>

#include "flash_attention.cuh"

// q [B*T, Hq, hd], k and v [B*T, Hkv, hd] -> out [B*T, Hq, hd];
// probs [B, Hq, T, T] receives the softmax probabilities (zero above the diagonal).
void attention_forward(const Context& ctx, const Tensor& out, const Tensor& probs, const Tensor& q,
                       const Tensor& k, const Tensor& v, const AttentionShape& s);
// Its two halves: the probabilities from q and k; the output from them (or what dropout left of
// them) and v.
void attention_probs(const Context& ctx, const Tensor& probs, const Tensor& q, const Tensor& k,
                     const AttentionShape& s);
void attention_output(const Context& ctx, const Tensor& out, const Tensor& probs, const Tensor& v,
                      const AttentionShape& s);
// dq [B*T, Hq, hd] (=), dk and dv [B*T, Hkv, hd] (=), from dout [B*T, Hq, hd] and the saved
// probs. `scratch` is a [B, Hq, T, T] workspace.
// Under dropout the output read `dropped` (the probabilities masked, [B, Hq, T, T]) in place of
// probs: dV reads it, and dP is masked (`mask`, `p`) before the softmax's backward.
void attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                        const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& probs, const Tensor& scratch, const AttentionShape& s,
                        const Tensor& dropped = Tensor(), const Tensor& mask = Tensor(),
                        float p = 0.0f);

// The softmax pieces, CPU reference and CUDA kernel each (exposed for tests):
// probs[r, i, j] = causal softmax over j <= i of scale * scores[r, i, j]; rows r = B*Hq.
void causal_softmax_forward(const Context& ctx, float* probs, const float* scores, int rows, int T,
                            float scale);
// dscores[r,i,j] = scale * probs * (dprobs - sum_j' probs * dprobs); may alias dprobs.
void causal_softmax_backward(const Context& ctx, float* dscores, const float* dprobs,
                             const float* probs, int rows, int T, float scale);
// Naive attention as the model's attention core: keeps the probabilities, which selective
// recomputation drops and the backward rebuilds (local_attention(AttentionKind::Naive)).
std::shared_ptr<const AttentionCore> naive_attention();
