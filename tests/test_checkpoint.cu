// test_checkpoint.cu: safetensors files byte for byte, config.json as Hugging Face reads it, and
// the promises of DESIGN §9: atomic checkpoint directories, and loads that name what is wrong
// and never half-overwrite a model.
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_case.cuh"
#include "runtime/checkpoint.cuh"
#include "runtime/core.cuh"
#include "usage_error.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using nlohmann::json;

namespace {

// A fresh directory under /tmp, removed with everything in it when the test ends.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/picoscale_ckpt_XXXXXX";
    REQUIRE(mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// Three F32 tensors (one with -0.0 and a NaN, which only a bit-exact copy keeps) and one I32.
std::vector<NamedTensor> sample_tensors(uint64_t seed) {
  std::vector<NamedTensor> ts = {
      {"model.embed_tokens.weight", empty({10, 4}, Mem::Params)},
      {"model.layers.0.self_attn.q_proj.weight", empty({3, 5}, Mem::Params)},
      {"model.norm.weight", empty({4}, Mem::Params)},
      {"positions", empty({7}, Mem::Params, Device::CPU, DType::I32)}};
  for (int i = 0; i < 3; i++) init_normal(ts[i].tensor, seed, ts[i].name, 1.0f);
  ts[0].tensor.f32()[0] = -0.0f;
  ts[0].tensor.f32()[1] = std::numeric_limits<float>::quiet_NaN();
  for (int i = 0; i < 7; i++) ts[3].tensor.i32()[i] = (int32_t)(seed * 1000) - 3 * i;
  return ts;
}
// What a checkpoint may hold: sample_tensors without the NaN (a checkpoint load refuses
// non-finite values; read_safetensors alone copies them bit for bit). The -0.0 stays.
std::vector<NamedTensor> checkpoint_tensors(uint64_t seed) {
  std::vector<NamedTensor> ts = sample_tensors(seed);
  ts[0].tensor.f32()[1] = 0.25f;
  return ts;
}
// Adam's second moments as a checkpoint may hold them: running means of squares, >= 0 (a load
// refuses a negative one): checkpoint_tensors' magnitudes.
std::vector<NamedTensor> second_moments(uint64_t seed) {
  std::vector<NamedTensor> ts = checkpoint_tensors(seed);
  for (NamedTensor& nt : ts)
    if (nt.tensor.dtype == DType::F32)
      for (int64_t i = 0; i < nt.tensor.numel(); i++)
        nt.tensor.f32()[i] = std::fabs(nt.tensor.f32()[i]);
  return ts;
}
// Destination tensors of the same names and shapes, filled with 7s.
std::vector<NamedTensor> like(const std::vector<NamedTensor>& src) {
  std::vector<NamedTensor> out;
  for (const NamedTensor& nt : src) {
    Tensor t = empty(nt.tensor.shape, Mem::Params, Device::CPU, nt.tensor.dtype);
    if (t.dtype == DType::F32)
      fill_(t, 7.0f);
    else
      for (int64_t i = 0; i < t.numel(); i++) t.i32()[i] = 7;
    out.push_back({nt.name, t});
  }
  return out;
}
bool same_bits(const std::vector<NamedTensor>& a, const std::vector<NamedTensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); i++) {
    Tensor x = to_device(a[i].tensor, Device::CPU, Mem::Workspace);
    Tensor y = to_device(b[i].tensor, Device::CPU, Mem::Workspace);
    if (a[i].name != b[i].name || x.shape != y.shape || memcmp(x.ptr, y.ptr, x.nbytes()) != 0)
      return false;
  }
  return true;
}
std::vector<NamedTensor> snapshot(const std::vector<NamedTensor>& ts) {
  std::vector<NamedTensor> out;
  for (const NamedTensor& nt : ts)
    out.push_back({nt.name, to_device(nt.tensor, Device::CPU, Mem::Workspace)});
  return out;
}

ModelConfig custom_config() {
  ModelConfig cfg;
  cfg.preset = "custom";
  cfg.vocab = 300, cfg.d_model = 96, cfg.layers = 3, cfg.heads = 6, cfg.kv_heads = 2;
  cfg.ffn = 256, cfg.seq = 64, cfg.rope_theta = 500000.0f, cfg.norm_eps = 1e-6f;
  cfg.tie_embeddings = true, cfg.init_std = 0.01f;
  return cfg;
}

}  // namespace

