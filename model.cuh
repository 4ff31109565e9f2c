// model.cuh: a tiny Llama (DESIGN section 6) with hand-written forward and backward.
// Parameters live in one flat buffer (and gradients in another) so that data parallelism and
// ZeRO can treat them as contiguous memory; each named tensor is a view into it.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core.cuh"
#include "flash_attention.cuh"

struct ModelConfig {
  std::string preset = "tiny";
  int vocab = 256;     // vocab_size
  int d_model = 128;   // hidden_size
  int layers = 4;      // num_hidden_layers
  int heads = 4;       // num_attention_heads
  int kv_heads = 2;    // num_key_value_heads
  int ffn = 384;       // intermediate_size
  int seq = 128;       // tokens per sequence (max_position_embeddings)
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  bool tie_embeddings = false;
  float init_std = 0.02f;
  int head_dim() const { return d_model / heads; }
};

ModelConfig model_preset(const std::string& name);  // tiny, medium, smollm-135m, llama-1b
std::vector<std::string> model_preset_names();
void validate_model_config(const ModelConfig& cfg);  // throws UsageError naming the flag
// Closed form: V*D [embed] + L*(2D + D*hd*(2Hq + 2Hkv) + 3*D*F) + D + (tied ? 0 : V*D)
int64_t parameter_count(const ModelConfig& cfg);

enum class Recompute { None, Selective, Full };  // Playbook §2.6
Recompute parse_recompute(const std::string& flag);
const char* recompute_name(Recompute r);

// The weights of one block, as views into the flat buffer (the gradients use the same struct).
struct BlockWeights {
  Tensor attn_norm;  // [D]
  Tensor wq;         // [Hq*hd, D]
  Tensor wk, wv;     // [Hkv*hd, D]
  Tensor wo;         // [D, Hq*hd]
  Tensor mlp_norm;   // [D]
  Tensor w_gate, w_up;  // [F, D]
  Tensor w_down;     // [D, F]
};
struct Weights {
  Tensor embed;       // [V, D]
  std::vector<BlockWeights> blocks;
  Tensor final_norm;  // [D]
  Tensor lm_head;     // [V, D] (a view of embed when tied)
};
struct NamedTensor {
  std::string name;  // Hugging Face name, e.g. model.layers.0.self_attn.q_proj.weight
  Tensor tensor;
};

struct Model {
  ModelConfig cfg;
  Tensor params;  // [num_params] flat, Mem::Params
  Tensor grads;   // [num_params] flat, Mem::Grads
  Weights w, g;   // views into params and grads
  std::vector<NamedTensor> named_params, named_grads;  // HF order (the checkpoint's order)
};
// Allocates the flat buffers and initialises every weight from (seed, name, element index):
// linear and embedding weights N(0, init_std), norm weights 1.
Model build_model(const ModelConfig& cfg, Device device, uint64_t seed);

// What one micro-batch's forward saves for its backward (its own object, so a pipeline can
// hold several in flight). Which tensors are kept depends on the recompute mode.
struct BlockActivations {
  Tensor x;             // [N, D] block input (always kept)
  Tensor norm1, rstd1;  // [N, D], [N]
  Tensor q, k, v;       // [N, Hq*hd], [N, Hkv*hd] x2 (after RoPE)
  Tensor probs;         // [B, Hq, T, T] (dropped by selective recompute)
  Tensor attn;          // [N, Hq*hd] attention output before wo
  Tensor x_mid;         // [N, D] after the attention residual
  Tensor norm2, rstd2;  // [N, D], [N]
  Tensor gate, up, act;  // [N, F] x3
};
struct Activations {
  int B = 0, T = 0;
  Tensor ids, targets, positions;  // [N] int32, N = B*T
  std::vector<BlockActivations> blocks;
  Tensor x_final, normf, rstdf;  // [N, D], [N, D], [N]
  Tensor logits;                 // [N, V]
  Tensor losses;                 // [N] per-token cross-entropy
};

// Runs the forward pass of B sequences of T tokens (ids and targets are host arrays [B*T]);
// returns the sum of per-token losses (fp32 accumulation). With targets == nullptr only the
// logits are computed (generation).
float model_forward(const Context& ctx, const Model& model, Activations& acts,
                    const int32_t* ids, const int32_t* targets, int B, int T, Recompute mode);
// Accumulates (+=) into model.grads the gradient of loss_scale * sum(losses), and releases the
// activations as it goes. `block_done(i)` runs as soon as a group's weight gradients are final,
// in backward order: i = layers (final norm and LM head), layers-1 ... 0 (block i), then -1
// (embedding). It is the seam where data parallelism launches a bucket's all-reduce.
void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const std::function<void(int)>& block_done = nullptr);
