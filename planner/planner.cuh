// planner.cuh: finding the best configuration (Playbook §11). For a model, a sequence length, a
// global batch and a cluster, predict for a layout (dp, tp, pp with its schedule, cp, ZeRO,
// recompute, mbs, grad-acc, dtype) the memory of each GPU by category, the step time split into
// compute, exposed communication per group and bubble, tokens/s per GPU and MFU; then try every
// layout and rank them. The memory side is the closed forms the reports check against measured
// runs (runtime/formulas, model.cu's activation formula, the pipeline's own schedule tables);
// the time side is the alpha-beta cost of the collectives with the overlap conditions of the
// book's appendix A3, and the compute the book's FLOP count. tools/plan.cu is the command line.
#pragma once
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "model.cuh"
#include "pipeline_parallel.cuh"
#include "runtime/comm.cuh"
#include "runtime/meters.cuh"

// ----------------------------------------------------------------------------
// The book's activation formula (Playbook §2.5, §2.6, §5.3, §6; Korthikanti et al. 2022)

// Bytes of `layers` layers' activations for mbs sequences of seq tokens in the book's GPT
// (16-bit activations, LayerNorm, a 4h GeLU MLP, dropout, naive attention): per layer
// s b h (34 + 5 a s / h); with tp: s b h (10 + 24/t + 5 a s/(h t)); with tp + sp: s b h/t
// (34 + 5 a s/h); selective recomputation drops the 5 a s/h term, full keeps 2 s b h (/t under
// sp). picoscale's Llama (RMSNorm, SwiGLU, no dropout, fp32 residual stream) has its own
// constants: model.cu's activation_bytes_per_block.
double book_activation_bytes(int layers, int64_t seq, int64_t mbs, int64_t hidden, int heads,
                             int tp, bool sp, Recompute mode);
// --report memory on the meta device: the book's closed forms for the run's shape (its GPT's
// parameter count, its activations of every layer) beside this Llama's, measured on this rank
// (`blocks` blocks of `block_bytes` each).
void print_book_memory(const ModelConfig& c, int mbs, int seq, int tp, bool sp, Recompute mode,
                       int blocks, int64_t block_bytes);
// Which of the two the planner uses for a block's activations.
enum class ActivationFormula { Llama, Book };
ActivationFormula parse_activation_formula(const std::string& flag);  // llama|book

// ----------------------------------------------------------------------------
// The cluster

// One GPU type (or this machine's CPU): its peak FLOP rate per format, memory, and the bus
// bandwidth and per-step latency of its collectives inside a node and between nodes (ring
// algorithm, nccl-tests' busbw: a ring collective of S bytes over R ranks takes steps x alpha +
// factor x S / busbw). The last four fields are the model's named constants: one set per
// profile, never tuned per configuration.
struct GpuProfile {
  std::string name;
  double peak_bf16 = 0, peak_fp32 = 0, peak_fp8 = 0;  // dense FLOP/s
  double memory = 0;                                  // bytes
  double hbm_bandwidth = 0;                           // bytes/s (the optimizer step)
  // Inside a node (NVLink; on CPU, shared memory): bus bandwidth of all-reduce and of
  // all-gather / reduce-scatter (bytes/s), point-to-point bandwidth, and the latency per ring
  // step of each (bench_comm --fit measures them per collective).
  struct Links {
    double allreduce_bw = 0, gather_bw = 0, p2p_bw = 0, alpha = 0, alpha_gather = 0, alpha_p2p = 0;
  };
  Links intra;
  // The same, measured per group size (bench_comm --fit's groups of 2 and of every rank): a
  // group of a size measured takes its own; any other, `intra`.
  std::map<int, Links> intra_by_size;
  // Between nodes: the bus bandwidth of a ring that leaves the node, which degrades with the
  // ranks R in it (1/busbw = 1/B + c R: congestion, not latency, as the book's 256 MB
  // measurement shows), the latency per ring step, and each GPU's own network bandwidth (a
  // group with k members on a node uses at most k network links).
  double inter_allreduce_bw = 0, inter_gather_bw = 0;
  double inter_allreduce_per_rank = 0, inter_gather_per_rank = 0;  // c, seconds per byte per rank
  double inter_alpha = 0, nic_bw = 0;
  double gemm_half_width = 128;  // a GEMM dimension at which its efficiency halves
  double runtime_bytes = 0;      // the CUDA context and kernels, library workspaces
  // What a caching allocator keeps reserved beyond the peak it has handed out, as a fraction of
  // the activation peak (the tensors that come and go in every size); 0 where none caches.
  double allocator_slack = 0;
  // The roofline's constants (--report roofline, runtime/ledger.cuh's Roofline): the fraction of
  // the peak a wide GEMM reaches, of the peak the attention kernels reach, of the memory
  // bandwidth a streaming kernel reaches, and the time a kernel launch adds; with their source.
  double gemm_efficiency = 0.7, attention_efficiency = 0.35, stream_efficiency = 0.9;
  double launch_s = 3e-6;
  std::string roofline_source;
  // CPU ranks sharing a machine's cores: how many ranks' worth of compute it runs at once
  // (bench_comm --fit measures it); 0: every rank has its own device.
  double shared_capacity = 0;
  std::string source;  // where the numbers come from
};
GpuProfile gpu_profile(const std::string& name);  // h100, h200, a100, cpu; else UsageError
// The alpha and busbw bench_comm --fit measured on this machine's ranks (a JSON file), as the
// profile's links inside a node and, for a one-node cluster, between nodes; for the cpu
// profile also the GEMM rate each rank reached while every rank computed. UsageError naming
// the file when it cannot be read.
void apply_comm_fit(GpuProfile& gpu, const std::string& path);
std::vector<std::string> gpu_profile_names();
double peak_flops(const GpuProfile& gpu, Precision p);
// Throws UsageError naming --dtype and the profiles that have one, when `gpu` has no peak for
// `p` (fp8 on an A100): no step in it can be priced. ./train and ./plan refuse it in these words.
void require_peak(const GpuProfile& gpu, Precision p);