TEST_CASE("safetensors round-trips F32 and I32 tensors bit-exactly, with the metadata",
          "[checkpoint]") {
  TempDir dir;
  const std::vector<NamedTensor> src = sample_tensors(1);
  write_safetensors(dir.file("a.safetensors"), src, {{"format", "pt"}, {"step", "12"}});
  std::vector<NamedTensor> dst = like(src);
  auto metadata = read_safetensors(dir.file("a.safetensors"), dst);
  CHECK(same_bits(src, dst));
  CHECK(metadata == std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}});
  write_safetensors(dir.file("b.safetensors"), src);
  CHECK(read_safetensors(dir.file("b.safetensors"), like(src)).empty());
  CHECK_FALSE(fs::exists(dir.file("a.safetensors.tmp")));
}

TEST_CASE("a safetensors file is a u64 header length, a JSON header, then 8-byte aligned data",
          "[checkpoint]") {
  TempDir dir;
  const std::vector<NamedTensor> src = sample_tensors(2);
  write_safetensors(dir.file("a.safetensors"), src, {{"format", "pt"}});
  const std::string bytes = read_file(dir.file("a.safetensors"));
  uint64_t header_len = 0;
  for (int b = 0; b < 8; b++) header_len |= (uint64_t)(unsigned char)bytes[b] << (8 * b);
  CHECK((8 + header_len) % 8 == 0);
  const json header = json::parse(bytes.substr(8, header_len));  // trailing spaces are fine
  CHECK(header["__metadata__"] == json{{"format", "pt"}});
  uint64_t at = 0;  // tensors lie contiguously, in the order given
  for (const NamedTensor& nt : src) {
    const json& e = header.at(nt.name);
    CHECK(e["dtype"] == dtype_name(nt.tensor.dtype));
    CHECK(e["shape"].get<std::vector<int64_t>>() == nt.tensor.shape);
    CHECK(e["data_offsets"] == json::array({at, at + nt.tensor.nbytes()}));
    CHECK(memcmp(bytes.data() + 8 + header_len + at, nt.tensor.ptr, nt.tensor.nbytes()) == 0);
    at += nt.tensor.nbytes();
  }
  CHECK(header["positions"]["dtype"] == "I32");
  CHECK(bytes.size() == 8 + header_len + at);
}

TEST_CASE("a truncated safetensors file is refused as truncated", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<NamedTensor> src = sample_tensors(3);
  write_safetensors(path, src);
  const std::string bytes = read_file(path);
  write_bytes(path, bytes.substr(0, bytes.size() - 5));
  const uint64_t data = 40 * 4 + 15 * 4 + 4 * 4 + 7 * 4;
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, like(src)); }),
             Contains(path) && Contains("truncated: header promises " + std::to_string(data) +
                                        " bytes of data, file has " + std::to_string(data - 5)));
}

TEST_CASE("a tensor of another shape or dtype is named with what was found and expected",
          "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<NamedTensor> src = sample_tensors(4);
  write_safetensors(path, src);
  std::vector<NamedTensor> dst = like(src);
  dst[1].tensor = empty({5, 3}, Mem::Params);
  CHECK(usage_error_of([&] { read_safetensors(path, dst); }) ==
        path + ": tensor model.layers.0.self_attn.q_proj.weight: shape [3, 5], expected [5, 3]");
  dst = like(src);
  dst[3].tensor = empty({7}, Mem::Params);
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, dst); }),
             Contains("tensor positions: dtype I32, expected F32"));
}

