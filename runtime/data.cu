// data.cu: token datasets (text as bytes, or llm.c .bin shards) and the batches a step reads.
// DESIGN §5 "data order is layout-free": which tokens a sequence holds is a function of
// (step, sequence index in the global batch) alone. A rank asks for its slice of the global
// batch [first_seq, first_seq + num_seqs), so dp=2 x grad_acc=1 reads exactly the tokens of
// dp=1 x grad_acc=2, and any layout can be checked against the single-process run.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "runtime/core.cuh"
#include "runtime/data.cuh"
#include "runtime/inputs.cuh"

namespace fs = std::filesystem;

static const int32_t kShardMagic = 20240520;  // llm.c's dataset header
static const int32_t kShardVersion = 1;
static const int64_t kShardHeaderBytes = 256 * sizeof(int32_t);

// ----------------------------------------------------------------------------
// Reading files

// A file's tokens sit in memory as int32, 4 bytes each, on every rank: the file, read in chunks,
// never also sits there whole as bytes (which took 5 bytes of memory per byte of text).
static const size_t kChunkBytes = 1 << 20;

static bool is_shard(const std::string& path) {
  return path.size() >= 4 && path.compare(path.size() - 4, 4, ".bin") == 0;
}

static uint32_t read_le32(const unsigned char* p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

// The tokens a file of `size` bytes holds (a shard's header is checked when it is read).
static int64_t tokens_in(const std::string& path, uint64_t size) {
  if (!is_shard(path)) return (int64_t)size;  // one byte = one token
  return size > (uint64_t)kShardHeaderBytes ? (int64_t)(size - kShardHeaderBytes) / 2 : 0;
}
// What holding `tokens` tokens takes, said for a message.
static std::string memory_needed(const std::string& what, uint64_t size, int64_t tokens) {
  return what + ": " + human_bytes((double)size) + " hold " + std::to_string(tokens) + " tokens, " +
         human_bytes(4.0 * tokens) + " in memory at 4 bytes each (every rank holds them all)";
}

void check_token_file(const std::string& flag, const std::string& path) {
  const std::string what = flag + " " + path;
  check_input_file(what, path);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  const int64_t tokens = tokens_in(path, size);
  const double have = host_memory_bytes();
  if (4.0 * tokens > have)
    throw UsageError(memory_needed(what, size, tokens) + ", more than this machine's " +
                     human_bytes(have) + ": use a smaller file, or a part of it");
}

// n little-endian uint16 tokens (an llm.c shard's) or n byte tokens, read in chunks into `out`.
static bool read_tokens_into(FILE* f, std::vector<int32_t>& out, int64_t n, bool uint16) {
  std::vector<unsigned char> buf(kChunkBytes);
  const size_t width = uint16 ? 2 : 1;
  for (int64_t done = 0; done < n;) {
    const size_t count = (size_t)std::min<int64_t>(n - done, (int64_t)(kChunkBytes / width));
    if (fread(buf.data(), width, count, f) != count) return false;
    for (size_t i = 0; i < count; i++)
      out.push_back(uint16 ? (int32_t)buf[2 * i] | (int32_t)buf[2 * i + 1] << 8 : buf[i]);
    done += (int64_t)count;
  }
  return true;
}

// `flag` is the command-line flag that named the file, so the message says what to fix.
// llm.c shard (.bin): 256 x int32 header (magic, version, token count, unused...), then uint16
// tokens; any other file: bytes as tokens (0..255).
static std::vector<int32_t> read_token_file(const std::string& path, const std::string& flag) {
  const std::string what = flag + " " + path;
  check_input_file(what, path);
  std::error_code ec;
  const int64_t size = (int64_t)fs::file_size(path, ec);
  const bool shard = is_shard(path);
  int64_t count = size;
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) throw UsageError(what + ": cannot open: " + strerror(errno));
  if (shard) {
    if (size < kShardHeaderBytes) {
      fclose(f);
      throw UsageError(what + ": " + std::to_string(size) + " bytes is too small for an llm.c " +
                       "token shard (its header alone is 1024 bytes)");
    }
    unsigned char header[kShardHeaderBytes];
    const bool got = fread(header, 1, sizeof header, f) == sizeof header;
    int32_t magic = (int32_t)read_le32(&header[0]), version = (int32_t)read_le32(&header[4]);
    count = (int32_t)read_le32(&header[8]);
    std::string bad;
    if (!got)
      bad = "read error";
    else if (magic != kShardMagic)
      bad = "bad magic " + std::to_string(magic) + ", expected " + std::to_string(kShardMagic) +
            " (an llm.c token shard)";
    else if (version != kShardVersion)
      bad = "llm.c shard version " + std::to_string(version) + ", expected 1 (uint16 tokens)";
    else if (count < 0 || size != kShardHeaderBytes + 2 * count)
      bad = "header promises " + std::to_string(count) + " tokens (" +
            std::to_string(kShardHeaderBytes + 2 * count) + " bytes) but the file has " +
            std::to_string(size) + " bytes; truncated or not an llm.c shard";
    if (!bad.empty()) {
      fclose(f);
      throw UsageError(what + ": " + bad);
    }
  }
  std::vector<int32_t> tokens;
  bool ok = false;
  try {
    tokens.reserve(count);
    ok = read_tokens_into(f, tokens, count, shard);
  } catch (const std::bad_alloc&) {
    fclose(f);
    throw UsageError(memory_needed(what, size, count) +
                     ", more than this rank could allocate: use a smaller file, or a part of it");
  }
  fclose(f);
  if (!ok) throw UsageError(what + ": read error");
  return tokens;
}

