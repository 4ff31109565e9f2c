// tensor_parallel.cuh: Megatron-style tensor parallelism and sequence parallelism
// (Playbook §5 and §6). Weights are split across the tp group; activations are full inside a
// "tensor-parallel region" (between a column-parallel and a row-parallel linear) and, with
// --sp, sharded along the tokens outside it.
#pragma once
#include <vector>

#include "comm.cuh"

// The tp group, and whether sequence parallelism is on. size 1 turns every operator into the
// identity, so the model uses the same calls with or without tensor parallelism.
struct TensorParallel {
  Comm* comm = nullptr;
  bool sp = false;
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
void scatter_to_sp_region_forward(const TensorParallel& tp, const Context& ctx,
                                  const Tensor& full, const Tensor& shard);
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

// ---- Vocab-parallel embedding and cross-entropy (the vocabulary split in tp ranges) ----
// Local ids: id - vocab_start for ids this rank holds, -1 (a zero row) for the others.
std::vector<int32_t> local_vocab_ids(const int32_t* ids, int64_t n, int vocab_start, int local_vocab);
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
// The model's cross-entropy: ops.cu's fused one on one rank, the vocab-parallel one on several.
void tp_cross_entropy_forward(const TensorParallel& tp, const Context& ctx, const Tensor& losses,
                              const Tensor& stats, const Tensor& logits, const Tensor& targets);
void tp_cross_entropy_backward(const TensorParallel& tp, const Context& ctx,
                               const Tensor& dlogits, const Tensor& logits, const Tensor& stats,
                               const Tensor& targets, float scale);

// ---- Weight shards ----
// Where this rank's shard of a weight sits in the full tensor: the block of rows
// [row0, row0 + rows) and columns [col0, col0 + cols) of the full [full_rows, full_cols] matrix
// (a 1-D weight is one row). Rows are split for column-parallel layers, columns for
// row-parallel ones; nothing for norms. `writer`: the one tp rank whose copy goes into a
// checkpoint when several hold the same block (norms; replicated key/value heads).
struct TpSlice {
  std::vector<int64_t> full_shape;
  int64_t row0 = 0, col0 = 0;
  bool writer = true;
  int64_t full_cols() const { return full_shape.size() > 1 ? full_shape[1] : full_shape[0]; }
  bool whole(const Tensor& shard) const;  // the shard is the full tensor
};
// Full tensors (host, Mem::Workspace) assembled on tp rank 0 from every rank's shard; on the
// other tp ranks the result is undefined. One process: the shards themselves.
std::vector<Tensor> gather_full_tensors(const TensorParallel& tp, const std::vector<Tensor>& shards,
                                        const std::vector<TpSlice>& layouts);
// Each shard := its block of the full tensor (full tensors on the host, every rank).
void scatter_full_tensors(const std::vector<Tensor>& full, const std::vector<Tensor>& shards,
                          const std::vector<TpSlice>& layouts);
// The rows [row0, row0 + rows) and columns [col0, col0 + cols) of the full [*, full_cols]
// tensor `name`, initialised from the layout-free RNG (DESIGN 5) into `shard` [rows, cols].
void init_normal_block(const Tensor& shard, uint64_t seed, const std::string& name, float std,
                       int64_t row0, int64_t col0, int64_t full_cols);
// Copies the block [row0, row0 + shard rows) x [col0, col0 + shard cols) of a full host
// tensor [*, full_cols] into `shard` (any device), and back.
void load_block(const Tensor& shard, const float* full, int64_t row0, int64_t col0, int64_t full_cols);
void store_block(const Tensor& shard, float* full, int64_t row0, int64_t col0, int64_t full_cols);
