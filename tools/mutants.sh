#!/usr/bin/env bash
# Mutation testing (`make mutants`, not part of `make test`): plants one single-line bug at a
# time in a copy of the tree, rebuilds the copy, runs a fast subset of the suite on it, and
# prints which mutants the tests kill. The working tree is never modified; the copy is removed
# on exit (trap), whatever happens.
#
# The fast subset (stops at the first failing step; a mutant that fails one is killed):
#   1. build/unit_tests ~[gpu]~[train]~[parity]         every CPU unit test, [golden] included
#   2. build/mpi_tests ~[gpu] under mpirun -np 2, 3, 4, 8  every CPU MPI test
#   3. build/unit_tests [golden][parity]                ./train on the transformers fixtures
#   4. the parity rows "dp 2, ring", "dp 3, ring", "zero 3, dp 2", "tp 2", "tp 4 (...)",
#      "pp 2, 1f1b" and "cp 2, zigzag, ring"
#      and the one-process checkpoint resumed under tp 2 + sp and tp 4
#   5. the bf16 gradients' layouts and ZeRO-1/2 in bf16 against plain data parallelism
#   6. every report's columns against each other (tests/test_reports.cu, [reports])
#   7. the mixture of experts' unit and one-process tests ([experts]), the parity rows "ep 2 (dp 2)"
#      and "ep 2 x pp 2, 1f1b" (step 3 runs the Mixtral fixture under ep, tp, pp, cp, ZeRO-3)
# Usage: tools/mutants.sh [ID ...]   (no IDs: every mutant)
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
GPU_ARCH=${GPU_ARCH:-"-gencode arch=compute_90,code=sm_90"}

# Each mutant: an id, the file, the exact line (it must occur once), its replacement, and the
# bug it plants.
IDS=() FILES=() LINES=() REPLS=() WHATS=()
mutant() { IDS+=("$1") FILES+=("$2") LINES+=("$3") REPLS+=("$4") WHATS+=("$5"); }
mutant rms-eps runtime/ops.cu \
  '    float r = 1.0f / sqrtf(ss / D + eps);' \
  '    float r = 1.0f / (sqrtf(ss / D) + eps);' \
  "RMSNorm: eps outside the square root"
mutant rope-angle runtime/ops.cu \
  '  for (int i = 0; i < hd / 2; i++) f[i] = 1.0f / powf(theta, (2.0f * i) / hd);' \
  '  for (int i = 0; i < hd / 2; i++) f[i] = 1.0f / powf(theta, (2.0f * i + 1) / hd);' \
  "RoPE: wrong frequencies (forward and backward still agree)"
mutant rope-sign runtime/ops.cu \
  '        v[i + half] = b * c + a * s;' \
  '        v[i + half] = b * c - a * s;' \
  "RoPE: not a rotation"
mutant ce-max runtime/ops.cu \
  '    for (int v = 0; v < V; v++) m = std::max(m, logits[t * V + v]);' \
  '    for (int v = 0; v < V; v++) m = std::max(m, 0.0f);' \
  "cross-entropy: no max shift"
mutant vocab-max-sum tensor_parallel.cu \
  '  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Max);' \
  '  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Sum);' \
  "vocab-parallel cross-entropy: the max reduced as a sum"
mutant vocab-local-max tensor_parallel.cu \
  '  if (tp.size() > 1) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Max);' \
  '  if (false) all_reduce(*tp.comm, tp.group(), ctx, row_max.f32(), N, ReduceOp::Max);' \
  "vocab-parallel cross-entropy: each rank shifts by its own max"
mutant ring-chunk data_parallel.cu \
  '  int send_chunk = ((reducing ? r - s : r + 1 - s) % N + N) % N;' \
  '  int send_chunk = ((r - s) % N + N) % N;' \
  "ring all-reduce: the all-gather sends the wrong chunk"
mutant ring-steps data_parallel.cu \
  '  if (step_ < N - 1) {  // reduce-scatter: add the received partial sum into our chunk' \
  '  if (step_ < N - 2) {  // reduce-scatter: add the received partial sum into our chunk' \
  "ring all-reduce: one reduce step not added"
mutant head-dim-flash runtime/ops.cu \
  '  if (flash && head_dim > kFlashMaxHeadDimCuda)' \
  '  if (flash && head_dim >= kFlashMaxHeadDimCuda)' \
  "CUDA refuses FlashAttention at head dim 128, which its kernels take"
