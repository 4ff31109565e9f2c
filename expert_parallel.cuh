// expert_parallel.cuh: a Mixtral-style mixture of experts in each block's MLP, and expert
// parallelism (Playbook, "Expert parallelism"). A router sends each token to k of E expert
// MLPs; the experts are split over the ep ranks, a group carved out of the data-parallel ranks,
// and each token's hidden state travels to its experts' ranks and back by all-to-all.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/model_config.cuh"
#include "runtime/report.cuh"
#include "tensor_parallel.cuh"

// ---- Flags (Playbook, expert parallelism) ----
namespace CLI {
class App;
}
struct ExpertOptions {
  int ep = 1;                    // --ep: expert-parallel ranks (dividing --dp and --experts)
  double capacity_factor = 0.0;  // --capacity-factor: 0 is dropless
};
struct RunOptions;
// --ep, --capacity-factor, and the model's --experts, --top-k, --aux-loss-coef (in `run`'s config).
void add_expert_flags(CLI::App& app, ExpertOptions& o, RunOptions& run);
// Throws UsageError naming the flag: --ep that does not divide --dp or the experts, --ep or a
// capacity without experts, a capacity with --cp (capacity counts a whole micro-batch's tokens).
void validate_expert_parallel(const ModelConfig& cfg, const ExpertOptions& o, int dp, int cp);
// The configuration table's row: experts, top k, ep, the capacity; empty for a dense model.
std::string describe_experts(const ModelConfig& cfg, const ExpertOptions& o);

// The ep group (size 1: every expert on every rank, no all-to-all), the capacity, and where
// training steps record what was routed (null: not recorded, e.g. validation).
struct ExpertParallel {
  Comm* comm = nullptr;
  double capacity_factor = 0.0;  // 0: dropless
  ExpertStats* stats = nullptr;
  int size() const { return comm ? comm->ep.size : 1; }
  int rank() const { return comm ? comm->ep.rank : 0; }
};
// Which share of an evaluation's windows a rank runs: the dp ranks split them, except that the
// ranks of one ep group hold different experts and dispatch to each other, so they run the same
// windows (`count` = dp / ep shares), and only the first one's sums count.
struct EvaluationShare {
  int index = 0, count = 1;
  bool counts = true;
};
EvaluationShare evaluation_share(const Comm& comm);
// The experts [first, first + count) of E that ep rank `rank` of `size` holds.
struct ExpertRange {
  int first = 0, count = 0;
};
ExpertRange local_experts(int experts, int rank, int size);

// ---- Routing (host, fp32, as Mixtral's router) ----
// probs = softmax(logits) per token; its k largest, best first (equal probabilities: the lower
// expert index first); their weights, the k probabilities over their sum. With a capacity
// (>= 0) each expert keeps its first `capacity` (token, slot) pairs, every token's first choice
// before any second choice, tokens in order; the others are dropped (the token keeps its
// residual, without that expert's share).
struct Routing {
  int tokens = 0, experts = 0, k = 0;
  std::vector<float> probs;     // [N, E]
  std::vector<int32_t> choice;  // [N, k]
  std::vector<float> weight;    // [N, k]
  std::vector<uint8_t> kept;    // [N, k] 0: dropped
  std::vector<int64_t> routed;  // [E] pairs that chose each expert, dropped ones included
  int64_t dropped = 0;
  // The kept pairs in dispatch order, sorted by (expert, token): row r carries token
  // row_token[r] to expert row_expert[r] for its slot row_slot[r].
  std::vector<int32_t> row_token, row_slot, row_expert;
  std::vector<int64_t> rows_per_expert;  // [E] kept rows
};
Routing route_tokens(const std::vector<float>& logits, int tokens, int experts, int k,
                     int64_t capacity = -1);
// c x tokens x k / E, rounded up: the capacity of each expert for one micro-batch.
int64_t expert_capacity(double factor, int64_t tokens, int experts, int k);
// d logits [N, E] from d weight [N, k] (the gradient of each kept slot's weight; 0 for dropped
// ones) through the renormalisation and the softmax, with `d_prob` [E] (the load-balancing
// loss's gradient per probability, the same for every token) added to every token's.
std::vector<float> route_backward(const Routing& r, const std::vector<float>& d_weight,
                                  const std::vector<float>& d_prob);
