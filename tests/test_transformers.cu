// test_transformers.cu: what a Hugging Face transformers user meets, each case as transformers
// (4.46 to 5.x) handles it or refused saying why. Mixtral's config defaults (rope_theta 1e6,
// output_router_logits false: the cross-entropy alone), a sliding window against the run's
// sequences, rope_scaling of type "default", --save-dtype fp16 (as torch's .half() rounds),
// save_pretrained's 5 GB shards (huggingface_hub's own split, its test's sizes), and a
// PyTorch pickle named as such. [checkpoint]; runs of ./train are also [train].
#include <cuda_fp16.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "golden.cuh"
#include "launch.cuh"
#include "refusals.cuh"
#include "runtime/checkpoint.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using nlohmann::json;

namespace {

// A small Mixtral's config.json as picoscale writes it, then edited.
json mixtral_config() {
  ModelConfig c;
  c.d_model = 32, c.layers = 1, c.heads = 2, c.kv_heads = 1, c.ffn = 32, c.seq = 16;
  c.experts = 4, c.top_k = 2, c.aux_loss_coef = 0.02f;
  return hf_config(c);
}
ModelConfig read(const json& j) {
  return config_from_hf(j, "ck");
}

// The fixture's directory copied to tmp/name with config.json edited by `edit`.
std::string fixture_with(const std::string& tmp, const std::string& name,
                         const std::function<void(json&)>& edit) {
  const std::string dir = tmp + "/" + name;
  fs::remove_all(dir);
  fs::copy("tests/data/golden/mixtral", dir);
  json j = json::parse(read_whole_file(dir + "/config.json"));
  edit(j);
  std::ofstream(dir + "/config.json") << j.dump(2);
  return dir;
}

}  // namespace

// ----------------------------------------------------------------------------
// config.json as transformers reads it

// Guards: Llama's default read for a Mixtral config without rope_theta (MixtralConfig's is 1e6,
// so RoPE turned 100x faster than transformers' and every logit differed).
TEST_CASE("a Mixtral config.json without rope_theta takes MixtralConfig's 1e6, a Llama's 10000",
          "[checkpoint]") {
  json mixtral = mixtral_config();
  mixtral.erase("rope_theta");
  CHECK(read(mixtral).rope_theta == 1e6f);  // MixtralConfig(rope_theta=1e6)
  ModelConfig llama_cfg;
  json llama = hf_config(llama_cfg);
  llama.erase("rope_theta");
  CHECK(read(llama).rope_theta == 10000.0f);  // LlamaConfig(rope_theta=10000.0)
  mixtral["rope_theta"] = 500000.0;
  CHECK(read(mixtral).rope_theta == 500000.0f);
}

// Guards: rope_scaling refused whatever it said, though {"rope_type": "default"} is plain RoPE
// in transformers (ROPE_INIT_FUNCTIONS["default"] ignores the rest of the dict).
TEST_CASE("rope_scaling of type default is plain RoPE; any other type is refused, naming it",
          "[checkpoint]") {
  ModelConfig base;
  json j = hf_config(base);
  for (json scaling : {json{{"rope_type", "default"}}, json{{"type", "default"}},
                       json{{"rope_type", "default"}, {"factor", 1.0}}}) {
    j["rope_scaling"] = scaling;
    INFO(scaling.dump());
    CHECK(usage_error_of([&] { read(j); }).empty());
    CHECK(read(j).rope_theta == base.rope_theta);
  }
  for (json scaling :
       {json{{"rope_type", "linear"}, {"factor", 2.0}},
        json{{"rope_type", "llama3"}, {"factor", 8.0}}, json{{"factor", 2.0}}, json("default")}) {
    j["rope_scaling"] = scaling;
    INFO(scaling.dump());
    CHECK_THAT(usage_error_of([&] { read(j); }), Contains("ck: config.json: rope_scaling") &&
                                                     Contains("is not supported") &&
                                                     Contains("rope_type default"));
  }
}

