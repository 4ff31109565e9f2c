// ops.cuh: the model's building blocks. Each op has a CPU reference loop and a CUDA kernel
// in ops.cu; the functions below dispatch on ctx.device (all tensors live on that device).
// Layouts follow PyTorch/HF: row-major, activations [tokens, features], linear W [out, in].
// Backward functions that take a gradient "+=" accumulate into it; "=" overwrites.
#pragma once
#include <cstdint>
#include <cstring>
#include <functional>

#include "runtime/core.cuh"

// Every tensor an op touches lives on the context's device (undefined tensors are skipped):
// an op's first check, here and in kernels/.
template <typename... Ts>
void check_devices(const Context& ctx, const char* op, const Ts&... ts) {
  for (const Tensor* t : {&ts...})
    PICO_ASSERT(!t->defined() || t->device == ctx.device,
                std::string(op) + ": a tensor is on " + device_name(t->device) +
                    " but the context is on " + device_name(ctx.device));
}

// ---- matmul (Playbook §2.1: every linear layer is a GEMM) ----
// C[M,N] = alpha * op(A) @ op(B) + beta * C, all row-major with leading dimensions
// (op(A) is [M,K], op(B) is [K,N]). CPU: cblas_sgemm; CUDA: cublasSgemm.
void gemm(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K, float alpha,
          const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc);
// The same with bf16 or fp16 A and B (one format) and fp32 C, products and sums in fp32: the
// tensor cores' mixed-precision GEMM (cublasGemmEx). C may be in A's format when beta is 0: the
// fp32 sums rounded once on their way out. GPU path only (CUDA, or meta's count).
void gemm_16bit(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                const Tensor& A, int lda, const Tensor& B, int ldb, float beta, const Tensor& C,
                int ldc);
// `count` GEMMs of one shape, operand i of X at X + i * stride_x elements (stride 0: one operand
// that all of them read), alpha 1: one strided-batched cuBLAS call (cublasGemmStridedBatchedEx,
// fp32 sums), counted as one launch. fp32 A, B and C on any device (CPU: one cblas_sgemm each,
// in order, the values of `count` gemm calls); bf16 or fp16 A and B as gemm_16bit's, on the GPU
// path. The C_i must not overlap: cuBLAS may run them concurrently.
void gemm_strided_batched(const Context& ctx, bool trans_a, bool trans_b, int M, int N, int K,
                          const Tensor& A, int lda, int64_t stride_a, const Tensor& B, int ldb,
                          int64_t stride_b, float beta, const Tensor& C, int ldc, int64_t stride_c,
                          int count);
// ---- embedding ----
// out[T, D] = table[ids[t], :]; ids [T] int32; id -1 gives a zero row (and no gradient): the
// ids another rank's vocabulary slice holds under tensor parallelism. The forward's table may be
// bf16 or fp16 (mixed precision's copy): the rows it reads are widened, exactly; out is fp32 or
// a 16-bit residual stream's format (each value rounded once; a plain gather from a table in the
// same format).
void embedding_forward(const Context& ctx, const Tensor& out, const Tensor& ids,
                       const Tensor& table);
// dtable[V, D] += scatter of dout[T, D] by ids; dtable fp32, dout fp32 or 16-bit (read widened)
void embedding_backward(const Context& ctx, const Tensor& dtable, const Tensor& ids,
                        const Tensor& dout);

// ---- RMSNorm: y = x / sqrt(mean(x^2) + eps) * w ----
// x, y [T, D]; w [D] (fp32, or a bf16 / fp16 compute copy read widened); rstd [T] saved for
// backward
void rmsnorm_forward(const Context& ctx, const Tensor& y, const Tensor& rstd, const Tensor& x,
                     const Tensor& w, float eps);
// sum = a + b (residual_forward), then y, rstd = rmsnorm(sum) (rmsnorm_forward): one kernel on
// CUDA, the same values; a, sum fp32, b as residual_forward's.
void residual_rmsnorm_forward(const Context& ctx, const Tensor& sum, const Tensor& y,
                              const Tensor& rstd, const Tensor& a, const Tensor& b, const Tensor& w,
                              float eps);
