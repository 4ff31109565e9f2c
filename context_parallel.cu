// context_parallel.cu: context parallelism (Playbook §7; Liu et al.'s ring attention, Megatron's
// context_parallel). Each rank of the cp group holds T/cp tokens of every sequence through the
// whole model: norms, projections and the MLP act per token and need nothing from the others;
// attention needs every earlier key and value, which travel around the ring.
// The one idea: attention over the whole sequence is a merge of attention over key blocks
// (the log-sum-exp weighs each partial result), so a rank can attend to one block while the
// next is on its way; with the sequence cut zig-zag, every rank does the same causal work.
// Guide: docs/context-parallel.md (the code in reading order, the reports that show it).
#include <cmath>

#include "context_parallel.cuh"
#include "runtime/dtype.cuh"
#include "runtime/ops.cuh"
#include "runtime/options.cuh"
#include "runtime/report.cuh"

static const std::vector<Choice<CpComm>> kCpComms = {{"ring", CpComm::Ring},
                                                     {"allgather", CpComm::AllGather}};

// ----------------------------------------------------------------------------
// Which tokens a rank holds (Playbook §7.3): each split cuts the sequence into cp x `chunks`
// equal chunks and gives rank r its pieces. A new split is a function and a row.

namespace {
// contiguous: rank r holds [r T/cp, (r+1) T/cp); the last rank does the most causal work.
std::vector<CpPiece> contiguous(int T, int cp, int r) {
  return {{r * (T / cp), T / cp}};
}
// zig-zag: chunks r and 2cp - 1 - r of 2cp, the same causal work on every rank.
std::vector<CpPiece> zigzag(int T, int cp, int r) {
  int c = T / (2 * cp);
  return {{r * c, c}, {(2 * cp - 1 - r) * c, c}};
}
struct SplitRow {
  CpBalance id;
  const char* name;  // --cp-balance
  int chunks;        // per rank
  std::vector<CpPiece> (*pieces)(int T, int cp, int rank);
};
const SplitRow kSplits[] = {{CpBalance::Zigzag, "zigzag", 2, zigzag},
                            {CpBalance::Contiguous, "contiguous", 1, contiguous}};
const SplitRow& split(CpBalance b) {
  return table_row(kSplits, b);
}
}  // namespace

CpBalance parse_cp_balance(const std::string& flag) {
  return parse_row("--cp-balance", flag, kSplits);
}
CpComm parse_cp_comm(const std::string& flag) {
  return parse_choice("--cp-comm", flag, kCpComms);
}
const char* cp_balance_name(CpBalance b) {
  return split(b).name;
}
const char* cp_comm_name(CpComm c) {
  return choice_name(kCpComms, c);
}

void add_context_parallel_flags(CLI::App& app, ContextParallelOptions& o) {
  CLI::App& g = flag_group(app, "Context parallelism (Playbook §7)");
  g.add_option("--cp", o.cp, "context-parallel ranks, >= 1")->capture_default_str();
  std::string splits;
  for (const SplitRow& r : kSplits) splits += std::string(splits.empty() ? "" : "|") + r.name;
  add_typed(g, "--cp-balance", &o.cp_balance, parse_cp_balance, cp_balance_name(o.cp_balance),
            "how the sequence is split (§7.3): " + splits);
  add_typed(g, "--cp-comm", &o.cp_comm, parse_cp_comm, cp_comm_name(o.cp_comm),
            "keys and values: ring|allgather");
}

std::vector<CpPiece> cp_pieces(CpBalance b, int T, int cp, int rank) {
  return cp == 1 ? contiguous(T, 1, 0) : split(b).pieces(T, cp, rank);
}

