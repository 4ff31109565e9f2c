// checkpoint.cu: Hugging Face compatible checkpoints. A directory holds config.json (LlamaConfig
// keys) and model.safetensors, so `LlamaForCausalLM.from_pretrained(dir)` opens what we train,
// plus optimizer.safetensors (Adam moments and step) for an exact resume. DESIGN §9: every
// write goes to a temporary name, is flushed to disk, then renamed, so a crash leaves the old
// checkpoint or the new one, never half of one; every load checks the whole file (header,
// names, dtypes, shapes, sizes) before it touches a single weight.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <set>

#include "runtime/checkpoint.cuh"
#include "runtime/dtype.cuh"
#include "runtime/inputs.cuh"

namespace fs = std::filesystem;
using nlohmann::json;

static const uint64_t kMaxHeaderBytes = 100u << 20;  // far above any real header; stops garbage

// ----------------------------------------------------------------------------
// JSON as a checkpoint holds it (safetensors headers, config.json, a shards' index)

// A checkpoint's JSON nests a few levels; JSON nested hundreds of thousands deep (a damaged or
// hostile file) would overflow the stack of whatever walks it recursively (printing an entry
// for a message), so it is refused before it is parsed.
static const int kMaxJsonDepth = 100;
static int json_depth(const std::string& text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      depth--;
    }
  }
  return deepest;
}
// `what`: the file as a message names it ("ckpt/config.json").
static void check_json_depth(const std::string& text, const std::string& what) {
  const int depth = json_depth(text);
  if (depth > kMaxJsonDepth)
    throw UsageError(what + ": JSON nested " + std::to_string(depth) + " levels deep, past the " +
                     std::to_string(kMaxJsonDepth) +
                     " any checkpoint needs (a damaged or hand-made file): write it again");
}
// A JSON file's text: a regular file (a FIFO is never opened), at most kMaxHeaderBytes, nested
// no deeper than kMaxJsonDepth. Throws UsageError "<what>: ...".
static std::string read_json_text(const std::string& path, const std::string& what) {
  check_input_file(what, path);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (size > kMaxHeaderBytes)
    throw UsageError(what + ": " + std::to_string(size) + " bytes, past the " +
                     std::to_string(kMaxHeaderBytes) + " a JSON file of a checkpoint may hold");
  std::ifstream in(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  check_json_depth(text, what);
  return text;
}
// A JSON value as a message shows it: at most 200 characters.
static std::string shown(const json& value) {
  std::string text = value.dump();
  return text.size() <= 200 ? text : text.substr(0, 200) + "...";
}

// ----------------------------------------------------------------------------
// Durable writes (write_file_atomic, in core.cu, writes each file)

// Makes the directory's entries (new names, renames) durable, not just the files' bytes.
static void fsync_dir(const std::string& dir) {
  int fd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

// copy_ runs on the legacy default stream, which the blocking compute stream is ordered with
// (core.cuh); checkpoints have no Context to name that stream, and the communication stream is
// not ordered with it at all: finish all device work before reading or overwriting weights.
static void wait_for_device(const std::vector<NamedTensor>& tensors) {
  for (const NamedTensor& nt : tensors)
    if (nt.tensor.device == Device::CUDA) {
      synchronize_device("the device's work before a checkpoint's copies");
      return;
    }
}
// A CPU tensor over caller-owned bytes, shaped like `like`: copy_ to or from any device.
static Tensor host_view(void* bytes, const Tensor& like) {
  Tensor h;
  h.ptr = bytes;
  h.shape = like.shape;
  h.dtype = like.dtype;
  return h;
}
static std::string shape_str(const std::vector<int64_t>& shape) {
  Tensor t;
  t.shape = shape;
  return t.shape_str();
}

// ----------------------------------------------------------------------------
// safetensors

void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();  // keeps the given order
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const NamedTensor& nt : tensors) {
    PICO_ASSERT(!header.contains(nt.name), "tensor name written twice: " + nt.name);
    const uint64_t end = offset + nt.tensor.nbytes();
    header[nt.name] = {{"dtype", dtype_name(nt.tensor.dtype)},
                       {"shape", nt.tensor.shape},
                       {"data_offsets", {offset, end}}};
    offset = end;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data then starts 8-byte aligned
  unsigned char length[8];                      // u64 little-endian header length
  for (int b = 0; b < 8; b++) length[b] = (unsigned char)((uint64_t)text.size() >> (8 * b));
  wait_for_device(tensors);
  write_file_atomic(path, [&](FILE* f) {
    write_all(f, length, 8, path);
    write_all(f, text.data(), text.size(), path);
    std::vector<char> buf;  // one tensor at a time, staged on the host (x86/ARM: little-endian)
    for (const NamedTensor& nt : tensors) {
      buf.resize(nt.tensor.nbytes());
      copy_(host_view(buf.data(), nt.tensor), nt.tensor);
      write_all(f, buf.data(), buf.size(), path);
    }
  });
}

// What a validated file holds: where each destination tensor's bytes start, and the metadata.
struct SafetensorsPlan {
  std::string path;
  std::vector<uint64_t> file_offsets;  // per destination tensor, from the start of the file
  std::vector<DType> file_dtypes;      // per destination tensor: its own, or BF16/F16 into F32
  std::map<std::string, std::string> metadata;
};

// The parsed JSON header and where the data after it starts and ends.
struct SafetensorsHeader {
  json entries;
  uint64_t data_start = 0, data_size = 0;
};
static SafetensorsHeader read_header(const std::string& path) {
  auto fail = [&](const std::string& what) { return UsageError(path + ": " + what); };
  std::error_code ec;
  check_input_file(path, path);
  const uint64_t size = fs::file_size(path, ec);
  if (size < 8) throw fail("too small for a safetensors file: " + std::to_string(size) + " bytes");
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) throw fail(std::string("cannot open: ") + strerror(errno));
  unsigned char length[8];
  uint64_t header_len = 0;
  bool ok = fread(length, 1, 8, f) == 8;
  for (int b = 0; b < 8; b++) header_len |= (uint64_t)length[b] << (8 * b);
  const bool sane = header_len <= size - 8 && header_len <= kMaxHeaderBytes;
  std::string text(sane ? header_len : 0, ' ');
  ok = ok && fread(&text[0], 1, text.size(), f) == text.size();
  fclose(f);
  if (!sane)
    throw fail("not a safetensors file: header length " + std::to_string(header_len) +
               " but the file has " + std::to_string(size) + " bytes");
  if (!ok) throw fail("read error");
  SafetensorsHeader h{json(), 8 + header_len, size - 8 - header_len};
  check_json_depth(text, path + ": the header");
  try {
    h.entries = json::parse(text);
  } catch (const json::parse_error& e) {
    throw fail(std::string("not a safetensors file: header is not valid JSON: ") + e.what());
  }
  if (!h.entries.is_object()) throw fail("not a safetensors file: header is not a JSON object");
  return h;
}

