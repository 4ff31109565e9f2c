// tensor_parallel.cuh: Megatron-style tensor parallelism and sequence parallelism
// (Playbook §5 and §6). Weights are split across the tp group; activations are full inside a
// "tensor-parallel region" (between a column-parallel and a row-parallel linear) and, with
// --sp, sharded along the tokens outside it.
#pragma once
#include <functional>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/meters.cuh"
#include "runtime/model_config.cuh"
#include "runtime/parameters.cuh"

// The slice of the model one tensor-parallel rank holds (Playbook §5.3): query heads, ffn
// columns and vocabulary rows split evenly over tp; key/value heads split too, or, when tp
// exceeds them, the one kv head this rank's query heads read, replicated on kv_replicas ranks.
struct LocalDims {
  int heads = 0, head0 = 0;  // query heads [head0, head0 + heads)
  int kv_heads = 0, kv_head0 = 0, kv_replicas = 1;
  int ffn = 0, ffn0 = 0;      // intermediate columns [ffn0, ffn0 + ffn)
  int vocab = 0, vocab0 = 0;  // vocabulary rows [vocab0, vocab0 + vocab)
  int tp_rank = 0;
};
LocalDims local_dims(const ModelConfig& cfg, int tp_rank, int tp_size);
// Throws UsageError unless --tp divides heads, ffn and vocab, kv heads and tp divide one
// another, and (with --sp) --tp is 2 or more and divides --seq.
void validate_tensor_parallel(const ModelConfig& cfg, int tp, bool sp);

// ---- Flags (Playbook §5, §6) ----
namespace CLI {
class App;
}
struct TensorParallelOptions {
  int tp = 1;       // --tp: tensor-parallel ranks
  bool sp = false;  // --sp: sequence parallelism in the tp group
};
void add_tensor_parallel_flags(CLI::App& app, TensorParallelOptions& o);
// The configuration table's note on the grid row: ", sequence parallel" under --sp.
std::string describe_tensor_parallel(const TensorParallelOptions& o);

// The tp group, whether sequence parallelism is on, and this rank's slice of the model (set by
// build_model). size 1 turns every operator into the identity and every layer below into a
// plain one, so the model makes the same calls with or without tensor parallelism.
struct TensorParallel {
  Comm* comm = nullptr;
  bool sp = false;
  LocalDims local;
  Group& group() const { return comm->tp; }
  int size() const { return comm ? comm->tp.size : 1; }
  int rank() const { return comm ? comm->tp.rank : 0; }
};

// ---- The conjugate operators (Megatron's names; f, f*, g, g* of the book) ----
// Activations are [tokens, features]; sequence shards are contiguous ranges of tokens.
// copy_to_tensor_parallel_region (f): forward identity, backward all-reduce of dx.
void copy_to_tp_region_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx);
// reduce_from_tensor_parallel_region (f*): forward all-reduce, backward identity.
void reduce_from_tp_region_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x);
// gather_from_sequence_parallel_region (g): forward all-gather [N/tp, D] -> [N, D],
// backward reduce-scatter [N, D] -> [N/tp, D].
void gather_from_sp_region_forward(const TensorParallel& tp, const Context& ctx,
                                   const Tensor& shard, const Tensor& full);
void gather_from_sp_region_backward(const TensorParallel& tp, const Context& ctx,
                                    const Tensor& dfull, const Tensor& dshard);
// reduce_scatter_to_sequence_parallel_region (g*): forward reduce-scatter [N, D] -> [N/tp, D],
// backward all-gather [N/tp, D] -> [N, D].
void scatter_to_sp_region_forward(const TensorParallel& tp, const Context& ctx, const Tensor& full,
                                  const Tensor& shard);
void scatter_to_sp_region_backward(const TensorParallel& tp, const Context& ctx,
                                   const Tensor& dshard, const Tensor& dfull);