mutant overlap-edge runtime/comm_handle.cu \
  '  return x && y && x < y + b_bytes && y < x + a_bytes;' \
  '  return x && y && x < y + b_bytes - 4 && y < x + a_bytes - 4;' \
  "overlap test misses a shared end element"
mutant overlap-ignored runtime/comm_handle.cu \
  '  if (ctx.device == Device::CUDA || !overlap)' \
  '  if (true)' \
  "in-place collectives hand MPI overlapping buffers"
mutant norm-replicas runtime/gradient_sync.cu \
  '    if (s.counted) grads.push_back(Tensor{nullptr, s.grad, {s.count}, s.grad_dtype, ctx.device});' \
  '    grads.push_back(Tensor{nullptr, s.grad, {s.count}, s.grad_dtype, ctx.device});' \
  "gradient norm counts replicated tensors on every tp rank"
mutant zero-norm runtime/gradient_sync.cu \
  '  if (grads_sharded()) all_reduce_host(comm_.dp_cp, &squares, 1, ReduceOp::Sum);' \
  '  if (grads_sharded()) all_reduce_host(comm_.dp_cp, &squares, 1, ReduceOp::Max);' \
  "ZeRO gradient norm: the largest shard instead of the sum"
mutant kv-writer model.cu \
  '  bool kv_writer = L.tp_rank % L.kv_replicas == 0;' \
  '  bool kv_writer = true;' \
  "replicated kv heads written (and counted) by every replica"
mutant kv-head tensor_parallel.cu \
  '    L.kv_heads = 1, L.kv_replicas = size / c.kv_heads, L.kv_head0 = rank / L.kv_replicas;' \
  '    L.kv_heads = 1, L.kv_replicas = size / c.kv_heads, L.kv_head0 = rank % c.kv_heads;' \
  "tp > kv heads: a rank reads the wrong kv head"
mutant swiglu-order model.cu \
  '    swiglu_forward(ctx, a.act, a.gate, a.up);' \
  '    swiglu_forward(ctx, a.act, a.up, a.gate);' \
  "SwiGLU: gate and up swapped in the forward"
mutant shard-rows runtime/parameters.cu \
  '      float& cell = full[(row0 + r) * full_cols + col0 + c];' \
  '      float& cell = full[(row0 + rows - 1 - r) * full_cols + col0 + c];' \
  "tp shards loaded and saved row-reversed (round trips still pass)"
mutant config-theta runtime/checkpoint.cu \
  '    if (theta != rope->end()) cfg.rope_theta = x;' \
  '    if (false) cfg.rope_theta = x;' \
  "--load ignores rope_parameters.rope_theta (transformers 5)"
mutant config-eps runtime/checkpoint.cu \
  '  cfg.norm_eps = positive_float("rms_norm_eps", true, 0);' \
  '  cfg.norm_eps = 1e-5f;' \
  "--load ignores rms_norm_eps"
mutant pp-warmup pipeline_parallel.cu \
  '  int warmup = std::min(p - rank - 1, m), weights = 0;' \
  '  int warmup = std::min(p - rank, m), weights = 0;' \
  "1F1B: one warm-up forward too many (more activations held than p - rank)"
mutant pp-loss train.cu \
  '  all_reduce_host(t.comm.pp, &loss_sum, 1, ReduceOp::Sum);' \
  '  (void)0;' \
  "pipeline: the loss is not summed over the stages (rank 0 logs 0)"
mutant cp-owner context_parallel.cu \
  '      attend(held, (r - step + P) % P);' \
  '      attend(held, (r + step) % P);' \
  "ring attention: the block held is attributed to the wrong rank (wrong positions, mask)"
mutant bf16-ties runtime/dtype.cu \
  '    if (rest > half || (rest == half && (r & 1))) r++;  // ties to even' \
  '    if (rest >= half) r++;  // ties to even' \
  "rounding to bf16, fp16 and fp8: ties away from zero instead of to even"
mutant lp-output mixed_precision.cu \
  '  if (y.dtype == DType::F32) return round_(ctx, y, output_dtype(ctx.precision));' \
  '  if (y.dtype == DType::F32) return;' \
  "low-precision linear: the output not rounded to bf16/fp16"
mutant lp-weight mixed_precision.cu \
  '  if (!half.defined() && (ctx.precision != Precision::FP8 || role == Operand::Weight))' \
  '  if (!half.defined() && ctx.precision != Precision::FP8 && role != Operand::Weight)' \
  "low-precision linear: the fp32 weights not rounded when no copy is kept"
