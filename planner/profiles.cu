// profiles.cu: the planner's hardware (Playbook §11): GPU profiles with their named constants,
// the links bench_comm --fit measured, and the peak a running job's MFU divides by.
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "flash_attention.cuh"
#include "planner/planner_internal.cuh"
#include "runtime/dtype.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"

// ----------------------------------------------------------------------------
// GPU profiles

// The H100 numbers the whole model uses (the book's cluster: 8 H100 SXM per node, 400 Gb/s per
// GPU between nodes). Bus bandwidths are the book's own measurement (Playbook §8.1,
// pp_comm_bandwidth: median busbw of 256 MB collectives on 1 to 64 nodes): within a node
// all-reduce reaches 436 GB/s, all-gather and reduce-scatter 250; between nodes, with a latency
// of 5 us per ring step, 1/busbw = 1/B + c R + alpha R / S over R = 8 x nodes ranks fits
// all-reduce with B = 408 GB/s and c = 4.1e-14 s/B, all-gather and reduce-scatter with B = 285
// GB/s and c = 1.2e-13 s/B (least squares on relative error over 2..64 nodes; within 30% of
// every point but 4 and 8 nodes' all-reduce).
static GpuProfile h100() {
  GpuProfile g;
  g.name = "h100";
  g.peak_bf16 = 989e12, g.peak_fp32 = 67e12, g.peak_fp8 = 1979e12;
  g.memory = 80 * kGiB, g.hbm_bandwidth = 3.35e12;
  g.intra.allreduce_bw = 436e9, g.intra.gather_bw = 250e9, g.intra.p2p_bw = 450e9;
  g.intra.alpha = g.intra.alpha_gather = g.intra.alpha_p2p = 2e-6;
  g.inter_allreduce_bw = 408e9, g.inter_gather_bw = 285e9;
  g.inter_allreduce_per_rank = 4.1e-14, g.inter_gather_per_rank = 1.2e-13;
  g.inter_alpha = 5e-6;
  g.nic_bw = 50e9;
  g.gemm_half_width = 128;
  g.runtime_bytes = 2 * kGiB;  // the book: CUDA context and kernels 1-2 GB, plus buffers
  // What the book's campaign measured beyond what picoscale allocates (NCCL's buffers, the
  // caching allocator's reserve, the framework's own buffers), over the activation peak, whose
  // sizes come and go: -0.32 to 0.82 over its 26 cells, median 0.34 (docs/meta-device.md, "The
  // book's campaign through the real code"). A fit to the book's measurement, not a datasheet.
  g.allocator_slack = 0.34;
  g.source = "H100 SXM datasheet; busbw fitted to the book's §8.1 measurement";
  // The roofline's constants (the planner's compute too: compute.cu). A bf16 GEMM: 0.6 of the
  // dense peak, half that at a width of 128: cuBLAS on the GPU check's H200 (the H100's tensor
  // cores) reached 0.46, 0.55 and 0.70 at llama-1b's three GEMM shapes, all 2,048 at their
  // narrowest (tools/README.md), a mean of 0.57 = 0.6 x 2048 / (2048 + 128); public figures
  // for wider GEMMs say 0.7. Attention: 0.35, FlashAttention-2's utilisation on H100 as the
  // FlashAttention-3 paper states it (Shah et al. 2024, abstract); a streaming kernel: 0.9 of HBM
  // bandwidth (STREAM-like copies); a launch: 3 us, the few microseconds of launch latency a
  // kernel too small to hide it costs.
  g.gemm_efficiency = 0.6, g.attention_efficiency = 0.35, g.stream_efficiency = 0.9;
  g.launch_s = 3e-6;
  g.roofline_source =
      "GEMMs 0.6 of peak (cuBLAS measured on an H200 at llama-1b's shapes), attention 0.35 "
      "(FlashAttention-2 on H100, FA3 paper), HBM x 0.9 (STREAM-like), 3 us a launch";
  return g;
}