std::string default_corpus_dir() {
  return "/usr/share/games/fortunes";
}

// Every fortune file (names without a '.': skips the *.dat indexes and *.u8 copies), sorted by
// name so the corpus, and hence every batch, is the same on every machine.
static std::vector<int32_t> read_default_corpus(std::string& source) {
  const std::string dir = default_corpus_dir();
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw UsageError("--data: the default corpus " + dir + " is not there; install the " +
                     "`fortunes` package (make deps) or pass --data FILE");
  std::vector<std::string> files;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.find('.') == std::string::npos && fs::is_regular_file(e.path(), ec))
      files.push_back(e.path().string());  // is_regular_file follows symlinks
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) throw UsageError("--data: no fortune files in " + dir + "; pass --data FILE");
  std::vector<int32_t> tokens;
  for (const std::string& f : files) {
    std::vector<int32_t> bytes = read_token_file(f, "--data");
    tokens.insert(tokens.end(), bytes.begin(), bytes.end());
  }
  source = dir + " (" + std::to_string(files.size()) + " fortune files)";
  return tokens;
}

// ----------------------------------------------------------------------------
// Loading and splitting

static int64_t val_size(int64_t n, double val_fraction) {
  return (int64_t)(n * val_fraction);
}
static std::string fmt(double x) {  // 0.1, not 0.100000
  char buf[32];
  snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Smallest token count whose train and val splits both hold one sequence of seq + 1 tokens.
// Neither split shrinks as n grows (val = floor(n f) and train = n - val each gain 0 or 1 token
// per token), so the answer is the first n that fits, counting up from below it: each split
// needs seq + 1, val needs n f >= seq + 1, and train, which holds at most n (1 - f) + 1
// tokens, needs n (1 - f) >= seq. (Counting from (seq + 1) / (1 - f) instead started above the
// answer whenever the val split's rounding hands train a token: 168 for --seq 16 at
// --val-frac 0.9, where 161 fits.)
static int64_t min_tokens(int seq, double val_fraction) {
  const double need = seq + 1.0;
  int64_t n = (int64_t)std::max({2 * need, need / val_fraction, seq / (1.0 - val_fraction)}) - 2;
  while (val_size(n, val_fraction) < seq + 1 || n - val_size(n, val_fraction) < seq + 1) n++;
  return n;
}

Dataset load_dataset(const std::string& path, double val_fraction, int seq) {
  if (!(val_fraction > 0.0 && val_fraction < 1.0))
    throw UsageError("--val-frac " + fmt(val_fraction) +
                     ": must be strictly between 0 and 1, e.g. 0.1");
  PICO_ASSERT(seq > 0, "seq must be validated before loading data");
  Dataset data;
  std::vector<int32_t> tokens;
  if (path.empty()) {
    tokens = read_default_corpus(data.source);
  } else {
    tokens = read_token_file(path, "--data");
    data.source = path;
  }
  const int64_t n = (int64_t)tokens.size(), n_val = val_size(n, val_fraction);
  const int64_t n_train = n - n_val;
  if (n_train < seq + 1 || n_val < seq + 1)
    throw UsageError("--data " + (path.empty() ? data.source : path) + ": " + std::to_string(n) +
                     " tokens are too few for --seq " + std::to_string(seq) + ": need at least " +
                     std::to_string(min_tokens(seq, val_fraction)) + " so that the train split (" +
                     std::to_string(n_train) + " now) and the val split (" + std::to_string(n_val) +
                     " now, --val-frac " + fmt(val_fraction) + ") each hold " +
                     std::to_string(seq + 1) + "; use a larger file or a smaller --seq");
  data.max_token = *std::max_element(tokens.begin(), tokens.end());
  data.val.assign(tokens.begin() + n_train, tokens.end());
  tokens.resize(n_train);  // the train split in place: no second copy of the file's tokens
  data.train = std::move(tokens);
  return data;
}

void check_vocab(const Dataset& data, int vocab) {
  if (data.max_token >= vocab)
    throw UsageError("--data " + data.source + ": token id " + std::to_string(data.max_token) +
                     " is outside the vocabulary of size " + std::to_string(vocab) +
                     " (--vocab); use --vocab " + std::to_string(data.max_token + 1) +
                     " or more, or data from the model's tokenizer");
}

// ----------------------------------------------------------------------------
// Batches: addressed by (step, sequence index) alone, never by rank (DESIGN §5).

// One sequence: inputs [seq] = tokens[start, start + seq), targets [seq] shifted by one.
static void fill_sequence(const std::vector<int32_t>& tokens, int64_t start, int seq,
                          int32_t* inputs, int32_t* targets) {
  PICO_ASSERT(start >= 0 && start + seq < (int64_t)tokens.size(), "sequence outside the split");
  std::copy(tokens.begin() + start, tokens.begin() + start + seq, inputs);
  std::copy(tokens.begin() + start + 1, tokens.begin() + start + seq + 1, targets);
}

// A permutation of [0, n) evaluated one element at a time, so no rank ever builds the epoch's
// whole order: a 4-round Feistel network (a bijection on [0, 4^h), 4^h the smallest power of 4
// >= n) keyed by (seed, epoch), and cycle-walking: values >= n go through it again until they
// land in [0, n), which keeps it a bijection on [0, n) (fewer than 4 passes on average).
int64_t shuffled_window(int64_t i, int64_t n, uint64_t seed, int64_t epoch) {
  PICO_ASSERT(i >= 0 && i < n, "window index outside the epoch");
  int h = 1;
  while (h < 31 && ((int64_t)1 << (2 * h)) < n) h++;
  const uint64_t mask = ((uint64_t)1 << h) - 1;
  const uint64_t key = splitmix64(rng_key(seed, "data order") + (uint64_t)epoch);
  uint64_t x = (uint64_t)i;
  do {
    uint64_t left = x >> h, right = x & mask;
    for (uint64_t round = 0; round < 4; round++) {
      uint64_t next = left ^ (splitmix64(key ^ splitmix64((round << 40) | right)) & mask);
      left = right, right = next;
    }
    x = left << h | right;
  } while (x >= (uint64_t)n);
  return (int64_t)x;
}

void fill_train_batch(const Dataset& data, int64_t step, int64_t global_batch, int first_seq,
                      int num_seqs, int seq, int32_t* inputs, int32_t* targets, bool shuffle,
                      uint64_t seed) {
  PICO_ASSERT(first_seq >= 0 && num_seqs >= 0 && first_seq + num_seqs <= global_batch,
              "sequences outside the global batch");
  const int64_t n_train = (int64_t)data.train.size();
  const int64_t span = n_train - seq, windows = (n_train - 1) / seq;
  for (int i = 0; i < num_seqs; i++) {
    const int64_t k = step * global_batch + first_seq + i;  // the run's k-th sequence
    // File order: starts step through the split seq tokens apart and wrap before the last
    // full window. Shuffled: each epoch visits the aligned windows in its own order.
    const int64_t start =
        shuffle ? seq * shuffled_window(k % windows, windows, seed, k / windows) : (k * seq) % span;
    fill_sequence(data.train, start, seq, inputs + (int64_t)i * seq, targets + (int64_t)i * seq);
  }
}

int64_t num_val_windows(const Dataset& data, int seq) {
  return ((int64_t)data.val.size() - 1) / seq;  // each window needs seq + 1 tokens
}

void fill_val_batch(const Dataset& data, int64_t first_window, int num_seqs, int seq,
                    int32_t* inputs, int32_t* targets) {
  PICO_ASSERT(first_window >= 0 && first_window + num_seqs <= num_val_windows(data, seq),
              "validation window outside the val split");
  for (int i = 0; i < num_seqs; i++)
    fill_sequence(data.val, (first_window + i) * seq, seq, inputs + (int64_t)i * seq,
                  targets + (int64_t)i * seq);
}

// ----------------------------------------------------------------------------
// Single files

std::vector<int32_t> read_tokens(const std::string& path) {
  return read_token_file(path, "--score");
}

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens) {
  std::vector<unsigned char> bytes(kShardHeaderBytes + 2 * tokens.size(), 0);
  const int32_t header[3] = {kShardMagic, kShardVersion, (int32_t)tokens.size()};
  for (int h = 0; h < 3; h++)
    for (int b = 0; b < 4; b++) bytes[4 * h + b] = (unsigned char)((uint32_t)header[h] >> (8 * b));
  for (size_t i = 0; i < tokens.size(); i++) {
    if (tokens[i] < 0 || tokens[i] > 65535)
      throw UsageError(path + ": token id " + std::to_string(tokens[i]) + " at position " +
                       std::to_string(i) + " does not fit an llm.c shard's uint16");
    bytes[kShardHeaderBytes + 2 * i] = (unsigned char)(tokens[i] & 0xff);
    bytes[kShardHeaderBytes + 2 * i + 1] = (unsigned char)(tokens[i] >> 8);
  }
  FILE* f = fopen(path.c_str(), "wb");
  if (!f) throw UsageError(path + ": cannot write: " + strerror(errno));
  size_t wrote = fwrite(bytes.data(), 1, bytes.size(), f);
  int close_rc = fclose(f);
  if (wrote != bytes.size() || close_rc != 0)
    throw UsageError(path + ": cannot write: " + strerror(errno));
}
