// Pipeline parallelism (Playbook §8) as tables, apart from the numerics (as Megatron tests its
// schedule orders): the partition, every schedule's ops, and the bubble and in-flight
// micro-batches that running the tables against each other gives, against the book's numbers.
// The training side (losses, gradients, weights against one process) is in test_parity.cu.
#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "pipeline_parallel.cuh"
#include "planner/pipeline_timing.cuh"
#include "runtime/comm_internal.cuh"

TEST_CASE("pipeline chunks cover every block once, sizes within one, Megatron's assignment",
          "[pipeline]") {
  for (int L : {4, 5, 7, 16})
    for (int p : {1, 2, 3, 4})
      for (int V : {1, 2})
        if (L >= p * V) {
          std::vector<int> owner(L, -1);
          int smallest = L, largest = 0;
          for (int r = 0; r < p; r++) {
            std::vector<Stage> chunks = pipeline_chunks(L, p, V, r);
            REQUIRE((int)chunks.size() == V);
            for (int k = 0; k < V; k++) {
              const Stage& s = chunks[k];
              int c = r + k * p;  // its global chunk: rank r holds r, r + p, ...
              REQUIRE(s.embedding == (c == 0));
              REQUIRE(s.head == (c == p * V - 1));
              smallest = std::min(smallest, s.last_block - s.first_block);
              largest = std::max(largest, s.last_block - s.first_block);
              for (int b = s.first_block; b < s.last_block; b++) {
                REQUIRE(owner[b] == -1);
                owner[b] = c;
              }
            }
          }
          INFO("L " << L << ", p " << p << ", V " << V);
          for (int b = 1; b < L; b++) REQUIRE(owner[b] >= owner[b - 1]);  // contiguous, in order
          REQUIRE(owner[0] == 0);
          REQUIRE(largest - smallest <= 1);
          REQUIRE(smallest >= 1);
        }
  // 5 blocks on 2 stages: the first L mod p stages take one more (picotron's split).
  REQUIRE(pipeline_chunks(5, 2, 1, 0)[0].last_block == 3);
  REQUIRE(pipeline_chunks(5, 2, 1, 1)[0].first_block == 3);
}

TEST_CASE(
    "every schedule places Megatron's loop: rank r holds chunks r, r + p, ...; chunk g lives on g "
    "mod p",
    "[pipeline]") {
  // Playbook §8.5 on 4 ranks and 2 chunks each: ranks 0-3 hold model chunks {0, 4}, {1, 5},
  // {2, 6}, {3, 7}.
  const std::vector<std::vector<int>> book = {{0, 4}, {1, 5}, {2, 6}, {3, 7}};
  for (PpSchedule s : {PpSchedule::AFAB, PpSchedule::OneFOneB, PpSchedule::Interleaved,
                       PpSchedule::ZeroBubbleH1}) {
    StagePlacement at = stage_placement(s, 4, 2);
    REQUIRE(at.chunks == book);
    REQUIRE(at.rank == std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3});
    // Neighbouring chunks always sit on other ranks: every hand-over is a message.
    REQUIRE(at.elsewhere(5, 0));
    REQUIRE(!at.elsewhere(4, 0));  // its own
    REQUIRE(!at.elsewhere(-1, 0));
    REQUIRE(!at.elsewhere(8, 3));  // past the last chunk
  }
  // The partition follows the placement: 8 blocks in 8 chunks, rank 1 holds blocks 1 and 5.
  std::vector<Stage> mine = pipeline_chunks(8, 4, 2, 1, PpSchedule::Interleaved);
  REQUIRE(mine.size() == 2);
  REQUIRE((mine[0].first_block == 1 && mine[1].first_block == 5 && mine[1].last_block == 6));
}

TEST_CASE(
    "zb-v and dualpipev place a V: rank r holds chunks r and 2p - 1 - r, the tip's two on rank p - "
    "1, the embedding and the head on rank 0",
    "[pipeline]") {
  // The zero-bubble paper's ZB-V and DeepSeek's DualPipeV on 4 ranks: ranks 0-3 hold model
  // chunks {0, 7}, {1, 6}, {2, 5}, {3, 4}.
  const std::vector<std::vector<int>> v = {{0, 7}, {1, 6}, {2, 5}, {3, 4}};
  for (PpSchedule s : {PpSchedule::ZeroBubbleV, PpSchedule::DualPipeV}) {
    StagePlacement at = stage_placement(s, 4, 2);
    REQUIRE(at.chunks == v);
    REQUIRE(at.rank == std::vector<int>{0, 1, 2, 3, 3, 2, 1, 0});
    REQUIRE(!at.elsewhere(4, 3));  // the tip: chunk 3's output is chunk 4's input on rank 3
    REQUIRE(at.elsewhere(5, 3));
    // 16 blocks in 8 chunks of 2: rank 0 holds blocks 0-1 with the embedding and 14-15 with
    // the head; rank 3 the middle, blocks 6-9.
    std::vector<Stage> first = pipeline_chunks(16, 4, 2, 0, s),
                       tip = pipeline_chunks(16, 4, 2, 3, s);
    REQUIRE((first[0].first_block == 0 && first[0].last_block == 2 && first[0].embedding));
    REQUIRE((first[1].first_block == 14 && first[1].last_block == 16 && first[1].head));
    REQUIRE((tip[0].first_block == 6 && tip[1].first_block == 8 && tip[1].last_block == 10));
    REQUIRE((!tip[0].embedding && !tip[0].head && !tip[1].embedding && !tip[1].head));
  }
}

