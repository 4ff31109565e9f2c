// ZeRO (Playbook §4): the shard layout and the book's memory formulas in-process ([zero]); what a
// run under mpirun measures against them, the traffic per step, checkpoints that move between
// stages and group sizes, and bad input ([parity]). Layouts train like one process: the ZeRO rows
// of PARITY_ROWS in test_parity.cu.
#include <catch2/catch.hpp>
#include <filesystem>
#include <regex>

#include "launch.cuh"
#include "model.cuh"
#include "zero.cuh"

namespace fs = std::filesystem;

// The parity matrix's model: 2 blocks, d_model 32, vocab 256.
static const std::string SMALL =
    "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 64 --seq 16 --mbs 2 --warmup 1 "
    "--grad-clip 0.5 --val-every 0 --val-seqs 4 --comm-timeout 60 ";
static ModelConfig small_config() {
  ModelConfig c = model_preset("tiny");
  c.d_model = 32, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 64, c.seq = 16;
  return c;
}

// Psi' = N * sum over units of ceil(numel / N): the parameters plus the shards' padding.
static int64_t padded_count(const Model& m, int N) {
  int64_t total = 0;
  for (const ModelUnit& u : m.units) total += N * ((u.numel + N - 1) / N);
  return total;
}

TEST_CASE("each unit splits into N equal shards that cover it exactly, padding < N per unit",
          "[zero]") {
  for (bool tied : {false, true}) {
    ModelConfig c = small_config();
    c.tie_embeddings = tied;
    Model m = build_model_layout(c);
    REQUIRE(m.units.size() == (size_t)c.layers + 2);
    for (int N = 1; N <= 8; N++) {
      std::vector<ShardLayout> ranks;
      for (int r = 0; r < N; r++) ranks.push_back(make_shard_layout(m, N, r));
      for (size_t u = 0; u < m.units.size(); u++) {
        int64_t covered = 0;
        for (int r = 0; r < N; r++) {
          const ShardLayout::Unit& U = ranks[r].units[u];
          REQUIRE(U.shard == ranks[0].units[u].shard);  // equal shards, as all-gather needs
          REQUIRE(U.valid == std::min(U.shard, std::max<int64_t>(0, U.numel - r * U.shard)));
          covered += U.valid;  // rank r's slice [r*S, r*S + valid): consecutive, disjoint
        }
        REQUIRE(covered == m.units[u].numel);
        REQUIRE(N * ranks[0].units[u].shard - m.units[u].numel < N);
      }
      REQUIRE(ranks[N - 1].padded_numel() == padded_count(m, N));
      REQUIRE(ranks[N - 1].shard_numel == ranks[0].shard_numel);
    }
  }
}

