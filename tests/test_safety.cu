// test_safety.cu: DESIGN §9 "every wait bounded, every file safe, every bad value refused".
// Outputs never replace a device or a symlink and never leave a checkpoint name empty; bad
// values and oversized runs stop before the first allocation with exit code 2 and the flag;
// sharded Hugging Face checkpoints load; the shuffled data order; a stuck peer in a host-side
// collective ends the job within --comm-timeout. [safety]; runs of ./train are also [train],
// runs under mpirun [parity].
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include "launch.cuh"
#include "model.cuh"
#include "refusals.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/data.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

bool is_char_device(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISCHR(st.st_mode);
}

std::vector<NamedTensor> tensors(float value) {
  std::vector<NamedTensor> ts = {{"a.weight", empty({3, 4}, Mem::Params)},
                                 {"b.weight", empty({5}, Mem::Params)}};
  for (NamedTensor& nt : ts) fill_(nt.tensor, value);
  return ts;
}
float first_value(const std::string& dir) {
  std::vector<NamedTensor> into = tensors(0);
  load_checkpoint(dir, into, nullptr);
  return into[0].tensor.f32()[0];
}

// A pid that belonged to a process that has exited (its temporaries are stale).
pid_t dead_pid() {
  pid_t child = fork();
  if (child == 0) _exit(0);
  waitpid(child, nullptr, 0);
  return child;
}
std::string host() {
  char name[256] = "";
  gethostname(name, sizeof name - 1);
  return name;
}

}  // namespace

// ----------------------------------------------------------------------------
// Files

TEST_CASE("an output never replaces a device or a symlink: a link is followed, a device refused",
          "[safety]") {
  TempDir dir;
  const std::string to_full = dir.file("full.safetensors");
  fs::create_symlink("/dev/full", to_full);
  CHECK_THAT(usage_error_of([&] { write_safetensors(to_full, tensors(1)); }),
             Contains(to_full) && Contains("/dev/full is a character device"));
  CHECK(fs::is_symlink(to_full));
  CHECK(is_char_device("/dev/full"));
  CHECK_THAT(usage_error_of([&] { check_output_file("--save-grads", to_full); }),
             Contains("--save-grads " + to_full) && Contains("character device"));
  CHECK_THAT(usage_error_of([&] { check_output_file("--trace", dir.path); }),
             Contains("--trace") && Contains("is a directory"));
  CHECK_THAT(usage_error_of([&] { check_output_file("--log-json", dir.file("no/such.json")); }),
             Contains("--log-json") && Contains("does not exist"));

  // A symlink to a file (even one not there yet): the file is written, the link stays.
  const std::string link = dir.file("link.safetensors");
  fs::create_directory(dir.file("real"));
  fs::create_symlink("real/g.safetensors", link);
  CHECK(usage_error_of([&] { check_output_file("--save-grads", link); }).empty());
  write_safetensors(link, tensors(2));
  write_safetensors(link, tensors(3));
  CHECK(fs::is_symlink(link));
  std::vector<NamedTensor> back = tensors(0);
  read_safetensors(dir.file("real/g.safetensors"), back);
  CHECK(back[0].tensor.f32()[0] == 3);
  CHECK(std::distance(fs::directory_iterator(dir.file("real")), {}) == 1);  // no temporary left

  // A checkpoint name that is a symlink: its target is replaced, the link stays.
  fs::create_symlink("real/ck", dir.file("ck"));
  save_checkpoint(dir.file("ck"), ModelConfig{}, tensors(4), nullptr);
  save_checkpoint(dir.file("ck"), ModelConfig{}, tensors(5), nullptr);
  CHECK(fs::is_symlink(dir.file("ck")));
  CHECK(first_value(dir.file("real/ck")) == 5);
  fs::create_symlink("/dev/full", dir.file("ck_full"));
  CHECK_THROWS_AS(save_checkpoint(dir.file("ck_full"), ModelConfig{}, tensors(1), nullptr),
                  UsageError);
  CHECK(is_char_device("/dev/full"));
}

