// test_reports.cu: every report's columns against each other. A report prints what the run
// measured next to what the technique expects and what the book's formula says; a column that
// no test reads can be wrong for ever (an expected count that forgets grad-acc, a book row
// computed at the padded size). Each case reads the printed table back and checks: measured ==
// expected, expected == the book's formula as the test derives it, for every ZeRO stage,
// --dp-sync and grad-acc, with and without sequence parallelism, every schedule, both context-
// parallel splits. [reports][parity] (mpirun).
#include <catch2/catch.hpp>
#include <cmath>
#include <regex>

#include "launch.cuh"

using Catch::Matchers::Contains;

namespace {

// The parity matrix's model: 2 blocks, d_model 32, vocab 256. ZeRO's first unit is the
// embedding (8,192), its last the final norm with the head (32 + 8,192).
const std::string SMALL =
    "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 64 --seq 16 --mbs 2 --warmup 1 "
    "--val-every 0 --val-seqs 4 --steps 2 --comm-timeout 60 ";
const double kEmbed = 256 * 32, kHead = 32 + 256 * 32;

// The part of `out` from the line starting with `title` to the next line that does not start
// with two spaces.
std::string section(const std::string& out, const std::string& title) {
  size_t at = out.find(title);
  if (at == std::string::npos) return "";
  size_t end = at;
  do end = out.find('\n', end + 1);
  while (end != std::string::npos && out.compare(end + 1, 2, "  ") == 0);
  return out.substr(at, end == std::string::npos ? std::string::npos : end - at);
}
std::vector<std::smatch> rows(const std::string& text, const std::string& pattern) {
  std::vector<std::smatch> found;
  std::regex re(pattern);
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it)
    found.push_back(*it);
  return found;
}

}  // namespace

// ZeRO's table: per collective, calls and bytes measured | expected; the total; the book's
// 2Ψ(N-1)/N or 3Ψ(N-1)/N at Ψ and at Ψ' (padded). Stage 1 reduce-scatters once per step,
// stages 2 and 3 once per micro-batch; stage 3 gathers per micro-batch, all but the embedding
// and head twice.
TEST_CASE(
    "--report comm: ZeRO's measured calls and bytes equal its expected columns, and the "
    "expected total the book's formula, for stages 1, 2, 3 at grad-acc 1 and 2",
    "[reports][parity]") {
  for (int N : {2, 3})
    for (int stage : {1, 2, 3})
      for (int acc : {1, 2}) {
        if (N == 3 && acc == 1) continue;  // dp 3 pads the shards: once per stage is enough
        const std::string flags = SMALL + "--report comm --dp " + std::to_string(N) + " --zero " +
                                  std::to_string(stage) + " --grad-acc " + std::to_string(acc);
        RunResult r = run_train(flags, N);
        INFO(flags << "\n" << r.output);
        REQUIRE(r.code == 0);
        const std::string table = section(r.output, "ZeRO-" + std::to_string(stage) + " traffic");
        auto colls =
            rows(table, "\n  (reduce_scatter|all_gather) +([0-9.]+) +([0-9]+) +([0-9]+) +([0-9]+)");
        REQUIRE(colls.size() == 2);
        double expected_total = 0;
        for (const std::smatch& c : colls) {
          INFO(c[1]);
          CHECK(std::stod(c[2]) == std::stod(c[4]));  // calls
          CHECK(std::stod(c[3]) == std::stod(c[5]));  // bytes
          expected_total += std::stod(c[5]);
        }
        auto total = rows(table, "\n  total +([0-9]+) +([0-9]+)");
        REQUIRE(total.size() == 1);
        CHECK(std::stod(total[0][1]) == std::stod(total[0][2]));
        CHECK(std::stod(total[0][2]) == expected_total);
        auto book = rows(table, "= ([0-9.]+) bytes \\(Ψ = ([0-9]+)\\), ([0-9.]+) at Ψ'");
        REQUIRE(book.size() == 1);
        const double psi = std::stod(book[0][2]), at_psi = std::stod(book[0][1]);
        const double at_padded = std::stod(book[0][3]), share = (N - 1.0) / N;
        CHECK(at_psi == Approx((stage == 3 ? 3 : 2) * psi * share * 4).margin(0.006));
        CHECK(at_padded >= at_psi);
        // Ψ' from the book's own padded figure: what each expected count is made of.
        const double padded = at_padded / ((stage == 3 ? 3 : 2) * share * 4);
        double want = at_padded;  // stage 1: the book's 2Ψ'(N-1)/N, whatever grad-acc
        if (stage == 2) want += (acc - 1) * padded * share * 4;  // a reduce-scatter per micro-batch
        // The embedding and the head each padded to N shards, as every unit is.
        auto pad = [&](double n) { return N * std::ceil(n / N); };
        if (stage == 3) want = acc * (at_padded - (pad(kEmbed) + pad(kHead)) * share * 4);
        CHECK(expected_total == Approx(want).epsilon(1e-12));
      }
}