TEST_CASE("ZeRO memory per rank: the book's 7.5B example, 120 -> 31.4 -> 16.6 -> 1.9 GB",
          "[zero]") {
  // Playbook §4.1 with mixed precision (2 + 2 + k = 12 bytes per parameter), N_d = 64.
  BytesPerParameter mixed{2, 2, 12};
  double psi = 7.5e9, GB = 1e9;
  REQUIRE(zero_static_memory(0, psi, 64, mixed).total() / GB == Approx(120.0));
  REQUIRE(zero_static_memory(1, psi, 64, mixed).total() / GB == Approx(31.40625));
  REQUIRE(zero_static_memory(2, psi, 64, mixed).total() / GB == Approx(16.640625));
  REQUIRE(zero_static_memory(3, psi, 64, mixed).total() / GB == Approx(1.875));
  // The 8B model at DP = 8 (the book's chart, 2 + 2 + 8 bytes per parameter, in GiB): params
  // 15, grads 15, optimizer 60; ZeRO-1 shards the optimizer to 7.5, ZeRO-2 the grads to 1.875,
  // ZeRO-3 the params to 1.875.
  double GiB = 1024.0 * 1024 * 1024, psi8 = 7.5 * GiB;
  BytesPerParameter chart{2, 2, 8};
  StaticMemory s0 = zero_static_memory(0, psi8, 8, chart),
               s1 = zero_static_memory(1, psi8, 8, chart);
  StaticMemory s2 = zero_static_memory(2, psi8, 8, chart),
               s3 = zero_static_memory(3, psi8, 8, chart);
  REQUIRE(s0.params / GiB == 15.0);
  REQUIRE(s0.grads / GiB == 15.0);
  REQUIRE(s0.optimizer / GiB == 60.0);
  REQUIRE(s1.optimizer / GiB == 7.5);
  REQUIRE(s2.grads / GiB == 1.875);
  REQUIRE(s3.params / GiB == 1.875);
  // fp32 (this project's training): 16, 8 + 8/N, 4 + 12/N and 16/N bytes per parameter.
  REQUIRE(zero_static_memory(0, 1, 4).total() == 16);
  REQUIRE(zero_static_memory(1, 1, 4).total() == 8 + 8.0 / 4);
  REQUIRE(zero_static_memory(2, 1, 4).total() == 4 + 12.0 / 4);
  REQUIRE(zero_static_memory(3, 1, 4).total() == 16.0 / 4);
  // The formulas as the reports print them, and the bytes each precision keeps: mixed precision
  // stores 2 per weight and 12 for the master weight and Adam, at every stage.
  CHECK(zero_memory_formula(1) == "4Ψ + 4Ψ + 8Ψ/N");
  CHECK(zero_memory_formula(3) == "4Ψ/N + 4Ψ/N + 8Ψ/N");
  CHECK(zero_memory_formula(1, mixed) == "2Ψ + 2Ψ + 12Ψ/N");
  CHECK(zero_memory_formula(2, bytes_per_parameter(Precision::BF16, false)) == "2Ψ + 4Ψ/N + 12Ψ/N");
  CHECK(zero_memory_formula(0, bytes_per_parameter(Precision::BF16, true)) == "2Ψ + 2Ψ + 12Ψ");
  CHECK(zero_memory_formula(3, bytes_per_parameter(Precision::BF16, true)) ==
        "2Ψ/N + 2Ψ/N + 12Ψ/N");
  CHECK(zero_memory_formula(3, bytes_per_parameter(Precision::FP32, false)) ==
        "4Ψ/N + 4Ψ/N + 8Ψ/N");
}

// ----------------------------------------------------------------------------
// Runs of ./train under mpirun

// The "rank" rows of --report memory: rank -> {params, grads, optimizer} bytes.
static std::map<int, std::vector<int64_t>> memory_rows(const std::string& output) {
  std::map<int, std::vector<int64_t>> rows;
  std::regex row("\n  ([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) ");
  for (std::sregex_iterator it(output.begin(), output.end(), row), end; it != end; ++it)
    rows[std::stoi((*it)[1])] = {std::stoll((*it)[2]), std::stoll((*it)[3]), std::stoll((*it)[4])};
  return rows;
}

TEST_CASE("ZeRO-1, -2 and -3 hold 4Ψ+4Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N bytes per rank, padding named",
          "[parity]") {
  // dp 3 does not divide the units: each rank holds the formula at Psi' = Psi + padding, exactly.
  ModelConfig c = small_config();
  Model m = build_model_layout(c);
  int N = 3;
  int64_t psi = parameter_count(c), padded = padded_count(m, N), shard = padded / N;
  REQUIRE(padded > psi);
  for (int stage : {0, 1, 2, 3}) {
    RunResult r =
        run_train(SMALL + "--steps 1 --dp 3 --report memory --zero " + std::to_string(stage), 3);
    INFO("zero " << stage << "\n" << r.output);
    REQUIRE(r.code == 0);
    int64_t held = stage == 0 ? psi : padded;  // what a rank's full buffers hold
    std::vector<int64_t> want = {4 * (stage >= 3 ? shard : held), 4 * (stage >= 2 ? shard : held),
                                 8 * (stage >= 1 ? shard : held)};
    auto rows = memory_rows(r.output);
    REQUIRE(rows.size() == 3);
    for (auto& [rank, bytes] : rows) REQUIRE(bytes == want);
    REQUIRE_THAT(r.output, Catch::Contains("every rank holds exactly the formula's bytes"));
    if (stage > 0)
      REQUIRE_THAT(r.output, Catch::Contains("Ψ' = N x " + std::to_string(shard) + " = " +
                                             std::to_string(padded) + ", " +
                                             std::to_string(padded - psi) + " of them padding"));
  }
}

