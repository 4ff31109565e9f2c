// test_data.cu: datasets, splits and the layout-free batch order (DESIGN §5), and the messages
// a bad data file gets (DESIGN §9).
#include <catch2/catch.hpp>

#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/core.cuh"
#include "usage_error.cuh"
#include "runtime/data.cuh"

namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

// A fresh directory under /tmp, removed with everything in it when the test ends.
struct TempDir {
  std::string path;
  TempDir() {
    char name[] = "/tmp/picoscale_data_XXXXXX";
    REQUIRE(mkdtemp(name) != nullptr);
    path = name;
  }
  ~TempDir() { fs::remove_all(path); }
  std::string file(const std::string& name) const { return path + "/" + name; }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Tokens whose value tells their position, so a batch shows exactly where it was read from.
std::vector<int32_t> counting_tokens(int n) {
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; i++) tokens[i] = i % 65536;
  return tokens;
}


}  // namespace

TEST_CASE("a text file is one token per byte; val is the last val_fraction of it", "[data]") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 1000; i++) text += (char)('a' + i % 26);
  write_bytes(dir.file("text.txt"), text);
  Dataset data = load_dataset(dir.file("text.txt"), 0.1, 16);
  REQUIRE(data.train.size() == 900);
  REQUIRE(data.val.size() == 100);
  CHECK(data.train[0] == 'a');
  CHECK(data.val[0] == text[900]);
  CHECK(data.val[99] == text[999]);
  CHECK(data.max_token == 'z');
  CHECK(data.source == dir.file("text.txt"));
  // floor(n * val_fraction): 1000 * 0.25 = 250, 1001 * 0.1 = 100.1 -> 100.
  CHECK(load_dataset(dir.file("text.txt"), 0.25, 16).val.size() == 250);
  write_bytes(dir.file("text.txt"), text + "!");
  CHECK(load_dataset(dir.file("text.txt"), 0.1, 16).val.size() == 100);
}

TEST_CASE("sequence j of step s starts at ((s * global_batch + j) * seq) mod (n_train - seq)",
          "[data]") {
  TempDir dir;
  write_token_shard(dir.file("count.bin"), counting_tokens(1000));
  const Dataset data = load_dataset(dir.file("count.bin"), 0.1, 16);
  REQUIRE(data.train.size() == 900);
  const int seq = 16, global_batch = 8;
  const int64_t span = 900 - seq;
  // Step 0 reads from the start; step 7 passes the end of the split and wraps around.
  for (int64_t step : {0, 1, 2, 7, 100}) {
    std::vector<int32_t> inputs(global_batch * seq), targets(global_batch * seq);
    fill_train_batch(data, step, global_batch, 0, global_batch, seq, inputs.data(), targets.data(),
                     false, 0);
    for (int j = 0; j < global_batch; j++) {
      const int64_t start = ((step * global_batch + j) * seq) % span;
      for (int t = 0; t < seq; t++) {
        INFO("step " << step << " sequence " << j << " token " << t);
        REQUIRE(inputs[j * seq + t] == data.train[start + t]);
        REQUIRE(targets[j * seq + t] == data.train[start + t + 1]);  // next-token targets
      }
    }
  }
  std::vector<int32_t> inputs(seq), targets(seq);
  fill_train_batch(data, 7, global_batch, 0, 1, seq, inputs.data(), targets.data(), false, 0);
  CHECK(inputs[0] == (7 * 8 * 16) % span);  // 896 % 884 = 12: wrapped
}

TEST_CASE("any slice of the global batch is that slice of the full batch (layout-free)", "[data]") {
  TempDir dir;
  write_token_shard(dir.file("count.bin"), counting_tokens(5000));
  const Dataset data = load_dataset(dir.file("count.bin"), 0.1, 32);
  const int seq = 32, global_batch = 12;
  for (int64_t step : {0, 3, 41}) {
    std::vector<int32_t> all_in(global_batch * seq), all_tg(global_batch * seq);
    fill_train_batch(data, step, global_batch, 0, global_batch, seq, all_in.data(), all_tg.data(),
                     false, 0);
    // dp ranks x micro-batches: every way of cutting 12 sequences reads the same tokens.
    for (int pieces : {1, 2, 3, 4, 6, 12}) {
      const int per = global_batch / pieces;
      for (int p = 0; p < pieces; p++) {
        std::vector<int32_t> in(per * seq), tg(per * seq);
        fill_train_batch(data, step, global_batch, p * per, per, seq, in.data(), tg.data(), false, 0);
        INFO("step " << step << ", " << pieces << " pieces, piece " << p);
        REQUIRE(std::equal(in.begin(), in.end(), all_in.begin() + p * per * seq));
        REQUIRE(std::equal(tg.begin(), tg.end(), all_tg.begin() + p * per * seq));
      }
    }
  }
}

TEST_CASE("validation windows are consecutive seq-token windows of the val split", "[data]") {
  TempDir dir;
  write_token_shard(dir.file("count.bin"), counting_tokens(1000));
  const Dataset data = load_dataset(dir.file("count.bin"), 0.2, 16);
  REQUIRE(data.val.size() == 200);
  CHECK(num_val_windows(data, 16) == 12);  // (200 - 1) / 16: each window needs 17 tokens
  std::vector<int32_t> inputs(2 * 16), targets(2 * 16);
  fill_val_batch(data, 10, 2, 16, inputs.data(), targets.data());
  for (int i = 0; i < 2 * 16; i++) {
    CHECK(inputs[i] == data.val[160 + i]);
    CHECK(targets[i] == data.val[161 + i]);
  }
}