// dx[T, D] += ..., dw[D] += ... (dy fp32, or bf16 / fp16 as the linear layers wrote it). With
// `dx_rounded` (a [T, D] fp32, bf16 or fp16 tensor): dx's new value also written into it,
// rounded once (a gradient's rounding, counted), for the GEMMs that read dx next.
void rmsnorm_backward(const Context& ctx, const Tensor& dx, const Tensor& dw, const Tensor& dy,
                      const Tensor& x, const Tensor& w, const Tensor& rstd,
                      const Tensor& dx_rounded = Tensor());

// ---- RoPE, HF rotate_half convention: pairs (i, i + hd/2), angle pos * theta^(-2i/hd) ----
// On CUDA the frequency table travels with the launch: head dims up to 256 (ops.cu). And the
// FlashAttention kernels hold a query row in registers at widths up to 128 (the bf16 ones take
// 16, 32, 64 and 128). validate_head_dim refuses a model past either before any step, naming
// the flags (UsageError); `flash`: its attention is FlashAttention's. The CPU takes any; the
// meta device, which prices the CUDA step on a GPU's profile (`gpu`, --gpu's; the default is
// h100's), takes what CUDA takes, and any head dim on the cpu profile.
constexpr int kRopeMaxHeadDimCuda = 256, kFlashMaxHeadDimCuda = 128;
void validate_head_dim(int head_dim, bool flash, Device device, const std::string& gpu = "");
// x [T, H, hd] rotated in place (fp32, or bf16 / fp16 read widened and each value rounded once
// as it is written back); positions [T] int32
void rope_forward(const Context& ctx, const Tensor& x, const Tensor& positions, float theta);
// dx [T, H, hd] in place: the inverse rotation (rotation matrices are orthogonal). With `into`
// (an fp32 dx and a [T, H, hd] fp32, bf16 or fp16 tensor): the result written into it instead
// (rounded once: the linear layers' input, a gradient whose rounding is counted), dx unchanged
// unless `into` is dx itself.
void rope_backward(const Context& ctx, const Tensor& dx, const Tensor& positions, float theta,
                   const Tensor& into = {});
// The same for q [T, Hq, hd] and k [T, Hk, hd] (the same formats) in one launch: the forward in
// place, the backward into into_q and into_k (each dq or dk itself, or its 16-bit buffer). Given
// dv [T, Hk, hd] and a 16-bit into_v, the backward also rounds dv into it in the same launch
// (not rotated; counted as a gradient's rounding): the three gradients the q, k and v
// projections read, in the format they read them.
void rope_forward(const Context& ctx, const Tensor& q, const Tensor& k, const Tensor& positions,
                  float theta);
void rope_backward(const Context& ctx, const Tensor& dq, const Tensor& dk, const Tensor& positions,
                   float theta, const Tensor& into_q, const Tensor& into_k,
                   const Tensor& dv = Tensor(), const Tensor& into_v = Tensor());

// ---- SwiGLU: out = silu(gate) * up ----
// gate, up, out [T, F], all three fp32, or all three bf16 or fp16 (mixed precision's compute
// format: read widened, the same fp32 arithmetic, the output rounded once)
void swiglu_forward(const Context& ctx, const Tensor& out, const Tensor& gate, const Tensor& up);
// dgate, dup [T, F] (=) from dout [T, F]: the three fp32, or the three in gate's 16-bit format
// (a gradient only GEMMs read next: rounded once); gate and up as the forward read them
void swiglu_backward(const Context& ctx, const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up);

// ---- The book's GPT block (Playbook §2.5): LayerNorm with a bias, GeLU, dropout ----
// y [T, D] = (x - mean) / sqrt(var + eps) * w + b per row; stats [T, 2] (fp32) receives each
// row's mean and 1/std. x: the stream's storage; y: fp32 or the compute format; b in w's format.
void layernorm_forward(const Context& ctx, const Tensor& y, const Tensor& stats, const Tensor& x,
                       const Tensor& w, const Tensor& b, float eps);
// The residual add and the next LayerNorm in one pass, as residual_rmsnorm_forward: sum = a + b
// (in a's format, rounded as stored), then layernorm_forward of the sum as stored.
void residual_layernorm_forward(const Context& ctx, const Tensor& sum, const Tensor& y,
                                const Tensor& stats, const Tensor& a, const Tensor& b,
                                const Tensor& w, const Tensor& bias, float eps);
