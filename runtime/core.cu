// core.cu: tensors on CPU or CUDA with per-category memory accounting, error handling,
// the counter-based RNG and timers. The one idea: every byte is counted by category, so the
// book's memory anatomy (Playbook §2.3) can be read off a run rather than estimated.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "runtime/core.cuh"

namespace fs = std::filesystem;

void fatal_abort() {
  fflush(stdout);
  fflush(stderr);
  int up = 0, down = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Abort(MPI_COMM_WORLD, 1);
  abort();
}

const char* device_name(Device d) {
  switch (d) {
    case Device::CPU:
      return "cpu";
    case Device::CUDA:
      return "cuda";
    case Device::Meta:
      break;
  }
  return "meta";
}
static const DType kDTypes[] = {DType::F32, DType::I32,    DType::BF16,
                                DType::F16, DType::F8E4M3, DType::F8E5M2};
const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::I32:
      return "I32";
    case DType::BF16:
      return "BF16";
    case DType::F16:
      return "F16";
    case DType::F8E4M3:
      return "F8_E4M3";
    case DType::F8E5M2:
      return "F8_E5M2";
    case DType::U8:
      return "U8";
  }
  return "?";
}
bool dtype_from_name(const std::string& name, DType* out) {
  for (DType t : kDTypes)
    if (name == dtype_name(t)) return *out = t, true;
  return false;
}
size_t dtype_size(DType t) {
  switch (t) {
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::F8E4M3:
    case DType::F8E5M2:
    case DType::U8:
      return 1;
    default:
      return 4;
  }
}
const char* mem_name(Mem m) {
  static const char* names[] = {"params", "grads", "optimizer", "activations", "workspace"};
  return names[(int)m];
}

// Set as the program loads, before any CUDA call (the first one reads it): as many hardware
// queues as CUDA gives (8 by default), so that the compute stream, the communicators' and a
// pipeline's links (up to 19 streams, and NCCL's two a communicator: comm_setup.cu's
// device_queue_note) seldom share one, where an op parked on one stream (a send waiting for its
// peer) would hold up the next op of another. A value the user set stays.
[[maybe_unused]] static const bool g_device_connections =
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;

bool cuda_available(std::string* why) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // cudaErrorNoDevice is a machine without a GPU; anything else (cudaErrorInsufficientDriver,
    // a driver that does not load) is a broken setup worth reading.
    if (why) *why = std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (count == 0 && why) *why = "the driver answers but lists no device";
  return count > 0;
}

// ----------------------------------------------------------------------------
// Memory accounting

static MemoryStats g_stats;  // observation only; see MemoryStats in core.cuh
static std::mutex g_stats_mutex;
static std::atomic<uint64_t> g_host_syncs{0};  // observation only; see count_host_sync

void count_host_sync() {
  g_host_syncs++;
}
uint64_t host_syncs() {
  return g_host_syncs.load();
}
bool event_reached(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  CUDA_CHECK(r);
  return true;
}
// How long the host waits for the device outside a collective (set_device_wait_bound).
static double g_device_wait_s = 300;
void set_device_wait_bound(double seconds) {
  g_device_wait_s = seconds;
}
[[noreturn]] static void device_stuck(const char* what) {
  fprintf(stderr, "%s did not finish within %gs (--comm-timeout): the device is stuck\n", what,
          g_device_wait_s);
  fatal_abort();
}
static bool event_reached_by(cudaEvent_t e, double deadline) {
  bool done;
  while (!(done = event_reached(e)) && now_seconds() <= deadline) std::this_thread::yield();
  return done;
}
bool stream_reached_by(cudaStream_t stream, double deadline) {
  cudaEvent_t reached;
  CUDA_CHECK(cudaEventCreateWithFlags(&reached, cudaEventDisableTiming));
  CUDA_CHECK(cudaEventRecord(reached, stream));
  const bool done = event_reached_by(reached, deadline);
  CUDA_CHECK(cudaEventDestroy(reached));  // (released once reached, if it is not yet)
  return done;
}
void wait_for_event(cudaEvent_t e, const char* what) {
  if (!event_reached_by(e, now_seconds() + g_device_wait_s)) device_stuck(what);
}
void synchronize_stream(cudaStream_t stream, const char* what) {
  if (!stream_reached_by(stream, now_seconds() + g_device_wait_s)) device_stuck(what);
}
void synchronize_device(const char* what) {
  // CUDA has no device-wide event to poll: a thread of its own synchronises, and this one waits
  // for it against the bound (on a timeout the job ends, with that thread still waiting).
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  auto result = std::make_shared<std::promise<cudaError_t>>();
  std::future<cudaError_t> done = result->get_future();
  std::thread([device, result] {
    cudaError_t err = cudaSetDevice(device);
    result->set_value(err == cudaSuccess ? cudaDeviceSynchronize() : err);
  }).detach();
  if (done.wait_for(std::chrono::duration<double>(g_device_wait_s)) != std::future_status::ready)
    device_stuck(what);
  CUDA_CHECK(done.get());
}