// The ZeRO section of --report comm: collective -> {calls, bytes} per step.
static std::map<std::string, std::pair<double, double>> zero_traffic(const std::string& output) {
  std::map<std::string, std::pair<double, double>> t;
  size_t at = output.find("ZeRO-");
  std::string section = at == std::string::npos ? "" : output.substr(at);
  std::regex row("\n  (reduce_scatter|all_gather) +([0-9.]+) +([0-9.]+) ");
  for (std::sregex_iterator it(section.begin(), section.end(), row), end; it != end; ++it)
    t[(*it)[1]] = {std::stod((*it)[2]), std::stod((*it)[3])};
  return t;
}

TEST_CASE(
    "bytes per step: ZeRO-1/2 send 2Ψ(N-1)/N x 4, ZeRO-3 3Ψ(N-1)/N x 4 less head and "
    "embedding, in 2L + 2 all-gathers per micro-batch",
    "[parity]") {
  // dp 4 divides every unit: no padding, so the book's formulas hold to the byte.
  ModelConfig c = small_config();
  Model m = build_model_layout(c);
  const int N = 4, L = c.layers;
  double psi = (double)parameter_count(c), per = 4.0 * (N - 1) / N;  // fp32 bytes, ring share
  REQUIRE(padded_count(m, N) == (int64_t)psi);
  double embed = (double)m.units.front().numel, head = (double)m.units.back().numel;
  std::string dir = make_temp_dir();
  for (int stage : {1, 2, 3}) {
    for (int acc : {1, 2}) {
      RunResult r =
          run_train(SMALL + "--steps 3 --dp 4 --report comm --zero " + std::to_string(stage) +
                        " --grad-acc " + std::to_string(acc) + " --trace " + dir + "/t.json",
                    N);
      INFO("zero " << stage << ", grad-acc " << acc << "\n" << r.output);
      REQUIRE(r.code == 0);
      auto t = zero_traffic(r.output);
      // Reduce-scatter: Psi(N-1)/N per step (ZeRO-1: on the last micro-batch only) or per
      // micro-batch (ZeRO-2/3: no full gradient survives a micro-batch); one call per unit.
      int reduces = stage == 1 ? 1 : acc;
      REQUIRE(t["reduce_scatter"].first == reduces * (L + 2));
      REQUIRE(t["reduce_scatter"].second == reduces * psi * per);
      if (stage < 3) {  // the weights once, after the step: 2 Psi(N-1)/N in all with acc 1
        REQUIRE(t["all_gather"].first == L + 2);
        REQUIRE(t["all_gather"].second == psi * per);
      } else {  // per micro-batch: forward every unit, backward the L blocks
        REQUIRE(t["all_gather"].first == acc * (2 * L + 2));
        REQUIRE(t["all_gather"].second == acc * (2 * psi - embed - head) * per);
      }
      if (stage == 3 && acc == 1)
        REQUIRE(t["reduce_scatter"].second + t["all_gather"].second ==
                (3 * psi - embed - head) * per);
      // The trace shows each of them on the communication track of every rank.
      nlohmann::json trace = nlohmann::json::parse(read_whole_file(dir + "/t.json"));
      std::map<int, int> gathers;
      for (auto& e : trace["traceEvents"])
        if (e["ph"] == "X" && e["tid"] == 1 &&
            e["name"].get<std::string>().rfind("all-gather", 0) == 0)
          gathers[e["pid"].get<int>()]++;
      for (int rank = 0; rank < N; rank++) REQUIRE(gathers[rank] == 3 * t["all_gather"].first);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("ZeRO-1, -2 and -3 take bitwise identical steps, and save byte-identical checkpoints",
          "[parity]") {
  // With one micro-batch every stage reduces the same gradients with the same reduce-scatter
  // and steps the same slices: only where the bytes live differs.
  std::string dir = make_temp_dir();
  for (int stage : {1, 2, 3})
    REQUIRE(run_train(SMALL + "--steps 3 --dp 3 --zero " + std::to_string(stage) + " --save " +
                          dir + "/z" + std::to_string(stage),
                      3)
                .code == 0);
  for (const char* file : {"/model.safetensors", "/optimizer.safetensors"}) {
    std::string one = read_whole_file(dir + "/z1" + file);
    REQUIRE(!one.empty());
    REQUIRE(read_whole_file(dir + "/z2" + file) == one);
    REQUIRE(read_whole_file(dir + "/z3" + file) == one);
  }
  fs::remove_all(dir);
}

// The safetensors header: u64 length, then the JSON that names every tensor, shape and offset.
static std::string header_of(const std::string& path) {
  std::string bytes = read_whole_file(path);
  uint64_t n = 0;
  memcpy(&n, bytes.data(), 8);
  return bytes.substr(0, 8 + n);
}

TEST_CASE("a ZeRO-3 checkpoint from dp 4 resumes at dp 2 under ZeRO-1 and in one process",
          "[parity]") {
  std::string dir = make_temp_dir();
  auto run = [&](const std::string& flags, int np) {
    RunResult r = run_train(SMALL + "--steps 6 " + flags, np);
    INFO(flags << "\n" << r.output);
    REQUIRE(r.code == 0);
  };
  run("--dp 4 --zero 3 --log-json " + dir + "/whole.jsonl --save " + dir + "/whole", 4);
  run("--dp 4 --zero 3 --stop-after 3 --save " + dir + "/half", 4);
  run("--grad-acc 4 --stop-after 3 --save " + dir + "/plain", 0);
  // The file is laid out exactly as an unsharded run's: same names, shapes, offsets, metadata.
  for (const char* file : {"/model.safetensors", "/optimizer.safetensors"})
    REQUIRE(header_of(dir + "/half" + file) == header_of(dir + "/plain" + file));
  // The same global batch of 8 sequences: dp 2 x grad-acc 2, or one process x grad-acc 4.
  run("--dp 2 --zero 1 --grad-acc 2 --load " + dir + "/half --log-json " + dir +
          "/resumed.jsonl --save " + dir + "/resumed",
      2);
  run("--grad-acc 4 --load " + dir + "/half --log-json " + dir + "/single.jsonl --save " + dir +
          "/single",
      0);
  auto whole = read_json_lines(dir + "/whole.jsonl");
  auto weights = read_f32_tensors(dir + "/whole/model.safetensors");
  REQUIRE(whole.size() == 6);
  for (const char* name : {"resumed", "single"}) {
    auto resumed = read_json_lines(dir + "/" + name + ".jsonl");
    REQUIRE(resumed.size() == 3);
    // Not bitwise: the resumed run sums each step's gradient in another order (over 2 ranks x 2
    // micro-batches, or 4 micro-batches, instead of 4 ranks), so fp32 rounding differs at ~1e-7;
    // the parity matrix's tolerances apply (1e-5 relative on losses, 1e-6 absolute on weights).
    for (int i = 0; i < 3; i++) {
      INFO(name << ", step " << i + 4);
      REQUIRE(resumed[i]["step"] == whole[i + 3]["step"]);
      REQUIRE(resumed[i]["loss"].get<double>() ==
              Approx(whole[i + 3]["loss"].get<double>()).epsilon(1e-5));
    }
    auto got = read_f32_tensors(dir + "/" + name + "/model.safetensors");
    REQUIRE(got.size() == weights.size());
    for (auto& [tensor, ref] : weights) {
      double diff = 0;
      for (size_t i = 0; i < ref.size(); i++)
        diff = std::max(diff, (double)std::abs(got[tensor][i] - ref[i]));
      INFO(name << " " << tensor << ": max diff " << diff);
      REQUIRE(diff <= 1e-6);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE(
    "--zero outside 0..3 exits with code 2 naming the flag; with one rank it warns and "
    "trains exactly as --zero 0",
    "[parity]") {
  for (const char* bad : {"4", "-1"}) {
    RunResult r = run_train(SMALL + "--steps 1 --dp 2 --zero " + bad, 2);
    INFO(r.output);
    REQUIRE(r.code == 2);
    REQUIRE(count_occurrences(r.output, std::string("--zero ") + bad + ": expected 0 (off)") == 1);
  }
  std::string dir = make_temp_dir();
  RunResult plain = run_train(SMALL + "--steps 2 --log-json " + dir + "/plain.jsonl");
  RunResult sharded = run_train(SMALL + "--steps 2 --zero 3 --log-json " + dir + "/zero.jsonl");
  INFO(sharded.output);
  REQUIRE(plain.code == 0);
  REQUIRE(sharded.code == 0);
  REQUIRE(count_occurrences(sharded.output,
                            "warning: --zero 3 has no effect with one "
                            "data-parallel rank") == 1);
  auto a = read_json_lines(dir + "/plain.jsonl"), b = read_json_lines(dir + "/zero.jsonl");
  REQUIRE(a.size() == 2);
  for (int i = 0; i < 2; i++) REQUIRE(b[i]["loss"].get<double>() == a[i]["loss"].get<double>());
  fs::remove_all(dir);
}