TEST_CASE(
    "two consecutive chunks on one rank hand over without waiting: one rank, two chunks, no idle "
    "tick",
    "[pipeline]") {
  // Interleaved on a single rank (p = 1, V = 2): chunk 0's output is chunk 1's input on the same
  // rank. Each of the m x V chunk passes costs t_f + t_b + t_w = 3 ticks and nothing waits: 12
  // ticks for m = 2, on a device and on one core's worth of CPU ranks alike.
  PipelineTiming device = simulate_pipeline(PpSchedule::Interleaved, 1, 2, 2, 1.0, 1.0, 1.0);
  REQUIRE(device.complete);
  REQUIRE(device.makespan == Approx(12));
  REQUIRE(device.busy[0] == Approx(12));
  PipelineTiming host = simulate_pipeline(PpSchedule::Interleaved, 1, 2, 2,
                                          PipelineCosts{1.0, 1.0, 1.0}, HostRanks{1.0});
  REQUIRE(host.complete);
  REQUIRE(host.makespan == Approx(12));
}

// Every (micro-batch, chunk) forwarded and backwarded exactly once on each rank, forward first;
// under zero-bubble also its weight gradient, once, after its backward (every one under zb-h1
// and zb-v, some under dualpipev, none otherwise). An F&B pair (dualpipev only) is a forward
// and a backward of two micro-batches.
static void require_complete_table(PpSchedule s, int p, int m, int V) {
  const bool all_apart = s == PpSchedule::ZeroBubbleH1 || s == PpSchedule::ZeroBubbleV;
  const bool some_apart = all_apart || s == PpSchedule::DualPipeV;
  for (int r = 0; r < p; r++) {
    std::set<std::pair<int, int>> forwarded, backwarded, weighted;
    const std::vector<PipelineOp> ops = pipeline_schedule(s, p, r, m, V);
    for (size_t i = 0; i < ops.size(); i++) {
      const PipelineOp& op = ops[i];
      std::pair<int, int> key{op.micro, op.chunk};
      REQUIRE((op.micro >= 0 && op.micro < m && op.chunk >= 0 && op.chunk < V));
      if (op.with_next) {
        REQUIRE(s == PpSchedule::DualPipeV);
        REQUIRE(i + 1 < ops.size());
        REQUIRE((op.kind == Phase::Forward && ops[i + 1].kind == Phase::Backward));
        REQUIRE(op.micro != ops[i + 1].micro);
      }
      if (op.kind == Phase::Forward) {
        REQUIRE(forwarded.insert(key).second);
      } else if (op.kind == Phase::Backward) {
        REQUIRE(forwarded.count(key));
        REQUIRE(backwarded.insert(key).second);
      } else {
        REQUIRE(some_apart);
        REQUIRE(backwarded.count(key));
        REQUIRE(weighted.insert(key).second);
      }
    }
    REQUIRE((int)forwarded.size() == m * V);
    REQUIRE((int)backwarded.size() == m * V);
    if (all_apart) REQUIRE((int)weighted.size() == m * V);
    if (!some_apart) REQUIRE(weighted.empty());
  }
}

TEST_CASE("every schedule runs each forward and backward once per stage, and never deadlocks",
          "[pipeline]") {
  for (int p = 2; p <= 8; p++)
    for (int m = 1; m <= 16; m++) {
      for (PpSchedule s : {PpSchedule::AFAB, PpSchedule::OneFOneB, PpSchedule::ZeroBubbleH1}) {
        INFO(pp_schedule_name(s) << ", p " << p << ", m " << m);
        require_complete_table(s, p, m, 1);
        // Dependencies: a forward after the previous stage's, a backward after the next
        // stage's; the simulation only runs an op once they are done, so completing is the proof.
        REQUIRE(simulate_pipeline(s, p, m, 1, 1.0, 1.0, 1.0).complete);
      }
      if (m % p == 0)
        for (int V = 2; V <= 4; V++) {
          INFO("interleaved, p " << p << ", m " << m << ", V " << V);
          require_complete_table(PpSchedule::Interleaved, p, m, V);
          REQUIRE(simulate_pipeline(PpSchedule::Interleaved, p, m, V, 1.0, 1.0, 1.0).complete);
        }
    }
}

TEST_CASE(
    "zb-v and dualpipev pass the simulator for p up to 8 and m from 1 to 4p: every send received, "
    "in the order sent, no deadlock, on devices and on CPU ranks",
    "[pipeline]") {
  // Completing is the proof (the simulator runs an op only once its inputs have arrived); a
  // receive that would get an earlier message of the same way clears `in_order`. CPU ranks
  // (HostRanks) move a send only while its sender waits inside MPI: a stricter test of the
  // order. Other costs change when ops run, not whether they can.
  for (PpSchedule s : {PpSchedule::ZeroBubbleV, PpSchedule::DualPipeV})
    for (int p = 1; p <= 8; p++)
      for (int m = 1; m <= 4 * p; m++) {
        INFO(pp_schedule_name(s) << ", p " << p << ", m " << m);
        require_complete_table(s, p, m, 2);
        PipelineTiming device = simulate_pipeline(s, p, m, 2, 1.0, 1.0, 1.0);
        REQUIRE(device.in_order);
        REQUIRE(device.complete);
        REQUIRE(simulate_pipeline(s, p, m, 2, 2.0, 1.0, 0.5).complete);
        for (double cores : {1.0, 2.0})
          REQUIRE(
              simulate_pipeline(s, p, m, 2, PipelineCosts{1.0, 1.0, 1.0, 0.25}, HostRanks{cores})
                  .complete);
      }
}

