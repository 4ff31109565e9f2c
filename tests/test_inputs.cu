// test_inputs.cu: DESIGN §9 for what a run is given and what it leaves. Inputs that would block a
// read forever (a FIFO in a file's place) or end it in an allocation failure (a file larger than
// memory), JSON nested deep enough to overflow a stack, files that differ between ranks past
// their first bytes, values that load and then mislead (a negative second moment, an absurd
// eps, a stale periodic checkpoint, an empty path), outputs that would remove what picoscale
// did not write, faults that no peer would notice, the job's end, and the suite's own report
// of failing cases. Each case exits 2 naming the flag or file and the fix, or is bounded in
// time. [safety]; runs of ./train are also [train], runs under mpirun [parity].
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "launch.cuh"
#include "refusals.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/data.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

struct Timed {
  RunResult result;
  double seconds;
};
// A shell command under `timeout 90` (exit 124 when it ran past it; 137 when it ignored the TERM
// for 10 s more, as a hung mpirun does), timed.
Timed bounded(const std::string& command) {
  auto t0 = std::chrono::steady_clock::now();
  RunResult r = run_command("timeout -k 10 90 " + command);
  return {r, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}
// ./train (np ranks under mpirun; 0: one process), bounded.
Timed train(const std::string& args, int np = 0) {
  const std::string launcher =
      np > 0 ? "mpirun --oversubscribe -np " + std::to_string(np) + " " : "";
  return bounded(launcher + "./train --device cpu " + args);
}
// Refused: exit code 2 within seconds, before the first step, saying each of `says`.
void expect_refused_in_time(const std::string& args, const std::vector<std::string>& says,
                            int np = 0) {
  Timed t = train(args, np);
  INFO(args << "\n" << t.result.output);
  CHECK(t.result.code == 2);
  CHECK(t.seconds < 60);
  for (const std::string& s : says) CHECK_THAT(t.result.output, Contains(s));
  CHECK_THAT(t.result.output, !Contains("step     1/"));
}

// A text file of `bytes` bytes: a repeated sentence.
void write_text(const std::string& path, size_t bytes) {
  std::string text;
  while (text.size() < bytes) text += "the quick brown fox jumps over the lazy dog. ";
  std::ofstream(path, std::ios::binary) << text.substr(0, bytes);
}
void make_fifo(const std::string& path) {
  REQUIRE(mkfifo(path.c_str(), 0600) == 0);
}
// Overwrites 4 bytes at `offset` of a file with the float x.
void poke_float(const std::string& path, uint64_t offset, float x) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp((std::streamoff)offset);
  f.write((const char*)&x, 4);
}
// Where the data of tensor `name` starts in a safetensors file (read with a plain parser).
uint64_t data_offset(const std::string& path, const std::string& name) {
  const std::string bytes = read_whole_file(path);
  uint64_t n = 0;
  memcpy(&n, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  return 8 + n + header[name]["data_offsets"][0].get<uint64_t>();
}
// JSON text nested `depth` arrays deep around `inner`.
std::string nested(int depth, const std::string& inner = "1") {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

}  // namespace

// ----------------------------------------------------------------------------
// Waits no timeout bounds: a FIFO as an input

// Guards: every rank opening each input whole for the launch's checksums before any check
// (runtime/launch.cu), and the readers themselves; a FIFO that nobody writes blocks an open or
// a read forever, whatever --comm-timeout says.
TEST_CASE("a FIFO given as an input is refused within seconds, on one rank and under mpirun",
          "[safety][train][parity]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(train(SMALL + "--steps 1 --save " + ck).result.code == 0);
  make_fifo(dir.file("fifo.txt"));
  make_fifo(dir.file("fifo.bin"));
  for (int np : {0, 2}) {
    INFO("ranks: " << np);
    expect_refused_in_time(SMALL + "--steps 2 --data " + dir.file("fifo.txt"),
                           {"--data " + dir.file("fifo.txt"), "FIFO", "not a regular file"}, np);
    expect_refused_in_time(SMALL + "--steps 2 --data " + dir.file("fifo.bin"), {"FIFO"}, np);
    expect_refused_in_time("--load " + ck + " --score " + dir.file("fifo.txt"),
                           {"--score " + dir.file("fifo.txt"), "FIFO"}, np);
  }
  // Each file a --load reads: config.json, the weights (whole or a shard), the optimizer state.
  for (const char* name : {"config.json", "model.safetensors", "optimizer.safetensors"}) {
    INFO(name);
    const std::string copy = dir.file(std::string("ck_") + name);
    fs::copy(ck, copy);
    fs::remove(copy + "/" + name);
    make_fifo(copy + "/" + name);
    expect_refused_in_time(SMALL + "--steps 3 --load " + copy, {copy, name, "FIFO"});
    expect_refused_in_time(SMALL + "--steps 3 --load " + copy, {"FIFO"}, 2);
  }
  const std::string sharded = dir.file("sharded");
  fs::copy(ck, sharded);
  fs::remove(sharded + "/model.safetensors");
  make_fifo(sharded + "/model-00001-of-00001.safetensors");
  nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
  for (auto& [name, t] : read_raw_tensors(ck + "/model.safetensors"))
    index["weight_map"][name] = "model-00001-of-00001.safetensors";
  std::ofstream(sharded + "/model.safetensors.index.json") << index.dump();
  expect_refused_in_time(SMALL + "--steps 3 --load " + sharded, {"model-00001-of-00001", "FIFO"});
  fs::remove(sharded + "/model.safetensors.index.json");
  make_fifo(sharded + "/model.safetensors.index.json");
  expect_refused_in_time(SMALL + "--steps 3 --load " + sharded, {"index.json", "FIFO"});
}

TEST_CASE("./plan refuses a FIFO or a directory as --campaign or --comm-fit", "[safety]") {
  TempDir dir;
  make_fifo(dir.file("fifo"));
  for (const std::string& flags : {"--campaign " + dir.file("fifo"), "--campaign " + dir.path,
                                   "--comm-fit " + dir.file("fifo"), "--comm-fit " + dir.path}) {
    Timed t = bounded("./plan " + flags);
    INFO(flags << "\n" << t.result.output);
    CHECK(t.result.code == 2);
    CHECK(t.seconds < 60);
    CHECK_THAT(t.result.output, Contains("not a regular file"));
    CHECK_THAT(t.result.output, !Contains("cells ran"));
  }
}

// ----------------------------------------------------------------------------
// Waits no timeout bounds: faults and the job's end

TEST_CASE("a hang on a one-rank run is refused: no peer would end it", "[safety][train]") {
  expect_refused_in_time(SMALL + "--steps 3 --fault hang:0:1",
                         {"--fault hang:0:1", "one-rank", "mpirun -np 2"});
  expect_refused_in_time(SMALL + "--steps 3 --fault hang:0:0:init", {"one-rank"});
  // A crash or an error on one rank ends that rank: still a fault one rank can test.
  Timed t = train(SMALL + "--steps 3 --fault error:0:1");
  INFO(t.result.output);
  CHECK(t.result.code != 0);
  CHECK(t.result.code != 2);
  CHECK_THAT(t.result.output, Contains("injected fault 'error' at step 1"));
}

// Guards: MPI_Finalize waiting for a peer without bound. A rank held at the job's end (--fault
// hang:1:0:finalize: after the closing barrier, inside the bound of MPI_Finalize) ends the job
// within --comm-timeout of the end, with a non-zero status and a line naming the wait.
TEST_CASE("a rank held at the job's end ends the job within --comm-timeout", "[safety][parity]") {
  Timed t = train(SMALL + "--steps 1 --comm-timeout 5 --dp 2 --fault hang:1:0:finalize", 2);
  INFO(t.result.output);
  CHECK(t.result.code != 0);
  CHECK(t.result.code != 124);  // not the test's own timeout
  CHECK(t.seconds < 45);        // --comm-timeout 5 per wait, and mpirun's start and end
  CHECK_THAT(t.result.output, Contains("injected fault 'hang' at step 0, finalize"));
  CHECK_THAT(t.result.output,
             Contains("MPI_Finalize has not returned within 5 s (--comm-timeout 5 s)"));
  expect_refused_in_time(SMALL + "--steps 1 --dp 2 --fault hang:1:1:finalize",
                         {"finalize comes once, at the job's end, as step 0"}, 2);
  // The end's own bound is at least a second and at most 1e8 s, whatever --comm-timeout says:
  // a one-rank run with the shortest timeout the flag takes, 1 s, or a 1e300-second one (a
  // clock's overflow) ends well.
  for (const char* timeout : {"1", "1e300"}) {
    Timed one = train(SMALL + "--steps 1 --comm-timeout " + timeout);
    INFO(one.result.output);
    CHECK(one.result.code == 0);
    CHECK_THAT(one.result.output, !Contains("MPI_Finalize has not returned"));
  }
}

// ----------------------------------------------------------------------------
// Crashes: deep JSON, huge data

// Guards: printing a malformed entry (or the architectures a config names) walks the JSON
// recursively: 300000 levels overflowed the stack (a segfault, not exit 2).
TEST_CASE("JSON nested hundreds of thousands deep in a checkpoint is refused, not a crash",
          "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(train(SMALL + "--steps 1 --save " + ck).result.code == 0);
  const std::string config = read_whole_file(ck + "/config.json");
  std::string deep = config;  // "architectures": [[[...]]] in place of ["LlamaForCausalLM"]
  deep.replace(deep.find("["), deep.find("]") - deep.find("[") + 1, nested(300000));
  std::ofstream(ck + "/config.json") << deep;
  CHECK_THAT(usage_error_of([&] { read_checkpoint_config(ck); }),
             Contains(ck + ": config.json") && Contains("nested 300001 levels deep"));
  expect_refused_in_time(SMALL + "--steps 2 --load " + ck,
                         {"config.json", "nested 300001 levels deep"});
  std::ofstream(ck + "/config.json") << config;

  // A safetensors header whose tensor entry holds a deep shape.
  const std::string path = ck + "/model.safetensors";
  const std::string header =
      "{\"x\": {\"dtype\": \"F32\", \"shape\": " + nested(300000) + ", \"data_offsets\": [0, 4]}}";
  std::string bytes(8, '\0');
  const uint64_t n = header.size();
  memcpy(&bytes[0], &n, 8);
  std::ofstream(path, std::ios::binary) << bytes << header << std::string(4, '\0');
  std::vector<NamedTensor> none;
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, none); }),
             Contains(path) && Contains("nested 300002 levels deep"));
  expect_refused_in_time(SMALL + "--steps 2 --load " + ck, {"model.safetensors", "levels deep"});
  // A checkpoint's JSON as deep as it is meant to be still loads (rope_parameters: 2 levels).
  CHECK_THAT(usage_error_of([&] { read_checkpoint_config(ck); }), !Contains("levels deep"));
}