// The load-balancing loss (Switch Transformer; transformers' load_balancing_loss_func, which
// concatenates every layer's tokens): with C_e the pairs routed to expert e and S_e the sum of
// its probabilities over `rows` (layers x tokens) rows, E sum_e (C_e / rows) (S_e / rows).
double load_balancing_loss(const std::vector<double>& counts, const std::vector<double>& prob_sums,
                           double rows);

// ---- Dispatch: where each row goes and in what order the experts read them ----
// Rows leave sorted by expert, so rank p's block of E/ep experts is one contiguous segment per
// destination. `send` [E]: rows for each expert; `recv` [ep x E/ep]: rows from each source
// rank for each of this rank's experts (exchanged). The experts read their rows expert by
// expert (expert-major); the all-to-all delivers them source by source (source-major).
struct Dispatch {
  int peers = 1, local = 1;
  std::vector<int64_t> send_peer, recv_peer;  // [ep] rows to and from each rank
  std::vector<int64_t> expert_rows;           // [E/ep] rows each local expert computes
  std::vector<int32_t> by_expert;  // [R] expert-major row i is source-major row by_expert[i]
  std::vector<int32_t> by_source;  // [R] the inverse
};
Dispatch make_dispatch(const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                       int peers);

// ---- The layer (Playbook, expert parallelism: route, dispatch, compute, combine) ----
// This rank's part of one block's mixture: the router [E, D] (every rank holds it) and its
// experts, each a SwiGLU MLP of Mixtral's names: w1 (gate) and w3 (up) [F/tp, D], w2 (down)
// [D, F/tp] (experts are split over tp as the dense MLP is).
struct ExpertWeights {
  Tensor w1, w2, w3;
};
struct MoeWeights {
  Tensor router;
  std::vector<ExpertWeights> experts;
};
// What one micro-batch's forward keeps for its backward.
struct MoeActivations {
  std::shared_ptr<const Routing> routing;
  std::shared_ptr<const Dispatch> dispatch;
  Tensor xe;             // [R, D] the rows this rank's experts received, expert-major
  Tensor gate, up, act;  // [R, F/tp]
  Tensor out;            // [K, D] the experts' outputs back at their tokens, dispatch order
                         // (partial sums over tp)
};
// out [n, D] (=) the mixture applied to x [n, D] (the post-attention norm's output; n = N/tp
// under SP): enter the tensor-parallel region, route, dispatch by all-to-all, the local
// experts, all-to-all back, combine with the weights, leave the region. With `carry` (a
// forward, not a recomputation): this micro-batch's counts C_e and probability sums S_e over
// the whole sequence (summed over cp) added into carry [2E], and what was routed recorded in
// ep.stats as layer `layer`.
void moe_forward(const ExpertParallel& ep, const TensorParallel& tp, const ModelConfig& cfg,
                 const Context& ctx, const MoeWeights& w, MoeActivations& a, const Tensor& x,
                 const Tensor& out, int layer, std::vector<float>* carry);
// dx [n, D] (=) and the weights' gradients (+=; or, the experts' and the router's, queued on
// `deferred` for a zero-bubble W op) from dout [n, D]. `totals` [2E]: the micro-batch's C_e and
// S_e over every layer, for the load-balancing loss's gradient, which enters with weight
// aux_loss_coef x loss_scale x (the micro-batch's tokens).
void moe_backward(const ExpertParallel& ep, const TensorParallel& tp, const ModelConfig& cfg,
                  const Context& ctx, const MoeWeights& w, const MoeWeights& g, MoeActivations& a,
                  const Tensor& x, const Tensor& dout, const Tensor& dx,
                  const std::vector<float>& totals, float loss_scale,
                  DeferredGrads* deferred = nullptr);
// Once the last layer has run on a micro-batch (its totals complete): its load-balancing loss,
// recorded in ep.stats. Returns it.
double moe_finish_micro_batch(const ExpertParallel& ep, const ModelConfig& cfg,
                              const std::vector<float>& totals, int64_t tokens);

// ---- Measurements: the closed forms the reports compare with (runtime/formulas.cuh's
// moe_activation_bytes and moe_expected_a2a_bytes) ----
