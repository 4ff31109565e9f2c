// roofline.cu: --report roofline (Playbook §12, seed 004: memory-bound or compute-bound). The
// ledger (runtime/ledger.cuh) counts every op of a training step where it is issued: FLOPs,
// bytes read and written, kernel launches; each is priced on a device profile as the larger of
// its compute time and its memory time plus its launches, and each group's collectives at
// latency plus bytes over bus bandwidth, as the planner prices them. On the meta device that is
// the step; on CPU and CUDA the clock measures each category beside the prediction. The guide:
// docs/meta-device.md.
#include <algorithm>
#include <cmath>
#include <map>

#include "planner/planner_internal.cuh"
#include "runtime/dtype.cuh"
#include "runtime/formulas.cuh"

Roofline roofline_of(const GpuProfile& g) {
  Roofline r;
  r.peak[(int)MathUnit::CudaCores] = g.peak_fp32;
  // A CPU profile has one rate: its fp32 GEMM's (no tensor cores; the CPU path computes in fp32).
  r.peak[(int)MathUnit::Tensor16] = g.peak_bf16 > 0 ? g.peak_bf16 : g.peak_fp32;
  r.peak[(int)MathUnit::Tensor8] = g.peak_fp8 > 0 ? g.peak_fp8 : r.peak[(int)MathUnit::Tensor16];
  r.gemm_efficiency = g.gemm_efficiency;
  r.gemm_half_width = g.gemm_half_width;
  r.attention_efficiency = g.attention_efficiency;
  r.bandwidth = g.hbm_bandwidth;
  r.stream_efficiency = g.stream_efficiency;
  r.launch_s = g.launch_s;
  return r;
}

// The bytes each training step must move at the least on this rank: every weight read by the
// forward and by the backward of each micro-batch, the gradient written by the first and read
// and written by each further one, the optimizer's one pass (gradient, master weight, Adam's m
// and v read; master, m, v and the compute copy written), every saved activation written once
// and read once, and the logits with their gradient.
static double minimum_traffic(const RooflineRun& r) {
  const double psi = (double)r.params, ga = r.grad_acc;
  const double weights = 2 * ga * psi * r.weight_bytes;
  const double grads = (2 * ga - 1) * psi * r.grad_bytes;
  const double master = r.mixed ? 4 : 0;  // fp32 master weights apart from the compute copy
  const double optimizer = psi * (r.grad_bytes + master + 8 + 8 + master + (r.mixed ? 2 : 4));
  const double activations = 2 * ga * ((double)r.activation_bytes + r.logit_bytes);
  return weights + grads + optimizer + activations;
}

RooflineMeter::RooflineMeter(Comm& comm, const Context& ctx, const GpuProfile& gpu,
                             const RooflineRun& run)
    : comm_(comm),
      ctx_(ctx),
      gpu_(gpu),
      run_(run),
      gpus_per_node_(gpu.name == "cpu" ? comm.grid.world_size : 8) {
  set_ledger_roofline(roofline_of(gpu));
  start_ledger_clock(ctx.device, ctx.stream);
}

void RooflineMeter::begin(StepPart p, int64_t) {
  if (p != StepPart::Step) return;
  mark_ledger_clock();  // what ran before the step is not the step's
  settle_ledger_clock();
  at_start_ = ledger();
  groups_at_start_.clear();
  for (Group* g : comm_.groups())
    groups_at_start_.push_back(std::vector<CollStats>(g->stats, g->stats + (int)Coll::Count));
}