TEST_CASE("what is not a safetensors file is refused as such", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  const std::vector<NamedTensor> dst = like(sample_tensors(5));
  auto header_then = [&](const std::string& header, const std::string& data) {
    std::string bytes(8, '\0');
    for (int b = 0; b < 8; b++) bytes[b] = (char)((uint64_t)header.size() >> (8 * b));
    write_bytes(path, bytes + header + data);
    return usage_error_of([&] { read_safetensors(path, dst); });
  };
  CHECK_THAT(usage_error_of([&] { read_safetensors(dir.file("none"), dst); }),
             Contains(dir.file("none") + ": not found"));
  write_bytes(path, "abc");
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, dst); }), Contains("too small"));
  write_bytes(path, std::string(8, '\xff') + "{}");
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, dst); }),
             Contains(path) && Contains("header length 18446744073709551615"));
  CHECK_THAT(header_then("{\"a\": [1, 2", ""), Contains(path) && Contains("not valid JSON"));
  CHECK_THAT(header_then("[1, 2]", ""), Contains("not a JSON object"));
  CHECK_THAT(header_then(R"({"positions": {"dtype": "I32", "shape": [7]}})", ""),
             Contains("tensor positions: malformed entry"));
  CHECK_THAT(header_then(R"({"__metadata__": {"step": 3}})", ""), Contains("not a string"));
  write_safetensors(path, sample_tensors(5));
  write_bytes(path, read_file(path) + "tail");
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, dst); }),
             Contains("4 bytes after the last tensor"));
}

TEST_CASE("missing and extra tensors are named", "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const std::vector<NamedTensor> src = sample_tensors(6);
  write_safetensors(path, src);
  std::vector<NamedTensor> more = like(src);
  more.push_back({"lm_head.weight", empty({10, 4}, Mem::Params)});
  CHECK(usage_error_of([&] { read_safetensors(path, more); }) ==
        path + ": tensor lm_head.weight: missing from the file");
  std::vector<NamedTensor> fewer = like(src);
  fewer.erase(fewer.begin() + 2);
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, fewer); }),
             Contains("tensor model.norm.weight") && Contains("extra tensor"));
}

TEST_CASE("a refused load leaves every destination tensor as it was", "[checkpoint]") {
  TempDir dir;
  const std::vector<NamedTensor> src = sample_tensors(7);
  // The last tensor is wrong: a reader that copied as it validated would have written the rest.
  std::vector<NamedTensor> bad = sample_tensors(7);
  bad[3].tensor = empty({8}, Mem::Params, Device::CPU, DType::I32);
  write_safetensors(dir.file("bad.safetensors"), bad);
  std::vector<NamedTensor> dst = like(src);
  const std::vector<NamedTensor> before = snapshot(dst);
  CHECK_THROWS_AS(read_safetensors(dir.file("bad.safetensors"), dst), UsageError);
  CHECK(same_bits(dst, before));

  // A good model file with a bad optimizer file: neither the weights nor the moments change.
  ModelConfig cfg;
  OptimizerState opt{like(src), like(src), 5};
  save_checkpoint(dir.file("ckpt"), cfg, src, &opt);
  write_safetensors(dir.file("ckpt/optimizer.safetensors"), {}, {{"step", "x"}});
  OptimizerState into{like(src), like(src), 0};
  const std::vector<NamedTensor> moments_before = snapshot(into.exp_avg);
  CHECK_THAT(usage_error_of([&] { load_checkpoint(dir.file("ckpt"), dst, &into); }),
             Contains("optimizer.safetensors") && Contains("missing from the file"));
  CHECK(same_bits(dst, before));
  CHECK(same_bits(into.exp_avg, moments_before));
  CHECK(into.step == 0);
}