GpuProfile gpu_profile(const std::string& name) {
  if (name == "h100") return h100();
  if (name == "h200") {  // the H100's compute and NVLink with 141 GB of faster memory
    GpuProfile g = h100();
    g.name = "h200", g.memory = 141e9, g.hbm_bandwidth = 4.8e12;
    g.source = "H200 SXM datasheet; links as the H100's";
    return g;
  }
  if (name == "a100") {  // NVLink 3 (300 GB/s per direction), 200 Gb/s per GPU between nodes
    GpuProfile g = h100();
    g.name = "a100";
    g.peak_bf16 = 312e12, g.peak_fp32 = 19.5e12, g.peak_fp8 = 0;
    g.memory = 80 * kGiB, g.hbm_bandwidth = 2.04e12;
    const double nvlink = 300.0 / 450.0;
    g.intra.allreduce_bw *= nvlink, g.intra.gather_bw *= nvlink, g.intra.p2p_bw = 300e9;
    g.nic_bw = 25e9;
    g.inter_allreduce_bw = std::min(g.inter_allreduce_bw, 8 * g.nic_bw);
    g.inter_gather_bw = std::min(g.inter_gather_bw, 8 * g.nic_bw);
    g.source = "A100 SXM datasheet; busbw scaled from the H100's by NVLink and network bandwidth";
    // FlashAttention-2 reaches 50-73% of A100's peak (Dao 2023, abstract): 0.6; cuBLAS's wide
    // bf16 GEMMs about 0.8 of it in public figures.
    g.gemm_efficiency = 0.8, g.attention_efficiency = 0.6;
    g.roofline_source =
        "GEMMs 0.8 of peak (public cuBLAS figures), attention 0.6 (FlashAttention-2 paper: "
        "50-73%), HBM x 0.9, 3 us a launch";
    return g;
  }
  if (name == "cpu") {  // this machine: one node whose "GPUs" are MPI ranks sharing its cores
    GpuProfile g;
    g.name = "cpu";
    g.peak_fp32 = 0;  // measured by the caller (device_peak) for its ranks' threads
    g.peak_bf16 = g.peak_fp8 = 0;
    double pages = (double)sysconf(_SC_PHYS_PAGES), page = (double)sysconf(_SC_PAGE_SIZE);
    g.memory = pages * page;
    g.hbm_bandwidth = 10e9;
    // Shared-memory MPI between processes: a few GB/s and microseconds (bench_comm measures
    // this machine's; plan --comm-fit reads its fit).
    g.intra.allreduce_bw = g.intra.gather_bw = 4e9, g.intra.p2p_bw = 4e9;
    g.intra.alpha = g.intra.alpha_gather = g.intra.alpha_p2p = 5e-6;
    g.inter_allreduce_bw = g.inter_gather_bw = g.nic_bw = 4e9;
    g.inter_alpha = 5e-6;
    // The rate is one 512^3 sgemm's on this machine: a wide GEMM of the model runs near it.
    g.gemm_half_width = 32;
    g.source = "this machine: sgemm measured now, shared-memory MPI defaults";
    // The roofline's (run_profile measures the rates): the GEMM rate is a wide sgemm's own, so
    // a wide GEMM reaches all of it; attention and memory are measured too; a call launches no
    // kernel.
    g.gemm_efficiency = 1, g.attention_efficiency = 1, g.stream_efficiency = 1;
    g.launch_s = 0;
    g.roofline_source = "this machine";
    return g;
  }
  std::string known;
  for (const std::string& n : gpu_profile_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--gpu " + name + ": unknown profile; choose one of " + known);
}
std::vector<std::string> gpu_profile_names() {
  return {"h100", "h200", "a100", "cpu"};
}

void apply_comm_fit(GpuProfile& g, const std::string& path) {
  std::ifstream f(path);
  if (!f) throw UsageError("--comm-fit " + path + ": cannot open it (bench_comm --fit writes it)");
  try {
    nlohmann::json j = nlohmann::json::parse(f);
    // Each number within what a machine measures: a key outside says which, and its bounds.
    auto number = [](const nlohmann::json& in, const char* key, double lo, bool open_lo, double hi,
                     bool integer = false) {
      const double v = in.at(key).get<double>();
      if (!(open_lo ? v > lo : v >= lo) || !(v <= hi) || (integer && v != std::floor(v)))
        throw std::invalid_argument(std::string(key) + " " + num(v) + " is not " +
                                    (integer ? "a whole number " : "a number ") +
                                    (open_lo ? "above " : "from ") + num(lo) + " to " + num(hi));
      return v;
    };
    auto links = [&](const nlohmann::json& collectives) {
      auto link = [&](const char* name, double& alpha, double& bw) {
        const nlohmann::json& c = collectives.at(name);
        try {  // a latency up to 10 s, a bandwidth up to 1 PB/s
          alpha = number(c, "alpha_s", 0, false, 10);
          bw = number(c, "busbw_bytes_per_s", 0, true, 1e15);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(std::string(name) + "'s " + e.what());
        }
      };
      GpuProfile::Links k;
      double gather_alpha = 0, gather_bw = 0, scatter_alpha = 0, scatter_bw = 0;
      link("all_reduce", k.alpha, k.allreduce_bw);
      link("all_gather", gather_alpha, gather_bw);
      link("reduce_scatter", scatter_alpha, scatter_bw);
      link("send_recv", k.alpha_p2p, k.p2p_bw);
      // One figure for both: the planner prices all-gathers and reduce-scatters alike.
      k.alpha_gather = (gather_alpha + scatter_alpha) / 2;
      k.gather_bw = 2 / (1 / gather_bw + 1 / scatter_bw);
      return k;
    };
    g.intra = links(j.at("collectives"));
    if (j.contains("groups"))
      for (auto& [size, collectives] : j.at("groups").items())
        g.intra_by_size[(int)parse_number(size, "groups key", 2, 1 << 20, true)] =
            links(collectives);
    g.inter_allreduce_bw = g.intra.allreduce_bw, g.inter_gather_bw = g.intra.gather_bw;
    g.inter_allreduce_per_rank = g.inter_gather_per_rank = 0;
    g.inter_alpha = g.intra.alpha, g.nic_bw = g.intra.p2p_bw;
    g.source += "; collectives measured by bench_comm --fit (" + path + ")";
    if (g.name == "cpu" && j.contains("gemm_flops_alone")) {
      // A rank alone runs at the machine's rate for one rank; together the ranks run
      // shared_capacity at a time (the rest wait for a core).
      double alone = number(j, "gemm_flops_alone", 0, true, 1e18);
      double busy = number(j, "gemm_flops_per_rank", 0, true, 1e18);
      int ranks = (int)number(j, "ranks", 1, false, 1 << 20, true);
      g.peak_fp32 = alone;
      if (ranks * busy < 0.9 * ranks * alone) g.shared_capacity = ranks * busy / alone;
      g.source += ", its fp32 GEMM rate alone and shared";
      if (j.contains("gemm_half_width")) {  // narrow GEMMs' rate, measured the same way
        g.gemm_half_width = number(j, "gemm_half_width", 0, false, 1e9);
        g.source += " and for narrow GEMMs";
      }
      if (j.contains("memory_bandwidth")) {  // the memory-bound ops' and attention's, alone
        g.hbm_bandwidth = number(j, "memory_bandwidth", 0, true, 1e15);
        g.stream_efficiency = number(j, "stream_efficiency", 0, true, 1);  // fractions
        g.attention_efficiency = number(j, "attention_efficiency", 0, true, 1);
        g.source +=
            ", its memory bandwidth, our loops' share of it and attention's of the GEMM rate";
      }
    }
  } catch (const std::exception& e) {
    throw UsageError("--comm-fit " + path + ": not bench_comm --fit's JSON (" + e.what() + ")");
  }
}

double peak_flops(const GpuProfile& g, Precision p) {
  switch (p) {
    case Precision::FP32:
      return g.peak_fp32;
    case Precision::BF16:
    case Precision::FP16:
      return g.peak_bf16;
    case Precision::FP8:
      return g.peak_fp8;
  }
  return 0;
}

void require_peak(const GpuProfile& g, Precision p) {
  if (peak_flops(g, p) > 0) return;
  std::vector<std::string> have;
  for (const std::string& n : gpu_profile_names())
    if (n != "cpu" && peak_flops(gpu_profile(n), p) > 0) have.push_back(n);
  std::string pick;
  for (size_t i = 0; i < have.size(); i++)
    pick += (i == 0 ? "" : i + 1 == have.size() ? " or " : ", ") + have[i];
  const std::string format = precision_name(p);
  throw UsageError("--dtype " + format + ": the " + g.name + " profile has no " + format +
                   " peak to price a step at; pick --gpu " + pick + ", or another --dtype");
}

// MFU's peak: the format's, fp8 counted against bf16 (its attention and the rest run in bf16).
double mfu_peak(const GpuProfile& g, Precision p) {
  return p == Precision::FP32 ? g.peak_fp32 : g.peak_bf16;
}

// ----------------------------------------------------------------------------
// The peak of a running job

namespace {
// One fp32 GEMM of [m, k] x [k, n] on this rank's threads, timed: the measure of a CPU rank's
// rate.
struct TimedGemm {
  const int m, k, n;
  const double flops = 2.0 * m * k * n;
  Tensor a, b, c;
  TimedGemm(const Context& ctx, int m_, int k_, int n_)
      : m(m_),
        k(k_),
        n(n_),
        a(empty({m, k}, Mem::Workspace, ctx.device)),
        b(empty({k, n}, Mem::Workspace, ctx.device)),
        c(empty({m, n}, Mem::Workspace, ctx.device)) {
    init_normal(a, 1, "a", 1.0f), init_normal(b, 1, "b", 1.0f);
  }
  double seconds(const Context& ctx) {
    ctx.synchronize();
    const double t0 = now_seconds();
    gemm(ctx, false, false, m, n, k, 1, a.f32(), k, b.f32(), n, 0, c.f32(), n);
    ctx.synchronize();
    return now_seconds() - t0;
  }
};
}  // namespace

// r = (w / (w + h)) / (W / (W + h)) solved for h; a narrow rate at or under w / W of the wide
// one is no finite h's.
double gemm_half_width_from(double r, double w, double W) {
  if (r >= 1) return 0;
  return r * W > w ? w * W * (1 - r) / (r * W - w) : 1e9;
}

// The wide and the narrow GEMMs in turn, so that a machine changing speed weighs on both alike.
GemmRate gemm_rate_for(const Context& ctx, double seconds) {
  const int W = 512, w = 128;
  TimedGemm wide(ctx, W, W, W), narrow_tokens(ctx, w, W, W), narrow_width(ctx, W, W, w);
  double t_wide = 0, t_narrow = 0;
  int rounds = 0;
  while (t_wide + t_narrow < seconds || rounds == 0) {
    t_wide += wide.seconds(ctx);
    for (int i = 0; i < W / w / 2; i++)
      t_narrow += narrow_tokens.seconds(ctx) + narrow_width.seconds(ctx);
    rounds++;
  }
  GemmRate g;
  g.flops = wide.flops * rounds / t_wide;
  g.half_width = gemm_half_width_from(t_wide / t_narrow, w, W);  // the same FLOPs each round
  return g;
}

// The profile of the current CUDA device ("h100" for an "NVIDIA H100 80GB HBM3"), or "" for a
// GPU of no profile; `gpu` (when given) gets the device's name.
static std::string cuda_profile_name(std::string* gpu) {
  int dev = 0;
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  if (gpu) *gpu = prop.name;
  for (const char* known : {"H100", "H200", "A100"})
    if (strstr(prop.name, known)) {
      std::string name = known;
      for (char& ch : name) ch = (char)tolower(ch);
      return name;
    }
  return "";
}

DevicePeak device_peak(const Context& ctx, Precision p, const std::string& profile) {
  DevicePeak d;
  if (ctx.device == Device::Meta || !profile.empty()) {  // priced on a profile, not measured
    GpuProfile g = run_profile(ctx, profile);
    if (g.name != "cpu") require_peak(g, p);  // CPU ranks are priced at their fp32 rate
    d.flops = g.name == "cpu" ? g.peak_fp32 : mfu_peak(g, p);
    d.how = "the " + g.name + " profile's " +
            (g.name == "cpu"
                 ? std::string("fp32 GEMM rate, measured now")
                 : std::string("dense ") + (p == Precision::FP32 ? "fp32" : "bf16") + " peak") +
            (profile.empty() ? ", --gpu's default on the meta device" : ", --gpu " + profile);
    return d;
  }
  std::string gpu;
  const std::string name = ctx.device == Device::CUDA ? cuda_profile_name(&gpu) : "";
  if (!name.empty()) {  // a GPU of a profile: its peak
    d.flops = mfu_peak(gpu_profile(name), p);
    d.how = gpu + ": the " + name + " profile's dense " + (p == Precision::FP32 ? "fp32" : "bf16") +
            " peak";
    return d;
  }
  // Measured: the best of 3 square GEMMs of 512 (after one warm-up) on this rank's threads.
  TimedGemm g(ctx, 512, 512, 512);
  g.seconds(ctx);
  double best = 1e30;
  for (int i = 0; i < 3; i++) best = std::min(best, g.seconds(ctx));
  d.flops = g.flops / best;
  d.how = "measured now: fp32 GEMM of " + std::to_string(g.n) + "^3, best of 3, " +
          (ctx.device == Device::CPU
               ? "on " + std::to_string(openblas_get_num_threads()) + " OpenBLAS thread(s)"
               : std::string("on this GPU (no profile for its name)"));
  return d;
}

// ----------------------------------------------------------------------------
// The profile a run is priced on (--report roofline, a meta run's MFU)

// This rank's memory bandwidth: bytes read and written by copies of 64 MiB, the best of 5.
static double measured_bandwidth() {
  const size_t n = size_t(64) << 20;
  std::vector<char> a(n, 1), b(n, 2);
  double best = 1e30;
  for (int i = 0; i < 5; i++) {
    const double t0 = now_seconds();
    memcpy(i % 2 ? a.data() : b.data(), i % 2 ? b.data() : a.data(), n);
    best = std::min(best, now_seconds() - t0);
  }
  return 2.0 * n / best;
}

// The fraction of the fp32 GEMM rate FlashAttention's CPU loop reaches on a causal block of 512
// tokens, 4 heads of 64 (its FLOPs as the ledger counts them: 4 per visible pair and head
// dimension), the best of 3.
static double measured_attention_efficiency(const Context& ctx, double peak) {
  const AttentionBlock a{1, 512, 512, 4, 4, 64};
  Tensor q = empty({a.Tq, a.Hq, a.hd}, Mem::Workspace, ctx.device);
  Tensor out = empty({a.Tq, a.Hq, a.hd}, Mem::Workspace, ctx.device);
  Tensor lse = empty({a.Hq, a.Tq}, Mem::Workspace, ctx.device);
  init_normal(q, 1, "q", 1.0f);
  double best = 1e30;
  for (int i = 0; i < 3; i++) {
    const double t0 = now_seconds();
    flash_attention_forward(ctx, out, lse, q, q, q, a);
    best = std::min(best, now_seconds() - t0);
  }
  const double pairs = a.Tq * (a.Tq + 1) / 2.0 * a.Hq;
  return std::min(1.0, 4 * pairs * a.hd / best / peak);
}

// The fraction of that bandwidth our own memory-bound CPU loops reach, whose arithmetic (an
// exponential, a square root) a copy does not have: a residual add, SwiGLU's forward and AdamW
// over 16 Mi elements, their bytes over their times (the best of 3 each).
static double measured_stream_efficiency(const Context& ctx, double bandwidth) {
  const int64_t n = int64_t(16) << 20;
  std::vector<Tensor> t;
  for (int i = 0; i < 4; i++) {
    t.push_back(empty({n / 1024, 1024}, Mem::Workspace, ctx.device));
    init_normal(t.back(), 1, "t" + std::to_string(i), 1.0f);
  }
  scale_(ctx, t[3], 0.0f);  // AdamW's v: a square root of it follows
  auto best = [&](const std::function<void()>& op) {
    double s = 1e30;
    for (int i = 0; i < 3; i++) {
      const double t0 = now_seconds();
      op();
      s = std::min(s, now_seconds() - t0);
    }
    return s;
  };
  const double seconds = best([&] { residual_forward(ctx, t[2], t[0], t[1]); }) +
                         best([&] { swiglu_forward(ctx, t[2], t[0], t[1]); }) + best([&] {
                           adamw_update(ctx, t[0].f32(), t[1].f32(), t[2].f32(), t[3].f32(), n,
                                        AdamWConfig{}, 1e-3f, 0.1f, 1);
                         });
  const double bytes = 4.0 * n * (3 + 3 + 7);  // read 2 write 1; the same; read 4 write 3
  return std::min(1.0, bytes / seconds / bandwidth);
}

CpuRates measure_cpu_rates(const Context& ctx, double peak) {
  CpuRates r;
  r.bandwidth = measured_bandwidth();
  r.stream_efficiency = measured_stream_efficiency(ctx, r.bandwidth);
  r.attention_efficiency = measured_attention_efficiency(ctx, peak);
  return r;
}

GpuProfile run_profile(const Context& ctx, const std::string& flag) {
  std::string name = flag;
  if (name.empty() && ctx.device == Device::CPU) name = "cpu";
  if (name.empty() && ctx.device == Device::CUDA) name = cuda_profile_name(nullptr);
  GpuProfile g = gpu_profile(name.empty() ? "h100" : name);  // meta, or a GPU of no profile
  if (g.name == "cpu") {  // this machine, measured now on this rank's threads (fp32 throughout)
    Context cpu = Context::create(Device::CPU);
    g.peak_fp32 = gemm_rate_for(cpu, 0.3).flops;
    const CpuRates rates = measure_cpu_rates(cpu, g.peak_fp32);
    g.hbm_bandwidth = rates.bandwidth;
    g.attention_efficiency = rates.attention_efficiency;
    g.stream_efficiency = rates.stream_efficiency;
    g.roofline_source =
        "this machine, measured now: sgemm 512^3, 64 MiB copies, our add, SwiGLU and AdamW "
        "loops, a causal FlashAttention block of 512 tokens";
    cpu.destroy();
  }
  return g;
}