TEST_CASE("the simulator catches a message received out of order, and a deadlock", "[pipeline]") {
  // Not a row's tables: the checks themselves, on tables that break them. AFAB on 2 ranks and 2
  // micro-batches, F0 F1 B0 B1 on each rank.
  const StagePlacement at = stage_placement(PpSchedule::AFAB, 2, 1);
  std::vector<std::vector<PipelineOp>> tables = {pipeline_schedule(PpSchedule::AFAB, 2, 0, 2, 1),
                                                 pipeline_schedule(PpSchedule::AFAB, 2, 1, 2, 1)};
  PipelineTiming good = simulate_tables(at, tables, PipelineCosts{});
  REQUIRE((good.complete && good.in_order));
  // Rank 1 forwards micro-batch 1 first: its receive would get micro-batch 0's activations.
  std::vector<std::vector<PipelineOp>> swapped = tables;
  std::swap(swapped[1][0], swapped[1][1]);
  PipelineTiming t = simulate_tables(at, swapped, PipelineCosts{});
  REQUIRE(!t.in_order);
  REQUIRE(!t.complete);
  // Rank 1 runs B0 before F0: the backward waits for what its forward keeps, forever.
  std::vector<std::vector<PipelineOp>> stuck = tables;
  std::rotate(stuck[1].begin(), stuck[1].begin() + 2, stuck[1].begin() + 3);
  REQUIRE((stuck[1][0].kind == Phase::Backward && stuck[1][0].micro == 0));
  PipelineTiming d = simulate_tables(at, stuck, PipelineCosts{});
  REQUIRE(d.in_order);
  REQUIRE(!d.complete);
}

TEST_CASE("1F1B on 4 stages and 8 micro-batches idles 3/11 of the time, as AFAB does",
          "[pipeline]") {
  // Playbook §8.3-§8.4 with t_b = 2 t_f: every stage idles (p-1)(t_f + t_b) of a step of
  // (m + p - 1)(t_f + t_b); the book's notes: p = 4, m = 8 gives 0.273, p = 8, m = 32 0.179.
  for (PpSchedule s : {PpSchedule::AFAB, PpSchedule::OneFOneB}) {
    PipelineTiming t = simulate_pipeline(s, 4, 8, 1, 1.0, 1.0, 1.0);
    REQUIRE(t.makespan == Approx(11 * 3.0));
    for (double busy : t.busy) REQUIRE(1.0 - busy / t.makespan == Approx(3.0 / 11));
    REQUIRE(bubble_fraction(s, 4, 8, 1) == Approx(0.2727).epsilon(1e-3));
    PipelineTiming big = simulate_pipeline(s, 8, 32, 1, 1.0, 1.0, 1.0);
    REQUIRE(1.0 - big.busy[0] / big.makespan == Approx(0.179).margin(1e-3));  // 7/39
  }
  for (int p = 2; p <= 8; p++)
    for (int m = 1; m <= 16; m++)
      for (PpSchedule s : {PpSchedule::AFAB, PpSchedule::OneFOneB}) {
        PipelineTiming t = simulate_pipeline(s, p, m, 1, 1.0, 1.0, 1.0);
        INFO(pp_schedule_name(s) << ", p " << p << ", m " << m);
        for (int r = 0; r < p; r++)
          REQUIRE(1.0 - t.busy[r] / t.makespan == Approx(bubble_fraction(s, p, m, 1)));
      }
}

TEST_CASE("AFAB holds m micro-batches on every stage, 1F1B p - rank", "[pipeline]") {
  for (int p = 2; p <= 8; p++)
    for (int m = 1; m <= 16; m++) {
      PipelineTiming afab = simulate_pipeline(PpSchedule::AFAB, p, m, 1, 1.0, 1.0, 1.0);
      PipelineTiming one = simulate_pipeline(PpSchedule::OneFOneB, p, m, 1, 1.0, 1.0, 1.0);
      for (int r = 0; r < p; r++) {
        INFO("p " << p << ", m " << m << ", rank " << r);
        REQUIRE(afab.peak_in_flight[r] == m);
        REQUIRE(one.peak_in_flight[r] == std::min(p - r, m));
      }
    }
}

// Guards: the interleaved table's warm-up (a rank holding more or fewer chunks' activations
// than Megatron's schedule, with the same bubble).
TEST_CASE(
    "interleaved 1F1B warms up as Megatron does: 2(p - r - 1) + (V - 1)p forwards, and holds "
    "one more in flight",
    "[pipeline]") {
  // Megatron-LM, megatron/core/pipeline_parallel/schedules.py,
  // forward_backward_pipelining_with_interleaving: of total = m V forward steps, rank r runs
  //   num_warmup = (p - r - 1) * 2 + (V - 1) * p, at most total (all of them when m == p),
  // then the steady state's forward before each backward; forward step k is chunk (k mod pV) / p
  // of micro-batch (k / pV) p + k mod p. So the first backward comes after num_warmup + 1
  // forwards (after all when num_warmup is total), and that many are held at once at most.
  int checked = 0;
  for (int p : {2, 3, 4, 8})
    for (int V : {2, 3, 4})
      for (int m : {p, 2 * p, 3 * p, 4 * p})
        for (int r = 0; r < p; r++) {
          INFO("p " << p << ", V " << V << ", m " << m << ", rank " << r);
          const int total = m * V;
          const int warmup = m == p ? total : std::min(total, (p - r - 1) * 2 + (V - 1) * p);
          const int before_first_backward = warmup == total ? total : warmup + 1;
          std::vector<PipelineOp> ops = pipeline_schedule(PpSchedule::Interleaved, p, r, m, V);
          int forwards = 0, held = 0, most = 0, leading = -1;
          for (const PipelineOp& op : ops) {
            if (op.kind == Phase::Forward) {
              // Megatron's order of forward steps.
              REQUIRE(op.micro == forwards / (p * V) * p + forwards % p);
              REQUIRE(op.chunk == forwards % (p * V) / p);
              forwards++, held++;
            } else {
              if (leading < 0) leading = forwards;
              held--;
            }
            most = std::max(most, held);
          }
          REQUIRE(forwards == total);
          REQUIRE(leading == before_first_backward);
          REQUIRE(most == before_first_backward);
          checked++;
        }
  REQUIRE(checked == 3 * 4 * (2 + 3 + 4 + 8));
}