static void account(Mem m, long long delta) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats.current[(int)m] += delta;
  g_stats.total_current += delta;
  if (g_stats.current[(int)m] > g_stats.peak[(int)m])
    g_stats.peak[(int)m] = g_stats.current[(int)m];
  if (g_stats.total_current > g_stats.total_peak) g_stats.total_peak = g_stats.total_current;
}
MemoryStats memory_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  return g_stats;
}
void memory_reset_peak() {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  for (int i = 0; i < (int)Mem::Count; i++) g_stats.peak[i] = g_stats.current[i];
  g_stats.total_peak = g_stats.total_current;
  arena_reset_peak();  // the device memory reserved: its peak from now on too
}
void memory_restore_peak(const MemoryStats& before) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  for (int i = 0; i < (int)Mem::Count; i++)
    g_stats.peak[i] = std::max(before.peak[i], g_stats.current[i]);
  g_stats.total_peak = std::max(before.total_peak, g_stats.total_current);
}

// Stream-ordered pools (cudaMallocAsync) are optional: some drivers, MIG slices and
// virtualised GPUs report cudaDevAttrMemoryPoolsSupported = 0. Asked once per device.
static bool memory_pools_supported() {
  static int cached[64];
  static std::once_flag once[64];
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  PICO_ASSERT(dev >= 0 && dev < 64, "device index " + std::to_string(dev));
  std::call_once(once[dev], [&] {
    CUDA_CHECK(cudaDeviceGetAttribute(&cached[dev], cudaDevAttrMemoryPoolsSupported, dev));
  });
  return cached[dev] != 0;
}
// The current device's default pool, which cudaMallocAsync draws from.
static cudaMemPool_t default_pool() {
  int dev = 0;
  cudaMemPool_t pool;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  return pool;
}

// ----------------------------------------------------------------------------
// The arena (as PyTorch's caching allocator): a device buffer freed on a stream is kept, under
// its size rounded up to 512 bytes, for the next allocation of that size on that stream, which
// reuses it in the stream's order (whatever was queued before the free runs before anything
// queued after the reuse, as with cudaFreeAsync and cudaMallocAsync on one stream). Only a
// miss calls the device's allocator; a step allocates the same sizes in the same order as the
// step before, so from the second on the hot path makes no allocator call (allocator_calls;
// counted on meta as CUDA would make them). MemoryStats still counts live tensors only.
// A failed allocation first gives back every buffer held free, then tries again; a Context
// gives back its stream's buffers before the stream goes (release_arena).
namespace {
constexpr size_t kArenaGrain = 512;
struct ArenaKey {
  Device device;
  cudaStream_t stream;
  size_t bytes;
  bool operator<(const ArenaKey& o) const {
    return std::tie(device, stream, bytes) < std::tie(o.device, o.stream, o.bytes);
  }
};
struct Arena {
  std::mutex mutex;
  std::map<ArenaKey, std::vector<void*>> free;
  std::atomic<uint64_t> calls{0};
  ArenaBytes reserved;           // under `mutex`
  void reserve(int64_t bytes) {  // + from the allocator, - given back
    reserved.now += bytes;
    reserved.peak = std::max(reserved.peak, reserved.now);
  }
};
// Never destroyed: buffers still held at exit go with the process, after CUDA's own teardown.
Arena& arena() {
  static Arena* a = new Arena;
  return *a;
}
void* arena_take(const ArenaKey& key) {
  std::lock_guard<std::mutex> lock(arena().mutex);
  auto it = arena().free.find(key);
  if (it == arena().free.end() || it->second.empty()) return nullptr;
  void* ptr = it->second.back();
  it->second.pop_back();
  return ptr;
}
void arena_give(const ArenaKey& key, void* ptr) {
  std::lock_guard<std::mutex> lock(arena().mutex);
  arena().free[key].push_back(ptr);
}
void device_free(const ArenaKey& key, void* ptr) {
  if (key.device != Device::CUDA) return;  // meta addresses are only numbers
  if (memory_pools_supported()) {
    CUDA_CHECK(cudaFreeAsync(ptr, key.stream));
  } else {
    count_host_sync();  // cudaFree waits for the whole device
    CUDA_CHECK(cudaFree(ptr));
  }
}
// Gives back the buffers held free for `stream` (all streams when `all`) to the device; returns
// the streams their frees were queued on.
std::set<cudaStream_t> release_held(bool all, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(arena().mutex);
  std::set<cudaStream_t> streams;
  for (auto it = arena().free.begin(); it != arena().free.end();) {
    if (!all && it->first.stream != stream) {
      ++it;
      continue;
    }
    for (void* ptr : it->second) {
      device_free(it->first, ptr);
      arena().reserve(-(int64_t)it->first.bytes);
    }
    if (it->first.device == Device::CUDA && !it->second.empty()) streams.insert(it->first.stream);
    it = arena().free.erase(it);
  }
  return streams;
}
// A miss: a new buffer from the device's allocator (stream-ordered where pools exist: a free
// does not stall the whole GPU as cudaFree does), or a meta address of its own.
void* device_allocate(const ArenaKey& key) {
  arena().calls++;
  {
    std::lock_guard<std::mutex> lock(arena().mutex);
    arena().reserve((int64_t)key.bytes);
  }
  if (key.device == Device::Meta) {
    static std::atomic<uintptr_t> next{uintptr_t(1) << 44};
    return (void*)next.fetch_add(key.bytes);
  }
  void* ptr = nullptr;
  const bool pooled = memory_pools_supported();
  if (!pooled) count_host_sync();  // cudaMalloc may wait for the device
  cudaError_t err =
      pooled ? cudaMallocAsync(&ptr, key.bytes, key.stream) : cudaMalloc(&ptr, key.bytes);
  if (err == cudaErrorMemoryAllocation && pooled) {
    // First the buffers held free for this stream: freed on it, their memory goes to this
    // allocation in the stream's order, with no wait (sizes that vary, as a mixture's rows per
    // expert do, would otherwise pile up held buffers until every stream has to be drained).
    (void)cudaGetLastError();
    if (!release_held(false, key.stream).empty())
      err = cudaMallocAsync(&ptr, key.bytes, key.stream);
  }
  if (err == cudaErrorMemoryAllocation) {  // every buffer held free, back; then once more
    (void)cudaGetLastError();
    // The frees complete before the retry: their streams waited for, each against the bound (a
    // whole-device synchronise would also wait for a pipeline's send parked until its peer
    // receives, which may need this rank to go on first: for ever).
    count_host_sync();
    for (cudaStream_t stream : release_held(true, nullptr))
      synchronize_stream(stream, "giving back the buffers held free, to retry an allocation,");
    // The pool's unused memory back to the driver, where a larger block may fit.
    if (pooled) CUDA_CHECK(cudaMemPoolTrimTo(default_pool(), 0));
    err = pooled ? cudaMallocAsync(&ptr, key.bytes, key.stream) : cudaMalloc(&ptr, key.bytes);
  }
  CUDA_CHECK(err);
  return ptr;
}
}  // namespace

