// The meta device (DESIGN 3): the real code path without storage or arithmetic. Its reports are
// the CPU run's (the memory each rank holds, the traffic of every group), its FLOPs the closed
// form, one process stands for any rank of a simulated world, and what it cannot do is refused.
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "launch.cuh"
#include "parity_rows.cuh"

namespace {

// What a run printed after its last step line (its val loss): the reports, less the book's
// closed forms a meta run adds to its memory report.
std::vector<std::string> report_lines(const std::string& output) {
  std::vector<std::string> lines;
  bool book = false;
  size_t start = 0;
  for (size_t at = 0; (at = output.find("\nstep ", at)) != std::string::npos; at++)
    start = output.find('\n', at + 1) + 1;
  for (size_t at = start; at < output.size();) {
    size_t end = output.find('\n', at);
    if (end == std::string::npos) end = output.size();
    const std::string line = output.substr(at, end - at);
    at = end + 1;
    if (line.rfind("the book's closed forms", 0) == 0)
      book = true;
    else if (line.rfind("  ", 0) != 0)
      book = false;
    // The device arena's reserved bytes: meta and CUDA only (the CPU allocates from the host).
    if (!book && line.rfind("  reserved ", 0) != 0) lines.push_back(line);
  }
  return lines;
}

// The number a meta run of `args` prints in `pattern`'s one group (the run must succeed).
double printed(const std::string& args, const std::string& pattern) {
  RunResult r = run_train("--device meta " + args);
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex(pattern)));
  return std::stod(m[1]);
}

// "68.24 MiB" in bytes.
double parse_bytes(const std::string& text) {
  std::smatch m;
  static const std::regex amount("([0-9.]+) (B|KiB|MiB|GiB|TiB)");
  REQUIRE(std::regex_search(text, m, amount));
  const std::string units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double scale = 1;
  for (const std::string& u : units) {
    if (m[2] == u) break;
    scale *= 1024;
  }
  return std::stod(m[1]) * scale;
}

// Two report lines that must agree: equal, or, for the lines that hold a peak of activations,
// equal but for it, within 1% (the meta device allocates what the CUDA path would, whose
// transient buffers may differ from the CPU loops'); workspace peaks are not compared (the CPU
// loops' per-thread tiles are not the kernels' buffers).
// `routed`: a mixture's, whose routing decides its all-to-all bytes and the activations kept.
void require_same_report_line(const std::string& cpu, const std::string& meta,
                              bool routed = false) {
  INFO("cpu:  " << cpu << "\nmeta: " << meta);
  if (cpu == meta) return;
  if (routed &&
      (cpu.find("all_to_all") != std::string::npos || cpu.find("measured") != std::string::npos))
    return;
  static const std::regex rank_row(
      "^  ([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+) +([0-9]+)   ([0-9.]+ [KMGT]?i?B), .*$");
  static const std::regex summary("^  (activations|workspace) +([0-9.]+ [KMGT]?i?B) / (.*)$");
  std::smatch a, b;
  if (std::regex_match(cpu, a, rank_row) && std::regex_match(meta, b, rank_row)) {
    for (int i = 1; i <= 5; i++) REQUIRE(a[i] == b[i]);  // rank and static bytes: exact
    if (!routed) REQUIRE(parse_bytes(b[6]) == Approx(parse_bytes(a[6])).epsilon(0.01));
    return;
  }
  if (std::regex_match(cpu, a, summary) && std::regex_match(meta, b, summary)) {
    REQUIRE(a[1] == b[1]);
    if (a[1] == "workspace" || routed) return;
    REQUIRE(parse_bytes(b[2]) == Approx(parse_bytes(a[2])).epsilon(0.01));
    REQUIRE(a[3] == b[3]);
    return;
  }
  FAIL("the meta run's report line differs from the CPU run's");
}

const std::string kReports = " --dtype fp32 --steps 2 --report memory,comm";

}  // namespace

// Every layout of the parity matrix, on the same ranks: what --report memory and --report comm
// print after the steps must be the CPU run's. Under a mixture of experts the routing is
// data-dependent on CPU and uniform on meta, so the experts' all-to-all bytes and the
// activations they keep are left out there (the static memory and every other group's traffic
// are still compared).
TEST_CASE("the meta device reports every parity layout's memory and traffic as the CPU run does",
          "[parity]") {
  for (const ParityRow& row : PARITY_ROWS) {
    const bool mixture = row.layout.find("--experts") != std::string::npos;
    RunResult cpu = run_train(COMMON + row.layout + kReports, row.ranks);
    // --comm mpi: the CPU run's backend (a pipeline keeps its sends until the step ends).
    RunResult meta =
        run_train(COMMON + row.layout + kReports + " --device meta --comm mpi", row.ranks);
    INFO(row.name << "\ncpu:\n" << cpu.output << "\nmeta:\n" << meta.output);
    REQUIRE(cpu.code == 0);
    REQUIRE(meta.code == 0);
    REQUIRE_THAT(meta.output, Catch::Contains("loss - |"));  // nothing computed, nothing shown
    std::vector<std::string> a = report_lines(cpu.output), b = report_lines(meta.output);
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); i++) require_same_report_line(a[i], b[i], mixture);
  }
}

