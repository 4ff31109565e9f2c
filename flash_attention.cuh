// flash_attention.cuh: the attention core, softmax(q k^T / sqrt(hd) + causal mask) v, with
// grouped-query heads (query head h reads key/value head h / (Hq / Hkv)), and the seam the
// model's block calls it through.
// Two versions: naive attention (kernels/attention_naive.cu), which materialises the
// [B, Hq, T, T] probabilities (Playbook §2.5's 5as^2b term) and stays as the readable
// reference, and FlashAttention (Playbook §12.8; flash_attention.cu, its CUDA kernels in
// kernels/), which streams key/value tiles past a query tile with an online softmax and keeps
// only the log-sum-exp per query: O(T) memory, and the interface ring attention (Playbook §7.2,
// context_parallel.cu) is built from.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/core.cuh"
#include "runtime/meters.cuh"
#include "runtime/ops.cuh"

struct AttentionShape {
  int B;                                      // sequences
  int T;                                      // tokens per sequence
  int Hq;                                     // query heads
  int Hkv;                                    // key/value heads (divides Hq)
  int hd;                                     // head dimension
  const AttentionDropout* dropout = nullptr;  // none: no dropout (evaluation, or p 0)
};

// ============================================================================
// The seam (DESIGN 6, "Attention"): the model holds one AttentionCore, chosen when it is built
// (local_attention below, or context_parallel.cuh's ring and all-gather attention), and its
// block calls it without asking which.
// ============================================================================

// What attention keeps of one block for its backward.
struct AttentionSaved {
  Tensor probs;  // [B, Hq, T, T] naive attention's probabilities (compute format under --dtype)
  Tensor lse;    // [B, Hq, T] FlashAttention's log-sum-exp per query and head (fp32 always)
  Tensor mask, dropped;  // under dropout: [B, Hq, T, T] its U8 mask and the probabilities it left
};

class AttentionCore {
 public:
  virtual ~AttentionCore() = default;
  virtual std::string name() const = 0;  // "naive", "flash", "ring", "allgather"
  // The global position of each of this rank's T tokens of B sequences (RoPE, the causal
  // mask): [0, T) in every sequence, unless the sequence is split over ranks.
  virtual std::vector<int32_t> positions(int B, int T) const {
    std::vector<int32_t> pos((size_t)B * T);
    for (size_t i = 0; i < pos.size(); i++) pos[i] = (int32_t)(i % T);
    return pos;
  }
  // Which of the B sequences (0 .. B-1) each of those tokens is in, in the same order (dropout
  // keys its masks by it): i / T, unless the sequence is split over ranks.
  virtual std::vector<int32_t> token_sequences(int B, int T) const {
    std::vector<int32_t> seq((size_t)B * T);
    for (size_t i = 0; i < seq.size(); i++) seq[i] = (int32_t)(i / T);
    return seq;
  }
  // out [B*T, Hq, hd] (=) from q [B*T, Hq, hd] and k, v [B*T, Hkv, hd]; fills `saved`.
  virtual void forward(const Context& ctx, const AttentionShape& s, const Tensor& out,
                       AttentionSaved& saved, const Tensor& q, const Tensor& k,
                       const Tensor& v) const = 0;
  // dq (=), dk, dv (=) from dout and the forward's out and saved (rebuilt where dropped).
  virtual void backward(const Context& ctx, const AttentionShape& s, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& out,
                        AttentionSaved& saved, const Tensor& q, const Tensor& k,
                        const Tensor& v) const = 0;
  // Selective recomputation (Playbook §2.6) drops what the backward rebuilds: the probabilities.
  virtual void drop_recomputable(AttentionSaved& saved) const {
    saved.probs = saved.mask = saved.dropped = Tensor();
  }
  // Bytes `saved` holds for B sequences of T tokens and `heads` query heads, e bytes per
  // element stored in the compute format, with dropout on the probabilities or not (model.cu's
  // activation formula adds them).
  virtual int64_t saved_bytes(int64_t B, int64_t T, int64_t heads, bool selective, int e,
                              bool dropout) const = 0;
  // The same per token, as the report writes it next to the book's 5as/h: "4 Hq" or "2 Hq T".
  virtual std::string saved_formula(int e, bool dropout) const = 0;
  // What it measures of the training steps (runtime/meters.cuh; ring attention: each rank's
  // work, --report balance); null: nothing.
  virtual std::unique_ptr<StepMeter> meter(Comm&) const { return nullptr; }
};

// Under --dtype bf16 and fp16 the block hands its core q, k and v (and in the backward out and
// dout) in the compute format they are stored in, and an out in that format to write; dq, dk
// and dv are fp32. A core that computes in fp32 reads its inputs widened (cast_to F32: exact,
// the tensor itself when fp32) and writes out through attention_output_fp32, an fp32
// workspace that attention_store_output rounds into out once.
Tensor attention_output_fp32(const Context& ctx, const Tensor& out);
void attention_store_output(const Context& ctx, const Tensor& out, const Tensor& written);