uint64_t allocator_calls() {
  return arena().calls.load();
}
ArenaBytes arena_reserved() {
  std::lock_guard<std::mutex> lock(arena().mutex);
  return arena().reserved;
}
void arena_reset_peak() {
  std::lock_guard<std::mutex> lock(arena().mutex);
  arena().reserved.peak = arena().reserved.now;
}
void release_arena(cudaStream_t stream) {
  release_held(false, stream);
}

struct Storage {
  void* ptr = nullptr;
  size_t bytes = 0;
  Device device;
  Mem category;
  cudaStream_t stream = nullptr;  // CUDA: allocated, and freed, in this stream's order
  // The live count of the Context this was allocated on (Context::allocations); null for the
  // forms without a Context. Shared, so it outlives a Context destroyed too early.
  std::shared_ptr<std::atomic<int64_t>> owner;
  Storage(size_t n, Device d, Mem m, cudaStream_t s, std::shared_ptr<std::atomic<int64_t>> o)
      : bytes(n), device(d), category(m), stream(s), owner(std::move(o)) {
    if (n == 0) n = 1;  // keep a valid pointer for empty tensors
    if (d == Device::CPU) {
      ptr = aligned_alloc(64, (n + 63) / 64 * 64);
      PICO_ASSERT(ptr != nullptr, "host allocation of " + std::to_string(n) + " bytes");
    } else {  // CUDA and meta: from the arena
      const ArenaKey key = arena_key();
      ptr = arena_take(key);
      if (!ptr) ptr = device_allocate(key);
    }
    account(category, (long long)bytes);
    if (owner) ++*owner;
  }
  ~Storage() {
    // Kept for the next allocation of its size on `stream`, in that stream's order: work queued
    // there before this point may still use the buffer. Work on the communication stream must
    // have been waited for by then (comm_handle.cu).
    if (device == Device::CPU)
      free(ptr);
    else
      arena_give(arena_key(), ptr);
    account(category, -(long long)bytes);
    if (owner) --*owner;
  }
  ArenaKey arena_key() const {
    return {device, stream,
            (std::max<size_t>(bytes, 1) + kArenaGrain - 1) / kArenaGrain * kArenaGrain};
  }
};

void recount(const Tensor& t, Mem category) {
  PICO_ASSERT(t.storage != nullptr, "recount of a tensor without its own buffer");
  account(t.storage->category, -(long long)t.storage->bytes);
  t.storage->category = category;
  account(category, (long long)t.storage->bytes);
}