// Checks the whole file against `into` without touching any destination tensor.
static SafetensorsPlan inspect_safetensors(const std::string& path,
                                           const std::vector<NamedTensor>& into) {
  auto fail = [&](const std::string& what) { return UsageError(path + ": " + what); };
  const SafetensorsHeader h = read_header(path);
  const json& header = h.entries;
  SafetensorsPlan plan;
  plan.path = path;
  // The file's own entries, each well formed; the data they promise must all be there.
  std::map<std::string, std::pair<uint64_t, uint64_t>> ranges;  // name -> [begin, end)
  uint64_t promised = 0;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) throw fail("__metadata__ is not a JSON object");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) throw fail("__metadata__ " + key + " is not a string");
        plan.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    const json* off =
        entry.is_object() && entry.contains("data_offsets") ? &entry["data_offsets"] : nullptr;
    bool ok = off && off->is_array() && off->size() == 2 && (*off)[0].is_number_unsigned() &&
              (*off)[1].is_number_unsigned() && (*off)[0] <= (*off)[1] && entry.contains("dtype") &&
              entry["dtype"].is_string() && entry.contains("shape") && entry["shape"].is_array();
    if (ok)
      for (const json& dim : entry["shape"]) ok = ok && dim.is_number_unsigned();
    if (!ok) throw fail("tensor " + name + ": malformed entry " + shown(entry));
    ranges[name] = {(*off)[0].get<uint64_t>(), (*off)[1].get<uint64_t>()};
    promised = std::max(promised, ranges[name].second);
  }
  const uint64_t data_size = h.data_size;
  if (promised > data_size)
    throw fail("truncated: header promises " + std::to_string(promised) +
               " bytes of data, file has " + std::to_string(data_size));
  // The format requires the tensors' byte ranges to tile the data exactly, in some order: no
  // two overlap (one tensor's bytes read as another's) and none leaves a hole (bytes no tensor
  // owns). The safetensors library refuses both; so does this reader.
  std::vector<std::pair<std::pair<uint64_t, uint64_t>, std::string>> by_offset;
  for (const auto& [name, range] : ranges) by_offset.push_back({range, name});
  std::sort(by_offset.begin(), by_offset.end());
  uint64_t covered = 0;  // the data [0, covered) belongs to the tensors walked so far
  for (size_t i = 0; i < by_offset.size(); i++) {
    const auto& [range, name] = by_offset[i];
    const std::string offsets =
        "data_offsets [" + std::to_string(range.first) + ", " + std::to_string(range.second) + "]";
    if (range.first < covered)
      throw fail("tensor " + name + ": " + offsets + " overlap tensor " + by_offset[i - 1].second +
                 "'s [" + std::to_string(by_offset[i - 1].first.first) + ", " +
                 std::to_string(by_offset[i - 1].first.second) +
                 "]; the safetensors format gives every byte to one tensor (a corrupt or "
                 "hand-edited header): write the file again");
    if (range.first > covered)
      throw fail("tensor " + name + ": " + offsets + " leave bytes [" + std::to_string(covered) +
                 ", " + std::to_string(range.first) +
                 ") of the data to no tensor; the safetensors format allows no gaps (a corrupt "
                 "or hand-edited header): write the file again");
    covered = range.second;
  }

  // Names, dtypes, shapes and sizes against the destination.
  std::set<std::string> wanted;
  for (const NamedTensor& nt : into) wanted.insert(nt.name);
  for (const auto& r : ranges)
    if (!wanted.count(r.first))
      throw fail("tensor " + r.first + ": in the file but not in this model (extra tensor)");
  for (const NamedTensor& nt : into) {
    auto bad = [&](const std::string& what) { return fail("tensor " + nt.name + ": " + what); };
    if (!ranges.count(nt.name)) throw bad("missing from the file");
    const json& entry = header.at(nt.name);
    const std::string dtype = entry["dtype"].get<std::string>();
    DType file_dtype = nt.tensor.dtype;
    const bool widens = dtype_from_name(dtype, &file_dtype) && nt.tensor.dtype == DType::F32 &&
                        (file_dtype == DType::BF16 || file_dtype == DType::F16);
    if (dtype != dtype_name(nt.tensor.dtype) && !widens)
      throw bad("dtype " + dtype + ", expected " + dtype_name(nt.tensor.dtype) +
                (nt.tensor.dtype == DType::F32 ? " (or BF16, F16)" : ""));
    const std::vector<int64_t> shape = entry["shape"].get<std::vector<int64_t>>();
    if (shape != nt.tensor.shape)
      throw bad("shape " + shape_str(shape) + ", expected " + nt.tensor.shape_str());
    const auto [begin, end] = ranges[nt.name];
    const uint64_t nbytes = (uint64_t)nt.tensor.numel() * dtype_size(file_dtype);
    if (end - begin != nbytes)
      throw bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + "] hold " +
                std::to_string(end - begin) + " bytes, expected " + std::to_string(nbytes));
    plan.file_offsets.push_back(h.data_start + begin);
    plan.file_dtypes.push_back(file_dtype);
  }
  if (promised != data_size)  // the header describes the whole file, or the file is suspect
    throw fail(std::to_string(data_size - promised) + " bytes after the last tensor's data");
  return plan;
}

// Calls visit(i, bytes) with each tensor's bytes as the file stores them (plan.file_dtypes[i]),
// one tensor at a time.
static void read_each_tensor(const SafetensorsPlan& plan, const std::vector<NamedTensor>& into,
                             const std::function<void(size_t, const char*)>& visit) {
  FILE* f = fopen(plan.path.c_str(), "rb");
  if (!f) throw UsageError(plan.path + ": cannot open: " + strerror(errno));
  std::vector<char> buf;
  for (size_t i = 0; i < into.size(); i++) {
    buf.resize((size_t)into[i].tensor.numel() * dtype_size(plan.file_dtypes[i]));
    if (fseeko(f, (off_t)plan.file_offsets[i], SEEK_SET) != 0 ||
        fread(buf.data(), 1, buf.size(), f) != buf.size()) {
      fclose(f);
      throw UsageError(plan.path + ": tensor " + into[i].name + ": read error");
    }
    try {
      visit(i, buf.data());
    } catch (...) {
      fclose(f);
      throw;
    }
  }
  fclose(f);
}

static void copy_safetensors(const SafetensorsPlan& plan, const std::vector<NamedTensor>& into) {
  wait_for_device(into);
  std::vector<char> widened;
  read_each_tensor(plan, into, [&](size_t i, const char* bytes) {
    const Tensor& t = into[i].tensor;
    if (plan.file_dtypes[i] != t.dtype) {  // BF16 or F16 into F32: exact
      widened.resize(t.nbytes());
      cast_host(widened.data(), t.dtype, bytes, plan.file_dtypes[i], t.numel());
      bytes = widened.data();
    }
    copy_(t, host_view((void*)bytes, t));
  });
}

static const char* non_finite_name(float x) {
  if (std::isnan(x)) return "NaN";
  return x > 0 ? "+inf" : "-inf";
}