// Guards: a NaN or inf in a checkpoint loading silently, then spreading through training (or
// stopping it steps later with a message that blames the learning rate).
TEST_CASE(
    "a checkpoint holding NaN or inf is refused at load, naming the file and the first "
    "such tensor, and nothing is loaded",
    "[checkpoint]") {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  const std::vector<NamedTensor> good = checkpoint_tensors(20);
  OptimizerState opt{checkpoint_tensors(21), second_moments(22), 4};
  std::vector<NamedTensor> dst = like(good);
  OptimizerState into{like(good), like(good), 0};
  const std::vector<NamedTensor> before = snapshot(dst), moments_before = snapshot(into.exp_avg);
  auto refused = [&] {
    std::string msg = usage_error_of([&] { load_checkpoint(ckpt, dst, &into); });
    CHECK(same_bits(dst, before));  // checked whole before anything was copied
    CHECK(same_bits(into.exp_avg, moments_before));
    CHECK(into.step == 0);
    return msg;
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();

  std::vector<NamedTensor> bad = checkpoint_tensors(20);
  bad[2].tensor.f32()[3] = nan;  // model.norm.weight
  save_checkpoint(ckpt, ModelConfig{}, bad, &opt);
  CHECK_THAT(refused(), Contains(ckpt + "/model.safetensors: tensor model.norm.weight: element "
                                        "3 of 4 is NaN") &&
                            Contains("load an earlier checkpoint"));
  // Two: the first in the file's order is named (the embedding comes first).
  bad[0].tensor.f32()[5] = inf;
  save_checkpoint(ckpt, ModelConfig{}, bad, &opt);
  CHECK_THAT(refused(), Contains("tensor model.embed_tokens.weight: element 5 of 40 is +inf"));
  // Saved in bf16 (-inf stays -inf): found after widening.
  std::vector<NamedTensor> weights = checkpoint_tensors(20);
  weights.pop_back();  // a bf16 save holds the F32 weights only
  weights[1].tensor.f32()[0] = -inf;
  save_checkpoint(ckpt, ModelConfig{}, weights, nullptr, DType::BF16);
  CHECK_THAT(usage_error_of([&] { load_checkpoint(ckpt, like(weights), nullptr); }),
             Contains("tensor model.layers.0.self_attn.q_proj.weight: element 0 of 15 is -inf"));
  // Finite weights, an inf in the optimizer state.
  OptimizerState bad_opt{checkpoint_tensors(21), second_moments(22), 4};
  bad_opt.exp_avg_sq[2].tensor.f32()[1] = inf;
  save_checkpoint(ckpt, ModelConfig{}, good, &bad_opt);
  CHECK_THAT(refused(), Contains(ckpt + "/optimizer.safetensors: tensor "
                                        "model.norm.weight.exp_avg_sq: element 1 of 4 is +inf"));
  // The same files load once every value is finite.
  save_checkpoint(ckpt, ModelConfig{}, good, &opt);
  CHECK(load_checkpoint(ckpt, dst, &into));
  CHECK(same_bits(dst, good));
}

// Guards: a header whose data_offsets overlap (one tensor read from another's bytes) or leave
// a hole loading as wrong weights: the safetensors format, and its library, forbid both.
TEST_CASE("safetensors data_offsets that overlap, leave a gap or run past the end are refused",
          "[checkpoint]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  // a [3, 4] F32 (48 bytes) and b [5] F32 (20 bytes), at the offsets given, over `data` bytes.
  std::vector<NamedTensor> dst = {{"a", empty({3, 4}, Mem::Params)},
                                  {"b", empty({5}, Mem::Params)}};
  auto load_with = [&](uint64_t a0, uint64_t b0, uint64_t data) {
    const std::string header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[3,4],\"data_offsets\":[" +
                               std::to_string(a0) + "," + std::to_string(a0 + 48) +
                               "]},\"b\":{\"dtype\":\"F32\",\"shape\":[5]," + "\"data_offsets\":[" +
                               std::to_string(b0) + "," + std::to_string(b0 + 20) + "]}}";
    std::string bytes(8, '\0');
    for (int i = 0; i < 8; i++) bytes[i] = (char)((uint64_t)header.size() >> (8 * i));
    write_bytes(path, bytes + header + std::string(data, '\0'));
    return usage_error_of([&] { read_safetensors(path, dst); });
  };
  CHECK(load_with(0, 48, 68).empty());  // the two tile the data: loads
  CHECK(load_with(20, 0, 68).empty());  // in either order
  CHECK_THAT(load_with(0, 40, 60),
             Contains(path + ": tensor b: data_offsets [40, 60] overlap tensor a's [0, 48]"));
  CHECK_THAT(load_with(0, 0, 48), Contains("overlap"));  // b inside a
  CHECK_THAT(load_with(0, 52, 72),
             Contains(path + ": tensor b: data_offsets [52, 72] leave bytes [48, 52) of the data "
                             "to no tensor"));
  CHECK_THAT(load_with(4, 52, 72), Contains("tensor a") && Contains("bytes [0, 4)"));
  CHECK_THAT(load_with(0, 48, 60), Contains("truncated: header promises 68 bytes of data, file "
                                            "has 60"));  // past the end
}

TEST_CASE("config.json holds every LlamaConfig key and reads back the same ModelConfig",
          "[checkpoint]") {
  const ModelConfig cfg = custom_config();
  const json j = hf_config(cfg);
  for (const char* key :
       {"architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
        "rope_theta", "max_position_embeddings", "tie_word_embeddings", "torch_dtype", "hidden_act",
        "initializer_range", "attention_bias", "mlp_bias", "picoscale_preset"})
    CHECK(j.contains(key));
  CHECK(j["architectures"] == json::array({"LlamaForCausalLM"}));
  CHECK(j["model_type"] == "llama");
  CHECK(j["head_dim"] == 16);
  CHECK(j["rms_norm_eps"].get<double>() == 1e-6);  // the decimal a person wrote, not 9.99e-07
  CHECK(j["initializer_range"].get<double>() == 0.01);
  CHECK(j["max_position_embeddings"] == 64);
  const ModelConfig back = config_from_hf(json::parse(j.dump()), "ckpt");
  CHECK(back.preset == cfg.preset);
  CHECK(back.vocab == cfg.vocab);
  CHECK(back.d_model == cfg.d_model);
  CHECK(back.layers == cfg.layers);
  CHECK(back.heads == cfg.heads);
  CHECK(back.kv_heads == cfg.kv_heads);
  CHECK(back.ffn == cfg.ffn);
  CHECK(back.seq == cfg.seq);
  CHECK(back.rope_theta == cfg.rope_theta);
  CHECK(back.norm_eps == cfg.norm_eps);
  CHECK(back.tie_embeddings == cfg.tie_embeddings);
  CHECK(back.init_std == cfg.init_std);
}

TEST_CASE("config_from_hf names missing keys, wrong types and what picoscale lacks",
          "[checkpoint]") {
  const json good = hf_config(custom_config());
  auto error_with = [&](const std::function<void(json&)>& edit) {
    json j = good;
    edit(j);
    return usage_error_of([&] { config_from_hf(j, "ckpt"); });
  };
  CHECK(error_with([](json& j) { j.erase("hidden_size"); }) ==
        "ckpt: config.json: missing key hidden_size");
  CHECK_THAT(error_with([](json& j) { j["num_hidden_layers"] = "3"; }),
             Contains("num_hidden_layers must be a positive integer, found \"3\""));
  CHECK_THAT(error_with([](json& j) { j["vocab_size"] = -1; }), Contains("vocab_size"));
  CHECK_THAT(error_with([](json& j) { j["architectures"] = {"GPT2LMHeadModel"}; }),
             Contains("LlamaForCausalLM"));
  CHECK_THAT(error_with([](json& j) { j["tie_word_embeddings"] = 1; }),
             Contains("tie_word_embeddings"));
  CHECK_THAT(error_with([](json& j) {
               j["rope_scaling"] = {{"rope_type", "llama3"}};
             }),
             Contains("rope_scaling {\"rope_type\":\"llama3\"} is not supported"));
  CHECK_THAT(error_with([](json& j) { j["head_dim"] = 64; }), Contains("head_dim"));
  CHECK_THAT(error_with([](json& j) { j["mlp_bias"] = true; }), Contains("mlp_bias"));
  CHECK_THAT(error_with([](json& j) { j["hidden_act"] = "gelu"; }), Contains("gelu"));
  // Keys a LlamaConfig may leave out take its defaults; JSON null counts as left out.
  json j = good;
  j.erase("num_key_value_heads"), j.erase("picoscale_preset"), j["rope_scaling"] = nullptr;
  const ModelConfig cfg = config_from_hf(j, "ckpt");
  CHECK(cfg.kv_heads == cfg.heads);
  CHECK(cfg.preset == "hf");
}

TEST_CASE(
    "save_checkpoint writes a Hugging Face directory; load_checkpoint restores it, step "
    "included",
    "[checkpoint]") {
  TempDir dir;
  const std::string ckpt = dir.file("runs/ckpt");  // the parent does not exist yet
  const ModelConfig cfg = custom_config();
  const std::vector<NamedTensor> params = checkpoint_tensors(8);
  OptimizerState opt{checkpoint_tensors(9), second_moments(10), 42};
  save_checkpoint(ckpt, cfg, params, &opt);
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors"})
    CHECK(fs::is_regular_file(ckpt + "/" + f));
  CHECK(read_checkpoint_config(ckpt).d_model == cfg.d_model);
  CHECK(read_safetensors(ckpt + "/model.safetensors", like(params)) ==
        std::map<std::string, std::string>{{"format", "pt"}});
  const std::string header = read_file(ckpt + "/optimizer.safetensors").substr(8, 2000);
  CHECK_THAT(header, Contains("\"model.norm.weight.exp_avg\"") &&
                         Contains("\"model.norm.weight.exp_avg_sq\"") && Contains("\"42\""));

  std::vector<NamedTensor> p = like(params);
  OptimizerState o{like(params), like(params), 0};
  CHECK(load_checkpoint(ckpt, p, &o));
  CHECK(same_bits(p, params));
  CHECK(same_bits(o.exp_avg, opt.exp_avg));
  CHECK(same_bits(o.exp_avg_sq, opt.exp_avg_sq));
  CHECK(o.step == 42);
  CHECK_FALSE(load_checkpoint(ckpt, like(params), nullptr));  // weights only
  save_checkpoint(ckpt, cfg, params, nullptr);                // no optimizer file now
  CHECK_FALSE(fs::exists(ckpt + "/optimizer.safetensors"));
  CHECK_FALSE(load_checkpoint(ckpt, like(params), &o));
}

TEST_CASE("save_checkpoint replaces an existing checkpoint whole and leaves no temporary behind",
          "[checkpoint]") {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  save_checkpoint(ckpt, ModelConfig{}, checkpoint_tensors(11), nullptr);
  const std::vector<NamedTensor> second = checkpoint_tensors(12);
  save_checkpoint(ckpt + "/", ModelConfig{}, second, nullptr);  // a trailing slash names ckpt
  std::vector<NamedTensor> p = like(second);
  load_checkpoint(ckpt, p, nullptr);
  CHECK(same_bits(p, second));
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(dir.path))
    names.push_back(fs::relative(e.path(), dir.path).string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"ckpt", "ckpt/config.json", "ckpt/model.safetensors"});
}