// ---- Entering and leaving a tensor-parallel region, TP or TP+SP alike ----
// enter: x [N_in, D] (N_in = N/tp under SP, else N) -> full [N, D] (f, or g under SP).
// Without SP `full` may be `x` itself (the forward is then nothing).
void tp_region_enter_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                             const Tensor& full);
// dx [N_in, D] = the backward of enter applied to dfull [N, D]: all-reduce (dx may then be
// dfull itself), or reduce-scatter under SP.
void tp_region_enter_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dfull,
                              const Tensor& dx);
// exit: partial sums [N, D] of a row-parallel linear -> out [N_out, D] (f*, or g* under SP).
// Without SP `out` may be `partial` itself.
void tp_region_exit_forward(const TensorParallel& tp, const Context& ctx, const Tensor& partial,
                            const Tensor& out);
// dpartial [N, D] = the backward of exit applied to dout [N_out, D] (identity, or all-gather).
void tp_region_exit_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dout,
                             const Tensor& dpartial);
// Tokens a rank holds outside tensor-parallel regions: N/tp under SP, else N.
int64_t sp_tokens(const TensorParallel& tp, int64_t tokens);

// The weight-gradient halves of a backward pass (dW += dy^T x, and the sums of replicated
// copies), held back by a zero-bubble pipeline schedule to run later as its W op (Playbook
// §8.6); run in order. Each captures the tensors it reads, and says what it computes (the W op
// shows it in the trace; null for a gradient hook, which computes nothing).
struct DeferredGrad {
  const char* what;  // "dW", "experts' dW", or null
  std::function<void()> run;
};
using DeferredGrads = std::vector<DeferredGrad>;
// Runs `weights` now, or queues it on `deferred` (a zero-bubble schedule's W op) as `what`.
void weight_half(DeferredGrads* deferred, const char* what, std::function<void()> weights);

// ---- The layers the model is built from (Playbook §5.2-§5.4, §6) ----
// Shapes: N = B*T tokens; n = N/tp under SP (a rank's contiguous run of tokens), else N.
// ColumnParallelLinear for the projections that read one input (q, k, v; gate, up; the LM
// head): x [n, D] enters the tensor-parallel region (f; g under SP: all-gathered to [N, D]),
// then outputs[i].y [N, rows_i] = x W_i^T, each rank computing its own output rows.
struct ColumnOutput {
  Tensor y, W;
};
void column_parallel_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                             const std::vector<ColumnOutput>& outputs);
// Its GEMMs (and the backward's weight gradients): the same linear on one input x for neighbours
// of one shape (the k and v projections; the MLP's gate and up), y_i = x @ W_i^T and
// dW_i += dy_i^T @ x. Where the weights as the GEMM reads them (fp32, or their kept 16-bit
// copies on the GPU path) and the outputs (or the gradients and their accumulators) each sit
// evenly spaced in memory, one strided-batched GEMM (runtime/ops.cuh) runs them all: the same
// values, one launch. Otherwise one linear_forward (or linear_backward) each; always so under
// fp8, whose GEMMs quantize each weight on its own.
void linear_forward_many(const Context& ctx, const std::vector<Tensor>& ys, const Tensor& x,
                         const std::vector<Tensor>& Ws);
void linear_weight_grads_many(const Context& ctx, const std::vector<Tensor>& dWs,
                              const std::vector<Tensor>& dys, const Tensor& x,
                              const std::vector<Tensor>& Ws);
// Backward: dx [n, D] = (f or g backward)(sum_i dy_i W_i), and dW_i += dy_i^T x (now, or
// queued on `deferred`). A weight with kv_replicated set holds one kv head that several ranks
// share: its gradient is summed over those copies (each served only its own query heads).
struct ColumnGrad {
  Tensor dy, W, dW;
  bool kv_replicated = false;
};
void column_parallel_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                              const Tensor& x, const std::vector<ColumnGrad>& grads,
                              DeferredGrads* deferred = nullptr);
// RowParallelLinear: x [N, cols/tp] (this rank's columns) times its block of W gives partial
// sums, which leave the region (f*: all-reduce into y [N, D]; g* under SP: reduce-scatter into
// y [N/tp, D]).
void row_parallel_forward(const TensorParallel& tp, const Context& ctx, const Tensor& y,
                          const Tensor& x, const Tensor& W);