TEST_CASE("interleaving V chunks divides the bubble by V: the book's p = 8 grid", "[pipeline]") {
  // Playbook §8.5, pp_bubblesize: (p-1)/(V m) for p = 8. Measured here as idle over busy ticks
  // of every rank (a chunk's forward costs t_f, its backward t_b). Interleaving needs m a
  // multiple of p; V = 1 is 1F1B.
  const int p = 8;
  const double book[6][4] = {{7.0, 3.5, 1.75, 0.875},
                             {3.5, 1.75, 0.875, 0.4375},
                             {1.75, 0.875, 0.4375, 0.21875},
                             {0.875, 0.4375, 0.21875, 0.109375},
                             {0.4375, 0.21875, 0.109375, 0.0546875},
                             {0.21875, 0.109375, 0.0546875, 0.02734375}};
  const int ms[6] = {1, 2, 4, 8, 16, 32}, Vs[4] = {1, 2, 4, 8};
  int checked = 0;
  for (int i = 0; i < 6; i++)
    for (int j = 0; j < 4; j++) {
      int m = ms[i], V = Vs[j];
      if (V > 1 && m % p) continue;  // not a schedule Megatron runs
      PpSchedule s = V == 1 ? PpSchedule::OneFOneB : PpSchedule::Interleaved;
      PipelineTiming t = simulate_pipeline(s, p, m, V, 1.0, 1.0, 1.0);
      INFO("m " << m << ", V " << V);
      REQUIRE(t.complete);
      for (int r = 0; r < p; r++)
        REQUIRE((t.makespan - t.busy[r]) / t.busy[r] == Approx(book[i][j]));
      checked++;
    }
  REQUIRE(checked == 6 + 3 * 3);
}

TEST_CASE(
    "ZB-H1 idles (p-1)(t_f + t_b - t_w) where 1F1B idles (p-1)(t_f + t_b + t_w), holding "
    "at most p micro-batches",
    "[pipeline]") {
  // Qi et al. 2023 (Playbook §8.6): splitting the backward into B (input gradient) and W
  // (weight gradient) shortens the chain of backwards from the last stage to the first by t_w
  // per stage, and the deferred W's fill the rest; the memory stays that of 1F1B's first stage.
  // The formula holds once there are at least p micro-batches.
  for (auto [t_f, t_b, t_w] : {std::tuple{1.0, 1.0, 1.0}, {2.0, 1.0, 1.0}, {1.0, 1.5, 0.5}})
    for (int p = 2; p <= 8; p++)
      for (int m = p; m <= 16; m++) {
        PipelineTiming zb = simulate_pipeline(PpSchedule::ZeroBubbleH1, p, m, 1, t_f, t_b, t_w);
        PipelineTiming one = simulate_pipeline(PpSchedule::OneFOneB, p, m, 1, t_f, t_b, t_w);
        INFO("p " << p << ", m " << m << ", t_f " << t_f << ", t_b " << t_b << ", t_w " << t_w);
        for (int r = 0; r < p; r++) {
          REQUIRE(zb.makespan - zb.busy[r] == Approx((p - 1) * (t_f + t_b - t_w)));
          REQUIRE(one.makespan - one.busy[r] == Approx((p - 1) * (t_f + t_b + t_w)));
          REQUIRE(zb.peak_in_flight[r] <= p);
        }
      }
  REQUIRE(bubble_fraction(PpSchedule::ZeroBubbleH1, 4, 8, 1) == Approx(3.0 / 27));
}

TEST_CASE(
    "ZB-V idles only the first micro-batch's way down, p - 1 of 6m + p - 1 ticks, holding 2p "
    "chunks: 1F1B's p micro-batches",
    "[pipeline]") {
  // Qi et al. 2023 (ZB-V, t_F = t_B = t_W): no bubble once the pipeline is full, at the
  // activation memory of 1F1B. Per rank a step is 2m chunks x (F + B + W) = 6m ticks; rank p - 1
  // cannot start before micro-batch 0 has crossed p - 1 chunks, so every rank idles at least
  // p - 1 ticks (same work, same step): ZB-V idles exactly that. 1F1B's first stage holds p
  // micro-batches of a stage of L/p blocks; a V rank's 2p chunks of L/2p blocks are as many.
  for (int p = 2; p <= 8; p++)
    for (int m = p; m <= 4 * p; m++) {
      PipelineTiming t = simulate_pipeline(PpSchedule::ZeroBubbleV, p, m, 2, 1.0, 1.0, 1.0);
      INFO("p " << p << ", m " << m);
      REQUIRE(t.makespan == Approx(6 * m + p - 1));
      for (int r = 0; r < p; r++) {
        REQUIRE(t.makespan - t.busy[r] == Approx(p - 1));
        REQUIRE(t.peak_in_flight[r] == 2 * p);
      }
      REQUIRE(bubble_fraction(PpSchedule::ZeroBubbleV, p, m, 2) ==
              Approx((p - 1.0) / (6 * m + p - 1)));
    }
  // The book's example, p = 4 and m = 8: 3 of 51 ticks (5.9%), where 1F1B idles 27.3% and ZB-H1
  // 11.1%.
  REQUIRE(bubble_fraction(PpSchedule::ZeroBubbleV, 4, 8, 2) == Approx(3.0 / 51));
}