// The roofline's table and its GEMMs by shape (from "  category" to the table's end), each line
// cut to its first 7 words: a category's calls, launches, GFLOP, GB, FLOP/B and predicted ms (a
// GEMM shape's M, N, K, unit, calls, GFLOP and predicted ms), not the times a CPU run measured.
static std::vector<std::string> counted_lines(const std::string& output) {
  std::vector<std::string> lines;
  const size_t start = output.find("\n  category ");
  if (start == std::string::npos) return lines;
  std::istringstream in(output.substr(start + 1));
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("  measured", 0) == 0 || line.rfind("  the meta device", 0) == 0 ||
        line.rfind("  ", 0) != 0)
      break;
    std::istringstream words(line);
    std::string word, cut;
    for (int i = 0; i < 7 && words >> word; i++) cut += word + " ";
    lines.push_back(cut);
  }
  return lines;
}

// The meta device counts the step the real code path runs: on CPU ranks in fp32 (the CPU's
// arithmetic is then the GPU path's: no format is emulated) the ledger holds the same ops, with
// the same FLOPs and bytes, as the meta run of the same layout, priced on one profile. Without
// clipping, whose scale runs only when the norm (which meta does not compute) exceeds the limit;
// a mixture's routing is data-dependent, so it is not here.
TEST_CASE("a CPU step's ledger is the meta step's, op for op, in fp32", "[train]") {
  const std::vector<std::pair<int, std::string>> layouts = {
      {0, ""},
      {0, "--grad-acc 2 --recompute full --attention naive"},
      {0, "--norm layernorm --mlp gelu --dropout 0.1 --grad-acc 2"},
      {2, "--dp 2 --zero 3"},
      {2, "--tp 2 --sp"},
      {2, "--pp 2 --grad-acc 4"},
      {2, "--cp 2"},
      {4, "--cp 2 --tp 2 --sp --cp-comm allgather"},
  };
  const std::string flags =
      COMMON + "--dtype fp32 --grad-clip 0 --steps 2 --report roofline --gpu h100 ";
  for (const auto& [ranks, layout] : layouts) {
    RunResult cpu = run_train(flags + layout, ranks);
    RunResult meta = run_train(flags + layout + " --device meta --comm mpi", ranks);
    INFO(layout << "\ncpu:\n" << cpu.output << "\nmeta:\n" << meta.output);
    REQUIRE(cpu.code == 0);
    REQUIRE(meta.code == 0);
    const std::vector<std::string> a = counted_lines(cpu.output), b = counted_lines(meta.output);
    REQUIRE(a.size() > 10);  // the table, the step, the GEMMs by shape
    REQUIRE(a == b);
  }
}

// The ledger's FLOPs against the closed form, written out here for the tiny model (one process,
// fp32): every linear layer costs 2 FLOPs per weight and token forward and 4 backward (input and
// weight gradients), and full recomputation runs the blocks' forward once more; attention's causal
// core costs 4 per visible (query, key) pair, head and head dimension forward (QK^T, then PV) and
// 10 backward (S again, dP, dV, dQ, dK), and the backward's rowsum(dO o O) 2 per query element.
TEST_CASE("a meta step counts the closed form's FLOPs for the GEMMs and the attention", "[train]") {
  const double D = 64, L = 2, H = 4, KV = 2, F = 128, V = 256, T = 32, B = 2, acc = 2;
  const double hd = D / H;
  const double blocks = L * (D * D + 2 * D * KV * hd + D * D + 3 * D * F), head = D * V;
  const double tokens = B * T * acc, pairs = B * T * (T + 1) / 2 * acc * H * L;
  for (std::string recompute : {"none", "full"}) {
    RunResult r = run_train(
        "--device meta --dtype fp32 --d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 "
        "--seq 32 --mbs 2 --grad-acc 2 --steps 2 --val-every 0 --report roofline --recompute " +
        recompute);
    INFO(r.output);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m,
                              std::regex("GEMMs ([0-9]+), attention ([0-9]+); the book's")));
    const double forwards = recompute == "full" ? 2 : 1;
    // Exact: integer counts far below 2^53.
    // The head is not recomputed: only the blocks run forward again.
    REQUIRE(std::stod(m[1]) == ((2 * forwards + 4) * blocks + 6 * head) * tokens);
    // Plus the backward's D = rowsum(dO o O): 2 per query, head and head dimension.
    REQUIRE(std::stod(m[2]) == (4 * forwards + 10) * pairs * hd + 2 * tokens * H * hd * L);
  }
}