// Seconds the collectives of group g cost on this profile, from what they sent (the comm
// report's formula bytes: the ring's share of each call) and their calls' ring steps.
double RooflineMeter::group_seconds(const Group& g, const CollStats* delta) const {
  if (g.size <= 1) return 0;
  std::map<int, int> per_node;
  for (int r : g.members) per_node[r / std::max(1, gpus_per_node_)]++;
  const bool inter = per_node.size() > 1;
  int busiest = 1;
  for (auto& [node, k] : per_node) busiest = std::max(busiest, k);
  auto found = gpu_.intra_by_size.find(g.size);
  const GpuProfile::Links& k = found != gpu_.intra_by_size.end() ? found->second : gpu_.intra;
  const double R = g.size;
  double seconds = 0;
  for (int c = 0; c < (int)Coll::Count; c++) {
    const double calls = (double)delta[c].calls, bytes = (double)delta[c].bytes;
    if (calls == 0) continue;
    const bool ar = c == (int)Coll::AllReduce;
    const bool ring = ar || c == (int)Coll::AllGather || c == (int)Coll::ReduceScatter;
    if (!ring) {  // point to point: send/recv, all-to-all, the rest
      seconds += calls * (inter ? gpu_.inter_alpha : k.alpha_p2p) +
                 bytes / (inter ? gpu_.nic_bw : k.p2p_bw);
      continue;
    }
    // The ring's bytes per rank over the bus bandwidth (nccl-tests' busbw), and its steps.
    const double steps = (ar ? 2 : 1) * (R - 1);
    if (!inter) {
      seconds += calls * steps * (ar ? k.alpha : k.alpha_gather) +
                 bytes / (ar ? k.allreduce_bw : k.gather_bw);
      continue;
    }
    const double inverse = std::max(1.0 / (ar ? gpu_.inter_allreduce_bw : gpu_.inter_gather_bw),
                                    1.0 / (busiest * gpu_.nic_bw)) +
                           R * (ar ? gpu_.inter_allreduce_per_rank : gpu_.inter_gather_per_rank);
    seconds += calls * steps * gpu_.inter_alpha + bytes * inverse;
  }
  return seconds;
}

// sum += b - a: what one row counted between two readings of the ledger.
void RooflineMeter::end(StepPart p) {
  if (p != StepPart::Step) return;
  mark_ledger_clock();
  settle_ledger_clock();
  const Ledger now = ledger();
  double compute = 0;
  for (int k = 0; k < (int)OpKind::Count; k++) {
    const LedgerRow &a = at_start_.rows[k], &b = now.rows[k];
    add_difference(steps_.rows[k], a, b);
    if (steps_run_ == 0) add_difference(first_.rows[k], a, b);
    compute += b.predicted_s - a.predicted_s;
  }
  for (const auto& [shape, b] : now.gemm_shapes) {
    const auto before = at_start_.gemm_shapes.find(shape);
    const LedgerRow a = before != at_start_.gemm_shapes.end() ? before->second : LedgerRow{};
    add_difference(steps_.gemm_shapes[shape], a, b);
    if (steps_run_ == 0) add_difference(first_.gemm_shapes[shape], a, b);
  }
  std::vector<Group*> groups = comm_.groups();
  if (comm_seconds_.empty())
    comm_seconds_.assign(groups.size(), 0), comm_bytes_.assign(groups.size(), 0);
  double comm = 0;
  for (size_t i = 0; i < groups.size(); i++) {
    CollStats delta[(int)Coll::Count];
    for (int c = 0; c < (int)Coll::Count; c++) {
      delta[c].calls = groups[i]->stats[c].calls - groups_at_start_[i][c].calls;
      delta[c].bytes = groups[i]->stats[c].bytes - groups_at_start_[i][c].bytes;
      comm_bytes_[i] += (double)delta[c].bytes;
    }
    const double s = group_seconds(*groups[i], delta);
    comm_seconds_[i] += s, comm += s;
  }
  last_step_s_ = compute + comm;
  steps_run_++;
}

double RooflineMeter::step_seconds(double measured) const {
  return ctx_.device == Device::Meta ? last_step_s_ : measured;
}