TEST_CASE(
    "DualPipeV idles DeepSeek's (PP/2-1)(F&B + B - 3W), 2(p-1) ticks with equal costs, holding "
    "PP + 1 = 2p + 1 chunks",
    "[pipeline]") {
  // DeepSeek-V3's table (DualPipe's README, DualPipeV on PP/2 = p devices of PP = 2p stages):
  // bubble (PP/2-1)(F&B + B - 3W), activations PP + 1 chunks per device, for m >= PP
  // micro-batches. F = W = 1 tick and a whole backward B = 2: an F&B pair takes 3, so
  // (p-1)(3 + 2 - 3) = 2(p-1) idle ticks of a step of 6m + 2(p-1).
  for (int p = 2; p <= 8; p++)
    for (int m = 2 * p; m <= 4 * p; m++) {
      PipelineTiming t = simulate_pipeline(PpSchedule::DualPipeV, p, m, 2, 1.0, 1.0, 1.0);
      INFO("p " << p << ", m " << m);
      const double F = 1, B = 2, W = 1, FB = F + B;
      for (int r = 0; r < p; r++) {
        REQUIRE(t.makespan - t.busy[r] == Approx((p - 1) * (FB + B - 3 * W)));
        REQUIRE(t.peak_in_flight[r] <= 2 * p + 1);
      }
      REQUIRE(*std::max_element(t.peak_in_flight.begin(), t.peak_in_flight.end()) == 2 * p + 1);
      REQUIRE(1 - t.busy[0] / t.makespan ==
              Approx(bubble_fraction(PpSchedule::DualPipeV, p, m, 2)));
    }
}

TEST_CASE("bad pipeline layouts exit with a message naming the flags", "[pipeline]") {
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  using Catch::Contains;
  REQUIRE_THAT(message([] { validate_pipeline(3, 4, 1, 4, PpSchedule::OneFOneB, false, 0); }),
               Contains("--pp 4") && Contains("--layers 3"));
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 2, 3, PpSchedule::Interleaved, false, 0); }),
               Contains("--grad-acc 3") && Contains("multiple of --pp 2"));
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 2, 4, PpSchedule::OneFOneB, false, 0); }),
               Contains("--pp-virtual 2"));
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 1, 4, PpSchedule::OneFOneB, true, 0); }),
               Contains("--tie-embeddings"));
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 1, 4, PpSchedule::OneFOneB, false, 3); }),
               Contains("--zero 3"));
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 1, 4, PpSchedule::ZeroBubbleH1, false, 2); }),
               Contains("--zero 2") && Contains("zb-h1"));
  // The V runs two chunks per rank, a block each at least; it defers weight gradients too.
  for (PpSchedule v : {PpSchedule::ZeroBubbleV, PpSchedule::DualPipeV}) {
    for (int V : {1, 3})
      REQUIRE_THAT(message([&] { validate_pipeline(8, 2, V, 4, v, false, 0); }),
                   Contains("--pp-schedule " + std::string(pp_schedule_name(v))) &&
                       Contains("--pp-virtual 2"));
    REQUIRE_THAT(message([&] { validate_pipeline(3, 2, 2, 4, v, false, 0); }),
                 Contains("--layers 3"));
    REQUIRE_THAT(message([&] { validate_pipeline(8, 2, 2, 4, v, false, 2); }),
                 Contains("--zero 2") && Contains(pp_schedule_name(v)));
    REQUIRE(message([&] { validate_pipeline(8, 2, 2, 4, v, false, 1); }) == "no error");
    REQUIRE(runs_chunks(v, 2));
    REQUIRE((!runs_chunks(v, 1) && !runs_chunks(v, 4)));
  }
  REQUIRE_THAT(message([] { validate_pipeline(8, 2, 3, 4, PpSchedule::OneFOneB, false, 0); }),
               Contains("--pp-virtual 3") && Contains("interleaved"));
  REQUIRE_THROWS_AS(parse_pp_schedule("gpipe"), UsageError);
  REQUIRE(parse_pp_schedule("zb-v") == PpSchedule::ZeroBubbleV);
  REQUIRE(parse_pp_schedule("dualpipev") == PpSchedule::DualPipeV);
  REQUIRE(message([] { validate_pipeline(8, 2, 2, 4, PpSchedule::Interleaved, false, 1); }) ==
          "no error");
}

