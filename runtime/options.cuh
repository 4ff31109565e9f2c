// options.cuh: the command line's machinery. The run's own flags (the model's shape, steps and
// learning rate, data, checkpoints, logs, reports, faults, device and collectives) are here;
// each technique declares its own flags and checks them next to its code (XxxOptions in its
// header, in a --help group named after its chapter), with the helpers below; train.cu puts
// them together. Every value is parsed once, into a typed value, the same on every rank, before
// anything is allocated.
#pragma once
#include <CLI/CLI.hpp>
#include <limits>
#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/core.cuh"
#include "runtime/launch.cuh"
#include "runtime/meters.cuh"
#include "runtime/model_config.cuh"
#include "runtime/observe.cuh"

// ---- Helpers for every technique's flags ----
// A flag whose value is one name of a table: the one place its names are written, read by the
// parse and by the name (a new value is one more row).
template <class T>
struct Choice {
  const char* name;
  T value;
};
template <class T>
T parse_choice(const std::string& flag, const std::string& value,
               const std::vector<Choice<T>>& table) {
  std::string names;
  for (size_t i = 0; i < table.size(); i++) {
    if (value == table[i].name) return table[i].value;
    names += (i == 0 ? "" : i + 1 == table.size() ? " or " : ", ") + std::string(table[i].name);
  }
  throw UsageError(flag + " " + value + ": expected " + names);
}
template <class T>
const char* choice_name(const std::vector<Choice<T>>& table, T value) {
  for (const Choice<T>& c : table)
    if (c.value == value) return c.name;
  PICO_ASSERT(false, "a value without a name in its table");
  return "";
}
// A technique's table of variants: rows with an `id` and a `name` (and what the variant needs
// besides), one a variant. The row of an id; the id a flag's value names (parse_choice's error
// otherwise).
template <class Row, size_t N>
const Row& table_row(const Row (&table)[N], decltype(Row::id) id) {
  for (const Row& r : table)
    if (r.id == id) return r;
  PICO_ASSERT(false, "a value without a row in its table");
  return table[0];
}
template <class Row, size_t N>
decltype(Row::id) parse_row(const std::string& flag, const std::string& value,
                            const Row (&table)[N]) {
  std::vector<Choice<decltype(Row::id)>> names;
  for (const Row& r : table) names.push_back({r.name, r.id});
  return parse_choice(flag, value, names);
}
// Registers --flag in `group`, its value parsed by `parse` into *target as the command line is
// read (a bad value stops there, naming the flag); `shown` is the default --help prints.
template <class T, class Parse>
CLI::Option* add_typed(CLI::App& group, const std::string& flag, T* target, Parse parse,
                       const std::string& shown, const std::string& help) {
  return group
      .add_option_function<std::string>(
          flag, [target, parse](const std::string& v) { *target = parse(v); }, help)
      ->default_str(shown);
}
// A flag whose value is one of `table`'s names (parse_choice), *target's name shown as its
// default.
template <class T>
CLI::Option* add_choice(CLI::App& group, const std::string& flag, T* target,
                        std::vector<Choice<T>> table, const std::string& help) {
  const std::string shown = choice_name(table, *target);
  return add_typed(
      group, flag, target,
      [flag, table](const std::string& v) { return parse_choice(flag, v, table); }, shown, help);
}
// --residual-dtype's names (fp32, bf16, fp16), the name of one, and the format a run whose
// linear layers compute in `p` keeps the stream in: fp32, or p's 16-bit compute format (a
// UsageError names the flag and the --dtype it needs otherwise).
std::vector<Choice<DType>> residual_choices();
std::string residual_choice_name(DType format);
DType residual_format(DType requested, Precision p);
// A --help group: the book's chapter the flags belong to.
CLI::App& flag_group(CLI::App& app, const std::string& chapter);

constexpr double kNoMax = std::numeric_limits<double>::max();
void check_positive(int64_t value, const std::string& flag);  // UsageError "--x 0: must be > 0"
// A float flag that must be a finite number in [lo, hi] (lo excluded when `open_lo`).
void check_range(double value, const std::string& flag, double lo, bool open_lo, double hi,
                 const std::string& fix);
// Sizes past `max` overflow int arithmetic or fit no machine; `source` names where the value
// came from: the flag, or the checkpoint's config.json key.
void check_at_most(int64_t value, int64_t max, const std::string& source, const std::string& fix);
std::string num(double x);        // 0.002, inf, nan: as the user would type it
std::string exact_num(double x);  // an integer in full (4294967296), else as num (0.125)
bool is_power_of_two(double x);   // 2^k for some integer k (0.125, 1, 32768)
// `text` as a number from lo to hi (an integer when `integer`, a power of two when
// `power_of_two`); UsageError "<what> '<text>': ..." otherwise (a value read back from a file:
// `what` names the file and the key).
double parse_number(const std::string& text, const std::string& what, double lo, double hi,
                    bool integer = false, bool power_of_two = false);

// ---- The run's own flags ----
// The largest values picoscale accepts (sizes past them overflow its int arithmetic or fit no
// machine); --help states them.
constexpr int kMaxSeq = 1 << 20, kMaxMbs = 1 << 20, kMaxLayers = 4096, kMaxWidth = 1 << 24;
constexpr int kMaxSample = 1 << 20;
// Parameters: 2^50, about 1.1e15 (a thousand times the book's largest models): their offsets,
// and the 16 bytes a parameter that fp32 training keeps, stay far inside 64-bit integers.
constexpr double kMaxParameters = 1125899906842624.0;