// Adam's second moment of a parameter: a running mean of squared gradients, never negative.
static bool is_second_moment(const std::string& name) {
  const std::string suffix = ".exp_avg_sq";
  return name.size() > suffix.size() &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// A checkpoint's floating-point tensors hold finite numbers, and Adam's second moments none
// below 0: a NaN or inf would only spread through training, and a negative second moment makes
// the update's sqrt a NaN at the first step (either stops the run steps later, blaming the
// learning rate). Throws UsageError naming the file, the first tensor (in the model's order)
// that breaks either, and the element.
static void require_finite(const SafetensorsPlan& plan, const std::vector<NamedTensor>& tensors) {
  auto g = [](float x) {
    char buf[32];
    snprintf(buf, sizeof buf, "%g", (double)x);
    return std::string(buf);
  };
  std::vector<float> wide;
  read_each_tensor(plan, tensors, [&](size_t i, const char* bytes) {
    const DType dtype = plan.file_dtypes[i];
    if (dtype != DType::F32 && dtype != DType::BF16 && dtype != DType::F16) return;
    const int64_t n = tensors[i].tensor.numel();
    const float* x = (const float*)bytes;
    if (dtype != DType::F32) {
      wide.resize(n);
      cast_host(wide.data(), DType::F32, bytes, dtype, n);
      x = wide.data();
    }
    for (int64_t e = 0; e < n; e++)
      if (!std::isfinite(x[e]))
        throw UsageError(plan.path + ": tensor " + tensors[i].name + ": element " +
                         std::to_string(e) + " of " + std::to_string(n) + " is " +
                         non_finite_name(x[e]) +
                         "; a checkpoint must hold finite numbers (it was saved from a run "
                         "that diverged, or is damaged): load an earlier checkpoint");
    if (is_second_moment(tensors[i].name))
      for (int64_t e = 0; e < n; e++)
        if (x[e] < 0)
          throw UsageError(plan.path + ": tensor " + tensors[i].name + ": element " +
                           std::to_string(e) + " of " + std::to_string(n) + " is " + g(x[e]) +
                           "; Adam's second moment is a running mean of squares and is never "
                           "negative (a damaged or hand-edited file): load an earlier "
                           "checkpoint, or remove optimizer.safetensors to start AdamW afresh");
  });
}

std::map<std::string, std::string> read_safetensors(const std::string& path,
                                                    const std::vector<NamedTensor>& into) {
  SafetensorsPlan plan = inspect_safetensors(path, into);
  copy_safetensors(plan, into);
  return plan.metadata;
}

// ----------------------------------------------------------------------------
// config.json

// The shortest decimal that reads back as the same float: config.json says 1e-05, not
// 9.999999747378752e-06, and a load recovers the exact float.
static double shortest(float x) {
  char buf[32];
  for (int digits = 1; digits <= 9; digits++) {
    snprintf(buf, sizeof buf, "%.*g", digits, (double)x);
    if (strtof(buf, nullptr) == x) break;
  }
  return strtod(buf, nullptr);
}

// The architecture config.json names for the book's GPT block (ModelConfig::gpt_block).
static const char* kGptArchitecture = "PicoscaleGptForCausalLM";

bool config_records_dropout(const ModelConfig& cfg) {
  if (cfg.loaded_config.empty()) return true;
  const json arch = json::parse(cfg.loaded_config).value("architectures", json::array());
  return std::find(arch.begin(), arch.end(), kGptArchitecture) != arch.end();
}

json hf_config(const ModelConfig& cfg) {
  if (!cfg.loaded_config.empty()) {
    // A loaded config.json is written back as it was: its token ids, transformers' own keys,
    // rope_parameters, every key picoscale does not read. Training changes none of them, nor
    // the shape (--load refuses shape flags that disagree). The one a run can move is the
    // context: max_position_embeddings grows to --seq when a run trains on longer sequences.
    json j = json::parse(cfg.loaded_config);
    if (j.value("max_position_embeddings", 0) < cfg.seq) j["max_position_embeddings"] = cfg.seq;
    // --dropout is a training setting: a GPT config says the one this run trained with.
    if (config_records_dropout(cfg) && j.value("hidden_dropout", 0.0f) != cfg.dropout)
      j["hidden_dropout"] = j["attention_dropout"] = shortest(cfg.dropout);
    return j;
  }
  json j = {{"architectures", json::array({"LlamaForCausalLM"})},
            {"model_type", "llama"},
            {"hidden_size", cfg.d_model},
            {"intermediate_size", cfg.ffn},
            {"num_hidden_layers", cfg.layers},
            {"num_attention_heads", cfg.heads},
            {"num_key_value_heads", cfg.kv_heads},
            {"head_dim", cfg.head_dim()},
            {"vocab_size", cfg.vocab},
            {"max_position_embeddings", cfg.seq},
            {"rms_norm_eps", shortest(cfg.norm_eps)},
            {"rope_theta", shortest(cfg.rope_theta)},
            {"initializer_range", shortest(cfg.init_std)},
            {"tie_word_embeddings", cfg.tie_embeddings},
            {"torch_dtype", "float32"},
            // Byte tokens have no BOS or EOS: say so rather than let a reader assume Llama's 1, 2.
            {"bos_token_id", nullptr},
            {"eos_token_id", nullptr},
            {"hidden_act", "silu"},
            {"attention_bias", false},
            {"mlp_bias", false},
            {"picoscale_preset", cfg.preset}};
  if (cfg.gpt_block() || cfg.dropout > 0) {
    // The book's GPT block (LayerNorm, GeLU, dropout) has no transformers class: the same files
    // under picoscale's own architecture, which only picoscale loads.
    j["architectures"] = json::array({kGptArchitecture});
    j["model_type"] = "picoscale-gpt";
    j["norm_type"] = cfg.norm == NormKind::LayerNorm ? "layernorm" : "rmsnorm";
    j["hidden_act"] = cfg.mlp == MlpKind::GeLU ? "gelu_pytorch_tanh" : "silu";
    j["hidden_dropout"] = j["attention_dropout"] = shortest(cfg.dropout);
  }
  if (cfg.experts > 0) {  // MixtralForCausalLM: the same Llama with a sparse MoE for its MLP
    j["architectures"] = json::array({"MixtralForCausalLM"});
    j["model_type"] = "mixtral";
    j.erase("attention_bias"), j.erase("mlp_bias");
    j["num_local_experts"] = cfg.experts, j["num_experts_per_tok"] = cfg.top_k;
    j["router_aux_loss_coef"] = shortest(cfg.aux_loss_coef);
    j["output_router_logits"] = true;  // the loss includes the load-balancing loss, as trained
    j["sliding_window"] = nullptr, j["router_jitter_noise"] = 0.0;
  }
  return j;
}

ModelConfig config_from_hf(const json& j, const std::string& path) {
  auto fail = [&](const std::string& what) { return UsageError(path + ": config.json: " + what); };
  if (!j.is_object()) throw fail("not a JSON object");
  // The value of `key`, or nullptr when absent (an error when required); JSON null = absent.
  auto find = [&](const char* key, bool required) -> const json* {
    auto it = j.find(key);
    if (it != j.end() && !it->is_null()) return &*it;
    if (required) throw fail(std::string("missing key ") + key);
    return nullptr;
  };
  auto positive_int = [&](const char* key, bool required, int fallback) {
    const json* v = find(key, required);
    if (!v) return fallback;
    if (!v->is_number_integer() || v->get<int64_t>() <= 0 || v->get<int64_t>() > INT_MAX)
      throw fail(std::string("key ") + key + " must be a positive integer, found " + shown(*v));
    return (int)v->get<int64_t>();
  };
  // A positive number that an fp32 holds as one: 1e300 would become inf, 1e-300 zero.
  auto positive_float = [&](const char* key, bool required, float fallback) {
    const json* v = find(key, required);
    if (!v) return fallback;
    const float x = v->is_number() ? v->get<float>() : 0.0f;
    if (!v->is_number() || !(v->get<double>() > 0) || !std::isfinite(x) || !(x > 0))
      throw fail(std::string("key ") + key + " must be a positive number within fp32's range (" +
                 "1.2e-38 to 3.4e38), found " + shown(*v));
    return x;
  };
  const json* arch = find("architectures", true);
  auto has = [&](const char* name) {
    return arch->is_array() && std::find(arch->begin(), arch->end(), name) != arch->end();
  };
  const bool mixtral = has("MixtralForCausalLM"), gpt = has(kGptArchitecture);
  if (!has("LlamaForCausalLM") && !mixtral && !gpt)
    throw fail("architectures " + shown(*arch) + " include neither LlamaForCausalLM, " +
               "MixtralForCausalLM nor " + kGptArchitecture);
  ModelConfig cfg;
  cfg.d_model = positive_int("hidden_size", true, 0);
  cfg.ffn = positive_int("intermediate_size", true, 0);
  cfg.layers = positive_int("num_hidden_layers", true, 0);
  cfg.heads = positive_int("num_attention_heads", true, 0);
  cfg.vocab = positive_int("vocab_size", true, 0);
  cfg.seq = positive_int("max_position_embeddings", true, 0);
  cfg.norm_eps = positive_float("rms_norm_eps", true, 0);
  // RMSNorm's eps guards a mean square against zero: Llama's 1e-5 or 1e-6. One above 1
  // outweighs the mean square of unit-scale activations, and the model barely moves.
  if (cfg.norm_eps > 1)
    throw fail("rms_norm_eps " + shown(j["rms_norm_eps"]) +
               " is above 1, where it would outweigh the mean square it guards (Llama's is 1e-5 "
               "or 1e-6): a damaged or mistyped config");
  // Optional keys take LlamaConfig's defaults (MixtralConfig's rope_theta: 1e6).
  cfg.kv_heads = positive_int("num_key_value_heads", false, cfg.heads);
  cfg.rope_theta = positive_float("rope_theta", false, mixtral ? 1e6f : 10000.0f);
  // transformers 5 writes {"rope_parameters": {"rope_type": "default", "rope_theta": ...}}.
  if (const json* rope = find("rope_parameters", false)) {
    auto type = rope->is_object() ? rope->find("rope_type") : rope->end();
    if (!rope->is_object() || (type != rope->end() && *type != "default"))
      throw fail("rope_parameters " + shown(*rope) +
                 " are not supported (picoscale implements "
                 "plain RoPE, rope_type default)");
    auto theta = rope->find("rope_theta");
    const float x = theta != rope->end() && theta->is_number() ? theta->get<float>() : 0.0f;
    if (theta != rope->end() && !(std::isfinite(x) && x > 0))
      throw fail(
          "rope_parameters.rope_theta must be a positive number within fp32's range, found " +
          shown(*theta));
    if (theta != rope->end()) cfg.rope_theta = x;
  }
  if (cfg.rope_theta < kMinRopeTheta)
    throw fail("rope_theta " + json(shortest(cfg.rope_theta)).dump() +
               " is below 1, where RoPE's turns per position grow past one radian and overflow " +
               "(Llama 2's base is 10000): a damaged or mistyped config");
  cfg.init_std = positive_float("initializer_range", false, 0.02f);
  if (const json* tie = find("tie_word_embeddings", false)) {
    if (!tie->is_boolean()) throw fail("key tie_word_embeddings must be true or false");
    cfg.tie_embeddings = tie->get<bool>();
  }
  const json* preset = find("picoscale_preset", false);
  cfg.preset = preset && preset->is_string() ? preset->get<std::string>() : "hf";
  cfg.loaded_config = j.dump();
  // What picoscale's Llama does not implement is refused, not silently ignored.
  if (positive_int("head_dim", false, cfg.d_model / cfg.heads) != cfg.head_dim())
    throw fail("head_dim differs from hidden_size / num_attention_heads = " +
               std::to_string(cfg.head_dim()) + "; picoscale derives head_dim");
  if (gpt) {  // the book's GPT block, as hf_config writes it
    const json* norm = find("norm_type", true);
    const json* act = find("hidden_act", true);
    const json* dropout = find("hidden_dropout", false);
    if (*norm != "layernorm" && *norm != "rmsnorm")
      throw fail("norm_type " + shown(*norm) + ": layernorm or rmsnorm");
    if (*act != "gelu_pytorch_tanh" && *act != "silu")
      throw fail("hidden_act " + shown(*act) + ": gelu_pytorch_tanh or silu");
    if (dropout &&
        !(dropout->is_number() && dropout->get<double>() >= 0 && dropout->get<double>() < 1))
      throw fail("hidden_dropout " + shown(*dropout) + ": a probability from 0 to below 1");
    cfg.norm = *norm == "layernorm" ? NormKind::LayerNorm : NormKind::RMSNorm;
    cfg.mlp = *act == "gelu_pytorch_tanh" ? MlpKind::GeLU : MlpKind::SwiGLU;
    cfg.dropout = dropout ? dropout->get<float>() : 0.0f;
  } else if (const json* act = find("hidden_act", false); act && *act != "silu") {
    throw fail("hidden_act " + shown(*act) + " is not supported (picoscale's MLP is SwiGLU, silu)");
  }
  // rope_scaling of rope_type "default" (transformers 4's older spelling: "type") is plain RoPE,
  // as transformers reads it; any other type scales the angles, which picoscale does not.
  if (const json* scaling = find("rope_scaling", false)) {
    const json* type = nullptr;
    for (const char* key : {"rope_type", "type"})
      if (!type && scaling->is_object() && scaling->contains(key)) type = &(*scaling)[key];
    if (!type || *type != "default")
      throw fail("rope_scaling " + shown(*scaling) +
                 " is not supported (picoscale implements plain RoPE: rope_type default)");
  }
  // One dropout probability for the attention's and the outputs' (--dropout): the Llama and
  // Mixtral blocks train without one (transformers writes 0.0).
  if (const json* drop = find("attention_dropout", false);
      drop && !(drop->is_number() && drop->get<float>() == cfg.dropout))
    throw fail("attention_dropout " + shown(*drop) + ": picoscale's " +
               (gpt ? "GPT block has one dropout probability, hidden_dropout's " +
                          json(shortest(cfg.dropout)).dump()
                    : std::string("Llama block has no dropout: 0.0")));
  for (const char* bias : {"attention_bias", "mlp_bias"})
    if (const json* b = find(bias, false); b && *b != false)
      throw fail(std::string(bias) + " is not supported (picoscale's linears have no bias)");
  if (mixtral) {  // the MLP is a sparse mixture of experts (expert_parallel.cu)
    cfg.experts = positive_int("num_local_experts", true, 0);
    cfg.top_k = positive_int("num_experts_per_tok", false, 2);
    if (cfg.top_k > cfg.experts)
      throw fail("num_experts_per_tok " + std::to_string(cfg.top_k) + " above num_local_experts " +
                 std::to_string(cfg.experts) + ": each token goes to 1 to " +
                 std::to_string(cfg.experts) + " experts");
    const json* coef = find("router_aux_loss_coef", false);
    if (coef &&
        !(coef->is_number() && coef->get<double>() >= 0 && std::isfinite(coef->get<float>())))
      throw fail("router_aux_loss_coef must be a number >= 0, found " + shown(*coef));
    cfg.aux_loss_coef = coef ? coef->get<float>() : 0.001f;
    // MixtralForCausalLM adds the load-balancing loss only when output_router_logits is true
    // (MixtralConfig's default is false): without it the loss is the cross-entropy alone.
    const json* router_logits = find("output_router_logits", false);
    if (router_logits && !router_logits->is_boolean())
      throw fail("key output_router_logits must be true or false, found " + shown(*router_logits));
    if (!router_logits || !router_logits->get<bool>()) cfg.aux_loss_coef = 0;
    if (const json* noise = find("router_jitter_noise", false); noise && *noise != 0)
      throw fail("router_jitter_noise " + shown(*noise) +
                 " is not supported (picoscale routes "
                 "without noise)");
    // Compared with the run's --seq once it is known (resolve_run_options).
    cfg.sliding_window = positive_int("sliding_window", false, 0);
  }
  return cfg;
}

// ----------------------------------------------------------------------------
// Checkpoint directories

// The optimizer file's tensor list: "<param>.exp_avg", "<param>.exp_avg_sq" per parameter.
static std::vector<NamedTensor> moment_tensors(const OptimizerState& opt) {
  PICO_ASSERT(opt.exp_avg.size() == opt.exp_avg_sq.size(), "one exp_avg_sq per exp_avg");
  std::vector<NamedTensor> out;
  for (size_t i = 0; i < opt.exp_avg.size(); i++) {
    out.push_back({opt.exp_avg[i].name + ".exp_avg", opt.exp_avg[i].tensor});
    out.push_back({opt.exp_avg_sq[i].name + ".exp_avg_sq", opt.exp_avg_sq[i].tensor});
  }
  return out;
}

// Replacing a checkpoint directory. rename() cannot put a directory over a non-empty one, so
// the new checkpoint is written whole under DIR.tmp.<host>.<pid> and then swapped with DIR in one
// step, renameat2(RENAME_EXCHANGE): a kill at any moment leaves DIR holding the old checkpoint
// or the new one, and the old one, now under the temporary name, is removed after. Where the
// filesystem cannot exchange (EINVAL), the old checkpoint steps aside to DIR.old.<host>.<pid>
// before the new one is renamed in; a kill between those two renames leaves no DIR but a whole
// DIR.old.*, which --load reads in its place (checkpoint_to_load). Temporaries of writers that
// are gone are removed by the next save. A symlink DIR is followed: its target is replaced and
// the link stays. Only an earlier checkpoint or an empty directory is ever replaced.
static std::string strip_slashes(std::string dir) {
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();  // "ckpt/" names "ckpt"
  return dir;
}
// "checkpoint-<step>": a periodic checkpoint's name inside DIR (--save-every); its step, or -1.
static int64_t periodic_step(const std::string& name) {
  const std::string prefix = "checkpoint-";
  const std::string digits = name.substr(std::min(name.size(), prefix.size()));
  if (name.compare(0, prefix.size(), prefix) != 0 || digits.empty() || digits.size() > 15 ||
      digits.find_first_not_of("0123456789") != std::string::npos)
    return -1;
  return std::stoll(digits);
}
// A periodic save's temporary inside DIR: "checkpoint-<step>.tmp.<host>.<pid>" (or .old.).
static bool is_temporary(const std::string& name) {
  const size_t dot = name.find('.');
  if (dot == std::string::npos || periodic_step(name.substr(0, dot)) < 0) return false;
  return name.compare(dot, 5, ".tmp.") == 0 || name.compare(dot, 5, ".old.") == 0;
}
// An earlier checkpoint, an empty directory, or one that holds only periodic checkpoints (a
// run with --save-every stopped before its final save).
static bool is_checkpoint_or_empty(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return false;
  if (fs::is_empty(dir, ec) || fs::exists(dir + "/config.json", ec)) return true;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (periodic_step(name) < 0 && !is_temporary(name)) return false;
  }
  return !ec;
}
static void require_replaceable(const std::string& what, const std::string& target) {
  std::error_code ec;
  if (fs::exists(target, ec) && !is_checkpoint_or_empty(target))
    throw UsageError(what +
                     ": exists and is not a checkpoint (no config.json); choose another "
                     "directory or remove it");
}
static void create_parent(const std::string& what, const std::string& target) {
  const fs::path parent = fs::path(target).parent_path();
  std::error_code ec;
  if (!parent.empty() && !fs::is_directory(parent, ec) && !fs::create_directories(parent, ec))
    throw UsageError(what + ": cannot create " + parent.string() + ": " + ec.message());
}

