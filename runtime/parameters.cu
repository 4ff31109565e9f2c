// parameters.cu: the flat parameter buffers and their named views (parameters.cuh), and
// blocks of whole tensors, where tensor-parallel shards come from and go back to.
#include "runtime/parameters.cuh"

std::vector<NamedTensor> named_views(const FlatParameters& p, const Tensor& flat) {
  std::vector<NamedTensor> views;
  for (size_t i = 0; i < p.named_params.size(); i++)
    views.push_back(
        {p.named_params[i].name, flat.view(p.offsets[i], p.named_params[i].tensor.shape)});
  return views;
}

void allocate_flat(FlatParameters& p, Device device, uint64_t seed, DType grad_dtype) {
  int64_t n = p.num_params;
  p.params = empty({n}, Mem::Params, device);
  p.grads = zeros({n}, Mem::Grads, device, grad_dtype);
  for (int u = 0; u < (int)p.units.size(); u++) {
    const ModelUnit& unit = p.units[u];
    p.bind_unit_params(u, p.params.view(unit.offset, {unit.numel}));
    if (grad_dtype == DType::F32) p.bind_unit_grads(u, p.grads.view(unit.offset, {unit.numel}));
  }
  p.init_values(seed, p.params, 0);
}

// ----------------------------------------------------------------------------
// Blocks of a whole row-major tensor

void init_normal_block(const Tensor& shard, uint64_t seed, const std::string& name, float std,
                       int64_t row0, int64_t col0, int64_t full_cols) {
  int64_t rows = shard.dim() > 1 ? shard.size(0) : 1, cols = shard.numel() / rows;
  for (int64_t r = 0; r < rows; r++)  // row r of the shard is a contiguous run of the full tensor
    init_normal(shard.view(r * cols, {cols}), seed, name, std, (row0 + r) * full_cols + col0);
}
static void copy_block(const Tensor& shard, float* full, int64_t row0, int64_t col0,
                       int64_t full_cols, bool into_shard) {
  int64_t rows = shard.dim() > 1 ? shard.size(0) : 1, cols = shard.numel() / rows;
  std::vector<float> host = into_shard ? std::vector<float>(shard.numel()) : to_host_floats(shard);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) {
      float& cell = full[(row0 + r) * full_cols + col0 + c];
      if (into_shard)
        host[r * cols + c] = cell;
      else
        cell = host[r * cols + c];
    }
  if (into_shard) from_host(shard, host.data());
}
void load_block(const Tensor& shard, const float* full, int64_t row0, int64_t col0,
                int64_t full_cols) {
  copy_block(shard, const_cast<float*>(full), row0, col0, full_cols, true);
}
void store_block(const Tensor& shard, float* full, int64_t row0, int64_t col0, int64_t full_cols) {
  copy_block(shard, full, row0, col0, full_cols, false);
}

bool TpSlice::whole(const Tensor& shard) const {
  int64_t n = 1;
  for (int64_t s : full_shape) n *= s;
  return shard.numel() == n;
}