struct Cluster {
  int nodes = 1, gpus_per_node = 8;
  GpuProfile gpu;
  int world() const { return nodes * gpus_per_node; }
};

// How the framework moves activations: picoscale keeps the residual stream in fp32, so tensor,
// context and pipeline parallelism send 4-byte activations (and their gradients); a framework
// whose activations are bf16 (nanotron, the book's campaign) sends 2, as picoscale's pipeline
// does for a layout with --residual-dtype bf16 (Layout::residual).
struct Implementation {
  int activation_wire_bytes = 4;
  // Tensor parallelism's collectives overlapped with the GEMMs around them (asynchronous
  // all-gathers and reduce-scatters, nanotron's and Megatron's): exposed is what the compute
  // does not cover (appendix A3's TP condition). picoscale's are blocking: all exposed.
  bool tp_overlap = false;
  // Pipeline stages balanced by compute cost (nanotron gives the first stage more blocks, as
  // the last holds the LM head); picoscale splits the blocks evenly (pipeline_chunks).
  bool balanced_stages = false;
  bool mpi_sends = false;  // CPU ranks over MPI: a pipeline keeps what it sent until the step ends
  ActivationFormula activations = ActivationFormula::Llama;
};

// ----------------------------------------------------------------------------
// A layout

struct Layout {
  int dp = 1, tp = 1, pp = 1, cp = 1;
  int ep = 1;  // expert parallelism (a mixture's experts over ep of the dp ranks)
  bool sp = false;
  PpSchedule schedule = PpSchedule::OneFOneB;
  int virtual_stages = 1;
  int zero = 0;
  Recompute recompute = Recompute::None;
  int mbs = 1, grad_acc = 1;
  Precision precision = Precision::BF16;
  bool bf16_grads = false;
  DType residual = DType::F32;  // the residual stream's format (--residual-dtype)
  AttentionKind attention = AttentionKind::Flash;
  int world() const { return dp * tp * pp * cp; }
  std::string str() const;    // "dp 4 tp 2 pp 2 (1f1b) cp 1 zero 1 mbs 2 ga 8 bf16 recompute none"
  std::string flags() const;  // the ./train flags that run it
};
// Throws UsageError naming the rule (the same checks ./train makes) when picoscale cannot run
// `l` for this model on the GPUs of profile `gpu` (their kernels' head dims: validate_head_dim).
void validate_layout(const ModelConfig& cfg, const Layout& l, const std::string& gpu);

// ----------------------------------------------------------------------------
// Memory per rank (Playbook §2.4-§2.6, §4.1, §8)

