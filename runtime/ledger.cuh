// ledger.cuh: what the ops of a run cost, counted where each op is issued: per category the
// calls, the CUDA kernels they launch, their FLOPs and the bytes they read and write (Playbook
// §12, seed 004: whether an op is compute- or memory-bound is its FLOPs over its bytes). Every
// device counts, so --report roofline reads the same ledger on CPU, CUDA and meta runs; on the
// meta device (DESIGN 3) counting is all an op does: it computes nothing. Given a device's
// roofline, each op is also priced as it is counted; given a clock, the time it took is kept.
#pragma once
#include <cstdint>
#include <map>
#include <tuple>

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

// The units an op's FLOPs run on: the CUDA cores (fp32), or the tensor cores with 16-bit or
// 8-bit operands (each has its own peak).
enum class MathUnit { CudaCores, Tensor16, Tensor8, Count };

// One op: its FLOPs, the bytes it reads and writes in device memory, the kernels it launches on
// CUDA (cuBLAS calls count one each); a GEMM also gives its narrowest dimension, which decides
// how much of the peak it reaches.
struct OpCost {
  double flops = 0, read = 0, written = 0;
  int launches = 1;
  MathUnit unit = MathUnit::CudaCores;
  double narrow = 0;            // min(M, N, K) of a GEMM; 0 for any other op
  int64_t m = 0, n = 0, k = 0;  // a GEMM's shape (C [m, n], k products a value): its own row
  int gemms = 1;                // GEMMs of that shape the op runs (a strided batch: its count)
};
struct LedgerRow {
  int64_t calls = 0, launches = 0;
  double flops = 0, read = 0, written = 0;
  double predicted_s = 0;  // priced on the roofline set (set_ledger_roofline)
  double measured_s = 0;   // timed by the clock (core.cuh, start_ledger_clock)
};
// A GEMM's shape and the unit it runs on: the GEMMs counted as such have a row per shape too
// (--report roofline's breakdown; a linear layer's forward, input gradient and weight gradient
// are three shapes).
using GemmShape = std::tuple<int64_t, int64_t, int64_t, MathUnit>;  // M, N, K, unit
struct Ledger {
  LedgerRow rows[(int)OpKind::Count];
  std::map<GemmShape, LedgerRow> gemm_shapes;
  LedgerRow total() const;
};
Ledger ledger();  // since the process started (or the last reset), this rank
void reset_ledger();

// Counts one op (runtime/core.cuh's count_op is the call every op makes: it records, then tells
// the op whether its device computes at all).
int record_op(OpKind kind, const OpCost& cost);  // the row it counted in, for the clock

// Within a scope, every op counts under `kind` whatever its own (naive attention's GEMMs and
// softmax are attention; the gradient norm's sums and the optimizer's casts are the optimizer's).
class LedgerScope {
 public:
  explicit LedgerScope(OpKind kind);
  ~LedgerScope();

 private:
  int saved_;
};

// ---- A device's roofline: what each op would take on it ----
// An op takes the larger of its compute time (FLOPs over its unit's peak times the fraction of
// it the op reaches) and its memory time (bytes over the bandwidth times the fraction a
// streaming kernel reaches), plus a fixed time per kernel launch. The constants are a device
// profile's (planner/profiles.cu), each with its source.
struct Roofline {
  double peak[(int)MathUnit::Count] = {};  // dense FLOP/s of each unit
  double gemm_efficiency = 1;              // fraction of the peak a wide GEMM reaches
  double gemm_half_width = 0;              // a GEMM dimension at which that fraction halves
  double attention_efficiency = 1;         // fraction of the peak the attention kernels reach
  double bandwidth = 0;                    // bytes/s of device memory
  double stream_efficiency = 1;            // fraction of it a streaming kernel reaches
  double launch_s = 0;                     // seconds a launch adds (latency, a tiny grid's ramp)
  double seconds(OpKind kind, const OpCost& c) const;
};
// From now on every op recorded is also priced on `r` (its row's predicted_s).
void set_ledger_roofline(const Roofline& r);

// Counts apart: while it lives, ops count into a ledger of their own, priced on `r`; when it
// ends, the process's ledger and roofline are as they were (the planner prices a layout's ops
// so, whatever the run around it counts).
class LedgerApart {
 public:
  explicit LedgerApart(const Roofline& r);
  ~LedgerApart();
  LedgerApart(const LedgerApart&) = delete;
  LedgerApart& operator=(const LedgerApart&) = delete;

 private:
  Ledger saved_;
  Roofline roofline_;
  bool priced_;
  int scope_;
};

// The time the clock (runtime/core.cuh, start_ledger_clock) measured for a row (as record_op
// returned it: a GEMM's shape row adds to its shape and to the GEMM row).
void add_measured_time(int row, double seconds);