mutant fp8-grad-format mixed_precision.cu \
  '  const DType fp8 = role == Operand::Gradient ? DType::F8E5M2 : DType::F8E4M3;' \
  '  const DType fp8 = DType::F8E4M3;' \
  "fp8: gradients quantized to E4M3 instead of E5M2"
mutant fp8-wgrad-tiles mixed_precision.cu \
  '    fake_quantize_tiles_(ctx, m, fp8, 128, 1);' \
  '    fake_quantize_tiles_(ctx, m, fp8, 1, 128);' \
  "fp8: the weight gradient reuses the forward's 1 x 128 tiles (scales across its contraction)"
mutant stale-copy mixed_precision.cu \
  '  for (const WeightCopies::Copy& c : ctx.weight_copies->copies) cast_(ctx, c.half, c.master);' \
  '  for (const WeightCopies::Copy& c : ctx.weight_copies->copies) if (!c.half.defined()) cast_(ctx, c.half, c.master);' \
  "mixed precision: the bf16 weights never refreshed from the master weights"
mutant scale-halve mixed_precision.cu \
  '    if (dynamic) scale = std::max(scale / 2, 1.0f);' \
  '    if (dynamic) scale = std::max(scale, 1.0f);' \
  "fp16 loss scaling: the scale not halved on overflow"
mutant mpi-16bit-sum runtime/comm.cu \
  '    b[i] = T == DType::BF16 ? float_to_bf16(r) : float_to_fp16(r);' \
  '    b[i] = T == DType::BF16 ? (uint16_t)(float_to_bf16(r) & 0xFFFE) : float_to_fp16(r);' \
  "bf16 collectives over MPI: sums not rounded to nearest even (last bit dropped)"
mutant bf16-grad-acc runtime/gradient_sync.cu \
  '    cast_(ctx, acc, bf16_unit_(u));  // the bf16 sum so far, exactly' \
  '    zero_(ctx, acc);' \
  "bf16 gradients: a unit's accumulator starts from zero, losing earlier micro-batches"
mutant zero-bf16-gather zero.cu \
  '    if (param_shard_.defined()) cast_(ctx, slice(model_.params, u), master(u));' \
  '    if (param_shard_.defined()) (void)0;' \
  "ZeRO-1/2 in bf16: the updated master slice never rounded into the gathered bf16 weights"
# fp32 accuracy of the attention backward (tests/test_golden.cu's trained fixture): each puts
# back an error in the softmax row term that a trained model's gradients carry 3-5 times over.
mutant attn-row-mean kernels/attention_naive.cu \
  '    const float dot = (float)(weighted / total);' \
  '    const float dot = (float)weighted;' \
  "naive attention backward: <p, dp> not divided by sum p (fp32 p sum to 1 within ulps only)"
mutant flash-d-fp32 flash_attention.cu \
  '    return out_dot_dout_host<double>(D.f32(), dout.f32(), out.f32(), a);' \
  '    return out_dot_dout_host<float>(D.f32(), dout.f32(), out.f32(), a);' \
  "FlashAttention backward: D = rowsum(dO * O) summed in fp32"
# The bf16 FlashAttention-2 kernels' CPU mirrors and the matmul ladder's tensor-core mirror (the
# GPU tests hold the kernels to these, so a wrong mirror would pass a wrong kernel).
mutant fa2-mirror-mask kernels/flash_attention_bf16.cu \
  '            if (j0 + c >= seen) continue;' \
  '            if (j0 + c > seen) continue;' \
  "FlashAttention-2 forward mirror: each query also sees the key after its last"
mutant fa2-mirror-d kernels/flash_attention_bf16.cu \
  '            const float pb = to_bf16_value(f * p), dsb = to_bf16_value(p * (f * dp - Di));' \
  '            const float pb = to_bf16_value(f * p), dsb = to_bf16_value(p * (f * dp - 0.99f * Di));' \
  "FlashAttention-2 backward mirror: dS from a D 1% off"
mutant ladder-tc-slice kernels/matmul_ladder.cu \
  '        for (int k = k0; k < k0 + 16 && k < K; k++)' \
  '        for (int k = k0; k < k0 + 15 && k < K; k++)' \
  "matmul ladder, tensor-core mirror: one product of every 16 dropped"
# Data boundaries (runtime/data.cu): each breaks only at a split length, window or epoch edge.
mutant data-windows runtime/data.cu \
  '  const int64_t span = n_train - seq, windows = (n_train - 1) / seq;' \
  '  const int64_t span = n_train - seq, windows = n_train / seq;' \
  "shuffled order: one window too many when --seq divides the split (reads past its end)"
