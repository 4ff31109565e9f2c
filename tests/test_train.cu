// End-to-end runs of ./train (tag [train]): learning, checkpoints and exact resume, the
// side outputs, and bad input. Run from the repository root (tools/run_tests.sh does).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "cuda_case.cuh"
#include "launch.cuh"
#include "model.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/data.cuh"
#include "runtime/ops.cuh"

namespace fs = std::filesystem;

static double last_number_after(const std::string& text, const std::string& label) {
  std::regex re(label + " ([0-9.]+)");
  double v = NAN;
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it)
    v = std::stod((*it)[1]);
  return v;
}
// A small model and batch, so each run takes about a second.
static const std::string SMALL =
    "--d-model 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 "
    "--seq 32 --mbs 4 --warmup 2 --val-seqs 8 ";

TEST_CASE("training tiny brings validation loss well below the unigram entropy", "[train]") {
  RunResult r = run_train("--model tiny --steps 150 --mbs 16 --val-every 0");
  INFO(r.output);
  REQUIRE(r.code == 0);
  double unigram = last_number_after(r.output, "unigram entropy of the training tokens:");
  double val = last_number_after(r.output, "val loss");
  // The fortunes' bytes have ~3.3 nats of unigram entropy, the best loss without context; after
  // 150 steps (300k tokens) the model is at ~2.6. 0.85x (~2.8) is out of reach of a model
  // that does not use the context, and safely within reach of a working one.
  REQUIRE(unigram > 3.0);
  REQUIRE(val < 0.85 * unigram);
}

TEST_CASE("k steps equal k/2 steps, save, load, k/2 steps, exactly", "[train]") {
  std::string dir = make_temp_dir();
  REQUIRE(run_train(SMALL + "--steps 6 --log-json " + dir + "/a.jsonl --save " + dir + "/a").code ==
          0);
  REQUIRE(run_train(SMALL + "--steps 6 --stop-after 3 --save " + dir + "/half").code == 0);
  RunResult r = run_train(SMALL + "--steps 6 --load " + dir + "/half --log-json " + dir +
                          "/b.jsonl --save " + dir + "/b");
  INFO(r.output);
  REQUIRE(r.code == 0);
  auto a = read_json_lines(dir + "/a.jsonl"), b = read_json_lines(dir + "/b.jsonl");
  REQUIRE(a.size() == 6);
  REQUIRE(b.size() == 3);
  for (int i = 0; i < 3; i++) {
    REQUIRE(b[i]["step"] == a[i + 3]["step"]);
    REQUIRE(b[i]["loss"].get<double>() == a[i + 3]["loss"].get<double>());  // bitwise
    REQUIRE(b[i]["grad_norm"].get<double>() == a[i + 3]["grad_norm"].get<double>());
  }
  REQUIRE(read_whole_file(dir + "/a/model.safetensors") ==
          read_whole_file(dir + "/b/model.safetensors"));
  REQUIRE(read_whole_file(dir + "/a/optimizer.safetensors") ==
          read_whole_file(dir + "/b/optimizer.safetensors"));
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint round trip gives identical logits", "[train]") {
  std::string dir = make_temp_dir();
  REQUIRE(run_train(SMALL + "--steps 2 --save " + dir + "/ck").code == 0);
  ModelConfig c = read_checkpoint_config(dir + "/ck");
  REQUIRE(c.d_model == 64);
  REQUIRE(c.seq == 32);
  Context ctx = Context::create(Device::CPU);
  Model m = build_model(c, Device::CPU, 999);  // different seed: the load must overwrite it all
  load_checkpoint(dir + "/ck", m.named_params, nullptr);
  std::vector<int32_t> ids(c.seq);
  for (int i = 0; i < c.seq; i++) ids[i] = "The quick brown fox jumps over it"[i];
  Activations first, second;
  model_forward(ctx, m, first, ids.data(), nullptr, 1, c.seq, Recompute::None);
  // Save again and load into a third model: logits equal bit for bit.
  save_checkpoint(dir + "/ck2", c, m.named_params, nullptr);
  Model m2 = build_model(c, Device::CPU, 5);
  load_checkpoint(dir + "/ck2", m2.named_params, nullptr);
  model_forward(ctx, m2, second, ids.data(), nullptr, 1, c.seq, Recompute::None);
  REQUIRE(to_host_floats(first.logits) == to_host_floats(second.logits));
  REQUIRE(read_whole_file(dir + "/ck/model.safetensors") ==
          read_whole_file(dir + "/ck2/model.safetensors"));

  // --score prints the mean loss of disjoint windows of seq + 1 tokens: check it by hand.
  std::string text;
  for (int i = 0; i < 2 * (c.seq + 1) + 5; i++) text += (char)('a' + (i * 7) % 26);
  std::ofstream(dir + "/score.txt") << text;
  RunResult r = run_train("--load " + dir + "/ck --score " + dir + "/score.txt");
  INFO(r.output);
  REQUIRE(r.code == 0);
  double total = 0;
  for (int w = 0; w < 2; w++) {
    std::vector<int32_t> in(c.seq), tgt(c.seq);
    for (int i = 0; i < c.seq; i++)
      in[i] = text[w * (c.seq + 1) + i], tgt[i] = text[w * (c.seq + 1) + i + 1];
    Activations acts;
    total += model_forward(ctx, m, acts, in.data(), tgt.data(), 1, c.seq, Recompute::None);
  }
  REQUIRE(last_number_after(r.output, "loss:") == Approx(total / (2 * c.seq)).epsilon(1e-5));
  fs::remove_all(dir);
}

