// test_data.cu: datasets, splits and the layout-free batch order (DESIGN §5), and the messages
// a bad data file gets (DESIGN §9).
#include <stdlib.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "runtime/core.cuh"
#include "runtime/data.cuh"
#include "usage_error.cuh"

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
        fill_train_batch(data, step, global_batch, p * per, per, seq, in.data(), tg.data(), false,
                         0);
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
             Contains(dir.file("shard.bin")) && Contains("token id 999") && Contains("size 999") &&
                 Contains("--vocab"));
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

// ----------------------------------------------------------------------------
// Boundaries: split lengths that --seq divides and does not, one window, two epochs, the
// val split's rounding, text and .bin. Expected values come from the definitions (a window of
// seq + 1 tokens that fits in the split), counted by brute force, never from data.cu's formulas.

namespace {

// A training split of n tokens whose values are their positions.
Dataset split_of(int64_t n) {
  Dataset d;
  d.train.resize(n);
  for (int64_t i = 0; i < n; i++) d.train[i] = (int32_t)i;
  d.val = d.train;
  d.max_token = (int32_t)n - 1;
  return d;
}
// The whole windows of a split: starts w * seq whose seq + 1 tokens all lie inside it.
std::vector<int64_t> whole_windows(int64_t n, int seq) {
  std::vector<int64_t> starts;
  for (int64_t start = 0; start + seq + 1 <= n; start += seq) starts.push_back(start);
  return starts;
}
// The starts of sequences [first, first + count) of the run (global batch 1), checking that each
// reads seq consecutive tokens of the split and its next-token targets.
std::vector<int64_t> read_starts(const Dataset& d, int seq, int64_t first, int64_t count,
                                 bool shuffle) {
  std::vector<int64_t> starts;
  std::vector<int32_t> in(seq), tg(seq);
  for (int64_t k = first; k < first + count; k++) {
    fill_train_batch(d, k, 1, 0, 1, seq, in.data(), tg.data(), shuffle, 1337);
    for (int t = 0; t < seq; t++) {
      INFO("sequence " << k << ", token " << t);
      REQUIRE(in[t] == in[0] + t);
      REQUIRE(tg[t] == in[0] + t + 1);
    }
    REQUIRE(tg[seq - 1] < (int32_t)d.train.size());
    starts.push_back(in[0]);
  }
  return starts;
}

}  // namespace

// Guards: an off-by-one in the shuffled window count: (n - 1) / seq windows when the split is
// n tokens. One too many reads past the split's end exactly when seq divides n (an llm.c shard
// can be such a split); one too few never reads the last window when seq divides n - 1.
TEST_CASE(
    "the shuffled order reads every whole window exactly once per epoch, for every split "
    "length around multiples of --seq",
    "[data]") {
  for (int seq : {1, 4, 7, 16}) {
    for (int64_t windows : {1, 2, 3, 10, 64}) {
      for (int64_t extra : {-1, 0, 1, 2, seq - 1}) {
        // n = windows * seq + extra: seq divides n when extra is 0 (or seq - 1 + 1 wraps).
        const int64_t n = windows * seq + extra;
        if (n < seq + 1) continue;  // not even one window: load_dataset refuses such a split
        INFO("seq " << seq << ", split of " << n << " tokens");
        const Dataset d = split_of(n);
        std::vector<int64_t> expected = whole_windows(n, seq);
        REQUIRE(!expected.empty());
        const int64_t W = (int64_t)expected.size();
        for (int64_t epoch : {0, 1}) {  // two epochs: each a permutation of every window
          INFO("epoch " << epoch);
          std::vector<int64_t> got = read_starts(d, seq, epoch * W, W, true);
          std::sort(got.begin(), got.end());
          CHECK(got == expected);
        }
      }
    }
  }
}

TEST_CASE("one window: every sequence of every epoch reads it, shuffled or in file order",
          "[data]") {
  for (int seq : {4, 16}) {
    for (int64_t n : {(int64_t)seq + 1, 2 * (int64_t)seq}) {  // seq + 1 up to 2 seq: one window
      INFO("seq " << seq << ", split of " << n);
      const Dataset d = split_of(n);
      REQUIRE(whole_windows(n, seq).size() == 1);
      for (bool shuffle : {true, false}) {
        INFO("shuffle " << shuffle);
        CHECK(read_starts(d, seq, 0, 5, shuffle) == std::vector<int64_t>(5, 0));
      }
    }
  }
}

