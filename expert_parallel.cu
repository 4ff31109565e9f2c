// expert_parallel.cu: a mixture of experts and expert parallelism (Playbook, "Expert
// parallelism"; Mixtral; Switch Transformer's load-balancing loss).
//   route    each token's router logits -> softmax (fp32) -> its top k experts, their weights
//            renormalised to sum to 1
//   dispatch rows (token, expert) sorted by expert, so each ep rank's experts are one segment:
//            counts first (exchange_counts), then the hidden states (all_to_all_v)
//   compute  each local expert's SwiGLU on its rows
//   combine  the outputs back by the reverse all-to-all, times their weights, summed per token
// The one idea: an expert is an MLP that sees only the tokens routed to it, so the experts can
// live on different ranks as long as the tokens travel to them: data parallelism for every
// other weight, and the experts sharded over the ep ranks, at the price of two all-to-alls per
// layer and direction. Guide: docs/expert-parallel.md.
#include <algorithm>
#include <cmath>

#include "expert_parallel.cuh"
#include "kernels/router.cuh"
#include "mixed_precision.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"

// ----------------------------------------------------------------------------
// Flags and the experts' placement

void add_expert_flags(CLI::App& app, ExpertOptions& o, RunOptions& run) {
  CLI::App& g = flag_group(app, "Mixture of experts and expert parallelism (Playbook §9)");
  add_shape_flag(g, run, "--experts", &ModelConfig::experts,
                 "a mixture of experts in every block: experts per MLP, >= 0, each a SwiGLU of "
                 "--ffn (0: the dense MLP; default: the --model's)");
  add_shape_flag(g, run, "--top-k", &ModelConfig::top_k,
                 "experts per token, 1 to --experts (default: the --model's)");
  g.add_option("--aux-loss-coef", run.model.aux_loss_coef,
               "weight of the load-balancing loss, >= 0 (default 0.001, Mixtral's; a loaded "
               "config.json's router_aux_loss_coef)");
  g.add_option("--ep", o.ep,
               "expert-parallel ranks, >= 1, dividing --dp and --experts: each holds --experts / "
               "--ep experts")
      ->capture_default_str();
  g.add_option("--capacity-factor", o.capacity_factor,
               "cap each expert at c x tokens x top-k / experts per micro-batch, c >= 0, and "
               "drop the rest (0: dropless)")
      ->capture_default_str();
}

void validate_expert_parallel(const ModelConfig& c, const ExpertOptions& o, int dp, int cp) {
  check_positive(o.ep, "--ep");
  check_range(o.capacity_factor, "--capacity-factor", 0, false, kNoMax,
              "must be 0 (dropless) or a number > 0, e.g. 1.25");
  auto s = [](int v) { return std::to_string(v); };
  if (c.experts == 0 && (o.ep > 1 || o.capacity_factor > 0))
    throw UsageError(std::string(o.ep > 1 ? "--ep " + s(o.ep) : "--capacity-factor") +
                     " needs a mixture of experts: add --experts E (and --top-k k), or use "
                     "--model tiny-moe");
  if (dp % o.ep)
    throw UsageError("--ep " + s(o.ep) + " does not divide --dp " + s(dp) +
                     ": the expert-parallel groups are carved out of the data-parallel ranks; "
                     "pick an --ep that divides --dp");
  if (c.experts % o.ep)
    throw UsageError("--ep " + s(o.ep) + " does not divide the " + s(c.experts) +
                     " experts: each ep rank holds experts / ep of them");
  if (o.capacity_factor > 0 && cp > 1)
    throw UsageError("--capacity-factor with --cp " + s(cp) +
                     ": a capacity counts the whole "
                     "micro-batch's tokens, which cp splits over its ranks; use one or the other");
}

std::string describe_experts(const ModelConfig& c, const ExpertOptions& o) {
  if (c.experts == 0) return "";
  auto s = [](auto v) { return std::to_string(v); };
  return s(c.experts) + " experts of ffn " + s(c.ffn) + ", top " + s(c.top_k) + ", ep " + s(o.ep) +
         " (" + s(c.experts / o.ep) + " per rank), " +
         (o.capacity_factor > 0 ? "capacity factor " + num(o.capacity_factor)
                                : std::string("dropless")) +
         ", aux loss coef " + num(c.aux_loss_coef);
}