// Guards: the load-balancing loss added whatever the config said. MixtralForCausalLM adds
// router_aux_loss_coef x aux_loss only when output_router_logits is true; MixtralConfig's
// default is false.
TEST_CASE("output_router_logits false, or left out, trains on the cross-entropy alone",
          "[checkpoint][experts][train]") {
  json j = mixtral_config();
  REQUIRE(j["output_router_logits"] == true);  // picoscale's own: trained with the aux loss
  CHECK(read(j).aux_loss_coef == 0.02f);
  j["output_router_logits"] = false;
  CHECK(read(j).aux_loss_coef == 0.0f);
  j.erase("output_router_logits");
  CHECK(read(j).aux_loss_coef == 0.0f);
  j["output_router_logits"] = "yes";
  CHECK_THAT(usage_error_of([&] { read(j); }), Contains("output_router_logits"));

  // The transformers fixture (its gradients those of cross-entropy + 0.02 aux, with
  // output_router_logits true) trained one step with the key false: its gradients are the
  // cross-entropy's alone, those of the same step with --aux-loss-coef 0, and the router's
  // differ from the fixture's by the aux loss's share.
  Golden g = read_golden("mixtral");
  const std::string tmp = make_temp_dir();
  const std::string off =
      fixture_with(tmp, "off", [](json& c) { c["output_router_logits"] = false; });
  Golden g_off = g;
  g_off.dir = off;
  GoldenStep with = run_golden_step(g, "--mbs 2", 0, tmp + "/with");
  GoldenStep without = run_golden_step(g_off, "--mbs 2", 0, tmp + "/without");
  GoldenStep zero = run_golden_step(g, "--mbs 2 --aux-loss-coef 0", 0, tmp + "/zero");
  require_grads(with.grads, g.grads(), 1e-5,
                "mixtral with the aux loss");  // test_experts.cu's tolerance
  CHECK(without.grads == zero.grads);
  const std::string router = "model.layers.0.block_sparse_moe.gate.weight";
  REQUIRE(with.grads.count(router));
  CHECK(without.grads.at(router) != with.grads.at(router));
  CHECK(without.log["loss"] == with.log["loss"]);  // the logged loss is the cross-entropy
  fs::remove_all(tmp);
}

// Guards: sliding_window compared with max_position_embeddings: a window shorter than the run's
// --seq was accepted, then ignored (every earlier token attended: 1.4e-3 off transformers).
TEST_CASE("a Mixtral sliding_window shorter than the run's sequences is refused, naming --seq",
          "[checkpoint][experts][train]") {
  // transformers masks key j for query i when j <= i - sliding_window: with every i - j <=
  // seq - 1, a window of seq or more masks nothing.
  const std::string tmp = make_temp_dir();
  const std::string common =
      "--data tests/data/golden/mixtral/tokens.bin --val-frac 0.5 "
      "--steps 1 --val-every 0 --mbs 1 --val-seqs 1 ";
  const std::string w8 = fixture_with(tmp, "w8", [](json& c) { c["sliding_window"] = 8; });
  // max_position_embeddings is 12: without --seq the run's sequences are 12 long.
  expect_refused(common + "--load " + w8,
                 {w8 + ": config.json's sliding_window 8 is shorter than the run's sequences of "
                       "12 (max_position_embeddings)",
                  "--seq 8 or less"});
  expect_refused(common + "--load " + w8 + " --seq 9", {"sequences of 9 (--seq)"});
  for (const char* seq : {"8", "4"}) {
    RunResult r = run_train(common + "--load " + w8 + " --seq " + seq);
    INFO(r.output);
    CHECK(r.code == 0);
  }
  const std::string w12 = fixture_with(tmp, "w12", [](json& c) { c["sliding_window"] = 12; });
  RunResult r = run_train(common + "--load " + w12);
  INFO(r.output);
  CHECK(r.code == 0);
  const std::string bad = fixture_with(tmp, "bad", [](json& c) { c["sliding_window"] = -4; });
  expect_refused(common + "--load " + bad, {"sliding_window must be a positive integer"});
  fs::remove_all(tmp);
}