// Guards: an order that ignores the epoch (every epoch the same), or a batch that skips or
// repeats windows across steps of a global batch that does not divide the window count.
TEST_CASE(
    "two epochs of the shuffled order differ, and a global batch of 3 reads the same "
    "sequence stream as a global batch of 1",
    "[data]") {
  const int seq = 8;
  const Dataset d = split_of(50 * seq + 1);                               // 50 windows
  const std::vector<int64_t> stream = read_starts(d, seq, 0, 102, true);  // two epochs and 2
  CHECK(std::vector<int64_t>(stream.begin(), stream.begin() + 50) !=
        std::vector<int64_t>(stream.begin() + 50, stream.begin() + 100));
  std::vector<int32_t> in(3 * seq), tg(3 * seq);
  for (int64_t step = 0; step < 34; step++) {
    fill_train_batch(d, step, 3, 0, 3, seq, in.data(), tg.data(), true, 1337);
    for (int j = 0; j < 3; j++) {
      INFO("step " << step << ", sequence " << j);
      CHECK(in[j * seq] == stream[step * 3 + j]);
    }
  }
}

// Guards: file order wrapping one token late (a read past the split) or early (the last start
// never read). Starts step seq apart and wrap modulo span = n - seq, the number of starts
// whose seq + 1 tokens fit; with gcd(seq, span) = 1 every one of them comes up.
TEST_CASE(
    "file order visits every start that fits and no other, for split lengths around "
    "multiples of --seq",
    "[data]") {
  for (int64_t seq : {4, 5, 16}) {
    for (int64_t n : {seq + 1, 3 * seq, 3 * seq + 1, 8 * seq + 2, 8 * seq + 3}) {
      int64_t fits = 0;  // starts s with s + seq + 1 <= n, by counting
      for (int64_t s = 0; s + seq + 1 <= n; s++) fits++;
      if (std::gcd<int64_t>(seq, fits) != 1) continue;
      INFO("seq " << seq << ", split of " << n << ", " << fits << " starts fit");
      std::vector<int64_t> got = read_starts(split_of(n), (int)seq, 0, fits, false);
      std::sort(got.begin(), got.end());
      std::vector<int64_t> all(fits);
      for (int64_t s = 0; s < fits; s++) all[s] = s;
      CHECK(got == all);
    }
  }
}

// Guards: (val - 1) / seq validation windows off by one when seq divides the val split.
TEST_CASE(
    "the val split holds every whole window and no more, for lengths around multiples of "
    "--seq",
    "[data]") {
  for (int seq : {4, 16}) {
    for (int64_t n : {(int64_t)seq + 1, 2 * (int64_t)seq, 2 * (int64_t)seq + 1, 5 * (int64_t)seq,
                      5 * (int64_t)seq + 1}) {
      INFO("seq " << seq << ", val split of " << n);
      const Dataset d = split_of(n);
      const int64_t windows = (int64_t)whole_windows(n, seq).size();
      REQUIRE(num_val_windows(d, seq) == windows);
      // The last window ends on the split's last token or before it.
      std::vector<int32_t> in(seq), tg(seq);
      fill_val_batch(d, windows - 1, 1, seq, in.data(), tg.data());
      CHECK(in[0] == (windows - 1) * seq);
      CHECK(tg[seq - 1] == (windows - 1) * seq + seq);
      CHECK(tg[seq - 1] <= n - 1);
    }
  }
}

