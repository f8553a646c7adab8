#pragma once

#include <cuda_runtime_api.h>

// harpe: the upstream macros evaluate EXPR and drop its result, so a launch that fails (e.g. "no kernel image
// is available" on a GPU the build has no code for) leaves O unwritten and the caller reads garbage. Here
// the first error of a run_mha call is kept in harpe_flash_error (defined in flash_api.cu, one per host
// thread), which run_mha returns and src/lib.rs turns into an error.
extern thread_local cudaError_t harpe_flash_error;

#define C10_CUDA_CHECK(EXPR)                                        \
  do {                                                              \
    const cudaError_t __err = EXPR;                                 \
    if (__err != cudaSuccess && harpe_flash_error == cudaSuccess)   \
      harpe_flash_error = __err;                                    \
  } while (0)

#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