// ----------------------------------------------------------------------------
// Tensor

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}
float* Tensor::f32() const {
  PICO_ASSERT(dtype == DType::F32, "tensor is not F32");
  return (float*)ptr;
}
int32_t* Tensor::i32() const {
  PICO_ASSERT(dtype == DType::I32, "tensor is not I32");
  return (int32_t*)ptr;
}
uint8_t* Tensor::u8() const {
  PICO_ASSERT(dtype == DType::U8, "tensor is not U8");
  return (uint8_t*)ptr;
}
Tensor Tensor::view(int64_t offset, std::vector<int64_t> new_shape) const {
  Tensor t = *this;
  t.shape = std::move(new_shape);
  t.ptr = (char*)ptr + offset * (int64_t)dtype_size(dtype);
  PICO_ASSERT(
      offset >= 0 && offset + t.numel() <= numel(),
      "view " + t.shape_str() + " at " + std::to_string(offset) + " outside " + shape_str());
  return t;
}
std::string Tensor::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The one allocation path; `stream` is the legacy default stream (0) and `owner` null for the
// forms without a Context.
static Tensor empty_on(cudaStream_t stream, std::vector<int64_t> shape, Mem category, Device device,
                       DType dtype, std::shared_ptr<std::atomic<int64_t>> owner = nullptr) {
  Tensor t;
  t.shape = std::move(shape);
  t.dtype = dtype;
  t.device = device;
  t.storage = std::make_shared<Storage>(t.nbytes(), device, category, stream, std::move(owner));
  t.ptr = t.storage->ptr;
  return t;
}
static void zero_on(cudaStream_t stream, const Tensor& t) {
  if (count_op(t.device, OpKind::Memory, {0, 0, (double)t.nbytes(), 1})) return;
  if (t.device == Device::CUDA)
    CUDA_CHECK(cudaMemsetAsync(t.ptr, 0, t.nbytes(), stream));
  else
    memset(t.ptr, 0, t.nbytes());
}
Tensor empty(std::vector<int64_t> shape, Mem category, Device device, DType dtype) {
  return empty_on(0, std::move(shape), category, device, dtype);
}
Tensor zeros(std::vector<int64_t> shape, Mem category, Device device, DType dtype) {
  Tensor t = empty(std::move(shape), category, device, dtype);
  zero_(t);
  return t;
}
void zero_(const Tensor& t) {
  zero_on(0, t);
}
Tensor empty(const Context& ctx, std::vector<int64_t> shape, Mem category, DType dtype) {
  return empty_on(ctx.stream, std::move(shape), category, ctx.device, dtype, ctx.allocations);
}
Tensor zeros(const Context& ctx, std::vector<int64_t> shape, Mem category, DType dtype) {
  Tensor t = empty(ctx, std::move(shape), category, dtype);
  zero_(ctx, t);
  return t;
}
void zero_(const Context& ctx, const Tensor& t) {
  zero_on(ctx.stream, t);
}
void copy_(const Context& ctx, const Tensor& dst, const Tensor& src) {
  PICO_ASSERT(dst.numel() == src.numel() && dst.dtype == src.dtype && dst.device == ctx.device &&
                  src.device == ctx.device,
              "copy_ " + src.shape_str() + " into " + dst.shape_str() + " on the context's device");
  if (count_op(ctx.device, OpKind::Memory, {0, (double)src.nbytes(), (double)dst.nbytes(), 1}))
    return;
  if (ctx.device == Device::CPU) return (void)memmove(dst.ptr, src.ptr, src.nbytes());
  if (src.nbytes() > 0)
    CUDA_CHECK(
        cudaMemcpyAsync(dst.ptr, src.ptr, src.nbytes(), cudaMemcpyDeviceToDevice, ctx.stream));
}
static __global__ void fill_kernel(float* t, float value, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    t[i] = value;
}
void fill_(const Context& ctx, const Tensor& t, float value) {
  PICO_ASSERT(t.dtype == DType::F32 && t.device == ctx.device,
              "fill_: an fp32 tensor on the context's device");
  const int64_t n = t.numel();
  if (count_op(ctx.device, OpKind::Memory, {0, 0, (double)t.nbytes(), 1})) return;
  if (ctx.device == Device::CPU) return std::fill(t.f32(), t.f32() + n, value);
  if (n == 0) return;
  const unsigned blocks = (unsigned)std::min<int64_t>((n + 255) / 256, 4096);
  fill_kernel<<<blocks, 256, 0, ctx.stream>>>(t.f32(), value, n);
  LAUNCH_CHECK(ctx, "fill_kernel");
}

Tensor empty_rows(const Context& ctx, int64_t rows, int64_t cols, Mem category) {
  return empty(ctx, {std::max<int64_t>(rows, 1), cols}, category).view(0, {rows, cols});
}
Tensor device_floats(const Context& ctx, const std::vector<float>& v, std::vector<int64_t> shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  PICO_ASSERT(n == (int64_t)v.size(), "device_floats: shape");
  Tensor t = empty(ctx, {std::max<int64_t>(n, 1)}, Mem::Workspace).view(0, shape);
  if (n > 0) from_host(ctx, t, v.data());
  return t;
}
Tensor device_ints(const Context& ctx, const std::vector<int32_t>& v, Mem category) {
  const int64_t n = (int64_t)v.size();
  Tensor t = empty(ctx, {std::max<int64_t>(n, 1)}, category, DType::I32).view(0, {n});
  if (n > 0) from_host(ctx, t, v.data());
  return t;
}