// ----------------------------------------------------------------------------
// What a save writes

// Guards: --save-dtype fp16 refused (transformers' torch_dtype float16); a weight past fp16's
// range saved as inf (torch's .half() does so silently).
TEST_CASE("--save-dtype fp16 writes F16 rounded to nearest even, and refuses a weight past 65504",
          "[checkpoint][train]") {
  TempDir dir;
  const std::string wide = dir.file("wide"), half = dir.file("half");
  REQUIRE(run_train(SMALL + "--steps 2 --save " + wide).code == 0);
  REQUIRE(
      run_train(SMALL + "--steps 0 --load " + wide + " --save-dtype fp16 --save " + half).code ==
      0);
  CHECK(json::parse(read_whole_file(half + "/config.json"))["torch_dtype"] == "float16");
  auto f32 = read_raw_tensors(wide + "/model.safetensors");
  auto f16 = read_raw_tensors(half + "/model.safetensors");
  REQUIRE(f16.size() == f32.size());
  for (auto& [name, t] : f32) {
    INFO(name);
    REQUIRE(f16[name].dtype == "F16");
    REQUIRE(f16[name].shape == t.shape);
    REQUIRE(f16[name].bytes.size() * 2 == t.bytes.size());
    for (size_t i = 0; i < t.bytes.size() / 4; i++) {
      float x;
      uint16_t want, got;
      memcpy(&x, &t.bytes[4 * i], 4);
      const __half h = __float2half_rn(x);  // CUDA's own round-to-nearest-even conversion
      memcpy(&want, &h, 2), memcpy(&got, &f16[name].bytes[2 * i], 2);
      REQUIRE(got == want);
    }
  }
  CHECK(read_whole_file(half + "/optimizer.safetensors") ==
        read_whole_file(wide + "/optimizer.safetensors"));      // the optimizer state stays fp32
  RunResult r = run_train(SMALL + "--steps 3 --load " + half);  // it loads, widened exactly
  INFO(r.output);
  CHECK(r.code == 0);

  // fp16's largest value is (2 - 2^-10) 2^15 = 65504; halfway to the next power, 65520, rounds
  // (to even) up to 2^16, past the format: inf. So 65519 saves (as 65504), 65520 is refused.
  auto weights = [](float last) {
    std::vector<NamedTensor> ts = {{"w", empty({3}, Mem::Params)}};
    ts[0].tensor.f32()[0] = -65504, ts[0].tensor.f32()[1] = 1, ts[0].tensor.f32()[2] = last;
    return ts;
  };
  CHECK(usage_error_of([&] {
          save_checkpoint(dir.file("ok"), ModelConfig{}, weights(65519), nullptr, DType::F16);
        }).empty());
  CHECK_THAT(usage_error_of([&] {
               save_checkpoint(dir.file("over"), ModelConfig{}, weights(65520), nullptr,
                               DType::F16);
             }),
             Contains("--save-dtype fp16: tensor w: element 2 is 65520") &&
                 Contains("beyond fp16's largest value 65504") && Contains("bf16"));
  CHECK_FALSE(fs::exists(dir.file("over")));
  CHECK_THAT(usage_error_of([] { parse_save_dtype("fp8"); }),
             Contains("fp32") && Contains("bf16") && Contains("fp16"));
  CHECK(parse_save_dtype("fp16") == DType::F16);
}