struct RankMemory {
  int stage = 0;                                // pipeline rank
  int64_t num_params = 0, padded_params = 0;    // Ψ of this rank, and Ψ' with ZeRO's padding
  double params = 0, grads = 0, optimizer = 0;  // bytes, exact: the report's formula
  double activations = 0;                       // peak bytes, the schedule walked op by op
  double workspace = 0;                         // transient buffers, approximate
  int peak_in_flight = 0;                       // micro-batch chunks held at the peak
  double static_bytes() const { return params + grads + optimizer; }
  double total() const { return params + grads + optimizer + activations + workspace; }
};
struct MemoryPrediction {
  std::vector<RankMemory> stages;  // one per pipeline rank (every dp, cp, tp rank alike)
  RankMemory worst;                // the stage with the largest total
  double runtime = 0;              // the profile's runtime bytes, per GPU
  double slack = 0;                // the allocator's reserve: allocator_slack x the activations
  double total() const { return worst.total() + runtime + slack; }
};
// `stages`: the pipeline ranks to predict (empty: every one).
// What a GPU holds beyond the tensors: the profile's runtime bytes and its allocator's slack on
// the worst stage's activations (the headroom a layout needs to fit).
void add_headroom(MemoryPrediction& m, const GpuProfile& gpu);
MemoryPrediction predict_memory(const ModelConfig& cfg, const Layout& l, const Implementation& impl,
                                std::vector<int> stages = {});

// ----------------------------------------------------------------------------
// Step time (Playbook §3-§8, appendix A3)

struct StepTime {
  double compute = 0;    // the slowest stage's forwards and backwards (recomputation included)
  double recompute = 0;  // of which recomputation
  double bubble = 0;     // the pipeline's idle time on that stage
  double optimizer = 0;  // once a step on this rank's shard: gradients zeroed, norm, AdamW
  std::map<std::string, double> exposed;  // per group (tp, cp, pp, dp): communication not hidden
  double step = 0;
  double tokens_per_s_per_gpu = 0, mfu = 0;
  bool timed = true;  // false: past predict_time's `above` without its bubble, not simulated
  double exposed_total() const;
};
// The step of `l` on `cluster`; `model_flops_per_token` is the FLOP count MFU divides (the
// book's 6N + 12 L h s, N the parameters a token meets: active_parameter_count). A step whose
// lower bound (its pipeline idle never: its ranks busy end to end) is already past `above`
// seconds is not simulated: `timed` false, `step` that bound (the search skips a layout that
// cannot rank so).
StepTime predict_time(const ModelConfig& cfg, const Layout& l, const Cluster& cluster,
                      const Implementation& impl,
                      double above = std::numeric_limits<double>::infinity());
double book_flops_per_token(const ModelConfig& cfg);

// ----------------------------------------------------------------------------
// The search (Playbook §11.1-§11.3: fit in memory, reach the batch, be fast)

struct SearchSpace {
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<Recompute> recompute = {Recompute::None, Recompute::Selective, Recompute::Full};
  std::vector<PpSchedule> schedules = {PpSchedule::AFAB, PpSchedule::OneFOneB,
                                       PpSchedule::Interleaved, PpSchedule::ZeroBubbleH1};
  std::vector<int> virtual_stages = {2, 4};  // chunks per rank to try where a schedule runs several
  std::vector<Precision> precisions = {Precision::BF16};
  // Residual stream formats to try (--residual-dtype): each that is fp32 or a layout's own
  // compute format (./train refuses the others).
  std::vector<DType> residuals = {DType::F32};
  bool sp = true;        // try tp with and without sequence parallelism
  bool sp_only = false;  // only with it
  bool cp = true;        // try context parallelism
  int max_tp = 0;        // 0: the GPUs of a node
  int max_mbs = 64;
  // A tied model with pp > 1 holds the embedding and the head as two copies (nanotron does;
  // picoscale refuses --tie-embeddings with --pp > 1, so false skips such layouts).
  bool untie_for_pipeline = false;
  // Rank by MFU instead of step time. The same order unless the FLOP count changes between
  // layouts (an untied pipeline counts its embedding and head twice, as the campaign's MFU does).
  bool rank_by_mfu = false;
  // 0: every layout that fits is timed in full (PlanResult::ranked holds them all). K: the K
  // fastest are, in order; a layout whose step without a bubble is already slower than K timed
  // ones is counted slower untimed (the printout and the JSON show at most K).
  int exact_top = 0;
};
struct Candidate {
  Layout layout;
  MemoryPrediction memory;
  StepTime time;
};
struct PlanResult {
  std::vector<Candidate> ranked;  // every layout that fits and reaches the batch, fastest first
  std::map<std::string, int> rejected;                  // why the others lost: reason -> count
  std::map<std::string, std::string> rejected_example;  // reason -> one such layout
  std::map<std::string, std::string> rejected_as;       // reason -> that layout's own words
  int64_t tried = 0;
  double smallest_memory = 0;  // of every valid layout reaching the batch
  std::string error;           // one line when nothing fits or reaches the batch
};
PlanResult plan_layouts(const ModelConfig& cfg, int64_t global_tokens, const Cluster& cluster,
                        const SearchSpace& space, const Implementation& impl);