TEST_CASE("--save-grads writes the first step's unclipped gradients", "[train]") {
  std::string dir = make_temp_dir();
  RunResult r = run_train(SMALL + "--steps 1 --grad-clip 0.01 --save-grads " + dir +
                          "/g.safetensors "
                          "--log-json " +
                          dir + "/log.jsonl");
  REQUIRE(r.code == 0);
  ModelConfig c = model_preset("tiny");
  c.d_model = 64, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.ffn = 128, c.seq = 32;
  Model m = build_model(c, Device::CPU, 1);
  read_safetensors(dir + "/g.safetensors", m.named_grads);
  Context ctx = Context::create(Device::CPU);
  double norm = std::sqrt(sum_squares(ctx, m.grads));
  double logged = read_json_lines(dir + "/log.jsonl")[0]["grad_norm"];
  REQUIRE(logged > 0.01);  // clipping was active, so the file must hold the pre-clip gradient
  REQUIRE(norm == Approx(logged).epsilon(1e-5));  // fp32 sums in another order
  fs::remove_all(dir);
}

// Every rank reports bad input with a message and exit code 2.
static void expect_usage_error(const std::string& args, const std::string& message) {
  RunResult r = run_train(args);
  INFO(args << "\n" << r.output);
  REQUIRE(r.code == 2);
  REQUIRE_THAT(r.output, Catch::Contains(message));
}

TEST_CASE("a training step waits for the device three times, whatever its micro-batches",
          "[train]") {
  // Counted on CPU at the places that make the host wait on CUDA (core.cuh, count_host_sync):
  // the micro-batches' losses come to the host together once the schedule is done (each left on
  // the device till then: runtime/ops.cuh's sum_later), the gradient norm reads its 21
  // per-tensor sums of squares in one trip, and the step ends with one stream synchronise. A new
  // wait in the hot path changes this number. Tensor parallelism adds none here: the vocab-parallel
  // cross-entropy finishes on the device (2 ranks, --tp 2); on NCCL a collective's wait that finds
  // it still running counts one more (comm_handle.cu), as many as the GPU is behind. A mixture adds
  // one per layer and micro-batch: the router's logits come to the host, where the routing (and so
  // the all-to-all's sizes) is decided; its backward runs on the device (expert parallelism
  // exchanges the counts over MPI, on the host already).
  for (int experts : {0, 4})
    for (int tp : {1, 2})
      for (int grad_acc : {1, 3}) {
        const std::string mixture = experts ? "--experts 4 --top-k 2 " : "";
        RunResult r =
            run_train(SMALL + mixture + "--steps 2 --val-every 0 --report sync " + "--grad-acc " +
                          std::to_string(grad_acc) + " --tp " + std::to_string(tp),
                      tp > 1 ? tp : 0);
        INFO("experts " << experts << ", tp " << tp << "\n" << r.output);
        REQUIRE(r.code == 0);
        const int layers = 2;
        CHECK(last_number_after(r.output, "host synchronisations per training step:") ==
              3 + (experts ? layers * grad_acc : 0));
      }
}