// The engine's messages on NCCL's rules for point-to-point (NCCL's guide, "Point-to-point
// communication"): an ncclSend or ncclRecv blocks its stream until the matching op runs on the
// peer (a message larger than NCCL's buffers: the worst case), and a stream runs its ops in
// order. Each rank's host walks its real table as run_schedule does: before an op (or an F&B
// pair) the queued sends go out, then the receive each needs (a forward's from the rank of the
// previous model chunk, on pp; a backward's from the next one's, on pp_grad; none from itself)
// is waited for; after a forward or backward its output is queued. Returns whether every rank
// finishes, sends included. `links`: a stream per way and neighbour (runtime/exchange.cuh, the
// engine); else one per communicator and rank. `wait_sends`: the receive's wait also waits for
// the sends that went out with it, as a grouped call's would.
static bool nccl_step_completes(PpSchedule s, int p, int m, int V, bool links, bool wait_sends) {
  const StagePlacement at = stage_placement(s, p, V);
  struct Op {
    int stream, match = -1;
    bool done = false;
  };
  std::vector<Op> ops;
  std::map<std::tuple<int, int, int, int>, int> stream_ids;  // (rank, kind, from, to)
  std::vector<std::vector<int>> streams;                     // ops in issue order
  std::vector<size_t> head;
  std::map<std::tuple<int, int, int, bool>, std::vector<int>> unmatched;  // (kind, from, to, send)
  auto issue = [&](int rank, int kind, int peer, bool send) {
    const int from = send ? rank : peer, to = send ? peer : rank;
    auto key = links ? std::make_tuple(rank, kind, from, to) : std::make_tuple(rank, kind, 0, 0);
    if (!stream_ids.count(key))
      stream_ids[key] = (int)streams.size(), streams.emplace_back(), head.push_back(0);
    const int id = (int)ops.size();
    ops.push_back({stream_ids[key]});
    streams[ops[id].stream].push_back(id);
    std::vector<int>& other = unmatched[{kind, from, to, !send}];
    if (other.empty()) {
      unmatched[{kind, from, to, send}].push_back(id);
    } else {  // NCCL matches a pair's messages in the order issued
      ops[id].match = other.front(), ops[other.front()].match = id;
      other.erase(other.begin());
    }
    return id;
  };
  struct Host {
    size_t k = 0;                             // the op it is at
    std::vector<std::pair<int, int>> inputs;  // op k's (and its pair's) receives still to make
    bool inputs_known = false;
    std::vector<int> waiting;                 // what it waits for now
    std::vector<std::pair<int, int>> queued;  // sends to go out: (kind, peer)
    std::vector<int> sent;                    // every send issued, waited for at the end
    bool done = false;
  };
  std::vector<Host> hosts(p);
  std::vector<std::vector<PipelineOp>> tables(p);
  for (int r = 0; r < p; r++) tables[r] = pipeline_schedule(s, p, r, m, V);
  auto go_out = [&](int r) {
    std::vector<int> ids;
    for (auto [kind, peer] : hosts[r].queued) ids.push_back(issue(r, kind, peer, true));
    hosts[r].queued.clear();
    hosts[r].sent.insert(hosts[r].sent.end(), ids.begin(), ids.end());
    return ids;
  };
  // One step of rank r's host; returns whether it moved.
  auto step_host = [&](int r) {
    Host& h = hosts[r];
    if (h.done) return false;
    for (int id : h.waiting)
      if (!ops[id].done) return false;
    h.waiting.clear();
    const std::vector<PipelineOp>& table = tables[r];
    if (h.k == table.size()) {  // the end: every send waited for
      go_out(r);
      if (h.sent.empty()) h.done = true;
      h.waiting = h.sent, h.sent.clear();
      return true;
    }
    if (!h.inputs_known) {  // op k's inputs (its pair's too), as run_schedule's `receive`
      h.inputs_known = true;
      if (h.k == 0 || !table[h.k - 1].with_next)
        for (size_t j = h.k; j <= h.k + table[h.k].with_next; j++) {
          const int g = at.chunks[r][table[j].chunk];
          const bool forward = table[j].kind == Phase::Forward;
          const int from = forward ? g - 1 : g + 1;
          const bool message = table[j].kind != Phase::Weight && at.elsewhere(from, r);
          h.inputs.push_back({forward ? 0 : 1, message ? at.rank[from] : -1});
        }
      return true;
    }
    if (!h.inputs.empty()) {  // the next input: the queued sends go out, then its receive
      auto [kind, peer] = h.inputs.front();
      h.inputs.erase(h.inputs.begin());
      std::vector<int> with = go_out(r);
      if (peer >= 0) {
        h.waiting.push_back(issue(r, kind, peer, false));
        if (wait_sends) h.waiting.insert(h.waiting.end(), with.begin(), with.end());
      }
      return true;
    }
    const PipelineOp& op = table[h.k];  // computed: its output queued
    const int g = at.chunks[r][op.chunk];
    if (op.kind == Phase::Forward && at.elsewhere(g + 1, r))
      h.queued.push_back({0, at.rank[g + 1]});
    if (op.kind == Phase::Backward && at.elsewhere(g - 1, r))
      h.queued.push_back({1, at.rank[g - 1]});
    h.k++, h.inputs_known = false;
    return true;
  };
  for (;;) {
    bool moved = false;
    for (int r = 0; r < p; r++) moved |= step_host(r);
    for (size_t st = 0; st < streams.size(); st++)  // two ops at their streams' heads meet
      while (head[st] < streams[st].size()) {
        Op& op = ops[streams[st][head[st]]];
        if (op.match < 0) break;
        Op& peer = ops[op.match];
        if (streams[peer.stream][head[peer.stream]] != op.match) break;
        op.done = peer.done = true;
        head[st]++, head[peer.stream]++, moved = true;
      }
    if (std::all_of(hosts.begin(), hosts.end(), [](const Host& h) { return h.done; })) return true;
    if (!moved) return false;
  }
}

TEST_CASE(
    "on NCCL's rules every schedule's messages arrive on the links; grouped with the receives, "
    "or on one stream, the interleaved and V schedules' sends wait for each other",
    "[pipeline]") {
  const std::vector<std::pair<PpSchedule, int>> rows = {
      {PpSchedule::AFAB, 1},        {PpSchedule::OneFOneB, 1},    {PpSchedule::ZeroBubbleH1, 1},
      {PpSchedule::Interleaved, 2}, {PpSchedule::Interleaved, 3}, {PpSchedule::ZeroBubbleV, 2},
      {PpSchedule::DualPipeV, 2}};
  std::set<PpSchedule> grouped_stuck, shared_stuck;
  for (auto [s, V] : rows)
    for (int p = 2; p <= 6; p++)
      for (int m = 1; m <= 3 * p; m++) {
        if (s == PpSchedule::Interleaved && m % p) continue;
        INFO(pp_schedule_name(s) << ", p " << p << ", m " << m << ", V " << V);
        REQUIRE(nccl_step_completes(s, p, m, V, true, false));
        if (!nccl_step_completes(s, p, m, V, true, true)) grouped_stuck.insert(s);
        if (!nccl_step_completes(s, p, m, V, false, false)) shared_stuck.insert(s);
      }
  // The model can fail: the two other ways deadlock where the book's reasoning says they must.
  for (PpSchedule s : {PpSchedule::Interleaved, PpSchedule::ZeroBubbleV, PpSchedule::DualPipeV}) {
    CHECK(grouped_stuck.count(s));
    CHECK(shared_stuck.count(s));
  }
}