// Tensor parallelism's table: bytes measured and the model's count (times grad-acc) side by
// side, "(equal)" when they agree.
TEST_CASE(
    "--report comm: the tp table's measured bytes equal the model's count, with and without "
    "sp, at grad-acc 1 and 2",
    "[reports][parity]") {
  for (bool sp : {false, true})
    for (int acc : {1, 2}) {
      const std::string flags =
          SMALL + "--report comm --tp 2 --grad-acc " + std::to_string(acc) + (sp ? " --sp" : "");
      RunResult r = run_train(flags, 2);
      INFO(flags << "\n" << r.output);
      REQUIRE(r.code == 0);
      const std::string table = section(r.output, "tensor-parallel traffic per training step");
      auto colls = rows(table,
                        "\n  (all_reduce|all_gather|reduce_scatter) +[0-9.]+ calls +[0-9.]+ "
                        "elements, bytes +([0-9.]+ [KMG]?i?B), model's count +([0-9.]+ "
                        "[KMG]?i?B)( \\(equal\\))?");
      REQUIRE(colls.size() == 3);
      for (const std::smatch& c : colls) {
        INFO(c[0]);
        CHECK(c[2] == c[3]);
        CHECK(c[4] == " (equal)");
      }
    }
}

// The memory table: every rank's bytes, the book's formula at Ψ, the padding, and the formula at
// Ψ' each rank should hold; dp 3 pads the shards.
TEST_CASE(
    "--report memory: every rank's bytes equal the padded row, and the book's row is the "
    "formula at Ψ, for ZeRO-0 to 3",
    "[reports][parity]") {
  const int N = 3;
  for (int stage : {0, 1, 2, 3}) {
    const std::string flags = SMALL + "--report memory --dp 3 --zero " + std::to_string(stage);
    RunResult r = run_train(flags, N);
    INFO(flags << "\n" << r.output);
    REQUIRE(r.code == 0);
    const std::string table = section(r.output, "memory per rank (--report memory)");
    auto psi_row = rows(table, "Ψ = ([0-9]+) parameters");
    REQUIRE(psi_row.size() == 1);
    const double psi = std::stod(psi_row[0][1]);
    auto row = [&](const std::string& label) {
      auto found = rows(table, "\n  " + label + " +([0-9.]+) +([0-9.]+) +([0-9.]+) +([0-9.]+)");
      REQUIRE(found.size() == 1);
      std::vector<double> v;
      for (int i = 1; i <= 4; i++) v.push_back(std::stod(found[0][i]));
      return v;
    };
    const std::vector<double> book = row("book");
    CHECK(book[0] == Approx(4 * psi / (stage >= 3 ? N : 1)));
    CHECK(book[1] == Approx(4 * psi / (stage >= 2 ? N : 1)));
    CHECK(book[2] == Approx(8 * psi / (stage >= 1 ? N : 1)));
    CHECK(book[3] == Approx(book[0] + book[1] + book[2]));
    std::vector<double> padded = book;
    if (stage > 0) {
      padded = row("= padded");
      const std::vector<double> padding = row("\\+ padding");
      for (int i = 0; i < 4; i++) CHECK(book[i] + padding[i] == Approx(padded[i]));
    }
    auto ranks = rows(table, "\n  ([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) ");
    REQUIRE(ranks.size() == N);
    for (const std::smatch& rank : ranks)
      for (int i = 0; i < 4; i++) CHECK(std::stod(rank[i + 2]) == padded[i]);
    CHECK_THAT(table, Contains(": yes"));
    // The activations of one block: measured and formula.
    CHECK_THAT(r.output, Contains(", equal\n"));
  }
}