void check_checkpoint_output(const std::string& flag, const std::string& dir) {
  const std::string what = flag + " " + dir, target = output_target(strip_slashes(dir));
  require_replaceable(what, target);
  create_parent(what, target);
  probe_directory(what, target);
}

DType parse_save_dtype(const std::string& flag) {
  if (flag == "fp32") return DType::F32;
  if (flag == "bf16") return DType::BF16;
  if (flag == "fp16") return DType::F16;
  throw UsageError("--save-dtype " + flag + ": expected fp32 (the master weights), bf16 or fp16");
}

// The weights as saved: the fp32 tensors themselves, or host copies rounded to BF16.
// config.json's torch_dtype for the weights as saved.
static const char* torch_dtype_name(DType weights) {
  switch (weights) {
    case DType::BF16:
      return "bfloat16";
    case DType::F16:
      return "float16";
    default:
      return "float32";
  }
}

// FP16 tops out at 65504: a weight beyond it would be saved as inf (as torch's .half() does), so
// it is refused, naming the first one.
static std::vector<NamedTensor> weights_in(DType dtype, const std::vector<NamedTensor>& params) {
  if (dtype == DType::F32) return params;
  PICO_ASSERT(dtype == DType::BF16 || dtype == DType::F16,
              std::string("weights saved as ") + dtype_name(dtype));
  wait_for_device(params);
  std::vector<NamedTensor> out;
  for (const NamedTensor& nt : params) {
    Tensor narrow = empty(nt.tensor.shape, Mem::Workspace, Device::CPU, dtype);
    Tensor wide = to_device(nt.tensor, Device::CPU, Mem::Workspace);
    cast_(narrow, wide);
    const uint16_t* bits = (const uint16_t*)narrow.ptr;
    for (int64_t e = 0; dtype == DType::F16 && e < narrow.numel(); e++)
      if ((bits[e] & 0x7fff) == 0x7c00) {  // +-inf: every exponent bit set, no mantissa
        char value[32];
        snprintf(value, sizeof value, "%g", (double)wide.f32()[e]);
        throw UsageError("--save-dtype fp16: tensor " + nt.name + ": element " + std::to_string(e) +
                         " is " + value +
                         ", beyond fp16's largest value 65504 (it would be saved as inf): save "
                         "as bf16, which has fp32's range, or fp32");
      }
    out.push_back({nt.name, narrow});
  }
  return out;
}

