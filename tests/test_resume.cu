// test_resume.cu: exact resume. A run stopped, saved and resumed ends bit-identical to the run
// that went straight through, in every dtype (fp16's dynamic loss scale and its count of good
// steps travel in optimizer.safetensors), and a long run saved every N steps (--save-every,
// --keep) and killed again and again ends bit-identical too, in one process, under pp 2 and
// under dp 2 ZeRO-2; a kill during a periodic save leaves the previous one loadable. [train];
// under mpirun [parity].
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "launch.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

const std::string SMALL =
    "--d-model 32 --layers 2 --heads 2 --kv-heads 1 --ffn 64 --seq 16 "
    "--mbs 2 --warmup 1 --val-seqs 2 --val-every 0 --comm-timeout 60 ";

std::map<std::string, std::string> metadata_of(const std::string& path) {
  const std::string bytes = read_whole_file(path);
  uint64_t n = 0;
  memcpy(&n, bytes.data(), 8);
  return nlohmann::json::parse(bytes.substr(8, n))["__metadata__"]
      .get<std::map<std::string, std::string>>();
}
// Every step's log line by step number (a resumed run's lines replace the killed run's),
// without the timing and the validation (a run stopped early validates where it stops).
void add_log(std::map<int, nlohmann::json>& by_step, const std::string& path) {
  if (!fs::exists(path)) return;
  for (nlohmann::json& line : read_json_lines(path)) {
    // Timings (throughput, MFU) differ between any two runs; the validation loss is only on
    // the steps that validate, which a split run places differently.
    for (const char* key : {"tokens_per_s", "tokens_per_s_per_rank", "mfu", "val_loss"})
      line.erase(key);
    by_step[line["step"].get<int>()] = line;
  }
}
void require_same_checkpoint(const std::string& a, const std::string& b) {
  for (const char* f : {"/config.json", "/model.safetensors", "/optimizer.safetensors"}) {
    INFO(a << f << " against " << b << f);
    REQUIRE(fs::exists(a + f));
    REQUIRE(read_whole_file(a + f) == read_whole_file(b + f));
  }
}

}  // namespace

TEST_CASE(
    "stopped, saved and resumed ends bit-identical to the straight run in fp32, bf16, fp16 "
    "(a skipped step before the save) and fp8",
    "[train]") {
  const std::string dir = make_temp_dir();
  struct Case {
    std::string name, flags;
  } cases[] = {
      {"fp32", ""},
      {"bf16", "--dtype bf16"},
      // The overflow at step 1 halves the scale; with a window of 2 good steps it doubles again
      // at step 3, so the save after step 3 holds a scale and a good-step count that a restart
      // at 65536 would get wrong.
      {"fp16", "--dtype fp16 --loss-scale-window 2 --fault inf:0:1"},
      {"fp8", "--dtype fp8"},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string run = SMALL + "--steps 7 " + c.flags + " ";
    const std::string d = dir + "/" + c.name;
    RunResult straight = run_train(run + "--save " + d + "/straight --log-json " + d + ".s.jsonl");
    INFO(straight.output);
    REQUIRE(straight.code == 0);
    RunResult half =
        run_train(run + "--stop-after 3 --save " + d + "/half --log-json " + d + ".h.jsonl");
    INFO(half.output);
    REQUIRE(half.code == 0);
    // The resumed run takes no --fault: inf:0:1 is before its first step (refused otherwise).
    RunResult resumed =
        run_train(SMALL + "--steps 7 " + c.flags.substr(0, c.flags.find(" --fault")) + " --load " +
                  d + "/half --save " + d + "/resumed --log-json " + d + ".r.jsonl");
    INFO(resumed.output);
    REQUIRE(resumed.code == 0);
    require_same_checkpoint(d + "/straight", d + "/resumed");
    std::map<int, nlohmann::json> whole, pieces;
    add_log(whole, d + ".s.jsonl");
    add_log(pieces, d + ".h.jsonl");
    add_log(pieces, d + ".r.jsonl");
    REQUIRE(pieces.size() == 7);
    for (auto& [step, line] : whole) {
      INFO("step " << step);
      CHECK(pieces[step].dump() == line.dump());
    }
    if (c.name == "fp16") {
      REQUIRE(whole[2]["skipped"].get<bool>());
      // Saved after step 3 (the log counts from 1): step 2 skipped and halved the scale, step 3
      // was one good step of the window of 2. The metadata holds the scale the straight run
      // used next (at step 4), and the training steps apart from AdamW's (one skipped).
      auto meta = metadata_of(d + "/half/optimizer.safetensors");
      CHECK(meta["step"] == "3");
      CHECK(meta["adam_steps"] == "2");
      CHECK(meta["loss_scale_good_steps"] == "1");
      CHECK(std::stod(meta["loss_scale"]) == whole[4]["loss_scale"].get<double>());
    }
  }
  fs::remove_all(dir);
}

