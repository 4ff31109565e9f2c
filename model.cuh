// model.cuh: a tiny Llama (DESIGN section 6) with hand-written forward and backward.
// Parameters live in one flat buffer (and gradients in another) so that data parallelism and
// ZeRO can treat them as contiguous memory; each named tensor is a view into it.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "expert_parallel.cuh"
#include "flash_attention.cuh"
#include "runtime/core.cuh"
#include "runtime/meters.cuh"
#include "runtime/model_config.cuh"
#include "runtime/parameters.cuh"
#include "tensor_parallel.cuh"

enum class Recompute { None, Selective, Full };  // Playbook §2.6
Recompute parse_recompute(const std::string& flag);
const char* recompute_name(Recompute r);
namespace CLI {
class App;
}
struct ModelOptions {
  Recompute recompute = Recompute::None;  // --recompute
};
void add_model_flags(CLI::App& app, ModelOptions& o);

// The weights of one block, as views into the flat buffer (the gradients use the same struct).
struct BlockWeights {
  Tensor attn_norm, attn_norm_bias;  // [D] (the bias: LayerNorm's only)
  Tensor wq;                         // [Hq*hd, D]
  Tensor wk, wv;                     // [Hkv*hd, D]
  Tensor wo;                         // [D, Hq*hd]
  Tensor mlp_norm, mlp_norm_bias;    // [D]
  Tensor w_gate, w_up;               // [F, D]   the dense MLP (GeLU's: up alone)
  Tensor w_down;                     // [D, F]
  MoeWeights moe;  // or a mixture of experts (expert_parallel.cuh): router, this rank's experts
};
struct Weights {
  Tensor embed;  // [V, D]
  std::vector<BlockWeights> blocks;
  Tensor final_norm, final_norm_bias;  // [D]
  Tensor lm_head;                      // [V, D] (a view of embed when tied)
};
struct Model;
struct BlockActivations;
// What a run's steps are made of, for the meters that predict their traffic: micro-batches of
// mbs sequences of seq tokens on this rank (seq / cp under context parallelism), grad_acc of
// them per step on each of dp data-parallel ranks.
struct RunShape {
  int mbs = 1, grad_acc = 1, dp = 1, seq = 1;
  Recompute recompute = Recompute::None;
  Precision precision = Precision::FP32;  // --dtype (a mixture's rows travel in its format)
};
// The block's MLP (DESIGN 6, "Feed-forward"): the dense SwiGLU, or a mixture of experts
// (expert_parallel.cu), chosen by the config when the model is built; the block asks neither.
// The residual stream's gradient [n, D]: `sum` in fp32, which the norms' backwards add into;
// `rounded`, where the linear layers that read it next take it in a 16-bit format and no
// sequence-parallel gather comes first, its copy in that format, written by the norm's backward
// that finished the sum (undefined otherwise: the GEMMs round `sum` themselves, as they did).
struct ResidualGradient {
  Tensor sum, rounded;
  const Tensor& for_gemms() const { return rounded.defined() ? rounded : sum; }
  bool gemms_read_sum() const { return !rounded.defined(); }  // which later adds change
};

// The block's norms (DESIGN 6, "Norm"): RMSNorm (the Llama), or LayerNorm with a bias (the
// book's GPT), chosen by the config when the model is built; the block asks neither.
struct NormWeights {
  Tensor weight, bias;  // [D] each (the bias: LayerNorm's only)
};
struct Normalization {
  virtual ~Normalization() = default;
  // What the backward reads of n tokens besides the input: [n] 1/rms, or [n, 2] mean and 1/std.
  virtual std::vector<int64_t> stats_shape(int64_t n) const = 0;
  // y = norm(x); with `branch`, y = norm(sum) of sum = x + branch, which it writes (one pass where
  // a kernel fuses the residual add and the norm).
  virtual void forward(const Context& ctx, const Tensor& y, const Tensor& stats, const Tensor& x,
                       const Tensor& branch, const Tensor& sum, const NormWeights& w,
                       float eps) const = 0;
  // dx += the gradient of <dy, norm(x)>, g's weight (and bias) += theirs, summed over the tp
  // group under sequence parallelism; `dx_rounded` (when defined): dx's new value rounded into
  // it, for the linear layers that read it next (rmsnorm_backward).
  virtual void backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                        const NormWeights& g, const Tensor& dy, const Tensor& x,
                        const NormWeights& w, const Tensor& stats,
                        const Tensor& dx_rounded) const = 0;
};