EvaluationShare evaluation_share(const Comm& comm) {
  return {comm.dp.rank / comm.ep.size, comm.dp.size / comm.ep.size, comm.ep.rank == 0};
}

ExpertRange local_experts(int experts, int rank, int size) {
  int per = experts / size;
  return {rank * per, per};
}

// ----------------------------------------------------------------------------
// Routing (host)

Routing route_tokens(const std::vector<float>& logits, int N, int E, int k, int64_t capacity) {
  PICO_ASSERT((int64_t)logits.size() == (int64_t)N * E && k >= 1 && k <= E, "route_tokens");
  Routing r;
  r.tokens = N, r.experts = E, r.k = k;
  r.probs.resize((size_t)N * E), r.choice.resize((size_t)N * k), r.weight.resize((size_t)N * k);
  r.kept.assign((size_t)N * k, 1), r.routed.assign(E, 0), r.rows_per_expert.assign(E, 0);
  std::vector<double> ez(E);  // exp(z - max), each taken once
  for (int t = 0; t < N; t++) {
    const float* z = &logits[(size_t)t * E];
    float* p = &r.probs[(size_t)t * E];
    double mx = *std::max_element(z, z + E), sum = 0;
    for (int e = 0; e < E; e++) sum += ez[e] = std::exp((double)z[e] - mx);
    for (int e = 0; e < E; e++) p[e] = (float)(ez[e] / sum);
    // The k largest, best first; a tie goes to the lower expert index.
    int32_t* chosen = &r.choice[(size_t)t * k];
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int e = 0; e < E; e++) {
        if (std::find(chosen, chosen + j, e) != chosen + j) continue;
        if (best < 0 || p[e] > p[best]) best = e;
      }
      chosen[j] = best;
      r.routed[best]++;
    }
    double picked = 0;
    for (int j = 0; j < k; j++) picked += p[chosen[j]];
    for (int j = 0; j < k; j++) r.weight[(size_t)t * k + j] = (float)(p[chosen[j]] / picked);
  }
  // The capacity: first choices of every token before second choices, tokens in order.
  if (capacity >= 0) {
    std::vector<int64_t> taken(E, 0);
    for (int j = 0; j < k; j++)
      for (int t = 0; t < N; t++) {
        size_t i = (size_t)t * k + j;
        if (taken[r.choice[i]] < capacity)
          taken[r.choice[i]]++;
        else
          r.kept[i] = 0, r.dropped++;
      }
  }
  // Dispatch order: by expert, then token.
  std::vector<std::vector<std::pair<int32_t, int32_t>>> rows(E);
  for (int t = 0; t < N; t++)
    for (int j = 0; j < k; j++)
      if (r.kept[(size_t)t * k + j]) rows[r.choice[(size_t)t * k + j]].push_back({t, j});
  for (int e = 0; e < E; e++) {
    r.rows_per_expert[e] = (int64_t)rows[e].size();
    for (auto [t, j] : rows[e])
      r.row_token.push_back(t), r.row_slot.push_back(j), r.row_expert.push_back(e);
  }
  return r;
}

int64_t expert_capacity(double factor, int64_t tokens, int experts, int k) {
  return (int64_t)std::ceil(factor * (double)tokens * k / experts);
}

// w_j = p_j / P over the chosen set S (P = sum of its p): dp_m = (dw_m - sum_j dw_j w_j) / P for
// m in S, 0 elsewhere; the softmax then gives dz_e = p_e (dp_e - sum_m dp_m p_m).
std::vector<float> route_backward(const Routing& r, const std::vector<float>& d_weight,
                                  const std::vector<float>& d_prob) {
  const int N = r.tokens, E = r.experts, k = r.k;
  std::vector<float> dz((size_t)N * E);
  for (int t = 0; t < N; t++)  // kernels/router.cuh: the arithmetic, shared with the GPU
    route_backward_token(&dz[(size_t)t * E], &r.probs[(size_t)t * E], &r.choice[(size_t)t * k],
                         &r.weight[(size_t)t * k], &d_weight[(size_t)t * k], nullptr,
                         d_prob.empty() ? nullptr : d_prob.data(), E, k);
  return dz;
}

