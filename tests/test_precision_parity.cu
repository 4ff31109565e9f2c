// The parity matrix in bf16 (Playbook §Mixed precision training): every layout of
// parity_rows.cuh, run with --dtype bf16, against the single-process bf16 run.
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <map>

#include "launch.cuh"
#include "parity_rows.cuh"

namespace fs = std::filesystem;

// Why the fp32 matrix's 1e-5 cannot hold, and what does: a layout changes which partial sums
// are rounded to bf16 (a row-parallel layer rounds each rank's partial output before the
// all-reduce, as Megatron's bf16 layers do; the reductions' order flips the rare value sitting
// on a rounding boundary), so single activations and gradients differ by an ulp or a few,
// 2^-8 of their size each. What each check allows, with what it measured over all rows:
// - the loss, every step: 2^-10 relative (measured at most 8e-5): a mean over thousands of
//   token losses whose errors have both signs;
// - the gradient norm: 2^-9 at step 1 (measured 5e-4), where the weights are the same; 2^-7
//   after (measured 2.6e-3), because AdamW's m/sqrt(v) is scale-free: an element whose
//   gradient is near zero turns an ulp of difference into a large share of an update, and
//   the next steps see weights that differ;
// - step 1's gradients: 2^-5 of the tensor's scale (measured 1.2e-2, k_proj under one kv head
//   shared by both tp ranks: a sum of the two ranks' bf16-rounded contributions).
// A missing or doubled contribution (a rank's tokens, a replicated weight's share) moves the
// loss or the norm by 1% or more and a gradient by half its scale.
TEST_CASE("every layout in bf16 trains like the single-process bf16 run", "[parity]") {
  static std::map<std::string, Bf16Run> references;
  std::string dir = make_temp_dir();
  for (const ParityRow& row : PARITY_ROWS) {
    SECTION(row.name) {
      if (!references.count(row.reference))
        references[row.reference] = run_bf16(row.reference, 0, dir + "/ref");
      const Bf16Run& ref = references[row.reference];
      Bf16Run got = run_bf16(row.layout, row.ranks, dir + "/layout");
      REQUIRE(got.log.size() == ref.log.size());
      for (size_t i = 0; i < ref.log.size(); i++) {
        INFO(row.name << ", step " << i + 1);
        REQUIRE(got.log[i]["loss"].get<double>() ==
                Approx(ref.log[i]["loss"].get<double>()).epsilon(std::ldexp(1.0, -10)));
        REQUIRE(got.log[i]["grad_norm"].get<double>() ==
                Approx(ref.log[i]["grad_norm"].get<double>())
                    .epsilon(std::ldexp(1.0, i == 0 ? -9 : -7)));
      }
      REQUIRE(got.grads.size() == ref.grads.size());
      for (auto& [name, g_ref] : ref.grads) {
        REQUIRE(got.grads.count(name));
        const std::vector<float>& g = got.grads.at(name);
        REQUIRE(g.size() == g_ref.size());
        double scale = 0, worst = 0;
        for (float v : g_ref) scale = std::max(scale, (double)std::fabs(v));
        for (size_t i = 0; i < g.size(); i++)
          worst = std::max(worst, (double)std::fabs(g[i] - g_ref[i]));
        INFO(row.name << ", gradient " << name << ": max diff " << worst << " of scale " << scale);
        REQUIRE(worst <= std::ldexp(scale, -5));
      }
    }
  }
  fs::remove_all(dir);
}
