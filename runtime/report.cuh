// report.cuh: what a run measured, next to what the book predicts (--report memory,comm).
// Every report takes numbers: what the run measured, and what the technique or the book's
// formula (runtime/formulas.cuh, or the technique's own) predicts.
#pragma once
#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/formulas.cuh"
#include "runtime/meters.cuh"
#include "runtime/model_config.cuh"
#include "runtime/observe.cuh"

// This rank's peak and current bytes per memory category, and its static bytes per parameter
// next to the book's (Playbook §2.4: 16 in fp32, 18 or 16 in mixed precision; §4.1 under ZeRO
// over `ranks` ranks).
void print_memory(int64_t num_params, int zero_stage, int ranks,
                  Precision precision = Precision::FP32, bool bf16_grads = false);
// --report memory, under --dtype: this rank's static bytes per parameter by role (weights the
// GEMMs read, gradients, fp32 master weights, Adam's m and v), measured, next to the book's
// mixed-precision table (Playbook §Mixed precision training: 2 + 2 + 4 + 4 + 4 = 16 bytes, 20
// with fp32 gradient accumulation) and fp32's 4 + 4 + 8. Rank 0 prints.
// master_bytes: the fp32 master weights' bytes when a compute copy is kept (else 0);
// bf16_grads: the gradient buffers are bf16 (--grad-acc-dtype bf16).
void print_precision_memory(Precision p, int64_t num_params, int64_t master_bytes,
                            bool bf16_grads = false);
// --report memory: every rank's params, grads and optimizer bytes (gathered to rank 0) next to
// the book's formula for this ZeRO stage, with the padding of the shards named (padded_params:
// Psi', the parameters plus padding; equal to num_params without ZeRO). Collective.
// bf16_grads: --grad-acc-dtype bf16. Under mixed precision the formula counts 2 bytes per weight
// and 12 per parameter for the optimizer (master weights included), as the book's.
void print_memory_report(Comm& comm, int zero_stage, int64_t num_params, int64_t padded_params,
                         Precision precision = Precision::FP32, bool bf16_grads = false);
// Per group and collective, per step: calls and elements counted on rank 0, and the bytes each
// rank was charged by formula (rank 0, and the range over every rank), next to the ring
// formulas for the gradient sync of num_params fp32 values (Playbook appendix A0); of them,
// expert_params (a mixture's experts) are summed over edp_cp instead of dp_cp.
// Collective: every rank calls it; rank 0 prints.
void print_comm_report(Comm& comm, int64_t num_params, int64_t steps, int64_t expert_params = 0);
// ZeRO's reduce-scatters and all-gathers per training step (validation and checkpoint gathers
// excluded), next to the book's 2Ψ(N-1)/N (stages 1-2) or 3Ψ(N-1)/N (stage 3). Rank 0 prints.
struct ZeroCommReport {
  int stage = 1, ranks = 1, grad_acc = 1;
  int64_t steps = 0;                               // training steps measured
  ZeroTraffic measured;                            // over those steps
  ZeroTraffic expected;                            // per step (zero_expected_traffic)
  int64_t psi = 0, padded = 0;                     // parameters, and with the shards' padding (Ψ')
  DType grads = DType::F32, weights = DType::F32;  // reduce-scattered, all-gathered
  bool tied = false;                               // a tied head gathers the embedding again
};
void print_zero_comm_report(const Comm& comm, const ZeroCommReport& r);

// One block's saved activations for this run's micro-batch, measured, next to the formula
// (model.cu's activation_bytes_per_block); `run` describes the layout ("tp 2 + sp, recompute
// none, flash attention"), `terms` the formula's terms as the model writes them (below).
// e: bytes per element of what is stored in the compute format (4, or 2 under --dtype); er: of
// the residual stream (4, or 2 under --residual-dtype).
// routed: a mixture of experts, whose kept rows are what the routing sent to this rank's
// experts; the formula counts N k rows, so a rank's own differs unless the routing is balanced.
// The formula's terms as the model writes them (model.cu): bytes per token outside the tp region
// ("8D + 8") and inside it without attention ("4D + 4 Hkv hd + 6F"), attention's ("2 Hq T"),
// and which block it is for ("this Llama").
struct ActivationTerms {
  std::string outside, inside, attention, block;
  bool dropout = false;  // attention also keeps dropout's mask and what it left
};
void print_activation_report(int64_t measured, int64_t formula, const std::string& run,
                             const ActivationTerms& terms, bool sp, int e, int er,
                             bool routed = false);
// Tensor parallelism (Playbook §5, §6): what the tp group sent per training step (measured over
// the training steps only; `measured` totals over `steps`), next to the count of all-reduces,
// or all-gathers and reduce-scatters under SP, that the model issues per micro-batch.
void print_tp_comm_report(const TpTraffic& expected, int grad_acc, int tp, bool sp,
                          const CollStats* measured, int64_t steps);

