// nvtx_record.cpp: an NVTX tool for the tests, loaded as Nsight Systems' is (NVTX_INJECTION64_PATH
// names it): every range pushed ("push NAME") and popped ("pop") in the process is written, in
// order, to the file that PICOSCALE_NVTX_LOG names, so a test can hold ./train's NVTX ranges to
// its --trace spans. Host-only C++; built by the Makefile beside the unit tests.
#include <nvtx3/nvToolsExt.h>

#include <cstdio>
#include <cstdlib>

static FILE* g_log = nullptr;

static int record_push(const char* name) {
  if (g_log) fprintf(g_log, "push %s\n", name ? name : "");
  return 0;
}
static int record_pop() {
  if (g_log) fprintf(g_log, "pop\n");
  return 0;
}

// NVTX's loader calls this once, at the process's first NVTX call: the tool writes its own
// functions into the core module's table (NVTX's injection interface, nvtxDetail/nvtxInit.h).
extern "C" int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get_export_table) {
  const char* path = getenv("PICOSCALE_NVTX_LOG");
  if (!path || !(g_log = fopen(path, "w"))) return 0;
  setvbuf(g_log, nullptr, _IOLBF, 0);  // a line at a time: nothing lost if the process aborts
  auto callbacks = (const NvtxExportTableCallbacks*)get_export_table(NVTX_ETID_CALLBACKS);
  NvtxFunctionTable table = nullptr;
  unsigned int size = 0;
  if (!callbacks || !callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &table, &size) ||
      size <= NVTX_CBID_CORE_RangePop)
    return 0;
  *table[NVTX_CBID_CORE_RangePushA] = (NvtxFunctionPointer)record_push;
  *table[NVTX_CBID_CORE_RangePop] = (NvtxFunctionPointer)record_pop;
  return 1;
}
