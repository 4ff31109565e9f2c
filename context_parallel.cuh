// context_parallel.cuh: context parallelism (Playbook §7). Every rank of the cp group holds
// T/cp tokens of each sequence for the whole model; attention, the one layer that mixes
// tokens, passes keys and values around the ring (ring attention) or gathers them.
#pragma once
#include <string>
#include <vector>

#include "flash_attention.cuh"
#include "runtime/comm.cuh"

enum class CpBalance { Zigzag, Contiguous };
enum class CpComm { Ring, AllGather };

// ---- Flags (Playbook §7) ----
namespace CLI {
class App;
}
struct ContextParallelOptions {
  int cp = 1;                                // --cp: context-parallel ranks
  CpBalance cp_balance = CpBalance::Zigzag;  // --cp-balance
  CpComm cp_comm = CpComm::Ring;             // --cp-comm
};
void add_context_parallel_flags(CLI::App& app, ContextParallelOptions& o);
// The configuration table's row: the split, the communication and each rank's tokens of a
// sequence of `seq`; empty for cp = 1.
std::string describe_context_parallel(const ContextParallelOptions& o, int seq);
CpBalance parse_cp_balance(const std::string& flag);  // zigzag|contiguous
CpComm parse_cp_comm(const std::string& flag);        // ring|allgather
const char* cp_balance_name(CpBalance b);
const char* cp_comm_name(CpComm c);

// A run of consecutive sequence positions that a rank holds (Playbook §7.3): contiguous, rank
// r holds [r T/cp, (r+1) T/cp); zig-zag, with the sequence cut in 2 cp chunks, chunks r and
// 2 cp - 1 - r, so that every rank gets as much causal work as every other. One rank: [0, T).
struct CpPiece {
  int start = 0;  // global position of its first token
  int length = 0;
};
std::vector<CpPiece> cp_pieces(CpBalance b, int T, int cp, int rank);
// Throws UsageError naming the flags: --seq not divisible by --cp (by 2 --cp for zig-zag, and
// by --tp under --sp on each rank's share), --attention naive, --sample.
void validate_context_parallel(int seq, int cp, CpBalance b, bool flash, int tp, bool sp,
                               int sample);

// The cp group and how the sequence is split over it. Size 1: the whole sequence, and the
// attention core is one FlashAttention call.
struct ContextParallel {
  Comm* comm = nullptr;
  CpBalance balance = CpBalance::Zigzag;
  CpComm mode = CpComm::Ring;
  int size() const { return comm ? comm->cp.size : 1; }
  int rank() const { return comm ? comm->cp.rank : 0; }
  // A rank's tokens of B sequences of T tokens (T the whole sequence) are laid out piece-major,
  // [piece][sequence][position in piece], so that each piece of queries is one FlashAttention
  // block of B sequences. local[i] = global index (b * T + position) of local token i.
  std::vector<int64_t> local_tokens(int B, int T) const;
  std::vector<int32_t> positions(int B, int T) const;  // the global position of each local token
  std::vector<int32_t> sequences(int B, int T) const;  // and the sequence (0 .. B-1) it is in
};
// This rank's tokens of `micro_batches` micro-batches of B whole sequences each, host arrays
// [micro_batches*B*T] -> [micro_batches*B*T/cp], each micro-batch in local order.
std::vector<int32_t> select_context_tokens(const ContextParallel& cp, const int32_t* tokens, int B,
                                           int T, int micro_batches = 1);

// What the attention of each rank computed (for --report balance): blocks of its queries
// against a piece of keys (a diagonal block counts as one) and exact (query, key) pairs.
struct CpWork {
  int64_t blocks = 0, pairs = 0;
  double seconds = 0;
};

// The model's attention core under context parallelism (DESIGN 6, "Attention"): ring or
// all-gather attention over the cp group, each a loop of FlashAttention calls merged by their
// log-sum-exp. T, the attention seam's sequence length, is this rank's share of each sequence.
class ContextParallelAttention : public AttentionCore {
 public:
  explicit ContextParallelAttention(ContextParallel cp) : cp_(cp) {}
  std::string name() const override { return cp_comm_name(cp_.mode); }
  std::vector<int32_t> positions(int B, int T) const override;
  std::vector<int32_t> token_sequences(int B, int T) const override;
  void forward(const Context& ctx, const AttentionShape& s, const Tensor& out,
               AttentionSaved& saved, const Tensor& q, const Tensor& k,
               const Tensor& v) const override;
  void backward(const Context& ctx, const AttentionShape& s, const Tensor& dq, const Tensor& dk,
                const Tensor& dv, const Tensor& dout, const Tensor& out, AttentionSaved& saved,
                const Tensor& q, const Tensor& k, const Tensor& v) const override;
  int64_t saved_bytes(int64_t B, int64_t T, int64_t heads, bool, int, bool) const override {
    return 4 * B * heads * T;  // the merged log-sum-exp, fp32
  }
  std::string saved_formula(int, bool) const override { return "4 Hq"; }
  const ContextParallel& layout() const { return cp_; }
  // Each rank's work over the training steps' schedules (--report balance).
  std::unique_ptr<StepMeter> meter(Comm& comm) const override;
  // Where the forward counts its blocks, while its meter measures: an observer, not state.
  mutable CpWork* work = nullptr;

 private:
  ContextParallel cp_;
};

// ---- Ring attention (Playbook §7.2): FlashAttention blocks merged by their log-sum-exp ----
// q [B*Tl, Hq, hd], k, v [B*Tl, Hkv, hd] (Tl = T/cp, local order) -> out [B*Tl, Hq, hd] (=),
// lse [pieces * B * Hq * piece length] (=). Ring: each step's keys and values go to the next
// rank while this one attends to the block it holds; blocks wholly in the future are skipped.
// All-gather: every rank's keys and values at once, then the same blocks. Under dropout each
// block draws the masks one process draws (AttentionBlock::drop: they are keyed by global
// positions), in the backward again. q, k, v (and dout, out in the backward) are fp32 or bf16
// (attention_input_dtype: the tensor-core kernels'), and keys and values travel so; out, lse and
// the gradients are fp32.
void context_attention_forward(const Context& ctx, const ContextParallel& cp, const Tensor& out,
                               const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                               int B, int T, int Hq, int Hkv, int hd, CpWork* work = nullptr,
                               const AttentionDropout* dropout = nullptr);
// dq (=), dk, dv (=) of this rank's tokens. Ring: keys and values travel again with their
// gradient accumulators, which come back to their owner after cp steps. All-gather: the
// gradients of every rank's keys and values are reduce-scattered back.
void context_attention_backward(const Context& ctx, const ContextParallel& cp, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                const Tensor& out, const Tensor& lse, const Tensor& q,
                                const Tensor& k, const Tensor& v, int B, int T, int Hq, int Hkv,
                                int hd, const AttentionDropout* dropout = nullptr);

// The model's attention core (DESIGN 6, "Attention"), chosen once: ring or all-gather attention
// over the cp group when it has more than one rank, else the rank's own (`local`, --attention).
std::shared_ptr<const AttentionCore> make_attention(Comm& comm, const ContextParallelOptions& o,
                                                    AttentionKind local);
