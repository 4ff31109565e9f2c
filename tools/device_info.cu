// device_info: what this machine offers picoscale, printed before anything runs on it: the CUDA
// driver and runtime, each device (name, memory, compute capability, stream-ordered pool
// support), the cuBLAS and NCCL versions, and the file each CUDA library was loaded from.
// Exit code 0 with a usable device, 1 without (the reason is printed either way).
//   device_info --hold SECONDS: then keeps a CUDA context open that long (or until killed), so
//   that on a machine whose driver is not kept loaded (persistence mode off) the many short
//   processes of a check do not each pay for bringing the GPU up again.
#include <link.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "runtime/core.cuh"

// Every shared object of this process whose path names a library picoscale depends on.
static int print_library(struct dl_phdr_info* info, size_t, void*) {
  std::string path = info->dlpi_name ? info->dlpi_name : "";
  for (const char* name :
       {"libcudart", "libcublas", "libnccl", "libcuda.", "libmpi", "libopenblas"})
    if (path.find(name) != std::string::npos) printf("  %s\n", path.c_str());
  return 0;
}

int main(int argc, char** argv) {
  double hold_s = 0;
  if (argc == 3 && strcmp(argv[1], "--hold") == 0) hold_s = atof(argv[2]);
  if (argc != 1 && !(hold_s > 0)) {
    fprintf(stderr, "usage: device_info [--hold SECONDS] (SECONDS > 0)\n");
    return 2;
  }
  std::string why;
  bool usable = cuda_available(&why);
  printf("%s", describe_cuda_devices().c_str());
  int nccl = 0, cublas_major = 0, cublas_minor = 0, cublas_patch = 0;
  ncclGetVersion(&nccl);  // a link-time symbol: no device needed
  cublasGetProperty(MAJOR_VERSION, &cublas_major);
  cublasGetProperty(MINOR_VERSION, &cublas_minor);
  cublasGetProperty(PATCH_LEVEL, &cublas_patch);
  printf("cuBLAS %d.%d.%d, NCCL %d.%d.%d\n", cublas_major, cublas_minor, cublas_patch, nccl / 10000,
         nccl / 100 % 100, nccl % 100);
  printf("libraries loaded from:\n");
  dl_iterate_phdr(print_library, nullptr);
  if (usable && hold_s > 0) {
    CUDA_CHECK(cudaFree(nullptr));  // the context, made now
    printf("holding device 0 for %g s\n", hold_s);
    fflush(stdout);
    std::this_thread::sleep_for(std::chrono::duration<double>(hold_s));
  }
  return usable ? 0 : 1;
}