// Guards: every byte of --data read into memory as bytes, then as int32, then copied into the
// splits (about 9 bytes of memory per byte), after every rank had checksummed it: a file
// larger than memory ended in an uncaught std::bad_alloc (abort), minutes later.
TEST_CASE("a --data or --score file whose tokens exceed memory exits 2 at once, naming the memory",
          "[safety][train][parity]") {
  TempDir dir;
  const std::string huge = dir.file("huge.txt"), shard = dir.file("huge.bin");
  // Sparse files as large as this machine's memory: 4 bytes per token is 4x (2x for a shard's
  // 2-byte tokens) what the machine holds, and they take no disk.
  const double memory = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  for (const std::string& path : {huge, shard}) {
    std::ofstream(path).close();
    REQUIRE(truncate(path.c_str(), (off_t)memory) == 0);
  }
  const std::string ck = dir.file("ck");
  REQUIRE(train(SMALL + "--steps 1 --save " + ck).result.code == 0);
  for (int np : {0, 2}) {
    INFO("ranks: " << np);
    expect_refused_in_time(
        SMALL + "--steps 2 --data " + huge,
        {"--data " + huge, "in memory at 4 bytes each", "more than this machine's"}, np);
    expect_refused_in_time(SMALL + "--steps 2 --data " + shard, {"--data " + shard, "more than"},
                           np);
    expect_refused_in_time("--load " + ck + " --score " + huge, {"--score " + huge, "more than"},
                           np);
  }
  // The check is the machine's memory, not the file's size: a file well within it loads.
  write_text(dir.file("fine.txt"), 200000);
  CHECK_NOTHROW(check_token_file("--data", dir.file("fine.txt")));
  Dataset d = load_dataset(dir.file("fine.txt"), 0.1, 16);
  CHECK(d.train.size() + d.val.size() == 200000);
}