// The arena (runtime/core.cu): device buffers freed on a stream are reused by the next
// allocation of their size there, so a step after the first calls the device's allocator
// nowhere (as PyTorch's caching allocator gives). Counted on meta as CUDA would call it: a
// dense and a mixture model, bf16 and fp32, recomputation, a pipeline rank of a simulated world.
// The first step's count shows the counter counts.
TEST_CASE("after the first step, a step makes no device allocator call", "[train]") {
  const std::string model =
      "--device meta --model llama-1b --layers 2 --seq 256 --steps 3 "
      "--val-every 0 --report sync ";
  for (const std::string& flags :
       {std::string("--dtype bf16"), std::string("--dtype fp32 --recompute full --grad-acc 2"),
        std::string("--dtype bf16 --experts 4 --top-k 2 --grad-acc 2"),
        std::string("--dtype bf16 --pp 2 --grad-acc 4 --untie-embeddings --simulate-world 2 "
                    "--simulate-rank 1")}) {
    RunResult r = run_train(model + flags);
    INFO(flags << "\n" << r.output);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(
        r.output, m,
        std::regex("device allocator calls: ([0-9]+) in the first training step, ([0-9]+) per")));
    CHECK(std::stoll(m[1]) > 10);  // activations, workspaces: the arena fills
    CHECK(std::stoll(m[2]) == 0);
  }
}

// The kernels a llama block launches per micro-batch on the CUDA path under bf16, counted on
// meta as the difference between 4 and 2 blocks, against the list of what the step runs (the
// GPU step's budget: at most 30 a block). Forward: the attention norm (fused with the last
// block's residual add), q and the batched k, v GEMMs, RoPE on q and k, attention, o, the
// residual add fused with the MLP's norm, the batched gate, up GEMMs, SwiGLU, down: 10.
// Backward: down's two GEMMs, SwiGLU, the batched gate, up weight gradients and their two input
// gradients, the MLP norm (two kernels: dx with the partial column sums, then their sum), o's
// two GEMMs, D = rowsum(dO o O) clearing dq, dk, dv, attention, RoPE on dq and dk rounding dv,
// q's and the batched k, v weight gradients, three input gradients, the attention norm (two):
// 20. A fusion undone, or an op added, shows here.
TEST_CASE("a llama block launches 30 kernels per micro-batch under bf16", "[train]") {
  auto launches = [](int layers) {
    RunResult r = run_train(
        "--device meta --model llama-1b --dtype bf16 --seq 256 --steps 1 --val-every 0 "
        "--report roofline --layers " +
        std::to_string(layers));
    INFO(r.output);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex("launches per micro-batch: ([0-9]+)")));
    return std::stoll(m[1]);
  };
  const int64_t forward = 10, backward = 20;
  CHECK((launches(4) - launches(2)) / 2 == forward + backward);
}

// --residual-dtype bf16 on the ledger: per block and micro-batch of N tokens, the two fused
// add + norms read a and write the sum in 2 bytes rather than 4 (4 N D less each), and the two
// norm backwards read x and dx and write dx in 2 bytes, with no rounded copy of dx beside it
// (4 N D + 4 N D less each): 24 N D bytes a block, counted from the closed form. The difference
// of 4 and 2 blocks leaves out the embedding, the final norm and the head.
TEST_CASE("a bf16 residual stream moves 24 N D fewer bytes per block through the norms",
          "[train]") {
  auto norm_gb = [](int layers, const std::string& residual) {
    return printed(
        "--model llama-1b --dtype bf16 --seq 256 --mbs 2 --steps 1 --val-every 0 "
        "--report roofline --residual-dtype " +
            residual + " --layers " + std::to_string(layers),
        // category calls launches GFLOP "GB moved" ...
        "\\n  norm +[0-9]+ +[0-9]+ +[0-9.]+ +([0-9.]+)");
  };
  const double N = 2 * 256, D = 2048, blocks = 2;
  const double saved =
      (norm_gb(4, "fp32") - norm_gb(2, "fp32")) - (norm_gb(4, "bf16") - norm_gb(2, "bf16"));
  // The report prints GB to 4 decimals: four readings, each within 5e-5 GB.
  CHECK(saved == Approx(blocks * 24 * N * D / 1e9).margin(2e-4));
}

