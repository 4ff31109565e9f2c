// Helpers of the tests that check what bad input is told (test_edges, test_inputs,
// test_safety, test_transformers): a temporary folder, a small model, a refusal expected.
// In an unnamed namespace: other tests keep their own helpers of these names.
#pragma once
#include <catch2/catch.hpp>
#include <filesystem>
#include <string>
#include <vector>

#include "launch.cuh"

namespace {

// A temporary folder, removed with everything in it at the end of its scope.
struct TempDir {
  std::string path = make_temp_dir();
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

// A model small enough that a refused run and a short one take well under a second.
const std::string SMALL =
    "--d-model 32 --layers 1 --heads 2 --kv-heads 1 --ffn 64 --seq 16 "
    "--mbs 2 --warmup 1 --val-seqs 2 --val-every 0 ";

// `./train <args>` (np ranks) is refused with exit code 2 before its first step, its message
// naming each of `says`.
void expect_refused(const std::string& args, const std::vector<std::string>& says, int np = 0) {
  RunResult r = run_train(args, np);
  INFO(args << "\n" << r.output);
  CHECK(r.code == 2);
  for (const std::string& s : says) CHECK_THAT(r.output, Catch::Contains(s));
  CHECK_THAT(r.output, !Catch::Contains("step     1/"));  // refused before the first step
}

}  // namespace
