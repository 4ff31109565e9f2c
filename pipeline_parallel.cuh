// pipeline_parallel.cuh: pipeline parallelism (Playbook §8). Each rank of the pp group holds
// consecutive blocks (a stage, or V model chunks when interleaved); activations travel forward
// and their gradients backward between neighbours; a schedule decides the order of each rank's
// forwards and backwards, and the bubble is the time a rank waits.
#pragma once
#include <string>
#include <vector>

#include "model.cuh"
#include "runtime/gradient_sync.cuh"
#include "runtime/observe.cuh"
#include "runtime/report.cuh"

enum class PpSchedule { AFAB, OneFOneB, Interleaved, ZeroBubbleH1 };

// ---- Flags (Playbook §8) ----
namespace CLI {
class App;
}
struct PipelineOptions {
  int pp = 1;                                     // --pp: stages
  PpSchedule pp_schedule = PpSchedule::OneFOneB;  // --pp-schedule
  int pp_virtual = 1;                             // --pp-virtual: model chunks per rank
};
void add_pipeline_flags(CLI::App& app, PipelineOptions& o);
PpSchedule parse_pp_schedule(const std::string& flag);  // afab|1f1b|interleaved|zb-h1
const char* pp_schedule_name(PpSchedule s);
// The configuration table's row: the schedule, its micro-batches and chunks; empty for pp = 1.
std::string describe_pipeline(const PipelineOptions& o, int micro_batches);

// ---- Partition (Playbook §8.1) ----
// L blocks in p x V contiguous chunks, as even as possible: the first L mod pV chunks get one
// block more. Rank r holds chunks r, r + p, r + 2p, ... (Megatron's interleaving); chunk 0 also
// holds the embedding, chunk pV - 1 the final norm, LM head and loss.
std::vector<Stage> pipeline_chunks(int layers, int p, int V, int rank);
// Throws UsageError naming the flags: layers < p x V, interleaved without m a multiple of p (or
// V < 2), V > 1 for another schedule, tied embeddings or ZeRO-3 with pp > 1, ZeRO-2 with zb-h1.
void validate_pipeline(int layers, int p, int V, int micro_batches, PpSchedule s, bool tied,
                       int zero_stage);

// ---- Schedules as tables (Playbook §8.3-§8.6) ----
struct PipelineOp {
  // Backward: the whole backward, or (zero-bubble) only its input-gradient half, B, whose
  // weight-gradient half W runs later as its own op (Qi et al., 2023).
  Phase kind;
  int micro;  // micro-batch
  int chunk;  // this rank's model chunk (0 .. V-1); its global chunk is rank + chunk * p
};
// Rank `rank`'s ops in order, for p stages, m micro-batches and V chunks per rank.
std::vector<PipelineOp> pipeline_schedule(PpSchedule s, int p, int rank, int m, int V);
// A table with weight ops (zero-bubble) needs the backward split into B and W.
bool splits_backward(const std::vector<PipelineOp>& table);

// Every rank's table run against each other with a forward costing t_f, a backward's input
// gradient t_b and its weight gradient t_w (one op of t_b + t_w unless zero-bubble) and
// communication free: when each op can start, so the idle time is the bubble the book draws.
struct PipelineTiming {
  bool complete = false;            // false: some op waits forever (the tables would deadlock)
  double makespan = 0;              // the step, from the first op to the last
  std::vector<double> busy;         // per rank
  std::vector<int> peak_in_flight;  // per rank: most (micro-batch, chunk) forwards awaiting
                                    // their backward at once, i.e. activations held
  std::vector<std::vector<double>> start;  // per rank, per op of its table: when it starts
};
PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, double t_f, double t_b,
                                 double t_w);
// The book's figure in text: one row per stage, one column per tick (t_f = t_b = t_w = 1, so a
// whole backward takes 2), each op's micro-batch with F, B or W (and its chunk when V > 1), '.'
// where the stage idles.
std::string pipeline_chart(PpSchedule s, int p, int m, int V);
// The book's idle fraction of a step: (p-1)/(m+p-1) for AFAB and 1F1B, (p-1)/(Vm+p-1)
// interleaved (the bubble (p-1)/m, resp. (p-1)/(Vm), of the ideal time, as a share of the step);
// ZB-H1 idles (p-1)(t_f + t_b - t_w), which with t_f = t_b = t_w is (p-1)/(3m+p-1).
double bubble_fraction(PpSchedule s, int p, int m, int V);
// What --report bubble prints next to the measured times: the tables on paper, the book's
// fraction and the chart.
BubblePrediction bubble_prediction(PpSchedule s, int p, int m, int V);

// ---- Running a step: the one engine (DESIGN 6, "Schedule") ----
struct PipelineConfig {
  PpSchedule schedule = PpSchedule::OneFOneB;
  int virtual_stages = 1;
};
// This rank's part of one step's global batch: micro_batches x mbs sequences of seq tokens.
struct StepBatch {
  const int32_t* inputs;   // host [micro_batches * mbs * seq]
  const int32_t* targets;  // host [micro_batches * mbs * seq]
  int micro_batches, mbs, seq;
};
// Runs every micro-batch of a step through this rank's chunks in the schedule's order:
// receive, forward or backward, send, with the gradient sync's hooks; loss_scale turns each
// micro-batch's summed loss into its share of the step's mean (DESIGN 5). Without a pipeline
// (pp = 1) the table is the one-stage 1F1B table F0 B0 F1 B1 ...: gradient accumulation
// (Playbook §2.7). Sends wait to go out with the next receive as one grouped call. The observer
// sees every op (trace, faults, memory). Returns the summed per-token losses of this rank's
// micro-batches (those of the last stage; 0 elsewhere).
double run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                    const StepBatch& batch, Recompute mode, float loss_scale,
                    const PipelineConfig& cfg, Observer& observer);
// Forward only, through every stage in turn (evaluation, sampling): the summed loss on the rank
// that holds the head (0 elsewhere); `acts` then holds its logits.
float pipeline_forward(const Context& ctx, Comm& comm, Model& model, Activations& acts,
                       const int32_t* ids, const int32_t* targets, int B, int T);