// The configuration a tied model has under `l` (untied when pp > 1 and the space says so).
ModelConfig layout_model(const ModelConfig& cfg, const Layout& l, const SearchSpace& space);

// The planner's printout of one candidate and of the search (tools/plan.cu).
void print_candidate(int rank, const Candidate& c, const Cluster& cluster);
void print_plan(const PlanResult& r, const ModelConfig& cfg, int64_t global_tokens,
                const Cluster& cluster, const Implementation& impl, int top);

// ----------------------------------------------------------------------------
// MFU of a running job (train.cu's step lines)

// The peak a rank's MFU divides by: with --gpu, or on the meta device, that profile's
// (run_profile); on CUDA the profile of the GPU's name (H100, H200, A100) for the run's format,
// else a measured GEMM rate; on CPU the rate of an sgemm measured now with this rank's threads.
// `how` says which, in words.
struct DevicePeak {
  double flops = 0;
  std::string how;
};
DevicePeak device_peak(const Context& ctx, Precision p, const std::string& profile = "");
// fp32 GEMMs on this rank for `seconds`, 512^3 in turn with as many FLOPs of narrow ones
// ([128, 512] x [512, 512] and [512, 512] x [512, 128]): `flops`, the FLOP/s of the wide ones,
// what this rank gets of the machine meanwhile (bench_comm --fit runs it on every rank at
// once); `half_width`, the gemm_half_width that gives the narrow ones' measured rate.
struct GemmRate {
  double flops = 0, half_width = 0;
};
GemmRate gemm_rate_for(const Context& ctx, double seconds);
// The cpu profile's other rates, measured on this rank as --report roofline measures them: the
// memory bandwidth (64 MiB copies), the fraction of it our memory-bound loops reach (a residual
// add, SwiGLU, AdamW), and the fraction of `peak` (fp32 GEMM FLOP/s) FlashAttention's loop
// reaches. bench_comm --fit writes them beside the GEMM rates, for ./plan --comm-fit.
struct CpuRates {
  double bandwidth = 0, stream_efficiency = 0, attention_efficiency = 0;
};
CpuRates measure_cpu_rates(const Context& ctx, double peak);
// The half width h at which GEMMs of width `narrow` run `ratio` times as fast as those of `wide`
// (planner/time.cu's efficiency w / (w + h)); 0 when they keep up.
double gemm_half_width_from(double ratio, double narrow, double wide);

// ----------------------------------------------------------------------------
// The roofline of a run (--report roofline; planner/roofline.cu)

// The profile a run is priced on: --gpu's (empty: h100 on the meta device, the GPU's own on
// CUDA, this machine's on CPU), with the cpu profile's fp32 rate and memory bandwidth measured
// now (on this rank's threads).
GpuProfile run_profile(const Context& ctx, const std::string& flag);
Roofline roofline_of(const GpuProfile& g);