// dx += (in x's format), dw += and db += (fp32) from dy [T, D] and the forward's stats; with
// `dx_rounded`, dx's new value also written into it, rounded once, as rmsnorm_backward does.
void layernorm_backward(const Context& ctx, const Tensor& dx, const Tensor& dw, const Tensor& db,
                        const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& stats,
                        const Tensor& dx_rounded = Tensor());
// out = gelu(in), GPT-2's tanh form; out and in in one format (fp32, bf16 or fp16).
void gelu_forward(const Context& ctx, const Tensor& out, const Tensor& in);
// din (=) dout * gelu'(in): din and dout fp32, or in in's 16-bit format (rounded once).
void gelu_backward(const Context& ctx, const Tensor& din, const Tensor& dout, const Tensor& in);
// Where a dropout is in the run: the seed, the layer and which of the block's dropouts (site),
// and its probability p of dropping an element. Whether an element is dropped is a hash of that,
// of its token (the number of its sequence in the run, its position) and of its place in the
// token's row: the same in any layout, and again when a forward is recomputed.
struct DropoutSite {
  uint64_t seed = 0;
  int layer = 0, site = 0;
  float p = 0.0f;
  uint64_t key() const;        // the seed, layer and site hashed
  uint32_t threshold() const;  // a 32-bit draw below it drops the element
  float scale() const;         // what a kept element is multiplied by: 1 / (1 - p)
};
// The draw itself: a hash of the site's key, the token (its sequence's number, its position) and
// the element's place (a, b), kept when its top 32 bits reach the threshold (splitmix64's
// finaliser, twice). Host and device: CPU loops and kernels draw the same bits.
__host__ __device__ inline uint64_t dropout_mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// The first half depends on the token and a only: a loop over b takes it once (dropout_row) and
// draws each b with one more hash (dropout_kept).
__host__ __device__ inline uint64_t dropout_row(uint64_t site, uint32_t sequence, uint32_t position,
                                                uint32_t a) {
  return dropout_mix64(site + (((uint64_t)sequence << 32) | position)) + ((uint64_t)a << 32);
}
__host__ __device__ inline bool dropout_kept(uint64_t row, uint32_t b, uint32_t threshold) {
  return (uint32_t)(dropout_mix64(row + b) >> 32) >= threshold;
}
__host__ __device__ inline bool dropout_keeps(uint64_t site, uint32_t sequence, uint32_t position,
                                              uint32_t a, uint32_t b, uint32_t threshold) {
  return dropout_kept(dropout_row(site, sequence, position, a), b, threshold);
}
// Attention's dropout drawn where the probabilities are made, inside a tile loop (FlashAttention:
// FlashAttention-2 draws its mask in the kernel and never stores it): element (sequence b, query
// head h, query and key at global positions i, j) is keyed as dropout_attention_forward keys it,
// so it is kept or dropped as naive attention keeps or drops it. Plain data, passed to kernels.
struct AttentionDraw {
  uint64_t key = 0;
  uint32_t threshold = 0;  // 0: nothing dropped
  float scale = 1.0f;      // 1 / (1 - p)
  // Sequence b's number in the run is sequences[b * stride] (on the device that draws).
  const int32_t* sequences = nullptr;
  int64_t stride = 0;
  int head0 = 0;  // this rank's first query head (tensor parallelism)
  __host__ __device__ bool on() const { return threshold != 0; }
  // Query row (b, h, i)'s half of the hash, taken once for all the keys it meets.
  __host__ __device__ uint64_t row(int b, int h, int64_t i) const {
    return dropout_row(key, (uint32_t)sequences[b * stride], (uint32_t)i, (uint32_t)(head0 + h));
  }
  // What probability (row, j) is multiplied by: scale kept, 0 dropped.
  __host__ __device__ float factor(uint64_t row, int64_t j) const {
    return dropout_kept(row, (uint32_t)j, threshold) ? scale : 0.0f;
  }
  __host__ __device__ float factor(int b, int h, int64_t i, int64_t j) const {
    return factor(row(b, h, i), j);
  }
};
// y = x * mask / (1 - p) (y may be x), mask [rows, D] U8 (1: kept). Row r of x is the token of
// sequences[row0 + r] and positions[row0 + r] ([N] int32 each: the micro-batch's tokens).
void dropout_forward(const Context& ctx, const Tensor& y, const Tensor& mask, const Tensor& x,
                     const DropoutSite& site, const Tensor& sequences, const Tensor& positions,
                     int64_t row0);
