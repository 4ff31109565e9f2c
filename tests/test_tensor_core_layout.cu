// test_tensor_core_layout.cu: the lane addresses the bf16 kernels give ldmatrix
// (kernels/tensor_core.cuh) deliver exactly the fragments mma.sync m16n8k16 expects, checked on
// the CPU with ldmatrix emulated as the PTX ISA defines it; and the padded rows of shared memory
// make every ldmatrix conflict-free. Without a GPU this is how the fragment plumbing of the
// matmul ladder's last rung and of FlashAttention-2's kernels is checked.
#include <catch2/catch.hpp>
#include <functional>
#include <set>
#include <utility>
#include <vector>

#include "kernels/tensor_core.cuh"

namespace {

// A shared-memory matrix of `cols` columns whose element (r, c) is the number 1000 r + c: a
// register pair then says which two elements it holds.
int element(int r, int c) {
  return 1000 * r + c;
}
using Pair = std::pair<int, int>;  // the two bf16 of one 32-bit register: (low half, high half)
using Fragments = std::vector<std::vector<Pair>>;  // [lane][register]

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 (PTX ISA): lanes 8i .. 8i+7 give the
// addresses of the 8 rows (8 consecutive elements each) of tile i; register i of lane 4g + t
// receives row g, elements 2t and 2t+1 of tile i, or with .trans column g, rows 2t and 2t+1.
Fragments ldmatrix_x4(const std::function<MatrixPosition(int lane)>& row_of, bool trans) {
  Fragments f(32, std::vector<Pair>(4));
  for (int i = 0; i < 4; i++) {
    MatrixPosition rows[8];
    for (int r = 0; r < 8; r++) rows[r] = row_of(8 * i + r);
    auto tile = [&](int r, int c) { return element(rows[r].row, rows[r].col + c); };
    for (int lane = 0; lane < 32; lane++) {
      const int g = lane / 4, t = lane % 4;
      f[lane][i] = trans ? Pair{tile(2 * t, g), tile(2 * t + 1, g)}
                         : Pair{tile(g, 2 * t), tile(g, 2 * t + 1)};
    }
  }
  return f;
}

// The fragments mma.sync.m16n8k16 takes (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane
// 4g + t, of matrices given as functions of (row, column):
//   A 16 x 16: (g, 2t), (g + 8, 2t), (g, 2t + 8), (g + 8, 2t + 8), each with its right neighbour
//   B 16 x 8:  (2t, g), (2t + 8, g), each with the element below it
std::vector<Pair> a_fragment(const std::function<int(int, int)>& A, int lane) {
  const int g = lane / 4, t = lane % 4;
  std::vector<Pair> f;
  for (auto [r, c] : {Pair{g, 2 * t}, {g + 8, 2 * t}, {g, 2 * t + 8}, {g + 8, 2 * t + 8}})
    f.push_back({A(r, c), A(r, c + 1)});
  return f;
}
std::vector<Pair> b_fragment(const std::function<int(int, int)>& B, int lane) {
  const int g = lane / 4, t = lane % 4;
  return {{B(2 * t, g), B(2 * t + 1, g)}, {B(2 * t + 8, g), B(2 * t + 9, g)}};
}

const int kOffsets[][2] = {{0, 0}, {16, 32}, {48, 8}, {112, 96}};

}  // namespace

TEST_CASE("ldmatrix at a_fragment_row gives mma's A fragment of a row-major tile",
          "[tensor_core]") {
  for (const auto& o : kOffsets) {
    const int m0 = o[0], k0 = o[1];
    INFO("tile at (" << m0 << ", " << k0 << ")");
    Fragments got =
        ldmatrix_x4([&](int lane) { return a_fragment_row(m0, k0, lane); }, /*trans=*/false);
    for (int lane = 0; lane < 32; lane++)  // A[m][k] stored as s[m][k]
      REQUIRE(got[lane] == a_fragment([&](int r, int c) { return element(m0 + r, k0 + c); }, lane));
  }
}