// Guards: the val split rounded up instead of down, or the "need at least N tokens" message
// naming a count that is not the smallest that loads.
TEST_CASE(
    "--val-frac: val holds floor(n x frac) tokens, and the smallest file the message asks "
    "for is the smallest that loads",
    "[data]") {
  TempDir dir;
  const std::string path = dir.file("count.bin");
  // Fractions a binary double holds exactly, so floor(n x frac) is unambiguous: n x 3/8 is an
  // integer at n = 8, 16, ... and has fractional part 3/8, 6/8, 1/8 ... elsewhere.
  for (auto [num, den] : {std::pair{1, 2}, {1, 4}, {3, 8}, {5, 8}, {1, 16}}) {
    const double frac = (double)num / den;
    for (int64_t n : {64, 65, 66, 67, 71, 72, 100, 127, 128}) {
      write_token_shard(path, counting_tokens((int)n));
      const int64_t want_val = n * num / den;  // integer floor
      std::string err;
      Dataset d;
      try {
        d = load_dataset(path, frac, 3);
      } catch (const UsageError& e) {
        err = e.what();
      }
      INFO("n " << n << ", --val-frac " << frac << ": " << err);
      if (want_val < 4 || n - want_val < 4) {  // a split shorter than seq + 1 = 4 is refused
        CHECK_THAT(err, Contains("too few"));
        continue;
      }
      REQUIRE(err.empty());
      CHECK((int64_t)d.val.size() == want_val);
      CHECK((int64_t)d.train.size() == n - want_val);
      CHECK(d.val.front() == n - want_val);  // val is the file's end
    }
  }
  // The minimum in the message, against a search over file sizes.
  for (int seq : {1, 3, 16, 64}) {
    for (double frac : {0.5, 0.25, 0.1, 0.3, 0.05, 0.9}) {
      int64_t smallest = 0;
      for (int64_t n = 2; smallest == 0; n++) {
        const int64_t val = (int64_t)(n * frac);  // floor, as documented
        if (val >= seq + 1 && n - val >= seq + 1) smallest = n;
      }
      INFO("seq " << seq << ", --val-frac " << frac << ": smallest " << smallest);
      write_token_shard(path, counting_tokens((int)smallest));
      CHECK_NOTHROW(load_dataset(path, frac, seq));
      write_token_shard(path, counting_tokens((int)smallest - 1));
      CHECK_THAT(usage_error_of([&] { load_dataset(path, frac, seq); }),
                 Contains("need at least " + std::to_string(smallest) + " so that"));
    }
  }
}

// Guards: the two file formats splitting or batching the same tokens differently.
TEST_CASE("a text file and a .bin shard of the same bytes give the same splits and batches",
          "[data]") {
  TempDir dir;
  for (int64_t n : {170, 171, 1000, 1024}) {  // 1024 - 102 = 922 train: not a multiple; 170: min
    std::string text;
    std::vector<int32_t> tokens;
    for (int64_t i = 0; i < n; i++) {
      const unsigned char byte = (unsigned char)(37 * i + 11);  // 256 tokens: every value
      text += (char)byte;
      tokens.push_back(byte);
    }
    write_bytes(dir.file("t.txt"), text);
    write_token_shard(dir.file("t.bin"), tokens);
    const Dataset a = load_dataset(dir.file("t.txt"), 0.1, 16);
    const Dataset b = load_dataset(dir.file("t.bin"), 0.1, 16);
    INFO(n << " tokens");
    CHECK(a.train == b.train);
    CHECK(a.val == b.val);
    CHECK(a.max_token == b.max_token);
    CHECK((int64_t)(a.train.size() + a.val.size()) == n);
    CHECK(read_tokens(dir.file("t.txt")) == read_tokens(dir.file("t.bin")));
    for (bool shuffle : {true, false}) {
      std::vector<int32_t> ia(4 * 16), ta(4 * 16), ib(4 * 16), tb(4 * 16);
      for (int64_t step : {0, 7, 60}) {
        fill_train_batch(a, step, 4, 0, 4, 16, ia.data(), ta.data(), shuffle, 5);
        fill_train_batch(b, step, 4, 0, 4, 16, ib.data(), tb.data(), shuffle, 5);
        CHECK(ia == ib);
        CHECK(ta == tb);
      }
    }
  }
}

TEST_CASE(
    "an llm.c shard whose size is not its header's promise is refused, one byte either "
    "way",
    "[data]") {
  TempDir dir;
  const std::string shard = dir.file("s.bin");
  write_token_shard(shard, counting_tokens(500));
  const std::string good = read_file(shard);
  CHECK_NOTHROW(load_dataset(shard, 0.1, 16));
  for (const std::string& bytes : {good + std::string(1, '\0'), good + std::string(2, '\0'),
                                   good.substr(0, good.size() - 1)}) {
    write_bytes(shard, bytes);
    CHECK_THAT(usage_error_of([&] { load_dataset(shard, 0.1, 16); }),
               Contains(shard) && Contains("header promises 500 tokens"));
  }
  write_token_shard(shard, {});  // a header and nothing else
  CHECK_THAT(usage_error_of([&] { load_dataset(shard, 0.1, 16); }), Contains("0 tokens"));
}
