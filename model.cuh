// model.cuh: a tiny Llama (DESIGN section 6) with hand-written forward and backward.
// Parameters live in one flat buffer (and gradients in another) so that data parallelism and
// ZeRO can treat them as contiguous memory; each named tensor is a view into it.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "context_parallel.cuh"
#include "runtime/core.cuh"
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
  std::string loaded_config;  // the config.json --load read ("": none), which --save writes back
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
// The attention core: naive (keeps the [B, H, T, T] probabilities, Playbook §2.5) or
// FlashAttention (keeps the output and one log-sum-exp per query and head, §12.8).
enum class Attention { Naive, Flash };
Attention parse_attention(const std::string& flag);  // naive|flash
const char* attention_name(Attention a);

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

// A pipeline stage (DESIGN 6, "Stage"): the blocks [first_block, last_block), with the
// embedding or not (the first stage) and with the final norm + LM head + loss or not (the last).
// The whole model is the one stage that holds everything; last_block -1 means every block.
// A rank holds one stage, or several model chunks under an interleaved pipeline (Playbook §8.5).
struct Stage {
  int first_block = 0, last_block = -1;
  bool embedding = true, head = true;
};

// A unit: the parameters one hook covers (the embedding, one block, or the head: final norm and
// LM head unless tied), a contiguous slice of the flat buffer. Data parallelism reduces, and
// ZeRO gathers, one unit at a time. Units are in forward order: u + 1 runs after u.
struct ModelUnit {
  std::string name;               // "embedding", "block 3", "head"
  int64_t offset = 0, numel = 0;  // its slice [offset, offset + numel) of the flat buffer
  int first = 0, count = 0;       // its parameters: named_params[first, first + count)
};

struct Model {
  ModelConfig cfg;
  std::vector<Stage> chunks;  // the parts of the model this rank holds, in order (resolved)
  TensorParallel tp;     // the tp group and this rank's heads, ffn and vocabulary slice
  Attention attention = Attention::Naive;  // train's --attention chooses (default flash)
  ContextParallel cp;    // the cp group: this rank holds T/cp tokens of every sequence
  CpWork* cp_work = nullptr;  // where ring attention counts its blocks (--report balance)
  int64_t num_params = 0;  // parameters on this rank: the stage's, over tp
  std::vector<TpSlice> layouts;  // per named parameter: where its shard sits in the whole
  // [num_params] flat, Mem::Params and Mem::Grads. A sharded optimizer (zero.cu) may hold the
  // memory instead: then these are undefined or padded, and the views point where it binds them.
  Tensor params, grads;
  Weights w, g;                                        // views into params and grads
  std::vector<NamedTensor> named_params, named_grads;  // HF order (the checkpoint's order)
  std::vector<int64_t> offsets;  // per named parameter: its first element in the flat buffer
  std::vector<ModelUnit> units;  // per chunk: [embedding], its blocks, [head]
  std::vector<int> chunk_unit0, chunk_block0;  // per chunk: its first unit and first block in w
  int blocks(int chunk) const { return chunks[chunk].last_block - chunks[chunk].first_block; }
  int embedding_unit() const { return chunks.front().embedding ? 0 : -1; }  // -1: not here
  int head_unit() const { return chunks.back().head ? (int)units.size() - 1 : -1; }
  // The unit of block l (0-based within chunk c).
  int block_unit(int c, int l) const { return chunk_unit0[c] + (chunks[c].embedding ? 1 : 0) + l; }
};
// Allocates the flat buffers and initialises every weight from (seed, name, element index):
// linear and embedding weights N(0, init_std), norm weights 1.
// Under tensor parallelism each rank allocates and initialises exactly its shards.
// `chunks`: the stages this rank holds (empty: the whole model).
Model build_model(const ModelConfig& cfg, Device device, uint64_t seed,
                  const TensorParallel& tp = {}, std::vector<Stage> chunks = {});
// The layout alone (names, shapes, offsets, units), no memory: every view is unbound (its
// shape is set, its data pointer null) until bind_unit_params / bind_unit_grads point it.
Model build_model_layout(const ModelConfig& cfg, const TensorParallel& tp = {},
                         std::vector<Stage> chunks = {});
// Allocates the flat parameter and gradient buffers of a layout, binds every view and
// initialises the weights (what build_model does after build_model_layout). With bf16
// gradients (--grad-acc-dtype bf16) the gradient views stay unbound: the backward accumulates
// each unit in an fp32 buffer of its own, bound around it (data_parallel.cu).
void allocate_model(Model& m, Device device, uint64_t seed, DType grad_dtype = DType::F32);
// Points the views of unit u at `base`, which holds the unit laid out as in the flat buffer
// (base[k] is flat element units[u].offset + k); an undefined `base` unbinds them.
void bind_unit_params(Model& m, int u, const Tensor& base);
void bind_unit_grads(Model& m, int u, const Tensor& base);
// out[k] := flat element first + k of the initial parameters: any slice, layout-free (DESIGN 5).
void init_parameters(const Model& m, uint64_t seed, const Tensor& out, int64_t first);
// Views of `flat` ([num_params], any device) under the parameter names and shapes: a whole copy
// of the weights, the gradients or an optimizer moment, in the checkpoint's order.
std::vector<NamedTensor> named_views(const Model& m, const Tensor& flat);

