// ledger.cu: the ops' ledger (ledger.cuh). Observation only, like MemoryStats: it counts what
// is issued, it never steers it.
#include <algorithm>
#include <vector>

#include "runtime/ledger.cuh"

static Ledger g_ledger;
static thread_local int g_scope = -1;  // the kind ops count under, -1: their own
static bool g_priced = false;
static Roofline g_roofline;

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
    t.predicted_s += r.predicted_s;
    t.measured_s += r.measured_s;
  }
  return t;
}

Ledger ledger() {
  return g_ledger;
}
void reset_ledger() {
  g_ledger = Ledger{};
}

// The clock's rows past OpKind::Count: GEMM shapes, numbered as first seen (for the life of the
// process, so a number stays valid across reset_ledger).
static std::map<GemmShape, int> g_shape_rows;
static std::vector<GemmShape> g_shapes;

double Roofline::seconds(OpKind kind, const OpCost& c) const {
  double efficiency = 1;
  if (c.narrow > 0)
    efficiency = gemm_efficiency * c.narrow / (c.narrow + gemm_half_width);
  else if (kind == OpKind::Attention)
    efficiency = attention_efficiency;
  const double rate = peak[(int)c.unit] * efficiency;
  const double compute = c.flops > 0 ? c.flops / rate : 0;
  const double memory = (c.read + c.written) / (bandwidth * stream_efficiency);
  return std::max(compute, memory) + c.launches * launch_s;
}
void set_ledger_roofline(const Roofline& r) {
  g_roofline = r;
  g_priced = true;
}

LedgerApart::LedgerApart(const Roofline& r)
    : saved_(g_ledger), roofline_(g_roofline), priced_(g_priced), scope_(g_scope) {
  g_ledger = Ledger{};
  g_scope = -1;
  set_ledger_roofline(r);
}
LedgerApart::~LedgerApart() {
  g_ledger = saved_;
  g_roofline = roofline_;
  g_priced = priced_;
  g_scope = scope_;
}

void add_measured_time(int row, double seconds) {
  if (row >= (int)OpKind::Count) {
    g_ledger.gemm_shapes[g_shapes[row - (int)OpKind::Count]].measured_s += seconds;
    row = (int)OpKind::Gemm;
  }
  g_ledger.rows[row].measured_s += seconds;
}

int record_op(OpKind kind, const OpCost& cost) {
  const int row = g_scope >= 0 ? g_scope : (int)kind;
  const double predicted = g_priced ? g_roofline.seconds(kind, cost) : 0.0;
  auto add = [&](LedgerRow& r) {
    r.calls++;
    r.launches += cost.launches;
    r.flops += cost.flops;
    r.read += cost.read;
    r.written += cost.written;
    r.predicted_s += predicted;
  };
  add(g_ledger.rows[row]);
  if (row != (int)OpKind::Gemm || cost.m == 0) return row;
  const GemmShape shape{cost.m, cost.n, cost.k, cost.unit};
  LedgerRow& by_shape = g_ledger.gemm_shapes[shape];
  add(by_shape);
  by_shape.calls += cost.gemms - 1;  // a strided batch: each of its GEMMs
  auto [at, fresh] = g_shape_rows.emplace(shape, (int)g_shapes.size());
  if (fresh) g_shapes.push_back(shape);
  return (int)OpKind::Count + at->second;
}

LedgerScope::LedgerScope(OpKind kind) : saved_(g_scope) {
  g_scope = (int)kind;
}
LedgerScope::~LedgerScope() {
  g_scope = saved_;
}