// The line gives the steps after the first, and names the first where it waited more: here
// --save-grads under tensor parallelism gathers each gradient to rank 0 in the first step, one
// host read a tensor. The tensors are counted in the file the run wrote (its safetensors header).
TEST_CASE("--report sync tells the first step apart when it waited more", "[train]") {
  std::string dir = make_temp_dir();
  RunResult r = run_train(
      SMALL + "--steps 2 --val-every 0 --report sync --tp 2 --save-grads " + dir + "/g.safetensors",
      2);
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::ifstream file(dir + "/g.safetensors", std::ios::binary);
  uint64_t header_bytes = 0;
  file.read(reinterpret_cast<char*>(&header_bytes), 8);
  std::string header(header_bytes, ' ');
  file.read(header.data(), (std::streamsize)header_bytes);
  const nlohmann::json tensors = nlohmann::json::parse(header);
  const int saved = (int)tensors.size() - (int)tensors.contains("__metadata__");
  REQUIRE(saved > 10);
  CHECK_THAT(r.output, Catch::Contains("host synchronisations per training step: 3 (the first "
                                       "step: " +
                                       std::to_string(3 + saved) + ")\n"));
  fs::remove_all(dir);
}

TEST_CASE("bad flags and data end with a clear message and exit code 2", "[train]") {
  std::string dir = make_temp_dir();
  expect_usage_error("--no-such-flag 3", "--no-such-flag");
  expect_usage_error("--heads 3", "--heads 3 does not divide --d-model 128");
  expect_usage_error("--kv-heads 3", "--kv-heads 3 does not divide --heads 4");
  expect_usage_error("--data /nonexistent/corpus.txt", "/nonexistent/corpus.txt");
  std::ofstream(dir + "/small.txt") << "too short";
  expect_usage_error("--data " + dir + "/small.txt", dir + "/small.txt");
  expect_usage_error("--device gpu", "--device gpu");
  expect_usage_error("--score x.txt", "--score x.txt needs --load");
  fs::remove_all(dir);
}

TEST_CASE("bad checkpoints end with a message naming the file and the problem", "[train]") {
  std::string dir = make_temp_dir();
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir + "/ok").code == 0);
  std::string weights = read_whole_file(dir + "/ok/model.safetensors");
  auto variant = [&](const std::string& name, const std::string& bytes) {
    fs::copy(dir + "/ok", dir + "/" + name);
    std::ofstream(dir + "/" + name + "/model.safetensors", std::ios::binary) << bytes;
    return dir + "/" + name;
  };
  expect_usage_error("--load " + variant("truncated", weights.substr(0, weights.size() - 100)),
                     "truncated");
  std::string bad_header = weights;
  for (int i = 0; i < 8; i++) bad_header[i] = (char)0xff;  // header length 2^64 - 1
  expect_usage_error("--load " + variant("header", bad_header), "model.safetensors");
  // A config that disagrees with the tensors: every shape check names the tensor.
  fs::copy(dir + "/ok", dir + "/shape");
  std::string cfg = read_whole_file(dir + "/ok/config.json");
  cfg = std::regex_replace(cfg, std::regex("\"intermediate_size\": *128"),
                           "\"intermediate_size\": 96");
  std::ofstream(dir + "/shape/config.json") << cfg;
  expect_usage_error("--load " + dir + "/shape", "mlp.gate_proj.weight");
  expect_usage_error("--load " + dir + "/missing", dir + "/missing");
  fs::remove_all(dir);
}

