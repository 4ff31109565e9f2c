// options.cuh: train's command line: every flag, its validation (the same on every rank,
// before anything is allocated), and the configuration table rank 0 prints.
#pragma once
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/data.cuh"
#include "model.cuh"

struct Options {
  ModelConfig model;
  std::string preset = "tiny", device = "auto", recompute = "none", attention = "flash";
  int steps = 100, stop_after = 0, mbs = 16, grad_acc = 1, warmup = 20, val_every = 50, val_seqs = 64;
  float lr = 2e-3f, min_lr = -1.0f, weight_decay = 0.1f, grad_clip = 1.0f;
  float val_frac = 0.1f, temperature = 0.8f;
  uint64_t seed = 1337;
  std::string data, save, load, log_json, save_grads, score, prompt = "\n";
  std::string save_dtype = "fp32";  // --save-dtype: model.safetensors in fp32 or bf16
  // --dtype: the linear layers' arithmetic (mixed_precision.cuh); auto: fp32 on CPU, bf16 on CUDA
  std::string dtype = "auto", loss_scale = "dynamic";  // --loss-scale: fp16 only
  int loss_scale_window = 1000;
  std::string grad_acc_dtype = "fp32";  // --grad-acc-dtype: gradient buffers in fp32 or bf16
  int sample = 0;
  // parallelism
  int dp = 1, pp = 1, cp = 1, tp = 1, zero = 0;
  std::string comm = "auto", dp_sync = "bucket", trace, fault, pp_schedule = "1f1b";
  std::string cp_balance = "zigzag", cp_comm = "ring";
  int pp_virtual = 1;
  double comm_timeout = 300, bucket_mb = 25;
  bool no_overlap = false, sp = false;
  bool no_shuffle = false;  // data: consecutive stretches in file order (the old order)
  bool sync_launches = false;  // debugging: synchronise after every CUDA kernel
  std::vector<std::string> reports;
  const CLI::App* app = nullptr;  // the parsed command line (main's, alive for the whole run)
};

// The largest values picoscale accepts (sizes past them overflow its int arithmetic or fit no
// machine); the README's flag table states them.
constexpr int kMaxSeq = 1 << 20, kMaxMbs = 1 << 20, kMaxLayers = 4096, kMaxWidth = 1 << 24;
constexpr int kMaxSample = 1 << 20;

// Model-shape flags: applied over the preset, or checked against a loaded checkpoint.
using IntField = int ModelConfig::*;
struct ShapeFlag {
  const char* flag;
  IntField field;
  CLI::Option* opt;
};

void add_flags(CLI::App& app, Options& o, std::vector<ShapeFlag>& shape);
// Builds the model config (preset, flags, or checkpoint) and checks every flag; throws
// UsageError naming the flag and the fix.
void resolve_options(Options& o, const std::vector<ShapeFlag>& shape);
// Before anything is allocated (collective, every rank): the predicted memory of a rank fits
// its device (host memory on CPU, the GPU's on CUDA, shared by the ranks that share it), and
// on world rank 0 every output path (--save, --save-grads, --log-json, --trace) can be
// written. Throws UsageError with both numbers, or the flag and the path.
void check_before_start(const Options& o, const Comm& comm);
// --dtype for `device` (auto: fp32 on CPU, bf16 on CUDA); UsageError for fp8 on a GPU without
// FP8 tensor cores (before compute capability 8.9).
Precision resolve_precision(const Options& o, Device device);
// --grad-acc-dtype for a run in precision p: F32, or BF16 (with --dtype bf16 or fp8, and not
// with --dp-sync ring: else UsageError naming the flags and the fix).
DType resolve_grad_dtype(const Options& o, Precision p);
void print_config(const Options& o, const Dataset& data, const Comm& comm, int64_t n_params,
                  int zero_stage);
