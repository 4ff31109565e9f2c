// model_config.cuh: the shape of the Llama, the numbers a Hugging Face config.json holds
// (LlamaConfig's keys in the comments), its presets and its closed-form parameter count. The
// model itself is model.cu's; the config.json mapping is checkpoint.cu's.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

// The block's norm and MLP: the Llama's (RMSNorm, SwiGLU), or the book's GPT's (Playbook
// §2.5: LayerNorm with a bias, a GeLU MLP of 4h), whose activations the book's tables count.
enum class NormKind { RMSNorm, LayerNorm };
enum class MlpKind { SwiGLU, GeLU };

// RoPE's base: each pair i of a head turns base^(-2i/head dim) radians per position; below a base
// of 1 those turns exceed one radian and grow with i until they overflow.
constexpr float kMinRopeTheta = 1.0f;

struct ModelConfig {
  std::string preset = "tiny";
  int vocab = 256;              // vocab_size
  int d_model = 128;            // hidden_size
  int layers = 4;               // num_hidden_layers
  int heads = 4;                // num_attention_heads
  int kv_heads = 2;             // num_key_value_heads
  int ffn = 384;                // intermediate_size
  int seq = 128;                // tokens per sequence (max_position_embeddings)
  float rope_theta = 10000.0f;  // at least kMinRopeTheta
  float norm_eps = 1e-5f;
  bool tie_embeddings = false;
  float init_std = 0.02f;
  // A Mixtral-style mixture of experts in every block's MLP (expert_parallel.cu); 0: dense.
  int experts = 0;               // num_local_experts
  int top_k = 2;                 // num_experts_per_tok
  float aux_loss_coef = 0.001f;  // router_aux_loss_coef: the load-balancing loss's weight
  // A loaded Mixtral's sliding_window (0: none): tokens attend only that far back, which
  // picoscale does not implement, so a run whose --seq is longer than it is refused.
  int sliding_window = 0;
  NormKind norm = NormKind::RMSNorm;  // --norm
  MlpKind mlp = MlpKind::SwiGLU;      // --mlp
  // Dropout's probability (--dropout) on attention's probabilities and on the attention's and
  // the MLP's outputs before their residual adds, as the book's GPT has it; 0: none.
  float dropout = 0.0f;
  std::string loaded_config;  // the config.json --load read ("": none), which --save writes back
  bool gpt_block() const { return norm != NormKind::RMSNorm || mlp != MlpKind::SwiGLU; }
  int head_dim() const { return d_model / heads; }
};

ModelConfig model_preset(const std::string& name);  // tiny, medium, smollm-135m, llama-1b
std::vector<std::string> model_preset_names();
void validate_model_config(const ModelConfig& cfg);  // throws UsageError naming the flag
// A mixture's flags given for a model without experts (--top-k, --aux-loss-coef): UsageError
// naming the flag and the fix, in the same words for ./train and ./plan.
void check_mixture_flags(const ModelConfig& m, bool top_k_given, bool aux_loss_coef_given);
// Closed form: V*D [embed] + L*(2D + D*hd*(2Hq + 2Hkv) + 3*D*F) + D + (tied ? 0 : V*D), the
// MLP's 3DF being E(3DF) + DE (the experts and the router) under a mixture of experts, 2DF
// with GeLU; each norm's D being 2D with LayerNorm (its bias)
int64_t parameter_count(const ModelConfig& cfg);
// The same in double, for a shape whose count int64_t would not hold (options.cu refuses it).
double parameter_count_unbounded(const ModelConfig& cfg);
// The experts' weights alone (0 without them): L x E x 3 D F, which expert parallelism splits.
int64_t expert_parameter_count(const ModelConfig& cfg);
// The parameters one token meets: all but the experts, plus top_k of E experts per layer (the N
// of the book's 6N under a mixture of experts; parameter_count without one).
int64_t active_parameter_count(const ModelConfig& cfg);
// The MFU line's note when that differs from the whole count (a mixture of experts): "N = ...
// parameters a token meets (top k of E experts per layer) of ...", with its newline; else "".
std::string active_parameters_note(const ModelConfig& cfg);