// ----------------------------------------------------------------------------
// Silently wrong: ranks that disagree, values that mislead

// Guards: the launch's checksums covering a file's first 64 KiB only: two data files of one
// size, or two checkpoints, differing past it trained different replicas with exit code 0.
TEST_CASE("ranks whose input files differ anywhere are refused, past the first 64 KiB too",
          "[safety][parity]") {
  TempDir dir;
  const std::string exe = fs::absolute("./train").string();
  for (const char* d : {"one", "two"}) fs::create_directory(dir.file(d));
  // Data: 200000 bytes each, the same but for the last byte.
  write_text(dir.file("one/data.txt"), 200000);
  std::string text = read_whole_file(dir.file("one/data.txt"));
  text.back() = text.back() == 'x' ? 'y' : 'x';
  std::ofstream(dir.file("two/data.txt"), std::ios::binary) << text;
  // Checkpoints: the same but for the last weight of lm_head, which lies past 64 KiB.
  const std::string wide =
      "--d-model 64 --layers 1 --heads 2 --kv-heads 1 --ffn 64 --seq 16 "
      "--mbs 2 --warmup 1 --val-seqs 2 --val-every 0 ";
  REQUIRE(train(wide + "--steps 1 --save " + dir.file("one/ck")).result.code == 0);
  fs::copy(dir.file("one/ck"), dir.file("two/ck"));
  const std::string model = dir.file("two/ck/model.safetensors");
  const uint64_t last = fs::file_size(model) - 4;
  REQUIRE(last > 65536);
  REQUIRE(data_offset(model, "lm_head.weight") < last);
  poke_float(model, last, 0.125f);
  auto mpmd = [&](const std::string& flags) {
    return bounded("mpirun --oversubscribe -np 1 -wdir " + dir.file("one") + " " + exe +
                   " --device cpu " + flags + " : -np 1 -wdir " + dir.file("two") + " " + exe +
                   " --device cpu " + flags);
  };
  for (auto [flags, says] :
       {std::pair{SMALL + "--dp 2 --steps 1 --data data.txt", std::string("--data data.txt is")},
        {wide + "--dp 2 --steps 2 --load ck", "--load ck is"}}) {
    Timed t = mpmd(flags);
    INFO(flags << "\n" << t.result.output);
    CHECK(t.result.code == 2);
    CHECK(t.seconds < 60);
    CHECK_THAT(t.result.output,
               Contains(says) && Contains("on rank 1") && Contains("checksums of the whole files"));
    CHECK_THAT(t.result.output, !Contains("step     1/") && !Contains("step     2/"));
  }
}