// The bubble table: per stage the idle share of the schedule's tables in ticks, the book's
// formula, and the micro-batches in flight measured from the memory next to the tables'.
TEST_CASE(
    "--report bubble: the tables' idle ticks equal the book's formula for every schedule, "
    "and the activations in flight the tables' count",
    "[reports][parity]") {
  struct Case {
    std::string flags;
    int np;
    double book;  // (p-1)/(m+p-1), (p-1)/(Vm+p-1), zb-h1 (p-1)/(3m+p-1), the V's
    // The stage whose in-flight count is not compared (-1: none): the one whose chunk holds the
    // head's logits beside other chunks, so that its activations are not a whole number of
    // equal chunks (interleaved's last stage, the V's first).
    int head_beside = -1;
  } cases[] = {
      {"--pp 2 --grad-acc 4 --pp-schedule afab", 2, 1.0 / 5},
      {"--pp 2 --grad-acc 4 --pp-schedule 1f1b", 2, 1.0 / 5},
      {"--pp 2 --grad-acc 4 --pp-schedule zb-h1", 2, 1.0 / 13},
      {"--pp 4 --layers 4 --grad-acc 8 --pp-schedule 1f1b", 4, 3.0 / 11},
      {"--pp 2 --layers 4 --grad-acc 4 --pp-schedule interleaved --pp-virtual 2", 2, 1.0 / 9, 1},
      // The V: zb-v (p-1)/(6m+p-1), dualpipev DeepSeek's 2(p-1) of 6m + 2(p-1) ticks.
      {"--pp 2 --layers 4 --grad-acc 4 --pp-schedule zb-v --pp-virtual 2", 2, 1.0 / 25, 0},
      {"--pp 2 --layers 4 --grad-acc 4 --pp-schedule dualpipev --pp-virtual 2", 2, 1.0 / 13, 0},
      {"--pp 4 --layers 8 --grad-acc 8 --pp-schedule zb-v --pp-virtual 2", 4, 3.0 / 51, 0},
  };
  for (const Case& c : cases) {
    RunResult r = run_train(SMALL + "--report bubble " + c.flags, c.np);
    INFO(c.flags << "\n" << r.output);
    REQUIRE(r.code == 0);
    const std::string table = section(r.output, "pipeline bubble (--report bubble");
    auto stages = rows(table,
                       "\n +([0-9]+) +[0-9.]+ +[0-9.]+ +[0-9.]+% +([0-9.]+)% +([0-9.]+)% "
                       "+([0-9]+) \\(tables: ([0-9]+)\\)");
    REQUIRE((int)stages.size() == c.np);
    for (const std::smatch& s : stages) {
      INFO("stage " << s[1]);
      CHECK(std::stod(s[2]) == std::stod(s[3]));  // ticks == book, as printed
      CHECK(std::stod(s[3]) == Approx(100 * c.book).margin(0.05));
      if (std::stoi(s[1]) != c.head_beside) CHECK(s[4] == s[5]);  // measured == tables
    }
  }
}