// On the legacy default stream. cudaMemcpy from device to host returns when the data is there:
// a host synchronisation, counted, waited for against the bound (an event on the legacy stream
// follows the work of every blocking stream, the compute stream's too). A host-to-device copy from
// pageable memory returns once the source is staged, so the caller may reuse it at once.
void copy_(const Tensor& dst, const Tensor& src) {
  PICO_ASSERT(dst.numel() == src.numel() && dst.dtype == src.dtype,
              "copy_ " + src.shape_str() + " into " + dst.shape_str());
  if (dst.device == Device::CPU && src.device == Device::CPU) {
    memmove(dst.ptr, src.ptr, src.nbytes());
    return;
  }
  if (dst.device == Device::Meta || src.device == Device::Meta) {
    // Nothing moves; a read back to the host is still the wait it would be (and reads zeros:
    // nothing data-dependent comes back from the meta device).
    PICO_ASSERT(dst.device != Device::CUDA && src.device != Device::CUDA, "meta and CUDA tensors");
    if (dst.device == Device::CPU) {
      count_host_sync();
      memset(dst.ptr, 0, dst.nbytes());
    }
    count_op(Device::Meta, OpKind::Memory, {0, (double)src.nbytes(), (double)dst.nbytes(), 1});
    return;
  }
  cudaMemcpyKind kind = src.device == Device::CPU   ? cudaMemcpyHostToDevice
                        : dst.device == Device::CPU ? cudaMemcpyDeviceToHost
                                                    : cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDeviceToHost) {  // the work before it done first, within the bound
    count_host_sync();
    synchronize_stream(0, "the device's work before a copy to the host");
  }
  CUDA_CHECK(cudaMemcpy(dst.ptr, src.ptr, src.nbytes(), kind));
}
Tensor to_device(const Tensor& t, Device device, Mem category) {
  Tensor out = empty(t.shape, category, device, t.dtype);
  copy_(out, t);
  return out;
}
std::vector<float> to_host_floats(const Tensor& t) {
  std::vector<float> v(t.numel());
  Tensor host;
  host.ptr = v.data();
  host.shape = t.shape;
  if (t.device == Device::CPU) count_host_sync();  // (copy_ counts the device-to-host copy)
  copy_(host, t);
  return v;
}
static void from_host_bytes(const Tensor& dst, const void* src, DType dtype) {
  Tensor host;
  host.ptr = const_cast<void*>(src);
  host.shape = dst.shape;
  host.dtype = dtype;
  copy_(dst, host);
}
void from_host(const Tensor& dst, const float* src) {
  from_host_bytes(dst, src, DType::F32);
}
void from_host(const Tensor& dst, const int32_t* src) {
  from_host_bytes(dst, src, DType::I32);
}

// A ring of pinned buffers, each with the event of the copy it last sent. A micro-batch sends
// four or five (positions, ids, targets, dropout's sequences, its loss's sum items), a mixture a
// few per layer. The host runs a few micro-batches ahead at most: the ring's 32 buffers are
// about seven micro-batches of a dense model, and a collective's wait (tp, a pipeline's receive,
// a mixture's routing) or the step's loss read holds it back sooner. So a buffer's last copy has
// mostly arrived when its turn comes again; when it has not, the host waits for it (counted,
// bounded), which keeps the host from running further ahead.
//
// Each buffer holds 64 KiB at least and doubles when it must grow, so it grows only in the first
// steps (a mixture's routing counts may grow it later). The buffer it outgrew is freed with the
// ring: cudaFreeHost waits for the whole device, an uncounted wait that a collective stuck on a
// failed peer would make endless.
struct PinnedStaging {
  struct Buffer {
    void* host = nullptr;
    size_t bytes = 0;
    cudaEvent_t sent = nullptr;
  };
  std::vector<Buffer> ring = std::vector<Buffer>(32);
  std::vector<void*> outgrown;
  size_t next = 0;
  ~PinnedStaging() {  // (errors ignored: the process may be ending)
    for (Buffer& b : ring) {
      if (b.sent) {
        cudaEventSynchronize(b.sent);
        cudaEventDestroy(b.sent);
      }
      if (b.host) cudaFreeHost(b.host);
    }
    for (void* p : outgrown) cudaFreeHost(p);
  }
};

void from_host(const Context& ctx, const Tensor& dst, const void* src) {
  PICO_ASSERT(dst.device == ctx.device, "from_host(ctx) into a tensor on the context's device");
  const size_t bytes = dst.nbytes();
  // One Memory op on every device: the copy up a GPU makes (on the CPU, the copy into place).
  if (count_op(ctx.device, OpKind::Memory, {0, (double)bytes, (double)bytes, 1})) return;
  if (ctx.device == Device::CPU) return (void)memcpy(dst.ptr, src, bytes);
  PICO_ASSERT(ctx.staging, "from_host(ctx): the context has no pinned staging buffers");
  PinnedStaging& staging = *ctx.staging;
  PinnedStaging::Buffer& b = staging.ring[staging.next++ % staging.ring.size()];
  if (b.sent && !event_reached(b.sent)) {  // its last copy is on its way
    count_host_sync();
    wait_for_event(b.sent, "a pinned staging buffer's last copy to the device");
  }
  if (b.bytes < bytes) {  // cudaMallocHost may wait for the device: counted
    count_host_sync();
    if (b.host) staging.outgrown.push_back(b.host);
    b.bytes = std::max<size_t>({bytes, 2 * b.bytes, 64 << 10});
    CUDA_CHECK(cudaMallocHost(&b.host, b.bytes));
  }
  if (!b.sent) CUDA_CHECK(cudaEventCreateWithFlags(&b.sent, cudaEventDisableTiming));
  memcpy(b.host, src, bytes);
  CUDA_CHECK(cudaMemcpyAsync(dst.ptr, b.host, bytes, cudaMemcpyHostToDevice, ctx.stream));
  CUDA_CHECK(cudaEventRecord(b.sent, ctx.stream));
}

// ----------------------------------------------------------------------------
// Context

static bool g_sync_launches = false;  // a debugging switch, read by Context::create only
void set_sync_launches(bool on) {
  g_sync_launches = on;
}