// A mixture under bf16 on the ledger: the experts' inputs, gate, up and SwiGLU output are kept
// in bf16, which their GEMMs and SwiGLU read and write, so no cast moves an [R, F] tensor; the
// rows travel in bf16 too, so the expert's output and its input gradient are written in bf16 by
// their GEMMs (no rounding pass: 0), and the routing weights' gradient reads the expert's output
// as it came back, in bf16 (no widening: 0). What a block casts per dispatched row is D values:
// the output's gradient rounded before it leaves for the GEMMs (4 + 2): 6 D bytes a row (12 D
// when the output was widened before the backward, 2 + 4 more; 42 D with fp32 rows: the output
// and the two input-gradient GEMMs' sums rounded, 3 x 8, and the output stored in bf16, 4 + 2,
// and widened, 2 + 4). Top-2 routes N more rows than top-1; the difference of 4 and 2 blocks
// leaves out the embedding and the head.
TEST_CASE("a mixture's experts keep bf16 between their GEMMs: 6 D cast bytes a routed row",
          "[train]") {
  auto cast_gb = [](int layers, int top_k) {
    return printed("--model llama-1b --experts 4 --top-k " + std::to_string(top_k) +
                       " --dtype bf16 --seq 256 --mbs 2 --steps 1 --val-every 0 --report roofline "
                       "--layers " +
                       std::to_string(layers),
                   // category calls launches GFLOP "GB moved" ...
                   "\\n  cast +[0-9]+ +[0-9]+ +[0-9.]+ +([0-9.]+)");
  };
  const double N = 2 * 256, D = 2048, blocks = 2;
  const double per_n_rows = (cast_gb(4, 2) - cast_gb(2, 2)) - (cast_gb(4, 1) - cast_gb(2, 1));
  // The report prints GB to 4 decimals: four readings, each within 5e-5 GB.
  CHECK(per_n_rows == Approx(blocks * 6 * N * D / 1e9).margin(2e-4));
}

// The rows a mixture's all-to-alls move travel in the compute format: 2 bytes a value under
// bf16, 4 under fp32. The meta device routes token t to experts 2t, 2t + 1 (mod 4) at top 2,
// so with 2 experts a rank (ep 2) the odd tokens' rows leave rank 0 and half of all rows cross:
// N k (ep - 1) / ep rows, D values each, per pass (dispatch, combine), forward and backward, per
// block. 2 blocks, N = 2 x 256 tokens, D = 2048.
TEST_CASE("a mixture's rows cross in bf16 under --dtype bf16: half the all-to-all bytes",
          "[train]") {
  auto sent = [](const std::string& dtype) {
    return printed(
        "--model llama-1b --experts 4 --top-k 2 --layers 2 --dp 2 --ep 2 "
        "--simulate-world 2 --seq 256 --mbs 2 --steps 1 --val-every 0 --report comm "
        "--dtype " +
            dtype,
        "\\n  measured +([0-9]+) bytes in");
  };
  const double N = 2 * 256, k = 2, ep = 2, D = 2048, blocks = 2;
  const double rows =
      blocks * 2 /* forward, backward */ * 2 /* dispatch, combine */ * N * k * (ep - 1) / ep;
  CHECK(sent("fp32") == rows * D * 4);
  CHECK(sent("bf16") == rows * D * 2);
}

// And between pipeline stages the hidden state travels in the stream's format: rank 0 of pp 2
// sends each micro-batch's [seq, D] forward (4 training micro-batches and one validation
// sequence of 2,048 tokens), 2 bytes an element with the bf16 stream, 4 with the fp32 one.
TEST_CASE("a bf16 residual stream halves the pipeline's messages", "[train]") {
  auto pp_mib = [](const std::string& residual) {
    return printed(
        "--model llama-1b --untie-embeddings --dtype bf16 --pp 2 --grad-acc 4 --mbs 1 "
        "--simulate-world 2 --steps 1 --val-seqs 1 --report comm --residual-dtype " +
            residual,
        "\\n  pp +2 +send_recv +[0-9.]+ +[0-9.]+ +([0-9.]+) MiB");
  };
  const double sent = 5.0 * 2048 * 2048;  // elements: five micro-batches of [2048, 2048]
  CHECK(pp_mib("fp32") == Approx(4 * sent / (1 << 20)));
  CHECK(pp_mib("bf16") == Approx(2 * sent / (1 << 20)));
}

