// The message of the UsageError a call throws, for tests of what bad input is told.
#pragma once
#include <string>

#include "runtime/core.cuh"

// The message of the UsageError `f` throws ("" when it throws none).
template <typename F>
std::string usage_error_of(F f) {
  try {
    f();
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}
