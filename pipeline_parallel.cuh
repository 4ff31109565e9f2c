// pipeline_parallel.cuh: pipeline parallelism (Playbook §8). Each rank of the pp group holds
// consecutive blocks (a stage, or V model chunks when interleaved); activations travel forward
// and their gradients backward between neighbours; a schedule decides the order of each rank's
// forwards and backwards, and the bubble is the time a rank waits.
#pragma once
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "model.cuh"
#include "runtime/gradient_sync.cuh"
#include "runtime/observe.cuh"
#include "runtime/report.cuh"

enum class PpSchedule {
  AFAB,          // §8.3: every forward, then every backward (GPipe)
  OneFOneB,      // §8.4
  Interleaved,   // §8.5, Megatron's loop of V chunks per rank
  ZeroBubbleH1,  // §8.6, Qi et al. 2023
  ZeroBubbleV,   // the zero-bubble paper's V (Qi et al. 2023)
  DualPipeV,     // DeepSeek-V3's DualPipe cut in half, on the V
};

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
// --pp-schedule afab|1f1b|interleaved|zb-h1|zb-v|dualpipev
PpSchedule parse_pp_schedule(const std::string& flag);
const char* pp_schedule_name(PpSchedule s);
// The configuration table's row: the schedule, its micro-batches and chunks; empty for pp = 1.
std::string describe_pipeline(const PipelineOptions& o, int micro_batches);

// ---- Placement and partition (Playbook §8.1, §8.5) ----
// Which of the model's p x V chunks (numbered along the model, 0 .. pV - 1) each rank holds: a
// column of the schedule's row. Megatron's loop (afab, 1f1b, interleaved, zb-h1): rank r holds
// chunks r, r + p, r + 2p, ...; the V (zb-v, dualpipev): chunk 1 runs back up the ranks, rank r
// holding r and 2p - 1 - r, so that chunks p - 1 and p meet on rank p - 1.
struct StagePlacement {
  std::vector<std::vector<int>> chunks;  // per rank: its model chunks, in its local order
  std::vector<int> rank;                 // per model chunk: the rank that holds it
  // Whether model chunk g exists and a rank other than r holds it: a message, not a hand-over.
  bool elsewhere(int g, int r) const { return g >= 0 && g < (int)rank.size() && rank[g] != r; }
};
StagePlacement stage_placement(PpSchedule s, int p, int V);
// The ways activations travel between ranks under this placement (comm_init's pipeline pairs,
// which over NCCL are the pipeline's links): from the rank of each model chunk to the next
// chunk's, where they differ. The loop: to the next rank (and round, interleaved); a V: both.
inline PipelinePairs pipeline_messages(PpSchedule s, int p, int V) {
  const StagePlacement at = stage_placement(s, p, V);
  std::set<std::pair<int, int>> ways;
  for (size_t g = 0; g + 1 < at.rank.size(); g++)
    if (at.rank[g] != at.rank[g + 1]) ways.insert({at.rank[g], at.rank[g + 1]});
  return {ways.begin(), ways.end()};
}
// L blocks in p x V contiguous chunks, as even as possible: the first L mod pV chunks get one
// block more; rank `rank` gets the chunks the placement of `s` gives it (the default: the
// loop). Chunk 0 also holds the embedding, chunk pV - 1 the final norm, LM head and loss.
std::vector<Stage> pipeline_chunks(int layers, int p, int V, int rank,
                                   PpSchedule s = PpSchedule::OneFOneB);
// Throws UsageError naming the flags: layers < p x V, interleaved without m a multiple of p (or
// V < 2), a V schedule without V = 2, V > 1 for another schedule, tied embeddings or ZeRO-3 with
// pp > 1, ZeRO-2 with a schedule that defers weight gradients.
void validate_pipeline(int layers, int p, int V, int micro_batches, PpSchedule s, bool tied,
                       int zero_stage);