// Ring attention under --dtype bf16 runs its blocks on the tensor cores, as one process's
// FlashAttention does: zig-zag gives each of 2 ranks half the causal (query, key) pairs, so half
// the attention time, plus the merges and D (streaming ops, under a tenth of it at this length):
// between 0.45 and 0.6 of one process's (blocks in fp32, on CUDA cores, take several times one
// process's whole attention), and MFU within 10% of one process's.
TEST_CASE("ring attention in bf16 runs on the tensor cores: half the attention time at cp 2",
          "[train]") {
  auto run = [](int cp, const std::string& pattern) {
    return printed(
        "--dtype bf16 --d-model 1024 --layers 2 --heads 16 --kv-heads 4 --ffn 4096 "
        "--seq 8192 --steps 1 --val-every 0 --gpu h100 --report roofline --cp " +
            std::to_string(cp) + " --simulate-world " + std::to_string(cp),
        pattern);
  };
  const std::string attention_ms =
      "\\n  attention +[0-9]+ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +([0-9.]+)";
  const std::string mfu = "with it all hidden behind compute, MFU ([0-9.]+)%";
  const double ratio = run(2, attention_ms) / run(1, attention_ms);
  CHECK(ratio >= 0.45);
  CHECK(ratio <= 0.6);
  CHECK(run(2, mfu) >= 0.9 * run(1, mfu));
}

// What the ring sends (Playbook §7.2), by closed form: each forward passes the keys and values
// (kv = 2 N Hkv hd elements, N local tokens) cp - 1 times in the blocks' format (e bytes: 2 under
// bf16), each backward passes them again with their fp32 gradient sums cp - 1 times and the
// sums once more: per layer, forwards x (cp - 1) kv e + backwards x ((cp - 1) kv (e + 4) + 4 kv).
// One training and one validation forward, one backward; 2 layers, cp 2.
TEST_CASE("the ring sends keys and values in the blocks' format: half the bytes under bf16",
          "[train]") {
  const double kv = 2.0 * (2 * 1024 / 2) * 2 * 64, cp = 2, layers = 2;
  for (auto [dtype, e] : {std::pair<std::string, double>{"bf16", 2}, {"fp32", 4}}) {
    INFO("--dtype " << dtype);
    const double bytes = layers * (2 * (cp - 1) * kv * e + (cp - 1) * kv * (e + 4) + 4 * kv);
    CHECK(printed("--dtype " + dtype +
                      " --d-model 256 --layers 2 --heads 4 --kv-heads 2 --ffn 512 --seq 1024 "
                      "--mbs 2 --steps 1 --val-seqs 2 --cp 2 --simulate-world 2 --report comm",
                  "\\n  cp +2 +send_recv +[0-9.]+ +[0-9.]+ +([0-9.]+) MiB") ==
          Approx(bytes / (1 << 20)));
  }
}

// The target of the GPU step (docs/meta-device.md): llama-1b in bf16 on the h100 profile, at the
// GPU check's target batch (131,072 tokens a step) with the residual stream in bf16, is
// predicted at 50% MFU or more. An op added to the step, or a fusion undone, shows here.
TEST_CASE("the meta device predicts llama-1b's bf16 step at 50% MFU or more", "[train]") {
  CHECK(printed("--model llama-1b --dtype bf16 --residual-dtype bf16 --mbs 8 --grad-acc 8 --gpu "
                "h100 --steps 1 --val-seqs 1 --report roofline",
                "predicted step [0-9.]+ ms [^,]*, MFU ([0-9.]+)%") >= 50.0);
}

