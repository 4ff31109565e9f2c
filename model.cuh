// model.cuh: a tiny Llama (DESIGN section 6) with hand-written forward and backward.
// Parameters live in one flat buffer (and gradients in another) so that data parallelism and
// ZeRO can treat them as contiguous memory; each named tensor is a view into it.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "core.cuh"
#include "flash_attention.cuh"
#include "tensor_parallel.cuh"

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

// The slice of the model one tensor-parallel rank holds (Playbook §5.3): query heads, ffn
// columns and vocabulary rows split evenly over tp; key/value heads split too, or, when tp
// exceeds them, the one kv head this rank's query heads read, replicated on kv_replicas ranks.
struct LocalDims {
  int heads = 0, head0 = 0;     // query heads [head0, head0 + heads)
  int kv_heads = 0, kv_head0 = 0, kv_replicas = 1;
  int ffn = 0, ffn0 = 0;        // intermediate columns [ffn0, ffn0 + ffn)
  int vocab = 0, vocab0 = 0;    // vocabulary rows [vocab0, vocab0 + vocab)
  int tp_rank = 0;
};
LocalDims local_dims(const ModelConfig& cfg, int tp_rank, int tp_size);
// Throws UsageError unless --tp divides heads, ffn and vocab, kv heads and tp divide one
// another, and (with --sp) --tp divides --seq.
void validate_tensor_parallel(const ModelConfig& cfg, int tp, bool sp);

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

// A unit: the parameters that one hook index covers, a contiguous slice of the flat buffer.
// units[i + 1] belongs to hook index i: -1 the embedding, 0..L-1 block i, L the head (final norm,
// and the LM head unless tied). Data parallelism reduces, and ZeRO gathers, one unit at a time.
struct ModelUnit {
  int64_t offset = 0, numel = 0;  // its slice [offset, offset + numel) of the flat buffer
  int first = 0, count = 0;       // its parameters: named_params[first, first + count)
};

struct Model {
  ModelConfig cfg;
  TensorParallel tp;     // the tp group (size 1: the whole model on this rank)
  LocalDims local;       // this rank's heads, ffn and vocabulary slice
  int64_t num_params = 0;  // parameters on this rank: the whole model over tp
  std::vector<TpSlice> layouts;  // per named parameter: where its shard sits in the whole
  // [num_params] flat, Mem::Params and Mem::Grads. A sharded optimizer (zero.cu) may hold the
  // memory instead: then these are undefined or padded, and the views point where it binds them.
  Tensor params, grads;
  Weights w, g;                                        // views into params and grads
  std::vector<NamedTensor> named_params, named_grads;  // HF order (the checkpoint's order)
  std::vector<int64_t> offsets;  // per named parameter: its first element in the flat buffer
  std::vector<ModelUnit> units;  // embedding, blocks 0..L-1, head
};
// Allocates the flat buffers and initialises every weight from (seed, name, element index):
// linear and embedding weights N(0, init_std), norm weights 1.
// Under tensor parallelism each rank allocates and initialises exactly its shards.
Model build_model(const ModelConfig& cfg, Device device, uint64_t seed,
                  const TensorParallel& tp = {});
// The layout alone (names, shapes, offsets, units), no memory: every view is unbound (its
// shape is set, its data pointer null) until bind_unit_params / bind_unit_grads point it.
Model build_model_layout(const ModelConfig& cfg, const TensorParallel& tp = {});
// Points the views of unit u at `base`, which holds the unit laid out as in the flat buffer
// (base[k] is flat element units[u].offset + k); an undefined `base` unbinds them.
void bind_unit_params(Model& m, int u, const Tensor& base);
void bind_unit_grads(Model& m, int u, const Tensor& base);
// out[k] := flat element first + k of the initial parameters: any slice, layout-free (DESIGN 5).
void init_parameters(const Model& m, uint64_t seed, const Tensor& out, int64_t first);
// Views of `flat` ([num_params], any device) under the parameter names and shapes: a whole copy
// of the weights, the gradients or an optimizer moment, in the checkpoint's order.
std::vector<NamedTensor> named_views(const Model& m, const Tensor& flat);

// Hooks around each unit's forward and backward, by hook index i (see ModelUnit). after_backward
// runs as soon as the unit's weight gradients are final: the seam where data parallelism
// launches a bucket's all-reduce and ZeRO a reduce-scatter; ZeRO-3 gathers a unit's weights
// in before_forward / before_backward and frees them in after_forward / after_backward.
struct UnitHooks {
  std::function<void(int)> before_forward, after_forward, before_backward, after_backward;
};

// What one micro-batch's forward saves for its backward (its own object, so a pipeline can
// hold several in flight). Which tensors are kept depends on the recompute mode.
// Shapes for N = B*T tokens and n = N/tp under sequence parallelism (else n = N); Hl, KVl and
// Fl are this rank's heads, kv heads and ffn columns (LocalDims).
struct BlockActivations {
  Tensor x;             // [n, D] block input (always kept)
  Tensor norm1, rstd1;  // [n, D], [n]
  Tensor q, k, v;       // [N, Hl*hd], [N, KVl*hd] x2 (after RoPE)
  Tensor probs;         // [B, Hl, T, T] (dropped by selective recompute)
  Tensor attn;          // [N, Hl*hd] attention output before wo
  Tensor x_mid;         // [n, D] after the attention residual
  Tensor norm2, rstd2;  // [n, D], [n]
  Tensor gate, up, act;  // [N, Fl] x3
};
// Bytes of one block's saved activations for B sequences of T tokens, by the formula derived
// in model.cu (the fp32, RMSNorm, SwiGLU, GQA analog of the book's sbh(34 + 5as/h)).
int64_t activation_bytes_per_block(const ModelConfig& cfg, int B, int T, int tp, bool sp,
                                   Recompute mode);
// The same, measured: the bytes `a` holds.
int64_t saved_bytes(const BlockActivations& a);
struct Activations {
  int B = 0, T = 0;
  Tensor ids, targets, positions;  // [N] int32, N = B*T
  std::vector<BlockActivations> blocks;
  Tensor x_final, normf, rstdf;  // [n, D], [n, D], [n]
  Tensor logits;                 // [N, V / tp] this rank's vocabulary slice
  Tensor losses;                 // [N] per-token cross-entropy
  Tensor ce_stats;               // [N, 2] row max and sum of exponentials (vocab-parallel)
};

// Runs the forward pass of B sequences of T tokens (ids and targets are host arrays [B*T]);
// returns the sum of per-token losses (fp32 accumulation). With targets == nullptr only the
// logits are computed (generation).
float model_forward(const Context& ctx, const Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode,
                    const UnitHooks& hooks = {});
// Accumulates (+=) into the gradient views the gradient of loss_scale * sum(losses), and releases
// the activations as it goes. Units run in backward order: the head (hook index layers), blocks
// layers-1 ... 0, then the embedding (-1).
void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks = {});