// The same on attention's probabilities [B, H, T, T] (fp32) of query heads head0 ..: element
// (b, h, i, j) is the query token b T + i's, keyed by its head and the key's position.
void dropout_attention_forward(const Context& ctx, const Tensor& dropped, const Tensor& mask,
                               const Tensor& probs, const DropoutSite& site,
                               const Tensor& sequences, const Tensor& positions, int head0);
// Dropout on attention's probabilities (the book's GPT, Playbook §2.5): where it is in the run,
// and the tokens' sequences and positions its masks are keyed by. Naive attention masks its
// stored probabilities with dropout_attention_forward; FlashAttention draws the same masks in
// its tile loops (AttentionBlock::drop).
struct AttentionDropout {
  DropoutSite site;
  Tensor sequences, positions;  // [B*T] int32 each
  int head0 = 0;                // this rank's first query head (tensor parallelism)
  // For a tile loop over these tokens, sequence b's first token at row b * stride.
  AttentionDraw draw(int64_t stride) const {
    return {site.key(), site.threshold(), site.scale(), sequences.i32(), stride, head0};
  }
};
// dx = dy * mask / (1 - p), either dropout's backward (dx may be dy; one format).
void dropout_backward(const Context& ctx, const Tensor& dx, const Tensor& dy, const Tensor& mask,
                      float p);

// ---- residual: out = a + b (backward is the identity into both branches) ----
// out and a fp32 (the residual stream); b fp32, or a layer's output in bf16 / fp16 read widened
void residual_forward(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b);
// y += alpha * x (same numel); the accumulate used by residual backward and gradient sums
void axpy(const Context& ctx, const Tensor& y, float alpha, const Tensor& x);
void scale_(const Context& ctx, const Tensor& x, float alpha);
// acc += x, summed in fp32 and rounded once into acc's dtype (fp32 or a storage format).
void accumulate(const Context& ctx, const Tensor& acc, const Tensor& x);

// ---- rows times weights (a mixture of experts' combine) ----
// y[K, D] = x[K, D] with row k times w[k] (y may be x), y fp32 and x fp32 or 16-bit (read
// widened); out[K] = sum_d a[k, d] b[k, d] (fp32; a fp32, b fp32 or 16-bit, read widened)
void scale_rows(const Context& ctx, const Tensor& y, const Tensor& x, const Tensor& w);
void row_dots(const Context& ctx, const Tensor& out, const Tensor& a, const Tensor& b);

// ---- cross-entropy, fp32 accumulation, in passes a split vocabulary can reduce between ----
// logits [N, V] fp32, or bf16 / fp16 (mixed precision's LM head writes them so: read widened,
// the same fp32 arithmetic); targets [N] int32, -1 for a target another rank's slice holds.
// row_max [N] (=) the row maxima; sums [N, 2] (=) (sum of exp(logit - max), target logit or 0);
// losses [N] (=) log(sum) + max - target logit, stats [N, 2] (=) (max, sum) for the backward.
void cross_entropy_row_max(const Context& ctx, const Tensor& row_max, const Tensor& logits);
void cross_entropy_row_sums(const Context& ctx, const Tensor& sums, const Tensor& logits,
                            const Tensor& row_max, const Tensor& targets);
void cross_entropy_finish(const Context& ctx, const Tensor& losses, const Tensor& stats,
                          const Tensor& row_max, const Tensor& sums);
// dlogits [N, V] = scale * (softmax - onehot(target)) from the forward's stats, in the logits'
// dtype (a 16-bit gradient rounded once as it is stored, counted as cast_gradient_ counts); may
// alias logits.
void cross_entropy_backward(const Context& ctx, const Tensor& dlogits, const Tensor& logits,
                            const Tensor& stats, const Tensor& targets, float scale);
// The three passes on one rank (the vocabulary whole); on the GPU path one fused kernel (the
// online softmax along the vocabulary: one read of the logits, the same values summed in
// another order), counted as one op.
void cross_entropy_forward(const Context& ctx, const Tensor& losses, const Tensor& stats,
                           const Tensor& logits, const Tensor& targets);
