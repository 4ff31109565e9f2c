// ledger.cuh: what the ops of a run cost, counted where each op is issued: per category the
// calls, the CUDA kernels they launch, their FLOPs and the bytes they read and write (Playbook
// §12, seed 004: whether an op is compute- or memory-bound is its FLOPs over its bytes). Every
// device counts, so --report roofline reads the same ledger on CPU, CUDA and meta runs; on the
// meta device (DESIGN 3) counting is all an op does: it computes nothing.
#pragma once
#include <cstdint>

enum class OpKind {
  Gemm,         // linear layers (cuBLAS)
  Attention,    // the attention core: naive's GEMMs and softmax, or FlashAttention
  Norm,         // RMSNorm
  Elementwise,  // RoPE, SwiGLU, residuals, scaling, embedding lookups
  Loss,         // softmax and cross-entropy
  Optimizer,    // AdamW, the gradient norm's sums
  Cast,         // rounding and widening between storage formats
  Memory,       // zeroing, copies between host and device
  Count
};
const char* op_kind_name(OpKind k);  // "gemm", "attention", ...

// One op: its FLOPs, the bytes it reads and writes in device memory, the kernels it launches on
// CUDA (cuBLAS calls count one each).
struct OpCost {
  double flops = 0, read = 0, written = 0;
  int launches = 1;
};
struct LedgerRow {
  int64_t calls = 0, launches = 0;
  double flops = 0, read = 0, written = 0;
};
struct Ledger {
  LedgerRow rows[(int)OpKind::Count];
  LedgerRow total() const;
};
Ledger ledger();  // since the process started (or the last reset), this rank
void reset_ledger();

// Counts one op (runtime/core.cuh's count_op is the call every op makes: it records, then tells
// the op whether its device computes at all).
void record_op(OpKind kind, const OpCost& cost);

// Within a scope, every op counts under `kind` whatever its own (naive attention's GEMMs and
// softmax are attention; the gradient norm's sums and the optimizer's casts are the optimizer's).
class LedgerScope {
 public:
  explicit LedgerScope(OpKind kind);
  ~LedgerScope();

 private:
  int saved_;
};