// --report roofline's GEMMs by shape: each linear layer y = x W^T (W [out, in], N tokens) is three
// GEMMs, the forward C [N, out] (K = in), the input gradient C [N, in] (K = out) and the weight
// gradient C [out, in] (K = N); equal shapes share a row. The closed form's list, from the
// model's dimensions, against the report's rows: shapes, units and calls per step. Guards against
// a GEMM counted without its shape, a shape given as (N, M) or with the wrong K, or a recomputed
// forward missing from the count.
TEST_CASE("the roofline lists each linear layer's three GEMMs by shape, as the closed form does",
          "[train]") {
  const int64_t D = 64, L = 2, hd = 16, KV = 2 * hd, F = 128, V = 256, N = 2 * 32, acc = 2;
  struct Linear {
    int64_t out, in, per_step;  // calls per step of its forward (per layer: L, the head: 1)
  };
  for (std::string recompute : {"none", "full"})
    for (std::string dtype : {"fp32", "bf16"}) {
      INFO("--recompute " << recompute << " --dtype " << dtype);
      const int64_t forwards = recompute == "full" ? 2 : 1;
      std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> want;  // (M, N, K) -> calls
      const Linear linears[] = {{D, D, L}, {KV, D, L}, {KV, D, L}, {D, D, L},
                                {F, D, L}, {F, D, L},  {D, F, L},  {V, D, 1}};
      for (const Linear& l : linears) {
        const int64_t blocks_forwards = l.out == V ? 1 : forwards;  // the head is not recomputed
        want[{N, l.out, l.in}] += l.per_step * acc * blocks_forwards;
        want[{N, l.in, l.out}] += l.per_step * acc;
        want[{l.out, l.in, N}] += l.per_step * acc;
      }
      RunResult r =
          run_train("--device meta --dtype " + dtype +
                    " --d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 --seq 32 --mbs 2 "
                    "--grad-acc 2 --steps 2 --val-every 0 --report roofline --recompute " +
                    recompute);
      INFO(r.output);
      REQUIRE(r.code == 0);
      std::map<std::tuple<int64_t, int64_t, int64_t>, int64_t> got;
      const std::regex row(" +([0-9]+) +([0-9]+) +([0-9]+) +(fp32|16-bit|8-bit) +([0-9]+) .*");
      const std::string unit = dtype == "fp32" ? "fp32" : "16-bit";
      bool in_table = false;
      for (const std::string& line : report_lines(r.output)) {
        std::smatch m;
        if (line.find("GEMMs by shape") != std::string::npos) {
          in_table = true;
        } else if (in_table && std::regex_match(line, m, row)) {
          CHECK(m[4] == unit);
          got[{std::stoll(m[1]), std::stoll(m[2]), std::stoll(m[3])}] += std::stoll(m[5]);
        }
      }
      CHECK(got == want);
    }
}

// rank 0 of a simulated world of 8 prints rank 0's reports of the 8-rank run (the groups' traffic
// without the other ranks' min..max), and rank 5 its own memory row.
TEST_CASE("one process on the meta device stands for any rank of a simulated world", "[parity]") {
  const std::string layout = COMMON + "--pp 2 --dp 2 --tp 2 --grad-acc 2 --comm mpi" + kReports;
  RunResult cpu = run_train(layout, 8);
  INFO(cpu.output);
  REQUIRE(cpu.code == 0);
  std::vector<std::string> whole = report_lines(cpu.output);
  for (int rank : {0, 5}) {
    RunResult sim = run_train(layout + " --device meta --simulate-world 8 --simulate-rank " +
                              std::to_string(rank));
    INFO(sim.output);
    REQUIRE(sim.code == 0);
    std::vector<std::string> lines = report_lines(sim.output);
    // Its memory row is the run's row of that rank.
    std::string mine, theirs;
    const std::regex row("^  " + std::to_string(rank) + " +[0-9]+ +[0-9]+ .*");
    for (const std::string& l : lines)
      if (std::regex_match(l, row)) mine = l;
    for (const std::string& l : whole)
      if (std::regex_match(l, row)) theirs = l;
    REQUIRE(!mine.empty());
    require_same_report_line(theirs, mine);
    if (rank != 0) continue;
    // Rank 0's traffic per group: calls, elements and bytes as the 8-rank run counted them.
    const std::regex traffic("^  ([a-z_]+) +([0-9]+)  ([a-z_]+) +([0-9.]+) +([0-9.]+) +(.+B) .*");
    int compared = 0;
    for (const std::string& l : lines) {
      std::smatch m;
      if (!std::regex_match(l, m, traffic)) continue;
      bool found = false;
      for (const std::string& w : whole) {
        std::smatch n;
        if (std::regex_match(w, n, traffic) && n[1] == m[1] && n[3] == m[3]) {
          for (int i = 2; i <= 6; i++) REQUIRE(n[i] == m[i]);
          found = true;
        }
      }
      REQUIRE(found);
      compared++;
    }
    REQUIRE(compared >= 3);  // tp, pp and dp at least
  }
}