// transformers' split (huggingface_hub's split_torch_state_dict_into_shards, which
// save_pretrained calls): tensors in the model's order fill a shard until the next one would
// take it past max_bytes, which starts a new one; a tensor larger than max_bytes gets a shard
// of its own at once, the shard being filled going on after it. One shard is model.safetensors.
static std::vector<std::vector<NamedTensor>> shards_of(const std::vector<NamedTensor>& weights,
                                                       uint64_t max_bytes) {
  std::vector<std::vector<NamedTensor>> shards;
  std::vector<NamedTensor> current;
  uint64_t current_bytes = 0;
  for (const NamedTensor& nt : weights) {
    const uint64_t bytes = nt.tensor.nbytes();
    if (bytes > max_bytes) {
      shards.push_back({nt});
      continue;
    }
    if (current_bytes + bytes > max_bytes) {
      shards.push_back(current);
      current.clear(), current_bytes = 0;
    }
    current.push_back(nt), current_bytes += bytes;
  }
  if (!current.empty()) shards.push_back(current);
  return shards;
}
// The weights into dir: model.safetensors, or save_pretrained's shards and their index
// ({"metadata": {"total_size": bytes}, "weight_map": {tensor: file}}, keys sorted, indent 2).
static void write_weights(const std::string& dir, const std::vector<NamedTensor>& weights,
                          uint64_t max_shard_bytes) {
  const std::vector<std::vector<NamedTensor>> shards = shards_of(weights, max_shard_bytes);
  if (shards.size() <= 1) {
    write_safetensors(dir + "/model.safetensors", weights, {{"format", "pt"}});
    return;
  }
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  uint64_t total = 0;
  for (size_t k = 0; k < shards.size(); k++) {
    char name[64];
    snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", k + 1, shards.size());
    write_safetensors(dir + "/" + name, shards[k], {{"format", "pt"}});
    for (const NamedTensor& nt : shards[k])
      index["weight_map"][nt.name] = name, total += nt.tensor.nbytes();
  }
  index["metadata"]["total_size"] = total;
  const std::string text = index.dump(2) + "\n";
  const std::string path = dir + "/model.safetensors.index.json";
  write_file_atomic(path, [&](FILE* f) { write_all(f, text.data(), text.size(), path); });
}

// DIR's model.safetensors.index.json parsed, or a discarded value when it is missing, not a
// regular file (a FIFO is never opened), too large, too deep or not JSON.
static json index_or_null(const std::string& dir) {
  try {
    return json::parse(read_json_text(dir + "/model.safetensors.index.json", dir), nullptr, false);
  } catch (const UsageError&) {
    return json::value_t::discarded;
  }
}

// What a save writes, and what an older checkpoint in DIR held that the new one replaces: a
// sharded model's index and its shards (save_pretrained removes them likewise).
static const char* kWritten[] = {"config.json", "model.safetensors", "optimizer.safetensors"};
// A name a save writes: its three files, or a sharded model's index and shards.
static bool written_by_save(const std::string& name) {
  for (const char* w : kWritten)
    if (name == w) return true;
  if (name == "model.safetensors.index.json") return true;
  static const std::regex shard("model-[0-9]{5}-of-[0-9]{5}\\.safetensors");
  return std::regex_match(name, shard);
}
static bool replaced_by_save(const std::string& dir, const std::string& name) {
  if (written_by_save(name)) return true;
  json index = index_or_null(dir);
  if (index.is_object() && index.contains("weight_map") && index["weight_map"].is_object())
    for (const auto& [tensor, file] : index["weight_map"].items())
      if (file == name) return true;
  return false;
}