mutant data-windows-few runtime/data.cu \
  '  const int64_t span = n_train - seq, windows = (n_train - 1) / seq;' \
  '  const int64_t span = n_train - seq, windows = (n_train - 2) / seq;' \
  "shuffled order: the last window never read when --seq divides the split minus one"
mutant data-span runtime/data.cu \
  '  const int64_t span = n_train - seq, windows = (n_train - 1) / seq;' \
  '  const int64_t span = n_train - seq - 1, windows = (n_train - 1) / seq;' \
  "file order: wraps one start early (the last start that fits never read)"
mutant data-epoch runtime/data.cu \
  '        shuffle ? seq * shuffled_window(k % windows, windows, seed, k / windows) : (k * seq) % span;' \
  '        shuffle ? seq * shuffled_window(k % windows, windows, seed, 0) : (k * seq) % span;' \
  "shuffled order: every epoch in the first epoch's order"
mutant data-val-windows runtime/data.cu \
  '  return ((int64_t)data.val.size() - 1) / seq;  // each window needs seq + 1 tokens' \
  '  return ((int64_t)data.val.size()) / seq;  // each window needs seq + 1 tokens' \
  "validation: one window too many when --seq divides the val split (reads past its end)"
mutant data-val-round runtime/data.cu \
  '  return (int64_t)(n * val_fraction);' \
  '  return (int64_t)std::ceil(n * val_fraction);' \
  "--val-frac: the val split rounded up instead of down"
mutant data-min-tokens runtime/data.cu \
  '  int64_t n = (int64_t)std::max({2 * need, need / val_fraction, seq / (1.0 - val_fraction)}) - 2;' \
  '  int64_t n = (int64_t)std::max({2 * need, need / val_fraction, seq / (1.0 - val_fraction)}) + 1;' \
  "too-small data: the message asks for one token more than the smallest file that loads"
mutant data-shard-size runtime/data.cu \
  '    else if (count < 0 || size != kShardHeaderBytes + 2 * count)' \
  '    else if (count < 0 || size < kShardHeaderBytes + 2 * count)' \
  "llm.c shard: bytes after the promised tokens accepted"
# Report columns (tests/test_reports.cu): each leaves the run's numbers alone and makes one
# printed column disagree with the others, which only a test that reads the columns back sees.
mutant zero-expected-acc runtime/formulas.cu \
  '  int reduces = stage == 1 ? 1 : grad_acc;' \
  '  int reduces = 1;' \
  "ZeRO's expected reduce-scatters: once per step at every stage (ZeRO-2/3 reduce per micro-batch)"
mutant zero-expected-head runtime/formulas.cu \
  '    for (int u = 0; u < units - 1; u++)  // the last unit: resident since its forward' \
  '    for (int u = 0; u < units; u++)  // the last unit: resident since its forward' \
  "ZeRO-3's expected all-gathers: the head gathered again for its backward"
mutant zero-report-total runtime/report.cu \
  '         (long long)(want.reduce_scatter_bytes + want.all_gather_bytes));' \
  '         (long long)(want.reduce_scatter_bytes + want.reduce_scatter_bytes));' \
  "ZeRO table: the expected total counts the reduce-scatters twice, the all-gathers never"
mutant tp-report-acc runtime/report.cu \
  '           human_bytes((double)expected * grad_acc).c_str(),' \
  '           human_bytes((double)expected).c_str(),' \
  "tp table: the model's count printed for one micro-batch, not for grad-acc of them"
mutant memory-book-padded runtime/report.cu \
  '  StaticMemory book = zero_static_memory(zero_stage, (double)num_params, N, b);' \
  '  StaticMemory book = zero_static_memory(zero_stage, (double)padded_params, N, b);' \
  "memory table: the book's row at Ψ' (the padding hidden in it)"
mutant bubble-book-chunks planner/pipeline_timing.cu \
  '          bubble_fraction(s, p, m, V),' \
  '          bubble_fraction(s, p, m, 1),' \
  "bubble table: the book's column ignores interleaving's V chunks"
mutant dp-report-book runtime/report.cu \
  '        human_bytes(2.0 * (N - 1) * K / N).c_str());' \
  '        human_bytes(2.0 * (N - 1) * K / (N - 1)).c_str());' \
  "comm table: the book's ring all-reduce 2(N-1)K/N printed as 2K"