// The data-parallel lines of --report comm: rank 0's measured all-reduce (or, --dp-sync ring,
// its own send_recv) next to the book's ring all-reduce 2(N-1)K/N. Gradient accumulation
// reduces once per step, after the last micro-batch, so nothing in the table scales with
// grad-acc. The model's 21 parameter tensors (2 blocks of 9, embedding, final norm, head) fit
// one 25 MiB bucket.
TEST_CASE(
    "--report comm: data parallelism's measured bytes equal the book's 2(N-1)K/N, once per "
    "step at grad-acc 1 and 2, for each --dp-sync",
    "[reports][parity]") {
  // "182.17 KiB" as bytes; the printed value is rounded to 0.01 of its unit.
  auto bytes_of = [](const std::string& size, const std::string& unit) {
    return std::stod(size) * (unit == "KiB" ? 1024.0 : unit == "MiB" ? 1048576.0 : 1.0);
  };
  for (int N : {2, 3})
    for (const char* sync : {"naive", "bucket", "ring"})
      for (int acc : {1, 2}) {
        const std::string flags = SMALL + "--report comm --dp " + std::to_string(N) +
                                  " --dp-sync " + sync + " --grad-acc " + std::to_string(acc);
        RunResult r = run_train(flags, N);
        INFO(flags << "\n" << r.output);
        REQUIRE(r.code == 0);
        const std::string table = section(r.output, "communication per step (--report comm");
        auto psi = rows(table, "K = 4 bytes x ([0-9]+) parameters");
        REQUIRE(psi.size() == 1);
        const double K = 4 * std::stod(psi[0][1]);
        auto book = rows(table, "ring all-reduce 2\\(N-1\\)K/N = ([0-9.]+) (B|KiB|MiB) per rank");
        REQUIRE(book.size() == 1);
        const double ring = 2.0 * (N - 1) * K / N;
        CHECK(bytes_of(book[0][1], book[0][2]) == Approx(ring).margin(0.005 * 1024));
        const bool own_ring = std::string(sync) == "ring";
        auto measured = rows(table, "\n  dp_cp +" + std::to_string(N) +
                                        " +(all_reduce|send_recv) +"
                                        "([0-9.]+) +([0-9.]+) +([0-9.]+) (B|KiB|MiB) ");
        REQUIRE(measured.size() == 1);
        const std::smatch& m = measured[0];
        CHECK(m[1] == (own_ring ? "send_recv" : "all_reduce"));
        // Calls per step: one per tensor (naive), one per bucket, or the ring's 2(N-1) sends.
        CHECK(std::stod(m[2]) == (std::string(sync) == "naive" ? 21 : own_ring ? 2 * (N - 1) : 1));
        // Elements: every parameter once, or the ring's 2(N-1) chunks of K/N elements (a chunk
        // of whole elements: one more or less per send).
        if (own_ring)
          CHECK(std::stod(m[3]) == Approx(ring / 4).margin(std::stod(m[2])));
        else
          CHECK(std::stod(m[3]) == K / 4);
        // Bytes: the same 2(N-1)K/N, but for whole elements: a call's share is floored (a byte
        // at most), a ring chunk may hold one element more or less (4 bytes per send).
        const double slack = 4.0 * std::stod(m[2]) + 0.005 * 1024;
        CHECK(bytes_of(m[4], m[5]) == Approx(ring).margin(slack));
      }
}

// --report balance: per cp rank the attention blocks computed in a step and the causal (q, k)
// pairs, against the book's §7.3 counts, derived here. Contiguous chunks of c = T/cp tokens:
// rank r computes r + 1 blocks, r·c² + c(c+1)/2 pairs. Zig-zag, 2cp chunks of h = T/(2cp):
// rank r holds chunks r and 2cp-1-r, so 2cp + 1 blocks and (2cp-1)h² + h(h+1) pairs on every
// rank. Per layer and micro-batch; summed over 2 layers and grad-acc micro-batches.
TEST_CASE(
    "--report balance: every cp rank's blocks and pairs are the book's causal counts, "
    "contiguous and zig-zag, at grad-acc 1 and 2",
    "[reports][parity]") {
  const int cp = 4, T = 32, layers = 2;
  for (const char* split : {"contiguous", "zigzag"})
    for (int acc : {1, 2}) {
      const std::string flags = SMALL + "--seq 32 --report balance --cp 4 --cp-balance " + split +
                                " --grad-acc " + std::to_string(acc);
      RunResult r = run_train(flags, cp);
      INFO(flags << "\n" << r.output);
      REQUIRE(r.code == 0);
      const std::string table = section(r.output, "attention work per cp rank");
      auto ranks = rows(table, "\n +([0-9]+) +([0-9.]+) +([0-9]+) +[0-9.]+");
      REQUIRE((int)ranks.size() == cp);
      for (const std::smatch& row : ranks) {
        const int rank = std::stoi(row[1]);
        INFO("cp rank " << rank);
        double blocks, pairs;
        if (std::string(split) == "contiguous") {
          const double c = T / cp;
          blocks = rank + 1, pairs = rank * c * c + c * (c + 1) / 2;
        } else {
          const double h = T / (2 * cp);
          blocks = 2 * cp + 1, pairs = (2 * cp - 1) * h * h + h * (h + 1);
        }
        CHECK(std::stod(row[2]) == blocks * layers * acc);
        CHECK(std::stod(row[3]) == pairs * layers * acc);
      }
    }
}
