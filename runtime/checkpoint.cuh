// checkpoint.cuh: Hugging Face Llama checkpoints (config.json + model.safetensors), plus the
// optimizer state and step for an exact resume. Writes are atomic: temporary name, flush,
// rename. Loads validate header, names, shapes, dtypes and sizes, and name what is wrong.
#pragma once
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "runtime/comm.cuh"
#include "runtime/model_config.cuh"
#include "runtime/parameters.cuh"

// safetensors: u64 little-endian header length, JSON header
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, raw data;
// the tensors' data_offsets cover the data exactly, without overlaps or gaps.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// Reads exactly the tensors named in `into` (names, shapes and dtypes must match; extra
// tensors in the file are an error too) and copies them into those tensors (any device). An F32
// destination also takes a BF16 or F16 tensor from the file, widened exactly to fp32.
// Returns the metadata. Throws UsageError: "<path>: tensor <name>: <problem>".
std::map<std::string, std::string> read_safetensors(const std::string& path,
                                                    const std::vector<NamedTensor>& into);

// LlamaConfig keys; for a config --load read (cfg.loaded_config), that config as it was, with
// max_position_embeddings raised to cfg.seq if shorter and, in picoscale's GPT architecture,
// the run's dropout.
nlohmann::json hf_config(const ModelConfig& cfg);
// Whether hf_config(cfg) says which dropout the run trains with: a new config always (one with
// dropout is picoscale's GPT architecture), a loaded one when it is of that architecture
// (transformers' Llama and Mixtral classes have no place for picoscale's dropout).
bool config_records_dropout(const ModelConfig& cfg);
// Validates; keeps the JSON in loaded_config so that a save writes its keys back.
ModelConfig config_from_hf(const nlohmann::json& j, const std::string& path);

// dir/config.json, dir/model.safetensors, dir/optimizer.safetensors (exp_avg, exp_avg_sq per
// parameter, step in the metadata). After a kill at any moment DIR holds the old checkpoint or
// the new one (see save_checkpoint in checkpoint.cu); a symlink DIR is followed, not replaced.
// What else DIR holds (a tokenizer.json, a folder) is kept, as save_pretrained keeps it, but
// for an older checkpoint's weight shards, which the new model.safetensors replaces.
struct OptimizerState {
  std::vector<NamedTensor> exp_avg, exp_avg_sq;  // same names and shapes as the parameters
  int64_t step = 0;                              // optimizer steps taken
  // More of the run's state, for an exact resume (fp16's loss scale): optimizer.safetensors'
  // metadata beside the step. A load fills it with every key the file holds.
  std::map<std::string, std::string> metadata;
};
// weights_dtype F32 (the master weights), BF16 or F16 (rounded to nearest even; config.json's
// torch_dtype says which; a weight past fp16's range is refused, naming it); the optimizer
// state is always F32. Weights past max_shard_bytes are saved as transformers' save_pretrained
// shards them (its default max_shard_size, 5 GB): model-0000k-of-0000n.safetensors, each filled
// in the model's order until the next tensor would pass the limit (a larger tensor alone), and
// model.safetensors.index.json naming each tensor's file.
constexpr uint64_t kMaxShardBytes = 5000000000ull;
void save_checkpoint(const std::string& dir, const ModelConfig& cfg,
                     const std::vector<NamedTensor>& params, const OptimizerState* opt,
                     DType weights_dtype = DType::F32, uint64_t max_shard_bytes = kMaxShardBytes);
DType parse_save_dtype(const std::string& flag);  // --save-dtype fp32|bf16|fp16
// Before the first step: throws UsageError "<flag> <dir>: ..." unless a checkpoint can be saved
// at dir (absent, empty, or an earlier checkpoint; the parent accepts new entries).
void check_checkpoint_output(const std::string& flag, const std::string& dir);
ModelConfig read_checkpoint_config(const std::string& dir);
// Throws UsageError naming dir unless it holds weights picoscale reads (model.safetensors, or
// model.safetensors.index.json and its shards): PyTorch's pickled pytorch_model.bin is named
// as unsupported rather than reported as a missing model.safetensors.
void check_checkpoint_weights(const std::string& dir);
// The optimizer step a --load of dir resumes at, from optimizer.safetensors' header alone
// (0 without one). Throws UsageError when the step is not a non-negative integer.
int64_t checkpoint_step(const std::string& dir);
// Periodic checkpoints (--save-every): DIR/checkpoint-<step>, Hugging Face Trainer's layout,
// each a whole checkpoint written atomically; the final save still goes to DIR itself. A --load
// of DIR reads whichever is furthest along by the step its optimizer state holds (a folder's
// name is not trusted): DIR itself on a tie, else its checkpoint-<step> furthest along.
std::string periodic_checkpoint(const std::string& dir, int64_t step);
// Removes all but the `keep` newest DIR/checkpoint-<step> (keep 0: none removed) of those
// picoscale wrote: a folder holding only what a save writes, its optimizer state at the step its
// name says. Anything else under such a name (the user's own checkpoint-1, a folder with notes
// in it) is neither removed nor counted. Called once a new one is in place, so a kill at any
// moment leaves at least the previous one whole.
void prune_periodic_checkpoints(const std::string& dir, int keep);
// The files a --load of dir reads (config.json, the weights' files, optimizer.safetensors), and
// those a --save of dir writes: for comparing the run's inputs with its outputs.
std::vector<std::string> checkpoint_input_files(const std::string& dir);
std::vector<std::string> checkpoint_output_files(const std::string& dir);
// Loads weights (and, when opt is non-null and the file exists, optimizer state and step).
// Every floating-point value must be finite, and Adam's second moments (exp_avg_sq, running means
// of squares) >= 0: the first tensor that breaks either is named, with the element.
// Returns true when optimizer state was loaded; when opt asks for it and there is none, rank 0
// says that AdamW starts fresh at step 0.
bool load_checkpoint(const std::string& dir, const std::vector<NamedTensor>& params,
                     OptimizerState* opt);

// Whole tensors from any layout (checkpoints, --save-grads). Tensor parallelism: every rank of
// the tp group calls these. whole_tensors: the shards (p.layouts says where each sits)
// assembled into whole tensors on tp rank 0 (on the host); other tp ranks get an empty list.
// One rank: the shards themselves.
std::vector<NamedTensor> whole_tensors(const FlatParameters& p, Group& tp,
                                       const std::vector<NamedTensor>& shards);
// Reads whole tensors and keeps each shard's block: weights into `params`, and the optimizer
// moments into opt's lists when opt is given. Returns true when optimizer state was loaded.
bool load_checkpoint_shards(const FlatParameters& p, Group& tp, const std::string& dir,
                            const std::vector<NamedTensor>& params, OptimizerState* opt);
// Pipeline stages: every stage's tensors together on rank 0 of the pp group `g`, in Hugging
// Face order (the embedding, the blocks by index, the final norm, the LM head); collective
// over g; other ranks get an empty list.
std::vector<NamedTensor> gather_stage_tensors(Group& g, const std::vector<NamedTensor>& mine);