struct RunOptions {
  // the model: a preset, its shape flags over it, or the checkpoint's config.json (--load)
  std::string preset = "tiny";
  ModelConfig model;
  std::vector<std::pair<std::string, int ModelConfig::*>> shape;  // the shape flags given
  bool untie_embeddings = false;  // --untie-embeddings: a tied preset with a head of its own
  // the optimisation (steps 0: load and save only, no step)
  int steps = 100, stop_after = 0, mbs = 16, grad_acc = 1, warmup = 20;
  float lr = 2e-3f, min_lr = -1.0f, weight_decay = 0.1f, grad_clip = 1.0f;
  uint64_t seed = 1337;
  // data and evaluation
  std::string data, score, prompt = "\n";
  float val_frac = 0.1f, temperature = 0.8f;
  int val_every = 50, val_seqs = 64, sample = 0;
  bool no_shuffle = false;  // consecutive stretches in file order
  // checkpoints, logs, reports
  std::string save, load, log_json, save_grads, trace;
  DType save_dtype = DType::F32;  // --save-dtype: model.safetensors in fp32 or bf16
  int save_every = 0, keep = 0;   // --save-every N: DIR/checkpoint-<step>; --keep K newest (0: all)
  int64_t first_step = 0;         // where --load resumes: its optimizer state's step (0: none)
  std::vector<Report> reports;
  // where it runs, and its faults
  std::string device = "auto", comm = "auto";
  std::string gpu;  // --gpu: the device profile of the roofline (empty: the device's own)
  // --simulate-world N --simulate-rank R (meta only): this process runs rank R of N; rank -1
  // walks the pipeline stages. 0: the world mpirun started.
  int simulate_world = 0, simulate_rank = 0;
  double comm_timeout = 300;
  bool sync_launches = false;     // debugging: synchronise after every CUDA kernel
  Fault fault;                    // --fault; kind empty: none
  const CLI::App* app = nullptr;  // the parsed command line (main's, alive for the whole run)
  bool given(const std::string& flag) const { return app && app->count(flag) > 0; }
  bool reports_on(Report r) const;
};
// The model's shape and the training step's flags; add_io_flags the rest (data, checkpoints,
// logs, reports, devices, faults), for --help after the chapters' groups.
void add_run_flags(CLI::App& app, RunOptions& o);
// A flag that sets a ModelConfig field: from the preset, or checked against --load's config.json.
void add_shape_flag(CLI::App& group, RunOptions& o, const std::string& flag,
                    int ModelConfig::*field, const std::string& help);
void add_io_flags(CLI::App& app, RunOptions& o);
// Once every flag is added: each number's text is checked before it is converted, and refused
// naming the flag ("--val-seqs: 99999999999 is past the whole numbers this flag holds ..."): an
// empty value (never read as 0), a count that is no whole number or past an int's range, a
// number that is none. An empty path or choice is refused by its own check, naming what it is.
void check_number_text(CLI::App& app);
// After the parse: the model config (preset and flags, or the checkpoint's, checked against the
// flags), every run flag's range, the step --load resumes at, and no output that would
// overwrite an input or another output; `world` ranks for --fault. Throws UsageError naming the
// flag and the fix.
void resolve_run_options(RunOptions& o, int world);
// Once the run's meters are registered: UsageError naming a --report that none of them answers
// (balance without context parallelism, experts without a mixture) and what it needs.
void check_reports_answered(const RunOptions& o, const StepMeters& meters);
// Throws UsageError naming both flags when an output (--save's files, --save-grads,
// --log-json, --trace) is an input (--data, --score, the files --load reads) or another output,
// symlinks followed: the same everywhere a path is, before anything is read or written.
void check_paths_apart(const RunOptions& o);
// What every rank must agree on (runtime/launch.cuh, agree_on_launch), in stages: the build;
// every flag as parsed; the input files (--data, --score, what --load reads). Nothing on one
// rank.
std::vector<std::vector<LaunchSetting>> launch_settings(const RunOptions& o);

// ---- Before the first allocation ----
// This rank's share of its device's memory: host RAM over the node's ranks on CPU; on CUDA the
// GPU's memory over the ranks that share it. `what` says which.
double device_bytes_per_rank(Device device, int local_ranks, std::string& what);
// UsageError with both numbers when static state and one micro-batch's activations (bytes per
// rank) do not fit the rank's share of its device.
void check_memory_fits(double state_bytes, double activation_bytes, Device device, int local_ranks);
// A rank's step's tokens, which every device holds on the host, within half its share of the
// host's memory; UsageError naming --grad-acc otherwise (the meta device too).
void check_step_tokens_fit(const RunOptions& o, int local_ranks);
// On world rank 0: every output path (--save, --save-grads, --log-json, --trace) can be written.
void check_outputs(const RunOptions& o, const Comm& comm);
// The configuration table rank 0 prints before the first step: one row per (name, value).
void print_config_table(const std::vector<std::pair<std::string, std::string>>& rows);
