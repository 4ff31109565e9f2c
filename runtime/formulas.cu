// formulas.cu: the book's closed forms (formulas.cuh).
#include "runtime/formulas.cuh"

StaticMemory zero_static_memory(int stage, double psi, int ranks, BytesPerParameter b) {
  double N = ranks;
  return {b.params * psi / (stage >= 3 ? N : 1.0), b.grads * psi / (stage >= 2 ? N : 1.0),
          b.optimizer * psi / (stage >= 1 ? N : 1.0)};
}
// Every ZeRO stage keeps the same kinds of bytes; zero_static_memory divides them by N.
BytesPerParameter bytes_per_parameter(Precision precision, bool bf16_grads) {
  if (precision == Precision::FP32) return {};
  return {2, bf16_grads ? 2.0 : 4.0, 12};
}

std::string zero_memory_formula(int stage, BytesPerParameter b) {
  auto term = [&](double bytes, bool sharded) {
    return std::to_string((int)bytes) + "Ψ" + (sharded ? "/N" : "");
  };
  return term(b.params, stage >= 3) + " + " + term(b.grads, stage >= 2) + " + " +
         term(b.optimizer, stage >= 1);
}

// ----------------------------------------------------------------------------
// ZeRO's collectives

// What one step issues. Reduce-scatter and all-gather of S_u elements per rank each send
// (N-1) x S_u x 4 bytes from every rank: over all units, (N-1)/N x Ψ' x 4, Ψ' = N x S (padded).
//   reduce-scatter  every unit: once per step (stage 1), once per micro-batch (stages 2, 3)
//   all-gather      stages 1-2: every unit once, after the optimizer step
//                   stage 3, per micro-batch: forward, every unit (a tied head re-gathers the
//                   embedding); backward, every block: the head is still resident from the
//                   forward and the embedding's backward reads no weights. So ZeRO-3 sends
//                   3Ψ(N-1)/N less the head and the embedding once per micro-batch, and issues
//                   L + 2 (+1 tied) + L all-gathers per micro-batch where stages 1-2 issue L + 2
//                   per step.
ZeroTraffic zero_expected_traffic(int stage, int ranks, const std::vector<int64_t>& shards,
                                  const std::vector<std::vector<int>>& reads,
                                  const std::vector<std::vector<int>>& reads_back, int grad_bytes,
                                  int weight_bytes, int grad_acc) {
  ZeroTraffic t;
  int64_t per_element = (int64_t)(ranks - 1) * grad_bytes;
  int64_t gathered_element = (int64_t)(ranks - 1) * weight_bytes;
  int reduces = stage == 1 ? 1 : grad_acc;
  for (int64_t shard : shards) {
    t.reduce_scatter_calls += reduces;
    t.reduce_scatter_bytes += reduces * per_element * shard;
  }
  auto gather = [&](int u, int times) {
    t.all_gather_calls += times;
    t.all_gather_bytes += times * gathered_element * shards[u];
  };
  int units = (int)shards.size();
  if (stage <= 2) {
    for (int u = 0; u < units; u++) gather(u, 1);
  } else {
    for (int u = 0; u < units; u++)
      for (int w : reads[u]) gather(w, grad_acc);
    for (int u = 0; u < units - 1; u++)  // the last unit: resident since its forward
      for (int w : reads_back[u]) gather(w, grad_acc);
  }
  return t;
}

// ----------------------------------------------------------------------------
// Tensor parallelism's collectives

TpTraffic tp_expected_traffic(const ModelConfig& c, int B, int T, int tp, bool sp) {
  TpTraffic t;
  if (tp == 1) return t;
  int64_t N = (int64_t)B * T, L = c.layers, K = 4 * N * c.d_model;  // one [N, D] activation
  auto ar = [&](int64_t bytes) { return 2 * (tp - 1) * bytes / tp; };
  auto ag = [&](int64_t bytes) { return (tp - 1) * bytes / tp; };
  if (sp) {
    // per block: forward 2 all-gathers (enter) + 2 reduce-scatters (exit); backward 2 all-gathers
    // (exit), 2 more re-gathering the norm outputs, 2 reduce-scatters (enter). Embedding: a
    // reduce-scatter forward, an all-gather backward; head: an all-gather forward and one
    // backward, a reduce-scatter backward. Norm weight gradients: 2L + 1 all-reduces of D (2D
    // with LayerNorm: its weight and bias together).
    t.all_gather = (6 * L + 3) * ag(K);
    t.reduce_scatter = (4 * L + 2) * ag(K);
    const int64_t norm_grads = c.norm == NormKind::LayerNorm ? 2 : 1;
    t.all_reduce = (2 * L + 1) * ar(4 * norm_grads * c.d_model);
  } else {
    // per block: an all-reduce after attention and after the MLP (forward), one before each in
    // backward; the embedding forward and the head backward add one each.
    t.all_reduce = (4 * L + 2) * ar(K);
  }
  t.all_reduce += ar(4 * N) + ar(8 * N);  // vocab-parallel cross-entropy: max, then two sums
  if (tp > c.kv_heads)  // replicated k and v projections: their gradient parts summed
    t.all_reduce += 2 * L * ar(4 * (int64_t)c.kv_heads * c.head_dim() * c.d_model);
  // A mixture of experts (expert_parallel.cu): each expert's output is a partial sum over tp,
  // so the gradient of each of a token's k combine weights is summed over tp in the backward;
  // dropless, N k of them per block (a capacity drops some).
  if (c.experts > 0) t.all_reduce += L * ar(4 * N * c.top_k);
  return t;
}

// ----------------------------------------------------------------------------
// The book's model

int64_t book_parameter_count(int64_t h, int64_t v, int64_t L) {
  // Per layer: attention 4h^2 + 4h (q, k, v, o and their biases), MLP 8h^2 + 5h (h -> 4h -> h),
  // two LayerNorms 4h; then the embedding h v and the final LayerNorm 2h.
  return h * v + L * (12 * h * h + 13 * h) + 2 * h;
}

double model_flops_per_token(double params, int layers, int attention_width, int seq) {
  return 6.0 * params + 12.0 * layers * (double)attention_width * seq;
}

int64_t moe_activation_bytes(const ModelConfig& c, int64_t tokens, int tp, int e) {
  return e * tokens * c.top_k * (2 * (int64_t)c.d_model + 3 * (int64_t)(c.ffn / tp));
}

double moe_expected_a2a_bytes(const ModelConfig& c, int64_t tokens, int ep, int value_bytes) {
  return 2.0 * tokens * c.top_k * (ep - 1) / ep * c.d_model * value_bytes;
}