TEST_CASE("a CUDA training run matches the CPU run of the same seed", "[gpu]") {
  SKIP_WITHOUT_CUDA();
  // Its own text (a machine under test may lack the default corpus): repeated sentences with
  // varied numbers, 64 KiB, enough for 5 steps and the validation split.
  std::string dir = make_temp_dir(), data = dir + "/text.txt";
  {
    std::ofstream text(data);
    for (int i = 0; text.tellp() < 65536; i++)
      text << "Sentence " << i << " says " << (i * 7919) % 1000 << " is not " << i % 13 << ".\n";
  }
  // bf16 twice: with the residual stream in fp32 (the default) and in bf16 (--residual-dtype);
  // and the book's GPT block (LayerNorm, GeLU, dropout: the device draws the CPU's masks).
  const std::string gpt = " --norm layernorm --mlp gelu --dropout 0.1 --attention naive";
  for (const std::string& dtype :
       {std::string("fp32"), std::string("bf16"), std::string("bf16 --residual-dtype bf16"),
        "fp32" + gpt, "bf16 --residual-dtype bf16" + gpt}) {
    std::string args = SMALL + "--steps 5 --data " + data + " --dtype " + dtype;
    REQUIRE(run_train(args + " --device cpu --log-json " + dir + "/cpu.jsonl").code == 0);
    RunResult r = run_train(args + " --device cuda --log-json " + dir + "/cuda.jsonl");
    INFO("--dtype " << dtype << "\n" << r.output);
    REQUIRE(r.code == 0);
    auto cpu = read_json_lines(dir + "/cpu.jsonl"), cuda = read_json_lines(dir + "/cuda.jsonl");
    REQUIRE(cpu.size() == cuda.size());
    const bool fp32 = dtype.rfind("fp32", 0) == 0;
    for (size_t i = 0; i < cpu.size(); i++) {
      // fp32: the same math, other summation orders (cuBLAS vs OpenBLAS, block reductions, the
      // RMSNorm weight gradient's row blocks): ~1e-6 relative per op, amplified a little by five
      // Adam steps; 1e-4 separates that from any real bug, which shifts the loss by more.
      // bf16: the CPU emulates the GPU's rounding exactly, but a sum that differs in its last
      // fp32 bit may round to the other bf16 neighbour, and the GPU's bf16 FlashAttention
      // kernels also round the probabilities (2^-9 each, averaging out over a row): the parity
      // matrix's bf16 bounds (tests/test_precision_parity.cu), loss 2^-10 and norm 2^-7,
      // doubled for five steps.
      INFO("--dtype " << dtype << ", step " << i + 1);
      REQUIRE(cuda[i]["loss"].get<double>() ==
              Approx(cpu[i]["loss"].get<double>()).epsilon(fp32 ? 1e-4 : std::ldexp(1.0, -9)));
      REQUIRE(cuda[i]["grad_norm"].get<double>() ==
              Approx(cpu[i]["grad_norm"].get<double>()).epsilon(fp32 ? 1e-3 : std::ldexp(1.0, -6)));
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("--save-dtype bf16 saves the weights rounded to bf16, which --load and --score read",
          "[train][precision]") {
  std::string dir = make_temp_dir();
  const std::string run = SMALL + "--steps 2 --val-every 0 ";
  REQUIRE(run_train(run + "--save " + dir + "/fp32").code == 0);
  REQUIRE(run_train(run + "--save-dtype bf16 --save " + dir + "/bf16").code == 0);
  std::ifstream config(dir + "/bf16/config.json");
  CHECK(nlohmann::json::parse(config)["torch_dtype"] == "bfloat16");
  // The same run, so the same master weights: one file is the other rounded; the optimizer
  // state is fp32 in both, byte for byte.
  CHECK(read_whole_file(dir + "/fp32/optimizer.safetensors") ==
        read_whole_file(dir + "/bf16/optimizer.safetensors"));
  CHECK(read_whole_file(dir + "/bf16/model.safetensors").size() <
        read_whole_file(dir + "/fp32/model.safetensors").size() * 6 / 10);
  // Scored on the same text, the bf16 weights give nearly the fp32 loss: each weight moved by
  // at most 2^-8 of itself, which moves the loss by far less than 1% here.
  std::string text;
  for (int i = 0; i < 4 * 33; i++) text += (char)('a' + (i * 7) % 26);
  std::ofstream(dir + "/score.txt") << text;
  double loss[2];
  for (int k = 0; k < 2; k++) {
    RunResult r =
        run_train("--load " + dir + (k ? "/bf16" : "/fp32") + " --score " + dir + "/score.txt");
    INFO(r.output);
    REQUIRE(r.code == 0);
    loss[k] = last_number_after(r.output, "loss:");
  }
  CHECK(std::isfinite(loss[0]));
  CHECK(loss[1] != loss[0]);  // the weights did change
  CHECK(loss[1] == Approx(loss[0]).epsilon(0.01));
  expect_usage_error("--save-dtype fp8", "--save-dtype fp8");
  fs::remove_all(dir);
}