TEST_CASE("save_checkpoint never replaces what is not a checkpoint", "[checkpoint]") {
  TempDir dir;
  fs::create_directory(dir.file("home"));
  write_bytes(dir.file("home/notes.txt"), "precious");
  CHECK_THAT(usage_error_of([&] { save_checkpoint(dir.file("home"), ModelConfig{}, {}, nullptr); }),
             Contains(dir.file("home")) && Contains("not a checkpoint"));
  CHECK(read_file(dir.file("home/notes.txt")) == "precious");
  write_bytes(dir.file("file"), "also precious");
  CHECK_THROWS_AS(save_checkpoint(dir.file("file"), ModelConfig{}, {}, nullptr), UsageError);
  CHECK(read_file(dir.file("file")) == "also precious");
}

TEST_CASE("loading from a directory without config.json names --load and the directory",
          "[checkpoint]") {
  TempDir dir;
  CHECK_THAT(usage_error_of([&] { read_checkpoint_config(dir.file("nowhere")); }),
             Contains("--load " + dir.file("nowhere") + ": no config.json") &&
                 Contains("no such directory"));
  CHECK_THAT(usage_error_of([&] { read_checkpoint_config(dir.path); }),
             Contains("no config.json in it"));
  write_bytes(dir.file("config.json"), "{ not json");
  CHECK_THAT(usage_error_of([&] { read_checkpoint_config(dir.path); }), Contains("not valid JSON"));
  CHECK_THAT(usage_error_of([&] { load_checkpoint(dir.path, {}, nullptr); }),
             Contains("model.safetensors: not found"));
}