void validate_context_parallel(int seq, int cp, CpBalance b, bool flash, int tp, bool sp,
                               int sample) {
  check_positive(cp, "--cp");
  if (cp == 1) return;
  std::string flags = "--cp " + std::to_string(cp);
  int parts = split(b).chunks * cp;
  if (seq % parts)
    throw UsageError("--seq " + std::to_string(seq) + " with " + flags + " and --cp-balance " +
                     cp_balance_name(b) + ": the sequence is cut in " + std::to_string(parts) +
                     " equal chunks; pick a --seq divisible by " + std::to_string(parts));
  if (sp && (seq / cp) % tp)
    throw UsageError("--sp with " + flags + " and --tp " + std::to_string(tp) + ": each rank's " +
                     std::to_string(seq / cp) +
                     " tokens are split again over tp; pick a --seq "
                     "divisible by cp x tp");
  if (!flash)
    throw UsageError("--attention naive with " + flags +
                     ": ring attention merges FlashAttention's partial results by their "
                     "log-sum-exp; use --attention flash");
  if (sample > 0)
    throw UsageError("--sample with " + flags +
                     ": each rank holds only part of every sequence; "
                     "sample from the saved checkpoint in one process (--load DIR --sample N)");
}

std::vector<int64_t> ContextParallel::local_tokens(int B, int T) const {
  std::vector<int64_t> local;
  for (const CpPiece& p : cp_pieces(balance, T, size(), rank()))
    for (int b = 0; b < B; b++)
      for (int t = 0; t < p.length; t++) local.push_back((int64_t)b * T + p.start + t);
  return local;
}

std::vector<int32_t> ContextParallel::positions(int B, int T) const {
  std::vector<int32_t> pos;
  for (int64_t i : local_tokens(B, T)) pos.push_back((int32_t)(i % T));
  return pos;
}
std::vector<int32_t> ContextParallel::sequences(int B, int T) const {
  std::vector<int32_t> seq;
  for (int64_t i : local_tokens(B, T)) seq.push_back((int32_t)(i / T));
  return seq;
}

std::vector<int32_t> select_context_tokens(const ContextParallel& cp, const int32_t* tokens, int B,
                                           int T, int micro_batches) {
  std::vector<int64_t> order = cp.local_tokens(B, T);
  std::vector<int32_t> local;
  for (int m = 0; m < micro_batches; m++)
    for (int64_t i : order) local.push_back(tokens[(int64_t)m * B * T + i]);
  return local;
}

// ----------------------------------------------------------------------------
// Blocks: one piece of queries against one piece of keys

namespace {

// The rows of one piece in a local tensor [B*Tl, H, hd] (piece-major): B x length rows.
Tensor piece_rows(const Tensor& t, const std::vector<CpPiece>& pieces, int p, int B) {
  int64_t row = 0, width = t.numel() / t.size(0);  // H * hd
  for (int i = 0; i < p; i++) row += (int64_t)B * pieces[i].length;
  int64_t rows = (int64_t)B * pieces[p].length;
  return t.view(row * width, {rows, t.size(1), t.size(2)});
}
// The log-sum-exp of one query piece: [B, Hq, length], pieces one after the other.
Tensor piece_lse(const Tensor& lse, const std::vector<CpPiece>& pieces, int p, int B, int Hq) {
  int64_t at = 0;
  for (int i = 0; i < p; i++) at += (int64_t)B * Hq * pieces[i].length;
  return lse.view(at, {B, Hq, pieces[p].length});
}

// Query positions [q0, q0 + nq) against keys [k0, k0 + nk), causal: the pairs that see each
// other (per sequence and head), and whether there are none (the block is skipped).
int64_t causal_pairs(const CpPiece& q, const CpPiece& k) {
  int64_t pairs = 0;
  for (int i = 0; i < q.length; i++)
    pairs += std::min<int64_t>(k.length, std::max<int64_t>(0, q.start + i - k.start + 1));
  return pairs;
}

struct Shapes {
  int B, T, Hq, Hkv, hd;
  AttentionDraw drop;  // sequence b's number at row b x the first piece's length (piece-major)
  AttentionBlock block(const CpPiece& q, const CpPiece& k) const {
    return {B, q.length, k.length, Hq, Hkv, hd, q.start, k.start, true, drop};
  }
};
AttentionDraw draw(const AttentionDropout* dropout, const std::vector<CpPiece>& mine) {
  return dropout ? dropout->draw(mine[0].length) : AttentionDraw{};
}

// A rank's keys and values travel as one buffer [2, N, Hkv, hd] in the blocks' input format
// (bf16 on tensor cores: half the bytes); their gradients as another, in fp32.
Tensor kv_part(const Tensor& kv, int which) {
  int64_t half = kv.numel() / 2;
  return kv.view(which * half, {half});
}
Tensor as_rows(const Tensor& flat, const Tensor& like) {
  return flat.reshape(like.shape);
}
// One step of the ring: a buffer to the next rank, and one from the previous.
P2P to_next(Group& g, const Tensor& t) {
  return {true, t.ptr, t.numel(), g.next(), nullptr, t.dtype};
}
P2P from_prev(Group& g, const Tensor& t) {
  return {false, t.ptr, t.numel(), g.prev(), nullptr, t.dtype};
}

}  // namespace