struct FeedForward {
  virtual ~FeedForward() = default;
  // Its output [n, D] (a workspace the residual add reads: fp32, or in the compute format) from
  // x [n, D], the post-attention norm's output, keeping what the backward needs in `a`.
  // `carry`: what the micro-batch carries from layer to layer and stage to stage
  // (Activations::carry), added to; null when the block is recomputed.
  virtual Tensor forward(const Context& ctx, const Model& m, int layer, const BlockWeights& w,
                         BlockActivations& a, const Tensor& x, std::vector<float>* carry) const = 0;
  // dx [n, D] (returned, a workspace as the output is) and the weights' gradients (+=; or
  // queued on `deferred`) from dout [n, D] (read as its GEMMs take it, or in fp32); `carry` as
  // the last layer left it; `loss_scale` the one the loss's gradient starts from.
  virtual Tensor backward(const Context& ctx, const Model& m, const BlockWeights& w,
                          const BlockWeights& g, BlockActivations& a, const Tensor& x,
                          const ResidualGradient& dout, const std::vector<float>& carry,
                          float loss_scale, DeferredGrads* deferred) const = 0;
  // Floats that travel with the hidden state between pipeline stages (0: none).
  virtual int carry_numel() const { return 0; }
  // After the last block, on the stage with the head: the carried values complete.
  virtual void finish(const Model&, const std::vector<float>&, int64_t) const {}
  // Bytes it keeps for the backward on N tokens, e per element (activation_bytes_per_block).
  virtual int64_t saved_bytes(const ModelConfig& c, int64_t N, int tp, int e) const = 0;
  // What it measures of the training steps (a mixture: its routing, its all-to-all, its
  // load-balancing loss in the step's log), registered with the run's meters; null: nothing.
  virtual std::unique_ptr<StepMeter> meter(Model&, Comm&, const RunShape&) const { return nullptr; }
};

// A pipeline stage (DESIGN 6, "Stage"): the blocks [first_block, last_block), with the
// embedding or not (the first stage) and with the final norm + LM head + loss or not (the last).
// The whole model is the one stage that holds everything; last_block -1 means every block.
// A rank holds one stage, or several model chunks under an interleaved pipeline (Playbook §8.5).
struct Stage {
  int first_block = 0, last_block = -1;
  bool embedding = true, head = true;
};

// This rank's part of the model: its parameters in flat buffers (FlatParameters,
// runtime/parameters.cuh: units per chunk: [embedding], its blocks, [head]), viewed as the
// Llama's weights, and how it computes: its tensor-parallel slice and its attention core.
struct Model : FlatParameters {
  ModelConfig cfg;
  std::vector<Stage> chunks;  // the parts of the model this rank holds, in order (resolved)
  TensorParallel tp;          // the tp group and this rank's heads, ffn and vocabulary slice
  // The attention core (flash_attention.cuh): naive, flash, or ring attention over the cp
  // group; train's --attention and --cp choose (default here: naive, the reference).
  std::shared_ptr<const AttentionCore> attention = local_attention(AttentionKind::Naive);
  // The MLP: dense, or a mixture of experts over the ep group (ep: which experts are here).
  ExpertParallel ep;
  std::shared_ptr<const FeedForward> mlp;
  std::shared_ptr<const Normalization> norm;  // RMSNorm or LayerNorm
  uint64_t seed = 0;                          // the run's --seed: dropout's masks are drawn from it
  Weights w, g;                               // views into params and grads
  std::vector<int> chunk_unit0, chunk_block0;  // per chunk: its first unit and first block in w
  int blocks(int chunk) const { return chunks[chunk].last_block - chunks[chunk].first_block; }
  int embedding_unit() const { return chunks.front().embedding ? 0 : -1; }  // -1: not here
  int head_unit() const { return chunks.back().head ? (int)units.size() - 1 : -1; }
  // A block is one unit, or two under a mixture of experts: its dense part (attention, norms,
  // the router) and its experts, whose gradients sum over another group (ModelUnit::experts).
  int units_per_block() const { return cfg.experts > 0 ? 2 : 1; }
  // The blocks this rank holds, over all its chunks; the parameters of its expert units.
  int blocks_held() const;
  int64_t expert_params() const;
  // The (first) unit of block l (0-based within chunk c).
  int block_unit(int c, int l) const {
    return chunk_unit0[c] + (chunks[c].embedding ? 1 : 0) + l * units_per_block();
  }

