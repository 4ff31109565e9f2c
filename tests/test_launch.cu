// test_launch.cu: ranks launched differently (runtime/launch.cuh). An MPMD launch gives each
// rank its own command line, `mpirun -np 1 ./train A : -np 1 ./train B`; before the grid is
// built every rank compares its build, its flags and its input files, and any difference ends
// every rank with exit code 2 and a message naming it, never a bogus grid, an MPI error of no
// word of ours, or a hang. [parity]: each case is one mpirun of two ranks.
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>

#include "launch.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

const std::string SMALL =
    "--device cpu --d-model 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 "
    "--seq 16 --mbs 2 --warmup 1 --val-seqs 2 --val-every 0 --steps 2 "
    "--comm-timeout 30 ";

struct Launch {
  RunResult result;
  double seconds;
};
// mpirun with one rank running `a` and one running `b` (each: [-wdir DIR] PROGRAM FLAGS).
Launch mpmd(const std::string& a, const std::string& b) {
  const std::string cmd =
      "timeout -k 10 120 mpirun --oversubscribe -np 1 " + a + " : -np 1 " + b + " 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  Launch l{{-1, ""}, 0};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) l.result.output.append(buf, n);
  int status = pclose(p);
  l.result.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  l.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return l;
}

}  // namespace

TEST_CASE(
    "ranks launched with different flags, files or builds exit 2 on every rank, naming "
    "what differs",
    "[parity]") {
  const std::string dir = make_temp_dir(), train = fs::absolute("./train").string();
  for (const char* d : {"/one", "/two"}) {
    fs::create_directory(dir + d);
    std::ofstream f(dir + d + "/data.txt");
    for (int i = 0; i < 300; i++)
      f << (d[1] == 'o' ? "one fish two fish. " : "red fish blue fish. ");
  }
  REQUIRE(run_train(SMALL + "--steps 1 --save " + dir + "/ck").code == 0);
  fs::copy_file(train, dir + "/train_other");  // another build: the same bytes and one more
  std::ofstream(dir + "/train_other", std::ios::app) << '\0';
  fs::permissions(dir + "/train_other", fs::perms::owner_exec, fs::perm_options::add);
  const std::string base = train + " " + SMALL + "--dp 2 ";
  struct Case {
    std::string a, b;
    std::vector<std::string> says;
  } cases[] = {
      // The audit's cases: a longer sequence, another learning rate, another grid, --steps or
      // --load on one rank only.
      {base, base + "--seq 64", {"--seq is 16 on rank 0 but 64 on rank 1"}},
      {base, base + "--lr 3e-3", {"--lr is 0.002 (the default) on rank 0 but 3e-3 on rank 1"}},
      {train + " " + SMALL + "--tp 2", base, {"--dp"}},
      {base + "--steps 5", base, {"--steps is 5 on rank 0"}},
      {base, base + "--load " + dir + "/ck", {"--load is (not given) on rank 0"}},
      {base + "--data " + dir + "/one/data.txt",
       base + "--data " + dir + "/two/data.txt",
       {"--data is " + dir + "/one/data.txt on rank 0 but " + dir + "/two/data.txt on rank 1"}},
      // The same flag, another file: each rank in its own directory reads its own data.txt.
      {"-wdir " + dir + "/one " + base + "--data data.txt",
       "-wdir " + dir + "/two " + base + "--data data.txt",
       {"--data data.txt is data.txt: 5700 bytes, checksum", "on rank 1"}},
      {base, dir + "/train_other " + SMALL + "--dp 2", {"the build of ./train is", "bytes"}},
      // A bad flag on one rank only: every rank stops with its message, promptly.
      {base, base + "--lr -1", {"--lr -1"}},
      {base, base + "--no-such-flag", {"--no-such-flag"}},
  };
  for (const Case& c : cases) {
    Launch l = mpmd(c.a, c.b);
    INFO(c.a << "\n : " << c.b << "\n" << l.result.output);
    CHECK(l.result.code == 2);
    CHECK(l.seconds < 30);  // never the --comm-timeout of a rank left waiting
    CHECK_THAT(l.result.output, !Contains("MPI_ERR") && !Contains("step     1/"));
    for (const std::string& s : c.says) CHECK_THAT(l.result.output, Contains(s));
  }
  // The same settings spelled differently agree: numbers compare by value.
  Launch same = mpmd(base + "--lr 0.003 --data " + dir + "/one/data.txt",
                     base + "--lr 3e-3 --data " + dir + "/one/data.txt");
  INFO(same.result.output);
  CHECK(same.result.code == 0);
  CHECK_THAT(same.result.output, Contains("step     2/2"));
  fs::remove_all(dir);
}