TEST_CASE("after a kill at any moment of a save the name holds the old or the new checkpoint",
          "[safety]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  save_checkpoint(ck, ModelConfig{}, tensors(1), nullptr);
  // A writer killed at random moments, saving 2, 3, 4, ... over and over.
  for (int trial = 0; trial < 12; trial++) {
    pid_t child = fork();
    if (child == 0) {
      for (int i = 2;; i++) save_checkpoint(ck, ModelConfig{}, tensors((float)i), nullptr);
    }
    usleep(2000 + 3000 * trial);
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    INFO("trial " << trial);
    REQUIRE(first_value(ck) >= 1);  // a whole checkpoint, old or new
  }
  // The next save removes the temporaries the killed writers left.
  save_checkpoint(ck, ModelConfig{}, tensors(9), nullptr);
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir.path)) names.push_back(e.path().filename());
  CHECK(names == std::vector<std::string>{"ck"});
  CHECK(first_value(ck) == 9);
}

TEST_CASE(
    "a save interrupted between its two renames is loaded from DIR.old; stale temporaries "
    "of dead writers go, a live writer's stay",
    "[safety]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  // The state a writer killed between "DIR -> DIR.old" and "DIR.tmp -> DIR" leaves on a
  // filesystem without RENAME_EXCHANGE: no DIR, the whole old checkpoint beside it.
  const std::string old = ck + ".old." + host() + "." + std::to_string(dead_pid());
  save_checkpoint(old, ModelConfig{}, tensors(7), nullptr);
  CHECK(read_checkpoint_config(ck).d_model == ModelConfig{}.d_model);
  CHECK(first_value(ck) == 7);
  const std::string stale = ck + ".tmp." + host() + "." + std::to_string(dead_pid());
  const std::string live = ck + ".tmp." + host() + ".1";  // pid 1 is always alive
  fs::create_directory(stale), fs::create_directory(live);
  save_checkpoint(ck, ModelConfig{}, tensors(8), nullptr);
  CHECK(first_value(ck) == 8);
  CHECK_FALSE(fs::exists(old));
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(live));
}

TEST_CASE(
    "./train refuses an output it cannot write before the first step, and never replaces "
    "a device",
    "[safety][train]") {
  TempDir dir;
  const std::string full = dir.file("full");
  fs::create_symlink("/dev/full", full);
  for (const char* flag : {"--save-grads", "--log-json", "--trace"})
    expect_refused(SMALL + "--steps 2 " + flag + " " + full,
                   {std::string(flag) + " " + full, "character device"});
  expect_refused(SMALL + "--steps 2 --save " + full, {"--save " + full, "not a checkpoint"});
  CHECK(fs::is_symlink(full));
  CHECK(is_char_device("/dev/full"));
  std::ofstream(dir.file("plain")) << "a file";
  expect_refused(SMALL + "--steps 2 --save " + dir.file("plain/ck"), {"--save", "cannot create"});
  expect_refused(SMALL + "--steps 2 --log-json " + dir.file("none/log.jsonl"), {"--log-json"});
}

// ----------------------------------------------------------------------------
// Values