// A [n, D] workspace for what leaves the tensor-parallel region: a row-parallel layer's output,
// a column-parallel layer's input gradient. fp32 where the tp ranks' partial sums are reduced
// into it (the reduction sums fp32); else in the compute format: one rank's GEMM writes it
// rounded on its way out, and what reads it (the residual add, the norm's backward) widens.
Tensor tp_region_output(const TensorParallel& tp, const Context& ctx, int64_t n, int64_t D);
// dx [N, cols/tp] = (f* or g* backward)(dy) W ; dW += that^T x (now, or queued on `deferred`).
// `dy_changes`: dy is the residual stream's gradient itself, which the caller adds into once
// this returns, so a queued dW must read a copy.
void row_parallel_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                           const Tensor& dW, const Tensor& dy, bool dy_changes, const Tensor& x,
                           const Tensor& W, DeferredGrads* deferred = nullptr);
// VocabParallelEmbedding: each rank looks up the ids of its vocabulary slice (ids from
// local_vocab_ids: -1 gives a zero row) and the partial rows leave the region into x [n, D].
void vocab_parallel_embedding_forward(const TensorParallel& tp, const Context& ctx, const Tensor& x,
                                      const Tensor& local_ids, const Tensor& table);
// dtable [V/tp, D] += the rows of dx [n, D] (all-gathered to [N, D] first under SP).
void vocab_parallel_embedding_backward(const TensorParallel& tp, const Context& ctx,
                                       const Tensor& dtable, const Tensor& local_ids,
                                       const Tensor& dx);
// RMSNorm backward on this rank's tokens (dx +=; and dx rounded into dx_rounded when given,
// ops.cuh). Under SP each rank saw n of the N tokens, so the weight's gradient is summed over tp
// before it is added into dw.
void parallel_rmsnorm_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                               const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                               const Tensor& rstd, const Tensor& dx_rounded = Tensor());
// LayerNorm's the same (dx +=, and its rounded copy; dw, db +=), its two gradients summed in one
// all-reduce under SP.
void parallel_layernorm_backward(const TensorParallel& tp, const Context& ctx, const Tensor& dx,
                                 const Tensor& dw, const Tensor& db, const Tensor& dy,
                                 const Tensor& x, const Tensor& w, const Tensor& stats,
                                 const Tensor& dx_rounded = Tensor());

// ---- Vocab-parallel embedding and cross-entropy (the vocabulary split in tp ranges) ----
// Local ids: id - vocab_start for ids this rank holds, -1 (a zero row) for the others.
std::vector<int32_t> local_vocab_ids(const int32_t* ids, int64_t n, int vocab_start,
                                     int local_vocab);
// losses[N] = logsumexp over the full vocabulary - target logit, from local logits [N, V/tp]:
// max, sum of exponentials and target logit are each all-reduced over tp, so no rank ever
// holds the full logits. stats [N, 2] saves (max, sum) for the backward.
void vocab_parallel_cross_entropy_forward(const TensorParallel& tp, const Context& ctx,
                                          const Tensor& losses, const Tensor& stats,
                                          const Tensor& logits, const Tensor& local_targets);
// dlogits [N, V/tp] = scale * (softmax - onehot) on this rank's vocabulary slice; may alias logits.
void vocab_parallel_cross_entropy_backward(const TensorParallel& tp, const Context& ctx,
                                           const Tensor& dlogits, const Tensor& logits,
                                           const Tensor& stats, const Tensor& local_targets,
                                           float scale);

// ---- What the tp group sent (--report comm; runtime/meters.cuh) ----
// The tp group's traffic over the training steps next to the count of collectives the model
// issues per micro-batch of mbs sequences of cfg.seq tokens (Playbook §5.3, §6); null for
// tp = 1.
std::unique_ptr<StepMeter> tensor_parallel_meter(Comm& comm, const ModelConfig& cfg, int mbs,
                                                 int grad_acc, bool sp);