void context_attention_forward(const Context& ctx, const ContextParallel& cp, const Tensor& out,
                               const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                               int B, int T, int Hq, int Hkv, int hd, CpWork* work,
                               const AttentionDropout* dropout) {
  double t0 = now_seconds();
  Comm& comm = *cp.comm;
  Group& g = comm.cp;
  int P = g.size, r = g.rank;
  std::vector<CpPiece> mine = cp_pieces(cp.balance, T, P, r);
  Shapes s{B, T, Hq, Hkv, hd, draw(dropout, mine)};
  zero_(ctx, out);
  fill_(ctx, lse, -INFINITY);  // nothing seen yet: the first merge takes the first block as it is
  Tensor kv = empty(ctx, {2 * k.numel()}, Mem::Workspace, k.dtype);  // [2, N, Hkv, hd]
  copy_(ctx, kv_part(kv, 0), k.reshape({k.numel()}));
  copy_(ctx, kv_part(kv, 1), v.reshape({v.numel()}));
  // Attend this rank's queries to the keys and values `owner` holds, merging block by block.
  auto attend = [&](const Tensor& theirs, int owner) {
    Tensor k_all = as_rows(kv_part(theirs, 0), k), v_all = as_rows(kv_part(theirs, 1), v);
    std::vector<CpPiece> keys = cp_pieces(cp.balance, T, P, owner);
    for (int qp = 0; qp < (int)mine.size(); qp++)
      for (int kp = 0; kp < (int)keys.size(); kp++) {
        int64_t pairs = causal_pairs(mine[qp], keys[kp]);
        if (pairs == 0) continue;  // every key in the future of every query
        AttentionBlock a = s.block(mine[qp], keys[kp]);
        Tensor o = empty(ctx, {(int64_t)B * a.Tq, Hq, hd}, Mem::Workspace, q.dtype);
        Tensor l = empty(ctx, {B, Hq, a.Tq}, Mem::Workspace);
        flash_attention_forward(ctx, o, l, piece_rows(q, mine, qp, B),
                                piece_rows(k_all, keys, kp, B), piece_rows(v_all, keys, kp, B), a);
        attention_lse_merge(ctx, piece_rows(out, mine, qp, B), piece_lse(lse, mine, qp, B, Hq), o,
                            l, a);
        if (work) work->blocks++, work->pairs += pairs;
      }
  };
  if (cp.mode == CpComm::AllGather) {  // every rank's keys and values at once: P x the memory
    Tensor all = empty(ctx, {P * kv.numel()}, Mem::Workspace, kv.dtype);
    all_gather_async(comm, g, ctx, kv.ptr, all.ptr, kv.dtype, kv.numel()).wait();
    for (int owner = 0; owner < P; owner++)
      attend(all.view(owner * kv.numel(), {kv.numel()}), owner);
  } else {  // Playbook §7.2: step s attends to rank (r - s)'s block while the next one arrives
    Tensor held = kv;
    for (int step = 0; step < P; step++) {
      Tensor next;
      Handle arriving;
      if (step < P - 1) {
        next = empty(ctx, {kv.numel()}, Mem::Workspace, kv.dtype);
        arriving = send_recv_async(comm, g, ctx, {to_next(g, held), from_prev(g, next)});
      }
      attend(held, (r - step + P) % P);
      if (step < P - 1) arriving.wait(), held = next;
    }
  }
  if (work) work->seconds += now_seconds() - t0;
}

