// time.cu: a layout's step time (Playbook §3-§8, appendix A3): the book's FLOPs at a named
// fraction of the peak, every collective at latency plus bytes over bus bandwidth with the ring's
// factors, exposed only where A3 says compute cannot hide it, and the bubble of the schedule's
// tables run on paper.
#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "planner/pipeline_timing.cuh"
#include "planner/planner_internal.cuh"
#include "runtime/dtype.cuh"
#include "runtime/formulas.cuh"
#include "tensor_parallel.cuh"

// ----------------------------------------------------------------------------
// Communication: the alpha-beta cost of ring collectives (collectives notes §2.4, nccl-tests'
// bus bandwidth)

namespace {

enum class Op { AllReduce, Gather, PointToPoint };  // Gather: all-gather or reduce-scatter

// Where a group's members sit: how many, whether the group leaves the node, and how many of
// them share the busiest node (each brings its own network link).
struct Placement {
  int size = 1, per_node = 1;
  bool inter = false;
};
// The group of world rank 0 along the given grid dimensions ("dp", "pp", "cp", "tp", "dp_cp").
Placement placement(const Layout& l, const Cluster& cl, const std::string& group) {
  Grid g;
  g.dp = l.dp, g.pp = l.pp, g.cp = l.cp, g.tp = l.tp;
  std::vector<int> members;
  const bool d = group == "dp" || group == "dp_cp", p = group == "pp",
             c = group == "cp" || group == "dp_cp", t = group == "tp", e = group == "ep";
  // ep: a block of ep consecutive dp ranks (runtime/comm_setup.cu).
  for (int di = 0; di < (d ? l.dp : e ? l.ep : 1); di++)
    for (int pi = 0; pi < (p ? l.pp : 1); pi++)
      for (int ci = 0; ci < (c ? l.cp : 1); ci++)
        for (int ti = 0; ti < (t ? l.tp : 1); ti++) members.push_back(g.rank_of(di, pi, ci, ti));
  std::map<int, int> per_node;
  for (int r : members) per_node[r / cl.gpus_per_node]++;
  Placement pl;
  pl.size = (int)members.size();
  pl.inter = per_node.size() > 1;
  for (auto& [node, k] : per_node) pl.per_node = std::max(pl.per_node, k);
  return pl;
}

// Seconds for one collective on `bytes` (all-reduce: the buffer; all-gather: the gathered
// output; reduce-scatter: the input; point-to-point: the message).
double collective_time(const GpuProfile& gpu, const Placement& pl, Op op, double bytes) {
  const int R = pl.size;
  // In a node: the group size's own measurement, else the profile's.
  auto measured = gpu.intra_by_size.find(R);
  const GpuProfile::Links& k = measured != gpu.intra_by_size.end() ? measured->second : gpu.intra;
  if (op == Op::PointToPoint) {
    double bw = pl.inter ? gpu.nic_bw : k.p2p_bw;
    return (pl.inter ? gpu.inter_alpha : k.alpha_p2p) + bytes / bw;
  }
  if (R <= 1 || bytes <= 0) return 0;
  const bool ar = op == Op::AllReduce;
  const double steps = (ar ? 2.0 : 1.0) * (R - 1), factor = steps / R;
  if (!pl.inter)
    return steps * (ar ? k.alpha : k.alpha_gather) +
           factor * bytes / (ar ? k.allreduce_bw : k.gather_bw);
  // Between nodes: the ring's bandwidth, capped by the network links its members on one node
  // bring, and degraded by the ranks in it.
  double inverse = std::max(1.0 / (ar ? gpu.inter_allreduce_bw : gpu.inter_gather_bw),
                            1.0 / (pl.per_node * gpu.nic_bw)) +
                   R * (ar ? gpu.inter_allreduce_per_rank : gpu.inter_gather_per_rank);
  return steps * gpu.inter_alpha + factor * bytes * inverse;
}

// simulate_pipeline (pipeline_parallel.cu) on ticks: with a device per rank its result depends
// on the ratios of the op costs only, so layouts with the same (schedule, p, m, V) and ratios
// share one run.
PipelineTiming pipeline_timing(PpSchedule s, int p, int m, int V, double t_f, double t_b,
                               double t_w) {
  static std::map<std::vector<double>, PipelineTiming> cache;
  std::vector<double> key = {(double)s, (double)p, (double)m, (double)V, t_b / t_f, t_w / t_f};
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() > 20000) cache.clear();
    const PipelineCosts ticks{1.0, key[4], key[5]};  // a forward takes one tick
    it = cache.emplace(key, simulate_pipeline(s, p, m, V, ticks)).first;
  }
  PipelineTiming t = it->second;
  t.makespan *= t_f;
  for (double& b : t.busy) b *= t_f;
  return t;
}

}  // namespace

