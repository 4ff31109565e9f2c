// test_bf16_state.cu: training state kept in bf16 (Playbook §Mixed precision training).
// --grad-acc-dtype bf16: gradients in the compute format, 2 bytes per parameter instead of fp32
// accumulation's 4. Each unit's backward sums in fp32 and the sum is stored rounded to bf16, so
// with one micro-batch the stored gradient is exactly the fp32-accumulated one rounded, whatever
// the model split; with several micro-batches or data-parallel ranks each partial sum is rounded
// once more, and the layouts track the single process within bf16's precision.
// ZeRO under --dtype bf16: the fp32 master weights sharded, the rounded slices all-gathered in
// bf16 (ZeRO-1/2 keep the whole weights in bf16 only, ZeRO-3 a bf16 copy of its shard).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>

#include "cuda_case.cuh"
#include "launch.cuh"
#include "parity_rows.cuh"
#include "runtime/ops.cuh"

namespace fs = std::filesystem;

namespace {

// fp32 -> bf16 -> fp32, round to nearest even, written here from the bit layout (finite inputs).
float round_bf16(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000u;
  float r;
  memcpy(&r, &b, 4);
  return r;
}

}  // namespace

TEST_CASE("bf16 gradients are the fp32-accumulated ones rounded to bf16, in every model split",
          "[train]") {
  std::string dir = make_temp_dir();
  struct Layout {
    const char* flags;
    int ranks;
  };
  // One micro-batch on one data-parallel rank: one rounding per element, after the whole sum
  // (sequence-parallel norm weights are summed over tp in the fp32 accumulator first).
  for (Layout l : {Layout{"", 0}, Layout{"--tp 2 --sp", 2}, Layout{"--pp 2", 2}}) {
    SECTION(std::string("layout ") + (l.ranks ? l.flags : "single process")) {
      Bf16Run fp32 = run_bf16(l.flags, l.ranks, dir + "/fp32");
      Bf16Run bf16 =
          run_bf16(std::string(l.flags) + " --grad-acc-dtype bf16", l.ranks, dir + "/bf16");
      REQUIRE(bf16.grads.size() == fp32.grads.size());
      int64_t elements = 0, differ = 0, rounded = 0;
      for (const auto& [name, g] : fp32.grads) {
        const std::vector<float>& h = bf16.grads.at(name);
        REQUIRE(h.size() == g.size());
        for (size_t i = 0; i < g.size(); i++) {
          elements++;
          differ += h[i] != round_bf16(g[i]);
          rounded += h[i] != g[i];
        }
      }
      CHECK(differ == 0);
      CHECK(rounded > elements / 2);  // the rounding happened: most fp32 values are not bf16
      // The first step's loss is computed before any gradient: bit-identical.
      CHECK(bf16.log[0]["loss"] == fp32.log[0]["loss"]);
    }
  }
  fs::remove_all(dir);
}