double load_balancing_loss(const std::vector<double>& counts, const std::vector<double>& sums,
                           double rows) {
  double loss = 0;
  for (size_t e = 0; e < counts.size(); e++) loss += counts[e] / rows * (sums[e] / rows);
  return loss * (double)counts.size();
}

// ----------------------------------------------------------------------------
// Dispatch

Dispatch make_dispatch(const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                       int peers) {
  Dispatch d;
  d.peers = peers, d.local = (int)send.size() / peers;
  const int L = d.local;
  PICO_ASSERT((int)recv.size() == peers * L, "make_dispatch: counts");
  d.send_peer.assign(peers, 0), d.recv_peer.assign(peers, 0), d.expert_rows.assign(L, 0);
  std::vector<int64_t> start(peers * L);  // where (source s, expert j) begins, source-major
  int64_t at = 0;
  for (int s = 0; s < peers; s++)
    for (int j = 0; j < L; j++) {
      d.send_peer[s] += send[s * L + j];
      d.recv_peer[s] += recv[s * L + j];
      d.expert_rows[j] += recv[s * L + j];
      start[s * L + j] = at, at += recv[s * L + j];
    }
  for (int j = 0; j < L; j++)
    for (int s = 0; s < peers; s++)
      for (int64_t i = 0; i < recv[s * L + j]; i++)
        d.by_expert.push_back((int32_t)(start[s * L + j] + i));
  d.by_source.resize(d.by_expert.size());
  for (size_t i = 0; i < d.by_expert.size(); i++) d.by_source[d.by_expert[i]] = (int32_t)i;
  return d;
}

// ----------------------------------------------------------------------------
// The layer

// The whole micro-batch [N, D] inside the tensor-parallel region: x itself, or all-gathered
// under SP (the backward gathers it again rather than keeping it, as column-parallel layers do).
static Tensor region_input(const TensorParallel& tp, const Context& ctx, const Tensor& x) {
  if (!tp.sp) return x;
  Tensor full = empty_rows(ctx, x.size(0) * tp.size(), x.size(1));
  tp_region_enter_forward(tp, ctx, x, full);
  return full;
}
// Rows as they travel: [rows, D] in the compute format (bf16 under --dtype bf16: half the bytes
// of fp32), in which every row that crosses is read next (the experts' GEMMs, the combine) or
// was made (the experts' outputs and input gradients, rounded as the GEMMs wrote them).
static Tensor rows_to_send(const Context& ctx, int64_t rows, int64_t D,
                           Mem category = Mem::Workspace) {
  return empty_in_compute_format(ctx, {rows, D}, category);
}
// Rows to the ep peers and back: `send` [sum send_rows, D] peer by peer -> `recv`.
static void all_to_all_rows(const ExpertParallel& ep, const Context& ctx, const Tensor& send,
                            const std::vector<int64_t>& send_rows, const Tensor& recv,
                            const std::vector<int64_t>& recv_rows) {
  PICO_ASSERT(send.dtype == recv.dtype, "all_to_all_rows: rows leave and arrive in one format");
  if (ep.size() == 1) return copy_(ctx, recv, send);
  const int64_t D = send.size(1);
  std::vector<int64_t> s(send_rows), r(recv_rows);
  for (int64_t& n : s) n *= D;
  for (int64_t& n : r) n *= D;
  all_to_all_v(*ep.comm, ep.comm->ep, ctx, send.ptr, s, recv.ptr, r, send.dtype);
}
// Each row's combine weight [K] (the renormalised probability of its token's slot).
static std::vector<float> row_weights(const Routing& r) {
  std::vector<float> w(r.row_token.size());
  for (size_t i = 0; i < w.size(); i++)
    w[i] = r.weight[(size_t)r.row_token[i] * r.k + r.row_slot[i]];
  return w;
}
static int cp_size(const ExpertParallel& ep) {
  return ep.comm ? ep.comm->cp.size : 1;
}
static bool counts_here(const ExpertParallel& ep, const TensorParallel& tp) {
  return tp.rank() == 0 && (!ep.comm || ep.comm->cp.rank == 0);
}