void context_attention_backward(const Context& ctx, const ContextParallel& cp, const Tensor& dq,
                                const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                const Tensor& out, const Tensor& lse, const Tensor& q,
                                const Tensor& k, const Tensor& v, int B, int T, int Hq, int Hkv,
                                int hd, const AttentionDropout* dropout) {
  Comm& comm = *cp.comm;
  Group& g = comm.cp;
  int P = g.size, r = g.rank;
  std::vector<CpPiece> mine = cp_pieces(cp.balance, T, P, r);
  Shapes s{B, T, Hq, Hkv, hd, draw(dropout, mine)};
  // D = rowsum(dO * O) of the merged output, once per query piece, shared by every block.
  Tensor D = empty(ctx, lse.shape, Mem::Workspace);
  for (int qp = 0; qp < (int)mine.size(); qp++)
    attention_out_dot_dout(ctx, piece_lse(D, mine, qp, B, Hq), piece_rows(dout, mine, qp, B),
                           piece_rows(out, mine, qp, B), s.block(mine[qp], mine[qp]));
  zero_(ctx, dq);
  const int64_t n = 2 * k.numel();                         // keys and values: [2, N, Hkv, hd]
  Tensor held = empty(ctx, {n}, Mem::Workspace, k.dtype);  // in the blocks' input format
  copy_(ctx, kv_part(held, 0), k.reshape({k.numel()}));
  copy_(ctx, kv_part(held, 1), v.reshape({v.numel()}));
  // dq (+=) of this rank's queries and the gradients (+=) of `owner`'s keys and values.
  auto attend = [&](const Tensor& kv, const Tensor& dkv, int owner) {
    Tensor k_all = as_rows(kv_part(kv, 0), k), v_all = as_rows(kv_part(kv, 1), v);
    Tensor dk_all = as_rows(kv_part(dkv, 0), dk), dv_all = as_rows(kv_part(dkv, 1), dv);
    std::vector<CpPiece> keys = cp_pieces(cp.balance, T, P, owner);
    for (int qp = 0; qp < (int)mine.size(); qp++)
      for (int kp = 0; kp < (int)keys.size(); kp++) {
        if (causal_pairs(mine[qp], keys[kp]) == 0) continue;
        flash_attention_backward(ctx, piece_rows(dq, mine, qp, B), piece_rows(dk_all, keys, kp, B),
                                 piece_rows(dv_all, keys, kp, B), piece_rows(dout, mine, qp, B),
                                 piece_rows(q, mine, qp, B), piece_rows(k_all, keys, kp, B),
                                 piece_rows(v_all, keys, kp, B), piece_lse(lse, mine, qp, B, Hq),
                                 piece_lse(D, mine, qp, B, Hq), s.block(mine[qp], keys[kp]));
      }
  };
  Tensor mine_dkv;  // [2, N, Hkv, hd]: the gradients of this rank's keys and values
  if (cp.mode == CpComm::AllGather) {
    Tensor all = empty(ctx, {P * n}, Mem::Workspace, held.dtype);
    all_gather_async(comm, g, ctx, held.ptr, all.ptr, held.dtype, n).wait();
    Tensor dall = zeros(ctx, {P * n}, Mem::Workspace);
    for (int owner = 0; owner < P; owner++)
      attend(all.view(owner * n, {n}), dall.view(owner * n, {n}), owner);
    mine_dkv = empty(ctx, {n}, Mem::Workspace);
    reduce_scatter(comm, g, ctx, dall.f32(), mine_dkv.f32(), n, ReduceOp::Sum);
  } else {
    // Keys, values and their gradient accumulators travel together; after the last block the
    // accumulators take one more step, which brings every rank's back to it.
    Tensor held_d = zeros(ctx, {n}, Mem::Workspace);  // the gradients' sums, fp32
    for (int step = 0; step < P; step++) {
      attend(held, held_d, (r - step + P) % P);
      Tensor next_d = empty(ctx, {n}, Mem::Workspace);
      if (step == P - 1) {
        send_recv(comm, g, ctx, {to_next(g, held_d), from_prev(g, next_d)});
        mine_dkv = next_d;
        break;
      }
      Tensor next = empty(ctx, {n}, Mem::Workspace, held.dtype);
      send_recv(comm, g, ctx,
                {to_next(g, held), to_next(g, held_d), from_prev(g, next), from_prev(g, next_d)});
      held = next, held_d = next_d;
    }
  }
  copy_(ctx, dk.reshape({dk.numel()}), kv_part(mine_dkv, 0));
  copy_(ctx, dv.reshape({dv.numel()}), kv_part(mine_dkv, 1));
}

