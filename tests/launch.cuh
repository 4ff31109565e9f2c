// Helpers for tests that launch ./train (one process or under mpirun) and read what it wrote.
#pragma once
#include <sys/wait.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

struct RunResult {
  int code;            // exit status; -1 when killed by a signal
  std::string output;  // stdout and stderr
};
// Runs a shell command, stdout and stderr together.
inline RunResult run_command(const std::string& cmd) {
  RunResult r{-1, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}
// Runs `./train <args>` with np ranks (np 0: without mpirun). Adds --device cpu unless given.
inline RunResult run_train(const std::string& args, int np = 0) {
  std::string device = args.find("--device") == std::string::npos ? "--device cpu " : "";
  std::string launcher = np > 0 ? "mpirun --oversubscribe -np " + std::to_string(np) + " " : "";
  return run_command(launcher + "./train " + device + args);
}
inline std::string make_temp_dir() {
  char tmpl[] = "/tmp/picoscale-test-XXXXXX";
  return mkdtemp(tmpl) ? tmpl : "";
}
inline std::string read_whole_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}
inline std::vector<nlohmann::json> read_json_lines(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) lines.push_back(nlohmann::json::parse(line));
  return lines;
}
// Every tensor of a safetensors file, by name: dtype, shape and raw bytes (a plain reader,
// independent of checkpoint.cu).
struct RawTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
inline std::map<std::string, RawTensor> read_raw_tensors(const std::string& path) {
  std::string bytes = read_whole_file(path);
  std::map<std::string, RawTensor> out;
  if (bytes.size() < 8) return out;
  uint64_t header_len = 0;
  memcpy(&header_len, bytes.data(), 8);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_len));
  for (auto& [name, info] : header.items()) {
    if (name == "__metadata__") continue;
    size_t begin = info["data_offsets"][0], end = info["data_offsets"][1];
    out[name] = {info["dtype"], info["shape"].get<std::vector<int64_t>>(),
                 bytes.substr(8 + header_len + begin, end - begin)};
  }
  return out;
}
// Every F32 tensor of a safetensors file, by name.
inline std::map<std::string, std::vector<float>> read_f32_tensors(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  for (auto& [name, t] : read_raw_tensors(path)) {
    std::vector<float> v(t.bytes.size() / 4);
    memcpy(v.data(), t.bytes.data(), v.size() * 4);
    out[name] = std::move(v);
  }
  return out;
}
inline int count_occurrences(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1))
    n++;
  return n;
}