// The streams of a pipeline over NCCL: the compute and communication streams, one per
// communicator, and a link for each way the run's messages travel to or from this rank, on pp and
// on pp_grad. Each needs a hardware queue (CUDA_DEVICE_MAX_CONNECTIONS).
TEST_CASE(
    "a pipeline over NCCL is refused fewer hardware queues than it makes streams, naming "
    "CUDA_DEVICE_MAX_CONNECTIONS and the fix",
    "[pipeline]") {
  using Catch::Matchers::Contains;
  CHECK(device_queue_shortage(nullptr, 8, 9).empty());  // unset: CUDA gets picoscale's 32
  CHECK(device_queue_shortage("1", 0, 9).empty());      // no pipeline, no link to wait on
  CHECK(device_queue_shortage("32", 8, 9).empty());     // the most: 2 + 9 + 8 = 19 streams
  CHECK(device_queue_shortage("8", 4, 2).empty());      // 2 + 2 + 4 = 8, one queue each
  CHECK_THAT(device_queue_shortage("7", 4, 2), Contains("CUDA_DEVICE_MAX_CONNECTIONS=7") &&
                                                   Contains("at least 8") &&
                                                   Contains("--comm mpi"));
  CHECK_THAT(device_queue_shortage("1", 8, 9), Contains("makes 19 streams"));  // Megatron's 1
  // With NCCL's two streams a communicator (and link) and its one a process: 4 + 3 (c + links).
  CHECK(device_queue_note("32", 0, 9).empty());  // no pipeline
  CHECK(device_queue_note("32", 4, 3).empty());  // 4 + 3 (3 + 4) = 25 <= 32
  CHECK_THAT(device_queue_note("32", 4, 7),      // 4 + 3 (7 + 4) = 37
             Contains("about 37 streams") && Contains("11 communicators and links") &&
                 Contains("32 hardware queues") && Contains("--comm mpi"));
  CHECK_THAT(device_queue_note("64", 8, 3), Contains("for 32 hardware queues"));  // CUDA's most
}

// The ways a schedule's activations travel (its placement, written out here from the Playbook's
// figures): Megatron's loop forward only, the interleaved loop round from the last rank to the
// first, a V down and back up. Each is a link on pp and, reversed, on pp_grad: a middle rank of
// a loop makes 4, of a V 8; without the pairs, comm_init makes every way to each neighbour.
TEST_CASE("a pipeline's links are the ways its placement sends, each rank's few", "[pipeline]") {
  using Pairs = PipelinePairs;
  CHECK(pipeline_messages(PpSchedule::OneFOneB, 1, 1).empty());
  CHECK(pipeline_messages(PpSchedule::OneFOneB, 2, 1) == Pairs{{0, 1}});
  CHECK(pipeline_messages(PpSchedule::AFAB, 4, 1) == Pairs{{0, 1}, {1, 2}, {2, 3}});
  CHECK(pipeline_messages(PpSchedule::ZeroBubbleH1, 3, 1) == Pairs{{0, 1}, {1, 2}});
  CHECK(pipeline_messages(PpSchedule::Interleaved, 2, 2) == Pairs{{0, 1}, {1, 0}});
  CHECK(pipeline_messages(PpSchedule::Interleaved, 4, 2) == Pairs{{0, 1}, {1, 2}, {2, 3}, {3, 0}});
  CHECK(pipeline_messages(PpSchedule::ZeroBubbleV, 4, 2) ==
        Pairs{{0, 1}, {1, 0}, {1, 2}, {2, 1}, {2, 3}, {3, 2}});
  CHECK(pipeline_messages(PpSchedule::DualPipeV, 2, 2) == Pairs{{0, 1}, {1, 0}});
  CHECK(neighbour_pairs(1).empty());
  CHECK(neighbour_pairs(2) == Pairs{{0, 1}, {1, 0}});
  CHECK(neighbour_pairs(3) == Pairs{{0, 1}, {0, 2}, {1, 0}, {1, 2}, {2, 0}, {2, 1}});
  CHECK(most_links(pipeline_messages(PpSchedule::OneFOneB, 2, 1), 2) == 2);
  CHECK(most_links(pipeline_messages(PpSchedule::OneFOneB, 4, 1), 4) == 4);
  CHECK(most_links(pipeline_messages(PpSchedule::Interleaved, 4, 2), 4) == 4);
  CHECK(most_links(pipeline_messages(PpSchedule::ZeroBubbleV, 4, 2), 4) == 8);
  CHECK(most_links(pipeline_messages(PpSchedule::DualPipeV, 2, 2), 2) == 4);
  CHECK(most_links(neighbour_pairs(2), 2) == 4);
  CHECK(most_links(neighbour_pairs(4), 4) == 8);
}

// The links' NCCL ids: each sender makes one id per way it sends, into its own slot to the next
// or the previous rank, and both ends of a link read the same slot. A slot made twice by one
// sender, or read where the sender wrote none, would join the wrong ranks, and NCCL's
// initialisation would then wait until --comm-timeout. Every schedule at p 2 to 6, and the
// default of every way to each neighbour.
TEST_CASE("both ends of every pipeline link agree on its NCCL id, each id made once",
          "[pipeline]") {
  for (int p = 2; p <= 6; p++) {
    std::vector<PipelinePairs> runs = {neighbour_pairs(p)};
    for (PpSchedule s : {PpSchedule::AFAB, PpSchedule::OneFOneB, PpSchedule::ZeroBubbleH1})
      runs.push_back(pipeline_messages(s, p, 1));
    for (int V : {2, 3}) runs.push_back(pipeline_messages(PpSchedule::Interleaved, p, V));
    for (PpSchedule s : {PpSchedule::ZeroBubbleV, PpSchedule::DualPipeV})
      runs.push_back(pipeline_messages(s, p, 2));
    for (const PipelinePairs& pairs : runs) {
      std::map<std::pair<int, int>, std::vector<int>> slots;  // (from, to) -> each end's slot
      std::map<int, int> made;                                // slot -> ids made there
      for (int r = 0; r < p; r++)
        for (const LinkPlan& l : link_plan(pairs, r, p)) {
          CHECK((l.from == r || l.to == r));
          slots[{l.from, l.to}].push_back(l.id_slot);
          if (l.from == r) made[l.id_slot]++;
          CHECK(l.id_slot / 2 == l.from);  // among the sender's ids
        }
      INFO("p " << p << ", " << pairs.size() << " pairs");
      CHECK(slots.size() == pairs.size());
      for (const auto& [pair, ends] : slots) {
        REQUIRE(ends.size() == 2);  // made by both of its ranks
        CHECK(ends[0] == ends[1]);  // the same id
        CHECK(made[ends[0]] == 1);  // which its sender made once, for it alone
      }
    }
  }
}

