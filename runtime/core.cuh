// core.cuh: tensors, devices, dtypes, memory accounting, error checks, RNG and timers.
// Everything else in picoscale is built from these few types (DESIGN section 2).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/ledger.cuh"

// ----------------------------------------------------------------------------
// Error checks: print file:line, the call and the error, then stop every rank.

[[noreturn]] void fatal_abort();  // MPI_Abort when MPI is up (so no rank hangs), else abort()

#define CUDA_CHECK(call)                                                           \
  do {                                                                             \
    cudaError_t err_ = (call);                                                     \
    if (err_ != cudaSuccess) {                                                     \
      fprintf(stderr, "[CUDA ERROR] %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, \
              cudaGetErrorString(err_));                                           \
      fatal_abort();                                                               \
    }                                                                              \
  } while (0)
#define CUBLAS_CHECK(call)                                                                  \
  do {                                                                                      \
    cublasStatus_t st_ = (call);                                                            \
    if (st_ != CUBLAS_STATUS_SUCCESS) {                                                     \
      fprintf(stderr, "[cuBLAS ERROR] %s:%d: %s -> status %d\n", __FILE__, __LINE__, #call, \
              (int)st_);                                                                    \
      fatal_abort();                                                                        \
    }                                                                                       \
  } while (0)
#define NCCL_CHECK(call)                                                           \
  do {                                                                             \
    ncclResult_t r_ = (call);                                                      \
    if (r_ != ncclSuccess) {                                                       \
      fprintf(stderr, "[NCCL ERROR] %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, \
              ncclGetErrorString(r_));                                             \
      fatal_abort();                                                               \
    }                                                                              \
  } while (0)
#define MPI_CHECK(call)                                                                  \
  do {                                                                                   \
    int rc_ = (call);                                                                    \
    if (rc_ != MPI_SUCCESS) {                                                            \
      char msg_[MPI_MAX_ERROR_STRING];                                                   \
      int len_ = 0;                                                                      \
      MPI_Error_string(rc_, msg_, &len_);                                                \
      fprintf(stderr, "[MPI ERROR] %s:%d: %s -> %s\n", __FILE__, __LINE__, #call, msg_); \
      fatal_abort();                                                                     \
    }                                                                                    \
  } while (0)
// Internal invariant (a bug in picoscale, not bad input).
#define PICO_ASSERT(cond, msg)                                                   \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "[BUG] %s:%d: %s failed: %s\n", __FILE__, __LINE__, #cond, \
              std::string(msg).c_str());                                         \
      fatal_abort();                                                             \
    }                                                                            \
  } while (0)

// Bad input from the user (a flag, a file): reported on rank 0, exit code 2 on every rank.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// ----------------------------------------------------------------------------
// Devices, dtypes, memory categories

// Meta (as PyTorch's meta tensors): shapes, dtypes and memory accounting without storage; every
// op counts its cost in the ledger (runtime/ledger.cuh) and computes nothing.
enum class Device { CPU, CUDA, Meta };
// F32 and I32 compute; BF16, F16 and the two FP8 formats are storage (mixed_precision.cuh).
enum class DType { F32, I32, BF16, F16, F8E4M3, F8E5M2, U8 };  // U8: masks (dropout)
enum class Mem { Params, Grads, Optimizer, Activations, Workspace, Count };
// What the linear layers compute in (--dtype; mixed_precision.cuh): their inputs rounded to
// bf16 or fp16 (or FP8 tiles), products summed in fp32, outputs rounded; everything else fp32.
enum class Precision { FP32, BF16, FP16, FP8 };

const char* device_name(Device d);
// Whether code takes the CUDA path's decisions (which operands a GEMM reads in what format, which
// kernels run): on CUDA, and on the meta device, whose ledger is then the GPU step's.
inline bool gpu_path(Device d) {
  return d == Device::CUDA || d == Device::Meta;
}
// Counts one op on `device` in the ledger; true when the op must compute nothing (the meta
// device), so that each op reads `if (count_op(ctx.device, OpKind::X, cost)) return;` before
// its CPU loop and its kernel.
void ledger_clock_tick(int row);  // the clock below: row's op starts now
inline bool count_op(Device device, OpKind kind, const OpCost& cost) {
  ledger_clock_tick(record_op(kind, cost));
  return device == Device::Meta;
}
// The ledger's clock: from start_ledger_clock on, the time from one op's start to the next op's
// (or to a mark) is added to its row's measured_s: on CPU the wall clock (its ops are
// synchronous); on CUDA events recorded on `stream` between the ops, read by
// settle_ledger_clock, which waits for the last of them. Time after a mark (a collective, a wait
// for one) is no op's: it is left out.
void start_ledger_clock(Device device, cudaStream_t stream);
void mark_ledger_clock();         // a collective or a wait begins: the op before it has ended
void settle_ledger_clock();       // CUDA: the events so far into measured_s (waits for the last)
const char* dtype_name(DType t);  // safetensors spelling: "F32", "I32", "BF16", "F16", "F8_E4M3"...
bool dtype_from_name(const std::string& name, DType* out);  // false for an unknown name
size_t dtype_size(DType t);
const char* mem_name(Mem m);
// A CUDA device is visible and the driver answers. When not, `why` (if given) gets the CUDA
// error, so "no device" and "a broken driver" read differently.
bool cuda_available(std::string* why = nullptr);

// Process-wide counters of live and peak bytes per category, like a caching allocator's
// statistics: they observe allocations, they never steer them.
struct MemoryStats {
  size_t current[(int)Mem::Count] = {};
  size_t peak[(int)Mem::Count] = {};
  size_t total_current = 0, total_peak = 0;
};
MemoryStats memory_stats();
void memory_reset_peak();  // peak := current, per category and in total
// peak := `before`'s where it is higher than now (after a count apart that freed all it took,
// such as the planner's meta runs of a layout, the peaks are as they were).
void memory_restore_peak(const MemoryStats& before);
struct Tensor;
// From now on the buffer of `t` counts under `category` (the fp32 weights become "master
// weights", optimizer state, once mixed precision keeps a half-precision copy of them).
void recount(const Tensor& t, Mem category);

// Host synchronisations: every point where the host waits for the device (a stream
// synchronise, a device-to-host copy, a result returned to the host). The same call sites
// count on CPU, where they cost nothing, so a CPU test pins the number a GPU step makes.
// Observation only, like MemoryStats.
void count_host_sync();
uint64_t host_syncs();  // since the process started
// Whether the work queued before event e has run, without waiting (cudaEventQuery). "Not ready"
// is an answer, cleared so that the next launch check does not report it; any other error stops.
bool event_reached(cudaEvent_t e);
// Whether `stream` runs what is queued on it now by `deadline` (now_seconds()): the host polls
// an event, never blocking on the device, so that every wait for a stream can be bounded.
bool stream_reached_by(cudaStream_t stream, double deadline);
// The same, against the bound of set_device_wait_bound (--comm-timeout): past it the job ends
// with an error that says `what` was waited for. For an event already recorded, and for a stream.
void wait_for_event(cudaEvent_t e, const char* what);
void synchronize_stream(cudaStream_t stream, const char* what);
// Calls to the device's allocator (cudaMallocAsync; on meta, as CUDA would make them) since the
// process started: the misses of the arena that device buffers come from (core.cu), which
// keeps a freed buffer for the next allocation of its size on its stream. Observation only.
uint64_t allocator_calls();
// The arena's device memory (CUDA and meta): the buffers taken from the device's allocator and
// not given back, live or held free for reuse, now and at the peak; PyTorch's memory_reserved
// beside MemoryStats' allocated. Rounded up to 512 bytes a buffer, a buffer of each size held
// per stream.
struct ArenaBytes {
  int64_t now = 0, peak = 0;
};
ArenaBytes arena_reserved();
void arena_reset_peak();  // peak := now
// Gives the buffers the arena holds free for `stream` back to the device (before the stream is
// destroyed; Context::destroy does it).
void release_arena(cudaStream_t stream);

// ----------------------------------------------------------------------------
// Tensor: a typed, shaped view of a buffer on one device. Copies share the buffer.

struct Storage;  // owns one allocation; frees and un-counts it when the last Tensor goes

struct Tensor {
  std::shared_ptr<Storage> storage;
  void* ptr = nullptr;
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
  Device device = Device::CPU;

  int64_t numel() const;
  size_t nbytes() const { return (size_t)numel() * dtype_size(dtype); }
  int64_t size(int dim) const { return shape.at(dim < 0 ? shape.size() + dim : dim); }
  int dim() const { return (int)shape.size(); }
  bool defined() const { return ptr != nullptr; }
  float* f32() const;    // checks dtype
  int32_t* i32() const;  // checks dtype
  uint8_t* u8() const;   // checks dtype
  // A view of `shape` starting `offset` elements in; shares (and keeps alive) the buffer.
  Tensor view(int64_t offset, std::vector<int64_t> new_shape) const;
  Tensor reshape(std::vector<int64_t> new_shape) const { return view(0, new_shape); }
  std::string shape_str() const;  // "[4, 128, 64]"
};
// A tensor still to be made: its shape and format (what a message will bring).
struct TensorSpec {
  std::vector<int64_t> shape;
  DType dtype = DType::F32;
};

// Allocation, zeroing and copies. On CUDA the forms without a Context run on the legacy
// default stream: setup, checkpoints and tests (a step copies and fills with the Context forms
// below, and sends its token ids up with from_host's). They are
// ordered with the compute stream because Context::create makes that stream blocking (it waits
// for the legacy stream and the legacy stream waits for it). The forms taking a Context run on
// its stream and say so: the model's activations and workspace during training (model.cu, ops.cu,
// the tensor-, context- and pipeline-parallel layers) are allocated, zeroed and freed with them.
// A buffer is freed on the stream it was allocated on; the communication stream is ordered
// with both through events (comm_handle.cu), never implicitly.
Tensor empty(std::vector<int64_t> shape, Mem category, Device device = Device::CPU,
             DType dtype = DType::F32);
Tensor zeros(std::vector<int64_t> shape, Mem category, Device device = Device::CPU,
             DType dtype = DType::F32);
void zero_(const Tensor& t);
void copy_(const Tensor& dst, const Tensor& src);  // same numel and dtype, any two devices
Tensor to_device(const Tensor& t, Device device, Mem category);
std::vector<float> to_host_floats(const Tensor& t);   // a host synchronisation (counted)
void from_host(const Tensor& dst, const float* src);  // numel floats
void from_host(const Tensor& dst, const int32_t* src);
struct Context;
// The same on ctx's stream, for what a step sends up (token ids, targets, positions, a
// mixture's routing): on CUDA through a pinned buffer and cudaMemcpyAsync, because a
// cudaMemcpy from pageable memory first waits for the device, a host synchronisation in every
// micro-batch. The source may be reused at once. A pinned buffer is used again once the copy it
// last sent has arrived; a wait for one that has not is counted (count_host_sync). One Memory
// op on the ledger on every device (on the CPU, the copy into place), as copy_(ctx) below.
void from_host(const Context& ctx, const Tensor& dst, const void* src);

// ----------------------------------------------------------------------------
// Context: what every op needs to run on its device; passed explicitly, never global.

struct WeightCopies;   // mixed_precision.cuh
struct PinnedStaging;  // core.cu: the pinned buffers of from_host(ctx, ...)

struct Context {
  Device device = Device::CPU;
  cudaStream_t stream = nullptr;  // compute stream (CUDA only)
  cublasHandle_t cublas = nullptr;
  void* cublas_workspace = nullptr;  // CUDA: cuBLAS's workspace, set once on the handle
  bool sync_launches = false;        // debugging: synchronise after every kernel (launch_check)
  Precision precision = Precision::FP32;  // of the linear layers (mixed_precision.cuh)
  // The residual stream between blocks and its gradient: F32, or the compute format's 16 bits
  // (--residual-dtype; runtime/dtype.cuh's empty_residual).
  DType residual = DType::F32;
  // The weights' copies in the compute format, where GEMMs read them (mixed_precision.cuh);
  // null: every GEMM rounds the fp32 weights itself.
  std::shared_ptr<WeightCopies> weight_copies;
  std::shared_ptr<PinnedStaging> staging;  // CUDA: what from_host(ctx, ...) sends up through
  // Buffers from the stream-ordered empty / zeros below made on this context (or a copy of
  // it: copies share the count) and still alive. destroy() requires none: on CUDA such a buffer
  // would later be freed on a destroyed stream. Counted on the CPU too, so CPU tests catch it.
  std::shared_ptr<std::atomic<int64_t>> allocations = std::make_shared<std::atomic<int64_t>>(0);
  int64_t live_allocations() const { return allocations->load(); }
  static Context create(Device device);
  void destroy();            // a [BUG] stop while live_allocations() > 0
  void synchronize() const;  // wait for the compute stream (tests, timers); counted
};
Device resolve_device(const std::string& flag);  // "auto" | "cpu" | "cuda" | "meta"

// Stream-ordered forms of empty / zeros / zero_ on ctx's compute stream (see above).
Tensor empty(const Context& ctx, std::vector<int64_t> shape, Mem category,
             DType dtype = DType::F32);
Tensor zeros(const Context& ctx, std::vector<int64_t> shape, Mem category,
             DType dtype = DType::F32);
void zero_(const Context& ctx, const Tensor& t);
// dst = src (same numel and dtype, both on ctx's device) and t = value (fp32) on ctx's stream:
// what a step copies and fills on the device (the tensor-parallel identities, a ring's key and
// value buffers). Counted as the Memory op each is on every device, so the CPU's ledger holds
// the copies the meta device counts and a GPU runs.
void copy_(const Context& ctx, const Tensor& dst, const Tensor& src);
void fill_(const Context& ctx, const Tensor& t, float value);
// [rows, cols] on ctx's stream, zero rows included (an empty view of one row's buffer).
Tensor empty_rows(const Context& ctx, int64_t rows, int64_t cols, Mem category = Mem::Workspace);
// Host values in a new tensor of `shape` on ctx's device, on its stream (any element count, 0
// too): a workspace tensor, or what `category` says (a step's token ids are activations).
Tensor device_floats(const Context& ctx, const std::vector<float>& v, std::vector<int64_t> shape);
Tensor device_ints(const Context& ctx, const std::vector<int32_t>& v,
                   Mem category = Mem::Workspace);  // [v.size()]

// Debugging aid, not a training behaviour: every Context created afterwards synchronises after
// each kernel launch, so a faulting kernel is named where it faults instead of at the next
// synchronisation (train --sync-launches, unit_tests --sync-launches). Slow; results unchanged.
void set_sync_launches(bool on);
// How long the host waits for the device outside a collective (the allocator's retry, a
// checkpoint's copies), as --comm-timeout bounds the collectives' waits (comm_init sets it to
// that; 300 s before).
void set_device_wait_bound(double seconds);
// All the device's work queued so far, done (cudaDeviceSynchronize) within that bound; past it the
// job ends with an error that says `what` was waiting.
void synchronize_device(const char* what);
// After a kernel launch: a launch error (bad configuration) names `kernel`; with sync_launches
// the stream is synchronised too, so an error while the kernel ran names it as well.
void launch_check(const Context& ctx, const char* kernel, const char* file, int line);
#define LAUNCH_CHECK(ctx, kernel) launch_check(ctx, kernel, __FILE__, __LINE__)

// What the machine is: driver and runtime versions, each device's name, memory, compute
// capability and stream-ordered pool support (tools/device_info, the GPU check's first step).
std::string describe_cuda_devices();

// ----------------------------------------------------------------------------
// Counter-based RNG: the value of element i of tensor `name` depends only on (seed, name, i),
// so any shard of any layout computes exactly its slice of the full tensor (DESIGN 5).

__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t rng_key(uint64_t seed, const std::string& name);  // FNV-1a of the name, mixed with seed
__host__ __device__ inline double rng_uniform(uint64_t key, uint64_t counter) {  // [0, 1)
  return (double)(splitmix64(key ^ splitmix64(counter)) >> 11) * (1.0 / 9007199254740992.0);
}
// N(0,1), Box-Muller on counters 2i, 2i+1, in double. The same code runs on the host (glibc's
// log and cos) and in the CUDA init kernel (CUDA's: sqrt is exact on both, log and cos may
// differ by an ulp or two of a double, which rounding to fp32 almost always hides).
__host__ __device__ inline double rng_normal(uint64_t key, uint64_t index) {
  double u1 = rng_uniform(key, 2 * index), u2 = rng_uniform(key, 2 * index + 1);
  if (u1 < 1e-300) u1 = 1e-300;
  return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}
// Fill elements [offset, offset + t.numel()) of the full tensor `name` into t: on the CPU in a
// loop, on CUDA in a kernel on the legacy default stream (setup), with the same values.
void init_normal(const Tensor& t, uint64_t seed, const std::string& name, float std,
                 int64_t offset = 0);
void init_uniform(const Tensor& t, uint64_t seed, const std::string& name, float lo, float hi,
                  int64_t offset = 0);
void fill_(const Tensor& t, float value);

// ----------------------------------------------------------------------------
// Timer and trace

double now_seconds();  // monotonic, and system-wide: comparable between ranks of one node
std::string human_bytes(double bytes);  // "1.50 MiB"

// A timeline of host-side spans, one track for compute and one for communication per rank.
enum class Track { Compute = 0, Comm = 1 };
struct Trace {
  struct Span {
    std::string name;
    Track track;
    double start, end;  // now_seconds()
    std::string color;  // a Chrome trace colour name ("cname"), or empty: chosen by the viewer
  };
  bool enabled = false;
  std::vector<Span> spans;
  void add(const std::string& name, Track track, double start, double end,
           const std::string& color = "") {
    if (enabled) spans.push_back({name, track, start, end, color});
  }
};
// trace_write (comm.cuh) gathers every rank's spans and writes them as a Chrome trace.

// ----------------------------------------------------------------------------
// Output files (DESIGN §9). An output replaces only a regular file, and atomically; a symlink
// is followed (the file it names is written, the link stays); anything else (a device, a FIFO,
// a directory) is refused, never replaced.

bool is_main_process();  // world rank 0, or no MPI: the process that prints notes
// Where a write to `path` lands: symlinks followed, a dangling one's target included.
std::string output_target(const std::string& path);
// "<target>.<tag>.<host>.<pid>": this process's temporary next to `target`.
std::string temp_name(const std::string& target, const std::string& tag);
// Removes "<target>.<tag>.<host>.<pid>" left by processes of this host that are gone (killed
// writers); a live process's temporaries stay.
void remove_stale_temps(const std::string& target, const std::string& tag);
// Creates and removes a temporary next to `target`: the directory accepts new files. Throws
// UsageError "<what>: cannot create files in <dir>: <why>".
void probe_directory(const std::string& what, const std::string& target);
// Before the first step: throws UsageError "<flag> <path>: ..." unless `path` is, or can be
// created as, a regular file. Changes nothing (the probe's temporary is removed).
void check_output_file(const std::string& flag, const std::string& path);
// Writes `body` to a temporary next to the target, flushes, fsyncs, then renames it over the
// target: a reader sees the old file or the new one, never a part. Throws UsageError.
void write_file_atomic(const std::string& path, const std::function<void(FILE*)>& body);
void write_all(FILE* f, const void* bytes, size_t n, const std::string& path);  // or throws

// An output written line by line as the run goes (--log-json): every write is flushed and
// checked; a failure stops every rank with the flag, the file and the reason.
class OutputLines {
 public:
  OutputLines() = default;
  OutputLines(const OutputLines&) = delete;
  OutputLines& operator=(const OutputLines&) = delete;
  ~OutputLines() { close(); }
  void open(const std::string& flag, const std::string& path);  // throws UsageError
  bool is_open() const { return file_ != nullptr; }
  void write_line(const std::string& line);
  void close();

 private:
  [[noreturn]] void fail();
  FILE* file_ = nullptr;
  std::string flag_, path_;
};