  // ---- FlatParameters ----
  void bind_unit_params(int u, const Tensor& base) override;
  void bind_unit_grads(int u, const Tensor& base) override;
  // Linear and embedding weights N(0, init_std), norm weights 1 (DESIGN 5).
  void init_parameters(uint64_t seed, const Tensor& out, int64_t first) const override;
  // A tied LM head reads (and writes the gradient of) the embedding's weights; the embedding's
  // backward reads no weights (a scatter-add of the ids).
  std::vector<int> weights_read(int u, bool backward) const override;
  std::vector<int> grads_written(int u) const override;
  std::unique_ptr<FlatParameters> whole_layout() const override;
};
// Allocates the flat buffers and initialises every weight from (seed, name, element index).
// Under tensor parallelism each rank allocates and initialises exactly its shards.
// `chunks`: the stages this rank holds (empty: the whole model); `ep`: which experts (a
// mixture of experts; default: all of them).
Model build_model(const ModelConfig& cfg, Device device, uint64_t seed,
                  const TensorParallel& tp = {}, std::vector<Stage> chunks = {},
                  const ExpertParallel& ep = {});
// The layout alone (names, shapes, offsets, units), no memory: every view is unbound (its
// shape is set, its data pointer null) until bind_unit_params / bind_unit_grads point it;
// a gradient sync allocates what it keeps (allocate_flat, or its shards).
Model build_model_layout(const ModelConfig& cfg, const TensorParallel& tp = {},
                         std::vector<Stage> chunks = {}, const ExpertParallel& ep = {});

// What one micro-batch's forward saves for its backward (its own object, so a pipeline can
// hold several in flight). Which tensors are kept depends on the recompute mode.
// Shapes for N = B*T tokens and n = N/tp under sequence parallelism (else n = N); Hl, KVl and
// Fl are this rank's heads, kv heads and ffn columns (LocalDims, tensor_parallel.cuh).
struct BlockActivations {
  Tensor x;              // [n, D] block input (always kept)
  Tensor norm1, rstd1;   // [n, D], and the norm's statistics (Normalization::stats_shape)
  Tensor q, k, v;        // [N, Hl*hd], [N, KVl*hd] x2 (after RoPE)
  AttentionSaved saved;  // naive attention's [B, Hl, T, T] probabilities (dropped by selective
                         // recompute), or FlashAttention's [B, Hl, T] log-sum-exp
  Tensor attn;           // [N, Hl*hd] attention output before wo
  Tensor x_mid;          // [n, D] after the attention residual
  Tensor norm2, rstd2;   // [n, D], and its statistics
  Tensor gate, up, act;  // [N, Fl] x3 (the dense MLP; GeLU's: up, its input, and act)
  Tensor drop1, drop2;   // [n, D] U8: dropout's masks on the attention's and the MLP's outputs
  MoeActivations moe;    // or the mixture's (expert_parallel.cuh)
};
// Bytes of one block's saved activations for B sequences of T tokens, by the formula derived
// in model.cu (the RMSNorm, SwiGLU, GQA analog of the book's sbh(34 + 5as/h)). e: the bytes of
// an element of what is stored in the compute format (4 in fp32, 2 under --dtype bf16, fp16 or
// fp8); er: of the residual stream (4, or 2 under --residual-dtype); the statistics are fp32.
int64_t activation_bytes_per_block(const ModelConfig& cfg, int B, int T, int tp, bool sp,
                                   Recompute mode, const AttentionCore& attention, int e = 4,
                                   int er = 4);
// The same, measured: the bytes `a` holds.
int64_t saved_bytes(const BlockActivations& a);
// --report memory: one block's saved activations, `measured` on a micro-batch of B sequences
// of T tokens (this rank's share under cp), next to the formula above. Rank 0 prints.
void print_activation_report(const Model& model, int B, int T, Recompute mode, int e, int er,
                             int64_t measured);