TEST_CASE("bad values are refused with exit code 2, the flag and the fix", "[safety][train]") {
  expect_refused("--seq 2147483647", {"--seq 2147483647", "maximum 1048576"});
  expect_refused("--mbs 2000000000", {"--mbs 2000000000", "maximum"});
  expect_refused("--lr inf", {"--lr inf", "positive number"});
  expect_refused("--weight-decay nan", {"--weight-decay nan"});
  expect_refused("--weight-decay -0.1", {"--weight-decay -0.1", ">= 0"});
  expect_refused("--lr 1e-3 --min-lr 2e-3", {"--min-lr 0.002", "to --lr 0.001"});
  expect_refused("--grad-clip nan", {"--grad-clip nan"});
  expect_refused("--rope-theta 0", {"--rope-theta 0", ">= 1"});
  expect_refused("--rope-theta 0.5", {"--rope-theta 0.5", ">= 1"});  // turns past a radian
  expect_refused("--rope-theta 1e-40", {"--rope-theta", ">= 1"});    // a NaN loss at step 1
  expect_refused("--rope-theta nan", {"--rope-theta nan"});
  expect_refused("--comm-timeout inf", {"--comm-timeout inf"});
  expect_refused("--comm-timeout 0.001", {"--comm-timeout 0.001", ">= 1"});  // no launch made it
  expect_refused("--fault crash:1", {"--fault crash:1", "KIND:RANK:STEP"});
  expect_refused("--fault crash:x:3", {"--fault crash:x:3", "rank 'x'"});
  expect_refused("--fault explode:0:1", {"unknown kind 'explode'"});
  expect_refused("--fault crash:1:1", {"rank 1 does not exist"});
  expect_refused("--fault hang:0:1:inside",
                 {"--fault hang:0:1:inside", "unknown place 'inside'", "forward, backward"});
  expect_refused("--fault hang:0:1:step:2", {"not three or four fields"});
  expect_refused("--sample 2000000", {"--sample 2000000", "maximum"});
  // A step's tokens a rank reads at once, and a model whose parameter count int64 would not
  // hold (4096 layers of 2^24 x 2^24 matrices: about 4.6e18 parameters), even on meta.
  expect_refused("--grad-acc 2147483647", {"--grad-acc 2147483647", "lower --grad-acc"});
  expect_refused("--device meta --layers 4096 --d-model 16777216 --heads 1 --kv-heads 1",
                 {"--d-model, --layers", "would hold", "past the 2^50"});
  // Seeds are whole numbers (not a wrapped -1), empty values are no zeros, and a top-k needs
  // experts to route to.
  expect_refused("--seed -1", {"--seed: -1 is past", "from 0 to 18446744073709551615"});
  expect_refused("--seed 18446744073709551616", {"--seed: 18446744073709551616 is past"});
  expect_refused("--lr ''", {"--lr", "an empty value; give a number"});
  expect_refused("--top-k 2", {"--top-k 2", "this model has no experts: add --experts N"});
  expect_refused("--aux-loss-coef 0.5", {"--aux-loss-coef 0.5", "no experts"});
  expect_refused("--data /proc/self/status", {"--data /proc/self/status: a kernel file of /proc"});
  // A report no part of the run measures: it printed nothing, and said nothing.
  expect_refused("--report comm,experts",
                 {"--report experts: it measures a mixture's routing", "add --experts N"});
  expect_refused("--report balance",
                 {"--report balance: it measures the ring attention's work", "add --cp 2 or more"});
  // A number's text is checked before it is converted, naming the flag; and an empty profile
  // name is no default.
  expect_refused(
      "--val-seqs 99999999999",
      {"--val-seqs: 99999999999 is past the whole numbers this flag holds", "2147483647"});
  expect_refused("--steps 2.5", {"--steps: 2.5 is not a whole number"});
  expect_refused("--lr 3e-4x", {"--lr: 3e-4x is not a number"});
  expect_refused("--kv-heads 010", {"--kv-heads 10 does not divide"});  // decimal, not octal 8
  expect_refused("--gpu ''", {"--gpu '': an empty profile name"});
  // A format the profile prices at no peak (the A100 has no fp8 tensor cores): MFU 0% before.
  expect_refused("--device meta --dtype fp8 --gpu a100",
                 {"--dtype fp8: the a100 profile has no fp8 peak", "pick --gpu h100 or h200"});
  expect_refused("--load x --score y --steps 5", {"--steps would be ignored"});
  expect_refused("--load x --score y --save z", {"--save would be ignored"});
  expect_refused("--load x --score y --report memory", {"--report would be ignored"});
  // Sizes are checked against this rank's memory before anything is allocated.
  expect_refused("--d-model 16384 --heads 128 --kv-heads 8 --ffn 65536 --layers 64",
                 {"per rank", "host memory", "lower --mbs"});
}

namespace {
// A copy `name` of the checkpoint dir/`from`, its config.json's first match of `pattern`
// replaced by `with`: the flag that loads it.
std::string load_edited(const TempDir& dir, const std::string& from, const std::string& name,
                        const std::string& pattern, const std::string& with) {
  fs::copy(dir.file(from), dir.file(name));
  const std::string cfg = read_whole_file(dir.file(from + "/config.json"));
  const std::string changed =
      std::regex_replace(cfg, std::regex(pattern), with, std::regex_constants::format_first_only);
  REQUIRE(changed != cfg);
  std::ofstream(dir.file(name) + "/config.json") << changed;
  return "--load " + dir.file(name);
}
}  // namespace