Context Context::create(Device device) {
  Context ctx;
  ctx.device = device;
  if (device == Device::CUDA) {
    // Keep freed blocks in the pool instead of returning them to the driver at each sync.
    if (memory_pools_supported()) {
      uint64_t keep = UINT64_MAX;
      CUDA_CHECK(cudaMemPoolSetAttribute(default_pool(), cudaMemPoolAttrReleaseThreshold, &keep));
    }
    // A blocking stream, on purpose: the forms of empty / zeros / zero_ / copy_ without a
    // Context (setup, checkpoints, tests, and every copy) run on the legacy default stream,
    // and a blocking stream is ordered with it in both directions. The model's activations
    // and workspace already take this Context; a non-blocking compute stream would need the
    // copies to take it too.
    CUDA_CHECK(cudaStreamCreateWithFlags(&ctx.stream, cudaStreamDefault));
    CUBLAS_CHECK(cublasCreate(&ctx.cublas));
    CUBLAS_CHECK(cublasSetStream(ctx.cublas, ctx.stream));
    // cuBLAS's workspace, where its split-K and stream-K GEMMs keep partial sums: NVIDIA's
    // recommended 32 MiB on Hopper, 4 MiB before it (the cuBLAS guide, cublasSetWorkspace; what
    // PyTorch sets), reserved once here so that no GEMM allocates.
    int dev = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    const size_t workspace = (major >= 9 ? 32u : 4u) << 20;
    CUDA_CHECK(cudaMalloc(&ctx.cublas_workspace, workspace));
    CUBLAS_CHECK(cublasSetWorkspace(ctx.cublas, ctx.cublas_workspace, workspace));
    // fp32 training stays fp32: no TF32 tensor-core shortcut, so GPU matches the CPU reference.
    // And a 16-bit output is one rounding of an fp32 sum: no split-K partial sums added in
    // bf16 or fp16 (cublasMath_t; PyTorch's allow_bf16_reduced_precision_reduction = False).
    CUBLAS_CHECK(cublasSetMathMode(
        ctx.cublas,
        (cublasMath_t)(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    ctx.staging = std::make_shared<PinnedStaging>();
  }
  ctx.sync_launches = g_sync_launches;
  return ctx;
}
void Context::destroy() {
  // Its work done, within the bound, before the implicit waits below (cublasDestroy, cudaFree).
  if (device == Device::CUDA && stream)
    synchronize_stream(stream, "the compute stream's last work");
  weight_copies.reset();  // allocated on this stream: freed before it goes
  staging.reset();        // its copies ran on this stream
  // Any other buffer still alive would be freed later, on a destroyed stream: a bug on every
  // device, stopped here where it is made rather than at some later free.
  const int64_t alive = live_allocations();
  PICO_ASSERT(alive == 0, std::to_string(alive) +
                              " allocations made on this context are still alive; let their "
                              "tensors go out of scope before Context::destroy");
  if (cublas) cublasDestroy(cublas);
  if (cublas_workspace) cudaFree(cublas_workspace);  // (waits for the GEMMs that used it)
  if (stream) {
    release_arena(stream);  // what the arena holds for it goes back before the stream goes
    cudaStreamDestroy(stream);
  }
  cublas = nullptr, cublas_workspace = nullptr;
  stream = nullptr;
}
void Context::synchronize() const {
  count_host_sync();
  if (device == Device::CUDA) synchronize_stream(stream, "the compute stream's work");
}
void launch_check(const Context& ctx, const char* kernel, const char* file, int line) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess && ctx.sync_launches) err = cudaStreamSynchronize(ctx.stream);
  if (err != cudaSuccess) {
    fprintf(stderr, "[CUDA ERROR] %s:%d: kernel %s%s -> %s\n", file, line, kernel,
            ctx.sync_launches ? " (launch or run, --sync-launches)" : " (launch)",
            cudaGetErrorString(err));
    fatal_abort();
  }
}
Device resolve_device(const std::string& flag) {
  if (flag == "cpu") return Device::CPU;
  if (flag == "meta") return Device::Meta;
  if (flag == "cuda") {
    std::string why;
    if (!cuda_available(&why))
      throw UsageError("--device cuda: no usable CUDA device (" + why +
                       "); use --device cpu or auto");
    return Device::CUDA;
  }
  if (flag == "auto") {
    std::string why;
    if (cuda_available(&why)) return Device::CUDA;
    if (why.rfind("cudaErrorNoDevice", 0) != 0 && why.find("lists no device") == std::string::npos)
      fprintf(stderr, "note: --device auto: CUDA is not usable (%s); running on the CPU\n",
              why.c_str());
    return Device::CPU;
  }
  throw UsageError("--device " + flag + ": expected auto, cpu, cuda or meta");
}

std::string describe_cuda_devices() {
  char line[512];
  std::string out;
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);  // 0 when no driver is loaded
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  snprintf(line, sizeof line, "CUDA driver API %d.%d, runtime %d.%d (built with %d.%d)\n",
           driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10,
           CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
  out += line;
  std::string why;
  if (!cuda_available(&why)) return out + "no usable CUDA device: " + why + "\n";
  int count = 0;
  CUDA_CHECK(cudaGetDeviceCount(&count));
  for (int d = 0; d < count; d++) {
    cudaDeviceProp p;
    CUDA_CHECK(cudaGetDeviceProperties(&p, d));
    int pools = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, d));
    snprintf(line, sizeof line,
             "device %d: %s, %s, compute capability %d.%d, %d SMs, stream-ordered memory "
             "pools %s\n",
             d, p.name, human_bytes((double)p.totalGlobalMem).c_str(), p.major, p.minor,
             p.multiProcessorCount, pools ? "supported" : "NOT supported (cudaMalloc is used)");
    out += line;
  }
  return out;
}

