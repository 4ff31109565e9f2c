// The Catch2 (v2) test runner's main; the tests themselves are in tests/test_*.cu.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