TEST_CASE("a checkpoint's config.json with sizes past the maxima is refused, naming the key",
          "[safety][train]") {
  TempDir dir;
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir.file("ok")).code == 0);
  for (const std::string key : {"num_hidden_layers", "max_position_embeddings"})
    expect_refused(
        load_edited(dir, "ok", key, "\"" + key + "\": *[0-9]+", "\"" + key + "\": 2147483647"),
        {key + " 2147483647", "maximum"});
}

// Every device holds a rank's step of tokens on the host (16 bytes a token: inputs and targets,
// whole and the rank's share); the meta device too, which stores nothing else. 16 x 128 tokens
// x 1,000,000 micro-batches = 2.048e9 tokens, 30.5 GiB: refused where that is more than half
// the host (it ran the machine out of memory), skipped on a host of 61 GiB or more.
TEST_CASE("a step's tokens past half the host's memory are refused, on the meta device too",
          "[safety][train]") {
  const double host = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  if (host / 2 >= 16 * 2.048e9) {
    WARN("SKIP: this host's memory holds the step's 30.5 GiB of tokens twice over");
    return;
  }
  expect_refused("--device meta --model tiny --mbs 16 --seq 128 --grad-acc 1000000",
                 {"--grad-acc 1000000", "held on the host", "lower --grad-acc"});
}

// What picoscale cannot honour in a config.json is refused naming the key, not the flags the
// user never gave: a Llama's attention dropout (its block has none), a GPT block's that differs
// from its hidden_dropout (one --dropout for both), a mixture's top-k past its experts.
TEST_CASE("a checkpoint's config.json with a dropout or top-k picoscale cannot honour is refused",
          "[safety][train]") {
  TempDir dir;
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir.file("llama")).code == 0);
  REQUIRE(run_train(SMALL + "--steps 1 --dropout 0.1 --save " + dir.file("gpt")).code == 0);
  REQUIRE(run_train(SMALL + "--steps 1 --experts 4 --top-k 2 --save " + dir.file("moe")).code == 0);
  expect_refused(load_edited(dir, "llama", "llama_drop", "\\{", "{\"attention_dropout\": 0.1, "),
                 {"config.json: attention_dropout 0.1", "no dropout"});
  expect_refused(load_edited(dir, "gpt", "gpt_drop", "\"attention_dropout\": *[0-9.e-]+",
                             "\"attention_dropout\": 0.2"),
                 {"config.json: attention_dropout 0.2", "hidden_dropout's 0.1"});
  expect_refused(load_edited(dir, "moe", "moe_top_k", "\"num_experts_per_tok\": *[0-9]+",
                             "\"num_experts_per_tok\": 9"),
                 {"config.json: num_experts_per_tok 9 above num_local_experts 4"});
  // And one that agrees loads: a Llama's attention_dropout 0.0, as transformers writes it.
  CHECK(run_train(SMALL + "--steps 2 " +
                  load_edited(dir, "llama", "llama_zero", "\\{", "{\"attention_dropout\": 0.0, "))
            .code == 0);
}

TEST_CASE(
    "--load says when AdamW starts fresh, and refuses --rope-theta and --tie-embeddings "
    "that disagree with the checkpoint",
    "[safety][train]") {
  TempDir dir;
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir.file("ck")).code == 0);
  RunResult with_state = run_train(SMALL + "--steps 2 --load " + dir.file("ck"));
  INFO(with_state.output);
  CHECK(with_state.code == 0);
  CHECK_THAT(with_state.output, !Contains("starts fresh"));
  fs::remove(dir.file("ck/optimizer.safetensors"));  // what a Hugging Face model holds
  RunResult fresh = run_train(SMALL + "--steps 1 --load " + dir.file("ck"));
  INFO(fresh.output);
  CHECK(fresh.code == 0);
  CHECK(count_occurrences(fresh.output, "AdamW starts fresh at step 0") == 1);
  expect_refused("--load " + dir.file("ck") + " --rope-theta 500000",
                 {"--rope-theta 500000 disagrees", "rope_theta 10000"});
  expect_refused("--load " + dir.file("ck") + " --tie-embeddings",
                 {"--tie-embeddings disagrees", "tie_word_embeddings false"});
  // Flags that agree are accepted.
  CHECK(run_train(SMALL + "--steps 1 --load " + dir.file("ck") + " --rope-theta 10000").code == 0);
}