// The GEMMs by shape, the longest predicted first: where the GEMM row's time goes, and on a
// real run how much of the peak each shape reached (the profile assumes one fraction for all).
void RooflineMeter::print_gemm_shapes(const Roofline& roof, double n, bool timed,
                                      double timed_steps) const {
  if (steps_.gemm_shapes.empty()) return;
  std::vector<std::pair<GemmShape, LedgerRow>> shapes(steps_.gemm_shapes.begin(),
                                                      steps_.gemm_shapes.end());
  std::sort(shapes.begin(), shapes.end(), [](const auto& a, const auto& b) {
    return a.second.predicted_s > b.second.predicted_s;
  });
  const char* unit_name[] = {"fp32", "16-bit", "8-bit"};
  printf(
      "  GEMMs by shape (C [M, N] = A [M, K] B [K, N]; a linear layer's forward, input gradient "
      "and weight gradient are three; per training step):\n");
  printf("  %8s %8s %8s %7s %7s %10s %12s %8s%s\n", "M", "N", "K", "unit", "calls", "GFLOP",
         "predicted ms", "of peak", timed ? "  measured ms  of peak" : "");
  for (const auto& [shape, s] : shapes) {
    const auto& [m, cols, k, unit] = shape;
    const double peak = roof.peak[(int)unit], flops = s.flops / n, predicted = s.predicted_s / n;
    printf("  %8lld %8lld %8lld %7s %7.0f %10.3f %12.3f %7.1f%%", (long long)m, (long long)cols,
           (long long)k, unit_name[(int)unit], s.calls / n, flops / 1e9, predicted * 1e3,
           predicted > 0 ? 100 * flops / (predicted * peak) : 0.0);
    if (timed) {
      const auto first = first_.gemm_shapes.find(shape);
      const double skipped =
          timed_steps < n && first != first_.gemm_shapes.end() ? first->second.measured_s : 0.0;
      const double measured = (s.measured_s - skipped) / timed_steps;
      printf("  %11.3f %7.1f%%", measured * 1e3,
             measured > 0 ? 100 * flops / (measured * peak) : 0.0);
    }
    printf("\n");
  }
}

