// cuda_case.cuh: the start of every test that needs CUDA. It runs where CUDA starts; on a
// machine without a GPU it ends with a visible "SKIP:" warning, which tools/run_tests.sh counts
// as skipped, never as passed; where nvidia-smi lists a GPU that CUDA cannot start (a driver
// that does not load, say) it fails, since that machine was meant to run it. Include after
// catch.hpp.
#pragma once
#include <cstdlib>
#include <string>

#include "runtime/core.cuh"

inline bool nvidia_smi_lists_a_gpu() {
  return std::system("nvidia-smi -L >/dev/null 2>&1") == 0;
}

// True when CUDA starts on this rank; otherwise a failure or a SKIP as above, and false.
inline bool cuda_case_ready(bool cuda_started, const std::string& why) {
  if (cuda_started) return true;
  if (nvidia_smi_lists_a_gpu())
    FAIL_CHECK("nvidia-smi lists a GPU, but CUDA does not start here: " << why);
  else
    WARN("SKIP: no CUDA device (" << why << ")");
  return false;
}
inline bool cuda_case_ready() {
  std::string why;
  bool started = cuda_available(&why);
  return cuda_case_ready(started, why);
}

#define SKIP_WITHOUT_CUDA() \
  if (!cuda_case_ready()) return