// Guards: --dropout over a loaded checkpoint trained with it, but the saved config.json kept the
// checkpoint's (none for a Llama, the old value for a GPT), so a resume trained without it.
TEST_CASE(
    "a saved config.json says the dropout its run trained with; a Llama's, which cannot, "
    "is refused --dropout with --save",
    "[safety][train]") {
  ModelConfig gpt;
  gpt.dropout = 0.1f;
  ModelConfig loaded = config_from_hf(hf_config(gpt), "ck");  // picoscale's GPT architecture
  CHECK(config_records_dropout(loaded));
  loaded.dropout = 0.3f;  // --dropout 0.3 over it
  const nlohmann::json back = hf_config(loaded);
  CHECK(back["hidden_dropout"].get<double>() == 0.3);  // the shortest decimal of 0.3f
  CHECK(back["attention_dropout"].get<double>() == 0.3);
  CHECK(config_from_hf(back, "ck2").dropout == 0.3f);
  CHECK_FALSE(config_records_dropout(config_from_hf(hf_config(ModelConfig{}), "ck")));  // Llama
  TempDir dir;
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir.file("ck")).code == 0);
  expect_refused("--load " + dir.file("ck") + " --dropout 0.1 --save " + dir.file("ck2"),
                 {"--dropout 0.1 with --load", "no place for picoscale's dropout"});
  CHECK_FALSE(fs::exists(dir.file("ck2")));
  // Without --save nothing is recorded: fine-tuning a Llama with dropout runs.
  CHECK(run_train(SMALL + "--steps 2 --load " + dir.file("ck") + " --dropout 0.1").code == 0);
}

// ----------------------------------------------------------------------------
// Checkpoint contents

TEST_CASE("config.json states bos_token_id and eos_token_id: null for byte tokens", "[safety]") {
  const nlohmann::json j = hf_config(ModelConfig{});
  REQUIRE(j.contains("bos_token_id"));
  REQUIRE(j.contains("eos_token_id"));
  CHECK(j["bos_token_id"].is_null());
  CHECK(j["eos_token_id"].is_null());
}

TEST_CASE(
    "a sharded Hugging Face checkpoint loads; a missing shard or a tensor listed twice is "
    "named",
    "[safety]") {
  TempDir dir;
  const std::string ck = dir.file("hf");
  fs::create_directory(ck);
  std::vector<NamedTensor> src = tensors(0);
  for (int64_t i = 0; i < 12; i++) src[0].tensor.f32()[i] = (float)i;
  for (int64_t i = 0; i < 5; i++) src[1].tensor.f32()[i] = 100.0f + i;
  write_safetensors(ck + "/model-00001-of-00002.safetensors", {src[0]});
  write_safetensors(ck + "/model-00002-of-00002.safetensors", {src[1]});
  const std::string index = R"({"metadata": {"total_size": 68}, "weight_map": {
      "a.weight": "model-00001-of-00002.safetensors",
      "b.weight": "model-00002-of-00002.safetensors"}})";
  std::ofstream(ck + "/model.safetensors.index.json") << index;
  std::vector<NamedTensor> into = tensors(-1);
  CHECK_FALSE(load_checkpoint(ck, into, nullptr));
  CHECK(to_host_floats(into[0].tensor) == to_host_floats(src[0].tensor));
  CHECK(to_host_floats(into[1].tensor) == to_host_floats(src[1].tensor));

  std::ofstream(ck + "/model.safetensors.index.json")
      << std::regex_replace(index, std::regex("00002-of"), "00003-of");
  CHECK_THAT(usage_error_of([&] { load_checkpoint(ck, tensors(0), nullptr); }),
             Contains("shard model-00003-of-00002.safetensors") && Contains("not found"));
  std::ofstream(ck + "/model.safetensors.index.json") << R"({"weight_map": {
      "a.weight": "model-00001-of-00002.safetensors",
      "b.weight": "model-00002-of-00002.safetensors",
      "a.weight": "model-00002-of-00002.safetensors"}})";
  CHECK_THAT(usage_error_of([&] { load_checkpoint(ck, tensors(0), nullptr); }),
             Contains("tensor a.weight is listed twice"));
  // The same tensor in two shard files.
  write_safetensors(ck + "/model-00002-of-00002.safetensors", {src[1], src[0]});
  std::ofstream(ck + "/model.safetensors.index.json") << index;
  CHECK_THAT(usage_error_of([&] { load_checkpoint(ck, tensors(0), nullptr); }),
             Contains("tensor a.weight is also in shard model-00001-of-00002.safetensors"));
  std::ofstream(ck + "/model.safetensors.index.json") << R"({"weight_map": {"a.weight": "x"}})";
  CHECK_THAT(usage_error_of([&] { load_checkpoint(ck, tensors(0), nullptr); }),
             Contains("tensor b.weight: not in weight_map"));
}