TEST_CASE("load_checkpoint refuses an optimizer file without a valid step", "[checkpoint]") {
  TempDir dir;
  const std::vector<NamedTensor> params = sample_tensors(13);
  OptimizerState opt{sample_tensors(14), sample_tensors(15), 3};
  save_checkpoint(dir.file("ckpt"), ModelConfig{}, params, &opt);
  for (std::string step : {"", "-1", "12abc"}) {
    std::map<std::string, std::string> metadata;
    if (!step.empty()) metadata["step"] = step;
    std::vector<NamedTensor> moments;
    for (size_t i = 0; i < params.size(); i++) {
      moments.push_back({params[i].name + ".exp_avg", opt.exp_avg[i].tensor});
      moments.push_back({params[i].name + ".exp_avg_sq", opt.exp_avg_sq[i].tensor});
    }
    write_safetensors(dir.file("ckpt/optimizer.safetensors"), moments, metadata);
    OptimizerState into{like(params), like(params), 0};
    CHECK_THAT(usage_error_of([&] { load_checkpoint(dir.file("ckpt"), like(params), &into); }),
               Contains("optimizer.safetensors") && Contains("step"));
  }
}

TEST_CASE("safetensors round-trips tensors that live on the GPU", "[checkpoint][gpu]") {
  SKIP_WITHOUT_CUDA();
  TempDir dir;
  const std::vector<NamedTensor> host = sample_tensors(16);
  std::vector<NamedTensor> gpu, dst;
  for (const NamedTensor& nt : host) {
    gpu.push_back({nt.name, to_device(nt.tensor, Device::CUDA, Mem::Params)});
    dst.push_back({nt.name, zeros(nt.tensor.shape, Mem::Params, Device::CUDA, nt.tensor.dtype)});
  }
  write_safetensors(dir.file("gpu.safetensors"), gpu);
  read_safetensors(dir.file("gpu.safetensors"), dst);
  CHECK(same_bits(dst, host));
  CHECK(read_file(dir.file("gpu.safetensors")).size() > 0);
}

