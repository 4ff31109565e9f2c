// The Catch2 (v2) test runner's main; the tests themselves are in tests/test_*.cu.
// One option of our own, --sync-launches: a debugging aid that makes every CUDA context
// synchronise after each kernel launch, so a kernel that faults is named in the failure
// (the GPU check's first pass uses it). A command-line option rather than an environment
// variable, as train's --sync-launches is.
#define CATCH_CONFIG_RUNNER
// The console reporter indents a failing case's or section's name past its first ": ", and at
// its default width of 80 aborts (TextFlow's `m_width > m_indent`) when that lies beyond the
// width: the names here read as claims and run longer, so the report is 256 columns wide.
#define CATCH_CONFIG_CONSOLE_WIDTH 256
#include <catch2/catch.hpp>

void set_sync_launches(bool on);  // core.cuh (this file is compiled without CUDA headers)

int main(int argc, char* argv[]) {
  Catch::Session session;
  bool sync_launches = false;
  session.cli(session.cli() | Catch::clara::Opt(sync_launches)["--sync-launches"](
                                  "synchronise after every CUDA kernel launch (debugging; slow)"));
  int rc = session.applyCommandLine(argc, argv);
  if (rc != 0) return rc;
  set_sync_launches(sync_launches);
  return session.run();
}