// Which groups share an NCCL communicator, for world rank 0 of a grid: each group's members
// worked out here from the rank order ((d * pp + p) * cp + c) * tp + t (runtime/comm.cuh's
// rank_of), in comm_init's group order and lanes (world -1; the gradients' 0; tp 1; cp 2; the
// pipeline's 3; ep 4). Returns the communicators rank 0 makes (its groups of more than one rank
// that use no earlier group's), and checks that a shared one is only ever within a lane (or the
// world's) and between the same ranks.
static int communicators_made(int dp, int pp, int cp, int tp, int ep) {
  // A group: the ranks whose coordinates equal rank 0's (all 0) outside `free`, ordered by key.
  auto group = [&](std::vector<char> free, auto key) {
    std::vector<std::pair<int, int>> found;
    for (int d = 0; d < dp; d++)
      for (int p = 0; p < pp; p++)
        for (int c = 0; c < cp; c++)
          for (int t = 0; t < tp; t++) {
            const int coords[4] = {d, p, c, t};
            bool in = true;
            for (int i = 0; i < 4; i++) in = in && (free[i] || coords[i] == 0);
            if (in && (free[4] || d % ep == 0) && (free[5] || d < ep))  // ep's blocks
              found.push_back({key(d, c, t, p), ((d * pp + p) * cp + c) * tp + t});
          }
    std::sort(found.begin(), found.end());
    std::vector<int> members;
    for (auto& f : found) members.push_back(f.second);
    return members;
  };
  auto rank = [&](int d, int c, int t, int p) { return ((d * pp + p) * cp + c) * tp + t; };
  auto by_d = [](int d, int, int, int) { return d; };
  auto by_dc = [&](int d, int c, int, int) { return d * cp + c; };
  // free: d, p, c, t, then "any dp rank in its ep block" and "any ep block".
  const std::vector<std::vector<int>> members = {
      group({1, 1, 1, 1, 1, 1}, rank),                                    // world
      group({0, 0, 0, 1, 1, 1}, [](int, int, int t, int) { return t; }),  // tp
      group({0, 0, 1, 0, 1, 1}, [](int, int c, int, int) { return c; }),  // cp
      group({0, 1, 0, 0, 1, 1}, [](int, int, int, int p) { return p; }),  // pp
      group({0, 1, 0, 0, 1, 1}, [](int, int, int, int p) { return p; }),  // pp_grad
      group({1, 0, 0, 0, 1, 1}, by_d),                                    // dp
      group({1, 0, 1, 0, 1, 1}, by_dc),                                   // dp_cp
      group({1, 0, 0, 0, 1, 0}, by_d),                                    // ep: its block
      group({1, 0, 1, 0, 0, 1}, by_dc)};  // edp_cp: rank 0's of each
  const std::vector<int> lanes = {-1, 1, 2, 3, 3, 0, 0, 4, 0};
  const std::vector<int> owner = communicator_owners(members, lanes);
  int made = 0;
  for (size_t i = 0; i < owner.size(); i++) {
    const int o = owner[i];
    CHECK(o <= (int)i);
    CHECK(members[o] == members[i]);
    CHECK((lanes[o] == lanes[i] || o == 0));  // within a lane, or the world's
    if (i != 0 && o == 0)                     // the world joins one lane only
      for (size_t j = 1; j < i; j++) CHECK((owner[j] != 0 || lanes[j] == lanes[i]));
    made += o == (int)i && members[i].size() > 1;
  }
  return made;
}

// Groups of the same ranks whose ops may queue together share a communicator: fewer NCCL
// streams, so that a pipeline with dp and tp (or cp) beside it stays within the GPU's 32
// hardware queues (the counts of device_queue_note above).
TEST_CASE("groups of the same ranks in one lane share an NCCL communicator", "[pipeline]") {
  CHECK(communicators_made(2, 1, 1, 1, 1) == 1);  // world = dp = dp_cp = edp_cp
  CHECK(communicators_made(1, 4, 1, 1, 1) == 1);  // world = pp = pp_grad
  CHECK(communicators_made(2, 2, 1, 1, 1) == 3);  // world, pp, dp
  CHECK(communicators_made(2, 2, 1, 2, 1) == 4);  // + tp
  CHECK(communicators_made(2, 2, 2, 1, 1) == 5);  // + cp, and dp_cp apart from dp
  CHECK(communicators_made(4, 1, 1, 1, 2) == 3);  // world = dp; ep's block; edp_cp
  CHECK(communicators_made(2, 1, 1, 1, 2) == 2);  // ep = dp = world, yet apart from the gradients
  CHECK(communicators_made(2, 2, 2, 2, 1) == 6);  // world, tp, cp, pp, dp, dp_cp
  CHECK(communicators_made(2, 4, 1, 2, 1) == 4);  // world, tp, pp, dp
  // With the links of the loop (4 at most a rank) and of the V (8 at p > 2):
  CHECK(device_queue_note("32", 4, communicators_made(2, 2, 1, 2, 1)).empty());   // 28
  CHECK(device_queue_note("32", 4, communicators_made(2, 4, 1, 2, 1)).empty());   // 28
  CHECK(device_queue_note("32", 8, communicators_made(1, 4, 1, 1, 1)).empty());   // 31
  CHECK(!device_queue_note("32", 8, communicators_made(2, 4, 1, 1, 1)).empty());  // 37
  CHECK(!device_queue_note("32", 4, communicators_made(2, 2, 2, 2, 1)).empty());  // 34, at V 2
}