// Guards: AdamW's sqrt(v) of a negative second moment, a NaN at the first step that the NaN
// check then blames on the learning rate.
TEST_CASE("an optimizer state with a negative second moment is refused at load, naming it",
          "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(train(SMALL + "--steps 1 --save " + ck).result.code == 0);
  const std::string opt = ck + "/optimizer.safetensors";
  const std::string name = "model.layers.0.mlp.down_proj.weight.exp_avg_sq";
  poke_float(opt, data_offset(opt, name) + 4 * 5, -0.5f);
  expect_refused_in_time(SMALL + "--steps 3 --load " + ck,
                         {opt, name, "element 5 of", "is -0.5", "never negative"});
  // The first moment may be negative: it is a mean of gradients.
  poke_float(opt, data_offset(opt, name) + 4 * 5, 0.25f);
  poke_float(opt, data_offset(opt, "model.layers.0.mlp.down_proj.weight.exp_avg") + 20, -0.5f);
  Timed t = train(SMALL + "--steps 2 --load " + ck);
  INFO(t.result.output);
  CHECK(t.result.code == 0);
}

// Guards: a float read from JSON as it comes: rms_norm_eps 1e300 became inf (a model that never
// moves), 1e-300 zero; an eps far above the mean square it guards.
TEST_CASE(
    "config.json's rms_norm_eps, rope_theta and initializer_range are refused outside fp32 "
    "and reason",
    "[safety]") {
  ModelConfig c;
  c.d_model = 32, c.layers = 1, c.heads = 2, c.kv_heads = 1, c.ffn = 64, c.seq = 16;
  const nlohmann::json good = hf_config(c);
  auto error_with = [&](const char* key, double value) {
    nlohmann::json j = good;
    j[key] = value;
    return usage_error_of([&] { config_from_hf(j, "ck"); });
  };
  for (double bad : {1e300, 1e-300, 10.0, 1.5})
    CHECK_THAT(error_with("rms_norm_eps", bad),
               Contains("ck: config.json") && Contains("rms_norm_eps"));
  CHECK_THAT(error_with("rms_norm_eps", 1e300), Contains("fp32's range"));
  CHECK_THAT(error_with("rms_norm_eps", 10), Contains("above 1"));
  CHECK(error_with("rms_norm_eps", 1e-6).empty());
  CHECK(error_with("rms_norm_eps", 1.0).empty());
  CHECK_THAT(error_with("rope_theta", 1e300), Contains("rope_theta") && Contains("fp32's range"));
  // A subnormal base passed as positive, and trained to a NaN loss; below 1 RoPE overflows.
  CHECK_THAT(error_with("rope_theta", 1e-40), Contains("rope_theta") && Contains("below 1"));
  CHECK_THAT(error_with("rope_theta", 0.5), Contains("rope_theta 0.5 is below 1"));
  CHECK(error_with("rope_theta", 1.0).empty());
  CHECK_THAT(error_with("initializer_range", 1e-300), Contains("initializer_range"));
}