mutant comm-all-reduce-bytes runtime/comm.cu \
  '  count_call(g, Coll::AllReduce, count, 2 * (N - 1) * K / N);' \
  '  count_call(g, Coll::AllReduce, count, (N - 1) * K / N);' \
  "comm table: an all-reduce charged as a reduce-scatter's bytes, half the ring's"
mutant balance-pairs context_parallel.cu \
  '        if (work) work->blocks++, work->pairs += pairs;' \
  '        if (work) work->blocks++, work->pairs += (int64_t)mine[qp].length * keys[kp].length;' \
  "balance table: a block's pairs counted as its whole rectangle, not the causal ones"
# Expert parallelism (expert_parallel.cu; tests/test_experts.cu and the Mixtral fixture).
mutant moe-ties expert_parallel.cu \
  '        if (best < 0 || p[e] > p[best]) best = e;' \
  '        if (best < 0 || p[e] >= p[best]) best = e;' \
  "routing: equal probabilities go to the higher expert index"
mutant moe-renorm expert_parallel.cu \
  '    for (int j = 0; j < k; j++) r.weight[(size_t)t * k + j] = (float)(p[chosen[j]] / picked);' \
  '    for (int j = 0; j < k; j++) r.weight[(size_t)t * k + j] = p[chosen[j]];' \
  "routing: the top-k weights not renormalised (Switch's, not Mixtral's)"
mutant moe-capacity expert_parallel.cu \
  '        if (taken[r.choice[i]] < capacity)' \
  '        if (taken[r.choice[i]] <= capacity)' \
  "capacity: each expert keeps one slot more than c x tokens x k / E"
mutant moe-route-back kernels/router.cuh \
  '      if (chosen[j] == e) dp += (slot_weight_gradient(d_weight, slot_row, j) - dot) / picked;' \
  '      if (chosen[j] == e) dp += slot_weight_gradient(d_weight, slot_row, j) / picked;' \
  "router backward: the renormalisation's shared term left out"
mutant moe-aux-grad expert_parallel.cu \
  '          (float)(c.aux_loss_coef * (double)loss_scale * tokens * E * totals[e] / (rows * rows)));' \
  '          (float)(c.aux_loss_coef * (double)loss_scale * tokens * totals[e] / (rows * rows)));' \
  "load-balancing loss: its gradient without the factor E"
mutant moe-dispatch-rows expert_parallel.cu \
  '      d.expert_rows[j] += recv[s * L + j];' \
  '      d.expert_rows[j] += send[s * L + j];' \
  "dispatch: each local expert computes as many rows as this rank sent it, not received"
mutant moe-tp-weights expert_parallel.cu \
  '  if (tp.size() > 1 && K > 0)' \
  '  if (false && K > 0)' \
  "mixture under tp: the combine weights' gradient left a partial sum"
mutant moe-router-dx expert_parallel.cu \
  '  linear_backward(ctx, tp.rank() == 0 ? dh : Tensor(), now(g.router), d_logits, h, w.router, true);' \
  '  linear_backward(ctx, dh, now(g.router), d_logits, h, w.router, true);' \
  "mixture under tp: the router's input gradient added on every tp rank"
mutant moe-pp-carry model.cu \
  '  acts.carry = take_carry(in);' \
  '  (void)take_carry(in);' \
  "pipeline: the routing counts of every layer not handed to the last stage's backward"
mutant moe-edp-group runtime/gradient_sync.cuh \
  '  Group& group_of(int u) const { return model_.units[u].experts ? comm_.edp_cp : comm_.dp_cp; }' \
  '  Group& group_of(int u) const { return comm_.dp_cp; }' \
  "expert parallelism: expert gradients summed over dp_cp (other ranks' experts added in)"