// ----------------------------------------------------------------------------
// Low-precision weights: bf16 saves, BF16 and F16 loads (mixed_precision.cuh)

namespace {
// x rounded to bf16 by the format's definition: 8 significant bits, ties to even (nearbyint in
// the default rounding mode), for the normal values init_normal draws.
float bf16_by_definition(float x) {
  if (std::isnan(x) || x == 0) return x;
  const double ulp = std::ldexp(1.0, std::ilogb(x) - 7);
  return (float)(std::nearbyint(x / ulp) * ulp);
}
// A safetensors file written byte by byte: one tensor "w" of `dtype` and shape [n].
void write_one_tensor(const std::string& path, const std::string& dtype,
                      const std::vector<uint16_t>& values) {
  const std::string header = "{\"w\":{\"dtype\":\"" + dtype + "\",\"shape\":[" +
                             std::to_string(values.size()) + "],\"data_offsets\":[0," +
                             std::to_string(2 * values.size()) + "]}}";
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; b++) bytes[b] = (char)((uint64_t)header.size() >> (8 * b));
  bytes += header;
  for (uint16_t v : values) bytes += std::string{(char)(v & 0xFF), (char)(v >> 8)};  // LE
  write_bytes(path, bytes);
}
}  // namespace

TEST_CASE(
    "--save-dtype bf16: model.safetensors holds BF16 and loads back as the bf16-rounded "
    "weights; the optimizer state stays F32",
    "[checkpoint][precision]") {
  TempDir dir;
  const std::string ckpt = dir.file("ckpt");
  std::vector<NamedTensor> params = checkpoint_tensors(11);
  params.pop_back();  // the weights: F32 only
  std::vector<NamedTensor> squares = second_moments(11);
  squares.pop_back();
  OptimizerState opt{snapshot(params), squares, 5};
  save_checkpoint(ckpt, custom_config(), params, &opt, DType::BF16);
  const json config = json::parse(read_file(ckpt + "/config.json"));
  CHECK(config["torch_dtype"] == "bfloat16");
  const std::string model = read_file(ckpt + "/model.safetensors").substr(8, 1000);
  const std::string moments = read_file(ckpt + "/optimizer.safetensors").substr(8, 1000);
  CHECK_THAT(model, Contains("\"BF16\"") && !Contains("\"F32\""));
  CHECK_THAT(moments, Contains("\"F32\"") && !Contains("\"BF16\""));
  std::vector<NamedTensor> p = like(params);
  OptimizerState o{like(params), like(params), 0};
  CHECK(load_checkpoint(ckpt, p, &o));
  CHECK(same_bits(o.exp_avg, params));  // fp32 moments: bit for bit
  int64_t changed = 0;
  for (size_t i = 0; i < params.size(); i++)
    for (int64_t k = 0; k < params[i].tensor.numel(); k++) {
      const float x = params[i].tensor.f32()[k], got = p[i].tensor.f32()[k];
      INFO(params[i].name << "[" << k << "] = " << x);
      if (std::isnan(x)) {
        CHECK(std::isnan(got));
        continue;
      }
      CHECK(got == bf16_by_definition(x));
      CHECK(std::signbit(got) == std::signbit(x));
      changed += got != x;
    }
  CHECK(changed > 0);  // bf16 keeps 8 of fp32's 24 significant bits: most values move
  save_checkpoint(ckpt, custom_config(), params, &opt);  // the default: fp32 master weights
  CHECK(json::parse(read_file(ckpt + "/config.json"))["torch_dtype"] == "float32");
  CHECK(load_checkpoint(ckpt, p, &o));
  CHECK(same_bits(p, params));
}