// This micro-batch's counts and probability sums for layer `layer`, over the whole sequence.
static void record(const ExpertParallel& ep, const TensorParallel& tp, const ModelConfig& c,
                   const Routing& r, const Dispatch& d, int layer, std::vector<float>& carry) {
  const int E = c.experts;
  std::vector<double> stats(2 * E, 0.0);
  for (int e = 0; e < E; e++) stats[e] = (double)r.routed[e];
  for (int t = 0; t < r.tokens; t++)
    for (int e = 0; e < E; e++) stats[E + e] += r.probs[(size_t)t * E + e];
  if (cp_size(ep) > 1) all_reduce_host(ep.comm->cp, stats.data(), 2 * E, ReduceOp::Sum);
  for (int i = 0; i < 2 * E; i++) carry[i] += (float)stats[i];
  ExpertStats* s = ep.stats;
  if (!s) return;
  s->rows_elsewhere += (int64_t)r.row_token.size() - d.send_peer[ep.rank()];
  s->rows_arrived += (int64_t)d.by_expert.size() - d.recv_peer[ep.rank()];
  if (!counts_here(ep, tp)) return;
  if ((int)s->routed.size() < c.layers) {
    s->routed.assign(c.layers, std::vector<int64_t>(E, 0));
    s->dropped.assign(c.layers, 0), s->layer_aux.assign(c.layers, 0);
    s->layer_batches.assign(c.layers, 0);
  }
  for (int e = 0; e < E; e++) s->routed[layer][e] += r.routed[e];
  s->dropped[layer] += r.dropped;
  std::vector<double> counts(stats.begin(), stats.begin() + E),
      sums(stats.begin() + E, stats.end());
  s->layer_aux[layer] += load_balancing_loss(counts, sums, (double)r.tokens * cp_size(ep));
  s->layer_batches[layer]++;
}

// The router's logits [N, E] on the host, where the routing is decided. The meta device holds
// no values: it routes uniformly instead, token t to experts t k, t k + 1, ... (mod E), in that
// order, so that every expert receives N k / E rows as the uniform routing of the book's
// formulas assumes (moe_expected_a2a_bytes, moe_activation_bytes).
static std::vector<float> router_logits_on_host(const Context& ctx, const Tensor& logits, int k) {
  std::vector<float> host = to_host_floats(logits);
  if (ctx.device != Device::Meta) return host;
  const int64_t N = logits.size(0), E = logits.size(1);
  for (int64_t t = 0; t < N; t++)
    for (int64_t e = 0; e < E; e++) host[t * E + e] = -(float)((e - t * k % E + E) % E);
  return host;
}

