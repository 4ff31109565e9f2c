// compute.cu: what one micro-batch computes on a rank of a layout, priced from the ledger of the
// code that trains it (Playbook §11, §12): the model's own forward and backward run on the meta
// device (nothing computed, every op counted where it is issued and priced on the profile's
// roofline, as --report roofline prices a run), once with one block and once with two; their
// difference is a block's, the rest is the embedding's, the final norm's, the head's and the
// loss's. So the planner's step time and the roofline are one model: the same ops, the same
// prices. Communication is the planner's own (time.cu): a simulated rank exchanges nothing.
// The guide: docs/planner.md ("How it predicts").
#include <map>
#include <memory>
#include <tuple>

#include "context_parallel.cuh"
#include "data_parallel.cuh"
#include "expert_parallel.cuh"
#include "mixed_precision.cuh"
#include "model.cuh"
#include "planner/planner_internal.cuh"
#include "runtime/ledger.cuh"
#include "tensor_parallel.cuh"
#include "zero.cuh"

namespace {

// The ledger of one micro-batch through a model of `blocks` blocks: its forward, its backward
// (input gradients, and the weight gradients unless `split`), and under `split` the deferred
// weight gradients (zero-bubble's W) apart.
struct Pass {
  Ledger forward, backward, weights;
  Ledger step;  // once a step: the gradients zeroed, their norm, AdamW
};

// Predicted seconds of a ledger's rows (all of them, or only `kind`'s).
double seconds(const Ledger& l) {
  return l.total().predicted_s;
}
double seconds(const Ledger& l, OpKind kind) {
  return l.rows[(int)kind].predicted_s;
}

// Adds to `into` what the ledger counted since `before`.
void count_since(Ledger& into, const Ledger& before) {
  const Ledger now = ledger();
  for (int k = 0; k < (int)OpKind::Count; k++)
    add_difference(into.rows[k], before.rows[k], now.rows[k]);
}

// The gradient sync ./train runs for `l`: ZeRO-k over dp_cp, or plain data parallelism.
std::unique_ptr<GradientSync> gradient_sync(Comm& comm, Model& model, Context& ctx, const Layout& l,
                                            const PrecisionPolicy& precision) {
  if (l.zero > 0 && l.dp * l.cp > 1)
    return std::make_unique<Zero>(comm, model, l.zero, AdamWConfig{}, 0.1f, 1, true, precision);
  return std::make_unique<DataParallel>(comm, model, ctx, DataParallelOptions{}, AdamWConfig{},
                                        0.1f, 1, precision);
}

// Rank 0 of a simulated world of dp x cp x tp ranks (one pipeline stage) runs one micro-batch
// of `l` as ./train builds it: its tp slice of every layer, its cp share of the tokens, its
// experts, its gradient sync (the compute format's weights, ZeRO's shards and gathers).
Pass run_pass(ModelConfig cfg, const Layout& l, int blocks, Recompute mode, bool split) {
  cfg.layers = blocks;
  const int ep = cfg.experts > 0 ? l.ep : 1;
  Comm comm = comm_init(l.dp, 1, l.cp, l.tp, "nccl", Device::Meta, 60.0, ep,
                        SimulatedWorld{l.dp * l.cp * l.tp, 0});
  Context ctx = Context::create(Device::Meta);
  ctx.precision = l.precision, ctx.residual = l.residual;
  Pass pass;
  {
    const PrecisionPolicy precision(l.precision, l.bf16_grads ? DType::BF16 : DType::F32,
                                    LossScaler{});
    Model model = build_model_layout(cfg, TensorParallel{&comm, l.sp}, {}, ExpertParallel{&comm});
    model.attention = make_attention(comm, ContextParallelOptions{l.cp}, l.attention);
    std::unique_ptr<GradientSync> owned = gradient_sync(comm, model, ctx, l, precision);
    GradientSync& sync = *owned;
    Ledger at = ledger();
    sync.begin_step(ctx);
    count_since(pass.step, at);
    const int T = cfg.seq / l.cp;
    std::vector<int32_t> ids((size_t)l.mbs * T, 0);
    Activations acts;
    UnitHooks hooks = sync.hooks(ctx, false);  // not the last micro-batch: nothing to send
    at = ledger();
    stage_forward(ctx, model, acts, ids.data(), {}, ids.data(), l.mbs, T, mode, hooks);
    count_since(pass.forward, at);
    at = ledger();
    DeferredGrads deferred;
    stage_backward(ctx, model, acts, 1.0f, {}, mode, hooks, 0, split ? &deferred : nullptr);
    count_since(pass.backward, at);
    at = ledger();
    for (const DeferredGrad& w : deferred) w.run();
    count_since(pass.weights, at);
    at = ledger();
    sync.clip_grad_norm(ctx, 1.0f);
    sync.step(ctx, 1e-3f);
    count_since(pass.step, at);
  }
  ctx.destroy();
  comm_destroy(comm);
  return pass;
}

}  // namespace