// The ranks of a layout on one node.
static int world_ranks_per_node(const Layout& l, const Cluster& cl) {
  return std::min(l.world(), cl.gpus_per_node);
}

double StepTime::exposed_total() const {
  double t = 0;
  for (auto& [group, s] : exposed) t += s;
  return t;
}

double book_flops_per_token(const ModelConfig& cfg) {
  return model_flops_per_token((double)active_parameter_count(cfg), cfg.layers,
                               cfg.heads * cfg.head_dim(), cfg.seq);
}

StepTime predict_time(const ModelConfig& cfg, const Layout& l, const Cluster& cl,
                      const Implementation& impl, double above) {
  const GpuProfile& gpu = cl.gpu;
  const LocalDims L = local_dims(cfg, 0, l.tp);
  const int m = l.grad_acc, p = l.pp, V = l.virtual_stages;
  const double T = (double)cfg.seq / l.cp, N = l.mbs * T, n = l.sp ? N / l.tp : N;
  const double D = cfg.d_model, hd = cfg.head_dim(), wire = impl.activation_wire_bytes;
  // Zero-bubble tables run a backward's weight gradients as an op of their own (W).
  const bool split =
      p > 1 && !weights_apart(pipeline_schedule(l.schedule, p, 0, std::max(m, 2 * p), V)).empty();
  // One block's forward and backward, and the rest (embedding, head, loss), on this rank: the
  // ledger of the model's own ops on the meta device, priced on the profile's roofline
  // (compute.cu), as --report roofline prices a run.
  const MicroBatchCost& cost = micro_batch_cost(cfg, l, gpu, split);
  const double block_gemm = cost.block_gemm, block_attn = cost.block_attention;
  const double block_fwd = cost.block_fwd, block_bwd = cost.block_bwd;

  // Tensor parallelism: every collective on the critical path (Playbook §5.3; picoscale's are
  // blocking). Per block, forward: 2 all-reduces of [N, D], or under sp 2 all-gathers and 2
  // reduce-scatters; backward: 2 all-reduces, or 4 all-gathers (2 re-gathering the norms'
  // outputs) and 2 reduce-scatters (runtime/formulas.cu, tp_expected_traffic).
  Placement tp_pl = placement(l, cl, "tp");
  const double K = N * D * wire;
  double tp_fwd = 0, tp_bwd = 0;
  if (l.tp > 1) {
    double ar = collective_time(gpu, tp_pl, Op::AllReduce, K);
    double ag = collective_time(gpu, tp_pl, Op::Gather, K);
    tp_fwd = l.sp ? 4 * ag : 2 * ar;  // a reduce-scatter costs an all-gather
    tp_bwd = l.sp ? 6 * ag : 2 * ar;
  }
  // Context parallelism (Playbook §7.2): per block, cp - 1 ring steps, each passing k and v of
  // this rank's tokens (forward) or k, v and their gradient accumulators (backward) while one
  // block of attention computes; only what the step's compute does not cover is exposed.
  double cp_fwd = 0, cp_bwd = 0;
  if (l.cp > 1) {
    Placement cp_pl = placement(l, cl, "cp");
    double kv = 2 * N * L.kv_heads * hd * wire;
    double step_fwd = collective_time(gpu, cp_pl, Op::PointToPoint, kv);
    double step_bwd = collective_time(gpu, cp_pl, Op::PointToPoint, 2 * kv);
    cp_fwd = (l.cp - 1) * std::max(0.0, step_fwd - block_attn / l.cp);
    cp_bwd = (l.cp - 1) * std::max(0.0, step_bwd - 2 * block_attn / l.cp);
  }
  // Expert parallelism (Playbook §9): per block, the forward's dispatch and combine and the
  // backward's two, each sending N k (ep - 1) / ep rows of D values to the other ep ranks (every
  // rank at once: its link's bandwidth), blocking; the rows travel in the compute format (2 bytes
  // a value under bf16, expert_parallel.cu's rows_to_send).
  double ep_fwd = 0;
  const double rows_wire = std::min(wire, (double)dtype_size(activation_dtype(l.precision)));
  if (l.ep > 1 && cfg.experts > 0)
    ep_fwd = 2 * collective_time(gpu, placement(l, cl, "ep"), Op::PointToPoint,
                                 N * cfg.top_k * (l.ep - 1.0) / l.ep * D * rows_wire);
  // Pipeline parallelism (Playbook §8.7): each op receives [n, D] from its neighbour and waits
  // for it (the engine's receives block), so the transfer adds to the op; in the residual
  // stream's format (2 bytes under --residual-dtype).
  double p2p = 0;
  const double stream_wire = std::min(wire, (double)dtype_size(l.residual));
  if (p > 1)
    p2p = collective_time(gpu, placement(l, cl, "pp"), Op::PointToPoint, n * D * stream_wire);

  // Appendix A3: an overlapped tp collective hides behind the GEMMs of its block.
  if (impl.tp_overlap) {
    tp_fwd = std::max(0.0, tp_fwd - block_gemm);
    tp_bwd = std::max(0.0, tp_bwd - 2 * block_gemm);
  }
  // The slowest pipeline rank's forward and backward of one micro-batch (all its chunks). The
  // first and the last bound the others: the most blocks and the embedding, or the head
  // (pipeline_chunks gives the first chunks the extra blocks).
  std::vector<const StageShape*> shapes;
  for (int s : p > 1 ? std::vector<int>{0, p - 1} : std::vector<int>{0})
    shapes.push_back(&stage_shape(cfg, l, s));
  double stage_fwd = 0, stage_bwd = 0, stage_weights = 0, stage_recompute = 0, stage_tp = 0,
         stage_cp = 0, stage_p2p = 0, stage_ep = 0;
  for (const StageShape* shape : shapes) {
    double f = 0, b = 0, w = 0, r = 0, tpc = 0, cpc = 0, pc = 0, epc = 0;
    int blocks = 0;
    for (const StageShape::Chunk& c : shape->chunks) {
      blocks += c.blocks;
      f += c.blocks * block_fwd + (c.head ? cost.rest_fwd : 0);
      b += c.blocks * block_bwd + (c.head ? cost.rest_bwd : 0);
      w += c.blocks * cost.block_weights + (c.head ? cost.rest_weights : 0);
      r += c.blocks * cost.block_recompute;
      // The vocab-parallel embedding and head (tensor_parallel.cu): without sp the embedding's
      // forward and the head's backward add an all-reduce each, half a block's forward; under
      // sp the embedding adds a reduce-scatter (forward) and an all-gather (backward), and the
      // head, column-parallel, an all-gather (forward), another re-gathering its input and a
      // reduce-scatter (backward): two and three of the block forward's four.
      const double embedding_tp = tp_fwd / 2, head_tp = l.sp ? tp_fwd * 3 / 4 : tp_fwd / 2;
      tpc +=
          c.blocks * (tp_fwd + tp_bwd) + (c.embedding ? embedding_tp : 0) + (c.head ? head_tp : 0);
      epc += c.blocks * 2 * ep_fwd;
      cpc += c.blocks * (cp_fwd + cp_bwd);
      pc += (c.receives ? 2 * p2p : 0) + (c.sends ? 2 * p2p : 0);
    }
    if (impl.balanced_stages && p > 1) {  // every stage a p-th of the whole model's work
      f = (cfg.layers * block_fwd + cost.rest_fwd) / p;
      b = (cfg.layers * block_bwd + cost.rest_bwd) / p;
      w = (cfg.layers * cost.block_weights + cost.rest_weights) / p;
      r = r / blocks * cfg.layers / p;
    }
    if (f + b + tpc + cpc + pc + epc >
        stage_fwd + stage_bwd + stage_tp + stage_cp + stage_p2p + stage_ep) {
      stage_fwd = f, stage_bwd = b, stage_weights = w, stage_recompute = r;
      stage_tp = tpc, stage_cp = cpc, stage_p2p = pc, stage_ep = epc;
    }
  }
  // Per op (a chunk's share): compute plus its exposed tp, cp and pp communication; the
  // backward splits into B and W under zero-bubble tables (W: the deferred weight gradients).
  const double ops = (double)V;
  const double comm_op = (stage_tp + stage_cp + stage_p2p + stage_ep) / ops / 2;
  double t_f = stage_fwd / ops + comm_op, t_b = stage_bwd / ops + comm_op, t_w = 0;
  if (split) t_w = stage_weights / ops, t_b -= t_w;
  const double busy = m * (stage_fwd + stage_bwd + stage_tp + stage_cp + stage_p2p + stage_ep);
  // Without a bubble: the ranks busy end to end, and on CPU ranks a rank's sends left out (they
  // move inside MPI, while it waits). A lower bound on the makespan, at most at full speed.
  const double unbubbled = impl.mpi_sends ? busy - m * stage_p2p : busy;
  // CPU ranks: the node's cores' worth (bench_comm's measure, else a core per rank) shared
  // evenly by its ranks; the optimizer's pass, which every rank runs at once, at that share too.
  const double node_ranks = world_ranks_per_node(l, cl);
  const double node_cores = gpu.shared_capacity > 0 ? gpu.shared_capacity : node_ranks;
  const double host_share = impl.mpi_sends ? std::max(1.0, node_ranks / node_cores) : 1.0;

  StepTime st;
  st.compute = m * (stage_fwd + stage_bwd);
  st.recompute = m * stage_recompute;
  st.exposed["tp"] = m * stage_tp;
  st.exposed["cp"] = m * stage_cp;
  st.exposed["pp"] = m * stage_p2p;
  if (l.ep > 1) st.exposed["ep"] = m * stage_ep;

  // Data parallelism and ZeRO over dp_cp (Playbook §3, §4; appendix A3): what the backward
  // of the micro-batch that launches the collectives covers is hidden; the rest is exposed.
  const int Nd = l.dp * l.cp;
  const int zero = Nd > 1 ? l.zero : 0;
  double dp_exposed = 0, opt = 0;
  {
    Placement pl = placement(l, cl, "dp_cp"), pl_experts = pl;
    pl_experts.size = Nd / l.ep;  // edp_cp: a mixture's experts (its nodes taken as dp_cp's)
    const double grad_bytes = l.bf16_grads ? 2 : 4;
    const double weight_bytes = l.precision == Precision::FP32 ? 4 : 2;
    double worst = 0, worst_opt = 0;
    for (const StageShape* shape : shapes) {
      const StageShape& sh = *shape;
      // Once a step: the gradients zeroed, their norm and AdamW on this rank's share (ZeRO's
      // shard), the ledger's for the stage's blocks and its embedding or head (the probe's rest
      // holds one such matrix when tied, two when not).
      int blocks = 0, matrices = 0;
      for (const StageShape::Chunk& c : sh.chunks) {
        blocks += c.blocks;
        matrices += c.embedding + (c.head && !(c.embedding && cfg.tie_embeddings));
      }
      const double o =
          blocks * cost.block_step + cost.rest_step * matrices / (cfg.tie_embeddings ? 1.0 : 2.0);
      double exposed = 0;
      if (Nd > 1) {
        // The last micro-batch's backward on this stage; none on CPU ranks, where MPI moves a
        // nonblocking collective only within MPI calls and the cores are busy computing.
        double window = impl.mpi_sends ? 0 : stage_bwd;
        if (zero == 0) {
          // Buckets of 25 MiB (data_parallel.cu), all-reduced as they fill; the last cannot hide.
          // A mixture's experts in buckets of their own over edp_cp (no sum when it is 1 rank).
          const double bucket = 25.0 * 1024 * 1024, experts = grad_bytes * sh.expert_params();
          const double bytes = grad_bytes * sh.num_params - experts;
          int buckets = std::max(1, (int)std::ceil(bytes / bucket));
          double each = collective_time(gpu, pl, Op::AllReduce, bytes / buckets);
          double total = buckets * each;
          if (experts > 0 && pl_experts.size > 1) {
            int n = std::max(1, (int)std::ceil(experts / bucket));
            total += n * collective_time(gpu, pl_experts, Op::AllReduce, experts / n);
          }
          exposed = std::max(each, total - window);
        } else {
          double rs = 0, rs_last = 0, ag = 0;
          for (size_t i = 0; i < sh.unit_numel.size(); i++) {
            const int64_t u = sh.unit_numel[i];
            const Placement& group = sh.unit_experts[i] ? pl_experts : pl;
            double padded = (double)group.size * ((u + group.size - 1) / group.size);
            rs_last = collective_time(gpu, group, Op::Gather, grad_bytes * padded);
            rs += rs_last;
            ag += collective_time(gpu, group, Op::Gather, weight_bytes * padded);
          }
          if (zero == 1) exposed = std::max(rs_last, rs - window);
          if (zero == 2) exposed = m * std::max(rs_last, rs - window);  // every micro-batch
          if (zero <= 2) exposed += std::max(0.0, ag - o);  // gathered as the optimizer updates
          if (zero == 3) {
            // Per micro-batch: every unit gathered before its forward and again before its
            // backward, the next one prefetched while this one computes; the reduce-scatter
            // after its backward overlaps the next unit's (A3: 1/(2 seq mbs) x peak/bw <= 1).
            double units = (double)sh.unit_numel.size();
            double f_unit = window > 0 ? stage_fwd / units : 0, b_unit = window / units;
            double ag_unit = ag / units, rs_unit = rs / units;
            exposed = m * (ag_unit + units * std::max(0.0, ag_unit - f_unit) +
                           units * std::max(0.0, ag_unit + rs_unit - b_unit));
          }
        }
      }
      worst = std::max(worst, exposed), worst_opt = std::max(worst_opt, o);
    }
    dp_exposed = worst, opt = worst_opt;
  }
  st.exposed["dp"] = dp_exposed;
  st.optimizer = opt * host_share;
  double makespan = unbubbled;
  st.timed = unbubbled + dp_exposed + st.optimizer <= above;
  if (st.timed && impl.mpi_sends) {
    // A pipeline stage's tp and cp ranks move in step. Each op is its compute plus blocking
    // collectives, the sends moving only inside MPI (HostRanks).
    const double work_w = split ? stage_weights / ops : 0;
    const PipelineCosts host_costs{stage_fwd / ops, stage_bwd / ops - work_w, work_w,
                                   (stage_tp + stage_cp + stage_ep) / ops / 2};
    PipelineTiming host = simulate_pipeline(p * V > 1 ? l.schedule : PpSchedule::OneFOneB, p, m, V,
                                            host_costs, HostRanks{node_cores * p / node_ranks});
    makespan = host.complete ? host.makespan : std::numeric_limits<double>::infinity();
  } else if (st.timed && p > 1) {
    makespan = pipeline_timing(l.schedule, p, m, V, t_f, t_b, t_w).makespan;
  }
  st.bubble = std::max(0.0, makespan - busy);
  st.step = makespan + dp_exposed + st.optimizer;
  const double tokens = (double)l.dp * l.mbs * l.grad_acc * cfg.seq;
  const int world = l.world();
  st.tokens_per_s_per_gpu = tokens / st.step / world;
  st.mfu = book_flops_per_token(cfg) * tokens / (st.step * world * mfu_peak(gpu, l.precision));
  return st;
}