# Runs one step of the subset; on failure prints the step and the test files whose checks
# failed (or "crashed" when there are none: an abort, a timeout).
step() {  # name, command...
  local name=$1 files
  shift
  "$@" >step.log 2>&1 && return 0
  files=$(grep -aoE "^[^ :]+\.cuh?:[0-9]+: FAILED" step.log | cut -d: -f1 | sort -u | tr '\n' ' ')
  echo "$name (${files:-crashed}${files:+failed})"
  return 1
}
# Runs the fast subset in the copy; returns 0 when every step passes (the mutant survives).
subset() {
  local np row
  step "unit tests" build/unit_tests "~[gpu]~[train]~[parity]~[sweep]~[record]~[report_width]" || return 1
  for np in 2 3 4 8; do
    step "mpi tests, np $np" mpirun --oversubscribe -np "$np" build/mpi_tests "~[gpu]" --use-colour no || return 1
  done
  step "golden ./train runs" build/unit_tests "[golden][parity]" || return 1
  for row in "dp 2, ring" "dp 3, ring" "zero 3, dp 2" "tp 2" "tp 4 (2 kv heads: each replicated on 2 ranks)" \
             "pp 2, 1f1b" "cp 2, zigzag, ring"; do
    step "parity: $row" build/unit_tests "every layout trains like its single-process reference" -c "$row" || return 1
  done
  step "parity: resume under tp" build/unit_tests "a one-process checkpoint resumes under tp 2 + sp and tp 4 like the run it left" || return 1
  step "bf16 state" build/unit_tests "bf16 gradients: data*,ZeRO-1/2 in bf16*" || return 1
  step "report columns" build/unit_tests "[reports]" || return 1
  step "experts" build/unit_tests "[experts]~[parity]" || return 1
  for row in "ep 2 (dp 2)" "ep 2 x pp 2, 1f1b"; do
    step "parity: $row" build/unit_tests "every layout trains like its single-process reference" -c "$row" || return 1
  done
}

WORK=$(mktemp -d /tmp/picoscale-mutants-XXXXXX)
trap 'rm -rf "$WORK"' EXIT INT TERM
export OMPI_MCA_btl_vader_single_copy_mechanism=none OPENBLAS_NUM_THREADS=1
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

# The copy: sources, tests, fixtures and the current build (so a mutant recompiles one file),
# built unmutated first (everything, when this tree was built with another GPU_ARCH).
tar --exclude=.git -cf - . | tar -C "$WORK" -xf -
(cd "$WORK" && make -j2 GPU_ARCH="$GPU_ARCH" train build/unit_tests build/mpi_tests >build.log 2>&1) ||
  { echo "the unmutated tree does not build (see make's output)"; exit 1; }
echo "unmutated copy built; checking that the fast subset passes on it"
if ! step=$(cd "$WORK" && subset); then echo "the unmutated tree fails: $step"; exit 1; fi

selected=" $* "
killed=0 total=0 survivors=()
printf "%-16s %-8s %s\n" "mutant" "result" "what it breaks: the first step that failed (the test files that failed)"
for k in "${!IDS[@]}"; do
  id=${IDS[k]} file=${FILES[k]}
  if [ $# -gt 0 ] && [[ $selected != *" $id "* ]]; then continue; fi
  if [ "$(grep -cxF -- "${LINES[k]}" "$WORK/$file")" != 1 ]; then
    printf "%-16s %-8s %s\n" "$id" "STALE" "the line is not in $file exactly once: update the mutant"
    continue
  fi
  total=$((total + 1))
  # A .cu file's object is kept and put back after; a header's dependents are rebuilt instead.
  obj=""
  if [[ $file == *.cu ]]; then obj=$WORK/build/${file%.cu}.o && cp -p "$obj" "$WORK/saved.o"; fi
  LINE=${LINES[k]} REPL=${REPLS[k]} awk '$0 == ENVIRON["LINE"] { print ENVIRON["REPL"]; next } { print }' \
    "$ROOT/$file" >"$WORK/$file"
  if ! (cd "$WORK" && make -j2 GPU_ARCH="$GPU_ARCH" train build/unit_tests build/mpi_tests >build.log 2>&1); then
    result=KILLED step="does not compile"
  elif step=$(cd "$WORK" && subset); then
    result=SURVIVED step="(every step passed)"
    survivors+=("$id")
  else
    result=KILLED
  fi
  [ "$result" = KILLED ] && killed=$((killed + 1))
  printf "%-16s %-8s %s: %s\n" "$id" "$result" "${WHATS[k]}" "$step"
  # Back to the unmutated file and object (older than the binaries: relink them next time).
  cp -p "$ROOT/$file" "$WORK/$file"
  if [ -n "$obj" ]; then cp -p "$WORK/saved.o" "$obj"; else touch "$WORK/$file"; fi
  rm -f "$WORK/train" "$WORK/build/unit_tests" "$WORK/build/mpi_tests"
done
[ "$total" -gt 0 ] && echo "killed $killed of $total mutants ($((100 * killed / total))%)${survivors:+; survived: ${survivors[*]}}"
[ "${#survivors[@]}" -eq 0 ]
