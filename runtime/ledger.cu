// ledger.cu: the ops' ledger (ledger.cuh). Observation only, like MemoryStats: it counts what
// is issued, it never steers it.
#include "runtime/ledger.cuh"

static Ledger g_ledger;
static thread_local int g_scope = -1;  // the kind ops count under, -1: their own

const char* op_kind_name(OpKind k) {
  static const char* names[] = {"gemm", "attention", "norm", "elementwise",
                                "loss", "optimizer", "cast", "memory"};
  return names[(int)k];
}

LedgerRow Ledger::total() const {
  LedgerRow t;
  for (const LedgerRow& r : rows) {
    t.calls += r.calls;
    t.launches += r.launches;
    t.flops += r.flops;
    t.read += r.read;
    t.written += r.written;
  }
  return t;
}

Ledger ledger() {
  return g_ledger;
}
void reset_ledger() {
  g_ledger = Ledger{};
}

void record_op(OpKind kind, const OpCost& cost) {
  LedgerRow& r = g_ledger.rows[g_scope >= 0 ? g_scope : (int)kind];
  r.calls++;
  r.launches += cost.launches;
  r.flops += cost.flops;
  r.read += cost.read;
  r.written += cost.written;
}

LedgerScope::LedgerScope(OpKind kind) : saved_(g_scope) {
  g_scope = (int)kind;
}
LedgerScope::~LedgerScope() {
  g_scope = saved_;
}
