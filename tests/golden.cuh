// golden.cuh: reading the transformers fixtures of tests/data/golden/ (tools/make_golden.py)
// and comparing tensors against them; shared by test_golden.cu and the MPI tests.
#pragma once
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "launch.cuh"
#include "runtime/checkpoint.cuh"

// gqa_bf16 was saved by transformers in bf16: loaded here it widens exactly, so the float64
// reference of those bf16 weights holds it to the same tolerances as the fp32 fixtures.
inline const std::vector<std::string> kFixtures = {"gqa", "mha_tied", "mqa_theta100", "gqa_bf16"};

struct Golden {
  std::string dir;
  DType dtype = DType::F32;  // of the fixture's model.safetensors (F32, or BF16 for gqa_bf16)
  ModelConfig cfg;
  int B = 0, T = 0;
  std::vector<int32_t> ids, targets;              // [B*T] each
  std::map<std::string, std::vector<float>> ref;  // batch, logits, loss, grad.<name>
  double loss() const { return ref.at("loss")[0]; }
  // The reference gradients under the parameters' own names.
  std::map<std::string, std::vector<float>> grads() const {
    std::map<std::string, std::vector<float>> out;
    for (auto& [name, v] : ref)
      if (name.rfind("grad.", 0) == 0) out[name.substr(5)] = v;
    return out;
  }
};

inline Golden read_golden(const std::string& name) {
  Golden g;
  g.dir = "tests/data/golden/" + name;
  g.cfg = read_checkpoint_config(g.dir);
  g.ref = read_f32_tensors(g.dir + "/golden.safetensors");
  auto weights = read_raw_tensors(g.dir + "/model.safetensors");
  REQUIRE(!weights.empty());
  REQUIRE(dtype_from_name(weights.begin()->second.dtype, &g.dtype));
  REQUIRE(g.ref.count("batch"));
  const std::vector<float>& batch = g.ref["batch"];  // [B, T+1] token ids (exact in fp32)
  g.T = g.cfg.seq;
  g.B = (int)batch.size() / (g.T + 1);
  for (int b = 0; b < g.B; b++)
    for (int t = 0; t < g.T; t++) {
      g.ids.push_back((int32_t)batch[b * (g.T + 1) + t]);
      g.targets.push_back((int32_t)batch[b * (g.T + 1) + t + 1]);
    }
  return g;
}

// max |got - want| <= rel * max |want| over one tensor (want from the float64 reference).
inline void require_close(const std::vector<float>& got, const std::vector<float>& want, double rel,
                          const std::string& what) {
  REQUIRE(got.size() == want.size());
  double scale = 0, worst = 0;
  for (size_t i = 0; i < want.size(); i++) {
    scale = std::max(scale, (double)std::abs(want[i]));
    double d = std::abs((double)got[i] - want[i]);
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  INFO(what << ": max diff " << worst << ", max |ref| " << scale << ", allowed " << rel * scale);
  REQUIRE(scale > 0);
  REQUIRE(worst <= rel * scale);
}

// One step of ./train from fixture g with `flags` on `ranks` (0: one process), training on
// exactly the fixture's batch (--val-frac 0.5, tools/make_golden.py): its step line and its
// first-step gradients (--save-grads). Requires exit code 0 and one step line.
struct GoldenStep {
  nlohmann::json log;
  std::map<std::string, std::vector<float>> grads;
};
inline GoldenStep run_golden_step(const Golden& g, const std::string& flags, int ranks,
                                  const std::string& tmp) {
  std::filesystem::remove_all(tmp + "/run");
  std::filesystem::create_directories(tmp + "/run");
  RunResult r =
      run_train("--load " + g.dir + " --data " + g.dir +
                    "/tokens.bin --val-frac 0.5 --steps 1 --val-every 0 --comm-timeout 60 " +
                    flags + " --save-grads " + tmp + "/run/grads.safetensors" + " --log-json " +
                    tmp + "/run/log.jsonl",
                ranks);
  INFO(flags << "\n" << r.output);
  REQUIRE(r.code == 0);
  auto log = read_json_lines(tmp + "/run/log.jsonl");
  REQUIRE(log.size() == 1);
  return {log[0], read_f32_tensors(tmp + "/run/grads.safetensors")};
}

// Every gradient tensor of `got` against the reference, by name (no tensor missing or extra).
inline void require_grads(const std::map<std::string, std::vector<float>>& got,
                          const std::map<std::string, std::vector<float>>& want, double rel,
                          const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (auto& [name, w] : want) {
    INFO(what << " " << name);
    REQUIRE(got.count(name));
    require_close(got.at(name), w, rel, what + " " + name);
  }
}

// The tensors of a written model.safetensors against the fixture's, byte for byte, with
// their dtype and shape (header order and offsets may differ).
inline void require_fixture_bytes(const std::string& written, const Golden& g) {
  auto want = read_raw_tensors(g.dir + "/model.safetensors");
  auto got = read_raw_tensors(written);
  REQUIRE(got.size() == want.size());
  for (auto& [tensor, w] : want) {
    INFO(tensor);
    REQUIRE(got.count(tensor));
    REQUIRE(got[tensor].dtype == w.dtype);
    REQUIRE(got[tensor].shape == w.shape);
    REQUIRE(got[tensor].bytes == w.bytes);
  }
}
