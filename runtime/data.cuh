// data.cuh: datasets as token arrays, and the global batch addressed by step alone
// (DESIGN section 5), so every layout reads exactly the same tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

struct Dataset {
  std::string source;          // file path, or the default corpus' description
  std::vector<int32_t> train;  // training tokens
  std::vector<int32_t> val;    // held-out tokens (the last val_fraction of the file)
  int max_token = 0;           // largest token id present
};

// The default corpus: every fortune file of Debian's `fortunes` packages, concatenated.
std::string default_corpus_dir();  // /usr/share/games/fortunes
// path "" -> default corpus; "*.bin" -> llm.c token shard (uint16 tokens after a 256 x int32
// header: magic 20240520, version 1, token count); anything else -> text as bytes (vocab 256).
// Throws UsageError naming the file and the problem (missing, too small for one sequence of
// `seq` + 1 tokens in each split, bad header).
Dataset load_dataset(const std::string& path, double val_fraction, int seq);
// Before any rank reads it: throws UsageError naming `flag` and the file unless `path` is a
// regular file whose tokens this machine's memory can hold (4 bytes each, every rank holding all
// of them): a FIFO would block the read, a 100 GB file would end it in an allocation failure.
void check_token_file(const std::string& flag, const std::string& path);
// Throws UsageError when a token id is outside [0, vocab).
void check_vocab(const Dataset& data, int vocab);

// Sequence j (0 <= j < global_batch) of step s is the k-th of the run, k = s * global_batch + j,
// and reads train tokens [start, start + seq]: inputs [start, start + seq), targets shifted by 1.
//   shuffle:     the split is W = (n_train - 1) / seq windows, window w at token w * seq; epoch
//                e = k / W reads every window once, in an order drawn from (seed, e):
//                start = seq * permutation_{seed, e}(k mod W)
//   file order:  start = (k * seq) mod (n_train - seq)
// Either way a sequence depends on (seed, step, j) alone, never on the layout (DESIGN 5).
// Fills num_seqs sequences starting at first_seq into inputs/targets [num_seqs * seq].
void fill_train_batch(const Dataset& data, int64_t step, int64_t global_batch, int first_seq,
                      int num_seqs, int seq, int32_t* inputs, int32_t* targets, bool shuffle,
                      uint64_t seed);
// Window permutation_{seed, epoch}(i) of [0, n): what the shuffled order reads (for tests).
int64_t shuffled_window(int64_t i, int64_t n, uint64_t seed, int64_t epoch);
// Validation windows are consecutive: window w reads val tokens [w * seq, w * seq + seq].
int64_t num_val_windows(const Dataset& data, int seq);
void fill_val_batch(const Dataset& data, int64_t first_window, int num_seqs, int seq,
                    int32_t* inputs, int32_t* targets);

// Reads a whole file as byte tokens (used by --score); throws UsageError when missing.
std::vector<int32_t> read_tokens(const std::string& path);
// Writes an llm.c-format .bin shard (for tests and tools).
void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens);