// Pipeline parallelism (Playbook §8): per stage, the measured busy and idle time of the
// schedule over the training steps, the idle share of the same tables run on paper (ticks,
// t_b = 2 t_f), the book's formula, and the micro-batches in flight measured from the
// activation memory next to the schedule's. Collective: every rank calls it; rank 0 prints.
struct BubblePrediction {
  std::string schedule;
  int p = 1, m = 1, V = 1;
  std::vector<double> busy_ticks;  // per stage, on paper
  double makespan_ticks = 0;
  std::vector<int> peak_in_flight;  // per stage, on paper
  double book = 0;                  // the book's idle fraction
  std::string chart;                // the tables drawn as the book draws them
  std::string formula;              // the book's (or the paper's) idle share, in words
};
void print_bubble_report(Comm& comm, const BubblePrediction& paper,
                         const ScheduleMeasure& measured);
// Context parallelism (Playbook §7.3): per cp rank, the attention blocks and (query, key) pairs
// it computed per training step and the time it took, next to what the split predicts:
// zig-zag gives every rank the same pairs; contiguous chunks give rank r r + 1 blocks.
// `split`: "zigzag split, ring". Collective: every rank calls it; rank 0 prints.
void print_balance_report(Comm& comm, const std::string& split, int64_t blocks, int64_t pairs,
                          double seconds, int64_t steps);
// Expert parallelism (--report experts): what training steps routed, per layer, summed over
// micro-batches and steps on the ranks that count them (tp rank 0 and cp rank 0 of each
// data-parallel replica: tp ranks route the same tokens, cp ranks sum their counts first), and
// the rows this rank dispatched.
struct ExpertStats {
  std::vector<std::vector<int64_t>> routed;  // [layer][expert] (token, slot) pairs routed to it
  std::vector<int64_t> dropped;              // [layer] pairs the capacity dropped
  std::vector<double> layer_aux;             // [layer] the layer's own balance loss, summed
  std::vector<int64_t> layer_batches;        // [layer] micro-batches counted
  double aux_sum = 0;                        // the model's load-balancing loss, summed
  int64_t batches = 0;                       // micro-batches it was summed over
  int64_t rows_elsewhere = 0;                // this rank: the rows it dispatched to another rank
  int64_t rows_arrived = 0;                  // this rank's experts: rows from another rank
};
// Per layer: tokens per expert per step (min, mean, max, max/mean), dropped pairs per step and
// the layer's balance loss; the model's load-balancing loss per micro-batch. Summed over every
// rank (collective over the world); rank 0 prints. `setup`: "8 experts, top 2, ep 2".
void print_expert_report(Comm& comm, const std::string& setup, int layers, int experts,
                         const ExpertStats& stats, int64_t steps);
// The all-to-all bytes this rank sent over the ep group per training step, next to the formula
// with the routing uniform (uniform_per_step: 2 N k (ep - 1) / ep D b per block, micro-batch and
// pass) and with the routing the run measured (routed_per_step: every row that left this rank,
// b D bytes each), b = value_bytes (the compute format's). Rank 0 prints its own.
void print_expert_comm_report(const CollStats& measured, double uniform_per_step,
                              double routed_per_step, int64_t steps, int passes, int value_bytes);
// The expert weights this rank holds, measured, next to L E / ep 3 D F / tp 4 bytes.
void print_expert_memory(int64_t measured_bytes, int64_t formula_bytes, const std::string& formula);
// A mixture's meter (meters.cuh): what the training steps' schedules (not validation's) routed,
// recorded by the layers into the ExpertStats that `recorded` points to while they run: the
// load-balancing loss per step in the log (" | aux", --log-json aux_loss), and --report memory
// (the experts this rank holds), comm (the all-to-all next to uniform routing) and experts
// (routing per layer).
struct ExpertSteps {
  int64_t tokens = 0;  // per micro-batch on this rank
  int grad_acc = 1, dp = 1;
  int passes = 2;             // all-to-all passes per block: dispatch and combine, forward and back
  int blocks = 0;             // the blocks this rank holds
  int64_t expert_params = 0;  // the parameters of its experts
  double capacity_factor = 0;  // 0: dropless
  // The all-to-all bytes a step sends with the routing uniform: blocks x micro-batches x passes
  // x moe_expected_a2a_bytes (formulas.cuh).
  double uniform_a2a = 0;
  int value_bytes = 4;  // a row's values as they travel (the compute format's size)
};
std::unique_ptr<StepMeter> expert_meter(Comm& comm, const ModelConfig& cfg, ExpertStats*& recorded,
                                        const ExpertSteps& steps);