// A job killed every few steps, each time relaunched with --load from its last checkpoint,
// against the job that was never killed: the same losses at every step and the same final
// checkpoint, byte for byte. The kills are --fault crash (SIGKILL) at steps 3 and 5, after
// the periodic checkpoints of steps 2 and 4.
TEST_CASE(
    "a job killed every N steps and resumed from its last checkpoint ends bit-identical to "
    "the straight run: one process, pp 2, dp 2 ZeRO-2",
    "[parity]") {
  const std::string dir = make_temp_dir();
  struct Layout {
    std::string name, flags;
    int np, crash_rank;
  } layouts[] = {
      {"single", "--grad-acc 2", 0, 0},
      {"pp2", "--pp 2 --grad-acc 2", 2, 1},
      {"zero2", "--dp 2 --zero 2 --grad-acc 2", 2, 1},
  };
  for (const Layout& l : layouts) {
    INFO(l.name);
    const std::string d = dir + "/" + l.name, run = SMALL + "--steps 6 " + l.flags + " ";
    REQUIRE(run_train(run + "--save " + d + "/straight --log-json " + d + ".s.jsonl", l.np).code ==
            0);
    const std::string ck = d + "/ck", periodic = "--save " + ck + " --save-every 2 --keep 1 ";
    std::map<int, nlohmann::json> pieces;
    int launch = 0;
    for (int crash_at : {3, 5, -1}) {
      const std::string log = d + "." + std::to_string(launch++) + ".jsonl";
      std::string flags = run + periodic + "--log-json " + log;
      if (crash_at != 3) flags += " --load " + ck;
      if (crash_at > 0)
        flags += " --fault crash:" + std::to_string(l.crash_rank) + ":" + std::to_string(crash_at);
      RunResult r = run_train(flags, l.np);
      INFO(flags << "\n" << r.output);
      if (crash_at > 0) {
        REQUIRE(r.code != 0);
        REQUIRE_THAT(r.output,
                     Contains("injected fault 'crash' at step " + std::to_string(crash_at)));
        // --keep 1: only the newest periodic checkpoint is left.
        REQUIRE(fs::exists(ck + "/checkpoint-" + std::to_string(crash_at - 1)));
        REQUIRE_FALSE(fs::exists(ck + "/checkpoint-" + std::to_string(crash_at - 3)));
      } else {
        REQUIRE(r.code == 0);
      }
      if (crash_at != 3) REQUIRE_THAT(r.output, Contains("loading " + ck + "/checkpoint-"));
      add_log(pieces, log);
    }
    require_same_checkpoint(d + "/straight", ck);
    std::map<int, nlohmann::json> whole;
    add_log(whole, d + ".s.jsonl");
    REQUIRE(pieces.size() == 6);
    for (auto& [step, line] : whole) {
      INFO("step " << step);
      CHECK(pieces[step].dump() == line.dump());
    }
  }
  fs::remove_all(dir);
}