// Layouts round at different points: a data-parallel rank rounds its own sum, and the bf16
// all-reduce rounds the sum of the ranks' (one more rounding per element on two ranks); a
// micro-batch split rounds after each micro-batch. Each is 2^-9 of an element, so gradients
// differ by an ulp or two of bf16 between layouts, as in the bf16 parity matrix
// (test_precision_parity.cu), whose bounds apply: the loss 2^-10 relative at every step, the
// gradient norm 2^-9 at step 1 and 2^-7 after (AdamW's scale-free update turns an ulp of a
// near-zero gradient into a different step). A rank's missing or doubled contribution moves the
// loss by 1% or more.
TEST_CASE("bf16 gradients: data, pipeline and tensor parallel runs track the single process",
          "[parity]") {
  std::string dir = make_temp_dir();
  struct Row {
    const char *name, *layout;
    int ranks;
    const char* reference;
  };
  const Row rows[] = {
      {"dp 2, buckets", "--dp 2", 2, "--grad-acc 2"},
      {"dp 2, naive", "--dp 2 --dp-sync naive", 2, "--grad-acc 2"},
      {"dp 2 x tp 2 + sp", "--dp 2 --tp 2 --sp", 4, "--grad-acc 2"},
      {"pp 2, zero-bubble", "--pp 2 --pp-schedule zb-h1 --grad-acc 4", 2, "--grad-acc 4"},
      {"pp 2 x dp 2, interleaved",
       "--layers 4 --pp 2 --dp 2 --pp-schedule interleaved --pp-virtual 2 --grad-acc 2", 4,
       "--layers 4 --grad-acc 4"},
      {"dp 2, tied embeddings", "--dp 2 --tie-embeddings", 2, "--grad-acc 2 --tie-embeddings"},
      {"dp 2, zero 1, 2 micro-batches", "--dp 2 --zero 1 --grad-acc 2", 2, "--grad-acc 4"},
      {"dp 2, zero 2, tied embeddings", "--dp 2 --zero 2 --tie-embeddings", 2,
       "--grad-acc 2 --tie-embeddings"},
      {"dp 2, zero 3, 2 micro-batches", "--dp 2 --zero 3 --grad-acc 2", 2, "--grad-acc 4"},
      {"pp 2 x dp 2, zero 1, zero-bubble",
       "--pp 2 --dp 2 --zero 1 --pp-schedule zb-h1 --grad-acc 2", 4, "--grad-acc 4"},
  };
  std::map<std::string, Bf16Run> refs;
  for (const Row& row : rows) {
    SECTION(row.name) {
      const std::string bf16 = " --grad-acc-dtype bf16";
      if (!refs.count(row.reference))
        refs[row.reference] = run_bf16(std::string(row.reference) + bf16, 0, dir + "/ref");
      const Bf16Run& ref = refs[row.reference];
      Bf16Run got = run_bf16(std::string(row.layout) + bf16, row.ranks, dir + "/layout");
      REQUIRE(got.log.size() == ref.log.size());
      for (size_t i = 0; i < ref.log.size(); i++) {
        INFO(row.name << ", step " << i + 1);
        CHECK(got.log[i]["loss"].get<double>() ==
              Approx(ref.log[i]["loss"].get<double>()).epsilon(std::ldexp(1.0, -10)));
        CHECK(got.log[i]["grad_norm"].get<double>() ==
              Approx(ref.log[i]["grad_norm"].get<double>())
                  .epsilon(std::ldexp(1.0, i == 0 ? -9 : -7)));
      }
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("--grad-acc-dtype bf16 halves the gradients' bytes: the book's 16 per parameter",
          "[train]") {
  const std::string run =
      "--steps 1 --mbs 2 --seq 32 --val-every 0 --val-seqs 2 --report memory "
      "--dtype bf16 --grad-acc-dtype bf16 ";
  RunResult r = run_train(run);
  INFO(r.output);
  REQUIRE(r.code == 0);
  // Measured at allocation: bf16 weights 2, bf16 gradients 2, fp32 master 4, Adam 8.
  CHECK_THAT(r.output,
             Catch::Contains(
                 "this rank, measured            2.00       2.00     4.00       8.00   16.00"));
  CHECK_THAT(r.output, Catch::Contains("bf16 gradients"));  // the configuration table says so
  // The memory summary measures 16.00 and names the book's formula for this precision.
  CHECK_THAT(r.output,
             Catch::Contains("= 16.00 bytes/parameter (Playbook §2.4, bf16: 2Ψ + 2Ψ + 12Ψ = 16)"));
  // ZeRO over 2 ranks: the book's 2Ψ + 2Ψ + 12Ψ/N (ZeRO-1), 2Ψ + 2Ψ/N + 12Ψ/N (ZeRO-2), to the
  // byte.
  for (const char* z : {"1", "2"}) {
    RunResult zr = run_train(run + "--dp 2 --zero " + z, 2);
    INFO(zr.output);
    REQUIRE(zr.code == 0);
    CHECK_THAT(zr.output, Catch::Contains(std::string("Playbook §4.1: 2Ψ + 2Ψ") +
                                          (z[0] == '1' ? "" : "/N") + " + 12Ψ/N"));
    CHECK_THAT(zr.output,
               Catch::Contains("every rank holds exactly the formula's bytes at Ψ': yes"));
  }
}

TEST_CASE("--grad-acc-dtype bf16 where it cannot apply ends with exit code 2 naming the fix",
          "[train]") {
  const std::string base = "--steps 1 --mbs 2 --seq 32 --val-every 0 --val-seqs 2 ";
  struct Case {
    std::string flags;
    int ranks;
    const char* says;
  };
  const Case cases[] = {
      {"--grad-acc-dtype bf16", 0, "add --dtype bf16"},  // fp32 on CPU by default
      {"--dtype fp16 --grad-acc-dtype bf16", 0, "fp16 gradients would underflow"},
      {"--dtype bf16 --grad-acc-dtype bf16 --dp-sync ring", 0, "use --dp-sync bucket or naive"},
      {"--dtype bf16 --grad-acc-dtype fp16", 0, "expected fp32 or bf16"},
  };
  for (const Case& c : cases) {
    RunResult r = run_train(base + c.flags, c.ranks);
    INFO(c.flags << "\n" << r.output);
    CHECK(r.code == 2);
    CHECK_THAT(r.output, Catch::Contains("--grad-acc-dtype") && Catch::Contains(c.says));
    if (c.ranks) CHECK(count_occurrences(r.output, "error: --grad-acc-dtype") == 1);
  }
}

// Two data-parallel ranks sum their gradients the same way under ZeRO as under plain data
// parallelism (one addition of two values does not depend on the order; in bf16, one fp32 add
// rounded once, whether all-reduced or reduce-scattered), and AdamW's update is elementwise: so
// a ZeRO run, with its sharded master weights, bf16 all-gathers and (with --grad-acc-dtype
// bf16) bf16 gradient shards, must end with the very bytes of the plain run, in the
// checkpoint's master weights and Adam moments (one micro-batch: ZeRO-2/3 round each
// micro-batch's sum where plain data parallelism rounds the running one). Without clipping: the
// global norm is summed from shards under ZeRO, in another order, so it differs in its last bits
// (checked to 2^-20), and a clipped step with it. And a checkpoint of one resumes in the other: the
// bf16 weights of a resumed ZeRO run are its loaded master slices rounded, as the uninterrupted
// run's were.
TEST_CASE(
    "ZeRO-1/2/3 in bf16 (sharded master, bf16 gathers and gradients) end bit for bit where dp does",
    "[parity]") {
  std::string dir = make_temp_dir();
  const std::string flags = COMMON + "--dtype bf16 --dp 2 --grad-clip 0 ";
  auto train = [&](const std::string& extra, const std::string& out) {
    RunResult r = run_train(flags + extra + " --log-json " + out + ".jsonl --save " + out, 2);
    INFO(extra << "\n" << r.output);
    REQUIRE(r.code == 0);
    return read_json_lines(out + ".jsonl");
  };
  for (const std::string grads : {"--grad-acc-dtype fp32", "--grad-acc-dtype bf16"}) {
    for (int zero : {1, 2, 3}) {
      const std::string z = grads + " --zero " + std::to_string(zero);
      SECTION(z) {
        std::vector<nlohmann::json> plain = train(grads, dir + "/dp");
        std::vector<nlohmann::json> log = train(z, dir + "/zero");
        REQUIRE(log.size() == plain.size());
        for (size_t i = 0; i < log.size(); i++) {
          CHECK(log[i]["loss"] == plain[i]["loss"]);
          CHECK(log[i]["grad_norm"].get<double>() ==
                Approx(plain[i]["grad_norm"].get<double>()).epsilon(std::ldexp(1.0, -20)));
        }
        for (const char* file : {"/model.safetensors", "/optimizer.safetensors"})
          CHECK(read_whole_file(dir + "/zero" + file) == read_whole_file(dir + "/dp" + file));
        // Resumed: one step of the plain run, saved, then ZeRO takes over for the rest.
        RunResult a = run_train(flags + grads + " --stop-after 1 --save " + dir + "/half", 2);
        REQUIRE(a.code == 0);
        std::vector<nlohmann::json> resumed =
            train(z + " --load " + dir + "/half", dir + "/resumed");
        REQUIRE(resumed.size() == plain.size() - 1);
        for (size_t i = 0; i < resumed.size(); i++)
          CHECK(resumed[i]["loss"] == plain[i + 1]["loss"]);
        CHECK(read_whole_file(dir + "/resumed/model.safetensors") ==
              read_whole_file(dir + "/dp/model.safetensors"));
      }
    }
  }
  fs::remove_all(dir);
}

// The bytes of --report memory and --report comm under ZeRO in bf16, against the book's
// mixed-precision formula (2 bytes per bf16 weight, 4 per fp32 gradient, 12 for the master
// weight and Adam's m and v) and fp32's all-gather bytes halved.
TEST_CASE("ZeRO in bf16: the book's 2Ψ + 4Ψ + 12Ψ/N, and all-gathers of half fp32's bytes",
          "[train]") {
  const std::string base =
      "--steps 2 --mbs 2 --seq 32 --val-every 0 --val-seqs 2 --dp 2 --report memory,comm ";
  auto all_gather_bytes = [](const std::string& out, const std::string& stage) {
    size_t at = out.find("  all_gather ", out.find("ZeRO-" + stage + " traffic"));
    REQUIRE(at != std::string::npos);
    std::istringstream row(out.substr(at + 13, 80));
    double calls = 0, bytes = 0, want_calls = 0, want_bytes = 0;
    row >> calls >> bytes >> want_calls >> want_bytes;
    CHECK(bytes == want_bytes);
    return bytes;
  };
  // Over N = 2, per parameter: weights 2 (bf16; ZeRO-3: its shard, 2/2), gradients 4 (fp32;
  // ZeRO-2 and -3: 4/2), the master weights 4/2 and Adam 8/2.
  struct Stage {
    const char *zero, *formula, *measured;
  };
  for (const Stage& z :
       {Stage{"1", "2Ψ + 4Ψ + 12Ψ/N", "2.00       4.00     2.00       4.00   12.00"},
        Stage{"2", "2Ψ + 4Ψ/N + 12Ψ/N", "2.00       2.00     2.00       4.00   10.00"},
        Stage{"3", "2Ψ/N + 4Ψ/N + 12Ψ/N", "1.00       2.00     2.00       4.00    9.00"}}) {
    RunResult fp32 = run_train(base + "--zero " + z.zero + " --dtype fp32", 2);
    RunResult bf16 = run_train(base + "--zero " + z.zero + " --dtype bf16", 2);
    INFO("--zero " << z.zero << "\n" << fp32.output << bf16.output);
    REQUIRE(fp32.code == 0);
    REQUIRE(bf16.code == 0);
    CHECK(all_gather_bytes(bf16.output, z.zero) * 2 == all_gather_bytes(fp32.output, z.zero));
    CHECK_THAT(bf16.output,
               Catch::Contains(std::string("this rank, measured            ") + z.measured));
    CHECK_THAT(bf16.output, Catch::Contains(std::string("Playbook §4.1: ") + z.formula));
    CHECK_THAT(bf16.output,
               Catch::Contains("every rank holds exactly the formula's bytes at Ψ': yes"));
  }
}

// Activations stored in bf16: what a block keeps shrinks by 2 bytes per element of everything
// but the residual stream (x, x_mid) and the statistics (1/rms, log-sum-exp), counted here from
// the tiny model's shapes (D 128, 4 heads of 32, 2 kv heads, F 384; N = mbs x seq tokens), and
// the report's formula says the same to the byte.
TEST_CASE("activations stored in bf16: 2 bytes less per element of all but the residual stream",
          "[train]") {
  const int64_t mbs = 2, seq = 64, N = mbs * seq, D = 128, Hq = 4, Hkv = 2, hd = 32, F = 384;
  auto measured = [](const std::string& out) {
    size_t at = out.find("  measured ", out.find("activations per block"));
    REQUIRE(at != std::string::npos);
    CHECK(out.substr(at, 200).find(", equal") != std::string::npos);  // against the formula
    return std::stoll(out.substr(out.find('(', at) + 1));
  };
  for (const char* attention : {"flash", "naive"}) {
    for (const char* recompute : {"none", "selective", "full"}) {
      const std::string flags = std::string(
                                    "--steps 1 --mbs 2 --seq 64 --val-every 0 --val-seqs 2 "
                                    "--report memory --attention ") +
                                attention + " --recompute " + recompute;
      RunResult fp32 = run_train(flags), bf16 = run_train(flags + " --dtype bf16");
      INFO(flags << "\n" << fp32.output << bf16.output);
      REQUIRE(fp32.code == 0);
      REQUIRE(bf16.code == 0);
      int64_t saved = 2 * (2 * N * D)  // norm1, norm2
                      +
                      2 * N * (2 * Hq * hd + 2 * Hkv * hd + 3 * F);  // q, attn, k, v, gate, up, act
      if (std::string(attention) == "naive")
        saved += 2 * mbs * Hq * seq * seq;  // the probabilities
      if (std::string(recompute) == "selective" && std::string(attention) == "naive")
        saved -= 2 * mbs * Hq * seq * seq;              // dropped, recomputed: not stored at all
      if (std::string(recompute) == "full") saved = 0;  // only the block input, fp32
      CHECK(measured(fp32.output) - measured(bf16.output) == saved);
    }
  }
}

// The gradient norm reads bf16 gradients directly: each value widened exactly, squares summed
// in fp32 (float64 recomputation: the fp32 sum's error is at most ~2^-24 x 256 + n/256 steps).
TEST_CASE("sum_squares_each reads bf16 tensors, widened exactly", "[ops]") {
  const int64_t n = 3000;
  std::vector<uint16_t> bits(n);
  std::vector<float> wide(n);
  double exact = 0;
  for (int64_t i = 0; i < n; i++) {
    float x = round_bf16(std::sin(0.37 * i) * (1 + i % 7));
    uint32_t b;
    memcpy(&b, &x, 4);
    bits[i] = (uint16_t)(b >> 16);
    wide[i] = x;
    exact += (double)x * x;
  }
  Context cpu;
  Tensor h{nullptr, bits.data(), {n}, DType::BF16, Device::CPU};
  Tensor f{nullptr, wide.data(), {n}, DType::F32, Device::CPU};
  std::vector<float> got = sum_squares_each(cpu, {h, f});
  CHECK(got[0] == got[1]);  // the same values in either storage: the same fp32 sum
  CHECK(std::fabs(got[0] - exact) <= 1e-5 * exact);
}

TEST_CASE("CUDA sum_squares_each of bf16 tensors equals the CPU's", "[ops][gpu]") {
  SKIP_WITHOUT_CUDA();
  const int64_t n = 100000;
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; i++) {
    float x = std::cos(0.11 * i) * (1 + i % 5);
    uint32_t b;
    memcpy(&b, &x, 4);
    bits[i] = (uint16_t)(b >> 16);
  }
  Context cpu, gpu = Context::create(Device::CUDA);
  Tensor h{nullptr, bits.data(), {n}, DType::BF16, Device::CPU};
  Tensor d = empty({n}, Mem::Workspace, Device::CUDA, DType::BF16);
  CUDA_CHECK(cudaMemcpy(d.ptr, bits.data(), n * 2, cudaMemcpyHostToDevice));
  float c = sum_squares_each(cpu, {h})[0], g = sum_squares_each(gpu, {d})[0];
  // Blocked sums in both, in different trees: within fp32 summation error of the total.
  CHECK(std::fabs(c - g) <= 1e-5 * c);
  gpu.destroy();
}
