// bench_step.cu: `make bench`. Times one training step (forward, backward, AdamW) and reports
// tokens/s and achieved GFLOP/s next to this machine's own sgemm rate at the model's GEMM
// shapes, measured in the same run (Playbook §11: MFU is achieved over attainable FLOPs).
// FLOPs per token: 6 N (N = parameters in matmuls, i.e. all but the embedding table) plus
// 12 L T (Hq hd) for the attention scores and values (forward 2 GEMMs, backward 4).
#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/timing.cuh"
#include "model.cuh"
#include "runtime/ops.cuh"
#include "runtime/optimizer.cuh"

struct BenchConfig {
  const char* name;
  ModelConfig model;
  int mbs;
};

static double flops_per_token(const ModelConfig& c, int T) {
  double matmul_params =
      (double)parameter_count(c) - (double)c.vocab * c.d_model * (c.tie_embeddings ? 0 : 1);
  return 6.0 * matmul_params + 12.0 * c.layers * T * c.heads * c.head_dim();
}

// sgemm GFLOP/s over the step's linear-layer GEMMs: forward y = x W^T, backward dx = dy W and
// dW = dy^T x, for every distinct (out, in) shape, weighted by how often the step runs it.
static double sgemm_rate(const Context& ctx, const ModelConfig& c, int tokens) {
  int hd = c.head_dim();
  struct Shape {
    int out, in, count;
  };
  std::vector<Shape> shapes = {
      {c.heads * hd, c.d_model, c.layers}, {c.kv_heads * hd, c.d_model, 2 * c.layers},
      {c.d_model, c.heads * hd, c.layers}, {c.ffn, c.d_model, 2 * c.layers},
      {c.d_model, c.ffn, c.layers},        {c.vocab, c.d_model, 1}};
  double flops = 0, seconds = 0;
  for (const Shape& s : shapes) {
    Tensor x = empty({tokens, s.in}, Mem::Workspace, ctx.device);
    Tensor w = empty({s.out, s.in}, Mem::Workspace, ctx.device);
    Tensor y = empty({tokens, s.out}, Mem::Workspace, ctx.device);
    init_normal(x, 1, "x", 1.0f), init_normal(w, 1, "w", 1.0f), init_normal(y, 1, "y", 1.0f);
    double t = best_seconds(ctx, 3, 1e30, [&] {
      gemm(ctx, false, true, tokens, s.out, s.in, 1, x.f32(), s.in, w.f32(), s.in, 0, y.f32(),
           s.out);
      gemm(ctx, false, false, tokens, s.in, s.out, 1, y.f32(), s.out, w.f32(), s.in, 0, x.f32(),
           s.in);
      gemm(ctx, true, false, s.out, s.in, tokens, 1, y.f32(), s.out, x.f32(), s.in, 1, w.f32(),
           s.in);
    });
    flops += 3 * 2.0 * tokens * s.out * s.in * s.count;
    seconds += t * s.count;
  }
  return flops / seconds / 1e9;
}

static void bench(const Context& ctx, const BenchConfig& b) {
  const ModelConfig& c = b.model;
  Model model = build_model(c, ctx.device, 1);
  AdamMoments moments = adam_moments(model.num_params, ctx.device);
  std::vector<ParamSlice> slices = whole_model_slices(model, moments);
  AdamW adamw;
  int T = c.seq, tokens = b.mbs * T;
  std::vector<int32_t> ids(tokens), targets(tokens);
  for (int i = 0; i < tokens; i++) ids[i] = (i * 31) % c.vocab, targets[i] = (i * 17) % c.vocab;
  double step = best_seconds(ctx, 3, 1e30, [&] {
    Activations acts;
    model_forward(ctx, model, acts, ids.data(), targets.data(), b.mbs, T, Recompute::None);
    model_backward(ctx, model, acts, 1.0f / tokens, Recompute::None);
    adamw.steps++;
    adamw.update(ctx, slices.data(), slices.size(), 1e-4f);
  });
  double gflops = flops_per_token(c, T) * tokens / step / 1e9;
  double sgemm = sgemm_rate(ctx, c, tokens);
  printf("| %-7s | %-4s | %10.1fM | %7d | %9.0f | %8.1f | %12.1f | %6.1f%% |\n", b.name,
         device_name(ctx.device), parameter_count(c) / 1e6, tokens, tokens / step, gflops, sgemm,
         100 * gflops / sgemm);
}

int main() {
  ModelConfig tiny = model_preset("tiny"), medium = model_preset("medium");
  std::vector<BenchConfig> configs = {{"tiny", tiny, 16}, {"medium", medium, 8}};
  std::vector<Device> devices = {Device::CPU};
  if (cuda_available()) devices.push_back(Device::CUDA);
  printf("one training step (forward + backward + AdamW), fp32, recompute none\n");
  printf(
      "| model   | dev  |     params  | tok/step |  tokens/s |  GFLOP/s | sgemm GFLOP/s | "
      "of sgemm |\n");
  printf(
      "|---------|------|-------------|----------|-----------|----------|---------------|"
      "----------|\n");
  for (Device d : devices) {
    Context ctx = Context::create(d);
    for (const BenchConfig& b : configs) bench(ctx, b);
    ctx.destroy();
  }
  printf("target: the medium step reaches 50%% or more of the sgemm rate at its GEMM shapes\n");
  return 0;
}