void moe_forward(const ExpertParallel& ep, const TensorParallel& tp, const ModelConfig& c,
                 const Context& ctx, const MoeWeights& w, MoeActivations& a, const Tensor& x,
                 const Tensor& out, int layer, std::vector<float>* carry) {
  const int E = c.experts, k = c.top_k;
  const int64_t D = c.d_model, N = x.size(0) * (tp.sp ? tp.size() : 1);
  // Route: every tp rank holds the whole micro-batch here, and routes it the same way.
  Tensor h = region_input(tp, ctx, x);  // [N, D]
  Tensor logits = empty_rows(ctx, N, E);
  linear_forward(ctx, logits, h, w.router);
  int64_t capacity = ep.capacity_factor > 0 ? expert_capacity(ep.capacity_factor, N, E, k) : -1;
  auto routing = std::make_shared<Routing>(
      route_tokens(router_logits_on_host(ctx, logits, k), (int)N, E, k, capacity));
  const Routing& r = *routing;
  // Dispatch: how many rows each rank's experts receive from each rank, then the rows.
  std::vector<int64_t> recv =
      ep.size() > 1 ? exchange_counts(*ep.comm, ep.comm->ep, r.rows_per_expert) : r.rows_per_expert;
  auto dispatch = std::make_shared<Dispatch>(make_dispatch(r.rows_per_expert, recv, ep.size()));
  const Dispatch& d = *dispatch;
  const int64_t K = (int64_t)r.row_token.size(), R = (int64_t)d.by_expert.size();
  Tensor row_ids = device_ints(ctx, r.row_token);
  Tensor leaving = rows_to_send(ctx, K, D), arrived = rows_to_send(ctx, R, D);
  embedding_forward(ctx, leaving, row_ids, h);  // row r: token row_token[r]'s hidden state
  all_to_all_rows(ep, ctx, leaving, d.send_peer, arrived, d.recv_peer);
  // Inputs, gate, up, SwiGLU output in the compute format, as the dense MLP's: no casts between.
  a.xe = empty_in_compute_format(ctx, {R, D}, Mem::Activations);
  embedding_forward(ctx, a.xe, device_ints(ctx, d.by_expert), arrived);  // expert by expert
  // Compute: each local expert's SwiGLU on its rows.
  const int64_t F = w.experts.empty() ? 0 : w.experts[0].w1.size(0);
  a.gate = empty_in_compute_format(ctx, {R, F}, Mem::Activations);
  a.up = empty_in_compute_format(ctx, {R, F}, Mem::Activations);
  a.act = empty_in_compute_format(ctx, {R, F}, Mem::Activations);
  Tensor y = rows_to_send(ctx, R, D);
  for (int64_t j = 0, at = 0; j < (int64_t)w.experts.size(); at += d.expert_rows[j++]) {
    const int64_t n = d.expert_rows[j];
    if (n == 0) continue;
    linear_forward(ctx, a.gate.view(at * F, {n, F}), a.xe.view(at * D, {n, D}), w.experts[j].w1);
    linear_forward(ctx, a.up.view(at * F, {n, F}), a.xe.view(at * D, {n, D}), w.experts[j].w3);
  }
  swiglu_forward(ctx, a.act, a.gate, a.up);
  for (int64_t j = 0, at = 0; j < (int64_t)w.experts.size(); at += d.expert_rows[j++])
    if (d.expert_rows[j] > 0)
      linear_forward(ctx, y.view(at * D, {d.expert_rows[j], D}),
                     a.act.view(at * F, {d.expert_rows[j], F}), w.experts[j].w2);
  // Combine: the outputs back where their tokens are, times their weights, summed per token.
  Tensor returning = rows_to_send(ctx, R, D);
  embedding_forward(ctx, returning, device_ints(ctx, d.by_source), y);  // source by source
  a.out = rows_to_send(ctx, K, D, Mem::Activations);
  all_to_all_rows(ep, ctx, returning, d.recv_peer, a.out, d.send_peer);
  Tensor weighted = empty_rows(ctx, K, D);
  scale_rows(ctx, weighted, a.out, device_floats(ctx, row_weights(r), {K}));
  Tensor partial = tp.sp ? empty_rows(ctx, N, D) : out;  // [N, D], partial sums over tp
  zero_(ctx, partial);
  embedding_backward(ctx, partial, row_ids, weighted);  // each token's rows, in expert order
  tp_region_exit_forward(tp, ctx, partial, out);
  a.routing = routing, a.dispatch = dispatch;
  if (carry) record(ep, tp, c, r, d, layer, *carry);
}