void RooflineMeter::report(Report r) {
  if (r != Report::Roofline || !comm_.grid.prints()) return;
  const double n = (double)std::max<int64_t>(1, steps_run_);
  const Roofline roof = roofline_of(gpu_);
  const bool timed = ctx_.device != Device::Meta;
  // The measured column leaves the first step out when there are others: it pays once for what
  // the steps after it reuse (loading each kernel at its first launch, cuBLAS's first calls,
  // the memory pool's growth).
  const bool skip_first = steps_run_ > 1;
  const double timed_steps = skip_first ? n - 1 : n;
  auto measured_of = [&](int k) {
    return (steps_.rows[k].measured_s - (skip_first ? first_.rows[k].measured_s : 0.0)) /
           timed_steps;
  };
  printf(
      "roofline (--report roofline; the %s profile: %s; rank %d, per training step, averaged "
      "over %lld):\n",
      gpu_.name.c_str(), gpu_.roofline_source.c_str(), comm_.grid.world_rank,
      (long long)steps_run_);
  printf(
      "  peaks %.4g (fp32), %.4g (16-bit tensor cores), %.4g (8-bit) TFLOP/s; GEMMs reach %.2f of "
      "it, half that at a width of %g; attention %.2f; memory %.4g GB/s x %.2f; %.1f us a "
      "launch\n",
      roof.peak[0] / 1e12, roof.peak[1] / 1e12, roof.peak[2] / 1e12, roof.gemm_efficiency,
      roof.gemm_half_width, roof.attention_efficiency, roof.bandwidth / 1e9, roof.stream_efficiency,
      roof.launch_s * 1e6);
  printf("  %-12s %8s %9s %10s %10s %8s %12s%s\n", "category", "calls", "launches", "GFLOP",
         "GB moved", "FLOP/B", "predicted ms", timed ? "  measured ms" : "");
  double predicted = 0, measured = 0, flops = 0, moved = 0, launches = 0, other_moved = 0;
  for (int k = 0; k < (int)OpKind::Count; k++) {
    const LedgerRow& s = steps_.rows[k];
    if (s.calls == 0) continue;
    const double bytes = s.read + s.written;
    printf("  %-12s %8.0f %9.0f %10.3f %10.4f %8.1f %12.3f", op_kind_name((OpKind)k), s.calls / n,
           s.launches / n, s.flops / n / 1e9, bytes / n / 1e9, bytes > 0 ? s.flops / bytes : 0.0,
           s.predicted_s / n * 1e3);
    if (timed) printf("  %11.3f", measured_of(k) * 1e3);
    printf("\n");
    predicted += s.predicted_s, measured += measured_of(k), flops += s.flops, moved += bytes;
    launches += (double)s.launches;
    if (k != (int)OpKind::Gemm && k != (int)OpKind::Attention) other_moved += bytes;
  }
  std::vector<Group*> groups = comm_.groups();
  double comm = 0;
  for (size_t i = 0; i < comm_seconds_.size(); i++) {
    if (comm_bytes_[i] == 0) continue;
    printf("  %-12s %8s %9s %10s %10.4f %8s %12.3f  (%d ranks%s)\n",
           ("comm " + groups[i]->name).c_str(), "", "", "", comm_bytes_[i] / n / 1e9, "",
           comm_seconds_[i] / n * 1e3, groups[i]->size, "");
    comm += comm_seconds_[i];
  }
  printf("  %-12s %8s %9.0f %10.3f %10.4f %8.1f %12.3f", "total ops", "", launches / n,
         flops / n / 1e9, moved / n / 1e9, moved > 0 ? flops / moved : 0.0, predicted / n * 1e3);
  if (timed) printf("  %11.3f", measured * 1e3);
  printf("\n");
  const double step = (predicted + comm) / n, hidden = std::max(predicted, comm) / n;
  const double tokens = (double)run_.tokens_per_step / run_.world;  // this rank's share
  const double peak = mfu_peak(gpu_, run_.precision);
  auto mfu = [&](double seconds) {
    return 100 * book_flops_per_token(run_.model) * tokens / (seconds * peak);
  };
  printf(
      "  predicted step %.3f ms with communication after compute, MFU %.1f%%; %.3f ms with it "
      "all hidden behind compute, MFU %.1f%% (the book's 6N + 12 L h s per token over the "
      "%s peak, %.4g tokens per rank)\n",
      step * 1e3, mfu(step), hidden * 1e3, mfu(hidden), precision_name(run_.precision), tokens);
  const double least = minimum_traffic(run_);
  printf(
      "  minimum traffic %.4f GB (weights read twice a micro-batch, gradients, one optimizer "
      "pass, activations written and read once): everything but GEMMs and attention moves "
      "%.2fx it, all ops %.2fx\n",
      least / 1e9, other_moved / n / least, moved / n / least);
  const LedgerRow &gemm = steps_.rows[(int)OpKind::Gemm],
                  &attn = steps_.rows[(int)OpKind::Attention];
  printf(
      "  FLOPs per training step on this rank: GEMMs %.0f, attention %.0f; the book's (6N + 12 L "
      "h s) x tokens: %.0f (6N counts the embedding's lookup as a GEMM, 12 L h s every (query, "
      "key) pair and a backward of two forwards; the ledger the linear layers' 6 per weight and "
      "token, and 14 per visible pair and head dimension)\n",
      gemm.flops / n, attn.flops / n, book_flops_per_token(run_.model) * tokens);
  printf("  launches per micro-batch: %.0f (%d blocks on this rank)\n",
         launches / n / run_.grad_acc, run_.blocks);
  print_gemm_shapes(roof, n, timed, timed_steps);
  if (timed) {
    const double first = first_.total().measured_s;
    printf(
        "  measured: each op's time from its start to the next op's or collective's (%s), "
        "averaged over %s; communication and waits are not in it\n",
        ctx_.device == Device::CUDA ? "CUDA events on the compute stream" : "the wall clock",
        skip_first ? "the steps after the first" : "the one step");
    if (skip_first)
      printf("  the first step's ops measured %.3f ms (%s)\n", first * 1e3,
             ctx_.device == Device::CUDA
                 ? "each kernel loaded at its first launch, cuBLAS's first calls, the memory "
                   "pool growing"
                 : "memory touched for the first time, caches cold");
  } else
    printf(
        "  the meta device computes nothing: every time above is the profile's; a mixture's "
        "routing is taken as uniform\n");
}
