// formulas.cuh: the book's closed forms that the reports print next to what a run measured
// (--report memory, comm) and that the memory check before a run uses: static memory per rank
// (Playbook §2.4, §4.1), ZeRO's and tensor parallelism's collectives (§4.4, §5, §6). Plain
// arithmetic on the layout's numbers; the activation formula is model.cu's, the bubble's
// pipeline_parallel.cu's.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/core.cuh"
#include "runtime/model_config.cuh"

// Bytes per parameter of each category. fp32 training: 4 (weights), 4 (gradients), 8 (Adam m, v).
// The book's mixed-precision figures use 2, 2 and k = 12 (fp32 master weights, m and v).
struct BytesPerParameter {
  double params = 4, grads = 4, optimizer = 8;
};
struct StaticMemory {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
// Playbook §4.1, bytes per rank for psi parameters at ZeRO stage 0..3 over `ranks` ranks.
StaticMemory zero_static_memory(int stage, double psi, int ranks, BytesPerParameter bytes = {});
// The formula in words: fp32 "4Ψ + 4Ψ + 8Ψ/N" for stage 1, ...; bf16 with an fp32 master
// {2, 4, 12}: "2Ψ + 4Ψ + 12Ψ/N".
std::string zero_memory_formula(int stage, BytesPerParameter bytes = {});
// What each rank keeps per parameter: fp32's 4, 4, 8, or under mixed precision the
// compute-format weights 2, the gradients (4, or 2 in bf16) and the fp32 master weights with
// Adam's moments, 12.
BytesPerParameter bytes_per_parameter(Precision precision, bool bf16_grads);

// Collective calls and bytes this rank sends over dp_cp in one training step.
struct ZeroTraffic {
  int64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;
  int64_t all_gather_calls = 0, all_gather_bytes = 0;
};

// What ZeRO issues in one training step (Playbook §4.4), by the rules in formulas.cu: for ZeRO
// `stage` over `ranks` ranks, units of shards[u] elements per rank, unit u reading the weights
// of reads[u] in its forward and reads_back[u] in its backward, grad_acc micro-batches, and
// the bytes of a gradient and of a gathered weight element.
ZeroTraffic zero_expected_traffic(int stage, int ranks, const std::vector<int64_t>& shards,
                                  const std::vector<std::vector<int>>& reads,
                                  const std::vector<std::vector<int>>& reads_back, int grad_bytes,
                                  int weight_bytes, int grad_acc);

// Tensor parallelism's bytes each rank sends per micro-batch of B sequences of T tokens, for
// the ring algorithm: all-reduce 2(t-1)/t K, all-gather and reduce-scatter (t-1)/t K of a
// K-byte activation.
struct TpTraffic {
  int64_t all_reduce = 0, all_gather = 0, reduce_scatter = 0;  // bytes each rank sends
};
TpTraffic tp_expected_traffic(const ModelConfig& cfg, int B, int T, int tp, bool sp);

// Expert parallelism (Playbook §9, expert_parallel.cu). The expected bytes of the saved
// activations one block keeps per token under balanced routing (every expert receives tokens x
// k / E rows): k rows of the hidden state twice (the expert's input and its output) and k rows
// of gate, up and SwiGLU output, e bytes each.
int64_t moe_activation_bytes(const ModelConfig& cfg, int64_t tokens, int tp, int e);
// All-to-all bytes a rank sends per block and micro-batch in the forward (dispatch and
// combine; the backward sends the same again), when each of its N k rows goes to a uniformly
// random expert: 2 x N x k x (ep - 1) / ep x D x b, the rows' values b bytes each (the compute
// format's: 4 under fp32 and fp8, 2 under bf16 and fp16).
double moe_expected_a2a_bytes(const ModelConfig& cfg, int64_t tokens, int ep, int value_bytes);

// ----------------------------------------------------------------------------
// The book's model: parameters and FLOPs

// Playbook §2.4: N = h v + L (12 h^2 + 13 h) + 2 h, the book's GPT-style transformer (a 4h GeLU
// MLP, LayerNorms and biases, tied embeddings). picoscale's Llama counts its own
// (model.cuh, parameter_count); the book's figures use this one.
int64_t book_parameter_count(int64_t hidden, int64_t vocab, int64_t layers);
// Appendix A2: FLOPs of one training token, forward and backward: 6 N for the matmuls (2 forward,
// 4 backward per parameter) plus 12 L h s for attention's QK^T and AV, whose cost grows with
// the sequence s (the book's 6 seq N + 12 L h seq^2 per sequence). h is the attention width
// (heads x head dimension). MFU counts these; recomputation does not (Playbook §2.6).
double model_flops_per_token(double params, int layers, int attention_width, int seq);