TEST_CASE("the meta device and a simulated world refuse what they cannot do, with exit code 2",
          "[train]") {
  const std::string tiny = "--model tiny --steps 1 ";
  struct Case {
    std::string args, says;
    int ranks;
  };
  const Case cases[] = {
      {"--device meta --save /tmp/picoscale-meta-never", "--save has nothing", 0},
      {"--device meta --load /tmp/picoscale-meta-never", "--load has nothing", 0},
      {"--device meta --score /tmp/picoscale-meta-never", "--score has nothing", 0},
      {"--device meta --sample 10", "--sample has nothing", 0},
      {"--device cpu --simulate-world 1", "add --device meta", 0},
      {"--device meta --dp 4 --simulate-world 8", "give --simulate-world 4", 0},
      {"--device meta --dp 4 --simulate-world 4 --simulate-rank 4", "give 0 to 3", 0},
      {"--device meta --dp 2 --simulate-rank 1", "add --simulate-world 2", 0},
      {"--device meta --gpu h900", "--gpu h900: unknown profile", 0},
      {"--device meta --dp 2 --simulate-world 2", "without mpirun", 2},
  };
  for (const Case& c : cases) {
    RunResult r = run_train(tiny + c.args, c.ranks);
    INFO(c.args << "\n" << r.output);
    REQUIRE(r.code == 2);
    REQUIRE_THAT(r.output, Catch::Contains(c.says));
    REQUIRE_THAT(r.output, !Catch::Contains("Aborted"));
  }
}

// ./plan --layout's memory per GPU (the worst pipeline stage, from its closed forms and the
// schedule's tables walked op by op) against the meta run of that stage's rank 0, per category
// at the planner's printed precision (0.01 GiB): two accounts of one layout, one by formula and
// one by the code that trains.
TEST_CASE("the planner's memory per category equals the meta run's, layout by layout", "[train]") {
  struct Case {
    std::string model, layout;
    int ranks;
  };
  const Case cases[] = {
      {"llama-1b --untie-embeddings", "--pp 4 --pp-schedule afab --grad-acc 4 --mbs 1", 4},
      {"book-8b", "--dp 2 --pp 4 --zero 1 --grad-acc 16 --mbs 1", 8},
      {"llama-1b", "--tp 4 --recompute selective --mbs 2", 4},
      {"book-8b", "--pp 2 --pp-schedule interleaved --pp-virtual 2 --grad-acc 8 --mbs 1", 2},
      {"llama-1b", "--dp 4 --zero 3 --grad-acc 2 --mbs 2", 4},
      {"llama-1b", "--cp 2 --dp 2 --mbs 1", 4},
      {"book-8b", "--pp 2 --tp 2 --sp --pp-schedule zb-h1 --grad-acc 8 --mbs 1", 4},
      {"book-8b", "--pp 2 --pp-schedule zb-v --pp-virtual 2 --grad-acc 8 --mbs 1", 2},
      {"book-8b", "--pp 4 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 8 --mbs 1", 4},
      // Full recomputation: each block's input kept, one block rebuilt at a time.
      {"llama-1b", "--dp 4 --zero 3 --recompute full --grad-acc 2 --mbs 2", 4},
      {"llama-1b --untie-embeddings",
       "--pp 4 --pp-schedule afab --recompute full --grad-acc 4 --mbs 1 --residual-dtype bf16", 4},
      // The residual stream in bf16: the blocks keep x and x_mid in 2 bytes, stages send it so.
      {"llama-1b --untie-embeddings",
       "--pp 4 --pp-schedule afab --grad-acc 4 --mbs 1 --residual-dtype bf16", 4},
      {"llama-1b", "--tp 4 --recompute selective --mbs 2 --residual-dtype bf16", 4},
      {"llama-1b", "--dp 4 --zero 3 --grad-acc 2 --mbs 2 --residual-dtype bf16", 4},
      {"book-8b",
       "--pp 4 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 8 --mbs 1 --residual-dtype bf16",
       4},
      {"book-8b",
       "--pp 2 --tp 2 --sp --pp-schedule zb-h1 --grad-acc 8 --mbs 1 --residual-dtype bf16", 4},
  };
  for (const Case& c : cases) {
    const size_t space = c.model.find(' ');
    const std::string preset = c.model.substr(0, space);
    const std::string extra = space == std::string::npos ? "" : c.model.substr(space);
    RunResult plan = run_command("./plan --model " + preset + extra + " --gpus-per-node " +
                                 std::to_string(c.ranks) + " --layout '" + c.layout + "'");
    INFO(c.model << " " << c.layout << "\n" << plan.output);
    REQUIRE(plan.code == 0);
    std::smatch p;
    REQUIRE(std::regex_search(
        plan.output, p,
        std::regex("pipeline stage ([0-9]+)\\): params ([0-9.]+) \\+ grads ([0-9.]+) \\+ "
                   "optimizer ([0-9.]+) \\+ activations ([0-9.]+)")));
    // Rank 0 of that stage: dp, cp and tp rank 0 (DESIGN 4: [dp][pp][cp][tp], tp fastest).
    std::smatch dims;
    int cp = 1, tp = 1;
    if (std::regex_search(c.layout, dims, std::regex("--cp ([0-9]+)"))) cp = std::stoi(dims[1]);
    if (std::regex_search(c.layout, dims, std::regex("--tp ([0-9]+)"))) tp = std::stoi(dims[1]);
    const int rank = std::stoi(p[1]) * cp * tp;
    RunResult meta =
        run_train("--model " + c.model + " " + c.layout +
                  " --device meta --steps 1 --val-every 0 --report memory "
                  "--simulate-world " +
                  std::to_string(c.ranks) + " --simulate-rank " + std::to_string(rank));
    INFO(meta.output);
    REQUIRE(meta.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(meta.output, m,
                              std::regex("\n  " + std::to_string(rank) +
                                         " +([0-9]+) +([0-9]+) +([0-9]+) +[0-9]+ +([0-9.]+ "
                                         "[KMGT]?i?B),")));
    const double GiB = 1024.0 * 1024 * 1024;
    auto printed = [&](double bytes) { return std::round(bytes / GiB * 100) / 100; };
    for (int i = 1; i <= 3; i++) REQUIRE(printed(std::stod(m[i])) == std::stod(p[i + 1]));
    REQUIRE(std::abs(parse_bytes(m[4]) / GiB - std::stod(p[5])) <= 0.0051);  // both rounded
  }
}