// Hooks around each unit's forward and backward, by unit index (Model::units). after_backward
// runs as soon as the unit's weight gradients are final: the seam where data parallelism
// launches a bucket's all-reduce and ZeRO a reduce-scatter; ZeRO-3 gathers a unit's weights
// in before_forward / before_backward and frees them in after_forward / after_backward.
struct UnitHooks {
  std::function<void(int)> before_forward, after_forward, before_backward, after_backward;
};

// What one micro-batch's forward saves for its backward (its own object, so a pipeline can
// hold several in flight). Which tensors are kept depends on the recompute mode.
// Shapes for N = B*T tokens and n = N/tp under sequence parallelism (else n = N); Hl, KVl and
// Fl are this rank's heads, kv heads and ffn columns (LocalDims, tensor_parallel.cuh).
struct BlockActivations {
  Tensor x;             // [n, D] block input (always kept)
  Tensor norm1, rstd1;  // [n, D], [n]
  Tensor q, k, v;       // [N, Hl*hd], [N, KVl*hd] x2 (after RoPE)
  Tensor probs;         // [B, Hl, T, T] naive attention (dropped by selective recompute)
  Tensor lse;           // [B, Hl, T] FlashAttention's log-sum-exp per query and head (under
                        // context parallelism, per piece of this rank's tokens)
  Tensor attn;          // [N, Hl*hd] attention output before wo
  Tensor x_mid;         // [n, D] after the attention residual
  Tensor norm2, rstd2;  // [n, D], [n]
  Tensor gate, up, act;  // [N, Fl] x3
};
// Bytes of one block's saved activations for B sequences of T tokens, by the formula derived
// in model.cu (the RMSNorm, SwiGLU, GQA analog of the book's sbh(34 + 5as/h)). e: the bytes of
// an element of what is stored in the compute format (4 in fp32, 2 under --dtype bf16, fp16 or
// fp8); the residual stream and the statistics are fp32 always.
int64_t activation_bytes_per_block(const ModelConfig& cfg, int B, int T, int tp, bool sp,
                                   Recompute mode, Attention attention = Attention::Naive,
                                   int e = 4);
// The same, measured: the bytes `a` holds.
int64_t saved_bytes(const BlockActivations& a);
struct Activations {
  int B = 0, T = 0;
  Tensor ids, targets, positions;  // [N] int32, N = B*T
  std::vector<BlockActivations> blocks;  // this chunk's blocks
  Tensor x_final;                // [n, D] the last block's output: the stage's output hidden state
  Tensor normf, rstdf;           // [n, D], [n]
  Tensor logits;                 // [N, V / tp] this rank's vocabulary slice
  Tensor losses;                 // [N] per-token cross-entropy
  Tensor ce_stats;               // [N, 2] row max and sum of exponentials (vocab-parallel)
};

// ---- The stage seam (DESIGN 6): what a pipeline schedule runs, one micro-batch at a time ----
// Forward of B sequences of T tokens through chunk `chunk` of this rank. Input: token ids (host
// [B*T]) when the chunk holds the embedding, else hidden_in [n, D] from the previous stage.
// Returns, when it holds the head, the sum of per-token losses (fp32 accumulation; with
// targets == nullptr only the logits are computed, for generation); elsewhere 0, and
// acts.x_final holds the output for the next stage.
float stage_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                    const Tensor& hidden_in, const int32_t* targets, int B, int T,
                    Recompute mode, const UnitHooks& hooks = {}, int chunk = 0);
// Accumulates (+=) into the gradient views the gradient of loss_scale * sum(losses) (the head's
// chunk) or of <d_out, output> (d_out [n, D], other chunks), releasing the activations as it
// goes; units run in backward order. Returns d(input hidden) [n, D], undefined for the chunk
// that holds the embedding. With `deferred` (zero-bubble pipelines, Playbook §8.6) only the
// input gradients are computed: the linear layers' weight gradients and the after_backward
// hooks are queued there, in order, for the schedule's W op.
Tensor stage_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                      const Tensor& d_out, Recompute mode, const UnitHooks& hooks = {},
                      int chunk = 0, DeferredGrads* deferred = nullptr);
// The whole model as one stage: ids in, loss (or logits) out; and its backward.
float model_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode,
                    const UnitHooks& hooks = {});
void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks = {});