// Everything else the old DIR holds (the user's tokenizer.json, a folder, the periodic
// checkpoints) goes into the new one before the swap, as hard links (the same filesystem: the
// temporary lies next to DIR), copied where links are refused. So the swap stays one atomic
// step and nothing picoscale did not write is lost.
static void keep_other_entries(const std::string& old_dir, const std::string& new_dir) {
  std::error_code ec;
  if (!fs::is_directory(old_dir, ec)) return;
  for (const fs::directory_entry& e : fs::directory_iterator(old_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (replaced_by_save(old_dir, name) || is_temporary(name)) continue;
    const fs::path to = fs::path(new_dir) / name;
    std::error_code link_ec;
    fs::copy(e.path(), to,
             fs::copy_options::recursive | fs::copy_options::copy_symlinks |
                 fs::copy_options::create_hard_links,
             link_ec);
    if (!link_ec) continue;
    fs::remove_all(to, ec);
    std::error_code copy_ec;
    fs::copy(e.path(), to, fs::copy_options::recursive | fs::copy_options::copy_symlinks, copy_ec);
    if (copy_ec)
      throw UsageError(old_dir + ": cannot keep " + name + " in the new checkpoint: " +
                       copy_ec.message() + "; move it out of the directory, or save elsewhere");
  }
  if (ec) throw UsageError(old_dir + ": cannot list: " + ec.message());
}

void save_checkpoint(const std::string& dir_arg, const ModelConfig& cfg,
                     const std::vector<NamedTensor>& params, const OptimizerState* opt,
                     DType weights_dtype, uint64_t max_shard_bytes) {
  const std::string dir = strip_slashes(dir_arg), target = output_target(dir);
  const std::string tmp = temp_name(target, "tmp");
  require_replaceable(dir, target);
  create_parent(dir, target);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec)) throw UsageError(tmp + ": cannot create: " + ec.message());
  try {
    json j = hf_config(cfg);
    // The weights' dtype under the key the config uses: transformers 5 writes "dtype", earlier
    // versions (and picoscale's own configs) "torch_dtype".
    const char* dtype = torch_dtype_name(weights_dtype);
    if (j.contains("dtype")) j["dtype"] = dtype;
    if (j.contains("torch_dtype") || !j.contains("dtype")) j["torch_dtype"] = dtype;
    const std::string config = j.dump(2) + "\n";
    write_file_atomic(tmp + "/config.json", [&](FILE* f) {
      write_all(f, config.data(), config.size(), tmp + "/config.json");
    });
    write_weights(tmp, weights_in(weights_dtype, params), max_shard_bytes);
    if (opt) {
      std::map<std::string, std::string> metadata = opt->metadata;
      metadata["step"] = std::to_string(opt->step);
      write_safetensors(tmp + "/optimizer.safetensors", moment_tensors(*opt), metadata);
    }
    keep_other_entries(target, tmp);
    fsync_dir(tmp);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  auto fail = [&](const std::string& what) {
    UsageError err(dir + ": cannot " + what + ": " + strerror(errno));
    fs::remove_all(tmp, ec);
    return err;
  };
  if (!fs::exists(target, ec)) {
    if (rename(tmp.c_str(), target.c_str()) != 0) throw fail("rename the new checkpoint in");
  } else if (renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(tmp, ec);  // the old checkpoint, now under the temporary name
  } else if (errno == EINVAL || errno == ENOSYS) {
    const std::string old = temp_name(target, "old");
    if (rename(target.c_str(), old.c_str()) != 0) throw fail("move the old checkpoint aside");
    if (rename(tmp.c_str(), target.c_str()) != 0) {
      UsageError err = fail("rename the new checkpoint in");
      rename(old.c_str(), target.c_str());
      throw err;
    }
    fs::remove_all(old, ec);
  } else {
    throw fail("replace it");
  }
  fsync_dir(fs::path(target).parent_path().string());
  remove_stale_temps(target, "tmp");
  remove_stale_temps(target, "old");
}

// optimizer.safetensors' step: a non-negative integer that fits int64 (strtoll saturates at
// 2^63 - 1 silently: ERANGE is checked).
static int64_t parse_step(const std::map<std::string, std::string>& metadata,
                          const std::string& path) {
  auto it = metadata.find("step");
  const char* text = it == metadata.end() ? "" : it->second.c_str();
  char* end = nullptr;
  errno = 0;
  const long long step = strtoll(text, &end, 10);
  if (end == text || *end != '\0' || step < 0 || errno == ERANGE || !isdigit((unsigned char)*text))
    throw UsageError(path +
                     ": metadata has no valid step (a non-negative integer below 2^63), "
                     "found '" +
                     std::string(text) +
                     "'; a damaged or hand-edited file: save it "
                     "again, or delete it to start AdamW afresh");
  return step;
}
// The step dir's optimizer.safetensors holds, from its header alone (0 without one).
static int64_t step_in(const std::string& dir) {
  const std::string path = dir + "/optimizer.safetensors";
  std::error_code ec;
  if (!fs::exists(path, ec)) return 0;
  const json header = read_header(path).entries;
  std::map<std::string, std::string> metadata;
  if (header.contains("__metadata__") && header["__metadata__"].is_object())
    for (const auto& [key, value] : header["__metadata__"].items()) {
      if (!value.is_string())  // as read_safetensors refuses it, rather than as a missing step
        throw UsageError(path + ": __metadata__ " + key + " is " + value.dump() +
                         ", not a string (safetensors metadata holds strings); a damaged or "
                         "hand-edited file: save it again, or delete it to start AdamW afresh");
      metadata[key] = value.get<std::string>();
    }
  return parse_step(metadata, path);
}

std::string periodic_checkpoint(const std::string& dir, int64_t step) {
  return strip_slashes(dir) + "/checkpoint-" + std::to_string(step);
}
// DIR's whole periodic checkpoints (config.json in place), by step.
static std::map<int64_t, std::string> periodic_checkpoints(const std::string& dir) {
  std::map<int64_t, std::string> found;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const int64_t step = periodic_step(e.path().filename().string());
    if (step >= 0 && fs::exists(e.path() / "config.json", ec)) found[step] = e.path().string();
  }
  return found;
}
// Whether DIR/checkpoint-<step> is one a periodic save wrote: only what a save writes in it
// (no notes, no folder), and its optimizer state at that step.
static bool written_by_periodic_save(const std::string& path, int64_t step) {
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(path, ec))
    if (!e.is_regular_file(ec) || e.is_symlink(ec) ||
        !written_by_save(e.path().filename().string()))
      return false;
  try {
    return !ec && fs::exists(path + "/optimizer.safetensors", ec) && step_in(path) == step;
  } catch (const UsageError&) {  // a damaged optimizer state: not one picoscale left whole
    return false;
  }
}

void prune_periodic_checkpoints(const std::string& dir_arg, int keep) {
  const std::string dir = output_target(strip_slashes(dir_arg));
  std::map<int64_t, std::string> found;
  for (const auto& [step, path] : periodic_checkpoints(dir))
    if (written_by_periodic_save(path, step)) found[step] = path;
  std::error_code ec;
  // Renamed to a temporary first (one atomic step), then removed: a run killed while it removes
  // leaves a temporary, which no load reads and the next save clears, never a torn checkpoint.
  for (auto it = found.begin(); keep > 0 && (int)found.size() > keep; it = found.erase(it)) {
    const std::string gone = temp_name(it->second, "old");
    if (rename(it->second.c_str(), gone.c_str()) == 0) fs::remove_all(gone, ec);
  }
  // Temporaries of periodic saves killed at other steps than this run's.
  std::set<std::string> killed;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (is_temporary(name)) killed.insert(dir + "/" + name.substr(0, name.find('.')));
  }
  for (const std::string& base : killed)
    remove_stale_temps(base, "tmp"), remove_stale_temps(base, "old");
}