TEST_CASE(
    "--save-every keeps the --keep newest checkpoints, and --load DIR resumes from the one "
    "furthest along",
    "[train]") {
  const std::string dir = make_temp_dir(), ck = dir + "/ck";
  RunResult r = run_train(SMALL + "--steps 5 --save " + ck + " --save-every 1 --keep 2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(ck)) names.insert(e.path().filename());
  CHECK(names == std::set<std::string>{"checkpoint-3", "checkpoint-4", "config.json",
                                       "model.safetensors", "optimizer.safetensors"});
  CHECK(metadata_of(ck + "/checkpoint-4/optimizer.safetensors")["step"] == "4");
  CHECK(metadata_of(ck + "/optimizer.safetensors")["step"] == "5");
  // DIR itself is furthest along: it is what --load reads.
  r = run_train(SMALL + "--steps 6 --load " + ck);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, !Contains("loading " + ck + "/checkpoint-"));
  CHECK_THAT(r.output, Contains("step     6/6"));
  // A periodic checkpoint is as far along as the step inside it, whatever its name says:
  // checkpoint-4 renamed checkpoint-7 still holds step 4, behind DIR's 5.
  fs::rename(ck + "/checkpoint-4", ck + "/checkpoint-7");
  r = run_train(SMALL + "--steps 9 --load " + ck);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, !Contains("loading " + ck + "/checkpoint-"));
  CHECK_THAT(r.output, Contains("step     6/9"));
  // A newer one than DIR's own (a later run killed after it): that one.
  REQUIRE(run_train(SMALL + "--steps 9 --stop-after 7 --save " + dir + "/later").code == 0);
  fs::remove_all(ck + "/checkpoint-7");
  fs::rename(dir + "/later", ck + "/checkpoint-7");
  r = run_train(SMALL + "--steps 9 --load " + ck);
  INFO(r.output);
  CHECK(r.code == 0);
  CHECK_THAT(r.output, Contains("loading " + ck + "/checkpoint-7"));
  CHECK_THAT(r.output, Contains("step     8/9"));  // the step inside it: 7 done
  // Flags that would do nothing are refused.
  r = run_train(SMALL + "--steps 2 --save-every 1");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Contains("--save-every 1") && Contains("--save DIR"));
  r = run_train(SMALL + "--steps 2 --save " + dir + "/x --keep 2");
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Contains("--keep 2") && Contains("--save-every"));
  fs::remove_all(dir);
}

// A run saving after every step, killed by SIGKILL at moments spread over its saves: whatever
// the moment, every periodic checkpoint left is whole, and --load DIR resumes from the newest.
TEST_CASE("a kill during a periodic save leaves the previous checkpoint loadable", "[train]") {
  const std::string dir = make_temp_dir(), ck = dir + "/ck";
  std::mt19937 rng(25);
  for (int trial = 0; trial < 6; trial++) {
    fs::remove_all(ck);
    pid_t child = fork();
    if (child == 0) {
      const std::string cmd = "exec ./train --device cpu " + SMALL + "--steps 100000 --save " + ck +
                              " --save-every 1 --keep 2 "
                              ">/dev/null 2>&1";
      execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
      _exit(127);
    }
    // Until a first checkpoint is in place, then a few more milliseconds, spread by trial.
    for (int waited = 0; waited < 30000 && !fs::exists(ck + "/checkpoint-1/config.json"); waited++)
      usleep(1000);
    usleep(1000 * (5 + (rng() % 40)));
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    INFO("trial " << trial);
    std::vector<std::string> left;
    for (const auto& e : fs::directory_iterator(ck))
      if (e.path().filename().string().rfind("checkpoint-", 0) == 0 &&
          e.path().filename().string().find('.') == std::string::npos)
        left.push_back(e.path().string());
    REQUIRE(!left.empty());
    for (const std::string& c : left) {
      RunResult r = run_train(SMALL + "--steps 0 --load " + c + " --save " + dir + "/check");
      INFO(c << "\n" << r.output);
      REQUIRE(r.code == 0);
    }
    RunResult r = run_train(SMALL + "--steps 200000 --stop-after 1 --load " + ck);
    INFO(r.output);
    REQUIRE(r.code == 0);
    REQUIRE_THAT(r.output, Contains("loading " + ck + "/checkpoint-"));
  }
  fs::remove_all(dir);
}
