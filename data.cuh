// data.cuh: datasets as token arrays, and the global batch addressed by step alone
// (DESIGN section 5), so every layout reads exactly the same tokens.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

struct Dataset {
  std::string source;            // file path, or the default corpus' description
  std::vector<int32_t> train;    // training tokens
  std::vector<int32_t> val;      // held-out tokens (the last val_fraction of the file)
  int max_token = 0;             // largest token id present
};

// The default corpus: every fortune file of Debian's `fortunes` packages, concatenated.
std::string default_corpus_dir();  // /usr/share/games/fortunes
// path "" -> default corpus; "*.bin" -> llm.c token shard (uint16 tokens after a 256 x int32
// header: magic 20240520, version 1, token count); anything else -> text as bytes (vocab 256).
// Throws UsageError naming the file and the problem (missing, too small for one sequence of
// `seq` + 1 tokens in each split, bad header).
Dataset load_dataset(const std::string& path, double val_fraction, int seq);
// Throws UsageError when a token id is outside [0, vocab).
void check_vocab(const Dataset& data, int vocab);

// Sequence j (0 <= j < global_batch) of step s reads train tokens [start, start + seq]:
//   start = ((s * global_batch + j) * seq) mod (n_train - seq)
// inputs are tokens [start, start + seq), targets [start + 1, start + seq + 1).
// Fills num_seqs sequences starting at first_seq into inputs/targets [num_seqs * seq].
void fill_train_batch(const Dataset& data, int64_t step, int64_t global_batch, int first_seq,
                      int num_seqs, int seq, int32_t* inputs, int32_t* targets);
// Validation windows are consecutive: window w reads val tokens [w * seq, w * seq + seq].
int64_t num_val_windows(const Dataset& data, int seq);
void fill_val_batch(const Dataset& data, int64_t first_window, int num_seqs, int seq,
                    int32_t* inputs, int32_t* targets);

// Reads a whole file as byte tokens (used by --score); throws UsageError when missing.
std::vector<int32_t> read_tokens(const std::string& path);
// Writes an llm.c-format .bin shard (for tests and tools).
void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens);