// DIR itself, or its newest periodic checkpoint when that one is further along (a run killed
// after a checkpoint-<step>, or stopped before its final save); when DIR is missing, the newest
// whole DIR.old.* that a save killed between its two renames left behind (see
// save_checkpoint). `note`: rank 0 says which it reads when it is not DIR.
static std::string checkpoint_to_load(const std::string& dir_arg, bool note) {
  const std::string dir = strip_slashes(dir_arg);
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    // By the step each one's optimizer state holds: a folder's name could be stale (a
    // checkpoint-100 left by an earlier run that holds step 3).
    const std::map<int64_t, std::string> periodic = periodic_checkpoints(dir);
    if (periodic.empty()) return dir;
    std::string best = fs::exists(dir + "/config.json", ec) ? dir : "";
    int64_t best_step = best.empty() ? -1 : step_in(dir);
    for (const auto& [name_step, path] : periodic) {
      const int64_t step = step_in(path);
      if (step > best_step) best = path, best_step = step;
    }
    if (best != dir && note && is_main_process())
      printf("note: loading %s, the checkpoint of %s furthest along (step %lld)\n", best.c_str(),
             dir.c_str(), (long long)best_step);
    return best;
  }
  if (fs::exists(dir, ec)) return dir;
  const fs::path target = output_target(dir);
  const std::string prefix = target.filename().string() + ".old.";
  std::string best;
  fs::file_time_type newest;
  const fs::path parent = target.parent_path().empty() ? "." : target.parent_path();
  for (const fs::directory_entry& e : fs::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0 || !fs::exists(e.path() / "config.json", ec))
      continue;
    fs::file_time_type t = fs::last_write_time(e.path(), ec);
    if (best.empty() || t > newest) best = e.path().string(), newest = t;
  }
  if (best.empty()) return dir;
  if (note && is_main_process())
    printf("note: %s is missing; a save was interrupted: loading the previous checkpoint %s\n",
           dir.c_str(), best.c_str());
  return best;
}

ModelConfig read_checkpoint_config(const std::string& dir_arg) {
  const std::string dir = checkpoint_to_load(dir_arg, true);
  const std::string path = dir + "/config.json";
  std::error_code ec;
  if (input_file_problem(path) == "not found")
    throw UsageError("--load " + dir + ": no config.json" +
                     (fs::is_directory(dir, ec) ? " in it" : " (no such directory)") +
                     "; point --load at a directory written by --save or a Hugging Face Llama");
  const std::string text = read_json_text(path, "--load " + dir + ": config.json");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw UsageError("--load " + dir + ": config.json is not valid JSON: " + e.what());
  }
  return config_from_hf(j, dir);
}

void check_checkpoint_weights(const std::string& dir_arg) {
  const std::string dir = checkpoint_to_load(dir_arg, false);
  std::error_code ec;
  const std::string single = dir + "/model.safetensors";
  if (fs::exists(single, ec) || fs::exists(single + ".index.json", ec)) return;
  for (const char* pickle : {"pytorch_model.bin", "pytorch_model.bin.index.json"})
    if (fs::exists(dir + "/" + pickle, ec))
      throw UsageError("--load " + dir + ": holds " + pickle +
                       ", PyTorch's pickle format, which picoscale does not read (unpickling runs "
                       "code; it reads safetensors only): convert it with transformers, "
                       "from_pretrained(dir).save_pretrained(out) writes model.safetensors");
  throw UsageError("--load " + single + ": not found, nor a sharded model's " +
                   "model.safetensors.index.json" +
                   (fs::is_directory(dir, ec) ? "" : " (no such directory)") +
                   "; point --load at a directory written by --save or a Hugging Face Llama");
}

// The weights' files, each validated against the tensors it must hold: model.safetensors, or
// the shards a Hugging Face index (model.safetensors.index.json, {"weight_map": {tensor:
// file}}) names. Every tensor is mapped exactly once; every shard holds exactly its tensors.
struct WeightFile {
  SafetensorsPlan plan;
  std::vector<NamedTensor> tensors;
};
static std::vector<WeightFile> inspect_weights(const std::string& dir,
                                               const std::vector<NamedTensor>& params) {
  check_checkpoint_weights(dir);
  const std::string single = dir + "/model.safetensors", index = single + ".index.json";
  std::error_code ec;
  if (fs::exists(single, ec) || !fs::exists(index, ec))
    return {{inspect_safetensors(single, params), params}};
  auto fail = [&](const std::string& what) { return UsageError(index + ": " + what); };
  const std::string text = read_json_text(index, index);
  // JSON keeps the last of two equal keys: catch a tensor listed twice while parsing.
  std::string top, twice;
  std::set<std::string> seen;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1) top = parsed.get<std::string>();
    if (event == json::parse_event_t::key && depth == 2 && top == "weight_map" &&
        !seen.insert(parsed.get<std::string>()).second && twice.empty())
      twice = parsed.get<std::string>();
    return true;
  };
  json j;
  try {
    j = json::parse(text, cb);
  } catch (const json::parse_error& e) {
    throw fail(std::string("not valid JSON: ") + e.what());
  }
  if (!twice.empty()) throw fail("tensor " + twice + " is listed twice in weight_map");
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw fail("no weight_map object");
  const json& map = j["weight_map"];
  std::map<std::string, std::vector<NamedTensor>> by_file;
  std::set<std::string> wanted;
  for (const NamedTensor& nt : params) {
    wanted.insert(nt.name);
    auto it = map.find(nt.name);
    if (it == map.end() || !it->is_string())
      throw fail("tensor " + nt.name + ": not in weight_map");
    by_file[it->get<std::string>()].push_back(nt);
  }
  for (const auto& [name, file] : map.items())
    if (!wanted.count(name)) throw fail("tensor " + name + ": in weight_map but not in this model");
  std::vector<WeightFile> files;
  for (const auto& [file, tensors] : by_file) {
    const std::string path = dir + "/" + file;
    if (file.find('/') != std::string::npos || input_file_problem(path) == "not found")
      throw fail("shard " + file + " (holding " + tensors[0].name + "): not found in " + dir);
    const json holds = read_header(path).entries;
    for (const auto& [name, entry] : holds.items())
      if (name != "__metadata__" && map.contains(name) && map[name] != file)
        throw UsageError(path + ": tensor " + name + " is also in shard " +
                         map[name].get<std::string>() + ": listed twice");
    files.push_back({inspect_safetensors(path, tensors), tensors});
  }
  return files;
}

bool load_checkpoint(const std::string& dir_arg, const std::vector<NamedTensor>& params,
                     OptimizerState* opt) {
  const std::string dir = checkpoint_to_load(dir_arg, false);
  const std::string opt_path = dir + "/optimizer.safetensors";
  const std::vector<WeightFile> weights = inspect_weights(dir, params);
  std::error_code ec;
  const bool with_opt = opt && fs::exists(opt_path, ec);
  std::vector<NamedTensor> moments;
  SafetensorsPlan moments_plan;
  int64_t step = 0;
  if (with_opt) {
    moments = moment_tensors(*opt);
    moments_plan = inspect_safetensors(opt_path, moments);
    step = parse_step(moments_plan.metadata, opt_path);
  } else if (opt && is_main_process()) {
    printf(
        "note: %s has no optimizer.safetensors (weights only, as in a Hugging Face model): "
        "AdamW starts fresh at step 0\n",
        dir.c_str());
  }
  // Every number finite, the weights' first (a second read of the files, from the page cache
  // mostly: the check must end before any destination changes).
  for (const WeightFile& w : weights) require_finite(w.plan, w.tensors);
  if (with_opt) require_finite(moments_plan, moments);
  // Every file is valid: only now does any destination tensor change.
  for (const WeightFile& w : weights) copy_safetensors(w.plan, w.tensors);
  if (with_opt) {
    copy_safetensors(moments_plan, moments);
    opt->step = step;
    opt->metadata = moments_plan.metadata;
  }
  return with_opt;
}

int64_t checkpoint_step(const std::string& dir) {
  return step_in(checkpoint_to_load(dir, false));
}

