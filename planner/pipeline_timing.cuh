// pipeline_timing.cuh: the pipeline's tables run on paper (Playbook §8.2-§8.6): every rank's
// table (pipeline_parallel.cuh) run against the others', each op at a cost, so the idle time is
// the bubble the book draws. The one simulator: the pipeline's tests and charts, --report bubble
// and the planner's step time (on a device per rank, or CPU ranks sharing cores over MPI).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "pipeline_parallel.cuh"
#include "runtime/report.cuh"

// Every rank's table run against each other on paper: when each op can start, so the idle time
// is the bubble. Each op costs its PipelineCosts; a message between two ranks costs nothing of
// itself, and one between consecutive chunks on the same rank is no message at all.
struct PipelineCosts {
  // A forward, a backward's input gradient B and its weight gradient W (one op of B + W unless
  // the table splits them, zero-bubble), in seconds of one rank on its own.
  double forward = 1, backward = 1, weight = 1;
  double comm = 0;  // blocking collectives (tp, cp, ep) after each forward and backward
};
// Where the ranks run. Without one (the book's figure) each rank has a device of its own and a
// message leaves as soon as it is sent. CPU ranks over MPI on one machine differ in two ways:
// the k ranks computing at a time share `cores` cores' worth, at min(1, cores / k) each (a rank
// waiting sleeps, runtime/comm_handle.cu, and hands its core to the others); and a send on host
// memory moves only while its sender is inside MPI (waiting for a receive of its own, however
// briefly, or at the step's end) and its receiver waits for it (runtime/exchange.cuh).
struct HostRanks {
  double cores = 1;  // the cores' worth the pipeline's ranks share
};
struct PipelineTiming {
  bool complete = false;     // false: some op waits forever (the tables would deadlock), a message
                             // is never received, or one would be received out of order
  bool in_order = true;      // every message received in the order it was sent on its way
  double makespan = 0;       // the step, from the first op to the last
  std::vector<double> busy;  // per rank: the seconds its ops cost
  std::vector<int> peak_in_flight;         // per rank: most (micro-batch, chunk) forwards awaiting
                                           // their backward at once, i.e. activations held
  std::vector<std::vector<double>> start;  // per rank, per op of its table: when it starts
};
PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, const PipelineCosts& costs,
                                 std::optional<HostRanks> host = std::nullopt);
// The same on given tables, one per rank, over a placement (a row's, or tables that are not).
PipelineTiming simulate_tables(const StagePlacement& at,
                               const std::vector<std::vector<PipelineOp>>& tables,
                               const PipelineCosts& costs,
                               std::optional<HostRanks> host = std::nullopt);
// The book's figure: a forward costs t_f, a backward t_b + t_w (or B t_b and W t_w), each rank
// on its own device.
PipelineTiming simulate_pipeline(PpSchedule s, int p, int m, int V, double t_f, double t_b,
                                 double t_w);
// The book's figure in text: one row per stage, one column per tick (t_f = t_b = t_w = 1, so a
// whole backward takes 2), each op's micro-batch with F, B or W (and its chunk when V > 1), '.'
// where the stage idles; '&' marks the second op of an F&B pair (DualPipe).
std::string pipeline_chart(PpSchedule s, int p, int m, int V);
// What --report bubble prints next to the measured times: the tables on paper, the book's
// fraction and the chart.
BubblePrediction bubble_prediction(PpSchedule s, int p, int m, int V);