// ----------------------------------------------------------------------------
// The seam

std::vector<int32_t> ContextParallelAttention::positions(int B, int T) const {
  return cp_.positions(B, T * cp_.size());
}
std::vector<int32_t> ContextParallelAttention::token_sequences(int B, int T) const {
  return cp_.sequences(B, T * cp_.size());
}

void ContextParallelAttention::forward(const Context& ctx, const AttentionShape& s,
                                       const Tensor& out, AttentionSaved& saved, const Tensor& q,
                                       const Tensor& k, const Tensor& v) const {
  saved.lse = empty(ctx, {s.B, s.Hq, s.T}, Mem::Activations);
  Tensor o = attention_output_fp32(ctx, out);      // the ring merges in fp32 (flash_attention.cuh)
  const DType in = attention_input_dtype(ctx, s);  // the blocks' (bf16 on tensor cores)
  context_attention_forward(ctx, cp_, o, saved.lse, cast_to(ctx, q, in), cast_to(ctx, k, in),
                            cast_to(ctx, v, in), s.B, s.T * cp_.size(), s.Hq, s.Hkv, s.hd, work,
                            s.dropout);
  attention_store_output(ctx, out, o);
}

void ContextParallelAttention::backward(const Context& ctx, const AttentionShape& s,
                                        const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                        const Tensor& dout, const Tensor& out,
                                        AttentionSaved& saved, const Tensor& q, const Tensor& k,
                                        const Tensor& v) const {
  const DType in = attention_input_dtype(ctx, s);
  context_attention_backward(ctx, cp_, dq, dk, dv, cast_to(ctx, dout, in), cast_to(ctx, out, in),
                             saved.lse, cast_to(ctx, q, in), cast_to(ctx, k, in),
                             cast_to(ctx, v, in), s.B, s.T * cp_.size(), s.Hq, s.Hkv, s.hd,
                             s.dropout);
}

std::unique_ptr<StepMeter> ContextParallelAttention::meter(Comm& comm) const {
  struct Balance : StepMeter {
    Balance(Comm& comm, const ContextParallelAttention& ring) : comm(comm), ring(ring) {}
    void begin(StepPart p, int64_t) override {
      if (p == StepPart::Schedule) ring.work = &work;  // training steps only, not validation
    }
    void end(StepPart p) override {
      if (p == StepPart::Schedule) ring.work = nullptr;
      if (p == StepPart::Step) steps++;
    }
    void report(Report r) override {
      if (r != Report::Balance) return;
      const ContextParallel& cp = ring.layout();
      print_balance_report(
          comm, std::string(cp_balance_name(cp.balance)) + " split, " + cp_comm_name(cp.mode),
          work.blocks, work.pairs, work.seconds, steps);
    }
    bool answers(Report r) const override { return r == Report::Balance; }
    Comm& comm;
    const ContextParallelAttention& ring;
    CpWork work;
    int64_t steps = 0;
  };
  return std::make_unique<Balance>(comm, *this);
}

std::shared_ptr<const AttentionCore> make_attention(Comm& comm, const ContextParallelOptions& o,
                                                    AttentionKind local) {
  if (o.cp == 1) return local_attention(local);
  return std::make_shared<ContextParallelAttention>(
      ContextParallel{&comm, o.cp_balance, o.cp_comm});
}

std::string describe_context_parallel(const ContextParallelOptions& o, int seq) {
  if (o.cp == 1) return "";
  return std::string(cp_balance_name(o.cp_balance)) + " split, " + cp_comm_name(o.cp_comm) + ", " +
         std::to_string(seq / o.cp) + " tokens per rank";
}
