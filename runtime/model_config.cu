// model_config.cu: the presets, their checks and the closed-form parameter count.
#include <cstdio>

#include "runtime/core.cuh"
#include "runtime/model_config.cuh"

ModelConfig model_preset(const std::string& name) {
  ModelConfig c;
  c.preset = name;
  if (name == "tiny") return c;  // 0.85M parameters: trains in minutes on 2 CPU cores
  if (name == "tiny-moe") {      // tiny with 8 experts of half its ffn, 2 per token: the same
    c.experts = 8, c.top_k = 2, c.ffn = 192;  // expert FLOPs per token, 4x the MLP weights
    return c;
  }
  if (name == "medium") {  // 25M parameters: the CPU benchmark's config
    c.d_model = 512, c.layers = 8, c.heads = 8, c.kv_heads = 4, c.ffn = 1536, c.seq = 256;
    return c;
  }
  if (name == "smollm-135m") {  // SmolLM-135M's shape
    c.vocab = 49152, c.d_model = 576, c.layers = 30, c.heads = 9, c.kv_heads = 3;
    c.ffn = 1536, c.seq = 2048, c.tie_embeddings = true;
    return c;
  }
  if (name == "llama-1b") {  // Llama-3.2-1B's shape
    c.vocab = 128256, c.d_model = 2048, c.layers = 16, c.heads = 32, c.kv_heads = 8;
    c.ffn = 8192, c.seq = 2048, c.rope_theta = 500000.0f, c.tie_embeddings = true;
    return c;
  }
  // The book's and the planner's models at their real size (train them on --device meta, or on
  // a cluster): Llama 3's shapes at seq 4096, and the book's with as many kv heads as heads.
  auto llama3 = [&](int d, int layers, int heads, int ffn, bool tied) {
    c.vocab = 128256, c.d_model = d, c.layers = layers, c.heads = heads, c.kv_heads = 8;
    c.ffn = ffn, c.tie_embeddings = tied, c.rope_theta = 500000.0f, c.seq = 4096;
    return c;
  };
  if (name == "llama-3b") return llama3(3072, 28, 24, 8192, true);
  if (name == "llama-8b") return llama3(4096, 32, 32, 14336, false);
  if (name == "llama-70b") return llama3(8192, 80, 64, 28672, false);
  const std::pair<const char*, const char*> book[] = {{"book-1b", "llama-1b"},
                                                      {"book-3b", "llama-3b"},
                                                      {"book-8b", "llama-8b"},
                                                      {"book-80b", "llama-70b"}};
  for (const auto& [ours, base] : book)
    if (name == ours) {
      ModelConfig b = model_preset(base);
      b.preset = name, b.kv_heads = b.heads, b.seq = 4096;
      return b;
    }
  // The book's GPT (Playbook §2.5: LayerNorm, a GeLU MLP of 4h, dropout 0.1, the embedding
  // tied to the head) at the shapes of the book's activation figures (Llama 3's L, h and a, as
  // many kv heads as heads), whose activations are the book's sbh(34 + 5as/h) per layer.
  const std::pair<const char*, const char*> gpt[] = {
      {"gpt-1b", "book-1b"}, {"gpt-3b", "book-3b"}, {"gpt-8b", "book-8b"}, {"gpt-70b", "book-80b"}};
  for (const auto& [ours, base] : gpt)
    if (name == ours) {
      ModelConfig g = model_preset(base);
      g.preset = name, g.ffn = 4 * g.d_model, g.tie_embeddings = true;
      g.norm = NormKind::LayerNorm, g.mlp = MlpKind::GeLU, g.dropout = 0.1f;
      return g;
    }
  if (name == "mixtral-8x7b") {  // Mixtral-8x7B's shape (its rope_theta 1e6), at seq 4096
    c.vocab = 32000, c.d_model = 4096, c.layers = 32, c.heads = 32, c.kv_heads = 8;
    c.ffn = 14336, c.experts = 8, c.top_k = 2, c.rope_theta = 1e6f, c.seq = 4096;
    return c;
  }
  std::string known;
  for (auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw UsageError("--model " + name + ": unknown preset; choose one of " + known);
}
std::vector<std::string> model_preset_names() {
  return {"tiny",     "tiny-moe",  "medium",  "smollm-135m", "llama-1b",    "llama-3b",
          "llama-8b", "llama-70b", "book-1b", "book-3b",     "book-8b",     "book-80b",
          "gpt-1b",   "gpt-3b",    "gpt-8b",  "gpt-70b",     "mixtral-8x7b"};
}

void check_mixture_flags(const ModelConfig& m, bool top_k_given, bool aux_loss_coef_given) {
  if (m.experts > 0) return;
  auto refuse = [](const std::string& flag, const std::string& does) {
    throw UsageError(flag + " " + does +
                     ", and this model has no experts: add --experts N, or drop " +
                     flag.substr(0, flag.find(' ')));
  };
  if (top_k_given) refuse("--top-k " + std::to_string(m.top_k), "routes tokens to experts");
  char coef[32];
  snprintf(coef, sizeof coef, "%g", m.aux_loss_coef);  // as the user typed it
  if (aux_loss_coef_given)
    refuse(std::string("--aux-loss-coef ") + coef, "weighs a mixture's load-balancing loss");
}

void validate_model_config(const ModelConfig& c) {
  if (!(c.dropout >= 0.0f && c.dropout < 1.0f)) {
    char value[32];
    snprintf(value, sizeof value, "%g", c.dropout);
    throw UsageError(std::string("--dropout ") + value +
                     ": a probability of dropping, from 0 (none) to below 1, e.g. 0.1");
  }
  if (c.experts > 0 && c.mlp == MlpKind::GeLU)
    throw UsageError("--mlp gelu with --experts " + std::to_string(c.experts) +
                     ": a mixture's experts are SwiGLU MLPs (Mixtral's); drop one of the two");
  if (c.experts < 0)
    throw UsageError("--experts " + std::to_string(c.experts) + ": 0 (a dense MLP) or more");
  if (c.experts > 0 && (c.top_k < 1 || c.top_k > c.experts))
    throw UsageError("--top-k " + std::to_string(c.top_k) + " with --experts " +
                     std::to_string(c.experts) + ": each token goes to 1 to " +
                     std::to_string(c.experts) + " experts");
  auto positive = [](int v, const char* flag) {
    if (v <= 0) throw UsageError(std::string(flag) + " " + std::to_string(v) + ": must be > 0");
  };
  positive(c.vocab, "--vocab"), positive(c.d_model, "--d-model"), positive(c.layers, "--layers");
  positive(c.heads, "--heads"), positive(c.kv_heads, "--kv-heads"), positive(c.ffn, "--ffn");
  positive(c.seq, "--seq");
  if (c.d_model % c.heads)
    throw UsageError("--heads " + std::to_string(c.heads) + " does not divide --d-model " +
                     std::to_string(c.d_model) + ": pick a head count that divides it");
  if (c.heads % c.kv_heads)
    throw UsageError("--kv-heads " + std::to_string(c.kv_heads) + " does not divide --heads " +
                     std::to_string(c.heads) +
                     ": grouped-query attention shares each key/value "
                     "head among heads/kv_heads query heads");
  if (c.head_dim() % 2)
    throw UsageError("--d-model / --heads = " + std::to_string(c.head_dim()) +
                     " is odd: RoPE rotates pairs, so the head dimension must be even");
}

// N: int64_t for the count, or double for a count that no shape overflows.
template <typename N>
static N count_parameters(const ModelConfig& c) {
  N V = c.vocab, D = c.d_model, F = c.ffn, hd = c.head_dim();
  const N matrices = c.mlp == MlpKind::GeLU ? 2 : 3;
  N mlp = c.experts > 0 ? c.experts * 3 * D * F + D * c.experts : matrices * D * F;
  const N norm = c.norm == NormKind::LayerNorm ? 2 * D : D;  // LayerNorm's bias
  N block = 2 * norm + D * hd * (2 * c.heads + 2 * c.kv_heads) + mlp;
  return V * D + c.layers * block + norm + (c.tie_embeddings ? 0 : V * D);
}
int64_t parameter_count(const ModelConfig& c) {
  return count_parameters<int64_t>(c);
}
double parameter_count_unbounded(const ModelConfig& c) {
  return count_parameters<double>(c);
}

int64_t expert_parameter_count(const ModelConfig& c) {
  return (int64_t)c.layers * c.experts * 3 * (int64_t)c.d_model * c.ffn;
}

int64_t active_parameter_count(const ModelConfig& c) {
  int64_t experts = expert_parameter_count(c);
  return parameter_count(c) - experts + (c.experts > 0 ? experts / c.experts * c.top_k : 0);
}

std::string active_parameters_note(const ModelConfig& c) {
  if (c.experts == 0) return "";
  char line[160];
  snprintf(line, sizeof line,
           "MFU: N = %lld parameters a token meets (top %d of %d experts per layer) of %lld\n",
           (long long)active_parameter_count(c), c.top_k, c.experts, (long long)parameter_count(c));
  return line;
}