void moe_backward(const ExpertParallel& ep, const TensorParallel& tp, const ModelConfig& c,
                  const Context& ctx, const MoeWeights& w, const MoeWeights& g, MoeActivations& a,
                  const Tensor& x, const Tensor& dout, const Tensor& dx,
                  const std::vector<float>& totals, float loss_scale, DeferredGrads* deferred) {
  const Routing& r = *a.routing;
  const Dispatch& d = *a.dispatch;
  const int E = c.experts, k = c.top_k;
  const int64_t D = c.d_model, N = r.tokens, K = (int64_t)r.row_token.size(), R = a.xe.size(0);
  const int64_t F = a.gate.size(1);
  Tensor h = region_input(tp, ctx, x);               // [N, D]
  Tensor dy = tp.sp ? empty_rows(ctx, N, D) : dout;  // [N, D], whole on every tp rank
  tp_region_exit_backward(tp, ctx, dout, dy);
  Tensor row_ids = device_ints(ctx, r.row_token);
  // Each row's weight: d w = <dy[token], out>, its partial sums added over tp.
  Tensor dy_rows = empty_rows(ctx, K, D), d_weight = empty_rows(ctx, K, 1).view(0, {K});
  embedding_forward(ctx, dy_rows, row_ids, dy);
  row_dots(ctx, d_weight, dy_rows, a.out);
  if (tp.size() > 1 && K > 0)
    all_reduce(*tp.comm, tp.group(), ctx, d_weight.f32(), K, ReduceOp::Sum);
  // The experts' outputs: d out = weight x dy[token], to the experts, expert by expert.
  scale_rows(ctx, dy_rows, dy_rows, device_floats(ctx, row_weights(r), {K}));
  // Rounded once before they leave, as the input's and the weights' GEMMs read them.
  Tensor leaving = gradient_operand(ctx, dy_rows);
  Tensor arrived = rows_to_send(ctx, R, D), d_y = rows_to_send(ctx, R, D);
  all_to_all_rows(ep, ctx, leaving, d.send_peer, arrived, d.recv_peer);
  embedding_forward(ctx, d_y, device_ints(ctx, d.by_expert), arrived);
  // Each expert's SwiGLU backward. Under a zero-bubble schedule (`deferred`) only the input
  // gradients now: the experts' and the router's weight gradients wait for the W op, as the
  // dense layers' do (Playbook §8.6).
  const bool apart = deferred != nullptr;
  auto now = [&](const Tensor& dW) { return apart ? Tensor() : dW; };
  // Their gradients in the compute format too, as the dense MLP's (SwiGLU and GEMMs read them).
  auto ffn_grad = [&] { return empty_in_compute_format(ctx, {R, F}, Mem::Workspace); };
  Tensor d_act = ffn_grad(), d_gate = ffn_grad(), d_up = ffn_grad();
  Tensor d_xe = rows_to_send(ctx, R, D);
  for (int64_t j = 0, at = 0; j < (int64_t)w.experts.size(); at += d.expert_rows[j++])
    if (d.expert_rows[j] > 0)
      linear_backward(ctx, d_act.view(at * F, {d.expert_rows[j], F}), now(g.experts[j].w2),
                      d_y.view(at * D, {d.expert_rows[j], D}),
                      a.act.view(at * F, {d.expert_rows[j], F}), w.experts[j].w2);
  swiglu_backward(ctx, d_gate, d_up, d_act, a.gate, a.up);
  for (int64_t j = 0, at = 0; j < (int64_t)w.experts.size(); at += d.expert_rows[j++]) {
    const int64_t n = d.expert_rows[j];
    if (n == 0) continue;
    Tensor xe = a.xe.view(at * D, {n, D}), dxe = d_xe.view(at * D, {n, D});
    linear_backward(ctx, dxe, now(g.experts[j].w1), d_gate.view(at * F, {n, F}), xe,
                    w.experts[j].w1);
    linear_backward(ctx, dxe, now(g.experts[j].w3), d_up.view(at * F, {n, F}), xe, w.experts[j].w3,
                    true);
  }
  // Back to the tokens' ranks, and into each token's gradient (partial over tp).
  Tensor returning = rows_to_send(ctx, R, D), d_rows = rows_to_send(ctx, K, D);
  embedding_forward(ctx, returning, device_ints(ctx, d.by_source), d_xe);
  all_to_all_rows(ep, ctx, returning, d.recv_peer, d_rows, d.send_peer);
  Tensor dh = zeros(ctx, {N, D}, Mem::Workspace);
  embedding_backward(ctx, dh, row_ids, d_rows);
  // The router: the weights' gradient through top-k's renormalisation and the softmax, plus
  // the load-balancing loss's: coef x loss_scale x tokens x E C_e / rows^2 per probability
  // (C_e over every layer of the micro-batch, rows = layers x tokens). On the device, from the
  // routing uploaded (kernels/router.cuh): nothing comes back to the host.
  std::vector<float> floats(r.probs), d_prob;
  floats.insert(floats.end(), r.weight.begin(), r.weight.end());
  if (c.aux_loss_coef > 0 && !totals.empty()) {
    const double tokens = (double)N * cp_size(ep), rows = tokens * c.layers;
    for (int e = 0; e < E; e++)
      d_prob.push_back(
          (float)(c.aux_loss_coef * (double)loss_scale * tokens * E * totals[e] / (rows * rows)));
  }
  floats.insert(floats.end(), d_prob.begin(), d_prob.end());
  std::vector<int32_t> ints(r.choice);  // then each (token, slot)'s dispatch row, -1 dropped
  ints.resize(2 * (size_t)N * k, -1);
  for (int64_t i = 0; i < K; i++) ints[(size_t)(N + r.row_token[i]) * k + r.row_slot[i]] = (int)i;
  Tensor values = device_floats(ctx, floats, {(int64_t)floats.size()});
  Tensor ids = device_ints(ctx, ints), d_logits = empty_rows(ctx, N, E);
  route_backward_on(ctx, d_logits, values.view(0, {N, E}), ids.view(0, {N, k}),
                    values.view(N * E, {N, k}), ids.view(N * k, {N, k}), d_weight,
                    values.view(N * (E + k), {(int64_t)d_prob.size()}));
  d_logits = gradient_operand(ctx, d_logits);
  // Every tp rank holds the same router and the same logits' gradient: the input's share is
  // added once (the region's backward sums dh over tp).
  linear_backward(ctx, tp.rank() == 0 ? dh : Tensor(), now(g.router), d_logits, h, w.router, true);
  tp_region_enter_backward(tp, ctx, dh, dx);
  if (apart)  // dW += dy^T x for each expert's w2, w1, w3 on its rows, and the router's
    weight_half(deferred, "experts' dW",
                [&ctx, w, g, rows = d.expert_rows, xe = a.xe, act = a.act, d_y, d_gate, d_up, h,
                 d_logits, F, D] {
                  for (int64_t j = 0, at = 0; j < (int64_t)w.experts.size(); at += rows[j++]) {
                    const int64_t n = rows[j];
                    if (n == 0) continue;
                    linear_backward(ctx, Tensor(), g.experts[j].w2, d_y.view(at * D, {n, D}),
                                    act.view(at * F, {n, F}), w.experts[j].w2);
                    linear_backward(ctx, Tensor(), g.experts[j].w1, d_gate.view(at * F, {n, F}),
                                    xe.view(at * D, {n, D}), w.experts[j].w1);
                    linear_backward(ctx, Tensor(), g.experts[j].w3, d_up.view(at * F, {n, F}),
                                    xe.view(at * D, {n, D}), w.experts[j].w3);
                  }
                  linear_backward(ctx, Tensor(), g.router, d_logits, h, w.router);
                });
  a = MoeActivations{};
}

double moe_finish_micro_batch(const ExpertParallel& ep, const ModelConfig& c,
                              const std::vector<float>& totals, int64_t tokens) {
  const int E = c.experts;
  std::vector<double> counts(totals.begin(), totals.begin() + E),
      sums(totals.begin() + E, totals.begin() + 2 * E);
  double loss = load_balancing_loss(counts, sums, (double)tokens * cp_size(ep) * c.layers);
  if (ep.stats && (!ep.comm || (ep.comm->tp.rank == 0 && ep.comm->cp.rank == 0)))
    ep.stats->aux_sum += loss, ep.stats->batches++;
  return loss;
}