TEST_CASE("ldmatrix.trans at a_fragment_transposed_row gives the A fragment of a stored transpose",
          "[tensor_core]") {
  for (const auto& o : kOffsets) {
    const int m0 = o[0], k0 = o[1];
    INFO("tile at (" << m0 << ", " << k0 << ")");
    Fragments got = ldmatrix_x4([&](int lane) { return a_fragment_transposed_row(m0, k0, lane); },
                                /*trans=*/true);
    for (int lane = 0; lane < 32; lane++)  // A[m][k] stored as s[k][m] (dS^T)
      REQUIRE(got[lane] == a_fragment([&](int r, int c) { return element(k0 + c, m0 + r); }, lane));
  }
}

TEST_CASE("ldmatrix at b_fragments_of_transpose_row gives two B fragments of X^T (K in Q K^T)",
          "[tensor_core]") {
  for (const auto& o : kOffsets) {
    const int k0 = o[0], n0 = o[1];
    INFO("tiles at (" << k0 << ", " << n0 << ")");
    Fragments got = ldmatrix_x4(
        [&](int lane) { return b_fragments_of_transpose_row(k0, n0, lane); }, /*trans=*/false);
    for (int lane = 0; lane < 32; lane++)
      for (int half = 0; half < 2; half++) {  // B[k][n] = X[n][k], X stored as s[n][k]
        std::vector<Pair> want =
            b_fragment([&](int r, int c) { return element(n0 + 8 * half + c, k0 + r); }, lane);
        REQUIRE(got[lane][2 * half] == want[0]);
        REQUIRE(got[lane][2 * half + 1] == want[1]);
      }
  }
}

TEST_CASE("ldmatrix.trans at b_fragments_row gives two B fragments of a row-major B (V in P V)",
          "[tensor_core]") {
  for (const auto& o : kOffsets) {
    const int k0 = o[0], n0 = o[1];
    INFO("tiles at (" << k0 << ", " << n0 << ")");
    Fragments got =
        ldmatrix_x4([&](int lane) { return b_fragments_row(k0, n0, lane); }, /*trans=*/true);
    for (int lane = 0; lane < 32; lane++)
      for (int half = 0; half < 2; half++) {  // B[k][n] stored as s[k][n]
        std::vector<Pair> want =
            b_fragment([&](int r, int c) { return element(k0 + r, n0 + 8 * half + c); }, lane);
        REQUIRE(got[lane][2 * half] == want[0]);
        REQUIRE(got[lane][2 * half + 1] == want[1]);
      }
  }
}

TEST_CASE("rows padded by 16 bytes make every ldmatrix of the kernels conflict-free",
          "[tensor_core]") {
  // The leading dimensions in use: hd + 8 (hd 16, 32, 64, 128), the backward's dS^T (32 or 64
  // queries + 8), the ladder's A and B tiles (32 + 8, 128 + 8).
  using RowOf = std::function<MatrixPosition(int, int, int)>;
  const RowOf loaders[] = {a_fragment_row, a_fragment_transposed_row, b_fragments_of_transpose_row,
                           b_fragments_row};
  for (int ld : {24, 40, 72, 136})
    for (const RowOf& row_of : loaders)
      for (const auto& o : kOffsets) {
        const int x0 = o[0], y0 = o[1];
        // One tile (8 rows of 16 bytes) is one shared-memory wavefront: its rows must fall in 8
        // different groups of four 4-byte banks, and start 16-byte aligned.
        for (int i = 0; i < 4; i++) {
          std::set<int> groups;
          for (int r = 0; r < 8; r++) {
            const MatrixPosition p = row_of(x0, y0, 8 * i + r);
            const int byte = 2 * (p.row * ld + p.col);
            REQUIRE(byte % 16 == 0);
            groups.insert(byte % 128 / 16);
          }
          INFO("ld " << ld << ", tile " << i);
          REQUIRE(groups.size() == 8);
        }
      }
}