// ----------------------------------------------------------------------------
// Data order

TEST_CASE(
    "shuffled data: each epoch reads every window once, not in file order, the same for "
    "any layout; --no-shuffle keeps file order",
    "[safety][data]") {
  TempDir dir;
  std::vector<int32_t> tokens(2000);
  for (int i = 0; i < 2000; i++) tokens[i] = i % 60000;
  write_token_shard(dir.file("count.bin"), tokens);
  const Dataset data = load_dataset(dir.file("count.bin"), 0.1, 16);
  const int seq = 16, global_batch = 6;
  const int64_t windows = (1800 - 1) / seq;  // 112
  std::vector<int64_t> starts;
  for (int64_t step = 0; step < 2 * windows / global_batch + 1; step++) {
    std::vector<int32_t> in(global_batch * seq), tg(global_batch * seq);
    fill_train_batch(data, step, global_batch, 0, global_batch, seq, in.data(), tg.data(), true,
                     1337);
    for (int j = 0; j < global_batch; j++) {
      starts.push_back(in[j * seq]);  // the token value is its position
      REQUIRE(tg[j * seq] == in[j * seq] + 1);
    }
    // Layout-free: dp ranks x micro-batches cut the same global batch.
    for (int per : {1, 2, 3}) {
      for (int first = 0; first < global_batch; first += per) {
        std::vector<int32_t> part(per * seq), part_tg(per * seq);
        fill_train_batch(data, step, global_batch, first, per, seq, part.data(), part_tg.data(),
                         true, 1337);
        REQUIRE(std::equal(part.begin(), part.end(), in.begin() + first * seq));
      }
    }
  }
  for (int epoch = 0; epoch < 2; epoch++) {
    std::vector<int64_t> e(starts.begin() + epoch * windows,
                           starts.begin() + (epoch + 1) * windows);
    std::vector<int64_t> file_order(windows);
    for (int64_t w = 0; w < windows; w++) file_order[w] = w * seq;
    CHECK(e != file_order);
    std::sort(e.begin(), e.end());
    CHECK(e == file_order);  // a permutation of the windows
  }
  CHECK(!std::equal(starts.begin(), starts.begin() + windows, starts.begin() + windows));
  // Another seed, another order; --no-shuffle is the file order.
  std::vector<int32_t> a(seq), b(seq), c(seq), t(seq);
  fill_train_batch(data, 3, global_batch, 0, 1, seq, a.data(), t.data(), true, 1337);
  fill_train_batch(data, 3, global_batch, 0, 1, seq, b.data(), t.data(), true, 7);
  fill_train_batch(data, 3, global_batch, 0, 1, seq, c.data(), t.data(), false, 1337);
  CHECK(a != b);
  CHECK(c[0] == (3 * global_batch * seq) % (1800 - seq));
  // The permutation itself, for sizes that are and are not powers of 4.
  for (int64_t n : {1, 2, 3, 4, 5, 17, 64, 1000}) {
    std::set<int64_t> seen;
    for (int64_t i = 0; i < n; i++) seen.insert(shuffled_window(i, n, 42, 0));
    CHECK((int64_t)seen.size() == n);
    CHECK(*seen.rbegin() == n - 1);
  }
}

