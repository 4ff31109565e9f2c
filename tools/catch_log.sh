# catch_log.sh: reading a Catch2 (v2) console log, for tools/gpu_check.sh and tools/run_tests.sh
# (sourced, not run; tools/test_gpu_check.sh tests it on logs of its own).

# A case that does not apply on a machine ends with WARN("SKIP: why") (tests/cuda_case.cuh),
# which Catch2 prints as a message line of its own, indented by two spaces: "  SKIP: why". Only
# those lines are skipped tests; a library's output that merely contains the word (an NCCL
# warning "... skipping ...", say) is not.
SKIP_LINE='^  SKIP: '

# catch_result LOG: from Catch2's last summary line, "All tests passed (A assertions in N test
# cases)" or "test cases: N | P passed | F failed", sets CASES_OK (1: all passed) and CASES_TEXT;
# SKIPS is the number of SKIP lines, FIRST_SKIP the first one's text (or empty).
catch_result() {
  local log=$1 line
  line=$(grep -E "^(All tests passed|test cases:)" "$log" | tail -1)
  CASES_TEXT=${line:-no Catch2 summary (crashed?)}
  CASES_TEXT=$(echo "$CASES_TEXT" | sed 's/  */ /g')
  CASES_OK=0
  [[ $line == All\ tests\ passed* ]] && CASES_OK=1
  SKIPS=$(grep -c -- "$SKIP_LINE" "$log")
  FIRST_SKIP=$(grep -m1 -- "$SKIP_LINE" "$log" | sed 's/^ *//' | cut -c1-120)
}