// What the report needs to know of the run besides the ledger.
struct RooflineRun {
  ModelConfig model;
  Precision precision = Precision::FP32;
  int64_t tokens_per_step = 0;  // the global batch's tokens
  int world = 1, grad_acc = 1, blocks = 0;
  int64_t params = 0;  // Ψ on this rank
  int weight_bytes = 4, grad_bytes = 4;
  bool mixed = false;            // fp32 master weights beside a 16-bit compute copy
  int64_t activation_bytes = 0;  // one micro-batch's saved activations, every block of this rank
  int64_t logit_bytes = 0;       // one micro-batch's logits and their gradient (the last stage)
};
// The training steps' ledger, priced on `gpu` (it sets the ledger's roofline and starts its
// clock); --report roofline prints it per category, each group's communication, the predicted
// step and MFU, the minimum traffic; and what the clock measured on CPU and CUDA.
class RooflineMeter : public StepMeter {
 public:
  // Ranks share a node 8 at a time (the book's nodes); on the cpu profile all are one node.
  RooflineMeter(Comm& comm, const Context& ctx, const GpuProfile& gpu, const RooflineRun& run);
  void begin(StepPart p, int64_t step) override;
  void end(StepPart p) override;
  void report(Report r) override;
  bool answers(Report r) const override { return r == Report::Roofline; }
  // The last step's seconds: on the meta device the prediction, elsewhere `measured`.
  double step_seconds(double measured) const;

 private:
  double group_seconds(const Group& g, const CollStats* delta) const;
  void print_gemm_shapes(const Roofline& roof, double n, bool timed, double timed_steps) const;
  Comm& comm_;
  const Context& ctx_;
  GpuProfile gpu_;
  RooflineRun run_;
  int gpus_per_node_;
  Ledger at_start_, steps_, first_;  // first_: what the first step alone counted
  std::vector<std::vector<CollStats>> groups_at_start_;
  std::vector<double> comm_seconds_, comm_bytes_;
  double last_step_s_ = 0;
  int64_t steps_run_ = 0;
};

// ----------------------------------------------------------------------------
// Models and the book's campaign (Playbook §11.4)

// model.cu's presets, and shapes the planner adds: llama-3b, llama-8b, llama-70b (Llama 3.2 3B,
// 3.1 8B and 70B: the models of the book's memory chapters), and the campaign's book-1b,
// book-3b, book-8b, book-80b: the same shapes without grouped-query attention (kv heads =
// heads), seq 4096 (see docs/planner.md for how they were read off the book's numbers).
ModelConfig planner_model(const std::string& name);
std::vector<std::string> planner_model_names();

// One cell of the book's best-configuration table: the model, the nodes of 8 H100, and the
// book's best layout with what it measured (ran = false: nothing ran there).
struct CampaignCell {
  std::string model;
  int nodes = 1;
  bool ran = false;
  int dp = 1, tp = 1, pp = 1, zero = 0, mbs = 1, grad_acc = 1;
  double mfu = 0, tokens_per_s_per_gpu = 0, memory_gb = 0;
};
// The table as a CSV file: model,nodes,dp,tp,pp,zero,mbs,ga,mfu_percent,tok_s_gpu,mem_gb
// (a row with only model and nodes: nothing ran). UsageError naming the file and line.
std::vector<CampaignCell> read_campaign(const std::string& path);
// What the campaign searched: dp, tp with sequence parallelism, pp under 1F1B, ZeRO 0 and 1,
// mbs and grad-acc, bf16 without recomputation; tied models untied across pipeline stages; bf16
// activations on the wire (nanotron's), FlashAttention; the best layout is the best MFU.
SearchSpace campaign_space();
Implementation campaign_implementation();
struct CampaignVerdict {
  CampaignCell cell;
  bool valid = false;  // picoscale can express the book's layout
  Candidate book;      // the planner's prediction for it
  bool fits = false;
  int rank = 0;     // among the planner's layouts by (dp, tp, pp, zero, mbs, ga); 0: unranked
  Candidate best;   // the planner's own best
  int layouts = 0;  // distinct (dp, tp, pp, zero, mbs, ga) that fit
};
CampaignVerdict judge_campaign_cell(const CampaignCell& cell, const GpuProfile& gpu);
// How the planner's MFU for the book's own layouts follows the book's measured MFU over the
// cells that ran: Spearman's rank correlation (tied values share their mean rank), the median of
// predicted minus measured, and the cells predicted at or above their measurement.
struct CampaignAgreement {
  int cells = 0, at_or_above = 0;
  double spearman = 0, median_gap = 0;
};
CampaignAgreement campaign_mfu_agreement(const std::vector<CampaignVerdict>& verdicts);
// Spearman's rank correlation of two equally long series (2 or more values; 0 when one is
// constant).
double spearman(const std::vector<double>& a, const std::vector<double>& b);