TEST_CASE("./train shuffles by default and --no-shuffle reads file order", "[safety][train]") {
  TempDir dir;
  auto first_loss = [&](const std::string& flags) {
    const std::string log = dir.file("log.jsonl");
    RunResult r = run_train(SMALL + "--steps 1 --log-json " + log + " " + flags);
    INFO(r.output);
    REQUIRE(r.code == 0);
    return read_json_lines(log).at(0)["loss"].get<double>();
  };
  const double shuffled = first_loss(""), file_order = first_loss("--no-shuffle");
  CHECK(shuffled != file_order);  // other sequences, another loss
  CHECK(first_loss("--seed 1337") == shuffled);
  CHECK(first_loss("--no-shuffle") == file_order);
}

// ----------------------------------------------------------------------------
// Waits

static double run_seconds(const std::string& cmd, RunResult& r) {
  auto t0 = std::chrono::steady_clock::now();
  r = run_command(cmd);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST_CASE(
    "a peer that never joins a host-side collective or an all-to-all ends the job within "
    "--comm-timeout, naming the collective and the group",
    "[safety][parity]") {
  // tests/mpi/test_safety.cu and test_all_to_all.cu: the hidden cases, a 2 s timeout, rank 1
  // asleep for 60 s.
  for (const char* which : {"all_reduce_host", "agree_on_error", "exchange_counts", "all_to_all"}) {
    RunResult r;
    double seconds = run_seconds(
        "timeout -k 10 90 mpirun --oversubscribe -np 2 build/mpi_tests "
        "'[.stuck-" +
            std::string(which) + "]'",
        r);
    INFO(which << "\n" << r.output);
    CHECK(r.code != 0);
    CHECK(r.code != 124);     // not ended by `timeout`: by the collective's own deadline
    CHECK(seconds < 2 + 20);  // the timeout, plus start-up and MPI_Abort
    CHECK_THAT(r.output, Contains(std::string(which) + " on world") && Contains("--comm-timeout"));
  }
}

// Communicator set-up waits like every collective (comm_setup.cu, "Set-up waits"): the splits into
// groups come after a nonblocking barrier on the world, waited for against --comm-timeout, so a
// rank that never arrives (here: asleep, --fault hang:1:0:init, before any collective) ends
// the job instead of leaving its peers in MPI_Comm_split forever.
TEST_CASE(
    "a rank that never reaches communicator set-up ends the job within --comm-timeout, "
    "naming the step and the group",
    "[safety][parity]") {
  struct Case {
    std::string cmd, waits_on;
  } cases[] = {
      // ./train's first collective: the node-local ranks, which choose each rank's GPU.
      {"mpirun --oversubscribe -np 2 ./train --device cpu --dp 2 --steps 1 --comm-timeout 2 "
       "--fault hang:1:0:init",
       "barrier before MPI_Comm_split_type (node-local ranks) on world"},
      // comm_init itself (tests/mpi/test_safety.cu), under --comm mpi and auto.
      {"mpirun --oversubscribe -np 2 build/mpi_tests '[.stuck-comm_init]'",
       "barrier before MPI_Comm_split into world on world"},
      {"mpirun --oversubscribe -np 2 build/mpi_tests '[.stuck-comm_init-auto]'",
       "barrier before MPI_Comm_split_type (GPU bus ids) on world"},
  };
  for (const Case& c : cases) {
    RunResult r;
    double seconds = run_seconds("timeout -k 10 60 " + c.cmd, r);
    INFO(c.cmd << "\n" << r.output);
    CHECK(r.code != 0);
    CHECK(r.code != 124);  // not ended by `timeout`: by the set-up's own deadline
    CHECK(seconds < 2 + 20);
    CHECK_THAT(r.output, Contains("rank 0: " + c.waits_on +
                                  ", 0 B did not finish within 2s "
                                  "(--comm-timeout)"));
    if (c.cmd.find("--fault") != std::string::npos)
      CHECK_THAT(r.output, Contains("injected fault 'hang' at step 0, init"));
  }
}