// The same without the stats (tests): losses[T] = logsumexp(logits[t]) - logits[t, targets[t]];
// and dlogits[T, V] = scale * (softmax(logits) - onehot(targets)), the stats recomputed.
void cross_entropy_forward(const Context& ctx, const Tensor& losses, const Tensor& logits,
                           const Tensor& targets);
void cross_entropy_backward(const Context& ctx, const Tensor& dlogits, const Tensor& logits,
                            const Tensor& targets, float scale);
// ---- reductions (fp32 accumulation, result on the host) ----
float sum(const Context& ctx, const Tensor& x);
float sum_squares(const Context& ctx, const Tensor& x);
// Each tensor's sum of squares, as sum_squares computes it, with one host synchronisation for
// all of them (the global gradient norm, Playbook §gradient clipping). F32 or BF16 tensors
// (gradients kept in bf16 are widened as they are read; the sums stay fp32).
std::vector<float> sum_squares_each(const Context& ctx, const std::vector<Tensor>& xs);
// A sum left where it was computed until read_total asks for it: each micro-batch's loss, so
// that a step's forwards queue on the device without the host waiting for each one (one trip
// a step for all of them, as llm.c and Megatron-LM read the loss). On CUDA the total stays in
// device memory; the CPU computes it at once (the value sum returns); on meta it is NaN.
struct PendingSum {
  bool pending = false;  // false: no sum (a stage without the loss), read as 0
  float value = 0;       // the CPU's and meta's result
  Tensor total;          // CUDA: [1] fp32 on the device, in the reduction's workspace
};
PendingSum sum_later(const Context& ctx, const Tensor& x);
// The values of `sums` added in order in double: one host synchronisation (counted) for all of
// them when any is pending.
double read_total(const Context& ctx, const std::vector<PendingSum>& sums);

// ---- AdamW (Loshchilov & Hutter): bias-corrected moments, decoupled weight decay ----
struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
};
// On n contiguous elements: m, v updated; p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p).
// step counts from 1. `copy`, when defined ([n], BF16 or F16): the new p rounded into it in the
// same pass (mixed precision's compute copy of the weights, which then needs no cast of its own:
// 2 bytes written per weight instead of 4 read and 2 written again).
void adamw_update(const Context& ctx, float* p, const float* g, float* m, float* v, int64_t n,
                  const AdamWConfig& cfg, float lr, float weight_decay, int step,
                  const Tensor& copy = {});

// The same update on many slices (each n contiguous elements of p, g, m, v; a weight decay of
// its own; a compute copy in copy_dtype or none) in one launch on CUDA, slice after slice on
// the CPU: every element's arithmetic is adamw_update's.
struct AdamWSlice {
  float* p;
  const float* g;
  float *m, *v;
  int64_t n;
  float weight_decay;
  uint16_t* copy;  // [n] the new p rounded into it, or null
};
void adamw_update_many(const Context& ctx, const std::vector<AdamWSlice>& slices,
                       const AdamWConfig& cfg, float lr, int step, DType copy_dtype = DType::BF16);

// ---- CPU threads (FlashAttention's CPU tiles) ----
// Work split into independent items runs on as many threads as OpenBLAS may use, worker w
// taking items w, w + W, ... (a fixed assignment: results never depend on timing). OpenBLAS
// itself is held to one thread meanwhile: a tile-sized GEMM is too small to split, and
// splitting it inside each worker would oversubscribe the cores.
int cpu_workers(int items);  // min(OpenBLAS threads, items), at least 1
void run_on_cpu_workers(int items, int workers,
                        const std::function<void(int item, int worker)>& fn);

// ---- A CPU exponential the compiler vectorises (FlashAttention's CPU tiles) ----
// exp(x) for x <= 0 (a score minus its row's max or lse), for the CPU tiles: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial (about 1 ulp), 2^n written straight into
// the exponent bits. Unlike expf it has no branches and no call, so the compiler vectorises the
// row loops around it: the exponentials are half of the CPU version's time otherwise. Inputs
// below -87 (exp < 2e-38, nothing next to a row sum >= 1) are clamped there.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round: add, drop 1.5 * 2^23
  float r = x - n * 0.693359375f;  // ln 2 in two parts: the first times n is exact
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}