// The configuration table's row for --recompute: what the mode drops with this attention.
std::string describe_recompute(Recompute mode, const AttentionCore& attention);
struct Activations {
  int B = 0, T = 0;
  Tensor ids, targets, positions;  // [N] int32, N = B*T
  // [N] int32: each token's sequence, numbered in the run (dropout's masks are drawn from it);
  // undefined when nothing is dropped (evaluation, sampling, or --dropout 0).
  Tensor sequences;
  std::vector<BlockActivations> blocks;  // this chunk's blocks
  Tensor x_final;       // [n, D] the last block's output: the stage's output hidden state
  Tensor normf, rstdf;  // [n, D], [n]
  Tensor logits;        // [N, V / tp] this rank's vocabulary slice
  Tensor losses;        // [N] per-token cross-entropy
  Tensor ce_stats;      // [N, 2] row max and sum of exponentials (vocab-parallel)
  // What travels with the hidden state from layer to layer and stage to stage
  // (FeedForward::carry_numel floats): a mixture of experts' routing counts, which its
  // load-balancing loss needs over every layer. Empty for a dense model.
  std::vector<float> carry;
};

// ---- The stage seam (DESIGN 6): what a pipeline schedule runs, one micro-batch at a time ----
// What one micro-batch hands from a stage to the next: its hidden state [n, D] first, then what
// its blocks carry besides (FeedForward::carry_numel floats, Activations::carry); and back, the
// hidden state's gradient first, then the same carried values, complete. The pipeline moves
// these tensors between stages without reading them.
using StagePayload = std::vector<Tensor>;
// What one micro-batch's payload of `tokens` tokens holds (the same forward and back): the hidden
// state in the residual stream's format (ctx.residual), then the carried floats.
std::vector<TensorSpec> stage_payload(const Context& ctx, const Model& model, int64_t tokens);
// What a chunk's forward hands to the next one: acts.x_final and the carried values.
StagePayload stage_output(const Context& ctx, const Model& model, const Activations& acts);
// A forward that no backward follows (evaluation, sampling) keeps what full recomputation keeps,
// each block's input, not the activations a backward would read.
constexpr Recompute kForwardOnly = Recompute::Full;
// Forward of B sequences of T tokens through chunk `chunk` of this rank. Input: token ids (host
// [B*T]) when the chunk holds the embedding, else the previous chunk's payload `in`.
// Returns, when it holds the head, the sum of per-token losses (fp32 accumulation), left on the
// device until read_total reads it (runtime/ops.cuh; with targets == nullptr only the logits are
// computed, for generation: no sum); elsewhere no sum, and acts.x_final holds the output for the
// next stage.
// `sequence0`: the number in the run of the micro-batch's first sequence (train's data order,
// runtime/data.cuh), from which dropout draws its masks; -1: a forward that drops nothing.
PendingSum stage_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                         StagePayload in, const int32_t* targets, int B, int T, Recompute mode,
                         const UnitHooks& hooks = {}, int chunk = 0, int64_t sequence0 = -1);
// Accumulates (+=) into the gradient views the gradient of loss_scale * sum(losses) (the head's
// chunk) or of <d_out[0], output> (other chunks, `d_out` the next chunk's payload back),
// releasing the activations as it goes; units run in backward order. Returns the payload for
// the previous chunk: d(input hidden) [n, D] and the carried values (empty for the chunk that
// holds the embedding). With `deferred` (zero-bubble pipelines, Playbook §8.6) only the input
// gradients are computed: the linear layers' weight gradients and the after_backward hooks are
// queued there, in order, for the schedule's W op.
StagePayload stage_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                            StagePayload d_out, Recompute mode, const UnitHooks& hooks = {},
                            int chunk = 0, DeferredGrads* deferred = nullptr);
// The whole model as one stage: ids in, loss (or logits) out; and its backward.
float model_forward(const Context& ctx, Model& model, Activations& acts, const int32_t* ids,
                    const int32_t* targets, int B, int T, Recompute mode,
                    const UnitHooks& hooks = {}, int64_t sequence0 = -1);
void model_backward(const Context& ctx, Model& model, Activations& acts, float loss_scale,
                    Recompute mode, const UnitHooks& hooks = {});