// The book's activation tables (Playbook §2.5-§2.6 and §5.3; their numbers in the reference
// notes, §2.5 and §21) through the code that trains: the book's GPT block at its shapes
// (gpt-8b: Llama 3.1 8B's L, h and a; gpt-70b: 70B's), on the meta device, every activation in
// bf16 as the book's are. --report memory's layers-only line against the book's figures: 8B at
// seq 4096 with no, selective and full recomputation, 97.02, 17.02 and 1.016 GiB (its figure
// adds ~0.02 GiB of terms outside the layers to the formula's 97.00, 17.00 and 1.00); 70B under
// tp 8 and 16 with selective recomputation, 32.5 and 28.75 GiB, and with sp 10.625 and 5.3125.
// Within 2% each (the ~1% of the full row is the figure's model-level terms, which the
// layers-only line leaves out).
TEST_CASE("the GPT block's meta runs give the book's activation tables within 2%", "[train]") {
  const std::string gpt =
      " --mbs 1 --steps 1 --val-seqs 1 --attention naive --dtype bf16 --residual-dtype bf16 "
      "--report memory --recompute ";
  const std::pair<std::string, double> cases[] = {
      {"--model gpt-8b" + gpt + "none", 97.02},
      {"--model gpt-8b" + gpt + "selective", 17.02},
      {"--model gpt-8b" + gpt + "full", 1.016},
      {"--model gpt-70b" + gpt + "selective --tp 8 --simulate-world 8", 32.5},
      {"--model gpt-70b" + gpt + "selective --tp 16 --simulate-world 16", 28.75},
      {"--model gpt-70b" + gpt + "selective --tp 8 --sp --simulate-world 8", 10.625},
      {"--model gpt-70b" + gpt + "selective --tp 16 --sp --simulate-world 16", 5.3125},
  };
  for (const auto& [args, book] : cases) {
    RunResult r = run_train("--device meta " + args);
    INFO(args << "\n" << r.output);
    REQUIRE(r.code == 0);
    std::smatch m;
    REQUIRE(std::regex_search(
        r.output, m, std::regex("this GPT's, measured on this rank: ([0-9.]+ [KMGT]?i?B)")));
    const double gib = parse_bytes(m[1]) / (1024.0 * 1024 * 1024);
    CHECK(std::abs(gib - book) <= 0.02 * book);
  }
}

// The GPT block's flags: what they cannot do is refused on every rank with exit code 2, naming
// the flag and the fix.
TEST_CASE("the GPT block's flags refuse what they cannot do, with exit code 2", "[train]") {
  const std::pair<std::string, std::string> cases[] = {
      {"--model tiny --dropout 1", "--dropout 1"},
      {"--model tiny --dropout -0.5", "--dropout -0.5"},
      {"--model tiny-moe --mlp gelu", "--mlp gelu with --experts 8"},
      {"--model tiny --norm rms", "--norm rms: expected rmsnorm or layernorm"},
  };
  for (const auto& [args, says] : cases) {
    RunResult r = run_train(args + " --steps 1");
    INFO(args << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains(says));
  }
}