// ----------------------------------------------------------------------------
// RNG

uint64_t rng_key(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return splitmix64(seed ^ splitmix64(h));
}
static void fill_host_then_copy(const Tensor& t, std::vector<float>& host) {
  PICO_ASSERT(t.dtype == DType::F32, "init needs an F32 tensor");
  from_host(t, host.data());
}
// Initialisation on the meta device draws nothing (a meta tensor holds no values).
// out[i] = element offset + i of the full tensor: normal (a = std) or uniform in [a, b).
// In double, then rounded to float, as the CPU loops below. nvcc would fuse the uniform's
// multiply and add into one FMA (one rounding instead of two, so other bits than the CPU's):
// __dmul_rn and __dadd_rn keep them apart. The normal has no add to fuse.
static __global__ void init_kernel(float* out, int64_t n, uint64_t key, int64_t offset, bool normal,
                                   float a, float b) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    if (normal)
      out[i] = (float)((double)a * rng_normal(key, offset + i));
    else
      out[i] = (float)__dadd_rn(a, __dmul_rn((double)(b - a), rng_uniform(key, offset + i)));
  }
}
static void init_on_device(const Tensor& t, uint64_t key, int64_t offset, bool normal, float a,
                           float b) {
  PICO_ASSERT(t.dtype == DType::F32, "init needs an F32 tensor");
  int64_t n = t.numel();
  if (n == 0) return;
  unsigned blocks = (unsigned)std::min<int64_t>((n + 255) / 256, 4096);
  init_kernel<<<blocks, 256>>>(t.f32(), n, key, offset, normal, a, b);  // legacy stream: setup
  CUDA_CHECK(cudaGetLastError());
}
void init_normal(const Tensor& t, uint64_t seed, const std::string& name, float std,
                 int64_t offset) {
  if (t.device == Device::Meta) return;
  uint64_t key = rng_key(seed, name);
  if (t.device == Device::CUDA) return init_on_device(t, key, offset, true, std, 0.0f);
  std::vector<float> host(t.numel());
  for (int64_t i = 0; i < t.numel(); i++) host[i] = (float)(std * rng_normal(key, offset + i));
  fill_host_then_copy(t, host);
}
void init_uniform(const Tensor& t, uint64_t seed, const std::string& name, float lo, float hi,
                  int64_t offset) {
  if (t.device == Device::Meta) return;
  uint64_t key = rng_key(seed, name);
  if (t.device == Device::CUDA) return init_on_device(t, key, offset, false, lo, hi);
  std::vector<float> host(t.numel());
  for (int64_t i = 0; i < t.numel(); i++)
    host[i] = (float)(lo + (hi - lo) * rng_uniform(key, offset + i));
  fill_host_then_copy(t, host);
}
void fill_(const Tensor& t, float value) {
  if (t.device == Device::Meta) return;
  std::vector<float> host(t.numel(), value);
  fill_host_then_copy(t, host);
}

// ----------------------------------------------------------------------------
// Timer and formatting

double now_seconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

// ---- The ledger's clock (core.cuh) ----
// Observation only: it times the ops the ledger counts, it never orders them.
static struct {
  bool on = false, cuda = false;
  cudaStream_t stream = nullptr;
  int row = -1;  // CPU: the row of the op running since `since` (-1: none)
  double since = 0;
  std::vector<std::pair<int, cudaEvent_t>> marks;  // CUDA: (row after it, event), not yet read
  std::vector<cudaEvent_t> pool;                   // CUDA: events read, to reuse
} g_clock;

void ledger_clock_tick(int row) {
  if (!g_clock.on) return;
  if (!g_clock.cuda) {
    const double now = now_seconds();
    if (g_clock.row >= 0) add_measured_time(g_clock.row, now - g_clock.since);
    g_clock.row = row, g_clock.since = now;
    return;
  }
  cudaEvent_t e;
  if (g_clock.pool.empty()) {
    CUDA_CHECK(cudaEventCreate(&e));
  } else {
    e = g_clock.pool.back();
    g_clock.pool.pop_back();
  }
  CUDA_CHECK(cudaEventRecord(e, g_clock.stream));
  g_clock.marks.push_back({row, e});
}
void start_ledger_clock(Device device, cudaStream_t stream) {
  g_clock.on = device != Device::Meta;  // the meta device takes no time to time
  g_clock.cuda = device == Device::CUDA, g_clock.stream = stream, g_clock.row = -1;
}
void mark_ledger_clock() {
  ledger_clock_tick(-1);
}
void settle_ledger_clock() {
  if (!g_clock.on || !g_clock.cuda || g_clock.marks.size() < 2) return;
  // Every event read must have happened: wait for the last (a measurement's wait, only under
  // --report roofline on CUDA; the step's own synchronisation usually has it done already, and
  // only a wait that blocks is counted).
  const cudaEvent_t last = g_clock.marks.back().second;
  if (!event_reached(last)) {
    count_host_sync();
    wait_for_event(last, "the roofline report's timing events");
  }
  for (size_t i = 0; i + 1 < g_clock.marks.size(); i++) {
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, g_clock.marks[i].second, g_clock.marks[i + 1].second));
    if (g_clock.marks[i].first >= 0) add_measured_time(g_clock.marks[i].first, ms * 1e-3);
    g_clock.pool.push_back(g_clock.marks[i].second);
  }
  g_clock.marks.erase(g_clock.marks.begin(), g_clock.marks.end() - 1);  // the last one runs on
}
std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) bytes /= 1024.0, u++;
  char buf[32];
  snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

