#include "daemon/comm/cuda_devices.h"

#ifdef RANNC_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

namespace rannc {
namespace comm {

int CudaDeviceCount() {
#ifdef RANNC_WITH_NCCL
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear it: no driver or no device is not an error here
    return 0;
  }
  return count;
#else
  return 0;
#endif
}

uint64_t CudaDeviceMemory(int index) {
#ifdef RANNC_WITH_NCCL
  cudaDeviceProp props;
  if (cudaGetDeviceProperties(&props, index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return props.totalGlobalMem;
#else
  (void)index;
  return 0;
#endif
}

bool CudaHostRegister(void* ptr, uint64_t bytes) {
#ifdef RANNC_WITH_NCCL
  if (cudaHostRegister(ptr, bytes, cudaHostRegisterDefault) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
#else
  (void)ptr;
  (void)bytes;
  return false;
#endif
}

void CudaHostUnregister(void* ptr) {
#ifdef RANNC_WITH_NCCL
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
#else
  (void)ptr;
#endif
}

}  // namespace comm
}  // namespace rannc
