// test_edges.cu: DESIGN §9 at the edges. Values that got through (a loss scale past fp16, an
// optimizer step past --steps, --sp without tp), a checkpoint converted without a step, outputs
// that would overwrite the run's inputs or each other, a save into a directory that holds the
// user's files, and faults that cannot fire in the run they are given to. [safety]; runs of
// ./train are also [train], runs under mpirun [parity].
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "launch.cuh"
#include "mixed_precision.cuh"
#include "refusals.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/options.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

// The safetensors file at `path` with its header's __metadata__[key] = value (the header padded
// again to 8 bytes; the data unchanged: offsets count from the data's start).
void set_metadata(const std::string& path, const std::string& key, const nlohmann::json& value) {
  const std::string bytes = read_whole_file(path);
  uint64_t n = 0;
  memcpy(&n, bytes.data(), 8);
  nlohmann::ordered_json header = nlohmann::ordered_json::parse(bytes.substr(8, n));
  header["__metadata__"][key] = value;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t m = text.size();
  std::string out(8, '\0');
  memcpy(&out[0], &m, 8);
  std::ofstream(path, std::ios::binary) << out << text << bytes.substr(8 + n);
}
// A safetensors file of raw tensors (name order), written without checkpoint.cu.
void write_raw(const std::string& path, const std::map<std::string, RawTensor>& tensors) {
  nlohmann::ordered_json header;
  std::string data;
  for (const auto& [name, t] : tensors) {
    header[name] = {{"dtype", t.dtype},
                    {"shape", t.shape},
                    {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t m = text.size();
  std::string out(8, '\0');
  memcpy(&out[0], &m, 8);
  std::ofstream(path, std::ios::binary) << out << text << data;
}

}  // namespace

// ----------------------------------------------------------------------------
// Inputs that got through

TEST_CASE("a fixed --loss-scale is a power of two fp16 holds, and the log prints a scale as it is",
          "[safety][precision]") {
  for (const char* bad : {"1e30", "65536", "1000", "3", "1e-30", "-1024"})
    CHECK_THAT(usage_error_of([&] { make_loss_scaler(Precision::FP16, bad, 1000, true); }),
               Contains("--loss-scale " + std::string(bad) + ":") && Contains("power of two"));
  for (const char* good : {"1", "1024", "32768", "0.5"})
    CHECK(usage_error_of([&] { make_loss_scaler(Precision::FP16, good, 1000, true); }).empty());
  CHECK(make_loss_scaler(Precision::FP16, "1024", 1000, true).scale == 1024.0f);
  // The dynamic scale may double up to 2^32: printed whole, never wrapped into an int64.
  CHECK(exact_num(4294967296.0) == "4294967296");
  CHECK(exact_num(65536.0) == "65536");
  CHECK(exact_num(0.125) == "0.125");
}

TEST_CASE("./train refuses --loss-scale 1e30 and --sp without tensor parallelism",
          "[safety][train]") {
  expect_refused(SMALL + "--steps 2 --dtype fp16 --loss-scale 1e30",
                 {"--loss-scale 1e30", "power of two", "32768"});
  // --sp with --tp 1 would change nothing: refused, so a layout meant to test sequence
  // parallelism cannot silently test none.
  expect_refused(SMALL + "--steps 2 --sp", {"--sp with --tp 1", "add --tp 2"});
}

// --residual-dtype keeps the stream in the compute format of --dtype: a format the run's
// linear layers do not use (fp32 runs, bf16 beside fp16) is refused, not quietly converted.
TEST_CASE("./train refuses a --residual-dtype that is not the compute format of --dtype",
          "[safety][train]") {
  expect_refused(SMALL + "--steps 2 --dtype fp32 --residual-dtype bf16",
                 {"--residual-dtype bf16", "this run is fp32", "add that --dtype"});
  expect_refused(SMALL + "--steps 2 --dtype bf16 --residual-dtype fp16",
                 {"--residual-dtype fp16", "this run is bf16"});
  expect_refused(SMALL + "--steps 2 --dtype fp8 --residual-dtype bf16",
                 {"--residual-dtype bf16", "this run is fp8"});
  expect_refused(SMALL + "--steps 2 --residual-dtype fp64", {"--residual-dtype fp64"});
}

TEST_CASE("an optimizer state whose step is not an int64, or at or past --steps, is refused",
          "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(run_train(SMALL + "--steps 2 --save " + ck).code == 0);
  // At --steps: nothing left to train (it used to run zero steps and exit 0 without a word).
  expect_refused(SMALL + "--steps 2 --load " + ck,
                 {"--load " + ck, "at step 2, where --steps 2 ends", "raise --steps", "--steps 0"});
  expect_refused(SMALL + "--steps 1 --load " + ck, {"at step 2, past where --steps 1 ends"});
  CHECK(run_train(SMALL + "--steps 3 --load " + ck).code == 0);  // one more step: fine
  // A step past int64 (strtoll saturates to 2^63 - 1 silently), and one that is no number.
  for (const char* step : {"99999999999999999999", "-1", "12abc", ""}) {
    set_metadata(ck + "/optimizer.safetensors", "step", step);
    expect_refused(SMALL + "--steps 5 --load " + ck,
                   {ck + "/optimizer.safetensors", "no valid step", "'" + std::string(step) + "'"});
  }
  // A number where safetensors keeps strings: named as such (it read as a missing step, '').
  set_metadata(ck + "/optimizer.safetensors", "step", 2);
  expect_refused(SMALL + "--steps 5 --load " + ck,
                 {ck + "/optimizer.safetensors", "__metadata__ step is 2, not a string"});
  set_metadata(ck + "/optimizer.safetensors", "step", "9223372036854775807");  // int64's largest
  expect_refused(SMALL + "--steps 5 --load " + ck, {"past where --steps 5 ends"});
}

// ----------------------------------------------------------------------------
// --steps 0: load and save, no step

TEST_CASE(
    "--steps 0 --load A --save B converts a checkpoint without a step: byte-exact where "
    "nothing converts, bf16 widened exactly, shards joined into one file",
    "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(run_train(SMALL + "--steps 2 --save " + ck).code == 0);
  RunResult r = run_train(SMALL + "--steps 0 --load " + ck + " --save " + dir.file("same"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, !Contains("step     1/"));
  for (const char* f : {"/config.json", "/model.safetensors", "/optimizer.safetensors"})
    CHECK(read_whole_file(dir.file("same") + f) == read_whole_file(ck + f));

  // bf16 weights to fp32: every value widened exactly; Adam's state and step as they were.
  const std::string bf16 = dir.file("bf16");
  REQUIRE(run_train(SMALL + "--steps 2 --save-dtype bf16 --save " + bf16).code == 0);
  REQUIRE(run_train(SMALL + "--steps 0 --load " + bf16 + " --save " + dir.file("wide")).code == 0);
  auto narrow = read_raw_tensors(bf16 + "/model.safetensors");
  auto wide = read_raw_tensors(dir.file("wide/model.safetensors"));
  REQUIRE(wide.size() == narrow.size());
  for (auto& [name, t] : narrow) {
    INFO(name);
    REQUIRE(t.dtype == "BF16");
    REQUIRE(wide[name].dtype == "F32");
    REQUIRE(wide[name].bytes.size() == 2 * t.bytes.size());
    for (size_t i = 0; i < t.bytes.size() / 2; i++) {
      uint16_t b;
      uint32_t f;
      memcpy(&b, &t.bytes[2 * i], 2), memcpy(&f, &wide[name].bytes[4 * i], 4);
      REQUIRE(f == (uint32_t)b << 16);
    }
  }
  CHECK(read_whole_file(dir.file("wide/optimizer.safetensors")) ==
        read_whole_file(bf16 + "/optimizer.safetensors"));
  CHECK_THAT(read_whole_file(dir.file("wide/config.json")),
             Contains("\"torch_dtype\": \"float32\""));

  // A Hugging Face sharded checkpoint (index + two shards) into one model.safetensors: the
  // same bytes as the single file it was cut from.
  const std::string sharded = dir.file("sharded");
  fs::create_directory(sharded);
  fs::copy(ck + "/config.json", sharded + "/config.json");
  std::map<std::string, RawTensor> all = read_raw_tensors(ck + "/model.safetensors"), a, b;
  nlohmann::json index = {{"metadata", nlohmann::json::object()},
                          {"weight_map", nlohmann::json::object()}};
  for (auto& [name, t] : all) {
    const bool first = name.find("layers") != std::string::npos;
    (first ? a : b)[name] = t;
    index["weight_map"][name] =
        first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  write_raw(sharded + "/model-00001-of-00002.safetensors", a);
  write_raw(sharded + "/model-00002-of-00002.safetensors", b);
  std::ofstream(sharded + "/model.safetensors.index.json") << index.dump(2);
  r = run_train(SMALL + "--steps 0 --load " + sharded + " --save " + dir.file("joined"));
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(read_whole_file(dir.file("joined/model.safetensors")) ==
        read_whole_file(ck + "/model.safetensors"));

  // Without --save a run of no step would do nothing; --save-grads would never be written.
  expect_refused(SMALL + "--steps 0 --load " + ck, {"--steps 0 trains nothing", "--save DIR"});
  expect_refused(SMALL + "--steps 0 --load " + ck + " --save " + dir.file("x") + " --save-grads " +
                     dir.file("g.safetensors"),
                 {"--save-grads", "--steps 0 takes no step"});
}

// ----------------------------------------------------------------------------
// Outputs that would overwrite inputs

TEST_CASE(
    "an output that is an input or another output is refused before the run, naming both, "
    "symlinks and hard links followed",
    "[safety][train]") {
  TempDir dir;
  const std::string data = dir.file("data.txt"), ck = dir.file("ck");
  {
    std::ofstream f(data);
    for (int i = 0; i < 400; i++) f << "the quick brown fox jumps over the lazy dog. ";
  }
  const std::string text = read_whole_file(data);
  REQUIRE(run_train(SMALL + "--steps 1 --data " + data + " --save " + ck).code == 0);
  const std::string model = read_whole_file(ck + "/model.safetensors");
  fs::create_symlink("data.txt", dir.file("data_link"));
  fs::create_hard_link(data, dir.file("data_hard"));
  fs::create_symlink("a.json", dir.file("a_link"));
  struct Case {
    std::string flags;
    std::vector<std::string> says;
  } cases[] = {
      {"--data " + data + " --log-json " + data,
       {"--log-json " + data + " would overwrite --data " + data}},
      {"--data " + data + " --trace " + dir.file("data_link"), {"--trace", "--data " + data}},
      {"--data " + data + " --save-grads " + dir.file("data_hard"), {"--save-grads", "--data"}},
      {"--load " + ck + " --steps 3 --log-json " + ck + "/model.safetensors",
       {"--log-json " + ck + "/model.safetensors would overwrite --load " + ck}},
      {"--load " + ck + " --steps 3 --save-grads " + ck + "/optimizer.safetensors",
       {"--save-grads", "--load " + ck}},
      {"--data " + ck + "/model.safetensors --save " + ck, {"--save " + ck, "--data"}},
      {"--log-json " + dir.file("a.json") + " --trace " + dir.file("a.json"),
       {"--log-json " + dir.file("a.json") + " and --trace " + dir.file("a.json"), "same file"}},
      {"--log-json " + dir.file("a.json") + " --trace " + dir.file("a_link"),
       {"--log-json", "--trace"}},
      {"--save " + dir.file("out") + " --trace " + dir.file("out/config.json"),
       {"--save " + dir.file("out"), "--trace"}},
      {"--save " + dir.file("out") + " --log-json " + dir.file("out"), {"--save", "--log-json"}},
  };
  for (const Case& c : cases) expect_refused(SMALL + "--steps 2 " + c.flags, c.says);
  CHECK(read_whole_file(data) == text);  // nothing was touched
  CHECK(read_whole_file(ck + "/model.safetensors") == model);
  CHECK_FALSE(fs::exists(dir.file("a.json")));
  // Resuming in place is not a conflict: every file is read before the save swaps DIR whole.
  // A log inside DIR under a name picoscale does not write stays through the swap.
  RunResult r = run_train(SMALL + "--steps 3 --data " + data + " --load " + ck + " --save " + ck +
                          " --log-json " + ck + "/log.jsonl");
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(read_json_lines(ck + "/log.jsonl").size() == 2);
  CHECK(read_whole_file(ck + "/model.safetensors") != model);
}

TEST_CASE(
    "--save into an older checkpoint keeps what picoscale did not write (a tokenizer, a "
    "folder), drops the older weights' shards, and stays atomic",
    "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(run_train(SMALL + "--steps 1 --save " + ck).code == 0);
  std::ofstream(ck + "/tokenizer.json") << "{\"version\": \"1.0\"}";
  fs::create_directories(ck + "/eval/results");
  std::ofstream(ck + "/eval/results/scores.txt") << "0.5";
  fs::create_symlink("tokenizer.json", ck + "/tokenizer_link.json");
  // An older sharded model's index and shards: superseded by the new model.safetensors.
  std::ofstream(ck + "/model.safetensors.index.json")
      << "{\"weight_map\": {\"lm_head.weight\": \"model-00001-of-00002.safetensors\"}}";
  std::ofstream(ck + "/model-00001-of-00002.safetensors") << "old";
  std::ofstream(ck + "/model-00002-of-00002.safetensors") << "old";
  RunResult r = run_train(SMALL + "--steps 2 --load " + ck + " --save " + ck);
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK(read_whole_file(ck + "/tokenizer.json") == "{\"version\": \"1.0\"}");
  CHECK(read_whole_file(ck + "/eval/results/scores.txt") == "0.5");
  CHECK(fs::is_symlink(ck + "/tokenizer_link.json"));
  CHECK_FALSE(fs::exists(ck + "/model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(ck + "/model-00001-of-00002.safetensors"));
  CHECK_FALSE(fs::exists(ck + "/model-00002-of-00002.safetensors"));
  CHECK(run_train(SMALL + "--steps 3 --load " + ck).code == 0);
  // Only the checkpoint and nothing beside it (no temporary left).
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename());
  CHECK(names == std::vector<std::string>{"ck"});
}

TEST_CASE(
    "a save killed at any moment leaves the old checkpoint or the new one, and the user's "
    "files in either",
    "[safety]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  auto tensors = [](float value) {
    std::vector<NamedTensor> ts = {{"a.weight", empty({64, 64}, Mem::Params)}};
    fill_(ts[0].tensor, value);
    return ts;
  };
  save_checkpoint(ck, ModelConfig{}, tensors(1), nullptr);
  std::ofstream(ck + "/tokenizer.json") << "mine";
  fs::create_directory(ck + "/notes");
  std::ofstream(ck + "/notes/a.txt") << "kept";
  for (int trial = 0; trial < 10; trial++) {
    pid_t child = fork();
    if (child == 0)
      for (int i = 2;; i++) save_checkpoint(ck, ModelConfig{}, tensors((float)i), nullptr);
    usleep(2000 + 3000 * trial);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    INFO("trial " << trial);
    std::vector<NamedTensor> back = tensors(0);
    load_checkpoint(ck, back, nullptr);
    REQUIRE(back[0].tensor.f32()[0] >= 1);  // a whole checkpoint, old or new
    REQUIRE(read_whole_file(ck + "/tokenizer.json") == "mine");
    REQUIRE(read_whole_file(ck + "/notes/a.txt") == "kept");
  }
}

// ----------------------------------------------------------------------------
// Faults that cannot fire

TEST_CASE("a --fault that cannot fire in this run exits 2 saying why; one that can still fires",
          "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(run_train(SMALL + "--steps 1 --save " + ck).code == 0);  // at step 1
  struct Case {
    std::string flags;
    std::vector<std::string> says;
  } never[] = {
      {"--steps 3 --fault hang:0:5", {"--fault hang:0:5 would never fire", "steps 0 to 2"}},
      {"--steps 3 --fault crash:0:1:save", {"crash:0:1:save", "saves no checkpoint", "--save"}},
      {"--steps 3 --fault crash:0:1:validation",
       {"crash:0:1:validation", "no validation after step 1", "after steps 2"}},
      {"--steps 4 --val-every 2 --fault crash:0:2:validation",
       {"no validation after step 2", "after steps 1, 3"}},
      {"--steps 3 --fault crash:0:1:init", {"init comes once", "crash:0:0:init"}},
      {"--steps 3 --save " + dir.file("s") + " --fault crash:0:0:save",
       {"no checkpoint is saved after step 0", "after steps 2"}},
      {"--steps 6 --save " + dir.file("s") + " --save-every 2 --fault crash:0:0:save",
       {"after steps 1, 3, 5"}},
      {"--steps 3 --load " + ck + " --fault error:0:0", {"step 0", "steps 1 to 2"}},
      {"--steps 0 --load " + ck + " --save " + dir.file("s") + " --fault crash:0:1",
       {"takes no step"}},
      {"--steps 3 --stop-after 1 --fault hang:0:1:forward", {"steps 0 to 0", "--stop-after 1"}},
  };
  for (const Case& c : never) expect_refused(SMALL + c.flags, c.says);
  // inf stands for an fp16 overflow: refused without fp16's loss scaling to meet it.
  expect_refused(SMALL + "--steps 3 --fault inf:0:1", {"--fault inf:0:1", "fp32", "--dtype fp16"});
  expect_refused(SMALL + "--steps 3 --dtype bf16 --fault inf:0:1", {"bf16", "--dtype fp16"});
  expect_refused(SMALL + "--steps 3 --dtype fp16 --fault inf:0:3", {"steps 0 to 2"});
  // Faults at places the run does pass still fire.
  struct Fires {
    std::string flags, says;
  } fires[] = {
      {"--steps 2 --save " + dir.file("f") + " --fault error:0:1:save",
       "injected fault 'error' at step 1, save"},
      {"--steps 4 --save " + dir.file("f") + " --save-every 2 --fault error:0:1:save",
       "injected fault 'error' at step 1, save"},
      {"--steps 3 --fault error:0:2:validation", "injected fault 'error' at step 2, validation"},
      {"--steps 3 --load " + ck + " --fault error:0:1", "injected fault 'error' at step 1, step"},
      {"--steps 0 --load " + ck + " --save " + dir.file("f") + " --fault error:0:0:save",
       "injected fault 'error' at step 0, save"},
  };
  for (const Fires& f : fires) {
    RunResult r = run_train(SMALL + f.flags);
    INFO(f.flags << "\n" << r.output);
    CHECK(r.code != 0);
    CHECK(r.code != 2);
    CHECK_THAT(r.output, Contains(f.says));
  }
}

// The one behaviour of --fault inf: fp16 loss scaling meets the infinity on one rank by
// skipping the step on every rank and halving the scale, in every layout.
TEST_CASE("an fp16 overflow on one rank skips the step on every rank in every layout",
          "[safety][parity]") {
  TempDir dir;
  for (const char* layout :
       {"--dp 2", "--cp 2", "--dp 2 --zero 3", "--pp 2 --layers 2 --grad-acc 2", "--tp 2 --sp"}) {
    RunResult r = run_train(SMALL + "--steps 3 --dtype fp16 --fault inf:1:1 " + layout +
                                " --log-json " + dir.file("log.jsonl"),
                            2);
    INFO(layout << "\n" << r.output);
    REQUIRE(r.code == 0);
    auto log = read_json_lines(dir.file("log.jsonl"));
    REQUIRE(log.size() == 3);
    CHECK(!log[0]["skipped"].get<bool>());
    CHECK(log[1]["skipped"].get<bool>());
    CHECK(log[1]["loss_scale"].get<double>() == 65536.0);
    CHECK(!log[2]["skipped"].get<bool>());
    CHECK(log[2]["loss_scale"].get<double>() == 32768.0);
    CHECK(std::isfinite(log[2]["loss"].get<double>()));
  }
}