// Guards: a periodic checkpoint chosen by its folder's name: a stale DIR/checkpoint-100 holding
// step 3 was resumed from instead of DIR's step 6.
TEST_CASE("--load DIR resumes from the checkpoint furthest along by its content, not its name",
          "[safety][train]") {
  TempDir dir;
  const std::string run = dir.file("run"), early = dir.file("early");
  REQUIRE(train(SMALL + "--steps 6 --save " + run).result.code == 0);
  REQUIRE(train(SMALL + "--steps 6 --stop-after 3 --save " + early).result.code == 0);
  fs::copy(early, run + "/checkpoint-100");  // a name past DIR, a step (3) behind it
  Timed t = train(SMALL + "--steps 8 --load " + run);
  INFO(t.result.output);
  REQUIRE(t.result.code == 0);
  CHECK_THAT(t.result.output, Contains("step     7/8"));
  CHECK_THAT(t.result.output, !Contains("step     4/8") && !Contains("checkpoint-100"));
  // A periodic checkpoint that is further along than DIR by content is still chosen, and named.
  fs::remove_all(run + "/checkpoint-100");
  REQUIRE(train(SMALL + "--steps 8 --stop-after 7 --save " + dir.file("late")).result.code == 0);
  fs::copy(dir.file("late"), run + "/checkpoint-2");
  t = train(SMALL + "--steps 8 --load " + run);
  INFO(t.result.output);
  REQUIRE(t.result.code == 0);
  CHECK_THAT(t.result.output, Contains("note: loading " + run + "/checkpoint-2") &&
                                  Contains("(step 7)") && Contains("step     8/8"));
}

// Guards: a script's unset variable: --load "" trained from scratch, --save "" saved nothing,
// each with exit code 0.
TEST_CASE("an empty path given to a flag is refused, naming the flag", "[safety][train]") {
  for (const char* flag :
       {"--save", "--load", "--log-json", "--save-grads", "--trace", "--data", "--score"})
    expect_refused_in_time(SMALL + "--steps 1 " + flag + " ''",
                           {std::string(flag) + " '': an empty path", "drop " + std::string(flag)});
}

// Guards: --model ignored under --load while each shape flag was checked against config.json.
TEST_CASE("--model under --load must describe the checkpoint's model, as shape flags must",
          "[safety][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(train(SMALL + "--steps 1 --save " + ck).result.code == 0);
  expect_refused_in_time(
      "--steps 2 --load " + ck + " --model tiny",
      {"--model tiny (hidden_size 128) disagrees with " + ck + "/config.json (hidden_size 32)",
       "drop --model"});
  expect_refused_in_time("--steps 2 --load " + ck + " --model medium", {"--model medium"});
  // The preset with the shape flags over it is the checkpoint's model: accepted.
  Timed t = train(SMALL + "--model tiny --steps 2 --load " + ck);
  INFO(t.result.output);
  CHECK(t.result.code == 0);
}

// ----------------------------------------------------------------------------
// Outputs that destroy