// ----------------------------------------------------------------------------
// Output files

bool is_main_process() {
  int up = 0, down = 0, rank = 0;
  MPI_Initialized(&up);
  MPI_Finalized(&down);
  if (up && !down) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank == 0;
}

std::string output_target(const std::string& path) {
  fs::path p = path;
  std::error_code ec;
  for (int hops = 0; hops < 40 && fs::is_symlink(p, ec); hops++) {
    fs::path link = fs::read_symlink(p, ec);
    if (ec) break;
    p = link.is_absolute() ? link : p.parent_path() / link;
  }
  return p.lexically_normal().string();
}

static std::string host_name() {
  char name[256] = "host";
  gethostname(name, sizeof name - 1);
  name[sizeof name - 1] = '\0';
  return name;
}
std::string temp_name(const std::string& target, const std::string& tag) {
  return target + "." + tag + "." + host_name() + "." + std::to_string(getpid());
}

void remove_stale_temps(const std::string& target, const std::string& tag) {
  const fs::path t = target;
  const std::string prefix = t.filename().string() + "." + tag + "." + host_name() + ".";
  std::error_code ec;
  const fs::path dir = t.parent_path().empty() ? "." : t.parent_path();
  std::vector<fs::path> stale;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string pid = name.substr(prefix.size());
    if (pid.empty() || pid.size() > 9 || pid.find_first_not_of("0123456789") != std::string::npos)
      continue;
    // kill(pid, 0): ESRCH means no such process; EPERM means alive but someone else's.
    if (kill((pid_t)std::stol(pid), 0) != 0 && errno == ESRCH) stale.push_back(e.path());
  }
  for (const fs::path& p : stale) fs::remove_all(p, ec);
}

void probe_directory(const std::string& what, const std::string& target) {
  const std::string probe = temp_name(target, "probe");
  const std::string dir = fs::path(target).parent_path().string();
  int fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0)
    throw UsageError(what + ": cannot create files in " + (dir.empty() ? "." : dir) + ": " +
                     strerror(errno));
  close(fd);
  unlink(probe.c_str());
}

// What a path that exists but is not a regular file is, for the message.
static std::string file_kind(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) return "missing";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return S_ISREG(st.st_mode) ? "a regular file" : "not a regular file";
}
// Throws unless `target` is absent or a regular file.
static void require_regular_or_absent(const std::string& what, const std::string& target) {
  std::error_code ec;
  if (fs::exists(target, ec) && !fs::is_regular_file(target, ec))
    throw UsageError(what + ": " + (target == what ? "" : target + " ") + "is " +
                     file_kind(target) + "; outputs only replace regular files: name a file");
}

void check_output_file(const std::string& flag, const std::string& path) {
  const std::string what = flag + " " + path, target = output_target(path);
  require_regular_or_absent(what, target);
  std::error_code ec;
  const fs::path dir = fs::path(target).parent_path();
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw UsageError(what + ": the directory " + dir.string() + " does not exist; create it");
  probe_directory(what, target);
}

static UsageError write_error(const std::string& path) {
  return UsageError(path + ": cannot write: " + strerror(errno));
}
void write_all(FILE* f, const void* bytes, size_t n, const std::string& path) {
  if (n > 0 && fwrite(bytes, 1, n, f) != n) throw write_error(path);
}

// The temporary lies next to the target (rename is atomic only within one filesystem) under
// this process's name, so two writers never share one, and a killed writer's is removed by
// the next write.
void write_file_atomic(const std::string& path, const std::function<void(FILE*)>& body) {
  const std::string target = output_target(path), tmp = temp_name(target, "tmp");
  require_regular_or_absent(path, target);
  FILE* f = fopen(tmp.c_str(), "wb");
  if (!f) throw write_error(tmp);
  try {
    body(f);
    if (fflush(f) != 0 || fsync(fileno(f)) != 0) throw write_error(tmp);
  } catch (...) {
    fclose(f);
    remove(tmp.c_str());
    throw;
  }
  if (fclose(f) != 0 || rename(tmp.c_str(), target.c_str()) != 0) {
    UsageError err = write_error(path);
    remove(tmp.c_str());
    throw err;
  }
  remove_stale_temps(target, "tmp");
}

void OutputLines::open(const std::string& flag, const std::string& path) {
  check_output_file(flag, path);
  flag_ = flag, path_ = path;
  file_ = fopen(output_target(path).c_str(), "w");
  if (!file_) throw UsageError(flag + " " + path + ": cannot open for writing: " + strerror(errno));
}
void OutputLines::write_line(const std::string& line) {
  if (!file_) return;
  if (fwrite(line.data(), 1, line.size(), file_) != line.size() || fputc('\n', file_) == EOF ||
      fflush(file_) != 0)
    fail();
}
void OutputLines::close() {
  if (!file_) return;
  FILE* f = file_;
  file_ = nullptr;
  if (fclose(f) != 0) fail();
}
// A lost log line is lost data: stop every rank rather than train on without it.
void OutputLines::fail() {
  fprintf(stderr, "error: %s %s: cannot write: %s\n", flag_.c_str(), path_.c_str(),
          strerror(errno));
  fatal_abort();
}