std::vector<std::string> checkpoint_input_files(const std::string& dir_arg) {
  const std::string dir = checkpoint_to_load(dir_arg, false);
  std::vector<std::string> files;
  std::error_code ec;
  auto add = [&](const std::string& path) {
    if (fs::exists(path, ec)) files.push_back(path);
  };
  add(dir + "/config.json");
  add(dir + "/model.safetensors");
  if (!fs::exists(dir + "/model.safetensors", ec)) {
    const std::string index = dir + "/model.safetensors.index.json";
    add(index);
    json j = index_or_null(dir);
    std::set<std::string> shards;
    if (j.is_object() && j.contains("weight_map") && j["weight_map"].is_object())
      for (const auto& [tensor, file] : j["weight_map"].items())
        if (file.is_string()) shards.insert(file.get<std::string>());
    for (const std::string& shard : shards) add(dir + "/" + shard);
  }
  add(dir + "/optimizer.safetensors");
  return files;
}

std::vector<std::string> checkpoint_output_files(const std::string& dir_arg) {
  const std::string dir = strip_slashes(dir_arg);
  std::vector<std::string> files;
  for (const char* name : kWritten) files.push_back(dir + "/" + name);
  return files;
}

// ----------------------------------------------------------------------------
// Tensor-parallel shards: checkpoints always hold whole tensors

// Each rank writes its block into a zeroed full tensor and the tp ranks sum them on rank 0:
// blocks do not overlap (only one writer per replicated block), so the sum is exact.
static std::vector<Tensor> gather_full_tensors(Group& tp, const std::vector<Tensor>& shards,
                                               const std::vector<TpSlice>& layouts) {
  if (tp.size == 1) return shards;
  std::vector<Tensor> full;
  for (size_t i = 0; i < shards.size(); i++) {
    const TpSlice& l = layouts[i];
    Tensor t = zeros(l.full_shape, Mem::Workspace);
    if (l.writer) store_block(shards[i], t.f32(), l.row0, l.col0, l.full_cols());
    host_wait(tp, "reduce of whole tensors", t.nbytes(), [&](MPI_Request* r) {
      return MPI_Ireduce(tp.rank == 0 ? MPI_IN_PLACE : t.ptr, t.ptr, (int)t.numel(), MPI_FLOAT,
                         MPI_SUM, 0, tp.mpi, r);
    });
    full.push_back(t);
  }
  return full;
}
static void scatter_full_tensors(const std::vector<Tensor>& full, const std::vector<Tensor>& shards,
                                 const std::vector<TpSlice>& layouts) {
  for (size_t i = 0; i < shards.size(); i++) {
    if (full[i].ptr == shards[i].ptr) continue;
    std::vector<float> host = to_host_floats(full[i]);
    load_block(shards[i], host.data(), layouts[i].row0, layouts[i].col0, layouts[i].full_cols());
  }
}

static std::vector<Tensor> tensors_of(const std::vector<NamedTensor>& named) {
  std::vector<Tensor> t;
  for (const NamedTensor& n : named) t.push_back(n.tensor);
  return t;
}

std::vector<NamedTensor> whole_tensors(const FlatParameters& p, Group& tp,
                                       const std::vector<NamedTensor>& shards) {
  if (tp.size == 1) return shards;
  std::vector<Tensor> whole = gather_full_tensors(tp, tensors_of(shards), p.layouts);
  if (tp.rank != 0) return {};
  std::vector<NamedTensor> named;
  for (size_t i = 0; i < shards.size(); i++) named.push_back({shards[i].name, whole[i]});
  return named;
}

bool load_checkpoint_shards(const FlatParameters& p, Group& tp, const std::string& dir,
                            const std::vector<NamedTensor>& params, OptimizerState* opt) {
  if (tp.size == 1) return load_checkpoint(dir, params, opt);
  auto whole_like = [&](const std::vector<NamedTensor>& shards) {
    std::vector<NamedTensor> whole;
    for (size_t i = 0; i < shards.size(); i++)
      whole.push_back({shards[i].name, empty(p.layouts[i].full_shape, Mem::Workspace)});
    return whole;
  };
  std::vector<NamedTensor> weights = whole_like(params);
  OptimizerState whole_opt;
  if (opt) whole_opt = {whole_like(opt->exp_avg), whole_like(opt->exp_avg_sq), 0};
  bool loaded = load_checkpoint(dir, weights, opt ? &whole_opt : nullptr);
  scatter_full_tensors(tensors_of(weights), tensors_of(params), p.layouts);
  if (loaded) {
    scatter_full_tensors(tensors_of(whole_opt.exp_avg), tensors_of(opt->exp_avg), p.layouts);
    scatter_full_tensors(tensors_of(whole_opt.exp_avg_sq), tensors_of(opt->exp_avg_sq), p.layouts);
    opt->step = whole_opt.step;
    opt->metadata = whole_opt.metadata;
  }
  return loaded;
}

// ----------------------------------------------------------------------------
// Pipeline stages: the stages' tensors on one rank

// Hugging Face order: the embedding, the blocks by index (each block's tensors as they come),
// the final norm, the LM head.
static std::pair<int, int> hf_rank(const std::string& name) {
  const std::string layers = "model.layers.";
  if (name.rfind("model.embed_tokens", 0) == 0) return {0, 0};
  if (name.rfind(layers, 0) == 0) return {1, std::stoi(name.substr(layers.size()))};
  if (name.rfind("model.norm", 0) == 0) return {2, 0};
  return {3, 0};
}

std::vector<NamedTensor> gather_stage_tensors(Group& g, const std::vector<NamedTensor>& mine) {
  if (g.size == 1) return mine;
  // Each rank packs its tensors: name, dims, shape, values; pp rank 0 gathers the packs.
  std::vector<char> pack;
  auto put = [&](const void* data, size_t bytes) {
    pack.insert(pack.end(), (const char*)data, (const char*)data + bytes);
  };
  for (const NamedTensor& t : mine) {
    int64_t name_size = (int64_t)t.name.size(), dims = t.tensor.dim();
    put(&name_size, sizeof name_size), put(t.name.data(), t.name.size());
    put(&dims, sizeof dims), put(t.tensor.shape.data(), dims * sizeof(int64_t));
    std::vector<float> values = to_host_floats(t.tensor);
    put(values.data(), values.size() * sizeof(float));
  }
  int size = (int)pack.size();
  std::vector<int> sizes(g.size), offsets(g.size, 0);
  host_wait(g, "gather of the stages' tensors", sizeof size, [&](MPI_Request* r) {
    return MPI_Igather(&size, 1, MPI_INT, sizes.data(), 1, MPI_INT, 0, g.mpi, r);
  });
  for (int r = 1; r < g.size; r++) offsets[r] = offsets[r - 1] + sizes[r - 1];
  std::vector<char> all(g.rank == 0 ? offsets.back() + sizes.back() : 0);
  host_wait(g, "gather of the stages' tensors", size, [&](MPI_Request* r) {
    return MPI_Igatherv(pack.data(), size, MPI_CHAR, all.data(), sizes.data(), offsets.data(),
                        MPI_CHAR, 0, g.mpi, r);
  });
  std::vector<NamedTensor> whole;
  for (size_t at = 0; at < all.size();) {
    auto get = [&](void* data, size_t bytes) {
      std::copy_n(&all[at], bytes, (char*)data), at += bytes;
    };
    int64_t name_size = 0, dims = 0;
    get(&name_size, sizeof name_size);
    std::string name(name_size, '\0');
    get(name.data(), name_size);
    get(&dims, sizeof dims);
    std::vector<int64_t> shape(dims);
    get(shape.data(), dims * sizeof(int64_t));
    Tensor t = empty(shape, Mem::Workspace);
    get(t.ptr, t.nbytes());
    whole.push_back({name, t});
  }
  std::stable_sort(whole.begin(), whole.end(), [](const NamedTensor& a, const NamedTensor& b) {
    return hf_rank(a.name) < hf_rank(b.name);
  });
  return whole;
}