TEST_CASE("BF16 and F16 safetensors written by hand load into fp32 exactly",
          "[checkpoint][precision]") {
  TempDir dir;
  // Patterns and their values by definition: bf16 = (-1)^s 2^(e-127) 1.m (7 bits),
  // fp16 = (-1)^s 2^(e-15) 1.m (10 bits), subnormals 2^(1-bias) 0.m.
  const std::vector<uint16_t> bf16 = {0x3F80, 0xC000, 0x3FC0, 0x0001, 0x7F7F, 0x8000};
  const float bf16_largest = (2 - std::ldexp(1.0f, -7)) * std::ldexp(1.0f, 127);
  const std::vector<float> bf16_values = {1, -2, 1.5f, std::ldexp(1.0f, -133), bf16_largest, -0.0f};
  const std::vector<uint16_t> fp16 = {0x3C00, 0xC000, 0x7BFF, 0x0001, 0x3555, 0x8000};
  const std::vector<float> fp16_values = {
      1, -2, 65504, std::ldexp(1.0f, -24), (1 + 341 / 1024.0f) / 4, -0.0f};
  for (auto [dtype, bits, values] :
       {std::make_tuple("BF16", bf16, bf16_values), std::make_tuple("F16", fp16, fp16_values)}) {
    INFO(dtype);
    const std::string path = dir.file(std::string(dtype) + ".safetensors");
    write_one_tensor(path, dtype, bits);
    std::vector<NamedTensor> w = {{"w", empty({6}, Mem::Params)}};
    read_safetensors(path, w);
    for (int i = 0; i < 6; i++) {
      CHECK(w[0].tensor.f32()[i] == values[i]);
      CHECK(std::signbit(w[0].tensor.f32()[i]) == std::signbit(values[i]));
    }
    // 16-bit data must be 2 bytes a value; an I32 destination takes no BF16/F16.
    std::vector<NamedTensor> longer = {{"w", empty({3}, Mem::Params)}};
    CHECK_THAT(usage_error_of([&] { read_safetensors(path, longer); }), Contains("shape [6]"));
    std::vector<NamedTensor> ints = {{"w", empty({6}, Mem::Params, Device::CPU, DType::I32)}};
    CHECK_THAT(usage_error_of([&] { read_safetensors(path, ints); }),
               Contains(std::string("dtype ") + dtype + ", expected I32"));
  }
  write_one_tensor(dir.file("fp8.safetensors"), "F8_E4M3", {0x3838, 0x3838, 0x3838});
  std::vector<NamedTensor> w = {{"w", empty({6}, Mem::Params)}};
  CHECK_THAT(usage_error_of([&] { read_safetensors(dir.file("fp8.safetensors"), w); }),
             Contains("dtype F8_E4M3, expected F32 (or BF16, F16)"));
}

TEST_CASE("a BF16 safetensors whose data has fp32's size is refused", "[checkpoint][precision]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  // Three BF16 values take 6 bytes; data_offsets giving them fp32's 12 are refused.
  const std::string header = "{\"w\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,12]}}";
  std::string bytes(8, '\0');
  for (int b = 0; b < 8; b++) bytes[b] = (char)((uint64_t)header.size() >> (8 * b));
  write_bytes(path, bytes + header + std::string(12, '\0'));
  std::vector<NamedTensor> w = {{"w", empty({3}, Mem::Params)}};
  CHECK_THAT(usage_error_of([&] { read_safetensors(path, w); }),
             Contains("hold 12 bytes, expected 6"));
}

TEST_CASE("--save-dtype accepts fp32 and bf16 and names itself otherwise",
          "[checkpoint][precision]") {
  CHECK(parse_save_dtype("fp32") == DType::F32);
  CHECK(parse_save_dtype("bf16") == DType::BF16);
  CHECK_THAT(usage_error_of([] { parse_save_dtype("fp8"); }),
             Contains("--save-dtype fp8") && Contains("fp32") && Contains("bf16"));
}