// The format FlashAttention reads q, k, v (and out, dout) in: bf16 where its tensor-core kernels
// run (a GPU or the meta device, a bf16 compute format: --dtype bf16 or fp8, hd 16, 32, 64 or
// 128), else fp32. Ring attention's blocks read theirs in it too, and send keys and values so.
DType attention_input_dtype(const Context& ctx, const AttentionShape& s);

// The attention that runs on one rank's whole sequences: naive or flash (--attention).
enum class AttentionKind { Naive, Flash };
AttentionKind parse_attention(const std::string& flag);  // naive|flash, else UsageError
const char* attention_name(AttentionKind kind);
// The configuration table's row: the name and what it keeps for the backward.
std::string describe_attention(AttentionKind kind);
std::shared_ptr<const AttentionCore> local_attention(AttentionKind kind);
namespace CLI {
class App;
}
struct AttentionOptions {
  AttentionKind attention = AttentionKind::Flash;  // --attention
};
void add_attention_flags(CLI::App& app, AttentionOptions& o);

// Naive attention, the reference: kernels/attention_naive.cuh.

// ============================================================================
// FlashAttention (Playbook §12.8), shaped for ring attention (Playbook §7.2)
// ============================================================================
// One call attends queries at global positions [q0, q0 + Tq) to keys/values at
// [k0, k0 + Tk) of the same B sequences. Causal means by global position: query i sees key j
// iff k0 + j <= q0 + i, so a rank of a context-parallel ring passes the positions it holds.
// A query that sees no key of this block gets out 0 and lse -inf (never NaN): a partial
// result that attention_lse_merge gives zero weight. Scores are scaled by 1/sqrt(hd).
struct AttentionBlock {
  int B;           // sequences
  int Tq, Tk;      // query tokens and key/value tokens per sequence in this block
  int Hq, Hkv;     // query heads and key/value heads (Hkv divides Hq)
  int hd;          // head dimension
  int64_t q0 = 0;  // global position of the first query
  int64_t k0 = 0;  // global position of the first key
  bool causal = true;
  AttentionDraw drop{};  // dropout on the probabilities (off by default), drawn per tile
};
// Layouts (token-major, as the model's projections produce them):
//   q, out, dq, dout [B*Tq, Hq, hd];  k, v, dk, dv [B*Tk, Hkv, hd];  lse, D [B, Hq, Tq] (fp32)
// lse is the natural log of sum_j exp(q.k_j / sqrt(hd)) over the visible keys.
// The operands q, k, v, out, dout are fp32 or bf16 (all in the format of q); lse, D, dq, dk,
// dv are fp32 always. fp32 on the CPU: 64 x 64 tiles through cblas_sgemm on the threads OpenBLAS
// may use, with a fixed-size Mem::Workspace per thread (no [T, T] buffer, nothing that grows
// with T); results do not depend on timing. fp32 on CUDA (CUDA cores, any hd up to 128): no
// allocation at all; dq is summed with atomicAdd, so its last bits vary from run to run.
// bf16 (hd 16, 32, 64 or 128): FlashAttention-2's tensor-core kernels on a GPU, their CPU
// mirrors (the same tiles and roundings) on the CPU: kernels/flash_attention_bf16.cuh.

// out (=), lse (=): the attention output and log-sum-exp of each (query, head).
void flash_attention_forward(const Context& ctx, const Tensor& out, const Tensor& lse,
                             const Tensor& q, const Tensor& k, const Tensor& v,
                             const AttentionBlock& a);
// D[b, h, i] (=) = sum_d dout[b, i, h, d] * out[b, i, h, d]: the softmax backward's row term,
// computed once from the final (merged) output, then shared by every block's backward.
void attention_out_dot_dout(const Context& ctx, const Tensor& D, const Tensor& dout,
                            const Tensor& out, const AttentionBlock& a);
// The same D, and dq, dk, dv (=) 0 for the sums of flash_attention_backward: one kernel on
// tensor cores (bf16 operands on a GPU), four ops elsewhere.
void attention_backward_begin(const Context& ctx, const Tensor& D, const Tensor& dout,
                              const Tensor& out, const Tensor& dq, const Tensor& dk,
                              const Tensor& dv, const AttentionBlock& a);
// dq (+=), dk (+=), dv (+=): every gradient ACCUMULATES, so a ring adds the blocks of one
// query chunk into its dq and passes dk, dv on (zero them before the first block).
// lse and D are those of the whole attention (after merging), not of this block alone.
void flash_attention_backward(const Context& ctx, const Tensor& dq, const Tensor& dk,
                              const Tensor& dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& D,
                              const AttentionBlock& a);
// (out, lse) (=) the merge of (out, lse) and (out2, lse2), two partial results for the same
// queries over disjoint keys, in fp32: lse' = logaddexp(lse, lse2),
// out' = exp(lse - lse') out + exp(lse2 - lse') out2. A side at -inf weighs 0. Uses B, Tq, Hq,
// hd of `a`. out is fp32; out2 fp32 or bf16 (a block's output from the tensor-core kernels).
void attention_lse_merge(const Context& ctx, const Tensor& out, const Tensor& lse,
                         const Tensor& out2, const Tensor& lse2, const AttentionBlock& a);