const MicroBatchCost& micro_batch_cost(const ModelConfig& cfg, const Layout& layout,
                                       const GpuProfile& gpu, bool split) {
  const Roofline roof = roofline_of(gpu);
  // The dp ranks change a rank's ops only through ZeRO's shards (and the ep ranks among them).
  Layout l = layout;
  if (!(l.zero > 0 && l.dp * l.cp > 1)) l.dp = cfg.experts > 0 ? l.ep : 1;
  // Everything the ops of one micro-batch depend on; a search asks for few of them many times.
  using Key = std::tuple<std::vector<double>, std::vector<int>>;
  static std::map<Key, MicroBatchCost> remembered;
  Key key{{roof.peak[0], roof.peak[1], roof.peak[2], roof.gemm_efficiency, roof.gemm_half_width,
           roof.attention_efficiency, roof.bandwidth, roof.stream_efficiency, roof.launch_s},
          {cfg.d_model,
           cfg.heads,
           cfg.kv_heads,
           cfg.ffn,
           cfg.vocab,
           cfg.seq,
           cfg.experts,
           cfg.top_k,
           cfg.tie_embeddings,
           l.dp,
           l.zero,
           l.tp,
           l.sp,
           l.cp,
           cfg.experts > 0 ? l.ep : 1,
           l.mbs,
           (int)l.precision,
           l.bf16_grads,
           (int)l.residual,
           (int)l.recompute,
           (int)l.attention,
           split}};
  auto found = remembered.find(key);
  if (found != remembered.end()) return found->second;

  const MemoryStats memory = memory_stats();
  MicroBatchCost c;
  {
    LedgerApart apart(roof);
    const Pass one = run_pass(cfg, l, 1, l.recompute, split);
    const Pass two = run_pass(cfg, l, 2, l.recompute, split);
    c.block_fwd = seconds(two.forward) - seconds(one.forward);
    c.block_weights = seconds(two.weights) - seconds(one.weights);
    c.block_bwd = seconds(two.backward) - seconds(one.backward) + c.block_weights;
    c.block_gemm = seconds(two.forward, OpKind::Gemm) - seconds(one.forward, OpKind::Gemm);
    c.block_attention =
        seconds(two.forward, OpKind::Attention) - seconds(one.forward, OpKind::Attention);
    c.rest_fwd = seconds(one.forward) - c.block_fwd;
    c.rest_weights = seconds(one.weights) - c.block_weights;
    c.rest_bwd = seconds(one.backward) + seconds(one.weights) - c.block_bwd;
    c.block_step = seconds(two.step) - seconds(one.step);
    c.rest_step = seconds(one.step) - c.block_step;
    if (l.recompute != Recompute::None) {  // what recomputation adds to a block's backward
      const Pass a = run_pass(cfg, l, 1, Recompute::None, split);
      const Pass b = run_pass(cfg, l, 2, Recompute::None, split);
      c.block_recompute = c.block_bwd - (seconds(b.backward) + seconds(b.weights) -
                                         seconds(a.backward) - seconds(a.weights));
    }
  }
  memory_restore_peak(memory);
  if (remembered.size() > 20000) remembered.clear();
  return remembered.emplace(key, c).first->second;
}