// Whether schedule s runs V model chunks per rank (1; interleaved 2 or more; a V exactly 2).
bool runs_chunks(PpSchedule s, int V);

// ---- Schedules as tables (Playbook §8.3-§8.6) ----
struct PipelineOp {
  // Backward: the whole backward, or (zero-bubble) only its input-gradient half, B, whose
  // weight-gradient half W runs later as its own op (Qi et al., 2023): when the table holds a
  // W of the same micro-batch and chunk.
  Phase kind;
  int micro;  // micro-batch
  int chunk;  // which of this rank's V chunks (0 .. V-1); stage_placement says which model chunk
  // DualPipe's F&B (DeepSeek-V3): this op and the next run as one, both inputs received before
  // either computes, both outputs sent after.
  bool with_next = false;
};
// Rank `rank`'s ops in order, for p stages, m micro-batches and V chunks per rank.
std::vector<PipelineOp> pipeline_schedule(PpSchedule s, int p, int rank, int m, int V);
// The (micro-batch, chunk) pairs whose backward is B alone: the table runs their W apart
// (zero-bubble; none: every backward whole).
std::set<std::pair<int, int>> weights_apart(const std::vector<PipelineOp>& table);

// The book's (or the paper's) idle fraction of a step: (p-1)/(m+p-1) for AFAB and 1F1B,
// (p-1)/(Vm+p-1) interleaved (the bubble (p-1)/m, resp. (p-1)/(Vm), of the ideal time, as a
// share of the step); ZB-H1 idles (p-1)(t_f + t_b - t_w), which with t_f = t_b = t_w is
// (p-1)/(3m+p-1); ZB-V no bubble past the first micro-batch's way down, (p-1) t_f of a chunk,
// (p-1)/(6m+p-1); DualPipeV (p-1)(F&B + B - 3W) of chunk ops (DeepSeek-V3, PP = 2p stages),
// 2(p-1) of 6m + 2(p-1) ticks with equal costs (m >= 2p).
double bubble_fraction(PpSchedule s, int p, int m, int V);
// The formula in words, for --report bubble.
std::string bubble_formula(PpSchedule s);
// The tables run on paper, their chart and --report bubble's prediction: the one simulator,
// planner/pipeline_timing.cuh.

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
  // The number in the run of the first of these sequences (the data order's, runtime/data.cuh),
  // which dropout draws its masks from; -1: none is dropped.
  int64_t sequence0 = -1;
  int64_t sequence(int micro) const {
    return sequence0 < 0 ? -1 : sequence0 + (int64_t)micro * mbs;
  }
};
// Runs every micro-batch of a step through this rank's chunks in the schedule's order:
// receive, forward or backward, send, with the gradient sync's hooks; loss_scale turns each
// micro-batch's summed loss into its share of the step's mean (DESIGN 5). Without a pipeline
// (pp = 1) the table is the one-stage 1F1B table F0 B0 F1 B1 ...: gradient accumulation
// (Playbook §2.7). Sends wait to go out just before the next receive; only receives wait. The
// observer sees every op (trace, faults, memory). The model's chunks are those pipeline_chunks
// gives for cfg.schedule. Returns the summed per-token losses of this rank's micro-batches (those
// of the chunk that holds the head; 0 elsewhere).
double run_schedule(const Context& ctx, Comm& comm, Model& model, GradientSync& sync,
                    const StepBatch& batch, Recompute mode, float loss_scale,
                    const PipelineConfig& cfg, Observer& observer);
// Forward only, through every stage in turn (evaluation, sampling): the summed loss on the rank
// that holds the head (0 elsewhere); `acts` then holds its logits. `s`: the schedule whose
// placement the model was built with (pipeline_chunks).
float pipeline_forward(const Context& ctx, Comm& comm, Model& model, Activations& acts,
                       const int32_t* ids, const int32_t* targets, int B, int T,
                       PpSchedule s = PpSchedule::OneFOneB);