// Guards: --keep pruning every DIR/checkpoint-<step> by its name: the user's own checkpoint-1,
// and the notes in it, were deleted.
TEST_CASE("--keep removes only the periodic checkpoints picoscale wrote", "[safety][train]") {
  TempDir dir;
  const std::string out = dir.file("out");
  REQUIRE(train(SMALL + "--steps 1 --save " + dir.file("mine")).result.code == 0);
  fs::create_directories(out);
  fs::copy(dir.file("mine"), out + "/checkpoint-1");  // the user's, with notes
  std::ofstream(out + "/checkpoint-1/notes.txt") << "keep me";
  fs::copy(dir.file("mine"), out + "/checkpoint-3");  // the user's, at step 1, not 3
  Timed t = train(SMALL + "--steps 7 --save-every 2 --keep 1 --save " + out);
  INFO(t.result.output);
  REQUIRE(t.result.code == 0);
  CHECK(read_whole_file(out + "/checkpoint-1/notes.txt") == "keep me");
  CHECK(fs::exists(out + "/checkpoint-1/model.safetensors"));
  CHECK(fs::exists(out + "/checkpoint-3/model.safetensors"));
  // picoscale's: checkpoint-2 and -4 went as newer ones came, -6 stays (--keep 1).
  CHECK_FALSE(fs::exists(out + "/checkpoint-2"));
  CHECK_FALSE(fs::exists(out + "/checkpoint-4"));
  CHECK(fs::exists(out + "/checkpoint-6/optimizer.safetensors"));
}

TEST_CASE("./plan --json never overwrites its own --campaign or --comm-fit", "[safety]") {
  TempDir dir;
  const std::string csv = dir.file("campaign.csv");
  fs::copy("tests/data/book_campaign.csv", csv);
  const std::string before = read_whole_file(csv);
  fs::create_symlink("campaign.csv", dir.file("link.json"));
  for (const std::string& json : {csv, dir.file("link.json")}) {
    Timed t = bounded("./plan --campaign " + csv + " --json " + json);
    INFO(t.result.output);
    CHECK(t.result.code == 2);
    CHECK_THAT(t.result.output, Contains("--json " + json + " would overwrite --campaign " + csv));
  }
  CHECK(read_whole_file(csv) == before);
  std::ofstream(dir.file("fit.json")) << "{}";
  Timed t =
      bounded("./plan --comm-fit " + dir.file("fit.json") + " --json " + dir.file("fit.json"));
  INFO(t.result.output);
  CHECK(t.result.code == 2);
  CHECK_THAT(t.result.output, Contains("would overwrite --comm-fit"));
  CHECK(read_whole_file(dir.file("fit.json")) == "{}");
}

// ----------------------------------------------------------------------------
// The suite's own report

// A case that fails on purpose, run by the case after it (hidden, and excluded by name where the
// suite runs with exclusions only, tools/run_tests.sh and tools/mutants.sh): its name and
// its section's run past a console's 80 columns, with ": " beyond them, which Catch2's console
// reporter indents to (at its default width of 80 it asserted `m_width > m_indent` and
// aborted, so a failing group crashed instead of reporting).
TEST_CASE(
    "a case that fails on purpose so that the report of a failure can be read: its name is long "
    "enough that this colon: falls past the console's eightieth column",
    "[.report_width]") {
  SECTION(
      "a section of that case whose name also runs past the eightieth column of a console: so "
      "does its colon") {
    CHECK(1 == 2);
  }
  CHECK(3 == 4);
}

TEST_CASE("the suite reports failing cases with long names instead of aborting", "[safety]") {
  RunResult r = run_command("build/unit_tests \"[report_width]\" --use-colour no");
  INFO(r.output);
  CHECK(r.code == 2);  // Catch2 (v2): the number of failed assertions
  CHECK_THAT(r.output,
             Contains("test cases: 1 | 1 failed") && Contains("assertions: 2 | 2 failed"));
  CHECK_THAT(r.output, !Contains("Assertion") && !Contains("m_width"));
  // Every case's name indents its report within the width (tests/catch_main.cpp: 256).
  for (const Catch::TestCase& t : Catch::getRegistryHub().getTestCaseRegistry().getAllTests()) {
    INFO(t.name);
    const size_t colon = t.name.find(": ");
    CHECK((colon == std::string::npos || colon + 2 < 255));
  }
}