TEST_CASE("an llm.c .bin shard round-trips through write_token_shard", "[data]") {
  TempDir dir;
  std::vector<int32_t> tokens = counting_tokens(300);
  tokens[5] = 0, tokens[6] = 255, tokens[7] = 256, tokens[8] = 65535, tokens[9] = 50256;
  write_token_shard(dir.file("shard.bin"), tokens);
  const std::string bytes = read_file(dir.file("shard.bin"));
  REQUIRE(bytes.size() == 1024 + 2 * 300);
  int32_t header[3];
  memcpy(header, bytes.data(), sizeof header);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 300);
  Dataset data = load_dataset(dir.file("shard.bin"), 0.5, 16);
  std::vector<int32_t> back = data.train;
  back.insert(back.end(), data.val.begin(), data.val.end());
  CHECK(back == tokens);
  CHECK(data.max_token == 65535);
  CHECK(read_tokens(dir.file("shard.bin")) == tokens);
  CHECK_THROWS_WITH(write_token_shard(dir.file("big.bin"), {70000}), Contains("70000"));
}

TEST_CASE("bad data files are refused with a message naming the file and the problem", "[data]") {
  TempDir dir;
  const std::string shard = dir.file("shard.bin");
  write_token_shard(shard, counting_tokens(1000));
  const std::string good = read_file(shard);

  SECTION("bad magic") {
    std::string bytes = good;
    bytes[0] = 123, bytes[1] = bytes[2] = bytes[3] = 0;
    write_bytes(shard, bytes);
    std::string msg = usage_error_of([&] { load_dataset(shard, 0.1, 16); });
    CHECK_THAT(msg, Contains(shard) && Contains("bad magic 123, expected 20240520"));
  }
  SECTION("truncated shard") {
    write_bytes(shard, good.substr(0, good.size() - 1));
    std::string msg = usage_error_of([&] { load_dataset(shard, 0.1, 16); });
    CHECK_THAT(msg, Contains(shard) && Contains("1000 tokens") && Contains("truncated"));
  }
  SECTION("shard shorter than its header") {
    write_bytes(shard, good.substr(0, 100));
    CHECK_THAT(usage_error_of([&] { load_dataset(shard, 0.1, 16); }),
               Contains(shard) && Contains("too small"));
  }
  SECTION("missing file") {
    const std::string missing = dir.file("nope.txt");
    CHECK_THAT(usage_error_of([&] { load_dataset(missing, 0.1, 16); }),
               Contains("--data") && Contains(missing) && Contains("not found"));
    CHECK_THAT(usage_error_of([&] { read_tokens(missing); }), Contains(missing));
  }
  SECTION("too few tokens for one sequence in each split") {
    write_bytes(dir.file("small.txt"), std::string(100, 'x'));
    std::string msg = usage_error_of([&] { load_dataset(dir.file("small.txt"), 0.1, 16); });
    // val gets 10 tokens, needs 17: 170 tokens is the smallest file that works.
    CHECK_THAT(msg, Contains(dir.file("small.txt")) && Contains("--seq 16") &&
                        Contains("need at least 170") && Contains("val split"));
    CHECK_NOTHROW(load_dataset(dir.file("small.txt"), 0.1, 8));  // 9 of each: fits
    write_bytes(dir.file("small.txt"), std::string(170, 'x'));
    CHECK_NOTHROW(load_dataset(dir.file("small.txt"), 0.1, 16));
  }
  SECTION("val fraction outside (0, 1)") {
    for (double bad : {0.0, 1.0, -0.5, 2.0})
      CHECK_THAT(usage_error_of([&] { load_dataset(shard, bad, 16); }), Contains("--val-frac"));
  }
}

TEST_CASE("check_vocab refuses token ids outside the vocabulary", "[data]") {
  TempDir dir;
  write_token_shard(dir.file("shard.bin"), counting_tokens(1000));  // ids up to 999
  const Dataset data = load_dataset(dir.file("shard.bin"), 0.1, 16);
  CHECK_NOTHROW(check_vocab(data, 1000));
  CHECK_THAT(usage_error_of([&] { check_vocab(data, 999); }),
             Contains(dir.file("shard.bin")) && Contains("token id 999") &&
                 Contains("size 999") && Contains("--vocab"));
  CHECK_THROWS_AS(check_vocab(data, 256), UsageError);
}

TEST_CASE("the default corpus is every fortune file, over 1 MB of bytes", "[data]") {
  if (!fs::is_directory(default_corpus_dir())) {
    WARN("no " << default_corpus_dir() << " (Debian package fortunes): skipped");
    return;
  }
  const Dataset data = load_dataset("", 0.1, 128);
  const size_t n = data.train.size() + data.val.size();
  CHECK(n > (1u << 20));
  CHECK(data.val.size() == (size_t)(n * 0.1));
  CHECK(data.max_token <= 255);
  CHECK_THAT(data.source, Contains(default_corpus_dir()));
  // The first bytes are those of the alphabetically first fortune file.
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(default_corpus_dir())) {
    std::string name = e.path().filename().string();
    if (name.find('.') == std::string::npos && fs::is_regular_file(e.path())) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  const std::string first = read_file(default_corpus_dir() + "/" + names.front());
  for (size_t i = 0; i < 64 && i < first.size(); i++)
    CHECK(data.train[i] == (unsigned char)first[i]);
}