// Guards: every model saved as one model.safetensors, where save_pretrained shards at 5 GB.
TEST_CASE("weights past the shard size are saved as save_pretrained shards them, index included",
          "[checkpoint]") {
  // huggingface_hub's own test of its split (tests/test_serialization.py,
  // test_multiple_shards): tensors of sizes 6, 10, 30, 2, 2 with a largest shard of 10 give
  // shards [layer_1], [layer_3], [layer_2], [layer_4, layer_5] and total_size 50. Here the
  // sizes are float counts: 4 bytes each, a largest shard of 40 bytes.
  TempDir dir;
  const std::vector<int64_t> sizes = {6, 10, 30, 2, 2};
  std::vector<NamedTensor> w;
  for (size_t i = 0; i < sizes.size(); i++) {
    w.push_back({"layer_" + std::to_string(i + 1), empty({sizes[i]}, Mem::Params)});
    for (int64_t e = 0; e < sizes[i]; e++) w.back().tensor.f32()[e] = 100.0f * i + e;
  }
  const std::string ck = dir.file("ck");
  save_checkpoint(ck, ModelConfig{}, w, nullptr, DType::F32, 40);
  const json index = json::parse(read_whole_file(ck + "/model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 50 * 4);
  const json want = {{"layer_1", "model-00001-of-00004.safetensors"},
                     {"layer_3", "model-00002-of-00004.safetensors"},
                     {"layer_2", "model-00003-of-00004.safetensors"},
                     {"layer_4", "model-00004-of-00004.safetensors"},
                     {"layer_5", "model-00004-of-00004.safetensors"}};
  CHECK(index["weight_map"] == want);
  CHECK_FALSE(fs::exists(ck + "/model.safetensors"));
  for (auto& [tensor, file] : want.items()) {
    INFO(tensor);
    auto held = read_raw_tensors(ck + "/" + file.get<std::string>());
    REQUIRE(held.count(tensor));
    CHECK(held.at(tensor).dtype == "F32");
  }
  // The shards load back (the index's reader), bit for bit.
  std::vector<NamedTensor> back;
  for (const NamedTensor& t : w) back.push_back({t.name, zeros({t.tensor.numel()}, Mem::Params)});
  load_checkpoint(ck, back, nullptr);
  for (size_t i = 0; i < w.size(); i++)
    CHECK(memcmp(back[i].tensor.ptr, w[i].tensor.ptr, w[i].tensor.nbytes()) == 0);
  // Within the limit, one model.safetensors; the older index and shards go.
  save_checkpoint(ck, ModelConfig{}, w, nullptr, DType::F32, 50 * 4);
  CHECK(fs::exists(ck + "/model.safetensors"));
  CHECK_FALSE(fs::exists(ck + "/model.safetensors.index.json"));
  CHECK_FALSE(fs::exists(ck + "/model-00001-of-00004.safetensors"));
  // save_pretrained's default max_shard_size "5GB": parse_size_to_int gives 5 x 10^9 bytes.
  CHECK(kMaxShardBytes == 5000000000ull);
}

// Guards: a transformers directory of pytorch_model.bin reported as "model.safetensors: not
// found", as if the checkpoint were incomplete.
TEST_CASE("a checkpoint of pytorch_model.bin is refused as PyTorch's pickle format",
          "[checkpoint][train]") {
  TempDir dir;
  const std::string ck = dir.file("ck");
  REQUIRE(run_train(SMALL + "--steps 1 --save " + ck).code == 0);
  fs::rename(ck + "/model.safetensors", ck + "/pytorch_model.bin");
  fs::remove(ck + "/optimizer.safetensors");
  CHECK_THAT(usage_error_of([&] { check_checkpoint_weights(ck); }),
             Contains("pytorch_model.bin, PyTorch's pickle format") && Contains("save_pretrained"));
  expect_refused(SMALL + "--steps 2 --load " + ck, {"pytorch_model.bin", "safetensors"});
  fs::remove(ck + "/pytorch_model.bin");
  CHECK_THAT(usage_error_of([&] { check_checkpoint_weights(ck); }),
             Contains(ck + "/model.safetensors: not found"));
}
