// parity_rows.cuh: the parity matrix's layouts (DESIGN 8), shared by the fp32 matrix
// (test_parity.cu) and its bf16 run (test_precision_parity.cu). Adding a layout is one row.
#pragma once
#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "launch.cuh"

struct ParityRow {
  std::string name;
  int ranks;              // mpirun -np
  std::string layout;     // flags of the parallel run
  std::string reference;  // flags of its single-process equivalent (DESIGN 5)
};

// The book's GPT block's flags (a row adds its layout), with FlashAttention (the default) or naive.
inline const std::string GPT_BLOCK = "--norm layernorm --mlp gelu --dropout 0.1 ";
inline const std::string GPT_BLOCK_NAIVE = GPT_BLOCK + "--attention naive ";

// dp d with grad-acc g reads the same global batch as one process with grad-acc d*g.
inline const std::vector<ParityRow> PARITY_ROWS = {
    {"dp 2, naive", 2, "--dp 2 --dp-sync naive", "--grad-acc 2"},
    {"dp 2, bucket", 2, "--dp 2 --dp-sync bucket", "--grad-acc 2"},
    {"dp 2, ring", 2, "--dp 2 --dp-sync ring", "--grad-acc 2"},
    {"dp 3, naive", 3, "--dp 3 --dp-sync naive", "--grad-acc 3"},
    {"dp 3, bucket", 3, "--dp 3 --dp-sync bucket", "--grad-acc 3"},
    {"dp 3, ring", 3, "--dp 3 --dp-sync ring", "--grad-acc 3"},
    {"dp 4, naive", 4, "--dp 4 --dp-sync naive", "--grad-acc 4"},
    {"dp 4, bucket", 4, "--dp 4 --dp-sync bucket", "--grad-acc 4"},
    {"dp 4, ring", 4, "--dp 4 --dp-sync ring", "--grad-acc 4"},
    {"dp 2, grad-acc 2", 2, "--dp 2 --grad-acc 2", "--grad-acc 4"},
    {"dp 2, buckets that split neighbours", 2, "--dp 2 --bucket-mb 0.01", "--grad-acc 2"},
    {"dp 2, ring, buckets that split neighbours", 2, "--dp 2 --dp-sync ring --bucket-mb 0.003",
     "--grad-acc 2"},
    // ZeRO (Playbook §4): any group size; dp 3 pads every unit's shards. Stages 2 and 3
    // reduce-scatter every micro-batch and accumulate into the shard.
    {"zero 1, dp 2", 2, "--zero 1 --dp 2", "--grad-acc 2"},
    {"zero 1, dp 2, grad-acc 2", 2, "--zero 1 --dp 2 --grad-acc 2", "--grad-acc 4"},
    {"zero 1, dp 3", 3, "--zero 1 --dp 3", "--grad-acc 3"},
    {"zero 1, dp 3, grad-acc 2", 3, "--zero 1 --dp 3 --grad-acc 2", "--grad-acc 6"},
    {"zero 1, dp 4", 4, "--zero 1 --dp 4", "--grad-acc 4"},
    {"zero 1, dp 4, grad-acc 2", 4, "--zero 1 --dp 4 --grad-acc 2", "--grad-acc 8"},
    {"zero 2, dp 2", 2, "--zero 2 --dp 2", "--grad-acc 2"},
    {"zero 2, dp 2, grad-acc 2", 2, "--zero 2 --dp 2 --grad-acc 2", "--grad-acc 4"},
    {"zero 2, dp 3", 3, "--zero 2 --dp 3", "--grad-acc 3"},
    {"zero 2, dp 3, grad-acc 2", 3, "--zero 2 --dp 3 --grad-acc 2", "--grad-acc 6"},
    {"zero 2, dp 4", 4, "--zero 2 --dp 4", "--grad-acc 4"},
    {"zero 2, dp 4, grad-acc 2", 4, "--zero 2 --dp 4 --grad-acc 2", "--grad-acc 8"},
    {"zero 3, dp 2", 2, "--zero 3 --dp 2", "--grad-acc 2"},
    {"zero 3, dp 2, grad-acc 2", 2, "--zero 3 --dp 2 --grad-acc 2", "--grad-acc 4"},
    {"zero 3, dp 3", 3, "--zero 3 --dp 3", "--grad-acc 3"},
    {"zero 3, dp 3, grad-acc 2", 3, "--zero 3 --dp 3 --grad-acc 2", "--grad-acc 6"},
    {"zero 3, dp 4", 4, "--zero 3 --dp 4", "--grad-acc 4"},
    {"zero 3, dp 4, grad-acc 2", 4, "--zero 3 --dp 4 --grad-acc 2", "--grad-acc 8"},
    // Tied embeddings: the head writes the embedding's gradient and (stage 3) gathers its weights.
    {"zero 2, dp 3, tied embeddings", 3, "--zero 2 --dp 3 --tie-embeddings",
     "--grad-acc 3 --tie-embeddings"},
    {"zero 3, dp 2, tied embeddings, full recompute", 2,
     "--zero 3 --dp 2 --tie-embeddings --recompute full",
     "--grad-acc 2 --tie-embeddings --recompute full"},
    {"zero 3, dp 3, no overlap (no prefetch)", 3, "--zero 3 --dp 3 --no-overlap", "--grad-acc 3"},
    // Tensor and sequence parallelism: the same batch, so the reference is one plain process.
    {"tp 2", 2, "--tp 2", ""},
    {"tp 4 (2 kv heads: each replicated on 2 ranks)", 4, "--tp 4", ""},
    {"tp 2, sp", 2, "--tp 2 --sp", ""},
    {"tp 4, sp", 4, "--tp 4 --sp", ""},
    {"tp 2, one kv head (fewer kv heads than tp)", 2, "--tp 2 --kv-heads 1", "--kv-heads 1"},
    {"tp 2, sp, full recompute", 2, "--tp 2 --sp --recompute full", "--recompute full"},
    {"tp 2, tied embeddings, selective recompute", 2,
     "--tp 2 --tie-embeddings --recompute selective", "--tie-embeddings --recompute selective"},
    {"dp 2 x tp 2", 4, "--dp 2 --tp 2", "--grad-acc 2"},
    {"dp 2 x tp 2, zero 1", 4, "--dp 2 --tp 2 --zero 1", "--grad-acc 2"},
    {"dp 2 x tp 2, sp, zero 3, grad-acc 2", 4, "--dp 2 --tp 2 --sp --zero 3 --grad-acc 2",
     "--grad-acc 4"},
    // Pipeline parallelism (Playbook §8): the step's micro-batches (grad-acc) flow through the
    // stages in the schedule's order; the reference is one process with the same micro-batches.
    {"pp 2, afab", 2, "--pp 2 --pp-schedule afab --grad-acc 4", "--grad-acc 4"},
    {"pp 2, 1f1b", 2, "--pp 2 --pp-schedule 1f1b --grad-acc 4", "--grad-acc 4"},
    {"pp 2, interleaved, 2 chunks per rank (4 layers)", 2,
     "--layers 4 --pp 2 --pp-schedule interleaved --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 4, afab (4 layers)", 4, "--layers 4 --pp 4 --pp-schedule afab --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 4, 1f1b (4 layers)", 4, "--layers 4 --pp 4 --grad-acc 4", "--layers 4 --grad-acc 4"},
    {"pp 4, 1f1b, fewer micro-batches than stages", 4, "--layers 4 --pp 4 --grad-acc 2",
     "--layers 4 --grad-acc 2"},
    {"pp 4, interleaved, 2 chunks per rank (8 layers)", 4,
     "--layers 8 --pp 4 --pp-schedule interleaved --pp-virtual 2 --grad-acc 4",
     "--layers 8 --grad-acc 4"},
    // Zero bubble (§8.6): the backward split into input gradient (B) and weight gradient (W).
    {"pp 2, zb-h1", 2, "--pp 2 --pp-schedule zb-h1 --grad-acc 4", "--grad-acc 4"},
    {"pp 4, zb-h1 (4 layers)", 4, "--layers 4 --pp 4 --pp-schedule zb-h1 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 2 x tp 2, sp, zb-h1, one kv head (replicated)", 4,
     "--pp 2 --tp 2 --sp --kv-heads 1 --pp-schedule zb-h1 --grad-acc 2",
     "--kv-heads 1 --grad-acc 2"},
    {"pp 2 x dp 2, zb-h1, zero 1", 4, "--pp 2 --dp 2 --zero 1 --pp-schedule zb-h1 --grad-acc 2",
     "--grad-acc 4"},
    // The V (§8.6): two chunks per rank, chunk 1 back up the ranks. ZB-V (B and W apart, the
    // zero-bubble paper's) and DualPipeV (DeepSeek-V3's F&B pairs; m >= 2p, and below it the
    // tables of 2p less the missing micro-batches), with dp, tp + sp and experts (ep).
    {"pp 2, zb-v (4 layers)", 2, "--layers 4 --pp 2 --pp-schedule zb-v --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 4, zb-v (8 layers)", 4, "--layers 8 --pp 4 --pp-schedule zb-v --pp-virtual 2 --grad-acc 4",
     "--layers 8 --grad-acc 4"},
    {"pp 2 x dp 2, zb-v", 4,
     "--layers 4 --pp 2 --dp 2 --pp-schedule zb-v --pp-virtual 2 --grad-acc 2",
     "--layers 4 --grad-acc 4"},
    {"pp 2 x tp 2, sp, zb-v", 4,
     "--layers 4 --pp 2 --tp 2 --sp --pp-schedule zb-v --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 2, dualpipev (4 layers)", 2,
     "--layers 4 --pp 2 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    {"pp 2, dualpipev, fewer micro-batches than 2p", 2,
     "--layers 4 --pp 2 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 2",
     "--layers 4 --grad-acc 2"},
    {"pp 4, dualpipev (8 layers, 2p micro-batches of one sequence)", 4,
     "--layers 8 --pp 4 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 8 --mbs 1",
     "--layers 8 --grad-acc 8 --mbs 1"},
    {"pp 2 x dp 2, dualpipev", 4,
     "--layers 4 --pp 2 --dp 2 --pp-schedule dualpipev --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 8"},
    {"pp 2 x tp 2, sp, dualpipev", 4,
     "--layers 4 --pp 2 --tp 2 --sp --pp-schedule dualpipev --pp-virtual 2 --grad-acc 4",
     "--layers 4 --grad-acc 4"},
    // Context parallelism (Playbook §7): every rank holds seq / cp tokens of each sequence.
    {"cp 2, zigzag, ring", 2, "--cp 2", ""},
    {"cp 2, contiguous, ring", 2, "--cp 2 --cp-balance contiguous", ""},
    {"cp 2, zigzag, all-gather", 2, "--cp 2 --cp-comm allgather", ""},
    {"cp 4, zigzag, ring", 4, "--cp 4", ""},
    {"cp 4, contiguous, all-gather", 4, "--cp 4 --cp-balance contiguous --cp-comm allgather", ""},
    {"cp 2 x dp 2", 4, "--cp 2 --dp 2", "--grad-acc 2"},
    {"cp 2 x tp 2, sp", 4, "--cp 2 --tp 2 --sp", ""},
    {"cp 2 x dp 2, zero 3", 4, "--cp 2 --dp 2 --zero 3", "--grad-acc 2"},
    {"cp 2 x pp 2", 4, "--cp 2 --pp 2 --grad-acc 2", "--grad-acc 2"},
    {"cp 2 x tp 2, sp x pp 2 (8 ranks: four dimensions at once)", 8,
     "--cp 2 --tp 2 --sp --pp 2 --grad-acc 2", "--grad-acc 2"},
    {"cp 2, full recompute (the ring runs again in the backward)", 2, "--cp 2 --recompute full",
     "--recompute full"},
    {"pp 2, 5 layers (3 + 2)", 2, "--layers 5 --pp 2 --grad-acc 2", "--layers 5 --grad-acc 2"},
    {"pp 2 x dp 2", 4, "--pp 2 --dp 2 --grad-acc 2", "--grad-acc 4"},
    {"pp 2 x tp 2, sp", 4, "--pp 2 --tp 2 --sp --grad-acc 2", "--grad-acc 2"},
    {"pp 2 x dp 2 x tp 2", 8, "--pp 2 --dp 2 --tp 2 --grad-acc 2", "--grad-acc 4"},
    {"pp 2 x dp 2, zero 1", 4, "--pp 2 --dp 2 --zero 1 --grad-acc 2", "--grad-acc 4"},
    {"pp 2 x dp 2, zero 2, full recompute", 4,
     "--pp 2 --dp 2 --zero 2 --recompute full --grad-acc 2", "--grad-acc 4 --recompute full"},
    // Expert parallelism (Playbook, EP): 4 experts, top 2, in every block. ep carves its groups
    // out of dp, so the reference reads dp's global batch; the experts' gradients are summed
    // over the ranks holding the same experts (edp_cp), the dense ones over dp_cp.
    {"experts, dp 2 (every expert on every rank)", 2, "--experts 4 --top-k 2 --dp 2",
     "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 2 (dp 2)", 2, "--experts 4 --top-k 2 --dp 2 --ep 2", "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 4 (dp 4)", 4, "--experts 4 --top-k 2 --dp 4 --ep 4", "--experts 4 --top-k 2 --grad-acc 4"},
    {"ep 2, dp 4, grad-acc 2", 4, "--experts 4 --top-k 2 --dp 4 --ep 2 --grad-acc 2",
     "--experts 4 --top-k 2 --grad-acc 8"},
    {"ep 2, top 1 of 2 experts", 2, "--experts 2 --top-k 1 --dp 2 --ep 2",
     "--experts 2 --top-k 1 --grad-acc 2"},
    {"ep 2, capacity factor 1 (overflow dropped)", 2,
     "--experts 4 --top-k 2 --dp 2 --ep 2 --capacity-factor 1",
     "--experts 4 --top-k 2 --grad-acc 2 --capacity-factor 1"},
    {"ep 2, zero 1", 2, "--experts 4 --top-k 2 --dp 2 --ep 2 --zero 1",
     "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 2, zero 2", 2, "--experts 4 --top-k 2 --dp 2 --ep 2 --zero 2",
     "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 2, zero 3", 2, "--experts 4 --top-k 2 --dp 2 --ep 2 --zero 3",
     "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 2 x tp 2, sp", 4, "--experts 4 --top-k 2 --dp 2 --ep 2 --tp 2 --sp",
     "--experts 4 --top-k 2 --grad-acc 2"},
    {"ep 2 x pp 2, 1f1b", 4, "--experts 4 --top-k 2 --dp 2 --ep 2 --pp 2 --grad-acc 2",
     "--experts 4 --top-k 2 --grad-acc 4"},
    {"ep 2 x pp 2, zb-h1", 4,
     "--experts 4 --top-k 2 --dp 2 --ep 2 --pp 2 --pp-schedule zb-h1 --grad-acc 2",
     "--experts 4 --top-k 2 --grad-acc 4"},
    {"ep 2 x pp 2, zb-v (4 layers)", 4,
     "--experts 4 --top-k 2 --dp 2 --ep 2 --layers 4 --pp 2 --pp-schedule zb-v --pp-virtual 2 "
     "--grad-acc 2",
     "--experts 4 --top-k 2 --layers 4 --grad-acc 4"},
    {"ep 2 x pp 2, dualpipev (4 layers)", 4,
     "--experts 4 --top-k 2 --dp 2 --ep 2 --layers 4 --pp 2 --pp-schedule dualpipev "
     "--pp-virtual 2 --grad-acc 4",
     "--experts 4 --top-k 2 --layers 4 --grad-acc 8"},
    {"ep 2 x cp 2", 4, "--experts 4 --top-k 2 --dp 2 --ep 2 --cp 2",
     "--experts 4 --top-k 2 --grad-acc 2"},
    // The book's GPT block (Playbook §2.5): LayerNorm, GeLU, dropout on attention's
    // probabilities and on both branches' outputs. Each mask is drawn from where it is in the
    // run (the sequence's number, the position, the head), so any layout drops what one process
    // drops: the rows below hold only if it does. Naive attention stores the masks; flash draws
    // them again in its tiles, and a cp ring's blocks draw those of their global positions.
    {"GPT block, dp 2", 2, GPT_BLOCK + "--dp 2", GPT_BLOCK + "--grad-acc 2"},
    {"GPT block, naive attention, tp 2, sp", 2, GPT_BLOCK_NAIVE + "--tp 2 --sp", GPT_BLOCK_NAIVE},
    {"GPT block, pp 2, 1f1b", 2, GPT_BLOCK + "--pp 2 --grad-acc 2", GPT_BLOCK + "--grad-acc 2"},
    {"GPT block, naive attention, zero 3, dp 2, full recompute", 2,
     GPT_BLOCK_NAIVE + "--zero 3 --dp 2 --recompute full",
     GPT_BLOCK_NAIVE + "--grad-acc 2 --recompute full"},
    {"GPT block, dp 2 x tp 2, selective recompute", 4,
     GPT_BLOCK + "--dp 2 --tp 2 --recompute selective",
     GPT_BLOCK + "--grad-acc 2 --recompute selective"},
    {"GPT block, cp 2, zigzag, ring", 2, GPT_BLOCK + "--cp 2", GPT_BLOCK},
    {"GPT block, cp 2 x tp 2, sp, all-gather", 4,
     GPT_BLOCK + "--cp 2 --tp 2 --sp --cp-comm allgather", GPT_BLOCK},
    {"5D: dp 2 (ep 2) x pp 2 x cp 2 x tp 2, sp, zero 1 (16 ranks)", 16,
     "--experts 4 --top-k 2 --dp 2 --ep 2 --pp 2 --cp 2 --tp 2 --sp --zero 1 --grad-acc 2",
     "--experts 4 --top-k 2 --grad-acc 4"},
};

// Small enough that a run takes about a second on one core; clipping is active (norms ~1).
inline const std::string COMMON =
    "--d-model 32 --layers 2 --heads 4 --kv-heads 2 --ffn 64 --seq 16 --mbs 2 --steps 3 "
    "--warmup 1 --grad-clip 0.5 --val-every 0 --val-seqs 4 --comm-timeout 60 ";

// A run of COMMON + flags under --dtype bf16 on `ranks` ranks (0: one process): its log, the
// first step's gradients (--save-grads) and what it printed. Requires exit code 0.
struct Bf16Run {
  std::vector<nlohmann::json> log;
  std::map<std::string, std::vector<float>> grads;
  std::string output;
};
inline Bf16Run run_bf16(const std::string& flags, int ranks, const std::string& dir) {
  std::filesystem::create_directories(dir);
  RunResult r = run_train(COMMON + flags + " --dtype bf16 --log-json " + dir + "/log.jsonl" +
                              " --save-grads " + dir + "/grads.safetensors",
                          ranks);
  INFO(flags << "\n" << r.output);
  REQUIRE(r.code == 0);
  return {read_json_lines(dir + "/log.jsonl"), read_f32_tensors(dir + "/grads.safetensors"),
          r.output};
}
